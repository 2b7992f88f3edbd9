"""Argument checks shared by the simulator (pyfa.sim) and pyfa's API, so both reject bad
input the same way, with errors (pyfa.errors) that name the argument. It needs NumPy
only: pyfa's API uses it without importing the simulator, and the simulator without the
compiled library.

Tensors are taken as the caller gave them and turned into 4-D (B, H, N, d) views of the
caller's memory, never copies: layout "bhnd" is (B, H, N, d) itself, layout "bnhd"
(flash-attn's) is (B, N, H, d) seen through a transpose. A caller's tensor of rank 3
drops B, of rank 2 drops B and H (then the layouts coincide). Per-row statistics (LSE,
m, l) are (B, H, Nq) in both layouts, as in flash-attn.
"""

import dataclasses
import math
import numbers
from typing import NamedTuple

import numpy as np

from . import _arrays
from .errors import ArgumentTypeError, InvalidArgumentError

MAX_HEAD_DIM = 256
LAYOUTS = ("bhnd", "bnhd")


def check_layout(layout):
    if not isinstance(layout, str):
        raise ArgumentTypeError(f"layout: expected 'bhnd' or 'bnhd', got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout: expected 'bhnd' or 'bnhd', got {layout!r}")
    return layout


def _float32_array(name, x):
    if not isinstance(x, np.ndarray):
        raise ArgumentTypeError(f"{name}: expected a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ArgumentTypeError(f"{name}: expected dtype float32, got {x.dtype}")
    return x


def _shape_words(layout):
    return "(B, H, N, d), (H, N, d) or (N, d)" if layout == "bhnd" else \
        "(B, N, H, d), (N, H, d) or (N, d)"


def as_tensor(name, x, rank=None, layout="bhnd"):
    """x checked as a float32 tensor of rank 2, 3 or 4 (and `rank` when given); returned
    as it is, any strides."""
    _float32_array(name, x)
    if x.ndim not in (2, 3, 4):
        raise InvalidArgumentError(f"{name}: expected shape {_shape_words(layout)}, got {x.shape}")
    if rank is not None and x.ndim != rank:
        raise InvalidArgumentError(f"{name}: expected {rank} dimensions like q, got shape {x.shape}")
    return x


def as_4d(x, layout="bhnd"):
    """The caller's tensor as a (B, H, N, d) view (no copy): leading unit axes for the
    dimensions the caller left out, then the transpose of a "bnhd" tensor."""
    x4 = x[(None,) * (4 - x.ndim)]
    return x4.transpose(0, 2, 1, 3) if layout == "bnhd" and x.ndim > 2 else x4


def caller_shape(shape4, rank, layout="bhnd"):
    """The shape, in the caller's rank and layout, of a (B, H, N, d) tensor."""
    B, H, N, d = shape4
    full = (B, N, H, d) if layout == "bnhd" and rank > 2 else (B, H, N, d)
    return full[4 - rank:]


def empty_output(shape4, rank, layout="bhnd"):
    """A fresh C-contiguous float32 tensor in the caller's rank and layout, and its
    (B, H, N, d) view: what a function returns, and where it writes it."""
    out = np.empty(caller_shape(shape4, rank, layout), np.float32)
    return out, as_4d(out, layout)


def restore_rank(x4, rank, layout="bhnd"):
    """A (B, H, N, d) result as the caller's rank and layout, C-contiguous in that
    layout (a copy only for "bnhd")."""
    x = x4.transpose(0, 2, 1, 3) if layout == "bnhd" and rank > 2 else x4
    return np.ascontiguousarray(x.reshape(x.shape[4 - rank:]))


def restore_rows(x3, rank):
    """A (B, H, Nq) per-row result as the caller's rank (q's rank less d)."""
    return x3.reshape(x3.shape[4 - rank:])


class QKV(NamedTuple):
    q: np.ndarray     # (B, H, Nq, d) view of the caller's q
    k: np.ndarray     # (B, Hkv, Nk, d) view of the caller's k
    v: np.ndarray     # (B, Hkv, Nk, d) view of the caller's v
    rank: int         # the caller's rank: 4, 3 or 2
    heads_kv: int     # Hkv; H % Hkv == 0, query head h reads K/V head h // (H // Hkv)


def check_qkv(q, k, v, layout="bhnd"):
    """q, k, v checked and seen as 4-D (B, H, N, d) views without copying (any strides;
    float32 only). k and v may have Hkv heads with H % Hkv == 0 (GQA, MQA at Hkv = 1)."""
    layout = check_layout(layout)
    as_tensor("q", q, layout=layout)
    as_tensor("k", k, q.ndim, layout)
    as_tensor("v", v, q.ndim, layout)
    rank = q.ndim
    q4, k4, v4 = as_4d(q, layout), as_4d(k, layout), as_4d(v, layout)
    B, H, Nq, d = q4.shape
    _, Hkv, Nk, dk = k4.shape
    if k4.shape[0] != B:
        raise InvalidArgumentError(f"k: batch {k4.shape[0]} differs from q's {B}")
    if dk != d:
        raise InvalidArgumentError(f"k: head dim {dk} differs from q's {d}")
    if v.shape != k.shape:
        raise InvalidArgumentError(f"v: shape {v.shape} differs from k's {k.shape}")
    check_sizes(q4.shape, k4.shape, q.shape, k.shape)
    if H % Hkv != 0:
        raise InvalidArgumentError(f"k: its {Hkv} heads must divide q's {H} heads (grouped-query "
                         f"attention), got q {q.shape}, k {k.shape}")
    if d > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"q: head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    return QKV(q4, k4, v4, rank, Hkv)


def check_sizes(q4, k4, q, k):
    """B, H, Hkv and d >= 1; Nq and Nk may be 0 (an empty problem: see EMPTY_VALUES)."""
    if min(q4[0], q4[1], q4[3], k4[1]) < 1 or min(q4[2], k4[2]) < 0:
        raise InvalidArgumentError(f"q, k: every dimension but the sequence lengths must be "
                                   f">= 1, got q {q}, k {k}")


# What each output of an empty problem (Nq = 0 or Nk = 0) holds, as PyTorch's SDPA gives
# it: rows that see no key (O = 0; LSE and FA1's m -inf, l = 0) and zero gradients (no
# query, or no key, contributes). No kernel runs then; the library checks the options on a
# problem of one row (pyfa/api.py, _check_run_options).
EMPTY_VALUES = {"o": 0.0, "lse": -math.inf, "m": -math.inf, "l": 0.0,
                "dq": 0.0, "dk": 0.0, "dv": 0.0}


def is_empty(seqlen_q, seqlen_k):
    return seqlen_q == 0 or seqlen_k == 0


def check_like(name, x, like, layout="bhnd"):
    """x must be a float32 tensor that is, in `layout`, exactly the (B, H, N, d) shape of
    `like` (leading unit axes may be left out); returns its (B, H, N, d) view."""
    layout = check_layout(layout)
    as_tensor(name, x, layout=layout)
    x4 = as_4d(x, layout)
    if x4.shape != like.shape:
        want = caller_shape(like.shape, 4, layout)
        raise InvalidArgumentError(f"{name}: expected shape {want} (layout {layout!r}), got {x.shape}")
    return x4


def check_rows(name, x, q4):
    """Per-row statistics (LSE, m, l): float32 shaped like q without d in (B, H, Nq) order
    whatever the layout, i.e. (B, H, Nq), (H, Nq) or (Nq,); returned as a (B, H, Nq)
    view (no copy)."""
    _float32_array(name, x)
    rows = q4.shape[:3]
    if not 1 <= x.ndim <= 3 or (1,) * (3 - x.ndim) + x.shape != rows:
        raise InvalidArgumentError(f"{name}: expected one value per query row, shape {rows} "
                         f"(or without its leading 1s), got {x.shape}")
    return x[(None,) * (3 - x.ndim)]


def c_aligned(x, dtype=None):
    """np.ascontiguousarray(x, dtype), copied also where its first element is not aligned to
    its item size (a view into a byte buffer), which ascontiguousarray keeps as it is: the
    library takes a typed pointer."""
    x = np.ascontiguousarray(x, dtype)
    return x if x.flags.aligned else np.array(x, order="C")


def refuse_self_overlap(label, shape, strides, itemsize=4):
    """InvalidArgumentError when two elements of an array that pyfa writes (shape, byte
    strides) share memory (a stride-0 axis, an as_strided view): its elements would be
    written over each other. Axes sorted by stride, each must step past all the memory the
    smaller ones span; a layout that interleaves axes without overlapping is refused too."""
    if 0 in shape:
        return
    span = itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if stride < span:
            raise InvalidArgumentError(f"{label}: its elements overlap each other in memory (strides "
                                       f"{tuple(strides)}, shape {tuple(shape)}); pass an array whose "
                                       f"elements each have their own memory")
        span = stride * (n - 1) + span


def element_strides(x4):
    """(batch, head, row) strides in elements of a (B, H, N, d) float32 view, as the C ABI
    takes them, or None when the library cannot address it in place (the last axis not
    contiguous, a negative or misaligned stride, an unaligned pointer): copy it then.
    The stride of an axis of length 1 never matters and is given as 0."""
    item = x4.itemsize
    if not x4.flags.aligned:
        return None
    if x4.shape[3] > 1 and x4.strides[3] != item:
        return None
    out = []
    for n, s in zip(x4.shape[:3], x4.strides[:3]):
        if n == 1:
            out.append(0)
        elif s < 0 or s % item:
            return None
        else:
            out.append(s // item)
    return tuple(out)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def resolve_scale(scale, d):
    """scale, or the default 1/sqrt(d), as float32 (the same rounding as the library)."""
    if scale is None:
        return np.float32(1.0) / np.sqrt(np.float32(d))
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    try:
        x = float(scale)
    except OverflowError:  # an int beyond any float
        raise InvalidArgumentError(f"scale: {scale} is not representable as a finite nonzero float32") from None
    if not math.isfinite(x) or x == 0:
        raise InvalidArgumentError(f"scale: must be finite and nonzero, got {scale}")
    # Checked before the cast, which would round it to inf with a NumPy warning.
    if abs(x) > FLOAT32_MAX:
        raise InvalidArgumentError(f"scale: {scale} is not representable as a finite nonzero float32")
    s = np.float32(x)
    if s == 0:
        raise InvalidArgumentError(f"scale: {scale} is not representable as a finite nonzero float32")
    return s


def check_causal(causal):
    """causal as a bool: True, False, a NumPy bool, or the ints 0 and 1; anything else
    ("False", None, 0.5, [0], an array) is a TypeError rather than its truth value."""
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    if isinstance(causal, numbers.Integral) and causal in (0, 1):
        return bool(causal)
    raise ArgumentTypeError(f"causal: expected a bool, got {causal!r}")


def check_int(name, value, lo, hi):
    """An int in [lo, hi] (NumPy integers too, never a bool or a float), as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an int in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{name}: must be in [{lo}, {hi}], got {value}")
    return int(value)


MAX_TILE = 1 << 20


def check_tile(name, value):
    """A tile size given by the caller: None (the default) or an int in [1, MAX_TILE];
    whether the tiles fit in shared memory is sim.tiles.check_fit's question."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an int >= 1 or None, got {type(value).__name__}")
    if value < 1 or value > MAX_TILE:
        raise InvalidArgumentError(f"{name}: must be in [1, {MAX_TILE}], got {value}")
    return int(value)


def check_count_args(passes, **sizes):
    """The problem of an IO count: passes, and sizes that are ints >= 1 (head_dim <= 256)."""
    if not isinstance(passes, str) or passes not in ("forward", "backward", "both"):
        raise InvalidArgumentError(f"passes: expected 'forward', 'backward' or 'both', got {passes!r}")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InvalidArgumentError(f"{name}: expected an int >= 1, got {value!r}")
    if sizes.get("head_dim", 1) > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"head_dim: must be in [1, {MAX_HEAD_DIM}], got {sizes['head_dim']}")


ALIGNMENTS = ("bottom_right", "top_left")


def check_window(window):
    """window as (left, right), each an int >= 0 or None (unbounded); None is (None, None)."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentTypeError(f"window: expected None or a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise ArgumentTypeError(f"window: {name} side must be an int >= 0 or None, got {side!r}")
        if side < 0:
            raise InvalidArgumentError(f"window: {name} side must be >= 0 or None, got {side}")
        sides.append(int(side))
    return tuple(sides)


def check_causal_align(causal_align):
    if not isinstance(causal_align, str):
        raise ArgumentTypeError(f"causal_align: expected 'bottom_right' or 'top_left', "
                                f"got {type(causal_align).__name__}")
    if causal_align not in ALIGNMENTS:
        raise InvalidArgumentError(f"causal_align: expected 'bottom_right' or 'top_left', "
                                   f"got {causal_align!r}")
    return causal_align


class MaskBounds(NamedTuple):
    left: int   # keys visible left of the diagonal, finite (<= Nq + Nk)
    right: int  # keys visible right of the diagonal, finite (<= Nq + Nk)
    off: int    # the diagonal: row i's own key is i + off


def mask_bounds(causal, window, causal_align, Nq, Nk, diagonal_offset=0):
    """The mask arguments checked (TypeError, ValueError naming causal, window or
    causal_align) and made finite for Nq query rows and Nk keys: an unbounded side, or one
    wider than any distance between a row and a key, is Nq + Nk + |diagonal_offset|, which
    hides nothing more (every |i + off - j| is below it). The simulator's Mask and the
    library call both take these bounds, so a window of any size means the same thing to
    both. diagonal_offset (checked by ScoreMods.resolve) is added to the alignment's off."""
    causal = check_causal(causal)
    left, right = check_window(window)
    causal_align = check_causal_align(causal_align)
    wide = Nq + Nk + abs(diagonal_offset)
    left = wide if left is None else min(left, wide)
    right = 0 if causal else wide if right is None else min(right, wide)
    off = (Nk - Nq if causal_align == "bottom_right" else 0) + diagonal_offset
    return MaskBounds(left, right, off)


@dataclasses.dataclass(frozen=True, eq=False)
class Bias:
    """An additive bias (issue 27), checked by ScoreMods.resolve: the caller's array
    broadcastable to (B, H, Nq, Nk), keys not broadcast. docs/numerics.md §2."""
    given: object     # the caller's array (a CPU one as a NumPy array)
    shape: tuple      # its shape, which dbias gets
    full: tuple       # (B, H, Nq) axes: True where the bias has the whole axis, False where it is 1
    view: object      # CPU: a float32 (B|1, H|1, Nq|1, Nk) NumPy view, keys contiguous; else None
    # Rows of one packed sequence cut from a bias of the grid's Nq rows (pyfa/sim/varlen.py):
    # dS is kept per row even where the sequence has one row, as the library keeps it.
    one_row: "bool | None" = None

    def strides(self):
        """The pyfa_problem bias_strides of view (0 along an axis of 1, or of a broadcast
        view), or None when the library cannot address it in place."""
        return element_strides(self.view)

    def for_grad(self):
        """The view as a backward that writes dbias takes it: a whole axis must not have
        stride 0 (the library sums dbias over rows by that stride), so a broadcast view is
        copied."""
        st = self.strides()
        if st is not None and all(s != 0 or n == 1 for s, n in zip(st, self.view.shape[:3])):
            return self.view
        return np.ascontiguousarray(self.view)

    def at(self, b, h, i, j):
        """bias[b, h, i, j] for integer index arrays broadcasting against each other; an
        index past the bias (the simulators' tile padding) reads its last row or key."""
        v = self.view
        idx = [np.minimum(x, n - 1) for x, n in zip((b, h, i, j), v.shape)]
        return v[idx[0], idx[1], idx[2], idx[3]]

    def sums_rows(self):
        """Whether dS is summed over the query rows (the bias has one row): the library's
        bias_strides.row == 0."""
        return self.view.shape[2] == 1 if self.one_row is None else self.one_row


def check_bias(function, bias, dims):
    """ScoreMods.bias: a float32 array broadcastable to (B, H, Nq, Nk), the keys whole."""
    if bias is None:
        return None
    B, H, Nq, Nk = dims[:4]
    if isinstance(bias, Bias):  # one sequence's corner of a checked bias (pyfa/sim/varlen.py)
        return bias
    if hasattr(bias, "shape") and _arrays.place_of("bias", bias).kind != "cpu":
        raise InvalidArgumentError(f"bias: on {_arrays.place_of('bias', bias)}; pyfa's Python API reads a bias "
                                   f"on the CPU only (the C ABI takes device pointers)")
    x = _arrays.host_array("bias", bias)
    shape = tuple(int(n) for n in getattr(x, "shape", ()))
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ArgumentTypeError(f"bias: expected an array, got {type(bias).__name__}")
    if str(x.dtype) not in ("float32", "torch.float32"):
        hint = " (a boolean mask is the bias where(mask, 0, -inf))" if "bool" in str(x.dtype) else ""
        raise ArgumentTypeError(f"bias: expected dtype float32, got {x.dtype}{hint}")
    full4 = (B, H, Nq, Nk)
    padded = (1,) * (4 - len(shape)) + shape
    if not 1 <= len(shape) <= 4 or padded[3] != Nk or any(n not in (1, m) for n, m in zip(padded[:3], full4)):
        raise InvalidArgumentError(f"bias: shape {shape} does not broadcast to (B, H, Nq, Nk) = {full4} "
                                   f"with its last axis the Nk keys")
    full = tuple(n == m for n, m in zip(padded[:3], full4[:3]))
    view = None
    if isinstance(x, np.ndarray):
        view = x.reshape(padded)
        if element_strides(view) is None:  # also None where the pointer is not aligned
            view = c_aligned(view)
    return Bias(x, shape, full, view)


def check_softcap(softcap):
    """softcap as a float that is exactly a float32 > 0, or None (off); 0, flash-attn's
    "off", is None too. The library takes the same float32 (pyfa_problem.softcap)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ArgumentTypeError(f"softcap: expected a float > 0 or None, got {type(softcap).__name__}")
    try:
        x = float(softcap)
    except OverflowError:  # an int beyond any float
        raise InvalidArgumentError(f"softcap: {softcap} is not representable as a finite float32") from None
    if x == 0:
        return None
    if not (x > 0) or not math.isfinite(x):
        raise InvalidArgumentError(f"softcap: must be finite and > 0 (or None, or 0: off), got {softcap}")
    if x > FLOAT32_MAX or np.float32(x) == 0:
        raise InvalidArgumentError(f"softcap: {softcap} is not representable as a finite nonzero float32")
    return float(np.float32(x))


def _on_a_gpu(x):
    """Whether x is an array on a CUDA device (kept as given: pyfa's API takes its device
    pointer; NumPy cannot read it)."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    device = getattr(x, "__dlpack_device__", None)
    return device is not None and not isinstance(x, np.ndarray) and device()[0] not in (1, 3)  # kDLCPU, kDLCUDAHost


def check_alibi_slopes(slopes, dims):
    """ALiBi's slopes as a float32 (B, H) NumPy view (an (H,) array broadcast along B, with
    batch stride 0), or None (off); an array on a CUDA device is returned as given, its
    shape checked (pyfa's API checks the rest against q's device). dims = (B, H, ...)."""
    if slopes is None:
        return None
    B, H = dims[0], dims[1]
    if _on_a_gpu(slopes):
        shape = tuple(slopes.shape)
        if shape not in ((H,), (B, H)):
            raise InvalidArgumentError(f"alibi_slopes: expected shape ({H},) or ({B}, {H}), got {shape}")
        return slopes
    try:
        a = np.asarray(slopes)
    except Exception as e:  # e.g. a tensor that requires grad
        raise ArgumentTypeError(f"alibi_slopes: expected a float32 array, got {type(slopes).__name__} ({e})") from None
    if a.dtype.kind not in "fiu" or a.dtype.itemsize > 8:
        raise ArgumentTypeError(f"alibi_slopes: expected a float32 array, got dtype {a.dtype}")
    if a.shape not in ((H,), (B, H)):
        raise InvalidArgumentError(f"alibi_slopes: expected shape ({H},) or ({B}, {H}), got {a.shape}")
    with np.errstate(over="ignore"):
        a = c_aligned(a, np.float32)
    if not np.isfinite(a).all():
        raise InvalidArgumentError("alibi_slopes: must be finite (as float32)")
    return np.broadcast_to(a, (B, H))


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """The score modifications of one call, checked (docs/numerics.md, "The score
    pipeline"): one field per modification, holding its neutral value when it is off.
    This is the one list of them in Python. pyfa's API and the simulator take them as
    keyword arguments (**mods) and resolve them here, once per call. A scalar field is
    copied to the pyfa_problem field of the same name (pyfa/api.py), and the simulator's
    formulas read the fields (pyfa/sim/score.py).

    softcap: None, or a float > 0 (a float32 value): S = softcap * tanh(s / softcap).
    alibi_slopes: None, or float32 (B, H) (an (H,) array broadcast: batch stride 0), or a
    CUDA array of shape (H,) or (B, H): S = S - slope[b, h] * |i + off - j|.
    diagonal_offset: an int in [-2^40, 2^40], 0 by default: the call as a block of a
    larger problem whose query row i and key j are rows P + i and K + j there,
    diagonal_offset = P - K (context parallelism). Not a score modification but a move of
    the mask's diagonal, which ALiBi's distance reads too; it travels with them because
    every call takes them alike. Dropout's (b, h, i, j) do not move with it.
    dropout_origin: (B0, H0, P, K), four ints >= 0, (0, 0, 0, 0) by default: element
    (b, h, i, j) of the call draws dropout's decision of element (B0 + b, H0 + h, P + i,
    K + j) of a larger problem (a block of rows and keys, a shard of heads, part of a
    batch), within dropout's counters (B0 + B, H0 + H, P + Nq at most 2^32, K + Nk at
    most 2^34). Normalised to zeros without dropout, as seed and offset are.
    off: the mask's diagonal offset (Nk - Nq for causal_align "bottom_right", 0 for
    "top_left", plus diagonal_offset), set by resolve(), not a keyword.

    A modification adds its field here, its check to resolve(), and its formula to
    pyfa/sim/score.py and src/common/score.h. A field whose pyfa_problem field has
    another name says it in its metadata ("problem")."""

    # ---- dropout of P in P V (docs/numerics.md, "Dropout"): off at dropout_p = 0
    dropout_p: float = 0.0
    seed: "int | None" = dataclasses.field(default=None, metadata={"problem": "dropout_seed"})
    offset: int = dataclasses.field(default=0, metadata={"problem": "dropout_offset"})
    dropout_origin: tuple = (0, 0, 0, 0)

    # Additive bias (issue 27): a Bias, or None. Not compared: an array has no one truth.
    bias: object = dataclasses.field(default=None, compare=False)

    softcap: "float | None" = None
    # Not compared, as bias: an array has no one truth (is_identity tests it).
    alibi_slopes: "np.ndarray | None" = dataclasses.field(default=None, compare=False)
    diagonal_offset: int = 0
    # Not a pyfa_problem field: the library has it from causal_align and diagonal_offset.
    off: int = dataclasses.field(default=0, metadata={"pyfa_problem": False})

    @classmethod
    def resolve(cls, function, dims, causal_align="bottom_right", /, **mods):
        """The modifications of the keyword arguments `mods` of `function` (its name, for
        the error) on a problem of dims = (B, H, Nq, Nk, d, Hkv) under the call's
        causal_align; TypeError for a keyword that names none."""
        for name in mods:
            if name not in SCORE_MOD_KEYWORDS:
                raise ArgumentTypeError(f"{function}() got an unexpected keyword argument {name!r}")
        mods.update(_check_dropout(mods.get("dropout_p", 0.0), mods.get("seed"), mods.get("offset", 0)))
        if "dropout_origin" in mods:
            origin = _check_dropout_origin(mods["dropout_origin"], dims)
            mods["dropout_origin"] = origin if mods["dropout_p"] else (0, 0, 0, 0)
        if "bias" in mods:
            mods["bias"] = check_bias(function, mods["bias"], dims)
        if "softcap" in mods:
            mods["softcap"] = check_softcap(mods["softcap"])
        if "alibi_slopes" in mods:
            mods["alibi_slopes"] = check_alibi_slopes(mods["alibi_slopes"], dims)
        if "diagonal_offset" in mods:
            mods["diagonal_offset"] = check_int("diagonal_offset", mods["diagonal_offset"], -(1 << 40), 1 << 40)
        shift = mods.get("diagonal_offset", 0)
        off = (dims[3] - dims[2] if causal_align == "bottom_right" else 0) + shift
        return cls(off=off, **mods)

    def is_identity(self):
        """True when no modification is on: the score pipeline is the identity (off, the
        mask's offset that ALiBi reads, is none)."""
        plain = dataclasses.replace(self, off=0, diagonal_offset=0) == type(self)()
        return plain and self.bias is None and self.alibi_slopes is None


# The keywords ScoreMods.resolve takes (off is computed, not given).
SCORE_MOD_KEYWORDS = frozenset(f.name for f in dataclasses.fields(ScoreMods)) - {"off"}

_UINT64 = (1 << 64) - 1


def _check_dropout(dropout_p, seed, offset):
    """dropout_p a real in [0, 1) (as float32: the library's rounding), seed an int in
    [0, 2^64) required when dropout_p > 0, offset an int in [0, 2^64). Off (dropout_p 0)
    normalises seed and offset away, so that every call without dropout is the same."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ArgumentTypeError(f"dropout_p: expected a real number in [0, 1), got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0 or not float(np.float32(p)) < 1.0:
        raise InvalidArgumentError(f"dropout_p: must be in [0, 1) (as a float32), got {dropout_p}")
    p = float(np.float32(p))
    if seed is not None:
        seed = check_int("seed", seed, 0, _UINT64)
    offset = check_int("offset", offset, 0, _UINT64)
    if p == 0.0:
        return {"dropout_p": 0.0, "seed": None, "offset": 0}
    if seed is None:
        raise InvalidArgumentError(
            "seed: dropout_p > 0 needs an explicit seed (an int in [0, 2^64)), so that the dropout mask is "
            "reproducible; pyfa.torch.attention draws one from torch's generator when seed is None")
    return {"dropout_p": p, "seed": seed, "offset": offset}


def _check_dropout_origin(origin, dims):
    """dropout_origin: four ints >= 0, each with the call's extent (B, H, Nq, Nk of dims)
    within dropout's counters."""
    if isinstance(origin, (str, bytes)) or not isinstance(origin, (tuple, list)) or len(origin) != 4:
        raise ArgumentTypeError(f"dropout_origin: expected four ints (B0, H0, P, K), got {origin!r}")
    names = ("B0", "H0", "P", "K")
    extents = (dims[0], dims[1], dims[2], dims[3])
    most = (1 << 32, 1 << 32, 1 << 32, 1 << 34)
    return tuple(check_int(f"dropout_origin's {n}", x, 0, max(0, m - e)) for n, x, e, m in
                 zip(names, origin, extents, most))


def check_dropout_mask(function, batch, heads, seqlen_q, seqlen_k, dropout_p, seed, offset,
                       dropout_origin=(0, 0, 0, 0)):
    """The arguments of dropout_mask (pyfa's and the simulator's): (B, H, Nq, Nk) and the
    resolved ScoreMods."""
    dims = (check_int("batch", batch, 1, 65535), check_int("heads", heads, 1, 65535),
            check_int("seqlen_q", seqlen_q, 0, 1 << 32), check_int("seqlen_k", seqlen_k, 0, 1 << 34))
    mods = ScoreMods.resolve(function, dims + (1, dims[1]), dropout_p=dropout_p, seed=seed, offset=offset,
                             dropout_origin=dropout_origin)
    return dims, mods


__all__ = [
    "ALIGNMENTS", "Bias", "EMPTY_VALUES", "FLOAT32_MAX", "LAYOUTS", "MAX_HEAD_DIM", "MAX_TILE", "MaskBounds", "QKV",
    "SCORE_MOD_KEYWORDS", "ScoreMods", "check_bias",
    "as_4d", "as_tensor", "caller_shape", "check_causal", "check_causal_align", "check_softcap", "check_alibi_slopes",
    "check_count_args", "check_dropout_mask", "check_int", "check_layout", "check_like", "check_qkv",
    "check_rows", "check_sizes", "check_tile", "check_window", "element_strides", "empty_output", "is_empty",
    "mask_bounds", "resolve_scale", "restore_rank", "restore_rows",
]


# ---- Packed sequences (varlen): flash-attn's flash_attn_varlen_func arguments. q is
# (total_q, H, d), k and v (total_k, Hkv, d), the offsets int32 (B + 1,), first 0,
# non-decreasing, last the total; sequence b owns rows cu[b] .. cu[b + 1] - 1.

VARLEN_SHAPES = {"q": "(total_q, H, d)", "k": "(total_k, Hkv, d)", "v": "(total_k, Hkv, d)",
                 "o": "(total_q, H, d)", "do": "(total_q, H, d)"}


def check_varlen_rank(name, shape):
    """A packed tensor has rank 3: one axis of rows, then heads and d."""
    if len(shape) != 3:
        raise InvalidArgumentError(f"{name}: expected a packed tensor {VARLEN_SHAPES.get(name, '(total, H, d)')}, "
                                   f"got shape {tuple(shape)}")


def check_offsets_shape(name, shape, typestr, batch=None):
    """The offsets' dtype (int32: 'int32' or a typestr '<i4') and shape (B + 1,), B >= 1;
    `batch`: B of the other offsets, which these must match. Returns B."""
    if typestr not in ("int32", "<i4", "=i4", "|i4"):
        raise ArgumentTypeError(f"{name}: expected dtype int32 (flash-attn's cu_seqlens), got {typestr}")
    if len(shape) != 1 or shape[0] < 2:
        raise InvalidArgumentError(f"{name}: expected a 1-D array of B + 1 >= 2 offsets, got shape {tuple(shape)}")
    if batch is not None and shape[0] != batch + 1:
        raise InvalidArgumentError(f"{name}: {shape[0]} offsets, but cu_seqlens_q has {batch + 1} "
                                   f"(B + 1 each)")
    return shape[0] - 1


def check_offsets(name, cu, total, batch=None):
    """CPU offsets (a NumPy int32 array) checked against the `total` rows of the packed
    tensor they split: B + 1 of them, first 0, non-decreasing, last total. Returns them as
    a tuple of Python ints."""
    if not isinstance(cu, np.ndarray):
        raise ArgumentTypeError(f"{name}: expected a 1-D int32 array (NumPy, or any with __dlpack__), "
                                f"got {type(cu).__name__}")
    check_offsets_shape(name, cu.shape, str(cu.dtype), batch)
    offsets = tuple(int(x) for x in cu)
    if offsets[0] != 0:
        raise InvalidArgumentError(f"{name}[0]: must be 0, got {offsets[0]}")
    for b in range(1, len(offsets)):
        if offsets[b] < offsets[b - 1]:
            raise InvalidArgumentError(f"{name}[{b}]: {offsets[b]} is below the offset before it "
                                       f"({offsets[b - 1]}); offsets must not decrease")
    if offsets[-1] != total:
        raise InvalidArgumentError(f"{name}[{len(offsets) - 1}]: must be the {total} rows of the packed "
                                   f"tensor, got {offsets[-1]}")
    return offsets


def check_seqused(name, used, offsets):
    """seqused_k (flash-attn's): None, or CPU int32 (B,) key counts, each within its
    sequence's keys in `offsets` (checked cu_seqlens_k). Returns a tuple of ints or None."""
    if used is None:
        return None
    if not isinstance(used, np.ndarray):
        raise ArgumentTypeError(f"{name}: expected a 1-D int32 array (NumPy, or any with __dlpack__), "
                                f"got {type(used).__name__}")
    if str(used.dtype) != "int32":
        raise ArgumentTypeError(f"{name}: expected dtype int32 (flash-attn's seqused_k), got {used.dtype}")
    if used.shape != (len(offsets) - 1,):
        raise InvalidArgumentError(f"{name}: expected shape ({len(offsets) - 1},), one count per sequence, "
                                   f"got {used.shape}")
    counts = tuple(int(x) for x in used)
    for b, n in enumerate(counts):
        if not 0 <= n <= offsets[b + 1] - offsets[b]:
            raise InvalidArgumentError(f"{name}[{b}]: must be in [0, {offsets[b + 1] - offsets[b]}] (sequence "
                                       f"{b}'s keys in cu_seqlens_k), got {n}")
    return counts


@dataclasses.dataclass(frozen=True)
class Pages:
    """Paged K/V (pyfa.h's problem->page_size): packed key row r of a call lies at row
    table[r // page_size] * page_size + r % page_size of its k and v, which hold
    num_pages * page_size rows. table: int32 (total_k / page_size,), contiguous, the
    entries of every page in use within [0, num_pages) (the caller's to have checked)."""
    table: np.ndarray
    page_size: int
    num_pages: int

    @property
    def logical_rows(self):
        """total_k of the call: the packed rows the table maps."""
        return len(self.table) * self.page_size

    def rows(self, a, z):
        """The rows of k and v holding packed key rows a .. z - 1."""
        r = np.arange(a, z, dtype=np.int64)
        return self.table[r // self.page_size].astype(np.int64) * self.page_size + r % self.page_size


def check_max_seqlen(name, value, offsets):
    """max_seqlen_q or _k: None (the longest length of `offsets`) or an int >= it."""
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    if value is None:
        return longest
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected None or an int, got {type(value).__name__}")
    if value < longest:
        raise InvalidArgumentError(f"{name}: {value} is below the longest sequence ({longest} rows)")
    return int(value)


# ---- split-KV (docs/numerics.md, "Split-KV"): keys per chunk of the FA2 forward
def decode_split_size(head_dim):
    """The split size split_size="decode" stands for: a constant of the head dimension
    alone (never of the batch, the device or the thread count, so that the bits follow
    the problem only): 512 keys for d <= 64, 256 for d <= 128, 128 above. Each is a
    multiple of every default Bc."""
    return 512 if head_dim <= 64 else 256 if head_dim <= 128 else 128


def check_split_size(split_size, head_dim, block_c=None):
    """split_size as keys per chunk (0: one chunk, no split): None or 0, "decode"
    (decode_split_size(head_dim)), or a positive int, a multiple of block_c where the
    caller knows it (the library checks its kernel's Bc itself)."""
    if split_size is None:
        return 0
    if isinstance(split_size, str):
        if split_size != "decode":
            raise InvalidArgumentError(f"split_size: expected None, an int or 'decode', got {split_size!r}")
        split_size = decode_split_size(head_dim)
    split_size = check_int("split_size", split_size, 0, 1 << 40)
    if split_size and block_c is not None and split_size % block_c:
        raise InvalidArgumentError(f"split_size: must be a multiple of Bc = {block_c}, got {split_size}")
    return split_size
