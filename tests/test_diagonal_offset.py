"""diagonal_offset (pyfa.h ABI 8): a call as the block (rows P + i, keys K + j) of a larger
problem. The block's outputs are the larger problem's, bit for bit, on every backend and
the simulator; merged in ascending key order, the blocks give the split forward."""

import numpy as np
import pytest

import pyfa

RNG = np.random.default_rng(7)
B, H, N, D = 1, 2, 96, 16
Q, K, V, DO = (RNG.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(4))
SLOPES = np.array([0.5, 0.25], np.float32)
MASKS = {
    "causal": dict(causal=True),
    "window": dict(window=(20, 5)),
    "alibi": dict(causal=True, alibi_slopes=SLOPES),
    "softcap_window": dict(window=(40, 0), softcap=5.0),
}
TILES = dict(block_r=16, block_c=16)


@pytest.mark.parametrize("backend", ["cpu", "emu"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_rows_of_the_whole_problem(backend, mask):
    # Rows [32, 64) against keys [0, 64) with offset 32 are rows 32..63 of the whole
    # causal problem restricted to the keys they can see (window right <= 0 or keys < 64).
    kw = dict(MASKS[mask], causal_align="top_left")
    opt = pyfa.Options(backend=backend, **TILES)
    o, lse = pyfa.fa2_forward(Q, K, V, options=opt, **kw)
    ob, lb = pyfa.fa2_forward(Q[:, :, 32:64], K[:, :, :64], V[:, :, :64], options=opt, diagonal_offset=32, **kw)
    if kw.get("window", (0, 0))[1] == 0 or kw.get("causal"):
        assert np.array_equal(ob, o[:, :, 32:64]) and np.array_equal(lb, lse[:, :, 32:64])
    sim = pyfa.sim.fa2_forward(Q[:, :, 32:64], K[:, :, :64], V[:, :, :64], options=opt, diagonal_offset=32, **kw)
    assert np.array_equal(ob, sim.o) and np.array_equal(lb, sim.lse)


@pytest.mark.parametrize("backend", ["cpu", "emu"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_blocks_merged_are_the_split_forward(backend, mask):
    kw = dict(MASKS[mask], causal_align="top_left")
    opt = pyfa.Options(backend=backend, **TILES)
    o, lse = pyfa.fa2_forward(Q, K, V, options=opt, split_size=32, **kw)
    parts = [pyfa.fa2_forward(Q, K[:, :, c:c + 32], V[:, :, c:c + 32], options=opt, diagonal_offset=-c, **kw)
             for c in range(0, N, 32)]
    om, lm = pyfa.merge_states([p[0] for p in parts], [p[1] for p in parts])
    assert np.array_equal(om, o) and np.array_equal(lm, lse)


@pytest.mark.parametrize("backend", ["cpu", "emu"])
@pytest.mark.parametrize("mask", ["causal", "window", "alibi"])
def test_backward_blocks_equal_the_simulator(backend, mask):
    kw = dict(MASKS[mask], causal_align="top_left")
    opt = pyfa.Options(backend=backend, **TILES)
    q, k, v, do = Q[:, :, 48:80], K[:, :, 16:48], V[:, :, 16:48], DO[:, :, 48:80]
    o, lse = pyfa.fa2_forward(q, k, v, options=opt, diagonal_offset=32, **kw)
    grads = pyfa.fa2_backward(q, k, v, o, lse, do, options=opt, diagonal_offset=32, **kw)
    sim = pyfa.sim.fa2_backward(q, k, v, o, lse, do, options=opt, diagonal_offset=32, **kw)
    for g, s in zip(grads, (sim.dq, sim.dk, sim.dv)):
        assert np.array_equal(g, s)
    fa1 = pyfa.fa1_forward(q, k, v, options=opt, diagonal_offset=32, **kw)
    fa1_sim = pyfa.sim.fa1_forward(q, k, v, options=opt, diagonal_offset=32, **kw)
    assert np.array_equal(fa1[0], fa1_sim.o)


@pytest.mark.parametrize("offset", [2**31 - 40, 2**32 + 3, -(2**33), 2**40])
def test_alibi_distance_beyond_int32_equals_the_simulator(offset):
    # |i + off - j| past 2^31 (diagonal_offset reaches 2^40): the cpu backend's lanes once
    # summed it in int32 and wrapped. Slopes small enough that the scores stay finite.
    kw = dict(alibi_slopes=np.array([1e-9, 3e-10], np.float32), diagonal_offset=offset)
    q, k, v, do = Q[:, :, :20], K[:, :, :24], V[:, :, :24], DO[:, :, :20]
    for fwd, fields in ((pyfa.fa2_forward, ("o", "lse")), (pyfa.fa1_forward, ("o", "m", "l"))):
        got = fwd(q, k, v, options=pyfa.Options(backend="cpu", **TILES), **kw)
        sim = getattr(pyfa.sim, fwd.__name__)(q, k, v, options=pyfa.Options(**TILES), **kw)
        assert all(np.array_equal(g, getattr(sim, f)) for g, f in zip(got, fields)), fwd.__name__
    o, lse = pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu", **TILES), **kw)
    grads = pyfa.fa2_backward(q, k, v, o, lse, do, options=pyfa.Options(backend="cpu", **TILES), **kw)
    sim = pyfa.sim.fa2_backward(q, k, v, o, lse, do, options=pyfa.Options(**TILES), **kw)
    for g, s in zip(grads, (sim.dq, sim.dk, sim.dv)):
        assert np.array_equal(g, s)


def test_refusals_name_the_argument():
    with pytest.raises(pyfa.InvalidArgumentError, match="diagonal_offset"):
        pyfa.fa2_forward(Q, K, V, diagonal_offset=1 << 41)
    with pytest.raises(pyfa.ArgumentTypeError, match="diagonal_offset"):
        pyfa.fa2_forward(Q, K, V, diagonal_offset=1.5)
    # Dropout's decisions do not move with the diagonal (dropout_origin moves them): a
    # moved diagonal with dropout is the moved mask over the call's own decisions.
    drop = dict(dropout_p=0.1, seed=1, options=pyfa.Options(backend="cpu"))
    assert np.array_equal(pyfa.fa2_forward(Q, K, V, diagonal_offset=4, **drop)[0],
                          pyfa.sim.fa2_forward(Q, K, V, diagonal_offset=4, **drop).o)
