// mask.h: the attention mask as one value (pyfa/sim/mask.py is its twin; the formula is
// written in these two files only).
//
// Key column j is visible to query row i iff  i + off - left <= j <= i + off + right,
// with off = Nk - Nq (bottom-right alignment, flash-attn's) or 0 (top-left, PyTorch's
// is_causal), plus the call's shift (pyfa.h's diagonal_offset: the call as a block of a
// larger problem). Causal is right = 0; a sliding window bounds both sides. The sides are
// resolved once on the host (make_mask) into finite values: an unbounded side becomes
// Nq + Nk + |shift|, which already reaches every key from every row, so nothing below
// overflows.
#pragma once

#include "common/device.h"

// Tiles t in [begin, end), visited in increasing order; empty when begin == end.
struct TileRange {
    int64_t begin, end;
};

// The mask seen from one tile: rows row0 + r, keys col0 + c (r, c local). Key c is
// visible to row r iff lo <= c - r <= hi. Every test of a score's visibility, in every
// kernel and the cpu backend, goes through this (or Mask::masked, which is its (0, 0)).
struct Band {
    int64_t lo, hi;

    // The visibility test itself, on dc = c - r against the band's edges, in any integer
    // type: a scalar here, a GCC vector of lanes in the cpu backend (whose edges are the
    // band's, clamped to its lanes' range), so that the formula is written once.
    template <class T, class E>
    PYFA_LANES PYFA_HD static T visible_diff(T dc, E lo_edge, E hi_edge) {
        return (dc >= lo_edge) & (dc <= hi_edge);
    }

    PYFA_HD bool visible(int64_t r, int64_t c) const { return visible_diff<int64_t>(c - r, lo, hi) != 0; }

    // The visible keys [begin, end) of row r among c = 0 .. bc-1 (empty: begin == end).
    PYFA_HD TileRange cols(int64_t r, int64_t bc) const {
        const int64_t a = r + lo > 0 ? r + lo : 0;
        const int64_t z = r + hi + 1 < bc ? r + hi + 1 : bc;
        return z > a ? TileRange{a, z} : TileRange{0, 0};
    }

    // The rows [begin, end) among r = 0 .. br-1 that see key c.
    PYFA_HD TileRange rows(int64_t c, int64_t br) const {
        const int64_t a = c - hi > 0 ? c - hi : 0;
        const int64_t z = c - lo + 1 < br ? c - lo + 1 : br;
        return z > a ? TileRange{a, z} : TileRange{0, 0};
    }

    // Some score of the br x bc tile is hidden (the tile is cut by the mask).
    PYFA_HD bool cuts(int64_t br, int64_t bc) const { return bc - 1 > hi || 1 - br < lo; }
};

struct Mask {
    int64_t left;   // keys visible left of the diagonal, in [0, Nq + Nk + |shift|]
    int64_t right;  // keys visible right of the diagonal, in [0, Nq + Nk + |shift|]
    int64_t off;    // the diagonal of row i is key i + off
    int64_t shift;  // the part of off that the alignment does not give (diagonal_offset)

    // The band of the tile whose first row is row0 and first key col0.
    PYFA_HD Band band(int64_t row0, int64_t col0) const {
        return Band{row0 + off - left - col0, row0 + off + right - col0};
    }

    PYFA_HD bool masked(int64_t row, int64_t col) const { return !band(row, col).visible(0, 0); }

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

    // The same mask for a sequence of Nq queries and Nk keys (a packed batch's): off is
    // its own (its alignment's, plus the call's shift). left and right stay those
    // resolved for the longest lengths, which reach every key of a shorter sequence too,
    // so each row sees the keys its sequence's dense call shows it.
    PYFA_HD Mask for_lengths(int align, int64_t Nq, int64_t Nk) const {
        return Mask{left, right, (align == 1 ? 0 : Nk - Nq) + shift, shift};
    }
};

// align: a pyfa_causal_align (0 bottom-right, 1 top-left); shift: diagonal_offset. The arguments are checked by
// the caller (src/core/api.cpp); a negative side, or no window, is unbounded.
inline Mask make_mask(int causal, int window, int64_t left, int64_t right, int align,
                      int64_t Nq, int64_t Nk, int64_t shift) {
    const int64_t unbounded = Nq + Nk + (shift < 0 ? -shift : shift);
    Mask mask = Mask{0, 0, 0, shift}.for_lengths(align, Nq, Nk);  // the off of these lengths
    mask.left = (window && left >= 0 && left < unbounded) ? left : unbounded;
    mask.right = (window && right >= 0 && right < unbounded) ? right : unbounded;
    if (causal) mask.right = 0;
    return mask;
}
