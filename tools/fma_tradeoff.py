#!/usr/bin/env python3
"""The measurements behind the numerical contract's decision to fuse (docs/numerics.md §4).

1. GPU side (needs nvcc, no GPU): float instructions per kernel in the PTX for sm_90, with
   the library's flags (-fmad=false), for the kernels as shipped (every pyfa_fma a
   fma.rn.f32) and for the same source with pyfa_fma written as a multiply then an add
   (the arithmetic of contract v1). "mul->add" counts the multiplications whose result is
   an operand of an add or sub: what fusion could still take.
2. NumPy cost of the simulator's exact fma: one step of an inner product, s = fma32(a, b, s)
   in reused buffers as dot_rows runs it, against s = s + a*b in two float32 ufuncs.
3. The simulators with fma32 against the same simulators with fma32 replaced by a multiply
   then an add (everything else unchanged): time on tools/bench.py --quick's problem, and
   accuracy of every output against the float64 references of tests/reference.py.

Ratios are measured side by side in one process (interleaved rounds, fastest round), so a
busy machine slows both sides alike.

    python tools/fma_tradeoff.py [--skip-ptx] [--skip-accuracy]
"""

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

import pyfa.sim as sim  # noqa: E402
from pyfa.sim import numerics as nx  # noqa: E402
from ptxas_report import (cuda_flags_from_cmake, demangle, find_nvcc, kernel_key,  # noqa: E402
                          ptx_sections)
from reference import attention_grad_ref, attention_ref  # noqa: E402

F32 = np.float32
UNFUSED_FMA = "PYFA_HD float pyfa_fma(float a, float b, float c) { return a * b + c; }"


# ----------------------------------------------------------------------------- 1. PTX

def mul_feeding_add(ptx):
    """mul.rn.f32 results used as an operand of an add.rn.f32 or sub.rn.f32."""
    products = set(re.findall(r"mul\.rn\.f32\s+(%f\d+)", ptx))
    count = 0
    for m in re.finditer(r"(?:add|sub)\.rn\.f32\s+%f\d+,\s*([^;]+);", ptx):
        count += sum(1 for op in m.group(1).split(",") if op.strip() in products)
    return count


def kernel_ptx(nvcc, src_dir, flags):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.ptx"
        # pyfa.h includes the export header CMake generates; device code needs none of it.
        Path(tmp, "pyfa_export.h").write_text("#define PYFA_API\n")
        subprocess.run([nvcc, "-arch=sm_90", "-ptx", "-std=c++17", *flags, "-I", str(src_dir),
                        "-I", str(src_dir / "include"), "-I", tmp,
                        str(src_dir / "backends" / "cuda" / "cuda_backend.cu"), "-o", str(out)],
                       check=True, capture_output=True, text=True)
        return out.read_text()


def ptx_table(nvcc):
    """{variant: {kernel: {op: count}}} for the shipped and the unfused source."""
    flags = [f for f in (cuda_flags_from_cmake() or []) if not f.startswith("-Xcompiler")]
    flags = flags or ["-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true"]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        unfused = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", unfused)
        header = unfused / "common" / "numerics.h"
        text = header.read_text()
        fused_def = re.search(r"PYFA_HD float pyfa_fma\(float a, float b, float c\) \{.*?\n\}",
                              text, re.S)
        if fused_def is None:
            raise RuntimeError("pyfa_fma not found in numerics.h")
        header.write_text(text.replace(fused_def.group(0), UNFUSED_FMA))
        for variant, src_dir in (("fused (shipped)", ROOT / "src"), ("unfused", unfused)):
            ptx = kernel_ptx(nvcc, src_dir, flags)
            sections = ptx_sections(ptx)
            names = demangle([n for n in sections if "kernel" in n])
            out[variant] = {kernel_key(names[n]): {
                "fma": len(re.findall(r"\bfma\.rn\.f32\b", sections[n])),
                "mul": len(re.findall(r"\bmul\.rn\.f32\b", sections[n])),
                "add+sub": len(re.findall(r"\b(?:add|sub)\.rn\.f32\b", sections[n])),
                "mul->add": mul_feeding_add(sections[n])} for n in names}
    return out


# ---------------------------------------------------------------------- 2. NumPy cost

def interleaved(fns, rounds=15, reps=50):
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for n, fn in enumerate(fns):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best[n] = min(best[n], (time.perf_counter() - t) / reps)
    return best


def step_cost(shape):
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(shape, dtype=F32) for _ in range(3))
    out = np.empty(shape, F32)
    a64, b64, c64 = (x.astype(np.float64) for x in (a, b, c))
    w = nx._FmaScratch(shape)

    def unfused():
        np.multiply(a, b, out=out)
        np.add(c, out, out=out)

    def fused():
        np.multiply(a64, b64, out=w.p)
        nx._fma_step(c64, out, w)

    with np.errstate(all="ignore"):
        return interleaved([unfused, fused])


# ------------------------------------------------------- 3. simulators, fused or not

def _unfused_fma32(a, b, c):
    return (np.asarray(a, F32) * np.asarray(b, F32) + np.asarray(c, F32)).astype(F32)


def _unfused_sum(a64, b64, shape, keep=None):
    total = np.zeros(shape, F32)
    for x in range(a64.shape[0]):
        step = total + (a64[x].astype(F32) * b64[x].astype(F32))
        total = step if keep is None else np.where(keep[x], step, total)
    return total


@contextlib.contextmanager
def unfused_simulator():
    """The simulators with every fma32 a multiply then an add (contract v1's arithmetic)."""
    saved = nx.fma32, nx._fma_sum
    nx.fma32, nx._fma_sum = _unfused_fma32, _unfused_sum
    try:
        yield
    finally:
        nx.fma32, nx._fma_sum = saved


def run_all(q, k, v, do, causal):
    f2 = sim.fa2_forward(q, k, v, causal=causal)
    g2 = sim.fa2_backward(q, k, v, f2.o, f2.lse, do, causal=causal)
    f1 = sim.fa1_forward(q, k, v, causal=causal)
    g1 = sim.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do, causal=causal)
    return {"FA2 O": f2.o, "FA2 dQ": g2.dq, "FA2 dK": g2.dk, "FA2 dV": g2.dv,
            "FA1 O": f1.o, "FA1 dQ": g1.dq, "FA1 dK": g1.dk, "FA1 dV": g1.dv}


def errors(x, ref):
    """(max |x - ref| / max |ref|, rms(x - ref) / rms(ref))."""
    diff = x.astype(np.float64) - ref
    return (np.abs(diff).max() / np.abs(ref).max(),
            np.sqrt(np.mean(diff ** 2) / np.mean(ref ** 2)))


def accuracy(shape, causal, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(shape, dtype=F32) for _ in range(4))
    o_ref, dq_ref, dk_ref, dv_ref = attention_grad_ref(q, k, v, do, causal=causal)
    assert np.allclose(o_ref, attention_ref(q, k, v, causal=causal)[0])
    refs = {"O": o_ref, "dQ": dq_ref, "dK": dk_ref, "dV": dv_ref}
    fused = run_all(q, k, v, do, causal)
    with unfused_simulator():
        unfused = run_all(q, k, v, do, causal)
    return {name: (errors(unfused[name], refs[name.split()[1]]),
                   errors(fused[name], refs[name.split()[1]])) for name in fused}


def sim_times(shape):
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal(shape, dtype=F32) for _ in range(4))
    f2 = sim.fa2_forward(q, k, v)
    f1 = sim.fa1_forward(q, k, v)
    jobs = {
        "fa2 forward": lambda: sim.fa2_forward(q, k, v),
        "fa1 forward": lambda: sim.fa1_forward(q, k, v),
        "fa2 backward": lambda: sim.fa2_backward(q, k, v, f2.o, f2.lse, do),
        "fa1 backward": lambda: sim.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do),
    }

    def unfused(job):
        def run():
            with unfused_simulator():
                job()
        return run

    return {name: interleaved([unfused(job), job], rounds=3, reps=1) for name, job in jobs.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-ptx", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args(argv)

    if not args.skip_ptx:
        nvcc = find_nvcc()
        if nvcc is None:
            print("1. PTX: nvcc not found, skipped")
        else:
            table = ptx_table(nvcc)
            print("1. PTX float instructions per kernel (sm_90, -fmad=false): "
                  "fused (shipped) / unfused")
            print("| kernel | fma.rn.f32 | mul.rn.f32 | add+sub.rn.f32 | mul->add |")
            print("|---|---|---|---|---|")
            fused, unfused = table["fused (shipped)"], table["unfused"]
            for kernel in fused:
                f, u = fused[kernel], unfused.get(kernel, {})
                cells = [f"{f[op]} / {u.get(op, '?')}"
                         for op in ("fma", "mul", "add+sub", "mul->add")]
                print(f"| {kernel} | " + " | ".join(cells) + " |")

    print("\n2. NumPy, one inner-product step (fastest of 15 interleaved rounds of 50)")
    for shape in ((64, 64), (256, 256)):
        unfused_s, fused_s = step_cost(shape)
        print(f"   {shape[0]}x{shape[1]}: s + a*b {unfused_s * 1e6:7.1f} us, "
              f"fma32 {fused_s * 1e6:7.1f} us: {fused_s / unfused_s:.1f}x")

    print("\n3. Simulators, B=1 H=4 N=256 d=64 (tools/bench.py --quick), "
          "fastest of 3 interleaved rounds")
    for name, (unfused_s, fused_s) in sim_times((1, 4, 256, 64)).items():
        print(f"   {name:13s} multiply-then-add {unfused_s * 1e3:8.1f} ms, "
              f"fma32 {fused_s * 1e3:8.1f} ms: {fused_s / unfused_s:.1f}x")

    if not args.skip_accuracy:
        for shape, causal in (((1, 2, 256, 64), False), ((1, 2, 256, 64), True),
                              ((1, 1, 1024, 128), False)):
            print(f"\n   accuracy against float64, shape {shape}, causal={causal}: "
                  "max rel err / rms rel err, unfused -> fused")
            for name, ((u_max, u_rms), (f_max, f_rms)) in accuracy(shape, causal).items():
                print(f"   {name:7s} {u_max:.3e} -> {f_max:.3e}   {u_rms:.3e} -> {f_rms:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
