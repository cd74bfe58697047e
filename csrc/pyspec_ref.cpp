// libpyspec_ref: C ABI over llama.cpp's common_speculative_* and common_sampler_*, the parity
// reference that Python drives on llama_context objects it created itself. The bindings are
// split by job: pyspec_ref_speculative.cpp (common/speculative.cpp, compiled in) and
// pyspec_ref_sampling.cpp (common/sampling.h); this file holds the library-wide entry points.
//
// ---- Wrapper behaviour (this file's C ABI, not upstream's) -------------------
//
// Every entry point catches C++ exceptions and checks, before calling in, the
// conditions the reference GGML_ASSERTs/ABORTs on, so that no input from
// Python can abort the process through this API; such a refusal is the
// wrapper's, not upstream's behaviour (tests name them as wrapper tests).
// pyspec_ref_spec_draft marks only the requested sequences as drafting (it
// clears the flag of every other sequence first), as a caller of
// common_speculative_draft sets the draft params it wants. Left unguarded
// (they depend on state libllama keeps private): EAGLE3 / DFlash process() before the
// target decoded with layer extraction on (llama_get_embeddings_layer_inp
// asserts; at 0c1e57098 their constructors turn the extraction on themselves), MTP draft() with a ctx_dft that yields no nextn embeddings (not an
// MTP context), a corrupt ngram-cache file, a sampler configuration that
// selects no token, backend sampling on a context whose sampler conflicts with
// a grammar.

#include "common.h"
#include "log.h"

#include <cstring>

#include "pyspec_ref_internal.h"

// the values the compiler gave the enum constants that decl/common.h declares, by name
// (stringified from the identifiers, so no value is retyped here)
#define PYSPEC_REF_ENUM(x) { #x, (int32_t) (x) }
static const struct {
    const char * name;
    int32_t      value;
} enum_values[] = {
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_NONE),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_DRAFT_MTP),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_DRAFT_DSPARK),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K4V),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_NGRAM_MOD),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_NGRAM_CACHE),
    PYSPEC_REF_ENUM(COMMON_SPECULATIVE_TYPE_COUNT),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_NONE),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_DRY),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_TOP_K),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_TOP_P),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_MIN_P),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_TYPICAL_P),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_TEMPERATURE),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_XTC),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_INFILL),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_PENALTIES),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_TOP_N_SIGMA),
    PYSPEC_REF_ENUM(COMMON_SAMPLER_TYPE_ADAPTIVE_P),
};
#undef PYSPEC_REF_ENUM

extern "C" {

const char * pyspec_ref_last_error(void) {
    return pyspec::last_error().c_str();
}

int pyspec_ref_enum_value(const char * name, int32_t * out) {
    REQUIRE(name != nullptr && out != nullptr, PYSPEC_REF_E_NULL, "name or out is NULL");
    for (const auto & e : enum_values) {
        if (std::strcmp(e.name, name) == 0) {
            *out = e.value;
            return PYSPEC_REF_OK;
        }
    }
    return pyspec::fail(PYSPEC_REF_E_RANGE, "no enum constant %s in the reference", name);
}

} // extern "C"

extern "C" {

// llama.cpp's common log (LOG_INF/LOG_WRN/... of common/) prints from a worker
// thread to stderr; pyspec keeps it silent unless asked (-1 silences all).
void pyspec_ref_log_set_verbosity(int verbosity) {
    common_log_set_verbosity_thold(verbosity);
}

int pyspec_ref_log_get_verbosity(void) {
    return common_log_get_verbosity_thold();
}

} // extern "C"
