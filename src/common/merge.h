// merge.h: folding partial attention states (O, LSE) of the same rows, the split-KV
// combine step (docs/numerics.md, "Merging states"). Twin: pyfa/sim/merge.py.
//
// Parts are folded in ascending part order, acc starting empty (LSE = -inf):
//     part LSE_c = -inf: skipped (it saw no key)
//     acc empty:         acc = part c
//     otherwise:         m = max(LSE_acc, LSE_c), w_a = exp(LSE_acc - m), w_c = exp(LSE_c - m),
//                        w = w_a + w_c, O_acc = (w_a * O_acc + w_c * O_c) / w, LSE_acc = m + log(w)
// with the contract's pyfa_exp and pyfa_log and no fused multiply-add. A row no part saw
// keeps O = 0, LSE = -inf. Attention sinks are one more part, (O = 0, LSE = s_h), folded
// last into each row's final state.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/numerics.h"
#include "common/params.h"
#include "common/tiling.h"

// One step of the fold: part c, whose LSE is lse_c, into an accumulator whose LSE is
// acc_lse. Its weights depend on the two LSEs only, so a row computes the step once and
// applies it to each of its elements (the cpu backend's combine does; the same bits).
struct MergeStep {
    int kind;             // kSkip, kTake or kFold
    float w_a, w_c, w;    // kFold's weights
    float lse;            // the accumulator's LSE after the step
    static constexpr int kSkip = 0, kTake = 1, kFold = 2;

    // The accumulator's element after the step, from its element acc_o and part c's o_c.
    PYFA_HD float apply(float acc_o, float o_c) const {
        if (kind == kSkip) return acc_o;
        if (kind == kTake) return o_c;
        const float wo_a = w_a * acc_o, wo_c = w_c * o_c;
        return (wo_a + wo_c) / w;
    }
};

PYFA_HD MergeStep merge_step(float acc_lse, float lse_c) {
    if (lse_c == -INFINITY) return MergeStep{MergeStep::kSkip, 0.0f, 0.0f, 0.0f, acc_lse};
    if (acc_lse == -INFINITY) return MergeStep{MergeStep::kTake, 0.0f, 0.0f, 0.0f, lse_c};
    const float m = pyfa_max(acc_lse, lse_c);
    const float w_a = pyfa_exp(acc_lse - m), w_c = pyfa_exp(lse_c - m);
    const float w = w_a + w_c;
    return MergeStep{MergeStep::kFold, w_a, w_c, w, m + pyfa_log(w)};
}

// One element x of one row: the parts' LSE at lse[c * lse_step] and their O at
// o[c * o_step], c = 0 .. count-1, then the sink's state (0, sink) (params.h sinks;
// -inf, no sink, is skipped as any such part is). Writes the merged O element to *o_out
// and, when lse_out is given, the merged LSE (the same for every x of the row).
PYFA_HD void merge_state_element(const float* o, int64_t o_step, const float* lse, int64_t lse_step,
                                 int64_t count, float sink, float* o_out, float* lse_out) {
    float acc_o = 0.0f, acc_lse = -INFINITY;
    for (int64_t c = 0; c < count; ++c) {
        const MergeStep step = merge_step(acc_lse, lse[c * lse_step]);
        acc_o = step.apply(acc_o, o[c * o_step]);
        acc_lse = step.lse;
    }
    const MergeStep step = merge_step(acc_lse, sink);
    *o_out = pyfa_canonical_nan(step.apply(acc_o, 0.0f));
    if (lse_out) *lse_out = pyfa_canonical_nan(step.lse);
}

// Attention sinks (params.h sinks): the state (0, s) of query head h's sink folded into a
// row's final state (O, LSE) as part 1 after the row's own part 0, by the rule above (a
// part 0 of LSE -inf is skipped: the accumulator's O is 0 then). One element of O:
PYFA_HD float sink_merged_o(float o, float lse, float s) {
    return pyfa_canonical_nan(merge_step(lse, s).apply(lse == -INFINITY ? 0.0f : o, 0.0f));
}
// ... and the row's LSE.
PYFA_HD float sink_merged_lse(float lse, float s) { return pyfa_canonical_nan(merge_step(lse, s).lse); }
// ... and a whole row in place, O (d) at o, its LSE at *lse, the step's exps taken once.
PYFA_HD void merge_sink_row(float* o, int64_t d, float* lse, float s) {
    const MergeStep step = merge_step(*lse, s);
    const bool saw_none = *lse == -INFINITY;
    for (int64_t x = 0; x < d; ++x) o[x] = pyfa_canonical_nan(step.apply(saw_none ? 0.0f : o[x], 0.0f));
    *lse = pyfa_canonical_nan(step.lse);
}

// The sinks of the rows r = 0 .. rows-1 of a tile whose final (O, LSE) a kernel has
// just written at O_row(r) (d elements) and *LSE_row(r), query head head(r), merged in
// place, spread over threads tid = 0 .. nthreads-1. sync() (a block barrier) separates
// every element's read of its row's unmerged LSE from that LSE's write.
template <class ORow, class LSERow, class Head, class Sync>
PYFA_HD void merge_sinks_tile(const AttentionParams& p, int64_t rows, ORow O_row, LSERow LSE_row, Head head,
                              int64_t tid, int64_t nthreads, Sync sync) {
    const int64_t d = p.head_dim;
    for (int64_t e = tid; e < rows * d; e += nthreads) {
        const int64_t r = e / d;
        float* o = O_row(r) + e % d;
        *o = sink_merged_o(*o, *LSE_row(r), p.sink(head(r)));
    }
    sync();
    for (int64_t r = tid; r < rows; r += nthreads) *LSE_row(r) = sink_merged_lse(*LSE_row(r), p.sink(head(r)));
}

// The combine step of a split FA2 forward for Q tile i of query head h of sequence b,
// spread over threads tid = 0 .. nthreads-1: p.split_count partials in p.o_part (dense
// (B, H, Nq, d) or packed (1, H, total_q, d) each, strides p.o_part_strides, chunk c at
// c * p.o_part_step) and p.lse_part (laid out as lse, chunk c at c * p.lse_part_step),
// merged, and then with head h's sink, into p.o and p.lse.
PYFA_HD void split_combine_tile(const AttentionParams& p, int64_t i, int64_t h, int64_t b, int64_t tid,
                                int64_t nthreads) {
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, row0 = i * p.block_r;
    if (row0 >= seq.Nq) return;
    const int64_t br = min64(p.block_r, seq.Nq - row0);
    const float* O_part = p.o_part + p.o_part_strides.at(seq.batch, h, seq.q0 + row0);  // (br, d) of chunk 0
    const float* LSE_part = p.lse_part + p.stat_at(seq, h) + row0;                       // (br) of chunk 0
    float* O = p.o + p.o_strides.at(seq.batch, h, seq.q0 + row0);                        // (br, d)
    float* LSE = p.lse + p.stat_at(seq, h) + row0;                                       // (br)
    const float sink = p.sink(h);
    for (int64_t e = tid; e < br * d; e += nthreads) {
        const int64_t r = e / d, x = e % d;
        merge_state_element(O_part + r * p.o_part_strides.row + x, p.o_part_step, LSE_part + r, p.lse_part_step,
                            p.split_count, sink, O + r * p.o_strides.row + x, x == 0 ? LSE + r : nullptr);
    }
}

// The split FA2 backward's fold (params.h split_size; docs/numerics.md "FA2 backward",
// "Split-KV"), in the kernels and the cpu backend: one chunk's partial into the written
// gradient, one element, by the thread that owns that element in every chunk. out: the
// output element, holding canonical(acc) of the chunks folded so far (storing acc
// canonical leaves the final bits of canonical(acc): an add with a NaN operand gives a
// NaN either way). part: the chunk's unscaled sum, reset to +0 for the next chunk; mult:
// scale for dQ, dK, 1 for dV. The accumulator lives in the output rather than in more
// shared memory, so that the unsplit kernels' layouts (and so their default tiles and
// limits) stay as they are.
PYFA_HD void split_fold(float* out, float* part, float mult, bool first) {
    const float partial = pyfa_canonical_nan(*part * mult);
    const float acc = first ? 0.0f : *out;
    *out = pyfa_canonical_nan(acc + partial);
    *part = 0.0f;
}
