/* pyspec_ref: C ABI over llama.cpp's common_speculative_* (common/speculative.h)
 * and common_sampler_* (common/sampling.h), the parity reference.
 * Implemented in csrc/pyspec_ref.cpp, pyspec_ref_speculative.cpp and
 * pyspec_ref_sampling.cpp, which include this very file, so the
 * declarations cffi reads and the definitions cannot drift apart.
 * Needs the declarations of decl/llama.h. Plain C: no #include, no #ifdef.
 *
 * Status: functions returning int return PYSPEC_REF_OK (0) or a negative
 * PYSPEC_REF_E_*, those returning a pointer NULL; pyspec_ref_last_error() then
 * holds the message (per thread; csrc/pyspec_errbuf.h), the library's one error helper.
 */

enum pyspec_ref_status {
    PYSPEC_REF_OK          =  0,
    PYSPEC_REF_E_NULL      = -1, /* a required pointer is NULL */
    PYSPEC_REF_E_RANGE     = -2, /* seq_id, index, token or size out of range */
    PYSPEC_REF_E_CAPACITY  = -3, /* an output buffer is too small */
    PYSPEC_REF_E_STATE     = -4, /* not valid now (e.g. accept without a draft) */
    PYSPEC_REF_E_EXCEPTION = -5  /* the C++ code threw */
};

const char * pyspec_ref_last_error(void);

/* the patches compiled into this build of the reference, comma-separated;
 * "" for the no-patch build (upstream's code exactly) */
const char * pyspec_ref_patches(void);

/* the value the compiler gave the enum constant called name (one of those
 * decl/common.h declares); PYSPEC_REF_E_RANGE for another name */
int pyspec_ref_enum_value(const char * name, int32_t * out);

/* ---- common_speculative ------------------------------------------------ */

/* struct common_params_speculative_draft (model-loading fields left out) */
typedef struct pyspec_ref_spec_draft_params {
    int32_t n_max;
    int32_t n_min;
    float   p_split;
    float   p_min;
    bool    backend_sampling;
    struct llama_context * ctx_tgt;
    struct llama_context * ctx_dft;
    int32_t n_gpu_layers;
} pyspec_ref_spec_draft_params;

/* struct common_params_speculative_ngram_mod */
typedef struct pyspec_ref_spec_ngram_mod_params {
    int32_t n_match;
    int32_t n_max;
    int32_t n_min;
} pyspec_ref_spec_ngram_mod_params;

/* struct common_params_speculative_ngram_map */
typedef struct pyspec_ref_spec_ngram_map_params {
    uint16_t size_n;
    uint16_t size_m;
    uint16_t min_hits;
} pyspec_ref_spec_ngram_map_params;

/* struct common_params_speculative */
typedef struct pyspec_ref_spec_params {
    const int32_t * types;   /* enum common_speculative_type values */
    int32_t         n_types;
    pyspec_ref_spec_draft_params     draft;
    pyspec_ref_spec_ngram_mod_params ngram_mod;
    pyspec_ref_spec_ngram_map_params ngram_simple;
    pyspec_ref_spec_ngram_map_params ngram_map_k;
    pyspec_ref_spec_ngram_map_params ngram_map_k4v;
    const char * lookup_cache_static;  /* NULL or "" = none */
    const char * lookup_cache_dynamic; /* NULL or "" = none */
    double          synth_len;         /* synthetic acceptance (benchmarking); -1 = off */
    const double *  synth_rates;
    int32_t         n_synth_rates;
} pyspec_ref_spec_params;

/* counters of struct common_speculative_impl */
typedef struct pyspec_ref_impl_stats {
    int32_t  type;
    uint64_t n_call_begin;
    uint64_t n_call_draft;
    uint64_t n_call_accept;
    uint64_t n_gen_drafts;
    uint64_t n_acc_drafts;
    uint64_t n_gen_tokens;
    uint64_t n_acc_tokens;
    int64_t  t_begin_us;
    int64_t  t_draft_us;
    int64_t  t_accept_us;
} pyspec_ref_impl_stats;

/* one sequence to draft for: fills common_speculative_draft_params, and
 * receives the result (n_out is the full size even when out_cap is smaller) */
typedef struct pyspec_ref_draft_request {
    llama_seq_id        seq_id;
    int32_t             n_max;    /* -1 = no per-call limit */
    llama_pos           pos0;     /* common_speculative_draft_params.pos0 (was n_past) */
    llama_token         id_last;
    const llama_token * prompt;
    int32_t             n_prompt;
    llama_token *       out;
    int32_t             out_cap;
    int32_t             n_out;
} pyspec_ref_draft_request;

typedef struct pyspec_ref_spec pyspec_ref_spec;

/* the defaults of common_params_speculative{} (types points to static storage) */
void pyspec_ref_spec_params_default(pyspec_ref_spec_params * out);

/* common_speculative_type_to_str; "" for an unknown type */
const char * pyspec_ref_spec_type_str(int32_t type);
/* common_speculative_types_from_names: the types written to out (up to out_cap), their
 * number, or a status (an unknown name throws: PYSPEC_REF_E_EXCEPTION with its message) */
int32_t pyspec_ref_spec_types_from_names(const char * const * names, int32_t n_names, int32_t * out, int32_t out_cap);
/* common_speculative_types_from_gguf: the types inferred from a draft GGUF's metadata written to out
 * (up to out_cap), their number (0: unknown or not a GGUF); PYSPEC_REF_E_STATE where upstream asserts */
int32_t pyspec_ref_spec_types_from_gguf(const char * path, int32_t * out, int32_t out_cap);
/* common_speculative_type_from_name: COMMON_SPECULATIVE_TYPE_COUNT for an unknown name */
int32_t pyspec_ref_spec_type_from_name(const char * name);
/* common_speculative_all_types_str */
const char * pyspec_ref_spec_all_types_str(void);
/* common_speculative_type_name_str of types (each in [0, COMMON_SPECULATIVE_TYPE_COUNT]):
 * its length, and as much of it as fits in out (NUL-terminated); or a status */
int32_t pyspec_ref_spec_type_name_str(const int32_t * types, int32_t n_types, char * out, size_t out_cap);

/* common_speculative_init. NULL with the message in pyspec_ref_last_error() on
 * failure; NULL with pyspec_ref_last_error() == "" when no implementation was
 * selected (the C++ returns nullptr). */
pyspec_ref_spec * pyspec_ref_spec_init(const pyspec_ref_spec_params * params, uint32_t n_seq);
void     pyspec_ref_spec_free(pyspec_ref_spec * spec);
uint32_t pyspec_ref_spec_n_seq(const pyspec_ref_spec * spec);
/* common_speculative_n_max of the init params: a result capacity that fits */
int32_t  pyspec_ref_spec_n_max(const pyspec_ref_spec * spec);

int pyspec_ref_spec_begin(pyspec_ref_spec * spec, llama_seq_id seq_id,
                          const llama_token * prompt, int32_t n_prompt);
/* 1 = true, 0 = false, < 0 = status */
/* common_speculative_process of a common_batch rebuilt from batch (its rows, seq_ids,
 * outputs and positions; embedding rows as wide as the target model's input).
 * Upstream's common_speculative_need_embd[_nextn] are gone: the implementations turn on
 * the target's extraction themselves (llama_set_embeddings_layer_inp / _nextn on ctx_tgt). */
int pyspec_ref_spec_process(pyspec_ref_spec * spec, const llama_batch * batch);
/* common_speculative_n_max(spec): the max draft length of the initialized implementations */
int32_t pyspec_ref_spec_n_max_effective(const pyspec_ref_spec * spec);
/* common_speculative_get_synth_probs: their number, min(n, out_cap) copied to out; or a status */
int32_t pyspec_ref_spec_get_synth_probs(const pyspec_ref_spec * spec, double * out, int32_t out_cap);
/* common_speculative_get_state: the state's size (copies min(size, out_cap) bytes),
 * 0 when no implementation has a state for seq_id (upstream returns false); or a status */
int64_t pyspec_ref_spec_get_state(pyspec_ref_spec * spec, llama_seq_id seq_id, uint8_t * out, size_t out_cap);
/* common_speculative_set_state with n bytes of data */
int pyspec_ref_spec_set_state(pyspec_ref_spec * spec, llama_seq_id seq_id, const uint8_t * data, size_t n);
/* common_speculative_draft for the sequences in reqs (distinct seq_ids);
 * PYSPEC_REF_E_CAPACITY after the draft when a result did not fit (the
 * whole result stays readable through pyspec_ref_spec_get_result) */
int pyspec_ref_spec_draft(pyspec_ref_spec * spec, pyspec_ref_draft_request * reqs, int32_t n_reqs);
/* the last result of seq_id: returns its size, copies min(size, out_cap) */
int32_t pyspec_ref_spec_get_result(const pyspec_ref_spec * spec, llama_seq_id seq_id,
                                   llama_token * out, int32_t out_cap);
int pyspec_ref_spec_accept(pyspec_ref_spec * spec, llama_seq_id seq_id, int32_t n_accepted);
int pyspec_ref_spec_print_stats(const pyspec_ref_spec * spec);

int32_t pyspec_ref_spec_n_impls(const pyspec_ref_spec * spec);
int     pyspec_ref_spec_get_impl(const pyspec_ref_spec * spec, int32_t i, pyspec_ref_impl_stats * out);
/* type of the implementation whose draft seq_id last used;
 * COMMON_SPECULATIVE_TYPE_NONE (0) before any; < 0 = status */
int32_t pyspec_ref_spec_last_impl_type(const pyspec_ref_spec * spec, llama_seq_id seq_id);

/* ---- common_sampler ---------------------------------------------------- */

/* struct common_params_sampling: the fields that shape the sampler chain.
 * The grammar is a user GBNF grammar (not lazy, no triggers, no reasoning
 * budget). ignore_eos is carried as is: like common.cpp, the caller adds the
 * EOG biases to logit_bias. */
typedef struct pyspec_ref_sampling_params {
    uint32_t seed;
    int32_t  n_prev;
    int32_t  n_probs;
    int32_t  min_keep;
    int32_t  top_k;
    float    top_p;
    float    min_p;
    float    xtc_probability;
    float    xtc_threshold;
    float    typ_p;
    float    temp;
    float    dynatemp_range;
    float    dynatemp_exponent;
    int32_t  penalty_last_n;
    float    penalty_repeat;
    float    penalty_freq;
    float    penalty_present;
    float    dry_multiplier;
    float    dry_base;
    int32_t  dry_allowed_length;
    int32_t  dry_penalty_last_n;
    float    adaptive_target;
    float    adaptive_decay;
    int32_t  mirostat;
    float    top_n_sigma;
    float    mirostat_tau;
    float    mirostat_eta;
    bool     ignore_eos;
    bool     no_perf;
    bool     timing_per_token;
    const char * const * dry_sequence_breakers;
    int32_t              n_dry_sequence_breakers;
    const int32_t *      samplers;  /* enum common_sampler_type values */
    int32_t              n_samplers;
    const char *         grammar;   /* NULL or "" = none */
    const llama_token *  logit_bias_tokens;
    const float *        logit_bias_values;
    int32_t              n_logit_bias;
    bool                 backend_sampling;
} pyspec_ref_sampling_params;

typedef struct pyspec_ref_sampler pyspec_ref_sampler;

/* the defaults of common_params_sampling{} (arrays point to static storage) */
void pyspec_ref_sampling_params_default(pyspec_ref_sampling_params * out);

/* common_sampler_init; NULL with the message in pyspec_ref_last_error() */
pyspec_ref_sampler * pyspec_ref_sampler_init(const struct llama_model * model,
                                             const pyspec_ref_sampling_params * params);
void pyspec_ref_sampler_free(pyspec_ref_sampler * smpl);

/* common_sampler_get: the sampler chain (owned by the sampler), e.g. for llama_set_sampler. */
struct llama_sampler * pyspec_ref_sampler_get_chain(pyspec_ref_sampler * smpl);

/* common_sampler_clone: an independent copy (chain state, previous tokens). */
pyspec_ref_sampler * pyspec_ref_sampler_clone(const pyspec_ref_sampler * smpl);
/* common_sampler_copy: dst takes src's state; both must come from one pyspec_ref_sampler_init
 * (the sampler or its clones: the structure common_sampler_copy asserts), else PYSPEC_REF_E_STATE */
int pyspec_ref_sampler_copy(const pyspec_ref_sampler * src, pyspec_ref_sampler * dst);
/* backend_sampling after init (common_sampler_init may turn it off) */
bool pyspec_ref_sampler_backend_sampling(const pyspec_ref_sampler * smpl);
int32_t pyspec_ref_sampler_n_vocab(const pyspec_ref_sampler * smpl);
/* PYSPEC_REF_OK when accepting token into the grammar would succeed, else PYSPEC_REF_E_NULL,
 * PYSPEC_REF_E_RANGE or (the grammar refuses it) PYSPEC_REF_E_EXCEPTION */
int pyspec_ref_sampler_accept_check(pyspec_ref_sampler * smpl, llama_token token);

int pyspec_ref_sampler_sample(pyspec_ref_sampler * smpl, struct llama_context * ctx, int32_t idx,
                              bool grammar_first, llama_token * out);
/* idxs NULL = the overload without idxs ([0, 1, ..., n_draft]); otherwise
 * n_draft + 1 entries. Returns the number of tokens written (>= 1) or a status. */
int pyspec_ref_sampler_sample_and_accept_n(pyspec_ref_sampler * smpl, struct llama_context * ctx,
                                           const int32_t * idxs, const llama_token * draft, int32_t n_draft,
                                           bool grammar_first, llama_token * out, int32_t out_cap);
int pyspec_ref_sampler_accept(pyspec_ref_sampler * smpl, llama_token token, bool accept_grammar);
int pyspec_ref_sampler_reset(pyspec_ref_sampler * smpl);
int pyspec_ref_sampler_last(const pyspec_ref_sampler * smpl, llama_token * out);
int pyspec_ref_sampler_get_seed(const pyspec_ref_sampler * smpl, uint32_t * out);
/* common_sampler_get_candidates: a view into the sampler, valid until its
 * next sample/reset/free; NULL (and last_error) when there is none yet */
llama_token_data_array * pyspec_ref_sampler_get_candidates(pyspec_ref_sampler * smpl, bool do_sort);

/* verbosity threshold of llama.cpp's common log (-1: silent, 0: info/warnings/errors, 1+: debug) */
void pyspec_ref_log_set_verbosity(int verbosity);
int  pyspec_ref_log_get_verbosity(void);
