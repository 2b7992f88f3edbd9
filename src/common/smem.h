// smem.h: the shared-memory layout of every kernel, term by term.
//
// Each kernel's layout is built by one function here. The kernel carves its dynamic
// shared memory with it, the launcher sizes the launch with it, the error for a tile
// that does not fit lists its terms, and pyfa/sim/tiles.py mirrors it term for term
// (tests/test_tiles.py holds the two equal through pyfa_smem_bytes).
#pragma once

#include "common/device.h"

// a * b for a, b >= 0, or -1 when either is negative or the product does not fit in
// int64_t. The launcher sizes any tiles a caller asks for (up to 2^31 - 1 rows, and
// pyfa_smem_bytes takes any head_dim), so a wrapped size would pass the device check
// and the kernel would write past its buffer: every size here is exact or -1.
PYFA_HD int64_t checked_mul(int64_t a, int64_t b) {
    if (a < 0 || b < 0) return -1;
#if defined(__CUDA_ARCH__)
    // No 64-bit division on the device: the high half of the 128-bit product says it.
    const unsigned long long ua = static_cast<unsigned long long>(a);
    const unsigned long long ub = static_cast<unsigned long long>(b);
    const unsigned long long lo = ua * ub;
    if (__umul64hi(ua, ub) != 0 || lo > static_cast<unsigned long long>(INT64_MAX)) return -1;
    return static_cast<int64_t>(lo);
#else
    int64_t r;
    return __builtin_mul_overflow(a, b, &r) ? -1 : r;
#endif
}

// a + b for a, b >= 0, or -1 as checked_mul.
PYFA_HD int64_t checked_add(int64_t a, int64_t b) {
    if (a < 0 || b < 0 || a > INT64_MAX - b) return -1;
    return a + b;
}

struct SmemLayout {
    static constexpr int kMaxTerms = 12;
    const char* name[kMaxTerms];
    int64_t offset[kMaxTerms];  // in floats from the start of dynamic shared memory
    int64_t floats[kMaxTerms];  // -1 for a term whose size overflows int64_t
    int64_t width[kMaxTerms];   // floats per row of the term, to name an element (r, c)
    int count = 0;
    int64_t total_floats = 0;   // -1 once any term or the running total overflows

    // One term of rows x cols floats.
    PYFA_HD void add(const char* term, int64_t rows, int64_t cols) {
        const int64_t n = checked_mul(rows, cols);
        name[count] = term;
        offset[count] = total_floats;
        floats[count] = n;
        width[count] = cols;
        ++count;
        total_floats = (total_floats < 0 || n < 0) ? -1 : checked_add(total_floats, n);
    }
    // Bytes of the whole layout, or -1 when they do not fit in int64_t.
    PYFA_HD int64_t bytes() const {
        return checked_mul(total_floats, static_cast<int64_t>(sizeof(float)));
    }
};

// Row stride of a shared-memory tile whose rows the threads of a warp read at the same
// column, one row per thread (K_j in S = Q K^T, S_ij in the row max): one float of
// padding per row. With a stride that is a multiple of 32 floats (d = 64, Bc = 64, ...)
// all 32 rows sit in one bank and the warp's 32 reads are serialized; with an odd stride
// they sit in 32 different banks. Tiles read along rows only keep their plain stride.
PYFA_HD int64_t padded(int64_t row) { return checked_add(row, 1); }

// Threads per block. Fixed, so that Br and Bc stay free runtime choices: every loop in
// the kernels strides by blockDim.x over the tile's elements or rows.
constexpr int kFa2ForwardThreads = 128;

// ---- FA2 forward. Terms in the order they sit in memory.
enum Fa2ForwardTerm { FA2F_Qi, FA2F_Kj, FA2F_Vj, FA2F_Sij, FA2F_Oi, FA2F_mi, FA2F_li, FA2F_alpha };

PYFA_HD SmemLayout fa2_forward_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("Q_i", Br, d);   // loaded once per block, reused against every K_j
    L.add("K_j", Bc, padded(d));
    L.add("V_j", Bc, d);
    L.add("S_ij", Br, padded(Bc));  // scores, overwritten in place by P~_ij = exp(S_ij - m_i)
    L.add("O_i", Br, d);   // unnormalized accumulator, divided by l_i once at the end
    L.add("m_i", Br, 1);       // running row max
    L.add("l_i", Br, 1);       // running row sum
    L.add("alpha", Br, 1);     // exp(m_old - m_new), the rescale of this step
    return L;
}

// ---- FA2 backward: three kernels (src/kernels/fa2_backward.cuh).
constexpr int kFa2BackwardThreads = 128;

// Preprocess, one block per Q row block: D_i = rowsum(dO_i o O_i). Bc is unused.
enum Fa2BackwardPreprocessTerm { FA2P_dOOi };

PYFA_HD SmemLayout fa2_backward_preprocess_smem(int64_t Br, int64_t /*Bc*/, int64_t d) {
    SmemLayout L;
    L.add("dO_i", Br, padded(d));  // loaded coalesced, then each row dotted with O_i by one thread
    return L;
}

// dK/dV, one block per K/V column block j, walking the Q row blocks i.
enum Fa2BackwardDkdvTerm {
    FA2KV_Kj, FA2KV_Vj, FA2KV_dKj, FA2KV_dVj, FA2KV_Qi, FA2KV_dOi, FA2KV_Pij, FA2KV_dSij, FA2KV_LSEi, FA2KV_Di
};

PYFA_HD SmemLayout fa2_backward_dkdv_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("K_j", Bc, padded(d));  // loaded once per block
    L.add("V_j", Bc, padded(d));
    L.add("dK_j", Bc, d);   // accumulated over every i, written once
    L.add("dV_j", Bc, d);
    L.add("Q_i", Br, d);    // reloaded for every (j, i)
    L.add("dO_i", Br, d);
    L.add("P_ij", Br, Bc);  // exp(S_ij - LSE_i), recomputed
    L.add("dS_ij", Br, Bc); // P_ij o (dP_ij - D_i)
    L.add("LSE_i", Br, 1);
    L.add("D_i", Br, 1);
    return L;
}

// dQ, one block per Q row block i, walking the K/V column blocks j.
enum Fa2BackwardDqTerm { FA2DQ_Qi, FA2DQ_dOi, FA2DQ_dQi, FA2DQ_Kj, FA2DQ_Vj, FA2DQ_dSij, FA2DQ_LSEi, FA2DQ_Di };

PYFA_HD SmemLayout fa2_backward_dq_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("Q_i", Br, d);    // loaded once per block
    L.add("dO_i", Br, d);
    L.add("dQ_i", Br, d);   // accumulated over every j, written once
    L.add("K_j", Bc, padded(d));  // reloaded for every (i, j)
    L.add("V_j", Bc, padded(d));
    L.add("dS_ij", Br, Bc); // recomputed as in the dK/dV kernel
    L.add("LSE_i", Br, 1);
    L.add("D_i", Br, 1);
    return L;
}

// ---- FA1 forward (Dao et al. 2022, Algorithm 1). One block per head: it has only B*H
// blocks, so it takes more threads per block than FA2.
constexpr int kFa1ForwardThreads = 256;

enum Fa1ForwardTerm { FA1F_Kj, FA1F_Vj, FA1F_Qi, FA1F_Sij, FA1F_mtij, FA1F_lnew, FA1F_oscale, FA1F_pvscale };

PYFA_HD SmemLayout fa1_forward_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("K_j", Bc, padded(d));  // outer loop: loaded once, used against every Q_i
    L.add("V_j", Bc, d);
    L.add("Q_i", Br, d);      // inner loop: reloaded for every (j, i); O_i, l_i, m_i go to registers
    L.add("S_ij", Br, padded(Bc));  // scores, overwritten in place by P~_ij = exp(S_ij - m~_ij)
    L.add("m~_ij", Br, 1);        // row max of this tile
    L.add("l_new", Br, 1);        // the row sum after this tile
    L.add("o_scale", Br, 1);      // l_i exp(m_i - m_new): the weight of the old O_i
    L.add("pv_scale", Br, 1);     // exp(m~_ij - m_new): the weight of P~_ij V_j
    return L;
}

// ---- FA1 backward (Dao et al. 2022, Algorithm 4).
constexpr int kFa1BackwardThreads = 256;

enum Fa1BackwardTerm {
    FA1B_Kj, FA1B_Vj, FA1B_dKj, FA1B_dVj, FA1B_Qi, FA1B_dOi, FA1B_Pij, FA1B_dSij, FA1B_mi, FA1B_li, FA1B_Di
};

PYFA_HD SmemLayout fa1_backward_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("K_j", Bc, padded(d));  // outer loop: loaded once
    L.add("V_j", Bc, padded(d));
    L.add("dK_j", Bc, d);     // accumulated over the inner loop, written once per j
    L.add("dV_j", Bc, d);
    L.add("Q_i", Br, d);      // inner loop: reloaded for every (j, i)
    L.add("dO_i", Br, padded(d));
    L.add("P_ij", Br, Bc);
    L.add("dS_ij", Br, Bc);   // dP_ij = dO_i V_j^T, overwritten in place by dS_ij
    L.add("m_i", Br, 1);
    L.add("l_i", Br, 1);
    L.add("D_i", Br, 1);          // rowsum(dO_i o O_i), recomputed for every (j, i)
    return L;
}

// ---- FA2 forward, fast variant (src/kernels/fast/fa2_forward_fast.cuh). Br is 64 or
// 128 (16 rows per warp, so 2 * Br threads), Bc is 64, d is 64 or 128; all compile-time.
constexpr int kFastBc = 64;
PYFA_HD int fa2_forward_fast_threads(int64_t Br) { return static_cast<int>(2 * Br); }

enum Fa2ForwardFastTerm { FA2FF_QiT, FA2FF_KjT, FA2FF_Vj, FA2FF_Pij, FA2FF_mi, FA2FF_alpha };

// Row stride of P_ij: Bc + 4 floats, an odd number of 16-byte chunks, so the rows r and
// r + 1 that a warp's two row groups read at one column sit in different banks.
PYFA_HD int64_t fast_p_stride(int64_t Bc) { return checked_add(Bc, 4); }

PYFA_HD SmemLayout fa2_forward_fast_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("Q_i^T", d, Br);        // transposed once: a thread's 8 rows at one x are 32 bytes
    L.add("K_j^T", checked_mul(2, d), Bc);    // two buffers: K_{j+1} is stored while K_j is read
    L.add("V_j", checked_mul(2, Bc), d);      // two buffers, filled by cp.async
    L.add("P_ij", Br, fast_p_stride(Bc));
    L.add("m_i", Br, 1);          // the new row max, from the lanes that hold it
    L.add("alpha", Br, 1);        // exp(m_old - m_new); l_i at the end
    return L;
}

// ---- FA2 backward dQ, fast variant (src/kernels/fast/fa2_backward_dq_fast.cuh), d = 64:
// the forward's thread layout; K_j is kept twice, transposed for S and row-major for dS K.
PYFA_HD int fa2_backward_dq_fast_threads(int64_t Br) { return static_cast<int>(2 * Br); }

enum Fa2BackwardDqFastTerm { FA2DQF_QiT, FA2DQF_dOiT, FA2DQF_KjT, FA2DQF_VjT, FA2DQF_Kj, FA2DQF_dSij, FA2DQF_dQi };

PYFA_HD SmemLayout fa2_backward_dq_fast_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("Q_i^T", d, Br);       // loaded once, transposed like the forward's
    L.add("dO_i^T", d, Br);
    L.add("K_j^T", d, Bc);       // for S = Q K^T
    L.add("V_j^T", d, Bc);       // for dP = dO V^T
    L.add("K_j", Bc, d);         // for dS K
    L.add("dS_ij", Br, fast_p_stride(Bc));
    L.add("dQ_i", Br, d);        // each thread's own elements: its registers go to S and dP
    return L;
}

// At d = 128 (Br = Bc = 64) the dQ fast kernel runs 8 warps in two roles, like the dK/dV
// one (4 * Bc threads): dQ_i in registers, K_j and V_j row-major (by cp.async, no
// transposed copies), P_ij and dS_ij each a buffer. With one stage K_j and V_j are one
// buffer each, 165,888 bytes; with two (fa2_backward_dq_fast_roles_smem2) tile j+1's K_j,
// V_j are copied into a second buffer while tile j is computed, 231,424 bytes: only a
// 227 KiB block (sm_90, sm_100) holds them.
PYFA_HD int fa2_backward_dq_fast_roles_threads(int64_t) { return 4 * kFastBc; }

enum Fa2BackwardDqRolesTerm { FA2DQR_QiT, FA2DQR_dOiT, FA2DQR_Kj, FA2DQR_Vj, FA2DQR_Pij, FA2DQR_dSij };

template <int STAGES>
PYFA_HD SmemLayout fa2_backward_dq_fast_roles_layout(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("Q_i^T", d, Br);       // loaded once, rows permuted
    L.add("dO_i^T", d, Br);
    // Stage s at s * Bc rows. (STAGES == 1 spelled apart: ptxas, left a checked_mul in the
    // kernel's offsets, spills at d = 64 in the dK/dV kernel.)
    const int64_t rows = STAGES == 1 ? Bc : checked_mul(STAGES, Bc);
    L.add("K_j", rows, d);  // for S = Q K^T and dS K, chunks swizzled
    L.add("V_j", rows, d);  // for dP = dO V^T
    L.add("P_ij", Br, fast_p_stride(Bc));
    L.add("dS_ij", Br, fast_p_stride(Bc));
    return L;
}
PYFA_HD SmemLayout fa2_backward_dq_fast_roles_smem(int64_t Br, int64_t Bc, int64_t d) {
    return fa2_backward_dq_fast_roles_layout<1>(Br, Bc, d);
}
PYFA_HD SmemLayout fa2_backward_dq_fast_roles_smem2(int64_t Br, int64_t Bc, int64_t d) {
    return fa2_backward_dq_fast_roles_layout<2>(Br, Bc, d);
}

// ---- FA2 backward dK/dV, fast variant (src/kernels/fast/fa2_backward_dkdv_fast.cuh):
// Br = Bc = 64, d = 64 or 128; 8 warps, two per 16 keys (warps 0..3: S, P, dV; warps
// 4..7: dP, dS, dK), so 4 * Bc threads. dK_j and dV_j live in registers; Q_i and dO_i are
// kept row-major (no transposed copies), and P_ij^T and dS_ij^T each get a buffer, since
// the dV warps read P^T while the dK warps write dS^T. With one stage Q_i and dO_i are one
// buffer each: 165,888 bytes at d = 128, which an A100's 163 KiB holds. With two
// (fa2_backward_dkdv_fast_smem2) the next step's Q_i, dO_i are copied into a second buffer
// while this step is computed: 231,424 bytes at d = 128, for a 227 KiB block (sm_90,
// sm_100).
PYFA_HD int fa2_backward_dkdv_fast_threads(int64_t) { return 4 * kFastBc; }

enum Fa2BackwardDkdvFastTerm { FA2KVF_KjT, FA2KVF_VjT, FA2KVF_Qi, FA2KVF_dOi, FA2KVF_PT, FA2KVF_dST };

template <int STAGES>
PYFA_HD SmemLayout fa2_backward_dkdv_fast_layout(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("K_j^T", d, Bc);       // loaded once: a thread's 8 keys at one x are 32 bytes
    L.add("V_j^T", d, Bc);
    const int64_t rows = STAGES == 1 ? Br : checked_mul(STAGES, Br);  // stage s at s * Br rows (as above)
    L.add("Q_i", rows, d);   // for S^T = K Q^T and dS^T Q, chunks swizzled
    L.add("dO_i", rows, d);  // for dP^T = V dO^T and P^T dO
    L.add("P_ij^T", Bc, fast_p_stride(Br));
    L.add("dS_ij^T", Bc, fast_p_stride(Br));
    return L;
}
PYFA_HD SmemLayout fa2_backward_dkdv_fast_smem(int64_t Br, int64_t Bc, int64_t d) {
    return fa2_backward_dkdv_fast_layout<1>(Br, Bc, d);
}
PYFA_HD SmemLayout fa2_backward_dkdv_fast_smem2(int64_t Br, int64_t Bc, int64_t d) {
    return fa2_backward_dkdv_fast_layout<2>(Br, Bc, d);
}

// ---- FA1 backward, fast variant (src/kernels/fast/fa1_backward_fast.cuh): 8 warps, two
// halves of 4 that each own the 64 keys of K_j (the P half: S, P, dV~_j; the dS half: dP,
// dS, dK~_j); Br = Bc = 64, d = 64 or 128. dK~_j and dV~_j live in registers; Q_i, dO_i,
// O_i are kept once, row-major with swizzled chunks, for both the transposed products and
// D_i: 130.25 KiB at d = 64 (an A100's 163 KiB holds it), 226.25 KiB at d = 128 (an H200's
// 227 KiB).
PYFA_HD int fa1_backward_fast_threads(int64_t) { return 4 * kFastBc; }

enum Fa1BackwardFastTerm { FA1BF_KjT, FA1BF_VjT, FA1BF_Kj, FA1BF_Qi, FA1BF_dOi, FA1BF_Oi, FA1BF_PT, FA1BF_dST, FA1BF_Di };

PYFA_HD SmemLayout fa1_backward_fast_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("K_j^T", d, Bc);       // outer loop: loaded once per j, for S^T = K Q^T
    L.add("V_j^T", d, Bc);       // for dP^T = V dO^T
    L.add("K_j", Bc, d);         // for dS K
    L.add("Q_i", Br, d);         // inner loop: reloaded for every (j, g, i)
    L.add("dO_i", Br, d);
    L.add("O_i", Br, d);         // for D_i only
    L.add("P_ij^T", Bc, fast_p_stride(Br));
    L.add("dS_ij^T", Bc, fast_p_stride(Br));
    L.add("D_i", Br, 1);         // rowsum(dO_i o O_i), recomputed for every (j, g, i)
    return L;
}

// ---- FA1 forward, fast variant (src/kernels/fast/fa1_forward_fast.cuh): the fast FA2
// forward's thread layout (16 rows per warp, 2 * Br threads); Bc = 64, d = 64 or 128.
PYFA_HD int fa1_forward_fast_threads(int64_t Br) { return static_cast<int>(2 * Br); }

enum Fa1ForwardFastTerm { FA1FF_KjT, FA1FF_Vj, FA1FF_QiT, FA1FF_Pij };

// The row scales of a step sit in each P~_ij row's 4 floats of padding (columns Bc ..
// Bc + 3: o_scale, pv_scale, l_new, m~_ij), so that d = 128 fits 128 rows in 227 KiB.
PYFA_HD SmemLayout fa1_forward_fast_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("K_j^T", d, Bc);        // outer loop: loaded once, used against every Q_i
    L.add("V_j", Bc, d);
    L.add("Q_i^T", checked_mul(2, d), Br);    // two buffers: Q_{i+1} is stored while Q_i is read
    L.add("P~_ij, row scales", Br, fast_p_stride(Bc));
    return L;
}
