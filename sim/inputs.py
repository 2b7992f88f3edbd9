"""Argument checks shared by the simulator and pyfa's API, so both reject bad input the
same way, with errors that name the argument."""

import math
import numbers

import numpy as np

MAX_HEAD_DIM = 256


def as_tensor(name, x, rank=None):
    """x as a C-contiguous float32 array; float32 only, any strides."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name}: expected dtype float32, got {x.dtype}")
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: expected shape (B, H, N, d), (H, N, d) or (N, d), got {x.shape}")
    if rank is not None and x.ndim != rank:
        raise ValueError(f"{name}: expected {rank} dimensions like q, got shape {x.shape}")
    return np.ascontiguousarray(x)


def as_4d(x):
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def check_qkv(q, k, v):
    """Returns q, k, v as contiguous 4-D float32 arrays and the rank the caller used."""
    q = as_tensor("q", q)
    k = as_tensor("k", k, q.ndim)
    v = as_tensor("v", v, q.ndim)
    rank = q.ndim
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    B, H, Nq, d = q4.shape
    if k4.shape[:2] != (B, H):
        raise ValueError(f"k: batch and heads {k.shape[:-2]} differ from q's {q.shape[:-2]}")
    if k4.shape[3] != d:
        raise ValueError(f"k: head dim {k4.shape[3]} differs from q's {d}")
    if v4.shape != k4.shape:
        raise ValueError(f"v: shape {v.shape} differs from k's {k.shape}")
    if min(q4.shape) < 1 or k4.shape[2] < 1:
        raise ValueError(f"q, k: every dimension must be >= 1, got q {q.shape}, k {k.shape}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    return q4, k4, v4, rank


def check_like(name, x, like):
    """x must be float32 with exactly the shape of `like` (4-D view returned)."""
    x = as_tensor(name, x)
    if x.size != like.size or as_4d(x).shape != like.shape:
        raise ValueError(f"{name}: expected shape matching {like.shape}, got {x.shape}")
    return as_4d(x)


def check_rows(name, x, q4):
    """Per-row statistics (LSE, m, l): float32 shaped like q without d, i.e. (B, H, Nq),
    (H, Nq) or (Nq,); returned as a contiguous (B, H, Nq) array."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name}: expected dtype float32, got {x.dtype}")
    rows = q4.shape[:3]
    if not 1 <= x.ndim <= 3 or (1,) * (3 - x.ndim) + x.shape != rows:
        raise ValueError(f"{name}: expected one value per query row, shape {rows} "
                         f"(or without its leading 1s), got {x.shape}")
    return np.ascontiguousarray(x).reshape(rows)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def resolve_scale(scale, d):
    """scale, or the default 1/sqrt(d), as float32 (the same rounding as the library)."""
    if scale is None:
        return np.float32(1.0) / np.sqrt(np.float32(d))
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    try:
        x = float(scale)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"scale: {scale} is not representable as a finite nonzero float32") from None
    if not math.isfinite(x) or x == 0:
        raise ValueError(f"scale: must be finite and nonzero, got {scale}")
    # Checked before the cast, which would round it to inf with a NumPy warning.
    if abs(x) > FLOAT32_MAX:
        raise ValueError(f"scale: {scale} is not representable as a finite nonzero float32")
    s = np.float32(x)
    if s == 0:
        raise ValueError(f"scale: {scale} is not representable as a finite nonzero float32")
    return s


def check_causal(causal):
    """causal as a bool: True, False, a NumPy bool, or the ints 0 and 1; anything else
    ("False", None, 0.5, [0], an array) is a TypeError rather than its truth value."""
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    if isinstance(causal, numbers.Integral) and causal in (0, 1):
        return bool(causal)
    raise TypeError(f"causal: expected a bool, got {causal!r}")


def check_int(name, value, lo, hi):
    """An int in [lo, hi] (NumPy integers too, never a bool or a float), as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: must be in [{lo}, {hi}], got {value}")
    return int(value)


MAX_TILE = 1 << 20


def check_tile(name, value):
    """A tile size given by the caller: None (the default) or an int in [1, MAX_TILE];
    whether the tiles fit in shared memory is sim.tiles.check_fit's question."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= 1 or None, got {type(value).__name__}")
    if value < 1 or value > MAX_TILE:
        raise ValueError(f"{name}: must be in [1, {MAX_TILE}], got {value}")
    return int(value)


def restore_rank(x, rank):
    """Drops the leading unit axes as_4d added to a tensor of the caller's rank."""
    drop = 4 - rank
    return x.reshape(x.shape[drop:])


def check_count_args(passes, **sizes):
    """The problem of an IO count: passes, and sizes that are ints >= 1 (head_dim <= 256)."""
    if not isinstance(passes, str) or passes not in ("forward", "backward", "both"):
        raise ValueError(f"passes: expected 'forward', 'backward' or 'both', got {passes!r}")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if sizes.get("head_dim", 1) > MAX_HEAD_DIM:
        raise ValueError(f"head_dim: must be in [1, {MAX_HEAD_DIM}], got {sizes['head_dim']}")
