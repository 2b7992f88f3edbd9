// registry.cuh: every kernel by its pyfa_kernel id. Each backend includes it, so each
// compilation (nvcc for the GPU, the host compiler for the emulator) gets a table of its
// own copies of the kernels.
#pragma once

#include "kernels/fa1_backward.cuh"
#include "kernels/fa1_forward.cuh"
#include "kernels/fa2_backward.cuh"
#include "kernels/fa2_forward.cuh"
#include "pyfa.h"

namespace PYFA_KERNELS {

using KernelFn = void (*)(AttentionParams);

// nullptr for an id that names no kernel.
inline KernelFn kernel_fn(int kernel) {
    switch (kernel) {
        case PYFA_KERNEL_FA1_FORWARD: return fa1_forward_kernel;
        case PYFA_KERNEL_FA2_FORWARD: return fa2_forward_kernel;
        case PYFA_KERNEL_FA1_BACKWARD: return fa1_backward_kernel;
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS: return fa2_backward_preprocess_kernel;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: return fa2_backward_dkdv_kernel;
        case PYFA_KERNEL_FA2_BACKWARD_DQ: return fa2_backward_dq_kernel;
    }
    return nullptr;
}

}  // namespace PYFA_KERNELS
