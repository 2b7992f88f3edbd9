"""Shared-memory sizes and default tiles: the simulator's mirror (pyfa/sim/tiles.py) equals the
library's one function per kernel, and the defaults fit."""

import numpy as np
import pytest

import pyfa
from pyfa.sim import tiles

KERNELS = sorted(tiles.SMEM_LAYOUTS)


@pytest.mark.parametrize("kernel", KERNELS)
def test_smem_bytes_match_the_library(kernel):
    for Br, Bc, d in [(1, 1, 1), (64, 64, 64), (32, 16, 128), (7, 13, 40), (128, 64, 256)]:
        assert pyfa.smem_bytes(kernel, Br, Bc, d) == tiles.smem_bytes(kernel, Br, Bc, d)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("d", [1, 3, 16, 40, 64, 128, 256])
def test_default_tiles_match_and_fit(kernel, d):
    Br, Bc = pyfa.default_tiles(kernel, d, backend="emu")
    assert (Br, Bc) == tiles.default_tiles(kernel, d)
    assert tiles.smem_bytes(kernel, Br, Bc, d) <= tiles.EMU_PROFILE.smem_per_block


def test_emulated_profile_is_the_h200s():
    prof = pyfa.device_profile("emu")
    assert prof["smem_per_block"] == tiles.EMU_PROFILE.smem_per_block == 227 * 1024
    assert prof["max_threads_per_block"] == 1024 and prof["sm_count"] == 132


def test_the_kernel_names_are_the_library_s():
    assert sorted(pyfa.api.KERNELS) == KERNELS


# (kernel's simulator, library op, d, Br, Bc): tiles one side would refuse must be refused
# by both, with the same message; the second case would ask the simulator for terabytes.
TOO_LARGE = [("fa2_forward", 96, 128, 128), ("fa1_forward", 64, 32, 512),
             ("fa2_backward", 64, 1 << 20, 1 << 20), ("fa1_backward", 128, 128, 64)]


def _sim_and_library_calls(op, d, Br, Bc):
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, 4, d), dtype=np.float32) for _ in range(4))
    kw = dict(block_r=Br, block_c=Bc)
    if op.endswith("forward"):
        return (lambda: getattr(pyfa.sim, op)(q, k, v, **kw),
                lambda: getattr(pyfa, op)(q, k, v, backend="emu", **kw))
    saved = {"fa2_backward": (q, np.zeros((1, 1, 4), np.float32)),
             "fa1_backward": (q, np.zeros((1, 1, 4), np.float32), np.ones((1, 1, 4), np.float32))}[op]
    return (lambda: getattr(pyfa.sim, op)(q, k, v, *saved, do, **kw),
            lambda: getattr(pyfa, op)(q, k, v, *saved, do, backend="emu", **kw))


@pytest.mark.parametrize("op,d,Br,Bc", TOO_LARGE)
def test_tiles_too_large_are_refused_alike(op, d, Br, Bc):
    sim_call, lib_call = _sim_and_library_calls(op, d, Br, Bc)
    with pytest.raises(pyfa.TileTooLargeError) as from_sim:
        sim_call()
    with pytest.raises(pyfa.TileTooLargeError) as from_lib:
        lib_call()
    assert isinstance(from_lib.value, pyfa.PyfaError) and isinstance(from_sim.value, ValueError)
    assert str(from_lib.value).startswith(str(from_sim.value)), (str(from_sim.value), str(from_lib.value))


def test_tiles_that_fit_still_run_in_the_simulator():
    q = np.zeros((1, 1, 4, 96), np.float32)
    Br, Bc = 64, 64
    assert tiles.smem_bytes("fa2_forward", Br, Bc, 96) <= tiles.EMU_PROFILE.smem_per_block
    assert pyfa.sim.fa2_forward(q, q, q, block_r=Br, block_c=Bc).o.shape == q.shape


def test_count_io_models_any_tiles():
    # The IO model counts what tiles of any size would move; only the kernels refuse them.
    io = pyfa.sim.count_io("fa1", batch=1, heads=1, seqlen_q=64, seqlen_k=64, head_dim=64,
                           block_r=32, block_c=512)
    assert io.total_reads > 0


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("given", [("block_r", 128), ("block_c", 128), ("block_r", 1), ("block_c", 3)])
def test_the_default_side_is_sized_for_the_given_one(kernel, d, given):
    name, value = given
    Br, Bc = tiles.default_tiles(kernel, d, **{name: value})
    assert (Br if name == "block_r" else Bc) == value
    free = Bc if name == "block_r" else Br
    assert tiles.fits(kernel, Br, Bc, d) or free == 1
    # The free side is the largest the rule reaches: its next step up, while still at or
    # below where the rule starts, does not fit.
    fa1 = kernel.startswith("fa1")
    if fa1:
        c0 = max(1, -(-(tiles.EMU_PROFILE.smem_per_block // 4) // (4 * d)))  # the paper's Bc
        start = c0 if name == "block_r" else min(value, d)
        up = free + 1
    else:
        start, up = 64, free * 2
    if up <= start and tiles.fits(kernel, Br, Bc, d):
        assert not tiles.fits(kernel, *((Br, up) if name == "block_r" else (up, Bc)), d)


def test_fa1_with_block_r_128_at_d16_runs_with_bc_for_that_br():
    """The default Bc of FA1 is the one for the caller's Br: at d = 16 the default Bc for
    the default Br does not fit beside Br = 128."""
    d = 16
    default_br, default_bc = tiles.default_tiles("fa1_forward", d)
    assert not tiles.fits("fa1_forward", 128, default_bc, d)
    Br, Bc = tiles.default_tiles("fa1_forward", d, block_r=128)
    assert Br == 128 and Bc < default_bc and tiles.fits("fa1_forward", Br, Bc, d)
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 2, 300, d)).astype(np.float32) for _ in range(4))
    o, m, l = pyfa.fa1_forward(q, k, v, block_r=128, backend="emu")
    o2, m2, l2 = pyfa.fa1_forward(q, k, v, block_r=128, block_c=Bc, backend="emu")
    r = pyfa.sim.fa1_forward(q, k, v, block_r=128)
    for a, b, c in [(o, o2, r.o), (m, m2, r.m), (l, l2, r.l)]:
        assert a.tobytes() == b.tobytes() == c.tobytes()
    grads = pyfa.fa1_backward(q, k, v, o, m, l, do, block_r=128, backend="emu")
    ref = pyfa.sim.fa1_backward(q, k, v, o, m, l, do, block_r=128)
    for a, b in zip(grads, (ref.dq, ref.dk, ref.dv)):
        assert a.tobytes() == b.tobytes()
    # The other side too: Bc given, Br sized for it.
    wide = 1400
    Br2, Bc2 = tiles.default_tiles("fa1_forward", d, block_c=wide)
    assert Bc2 == wide and Br2 < default_br and tiles.fits("fa1_forward", Br2, Bc2, d)
    assert not tiles.fits("fa1_forward", Br2 + 1, Bc2, d)
    o3, _, _ = pyfa.fa1_forward(q, k, v, block_c=wide, backend="emu")
    o4, _, _ = pyfa.fa1_forward(q, k, v, block_r=Br2, block_c=wide, backend="emu")
    assert o3.tobytes() == o4.tobytes() == pyfa.sim.fa1_forward(q, k, v, block_c=wide).o.tobytes()
