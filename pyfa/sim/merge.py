"""Merging partial attention states (O, LSE) of the same rows: the twin of
src/common/merge.h (merge_state_element), bit for bit; the order is written there and in
docs/numerics.md ("Merging states").

Parts are folded in ascending order into an accumulator that starts empty (LSE = -inf):
a part with LSE = -inf is skipped, the first other part is taken as it is, and each
later one is folded with m = max(LSE_acc, LSE_c), w_a = exp(LSE_acc - m),
w_c = exp(LSE_c - m), w = w_a + w_c, O = (w_a * O_acc + w_c * O_c) / w, LSE = m + log(w).
"""

import numpy as np

from . import numerics as nx
from ..errors import InvalidArgumentError

F32 = np.float32
NEG_INF = np.float32(-np.inf)


def _stack(name, parts):
    try:
        x = np.asarray(parts if not isinstance(parts, (list, tuple)) else [np.asarray(p) for p in parts])
    except ValueError as e:
        raise InvalidArgumentError(f"{name}: the parts must all have one shape ({e})") from None
    if x.dtype != np.float32:
        raise InvalidArgumentError(f"{name}: expected float32, got {x.dtype}")
    return x


@nx.ieee_arithmetic
def merge_states(o_parts, lse_parts):
    """Folds P partial states of the same rows into one, in ascending part order.

    o_parts: (P, ..., d) float32 (or a sequence of P arrays (..., d)), each part's O
    normalised by its own sum; lse_parts: (P, ...) their log-sum-exps (-inf: the part saw
    no key, and contributes nothing). Returns (o (..., d), lse (...)): the attention over
    the union of the parts' keys; a row no part saw gets O = 0, LSE = -inf. The bits are
    those of the split-KV combine step of every backend."""
    O = _stack("o_parts", o_parts)
    L = _stack("lse_parts", lse_parts)
    if O.ndim < 2:
        raise InvalidArgumentError(f"o_parts: expected shape (P, ..., d), got {O.shape}")
    if L.shape != O.shape[:-1]:
        raise InvalidArgumentError(f"lse_parts: expected shape {O.shape[:-1]} (o_parts' without d), "
                                   f"got {L.shape}")
    if O.shape[0] == 0:
        raise InvalidArgumentError("o_parts: no parts to merge")
    acc_o = np.zeros(O.shape[1:], F32)
    acc_lse = np.full(L.shape[1:], NEG_INF, F32)
    for c in range(O.shape[0]):
        o_c, lse_c = O[c], L[c]
        skip = lse_c == NEG_INF
        take = ~skip & (acc_lse == NEG_INF)
        fold = ~skip & ~take
        m = nx.maximum(acc_lse, lse_c)
        w_a = nx.exp(acc_lse - m)
        w_c = nx.exp(lse_c - m)
        w = w_a + w_c
        o_fold = (w_a[..., None] * acc_o + w_c[..., None] * o_c) / w[..., None]
        lse_fold = m + nx.log(w)
        acc_o = np.where(take[..., None], o_c, np.where(fold[..., None], o_fold, acc_o)).astype(F32)
        acc_lse = np.where(take, lse_c, np.where(fold, lse_fold, acc_lse)).astype(F32)
    return nx.canonical_nan(acc_o), nx.canonical_nan(acc_lse)
