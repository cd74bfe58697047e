/* csrc/pyspec_ext.cpp: C linkage for the staging API of src/llama-ext.h. */

void            pyspec_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float *         pyspec_get_embeddings_nextn(struct llama_context * ctx);
float *         pyspec_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
void            pyspec_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
float *         pyspec_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
struct llama_context * pyspec_get_ctx_other(struct llama_context * ctx);
const int32_t * pyspec_model_target_layer_ids(const struct llama_model * model);
uint32_t        pyspec_model_target_layer_ids_n(const struct llama_model * model);

/* batch-invariant mode: ggml-cpu's reference kernels on the context's CPU backends;
   returns how many were switched, *n_other the backends of other kinds */
int32_t pyspec_context_set_cpu_use_ref(struct llama_context * ctx, bool value, int32_t * n_other);

/* common_sampler::set_logits' fill of {id, logit, 0} for a full logits row */
void pyspec_fill_candidates(llama_token_data * dst, const float * logits, int32_t n_vocab);

/* The struct layout probe: one entry per struct (field "", its size and alignment)
   and per field (its offset and size) of the structs declared for llama.cpp's
   headers, as the compiler sees them; pyspec.ffi checks them when it opens the
   libraries. */
typedef struct pyspec_layout_entry {
    const char * type;
    const char * field;
    size_t       offset;
    size_t       size;
    size_t       align;
} pyspec_layout_entry;

size_t                      pyspec_layout_count(void);
const pyspec_layout_entry * pyspec_layout_table(void);
