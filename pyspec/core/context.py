"""A llama_context: decode/encode, outputs as numpy arrays, memory, state.

Safety rules (docs/audit.toml lists every llama.cpp site they keep out of reach):

- One thread at a time. Every method that reaches the C context takes the
  context's guard without waiting; a second thread gets ConcurrentUseError
  instead of racing a running decode.
- Outputs are copies. llama.cpp frees its output buffer on close and moves it
  when a later decode needs more rows, so an array over it would dangle; each
  getter copies the rows it is asked for (``out=`` reuses an array of yours).
- Every value that llama.cpp would GGML_ASSERT on, abort on, or index with
  unchecked is checked here first and raises a Python exception naming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pyspec.core import adapters as _adapters
from pyspec.core import fork
from pyspec.core import state as _state
from pyspec.core.batch import Batch, BatchExt, BatchView, EmbdBatch
from pyspec.core.ext_error import last_error
from pyspec.core.handle import Handle
from pyspec.core.memory import Memory
from pyspec.core.model import Model
from pyspec.core.threadpool import ThreadPool
from pyspec.errors import ConcurrentUseError, ContextError, SnapshotSplitError, decode_error
from pyspec.ffi import c_enum, ext, ffi, llama

__all__ = ["MAX_THREADS", "AnyBatch", "Context", "batch_invariant_params"]

logger = logging.getLogger("pyspec")

AnyBatch = Batch | BatchView | EmbdBatch

_CTX_TYPES = c_enum("enum llama_context_type", "LLAMA_CONTEXT_TYPE_")
PROCESS_TYPES = c_enum("enum llama_process_type", "LLAMA_PROCESS_TYPE_")  # {"encode": 0, "decode": 1}
_FLASH_ATTN: dict[Any, int] = c_enum("enum llama_flash_attn_type", "LLAMA_FLASH_ATTN_TYPE_")
_FLASH_ATTN.update({False: _FLASH_ATTN["disabled"], True: _FLASH_ATTN["enabled"]})
# the K/V cache types llama.cpp offers (common/arg.cpp kv_cache_types); the other
# ggml types are not cache types and may abort inside llama.cpp
_KV_TYPES = {k: v for k, v in c_enum("enum ggml_type", "GGML_TYPE_").items()
             if k in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")}
_POOLING = c_enum("enum llama_pooling_type", "LLAMA_POOLING_TYPE_")
_ROPE_SCALING = c_enum("enum llama_rope_scaling_type", "LLAMA_ROPE_SCALING_TYPE_")
_ATTENTION = c_enum("enum llama_attention_type", "LLAMA_ATTENTION_TYPE_")
# fields set through a converter below rather than copied as they are
_ENUM_FIELDS: dict[str, dict[Any, int]] = {
    "ctx_type": _CTX_TYPES, "flash_attn_type": _FLASH_ATTN, "type_k": _KV_TYPES, "type_v": _KV_TYPES,
    "pooling_type": _POOLING, "rope_scaling_type": _ROPE_SCALING, "attention_type": _ATTENTION,
}
_SPECIAL = {*_ENUM_FIELDS, "ctx_other", "samplers"}
_FIELDS = {name for name, _ in ffi.typeof("struct llama_context_params").fields}
_POINTER_FIELDS = {"cb_eval", "cb_eval_user_data", "abort_callback", "abort_callback_data", "n_samplers"}
_THREAD_FIELDS = {"n_threads", "n_threads_batch"}
_NO_LAYERS: frozenset[int] = frozenset()  # what _layer_inp_ready holds after a decode that kept no layer inputs
# architectures whose graph (src/models/<arch>.cpp) records each layer's input: on any
# other, a decode with set_embeddings_layer_inp enabled hits a GGML_ASSERT and aborts
_LAYER_INP_ARCHS = {"llama", "qwen3", "qwen3moe", "gpt-oss", "gemma4"}
MAX_THREADS = 512  # GGML_MAX_N_THREADS (ggml.h): ggml's per-thread tables have this many entries
_STATE_FLAGS_HOST = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY; ON_DEVICE (2) keeps the data off the host
# bytes per KV element of the cache types (ggml_type_size / block size), for the memory estimate
_KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
             "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}


def batch_invariant_params(model: Model, params: dict[str, Any]) -> dict[str, Any]:
    """The context parameters of batch-invariant mode, checked against what the caller asked for.

    Where a row's result may depend on its batch on the CPU backend, and what the mode does:

    - repacked weights (llama.cpp's extra buffer types; their kernels change with the
      batch size): the model must be loaded with ``Model(..., batch_invariant=True)``;
    - flash attention tiles the queries from 64 rows on, and splits the KV cache across
      threads for a single query from 512 cells on: ggml-cpu's reference switch
      (``ggml_backend_cpu_set_use_ref``, set after creation) keeps one kernel for all;
    - the KV cells a token lands in set the order attention sums in: with a unified
      cache several sequences share (and reorder) cells, and a sliding-window cache
      reuses cells; the mode keeps one stream per sequence (``kv_unified=False``) and
      full-size sliding-window caches (``swa_full=True``).

    Matrix products on file-layout quantized weights compute each output element with
    one dot product whatever the batch or thread count, and llama.cpp's tinyBLAS path
    (from two rows on) gives the same bits as the one-row path for them (checked by the
    tests on Q8_0 copies of the tiny models and scripts/lossless.py on Gemma's Q4_K_M).
    Float weights (F32/F16/BF16) are the exception: tinyBLAS sums their products in
    another order than the one-row dot product, so the last bits of a row still depend
    on its batch unless the build has no llamafile kernels (``-DGGML_LLAMAFILE=OFF``);
    :class:`~pyspec.core.model.Model` warns when that is the case.
    """
    if not model.batch_invariant:
        raise ValueError("batch-invariant mode needs the model loaded with Model(path, batch_invariant=True): "
                         "repacked CPU weights are multiplied by kernels that change with the batch size")
    if params.get("swa_full") is False:
        raise ValueError("batch-invariant mode needs swa_full=True (a sliding-window cache reuses its cells)")
    if params.get("kv_unified") and params.get("n_seq_max", 1) > 1:
        raise ValueError("batch-invariant mode needs kv_unified=False with several sequences "
                         "(sequences sharing a cache reorder each other's cells)")
    return {**params, "swa_full": True, "kv_unified": bool(params.get("kv_unified", False))}


def _convert(table: dict[Any, int], name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value in table.values():
        return value
    if isinstance(value, (str, bool)) and value in table:
        return table[value]
    raise ValueError(f"{name} must be one of {sorted(str(k) for k in table)}, not {value!r}")


def _stoi_positive(text: str | None) -> bool:
    """std::stoi(text) > 0 without its exceptions: leading blanks, a sign, digits, within int."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", text or "")
    return m is not None and 0 < int(m.group(1)) < 2**31


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 1 << 62


class Context(Handle):
    """Mirrors llama_init_from_model / llama_free (llama.h).

    Keyword arguments are the fields of ``llama_context_params`` (n_ctx,
    n_batch, n_ubatch, n_seq_max, n_rs_seq, n_threads, embeddings, ...);
    ``ctx_type`` takes "default" or "mtp", ``flash_attn_type`` "auto" /
    "enabled" / "disabled", ``type_k``/``type_v`` a cache type name,
    ``pooling_type`` / ``rope_scaling_type`` / ``attention_type`` a member name
    of their enum, ``ctx_other`` another Context, which this one keeps alive,
    and ``samplers`` a {seq_id: SamplerChain} of backend samplers, which this
    context keeps alive while it uses them.

    ``batch_invariant`` (default: the model's) makes every output row independent of
    the batch it is computed in on the CPU backend, so speculative decoding gives
    exactly the tokens of plain decoding: see :func:`batch_invariant_params`.
    """

    _kind = "context"

    def __init__(self, model: Model, **params: Any) -> None:
        super().__init__()
        self._busy = threading.Lock()  # held while llama.cpp runs on this context
        self._claimed = threading.Lock()  # held for a whole generation (see claim)
        self._claim_owner: int | None = None  # the thread holding the claim: others are refused meanwhile
        self._fork_gen = fork.child_generation()
        self.t_decode_ns = 0  # wall time spent in llama_decode / llama_encode, for statistics
        batch_invariant = params.pop("batch_invariant", None)
        unknown = set(params) - _FIELDS - {"samplers"}
        if unknown:
            raise TypeError(f"unknown llama_context_params field(s): {', '.join(sorted(unknown))}")
        bad_ptr = set(params) & _POINTER_FIELDS
        if bad_ptr:
            raise TypeError(f"field(s) {', '.join(sorted(bad_ptr))} are not settable from Python")
        if model.vocab_only:
            raise ValueError(
                f"{model.path.name} was loaded with vocab_only=True: it has no weights to compute with "
                "(tokenize with model.vocab, or load it again without vocab_only to create a Context)"
            )
        self.batch_invariant = model.batch_invariant if batch_invariant is None else bool(batch_invariant)
        if self.batch_invariant:
            params = batch_invariant_params(model, params)
        cparams = llama.llama_context_default_params()
        n_cpu = min(os.cpu_count() or 1, MAX_THREADS)
        cparams.n_threads = n_cpu
        cparams.n_threads_batch = n_cpu
        for name, value in params.items():
            if name in _SPECIAL:
                continue
            if name in _THREAD_FIELDS:
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
                    raise ValueError(f"{name} must be an int in 1..{MAX_THREADS}, got {value!r}")
            elif name.startswith("n_") and isinstance(value, (int, float)) and not isinstance(value, bool):
                if value < 0:
                    raise ValueError(f"{name} must be >= 0, got {value}")
            try:
                setattr(cparams, name, value)
            except OverflowError as e:
                raise ValueError(f"{name}={value!r} out of range") from e
            except TypeError as e:
                raise TypeError(f"{name}: {e}") from e
        for name, table in _ENUM_FIELDS.items():
            if name in params:
                setattr(cparams, name, _convert(table, name, params[name]))
        if fork.in_single_thread_child():
            cparams.n_threads = cparams.n_threads_batch = 1
        self._check_sizes(model, cparams)

        if cparams.ctx_type == _CTX_TYPES["mtp"]:
            # llama.cpp refuses this too, but only with a log line; say why here
            arch = model.meta("general.architecture") or "?"
            if int(model.meta(f"{arch}.nextn_predict_layers") or 0) <= 0:
                raise ValueError(
                    f"ctx_type='mtp' needs a model with MTP (NextN) layers; this {arch} model has none "
                    f"({arch}.nextn_predict_layers is absent or 0)"
                )
            if not model.load_mtp:  # its graph GGML_ASSERTs on the skipped NextN tensors
                raise ValueError("ctx_type='mtp' needs the model loaded with Model(..., load_mtp=True)")
        if ext.pyspec_model_has_dspark_head(model.ptr) and not _stoi_positive(model.meta("dflash.block_size")):
            # build_dspark_markov_head GGML_ASSERTs it (std::stoi, > 0) in the graph reserve of the creation
            raise ContextError("DSpark draft requires a positive 'dflash.block_size' in GGUF metadata")

        self.model = model
        self.other: Context | None = params.get("ctx_other")
        deps: list[Handle] = [model]
        if self.other is not None:
            if not isinstance(self.other, Context):
                raise TypeError("ctx_other must be a pyspec Context")
            cparams.ctx_other = self.other.ptr
            deps.append(self.other)
        # backend sampler chains: {seq_id: SamplerChain}, each retained while attached
        self._samplers: dict[int, Any] = {}
        samplers = self._check_samplers(params.get("samplers"), int(cparams.n_seq_max), model.vocab.n_tokens)
        cfg = None
        if samplers:
            cfg = ffi.new("struct llama_sampler_seq_config[]", len(samplers))
            for k, (seq, chain) in enumerate(samplers.items()):
                cfg[k].seq_id = seq
                cfg[k].sampler = chain.ptr
            cparams.samplers = cfg
            cparams.n_samplers = len(samplers)
        self._retired: list[Any] = []  # chains detached since the last decode (its graph may still hold them)

        # a model on rpc-servers: its calls go through the RPC guard (pyspec.core.rpc)
        self._rpc = model.rpc
        taken: list[Any] = []
        reserved: list[Any] = []
        try:
            for chain in samplers.values():
                chain._reserve(model.vocab.n_tokens)  # no other thread attaches it meanwhile
                reserved.append(chain)
                chain.retain()  # alive and unchanged from here on
                taken.append(chain)
            if self.other is not None:  # llama.cpp reads the other context's memory while it builds this one
                with self.other.held():
                    ptr = self._init_from_model(model, cparams)
            else:
                ptr = self._init_from_model(model, cparams)
            if ptr == ffi.NULL:
                raise ContextError("llama_init_from_model failed (see the pyspec.llama log for the reason)")
            free = self._rpc.free(llama.llama_free) if self._rpc is not None else llama.llama_free
            if llama.llama_n_rs_seq(ptr) > 0 and ext.pyspec_context_gdn_split(ptr):
                free(ptr)
                raise SnapshotSplitError(
                    f"n_rs_seq={cparams.n_rs_seq}: a device that holds this model's recurrent layers does not run "
                    "the fused gated-delta-net op that recurrent-state snapshots need, so llama.cpp would run it "
                    "on another device, which corrupts memory at this revision; use n_rs_seq=0 (speculative "
                    "rollback then goes through checkpoints) or keep the recurrent layers on the CPU")
            self.own(ptr, free, tuple(deps))
        except BaseException:
            for chain in taken:
                chain.release()
            for chain in reserved:
                chain._unreserve()
            raise
        for seq, chain in samplers.items():
            chain._attached(self)
            self._samplers[seq] = chain
        if self.batch_invariant:
            n_other = ffi.new("int32_t *")
            ext.pyspec_context_set_cpu_use_ref(ptr, True, n_other)
            if n_other[0]:
                logger.warning("batch-invariant mode covers the CPU backend; %d other backend(s) of this context "
                               "(GPU, accelerators) may still compute a row differently in another batch", n_other[0])
        self.params = cparams
        self.n_vocab = model.vocab.n_tokens
        self.n_seq_max = int(llama.llama_n_seq_max(ptr))
        self.n_batch = int(llama.llama_n_batch(ptr))
        self.n_ubatch = int(llama.llama_n_ubatch(ptr))
        self.n_ctx = int(llama.llama_n_ctx(ptr))
        self.n_ctx_seq = int(llama.llama_n_ctx_seq(ptr))  # positions each sequence may use
        if cparams.n_ctx and self.n_ctx != int(cparams.n_ctx):
            # llama_context pads n_ctx (and each sequence's share) to a multiple of 256 (GGML_PAD, llama-context.cpp)
            logger.warning("n_ctx=%d became %d (%d per sequence): llama.cpp pads a context to a multiple of 256; "
                           "pass a multiple of 256 to get what you ask for",
                           int(cparams.n_ctx), self.n_ctx, self.n_ctx_seq)
        self.n_embd = model.n_embd
        self.n_embd_out = model.n_embd_out
        # the most outputs one decode may ask for (llama.cpp asserts beyond it)
        self.n_outputs_max = self.n_batch if cparams.n_outputs_max == 0 or model.has_encoder else min(
            int(cparams.n_outputs_max), self.n_batch)
        # llama_context's clamp (0: n_outputs_max); backend sampling refuses more outputs per sequence
        per_seq = int(cparams.n_outputs_max_per_seq)
        self.n_outputs_max_per_seq = self.n_outputs_max if per_seq == 0 else min(per_seq, self.n_outputs_max)
        self._causal = self._is_causal(model, int(cparams.attention_type))
        self._threads = max(int(cparams.n_threads), int(cparams.n_threads_batch))
        self.memory = Memory(self)
        # what the C output buffers hold after the last decode/encode, to check the getters
        self._embeddings = bool(cparams.embeddings)
        self._outputs: np.ndarray = np.zeros(0, np.int32)  # batch index -> output row, -1 without output
        # pyspec_batch_scan writes a batch's output rows into one of two buffers, the one that
        # _outputs does not show, so a batch refused before llama_decode leaves them as they were
        self._row_bufs = (np.empty(self.n_batch, np.int32), np.empty(self.n_batch, np.int32))
        self._row_ptrs = tuple(ffi.cast("int32_t *", ffi.from_buffer(b)) for b in self._row_bufs)
        self._row_next = 0
        self._scan = ffi.new("pyspec_batch_info *")
        self._n_outputs = 0
        self._n_tokens = 0
        self._embd_ready = False
        self._nextn_on = False
        self._nextn_masked = True
        self._nextn_ready = False
        self._layer_inp_on: set[int] = set()
        self._layer_inp_ready: frozenset[int] | set[int] = _NO_LAYERS

    def _init_from_model(self, model: Model, cparams: Any) -> Any:
        if self._rpc is not None:
            return self._rpc.init_context(model.ptr, cparams)
        return llama.llama_init_from_model(model.ptr, cparams)

    # --- creation checks -------------------------------------------------

    @staticmethod
    def _is_causal(model: Model, attention_type: int) -> bool:
        if attention_type != _ATTENTION["unspecified"]:
            return attention_type == _ATTENTION["causal"]
        arch = model.meta("general.architecture") or ""
        return (model.meta(f"{arch}.attention.causal") or "true").lower() != "false"

    @staticmethod
    def _check_sizes(model: Model, cp: Any) -> None:
        """What llama_init_from_model / the first decode would assert on, allocate without bound or hang on."""
        n_seq_max_c = int(llama.llama_max_parallel_sequences())
        if cp.n_seq_max < 1 or cp.n_seq_max > n_seq_max_c:
            raise ValueError(f"n_seq_max must be in 1..{n_seq_max_c} (LLAMA_MAX_SEQ), got {cp.n_seq_max}")
        max_rs = int(ext.pyspec_model_max_rs_seq(model.ptr))
        if cp.n_rs_seq > max_rs:
            # every snapshot adds nodes to each graph; past the graph's budget llama.cpp aborts
            raise ValueError(f"n_rs_seq={cp.n_rs_seq} exceeds {max_rs}, the most recurrent-state snapshots per "
                             f"sequence this model's graphs hold (an MTP draft's n_max sets it)")
        if cp.n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {cp.n_batch}")
        n_ctx = int(cp.n_ctx) or model.n_ctx_train
        if n_ctx <= 0:
            raise ValueError("n_ctx is 0 and the model gives no training context length: set n_ctx")
        causal = Context._is_causal(model, int(cp.attention_type))
        n_batch = min(n_ctx, int(cp.n_batch)) if causal else int(cp.n_batch)
        n_outputs_max = n_batch if cp.n_outputs_max == 0 or model.has_encoder else int(cp.n_outputs_max)
        if cp.n_seq_max > n_outputs_max:
            # llama_context::output_reserve: GGML_ASSERT(max(n_outputs, n_seq_max) <= n_outputs_max)
            what = "n_outputs_max" if cp.n_outputs_max else f"n_batch (capped at n_ctx={n_ctx})"
            raise ValueError(
                f"n_seq_max={cp.n_seq_max} exceeds {what}={n_outputs_max}: every sequence needs an output row")
        n_ubatch = min(n_batch, int(cp.n_ubatch) or n_batch)
        if cp.n_rs_seq > 0 and n_ubatch <= cp.n_rs_seq + 1:
            # the recurrent memories split a batch keeping each sequence's last n_rs_seq + 1 tokens in
            # one ubatch: llama_batch_allocr::split_equal asserts n_ubatch > n_keep_tail
            raise SnapshotSplitError(
                f"n_rs_seq={cp.n_rs_seq} needs n_ubatch > n_rs_seq + 1 = {cp.n_rs_seq + 1}, got n_ubatch={n_ubatch} "
                f"(raise n_ubatch, or use n_rs_seq=0: speculative rollbacks then go through checkpoints)")
        # the memory this context would take, so a typo in n_ctx is an error, not a machine that swaps or hangs
        kv_type = {v: k for k, v in _KV_TYPES.items()}
        bytes_k = _KV_BYTES.get(kv_type.get(int(cp.type_k), "f16"), 4.0)
        bytes_v = _KV_BYTES.get(kv_type.get(int(cp.type_v), "f16"), 4.0)
        n_head = max(model.n_head, 1)
        head_dim = model.n_embd / n_head
        kv_width = model.n_layer * max(model.n_head_kv, 1) * head_dim
        need = (n_ctx + 256) * kv_width * (bytes_k + bytes_v)
        need += 4.0 * model.vocab.n_tokens * (min(n_outputs_max, max(n_ubatch, int(cp.n_seq_max))) + n_ubatch)
        have = _physical_memory()
        if need > have:
            raise ValueError(
                f"this context would need about {need / 2**30:.1f} GiB (n_ctx={n_ctx}, n_batch={n_batch}, "
                f"n_ubatch={n_ubatch}), more than this machine's {have / 2**30:.1f} GiB: lower n_ctx / n_batch"
            )

    @staticmethod
    def _check_samplers(samplers: Any, n_seq_max: int, n_vocab: int) -> dict[int, Any]:
        from pyspec.core.sampler import SamplerChain

        if not samplers:
            return {}
        if not isinstance(samplers, Mapping):
            raise TypeError("samplers must be a {seq_id: SamplerChain} mapping")
        out: dict[int, Any] = {}
        for seq, chain in samplers.items():
            if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < n_seq_max:
                raise ValueError(f"samplers: seq_id {seq!r} out of range 0..{n_seq_max - 1}")
            if not isinstance(chain, SamplerChain):
                raise TypeError(f"samplers[{seq}] must be a SamplerChain, got {type(chain).__name__}")
            chain._check_attachable(n_vocab)
            if any(chain is c for c in out.values()):
                raise ValueError("samplers: one SamplerChain cannot serve two sequences (it is set up once per use)")
            out[seq] = chain
        return out

    # --- the guard -----------------------------------------------------------

    def _acquire(self) -> Any:
        """Take this context's own guard (closed, busy and fork checks); returns the C pointer."""
        if not self._busy.acquire(blocking=False):
            self.check_open()  # a closed context says so first
            if self._fork_gen != fork.child_generation():
                raise ConcurrentUseError(
                    "this context was in use by another thread when the process forked; its state is undefined "
                    "in the child: create a new Context there"
                )
            raise ConcurrentUseError("this context is in use by another thread; give each thread its own Context")
        if self._closed:  # checked under the guard: close() takes it too
            self._busy.release()
            self.check_open()
        if self._fork_gen != fork.child_generation():
            self._adopt_after_fork()
        owner = self._claim_owner
        if owner is not None and owner != threading.get_ident():
            self._busy.release()
            raise ConcurrentUseError(
                "a generation is already running on this context in another thread (it holds a claim)")
        return self._ptr

    def _enter(self) -> Any:
        """Take this context for one call into llama.cpp; returns the C pointer. Callers use the
        public guards (in_use(), held()), which pair it with _leave().

        A context reading another one (EAGLE3 reads its target's layer inputs, an MTP context
        shares its target's memory) takes that one's guard too.
        """
        if self.other is None and self._busy.acquire(blocking=False):
            # the common case in this one frame (a generation takes the guard several times a token):
            # open, not forked since, no claim or this thread's
            owner = self._claim_owner
            if not self._closed and self._fork_gen == fork._generation and (
                    owner is None or owner == threading.get_ident()):
                return self._ptr
            self._busy.release()  # the full checks below say what is wrong
        ptr = self._acquire()
        other = self.other
        if other is not None and not other._busy.acquire(blocking=False):
            self._busy.release()
            raise ConcurrentUseError("the context this one reads (ctx_other) is in use by another thread")
        return ptr

    def _enter_compute(self) -> Any:
        """_enter() for C code that may compute on this context (held(), the port's sampler)."""
        ptr = self._enter()
        if self._threads > 1:  # fork.note_compute heeds only several threads
            try:
                fork.note_compute(self._threads)
            except BaseException:
                self._leave()
                raise
        return ptr

    def _leave(self) -> None:
        if self.other is not None:
            self.other._busy.release()
        self._busy.release()

    def in_use(self) -> _InUse:
        """The public guard for one call into llama.cpp: ``with ctx.in_use() as ptr: ...`` (also
        holds the guard of the context this one reads, ctx_other); Handle.in_use's contract."""
        return _InUse(self)

    def held(self) -> _Held:
        """in_use() around C code that may compute on this context (the port's sampler, the C++
        reference): ``with ctx.held() as ptr: ...``."""
        return _Held(self)

    def held_alone(self) -> _HeldAlone:
        """held() without ctx_other's guard, for a caller that holds every context C++ code uses
        (the C++ reference's held_all)."""
        return _HeldAlone(self)

    def _adopt_after_fork(self) -> None:
        # first use in a forked child (the guard is held): threads the child does not have are gone
        self._claimed = threading.Lock()
        self._claim_owner = None
        if fork.in_single_thread_child() and self._threads > 1:
            llama.llama_set_n_threads(self._ptr, 1, 1)
            self._threads = 1
        self._fork_gen = fork.child_generation()

    # --- decode -----------------------------------------------------------

    def _check_batch(self, batch: AnyBatch, all_outputs: bool) -> int:
        """Returns the number of outputs the batch asks for (what llama_decode would abort on raises)
        and leaves its output rows in the spare row buffer (every row an output with ``all_outputs``).

        A token outside the vocabulary is not refused here: llama_decode refuses such a batch
        itself with -1 (decode() raises ValueError for it first); ``self._scan`` reports it."""
        if not isinstance(batch, (Batch, BatchView, EmbdBatch)):
            raise TypeError(f"expected a pyspec Batch, BatchView or EmbdBatch, got {type(batch).__name__}")
        n = batch.n_tokens
        if n <= 0:
            raise ValueError("batch is empty")
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        if not self._causal and n > self.n_ubatch:
            raise ValueError(
                f"non-causal attention computes a batch in one ubatch: {n} tokens exceed n_ubatch={self.n_ubatch}")
        if isinstance(batch, EmbdBatch):  # one sequence (0), positions from the memory, every row an output
            if batch.n_embd != self.model.n_embd_inp_or_embd():
                raise ValueError(
                    f"batch embeddings have width {batch.n_embd}, the model expects {self.model.n_embd_inp_or_embd()}")
            if n > self.n_outputs_max:
                raise ValueError(f"batch asks for {n} outputs, this context allows n_outputs_max={self.n_outputs_max}")
            self._row_bufs[self._row_next][:n] = np.arange(n, dtype=np.int32)
            self._scan.has_bad_token = 0
            return n
        if batch.token is None:
            if batch.embd is None:
                raise ValueError("batch carries neither tokens nor embeddings")
            if batch.n_embd != self.model.n_embd_inp_or_embd():
                raise ValueError(
                    f"batch embeddings have width {batch.n_embd}, the model expects {self.model.n_embd_inp_or_embd()}"
                )
        if batch.c.n_tokens != n:  # llama_decode and the scan read the struct's count
            raise ValueError(f"batch.c.n_tokens ({batch.c.n_tokens}) was changed behind the batch (n_tokens={n})")
        scan = self._scan
        status = ext.pyspec_batch_scan(batch.c, min(batch.n_seq_max, self.n_seq_max), self.n_seq_max, self.n_vocab,
                                       all_outputs, self._row_ptrs[self._row_next], scan)
        if status == ext.PYSPEC_BATCH_E_N_SEQ:
            raise ValueError(f"each token needs 1..{self.n_seq_max} sequence ids")
        if status == ext.PYSPEC_BATCH_E_SEQ_ID:
            raise ValueError(f"seq_id {scan.bad_value} out of range 0..{self.n_seq_max - 1}")
        n_out = int(scan.n_outputs)
        if n_out > self.n_outputs_max:
            raise ValueError(f"batch asks for {n_out} outputs, this context allows n_outputs_max={self.n_outputs_max}")
        if self._samplers and scan.max_n_seq_id > 1:
            # backend sampling counts outputs per sequence id and expects one id per output token
            raise ValueError("with backend samplers attached, each token needs exactly one sequence id")
        if self._samplers and not isinstance(batch, EmbdBatch):
            outs = (batch.logits[:n] != 0) | all_outputs
            self._check_outputs_per_seq(batch.seq_id[:n, 0][outs])
        return n_out

    def _check_outputs_per_seq(self, seqs: np.ndarray) -> None:
        """llama_decode's -1 where a sequence with a backend sampler asks for more outputs than
        n_outputs_max_per_seq (1 by default at this pin), said before the call."""
        for seq in self._samplers:
            k = int(np.count_nonzero(seqs == seq))
            if k > self.n_outputs_max_per_seq:
                raise ValueError(
                    f"backend sampling gives at most n_outputs_max_per_seq={self.n_outputs_max_per_seq} outputs per "
                    f"sequence, seq_id {seq} asks for {k} (make the context with a larger n_outputs_max_per_seq)")

    def decode(self, batch: AnyBatch) -> None:
        """Mirrors llama_decode (llama.h); a non-zero result raises DecodeError, a token outside
        the vocabulary ValueError."""
        rc = self._decode(batch, refuse_bad_token=True)
        if rc != 0:
            raise decode_error(rc, "llama_decode")

    def decode_rc(self, batch: AnyBatch) -> int:
        """llama_decode returning the code, for loops that mirror C++ `ret != 0` checks.

        A batch that llama_decode refuses itself (a token outside the vocabulary) returns its
        -1, as in the C++, where e.g. a draft context whose vocabulary lacks a target token
        makes the draft stop; what it would abort on raises ValueError."""
        return self._decode(batch, refuse_bad_token=False)

    def _decode(self, batch: AnyBatch, refuse_bad_token: bool) -> int:
        with self.in_use() as ptr:
            n_out = self._check_batch(batch, self._embeddings)
            if refuse_bad_token and self._scan.has_bad_token:
                raise ValueError(f"token {self._scan.bad_token} is outside the vocabulary (0..{self.n_vocab - 1})")
            if self._threads > 1:  # fork.note_compute heeds only several threads
                fork.note_compute(self._threads)
            t0 = time.perf_counter_ns()
            if self._rpc is not None:
                rc = self._rpc.decode(ptr, batch.c[0])
            else:
                rc = int(llama.llama_decode(ptr, batch.c[0]))
            self.t_decode_ns += time.perf_counter_ns() - t0
            self._after_compute(batch.n_tokens, n_out, rc)
            if rc == 0 and self._retired:
                self._release_retired()
            return rc

    def process(self, batch: BatchExt, type: int | str = "decode") -> None:
        """Mirrors llama_process (llama.h) on a BatchExt made for this context; a non-zero result
        raises DecodeError. ``type`` is LLAMA_PROCESS_TYPE_DECODE / _ENCODE (or "decode" / "encode")."""
        rc = self.process_rc(batch, type)
        if rc != 0:
            raise decode_error(rc, "llama_process")

    def process_rc(self, batch: BatchExt, type: int | str = "decode") -> int:
        """llama_process returning the code (what it would abort on raises ValueError)."""
        kind = _convert(PROCESS_TYPES, "type", type)
        encode = kind == PROCESS_TYPES["encode"]
        with self.in_use() as ptr:
            n_out = self._check_batch_ext(batch, encode)
            if self._threads > 1:
                fork.note_compute(self._threads)
            t0 = time.perf_counter_ns()
            with batch.in_use() as bptr:
                if self._rpc is not None:
                    rc = self._rpc.process(ptr, kind, bptr)
                else:
                    rc = int(llama.llama_process(ptr, kind, bptr))
            self.t_decode_ns += time.perf_counter_ns() - t0
            self._after_compute(batch.n_tokens, n_out, rc)
            if rc == 0 and self._retired:
                self._release_retired()
            return rc

    def _check_batch_ext(self, batch: BatchExt, encode: bool) -> int:
        """_check_batch for a BatchExt, from the entries it mirrors: the output count, and the
        output rows left in the spare row buffer."""
        if not isinstance(batch, BatchExt):
            raise TypeError(f"expected a pyspec BatchExt, got {type(batch).__name__}")
        if batch.ctx is not self:  # its capacity, vocabulary and input width are its context's
            raise ValueError("this BatchExt was made for another context (BatchExt(ctx) for this one)")
        batch.check_open()
        n = batch.n_tokens
        if n <= 0:
            raise ValueError("batch is empty")
        if (encode or not self._causal) and n > self.n_ubatch:
            what = "an encoder batch" if encode else "non-causal attention computes a batch in one ubatch:"
            raise ValueError(f"{what} of {n} tokens exceeds n_ubatch={self.n_ubatch}")
        if encode and not self.model.has_encoder:
            raise ValueError("llama_process(ENCODE) needs a model with an encoder (T5, EAGLE3); use DECODE")
        outs = np.asarray(batch.outputs, dtype=bool)
        if encode or self._embeddings:
            outs[:] = True
        n_out = int(outs.sum())
        if n_out > self.n_outputs_max:
            raise ValueError(f"batch asks for {n_out} outputs, this context allows n_outputs_max={self.n_outputs_max}")
        if self._samplers and any(len(s) > 1 for s in batch.seq_ids):
            raise ValueError("with backend samplers attached, each token needs exactly one sequence id")
        if self._samplers and not encode:  # llama_context::encode does not count them
            self._check_outputs_per_seq(np.array([min(s) for s in batch.seq_ids], np.int32)[outs])
        rows = self._row_bufs[self._row_next]
        rows[:n] = np.where(outs, np.cumsum(outs) - 1, -1)
        self._scan.has_bad_token = 0  # BatchExt refused invalid token ids when they were added
        return n_out

    def _after_compute(self, n: int, n_out: int, rc: int) -> None:
        """What the output buffers hold now: the rows _check_batch left in the spare buffer."""
        if rc != 0:
            self._forget_outputs()
            return
        j = self._row_next
        self._outputs = self._row_bufs[j][:n]
        self._row_next = j ^ 1
        self._n_outputs = n_out
        self._n_tokens = n
        self._embd_ready = self._embeddings
        self._nextn_ready = self._nextn_on
        self._layer_inp_ready = set(self._layer_inp_on) if self._layer_inp_on else _NO_LAYERS

    def encode(self, batch: AnyBatch) -> None:
        """Mirrors llama_encode (llama.h); a non-zero result raises DecodeError."""
        rc = self.encode_rc(batch)
        if rc != 0:
            raise decode_error(rc, "llama_encode")

    def encode_rc(self, batch: AnyBatch) -> int:
        with self.in_use() as ptr:
            if not isinstance(batch, (Batch, BatchView, EmbdBatch)):
                raise TypeError(f"expected a pyspec Batch, BatchView or EmbdBatch, got {type(batch).__name__}")
            if batch.n_tokens <= 0:
                raise ValueError("batch is empty")
            if batch.n_tokens > self.n_ubatch:
                raise ValueError(f"encoder batch of {batch.n_tokens} tokens exceeds n_ubatch={self.n_ubatch}")
            if not self.model.has_encoder:
                # llama_encode on a decoder-only model crashes at this revision
                raise ValueError("llama_encode needs a model with an encoder (T5, EAGLE3); use decode() for this model")
            n_out = self._check_batch(batch, True)
            fork.note_compute(self._threads)
            t0 = time.perf_counter_ns()
            if self._rpc is not None:
                rc = self._rpc.encode(ptr, batch.c[0])
            else:
                rc = int(llama.llama_encode(ptr, batch.c[0]))
            self.t_decode_ns += time.perf_counter_ns() - t0
            self._after_compute(batch.n_tokens, n_out, rc)
            return rc

    # --- outputs (copies: llama.cpp frees or moves its buffer later) -----------

    def output_row(self, i: int, what: str) -> int:
        """The output row of batch index i (negative counts from the last output), or IndexError."""
        i = int(i)
        n = self._n_outputs
        if i < 0:
            if -i > n:
                raise IndexError(f"{what}: index {i} out of range, the last decode produced {n} outputs")
            return n + i
        if i >= self._outputs.size or self._outputs[i] < 0:
            raise IndexError(
                f"{what}: batch index {i} has no output (not requested in the last decode, or out of range)")
        return int(self._outputs[i])

    @staticmethod
    def _copy(p: Any, shape: tuple[int, ...], what: str, out: np.ndarray | None = None,
              dtype: Any = np.float32) -> np.ndarray:
        if p == ffi.NULL:
            raise IndexError(f"{what} not available (no such output row, or outputs not requested)")
        n = 1
        for s in shape:
            n *= s
        if out is None:
            out = np.empty(shape, dtype)
        elif (not isinstance(out, np.ndarray) or out.dtype != np.dtype(dtype) or out.size != n
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(f"out must be a writeable C-contiguous {np.dtype(dtype).name} array of {n} elements")
        if n:
            ffi.memmove(ffi.from_buffer(out), p, n * out.itemsize)
        return out

    def get_logits_ith(self, i: int, out: np.ndarray | None = None) -> np.ndarray:
        """Mirrors llama_get_logits_ith: a copy of the logits row of batch index i (negative counts from the end).

        With a backend sampler on that sequence the row holds the sampled candidates' logits only.
        """
        with self.in_use() as ptr:
            self.output_row(i, "logits")
            n = self.n_vocab
            if self._samplers and llama.llama_get_sampled_logits_ith(ptr, i) != ffi.NULL:
                n = min(n, int(llama.llama_get_sampled_logits_count_ith(ptr, i)))
            return self._copy(llama.llama_get_logits_ith(ptr, i), (n,), f"logits for index {i}", out)

    def _check_rows(self, n: int, what: str, n_max: int) -> None:
        if not 0 <= n <= n_max:
            raise IndexError(f"{what}: {n} rows requested, the last decode produced {n_max}")

    def get_logits(self, n_outputs: int, out: np.ndarray | None = None) -> np.ndarray:
        """Mirrors llama_get_logits: a copy of the first n_outputs rows, shape (n_outputs, n_vocab)."""
        with self.in_use() as ptr:
            self._check_rows(n_outputs, "logits", self._n_outputs)
            return self._copy(llama.llama_get_logits(ptr), (n_outputs, self.n_vocab), "logits", out)

    def get_embeddings_ith(self, i: int, out: np.ndarray | None = None) -> np.ndarray:
        with self.in_use() as ptr:
            if not self._embd_ready:
                raise IndexError("embeddings not available: set_embeddings(True) before the decode")
            self.output_row(i, "embeddings")
            p = llama.llama_get_embeddings_ith(ptr, i)
            return self._copy(p, (self.n_embd_out,), f"embeddings for index {i}", out)

    def get_embeddings(self, n_outputs: int, out: np.ndarray | None = None) -> np.ndarray:
        with self.in_use() as ptr:
            if not self._embd_ready:
                raise IndexError("embeddings not available: set_embeddings(True) before the decode")
            self._check_rows(n_outputs, "embeddings", self._n_outputs)
            return self._copy(llama.llama_get_embeddings(ptr), (n_outputs, self.n_embd_out), "embeddings", out)

    def get_embeddings_seq(self, seq_id: int, out: np.ndarray | None = None) -> np.ndarray:
        """Mirrors llama_get_embeddings_seq: the pooled embedding (or, for rank pooling, the scores) of seq_id."""
        with self.in_use() as ptr:
            seq = self.memory.check_seq(seq_id)
            pooling = int(llama.llama_pooling_type(ptr))
            n = int(llama.llama_model_n_cls_out(self.model.ptr)) if pooling == _POOLING["rank"] else self.n_embd_out
            p = llama.llama_get_embeddings_seq(ptr, seq) if self._embd_ready else ffi.NULL
            return self._copy(p, (n,), f"pooled embeddings of seq {seq}", out)

    def set_embeddings(self, value: bool) -> None:
        with self.in_use() as ptr:
            llama.llama_set_embeddings(ptr, bool(value))
            self._embeddings = bool(value)

    # --- staging API of llama-ext.h (through the pyspec_ext shim) ---------

    def set_embeddings_nextn(self, value: bool, masked: bool) -> None:
        with self.in_use() as ptr:
            ext.pyspec_set_embeddings_nextn(ptr, bool(value), bool(masked))
            self._nextn_on = bool(value)
            self._nextn_masked = bool(masked)

    def set_causal_attn(self, value: bool) -> None:
        """Mirrors llama_set_causal_attn; the batch checks follow it (a non-causal batch is one ubatch)."""
        with self.in_use() as ptr:
            llama.llama_set_causal_attn(ptr, bool(value))
            self._causal = bool(value)

    def set_nextn_layer_offset(self, offset: int) -> None:
        """Mirrors llama_set_nextn_layer_offset (llama-ext.h): the NextN head the MTP graph runs
        (layer n_layer + offset); an offset outside [0, n_layer_nextn) raises ValueError (its graph
        would GGML_ASSERT)."""
        with self.in_use() as ptr:
            off = int(offset)
            if not -(2**31) <= off < 2**31 or ext.pyspec_set_nextn_layer_offset(ptr, off) != 0:
                raise ValueError(last_error() or f"nextn layer offset {offset!r} out of range")

    def get_embeddings_nextn(self, n_rows: int, out: np.ndarray | None = None) -> np.ndarray:
        with self.in_use() as ptr:
            if not self._nextn_ready:
                raise IndexError("nextn embeddings not available: set_embeddings_nextn(True, ...) before the decode")
            # unmasked: one row per batch token; masked: one per output
            self._check_rows(n_rows, "nextn embeddings", self._n_outputs if self._nextn_masked else self._n_tokens)
            return self._copy(ext.pyspec_get_embeddings_nextn(ptr), (n_rows, self.n_embd_out), "nextn embeddings", out)

    def get_embeddings_nextn_ith(self, i: int, out: np.ndarray | None = None) -> np.ndarray:
        with self.in_use() as ptr:
            if not self._nextn_ready:
                raise IndexError("nextn embeddings not available: set_embeddings_nextn(True, ...) before the decode")
            if self._nextn_masked:
                self.output_row(i, "nextn embeddings")
            elif not 0 <= int(i) < self._n_tokens:
                raise IndexError(f"nextn embeddings: index {i} out of range 0..{self._n_tokens - 1}")
            p = ext.pyspec_get_embeddings_nextn_ith(ptr, i)
            return self._copy(p, (self.n_embd_out,), f"nextn embeddings for index {i}", out)

    def check_layer_inp(self, layer: int) -> None:
        """Raise ValueError unless this context can export the input of ``layer`` (llama.cpp aborts otherwise)."""
        if not 0 <= layer < self.model.n_layer:
            raise ValueError(f"layer {layer} out of range 0..{self.model.n_layer - 1}")
        arch = self.model.meta("general.architecture")
        if arch not in _LAYER_INP_ARCHS:
            raise ValueError(
                f"layer input extraction (EAGLE3 targets) is not implemented for the {arch!r} architecture "
                f"at this llama.cpp revision; it is for {', '.join(sorted(_LAYER_INP_ARCHS))}"
            )

    def set_embeddings_layer_inp(self, layer: int, value: bool) -> None:
        if not 0 <= layer < self.model.n_layer:
            raise ValueError(f"layer {layer} out of range 0..{self.model.n_layer - 1}")
        if value:
            self.check_layer_inp(layer)
        with self.in_use() as ptr:
            ext.pyspec_set_embeddings_layer_inp(ptr, layer, bool(value))
            (self._layer_inp_on.add if value else self._layer_inp_on.discard)(layer)

    def get_embeddings_layer_inp(self, layer: int, n_tokens: int, out: np.ndarray | None = None) -> np.ndarray:
        if not 0 <= layer < self.model.n_layer:
            raise ValueError(f"layer {layer} out of range 0..{self.model.n_layer - 1}")
        with self.in_use() as ptr:
            if layer not in self._layer_inp_ready:
                # llama.cpp asserts (aborts) when the layer's buffer was not filled by a decode
                raise IndexError(
                    f"layer {layer} input not available: enable set_embeddings_layer_inp({layer}, True), then decode")
            self._check_rows(n_tokens, f"layer {layer} input", self._n_tokens)
            p = ext.pyspec_get_embeddings_layer_inp(ptr, layer)
            return self._copy(p, (n_tokens, self.n_embd), f"layer {layer} input", out)

    def get_ctx_other_ptr(self) -> Any:
        return ext.pyspec_get_ctx_other(self.ptr)

    # --- backend sampling --------------------------------------------------

    def set_sampler(self, seq_id: int, chain: Any) -> bool:
        """Mirrors llama_set_sampler: attach a sampler chain (or None) to seq_id.

        The context keeps an attached chain alive until it is detached or the context
        is freed. llama.cpp sets a chain up for one context once: a chain that was ever
        attached cannot be attached again (clone() it).
        """
        from pyspec.core.sampler import SamplerChain

        seq = self.memory.check_seq(seq_id)
        if chain is not None:
            if not isinstance(chain, SamplerChain):
                raise TypeError(f"chain must be a SamplerChain or None, got {type(chain).__name__}")
            chain._reserve(self.model.vocab.n_tokens)
        entered = False  # a refused guard gives the reservation back; past it, the body does
        try:
            with self.in_use() as ptr:
                entered = True
                if chain is not None:
                    chain.retain()
                try:
                    ok = bool(llama.llama_set_sampler(ptr, seq, chain.ptr if chain is not None else ffi.NULL))
                except BaseException:
                    if chain is not None:
                        chain.release()
                        chain._unreserve()
                    raise
                # llama.cpp now holds the new chain for seq (ok) or none at all
                old = self._samplers.pop(seq, None)
                if old is not None:
                    self._retired.append(old)
                if chain is not None:
                    if ok:
                        chain._attached(self)
                        self._samplers[seq] = chain
                    else:
                        chain.release()  # not offloadable: llama.cpp did not take it
                        chain._unreserve()
                return ok
        except BaseException:
            if not entered and chain is not None:
                chain._unreserve()
            raise

    def get_sampled_token_ith(self, i: int) -> int:
        i = _batch_index(i, "sampled token")
        with self.in_use() as ptr:
            return int(llama.llama_get_sampled_token_ith(ptr, i))

    def _sampled(self, i: int, count_fn: Any, data_fn: Any, what: str, dtype: Any) -> np.ndarray:
        i = _batch_index(i, what)
        with self.in_use() as ptr:
            n = min(int(count_fn(ptr, i)), self.n_vocab)
            p = data_fn(ptr, i)
            if n == 0 or p == ffi.NULL:
                return np.zeros(0, dtype)
            return self._copy(p, (n,), what, None, dtype)

    def get_sampled_probs_ith(self, i: int) -> np.ndarray:
        return self._sampled(i, llama.llama_get_sampled_probs_count_ith, llama.llama_get_sampled_probs_ith,
                             "sampled probs", np.float32)

    def get_sampled_logits_ith(self, i: int) -> np.ndarray:
        return self._sampled(i, llama.llama_get_sampled_logits_count_ith, llama.llama_get_sampled_logits_ith,
                             "sampled logits", np.float32)

    def get_sampled_candidates_ith(self, i: int) -> np.ndarray:
        return self._sampled(i, llama.llama_get_sampled_candidates_count_ith, llama.llama_get_sampled_candidates_ith,
                             "sampled candidates", np.int32)

    # --- state (per-sequence checkpoints) ----------------------------------

    @staticmethod
    def _check_state_flags(flags: int) -> int:
        if isinstance(flags, bool) or not isinstance(flags, int) or flags & ~_STATE_FLAGS_HOST:
            raise ValueError(
                f"state flags must be 0 or LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (1), got {flags!r} "
                "(ON_DEVICE states live in device memory, which pyspec does not hand out)"
            )
        return flags

    def state_seq_get(self, seq_id: int, flags: int = 0) -> bytes:
        """Mirrors llama_state_seq_get_data_ext: a copy of one sequence's state."""
        seq = self.memory.check_seq(seq_id)
        flags = self._check_state_flags(flags)
        if self._rpc is not None:
            self._rpc.ensure_usable("reading a sequence's state")
        with self.in_use() as ptr:
            size = llama.llama_state_seq_get_size_ext(ptr, seq, flags)
            buf = ffi.new("uint8_t[]", size)
            n = llama.llama_state_seq_get_data_ext(ptr, buf, size, seq, flags)
            return ffi.buffer(buf, n)[:]

    def state_seq_set(self, seq_id: int, data: bytes, flags: int = 0) -> None:
        """Mirrors llama_state_seq_set_data_ext; the data is checked against this context first.

        A state that does not fit this context raises ValueError before llama.cpp reads it;
        one that llama.cpp rejects raises ContextError (and leaves the sequence empty).
        """
        from pyspec.core.state import check_seq_state

        seq = self.memory.check_seq(seq_id)
        flags = self._check_state_flags(flags)
        data = bytes(data)
        if not data:
            raise ValueError("empty state")
        if self._rpc is not None:
            self._rpc.ensure_usable("restoring a sequence's state")
        with self.in_use() as ptr:
            check_seq_state(self, data, flags)
            n = llama.llama_state_seq_set_data_ext(ptr, ffi.from_buffer(data), len(data), seq, flags)
        if n == 0:
            raise ContextError(f"llama_state_seq_set_data rejected the state for seq {seq}")

    # --- threads, perf ------------------------------------------------------

    def set_n_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        nb = n_threads if n_threads_batch is None else n_threads_batch
        for name, v in (("n_threads", n_threads), ("n_threads_batch", nb)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_THREADS:
                raise ValueError(f"{name} must be an int in 1..{MAX_THREADS}, got {v!r}")
        if fork.in_single_thread_child():
            n_threads = nb = 1
        self._check_pool_threads(n_threads, nb)
        with self.in_use() as ptr:
            llama.llama_set_n_threads(ptr, n_threads, nb)
            self._threads = max(n_threads, nb)

    @property
    def n_rs_seq(self) -> int:
        return int(llama.llama_n_rs_seq(self.ptr))

    def synchronize(self) -> None:
        with self.in_use() as ptr:
            llama.llama_synchronize(ptr)

    @property
    def n_threads(self) -> int:
        return int(llama.llama_n_threads(self.ptr))

    @property
    def pooling_type(self) -> str:
        """Mirrors llama_pooling_type: the pooling this context applies, by its enum member's name
        ("none", "mean", "cls", "last", "rank"), the model's own where none was asked."""
        value = int(llama.llama_pooling_type(self.ptr))
        return next((k for k, v in _POOLING.items() if v == value), str(value))

    def perf(self) -> dict[str, float]:
        with self.in_use() as ptr:
            d = llama.llama_perf_context(ptr)
        return {
            "t_start_ms": d.t_start_ms,
            "t_load_ms": d.t_load_ms,
            "t_p_eval_ms": d.t_p_eval_ms,
            "t_eval_ms": d.t_eval_ms,
            "n_p_eval": d.n_p_eval,
            "n_eval": d.n_eval,
            "n_reused": d.n_reused,
        }

    def perf_reset(self) -> None:
        with self.in_use() as ptr:
            llama.llama_perf_context_reset(ptr)

    # --- claiming for a generation -------------------------------------------

    @contextlib.contextmanager
    def claim(self, *, exclusive: bool = False) -> Iterator[None]:
        """Hold this context for one generation (or any sequence of calls that must not be
        interleaved); a second claim (another thread, another generator, a callback) raises
        ConcurrentUseError, and so does any call from another thread while the claim lasts.

        ``exclusive`` also holds the decode guard for the whole time, for C code that
        decodes on this context by itself (the C++ loop); what that code left in the
        output buffers is then forgotten, so the output getters stay bounded.
        """
        self._acquire()  # the closed, busy and fork checks
        self._busy.release()
        if not self._claimed.acquire(blocking=False):
            raise ConcurrentUseError("a generation is already running on this context (another thread or generator)")
        self._claim_owner = threading.get_ident()
        try:
            if exclusive:  # this context's own guard: the caller claims every context the C code uses
                self._acquire()
                try:
                    fork.note_compute(self._threads)
                    yield
                finally:
                    self._forget_outputs()
                    self._busy.release()
            else:
                yield
        finally:
            self._claim_owner = None
            self._claimed.release()

    def _forget_outputs(self) -> None:
        """C code decoded on this context behind our back: nothing is known about its output buffers."""
        self._outputs = np.zeros(0, np.int32)
        self._n_outputs = self._n_tokens = 0
        self._embd_ready = self._nextn_ready = False
        self._layer_inp_ready = _NO_LAYERS

    def close(self) -> None:
        """Free the context (deferred while an MTP/EAGLE3 context still uses it); refused mid-decode."""
        if self._closed:
            return
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError("cannot close a context while another thread is using it")
        try:
            super().close()
        finally:
            self._busy.release()

    def _release_retired(self) -> None:
        # a decode rebuilt the graph without them: the detached chains may go
        retired, self._retired = self._retired, []
        for chain in retired:
            chain._detached()

    def _destroy(self) -> None:
        chains = [*self._samplers.values(), *self._retired]
        self._samplers, self._retired = {}, []
        super()._destroy()  # llama_free first: the chains must outlive the context that uses them
        for chain in chains:
            chain._detached()

    # --- state to bytes and files (pyspec.core.state) ---------------------------

    def state_get(self) -> bytes:
        """Mirrors llama_state_get_data: a copy of the whole context state (its memory, see pyspec.core.state)."""
        return _state.state_get(self)

    def state_set(self, data: bytes) -> None:
        """Mirrors llama_state_set_data: restore a state from state_get."""
        _state.state_set(self, data)

    def state_save_file(self, path: str | os.PathLike[str], tokens: Any = ()) -> None:
        """Mirrors llama_state_save_file: the whole state and the tokens it stands for, to a file."""
        _state.save_file(self, path, tokens)

    def state_load_file(self, path: str | os.PathLike[str]) -> list[int]:
        """Mirrors llama_state_load_file: restore the whole state from a file; returns its tokens."""
        return _state.load_file(self, path)

    def state_seq_save_file(self, path: str | os.PathLike[str], seq_id: int, tokens: Any = ()) -> int:
        """Mirrors llama_state_seq_save_file: one sequence's state and tokens; returns the bytes written."""
        return _state.seq_save_file(self, path, seq_id, tokens)

    def state_seq_load_file(self, path: str | os.PathLike[str], seq_id: int) -> list[int]:
        """Mirrors llama_state_seq_load_file: restore a sequence state into seq_id; returns its tokens."""
        return _state.seq_load_file(self, path, seq_id)

    # --- LoRA adapters and control vectors (pyspec.core.adapters) ---------------

    def set_lora_adapters(self, adapters: _adapters.LoraScales) -> None:
        """Mirrors llama_set_adapters_lora: apply ``{adapter: scale}`` (replacing the previous set)."""
        _adapters.set_lora_adapters(self, adapters)

    def clear_lora_adapters(self) -> None:
        """Remove every LoRA adapter from this context."""
        _adapters.set_lora_adapters(self, {})

    @property
    def lora_adapters(self) -> dict[_adapters.LoraAdapter, float]:
        """The adapters applied to this context, with their scales."""
        return _adapters.applied_lora_adapters(self)

    def set_control_vector(self, directions: Any, il_start: int | None = None, il_end: int | None = None) -> None:
        """Mirrors llama_set_adapter_cvec: ``{layer: vector}`` added after those layers (see pyspec.core.adapters)."""
        _adapters.set_control_vector(self, directions, il_start, il_end)

    def clear_control_vector(self) -> None:
        """Mirrors llama_set_adapter_cvec with no data: remove the control vector."""
        _adapters.set_control_vector(self, None)

    # --- threadpools (pyspec.core.threadpool) -----------------------------------

    @property
    def n_threads_batch(self) -> int:
        """Mirrors llama_n_threads_batch: threads for batches of more than one token."""
        return int(llama.llama_n_threads_batch(self.ptr))

    def attach_threadpool(self, threadpool: ThreadPool, threadpool_batch: ThreadPool | None = None) -> None:
        """Mirrors llama_attach_threadpool: decode on these pools (the second for batches); keeps them alive.

        The context's thread counts become the pools' sizes: an OpenMP build of ggml
        indexes the pool's workers by thread number without a bound, so a context
        asking for more threads than its pool has would crash (set_n_threads refuses it).
        A pool serves one context at a time: two contexts decoding on one pool from two
        threads would run two graphs on the same workers.
        """
        pools = [threadpool]
        if threadpool_batch is not None and threadpool_batch is not threadpool:
            pools.append(threadpool_batch)
        for pool in pools:
            if not isinstance(pool, ThreadPool):
                raise TypeError(f"{pool!r} is not a pyspec ThreadPool")
            _ = pool.ptr  # raises ClosedError first
        with self.in_use() as ptr:
            # take the new pools first (one check-and-set each), so that a refusal keeps the old ones
            prev = [pool.user() for pool in pools]
            taken: list[ThreadPool] = []
            try:
                for pool in pools:
                    pool.take(self)
                    taken.append(pool)
            except ValueError:
                for pool, user in zip(taken, prev, strict=False):
                    pool.set_user(user)
                raise
            for pool in pools:  # held before the old ones are let go: a pool may be both
                self._hold(pool)
            self._release_pools(ptr, keep=pools)
            llama.llama_attach_threadpool(ptr, threadpool.ptr, pools[-1].ptr)
            llama.llama_set_n_threads(ptr, threadpool.n_threads, pools[-1].n_threads)
            self._threads = max(threadpool.n_threads, pools[-1].n_threads)
            self._threadpools = pools

    def _check_pool_threads(self, n_threads: int, n_threads_batch: int) -> None:
        pools = getattr(self, "_threadpools", [])
        if pools and (n_threads > pools[0].n_threads or n_threads_batch > pools[-1].n_threads):
            raise ValueError(
                f"the attached threadpools have {pools[0].n_threads} and {pools[-1].n_threads} threads; "
                f"{n_threads} / {n_threads_batch} would overrun them (detach_threadpool first)"
            )

    def detach_threadpool(self) -> None:
        """Mirrors llama_detach_threadpool: back to llama.cpp's own threads."""
        if not getattr(self, "_threadpools", []):
            return
        with self.in_use() as ptr:
            self._release_pools(ptr)

    def _release_pools(self, ptr: Any, keep: Sequence[ThreadPool] = ()) -> None:
        """Detach the attached pools (the guard held); those in ``keep`` stay this context's."""
        pools = getattr(self, "_threadpools", [])
        if not pools:
            return
        llama.llama_detach_threadpool(ptr)
        self._threadpools = []
        for pool in pools:
            if not any(pool is k for k in keep):
                pool.set_user(None)
            self._unhold(pool)


def _batch_index(i: Any, what: str) -> int:
    """A batch index as the getters' int32_t (llama.cpp answers an index out of range with nothing)."""
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -(2**31) <= int(i) < 2**31:
        raise IndexError(f"{what}: batch index {i!r} out of range")
    return int(i)


class _Held:
    """Context.held()'s context manager: a class, as the sampler takes it on every token
    (a generator-based one costs several times more)."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def __enter__(self) -> Any:
        return self._ctx._enter_compute()

    def __exit__(self, *exc: object) -> None:
        self._ctx._leave()


class _InUse(_Held):
    """Context.in_use()'s context manager (no compute note: the call does not run the graph's threads)."""

    __slots__ = ()

    def __enter__(self) -> Any:
        return self._ctx._enter()


class _HeldAlone(_Held):
    """Context.held_alone()'s context manager: this context's own guard, with the compute note."""

    __slots__ = ()

    def __enter__(self) -> Any:
        ctx = self._ctx
        ptr = ctx._acquire()
        try:
            fork.note_compute(ctx._threads)
        except BaseException:
            ctx._busy.release()
            raise
        return ptr

    def __exit__(self, *exc: object) -> None:
        self._ctx._busy.release()
