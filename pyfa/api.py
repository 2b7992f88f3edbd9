"""pyfa's Python API on NumPy buffers: argument checks, then one call into libpyfa.

Outputs are always fresh arrays in the layout asked for. Inputs of any strides are
accepted and never written; those whose last axis is contiguous (a transposed (B, N, H, d)
array, q, k, v as views into one packed array, ...) go to the library in place with their
strides, others are copied to C-contiguous float32 first.
"""

import warnings
from dataclasses import dataclass

import numpy as np

from . import _lib
from .sim.inputs import (
    MAX_HEAD_DIM, check_causal, check_int, check_like, check_qkv, check_rows, check_tile,
    element_strides, empty_output, resolve_scale, restore_rows,
)
from .sim.mask import Mask, check_window

# The C enum pyfa_backend; "auto" first, then the others best first (backends() keeps
# this order).
BACKENDS = {"auto": 0, "cuda": 1, "emu": 2}
EMU_ORDERS = {"forward": 0, "reverse": 1, "shuffled": 2}
# The C enum pyfa_kernel.
KERNELS = {"fa1_forward": 0, "fa2_forward": 1, "fa1_backward": 2,
           "fa2_backward_preprocess": 3, "fa2_backward_dkdv": 4, "fa2_backward_dq": 5}

INT_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# Every tensor of the C ABI by the name the Python API and errors use (pyfa.h spells dO
# "dout", `do` being a C keyword), with the kind of its shape: "query" (B, H, Nq, d),
# "key" (B, Hkv, Nk, d) or "row" (B, H, Nq), one float per query row.
TENSOR_KINDS = {"q": "query", "k": "key", "v": "key", "o": "query", "do": "query",
                "lse": "row", "m": "row", "l": "row", "dq": "query", "dk": "key", "dv": "key"}
# The pyfa_problem field holding each 4-D tensor's strides.
STRIDE_FIELDS = {"q": "q", "k": "k", "v": "v", "o": "o", "do": "dout", "dq": "dq", "dk": "dk",
                 "dv": "dv"}
# The C enum pyfa_causal_align.
CAUSAL_ALIGNS = {"bottom_right": 0, "top_left": 1}


def tensor_shape(name, batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv=None):
    """The (B, heads, N, d) or (B, H, Nq) shape of tensor `name` (a TENSOR_KINDS key) in a
    problem of these sizes; heads_kv None means heads."""
    kind = TENSOR_KINDS[name]
    if kind == "row":
        return (batch, heads, seqlen_q)
    if kind == "query":
        return (batch, heads, seqlen_q, head_dim)
    return (batch, heads if heads_kv is None else heads_kv, seqlen_k, head_dim)


@dataclass(frozen=True)
class Op:
    """One operation of the C ABI, as the API, the tools and the tests call it.

    c_function takes (problem, config, *inputs, *outputs) as host pointers; its twin
    device_function takes device pointers and then a stream (pyfa.h)."""
    name: str        # "fa2_forward": also the name of the Python function
    algo: str        # "fa1" or "fa2"
    pass_: str       # "forward" or "backward"
    c_function: str
    inputs: tuple    # TENSOR_KINDS names, in C argument order
    outputs: tuple   # TENSOR_KINDS names, in C argument order, after the inputs
    kernels: tuple   # KERNELS names, in launch order

    @property
    def device_function(self):
        return self.c_function + "_device"

    def output_shapes(self, batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv=None):
        return {t: tensor_shape(t, batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv)
                for t in self.outputs}


OPS = {op.name: op for op in (
    Op("fa2_forward", "fa2", "forward", "pyfa_fa2_forward",
       ("q", "k", "v"), ("o", "lse"), ("fa2_forward",)),
    Op("fa2_backward", "fa2", "backward", "pyfa_fa2_backward",
       ("q", "k", "v", "o", "lse", "do"), ("dq", "dk", "dv"),
       ("fa2_backward_preprocess", "fa2_backward_dkdv", "fa2_backward_dq")),
    Op("fa1_forward", "fa1", "forward", "pyfa_fa1_forward",
       ("q", "k", "v"), ("o", "m", "l"), ("fa1_forward",)),
    Op("fa1_backward", "fa1", "backward", "pyfa_fa1_backward",
       ("q", "k", "v", "o", "m", "l", "do"), ("dq", "dk", "dv"), ("fa1_backward",)),
)}


def _choice(name, value, table):
    if not isinstance(value, str) or value not in table:
        raise ValueError(f"{name}: expected one of {sorted(table)}, got {value!r}")
    return table[value]


_auto_checked = False


def _warn_if_auto_falls_back(lib):
    """Once per process: backend="auto" on a library built with CUDA that cannot use it
    here runs far slower on the CPU; say so, and why."""
    global _auto_checked
    if _auto_checked:
        return
    _auto_checked = True
    cuda = BACKENDS["cuda"]
    if lib.pyfa_backend_compiled(cuda) and not lib.pyfa_backend_available(cuda):
        warnings.warn(f"pyfa: backend='auto' falls back to the CPU: this libpyfa has a CUDA "
                      f"backend, but it cannot run here ({_reason(lib, cuda)})",
                      RuntimeWarning, stacklevel=5)


def _reason(lib, backend):
    ffi, _ = _lib.load()
    return ffi.string(lib.pyfa_backend_reason(backend)).decode("utf-8", "replace")


# pyfa_variant: "fast" runs the register-tiled kernels (an error where they do not
# apply), "reference" the readable ones, "auto" fast where it applies.
VARIANTS = {"auto": 0, "reference": 1, "fast": 2}


def _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, variant="auto"):
    ffi, lib = _lib.load()
    cfg = ffi.new("pyfa_config *")
    cfg.variant = _choice("variant", variant, VARIANTS)
    cfg.backend = _choice("backend", backend, BACKENDS)
    if backend == "auto":
        _warn_if_auto_falls_back(lib)
    cfg.block_r = check_tile("block_r", block_r) or 0
    cfg.block_c = check_tile("block_c", block_c) or 0
    cfg.emu_order = _choice("emu_order", emu_order, EMU_ORDERS)
    cfg.emu_seed = check_int("emu_seed", emu_seed, 0, 2**64 - 1)
    cfg.emu_workers = check_int("emu_workers", emu_workers, 0, INT_MAX)
    return cfg


def _problem(q4, k4, scale, causal, window, causal_align):
    """A pyfa_problem (struct_size 0: this layout) for q4, k4 and the mask arguments,
    checked as the simulator checks them; the strides are filled in by _run."""
    ffi, _ = _lib.load()
    Nq, Nk = q4.shape[2], k4.shape[2]
    Mask.resolve(causal, window, causal_align, Nq, Nk)  # the argument checks
    pr = ffi.new("pyfa_problem *")
    pr.batch, pr.heads, pr.seqlen_q, pr.head_dim = q4.shape
    pr.heads_kv = k4.shape[1]
    pr.seqlen_k = Nk
    pr.scale = float(resolve_scale(scale, q4.shape[3]))
    pr.causal = 1 if check_causal(causal) else 0
    if window is not None:
        left, right = check_window(window)
        pr.window = 1
        pr.window_left = -1 if left is None else left
        pr.window_right = -1 if right is None else right
    pr.causal_align = CAUSAL_ALIGNS[causal_align]
    return pr


def _strides(x4):
    """The (batch, head, row) element strides the library takes for the (B, heads, N, d)
    view x4, or None when it cannot address x4 in place. An axis of length 1 gets its
    dense stride (any value would do), so that all three are 0 only for a tensor broadcast
    along every axis, which pyfa.h would read as dense: that one is copied too."""
    strides = element_strides(x4)
    if strides is None:
        return None
    B, H, N, d = x4.shape
    strides = tuple(dense if n == 1 else s
                    for n, s, dense in zip((B, H, N), strides, (H * N * d, N * d, d)))
    return None if strides == (0, 0, 0) else strides


def _in_place(x):
    """x as the library can address it (x itself when it can, else a C-contiguous copy)
    and its (batch, head, row) element strides (None for a per-row tensor, always dense)."""
    if x.ndim == 3:
        return np.ascontiguousarray(x), None
    strides = _strides(x)
    if strides is None:
        x = np.ascontiguousarray(x)
        strides = _strides(x)
    return x, strides


def _address(ffi, x):
    """A float * to element 0 of x (a view may start anywhere in its base's buffer)."""
    return ffi.cast("float *", x.__array_interface__["data"][0])


def _check_progress(progress):
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected a callable(done, total) or None, got {type(progress).__name__}")
    return progress


def _run(op_name, inputs, *, rank, layout, causal, window, causal_align, scale, block_r,
         block_c, backend, emu_order, emu_seed, emu_workers, progress, variant="auto"):
    """Runs OPS[op_name] on `inputs` ({name: checked (B, heads, N, d) or (B, H, Nq) view});
    returns its outputs {name: fresh array in the caller's rank and layout; per-row ones
    (B, H, Nq) cut to the caller's rank}."""
    op = OPS[op_name]
    q4, k4 = inputs["q"], inputs["k"]
    problem = _problem(q4, k4, scale, causal, window, causal_align)
    config = _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, variant)
    progress = _check_progress(progress)
    ffi, lib = _lib.load()
    shapes = op.output_shapes(*q4.shape[:3], k4.shape[2], q4.shape[3], k4.shape[1])
    outputs, views = {}, {}
    for name, shape in shapes.items():
        if len(shape) == 3:
            outputs[name] = views[name] = np.empty(shape, np.float32)
        else:
            outputs[name], views[name] = empty_output(shape, rank, layout)
    # `held` keeps every array (and any copy _in_place made) alive until the call returns.
    # Fresh outputs are C-contiguous in the caller's layout, so always addressable in place.
    held = [_in_place(inputs[n]) for n in op.inputs]
    held += [(views[n], None if views[n].ndim == 3 else _strides(views[n]))
             for n in op.outputs]
    for name, (_, strides) in zip(op.inputs + op.outputs, held):
        if strides is not None:
            s = getattr(problem, STRIDE_FIELDS[name])
            s.batch, s.head, s.row = strides
    pointers = [_address(ffi, x) for x, _ in held]
    _lib.call(getattr(lib, op.c_function), config, problem, config, *pointers, progress=progress)
    return outputs


_MASK_DOC = """
    causal: key j hidden from query i when j > i + off; window: None or (left, right),
    each an int >= 0 or None (unbounded): key j visible to query i iff
    i + off - left <= j <= i + off + right (causal sets right = 0); causal_align:
    "bottom_right" (off = Nk - Nq, flash-attn's) or "top_left" (off = 0, PyTorch's
    is_causal). layout: "bhnd" (B, H, N, d) or "bnhd" (B, N, H, d), flash-attn's, for
    every 4-D tensor in and out; per-row tensors (lse, m, l) are (B, H, Nq) in both.
    k and v may have Hkv heads, H % Hkv == 0 (grouped-query attention)."""


def _with_mask_doc(fn):
    fn.__doc__ += _MASK_DOC
    return fn


@_with_mask_doc
def fa2_forward(q, k, v, *, causal=False, window=None, causal_align="bottom_right", scale=None,
                layout="bhnd", block_r=None, block_c=None, backend="auto", emu_order="forward",
                emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-2 forward. Returns (o, lse): o like q, lse (log-sum-exp of each
    query row's scaled scores, -inf for a row with no visible key) (B, H, Nq) cut to q's
    rank.

    progress: None, or a callable(done, total) called now and then from a library
    thread; returning True cancels the call (CancelledError). Ctrl-C cancels it too."""
    q4, k4, v4, rank, _ = check_qkv(q, k, v, layout)
    out = _run("fa2_forward", dict(q=q4, k=k4, v=v4), rank=rank, layout=layout, causal=causal,
               window=window, causal_align=causal_align, scale=scale, block_r=block_r,
               block_c=block_c, backend=backend, emu_order=emu_order, emu_seed=emu_seed,
               emu_workers=emu_workers, progress=progress,
               variant=variant)
    return out["o"], restore_rows(out["lse"], rank)


@_with_mask_doc
def fa2_backward(q, k, v, o, lse, do, *, causal=False, window=None, causal_align="bottom_right",
                 scale=None, layout="bhnd", block_r=None, block_c=None, backend="auto",
                 emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-2 backward from the forward's saved o and lse (fa2_forward) and the
    incoming gradient do (like o). Returns (dq, dk, dv), shaped like q, k, v (dk, dv with
    Hkv heads, each the sum over its group's query heads). The mask, scale and layout
    must be the forward's. Deterministic: the same inputs give the same bits."""
    q4, k4, v4, rank, _ = check_qkv(q, k, v, layout)
    inputs = dict(q=q4, k=k4, v=v4, o=check_like("o", o, q4, layout),
                  lse=check_rows("lse", lse, q4), do=check_like("do", do, q4, layout))
    out = _run("fa2_backward", inputs, rank=rank, layout=layout, causal=causal, window=window,
               causal_align=causal_align, scale=scale, block_r=block_r, block_c=block_c,
               backend=backend, emu_order=emu_order, emu_seed=emu_seed,
               emu_workers=emu_workers, progress=progress,
               variant=variant)
    return out["dq"], out["dk"], out["dv"]


@_with_mask_doc
def fa1_forward(q, k, v, *, causal=False, window=None, causal_align="bottom_right", scale=None,
                layout="bhnd", block_r=None, block_c=None, backend="auto", emu_order="forward",
                emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-1 forward (the paper's Algorithm 1 as written). Returns (o, m, l):
    o like q; m (row max of the scaled scores) and l (sum of exp(score - m)) (B, H, Nq)
    cut to q's rank, as the paper keeps them for the backward; a row with no visible key
    gets o = 0, m = -inf, l = 0."""
    q4, k4, v4, rank, _ = check_qkv(q, k, v, layout)
    out = _run("fa1_forward", dict(q=q4, k=k4, v=v4), rank=rank, layout=layout, causal=causal,
               window=window, causal_align=causal_align, scale=scale, block_r=block_r,
               block_c=block_c, backend=backend, emu_order=emu_order, emu_seed=emu_seed,
               emu_workers=emu_workers, progress=progress,
               variant=variant)
    return out["o"], restore_rows(out["m"], rank), restore_rows(out["l"], rank)


@_with_mask_doc
def fa1_backward(q, k, v, o, m, l, do, *, causal=False, window=None, causal_align="bottom_right",
                 scale=None, layout="bhnd", block_r=None, block_c=None, backend="auto",
                 emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-1 backward (the paper's Algorithm 4) from the forward's saved o, m, l
    (fa1_forward) and the incoming gradient do (like o). Returns (dq, dk, dv), shaped like
    q, k, v (dk, dv with Hkv heads). The mask, scale and layout must be the forward's.
    Deterministic: no atomics."""
    q4, k4, v4, rank, _ = check_qkv(q, k, v, layout)
    inputs = dict(q=q4, k=k4, v=v4, o=check_like("o", o, q4, layout), m=check_rows("m", m, q4),
                  l=check_rows("l", l, q4), do=check_like("do", do, q4, layout))
    out = _run("fa1_backward", inputs, rank=rank, layout=layout, causal=causal, window=window,
               causal_align=causal_align, scale=scale, block_r=block_r, block_c=block_c,
               backend=backend, emu_order=emu_order, emu_seed=emu_seed,
               emu_workers=emu_workers, progress=progress,
               variant=variant)
    return out["dq"], out["dk"], out["dv"]


# algo -> the forward pass returning O alone.
_FORWARD = {"fa1": lambda *a, **kw: fa1_forward(*a, **kw)[0],
            "fa2": lambda *a, **kw: fa2_forward(*a, **kw)[0]}


@_with_mask_doc
def attention(q, k, v, *, causal=False, window=None, causal_align="bottom_right", scale=None,
              algo="fa2", layout="bhnd", block_r=None, block_c=None, backend="auto",
              emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """O = softmax(scale * Q K^T [mask]) V by FlashAttention.

    q: (B, H, Nq, d), (H, Nq, d) or (Nq, d) float32 in layout "bhnd" ((B, Nq, H, d), ... in
    "bnhd"); k, v: the same with Nk rows (and Hkv heads). algo: "fa1" or "fa2"; backend:
    "auto" (CUDA when a GPU is usable, else the CPU), "cuda" or "emu"; block_r, block_c:
    tiles Br, Bc (None: the default); progress: see fa2_forward; variant: "auto" (the fast
    kernels where they apply, else the readable ones), "reference" (the readable ones) or
    "fast" (ValueError naming what they lack where they do not apply)."""
    fn = _FORWARD.get(algo) if isinstance(algo, str) else None
    if fn is None:
        raise ValueError(f"algo: expected one of {sorted(_FORWARD)}, got {algo!r}")
    return fn(q, k, v, causal=causal, window=window, causal_align=causal_align, scale=scale,
              layout=layout, block_r=block_r, block_c=block_c, backend=backend,
              emu_order=emu_order, emu_seed=emu_seed, emu_workers=emu_workers, progress=progress,
               variant=variant)


def _fa1_grad(q, k, v, do, **kw):
    o, m, l = fa1_forward(q, k, v, **kw)
    return (o, *fa1_backward(q, k, v, o, m, l, do, **kw))


def _fa2_grad(q, k, v, do, **kw):
    o, lse = fa2_forward(q, k, v, **kw)
    return (o, *fa2_backward(q, k, v, o, lse, do, **kw))


# algo -> forward then backward, returning (o, dq, dk, dv).
_GRAD = {"fa1": _fa1_grad, "fa2": _fa2_grad}


@_with_mask_doc
def attention_grad(q, k, v, do, *, causal=False, window=None, causal_align="bottom_right",
                   scale=None, algo="fa2", layout="bhnd", block_r=None, block_c=None,
                   backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """The forward and backward of attention(q, k, v, ...) for the incoming gradient do
    (like the output): returns (o, dq, dk, dv), o like q and the gradients like q, k, v.
    Arguments as in attention(); do is checked before any kernel runs; progress sees
    each of the two calls in turn."""
    fn = _GRAD.get(algo) if isinstance(algo, str) else None
    if fn is None:
        raise ValueError(f"algo: expected one of {sorted(_GRAD)}, got {algo!r}")
    q4, k4, _, _, _ = check_qkv(q, k, v, layout)
    check_like("do", do, q4, layout)
    Mask.resolve(causal, window, causal_align, q4.shape[2], k4.shape[2])
    return fn(q, k, v, do, causal=causal, window=window, causal_align=causal_align, scale=scale,
              layout=layout, block_r=block_r, block_c=block_c, backend=backend,
              emu_order=emu_order, emu_seed=emu_seed, emu_workers=emu_workers, progress=progress,
               variant=variant)


def backends():
    """The backends that can run here, best first ("cuda" only with a usable GPU);
    unavailable_backends() says why the others cannot."""
    _, lib = _lib.load()
    return [name for name, b in BACKENDS.items() if name != "auto" and lib.pyfa_backend_available(b)]


def unavailable_backends():
    """{backend: why it cannot run here} for each backend that cannot, e.g.
    {"cuda": "this libpyfa was built without nvcc"}; the reason is the library's own
    (pyfa_backend_reason), the CUDA driver's error where there is one."""
    _, lib = _lib.load()
    return {name: _reason(lib, b) for name, b in BACKENDS.items()
            if name != "auto" and not lib.pyfa_backend_available(b)}


def device_profile(backend="auto"):
    """The limits the kernels are sized against: a dict with name, smem_per_block,
    max_threads_per_block, sm_count."""
    ffi, lib = _lib.load()
    prof = ffi.new("pyfa_device_profile *")
    _lib.check(lib.pyfa_device_profile_get(_choice("backend", backend, BACKENDS), prof))
    return {"name": ffi.string(prof.name).decode(), "smem_per_block": prof.smem_per_block,
            "max_threads_per_block": prof.max_threads_per_block, "sm_count": prof.sm_count}


def default_tiles(kernel, head_dim, backend="auto", variant="reference"):
    """(Br, Bc) the library uses for `kernel` (e.g. "fa2_forward") at this head dim when
    no tiles are given: the readable kernel's ("reference", what pyfa.sim mirrors), the
    fast kernel's ("fast": ValueError naming what it lacks where it has none) or what
    variant="auto" runs."""
    ffi, lib = _lib.load()
    kernel_id = _choice("kernel", kernel, KERNELS)
    d = check_int("head_dim", head_dim, 1, MAX_HEAD_DIM)
    br, bc = ffi.new("int *"), ffi.new("int *")
    _lib.check(lib.pyfa_variant_default_tiles(kernel_id, _choice("variant", variant, VARIANTS), d,
                                              _choice("backend", backend, BACKENDS), br, bc))
    return br[0], bc[0]


def smem_bytes(kernel, block_r, block_c, head_dim, variant="reference"):
    """Bytes of dynamic shared memory `kernel` needs for these tiles; 0 when the library
    has no size for them (a value out of its range, or no kernel of that variant)."""
    _, lib = _lib.load()
    return lib.pyfa_variant_smem_bytes(_choice("kernel", kernel, KERNELS),
                                       _choice("variant", variant, VARIANTS),
                                       check_int("block_r", block_r, -INT_MAX - 1, INT_MAX),
                                       check_int("block_c", block_c, -INT_MAX - 1, INT_MAX),
                                       check_int("head_dim", head_dim, -INT64_MAX - 1, INT64_MAX))


def library_version():
    """The version of the loaded libpyfa (pyfa_version()); equals pyfa.__version__."""
    ffi, lib = _lib.load()
    return ffi.string(lib.pyfa_version()).decode()
