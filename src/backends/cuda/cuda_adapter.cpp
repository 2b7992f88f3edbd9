// cuda_adapter.cpp: the CUDA backend as a Backend. The runtime calls themselves stay in
// cuda_backend.cu (cuda_stub.cpp without nvcc); this only says how the dispatcher drives
// them: device memory, kernel by kernel on a stream, progress asked between kernels.
#include "backends/cuda/cuda_functions.h"

namespace pyfa {

namespace {

class CudaBackend final : public Backend {
public:
    int id() const override { return PYFA_BACKEND_CUDA; }
    const char* label() const override { return "CUDA"; }
    bool compiled() const override { return cuda_compiled(); }
    bool available() const override { return cuda_available(); }
    const char* unavailable_reason() const override { return cuda_unavailable_reason(); }
    int auto_rank() const override { return 1; }
    Memory memory() const override { return Memory::Device; }
    pyfa_status profile(pyfa_device_profile* profile) const override { return cuda_profile(profile); }
    pyfa_status enter_device(const char* const* names, const void* const* pointers, int count, void* stream,
                             DeviceScope* scope) const override {
        return cuda_enter_device(names, pointers, count, stream, scope);
    }
    // A cancel takes effect between kernels: the dispatcher waits for the kernels
    // launched and asks before the next (on the library's stream only; work enqueued on
    // a caller's stream cannot be taken back).
    bool polls_progress_per_kernel() const override { return true; }
    pyfa_status check_launch(int kernel, const LaunchShape& shape) const override {
        return cuda_check_launch(kernel, shape);
    }
    pyfa_status launch(int kernel, const AttentionParams& p, const LaunchShape& shape, const pyfa_config&,
                       void* stream) const override {
        return cuda_launch(kernel, p, shape, stream);
    }
    pyfa_status library_stream(void** stream) const override { return cuda_library_stream(stream); }
    pyfa_status allocate(void** ptr, size_t bytes, void* stream) const override {
        return cuda_malloc(ptr, bytes, stream);
    }
    pyfa_status deallocate(void* ptr, void* stream) const override { return cuda_free(ptr, stream); }
    pyfa_status copy_to_device(void* dst, const void* src, size_t bytes, void* stream) const override {
        return cuda_copy_to_device(dst, src, bytes, stream);
    }
    pyfa_status copy_to_host(void* dst, const void* src, size_t bytes, void* stream) const override {
        return cuda_copy_to_host(dst, src, bytes, stream);
    }
    pyfa_status synchronize(void* stream) const override { return cuda_synchronize(stream); }
    pyfa_status fold_dbias(const DbiasFold& fold, void* stream) const override {
        return cuda_fold_dbias(fold, stream);
    }
};

}  // namespace

PYFA_REGISTER_BACKEND(CudaBackend)

}  // namespace pyfa
