// fa2_backward_dkdv_fast.cuh: FlashAttention-2 backward, the dK/dV kernel, register-tiled;
// the same bits as fa2_backward_dkdv_kernel (src/kernels/fa2_backward.cuh) and
// pyfa/sim/fa2_backward.py.
//
// Against the readable kernel: 8 warps in two roles over one K/V tile (Bc = 64 keys) and
// each Q tile (Br = 64 rows). Warp w owns the 16 keys (w & 3) * 16 ..; a thread the 8 keys
// (w & 3) * 16 + rg + 2 ii (ii = 0..7) and, of a Q tile, the 4 query rows cg*4 .. cg*4+3.
// Warps 0..3 form S^T = K_j Q_i^T and P, store P_ij^T and add P_ij^T dO_i to dV_j;
// warps 4..7 form dP^T = V_j dO_i^T, take their twin thread's P from P_ij^T, store dS_ij^T
// and add dS_ij^T Q_i to dK_j. So the two halves run the same loops on other operands, and
// dK_j, dV_j (8 keys x d/16 columns a thread) never leave the registers of the warps that
// own them. K_j, V_j are stored transposed once (keys permuted by fast_q_pos: a thread's
// 8 keys at one x are 32 bytes); Q_i and dO_i only row-major, chunks swizzled (swz_qk), by
// cp.async: S^T reads 4 query rows at 4 x, the products 4 rows at one chunk, both 128 bits.
// STAGES = 2 (where a block may hold 227 KiB): Q_i, dO_i have two buffers, and the next
// step's (the next Q tile of the band, or the next query head's first) are copied right
// after the barrier that opens a step, into the buffer the step before left, so that they
// run while this step is computed; STAGES = 1 waits for each step's copies before it.
// The arithmetic is the same either way, so are the bits.
// Shared memory: K_j^T, V_j^T, Q_i, dO_i, P_ij^T, dS_ij^T, 98 KiB at d = 64 and 162 KiB at
// d = 128 (an A100's 163 KiB holds both), 226 KiB at d = 128 with two stages. 128-bit global loads, 32-bit indices inside a
// head, d compile-time.
//
// Per element (docs/numerics.md, FA2 dK/dV): S by pyfa_fma over x in order, times scale,
// -inf if masked; P = (LSE == -inf) ? 0 : exp(S - LSE); dp over x in order;
// dS = score_grad(P, dp, D) (common/score.h); per Q tile dv and dk summed over r in order from +0, then added to
// dV_j and dK_j; query heads of the group g outer, Q tiles of the band inner; at the end
// dK = canonical(dK_j * scale), dV = canonical(dV_j).
#pragma once

#include "common/async_copy.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/smem.h"
#include "kernels/fast/fast_common.h"
#include "kernels/fast/fast_tiles.h"

namespace PYFA_KERNELS {

// Blocks per SM asked of ptxas: two at d = 64 (128 registers, which the scores' loop, not
// unrolled, fits without spilling on sm_80, sm_90 and sm_120), one at d = 128 (left to
// itself ptxas would hold it to 128 registers and spill). sm_86 and sm_89 hold one d = 64
// block per SM anyway (100 KiB of shared memory, docs/gpu_limits.md) and ptxas spills at
// 128 registers there: one is asked. So it is on sm_100, where ptxas has spilled at 128
// registers since the packed-sequence fields of AttentionParams grew (44 B at c827e4d, 88 B
// at 0f94b66): one block of 240 registers, no spill, until the two fit again.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ == 1000)
#define PYFA_DKDV_FAST_D64_BLOCKS 1
#else
#define PYFA_DKDV_FAST_D64_BLOCKS 2
#endif
template <int D, int STAGES = 1>
__global__ void __launch_bounds__(4 * kFastBc, D == 64 ? PYFA_DKDV_FAST_D64_BLOCKS : 1)
    fa2_backward_dkdv_fast_kernel(const AttentionParams params) {
    // Built without the additive bias: no registers left for it (sm_80 to sm_89 spill);
    // core/tiles.cpp sends a call with a bias to the readable kernel.
    // Nor softcap and ALiBi (common/score.h fast_score_params).
    AttentionParams p = fast_score_params<PYFA_KERNEL_FA2_BACKWARD_DKDV, D>(params);
    p.bias = nullptr;
    constexpr int BC = kFastBc;
    constexpr int BR = kFastBc;
    constexpr int NT = 4 * BC;
    constexpr int XC = D / 64;
    constexpr int LDP = BR + 4;  // fast_p_stride(BR)
    static_assert(D == 64 || D == 128, "head dims 64 and 128");
    static_assert(STAGES == 1 || STAGES == 2, "one or two Q_i, dO_i buffers");
    constexpr bool kDrops = fast_kernel_drops(PYFA_KERNEL_FA2_BACKWARD_DKDV, D);  // else never called with dropout

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane >> 4, cg = lane & 15;
    const bool dk_role = warp >= 4;  // warps 4..7: dP, dS, dK; warps 0..3: S, P, dV
    const int wcol = (warp & 3) * 16;
    const int64_t b = blockIdx.z, hk = blockIdx.y;
    const Sequence seq = p.sequence(b);
    const int Nq = static_cast<int>(seq.Nq), Nk = static_cast<int>(seq.Nk);
    const int col0 = static_cast<int>(blockIdx.x) * BC;
    if (col0 >= Nk) return;  // past its sequence's keys
    const int64_t G = p.heads / p.heads_kv;  // query heads per K/V head
    const float* K = p.k + p.k_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride ldk
    const float* V = p.v + p.v_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride ldv
    float* dK = p.dk + p.dk_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride lddk
    float* dV = p.dv + p.dv_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride lddv
    const int ldq = static_cast<int>(p.q_strides.row), lddo = static_cast<int>(p.dout_strides.row);
    const int ldk = static_cast<int>(p.k_strides.row), ldv = static_cast<int>(p.v_strides.row);
    const int lddk = static_cast<int>(p.dk_strides.row), lddv = static_cast<int>(p.dv_strides.row);
    const int bc = imin(BC, Nk - col0);
    const Mask mask = seq.mask;
    const TileRange visit = mask.q_tiles(col0, bc, BR, Nq);

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_backward_dkdv_fast_layout<STAGES>(BR, BC, D);
    float* KjT = smem + L.offset[FA2KVF_KjT];    // (d, Bc), keys permuted by fast_q_pos
    float* VjT = smem + L.offset[FA2KVF_VjT];    // (d, Bc), the same permutation
    float* Qis = smem + L.offset[FA2KVF_Qi];     // STAGES x (Br, d), chunks swizzled by swz_qk
    float* dOis = smem + L.offset[FA2KVF_dOi];   // STAGES x (Br, d), chunks swizzled by swz_qk
    float* PT = smem + L.offset[FA2KVF_PT];      // (Bc, Br), row stride LDP: P_ij^T
    float* dST = smem + L.offset[FA2KVF_dST];    // (Bc, Br), row stride LDP: dS_ij^T

    // Query head g's Q and dO (head hk * G + g), each (Nq, d) with row stride ldq, lddo.
    auto head_q = [&](int64_t g) { return p.q + p.q_strides.at(seq.batch, hk * G + g, seq.q0); };
    auto head_do = [&](int64_t g) { return p.dout + p.dout_strides.at(seq.batch, hk * G + g, seq.q0); };
    // Q tile i of Q and dO into buffer `stage`, one commit group; rows past the tile's end are 0.
    auto copy_q = [&](const float* Q, const float* dO, int i, int stage) {
        const int row0 = i * BR;
        fast_copy_rows2_async<D, BR, NT>(Qis + stage * BR * D, dOis + stage * BR * D, Q, ldq, dO, lddo, row0,
                                         imin(BR, Nq - row0), tid);
    };
    const int ibegin = static_cast<int>(visit.begin), iend = static_cast<int>(visit.end);
    // Two stages: the first step's copies run while K_j^T and V_j^T load.
    if (STAGES == 2 && ibegin < iend) copy_q(head_q(0), head_do(0), ibegin, 0);

    // K_j^T and V_j^T, once (not at all for an empty band); keys past bc are 0.
    if (visit.begin < visit.end) fast_load_transposed2<D, BC, NT>(KjT, VjT, K, ldk, V, ldv, col0, bc, tid);
    // The role's operands: the scores' A^T, the product's A^T rows.
    const float* score_at = (dk_role ? VjT : KjT) + wcol + rg * 8;
    float* prod_at = (dk_role ? dST : PT) + (wcol + rg) * LDP;
    float acc[8][4 * XC];  // dK_j (unscaled) or dV_j of the thread's keys and columns
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int x = 0; x < 4 * XC; ++x) acc[ii][x] = 0.0f;

    int step = 0;  // steps (g, i) done, for the stage with two
    for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const float* Q = head_q(g);
        const float* dO = head_do(g);
        const float* LSE = p.lse + p.stat_at(seq, h);                              // (Nq), dense
        const float* Drow = p.drow + p.stat_at(seq, h);                            // (Nq), dense
        for (int i = ibegin; i < iend; ++i, ++step) {
            const int row0 = i * BR, br = imin(BR, Nq - row0);
            const int stage = STAGES == 2 ? step & 1 : 0;
            if (STAGES == 1) {
                __syncthreads();  // every warp is done with the previous step's Q_i, dO_i, P^T, dS^T
                copy_q(Q, dO, i, 0);
            }
            // The role's row values: LSE (-inf past br) for P, D (0 past br) for dS.
            float rowv[4];
PYFA_UNROLL
            for (int kk = 0; kk < 4; ++kk) {
                const int r = cg * 4 + kk;
                rowv[kk] = dk_role ? (r < br ? Drow[row0 + r] : 0.0f) : (r < br ? LSE[row0 + r] : -INFINITY);
            }
            pyfa_cp_async_wait<0>();  // this thread's copies of this step (two stages: the only group in flight)
            // Every thread's copies of this step have landed; every warp is done with the
            // previous step's P^T, dS^T and (two stages) the Q_i, dO_i buffer the next step goes to.
            __syncthreads();
            if (STAGES == 2) {
                if (i + 1 < iend)
                    copy_q(Q, dO, i + 1, stage ^ 1);
                else if (g + 1 < G)
                    copy_q(head_q(g + 1), head_do(g + 1), ibegin, stage ^ 1);
            }
            const float* Qi = Qis + stage * BR * D;
            const float* dOi = dOis + stage * BR * D;
            // The role's operands: the scores' B, the product's B.
            const float* score_b = dk_role ? dOi : Qi;
            const float* prod_b = dk_role ? Qi : dOi;

            // S^T = K_j Q_i^T (warps 0..3) or dP^T = V_j dO_i^T (warps 4..7), over x in order.
            float s[8][4];
            fast_scores_8x4<D>(score_at, score_b, cg, s);
            // In a tile the mask cuts, a hidden score is P = 0 by selection and is left out
            // of both products; a key that no row of the tile sees takes no step.
            const Band band = mask.band(row0, col0);
            const bool cut = band.cuts(br, bc);
            // The band's edges in 32 bits (|c - r| < 2 BC in a tile), to spare registers.
            const int blo = static_cast<int>(band.lo < -2 * BC ? -2 * BC : band.lo > 2 * BC ? 2 * BC : band.lo);
            const int bhi = static_cast<int>(band.hi < -2 * BC ? -2 * BC : band.hi > 2 * BC ? 2 * BC : band.hi);
            auto seen = [=](int c, int r) { return Band::visible_diff<int, int>(c - r, blo, bhi) != 0; };

            float* prow = PT + (wcol + rg) * LDP;  // the thread's keys' rows of P_ij^T
            if (!dk_role) {
                // P = exp(S - LSE) (0 for a row that sees no key) into P_ij^T: the score
                // pipeline (common/score.h).
PYFA_UNROLL
                for (int ii = 0; ii < 8; ++ii) {
                    const int c = wcol + rg + 2 * ii;
                    float P[4];
PYFA_UNROLL
                    for (int kk = 0; kk < 4; ++kk) {
                        const int r = cg * 4 + kk;
                        P[kk] = fast_score_p(p, s[ii][kk], cut && !seen(c, r), rowv[kk] == -INFINITY, b, h, row0 + r,
                                             col0 + c, [&](float S) { return pyfa_exp(S - rowv[kk]); });
                    }
                    st4(prow + 2 * ii * LDP + cg * 4, pyfa_f4{P[0], P[1], P[2], P[3]});
                }
                // Dropout (common/dropout.h), on the thread's own elements in a loop of its own,
                // so that the generator's registers never meet the scores': dV takes P o Z /
                // (1 - p) in P_ij^T, and dS the undropped P with Z in its sign, in dS_ij^T
                // where its dS will go.
                if (kDrops && p.dropout.on()) {
PYFA_UNROLL_BY(1)
                    for (int e = 0; e < 32; ++e) {
                        const int ii = e >> 2, kk = e & 3, at = 2 * ii * LDP + cg * 4 + kk;
                        const bool kept = p.dropout.keep(b, h, row0 + cg * 4 + kk, col0 + wcol + rg + 2 * ii);
                        const float P = prow[at];
                        dST[(wcol + rg) * LDP + at] = Dropout::flag(P, kept);
                        prow[at] = p.dropout.apply_kept(P, kept);
                    }
                }
            }
            __syncthreads();  // P_ij^T is whole
            if (dk_role) {
                // dS = score_grad(P, dp, D), P from the twin thread of warp w - 4, into
                // dS_ij^T; the score its modification reads, from the twin's operands.
                ScoreAt<float> sa[8][4];
                fast_scores_for_grad<D, true>(p, KjT + wcol + rg * 8, Qi, wcol + rg, cg, row0, col0, b, h, sa);
PYFA_UNROLL
                for (int ii = 0; ii < 8; ++ii) {
                    const int c = wcol + rg + 2 * ii;
                    // With dropout P waits in dS_ij^T, Z in its sign; without, P_ij^T holds it.
                    const pyfa_f4 P4 = ld4((kDrops && p.dropout.on() ? prod_at : prow) + 2 * ii * LDP + cg * 4);
                    const float P[4] = {P4.x, P4.y, P4.z, P4.w};
                    float ds[4];
PYFA_UNROLL
                    for (int kk = 0; kk < 4; ++kk)
                        ds[kk] = score_grad_kept(p, kDrops ? std::fabs(P[kk]) : P[kk], s[ii][kk], rowv[kk],
                                                 !kDrops || Dropout::flagged_kept(P[kk]), sa[ii][kk], b, h,
                                                 row0 + cg * 4 + kk, col0 + c);
                    st4(prod_at + 2 * ii * LDP + cg * 4, pyfa_f4{ds[0], ds[1], ds[2], ds[3]});
                }
                pyfa_syncwarp();
            }
            // dV_j += P_ij^T dO_i (warps 0..3) or dK_j += dS_ij^T Q_i (warps 4..7).
            if (!cut) {
                fast_product_8x4<D, XC, LDP>(prod_at, prod_b, br, cg, acc);
            } else {
                fast_product_8x4<D, XC, LDP, 1>(prod_at, prod_b, br, cg, acc, wcol + rg, blo, bhi);
            }
        }
    }

    // dK = canonical(dK_j * scale), dV = canonical(dV_j); +0 for an empty band.
    float* out = dk_role ? dK : dV;
    const int ldout = dk_role ? lddk : lddv;
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int c = wcol + rg + 2 * ii;
        if (c >= bc) continue;
PYFA_UNROLL
        for (int hh = 0; hh < XC; ++hh) {
            float o[4];
PYFA_UNROLL
            for (int x = 0; x < 4; ++x) {
                const float a = acc[ii][4 * hh + x];
                o[x] = pyfa_canonical_nan(dk_role ? a * p.scale : a);
            }
            stg4(out + (col0 + c) * ldout + cg * 4 + 64 * hh, pyfa_f4{o[0], o[1], o[2], o[3]});
        }
    }
}

}  // namespace PYFA_KERNELS
