// cuda_stub.cpp: the CUDA backend of a library built without nvcc. It reports itself
// absent, so PYFA_BACKEND_AUTO picks the emulator and PYFA_BACKEND_CUDA fails clearly.
#include "launch/internal.h"

namespace pyfa {

namespace {
pyfa_status not_built() {
    return fail(PYFA_ERROR_BACKEND_UNAVAILABLE,
                "backend: this libpyfa was built without nvcc, so it has no CUDA backend");
}
}  // namespace

bool cuda_compiled() { return false; }
bool cuda_available() { return false; }
pyfa_status cuda_profile(pyfa_device_profile*) { return not_built(); }
pyfa_status cuda_malloc(void**, size_t, void*) { return not_built(); }
void cuda_free(void*, void*) {}
pyfa_status cuda_copy_to_device(void*, const void*, size_t) { return not_built(); }
pyfa_status cuda_copy_to_host(void*, const void*, size_t) { return not_built(); }
pyfa_status cuda_launch(int, const AttentionParams&, const LaunchShape&, void*) { return not_built(); }
pyfa_status cuda_synchronize() { return not_built(); }

}  // namespace pyfa
