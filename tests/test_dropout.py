"""Reproducible dropout (docs/numerics.md, "Dropout"): Philox4x32-10 against Random123's
known answers; the keep mask a pure function of (seed, offset, b, h, i, j), the library's
(C) equal to the simulator's (NumPy) bit for bit, its keep rate within a binomial 5-sigma
band; every kernel's results with dropout equal across backends, tiles, threads, emulator
orders, variants, FA1 and FA2, forward and backward, under masks and GQA; the gradients
those of a float64 reference that applies the returned mask explicitly; LSE and the IO
counts those of the same call without dropout."""

import functools

import numpy as np
import pytest

import pyfa
import pyfa.sim
from conftest import HAS_CUDA
from pyfa.sim.dropout import Dropout, philox4x32_10
from reference import make_inputs, mask_matrix, same_bits

# The simulator's results are shared by every backend and variant of a case.
pytestmark = pytest.mark.xdist_group("dropout")

# Random123's kat_vectors for philox4x32_10: (key, counter, output), as published.
PHILOX_KAT = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000, 0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("key, ctr, want", PHILOX_KAT)
def test_philox_known_answers(key, ctr, want):
    got = philox4x32_10(key, ctr)
    assert tuple(int(w) for w in got) == want


def test_philox_vectorized_equals_scalar():
    ctr = [np.array([0, 1, 0xFFFFFFFF], np.uint32), 7, np.array([3, 0, 0x80000000], np.uint32), 9]
    words = philox4x32_10((11, 12), ctr)
    for n in range(3):
        one = philox4x32_10((11, 12), (int(ctr[0][n]), 7, int(ctr[2][n]), 9))
        assert [int(w[n]) for w in words] == [int(w) for w in one]


def test_mask_follows_the_documented_mapping():
    """Z[b, h, i, j] = w[j % 4] >= ceil(p 2^32), w = Philox(key(seed, offset), (j // 4, i, h, b)),
    key = words 0, 1 of Philox((seed_lo, seed_hi), (offset_lo, offset_hi, 0, 0))."""
    p, seed, offset = 0.375, 0x0123456789ABCDEF, (5 << 32) + 3
    mask = pyfa.dropout_mask(2, 3, 5, 11, dropout_p=p, seed=seed, offset=offset)
    k = philox4x32_10((seed & 0xFFFFFFFF, seed >> 32), (offset & 0xFFFFFFFF, offset >> 32, 0, 0))
    threshold = int(np.ceil(p * 2.0 ** 32))
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 10), (1, 0, 3, 7), (0, 1, 2, 5)]:
        w = philox4x32_10((int(k[0]), int(k[1])), (j // 4, i, h, b))
        assert mask[b, h, i, j] == (int(w[j % 4]) >= threshold)


MASK_CASES = [  # (dropout_p, seed, offset)
    (0.1, 0, 0), (0.5, 1, 0), (0.9, 2 ** 64 - 1, 2 ** 64 - 1), (0.25, 2 ** 32, 2 ** 32),
    (1e-30, 7, 3), (np.nextafter(np.float32(1), np.float32(0)), 123, 456),
]


@pytest.mark.parametrize("p, seed, offset", MASK_CASES)
def test_library_mask_equals_simulator_mask(p, seed, offset):
    shape = (2, 3, 17, 45)
    lib = pyfa.dropout_mask(*shape, dropout_p=float(p), seed=seed, offset=offset)
    sim = pyfa.sim.dropout_mask(*shape, dropout_p=float(p), seed=seed, offset=offset)
    assert lib.dtype == np.bool_ and lib.shape == shape
    assert np.array_equal(lib, sim)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_five_sigma(p):
    B, H, Nq, Nk = 2, 4, 128, 256
    keep = pyfa.dropout_mask(B, H, Nq, Nk, dropout_p=p, seed=2026, offset=1)
    q = 1 - np.ceil(np.float32(p) * 2.0 ** 32) / 2.0 ** 32  # the exact keep probability
    # Over the whole grid, and over each of the four words of a Philox block (j % 4).
    for part in [keep] + [keep[..., w::4] for w in range(4)]:
        n = part.size
        assert abs(part.mean() - q) <= 5 * np.sqrt(q * (1 - q) / n)


def test_threshold_and_rescale():
    d = Dropout.make(np.float32(0.1), 1, 2)
    assert d.threshold == int(np.ceil(float(np.float32(0.1)) * 2.0 ** 32))
    assert d.rescale == np.float32(1.0 / (1.0 - float(np.float32(0.1))))
    assert Dropout.make(np.float32(1e-40), 1, 2).threshold == 1  # any p > 0 drops something
    assert not Dropout.make(np.float32(0), 1, 2).on()


def test_same_seed_and_offset_same_bits_different_ones_differ():
    shape = (1, 2, 33, 64)
    a = pyfa.dropout_mask(*shape, dropout_p=0.5, seed=9, offset=4)
    assert np.array_equal(a, pyfa.dropout_mask(*shape, dropout_p=0.5, seed=9, offset=4))
    others = [dict(seed=9, offset=5), dict(seed=10, offset=4), dict(seed=9 + 2 ** 32, offset=4),
              dict(seed=9, offset=4 + 2 ** 32)]
    for o in others:
        b = pyfa.dropout_mask(*shape, dropout_p=0.5, **o)
        assert 0.4 < np.mean(a != b) < 0.6, o  # unrelated masks, not shifts of each other
    # The mask of offset + 1 is no shift of offset's along the keys (the key is derived).
    c = pyfa.dropout_mask(*shape, dropout_p=0.5, seed=9, offset=5)
    assert not any(np.array_equal(a[..., s:], c[..., :-s]) for s in (1, 4, 8))


# ---- kernels: bit-identity across backends, tiles, threads, orders and variants ----

P_DROP = 0.3
DROP = dict(dropout_p=P_DROP, seed=0xC0FFEE, offset=11)
# (name, B, H, Hkv, Nq, Nk, d, causal, window, causal_align)
CASES = {
    "dense": (2, 2, 2, 37, 29, 16, False, None, "bottom_right"),
    "causal_gqa": (1, 4, 2, 29, 41, 16, True, None, "bottom_right"),
    "window_top_left": (1, 2, 1, 33, 33, 8, False, (7, 3), "top_left"),
}
TILES = [(16, 8), (7, 5)]


@functools.lru_cache(maxsize=None)
def inputs(case):
    B, H, Hkv, Nq, Nk, d, *_ = CASES[case]
    q, k, v, do = make_inputs((B, H, Nq, d), (B, Hkv, Nk, d), 27, 1)
    return q, k, v, do


def mask_kw(case):
    *_, causal, window, align = CASES[case]
    return dict(causal=causal, window=window, causal_align=align)


@functools.lru_cache(maxsize=None)
def simulated(case, algo, tiles):
    """The simulator's forward and backward with dropout: (forward outputs, gradients)."""
    q, k, v, do = inputs(case)
    opt = pyfa.Options(block_r=tiles[0], block_c=tiles[1])
    kw = dict(mask_kw(case), options=opt, **DROP)
    if algo == "fa2":
        f = pyfa.sim.fa2_forward(q, k, v, **kw)
        g = pyfa.sim.fa2_backward(q, k, v, f.o, f.lse, do, **kw)
        return (f.o, f.lse), (g.dq, g.dk, g.dv), f.io, g.io
    f = pyfa.sim.fa1_forward(q, k, v, **kw)
    g = pyfa.sim.fa1_backward(q, k, v, f.o, f.m, f.l, do, **kw)
    return (f.o, f.m, f.l), (g.dq, g.dk, g.dv), f.io, g.io


def run_library(case, algo, opt):
    q, k, v, do = inputs(case)
    kw = dict(mask_kw(case), options=opt, **DROP)
    if algo == "fa2":
        fwd = pyfa.fa2_forward(q, k, v, **kw)
        return fwd, pyfa.fa2_backward(q, k, v, *fwd, do, **kw)
    fwd = pyfa.fa1_forward(q, k, v, **kw)
    return fwd, pyfa.fa1_backward(q, k, v, *fwd, do, **kw)


RUNS = [  # (backend, Options extras)
    ("emu", dict(variant="reference")),
    ("emu", dict(variant="reference", emu_order="reverse")),
    ("cpu", dict(threads=1)),
    ("cpu", dict(threads=2)),
    ("cpu", dict(threads=3)),
    pytest.param("cuda", dict(variant="reference"),
                 marks=pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here")),
]


@pytest.mark.parametrize("backend, extra", RUNS)
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("algo", ["fa2", "fa1"])
@pytest.mark.parametrize("case", list(CASES))
def test_results_equal_the_simulator(case, algo, tiles, backend, extra):
    fwd_sim, grad_sim, _, _ = simulated(case, algo, tiles)
    opt = pyfa.Options(backend=backend, block_r=tiles[0], block_c=tiles[1], **extra)
    fwd, grad = run_library(case, algo, opt)
    for got, want in zip(fwd + grad, fwd_sim + grad_sim):
        assert same_bits(got, want)


FAST_BACKENDS = ["emu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here"))]


@functools.lru_cache(maxsize=None)
def fast_inputs(d):
    return make_inputs((1, 2, 70, d), (1, 1, 50, d), 5, 1)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("algo", ["fa2", "fa1"])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_kernels_equal_the_reference(causal, algo, d, backend):
    """variant auto (the register-tiled kernels that draw dropout at this head dim, the
    readable ones for the rest: src/common/fast_takes.h) gives the readable
    kernels' bits, GQA and a dropout origin included."""
    q, k, v, do = fast_inputs(d)
    drop = dict(DROP, dropout_origin=(2, 1, 5, 3))
    fwd_fn, bwd_fn = (pyfa.fa2_forward, pyfa.fa2_backward) if algo == "fa2" else (pyfa.fa1_forward,
                                                                                  pyfa.fa1_backward)
    ref = pyfa.Options(backend="emu", variant="reference")
    fwd = fwd_fn(q, k, v, causal=causal, options=ref, **drop)
    grad = bwd_fn(q, k, v, *fwd, do, causal=causal, options=ref, **drop)
    opt = pyfa.Options(backend=backend, variant="auto")
    fwd_f = fwd_fn(q, k, v, causal=causal, options=opt, **drop)
    grad_f = bwd_fn(q, k, v, *fwd, do, causal=causal, options=opt, **drop)
    for got, want in zip(fwd_f + grad_f, fwd + grad):
        assert same_bits(got, want)


def test_fast_variant_runs_dropout_where_its_kernel_draws_it():
    q, k, v, _ = fast_inputs(64)
    fast = pyfa.Options(backend="emu", variant="fast")
    o, _ = pyfa.fa2_forward(q, k, v, options=fast, **DROP)
    assert same_bits(o, pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="emu", variant="reference"),
                                         **DROP)[0])
    q, k, v, _ = fast_inputs(128)
    with pytest.raises(pyfa.InvalidArgumentError, match="the fast fa2_forward at head_dim 128 takes no dropout"):
        pyfa.fa2_forward(q, k, v, options=fast, **DROP)


# ---- semantics: the float64 reference with the mask applied explicitly ----

def dropout_reference(q, k, v, do, keep, p, causal, window, causal_align):
    """O, dQ, dK, dV in float64 of O = (softmax(S) o Z / (1 - p)) V, GQA's groups summed."""
    H, Hkv = q.shape[1], k.shape[1]
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    scale = 1 / np.sqrt(q.shape[-1])
    s = np.where(mask_matrix(q.shape[2], k.shape[2], causal, window, causal_align), -np.inf,
                 q @ np.swapaxes(k, -1, -2) * scale)
    m = s.max(axis=-1, keepdims=True)
    P = np.exp(s - np.where(np.isinf(m), 0, m))
    P = P / np.maximum(P.sum(axis=-1, keepdims=True), 1e-300)
    Zs = keep / (1 - p)
    o = (P * Zs) @ v
    dv = np.swapaxes(P * Zs, -1, -2) @ do
    dP = (do @ np.swapaxes(v, -1, -2)) * Zs
    dS = P * (dP - (P * dP).sum(axis=-1, keepdims=True))
    dq = dS @ k * scale
    dk = np.swapaxes(dS, -1, -2) @ q * scale
    group = lambda x: x.reshape(x.shape[0], Hkv, H // Hkv, *x.shape[2:]).sum(axis=2)
    return o, dq, group(dk), group(dv)


@pytest.mark.parametrize("algo", ["fa2", "fa1"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_a_float64_reference_with_the_returned_mask(case, algo):
    q, k, v, do = inputs(case)
    B, H, Hkv, Nq, Nk, *_ = CASES[case]
    keep = pyfa.dropout_mask(B, H, Nq, Nk, **DROP)
    (o, *_), grads, _, _ = simulated(case, algo, TILES[0])
    want = dropout_reference(q, k, v, do, keep, np.float32(P_DROP), **mask_kw(case))
    for got, ref in zip((o,) + grads, want):
        assert np.abs(got - ref).max() <= 2e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("case", list(CASES))
def test_lse_and_io_are_those_without_dropout(case):
    """l, m and LSE take P undropped, and the mask is regenerated: no extra HBM byte."""
    q, k, v, do = inputs(case)
    opt = pyfa.Options(block_r=TILES[0][0], block_c=TILES[0][1])
    plain = pyfa.sim.fa2_forward(q, k, v, **mask_kw(case), options=opt)
    (o, lse), _, io_f, io_b = simulated(case, "fa2", TILES[0])
    assert same_bits(lse, plain.lse)
    assert not same_bits(o, plain.o)
    g = pyfa.sim.fa2_backward(q, k, v, plain.o, plain.lse, do, **mask_kw(case), options=opt)
    assert io_f.reads == plain.io.reads and io_f.writes == plain.io.writes
    assert io_b.reads == g.io.reads and io_b.writes == g.io.writes


def test_zero_dropout_is_no_dropout():
    q, k, v, do = inputs("dense")
    opt = pyfa.Options(backend="cpu")
    o = pyfa.attention(q, k, v, options=opt)
    assert same_bits(pyfa.attention(q, k, v, options=opt, dropout_p=0.0, seed=5, offset=3), o)
    assert same_bits(pyfa.attention(q, k, v, options=opt, dropout_p=0), o)


def test_attention_grad_takes_dropout():
    q, k, v, do = inputs("causal_gqa")
    opt = pyfa.Options(backend="cpu")
    got = pyfa.attention_grad(q, k, v, do, causal=True, options=opt, **DROP)
    o, lse = pyfa.fa2_forward(q, k, v, causal=True, options=opt, **DROP)
    want = (o,) + pyfa.fa2_backward(q, k, v, o, lse, do, causal=True, options=opt, **DROP)
    for a, b in zip(got, want):
        assert same_bits(a, b)


# ---- dropout_origin: a call on a block of a larger problem draws that problem's decisions ----

def test_origin_mask_is_the_larger_problems_block():
    """The mask of a block at origin (B0, H0, P, K), P and K not multiples of 4, is that
    block of the larger problem's mask, in the library and the simulator."""
    full = pyfa.dropout_mask(3, 4, 23, 41, **DROP)
    for origin, dims in [((1, 2, 5, 13), (2, 2, 9, 17)), ((0, 0, 0, 3), (3, 4, 23, 38)), ((2, 3, 22, 40), (1, 1, 1, 1))]:
        block = full[tuple(slice(o, o + n) for o, n in zip(origin, dims))]
        assert np.array_equal(pyfa.dropout_mask(*dims, **DROP, dropout_origin=origin), block), origin
        assert np.array_equal(pyfa.sim.dropout_mask(*dims, **DROP, dropout_origin=origin), block), origin


ORIGIN_RUNS = [("emu", dict(variant="reference")), ("emu", dict(variant="auto", emu_order="reverse")),
               ("cpu", dict(threads=1)), ("cpu", dict(threads=2))]


@pytest.mark.parametrize("backend, extra", ORIGIN_RUNS)
@pytest.mark.parametrize("algo", ["fa2", "fa1"])
def test_block_calls_with_origin_give_the_whole_calls_bits(algo, backend, extra):
    """Rows 9..27 of one head of the causal_gqa case against keys 13..40 (the block a
    context-parallel rank computes: diagonal_offset = P - K, dropout_origin = (0, h, P, K)):
    forward and backward with the bits of the simulator's block call, and each row whose
    visible keys all lie in the block, from a key tile boundary on, has the bits of the
    whole call's row."""
    q, k, v, do = inputs("causal_gqa")
    P, K, h = 9, 13, 3
    qb, dob = q[:, h:h + 1, P:28], do[:, h:h + 1, P:28]
    kb, vb = k[:, h // 2:h // 2 + 1, K:], v[:, h // 2:h // 2 + 1, K:]
    kw = dict(causal=True, causal_align="top_left", diagonal_offset=P - K, dropout_origin=(0, h, P, K),
              options=pyfa.Options(backend=backend, block_r=8, block_c=8, **extra), **DROP)
    sim_kw = dict(kw, options=pyfa.Options(block_r=8, block_c=8))
    fwd_fn, bwd_fn = (pyfa.fa2_forward, pyfa.fa2_backward) if algo == "fa2" else (pyfa.fa1_forward,
                                                                                  pyfa.fa1_backward)
    fwd = fwd_fn(qb, kb, vb, **kw)
    grad = bwd_fn(qb, kb, vb, *fwd, dob, **kw)
    if algo == "fa2":
        f = pyfa.sim.fa2_forward(qb, kb, vb, **sim_kw)
        g = pyfa.sim.fa2_backward(qb, kb, vb, f.o, f.lse, dob, **sim_kw)
        want = (f.o, f.lse, g.dq, g.dk, g.dv)
    else:
        f = pyfa.sim.fa1_forward(qb, kb, vb, **sim_kw)
        g = pyfa.sim.fa1_backward(qb, kb, vb, f.o, f.m, f.l, dob, **sim_kw)
        want = (f.o, f.m, f.l, g.dq, g.dk, g.dv)
    for got, w in zip(fwd + grad, want):
        assert same_bits(got, w)
    # Where the block holds every key its rows see, from a key tile boundary on (K = 8 =
    # Bc), its rows are the whole call's: a causal window of left side P - K.
    P, K = 12, 8
    whole = dict(causal=True, causal_align="top_left", window=(P - K, 0),
                 options=pyfa.Options(backend=backend, block_r=8, block_c=8, **extra), **DROP)
    o_whole = pyfa.fa2_forward(q, k, v, **whole)[0]
    o_block = pyfa.fa2_forward(q[:, h:h + 1, P:28], k[:, h // 2:h // 2 + 1, K:], v[:, h // 2:h // 2 + 1, K:],
                               **dict(whole, diagonal_offset=P - K, dropout_origin=(0, h, P, K)))[0]
    assert same_bits(o_block, o_whole[:, h:h + 1, P:28])
    moved = pyfa.fa2_forward(q[:, h:h + 1, P:28], k[:, h // 2:h // 2 + 1, K:], v[:, h // 2:h // 2 + 1, K:],
                             **dict(whole, diagonal_offset=P - K, dropout_origin=(0, h, P, K + 1)))[0]
    assert not same_bits(moved, o_block)  # the origin is read


def test_origin_arguments_and_old_layout():
    q, k, v, _ = inputs("dense")
    for origin, error, words in [((0, 0, -1, 0), pyfa.InvalidArgumentError, "dropout_origin's P: must be in"),
                                 ((0, 0, 0), pyfa.ArgumentTypeError, "dropout_origin: expected four ints"),
                                 ((0, 0, 0, 2 ** 34), pyfa.InvalidArgumentError, "dropout_origin's K"),
                                 ((0, 2 ** 32 - 1, 0, 0), pyfa.InvalidArgumentError, "dropout_origin's H0"),
                                 ((0, 0, 0, 1.0), pyfa.ArgumentTypeError, "dropout_origin's K")]:
        for fn in (pyfa.fa2_forward, pyfa.sim.fa2_forward):
            with pytest.raises(error, match=words):
                fn(q, k, v, dropout_origin=origin, **DROP)
    # Without dropout an origin is checked and draws nothing.
    plain = pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu"))
    assert all(same_bits(a, b) for a, b in zip(
        pyfa.fa2_forward(q, k, v, dropout_origin=(1, 1, 1, 1), options=pyfa.Options(backend="cpu")), plain))
    # The C ABI: its range named, and the ABI 10 layout (ending before it) an origin of 0.
    from pyfa import _lib
    ffi, lib = _lib.load()
    B, H, _, Nq, Nk, d, *_ = CASES["dense"]
    o, lse = np.zeros_like(q), np.zeros((B, H, Nq), np.float32)
    ptr = lambda x: ffi.cast("float *", x.ctypes.data)
    pr = ffi.new("pyfa_problem *")
    pr.struct_size = ffi.sizeof("pyfa_problem")
    pr.batch, pr.heads, pr.seqlen_q, pr.seqlen_k, pr.head_dim = B, H, Nq, Nk, d
    pr.dropout_p, pr.dropout_seed, pr.dropout_offset = DROP["dropout_p"], DROP["seed"], DROP["offset"]
    cfg = ffi.new("pyfa_config *")
    cfg.backend = 3  # PYFA_BACKEND_CPU
    pr.dropout_origin = [0, 0, 2 ** 32 - Nq + 1, 0]
    assert lib.pyfa_fa2_forward(pr, cfg, ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse)) == 1
    assert "problem->dropout_origin[2]: must be >= 0 with P + seqlen_q <= 2^32" in \
        ffi.string(lib.pyfa_last_error()).decode()
    assert not o.any()
    pr.struct_size = ffi.offsetof("pyfa_problem", "dropout_origin")
    assert lib.pyfa_fa2_forward(pr, cfg, ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse)) == 0
    assert same_bits(o, pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu"), **DROP)[0])
    # Without dropout nothing is addressed: the origin's bounds are dropout's alone.
    pr.struct_size = ffi.sizeof("pyfa_problem")
    pr.dropout_p = 0.0
    assert lib.pyfa_fa2_forward(pr, cfg, ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse)) == 0
    assert same_bits(o, pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu"))[0])


# ---- arguments ----

@pytest.mark.parametrize("fn", [pyfa.attention, pyfa.sim.fa2_forward])
@pytest.mark.parametrize("kw, error, words", [
    (dict(dropout_p=0.1), pyfa.InvalidArgumentError, "seed: dropout_p > 0 needs an explicit seed"),
    (dict(dropout_p=1.0, seed=1), pyfa.InvalidArgumentError, "dropout_p: must be in [0, 1)"),
    (dict(dropout_p=-0.1, seed=1), pyfa.InvalidArgumentError, "dropout_p: must be in [0, 1)"),
    (dict(dropout_p=float("nan"), seed=1), pyfa.InvalidArgumentError, "dropout_p"),
    (dict(dropout_p=0.99999999, seed=1), pyfa.InvalidArgumentError, "as a float32"),
    (dict(dropout_p="0.1", seed=1), pyfa.ArgumentTypeError, "dropout_p"),
    (dict(dropout_p=0.1, seed=-1), pyfa.InvalidArgumentError, "seed"),
    (dict(dropout_p=0.1, seed=2 ** 64), pyfa.InvalidArgumentError, "seed"),
    (dict(dropout_p=0.1, seed=1.0), pyfa.ArgumentTypeError, "seed"),
    (dict(dropout_p=0.1, seed=1, offset=-1), pyfa.InvalidArgumentError, "offset"),
])
def test_bad_dropout_arguments_are_refused(fn, kw, error, words):
    q, k, v, _ = inputs("dense")
    with pytest.raises(error, match=None) as info:
        fn(q, k, v, **kw)
    assert words in str(info.value)


def test_c_abi_checks_dropout_p_and_accepts_the_old_layout():
    from pyfa import _lib
    ffi, lib = _lib.load()
    q, k, v, _ = inputs("dense")
    B, H, _, Nq, Nk, d, *_ = CASES["dense"]
    o, lse = np.zeros_like(q), np.zeros((B, H, Nq), np.float32)
    ptr = lambda x: ffi.cast("float *", x.ctypes.data)
    pr = ffi.new("pyfa_problem *")
    pr.batch, pr.heads, pr.seqlen_q, pr.seqlen_k, pr.head_dim = B, H, Nq, Nk, d
    cfg = ffi.new("pyfa_config *")
    cfg.backend = 3  # PYFA_BACKEND_CPU
    pr.struct_size = ffi.sizeof("pyfa_problem")
    for bad in (float("nan"), 1.0, -0.5, float("inf")):
        pr.dropout_p = bad
        assert lib.pyfa_fa2_forward(pr, cfg, ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse)) == 1
        assert "problem->dropout_p" in ffi.string(lib.pyfa_last_error()).decode()
        assert not o.any()  # nothing written on failure
    # The ABI 3 to 5 layout (struct_size 0) ends before the dropout fields: no dropout.
    pr.struct_size, pr.dropout_p, pr.dropout_seed = 0, 0.5, 1
    assert lib.pyfa_fa2_forward(pr, cfg, ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse)) == 0
    assert same_bits(o, pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu"))[0])
    keep = np.zeros((B, H, Nq, Nk), np.uint8)
    assert lib.pyfa_dropout_mask(ffi.NULL, ffi.cast("uint8_t *", keep.ctypes.data)) == 1
    pr.struct_size, pr.dropout_p = ffi.sizeof("pyfa_problem"), 0.5
    assert lib.pyfa_dropout_mask(pr, ffi.NULL) == 1
    assert "keep: null pointer" in ffi.string(lib.pyfa_last_error()).decode()


def test_dropout_mask_arguments():
    with pytest.raises(pyfa.InvalidArgumentError, match="seed"):
        pyfa.dropout_mask(1, 1, 4, 4, dropout_p=0.5, seed=None)
    with pytest.raises(pyfa.InvalidArgumentError, match="batch"):
        pyfa.sim.dropout_mask(0, 1, 4, 4, dropout_p=0.5, seed=1)
    assert pyfa.dropout_mask(1, 2, 0, 3, dropout_p=0.5, seed=1).shape == (1, 2, 0, 3)
    assert pyfa.dropout_mask(1, 1, 2, 3, dropout_p=0.0, seed=None).all()


def test_packed_sequences_drop_as_the_dense_batch_element_of_their_index():
    # Sequence b of a varlen call draws the decisions of (b, h, i, j), i and j its own rows
    # and keys: those of batch element b of a dense call holding it (the rest padded); the
    # simulator's packed calls draw the same.
    rng = np.random.default_rng(12)
    q = rng.standard_normal((30, 2, 16), dtype=np.float32)
    k, v = (rng.standard_normal((40, 1, 16), dtype=np.float32) for _ in range(2))
    cu_q, cu_k = np.array([0, 10, 30], np.int32), np.array([0, 15, 40], np.int32)
    kw = dict(causal=True, dropout_p=0.3, seed=5)
    Q = np.zeros((2, 20, 2, 16), np.float32)
    K, V = np.zeros((2, 25, 1, 16), np.float32), np.zeros((2, 25, 1, 16), np.float32)
    for b in range(2):
        Q[b, :cu_q[b + 1] - cu_q[b]] = q[cu_q[b]:cu_q[b + 1]]
        K[b, :cu_k[b + 1] - cu_k[b]] = k[cu_k[b]:cu_k[b + 1]]
        V[b, :cu_k[b + 1] - cu_k[b]] = v[cu_k[b]:cu_k[b + 1]]
    for backend in ("cpu", "emu"):
        opts = pyfa.Options(backend=backend)
        o = pyfa.attention_varlen(q, k, v, cu_q, cu_k, options=opts, **kw)
        # Sequence 1 fills its dense rows; sequence 0 its first 10 of 20 (bottom-right: the
        # dense call's causal offset differs), so it is compared against its own dense call.
        assert same_bits(o[10:30], pyfa.attention(Q, K, V, layout="bnhd", options=opts, **kw)[1])
        alone = pyfa.attention(q[None, :10], k[None, :15], v[None, :15], layout="bnhd", options=opts, **kw)[0]
        assert same_bits(o[:10], alone)
        assert same_bits(o, pyfa.sim.attention_varlen(q, k, v, cu_q, cu_k, **kw).o)
    # And the backward regenerates them: the library's gradients are the simulator's.
    do = rng.standard_normal(q.shape, dtype=np.float32)
    sim = pyfa.sim.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    want = pyfa.sim.fa2_backward_varlen(q, k, v, sim.o, sim.lse, do, cu_q, cu_k, **kw)
    for backend in ("cpu", "emu"):
        _, *got = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, options=pyfa.Options(backend=backend), **kw)
        assert all(same_bits(a, getattr(want, n)) for a, n in zip(got, ("dq", "dk", "dv"))), backend
