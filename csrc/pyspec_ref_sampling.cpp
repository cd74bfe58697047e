// C ABI over llama.cpp's common_sampler_* (common/sampling.h): the sampler half of
// libpyspec_ref (see pyspec_ref.cpp for the wrapper's rules).

#include "common.h"
#include "llama.h"
#include "sampling.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pyspec_ref_internal.h"

// ---- common_sampler ---------------------------------------------------------

struct pyspec_ref_sampler {
    common_sampler * smpl = nullptr;
    const llama_model * model = nullptr;
    int32_t n_vocab = 0;
    bool backend_sampling = false;
    // a grammar accept that threw inside common_sampler_* left the grammar without parse
    // stacks, and its next use would GGML_ASSERT: the sampler refuses further calls
    bool broken = false;
    // samplers made by one pyspec_ref_sampler_init and its clones share the family: the same
    // grammar / budget / chain structure, which common_sampler_copy GGML_ASSERTs
    uint64_t family = 0;

    ~pyspec_ref_sampler() { common_sampler_free(smpl); }
};

static bool sampler_type_valid(int32_t t) {
    switch (t) {
        case COMMON_SAMPLER_TYPE_DRY:
        case COMMON_SAMPLER_TYPE_TOP_K:
        case COMMON_SAMPLER_TYPE_TOP_P:
        case COMMON_SAMPLER_TYPE_MIN_P:
        case COMMON_SAMPLER_TYPE_TYPICAL_P:
        case COMMON_SAMPLER_TYPE_TEMPERATURE:
        case COMMON_SAMPLER_TYPE_XTC:
        case COMMON_SAMPLER_TYPE_INFILL:
        case COMMON_SAMPLER_TYPE_PENALTIES:
        case COMMON_SAMPLER_TYPE_TOP_N_SIGMA:
        case COMMON_SAMPLER_TYPE_ADAPTIVE_P:
            return true;
        default:
            return false;
    }
}

// struct common_sampler is private to common/sampling.cpp; at this revision (e3a74b299) it
// begins {common_params_sampling params; llama_sampler * grmr; ...}. This mirror of its first
// members reaches the grammar sampler, so an accept the grammar would throw on (leaving it
// without parse stacks, and the next use asserting) is refused beforehand, as the port does.
struct common_sampler_head {
    common_params_sampling params;
    llama_sampler * grmr;
};

static llama_sampler * grammar_of(common_sampler * smpl) {
    return reinterpret_cast<common_sampler_head *>(smpl)->grmr;
}

// common_sampler_sample GGML_ASSERTs that ctx has output for idx
static bool ctx_has_output(llama_context * ctx, int32_t idx) {
    return llama_get_sampled_probs_ith(ctx, idx) != nullptr ||
           llama_get_sampled_logits_ith(ctx, idx) != nullptr ||
           llama_get_logits_ith(ctx, idx) != nullptr;
}

extern "C" {

void pyspec_ref_sampling_params_default(pyspec_ref_sampling_params * out) {
    if (out == nullptr) {
        return;
    }
    static const common_params_sampling d;
    static std::vector<int32_t> samplers(d.samplers.begin(), d.samplers.end());
    static std::vector<const char *> breakers = [] {
        std::vector<const char *> v;
        for (const auto & s : d.dry_sequence_breakers) {
            v.push_back(s.c_str());
        }
        return v;
    }();

    *out = {};
    out->seed               = d.seed;
    out->n_prev             = d.n_prev;
    out->n_probs            = d.n_probs;
    out->min_keep           = d.min_keep;
    out->top_k              = d.top_k;
    out->top_p              = d.top_p;
    out->min_p              = d.min_p;
    out->xtc_probability    = d.xtc_probability;
    out->xtc_threshold      = d.xtc_threshold;
    out->typ_p              = d.typ_p;
    out->temp               = d.temp;
    out->dynatemp_range     = d.dynatemp_range;
    out->dynatemp_exponent  = d.dynatemp_exponent;
    out->penalty_last_n     = d.penalty_last_n;
    out->penalty_repeat     = d.penalty_repeat;
    out->penalty_freq       = d.penalty_freq;
    out->penalty_present    = d.penalty_present;
    out->dry_multiplier     = d.dry_multiplier;
    out->dry_base           = d.dry_base;
    out->dry_allowed_length = d.dry_allowed_length;
    out->dry_penalty_last_n = d.dry_penalty_last_n;
    out->adaptive_target    = d.adaptive_target;
    out->adaptive_decay     = d.adaptive_decay;
    out->mirostat           = d.mirostat;
    out->top_n_sigma        = d.top_n_sigma;
    out->mirostat_tau       = d.mirostat_tau;
    out->mirostat_eta       = d.mirostat_eta;
    out->ignore_eos         = d.ignore_eos;
    out->no_perf            = d.no_perf;
    out->timing_per_token   = d.timing_per_token;
    out->dry_sequence_breakers   = breakers.data();
    out->n_dry_sequence_breakers = (int32_t) breakers.size();
    out->samplers           = samplers.data();
    out->n_samplers         = (int32_t) samplers.size();
    out->grammar            = nullptr;
    out->logit_bias_tokens  = nullptr;
    out->logit_bias_values  = nullptr;
    out->n_logit_bias       = 0;
    out->backend_sampling   = d.backend_sampling;
}

pyspec_ref_sampler * pyspec_ref_sampler_init(const llama_model * model,
                                             const pyspec_ref_sampling_params * params) {
    pyspec::last_error().clear();

    auto fail = [&](const std::string & msg) -> pyspec_ref_sampler * {
        pyspec::last_error() = msg;
        return nullptr;
    };

    if (model == nullptr) {
        return fail("model is NULL");
    }
    if (params == nullptr) {
        return fail("params is NULL");
    }
    const auto & q = *params;
    if ((q.n_samplers < 0 || (q.n_samplers > 0 && q.samplers == nullptr)) ||
        (q.n_dry_sequence_breakers < 0 || (q.n_dry_sequence_breakers > 0 && q.dry_sequence_breakers == nullptr)) ||
        (q.n_logit_bias < 0 || (q.n_logit_bias > 0 && (q.logit_bias_tokens == nullptr || q.logit_bias_values == nullptr)))) {
        return fail("invalid array in sampling params");
    }
    // pyspec.common.checks.check_sampling_params, in its order and with its messages
    const int32_t max_hist = PYSPEC_MAX_HISTORY;
    if (q.n_prev > max_hist) {
        return fail("n_prev " + std::to_string(q.n_prev) + " exceeds the history limit of " + std::to_string(max_hist) + " tokens");
    }
    if (q.min_keep < 0) {
        return fail("min_keep must be an int in 0..2147483647, got " + std::to_string(q.min_keep));
    }
    if (q.penalty_last_n < -1 || q.penalty_last_n > max_hist) {
        return fail("penalty_last_n must be an int in -1.." + std::to_string(max_hist) + ", got " + std::to_string(q.penalty_last_n));
    }
    if (q.dry_penalty_last_n < -1) {
        return fail("dry_penalty_last_n must be an int in -1..2147483647, got " + std::to_string(q.dry_penalty_last_n));
    }
    if (q.mirostat < 0 || q.mirostat > 2) {
        return fail("unknown mirostat version");
    }
    if (q.mirostat == 0) {
        bool has_dry = false;
        for (int32_t i = 0; i < q.n_samplers; ++i) {
            if (!sampler_type_valid(q.samplers[i])) {
                return fail("unknown sampler type: " + std::to_string(q.samplers[i]));
            }
            has_dry |= q.samplers[i] == COMMON_SAMPLER_TYPE_DRY;
        }
        // llama_sampler_infill_apply compares every pair of candidates: a top-k must bound them
        // (pyspec.core.sampler.INFILL_MAX_CANDIDATES, the same message)
        for (int32_t i = 0; i < q.n_samplers; ++i) {
            if (q.samplers[i] != COMMON_SAMPLER_TYPE_INFILL) {
                continue;
            }
            bool top_k_before = false;
            for (int32_t j = 0; j < i; ++j) {
                top_k_before |= q.samplers[j] == COMMON_SAMPLER_TYPE_TOP_K;
            }
            if (!top_k_before || q.top_k <= 0 || q.top_k > PYSPEC_INFILL_MAX_CANDIDATES) {
                return fail("the infill sampler compares every pair of candidates: it needs top_k (1.." +
                            std::to_string(PYSPEC_INFILL_MAX_CANDIDATES) + ") before it");
            }
            const int32_t longest = pyspec_vocab_max_piece(llama_model_get_vocab(model));
            if (longest > PYSPEC_INFILL_MAX_PIECE) {
                return fail("the infill sampler holds token pieces of up to " + std::to_string(PYSPEC_INFILL_MAX_PIECE) +
                            " bytes; this vocabulary has one of " + std::to_string(longest));
            }
            break;
        }
        // llama_sampler_init_dry allocates its history window at once (a window <= 0 turns DRY
        // off at this pin: it lost n_ctx_train, and -1 no longer means the context size)
        if (has_dry && q.dry_multiplier != 0.0f && q.dry_base >= 1.0f && q.dry_penalty_last_n > max_hist) {
            return fail("DRY needs a history window in 1.." + std::to_string(max_hist) +
                        " tokens (penalty_last_n), got " + std::to_string(q.dry_penalty_last_n));
        }
    }

    try {
        const llama_vocab * vocab = llama_model_get_vocab(model);
        const int32_t n_vocab = llama_vocab_n_tokens(vocab);

        common_params_sampling p;
        p.seed               = q.seed;
        p.n_prev             = q.n_prev;
        p.n_probs            = q.n_probs;
        p.min_keep           = q.min_keep;
        p.top_k              = q.top_k;
        p.top_p              = q.top_p;
        p.min_p              = q.min_p;
        p.xtc_probability    = q.xtc_probability;
        p.xtc_threshold      = q.xtc_threshold;
        p.typ_p              = q.typ_p;
        p.temp               = q.temp;
        p.dynatemp_range     = q.dynatemp_range;
        p.dynatemp_exponent  = q.dynatemp_exponent;
        p.penalty_last_n     = q.penalty_last_n;
        p.penalty_repeat     = q.penalty_repeat;
        p.penalty_freq       = q.penalty_freq;
        p.penalty_present    = q.penalty_present;
        p.dry_multiplier     = q.dry_multiplier;
        p.dry_base           = q.dry_base;
        p.dry_allowed_length = q.dry_allowed_length;
        p.dry_penalty_last_n = q.dry_penalty_last_n;
        p.adaptive_target    = q.adaptive_target;
        p.adaptive_decay     = q.adaptive_decay;
        p.mirostat           = q.mirostat;
        p.top_n_sigma        = q.top_n_sigma;
        p.mirostat_tau       = q.mirostat_tau;
        p.mirostat_eta       = q.mirostat_eta;
        p.ignore_eos         = q.ignore_eos;
        p.no_perf            = q.no_perf;
        p.timing_per_token   = q.timing_per_token;
        p.backend_sampling   = q.backend_sampling;

        p.dry_sequence_breakers.clear();
        for (int32_t i = 0; i < q.n_dry_sequence_breakers; ++i) {
            if (q.dry_sequence_breakers[i] == nullptr) {
                return fail("dry sequence breaker is NULL");
            }
            p.dry_sequence_breakers.emplace_back(q.dry_sequence_breakers[i]);
        }

        p.samplers.clear();
        for (int32_t i = 0; i < q.n_samplers; ++i) {
            p.samplers.push_back((common_sampler_type) q.samplers[i]);
        }

        for (int32_t i = 0; i < q.n_logit_bias; ++i) {
            if (q.logit_bias_tokens[i] < 0 || q.logit_bias_tokens[i] >= n_vocab) {
                return fail("logit bias token " + std::to_string(q.logit_bias_tokens[i]) +
                            " is outside the vocabulary (0.." + std::to_string(n_vocab - 1) + ")");
            }
            p.logit_bias.push_back({ q.logit_bias_tokens[i], q.logit_bias_values[i] });
        }

        if (q.grammar != nullptr && q.grammar[0] != '\0') {
            const std::string grammar = q.grammar;
            if (grammar.compare(0, 11, "%llguidance") == 0) {
                return fail("llguidance (cmake -DLLAMA_LLGUIDANCE=ON) is not enabled");
            }
            // bounded first (pyspec_grammar.cpp); common_sampler_init silently drops a grammar that does not parse
            if (pyspec_grammar_check(vocab, grammar.data(), grammar.size(), "root") != 0) {
                return fail(std::string("grammar refused: ") + pyspec_ext_last_error());
            }
            llama_sampler * probe = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
            if (probe == nullptr) {
                return fail("grammar refused: failed to parse the grammar");
            }
            llama_sampler_free(probe);
            p.grammar = common_grammar(COMMON_GRAMMAR_TYPE_USER, grammar);
        }

        auto res = std::make_unique<pyspec_ref_sampler>();
        res->model   = model;
        res->n_vocab = n_vocab;
        res->smpl    = common_sampler_init(model, p);
        if (res->smpl == nullptr) {
            return fail("common_sampler_init failed");
        }
        static std::atomic<uint64_t> families{0};
        res->family = ++families;
        res->backend_sampling = p.backend_sampling; // common_sampler_init may have turned it off
        return res.release();
    } catch (const std::exception & e) {
        return fail(e.what());
    } catch (...) {
        return fail("unknown C++ exception");
    }
}

void pyspec_ref_sampler_free(pyspec_ref_sampler * smpl) {
    delete smpl;
}

pyspec_ref_sampler * pyspec_ref_sampler_clone(const pyspec_ref_sampler * smpl) {
    if (smpl == nullptr || smpl->smpl == nullptr) {
        return nullptr;
    }
    try {
        auto * out = new pyspec_ref_sampler();
        out->model            = smpl->model;
        out->n_vocab          = smpl->n_vocab;
        out->backend_sampling = smpl->backend_sampling;
        out->broken           = smpl->broken;
        out->family           = smpl->family;
        out->smpl             = common_sampler_clone(smpl->smpl);
        return out;
    } catch (const std::exception &) {
        return nullptr;
    }
}

int pyspec_ref_sampler_copy(const pyspec_ref_sampler * src, pyspec_ref_sampler * dst) {
    REQUIRE(src != nullptr && src->smpl != nullptr && dst != nullptr && dst->smpl != nullptr, PYSPEC_REF_E_NULL,
            "sampler is NULL");
    REQUIRE(src->family == dst->family, PYSPEC_REF_E_STATE,
            "common_sampler_copy needs samplers of the same structure: dst is not src or a clone of its family");
    return guarded([&] {
        common_sampler_copy(src->smpl, dst->smpl);
        dst->broken = src->broken;
        return (int) PYSPEC_REF_OK;
    });
}

bool pyspec_ref_sampler_backend_sampling(const pyspec_ref_sampler * smpl) {
    return smpl ? smpl->backend_sampling : false;
}

int32_t pyspec_ref_sampler_n_vocab(const pyspec_ref_sampler * smpl) {
    return smpl ? smpl->n_vocab : 0;
}

int pyspec_ref_sampler_accept_check(pyspec_ref_sampler * smpl, llama_token token) {
    REQUIRE(smpl != nullptr && smpl->smpl != nullptr, PYSPEC_REF_E_NULL, "sampler is NULL");
    REQUIRE(token >= 0 && token < smpl->n_vocab, PYSPEC_REF_E_RANGE,
            "token %d out of range [0, %d)", (int) token, (int) smpl->n_vocab);
    llama_sampler * grmr = grammar_of(smpl->smpl);
    if (grmr == nullptr) {
        return PYSPEC_REF_OK;
    }
    // the check is libpyspec_ext's: its message moves into this library's last error
    if (pyspec_grammar_accept_check(grmr, llama_model_get_vocab(smpl->model), token) != 0) {
        return pyspec::fail(PYSPEC_REF_E_EXCEPTION, "%s", pyspec_ext_last_error());
    }
    return PYSPEC_REF_OK;
}

#define REQUIRE_SMPL(s) \
    REQUIRE((s) != nullptr && (s)->smpl != nullptr, PYSPEC_REF_E_NULL, "sampler is NULL"); \
    REQUIRE(!(s)->broken, PYSPEC_REF_E_STATE, "this sampler's grammar lost its state in an earlier error; create a new sampler")

} // extern "C"

// run f() on the sampler; an exception marks it broken (see pyspec_ref_sampler::broken)
template <typename F>
static int guarded_smpl(pyspec_ref_sampler * smpl, F && f) {
    const int rc = guarded(std::forward<F>(f));
    if (rc == PYSPEC_REF_E_EXCEPTION && grammar_of(smpl->smpl) != nullptr) {
        smpl->broken = true;
    }
    return rc;
}

extern "C" {

int pyspec_ref_sampler_sample(pyspec_ref_sampler * smpl, llama_context * ctx, int32_t idx,
                              bool grammar_first, llama_token * out) {
    REQUIRE_SMPL(smpl);
    REQUIRE(ctx != nullptr, PYSPEC_REF_E_NULL, "ctx is NULL");
    REQUIRE(out != nullptr, PYSPEC_REF_E_NULL, "out is NULL");
    REQUIRE(llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx))) == smpl->n_vocab, PYSPEC_REF_E_RANGE,
            "ctx vocabulary size differs from the sampler's model");
    return guarded_smpl(smpl, [&] {
        REQUIRE(ctx_has_output(ctx, idx), PYSPEC_REF_E_RANGE, "no output (logits) for batch index %d", (int) idx);
        *out = common_sampler_sample(smpl->smpl, ctx, idx, grammar_first);
        return (int) PYSPEC_REF_OK;
    });
}

int pyspec_ref_sampler_sample_and_accept_n(pyspec_ref_sampler * smpl, llama_context * ctx,
                                           const int32_t * idxs, const llama_token * draft, int32_t n_draft,
                                           bool grammar_first, llama_token * out, int32_t out_cap) {
    REQUIRE_SMPL(smpl);
    REQUIRE(ctx != nullptr, PYSPEC_REF_E_NULL, "ctx is NULL");
    REQUIRE(n_draft >= 0 && (n_draft == 0 || draft != nullptr), PYSPEC_REF_E_NULL, "invalid draft");
    REQUIRE(out != nullptr, PYSPEC_REF_E_NULL, "out is NULL");
    REQUIRE(out_cap >= n_draft + 1, PYSPEC_REF_E_CAPACITY, "out_cap %d < n_draft + 1 = %d",
            (int) out_cap, (int) n_draft + 1);
    REQUIRE(llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx))) == smpl->n_vocab, PYSPEC_REF_E_RANGE,
            "ctx vocabulary size differs from the sampler's model");
    return guarded_smpl(smpl, [&] {
        const llama_tokens d(draft, draft + n_draft);
        // every index that may be sampled must have output
        for (int32_t i = 0; i <= n_draft; ++i) {
            const int32_t idx = idxs ? idxs[i] : i;
            REQUIRE(ctx_has_output(ctx, idx), PYSPEC_REF_E_RANGE, "no output (logits) for batch index %d", (int) idx);
        }
        std::vector<llama_token> res;
        if (idxs == nullptr) {
            res = common_sampler_sample_and_accept_n(smpl->smpl, ctx, d, grammar_first);
        } else {
            const std::vector<int> vidxs(idxs, idxs + n_draft + 1);
            res = common_sampler_sample_and_accept_n(smpl->smpl, ctx, vidxs, d, grammar_first);
        }
        std::copy(res.begin(), res.end(), out);
        return (int) res.size();
    });
}

int pyspec_ref_sampler_accept(pyspec_ref_sampler * smpl, llama_token token, bool accept_grammar) {
    REQUIRE_SMPL(smpl);
    REQUIRE(token >= 0 && token < smpl->n_vocab, PYSPEC_REF_E_RANGE,
            "token %d out of range [0, %d)", (int) token, (int) smpl->n_vocab);
    llama_sampler * grmr = grammar_of(smpl->smpl);
    if (accept_grammar && grmr != nullptr) {
        if (pyspec_grammar_accept_check(grmr, llama_model_get_vocab(smpl->model), token) != 0) {
            return pyspec::fail(PYSPEC_REF_E_EXCEPTION, "%s", pyspec_ext_last_error());
        }
    }
    return guarded_smpl(smpl, [&] {
        common_sampler_accept(smpl->smpl, token, accept_grammar);
        return (int) PYSPEC_REF_OK;
    });
}

int pyspec_ref_sampler_reset(pyspec_ref_sampler * smpl) {
    REQUIRE_SMPL(smpl);
    return guarded([&] {
        common_sampler_reset(smpl->smpl);
        return (int) PYSPEC_REF_OK;
    });
}

int pyspec_ref_sampler_last(const pyspec_ref_sampler * smpl, llama_token * out) {
    REQUIRE_SMPL(smpl);
    REQUIRE(out != nullptr, PYSPEC_REF_E_NULL, "out is NULL");
    return guarded([&] {
        *out = common_sampler_last(smpl->smpl); // throws when nothing was accepted yet
        return (int) PYSPEC_REF_OK;
    });
}

int pyspec_ref_sampler_get_seed(const pyspec_ref_sampler * smpl, uint32_t * out) {
    REQUIRE_SMPL(smpl);
    REQUIRE(out != nullptr, PYSPEC_REF_E_NULL, "out is NULL");
    return guarded([&] {
        *out = common_sampler_get_seed(smpl->smpl);
        return (int) PYSPEC_REF_OK;
    });
}

llama_sampler * pyspec_ref_sampler_get_chain(pyspec_ref_sampler * smpl) {
    return (smpl == nullptr || smpl->smpl == nullptr) ? nullptr : common_sampler_get(smpl->smpl);
}

llama_token_data_array * pyspec_ref_sampler_get_candidates(pyspec_ref_sampler * smpl, bool do_sort) {
    if (smpl == nullptr || smpl->smpl == nullptr) {
        pyspec::fail(PYSPEC_REF_E_NULL, "sampler is NULL");
        return nullptr;
    }
    try {
        // unsorted read first: sorting dereferences data[selected]
        llama_token_data_array * cur_p = common_sampler_get_candidates(smpl->smpl, false);
        if (cur_p == nullptr || cur_p->data == nullptr || cur_p->size == 0) {
            pyspec::fail(PYSPEC_REF_E_STATE, "no candidates: nothing was sampled yet");
            return nullptr;
        }
        if (do_sort && !cur_p->sorted) {
            if (cur_p->selected < 0 || (size_t) cur_p->selected >= cur_p->size) {
                pyspec::fail(PYSPEC_REF_E_STATE, "candidates have no selected token; cannot sort");
                return nullptr;
            }
            cur_p = common_sampler_get_candidates(smpl->smpl, true);
        }
        return cur_p;
    } catch (const std::exception & e) {
        pyspec::fail(PYSPEC_REF_E_EXCEPTION, "%s", e.what());
        return nullptr;
    }
}

} // extern "C"
