/* Mirrors ggml/include/ggml.h (llama.cpp e3a74b299): the part llama.h and the
   other mirrored headers use, in the header's order. Every enum here is
   complete and every struct copied field for field (tests/test_abi_headers.py
   compares them with the header). */

#define GGML_MAX_DIMS      4
#define GGML_MAX_SRC       10
#define GGML_MAX_N_THREADS 512
#define GGML_MAX_NAME      64

enum ggml_status {
    GGML_STATUS_ALLOC_FAILED = -2,
    GGML_STATUS_FAILED = -1,
    GGML_STATUS_SUCCESS = 0,
    GGML_STATUS_ABORTED = 1,
};

const char * ggml_status_to_string(enum ggml_status status);

typedef uint16_t ggml_fp16_t;
float       ggml_fp16_to_fp32(ggml_fp16_t);
ggml_fp16_t ggml_fp32_to_fp16(float);

typedef struct { uint16_t bits; } ggml_bf16_t;
ggml_bf16_t ggml_fp32_to_bf16(float);
float       ggml_bf16_to_fp32(ggml_bf16_t);

struct ggml_object;
struct ggml_context;
struct ggml_cgraph;

enum ggml_type {
    GGML_TYPE_F32     = 0,
    GGML_TYPE_F16     = 1,
    GGML_TYPE_Q4_0    = 2,
    GGML_TYPE_Q4_1    = 3,
    GGML_TYPE_Q5_0    = 6,
    GGML_TYPE_Q5_1    = 7,
    GGML_TYPE_Q8_0    = 8,
    GGML_TYPE_Q8_1    = 9,
    GGML_TYPE_Q2_K    = 10,
    GGML_TYPE_Q3_K    = 11,
    GGML_TYPE_Q4_K    = 12,
    GGML_TYPE_Q5_K    = 13,
    GGML_TYPE_Q6_K    = 14,
    GGML_TYPE_Q8_K    = 15,
    GGML_TYPE_IQ2_XXS = 16,
    GGML_TYPE_IQ2_XS  = 17,
    GGML_TYPE_IQ3_XXS = 18,
    GGML_TYPE_IQ1_S   = 19,
    GGML_TYPE_IQ4_NL  = 20,
    GGML_TYPE_IQ3_S   = 21,
    GGML_TYPE_IQ2_S   = 22,
    GGML_TYPE_IQ4_XS  = 23,
    GGML_TYPE_I8      = 24,
    GGML_TYPE_I16     = 25,
    GGML_TYPE_I32     = 26,
    GGML_TYPE_I64     = 27,
    GGML_TYPE_F64     = 28,
    GGML_TYPE_IQ1_M   = 29,
    GGML_TYPE_BF16    = 30,
    GGML_TYPE_TQ1_0   = 34,
    GGML_TYPE_TQ2_0   = 35,
    GGML_TYPE_MXFP4   = 39,
    GGML_TYPE_NVFP4   = 40,
    GGML_TYPE_Q1_0    = 41,
    GGML_TYPE_Q2_0    = 42,
    GGML_TYPE_COUNT   = 43,
};

enum ggml_op {
    GGML_OP_NONE = 0,

    GGML_OP_DUP,
    GGML_OP_ADD,
    GGML_OP_ADD_ID,
    GGML_OP_ADD1,
    GGML_OP_ACC,
    GGML_OP_SUB,
    GGML_OP_MUL,
    GGML_OP_DIV,
    GGML_OP_SQR,
    GGML_OP_SQRT,
    GGML_OP_LOG,
    GGML_OP_SIN,
    GGML_OP_COS,
    GGML_OP_SUM,
    GGML_OP_SUM_ROWS,
    GGML_OP_CUMSUM,
    GGML_OP_MEAN,
    GGML_OP_ARGMAX,
    GGML_OP_COUNT_EQUAL,
    GGML_OP_REPEAT,
    GGML_OP_REPEAT_BACK,
    GGML_OP_CONCAT,
    GGML_OP_SILU_BACK,
    GGML_OP_NORM,
    GGML_OP_RMS_NORM,
    GGML_OP_RMS_NORM_BACK,
    GGML_OP_GROUP_NORM,
    GGML_OP_L2_NORM,

    GGML_OP_MUL_MAT,
    GGML_OP_MUL_MAT_ID,
    GGML_OP_OUT_PROD,

    GGML_OP_SCALE,
    GGML_OP_SET,
    GGML_OP_CPY,
    GGML_OP_CONT,
    GGML_OP_RESHAPE,
    GGML_OP_VIEW,
    GGML_OP_PERMUTE,
    GGML_OP_TRANSPOSE,
    GGML_OP_GET_ROWS,
    GGML_OP_GET_ROWS_BACK,
    GGML_OP_SET_ROWS,
    GGML_OP_DIAG,
    GGML_OP_DIAG_MASK_INF,
    GGML_OP_DIAG_MASK_ZERO,
    GGML_OP_SOFT_MAX,
    GGML_OP_SOFT_MAX_BACK,
    GGML_OP_ROPE,
    GGML_OP_ROPE_BACK,
    GGML_OP_CLAMP,
    GGML_OP_CONV_TRANSPOSE_1D,
    GGML_OP_IM2COL,
    GGML_OP_IM2COL_BACK,
    GGML_OP_IM2COL_3D,
    GGML_OP_COL2IM_1D,
    GGML_OP_CONV_2D,
    GGML_OP_CONV_3D,
    GGML_OP_CONV_2D_DW,
    GGML_OP_CONV_TRANSPOSE_2D,
    GGML_OP_POOL_1D,
    GGML_OP_POOL_2D,
    GGML_OP_POOL_2D_BACK,
    GGML_OP_UPSCALE,
    GGML_OP_PAD,
    GGML_OP_PAD_REFLECT_1D,
    GGML_OP_ROLL,
    GGML_OP_ARANGE,
    GGML_OP_TIMESTEP_EMBEDDING,
    GGML_OP_ARGSORT,
    GGML_OP_TOP_K,
    GGML_OP_LEAKY_RELU,
    GGML_OP_TRI,
    GGML_OP_FILL,

    GGML_OP_FLASH_ATTN_EXT,
    GGML_OP_FLASH_ATTN_BACK,
    GGML_OP_SSM_CONV,
    GGML_OP_SSM_SCAN,
    GGML_OP_WIN_PART,
    GGML_OP_WIN_UNPART,
    GGML_OP_GET_REL_POS,
    GGML_OP_ADD_REL_POS,
    GGML_OP_RWKV_WKV6,
    GGML_OP_GATED_LINEAR_ATTN,
    GGML_OP_RWKV_WKV7,
    GGML_OP_SOLVE_TRI,
    GGML_OP_GATED_DELTA_NET,
    GGML_OP_LIGHTNING_INDEXER,
    GGML_OP_DSV4_HC_COMB,
    GGML_OP_DSV4_HC_PRE,
    GGML_OP_DSV4_HC_POST,

    GGML_OP_UNARY,

    GGML_OP_MAP_CUSTOM1,
    GGML_OP_MAP_CUSTOM2,
    GGML_OP_MAP_CUSTOM3,

    GGML_OP_CUSTOM,

    GGML_OP_CROSS_ENTROPY_LOSS,
    GGML_OP_CROSS_ENTROPY_LOSS_BACK,
    GGML_OP_OPT_STEP_ADAMW,
    GGML_OP_OPT_STEP_SGD,

    GGML_OP_GLU,

    GGML_OP_COUNT,
};

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE  = 0,
    GGML_LOG_LEVEL_DEBUG = 1,
    GGML_LOG_LEVEL_INFO  = 2,
    GGML_LOG_LEVEL_WARN  = 3,
    GGML_LOG_LEVEL_ERROR = 4,
    GGML_LOG_LEVEL_CONT  = 5,
};

/* a model's weights and a callback's tensors are read through this layout */
struct ggml_tensor {
    enum ggml_type type;

    struct ggml_backend_buffer * buffer;

    int64_t ne[4];
    size_t  nb[4];

    enum ggml_op op;

    int32_t op_params[16];

    int32_t flags;

    struct ggml_tensor * src[10];

    struct ggml_tensor * view_src;
    size_t               view_offs;

    void * data;

    char name[64];

    void * extra;

    char padding[8];
};

typedef bool (*ggml_abort_callback)(void * data);

typedef uint8_t ggml_guid[16];
typedef ggml_guid * ggml_guid_t;

bool ggml_guid_matches(ggml_guid_t guid_a, ggml_guid_t guid_b);

const char * ggml_version(void);
const char * ggml_commit(void);

int64_t ggml_nelements (const struct ggml_tensor * tensor);
int64_t ggml_nrows     (const struct ggml_tensor * tensor);
size_t  ggml_nbytes    (const struct ggml_tensor * tensor);

int64_t ggml_blck_size(enum ggml_type type);
size_t  ggml_type_size(enum ggml_type type);
size_t  ggml_row_size (enum ggml_type type, int64_t ne);

const char * ggml_type_name(enum ggml_type type);
const char * ggml_op_name  (enum ggml_op   op);

size_t  ggml_element_size(const struct ggml_tensor * tensor);

bool    ggml_is_quantized(enum ggml_type type);

int  ggml_n_dims       (const struct ggml_tensor * tensor);

void                  ggml_free (struct ggml_context * ctx);

struct ggml_tensor * ggml_get_first_tensor(const struct ggml_context * ctx);
struct ggml_tensor * ggml_get_next_tensor (const struct ggml_context * ctx, struct ggml_tensor * tensor);
struct ggml_tensor * ggml_get_tensor(struct ggml_context * ctx, const char * name);

const char *         ggml_get_name   (const struct ggml_tensor * tensor);

typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);

void ggml_log_get(ggml_log_callback * log_callback, void ** user_data);
void ggml_log_set(ggml_log_callback   log_callback, void *  user_data);

bool ggml_quantize_requires_imatrix(enum ggml_type type);

typedef void (*ggml_to_float_t)  (const void  * x, float * y, int64_t k);
typedef void (*ggml_from_float_t)(const float * x, void  * y, int64_t k);

enum ggml_sched_priority {
    GGML_SCHED_PRIO_LOW = -1,
    GGML_SCHED_PRIO_NORMAL,
    GGML_SCHED_PRIO_MEDIUM,
    GGML_SCHED_PRIO_HIGH,
    GGML_SCHED_PRIO_REALTIME
};

struct ggml_threadpool_params {
    bool                cpumask[512];
    int                 n_threads;
    enum ggml_sched_priority prio;
    uint32_t            poll;
    bool                strict_cpu;
    bool                paused;
};

struct ggml_threadpool;

typedef struct ggml_threadpool * ggml_threadpool_t;

struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
void                          ggml_threadpool_params_init   (struct ggml_threadpool_params * p, int n_threads);
bool                          ggml_threadpool_params_match  (const struct ggml_threadpool_params * p0, const struct ggml_threadpool_params * p1);
