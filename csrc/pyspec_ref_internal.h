// Shared by the pyspec_ref*.cpp files of libpyspec_ref: the C declarations and the error helpers.
#pragma once

#include "llama.h"

#include <exception>

extern "C" {
#include "../pyspec/decl/pyspec_ref.h"
#include "../pyspec/decl/pyspec_ext.h"
}
#include "pyspec_errbuf.h"

// ---- errors: pyspec_errbuf.h's convention; pyspec_ref_last_error (pyspec_ref.cpp) returns the message

// run f(), turning any C++ exception into PYSPEC_REF_E_EXCEPTION + message
template <typename F>
static inline int guarded(F && f) {
    try {
        return f();
    } catch (const std::exception & e) {
        return pyspec::fail(PYSPEC_REF_E_EXCEPTION, "%s", e.what());
    } catch (...) {
        return pyspec::fail(PYSPEC_REF_E_EXCEPTION, "unknown C++ exception");
    }
}

#define REQUIRE(cond, status, ...) do { if (!(cond)) { return pyspec::fail((status), __VA_ARGS__); } } while (0)
