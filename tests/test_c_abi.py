"""The C ABI from C: a C99 program compiled with -Wall -Werror links libpyfa and checks a
result; the header also compiles as C++."""

import shutil
import subprocess
from pathlib import Path

import pytest

import pyfa
from pyfa import _lib

HERE = Path(__file__).resolve().parent


def compiler(*names):
    for name in names:
        if shutil.which(name):
            return name
    pytest.skip(f"no compiler among {names}")


def test_c99_program_links_and_checks_a_result(tmp_path):
    cc = compiler("cc", "gcc", "clang")
    lib = _lib.library_path()
    include = pyfa.get_include()
    exe = tmp_path / "smoke"
    subprocess.run([cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{include}",
                    str(HERE / "c" / "smoke.c"), "-o", str(exe), str(lib),
                    f"-Wl,-rpath,{lib.parent}", "-lm"], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "max abs error" in run.stdout


def test_header_compiles_as_cpp(tmp_path):
    cxx = compiler("c++", "g++", "clang++")
    include = pyfa.get_include()
    src = tmp_path / "h.cpp"
    src.write_text('#include "pyfa.h"\nint main() { pyfa_problem p{}; return p.causal; }\n')
    subprocess.run([cxx, "-std=c++11", "-Wall", "-Werror", f"-I{include}", "-fsyntax-only", str(src)],
                   check=True)


def test_cuda_backend_compiled_when_nvcc_is_here():
    # The build must pick up nvcc when it is installed, so that a CUDA compile error
    # fails the install (and CI) instead of silently yielding an emulator-only library.
    _, lib = _lib.load()
    assert lib.pyfa_backend_compiled(2) == 1
    if shutil.which("nvcc"):
        assert lib.pyfa_backend_compiled(1) == 1


def _load_in_subprocess(env_library):
    import os
    import sys
    import pyfa
    env = dict(os.environ, PYFA_LIBRARY=str(env_library),
               PYTHONPATH=str(Path(pyfa.__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-c", "import pyfa; print(pyfa.backends())"],
                          capture_output=True, text=True, env=env, timeout=60)


def test_pyfa_library_names_the_only_place_tried(tmp_path):
    missing = tmp_path / "nowhere" / "libpyfa.so"
    run = _load_in_subprocess(missing)
    assert run.returncode != 0
    assert "LibraryNotFoundError" in run.stderr and str(missing) in run.stderr
    assert "PYFA_LIBRARY: no such file" in run.stderr


def test_a_file_that_is_not_a_library_is_reported_with_the_loader_message(tmp_path):
    bogus = tmp_path / "libpyfa.so"
    bogus.write_text("not a shared library\n")
    run = _load_in_subprocess(bogus)
    assert run.returncode != 0
    assert str(bogus) in run.stderr and "PYFA_LIBRARY:" in run.stderr


def test_pyfa_library_selects_the_library(tmp_path):
    run = _load_in_subprocess(_lib.library_path())
    assert run.returncode == 0 and "emu" in run.stdout
