/* Subset of include/llama.h (llama.cpp e3a74b299) that pyspec uses.
   Struct layouts are copied field for field: their order matters. */

struct llama_vocab;
struct llama_model;
struct llama_context;
struct llama_sampler;

typedef struct llama_memory_i * llama_memory_t;

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

#define LLAMA_DEFAULT_SEED 0xFFFFFFFF

enum llama_vocab_type {
    LLAMA_VOCAB_TYPE_NONE   = 0,
    LLAMA_VOCAB_TYPE_SPM    = 1,
    LLAMA_VOCAB_TYPE_BPE    = 2,
    LLAMA_VOCAB_TYPE_WPM    = 3,
    LLAMA_VOCAB_TYPE_UGM    = 4,
    LLAMA_VOCAB_TYPE_RWKV   = 5,
    LLAMA_VOCAB_TYPE_PLAMO2 = 6,
};

enum llama_token_attr {
    LLAMA_TOKEN_ATTR_UNDEFINED    = 0,
    LLAMA_TOKEN_ATTR_UNKNOWN      = 1,
    LLAMA_TOKEN_ATTR_UNUSED       = 2,
    LLAMA_TOKEN_ATTR_NORMAL       = 4,
    LLAMA_TOKEN_ATTR_CONTROL      = 8,
    LLAMA_TOKEN_ATTR_USER_DEFINED = 16,
    LLAMA_TOKEN_ATTR_BYTE         = 32,
    LLAMA_TOKEN_ATTR_NORMALIZED   = 64,
    LLAMA_TOKEN_ATTR_LSTRIP       = 128,
    LLAMA_TOKEN_ATTR_RSTRIP       = 256,
    LLAMA_TOKEN_ATTR_SINGLE_WORD  = 512,
};

enum llama_rope_scaling_type {
    LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1,
    LLAMA_ROPE_SCALING_TYPE_NONE        = 0,
    LLAMA_ROPE_SCALING_TYPE_LINEAR      = 1,
    LLAMA_ROPE_SCALING_TYPE_YARN        = 2,
    LLAMA_ROPE_SCALING_TYPE_LONGROPE    = 3,
};

enum llama_pooling_type {
    LLAMA_POOLING_TYPE_UNSPECIFIED = -1,
    LLAMA_POOLING_TYPE_NONE = 0,
    LLAMA_POOLING_TYPE_MEAN = 1,
    LLAMA_POOLING_TYPE_CLS  = 2,
    LLAMA_POOLING_TYPE_LAST = 3,
    LLAMA_POOLING_TYPE_RANK = 4,
};

enum llama_attention_type {
    LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1,
    LLAMA_ATTENTION_TYPE_CAUSAL      = 0,
    LLAMA_ATTENTION_TYPE_NON_CAUSAL  = 1,
};

enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO     = -1,
    LLAMA_FLASH_ATTN_TYPE_DISABLED = 0,
    LLAMA_FLASH_ATTN_TYPE_ENABLED  = 1,
};

enum llama_split_mode {
    LLAMA_SPLIT_MODE_NONE   = 0,
    LLAMA_SPLIT_MODE_LAYER  = 1,
    LLAMA_SPLIT_MODE_ROW    = 2,
    LLAMA_SPLIT_MODE_TENSOR = 3,
};

enum llama_rope_type {
    LLAMA_ROPE_TYPE_NONE   = -1,
    LLAMA_ROPE_TYPE_NORM   = 0,
    LLAMA_ROPE_TYPE_NEOX   = 2,
    LLAMA_ROPE_TYPE_MROPE  = 8,
    LLAMA_ROPE_TYPE_VISION = 24,
    LLAMA_ROPE_TYPE_IMROPE = 40,
};

enum llama_context_type {
    LLAMA_CONTEXT_TYPE_DEFAULT = 0,
    LLAMA_CONTEXT_TYPE_MTP     = 1,
};

typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
} llama_token_data;

typedef struct llama_token_data_array {
    llama_token_data * data;
    size_t size;
    int64_t selected;
    bool sorted;
} llama_token_data_array;

typedef bool (*llama_progress_callback)(float progress, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;

    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_model_kv_override;
struct llama_model_tensor_buft_override;

struct llama_model_params {
    ggml_backend_dev_t * devices;
    const struct llama_model_tensor_buft_override * tensor_buft_overrides;

    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    int32_t main_gpu;
    const float * tensor_split;

    llama_progress_callback progress_callback;
    void * progress_callback_user_data;

    const struct llama_model_kv_override * kv_overrides;

    bool vocab_only;
    bool use_mmap;
    bool use_direct_io;
    bool use_mlock;
    bool check_tensors;
    bool use_extra_bufts;
    bool no_host;
    bool no_alloc;
};

struct llama_sampler_seq_config {
    llama_seq_id           seq_id;
    struct llama_sampler * sampler;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    uint32_t n_outputs_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;

    enum llama_context_type      ctx_type;
    enum llama_rope_scaling_type rope_scaling_type;
    enum llama_pooling_type      pooling_type;
    enum llama_attention_type    attention_type;
    enum llama_flash_attn_type   flash_attn_type;

    float    rope_freq_base;
    float    rope_freq_scale;
    float    yarn_ext_factor;
    float    yarn_attn_factor;
    float    yarn_beta_fast;
    float    yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    float    defrag_thold;

    ggml_backend_sched_eval_callback cb_eval;
    void * cb_eval_user_data;

    enum ggml_type type_k;
    enum ggml_type type_v;

    ggml_abort_callback abort_callback;
    void *              abort_callback_data;

    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool op_offload;
    bool swa_full;
    bool kv_unified;

    struct llama_sampler_seq_config * samplers;
    size_t                            n_samplers;

    struct llama_context * ctx_other;
};

typedef struct llama_logit_bias {
    llama_token token;
    float bias;
} llama_logit_bias;

typedef struct llama_sampler_chain_params {
    bool no_perf;
} llama_sampler_chain_params;

struct llama_perf_context_data {
    double t_start_ms;
    double t_load_ms;
    double t_p_eval_ms;
    double t_eval_ms;

    int32_t n_p_eval;
    int32_t n_eval;
    int32_t n_reused;
};

struct llama_perf_sampler_data {
    double t_sample_ms;
    int32_t n_sample;
};

/* defaults, backend */
struct llama_model_params          llama_model_default_params(void);
struct llama_context_params        llama_context_default_params(void);
struct llama_sampler_chain_params  llama_sampler_chain_default_params(void);

void llama_backend_init(void);
void llama_backend_free(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
int64_t llama_time_us(void);
size_t llama_max_devices(void);
size_t llama_max_parallel_sequences(void);
bool llama_supports_mmap(void);
bool llama_supports_mlock(void);
bool llama_supports_gpu_offload(void);

/* model */
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t  llama_model_n_ctx_train(const struct llama_model * model);
int32_t  llama_model_n_embd     (const struct llama_model * model);
int32_t  llama_model_n_embd_inp (const struct llama_model * model);
int32_t  llama_model_n_embd_out (const struct llama_model * model);
int32_t  llama_model_n_layer    (const struct llama_model * model);
int32_t  llama_model_n_head     (const struct llama_model * model);
int32_t  llama_model_n_head_kv  (const struct llama_model * model);
int32_t  llama_model_n_swa      (const struct llama_model * model);
uint32_t llama_model_n_cls_out  (const struct llama_model * model);
enum llama_rope_type llama_model_rope_type(const struct llama_model * model);
int32_t  llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t  llama_model_meta_count(const struct llama_model * model);
int32_t  llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t  llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t  llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
bool     llama_model_has_encoder(const struct llama_model * model);
bool     llama_model_has_decoder(const struct llama_model * model);
bool     llama_model_is_recurrent(const struct llama_model * model);
bool     llama_model_is_hybrid(const struct llama_model * model);

/* context */
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

uint32_t llama_n_ctx      (const struct llama_context * ctx);
uint32_t llama_n_ctx_seq  (const struct llama_context * ctx);
uint32_t llama_n_batch    (const struct llama_context * ctx);
uint32_t llama_n_ubatch   (const struct llama_context * ctx);
uint32_t llama_n_seq_max  (const struct llama_context * ctx);
uint32_t llama_n_rs_seq   (const struct llama_context * ctx);
enum llama_pooling_type llama_pooling_type(const struct llama_context * ctx);

const struct llama_model * llama_get_model (const struct llama_context * ctx);
llama_memory_t             llama_get_memory(const struct llama_context * ctx);

void    llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
int32_t llama_n_threads(struct llama_context * ctx);
int32_t llama_n_threads_batch(struct llama_context * ctx);
void    llama_set_embeddings(struct llama_context * ctx, bool embeddings);
void    llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
void    llama_synchronize(struct llama_context * ctx);

/* memory */
void      llama_memory_clear(llama_memory_t mem, bool data);
bool      llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void      llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void      llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
void      llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
void      llama_memory_seq_div(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
bool      llama_memory_can_shift(llama_memory_t mem);

/* state (per sequence: checkpoints) */
size_t llama_state_get_size(struct llama_context * ctx);
size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
typedef uint32_t llama_state_seq_flags;
size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id, llama_state_seq_flags flags);

/* batch, decode */
struct llama_batch llama_batch_get_one(llama_token * tokens, int32_t n_tokens);
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void    llama_batch_free(struct llama_batch batch);
int32_t llama_encode(struct llama_context * ctx, struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);

/* outputs */
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings(struct llama_context * ctx);
float * llama_get_embeddings_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);

/* backend sampling outputs */
llama_token   llama_get_sampled_token_ith(struct llama_context * ctx, int32_t i);
float *       llama_get_sampled_probs_ith(struct llama_context * ctx, int32_t i);
uint32_t      llama_get_sampled_probs_count_ith(struct llama_context * ctx, int32_t i);
float *       llama_get_sampled_logits_ith(struct llama_context * ctx, int32_t i);
uint32_t      llama_get_sampled_logits_count_ith(struct llama_context * ctx, int32_t i);
llama_token * llama_get_sampled_candidates_ith(struct llama_context * ctx, int32_t i);
uint32_t      llama_get_sampled_candidates_count_ith(struct llama_context * ctx, int32_t i);

/* vocab */
enum llama_vocab_type llama_vocab_type(const struct llama_vocab * vocab);
int32_t     llama_vocab_n_tokens(const struct llama_vocab * vocab);
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
float       llama_vocab_get_score(const struct llama_vocab * vocab, llama_token token);
enum llama_token_attr llama_vocab_get_attr(const struct llama_vocab * vocab, llama_token token);
bool        llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool        llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
llama_token llama_vocab_nl (const struct llama_vocab * vocab);
llama_token llama_vocab_pad(const struct llama_vocab * vocab);
bool        llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool        llama_vocab_get_add_eos(const struct llama_vocab * vocab);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

/* samplers */
bool   llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl);
const char * llama_sampler_name(const struct llama_sampler * smpl);
void   llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void   llama_sampler_apply (struct llama_sampler * smpl, llama_token_data_array * cur_p);
void   llama_sampler_reset (struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_clone(const struct llama_sampler * smpl);
void   llama_sampler_free  (struct llama_sampler * smpl);

struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void                   llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_chain_get(struct llama_sampler * chain, int32_t i);
int                    llama_sampler_chain_n  (const struct llama_sampler * chain);
struct llama_sampler * llama_sampler_chain_remove(struct llama_sampler * chain, int32_t i);

struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_typical(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_temp_ext(float t, float delta, float exponent);
struct llama_sampler * llama_sampler_init_xtc(float p, float t, size_t min_keep, uint32_t seed);
struct llama_sampler * llama_sampler_init_top_n_sigma(float n);
struct llama_sampler * llama_sampler_init_mirostat(int32_t n_vocab, uint32_t seed, float tau, float eta, int32_t m);
struct llama_sampler * llama_sampler_init_mirostat_v2(uint32_t seed, float tau, float eta);
struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * grammar_str, const char * grammar_root);
struct llama_sampler * llama_sampler_init_penalties(int32_t penalty_last_n, float penalty_repeat, float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_dry(const struct llama_vocab * vocab, int32_t n_ctx_train, float dry_multiplier,
                                              float dry_base, int32_t dry_allowed_length, int32_t dry_penalty_last_n,
                                              const char ** seq_breakers, size_t num_breakers);
struct llama_sampler * llama_sampler_init_adaptive_p(float target, float decay, uint32_t seed);
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias, const llama_logit_bias * logit_bias);
struct llama_sampler * llama_sampler_init_infill(const struct llama_vocab * vocab);
uint32_t    llama_sampler_get_seed(const struct llama_sampler * smpl);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);

/* performance */
struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
void                           llama_perf_context_reset(struct llama_context * ctx);
struct llama_perf_sampler_data llama_perf_sampler(const struct llama_sampler * chain);
void                           llama_perf_sampler_reset(struct llama_sampler * chain);
