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
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "backends/cuda/cuda_functions.h"
#include "backends/cuda/device_rules.h"
#include "kernels/registry.cuh"

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

// The architectures this file was compiled for (nvcc's __CUDA_ARCH_LIST__, e.g. 750,800,900),
// as CMAKE_CUDA_ARCHITECTURES spells them ("75 80 90"), for device_rules.h.
#if !defined(__CUDA_ARCH_LIST__)
#error "nvcc 11.5 or later is needed (__CUDA_ARCH_LIST__ names the architectures built)"
#endif
constexpr int kBuiltArchs[] = {__CUDA_ARCH_LIST__};

const char* built_archs() {
    static const std::string list = [] {
        std::string r;
        for (int a : kBuiltArchs) r += (r.empty() ? "" : " ") + std::to_string(a / 10);
        return r;
    }();
    return list.c_str();
}

// The kernel-image check: cudaFuncGetAttributes on one kernel, on the current device. It
// fails (cudaErrorNoKernelImageForDevice) where the build has neither SASS the device
// runs nor PTX its driver can compile.
cudaError_t image_loads() {
    cudaFuncAttributes attr;
    const cudaError_t err = cudaFuncGetAttributes(&attr, PYFA_KERNELS::kernel_fn(0));
    if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky; cleared for the next check
    return err;
}

// Decided once per process: whether the runtime finds a driver and a GPU this build can
// run on (device_rules.h), and if not, why. The current device is the one asked (the one
// a host call runs on); where it cannot run them, the first visible device that can makes
// CUDA available, for calls on that device, and the current one is refused when used.
struct Availability {
    bool usable;
    char reason[512];
};

// Whether device `dev` runs this build's kernels; reason[size] says why not. The image
// check runs with `dev` current, and `current` is made current again.
bool examine(int dev, int current, char* reason, size_t size) {
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, dev);
    if (err != cudaSuccess) {
        std::snprintf(reason, size, "CUDA device %d: cudaGetDeviceProperties: %s: %s", dev, cudaGetErrorName(err),
                      cudaGetErrorString(err));
        (void)cudaGetLastError();
        return false;
    }
    DeviceFacts f{dev, prop.name, prop.major, prop.minor, false, ""};
    bool known = false;
    if (arch_supported(built_archs(), f.major, f.minor, &known)) {
        if (dev != current) err = cudaSetDevice(dev);
        const cudaError_t image = err == cudaSuccess ? image_loads() : err;
        f.image_loads = image == cudaSuccess;
        f.image_error = f.image_loads ? "" : cudaGetErrorName(image);
        if (dev != current && cudaSetDevice(current) != cudaSuccess) (void)cudaGetLastError();
    }
    return device_usable(f, built_archs(), reason, size);
}

const Availability& availability() {
    static const Availability a = [] {
        Availability r{};
        int count = 0, current = 0;
        cudaError_t err = cudaGetDeviceCount(&count);
        if (err == cudaSuccess) err = cudaGetDevice(&current);
        if (err != cudaSuccess) {
            std::snprintf(r.reason, sizeof(r.reason), "CUDA initialisation failed: %s: %s",
                          cudaGetErrorName(err), cudaGetErrorString(err));
            // Not sticky, but cleared so that the next unrelated check does not see it.
            (void)cudaGetLastError();
        } else if (count < 1) {
            std::snprintf(r.reason, sizeof(r.reason), "no CUDA GPU is visible (cudaGetDeviceCount: 0 devices)");
        } else if (examine(current, current, r.reason, sizeof(r.reason))) {
            r.usable = true;
        } else {
            // r.reason keeps the current device's, for when no other device serves.
            char other[sizeof(r.reason)];
            for (int dev = 0; dev < count && !r.usable; ++dev)
                r.usable = dev != current && examine(dev, current, other, sizeof(other));
            if (r.usable) r.reason[0] = '\0';
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
    cudaMemPool_t pool;   // the library's own, where memory_pools; lives as long as the process
    cudaStream_t stream;  // the library's own; lives as long as the process
    std::atomic<bool> kernel_ready[kKernelSlots];
    KernelLimits kernel[kKernelSlots];
};

DeviceState g_devices[kMaxDevices];
std::mutex g_setup;

// How much freed memory the library's pool keeps for the next call instead of handing it
// back to the driver at each synchronization: a quarter of the device's memory, enough
// for the staging buffers of the calls a program repeats, and little enough that the
// rest of a process's GPU work is not starved of it.
constexpr size_t kPoolKeepDivisor = 4;

pyfa_status setup_device(int dev, DeviceState& s) {
    {
        char reason[512];
        if (!examine(dev, dev, reason, sizeof(reason)))
            return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "cuda: %s", reason);
    }
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
    if (pools) {
        // A pool of the library's own, so that keeping memory between calls changes
        // nothing for the process's other users of the device's default pool.
        cudaMemPoolProps props{};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = dev;
        PYFA_CUDA_CHECK(cudaMemPoolCreate(&s.pool, &props));
        uint64_t keep = prop.totalGlobalMem / kPoolKeepDivisor;
        const cudaError_t err = cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReleaseThreshold, &keep);
        if (err != cudaSuccess) {
            (void)cudaMemPoolDestroy(s.pool);  // the setup fails with err's message either way
            return cuda_fail("cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)", err);
        }
    }
    const cudaError_t err = cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
        if (pools) (void)cudaMemPoolDestroy(s.pool);  // the setup fails with err's message either way
        return cuda_fail("cudaStreamCreateWithFlags", err);
    }
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
        PYFA_CUDA_CHECK(cudaMallocFromPoolAsync(ptr, bytes ? bytes : 1, s->pool, static_cast<cudaStream_t>(stream)));
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

pyfa_status cuda_enter_device(const char* const* names, const void* const* pointers, int count, void* stream,
                              DeviceScope* scope) {
    constexpr int kMaxTensors = 16;
    if (count < 1 || count > kMaxTensors)
        return fail(PYFA_ERROR_INTERNAL, "cuda_enter_device: %d tensors (1 to %d)", count, kMaxTensors);
    PointerFacts facts[kMaxTensors];
    for (int t = 0; t < count; ++t) {
        cudaPointerAttributes attr;
        const cudaError_t err = cudaPointerGetAttributes(&attr, pointers[t]);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: not a pointer CUDA knows: cudaPointerGetAttributes: %s: %s",
                        names[t], cudaGetErrorName(err), cudaGetErrorString(err));
        }
        const MemoryKind kind = attr.type == cudaMemoryTypeDevice    ? MemoryKind::kDevice
                                : attr.type == cudaMemoryTypeManaged ? MemoryKind::kManaged
                                                                     : MemoryKind::kHost;
        facts[t] = PointerFacts{names[t], kind, attr.device};
    }
    // The default streams (legacy and per-thread) follow the current device; any other
    // stream belongs to one device. cudaStreamGetDevice came with CUDA 12.8: built with an
    // older runtime, or run on a driver without it, the stream's device goes unchecked.
    int stream_device = -1;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (s != nullptr && s != cudaStreamLegacy && s != cudaStreamPerThread) {
#if CUDART_VERSION >= 12080
        const cudaError_t err = cudaStreamGetDevice(s, &stream_device);
        if (err == cudaErrorCallRequiresNewerDriver || err == cudaErrorNotSupported) {
            (void)cudaGetLastError();
            stream_device = -1;
        } else if (err != cudaSuccess) {
            (void)cudaGetLastError();
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "stream: cudaStreamGetDevice: %s: %s", cudaGetErrorName(err),
                        cudaGetErrorString(err));
        }
#endif
    }
    int device = 0;
    char why[256];
    if (!owning_device(facts, count, stream_device, &device, why, sizeof(why)))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s", why);
    int current = 0;
    PYFA_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) {
        PYFA_CUDA_CHECK(cudaSetDevice(device));
        scope->restore = cuda_restore_device;
        scope->previous = current;
    }
    return PYFA_OK;
}

void cuda_restore_device(int previous) {
    // The call's status is decided by now; making current again a device that was current
    // a moment ago has nothing left to fail on, so its result is not reported.
    if (previous >= 0) (void)cudaSetDevice(previous);
}

__global__ void dbias_fold_kernel(const DbiasFold fold) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e < fold.elems()) fold.out[e] = dbias_fold_at(fold, e);
}

pyfa_status cuda_fold_dbias(const DbiasFold& fold, void* stream) {
    constexpr int kThreads = 256;
    const int64_t blocks = (fold.elems() + kThreads - 1) / kThreads;
    if (blocks > 0x7fffffff) return fail(PYFA_ERROR_INVALID_ARGUMENT, "dbias: more than 2^31-1 blocks to fold");
    dbias_fold_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(fold);
    PYFA_CUDA_CHECK(cudaGetLastError());
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
