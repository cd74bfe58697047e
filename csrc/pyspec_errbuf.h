// The one error convention of pyspec's C entry points: a call returns its status (0 or a
// negative int, a NULL pointer, or a sentinel its declaration documents) and leaves the
// message in the calling thread's last error of its library, which the library's one C
// helper returns: pyspec_ext_last_error (libpyspec_ext) and pyspec_ref_last_error
// (libpyspec_ref). Python reads it through one helper per library
// (pyspec.core.ext_error.last_error, pyspec.reference.library.last_error).
//
// Each shared library that includes this header has its own last error: the namespace is
// hidden, so the linker keeps one copy of last_error() (and of its thread_local string) per
// library, shared by that library's translation units, and libpyspec_ref, which links
// libpyspec_ext, does not bind to libpyspec_ext's copy.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <string>

namespace pyspec __attribute__((visibility("hidden"))) {

// the calling thread's last message of this library ("" when the last failure left none)
inline std::string & last_error() {
    static thread_local std::string msg;
    return msg;
}

// the message, printf style, as the thread's last error; returns status
__attribute__((format(printf, 2, 3)))
inline int fail(int status, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    va_list again;
    va_copy(again, args);
    const int n = vsnprintf(nullptr, 0, fmt, args);
    va_end(args);
    std::string msg(n > 0 ? (size_t) n : 0, '\0');
    if (n > 0) {
        vsnprintf(msg.data(), msg.size() + 1, fmt, again);
    }
    va_end(again);
    last_error() = std::move(msg);
    return status;
}

}  // namespace pyspec
