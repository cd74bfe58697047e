// C ABI over llama.cpp's common_speculative_* (the speculative half of libpyspec_ref; the
// sampler half is pyspec_ref_sampling.cpp, the library-wide entry points pyspec_ref.cpp).
//
//
// The implementation structs of common/speculative.cpp (and their counters)
// are private to that file. Rather than copy any of it, this translation unit
// compiles the vendored file itself inside namespace pyspec_ref_impl: every
// header it includes is included first at global scope (so the #pragma once
// guards skip them inside the namespace), except speculative.h, whose
// declarations therefore land in the namespace too. The result is our own
// build of the reference code, whose structs we may read; the functions it
// calls (common_sampler_*, ngram maps, logging, llama_*) stay the global ones
// of libllama-common and libllama.
//
// ---- Patches: where this build differs from upstream's speculative.cpp -------
//
// None at this revision. Patch 1 of the previous pin (eagle3-batch-rows: a
// namespace-local llama_batch_init giving EAGLE3's decoder batch 4 x n_tokens zeroed
// rows) is dropped: the EAGLE3 code no longer calls llama_batch_init, it fills a
// common_batch whose rows are copied into a llama_batch_ext with their own width
// (llama_embd.n_embd, checked against the model's input width by
// llama_batch_ext::set_token_embd), and llama_batch_allocr strides ubatch rows by
// that same width, so the out-of-bounds read of a split draft decode no longer exists.
//
// The mechanism stays: building with -DPYSPEC_REF_NO_PATCH (CMake target
// pyspec_ref_nopatch, installed as pyspec/lib/nopatch/libpyspec_ref.so) leaves out
// every patch, and pyspec_ref_patches() names the patches compiled in ("" now, in
// both builds); tests/test_parity_nopatch.py shows the port equal to upstream's code.
//

#include "common.h"
#include "ggml.h"
#include "ggml-cpp.h"
#include "llama.h"
#include "log.h"
#include "ngram-cache.h"
#include "ngram-map.h"
#include "ngram-mod.h"
#include "sampling.h"

#include "llama-ext.h"

#include <sys/stat.h>

#include <algorithm>
#include <cassert>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace pyspec_ref_impl {
#include "speculative.cpp"
} // namespace pyspec_ref_impl

namespace ref = pyspec_ref_impl;

#include "pyspec_ref_internal.h"

// ---- common_speculative -----------------------------------------------------

struct pyspec_ref_spec {
    ref::common_speculative * spec = nullptr;
    uint32_t n_seq = 0;
    int32_t  n_max = 0;
    llama_context * ctx_tgt = nullptr; // the batch of process() was decoded on it

    // storage behind the draft params' prompt / result pointers
    std::vector<llama_tokens> prompts;
    std::vector<llama_tokens> results;

    ~pyspec_ref_spec() { ref::common_speculative_free(spec); }
};

static const common_params_speculative & spec_defaults() {
    static const common_params_speculative defaults;
    return defaults;
}

static bool spec_type_valid(int32_t t) {
    return t >= COMMON_SPECULATIVE_TYPE_NONE && t < COMMON_SPECULATIVE_TYPE_COUNT;
}

static void to_ngram_map(common_params_speculative_ngram_map & dst, const pyspec_ref_spec_ngram_map_params & src) {
    dst.size_n   = src.size_n;
    dst.size_m   = src.size_m;
    dst.min_hits = src.min_hits;
}

static void from_ngram_map(pyspec_ref_spec_ngram_map_params & dst, const common_params_speculative_ngram_map & src) {
    dst.size_n   = src.size_n;
    dst.size_m   = src.size_m;
    dst.min_hits = src.min_hits;
}

// common_ngram_cache_load GGML_ASSERTs on a record cut short, a token count <= 0 or a
// count <= 0, and aborts on a file it cannot open (a directory opens, then fails).
// The same reading as pyspec.common.checks.check_ngram_cache_file, which the port runs.
static bool ngram_cache_file_ok(const std::string & path) {
    struct stat st;
    if (path.find('\0') != std::string::npos || stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return false;
    }
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    std::vector<char> raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t n = raw.size() / 4;
    std::vector<int32_t> words(n);
    std::memcpy(words.data(), raw.data(), n * 4);
    size_t p = 0;
    while (n - p >= (size_t) LLAMA_NGRAM_MAX) {
        p += LLAMA_NGRAM_MAX;
        if (p >= n || words[p] <= 0 || n - (p + 1) < 2 * (size_t) words[p]) {
            return false;
        }
        const size_t k = (size_t) words[p];
        for (size_t j = 0; j < k; ++j) {
            if (words[p + 2 + 2 * j] <= 0) {
                return false;
            }
        }
        p += 1 + 2 * k;
    }
    return true;
}

static bool has_type(const common_params_speculative & p, common_speculative_type t) {
    return std::find(p.types.begin(), p.types.end(), t) != p.types.end();
}

// the GGML_ASSERT/ABORT preconditions of the implementations' constructors
static std::string check_spec_params(const common_params_speculative & p) {
    const auto & d = p.draft;
    // without ctx_dft the constructor throws its own message; without ctx_tgt it would dereference NULL
    if (has_type(p, COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE) && d.ctx_tgt == nullptr && d.ctx_dft != nullptr) {
        return "draft-simple requires ctx_tgt and ctx_dft to be set";
    }
    if (has_type(p, COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3) && d.ctx_dft != nullptr && d.ctx_tgt == nullptr) {
        return "EAGLE3 requires ctx_tgt and ctx_dft to be set";
    }
    if (has_type(p, COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3) && d.ctx_dft != nullptr && d.ctx_tgt != nullptr) {
        const llama_model * m_dft = llama_get_model(d.ctx_dft);
        const int32_t n_layer_tgt = llama_model_n_layer(llama_get_model(d.ctx_tgt));
        const int32_t * ids = llama_model_target_layer_ids(m_dft);
        for (uint32_t k = 0; k < llama_model_target_layer_ids_n(m_dft) && k < 3; ++k) {
            if (ids[k] > n_layer_tgt) { // the constructor GGML_ABORTs
                return "EAGLE3: target layer id " + std::to_string(ids[k]) + " exceeds target n_layer " +
                       std::to_string(n_layer_tgt);
            }
        }
    }
    for (const auto t : { COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH, COMMON_SPECULATIVE_TYPE_DRAFT_DSPARK }) {
        if (has_type(p, t) && d.ctx_dft != nullptr) { // the constructor's GGML_ASSERTs
            if (d.ctx_tgt == nullptr) {
                return "DFlash requires ctx_tgt and ctx_dft to be set";
            }
            const llama_model * m_dft = llama_get_model(d.ctx_dft);
            if (llama_model_target_layer_ids_n(m_dft) == 0) {
                return "DFlash model has no target_layer_ids";
            }
            // llama_set_embeddings_layer_inp asserts lid <= n_layer; the target graph then asserts that
            // the layer records its input, which no graph does for lid == n_layer (the port's message)
            const int32_t n_layer_tgt = llama_model_n_layer(llama_get_model(d.ctx_tgt));
            const int32_t * ids = llama_model_target_layer_ids(m_dft);
            for (uint32_t k = 0; k < llama_model_target_layer_ids_n(m_dft); ++k) {
                if (ids[k] < 0 || ids[k] >= n_layer_tgt) {
                    return "DFlash: target layer id " + std::to_string(ids[k]) + " out of range [0, " +
                           std::to_string(n_layer_tgt) + ")";
                }
            }
        }
    }
    if (has_type(p, COMMON_SPECULATIVE_TYPE_DRAFT_MTP) && d.ctx_dft != nullptr) {
        if (d.ctx_tgt == nullptr) {
            return "MTP requires ctx_tgt and ctx_dft to be set";
        }
        if (llama_model_n_embd_out(llama_get_model(d.ctx_dft)) != llama_model_n_embd_out(llama_get_model(d.ctx_tgt))) {
            return "MTP input row width must match the target h_nextn width";
        }
    }
    // pyspec.common.checks.check_speculative_params, with its messages
    const std::pair<const char *, const common_params_speculative_ngram_map *> maps[] = {
        { "ngram_simple", &p.ngram_simple }, { "ngram_map_k", &p.ngram_map_k }, { "ngram_map_k4v", &p.ngram_map_k4v } };
    for (const auto & [name, m] : maps) {
        if (m->size_n < 1) {
            return std::string(name) + ".size_n must be an int in 1..65535, got " + std::to_string(m->size_n);
        }
        if (m->size_m < 1) {
            return std::string(name) + ".size_m must be an int in 1..65535, got " + std::to_string(m->size_m);
        }
    }
    if (has_type(p, COMMON_SPECULATIVE_TYPE_NGRAM_MOD)) {
        const auto & m = p.ngram_mod;
        if (m.n_match <= 0) {
            return "ngram_mod n_match must be positive, got " + std::to_string(m.n_match);
        }
        if (m.n_max < 0) {  // draft_one sizes its result n_match + n_max and writes n_match entries
            return "ngram_mod.n_max must be an int in 0..2147483647, got " + std::to_string(m.n_max);
        }
    }
    if (has_type(p, COMMON_SPECULATIVE_TYPE_NGRAM_CACHE)) {
        const auto & c = p.ngram_cache;
        if (!c.lookup_cache_static.empty() && !ngram_cache_file_ok(c.lookup_cache_static)) {
            return "Couldn't read static lookup cache: " + c.lookup_cache_static;
        }
        if (!c.lookup_cache_dynamic.empty() && !ngram_cache_file_ok(c.lookup_cache_dynamic)) {
            return "Couldn't read dynamic lookup cache: " + c.lookup_cache_dynamic;
        }
    }
    return "";
}

// what DFlash / DSpark leave to llama.cpp's asserts later, read from the constructed
// implementation (its clamped n_max, mask token, block layout); the port's checks and messages
// (pyspec.common._dflash_draft: _check_inputs)
static std::string check_dflash(const ref::common_speculative & spec, uint32_t n_seq) {
    for (const auto & impl : spec.impls) {
        const auto * df = dynamic_cast<const ref::common_speculative_impl_draft_dflash *>(impl.get());
        if (df == nullptr) {
            continue;
        }
        llama_context * ctx_dft = df->params.ctx_dft;
        const llama_model * m_dft = llama_get_model(ctx_dft);
        // common_batch::get_sub_batch aborts on an injected row of another width
        const int32_t n_embd_inp_enc = (int32_t) df->target_layer_ids_n * df->n_embd_dec;
        if (df->n_embd_enc != n_embd_inp_enc) {
            return "DFlash: the target features (" + std::to_string(df->target_layer_ids_n) + " x " +
                   std::to_string(df->n_embd_tgt) + ") do not match the draft's encoder input width " +
                   std::to_string(n_embd_inp_enc);
        }
        // a LLAMA_TOKEN_NULL mask becomes an embedding entry without data: get_sub_batch aborts
        if (df->mask_token_id < 0 || df->mask_token_id >= llama_vocab_n_tokens(llama_model_get_vocab(m_dft))) {
            return "DFlash draft has no mask token (tokenizer.ggml.mask_token_id)";
        }
        if (n_seq > llama_n_seq_max(ctx_dft)) {
            return "DFlash: n_seq " + std::to_string(n_seq) + " exceeds the draft context's n_seq_max " +
                   std::to_string(llama_n_seq_max(ctx_dft));
        }
        // non-causal attention computes the whole noise batch in one ubatch (GGML_ASSERT otherwise)
        const int32_t n_block_max = std::max(0, df->params.n_max) + (df->is_dspark && df->sample_from_anchor ? 0 : 1);
        const int32_t n_ubatch_dft = (int32_t) llama_n_ubatch(ctx_dft);
        if ((int64_t) n_seq * n_block_max > n_ubatch_dft) {
            return "DFlash: " + std::to_string(n_seq) + " blocks of " + std::to_string(n_block_max) +
                   " tokens exceed the draft context's n_batch / n_ubatch " + std::to_string(n_ubatch_dft);
        }
    }
    return "";
}

// The smallest vocabulary and n_seq_max among the draft contexts the implementations decode on
// (draft-simple, EAGLE3, DFlash / DSpark, MTP); INT32_MAX with none. A token or sequence id outside
// them makes common_batch::get_sub_batch GGML_ABORT (llama_batch_ext_add_token refuses it): the
// wrapper checks process()'s batch and the draft requests' id_last against them first.
struct draft_limits {
    int32_t n_vocab = INT32_MAX;
    int32_t n_seq   = INT32_MAX;
};

static draft_limits draft_n_vocab(const ref::common_speculative & spec) {
    draft_limits lim;
    auto take = [&](const llama_context * ctx_dft) {
        if (ctx_dft != nullptr) {
            lim.n_vocab = std::min(lim.n_vocab, llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx_dft))));
            lim.n_seq   = std::min(lim.n_seq, (int32_t) llama_n_seq_max(ctx_dft));
        }
    };
    for (const auto & impl : spec.impls) {
        if (const auto * s = dynamic_cast<const ref::common_speculative_impl_draft_simple *>(impl.get())) {
            take(s->params.ctx_dft);
        } else if (const auto * e3 = dynamic_cast<const ref::common_speculative_impl_draft_eagle3 *>(impl.get())) {
            take(e3->params.ctx_dft);
        } else if (const auto * df = dynamic_cast<const ref::common_speculative_impl_draft_dflash *>(impl.get())) {
            take(df->params.ctx_dft);
        } else if (const auto * mtp = dynamic_cast<const ref::common_speculative_impl_draft_mtp *>(impl.get())) {
            take(mtp->params.ctx_dft);
        }
    }
    return lim;
}

static const char * spec_type_names[COMMON_SPECULATIVE_TYPE_COUNT + 1] = {};

// common_speculative_process takes a common_batch at this revision; pyspec's C ABI
// keeps the llama_batch that Python decoded, rebuilt here row by row with llama_batch's
// defaults (no logits array: only the last row is an output; no pos array: positions
// continue from the target memory, as llama_batch_ext's compat path does). Embedding
// rows are as wide as the target model's input; common_batch keeps views, not copies.
static common_batch to_common_batch(const pyspec_ref_spec * spec, const llama_batch & b) {
    llama_context * ctx = spec->ctx_tgt;
    common_batch cb = ctx != nullptr ? common_batch(ctx) : common_batch();
    const size_t n_embd = ctx != nullptr ? (size_t) llama_model_n_embd_inp(llama_get_model(ctx)) : 0;
    std::vector<llama_pos> pos_next;
    if (b.pos == nullptr && ctx != nullptr) {
        pos_next.resize(llama_n_seq_max(ctx));
        for (size_t s = 0; s < pos_next.size(); ++s) {
            pos_next[s] = llama_memory_seq_pos_max(llama_get_memory(ctx), (llama_seq_id) s) + 1;
        }
    }
    for (int32_t i = 0; i < b.n_tokens; ++i) {
        const llama_seq_id seq0 = b.seq_id != nullptr && b.n_seq_id != nullptr && b.n_seq_id[i] > 0 ? b.seq_id[i][0] : 0;
        const bool output = b.logits != nullptr ? b.logits[i] != 0 : i == b.n_tokens - 1;
        std::array<llama_pos, GGML_MROPE_SECTIONS> pos = {};
        if (b.pos != nullptr) {
            for (int32_t j = 0; j < (b.token != nullptr ? 1 : cb.n_pos); ++j) {
                pos[j] = b.pos[(size_t) j * b.n_tokens + i]; // M-RoPE embeddings: section-major
            }
        } else if (seq0 >= 0 && (size_t) seq0 < pos_next.size()) {
            pos[0] = pos_next[seq0]++;
        }
        const llama_embd embd = { b.embd != nullptr ? b.embd + (size_t) i * n_embd : nullptr, 1, n_embd };
        int32_t idx;
        if (b.token != nullptr) {
            idx = cb.add(b.token[i], pos[0], seq0, output);
            if (embd.data != nullptr) {
                cb.set_embd(idx, embd);
            }
        } else {
            idx = cb.add_embd(embd, pos.data(), seq0, output);
        }
        for (int32_t k = 1; b.seq_id != nullptr && b.n_seq_id != nullptr && k < b.n_seq_id[i]; ++k) {
            cb.add_seq(idx, b.seq_id[i][k]);
        }
    }
    return cb;
}

extern "C" {

const char * pyspec_ref_patches(void) {
    return ""; // no patch at this revision (see the list at the top of this file)
}

void pyspec_ref_spec_params_default(pyspec_ref_spec_params * out) {
    if (out == nullptr) {
        return;
    }
    static std::vector<int32_t> types;
    const auto & d = spec_defaults();
    types.assign(d.types.begin(), d.types.end());

    *out = {};
    out->types   = types.data();
    out->n_types = (int32_t) types.size();

    out->draft.n_max            = d.draft.n_max;
    out->draft.n_min            = d.draft.n_min;
    out->draft.p_split          = d.draft.p_split;
    out->draft.p_min            = d.draft.p_min;
    out->draft.backend_sampling = d.draft.backend_sampling;
    out->draft.ctx_tgt          = d.draft.ctx_tgt;
    out->draft.ctx_dft          = d.draft.ctx_dft;
    out->draft.n_gpu_layers     = d.draft.n_gpu_layers;

    out->ngram_mod.n_match = d.ngram_mod.n_match;
    out->ngram_mod.n_max   = d.ngram_mod.n_max;
    out->ngram_mod.n_min   = d.ngram_mod.n_min;

    from_ngram_map(out->ngram_simple,  d.ngram_simple);
    from_ngram_map(out->ngram_map_k,   d.ngram_map_k);
    from_ngram_map(out->ngram_map_k4v, d.ngram_map_k4v);

    out->lookup_cache_static  = nullptr;
    out->lookup_cache_dynamic = nullptr;

    out->synth_len     = d.synth_len;
    out->synth_rates   = nullptr;
    out->n_synth_rates = 0;
}

const char * pyspec_ref_spec_type_str(int32_t type) {
    if (!spec_type_valid(type)) {
        return "";
    }
    static std::string names[COMMON_SPECULATIVE_TYPE_COUNT];
    if (spec_type_names[type] == nullptr) {
        names[type] = ref::common_speculative_type_to_str((common_speculative_type) type);
        spec_type_names[type] = names[type].c_str();
    }
    return spec_type_names[type];
}

int32_t pyspec_ref_spec_types_from_names(const char * const * names, int32_t n_names, int32_t * out, int32_t out_cap) {
    REQUIRE(n_names >= 0 && (n_names == 0 || names != nullptr), PYSPEC_REF_E_NULL, "invalid names");
    REQUIRE(out_cap >= 0 && (out_cap == 0 || out != nullptr), PYSPEC_REF_E_NULL, "invalid output buffer");
    for (int32_t i = 0; i < n_names; ++i) {
        REQUIRE(names[i] != nullptr, PYSPEC_REF_E_NULL, "name %d is NULL", (int) i);
    }
    return guarded([&] {
        const std::vector<std::string> v(names, names + n_names);
        const auto types = ref::common_speculative_types_from_names(v); // throws for an unknown name
        for (size_t i = 0; i < types.size() && i < (size_t) out_cap; ++i) {
            out[i] = (int32_t) types[i];
        }
        return (int) types.size();
    });
}

int32_t pyspec_ref_spec_types_from_gguf(const char * path, int32_t * out, int32_t out_cap) {
    REQUIRE(path != nullptr, PYSPEC_REF_E_NULL, "path is NULL");
    REQUIRE(out_cap >= 0 && (out_cap == 0 || out != nullptr), PYSPEC_REF_E_NULL, "invalid output buffer");
    // gguf_get_val_u32 GGML_ASSERTs on a missing or non-uint32 <arch>.block_count: checked first,
    // with the message the port raises (pyspec.common.speculative.common_speculative_types_from_gguf)
    {
        gguf_init_params gp = { /* .no_alloc = */ true, /* .ctx = */ nullptr };
        gguf_context_ptr g(gguf_init_from_file(path, gp));
        if (g) {
            const int64_t arch_id = gguf_find_key(g.get(), "general.architecture");
            if (arch_id >= 0 && gguf_get_kv_type(g.get(), arch_id) == GGUF_TYPE_STRING) {
                const std::string arch = gguf_get_val_str(g.get(), arch_id);
                const int64_t key_id = gguf_find_key(g.get(), (arch + ".block_count").c_str());
                if (arch != "dflash" && (key_id < 0 || gguf_get_kv_type(g.get(), key_id) != GGUF_TYPE_UINT32)) {
                    return pyspec::fail(PYSPEC_REF_E_STATE,
                                        "GGML_ASSERT(gguf_get_kv_type(ctx, key_id) == GGUF_TYPE_UINT32) failed: %s.block_count",
                                        arch.c_str());
                }
            }
        }
    }
    return guarded([&] {
        const auto types = ref::common_speculative_types_from_gguf(path);
        for (size_t i = 0; i < types.size() && i < (size_t) out_cap; ++i) {
            out[i] = (int32_t) types[i];
        }
        return (int) types.size();
    });
}

int32_t pyspec_ref_spec_type_from_name(const char * name) {
    REQUIRE(name != nullptr, PYSPEC_REF_E_NULL, "name is NULL");
    return guarded([&] { return (int) ref::common_speculative_type_from_name(name); });
}

const char * pyspec_ref_spec_all_types_str(void) {
    return ref::common_speculative_all_types_str();
}

int32_t pyspec_ref_spec_type_name_str(const int32_t * types, int32_t n_types, char * out, size_t out_cap) {
    REQUIRE(n_types >= 0 && (n_types == 0 || types != nullptr), PYSPEC_REF_E_NULL, "invalid types");
    REQUIRE(out_cap == 0 || out != nullptr, PYSPEC_REF_E_NULL, "invalid output buffer");
    std::vector<common_speculative_type> v;
    for (int32_t i = 0; i < n_types; ++i) {
        // COUNT is in range: common_speculative_type_to_str names it "unknown"
        REQUIRE(types[i] >= 0 && types[i] <= COMMON_SPECULATIVE_TYPE_COUNT, PYSPEC_REF_E_RANGE,
                "type %d out of range [0, %d]", (int) types[i], (int) COMMON_SPECULATIVE_TYPE_COUNT);
        v.push_back((common_speculative_type) types[i]);
    }
    return guarded([&] {
        const std::string str = ref::common_speculative_type_name_str(v);
        if (out_cap > 0) {
            snprintf(out, out_cap, "%s", str.c_str());
        }
        return (int) str.size();
    });
}

pyspec_ref_spec * pyspec_ref_spec_init(const pyspec_ref_spec_params * params, uint32_t n_seq) {
    pyspec::last_error().clear();

    auto fail = [&](const std::string & msg) -> pyspec_ref_spec * {
        pyspec::last_error() = msg;
        return nullptr;
    };

    if (params == nullptr) {
        return fail("params is NULL");
    }
    if (n_seq == 0) {
        return fail("n_seq must be > 0");
    }
    if (params->n_types < 0 || (params->n_types > 0 && params->types == nullptr)) {
        return fail("invalid types array");
    }
    if (params->n_synth_rates < 0 || (params->n_synth_rates > 0 && params->synth_rates == nullptr)) {
        return fail("invalid synth_rates array");
    }

    try {
        common_params_speculative p;

        p.types.clear();
        for (int32_t i = 0; i < params->n_types; ++i) {
            if (!spec_type_valid(params->types[i])) {
                return fail("unknown speculative type: " + std::to_string(params->types[i]));
            }
            p.types.push_back((common_speculative_type) params->types[i]);
        }

        p.draft.n_max            = params->draft.n_max;
        p.draft.n_min            = params->draft.n_min;
        p.draft.p_split          = params->draft.p_split;
        p.draft.p_min            = params->draft.p_min;
        p.draft.backend_sampling = params->draft.backend_sampling;
        p.draft.ctx_tgt          = params->draft.ctx_tgt;
        p.draft.ctx_dft          = params->draft.ctx_dft;
        p.draft.n_gpu_layers     = params->draft.n_gpu_layers;

        p.ngram_mod.n_match = params->ngram_mod.n_match;
        p.ngram_mod.n_max   = params->ngram_mod.n_max;
        p.ngram_mod.n_min   = params->ngram_mod.n_min;

        to_ngram_map(p.ngram_simple,  params->ngram_simple);
        to_ngram_map(p.ngram_map_k,   params->ngram_map_k);
        to_ngram_map(p.ngram_map_k4v, params->ngram_map_k4v);

        p.synth_len = params->synth_len;
        p.synth_rates.assign(params->synth_rates, params->synth_rates + params->n_synth_rates);

        p.ngram_cache.lookup_cache_static  = params->lookup_cache_static  ? params->lookup_cache_static  : "";
        p.ngram_cache.lookup_cache_dynamic = params->lookup_cache_dynamic ? params->lookup_cache_dynamic : "";

        const std::string msg = check_spec_params(p);
        if (!msg.empty()) {
            return fail(msg);
        }

        auto res = std::make_unique<pyspec_ref_spec>();
        res->n_seq = n_seq;
        res->n_max = ref::common_speculative_n_max(&p);
        res->ctx_tgt = p.draft.ctx_tgt;
        res->spec  = ref::common_speculative_init(p, n_seq);
        if (res->spec == nullptr) {
            return nullptr; // no implementation selected: err stays ""
        }
        const std::string msg_impl = check_dflash(*res->spec, n_seq);
        if (!msg_impl.empty()) {
            return fail(msg_impl); // res frees the implementations (their destructors detach the samplers)
        }

        // every dparams entry needs valid prompt/result pointers: the
        // dispatcher dereferences result for all sequences after each impl
        res->prompts.resize(n_seq);
        res->results.resize(n_seq);
        for (uint32_t s = 0; s < n_seq; ++s) {
            auto & dp = res->spec->dparams[s];
            dp.prompt = &res->prompts[s];
            dp.result = &res->results[s];
        }

        return res.release();
    } catch (const std::exception & e) {
        return fail(e.what());
    } catch (...) {
        return fail("unknown C++ exception");
    }
}

void pyspec_ref_spec_free(pyspec_ref_spec * spec) {
    delete spec;
}

uint32_t pyspec_ref_spec_n_seq(const pyspec_ref_spec * spec) {
    return spec ? spec->n_seq : 0;
}

int32_t pyspec_ref_spec_n_max(const pyspec_ref_spec * spec) {
    return spec ? spec->n_max : 0;
}

#define REQUIRE_SPEC(spec) REQUIRE((spec) != nullptr && (spec)->spec != nullptr, PYSPEC_REF_E_NULL, "spec is NULL")
#define REQUIRE_SEQ(spec, seq_id) \
    REQUIRE((seq_id) >= 0 && (uint32_t) (seq_id) < (spec)->n_seq, PYSPEC_REF_E_RANGE, \
            "seq_id %d out of range [0, %u)", (int) (seq_id), (spec)->n_seq)

int pyspec_ref_spec_begin(pyspec_ref_spec * spec, llama_seq_id seq_id,
                          const llama_token * prompt, int32_t n_prompt) {
    REQUIRE_SPEC(spec);
    REQUIRE_SEQ(spec, seq_id);
    REQUIRE(n_prompt >= 0 && (n_prompt == 0 || prompt != nullptr), PYSPEC_REF_E_NULL, "invalid prompt");
    return guarded([&] {
        const llama_tokens tokens(prompt, prompt + n_prompt);
        ref::common_speculative_begin(spec->spec, seq_id, tokens);
        return (int) PYSPEC_REF_OK;
    });
}

int pyspec_ref_spec_process(pyspec_ref_spec * spec, const llama_batch * batch) {
    REQUIRE_SPEC(spec);
    REQUIRE(batch != nullptr, PYSPEC_REF_E_NULL, "batch is NULL");

    const llama_batch & b = *batch;
    REQUIRE(b.n_tokens >= 0, PYSPEC_REF_E_RANGE, "batch.n_tokens < 0");

    // draft-eagle3 / draft-mtp read the sequence layout of token batches and
    // assert one seq_id per token
    bool needs_layout = false;
    for (const auto & impl : spec->spec->impls) {
        needs_layout |= impl->type == COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3 ||
                        impl->type == COMMON_SPECULATIVE_TYPE_DRAFT_MTP;
    }
    if (needs_layout && b.token != nullptr && b.embd == nullptr && b.n_tokens > 0) {
        REQUIRE(b.pos != nullptr && b.n_seq_id != nullptr && b.seq_id != nullptr, PYSPEC_REF_E_NULL,
                "batch has no pos / n_seq_id / seq_id arrays");
        std::vector<bool> present(spec->n_seq, false);
        int32_t n_present = 0;
        for (int32_t k = 0; k < b.n_tokens; ++k) {
            REQUIRE(b.n_seq_id[k] == 1 && b.seq_id[k] != nullptr, PYSPEC_REF_E_RANGE,
                    "batch token %d: exactly one seq_id per token is required", (int) k);
            const llama_seq_id s = b.seq_id[k][0];
            if (s >= 0 && (uint32_t) s < spec->n_seq && !present[s]) {
                present[s] = true;
                n_present++;
            }
        }
        for (const auto & impl : spec->spec->impls) {
            if (const auto * e3 = dynamic_cast<const ref::common_speculative_impl_draft_eagle3 *>(impl.get())) {
                // per sequence its draft batch gets n_rows - 1 rows plus at most one
                // cross-ubatch bridge, so at most n_tokens rows in all
                const int32_t n_b = (int32_t) llama_n_batch(e3->params.ctx_dft);
                REQUIRE(b.n_tokens <= n_b, PYSPEC_REF_E_RANGE,
                        "EAGLE3: batch of %d tokens does not fit the draft n_batch %d", (int) b.n_tokens, (int) n_b);
            }
            if (const auto * mtp = dynamic_cast<const ref::common_speculative_impl_draft_mtp *>(impl.get())) {
                const int32_t n_b = (int32_t) llama_n_batch(mtp->params.ctx_dft);
                REQUIRE(b.n_tokens <= n_b, PYSPEC_REF_E_RANGE,
                        "MTP: batch of %d tokens does not fit the draft n_batch %d", (int) b.n_tokens, (int) n_b);
                // it copies the target's nextn rows of this batch without checking them
                llama_context * ctx_tgt = mtp->params.ctx_tgt;
                REQUIRE(mtp->is_mem_shared || llama_get_embeddings_nextn(ctx_tgt) != nullptr, PYSPEC_REF_E_STATE,
                        "MTP: the target context holds no nextn embeddings (decode the batch on it first)");
                for (int32_t k = 0; k < b.n_tokens; ++k) {
                    const llama_seq_id s = b.seq_id[k][0];
                    if (s >= 0 && (uint32_t) s < spec->n_seq) {
                        REQUIRE(llama_get_embeddings_nextn_ith(ctx_tgt, k) != nullptr, PYSPEC_REF_E_STATE,
                                "MTP: the target context has no nextn embedding for batch row %d", (int) k);
                    }
                }
            }
        }
    }

    // the audit check (docs/audit.toml ref-draft-token-vocab): get_sub_batch aborts on a token the draft lacks
    const draft_limits lim = draft_n_vocab(*spec->spec);
    for (int32_t k = 0; lim.n_vocab != INT32_MAX && k < b.n_tokens; ++k) {
        REQUIRE(b.token == nullptr || (b.token[k] >= 0 && b.token[k] < lim.n_vocab), PYSPEC_REF_E_RANGE,
                "batch token %d at index %d is outside the draft vocabulary (0..%d)", b.token ? (int) b.token[k] : 0,
                (int) k, (int) lim.n_vocab - 1);
        for (int32_t j = 0; b.seq_id != nullptr && b.n_seq_id != nullptr && j < b.n_seq_id[k]; ++j) {
            REQUIRE(b.seq_id[k] != nullptr && b.seq_id[k][j] >= 0 && b.seq_id[k][j] < lim.n_seq, PYSPEC_REF_E_RANGE,
                    "batch index %d: seq_id %d is outside the draft context's sequences (0..%d)", (int) k,
                    b.seq_id[k] != nullptr ? (int) b.seq_id[k][j] : -1, (int) lim.n_seq - 1);
        }
    }

    return guarded([&] {
        const common_batch cb = to_common_batch(spec, b);
        return ref::common_speculative_process(spec->spec, cb) ? 1 : 0;
    });
}

int32_t pyspec_ref_spec_n_max_effective(const pyspec_ref_spec * spec) {
    REQUIRE_SPEC(spec);
    return ref::common_speculative_n_max(spec->spec);
}

int32_t pyspec_ref_spec_get_synth_probs(const pyspec_ref_spec * spec, double * out, int32_t out_cap) {
    REQUIRE_SPEC(spec);
    REQUIRE(out_cap >= 0 && (out_cap == 0 || out != nullptr), PYSPEC_REF_E_NULL, "invalid output buffer");
    const auto & probs = ref::common_speculative_get_synth_probs(spec->spec);
    std::copy(probs.begin(), probs.begin() + std::min(probs.size(), (size_t) out_cap), out);
    return (int32_t) probs.size();
}

int64_t pyspec_ref_spec_get_state(pyspec_ref_spec * spec, llama_seq_id seq_id, uint8_t * out, size_t out_cap) {
    REQUIRE_SPEC(spec);
    REQUIRE_SEQ(spec, seq_id);
    REQUIRE(out_cap == 0 || out != nullptr, PYSPEC_REF_E_NULL, "invalid output buffer");
    int64_t n = 0;
    const int rc = guarded([&] {
        std::vector<uint8_t> data;
        if (ref::common_speculative_get_state(spec->spec, seq_id, data)) {
            std::copy(data.begin(), data.begin() + std::min(data.size(), out_cap), out);
            n = (int64_t) data.size();
        }
        return (int) PYSPEC_REF_OK;
    });
    return rc < 0 ? rc : n;
}

int pyspec_ref_spec_set_state(pyspec_ref_spec * spec, llama_seq_id seq_id, const uint8_t * data, size_t n) {
    REQUIRE_SPEC(spec);
    REQUIRE_SEQ(spec, seq_id);
    REQUIRE(n == 0 || data != nullptr, PYSPEC_REF_E_NULL, "invalid data");
    return guarded([&] {
        ref::common_speculative_set_state(spec->spec, seq_id, std::vector<uint8_t>(data, data + n));
        return (int) PYSPEC_REF_OK;
    });
}

int pyspec_ref_spec_draft(pyspec_ref_spec * spec, pyspec_ref_draft_request * reqs, int32_t n_reqs) {
    REQUIRE_SPEC(spec);
    REQUIRE(n_reqs >= 0 && (n_reqs == 0 || reqs != nullptr), PYSPEC_REF_E_NULL, "invalid requests");

    std::vector<bool> seen(spec->n_seq, false);
    for (int32_t r = 0; r < n_reqs; ++r) {
        const auto & q = reqs[r];
        REQUIRE_SEQ(spec, q.seq_id);
        REQUIRE(!seen[q.seq_id], PYSPEC_REF_E_RANGE, "seq_id %d requested twice", (int) q.seq_id);
        REQUIRE(q.n_prompt >= 0 && (q.n_prompt == 0 || q.prompt != nullptr), PYSPEC_REF_E_NULL,
                "seq_id %d: invalid prompt", (int) q.seq_id);
        REQUIRE(q.out_cap >= 0 && (q.out_cap == 0 || q.out != nullptr), PYSPEC_REF_E_NULL,
                "seq_id %d: invalid output buffer", (int) q.seq_id);
        seen[q.seq_id] = true;
    }

    // the audit check (docs/audit.toml ref-draft-token-vocab): the draft batch starts with id_last
    const draft_limits lim = draft_n_vocab(*spec->spec);
    for (int32_t r = 0; r < n_reqs; ++r) {
        REQUIRE(lim.n_vocab == INT32_MAX || (reqs[r].id_last >= 0 && reqs[r].id_last < lim.n_vocab), PYSPEC_REF_E_RANGE,
                "seq_id %d: id_last %d is outside the draft vocabulary (0..%d)", (int) reqs[r].seq_id,
                (int) reqs[r].id_last, (int) lim.n_vocab - 1);
        REQUIRE(reqs[r].seq_id < lim.n_seq, PYSPEC_REF_E_RANGE,
                "seq_id %d is outside the draft context's sequences (0..%d)", (int) reqs[r].seq_id, (int) lim.n_seq - 1);
    }

    // common_ngram_map_draft aborts when the history shrank below what it
    // already scanned (without a begin() in between)
    for (const auto & impl : spec->spec->impls) {
        const auto * mk = dynamic_cast<const ref::common_speculative_impl_ngram_map_k *>(impl.get());
        if (mk == nullptr) {
            continue;
        }
        for (int32_t r = 0; r < n_reqs; ++r) {
            const auto & map = mk->config[reqs[r].seq_id];
            const size_t cur_len = (size_t) reqs[r].n_prompt;
            // the conditions of common_ngram_map_draft, which returns before them for short prompts;
            // the messages of its GGML_ABORTs, as the port raises them
            if (cur_len < 2 * (size_t) map.size_key + map.size_value) {
                continue;
            }
            REQUIRE(map.idx_last_check <= cur_len, PYSPEC_REF_E_STATE,
                    "common_ngram_map_draft: map.idx_last_check > cur_len: %zu > %zu", map.idx_last_check, cur_len);
            REQUIRE(map.size_last_begin <= cur_len, PYSPEC_REF_E_STATE,
                    "common_ngram_map_draft: map.size_last_begin > cur_len: %zu > %zu", map.size_last_begin, cur_len);
        }
    }

    return guarded([&] {
        auto & dparams = spec->spec->dparams;
        for (auto & dp : dparams) {
            dp.drafting = false;
        }
        for (int32_t r = 0; r < n_reqs; ++r) {
            const auto & q = reqs[r];
            auto & dp = ref::common_speculative_get_draft_params(spec->spec, q.seq_id);

            spec->prompts[q.seq_id].assign(q.prompt, q.prompt + q.n_prompt);
            spec->results[q.seq_id].clear();

            dp.drafting = true;
            dp.n_max    = q.n_max;
            dp.pos0     = q.pos0;
            dp.id_last  = q.id_last;
            dp.prompt   = &spec->prompts[q.seq_id];
            dp.result   = &spec->results[q.seq_id];
        }

        ref::common_speculative_draft(spec->spec);

        int status = PYSPEC_REF_OK;
        for (int32_t r = 0; r < n_reqs; ++r) {
            auto & q = reqs[r];
            const auto & result = spec->results[q.seq_id];
            q.n_out = (int32_t) result.size();
            const size_t n_copy = std::min(result.size(), (size_t) q.out_cap);
            std::copy(result.begin(), result.begin() + n_copy, q.out);
            if (result.size() > (size_t) q.out_cap) {
                status = pyspec::fail(PYSPEC_REF_E_CAPACITY, "seq_id %d: draft of %zu tokens, out_cap %d",
                                   (int) q.seq_id, result.size(), (int) q.out_cap);
            }
        }
        return status;
    });
}

int32_t pyspec_ref_spec_get_result(const pyspec_ref_spec * spec, llama_seq_id seq_id,
                                   llama_token * out, int32_t out_cap) {
    REQUIRE_SPEC(spec);
    REQUIRE_SEQ(spec, seq_id);
    REQUIRE(out_cap >= 0 && (out_cap == 0 || out != nullptr), PYSPEC_REF_E_NULL, "invalid output buffer");
    const auto & result = spec->results[seq_id];
    std::copy(result.begin(), result.begin() + std::min(result.size(), (size_t) out_cap), out);
    return (int32_t) result.size();
}

int pyspec_ref_spec_accept(pyspec_ref_spec * spec, llama_seq_id seq_id, int32_t n_accepted) {
    REQUIRE_SPEC(spec);
    REQUIRE_SEQ(spec, seq_id);
    REQUIRE(n_accepted >= 0 && n_accepted <= UINT16_MAX, PYSPEC_REF_E_RANGE,
            "n_accepted %d out of range [0, %d]", (int) n_accepted, (int) UINT16_MAX);
    // without a draft for seq_id the reference GGML_ASSERTs n_accepted == 0 (and returns)
    REQUIRE(spec->spec->impl_last[seq_id] != nullptr || n_accepted == 0, PYSPEC_REF_E_STATE,
            "seq_id %d: accept without a previous draft (impl_last is null)", (int) seq_id);
    // common_ngram_map_accept indexes keys[last_draft_key_idx] unchecked, and a
    // common_ngram_map_begin since the draft may have dropped that key
    for (const auto & impl : spec->spec->impls) {
        const auto * mk = dynamic_cast<const ref::common_speculative_impl_ngram_map_k *>(impl.get());
        if (mk == nullptr || impl.get() != spec->spec->impl_last[seq_id]) {
            continue;
        }
        const common_ngram_map & map = mk->config[seq_id];
        REQUIRE(!map.last_draft_created || map.last_draft_key_idx < map.keys.size(), PYSPEC_REF_E_STATE,
                "common_ngram_map_accept: the drafted key %zu no longer exists (common_ngram_map_begin dropped it)",
                map.last_draft_key_idx);
    }
    return guarded([&] {
        ref::common_speculative_accept(spec->spec, seq_id, (uint16_t) n_accepted);
        return (int) PYSPEC_REF_OK;
    });
}

int pyspec_ref_spec_print_stats(const pyspec_ref_spec * spec) {
    REQUIRE_SPEC(spec);
    return guarded([&] {
        ref::common_speculative_print_stats(spec->spec);
        return (int) PYSPEC_REF_OK;
    });
}

int32_t pyspec_ref_spec_n_impls(const pyspec_ref_spec * spec) {
    REQUIRE_SPEC(spec);
    return (int32_t) spec->spec->impls.size();
}

int pyspec_ref_spec_get_impl(const pyspec_ref_spec * spec, int32_t i, pyspec_ref_impl_stats * out) {
    REQUIRE_SPEC(spec);
    REQUIRE(out != nullptr, PYSPEC_REF_E_NULL, "out is NULL");
    REQUIRE(i >= 0 && (size_t) i < spec->spec->impls.size(), PYSPEC_REF_E_RANGE,
            "impl index %d out of range [0, %zu)", (int) i, spec->spec->impls.size());

    const auto & impl = *spec->spec->impls[i];
    out->type          = (int32_t) impl.type;
    out->n_call_begin  = impl.n_call_begin;
    out->n_call_draft  = impl.n_call_draft;
    out->n_call_accept = impl.n_call_accept;
    out->n_gen_drafts  = impl.n_gen_drafts;
    out->n_acc_drafts  = impl.n_acc_drafts;
    out->n_gen_tokens  = impl.n_gen_tokens;
    out->n_acc_tokens  = impl.n_acc_tokens;
    out->t_begin_us    = impl.t_begin_us;
    out->t_draft_us    = impl.t_draft_us;
    out->t_accept_us   = impl.t_accept_us;
    return PYSPEC_REF_OK;
}

int32_t pyspec_ref_spec_last_impl_type(const pyspec_ref_spec * spec, llama_seq_id seq_id) {
    REQUIRE_SPEC(spec);
    REQUIRE_SEQ(spec, seq_id);
    const auto * impl = spec->spec->impl_last[seq_id];
    return impl ? (int32_t) impl->type : (int32_t) COMMON_SPECULATIVE_TYPE_NONE;
}

} // extern "C"
