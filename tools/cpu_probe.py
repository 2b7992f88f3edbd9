"""What CPU this is and how fast its FMA ports go, for tools/bench.py's sweep (issue 25).

identity(): vendor, family, model, the model string, the microarchitecture (from a table
of the ones this project has met, else "unknown") and the ISA build of the cpu backend a
call takes now (the library's own answer: the cpu profile's name).
fma_peak(isa, threads): the FMA peak in GFLOP/s of `threads` cores together, measured
by tools/fma_peak.c compiled here with the ISA's flags (None, with the reason, without a
C compiler, off x86, or for the portable build, which has no vector FMA of its own).
decode_loop(isa): tools/decode_loop.c compiled alike, for bench.py --decode-c.
"""
import ctypes
import functools
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time

# (vendor, family, first model, last model) -> name; families and models as /proc/cpuinfo
# gives them (decimal). Sources: AMD's and Intel's family/model lists.
MICROARCHITECTURES = [
    ("AuthenticAMD", 23, 0, 0x2F, "Zen / Zen+"),
    ("AuthenticAMD", 23, 0x30, 0xFF, "Zen 2"),
    ("AuthenticAMD", 25, 0x00, 0x0F, "Zen 3"),
    ("AuthenticAMD", 25, 0x10, 0x1F, "Zen 4"),
    ("AuthenticAMD", 25, 0x20, 0x5F, "Zen 3"),
    ("AuthenticAMD", 25, 0x60, 0x7F, "Zen 4"),
    ("AuthenticAMD", 25, 0xA0, 0xAF, "Zen 4"),
    ("AuthenticAMD", 26, 0x00, 0xFF, "Zen 5"),
    ("GenuineIntel", 6, 85, 85, "Skylake-SP / Cascade Lake"),
    ("GenuineIntel", 6, 106, 106, "Ice Lake-SP"),
    ("GenuineIntel", 6, 143, 143, "Sapphire Rapids"),
    ("GenuineIntel", 6, 207, 207, "Emerald Rapids"),
    ("GenuineIntel", 6, 173, 173, "Granite Rapids"),
]

ISA_FLAGS = {"avx512": ["-mavx512f", "-mfma"], "avx512_wide": ["-mavx512f", "-mfma"], "avx2": ["-mavx2", "-mfma"]}


def identity():
    info = {"vendor": "?", "family": None, "model": None, "model_name": platform.processor() or "?"}
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "vendor_id":
                    info["vendor"] = value
                elif key == "cpu family":
                    info["family"] = int(value)
                elif key == "model":
                    info["model"] = int(value)
                elif key == "model name":
                    info["model_name"] = value
                elif key == "flags":
                    flags = set(value.split())
                elif not line.strip():
                    break  # the first processor is enough
    except OSError:
        pass
    info["microarchitecture"] = next(
        (name for vendor, fam, lo, hi, name in MICROARCHITECTURES
         if vendor == info["vendor"] and fam == info["family"] and info["model"] is not None
         and lo <= info["model"] <= hi), "unknown")
    # A hypervisor may report a model number of its own (family 6 model 167 on the Xeon of
    # these machines): AMX with AVX-512 FP16 then still says Sapphire Rapids or a successor.
    if info["microarchitecture"] == "unknown" and info["vendor"] == "GenuineIntel" and \
            {"amx_tile", "avx512_fp16"} <= flags:
        info["microarchitecture"] = "Sapphire Rapids or later (AMX, AVX-512 FP16; model number not its own)"
    import pyfa
    # "pyfa cpu avx512 (tiles of ...)": the build a call takes now, PYFA_CPU_ISA included.
    info["isa"] = pyfa.device_profile("cpu")["name"].split()[2]
    return info


@functools.lru_cache(maxsize=None)
def _compile(isa, name="fma_peak"):
    """(tools/<name>.c built as a shared library with the ISA's flags, loaded with ctypes;
    or None and why). Once per process: the sweep measures the peak of each thread count
    before and after its runs, from the same loop."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler (CC, cc, gcc, clang)"
    out = os.path.join(tempfile.mkdtemp(prefix="pyfa-probe-"), f"{name}.so")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.c")
    p = subprocess.run([cc, "-O2", *ISA_FLAGS[isa], "-shared", "-fPIC", src, "-o", out, "-lpthread"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return None, f"{cc} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
    return ctypes.CDLL(out), ""


def decode_loop(isa):
    """(tools/decode_loop.c loaded, with its functions' argument types; or None and why)."""
    if isa not in ISA_FLAGS or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"no decode loop for the {isa} build on {platform.machine()}"
    lib, why = _compile(isa, "decode_loop")
    if lib is None:
        return None, why
    ptr, dp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)
    lib.decode_loop_step.restype = ctypes.c_int
    lib.decode_loop_step.argtypes = [ptr] * 8 + [ctypes.c_double, ctypes.c_int, dp]
    lib.decode_loop_read.restype = ctypes.c_int
    lib.decode_loop_read.argtypes = [ptr, ctypes.c_size_t, ctypes.c_int, ctypes.c_double, ctypes.c_int, dp]
    return lib, ""


def fma_peak(isa, threads, seconds=0.15, tries=5):
    """(GFLOP/s of `threads` cores together, reason when None): the best of `tries` runs,
    each `threads` threads running the loop for about `seconds` at once (ctypes releases
    the GIL). The best, since a peak is what the ports can do, not what a noisy moment let
    them do."""
    if isa not in ISA_FLAGS or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"no vector FMA loop for the {isa} build on {platform.machine()}"
    lib, why = _compile(isa)
    if lib is None:
        return None, why
    lib.fma_peak_loop.restype = ctypes.c_float
    lib.fma_peak_loop.argtypes = [ctypes.c_int64]
    per_step = lib.fma_peak_chains() * lib.fma_peak_width() * 2
    n = 1 << 16
    while True:  # calibrate: steps for about `seconds` on one core
        t0 = time.perf_counter()
        lib.fma_peak_loop(n)
        if time.perf_counter() - t0 > seconds / 4:
            break
        n *= 2
    n = int(n * seconds / max(time.perf_counter() - t0, 1e-6))
    best = 0.0
    for _ in range(tries):
        workers = [threading.Thread(target=lib.fma_peak_loop, args=(n,)) for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * n * per_step / (time.perf_counter() - t0) / 1e9)
    return best, ""
