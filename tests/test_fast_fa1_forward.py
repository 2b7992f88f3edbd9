"""The fast FA1 forward (src/kernels/fast/fa1_forward_fast.cuh): the same O, m and l bits
as the simulator, and so as the readable kernel, on every case it takes, under two thread
orders; masks, grouped-query heads and both layouts; special values; what variant="fast"
says it lacks, and variant="auto" falling back to the readable kernel. FA1's results
depend on Bc, so every call here gives its tiles (Bc = 64, the fast kernel's)."""

import numpy as np
import pytest

import grid
import pyfa
from reference import make_inputs, same_bits
from test_fast_kernels import MASKED, SPECIALS  # masks and special values of the fast FA2 tests

# (B, H, Nq, Nk, d, Br, Bc): both row tiles at both head dims; one tile and
# less; K/V tails of every residue of 4 (the P V loop's last 1..3 keys: 131 and 67 leave
# 3, 66 and 190 leave 2, 129 leaves 1); Nq != Nk both ways (with causal and Nq > Nk the
# first rows see no key of the early tiles); several Q tiles per band, so that Q_{i+1} is
# prefetched while Q_i computes.
FAST_CASES = [
    (1, 1, 64, 64, 64, 64, 64),
    (2, 2, 70, 131, 64, 64, 64),
    (1, 1, 1, 1, 64, 64, 64),
    (1, 2, 130, 67, 64, 128, 64),
    (1, 1, 300, 66, 64, 128, 64),
    (1, 1, 45, 190, 128, 64, 64),
    (1, 1, 129, 129, 128, 64, 64),
    (1, 1, 200, 70, 64, 64, 64),
    (1, 2, 270, 131, 128, 128, 64),
]

_SIM = {}


def simulated(case, causal):
    if (case, causal) not in _SIM:
        B, H, Nq, Nk, d, Br, Bc = case
        q, k, v = make_inputs((B, H, Nq, d), (B, H, Nk, d), seed=grid.case_seed(case))
        _SIM[case, causal] = (q, k, v), pyfa.sim.fa1_forward(q, k, v, causal=causal, block_r=Br,
                                                             block_c=Bc)
    return _SIM[case, causal]


def same_result(got, sim):
    o, m, l = got
    return same_bits(o, sim.o) and same_bits(m, sim.m) and same_bits(l, sim.l)


@pytest.mark.parametrize("variant", ["fast", "auto"])
@pytest.mark.parametrize("backend,order", grid.RUNS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", grid.grouped(FAST_CASES, "fast_fa1_forward"))
def test_fast_fa1_forward_equals_the_simulator(case, causal, backend, order, variant):
    (q, k, v), sim = simulated(case, causal)
    _, _, _, _, _, Br, Bc = case
    if backend == "cpu" and variant == "fast":  # the cpu backend's kernels are its own
        with pytest.raises(ValueError, match="config->variant: fast: the cpu backend"):
            pyfa.fa1_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc, backend=backend,
                             variant=variant)
        return
    got = pyfa.fa1_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc, backend=backend,
                           emu_order=order, variant=variant)
    assert same_result(got, sim)


# MASKED: windows and both causal alignments, which the kernel reads through Mask (the
# bands q_tiles(j), whole tiles and per-element tests); with grouped-query heads and the
# (B, N, H, d) layout, which it reads through the head mapping and the strides.
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("heads,heads_kv,d,block_r", [(4, 2, 64, 128), (3, 1, 128, 64), (2, 2, 64, 64),
                                                     (2, 1, 128, 128)])
@pytest.mark.parametrize("mask", MASKED, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_fast_fa1_forward_masks_gqa_layouts(mask, heads, heads_kv, d, block_r, layout):
    Nq, Nk = (150, 97) if heads_kv == 2 else (70, 200)
    rng = np.random.default_rng(heads + d + block_r)
    shape_q = (1, heads, Nq, d) if layout == "bhnd" else (1, Nq, heads, d)
    shape_k = (1, heads_kv, Nk, d) if layout == "bhnd" else (1, Nk, heads_kv, d)
    q = rng.standard_normal(shape_q, dtype=np.float32)
    k, v = (rng.standard_normal(shape_k, dtype=np.float32) for _ in range(2))
    sim = pyfa.sim.fa1_forward(q, k, v, layout=layout, block_r=block_r, block_c=64, **mask)
    for order in ("forward", "reverse"):
        got = pyfa.fa1_forward(q, k, v, layout=layout, block_r=block_r, block_c=64, backend="emu",
                               emu_order=order, variant="fast", **mask)
        assert same_result(got, sim), order


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,block_r", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_fast_fa1_forward_special_values(d, block_r, causal, order):
    rng = np.random.default_rng(d + block_r + causal)
    q = rng.standard_normal((1, 2, 150, d), dtype=np.float32)
    k = rng.standard_normal((1, 2, 90, d), dtype=np.float32)
    v = rng.standard_normal((1, 2, 90, d), dtype=np.float32)
    q[0, 0, 3] = 1e-30
    k[0, 0, ::3] = -1e-30
    for x in (q, k, v):
        x.flat[rng.integers(0, x.size, 6)] = rng.choice(SPECIALS, 6)
    sim = pyfa.sim.fa1_forward(q, k, v, causal=causal, block_r=block_r, block_c=64)
    got = pyfa.fa1_forward(q, k, v, causal=causal, block_r=block_r, block_c=64, backend="emu",
                           emu_order=order, variant="fast")
    assert same_result(got, sim)
    assert np.isnan(got[0]).any()  # the specials reach O


def test_fast_fa1_forward_names_what_it_lacks_and_writes_nothing():
    q, k, v = make_inputs((1, 1, 20, 40), (1, 1, 20, 40), seed=1)
    with pytest.raises(ValueError, match=r"config->variant: fast: the fast fa1_forward is compiled "
                                         r"for head_dim 64, 128, not 40"):
        pyfa.fa1_forward(q, k, v, block_r=64, block_c=64, backend="emu", variant="fast")
    q, k, v = make_inputs((1, 1, 20, 64), (1, 1, 20, 64), seed=1)
    with pytest.raises(ValueError, match=r"config->variant: fast: .*fa1_forward at head_dim=64 has tiles "
                                         r"\(block_r x block_c\) 64x64, 128x64, not 32x64"):
        pyfa.fa1_forward(q, k, v, block_r=32, block_c=64, backend="emu", variant="fast")
    with pytest.raises(ValueError, match=r"config->variant: fast: .*not 64x32"):
        pyfa.fa1_forward(q, k, v, block_r=64, block_c=32, backend="emu", variant="fast")
    q, k, v = make_inputs((1, 1, 20, 128), (1, 1, 20, 128), seed=1)
    outs = tuple(np.full(s, 7.0, np.float32) for s in [(1, 1, 20, 128), (1, 1, 20), (1, 1, 20)])
    with pytest.raises(ValueError, match=r"config->variant: fast: .*fa1_forward at head_dim=128 has tiles "
                                         r"\(block_r x block_c\) 64x64, 128x64, not 32x32"):
        pyfa.fa1_forward(q, k, v, block_r=32, block_c=32, backend="emu", variant="fast", out=outs)
    assert all((x == 7.0).all() for x in outs), "a failed call wrote the caller's outputs"


def test_fast_fa1_forward_needs_aligned_tensors_and_auto_falls_back():
    q, k, v = make_inputs((1, 1, 20, 64), (1, 1, 20, 64), seed=2)
    raw = np.zeros(q.size + 1, np.float32)
    shifted = raw[1:].reshape(q.shape)  # 4 bytes past an aligned buffer
    shifted[...] = q
    assert shifted.ctypes.data % 16 != 0
    with pytest.raises(ValueError, match=r"config->variant: fast: .*16-byte aligned"):
        pyfa.fa1_forward(shifted, k, v, block_r=64, block_c=64, backend="emu", variant="fast")
    sim = pyfa.sim.fa1_forward(q, k, v, block_r=64, block_c=64)
    got = pyfa.fa1_forward(shifted, k, v, block_r=64, block_c=64, backend="emu", variant="auto")
    assert same_result(got, sim)
    # A head dim and tiles the fast kernel does not have: auto runs the readable kernel.
    q, k, v = make_inputs((1, 1, 37, 40), (1, 1, 53, 40), seed=3)
    for tiles in [(16, 16), (64, 64)]:
        sim = pyfa.sim.fa1_forward(q, k, v, causal=True, block_r=tiles[0], block_c=tiles[1])
        got = pyfa.fa1_forward(q, k, v, causal=True, block_r=tiles[0], block_c=tiles[1], backend="emu",
                               variant="auto")
        assert same_result(got, sim), tiles


def fast_layout_bytes(Br, d, Bc=64):
    """src/common/smem.h fa1_forward_fast_smem: K_j^T, V_j, two Q_i^T and P~_ij, whose
    row stride Bc + 4 holds the row's scales."""
    return 4 * (d * Bc + Bc * d + 2 * d * Br + Br * (Bc + 4))


def test_fast_fa1_forward_tiles():
    for d in (64, 128):
        assert pyfa.default_tiles("fa1_forward", d, backend="emu", variant="fast") == (128, 64)
        for Br in (64, 128):
            assert pyfa.smem_bytes("fa1_forward", Br, 64, d, variant="fast") == fast_layout_bytes(Br, d)
            # With these tiles auto runs the fast kernel: its layout is what auto sizes.
            assert pyfa.smem_bytes("fa1_forward", Br, 64, d, variant="auto") == fast_layout_bytes(Br, d)
            assert pyfa.smem_bytes("fa1_forward", Br, 64, d, variant="reference") != \
                fast_layout_bytes(Br, d)
    assert fast_layout_bytes(128, 128) <= 227 * 1024  # an H200's (and the emulator's) opt-in
    assert pyfa.smem_bytes("fa1_forward", 32, 64, 64, variant="fast") == 0
    with pytest.raises(ValueError, match=r"variant: fast: the fast fa1_forward is compiled for head_dim "
                                         r"64, 128, not 96"):
        pyfa.default_tiles("fa1_forward", 96, backend="emu", variant="fast")


@pytest.mark.parametrize("d", [64, 128])
def test_the_variants_agree_at_64x64(d):
    # The tiles the project's external tests use: reference, fast and auto give one result.
    q, k, v = make_inputs((1, 2, 150, d), (1, 2, 140, d), seed=d)
    runs = [pyfa.fa1_forward(q, k, v, causal=True, block_r=64, block_c=64, backend="emu", variant=x)
            for x in ("reference", "fast", "auto")]
    for got in runs[1:]:
        assert all(same_bits(a, b) for a, b in zip(got, runs[0]))
