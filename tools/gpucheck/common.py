"""What the device-check steps share."""

import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "tools" / "gpu_bench.py"

# Vendor datasheet peaks for plain (non-tensor-core) fp32, counting an FMA as two FLOPs.
# pyfa's kernels fuse every inner-product step (docs/numerics.md §4), so that peak is their
# ceiling; half of it, the multiply-then-add peak, is shown beside it for comparison. Only
# parts named here get a share of peak; any other GPU prints "unknown" rather than a guess.
FP32_PEAKS = [
    # (test on the upper-cased device name, FMA peak TFLOP/s, source)
    (lambda n: "H200" in n and "NVL" not in n, 67.0,
     "NVIDIA H200 Tensor Core GPU datasheet: FP32 67 TFLOPS (H200 SXM)"),
    (lambda n: "H100" in n and ("SXM" in n or "HBM3" in n) and "NVL" not in n, 67.0,
     "NVIDIA H100 Tensor Core GPU datasheet: FP32 67 TFLOPS (H100 SXM)"),
]

# Output of a tool that cannot run on this machine (seen on sandboxed runtimes).
TOOL_NOT_WORKING = ["Device not supported", "LibraryNotLoaded", "error 999", "ERR_NVGPUCTRPERM",
                    "Failed to initialize", "not supported on this", "Unable to find the injection",
                    "Target application terminated before first instrumented API call",
                    "==ERROR== Profiling is not supported"]


def deadline():
    """PYFA_STEP_DEADLINE (seconds since the epoch, set by device_check.sh), else none."""
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


def load_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


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
    """(FMA peak TFLOP/s, source) from the datasheet table, or (None, 'unknown')."""
    upper = (name or "").upper()
    for test, tflops, source in FP32_PEAKS:
        if test(upper):
            return tflops, source
    return None, "unknown"


def peak_shares(tflops, peak):
    """{fma, mul_add}: tflops as a fraction of the FMA peak and of the multiply-then-add
    peak (half of it); None where the peak is unknown."""
    if not peak:
        return {"fma": None, "mul_add": None}
    return {"fma": tflops / peak, "mul_add": tflops / (peak / 2)}


def flops(pass_, b, h, nq, nk, d, causal):
    """The FlashAttention-2 paper's count: forward 4*B*H*Nq*Nk*d (halved when causal),
    backward 2.5 times the forward; recomputation is not counted."""
    forward = 4.0 * b * h * nq * nk * d * (0.5 if causal else 1.0)
    return forward * (2.5 if pass_ == "backward" else 1.0)


FLOPS_CONVENTION = "forward 4*B*H*Nq*Nk*d (halved if causal), backward 2.5x forward (FA2 paper)"


def kernel_key(name):
    """'pyfa_cuda_kernels::fa2_forward_kernel(AttentionParams)' -> 'fa2_forward'."""
    base = name.split("(")[0].split("::")[-1].strip()
    return base[:-len("_kernel")] if base.endswith("_kernel") else base


def ops():
    """pyfa.api.OPS, forward ops first (a backward op needs its forward's outputs)."""
    import pyfa
    return sorted(pyfa.api.OPS.values(), key=lambda op: (op.pass_ != "forward", op.name))


def forward_of(op):
    """The forward op whose outputs `op` (a backward) reads."""
    import pyfa
    return next(o for o in pyfa.api.OPS.values() if o.algo == op.algo and o.pass_ == "forward")


def fmt_bytes(n):
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def entry_cmd(*args):
    """A command line running tools/gpu_bench.py with this Python."""
    return [sys.executable, str(ENTRY), *map(str, args)]
