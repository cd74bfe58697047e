// C linkage for the staging API of llama.cpp's src/llama-ext.h, and the struct
// layout probe.
//
// libllama exports the staging API with C++ linkage (mangled names), which
// cffi cannot declare; each wrapper below forwards one call unchanged.

#include "llama.h"
#include "llama-ext.h"
#include "llama-context.h"
#include "llama-model.h"
#include "llama-arch.h"

#include "ggml-backend.h"

#include "pyspec_errbuf.h"

#ifdef PYSPEC_OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

extern "C" {

// the declarations cffi reads, so the compiler checks them against the definitions below
#include "../pyspec/decl/pyspec_ext.h"

// the library's one last-error helper (pyspec_errbuf.h): the messages of the grammar, GGUF and RPC checks
const char * pyspec_ext_last_error(void) {
    return pyspec::last_error().c_str();
}

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

// the MTP graphs GGML_ASSERT 0 <= offset < n_layer_nextn when they are built: refused here
// (-1, message in pyspec_ext_last_error), where Python can still be told
int32_t pyspec_set_nextn_layer_offset(llama_context * ctx, int32_t offset) {
    pyspec::last_error().clear();
    const int32_t n = (int32_t) llama_get_model(ctx)->hparams.n_layer_nextn;
    if (offset < 0 || (offset > 0 && offset >= n)) {
        return pyspec::fail(-1, "nextn layer offset %d out of range [0, %d)", (int) offset, (int) std::max(n, 1));
    }
    llama_set_nextn_layer_offset(ctx, offset);
    return 0;
}

// a DSpark Markov head was loaded: its graph (build_dspark_markov_head, src/models/dflash.cpp)
// GGML_ASSERTs dflash.block_size when any context of the model reserves its graphs
bool pyspec_model_has_dspark_head(const llama_model * model) {
    return model->dspark_markov_w1 != nullptr;
}

int32_t pyspec_model_dflash_selector_top_k(const llama_model * model) {
    return llama_model_dflash_selector_top_k(model);
}

// llama_model_get_tok_embd, without its aborts (more than UINT32_MAX elements, a tensor
// type it cannot dequantize): 0 with the message in pyspec_ext_last_error instead
uint32_t pyspec_model_get_tok_embd(const llama_model * model, float * out) {
    pyspec::last_error().clear();
    const ggml_tensor * t = model->tok_embd;
    if (t != nullptr && model->vocab.n_tokens() != 0) {
        if ((uint64_t) ggml_nelements(t) > UINT32_MAX) {
            pyspec::fail(-1, "token embedding matrix of %lld elements", (long long) ggml_nelements(t));
            return 0;
        }
        const ggml_type ty = t->type;
        if (out != nullptr && ty != GGML_TYPE_F32 && ty != GGML_TYPE_F16 && ty != GGML_TYPE_BF16 &&
            !(ggml_is_quantized(ty) && ggml_get_type_traits(ty)->to_float != nullptr)) {
            pyspec::fail(-1, "unsupported tensor type for dequantization: %s", ggml_type_name(ty));
            return 0;
        }
    }
    return llama_model_get_tok_embd(model, out);
}

// The most recurrent-state snapshots per sequence (n_rs_seq) a context of `model` can
// be made with. Each snapshot adds three tensors per recurrent layer to every graph
// (build_conv_state in src/models/delta-net-base.cpp), and a graph's ggml context holds
// graph_max_nodes() tensors, at least 32 per model tensor for these archs; past that,
// llama_init_from_model aborts (GGML_ASSERT(obj_new)) while it reserves the graphs. Half
// of that budget is left to the snapshots. UINT32_MAX where the arch keeps none
// (llama.cpp sets n_rs_seq to 0 there).
uint32_t pyspec_model_max_rs_seq(const llama_model * model) {
    if (!llm_arch_supports_rs_rollback(model->arch)) {
        return UINT32_MAX;
    }
    size_t n_recurrent = 0;
    for (uint32_t il = 0; il < model->hparams.n_layer(); il++) {
        n_recurrent += model->hparams.is_recr(il) ? 1 : 0;
    }
    if (n_recurrent == 0) {
        return UINT32_MAX;
    }
    const size_t budget = 32 * model->n_tensors() / 2;
    const size_t k_max  = budget / (3 * n_recurrent);  // snapshots + 1 (the current state)
    return k_max > 1 ? (uint32_t) (k_max - 1) : 0;
}

// llama_context's creation tries the fused gated-delta-net op on the devices of the recurrent
// layers and turns it off where the scheduler would place it on another device. With
// n_rs_seq > 0 the graph uses the fused op anyway (it writes the snapshots), so that split
// happens: on Vulkan (lavapipe) the tiny qwen35 model's head size 16, which the Vulkan shader
// lacks, corrupted the heap on the third decode after a 1- and a 2-token decode.
bool pyspec_context_gdn_split(const llama_context * ctx) {
    const auto & cp = ctx->get_cparams();
    return !cp.fused_gdn_ar || !cp.fused_gdn_ch;
}

// libgomp keeps a pool of workers for every thread that has run a parallel region, and
// while it manages more threads than there are CPUs it barely spins at a barrier: each of
// a decode's barriers then sleeps and wakes through the kernel. Once one thread has decoded
// and another decodes from then on, every decode runs about twice as slow (Gemma 3 270M,
// 2 threads on 2 cores: 24 -> 49 ms a token) until the first thread's pool is released.
int32_t pyspec_cpu_release_workers(void) {
#ifdef PYSPEC_OPENMP
    return omp_pause_resource_all(omp_pause_soft) == 0 ? 1 : -1;
#else
    return 0;
#endif
}

// The longest piece llama_sampler_infill_apply renders (special = false, lstrip = 0),
// which its fixed 512-byte buffers must hold (PYSPEC_INFILL_MAX_PIECE). A piece that
// does not fit in `probe` returns its length negated.
int32_t pyspec_vocab_max_piece(const llama_vocab * vocab) {
    char    probe[8];
    int32_t longest = 0;
    for (llama_token t = 0; t < llama_vocab_n_tokens(vocab); t++) {
        const int32_t n = llama_token_to_piece(vocab, t, probe, sizeof(probe), 0, false);
        longest = std::max(longest, n < 0 ? -n : n);
    }
    return longest;
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

// The reads of common_sampler::set_logits and common_sampler_sample (common/sampling.cpp)
// for one output row, in the C++'s order and one call: the backend-sampled probabilities,
// else the backend-sampled logits (each with the candidate ids and their count), else the
// row's logits; then the backend-sampled token. Five calls through cffi cost the Python
// sampler more than the calls themselves, on every row it samples.
void pyspec_sampler_row(llama_context * ctx, int32_t idx, pyspec_sampler_row_data * out) {
    out->probs      = llama_get_sampled_probs_ith(ctx, idx);
    out->logits     = llama_get_sampled_logits_ith(ctx, idx);
    out->candidates = llama_get_sampled_candidates_ith(ctx, idx);
    out->n          = 0;
    out->row        = nullptr;
    if (out->probs != nullptr) {
        out->n = (int32_t) llama_get_sampled_probs_count_ith(ctx, idx);
    } else if (out->logits != nullptr) {
        out->n = (int32_t) llama_get_sampled_logits_count_ith(ctx, idx);
    } else {
        out->row = llama_get_logits_ith(ctx, idx);
    }
    out->token = llama_get_sampled_token_ith(ctx, idx);
}

// The highest of row[b0, b1) (any one of equal highest) and, in *nan, whether a NaN is
// among them. On x86-64, SSE in four independent lanes: maxps(x, m) is x > m ? x : m, so a
// NaN never wins and is looked for beside it (an unordered compare of two rows catches one
// in either).
static float block_max(const float * row, int32_t b0, int32_t b1, bool * nan) {
    float   mx = -INFINITY;
    bool    nn = false;
    int32_t i  = b0;
#if defined(__SSE2__)
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m128 u0 = _mm_setzero_ps(), u1 = u0;
    for (; i + 32 <= b1; i += 32) {
        const __m128 x0 = _mm_loadu_ps(row + i), x1 = _mm_loadu_ps(row + i + 4);
        const __m128 x2 = _mm_loadu_ps(row + i + 8), x3 = _mm_loadu_ps(row + i + 12);
        const __m128 x4 = _mm_loadu_ps(row + i + 16), x5 = _mm_loadu_ps(row + i + 20);
        const __m128 x6 = _mm_loadu_ps(row + i + 24), x7 = _mm_loadu_ps(row + i + 28);
        m0 = _mm_max_ps(x4, _mm_max_ps(x0, m0));
        m1 = _mm_max_ps(x5, _mm_max_ps(x1, m1));
        m2 = _mm_max_ps(x6, _mm_max_ps(x2, m2));
        m3 = _mm_max_ps(x7, _mm_max_ps(x3, m3));
        u0 = _mm_or_ps(u0, _mm_or_ps(_mm_cmpunord_ps(x0, x1), _mm_cmpunord_ps(x2, x3)));
        u1 = _mm_or_ps(u1, _mm_or_ps(_mm_cmpunord_ps(x4, x5), _mm_cmpunord_ps(x6, x7)));
    }
    float lanes[4];
    _mm_storeu_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
    for (const float v : lanes) {
        mx = v > mx ? v : mx;
    }
    nn = _mm_movemask_ps(_mm_or_ps(u0, u1)) != 0;
#endif
    for (; i < b1; i++) {
        const float x = row[i];
        nn |= x != x;
        mx  = x > mx ? x : mx;
    }
    *nan |= nn;
    return mx;
}

// The token top-k 1 keeps from a row of logits in token order: std::partial_sort with a
// strict > keeps the first of the highest. -1 for a row with a NaN (argmax and the sort part
// ways there) or no logits. One pass in blocks: the first block whose highest is above all
// before it holds the answer, at its first logit equal to that highest (-0.0 == +0.0 there,
// as in the sort's comparisons).
llama_token pyspec_top1(const float * row, int32_t n) {
    constexpr int32_t BLOCK      = 256;
    float             best       = -INFINITY;
    int32_t           best_block = -1;
    bool              nan        = false;
    for (int32_t b0 = 0; b0 < n; b0 += BLOCK) {
        const float mx = block_max(row, b0, std::min(n, b0 + BLOCK), &nan);
        if (best_block < 0 || mx > best) {
            best       = mx;
            best_block = b0;
        }
    }
    if (nan || best_block < 0) {
        return LLAMA_TOKEN_NULL;
    }
    for (int32_t i = best_block;; i++) {
        if (row[i] == best) {
            return i;
        }
    }
}

// The row of plain logits common_sampler::set_logits would read for output idx: nullptr where it
// reads something else (backend-sampled probabilities or logits, a backend-sampled token) or
// there is no row. The sampler's shortcuts below take only such rows.
static const float * plain_logits_row(llama_context * ctx, int32_t idx) {
    if (llama_get_sampled_probs_ith(ctx, idx) != nullptr || llama_get_sampled_logits_ith(ctx, idx) != nullptr) {
        return nullptr;
    }
    const float * row = llama_get_logits_ith(ctx, idx);
    return llama_get_sampled_token_ith(ctx, idx) == LLAMA_TOKEN_NULL ? row : nullptr;
}

// The greedy shortcut of common_sampler_sample (pyspec.fastpath.sampler) in one call: its
// llama_synchronize; then, for a row of plain logits, the token the chain [top-k 1, dist]
// selects, with cur_p left as that chain leaves it (data = buf, buf[0] = {id, logit, 1},
// size 1, selected 0, sorted) and the time after the synchronization added to *t_us (if given).
// dist (the chain's second sampler) is applied to that one candidate: it draws from its RNG
// even then, and a later sampled draw must find the state the chain would have left.
// LLAMA_TOKEN_NULL, cur_p untouched, where the full path must run: a backend-sampled row,
// no row, a NaN logit.
llama_token pyspec_sampler_top1(llama_context * ctx, int32_t idx, int32_t n_vocab, llama_token_data_array * cur_p,
                                llama_token_data * buf, llama_sampler * dist, int64_t * t_us) {
    llama_synchronize(ctx);
    const int64_t t0  = t_us != nullptr ? ggml_time_us() : 0;
    const float * row = plain_logits_row(ctx, idx);
    if (row == nullptr) {
        return LLAMA_TOKEN_NULL;
    }
    const llama_token id = pyspec_top1(row, n_vocab);
    if (id == LLAMA_TOKEN_NULL) {
        return id;
    }
    buf[0]          = llama_token_data{ id, row[id], 1.0f };
    cur_p->data     = buf;
    cur_p->size     = 1;
    cur_p->selected = 0;
    cur_p->sorted   = true;
    if (dist != nullptr) {
        llama_sampler_apply(dist, cur_p);
    }
    if (t_us != nullptr) {
        *t_us += ggml_time_us() - t0;
    }
    return id;
}

constexpr int32_t TOPK_BLOCK = 32;

// Whether any of row[0, TOPK_BLOCK) is above thr or a NaN (SSE on x86-64).
static bool block_has_above(const float * row, float thr) {
#if defined(__SSE2__)
    const __m128 t   = _mm_set1_ps(thr);
    __m128       hit = _mm_setzero_ps();
    for (int32_t j = 0; j < TOPK_BLOCK; j += 8) {
        const __m128 x0 = _mm_loadu_ps(row + j), x1 = _mm_loadu_ps(row + j + 4);
        hit = _mm_or_ps(hit, _mm_or_ps(_mm_cmpgt_ps(x0, t), _mm_cmpgt_ps(x1, t)));
        hit = _mm_or_ps(hit, _mm_cmpunord_ps(x0, x1));
    }
    return _mm_movemask_ps(hit) != 0;
#else
    bool hit = false;
    for (int32_t j = 0; j < TOPK_BLOCK; j++) {
        hit |= !(row[j] <= thr);  // above, or a NaN
    }
    return hit;
#endif
}

// The k highest of a row of n logits, highest first, as {id, logit, 0} in buf[0, k): what
// std::partial_sort with a strict > leaves there where its order is certain, that is where the
// k highest are distinct and above all others. false otherwise (equal logits there, a NaN), or
// for k outside 1..PYSPEC_TOPK_MAX or n <= k.
bool pyspec_topk(const float * row, int32_t n, int32_t k, llama_token_data * buf) {
    if (k < 1 || k > PYSPEC_TOPK_MAX || n <= k) {
        return false;
    }
    // the k + 1 highest seen so far, highest first (an equal one goes after those before it)
    float   top[PYSPEC_TOPK_MAX + 1];
    int32_t ids[PYSPEC_TOPK_MAX + 1];
    int32_t n_top = 0;
    for (int32_t i = 0; i < n;) {
        // once k + 1 are kept, most blocks hold nothing above the lowest of them: skip those whole
        if (n_top == k + 1 && i + TOPK_BLOCK <= n && !block_has_above(row + i, top[k])) {
            i += TOPK_BLOCK;
            continue;
        }
        for (const int32_t end = std::min(n, i + TOPK_BLOCK); i < end; i++) {
            const float x = row[i];
            if (x != x) {
                return false;
            }
            if (n_top == k + 1 && !(x > top[k])) {
                continue;
            }
            int32_t j = n_top < k + 1 ? n_top++ : k;
            for (; j > 0 && x > top[j - 1]; j--) {
                top[j] = top[j - 1];
                ids[j] = ids[j - 1];
            }
            top[j] = x;
            ids[j] = i;
        }
    }
    for (int32_t j = 0; j < k; j++) {
        if (!(top[j] > top[j + 1])) {
            return false;  // equal logits: the sort's order among them is its own
        }
    }
    for (int32_t j = 0; j < k; j++) {
        buf[j] = llama_token_data{ ids[j], top[j], 0.0f };
    }
    return true;
}

// set_logits and the top-k sampler of common_sampler_sample (pyspec.fastpath.sampler) for a
// chain [top-k k, dist] and a row of plain logits, without the vocabulary-sized candidate
// array: pyspec_topk into buf, and cur_p = {buf, k, -1, sorted}. false, cur_p untouched, where
// pyspec_topk is, for a backend-sampled row and for no row: the full path runs.
bool pyspec_sampler_topk(llama_context * ctx, int32_t idx, int32_t n_vocab, int32_t k, llama_token_data_array * cur_p,
                         llama_token_data * buf) {
    const float * row = plain_logits_row(ctx, idx);
    if (row == nullptr || !pyspec_topk(row, n_vocab, k, buf)) {
        return false;
    }
    cur_p->data     = buf;
    cur_p->size     = (size_t) k;
    cur_p->selected = -1;
    cur_p->sorted   = true;
    return true;
}

// Batch-invariant mode (pyspec.core.context): ggml-cpu's reference switch
// (ggml_backend_cpu_set_use_ref) on every CPU backend of a context. With it,
// flash attention runs one kernel whatever the batch (no query tiling from 64
// rows on, no KV splitting across threads for a single query) and no ops are
// fused, so a row's result does not depend on the batch it was computed in.
// llama.h does not expose a context's backends; the scheduler does. Returns the
// number of CPU backends switched; *n_other receives the number of backends
// of other kinds (GPU, accelerators), which the switch does not reach.
int32_t pyspec_context_set_cpu_use_ref(llama_context * ctx, bool value, int32_t * n_other) {
    ggml_backend_sched_t sched  = ctx->get_sched();
    int32_t              n_cpu  = 0;
    int32_t              n_rest = 0;
    const int            n      = sched != nullptr ? ggml_backend_sched_get_n_backends(sched) : 0;
    for (int i = 0; i < n; ++i) {
        ggml_backend_t     backend = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev     = ggml_backend_get_device(backend);
        if (dev == nullptr || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            n_rest++;
            continue;
        }
        using set_use_ref_t = void (*)(ggml_backend_t, bool);
        auto set_use_ref    = (set_use_ref_t) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                                "ggml_backend_cpu_set_use_ref");
        if (set_use_ref == nullptr) {
            n_rest++;
            continue;
        }
        set_use_ref(backend, value);
        n_cpu++;
    }
    if (n_other != nullptr) {
        *n_other = n_rest;
    }
    return n_cpu;
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
