"""The additive bias and its gradient dBias (issue 27; docs/numerics.md §2): emu, cpu and
the simulator give the same bits, FA1 and FA2, forward and backward, over broadcast
shapes, masks, alignments and GQA, and under softcap (with ALiBi and dropout); -inf
entries (whole rows too) behave as a row with no visible key; the gradients match a
float64 NumPy reference (and, under softcap, torch's float64 autograd within twice its
fp32 error), and dBias matches finite differences of it."""

import functools

import numpy as np
import pytest

import pyfa
from pyfa.sim.mask import Mask

B, H, NQ, NK, D = 2, 2, 21, 19, 16
TILES = dict(block_r=8, block_c=8)
# The bias's shape, as the caller gives it: (Nq, Nk) is (1, 1, Nq, Nk).
BIAS_SHAPES = [(NQ, NK), (B, 1, NQ, NK), (1, H, 1, NK), (B, H, NQ, NK), (H, NQ, NK)]
# (causal, window, causal_align, Hkv)
CASES = [
    (False, None, "bottom_right", H),
    (True, None, "bottom_right", 1),
    (True, None, "top_left", H),
    (False, (5, 3), "top_left", 1),
]
pytestmark = pytest.mark.xdist_group("bias")


def same_bits(a, b):
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    na, nb = np.isnan(a), np.isnan(b)
    return a.shape == b.shape and bool(np.array_equal(na, nb) and
                                       np.array_equal(a.view(np.uint32)[~na], b.view(np.uint32)[~nb]))


def make_bias(shape, seed, neg_inf_rows=True):
    """A bias with -inf entries: scattered ones, and (where it has rows) one whole row."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(shape).astype(np.float32)
    bias[rng.random(shape) < 0.15] = -np.inf
    if neg_inf_rows and shape[-2] > 1:
        bias[..., 3, :] = -np.inf
    return bias


@functools.lru_cache(maxsize=None)
def problem(hkv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, NQ, D)).astype(np.float32)
    k = rng.standard_normal((B, hkv, NK, D)).astype(np.float32)
    v = rng.standard_normal((B, hkv, NK, D)).astype(np.float32)
    do = rng.standard_normal((B, H, NQ, D)).astype(np.float32)
    return q, k, v, do


def mask_kw(case):
    causal, window, align, _ = case
    return dict(causal=causal, window=window, causal_align=align)


@functools.lru_cache(maxsize=None)
def simulated(algo, shape, ci):
    """The simulator's forward and backward outputs of one case (shared by every backend)."""
    case = CASES[ci]
    q, k, v, do = problem(case[3])
    bias = make_bias(shape, ci)
    kw = dict(mask_kw(case), bias=bias, options=pyfa.Options(**TILES))
    if algo == "fa2":
        f = pyfa.sim.fa2_forward(q, k, v, **kw)
        g = pyfa.sim.fa2_backward(q, k, v, f.o, f.lse, do, **kw)
        fwd = (f.o, f.lse)
    else:
        f = pyfa.sim.fa1_forward(q, k, v, **kw)
        g = pyfa.sim.fa1_backward(q, k, v, f.o, f.m, f.l, do, **kw)
        fwd = (f.o, f.m, f.l)
    return bias, fwd, (g.dq, g.dk, g.dv, g.dbias)


RUNS = [dict(backend="emu", emu_order="forward"), dict(backend="emu", emu_order="reverse"),
        dict(backend="cpu", threads=1), dict(backend="cpu", threads=2), dict(backend="cpu", threads=3)]


@pytest.mark.parametrize("algo", ["fa2", "fa1"])
@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_backends_equal_simulator(algo, shape, ci):
    bias, fwd, grads = simulated(algo, shape, ci)
    case = CASES[ci]
    q, k, v, do = problem(case[3])
    assert grads[3].shape == shape
    # One backend per case (cycled), so that the grid stays cheap.
    run = RUNS[(BIAS_SHAPES.index(shape) + ci + (algo == "fa1")) % len(RUNS)]
    kw = dict(mask_kw(case), bias=bias, options=pyfa.Options(**TILES, **run))
    forward, backward = (pyfa.fa2_forward, pyfa.fa2_backward) if algo == "fa2" else (pyfa.fa1_forward,
                                                                                   pyfa.fa1_backward)
    out = forward(q, k, v, **kw)
    for name, a, b in zip(("o", "lse/m", "l"), out, fwd):
        assert same_bits(a, b), (name, run)
    got = backward(q, k, v, *fwd, do, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, grads):
        assert same_bits(a, b), (name, run)


def test_threads_and_orders_agree():
    """One case on every run: each thread count and emulator order, the same bits."""
    bias, fwd, grads = simulated("fa2", (1, H, 1, NK), 1)
    q, k, v, do = problem(CASES[1][3])
    for run in RUNS:
        kw = dict(mask_kw(CASES[1]), bias=bias, options=pyfa.Options(**TILES, **run))
        got = pyfa.fa2_backward(q, k, v, *fwd, do, **kw)
        assert all(same_bits(a, b) for a, b in zip(got, grads)), run


def test_backward_tiles_leave_dbias_alone():
    """dS of each (i, j) and the sum over i in order do not depend on the backward's tiles."""
    q, k, v, do = problem(H)
    for shape in [(NQ, NK), (1, H, 1, NK)]:
        bias = make_bias(shape, 7)
        o, lse = pyfa.fa2_forward(q, k, v, bias=bias, options=pyfa.Options(backend="cpu"))
        ref = None
        for tiles in [(8, 8), (16, 4), (32, 32)]:
            got = pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias,
                                    options=pyfa.Options(backend="cpu", block_r=tiles[0], block_c=tiles[1]))
            ref = got[3] if ref is None else ref
            assert same_bits(got[3], ref), (shape, tiles)


def test_bias_grad_false_leaves_out_dbias_only():
    """bias_grad=False: the backwards return dq, dk, dv only, with the bits of the call that
    also computes dbias; the split backward (which computes no dbias) then takes a bias, and
    gives its unsplit bits on one chunk. A forward, or a non-bool, is refused by name."""
    q, k, v, do = problem(1)
    bias = make_bias((B, 1, NQ, NK), 5)
    opts = pyfa.Options(backend="cpu", **TILES)
    o, lse = pyfa.fa2_forward(q, k, v, bias=bias, causal=True, options=opts)
    full = pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, causal=True, options=opts)
    assert len(full) == 4
    for split in (None, 32):
        kw = {} if split is None else dict(split_size=split)
        got = pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, bias_grad=False, causal=True, options=opts, **kw)
        assert len(got) == 3 and all(same_bits(a, b) for a, b in zip(got, full[:3])), split
    both = pyfa.attention_grad(q, k, v, do, bias=bias, bias_grad=False, causal=True, options=opts)
    assert len(both) == 4 and all(same_bits(a, b) for a, b in zip(both[1:], full[:3]))
    with pytest.raises(TypeError, match="unexpected keyword argument 'bias_grad'"):
        pyfa.fa2_forward(q, k, v, bias=bias, bias_grad=False, options=opts)
    with pytest.raises(TypeError, match="bias_grad: expected a bool, got int"):
        pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, bias_grad=0, options=opts)


def reference64(q, k, v, do, bias, case, softcap=None):
    """Attention with an additive bias (after softcap c tanh(s / c), if given) in float64,
    and its gradients, dBias reduced to the bias's shape: dBias of S, dQ and dK of s. A row
    with no visible key gets O = 0 and zero gradients."""
    causal, window, align, hkv = case
    g = q.shape[1] // hkv
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1 / np.sqrt(q.shape[-1])
    hidden = Mask.resolve(causal, window, align, q.shape[2], k.shape[2]).masked(
        np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None, :])
    s = scale * q @ np.swapaxes(k, -1, -2)
    slope = 1.0 if softcap is None else 1 - np.tanh(s / softcap) ** 2  # dS/ds
    S = (s if softcap is None else softcap * np.tanh(s / softcap)) + bias.astype(np.float64)
    S = np.where(hidden, -np.inf, S)
    m = S.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        E = np.where(np.isneginf(S), 0.0, np.exp(S - np.where(np.isneginf(m), 0.0, m)))
    den = E.sum(axis=-1, keepdims=True)
    P = np.divide(E, den, out=np.zeros_like(E), where=den > 0)
    o = P @ v
    dP = do @ np.swapaxes(v, -1, -2)
    dS = P * (dP - (do * o).sum(axis=-1, keepdims=True))  # of S
    dS_s = dS * slope
    dq = scale * dS_s @ k
    dk = (scale * np.swapaxes(dS_s, -1, -2) @ q).reshape(q.shape[0], hkv, g, k.shape[2], -1).sum(axis=2)
    dv = (np.swapaxes(P, -1, -2) @ do).reshape(q.shape[0], hkv, g, k.shape[2], -1).sum(axis=2)
    full = (1,) * (4 - bias.ndim) + bias.shape
    axes = tuple(a for a in range(3) if full[a] == 1 and dS.shape[a] > 1)
    dbias = dS.sum(axis=axes, keepdims=True).reshape(bias.shape)
    return o, (dq, dk, dv, dbias)


@pytest.mark.parametrize("shape", [(NQ, NK), (1, H, 1, NK), (B, H, NQ, NK)], ids=lambda s: "x".join(map(str, s)))
def test_float64_reference(shape):
    case = CASES[1]
    q, k, v, do = problem(case[3])
    bias = make_bias(shape, 3)
    o64, grads64 = reference64(q, k, v, do, bias, case)
    for algo in ("fa2", "fa1"):
        got = pyfa.attention_grad(q, k, v, do, bias=bias, algo=algo, options=pyfa.Options(backend="cpu"),
                                  **mask_kw(case))
        assert np.all(np.isfinite(got[0]))
        np.testing.assert_allclose(got[0], o64, atol=2e-5, rtol=1e-4)
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), got[1:], grads64):
            assert a.shape == b.shape, name
            np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4, err_msg=f"{algo} {name}")


def finite_difference_check(q, k, v, do, bias, case, **mods):
    """The float64 reference's dBias, checked against central differences of sum(O * dO)
    along every finite bias element."""
    _, (_, _, _, dbias) = reference64(q, k, v, do, bias, case, **mods)
    loss = lambda b: float((reference64(q, k, v, do, b, case, **mods)[0] * do).sum())
    eps = 1e-6
    for idx in np.ndindex(bias.shape):
        if not np.isfinite(bias[idx]):
            continue
        up, down = bias.copy(), bias.copy()
        up[idx] += eps
        down[idx] -= eps
        assert abs((loss(up) - loss(down)) / (2 * eps) - dbias[idx]) < 1e-6, idx
    return dbias


def test_dbias_finite_differences():
    """The float64 reference's dBias is the derivative of sum(O * dO) along the bias."""
    case = (True, None, "top_left", 1)
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal(s) for s in [(1, 2, 5, 4), (1, 1, 6, 4), (1, 1, 6, 4), (1, 2, 5, 4)])
    bias = rng.standard_normal((2, 1, 6))
    bias[0, 0, 2] = -np.inf
    dbias = finite_difference_check(q, k, v, do, bias, case)
    assert dbias[0, 0, 2] == 0


def test_rows_all_neg_inf_are_rows_with_no_key():
    """Row 3's keys are all -inf: O = 0, LSE = -inf (FA1: m = -inf, l = 0), zero gradients,
    and no NaN anywhere."""
    q, k, v, do = problem(H)
    bias = make_bias((B, H, NQ, NK), 11)
    opts = pyfa.Options(backend="cpu")
    o, lse = pyfa.fa2_forward(q, k, v, bias=bias, options=opts)
    assert np.all(o[:, :, 3] == 0) and np.all(lse[:, :, 3] == -np.inf)
    o1, m, l = pyfa.fa1_forward(q, k, v, bias=bias, options=opts)
    assert np.all(o1[:, :, 3] == 0) and np.all(m[:, :, 3] == -np.inf) and np.all(l[:, :, 3] == 0)
    dq, dk, dv, dbias = pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, options=opts)
    assert np.all(dq[:, :, 3] == 0) and np.all(dbias[:, :, 3] == 0)
    for x in (o, lse[np.isfinite(lse)], dq, dk, dv, dbias, o1):
        assert not np.any(np.isnan(x))


def test_fast_variants():
    """The fast kernels take the bias (the same bits as the readable ones); the fast dK/dV
    and FA1 backward kernels do not write dBias, so variant fast refuses it and auto runs
    the readable ones there."""
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 1, 64, 64)).astype(np.float32) for _ in range(4))
    bias = make_bias((64, 64), 4)
    ref = pyfa.Options(backend="emu", variant="reference", block_r=64, block_c=64)
    fast = pyfa.Options(backend="emu", variant="fast", block_r=64, block_c=64)
    o, lse = pyfa.fa2_forward(q, k, v, bias=bias, options=ref)
    o_f, lse_f = pyfa.fa2_forward(q, k, v, bias=bias, options=fast)
    assert same_bits(o, o_f) and same_bits(lse, lse_f)
    fa1 = [pyfa.fa1_forward(q, k, v, bias=bias, options=opts) for opts in (ref, fast)]
    assert all(same_bits(a, b) for a, b in zip(*fa1))
    wide = np.zeros((1, 1, 8, 128), np.float32)
    with pytest.raises(ValueError, match="fast fa1_forward at head_dim 128 takes no bias"):
        pyfa.fa1_forward(wide, wide, wide, bias=np.zeros((8, 8), np.float32), options=fast)
    with pytest.raises(ValueError, match="fast fa2_backward_dkdv at head_dim 64 takes no bias"):
        pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, options=fast)
    with pytest.raises(ValueError, match="fast fa1_backward at head_dim 64 takes no dbias output"):
        pyfa.fa1_backward(q, k, v, *fa1[0], do, bias=bias, options=fast)
    auto = pyfa.Options(backend="emu", variant="auto", block_r=64, block_c=64)
    got = pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, options=auto)
    want = pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, options=ref)
    assert all(same_bits(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("shape", [(150, 97), (2, 1, 150, 97), (1, 3, 1, 97), (3, 150, 97)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("d", [64, 128])
def test_fast_forward_bias_at_every_instantiation(d, shape):
    """The fast forwards add the bias from a row pointer of their own per tile
    (kernels/fast/forward_tiles.h, fast_scale_mask): at both head dims and row tiles
    (tails, a causal mask, GQA, a bias of one row whose row stride is 0), the simulator's
    bits. FA2's forward depends on Bc only, so one simulated run serves both Br."""
    rng = np.random.default_rng(d + len(shape))
    q = rng.standard_normal((2, 3, 150, d)).astype(np.float32)
    k, v = (rng.standard_normal((2, 1, 97, d)).astype(np.float32) for _ in range(2))
    bias = make_bias(shape, d)
    sim = pyfa.sim.fa2_forward(q, k, v, causal=True, bias=bias, block_r=64, block_c=64)
    for br in (64, 128):
        o, lse = pyfa.fa2_forward(q, k, v, causal=True, bias=bias,
                                  options=pyfa.Options(backend="emu", variant="fast", block_r=br, block_c=64))
        assert same_bits(o, sim.o) and same_bits(lse, sim.lse), br
    if d == 64:  # FA1's fast forward shares the bias step (it takes the bias at d = 64 only)
        fa1 = pyfa.sim.fa1_forward(q, k, v, causal=True, bias=bias, block_r=64, block_c=64)
        got = pyfa.fa1_forward(q, k, v, causal=True, bias=bias,
                               options=pyfa.Options(backend="emu", variant="fast", block_r=64, block_c=64))
        assert all(same_bits(a, b) for a, b in zip(got, (fa1.o, fa1.m, fa1.l)))


def test_argument_errors():
    q, k, v, do = problem(H)
    with pytest.raises(TypeError, match="bias: expected dtype float32, got bool"):
        pyfa.attention(q, k, v, bias=np.ones((NQ, NK), bool))
    with pytest.raises(TypeError, match="bias: expected dtype float32"):
        pyfa.attention(q, k, v, bias=np.ones((NQ, NK)))
    with pytest.raises(ValueError, match=r"bias: shape \(3, 21, 19\) does not broadcast"):
        pyfa.attention(q, k, v, bias=np.ones((3, NQ, NK), np.float32))
    with pytest.raises(ValueError, match="bias: shape"):
        pyfa.attention(q, k, v, bias=np.ones((NQ, 1), np.float32))
    with pytest.raises(ValueError, match="bias: shape"):
        pyfa.sim.fa2_forward(q, k, v, bias=np.ones((NQ, NK + 1), np.float32))
    bias = np.zeros((NQ, NK), np.float32)
    o, lse = pyfa.fa2_forward(q, k, v, bias=bias)
    with pytest.raises(ValueError, match=r"out \(dbias\): expected shape"):
        pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, out=(None, None, None, np.zeros((1, NQ, NK), np.float32)))
    with pytest.raises(ValueError, match=r"out \(dbias\): overlaps bias"):
        pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, out=(None, None, None, bias))
    # out= given: the caller's dbias is written only after success.
    mine = np.full((NQ, NK), 7, np.float32)
    got = pyfa.fa2_backward(q, k, v, o, lse, do, bias=bias, out=(None, None, None, mine))
    assert got[3] is mine and not np.any(mine == 7)


def test_broadcast_view_equals_its_array():
    """A bias given as a stride-0 broadcast view reads as the array it repeats; its dbias
    then has the view's shape, dS per element."""
    q, k, v, do = problem(H)
    small = make_bias((1, 1, 1, NK), 9, neg_inf_rows=False)
    view = np.broadcast_to(small, (B, H, NQ, NK))
    opts = pyfa.Options(backend="cpu")
    a = pyfa.attention_grad(q, k, v, do, bias=view, options=opts)
    b = pyfa.attention_grad(q, k, v, do, bias=np.ascontiguousarray(view), options=opts)
    assert all(same_bits(x, y) for x, y in zip(a, b))
    assert a[4].shape == (B, H, NQ, NK)


# ---- the C ABI: pyfa_run's tensors->bias, tensors->dbias and problem->bias_strides

def _abi_call(op, bias_strides=(0, 0, 0), dbias_shape=(B, H, NQ, NK), **override):
    """pyfa_run of `op` on the cpu backend with a (B, H, Nq, Nk) bias: (status, message,
    dbias, the arrays)."""
    from pyfa import _lib
    ffi, lib = _lib.load()
    q, k, v, do = problem(H)
    o, lse = pyfa.fa2_forward(q, k, v)
    bias = make_bias((B, H, NQ, NK), 1)
    dbias = np.full(dbias_shape, 5, np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    arrays = dict(q=q, k=k, v=v, o=o, lse=lse, dout=do, dq=dq, dk=dk, dv=dv, bias=bias, dbias=dbias)
    if op == "fa2_forward":
        arrays = dict(q=q, k=k, v=v, o=dq, lse=np.zeros_like(lse), bias=bias)
    arrays.update(override)
    p = ffi.new("pyfa_problem*")
    p.struct_size = ffi.sizeof("pyfa_problem")
    p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim = B, H, H, NQ, NK, D
    p.bias_strides.batch, p.bias_strides.head, p.bias_strides.row = bias_strides
    c = ffi.new("pyfa_config*")
    c.struct_size = ffi.sizeof("pyfa_config")
    c.backend = lib.PYFA_BACKEND_CPU
    t = ffi.new("pyfa_tensors*")
    t.struct_size = ffi.sizeof("pyfa_tensors")
    for name, a in arrays.items():
        if isinstance(a, tuple):
            a, strides = a
            getattr(t, name).strides.batch, getattr(t, name).strides.head, getattr(t, name).strides.row = strides
        if a is not None:
            getattr(t, name).data = ffi.cast("void*", ffi.from_buffer(a))
    op_id = {"fa2_forward": 0, "fa2_backward": 1}[op]
    st = lib.pyfa_run(op_id, p, c, t, ffi.NULL)
    return st, ffi.string(lib.pyfa_last_error()).decode(), dbias, arrays


def test_c_abi_bias():
    dense = (H * NQ * NK, NQ * NK, NK)
    st, msg, dbias, a = _abi_call("fa2_backward", dense)
    assert st == 0, msg
    want = pyfa.sim.fa2_backward(a["q"], a["k"], a["v"], a["o"], a["lse"], a["dout"], bias=a["bias"]).dbias
    assert same_bits(dbias, want)
    # Row stride 0: the bias's first row for every i, and dbias the sum over i.
    st, msg, dbias, a = _abi_call("fa2_backward", (H * NQ * NK, NQ * NK, 0), (B, H, 1, NK))
    assert st == 0, msg
    row = np.ascontiguousarray(a["bias"][:, :, :1])
    want = pyfa.sim.fa2_backward(a["q"], a["k"], a["v"], a["o"], a["lse"], a["dout"], bias=row).dbias
    assert same_bits(dbias, want)
    # Batch and head strides 0: dbias is (1, 1, Nq, Nk), folded over B and H in the library.
    st, msg, dbias, a = _abi_call("fa2_backward", (0, 0, NK), (1, 1, NQ, NK))
    assert st == 0, msg
    shared = np.ascontiguousarray(a["bias"][:1, :1])
    want = pyfa.sim.fa2_backward(a["q"], a["k"], a["v"], a["o"], a["lse"], a["dout"], bias=shared).dbias
    assert same_bits(dbias, want)


@pytest.mark.parametrize("op, strides, override, message", [
    ("fa2_backward", (-1, 0, 0), {}, "problem->bias_strides.batch: must be >= 0"),
    ("fa2_backward", (0, 0, 0), {"bias": (make_bias((B, H, NQ, NK), 1), (1, 1, 1))},
     "tensors->bias.strides: must be 0"),
    ("fa2_backward", (0, 0, 0), {"bias": None}, "tensors->dbias: given without tensors->bias"),
    ("fa2_forward", (0, 0, 0), {"dbias": np.zeros((B, H, NQ, NK), np.float32)},
     "tensors->dbias: given, but pyfa_fa2_forward does not take it"),
    ("fa2_backward", (0, 0, 2**62), {}, "problem->bias_strides: bias or dbias spans more than"),
])
def test_c_abi_bias_refusals(op, strides, override, message):
    st, msg, dbias, _ = _abi_call(op, strides, **override)
    assert st == 1 and message in msg, msg
    assert np.all(dbias == 5)


def test_c_abi_dbias_overlap():
    """dbias must share no byte with another tensor of the call; nothing is written."""
    q, k, v, do = problem(H)
    st, msg, _, a = _abi_call("fa2_backward", (0, 0, NK), dbias=q)
    assert st == 1 and "dbias and q: dbias overlaps" in msg, msg
    assert np.array_equal(q, problem(H)[0])


# ---- under softcap: dBias is dS of S (the score the bias is added to), dQ and dK of s

SOFTCAP = 1.5  # |s / c| reaches the tanh's non-linear range (and beyond its polynomial branch)
# (bias shape, CASES index, further modifications): broadcast biases, masks, alignments,
# GQA (CASES 1 and 3), ALiBi and dropout, each with softcap.
SOFTCAP_CASES = [
    ((1, H, NQ, NK), 1, {}),
    ((B, 1, 1, NK), 3, dict(alibi_slopes=np.array([0.5, 0.25], np.float32))),
    ((NQ, NK), 2, dict(dropout_p=0.25, seed=77)),
    ((B, H, NQ, NK), 0, dict(alibi_slopes=np.array([[0.3, 0.1], [0.2, 0.4]], np.float32), dropout_p=0.2, seed=5)),
    ((NQ, NK), 1, dict(alibi_slopes=np.array([0.5, 0.125], np.float32), dropout_p=0.1, seed=3)),
]


def softcap_inputs(hkv):
    # Scores of a few units, so that softcap's derivative 1 - tanh^2 ranges over (0, 1].
    q, k, v, do = problem(hkv, seed=4)
    return q * np.float32(2), k * np.float32(2), v, do


@pytest.mark.parametrize("algo", ["fa2", "fa1"])
@pytest.mark.parametrize("si", range(len(SOFTCAP_CASES)))
def test_softcap_backends_equal_simulator(algo, si):
    """dBias, dQ, dK, dV with a bias under softcap: every run (emulator orders, cpu thread
    counts) gives the simulator's bits."""
    shape, ci, extra = SOFTCAP_CASES[si]
    case = CASES[ci]
    q, k, v, do = softcap_inputs(case[3])
    bias = make_bias(shape, 20 + si)
    kw = dict(mask_kw(case), bias=bias, softcap=SOFTCAP, **extra)
    tiles = pyfa.Options(**TILES)
    if algo == "fa2":
        f = pyfa.sim.fa2_forward(q, k, v, options=tiles, **kw)
        fwd = (f.o, f.lse)
        g = pyfa.sim.fa2_backward(q, k, v, *fwd, do, options=tiles, **kw)
        backward = pyfa.fa2_backward
    else:
        f = pyfa.sim.fa1_forward(q, k, v, options=tiles, **kw)
        fwd = (f.o, f.m, f.l)
        g = pyfa.sim.fa1_backward(q, k, v, *fwd, do, options=tiles, **kw)
        backward = pyfa.fa1_backward
    want = (g.dq, g.dk, g.dv, g.dbias)
    assert g.dbias.shape == shape and np.any(g.dbias != 0)
    # dBias is not the sum of dQ's dS_s: without softcap's derivative it differs.
    plain = dict(kw, softcap=None)
    assert not same_bits(backward(q, k, v, *fwd, do, options=pyfa.Options(backend="cpu", **TILES), **plain)[3],
                         g.dbias)
    # The emulator's first order under strict access checks: dS_ij is rewritten in place
    # between barriers (score.h score_mod_grad_tile).
    runs = [dict(RUNS[0], emu_check="strict")] + RUNS[1:]
    for run in runs:
        got = backward(q, k, v, *fwd, do, options=pyfa.Options(**TILES, **run), **kw)
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
            assert same_bits(a, b), (name, run)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "avx512_wide"])
def test_softcap_every_cpu_isa_equals_simulator(isa, monkeypatch):
    """The cpu backend's instruction-set builds (PYFA_CPU_ISA) give the simulator's bits
    for dBias, dQ, dK, dV under softcap, ALiBi and dropout; a build this CPU cannot run
    is skipped, naming it."""
    shape, ci, extra = SOFTCAP_CASES[3]
    case = CASES[ci]
    q, k, v, do = softcap_inputs(case[3])
    bias = make_bias(shape, 23)
    kw = dict(mask_kw(case), bias=bias, softcap=SOFTCAP, **extra)
    f = pyfa.sim.fa2_forward(q, k, v, options=pyfa.Options(**TILES), **kw)
    want = pyfa.sim.fa2_backward(q, k, v, f.o, f.lse, do, options=pyfa.Options(**TILES), **kw)
    f1 = pyfa.sim.fa1_forward(q, k, v, options=pyfa.Options(**TILES), **kw)
    want1 = pyfa.sim.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do, options=pyfa.Options(**TILES), **kw)
    monkeypatch.setenv("PYFA_CPU_ISA", isa)
    options = pyfa.Options(backend="cpu", threads=2, **TILES)
    try:
        got = pyfa.fa2_backward(q, k, v, f.o, f.lse, do, options=options, **kw)
    except pyfa.BackendUnavailableError as e:
        pytest.skip(f"this CPU cannot run the {isa} build: {e}")
    got1 = pyfa.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do, options=options, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dbias") * 2, tuple(got) + tuple(got1),
                          (want.dq, want.dk, want.dv, want.dbias, want1.dq, want1.dk, want1.dv, want1.dbias)):
        assert same_bits(a, b), (isa, name)


def test_softcap_backward_tiles_and_threads_leave_dbias_alone():
    """Under softcap too, dBias does not depend on the backward's tiles or its threads."""
    q, k, v, do = softcap_inputs(1)
    bias = make_bias((1, H, 1, NK), 8)
    kw = dict(causal=True, bias=bias, softcap=SOFTCAP)
    o, lse = pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu"), **kw)
    ref = None
    for tiles, threads in [((8, 8), 1), ((16, 4), 2), ((32, 32), 3), ((4, 16), 2)]:
        got = pyfa.fa2_backward(q, k, v, o, lse, do, options=pyfa.Options(
            backend="cpu", threads=threads, block_r=tiles[0], block_c=tiles[1]), **kw)
        ref = got[3] if ref is None else ref
        assert same_bits(got[3], ref), tiles


@pytest.mark.parametrize("shape", [(NQ, NK), (1, H, NQ, NK), (B, 1, 1, NK)], ids=lambda s: "x".join(map(str, s)))
def test_softcap_float64_reference(shape):
    case = CASES[3]  # a window, top-left, GQA
    q, k, v, do = softcap_inputs(case[3])
    bias = make_bias(shape, 13)
    o64, grads64 = reference64(q, k, v, do, bias, case, softcap=SOFTCAP)
    for algo in ("fa2", "fa1"):
        got = pyfa.attention_grad(q, k, v, do, bias=bias, softcap=SOFTCAP, algo=algo,
                                  options=pyfa.Options(backend="cpu"), **mask_kw(case))
        np.testing.assert_allclose(got[0], o64, atol=2e-5, rtol=1e-4)
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), got[1:], grads64):
            assert a.shape == b.shape, name
            np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4, err_msg=f"{algo} {name}")


def test_softcap_dbias_finite_differences():
    """The float64 reference's dBias under softcap is the derivative of sum(O * dO) along
    the bias, and pyfa's (FA1 and FA2) is the reference's."""
    case = (True, (3, 1), "top_left", 1)
    rng = np.random.default_rng(6)
    q, k, v, do = (rng.standard_normal(s) for s in [(1, 2, 5, 4), (1, 1, 6, 4), (1, 1, 6, 4), (1, 2, 5, 4)])
    q, k = 3 * q, 3 * k
    bias = rng.standard_normal((2, 5, 6))
    bias[1, 3, 2] = -np.inf
    c = 1.25
    dbias = finite_difference_check(q, k, v, do, bias, case, softcap=c)
    assert dbias[1, 3, 2] == 0
    f32 = [x.astype(np.float32) for x in (q, k, v, do, bias)]
    for algo in ("fa2", "fa1"):
        got = pyfa.attention_grad(*f32[:4], bias=f32[4], softcap=c, algo=algo, options=pyfa.Options(backend="cpu"),
                                  **mask_kw(case))[4]
        np.testing.assert_allclose(got, dbias, atol=2e-6, rtol=1e-5, err_msg=algo)


def test_softcap_against_torch_float64():
    """dQ, dK, dV and dBias under softcap (and a broadcast bias, a causal mask, GQA) within
    twice PyTorch fp32's error of torch's float64 autograd through the explicit formula."""
    torch = pytest.importorskip("torch")
    case = CASES[1]
    q, k, v, do = softcap_inputs(case[3])
    c = SOFTCAP
    hidden = torch.from_numpy(Mask.resolve(True, None, "bottom_right", NQ, NK).masked(
        np.arange(NQ)[:, None], np.arange(NK)[None, :]))
    for shape in [(NQ, NK), (B, 1, 1, NK), (1, H, NQ, NK)]:
        bias = make_bias(shape, 31)

        def torch_grads(dtype):
            t = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v, bias)]
            kr, vr = (x.repeat_interleave(H // case[3], 1) for x in t[1:3])
            S = c * torch.tanh(t[0] @ kr.transpose(-1, -2) / np.sqrt(D) / c) + t[3]
            S = S.masked_fill(hidden, -float("inf"))
            # A softmax whose rows with no visible key (the causal mask's first rows, and
            # make_bias's row 3, all -inf) give P = 0 and no NaN, as pyfa's.
            m = S.detach().amax(-1, keepdim=True)
            E = torch.exp(S - torch.where(torch.isinf(m), torch.zeros_like(m), m))
            den = E.sum(-1, keepdim=True)
            P = E / torch.where(den > 0, den, torch.ones_like(den))
            ((P @ vr) * torch.tensor(do, dtype=dtype)).sum().backward()
            return [x.grad.numpy().astype(np.float64) for x in t]

        exact, f32 = torch_grads(torch.float64), torch_grads(torch.float32)
        for algo in ("fa2", "fa1"):
            got = pyfa.attention_grad(q, k, v, do, bias=bias, softcap=c, algo=algo, options=pyfa.Options(backend="cpu"),
                                      **mask_kw(case))[1:]
            for name, a, p, e in zip(("dq", "dk", "dv", "dbias"), got, f32, exact):
                err, ref = np.linalg.norm(a - e), np.linalg.norm(p - e)
                bound = 2.5 if name == "dv" else 2  # dv: as in test_score_mods' accuracy test
                assert err <= bound * ref, (shape, algo, name, err, ref)
