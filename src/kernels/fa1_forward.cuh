// fa1_forward.cuh: FlashAttention-1 forward (Dao et al. 2022, Algorithm 1), fp32, as the
// paper writes it: the baseline, not an improved variant.
// Simulator twin: pyfa/sim/fa1_forward.py (same names, same loop order, same operations).
// Numerical contract: docs/numerics.md.
//
// One block per (query head h, batch b): FA1 parallelizes over heads and batch only;
// head h reads K/V head hk = h / (H / Hkv). The block first sets its head's O = 0, l = 0,
// m = -inf in HBM, then walks the K/V tiles j in the outer loop (K_j, V_j loaded once
// each) and, for each, the Q tiles i of the mask's band in the inner loop (tiles wholly
// masked are skipped, and a K/V tile no row sees is not loaded),
// reading Q_i, O_i, l_i, m_i from HBM and writing O_i, l_i, m_i back at every step:
//     S_ij   = scale * Q_i K_j^T
//     m~_ij  = rowmax(S_ij),   P~_ij = exp(S_ij - m~_ij),   l~_ij = rowsum(P~_ij)
//     m_new  = max(m_i, m~_ij)
//     l_new  = exp(m_i - m_new) l_i + exp(m~_ij - m_new) l~_ij
//     O_i    = diag(l_new)^-1 (diag(l_i) exp(m_i - m_new) O_i + exp(m~_ij - m_new) P~_ij V_j)
//     l_i    = l_new,   m_i = m_new
// so O is normalized after every step. Q_i goes to shared memory (every thread of a row
// reads it); O_i, l_i and m_i go from HBM into the registers of the one thread that
// updates each element, which is the same traffic with less shared memory.
#pragma once

#include <cmath>

#include "common/device.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/score.h"
#include "common/smem.h"
#include "common/tiling.h"

namespace PYFA_KERNELS {

__global__ void fa1_forward_kernel(const AttentionParams p) {
    const int64_t h = blockIdx.y, b = blockIdx.z;
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, Nq = seq.Nq, Nk = seq.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t tid = threadIdx.x, nthreads = blockDim.x;

    const int64_t hk = h / (p.heads / p.heads_kv);  // the K/V head of this query head
    const float* Q = p.q + p.q_strides.at(seq.batch, h, seq.q0);   // (Nq, d) of this head, HBM row stride row_q
    // Key n of the sequence is row p.kv_row(seq.k0 + n) of K and V (params.h: paged K/V).
    const float* K = p.k + p.k_strides.at(seq.batch, hk, 0);  // (rows of k, d), row stride row_k
    const float* V = p.v + p.v_strides.at(seq.batch, hk, 0);  // (rows of v, d), row stride row_v
    float* O = p.o + p.o_strides.at(seq.batch, h, seq.q0);         // (Nq, d), row stride row_o; normalized after every step
    float* m = p.m + p.stat_at(seq, h);                                // (Nq)  running row max, dense
    float* l = p.l + p.stat_at(seq, h);                                // (Nq)  running row sum, relative to m
    const int64_t row_q = p.q_strides.row, row_k = p.k_strides.row;
    const int64_t row_v = p.v_strides.row, row_o = p.o_strides.row;

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa1_forward_smem(Br, Bc, d);
    const int64_t ldk = padded(d), lds = padded(Bc);  // row strides, see smem.h
    float* Kj = smem + L.offset[FA1F_Kj];             // (bc, d), row stride ldk
    float* Vj = smem + L.offset[FA1F_Vj];             // (bc, d)
    float* Qi = smem + L.offset[FA1F_Qi];             // (br, d)
    float* Sij = smem + L.offset[FA1F_Sij];           // (br, bc), row stride lds
    float* mt = smem + L.offset[FA1F_mtij];           // (br)  m~_ij
    float* lnew = smem + L.offset[FA1F_lnew];         // (br)  l_new
    float* oscale = smem + L.offset[FA1F_oscale];     // (br)  l_i exp(m_i - m_new)
    float* pvscale = smem + L.offset[FA1F_pvscale];   // (br)  exp(m~_ij - m_new)

    // O = 0, l = 0, m = -inf in HBM before anything reads them. The __syncthreads at the
    // top of the K/V loop makes these global writes visible to every thread of the block.
    for (int64_t e = tid; e < Nq * d; e += nthreads) O[(e / d) * row_o + e % d] = 0.0f;
    for (int64_t r = tid; r < Nq; r += nthreads) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }

    const int64_t Tc = ceil_div(Nk, Bc);
    for (int64_t j = 0; j < Tc; ++j) {
        const int64_t col0 = j * Bc;
        const int64_t bc = min64(Bc, Nk - col0);
        const TileRange visit = seq.mask.q_tiles(col0, bc, Br, Nq);
        if (visit.begin == visit.end) continue;  // no row sees this tile: not even loaded
        __syncthreads();  // the previous K/V tile's readers are done (first: O, l, m are set)
        for (int64_t e = tid; e < bc * d; e += nthreads) {
            const int64_t c = e / d, x = e % d;
            const int64_t n = p.kv_row(seq.k0 + col0 + c);
            Kj[c * ldk + x] = K[n * row_k + x];
            Vj[e] = V[n * row_v + x];
        }

        for (int64_t i = visit.begin; i < visit.end; ++i) {
            const int64_t row0 = i * Br;
            const int64_t br = min64(Br, Nq - row0);
            // No barrier needed before this load: Q_i's last readers (the S_ij step of the
            // previous Q tile) are three barriers back.
            for (int64_t e = tid; e < br * d; e += nthreads) Qi[e] = Q[(row0 + e / d) * row_q + e % d];
            __syncthreads();

            // S_ij[r, c]: the score pipeline (common/score.h), its sum x = 0 .. d-1 in order.
            for (int64_t e = tid; e < br * bc; e += nthreads) {
                const int64_t r = e / bc, c = e % bc;
                Sij[r * lds + c] = attention_score(p, seq.mask, Qi + r * d, Kj + c * ldk, b, h, row0 + r, col0 + c);
            }
            __syncthreads();
            const Band band = seq.mask.band(row0, col0);

            // m~_ij = max(-inf, S_ij[r, 0], ..., S_ij[r, bc-1]).
            for (int64_t r = tid; r < br; r += nthreads) {
                float mx = -INFINITY;
                for (int64_t c = 0; c < bc; ++c) mx = pyfa_max(mx, Sij[r * lds + c]);
                mt[r] = mx;
            }
            __syncthreads();

            // P~_ij = exp(S_ij - m~_ij), in place.
            for (int64_t e = tid; e < br * bc; e += nthreads) {
                const int64_t r = e / bc, c = e % bc;
                Sij[r * lds + c] = pyfa_exp(Sij[r * lds + c] - safe_max(mt[r]));
            }
            __syncthreads();

            // l~_ij = rowsum(P~_ij), c = 0 .. bc-1 in order; then the row statistics, read
            // from HBM and written back. A row that sees no key of the tile takes no step:
            // its m, l and O stay as they are.
            for (int64_t r = tid; r < br; r += nthreads) {
                if (band.cols(r, bc).begin == band.cols(r, bc).end) continue;
                float lt = 0.0f;
                for (int64_t c = 0; c < bc; ++c) lt = lt + Sij[r * lds + c];
                const float m_old = m[row0 + r];
                const float l_old = l[row0 + r];
                const float m_new = pyfa_max(m_old, mt[r]);
                const float alpha = pyfa_exp(m_old - safe_max(m_new));  // exp(m_i - m_new)
                const float beta = pyfa_exp(mt[r] - safe_max(m_new));   // exp(m~_ij - m_new)
                const float os = l_old * alpha;
                const float l_new = pyfa_fma(beta, lt, os);
                oscale[r] = os;
                pvscale[r] = beta;
                lnew[r] = l_new;
                m[row0 + r] = pyfa_canonical_nan(m_new);
                l[row0 + r] = pyfa_canonical_nan(l_new);
                // P V takes P~ o Z / (1 - p) (common/dropout.h); l~ above took P~ undropped.
                p.dropout.apply_row(Sij + r * lds, bc, b, h, row0 + r, col0);
            }
            __syncthreads();

            // O_i = fma(o_scale, O_i, pv_scale * P~_ij V_j) / l_new, the product summed
            // over the row's visible keys c in increasing order (hidden ones are left out,
            // not multiplied by 0). A row with no visible key so far has l_new = 0 and
            // keeps O = 0 rather than 0/0.
            for (int64_t e = tid; e < br * d; e += nthreads) {
                const int64_t r = e / d, x = e % d;
                const TileRange vis = band.cols(r, bc);
                if (vis.begin == vis.end) continue;
                float pv = 0.0f;
                for (int64_t c = vis.begin; c < vis.end; ++c) pv = pyfa_fma(Sij[r * lds + c], Vj[c * d + x], pv);
                const float o_old = O[(row0 + r) * row_o + x];
                const float num = pyfa_fma(oscale[r], o_old, pvscale[r] * pv);
                const float ln = lnew[r];
                O[(row0 + r) * row_o + x] = pyfa_canonical_nan(ln == 0.0f ? 0.0f : num / ln);
            }
        }
    }
}

}  // namespace PYFA_KERNELS
