// params.h: the one argument every kernel takes, passed by value.
// Pointers are device pointers (host pointers under the emulator). The (B, H|Hkv, N, d)
// tensors are float32 with the last dimension contiguous and the element strides given
// in `TensorStrides`; the per-row tensors (lse, m, l, drow) are dense (B, H, Nq).
// Indices into them are int64_t.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/dropout.h"
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

// One sequence of the batch as its blocks see it (AttentionParams::sequence): where its
// rows start in the tensors, its lengths and its own mask. Every kernel and the cpu
// backend find a block's rows through it, never through seqlen_q, seqlen_k or mask.
struct Sequence {
    int64_t batch;   // batch index of the 4-D tensors' strides: b dense, 0 packed
    int64_t q0, k0;  // row of its first query and of its first key in those tensors
    int64_t Nq, Nk;  // its lengths (0 allowed when packed)
    Mask mask;       // its mask: off from its own lengths
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
    // ---- dropout of P in P V (common/dropout.h); off when dropout.threshold is 0
    Dropout dropout;
    // ---- score modifications (common/score.h score_mod)
    float softcap;      // softcap: S = softcap * tanh(s / softcap); 0: off
    // ALiBi: S -= slope_{b,h} * |i + mask.off - j|, slope_{b,h} = alibi_slopes[alibi_strides.at(b, h, 0)]
    const float* alibi_slopes;   // (B, H), or (H,) as batch stride 0; NULL: off
    TensorStrides alibi_strides; // element strides of alibi_slopes (row unused)
    // ---- tiling
    int block_r;        // Br: rows of Q (and O, dO, dQ) per tile
    int block_c;        // Bc: rows of K and V (and dK, dV) per tile
    // ---- packed sequences (varlen: pyfa.h's cu_seqlens_q, cu_seqlens_k); null for a
    // dense batch. Packed, the 4-D tensors hold one batch of total_q (total_k) rows,
    // sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (keys likewise),
    // batch is the number of sequences and seqlen_q, seqlen_k are bounds of their lengths
    // (the grid's), and the per-row tensors are (H, total_q).
    const int32_t* cu_seqlens_q;  // (B + 1) offsets, first 0, last total_q
    const int32_t* cu_seqlens_k;  // (B + 1) offsets, first 0, last total_k
    const int32_t* seqused_k;     // (B) keys sequence b uses, from its first (pyfa.h); null: all
    // Paged K/V (pyfa.h's page_size): packed key row r lies at row kv_row(r) of k and v.
    const int32_t* block_table;   // (total_k / page_size) page of each page_size logical rows; null: not paged
    int64_t page_size;            // rows per page
    int64_t num_pages;            // pages of k and v: num_pages * page_size rows
    int64_t total_q;              // rows of q, o, dO, dQ
    int causal_align;             // a pyfa_causal_align: each sequence's off (mask.h)
    // ---- split-KV (pyfa.h's split_size): 0 for one chunk. A split FA2 forward is the
    // forward kernel launched for chunks c = split_index, split_index + 1, ... of
    // split_size keys (a multiple of Bc), each block visiting only its chunk's K/V tiles
    // and writing its partial (O, LSE) to o, lse (the scratch partials, chunk c at
    // (c - split_index) partial steps from them), then once more with split_count > 0, as
    // the combine step (common/merge.h) folding the partials in o_part, lse_part into o,
    // lse. All the chunks go in one launch (chunk_block: the grid's x is Tr per chunk),
    // so that a decoding step's grid has chunks x H x B blocks, not H x B in each of
    // `chunks` launches one after another on a stream; the cpu backend takes a launch per
    // chunk (split_launch_chunks 0) and shares them among its threads itself.
    int64_t split_size;            // keys per chunk
    int64_t split_index;           // the (first) chunk a partial launch computes
    int64_t split_launch_chunks;   // > 1: the chunks of this partial launch (chunk_block)
    int64_t split_count;           // > 0: the combine launch, over this many partials
    const float* o_part;           // split_count x the dense layout of o (o_part_strides)
    const float* lse_part;         // split_count x the layout of lse
    TensorStrides o_part_strides;  // of one partial
    int64_t o_part_step, lse_part_step;  // elements from partial c to c + 1

    // ---- GQA packing (FA2 forward; src/core/tiles.cpp pack_gqa decides): 1: a block
    // serves the G = H / Hkv query heads of K/V head blockIdx.y, their rows packed query
    // by query into one grid of G * Nq rows (q_row), so that K_j and V_j are read once for
    // the group, not G times; 0: a block serves one query head. No bit depends on it: a
    // row's steps never read another row (docs/numerics.md, "Invariance").
    int pack_gqa;

    // Query heads whose rows one FA2 forward block holds: G packed, else 1.
    PYFA_HD int64_t packed_heads() const { return pack_gqa ? heads / heads_kv : 1; }
    // Row R of block row y's rows (y: blockIdx.y, a query head or, packed, a K/V head):
    // query i of query head h.
    struct QRow {
        int64_t h, i;
    };
    PYFA_HD QRow q_row(int64_t y, int64_t R) const {
        if (!pack_gqa) return QRow{y, R};
        const int64_t G = heads / heads_kv;
        return QRow{y * G + R % G, R / G};
    }

    // The K/V tiles of `visit` (a Q tile's band) in this launch's chunk: all of them
    // without split-KV. Bc: block_c, a compile-time constant in the fast kernels (no
    // 64-bit division there).
    PYFA_HD TileRange split_tiles(TileRange visit, int64_t Bc) const { return split_tiles(visit, Bc, split_index); }
    PYFA_HD TileRange split_tiles(TileRange visit, int64_t Bc, int64_t chunk) const {
        if (split_size <= 0) return visit;
        const int64_t per = split_size / Bc, lo = chunk * per, hi = lo + per;
        const int64_t a = visit.begin > lo ? visit.begin : lo, z = visit.end < hi ? visit.end : hi;
        return z > a ? TileRange{a, z} : TileRange{a, a};
    }

    // Block x of a partial launch: its Q tile i and chunk, x = (chunk - split_index) * Tr + i
    // where the launch has split_launch_chunks > 1, else Q tile x of chunk split_index.
    struct ChunkBlock {
        int64_t i, chunk;
    };
    // (A grid's x and Tr fit 32 bits: the one division a block makes stays a 32-bit one.)
    PYFA_HD ChunkBlock chunk_block(int64_t x) const {
        if (split_launch_chunks <= 1) return ChunkBlock{x, split_index};
        const uint32_t x32 = static_cast<uint32_t>(x),
                       Tr = static_cast<uint32_t>((seqlen_q * packed_heads() + block_r - 1) / block_r);
        return ChunkBlock{x32 % Tr, split_index + x32 / Tr};
    }

    // The row of k and v (in their row stride) holding packed key row r, r itself unless
    // paged. Every kernel and the cpu backend address a key row through it.
    PYFA_HD int64_t kv_row(int64_t r) const {
        return block_table ? static_cast<int64_t>(block_table[r / page_size]) * page_size + r % page_size : r;
    }

    PYFA_HD Sequence sequence(int64_t b) const {
        if (!cu_seqlens_q) return Sequence{b, 0, 0, seqlen_q, seqlen_k, mask};
        const int64_t q0 = cu_seqlens_q[b], k0 = cu_seqlens_k[b];
        const int64_t nq = cu_seqlens_q[b + 1] - q0, nk = seqused_k ? seqused_k[b] : cu_seqlens_k[b + 1] - k0;
        return Sequence{0, q0, k0, nq, nk, mask.for_lengths(causal_align, nq, nk)};
    }

    // Element of sequence s's row 0, query head h, in the per-row tensors (lse, m, l, D):
    // (B, H, Nq) dense, (H, total_q) packed.
    PYFA_HD int64_t stat_at(const Sequence& s, int64_t h) const {
        return cu_seqlens_q ? h * total_q + s.q0 : (s.batch * heads + h) * seqlen_q;
    }
    // ---- additive bias (issue 27): S = score_mod(s) + bias[b, h, i, j] (common/score.h)
    const float* bias;           // (B, H, Nq, Nk) through bias_strides, keys contiguous; nullptr: none
    TensorStrides bias_strides;  // of bias; 0 along an axis it broadcasts over (never "dense")
    float* dbias;                // (B, H, Nq or 1, Nk) dense, dS of each (b, h): rows 1 (the sum over
                                 // i = 0 .. Nq-1 in order) when bias_strides.row == 0; nullptr: not asked
    // ---- attention sinks (pyfa.h's tensors->sinks; FA2 forward): query head h's logit s_h
    // joins its rows' softmax with no value. Each row's final (O, LSE) is merged with the
    // state (0, s_h) (common/merge.h merge_sink) where it is written: by the forward's
    // epilogue unsplit, by the combine after the chunks split (never into a partial).
    const float* sinks;          // (H) s_h, -inf: head h has none; nullptr: no sinks

    PYFA_HD float sink(int64_t h) const { return sinks ? sinks[h] : -INFINITY; }
    // Whether this launch writes the rows' final state: not a split forward's partial.
    PYFA_HD bool final_state() const { return split_size <= 0 || split_count > 0; }
};

// The fold of dBias over a bias's broadcast B and H (issue 27; common/score.h
// dbias_fold_at), run after the kernel that writes `part`.
struct DbiasFold {
    const float* part;  // (B, H, rows, Nk) dense: AttentionParams::dbias as the kernels wrote it
    float* out;         // (sum_b ? 1 : B, sum_h ? 1 : H, rows, Nk) dense: the caller's dbias
    int64_t batch, heads, rows, keys;  // B, H, rows (Nq or 1), Nk
    bool sum_b, sum_h;  // the bias broadcasts along B, along H
    PYFA_HD int64_t elems() const { return (sum_b ? 1 : batch) * (sum_h ? 1 : heads) * rows * keys; }
};
