"""Shared-memory sizes and default tiles: the simulator's mirror (sim/tiles.py) equals the
library's one function per kernel, and the defaults fit."""

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
