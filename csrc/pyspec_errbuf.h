// The error buffer of pyspec's check functions: the message written into the caller's
// (err, err_len) buffer, snprintf style, and -1 returned (shared by the grammar and GGUF checks).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdio>

namespace pyspec {

inline int fail(char * err, size_t err_len, const char * fmt, ...) {
    if (err != nullptr && err_len > 0) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(err, err_len, fmt, args);
        va_end(args);
    }
    return -1;
}

}  // namespace pyspec
