#!/usr/bin/env python3
"""The GPU-side steps of tools/device_check.sh, one subcommand each.

    info       GPU, driver, nvcc, torch, ncu and compute-sanitizer versions (no pyfa needed)
    bench      times every forward and backward entry point on device pointers with CUDA
               events (PyTorch allocates and times), and PyTorch's SDPA on the same inputs
    sanitize   compute-sanitizer memcheck and racecheck over `drive` on small problems
    ncu        DRAM bytes read and written, per kernel, by ncu, beside pyfa.sim.count_io
    drive      runs ops once through the Python API (the program the two tools above watch)
    summarize  merges the steps' JSON into summary.json and summary.md

What is measured is discovered at run time: the device-pointer entry points are read
from pyfa.h (every `pyfa_<op>_device`; its parameters' names say which tensor each is,
`const float *` an input, `float *` an output), the Python-level ops from pyfa.api._FORWARD
and pyfa.attention_grad, the kernels from pyfa.api.KERNELS. A kernel added to the library
is measured without changes here.

FLOPs follow the FlashAttention-2 paper: a forward pass is 4*B*H*Nq*Nk*d (the two
matmuls), halved under the causal mask; a backward pass is 2.5 times the forward (five
matmuls instead of two). Recomputation is not counted.

Every step takes its deadline from PYFA_STEP_DEADLINE (seconds since the epoch, set by
device_check.sh) and, past it, records what it skipped instead of running it.
"""

import argparse
import csv
import glob
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()

# Vendor datasheet peaks for plain (non-tensor-core) fp32. Only parts named here get a
# fraction of peak; any other GPU prints "unknown" rather than a guess.
FP32_PEAKS = [
    # (test on the upper-cased device name, TFLOP/s, source)
    (lambda n: "H200" in n and "NVL" not in n, 67.0,
     "NVIDIA H200 Tensor Core GPU datasheet: FP32 67 TFLOPS (H200 SXM)"),
    (lambda n: "H100" in n and ("SXM" in n or "HBM3" in n) and "NVL" not in n, 67.0,
     "NVIDIA H100 Tensor Core GPU datasheet: FP32 67 TFLOPS (H100 SXM)"),
]

BENCH_SEQLENS = [1024, 2048, 4096, 8192]
# (head_dim, tiles): None tiles are the library's defaults for the device.
BENCH_VARIANTS = [(64, None), (64, (32, 32)), (128, None), (128, (32, 32))]
BENCH_BATCH, BENCH_HEADS = 4, 8
NCU_SHAPE = dict(batch=4, heads=8, seqlen_q=2048, seqlen_k=2048, head_dim=64)
NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"
SANITIZER_TOOLS = ["memcheck", "racecheck"]

# Tensors by canonical name (see canonical()): their shapes.
ROW_STATS = {"lse", "m", "l", "D"}     # (B, H, Nq): one float per query row
QUERY_ROWS = {"q", "o", "do", "dq"}    # (B, H, Nq, d)
KEY_ROWS = {"k", "v", "dk", "dv"}      # (B, H, Nk, d)
# `do` is a C keyword, so the header spells dO otherwise; D may be spelled out too.
ALIASES = {"dout": "do", "grado": "do", "gradout": "do", "d": "D", "delta": "D", "drow": "D"}
GRADS = ("dq", "dk", "dv")

# Output of a tool that cannot run on this machine (seen on sandboxed runtimes).
TOOL_NOT_WORKING = ["Device not supported", "LibraryNotLoaded", "error 999", "ERR_NVGPUCTRPERM",
                    "Failed to initialize", "not supported on this", "Unable to find the injection",
                    "Target application terminated before first instrumented API call",
                    "==ERROR== Profiling is not supported"]


# ---------------------------------------------------------------- small helpers

def deadline():
    value = os.environ.get("PYFA_STEP_DEADLINE")
    return float(value) if value else math.inf


def left_s():
    return deadline() - time.time()


def write_json(path, data):
    """Atomically, so a step killed at its timeout leaves the last complete record."""
    if not path:
        return
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_cmd(cmd, timeout):
    """(rc, combined output); rc None when the timeout ran out."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1, timeout))
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return None, out.decode(errors="replace") if isinstance(out, bytes) else out
    except OSError as e:
        return 127, str(e)


def find_tool(name, patterns):
    found = shutil.which(name)
    if found:
        return found
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def find_ncu():
    return find_tool("ncu", ["/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu",
                             "/usr/local/cuda/nsight-compute*/ncu"])


def find_sanitizer():
    return find_tool("compute-sanitizer", ["/usr/local/cuda/bin/compute-sanitizer",
                                           "/usr/local/cuda/compute-sanitizer/compute-sanitizer"])


def fp32_peak(name):
    """(TFLOP/s, source) from the datasheet table, or (None, 'unknown')."""
    upper = (name or "").upper()
    for test, tflops, source in FP32_PEAKS:
        if test(upper):
            return tflops, source
    return None, "unknown"


def flops(kind, b, h, nq, nk, d, causal):
    forward = 4.0 * b * h * nq * nk * d * (0.5 if causal else 1.0)
    return forward * (2.5 if kind == "backward" else 1.0)


def op_kind(op):
    return "backward" if "backward" in op else "forward"


def kernel_key(name):
    """'pyfa_cuda_kernels::fa2_forward_kernel(AttentionParams)' -> 'fa2_forward'."""
    base = name.split("(")[0].split("::")[-1].strip()
    return base[:-len("_kernel")] if base.endswith("_kernel") else base


# ---------------------------------------------------------------- discovery

def header_text():
    try:
        from pyfa import _lib
        path = _lib.header_path()
    except ImportError:
        path = None
    return Path(path or ROOT / "cuda" / "include" / "pyfa.h").read_text()


def device_entry_points(text):
    """{op: [(param name, role)]} for each `pyfa_<op>_device` prototype of pyfa.h; role is
    problem, config, stream, in (const float *), out (float *) or unknown."""
    m = re.search(r"PYFA_CDEF_BEGIN \*/(.*)/\* PYFA_CDEF_END", text, re.S)
    body = m.group(1) if m else text
    body = re.sub(r"/\*.*?\*/", " ", body, flags=re.S)
    body = re.sub(r"//[^\n]*", " ", body)
    ops = {}
    for fm in re.finditer(r"pyfa_status\s+pyfa_(\w+)_device\s*\(([^)]*)\)\s*;", body):
        params = []
        for raw in fm.group(2).split(","):
            pm = re.match(r"(.*?)(\w+)\s*$", " ".join(raw.split()))
            ctype, name = pm.group(1).replace(" ", ""), pm.group(2)
            role = {"constpyfa_problem*": "problem", "constpyfa_config*": "config",
                    "constfloat*": "in", "float*": "out"}.get(ctype)
            if ctype == "void*" and name == "stream":
                role = "stream"
            params.append((name, role or "unknown"))
        ops[fm.group(1)] = params
    return ops


def canonical(name):
    """A parameter's tensor name as this script knows it: 'dO', 'd_o', 'dout' -> 'do'."""
    key = name.lower().replace("_", "")
    return ALIASES.get(key, key)


def tensor_shape(name, b, h, nq, nk, d):
    """The shape of tensor `name` (canonical), None for a name this script does not know."""
    if name in ROW_STATS:
        return (b, h, nq)
    if name in QUERY_ROWS:
        return (b, h, nq, d)
    if name in KEY_ROWS:
        return (b, h, nk, d)
    return None


def host_ops():
    """Ops the Python API runs: <algo>_forward for each algorithm pyfa.attention knows
    (pyfa.api._FORWARD), <algo>_backward for each pyfa.attention_grad knows (its table
    pyfa.api._GRAD; without one, the forward algorithms)."""
    import pyfa
    ops = [f"{a}_forward" for a in sorted(pyfa.api._FORWARD)]
    if hasattr(pyfa, "attention_grad"):
        algos = getattr(pyfa.api, "_GRAD", None) or pyfa.api._FORWARD
        ops += [f"{a}_backward" for a in sorted(algos)]
    return ops


def library_kernels():
    """(kernels with a shared-memory layout, where that was read from): the library's
    pyfa_smem_bytes when it loads, the simulator's layouts otherwise (dry runs)."""
    import pyfa
    try:
        return [k for k in pyfa.api.KERNELS if pyfa.smem_bytes(k, 32, 32, 64) > 0], "libpyfa"
    except pyfa.LibraryNotFoundError:
        kernels = []
        for k in pyfa.api.KERNELS:
            try:
                pyfa.sim.smem_bytes(k, 32, 32, 64)
                kernels.append(k)
            except ValueError:
                pass
        return kernels, "pyfa.sim (libpyfa not loadable here)"


def op_kernels(op, kernels):
    return [k for k in kernels if k == op or k.startswith(op + "_")]


# ---------------------------------------------------------------- info

def cmd_info(args):
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    smi = shutil.which("nvidia-smi")
    if smi:
        fields = ("name,driver_version,compute_cap,memory.total,clocks.sm,clocks.max.sm,clocks.mem,"
                  "temperature.gpu,power.draw")
        rc, out = run_cmd([smi, f"--query-gpu={fields}", "--format=csv,noheader"], 30)
        if rc == 0 and out.strip():
            info["gpu"] = dict(zip(fields.split(","), (x.strip() for x in out.splitlines()[0].split(","))))
        info["nvidia_smi"] = out.strip()
    nvcc = shutil.which("nvcc") or (Path("/usr/local/cuda/bin/nvcc").is_file() and "/usr/local/cuda/bin/nvcc")
    if nvcc:
        rc, out = run_cmd([nvcc, "--version"], 30)
        m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
        info["nvcc"] = f"{m.group(1)} ({m.group(2)})" if m else out.strip().splitlines()[-1:]
    cmake = shutil.which("cmake")
    if cmake:
        info["cmake"] = run_cmd([cmake, "--version"], 30)[1].splitlines()[0]
    for key, path in (("ncu", find_ncu()), ("compute_sanitizer", find_sanitizer())):
        if path:
            rc, out = run_cmd([path, "--version"], 60)
            lines = [x for x in out.splitlines() if x.strip()]
            info[key] = {"path": path, "version": lines[-1] if lines else f"rc={rc}"}
        else:
            info[key] = None
    try:
        import torch
        info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                         "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["torch"].update(device=p.name, sm_count=p.multi_processor_count,
                                 l2_bytes=getattr(p, "L2_cache_size", None),
                                 memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
    except ImportError:
        info["torch"] = None
    name = (info.get("gpu") or {}).get("name") or ((info.get("torch") or {}).get("device"))
    peak, source = fp32_peak(name)
    info["fp32_peak_tflops"], info["fp32_peak_source"] = peak, source
    for key in ("gpu", "nvcc", "cmake", "torch", "ncu", "compute_sanitizer"):
        print(f"{key}: {info.get(key)}")
    print(f"fp32 peak: {peak if peak else 'unknown'} TFLOP/s ({source})")
    write_json(args.out, info)
    return 0


# ---------------------------------------------------------------- bench

class TorchCuda:
    """Device tensors from PyTorch, CUDA-event timing, SDPA as the reference."""

    name = "cuda"

    def __init__(self):
        import torch
        self.torch = torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        # Plain fp32 in the reference and in SDPA: no TF32 anywhere.
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(1234)
        props = torch.cuda.get_device_properties(0)
        self.device_name = props.name
        self.l2_bytes = getattr(props, "L2_cache_size", 50 << 20)

    def randn(self, shape):
        return self.torch.randn(shape, device="cuda", dtype=self.torch.float32, generator=self.gen)

    def empty(self, shape):
        return self.torch.empty(shape, device="cuda", dtype=self.torch.float32)

    def poison(self, t):
        t.fill_(float("nan"))

    def address(self, t):
        return t.data_ptr()

    def stream(self):
        return self.torch.cuda.current_stream().cuda_stream

    def sync(self):
        self.torch.cuda.synchronize()

    def time_ms(self, fn, reps):
        """Per-call times of reps back-to-back calls, each between two events."""
        ev = [(self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        for r, (start, end) in enumerate(ev):
            start.record()
            fn(r)
            end.record()
        self.torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in ev]

    def all_finite(self, t):
        return bool(self.torch.isfinite(t).all().item())

    def rel_err(self, x, ref):
        return float(((x - ref).abs().max() / ref.abs().max()).item())

    def reference(self, kind, q, k, v, do, causal):
        """{'o': O} or {'dq', 'dk', 'dv'} from SDPA in fp32."""
        F = self.torch.nn.functional
        if kind == "forward":
            with self.torch.no_grad():
                return {"o": F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        return dict(zip(GRADS, self.torch.autograd.grad(out, leaves, do)))

    def sdpa_runner(self, kind, sets, causal):
        F = self.torch.nn.functional
        if kind == "forward":
            def run(r):
                s = sets[r % len(sets)]
                with self.torch.no_grad():
                    F.scaled_dot_product_attention(s["q"], s["k"], s["v"], is_causal=causal)
            return run
        graphs = []
        for s in sets:
            leaves = [s[n].detach().requires_grad_() for n in ("q", "k", "v")]
            graphs.append((F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, s["do"]))

        def run(r):
            out, leaves, do = graphs[r % len(graphs)]
            self.torch.autograd.grad(out, leaves, do, retain_graph=True)
        return run


class HostEmu:
    """NumPy buffers on the emulator (whose _device entry points take host pointers) and
    wall-clock timing: lets the bench's plumbing run on a machine without a GPU."""

    name = "emu"
    device_name = "pyfa emulator (CPU)"
    l2_bytes = 0

    def __init__(self):
        import numpy as np
        self.np = np
        self.rng = np.random.default_rng(1234)
        from pyfa import _lib
        self.ffi, _ = _lib.load()

    def randn(self, shape):
        return self.rng.standard_normal(shape, dtype=self.np.float32)

    def empty(self, shape):
        return self.np.empty(shape, self.np.float32)

    def poison(self, t):
        t.fill(self.np.nan)

    def address(self, t):
        return int(self.ffi.cast("uintptr_t", self.ffi.from_buffer(t)))

    def stream(self):
        return 0

    def sync(self):
        pass

    def time_ms(self, fn, reps):
        out = []
        for r in range(reps):
            t0 = time.perf_counter()
            fn(r)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def all_finite(self, t):
        return bool(self.np.isfinite(t).all())

    def rel_err(self, x, ref):
        return float(self.np.abs(x.astype(self.np.float64) - ref).max() / self.np.abs(ref).max())

    def reference(self, kind, q, k, v, do, causal):
        np = self.np
        q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
        s = q64 @ k64.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
        if causal:
            nq, nk = q.shape[-2], k.shape[-2]
            s[..., np.arange(nk)[None, :] > np.arange(nq)[:, None] + (nk - nq)] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = p @ v64
        if kind == "forward":
            return {"o": o}
        dv = p.swapaxes(-1, -2) @ do64
        ds = p * (do64 @ v64.swapaxes(-1, -2) - (do64 * o).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
        return {"dq": ds @ k64, "dk": ds.swapaxes(-1, -2) @ q64, "dv": dv}

    def sdpa_runner(self, kind, sets, causal):
        return None


class DeviceOp:
    """One `pyfa_<op>_device` entry point, called with tensors looked up by name."""

    def __init__(self, name, params, ffi, lib):
        self.name, self.params, self.ffi = name, params, ffi
        self.fn = getattr(lib, f"pyfa_{name}_device")
        self.algo, self.kind = name.split("_")[0], op_kind(name)
        self.inputs = [canonical(n) for n, role in params if role == "in"]
        self.outputs = [canonical(n) for n, role in params if role == "out"]
        # Parameters this script cannot fill: an unknown type, or a tensor of unknown shape.
        self.unknown = [n for n, role in params if role == "unknown"
                        or (role in ("in", "out") and tensor_shape(canonical(n), 1, 1, 1, 1, 1) is None)]

    def __call__(self, problem, config, tensors, backend):
        from pyfa import _lib
        args = []
        for name, role in self.params:
            if role == "problem":
                args.append(problem)
            elif role == "config":
                args.append(config)
            elif role == "stream":
                args.append(self.ffi.cast("void *", backend.stream()))
            else:
                args.append(self.ffi.cast("float *", backend.address(tensors[canonical(name)])))
        _lib.check(self.fn(*args))


def make_problem(ffi, b, h, nq, nk, d, causal):
    return ffi.new("pyfa_problem *", {"batch": b, "heads": h, "seqlen_q": nq, "seqlen_k": nk,
                                      "head_dim": d, "scale": 0.0, "causal": int(causal)})


def make_config(ffi, backend_name, tiles):
    import pyfa
    br, bc = tiles or (0, 0)
    return ffi.new("pyfa_config *", {"backend": pyfa.api.BACKENDS[backend_name], "block_r": br,
                                     "block_c": bc})


def bench_plan(ops_all, seqlens, variants):
    """[(N, d, tiles, [op names])], in the order they run: N ascending, so that a time
    budget that runs out drops the largest problems, never a whole kernel."""
    return [(n, d, tiles, ops_all) for n in seqlens for d, tiles in variants]


def choose_reps(first_ms, target_ms, lo=3, hi=20):
    return max(lo, min(hi, int(target_ms / max(first_ms, 1e-3))))


def cmd_bench(args):
    import pyfa
    entry = device_entry_points(header_text())
    kernels, kernels_from = library_kernels()
    seqlens = args.seqlens or BENCH_SEQLENS
    variants = [(d, t) for d, t in BENCH_VARIANTS if not args.head_dims or d in args.head_dims]
    batch, heads = args.batch, args.heads
    # Forward ops first: a backward op needs its algorithm's forward outputs (o, lse, ...).
    names = sorted(entry, key=lambda op: (op_kind(op) != "forward", op))
    plan = bench_plan(names, seqlens, variants)
    if args.dry_run:
        print(f"entry points read from pyfa.h: {', '.join(f'pyfa_{n}_device' for n in names) or 'none'}")
        print(f"kernels ({kernels_from}): {', '.join(kernels)}")
        for op in names:
            print(f"  {op}: kernels {', '.join(op_kernels(op, kernels)) or '?'}; "
                  f"reads {[n for n, r in entry[op] if r == 'in']}, "
                  f"writes {[n for n, r in entry[op] if r == 'out']}")
        kinds = " and ".join(sorted({op_kind(op) for op in names}, reverse=True))
        for n, d, tiles, ops in plan:
            t = f"{tiles[0]}x{tiles[1]}" if tiles else "default"
            print(f"  would time B={batch} H={heads} N={n} d={d} tiles={t}: {', '.join(ops)}"
                  f"{f', torch SDPA {kinds}' if tiles is None else ''}")
        return 0

    ffi, lib = pyfa._lib.load()
    backend = TorchCuda() if args.backend == "cuda" else HostEmu()
    peak, peak_source = fp32_peak(backend.device_name)
    ops = {n: DeviceOp(n, entry[n], ffi, lib) for n in names}
    result = {"device": backend.device_name, "backend": backend.name, "fp32_peak_tflops": peak,
              "fp32_peak_source": peak_source, "batch": batch, "heads": heads, "causal": args.causal,
              "flops_convention": "forward 4*B*H*Nq*Nk*d (halved if causal), backward 2.5x forward (FA2 paper)",
              "kernels": kernels, "entry_points": names, "records": []}
    print(f"bench on {backend.device_name}: fp32 peak {peak or 'unknown'} TFLOP/s ({peak_source}); "
          f"B={batch} H={heads} causal={args.causal}; entry points: {', '.join(names)}")
    last = {}  # (op, d) -> (N, ms per call): predicts the next size's cost

    def record(rec):
        result["records"].append(rec)
        write_json(args.out, result)
        tiles = rec.get("tiles_used")
        if rec.get("ms") is None:
            print(f"  {rec['op']:24} N={rec['N']:5} d={rec['d']:3} tiles={rec['tiles']:8} {rec['status']}")
            return
        frac = ("peak unknown" if rec.get("fraction_of_peak") is None
                else f"{100 * rec['fraction_of_peak']:.1f}% of peak")
        err = f"rel err {rec['rel_err']:.1e}" if rec.get("rel_err") is not None else ""
        print(f"  {rec['op']:24} N={rec['N']:5} d={rec['d']:3} tiles={rec['tiles']:8} {rec['ms']:9.3f} ms "
              f"(median of {rec['reps']}, {rec['sets']} input sets) {rec['tflops']:7.3f} TFLOP/s  {frac}  "
              f"{err} {rec['status'] if rec['status'] != 'ok' else ''} {tiles or ''}".rstrip())

    for n, d, tiles, op_names in plan:
        tiles_label = f"{tiles[0]}x{tiles[1]}" if tiles else "default"
        per_set = 4 * batch * heads * n * d * 4 * 2  # q, k, v, do and as much again of outputs
        n_sets = 1 if not backend.l2_bytes else max(1, min(4, math.ceil(4 * backend.l2_bytes / per_set)))
        sets = [{name: backend.randn((batch, heads, n, d)) for name in ("q", "k", "v", "do")}
                for _ in range(n_sets)]
        problem = make_problem(ffi, batch, heads, n, n, d, args.causal)
        config = make_config(ffi, backend.name, tiles)
        refs = {}
        for name in op_names:
            op = ops[name]
            base = {"op": name, "N": n, "d": d, "tiles": tiles_label, "sets": n_sets}
            if op.unknown:
                record({**base, "ms": None, "status": f"skipped: parameters not understood: {op.unknown}"})
                continue
            prev = last.get((name, d))
            predicted = prev[1] * (n / prev[0]) ** 2 * 5 if prev else 0.0
            if time.time() + predicted + 2 > deadline():
                record({**base, "ms": None, "status": "skipped: time budget"})
                continue
            try:
                if tiles is None:
                    used = {k: list(pyfa.default_tiles(k, d, backend.name)) for k in op_kernels(name, kernels)}
                else:
                    used = {k: list(tiles) for k in op_kernels(name, kernels)}
                # Tensors this op reads but nobody gave: the outputs of its algorithm's forward.
                fwd = ops.get(f"{op.algo}_forward")
                needs = [t for t in op.inputs if t not in sets[0]]
                if needs and (fwd is None or not set(needs) <= set(fwd.outputs)):
                    record({**base, "ms": None, "status": f"skipped: no forward entry point gives {needs}"})
                    continue
                outs = {t: backend.empty(tensor_shape(t, batch, heads, n, n, d)) for t in op.outputs}
                per_set_tensors = []
                for s in sets:
                    tensors = dict(s)
                    if needs:
                        fouts = {t: backend.empty(tensor_shape(t, batch, heads, n, n, d)) for t in fwd.outputs}
                        fwd(problem, config, {**s, **fouts}, backend)
                        tensors.update({t: fouts[t] for t in needs})
                    tensors.update(outs)
                    per_set_tensors.append(tensors)
                backend.sync()
                for t in outs.values():
                    backend.poison(t)
                op(problem, config, per_set_tensors[0], backend)  # also the warm-up call
                backend.sync()
                finite = all(backend.all_finite(t) for t in outs.values())
                s0 = sets[0]
                if op.kind not in refs:
                    refs[op.kind] = backend.reference(op.kind, s0["q"], s0["k"], s0["v"], s0["do"], args.causal)
                compared = [t for t in refs[op.kind] if t in outs]
                err = max((backend.rel_err(outs[t], refs[op.kind][t]) for t in compared), default=None)

                def call(r, op=op, tl=per_set_tensors):
                    op(problem, config, tl[r % len(tl)], backend)
                first = backend.time_ms(call, 1)[0]
                reps = choose_reps(first, args.target_ms)
                times = backend.time_ms(call, reps)
                ms = statistics.median(times)
                last[(name, d)] = (n, ms)
                tf = flops(op.kind, batch, heads, n, n, d, args.causal) / (ms * 1e-3) / 1e12
                ok = finite and err is not None and err < 1e-3
                record({**base, "ms": ms, "ms_min": min(times), "reps": reps, "tflops": tf,
                        "fraction_of_peak": tf / peak if peak else None, "rel_err": err,
                        "compared": compared, "all_outputs_written": finite, "tiles_used": used,
                        "status": "ok" if ok else "CHECK FAILED (outputs not all written or rel err >= 1e-3)"})
                del outs, per_set_tensors
            except Exception as e:  # recorded, and the next configuration still runs
                record({**base, "ms": None, "status": f"error: {type(e).__name__}: {e}"})
        runner_kinds = sorted({op_kind(x) for x in op_names}) if tiles is None else []
        for kind in runner_kinds:
            base = {"op": f"torch_sdpa_{kind}", "N": n, "d": d, "tiles": "-", "sets": n_sets}
            prev = last.get((base["op"], d))
            if prev and time.time() + prev[1] * (n / prev[0]) ** 2 * 5 + 2 > deadline():
                record({**base, "ms": None, "status": "skipped: time budget"})
                continue
            try:
                run = backend.sdpa_runner(kind, sets, args.causal)
                if run is None:
                    continue
                run(0)
                backend.sync()
                first = backend.time_ms(run, 1)[0]
                reps = choose_reps(first, args.target_ms)
                times = backend.time_ms(run, reps)
                ms = statistics.median(times)
                last[(base["op"], d)] = (n, ms)
                tf = flops(kind, batch, heads, n, n, d, args.causal) / (ms * 1e-3) / 1e12
                record({**base, "ms": ms, "ms_min": min(times), "reps": reps, "tflops": tf,
                        "fraction_of_peak": tf / peak if peak else None, "status": "ok"})
            except Exception as e:
                record({**base, "ms": None, "status": f"error: {type(e).__name__}: {e}"})
        del sets
    write_json(args.out, result)
    failed = [r for r in result["records"] if r["status"].startswith(("CHECK", "error"))]
    print(f"bench: {len(result['records'])} records, {len(failed)} failed, "
          f"{len([r for r in result['records'] if r['status'].startswith('skipped')])} skipped")
    return 1 if failed else 0


# ---------------------------------------------------------------- drive

DRIVE_SIZES = {
    # Small problems with tails (N not a multiple of the tiles), Nq != Nk both ways, the
    # default tiles and small explicit ones, both masks, two head dims: for memcheck.
    "small": [dict(batch=1, heads=2, seqlen_q=nq, seqlen_k=nk, head_dim=d, tiles=t, causal=c)
              for d in (64, 128) for nq, nk in ((70, 90), (90, 70)) for t in (None, (16, 32))
              for c in (False, True)],
    # Racecheck instruments every shared-memory access and runs far slower: two cases,
    # still both tile shapes and both masks (a missing barrier does not depend on d).
    "race": [dict(batch=1, heads=2, seqlen_q=70, seqlen_k=90, head_dim=64, tiles=None, causal=False),
             dict(batch=1, heads=2, seqlen_q=90, seqlen_k=70, head_dim=64, tiles=(16, 32), causal=True)],
}
SANITIZER_SIZES = {"memcheck": "small", "racecheck": "race"}


def drive_op(op, case, backend):
    import numpy as np
    import pyfa
    rng = np.random.default_rng(7)
    b, h, nq, nk, d = (case[k] for k in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim"))
    q, do = (rng.standard_normal((b, h, nq, d), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, h, nk, d), dtype=np.float32) for _ in range(2))
    kw = dict(causal=case["causal"], backend=backend)
    if case["tiles"]:
        kw.update(block_r=case["tiles"][0], block_c=case["tiles"][1])
    algo = op.split("_")[0]
    if op_kind(op) == "forward":
        return pyfa.api._FORWARD[algo](q, k, v, **kw)
    return pyfa.attention_grad(q, k, v, do, algo=algo, **kw)


def cmd_drive(args):
    ops = host_ops() if args.ops == "all" else args.ops.split(",")
    if args.shape:
        b, h, n, d = args.shape
        cases = [dict(batch=b, heads=h, seqlen_q=n, seqlen_k=n, head_dim=d, tiles=None, causal=False)]
    else:
        cases = DRIVE_SIZES[args.size]
    errors = launches = 0
    for op in ops:
        for case in cases:
            try:
                drive_op(op, case, args.backend)
                launches += 1
            except ValueError as e:  # the library's own argument checks (e.g. tiles it rejects)
                print(f"drive: {op} {case}: rejected: {e}")
            except Exception as e:  # reported; the other ops still run under the tool
                errors += 1
                print(f"drive: {op} {case}: {type(e).__name__}: {e}")
    print(f"drive: done, {launches} calls of {', '.join(ops)}, {errors} errors")
    return 1 if errors else 0


def drive_cmd(ops, size, backend="cuda"):
    """The driven program: `size` is a DRIVE_SIZES name or a shape (B, H, N, d)."""
    how = ["--size", size] if isinstance(size, str) else ["--shape", *map(str, size)]
    return [sys.executable, str(THIS), "drive", "--ops", ",".join(ops), *how, "--backend", backend]


# ---------------------------------------------------------------- sanitize

def classify_sanitizer(tool, rc, out):
    """(status, error count) of one compute-sanitizer run over `drive`."""
    errors = None
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", out)
    if m:
        errors = int(m.group(1))
    m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", out)
    if m:
        errors = int(m.group(1))
    done = "drive: done" in out
    if rc is None:
        return "timeout", errors
    if errors:
        return "errors found", errors
    if any(p in out for p in TOOL_NOT_WORKING) or (not done and errors is None):
        return "tool not working here", errors
    if done and rc == 0:
        return "clean", errors or 0
    return "failed (see output)", errors


def cmd_sanitize(args):
    tool_path = find_sanitizer() or "compute-sanitizer"
    ops = host_ops()
    result = {"tool": tool_path, "ops": ops, "cases": {t: DRIVE_SIZES[s] for t, s in SANITIZER_SIZES.items()},
              "runs": []}
    for tool in SANITIZER_TOOLS:
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "86", "--print-limit", "20",
               *drive_cmd(ops, SANITIZER_SIZES[tool], args.backend)]
        if args.dry_run:
            print("  would run: " + " ".join(cmd))
            continue
        if not find_sanitizer():
            result["runs"].append({"tool": tool, "status": "not installed", "command": cmd})
            continue
        if left_s() < 10:
            result["runs"].append({"tool": tool, "status": "skipped: time budget", "command": cmd})
            continue
        t0 = time.time()
        # An equal share of what is left for this and each later tool.
        share = (left_s() - 5) / (len(SANITIZER_TOOLS) - SANITIZER_TOOLS.index(tool))
        rc, out = run_cmd(cmd, min(args.timeout, share))
        status, errors = classify_sanitizer(tool, rc, out)
        run = {"tool": tool, "status": status, "errors": errors, "rc": rc, "seconds": round(time.time() - t0, 1),
               "command": cmd, "output_tail": out[-3000:]}
        result["runs"].append(run)
        print(f"compute-sanitizer {tool}: {status}" + (f", {errors} errors" if errors else "")
              + f" ({run['seconds']} s, ops {', '.join(ops)})")
        if status != "clean":
            print(out[-2000:])
        write_json(args.out, result)
        if status == "tool not working here":
            # The same tool fails the same way on every run; spend the time elsewhere.
            for rest in SANITIZER_TOOLS[SANITIZER_TOOLS.index(tool) + 1:]:
                result["runs"].append({"tool": rest, "status": "skipped: the tool does not work here"})
            break
    if args.dry_run:
        print(f"  ops: {', '.join(ops)}; memcheck {len(DRIVE_SIZES['small'])} small cases each (B=1 H=2, "
              "Nq/Nk 70/90 and 90/70, d 64 and 128, default and 16x32 tiles, causal or not), "
              f"racecheck {len(DRIVE_SIZES['race'])} of them at d=64")
        return 0
    write_json(args.out, result)
    return 1 if any(r["status"] in ("errors found", "failed (see output)") for r in result["runs"]) else 0


# ---------------------------------------------------------------- ncu

def parse_ncu_csv(out):
    """{kernel key: {metric: summed value}} and launches per kernel, from `ncu --csv`
    output (rows are the lines that start with a quote; others are the program's)."""
    rows = [line for line in out.splitlines() if line.startswith('"')]
    per_launch = {}
    for row in csv.DictReader(rows):
        name, metric, value = row.get("Kernel Name"), row.get("Metric Name"), row.get("Metric Value")
        if not name or not metric or value is None:
            continue
        try:
            number = float(value.replace(",", ""))
        except ValueError:
            continue
        launch = per_launch.setdefault(row.get("ID"), {"kernel": kernel_key(name), "metrics": {}})
        launch["metrics"][metric] = number
    kernels = {}
    for launch in per_launch.values():
        k = kernels.setdefault(launch["kernel"], {"launches": 0})
        k["launches"] += 1
        for metric, v in launch["metrics"].items():
            k[metric] = k.get(metric, 0) + v
    return kernels


def cmd_ncu(args):
    import pyfa
    ncu = find_ncu() or "ncu"
    shape = dict(NCU_SHAPE)
    if args.shape:
        shape.update(zip(("batch", "heads", "seqlen_q", "head_dim"), args.shape), seqlen_k=args.shape[2])
    result = {"tool": ncu, "shape": shape, "metrics": NCU_METRICS, "ops": []}
    ops = host_ops()
    for index, op in enumerate(ops):
        cmd = [ncu, "--metrics", NCU_METRICS, "--clock-control", "none", "--print-units", "base",
               "--csv", *drive_cmd([op], [shape[k] for k in ("batch", "heads", "seqlen_q", "head_dim")],
                                   args.backend)]
        if args.dry_run:
            print("  would run: " + " ".join(cmd))
            continue
        entry = {"op": op, "command": cmd}
        result["ops"].append(entry)
        if not find_ncu():
            entry["status"] = "not installed"
            continue
        if left_s() < 15:
            entry["status"] = "skipped: time budget"
            continue
        t0 = time.time()
        rc, out = run_cmd(cmd, min(args.timeout, (left_s() - 5) / (len(ops) - index)))
        entry["seconds"] = round(time.time() - t0, 1)
        kernels = parse_ncu_csv(out or "")
        entry["kernels"] = kernels
        if rc is None:
            entry["status"] = "timeout"
        elif not kernels:
            entry["status"] = ("tool not working here" if any(p in out for p in TOOL_NOT_WORKING)
                               else f"no kernel measured (rc {rc})")
            entry["output_tail"] = out[-3000:]
        else:
            entry["status"] = "ok" if rc == 0 else f"measured, but rc {rc}"
        # The simulator's count for each pass this op ran, beside the kernels of that pass.
        algo = op.split("_")[0]
        entry["passes"] = {}
        for pass_ in sorted({op_kind(k) for k in kernels} or {op_kind(op)}):
            mine = {k: v for k, v in kernels.items() if op_kind(k) == pass_ and k.split("_")[0] == algo}
            row = {"ncu_read": sum(v.get("dram__bytes_read.sum", 0) for v in mine.values()) if mine else None,
                   "ncu_write": sum(v.get("dram__bytes_write.sum", 0) for v in mine.values()) if mine else None,
                   "kernels": sorted(mine)}
            try:
                io = pyfa.sim.count_io(algo, passes=pass_, **shape)
                row.update(sim_read=io.total_reads, sim_write=io.total_writes)
            except ValueError as e:
                row["sim"] = f"no count: {e}"
            # count_io uses the simulator's default tiles; the GPU run used the library's.
            try:
                row["tiles_match"] = all(tuple(pyfa.default_tiles(k, shape["head_dim"], args.backend))
                                         == tuple(pyfa.sim.default_tiles(k, shape["head_dim"])) for k in mine)
            except Exception as e:
                row["tiles_match"] = f"unknown: {e}"
            entry["passes"][pass_] = row
            print(f"ncu {op} ({pass_} kernels {', '.join(sorted(mine)) or 'none'}): DRAM read "
                  f"{fmt_bytes(row['ncu_read'])}, written {fmt_bytes(row['ncu_write'])}; simulator "
                  f"HBM read {fmt_bytes(row.get('sim_read'))}, written {fmt_bytes(row.get('sim_write'))}")
        if entry["status"] != "ok":
            print(f"ncu {op}: {entry['status']}")
        write_json(args.out, result)
        if entry["status"] == "tool not working here":
            break
    if args.dry_run:
        s = shape
        print(f"  shape B={s['batch']} H={s['heads']} N={s['seqlen_q']} d={s['head_dim']}, default tiles; "
              f"beside pyfa.sim.count_io(algo, passes=..., same shape)")
        return 0
    write_json(args.out, result)
    return 0


def fmt_bytes(n):
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------- summarize

def load_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def junit_counts(path):
    """Test counts from pytest's JUnit XML, all tests and those run on the cuda backend."""
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {"all": dict(passed=0, failed=0, skipped=0), "cuda": dict(passed=0, failed=0, skipped=0)}
    for case in root.iter("testcase"):
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        out["all"][outcome] += 1
        if "cuda" in case.get("name", ""):
            out["cuda"][outcome] += 1
    return out


def read_steps(path):
    steps = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 6:
            steps.append({"step": parts[0], "status": parts[1], "rc": parts[2], "seconds": parts[3],
                          "timeout_s": parts[4], "command": parts[5]})
    return steps


def cmd_summarize(args):
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": args.mode,
               "steps": read_steps(work / "steps.tsv"), "info": load_json(work / "info.json"),
               "tests": junit_counts(out / "pytest.xml"), "sanitizer": load_json(work / "sanitize.json"),
               "bench": load_json(work / "bench.json"), "ncu": load_json(work / "ncu.json"),
               "ptxas": load_json(work / "ptxas.json")}
    write_json(out / "summary.json", summary)
    md = markdown(summary)
    (out / "summary.md").write_text(md)
    print(md)
    return 0


def markdown(s):
    lines = [f"# pyfa device check ({s['mode']}, {s['generated']})", ""]
    info = s.get("info") or {}
    gpu = info.get("gpu") or {}
    if info:
        lines += [f"- GPU: {gpu.get('name', '?')} (compute capability {gpu.get('compute_cap', '?')}, "
                  f"{gpu.get('memory.total', '?')}), driver {gpu.get('driver_version', '?')}",
                  f"- nvcc {info.get('nvcc')}; {info.get('cmake')}; Python {info.get('python')}; "
                  f"torch {(info.get('torch') or {}).get('version')}",
                  f"- fp32 peak: {info.get('fp32_peak_tflops') or 'unknown'} TFLOP/s ({info.get('fp32_peak_source')})",
                  ""]
    lines += ["## Steps", "", "| step | status | rc | seconds | timeout s |", "|---|---|---|---|---|"]
    lines += [f"| {x['step']} | {x['status']} | {x['rc']} | {x['seconds']} | {x['timeout_s']} |" for x in s["steps"]]
    lines.append("")
    if s["mode"] == "dry-run":
        lines += ["Dry run: nothing was built, tested or measured; the log lists each command.", ""]
    t = s.get("tests")
    if t:
        lines += ["## Tests", "", f"- all: {t['all']['passed']} passed, {t['all']['failed']} failed, "
                  f"{t['all']['skipped']} skipped", f"- on the cuda backend: {t['cuda']['passed']} passed, "
                  f"{t['cuda']['failed']} failed, {t['cuda']['skipped']} skipped", ""]
    san = s.get("sanitizer")
    if san:
        lines += ["## compute-sanitizer", "", f"ops: {', '.join(san.get('ops', []))}", ""]
        lines += [f"- {r['tool']}: {r['status']}" + (f" ({r['errors']} errors)" if r.get("errors") else "")
                  for r in san.get("runs", [])]
        lines.append("")
    b = s.get("bench")
    if b:
        clock = "CUDA events" if b.get("backend") == "cuda" else "wall clock, emulator"
        lines += [f"## Timings ({clock}, median)", "",
                  f"{b['device']}, B={b['batch']} H={b['heads']} causal={b['causal']}; FLOPs: "
                  f"{b['flops_convention']}; fp32 peak {b.get('fp32_peak_tflops') or 'unknown'} TFLOP/s "
                  f"({b.get('fp32_peak_source')}); x SDPA: time over torch SDPA's at the same N and d", "",
                  "| op | N | d | tiles | ms | TFLOP/s | % of fp32 peak | x SDPA | rel err | status |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        sdpa = {(r["op"], r["N"], r["d"]): r["ms"] for r in b["records"]
                if r["op"].startswith("torch_sdpa_") and r.get("ms")}
        for r in b["records"]:
            if r.get("ms") is None:
                lines.append(f"| {r['op']} | {r['N']} | {r['d']} | {r['tiles']} | - | - | - | - | - | {r['status']} |")
                continue
            frac = f"{100 * r['fraction_of_peak']:.1f}" if r.get("fraction_of_peak") is not None else "unknown"
            err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
            ref = sdpa.get((f"torch_sdpa_{op_kind(r['op'])}", r["N"], r["d"]))
            vs = f"{r['ms'] / ref:.2f}" if ref and not r["op"].startswith("torch_") else "-"
            lines.append(f"| {r['op']} | {r['N']} | {r['d']} | {r['tiles']} | {r['ms']:.3f} | "
                         f"{r['tflops']:.2f} | {frac} | {vs} | {err} | {r['status']} |")
        lines.append("")
    n = s.get("ncu")
    if n:
        sh = n["shape"]
        lines += ["## DRAM bytes (ncu) beside the simulator's HBM count", "",
                  f"B={sh['batch']} H={sh['heads']} N={sh['seqlen_q']} d={sh['head_dim']}, default tiles, "
                  f"one call; ncu {NCU_METRICS} --clock-control none", "",
                  "| op | pass | kernels | ncu read | ncu write | sim read | sim write | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in n.get("ops", []):
            for pass_, r in (e.get("passes") or {"-": {}}).items():
                lines.append(f"| {e['op']} | {pass_} | {', '.join(r.get('kernels', [])) or '-'} | "
                             f"{fmt_bytes(r.get('ncu_read'))} | {fmt_bytes(r.get('ncu_write'))} | "
                             f"{fmt_bytes(r.get('sim_read'))} | {fmt_bytes(r.get('sim_write'))} | {e.get('status')} |")
        lines.append("")
    p = s.get("ptxas")
    if p:
        lines += [f"## ptxas ({p['arch']}, nvcc {p['nvcc']})", "",
                  "| kernel | registers | spill stores | spill loads | stack | fma.rn.f32 |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {k['kernel']} | {k['registers']} | {k['spill_stores']} | {k['spill_loads']} | "
                  f"{k['stack_frame']} | {k['fma_rn_f32']} |" for k in p["kernels"]]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info")
    p.add_argument("--out")
    p = sub.add_parser("bench")
    p.add_argument("--out")
    p.add_argument("--backend", choices=["cuda", "emu"], default="cuda",
                   help="emu: the emulator on host buffers, to try this script without a GPU")
    p.add_argument("--seqlens", type=int, nargs="+")
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--batch", type=int, default=BENCH_BATCH)
    p.add_argument("--heads", type=int, default=BENCH_HEADS)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--target-ms", type=float, default=200.0,
                   help="timed calls per measurement: about this many ms' worth, 3 to 20")
    p.add_argument("--dry-run", action="store_true")
    for name, timeout in (("sanitize", 120), ("ncu", 60)):
        p = sub.add_parser(name)
        p.add_argument("--out")
        p.add_argument("--timeout", type=float, default=timeout, help="seconds per tool run")
        p.add_argument("--backend", choices=["cuda", "emu"], default="cuda",
                       help="backend of the driven program (emu: to try the plumbing without a GPU)")
        p.add_argument("--dry-run", action="store_true")
        if name == "ncu":
            p.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "N", "D"),
                           help="problem to measure (default: %s)" % " ".join(
                               str(NCU_SHAPE[k]) for k in ("batch", "heads", "seqlen_q", "head_dim")))
    p = sub.add_parser("drive")
    p.add_argument("--ops", default="all", help="comma-separated ops (e.g. fa2_forward) or 'all'")
    p.add_argument("--size", choices=sorted(DRIVE_SIZES), default="small")
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "N", "D"),
                   help="instead of --size: one call at this shape, default tiles, no mask")
    p.add_argument("--backend", choices=["cuda", "emu"], default="cuda")
    p = sub.add_parser("summarize")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="gpu")
    args = ap.parse_args(argv)
    return {"info": cmd_info, "bench": cmd_bench, "sanitize": cmd_sanitize, "ncu": cmd_ncu,
            "drive": cmd_drive, "summarize": cmd_summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
