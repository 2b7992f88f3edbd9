// fast_takes.h: what each fast (register-tiled) kernel computes beyond plain masked
// attention, in one table. A fast kernel is built without the code of what its row lacks
// (registers: each was dropped where ptxas spilled with it, sm_80 to sm_90), and
// select_kernel (core/tiles.cpp) reads the same row: a call that needs more runs the
// readable kernel under variant auto (same bits: the fast kernels equal the readable ones
// where the contract says so) and is refused, naming what is missing, under variant fast.
// The readable kernels take everything. A new modification is a bit here, its column in
// fast_takes, and the one line in select_kernel's fast_needs that asks for it.
//
// Where each kernel compiles out what it lacks: softcap and ALiBi through
// fast_score_params (common/score.h), the bias by clearing it (fa2_backward_dkdv_fast.cuh,
// fa1_forward_fast.cuh at d = 128), dropout through fast_kernel_drops below, dBias and
// split-KV by never writing or reading them.
#pragma once

#include <cstdint>

#include "common/device.h"
#include "pyfa.h"

enum FastTakes : unsigned {
    kTakesSoftcap = 1u << 0,
    kTakesAlibi = 1u << 1,
    kTakesDropout = 1u << 2,
    kTakesBias = 1u << 3,
    kTakesDbias = 1u << 4,  // writes dS into dBias (only the kernels that visit each (i, j) once may)
    kTakesSplit = 1u << 5,  // split-KV's chunked launch (problem->split_size)
};

// The fast kernel of `kernel` (a pyfa_kernel) at head dim d: what it takes.
PYFA_HD constexpr unsigned fast_takes(int kernel, int64_t d) {
    switch (kernel) {
        case PYFA_KERNEL_FA1_FORWARD: return (d == 64 ? kTakesDropout | kTakesBias : 0u);
        case PYFA_KERNEL_FA2_FORWARD: return (d == 64 ? kTakesDropout : 0u) | kTakesBias;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: return d == 128 ? kTakesDropout : 0u;
        case PYFA_KERNEL_FA2_BACKWARD_DQ: return kTakesDropout | kTakesBias;
        case PYFA_KERNEL_FA1_BACKWARD: return kTakesDropout | kTakesBias;
        default: return 0u;
    }
}

// Its name in messages, for the lowest bit of `missing`.
inline const char* fast_takes_name(unsigned missing) {
    if (missing & kTakesSoftcap) return "softcap";
    if (missing & kTakesAlibi) return "ALiBi";
    if (missing & kTakesDropout) return "dropout";
    if (missing & kTakesBias) return "bias";
    if (missing & kTakesDbias) return "dbias output";
    return "split_size";
}

// Whether the fast kernel of `kernel` at head dim d draws dropout (a compile-time
// constant in the kernels: elsewhere its dropout code is compiled out).
PYFA_HD constexpr bool fast_kernel_drops(int kernel, int64_t d) {
    return (fast_takes(kernel, d) & kTakesDropout) != 0;
}
