#!/usr/bin/env python3
"""ptxas resource report of every CUDA kernel, for one GPU architecture (default sm_90).

Compiles src/backends/cuda/cuda_backend.cu (which includes every kernel) to a cubin with
`nvcc -Xptxas -v`, using the CUDA flags of CMakeLists.txt (the numerical contract's
-fmad=false -ftz=false -prec-div=true -prec-sqrt=true), and prints one row per kernel:
registers, static shared memory, spill stores and loads, stack frame, and the float
instructions of the kernel's PTX: `fma.rn.f32` (every fusion is a written pyfa_fma,
docs/numerics.md; each kernel forms at least one inner product, so each must hold some),
`mul.rn.f32` and `add.rn.f32` (what the contract keeps separate).

The kernels are runtime-parametrized: d, Br and Bc are arguments, and each kernel has a
single instantiation. So ptxas sees one function per kernel, and its registers and spills
hold for every head dim and tile; what does depend on d and the tiles is the dynamic
shared memory, shown for the default tiles at each --head-dim (from pyfa.sim, whose
default tiles are sized for an H200's 227 KiB per block).

Needs nvcc, no GPU. Exit status: 0 clean, 1 a kernel spills or has no fma.rn.f32 (its
inner products are not fused), 2 nvcc missing or the compile failed.

    python tools/ptxas_report.py [--arch sm_90] [--head-dim 64 128] [--json report.json]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The contract's flags, used when CMakeLists.txt cannot be read (the report says so).
FALLBACK_CUDA_FLAGS = ["-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
                       "-Xcompiler=-ffp-contract=off,-fno-fast-math"]


def cuda_flags_from_cmake(path=ROOT / "CMakeLists.txt"):
    """The CUDA-only compile options of CMakeLists.txt ($<$<COMPILE_LANGUAGE:CUDA>:...>),
    so that the report compiles exactly as the library does. None if not found."""
    try:
        text = path.read_text()
    except OSError:
        return None
    m = re.search(r"\$<\$<COMPILE_LANGUAGE:CUDA>:([^>]*)>", text)
    return m.group(1).split() if m else None


def find_nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and Path(base, "bin", "nvcc").is_file():
            return str(Path(base, "bin", "nvcc"))
    return None


def demangle(names):
    """Demangled names through c++filt when it is there; the mangled ones otherwise."""
    filt = shutil.which("c++filt")
    if not filt or not names:
        return dict(zip(names, names))
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    return dict(zip(names, lines)) if out.returncode == 0 and len(lines) == len(names) \
        else dict(zip(names, names))


def kernel_key(demangled):
    """'pyfa_cuda_kernels::fa2_forward_kernel(AttentionParams)' -> 'fa2_forward', the name
    pyfa.api.KERNELS and pyfa.sim use; the demangled name when it does not follow that."""
    base = demangled.split("(")[0].split("::")[-1]
    return base[:-len("_kernel")] if base.endswith("_kernel") else base


def parse_ptxas(text):
    """{mangled entry: {registers, smem_static, spill_stores, spill_loads, stack_frame,
    barriers}} from ptxas -v output. Only entry functions (kernels) are kept."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
            kernels[current] = {"registers": None, "smem_static": 0, "spill_stores": None,
                                "spill_loads": None, "stack_frame": None, "barriers": 0}
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            # Properties of a non-entry function (a helper that was not inlined) are not
            # the kernel's; attribute the next properties line only to a known kernel.
            current = m.group(1) if m.group(1) in kernels else None
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            k = kernels[current]
            k["stack_frame"], k["spill_stores"], k["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            k = kernels[current]
            k["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            k["smem_static"] = int(s.group(1)) if s else 0
            b = re.search(r"used (\d+) barriers", line)
            k["barriers"] = int(b.group(1)) if b else 0
    return kernels


def ptx_sections(ptx):
    """{function name: its PTX text}, split at each top-level .entry / .func."""
    heads = list(re.finditer(r"^(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(?:entry|func)\s+"
                             r"(?:\([^)]*\)\s*)?([\w$]+)", ptx, re.M))
    out = {}
    for n, h in enumerate(heads):
        end = heads[n + 1].start() if n + 1 < len(heads) else len(ptx)
        out[h.group(1)] = ptx[h.start():end]
    return out


def dynamic_smem(kernel, head_dims):
    """{d: (Br, Bc, bytes)} of the default tiles, or a reason string."""
    try:
        import pyfa.sim as sim
    except Exception as e:  # the report stays useful without the simulator
        return f"pyfa.sim not importable: {e}"
    out = {}
    for d in head_dims:
        try:
            br, bc = sim.default_tiles(kernel, d)
            out[d] = (br, bc, sim.smem_bytes(kernel, br, bc, d))
        except ValueError:
            return "no layout in pyfa.sim"
    return out


def compile_report(nvcc, arch, source, flags, cubin=None):
    """Runs nvcc once; returns (kernels dict, PTX text, the command, nvcc's output). With
    `cubin` (a path), the compile also keeps a line table (-lineinfo, which changes no
    instruction) and the cubin is copied there, for tools/sass_report.py --cubin."""
    with tempfile.TemporaryDirectory(prefix="pyfa-ptxas-") as tmp:
        # pyfa.h includes the export header CMake generates; device code needs none of it.
        Path(tmp, "pyfa_export.h").write_text("#define PYFA_API\n")
        # -cubin skips the host compile; -keep leaves the PTX of the same compile beside it.
        cmd = [nvcc, "-cubin", f"-arch={arch}", *(["-lineinfo"] if cubin else []), "-Xptxas", "-v", "-keep",
               "-keep-dir", tmp, *flags, "-I", "src", "-I", "src/include", "-I", tmp,
               '-DPYFA_VERSION_STRING="ptxas-report"', "-o", str(Path(tmp, "kernels.cubin")), source]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed (exit {proc.returncode}):\n{log}")
        ptx_files = sorted(Path(tmp).glob("*.ptx"))
        ptx = "\n".join(p.read_text() for p in ptx_files)
        if cubin:
            shutil.copyfile(Path(tmp, "kernels.cubin"), cubin)
    return parse_ptxas(log), ptx, cmd, log


FLOAT_OPS = ("fma.rn.f32", "mul.rn.f32", "add.rn.f32")
# Kernels that form no inner product, so hold no fma.rn.f32 by design: dBias's fold over a
# broadcast B and H (issue 27) only adds.
NO_PRODUCTS = ("dbias_fold",)


def count_op(ptx, op):
    """Instructions `op` in PTX text (the mnemonic as a whole word)."""
    return len(re.findall(rf"(?<![\w.]){re.escape(op)}(?![\w.])", ptx))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90", help="GPU architecture (default sm_90)")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128],
                    help="head dims whose default tiles' dynamic shared memory is shown")
    ap.add_argument("--source", default="src/backends/cuda/cuda_backend.cu",
                    help="translation unit that includes every kernel (relative to the repo)")
    ap.add_argument("--json", help="also write the report as JSON here")
    ap.add_argument("--cubin", help="also keep the cubin here, with a line table (for sass_report.py --cubin)")
    args = ap.parse_args(argv)

    nvcc = find_nvcc()
    if not nvcc:
        print("ptxas_report: nvcc not found (PATH, CUDA_HOME, /usr/local/cuda); nothing to report")
        return 2
    flags = cuda_flags_from_cmake()
    flag_origin = "CMakeLists.txt"
    if flags is None:
        flags, flag_origin = FALLBACK_CUDA_FLAGS, "built-in copy (CMakeLists.txt not parsed)"
    try:
        kernels, ptx, cmd, _ = compile_report(nvcc, args.arch, args.source, flags, args.cubin)
    except RuntimeError as e:
        print(f"ptxas_report: {e}")
        return 2
    if not kernels:
        print(f"ptxas_report: no kernel found in {args.source}")
        return 2

    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release ([\d.]+)", version)
    sections = ptx_sections(ptx)
    names = demangle(list(kernels))
    rows = []
    for mangled, res in kernels.items():
        key = kernel_key(names[mangled])
        rows.append({"kernel": key, "function": names[mangled], **res,
                     **{op.replace(".", "_"): count_op(sections.get(mangled, ""), op)
                        for op in FLOAT_OPS},
                     "dynamic_smem_default_tiles": dynamic_smem(key, args.head_dim)})
    fma_total = count_op(ptx, "fma.rn.f32")

    print(f"ptxas report for {args.arch}: nvcc {release.group(1) if release else '?'}, "
          f"{args.source}, flags from {flag_origin}: {' '.join(flags)}")
    print("One row per kernel: each kernel has a single instantiation (d, Br, Bc are runtime "
          "arguments), so registers and spills hold for every head dim and tile.")
    dyn_heads = "".join(f" | dyn smem d={d} (default Br x Bc)" for d in args.head_dim)
    print(f"| kernel | registers | static smem B | spill stores B | spill loads B | stack frame B "
          f"| barriers | fma.rn.f32 | mul.rn.f32 | add.rn.f32{dyn_heads} |")
    print("|---" * (10 + len(args.head_dim)) + "|")
    for r in rows:
        dyn = r["dynamic_smem_default_tiles"]
        cells = [f"{dyn[d][2]} ({dyn[d][0]}x{dyn[d][1]})" if isinstance(dyn, dict) else dyn
                 for d in args.head_dim]
        print(f"| {r['kernel']} | {r['registers']} | {r['smem_static']} | {r['spill_stores']} | "
              f"{r['spill_loads']} | {r['stack_frame']} | {r['barriers']} | {r['fma_rn_f32']} | "
              f"{r['mul_rn_f32']} | {r['add_rn_f32']} | "
              + " | ".join(cells) + " |")
    spills = [r["kernel"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    unfused = [r["kernel"] for r in rows if not r["fma_rn_f32"] and r["kernel"] not in NO_PRODUCTS]
    ok = not spills and not unfused
    print(f"ptxas_report: {len(rows)} kernels, spills: {', '.join(spills) or 'none'}, "
          f"kernels without fma.rn.f32: {', '.join(unfused) or 'none'}, "
          f"fma.rn.f32 in the whole PTX: {fma_total} -> {'OK' if ok else 'FAIL'}")

    if args.json:
        report = {"arch": args.arch, "nvcc": release.group(1) if release else None,
                  "command": cmd, "flags_from": flag_origin, "kernels": rows,
                  "fma_rn_f32_total": fma_total, "ok": ok}
        for r in report["kernels"]:
            dyn = r["dynamic_smem_default_tiles"]
            if isinstance(dyn, dict):
                r["dynamic_smem_default_tiles"] = {str(d): {"block_r": v[0], "block_c": v[1], "bytes": v[2]}
                                                   for d, v in dyn.items()}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
