"""LoRA adapters and control vectors on the tiny target (pyspec.core.adapters)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from pyspec import Batch, Context, Model
from pyspec.core.adapters import LoraAdapter, load_control_vector
from pyspec.errors import AdapterError, ClosedError
from pyspec.testing import derived

PROMPT = "The quick brown fox jumps over the lazy dog"


def last_logits(ctx: Context, tokens: list[int]) -> np.ndarray:
    """Decode ``tokens`` from an empty memory; the last token's logits (a copy)."""
    ctx.memory.clear()
    batch = Batch(len(tokens), 0, 1)
    batch.add_sequence(tokens, 0, 0)
    ctx.decode(batch)
    return ctx.get_logits_ith(-1).copy()


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> derived.TinyLora:
    return derived.make_lora(tmp_path_factory.mktemp("lora") / "lora.gguf")


@pytest.fixture
def ctx(target_model):
    with Context(target_model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=1, embeddings=True,
                 n_threads=1, n_threads_batch=1) as c:
        yield c


@pytest.fixture
def tokens(target_model) -> list[int]:
    return target_model.vocab.tokenize(PROMPT)


def test_adapter_metadata(target_model, lora):
    with LoraAdapter(target_model, lora.path) as adapter:
        assert adapter.meta("general.type") == "adapter"
        assert adapter.meta("adapter.type") == "lora"
        assert float(adapter.meta("adapter.lora.alpha")) == lora.alpha
        assert adapter.meta("no.such.key") is None
        meta = adapter.meta_dict()
        assert meta["general.architecture"] == "llama" and meta["general.name"] == "pyspec-tiny-lora"
        assert adapter.alora_invocation_tokens == []


def test_alora_invocation_tokens_are_read(target_model, tmp_path):
    path = derived.make_lora(tmp_path / "alora.gguf", alora_invocation_tokens=[12, 345, 6789]).path
    with LoraAdapter(target_model, path) as adapter:
        assert adapter.alora_invocation_tokens == [12, 345, 6789]


def test_lora_adds_scale_alpha_over_rank_times_b_a_h_to_the_logits(target_model, lora, ctx, tokens):
    base = last_logits(ctx, tokens)
    h = ctx.get_embeddings_ith(-1).astype(np.float64)  # the normed hidden state the head reads
    with LoraAdapter(target_model, lora.path) as adapter:
        for scale in (1.0, -0.5):
            ctx.set_lora_adapters({adapter: scale})
            assert ctx.lora_adapters == {adapter: scale}
            got = last_logits(ctx, tokens)
            name = "output.weight"
            delta = scale * lora.alpha / lora.rank * (lora.b[name] @ (lora.a[name] @ h))
            np.testing.assert_allclose(got - base, delta, rtol=1e-4, atol=2e-4)
            assert np.abs(delta).max() > 0.5  # a real change, not noise
        ctx.set_lora_adapters({adapter: 0.0})  # scale 0: as if not applied
        assert ctx.lora_adapters == {}
        np.testing.assert_array_equal(last_logits(ctx, tokens), base)
        ctx.set_lora_adapters([(adapter, 1.0)])
        ctx.clear_lora_adapters()
        np.testing.assert_array_equal(last_logits(ctx, tokens), base)


def test_an_adapter_on_a_layer_weight_changes_the_hidden_state(target_model, ctx, tokens, tmp_path):
    path = derived.make_lora(tmp_path / "ffn.gguf", targets=("blk.3.ffn_down.weight",)).path
    base = last_logits(ctx, tokens)
    h0 = ctx.get_embeddings_ith(-1).copy()
    with LoraAdapter(target_model, path) as adapter:
        ctx.set_lora_adapters({adapter: 2.0})
        changed = last_logits(ctx, tokens)
        assert not np.allclose(ctx.get_embeddings_ith(-1), h0)
        assert not np.allclose(changed, base)


def test_closing_an_applied_adapter_waits_for_the_context(target_model, lora, ctx, tokens):
    adapter = LoraAdapter(target_model, lora.path)
    ctx.set_lora_adapters({adapter: 1.0})
    with_lora = last_logits(ctx, tokens)
    adapter.close()  # the context still points at its tensors: the free waits
    assert adapter.closed
    np.testing.assert_array_equal(last_logits(ctx, tokens), with_lora)
    with pytest.raises(ClosedError):
        ctx.set_lora_adapters({adapter: 1.0})
    ctx.clear_lora_adapters()  # now it is freed
    del adapter
    gc.collect()
    assert last_logits(ctx, tokens).shape == with_lora.shape


def test_an_adapter_keeps_its_model_alive(target_path, lora, tokens):
    model = Model(target_path)
    adapter = LoraAdapter(model, lora.path)
    model.close()  # llama.cpp would free the adapter with the model: the free waits for it
    assert model.closed and adapter.meta("adapter.type") == "lora"
    adapter.close()


def test_adapters_are_refused_for_another_model(draft_model, lora, ctx):
    # same architecture, so llama.cpp loads it; but this context runs the target
    with LoraAdapter(draft_model, lora.path) as adapter, pytest.raises(AdapterError, match="another model"):
        ctx.set_lora_adapters({adapter: 1.0})


def _bad_lora(path, case: str):
    z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    if case == "arch":
        return derived.make_lora(path, arch="qwen2").path
    extra = {
        "unknown tensor": [("blk.9.attn_q.weight.lora_a", z(4, 64)), ("blk.9.attn_q.weight.lora_b", z(64, 4))],
        "shape": [("output.weight.lora_a", z(4, 32)), ("output.weight.lora_b", z(32000, 4))],
        "half pair": [("output.weight.lora_a", z(4, 64))],
        "suffix": [("output.weight.lora_c", z(4, 64))],
    }[case]
    return derived.make_lora(path, targets=(), extra_tensors=extra).path


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("arch", "model arch and LoRA arch mismatch"),
        ("unknown tensor", "does not exist in base model"),
        ("shape", "incorrect shape"),
        ("half pair", "missing one component"),
        ("suffix", "unexpected suffix"),
    ],
)
def test_bad_adapter_files_raise_with_llama_cpps_reason(target_model, tmp_path, case, reason):
    with pytest.raises(AdapterError, match=reason):
        LoraAdapter(target_model, _bad_lora(tmp_path / "bad.gguf", case))


def test_not_an_adapter_file_raises(target_model, target_path, tmp_path):
    with pytest.raises(AdapterError, match=r"expect general\.type to be 'adapter'"):
        LoraAdapter(target_model, target_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(AdapterError, match="not a GGUF"):
        LoraAdapter(target_model, junk)
    with pytest.raises(FileNotFoundError):
        LoraAdapter(target_model, tmp_path / "missing.gguf")


def test_bad_scales_are_refused(target_model, lora, ctx):
    with LoraAdapter(target_model, lora.path) as adapter:
        for scales in ({adapter: float("nan")}, {adapter: "1"}, [(adapter, 1.0), (adapter, 2.0)], [adapter]):
            with pytest.raises((ValueError, TypeError)):
                ctx.set_lora_adapters(scales)
        assert ctx.lora_adapters == {}


# --- control vectors ------------------------------------------------------------


def test_a_zero_control_vector_changes_nothing_and_clearing_restores(target_model, ctx, tokens):
    base = last_logits(ctx, tokens)
    ctx.set_control_vector({layer: np.zeros(target_model.n_embd) for layer in (1, 2, 3)})
    np.testing.assert_array_equal(last_logits(ctx, tokens), base)
    rng = np.random.default_rng(3)
    ctx.set_control_vector({2: rng.standard_normal(target_model.n_embd)})
    assert not np.allclose(last_logits(ctx, tokens), base)
    ctx.clear_control_vector()
    np.testing.assert_array_equal(last_logits(ctx, tokens), base)


def test_a_strong_control_vector_on_the_last_layer_steers_every_prompt_alike(target_model, ctx):
    # after the last layer the residual stream is h + v; with |v| >> |h| the normed state is v's
    # direction whatever the prompt, so two unrelated prompts give (nearly) the same logits
    a = target_model.vocab.tokenize("Once upon a time")
    b = target_model.vocab.tokenize("import numpy as np")
    cos = lambda x, y: float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))  # noqa: E731
    assert cos(last_logits(ctx, a), last_logits(ctx, b)) < 0.9
    v = np.random.default_rng(5).standard_normal(target_model.n_embd) * 1e4
    last = target_model.n_layer - 1
    ctx.set_control_vector({last: v})
    assert cos(last_logits(ctx, a), last_logits(ctx, b)) > 0.999
    # the layer range bounds where vectors apply: exclude the last layer and the effect is gone
    ctx.set_control_vector({last: v}, il_start=1, il_end=last - 1)
    assert cos(last_logits(ctx, a), last_logits(ctx, b)) < 0.9


def test_control_vector_files_load_with_strength(tmp_path, target_model, ctx, tokens):
    rng = np.random.default_rng(9)
    dirs = {1: rng.standard_normal(target_model.n_embd).astype(np.float32),
            3: rng.standard_normal(target_model.n_embd).astype(np.float32)}
    path = derived.make_control_vector(tmp_path / "cv.gguf", dirs)
    loaded = load_control_vector(path, strength=0.5)
    assert sorted(loaded) == [1, 3]
    for layer in dirs:
        np.testing.assert_allclose(loaded[layer], 0.5 * dirs[layer], rtol=1e-6)
    ctx.set_control_vector(loaded)
    from_file = last_logits(ctx, tokens)
    ctx.set_control_vector({k: 0.5 * v for k, v in dirs.items()})
    np.testing.assert_array_equal(last_logits(ctx, tokens), from_file)


def test_bad_control_vectors_are_refused(target_model, ctx, tmp_path):
    n = target_model.n_embd
    for directions in ({0: np.zeros(n)}, {target_model.n_layer: np.zeros(n)}, {1: np.zeros(n + 1)},
                       {1: np.full(n, np.nan)}, {"1": np.zeros(n)}):
        with pytest.raises((ValueError, TypeError)):
            ctx.set_control_vector(directions)
    with pytest.raises(ValueError, match="layer range"):
        ctx.set_control_vector({1: np.zeros(n)}, il_start=2, il_end=1)
    bad = derived.make_control_vector(tmp_path / "bad.gguf", {})
    assert load_control_vector(bad) == {}
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(AdapterError, match="cannot read the control vector"):
        load_control_vector(junk)
