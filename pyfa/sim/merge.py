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
from ..errors import ArgumentTypeError, InvalidArgumentError

F32 = np.float32
NEG_INF = np.float32(-np.inf)


def _stack(name, parts):
    try:
        x = np.asarray(parts if not isinstance(parts, (list, tuple)) else [np.asarray(p) for p in parts])
    except ValueError as e:
        raise InvalidArgumentError(f"{name}: the parts must all have one shape ({e})") from None
    if x.dtype != np.float32:
        raise ArgumentTypeError(f"{name}: expected float32, got {x.dtype}")
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
        w_a, w_c = nx.exp(np.stack([acc_lse - m, lse_c - m]))  # one call: elementwise, the same bits
        w = w_a + w_c
        o_fold = (w_a[..., None] * acc_o + w_c[..., None] * o_c) / w[..., None]
        lse_fold = m + nx.log(w)
        acc_o = np.where(take[..., None], o_c, np.where(fold[..., None], o_fold, acc_o)).astype(F32)
        acc_lse = np.where(take, lse_c, np.where(fold, lse_fold, acc_lse)).astype(F32)
    return nx.canonical_nan(acc_o), nx.canonical_nan(acc_lse)


# ---- attention sinks (gpt-oss's learned sinks): a logit s_h per query head that joins
# every row's softmax and carries no value, P_ij = exp(S_ij - LSE'_i) with
# LSE'_i = log(exp(s_h) + sum_j exp(S_ij)). The sink is the state (O = 0, LSE = s_h) of an
# empty key set, so attention with a sink is the attention's state merged with it, part 1
# after part 0 by merge_states; and the kernels' backward, given that merged (O', LSE'),
# is already the gradient of q, k, v (P' = exp(S - LSE'), D = dO . O'), the sink adding
# no dP. What is left is the sinks' own gradient, sinks_grad.

def _sink_views(o, lse, sinks, layout):
    """(o as (B, H, Nq, d), lse (B, H, Nq), sinks (H,)) checked; o in `layout`."""
    o, lse, sinks = (np.asarray(x) for x in (o, lse, sinks))
    for name, x in (("o", o), ("lse", lse), ("sinks", sinks)):
        if x.dtype != np.float32:
            raise ArgumentTypeError(f"{name}: expected float32, got {x.dtype}")
    if layout not in ("bhnd", "bnhd"):
        raise InvalidArgumentError(f"layout: expected 'bhnd' or 'bnhd', got {layout!r}")
    if o.ndim != 4:
        raise InvalidArgumentError(f"o: expected 4 dimensions, got shape {o.shape}")
    o4 = o if layout == "bhnd" else o.transpose(0, 2, 1, 3)
    if lse.shape != o4.shape[:3]:
        raise InvalidArgumentError(f"lse: expected shape {o4.shape[:3]} (B, H, Nq), got {lse.shape}")
    check_sinks(sinks, o4.shape[1])
    return o4, lse, sinks


def checked_sinks(sinks, heads):
    """The sinks keyword of a simulated FA2 forward: None, or as a float32 NumPy (heads,)
    array checked by check_sinks."""
    if sinks is None:
        return None
    s = np.asarray(sinks)
    if s.dtype != np.float32:
        raise ArgumentTypeError(f"sinks: expected a float32 array (H,), got {s.dtype}")
    check_sinks(s, heads)
    return s


def check_sinks(sinks, heads):
    """The values merge_sinks takes for `heads` query heads: shape (heads,), each finite or
    -inf (no sink); InvalidArgumentError otherwise."""
    if sinks.shape != (heads,):
        raise InvalidArgumentError(f"sinks: expected shape ({heads},), one per query head, got {sinks.shape}")
    if np.isnan(sinks).any() or (sinks == np.inf).any():
        raise InvalidArgumentError("sinks: must be finite or -inf (no sink)")


@nx.ieee_arithmetic
def merge_sinks(o, lse, sinks, layout="bhnd"):
    """(o', lse'): the state (o, lse) of attention (pyfa.fa2_forward's) merged with each
    query head's sink, the state (O = 0, LSE = sinks[h]), by merge_states (part 0 the
    attention, part 1 the sink): attention whose softmax also counts a logit sinks[h]
    that has no value (gpt-oss; a row that sees no key gets O = 0, LSE = sinks[h]).
    o: (B, H, Nq, d) in "bhnd", (B, Nq, H, d) in "bnhd"; lse: (B, H, Nq); sinks: (H,)
    float32, -inf for a head without one. Returns o' in o's layout and lse'."""
    o4, lse, sinks = _sink_views(o, lse, sinks, layout)
    s = np.broadcast_to(sinks[None, :, None], lse.shape)
    out, lse_out = merge_states([o4, np.zeros_like(o4)], [lse, s])
    return (out if layout == "bhnd" else out.transpose(0, 2, 1, 3)), lse_out


@nx.ieee_arithmetic
def sinks_grad(o, lse, do, sinks, dlse=None, layout="bhnd"):
    """The gradient of the sinks (H,) from merge_sinks' (o', lse') and the incoming
    gradients do (like o') and dlse (like lse', or None): with the sink's probability
    p = exp(sinks[h] - lse'[b, h, i]) (0 where lse' is -inf: no key and no sink) and
    D = pyfa_dot(dO_i, O'_i) (the backward's D, x in order, one fma a step),
        dsinks[h] = sum over b, then i, in order from +0 of p * (dlse - D)
    (dlse = 0 when None), each step one add after one multiply: a sum whose order is
    written, the same bits wherever o', lse' and do have them."""
    o4, lse, sinks = _sink_views(o, lse, sinks, layout)
    do = np.asarray(do)
    if do.dtype != np.float32:
        raise ArgumentTypeError(f"do: expected float32, got {do.dtype}")
    if do.shape != o.shape:
        raise InvalidArgumentError(f"do: expected o's shape {np.shape(o)}, got {do.shape}")
    do4 = do if layout == "bhnd" else do.transpose(0, 2, 1, 3)
    g = np.zeros(lse.shape, F32)
    if dlse is not None:
        g = np.asarray(dlse)
        if g.dtype != np.float32:
            raise ArgumentTypeError(f"dlse: expected float32, got {g.dtype}")
        if g.shape != lse.shape:
            raise InvalidArgumentError(f"dlse: expected lse's shape {lse.shape}, got {g.shape}")
    B, H, Nq = lse.shape
    D = nx.canonical_nan(nx.dot(do4, o4))
    # A row whose merged LSE is -inf saw no key and has no sink (sinks[h] = -inf): the
    # sink's probability there is 0, not exp(-inf - -inf) = NaN.
    p = np.where(lse == NEG_INF, F32(0), nx.exp(sinks[None, :, None] - lse)).astype(F32)
    terms = (p * (g - D)).transpose(1, 0, 2).reshape(H, B * Nq)  # per head, b then i
    # np.add.accumulate adds in order, one element after the other: the written sum.
    steps = np.concatenate([np.zeros((H, 1), F32), terms], axis=1)
    return nx.canonical_nan(np.add.accumulate(steps, axis=1)[:, -1].astype(F32))
