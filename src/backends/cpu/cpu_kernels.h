// cpu_kernels.h: what each instruction-set build of the cpu backend's tile code
// (cpu_impl.h, compiled once per instruction set) offers the dispatcher (cpu_backend.cpp).
// One call computes one work item; the dispatcher spreads items over threads. The items
// of one phase write disjoint outputs, so results never depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/params.h"

namespace pyfa_cpu {

// Everything a work item reads. p's pointers are bound (outputs may be staging buffers)
// and p.block_r, p.block_c are the tiles of the kernel whose results the phase reproduces.
struct Ctx {
    AttentionParams p;
    bool fa1;                // FA1's formulas (docs/numerics.md), else FA2's
    float* D;                // D = rowsum(dO o O), laid out as lse; written by the rowdot phase
    // The mask's bands for p's tiles: K/V tiles [kv_begin[n], kv_end[n]) of Q tile i,
    // Q tiles [q_begin[n], q_end[n]) of K/V tile j (common/mask.h), n = i (j) for a dense
    // batch, whose sequences share them, and b * Tr + i (b * Tc + j) for a packed one.
    const int64_t* kv_begin;  // (Tr) or (B, Tr)
    const int64_t* kv_end;
    const int64_t* q_begin;   // (Tc) or (B, Tc)
    const int64_t* q_end;
    int64_t Tr, Tc;           // Q and K/V tiles of the grid: of the longest sequence
    bool per_sequence;        // bands per sequence (packed)
    bool group;               // the forward runs forward_group (workspace for it)
    int64_t group_heads = 1;  // adjacent K/V heads per forward_group item (group_heads())
    bool prefetch_past = false;  // forward_group: the last K/V tile prefetches the keys after it
                                 // (a split's next chunk, which the same thread computes next)
    bool first_prefetched = false;  // forward_group: the call before prefetched past its last tile
                                    // (this one's first, unless a mask ended that one early)

    TileRange kv_tiles(int64_t b, int64_t i) const {
        const int64_t n = (per_sequence ? b * Tr : 0) + i;
        return TileRange{kv_begin[n], kv_end[n]};
    }
    TileRange q_tiles(int64_t b, int64_t j) const {
        const int64_t n = (per_sequence ? b * Tc : 0) + j;
        return TileRange{q_begin[n], q_end[n]};
    }
};

struct Isa {
    const char* name;
    int width;  // floats per vector
    // Floats of per-thread workspace any item of ctx needs (forward or backward).
    size_t (*workspace_floats)(const Ctx& ctx);
    // Forward (FA1 or FA2) of Q tile i of head bh: O, and LSE (FA2) or m, l (FA1).
    void (*forward)(const Ctx& ctx, int64_t bh, int64_t i, float* ws);
    // D of the rows of Q tile i of head bh.
    void (*rowdot)(const Ctx& ctx, int64_t bh, int64_t i);
    // dK_j, dV_j of K/V tile j of K/V head bkv = b * Hkv + hk (the dK/dV kernel's walk
    // over the group's query heads g, then Q tiles). With with_dq, also adds each tile
    // pair's dQ contribution into p.dq, in place: called for j = 0, 1, ... in order on one
    // thread after zero_dq of the group's heads, that is the dQ kernel's sum.
    void (*backward_kv)(const Ctx& ctx, int64_t bkv, int64_t j, bool with_dq, float* ws);
    // dQ_i of Q tile i of head bh (the dQ kernel's walk over K/V tiles).
    void (*backward_dq)(const Ctx& ctx, int64_t bh, int64_t i, float* ws);
    // Before and after a head's backward_kv(with_dq) calls: dQ = 0, then its final form.
    void (*zero_dq)(const Ctx& ctx, int64_t bh);
    void (*finish_dq)(const Ctx& ctx, int64_t bh);
    // FA2 forward of Q tile i of the G = H / Hkv query heads of each K/V head together
    // (their rows g * br + r), lanes along keys and x: for tiles of fewer rows than
    // kGroupRows, where the forward's lanes along rows would run mostly empty. Item u
    // covers ctx.group_heads adjacent K/V heads of one batch element (cpu_impl.h).
    void (*forward_group)(const Ctx& ctx, int64_t u, int64_t i, float* ws);
};

// K/V heads per forward_group item: 1, unless K and V hold adjacent heads side by side in
// each key row ((B, N, Hkv, d) or paged: head stride d, rows longer than a head), where a
// head's rows alone are short runs a row stride apart, each on its own 4 KiB page, which
// the hardware prefetchers do not follow. Then the largest divisor n of Hkv that still
// leaves `threads` items: B * Hkv / n * parallel >= threads, `parallel` being the items of
// each (batch element, head block).
inline int64_t group_heads(const AttentionParams& p, int threads, int64_t parallel) {
    const int64_t d = p.head_dim, Hkv = p.heads_kv;
    const bool side_by_side = p.k_strides.head == d && p.v_strides.head == d && p.k_strides.row >= Hkv * d &&
                              p.v_strides.row >= Hkv * d;
    if (!side_by_side) return 1;
    for (int64_t n = Hkv; n > 1; --n)
        if (Hkv % n == 0 && p.batch * (Hkv / n) * parallel >= threads) return n;
    return 1;
}

// The dispatcher serves an FA2 forward whose grid has at most this many query rows
// (decoding: Nq = 1, or a few speculative tokens) with forward_group.
constexpr int64_t kGroupRows = 8;

extern const Isa kIsaPortable;
#if defined(__x86_64__) || defined(_M_X64)
extern const Isa kIsaAvx2;
extern const Isa kIsaAvx512;
extern const Isa kIsaAvx512Wide;
#endif

}  // namespace pyfa_cpu
