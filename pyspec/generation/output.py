"""Tokens out: stop strings in the generated text (the server's process_token, tools/server/server-context.cpp)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["find_stop", "partial_stop"]


def find_stop(text: str, stop: Sequence[str], start: int) -> tuple[int, str]:
    """The earliest position at or after ``start`` where a stop string occurs, and that string; (-1, "") if none."""
    best, word = -1, ""
    for w in stop:
        i = text.find(w, start)
        if i >= 0 and (best < 0 or i < best):
            best, word = i, w
    return best, word


def partial_stop(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (held back when streaming)."""
    n = 0
    for w in stop:
        for k in range(min(len(w) - 1, len(text)), n, -1):
            if text.endswith(w[:k]):
                n = k
                break
    return n
