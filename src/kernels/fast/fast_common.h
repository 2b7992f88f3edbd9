// fast_common.h: what the register-tiled kernels share, forward and backward: 128-bit
// shared-memory access, the row permutation and chunk swizzles of their shared-memory
// tiles, and the ordered row max.
#pragma once

#include <cstring>

#include "common/async_copy.h"
#include "common/device.h"
#include "common/numerics.h"

// Loop unrolling: nvcc's pragma on the GPU, GCC's for the emulator.
#if defined(__CUDACC__)
#define PYFA_UNROLL _Pragma("unroll")
#define PYFA_UNROLL_BY(n) _Pragma(PYFA_STRINGIFY(unroll n))
#else
#define __launch_bounds__(...)
#define PYFA_UNROLL _Pragma("GCC unroll 16")
#define PYFA_UNROLL_BY(n) _Pragma("GCC unroll 4")
#endif
#define PYFA_STRINGIFY(x) #x

PYFA_HD int imin(int a, int b) { return a < b ? a : b; }

// The tag of a product's two copies, `if (!cut) f(Masked<false>{}); else f(Masked<true>{});`
// with f a generic lambda testing `decltype(m)::on`: a tile the mask leaves whole then runs
// a loop with no per-element mask test, and the SASS report counts the other copy as a
// masked-tile loop (tools/sass_report.py).
template <bool On>
struct Masked {
    static constexpr bool on = On;
};

#if defined(__CUDACC__)
using pyfa_f4 = float4;
#else
struct alignas(16) pyfa_f4 {
    float x, y, z, w;
};
#endif

// 16-byte loads and stores of shared or global memory at a 16-byte aligned address; stg4
// for global stores.
#if defined(PYFA_EMU_STRICT)
// Strict mode checks each as one 16-byte access, with its call site.
PYFA_DEV pyfa_f4 ld4(const float* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    pyfa_f4 v;
    ::pyfa_emu::strict_load(&v, p, sizeof(v), file, line);
    return v;
}

PYFA_DEV void st4(float* p, pyfa_f4 v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::pyfa_emu::strict_store(p, &v, sizeof(v), file, line);
}

PYFA_DEV void stg4(float* p, pyfa_f4 v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::pyfa_emu::strict_store(p, &v, sizeof(v), file, line);
}
#else
PYFA_DEV pyfa_f4 ld4(const float* p) {
#if defined(__CUDACC__)
    return *reinterpret_cast<const float4*>(p);
#else
    pyfa_f4 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
#endif
}

PYFA_DEV void st4(float* p, pyfa_f4 v) {
#if defined(__CUDACC__)
    *reinterpret_cast<float4*>(p) = v;
#else
    std::memcpy(p, &v, sizeof(v));
#endif
}

// st4 into global memory (O, dQ, dK, dV; never shared memory). nvcc 13 breaks some plain
// float4 stores to global memory into four 32-bit STG (the fast forwards' O, the d = 64
// dQ: issue 23, F5); st.global.wb.v4 (write-back, the default policy) is one STG.128.
// tools/sass_report.py counts them, tests/test_tools.py holds every fast kernel to it.
PYFA_DEV void stg4(float* p, pyfa_f4 v) {
#if defined(__CUDACC__)
    __stwb(reinterpret_cast<float4*>(p), v);
#else
    std::memcpy(p, &v, sizeof(v));
#endif
}
#endif

// Position of tile row r in a transposed tile (Q_i^T; K_j^T, V_j^T in the backwards): a
// thread's 8 rows (w*16 + rg + 2 ii) become 8 consecutive floats (w*16 + rg*8 + ii), two
// 128-bit loads.
PYFA_HD int fast_q_pos(int r) { return (r & ~15) | ((r & 1) << 3) | ((r >> 1) & 7); }

// Row-major tiles of 4-float chunks whose chunk index is XORed with a function of the
// row, so that the 16 lanes reading 16 different rows at one chunk hit all 8 bank groups
// (two wavefronts for 256 bytes) without padding. Both need at least 8 chunks per row.
//
// Q_i and K_j: lanes read rows cg*4 + kk (K_j, cg = 0..15) or rows r and r + 8 (Q_i).
PYFA_HD int swz_qk(int row) { return (row >> 2) & 7; }
// P_ij: lanes write rows r, r + 8 at chunks cg, read rows r, r + 8 at one chunk (the two
// row groups of a warp), and lanes 0..15 read rows 0..15 at one chunk (the row sums).
PYFA_HD int swz_p(int row) { return (row & 7) ^ ((row >> 3) & 1); }

// Offset in floats of chunk `ch` (4 floats) of `row` in a tile of `chunks` chunks per row.
PYFA_HD int swz_at(int row, int ch, int chunks, int swz) { return row * (chunks * 4) + ((ch ^ swz) << 2); }

// The ordered row max of a row held by 16 lanes (lane bit 3..0 = cg, 4 columns each, cg
// in column order), equal bit for bit to the sequential scan
//     m = m_old; for c in order: m = pyfa_max(m, S[c]).
// Each lane folds its own columns in order starting from m_old; the 16 partials are then
// combined in a tree whose left operand is always the lower columns.
//
// Why that is the sequential scan's bits: with m_old not NaN, no partial is NaN
// (pyfa_max ignores a NaN right operand), and pyfa_max keeps its left operand unless the
// right one is strictly greater. So the scan returns the first element, in the order
// (m_old, S[0], S[1], ...), that no later element exceeds and that exceeds every earlier
// one: the first maximal element (+0 and -0 compare equal, so the earlier one wins). A
// lane's partial is the first maximal element of (m_old, its columns), and a tree node
// with the lower columns on the left returns the first maximal element of its two
// halves, so the root returns the first maximal element of (m_old, S[0..3], m_old,
// S[4..7], ...), which is the scan's (the extra copies of m_old are only ever chosen
// when the first copy is). With m_old NaN every partial is that same NaN and so is the
// root. tests/test_fast_kernels.py checks this argument on every ordering of special
// values.
PYFA_DEV float ordered_row_max16(float partial, int cg) {
PYFA_UNROLL
    for (int o = 1; o < 16; o <<= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, partial, o);
        partial = (cg & o) ? pyfa_max(other, partial) : pyfa_max(partial, other);
    }
    return partial;
}
