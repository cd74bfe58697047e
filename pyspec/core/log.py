"""Route llama.cpp / ggml logging to Python's ``logging`` (logger ``pyspec.llama``).

The logger is quiet by default (ERROR); a user raises verbosity with
``logging.getLogger("pyspec.llama").setLevel(logging.DEBUG)``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from pyspec.ffi import c_enum, ffi, ggml, is_open, llama, on_open, open_library

__all__ = ["install", "rename", "renamed", "set_common_log_verbosity"]

logger = logging.getLogger("pyspec.llama")

_GGML_LEVEL = c_enum("enum ggml_log_level", "GGML_LOG_LEVEL_")
_LEVELS = {
    _GGML_LEVEL["debug"]: logging.DEBUG,
    _GGML_LEVEL["info"]: logging.INFO,
    _GGML_LEVEL["warn"]: logging.WARNING,
    _GGML_LEVEL["error"]: logging.ERROR,
}
_CONT = _GGML_LEVEL["cont"]  # continues the previous line's level

# llama.cpp writes one line in several calls; GGML_LOG_LEVEL_CONT continues
# the previous level, so lines are assembled before they reach logging.
_pending: list[str] = []
_pending_level = logging.INFO

# names llama.cpp knows by another text than the user does: an rpc-server's relay address
_renames: dict[str, str] = {}


def rename(old: str, new: str) -> None:
    """Write ``new`` wherever llama.cpp's text says ``old`` (its log lines, names read with :func:`renamed`)."""
    _renames[old] = new


def renamed(text: str) -> str:
    """``text`` with the names :func:`rename` registered replaced."""
    for old, new in _renames.items():
        text = text.replace(old, new)
    return text


@ffi.callback("void(enum ggml_log_level, const char *, void *)")
def _on_log(level: int, text, _user_data) -> None:
    global _pending_level
    try:
        if level != _CONT:
            _pending_level = _LEVELS.get(level, logging.INFO)
        if not logger.isEnabledFor(_pending_level):
            return
        _pending.append(ffi.string(text).decode("utf-8", "replace"))
        if _pending[-1].endswith("\n"):
            line = renamed("".join(_pending).rstrip("\n"))
            _pending.clear()
            logger.log(_pending_level, "%s", line)
    except Exception:  # a callback must never raise into C
        pass


def install() -> None:
    """Send llama.cpp and ggml logs to the ``pyspec.llama`` logger.

    (The C++ common log of the reference library starts quiet when that library is opened.)
    """
    llama.llama_log_set(_on_log, ffi.NULL)
    ggml.ggml_log_set(_on_log, ffi.NULL)


class ErrorLines(logging.Handler):
    """Collects llama.cpp's error lines while a call runs, so the exception can say why."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def reason(self, marker: str = "") -> str:
        """The text after ``marker`` on the first line that has it, else the first two lines."""
        for line in self.lines:
            if marker and marker in line:
                return line.split(marker, 1)[1].strip()
        return "; ".join(line.strip() for line in self.lines[:2])


@contextlib.contextmanager
def capture_errors() -> Iterator[ErrorLines]:
    """``with capture_errors() as errors: <call>``: llama.cpp's error lines land in ``errors.lines``.

    (The ``pyspec.llama`` logger passes error lines at its default level, ERROR.)
    """
    errors = ErrorLines()
    logger.addHandler(errors)
    try:
        yield errors
    finally:
        logger.removeHandler(errors)


_common_verbosity = -1  # llama.cpp's common log writes to stderr: quiet unless asked


def set_common_log_verbosity(verbosity: int) -> None:
    """Threshold of llama.cpp's common log, which the C++ reference writes to stderr
    (-1 silences it, 0 shows info, warnings and errors, 1 and up adds debug lines).

    Applies when the reference library is opened, or at once if it is open.
    """
    global _common_verbosity
    _common_verbosity = verbosity
    if is_open("ref"):
        _apply_common_verbosity(open_library("ref"))


def _apply_common_verbosity(lib: Any) -> None:
    lib.pyspec_ref_log_set_verbosity(_common_verbosity)


on_open("ref", _apply_common_verbosity)


if logger.level == logging.NOTSET:
    logger.setLevel(logging.ERROR)
