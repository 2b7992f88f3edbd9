// registry.cuh: every kernel function by its table row (kernels/table.h). Each backend
// includes it, so each compilation (nvcc for the GPU, the host compiler for the emulator)
// gets its own copies of the kernels.
#pragma once

#include "kernels/fa1_backward.cuh"
#include "kernels/fa1_forward.cuh"
#include "kernels/fa2_backward.cuh"
#include "kernels/fa2_forward.cuh"
#include "kernels/fast/fa1_forward_fast.cuh"
#include "kernels/fast/fa1_backward_fast.cuh"
#include "kernels/fast/fa2_backward_dkdv_fast.cuh"
#include "kernels/fast/fa2_backward_dq_fast.cuh"
#include "kernels/fast/fa2_forward_fast.cuh"
#include "kernels/table.h"
#include "pyfa.h"

namespace PYFA_KERNELS {

using KernelFn = void (*)(AttentionParams);

// nullptr for an id that names no row.
inline KernelFn kernel_fn(int id) {
    switch (id) {
#define PYFA_KERNEL_FN_CASE(ID, NAME, KERNEL, VARIANT, D, BR, BC, FN, LAYOUT, THREADS, GRID) \
    case ID: return FN;
        PYFA_KERNEL_TABLE(PYFA_KERNEL_FN_CASE)
#undef PYFA_KERNEL_FN_CASE
    }
    return nullptr;
}

}  // namespace PYFA_KERNELS
