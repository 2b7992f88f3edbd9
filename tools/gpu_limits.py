#!/usr/bin/env python3
"""GPU limits of every kernel pyfa can launch, on each architecture it is built for,
checked without a GPU.

Every launch: each row of the kernel table (src/kernels/table.h) and each kernel the CUDA
backend launches itself with `<<<...>>>` (direct_launches: dBias's fold). Two halves. The
device-profile table below (ARCHS: per architecture the shared memory a
block may opt in to, threads, registers and shared memory per SM, resident blocks) is
what tests/test_gpu_limits.py holds the tile chooser against: it runs the library's own
chooser (src/core/tiles.cpp, through the C ABI over tests/c/fake_cuda.cpp) with each
architecture's profile and checks every launch it would make (fast). The registers,
spills and static shared memory of each kernel come from `ptxas -v`, one compile of
src/backends/cuda/cuda_backend.cu per architecture (tools/ptxas_report.py; slow, about a
minute each): this tool runs them and writes docs/gpu_limits.md, whose tables the test
reads back.

    python tools/gpu_limits.py --write docs/gpu_limits.md [--reports DIR]

--reports DIR reuses `ptxas_report.py --arch sm_XX --json DIR/sm_XX.json` files where
they exist (and writes the missing ones there). Needs nvcc and a C++ compiler, no GPU.
Exit status: 0 every launch fits, 1 some launch exceeds a limit (listed), 2 a tool is
missing or a compile failed.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass(frozen=True)
class Arch:
    """One architecture's limits (CUDA C++ Programming Guide, "Compute Capabilities")."""
    cc: int
    example: str
    smem_block_optin: int   # bytes of shared memory one block may opt in to (static + dynamic)
    smem_sm: int            # bytes of shared memory per SM
    smem_reserved: int      # bytes the system reserves per resident block
    threads_block: int
    threads_sm: int
    blocks_sm: int
    regs_sm: int            # 32-bit registers per SM
    regs_thread: int


KIB = 1024
ARCHS = {
    "sm_75": Arch(75, "T4, RTX 20xx", 64 * KIB, 64 * KIB, 0, 1024, 1024, 16, 65536, 255),
    "sm_80": Arch(80, "A100", 163 * KIB, 164 * KIB, 1 * KIB, 1024, 2048, 32, 65536, 255),
    "sm_86": Arch(86, "A10, RTX 30xx", 99 * KIB, 100 * KIB, 1 * KIB, 1024, 1536, 16, 65536, 255),
    "sm_89": Arch(89, "L4, L40, RTX 40xx", 99 * KIB, 100 * KIB, 1 * KIB, 1024, 1536, 24, 65536, 255),
    "sm_90": Arch(90, "H100, H200", 227 * KIB, 228 * KIB, 1 * KIB, 1024, 2048, 32, 65536, 255),
    "sm_100": Arch(100, "B200", 227 * KIB, 228 * KIB, 1 * KIB, 1024, 2048, 32, 65536, 255),
    "sm_120": Arch(120, "RTX 50xx, RTX PRO 6000", 99 * KIB, 100 * KIB, 1 * KIB, 1024, 1536, 32, 65536, 255),
}
# Every architecture since compute capability 3.0.
MAX_GRID = (2 ** 31 - 1, 65535, 65535)
# Registers are allocated per warp in units of 256 (8 per thread).
REG_UNIT_PER_THREAD = 8

# The head dims the chooser is run at: every one the API accepts (1 to 256).
HEAD_DIMS = range(1, 257)
VARIANTS = {"auto": 0, "reference": 1, "fast": 2}
OPS = ("fa2_forward", "fa1_forward", "fa2_backward", "fa1_backward")


def table_rows(path=ROOT / "src" / "kernels" / "table.h"):
    """[(row id, row name, kernel function as ptxas_report names it)] of the kernel table."""
    text = re.sub(r"\s+", " ", path.read_text().replace("\\\n", " "))
    rows = []
    for m in re.finditer(r'X\((\d+), "([^"]+)", \w+, \w+, \d+, \d+, \d+, (\([^)]*\)|\w+),', text):
        fn = m.group(3).strip("()")
        if "<" not in fn and fn.endswith("_kernel"):
            fn = fn[: -len("_kernel")]
        rows.append((int(m.group(1)), m.group(2), fn))
    return rows


CUDA_SOURCES = ROOT / "src" / "backends" / "cuda"
# What launches each kernel outside the table, for the doc's "at" column.
DIRECT_WHERE = {"dbias_fold": "backward: dbias over a broadcast B or H"}


def direct_launches(folder=CUDA_SOURCES):
    """[(name, kernel function as ptxas_report names it, threads, dynamic smem bytes)] of
    every kernel the CUDA backend launches itself with `<<<grid, threads, smem, ...>>>`,
    outside the kernel table (dBias's fold): threads and shared memory are the launch's
    literals or the `constexpr int` constants of the same file."""
    out = []
    for path in sorted(folder.glob("*.cu")):
        text = path.read_text()
        consts = {k: int(v) for k, v in re.findall(r"constexpr int (\w+) = (\d+);", text)}
        for fn, threads, smem in re.findall(r"\b(\w+)_kernel<<<[^,]+,\s*(\w+),\s*(\w+)\s*,", text):
            value = lambda x: int(x) if x.isdigit() else consts[x]
            out.append((fn, fn, value(threads), value(smem)))
    return out


def blocks_per_sm(arch, registers, threads, smem):
    """(resident blocks per SM, what limits them) for a kernel of `registers` per thread,
    `threads` per block and `smem` bytes of shared memory per block (static + dynamic)."""
    warps = -(-threads // 32)
    regs_warp = -(-max(registers, 1) // REG_UNIT_PER_THREAD) * REG_UNIT_PER_THREAD * 32
    limits = {"blocks": arch.blocks_sm, "threads": arch.threads_sm // (32 * warps),
              "registers": arch.regs_sm // (regs_warp * warps)}
    if smem > 0:
        limits["shared memory"] = arch.smem_sm // (smem + arch.smem_reserved)
    what = min(limits, key=limits.get)
    return limits[what], what


# ---- the chooser, run through the C ABI over tests/c/fake_cuda.cpp

FAKE_CDEF = """
void fake_cuda_reset(int, int); const char* fake_cuda_log(void);
void fake_cuda_set_device(const char*, int, int, int); void fake_cuda_place(const void*, int, int);
void fake_cuda_set_current(int); int fake_cuda_current(void); void fake_cuda_set_stream_device(int);
void fake_cuda_set_profile(int, int64_t, int); int fake_cuda_checks(int64_t*); void fake_cuda_last_launch(int*);
"""


def build_fake(out, include_dir, version="fake"):
    """Compiles the C ABI's sources with tests/c/fake_cuda.cpp into `out`; the path. Built
    as `version` (pyfa's own, for a library pyfa's loader is to accept)."""
    cxx = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    core = ROOT / "src" / "core"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-O1", "-Wall", "-Wextra",
                    "-Werror", f"-I{ROOT / 'src'}", f"-I{include_dir}", f'-DPYFA_VERSION_STRING="{version}"',
                    str(core / "api.cpp"), str(core / "errors.cpp"), str(core / "tiles.cpp"),
                    str(core / "backend.cpp"), str(ROOT / "src" / "backends" / "cuda" / "cuda_adapter.cpp"),
                    str(ROOT / "tests" / "c" / "fake_cuda.cpp"), "-o", str(out)], check=True)
    return out


def open_fake(path):
    """(ffi, lib) of a library build_fake made: pyfa.h's declarations and the fake's controls."""
    import cffi
    text = (ROOT / "src" / "include" / "pyfa.h").read_text()
    cdef = text.split("/* PYFA_CDEF_BEGIN */")[1].split("/* PYFA_CDEF_END */")[0].replace("PYFA_API ", "")
    ffi = cffi.FFI()
    ffi.cdef(cdef + FAKE_CDEF)
    return ffi, ffi.dlopen(str(path))


class Fake:
    """Runs *_device calls through the fake library: the chooser and the launch checks are
    the library's own; "device memory" is host memory, and nothing is computed."""

    # op -> (full-size inputs, per-row inputs, full-size outputs, per-row outputs), in
    # the order of the entry point's arguments (per-row inputs before dO).
    SHAPES = {"fa2_forward": (3, 0, 1, 1), "fa1_forward": (3, 0, 1, 2),
              "fa2_backward": (4, 1, 3, 0), "fa1_backward": (4, 2, 3, 0)}

    def __init__(self, ffi, lib):
        self.ffi, self.lib = ffi, lib

    def call(self, op, arch=None, batch=1, heads=1, seqlen=64, head_dim=64, variant=0, block_r=0,
             block_c=0, refuse_launch=False):
        """(status, message, [(row, threads, dynamic smem, grid x, y, z)] that the launch
        checks saw), with `arch`'s profile on the fake device (its default when None).
        With refuse_launch the fake refuses the first launch, before anything is read or
        written, so the tensors can stand for any size."""
        ffi, lib = self.ffi, self.lib
        pr = ffi.new("pyfa_problem *", dict(batch=batch, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen,
                                            head_dim=head_dim))
        cfg = ffi.new("pyfa_config *", dict(backend=1, variant=variant, block_r=block_r, block_c=block_c))
        full, rows = (1, 1) if refuse_launch else (batch * heads * seqlen * head_dim, batch * heads * seqlen)
        n_full, n_rows, o_full, o_rows = self.SHAPES[op]
        new = lambda n: ffi.new("float[]", max(n, 1))
        x, r = new(full), new(rows)
        args = [x] * n_full + [r] * n_rows + ([x] if op.endswith("backward") else [])
        args += [new(full) for _ in range(o_full)] + [new(rows) for _ in range(o_rows)]
        lib.fake_cuda_reset(-1, 0 if refuse_launch else -1)
        if arch is not None:
            lib.fake_cuda_set_profile(0, arch.smem_block_optin, arch.threads_block)
        status = getattr(lib, f"pyfa_{op}_device")(pr, cfg, *args, ffi.cast("void *", 0))
        message = ffi.string(lib.pyfa_last_error()).decode()
        seen = ffi.new("int64_t[48]")
        n = lib.fake_cuda_checks(seen)
        return status, message, [tuple(int(seen[6 * i + j]) for j in range(6)) for i in range(n)]


KERNELS = {"fa1_forward": 0, "fa2_forward": 1, "fa1_backward": 2, "fa2_backward_preprocess": 3,
           "fa2_backward_dkdv": 4, "fa2_backward_dq": 5}


def fast_tiles(name):
    """(kernel, d, Br, Bc) of a fast row ("fa2_forward/fast d=64 128x64", or with copy
    stages: "fa2_backward_dq/fast d=128 64x64 2 stages"), or None."""
    m = re.match(r"(\w+)/fast d=(\d+) (\d+)x(\d+)( \d+ stages)?$", name)
    return m and (m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))


def op_of(kernel):
    return "fa2_backward" if kernel.startswith("fa2_backward") else kernel


def launch_plans(fake, arch, rows):
    """{(row, threads, dynamic smem): (op, variant, head_dim)} of every launch the library
    makes on `arch`: default tiles at every head dim, for every op and variant, and each
    fast row at its own tiles (a caller's block_r, block_c)."""
    plans = {}
    calls = [(op, variant, d, 0, 0) for op in OPS for variant in VARIANTS for d in HEAD_DIMS]
    calls += [(op_of(t[0]), "fast", t[1], t[2], t[3]) for t in map(fast_tiles, (r[1] for r in rows)) if t]
    for op, variant, d, br, bc in calls:
        _, _, checks = fake.call(op, arch, head_dim=d, variant=VARIANTS[variant], block_r=br, block_c=bc)
        for row, threads, smem, *_ in checks:
            plans.setdefault((row, threads, smem), (op, variant, d))
    return plans


def ptxas_facts(arch_name, folder):
    """{kernel function: ptxas_report.py's row} for one architecture: folder/ARCH.json,
    compiled now when it is not there."""
    path = Path(folder) / f"{arch_name}.json"
    if not path.is_file():
        cmd = [sys.executable, str(ROOT / "tools" / "ptxas_report.py"), "--arch", arch_name, "--json", str(path)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        # Exit 1 is a report that found spills or unfused products: the facts still hold.
        if proc.returncode not in (0, 1) or not path.is_file():
            raise RuntimeError(f"ptxas_report.py --arch {arch_name} failed:\n{proc.stdout}{proc.stderr}")
    return {k["kernel"]: k for k in json.loads(path.read_text())["kernels"]}


def row_smem(fake, row, name):
    """Dynamic shared memory of a fast row at its own tiles: the least of its tiles' rows
    (pyfa_variant_smem_bytes) or, for a row of more copy stages, what the chooser launches
    it with on a device that holds any (a fake profile of 1 GiB per block)."""
    kernel, d, br, bc = fast_tiles(name) or (name, 0, 0, 0)
    if not name.endswith(" stages"):
        return fake.lib.pyfa_variant_smem_bytes(KERNELS.get(kernel, -1), 2, br, bc, d)
    huge = Arch(0, "", 1 << 30, 1 << 30, 0, 1024, 2048, 32, 65536, 255)
    _, _, checks = fake.call(op_of(kernel), huge, head_dim=d, variant=VARIANTS["fast"], block_r=br, block_c=bc)
    return next((smem for r, _, smem, *_ in checks if r == row), -1)


def check_launches(arch, plans, facts, rows, fake, direct=None):
    """[(row name, function, registers, spills, static smem, threads, largest dynamic
    smem, where (op, variant, d) or a reason it is never launched, blocks per SM, limiter,
    problems)] per kernel-table row on `arch`, then per direct launch (direct_launches()
    unless given); problems lists every limit a launch exceeds."""
    worst = {}
    for (row, threads, smem), where in plans.items():
        if row not in worst or smem > worst[row][1]:
            worst[row] = (threads, smem, where)
    out = []
    for row, name, fn in rows:
        k = facts.get(fn)
        if k is None:
            out.append((name, fn, None, None, None, None, None, "-", 0, "-", [f"no ptxas facts for {fn}"]))
            continue
        regs, static = k["registers"], k["smem_static"]
        spills = k["spill_stores"] + k["spill_loads"]
        if row not in worst:
            tiles = fast_tiles(name)
            need = row_smem(fake, row, name)
            # Rows of the same tiles in other copy stages (the same bits): the chooser runs
            # the one with the most shared memory that fits.
            twin = next((n for r, n, _ in rows if r in worst and r != row and fast_tiles(n) == tiles), None)
            if tiles and twin and need <= arch.smem_block_optin:
                why = f"never: {twin} runs its tiles"
            elif need > arch.smem_block_optin:
                why = f"never: needs {need} B > {arch.smem_block_optin}"
            else:
                why = "never"
            fine = (tiles and twin) or need > arch.smem_block_optin
            out.append((name, fn, regs, spills, static, None, None, why, 0, "-",
                        [] if fine else [f"{name} is never launched"]))
            continue
        threads, smem, where = worst[row]
        out.append(fit(arch, name, fn, regs, spills, static, threads, smem,
                       f"{where[0]} {where[1]} d={where[2]}"))
    for name, fn, threads, smem in direct_launches() if direct is None else direct:
        k = facts.get(fn)
        if k is None:
            out.append((name, fn, None, None, None, None, None, "-", 0, "-", [f"no ptxas facts for {fn}"]))
            continue
        out.append(fit(arch, name, fn, k["registers"], k["spill_stores"] + k["spill_loads"], k["smem_static"],
                       threads, smem, DIRECT_WHERE.get(name, "the cuda backend")))
    return out


def fit(arch, name, fn, regs, spills, static, threads, smem, at):
    """check_launches' row of one launch: blocks per SM and every limit it exceeds."""
    total = static + smem
    blocks, limiter = blocks_per_sm(arch, regs, threads, total)
    problems = []
    if threads > arch.threads_block:
        problems.append(f"{threads} threads > {arch.threads_block}")
    if total > arch.smem_block_optin:
        problems.append(f"{total} B shared memory > {arch.smem_block_optin}")
    if regs > arch.regs_thread:
        problems.append(f"{regs} registers > {arch.regs_thread}")
    if blocks < 1:
        problems.append(f"no block fits on an SM ({limiter})")
    if spills:
        problems.append(f"spills {spills} B")
    return (name, fn, regs, spills, static, threads, smem, at, blocks, limiter, problems)


def grid_check(fake):
    """The launch grids at the largest batch and heads the API accepts (65535 each) and at
    the most tiles along a sequence (2^31 - 1 with block_r = block_c = 1): [(op, row,
    grid)], each within MAX_GRID, and whether one tile more is refused before launching."""
    seen = []
    for op in OPS:
        for batch, heads, seqlen, d, tiles in ((65535, 65535, 256, 16, 0), (1, 1, 2 ** 31 - 1, 1, 1)):
            _, _, checks = fake.call(op, batch=batch, heads=heads, seqlen=seqlen, head_dim=d, variant=1,
                                     block_r=tiles, block_c=tiles, refuse_launch=True)
            seen += [(op, c[0], c[3:]) for c in checks]
    over = fake.call("fa2_forward", seqlen=2 ** 31, head_dim=1, variant=1, block_r=1, block_c=1,
                     refuse_launch=True)
    return seen, over


def markdown(results, grids, over, nvcc):
    lines = ["# GPU limits of every kernel, per architecture", "",
             "Generated by `python tools/gpu_limits.py --write docs/gpu_limits.md` (do not edit by hand);",
             "`tests/test_gpu_limits.py` reads the tables back and holds the tile chooser against them.",
             f"Registers, spills and static shared memory: `ptxas -v` of nvcc {nvcc}, one compile of",
             "`src/backends/cuda/cuda_backend.cu` per architecture (`tools/ptxas_report.py`). Threads and",
             "dynamic shared memory: the library's own tile chooser, run through the C ABI over",
             "`tests/c/fake_cuda.cpp` with each architecture's profile, at every head dim 1 to 256, for",
             "every op and variant with default tiles, and each fast kernel at its own tiles; the largest",
             "dynamic shared memory of each kernel is shown with the call that asked for it (\"never\": no",
             "call launches it there, its tiles needing more shared memory than a block may have). Kernels",
             "the CUDA backend launches itself, outside the kernel table (`dbias_fold`: dBias's fold over a",
             "broadcast B or H), are checked at the threads and shared memory of their `<<<...>>>` in",
             "`src/backends/cuda/`. Blocks per SM: the resident blocks at that size, and what limits them.",
             "", "## Device profiles", "",
             "| arch | e.g. | smem per block (opt-in) | smem per SM | threads per block | threads per SM | "
             "blocks per SM | registers per SM |", "|---|---|---|---|---|---|---|---|"]
    for name, a in ARCHS.items():
        lines.append(f"| {name} | {a.example} | {a.smem_block_optin} | {a.smem_sm} | {a.threads_block} | "
                     f"{a.threads_sm} | {a.blocks_sm} | {a.regs_sm} |")
    lines += ["", "## Kernels", "",
              "| arch | kernel | function | registers | spills B | static smem B | threads | "
              "dynamic smem B | at (op, variant, d) or never | blocks per SM | limited by | within limits |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arch_name, rows in results.items():
        for name, fn, regs, spills, static, threads, smem, where, blocks, limiter, problems in rows:
            ok = "yes" if not problems else "NO: " + "; ".join(problems)
            lines.append(f"| {arch_name} | {name} | `{fn}` | {regs} | {spills} | {static} | {threads or '-'} | "
                         f"{'-' if smem is None else smem} | {where} | {blocks} | {limiter} | {ok} |")
    lines += ["", "## Grids at the API's largest problems", "",
              f"Every architecture allows grid x up to {MAX_GRID[0]}, y and z up to {MAX_GRID[1]}. The API",
              "takes batch and heads up to 65535 (grid z and y) and at most 2^31 - 1 tiles along a",
              "sequence (grid x): the launches at those sizes, refused at their launch check so that",
              "nothing is allocated:", "", "| op | kernel row | grid (x, y, z) |", "|---|---|---|"]
    for op, row, grid in grids:
        lines.append(f"| {op} | {row} | {grid} |")
    status, message, _ = over
    lines += ["", f"One tile more (seqlen 2^31 with 1 x 1 tiles): status {status}, \"{message}\".", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", type=Path, help="the Markdown file to write (docs/gpu_limits.md)")
    ap.add_argument("--reports", type=Path, help="folder of ptxas_report.py --json files, reused and filled")
    args = ap.parse_args(argv)
    from ptxas_report import find_nvcc
    nvcc = find_nvcc()
    if nvcc is None:
        print("gpu_limits: nvcc not found", file=sys.stderr)
        return 2
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release ([\d.]+)", version)
    sys.path.insert(0, str(ROOT))
    import pyfa
    if args.reports:
        args.reports.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            fake = Fake(*open_fake(build_fake(Path(tmp, "libpyfa_fake_cuda.so"), pyfa.get_include())))
            rows = table_rows()
            results = {}
            for arch_name, arch in ARCHS.items():
                facts = ptxas_facts(arch_name, args.reports or tmp)
                results[arch_name] = check_launches(arch, launch_plans(fake, arch, rows), facts, rows, fake)
                print(f"gpu_limits: {arch_name}: {len(results[arch_name])} kernels", file=sys.stderr)
            grids, over = grid_check(fake)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"gpu_limits: {e}", file=sys.stderr)
            return 2
    text = markdown(results, grids, over, release.group(1) if release else "?")
    if args.write:
        args.write.write_text(text)
    else:
        print(text)
    bad = [(a, r[0], r[-1]) for a, rs in results.items() for r in rs if r[-1]]
    for a, name, problems in bad:
        print(f"gpu_limits: {a} {name}: {'; '.join(problems)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
