// fa1_backward_fast.cuh: FlashAttention-1 backward (Algorithm 4), register-tiled; the same
// bits as fa1_backward_kernel (src/kernels/fa1_backward.cuh) and pyfa/sim/fa1_backward.py.
//
// What stays: the readable kernel's algorithm. One block per (K/V head, batch); dQ = 0 in
// HBM first; K/V tiles j outer with K_j, V_j, dK~_j, dV~_j on chip; the group's query
// heads g, then the Q tiles i of the band, inner; Q_i, O_i, dO_i, dQ_i, m_i, l_i read
// from HBM at every (j, g, i) and dQ_i written back; D_i recomputed at every step.
//
// What changes, against the readable kernel: Br = Bc = 64 and d (64 or 128) compile-time;
// 8 warps in two halves of 4 that run the same register tiles on different operands. Each
// warp owns 16 keys of K_j (a thread 8 keys c = w*16 + rg + 2 ii, w = warp & 3, lane =
// 16 rg + cg):
//   step A  the "P" half computes an 8 x 4 tile of S^T (keys x query rows cg*4 .. +3) and
//           P, the "dS" half the same tile of dP^T; two warps of the dS half compute D_i,
//           one row per thread;
//   step B  the P half adds its 8 x 4 (d = 128: 8 x 8) tile of P^T dO_i to dV~_j, the dS
//           half forms dS (score_grad, common/score.h) and adds its tile of scale * dS^T Q_i to dK~_j; dK~_j and dV~_j
//           live in registers;
//   step C  all 256 threads compute a 4 x 4 (4 x 8) tile of dS K_j each and update dQ_i in
//           HBM, each dQ element always by the same thread.
// K_j, V_j are stored transposed (keys permuted by fast_q_pos) for 128-bit loads of a
// thread's 8 keys, and K_j row-major for dS K; Q_i, dO_i, O_i row-major with the chunk
// swizzle swz_qk, read along rows in 128-bit loads without bank conflicts; P^T and dS^T
// with the padded stride fast_p_stride. 128-bit global loads; the next step's Q_i, dO_i,
// O_i come by cp.async while this step's dS K computes; 32-bit indices inside a head; no
// division or modulo in the loops; three barriers per step. Every element is computed with
// the operations and in the order of docs/numerics.md (FA1 backward), so the simulator is
// unchanged.
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

template <int D>
__global__ void __launch_bounds__(4 * kFastBc) fa1_backward_fast_kernel(const AttentionParams params) {
    const AttentionParams p = fast_score_params<PYFA_KERNEL_FA1_BACKWARD, D>(params);  // what the row takes (common/score.h)
    constexpr int BC = kFastBc;
    constexpr int BR = kFastBc;
    constexpr int NT = 4 * BC;          // fa1_backward_fast_threads
    constexpr int DC = D / 4;           // 16-byte chunks per row of Q, dO, O, K, V
    constexpr int XC = D / 64;          // 4-column chunks per thread per row in steps B, C
    constexpr int LDP = BR + 4;         // fast_p_stride(BR)
    constexpr int RPT = BR * DC / NT;   // chunks of each of Q_i, dO_i, O_i per thread
    static_assert(D == 64 || D == 128, "head dims 64 and 128");
    static_assert(BR * BC == 16 * NT, "step C: a 4 x 4 tile of dQ_i per thread");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane >> 4, cg = lane & 15;
    const int half = warp >> 2;         // 0: S, P, dV~_j; 1: dP, dS, dK~_j
    const int wcol = (warp & 3) * 16;   // the warp's first key in the tile
    const int rq = tid >> 4, xq = tid & 15;  // step C: rows rq*4 .. +3, columns xq*4 (+64 hh)
    const int64_t b = blockIdx.z, hk = blockIdx.y;
    const Sequence seq = p.sequence(b);
    const int Nq = static_cast<int>(seq.Nq), Nk = static_cast<int>(seq.Nk);
    const int G = static_cast<int>(p.heads / p.heads_kv);  // query heads per K/V head
    const float scale = p.scale;
    const Mask mask = seq.mask;
    const float* K = p.k + p.k_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride ldk
    const float* V = p.v + p.v_strides.at(seq.batch, hk, seq.k0);  // (Nk, d), row stride ldv
    float* dK = p.dk + p.dk_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride lddk
    float* dV = p.dv + p.dv_strides.at(seq.batch, hk, seq.k0);     // (Nk, d), row stride lddv
    const int ldq = static_cast<int>(p.q_strides.row), lddo = static_cast<int>(p.dout_strides.row);
    const int ldo = static_cast<int>(p.o_strides.row), lddq = static_cast<int>(p.dq_strides.row);
    const int ldk = static_cast<int>(p.k_strides.row), ldv = static_cast<int>(p.v_strides.row);
    const int lddk = static_cast<int>(p.dk_strides.row), lddv = static_cast<int>(p.dv_strides.row);

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa1_backward_fast_smem(BR, BC, D);
    float* KjT = smem + L.offset[FA1BF_KjT];   // (d, Bc), keys permuted by fast_q_pos
    float* VjT = smem + L.offset[FA1BF_VjT];   // (d, Bc), the same permutation
    float* Kj = smem + L.offset[FA1BF_Kj];     // (Bc, d)
    float* Qs = smem + L.offset[FA1BF_Qi];     // (Br, d), chunks swizzled by swz_qk
    float* dOs = smem + L.offset[FA1BF_dOi];   // (Br, d), swizzled
    float* Os = smem + L.offset[FA1BF_Oi];     // (Br, d), swizzled
    float* PT = smem + L.offset[FA1BF_PT];     // (Bc, Br), row stride LDP: P_ij^T
    float* dST = smem + L.offset[FA1BF_dST];   // (Bc, Br), row stride LDP: dS_ij^T
    float* Di = smem + L.offset[FA1BF_Di];     // (Br)

    // The tensors of query head g (h = hk * G + g).
    struct Head {
        const float* q;   // (Nq, d), row stride ldq
        const float* o;   // (Nq, d), row stride ldo; the forward's output
        const float* dO;  // (Nq, d), row stride lddo
        float* dQ;        // (Nq, d), row stride lddq; accumulated in HBM
        const float* m;   // (Nq), dense: the forward's row max
        const float* l;   // (Nq), dense: the forward's row sum, relative to m
    };
    auto head = [&](int g) {
        const int64_t h = hk * G + g;
        return Head{p.q + p.q_strides.at(seq.batch, h, seq.q0), p.o + p.o_strides.at(seq.batch, h, seq.q0),
                    p.dout + p.dout_strides.at(seq.batch, h, seq.q0), p.dq + p.dq_strides.at(seq.batch, h, seq.q0),
                    p.m + p.stat_at(seq, h), p.l + p.stat_at(seq, h)};
    };

    // dQ = 0 in HBM for every query head of the group; the barrier ahead of the first K/V
    // tile's load makes these writes visible before any thread reads them.
    for (int g = 0; g < G; ++g) {
        float* dQ = head(g).dQ;
        for (int e = tid; e < Nq * DC; e += NT)
            stg4(dQ + (e / DC) * lddq + 4 * (e & (DC - 1)), pyfa_f4{0.f, 0.f, 0.f, 0.f});
    }

    // Q_i, dO_i, O_i of one step by cp.async, 16 bytes at a time into their swizzled
    // places (rows past br are 0): 16 threads copy one row's 256 bytes. The copies land
    // while the threads compute; the wait and barrier at the top of the step publish them.
    // Not unrolled: the addresses of unrolled copies would be hoisted into registers that
    // the products need.
    auto copy_rows = [&](const Head& hd, int row0, int br) {
PYFA_UNROLL_BY(1)
        for (int t = 0; t < RPT; ++t) {
            const int e = tid + t * NT, r = e / DC, x4 = e & (DC - 1);
            const bool ok = r < br;
            const int at = swz_at(r, x4, DC, swz_qk(r));
            pyfa_cp_async16(Qs + at, ok ? hd.q + (row0 + r) * ldq + 4 * x4 : hd.q, ok);
            pyfa_cp_async16(dOs + at, ok ? hd.dO + (row0 + r) * lddo + 4 * x4 : hd.dO, ok);
            pyfa_cp_async16(Os + at, ok ? hd.o + (row0 + r) * ldo + 4 * x4 : hd.o, ok);
        }
        pyfa_cp_async_commit();
    };

    const int Tc = (Nk + BC - 1) / BC;
    for (int j = 0; j < Tc; ++j) {
        const int col0 = j * BC, bc = imin(BC, Nk - col0);
        const TileRange visit = mask.q_tiles(col0, bc, BR, Nq);
        const int ib = static_cast<int>(visit.begin), ie = static_cast<int>(visit.end);

        // dK~_j (the dS half) or dV~_j (the P half): keys wcol + rg + 2 ii, columns
        // cg*4 (+64 hh).
        float acc[8][4 * XC];
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
            for (int x = 0; x < 4 * XC; ++x) acc[ii][x] = 0.0f;

        if (ib < ie) {
            __syncthreads();  // every thread is done with tile j-1's K_j (and the dQ zeros are out)
            // K_j^T, V_j^T and K_j; keys past bc are 0.
PYFA_UNROLL_BY(1)
            for (int t = 0; t < BC * DC / NT; ++t) {
                const int e = tid + t * NT, c = e & (BC - 1), x4 = e / BC;
                const bool ok = c < bc;
                const pyfa_f4 kv = ok ? ld4(K + (col0 + c) * ldk + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
                const pyfa_f4 vv = ok ? ld4(V + (col0 + c) * ldv + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
                const int pos = fast_q_pos(c);
                KjT[(4 * x4 + 0) * BC + pos] = kv.x;
                KjT[(4 * x4 + 1) * BC + pos] = kv.y;
                KjT[(4 * x4 + 2) * BC + pos] = kv.z;
                KjT[(4 * x4 + 3) * BC + pos] = kv.w;
                VjT[(4 * x4 + 0) * BC + pos] = vv.x;
                VjT[(4 * x4 + 1) * BC + pos] = vv.y;
                VjT[(4 * x4 + 2) * BC + pos] = vv.z;
                VjT[(4 * x4 + 3) * BC + pos] = vv.w;
                st4(Kj + c * D + 4 * x4, kv);
            }
            copy_rows(head(0), ib * BR, imin(BR, Nq - ib * BR));
        }

        // The steps (g, i): query heads g outer, the band's Q tiles i inner.
        for (int g = 0, i = ib; ib < ie;) {
            const int row0 = i * BR, br = imin(BR, Nq - row0);
            const Head cur = head(g);
            int gn = g, in = i + 1;
            if (in == ie) {
                in = ib;
                ++gn;
            }
            const bool has_next = gn < G;
            pyfa_cp_async_wait<0>();
            __syncthreads();  // Q_i, dO_i, O_i are in; the previous step's readers are done

            // m_i, l_i of the thread's rows cg*4 + kk (the P half); l = 0 past br gives P = 0.
            float mr[4], lr[4];
PYFA_UNROLL
            for (int kk = 0; kk < 4; ++kk) {
                const int r = cg * 4 + kk;
                const bool ok = half == 0 && r < br;
                mr[kk] = ok ? cur.m[row0 + r] : -INFINITY;
                lr[kk] = ok ? cur.l[row0 + r] : 0.0f;
            }

            // Step A: s[ii][kk] = sum_x B[r, x] A[c, x] for keys c = wcol + rg + 2 ii and
            // rows r = cg*4 + kk, x = 0 .. d-1 in order: S^T = K_j Q_i^T (P half) or
            // dP^T = V_j dO_i^T (dS half).
            float s[8][4];
            fast_scores_8x4<D>((half ? VjT : KjT) + wcol + rg * 8, half ? dOs : Qs, cg, s);

            // In a tile the mask cuts, a hidden score is P = 0 by selection and is left out
            // of every product; a key (a row) that no row (key) of the tile sees takes no step.
            const Band band = mask.band(row0, col0);
            const bool cut = band.cuts(br, bc);
            if (half == 0) {
                // The score pipeline (common/score.h): S, -inf if hidden;
                // P = (l == 0) ? 0 : exp(S - safe_max(m)) / l, into P_ij^T.
PYFA_UNROLL
                for (int ii = 0; ii < 8; ++ii) {
                    const int c = wcol + rg + 2 * ii;
                    float P[4];
PYFA_UNROLL
                    for (int kk = 0; kk < 4; ++kk) {
                        const int r = cg * 4 + kk;
                        P[kk] = fast_score_p(p, s[ii][kk], cut && !band.visible(r, c), lr[kk] == 0.0f, b, hk * G + g,
                                             row0 + r, col0 + c,
                                             [&](float S) { return pyfa_exp(S - safe_max(mr[kk])) / lr[kk]; });
                    }
                    st4(PT + c * LDP + cg * 4, pyfa_f4{P[0], P[1], P[2], P[3]});
                }
                // Dropout (common/dropout.h), on the thread's own elements in a loop of its own,
                // so that the generator's registers never meet the scores': dV takes P o Z /
                // (1 - p) in P_ij^T, and dS the undropped P with Z in its sign, in dS_ij^T
                // where its dS will go.
                if (p.dropout.on()) {
PYFA_UNROLL_BY(1)
                    for (int e = 0; e < 32; ++e) {
                        const int ii = e >> 2, kk = e & 3, c = wcol + rg + 2 * ii, at = c * LDP + cg * 4 + kk;
                        const bool kept = p.dropout.keep(b, hk * G + g, row0 + cg * 4 + kk, col0 + c);
                        const float P = PT[at];
                        dST[at] = Dropout::flag(P, kept);
                        PT[at] = p.dropout.apply_kept(P, kept);
                    }
                }
            } else if (warp < 6) {
                // D_i[r] = sum_x dO_i[r, x] O_i[r, x], x in order: one row per thread.
                const int r = tid - 4 * 32;
                const int sw = swz_qk(r);
                float dsum = 0.0f;
PYFA_UNROLL
                for (int x4 = 0; x4 < DC; ++x4) {
                    const pyfa_f4 gv = ld4(dOs + swz_at(r, x4, DC, sw));
                    const pyfa_f4 ov = ld4(Os + swz_at(r, x4, DC, sw));
                    dsum = pyfa_fma(gv.x, ov.x, dsum);
                    dsum = pyfa_fma(gv.y, ov.y, dsum);
                    dsum = pyfa_fma(gv.z, ov.z, dsum);
                    dsum = pyfa_fma(gv.w, ov.w, dsum);
                }
                Di[r] = dsum;
            }
            __syncthreads();  // P_ij^T and D_i are complete

            if (half == 1) {
                // dS = score_grad(P, dp, D), into dS_ij^T; the score its modification reads,
                // from the P half's operands.
                const pyfa_f4 d4 = ld4(Di + cg * 4);
                const float dr[4] = {d4.x, d4.y, d4.z, d4.w};
                ScoreAt<float> sa[8][4];
                fast_scores_for_grad<D, true>(p, KjT + wcol + rg * 8, Qs, wcol + rg, cg, row0, col0, b, hk * G + g,
                                              sa);
PYFA_UNROLL
                for (int ii = 0; ii < 8; ++ii) {
                    const int c = wcol + rg + 2 * ii;
                    // With dropout P waits in dS_ij^T, Z in its sign; without, P_ij^T holds it.
                    const pyfa_f4 pv = ld4((p.dropout.on() ? dST : PT) + c * LDP + cg * 4);
                    const float P[4] = {pv.x, pv.y, pv.z, pv.w};
                    float ds[4];
PYFA_UNROLL
                    for (int kk = 0; kk < 4; ++kk)
                        ds[kk] = score_grad_kept(p, std::fabs(P[kk]), s[ii][kk], dr[kk], Dropout::flagged_kept(P[kk]),
                                                 sa[ii][kk], b, hk * G + g, row0 + cg * 4 + kk, col0 + c);
                    st4(dST + c * LDP + cg * 4, pyfa_f4{ds[0], ds[1], ds[2], ds[3]});
                }
                pyfa_syncwarp();  // the warp reads back only its own rows of dS_ij^T
            }

            // Step B: t[ii][x] = sum_r A^T[c, r] B[r, x], r = 0 .. br-1 in order from +0:
            // P_ij^T dO_i (dV~_j = dV~_j + t) or dS_ij^T Q_i (dK~_j = fma(scale, t, dK~_j)).
            {
                const float* at = (half ? dST : PT) + (wcol + rg) * LDP;
                const float* bm = half ? Qs : dOs;
PYFA_UNROLL
                for (int hh = 0; hh < XC; ++hh) {
                    float t[8][4];
PYFA_UNROLL
                    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
                        for (int x = 0; x < 4; ++x) t[ii][x] = 0.0f;
                    // Hidden steps left out where the mask cuts the tile (Masked<true>); a whole
                    // tile's loop tests nothing.
                    auto product = [&](auto m) {
                        constexpr bool masked = decltype(m)::on;
                        int r = 0;
                        for (; r + 4 <= br; r += 4) {
                            // Rows r .. r+3 share one swizzle.
                            const float* brow = bm + r * D + (((cg ^ swz_qk(r)) << 2) + 64 * hh);
                            pyfa_f4 bx[4];
PYFA_UNROLL
                            for (int rr = 0; rr < 4; ++rr) bx[rr] = ld4(brow + rr * D);
PYFA_UNROLL
                            for (int ii = 0; ii < 8; ++ii) {
                                const pyfa_f4 ar = ld4(at + 2 * ii * LDP + r);
                                const float ac[4] = {ar.x, ar.y, ar.z, ar.w};
PYFA_UNROLL
                                for (int rr = 0; rr < 4; ++rr) {
                                    const bool kept = !masked || band.visible(r + rr, wcol + rg + 2 * ii);
                                    const float bv[4] = {bx[rr].x, bx[rr].y, bx[rr].z, bx[rr].w};
PYFA_UNROLL
                                    for (int x = 0; x < 4; ++x) {
                                        const float u = pyfa_fma(ac[rr], bv[x], t[ii][x]);
                                        t[ii][x] = kept ? u : t[ii][x];
                                    }
                                }
                            }
                        }
                        if (r < br) {  // the last 1..3 rows of a tail Q tile, in order
                            const float* brow = bm + r * D + (((cg ^ swz_qk(r)) << 2) + 64 * hh);
PYFA_UNROLL
                            for (int rr = 0; rr < 3; ++rr) {
                                if (r + rr < br) {
                                    const pyfa_f4 v = ld4(brow + rr * D);
PYFA_UNROLL
                                    for (int ii = 0; ii < 8; ++ii) {
                                        const float ac = at[2 * ii * LDP + r + rr];
                                        const bool kept = !masked || band.visible(r + rr, wcol + rg + 2 * ii);
                                        const float bv[4] = {v.x, v.y, v.z, v.w};
PYFA_UNROLL
                                        for (int x = 0; x < 4; ++x) {
                                            const float u = pyfa_fma(ac, bv[x], t[ii][x]);
                                            t[ii][x] = kept ? u : t[ii][x];
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
                        const int c = wcol + rg + 2 * ii;
                        if (cut && band.rows(c, br).begin == band.rows(c, br).end) continue;
PYFA_UNROLL
                        for (int x = 0; x < 4; ++x)
                            acc[ii][4 * hh + x] = half ? pyfa_fma(scale, t[ii][x], acc[ii][4 * hh + x])
                                                       : acc[ii][4 * hh + x] + t[ii][x];
                    }
                }
            }
            __syncthreads();  // dS_ij^T is complete; Q_i, dO_i, O_i are free

            // The next step's Q_i, dO_i, O_i come in while step C computes.
            if (has_next) copy_rows(head(gn), in * BR, imin(BR, Nq - in * BR));

            // Step C: dq[r, x] = sum_c dS[r, c] K_j[c, x], c = 0 .. bc-1 in order from +0;
            // dQ_i = canonical(fma(scale, dq, dQ_i)), read from and written back to HBM.
PYFA_UNROLL
            for (int hh = 0; hh < XC; ++hh) {
                pyfa_f4 old[4];
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk) {
                    const int r = rq * 4 + kk;
                    old[kk] = r < br ? ld4(cur.dQ + (row0 + r) * lddq + xq * 4 + 64 * hh)
                                     : pyfa_f4{0.f, 0.f, 0.f, 0.f};
                }
                float t[4][4];
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk)
PYFA_UNROLL
                    for (int x = 0; x < 4; ++x) t[kk][x] = 0.0f;
                const float* dsp = dST + rq * 4;
                const float* kp = Kj + xq * 4 + 64 * hh;
                // Hidden steps left out where the mask cuts the tile (Masked<true>); a whole
                // tile's loop tests nothing.
                auto product = [&](auto m) {
                    constexpr bool masked = decltype(m)::on;
                    int c = 0;
                    for (; c + 4 <= bc; c += 4) {
                        pyfa_f4 kx[4], dv[4];
PYFA_UNROLL
                        for (int cc = 0; cc < 4; ++cc) {
                            kx[cc] = ld4(kp + (c + cc) * D);
                            dv[cc] = ld4(dsp + (c + cc) * LDP);
                        }
PYFA_UNROLL
                        for (int cc = 0; cc < 4; ++cc) {
                            const float dc[4] = {dv[cc].x, dv[cc].y, dv[cc].z, dv[cc].w};
PYFA_UNROLL
                            for (int kk = 0; kk < 4; ++kk) {
                                const bool kept = !masked || band.visible(rq * 4 + kk, c + cc);
                                const float kv[4] = {kx[cc].x, kx[cc].y, kx[cc].z, kx[cc].w};
PYFA_UNROLL
                                for (int x = 0; x < 4; ++x) {
                                    const float u = pyfa_fma(dc[kk], kv[x], t[kk][x]);
                                    t[kk][x] = kept ? u : t[kk][x];
                                }
                            }
                        }
                    }
                    if (c < bc) {  // the last 1..3 keys of a tail tile, in order
PYFA_UNROLL
                        for (int cc = 0; cc < 3; ++cc) {
                            if (c + cc < bc) {
                                const pyfa_f4 kv = ld4(kp + (c + cc) * D);
                                const pyfa_f4 dv = ld4(dsp + (c + cc) * LDP);
                                const float dc[4] = {dv.x, dv.y, dv.z, dv.w};
PYFA_UNROLL
                                for (int kk = 0; kk < 4; ++kk) {
                                    const bool kept = !masked || band.visible(rq * 4 + kk, c + cc);
                                    const float kw[4] = {kv.x, kv.y, kv.z, kv.w};
PYFA_UNROLL
                                    for (int x = 0; x < 4; ++x) {
                                        const float u = pyfa_fma(dc[kk], kw[x], t[kk][x]);
                                        t[kk][x] = kept ? u : t[kk][x];
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
                for (int kk = 0; kk < 4; ++kk) {
                    const int r = rq * 4 + kk;
                    if (r >= br || (cut && band.cols(r, bc).begin == band.cols(r, bc).end)) continue;
                    stg4(cur.dQ + (row0 + r) * lddq + xq * 4 + 64 * hh,
                         pyfa_f4{pyfa_canonical_nan(pyfa_fma(scale, t[kk][0], old[kk].x)),
                                 pyfa_canonical_nan(pyfa_fma(scale, t[kk][1], old[kk].y)),
                                 pyfa_canonical_nan(pyfa_fma(scale, t[kk][2], old[kk].z)),
                                 pyfa_canonical_nan(pyfa_fma(scale, t[kk][3], old[kk].w))});
                }
            }

            if (!has_next) break;
            g = gn;
            i = in;
        }

        // dK_j = canonical(dK~_j) (the dS half), dV_j = canonical(dV~_j) (the P half);
        // +0 for an empty band.
        float* out = half ? dK : dV;
        const int ldout = half ? lddk : lddv;
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            const int c = wcol + rg + 2 * ii;
            if (c >= bc) continue;
PYFA_UNROLL
            for (int hh = 0; hh < XC; ++hh)
                stg4(out + (col0 + c) * ldout + cg * 4 + 64 * hh,
                     pyfa_f4{pyfa_canonical_nan(acc[ii][4 * hh + 0]), pyfa_canonical_nan(acc[ii][4 * hh + 1]),
                             pyfa_canonical_nan(acc[ii][4 * hh + 2]), pyfa_canonical_nan(acc[ii][4 * hh + 3])});
        }
    }
}

}  // namespace PYFA_KERNELS
