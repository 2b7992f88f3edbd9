"""The split FA2 backward (docs/numerics.md, "FA2 backward", "Split-KV"): dQ summed per key
chunk and dK, dV per query chunk, the chunk partials folded in ascending order. The
emulated kernels, the cpu backend and the simulator agree bit for bit; a split size that
covers the problem gives the unsplit bits; folding separate unsplit calls on the (query
chunk, key chunk) blocks gives the split bits; and what the split cannot take is refused
by name."""

import functools

import numpy as np
import pytest

import pyfa
import pyfa.sim
from reference import same_bits

TILES = dict(block_r=16, block_c=16)
SIM = pyfa.Options(**TILES)  # the simulator's tiles
S = 32  # two tiles per chunk
# (backend, variant) of every implementation of the split backward that runs here:
# "auto" on the emulator must fall back to the readable kernels.
RUNS = [("emu", "reference"), ("emu", "auto"), ("cpu", "auto")]


def run_options(backend, variant):
    """Options of one RUNS entry; the emulator's readable run checks every access (its
    split fold reads back the output it wrote: strict mode checks that too)."""
    strict = dict(emu_check="strict") if (backend, variant) == ("emu", "reference") else {}
    return pyfa.Options(backend=backend, variant=variant, **strict, **TILES)


@functools.lru_cache(maxsize=None)
def problem(H, Hkv, Nq, Nk, d, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, H, Nq, d), dtype=np.float32)
    k = rng.standard_normal((1, Hkv, Nk, d), dtype=np.float32)
    v = rng.standard_normal((1, Hkv, Nk, d), dtype=np.float32)
    do = rng.standard_normal((1, H, Nq, d), dtype=np.float32)
    return q, k, v, do


# (name, H, Hkv, Nq, Nk, keywords): tails (70 and 45 are no multiples of S), GQA,
# masks, windows and the score modifications.
CASES = [
    ("plain", 2, 2, 70, 45, {}),
    ("causal-gqa", 4, 2, 45, 70, dict(causal=True)),
    ("causal-top-left", 2, 1, 70, 70, dict(causal=True, causal_align="top_left")),
    ("window", 2, 2, 70, 70, dict(window=(20, 9))),
    ("softcap-alibi", 2, 1, 45, 70, dict(causal=True, softcap=5.0, alibi_slopes=np.array([0.5, 0.125], np.float32))),
]


@functools.lru_cache(maxsize=None)
def simulated(name, split):
    _, H, Hkv, Nq, Nk, kw = next(c for c in CASES if c[0] == name)
    q, k, v, do = problem(H, Hkv, Nq, Nk, 16)
    fwd = pyfa.sim.fa2_forward(q, k, v, options=SIM, **kw)
    bwd = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, split_size=split, options=SIM, **kw)
    return (q, k, v, do, fwd.o, fwd.lse), (bwd.dq, bwd.dk, bwd.dv)


@pytest.mark.parametrize("run", RUNS, ids="-".join)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_split_backward_equals_the_simulator(case, run):
    name, kw = case[0], case[5]
    (q, k, v, do, o, lse), want = simulated(name, S)
    got = pyfa.fa2_backward(q, k, v, o, lse, do, split_size=S, **kw,
                            options=run_options(*run))
    for g, w, what in zip(got, want, ("dQ", "dK", "dV")):
        assert same_bits(g, w), f"{what} differs from the simulator"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_split_changes_the_bits_only_within_rounding(case):
    name = case[0]
    _, split = simulated(name, S)
    _, whole = simulated(name, None)
    for g, w in zip(split, whole):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    # The fold is a different sum order: some bits must move for a split to mean anything.
    assert not all(same_bits(g, w) for g, w in zip(split, whole))


@pytest.mark.parametrize("backend", ["emu", "cpu"])
def test_split_size_covering_the_problem_is_the_unsplit_backward(backend):
    for name in ("plain", "causal-gqa", "softcap-alibi"):
        kw = next(c for c in CASES if c[0] == name)[5]
        (q, k, v, do, o, lse), whole = simulated(name, None)
        opts = pyfa.Options(backend=backend, variant="reference" if backend == "emu" else "auto", **TILES)
        got = pyfa.fa2_backward(q, k, v, o, lse, do, split_size=80, **kw, options=opts)
        sim = pyfa.sim.fa2_backward(q, k, v, o, lse, do, split_size=80, options=SIM, **kw)
        for g, s, w in zip(got, (sim.dq, sim.dk, sim.dv), whole):
            assert same_bits(g, w) and same_bits(s, w)


def fold(parts):
    """The split's fold of chunk partials: plain fp32 adds from +0, chunks ascending."""
    acc = np.zeros_like(parts[0])
    for p in parts:
        acc = (acc + p).astype(np.float32)
    return acc


@pytest.mark.parametrize("causal", [False, True])
def test_split_equals_the_fold_of_per_block_calls(causal):
    """Each (query chunk a, key chunk b) block as its own unsplit call with the full
    problem's O, dO and LSE rows; dQ of chunk a folds over b, dK and dV of chunk b over a.
    Causal: square blocks, a == b causal, a > b unmasked, a < b sees nothing (skipped)."""
    N = 70 if causal else None
    Nq, Nk = (N, N) if causal else (70, 45)
    q, k, v, do = problem(4, 2, Nq, Nk, 16, seed=3)
    opts = pyfa.Options(backend="cpu", **TILES)
    o, lse = pyfa.fa2_forward(q, k, v, causal=causal, options=opts)
    dq, dk, dv = pyfa.fa2_backward(q, k, v, o, lse, do, causal=causal, split_size=S, options=opts)
    qa = [slice(a, min(a + S, Nq)) for a in range(0, Nq, S)]
    kb = [slice(b, min(b + S, Nk)) for b in range(0, Nk, S)]
    dq_parts = [[] for _ in qa]
    dk_parts = [[] for _ in kb]
    dv_parts = [[] for _ in kb]
    for a, ra in enumerate(qa):
        for b, rb in enumerate(kb):
            if causal and a < b:
                continue
            parts = pyfa.fa2_backward(q[:, :, ra], k[:, :, rb], v[:, :, rb], o[:, :, ra], lse[:, :, ra],
                                      do[:, :, ra], causal=causal and a == b, options=opts)
            dq_parts[a].append(parts[0])
            dk_parts[b].append(parts[1])
            dv_parts[b].append(parts[2])
    want_dq = np.concatenate([fold(p) for p in dq_parts], axis=2)
    want_dk = np.concatenate([fold(p) for p in dk_parts], axis=2)
    want_dv = np.concatenate([fold(p) for p in dv_parts], axis=2)
    assert same_bits(dq, want_dq), "dQ differs from the fold over key chunks"
    assert same_bits(dk, want_dk), "dK differs from the fold over query chunks"
    assert same_bits(dv, want_dv), "dV differs from the fold over query chunks"
    sim = pyfa.sim.fa2_backward(q, k, v, o, lse, do, causal=causal, split_size=S, options=SIM)
    assert same_bits(sim.dq, want_dq) and same_bits(sim.dk, want_dk) and same_bits(sim.dv, want_dv)


def test_attention_grad_splits_forward_and_backward():
    q, k, v, do = problem(2, 1, 45, 70, 16)
    opts = pyfa.Options(backend="cpu", **TILES)
    o, dq, dk, dv = pyfa.attention_grad(q, k, v, do, causal=True, split_size=S, options=opts)
    o2, lse = pyfa.fa2_forward(q, k, v, causal=True, split_size=S, options=opts)
    want = pyfa.fa2_backward(q, k, v, o2, lse, do, causal=True, split_size=S, options=opts)
    assert same_bits(o, o2)
    for g, w in zip((dq, dk, dv), want):
        assert same_bits(g, w)


# ---- refusals

def inputs():
    q, k, v, do = problem(2, 2, 45, 45, 16)
    o, lse = pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu", **TILES))
    return q, k, v, o, lse, do


@pytest.mark.parametrize("tiles,kernel", [(dict(block_r=16, block_c=32), "Bc"), (dict(block_r=32, block_c=16), "Br")])
@pytest.mark.parametrize("backend", ["emu", "cpu", "sim"])
def test_split_size_must_be_a_multiple_of_the_kernels_tiles(tiles, kernel, backend):
    args = inputs()
    outs = [np.full_like(args[0], 7.0), np.full_like(args[1], 7.0), np.full_like(args[2], 7.0)]
    with pytest.raises(pyfa.InvalidArgumentError, match=f"split_size.*{kernel}"):
        if backend == "sim":
            pyfa.sim.fa2_backward(*args, split_size=16, options=pyfa.Options(**tiles))
        else:
            pyfa.fa2_backward(*args, split_size=16, out=outs, options=pyfa.Options(backend=backend, **tiles))
    assert all(np.all(x == 7.0) for x in outs), "written on failure"


# Bias shapes (of (1, H, Nq, Nk)): every element, one row (dBias sums the rows), a head
# broadcast (folded over H), and one row broadcast over the heads too.
BIAS_SHAPES = [(1, 4, 45, 70), (1, 4, 1, 70), (1, 1, 45, 70), (1, 1, 1, 70)]


@pytest.mark.parametrize("run", RUNS + [("cpu2", "auto"), ("sim", "")], ids="-".join)
@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_backward_dbias_is_the_unsplit_dbias(shape, run):
    """dBias does not fold by chunk (docs/numerics.md, "Split-KV"): with a split it has the
    unsplit call's bits, on every backend and the simulator, and dQ, dK, dV keep the split
    bits of the call without dbias (bias_grad=False)."""
    q, k, v, do = problem(4, 2, 45, 70, 16)
    bias = np.random.default_rng(3).standard_normal(shape, dtype=np.float32)
    kw = dict(causal=True, softcap=5.0, bias=bias)
    fwd = pyfa.sim.fa2_forward(q, k, v, options=SIM, **kw)
    whole = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, options=SIM, **kw)
    if run[0] == "sim":
        got = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, split_size=S, options=SIM, **kw)
        got, grads = got.dbias, (got.dq, got.dk, got.dv)
    else:
        backend, threads = ("cpu", 2) if run[0] == "cpu2" else (run[0], None)
        opts = run_options(backend, run[1]) if threads is None else pyfa.Options(backend="cpu", threads=2, **TILES)
        *grads, got = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, split_size=S, options=opts, **kw)
        plain = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, split_size=S, bias_grad=False, options=opts, **kw)
        assert all(same_bits(a, b) for a, b in zip(grads, plain)), "dbias moved dQ, dK or dV"
    assert got.shape == shape and same_bits(got, whole.dbias), "dbias differs from the unsplit one"
    split = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, split_size=S, options=SIM, **kw)
    assert all(same_bits(a, b) for a, b in zip(grads, (split.dq, split.dk, split.dv)))
    assert not same_bits(split.dk, whole.dk), "the split must move dK's bits for this test to mean anything"


def test_split_backward_refuses_fa1_and_the_fast_kernels():
    q, k, v, o, lse, do = inputs()
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.attention_grad(q, k, v, do, algo="fa1", split_size=S)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.fa2_backward(q, k, v, o, lse, do, split_size=-1, options=pyfa.Options(backend="cpu"))


def test_fast_kernels_do_not_split():
    """Variant fast refuses split_size by name; auto runs the readable kernels (their bits)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 64, 64), dtype=np.float32)
    o, lse = pyfa.fa2_forward(q, q, q, options=pyfa.Options(backend="cpu"))
    with pytest.raises(pyfa.InvalidArgumentError, match="fast.*split_size"):
        pyfa.fa2_backward(q, q, q, o, lse, q, split_size=128, options=pyfa.Options(backend="emu", variant="fast"))
    auto = pyfa.fa2_backward(q, q, q, o, lse, q, split_size=128, options=pyfa.Options(backend="emu", variant="auto"))
    ref = pyfa.fa2_backward(q, q, q, o, lse, q, split_size=128,
                            options=pyfa.Options(backend="emu", variant="reference"))
    assert all(same_bits(a, r) for a, r in zip(auto, ref))
