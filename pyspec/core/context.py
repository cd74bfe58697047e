"""A llama_context: decode/encode, outputs as numpy views, memory, state."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from pyspec.core import adapters as _adapters
from pyspec.core import state as _state
from pyspec.core.batch import Batch, BatchView
from pyspec.core.handle import Handle
from pyspec.core.memory import Memory
from pyspec.core.model import Model
from pyspec.core.threadpool import ThreadPool
from pyspec.errors import ConcurrentUseError, ContextError, decode_error
from pyspec.ffi import c_enum, ext, ffi, llama

__all__ = ["AnyBatch", "Context"]

AnyBatch = Batch | BatchView

_CTX_TYPES = c_enum("enum llama_context_type", "LLAMA_CONTEXT_TYPE_")
_FLASH_ATTN: dict[Any, int] = c_enum("enum llama_flash_attn_type", "LLAMA_FLASH_ATTN_TYPE_")
_FLASH_ATTN.update({False: _FLASH_ATTN["disabled"], True: _FLASH_ATTN["enabled"]})
# the K/V cache types llama.cpp offers (common/arg.cpp kv_cache_types); the other
# ggml types are not cache types and may abort inside llama.cpp
_KV_TYPES = {k: v for k, v in c_enum("enum ggml_type", "GGML_TYPE_").items()
             if k in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")}
# fields set through a converter below rather than copied as they are
_SPECIAL = {"ctx_type", "flash_attn_type", "type_k", "type_v", "ctx_other", "samplers"}
_FIELDS = {name for name, _ in ffi.typeof("struct llama_context_params").fields}
_POINTER_FIELDS = {"cb_eval", "cb_eval_user_data", "abort_callback", "abort_callback_data", "n_samplers"}
# architectures whose graph (src/models/<arch>.cpp) records each layer's input: on any
# other, a decode with set_embeddings_layer_inp enabled hits a GGML_ASSERT and aborts
_LAYER_INP_ARCHS = {"llama", "qwen3", "qwen3moe", "gpt-oss", "gemma4"}


def _convert(table: dict[Any, int], name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value in table.values():
        return value
    if value in table:
        return table[value]
    raise ValueError(f"{name} must be one of {sorted(str(k) for k in table)}, not {value!r}")


class Context(Handle):
    """Mirrors llama_init_from_model / llama_free (llama.h).

    Keyword arguments are the fields of ``llama_context_params`` (n_ctx,
    n_batch, n_ubatch, n_seq_max, n_rs_seq, n_threads, embeddings, ...);
    ``ctx_type`` takes "default" or "mtp", ``flash_attn_type`` "auto" /
    "enabled" / "disabled", ``type_k``/``type_v`` a cache type name, and
    ``ctx_other`` another Context, which this one keeps alive.
    """

    _kind = "context"

    def __init__(self, model: Model, **params: Any) -> None:
        super().__init__()
        self._busy = threading.Lock()  # held while llama.cpp runs on this context
        self._claimed = threading.Lock()  # held for a whole generation (see claim)
        self.t_decode_ns = 0  # wall time spent in llama_decode / llama_encode, for statistics
        unknown = set(params) - _FIELDS - {"samplers"}
        if unknown:
            raise TypeError(f"unknown llama_context_params field(s): {', '.join(sorted(unknown))}")
        bad_ptr = set(params) & _POINTER_FIELDS
        if bad_ptr:
            raise TypeError(f"field(s) {', '.join(sorted(bad_ptr))} are not settable from Python")
        cparams = llama.llama_context_default_params()
        n_cpu = os.cpu_count() or 1
        cparams.n_threads = n_cpu
        cparams.n_threads_batch = n_cpu
        for name, value in params.items():
            if name not in _SPECIAL:
                is_count = name.startswith("n_") and name not in ("n_threads", "n_threads_batch")
                if is_count and isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                    raise ValueError(f"{name} must be >= 0, got {value}")
                try:
                    setattr(cparams, name, value)
                except OverflowError as e:
                    raise ValueError(f"{name}={value!r} out of range") from e
        if "ctx_type" in params:
            cparams.ctx_type = _convert(_CTX_TYPES, "ctx_type", params["ctx_type"])
        if "flash_attn_type" in params:
            cparams.flash_attn_type = _convert(_FLASH_ATTN, "flash_attn_type", params["flash_attn_type"])
        for name in ("type_k", "type_v"):
            if name in params:
                setattr(cparams, name, _convert(_KV_TYPES, name, params[name]))
        if cparams.n_seq_max == 0:
            raise ValueError("n_seq_max must be >= 1")
        if cparams.n_ubatch > cparams.n_batch and cparams.n_batch > 0:
            # llama.cpp clamps n_ubatch to n_batch; do it explicitly so n_ubatch reads back true
            cparams.n_ubatch = cparams.n_batch

        if cparams.ctx_type == _CTX_TYPES["mtp"]:
            # llama.cpp refuses this too, but only with a log line; say why here
            arch = model.meta("general.architecture") or "?"
            if int(model.meta(f"{arch}.nextn_predict_layers") or 0) <= 0:
                raise ValueError(
                    f"ctx_type='mtp' needs a model with MTP (NextN) layers; this {arch} model has none "
                    f"({arch}.nextn_predict_layers is absent or 0)"
                )

        self.model = model
        self.other: Context | None = params.get("ctx_other")
        deps: tuple[Handle, ...] = (model,)
        if self.other is not None:
            if not isinstance(self.other, Context):
                raise TypeError("ctx_other must be a pyspec Context")
            cparams.ctx_other = self.other.ptr
            deps = (model, self.other)
        # backend sampler chains given at creation: {seq_id: SamplerChain}
        self._samplers: dict[int, Any] = {}
        samplers = params.get("samplers") or {}
        if samplers:
            cfg = ffi.new("struct llama_sampler_seq_config[]", len(samplers))
            for k, (seq, chain) in enumerate(samplers.items()):
                cfg[k].seq_id = seq
                cfg[k].sampler = chain.ptr
            cparams.samplers = cfg
            cparams.n_samplers = len(samplers)

        # a model on rpc-servers: its calls go through the RPC guard (pyspec.core.rpc)
        self._rpc = model.rpc
        if self._rpc is not None:
            ptr = self._rpc.init_context(model.ptr, cparams)
        else:
            ptr = llama.llama_init_from_model(model.ptr, cparams)
        if ptr == ffi.NULL:
            raise ContextError("llama_init_from_model failed (see the pyspec.llama log for the reason)")
        self._own(ptr, self._rpc.free(llama.llama_free) if self._rpc is not None else llama.llama_free, deps)
        self._samplers.update(samplers)
        self.params = cparams
        self.n_vocab = model.vocab.n_tokens
        self.n_seq_max = int(llama.llama_n_seq_max(ptr))
        self.n_batch = int(llama.llama_n_batch(ptr))
        self.n_ubatch = int(llama.llama_n_ubatch(ptr))
        self.n_ctx = int(llama.llama_n_ctx(ptr))
        self.n_ctx_seq = int(llama.llama_n_ctx_seq(ptr))  # positions each sequence may use
        self.n_embd = model.n_embd
        self.n_embd_out = model.n_embd_out
        self.memory = Memory(self)
        # what the C output buffer holds after the last decode/encode, to bound the views
        self._embeddings = bool(cparams.embeddings)
        self._n_outputs = 0
        self._nextn_masked = True
        self._layer_inp_on: set[int] = set()
        self._layer_inp_ready: set[int] = set()

    # --- decode -----------------------------------------------------------

    def _bad_token(self, batch: AnyBatch) -> int | None:
        """A token of the batch outside the vocabulary (llama_decode refuses such a batch with -1)."""
        if batch.token is None or batch.n_tokens <= 0:
            return None
        toks = batch.token[: batch.n_tokens]
        lo, hi = int(toks.min()), int(toks.max())
        if lo < 0 or hi >= self.n_vocab:
            return lo if lo < 0 else hi
        return None

    def _check_batch(self, batch: AnyBatch) -> None:
        # what llama_decode would abort on, or read out of bounds for
        self.check_open()
        n = batch.n_tokens
        if n <= 0:
            raise ValueError("batch is empty")
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        if batch.token is None and batch.embd is not None and batch.n_embd != self.model.n_embd_inp_or_embd():
            raise ValueError(
                f"batch embeddings have width {batch.n_embd}, the model expects {self.model.n_embd_inp_or_embd()}"
            )
        nsi = batch.n_seq_id[:n]
        if int(nsi.min()) < 1 or int(nsi.max()) > min(batch.n_seq_max, self.n_seq_max):
            raise ValueError(f"each token needs 1..{self.n_seq_max} sequence ids")
        if batch.n_seq_max == 1 or int(nsi.max()) == 1:
            sid = batch.seq_id[:n, 0]
        else:
            mask = np.arange(batch.n_seq_max)[None, :] < nsi[:, None]
            sid = batch.seq_id[:n][mask]
        lo, hi = int(sid.min()), int(sid.max())
        if lo < 0 or hi >= self.n_seq_max:
            bad = lo if lo < 0 else hi
            raise ValueError(f"seq_id {bad} out of range 0..{self.n_seq_max - 1}")

    def _enter(self) -> None:
        # a llama_context is not thread-safe: a second thread is refused, not interleaved
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError("this context is in use by another thread; give each thread its own Context")

    def decode(self, batch: AnyBatch) -> None:
        """Mirrors llama_decode (llama.h); a non-zero result raises DecodeError, a token outside
        the vocabulary ValueError."""
        self.check_open()
        bad = self._bad_token(batch)
        if bad is not None:
            raise ValueError(f"token {bad} is outside the vocabulary (0..{self.n_vocab - 1})")
        rc = self.decode_rc(batch)
        if rc != 0:
            raise decode_error(rc, "llama_decode")

    def decode_rc(self, batch: AnyBatch) -> int:
        """llama_decode returning the code, for loops that mirror C++ `ret != 0` checks.

        A batch that llama_decode refuses itself (a token outside the vocabulary) returns its
        -1, as in the C++, where e.g. a draft context whose vocabulary lacks a target token
        makes the draft stop; what it would abort on raises ValueError."""
        self._check_batch(batch)
        self._enter()
        t0 = time.perf_counter_ns()
        try:
            if self._rpc is not None:
                rc = self._rpc.decode(self._ptr, batch.c[0])
            else:
                rc = int(llama.llama_decode(self._ptr, batch.c[0]))
            self.t_decode_ns += time.perf_counter_ns() - t0
            n = batch.n_tokens
            self._n_outputs = (n if self._embeddings else int(np.count_nonzero(batch.logits[:n]))) if rc == 0 else 0
            self._layer_inp_ready = set(self._layer_inp_on) if rc == 0 else set()
            return rc
        finally:
            self._busy.release()

    def encode(self, batch: AnyBatch) -> None:
        """Mirrors llama_encode (llama.h); a non-zero result raises DecodeError."""
        rc = self.encode_rc(batch)
        if rc != 0:
            raise decode_error(rc, "llama_encode")

    def encode_rc(self, batch: AnyBatch) -> int:
        self.check_open()
        if batch.n_tokens <= 0:
            raise ValueError("batch is empty")
        if batch.n_tokens > self.n_ubatch:
            raise ValueError(f"encoder batch of {batch.n_tokens} tokens exceeds n_ubatch={self.n_ubatch}")
        if not self.model.has_encoder:
            # llama_encode on a decoder-only model crashes at this revision
            raise ValueError("llama_encode needs a model with an encoder (T5, EAGLE3); use decode() for this model")
        self._enter()
        t0 = time.perf_counter_ns()
        try:
            if self._rpc is not None:
                rc = self._rpc.encode(self._ptr, batch.c[0])
            else:
                rc = int(llama.llama_encode(self._ptr, batch.c[0]))
            self.t_decode_ns += time.perf_counter_ns() - t0
            self._n_outputs = batch.n_tokens if rc == 0 else 0
            return rc
        finally:
            self._busy.release()

    # --- outputs (numpy views over C memory, valid until the next decode) ---

    def _check_rows(self, n: int, what: str, n_max: int | None = None) -> None:
        # a view past the rows llama.cpp wrote would read (or crash on) memory it does not own;
        # its output buffer holds at least max(outputs of the last decode, n_seq_max) rows
        self.check_open()
        limit = max(self._n_outputs, self.n_seq_max) if n_max is None else n_max
        if not 0 <= n <= limit:
            raise IndexError(f"{what}: {n} rows requested, the last decode produced at most {limit}")

    def _view(self, p: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
        if p == ffi.NULL:
            raise IndexError(f"{what} not available (no such output row, or outputs not requested)")
        n = 1
        for s in shape:
            n *= s
        return np.frombuffer(ffi.buffer(p, 4 * n), dtype=np.float32).reshape(shape)

    def get_logits_ith(self, i: int) -> np.ndarray:
        """Mirrors llama_get_logits_ith: the logits row of batch index i (negative counts from the end)."""
        return self._view(llama.llama_get_logits_ith(self.ptr, i), (self.n_vocab,), f"logits for index {i}")

    def get_logits(self, n_outputs: int) -> np.ndarray:
        """Mirrors llama_get_logits: the first n_outputs rows as an (n_outputs, n_vocab) view."""
        self._check_rows(n_outputs, "logits")
        return self._view(llama.llama_get_logits(self.ptr), (n_outputs, self.n_vocab), "logits")

    def get_embeddings_ith(self, i: int) -> np.ndarray:
        return self._view(llama.llama_get_embeddings_ith(self.ptr, i), (self.n_embd_out,), f"embeddings for index {i}")

    def get_embeddings(self, n_outputs: int) -> np.ndarray:
        self._check_rows(n_outputs, "embeddings")
        return self._view(llama.llama_get_embeddings(self.ptr), (n_outputs, self.n_embd_out), "embeddings")

    def get_embeddings_seq(self, seq_id: int) -> np.ndarray:
        return self._view(llama.llama_get_embeddings_seq(self.ptr, seq_id), (self.n_embd_out,),
                          f"embeddings of seq {seq_id}")

    def set_embeddings(self, value: bool) -> None:
        llama.llama_set_embeddings(self.ptr, value)
        self._embeddings = bool(value)

    # --- staging API of llama-ext.h (through the pyspec_ext shim) ---------

    def set_embeddings_nextn(self, value: bool, masked: bool) -> None:
        ext.pyspec_set_embeddings_nextn(self.ptr, value, masked)
        self._nextn_masked = bool(masked)

    def get_embeddings_nextn(self, n_rows: int) -> np.ndarray:
        # unmasked: one row per batch token (n_batch rows); masked: one per output
        self._check_rows(n_rows, "nextn embeddings", None if self._nextn_masked else self.n_batch)
        return self._view(ext.pyspec_get_embeddings_nextn(self.ptr), (n_rows, self.n_embd), "nextn embeddings")

    def get_embeddings_nextn_ith(self, i: int) -> np.ndarray:
        return self._view(ext.pyspec_get_embeddings_nextn_ith(self.ptr, i), (self.n_embd,),
                          f"nextn embeddings for index {i}")

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
        ext.pyspec_set_embeddings_layer_inp(self.ptr, layer, value)
        (self._layer_inp_on.add if value else self._layer_inp_on.discard)(layer)

    def get_embeddings_layer_inp(self, layer: int, n_tokens: int) -> np.ndarray:
        if not 0 <= layer < self.model.n_layer:
            raise ValueError(f"layer {layer} out of range 0..{self.model.n_layer - 1}")
        if layer not in self._layer_inp_ready:
            # llama.cpp asserts (aborts) when the layer's buffer was not filled by a decode
            raise IndexError(f"layer {layer} input not available: "
                             f"enable set_embeddings_layer_inp({layer}, True), then decode")
        self._check_rows(n_tokens, f"layer {layer} input", self.n_batch)
        return self._view(ext.pyspec_get_embeddings_layer_inp(self.ptr, layer), (n_tokens, self.n_embd),
                          f"layer {layer} input")

    def get_ctx_other_ptr(self):
        return ext.pyspec_get_ctx_other(self.ptr)

    # --- backend sampling --------------------------------------------------

    def set_sampler(self, seq_id: int, chain: Any) -> bool:
        """Mirrors llama_set_sampler: attach a sampler chain (or None) to seq_id; keeps it alive."""
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} out of range 0..{self.n_seq_max - 1}")
        ok = bool(llama.llama_set_sampler(self.ptr, seq_id, chain.ptr if chain is not None else ffi.NULL))
        if ok and chain is not None:
            self._samplers[seq_id] = chain
        elif chain is None:
            self._samplers.pop(seq_id, None)
        return ok

    def get_sampled_token_ith(self, i: int) -> int:
        return int(llama.llama_get_sampled_token_ith(self.ptr, i))

    def get_sampled_probs_ith(self, i: int) -> np.ndarray:
        n = llama.llama_get_sampled_probs_count_ith(self.ptr, i)
        p = llama.llama_get_sampled_probs_ith(self.ptr, i)
        return np.zeros(0, np.float32) if n == 0 or p == ffi.NULL else self._view(p, (n,), "sampled probs")

    def get_sampled_logits_ith(self, i: int) -> np.ndarray:
        n = llama.llama_get_sampled_logits_count_ith(self.ptr, i)
        p = llama.llama_get_sampled_logits_ith(self.ptr, i)
        return np.zeros(0, np.float32) if n == 0 or p == ffi.NULL else self._view(p, (n,), "sampled logits")

    def get_sampled_candidates_ith(self, i: int) -> np.ndarray:
        n = llama.llama_get_sampled_candidates_count_ith(self.ptr, i)
        p = llama.llama_get_sampled_candidates_ith(self.ptr, i)
        if n == 0 or p == ffi.NULL:
            return np.zeros(0, np.int32)
        return np.frombuffer(ffi.buffer(p, 4 * n), dtype=np.int32)

    # --- state (per-sequence checkpoints) ----------------------------------

    def state_seq_get(self, seq_id: int, flags: int = 0) -> bytes:
        """Mirrors llama_state_seq_get_data_ext: a copy of one sequence's state."""
        seq = self.memory.check_seq(seq_id)
        if self._rpc is not None:
            self._rpc.ensure_usable("reading a sequence's state")
        size = llama.llama_state_seq_get_size_ext(self.ptr, seq, flags)
        buf = ffi.new("uint8_t[]", size)
        n = llama.llama_state_seq_get_data_ext(self.ptr, buf, size, seq, flags)
        return ffi.buffer(buf, n)[:]

    def state_seq_set(self, seq_id: int, data: bytes, flags: int = 0) -> None:
        """Mirrors llama_state_seq_set_data_ext; raises if llama.cpp rejects the data."""
        seq = self.memory.check_seq(seq_id)
        if not data:
            raise ValueError("empty state")
        if self._rpc is not None:
            self._rpc.ensure_usable("restoring a sequence's state")
        n = llama.llama_state_seq_set_data_ext(self.ptr, ffi.from_buffer(data), len(data), seq, flags)
        if n == 0:
            raise ContextError(f"llama_state_seq_set_data rejected the state for seq {seq}")

    # --- threads, perf ------------------------------------------------------

    def set_n_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        if n_threads <= 0 or (n_threads_batch is not None and n_threads_batch <= 0):
            raise ValueError("thread counts must be positive")
        self._check_pool_threads(n_threads, n_threads_batch or n_threads)
        llama.llama_set_n_threads(self.ptr, n_threads, n_threads_batch or n_threads)

    @property
    def n_rs_seq(self) -> int:
        return int(llama.llama_n_rs_seq(self.ptr))

    def synchronize(self) -> None:
        llama.llama_synchronize(self.ptr)

    @property
    def n_threads(self) -> int:
        return int(llama.llama_n_threads(self.ptr))

    def perf(self) -> dict[str, float]:
        d = llama.llama_perf_context(self.ptr)
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
        llama.llama_perf_context_reset(self.ptr)

    # --- claiming for a generation -------------------------------------------

    @contextlib.contextmanager
    def claim(self, *, exclusive: bool = False) -> Iterator[None]:
        """Hold this context for one generation; a second claim (another thread, another
        generator, a callback) raises ConcurrentUseError instead of interleaving its memory edits.

        ``exclusive`` also holds the decode guard for the whole time, for C code that
        decodes on this context by itself (the C++ loop); what that code left in the
        output buffers is then forgotten, so the output views stay bounded.
        """
        self.check_open()
        if not self._claimed.acquire(blocking=False):
            raise ConcurrentUseError("a generation is already running on this context (another thread or generator)")
        try:
            if exclusive:
                self._enter()
                try:
                    yield
                finally:
                    self._n_outputs = 0
                    self._layer_inp_ready = set()
                    self._busy.release()
            else:
                yield
        finally:
            self._claimed.release()

    def close(self) -> None:
        """Free the context (deferred while an MTP/EAGLE3 context still uses it); refused mid-decode."""
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError("cannot close a context while another thread is decoding on it")
        try:
            super().close()
        finally:
            self._busy.release()

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
            user = pool.user()
            if user is not None and user is not self and not user.closed:
                raise ValueError(f"{pool!r} is attached to another context; detach it there first")
        self.detach_threadpool()
        self._enter()
        try:
            for pool in pools:
                self._hold(pool)
                pool.set_user(self)
            llama.llama_attach_threadpool(self.ptr, threadpool.ptr, pools[-1].ptr)
            llama.llama_set_n_threads(self.ptr, threadpool.n_threads, pools[-1].n_threads)
            self._threadpools = pools
        finally:
            self._busy.release()

    def _check_pool_threads(self, n_threads: int, n_threads_batch: int) -> None:
        pools = getattr(self, "_threadpools", [])
        if pools and (n_threads > pools[0].n_threads or n_threads_batch > pools[-1].n_threads):
            raise ValueError(
                f"the attached threadpools have {pools[0].n_threads} and {pools[-1].n_threads} threads; "
                f"{n_threads} / {n_threads_batch} would overrun them (detach_threadpool first)"
            )

    def detach_threadpool(self) -> None:
        """Mirrors llama_detach_threadpool: back to llama.cpp's own threads."""
        pools = getattr(self, "_threadpools", [])
        if not pools:
            return
        self._enter()
        try:
            llama.llama_detach_threadpool(self.ptr)
            self._threadpools = []
            for pool in pools:
                pool.set_user(None)
                self._unhold(pool)
        finally:
            self._busy.release()
