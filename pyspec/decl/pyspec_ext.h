/* csrc/pyspec_ext.cpp: C linkage for the staging API of src/llama-ext.h. */

/* libpyspec_ext's one error helper: a check that failed (a negative status, a NULL pointer or
   the sentinel its declaration names) left its message here, per thread (csrc/pyspec_errbuf.h) */
const char *    pyspec_ext_last_error(void);

void            pyspec_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float *         pyspec_get_embeddings_nextn(struct llama_context * ctx);
float *         pyspec_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
void            pyspec_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
float *         pyspec_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
struct llama_context * pyspec_get_ctx_other(struct llama_context * ctx);
const int32_t * pyspec_model_target_layer_ids(const struct llama_model * model);
uint32_t        pyspec_model_target_layer_ids_n(const struct llama_model * model);
/* llama_set_nextn_layer_offset (the NextN head the MTP graph runs); -1: offset outside [0, n_layer_nextn) */
int32_t         pyspec_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);
int32_t         pyspec_model_dflash_selector_top_k(const struct llama_model * model);
/* a DSpark Markov head (markov_w1) was loaded: its graph asserts a positive dflash.block_size */
bool            pyspec_model_has_dspark_head(const struct llama_model * model);
/* llama_model_get_tok_embd (n_embd * n_vocab floats; out NULL: the count); 0 on error, with a message */
uint32_t        pyspec_model_get_tok_embd(const struct llama_model * model, float * out);
/* the most recurrent-state snapshots per sequence (n_rs_seq) the model's graphs hold; UINT32_MAX: no limit */
uint32_t        pyspec_model_max_rs_seq(const struct llama_model * model);

/* batch-invariant mode: ggml-cpu's reference kernels on the context's CPU backends;
   returns how many were switched, *n_other the backends of other kinds */
int32_t pyspec_context_set_cpu_use_ref(struct llama_context * ctx, bool value, int32_t * n_other);

/* lets the OpenMP workers that the calling thread's decodes started go (omp_pause_resource_all);
   1 released, 0 no OpenMP in this build, -1 refused (inside a parallel region) */
int32_t pyspec_cpu_release_workers(void);

/* whether llama.cpp turned the fused gated-delta-net op off at creation because a device that
   holds a recurrent layer does not run it (the op then goes to another device) */
bool pyspec_context_gdn_split(const struct llama_context * ctx);

/* the longest piece (llama_token_to_piece, no special tokens, no lstrip) of any token */
int32_t pyspec_vocab_max_piece(const struct llama_vocab * vocab);
/* common_sampler::set_logits' fill of {id, logit, 0} for a full logits row */
void pyspec_fill_candidates(llama_token_data * dst, const float * logits, int32_t n_vocab);
/* common_sampler::set_logits' and common_sampler_sample's reads of one output row */
typedef struct pyspec_sampler_row_data {
    float *       probs;      /* backend-sampled probabilities, or NULL */
    float *       logits;     /* backend-sampled logits, or NULL */
    llama_token * candidates; /* their token ids */
    int32_t       n;          /* how many (probs, else logits) */
    float *       row;        /* the row's logits when neither was sampled (NULL: no such row) */
    llama_token   token;      /* the backend-sampled token, or LLAMA_TOKEN_NULL */
} pyspec_sampler_row_data;
void pyspec_sampler_row(struct llama_context * ctx, int32_t idx, pyspec_sampler_row_data * out);
/* the token top-k 1 keeps from a row of n logits (the first of the highest); -1 for a NaN or n < 1 */
llama_token pyspec_top1(const float * row, int32_t n);
/* common_sampler_sample for the chain [top-k 1, dist]: synchronize, then the row's top-1 token with
   cur_p (its data = buf) and dist's RNG as that chain leaves them and the time added to *t_us (if
   not NULL); -1: run the full path */
llama_token pyspec_sampler_top1(struct llama_context * ctx, int32_t idx, int32_t n_vocab,
                                llama_token_data_array * cur_p, llama_token_data * buf,
                                struct llama_sampler * dist, int64_t * t_us);
/* the k highest of a row of n logits, highest first, where std::partial_sort's order is certain
   (distinct, above all others; no NaN): true and buf[0, k) = {id, logit, 0}; else false */
#define PYSPEC_TOPK_MAX 32
bool pyspec_topk(const float * row, int32_t n, int32_t k, llama_token_data * buf);
/* set_logits + the top-k sampler of a chain [top-k k, dist] for a row of plain logits: cur_p = the
   k highest, sorted, in buf; false, cur_p untouched, where pyspec_topk is or the full path must run */
bool pyspec_sampler_topk(struct llama_context * ctx, int32_t idx, int32_t n_vocab, int32_t k,
                         llama_token_data_array * cur_p, llama_token_data * buf);

/* csrc/pyspec_batch.cpp: a batch's checks before llama_decode and its output rows, in one pass */
typedef struct pyspec_batch_info {
    int32_t n_outputs;
    int32_t max_n_seq_id;
    int32_t bad_token;
    int32_t has_bad_token;
    int32_t bad_value;
} pyspec_batch_info;
enum pyspec_batch_status { PYSPEC_BATCH_OK = 0, PYSPEC_BATCH_E_N_SEQ = 1, PYSPEC_BATCH_E_SEQ_ID = 2 };
int32_t pyspec_batch_scan(const struct llama_batch * batch, int32_t n_seq_id_max, int32_t n_seq_max, int32_t n_vocab,
                          bool all_outputs, int32_t * rows, pyspec_batch_info * info);

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

/* csrc/pyspec_grammar.cpp: bounds on GBNF grammars before llama.cpp builds a grammar
   sampler, and a checked accept (see the comment at the top of that file) */
enum pyspec_grammar_limit {
    PYSPEC_GRAMMAR_MAX_BYTES    = 4194304, /* grammar text */
    PYSPEC_GRAMMAR_MAX_NESTING  = 128,     /* ( ... ) inside ( ... ): the parser recurses per level */
    PYSPEC_GRAMMAR_MAX_ELEMENTS = 2000000, /* rule elements after repetitions are expanded */
    PYSPEC_GRAMMAR_MAX_DEPTH    = 1000,    /* rules chained at the start of a rule: the left-recursion check recurses */
    PYSPEC_GRAMMAR_MAX_STEPS    = 2000000, /* calls of the left-recursion check, which revisits rules */
    PYSPEC_GRAMMAR_MAX_STACKS   = 4096     /* parse stacks one step may create or the grammar may hold */
};
/* the longest token history a sampler may keep: llama.cpp allocates its ring buffers
   (penalties, DRY, common_sampler's prev) at full size up front */
enum pyspec_sampler_limit {
    PYSPEC_MAX_HISTORY = 16777216,
    /* the most candidates before llama.cpp's infill sampler, which compares every pair */
    PYSPEC_INFILL_MAX_CANDIDATES = 1024,
    /* the longest token piece the infill sampler holds: its 512-byte buffers are "grown"
       with resize(negative length), which throws through the C API */
    PYSPEC_INFILL_MAX_PIECE = 512
};

/* 0, or -1 with the message in pyspec_ext_last_error() */
int     pyspec_grammar_check(const struct llama_vocab * vocab, const char * text, size_t len, const char * root);
int     pyspec_grammar_accept_check(struct llama_sampler * smpl, const struct llama_vocab * vocab, llama_token token);
int64_t pyspec_grammar_n_stacks(struct llama_sampler * smpl);

/* csrc/pyspec_gguf.cpp: the tokenizer metadata llama.cpp reads unchecked; 0, or -1 with the
   message in pyspec_ext_last_error() */
int     pyspec_gguf_check(const char * path);
