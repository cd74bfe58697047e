/* The device and registry part of ggml/include/ggml-backend.h (llama.cpp e3a74b299) that
   pyspec.core.backend and pyspec.core.rpc use beyond ggml.h's (issue 15). The full
   ggml-backend.h declarations (issue 13) supersede this file. */

struct ggml_backend_dev_caps {
    bool async;
    bool host_buffer;
    bool buffer_from_host_ptr;
    bool events;
};

struct ggml_backend_dev_props {
    const char * name;
    const char * description;
    size_t memory_free;
    size_t memory_total;
    enum ggml_backend_dev_type type;
    const char * device_id;
    struct ggml_backend_dev_caps caps;
};

void               ggml_backend_dev_get_props(ggml_backend_dev_t device, struct ggml_backend_dev_props * props);
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);

size_t             ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
