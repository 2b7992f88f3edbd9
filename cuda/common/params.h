// params.h: the one argument every kernel takes, passed by value.
// Pointers are device pointers (host pointers under the emulator); every tensor is dense
// row-major float32 with the shape given beside it. Indices into them are int64_t.
#pragma once

#include <cstdint>

struct AttentionParams {
    // ---- inputs
    const float* q;     // (B, H, Nq, d)  Q
    const float* k;     // (B, H, Nk, d)  K
    const float* v;     // (B, H, Nk, d)  V
    // ---- forward outputs, inputs of the backward pass
    float* o;           // (B, H, Nq, d)  O = softmax(scale * Q K^T) V
    float* lse;         // (B, H, Nq)     FA2: LSE_i = m_i + log(l_i), -inf for a row with no visible key
    float* m;           // (B, H, Nq)     FA1: running row max m, kept in HBM between K/V tiles
    float* l;           // (B, H, Nq)     FA1: running row sum l = sum_j exp(S_ij - m_i)
    // ---- backward
    const float* dout;  // (B, H, Nq, d)  dO, the incoming gradient of O
    float* dq;          // (B, H, Nq, d)  dQ
    float* dk;          // (B, H, Nk, d)  dK
    float* dv;          // (B, H, Nk, d)  dV
    float* drow;        // (B, H, Nq)     FA2: D_i = rowsum(dO_i o O_i), written by the preprocess kernel
    // ---- problem
    int64_t batch;      // B
    int64_t heads;      // H
    int64_t seqlen_q;   // Nq
    int64_t seqlen_k;   // Nk
    int64_t head_dim;   // d
    float scale;        // multiplies Q K^T; already resolved (never 0 here)
    int causal;         // key j masked for query i when j > i + (Nk - Nq)
    // ---- tiling
    int block_r;        // Br: rows of Q (and O, dO, dQ) per tile
    int block_c;        // Bc: rows of K and V (and dK, dV) per tile
};
