"""Every exception pyspec raises on purpose, and the mapping from C status codes to them."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AdapterError",
    "BadRequest",
    "BatchFullError",
    "ChatTemplateError",
    "CliError",
    "ClosedError",
    "ConcurrentUseError",
    "ContextError",
    "DecodeError",
    "EmbeddingTooLarge",
    "FuzzFinding",
    "LibraryNotFoundError",
    "LoopInputError",
    "MissingModelPackage",
    "ModelLoadError",
    "NoChatTemplateError",
    "ParityError",
    "PyspecError",
    "QuantizeError",
    "RefError",
    "RpcConnectionError",
    "RpcError",
    "RpcUnavailableError",
    "SamplerCallbackError",
    "SlotBusyError",
    "SnapshotSplitError",
    "SpeculativeError",
    "StateFileError",
    "decode_error",
    "ref_error",
]


class PyspecError(Exception):
    """Base class of every error pyspec raises on purpose."""


class LibraryNotFoundError(PyspecError, ImportError):
    """A shared library of the package is missing (the package was not built)."""


class ModelLoadError(PyspecError):
    """llama.cpp could not load a model file (not a GGUF, truncated, unknown architecture...)."""

    def __init__(self, path: str, reason: str = "") -> None:
        self.path = path
        msg = f"failed to load model from {path!r}"
        super().__init__(f"{msg}: {reason}" if reason else msg)


class AdapterError(PyspecError):
    """llama.cpp refused a LoRA adapter or a control vector (wrong model, bad file, bad shape)."""


class QuantizeError(PyspecError):
    """llama_model_quantize failed (the reason is in the message)."""


class StateFileError(PyspecError):
    """A context or sequence state (a file, or bytes) could not be saved or loaded."""


class SamplerCallbackError(PyspecError):
    """A custom Python sampler raised inside a llama.cpp callback.

    The exception was caught at the C boundary (it never unwinds through llama.cpp) and
    is re-raised from the Python call that ran the sampler; ``__cause__`` is the original.
    """


class MissingModelPackage(PyspecError):
    """The real model's PyPI package is not installed."""


class ContextError(PyspecError):
    """llama.cpp could not create a context with the given parameters."""


class SnapshotSplitError(ContextError, ValueError):
    """Recurrent-state snapshots (``n_rs_seq > 0``) asked of a context that cannot keep them: its devices cannot
    run them in one piece, or ``n_ubatch`` is not above ``n_rs_seq + 1``. The Engine then rolls back through
    checkpoints (``n_rs_seq=0``)."""


class ClosedError(PyspecError):
    """An object was used after close()."""


class SlotBusyError(PyspecError):
    """A slot command (save, restore, erase) on a slot that is processing a request."""


class ConcurrentUseError(PyspecError):
    """A context was used from a second thread while the first was still in llama.cpp."""


class ChatTemplateError(PyspecError, ValueError):
    """A chat template failed to render the messages (the template raised, or the messages do not fit it),
    or llama_chat_apply_template does not know it (no built-in name, no Jinja source it recognises)."""


class NoChatTemplateError(ChatTemplateError):
    """Chat messages were given for a model that has no chat template, and no template was named."""


class BadRequest(PyspecError, ValueError):
    """An HTTP request body the server refuses with 400 (a field of the wrong type or out of range)."""


class EmbeddingTooLarge(BadRequest):
    """A prompt longer than an embedding can take in one go (llama-server's 'too large' error)."""


class BatchFullError(PyspecError, IndexError):
    """A token was added to a batch that is already at capacity."""


class DecodeError(PyspecError):
    """llama_decode / llama_encode returned a non-zero code."""

    def __init__(self, code: int, op: str = "llama_decode", meaning: str = "") -> None:
        self.code = code
        self.op = op
        super().__init__(f"{op} returned {code}: {meaning or ('fatal error' if code < 0 else 'warning')}")


class RpcError(PyspecError):
    """Something failed with llama.cpp's RPC backend or an rpc-server process."""


class RpcUnavailableError(RpcError):
    """This build has no RPC backend or no rpc-server (built with CMAKE_ARGS="-DGGML_RPC=off")."""


class RpcConnectionError(RpcError, ConnectionError):
    """An rpc-server could not be reached, stopped answering, or its connection was lost.

    ``endpoints`` names the servers involved. A model whose server was lost stays
    unusable (its weights were there); close it, and load it again once a server runs.
    """

    def __init__(self, message: str, endpoints: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.endpoints = endpoints


class SpeculativeError(PyspecError, RuntimeError):
    """A check of the speculative decoding reference failed (throw / GGML_ASSERT / GGML_ABORT)."""


class RefError(SpeculativeError):
    """The C++ reference refused a call or threw; ``status`` is the PYSPEC_REF_E_* code."""

    def __init__(self, message: str, status: int = -5) -> None:
        super().__init__(message)
        self.status = status


class LoopInputError(RefError, ValueError):
    """The C++ loop refused its input (PYSPEC_REF_E_NULL / _RANGE / _CAPACITY)."""


class CliError(PyspecError):
    """A command-line error reported as one line, without a traceback."""


class FuzzFinding(AssertionError):
    """A fuzz input that pyspec neither handled nor refused cleanly (pyspec.testing.fuzz)."""


class ParityError(AssertionError):
    """The Python port and the C++ reference disagree (or one of them failed) on a scenario."""

    def __init__(self, report: Any) -> None:
        super().__init__(report.verdict())
        self.report = report


# --- C status codes -----------------------------------------------------------

# llama_decode / llama_encode return codes (include/llama.h)
_DECODE_MEANING = {
    1: "could not find a KV slot for the batch (try reducing the batch or increasing the context)",
    2: "aborted (the abort callback returned true)",
    -1: "invalid input batch",
}


def decode_error(code: int, op: str = "llama_decode") -> DecodeError:
    """The exception for a non-zero llama_decode / llama_encode result."""
    return DecodeError(code, op, _DECODE_MEANING.get(code, ""))


def ref_error(status: int, message: str = "", *, what: str = "", input_error: bool = False) -> RefError:
    """The exception for a negative PYSPEC_REF_E_* status (decl/pyspec_ref.h).

    With ``input_error`` (the C++ loop's entry checks), a refusal of the input
    itself (NULL, RANGE, CAPACITY) is a :class:`LoopInputError`, a ValueError.
    """
    from pyspec.ffi import c_const, ffi  # errors.py sits below ffi.py

    names = ffi.typeof("enum pyspec_ref_status").elements
    text = message or names.get(status, str(status))
    if what:
        text = f"{what}: {text}"
    bad_input = {c_const(n) for n in ("PYSPEC_REF_E_NULL", "PYSPEC_REF_E_RANGE", "PYSPEC_REF_E_CAPACITY")}
    if input_error and status in bad_input:
        return LoopInputError(text, status)
    return RefError(text, status)
