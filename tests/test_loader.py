"""The loader: only a libpyfa that matches the header and the package is loaded; anything
else is refused at load time with LibraryNotFoundError naming the file and the mismatch.
A checkout's own pyfa/ finds the library pip installed (python -m pyfa at the repo root)."""

import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyfa
from pyfa import _lib
from pyfa._version import DISTRIBUTION

ROOT = Path(pyfa.__file__).resolve().parents[1]   # where the pyfa under test lives
REPO = Path(__file__).resolve().parents[1]         # the checkout these tests belong to


def python_env(**extra):
    """The environment of a child Python that imports this pyfa (PYTHONPATH prepended,
    so that packages found only through PYTHONPATH, such as cffi on the GPU machine, stay)."""
    env = dict(os.environ, **{k: str(v) for k, v in extra.items()})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def load_with(library):
    # Run from ROOT: `python -c` puts the current directory first on sys.path, and a
    # checkout's pyfa/ there would shadow an installed pyfa under test.
    code = "import pyfa; print(pyfa._lib.library_path()); print(pyfa.backends())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=python_env(PYFA_LIBRARY=library), cwd=ROOT)


def declared_functions():
    ffi, lib = _lib.load()
    return sorted(n for n in dir(lib) if n.startswith("pyfa_"))


def compiler():
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    pytest.skip("no C compiler")


def fake_library(tmp_path, abi, version):
    """A shared library that defines every declared pyfa_ symbol, with other meanings:
    each returns 0, except pyfa_abi_version (abi) and pyfa_version (version)."""
    lines = []
    for name in declared_functions():
        if name == "pyfa_abi_version":
            lines.append(f"int {name}(void) {{ return {abi}; }}")
        elif name == "pyfa_version":
            lines.append(f'const char* {name}(void) {{ return "{version}"; }}')
        else:
            lines.append(f"int {name}(void) {{ return 0; }}")
    src = tmp_path / "fake.c"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "libfake.so"
    subprocess.run([compiler(), "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return out


def test_libm_is_not_libpyfa():
    libm = ctypes.util.find_library("m")
    if not libm:
        pytest.skip("no libm found")
    path = next((p for p in ("/lib/x86_64-linux-gnu/" + libm, "/usr/lib/x86_64-linux-gnu/" + libm,
                             "/lib64/" + libm, "/usr/lib/" + libm) if Path(p).is_file()), libm)
    run = load_with(path)
    assert run.returncode != 0
    assert "LibraryNotFoundError" in run.stderr and path in run.stderr
    assert "declared symbols do not resolve" in run.stderr and "pyfa_abi_version" in run.stderr


def test_a_library_of_another_abi_is_refused(tmp_path):
    fake = fake_library(tmp_path, abi=0, version=pyfa.__version__)
    run = load_with(fake)
    assert run.returncode != 0
    header = _lib.header_path()
    abi = _lib._read_header()[2]
    assert f"{fake} (PYFA_LIBRARY: ABI version 0, but {header} declares PYFA_ABI_VERSION {abi})" in run.stderr


def test_a_library_of_another_version_is_refused(tmp_path):
    fake = fake_library(tmp_path, abi=_lib._read_header()[2], version="9.9.9")
    run = load_with(fake)
    assert run.returncode != 0
    assert (f"{fake} (PYFA_LIBRARY: library version 9.9.9, but the pyfa package is "
            f"{pyfa.__version__})") in run.stderr


def test_a_directory_is_reported_as_one(tmp_path):
    run = load_with(tmp_path)
    assert run.returncode != 0
    assert f"{tmp_path} (PYFA_LIBRARY: is a directory, not a library file)" in run.stderr


def test_every_declared_function_resolves_in_the_real_library():
    ffi, lib = _lib.load()
    for name in declared_functions():
        getattr(lib, name)
    assert lib.pyfa_abi_version() == _lib._read_header()[2]


def test_a_checkout_without_a_build_finds_the_installed_library(tmp_path):
    # The situation of `pip install . && python -m pyfa` at a fresh clone's root: the
    # current directory's pyfa/ (no library, no build/) is imported, and the library is
    # the one pip put in site-packages, found through the distribution's file list.
    checkout, site = tmp_path / "clone", tmp_path / "site"
    shutil.copytree(REPO / "pyfa", checkout / "pyfa", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (checkout / "src" / "include").mkdir(parents=True)
    shutil.copy(REPO / "src" / "include" / "pyfa.h", checkout / "src" / "include" / "pyfa.h")
    (checkout / "CMakeLists.txt").write_text("# a checkout\n")
    lib_name = _lib.library_path().name
    (site / "pyfa").mkdir(parents=True)
    shutil.copy(_lib.library_path(), site / "pyfa" / lib_name)
    info = site / f"{DISTRIBUTION.replace('-', '_')}-{pyfa.__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\n"
                                   f"Version: {pyfa.__version__}\n")
    (info / "RECORD").write_text(f"pyfa/{lib_name},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p and Path(p).resolve() != ROOT))
    env.pop("PYFA_LIBRARY", None)
    code = "import pyfa; print(pyfa.__file__); print(pyfa._lib.library_path()); print(pyfa.backends())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env, cwd=checkout)
    assert run.returncode == 0, run.stderr
    module, library, backends = run.stdout.splitlines()
    assert Path(module).resolve() == (checkout / "pyfa" / "__init__.py").resolve()
    assert Path(library) == (site / "pyfa" / lib_name).resolve()
    assert "emu" in backends
