"""Reproducible dropout: the NumPy twin of src/common/dropout.h (docs/numerics.md,
"Dropout"), the same 32-bit integer operations vectorized over arrays.

Z[b, h, i, j], the keep decision of element (b, h, i, j) of P, is a pure function of
(seed, offset, b, h, i, j):
    the call's key  (k0, k1) = words 0, 1 of Philox4x32-10((seed_lo, seed_hi), (offset_lo, offset_hi, 0, 0))
    the words       w[0..3]  = Philox4x32-10((k0, k1), (j // 4, i, h, b))
    the decision    Z = w[j % 4] >= threshold, threshold = ceil(p * 2^32)
and a kept element is scaled by rescale = float32(1 / (1 - p)) (computed in float64);
(b, h, i, j) are the call's own indices plus its dropout_origin.
"""

import math
from typing import NamedTuple

import numpy as np

from ..checks import check_dropout_mask

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # the round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85                       # the Weyl key increments
_MASK32 = 0xFFFFFFFF

__all__ = ["Dropout", "philox4x32_10", "dropout_mask"]


def philox4x32_10(key, ctr):
    """Philox4x32-10 (Salmon et al., SC'11) of the counters ctr = (c0, c1, c2, c3), each
    a uint32 array (broadcasting together), under key = (k0, k1), two ints < 2^32.
    Returns the four output words as uint32 arrays."""
    k0, k1 = int(key[0]), int(key[1])
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint32) for c in ctr))
    for rnd in range(10):
        if rnd > 0:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        p0 = _M0 * c0.astype(np.uint64)
        p1 = _M1 * c2.astype(np.uint64)
        hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), p0.astype(np.uint32)
        hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), p1.astype(np.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint32(k0), lo1, hi0 ^ c3 ^ np.uint32(k1), lo0
    return c0, c1, c2, c3


class Dropout(NamedTuple):
    """The dropout of one call (dropout.h's Dropout), resolved once: off when threshold
    is 0."""
    k0: int
    k1: int
    threshold: int
    rescale: np.float32
    origin: tuple = (0, 0, 0, 0)  # dropout_origin: added to every (b, h, i, j) drawn

    @classmethod
    def make(cls, p, seed, offset, origin=(0, 0, 0, 0)):
        """p a float32 in [0, 1) (checked by the caller), seed and offset ints in [0, 2^64),
        origin four ints >= 0."""
        p = np.float32(p)
        if not p > 0:
            return cls(0, 0, 0, np.float32(1.0), tuple(origin))
        w = philox4x32_10((seed & _MASK32, seed >> 32), (offset & _MASK32, offset >> 32, 0, 0))
        threshold = math.ceil(float(p) * 4294967296.0)  # exact: p * 2^32 is a float64
        return cls(int(w[0]), int(w[1]), threshold, np.float32(1.0 / (1.0 - float(p))), tuple(origin))

    def on(self):
        return self.threshold != 0

    def keep(self, b, h, i, j):
        """Z of the call's integer arrays b, h, i, j (broadcasting together), as a bool
        array."""
        b, h, i, j = (np.asarray(x, dtype=np.int64) + o for x, o in zip((b, h, i, j), self.origin))
        w = philox4x32_10((self.k0, self.k1), ((j >> 2) & _MASK32, i & _MASK32, h & _MASK32, b & _MASK32))
        n = j & 3
        word = np.where(n == 0, w[0], np.where(n == 1, w[1], np.where(n == 2, w[2], w[3])))
        return word >= np.uint32(self.threshold)

    def apply(self, x, b, h, i, j):
        """x * Z / (1 - p): 0 where dropped, x * rescale where kept, x itself when off."""
        if not self.on():
            return x
        return np.where(self.keep(b, h, i, j), x * self.rescale, np.float32(0))


def dropout_mask(batch, heads, seqlen_q, seqlen_k, *, dropout_p, seed, offset=0, dropout_origin=(0, 0, 0, 0)):
    """pyfa.dropout_mask in NumPy: the keep decisions Z as a bool array (B, H, Nq, Nk),
    the same bits as the library's."""
    (B, H, Nq, Nk), mods = check_dropout_mask("pyfa.sim.dropout_mask", batch, heads, seqlen_q, seqlen_k,
                                              dropout_p, seed, offset, dropout_origin)
    d = Dropout.make(mods.dropout_p, mods.seed or 0, mods.offset, mods.dropout_origin)
    b, h, i, j = np.ix_(np.arange(B), np.arange(H), np.arange(Nq), np.arange(Nk))
    return np.broadcast_to(d.keep(b, h, i, j), (B, H, Nq, Nk)).copy()
