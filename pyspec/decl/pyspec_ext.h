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

/* struct sizes as the C++ compiler sees them (checked at load time) */
size_t pyspec_sizeof_context_params(void);
size_t pyspec_sizeof_model_params(void);
size_t pyspec_sizeof_batch(void);
size_t pyspec_sizeof_token_data_array(void);
size_t pyspec_sizeof_perf_context_data(void);
