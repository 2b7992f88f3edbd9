// mask.h: the attention mask as one value (pyfa/sim/mask.py is its twin; the formula is
// written in these two files only).
//
// Key column j is visible to query row i iff  i + off - left <= j <= i + off + right,
// with off = Nk - Nq (bottom-right alignment, flash-attn's) or 0 (top-left, PyTorch's
// is_causal). Causal is right = 0; a sliding window bounds both sides. The sides are
// resolved once on the host (make_mask) into finite values: an unbounded side becomes
// Nq + Nk, which already reaches every key from every row, so nothing below overflows.
#pragma once

#include "common/device.h"

// Tiles t in [begin, end), visited in increasing order; empty when begin == end.
struct TileRange {
    int64_t begin, end;
};

struct Mask {
    int64_t left;   // keys visible left of the diagonal, in [0, Nq + Nk]
    int64_t right;  // keys visible right of the diagonal, in [0, Nq + Nk]
    int64_t off;    // the diagonal of row i is key i + off

    PYFA_HD bool masked(int64_t row, int64_t col) const {
        return col < row + off - left || col > row + off + right;
    }

    // The K/V tiles (Bc keys each) holding a key visible to some row of
    // [row0, row0 + br): a band, since both edges of the visible range grow with the row.
    PYFA_HD TileRange kv_tiles(int64_t row0, int64_t br, int64_t Bc, int64_t Nk) const {
        const int64_t lo_raw = row0 + off - left;
        const int64_t lo = lo_raw > 0 ? lo_raw : 0;
        const int64_t hi_raw = row0 + br - 1 + off + right;
        const int64_t hi = hi_raw < Nk - 1 ? hi_raw : Nk - 1;
        if (hi < lo) return TileRange{0, 0};
        return TileRange{lo / Bc, hi / Bc + 1};
    }

    // The Q tiles (Br rows each) holding a row that sees some key of [col0, col0 + bc).
    PYFA_HD TileRange q_tiles(int64_t col0, int64_t bc, int64_t Br, int64_t Nq) const {
        const int64_t lo_raw = col0 - off - right;
        const int64_t lo = lo_raw > 0 ? lo_raw : 0;
        const int64_t hi_raw = col0 + bc - 1 - off + left;
        const int64_t hi = hi_raw < Nq - 1 ? hi_raw : Nq - 1;
        if (hi < lo) return TileRange{0, 0};
        return TileRange{lo / Br, hi / Br + 1};
    }
};

// align: a pyfa_causal_align (0 bottom-right, 1 top-left). The arguments are checked by
// the caller (src/core/api.cpp); a negative side, or no window, is unbounded.
inline Mask make_mask(int causal, int window, int64_t left, int64_t right, int align,
                      int64_t Nq, int64_t Nk) {
    const int64_t unbounded = Nq + Nk;
    Mask mask;
    mask.off = align == 1 ? 0 : Nk - Nq;
    mask.left = (window && left >= 0 && left < unbounded) ? left : unbounded;
    mask.right = (window && right >= 0 && right < unbounded) ? right : unbounded;
    if (causal) mask.right = 0;
    return mask;
}
