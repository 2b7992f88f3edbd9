"""pyfa's Python API on NumPy buffers: argument checks, then one call into libpyfa.

Outputs are always fresh arrays; inputs of any strides are accepted (copied to
C-contiguous float32 when needed) and never written.
"""

import numpy as np

from . import _lib
from .sim.inputs import check_like, check_qkv, check_rows, check_tile, resolve_scale, restore_rank

BACKENDS = {"auto": 0, "cuda": 1, "emu": 2, "cpu": 3}
EMU_ORDERS = {"forward": 0, "reverse": 1, "shuffled": 2}
KERNELS = {"fa1_forward": 0, "fa2_forward": 1, "fa1_backward": 2,
           "fa2_backward_preprocess": 3, "fa2_backward_dkdv": 4, "fa2_backward_dq": 5}


def _choice(name, value, table):
    if not isinstance(value, str) or value not in table:
        raise ValueError(f"{name}: expected one of {sorted(table)}, got {value!r}")
    return table[value]


def _check_causal(causal):
    if not isinstance(causal, (bool, np.bool_)) and causal not in (0, 1):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    return bool(causal)


def _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, threads=0):
    ffi, _ = _lib.load()
    cfg = ffi.new("pyfa_config *")
    cfg.backend = _choice("backend", backend, BACKENDS)
    cfg.block_r = check_tile("block_r", block_r) or 0
    cfg.block_c = check_tile("block_c", block_c) or 0
    cfg.emu_order = _choice("emu_order", emu_order, EMU_ORDERS)
    if isinstance(emu_seed, bool) or not isinstance(emu_seed, (int, np.integer)) or not 0 <= emu_seed < 2**64:
        raise ValueError(f"emu_seed: expected an int in [0, 2**64), got {emu_seed!r}")
    cfg.emu_seed = int(emu_seed)
    if isinstance(emu_workers, bool) or not isinstance(emu_workers, (int, np.integer)) or emu_workers < 0:
        raise ValueError(f"emu_workers: expected an int >= 0, got {emu_workers!r}")
    cfg.emu_workers = int(emu_workers)
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 0 <= threads < 2**31:
        raise ValueError(f"threads: expected an int >= 0 (0: one per core), got {threads!r}")
    cfg.threads = int(threads)
    return cfg


def _problem(q4, k4, scale, causal):
    ffi, _ = _lib.load()
    pr = ffi.new("pyfa_problem *")
    pr.batch, pr.heads, pr.seqlen_q, pr.head_dim = q4.shape
    pr.seqlen_k = k4.shape[2]
    pr.scale = float(resolve_scale(scale, q4.shape[3]))
    pr.causal = 1 if _check_causal(causal) else 0
    return pr


def _ptr(x):
    ffi, _ = _lib.load()
    return ffi.cast("float *", ffi.from_buffer(x))


def _run(fn_name, problem, config, inputs, outputs):
    _, lib = _lib.load()
    fn = getattr(lib, fn_name)
    _lib.check(fn(problem, config, *[_ptr(x) for x in inputs], *[_ptr(x) for x in outputs]))


def fa2_forward(q, k, v, *, causal=False, scale=None, block_r=None, block_c=None,
                backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, threads=0):
    """FlashAttention-2 forward. Returns (o, lse): o like q, lse (log-sum-exp of each
    query row's scaled scores, -inf for a row with no visible key) q's shape without d."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    problem = _problem(q4, k4, scale, causal)
    config = _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, threads)
    o = np.empty_like(q4)
    lse = np.empty(q4.shape[:3], np.float32)
    _run("pyfa_fa2_forward", problem, config, (q4, k4, v4), (o, lse))
    return restore_rank(o, rank), lse.reshape(q4.shape[4 - rank:3])


def fa2_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_r=None, block_c=None,
                 backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, threads=0):
    """FlashAttention-2 backward from the forward's saved o and lse (fa2_forward) and the
    incoming gradient do (like o). Returns (dq, dk, dv), shaped like q, k, v. causal and
    scale must be the forward's. Deterministic: the same inputs give the same bits."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    o4 = check_like("o", o, q4)
    do4 = check_like("do", do, q4)
    lse3 = check_rows("lse", lse, q4)
    problem = _problem(q4, k4, scale, causal)
    config = _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, threads)
    dq = np.empty_like(q4)
    dk = np.empty_like(k4)
    dv = np.empty_like(v4)
    _run("pyfa_fa2_backward", problem, config, (q4, k4, v4, o4, lse3, do4), (dq, dk, dv))
    return restore_rank(dq, rank), restore_rank(dk, rank), restore_rank(dv, rank)


def fa1_forward(q, k, v, *, causal=False, scale=None, block_r=None, block_c=None,
                backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, threads=0):
    """FlashAttention-1 forward (the paper's Algorithm 1 as written). Returns (o, m, l):
    o like q; m (row max of the scaled scores) and l (sum of exp(score - m)) q's shape
    without d, as the paper keeps them for the backward; a row with no visible key gets
    o = 0, m = -inf, l = 0."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    problem = _problem(q4, k4, scale, causal)
    config = _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, threads)
    o = np.empty_like(q4)
    m = np.empty(q4.shape[:3], np.float32)
    l = np.empty(q4.shape[:3], np.float32)
    _run("pyfa_fa1_forward", problem, config, (q4, k4, v4), (o, m, l))
    rows = q4.shape[4 - rank:3]
    return restore_rank(o, rank), m.reshape(rows), l.reshape(rows)


def fa1_backward(q, k, v, o, m, l, do, *, causal=False, scale=None, block_r=None, block_c=None,
                 backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, threads=0):
    """FlashAttention-1 backward (the paper's Algorithm 4) from the forward's saved o, m, l
    (fa1_forward) and the incoming gradient do (like o). Returns (dq, dk, dv), shaped like
    q, k, v. causal and scale must be the forward's. Deterministic: no atomics."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    o4 = check_like("o", o, q4)
    do4 = check_like("do", do, q4)
    m3 = check_rows("m", m, q4)
    l3 = check_rows("l", l, q4)
    problem = _problem(q4, k4, scale, causal)
    config = _config(backend, block_r, block_c, emu_order, emu_seed, emu_workers, threads)
    dq = np.empty_like(q4)
    dk = np.empty_like(k4)
    dv = np.empty_like(v4)
    _run("pyfa_fa1_backward", problem, config, (q4, k4, v4, o4, m3, l3, do4), (dq, dk, dv))
    return restore_rank(dq, rank), restore_rank(dk, rank), restore_rank(dv, rank)


# algo -> the forward pass returning O alone.
_FORWARD = {"fa1": lambda *a, **kw: fa1_forward(*a, **kw)[0],
            "fa2": lambda *a, **kw: fa2_forward(*a, **kw)[0]}


def attention(q, k, v, *, causal=False, scale=None, algo="fa2", block_r=None, block_c=None,
              backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, threads=0):
    """O = softmax(scale * Q K^T [causal mask]) V by FlashAttention.

    q: (B, H, Nq, d), (H, Nq, d) or (Nq, d) float32; k, v: the same with Nk rows.
    algo: "fa1" or "fa2"; backend: "auto" (CUDA when a GPU is usable, else "cpu"),
    "cuda", "cpu" (native, vectorised, the same bits) or "emu" (the kernel source run by
    the emulator); block_r, block_c: tiles Br, Bc (None: the default); threads: OS
    threads of the cpu backend (0: one per core; the results never depend on it)."""
    fn = _FORWARD.get(algo) if isinstance(algo, str) else None
    if fn is None:
        raise ValueError(f"algo: expected one of {sorted(_FORWARD)}, got {algo!r}")
    return fn(q, k, v, causal=causal, scale=scale, block_r=block_r, block_c=block_c,
              backend=backend, emu_order=emu_order, emu_seed=emu_seed, emu_workers=emu_workers,
              threads=threads)


def _fa1_grad(q, k, v, do, **kw):
    o, m, l = fa1_forward(q, k, v, **kw)
    return (o, *fa1_backward(q, k, v, o, m, l, do, **kw))


def _fa2_grad(q, k, v, do, **kw):
    o, lse = fa2_forward(q, k, v, **kw)
    return (o, *fa2_backward(q, k, v, o, lse, do, **kw))


# algo -> forward then backward, returning (o, dq, dk, dv).
_GRAD = {"fa1": _fa1_grad, "fa2": _fa2_grad}


def attention_grad(q, k, v, do, *, causal=False, scale=None, algo="fa2", block_r=None,
                   block_c=None, backend="auto", emu_order="forward", emu_seed=0, emu_workers=0, threads=0):
    """The forward and backward of attention(q, k, v, ...) for the incoming gradient do
    (like the output): returns (o, dq, dk, dv), o like q and the gradients like q, k, v.
    Arguments as in attention(); do is checked before any kernel runs."""
    fn = _GRAD.get(algo) if isinstance(algo, str) else None
    if fn is None:
        raise ValueError(f"algo: expected one of {sorted(_GRAD)}, got {algo!r}")
    q4, _, _, _ = check_qkv(q, k, v)
    check_like("do", do, q4)
    return fn(q, k, v, do, causal=causal, scale=scale, block_r=block_r, block_c=block_c,
              backend=backend, emu_order=emu_order, emu_seed=emu_seed, emu_workers=emu_workers,
              threads=threads)


def backends():
    """The backends that can run here, best first ("cuda" only with a usable GPU)."""
    _, lib = _lib.load()
    return [name for name in ("cuda", "cpu", "emu") if lib.pyfa_backend_available(BACKENDS[name])]


def device_profile(backend="auto"):
    """The limits the kernels are sized against: a dict with name, smem_per_block,
    max_threads_per_block, sm_count."""
    ffi, lib = _lib.load()
    prof = ffi.new("pyfa_device_profile *")
    _lib.check(lib.pyfa_device_profile_get(_choice("backend", backend, BACKENDS), prof))
    return {"name": ffi.string(prof.name).decode(), "smem_per_block": prof.smem_per_block,
            "max_threads_per_block": prof.max_threads_per_block, "sm_count": prof.sm_count}


def default_tiles(kernel, head_dim, backend="auto"):
    """(Br, Bc) the library uses for `kernel` (e.g. "fa2_forward") at this head dim."""
    ffi, lib = _lib.load()
    br, bc = ffi.new("int *"), ffi.new("int *")
    _lib.check(lib.pyfa_default_tiles(_choice("kernel", kernel, KERNELS), int(head_dim),
                                      _choice("backend", backend, BACKENDS), br, bc))
    return br[0], bc[0]


def smem_bytes(kernel, block_r, block_c, head_dim):
    """Bytes of dynamic shared memory `kernel` needs for these tiles (0: unknown)."""
    _, lib = _lib.load()
    return lib.pyfa_smem_bytes(_choice("kernel", kernel, KERNELS), block_r, block_c, head_dim)


def library_version():
    ffi, lib = _lib.load()
    return ffi.string(lib.pyfa_version()).decode()
