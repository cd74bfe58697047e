"""Device selection from Python: listing, n_gpu_layers, split_mode, main_gpu, tensor_split, the draft elsewhere.

The tests marked by ``ACCELERATORS`` run on each local GPU-API device this build
sees: Vulkan (Mesa's lavapipe under scripts/vulkan_check.sh) or CUDA (under
scripts/gpu_check.sh); on a CPU-only build they skip, saying so. The RPC
devices are covered in test_rpc.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pyspec import Batch, Context, Model
from pyspec.common.params import CommonParamsSampling
from pyspec.common.params import CommonSamplerType as S
from pyspec.core.backend import Device, default_offload_devices, devices, find_device, local_devices
from pyspec.errors import SnapshotSplitError
from pyspec.ffi import ext, llama
from pyspec.generation.contexts import load_models, open_contexts, parse_types, spec_params
from pyspec.generation.driver import generate, greedy_sampling
from pyspec.testing import models as tm

ACCELERATORS = [d.name for d in local_devices() if d.type in ("GPU", "IGPU")]
on_accelerator = pytest.mark.parametrize(
    "accel",
    ACCELERATORS
    or [pytest.param(None, marks=pytest.mark.skip(reason="no GPU-API device in this build (CPU only): "
                                                         "scripts/vulkan_check.sh runs these on lavapipe, "
                                                         "scripts/gpu_check.sh on a CUDA GPU"))],
)


def tiny(types: list) -> dict[str, Any]:
    """load_models' model= and draft= for the tiny models of the types."""
    target, draft = tm.tiny_model_paths(types)
    return {"model": target, "draft": draft}


def _ctx(model: Model, n_ctx: int, n_batch: int) -> Context:
    # one thread: two threads spinning at a barrier stall for whole time slices on a loaded 2-core machine
    return Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=1, n_threads_batch=1)


def _greedy(ctx: Context, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy decoding; the tokens, and the logits of the prompt's last position."""
    ctx.memory.clear()
    b = Batch(len(prompt) + 1, 0, 1)
    for i, t in enumerate(prompt):
        b.add(t, i, 0, i == len(prompt) - 1)
    ctx.decode(b)
    first = ctx.get_logits_ith(-1).copy()
    out, pos = [], len(prompt)
    for _ in range(n):
        tok = int(np.argmax(ctx.get_logits_ith(-1)))
        out.append(tok)
        b.clear()
        b.add(tok, pos, 0, True)
        ctx.decode(b)
        pos += 1
    return out, first


# --- listing ------------------------------------------------------------------------


def test_devices_have_a_unique_name_a_type_a_backend_and_memory():
    devs = devices()
    assert [d.index for d in devs] == list(range(len(devs)))
    assert len({d.name for d in devs}) == len(devs)
    cpu = [d for d in devs if d.type == "CPU"]
    assert len(cpu) == 1 and cpu[0].backend == "CPU" and cpu[0].endpoint is None
    for d in devs:
        assert d.type in ("CPU", "GPU", "IGPU", "ACCEL") and d.backend and d.description
        if d.reachable:
            assert 0 < d.memory_total and 0 <= d.memory_free <= d.memory_total
        else:  # an rpc-server (of an earlier test) that no longer answers
            assert d.endpoint is not None and d.memory_total == d.memory_free == 0


def test_find_device_takes_an_index_a_name_or_a_device():
    cpu = next(d for d in devices() if d.type == "CPU")
    assert find_device(cpu.index) == find_device(cpu.name) == find_device(cpu)
    with pytest.raises(ValueError, match="no device 'Nope0'; the devices are 0: "):
        find_device("Nope0")
    with pytest.raises(ValueError, match="no device 99"):
        find_device(99)
    with pytest.raises(TypeError):
        find_device(1.5)  # type: ignore[arg-type]


def test_default_offload_devices_are_the_local_gpus_llama_cpp_picks():
    local = local_devices()
    default = default_offload_devices()
    assert all(d.endpoint is None for d in default)
    gpus = [d.name for d in local if d.type == "GPU"]
    igpus = [d.name for d in local if d.type == "IGPU"]
    # every GPU (one per device id), else the first integrated GPU, never the CPU
    assert [d.name for d in default] == (gpus if gpus else igpus[:1])
    with Model(tm.make_target(), vocab_only=True) as m:
        assert [d.name for d in m.devices] == [d.name for d in default]


# --- parameters are checked before llama.cpp sees them -----------------------------------


def test_the_cpu_is_not_an_offload_device():
    cpu = next(d for d in devices() if d.type == "CPU")
    with pytest.raises(ValueError, match="is the CPU: devices lists offload devices"):
        Model(tm.make_target(), devices=[cpu.name])


@pytest.mark.parametrize("bad", [-2, 1.5, True, "all"])
def test_n_gpu_layers_is_minus_one_or_a_count(bad):
    with pytest.raises(ValueError, match="n_gpu_layers"):
        Model(tm.make_target(), n_gpu_layers=bad)


@pytest.mark.parametrize("bad", [[-1.0], [float("nan")], [1.0] * 40])
def test_tensor_split_needs_one_finite_share_per_offload_device(bad):
    with pytest.raises(ValueError, match="tensor_split"):
        Model(tm.make_target(), tensor_split=bad)


def test_devices_is_a_list_and_names_each_device_once():
    with pytest.raises(TypeError, match="list of devices"):
        Model(tm.make_target(), devices="CPU")
    with pytest.raises(ValueError, match="split_mode"):
        Model(tm.make_target(), split_mode="diagonal")


def test_a_model_with_no_offload_device_runs_on_the_cpu_in_every_split_mode():
    path = tm.make_target()
    outs = []
    placements: list[dict[str, Any]] = [{"devices": []}, {"devices": [], "split_mode": "none", "main_gpu": 0},
                                        {"n_gpu_layers": 0}]
    for kw in placements:
        with Model(path, **kw) as m, _ctx(m, 128, 32) as c:
            if "devices" in kw:
                assert m.devices == []
            outs.append(_greedy(c, [1, 2, 3, 4], 6)[0])
    assert outs[0] == outs[1] == outs[2]


# --- accelerators (Vulkan on lavapipe, CUDA) -------------------------------------------------


@on_accelerator
def test_an_accelerator_is_listed_with_memory_and_type(accel):
    d = find_device(accel)
    assert d.type in ("GPU", "IGPU") and d.memory_total > 0 and d.backend in ("Vulkan", "CUDA", "Metal", "HIP", "SYCL")


@on_accelerator
@pytest.mark.parametrize("n_gpu_layers", [-1, 1])
def test_greedy_decoding_on_an_accelerator_equals_the_cpu(accel, n_gpu_layers):
    path = tm.make_target()
    prompt = list(range(3, 40))
    with Model(path, devices=[]) as m, _ctx(m, 256, 64) as c:
        want, want_logits = _greedy(c, prompt, 16)
    with Model(path, devices=[accel], n_gpu_layers=n_gpu_layers) as m, _ctx(m, 256, 64) as c:
        assert [d.name for d in m.devices] == [accel]
        got, got_logits = _greedy(c, prompt, 16)
    assert got == want
    # not bit-equal: ggml-vulkan's matrix shaders take the activations in f16 (on lavapipe the
    # logits, of magnitude ~10, differ by at most 0.024, measured), and every GPU sums in another order
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=0.1)


@on_accelerator
def test_split_mode_none_and_main_gpu_place_the_model_on_one_accelerator(accel):
    path = tm.make_target()
    with Model(path, devices=[accel], split_mode="none", main_gpu=0) as m, _ctx(m, 128, 32) as c:
        assert len(_greedy(c, [5, 6, 7], 4)[0]) == 4
    with pytest.raises(ValueError, match="main_gpu 1 out of range"):
        Model(path, devices=[accel], split_mode="none", main_gpu=1)


@on_accelerator
@pytest.mark.parametrize(
    "types",
    ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple", "draft-eagle3",
     "draft-mtp"],
)
def test_the_driver_runs_each_type_on_the_accelerator_as_on_the_cpu(accel, types):
    ts = parse_types(types)
    runs = {}
    checkpoints = False  # how the accelerator's MTP target rolls back, for the CPU run to do the same
    for where, kw in (("accel", {"devices": [accel], "n_gpu_layers": -1}), ("cpu", {"devices": []})):
        with load_models(ts, **tiny(ts), use_extra_bufts=False, **kw) as ms:
            spec = spec_params(ts, n_max=4)
            with open_contexts(ms, spec, n_ctx=256, n_batch=64, n_threads=1, mtp_checkpoint=checkpoints) as cs:
                checkpoints = spec.need_n_rs_seq() > 0 and cs.ctx_tgt.n_rs_seq == 0  # SnapshotSplitError's fallback
                # fixed draft lengths: the cost-aware choice follows each device's measured costs
                res, stats = generate(cs.ctx_tgt, "the quick brown fox jumps", 32, spec=spec, adaptive_draft=False)
                runs[where] = (res.tokens, stats.n_drafted, stats.n_accepted)
    assert len(runs["accel"][0]) == 32
    assert runs["accel"] == runs["cpu"]


@on_accelerator
def test_backend_sampling_runs_on_the_accelerator(accel):
    """The chain samples in the graph on the device, and the port draws what the C++ sampler draws there.

    Not compared with the CPU backend: at temperature 0.8 a draw near a boundary follows the
    device's own logits (measured on lavapipe: another token from the 7th on)."""
    from pyspec.common import sampling as smp
    from pyspec.reference.sampling import RefSampler

    params = CommonParamsSampling(seed=99, temp=0.8, top_k=20, samplers=[S.TOP_K, S.TEMPERATURE], backend_sampling=True)
    outs = {}
    with Model(tm.make_target(), devices=[accel]) as m:
        for side in ("port", "cpp"):
            s: Any = smp.common_sampler_init(m, CommonParamsSampling(**vars(params))) if side == "port" else \
                RefSampler(m, CommonParamsSampling(**vars(params)))
            with _ctx(m, 128, 32) as c:
                assert llama.llama_set_sampler(c.ptr, 0, smp.common_sampler_get(s) if side == "port" else s.chain)
                b = Batch(32)
                toks, pos = [1, 450, 4996, 17354], 0
                out = []
                for _ in range(8):
                    b.clear()
                    for i, t in enumerate(toks):
                        b.add(t, pos + i, 0, i == len(toks) - 1)
                    pos += len(toks)
                    c.decode(b)
                    tok = c.get_sampled_token_ith(-1)  # sampled in the graph, on the device
                    got = smp.common_sampler_sample(s, c, -1) if side == "port" else s.sample(c, -1)
                    assert tok != -1 and got == tok
                    if side == "port":
                        smp.common_sampler_accept(s, tok, True)
                    else:
                        s.accept(tok, True)
                    out.append(tok)
                    toks = [tok]
                outs[side] = out
            s.close()
    assert outs["port"] == outs["cpp"]


@on_accelerator
def test_eagle3_and_mtp_staging_outputs_come_back_from_the_accelerator(accel):
    # EAGLE3 reads a target layer's input (the llama target); MTP reads the hidden state its
    # NextN head takes (the qwen35 model: a llama target has no NextN head, and its nextn rows
    # stay zero on every device)
    prompt = list(range(10, 30))
    outs: dict[str, dict[str, np.ndarray]] = {}
    for where, kw in (("cpu", {"devices": []}), ("accel", {"devices": [accel], "n_gpu_layers": -1})):
        got: dict[str, np.ndarray] = {}
        for key, path in (("layer_inp", tm.make_target()), ("nextn", tm.make_mtp())):
            with Model(path, **kw) as m, _ctx(m, 128, 64) as c:
                if key == "layer_inp":
                    c.set_embeddings_layer_inp(1, True)  # an EAGLE3 extract layer
                else:
                    c.set_embeddings_nextn(True, False)
                b = Batch(len(prompt))
                for i, t in enumerate(prompt):
                    b.add(t, i, 0, i == len(prompt) - 1)
                c.decode(b)
                if key == "layer_inp":
                    got[key] = c.get_embeddings_layer_inp(1, len(prompt)).copy()
                else:
                    got[key] = c.get_embeddings_nextn(len(prompt)).copy()
        outs[where] = got
    for k in ("layer_inp", "nextn"):
        assert np.isfinite(outs["accel"][k]).all() and outs["accel"][k].std() > 0
        np.testing.assert_allclose(outs["accel"][k], outs["cpu"][k], rtol=0, atol=0.1)  # f16 activations, as above


def test_recurrent_snapshots_run_on_the_cpu_in_one_piece():
    # the CPU runs the fused gated-delta-net op, so llama.cpp keeps it and snapshots work
    with Model(tm.make_mtp(), devices=[]) as m, Context(m, n_ctx=128, n_batch=32, n_rs_seq=4) as c:
        assert c.n_rs_seq == 4 and not ext.pyspec_context_gdn_split(c.ptr)


@on_accelerator
def test_recurrent_snapshots_are_refused_where_their_op_would_leave_the_device(accel):
    # the tiny qwen35 model's head size (16) is one that Vulkan's gated-delta-net shader lacks: llama.cpp
    # then turns the fused op off, but snapshots use it anyway, split to the CPU (heap corruption on lavapipe)
    with Model(tm.make_mtp(), devices=[accel], n_gpu_layers=-1, use_extra_bufts=False) as m:
        with Context(m, n_ctx=128, n_batch=32) as c:
            split = bool(ext.pyspec_context_gdn_split(c.ptr))
        if split:
            with pytest.raises(SnapshotSplitError, match="n_rs_seq=4"):
                Context(m, n_ctx=128, n_batch=32, n_rs_seq=4)
        else:
            with Context(m, n_ctx=128, n_batch=32, n_rs_seq=4) as c:
                assert c.n_rs_seq == 4
    ts = parse_types("draft-mtp")
    with load_models(ts, **tiny(ts), devices=[accel], n_gpu_layers=-1, use_extra_bufts=False) as ms:
        spec = spec_params(ts, n_max=4)
        with open_contexts(ms, spec, n_ctx=128, n_batch=32, n_threads=1) as cs:
            # the loader rolls back through checkpoints instead
            assert cs.ctx_tgt.n_rs_seq == (0 if split else spec.need_n_rs_seq())


def test_open_contexts_gives_its_context_keywords_to_both_contexts():
    """``context_kw`` (device_parity.py turns flash attention off for lavapipe through it)."""
    ts = parse_types("draft-simple")
    with load_models(ts, **tiny(ts)) as ms:
        spec = spec_params(ts, n_max=4)
        with open_contexts(ms, spec, n_ctx=128, n_batch=32, n_threads=1, context_kw={"n_outputs_max": 9}) as cs:
            assert cs.ctx_dft is not None
            assert cs.ctx_tgt.n_outputs_max == cs.ctx_dft.n_outputs_max == 9


# --- the draft on another device than the target ----------------------------------------------


def test_load_models_places_the_draft_apart_from_the_target():
    ts = parse_types("draft-simple")
    offload = default_offload_devices()
    with load_models(ts, **tiny(ts), draft_kw={"devices": []}) as ms:
        assert ms.draft is not None and ms.draft is not ms.target
        assert ms.draft.devices == [] and [d.name for d in ms.target.devices] == [d.name for d in offload]
    # draft-simple without a draft file: draft_kw loads the target file a second time, elsewhere
    with load_models(ts, model=tm.make_cyclic_target(), draft_kw={"devices": []}) as ms:
        assert ms.draft is not None and ms.draft.path == ms.target.path and ms.draft.devices == []
        spec = spec_params(ts, n_max=4)
        with open_contexts(ms, spec, n_ctx=256, n_batch=64, n_threads=1) as cs:
            assert cs.ctx_dft is not None and cs.ctx_dft.model is ms.draft
            res, _ = generate(cs.ctx_tgt, "the quick brown fox", 16, spec=spec, sampling=greedy_sampling())
            assert len(res.tokens) == 16


def test_device_objects_are_plain_values():
    d = devices()[0]
    assert isinstance(d, Device) and d == find_device(d.index)
