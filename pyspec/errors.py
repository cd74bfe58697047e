"""Exceptions raised by pyspec."""

from __future__ import annotations


class PyspecError(Exception):
    """Base class of every error pyspec raises on purpose."""


class ModelLoadError(PyspecError):
    """llama.cpp could not load a model file (not a GGUF, truncated, unknown architecture...)."""

    def __init__(self, path: str, reason: str = "") -> None:
        self.path = path
        msg = f"failed to load model from {path!r}"
        super().__init__(f"{msg}: {reason}" if reason else msg)


class ContextError(PyspecError):
    """llama.cpp could not create a context with the given parameters."""


class ClosedError(PyspecError):
    """An object was used after close()."""


class ConcurrentUseError(PyspecError):
    """A context was used from a second thread while the first was still in llama.cpp."""


# llama_decode / llama_encode return codes (include/llama.h)
_DECODE_MEANING = {
    1: "could not find a KV slot for the batch (try reducing the batch or increasing the context)",
    2: "aborted (the abort callback returned true)",
    -1: "invalid input batch",
}


class DecodeError(PyspecError):
    """llama_decode / llama_encode returned a non-zero code."""

    def __init__(self, code: int, op: str = "llama_decode") -> None:
        self.code = code
        self.op = op
        meaning = _DECODE_MEANING.get(code, "fatal error" if code < 0 else "warning")
        super().__init__(f"{op} returned {code}: {meaning}")


class SpeculativeError(PyspecError, RuntimeError):
    """A check of the speculative decoding reference failed (throw / GGML_ASSERT / GGML_ABORT)."""
