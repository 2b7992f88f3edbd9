"""Float64 references and input makers shared by the tests."""

import numpy as np


def make_inputs(shape_q, shape_k, seed, *extra_like_q):
    """q, k, v (and any extra tensors shaped like q, e.g. dO) of float32 normals."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q, dtype=np.float32)
    k = rng.standard_normal(shape_k, dtype=np.float32)
    v = rng.standard_normal(shape_k, dtype=np.float32)
    extra = [rng.standard_normal(shape_q, dtype=np.float32) for _ in extra_like_q]
    return (q, k, v, *extra)


def causal_mask(Nq, Nk):
    """True where key j is hidden from query i: j > i + (Nk - Nq)."""
    return np.arange(Nk)[None, :] > np.arange(Nq)[:, None] + (Nk - Nq)


def attention_ref(q, k, v, causal=False, scale=None):
    """(O, LSE) in float64; rows with no visible key get O = 0, LSE = -inf."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = np.einsum("...qd,...kd->...qk", q, k) * scale
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    o = np.where(l > 0, (p @ v) / np.where(l > 0, l, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), -np.inf)
    return o, lse


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


def attention_grad_ref(q, k, v, do, causal=False, scale=None):
    """(O, dQ, dK, dV) in float64: the gradients of loss = sum(O * dO) for
    O = softmax(scale * Q K^T [causal]) V. A row with no visible key has O = 0 and
    contributes nothing, so its dQ is 0."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = np.einsum("...qd,...kd->...qk", q, k) * scale
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isinf(m), 0.0, m))
    l = p.sum(axis=-1, keepdims=True)
    p = p / np.where(l > 0, l, 1.0)
    o = p @ v
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = ds @ k * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    return o, dq, dk, dv
