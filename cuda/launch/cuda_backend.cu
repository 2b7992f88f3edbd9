// cuda_backend.cu: the kernels compiled by nvcc, their launches, and the few CUDA runtime
// calls the C ABI needs. Every runtime call is checked; a failure becomes a status and a
// message naming the call, never an exit.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "kernels/registry.cuh"
#include "launch/internal.h"

namespace pyfa {

namespace {

pyfa_status cuda_fail(const char* what, cudaError_t err) {
    return fail(err == cudaErrorMemoryAllocation ? PYFA_ERROR_OUT_OF_MEMORY : PYFA_ERROR_CUDA,
                std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

#define PYFA_CUDA_CHECK(call)                                    \
    do {                                                         \
        const cudaError_t err_ = (call);                         \
        if (err_ != cudaSuccess) return cuda_fail(#call, err_); \
    } while (0)

}  // namespace

bool cuda_compiled() { return true; }

bool cuda_available() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        cudaGetLastError();  // a missing driver is an answer here, not a sticky error
        return false;
    }
    return count > 0;
}

pyfa_status cuda_profile(pyfa_device_profile* profile) {
    int dev = 0, smem = 0, threads = 0, sms = 0;
    PYFA_CUDA_CHECK(cudaGetDevice(&dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerBlock, dev));
    PYFA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    PYFA_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    std::memset(profile, 0, sizeof(*profile));
    std::strncpy(profile->name, prop.name, sizeof(profile->name) - 1);
    profile->smem_per_block = smem;
    profile->max_threads_per_block = threads;
    profile->sm_count = sms;
    return PYFA_OK;
}

pyfa_status cuda_malloc(void** ptr, size_t bytes, void* stream) {
    PYFA_CUDA_CHECK(cudaMallocAsync(ptr, bytes ? bytes : 1, static_cast<cudaStream_t>(stream)));
    return PYFA_OK;
}

void cuda_free(void* ptr, void* stream) {
    // Also called on error paths, where the first error is the one reported.
    if (ptr) cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream));
}

pyfa_status cuda_copy_to_device(void* dst, const void* src, size_t bytes) {
    PYFA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return PYFA_OK;
}

pyfa_status cuda_copy_to_host(void* dst, const void* src, size_t bytes) {
    PYFA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return PYFA_OK;
}

pyfa_status cuda_synchronize() {
    PYFA_CUDA_CHECK(cudaDeviceSynchronize());
    return PYFA_OK;
}

pyfa_status cuda_launch(int kernel, const AttentionParams& p, const LaunchShape& shape, void* stream) {
    const PYFA_KERNELS::KernelFn fn = PYFA_KERNELS::kernel_fn(kernel);
    if (!fn) return fail(PYFA_ERROR_INTERNAL, std::string("cuda: no kernel ") + kernel_name(kernel));
    // Above 48 KiB of dynamic shared memory a kernel must opt in.
    PYFA_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(shape.smem_bytes)));
    fn<<<dim3(shape.grid[0], shape.grid[1], shape.grid[2]), dim3(shape.threads),
         static_cast<size_t>(shape.smem_bytes), static_cast<cudaStream_t>(stream)>>>(p);
    PYFA_CUDA_CHECK(cudaGetLastError());
    return PYFA_OK;
}

}  // namespace pyfa
