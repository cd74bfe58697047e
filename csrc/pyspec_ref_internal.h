// Shared by the pyspec_ref*.cpp files of libpyspec_ref: the C declarations and the error helpers.
#pragma once

#include "common.h"
#include "llama.h"
#include "sampling.h"

#include <cstdarg>
#include <cstdio>
#include <string>

extern "C" {
#include "../pyspec/decl/pyspec_ref.h"
#include "../pyspec/decl/pyspec_ext.h"
}

// ---- errors -----------------------------------------------------------------

inline thread_local std::string g_last_error;  // one per library (a C++17 inline variable)

static inline int set_error(int status, const char * fmt, ...) {
    char buf[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    g_last_error = buf;
    return status;
}

static inline void copy_err(char * err, size_t err_len, const std::string & msg) {
    if (err != nullptr && err_len > 0) {
        snprintf(err, err_len, "%s", msg.c_str());
    }
}

// run f(), turning any C++ exception into PYSPEC_REF_E_EXCEPTION + message
template <typename F>
static inline int guarded(F && f) {
    try {
        return f();
    } catch (const std::exception & e) {
        return set_error(PYSPEC_REF_E_EXCEPTION, "%s", e.what());
    } catch (...) {
        return set_error(PYSPEC_REF_E_EXCEPTION, "unknown C++ exception");
    }
}

#define REQUIRE(cond, status, ...) do { if (!(cond)) { return set_error((status), __VA_ARGS__); } } while (0)
