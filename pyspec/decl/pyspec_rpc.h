/* csrc/pyspec_rpc.cpp: a guard around llama.cpp's RPC backend (status codes instead of
   abort() or a hang when an rpc-server is lost, silent or lying; ggml-rpc talks to each
   server through a relay of the guard's). Part of libpyspec_ext: the message
   of a PYSPEC_RPC_LOST or PYSPEC_RPC_ERROR is in pyspec_ext_last_error(). */

enum pyspec_rpc_status {
    PYSPEC_RPC_OK          =  0,
    PYSPEC_RPC_LOST        = -1,
    PYSPEC_RPC_TIMEOUT     = -2,
    PYSPEC_RPC_ERROR       = -3,
    PYSPEC_RPC_UNAVAILABLE = -4,
    PYSPEC_RPC_REFUSED     = -5,
    PYSPEC_RPC_BAD_ARG     = -6,
};

void        pyspec_rpc_guard_install(void);
int32_t     pyspec_rpc_watch(const char * endpoint);
int32_t     pyspec_rpc_relay_name(int32_t ep, char * buf, int32_t size);
int64_t     pyspec_rpc_answer_size(uint8_t cmd, uint64_t get_size);
uint64_t    pyspec_rpc_losses(int32_t ep);
int32_t     pyspec_rpc_connections(int32_t ep, bool lost);
int32_t     pyspec_rpc_check(const int32_t * eps, int32_t n_eps);
int32_t     pyspec_rpc_retire(int32_t ep);
int32_t     pyspec_rpc_region_begin(const int32_t * eps, int32_t n_eps, double timeout_s);
int32_t     pyspec_rpc_region_end(void);

ggml_backend_reg_t pyspec_rpc_add_server(const char * endpoint, int32_t ep, double timeout_s, int32_t * status);
int32_t     pyspec_rpc_dev_memory(ggml_backend_dev_t dev, size_t * free, size_t * total,
                                  const int32_t * eps, int32_t n_eps, double timeout_s);
int32_t     pyspec_rpc_decode(struct llama_context * ctx, struct llama_batch batch,
                              const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result);
int32_t     pyspec_rpc_encode(struct llama_context * ctx, struct llama_batch batch,
                              const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result);
int32_t     pyspec_rpc_process(struct llama_context * ctx, int32_t type, struct llama_batch_ext * batch,
                               const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result);
struct llama_model *   pyspec_rpc_model_load(const char * path, struct llama_model_params params,
                                             const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * status);
struct llama_context * pyspec_rpc_init_from_model(struct llama_model * model, struct llama_context_params params,
                                                  const int32_t * eps, int32_t n_eps, double timeout_s,
                                                  int32_t * status);

/* the file doors with llama.cpp's GGML_ASSERTs while reading the file failing the load
   (NULL / 1, the message in llama.cpp's log) instead of ending the process */
struct llama_model *        pyspec_model_load_checked(const char ** paths, size_t n_paths,
                                                 struct llama_model_params params);
struct llama_adapter_lora * pyspec_adapter_lora_init_checked(struct llama_model * model, const char * path);
uint32_t                    pyspec_model_quantize_checked(const char * fname_inp, const char * fname_out,
                                                          const struct llama_model_quantize_params * params);
