"""Why pyfa multiplies then adds instead of using fmaf: the two costs, measured.

1. GPU side: instructions in the PTX of the kernels compiled with -fmad=false (what we
   ship: separate mul.rn.f32 and add.rn.f32) against -fmad=true (nvcc contracts them into
   fma.rn.f32). Needs nvcc; no GPU.
2. Simulator side: NumPy throughput of the inner-product step s = s + a*b done as
   multiply-then-add (two float32 ufuncs) against an exact float32 fma emulated through
   float64 with a round-to-odd correction (what mirroring fmaf bit for bit would cost).

    python tools/fma_tradeoff.py
"""

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def fma_f32(a, b, c):
    """Exact float32 fma(a, b, c) in NumPy. a*b is exact in float64 (48 bits); p + c is
    rounded to odd (TwoSum error term decides), so the final float32 rounding is not a
    double rounding."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bp = s - c64
    err = (p - bp) + (c64 - (s - bp))
    bits = s.view(np.uint64)
    inexact_even = (err != 0) & ((bits & np.uint64(1)) == 0) & np.isfinite(s)
    toward = np.where((err > 0) == (s > 0), np.uint64(1), np.uint64(np.iinfo(np.uint64).max))
    bits = np.where(inexact_even & (s != 0), bits + toward, bits)
    return bits.view(np.float64).astype(np.float32)


def ptx_counts(fmad):
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.ptx"
        subprocess.run([nvcc, "-arch=sm_90", "-ptx", f"-fmad={'true' if fmad else 'false'}",
                        "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
                        "-I", str(ROOT / "cuda"), "-I", str(ROOT / "cuda" / "include"),
                        str(ROOT / "cuda" / "launch" / "cuda_backend.cu"), "-o", str(out)],
                       check=True)
        text = out.read_text()
    return {op: len(re.findall(rf"\b{re.escape(op)}\b", text))
            for op in ("fma.rn.f32", "mul.rn.f32", "add.rn.f32", "sub.rn.f32")}


def throughput(fn, n, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return n / best / 1e6


def main():
    for fmad in (False, True):
        counts = ptx_counts(fmad)
        if counts is None:
            print("nvcc not found: PTX counts skipped")
            break
        print(f"PTX (all kernels, sm_90) -fmad={str(fmad).lower():5}: " +
              ", ".join(f"{k} {v}" for k, v in counts.items()))

    n = 1 << 22
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    mul_add = throughput(lambda: c + a * b, n)
    fused = throughput(lambda: fma_f32(a, b, c), n)
    print(f"NumPy s + a*b (two float32 ufuncs): {mul_add:8.0f} M/s")
    print(f"NumPy exact fma emulation:          {fused:8.0f} M/s  ({mul_add / fused:.1f}x slower)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
