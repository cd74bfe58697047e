// A pre-flight check of a GGUF file's tokenizer metadata, before llama_model_load_from_file.
//
// llama_vocab::impl::load (src/llama-vocab.cpp) reads the tokenizer arrays with gguf's
// unchecked accessors and asserts on what it built: a token list with a repeated token
// ends in GGML_ASSERT(id_to_token.size() == token_to_id.size()) (found by scripts/fuzz.py
// on a mutated header), a token list that is not an array of strings in the assert of
// gguf_get_arr_str, and scores / token types / a precompiled charsmap of another element
// type are read as float / int32 / bytes past their end. This check parses the file with
// gguf's own parser (no tensor data) and refuses those cases with a message; everything
// else is left to llama.cpp, whose loader reports its errors as exceptions it catches.

#include "gguf.h"
#include "llama.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_map>

extern "C" {
#include "../pyspec/decl/pyspec_ext.h"
}
#include "pyspec_errbuf.h"

namespace {

// whether key is absent, or an array of one of the allowed element types
bool array_of(const gguf_context * g, const char * key, std::initializer_list<gguf_type> allowed) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) {
        return true;
    }
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) {
        return false;
    }
    const gguf_type t = gguf_get_arr_type(g, id);
    for (gguf_type a : allowed) {
        if (t == a) {
            return true;
        }
    }
    return false;
}

}  // namespace

extern "C" int pyspec_gguf_check(const char * path, char * err, size_t err_len) {
    gguf_init_params params = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path, params);
    if (g == nullptr) {
        return 0;  // not parsable: llama.cpp says so itself (ModelLoadError)
    }
    int rc = 0;
    if (!array_of(g, "tokenizer.ggml.tokens", { GGUF_TYPE_STRING })) {
        rc = pyspec::fail(err, err_len, "tokenizer.ggml.tokens is not an array of strings");
    } else if (!array_of(g, "tokenizer.ggml.scores", { GGUF_TYPE_FLOAT32 })) {
        rc = pyspec::fail(err, err_len, "tokenizer.ggml.scores is not an array of float32");
    } else if (!array_of(g, "tokenizer.ggml.token_type", { GGUF_TYPE_INT32 })) {
        rc = pyspec::fail(err, err_len, "tokenizer.ggml.token_type is not an array of int32");
    } else if (!array_of(g, "tokenizer.ggml.merges", { GGUF_TYPE_STRING })) {
        rc = pyspec::fail(err, err_len, "tokenizer.ggml.merges is not an array of strings");
    } else if (!array_of(g, "tokenizer.ggml.precompiled_charsmap", { GGUF_TYPE_INT8, GGUF_TYPE_UINT8 })) {
        rc = pyspec::fail(err, err_len, "tokenizer.ggml.precompiled_charsmap is not an array of bytes");
    } else {
        const int64_t id = gguf_find_key(g, "tokenizer.ggml.tokens");
        if (id >= 0) {
            // the same words llama_vocab::impl::load puts into token_to_id (an empty one is renamed)
            const size_t n = gguf_get_arr_n(g, id);
            std::unordered_map<std::string, size_t> seen;
            seen.reserve(n);
            for (size_t i = 0; i < n; ++i) {
                std::string word = gguf_get_arr_str(g, id, i);
                if (word.empty()) {
                    word = "[EMPTY_" + std::to_string(i) + "]";
                }
                auto [it, fresh] = seen.emplace(word, i);
                if (!fresh) {
                    rc = pyspec::fail(err, err_len, "tokenizer.ggml.tokens repeats token %zu as %zu ('%.60s')", it->second,
                                   i, word.c_str());
                    break;
                }
            }
        }
    }
    gguf_free(g);
    return rc;
}
