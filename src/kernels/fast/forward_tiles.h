// forward_tiles.h: the register tiles and tile loads the fast forward kernels share (FA2's,
// fa2_forward_fast.cuh, and FA1's, fa1_forward_fast.cuh), so that both compute S and P V
// with one loop each.
//
// Thread layout (both kernels): warp w owns 16 rows of the Q tile, lane = 16 rg + cg; the
// thread's rows are w*16 + rg + 2 ii (ii = 0..7), its S columns cg*4 .. cg*4+3 and its
// O columns the 4-float chunks cg (and cg + 16 when d = 128).
#pragma once

#include "common/mask.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/score.h"
#include "kernels/fast/fast_common.h"

namespace PYFA_KERNELS {

// 16-byte chunks `first` .. `first` + N - 1 (per thread) of a (ROWS, d) tile of global
// memory at `src` (row stride ld): chunk t is e = tid + (first + t) * NT, row e % ROWS,
// columns 4 (e / ROWS) .. +3, so that consecutive lanes take consecutive rows at one
// column chunk and store them, transposed, to consecutive floats. Rows from n on are 0.
template <int ROWS, int NT, int N>
PYFA_DEV void fast_load_chunks(pyfa_f4 (&reg)[N], const float* src, int ld, int n, int first, int tid) {
PYFA_UNROLL
    for (int t = 0; t < N; ++t) {
        const int e = tid + (first + t) * NT, r = e & (ROWS - 1), x4 = e / ROWS;
        reg[t] = r < n ? ld4(src + r * ld + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
    }
}

// The chunks fast_load_chunks loaded, stored transposed into a (d, ROWS) tile: row r at
// position fast_q_pos(r) (PERMUTE, Q_i^T) or r (K_j^T).
template <int ROWS, int NT, int N, bool PERMUTE>
PYFA_DEV void fast_store_chunks_t(float* dst, const pyfa_f4 (&reg)[N], int first, int tid) {
PYFA_UNROLL
    for (int t = 0; t < N; ++t) {
        const int e = tid + (first + t) * NT, r = e & (ROWS - 1), x4 = e / ROWS;
        const int pos = PERMUTE ? fast_q_pos(r) : r;
        dst[(4 * x4 + 0) * ROWS + pos] = reg[t].x;
        dst[(4 * x4 + 1) * ROWS + pos] = reg[t].y;
        dst[(4 * x4 + 2) * ROWS + pos] = reg[t].z;
        dst[(4 * x4 + 3) * ROWS + pos] = reg[t].w;
    }
}

// A (ROWS, D) tile of global memory at `src` (row stride ld) copied by cp.async into
// `dst` (row stride D) and committed as one group; rows from n on are written as zeros.
template <int ROWS, int D, int NT>
PYFA_DEV void fast_cp_async_rows(float* dst, const float* src, int ld, int n, int tid) {
    constexpr int DC = D / 4;
PYFA_UNROLL
    for (int t = 0; t < ROWS * DC / NT; ++t) {
        const int e = tid + t * NT, c = e / DC, x4 = e & (DC - 1);
        const bool ok = c < n;
        pyfa_cp_async16(dst + c * D + 4 * x4, ok ? src + c * ld + 4 * x4 : src, ok);
    }
    pyfa_cp_async_commit();
}

// S = Q_i K_j^T on the thread's 8 x 4 tile: s[ii][kk] = sum_x Q[row ii, x] K[key kk, x],
// x = 0 .. D-1 in order from +0, one pyfa_fma per step. qp: Q_i^T (d, BR) at the thread's
// 8 rows (w*16 + rg*8); kp: K_j^T (d, BC) at its 4 keys (cg*4).
template <int D, int BR, int BC>
PYFA_DEV void fast_s_tile(const float* qp, const float* kp, float (&s)[8][4]) {
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int kk = 0; kk < 4; ++kk) s[ii][kk] = 0.0f;
PYFA_UNROLL_BY(4)
    for (int x = 0; x < D; ++x) {
        const pyfa_f4 qa = ld4(qp + x * BR), qb = ld4(qp + x * BR + 4);
        const pyfa_f4 kv = ld4(kp + x * BC);
        const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const float kx[4] = {kv.x, kv.y, kv.z, kv.w};
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
            for (int kk = 0; kk < 4; ++kk) s[ii][kk] = pyfa_fma(qv[ii], kx[kk], s[ii][kk]);
    }
}

// S_ij[r, c] of the score pipeline (common/score.h) from the thread's sums s: -inf where
// the mask hides key c from row r or c >= bc, on the thread's 8 x 4 tile: rows
// row0 + wrow + rg + 2 ii, keys col0 + cg*4 + kk of batch b, head h (mask: the
// sequence's, Sequence::mask). A tile that the mask
// leaves whole skips the per-element test; keys past bc become -inf, which the row max
// passes over (pyfa_max(m, -inf) = m) and the row sum and P V never visit. kBias false: a
// kernel built without the additive bias (no registers left for it; core/tiles.cpp sends a
// call with a bias to the readable kernel).
//
// With PYFA_FAST_BIAS_ROWS the bias is added here rather than in score_finish, by
// score_mod's rule (last, the value BiasAt::get reads), from one pointer per tile: the
// thread's first row at key col0, its rows 2 row strides apart. Addressed per element as
// score_mod does (at(b, h, i) + j), the compiler keeps the 8 rows' 64-bit offsets live
// across the whole key loop: ptxas for sm_100 spilled the fast FA2 forward at d = 128 with
// them (56 and 128 bytes at Br = 64, 128), and spills nothing with the row pointers. For
// sm_75 to sm_90 the row pointers are what spill (sm_90: 52 bytes at d = 128, Br = 128;
// sm_75, sm_80: 92 bytes at Br = 64), so there the element addresses stay. The emulator
// takes the row pointers: the bits are the same either way, and tests/test_bias.py holds
// it to the simulator at every fast forward instantiation.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 1000
#define PYFA_FAST_BIAS_ROWS 0
#else
#define PYFA_FAST_BIAS_ROWS 1
#endif
template <bool kBias = true>
PYFA_DEV void fast_scale_mask(float (&s)[8][4], const AttentionParams& params, const Mask& mask, int64_t b,
                              int64_t h, int row0, int br, int col0, int bc, int wrow, int rg, int cg) {
    const float* bias_tile = kBias && PYFA_FAST_BIAS_ROWS && params.bias
                                 ? BiasAt<float>::row(params, b, h, row0 + wrow + rg) + col0
                                 : nullptr;
    AttentionParams p = params;
    if (!kBias || PYFA_FAST_BIAS_ROWS) p.bias = nullptr;  // none, or added below
    const Band band = mask.band(row0, col0);
    const bool whole = !band.cuts(br, bc);
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int r = wrow + rg + 2 * ii;
PYFA_UNROLL
        for (int kk = 0; kk < 4; ++kk) {
            const int c = cg * 4 + kk;
            const bool hidden = c >= bc || (!whole && !band.visible(r, c));
            float S = score_finish(p, s[ii][kk] * p.scale, hidden, b, h, row0 + r, col0 + c);
            if (bias_tile && !hidden)
                S = S + (BiasAt<float>::reads(params, row0 + r, col0 + c)
                             ? bias_tile[2 * ii * params.bias_strides.row + c]
                             : 0.0f);
            s[ii][kk] = S;
        }
    }
}

// One row of the tile, held by 16 lanes: returns m = pyfa_max over (seed, S[r, 0 .. bc-1])
// in order (the ordered tree, fast_common.h) and stores the thread's 4 columns of
// exp(S - safe_max(m)) at `prow` (16-byte aligned). FA2 seeds with the running m_old,
// FA1 with -inf (the tile's own max m~_ij).
PYFA_DEV float fast_row_max_exp(const float (&s)[4], float seed, int cg, float* prow) {
    float part = seed;
PYFA_UNROLL
    for (int kk = 0; kk < 4; ++kk) part = pyfa_max(part, s[kk]);
    const float m = ordered_row_max16(part, cg);
    const float ms = safe_max(m);
    pyfa_f4 e;
    e.x = pyfa_exp(s[0] - ms);
    e.y = pyfa_exp(s[1] - ms);
    e.z = pyfa_exp(s[2] - ms);
    e.w = pyfa_exp(s[3] - ms);
    st4(prow, e);
    return m;
}

// pv[ii][x] = sum_c P[row ii, c] V[c, column x], c = 0 .. bc-1 in order from +0, one
// pyfa_fma per step, on the thread's 8 rows and D/16 columns. pp: P_ij (row stride LDP)
// at the thread's first row (w*16 + rg; its rows are 2 apart); vp: V_j (Bc, D) at its
// first column (cg*4; the second chunk, at d = 128, is 64 columns on). With SEL (a tile
// the mask cuts) a step whose score is hidden from the row (band; the thread's first row
// is r0 of the tile) is left out rather than multiplied by 0.
template <int D, int LDP, bool SEL = false>
PYFA_DEV void fast_pv_tile(const float* pp, const float* vp, int bc, float (&pv)[8][D / 16],
                           const Band band = Band{0, 0}, int r0 = 0) {
    constexpr int XC = D / 64;  // 4-column chunks per thread per row
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int x = 0; x < 4 * XC; ++x) pv[ii][x] = 0.0f;
    int c = 0;
    for (; c + 4 <= bc; c += 4) {
        float vx[4][4 * XC];  // V[c + cc, the thread's columns]
PYFA_UNROLL
        for (int cc = 0; cc < 4; ++cc)
PYFA_UNROLL
            for (int h = 0; h < XC; ++h) {
                const pyfa_f4 v = ld4(vp + (c + cc) * D + 64 * h);
                vx[cc][4 * h + 0] = v.x;
                vx[cc][4 * h + 1] = v.y;
                vx[cc][4 * h + 2] = v.z;
                vx[cc][4 * h + 3] = v.w;
            }
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            const pyfa_f4 pr = ld4(pp + 2 * ii * LDP + c);
            const float pc[4] = {pr.x, pr.y, pr.z, pr.w};
PYFA_UNROLL
            for (int cc = 0; cc < 4; ++cc) {
                const bool kept = !SEL || band.visible(r0 + 2 * ii, c + cc);
PYFA_UNROLL
                for (int x = 0; x < 4 * XC; ++x) {
                    const float t = pyfa_fma(pc[cc], vx[cc][x], pv[ii][x]);
                    pv[ii][x] = kept ? t : pv[ii][x];
                }
            }
        }
    }
    if (c < bc) {  // the last 1..3 keys of a tail tile, in order
PYFA_UNROLL
        for (int cc = 0; cc < 3; ++cc) {
            if (c + cc < bc) {
PYFA_UNROLL
                for (int ii = 0; ii < 8; ++ii) {
                    const float pc = pp[2 * ii * LDP + c + cc];
                    const bool kept = !SEL || band.visible(r0 + 2 * ii, c + cc);
PYFA_UNROLL
                    for (int h = 0; h < XC; ++h) {
                        const pyfa_f4 v = ld4(vp + (c + cc) * D + 64 * h);
                        const float vv[4] = {v.x, v.y, v.z, v.w};
PYFA_UNROLL
                        for (int x = 0; x < 4; ++x) {
                            const float t = pyfa_fma(pc, vv[x], pv[ii][4 * h + x]);
                            pv[ii][4 * h + x] = kept ? t : pv[ii][4 * h + x];
                        }
                    }
                }
            }
        }
    }
}

}  // namespace PYFA_KERNELS
