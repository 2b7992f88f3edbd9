// merge.h: folding partial attention states (O, LSE) of the same rows, the split-KV
// combine step (docs/numerics.md, "Merging states"). Twin: pyfa/sim/merge.py.
//
// Parts are folded in ascending part order, acc starting empty (LSE = -inf):
//     part LSE_c = -inf: skipped (it saw no key)
//     acc empty:         acc = part c
//     otherwise:         m = max(LSE_acc, LSE_c), w_a = exp(LSE_acc - m), w_c = exp(LSE_c - m),
//                        w = w_a + w_c, O_acc = (w_a * O_acc + w_c * O_c) / w, LSE_acc = m + log(w)
// with the contract's pyfa_exp and pyfa_log and no fused multiply-add. A row no part saw
// keeps O = 0, LSE = -inf.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/numerics.h"
#include "common/params.h"
#include "common/tiling.h"

// One element x of one row: the parts' LSE at lse[c * lse_step] and their O at
// o[c * o_step], c = 0 .. count-1. Writes the merged O element to *o_out and, when lse_out
// is given, the merged LSE (the same for every x of the row).
PYFA_HD void merge_state_element(const float* o, int64_t o_step, const float* lse, int64_t lse_step,
                                 int64_t count, float* o_out, float* lse_out) {
    float acc_o = 0.0f, acc_lse = -INFINITY;
    for (int64_t c = 0; c < count; ++c) {
        const float lse_c = lse[c * lse_step], o_c = o[c * o_step];
        if (lse_c == -INFINITY) continue;
        if (acc_lse == -INFINITY) {
            acc_o = o_c;
            acc_lse = lse_c;
            continue;
        }
        const float m = pyfa_max(acc_lse, lse_c);
        const float w_a = pyfa_exp(acc_lse - m), w_c = pyfa_exp(lse_c - m);
        const float w = w_a + w_c;
        const float wo_a = w_a * acc_o, wo_c = w_c * o_c;
        acc_o = (wo_a + wo_c) / w;
        acc_lse = m + pyfa_log(w);
    }
    *o_out = pyfa_canonical_nan(acc_o);
    if (lse_out) *lse_out = pyfa_canonical_nan(acc_lse);
}

// The combine step of a split FA2 forward for Q tile i of query head h of sequence b,
// spread over threads tid = 0 .. nthreads-1: p.split_count partials in p.o_part (dense
// (B, H, Nq, d) or packed (1, H, total_q, d) each, strides p.o_part_strides, chunk c at
// c * p.o_part_step) and p.lse_part (laid out as lse, chunk c at c * p.lse_part_step),
// merged into p.o and p.lse.
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
    for (int64_t e = tid; e < br * d; e += nthreads) {
        const int64_t r = e / d, x = e % d;
        merge_state_element(O_part + r * p.o_part_strides.row + x, p.o_part_step, LSE_part + r, p.lse_part_step,
                            p.split_count, O + r * p.o_strides.row + x, x == 0 ? LSE + r : nullptr);
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
