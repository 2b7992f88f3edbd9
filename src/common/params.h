// params.h: the one argument every kernel takes, passed by value.
// Pointers are device pointers (host pointers under the emulator). The (B, H|Hkv, N, d)
// tensors are float32 with the last dimension contiguous and the element strides given
// in `TensorStrides`; the per-row tensors (lse, m, l, drow) are dense (B, H, Nq).
// Indices into them are int64_t.
#pragma once

#include <cstdint>

#include "common/mask.h"

// Element strides of a (B, heads, N, d) tensor, resolved at launch set-up: the caller's
// all-zero pyfa_strides has become the dense (heads*N*d, N*d, d) here.
struct TensorStrides {
    int64_t batch;  // elements from batch b to b + 1
    int64_t head;   // elements from head h to h + 1
    int64_t row;    // elements from row n to n + 1; element d of a row is at + d

    PYFA_HD int64_t at(int64_t b, int64_t h, int64_t n) const {
        return b * batch + h * head + n * row;
    }
};

struct AttentionParams {
    // ---- inputs
    const float* q;     // (B, H, Nq, d)    Q
    const float* k;     // (B, Hkv, Nk, d)  K
    const float* v;     // (B, Hkv, Nk, d)  V
    // ---- forward outputs, inputs of the backward pass
    float* o;           // (B, H, Nq, d)  O = softmax(scale * Q K^T) V
    float* lse;         // (B, H, Nq)     FA2: LSE_i = m_i + log(l_i), -inf for a row with no visible key
    float* m;           // (B, H, Nq)     FA1: running row max m, kept in HBM between K/V tiles
    float* l;           // (B, H, Nq)     FA1: running row sum l = sum_j exp(S_ij - m_i)
    // ---- backward
    const float* dout;  // (B, H, Nq, d)    dO, the incoming gradient of O
    float* dq;          // (B, H, Nq, d)    dQ
    float* dk;          // (B, Hkv, Nk, d)  dK, summed over the query heads of its group
    float* dv;          // (B, Hkv, Nk, d)  dV, summed over the query heads of its group
    float* drow;        // (B, H, Nq)       FA2: D_i = rowsum(dO_i o O_i), written by the preprocess kernel
    // ---- strides of the (B, heads, N, d) tensors above, in elements
    TensorStrides q_strides, k_strides, v_strides, o_strides;
    TensorStrides dout_strides, dq_strides, dk_strides, dv_strides;
    // ---- problem
    int64_t batch;      // B
    int64_t heads;      // H, query heads
    int64_t heads_kv;   // Hkv, K/V heads; H % Hkv == 0, query head h reads K/V head h / (H / Hkv)
    int64_t seqlen_q;   // Nq
    int64_t seqlen_k;   // Nk
    int64_t head_dim;   // d
    float scale;        // multiplies Q K^T; already resolved (never 0 here)
    Mask mask;          // which keys each query row sees (common/mask.h)
    // ---- score modifications (common/score.h score_mod)
    float softcap;      // softcap: S = softcap * tanh(s / softcap); 0: off
    // ALiBi: S -= slope_{b,h} * |i + mask.off - j|, slope_{b,h} = alibi_slopes[alibi_strides.at(b, h, 0)]
    const float* alibi_slopes;   // (B, H), or (H,) as batch stride 0; NULL: off
    TensorStrides alibi_strides; // element strides of alibi_slopes (row unused)
    // ---- tiling
    int block_r;        // Br: rows of Q (and O, dO, dQ) per tile
    int block_c;        // Bc: rows of K and V (and dK, dV) per tile
};
