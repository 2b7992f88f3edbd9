// strict_params.h: a kernel's AttentionParams registered with a strict session (strict.h):
// every tensor it may address, which of them it writes, and the copies it runs on. Used
// by the emulator backend and by the mutation tests (tests/emu/strict_faults.cpp).
#pragma once

#include "backends/emu/strict.h"
#include "common/params.h"
#include "pyfa.h"

namespace pyfa_emu {

// Which of a kernel's tensors it writes: the rest it only reads (strict mode's bounds and
// init checks follow this).
enum Written : unsigned {
    kO = 1, kLse = 2, kM = 4, kL = 8, kDq = 16, kDk = 32, kDv = 64, kDrow = 128, kDbias = 256
};
inline unsigned written_by(int kernel) {
    switch (kernel) {
        case PYFA_KERNEL_FA1_FORWARD: return kO | kM | kL;
        case PYFA_KERNEL_FA2_FORWARD: return kO | kLse;
        case PYFA_KERNEL_FA1_BACKWARD: return kDq | kDk | kDv | kDbias;
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS: return kDrow;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: return kDk | kDv | kDbias;
        case PYFA_KERNEL_FA2_BACKWARD_DQ: return kDq;
    }
    return 0;
}

// Registers every tensor of p with the session, each with the extent the kernels may
// address (params.h), and points q at the session's copies. Packed sequences (varlen) are
// one batch of total_q (total_k) rows and their per-row tensors (H, total_q); the int32
// offsets are registered as 4-byte elements, which is all the checks look at.
inline bool strict_tensors(pyfa_emu::StrictSession& S, int kernel, const AttentionParams& p, AttentionParams& q) {
    const unsigned out = written_by(kernel);
    const bool packed = p.cu_seqlens_q != nullptr;
    const int64_t B = packed ? 1 : p.batch;
    bool ok = true;
    auto add4 = [&](const char* name, const void* data, const int64_t (&dims)[4], const TensorStrides& st,
                    unsigned bit) {
        const int64_t strides[3] = {st.batch, st.head, st.row};
        float* copy = S.add_tensor(name, static_cast<float*>(const_cast<void*>(data)), dims, strides,
                                   (out & bit) != 0);
        if (data && !copy) ok = false;
        return copy;
    };
    auto add = [&](const char* name, auto* data, int64_t heads, int64_t n, int64_t d, const TensorStrides& st,
                   unsigned bit) {
        return static_cast<decltype(data)>(add4(name, data, {B, heads, n, d}, st, bit));
    };
    const int64_t H = p.heads, Hkv = p.heads_kv, d = p.head_dim;
    const int64_t Nq = packed ? p.total_q : p.seqlen_q;
    const int64_t Nk = packed ? p.cu_seqlens_k[p.batch] : p.seqlen_k;
    const TensorStrides rows{H * Nq, Nq, 1};  // lse, m, l, drow: dense (B, H, Nq), (H, total_q) packed
    q.q = add("q", p.q, H, Nq, d, p.q_strides, 0);
    const int64_t kv_rows = p.block_table ? p.num_pages * p.page_size : Nk;  // paged: the pages
    q.k = add("k", p.k, Hkv, kv_rows, d, p.k_strides, 0);
    q.v = add("v", p.v, Hkv, kv_rows, d, p.v_strides, 0);
    if (p.split_launch_chunks > 1) {  // a launch of several chunks' partials, each a dense o, lse
        const int64_t C = p.split_launch_chunks;
        const TensorStrides o_parts{p.o_part_step / B, p.o_strides.head, p.o_strides.row};
        q.o = static_cast<float*>(add4("o", p.o, {B * C, H, Nq, d}, o_parts, kO));
        const TensorStrides lse_parts{p.lse_part_step / B, Nq, 1};
        q.lse = static_cast<float*>(add4("lse", p.lse, {B * C, H, Nq, 1}, lse_parts, kLse));
    } else {
        q.o = add("o", p.o, H, Nq, d, p.o_strides, kO);
        q.lse = add("lse", p.lse, H, Nq, 1, rows, kLse);
    }
    q.m = add("m", p.m, H, Nq, 1, rows, kM);
    q.l = add("l", p.l, H, Nq, 1, rows, kL);
    q.dout = add("dout", p.dout, H, Nq, d, p.dout_strides, 0);
    q.dq = add("dq", p.dq, H, Nq, d, p.dq_strides, kDq);
    q.dk = add("dk", p.dk, Hkv, Nk, d, p.dk_strides, kDk);
    q.dv = add("dv", p.dv, Hkv, Nk, d, p.dv_strides, kDv);
    q.drow = add("drow", p.drow, H, Nq, 1, rows, kDrow);
    // The score modifications (common/score.h): bias (B, H, Nq, Nk) through its strides, 0
    // along a broadcast axis; dS into dbias (B, H, Nq or 1, Nk) dense; ALiBi's slopes
    // (B, H), batch stride 0 for (H,).
    q.bias = add4("bias", p.bias, {p.batch, H, p.seqlen_q, p.seqlen_k}, p.bias_strides, 0);
    const int64_t dbias_rows = p.bias_strides.row != 0 ? p.seqlen_q : 1;
    q.dbias = add4("dbias", p.dbias, {p.batch, H, dbias_rows, p.seqlen_k},
                   TensorStrides{H * dbias_rows * p.seqlen_k, dbias_rows * p.seqlen_k, p.seqlen_k}, kDbias);
    const TensorStrides slopes{p.alibi_strides.batch, p.alibi_strides.head, 0};
    q.alibi_slopes = add4("alibi_slopes", p.alibi_slopes, {p.batch, H, 1, 1}, slopes, 0);
    if (packed) {
        const TensorStrides flat{0, 0, 0};
        const int64_t offsets[4] = {1, 1, 1, p.batch + 1};
        q.cu_seqlens_q = reinterpret_cast<const int32_t*>(add4("cu_seqlens_q", p.cu_seqlens_q, offsets, flat, 0));
        q.cu_seqlens_k = reinterpret_cast<const int32_t*>(add4("cu_seqlens_k", p.cu_seqlens_k, offsets, flat, 0));
        const int64_t lengths[4] = {1, 1, 1, p.batch};
        q.seqused_k = reinterpret_cast<const int32_t*>(add4("seqused_k", p.seqused_k, lengths, flat, 0));
        const int64_t pages[4] = {1, 1, 1, p.block_table ? Nk / p.page_size : 0};
        q.block_table = reinterpret_cast<const int32_t*>(add4("block_table", p.block_table, pages, flat, 0));
    }
    return ok;
}

}  // namespace pyfa_emu
