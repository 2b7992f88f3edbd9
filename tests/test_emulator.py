"""The host emulation runtime (src/backends/emu): its C++ self-test, the library's kernels on it
under memory exhaustion, and its limits as the C ABI reports them."""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

import emu_abi
import pyfa
from conftest import built_once

ROOT = pathlib.Path(__file__).resolve().parent.parent
EMU_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src" / "backends" / "emu").glob("*.cpp")
                     # the runtime alone, without the library's adapter and its strict kernels
                     if p.name not in ("emu_backend.cpp", "emu_strict_kernels.cpp"))
MAX_WORKERS = 256  # pyfa_emu::kMaxWorkers
FIBER_STACK_BYTES = 64 * 1024  # pyfa_emu::kFiberStackBytes


def compiler(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: this test builds C/C++ and needs it")
    return path


def emu_runtime(tmp_path_factory):
    """The object files of EMU_SOURCES, compiled (-O2) once per test run for every program
    of these tests that links the runtime."""
    cxx = compiler("g++")

    def make(out):
        build = subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-pthread", "-I", str(ROOT / "src"),
                                "-I", pyfa.get_include(), "-c", *(str(ROOT / s) for s in EMU_SOURCES)],
                               cwd=out, capture_output=True, text=True, timeout=300)
        assert build.returncode == 0, f"emulation runtime build failed:\n{build.stdout}\n{build.stderr}"

    return sorted(str(o) for o in built_once(tmp_path_factory, "emu_runtime", make).glob("*.o"))


def build_cxx(tmp_path_factory, out, name, main_source):
    exe = out / name
    build = subprocess.run(
        [compiler("g++"), "-std=c++17", "-O2", "-ffp-contract=off", "-pthread", "-I", "src",
         "-I", pyfa.get_include(), main_source, *emu_runtime(tmp_path_factory), "-o", str(exe), "-ldl"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"{name} build failed:\n{build.stdout}\n{build.stderr}"
    return exe


def summary_ok(run, prefix):
    out = run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert run.returncode == 0, f"rc {run.returncode}:\n{out}"
    assert lines and lines[-1].startswith(prefix), f"no summary line:\n{out}"
    assert not any(line.startswith("FAIL") for line in lines), out
    return lines


@pytest.mark.slow
def test_emulator_selftest(tmp_path_factory, tmp_path):
    exe = build_cxx(tmp_path_factory, tmp_path, "selftest", "tests/emu/emu_selftest.cpp")
    # The self-test has its own 120 s watchdog; this bound only guards against a stuck process.
    run = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = summary_ok(run, "emu selftest: ")
    assert lines[-1].endswith(" passed, 0 failed"), run.stdout


@pytest.fixture(scope="module")
def emu_faults(tmp_path_factory):
    """tests/emu/emu_faults.cpp built once for the two tests below (the readable kernels, -O2)."""
    return build_cxx(tmp_path_factory, tmp_path_factory.mktemp("emu_faults"), "emu_faults",
                     "tests/emu/emu_faults.cpp")


@pytest.mark.slow
@pytest.mark.xdist_group("emu_faults")
def test_kernels_stack_use_is_far_below_the_fiber_stack(emu_faults):
    run = subprocess.run([str(emu_faults), "stack"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = summary_ok(run, "emu faults: ")
    used = {line.split(":")[0]: int(line.split(":")[1].split()[0])
            for line in lines if line.startswith("stack ")}
    assert len(used) == 6 * 4, run.stdout  # every kernel at d = 32, 64, 128, 256
    assert max(used.values()) < FIBER_STACK_BYTES // 8, run.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("emu_faults")
def test_allocation_failures_give_a_status_never_a_crash(emu_faults, tmp_path):
    """Every memory request of an FA2 launch failed in turn, under an LD_PRELOAD shim."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the allocation-failing shim is for glibc on Linux")
    shim = tmp_path / "fail_alloc.so"
    build = subprocess.run([compiler("cc"), "-O2", "-shared", "-fPIC", "tests/emu/fail_alloc.c",
                            "-o", str(shim), "-ldl"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(emu_faults), "sweep"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "LD_PRELOAD": str(shim)})
    lines = summary_ok(run, "emu faults: ")
    assert sum(line.startswith("sweep ") for line in lines) == 6, run.stdout
    assert sum(line.endswith("went on with 1 of 3") for line in lines) == 3, run.stdout


def small_fa2():
    return {**emu_abi.tensors(("q", "k", "v"), 1, 2, 40, 16, seed=9),
            **emu_abi.tensors(("o", "lse"), 1, 2, 40, 16, fill=0.0)}


def test_emu_workers_is_capped_with_an_error_naming_it():
    status, message = emu_abi.call("pyfa_fa2_forward", small_fa2(), workers=MAX_WORKERS + 1)
    assert status == emu_abi.INVALID_ARGUMENT
    assert "config->emu_workers" in message and str(MAX_WORKERS) in message, message
    status, message = emu_abi.call("pyfa_fa2_forward", small_fa2(), workers=MAX_WORKERS)
    assert status == emu_abi.OK, message


OOM_SCRIPT = textwrap.dedent("""
    import resource
    import emu_abi

    def address_space():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    t = {**emu_abi.tensors(("q", "k", "v"), 1, 1, 64, 32, seed=1),
         **emu_abi.tensors(("o", "m", "l"), 1, 1, 64, 32, fill=7.0)}
    emu_abi.load()
    # Room for everything but FA1's 256 guarded fiber stacks (about 34 MB).
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + (8 << 20), hard))
    status, message = emu_abi.call("pyfa_fa1_forward", t, workers=1)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    print(status, message)
    print(int((t["o"] == 7.0).all()))
    status, message = emu_abi.call("pyfa_fa1_forward", t, workers=1)
    print(status, message)
""")


def test_no_memory_for_fiber_stacks_is_out_of_memory():
    if not pathlib.Path("/proc/self/status").exists():
        pytest.skip("needs /proc to size the address-space limit")
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", OOM_SCRIPT], cwd=ROOT / "tests",
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stdout + run.stderr
    first, untouched, second = run.stdout.splitlines()[-3:]
    assert first.startswith(f"{emu_abi.OUT_OF_MEMORY} "), run.stdout
    assert "out of memory" in first and "fiber stacks" in first, first
    assert untouched == "1", "outputs written by a failed call"
    assert second.startswith(f"{emu_abi.OK} "), second
