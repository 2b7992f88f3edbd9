// cuda_functions.h: the CUDA runtime calls the CUDA backend is made of, defined by
// cuda_backend.cu (or cuda_stub.cpp when built without nvcc, or a test's fake) and
// wrapped into the Backend interface by cuda_adapter.cpp.
#pragma once

#include "core/internal.h"

namespace pyfa {

// Every function acts on the calling thread's current device (a *_device call's:
// cuda_enter_device).
bool cuda_compiled();
// Compiled in, the driver initialised, and a GPU present whose architecture this build
// has kernels for and on which a kernel image loads (device_rules.h); decided once per
// process.
bool cuda_available();
// Why cuda_available() is false ("" when it is true): for a failed initialisation the
// driver's error name and string. Computed once; the pointer stays valid.
const char* cuda_unavailable_reason();
pyfa_status cuda_profile(pyfa_device_profile* profile);
// The library's own non-blocking stream on the current device, created once per device:
// the host entry points work on it and synchronize only it.
pyfa_status cuda_library_stream(void** stream);
// Checks that `kernel` can be launched with `shape` on the current device (threads,
// dynamic shared memory against the kernel's own limits, grid), opting the kernel in to
// the device's maximum dynamic shared memory the first time. Launches nothing.
pyfa_status cuda_check_launch(int kernel, const LaunchShape& shape);
// Stream-ordered where the device has memory pools, so scratch freed right after an
// asynchronous launch stays valid for it; cudaMalloc and cudaFree elsewhere.
pyfa_status cuda_malloc(void** ptr, size_t bytes, void* stream);
pyfa_status cuda_free(void* ptr, void* stream);
pyfa_status cuda_copy_to_device(void* dst, const void* src, size_t bytes, void* stream);
pyfa_status cuda_copy_to_host(void* dst, const void* src, size_t bytes, void* stream);
// Enqueues the kernel on `stream`; the shape must have passed cuda_check_launch.
pyfa_status cuda_launch(int kernel, const AttentionParams& p, const LaunchShape& shape, void* stream);
// Waits for `stream` alone and reports the first error of the work on it.
pyfa_status cuda_synchronize(void* stream);
// Enqueues dBias's fold (issue 27) on `stream`: one thread per element of fold.out.
pyfa_status cuda_fold_dbias(const DbiasFold& fold, void* stream);
// For a *_device call: finds the device that owns pointers[0] (q) with
// cudaPointerGetAttributes, refuses host memory, another device's memory or a stream of
// another device (PYFA_ERROR_INVALID_ARGUMENT naming the tensor; device_rules.h), and
// makes that device current until `scope` goes (its restore is cuda_restore_device).
// names[t] names pointers[t] in messages.
pyfa_status cuda_enter_device(const char* const* names, const void* const* pointers, int count, void* stream,
                              DeviceScope* scope);
// Puts back the device that was current before cuda_enter_device switched; a no-op
// where none was switched (previous < 0).
void cuda_restore_device(int previous);

}  // namespace pyfa
