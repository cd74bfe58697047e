"""The memory (KV cache, recurrent state) of one context: the llama_memory_* API of llama.h."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspec.ffi import llama

if TYPE_CHECKING:
    from pyspec.core.context import Context

__all__ = ["Memory"]


class Memory:
    """Mirrors the llama_memory_* API (llama.h) of one context, with sequence ids checked."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    @property
    def ptr(self):
        return llama.llama_get_memory(self._ctx.ptr)

    def check_seq(self, seq_id: int, allow_any: bool = False) -> int:
        """seq_id as an int, or ValueError unless 0 <= seq_id < n_seq_max (or -1 with allow_any)."""
        s = int(seq_id)
        n = self._ctx.n_seq_max
        if allow_any and s == -1:
            return s
        if not 0 <= s < n:
            extra = " (or -1 for all)" if allow_any else ""
            raise ValueError(f"seq_id {s} out of range 0..{n - 1}{extra}")
        return s

    def clear(self, data: bool = True) -> None:
        rpc = self._ctx.model.rpc
        if data and rpc is not None:  # clearing the data of buffers on an rpc-server is a request to it
            rpc.ensure_usable("clearing the memory")
        llama.llama_memory_clear(self.ptr, data)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of seq_id (-1 = all sequences); False if not possible (recurrent)."""
        return bool(llama.llama_memory_seq_rm(self.ptr, self.check_seq(seq_id, True), p0, p1))

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        src, dst = self.check_seq(seq_id_src), self.check_seq(seq_id_dst)
        # without a unified KV buffer each sequence has its own stream, and llama.cpp
        # can copy only whole streams (it asserts on a partial range)
        if src != dst and not self._ctx.params.kv_unified and (p0 > 0 or p1 >= 0):
            raise ValueError("a partial seq_cp between sequences needs a context with kv_unified=True")
        llama.llama_memory_seq_cp(self.ptr, src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        llama.llama_memory_seq_keep(self.ptr, self.check_seq(seq_id))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        if not self.can_shift():
            raise ValueError("this context's memory cannot shift positions")
        llama.llama_memory_seq_add(self.ptr, self.check_seq(seq_id), p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        if d <= 0:
            raise ValueError(f"divisor must be positive, got {d}")
        if not self.can_shift():
            raise ValueError("this context's memory cannot shift positions")
        llama.llama_memory_seq_div(self.ptr, self.check_seq(seq_id), p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(llama.llama_memory_seq_pos_min(self.ptr, self.check_seq(seq_id)))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(llama.llama_memory_seq_pos_max(self.ptr, self.check_seq(seq_id)))

    def can_shift(self) -> bool:
        return bool(llama.llama_memory_can_shift(self.ptr))
