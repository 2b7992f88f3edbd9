"""Float64 references and input makers shared by the tests.

The references take q of shape (B, H, Nq, d), (H, Nq, d) or (Nq, d) and k, v with Hkv
heads (H % Hkv == 0; query head h reads K/V head h // (H // Hkv)), in layout "bhnd", or
"bnhd" for (B, N, H, d). The mask is pyfa.sim.mask.Mask's (the one place, besides its C
twin, where its formula is written; tests/test_sim_masks.py checks it against NumPy's
triangles).
"""

import numpy as np

from pyfa.sim.mask import Mask


def make_inputs(shape_q, shape_k, seed, *extra_like_q):
    """q, k, v (and any extra tensors shaped like q, e.g. dO) of float32 normals."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q, dtype=np.float32)
    k = rng.standard_normal(shape_k, dtype=np.float32)
    v = rng.standard_normal(shape_k, dtype=np.float32)
    extra = [rng.standard_normal(shape_q, dtype=np.float32) for _ in extra_like_q]
    return (q, k, v, *extra)


def mask_matrix(Nq, Nk, causal=False, window=None, causal_align="bottom_right"):
    """(Nq, Nk) bool, True where key j is hidden from query i."""
    mask = Mask.resolve(causal, window, causal_align, Nq, Nk)
    return mask.masked(np.arange(Nq)[:, None], np.arange(Nk)[None, :])


def causal_mask(Nq, Nk):
    """The causal mask, bottom-right aligned: key j hidden from query i iff j > i + Nk - Nq."""
    return mask_matrix(Nq, Nk, causal=True)


def _bhnd64(q, k, v, *rest, layout="bhnd"):
    """float64 copies in (..., H, N, d) order, K and V repeated out to q's heads."""
    swap = (lambda x: np.swapaxes(x, -3, -2)) if layout == "bnhd" and q.ndim > 2 else (lambda x: x)
    q, k, v, *rest = (swap(x).astype(np.float64) for x in (q, k, v, *rest))
    if q.ndim > 2 and k.shape[-3] != q.shape[-3]:
        G = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3)
    return (q, k, v, *rest), swap


def _probabilities(q, k, scale, mask):
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = np.einsum("...qd,...kd->...qk", q, k) * scale
    s = np.where(mask_matrix(q.shape[-2], k.shape[-2], **mask), -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    return p, l, m_safe, scale


def attention_ref(q, k, v, causal=False, scale=None, *, window=None, causal_align="bottom_right",
                  layout="bhnd"):
    """(O, LSE) in float64, O in q's layout, LSE (B, H, Nq) (less q's missing leading
    axes); rows with no visible key get O = 0, LSE = -inf."""
    (q, k, v), swap = _bhnd64(q, k, v, layout=layout)
    p, l, m_safe, _ = _probabilities(q, k, scale, dict(causal=causal, window=window,
                                                       causal_align=causal_align))
    o = np.where(l > 0, (p @ v) / np.where(l > 0, l, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), -np.inf)
    return swap(o), lse


def row_stats_ref(q, k, causal=False, scale=None, *, window=None, causal_align="bottom_right",
                  layout="bhnd"):
    """float64 FA1 row statistics, (B, H, Nq) each: m (the row max of the scaled scores,
    -inf for a row with no visible key) and l = sum exp(s - m) (0 for such a row)."""
    (q, k, _), _ = _bhnd64(q, k, k, layout=layout)
    _, l, m_safe, _ = _probabilities(q, k, scale, dict(causal=causal, window=window,
                                                       causal_align=causal_align))
    return np.where(l[..., 0] > 0, m_safe[..., 0], -np.inf), l[..., 0]


def rel_err(x, ref):
    """max |x - ref| / max |ref| (0 when both are all zero)."""
    scale = np.abs(ref).max()
    diff = np.abs(x.astype(np.float64) - ref).max()
    return diff / scale if scale > 0 else diff


def same_bits(a, b):
    """Bitwise equality of float32 arrays, NaNs equal whatever their payload."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(nan | (a.view(np.uint32) == b.view(np.uint32))))


def attention_grad_ref(q, k, v, do, causal=False, scale=None, *, window=None,
                       causal_align="bottom_right", layout="bhnd"):
    """(O, dQ, dK, dV) in float64, each in its tensor's layout and shape (dK, dV with k's
    Hkv heads, each the sum over its group's query heads): the gradients of
    loss = sum(O * dO) for O = softmax(scale * Q K^T [masked]) V. A row with no visible
    key has O = 0 and contributes nothing, so its dQ is 0."""
    Hkv = k.shape[-3] if k.ndim > 2 and layout == "bhnd" else k.shape[-2] if k.ndim > 2 else 1
    (q, k, v, do), swap = _bhnd64(q, k, v, do, layout=layout)
    p, l, _, scale = _probabilities(q, k, scale, dict(causal=causal, window=window,
                                                      causal_align=causal_align))
    p = p / np.where(l > 0, l, 1.0)
    o = p @ v
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = ds @ k * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    if q.ndim > 2 and Hkv != q.shape[-3]:  # sum each group's query heads
        group = lambda x: x.reshape(x.shape[:-3] + (Hkv, -1) + x.shape[-2:]).sum(axis=-3)
        dk, dv = group(dk), group(dv)
    return swap(o), swap(dq), swap(dk), swap(dv)
