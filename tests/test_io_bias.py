"""The IO model of an additive bias and dBias (issue 27): the simulator's record equals
count_io's walk (bias=) over broadcast shapes, masks, GQA and tiles, and the walk equals
the closed forms of docs/io_closed_forms.md ("Additive bias")."""

import numpy as np
import pytest

import pyfa

B, H, HKV, NQ, NK, D = 2, 2, 1, 21, 19, 16
MASKS = [(False, None, "bottom_right"), (True, None, "top_left"), (False, (5, 3), "bottom_right")]


@pytest.mark.parametrize("algo", ["fa2", "fa1"])
@pytest.mark.parametrize("shape", [(NQ, NK), (1, H, 1, NK), (B, H, NQ, NK)], ids=lambda s: "x".join(map(str, s)))
def test_simulator_record_equals_count(algo, shape):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, NQ, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, NK, D)).astype(np.float32)
    bias = rng.standard_normal(shape).astype(np.float32)
    for (causal, window, align), tiles in zip(MASKS, [(8, 8), (16, 4), (8, 8)]):
        mask = dict(causal=causal, window=window, causal_align=align)
        kw = dict(mask, bias=bias, options=pyfa.Options(block_r=tiles[0], block_c=tiles[1]))
        if algo == "fa2":
            f = pyfa.sim.fa2_forward(q, k, k, **kw)
            g = pyfa.sim.fa2_backward(q, k, k, f.o, f.lse, q, **kw)
        else:
            f = pyfa.sim.fa1_forward(q, k, k, **kw)
            g = pyfa.sim.fa1_backward(q, k, k, f.o, f.m, f.l, q, **kw)
        for rec, passes in ((f.io, "forward"), (g.io, "backward")):
            want = pyfa.sim.count_io(algo, passes=passes, batch=B, heads=H, heads_kv=HKV, seqlen_q=NQ,
                                     seqlen_k=NK, head_dim=D, block_r=tiles[0], block_c=tiles[1],
                                     bias=shape, **mask)
            assert rec.reads == want.reads and rec.writes == want.writes, (passes, mask, tiles)
            assert rec.reads["Bias"] > 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", ["full", "one"])
def test_closed_forms(causal, rows):
    """Nq = Nk = T b, Br = Bc = b: V visited tile pairs (T^2, or T(T + 1)/2 causal) each
    read b^2 bias values per query head: in the forwards once, in FA2's backward twice
    (dK/dV and dQ kernels), in FA1's once. dBias of Nq rows: B H Nq Nk written once; of
    one row: each key's sum started once and read and written back per visited pair."""
    T, b, Bb, Hh = 8, 16, 2, 3
    N = T * b
    V = T * (T + 1) // 2 if causal else T * T
    shape = (Bb, Hh, N, N) if rows == "full" else (1, Hh, 1, N)
    kw = dict(batch=Bb, heads=Hh, seqlen_q=N, seqlen_k=N, head_dim=8, block_r=b, block_c=b, causal=causal,
              bias=shape)
    per_head = V * b * b * 4
    for algo, backward_reads in (("fa2", 2), ("fa1", 1)):
        fwd = pyfa.sim.count_io(algo, **kw)
        assert fwd.reads["Bias"] == Bb * Hh * per_head
        assert "dBias" not in fwd.writes
        bwd = pyfa.sim.count_io(algo, passes="backward", **kw)
        assert bwd.reads["Bias"] == backward_reads * Bb * Hh * per_head
        if rows == "full":
            assert bwd.writes["dBias"] == Bb * Hh * N * N * 4 and "dBias" not in bwd.reads
        else:
            assert bwd.reads["dBias"] == Bb * Hh * V * b * 4
            assert bwd.writes["dBias"] == Bb * Hh * (N + V * b) * 4
    plain = pyfa.sim.count_io("fa2", **{**kw, "bias": None})
    assert "Bias" not in plain.reads


def test_count_refuses_a_bad_bias():
    kw = dict(batch=2, heads=2, seqlen_q=4, seqlen_k=5, head_dim=8)
    with pytest.raises(ValueError, match="bias: shape"):
        pyfa.sim.count_io("fa2", bias=(4, 4), **kw)
    with pytest.raises(TypeError, match="bias: expected the bias's shape"):
        pyfa.sim.count_io("fa2", bias=np.zeros((4, 5)), **kw)
