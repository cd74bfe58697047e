/* Mirrors ggml/include/gguf.h (llama.cpp e3a74b299): the reading API, in the
   header's order (the writing API is left out: pyspec writes no GGUF from C).
   Careful: the accessors GGML_ASSERT on an out-of-range id or a wrong value
   type, so a caller checks gguf_get_kv_type / the counts first. */

#define GGUF_VERSION 3

#define GGUF_DEFAULT_ALIGNMENT 32

enum gguf_type {
    GGUF_TYPE_UINT8   = 0,
    GGUF_TYPE_INT8    = 1,
    GGUF_TYPE_UINT16  = 2,
    GGUF_TYPE_INT16   = 3,
    GGUF_TYPE_UINT32  = 4,
    GGUF_TYPE_INT32   = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL    = 7,
    GGUF_TYPE_STRING  = 8,
    GGUF_TYPE_ARRAY   = 9,
    GGUF_TYPE_UINT64  = 10,
    GGUF_TYPE_INT64   = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT,
};

struct gguf_context;

struct gguf_init_params {
    bool no_alloc;

    struct ggml_context ** ctx;
};

struct gguf_context * gguf_init_from_file(const char * fname, struct gguf_init_params params);

void gguf_free(struct gguf_context * ctx);

const char * gguf_type_name(enum gguf_type type);

uint32_t gguf_get_version    (const struct gguf_context * ctx);
size_t   gguf_get_alignment  (const struct gguf_context * ctx);
size_t   gguf_get_data_offset(const struct gguf_context * ctx);

int64_t      gguf_get_n_kv(const struct gguf_context * ctx);
int64_t      gguf_find_key(const struct gguf_context * ctx, const char * key);
const char * gguf_get_key (const struct gguf_context * ctx, int64_t key_id);

enum gguf_type gguf_get_kv_type (const struct gguf_context * ctx, int64_t key_id);
enum gguf_type gguf_get_arr_type(const struct gguf_context * ctx, int64_t key_id);

uint8_t      gguf_get_val_u8  (const struct gguf_context * ctx, int64_t key_id);
int8_t       gguf_get_val_i8  (const struct gguf_context * ctx, int64_t key_id);
uint16_t     gguf_get_val_u16 (const struct gguf_context * ctx, int64_t key_id);
int16_t      gguf_get_val_i16 (const struct gguf_context * ctx, int64_t key_id);
uint32_t     gguf_get_val_u32 (const struct gguf_context * ctx, int64_t key_id);
int32_t      gguf_get_val_i32 (const struct gguf_context * ctx, int64_t key_id);
float        gguf_get_val_f32 (const struct gguf_context * ctx, int64_t key_id);
uint64_t     gguf_get_val_u64 (const struct gguf_context * ctx, int64_t key_id);
int64_t      gguf_get_val_i64 (const struct gguf_context * ctx, int64_t key_id);
double       gguf_get_val_f64 (const struct gguf_context * ctx, int64_t key_id);
bool         gguf_get_val_bool(const struct gguf_context * ctx, int64_t key_id);
const char * gguf_get_val_str (const struct gguf_context * ctx, int64_t key_id);
const void * gguf_get_val_data(const struct gguf_context * ctx, int64_t key_id);
size_t       gguf_get_arr_n   (const struct gguf_context * ctx, int64_t key_id);

const void * gguf_get_arr_data(const struct gguf_context * ctx, int64_t key_id);

const char * gguf_get_arr_str (const struct gguf_context * ctx, int64_t key_id, size_t i);

int64_t        gguf_get_n_tensors    (const struct gguf_context * ctx);
int64_t        gguf_find_tensor      (const struct gguf_context * ctx, const char * name);
size_t         gguf_get_tensor_offset(const struct gguf_context * ctx, int64_t tensor_id);
const char *   gguf_get_tensor_name  (const struct gguf_context * ctx, int64_t tensor_id);
enum ggml_type gguf_get_tensor_type  (const struct gguf_context * ctx, int64_t tensor_id);
size_t         gguf_get_tensor_size  (const struct gguf_context * ctx, int64_t tensor_id);
