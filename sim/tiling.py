"""Tile counts and the causal mask: the twin of cuda/common/tiling.h.

The causal mask is bottom-right aligned: key column c is visible to query row r iff
c <= r + (Nk - Nq).
"""


def ceil_div(a, b):
    return (a + b - 1) // b


def causal_masked(row, col, Nq, Nk):
    """True where key `col` is hidden from query `row` (works on NumPy arrays too)."""
    return col > row + (Nk - Nq)


def kv_tile_end(causal, row0, br, Nq, Nk, Bc):
    """K/V tiles j in [0, end) hold a key visible to some row of the Q tile
    [row0, row0 + br); later tiles are fully masked and skipped."""
    Tc = ceil_div(Nk, Bc)
    if not causal:
        return Tc
    last_visible = row0 + br - 1 + (Nk - Nq)
    if last_visible < 0:
        return 0
    return min(Tc, last_visible // Bc + 1)


def q_tile_begin(causal, col0, Nq, Nk, Br):
    """Q tiles i in [begin, Tr) hold a row that sees some key of the K/V tile at col0."""
    Tr = ceil_div(Nq, Br)
    if not causal:
        return 0
    first_row = max(0, col0 - (Nk - Nq))
    if first_row >= Nq:
        return Tr
    return first_row // Br
