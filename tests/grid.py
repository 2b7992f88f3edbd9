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
    (1, 2, 130, 70, 64, 64, 64),
    (1, 1, 70, 150, 128, 64, 64),
]

# What a case on the GPU carries: the `gpu` marker, and a skip where no GPU is usable.
NEEDS_GPU = (pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here"))

# The emulator under two thread orders (a missing __syncthreads shows as different bits),
# the native cpu backend (which ignores the order), and the GPU when one is here.
RUNS = [("emu", "forward"), ("emu", "reverse"), ("cpu", "forward"),
        pytest.param("cuda", "forward", marks=NEEDS_GPU)]


# The backends alone, for tests that do not vary the thread order.
BACKENDS = ["emu", "cpu", pytest.param("cuda", marks=NEEDS_GPU)]


def case_id(case):
    B, H, Nq, Nk, d, Br, Bc = case
    return f"B{B}H{H}-Nq{Nq}-Nk{Nk}-d{d}-Br{Br}-Bc{Bc}"


def grouped(cases, name, ids=None):
    """The cases as parameters (named by `ids`, case_id by default), each in an xdist group
    of its own, so that the runs of a case share what is computed once for it (its
    simulator results) on one worker."""
    ids = ids or case_id
    return [pytest.param(c, id=ids(c), marks=pytest.mark.xdist_group(f"{name}-{ids(c)}")) for c in cases]


def case_seed(case):
    """A seed fixed by the case itself, the same in every process."""
    return zlib.crc32(case_id(case).encode())


# RUNS with the kernel variant: the emulator and the GPU run the readable kernels and the
# fast ones (src/kernels/fast/); the cpu backend has kernels of its own ("auto").
VARIANT_RUNS = [("emu", "forward", "reference"), ("emu", "reverse", "reference"),
                ("emu", "forward", "fast"), ("emu", "reverse", "fast"),
                ("cpu", "forward", "auto"), ("cuda", "forward", "reference"),
                ("cuda", "forward", "fast")]


def variant_params(cases):
    """(case, backend, order, variant) for every case and VARIANT_RUNS. Without tiles
    variant "fast" picks tiles of its own, which the simulator is not given here
    (tests/test_fast_kernels.py and its siblings cover them); "auto" runs instead, which
    must give the bits of the readable kernels at their default tiles, fast kernels or not."""
    out = []
    for case in cases:
        for backend, order, variant in VARIANT_RUNS:
            if variant == "fast" and (case[5] is None or case[6] is None):
                variant = "auto"
            marks = NEEDS_GPU if backend == "cuda" else ()
            out.append(pytest.param(case, backend, order, variant, marks=marks,
                                    id=f"{case_id(case)}-{backend}-{order}-{variant}"))
    return out


def run_variant(op_name, case, variant, call):
    """call() under `variant`. Where variant "fast" does not apply (some kernel of the op
    has no fast form at this head dim and these tiles, as the library's own table says),
    checks the ValueError that names it and returns None; else returns call()'s result."""
    import pyfa
    if variant == "fast":
        d, Br, Bc = case[4], case[5], case[6]
        kernels = pyfa.api.OPS[op_name].kernels
        if not all(pyfa.smem_bytes(k, Br, Bc, d, variant="fast") > 0 for k in kernels):
            with pytest.raises(ValueError, match="config->variant: fast: "):
                call()
            return None
    return call()
