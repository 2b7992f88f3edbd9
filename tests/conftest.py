import pytest

import pyfa


def _cuda_usable():
    try:
        return "cuda" in pyfa.backends()
    except pyfa.LibraryNotFoundError:
        return False


HAS_CUDA = _cuda_usable()

# The backends every kernel test runs on: the emulator always, CUDA when a GPU is here.
BACKENDS = [
    "emu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here")),
]

# Thread orders of the emulator: a missing __syncthreads shows up as different bits.
EMU_ORDERS = ["forward", "reverse"]


def pytest_report_header(config):
    try:
        return f"pyfa backends: {pyfa.backends()}, library {pyfa.library_version()}"
    except pyfa.LibraryNotFoundError as e:
        return f"pyfa library not loaded: {e}"
