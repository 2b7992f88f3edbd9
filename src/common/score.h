// score.h: the score pipeline, written once for every kernel (readable and fast) and, in
// its vector form, for the cpu backend (src/backends/cpu/cpu_impl.h). Simulator twin:
// pyfa/sim/score.py. Contract: docs/numerics.md, "The score pipeline".
//
// Forward, for query row i and key j of batch b, query head h:
//     s  = pyfa_dot(Q_i, K_j) * scale        the scaled score
//     S  = score_mod(p, s, b, h, i, j)        the modifications: softcap, then ALiBi, then the bias
//     S  = -inf where the mask hides j from i
//     then the online softmax (each kernel's own: FA1's or FA2's)
// Backward, from the same S:
//     P  = the forward's probabilities (recomputed from LSE, or m and l)
//     dP = pyfa_dot(dO_i, V_j)
//     dS_S = P * (dP - D_i)                   the gradient with respect to S (score_grad_S)
//     dS_s = score_mod_grad(p, dS_S, {s, S}, b, h, i, j), the gradient with respect to s
// (score_grad: both at once). dQ and dK take dS_s; dBias takes dS_S, the gradient of the
// score the bias is added to (equal to dS_s without softcap).
//
// A hidden score takes no part in any product (P V, P^T dO, dO V^T, dS^T Q, dS K): it is
// left out by selection, never multiplied by zero, so an Inf or NaN in a hidden key's V or
// in the dO of a row that sees no key cannot reach a visible result, and which tiles a
// kernel visits (a matter of Br and Bc) changes no bit. Likewise a row of a visited tile
// that sees none of its keys (or a key no row of the tile sees) takes no step at all.
#pragma once

#include <cmath>
#include <type_traits>

#include "common/device.h"
#include "common/fast_takes.h"
#include "common/mask.h"
#include "common/numerics.h"
#include "common/params.h"

// ALiBi's distance |i + off - j| as the score's type T (the first argument, a tag),
// computed in integers and converted once (exact below 2^24, correctly rounded above).
// Kernels: integer indices, T float.
template <class I, class J>
PYFA_HD float alibi_distance(float, I i, J j, int64_t off) {
    int64_t d = static_cast<int64_t>(i) + off - static_cast<int64_t>(j);
    d = d < 0 ? -d : d;
    return static_cast<float>(d);
}
#if !defined(__CUDACC__)
// The cpu backend's vectors: V a GCC vector of floats, VI of int32 lane indices (rows in
// its forward, keys in its backward), the other index a scalar. The lanes' indices fit
// int32 (below 2^30), but off carries diagonal_offset (up to 2^40): where the scalar part
// (off - j, or i + off) leaves (-2^30, 2^30), the int32 sum could wrap, so the distance is
// then formed in int64 lane by lane and converted once, the kernels' value exactly.
template <class V, class VI>
PYFA_LANES inline V alibi_lanes(VI d) {
    d = d < 0 ? -d : d;
    return __builtin_convertvector(d, V);
}
// |sign * lane + base| per lane, in int64.
template <class V, class VI>
PYFA_LANES inline V alibi_lanes_wide(VI lanes, int64_t sign, int64_t base) {
    V out;
    for (int k = 0; k < static_cast<int>(sizeof(V) / sizeof(float)); ++k) {
        int64_t d = sign * static_cast<int64_t>(lanes[k]) + base;
        d = d < 0 ? -d : d;
        out[k] = static_cast<float>(d);
    }
    return out;
}
constexpr int64_t kAlibiLanesNarrow = int64_t{1} << 30;
template <class V, class VI, std::enable_if_t<!std::is_arithmetic<VI>::value, int> = 0>
PYFA_LANES inline V alibi_distance(V, VI i, int64_t j, int64_t off) {
    const int64_t base = off - j;
    if (base > -kAlibiLanesNarrow && base < kAlibiLanesNarrow) return alibi_lanes<V>(i + static_cast<int32_t>(base));
    return alibi_lanes_wide<V>(i, 1, base);
}
template <class V, class VI, std::enable_if_t<!std::is_arithmetic<VI>::value, int> = 0>
PYFA_LANES inline V alibi_distance(V, int64_t i, VI j, int64_t off) {
    const int64_t base = i + off;
    if (base > -kAlibiLanesNarrow && base < kAlibiLanesNarrow) return alibi_lanes<V>(static_cast<int32_t>(base) - j);
    return alibi_lanes_wide<V>(j, -1, base);
}
#endif

// The modification of a scaled score s of row i, key j: a modification adds its
// parameters to AttentionParams and its formula here, its gradient in score_mod_grad,
// and the same two in pyfa/sim/score.py. T is float in the kernels; the cpu backend calls the
// same function on its vectors (T a GCC vector of floats, I and J of lane indices), so
// a formula made of the operations both support is written once.
// ---- additive bias (issue 27): bias[b, h, i, j], broadcast along any axis of stride 0.
// The cpu backend's vectors carry lanes past Nq or Nk (tile padding), which read 0.
inline int64_t score_lane(int64_t x, int) { return x; }
template <class V>
PYFA_LANES inline int64_t score_lane(const V& x, int k) { return x[k]; }

template <class T>
struct BiasAt {  // T a GCC vector of floats: one lane at a time
    template <class I, class J>
    PYFA_LANES static inline T get(const AttentionParams& p, int64_t b, int64_t h, I i, J j) {
        T out = T{};
        for (int k = 0; k < static_cast<int>(sizeof(T) / sizeof(float)); ++k) {
            const int64_t ik = score_lane(i, k), jk = score_lane(j, k);
            out[k] = ik < p.seqlen_q && jk < p.seqlen_k ? p.bias[p.bias_strides.at(b, h, ik) + jk] : 0.0f;
        }
        return out;
    }
};
template <>
struct BiasAt<float> {  // the fast kernels form scores of tile padding too (rows past Nq): those read 0
    // get's two halves, for a kernel that walks row pointers of its own (fast_scale_mask):
    // whether (i, j) reads the bias at all, and row i of bias[b, h] (key j at row[j]).
    PYFA_HD static bool reads(const AttentionParams& p, int64_t i, int64_t j) {
        return i < p.seqlen_q && j < p.seqlen_k;
    }
    PYFA_HD static const float* row(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
        return p.bias + p.bias_strides.at(b, h, i);
    }
    PYFA_HD static float get(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
        return reads(p, i, j) ? row(p, b, h, i)[j] : 0.0f;
    }
};

template <class T, class I, class J>
PYFA_LANES PYFA_HD T score_mod(const AttentionParams& p, T s, int64_t b, int64_t h, I i, J j) {
    (void)p, (void)b, (void)h, (void)i, (void)j;
    // softcap: S = c tanh(s / c), a division (correctly rounded), not s times a rounded 1/c.
    if (p.softcap != 0.0f) s = p.softcap * pyfa_tanh(s / p.softcap);
    // ALiBi, after softcap: S = S - slope * |i + off - j|, a product and a difference (two
    // roundings, no fma); off is the mask's (causal_align's) diagonal offset: a packed
    // sequence's own (Nk_b - Nq_b bottom-right), as in the call of that sequence alone.
    if (p.alibi_slopes) {
        const float slope = p.alibi_slopes[p.alibi_strides.at(b, h, 0)];
        const int64_t off = p.cu_seqlens_q ? p.sequence(b).mask.off : p.mask.off;
        s = s - slope * alibi_distance(s, i, j, off);
    }
    // The additive bias, last (after scaling, softcap and ALiBi): its gradient is dS itself.
    if (p.bias) s = s + BiasAt<T>::get(p, b, h, i, j);
    return s;
}

// What a modification's gradient may read of the score it differentiates (ScoreAt): s,
// the scaled score, and S = score_mod(s), both of the same (i, j) and from the same fused
// steps as the forward's, so that a gradient written in either gets the forward's bits.
// Both are given because a modification's gradient is cheapest in one or the other:
//     softcap   S = c tanh(s / c):  dS_s = dS * (1 - (S / c)^2), reads S (no second tanh;
//               S as softcap left it, so recomputed from s when ALiBi or the bias changed
//               it after);
//     ALiBi     S = s - slope * |i + off - j|, and an additive bias S = s + bias[b, h, i, j]:
//               dS_s = dS, reads neither;
//     dropout   acts on P, not on the score: its keep mask (a function of the seed and
//               b, h, i, j) and 1 / (1 - rate) scale dp in score_grad before dS is formed,
//               and it reads neither.
// A kernel whose thread that forms dS does not hold the score (the fast kernels whose
// warps split into roles) recomputes it, by the same fused steps, only when
// score_mod_is_identity(p) is false, and passes ScoreAt{} otherwise: an identity gradient
// reads nothing, so the recomputation costs no instruction or register today.
template <class T>
struct ScoreAt {
    T s;  // the scaled score
    T S;  // the modified score, score_mod(p, s, ...)
};

// ScoreAt of a scaled score s of row i, key j: s and its modification.
template <class T, class I, class J>
PYFA_HD ScoreAt<T> score_at(const AttentionParams& p, T s, int64_t b, int64_t h, I i, J j) {
    return ScoreAt<T>{s, score_mod(p, s, b, h, i, j)};
}

// dS of the modified score -> dS of the scaled score s it was made from.
template <class T, class I, class J>
PYFA_LANES PYFA_HD T score_mod_grad(const AttentionParams& p, T dS, ScoreAt<T> at, int64_t b, int64_t h, I i, J j) {
    (void)p, (void)at, (void)b, (void)h, (void)i, (void)j;
    // softcap: dS_s = dS (1 - t^2), t = S_c / c, S_c softcap's output: S itself unless
    // ALiBi or the bias changed it after, else recomputed from s by the forward's steps
    // (its bits). (t is not the forward's tanh, which S_c has rounded.)
    if (p.softcap != 0.0f) {
        const T S_c = p.alibi_slopes || p.bias ? p.softcap * pyfa_tanh(at.s / p.softcap) : at.S;
        const T t = S_c / p.softcap;
        dS = dS * (1.0f - t * t);
    }
    return dS;
}

// Whether the modifications' gradient is the identity (it reads nothing of the score), so
// that a kernel may skip what only that gradient needs (the FA1 backwards and the fast
// role-split kernels recompute the score for it; see ScoreAt). ALiBi's gradient is the
// identity: only softcap's reads the score.
PYFA_HD bool score_mod_is_identity(const AttentionParams& p) {
    return p.softcap == 0.0f;
}

// Whether no modification is on: score_mod returns s itself. A loop over scores may test
// it once instead of score_mod's fields at every score (the cpu backend's score passes,
// where a float field cannot be kept in a register across the stores to S).
PYFA_HD bool score_mod_is_none(const AttentionParams& p) {
    return p.softcap == 0.0f && !p.alibi_slopes && !p.bias;
}

// The parameters a fast kernel works on: those of the call with what the kernel's row of
// common/fast_takes.h lacks (softcap, ALiBi) cleared, so that the compiler drops that
// code (with softcap cleared score_mod_is_identity is constant true, and the role-split
// backwards recompute nothing). KERNEL a pyfa_kernel, D its head dim, both the kernel's
// compile-time constants; core/tiles.cpp never sends such a kernel a call that needs more.
template <int KERNEL, int D>
PYFA_HD AttentionParams fast_score_params(const AttentionParams& p) {
    constexpr unsigned takes = fast_takes(KERNEL, D);
    AttentionParams q = p;
    if (!(takes & kTakesSoftcap)) q.softcap = 0.0f;
    if (!(takes & kTakesAlibi)) q.alibi_slopes = nullptr;
    return q;
}

// The scaled score s = (Q_i . K_j) * scale. Q_i, K_j: rows of d floats.
PYFA_HD float scaled_score(const AttentionParams& p, const float* Q_i, const float* K_j) {
    return pyfa_dot(Q_i, K_j, p.head_dim) * p.scale;
}

// S from the scaled score s: -inf where hidden, else the modification. The fast kernels
// and the cpu backend form s by their own loops (the same fused steps) and finish it here.
PYFA_HD float score_finish(const AttentionParams& p, float s, bool hidden, int64_t b, int64_t h, int64_t i,
                           int64_t j) {
    return hidden ? -INFINITY : score_mod(p, s, b, h, i, j);
}

// S[i, j] of the pipeline above: every kernel's scores, so that a backward pass recomputes
// the very S its forward saw. A hidden score's inner product is not even formed. mask:
// the sequence's (Sequence::mask), i and j its own rows.
PYFA_HD float attention_score(const AttentionParams& p, const Mask& mask, const float* Q_i, const float* K_j,
                              int64_t b, int64_t h, int64_t i, int64_t j) {
    return mask.masked(i, j) ? -INFINITY : score_finish(p, scaled_score(p, Q_i, K_j), false, b, h, i, j);
}

// The softmax's gradient: dS_S = P o (dP - D_i), dP with dropout applied. T is float in
// the kernels, a GCC vector of floats in the cpu backend (which drops dP a row at a time).
template <class T>
PYFA_LANES PYFA_HD T softmax_grad(T P, T dP, T D) {
    return P * (dP - D);
}

// dS of a visible score with respect to S, the modified score (what dBias sums), from P,
// dp = dO_i . V_j and D_i.
PYFA_HD float score_grad_S(const AttentionParams& p, float P, float dp, float D, int64_t b, int64_t h, int64_t i,
                           int64_t j) {
    // Dropout: dP = (dO_i V_j^T) o Z / (1 - p) (common/dropout.h), the forward's decisions.
    return softmax_grad(P, p.dropout.apply(dp, b, h, i, j), D);
}

// dS of a visible score with respect to its scaled score s, from P, dp = dO_i . V_j, D_i
// and what the modification's gradient reads of the score (ScoreAt): every kernel's dS,
// readable and fast, is formed here (in two steps where dBias needs the first,
// dbias_splits_grad).
PYFA_HD float score_grad(const AttentionParams& p, float P, float dp, float D, ScoreAt<float> at, int64_t b,
                         int64_t h, int64_t i, int64_t j) {
    return score_mod_grad(p, score_grad_S(p, P, dp, D, b, h, i, j), at, b, h, i, j);
}

// score_grad with the dropout decision Z of (i, j) already drawn (by another thread).
PYFA_HD float score_grad_kept(const AttentionParams& p, float P, float dp, float D, bool kept, ScoreAt<float> at,
                              int64_t b, int64_t h, int64_t i, int64_t j) {
    return score_mod_grad(p, softmax_grad(P, p.dropout.apply_kept(dp, kept), D), at, b, h, i, j);
}

// ---- dBias (issue 27): dS_S of every (b, h, i, j), into p.dbias (params.h), written by the
// kernel that visits each (i, j) of a (b, h) exactly once (FA2: dK/dV, FA1: its one
// kernel), by the threads of one block. Rows of Nq (bias_strides.row != 0): dS as is, +0
// where hidden or never visited. One row (bias_strides.row == 0): the sum over the visible
// i = 0 .. Nq-1 in increasing order, one fp32 addition each, from +0, whatever the tiles.
// The sums over a bias broadcast along B or H are the caller's (docs/numerics.md).
PYFA_HD bool dbias_sums_rows(const AttentionParams& p) { return p.bias_strides.row == 0; }

// Row i of dBias for query head h of batch b: Nk floats.
PYFA_HD float* dbias_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
    const int64_t rows = dbias_sums_rows(p) ? 1 : p.seqlen_q;
    return p.dbias + ((b * p.heads + h) * rows + (dbias_sums_rows(p) ? 0 : i)) * p.seqlen_k;
}

// Before the first visited tile of keys col0 .. col0+bc-1 of (b, h): +0 in the rows no
// tile visits (all but [r0, r1)), or the row sum's start. A column's sum is kept by the
// thread c % nthreads here and in dbias_tile.
PYFA_HD void dbias_clear(const AttentionParams& p, int64_t b, int64_t h, int64_t r0, int64_t r1, int64_t col0,
                         int64_t bc, int64_t tid, int64_t nthreads) {
    if (dbias_sums_rows(p)) {
        for (int64_t c = tid; c < bc; c += nthreads) dbias_row(p, b, h, 0)[col0 + c] = 0.0f;
        return;
    }
    const int64_t rest = p.seqlen_q - (r1 - r0);
    for (int64_t e = tid; e < rest * bc; e += nthreads) {
        const int64_t n = e / bc, i = n < r0 ? n : n + (r1 - r0);
        dbias_row(p, b, h, i)[col0 + e % bc] = 0.0f;
    }
}

// Element e of the folded dBias: from +0, part's (b, h) over the broadcast axes in
// increasing order, b outer, one fp32 addition each (twin: pyfa/sim/score.py dbias_fold).
PYFA_HD float dbias_fold_at(const DbiasFold& f, int64_t e) {
    const int64_t per = f.rows * f.keys, x = e % per, bh = e / per;
    const int64_t out_h = f.sum_h ? 1 : f.heads, h0 = bh % out_h, b0 = bh / out_h;
    float sum = 0.0f;
    for (int64_t b = f.sum_b ? 0 : b0; b < (f.sum_b ? f.batch : b0 + 1); ++b)
        for (int64_t h = f.sum_h ? 0 : h0; h < (f.sum_h ? f.heads : h0 + 1); ++h)
            sum = sum + f.part[(b * f.heads + h) * per + x];
    return pyfa_canonical_nan(sum);
}

// One visited tile: dS_ij (br, bc; dS_S, score_grad_S's) of rows row0.., row stride ld, +0
// where hidden.
PYFA_HD void dbias_tile(const AttentionParams& p, const float* dS_ij, int64_t ld, const Band& band, int64_t b,
                        int64_t h, int64_t row0, int64_t br, int64_t col0, int64_t bc, int64_t tid,
                        int64_t nthreads) {
    if (dbias_sums_rows(p)) {
        for (int64_t c = tid; c < bc; c += nthreads) {
            const TileRange vis = band.rows(c, br);
            float* at = dbias_row(p, b, h, 0) + col0 + c;
            float sum = *at;
            for (int64_t r = vis.begin; r < vis.end; ++r) sum = sum + dS_ij[r * ld + c];
            *at = pyfa_canonical_nan(sum);
        }
        return;
    }
    for (int64_t e = tid; e < br * bc; e += nthreads) {
        const int64_t r = e / bc, c = e % bc;
        dbias_row(p, b, h, row0 + r)[col0 + c] = band.visible(r, c) ? pyfa_canonical_nan(dS_ij[r * ld + c]) : 0.0f;
    }
}

// Whether dBias (dS_S) and the dS_s of dQ and dK differ: a modification's gradient that is
// not the identity (softcap's) comes between them. Then the kernel that writes dBias forms
// the tile's dS_S (score_grad_S), sums it in dbias_tile, and after a barrier turns it into
// dS_s in place (score_mod_grad_tile), the same bits as score_grad's (the same two steps);
// otherwise it forms dS_s = dS_S at once.
PYFA_HD bool dbias_splits_grad(const AttentionParams& p) { return p.dbias && !score_mod_is_identity(p); }

// The tile's dS_ij (br, bc, row stride ld) from dS_S to dS_s for its visible scores, after
// dbias_tile: score_mod_grad of each, its ScoreAt recomputed by the forward's fused steps
// from Q_i (br, d, row stride ldq) and K_j (bc, d, row stride ldk). Hidden scores stay +0.
PYFA_HD void score_mod_grad_tile(const AttentionParams& p, float* dS_ij, int64_t ld, const float* Q_i, int64_t ldq,
                                 const float* K_j, int64_t ldk, const Band& band, int64_t b, int64_t h, int64_t row0,
                                 int64_t br, int64_t col0, int64_t bc, int64_t tid, int64_t nthreads) {
    for (int64_t e = tid; e < br * bc; e += nthreads) {
        const int64_t r = e / bc, c = e % bc;
        if (!band.visible(r, c)) continue;
        const ScoreAt<float> at = score_at(p, scaled_score(p, Q_i + r * ldq, K_j + c * ldk), b, h, row0 + r, col0 + c);
        dS_ij[r * ld + c] = score_mod_grad(p, dS_ij[r * ld + c], at, b, h, row0 + r, col0 + c);
    }
}
