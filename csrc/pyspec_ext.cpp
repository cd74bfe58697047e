// C linkage for the staging API of llama.cpp's src/llama-ext.h, and the struct
// layout probe.
//
// libllama exports the staging API with C++ linkage (mangled names), which
// cffi cannot declare; each wrapper below forwards one call unchanged.

#include "llama.h"
#include "llama-ext.h"

#include <cstddef>

extern "C" {

// the declarations cffi reads, so the compiler checks them against the definitions below
#include "../pyspec/decl/pyspec_ext.h"

void pyspec_set_embeddings_nextn(llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

float * pyspec_get_embeddings_nextn(llama_context * ctx) {
    return llama_get_embeddings_nextn(ctx);
}

float * pyspec_get_embeddings_nextn_ith(llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

void pyspec_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value) {
    llama_set_embeddings_layer_inp(ctx, lid, value);
}

float * pyspec_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid) {
    return llama_get_embeddings_layer_inp(ctx, lid);
}

llama_context * pyspec_get_ctx_other(llama_context * ctx) {
    return llama_get_ctx_other(ctx);
}

const int32_t * pyspec_model_target_layer_ids(const llama_model * model) {
    return llama_model_target_layer_ids(model);
}

uint32_t pyspec_model_target_layer_ids_n(const llama_model * model) {
    return llama_model_target_layer_ids_n(model);
}

// The candidate array of common_sampler::set_logits (common/sampling.cpp) for a
// full logits row: {id, logit, 0}. A C loop, because numpy's strided writes
// into the interleaved llama_token_data array cost several times more for a
// 262k-token vocabulary, on every sampled token.
void pyspec_fill_candidates(llama_token_data * dst, const float * logits, int32_t n_vocab) {
    for (llama_token token_id = 0; token_id < n_vocab; token_id++) {
        dst[token_id] = llama_token_data{token_id, logits[token_id], 0.0f};
    }
}

// The layout of every struct that pyspec/decl declares for a llama.cpp header,
// as this compiler sees it: pyspec.ffi compares it with cffi's layout of the
// same declarations when it opens the libraries. The table is generated from
// the declarations at build time (csrc/gen_layout_probe.py).
static const pyspec_layout_entry pyspec_layout[] = {
#include "pyspec_layout_table.inc"
};

size_t pyspec_layout_count(void) { return sizeof(pyspec_layout) / sizeof(pyspec_layout[0]); }

const pyspec_layout_entry * pyspec_layout_table(void) { return pyspec_layout; }

}
