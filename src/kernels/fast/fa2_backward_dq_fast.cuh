// fa2_backward_dq_fast.cuh: FlashAttention-2 backward, the dQ kernel, register-tiled; the
// same bits as fa2_backward_dq_kernel (src/kernels/fa2_backward.cuh) and
// pyfa/sim/fa2_backward.py.
//
// Against the readable kernel, at d = 64 (Br = 64 or 128): the forward fast kernel's
// thread layout (warps own 16 rows, each thread an 8 x 4 tile of S and of dP and of each
// 64 columns of dq); Q_i, dO_i, K_j, V_j transposed in shared memory for 128-bit loads,
// K_j also row-major for dS K, dQ_i in shared memory. At d = 128 (Br = Bc = 64) twice the
// warps in two roles, dQ_i in registers and K_j, V_j only row-major (see
// fa2_backward_dq_fast_roles), so that the block fits with 8 warps. Both: 128-bit global
// loads; LSE and D of the thread's rows in registers; 32-bit indices inside a head; d and
// Br compile-time. Per element (docs/numerics.md §5):
// S by pyfa_fma over x in order, times scale, -inf if masked; P = (LSE == -inf) ? 0 :
// exp(S - LSE); dp over x in order; dS = score_grad(P, dp, D) (common/score.h); dq over c
// in order from +0;
// dQ_i = dQ_i + dq; at the end dQ = canonical(dQ_i * scale).
#pragma once

#include "common/async_copy.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/smem.h"
#include "common/tiling.h"
#include "kernels/fast/fast_common.h"
#include "kernels/fast/fast_tiles.h"

namespace PYFA_KERNELS {

// What both dQ paths read of AttentionParams: the block's Q tile (rows row0 .. row0+br-1)
// of query head blockIdx.y in sequence blockIdx.z, the K/V head it reads, the band of K/V
// tiles it visits and the sequence's mask. br <= 0: the tile is past the sequence's rows.
struct FastDqBlock {
    const float* Q;     // (Nq, d), row stride ldq
    const float* dO;    // (Nq, d), row stride lddo
    const float* K;     // (Nk, d), row stride ldk
    const float* V;     // (Nk, d), row stride ldv
    float* dQ;          // (Nq, d), row stride lddq
    const float* LSE;   // (Nq), dense
    const float* Drow;  // (Nq), dense
    int ldq, lddo, ldk, ldv, lddq;
    int Nk, row0, br;
    TileRange tiles;
    Mask mask;
};

PYFA_DEV FastDqBlock fast_dq_block(const AttentionParams& p, int Br, int Bc) {
    const int64_t h = blockIdx.y;
    const Sequence seq = p.sequence(blockIdx.z);
    const int64_t hk = h / (p.heads / p.heads_kv);
    FastDqBlock f;
    f.Q = p.q + p.q_strides.at(seq.batch, h, seq.q0);
    f.dO = p.dout + p.dout_strides.at(seq.batch, h, seq.q0);
    f.K = p.k + p.k_strides.at(seq.batch, hk, seq.k0);
    f.V = p.v + p.v_strides.at(seq.batch, hk, seq.k0);
    f.dQ = p.dq + p.dq_strides.at(seq.batch, h, seq.q0);
    f.LSE = p.lse + p.stat_at(seq, h);
    f.Drow = p.drow + p.stat_at(seq, h);
    f.ldq = static_cast<int>(p.q_strides.row);
    f.lddo = static_cast<int>(p.dout_strides.row);
    f.ldk = static_cast<int>(p.k_strides.row);
    f.ldv = static_cast<int>(p.v_strides.row);
    f.lddq = static_cast<int>(p.dq_strides.row);
    f.Nk = static_cast<int>(seq.Nk);
    f.row0 = static_cast<int>(blockIdx.x) * Br;
    f.br = imin(Br, static_cast<int>(seq.Nq) - f.row0);
    f.mask = seq.mask;
    f.tiles = f.mask.kv_tiles(f.row0, f.br, Bc, f.Nk);
    return f;
}

// d = 64: warps own 16 rows (2 * Br threads).
template <int D, int BR>
PYFA_DEV void fa2_backward_dq_fast_rows(const AttentionParams& p) {
    constexpr int BC = kFastBc;
    constexpr int NT = 2 * BR;
    constexpr int DC = D / 4;
    constexpr int XC = D / 64;
    constexpr int LDP = BC + 4;  // fast_p_stride(BC)
    static_assert(D == 64, "head dim 64");
    static_assert(BR == 64 || BR == 128, "Br 64 or 128");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane >> 4, cg = lane & 15;
    const int wrow = warp * 16;
    const auto [Q, dO, K, V, dQ, LSE, Drow, ldq, lddo, ldk, ldv, lddq, Nk, row0, br, tiles, mask] =
        fast_dq_block(p, BR, BC);
    if (br <= 0) return;  // past its sequence's rows

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_backward_dq_fast_smem(BR, BC, D);
    float* QiT = smem + L.offset[FA2DQF_QiT];    // (d, Br), rows permuted by fast_q_pos
    float* dOiT = smem + L.offset[FA2DQF_dOiT];  // (d, Br), the same permutation
    float* KjT = smem + L.offset[FA2DQF_KjT];    // (d, Bc)
    float* VjT = smem + L.offset[FA2DQF_VjT];    // (d, Bc)
    float* Kj = smem + L.offset[FA2DQF_Kj];      // (Bc, d)
    float* dSij = smem + L.offset[FA2DQF_dSij];  // (Br, Bc), row stride LDP
    float* dQi = smem + L.offset[FA2DQF_dQi];    // (Br, d), unscaled; a thread's own elements

    // Q_i^T and dO_i^T, once; rows past br are 0.
    fast_load_transposed2<D, BR, NT>(QiT, dOiT, Q, ldq, dO, lddo, row0, br, tid);

    float lse[8], drow[8];
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int r = wrow + rg + 2 * ii;
        lse[ii] = r < br ? LSE[row0 + r] : -INFINITY;
        drow[ii] = r < br ? Drow[row0 + r] : 0.0f;
PYFA_UNROLL
        for (int hh = 0; hh < XC; ++hh) st4(dQi + r * D + cg * 4 + 64 * hh, pyfa_f4{0.f, 0.f, 0.f, 0.f});
    }

    for (int j = static_cast<int>(tiles.begin); j < static_cast<int>(tiles.end); ++j) {
        const int col0 = j * BC, bc = imin(BC, Nk - col0);
        __syncthreads();  // every warp is done with tile j-1's K_j, V_j
        // K_j (twice) and V_j^T; keys past bc are 0.
PYFA_UNROLL
        for (int t = 0; t < BC * DC / NT; ++t) {
            const int e = tid + t * NT, c = e & (BC - 1), x4 = e / BC;
            const bool ok = c < bc;
            const pyfa_f4 kv = ok ? ld4(K + (col0 + c) * ldk + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
            const pyfa_f4 vv = ok ? ld4(V + (col0 + c) * ldv + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
            KjT[(4 * x4 + 0) * BC + c] = kv.x;
            KjT[(4 * x4 + 1) * BC + c] = kv.y;
            KjT[(4 * x4 + 2) * BC + c] = kv.z;
            KjT[(4 * x4 + 3) * BC + c] = kv.w;
            VjT[(4 * x4 + 0) * BC + c] = vv.x;
            VjT[(4 * x4 + 1) * BC + c] = vv.y;
            VjT[(4 * x4 + 2) * BC + c] = vv.z;
            VjT[(4 * x4 + 3) * BC + c] = vv.w;
            st4(Kj + c * D + 4 * x4, kv);
        }
        __syncthreads();

        // S = Q_i K_j^T and dP = dO_i V_j^T, each summed x = 0 .. d-1 in order.
        float s[8][4], dp[8][4];
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
            for (int kk = 0; kk < 4; ++kk) s[ii][kk] = dp[ii][kk] = 0.0f;
        const float* qp = QiT + wrow + rg * 8;
        const float* gp = dOiT + wrow + rg * 8;
        const float* kp = KjT + cg * 4;
        const float* vp = VjT + cg * 4;
PYFA_UNROLL_BY(4)
        for (int x = 0; x < D; ++x) {
            const pyfa_f4 qa = ld4(qp + x * BR), qb = ld4(qp + x * BR + 4);
            const pyfa_f4 ga = ld4(gp + x * BR), gb = ld4(gp + x * BR + 4);
            const pyfa_f4 kv = ld4(kp + x * BC), vv = ld4(vp + x * BC);
            const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            const float gv[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
            const float kx[4] = {kv.x, kv.y, kv.z, kv.w};
            const float vx[4] = {vv.x, vv.y, vv.z, vv.w};
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk) {
                    s[ii][kk] = pyfa_fma(qv[ii], kx[kk], s[ii][kk]);
                    dp[ii][kk] = pyfa_fma(gv[ii], vx[kk], dp[ii][kk]);
                }
        }

        // dS = score_grad(P, dp, D), P = exp(S - LSE) (0 for a row that sees no key), into the
        // warp's rows of dS_ij: the score pipeline (common/score.h). In a tile the mask cuts,
        // a hidden score is dS = 0 by selection and is left out of dS K, and a row that sees
        // no key of the tile takes no step.
        const Band band = mask.band(row0, col0);
        const bool cut = band.cuts(br, bc);
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            const int r = wrow + rg + 2 * ii;
            float ds[4];
PYFA_UNROLL
            for (int kk = 0; kk < 4; ++kk) {
                const int c = cg * 4 + kk;
                const bool hidden = cut && !band.visible(r, c);
                const float P = fast_score_p(p, s[ii][kk], hidden, lse[ii] == -INFINITY, blockIdx.z, blockIdx.y,
                                             row0 + r, col0 + c, [&](float S) { return pyfa_exp(S - lse[ii]); });
                const ScoreAt<float> at = score_mod_is_identity(p)
                                              ? ScoreAt<float>{}
                                              : score_at(p, s[ii][kk] * p.scale, blockIdx.z, blockIdx.y, row0 + r,
                                                         col0 + c);
                ds[kk] = hidden ? 0.0f : score_grad(p, P, dp[ii][kk], drow[ii], at, blockIdx.z, blockIdx.y, row0 + r,
                                                    col0 + c);
            }
            st4(dSij + r * LDP + cg * 4, pyfa_f4{ds[0], ds[1], ds[2], ds[3]});
        }
        pyfa_syncwarp();

        // dq = sum_c dS[r, c] K[c, x], c = 0 .. bc-1 in order; dQ_i = dQ_i + dq. One
        // 4-column chunk of the thread's columns at a time (two at d = 128): registers.
        const float* dsp = dSij + (wrow + rg) * LDP;
PYFA_UNROLL
        for (int hh = 0; hh < XC; ++hh) {
            const float* krow = Kj + cg * 4 + 64 * hh;
            float dq[8][4];
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
                for (int x = 0; x < 4; ++x) dq[ii][x] = 0.0f;
            // Hidden steps are left out in a tile the mask cuts (Masked<true>); a whole
            // tile's loop tests nothing.
            auto product = [&](auto m) {
                constexpr bool masked = decltype(m)::on;
                int c = 0;
                for (; c + 4 <= bc; c += 4) {
                    pyfa_f4 kx[4];
PYFA_UNROLL
                    for (int cc = 0; cc < 4; ++cc) kx[cc] = ld4(krow + (c + cc) * D);
PYFA_UNROLL
                    for (int ii = 0; ii < 8; ++ii) {
                        const pyfa_f4 pr = ld4(dsp + 2 * ii * LDP + c);
                        const float pc[4] = {pr.x, pr.y, pr.z, pr.w};
PYFA_UNROLL
                        for (int cc = 0; cc < 4; ++cc) {
                            const bool kept = !masked || band.visible(wrow + rg + 2 * ii, c + cc);
                            const float kv[4] = {kx[cc].x, kx[cc].y, kx[cc].z, kx[cc].w};
PYFA_UNROLL
                            for (int x = 0; x < 4; ++x) {
                                const float u = pyfa_fma(pc[cc], kv[x], dq[ii][x]);
                                dq[ii][x] = kept ? u : dq[ii][x];
                            }
                        }
                    }
                }
                if (c < bc) {  // the last 1..3 keys of a tail tile, in order
PYFA_UNROLL
                    for (int cc = 0; cc < 3; ++cc) {
                        if (c + cc < bc) {
                            const pyfa_f4 v = ld4(krow + (c + cc) * D);
PYFA_UNROLL
                            for (int ii = 0; ii < 8; ++ii) {
                                const float pc = dsp[2 * ii * LDP + c + cc];
                                const bool kept = !masked || band.visible(wrow + rg + 2 * ii, c + cc);
                                const float kv[4] = {v.x, v.y, v.z, v.w};
PYFA_UNROLL
                                for (int x = 0; x < 4; ++x) {
                                    const float u = pyfa_fma(pc, kv[x], dq[ii][x]);
                                    dq[ii][x] = kept ? u : dq[ii][x];
                                }
                            }
                        }
                    }
                }
            };
            if (!cut) {
                product(Masked<false>{});
            } else {
                product(Masked<true>{});
            }
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const int r = wrow + rg + 2 * ii;
                if (cut && band.cols(r, bc).begin == band.cols(r, bc).end) continue;
                float* acc = dQi + r * D + cg * 4 + 64 * hh;
                const pyfa_f4 a = ld4(acc);
                st4(acc, pyfa_f4{a.x + dq[ii][0], a.y + dq[ii][1], a.z + dq[ii][2], a.w + dq[ii][3]});
            }
        }
    }

    // dQ = canonical(dQ_i * scale).
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int r = wrow + rg + 2 * ii;
        if (r >= br) continue;
PYFA_UNROLL
        for (int hh = 0; hh < XC; ++hh) {
            const pyfa_f4 a = ld4(dQi + r * D + cg * 4 + 64 * hh);
            pyfa_f4 out;
            out.x = pyfa_canonical_nan(a.x * p.scale);
            out.y = pyfa_canonical_nan(a.y * p.scale);
            out.z = pyfa_canonical_nan(a.z * p.scale);
            out.w = pyfa_canonical_nan(a.w * p.scale);
            stg4(dQ + (row0 + r) * lddq + cg * 4 + 64 * hh, out);
        }
    }
}

// d = 128, Br = Bc = 64: 8 warps in two roles (4 * Bc threads), as in the fast dK/dV
// kernel. Warp w owns the 16 query rows (w & 3) * 16 ..; a thread the 8 rows
// (w & 3) * 16 + rg + 2 ii and, of a K/V tile, the 4 keys cg*4 .. cg*4+3. Warps 0..3 form
// S = Q_i K_j^T and P into P_ij; warps 4..7 form dP = dO_i V_j^T and dS = score_grad into
// dS_ij; then warps 0..3 add dS_ij K_j's columns 0..63 to dQ_i, warps 4..7 its columns
// 64..127, each in registers (8 rows x 4 columns a thread). Q_i, dO_i transposed once
// (rows permuted by fast_q_pos); K_j, V_j row-major only, chunks swizzled, by cp.async.
// STAGES = 2 (where a block may hold 227 KiB): K_j, V_j have two buffers, and tile j+1's
// copies are issued right after the barrier that opens tile j, into the buffer tile j-1
// left, so they run while tile j is computed; one barrier a tile then serves both the
// copies' visibility and the buffers' reuse. STAGES = 1: each tile's copies are waited for
// before it is computed. The arithmetic is the same either way, so are the bits.
template <int D, int STAGES>
PYFA_DEV void fa2_backward_dq_fast_roles(const AttentionParams& p) {
    constexpr int BC = kFastBc;
    constexpr int BR = kFastBc;
    constexpr int NT = 4 * BC;
    constexpr int LDP = BC + 4;  // fast_p_stride(BC)
    static_assert(D == 128, "head dim 128: two column halves of 64");
    static_assert(STAGES == 1 || STAGES == 2, "one or two K_j, V_j buffers");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane >> 4, cg = lane & 15;
    const int role = warp >> 2;  // 0: S, P and dQ's columns 0..63; 1: dP, dS and columns 64..127
    const int wrow = (warp & 3) * 16;
    const FastDqBlock f = fast_dq_block(p, BR, BC);
    const auto [Q, dO, K, V, dQ, LSE, Drow, ldq, lddo, ldk, ldv, lddq, Nk, row0, br, tiles, mask] = f;
    if (br <= 0) return;  // past its sequence's rows

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_backward_dq_fast_roles_layout<STAGES>(BR, BC, D);
    float* QiT = smem + L.offset[FA2DQR_QiT];    // (d, Br), rows permuted by fast_q_pos
    float* dOiT = smem + L.offset[FA2DQR_dOiT];  // (d, Br), the same permutation
    float* Kjs = smem + L.offset[FA2DQR_Kj];     // STAGES x (Bc, d), chunks swizzled by swz_qk
    float* Vjs = smem + L.offset[FA2DQR_Vj];     // STAGES x (Bc, d), chunks swizzled by swz_qk
    float* Pij = smem + L.offset[FA2DQR_Pij];    // (Br, Bc), row stride LDP
    float* dSij = smem + L.offset[FA2DQR_dSij];  // (Br, Bc), row stride LDP

    // Tile j's K_j and V_j into buffer `stage`, one commit group; keys past the tile's end are 0.
    auto copy_kv = [&](int j, int stage) {
        const int col0 = j * BC;
        fast_copy_rows2_async<D, BC, NT>(Kjs + stage * BC * D, Vjs + stage * BC * D, f.K, f.ldk, f.V, f.ldv, col0,
                                         imin(BC, f.Nk - col0), tid);
    };
    const int jbegin = static_cast<int>(tiles.begin), jend = static_cast<int>(tiles.end);
    // Two stages: the first tile's copies run while Q_i^T and dO_i^T load.
    if (STAGES == 2 && jbegin < jend) copy_kv(jbegin, 0);

    // Q_i^T and dO_i^T, once; rows past br are 0.
    fast_load_transposed2<D, BR, NT>(QiT, dOiT, Q, ldq, dO, lddo, row0, br, tid);
    // The role's row values: LSE (-inf past br) for P, D (0 past br) for dS.
    float rowv[8];
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int r = wrow + rg + 2 * ii;
        rowv[ii] = role ? (r < br ? Drow[row0 + r] : 0.0f) : (r < br ? LSE[row0 + r] : -INFINITY);
    }
    const float* score_at = (role ? dOiT : QiT) + wrow + rg * 8;
    float acc[8][4];  // dQ_i (unscaled) of the thread's rows and columns
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int x = 0; x < 4; ++x) acc[ii][x] = 0.0f;

    for (int j = jbegin; j < jend; ++j) {
        const int col0 = j * BC, bc = imin(BC, Nk - col0);
        const int stage = STAGES == 2 ? (j - jbegin) & 1 : 0;
        if (STAGES == 1) {
            __syncthreads();  // every warp is done with tile j-1's K_j, V_j, P_ij, dS_ij
            copy_kv(j, 0);
        }
        pyfa_cp_async_wait<0>();  // this thread's copies of tile j (two stages: the only group in flight)
        // Every thread's copies of tile j have landed; every warp is done with tile j-1's
        // P_ij, dS_ij and (two stages) the K_j, V_j buffer tile j+1 goes to.
        __syncthreads();
        if (STAGES == 2 && j + 1 < jend) copy_kv(j + 1, stage ^ 1);
        const float* Kj = Kjs + stage * BC * D;
        const float* Vj = Vjs + stage * BC * D;
        const float* score_b = role ? Vj : Kj;

        // S = Q_i K_j^T (warps 0..3) or dP = dO_i V_j^T (warps 4..7), over x in order.
        float s[8][4];
        fast_scores_8x4<D>(score_at, score_b, cg, s);

        float* prow = Pij + (wrow + rg) * LDP;  // the thread's rows of P_ij
        float* dsrow = dSij + (wrow + rg) * LDP;
        // In a tile the mask cuts, a hidden score is P = 0 by selection and is left out of
        // dS K; a row that sees no key of the tile takes no step.
        const Band band = mask.band(row0, col0);
        const bool cut = band.cuts(br, bc);
        if (role == 0) {
            // P = exp(S - LSE) (0 for a row that sees no key) into P_ij: the score pipeline
            // (common/score.h).
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const int r = wrow + rg + 2 * ii;
                float P[4];
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk) {
                    const int c = cg * 4 + kk;
                    P[kk] = fast_score_p(p, s[ii][kk], cut && !band.visible(r, c), rowv[ii] == -INFINITY, blockIdx.z,
                                         blockIdx.y, row0 + r, col0 + c,
                                         [&](float S) { return pyfa_exp(S - rowv[ii]); });
                }
                st4(prow + 2 * ii * LDP + cg * 4, pyfa_f4{P[0], P[1], P[2], P[3]});
            }
        }
        __syncthreads();  // P_ij is whole
        if (role == 1) {
            // dS = score_grad(P, dp, D), P from the twin thread of warp w - 4, into dS_ij;
            // the score its modification reads, from the twin's operands.
            ScoreAt<float> sa[8][4];
            fast_scores_for_grad<D, false>(p, QiT + wrow + rg * 8, Kj, wrow + rg, cg, row0, col0, blockIdx.z,
                                           blockIdx.y, sa);
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const int r = wrow + rg + 2 * ii;
                const pyfa_f4 P4 = ld4(prow + 2 * ii * LDP + cg * 4);
                const float P[4] = {P4.x, P4.y, P4.z, P4.w};
                float ds[4];
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk)
                    ds[kk] = score_grad(p, P[kk], s[ii][kk], rowv[ii], sa[ii][kk], blockIdx.z, blockIdx.y, row0 + r,
                                        col0 + cg * 4 + kk);
                st4(dsrow + 2 * ii * LDP + cg * 4, pyfa_f4{ds[0], ds[1], ds[2], ds[3]});
            }
        }
        __syncthreads();  // dS_ij is whole
        // dq = sum_c dS[r, c] K[c, x] over c < bc in order; dQ_i = dQ_i + dq.
        if (!cut) {
            fast_product_8x4<D, 1, LDP>(dsrow, Kj + 64 * role, bc, cg, acc);
        } else {
            const int blo = static_cast<int>(band.lo < -2 * BC ? -2 * BC : band.lo > 2 * BC ? 2 * BC : band.lo);
            const int bhi = static_cast<int>(band.hi < -2 * BC ? -2 * BC : band.hi > 2 * BC ? 2 * BC : band.hi);
            fast_product_8x4<D, 1, LDP, -1>(dsrow, Kj + 64 * role, bc, cg, acc, wrow + rg, blo, bhi);
        }
    }

    // dQ = canonical(dQ_i * scale).
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int r = wrow + rg + 2 * ii;
        if (r >= br) continue;
        stg4(dQ + (row0 + r) * lddq + cg * 4 + 64 * role,
             pyfa_f4{pyfa_canonical_nan(acc[ii][0] * p.scale), pyfa_canonical_nan(acc[ii][1] * p.scale),
                     pyfa_canonical_nan(acc[ii][2] * p.scale), pyfa_canonical_nan(acc[ii][3] * p.scale)});
    }
}

// Threads per block: 2 * Br at d = 64, 4 * Bc at d = 128. At d = 128 one block per SM is
// asked for (left to itself, ptxas holds sm_120 to 128 registers and spills); 0 asks
// nothing at d = 64.
// STAGES: K_j, V_j buffers of the d = 128 kernel (fa2_backward_dq_fast_roles); 1 at d = 64.
template <int D, int BR, int STAGES = 1>
__global__ void __launch_bounds__(D == 128 ? 4 * kFastBc : 2 * BR, D == 128 ? 1 : 0)
    fa2_backward_dq_fast_kernel(const AttentionParams params) {
    static_assert(D == 128 || STAGES == 1, "d = 64 loads K_j, V_j through registers, one stage");
    const AttentionParams p = fast_score_params<PYFA_KERNEL_FA2_BACKWARD_DQ, D>(params);  // what the row takes (common/score.h)
    if constexpr (D == 128)
        fa2_backward_dq_fast_roles<D, STAGES>(p);
    else
        fa2_backward_dq_fast_rows<D, BR>(p);
}

}  // namespace PYFA_KERNELS
