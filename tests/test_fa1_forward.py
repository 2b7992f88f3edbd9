"""FA1 forward (Algorithm 1 as written): the kernel (emulated, or on a GPU) equals its
simulator bit for bit, both are accurate against float64, and O, m, l are read only after
the kernel has initialized them."""

import functools

import numpy as np
import pytest

import grid
import pyfa
from pyfa import _lib
from reference import attention_ref, make_inputs, rel_err, row_stats_ref, same_bits

# pyfa.h's enum values, as the loader parses them from the header.
const = _lib.constant

# The shared grid (tests/grid.py), plus the default tiles (64 x 227 at d = 64) over two
# K/V tiles with tails.
CASES = grid.CASES + [
    (1, 1, 300, 260, 64, None, None),
]


@functools.lru_cache(maxsize=None)
def simulated(case, causal):
    B, H, Nq, Nk, d, Br, Bc = case
    q, k, v = make_inputs((B, H, Nq, d), (B, H, Nk, d), seed=grid.case_seed(case))
    return (q, k, v), pyfa.sim.fa1_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case,backend,order,variant", grid.variant_params(CASES))
def test_kernel_equals_simulator_bitwise(case, causal, backend, order, variant):
    (q, k, v), sim = simulated(case, causal)
    _, _, _, _, _, Br, Bc = case
    got = grid.run_variant("fa1_forward", case, variant, lambda: pyfa.fa1_forward(
        q, k, v, causal=causal, block_r=Br, block_c=Bc, backend=backend, emu_order=order,
        variant=variant))
    if got is None:
        return
    o, m, l = got
    assert same_bits(o, sim.o), "O differs from the simulator"
    assert same_bits(m, sim.m), "m differs from the simulator"
    assert same_bits(l, sim.l), "l differs from the simulator"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=grid.case_id)
def test_accuracy_against_float64(case, causal):
    (q, k, v), sim = simulated(case, causal)
    o_ref, _ = attention_ref(q, k, v, causal)
    assert rel_err(sim.o, o_ref) < 1e-5
    m_ref, l_ref = row_stats_ref(q, k, causal)
    seen = np.isfinite(m_ref)  # rows with a visible key; the others have m = -inf, l = 0
    assert np.array_equal(np.isfinite(sim.m), seen) and seen.any()
    assert np.all(sim.l[~seen] == 0)
    assert rel_err(sim.m[seen], m_ref[seen]) < 1e-5 and rel_err(sim.l, l_ref) < 1e-5


@pytest.mark.parametrize("d,paper,fitted", [
    (64, (64, 227), (64, 227)),    # M = 58112 floats: Bc = ceil(M / 4d) = 227, Br = min(227, d)
    (256, (57, 57), (57, 57)),
    (118, (118, 124), (118, 122)),  # K_j, V_j, Q_i and S_ij exceed M: Bc lowered by two
])
def test_default_tiles_follow_the_papers_rule(d, paper, fitted):
    M = 227 * 1024 // 4
    assert paper == (min(-(-M // (4 * d)), d), -(-M // (4 * d)))
    assert pyfa.default_tiles("fa1_forward", d, backend="emu") == fitted
    Br, Bc = fitted
    assert pyfa.sim.smem_bytes("fa1_forward", Br, Bc, d) <= 227 * 1024
    if fitted != paper:  # the largest Bc below the paper's that fits
        assert pyfa.sim.smem_bytes("fa1_forward", min(paper[0], Bc + 1), Bc + 1, d) > 227 * 1024


def test_default_tiles_run():
    # CASES[-1] runs with the default 64 x 227 tiles: two K/V tiles, the second a tail.
    assert "Br=64, Bc=227" in simulated(CASES[-1], False)[1].io.label


def test_shuffled_order_gives_the_same_bits():
    q, k, v = make_inputs((1, 2, 45, 32), (1, 2, 45, 32), seed=7)
    ref = pyfa.fa1_forward(q, k, v, causal=True, block_r=16, block_c=8, backend="emu")
    for seed in (1, 2, 3):
        out = pyfa.fa1_forward(q, k, v, causal=True, block_r=16, block_c=8, backend="emu",
                               emu_order="shuffled", emu_seed=seed)
        assert all(same_bits(a, b) for a, b in zip(out, ref))


def test_fully_masked_rows_give_zero_and_no_statistics():
    # Nq > Nk with causal: query i sees keys j <= i - (Nq - Nk), so the first 6 rows see
    # none. Rows 4, 5 share a visited Q tile (rows 4..7) with visible rows: their update
    # divides by l_new = 0 and must select 0.
    q, k, v = make_inputs((1, 1, 10, 8), (1, 1, 4, 8), seed=3)
    o, m, l = pyfa.fa1_forward(q, k, v, causal=True, block_r=4, block_c=2, backend="emu")
    assert np.all(o[0, 0, :6] == 0) and np.all(np.isneginf(m[0, 0, :6])) and np.all(l[0, 0, :6] == 0)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(m[0, 0, 6:])) and np.all(l[0, 0, 6:] >= 1)
    sim = pyfa.sim.fa1_forward(q, k, v, causal=True, block_r=4, block_c=2)
    assert same_bits(o, sim.o) and same_bits(m, sim.m) and same_bits(l, sim.l)


def test_outputs_are_initialized_before_they_are_read():
    # The device-pointer entry point writes straight into the caller's buffers: fill them
    # with NaN and Inf first. A kernel that read O, m or l before setting them would carry
    # the garbage into the result (0 * NaN = NaN).
    ffi, lib = _lib.load()
    q, k, v = make_inputs((2, 2, 19, 8), (2, 2, 23, 8), seed=4)
    want = pyfa.fa1_forward(q, k, v, causal=True, block_r=4, block_c=8, backend="emu")
    for fill in (np.nan, np.inf, -np.inf):
        o = np.full(q.shape, fill, np.float32)
        m = np.full(q.shape[:3], fill, np.float32)
        l = np.full(q.shape[:3], fill, np.float32)
        problem = ffi.new("pyfa_problem *", {"batch": 2, "heads": 2, "seqlen_q": 19, "seqlen_k": 23,
                                              "head_dim": 8, "causal": 1})
        config = ffi.new("pyfa_config *", {"backend": const("PYFA_BACKEND_EMU"), "block_r": 4, "block_c": 8})
        ptr = lambda x: ffi.cast("float *", ffi.from_buffer(x))
        _lib.check(lib.pyfa_fa1_forward_device(problem, config, ptr(q), ptr(k), ptr(v), ptr(o),
                                               ptr(m), ptr(l), ffi.NULL))
        assert same_bits(o, want[0]) and same_bits(m, want[1]) and same_bits(l, want[2])


def test_ranks_and_noncontiguous_inputs():
    q, k, v = make_inputs((2, 3, 24, 16), (2, 3, 24, 16), seed=5)
    o4, m4, l4 = pyfa.fa1_forward(q, k, v, backend="emu")
    o3, m3, l3 = pyfa.fa1_forward(q[1], k[1], v[1], backend="emu")
    o2, m2, l2 = pyfa.fa1_forward(q[1, 2], k[1, 2], v[1, 2], backend="emu")
    assert o3.shape == (3, 24, 16) and m3.shape == l3.shape == (3, 24)
    assert o2.shape == (24, 16) and m2.shape == l2.shape == (24,)
    assert same_bits(o3, o4[1]) and same_bits(o2, o4[1, 2])
    assert same_bits(m2, m4[1, 2]) and same_bits(l2, l4[1, 2])
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    big = np.zeros((2, 3, 48, 16), np.float32)
    big[:, :, ::2] = k
    o_nc, _, _ = pyfa.fa1_forward(qt, big[:, :, ::2], v, backend="emu")
    assert not qt.flags.c_contiguous and same_bits(o_nc, o4)


def test_attention_dispatches_to_fa1():
    q, k, v = make_inputs((1, 2, 30, 8), (1, 2, 26, 8), seed=9)
    o = pyfa.attention(q, k, v, causal=True, algo="fa1", block_r=8, block_c=4, backend="emu")
    assert same_bits(o, pyfa.fa1_forward(q, k, v, causal=True, block_r=8, block_c=4, backend="emu")[0])
    o_half = pyfa.attention(q, k, v, scale=0.5, algo="fa1", backend="emu")
    assert rel_err(o_half, attention_ref(q, k, v, scale=0.5)[0]) < 1e-5
    assert same_bits(o_half, pyfa.sim.fa1_forward(q, k, v, scale=0.5).o)


def test_repeated_calls_are_identical():
    q, k, v = make_inputs((2, 2, 50, 24), (2, 2, 50, 24), seed=11)
    first = pyfa.attention(q, k, v, causal=True, algo="fa1", backend="emu")
    for workers in (1, 2, 3):
        again = pyfa.attention(q, k, v, causal=True, algo="fa1", backend="emu", emu_workers=workers)
        assert same_bits(first, again)


def test_tile_too_large_names_the_fa1_layout():
    q = np.zeros((1, 1, 8, 256), np.float32)
    with pytest.raises(pyfa.TileTooLargeError) as info:
        pyfa.fa1_forward(q, q, q, block_r=128, block_c=128, backend="emu")
    msg = str(info.value)
    need = pyfa.sim.smem_bytes("fa1_forward", 128, 128, 256)
    terms = dict(pyfa.sim.smem_terms("fa1_forward", 128, 128, 256))
    assert "fa1_forward" in msg and f"need {need} bytes" in msg
    assert f"K_j {4 * terms['K_j']} + V_j {4 * terms['V_j']}" in msg
