"""pyfa's Python API on NumPy buffers: argument checks, then one call into libpyfa.

Outputs are always fresh arrays; inputs of any strides are accepted (copied to
C-contiguous float32 when needed) and never written.
"""

import warnings
from dataclasses import dataclass

import numpy as np

from . import _lib
from .sim.inputs import (
    MAX_HEAD_DIM, check_causal, check_int, check_like, check_qkv, check_rows, check_tile,
    resolve_scale, restore_rank,
)

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
# "key" (B, H, Nk, d) or "row" (B, H, Nq), one float per query row.
TENSOR_KINDS = {"q": "query", "k": "key", "v": "key", "o": "query", "do": "query",
                "lse": "row", "m": "row", "l": "row", "dq": "query", "dk": "key", "dv": "key"}


def tensor_shape(name, batch, heads, seqlen_q, seqlen_k, head_dim):
    """The shape of tensor `name` (a TENSOR_KINDS key) in a problem of these sizes."""
    kind = TENSOR_KINDS[name]
    if kind == "row":
        return (batch, heads, seqlen_q)
    return (batch, heads, seqlen_q if kind == "query" else seqlen_k, head_dim)


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

    def output_shapes(self, batch, heads, seqlen_q, seqlen_k, head_dim):
        return {t: tensor_shape(t, batch, heads, seqlen_q, seqlen_k, head_dim) for t in self.outputs}


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


def _problem(q4, k4, scale, causal):
    ffi, _ = _lib.load()
    pr = ffi.new("pyfa_problem *")
    pr.batch, pr.heads, pr.seqlen_q, pr.head_dim = q4.shape
    pr.seqlen_k = k4.shape[2]
    pr.scale = float(resolve_scale(scale, q4.shape[3]))
    pr.causal = 1 if check_causal(causal) else 0
    return pr


def _check_progress(progress):
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected a callable(done, total) or None, got {type(progress).__name__}")
    return progress


def _run(op_name, inputs, *, causal, scale, block_r, block_c, backend, emu_order, emu_seed,
         emu_workers, progress, variant="auto"):
    """Runs OPS[op_name] on `inputs` ({name: checked 4-D or 3-D array}); returns its
    outputs {name: fresh array}."""
    op = OPS[op_name]
    q4, k4 = inputs["q"], inputs["k"]
    problem = _problem(q4, k4, scale, causal)
    config = _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, variant)
    progress = _check_progress(progress)
    ffi, lib = _lib.load()
    outputs = {name: np.empty(shape, np.float32)
               for name, shape in op.output_shapes(*q4.shape[:3], k4.shape[2], q4.shape[3]).items()}
    pointers = [ffi.cast("float *", ffi.from_buffer(x))
                for x in [inputs[n] for n in op.inputs] + [outputs[n] for n in op.outputs]]
    _lib.call(getattr(lib, op.c_function), config, problem, config, *pointers, progress=progress)
    return outputs


def fa2_forward(q, k, v, *, causal=False, scale=None, block_r=None, block_c=None,
                backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-2 forward. Returns (o, lse): o like q, lse (log-sum-exp of each
    query row's scaled scores, -inf for a row with no visible key) q's shape without d.

    progress: None, or a callable(done, total) called now and then from a library
    thread; returning True cancels the call (CancelledError). Ctrl-C cancels it too."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    out = _run("fa2_forward", dict(q=q4, k=k4, v=v4), causal=causal, scale=scale,
               block_r=block_r, block_c=block_c, backend=backend, emu_order=emu_order,
               emu_seed=emu_seed, emu_workers=emu_workers, progress=progress, variant=variant)
    return restore_rank(out["o"], rank), out["lse"].reshape(q4.shape[4 - rank:3])


def fa2_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_r=None, block_c=None,
                 backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-2 backward from the forward's saved o and lse (fa2_forward) and the
    incoming gradient do (like o). Returns (dq, dk, dv), shaped like q, k, v. causal and
    scale must be the forward's. Deterministic: the same inputs give the same bits."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    inputs = dict(q=q4, k=k4, v=v4, o=check_like("o", o, q4), lse=check_rows("lse", lse, q4),
                  do=check_like("do", do, q4))
    out = _run("fa2_backward", inputs, causal=causal, scale=scale, block_r=block_r,
               block_c=block_c, backend=backend, emu_order=emu_order, emu_seed=emu_seed,
               emu_workers=emu_workers, progress=progress, variant=variant)
    return tuple(restore_rank(out[g], rank) for g in ("dq", "dk", "dv"))


def fa1_forward(q, k, v, *, causal=False, scale=None, block_r=None, block_c=None,
                backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-1 forward (the paper's Algorithm 1 as written). Returns (o, m, l):
    o like q; m (row max of the scaled scores) and l (sum of exp(score - m)) q's shape
    without d, as the paper keeps them for the backward; a row with no visible key gets
    o = 0, m = -inf, l = 0."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    out = _run("fa1_forward", dict(q=q4, k=k4, v=v4), causal=causal, scale=scale,
               block_r=block_r, block_c=block_c, backend=backend, emu_order=emu_order,
               emu_seed=emu_seed, emu_workers=emu_workers, progress=progress, variant=variant)
    rows = q4.shape[4 - rank:3]
    return restore_rank(out["o"], rank), out["m"].reshape(rows), out["l"].reshape(rows)


def fa1_backward(q, k, v, o, m, l, do, *, causal=False, scale=None, block_r=None, block_c=None,
                 backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
                variant="auto"):
    """FlashAttention-1 backward (the paper's Algorithm 4) from the forward's saved o, m, l
    (fa1_forward) and the incoming gradient do (like o). Returns (dq, dk, dv), shaped like
    q, k, v. causal and scale must be the forward's. Deterministic: no atomics."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    inputs = dict(q=q4, k=k4, v=v4, o=check_like("o", o, q4), m=check_rows("m", m, q4),
                  l=check_rows("l", l, q4), do=check_like("do", do, q4))
    out = _run("fa1_backward", inputs, causal=causal, scale=scale, block_r=block_r,
               block_c=block_c, backend=backend, emu_order=emu_order, emu_seed=emu_seed,
               emu_workers=emu_workers, progress=progress, variant=variant)
    return tuple(restore_rank(out[g], rank) for g in ("dq", "dk", "dv"))


# algo -> the forward pass returning O alone.
_FORWARD = {"fa1": lambda *a, **kw: fa1_forward(*a, **kw)[0],
            "fa2": lambda *a, **kw: fa2_forward(*a, **kw)[0]}


def attention(q, k, v, *, causal=False, scale=None, algo="fa2", block_r=None, block_c=None,
              backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, progress=None,
              variant="auto"):
    """O = softmax(scale * Q K^T [causal mask]) V by FlashAttention.

    q: (B, H, Nq, d), (H, Nq, d) or (Nq, d) float32; k, v: the same with Nk rows.
    algo: "fa1" or "fa2"; backend: "auto" (CUDA when a GPU is usable, else the CPU),
    "cuda" or "emu"; block_r, block_c: tiles Br, Bc (None: the default); progress: see
    fa2_forward; variant: "auto" (the fast kernels where they apply), "reference" (the
    readable ones) or "fast" (an error naming what they lack where they do not apply)."""
    fn = _FORWARD.get(algo) if isinstance(algo, str) else None
    if fn is None:
        raise ValueError(f"algo: expected one of {sorted(_FORWARD)}, got {algo!r}")
    return fn(q, k, v, causal=causal, scale=scale, block_r=block_r, block_c=block_c,
              backend=backend, emu_order=emu_order, emu_seed=emu_seed, emu_workers=emu_workers,
              progress=progress, variant=variant)


def _fa1_grad(q, k, v, do, **kw):
    o, m, l = fa1_forward(q, k, v, **kw)
    return (o, *fa1_backward(q, k, v, o, m, l, do, **kw))


def _fa2_grad(q, k, v, do, **kw):
    o, lse = fa2_forward(q, k, v, **kw)
    return (o, *fa2_backward(q, k, v, o, lse, do, **kw))


# algo -> forward then backward, returning (o, dq, dk, dv).
_GRAD = {"fa1": _fa1_grad, "fa2": _fa2_grad}


def attention_grad(q, k, v, do, *, causal=False, scale=None, algo="fa2", block_r=None,
                   block_c=None, backend="auto", emu_order="forward", emu_seed=0, emu_workers=0,
                   progress=None, variant="auto"):
    """The forward and backward of attention(q, k, v, ...) for the incoming gradient do
    (like the output): returns (o, dq, dk, dv), o like q and the gradients like q, k, v.
    Arguments as in attention(); do is checked before any kernel runs; progress sees
    each of the two calls in turn."""
    fn = _GRAD.get(algo) if isinstance(algo, str) else None
    if fn is None:
        raise ValueError(f"algo: expected one of {sorted(_GRAD)}, got {algo!r}")
    q4, _, _, _ = check_qkv(q, k, v)
    check_like("do", do, q4)
    return fn(q, k, v, do, causal=causal, scale=scale, block_r=block_r, block_c=block_c,
              backend=backend, emu_order=emu_order, emu_seed=emu_seed, emu_workers=emu_workers,
              progress=progress, variant=variant)


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
