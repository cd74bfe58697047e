/* Mirrors ggml/include/ggml-opt.h (llama.cpp e3a74b299): the types that the
   training entry points of llama.h (llama_opt_init, llama_opt_epoch) take, and
   the dataset / result objects they work on, in the header's order. */

struct ggml_opt_dataset;
struct ggml_opt_context;
struct ggml_opt_result;

typedef struct ggml_opt_dataset * ggml_opt_dataset_t;
typedef struct ggml_opt_context * ggml_opt_context_t;
typedef struct ggml_opt_result  * ggml_opt_result_t;

enum ggml_opt_loss_type {
    GGML_OPT_LOSS_TYPE_MEAN,
    GGML_OPT_LOSS_TYPE_SUM,
    GGML_OPT_LOSS_TYPE_CROSS_ENTROPY,
    GGML_OPT_LOSS_TYPE_MEAN_SQUARED_ERROR,
};

ggml_opt_dataset_t ggml_opt_dataset_init(
        enum ggml_type type_data,
        enum ggml_type type_label,
        int64_t        ne_datapoint,
        int64_t        ne_label,
        int64_t        ndata,
        int64_t        ndata_shard);
void ggml_opt_dataset_free(ggml_opt_dataset_t dataset);

int64_t              ggml_opt_dataset_ndata (ggml_opt_dataset_t dataset);
struct ggml_tensor * ggml_opt_dataset_data  (ggml_opt_dataset_t dataset);
struct ggml_tensor * ggml_opt_dataset_labels(ggml_opt_dataset_t dataset);

enum ggml_opt_build_type {
    GGML_OPT_BUILD_TYPE_FORWARD = 10,
    GGML_OPT_BUILD_TYPE_GRAD    = 20,
    GGML_OPT_BUILD_TYPE_OPT     = 30,
};

enum ggml_opt_optimizer_type {
    GGML_OPT_OPTIMIZER_TYPE_ADAMW,
    GGML_OPT_OPTIMIZER_TYPE_SGD,

    GGML_OPT_OPTIMIZER_TYPE_COUNT
};

struct ggml_opt_optimizer_params {
    struct {
        float alpha;
        float beta1;
        float beta2;
        float eps;
        float wd;
    } adamw;
    struct {
        float alpha;
        float wd;
    } sgd;
};

typedef struct ggml_opt_optimizer_params (*ggml_opt_get_optimizer_params)(void * userdata);

struct ggml_opt_optimizer_params ggml_opt_get_default_optimizer_params(void * userdata);

struct ggml_opt_optimizer_params ggml_opt_get_constant_optimizer_params(void * userdata);

const char * ggml_opt_optimizer_name(enum ggml_opt_optimizer_type);

ggml_opt_result_t ggml_opt_result_init(void);
void ggml_opt_result_free(ggml_opt_result_t result);
void ggml_opt_result_reset(ggml_opt_result_t result);

void ggml_opt_result_ndata(   ggml_opt_result_t result, int64_t * ndata);
void ggml_opt_result_loss(    ggml_opt_result_t result, double  * loss,     double * unc);
void ggml_opt_result_pred(    ggml_opt_result_t result, int32_t * pred);
void ggml_opt_result_accuracy(ggml_opt_result_t result, double  * accuracy, double * unc);

typedef void (*ggml_opt_epoch_callback)(
        bool               train,
        ggml_opt_context_t opt_ctx,
        ggml_opt_dataset_t dataset,
        ggml_opt_result_t  result,
        int64_t            ibatch,
        int64_t            ibatch_max,
        int64_t            t_start_us);

void ggml_opt_epoch_callback_progress_bar(
        bool               train,
        ggml_opt_context_t opt_ctx,
        ggml_opt_dataset_t dataset,
        ggml_opt_result_t  result,
        int64_t            ibatch,
        int64_t            ibatch_max,
        int64_t            t_start_us);
