// fa2_backward.cuh: FlashAttention-2 backward (Dao 2023, Algorithm 2), fp32, no atomics.
// Simulator twin: pyfa/sim/fa2_backward.py (same names, same loop order, same operations).
// Numerical contract: docs/numerics.md, section "FA2 backward".
//
// With P = exp(S - LSE) recomputed from the forward's LSE (S = scale * Q K^T), the
// gradients of O = P V are
//     dV = P^T dO        dP = dO V^T        dS = P o (dP - D),  D = rowsum(dO o O)
//     dQ = scale * dS K  dK = scale * dS^T Q
// Three kernels, launched in this order:
//   fa2_backward_preprocess_kernel  one block per (Q row block i, head, batch): D_i.
//   fa2_backward_dkdv_kernel        one block per (K/V column block j, K/V head hk, batch):
//                                   walks the query heads of hk's group g = 0 .. G-1 and,
//                                   for each, the Q row blocks i of the mask's band; keeps
//                                   dK_j and dV_j on chip and writes them once.
//   fa2_backward_dq_kernel          one block per (Q row block i, head, batch): walks the
//                                   K/V column blocks j of the mask's band, recomputes
//                                   dS_ij, keeps dQ_i on chip and writes it once.
// With GQA (G = H / Hkv query heads per K/V head) query head h = hk * G + g reads K/V
// head hk, and dK, dV of hk sum over g in increasing order: deterministic, no atomics.
// dQ gets its own kernel rather than floating-point atomics (nondeterministic order) or
// per-column-block partial buffers (Tc x Nq x d of scratch): docs/fa2_backward_dq.md.
#pragma once

#include <cmath>

#include "common/device.h"
#include "common/merge.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/score.h"
#include "common/smem.h"
#include "common/tiling.h"

namespace PYFA_KERNELS {

// P[i,j] and dS[i,j] of one score of row i, key j, shared by the dK/dV and dQ kernels so
// that both recompute the very same bits. Q_i, dO_i: the query row; K_j, V_j: the key
// row. S is the forward's (common/score.h), so exp(S - LSE) uses the very S the forward's
// LSE was computed from. A hidden score gets P = dS = 0 by selection (its dP is not even
// formed), and a row that sees no key (LSE = -inf) gets P = 0 outright instead of
// exp(S + inf). mask: the sequence's; i, j its rows. wrt_S: dS with respect to S (dS_S,
// score_grad_S), else with respect to s (dS_s, score_grad): see dbias_splits_grad.
PYFA_HD void fa2_backward_p_ds(const AttentionParams& p, const Mask& mask, const float* Q_i, const float* dO_i, const float* K_j,
                               const float* V_j, int64_t b, int64_t h, int64_t i, int64_t j, float lse,
                               float D_i, bool wrt_S, float* P_ij, float* dS_ij) {
    if (mask.masked(i, j)) {
        *P_ij = 0.0f;
        *dS_ij = 0.0f;
        return;
    }
    const float s = scaled_score(p, Q_i, K_j);
    const float S = score_finish(p, s, false, b, h, i, j);
    const float P = lse == -INFINITY ? 0.0f : pyfa_exp(S - lse);
    const float dp = pyfa_dot(dO_i, V_j, p.head_dim);
    *P_ij = p.dropout.apply(P, b, h, i, j);  // dV = (P o Z / (1 - p))^T dO; dS reads P undropped
    *dS_ij = wrt_S ? score_grad_S(p, P, dp, D_i, b, h, i, j) : score_grad(p, P, dp, D_i, ScoreAt<float>{s, S}, b, h, i, j);
}

// D_i = rowsum(dO_i o O_i): D[r] = pyfa_dot(dO_r, O_r), x = 0 .. d-1 in order.
__global__ void fa2_backward_preprocess_kernel(const AttentionParams p) {
    const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, Nq = seq.Nq;
    const int64_t Br = p.block_r;
    const int64_t tid = threadIdx.x, nthreads = blockDim.x;
    if (i * Br >= Nq) return;  // past its sequence's rows

    const float* O = p.o + p.o_strides.at(seq.batch, h, seq.q0);         // (Nq, d), HBM row stride row_o
    const float* dO = p.dout + p.dout_strides.at(seq.batch, h, seq.q0);  // (Nq, d), row stride row_do
    float* D = p.drow + p.stat_at(seq, h);                                   // (Nq), dense
    const int64_t row_o = p.o_strides.row, row_do = p.dout_strides.row;

    const int64_t row0 = i * Br;
    const int64_t br = min64(Br, Nq - row0);

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_backward_preprocess_smem(Br, p.block_c, d);
    const int64_t ld = padded(d);               // row stride, see smem.h
    float* dOi = smem + L.offset[FA2P_dOOi];   // (br, d), row stride ld

    // dO_i is loaded coalesced; each row's inner product, fused, is then taken by one thread.
    for (int64_t e = tid; e < br * d; e += nthreads)
        dOi[(e / d) * ld + e % d] = dO[(row0 + e / d) * row_do + e % d];
    __syncthreads();
    for (int64_t r = tid; r < br; r += nthreads)
        D[row0 + r] = pyfa_canonical_nan(pyfa_dot(dOi + r * ld, O + (row0 + r) * row_o, d));
}

__global__ void fa2_backward_dkdv_kernel(const AttentionParams p) {
    const int64_t j = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, Nq = seq.Nq, Nk = seq.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t tid = threadIdx.x, nthreads = blockDim.x;
    const int64_t G = p.heads / p.heads_kv;  // query heads per K/V head
    if (j * Bc >= Nk) return;  // past its sequence's keys

    const float* K = p.k + p.k_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), HBM row stride row_k
    const float* V = p.v + p.v_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride row_v
    float* dK = p.dk + p.dk_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride row_dk
    float* dV = p.dv + p.dv_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride row_dv
    const int64_t row_q = p.q_strides.row, row_k = p.k_strides.row, row_v = p.v_strides.row;
    const int64_t row_do = p.dout_strides.row, row_dk = p.dk_strides.row;
    const int64_t row_dv = p.dv_strides.row;

    const int64_t col0 = j * Bc;
    const int64_t bc = min64(Bc, Nk - col0);  // columns of this tile (fewer in the tail)

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_backward_dkdv_smem(Br, Bc, d);
    const int64_t ld = padded(d);               // row stride of K_j, V_j, see smem.h
    float* Kj = smem + L.offset[FA2KV_Kj];      // (bc, d), row stride ld
    float* Vj = smem + L.offset[FA2KV_Vj];      // (bc, d), row stride ld
    float* dKj = smem + L.offset[FA2KV_dKj];    // (bc, d), unscaled
    float* dVj = smem + L.offset[FA2KV_dVj];    // (bc, d)
    float* Qi = smem + L.offset[FA2KV_Qi];      // (br, d)
    float* dOi = smem + L.offset[FA2KV_dOi];    // (br, d)
    float* Pij = smem + L.offset[FA2KV_Pij];    // (br, Bc), row stride Bc
    float* dSij = smem + L.offset[FA2KV_dSij];  // (br, Bc), row stride Bc
    float* LSEi = smem + L.offset[FA2KV_LSEi];  // (br)
    float* Di = smem + L.offset[FA2KV_Di];      // (br)

    // Only the Q tiles of the mask's band see a key of this tile; the others contribute
    // nothing and are skipped. The band is the same for every query head of the group;
    // when it is empty, K_j and V_j are not loaded and dK_j = dV_j = 0.
    const TileRange visit = seq.mask.q_tiles(col0, bc, Br, Nq);
    const bool split_grad = dbias_splits_grad(p);  // dS_ij holds dS_S for dbias_tile first
    for (int64_t e = tid; e < bc * d; e += nthreads) {
        const int64_t c = e / d, x = e % d;
        if (visit.begin < visit.end) {
            Kj[c * ld + x] = K[(col0 + c) * row_k + x];
            Vj[c * ld + x] = V[(col0 + c) * row_v + x];
        }
        dKj[e] = 0.0f;
        dVj[e] = 0.0f;
    }

    // Split backward: the Q tiles of the band by query chunk of split_size rows (per tiles
    // each), chunk c outer, then the group's heads g, then the chunk's tiles i; each chunk's
    // dK_j, dV_j from +0, folded into dK, dV in ascending chunk order. Unsplit: one chunk.
    const int64_t per = p.split_size > 0 ? p.split_size / Br : 0;
    const int64_t c_first = per > 0 && visit.begin < visit.end ? visit.begin / per : 0;
    const int64_t c_end = per > 0 ? (visit.begin < visit.end ? (visit.end - 1) / per + 1 : 0) : 1;
    // dBias does not fold by chunk: each head's rows outside the band, or its one-row sums,
    // start once, so the chunks' tiles write (add to) it as the unsplit walk does.
    if (p.dbias)
        for (int64_t g = 0; g < G; ++g)
            dbias_clear(p, b, hk * G + g, min64(visit.begin * Br, Nq), min64(visit.end * Br, Nq), col0, bc, tid,
                        nthreads);
    for (int64_t chunk = c_first; chunk < c_end; ++chunk) {
        const int64_t i_begin = per > 0 ? max64(visit.begin, chunk * per) : visit.begin;
        const int64_t i_end = per > 0 ? min64(visit.end, (chunk + 1) * per) : visit.end;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            const float* Q = p.q + p.q_strides.at(seq.batch, h, seq.q0);         // (Nq, d), row stride row_q
            const float* dO = p.dout + p.dout_strides.at(seq.batch, h, seq.q0);  // (Nq, d), row stride row_do
            const float* LSE = p.lse + p.stat_at(seq, h);                            // (Nq), dense
            const float* D = p.drow + p.stat_at(seq, h);                             // (Nq), dense
            for (int64_t i = i_begin; i < i_end; ++i) {
                const int64_t row0 = i * Br;
                const int64_t br = min64(Br, Nq - row0);
                __syncthreads();  // the previous step's readers of Q_i, dO_i, P_ij and dS_ij are done
                for (int64_t e = tid; e < br * d; e += nthreads) {
                    const int64_t r = e / d, x = e % d;
                    Qi[e] = Q[(row0 + r) * row_q + x];
                    dOi[e] = dO[(row0 + r) * row_do + x];
                }
                for (int64_t r = tid; r < br; r += nthreads) {
                    LSEi[r] = LSE[row0 + r];
                    Di[r] = D[row0 + r];
                }
                __syncthreads();

                // P_ij = exp(S_ij - LSE_i), dS_ij = P_ij o (dO_i V_j^T - D_i), element by element.
                for (int64_t e = tid; e < br * bc; e += nthreads) {
                    const int64_t r = e / bc, c = e % bc;
                    fa2_backward_p_ds(p, seq.mask, Qi + r * d, dOi + r * d, Kj + c * ld, Vj + c * ld, b, h, row0 + r, col0 + c,
                                      LSEi[r], Di[r], split_grad, &Pij[r * Bc + c], &dSij[r * Bc + c]);
                }
                __syncthreads();
                const Band band = seq.mask.band(row0, col0);
                if (p.dbias) dbias_tile(p, dSij, Bc, band, b, h, row0, br, col0, bc, tid, nthreads);
                if (split_grad) {
                    __syncthreads();  // dbias_tile's column sums have read dS_S
                    score_mod_grad_tile(p, dSij, Bc, Qi, d, Kj, ld, band, b, h, row0, br, col0, bc, tid, nthreads);
                    __syncthreads();
                }

                // dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i, each tile's product summed over
                // the rows r that see key c, in increasing order, before it is added to the
                // accumulator; a key no row of the tile sees takes no step.
                for (int64_t e = tid; e < bc * d; e += nthreads) {
                    const int64_t c = e / d, x = e % d;
                    const TileRange vis = band.rows(c, br);
                    if (vis.begin == vis.end) continue;
                    float dv = 0.0f, dk = 0.0f;
                    for (int64_t r = vis.begin; r < vis.end; ++r) {
                        dv = pyfa_fma(Pij[r * Bc + c], dOi[r * d + x], dv);
                        dk = pyfa_fma(dSij[r * Bc + c], Qi[r * d + x], dk);
                    }
                    dVj[e] = dVj[e] + dv;
                    dKj[e] = dKj[e] + dk;
                }
            }
        }
        if (per > 0)
            for (int64_t e = tid; e < bc * d; e += nthreads) {
                const int64_t c = e / d, x = e % d;
                split_fold(&dK[(col0 + c) * row_dk + x], &dKj[e], p.scale, chunk == c_first);
                split_fold(&dV[(col0 + c) * row_dv + x], &dVj[e], 1.0f, chunk == c_first);
            }
    }
    __syncthreads();
    if (per > 0) {
        // A tile no query sees folds no chunk: acc = +0.
        if (c_first == c_end)
            for (int64_t e = tid; e < bc * d; e += nthreads) {
                dK[(col0 + e / d) * row_dk + e % d] = 0.0f;
                dV[(col0 + e / d) * row_dv + e % d] = 0.0f;
            }
        return;
    }

    // dK = scale * dK_j: the softmax scale of S = scale * Q K^T, applied once at the end.
    for (int64_t e = tid; e < bc * d; e += nthreads) {
        const int64_t c = e / d, x = e % d;
        dK[(col0 + c) * row_dk + x] = pyfa_canonical_nan(dKj[e] * p.scale);
        dV[(col0 + c) * row_dv + x] = pyfa_canonical_nan(dVj[e]);
    }
}

__global__ void fa2_backward_dq_kernel(const AttentionParams p) {
    const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, Nq = seq.Nq, Nk = seq.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t tid = threadIdx.x, nthreads = blockDim.x;
    if (i * Br >= Nq) return;  // past its sequence's rows

    const int64_t hk = h / (p.heads / p.heads_kv);  // the K/V head of this query head
    const float* Q = p.q + p.q_strides.at(seq.batch, h, seq.q0);         // (Nq, d), HBM row stride row_q
    const float* K = p.k + p.k_strides.at(seq.batch, hk, seq.k0);        // (Nk, d), row stride row_k
    const float* V = p.v + p.v_strides.at(seq.batch, hk, seq.k0);        // (Nk, d), row stride row_v
    const float* dO = p.dout + p.dout_strides.at(seq.batch, h, seq.q0);  // (Nq, d), row stride row_do
    const float* LSE = p.lse + p.stat_at(seq, h);                            // (Nq), dense
    const float* D = p.drow + p.stat_at(seq, h);                             // (Nq), dense
    float* dQ = p.dq + p.dq_strides.at(seq.batch, h, seq.q0);            // (Nq, d), row stride row_dq
    const int64_t row_q = p.q_strides.row, row_k = p.k_strides.row, row_v = p.v_strides.row;
    const int64_t row_do = p.dout_strides.row, row_dq = p.dq_strides.row;

    const int64_t row0 = i * Br;
    const int64_t br = min64(Br, Nq - row0);  // rows of this tile (fewer in the tail)

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_backward_dq_smem(Br, Bc, d);
    const int64_t ld = padded(d);               // row stride of K_j, V_j, see smem.h
    float* Qi = smem + L.offset[FA2DQ_Qi];      // (br, d)
    float* dOi = smem + L.offset[FA2DQ_dOi];    // (br, d)
    float* dQi = smem + L.offset[FA2DQ_dQi];    // (br, d), unscaled
    float* Kj = smem + L.offset[FA2DQ_Kj];      // (bc, d), row stride ld
    float* Vj = smem + L.offset[FA2DQ_Vj];      // (bc, d), row stride ld
    float* dSij = smem + L.offset[FA2DQ_dSij];  // (br, Bc), row stride Bc
    float* LSEi = smem + L.offset[FA2DQ_LSEi];  // (br)
    float* Di = smem + L.offset[FA2DQ_Di];      // (br)

    for (int64_t e = tid; e < br * d; e += nthreads) {
        const int64_t r = e / d, x = e % d;
        Qi[e] = Q[(row0 + r) * row_q + x];
        dOi[e] = dO[(row0 + r) * row_do + x];
        dQi[e] = 0.0f;
    }
    for (int64_t r = tid; r < br; r += nthreads) {
        LSEi[r] = LSE[row0 + r];
        Di[r] = D[row0 + r];
    }

    const TileRange visit = seq.mask.kv_tiles(row0, br, Bc, Nk);
    const int64_t per = p.split_size > 0 ? p.split_size / Bc : 0;  // K/V tiles per key chunk
    for (int64_t j = visit.begin; j < visit.end; ++j) {
        const int64_t col0 = j * Bc;
        const int64_t bc = min64(Bc, Nk - col0);
        __syncthreads();  // the previous step's readers of K_j and dS_ij are done
        for (int64_t e = tid; e < bc * d; e += nthreads) {
            const int64_t c = e / d, x = e % d;
            Kj[c * ld + x] = K[(col0 + c) * row_k + x];
            Vj[c * ld + x] = V[(col0 + c) * row_v + x];
        }
        __syncthreads();

        // dS_ij as in the dK/dV kernel (P_ij is not needed here and is dropped).
        for (int64_t e = tid; e < br * bc; e += nthreads) {
            const int64_t r = e / bc, c = e % bc;
            float P_rc;
            fa2_backward_p_ds(p, seq.mask, Qi + r * d, dOi + r * d, Kj + c * ld, Vj + c * ld, b, h, row0 + r, col0 + c,
                              LSEi[r], Di[r], false, &P_rc, &dSij[r * Bc + c]);
        }
        __syncthreads();
        const Band band = seq.mask.band(row0, col0);

        // dQ_i += dS_ij K_j, the tile's product summed over the row's visible keys c in
        // increasing order; a row that sees no key of the tile takes no step.
        for (int64_t e = tid; e < br * d; e += nthreads) {
            const int64_t r = e / d, x = e % d;
            const TileRange vis = band.cols(r, bc);
            if (vis.begin == vis.end) continue;
            float dq = 0.0f;
            for (int64_t c = vis.begin; c < vis.end; ++c) dq = pyfa_fma(dSij[r * Bc + c], Kj[c * ld + x], dq);
            dQi[e] = dQi[e] + dq;
        }
        // Split backward: the last visited tile of key chunk j / per folds its dQ_i into dQ
        // (split_fold), in ascending chunk order; chunks the tile does not visit are skipped.
        if (per > 0 && (j + 1 == visit.end || (j + 1) % per == 0)) {
            for (int64_t e = tid; e < br * d; e += nthreads)
                split_fold(&dQ[(row0 + e / d) * row_dq + e % d], &dQi[e], p.scale, j / per == visit.begin / per);
        }
    }
    __syncthreads();
    if (per > 0) {
        if (visit.begin == visit.end)  // no chunk folded: acc = +0
            for (int64_t e = tid; e < br * d; e += nthreads) dQ[(row0 + e / d) * row_dq + e % d] = 0.0f;
        return;
    }

    for (int64_t e = tid; e < br * d; e += nthreads)
        dQ[(row0 + e / d) * row_dq + e % d] = pyfa_canonical_nan(dQi[e] * p.scale);
}

}  // namespace PYFA_KERNELS
