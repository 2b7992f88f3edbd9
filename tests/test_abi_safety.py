"""Memory safety of the C ABI: exact sizes, and no crash when allocation fails.

Calls that could crash run in a subprocess, so that a crash fails the test instead of
ending pytest.
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pyfa
from pyfa import _lib

# pyfa.h's enum values, as the loader parses them from the header.
const = _lib.constant

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1

# The C enum pyfa_kernel.
KERNELS = {"fa1_forward": 0, "fa2_forward": 1, "fa1_backward": 2, "fa2_backward_preprocess": 3,
           "fa2_backward_dkdv": 4, "fa2_backward_dq": 5}


def child_env():
    """The environment of a child interpreter that imports the pyfa this test imported."""
    import pyfa
    env = dict(os.environ)
    here = str(Path(pyfa.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def run_python(code, timeout=300):
    """Runs `code` in a fresh interpreter; returns the completed process (a crash shows as
    a negative returncode)."""
    env = child_env()
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def json_result(run):
    assert run.returncode == 0, f"subprocess ended with {run.returncode}:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def exact_or_zero(kernel, Br, Bc, d):
    """What pyfa_smem_bytes promises: the exact size (Python ints do not wrap), or 0 when
    it does not fit in int64."""
    from pyfa.sim import tiles
    n = tiles.smem_bytes(kernel, Br, Bc, d)
    return n if n <= INT64_MAX else 0


def largest_fitting(f, lo, hi):
    """The largest x in [lo, hi] with f(x) <= INT64_MAX (f increasing, f(lo) fits)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if f(mid) <= INT64_MAX:
            lo = mid
        else:
            hi = mid - 1
    return lo


def smem_cases(seed=20261130, per_kernel=400):
    """(kernel, Br, Bc, d) cases: uniform and log-uniform tiles in [1, 2^31 - 1], head dims
    in [1, 256], the tiles on either side of int64's limit, and the issue's regressions."""
    from pyfa.sim import tiles
    rng = random.Random(seed)
    cases = []
    for kernel in KERNELS:
        for _ in range(per_kernel // 2):
            cases.append((kernel, rng.randint(1, INT32_MAX), rng.randint(1, INT32_MAX), rng.randint(1, 256)))
        for _ in range(per_kernel // 2):
            cases.append((kernel, int(2 ** rng.uniform(0, 31)) or 1, int(2 ** rng.uniform(0, 31)) or 1,
                          rng.randint(1, 256)))
        for d in (1, 64, 150, 256):
            # Square tiles, and Bc alone growing at Br = 2^31 - 1, across the limit.
            sq = largest_fitting(lambda x: tiles.smem_bytes(kernel, x, x, d), 1, INT32_MAX)
            col = largest_fitting(lambda x: tiles.smem_bytes(kernel, INT32_MAX, x, d), 1, INT32_MAX)
            for x in (sq, sq + 1):
                if x <= INT32_MAX:
                    cases.append((kernel, x, x, d))
            for x in (col, col + 1):
                if x <= INT32_MAX:
                    cases.append((kernel, INT32_MAX, x, d))
        # Head dims far beyond the library's 256: pyfa_smem_bytes still answers exactly.
        for d in (2**31, 2**40, 2**60, 2**62, INT64_MAX):
            cases.append((kernel, 64, 64, d))
            cases.append((kernel, 1, 1, d))
    cases.append(("fa1_backward", 1073764693, 2147437157, 150))
    cases.append(("fa2_forward", 64, 64, 2**62))
    return cases


def test_smem_bytes_is_exact_or_zero():
    cases = smem_cases()
    run = run_python(f"""
        import json
        from pyfa import _lib
        ffi, lib = _lib.load()
        kernels = {KERNELS!r}
        cases = {cases!r}
        print(json.dumps([lib.pyfa_smem_bytes(kernels[k], r, c, d) for k, r, c, d in cases]))
    """)
    got = json_result(run)
    wrong = [(case, value, exact_or_zero(*case)) for case, value in zip(cases, got)
             if value != exact_or_zero(*case)]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, e.g. (case, library, exact) {wrong[:5]}"
    # The cases reach both sides of the limit for every kernel, so the test can fail both ways.
    for kernel in KERNELS:
        mine = [exact_or_zero(*c) for c in cases if c[0] == kernel]
        assert any(v == 0 for v in mine) and any(v > 2**62 for v in mine), kernel


def test_smem_bytes_regressions():
    _, lib = _lib.load()
    assert lib.pyfa_smem_bytes(KERNELS["fa2_forward"], 64, 64, 2**62) == 0
    # 1073764693 x 2147437157 at d = 150 used to wrap to 171,536 bytes and pass the check.
    assert lib.pyfa_smem_bytes(KERNELS["fa1_backward"], 1073764693, 2147437157, 150) == 0
    assert lib.pyfa_smem_bytes(KERNELS["fa2_forward"], 64, 64, 0) == 0
    assert lib.pyfa_smem_bytes(KERNELS["fa2_forward"], 0, 64, 64) == 0
    assert lib.pyfa_smem_bytes(KERNELS["fa2_forward"], -64, 64, 64) == 0
    assert lib.pyfa_smem_bytes(99, 64, 64, 64) == 0


HUGE_TILES_CALL = """
    import json
    import numpy as np
    from pyfa import _lib
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=150))
    p = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    x = np.ones((4, 150), np.float32)
    row = np.ones(4, np.float32)
    results = {}
    for name, block_r, block_c in [("fa1_backward", 1073764693, 2147437157),
                                   ("fa2_backward", 1073764693, 2147437157),
                                   ("fa2_forward", 2147483647, 2147483647),
                                   ("fa1_forward", 2147483647, 1)]:
        cfg = ffi.new("pyfa_config *", dict(backend=lib.PYFA_BACKEND_EMU, block_r=block_r, block_c=block_c, emu_workers=1))
        outs = [np.full((4, 150), 7.0, np.float32) for _ in range(3)]
        rows = [np.full(4, 7.0, np.float32) for _ in range(2)]
        if name == "fa1_backward":
            st = lib.pyfa_fa1_backward(pr, cfg, p(x), p(x), p(x), p(x), p(row), p(row), p(x),
                                       *[p(o) for o in outs])
        elif name == "fa2_backward":
            st = lib.pyfa_fa2_backward(pr, cfg, p(x), p(x), p(x), p(x), p(row), p(x), *[p(o) for o in outs])
        elif name == "fa2_forward":
            st = lib.pyfa_fa2_forward(pr, cfg, p(x), p(x), p(x), p(outs[0]), p(rows[0]))
        else:
            st = lib.pyfa_fa1_forward(pr, cfg, p(x), p(x), p(x), p(outs[0]), p(rows[0]), p(rows[1]))
        untouched = all(bool(np.all(a == 7.0)) for a in outs + rows)
        results[name] = [st, ffi.string(lib.pyfa_last_error()).decode(), untouched, block_r, block_c]
    print(json.dumps(results))
"""


def test_huge_tiles_are_refused_cleanly():
    results = json_result(run_python(HUGE_TILES_CALL))
    for name, (status, message, untouched, block_r, block_c) in results.items():
        assert status == const("PYFA_ERROR_TILE_TOO_LARGE"), (name, status, message)
        assert f"block_r={block_r}" in message and f"block_c={block_c}" in message, message
        assert "bytes of shared memory" in message and untouched, (name, message)


def test_tensor_sizes_are_exact():
    """B * H * N * d beyond int64 is refused by exact arithmetic, not a wrapped product."""
    import numpy as np
    ffi, lib = _lib.load()
    x = np.zeros(8, np.float32)
    p = ffi.cast("float *", ffi.from_buffer(x))
    cfg = ffi.new("pyfa_config *", dict(backend=const("PYFA_BACKEND_EMU")))
    for fields in [dict(batch=65535, heads=65535, seqlen_q=2**40, seqlen_k=1, head_dim=256),
                   dict(batch=1, heads=1, seqlen_q=1, seqlen_k=2**62, head_dim=256),
                   dict(batch=2, heads=1, seqlen_q=2**59, seqlen_k=1, head_dim=2)]:
        pr = ffi.new("pyfa_problem *", fields)
        assert lib.pyfa_fa2_forward(pr, cfg, p, p, p, p, p) == 1
        assert "exceed 2^61 - 1" in ffi.string(lib.pyfa_last_error()).decode()


# ---- fault injection: every allocation after the Nth fails ----

def _build_fault_tools(tmp_path):
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler")
    if not sys.platform.startswith("linux"):
        pytest.skip("the malloc shim interposes glibc's allocator")
    lib = _lib.library_path()
    _, clib = _lib.load()
    version = _lib.load()[0].string(clib.pyfa_version()).decode()
    shim, driver = tmp_path / "fault_shim.so", tmp_path / "fault_driver"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
                    str(HERE / "c" / "fault_shim.c"), "-o", str(shim)], check=True)
    subprocess.run([cc, "-std=c99", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
                    f"-I{pyfa.get_include()}", f'-DPYFA_VERSION_EXPECTED="{version}"',
                    str(HERE / "c" / "fault_driver.c"), "-o", str(driver), str(lib),
                    f"-Wl,-rpath,{lib.parent}"], check=True)
    return shim, driver


def _run_driver(tmp_path, workers, mode, max_points=120, keep=None):
    shim, driver = _build_fault_tools(tmp_path)
    env = dict(os.environ, LD_PRELOAD=str(shim))
    env.pop("PYFA_HOST_KEEP_BYTES", None)
    if keep is not None:
        env["PYFA_HOST_KEEP_BYTES"] = keep
    env.pop("FAULTSHIM_FAIL_AFTER", None)
    run = subprocess.run([str(driver), str(workers), str(max_points), mode], capture_output=True,
                         text=True, env=env, timeout=600)
    lines = run.stdout.splitlines()
    last_call = next((l for l in reversed(lines) if l.startswith("call ")), "")
    violations = [l for l in lines if l.startswith("VIOLATION")]
    assert run.returncode == 0 and not violations, (
        f"fault_driver ended with {run.returncode} at '{last_call}':\n"
        + "\n".join(violations[:10]) + "\n" + run.stderr[-2000:])
    done = [l for l in lines if l.startswith("done ")]
    return done


@pytest.mark.slow
def test_failed_allocations_give_a_status_never_a_crash(tmp_path):
    # With no host scratch kept between calls, so that each call allocates its own.
    done = _run_driver(tmp_path, workers=1, mode="warm", keep="0")
    # Not vacuous: allocations were refused in every computing entry point, and the
    # calls reported out of memory.
    for entry in ("pyfa_fa2_forward", "pyfa_fa2_backward", "pyfa_fa2_backward_device", "pyfa_fa1_forward",
                  "pyfa_fa1_backward", "pyfa_fa1_forward_device"):
        refused = [l for l in done if l.startswith(f"done {entry} ") and " refused=0" not in l]
        assert refused and any(" status=6 " in l for l in refused), entry


@pytest.mark.slow
def test_failed_allocations_with_scratch_kept_between_calls(tmp_path):
    # The default: the blocks of earlier calls are reused, and those still allocated fail.
    done = _run_driver(tmp_path, workers=1, mode="warm")
    assert any(" status=6 " in l for l in done)


@pytest.mark.slow
def test_failed_allocations_on_fresh_threads(tmp_path):
    _run_driver(tmp_path, workers=1, mode="cold")


@pytest.mark.slow
def test_failed_allocations_with_emulator_workers(tmp_path):
    _run_driver(tmp_path, workers=2, mode="cold")


# ---- the CUDA paths of the C ABI, without a GPU ----
# tests/c/fake_cuda.cpp stands in for cuda_backend.cu: linked with the C ABI's own
# sources, it runs run_op's CUDA paths on host memory and logs every step.

FAKE_CUDA_SCRIPT = """
    import json, re, sys
    import cffi
    import numpy as np
    header, library = sys.argv[1], sys.argv[2]
    text = open(header).read()
    cdef = text.split("/* PYFA_CDEF_BEGIN */")[1].split("/* PYFA_CDEF_END */")[0]
    cdef = re.sub(r"PYFA_API ", "", cdef)
    ffi = cffi.FFI()
    ffi.cdef(cdef + "void fake_cuda_reset(int, int); const char* fake_cuda_log(void); int fake_cuda_live(void);")
    lib = ffi.dlopen(library)
    B, H, N, D = 1, 2, 8, 4
    p = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    calls = []

    @ffi.callback("int(void*, int64_t, int64_t)")
    def progress(user, done, total):
        calls.append([done, total])
        return 1 if [done, total] == stop[0] else 0

    stop = [None]
    results = []
    for case in json.loads(sys.argv[3]):
        lib.fake_cuda_reset(case.get("fail_check", -1), case.get("fail_launch", -1))
        calls.clear()
        stop[0] = case.get("cancel_at")
        pr = ffi.new("pyfa_problem *", dict(batch=B, heads=H, seqlen_q=N, seqlen_k=N, head_dim=D))
        cfg = ffi.new("pyfa_config *", dict(backend=case.get("backend", 1), block_r=4, block_c=4))
        if case.get("progress", True):
            cfg.progress = progress
        x = np.ones((B, H, N, D), np.float32)
        row = np.ones((B, H, N), np.float32)
        outs = [np.zeros((B, H, N, D), np.float32) for _ in range(3)]
        stream = ffi.cast("void *", 0x1234) if case["device"] else None
        if case["op"] == "fa2_backward":
            args = [pr, cfg] + [p(a) for a in (x, x, x, x, row, x)] + [p(o) for o in outs]
            fn = lib.pyfa_fa2_backward_device if case["device"] else lib.pyfa_fa2_backward
        else:
            outs = [outs[0], np.zeros((B, H, N), np.float32)]
            args = [pr, cfg, p(x), p(x), p(x), p(outs[0]), p(outs[1])]
            fn = lib.pyfa_fa2_forward_device if case["device"] else lib.pyfa_fa2_forward
        status = fn(*(args + [stream] if case["device"] else args))
        results.append(dict(status=status, message=ffi.string(lib.pyfa_last_error()).decode(),
                            log=ffi.string(lib.fake_cuda_log()).decode().split(chr(10))[:-1],
                            progress=list(calls), live=lib.fake_cuda_live(),
                            outs=[sorted(set(o.ravel().tolist())) for o in outs]))
    print(json.dumps(results))
"""


def fake_cuda(library, *cases):
    env = child_env()
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(FAKE_CUDA_SCRIPT),
                          str(ROOT / "src" / "include" / "pyfa.h"), str(library), json.dumps(list(cases))],
                         capture_output=True, text=True, env=env, timeout=120)
    return json_result(run)


def launches(result):
    return [e for e in result["log"] if e.startswith("launch")]


def test_cuda_host_entry_runs_on_the_library_stream_and_reports_progress(fake_cuda_library):
    (r,) = fake_cuda(fake_cuda_library, dict(op="fa2_backward", device=False))
    assert r["status"] == const("PYFA_OK"), r["message"]
    assert launches(r) == ["launch fa2_backward_preprocess library", "launch fa2_backward_dkdv library",
                           "launch fa2_backward_dq library"]
    # Everything on the library's stream, which is the only one waited for.
    assert all(e.endswith(" library") for e in r["log"] if not e.startswith("check")), r["log"]
    # Each kernel's launch configuration is checked before anything is allocated.
    assert [e for e in r["log"][:3]] == ["check fa2_backward_preprocess", "check fa2_backward_dkdv",
                                         "check fa2_backward_dq"]
    # Progress in kernels: before each, after waiting for the ones before, and at the end.
    assert r["progress"] == [[0, 3], [1, 3], [2, 3], [3, 3]]
    log = r["log"]
    assert log.index("sync library") < log.index("launch fa2_backward_dkdv library")
    first_copy = log.index("d2h library")
    assert first_copy > log.index("launch fa2_backward_dq library")
    assert "sync library" in log[log.index("launch fa2_backward_dq library"):first_copy]
    assert r["outs"] == [[8.0], [6.0], [7.0]] and r["live"] == 0


@pytest.mark.parametrize("cancel_at", [[0, 3], [1, 3], [2, 3], [3, 3]])
def test_cuda_host_entry_cancelled_writes_nothing(fake_cuda_library, cancel_at):
    (r,) = fake_cuda(fake_cuda_library, dict(op="fa2_backward", device=False, cancel_at=cancel_at))
    assert r["status"] == const("PYFA_ERROR_CANCELLED") and "cancelled" in r["message"], r
    assert len(launches(r)) == cancel_at[0]
    assert "d2h library" not in r["log"] and r["outs"] == [[0.0]] * 3 and r["live"] == 0


@pytest.mark.parametrize("fail_launch", [0, 1, 2])
def test_cuda_host_entry_failed_launch_writes_nothing(fake_cuda_library, fail_launch):
    (r,) = fake_cuda(fake_cuda_library, dict(op="fa2_backward", device=False, fail_launch=fail_launch))
    assert r["status"] == const("PYFA_ERROR_CUDA") and "refused" in r["message"]
    assert "d2h library" not in r["log"] and r["outs"] == [[0.0]] * 3 and r["live"] == 0


def test_cuda_configuration_errors_come_before_any_launch(fake_cuda_library):
    # The dQ kernel's configuration is refused: neither entry point has launched dK/dV.
    for device in (False, True):
        (r,) = fake_cuda(fake_cuda_library, dict(op="fa2_backward", device=device, fail_check=5))
        assert r["status"] == const("PYFA_ERROR_TILE_TOO_LARGE") and "fa2_backward_dq" in r["message"]
        assert not launches(r) and not [e for e in r["log"] if e.startswith("malloc")]
        assert r["outs"] == [[0.0]] * 3 and r["progress"] == []


def test_cuda_device_entry_runs_on_the_callers_stream_and_never_waits(fake_cuda_library):
    (r,) = fake_cuda(fake_cuda_library, dict(op="fa2_backward", device=True))
    assert r["status"] == const("PYFA_OK"), r["message"]
    assert launches(r) == ["launch fa2_backward_preprocess caller", "launch fa2_backward_dkdv caller",
                           "launch fa2_backward_dq caller"]
    assert not [e for e in r["log"] if e.startswith(("sync", "h2d", "d2h"))], r["log"]
    # Scratch D only, stream-ordered on the caller's stream.
    assert [e for e in r["log"] if e.startswith(("malloc", "free"))] == ["malloc caller", "free caller"]
    assert r["progress"] == [[0, 3]] and r["outs"] == [[8.0], [6.0], [7.0]] and r["live"] == 0


def test_cuda_device_entry_cancel_before_enqueueing(fake_cuda_library):
    (r,) = fake_cuda(fake_cuda_library, dict(op="fa2_backward", device=True, cancel_at=[0, 3]))
    assert r["status"] == const("PYFA_ERROR_CANCELLED") and not launches(r) and r["outs"] == [[0.0]] * 3 and r["live"] == 0


def test_cuda_device_entry_late_launch_failure_is_as_documented(fake_cuda_library):
    # pyfa.h: a launch refused after earlier kernels were enqueued leaves their outputs:
    # for pyfa_fa2_backward_device, dK and dV without dQ.
    (r,) = fake_cuda(fake_cuda_library, dict(op="fa2_backward", device=True, fail_launch=2))
    assert r["status"] == const("PYFA_ERROR_CUDA")
    assert r["outs"] == [[0.0], [6.0], [7.0]] and r["live"] == 0


def test_auto_is_cuda_on_both_entry_points_when_cuda_is_usable(fake_cuda_library):
    host, device = fake_cuda(fake_cuda_library, dict(op="fa2_forward", device=False, backend=const("PYFA_BACKEND_AUTO")),
                             dict(op="fa2_forward", device=True, backend=const("PYFA_BACKEND_AUTO"), progress=False))
    assert host["status"] == device["status"] == const("PYFA_OK")
    assert launches(host) == ["launch fa2_forward library"]
    assert launches(device) == ["launch fa2_forward caller"]
    assert host["outs"] == device["outs"] == [[1.0], [2.0]]


def test_smem_bytes_refuses_internal_kernel_ids():
    # Rows 6 and up of src/kernels/table.h are the fast variants' ids, the library's own:
    # pyfa_smem_bytes and pyfa_variant_smem_bytes answer 0 for them as for any unknown
    # kernel, even where the fast layouts would have a size.
    ffi, lib = _lib.load()
    for kernel in (-1, 6, 7, 13, 20, 21, 1000):
        for d in (64, 128, 2**62, 2**63 - 1):
            assert lib.pyfa_smem_bytes(kernel, 64, 64, d) == 0, (kernel, d)
            for variant in (0, 1, 2):
                assert lib.pyfa_variant_smem_bytes(kernel, variant, 64, 64, d) == 0, (kernel, variant, d)
    assert lib.pyfa_smem_bytes(1, 64, 64, 64) > 0
    assert lib.pyfa_variant_smem_bytes(1, 2, 64, 64, 64) > 0
    assert lib.pyfa_variant_smem_bytes(1, 3, 64, 64, 64) == 0  # an unknown variant


def test_every_table_rows_smem_size_is_free_of_undefined_behaviour(tmp_path):
    # tests/c/smem_ubsan.cpp asks src/core/tiles.cpp for every row's size (the fast rows'
    # too) at arguments up to INT64_MAX, built with -fsanitize=undefined: a signed overflow
    # (2 * d at d = INT64_MAX, say) stops it.
    cxx = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None:
        pytest.skip("no C++ compiler to build the UBSan program")
    exe = tmp_path / "smem_ubsan"
    src = ROOT / "src"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-fsanitize=undefined", "-fno-sanitize-recover=all",
                            f"-I{src}", f"-I{src / 'include'}", f"-I{pyfa.get_include()}",
                            str(HERE / "c" / "smem_ubsan.cpp"), str(src / "core" / "tiles.cpp"),
                            str(src / "core" / "errors.cpp"), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"{cxx} cannot build with -fsanitize=undefined here: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "smem: ok" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_unloading_the_library_releases_the_emulators_workers(tmp_path):
    # tests/c/unload_loop.c: dlopen, one emulated call on two workers, dlclose, 40 times.
    # Each parked worker holds a few hundred mappings; kept past unload they would add up
    # to thousands here (and hit the process's mapping limit after a few hundred cycles).
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler to build the unload loop")
    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps to count mappings in")
    exe = tmp_path / "unload_loop"
    subprocess.run([cc, "-std=c99", "-Wall", "-Wextra", "-Werror", f"-I{pyfa.get_include()}",
                    str(HERE / "c" / "unload_loop.c"), "-o", str(exe), "-ldl"], check=True)
    run = subprocess.run([str(exe), str(_lib.library_path()), "40"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    early, late = map(int, run.stdout.split()[1:3])
    assert early > 0 and late - early < 20, run.stdout


def test_the_library_is_built_hardened():
    # CMakeLists.txt: full RELRO (BIND_NOW and a GNU_RELRO segment), stack canaries
    # (__stack_chk_fail referenced) and, in an optimised build, fortified libc calls.
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not found: the library's ELF headers cannot be read")
    library = _lib.library_path().resolve()
    dynamic = subprocess.run([readelf, "-dW", str(library)], capture_output=True, text=True, check=True).stdout
    assert "BIND_NOW" in dynamic or re.search(r"FLAGS_1\).*\bNOW\b", dynamic), dynamic
    segments = subprocess.run([readelf, "-lW", str(library)], capture_output=True, text=True, check=True).stdout
    assert "GNU_RELRO" in segments
    symbols = subprocess.run([readelf, "--dyn-syms", "-W", str(library)], capture_output=True, text=True,
                             check=True).stdout
    assert "__stack_chk_fail" in symbols
    cache = library.parent / "CMakeCache.txt"
    build_type = "Release"  # a wheel's build
    if cache.exists():
        m = re.search(r"^CMAKE_BUILD_TYPE:\w+=(\w*)$", cache.read_text(), re.M)
        build_type = m.group(1) if m else ""
    if build_type in ("Release", "RelWithDebInfo", "MinSizeRel"):
        fortified = set(re.findall(r"\b(__\w+_chk)\b", symbols)) - {"__stack_chk_fail"}
        assert fortified, "no fortified libc call (__*_chk) in an optimised build"
