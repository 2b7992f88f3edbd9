// smem.h: the shared-memory layout of every kernel, term by term.
//
// Each kernel's layout is built by one function here. The kernel carves its dynamic
// shared memory with it, the launcher sizes the launch with it, the error for a tile
// that does not fit lists its terms, and sim/tiles.py mirrors it term for term
// (tests/test_tiles.py holds the two equal through pyfa_smem_bytes).
#pragma once

#include "common/device.h"

struct SmemLayout {
    static constexpr int kMaxTerms = 12;
    const char* name[kMaxTerms];
    int64_t offset[kMaxTerms];  // in floats from the start of dynamic shared memory
    int64_t floats[kMaxTerms];
    int count = 0;
    int64_t total_floats = 0;

    PYFA_HD void add(const char* term, int64_t n) {
        name[count] = term;
        offset[count] = total_floats;
        floats[count] = n;
        ++count;
        total_floats += n;
    }
    PYFA_HD int64_t bytes() const { return total_floats * static_cast<int64_t>(sizeof(float)); }
};

// Threads per block. Fixed, so that Br and Bc stay free runtime choices: every loop in
// the kernels strides by blockDim.x over the tile's elements or rows.
constexpr int kFa2ForwardThreads = 128;

// ---- FA2 forward. Terms in the order they sit in memory.
enum Fa2ForwardTerm { FA2F_Qi, FA2F_Kj, FA2F_Vj, FA2F_Sij, FA2F_Oi, FA2F_mi, FA2F_li, FA2F_alpha };

PYFA_HD SmemLayout fa2_forward_smem(int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    L.add("Q_i", Br * d);   // loaded once per block, reused against every K_j
    L.add("K_j", Bc * d);
    L.add("V_j", Bc * d);
    L.add("S_ij", Br * Bc); // scores, overwritten in place by P~_ij = exp(S_ij - m_i)
    L.add("O_i", Br * d);   // unnormalized accumulator, divided by l_i once at the end
    L.add("m_i", Br);       // running row max
    L.add("l_i", Br);       // running row sum
    L.add("alpha", Br);     // exp(m_old - m_new), the rescale of this step
    return L;
}
