"""The one error convention of pyspec's C entry points (csrc/pyspec_errbuf.h).

A call returns its status (a negative int, NULL, or the sentinel its declaration names) and
leaves the message in the calling thread's last error of its library, read through one helper
per library: pyspec_ext_last_error (pyspec.core.ext_error.last_error) and
pyspec_ref_last_error (pyspec.reference.library.last_error). No entry point takes an
(err, err_len) buffer.
"""

from __future__ import annotations

import re
import threading

from pyspec import decl
from pyspec.core.ext_error import last_error as ext_last_error
from pyspec.ffi import c_const, ext, ffi, ref
from pyspec.reference.library import last_error as ref_last_error

# the decl files of each library's entry points
LIBRARIES = {"pyspec_ext": ("pyspec_ext.h", "pyspec_rpc.h"), "pyspec_ref": ("pyspec_ref.h", "pyspec_loop.h")}


def test_no_entry_point_takes_an_error_buffer_and_each_library_declares_one_last_error_helper():
    for library, files in LIBRARIES.items():
        text = "\n".join(decl.read(f) for f in files)
        assert not re.search(r"\bchar\s*\*\s*err\b|\berr_len\b", text), library
        assert re.findall(r"\b(\w+_last_error)\s*\(void\)", text) == [f"{library}_last_error"]


def _refused_grammar() -> str:
    text = b'root ::= "a'  # an unterminated string
    assert ext.pyspec_grammar_check(ffi.NULL, text, len(text), b"root") == -1
    return ext_last_error()


def test_each_library_keeps_its_own_last_error():
    ext_msg = _refused_grammar()
    assert ext_msg
    out = ffi.new("int32_t *")
    assert ref.pyspec_ref_enum_value(b"NO_SUCH_CONSTANT", out) == c_const("PYSPEC_REF_E_RANGE")
    assert ref_last_error() == "no enum constant NO_SUCH_CONSTANT in the reference"
    assert ext_last_error() == ext_msg  # the reference's failure left the other library's message alone


def test_the_last_error_is_the_calling_threads():
    out = ffi.new("int32_t *")
    assert ref.pyspec_ref_enum_value(b"MAIN_THREAD", out) < 0
    seen: list[str] = []

    def other() -> None:
        seen.append(ref_last_error())  # nothing failed on this thread yet
        ref.pyspec_ref_enum_value(b"OTHER_THREAD", ffi.new("int32_t *"))
        seen.append(ref_last_error())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == ["", "no enum constant OTHER_THREAD in the reference"]
    assert ref_last_error() == "no enum constant MAIN_THREAD in the reference"
