// device.h: the one place that differs between the two compilations of a kernel file.
// Under nvcc the kernels are CUDA; under a host C++ compiler they run on the emulator
// (src/backends/emu), which provides threadIdx, __syncthreads, shuffles and dynamic shared memory.
#pragma once

#include <cstdint>

// The kernels are compiled twice into one library, once per backend; each compilation
// puts them in its own namespace so that the two definitions never meet at link time.
#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define PYFA_KERNELS pyfa_cuda_kernels
#define PYFA_HD __host__ __device__ __forceinline__
// A byte array, not float: nvcc rejects one extern __shared__ name declared with two
// element types in one translation unit.
#define PYFA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
#include "backends/emu/emu.h"
#if defined(PYFA_EMU_STRICT)
// The emulator's strict mode runs its own, instrumented compilation of the kernels
// (src/backends/emu/emu_strict_kernels.cpp).
#define PYFA_KERNELS pyfa_emu_strict_kernels
#else
#define PYFA_KERNELS pyfa_emu_kernels
#endif
#define PYFA_HD inline
#define PYFA_DYNAMIC_SMEM(name) unsigned char* name = ::pyfa_emu::dynamic_smem()
#endif

// On a function of these headers that the cpu backend calls on its GCC vectors: always
// inlined. Its portable and AVX2 files both use 8-lane vectors, passed in memory in one
// and in ymm registers in the other, and the linker keeps one out-of-line copy of a
// template for both: at -O0 (or wherever the compiler declines to inline) the other
// file's calls then read garbage. Inlined, no copy is called.
#if defined(__CUDACC__)
#define PYFA_LANES
#else
#define PYFA_LANES __attribute__((always_inline))
#endif
