// internal.h: what the C ABI (api.cpp) needs from the backends and the tile rules.
// Not installed; the public interface is include/pyfa.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/params.h"
#include "pyfa.h"

namespace pyfa {

// Sets this thread's last-error message and returns `status`, so that a failing check
// reads `return fail(PYFA_ERROR_..., "q: ...")`.
pyfa_status fail(pyfa_status status, const std::string& message);
void clear_error();

// The launch geometry of one kernel for one problem.
struct LaunchShape {
    unsigned grid[3];
    unsigned threads;
    int64_t smem_bytes;
};

// Grid, block and shared memory of `kernel` (a pyfa_kernel) for params p (tiles set).
LaunchShape launch_shape(int kernel, const AttentionParams& p);

// Shared-memory bytes of a kernel, and its layout's terms spelled out for messages.
int64_t smem_bytes(int kernel, int64_t Br, int64_t Bc, int64_t d);
std::string smem_breakdown(int kernel, int64_t Br, int64_t Bc, int64_t d);
const char* kernel_name(int kernel);
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int* Br, int* Bc);

// ---- the emulator
pyfa_status emu_profile(pyfa_device_profile* profile);
pyfa_status emu_launch(int kernel, const AttentionParams& p, const LaunchShape& shape,
                       const pyfa_config& config);

// ---- the cpu backend (cuda/cpu): the emulator's profile, and one call per operation
// (the kernels of an op in launch order, each with its tiles), since it may fuse them.
pyfa_status cpu_profile(pyfa_device_profile* profile);
pyfa_status cpu_run(const int* kernels, const AttentionParams* params, size_t count,
                    const pyfa_config& config);

// ---- CUDA (cuda_backend.cu, or cuda_stub.cpp when built without nvcc)
bool cuda_compiled();
bool cuda_available();
pyfa_status cuda_profile(pyfa_device_profile* profile);
// Stream-ordered, so scratch freed right after an asynchronous launch stays valid for it.
pyfa_status cuda_malloc(void** ptr, size_t bytes, void* stream);
void cuda_free(void* ptr, void* stream);
pyfa_status cuda_copy_to_device(void* dst, const void* src, size_t bytes);
pyfa_status cuda_copy_to_host(void* dst, const void* src, size_t bytes);
pyfa_status cuda_launch(int kernel, const AttentionParams& p, const LaunchShape& shape, void* stream);
pyfa_status cuda_synchronize();

}  // namespace pyfa
