"""gpu_bench.py info: what the run is on (needs no pyfa)."""

import platform
import re
import shutil
import sys
from pathlib import Path

from .common import find_ncu, find_sanitizer, fp32_peak, run_cmd, write_json


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
    print(f"fp32 peak: {peak if peak else 'unknown'} TFLOP/s with FMA, "
          f"{peak / 2 if peak else 'unknown'} multiply-then-add ({source})")
    write_json(args.out, info)
    return 0


def add_parser(sub):
    p = sub.add_parser("info", help="GPU, driver and tool versions")
    p.add_argument("--out")
    p.set_defaults(run=cmd_info)
