// fast_takes.h: what each fast (register-tiled) kernel computes beyond plain masked
// attention, in one table. A fast kernel is built without the code of what its row lacks
// (registers: each was dropped where ptxas spilled with it, sm_80 to sm_90; softcap and
// ALiBi, sm_80 to sm_120, below), and
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
//
// Softcap and ALiBi (nvcc 13, ptxas -v, sm_80 to sm_120): the FA2 forward at d = 64 and
// 128 and the FA2 dQ kernel at d = 64 hold both without a spill (and the FA2 forward's
// spills at d = 128 on sm_100 and sm_120, docs/gpu_limits.md, are gone with them), the FA1
// forward at d = 64 softcap and the FA1 backward at d = 64 ALiBi (sm_75 too). Not taken,
// where ptxas spilled with them: the FA1 forward's ALiBi at d = 64 (with softcap: 4 B of
// spill stores at sm_120) and both at d = 128 (softcap alone 24-36 B, ALiBi alone 92-116 B
// at sm_120); the FA2 dK/dV kernel at d = 64 (held to 128 registers for two blocks per SM:
// 404 B with both at sm_80, 92 B with ALiBi alone); the FA1 backward's softcap (its dS
// half recomputes the score: 72 B at d = 64, 76 B at d = 128, with ALiBi, at sm_80) and
// its ALiBi at d = 128 (4 B at sm_80). The FA2 dQ and dK/dV kernels at d = 128 take
// neither: their registers go to their two-stage copies.
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
    kTakesPages = 1u << 6,  // paged K/V (problem->page_size): no fast kernel reads rows through a page table
    kTakesSinks = 1u << 7,  // attention sinks (tensors->sinks), merged into each row's final state
};

// The fast kernel of `kernel` (a pyfa_kernel) at head dim d: what it takes.
PYFA_HD constexpr unsigned fast_takes(int kernel, int64_t d) {
    switch (kernel) {
        case PYFA_KERNEL_FA1_FORWARD: return d == 64 ? kTakesSoftcap | kTakesDropout | kTakesBias : 0u;
        case PYFA_KERNEL_FA2_FORWARD:
            return kTakesSoftcap | kTakesAlibi | (d == 64 ? kTakesDropout : 0u) | kTakesBias | kTakesSinks;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: return d == 128 ? kTakesDropout : 0u;
        case PYFA_KERNEL_FA2_BACKWARD_DQ: return (d == 64 ? kTakesSoftcap | kTakesAlibi : 0u) | kTakesDropout | kTakesBias;
        case PYFA_KERNEL_FA1_BACKWARD: return (d == 64 ? kTakesAlibi : 0u) | kTakesDropout | kTakesBias;
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
    if (missing & kTakesSplit) return "split_size";
    if (missing & kTakesPages) return "paged K/V";
    return "sinks";
}

// Whether the fast kernel of `kernel` at head dim d draws dropout (a compile-time
// constant in the kernels: elsewhere its dropout code is compiled out).
PYFA_HD constexpr bool fast_kernel_drops(int kernel, int64_t d) {
    return (fast_takes(kernel, d) & kTakesDropout) != 0;
}
