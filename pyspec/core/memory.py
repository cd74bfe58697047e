"""The memory (KV cache, recurrent state) of one context: the llama_memory_* API of llama.h.

Every call takes the context's guard (a second thread gets ConcurrentUseError, not a
race with a running decode) and checks sequence ids and positions first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pyspec.ffi import llama

if TYPE_CHECKING:
    from pyspec.core.context import Context

__all__ = ["Memory"]

_POS_MAX = 2**31 - 1


def _pos(name: str, p: Any) -> int:
    if isinstance(p, bool) or not isinstance(p, int) or not -(2**31) <= p <= _POS_MAX:
        raise ValueError(f"{name} must be an int32 position, got {p!r}")
    return p


class Memory:
    """Mirrors the llama_memory_* API (llama.h) of one context, with sequence ids checked."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    @property
    def ptr(self) -> Any:
        return llama.llama_get_memory(self._ctx.ptr)

    def check_seq(self, seq_id: int, allow_any: bool = False) -> int:
        """seq_id as an int, or ValueError unless 0 <= seq_id < n_seq_max (or -1 with allow_any).

        A closed context says so first (ClosedError), whatever the seq_id.
        """
        self._ctx.check_open()
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            try:
                s = int(seq_id)  # numpy integers
            except (TypeError, ValueError):
                raise ValueError(f"seq_id must be an int, got {seq_id!r}") from None
            if s != seq_id:
                raise ValueError(f"seq_id must be an int, got {seq_id!r}")
        else:
            s = seq_id
        n = self._ctx.n_seq_max
        if allow_any and s == -1:
            return s
        if not 0 <= s < n:
            extra = " (or -1 for all)" if allow_any else ""
            raise ValueError(f"seq_id {s} out of range 0..{n - 1}{extra}")
        return s

    def _call(self, fn: Any, *args: Any) -> Any:
        ctx = self._ctx
        with ctx.in_use() as cptr:
            return fn(llama.llama_get_memory(cptr), *args)

    def clear(self, data: bool = True) -> None:
        rpc = self._ctx.model.rpc
        if data and rpc is not None:  # clearing the data of buffers on an rpc-server is a request to it
            rpc.ensure_usable("clearing the memory")
        self._call(llama.llama_memory_clear, bool(data))

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of seq_id (-1 = all sequences); False if not possible (recurrent)."""
        return bool(self._call(llama.llama_memory_seq_rm, self.check_seq(seq_id, True), _pos("p0", p0), _pos("p1", p1)))

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        src, dst = self.check_seq(seq_id_src), self.check_seq(seq_id_dst)
        p0, p1 = _pos("p0", p0), _pos("p1", p1)
        # without a unified KV buffer each sequence has its own stream, and llama.cpp
        # can copy only whole streams (it asserts on a partial range)
        if src != dst and not self._ctx.params.kv_unified and (p0 > 0 or p1 >= 0):
            raise ValueError("a partial seq_cp between sequences needs a context with kv_unified=True")
        self._call(llama.llama_memory_seq_cp, src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self._call(llama.llama_memory_seq_keep, self.check_seq(seq_id))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        seq, p0, p1, delta = self.check_seq(seq_id), _pos("p0", p0), _pos("p1", p1), _pos("delta", delta)
        if not self.can_shift():
            raise ValueError("this context's memory cannot shift positions")
        # positions are int32 in llama.cpp: a shift past the top would wrap (signed overflow)
        top = self.seq_pos_max(seq)
        if top >= 0 and top + delta > _POS_MAX - 1:
            raise ValueError(f"shifting seq {seq} by {delta} moves position {top} past {_POS_MAX - 1}")
        self._call(llama.llama_memory_seq_add, seq, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        seq, p0, p1 = self.check_seq(seq_id), _pos("p0", p0), _pos("p1", p1)
        if isinstance(d, bool) or not isinstance(d, int) or not 0 < d <= _POS_MAX:
            raise ValueError(f"divisor must be a positive int, got {d!r}")
        if not self.can_shift():
            raise ValueError("this context's memory cannot shift positions")
        self._call(llama.llama_memory_seq_div, seq, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(self._call(llama.llama_memory_seq_pos_min, self.check_seq(seq_id)))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self._call(llama.llama_memory_seq_pos_max, self.check_seq(seq_id)))

    def seq_pos_range(self, seq_id: int) -> tuple[int, int]:
        """(seq_pos_min, seq_pos_max) of seq_id in one call: the generation loop asks for both every step."""
        seq = self.check_seq(seq_id)
        ctx = self._ctx
        with ctx.in_use() as cptr:
            mem = llama.llama_get_memory(cptr)
            return int(llama.llama_memory_seq_pos_min(mem, seq)), int(llama.llama_memory_seq_pos_max(mem, seq))

    def can_shift(self) -> bool:
        return bool(self._call(llama.llama_memory_can_shift))
