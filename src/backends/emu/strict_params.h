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
enum Written : unsigned { kO = 1, kLse = 2, kM = 4, kL = 8, kDq = 16, kDk = 32, kDv = 64, kDrow = 128 };
inline unsigned written_by(int kernel) {
    switch (kernel) {
        case PYFA_KERNEL_FA1_FORWARD: return kO | kM | kL;
        case PYFA_KERNEL_FA2_FORWARD: return kO | kLse;
        case PYFA_KERNEL_FA1_BACKWARD: return kDq | kDk | kDv;
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS: return kDrow;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: return kDk | kDv;
        case PYFA_KERNEL_FA2_BACKWARD_DQ: return kDq;
    }
    return 0;
}

// Registers every tensor of p with the session and points q at the session's copies.
inline bool strict_tensors(pyfa_emu::StrictSession& S, int kernel, const AttentionParams& p, AttentionParams& q) {
    const unsigned out = written_by(kernel);
    bool ok = true;
    auto add = [&](const char* name, auto* data, int64_t heads, int64_t n, int64_t d, const TensorStrides& st,
                   unsigned bit) {
        const int64_t dims[4] = {p.batch, heads, n, d};
        const int64_t strides[3] = {st.batch, st.head, st.row};
        float* copy = S.add_tensor(name, const_cast<float*>(data), dims, strides, (out & bit) != 0);
        if (data && !copy) ok = false;
        return copy;
    };
    const TensorStrides rows{p.heads * p.seqlen_q, p.seqlen_q, 1};  // lse, m, l, drow: dense (B, H, Nq)
    const int64_t H = p.heads, Hkv = p.heads_kv, Nq = p.seqlen_q, Nk = p.seqlen_k, d = p.head_dim;
    q.q = add("q", p.q, H, Nq, d, p.q_strides, 0);
    q.k = add("k", p.k, Hkv, Nk, d, p.k_strides, 0);
    q.v = add("v", p.v, Hkv, Nk, d, p.v_strides, 0);
    q.o = add("o", p.o, H, Nq, d, p.o_strides, kO);
    q.lse = add("lse", p.lse, H, Nq, 1, rows, kLse);
    q.m = add("m", p.m, H, Nq, 1, rows, kM);
    q.l = add("l", p.l, H, Nq, 1, rows, kL);
    q.dout = add("dout", p.dout, H, Nq, d, p.dout_strides, 0);
    q.dq = add("dq", p.dq, H, Nq, d, p.dq_strides, kDq);
    q.dk = add("dk", p.dk, Hkv, Nk, d, p.dk_strides, kDk);
    q.dv = add("dv", p.dv, Hkv, Nk, d, p.dv_strides, kDv);
    q.drow = add("drow", p.drow, H, Nq, 1, rows, kDrow);
    return ok;
}

}  // namespace pyfa_emu
