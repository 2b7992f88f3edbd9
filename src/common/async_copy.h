// async_copy.h: 16-byte global-to-shared copies that run in the background (cp.async,
// sm_80 and later; below sm_80 a plain 16-byte load and store, done at once, so commit
// and wait have nothing to do there either: the same bytes land in shared memory, only
// without the overlap), and the warp-level sync the fast kernels use between a warp's own
// shared-memory writes and reads. Under the emulator a copy is a plain memcpy done at
// once (so commit and wait have nothing to do) and a warp sync is a shuffle, which every
// lane must reach before any goes on: the same ordering the GPU gives. The emulator's
// strict mode (src/backends/emu/strict.h) records each copy with its group instead, and
// reports a destination read before its wait and barrier, as the GPU would punish it.
#pragma once

#include <cstring>

#include "common/device.h"

// Device code only (warp and async-copy instructions): a __device__ function under nvcc,
// so that its host compilation pass never sees them; a plain inline one for the emulator.
#if defined(__CUDACC__)
#define PYFA_DEV __device__ __forceinline__
#else
#define PYFA_DEV inline
#endif

// Copies 16 bytes from global `src` to shared `dst` (both 16-byte aligned), or writes 16
// zero bytes when `valid` is false (rows past the end of a tensor); src is not read then.
#if defined(PYFA_EMU_STRICT)
// Strict mode records the copy, its group and its call site (src/backends/emu/strict.cpp).
PYFA_DEV void pyfa_cp_async16(float* dst, const float* src, bool valid, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    ::pyfa_emu::strict_cp_async(dst, src, valid, file, line);
}
#else
PYFA_DEV void pyfa_cp_async16(float* dst, const float* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    const int bytes = valid ? 16 : 0;  // cp.async fills the rest of the 16 bytes with zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(src), "r"(bytes)
                 : "memory");
#elif defined(__CUDA_ARCH__)
    // Turing and older: one 128-bit load and store (both pointers are 16-byte aligned).
    *reinterpret_cast<float4*>(dst) =
        valid ? *reinterpret_cast<const float4*>(src) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#else
    if (valid)
        std::memcpy(dst, src, 16);
    else
        std::memset(dst, 0, 16);
#endif
}
#endif

// Closes the group of copies issued since the last commit.
PYFA_DEV void pyfa_cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(PYFA_EMU_STRICT)
    ::pyfa_emu::strict_cp_commit();
#endif
}

// Waits until at most N of this thread's committed groups are still in flight. Other
// threads' copies become visible only after a __syncthreads that follows.
#if defined(PYFA_EMU_STRICT)
template <int N>
PYFA_DEV void pyfa_cp_async_wait(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::pyfa_emu::strict_cp_wait(N, file, line);
}
#else
template <int N>
PYFA_DEV void pyfa_cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
#endif

// Orders the shared-memory writes of a warp's lanes before their reads by other lanes of
// the same warp.
PYFA_DEV void pyfa_syncwarp() {
#if defined(__CUDACC__)
    __syncwarp();
#else
    (void)__shfl_sync(0xffffffffu, 0, 0);
#endif
}
