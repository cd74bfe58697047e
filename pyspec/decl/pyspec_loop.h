/* pyspec_loop: the generation loop of pyspec/generation/engine.py (the Engine that
 * SpeculativeGenerator steps) with fixed draft lengths, written in C++ over the same C++ reference calls (libpyspec_ref's
 * common_speculative_* / common_sampler_* wrappers, common_context_can_seq_rm,
 * common_prompt_checkpoint), so that the Python loop's speed can be measured
 * against a loop with no Python in it, token for token. Not mirrored: the
 * cost-aware draft-length controller (Python-only; see csrc/pyspec_loop.cpp).
 * Implemented in csrc/pyspec_loop.cpp (part of libpyspec_ref), which includes
 * this very file. Needs the declarations of decl/llama.h and decl/pyspec_ref.h.
 * Plain C: no #include, no #ifdef.
 */

/* why a sequence stopped (SequenceResult.stop_reason, Completion.stop_reason) */
enum pyspec_loop_stop_reason {
    PYSPEC_LOOP_STOP_NONE      = 0,
    PYSPEC_LOOP_STOP_EOG       = 1, /* "eog" */
    PYSPEC_LOOP_STOP_N_PREDICT = 2, /* "n_predict" */
    PYSPEC_LOOP_STOP_CONTEXT   = 3  /* "context" */
};

typedef struct pyspec_loop_params {
    struct llama_context * ctx_tgt;
    struct llama_context * ctx_dft;               /* NULL = none; overrides spec->draft.ctx_dft */
    const pyspec_ref_spec_params * spec;          /* NULL = no speculation; draft.ctx_tgt is set to ctx_tgt */
    const pyspec_ref_sampling_params * sampling;  /* NULL = greedy (top-k 1) */
    int32_t n_seq;                     /* sequences 0 .. n_seq - 1, one prompt each, <= llama_n_seq_max */
    const llama_token * prompt_tokens; /* the prompts one after the other */
    const int32_t *     prompt_lens;   /* n_seq entries, each > 0 */
    int32_t n_predict;                 /* > 0: tokens to generate per sequence at most */
    int32_t n_draft_max;               /* Request.n_draft_max for every sequence; < 0: no cap
                                        * (0, a zeroed struct's value, turns drafting off) */
} pyspec_loop_params;

typedef struct pyspec_loop_result {
    /* caller buffers: tokens of n_seq * tokens_cap (sequence i at tokens + i * tokens_cap; no sequence
     * generates more than min(n_predict, llama_n_ctx_seq) tokens), the others of n_seq */
    llama_token * tokens;
    int32_t       tokens_cap;
    int32_t *     n_tokens;
    int32_t *     n_drafted;
    int32_t *     n_accepted;
    int32_t *     stop_reason;  /* enum pyspec_loop_stop_reason */
    /* filled by the call */
    int32_t n_steps;            /* target decodes after the prompt */
    int64_t t_prompt_us;        /* prefill: prompt decodes and first tokens */
    int64_t t_gen_us;           /* the steps after the prefill */
    int64_t t_decode_us;        /* inside llama_decode of the target, prefill and steps */
    int64_t t_decode_gen_us;    /* the part of t_decode_us spent in the steps */
} pyspec_loop_result;

/* Runs the loop: clears the memory of both contexts (common_context_can_seq_rm)
 * and of sequences 0 .. n_seq - 1, prefills, generates until every sequence
 * stopped. Returns PYSPEC_REF_OK or a negative PYSPEC_REF_E_*, with the
 * message in pyspec_ref_last_error(). */
int pyspec_loop_generate(const pyspec_loop_params * params, pyspec_loop_result * out);
