// fast_tiles.h: what the fast backward kernels share (fa2_backward_dkdv_fast.cuh,
// fa2_backward_dq_fast.cuh, fa1_backward_fast.cuh): the two register-tile loops of the
// kernels whose warps split into roles (a thread's 8 x 4 tile of scores from a transposed
// operand and a row-major one, and a thread's 8 x 4*XC tile of a product summed over the
// tile's other index), and the score pipeline's backward steps (P from a score's sum, and
// what dS's modification gradient reads of the score). The loops keep the contract's
// order (every sum in index order from +0), so a kernel that uses them keeps the
// simulator's bits.
//
// Row-major operands (B) sit in shared memory as (rows, D) with 16-byte chunks swizzled by
// swz_qk (fast_common.h): a warp reads 16 rows cg*4 + kk at one chunk (the scores) or one
// row at 16 chunks (the products), each in two wavefronts per 128-bit load.
#pragma once

#include "common/async_copy.h"
#include "common/mask.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/score.h"
#include "common/smem.h"
#include "kernels/fast/fast_common.h"

namespace PYFA_KERNELS {

// Rows row0 .. row0+n-1 of two (N, D) tensors a and b (row strides lda, ldb) into shared
// memory transposed, at (D, ROWS) and bt (D, ROWS), rows permuted by fast_q_pos so that a
// thread's 8 rows at one x are 32 bytes; rows past n are 0. NT threads, 128-bit loads.
template <int D, int ROWS, int NT>
PYFA_DEV void fast_load_transposed2(float* at, float* bt, const float* a, int lda, const float* b, int ldb,
                                    int row0, int n, int tid) {
PYFA_UNROLL
    for (int t = 0; t < ROWS * (D / 4) / NT; ++t) {
        const int e = tid + t * NT, r = e & (ROWS - 1), x4 = e / ROWS;
        const bool ok = r < n;
        const pyfa_f4 av = ok ? ld4(a + (row0 + r) * lda + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
        const pyfa_f4 bv = ok ? ld4(b + (row0 + r) * ldb + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
        const int pos = fast_q_pos(r);
        at[(4 * x4 + 0) * ROWS + pos] = av.x;
        at[(4 * x4 + 1) * ROWS + pos] = av.y;
        at[(4 * x4 + 2) * ROWS + pos] = av.z;
        at[(4 * x4 + 3) * ROWS + pos] = av.w;
        bt[(4 * x4 + 0) * ROWS + pos] = bv.x;
        bt[(4 * x4 + 1) * ROWS + pos] = bv.y;
        bt[(4 * x4 + 2) * ROWS + pos] = bv.z;
        bt[(4 * x4 + 3) * ROWS + pos] = bv.w;
    }
}

// Rows row0 .. row0+n-1 of two (N, D) tensors a and b (row strides lda, ldb) into shared
// memory row-major, as (ROWS, D) with 16-byte chunks swizzled by swz_qk, by cp.async: one
// commit group, which the caller waits for (and follows with a barrier) before any thread
// reads it. Rows past n are 0 (row 0 is the address given, not read). NT threads.
template <int D, int ROWS, int NT>
PYFA_DEV void fast_copy_rows2_async(float* as, float* bs, const float* a, int lda, const float* b, int ldb,
                                    int row0, int n, int tid) {
    constexpr int DC = D / 4;
PYFA_UNROLL
    for (int t = 0; t < ROWS * DC / NT; ++t) {
        const int e = tid + t * NT, r = e / DC, ch = e % DC;
        const bool ok = r < n;
        const int at = swz_at(r, ch, DC, swz_qk(r)), src = ok ? row0 + r : 0;
        pyfa_cp_async16(as + at, a + src * lda + 4 * ch, ok);
        pyfa_cp_async16(bs + at, b + src * ldb + 4 * ch, ok);
    }
    pyfa_cp_async_commit();
}

// s[ii][kk] = sum_x A[a_ii, x] B[cg*4 + kk, x] (x = 0 .. D-1 in order, from +0) over the
// thread's 8 rows a_ii of A and 4 rows of B. at: the thread's 8 consecutive floats of A^T
// (D, 64) at x = 0 (A's rows permuted so that they are consecutive: fast_q_pos); b: B
// (64, D) row-major, chunks swizzled.
template <int D>
PYFA_DEV void fast_scores_8x4(const float* at, const float* b, int cg, float (&s)[8][4]) {
    constexpr int BC = kFastBc;
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int kk = 0; kk < 4; ++kk) s[ii][kk] = 0.0f;
    const float* brow = b + cg * 4 * D;  // rows cg*4 .. cg*4+3 share one swizzle
    const int sw = swz_qk(cg * 4);
    // Not unrolled: 4 x a step is 128 fma against 12 128-bit loads already, and unrolling
    // holds the next step's 48 floats in registers (the dK/dV kernel at d = 64 would spill
    // at two blocks per SM).
PYFA_UNROLL_BY(1)
    for (int x4 = 0; x4 < D / 4; ++x4) {
        pyfa_f4 bq[4];
PYFA_UNROLL
        for (int kk = 0; kk < 4; ++kk) bq[kk] = ld4(brow + kk * D + ((x4 ^ sw) << 2));
        const float bx[4][4] = {{bq[0].x, bq[1].x, bq[2].x, bq[3].x},
                                {bq[0].y, bq[1].y, bq[2].y, bq[3].y},
                                {bq[0].z, bq[1].z, bq[2].z, bq[3].z},
                                {bq[0].w, bq[1].w, bq[2].w, bq[3].w}};
PYFA_UNROLL
        for (int xx = 0; xx < 4; ++xx) {
            const float* ap = at + (4 * x4 + xx) * BC;
            const pyfa_f4 a0 = ld4(ap), a1 = ld4(ap + 4);
            const float ax[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk) s[ii][kk] = pyfa_fma(bx[xx][kk], ax[ii], s[ii][kk]);
        }
    }
}

// The backward's P of one score from its sum (Q_i . K_j, the fast loops' fused steps): the
// score pipeline (common/score.h) S = score_finish(sum * scale, hidden) of row i, key j
// (batch b, query head h), then P = 0 where hidden or where the row sees no key (none:
// FA2's LSE = -inf, FA1's l = 0), else prob(S), the family's rule (FA2: exp(S - LSE),
// FA1: exp(S - safe_max(m)) / l). One score at a time, each kernel in its own loop and
// with its own band test, because at two blocks per SM the dK/dV kernel at d = 64 has no
// register to spare: a helper over the whole 8 x 4 tile made ptxas spill there.
template <class Prob>
PYFA_DEV float fast_score_p(const AttentionParams& p, float sum, bool hidden, bool none, int64_t b, int64_t h,
                            int64_t i, int64_t j, Prob prob) {
    const float S = score_finish(p, sum * p.scale, hidden, b, h, i, j);
    return hidden || none ? 0.0f : prob(S);
}

// What the modification's gradient reads of the score (ScoreAt, common/score.h) on the
// thread's 8 x 4 tile, for a thread that forms dS without holding the score (the dS role
// of a kernel whose warps split): the sums are recomputed by fast_scores_8x4 on the P
// role's operands (at, bm as its twin passes them), the same fused steps and so the same
// bits, and only when the modification is not the identity; else ScoreAt{}, which an
// identity gradient never reads. KEYS: ii indexes the tile's keys a0 + 2 ii and kk its
// rows cg*4 + kk (S^T: the dK/dV and FA1 kernels); else ii the rows a0 + 2 ii, kk the keys
// cg*4 + kk (dQ).
template <int D, bool KEYS>
PYFA_DEV void fast_scores_for_grad(const AttentionParams& p, const float* at, const float* bm, int a0, int cg,
                                   int row0, int col0, int64_t b, int64_t h, ScoreAt<float> (&sa)[8][4]) {
    if (score_mod_is_identity(p)) {
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
            for (int kk = 0; kk < 4; ++kk) sa[ii][kk] = ScoreAt<float>{};
        return;
    }
    float s[8][4];
    fast_scores_8x4<D>(at, bm, cg, s);
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int kk = 0; kk < 4; ++kk) {
            const int r = KEYS ? cg * 4 + kk : a0 + 2 * ii;
            const int c = KEYS ? a0 + 2 * ii : cg * 4 + kk;
            sa[ii][kk] = score_at(p, s[ii][kk] * p.scale, b, h, row0 + r, col0 + c);
        }
}

// One tile's product: t[c, x] = sum_r A^T[c, r] B[r, x] (r = 0 .. br-1 in order, from +0),
// then acc[c, x] = acc[c, x] + t[c, x], over the thread's rows c = first + 2 ii of A^T and
// the columns of B's chunks cg + 16 hh (hh < XC). at: the thread's first row of A^T (row
// stride LDP); b: B (br, D) row-major, chunks swizzled, from the first column this thread
// group covers (a multiple of 64).
//
// SEL != 0 (a tile the mask cuts): step r of row a = a0 + 2 ii takes part iff the score is
// visible, lo <= dc <= hi (the tile's Band, edges clamped to 32 bits) with dc = a - r when
// A^T's rows are keys (SEL = 1, the dK/dV kernel) or dc = r - a when they are query rows
// (SEL = -1, dS K); a hidden step is left out rather than multiplied by 0, and a row with
// no step left keeps its acc. The test is one unsigned compare against hi - lo (>= 0), so
// that the selecting loop needs two registers more than the plain one.
template <int D, int XC, int LDP, int SEL = 0>
PYFA_DEV void fast_product_8x4(const float* at, const float* b, int br, int cg, float (&acc)[8][4 * XC],
                               int a0 = 0, int lo = 0, int hi = 0) {
    float t[8][4 * XC];
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int x = 0; x < 4 * XC; ++x) t[ii][x] = 0.0f;
    // kept(a, r) = (unsigned)(SEL * (a - r) - lo) <= span, with base = SEL * (a0 - r) - lo
    // following r.
    const unsigned span = static_cast<unsigned>(hi - lo);
    auto kept = [&](int base, int ii, int rr) {
        return !SEL || static_cast<unsigned>(base + SEL * (2 * ii - rr)) <= span;
    };
    unsigned stepm = 0;  // bit ii: some step of row ii was kept
    int r = 0;
    for (; r + 4 <= br; r += 4) {
        const float* brow = b + r * D + ((cg ^ swz_qk(r)) << 2);  // rows r .. r+3 share one swizzle
        pyfa_f4 bx[4][XC];
PYFA_UNROLL
        for (int rr = 0; rr < 4; ++rr)
PYFA_UNROLL
            for (int hh = 0; hh < XC; ++hh) bx[rr][hh] = ld4(brow + rr * D + 64 * hh);
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            const pyfa_f4 ar = ld4(at + 2 * ii * LDP + r);
            const float ac[4] = {ar.x, ar.y, ar.z, ar.w};
PYFA_UNROLL
            for (int rr = 0; rr < 4; ++rr) {
                const bool k = kept(SEL * (a0 - r) - lo, ii, rr);
                if (SEL) stepm |= static_cast<unsigned>(k) << ii;
PYFA_UNROLL
                for (int hh = 0; hh < XC; ++hh) {
                    const float bv[4] = {bx[rr][hh].x, bx[rr][hh].y, bx[rr][hh].z, bx[rr][hh].w};
PYFA_UNROLL
                    for (int x = 0; x < 4; ++x) {
                        const float u = pyfa_fma(ac[rr], bv[x], t[ii][4 * hh + x]);
                        t[ii][4 * hh + x] = k ? u : t[ii][4 * hh + x];
                    }
                }
            }
        }
    }
    if (r < br) {  // the last 1..3 rows of a tail Q tile, in order
PYFA_UNROLL
        for (int rr = 0; rr < 3; ++rr) {
            if (r + rr < br) {
                const float* brow = b + (r + rr) * D + ((cg ^ swz_qk(r + rr)) << 2);
PYFA_UNROLL
                for (int hh = 0; hh < XC; ++hh) {
                    const pyfa_f4 v = ld4(brow + 64 * hh);
                    const float bv[4] = {v.x, v.y, v.z, v.w};
PYFA_UNROLL
                    for (int ii = 0; ii < 8; ++ii) {
                        const float ac = at[2 * ii * LDP + r + rr];
                        const bool k = kept(SEL * (a0 - r) - lo, ii, rr);
                        if (SEL) stepm |= static_cast<unsigned>(k) << ii;
PYFA_UNROLL
                        for (int x = 0; x < 4; ++x) {
                            const float u = pyfa_fma(ac, bv[x], t[ii][4 * hh + x]);
                            t[ii][4 * hh + x] = k ? u : t[ii][4 * hh + x];
                        }
                    }
                }
            }
        }
    }
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int x = 0; x < 4 * XC; ++x)
            acc[ii][x] = (!SEL || ((stepm >> ii) & 1u)) ? acc[ii][x] + t[ii][x] : acc[ii][x];
}

}  // namespace PYFA_KERNELS
