"""The one reader of libpyspec_ext's error messages.

A check of libpyspec_ext (the grammar and GGUF checks, the RPC guard) that fails returns its
status and leaves the message in the calling thread's last error (csrc/pyspec_errbuf.h), which
``pyspec_ext_last_error`` returns; :func:`last_error` reads it, once, right after the call.
"""

from __future__ import annotations

from pyspec.ffi import ext, ffi

__all__ = ["last_error"]


def last_error() -> str:
    """The message of the calling thread's last failure in libpyspec_ext ("" for none)."""
    return ffi.string(ext.pyspec_ext_last_error()).decode("utf-8", "replace")
