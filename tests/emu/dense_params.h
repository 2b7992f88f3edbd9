// dense_params.h: the AttentionParams of a dense (B, H, N, d) self-attention problem, every
// tensor contiguous, shared by the emulator's standalone test programs (emu_faults.cpp,
// strict_faults.cpp); the caller points it at its own buffers.
#pragma once

#include <cstdint>

#include "common/mask.h"
#include "common/params.h"

inline AttentionParams dense_params(int64_t B, int64_t H, int64_t N, int64_t d, int causal, int Br, int Bc) {
    AttentionParams p{};
    p.batch = B;
    p.heads = H;
    p.heads_kv = H;
    p.seqlen_q = N;
    p.seqlen_k = N;
    p.head_dim = d;
    p.scale = 0.125f;
    p.mask = make_mask(causal, /*window=*/0, 0, 0, /*align=*/0, N, N, /*shift=*/0);
    const TensorStrides dense{H * N * d, N * d, d};
    p.q_strides = p.k_strides = p.v_strides = p.o_strides = dense;
    p.dout_strides = p.dq_strides = p.dk_strides = p.dv_strides = dense;
    p.block_r = Br;
    p.block_c = Bc;
    return p;
}
