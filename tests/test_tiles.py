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
