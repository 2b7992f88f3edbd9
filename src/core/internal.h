// internal.h: what the C ABI (api.cpp) needs from the backends and the tile rules.
// Not installed; the public interface is include/pyfa.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/params.h"
#include "pyfa.h"

namespace pyfa {

// Longest last-error message kept (bytes, with the terminating NUL); longer ones are cut.
constexpr size_t kMaxErrorLength = 1024;

// Sets this thread's last-error message, printf-style, and returns `status`, so that a
// failing check reads `return fail(PYFA_ERROR_..., "q: ...")`. Never allocates or
// throws: it is what reports a failed allocation.
pyfa_status fail(pyfa_status status, const char* format, ...) __attribute__((format(printf, 2, 3)));
// For a caller that already holds its message in a string.
pyfa_status fail(pyfa_status status, const std::string& message);
void clear_error();

// The launch geometry of one kernel for one problem.
struct LaunchShape {
    unsigned grid[3];
    unsigned threads;
    int64_t smem_bytes;
};

// Grid, block and shared memory of `kernel` (a pyfa_kernel) for params p, whose tiles
// have been checked by fits() and whose tile counts fit a grid dimension.
LaunchShape launch_shape(int kernel, const AttentionParams& p);

// Exact shared-memory bytes of a kernel's layout, or -1 for an unknown kernel, a size
// below 1, or a size that does not fit in int64_t.
int64_t smem_bytes(int kernel, int64_t Br, int64_t Bc, int64_t d);
// The layout fits in `limit` bytes (false when its size overflows).
bool smem_fits(int kernel, int64_t Br, int64_t Bc, int64_t d, int64_t limit);
// The layout's terms spelled out for messages ("Q_i 16384 + K_j 16640 + ..."), written
// into buf (cut at size).
void smem_breakdown(int kernel, int64_t Br, int64_t Bc, int64_t d, char* buf, size_t size);
const char* kernel_name(int kernel);
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int* Br, int* Bc);
// The default for the sides the caller left free (fixed_br, fixed_bc: 0), given the others.
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int fixed_br,
                          int fixed_bc, int* Br, int* Bc);

// Variants (kernels/table.h). `kernel` is a pyfa_kernel; ids returned are table rows,
// which launch_shape, smem_bytes, kernel_name and the backends take like a pyfa_kernel.
// The row that runs `kernel` for p under `variant`: the reference (*id = kernel, tiles
// left for kernel_tiles) or a fast row with its tiles in *Br, *Bc. want_br, want_bc: the
// caller's tiles (0: default); aligned: every tensor 16-byte aligned with row strides a
// multiple of 4. PYFA_VARIANT_FAST where no fast row applies is an error naming why.
pyfa_status select_kernel(int kernel, int variant, const AttentionParams& p, int want_br, int want_bc,
                          bool aligned, const pyfa_device_profile& profile, int* id, int* Br, int* Bc);
pyfa_status variant_default_tiles(int kernel, int variant, int64_t d, const pyfa_device_profile& profile,
                                  int* Br, int* Bc);
// -1 where the variant has no kernel for these tiles.
int64_t variant_smem_bytes(int kernel, int variant, int64_t Br, int64_t Bc, int64_t d);

// ---- the emulator
pyfa_status emu_profile(pyfa_device_profile* profile);
pyfa_status emu_launch(int kernel, const AttentionParams& p, const LaunchShape& shape,
                       const pyfa_config& config);

// ---- the cpu backend (src/backends/cpu): the emulator's profile, and one call per operation
// (the kernels of an op in launch order, each with its tiles), since it may fuse them.
pyfa_status cpu_profile(pyfa_device_profile* profile);
pyfa_status cpu_run(const int* kernels, const AttentionParams* params, size_t count,
                    const pyfa_config& config);

// ---- CUDA (cuda_backend.cu, or cuda_stub.cpp when built without nvcc). Every function
// acts on the calling thread's current device.
bool cuda_compiled();
// Compiled in, the driver initialised and a GPU present; decided once per process.
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

}  // namespace pyfa
