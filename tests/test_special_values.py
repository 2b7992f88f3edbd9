"""Inputs holding NaN, +-Inf and huge values: every kernel still equals its simulator bit
for bit, NaNs included (every NaN a kernel stores is the canonical 0x7FC00000,
docs/numerics.md), nothing crashes, and the simulators raise no NumPy warnings."""

import numpy as np
import pytest

import grid
import pyfa

CANONICAL_NAN = 0x7FC00000


def same_bits(a, b):
    """The same float32 bits everywhere, NaN payloads included, and every NaN canonical."""
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    if a.shape != b.shape or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        return False
    return bool(np.all(a.view(np.uint32)[np.isnan(a)] == CANONICAL_NAN))

# NaNs with payloads and either sign (a GPU would return its own NaN for them), infinities,
# huge values and the smallest subnormal.
SPECIALS = np.concatenate([
    np.array([0x7FC00000, 0xFFC00000, 0x7FC01234, 0xFFA12345], np.uint32).view(np.float32),
    np.array([np.inf, -np.inf, 3e38, -3e38, 1e-45], np.float32)])


def poisoned_inputs(seed):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((2, 19, 8), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 23, 8), dtype=np.float32) for _ in range(2))
    for x in (q, k, v, do):
        x.flat[rng.integers(0, x.size, 3)] = rng.choice(SPECIALS, 3)
    return q, k, v, do


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("backend", grid.BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_kernel_matches_its_simulator_on_special_values(seed, causal, backend):
    q, k, v, do = poisoned_inputs(seed)
    tiles = pyfa.Options(backend=backend, block_r=4, block_c=8)

    o, lse = pyfa.fa2_forward(q, k, v, causal=causal, options=tiles)
    sim = pyfa.sim.fa2_forward(q, k, v, causal=causal, options=tiles)
    assert same_bits(o, sim.o) and same_bits(lse, sim.lse)
    assert np.isnan(o).any(), "the poisoned inputs should reach the output"

    o1, m, l = pyfa.fa1_forward(q, k, v, causal=causal, options=tiles)
    sim1 = pyfa.sim.fa1_forward(q, k, v, causal=causal, options=tiles)
    assert same_bits(o1, sim1.o) and same_bits(m, sim1.m) and same_bits(l, sim1.l)

    grads = pyfa.fa2_backward(q, k, v, o, lse, do, causal=causal, options=tiles)
    simg = pyfa.sim.fa2_backward(q, k, v, o, lse, do, causal=causal, options=tiles)
    assert all(same_bits(a, b) for a, b in zip(grads, (simg.dq, simg.dk, simg.dv)))

    grads1 = pyfa.fa1_backward(q, k, v, o1, m, l, do, causal=causal, options=tiles)
    simg1 = pyfa.sim.fa1_backward(q, k, v, o1, m, l, do, causal=causal, options=tiles)
    assert all(same_bits(a, b) for a, b in zip(grads1, (simg1.dq, simg1.dk, simg1.dv)))
