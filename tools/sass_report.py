#!/usr/bin/env python3
"""SASS report of every CUDA kernel and variant: resources, hot-loop mix, H200 forecast.

Builds src/backends/cuda/cuda_backend.cu to an sm_90 cubin with the library's CUDA flags (read
from CMakeLists.txt, as tools/ptxas_report.py does), disassembles it with cuobjdump (the
`dev` extra: nvidia-cuda-cuobjdump) and prints, per kernel and variant:
- registers, spills (ptxas -v), dynamic shared memory at the default tiles and the
  theoretical occupancy they give on an H200;
- in the hot loops (the innermost loops, found as backward branches that enclose no other
  backward branch, that hold an FFMA) that an unmasked tile runs: issued instructions, the
  floating-point share of them, shared-memory load instructions per FLOP, and any integer
  division (inline I2F.*.RP sequences or calls to a subroutine that holds one);
- a forecast of H200 TFLOP/s for B = 4, H = 8, N = 4096 at each head dim, from the bound
  model in tools/README.md ("SASS report"), over those same loops.

Masked-tile loops. A fast kernel runs a tile the mask cuts (`cut`, common/mask.h
Band::cuts) through its own copy of an inner product (`if (!cut) {...} else {...}`); the
forecast problem has no mask, so no tile of it runs that copy. A hot loop is a masked-tile
loop when most of its instructions come (in any frame of nvdisasm's line table: the
kernel's line or a line it inlines) from a block that only a cut tile enters: the `else`
of `if (!cut)` or the body of `if (cut)` in the source. Those loops are counted apart
(`masked`, and the JSON's `hot_masked`) and left out of the mix and the forecast; loops
that test the mask per element run in every tile and stay in. Without nvdisasm no loop
can be told apart and every hot loop is counted (the header says so).
- its global stores (STG) by width, and how many of them are split vector stores: a store
  narrower than 128 bits whose source line (from nvdisasm's line table: the compile adds
  -lineinfo, which changes no instruction) calls a 16-byte store helper (st4, stg4).

The last line starts with `summary:` and lists, at the first --head-dim (default 64),
`NAME fp_share=X lds_per_flop=Y forecast_tflops=Z` per kernel and variant at its default
tiles, ` | ` between. A fast kernel compiled for several tile shapes gets a row for each.

Needs nvcc and cuobjdump (PATH, CUDA_HOME, or the nvidia-cuda-cuobjdump wheel), no GPU;
nvdisasm (nvidia-cuda-nvdisasm) for the store sites and the masked-tile loops: without it
the sites are left out and every hot loop is counted.
Exit status 0, or 2 when a tool is missing or the compile fails.

    python tools/sass_report.py [--head-dim 64 128] [--json report.json]
    python tools/sass_report.py --cubin K.cubin --ptxas-json P.json   # no compile: report
                                # on ptxas_report.py --cubin K.cubin --json P.json's build
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import ptxas_report  # noqa: E402  (flags, nvcc, ptxas -v parsing: one copy)

# ---- H200 (SXM) as the model sees it; tools/README.md says where each number comes from.
H200 = {
    "sms": 132,
    "clock_hz": 1.98e9,           # boost clock
    "issue_per_clk": 4,           # warp instructions per SM per clock (4 schedulers)
    "fp32_per_clk": 4,            # warp FFMA/FADD/FMUL per SM per clock (128 lanes)
    "mufu_per_clk": 0.5,          # warp MUFU per SM per clock (16 lanes)
    "smem_wavefronts_per_clk": 1,  # 128 bytes of shared memory per SM per clock
    "regs_per_sm": 65536,
    "max_warps_per_sm": 64,
    "max_blocks_per_sm": 32,
    "smem_per_sm": 233472,        # 228 KiB
    "smem_reserved_per_block": 1024,
    "latency_warps": 8,           # warps per SM that hide latency (2 per scheduler)
}
PROBLEM = {"batch": 4, "heads": 8, "seqlen": 4096}
# Decoding steps (issue 21): Nq = 1 against a Llama-3-8B-like cache (32 query heads over 8
# K/V heads, d = 128, causal, split_size "decode"), (batch, context) pairs. Memory-bound:
# the forecast is the step's HBM bytes (pyfa.sim.count_io of the readable FA2 forward the
# step runs) over the H200's 4.8 TB/s, beside the grid's blocks per SM.
DECODE = {"heads": 32, "heads_kv": 8, "head_dim": 128, "steps": [(1, 8192), (1, 32768), (16, 8192), (16, 32768)]}
HBM_BYTES_PER_S = 4.8e12


FP_OPCODES = {"FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "MUFU",
              "FRND", "F2F", "FSWZADD"}
FLOP_OF = {"FFMA": 2, "FADD": 1, "FMUL": 1}
FP32_PIPE = {"FFMA", "FADD", "FMUL"}


def find_tool(name):
    """nvcc's sibling, PATH, CUDA_HOME, or the NVIDIA wheel's bin folder."""
    found = shutil.which(name)
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and Path(base, "bin", name).is_file():
            return str(Path(base, "bin", name))
    try:
        import nvidia  # the nvidia-cuda-* wheels install into this namespace package
        for root in nvidia.__path__:
            for cand in Path(root).glob(f"*/bin/{name}"):
                if os.access(cand, os.X_OK):
                    return str(cand)
    except ImportError:
        pass
    return None


INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)(.*?);")


def parse_sass(text):
    """{mangled function: [(address, predicate, opcode, operands)]} from cuobjdump -sass."""
    funcs, cur = {}, None
    for line in text.splitlines():
        # The substring test first: a regular expression per line of a cubin's million
        # lines of SASS took seconds.
        m = "Function : " in line and re.search(r"Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3),
                        m.group(4).strip()))
    return funcs


def branch_target(operands):
    m = re.search(r"0x([0-9a-f]+)", operands)
    return int(m.group(1), 16) if m else None


def division_subroutines(insns):
    """Addresses of CALL targets whose body (up to its RET) holds an integer division."""
    out = set()
    by_addr = {a: n for n, (a, _, _, _) in enumerate(insns)}
    for _, _, op, ops in insns:
        if not op.startswith("CALL"):
            continue
        t = branch_target(ops)
        n = by_addr.get(t)
        while n is not None and n < len(insns):
            o = insns[n][2]
            if o.startswith("I2F.U32.RP") or o.startswith("I2F.U64.RP"):
                out.add(t)
                break
            if o.startswith("RET"):
                break
            n += 1
    return out


def loops(insns):
    """[(start, end)] of every backward branch: the loop body spans [target, branch]."""
    out = []
    for a, _, op, ops in insns:
        if op.startswith("BRA"):
            t = branch_target(ops)
            if t is not None and t <= a:
                out.append((t, a))
    return out


def hot_loops(insns):
    """Innermost loops holding an FFMA, each with its instruction mix for one iteration."""
    all_loops = loops(insns)
    divs = division_subroutines(insns)
    out = []
    for (s, e) in all_loops:
        if any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for (s2, e2) in all_loops):
            continue  # encloses another loop: not innermost
        body = [x for x in insns if s <= x[0] <= e]
        ops = [x[2] for x in body]
        if not any(o.split(".")[0] == "FFMA" for o in ops):
            continue
        base = [o.split(".")[0] for o in ops]
        n_div = sum(1 for o in ops if o.startswith("I2F.U32.RP") or o.startswith("I2F.U64.RP"))
        n_div += sum(1 for x in body if x[2].startswith("CALL") and branch_target(x[3]) in divs)
        lds = [o for o in ops if o.startswith("LDS")]
        out.append({
            "start": s, "end": e,
            "instructions": len(ops),
            "fp": sum(1 for b in base if b in FP_OPCODES),
            "fp32_pipe": sum(1 for b in base if b in FP32_PIPE),
            "mufu": base.count("MUFU"),
            "flop": sum(FLOP_OF.get(b, 0) for b in base),
            "lds": len(lds),
            "lds128": sum(1 for o in lds if ".128" in o),
            "smem_wavefronts": sum(smem_wavefronts(o) for o in ops),
            "int_div": n_div,
        })
    return out


def smem_wavefronts(op):
    """128-byte shared-memory wavefronts of one warp instruction, assuming no bank conflict
    and no broadcast (see tools/README.md)."""
    base = op.split(".")[0]
    if base not in ("LDS", "STS", "LDSM"):
        return 0
    if ".128" in op:
        return 4
    if ".64" in op:
        return 2
    return 1


def store_bits(op):
    """Width in bits of a global store opcode (STG.E, STG.E.64, STG.E.128, STG.E.U8...)."""
    for suffix, bits in ((".128", 128), (".64", 64), (".U16", 16), (".S16", 16), (".U8", 8), (".S8", 8)):
        if suffix in op:
            return bits
    return 32


LINE_NOTE = re.compile(r'File "([^"]+)", line (\d+)')
# The 16-byte store helpers of src/kernels/fast/fast_common.h: a narrower store at a line
# that calls one of them is a 16-byte store the compiler split.
VECTOR_STORE_CALL = re.compile(r"\b(st4|stg4)\(")
STORE_HELPERS = ("fast_common.h",)


def line_chains(nvdisasm_text):
    """{mangled function: [(address, opcode, chain)]} from `nvdisasm -gi`: each
    instruction's line-table entry, its frames [(file, line)] innermost first (the line,
    then each line it is inlined at, out to the kernel's own)."""
    funcs, cur, block, chain = {}, None, False, ()
    for line in nvdisasm_text.splitlines():
        m = line.startswith(".text.") and re.match(r"^\.text\.(\S+):\s*$", line)
        if m:
            cur, chain = funcs.setdefault(m.group(1), []), ()
            continue
        if line.lstrip().startswith("//##"):
            pairs = [(f, int(n)) for f, n in LINE_NOTE.findall(line)]
            chain = (chain if block else ()) + tuple(pairs[:1])
            block = True
            continue
        block = False
        m = INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(3), chain))
    return funcs


def global_store_sites(chains):
    """{mangled function: [(bits, (file, line) or None)]} of every STG, from line_chains.
    A store's site is the innermost frame of its line-table entry outside the store
    helpers' own file: the line that asked for the store."""
    return {fn: [(store_bits(op), next((fl for fl in chain if not fl[0].endswith(STORE_HELPERS)), None))
                 for _, op, chain in insns if op.startswith("STG")]
            for fn, insns in chains.items()}


# `if (!cut) {` (its `else` block is for cut tiles only) or `if (cut) {` (its own block).
CUT_IF = re.compile(r"\bif\s*\(\s*(!?)\s*cut\s*\)\s*\{")


def cut_only_lines(text):
    """The 1-based source lines inside blocks that only a tile the mask cuts enters: the
    `else { ... }` of `if (!cut) { ... }`, the body of `if (cut) { ... }`."""
    code = re.sub(r"//[^\n]*", lambda m: " " * len(m.group(0)), text)  # comments hold no braces that count

    def block_end(open_at):
        depth = 0
        for i in range(open_at, len(code)):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                return i
        return len(code) - 1

    def lines_of(a, b):
        return range(code.count("\n", 0, a) + 1, code.count("\n", 0, b) + 2)

    out = set()
    for m in CUT_IF.finditer(code):
        then_end = block_end(m.end() - 1)
        if not m.group(1):
            out.update(lines_of(m.end() - 1, then_end))
            continue
        e = re.compile(r"\s*else\s*\{").match(code, then_end + 1)
        if e:
            out.update(lines_of(e.end() - 1, block_end(e.end() - 1)))
    return out


def masked_tile_loop(loop, chain_at, cut_lines):
    """Whether a hot loop is a masked-tile loop: most of its instructions have a frame on a
    line only a cut tile runs. `chain_at` {address: chain}; `cut_lines(file)` that file's
    cut_only_lines."""
    addrs = [a for a in chain_at if loop["start"] <= a <= loop["end"]]
    cut = sum(1 for a in addrs if any(line in cut_lines(f) for f, line in chain_at[a]))
    return bool(addrs) and 2 * cut > len(addrs)


def store_summary(stores, sources):
    """(stores by width {bits: count}, split vector stores, ["file:line", ...] of the stores
    narrower than 128 bits) of one function; `sources` caches source files' lines."""
    by_width, split, sites = {}, 0, []
    for bits, site in stores:
        by_width[bits] = by_width.get(bits, 0) + 1
        if bits >= 128:
            continue
        text = ""
        if site:
            path = Path(site[0])
            if path not in sources:
                try:
                    sources[path] = path.read_text().splitlines()
                except OSError:
                    sources[path] = []
            lines = sources[path]
            text = lines[site[1] - 1] if 0 < site[1] <= len(lines) else ""
            where = f"{path.relative_to(ROOT / 'src') if path.is_relative_to(ROOT / 'src') else path}:{site[1]}"
            if where not in sites:
                sites.append(where)
        if VECTOR_STORE_CALL.search(text):
            split += 1
    return by_width, split, sites


def max_threads_attrs(cuobjdump, cubin):
    """{mangled function: threads} from __launch_bounds__ (EIATTR_MAX_THREADS)."""
    out = subprocess.run([cuobjdump, "-elf", cubin], capture_output=True, text=True).stdout
    res, cur = {}, None
    for line in out.splitlines():
        m = ".nv.info." in line and re.search(r"\.nv\.info\.(\S+)", line)
        if m:
            cur = m.group(1)
            continue
        if cur and "EIATTR_MAX_THREADS" in line:
            res[cur] = "pending"
            continue
        if cur and res.get(cur) == "pending":
            m = re.search(r"Value:\s*0x([0-9a-f]+)", line)
            if m:
                res[cur] = int(m.group(1), 16)
    return {k: v for k, v in res.items() if isinstance(v, int)}


def reference_threads():
    """{kernel: threads} of the readable kernels, from the constants in src/common/smem.h."""
    text = (ROOT / "src/common/smem.h").read_text()
    consts = dict((k, int(v)) for k, v in
                  re.findall(r"constexpr int (k\w+Threads) = (\d+);", text))
    return {"fa2_forward": consts.get("kFa2ForwardThreads"),
            "fa2_backward_preprocess": consts.get("kFa2BackwardThreads"),
            "fa2_backward_dkdv": consts.get("kFa2BackwardThreads"),
            "fa2_backward_dq": consts.get("kFa2BackwardThreads"),
            "fa1_forward": consts.get("kFa1ForwardThreads"),
            "fa1_backward": consts.get("kFa1BackwardThreads")}


def split_name(demangled):
    """'void ns::fa2_forward_fast_kernel<64, 64, 64>(AttentionParams)' ->
    ('fa2_forward', 'fast', (64, 64, 64)); the reference kernels have no template."""
    head = demangled.split("(")[0]
    targs = ()
    m = re.search(r"<([^>]*)>", head)
    if m:
        targs = tuple(int(t) for t in re.findall(r"-?\d+", m.group(1)))
        head = head[:m.start()]
    base = head.split("::")[-1].split()[-1]
    base = base[:-len("_kernel")] if base.endswith("_kernel") else base
    if base.endswith("_fast"):
        return base[:-len("_fast")], "fast", targs
    return base, "reference", targs


def fast_rows():
    """{(kernel, template arguments): (Br, Bc, copy stages, the most stages of its tiles)}
    of the kernel table's fast rows (src/kernels/table.h, through gpu_limits.table_rows):
    a fast kernel's template arguments are not all tiles (the dK/dV kernel's second is its
    copy stages), so its tiles are read from its row."""
    import gpu_limits
    rows = {}
    for _, name, fn in gpu_limits.table_rows():
        tiles = gpu_limits.fast_tiles(name)
        if tiles and "<" in fn:
            stages = re.search(r" (\d+) stages$", name)
            targs = tuple(int(t) for t in re.findall(r"-?\d+", fn.split("<", 1)[1]))
            rows[(tiles[0], targs)] = (tiles[2], tiles[3], int(stages.group(1)) if stages else 1)
    most = {}
    for (kernel, targs), (br, bc, stages) in rows.items():
        key = (kernel, targs[0], br, bc)
        most[key] = max(most.get(key, 1), stages)
    return {k: (*v, most[(k[0], k[1][0], v[0], v[1])]) for k, v in rows.items()}


def tiles_and_smem(kernel, variant, d, row=None):
    """(Br, Bc, dynamic smem bytes, default): a fast kernel's own tiles (`row`, its
    fast_rows entry) and whether they are the variant's default (of rows of the same tiles
    in several copy stages, the one of the most: the one an H200 runs); the readable
    kernel's default tiles. From the library (pyfa), or from pyfa.sim for the readable
    kernels when the library cannot be loaded; None if neither knows the kernel, variant
    and head dim. The bytes are pyfa.smem_bytes', the least of the rows of those tiles (a
    row of more stages holds more; on an H200 either leaves room for one block)."""
    try:
        import pyfa
        br, bc = pyfa.default_tiles(kernel, d, backend="emu", variant=variant)
        default = True
        if variant == "fast" and row:
            default = (row[0], row[1]) == (br, bc) and row[2] == row[3]
            br, bc = row[0], row[1]
        return br, bc, pyfa.smem_bytes(kernel, br, bc, d, variant=variant), default
    except Exception:
        if variant != "reference":
            return None
    try:
        import pyfa.sim as sim
        br, bc = sim.default_tiles(kernel, d)
        return br, bc, sim.smem_bytes(kernel, br, bc, d), True
    except Exception:
        return None


def occupancy(registers, threads, smem):
    """(blocks per SM, warps per SM, limiter) on an H200."""
    g = H200
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    lim = {"blocks": g["max_blocks_per_sm"],
           "warps": g["max_warps_per_sm"] // warps,
           "registers": g["regs_per_sm"] // (regs_per_warp * warps)}
    if smem is not None:
        lim["shared memory"] = g["smem_per_sm"] // (smem + g["smem_reserved_per_block"])
    name = min(lim, key=lim.get)
    blocks = lim[name]
    return blocks, blocks * warps, name


def grid_blocks(kernel, br, bc, d):
    B, H, N = PROBLEM["batch"], PROBLEM["heads"], PROBLEM["seqlen"]
    if kernel in ("fa1_forward", "fa1_backward"):
        return B * H
    if kernel == "fa2_backward_dkdv":
        return B * H * math.ceil(N / bc)
    return B * H * math.ceil(N / br)


def forecast(kernel, loop, blocks_per_sm, threads, br, bc, d):
    """H200 TFLOP/s from the hot loops' bound (issue, fp32 pipe, MUFU, shared memory),
    times a latency factor (resident warps / latency_warps, at most 1) and the grid's
    wave efficiency. None without a hot loop or with no block fitting an SM."""
    g = H200
    if not loop or loop["flop"] == 0 or blocks_per_sm == 0:
        return None
    cycles = max(loop["instructions"] / g["issue_per_clk"],
                 loop["fp32_pipe"] / g["fp32_per_clk"],
                 loop["mufu"] / g["mufu_per_clk"],
                 loop["smem_wavefronts"] / g["smem_wavefronts_per_clk"])
    flop_per_clk_sm = 32 * loop["flop"] / cycles
    blocks = grid_blocks(kernel, br, bc, d)
    # A grid smaller than the machine leaves SMs with fewer blocks (or none).
    resident = min(blocks_per_sm, math.ceil(blocks / g["sms"]))
    waves = math.ceil(blocks / (g["sms"] * resident))
    wave_eff = blocks / (waves * g["sms"] * resident)
    latency = min(1.0, resident * math.ceil(threads / 32) / g["latency_warps"])
    return flop_per_clk_sm * g["sms"] * g["clock_hz"] * latency * wave_eff / 1e12


def decode_rows(rows):
    """The decoding steps of DECODE on the readable fa2_forward kernel (its registers and
    threads at d = 128): grid (packed on the H200's 132 SMs, or one block per query head)
    and Q tile as the library launches them (pyfa.sim.tiles.fa2_launch), blocks per SM
    beside the resident ones that Q tile allows, HBM bytes (fp32) against the floor (K and V once, q and o), and the time those
    bytes take at 4.8 TB/s. [] without the simulator."""
    try:
        import pyfa.sim as sim
        from pyfa.checks import decode_split_size
        from pyfa.sim.tiles import fa2_launch
    except Exception:
        return []
    H, Hkv, d = DECODE["heads"], DECODE["heads_kv"], DECODE["head_dim"]
    split = decode_split_size(d)
    ref = next((r for r in rows if r["kernel"] == "fa2_forward" and r["variant"] == "reference"
                and r["head_dim"] == d), None)
    br, bc = sim.default_tiles("fa2_forward", d)
    out = []
    for B, N in DECODE["steps"]:
        chunks = -(-N // split)
        qg, rows_br = fa2_launch(B, H, Hkv, 1, N, br, split, None)
        packed = qg > 1
        blocks = B * chunks * (H // qg) * -(-qg // rows_br)
        resident = (occupancy(ref["registers"], ref["threads"], sim.smem_bytes("fa2_forward", rows_br, bc, d))[0]
                    if ref and ref["registers"] and ref["threads"] else None)
        rec = sim.count_io("fa2", batch=B, heads=H, heads_kv=Hkv, seqlen_q=1, seqlen_k=N, head_dim=d,
                           causal=True, split_size=split)
        floor = 4 * (2 * B * Hkv * N * d + 2 * B * H * d)
        out.append({"batch": B, "context": N, "split_size": split, "packed": packed, "blocks": blocks,
                    "blocks_per_sm": blocks / H200["sms"], "block_r": rows_br, "block_c": bc,
                    "resident_per_sm": resident,
                    "hbm_bytes": rec.total, "over_floor": rec.total / floor,
                    "forecast_us": rec.total / HBM_BYTES_PER_S * 1e6})
    return out


def aggregate(loops_):
    """The hot loops of one kernel summed, one iteration of each (tools/README.md)."""
    if not loops_:
        return None
    keys = ("instructions", "fp", "fp32_pipe", "mufu", "flop", "lds", "lds128",
            "smem_wavefronts", "int_div")
    return {k: sum(x[k] for x in loops_) for k in keys}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90", help="GPU architecture (default sm_90)")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--source", default="src/backends/cuda/cuda_backend.cu")
    ap.add_argument("--json", help="also write the report as JSON here")
    ap.add_argument("--cubin", help="report on this cubin instead of compiling (ptxas_report.py --cubin)")
    ap.add_argument("--ptxas-json", help="with --cubin: ptxas_report.py --json of the same compile")
    args = ap.parse_args(argv)

    nvcc = ptxas_report.find_nvcc()
    cuobjdump = find_tool("cuobjdump")
    if not nvcc or not cuobjdump:
        print(f"sass_report: {'nvcc' if not nvcc else 'cuobjdump'} not found "
              "(install the dev extra: pip install nvidia-cuda-cuobjdump); nothing to report")
        return 2
    flags = ptxas_report.cuda_flags_from_cmake()
    origin = "CMakeLists.txt"
    if flags is None:
        flags, origin = ptxas_report.FALLBACK_CUDA_FLAGS, "built-in copy"
    if bool(args.cubin) != bool(args.ptxas_json):
        print("sass_report: --cubin and --ptxas-json go together (ptxas_report.py --json J --cubin C)")
        return 2
    with tempfile.TemporaryDirectory(prefix="pyfa-sass-") as tmp:
        if args.cubin:
            # ptxas_report.py's compile (the same flags), its resources by kernel function.
            cubin = args.cubin
            by_function = {r["function"]: r for r in json.loads(Path(args.ptxas_json).read_text())["kernels"]}
        else:
            Path(tmp, "pyfa_export.h").write_text("#define PYFA_API\n")
            cubin = str(Path(tmp, "kernels.cubin"))
            cmd = [nvcc, "-cubin", f"-arch={args.arch}", "-lineinfo", "-Xptxas", "-v", *flags, "-I", "src",
                   "-I", "src/include", "-I", tmp, '-DPYFA_VERSION_STRING="sass-report"',
                   "-o", cubin, args.source]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"sass_report: nvcc failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
                return 2
            resources = ptxas_report.parse_ptxas(proc.stdout + proc.stderr)
        dis = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True)
        if dis.returncode != 0:
            print(f"sass_report: cuobjdump failed: {dis.stderr}")
            return 2
        sass = parse_sass(dis.stdout)
        bounds = max_threads_attrs(cuobjdump, cubin)
        stores = {m: [(store_bits(op), None) for _, _, op, _ in insns if op.startswith("STG")]
                  for m, insns in sass.items()}
        nvdisasm, have_sites, chains = find_tool("nvdisasm"), False, {}
        if nvdisasm:
            gi = subprocess.run([nvdisasm, "-gi", cubin], capture_output=True, text=True)
            if gi.returncode == 0:
                chains = line_chains(gi.stdout)
                del gi
                stores.update(global_store_sites(chains))
                have_sites = True

    names = ptxas_report.demangle(list(sass))
    if args.cubin:
        resources = {m: by_function.get(names[m], {}) for m in sass}
    ref_threads = reference_threads()
    table = fast_rows()
    rows = []
    sources, cut_lines = {}, {}

    def cut_lines_of(path):
        if path not in cut_lines:
            try:
                cut_lines[path] = cut_only_lines(Path(path).read_text())
            except OSError:
                cut_lines[path] = set()
        return cut_lines[path]
    for mangled, insns in sass.items():
        kernel, variant, targs = split_name(names[mangled])
        res = resources.get(mangled, {})
        by_width, split, narrow_sites = store_summary(stores.get(mangled, []), sources)
        hl = hot_loops(insns)
        chain_at = {a: c for a, _, c in chains.get(mangled, [])}
        masked = [x for x in hl if have_sites and masked_tile_loop(x, chain_at, cut_lines_of)]
        agg = aggregate([x for x in hl if x not in masked])
        threads = bounds.get(mangled) or ref_threads.get(kernel)
        for d in args.head_dim:
            if variant == "fast" and targs and targs[0] != d:
                continue  # a fast kernel is compiled for one head dim (its first template argument)
            row = table.get((kernel, targs)) if variant == "fast" else None
            ts = tiles_and_smem(kernel, variant, d, row)
            br, bc, smem, default = ts if ts else (None, None, None, True)
            if threads is None or res.get("registers") is None:
                occ = (0, 0, "unknown")
            else:
                occ = occupancy(res["registers"], threads, smem)
            fc = None
            if agg and br:
                fc = forecast(kernel, agg, occ[0], threads, br, bc, d)
            stages = f" {row[2]} stage{'s' if row[2] > 1 else ''}" if row and row[3] > 1 else ""
            rows.append({
                "name": f"{kernel}/{variant}{stages}", "kernel": kernel, "variant": variant,
                "default_tiles": default,
                "function": names[mangled], "head_dim": d, "block_r": br, "block_c": bc,
                "threads": threads, "registers": res.get("registers"),
                "spill_bytes": (res.get("spill_stores") or 0) + (res.get("spill_loads") or 0),
                "smem_bytes": smem, "blocks_per_sm": occ[0],
                "occupancy": occ[1] / H200["max_warps_per_sm"], "occupancy_limit": occ[2],
                "hot_loops": len(hl) - len(masked), "hot": agg,
                "masked_loops": len(masked) if have_sites else None, "hot_masked": aggregate(masked),
                "fp_share": agg["fp"] / agg["instructions"] if agg else None,
                "lds_per_flop": agg["lds"] / agg["flop"] if agg and agg["flop"] else None,
                "int_div": agg["int_div"] if agg else None,
                "forecast_tflops": fc,
                "global_stores": {str(b): n for b, n in sorted(by_width.items())},
                "split_vector_stores": split if have_sites else None,
                "narrow_store_sites": narrow_sites,
            })
    rows.sort(key=lambda r: (r["kernel"], r["variant"] != "reference", r["head_dim"],
                             not r["default_tiles"]))

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"SASS report for {args.arch}: nvcc {ptxas_report.find_nvcc()}, {args.source}, flags "
          f"from {origin}: {' '.join(flags)}; H200 forecast for B={PROBLEM['batch']} "
          f"H={PROBLEM['heads']} N={PROBLEM['seqlen']}, no mask: the hot loops an unmasked tile runs "
          f"(model: tools/README.md)" + ("" if have_sites else "; no nvdisasm: masked-tile loops "
                                         "not told apart, every hot loop counted"))
    print("| kernel/variant | d | tiles | threads | regs | spill B | smem B | occupancy (limit) "
          "| hot loops | masked | insns/iter | fp share | LDS/FLOP | LDS.128 | int div | TFLOP/s "
          "| STG 128/64/32 bit | split |")
    print("|---" * 18 + "|")
    for r in rows:
        h = r["hot"] or {}
        tiles = f"{r['block_r']}x{r['block_c']}" if r["block_r"] else "-"
        tiles += "" if r["default_tiles"] else " (not default)"
        print(f"| {r['name']} | {r['head_dim']} | {tiles} | {f(r['threads'], 'd')} | "
              f"{f(r['registers'], 'd')} | {r['spill_bytes']} | {f(r['smem_bytes'], 'd')} | "
              f"{r['occupancy']:.2f} ({r['occupancy_limit']}) | {r['hot_loops']} | "
              f"{f(r['masked_loops'], 'd')} | "
              f"{f(h.get('instructions'), 'd')} | {f(r['fp_share'], '.2f')} | "
              f"{f(r['lds_per_flop'], '.3f')} | {f(h.get('lds128'), 'd')} | "
              f"{f(r['int_div'], 'd')} | {f(r['forecast_tflops'], '.1f')} | "
              f"{'/'.join(str(r['global_stores'].get(b, 0)) for b in ('128', '64', '32'))} | "
              f"{f(r['split_vector_stores'], 'd')} |")
    d0 = args.head_dim[0]
    parts = [f"{r['name']} fp_share={f(r['fp_share'], '.3f')} "
             f"lds_per_flop={f(r['lds_per_flop'], '.3f')} "
             f"forecast_tflops={f(r['forecast_tflops'], '.1f')}"
             for r in rows if r["head_dim"] == d0 and r["default_tiles"]]
    decode = decode_rows(rows)
    if decode:
        print(f"\nDecoding steps on fa2_forward/reference (Nq = 1, H = {DECODE['heads']} over Hkv = "
              f"{DECODE['heads_kv']}, d = {DECODE['head_dim']}, split {decode[0]['split_size']}; "
              f"memory-bound: HBM bytes at {HBM_BYTES_PER_S / 1e12:g} TB/s)")
        print("| B | context | packed | tiles | blocks | blocks per SM (resident at most) | HBM MB | x floor "
              "| forecast us |")
        print("|---" * 9 + "|")
        for x in decode:
            print(f"| {x['batch']} | {x['context']} | {x['packed']} | {x['block_r']}x{x['block_c']} | {x['blocks']} | "
                  f"{x['blocks_per_sm']:.1f} ({f(x['resident_per_sm'], 'd')}) | {x['hbm_bytes'] / 1e6:.1f} | "
                  f"{x['over_floor']:.3f} | {x['forecast_us']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "flags": flags,
                                               "model": H200, "problem": PROBLEM,
                                               "rows": rows, "decode": decode}, indent=2) + "\n")
    print("summary: " + " | ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
