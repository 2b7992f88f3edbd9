"""The C ABI from C: a C99 program compiled with -Wall -Werror links libpyfa and checks a
result; the header also compiles as C++."""

import shutil
import subprocess
from pathlib import Path

import pytest

import pyfa
from pyfa import _lib

# pyfa.h's enum values, as the loader parses them from the header.
const = _lib.constant

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
    assert lib.pyfa_backend_compiled(const("PYFA_BACKEND_EMU")) == 1
    if shutil.which("nvcc"):
        assert lib.pyfa_backend_compiled(const("PYFA_BACKEND_CUDA")) == 1


def _load_in_subprocess(env_library):
    import os
    import sys
    import pyfa
    # PYTHONPATH prepended, never replaced: on the GPU machine cffi is found only through it.
    path = [str(Path(pyfa.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYFA_LIBRARY=str(env_library), PYTHONPATH=os.pathsep.join(p for p in path if p))
    # From the imported pyfa's parent: a checkout's pyfa/ in the current directory would
    # come first on sys.path and shadow an installed pyfa under test.
    return subprocess.run([sys.executable, "-c", "import pyfa; print(pyfa.backends())"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=path[0])


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


def test_the_op_table_matches_the_c_declarations_and_the_python_functions():
    import inspect

    import pyfa
    ffi, lib = _lib.load()
    declared = {n for n in dir(lib) if n.startswith("pyfa_") and n.endswith(("_forward", "_backward"))}
    assert {op.c_function for op in pyfa.api.OPS.values()} == declared
    for name, op in pyfa.api.OPS.items():
        tensors = len(op.inputs) + len(op.outputs)
        host = ffi.typeof(getattr(lib, op.c_function))
        assert [a.cname for a in host.args] == ["pyfa_problem *", "pyfa_config *"] + ["float *"] * tensors, name
        device = ffi.typeof(getattr(lib, op.device_function))
        assert [a.cname for a in device.args] == [a.cname for a in host.args] + ["void *"], name
        assert set(op.inputs + op.outputs) <= set(pyfa.api.TENSOR_KINDS)
        assert set(op.kernels) <= set(pyfa.api.KERNELS) and op.algo + "_" + op.pass_ == name
        # The Python function takes the inputs in C order, so callers may go by the table.
        params = [p.name for p in inspect.signature(getattr(pyfa, name)).parameters.values()
                  if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert params == list(op.inputs), name
    assert sorted(k for op in pyfa.api.OPS.values() for k in op.kernels) == sorted(pyfa.api.KERNELS)


def test_struct_size_keeps_todays_callers_and_refuses_unpublished_layouts(tmp_path):
    # tests/c/struct_size.c: zero-initialised structs with only ABI 2's fields give ABI 2's
    # results; ABI 3's config size hides flags; sizes of no published layout are refused.
    cc = compiler("cc", "gcc", "clang")
    lib = _lib.library_path()
    exe = tmp_path / "struct_size"
    subprocess.run([cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic",
                    f"-I{pyfa.get_include()}", str(HERE / "c" / "struct_size.c"), "-o", str(exe),
                    str(lib), f"-Wl,-rpath,{lib.parent}", "-lm"], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "struct_size: ok" in run.stdout
