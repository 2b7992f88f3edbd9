"""The emulator runs kernels in the default FP environment whatever the caller's.

A caller with flush-to-zero and denormals-are-zero set in MXCSR (as some fast-math
libraries leave it) must get the same bits as anyone else, and its own MXCSR back."""

import ctypes
import platform
import shutil
import subprocess

import numpy as np
import pytest

import emu_abi
import pyfa.sim

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="MXCSR (FTZ/DAZ) exists on x86-64 only")

FTZ, DAZ = 1 << 15, 1 << 6
SMALLEST_NORMAL = np.finfo(np.float32).tiny

MXCSR_C = r"""
unsigned get_mxcsr(void) { unsigned m; __asm__ volatile("stmxcsr %0" : "=m"(m)); return m; }
void set_mxcsr(unsigned m) { __asm__ volatile("ldmxcsr %0" : : "m"(m)); }
"""


@pytest.fixture(scope="module")
def mxcsr(tmp_path_factory):
    """(get, set) of this thread's MXCSR, from a helper compiled here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the MXCSR helper")
    d = tmp_path_factory.mktemp("mxcsr")
    (d / "mxcsr.c").write_text(MXCSR_C)
    so = d / "libmxcsr.so"
    build = subprocess.run([cc, "-O1", "-shared", "-fPIC", str(d / "mxcsr.c"), "-o", str(so)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    lib = ctypes.CDLL(str(so))
    lib.get_mxcsr.restype = ctypes.c_uint
    lib.set_mxcsr.argtypes = [ctypes.c_uint]
    return lib.get_mxcsr, lib.set_mxcsr


def subnormal_problem():
    """Q, K of ordinary size; V so small that every P_ij V_j and every row of O is
    subnormal: flushing them, or reading V as zero, changes O."""
    t = emu_abi.tensors(("q", "k", "v"), 1, 2, 48, 16, seed=5)
    t["v"] = (t["v"] * np.float32(SMALLEST_NORMAL / 8)).astype(np.float32)
    return t


def assert_same_bits(got, want):
    differ = int(np.count_nonzero(got.view(np.uint32) != np.asarray(want, np.float32).view(np.uint32)))
    assert differ == 0, f"{differ} of {got.size} elements differ"


def run_fa2(t, workers):
    out = {**t, **emu_abi.tensors(("o", "lse"), 1, 2, 48, 16, fill=-1.0)}
    status, message = emu_abi.call("pyfa_fa2_forward", out, causal=True, workers=workers,
                                   block_r=16, block_c=16)
    assert status == emu_abi.OK, message
    return out["o"], out["lse"]


@pytest.mark.parametrize("workers", [1, 2])
def test_ftz_daz_caller_gets_the_default_environment_bits(mxcsr, workers):
    get_mxcsr, set_mxcsr = mxcsr
    t = subnormal_problem()
    o_ref, lse_ref = run_fa2(t, workers)
    sim = pyfa.sim.fa2_forward(t["q"], t["k"], t["v"], causal=True, block_r=16, block_c=16)
    assert_same_bits(o_ref, sim.o)
    assert_same_bits(lse_ref, sim.lse)
    subnormal = (o_ref != 0) & (np.abs(o_ref) < SMALLEST_NORMAL)
    assert subnormal.mean() > 0.9, "the problem must depend on subnormals to test anything"

    saved = get_mxcsr()
    caller = saved | FTZ | DAZ
    set_mxcsr(caller)
    try:
        o, lse = run_fa2(t, workers)
        after = get_mxcsr()
    finally:
        set_mxcsr(saved)
    assert after == caller, f"MXCSR was {caller:#x} before the call and {after:#x} after it"
    assert_same_bits(o, o_ref)
    assert_same_bits(lse, lse_ref)
