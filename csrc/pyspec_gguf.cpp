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
// Before that parse, a walk over the metadata refuses an empty key, which gguf's parser
// asserts on.

#include "gguf.h"
#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sys/types.h>
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

// bytes of a scalar GGUF value type (gguf.cpp keeps its table private); 0: not a scalar
size_t scalar_size(uint32_t type) {
    switch (type) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

// Walks the metadata section for what gguf's own parser asserts on instead of refusing:
// an empty key (GGML_ASSERT(!key.empty()) in gguf_kv's constructors, found by
// scripts/fuzz.py --atheris on a mutated header). Returns the index of the first KV with
// an empty key, or -1; a file it cannot walk (short, unknown type) is left to gguf, which
// refuses it with an error.
int64_t first_empty_key(const char * path) {
    FILE * f = std::fopen(path, "rb");
    if (f == nullptr) {
        return -1;
    }
    auto rd = [f](void * dst, size_t n) { return std::fread(dst, 1, n, f) == n; };
    auto skip = [f](uint64_t n) { return n <= (uint64_t) INT64_MAX && fseeko(f, (off_t) n, SEEK_CUR) == 0; };
    auto skip_string = [&]() {
        uint64_t len = 0;
        return rd(&len, sizeof(len)) && skip(len);
    };
    int64_t found = -1;
    char     magic[4];
    uint32_t version = 0;
    int64_t  n_tensors = 0, n_kv = 0;
    if (rd(magic, 4) && rd(&version, 4) && rd(&n_tensors, 8) && rd(&n_kv, 8)) {
        for (int64_t i = 0; i < n_kv; ++i) {
            uint64_t key_len = 0;
            if (!rd(&key_len, sizeof(key_len))) {
                break;
            }
            if (key_len == 0) {
                found = i;
                break;
            }
            uint32_t type = 0;
            if (!skip(key_len) || !rd(&type, sizeof(type))) {
                break;
            }
            bool ok = true;
            if (type == GGUF_TYPE_STRING) {
                ok = skip_string();
            } else if (type == GGUF_TYPE_ARRAY) {
                uint32_t elem = 0;
                uint64_t n    = 0;
                ok = rd(&elem, sizeof(elem)) && rd(&n, sizeof(n));
                if (ok && elem == GGUF_TYPE_STRING) {
                    for (uint64_t k = 0; ok && k < n; ++k) {
                        ok = skip_string();
                    }
                } else if (ok) {
                    const size_t size = scalar_size(elem);
                    ok = size > 0 && n <= UINT64_MAX / size && skip(n * size);
                }
            } else {
                const size_t size = scalar_size(type);
                ok = size > 0 && skip(size);
            }
            if (!ok) {
                break;
            }
        }
    }
    std::fclose(f);
    return found;
}

}  // namespace

extern "C" int pyspec_gguf_check(const char * path) {
    const int64_t empty = first_empty_key(path);
    if (empty >= 0) {
        return pyspec::fail(-1, "metadata key #%lld is empty", (long long) empty);
    }
    gguf_init_params params = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path, params);
    if (g == nullptr) {
        return 0;  // not parsable: llama.cpp says so itself (ModelLoadError)
    }
    int rc = 0;
    if (!array_of(g, "tokenizer.ggml.tokens", { GGUF_TYPE_STRING })) {
        rc = pyspec::fail(-1, "tokenizer.ggml.tokens is not an array of strings");
    } else if (!array_of(g, "tokenizer.ggml.scores", { GGUF_TYPE_FLOAT32, GGUF_TYPE_INT32 })) {
        rc = pyspec::fail(-1, "tokenizer.ggml.scores is not an array of float32 or int32");
    } else if (!array_of(g, "tokenizer.ggml.token_type", { GGUF_TYPE_INT32 })) {
        rc = pyspec::fail(-1, "tokenizer.ggml.token_type is not an array of int32");
    } else if (!array_of(g, "tokenizer.ggml.merges", { GGUF_TYPE_STRING })) {
        rc = pyspec::fail(-1, "tokenizer.ggml.merges is not an array of strings");
    } else if (!array_of(g, "tokenizer.ggml.precompiled_charsmap", { GGUF_TYPE_INT8, GGUF_TYPE_UINT8 })) {
        rc = pyspec::fail(-1, "tokenizer.ggml.precompiled_charsmap is not an array of bytes");
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
                    rc = pyspec::fail(-1, "tokenizer.ggml.tokens repeats token %zu as %zu ('%.60s')", it->second,
                                   i, word.c_str());
                    break;
                }
            }
        }
    }
    gguf_free(g);
    return rc;
}
