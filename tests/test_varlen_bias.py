"""An additive bias with packed sequences: broadcastable to (B, H, max_seqlen_q,
max_seqlen_k), sequence b reading the corner of its own lengths. Every row's output and
gradients equal its sequence's dense call with that corner (bit for bit, docs/numerics.md
"Packed sequences"); dBias has the bias's shape, each sequence's dS in its corner, +0
beyond it, folded over a broadcast B or H as a dense call folds. emu (readable and fast
kernels), cpu (threads 1, 2, 3) and the simulator agree; the simulator's IO record is
count_io_varlen's."""

import functools

import numpy as np
import pytest

import pyfa
from reference import same_bits
from test_varlen import offsets

pytestmark = pytest.mark.xdist_group("varlen")

LENS_Q = [5, 0, 17, 1, 9]
LENS_K = [7, 3, 17, 12, 0]
B, H, HKV, D = len(LENS_Q), 2, 1, 16
MQ, MK = max(LENS_Q), max(LENS_K)
SHAPES = [(B, H, MQ, MK), (1, H, MQ, MK), (B, 1, 1, MK), (1, 1, MQ, MK), (MK,), (B, H, 1, MK)]
OPTS = {
    "emu": pyfa.Options(backend="emu", block_r=8, block_c=8, variant="reference"),
    "cpu": pyfa.Options(backend="cpu", block_r=8, block_c=8),
}


CU_Q, CU_K = offsets(LENS_Q), offsets(LENS_K)


@functools.lru_cache(maxsize=None)
def problem(shape, d=D):
    rng = np.random.default_rng(len(shape) * 7 + shape[0] + d)
    f = lambda n, h: rng.standard_normal((n, h, d)).astype(np.float32)
    bias = rng.standard_normal(shape).astype(np.float32)
    return f(CU_Q[-1], H), f(CU_K[-1], HKV), f(CU_K[-1], HKV), f(CU_Q[-1], H), bias


def corner(bias, b):
    """Sequence b's (1, H|1, nq|1, nk) corner of the packed bias."""
    v = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    v = v[b if v.shape[0] > 1 else 0][None]
    return np.ascontiguousarray(v[:, :, :LENS_Q[b] if v.shape[2] > 1 else 1, :LENS_K[b]])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("algo", ["fa2", "fa1"])
def test_backends_simulator_and_each_sequence_alone(shape, causal, algo):
    q, k, v, do, bias = problem(shape)
    kw = dict(causal=causal, algo=algo, bias=bias)
    runs = {name: pyfa.attention_varlen_grad(q, k, v, do, CU_Q, CU_K, options=opts, **kw)
            for name, opts in OPTS.items()}
    o, dq, dk, dv, dbias = runs["emu"]
    assert dbias.shape == bias.shape
    for got in runs.values():
        assert all(same_bits(a, b) for a, b in zip(got, runs["emu"]))
    fwd = pyfa.attention_varlen(q, k, v, CU_Q, CU_K, options=OPTS["cpu"], **kw)
    assert same_bits(fwd, o)

    sim = pyfa.sim
    stats_kw = dict(options=OPTS["emu"], causal=causal, bias=bias)
    f = getattr(sim, f"{algo}_forward_varlen")(q, k, v, CU_Q, CU_K, **stats_kw)
    stats = (f.lse,) if algo == "fa2" else (f.m, f.l)
    g = getattr(sim, f"{algo}_backward_varlen")(q, k, v, f.o, *stats, do, CU_Q, CU_K, **stats_kw)
    assert same_bits(f.o, o)
    for a, b in zip((g.dq, g.dk, g.dv, g.dbias), (dq, dk, dv, dbias)):
        assert same_bits(a, b)
    for passes, record in (("forward", f.io), ("backward", g.io)):
        model = sim.count_io_varlen(algo, passes=passes, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, heads=H,
                                    head_dim=D, heads_kv=HKV, block_r=8, block_c=8, causal=causal,
                                    bias=shape)
        assert (model.reads, model.writes) == (record.reads, record.writes), passes

    # Row for row the dense call of each sequence with its corner; where the bias has
    # the batch axis (and so each sequence a dBias of its own) its corner of dBias too.
    full = np.reshape(dbias, (1,) * (4 - dbias.ndim) + dbias.shape)
    for b in range(B):
        qs, qz, ks, kz = CU_Q[b], CU_Q[b + 1], CU_K[b], CU_K[b + 1]
        ref = pyfa.attention_grad(q[qs:qz], k[ks:kz], v[ks:kz], do[qs:qz], causal=causal, algo=algo,
                                  bias=corner(bias, b), layout="bnhd", options=OPTS["emu"])
        for got, want in zip((o[qs:qz], dq[qs:qz], dk[ks:kz], dv[ks:kz]), ref[:4]):
            assert same_bits(got, want), b
        if full.shape[0] == B:
            rows = LENS_Q[b] if full.shape[2] > 1 else 1
            assert same_bits(full[b, :, :rows, :LENS_K[b]], ref[4][0]), b
            rest = full[b].copy()
            rest[:, :rows, :LENS_K[b]] = 0
            assert not np.any(rest.view(np.uint32)), b  # +0 beyond the corner, every bit


def test_threads_and_fast_kernels():
    """cpu threads 1, 2, 3 agree; the register-tiled forwards (d = 64; the fast backwards
    take no bias) equal the readable ones on the emulator, with a bias cut per sequence."""
    shape = (B, H, MQ, MK)
    q, k, v, do, bias = problem(shape)
    runs = [pyfa.attention_varlen_grad(q, k, v, do, CU_Q, CU_K, causal=True, bias=bias,
                                       options=pyfa.Options(backend="cpu", threads=t)) for t in (1, 2, 3)]
    for other in runs[1:]:
        assert all(same_bits(a, b) for a, b in zip(runs[0], other))
    q, k, v, do, bias = problem((1, H, MQ, MK), 64)
    for algo in ("fa2", "fa1"):
        got = {variant: pyfa.attention_varlen(
            q, k, v, CU_Q, CU_K, causal=True, algo=algo, bias=bias,
            options=pyfa.Options(backend="emu", block_r=64, block_c=64, variant=variant))
            for variant in ("fast", "reference")}
        assert same_bits(got["fast"], got["reference"]), algo


def test_bias_errors_name_the_argument():
    q, k, v, do, bias = problem((B, H, MQ, MK))
    with pytest.raises(pyfa.InvalidArgumentError, match="bias"):
        pyfa.attention_varlen(q, k, v, CU_Q, CU_K, bias=bias[:, :, :, :-1])
    with pytest.raises(pyfa.InvalidArgumentError, match="bias"):  # max_seqlen_k says the bias's keys
        pyfa.attention_varlen(q, k, v, CU_Q, CU_K, bias=bias, max_seqlen_k=MK + 1)
    with pytest.raises(pyfa.InvalidArgumentError, match="bias"):
        pyfa.sim.fa2_forward_varlen(q, k, v, CU_Q, CU_K, bias=bias[:3])
    dbias = np.full(bias.shape, 7, np.float32)
    out = (None, None, None, None, dbias[:, :, :, :-1])
    with pytest.raises(pyfa.PyfaError, match="dbias"):
        pyfa.attention_varlen_grad(q, k, v, do, CU_Q, CU_K, bias=bias, out=out)
    assert np.all(dbias == 7)
    with pytest.raises(pyfa.InvalidArgumentError, match="bias"):
        pyfa.sim.count_io_varlen("fa2", passes="backward", cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, heads=H,
                                 head_dim=D, bias=(B, H, MQ, MK - 1))


def test_kvcache_refuses_a_bias_and_writes_nothing():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 1, H, D)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((2, 16, HKV, D)).astype(np.float32) for _ in range(2))
    k_new = rng.standard_normal((2, 1, HKV, D)).astype(np.float32)
    seqlens = np.array([5, 9], np.int32)
    before = k_cache.copy()
    for call in (pyfa.attention_with_kvcache, pyfa.sim.attention_with_kvcache):
        with pytest.raises(pyfa.InvalidArgumentError, match="bias"):
            call(q, k_cache, v_cache, seqlens, k_new, k_new, bias=np.zeros((2, H, 1, 16), np.float32))
        assert same_bits(k_cache, before)
