"""The case grid every kernel's bit-exact tests walk, and the runs they repeat it under."""

import zlib

import pytest

from conftest import HAS_CUDA

# (B, H, Nq, Nk, d, Br, Bc): N = 1, N < Br, tails (N not a multiple of Br or Bc),
# Br != Bc, Br = Bc = 1, Nq != Nk both ways (with causal and Nq > Nk the first rows see
# no key), every head dim of the contract's grid, and the default tiles (None).
CASES = [
    (1, 1, 1, 1, 1, 4, 4),
    (1, 2, 5, 5, 3, 8, 8),
    (2, 1, 37, 53, 16, 8, 16),
    (1, 1, 9, 7, 40, 1, 1),
    (1, 2, 33, 33, 64, 16, 32),
    (1, 1, 40, 70, 128, 32, 16),
    (1, 1, 20, 17, 256, 16, 8),
    (1, 1, 70, 40, 64, 32, 16),
    (1, 2, 100, 100, 64, None, None),
]

# The emulator under two thread orders (a missing __syncthreads shows as different bits),
# the native cpu backend (which ignores the order), and the GPU when one is here.
RUNS = [("emu", "forward"), ("emu", "reverse"), ("cpu", "forward"),
        pytest.param("cuda", "forward",
                     marks=pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here"))]


# The backends alone, for tests that do not vary the thread order.
BACKENDS = ["emu", "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA,
                                                                 reason="no usable CUDA GPU here"))]


def case_id(case):
    B, H, Nq, Nk, d, Br, Bc = case
    return f"B{B}H{H}-Nq{Nq}-Nk{Nk}-d{d}-Br{Br}-Bc{Bc}"


def case_seed(case):
    """A seed fixed by the case itself, the same in every process."""
    return zlib.crc32(case_id(case).encode())
