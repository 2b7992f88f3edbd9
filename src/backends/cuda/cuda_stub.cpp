// cuda_stub.cpp: the CUDA backend of a library built without nvcc. It reports itself
// absent, so PYFA_BACKEND_AUTO picks a host backend on the host entry points and
// PYFA_BACKEND_CUDA (or AUTO on a *_device entry point) fails clearly.
#include "backends/cuda/cuda_functions.h"

namespace pyfa {

namespace {
constexpr const char* kNotBuilt = "this libpyfa was built without nvcc, so it has no CUDA backend";

pyfa_status not_built() { return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "backend: %s", kNotBuilt); }
}  // namespace

bool cuda_compiled() { return false; }
bool cuda_available() { return false; }
const char* cuda_unavailable_reason() { return kNotBuilt; }
pyfa_status cuda_profile(pyfa_device_profile*) { return not_built(); }
pyfa_status cuda_library_stream(void**) { return not_built(); }
pyfa_status cuda_check_launch(int, const LaunchShape&) { return not_built(); }
pyfa_status cuda_malloc(void**, size_t, void*) { return not_built(); }
pyfa_status cuda_free(void*, void*) { return PYFA_OK; }
pyfa_status cuda_copy_to_device(void*, const void*, size_t, void*) { return not_built(); }
pyfa_status cuda_copy_to_host(void*, const void*, size_t, void*) { return not_built(); }
pyfa_status cuda_launch(int, const AttentionParams&, const LaunchShape&, void*) { return not_built(); }
pyfa_status cuda_synchronize(void*) { return not_built(); }
pyfa_status cuda_fold_dbias(const DbiasFold&, void*) { return not_built(); }
pyfa_status cuda_enter_device(const char* const*, const void* const*, int, void*, DeviceScope*) {
    return not_built();
}
void cuda_restore_device(int) {}

}  // namespace pyfa
