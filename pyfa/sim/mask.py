"""The attention mask as a value: the twin of src/common/mask.h, and the one place in
Python where the mask formula is written (tests, tools and the simulator use it).

Key j is visible to query row i iff  i + off - left <= j <= i + off + right,  where
off = Nk - Nq for causal_align "bottom_right" (flash-attn's) or 0 for "top_left"
(PyTorch's is_causal), and (left, right) is the window, causal forcing right = 0. An
unbounded side (None), or one wider than any distance between a row and a key, is held
as Nq + Nk, so every bound is a finite int and the arithmetic of the C twin never
overflows.
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..checks import ALIGNMENTS, check_causal_align, check_window, mask_bounds  # noqa: F401


class TileRange(NamedTuple):
    """Tiles [begin, end), visited in increasing order; begin == end when empty."""
    begin: int
    end: int


EMPTY = TileRange(0, 0)


@dataclass(frozen=True)
class Mask:
    left: int   # keys visible left of the diagonal, finite (<= Nq + Nk)
    right: int  # keys visible right of the diagonal, finite (<= Nq + Nk)
    off: int    # the diagonal: row i's own key is i + off

    @classmethod
    def resolve(cls, causal, window, causal_align, Nq, Nk, diagonal_offset=0):
        """The mask of the Python-level arguments, checked (TypeError, ValueError naming
        causal, window or causal_align), for Nq query rows and Nk keys, its diagonal moved
        by diagonal_offset (a ScoreMods field, checked there)."""
        return cls(*mask_bounds(causal, window, causal_align, Nq, Nk, diagonal_offset))

    @classmethod
    def none(cls, Nq, Nk):
        """Every key visible to every row."""
        return cls(Nq + Nk, Nq + Nk, Nk - Nq)

    def masked(self, rows, cols):
        """True where key `cols` is hidden from query `rows` (NumPy arrays broadcast)."""
        rows = np.asarray(rows, np.int64)
        cols = np.asarray(cols, np.int64)
        return (cols < rows + (self.off - self.left)) | (cols > rows + (self.off + self.right))

    def visible(self, rows, cols):
        return ~self.masked(rows, cols)

    def kv_tiles(self, row0, br, Bc, Nk):
        """The K/V tiles (of Bc keys) holding a key visible to some row of
        [row0, row0 + br)."""
        lo = max(0, row0 + self.off - self.left)
        hi = min(Nk - 1, row0 + br - 1 + self.off + self.right)
        if hi < lo:
            return EMPTY
        return TileRange(lo // Bc, hi // Bc + 1)

    def q_tiles(self, col0, bc, Br, Nq):
        """The Q tiles (of Br rows) holding a row that sees some key of
        [col0, col0 + bc)."""
        lo = max(0, col0 - self.off - self.right)
        hi = min(Nq - 1, col0 + bc - 1 - self.off + self.left)
        if hi < lo:
            return EMPTY
        return TileRange(lo // Br, hi // Br + 1)
