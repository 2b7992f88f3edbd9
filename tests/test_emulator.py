"""Builds and runs the C++ self-test of the host emulation runtime (cuda/emu)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EMU_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cuda" / "emu").glob("*.cpp"))


def test_emulator_selftest(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the emulator self-test is C++ and needs it to build")
    exe = tmp_path / "selftest"
    build = subprocess.run(
        [
            gxx, "-std=c++17", "-O2", "-ffp-contract=off", "-pthread", "-I", "cuda",
            "tests/emu/emu_selftest.cpp", *EMU_SOURCES, "-o", str(exe),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"self-test build failed:\n{build.stdout}\n{build.stderr}"

    # The self-test has its own 120 s watchdog; this bound only guards against a stuck process.
    run = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert run.returncode == 0, f"self-test failed (rc {run.returncode}):\n{out}"
    assert lines and lines[-1].startswith("emu selftest: "), f"no summary line:\n{out}"
    assert lines[-1].endswith(" passed, 0 failed"), f"self-test reported failures:\n{out}"
    assert not any(line.startswith("FAIL") for line in lines), out
