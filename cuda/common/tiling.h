// tiling.h: tile counts and the causal mask, shared by every kernel (sim/tiling.py twin).
//
// The causal mask is bottom-right aligned: key column c is visible to query row r iff
// c <= r + (Nk - Nq). With Nq == Nk that is the usual c <= r; with Nq < Nk the queries
// are the last Nq positions of the sequence; with Nq > Nk the first rows see no key.
#pragma once

#include "common/device.h"

PYFA_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
PYFA_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
PYFA_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

PYFA_HD bool causal_masked(int64_t row, int64_t col, int64_t Nq, int64_t Nk) {
    return col > row + (Nk - Nq);
}

// K/V tiles j in [0, end) hold a key visible to some row of the Q tile [row0, row0 + br);
// tiles from `end` on are fully masked and skipped. Without causal every tile is visited.
PYFA_HD int64_t kv_tile_end(int causal, int64_t row0, int64_t br, int64_t Nq, int64_t Nk,
                            int64_t Bc) {
    const int64_t Tc = ceil_div(Nk, Bc);
    if (!causal) return Tc;
    const int64_t last_visible = row0 + br - 1 + (Nk - Nq);  // last key of the last row
    if (last_visible < 0) return 0;
    return min64(Tc, last_visible / Bc + 1);
}

// Q tiles i in [begin, Tr) hold a row that sees some key of the K/V tile starting at
// col0; earlier Q tiles are fully masked for it. Without causal every tile is visited.
PYFA_HD int64_t q_tile_begin(int causal, int64_t col0, int64_t Nq, int64_t Nk, int64_t Br) {
    const int64_t Tr = ceil_div(Nq, Br);
    if (!causal) return 0;
    const int64_t first_row = max64(0, col0 - (Nk - Nq));  // first row that sees key col0
    if (first_row >= Nq) return Tr;
    return first_row / Br;
}
