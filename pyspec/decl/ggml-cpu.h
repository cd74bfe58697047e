/* Mirrors ggml/include/ggml-cpu.h (llama.cpp e3a74b299), the whole header in its
   order: NUMA, threadpools, graph compute, CPU features, the CPU backend.

   The functions live in the CPU backend library. When that library is loaded at
   run time (GGML_BACKEND_DL builds) they are not reachable through the ggml
   handle: pyspec.core.threadpool fetches the threadpool functions with
   ggml_backend_reg_get_proc_address and calls them through these types. */

struct ggml_cplan {
    size_t    work_size;
    uint8_t * work_data;

    int n_threads;
    struct ggml_threadpool * threadpool;

    ggml_abort_callback abort_callback;
    void *              abort_callback_data;

    bool use_ref;
};

enum ggml_numa_strategy {
    GGML_NUMA_STRATEGY_DISABLED   = 0,
    GGML_NUMA_STRATEGY_DISTRIBUTE = 1,
    GGML_NUMA_STRATEGY_ISOLATE    = 2,
    GGML_NUMA_STRATEGY_NUMACTL    = 3,
    GGML_NUMA_STRATEGY_MIRROR     = 4,
    GGML_NUMA_STRATEGY_COUNT
};

void    ggml_numa_init(enum ggml_numa_strategy numa);
bool    ggml_is_numa(void);

struct ggml_tensor * ggml_new_i32(struct ggml_context * ctx, int32_t value);
struct ggml_tensor * ggml_new_f32(struct ggml_context * ctx, float value);

struct ggml_tensor * ggml_set_i32 (struct ggml_tensor * tensor, int32_t value);
struct ggml_tensor * ggml_set_f32 (struct ggml_tensor * tensor, float value);

int32_t ggml_get_i32_1d(const struct ggml_tensor * tensor, int i);
void    ggml_set_i32_1d(const struct ggml_tensor * tensor, int i, int32_t value);

int32_t ggml_get_i32_nd(const struct ggml_tensor * tensor, int i0, int i1, int i2, int i3);
void    ggml_set_i32_nd(const struct ggml_tensor * tensor, int i0, int i1, int i2, int i3, int32_t value);

float   ggml_get_f32_1d(const struct ggml_tensor * tensor, int i);
void    ggml_set_f32_1d(const struct ggml_tensor * tensor, int i, float value);

float   ggml_get_f32_nd(const struct ggml_tensor * tensor, int i0, int i1, int i2, int i3);
void    ggml_set_f32_nd(const struct ggml_tensor * tensor, int i0, int i1, int i2, int i3, float value);

struct ggml_threadpool *      ggml_threadpool_new           (struct ggml_threadpool_params  * params);
void                          ggml_threadpool_free          (struct ggml_threadpool * threadpool);
int                           ggml_threadpool_get_n_threads (struct ggml_threadpool * threadpool);
void                          ggml_threadpool_pause         (struct ggml_threadpool * threadpool);
void                          ggml_threadpool_resume        (struct ggml_threadpool * threadpool);

struct ggml_cplan ggml_graph_plan(
              const struct ggml_cgraph * cgraph,
                                   int   n_threads,
                struct ggml_threadpool * threadpool);
enum ggml_status  ggml_graph_compute(struct ggml_cgraph * cgraph, struct ggml_cplan * cplan);

enum ggml_status  ggml_graph_compute_with_ctx(struct ggml_context * ctx, struct ggml_cgraph * cgraph, int n_threads);

int ggml_cpu_has_sse3       (void);
int ggml_cpu_has_ssse3      (void);
int ggml_cpu_has_avx        (void);
int ggml_cpu_has_avx_vnni   (void);
int ggml_cpu_has_avx2       (void);
int ggml_cpu_has_bmi2       (void);
int ggml_cpu_has_f16c       (void);
int ggml_cpu_has_fma        (void);
int ggml_cpu_has_avx512     (void);
int ggml_cpu_has_avx512_vbmi(void);
int ggml_cpu_has_avx512_vnni(void);
int ggml_cpu_has_avx512_bf16(void);
int ggml_cpu_has_amx_int8   (void);

int ggml_cpu_has_neon       (void);
int ggml_cpu_has_arm_fma    (void);
int ggml_cpu_has_fp16_va    (void);
int ggml_cpu_has_dotprod    (void);
int ggml_cpu_has_matmul_int8(void);
int ggml_cpu_has_sve        (void);
int ggml_cpu_get_sve_cnt    (void);
int ggml_cpu_has_sme        (void);
int ggml_cpu_has_sme2       (void);

int ggml_cpu_has_riscv_v    (void);
int ggml_cpu_get_rvv_vlen   (void);
int ggml_cpu_has_vsx        (void);
int ggml_cpu_has_vxe        (void);
int ggml_cpu_has_wasm_simd  (void);
int ggml_cpu_has_llamafile  (void);

typedef void (*ggml_vec_dot_t)  (int n, float * s, size_t bs, const void * x, size_t bx,
                                   const void * y, size_t by, int nrc);

struct ggml_type_traits_cpu {
    ggml_from_float_t        from_float;
    ggml_vec_dot_t           vec_dot;
    enum ggml_type           vec_dot_type;
    int64_t                  nrows;
};

const struct ggml_type_traits_cpu * ggml_get_type_traits_cpu(enum ggml_type type);

void ggml_cpu_init(void);

ggml_backend_t ggml_backend_cpu_init(void);

bool ggml_backend_is_cpu                (ggml_backend_t backend);
void ggml_backend_cpu_set_n_threads     (ggml_backend_t backend_cpu, int n_threads);
void ggml_backend_cpu_set_threadpool    (ggml_backend_t backend_cpu, ggml_threadpool_t threadpool);
void ggml_backend_cpu_set_abort_callback(ggml_backend_t backend_cpu, ggml_abort_callback abort_callback, void * abort_callback_data);

void ggml_backend_cpu_set_use_ref(ggml_backend_t backend_cpu, bool use_ref);

ggml_backend_reg_t ggml_backend_cpu_reg(void);

void ggml_cpu_fp32_to_fp32(const float *,       float *, int64_t);
void ggml_cpu_fp32_to_i32 (const float *,     int32_t *, int64_t);
void ggml_cpu_fp32_to_fp16(const float *, ggml_fp16_t *, int64_t);
void ggml_cpu_fp16_to_fp32(const ggml_fp16_t *, float *, int64_t);
void ggml_cpu_fp32_to_bf16(const float *, ggml_bf16_t *, int64_t);
void ggml_cpu_bf16_to_fp32(const ggml_bf16_t *, float *, int64_t);
