"""FA2 forward: the kernel (emulated, or on a GPU) equals its simulator bit for bit, and
both are accurate against float64."""

import functools

import numpy as np
import pytest

import grid
import pyfa
from reference import attention_ref, make_inputs, rel_err, same_bits


@functools.lru_cache(maxsize=None)
def simulated(case, causal):
    B, H, Nq, Nk, d, Br, Bc = case
    q, k, v = make_inputs((B, H, Nq, d), (B, H, Nk, d), seed=grid.case_seed(case))
    return (q, k, v), pyfa.sim.fa2_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case,backend,order,variant", grid.variant_params(grid.CASES))
def test_kernel_equals_simulator_bitwise(case, causal, backend, order, variant):
    (q, k, v), sim = simulated(case, causal)
    _, _, _, _, _, Br, Bc = case
    got = grid.run_variant("fa2_forward", case, variant, lambda: pyfa.fa2_forward(
        q, k, v, causal=causal, block_r=Br, block_c=Bc, backend=backend, emu_order=order,
        variant=variant))
    if got is None:
        return
    o, lse = got
    assert same_bits(o, sim.o), "O differs from the simulator"
    assert same_bits(lse, sim.lse), "LSE differs from the simulator"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", grid.CASES, ids=grid.case_id)
def test_accuracy_against_float64(case, causal):
    (q, k, v), sim = simulated(case, causal)
    o_ref, lse_ref = attention_ref(q, k, v, causal)
    assert rel_err(sim.o, o_ref) < 1e-5
    finite = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(sim.lse), finite) and finite.any()
    assert rel_err(sim.lse[finite], lse_ref[finite]) < 1e-5


def test_shuffled_order_gives_the_same_bits():
    q, k, v = make_inputs((1, 2, 45, 32), (1, 2, 45, 32), seed=7)
    ref = pyfa.fa2_forward(q, k, v, causal=True, block_r=16, block_c=8, backend="emu")
    for seed in (1, 2, 3):
        out = pyfa.fa2_forward(q, k, v, causal=True, block_r=16, block_c=8, backend="emu",
                               emu_order="shuffled", emu_seed=seed)
        assert same_bits(out[0], ref[0]) and same_bits(out[1], ref[1])


def test_fully_masked_rows_give_zero_and_minus_inf():
    # Nq > Nk with causal: query i sees keys j <= i - (Nq - Nk), so the first 6 rows see none.
    q, k, v = make_inputs((1, 1, 10, 8), (1, 1, 4, 8), seed=3)
    o, lse = pyfa.fa2_forward(q, k, v, causal=True, block_r=4, block_c=2, backend="emu")
    assert np.all(o[0, 0, :6] == 0) and np.all(np.isneginf(lse[0, 0, :6]))
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[0, 0, 6:]))
    sim = pyfa.sim.fa2_forward(q, k, v, causal=True, block_r=4, block_c=2)
    assert same_bits(o, sim.o) and same_bits(lse, sim.lse)


def test_ranks_and_noncontiguous_inputs():
    q, k, v = make_inputs((2, 3, 24, 16), (2, 3, 24, 16), seed=5)
    o4, lse4 = pyfa.fa2_forward(q, k, v, backend="emu")
    o3, lse3 = pyfa.fa2_forward(q[1], k[1], v[1], backend="emu")
    o2, lse2 = pyfa.fa2_forward(q[1, 2], k[1, 2], v[1, 2], backend="emu")
    assert o3.shape == (3, 24, 16) and lse3.shape == (3, 24)
    assert o2.shape == (24, 16) and lse2.shape == (24,)
    assert same_bits(o3, o4[1]) and same_bits(o2, o4[1, 2]) and same_bits(lse2, lse4[1, 2])
    # Non-contiguous views: a transposed layout and a strided slice give the same bits.
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    big = np.zeros((2, 3, 48, 16), np.float32)
    big[:, :, ::2] = k
    o_nc, _ = pyfa.fa2_forward(qt, big[:, :, ::2], v, backend="emu")
    assert not qt.flags.c_contiguous and same_bits(o_nc, o4)


def test_attention_returns_o_and_default_scale():
    q, k, v = make_inputs((1, 1, 16, 8), (1, 1, 16, 8), seed=9)
    o = pyfa.attention(q, k, v, backend="emu")
    o_explicit = pyfa.attention(q, k, v, scale=float(1 / np.sqrt(np.float32(8))), backend="emu")
    assert same_bits(o, pyfa.fa2_forward(q, k, v, backend="emu")[0])
    assert same_bits(o, o_explicit)
    o_half = pyfa.attention(q, k, v, scale=0.5, backend="emu")
    assert rel_err(o_half, attention_ref(q, k, v, scale=0.5)[0]) < 1e-5


def test_repeated_calls_are_identical():
    q, k, v = make_inputs((2, 2, 50, 24), (2, 2, 50, 24), seed=11)
    first = pyfa.attention(q, k, v, causal=True, backend="emu")
    for workers in (1, 2, 3):
        assert same_bits(first, pyfa.attention(q, k, v, causal=True, backend="emu", emu_workers=workers))


def test_auto_backend_and_backend_list():
    assert "emu" in pyfa.backends()
    q, k, v = make_inputs((1, 1, 8, 4), (1, 1, 8, 4), seed=1)
    expected = "cuda" if grid.HAS_CUDA else "emu"
    assert same_bits(pyfa.attention(q, k, v), pyfa.attention(q, k, v, backend=expected))


def test_device_entry_point_and_c_default_scale():
    # pyfa_fa2_forward_device on the emulator takes host buffers; with scale = 0 the C side
    # picks 1/sqrt(d) itself, which must round exactly as Python's default does.
    from pyfa import _lib
    ffi, lib = _lib.load()
    q, k, v = make_inputs((13, 24), (11, 24), seed=4)
    o, lse = np.zeros((13, 24), np.float32), np.zeros(13, np.float32)
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=13, seqlen_k=11, head_dim=24,
                                        scale=0.0, causal=1))
    cfg = ffi.new("pyfa_config *", dict(backend=2, block_r=4, block_c=8))
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    _lib.check(lib.pyfa_fa2_forward_device(pr, cfg, ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse), ffi.NULL))
    sim = pyfa.sim.fa2_forward(q, k, v, causal=True, block_r=4, block_c=8)
    assert same_bits(o, sim.o) and same_bits(lse, sim.lse)


def test_read_only_and_broadcast_inputs():
    q, k, v = make_inputs((9, 8), (9, 8), seed=12)
    ref = pyfa.attention(q, k, v, backend="emu")
    q_ro = q.copy()
    q_ro.setflags(write=False)
    assert same_bits(pyfa.attention(q_ro, k, v, backend="emu"), ref)
    row = np.broadcast_to(v[3], v.shape)  # every key's value is the same row
    o = pyfa.attention(q, k, row, backend="emu")
    assert np.allclose(o, v[3], rtol=1e-6, atol=1e-6)
