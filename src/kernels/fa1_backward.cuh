// fa1_backward.cuh: FlashAttention-1 backward (Dao et al. 2022, Algorithm 4, without
// dropout), fp32.
// Simulator twin: pyfa/sim/fa1_backward.py (same names, same loop order, same operations).
// Numerical contract: docs/numerics.md.
//
// One block per (K/V head hk, batch b), which serves the G = H / Hkv query heads
// h = hk * G + g of its group (G = 1 without GQA). The block sets their dQ = 0 in HBM,
// then walks the K/V tiles j in the outer loop, keeping K_j, V_j and the accumulators
// dK~_j, dV~_j on chip; for each, the query heads g = 0 .. G-1 in increasing order and,
// for each, the Q tiles i of the mask's band, reading Q_i, O_i, dO_i, dQ_i, l_i, m_i
// from HBM at every step:
//     P_ij   = diag(l_i)^-1 exp(scale * Q_i K_j^T - m_i)       (recomputed, masked)
//     dV~_j  = dV~_j + P_ij^T dO_i
//     dP_ij  = dO_i V_j^T
//     D_i    = rowsum(dO_i o O_i)                              (recomputed per (j, i))
//     dS_ij  = P_ij o (dP_ij - D_i)
//     dQ_i   = dQ_i + scale * dS_ij K_j                        (one fma, written back to HBM)
//     dK~_j  = dK~_j + scale * dS_ij^T Q_i                     (one fma)
// and after the inner loop writes dK_j = dK~_j, dV_j = dV~_j once. The paper also zeroes
// dK and dV in HBM first; every tile of them is written whole at the end of its outer
// step, so that initialization is left out (a K/V tile that no row sees is not loaded
// and gets dK_j = dV_j = 0). O_i and dQ_i go from HBM into the registers of the thread
// that uses each element.
#pragma once

#include <cmath>

#include "common/device.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/score.h"
#include "common/smem.h"
#include "common/tiling.h"

namespace PYFA_KERNELS {

__global__ void fa1_backward_kernel(const AttentionParams p) {
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, Nq = seq.Nq, Nk = seq.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t tid = threadIdx.x, nthreads = blockDim.x;
    const int64_t G = p.heads / p.heads_kv;  // query heads per K/V head

    const float* K = p.k + p.k_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), HBM row stride row_k
    const float* V = p.v + p.v_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride row_v
    float* dK = p.dk + p.dk_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride row_dk
    float* dV = p.dv + p.dv_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride row_dv
    const int64_t row_q = p.q_strides.row, row_k = p.k_strides.row, row_v = p.v_strides.row;
    const int64_t row_o = p.o_strides.row, row_do = p.dout_strides.row;
    const int64_t row_dq = p.dq_strides.row, row_dk = p.dk_strides.row;
    const int64_t row_dv = p.dv_strides.row;

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa1_backward_smem(Br, Bc, d);
    const int64_t ld = padded(d);              // row stride of K_j, V_j, dO_i, see smem.h
    float* Kj = smem + L.offset[FA1B_Kj];     // (bc, d), row stride ld
    float* Vj = smem + L.offset[FA1B_Vj];     // (bc, d), row stride ld
    float* dKj = smem + L.offset[FA1B_dKj];   // (bc, d)  dK~_j
    float* dVj = smem + L.offset[FA1B_dVj];   // (bc, d)  dV~_j
    float* Qi = smem + L.offset[FA1B_Qi];     // (br, d)
    float* dOi = smem + L.offset[FA1B_dOi];   // (br, d), row stride ld
    float* Pij = smem + L.offset[FA1B_Pij];   // (br, Bc), row stride Bc
    float* dSij = smem + L.offset[FA1B_dSij]; // (br, Bc), row stride Bc
    float* mi = smem + L.offset[FA1B_mi];     // (br)
    float* li = smem + L.offset[FA1B_li];     // (br)
    float* Di = smem + L.offset[FA1B_Di];     // (br)

    // dQ = 0 in HBM for every query head of the group before its first read; the barrier
    // after the first Q tile's load makes these global writes visible to every thread.
    for (int64_t g = 0; g < G; ++g) {
        float* dQ = p.dq + p.dq_strides.at(seq.batch, hk * G + g, seq.q0);  // (Nq, d), row stride row_dq
        for (int64_t e = tid; e < Nq * d; e += nthreads) dQ[(e / d) * row_dq + e % d] = 0.0f;
    }

    const bool split_grad = dbias_splits_grad(p);  // dS_ij holds dS_S for dbias_tile first
    const int64_t Tc = ceil_div(Nk, Bc);
    for (int64_t j = 0; j < Tc; ++j) {
        const int64_t col0 = j * Bc;
        const int64_t bc = min64(Bc, Nk - col0);
        // The Q tiles of the mask's band; the others see no key of this tile. The band is
        // the same for every query head of the group.
        const TileRange visit = seq.mask.q_tiles(col0, bc, Br, Nq);
        // No barrier needed here: every reader of K_j and V_j is before the barrier ahead of
        // the previous tile's write-out, and each element of dK~_j, dV~_j is zeroed by the
        // thread that wrote it out (the same e loop).
        for (int64_t e = tid; e < bc * d; e += nthreads) {
            const int64_t c = e / d, x = e % d;
            if (visit.begin < visit.end) {
                Kj[c * ld + x] = K[(col0 + c) * row_k + x];
                Vj[c * ld + x] = V[(col0 + c) * row_v + x];
            }
            dKj[e] = 0.0f;
            dVj[e] = 0.0f;
        }

        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            const float* Q = p.q + p.q_strides.at(seq.batch, h, seq.q0);         // (Nq, d), row stride row_q
            const float* O = p.o + p.o_strides.at(seq.batch, h, seq.q0);         // (Nq, d), row stride row_o; the forward's output
            const float* dO = p.dout + p.dout_strides.at(seq.batch, h, seq.q0);  // (Nq, d), row stride row_do
            float* dQ = p.dq + p.dq_strides.at(seq.batch, h, seq.q0);            // (Nq, d), row stride row_dq; accumulated in HBM
            const float* m = p.m + p.stat_at(seq, h);  // (Nq), dense: the forward's row max
            const float* l = p.l + p.stat_at(seq, h);  // (Nq), dense: the forward's row sum, relative to m
            if (p.dbias) dbias_clear(p, b, h, min64(visit.begin * Br, Nq), min64(visit.end * Br, Nq), col0, bc,
                                     tid, nthreads);
            for (int64_t i = visit.begin; i < visit.end; ++i) {
                const int64_t row0 = i * Br;
                const int64_t br = min64(Br, Nq - row0);
                __syncthreads();  // the previous Q tile's readers of Q_i, dO_i, P_ij, dS_ij, D_i are done
                for (int64_t e = tid; e < br * d; e += nthreads) {
                    const int64_t r = e / d, x = e % d;
                    Qi[e] = Q[(row0 + r) * row_q + x];
                    dOi[r * ld + x] = dO[(row0 + r) * row_do + x];
                }
                for (int64_t r = tid; r < br; r += nthreads) {
                    mi[r] = m[row0 + r];
                    li[r] = l[row0 + r];
                }
                __syncthreads();

                // The score pipeline (common/score.h): S, -inf if hidden;
                // P_ij[r, c] = exp(S - m_i[r]) / l_i[r], 0 for a row with l_i = 0 (no visible key);
                // dP_ij[r, c] = sum_x dO_i[r, x] V_j[c, x]. Both sums x = 0 .. d-1 in order.
                // A hidden score gets P = 0 by selection and no dP.
                for (int64_t e = tid; e < br * bc; e += nthreads) {
                    const int64_t r = e / bc, c = e % bc;
                    if (seq.mask.masked(row0 + r, col0 + c)) {
                        Pij[r * Bc + c] = 0.0f;
                        dSij[r * Bc + c] = 0.0f;
                        continue;
                    }
                    const float s = scaled_score(p, Qi + r * d, Kj + c * ld);
                    const float S = score_finish(p, s, false, b, h, row0 + r, col0 + c);
                    const float lr = li[r];
                    Pij[r * Bc + c] = lr == 0.0f ? 0.0f : pyfa_exp(S - safe_max(mi[r])) / lr;
                    dSij[r * Bc + c] = pyfa_dot(dOi + r * ld, Vj + c * ld, d);
                }
                // D_i[r] = sum_x dO_i[r, x] O_i[r, x], x in order.
                for (int64_t r = tid; r < br; r += nthreads) {
                    Di[r] = pyfa_dot(dOi + r * ld, O + (row0 + r) * row_o, d);
                }
                __syncthreads();
                const Band band = seq.mask.band(row0, col0);

                // dS_ij = P_ij o (dP_ij - D_i), in place over dP_ij, for the visible scores
                // (what the modification's gradient reads of the score, ScoreAt, recomputed here);
                // with respect to S (dS_S) where dBias needs it apart (dbias_splits_grad).
                for (int64_t e = tid; e < br * bc; e += nthreads) {
                    const int64_t r = e / bc, c = e % bc;
                    if (!band.visible(r, c)) continue;
                    if (split_grad) {
                        dSij[r * Bc + c] = score_grad_S(p, Pij[r * Bc + c], dSij[r * Bc + c], Di[r], b, h, row0 + r,
                                                        col0 + c);
                        continue;
                    }
                    const ScoreAt<float> at =
                        score_mod_is_identity(p)
                            ? ScoreAt<float>{}
                            : score_at(p, scaled_score(p, Qi + r * d, Kj + c * ld), b, h, row0 + r, col0 + c);
                    dSij[r * Bc + c] = score_grad(p, Pij[r * Bc + c], dSij[r * Bc + c], Di[r], at, b, h, row0 + r,
                                                  col0 + c);
                }
                // dV~_j reads P o Z / (1 - p) (common/dropout.h), dS above the undropped P.
                if (p.dropout.on()) {
                    __syncthreads();
                    for (int64_t r = tid; r < br; r += nthreads)
                        p.dropout.apply_row(Pij + r * Bc, bc, b, h, row0 + r, col0);
                    __syncthreads();
                }
                // dV~_j = dV~_j + P_ij^T dO_i, the product summed over the rows r that see
                // key c, in increasing order; a key no row of the tile sees takes no step.
                for (int64_t e = tid; e < bc * d; e += nthreads) {
                    const int64_t c = e / d, x = e % d;
                    const TileRange vis = band.rows(c, br);
                    if (vis.begin == vis.end) continue;
                    float t = 0.0f;
                    for (int64_t r = vis.begin; r < vis.end; ++r) t = pyfa_fma(Pij[r * Bc + c], dOi[r * ld + x], t);
                    dVj[e] = dVj[e] + t;
                }
                __syncthreads();
                if (p.dbias) dbias_tile(p, dSij, Bc, band, b, h, row0, br, col0, bc, tid, nthreads);
                if (split_grad) {
                    __syncthreads();  // dbias_tile's column sums have read dS_S
                    score_mod_grad_tile(p, dSij, Bc, Qi, d, Kj, ld, band, b, h, row0, br, col0, bc, tid, nthreads);
                    __syncthreads();
                }

                // dQ_i = fma(scale, dS_ij K_j, dQ_i), the product summed over the row's
                // visible keys c in increasing order; read from and written back to HBM. A
                // row that sees no key of the tile takes no step.
                for (int64_t e = tid; e < br * d; e += nthreads) {
                    const int64_t r = e / d, x = e % d;
                    const TileRange vis = band.cols(r, bc);
                    if (vis.begin == vis.end) continue;
                    float t = 0.0f;
                    for (int64_t c = vis.begin; c < vis.end; ++c) t = pyfa_fma(dSij[r * Bc + c], Kj[c * ld + x], t);
                    float* dQ_rx = dQ + (row0 + r) * row_dq + x;
                    *dQ_rx = pyfa_canonical_nan(pyfa_fma(p.scale, t, *dQ_rx));
                }
                // dK~_j = fma(scale, dS_ij^T Q_i, dK~_j), the product summed over the rows
                // that see key c, in increasing order.
                for (int64_t e = tid; e < bc * d; e += nthreads) {
                    const int64_t c = e / d, x = e % d;
                    const TileRange vis = band.rows(c, br);
                    if (vis.begin == vis.end) continue;
                    float t = 0.0f;
                    for (int64_t r = vis.begin; r < vis.end; ++r) t = pyfa_fma(dSij[r * Bc + c], Qi[r * d + x], t);
                    dKj[e] = pyfa_fma(p.scale, t, dKj[e]);
                }
            }
        }
        __syncthreads();  // dK~_j and dV~_j are complete; K_j and V_j are free for the next tile
        for (int64_t e = tid; e < bc * d; e += nthreads) {
            const int64_t c = e / d, x = e % d;
            dK[(col0 + c) * row_dk + x] = pyfa_canonical_nan(dKj[e]);
            dV[(col0 + c) * row_dv + x] = pyfa_canonical_nan(dVj[e]);
        }
    }
}

}  // namespace PYFA_KERNELS
