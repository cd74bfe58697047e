/* Subset of ggml/include/ggml.h and ggml-backend.h that pyspec uses. */

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE  = 0,
    GGML_LOG_LEVEL_DEBUG = 1,
    GGML_LOG_LEVEL_INFO  = 2,
    GGML_LOG_LEVEL_WARN  = 3,
    GGML_LOG_LEVEL_ERROR = 4,
    GGML_LOG_LEVEL_CONT  = 5,
};

/* only the values pyspec names; the C enum is wider (an enum is an int here) */
enum ggml_type {
    GGML_TYPE_F32  = 0,
    GGML_TYPE_F16  = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_BF16 = 30,
};


typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);

struct ggml_tensor;
struct ggml_cgraph;
struct ggml_context;

typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);

enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU,
    GGML_BACKEND_DEVICE_TYPE_GPU,
    GGML_BACKEND_DEVICE_TYPE_IGPU,
    GGML_BACKEND_DEVICE_TYPE_ACCEL,
    GGML_BACKEND_DEVICE_TYPE_META,
};

void ggml_log_set(ggml_log_callback log_callback, void * user_data);
const char * ggml_type_name(enum ggml_type type);

const char *               ggml_backend_reg_name(ggml_backend_reg_t reg);

size_t                     ggml_backend_reg_count(void);
ggml_backend_reg_t         ggml_backend_reg_get(size_t index);

size_t                     ggml_backend_dev_count(void);
ggml_backend_dev_t         ggml_backend_dev_get(size_t index);
const char *               ggml_backend_dev_name(ggml_backend_dev_t device);
const char *               ggml_backend_dev_description(ggml_backend_dev_t device);
void                       ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);

void                       ggml_backend_load_all_from_path(const char * dir_path);
