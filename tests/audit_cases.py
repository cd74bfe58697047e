"""One hostile call per row of docs/audit.toml: each reaches a llama.cpp GGML_ASSERT / GGML_ABORT /
throw / unchecked index (or a hang, or an unbounded allocation) unless pyspec's guard stops it.

tests/test_audit.py runs every case in a crash-safe worker (pyspec.testing.crashsafe): a guard
that regresses shows up as the signal or hang of that one case, named, not as a dead test run.
A case raises what the row's ``expect`` names; it returns only when the guard is missing.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from pyspec import Batch, Context, Model, SamplerChain
from pyspec.common import sampling as smp
from pyspec.common import speculative as sp
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative, CommonSamplerType
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.testing import models as tm

M: dict[str, Model] = {}
KW: dict[str, Any] = dict(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=1, n_threads_batch=1)
TMP = Path(tempfile.mkdtemp(prefix="pyspec-audit-"))


def setup() -> None:
    M["target"] = Model(tm.make_target())
    M["draft"] = Model(tm.make_draft())
    M["eagle3"] = Model(tm.make_eagle3())
    M["mtp"] = Model(tm.make_mtp())
    M["vocab_only"] = Model(tm.make_target(), vocab_only=True)


def ctx(**kw: Any) -> Context:
    return Context(M["target"], **{**KW, **kw})


def decoded(n: int = 3, all_logits: bool = False, **kw: Any) -> Context:
    c = ctx(**kw)
    b = Batch(n)
    b.add_sequence(list(range(10, 10 + n)), 0, 0)
    if all_logits:
        b.logits[:n] = 1
    c.decode(b)
    return c


def _write(name: str, data: bytes) -> str:
    p = TMP / name
    p.write_bytes(data)
    return str(p)


# --- model files --------------------------------------------------------------------


def gguf_repeated_token() -> Any:
    data = Path(tm.make_target()).read_bytes()
    entry = struct.pack("<Q", 6)
    assert data.count(entry + b"<0x0B>") == 1
    return Model(_write_bytes("repeat.gguf", data.replace(entry + b"<0x0B>", entry + b"<0x0A>")))


def gguf_empty_key() -> Any:
    # the first metadata key's length set to 0, its bytes then read as the type and value
    # (found by scripts/fuzz.py --atheris): gguf's parser asserts on an empty key
    data = bytearray(Path(tm.make_target()).read_bytes())
    data[24:32] = struct.pack("<Q", 0)
    return Model(_write_bytes("empty-key.gguf", bytes(data)))


def gguf_tokens_not_strings() -> Any:
    # a well-formed GGUF whose token list holds int32 (a list of the same length)
    gguf = tm.gguf_module()
    kv = []
    for key, value, vtype, sub_type in tm.llama_vocab_kv():
        if key == "tokenizer.ggml.tokens":
            value, sub_type = list(range(len(value))), gguf.GGUFValueType.INT32
        kv.append((key, value, vtype, sub_type))
    return Model(tm.write_llama(TMP / "ints.gguf", vocab_kv=kv))


def gguf_no_layers() -> Any:
    # block_count 0: llama.cpp GGML_ASSERTs the layer count while it reads the hyperparameters
    return Model(tm.write_llama(TMP / "no-layers.gguf", n_layer=0))


def gguf_experts_used_without_experts() -> Any:
    # two experts used per token in a model without experts (the 100,000-file gguf_doors run)
    gguf = tm.gguf_module()
    kv = [*tm.llama_vocab_kv(), ("llama.expert_used_count", 2, gguf.GGUFValueType.UINT32, None)]
    return Model(tm.write_llama(TMP / "experts-used.gguf", vocab_kv=kv))


def _write_bytes(name: str, data: bytes) -> str:
    return _write(name, data)


# --- context parameters -----------------------------------------------------------


def ctx_vocab_only_model() -> Any:
    return Context(M["vocab_only"], **KW)


def ctx_n_seq_max_above_n_batch() -> Any:
    return ctx(n_batch=4, n_ubatch=4, n_seq_max=8)


def ctx_n_batch_zero() -> Any:
    return ctx(n_batch=0, n_ubatch=8)


def ctx_n_seq_max_above_llama_max_seq() -> Any:
    return ctx(n_seq_max=1000, n_batch=1024, n_ctx=1024)


def ctx_n_outputs_max_below_n_seq_max() -> Any:
    return ctx(n_seq_max=4, n_outputs_max=2)


def speculative_state_for_billions_of_sequences() -> Any:
    # found by scripts/fuzz.py --atheris (api target): per-sequence state for 2^31 - 1 sequences
    from pyspec.common import speculative as sp
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.common.params import CommonSpeculativeType as T

    return sp.common_speculative_init(CommonParamsSpeculative(types=[T.NGRAM_MOD]), 2**31 - 1)


def sampler_infill_without_top_k() -> Any:
    # found by scripts/fuzz.py --atheris (params target): infill on all 32000 candidates does
    # 10^9 token_to_piece calls per token
    return SamplerChain().add_top_p(0.9).add_infill(M["target"].vocab)


def common_sampler_infill_on_the_whole_vocabulary() -> Any:
    from pyspec.common import sampling as smp
    from pyspec.common.params import CommonParamsSampling, CommonSamplerType

    return smp.common_sampler_init(M["target"], CommonParamsSampling(top_k=0, samplers=[CommonSamplerType.INFILL]))


def _model_with_a_long_piece() -> Model:
    # token 1000's text made 601 bytes: llama.cpp's infill sampler keeps pieces in 512-byte
    # buffers and "grows" them with resize(negative length), which throws through the C API
    if "long_piece" not in M:
        kv = []
        for key, value, vtype, sub_type in tm.llama_vocab_kv():
            if key == "tokenizer.ggml.tokens":
                value = list(value)
                value[1000] = "\u2581" + "x" * 600
            kv.append((key, value, vtype, sub_type))
        M["long_piece"] = Model(tm.write_llama(TMP / "long-piece.gguf", vocab_kv=kv))
    return M["long_piece"]


def sampler_infill_on_a_piece_longer_than_its_buffer() -> Any:
    return SamplerChain().add_top_k(40).add_infill(_model_with_a_long_piece().vocab)


def common_sampler_infill_on_a_piece_longer_than_its_buffer() -> Any:
    params = CommonParamsSampling(top_k=40, samplers=[CommonSamplerType.TOP_K, CommonSamplerType.INFILL])
    return smp.common_sampler_init(_model_with_a_long_piece(), params)


def ctx_n_rs_seq_beyond_the_graph_budget() -> Any:
    # found by the fuzzer (atheris, api target): 256 snapshots abort the tiny MTP model's graph
    return Context(M["mtp"], **{**KW, "n_rs_seq": 262})


def ctx_n_rs_seq_not_below_n_ubatch() -> Any:
    # two sequences of 9 tokens in ubatches of 4, each keeping its last 5 together: split_equal asserts
    c = Context(M["mtp"], **{**KW, "n_ubatch": 4, "n_seq_max": 2, "n_rs_seq": 4})
    b = Batch(32, 0, 2)
    for s in (0, 1):
        for i in range(9):
            b.add(1 + i, i, s, i == 8)
    c.decode(b)
    return c


def ctx_pooling_type_not_an_enum_value() -> Any:
    return ctx(pooling_type=77)


def ctx_attention_type_not_an_enum_value() -> Any:
    return ctx(attention_type=5)


def ctx_rope_scaling_not_an_enum_value() -> Any:
    return ctx(rope_scaling_type=9)


def ctx_n_ctx_beyond_memory() -> Any:
    return ctx(n_ctx=2**31)


def ctx_threads_out_of_range() -> Any:
    return ctx(n_threads=100000)


def ctx_samplers_not_chains() -> Any:
    return ctx(samplers={0: 5})


def ctx_samplers_seq_out_of_range() -> Any:
    return ctx(samplers={5: SamplerChain().add_greedy()})


# --- decode ------------------------------------------------------------------------


def decode_non_causal_batch_above_n_ubatch() -> Any:
    c = ctx(attention_type="non_causal", n_batch=32, n_ubatch=8)
    b = Batch(16)
    b.add_sequence(list(range(1, 17)), 0, 0)
    return c.decode(b)


def decode_outputs_above_n_outputs_max() -> Any:
    c = ctx(n_outputs_max=2)
    b = Batch(4)
    b.add_sequence([1, 2, 3, 4], 0, 0)
    b.logits[:4] = 1
    return c.decode(b)


def decode_batch_without_tokens_or_embeddings() -> Any:
    b = Batch(2, 0, tokens=False)
    b.add(0, 0, 0, True)
    return ctx().decode(b)


def decode_batch_above_n_batch() -> Any:
    b = Batch(40)
    b.add_sequence(list(range(1, 41)), 0, 0)
    return ctx().decode(b)


def decode_seq_id_out_of_range_with_backend_sampler() -> Any:
    c = ctx(n_seq_max=2)
    c.set_sampler(0, SamplerChain().add_greedy())
    b = Batch(2, 0, 2)
    b.add(1, 0, [0, 5], True)
    return c.decode(b)


def decode_batch_array_reassigned() -> Any:
    b = Batch(2)
    b.token = np.array([10**9, 0], np.int32)  # type: ignore[misc]
    return b


def decode_from_another_thread() -> Any:
    return _while_busy(lambda c: c.decode(_batch()))


def memory_edit_during_decode() -> Any:
    return _while_busy(lambda c: c.memory.seq_rm(0, 5, -1))


def sample_during_decode() -> Any:
    chain = SamplerChain().add_greedy()
    return _while_busy(lambda c: chain.sample(c, -1))


def close_during_decode() -> Any:
    return _while_busy(lambda c: c.close())


def _batch() -> Batch:
    b = Batch(32)
    b.add_sequence(list(range(100, 132)), 0, 0)
    b.logits[:] = 1
    return b


def _while_busy(call: Any) -> Any:
    """call(c) from this thread while another thread is inside llama.cpp on c (it holds the
    context's guard for the whole of call, as a decode does for its duration)."""
    c = ctx(n_batch=32, n_ubatch=32)
    c.decode(_batch())
    inside, done = threading.Event(), threading.Event()

    def busy() -> None:
        with c.held():
            inside.set()
            done.wait(60)

    th = threading.Thread(target=busy)
    th.start()
    inside.wait(60)
    try:
        return call(c)
    finally:
        done.set()
        th.join()


# --- outputs -----------------------------------------------------------------------


def logits_read_after_close() -> Any:
    c = decoded()
    row = c.get_logits_ith(-1)
    c.close()
    gc.collect()
    # the row is a copy: reading it is fine; the context itself then refuses
    assert np.isfinite(row).all()
    return c.get_logits_ith(-1)


def logits_read_after_reallocating_decode() -> Any:
    c = decoded(1)
    row = c.get_logits_ith(-1)
    before = row.copy()
    b = Batch(32)
    b.add_sequence(list(range(1, 33)), 1, 0)
    b.logits[:] = 1
    c.decode(b)  # more outputs than the buffer held: llama.cpp reallocates it
    np.testing.assert_array_equal(row, before)
    return c.get_logits_ith(40)


def _row_0_without_output() -> Context:
    """A context whose last decode gave batch index 0 no output row."""
    c = ctx()
    b = Batch(2)
    b.add(1, 0, 0, False)
    b.add(2, 1, 0, True)
    c.decode(b)
    return c


def logits_of_a_row_without_output() -> Any:
    return _row_0_without_output().get_logits_ith(0)


def embeddings_rank_pooling_length() -> Any:
    c = ctx(embeddings=True, pooling_type="rank")
    b = Batch(3)
    b.add_sequence([1, 2, 3], 0, 0)
    b.logits[:3] = 1
    c.decode(b)
    out = c.get_embeddings_seq(0)
    n_cls = int(__import__("pyspec.ffi", fromlist=["llama"]).llama.llama_model_n_cls_out(M["target"].ptr))
    if out.shape != (n_cls,):
        return f"wrong length {out.shape}"
    raise IndexError("rank pooling: one score per class (checked)")


def layer_inp_without_export() -> Any:
    return decoded().get_embeddings_layer_inp(1, 1)


def nextn_without_nextn() -> Any:
    return decoded().get_embeddings_nextn(3)


# --- copies, pickles, lifetimes ------------------------------------------------------


def copy_context() -> Any:
    return copy.copy(ctx())


def deepcopy_model() -> Any:
    return copy.deepcopy(M["target"])


def pickle_sampler_chain() -> Any:
    return pickle.dumps(SamplerChain().add_greedy())


def copy_batch() -> Any:
    return copy.copy(Batch(2))


def copy_common_sampler() -> Any:
    return copy.copy(smp.common_sampler_init(M["target"], greedy_sampling()))


def chain_freed_while_attached() -> Any:
    c = ctx()
    chain = SamplerChain().add_top_k(3).add_dist(1)
    c.set_sampler(0, chain)
    chain.close()
    del chain
    gc.collect()
    b = Batch(2)
    b.add(1, 0, 0, True)
    c.decode(b)  # the context kept the chain alive
    c.close()
    raise ValueError("the attached chain outlived its close() until the context let go (checked)")


def chain_given_at_creation_freed() -> Any:
    chain = SamplerChain().add_top_k(3).add_dist(1)
    c = ctx(samplers={0: chain})
    chain.close()
    del chain
    gc.collect()
    b = Batch(2)
    b.add(1, 0, 0, True)
    c.decode(b)
    raise ValueError("the creation-time chain outlived its close() (checked)")


def chain_on_two_contexts() -> Any:
    chain = SamplerChain().add_greedy()
    ctx().set_sampler(0, chain)
    return ctx().set_sampler(0, chain)


def chain_reserved_by_another_thread() -> Any:
    # the state another thread's set_sampler leaves between its check and its mark
    chain = SamplerChain().add_greedy()
    chain._reserve()
    return ctx().set_sampler(0, chain)


def threadpool_taken_by_another_context() -> Any:
    from pyspec.core import ThreadPool

    pool = ThreadPool(1, poll=0)
    a, b = ctx(), ctx()
    pool.take(a)  # what a's attach_threadpool does first, before it attaches
    return b.attach_threadpool(pool)


def chain_changed_while_attached() -> Any:
    chain = SamplerChain().add_top_k(3)
    ctx().set_sampler(0, chain)
    return chain.add_dist(1)


# --- samplers ----------------------------------------------------------------------


def chain_selects_nothing() -> Any:
    return SamplerChain().add_top_k(5).sample(decoded(), -1)


def chain_samples_row_without_logits() -> Any:
    return SamplerChain().add_greedy().sample(_row_0_without_output(), 0)


def chain_samples_before_any_decode() -> Any:
    return SamplerChain().add_greedy().sample(ctx(), 0)


def dry_window_huge() -> Any:
    return SamplerChain().add_dry(M["target"].vocab, 1.0, 1.75, 2, 2**31 - 1, ["\n"])


def penalties_window_huge() -> Any:
    return SamplerChain().add_penalties(M["target"].vocab.n_tokens, 2**31 - 1, 1.1, 0.0, 0.0)


def chain_apply_empty_candidates() -> Any:
    return SamplerChain().add_greedy().apply(np.zeros(0, np.float32))


def chain_accept_token_outside_vocab() -> Any:
    return SamplerChain().add_grammar(M["target"].vocab, 'root ::= "a"').accept(10**6)


def grammar_accept_disallowed_token() -> Any:
    return SamplerChain().add_grammar(M["target"].vocab, 'root ::= "a"').accept(5)


def grammar_accept_eog_too_early() -> Any:
    v = M["target"].vocab
    return SamplerChain().add_grammar(v, 'root ::= "abc"').accept(v.eos)


def grammar_deep_nesting() -> Any:
    return SamplerChain().add_grammar(M["target"].vocab, "root ::= " + "(" * 100000 + '"a"' + ")" * 100000)


def grammar_long_rule_chain() -> Any:
    n = 200000
    g = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'
    return SamplerChain().add_grammar(M["target"].vocab, g)


def grammar_rule_diamond() -> Any:
    g = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | r{i + 1} "b"\n' for i in range(40)) + 'r40 ::= "a"\n'
    return SamplerChain().add_grammar(M["target"].vocab, g)


def grammar_left_recursion_through_nullable_rule() -> Any:
    g = 'root ::= x\nx ::= y x "b"\ny ::= z\nz ::= "" | "a"\n'
    return SamplerChain().add_grammar(M["target"].vocab, g)


def grammar_stack_explosion() -> Any:
    # x_i ::= x_{i-1} x_{i-1} over a rule that may be empty: one advance yields 2^40 parse stacks
    g = 'root ::= x40\nx0 ::= "a" | ""\n' + "".join(f"x{i} ::= x{i - 1} x{i - 1}\n" for i in range(1, 41))
    return SamplerChain().add_grammar(M["target"].vocab, g)


def grammar_repetition_min_above_max() -> Any:
    return SamplerChain().add_grammar(M["target"].vocab, 'root ::= x{4,3}\nx ::= "b"')


def grammar_text_too_large() -> Any:
    return SamplerChain().add_grammar(M["target"].vocab, 'root ::= "a"\n' + "# " + "x" * (5 << 20))


# --- state -------------------------------------------------------------------------


def state_blob_huge_cell_count() -> Any:
    blob = struct.pack("<IiII", 0xAF143CD8, 0, 1, 0xFFFFFFFF) + b"\0" * 2000
    return ctx().state_seq_set(0, blob)


def state_on_device_flag() -> Any:
    return decoded().state_seq_get(0, 2)


def state_recurrent_two_cells() -> Any:
    c = Context(M["mtp"], **KW)
    b = Batch(3)
    b.add_sequence([1, 2, 3], 0, 0)
    c.decode(b)
    blob = bytearray(c.state_seq_get(0, 1))  # PARTIAL_ONLY: the recurrent section alone
    struct.pack_into("<I", blob, 8, 2)  # its cell count
    return c.state_seq_set(0, bytes(blob), 1)


def state_truncated() -> Any:
    c = decoded()
    blob = c.state_seq_get(0)
    return c.state_seq_set(0, blob[: len(blob) // 2])


# --- memory ------------------------------------------------------------------------


def memory_partial_copy_between_streams() -> Any:
    c = decoded(n_seq_max=2)
    return c.memory.seq_cp(0, 1, 0, 2)


def memory_shift_past_int32() -> Any:
    c = decoded()
    return c.memory.seq_add(0, 0, -1, 2**31 - 2)


def memory_divide_by_zero() -> Any:
    return decoded().memory.seq_div(0, 0, -1, 0)


# --- the port, the reference, the driver ------------------------------------------


def _spec(t: T, **kw: Any) -> CommonParamsSpeculative:
    p = CommonParamsSpeculative(types=[t])
    for k, v in kw.items():
        obj, attr = k.split("__")
        setattr(getattr(p, obj), attr, v)
    return p


def _generate(engine: str, p: CommonParamsSpeculative, sampling: CommonParamsSampling | None = None) -> Any:
    c = ctx(n_ctx=512)
    with SpeculativeGenerator(c, p, sampling or greedy_sampling(), backend=engine) as g:
        return g.generate(["def f(x): return f(x) + f(x)"], 8)[0].tokens


def ref_ngram_mod_n_match_zero() -> Any:
    return _generate("cpp", _spec(T.NGRAM_MOD, ngram_mod__n_match=0))


def ref_ngram_mod_n_max_negative() -> Any:
    return _generate("cpp", _spec(T.NGRAM_MOD, ngram_mod__n_max=-1))


def ref_ngram_map_size_negative() -> Any:
    return _generate("cpp", _spec(T.NGRAM_SIMPLE, ngram_simple__size_n=-1))


def ref_ngram_cache_corrupt() -> Any:
    path = _write("corrupt.cache", b"\x01" * 40)
    return _generate("cpp", _spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_static=path))


def ref_ngram_cache_negative_count() -> Any:
    path = _write("negative.cache", b"\x01" * 16 + b"\xff\xff\xff\xff")
    return _generate("cpp", _spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_dynamic=path))


def ref_ngram_cache_directory() -> Any:
    return _generate("cpp", _spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_static=str(TMP)))


def ref_sampler_grammar_accept_disallowed() -> Any:
    from pyspec.reference.sampling import RefSampler

    s = RefSampler(M["target"], CommonParamsSampling(grammar='root ::= "a"'))
    return s.accept(5, True)


def ref_sampler_dry_without_window() -> Any:
    from pyspec.reference.sampling import RefSampler

    p = CommonParamsSampling(dry_multiplier=1.0, dry_penalty_last_n=-7,
                             samplers=[CommonSamplerType.DRY, CommonSamplerType.TOP_K])
    return RefSampler(M["target"], p)


def ref_sampler_raw_c_dry_without_window() -> Any:
    """The C ABI checks the same as Python when called directly (no Python checks first)."""
    from pyspec.ffi import ffi, ref
    from pyspec.reference.sampling import sampling_params_struct

    p = CommonParamsSampling(dry_multiplier=1.0, dry_penalty_last_n=-7,
                             samplers=[CommonSamplerType.DRY, CommonSamplerType.TOP_K])
    s, _keep = sampling_params_struct(p)
    ptr = ref.pyspec_ref_sampler_init(ffi.cast("struct llama_model *", M["target"].ptr), s)
    if ptr != ffi.NULL:
        ref.pyspec_ref_sampler_free(ptr)
        return "accepted"
    raise ValueError(ffi.string(ref.pyspec_ref_last_error()).decode())


def port_sampler_grammar_accept_disallowed() -> Any:
    s = smp.common_sampler_init(M["target"], CommonParamsSampling(grammar='root ::= "a"'))
    return smp.common_sampler_accept(s, 5, True)


def port_sampler_n_prev_huge() -> Any:
    return smp.common_sampler_init(M["target"], CommonParamsSampling(n_prev=2**31 - 1))


def _map_spec() -> CommonParamsSpeculative:
    p = _spec(T.NGRAM_MAP_K)
    p.ngram_map_k.size_n, p.ngram_map_k.size_m, p.ngram_map_k.min_hits = 2, 4, 1
    return p


HISTORIES = ([3, 4, 5, 6] * 10, [3, 4, 5, 6] * 3)  # a long history, then a shorter one (still >= 2n + m)


def port_ngram_map_history_shrinks() -> Any:
    spec = sp.common_speculative_init(_map_spec(), 1)
    assert spec is not None
    dp = sp.common_speculative_get_draft_params(spec, 0)
    for hist in HISTORIES:
        dp.drafting, dp.n_max, dp.n_past, dp.id_last = True, 4, len(hist), 3
        dp.prompt, dp.result = hist, []
        sp.common_speculative_draft(spec)
    return "drafted"


def ref_ngram_map_history_shrinks() -> Any:
    from pyspec.common.speculative import DraftRequest
    from pyspec.reference.speculative import RefSpeculative

    spec = RefSpeculative(_map_spec(), 1)
    for hist in HISTORIES:
        spec.draft([DraftRequest(seq_id=0, n_max=4, n_past=len(hist), id_last=3, prompt=hist)])
    return "drafted"


def ref_accept_without_draft() -> Any:
    from pyspec.reference.speculative import RefSpeculative

    return RefSpeculative(_spec(T.NGRAM_SIMPLE), 1).accept(0, 1)


def _draft_simple() -> CommonParamsSpeculative:
    p = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    p.draft.ctx_tgt, p.draft.ctx_dft = ctx(), Context(M["draft"], **KW)
    return p


OOV = 10**6  # beyond the draft's vocabulary (and the target's)


def ref_process_token_outside_draft_vocab() -> Any:
    from pyspec.reference.speculative import RefSpeculative

    b = Batch(3)
    b.add_sequence([10, 11, OOV], 0, 0)
    return RefSpeculative(_draft_simple(), 1).process(b)


def ref_process_seq_outside_draft_context() -> Any:
    from pyspec.reference.speculative import RefSpeculative

    b = Batch(3)
    b.add_sequence([10, 11, 12], 0, 5)  # the draft context holds sequence 0 only
    return RefSpeculative(_draft_simple(), 1).process(b)


def port_process_seq_outside_draft_context() -> Any:
    from pyspec.common.common import CommonBatch

    p = _draft_simple()
    spec = sp.common_speculative_init(p, 1)
    cb = CommonBatch(p.draft.ctx_tgt)
    cb.add(10, 0, 5, True)
    return sp.common_speculative_process(spec, cb)


def ref_draft_id_last_outside_draft_vocab() -> Any:
    from pyspec.common.speculative import DraftRequest
    from pyspec.reference.speculative import RefSpeculative

    return RefSpeculative(_draft_simple(), 1).draft([DraftRequest(seq_id=0, n_max=4, pos0=3, id_last=OOV,
                                                                  prompt=[10, 11, 12])])


def port_process_token_outside_draft_vocab() -> Any:
    from pyspec.common.common import CommonBatch

    p = _draft_simple()
    spec = sp.common_speculative_init(p, 1)
    cb = CommonBatch(p.draft.ctx_tgt)
    cb.add(10, 0, 0, False)
    cb.add(OOV, 1, 0, True)
    return sp.common_speculative_process(spec, cb)


def port_draft_id_last_outside_draft_vocab() -> Any:
    spec = sp.common_speculative_init(_draft_simple(), 1)
    assert spec is not None
    dp = sp.common_speculative_get_draft_params(spec, 0)
    dp.drafting, dp.n_max, dp.pos0, dp.id_last, dp.prompt, dp.result = True, 4, 3, OOV, [10, 11, 12], []
    sp.common_speculative_draft(spec)
    return dp.result


def _block_draft_without_layers() -> CommonParamsSpeculative:
    p = CommonParamsSpeculative(types=[T.DRAFT_DFLASH])
    p.draft.ctx_tgt = p.draft.ctx_dft = ctx()  # a plain model: no target_layer_ids
    return p


def port_dflash_without_target_layers() -> Any:
    return sp.common_speculative_init(_block_draft_without_layers(), 1)


def ref_dflash_without_target_layers() -> Any:
    from pyspec.reference.speculative import RefSpeculative

    return RefSpeculative(_block_draft_without_layers(), 1)


def _eagle3_past_target(engine: str) -> Any:
    head = Model(tm.write_eagle3_with_layers(TMP / "e9.gguf", (1, 2, 9)))  # the tiny target has 4 layers
    c = ctx()
    p = CommonParamsSpeculative(types=[T.DRAFT_EAGLE3])
    p.draft.ctx_tgt, p.draft.ctx_dft = c, Context(head, **KW, ctx_other=c)
    if engine == "port":
        return sp.common_speculative_init(p, 1)
    from pyspec.reference.speculative import RefSpeculative

    return RefSpeculative(p, 1)


def port_eagle3_layer_past_target() -> Any:
    return _eagle3_past_target("port")


def ref_eagle3_layer_past_target() -> Any:
    return _eagle3_past_target("ref")


def port_sampler_copy_grammar_mismatch() -> Any:
    with smp.common_sampler_init(M["target"], CommonParamsSampling(grammar='root ::= "a"')) as a, \
            smp.common_sampler_init(M["target"], CommonParamsSampling()) as b:
        return smp.common_sampler_copy(a, b)


def ref_sampler_copy_other_structure() -> Any:
    from pyspec.reference.sampling import RefSampler

    with RefSampler(M["target"], CommonParamsSampling(grammar='root ::= "a"')) as a, \
            RefSampler(M["target"], CommonParamsSampling()) as b:
        return b.copy_from(a)


def loop_draft_token_outside_vocab() -> Any:
    from pyspec.common.ngram_cache import LLAMA_NGRAM_MAX
    from pyspec.generation.cpp_loop import cpp_generate

    c = ctx(n_ctx=512)
    prompt = "def f(x): return f(x) + f(x)"
    last = M["target"].vocab.tokenize(prompt)[-1]
    # a valid static cache: after the prompt's last token, whatever comes next, a token beyond the vocabulary
    n_vocab = M["target"].vocab.n_tokens
    rec = np.full((n_vocab, LLAMA_NGRAM_MAX + 3), -1, np.int32)
    rec[:, 0], rec[:, 1] = last, np.arange(n_vocab)
    rec[:, LLAMA_NGRAM_MAX:] = [1, 10**6, 1000]
    path = _write("oov.cache", rec.tobytes())
    p = _spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_static=path)
    return cpp_generate(c, [prompt], 8, p)


def eagle3_target_without_layer_export() -> Any:
    c = Context(M["mtp"], **KW)
    d = Context(M["eagle3"], **KW, ctx_other=c)
    p = CommonParamsSpeculative(types=[T.DRAFT_EAGLE3])
    p.draft.ctx_dft = d
    return SpeculativeGenerator(c, p, backend="cpp")


def driver_prompt_token_outside_vocab() -> Any:
    with SpeculativeGenerator(ctx(n_ctx=512), _spec(T.NGRAM_SIMPLE), greedy_sampling()) as g:
        return g.generate([[1, 2, 10**6]], 4)


def cli_threads_beyond_ggml() -> Any:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pyspec", "run", "--tiny", "-n", "2", "--threads", "100000"],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if r.returncode < 0 or "Traceback" in r.stderr:
        return f"exit {r.returncode}: {r.stderr[-500:]}"
    raise ValueError(f"exit {r.returncode}: {r.stderr.strip()}")


# --- process -----------------------------------------------------------------------


def fork_after_multithreaded_decode() -> Any:
    c = decoded(n_threads=2, n_threads_batch=2)
    pid = os.fork()
    if pid == 0:  # the child: one thread, the decode works
        try:
            b = Batch(1)
            b.add(5, 3, 0, True)
            c.decode(b)
            os._exit(0 if c.n_threads == 1 else 3)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    if os.WEXITSTATUS(status) != 0:
        return f"child failed with status {status}"
    raise RuntimeError("child decoded single-threaded (checked)")


# --- entry points from the abi work: custom samplers, LoRA, threadpools, state files --------


class _Raising:
    name = "raising"

    def __init__(self, where: str) -> None:
        self.where = where

    def apply(self, cur_p: Any) -> None:
        if self.where == "apply":
            raise RuntimeError("apply failed")
        if self.where == "grow":
            cur_p.data = np.concatenate([cur_p.data, cur_p.data])
        if self.where == "none":
            cur_p.selected = -1

    def clone(self) -> Any:
        if self.where == "clone":
            return 42  # not a sampler
        return _Raising(self.where)


def custom_sampler_apply_raises() -> Any:
    c = decoded()
    return SamplerChain().add_custom(_Raising("apply")).sample(c, -1)


def custom_sampler_selects_nothing() -> Any:
    c = decoded()
    return SamplerChain().add_custom(_Raising("none")).sample(c, -1)


def custom_sampler_grows_the_array() -> Any:
    c = decoded()
    return SamplerChain().add_custom(_Raising("grow")).add_greedy().sample(c, -1)


def custom_sampler_clone_not_a_sampler() -> Any:
    return SamplerChain().add_custom(_Raising("clone")).clone()


def lora_on_a_closed_model() -> Any:
    from pyspec.core.adapters import LoraAdapter
    from pyspec.testing import derived

    m = Model(tm.make_target())
    path = derived.make_lora(TMP / "lora.gguf").path
    m.close()
    return LoraAdapter(m, path)


def lora_from_another_model() -> Any:
    from pyspec.core.adapters import LoraAdapter
    from pyspec.testing import derived

    adapter = LoraAdapter(M["target"], derived.make_lora(TMP / "lora.gguf").path)
    return Context(M["draft"], **KW).set_lora_adapters({adapter: 1.0})


def threadpool_smaller_than_the_threads() -> Any:
    from pyspec.core.threadpool import ThreadPool

    c = ctx()
    c.attach_threadpool(ThreadPool(1))
    return c.set_n_threads(4)


def threadpool_closed_before_attach() -> Any:
    from pyspec.core.threadpool import ThreadPool

    pool = ThreadPool(1)
    pool.close()
    return ctx().attach_threadpool(pool)


def state_whole_negative_position() -> Any:
    c = decoded()
    blob = bytearray(c.state_get())
    (n,) = struct.unpack_from("<I", blob, 0)
    struct.pack_into("<i", blob, 4 + n + 8, -3)  # the first cell's position (after n_stream, cell_count)
    return c.state_set(bytes(blob))


def state_seq_file_huge_cell_count() -> Any:
    from pyspec.ffi import c_const

    head = struct.pack("<III", c_const("LLAMA_STATE_SEQ_MAGIC"), c_const("LLAMA_STATE_SEQ_VERSION"), 0)
    return decoded().state_seq_load_file(_write("huge-cells.state", head + struct.pack("<II", 1, 0xFFFFFFFF)
                                                + b"\0" * 64), 0)


def backend_chain_selects_twice() -> Any:
    chain = SamplerChain().add_dist(1).add_top_k(10).add_greedy()
    return ctx(n_seq_max=2).set_sampler(0, chain)


def backend_chain_reorders_three_times() -> Any:
    # three top-k on the backend (scripts/fuzz.py --atheris): the third cannot reshape the [1, k]
    # candidates the second left, an assert while set_sampler builds the graph
    chain = SamplerChain().add_top_k(24).add_top_k(24).add_top_k(24)
    return ctx(n_seq_max=2).set_sampler(0, chain)


def backend_top_k_past_the_candidates() -> Any:
    # a backend top-k larger than the vocabulary asserts in ggml_top_k at the first decode
    chain = SamplerChain().add_top_k(M["target"].vocab.n_tokens + 1).add_dist(1)
    return ctx(n_seq_max=2).set_sampler(0, chain)
