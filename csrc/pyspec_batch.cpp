// The checks pyspec.core.context runs on a batch before llama_decode / llama_encode
// (what llama.cpp would abort on), and the output row of every batch index, in one
// pass. In Python the same took a dozen numpy calls per decode, a good part of the
// driver's cost per step on a small model.

#include "llama.h"

#include <cstdint>

extern "C" {
#include "../pyspec/decl/pyspec_ext.h"  // pyspec_batch_info, the status codes (C linkage)
}

// n_seq_id_max: the most sequence ids a token may carry (the batch's row width, and
// the context's n_seq_max); rows receives, for each of the batch's tokens, its output
// row or -1 (every row an output when all_outputs). A token outside the vocabulary is
// only reported: llama_decode refuses such a batch itself.
int32_t pyspec_batch_scan(const llama_batch * batch, int32_t n_seq_id_max, int32_t n_seq_max, int32_t n_vocab,
                          bool all_outputs, int32_t * rows, pyspec_batch_info * info) {
    const int32_t n = batch->n_tokens;
    info->n_outputs     = 0;
    info->max_n_seq_id  = 0;
    info->bad_token     = -1;
    info->has_bad_token = 0;
    info->bad_value     = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t k = batch->n_seq_id[i];
        if (k < 1 || k > n_seq_id_max) {
            info->bad_value = k;
            return PYSPEC_BATCH_E_N_SEQ;
        }
        if (k > info->max_n_seq_id) {
            info->max_n_seq_id = k;
        }
        for (int32_t j = 0; j < k; j++) {
            const llama_seq_id s = batch->seq_id[i][j];
            if (s < 0 || s >= n_seq_max) {
                info->bad_value = s;
                return PYSPEC_BATCH_E_SEQ_ID;
            }
        }
        if (batch->token != nullptr && !info->has_bad_token && (batch->token[i] < 0 || batch->token[i] >= n_vocab)) {
            info->bad_token     = batch->token[i];
            info->has_bad_token = 1;
        }
        rows[i] = (all_outputs || batch->logits[i] != 0) ? info->n_outputs++ : -1;
    }
    return PYSPEC_BATCH_OK;
}
