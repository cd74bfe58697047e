"""The helpers of llama.cpp's common/common.{h,cpp} that the port uses."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pyspec.core.batch import Batch, BatchExt, BatchView
from pyspec.core.threadpool import THREAD_PRIORITIES, ThreadPool
from pyspec.errors import SpeculativeError
from pyspec.ffi import c_const

if TYPE_CHECKING:
    from pyspec.core.context import Context
    from pyspec.core.vocab import Vocab

logger = logging.getLogger("pyspec")

__all__ = [
    "COMMON_CPU_PARAMS_DEFAULT",
    "GGML_MROPE_SECTIONS",
    "LLAMA_PROCESS_TYPE_DECODE",
    "LLAMA_PROCESS_TYPE_ENCODE",
    "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "LLAMA_TOKEN_NULL",
    "CommonBatch",
    "CommonBatchToken",
    "CommonContextSeqRmType",
    "CommonCpuParams",
    "CommonPromptCheckpoint",
    "CommonThreadpools",
    "CommonTimeMeas",
    "common_batch_get_one",
    "common_context_can_seq_rm",
    "common_context_seq_rm",
    "common_detokenize",
    "common_token_to_piece",
    "common_tokenize",
    "ggml_time_us",
    "llama_process",
]

LLAMA_TOKEN_NULL = -1
GGML_MROPE_SECTIONS = 4

LLAMA_PROCESS_TYPE_ENCODE = c_const("LLAMA_PROCESS_TYPE_ENCODE")
LLAMA_PROCESS_TYPE_DECODE = c_const("LLAMA_PROCESS_TYPE_DECODE")


def ggml_time_us() -> int:
    """Monotonic microseconds, as ggml_time_us (ggml.c)."""
    return time.monotonic_ns() // 1000


class CommonTimeMeas:
    """Mirrors struct common_time_meas (common.h): adds the elapsed time to ``owner.attr``.

    Used as ``with CommonTimeMeas(impl, "t_draft_us", disable):`` where the C++
    keeps an ``int64_t &`` to the accumulator.
    """

    __slots__ = ("attr", "owner", "t_start_us")

    def __init__(self, owner: object, attr: str, disable: bool = False) -> None:
        self.owner = owner
        self.attr = attr
        self.t_start_us = -1 if disable else ggml_time_us()

    def __enter__(self) -> CommonTimeMeas:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.t_start_us >= 0:
            setattr(self.owner, self.attr, getattr(self.owner, self.attr) + ggml_time_us() - self.t_start_us)


@dataclass(frozen=True)
class CommonCpuParams:
    """Mirrors struct common_cpu_params (common.h): the threads of one threadpool, where they may run, their
    priority and how long they poll for work before sleeping.

    ``n_threads`` -1 takes the context's own count; ``cpumask`` is the CPU numbers the threads may run on
    (``mask_valid``), None any CPU; ``priority`` one of ThreadPool's names ("normal", "medium", ...).
    """

    n_threads: int = -1
    cpumask: tuple[int, ...] | None = None
    priority: str = "normal"
    strict_cpu: bool = False
    poll: int = 50

    def __post_init__(self) -> None:
        # refused here, where the caller made them, not when a pool is made from them
        if isinstance(self.n_threads, bool) or not isinstance(self.n_threads, int) or \
                not (self.n_threads == -1 or self.n_threads >= 1):
            raise ValueError(f"n_threads must be -1 (the context's) or >= 1, not {self.n_threads!r}")
        if isinstance(self.poll, bool) or not isinstance(self.poll, int) or not 0 <= self.poll <= 100:
            raise ValueError(f"poll must be an int in 0..100, not {self.poll!r}")
        if self.priority not in THREAD_PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(THREAD_PRIORITIES)}, not {self.priority!r}")


COMMON_CPU_PARAMS_DEFAULT = CommonCpuParams()  # common_params' cpuparams before any option


class CommonThreadpools:
    """Mirrors struct common_threadpools (common.h): the pools common_init_result attaches to its context, so
    that a decode reuses its threads instead of setting up a pool of its own each time."""

    def __init__(self) -> None:
        self.threadpool: ThreadPool | None = None
        self.threadpool_batch: ThreadPool | None = None

    def init(self, ctx: Context, cpuparams: CommonCpuParams, cpuparams_batch: CommonCpuParams) -> None:
        """Mirrors common_threadpools::init (common.cpp).

        A pool for batches is made only where its parameters differ from the one-token pool's (which then
        starts paused, as there); a pool that cannot be made is logged and the context keeps llama.cpp's own
        threads. ``n_threads`` -1 resolves to the context's counts (the C++ resolves it earlier, in
        common_params' post-processing)."""
        assert self.threadpool is None and self.threadpool_batch is None

        tpp = _resolved(cpuparams, ctx.n_threads)
        tpp_batch = _resolved(cpuparams_batch, ctx.n_threads_batch)
        logger.debug("llama threadpool init, n_threads = %d", tpp.n_threads)

        paused = False
        try:
            if tpp != tpp_batch:  # ggml_threadpool_params_match
                self.threadpool_batch = _threadpool_new(tpp_batch)
                # start the non-batch threadpool in the paused state
                paused = True
            self.threadpool = _threadpool_new(tpp, paused=paused)
        except RuntimeError as e:  # ggml_threadpool_new failed
            logger.warning("threadpool create failed : n_threads %d (%s)", tpp.n_threads, e)
            self.close()
            return

        ctx.attach_threadpool(self.threadpool, self.threadpool_batch)

    def pools(self) -> list[ThreadPool]:
        """The pools made (for their owner to close after the context)."""
        return [p for p in (self.threadpool, self.threadpool_batch) if p is not None]

    def close(self) -> None:
        for p in self.pools():
            p.close()
        self.threadpool = self.threadpool_batch = None


def _resolved(params: CommonCpuParams, n_threads: int) -> CommonCpuParams:
    return params if params.n_threads > 0 else dataclasses.replace(params, n_threads=n_threads)


def _threadpool_new(p: CommonCpuParams, paused: bool = False) -> ThreadPool:
    # ggml_threadpool_params_from_cpu_params, then ggml_threadpool_new
    return ThreadPool(p.n_threads, prio=p.priority, poll=p.poll, strict_cpu=p.strict_cpu, paused=paused,
                      cpumask=p.cpumask)


def _embd_rows(embd: Any) -> np.ndarray:
    # a llama_embd {data, n_rows, n_embd} is a float32 [n_rows, n_embd] array here (a 1-D row is one row)
    rows = np.asarray(embd, dtype=np.float32)
    return rows.reshape(1, -1) if rows.ndim == 1 else rows


@dataclass(slots=True)
class CommonBatchToken:
    """Mirrors struct common_batch::token (common.h): one entry of the batch.

    ``embd`` is the non-owning llama_embd view of the C++: the caller's float32 rows
    (``[n_rows, n_embd]``), or None where the C++ holds data == NULL.
    """

    id: int
    pos: list[int]  # GGML_MROPE_SECTIONS positions, only pos[0] is used for text tokens
    seq_id: int  # the first sequence id, see add_seq()
    output: bool
    embd: np.ndarray | None = None
    seq_ids_extra: list[int] = field(default_factory=list)  # see add_seq()


class CommonBatch:
    """Mirrors struct common_batch (common.h): the entries, and the llama_batch_ext they are rendered into.

    Entries can exceed n_batch; get_sub_batch() renders a range of them for one llama_process.
    ``CommonBatch()`` without a context (the C++ default constructor) holds entries only:
    enough for common_speculative_process, whose implementations copy the entries into their own batches.
    """

    def __init__(self, ctx: Any = None) -> None:
        self.tokens: list[CommonBatchToken] = []  # mirror of the entries, tokens[i] describes batch index i
        self.batch: Any = None  # llama_batch_ext_ptr
        self.n_pos = 1  # positions per embedding entry, GGML_MROPE_SECTIONS for MROPE/IMROPE
        if ctx is not None:
            self.batch = BatchExt.init(ctx)
            rope_type = ctx.model.rope_type
            self.n_pos = GGML_MROPE_SECTIONS if rope_type in ("mrope", "imrope") else 1

    def close(self) -> None:
        """Frees the llama_batch_ext (the C++ llama_batch_ext_ptr's deleter)."""
        if self.batch is not None:
            self.batch.free()
            self.batch = None

    def get(self) -> Any:
        return self.get_sub_batch(0, self.size())

    def get_sub_batch(self, off: int, n: int) -> Any:
        """Mirrors common_batch::get_sub_batch: renders entries [off, off + n) into the llama_batch_ext."""
        if self.batch is None:
            raise SpeculativeError("GGML_ASSERT(batch && \"common_batch was not initialized with a context\") failed")
        if not (off >= 0 and n >= 0 and off + n <= self.size()):
            raise SpeculativeError("GGML_ASSERT(off >= 0 && n >= 0 && off + n <= size()) failed")

        res = self.batch
        res.clear()

        # BatchExt raises where the C++ aborts (a full batch, an invalid token, embedding or
        # sequence id): BatchFullError / ValueError with llama_batch_ext's reason
        for i in range(off, off + n):
            t = self.tokens[i]

            if t.id != LLAMA_TOKEN_NULL:
                idx = res.add_token(t.seq_id, t.id)
                res.set_pos(idx, t.pos)
                if t.embd is not None:
                    res.set_embd_token(idx, t.embd)
            else:
                idx = res.add_embd(t.seq_id, t.embd)
                res.set_pos(idx, t.pos)
            if idx != i - off:
                raise SpeculativeError("GGML_ASSERT(idx == i - off) failed")

            for seq_id in t.seq_ids_extra:
                res.add_seq(idx, seq_id)
            if t.output:
                res.set_output_logits(idx, True)

        return res

    # content type of the batch, all entries carry the same combination
    def has_token(self) -> bool:
        return len(self.tokens) > 0 and self.tokens[0].id != LLAMA_TOKEN_NULL

    def has_embd(self) -> bool:
        return len(self.tokens) > 0 and self.tokens[0].embd is not None

    def clear(self) -> None:
        self.tokens.clear()

    def add(self, id: int, pos: int, seq_id: int | Sequence[int], output: bool) -> int:
        """Mirrors both common_batch::add overloads; returns the batch index."""
        if not isinstance(seq_id, (int, np.integer)):
            seq_ids = list(seq_id)
            if not seq_ids:
                raise SpeculativeError("GGML_ASSERT(!seq_ids.empty()) failed")
            idx = self.add(id, pos, int(seq_ids[0]), output)
            for s in seq_ids[1:]:
                self.add_seq(idx, int(s))
            return idx
        self.tokens.append(CommonBatchToken(int(id), [int(pos), 0, 0, 0], int(seq_id), bool(output)))
        return self.size() - 1

    def add_seq(self, idx: int, seq_id: int) -> bool:
        """Add the entry at idx to another sequence; tokens[idx].seq_id keeps the first one."""
        if idx < 0 or idx >= self.size():
            return False
        self.tokens[idx].seq_ids_extra.append(seq_id)
        return True

    def set_output(self, idx: int, value: bool) -> bool:
        if idx < 0 or idx >= self.size():
            return False
        self.tokens[idx].output = value
        return True

    def set_embd(self, idx: int, embd: Any) -> bool:
        """Attach a token embedding to the entry at idx; can only be set once per entry."""
        if idx < 0 or idx >= self.size() or self.tokens[idx].embd is not None:
            return False
        self.tokens[idx].embd = _embd_rows(embd)
        return True

    def add_embd(self, embd: Any, pos: Sequence[int], seq_id: int, output: bool) -> int:
        """Add an embedding-only entry (no token id); pos holds n_pos positions."""
        t = CommonBatchToken(LLAMA_TOKEN_NULL, [0, 0, 0, 0], seq_id, output, _embd_rows(embd))
        for j in range(self.n_pos):
            t.pos[j] = int(pos[j])
        self.tokens.append(t)
        return self.size() - 1

    def size(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_llama_batch(cls, batch: Batch | BatchView, ctx: Any = None) -> CommonBatch:
        """The entries of a llama_batch as a common_batch (not in the C++: the loop that builds a
        llama_batch for the target hands the same rows to common_speculative_process)."""
        out = cls(ctx)
        n = batch.n_tokens
        token, embd = batch.token, batch.embd
        pos, n_seq_id, seq_id, logits = batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        for k in range(n):
            seqs = [int(s) for s in seq_id[k, : int(n_seq_id[k])]]
            if token is not None:
                idx = out.add(int(token[k]), int(pos[k]), seqs[0], bool(logits[k]))
                if embd is not None:
                    out.set_embd(idx, embd[k : k + 1])
            else:
                assert embd is not None
                idx = out.add_embd(embd[k : k + 1], [int(pos[k])] * out.n_pos, seqs[0], bool(logits[k]))
            out.tokens[idx].seq_ids_extra = seqs[1:]
        return out


def common_batch_get_one(ctx: Any, tokens: Sequence[int]) -> CommonBatch:
    """Mirrors common_batch_get_one (common.cpp): positions continue from the memory, the last token is output."""
    batch = CommonBatch(ctx)

    pos = ctx.memory.seq_pos_max(0) + 1  # -1 + 1 == 0 when the memory is empty

    n_tokens = len(tokens)
    for i in range(n_tokens):
        output = i == n_tokens - 1
        batch.add(tokens[i], pos, 0, output)
        pos += 1

    return batch


def llama_process(ctx: Any, type: int, batch: Any) -> int:
    """llama_process (llama.h) on a pyspec Context: the one place the port calls it, returns its status."""
    rc: int = ctx.process_rc(batch, type)
    return rc


def common_tokenize(vocab: Vocab, text: str, add_special: bool, parse_special: bool = False) -> list[int]:
    """Mirrors common_tokenize (common.cpp)."""
    return vocab.tokenize(text, add_special, parse_special)


def common_token_to_piece(vocab: Vocab, token: int, special: bool = True) -> str:
    """Mirrors common_token_to_piece (common.cpp)."""
    return vocab.token_to_piece(token, special)


def common_detokenize(vocab: Vocab, tokens: list[int], special: bool = True) -> str:
    """Mirrors common_detokenize (common.cpp)."""
    return vocab.detokenize(tokens, False, special)


class CommonContextSeqRmType:
    """Mirrors enum common_context_seq_rm_type (common.h)."""

    NO = 0    # seq_rm not supported (e.g. no memory module)
    PART = 1  # can seq_rm partial sequences
    FULL = 2  # can seq_rm full sequences only
    RS = 3    # can seq_rm partial sequences, bounded by n_rs_seq


def common_context_can_seq_rm(ctx: Any) -> int:
    """Mirrors common_context_can_seq_rm (common.cpp). Clears the context's memory, as the C++ does."""
    mem = ctx.memory
    if mem is None:
        return CommonContextSeqRmType.NO

    if ctx.n_rs_seq > 0:
        # the context supports bounded partial sequence removal
        return CommonContextSeqRmType.RS

    res = CommonContextSeqRmType.PART

    mem.clear(True)

    # eval 2 tokens to check if the context is compatible
    tmp = [0, 0]

    batch = common_batch_get_one(ctx, tmp)
    try:
        ret = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.get())
    finally:
        batch.close()
    if ret != 0:
        res = CommonContextSeqRmType.NO
    elif not mem.seq_rm(0, 1, -1):
        # the context does not support partial sequence removal
        res = CommonContextSeqRmType.FULL

    mem.clear(True)
    ctx.synchronize()

    return res


def common_context_seq_rm(ctx: Any, seq_id: int, p0: int, p1: int) -> None:
    """Mirrors common_context_seq_rm (common.cpp); the reference's abort becomes an exception."""
    if not ctx.memory.seq_rm(seq_id, p0, p1):
        raise SpeculativeError(f"failed to remove sequence {seq_id} with p0={p0}, p1={p1}")


LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1


class CommonPromptCheckpoint:
    """Mirrors struct common_prompt_checkpoint (common.h): per-sequence state of the target and draft."""

    def __init__(self) -> None:
        self.id_task = -1  # (optional) id of the task that created the checkpoint
        self.clear()

    def size(self) -> int:
        return len(self.data_tgt) + len(self.data_dft) + len(self.data_spec)

    def empty(self) -> bool:
        return len(self.data_tgt) == 0

    def clear(self) -> None:
        self.n_tokens = 0
        self.pos_min = 0
        self.pos_max = 0
        self.data_tgt = b""
        self.data_dft = b""
        # (optional) speculative-decoding implementation state stashed with the checkpoint
        # (e.g. eagle3's deferred-boundary g_embd row)
        self.data_spec = b""

    def update_pos(self, n_tokens: int, pos_min: int, pos_max: int) -> None:
        self.n_tokens = n_tokens
        self.pos_min = pos_min
        self.pos_max = pos_max

    def update_tgt(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None:
            return
        self.data_tgt = ctx.state_seq_get(seq_id, flags)

    def update_dft(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None:
            return
        self.data_dft = ctx.state_seq_get(seq_id, flags)

    def load_tgt(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None or not self.data_tgt:
            return
        ctx.state_seq_set(seq_id, self.data_tgt, flags)

    def load_dft(self, ctx, seq_id: int, flags: int) -> None:
        if ctx is None or not self.data_dft:
            return
        ctx.state_seq_set(seq_id, self.data_dft, flags)

    def clear_tgt(self) -> None:
        self.data_tgt = b""

    def clear_dft(self) -> None:
        self.data_dft = b""
        self.data_spec = b""
