// fa2_forward_fast.cuh: FlashAttention-2 forward, register-tiled; the same bits as the
// readable kernel (src/kernels/fa2_forward.cuh) and its simulator twin pyfa/sim/fa2_forward.py.
//
// Against the readable kernel: warps own 16 query rows each (m, alpha in the warp); each
// thread holds an 8 x 4 tile of S and an 8 x d/16 tile of O and of P V in registers; Q_i
// and K_j sit transposed in shared memory (128-bit loads of 8 rows / 4 keys at one x);
// 128-bit global loads; V_j by cp.async and K_j by register prefetch, both double
// buffered; one barrier per K/V tile; the row max as an ordered shuffle tree
// (fast_common.h); 32-bit indices inside a head; d, Br, Bc compile-time.
//
// Thread layout: warp w, lane = 16 rg + cg. The thread's rows are w*16 + rg + 2 ii
// (ii = 0..7), its S columns cg*4 .. cg*4+3, its O columns the 4-float chunks cg (and
// cg + 16 when d = 128). Every element is computed as docs/numerics.md §5 writes it:
// S[r,c] by pyfa_fma over x in order, times scale; the max over c in order (the tree is
// that scan's bits); P = exp(S - safe_max(m)); the row sum over c in order by one lane per
// row; P V over c in order; O = fma(alpha, O, pv), l = fma(alpha, l, rowsum).
#pragma once

#include "common/device.h"
#include "common/fault.h"
#include "common/mask.h"
#include "common/merge.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/smem.h"
#include "common/tiling.h"
#include "kernels/fast/forward_tiles.h"

namespace PYFA_KERNELS {

// What the fast kernels read of AttentionParams, in one place (the strides and the mask).
struct FastHead {
    const float* q;  // (Nq, d) of this head, row stride ldq
    const float* k;  // (Nk, d), row stride ldk
    const float* v;  // (Nk, d), row stride ldv
    float* o;        // (Nq, d), row stride ldo
    float* lse;      // (Nq)
    int ldq, ldk, ldv, ldo;
};

// Query head h of sequence seq reads K/V head h / (H / Hkv); row strides fit in int
// (checked at launch).
PYFA_HD FastHead fast_head(const AttentionParams& p, const Sequence& seq, int64_t h) {
    const int64_t hk = h / (p.heads / p.heads_kv);
    FastHead f;
    f.q = p.q + p.q_strides.at(seq.batch, h, seq.q0);
    f.k = p.k + p.k_strides.at(seq.batch, hk, seq.k0);
    f.v = p.v + p.v_strides.at(seq.batch, hk, seq.k0);
    f.o = p.o + p.o_strides.at(seq.batch, h, seq.q0);
    f.lse = p.lse + p.stat_at(seq, h);
    f.ldq = static_cast<int>(p.q_strides.row);
    f.ldk = static_cast<int>(p.k_strides.row);
    f.ldv = static_cast<int>(p.v_strides.row);
    f.ldo = static_cast<int>(p.o_strides.row);
    return f;
}

template <int D, int BR>
__global__ void __launch_bounds__(2 * BR) fa2_forward_fast_kernel(const AttentionParams params) {
    const AttentionParams p = fast_score_params<PYFA_KERNEL_FA2_FORWARD, D>(params);  // what the row takes (common/score.h)
    constexpr int BC = kFastBc;
    constexpr int NT = 2 * BR;
    constexpr int DC = D / 4;      // 16-byte chunks per row of Q, K, V, O
    constexpr int XC = D / 64;     // O chunks per thread per row
    constexpr int LDP = BC + 4;    // fast_p_stride(BC)
    static_assert(D == 64 || D == 128, "head dims 64 and 128");
    static_assert(BR == 64 || BR == 128, "Br 64 or 128");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane >> 4, cg = lane & 15;
    const int wrow = warp * 16;                 // the warp's first row in the tile
    const Sequence seq = p.sequence(blockIdx.z);
    const int Nq = static_cast<int>(seq.Nq), Nk = static_cast<int>(seq.Nk);
    const int row0 = static_cast<int>(blockIdx.x) * BR;
    if (row0 >= Nq) return;  // past its sequence's rows
    const FastHead g = fast_head(p, seq, blockIdx.y);
    const int br = imin(BR, Nq - row0);
    const Mask mask = seq.mask;
    const TileRange tiles = mask.kv_tiles(row0, br, BC, Nk);
    const int jb = static_cast<int>(tiles.begin), je = static_cast<int>(tiles.end);

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_forward_fast_smem(BR, BC, D);
    float* QiT = smem + L.offset[FA2FF_QiT];     // (d, Br), rows permuted by fast_q_pos
    float* KjT = smem + L.offset[FA2FF_KjT];     // 2 x (d, Bc)
    float* Vj = smem + L.offset[FA2FF_Vj];       // 2 x (Bc, d)
    float* Pij = smem + L.offset[FA2FF_Pij];     // (Br, Bc), row stride LDP
    float* mi = smem + L.offset[FA2FF_mi];       // (Br)
    float* alpha_s = smem + L.offset[FA2FF_alpha];  // (Br)

    // Q_i^T, once: 128-bit loads along rows, stored one float per x; rows past br are 0.
PYFA_UNROLL
    for (int t = 0; t < BR * DC / NT; ++t) {
        const int e = tid + t * NT, r = e & (BR - 1), x4 = e / BR;
        const bool ok = r < br;
        const pyfa_f4 q = ok ? ld4(g.q + (row0 + r) * g.ldq + 4 * x4 + (PYFA_FAULT(align) ? 1 : 0))
                             : pyfa_f4{0.f, 0.f, 0.f, 0.f};
        const int pos = fast_q_pos(r);
        QiT[(4 * x4 + 0) * BR + pos] = q.x;
        QiT[(4 * x4 + 1) * BR + pos] = q.y;
        QiT[(4 * x4 + 2) * BR + pos] = q.z;
        QiT[(4 * x4 + 3) * BR + pos] = q.w;
    }

    // K_j^T by registers (it is transposed on the way); keys past bc are 0. K_{j+1} comes
    // in parts of 4 chunks per thread (16 registers): with two parts, part 0 is held across
    // S and part 1 across the softmax; with more (d = 128, Br = 64: 16 chunks per thread)
    // all are loaded and stored at the start of the tile, so that no stretch of the tile
    // runs out of registers.
    constexpr int KPT = BC * DC / NT;  // 16-byte chunks of K_j per thread
    constexpr int KPART = 4;
    constexpr int KPARTS = KPT / KPART;
    static_assert(KPT % KPART == 0, "K_j splits into parts of 4 chunks per thread");
    pyfa_f4 kpre[KPART];
    auto load_k = [&](int j, int part) {
        const int col0 = j * BC;
        fast_load_chunks<BC, NT>(kpre, g.k + col0 * g.ldk, g.ldk, imin(BC, Nk - col0), part * KPART, tid);
    };
    auto store_k = [&](float* dst, int part) { fast_store_chunks_t<BC, NT, KPART, false>(dst, kpre, part * KPART, tid); };
    // V_j by cp.async, rows along rows; keys past bc are 0.
    auto load_v = [&](int j, float* dst) {
        const int col0 = j * BC;
        fast_cp_async_rows<BC, D, NT>(dst, g.v + col0 * g.ldv, g.ldv, imin(BC, Nk - col0), tid);
    };

    if (jb < je) {
        load_v(jb, Vj);
        for (int part = 0; part < KPARTS; ++part) {
            load_k(jb, part);
            store_k(KjT, part);
        }
    }

    float o[8][4 * XC];        // O_i rows w*16 + rg + 2 ii, columns of chunks cg (+16)
    float m[8];                // m_i of the thread's rows, the same in the 16 lanes of rg
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        m[ii] = -INFINITY;
PYFA_UNROLL
        for (int x = 0; x < 4 * XC; ++x) o[ii][x] = 0.0f;
    }
    // Lanes 0..15 keep the running m and l of row w*16 + lane for the row sums and LSE.
    float m_row = -INFINITY, l_row = 0.0f;
    const int my_row = wrow + lane;

    for (int j = jb; j < je; ++j) {
        const int buf = (j - jb) & 1;
        const int col0 = j * BC, bc = imin(BC, Nk - col0);
        const bool has_next = j + 1 < je;
        const float* Kt = KjT + buf * (D * BC);
        const float* Vt = Vj + buf * (BC * D);
        if (PYFA_FAULT(async_count))
            pyfa_cp_async_wait<1>();
        else if (!PYFA_FAULT(async_drop))
            pyfa_cp_async_wait<0>();
        // K_j, V_j (and Q_i) are visible; every warp is done with tile j-1, whose buffers
        // now take tile j+1.
        __syncthreads();
        float* Knext = KjT + (buf ^ 1) * (D * BC);
        if (has_next) {
            load_v(j + 1, Vj + (buf ^ 1) * (BC * D));
            if (KPARTS > 2) {
                for (int part = 0; part < KPARTS; ++part) {
                    load_k(j + 1, part);
                    store_k(Knext, part);
                }
            } else {
                load_k(j + 1, 0);
            }
        }

        // S = Q_i K_j^T: s[ii][kk] = sum_x Q[row ii, x] K[col cg*4+kk, x], x in order.
        float s[8][4];
        fast_s_tile<D, BR, BC>(QiT + wrow + rg * 8, Kt + cg * 4, s);
        if (has_next && KPARTS <= 2) {
            store_k(Knext, 0);
            if (KPARTS == 2) load_k(j + 1, 1);
        }

        fast_scale_mask(s, p, mask, blockIdx.z, blockIdx.y, row0, br, col0, bc, wrow, rg, cg);
        // In a tile the mask cuts, hidden scores are left out of P V and a row that sees
        // none of its keys takes no step (common/score.h).
        const Band band = mask.band(row0, col0);
        const bool cut = band.cuts(br, bc);

        // m_new = pyfa_max over (m_old, S[r, 0 .. bc-1]) in order; P = exp(S - safe_max(m_new)).
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            m[ii] = fast_row_max_exp(s[ii], m[ii], cg, Pij + (wrow + rg + 2 * ii) * LDP + cg * 4);
            if (cg == 0) mi[wrow + rg + 2 * ii] = m[ii];
        }
        if (!PYFA_FAULT(warp_race)) pyfa_syncwarp();
        if (PYFA_FAULT(warp_mask)) (void)__shfl_sync(0x0000ffffu, 0.0f, 0);

        // One lane per row: alpha = exp(m_old - safe_max(m_new)), the row sum over
        // c = 0 .. bc-1 in order, l = fma(alpha, l, rowsum).
        if (lane < 16) {
            const float m_new = mi[my_row];
            const float a = pyfa_exp(m_row - safe_max(m_new));
            if (!cut || band.cols(my_row, bc).begin != band.cols(my_row, bc).end) {
                m_row = m_new;
                float* prow = Pij + my_row * LDP;
                float rowsum = 0.0f;
                for (int c = 0; c < bc; ++c) rowsum = rowsum + prow[c];
                l_row = pyfa_fma(a, l_row, rowsum);
                // P V takes P~ o Z / (1 - p) (common/dropout.h); l above took P~ undropped.
                if (fast_kernel_drops(PYFA_KERNEL_FA2_FORWARD, D))
                    p.dropout.apply_row(prow, bc, blockIdx.z, blockIdx.y, row0 + my_row, col0);
            }
            alpha_s[my_row] = a;
        }
        pyfa_syncwarp();

        if (has_next && KPARTS == 2) store_k(Knext, 1);

        // pv = sum_c P[r, c] V[c, x], c in order; O = fma(alpha, O, pv).
        float pv[8][4 * XC];
        if (!cut) {
            fast_pv_tile<D, LDP>(Pij + (wrow + rg) * LDP, Vt + cg * 4, bc, pv);
        } else {
            fast_pv_tile<D, LDP, true>(Pij + (wrow + rg) * LDP, Vt + cg * 4, bc, pv, band, wrow + rg);
        }
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            const int r = wrow + rg + 2 * ii;
            const float a = alpha_s[r];
            const bool steps = !cut || band.cols(r, bc).begin != band.cols(r, bc).end;
PYFA_UNROLL
            for (int x = 0; x < 4 * XC; ++x) o[ii][x] = steps ? pyfa_fma(a, o[ii][x], pv[ii][x]) : o[ii][x];
        }
    }

    // O = O / l, LSE = m + log(l); a row that saw no key gets O = 0, LSE = -inf. The
    // warp's reads of alpha (and m) come before l (and LSE) take their place. Attention
    // sinks then merge each row's final state with the head's sink (common/merge.h), one
    // MergeStep per row: without sinks (sink -inf) it skips and leaves both as they are.
    // Its part 0 is (O, LSE): LSE is -inf exactly where l is 0, where O is 0 as the rule's
    // skipped part 0 leaves it.
    const float lse_row = pyfa_canonical_nan(l_row == 0.0f ? -INFINITY : m_row + pyfa_log(l_row));
    const float sink = p.sink(blockIdx.y);
    pyfa_syncwarp();
    if (lane < 16) {
        alpha_s[my_row] = l_row;
        mi[my_row] = lse_row;
    }
    pyfa_syncwarp();
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int r = wrow + rg + 2 * ii;
        if (r >= br) continue;
        const float l = alpha_s[r];
        const MergeStep step = merge_step(mi[r], sink);
PYFA_UNROLL
        for (int h = 0; h < XC; ++h) {
            pyfa_f4 out;
            out.x = pyfa_canonical_nan(step.apply(l == 0.0f ? 0.0f : o[ii][4 * h + 0] / l, 0.0f));
            out.y = pyfa_canonical_nan(step.apply(l == 0.0f ? 0.0f : o[ii][4 * h + 1] / l, 0.0f));
            out.z = pyfa_canonical_nan(step.apply(l == 0.0f ? 0.0f : o[ii][4 * h + 2] / l, 0.0f));
            out.w = pyfa_canonical_nan(step.apply(l == 0.0f ? 0.0f : o[ii][4 * h + 3] / l, 0.0f));
            stg4(g.o + (row0 + r) * g.ldo + cg * 4 + 64 * h, out);
        }
    }
    if (lane < 16 && my_row < br) g.lse[row0 + my_row] = pyfa_canonical_nan(merge_step(lse_row, sink).lse);
}

}  // namespace PYFA_KERNELS
