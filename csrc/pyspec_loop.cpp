// The generation loop of pyspec/generation/engine.py (the Engine that
// SpeculativeGenerator steps), in C++, for a fixed set of prompts: a declared
// mirror of the engine, tracked in the drift record (UPSTREAM, tests/test_upstream_drift.py)
// and tested equal to it token for token (tests/test_cpp_loop.py).
//
// What it mirrors: Engine._step / _update / _verify / _emit's budget side with
// FIXED draft lengths (Engine(adaptive_draft=False)): Engine.n_draft_max's room
// (_n_draft_room: context, remaining budget, the per-request cap
// Request.n_draft_max as pyspec_loop_params.n_draft_max, a share of the batch).
// What it does not: the cost-aware draft-length controller
// (pyspec/generation/draft_length.py) is Python-only by design, and
// pyspec.generation.cpp_loop.cpp_generate refuses adaptive_draft=True; nor does
// it do text, stop strings, logprobs, n_draft_min, prefix reuse or slot files
// (requests that come and go).
//
// Same decisions as the Python engine, step by step (which in turn mirrors
// what tools/server/server-context.cpp's update_slots does around
// common_speculative): per step, the generating sequences draft, make
// checkpoints where the memory cannot drop the rejected part and add
// [sampled, draft...] to the target batch; the sequences still reading their
// prompt fill the rest of the batch (n_batch) with prompt tokens (continuous
// batching); one target decode, the process hook, then per sequence: a prompt
// that ended begins speculation and samples its first token, a sequence
// without a draft samples, one with a draft verifies it (sample_and_accept_n),
// restores its checkpoint on a partial acceptance the memory cannot express,
// accepts and removes the rest with seq_rm. As the server at 0c1e57098: synthetic
// acceptance (server_sample_and_accept_synth) where the params ask for it, a replay
// after a checkpoint restore counts the target's own last token as no accepted
// draft token, and the sampler is restored with common_sampler_copy.
//
// The batch stays a llama_batch decoded with llama_decode where the server now
// renders a common_batch and calls llama_process(DECODE): llama_decode converts
// the same rows (llama_batch_compat) and decodes them the same way; the Python
// engine decodes a core Batch (a llama_batch) and libpyspec_ref's process call
// takes one (it builds the common_batch, as the python backend does).
//
// The speculative and sampler calls go through libpyspec_ref's C API (this
// file is part of that library), i.e. the very code that engine="cpp" of the
// Python engine runs, with the same precondition checks: whatever the C++
// reference would GGML_ASSERT on is refused with a status instead. The memory
// helpers (common_context_can_seq_rm, common_prompt_checkpoint) are the ones
// of libllama-common; the two that abort on failure (common_context_seq_rm,
// common_prompt_checkpoint::load_*) are replaced by checked twins.

#include "common.h"
#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
#include "../pyspec/decl/pyspec_ref.h"
#include "../pyspec/decl/pyspec_loop.h"
}
#include "pyspec_errbuf.h"  // the message of a failure: libpyspec_ref's last error

namespace {

// a failure with its PYSPEC_REF_E_* status, thrown inside the loop and turned
// into the return value at the API boundary
struct loop_error : std::runtime_error {
    int status;
    loop_error(int status, const std::string & msg) : std::runtime_error(msg), status(status) {}
};

[[noreturn]] void fail(int status, const char * fmt, ...) {
    char buf[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    throw loop_error(status, buf);
}

// a negative status of libpyspec_ref becomes a loop_error with its message
int check_ref(int rc, const char * what) {
    if (rc < 0) {
        fail(rc, "%s: %s", what, pyspec_ref_last_error());
    }
    return rc;
}

struct spec_deleter    { void operator()(pyspec_ref_spec * p)    const { pyspec_ref_spec_free(p); } };
struct sampler_deleter { void operator()(pyspec_ref_sampler * p) const { pyspec_ref_sampler_free(p); } };
using spec_ptr    = std::unique_ptr<pyspec_ref_spec, spec_deleter>;
using sampler_ptr = std::unique_ptr<pyspec_ref_sampler, sampler_deleter>;

// common_context_seq_rm without the abort
void context_seq_rm(llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (!llama_memory_seq_rm(llama_get_memory(ctx), seq_id, p0, p1)) {
        fail(PYSPEC_REF_E_STATE, "failed to remove sequence %d with p0=%d, p1=%d", (int) seq_id, (int) p0, (int) p1);
    }
}

// common_prompt_checkpoint::load_tgt / load_dft without the abort
void ckpt_load(llama_context * ctx, const std::vector<uint8_t> & data, llama_seq_id seq_id) {
    if (ctx == nullptr || data.empty()) {
        return;
    }
    const size_t n = llama_state_seq_set_data_ext(ctx, data.data(), data.size(), seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    if (n != data.size()) {
        fail(PYSPEC_REF_E_STATE, "checkpoint size mismatch: expected %zu, got %zu", data.size(), n);
    }
}

// one sequence's generation state (generation/slots.py's Slot)
struct slot {
    llama_seq_id id = 0;
    std::vector<llama_token> prompt;
    std::vector<llama_token> tokens;  // tokens in the target's memory
    int32_t n_prompt = 0;
    bool reading = true;  // still adding prompt tokens
    std::vector<llama_token> generated;
    int32_t stop_reason = PYSPEC_LOOP_STOP_NONE;
    int32_t n_drafted  = 0;
    int32_t n_accepted = 0;
    int32_t n_remaining = 0;
    llama_token sampled = -1;
    bool active = true;
    std::vector<llama_token> spec_draft;
    std::vector<int32_t> spec_i_batch;
    common_prompt_checkpoint spec_ckpt;
    int32_t spec_n_drafted = 0;   // the size of the draft as made (a replay is shorter)
    bool spec_is_replay = false;  // the draft is the accepted part of one, re-verified after a checkpoint restore
    std::mt19937 spec_synth_rng;  // synthetic acceptance's draws (the server's spec_synth_rng)
    int32_t i_batch = -1;

    slot() { spec_ckpt.clear(); }
};

struct loop {
    llama_context * ctx_tgt = nullptr;
    llama_context * ctx_dft = nullptr;
    const llama_vocab * vocab = nullptr;

    common_context_seq_rm_type tgt_seq_rm_type = COMMON_CONTEXT_SEQ_RM_TYPE_NO;
    common_context_seq_rm_type dft_seq_rm_type = COMMON_CONTEXT_SEQ_RM_TYPE_NO;

    spec_ptr spec;  // null: no speculation
    std::vector<sampler_ptr> smpls;
    int32_t spec_n_max = 0;
    int32_t n_draft_cap = -1;  // pyspec_loop_params.n_draft_max (< 0: no cap)
    std::vector<double> synth_probs;  // common_speculative_get_synth_probs (empty: verify by match)

    llama_batch batch = {};
    int32_t n_batch   = 0;
    int32_t n_ctx_seq = 0;

    std::vector<slot> slots;
    std::vector<llama_token> draft_buf;
    std::vector<llama_token> accept_buf;

    int64_t t_decode_us = 0;

    ~loop() {
        if (batch.token != nullptr) {
            llama_batch_free(batch);
        }
    }

    // common_batch_add with a capacity check instead of the assert
    void batch_add(llama_token id, llama_pos pos, llama_seq_id seq_id, bool logits) {
        if (batch.n_tokens >= n_batch) {
            fail(PYSPEC_REF_E_CAPACITY, "batch of %d tokens is full", (int) n_batch);
        }
        // a draft from an n-gram cache file may name any token; Context._check_batch says the same
        if (id < 0 || id >= llama_vocab_n_tokens(vocab)) {
            fail(PYSPEC_REF_E_RANGE, "token %d is outside the vocabulary (0..%d)", (int) id, llama_vocab_n_tokens(vocab) - 1);
        }
        // the previous pin's common_batch_add (common.cpp now has common_batch over
        // llama_batch_ext): this loop keeps a llama_batch and llama_decode, as before the bump
        batch.token   [batch.n_tokens]    = id;
        batch.pos     [batch.n_tokens]    = pos;
        batch.n_seq_id[batch.n_tokens]    = 1;
        batch.seq_id  [batch.n_tokens][0] = seq_id;
        batch.logits  [batch.n_tokens]    = logits;
        batch.n_tokens++;
    }

    void decode_tgt() {
        const int64_t t0 = ggml_time_us();
        const int rc = llama_decode(ctx_tgt, batch);
        t_decode_us += ggml_time_us() - t0;
        if (rc != 0) {
            fail(PYSPEC_REF_E_STATE, "llama_decode failed: %d", rc);
        }
    }

    void process() {
        if (spec && check_ref(pyspec_ref_spec_process(spec.get(), &batch), "process") == 0) {
            fail(PYSPEC_REF_E_STATE, "failed to process speculative batch");
        }
    }

    llama_token sample(const slot & s, int32_t idx) {
        llama_token tok = 0;
        check_ref(pyspec_ref_sampler_sample(smpls[s.id].get(), ctx_tgt, idx, false, &tok), "sample");
        return tok;
    }

    void accept_token(const slot & s, llama_token tok, bool is_generated) {
        check_ref(pyspec_ref_sampler_accept(smpls[s.id].get(), tok, is_generated), "accept_token");
    }

    void finish(slot & s, int32_t reason) {
        s.active = false;
        s.stop_reason = reason;
        s.spec_draft.clear();
    }

    // engine.py's Engine._emit without text and stop strings: end of generation, budget, context
    void emit(slot & s, const llama_token * toks, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            const llama_token tok = toks[i];
            s.sampled = tok;
            s.generated.push_back(tok);
            s.n_remaining -= 1;
            if (llama_vocab_is_eog(vocab, tok)) {
                finish(s, PYSPEC_LOOP_STOP_EOG);
                return;
            }
            if (s.n_remaining <= 0) {
                finish(s, PYSPEC_LOOP_STOP_N_PREDICT);
                return;
            }
        }
        if ((int64_t) s.tokens.size() + 1 >= n_ctx_seq) {
            finish(s, PYSPEC_LOOP_STOP_CONTEXT);
        }
    }

    // server_sample_and_accept_synth (server-context.cpp; engine.py's Engine._accept_synth): the draft
    // accepted at random with the synthetic probabilities; on replay every token again, the last (the
    // target's) as generated. Returns the number of tokens written to out
    int sample_and_accept_synth(slot & s, std::vector<llama_token> & out) {
        const auto & draft = s.spec_draft;
        const auto & idxs  = s.spec_i_batch;
        if (idxs.size() != draft.size() + 1 || synth_probs.size() < draft.size()) {
            fail(PYSPEC_REF_E_RANGE, "synthetic acceptance: %zu indices and %zu probabilities for a draft of %zu tokens",
                 idxs.size(), synth_probs.size(), draft.size());
        }
        pyspec_ref_sampler * smpl = smpls[s.id].get();
        std::uniform_real_distribution<double> dist(0.0, 1.0);
        int n = 0;
        for (size_t i = 0; i < draft.size(); ++i) {
            const llama_token id = sample(s, idxs[i]);
            const bool accept = s.spec_is_replay || dist(s.spec_synth_rng) < synth_probs[i];
            // a drafted end of generation is not accepted; on replay the last token is the target's
            if (accept && (s.spec_is_replay || !llama_vocab_is_eog(vocab, draft[i]))) {
                // synthetic tokens do not advance the grammar; the replay's last token does
                const bool is_replay_target = s.spec_is_replay && i + 1 == draft.size();
                check_ref(pyspec_ref_sampler_accept(smpl, draft[i], is_replay_target), "accept_token");
                out[n++] = draft[i];
                continue;
            }
            check_ref(pyspec_ref_sampler_accept(smpl, id, true), "accept_token");
            out[n++] = id;
            return n;
        }
        const llama_token id = sample(s, idxs[draft.size()]);
        check_ref(pyspec_ref_sampler_accept(smpl, id, true), "accept_token");
        out[n++] = id;
        return n;
    }

    // Engine.n_draft_max with a fixed controller, i.e. Engine._n_draft_room
    int32_t n_draft_max(const slot & s, int32_t n_active) const {
        // what fits the context (one token kept spare for shifts), the remaining budget and the
        // request's own cap, and a share of the batch so all sequences fit one target decode
        int32_t n = n_ctx_seq - (int32_t) s.tokens.size() - 2;
        if (s.n_remaining > 0) {
            n = std::min(n, s.n_remaining - 1);
        }
        if (n_draft_cap >= 0) {
            n = std::min(n, n_draft_cap);
        }
        return std::min(n, n_batch / n_active - 1);
    }

    void step() {
        std::vector<slot *> active;  // the generating sequences (engine.py's `generating`)
        for (auto & s : slots) {
            if (s.active && !s.reading) {
                active.push_back(&s);
            }
        }
        const int32_t n_active = (int32_t) active.size();
        const bool use_ckpt_tgt_full = tgt_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_FULL;
        const bool use_ckpt_dft_full = dft_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_FULL;
        llama_memory_t mem_tgt = llama_get_memory(ctx_tgt);

        // draft for the sequences that have room for one
        std::vector<slot *> drafting;
        if (spec) {
            std::vector<pyspec_ref_draft_request> reqs;
            for (slot * s : active) {
                const int32_t n_max = n_draft_max(*s, n_active);
                if (!s->spec_draft.empty()) {
                    // a previous (partial) draft is reused after a checkpoint restore; more sequences
                    // may generate now than when it was made, so it keeps only its share of the batch
                    const size_t n_keep = (size_t) std::max(0, n_max);
                    if (n_keep < s->spec_draft.size()) {  // the target's own last token is cut: a plain draft now
                        s->spec_draft.resize(n_keep);
                        s->spec_is_replay = false;
                    }
                    continue;
                }
                if (n_max <= 0) {
                    continue;  // no room
                }
                s->spec_ckpt.update_pos((int64_t) s->tokens.size(), llama_memory_seq_pos_min(mem_tgt, s->id),
                                        llama_memory_seq_pos_max(mem_tgt, s->id));
                if (use_ckpt_dft_full) {
                    s->spec_ckpt.update_dft(ctx_dft, s->id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
                }
                pyspec_ref_draft_request r = {};
                r.seq_id   = s->id;
                r.n_max    = n_max;
                r.pos0     = (llama_pos) s->tokens.size();
                r.id_last  = s->sampled;
                r.prompt   = s->tokens.data();
                r.n_prompt = (int32_t) s->tokens.size();
                reqs.push_back(r);
                drafting.push_back(s);
            }
            if (!reqs.empty()) {
                const size_t cap = (size_t) std::max(spec_n_max, n_batch);
                draft_buf.resize(cap * reqs.size());
                for (size_t k = 0; k < reqs.size(); ++k) {
                    reqs[k].out     = draft_buf.data() + k * cap;
                    reqs[k].out_cap = (int32_t) cap;
                }
                const int rc = pyspec_ref_spec_draft(spec.get(), reqs.data(), (int32_t) reqs.size());
                if (rc != PYSPEC_REF_E_CAPACITY) {
                    check_ref(rc, "draft");
                }
                for (size_t k = 0; k < reqs.size(); ++k) {
                    auto & d = drafting[k]->spec_draft;
                    if (reqs[k].n_out <= reqs[k].out_cap) {
                        d.assign(reqs[k].out, reqs[k].out + reqs[k].n_out);
                    } else {  // a draft beyond the buffer: read it whole
                        d.resize(reqs[k].n_out);
                        check_ref(pyspec_ref_spec_get_result(spec.get(), reqs[k].seq_id, d.data(), (int32_t) d.size()), "draft");
                    }
                }
            }
        }

        // checkpoints where the memory cannot drop the rejected part
        for (slot * s : drafting) {
            const auto & draft = s->spec_draft;
            auto & ckpt = s->spec_ckpt;
            s->n_drafted += (int32_t) draft.size();
            s->spec_n_drafted = (int32_t) draft.size();
            if (ctx_dft != nullptr) {
                if (use_ckpt_dft_full) {
                    ckpt_load(ctx_dft, ckpt.data_dft, s->id);
                }
                context_seq_rm(ctx_dft, s->id, ckpt.pos_max + 1, -1);
            }
            if (!draft.empty()) {
                const bool use_ckpt_tgt = use_ckpt_tgt_full ||
                    (tgt_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_RS && draft.size() > llama_n_rs_seq(ctx_tgt));
                const bool use_ckpt_dft =
                    dft_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_RS && draft.size() > llama_n_rs_seq(ctx_dft);
                if (use_ckpt_tgt) {
                    ckpt.update_tgt(ctx_tgt, s->id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
                }
                if (use_ckpt_dft) {
                    ckpt.update_dft(ctx_dft, s->id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
                }
            }
        }

        // one batch for all sequences: [sampled, draft...] each (the server's update_batch)
        batch.n_tokens = 0; // the previous pin's common_batch_clear
        for (slot * s : active) {
            const llama_pos pos0 = (llama_pos) s->tokens.size();
            if (s->spec_draft.empty()) {
                s->i_batch = batch.n_tokens;
                batch_add(s->sampled, pos0, s->id, true);
            } else {
                s->spec_i_batch.clear();
                for (size_t k = 0; k <= s->spec_draft.size(); ++k) {
                    s->spec_i_batch.push_back(batch.n_tokens + (int32_t) k);
                }
                batch_add(s->sampled, pos0, s->id, true);
                for (size_t k = 0; k < s->spec_draft.size(); ++k) {
                    batch_add(s->spec_draft[k], pos0 + 1 + (llama_pos) k, s->id, true);
                }
            }
            s->tokens.push_back(s->sampled);
            s->tokens.insert(s->tokens.end(), s->spec_draft.begin(), s->spec_draft.end());
        }

        // then prompt tokens of the sequences still reading theirs, up to n_batch (continuous batching)
        for (auto & s : slots) {
            if (batch.n_tokens >= n_batch) {
                break;
            }
            if (!s.active || !s.reading) {
                continue;
            }
            while ((int32_t) s.tokens.size() < s.n_prompt && batch.n_tokens < n_batch) {
                const int32_t p = (int32_t) s.tokens.size();
                const bool last = p == s.n_prompt - 1;
                batch_add(s.prompt[p], p, s.id, last);
                s.tokens.push_back(s.prompt[p]);
                if (last) {
                    s.i_batch = batch.n_tokens - 1;
                }
            }
        }

        decode_tgt();
        process();

        // prompts that ended begin speculation; sequences without a draft sample
        for (auto & s : slots) {
            if (!s.active || s.i_batch < 0) {
                continue;
            }
            if (s.reading) {
                s.reading = false;
                if (spec) {
                    check_ref(pyspec_ref_spec_begin(spec.get(), s.id, s.tokens.data(), (int32_t) s.tokens.size()), "begin");
                }
            }
            if (!s.spec_draft.empty()) {
                continue;
            }
            const llama_token tok = sample(s, s.i_batch);
            s.i_batch = -1;
            accept_token(s, tok, true);
            emit(s, &tok, 1);
        }

        // sequences with a draft: verify, accept, clean up the memory
        for (slot * s : active) {
            if (!s->active || s->spec_draft.empty()) {
                continue;
            }
            const int32_t n_draft = (int32_t) s->spec_draft.size();
            // the server clones the sampler before every verification; only a checkpoint restore
            // uses the copy, which a target that can drop part of a sequence never needs
            const bool may_restore = use_ckpt_tgt_full ||
                (tgt_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_RS && (uint32_t) n_draft > llama_n_rs_seq(ctx_tgt));
            sampler_ptr saved(may_restore ? pyspec_ref_sampler_clone(smpls[s->id].get()) : nullptr);
            if (may_restore && !saved) {
                fail(PYSPEC_REF_E_EXCEPTION, "common_sampler_clone failed");
            }
            accept_buf.resize((size_t) n_draft + 1);
            const int n_acc = synth_probs.empty()
                ? check_ref(pyspec_ref_sampler_sample_and_accept_n(
                      smpls[s->id].get(), ctx_tgt, s->spec_i_batch.data(), s->spec_draft.data(), n_draft, false,
                      accept_buf.data(), (int32_t) accept_buf.size()), "sample_and_accept_n")
                : sample_and_accept_synth(*s, accept_buf);
            const std::vector<llama_token> accepted(accept_buf.begin(), accept_buf.begin() + n_acc);
            s->spec_i_batch.clear();
            const int32_t n_rollback = n_draft + 1 - n_acc;
            const bool use_ckpt_tgt = use_ckpt_tgt_full ||
                (tgt_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_RS && (uint32_t) n_rollback > llama_n_rs_seq(ctx_tgt));

            if (n_rollback > 0 && use_ckpt_tgt) {
                // partial acceptance the memory cannot express: restore the checkpoint and
                // re-verify the accepted tokens as the next step's draft
                s->spec_is_replay = true;
                s->spec_draft = accepted;
                const auto & ckpt = s->spec_ckpt;
                ckpt_load(ctx_tgt, ckpt.data_tgt, s->id);
                context_seq_rm(ctx_tgt, s->id, ckpt.pos_max + 1, -1);
                if (ctx_dft != nullptr) {
                    ckpt_load(ctx_dft, ckpt.data_dft, s->id);
                    context_seq_rm(ctx_dft, s->id, ckpt.pos_max + 1, -1);
                }
                s->tokens.resize((size_t) ckpt.n_tokens);
                // the server's common_sampler_copy(smpl_save, slot.smpl)
                check_ref(pyspec_ref_sampler_copy(saved.get(), smpls[s->id].get()), "sampler copy");
                continue;
            }
            saved.reset();

            check_ref(pyspec_ref_spec_accept(spec.get(), s->id, n_acc - 1), "accept");
            // a replay's last draft token was the target's own: not an accepted draft token (the server's count)
            int32_t n_accepted = n_acc - 1;
            if (s->spec_is_replay && n_accepted > 0) {
                n_accepted--;
            }
            s->spec_is_replay = false;
            s->n_accepted += n_accepted;

            // the memory keeps the prompt, the sampled token and the accepted draft tokens
            s->tokens.resize(s->tokens.size() - (size_t) n_draft);
            s->tokens.insert(s->tokens.end(), accepted.begin(), accepted.end() - 1);
            s->spec_draft.clear();
            context_seq_rm(ctx_tgt, s->id, (llama_pos) s->tokens.size(), -1);
            if (ctx_dft != nullptr) {
                context_seq_rm(ctx_dft, s->id, (llama_pos) s->tokens.size(), -1);
            }
            emit(*s, accepted.data(), accepted.size());
        }
    }
};

bool has_speculation(const pyspec_ref_spec_params * sp) {
    if (sp == nullptr || sp->types == nullptr) {
        return false;
    }
    for (int32_t i = 0; i < sp->n_types; ++i) {
        if (sp->types[i] != COMMON_SPECULATIVE_TYPE_NONE) {
            return true;
        }
    }
    return false;
}

int generate(const pyspec_loop_params & p, pyspec_loop_result & out) {
    // --- the inputs, checked before anything is touched
    if (p.ctx_tgt == nullptr) {
        fail(PYSPEC_REF_E_NULL, "ctx_tgt is NULL");
    }
    const int32_t n_seq_max = (int32_t) llama_n_seq_max(p.ctx_tgt);
    if (p.n_seq < 1 || p.n_seq > n_seq_max) {
        fail(PYSPEC_REF_E_RANGE, "n_seq must be 1..%d (the target's n_seq_max), got %d", (int) n_seq_max, (int) p.n_seq);
    }
    if (p.n_predict <= 0) {
        fail(PYSPEC_REF_E_RANGE, "n_predict must be positive, got %d", (int) p.n_predict);
    }
    if (p.prompt_tokens == nullptr || p.prompt_lens == nullptr) {
        fail(PYSPEC_REF_E_NULL, "prompt_tokens / prompt_lens is NULL");
    }
    if (out.tokens == nullptr || out.n_tokens == nullptr || out.n_drafted == nullptr || out.n_accepted == nullptr ||
        out.stop_reason == nullptr) {
        fail(PYSPEC_REF_E_NULL, "an output buffer is NULL");
    }
    if (out.tokens_cap < std::min(p.n_predict, (int32_t) llama_n_ctx_seq(p.ctx_tgt))) {
        fail(PYSPEC_REF_E_CAPACITY, "tokens_cap %d < min(n_predict, n_ctx_seq) = %d", (int) out.tokens_cap,
             (int) std::min(p.n_predict, (int32_t) llama_n_ctx_seq(p.ctx_tgt)));
    }
    if (p.spec != nullptr && (p.spec->n_types < 0 || (p.spec->n_types > 0 && p.spec->types == nullptr))) {
        fail(PYSPEC_REF_E_NULL, "invalid types array in spec params");
    }
    if (p.ctx_dft == p.ctx_tgt) {
        fail(PYSPEC_REF_E_RANGE, "ctx_dft must differ from ctx_tgt");
    }
    if (p.ctx_dft != nullptr && p.n_seq > (int32_t) llama_n_seq_max(p.ctx_dft)) {
        // its memory asserts on a sequence id it does not have
        fail(PYSPEC_REF_E_RANGE, "n_seq %d exceeds the draft context's n_seq_max %d", (int) p.n_seq,
             (int) llama_n_seq_max(p.ctx_dft));
    }

    loop L;
    L.ctx_tgt   = p.ctx_tgt;
    L.ctx_dft   = p.ctx_dft;
    L.vocab     = llama_model_get_vocab(llama_get_model(p.ctx_tgt));
    L.n_batch   = (int32_t) llama_n_batch(p.ctx_tgt);
    L.n_ctx_seq = (int32_t) llama_n_ctx_seq(p.ctx_tgt);
    // Engine.n_ctx_seq: at most the model's training context (the server's n_ctx_slot)
    const int32_t n_ctx_train = llama_model_n_ctx_train(llama_get_model(p.ctx_tgt));
    if (n_ctx_train > 0) {
        L.n_ctx_seq = std::min(L.n_ctx_seq, n_ctx_train);
    }
    L.n_draft_cap = p.n_draft_max;
    const int32_t n_vocab = llama_vocab_n_tokens(L.vocab);

    size_t off = 0;
    for (int32_t i = 0; i < p.n_seq; ++i) {
        const int32_t n = p.prompt_lens[i];
        if (n <= 0) {
            fail(PYSPEC_REF_E_RANGE, "prompt %d is empty", (int) i);
        }
        if (n + 1 > L.n_ctx_seq) {
            fail(PYSPEC_REF_E_RANGE, "prompt of %d tokens does not fit the context (%d per sequence)", (int) n,
                 (int) L.n_ctx_seq);
        }
        for (int32_t k = 0; k < n; ++k) {
            const llama_token t = p.prompt_tokens[off + k];
            if (t < 0 || t >= n_vocab) {
                // Context._check_batch's words: the Python engine refuses the same prompt with them
                fail(PYSPEC_REF_E_RANGE, "token %d is outside the vocabulary (0..%d)", (int) t, (int) n_vocab - 1);
            }
        }
        off += (size_t) n;
    }

    // --- SpeculativeGenerator.__init__: how each context can roll back (clears their memory)
    L.tgt_seq_rm_type = common_context_can_seq_rm(L.ctx_tgt);
    if (L.tgt_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_NO) {
        fail(PYSPEC_REF_E_STATE, "speculative decoding is not supported by this target context");
    }
    if (L.ctx_dft != nullptr) {
        L.dft_seq_rm_type = common_context_can_seq_rm(L.ctx_dft);
    }

    if (has_speculation(p.spec)) {
        pyspec_ref_spec_params sp = *p.spec;
        sp.draft.ctx_tgt = L.ctx_tgt;
        sp.draft.ctx_dft = L.ctx_dft;
        L.spec.reset(pyspec_ref_spec_init(&sp, (uint32_t) p.n_seq));
        if (!L.spec && !pyspec::last_error().empty()) {
            fail(PYSPEC_REF_E_EXCEPTION, "%s", pyspec_ref_last_error());
        }
        // no implementation selected (no message): no speculation, as RefSpeculative.init
        if (L.spec) {
            L.spec_n_max = std::max(1, pyspec_ref_spec_n_max(L.spec.get()));
            const int32_t n_synth = check_ref(pyspec_ref_spec_get_synth_probs(L.spec.get(), nullptr, 0), "synth_probs");
            L.synth_probs.resize((size_t) n_synth);
            check_ref(pyspec_ref_spec_get_synth_probs(L.spec.get(), L.synth_probs.data(), n_synth), "synth_probs");
        }
    }
    if (p.spec != nullptr && (p.spec->synth_len != -1.0 || p.spec->n_synth_rates > 0) && !L.spec) {
        fail(PYSPEC_REF_E_STATE, "synthetic acceptance requires an initialized speculative decoding context");
    }

    pyspec_ref_sampling_params greedy;
    const int32_t greedy_samplers[] = { COMMON_SAMPLER_TYPE_TOP_K };
    const pyspec_ref_sampling_params * sampling = p.sampling;
    if (sampling == nullptr) {  // engine.py's greedy_sampling()
        pyspec_ref_sampling_params_default(&greedy);
        greedy.top_k      = 1;
        greedy.samplers   = greedy_samplers;
        greedy.n_samplers = 1;
        sampling = &greedy;
    }
    for (int32_t i = 0; i < p.n_seq; ++i) {
        sampler_ptr smpl(pyspec_ref_sampler_init(llama_get_model(L.ctx_tgt), sampling));
        if (!smpl) {
            const char * msg = pyspec_ref_last_error();
            fail(PYSPEC_REF_E_EXCEPTION, "%s", msg[0] ? msg : "common_sampler_init failed");
        }
        L.smpls.push_back(std::move(smpl));
    }

    L.batch = llama_batch_init(L.n_batch, 0, 1);

    // --- _run: a fresh start for every sequence (the prompt is accepted, not generated)
    L.slots.resize((size_t) p.n_seq);
    off = 0;
    for (int32_t i = 0; i < p.n_seq; ++i) {
        slot & s = L.slots[i];
        s.id          = i;
        s.n_prompt    = p.prompt_lens[i];
        s.prompt.assign(p.prompt_tokens + off, p.prompt_tokens + off + s.n_prompt);
        s.n_remaining = p.n_predict;
        off += (size_t) s.n_prompt;
    }
    for (auto & s : L.slots) {
        context_seq_rm(L.ctx_tgt, s.id, -1, -1);
        if (L.ctx_dft != nullptr) {
            context_seq_rm(L.ctx_dft, s.id, -1, -1);
        }
        check_ref(pyspec_ref_sampler_reset(L.smpls[s.id].get()), "reset");
        if (!L.synth_probs.empty()) {  // Engine._start: each sequence's own draws, seeded as the server does
            s.spec_synth_rng.seed(sampling->seed == LLAMA_DEFAULT_SEED ? std::random_device{}() : sampling->seed);
        }
        for (const llama_token t : s.prompt) {
            L.accept_token(s, t, false);
        }
    }

    // steps until every sequence has ended; the prompt phase ends with the step in which
    // the last prompt was read (the steps after it are counted, as SpeculativeGenerator does)
    const int64_t t0 = ggml_time_us();
    int64_t t1 = -1;
    int64_t t_dec_prompt = 0;
    int32_t n_steps = 0;
    while (std::any_of(L.slots.begin(), L.slots.end(), [](const slot & s) { return s.active; })) {
        L.step();
        if (t1 >= 0) {
            n_steps++;
        } else if (std::none_of(L.slots.begin(), L.slots.end(), [](const slot & s) { return s.active && s.reading; })) {
            t1 = ggml_time_us();
            t_dec_prompt = L.t_decode_us;
        }
    }
    const int64_t t2 = ggml_time_us();

    for (const auto & s : L.slots) {
        // cannot happen: drafts stay within n_remaining and the context
        if (s.generated.size() > (size_t) out.tokens_cap) {
            fail(PYSPEC_REF_E_CAPACITY, "sequence %d generated %zu tokens > tokens_cap", (int) s.id, s.generated.size());
        }
    }
    for (const auto & s : L.slots) {
        std::copy(s.generated.begin(), s.generated.end(), out.tokens + (size_t) s.id * out.tokens_cap);
        out.n_tokens[s.id]    = (int32_t) s.generated.size();
        out.n_drafted[s.id]   = s.n_drafted;
        out.n_accepted[s.id]  = s.n_accepted;
        out.stop_reason[s.id] = s.stop_reason;
    }
    out.n_steps         = n_steps;
    out.t_prompt_us     = t1 - t0;
    out.t_gen_us        = t2 - t1;
    out.t_decode_us     = L.t_decode_us;
    out.t_decode_gen_us = L.t_decode_us - t_dec_prompt;
    return PYSPEC_REF_OK;
}

} // namespace

extern "C" int pyspec_loop_generate(const pyspec_loop_params * params, pyspec_loop_result * out) {
    pyspec::last_error().clear();
    try {
        if (params == nullptr || out == nullptr) {
            fail(PYSPEC_REF_E_NULL, "params / out is NULL");
        }
        return generate(*params, *out);
    } catch (const loop_error & e) {
        return pyspec::fail(e.status, "%s", e.what());
    } catch (const std::exception & e) {
        return pyspec::fail(PYSPEC_REF_E_EXCEPTION, "%s", e.what());
    } catch (...) {
        return pyspec::fail(PYSPEC_REF_E_EXCEPTION, "unknown C++ exception");
    }
}
