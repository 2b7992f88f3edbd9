// fa2_forward.cuh: FlashAttention-2 forward (Dao 2023, Algorithm 1), fp32.
// Simulator twin: pyfa/sim/fa2_forward.py (same names, same loop order, same operations).
// Numerical contract: docs/numerics.md.
//
// One block per (Q row block i, query head h, batch b); head h reads K/V head
// hk = h / (H / Hkv). With GQA packing (params.h pack_gqa, where the group's rows take
// fewer tiles packed, as decoding's) one block per (i, K/V head hk, b) instead, its rows
// those of the group's G query heads taken query by query: K_j, V_j read once per group.
// The block loads Q_i once and walks the K/V tiles j of the mask's
// band [begin, end) (tiles wholly masked for Q_i are skipped), keeping the running max m_i, the running sum l_i and the
// unnormalized accumulator O_i in shared memory:
//     m_new   = max(m_old, rowmax(S_ij))                 S_ij = scale * Q_i K_j^T
//     P~_ij   = exp(S_ij - m_new)
//     l_i     = exp(m_old - m_new) * l_i + rowsum(P~_ij)     (one fma)
//     O_i     = exp(m_old - m_new) * O_i + P~_ij V_j         (one fma)
// and only at the end divides: O_i / l_i, LSE_i = m_i + log(l_i); attention sinks are
// then merged into that final state (common/merge.h).
#pragma once

#include <cmath>

#include "common/device.h"
#include "common/fault.h"
#include "common/merge.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/score.h"
#include "common/smem.h"
#include "common/tiling.h"

namespace PYFA_KERNELS {

__global__ void fa2_forward_kernel(const AttentionParams p) {
    const int64_t y = blockIdx.y, b = blockIdx.z;  // y: the query head, or packed the K/V head
    if (p.split_count > 0) {  // split-KV's combine launch (params.h), never packed
        split_combine_tile(p, blockIdx.x, y, b, threadIdx.x, blockDim.x);
        return;
    }
    // Q tile i of key chunk `chunk` (params.h chunk_block), whose partial (O, LSE) lies
    // `part` partial steps from o and lse; without split-KV chunk and part are 0.
    const AttentionParams::ChunkBlock cb = p.chunk_block(blockIdx.x);
    const int64_t i = cb.i, part = cb.chunk - p.split_index;
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, Nk = seq.Nk;
    const int64_t NR = seq.Nq * p.packed_heads();  // this block row's rows: Nq, or G * Nq packed
    const int64_t Br = p.block_r, Bc = p.block_c;
    if (i * Br >= NR) return;  // past its sequence's rows (a shorter one of a packed batch)
    const int64_t tid = threadIdx.x, nthreads = blockDim.x;

    const int64_t hk = p.pack_gqa ? y : y / (p.heads / p.heads_kv);  // the K/V head of these rows
    // Row r of the tile is query qr(r).i of query head qr(r).h (params.h q_row).
    const int64_t row0 = i * Br;
    const int64_t br = min64(Br, NR - row0);  // rows of this tile (fewer in the tail)
    auto qr = [&](int64_t r) { return p.q_row(y, row0 + r); };
    // Key n of the sequence is row p.kv_row(seq.k0 + n) of K and V (params.h: paged K/V).
    const float* K = p.k + p.k_strides.at(seq.batch, hk, 0);  // (rows of k, d), row stride row_k
    const float* V = p.v + p.v_strides.at(seq.batch, hk, 0);  // (rows of v, d), row stride row_v
    const int64_t row_k = p.k_strides.row, row_v = p.v_strides.row;
    // Query qr(r) of Q (d), of O (d) and of LSE (1): partial `part` of them under split-KV.
    auto Q_row = [&](int64_t r) { return p.q + p.q_strides.at(seq.batch, qr(r).h, seq.q0 + qr(r).i); };
    auto O_row = [&](int64_t r) {
        return p.o + part * p.o_part_step + p.o_strides.at(seq.batch, qr(r).h, seq.q0 + qr(r).i);
    };
    auto LSE_row = [&](int64_t r) { return p.lse + part * p.lse_part_step + p.stat_at(seq, qr(r).h) + qr(r).i; };

    PYFA_DYNAMIC_SMEM(smem_raw);
    float* smem = reinterpret_cast<float*>(smem_raw);
    const SmemLayout L = fa2_forward_smem(Br, Bc, d);
    const int64_t ldk = padded(d), lds = padded(Bc);  // row strides, see smem.h
    float* Qi = smem + L.offset[FA2F_Qi];        // (br, d)
    float* Kj = smem + L.offset[FA2F_Kj];        // (bc, d), row stride ldk
    float* Vj = smem + L.offset[FA2F_Vj];        // (bc, d)
    float* Sij = smem + L.offset[FA2F_Sij];      // (br, bc), row stride lds
    float* Oi = smem + L.offset[FA2F_Oi];        // (br, d)
    float* mi = smem + L.offset[FA2F_mi];        // (br)
    float* li = smem + L.offset[FA2F_li];        // (br)
    float* alpha = smem + L.offset[FA2F_alpha];  // (br)

    for (int64_t e = tid; e < br * d; e += nthreads) {
        Qi[e] = Q_row(e / d)[e % d + (PYFA_FAULT(bounds) ? 1 : 0)];
        Oi[e] = 0.0f;
    }
    for (int64_t r = tid; r < br; r += nthreads) {
        if (!PYFA_FAULT(init)) mi[r] = -INFINITY;
        li[r] = 0.0f;
    }

    // The tile's queries are qr(0).i .. qr(br - 1).i (increasing with r).
    const TileRange visit =
        p.split_tiles(seq.mask.kv_tiles(qr(0).i, qr(br - 1).i - qr(0).i + 1, Bc, Nk), Bc, cb.chunk);
    for (int64_t j = visit.begin; j < visit.end; ++j) {
        const int64_t col0 = j * Bc;
        const int64_t bc = min64(Bc, Nk - col0);
        if (!(PYFA_FAULT(barrier) && tid < 32)) __syncthreads();  // the previous step's readers of K_j, V_j and S_ij are done
        for (int64_t e = tid; e < bc * d; e += nthreads) {
            const int64_t c = e / d, x = e % d;
            const int64_t n = p.kv_row(seq.k0 + col0 + c);
            Kj[c * ldk + x] = K[n * row_k + x];
            Vj[e] = V[n * row_v + x];
        }
        if (!PYFA_FAULT(race)) __syncthreads();

        // S_ij[r, c]: the score pipeline (common/score.h), its sum x = 0 .. d-1 in order.
        for (int64_t e = tid; e < br * bc; e += nthreads) {
            const int64_t r = e / bc, c = e % bc;
            const AttentionParams::QRow q = qr(r);
            Sij[r * lds + c] = attention_score(p, seq.mask, Qi + r * d, Kj + c * ldk, b, q.h, q.i, col0 + c);
        }
        __syncthreads();
        // The visible keys of row r among c = 0 .. bc-1.
        auto cols = [&](int64_t r) { return seq.mask.band(qr(r).i, col0).cols(0, bc); };

        // m_new = max(m_old, S_ij[r, 0], ..., S_ij[r, bc-1]); alpha = exp(m_old - m_new).
        // A row that sees no key of the tile takes no step (alpha is not read for it).
        for (int64_t r = tid; r < br; r += nthreads) {
            if (cols(r).begin == cols(r).end) continue;
            const float m_old = mi[r];
            float m_new = m_old;
            for (int64_t c = 0; c < bc; ++c) m_new = pyfa_max(m_new, Sij[r * lds + c]);
            alpha[r] = pyfa_exp(m_old - safe_max(m_new));
            mi[r] = m_new;
        }
        __syncthreads();

        // P~_ij = exp(S_ij - m_new), in place.
        for (int64_t e = tid; e < br * bc; e += nthreads) {
            const int64_t r = e / bc, c = e % bc;
            Sij[r * lds + c] = pyfa_exp(Sij[r * lds + c] - safe_max(mi[r]));
        }
        __syncthreads();

        // l_i = fma(alpha, l_i, rowsum(P~_ij)), the row sum taken c = 0 .. bc-1 in order.
        for (int64_t r = tid; r < br; r += nthreads) {
            if (cols(r).begin == cols(r).end) continue;
            float rowsum = 0.0f;
            for (int64_t c = 0; c < bc; ++c) rowsum = rowsum + Sij[r * lds + c];
            li[r] = pyfa_fma(alpha[r], li[r], rowsum);
            // P V takes P~ o Z / (1 - p) (common/dropout.h); l above took P~ undropped.
            p.dropout.apply_row(Sij + r * lds, bc, b, qr(r).h, qr(r).i, col0);
        }
        if (p.dropout.on()) __syncthreads();  // every row's P~ is dropped before P V reads it
        // O_i = fma(alpha, O_i, P~_ij V_j), the product summed over the row's visible keys
        // c in increasing order (hidden ones are left out, not multiplied by 0).
        for (int64_t e = tid; e < br * d; e += nthreads) {
            const int64_t r = e / d, x = e % d;
            const TileRange vis = cols(r);
            if (vis.begin == vis.end) continue;
            float pv = 0.0f;
            for (int64_t c = vis.begin; c < vis.end; ++c) pv = pyfa_fma(Sij[r * lds + c], Vj[c * d + x], pv);
            Oi[e] = pyfa_fma(alpha[r], Oi[e], pv);
        }
    }
    __syncthreads();

    // O_i = O_i / l_i; LSE_i = m_i + log(l_i). A row that saw no key has l_i = 0:
    // it gets O = 0 and LSE = -inf rather than 0/0.
    for (int64_t e = tid; e < br * d; e += nthreads) {
        const float l = li[e / d];
        O_row(e / d)[e % d] = pyfa_canonical_nan(l == 0.0f ? 0.0f : Oi[e] / l);
    }
    for (int64_t r = tid; r < br; r += nthreads) {
        const float l = li[r];
        *LSE_row(r) = pyfa_canonical_nan(l == 0.0f ? -INFINITY : mi[r] + pyfa_log(l));
    }
    // Attention sinks join the final state (split: the combine's), read back from where it
    // was just written: a row's elements are other threads' writes.
    if (p.sinks && p.final_state()) {
        __syncthreads();
        merge_sinks_tile(
            p, br, O_row, LSE_row, [&](int64_t r) { return qr(r).h; }, tid, nthreads, [] { __syncthreads(); });
    }
}

}  // namespace PYFA_KERNELS
