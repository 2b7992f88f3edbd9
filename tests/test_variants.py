"""Variant auto gives the readable kernels' bits. Without tiles it may run a fast kernel
at other tiles only along a side the results do not depend on (src/core/tiles.cpp,
tile_sides_in_bits); the simulator shows those sides are free, and the library's
defaults keep every other side."""

import numpy as np
import pytest

import pyfa
from reference import make_inputs, same_bits

# (kernel, the tile sides its results depend on), as docs/numerics.md's sums imply.
SIDES = {
    "fa2_forward": ("Bc",),
    "fa2_backward_dq": ("Bc",),
    "fa2_backward_dkdv": ("Br",),
    "fa1_forward": ("Br", "Bc"),
    "fa1_backward": ("Br", "Bc"),
}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernel", sorted(SIDES))
def test_auto_defaults_keep_the_sides_that_set_the_bits(kernel, d):
    ref = dict(zip(("Br", "Bc"), pyfa.default_tiles(kernel, d, variant="reference")))
    auto = dict(zip(("Br", "Bc"), pyfa.default_tiles(kernel, d, variant="auto")))
    for side in SIDES[kernel]:
        assert auto[side] == ref[side], (side, ref, auto)


# Causal with Nq > Nk and tails, a window, and GQA: rows with no key, partly masked tiles
# and tiles a row's band reaches without any visible key for that row.
MASKS = [dict(causal=True), dict(window=(20, 5)), dict(causal=True, window=(33, None))]


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_the_free_sides_change_no_bit_in_the_simulator(mask):
    rng = np.random.default_rng(5)
    q, do = (rng.standard_normal((1, 4, 150, 64), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 97, 64), dtype=np.float32) for _ in range(2))
    fwd = pyfa.sim.fa2_forward(q, k, v, block_r=64, block_c=32, **mask)
    for br in (16, 128):  # the forward: rows alone
        other = pyfa.sim.fa2_forward(q, k, v, block_r=br, block_c=32, **mask)
        assert same_bits(other.o, fwd.o) and same_bits(other.lse, fwd.lse), br
    bwd = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=64, block_c=32, **mask)
    rows = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=128, block_c=32, **mask)
    assert same_bits(rows.dq, bwd.dq)  # dQ: rows alone
    cols = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=64, block_c=16, **mask)
    assert same_bits(cols.dk, bwd.dk) and same_bits(cols.dv, bwd.dv)  # dK, dV: columns alone


def test_the_bound_sides_do_change_bits():
    # The converse, so the test above can fail: the sides SIDES lists do reach the bits.
    q, k, v, do = make_inputs((1, 2, 150, 64), (1, 2, 150, 64), 11, True)
    a = pyfa.sim.fa2_forward(q, k, v, block_r=64, block_c=64)
    b = pyfa.sim.fa2_forward(q, k, v, block_r=64, block_c=32)
    assert not same_bits(a.o, b.o)
    x = pyfa.sim.fa2_backward(q, k, v, a.o, a.lse, do, block_r=64, block_c=64)
    y = pyfa.sim.fa2_backward(q, k, v, a.o, a.lse, do, block_r=32, block_c=32)
    assert not same_bits(x.dk, y.dk) and not same_bits(x.dq, y.dq)
    f1 = pyfa.sim.fa1_forward(q, k, v, block_r=64, block_c=64)
    f2 = pyfa.sim.fa1_forward(q, k, v, block_r=64, block_c=32)
    assert not same_bits(f1.o, f2.o)


def test_fast_fa2_backward_runs_with_the_one_preprocess():
    # The preprocess has one form; variant "fast" runs it beside the fast dQ and dK/dV.
    q, k, v, do = make_inputs((1, 2, 100, 64), (1, 2, 90, 64), 4, True)
    fwd = pyfa.sim.fa2_forward(q, k, v, causal=True)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=True, block_r=64, block_c=64)
    got = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=True, block_r=64, block_c=64,
                            backend="emu", variant="fast")
    assert all(same_bits(g, s) for g, s in zip(got, (sim.dq, sim.dk, sim.dv)))
    assert pyfa.default_tiles("fa2_backward_preprocess", 64, variant="fast") == \
        pyfa.default_tiles("fa2_backward_preprocess", 64, variant="reference")
    with pytest.raises(ValueError, match="fa2_backward_dkdv at head_dim=64 has tiles"):
        pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=32, block_c=64, backend="emu",
                          variant="fast")
