// fa1_forward_fast.cuh: FlashAttention-1 forward (Algorithm 1), register-tiled; the same
// bits as the readable kernel (src/kernels/fa1_forward.cuh) and its simulator twin
// pyfa/sim/fa1_forward.py.
//
// What stays: Algorithm 1's structure. One block per (query head h, batch b); K/V tiles j
// outside, K_j and V_j loaded once each; inside, the Q tiles i of the band q_tiles(j) in
// increasing order, each step reading O_i, l_i, m_i from HBM and writing them back, O_i
// normalized after every step (docs/numerics.md, FA1 forward, steps 1-6).
//
// What changes against the readable kernel: the fast FA2 forward's thread layout and
// register tiles (forward_tiles.h): warps own 16 rows each, each thread an 8 x 4 tile of
// S and an 8 x d/16 tile of P V and of O_i; Q_i and K_j transposed in shared memory for
// 128-bit loads; the tile's row max m~_ij as the ordered shuffle tree (fast_common.h);
// P~_ij through shared memory; O_i straight from HBM into the registers of the thread that
// updates each element and back (128-bit accesses), m_i and l_i likewise by the lane that
// keeps the row's statistics; Q_{i+1} prefetched through registers into a second buffer
// while Q_i computes; V_j by cp.async; one barrier per step; 32-bit indices inside a head;
// d, Br, Bc compile-time. Every HBM element of O, m, l is only ever touched by one thread
// (the one that initializes it is the one that updates it), so the initial O = 0,
// m = -inf, l = 0 need no barrier before they are read.
#pragma once

#include "common/device.h"
#include "common/mask.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/smem.h"
#include "common/tiling.h"
#include "kernels/fast/forward_tiles.h"

namespace PYFA_KERNELS {

template <int D, int BR>
__global__ void __launch_bounds__(2 * BR) fa1_forward_fast_kernel(const AttentionParams params) {
    const AttentionParams p = fast_score_params<PYFA_KERNEL_FA1_FORWARD, D>(params);  // what the row takes (common/score.h)
    constexpr int BC = kFastBc;
    constexpr int NT = 2 * BR;
    constexpr int DC = D / 4;      // 16-byte chunks per row of Q, K, V, O
    constexpr int XC = D / 64;     // O chunks per thread per row
    constexpr int LDP = BC + 4;    // fast_p_stride(BC): 4 floats past P~_ij's row for its scales
    static_assert(D == 64 || D == 128, "head dims 64 and 128");
    static_assert(BR == 64 || BR == 128, "Br 64 or 128");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane >> 4, cg = lane & 15;
    const int wrow = warp * 16;      // the warp's first row in the tile
    const int my_row = wrow + lane;  // lanes 0..15: the row whose m, l they keep
    const int64_t b = blockIdx.z, h = blockIdx.y;
    const Sequence seq = p.sequence(b);
    const int Nq = static_cast<int>(seq.Nq), Nk = static_cast<int>(seq.Nk);
    const int64_t hk = h / (p.heads / p.heads_kv);  // the K/V head of this query head
    const float* Q = p.q + p.q_strides.at(seq.batch, h, seq.q0);   // (Nq, d), row stride ldq
    const float* K = p.k + p.k_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride ldk
    const float* V = p.v + p.v_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride ldv
    float* O = p.o + p.o_strides.at(seq.batch, h, seq.q0);         // (Nq, d), row stride ldo; normalized after every step
    float* m = p.m + p.stat_at(seq, h);                                  // (Nq)  running row max, dense
    float* l = p.l + p.stat_at(seq, h);                                  // (Nq)  running row sum, relative to m
    // Row strides fit in int (checked at launch: row stride * seqlen < 2^31).
    const int ldq = static_cast<int>(p.q_strides.row), ldk = static_cast<int>(p.k_strides.row);
    const int ldv = static_cast<int>(p.v_strides.row), ldo = static_cast<int>(p.o_strides.row);
    const Mask mask = seq.mask;

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa1_forward_fast_smem(BR, BC, D);
    float* KjT = smem + L.offset[FA1FF_KjT];            // (d, Bc)
    float* Vj = smem + L.offset[FA1FF_Vj];              // (Bc, d)
    float* QiT = smem + L.offset[FA1FF_QiT];            // 2 x (d, Br), rows permuted by fast_q_pos
    // (Br, Bc) P~_ij, row stride LDP; columns Bc .. Bc + 3 of row r: its o_scale =
    // l_i exp(m_i - m_new), pv_scale = exp(m~_ij - m_new), l_new and m~_ij.
    float* Pij = smem + L.offset[FA1FF_Pij];

    // O = 0, m = -inf, l = 0 in HBM for all Nq rows, each element by its owner.
    const pyfa_f4 zero4{0.f, 0.f, 0.f, 0.f};
    for (int row0 = 0; row0 < Nq; row0 += BR) {
        const int br = imin(BR, Nq - row0);
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            const int r = wrow + rg + 2 * ii;
            if (r >= br) continue;
PYFA_UNROLL
            for (int hh = 0; hh < XC; ++hh) stg4(O + (row0 + r) * ldo + cg * 4 + 64 * hh, zero4);
        }
        if (lane < 16 && my_row < br) {
            m[row0 + my_row] = -INFINITY;
            l[row0 + my_row] = 0.0f;
        }
    }

    // Q_i and K_j come through registers (they are transposed on the way) in parts of 4
    // chunks per thread. Q_{i+1} is loaded in QPARTS parts, one at each point of the step
    // below and stored at the next, so that at most 16 registers hold it at a time.
    constexpr int PART = 4;
    constexpr int QPARTS = BR * DC / NT / PART;
    constexpr int KPARTS = BC * DC / NT / PART;
    static_assert(QPARTS >= 1 && QPARTS <= 4 && KPARTS >= 1, "Q_i's parts fit the step's 5 points");
    pyfa_f4 pre[PART];

    const int Tc = static_cast<int>(ceil_div(Nk, BC));
    for (int j = 0; j < Tc; ++j) {
        const int col0 = j * BC, bc = imin(BC, Nk - col0);
        const TileRange band = mask.q_tiles(col0, bc, BR, Nq);
        const int ib = static_cast<int>(band.begin), ie = static_cast<int>(band.end);
        if (ib == ie) continue;  // no row sees this tile: not even loaded
        // Every warp is done with K_{j-1}, V_{j-1} and both Q buffers.
        __syncthreads();
        fast_cp_async_rows<BC, D, NT>(Vj, V + col0 * ldv, ldv, bc, tid);  // keys past bc zero
        for (int part = 0; part < KPARTS; ++part) {  // K_j^T, keys past bc zero
            fast_load_chunks<BC, NT>(pre, K + col0 * ldk, ldk, bc, part * PART, tid);
            fast_store_chunks_t<BC, NT, PART, false>(KjT, pre, part * PART, tid);
        }
        {  // Q_i^T of the band's first tile, rows past br zero
            const int row0 = ib * BR, br = imin(BR, Nq - row0);
            for (int part = 0; part < QPARTS; ++part) {
                fast_load_chunks<BR, NT>(pre, Q + row0 * ldq, ldq, br, part * PART, tid);
                fast_store_chunks_t<BR, NT, PART, true>(QiT, pre, part * PART, tid);
            }
        }

        for (int i = ib; i < ie; ++i) {
            const int buf = (i - ib) & 1;
            const int row0 = i * BR, br = imin(BR, Nq - row0);
            const bool has_next = i + 1 < ie;
            const float* Qt = QiT + buf * (D * BR);
            float* Qnext = QiT + (buf ^ 1) * (D * BR);
            const int next0 = row0 + BR;
            // At point t of the step: store part t - 1 of Q_{i+1}^T, load part t.
            auto q_stage = [&](int point) {
                if (!has_next) return;
                if (point >= 1 && point <= QPARTS)
                    fast_store_chunks_t<BR, NT, PART, true>(Qnext, pre, (point - 1) * PART, tid);
                if (point < QPARTS)
                    fast_load_chunks<BR, NT>(pre, Q + next0 * ldq, ldq, imin(BR, Nq - next0), point * PART, tid);
            };
            pyfa_cp_async_wait<0>();
            // Q_i (and K_j, V_j) are visible; every warp is done with step i - 1, whose Q
            // buffer now takes Q_{i+1}.
            __syncthreads();
            q_stage(0);

            // m_i, l_i of the lane's row, read early (step 5 uses them).
            float m_old = -INFINITY, l_old = 0.0f;
            if (lane < 16 && my_row < br) {
                m_old = m[row0 + my_row];
                l_old = l[row0 + my_row];
            }

            // 1. S_ij[r, c] = scale * sum_x Q_i[r, x] K_j[c, x], x in order; -inf if masked.
            float s[8][4];
            fast_s_tile<D, BR, BC>(Qt + wrow + rg * 8, KjT + cg * 4, s);
            q_stage(1);
            fast_scale_mask<D != 128>(s, p, mask, b, h, row0, br, col0, bc, wrow, rg, cg);
            // In a tile the mask cuts, hidden scores are left out of P V and a row that
            // sees none of its keys takes no step: its m, l and O stay (common/score.h).
            const Band band = mask.band(row0, col0);
            const bool cut = band.cuts(br, bc);

            // 2. m~_ij = pyfa_max over (-inf, S[r, 0 .. bc-1]) in order; 3. P~_ij =
            // exp(S_ij - safe_max(m~_ij)).
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const float mt = fast_row_max_exp(s[ii], -INFINITY, cg, Pij + (wrow + rg + 2 * ii) * LDP + cg * 4);
                if (cg == 0) Pij[(wrow + rg + 2 * ii) * LDP + BC + 3] = mt;
            }
            pyfa_syncwarp();
            q_stage(2);

            // 4. l~_ij = sum_c P~_ij[r, c], c = 0 .. bc-1 in order; 5. the row statistics,
            // one lane per row, written back to HBM.
            if (lane < 16) {
                float* prow = Pij + my_row * LDP;
                const float mt = prow[BC + 3];
                float lt = 0.0f;
                for (int c = 0; c < bc; ++c) lt = lt + prow[c];
                const float m_new = pyfa_max(m_old, mt);
                const float alpha = pyfa_exp(m_old - safe_max(m_new));  // exp(m_i - m_new)
                const float beta = pyfa_exp(mt - safe_max(m_new));      // exp(m~_ij - m_new)
                const float os = l_old * alpha;
                const float l_new = pyfa_fma(beta, lt, os);
                st4(prow + BC, pyfa_f4{os, beta, l_new, mt});
                // P V takes P~ o Z / (1 - p) (common/dropout.h); l~ above took P~ undropped.
                if (fast_kernel_drops(PYFA_KERNEL_FA1_FORWARD, D)) p.dropout.apply_row(prow, bc, b, h, row0 + my_row, col0);
                if (my_row < br && (!cut || band.cols(my_row, bc).begin != band.cols(my_row, bc).end)) {
                    m[row0 + my_row] = pyfa_canonical_nan(m_new);
                    l[row0 + my_row] = pyfa_canonical_nan(l_new);
                }
            }
            pyfa_syncwarp();
            q_stage(3);

            // 6. pv = sum_c P~_ij[r, c] V_j[c, x], c in order; O_i = fma(o_scale, O_i,
            // pv_scale * pv) / l_new, or 0 for a row with no visible key so far (l_new = 0).
            pyfa_f4 o[8][XC];
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const int r = wrow + rg + 2 * ii;
PYFA_UNROLL
                for (int hh = 0; hh < XC; ++hh)
                    o[ii][hh] = r < br ? ld4(O + (row0 + r) * ldo + cg * 4 + 64 * hh) : zero4;
            }
            float pv[8][4 * XC];
            if (!cut) {
                fast_pv_tile<D, LDP>(Pij + (wrow + rg) * LDP, Vj + cg * 4, bc, pv);
            } else {
                fast_pv_tile<D, LDP, true>(Pij + (wrow + rg) * LDP, Vj + cg * 4, bc, pv, band, wrow + rg);
            }
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const int r = wrow + rg + 2 * ii;
                if (r >= br || (cut && band.cols(r, bc).begin == band.cols(r, bc).end)) continue;
                const pyfa_f4 rs = ld4(Pij + r * LDP + BC);
                const float os = rs.x, beta = rs.y, ln = rs.z;
PYFA_UNROLL
                for (int hh = 0; hh < XC; ++hh) {
                    const float* w = pv[ii] + 4 * hh;
                    pyfa_f4 out;
                    out.x = pyfa_canonical_nan(ln == 0.0f ? 0.0f : pyfa_fma(os, o[ii][hh].x, beta * w[0]) / ln);
                    out.y = pyfa_canonical_nan(ln == 0.0f ? 0.0f : pyfa_fma(os, o[ii][hh].y, beta * w[1]) / ln);
                    out.z = pyfa_canonical_nan(ln == 0.0f ? 0.0f : pyfa_fma(os, o[ii][hh].z, beta * w[2]) / ln);
                    out.w = pyfa_canonical_nan(ln == 0.0f ? 0.0f : pyfa_fma(os, o[ii][hh].w, beta * w[3]) / ln);
                    stg4(O + (row0 + r) * ldo + cg * 4 + 64 * hh, out);
                }
            }
            q_stage(4);
        }
    }
}

}  // namespace PYFA_KERNELS
