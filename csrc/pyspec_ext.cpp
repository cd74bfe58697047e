// C linkage for the staging API of llama.cpp's src/llama-ext.h.
//
// libllama exports these functions with C++ linkage (mangled names), which
// cffi cannot declare; each wrapper below forwards one call unchanged.

#include "llama-ext.h"

extern "C" {

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

// Sizes of the structs that cffi lays out from our declarations: pyspec
// compares them at load time, so a layout drift fails loudly instead of
// corrupting memory.
size_t pyspec_sizeof_context_params(void) { return sizeof(llama_context_params); }
size_t pyspec_sizeof_model_params(void)   { return sizeof(llama_model_params); }
size_t pyspec_sizeof_batch(void)          { return sizeof(llama_batch); }
size_t pyspec_sizeof_token_data_array(void) { return sizeof(llama_token_data_array); }
size_t pyspec_sizeof_perf_context_data(void) { return sizeof(llama_perf_context_data); }

}
