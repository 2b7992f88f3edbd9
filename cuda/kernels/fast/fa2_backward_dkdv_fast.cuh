// fa2_backward_dkdv_fast.cuh: FlashAttention-2 backward, the dK/dV kernel, register-tiled;
// the same bits as fa2_backward_dkdv_kernel (cuda/kernels/fa2_backward.cuh) and
// sim/fa2_backward.py.
//
// The dQ fast kernel's thread layout with the roles of rows and columns swapped: warps own
// 16 keys of K_j, each thread an 8 x 4 tile of S^T and dP^T (8 keys, 4 query rows) and an
// 8 x 4 tile of each Q tile's dv and dk products. K_j, V_j stored transposed once (keys
// permuted by fast_q_pos); Q_i, dO_i transposed for S and dP and row-major for dS^T Q and
// P^T dO; dK_j, dV_j in shared memory, each thread its own elements. Per element
// (docs/numerics.md, FA2 dK/dV): S by pyfa_fma over x in order, times scale, -inf if
// masked; P = (LSE == -inf) ? 0 : exp(S - LSE); dp over x in order; dS = P * (dp - D);
// per Q tile dv and dk summed over r in order from +0, then added to dV_j and dK_j; query
// heads of the group g outer, Q tiles of the band inner; at the end
// dK = canonical(dK_j * scale), dV = canonical(dV_j).
#pragma once

#include "kernels/fast/fa2_forward_fast.cuh"

namespace PYFA_KERNELS {

// One Q tile's product dst[c, x] += sum_r A^T[c, r] B[r, x] (r = 0 .. br-1 in order, from
// +0) over the thread's keys c = wcol + rg + 2 ii and columns x = cg*4 + 64 hh.
// at: the thread's first key row of A^T (row stride LDP); b: B (Br, D) row-major.
template <int D, int LDP>
PYFA_DEV void fast_dkdv_tile_product(const float* at, const float* b, int br, int cg, float* acc_rows) {
    constexpr int XC = D / 64;
PYFA_UNROLL
    for (int hh = 0; hh < XC; ++hh) {
        const float* bcol = b + cg * 4 + 64 * hh;
        float t[8][4];
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
            for (int x = 0; x < 4; ++x) t[ii][x] = 0.0f;
        int r = 0;
        for (; r + 4 <= br; r += 4) {
            pyfa_f4 bx[4];
PYFA_UNROLL
            for (int rr = 0; rr < 4; ++rr) bx[rr] = ld4(bcol + (r + rr) * D);
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const pyfa_f4 ar = ld4(at + 2 * ii * LDP + r);
                const float ac[4] = {ar.x, ar.y, ar.z, ar.w};
PYFA_UNROLL
                for (int rr = 0; rr < 4; ++rr) {
                    t[ii][0] = pyfa_fma(ac[rr], bx[rr].x, t[ii][0]);
                    t[ii][1] = pyfa_fma(ac[rr], bx[rr].y, t[ii][1]);
                    t[ii][2] = pyfa_fma(ac[rr], bx[rr].z, t[ii][2]);
                    t[ii][3] = pyfa_fma(ac[rr], bx[rr].w, t[ii][3]);
                }
            }
        }
        if (r < br) {  // the last 1..3 rows of a tail Q tile, in order
PYFA_UNROLL
            for (int rr = 0; rr < 3; ++rr) {
                if (r + rr < br) {
                    const pyfa_f4 v = ld4(bcol + (r + rr) * D);
PYFA_UNROLL
                    for (int ii = 0; ii < 8; ++ii) {
                        const float ac = at[2 * ii * LDP + r + rr];
                        t[ii][0] = pyfa_fma(ac, v.x, t[ii][0]);
                        t[ii][1] = pyfa_fma(ac, v.y, t[ii][1]);
                        t[ii][2] = pyfa_fma(ac, v.z, t[ii][2]);
                        t[ii][3] = pyfa_fma(ac, v.w, t[ii][3]);
                    }
                }
            }
        }
PYFA_UNROLL
        for (int ii = 0; ii < 8; ++ii) {
            float* acc = acc_rows + 2 * ii * D + cg * 4 + 64 * hh;
            const pyfa_f4 a = ld4(acc);
            st4(acc, pyfa_f4{a.x + t[ii][0], a.y + t[ii][1], a.z + t[ii][2], a.w + t[ii][3]});
        }
    }
}

template <int D>
__global__ void __launch_bounds__(2 * kFastBc) fa2_backward_dkdv_fast_kernel(const AttentionParams p) {
    constexpr int BC = kFastBc;
    constexpr int BR = kFastBc;  // the S^T tile is Bc x Br, 16 lanes x 4 query rows
    constexpr int NT = 2 * BC;
    constexpr int DC = D / 4;
    constexpr int XC = D / 64;
    constexpr int LDP = BC + 4;  // fast_p_stride(BR)
    static_assert(D == 64, "head dim 64");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane >> 4, cg = lane & 15;
    const int wcol = warp * 16;
    const int64_t b = blockIdx.z, hk = blockIdx.y;
    const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
    const int64_t G = p.heads / p.heads_kv;  // query heads per K/V head
    const float* K = p.k + p.k_strides.at(b, hk, 0);  // (Nk, d), row stride ldk
    const float* V = p.v + p.v_strides.at(b, hk, 0);  // (Nk, d), row stride ldv
    float* dK = p.dk + p.dk_strides.at(b, hk, 0);     // (Nk, d), row stride lddk
    float* dV = p.dv + p.dv_strides.at(b, hk, 0);     // (Nk, d), row stride lddv
    const int ldq = static_cast<int>(p.q_strides.row), lddo = static_cast<int>(p.dout_strides.row);
    const int ldk = static_cast<int>(p.k_strides.row), ldv = static_cast<int>(p.v_strides.row);
    const int lddk = static_cast<int>(p.dk_strides.row), lddv = static_cast<int>(p.dv_strides.row);
    const int col0 = static_cast<int>(blockIdx.x) * BC;
    const int bc = imin(BC, Nk - col0);
    const Mask mask = p.mask;
    const TileRange visit = mask.q_tiles(col0, bc, BR, Nq);

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_backward_dkdv_fast_smem(BR, BC, D);
    float* KjT = smem + L.offset[FA2KVF_KjT];    // (d, Bc), keys permuted by fast_q_pos
    float* VjT = smem + L.offset[FA2KVF_VjT];    // (d, Bc), the same permutation
    float* QiT = smem + L.offset[FA2KVF_QiT];    // (d, Br)
    float* dOiT = smem + L.offset[FA2KVF_dOiT];  // (d, Br)
    float* Qi = smem + L.offset[FA2KVF_Qi];      // (Br, d)
    float* dOi = smem + L.offset[FA2KVF_dOi];    // (Br, d)
    float* PdS = smem + L.offset[FA2KVF_PdS];    // (Bc, Br), row stride LDP: P_ij^T, then dS_ij^T
    float* dKj = smem + L.offset[FA2KVF_dKj];    // (Bc, d), unscaled; a thread's own elements
    float* dVj = smem + L.offset[FA2KVF_dVj];    // (Bc, d), a thread's own elements

    // K_j^T and V_j^T, once (not at all for an empty band); keys past bc are 0.
    if (visit.begin < visit.end) {
PYFA_UNROLL
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
        }
    }
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
        for (int hh = 0; hh < XC; ++hh) {
            const int c = wcol + rg + 2 * ii;
            st4(dKj + c * D + cg * 4 + 64 * hh, pyfa_f4{0.f, 0.f, 0.f, 0.f});
            st4(dVj + c * D + cg * 4 + 64 * hh, pyfa_f4{0.f, 0.f, 0.f, 0.f});
        }

    for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const float* Q = p.q + p.q_strides.at(b, h, 0);             // (Nq, d), row stride ldq
        const float* dO = p.dout + p.dout_strides.at(b, h, 0);      // (Nq, d), row stride lddo
        const float* LSE = p.lse + (b * p.heads + h) * p.seqlen_q;  // (Nq), dense
        const float* Drow = p.drow + (b * p.heads + h) * p.seqlen_q;  // (Nq), dense
        for (int i = static_cast<int>(visit.begin); i < static_cast<int>(visit.end); ++i) {
            const int row0 = i * BR, br = imin(BR, Nq - row0);
            __syncthreads();  // every warp is done with the previous step's Q_i, dO_i
            // Q_i and dO_i, transposed and row-major; rows past br are 0.
PYFA_UNROLL
            for (int t = 0; t < BR * DC / NT; ++t) {
                const int e = tid + t * NT, r = e & (BR - 1), x4 = e / BR;
                const bool ok = r < br;
                const pyfa_f4 q = ok ? ld4(Q + (row0 + r) * ldq + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
                const pyfa_f4 o = ok ? ld4(dO + (row0 + r) * lddo + 4 * x4) : pyfa_f4{0.f, 0.f, 0.f, 0.f};
                QiT[(4 * x4 + 0) * BR + r] = q.x;
                QiT[(4 * x4 + 1) * BR + r] = q.y;
                QiT[(4 * x4 + 2) * BR + r] = q.z;
                QiT[(4 * x4 + 3) * BR + r] = q.w;
                dOiT[(4 * x4 + 0) * BR + r] = o.x;
                dOiT[(4 * x4 + 1) * BR + r] = o.y;
                dOiT[(4 * x4 + 2) * BR + r] = o.z;
                dOiT[(4 * x4 + 3) * BR + r] = o.w;
                st4(Qi + r * D + 4 * x4, q);
                st4(dOi + r * D + 4 * x4, o);
            }
            float lse[4], drow[4];
PYFA_UNROLL
            for (int kk = 0; kk < 4; ++kk) {
                const int r = cg * 4 + kk;
                lse[kk] = r < br ? LSE[row0 + r] : -INFINITY;
                drow[kk] = r < br ? Drow[row0 + r] : 0.0f;
            }
            __syncthreads();

            // S^T = K_j Q_i^T and dP^T = V_j dO_i^T, each summed x = 0 .. d-1 in order.
            float s[8][4], dp[8][4];
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk) s[ii][kk] = dp[ii][kk] = 0.0f;
            const float* kp = KjT + wcol + rg * 8;
            const float* vp = VjT + wcol + rg * 8;
            const float* qp = QiT + cg * 4;
            const float* gp = dOiT + cg * 4;
PYFA_UNROLL_BY(4)
            for (int x = 0; x < D; ++x) {
                const pyfa_f4 ka = ld4(kp + x * BC), kb = ld4(kp + x * BC + 4);
                const pyfa_f4 va = ld4(vp + x * BC), vb = ld4(vp + x * BC + 4);
                const pyfa_f4 qv = ld4(qp + x * BR), gv = ld4(gp + x * BR);
                const float kx[8] = {ka.x, ka.y, ka.z, ka.w, kb.x, kb.y, kb.z, kb.w};
                const float vx[8] = {va.x, va.y, va.z, va.w, vb.x, vb.y, vb.z, vb.w};
                const float qx[4] = {qv.x, qv.y, qv.z, qv.w};
                const float gx[4] = {gv.x, gv.y, gv.z, gv.w};
PYFA_UNROLL
                for (int ii = 0; ii < 8; ++ii)
PYFA_UNROLL
                    for (int kk = 0; kk < 4; ++kk) {
                        s[ii][kk] = pyfa_fma(qx[kk], kx[ii], s[ii][kk]);
                        dp[ii][kk] = pyfa_fma(gx[kk], vx[ii], dp[ii][kk]);
                    }
            }

            // P = exp(S - LSE) (0 for a row that sees no key) into P_ij^T; dS = P (dp - D)
            // kept in s until P_ij^T has been read.
            const bool whole = !mask.masked(row0 + br - 1, col0) && !mask.masked(row0, col0 + bc - 1);
            float* prow = PdS + (wcol + rg) * LDP;
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii) {
                const int c = wcol + rg + 2 * ii;
                float P[4];
PYFA_UNROLL
                for (int kk = 0; kk < 4; ++kk) {
                    const int r = cg * 4 + kk;
                    const bool masked = !whole && mask.masked(row0 + r, col0 + c);
                    const float sc = masked ? -INFINITY : s[ii][kk] * p.scale;
                    P[kk] = lse[kk] == -INFINITY ? 0.0f : pyfa_exp(sc - lse[kk]);
                    s[ii][kk] = P[kk] * (dp[ii][kk] - drow[kk]);
                }
                st4(prow + 2 * ii * LDP + cg * 4, pyfa_f4{P[0], P[1], P[2], P[3]});
            }
            pyfa_syncwarp();
            // dV_j += P_ij^T dO_i.
            fast_dkdv_tile_product<D, LDP>(prow, dOi, br, cg, dVj + (wcol + rg) * D);
            pyfa_syncwarp();  // the warp's P_ij^T rows are read before dS_ij^T replaces them
PYFA_UNROLL
            for (int ii = 0; ii < 8; ++ii)
                st4(prow + 2 * ii * LDP + cg * 4, pyfa_f4{s[ii][0], s[ii][1], s[ii][2], s[ii][3]});
            pyfa_syncwarp();
            // dK_j += dS_ij^T Q_i.
            fast_dkdv_tile_product<D, LDP>(prow, Qi, br, cg, dKj + (wcol + rg) * D);
        }
    }

    // dK = canonical(dK_j * scale), dV = canonical(dV_j); +0 for an empty band.
PYFA_UNROLL
    for (int ii = 0; ii < 8; ++ii) {
        const int c = wcol + rg + 2 * ii;
        if (c >= bc) continue;
PYFA_UNROLL
        for (int hh = 0; hh < XC; ++hh) {
            const pyfa_f4 a = ld4(dKj + c * D + cg * 4 + 64 * hh);
            const pyfa_f4 v = ld4(dVj + c * D + cg * 4 + 64 * hh);
            st4(dK + (col0 + c) * lddk + cg * 4 + 64 * hh,
                pyfa_f4{pyfa_canonical_nan(a.x * p.scale), pyfa_canonical_nan(a.y * p.scale),
                        pyfa_canonical_nan(a.z * p.scale), pyfa_canonical_nan(a.w * p.scale)});
            st4(dV + (col0 + c) * lddv + cg * 4 + 64 * hh,
                pyfa_f4{pyfa_canonical_nan(v.x), pyfa_canonical_nan(v.y), pyfa_canonical_nan(v.z),
                        pyfa_canonical_nan(v.w)});
        }
    }
}

}  // namespace PYFA_KERNELS
