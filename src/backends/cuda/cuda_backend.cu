// cuda_backend.cu: the kernels compiled by nvcc, their launches, and the few CUDA runtime
// calls the C ABI needs. Every runtime call is checked; a failure becomes a status and a
// message naming the call, never an exit.
//
// What the process shares with other CUDA users is touched as little as possible: no
// cudaDeviceSynchronize and no legacy default stream (the host entry points run on a
// non-blocking stream of the library's own and wait for that stream alone), and the
// per-device facts (limits, name, memory-pool support, each kernel's opt-in to the
// device's dynamic shared memory) are set up once per device, under a lock, instead of
// on every call, so that two host threads never race on a kernel attribute.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "kernels/registry.cuh"
#include "backends/cuda/cuda_functions.h"

namespace pyfa {

namespace {

pyfa_status cuda_fail(const char* what, cudaError_t err) {
    return fail(err == cudaErrorMemoryAllocation ? PYFA_ERROR_OUT_OF_MEMORY : PYFA_ERROR_CUDA, "%s: %s: %s",
                what, cudaGetErrorName(err), cudaGetErrorString(err));
}

#define PYFA_CUDA_CHECK(call)                                    \
    do {                                                         \
        const cudaError_t err_ = (call);                         \
        if (err_ != cudaSuccess) return cuda_fail(#call, err_); \
    } while (0)

// Decided once per process: whether the runtime finds a driver and a GPU, and if not,
// the driver's own words for it.
struct Availability {
    bool usable;
    char reason[256];
};

const Availability& availability() {
    static const Availability a = [] {
        Availability r{};
        int count = 0;
        const cudaError_t err = cudaGetDeviceCount(&count);
        if (err != cudaSuccess) {
            std::snprintf(r.reason, sizeof(r.reason), "CUDA initialisation failed: cudaGetDeviceCount: %s: %s",
                          cudaGetErrorName(err), cudaGetErrorString(err));
            // Not sticky, but cleared so that the next unrelated check does not see it.
            (void)cudaGetLastError();
        } else if (count < 1) {
            std::snprintf(r.reason, sizeof(r.reason), "no CUDA GPU is visible (cudaGetDeviceCount: 0 devices)");
        } else {
            r.usable = true;
        }
        return r;
    }();
    return a;
}

// Kernel table rows (kernels/table.h) are 0 .. kKernelSlots - 1.
constexpr int kKernelSlots = kKernelRows;
constexpr int kMaxDevices = 64;

struct KernelLimits {
    int max_threads;       // per block, for this kernel's registers
    int64_t max_dynamic;   // bytes of dynamic shared memory after its opt-in
};

// Written once under g_setup before its `ready` flag is released; read-only after.
struct DeviceState {
    std::atomic<bool> ready;
    pyfa_device_profile profile;
    int max_grid[3];
    bool memory_pools;
    cudaStream_t stream;  // the library's own; lives as long as the process
    std::atomic<bool> kernel_ready[kKernelSlots];
    KernelLimits kernel[kKernelSlots];
};

DeviceState g_devices[kMaxDevices];
std::mutex g_setup;

pyfa_status setup_device(int dev, DeviceState& s) {
    int smem = 0, threads = 0, sms = 0, pools = 0;
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerBlock, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&s.max_grid[0], cudaDevAttrMaxGridDimX, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&s.max_grid[1], cudaDevAttrMaxGridDimY, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&s.max_grid[2], cudaDevAttrMaxGridDimZ, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev));
    cudaDeviceProp prop;
    PYFA_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    PYFA_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    std::memset(&s.profile, 0, sizeof(s.profile));
    std::strncpy(s.profile.name, prop.name, sizeof(s.profile.name) - 1);
    s.profile.smem_per_block = smem;
    s.profile.max_threads_per_block = threads;
    s.profile.sm_count = sms;
    s.memory_pools = pools != 0;
    return PYFA_OK;
}

// The calling thread's current device, set up on first use.
pyfa_status current_device(DeviceState** state) {
    int dev = 0;
    PYFA_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kMaxDevices)
        return fail(PYFA_ERROR_CUDA, "cuda: device %d: libpyfa serves devices 0 to %d", dev, kMaxDevices - 1);
    DeviceState& s = g_devices[dev];
    if (!s.ready.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(g_setup);
        if (!s.ready.load(std::memory_order_relaxed)) {
            const pyfa_status st = setup_device(dev, s);
            if (st != PYFA_OK) return st;  // nothing kept: the next call tries again
            s.ready.store(true, std::memory_order_release);
        }
    }
    *state = &s;
    return PYFA_OK;
}

// A kernel's limits on the current device; the first time, it is opted in to all the
// dynamic shared memory the device allows, so no launch ever changes the attribute.
pyfa_status kernel_limits(DeviceState& s, int kernel, KernelLimits* out) {
    const PYFA_KERNELS::KernelFn fn = PYFA_KERNELS::kernel_fn(kernel);
    if (!fn || kernel < 0 || kernel >= kKernelSlots)
        return fail(PYFA_ERROR_INTERNAL, "cuda: no kernel %s (%d)", kernel_name(kernel), kernel);
    if (!s.kernel_ready[kernel].load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(g_setup);
        if (!s.kernel_ready[kernel].load(std::memory_order_relaxed)) {
            cudaFuncAttributes attr;
            PYFA_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
            const int dynamic = static_cast<int>(s.profile.smem_per_block) - static_cast<int>(attr.sharedSizeBytes);
            if (dynamic > 0)
                PYFA_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
            s.kernel[kernel] = KernelLimits{attr.maxThreadsPerBlock, dynamic > 0 ? dynamic : 0};
            s.kernel_ready[kernel].store(true, std::memory_order_release);
        }
    }
    *out = s.kernel[kernel];
    return PYFA_OK;
}

}  // namespace

bool cuda_compiled() { return true; }

bool cuda_available() { return availability().usable; }

const char* cuda_unavailable_reason() { return availability().reason; }

pyfa_status cuda_profile(pyfa_device_profile* profile) {
    DeviceState* s = nullptr;
    const pyfa_status st = current_device(&s);
    if (st != PYFA_OK) return st;
    *profile = s->profile;
    return PYFA_OK;
}

pyfa_status cuda_library_stream(void** stream) {
    DeviceState* s = nullptr;
    const pyfa_status st = current_device(&s);
    if (st != PYFA_OK) return st;
    *stream = s->stream;
    return PYFA_OK;
}

pyfa_status cuda_check_launch(int kernel, const LaunchShape& shape) {
    DeviceState* s = nullptr;
    KernelLimits lim;
    pyfa_status st = current_device(&s);
    if (st != PYFA_OK || (st = kernel_limits(*s, kernel, &lim)) != PYFA_OK) return st;
    if (static_cast<int64_t>(shape.threads) > lim.max_threads)
        return fail(PYFA_ERROR_CUDA, "%s: %u threads per block, but on %s this kernel allows %d (its registers)",
                    kernel_name(kernel), shape.threads, s->profile.name, lim.max_threads);
    if (shape.smem_bytes < 0 || shape.smem_bytes > lim.max_dynamic)
        return fail(PYFA_ERROR_TILE_TOO_LARGE,
                    "%s: %lld bytes of dynamic shared memory, but on %s this kernel can have %lld",
                    kernel_name(kernel), static_cast<long long>(shape.smem_bytes), s->profile.name,
                    static_cast<long long>(lim.max_dynamic));
    for (int a = 0; a < 3; ++a)
        if (shape.grid[a] < 1 || shape.grid[a] > static_cast<unsigned>(s->max_grid[a]))
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: grid dimension %c = %u, but %s allows 1 to %d",
                        kernel_name(kernel), "xyz"[a], shape.grid[a], s->profile.name, s->max_grid[a]);
    return PYFA_OK;
}

pyfa_status cuda_malloc(void** ptr, size_t bytes, void* stream) {
    DeviceState* s = nullptr;
    const pyfa_status st = current_device(&s);
    if (st != PYFA_OK) return st;
    if (s->memory_pools)
        PYFA_CUDA_CHECK(cudaMallocAsync(ptr, bytes ? bytes : 1, static_cast<cudaStream_t>(stream)));
    else
        PYFA_CUDA_CHECK(cudaMalloc(ptr, bytes ? bytes : 1));
    return PYFA_OK;
}

pyfa_status cuda_free(void* ptr, void* stream) {
    if (!ptr) return PYFA_OK;
    DeviceState* s = nullptr;
    const pyfa_status st = current_device(&s);
    if (st != PYFA_OK) return st;
    // Without memory pools cudaFree waits for the device's pending work before it frees.
    if (s->memory_pools)
        PYFA_CUDA_CHECK(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)));
    else
        PYFA_CUDA_CHECK(cudaFree(ptr));
    return PYFA_OK;
}

pyfa_status cuda_copy_to_device(void* dst, const void* src, size_t bytes, void* stream) {
    PYFA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
    return PYFA_OK;
}

pyfa_status cuda_copy_to_host(void* dst, const void* src, size_t bytes, void* stream) {
    PYFA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
    return PYFA_OK;
}

pyfa_status cuda_synchronize(void* stream) {
    PYFA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    return PYFA_OK;
}

pyfa_status cuda_launch(int kernel, const AttentionParams& p, const LaunchShape& shape, void* stream) {
    const PYFA_KERNELS::KernelFn fn = PYFA_KERNELS::kernel_fn(kernel);
    if (!fn) return fail(PYFA_ERROR_INTERNAL, "cuda: no kernel %s (%d)", kernel_name(kernel), kernel);
    AttentionParams arg = p;
    void* args[] = {&arg};
    PYFA_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(fn),
                                     dim3(shape.grid[0], shape.grid[1], shape.grid[2]), dim3(shape.threads),
                                     args, static_cast<size_t>(shape.smem_bytes),
                                     static_cast<cudaStream_t>(stream)));
    return PYFA_OK;
}

}  // namespace pyfa
