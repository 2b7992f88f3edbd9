// dropout.h: reproducible dropout of the attention probabilities, written once for every
// kernel (readable and fast), the cpu backend (per lane) and pyfa_dropout_mask. Simulator
// twin: pyfa/sim/dropout.py. Contract: docs/numerics.md, "Dropout".
//
// The keep decision Z[b, h, i, j] is a pure function of (seed, offset, b, h, i, j), made
// of 32-bit integer operations only, so that tiles, threads, backends and variants cannot
// change a bit of it:
//   the call's key  (k0, k1) = words 0, 1 of Philox4x32-10(key = (seed_lo, seed_hi),
//                                                       counter = (offset_lo, offset_hi, 0, 0))
//   the words       w[0..3]  = Philox4x32-10(key = (k0, k1), counter = (j / 4, i, h, b))
// where (b, h, i, j) are the call's own indices plus its dropout_origin (pyfa.h, ABI 11):
// a call on a block of a larger problem draws that problem's decisions.
//   the decision    Z = w[j % 4] >= threshold,  threshold = ceil(p * 2^32)
// The key is derived rather than the offset added into the counter because (offset, b, h,
// i, j / 4) is 160 bits and a counter is 128: any two offsets give unrelated masks, and
// no offset's mask is a shift of another's. Kept values are scaled by rescale =
// 1 / (1 - p), computed in double and rounded to float32 once.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/device.h"
#include "common/fast_takes.h"
#include "pyfa.h"

// One Philox4x32-10 block (Salmon et al., SC'11): ctr, four 32-bit words, is replaced by
// the generator's output under the key (k0, k1).
PYFA_HD void philox4x32_10(uint32_t k0, uint32_t k1, uint32_t ctr[4]) {
    constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;  // the round multipliers
    constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;  // the Weyl key increments
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += W0;
            k1 += W1;
        }
        const uint64_t p0 = static_cast<uint64_t>(M0) * ctr[0];
        const uint64_t p1 = static_cast<uint64_t>(M1) * ctr[2];
        const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
        const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
        const uint32_t c1 = ctr[1], c3 = ctr[3];
        ctr[0] = hi1 ^ c1 ^ k0;
        ctr[1] = lo1;
        ctr[2] = hi0 ^ c3 ^ k1;
        ctr[3] = lo0;
    }
}

// The dropout of one call, resolved once on the host (make). Off when threshold is 0.
struct Dropout {
    uint32_t k0, k1;     // the call's Philox key, from (seed, offset)
    uint32_t threshold;  // a word below it drops the element: ceil(p * 2^32), 0 when off
    float rescale;       // 1 / (1 - p) as float32: the factor of every kept element
    int64_t b0, h0, i0, j0;  // dropout_origin: added to every (b, h, i, j) drawn

    static Dropout make(float p, uint64_t seed, uint64_t offset, const int64_t origin[4]) {
        Dropout d{0u, 0u, 0u, 1.0f, origin[0], origin[1], origin[2], origin[3]};
        if (!(p > 0.0f)) return d;
        uint32_t ctr[4] = {static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32), 0u, 0u};
        philox4x32_10(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), ctr);
        d.k0 = ctr[0];
        d.k1 = ctr[1];
        // p * 2^32 is exact in double, and below 2^32 - 255 for a float32 p < 1.
        d.threshold = static_cast<uint32_t>(std::ceil(static_cast<double>(p) * 4294967296.0));
        d.rescale = static_cast<float>(1.0 / (1.0 - static_cast<double>(p)));
        return d;
    }

    PYFA_HD bool on() const { return threshold != 0u; }

    // The four words of keys 4q .. 4q+3 of row i, batch b, query head h, all of the larger
    // problem (the origin already added).
    PYFA_HD void words(int64_t b, int64_t h, int64_t i, int64_t q, uint32_t w[4]) const {
        w[0] = static_cast<uint32_t>(q);
        w[1] = static_cast<uint32_t>(i);
        w[2] = static_cast<uint32_t>(h);
        w[3] = static_cast<uint32_t>(b);
        philox4x32_10(k0, k1, w);
    }

    // Word j % 4 of a block, selected without indexing (an indexed register array would
    // live in local memory on a GPU).
    PYFA_HD static uint32_t word(const uint32_t w[4], int64_t j) {
        const int n = static_cast<int>(j & 3);
        return n == 0 ? w[0] : n == 1 ? w[1] : n == 2 ? w[2] : w[3];
    }

    // Z[b, h, i, j]: whether the call's element is kept.
    PYFA_HD bool keep(int64_t b, int64_t h, int64_t i, int64_t j) const {
        uint32_t w[4];
        j += j0;
        words(b + b0, h + h0, i + i0, j >> 2, w);
        return word(w, j) >= threshold;
    }

    // x * Z / (1 - p) of a decision Z already drawn: 0 where dropped, x * rescale where
    // kept, x itself when off.
    PYFA_HD float apply_kept(float x, bool kept) const {
        if (!on()) return x;
        return kept ? x * rescale : 0.0f;
    }

    PYFA_HD float apply(float x, int64_t b, int64_t h, int64_t i, int64_t j) const {
        return on() ? apply_kept(x, keep(b, h, i, j)) : x;
    }

    // The fast backward kernels whose warps split into roles pass a drawn decision from
    // the thread that draws it to the one that forms dS in the sign of P (>= +0 or NaN):
    // -P for a dropped element.
    PYFA_HD static float flag(float P, bool kept) { return kept ? P : -P; }
    PYFA_HD static bool flagged_kept(float v) { return !std::signbit(v); }

    // apply() in place on keys first .. first+n-1 of row i, key first + c at x[c * stride]:
    // one Philox block per four keys (the words keep() reads, so the same bits).
    PYFA_HD void apply_row(float* x, int64_t n, int64_t b, int64_t h, int64_t i, int64_t first,
                           int64_t stride = 1) const {
        if (!on()) return;
        uint32_t w[4];
        for (int64_t c = 0; c < n; ++c) {
            const int64_t j = j0 + first + c;
            if (c == 0 || (j & 3) == 0) words(b + b0, h + h0, i + i0, j >> 2, w);
            x[c * stride] = apply_kept(x[c * stride], word(w, j) >= threshold);
        }
    }
};
