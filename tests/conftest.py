import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyfa

ROOT = Path(__file__).resolve().parent.parent


def _cuda_usable():
    try:
        return "cuda" in pyfa.backends()
    except pyfa.LibraryNotFoundError:
        return False


HAS_CUDA = _cuda_usable()


def pytest_report_header(config):
    try:
        return f"pyfa backends: {pyfa.backends()}, library {pyfa.library_version()}"
    except pyfa.LibraryNotFoundError as e:
        return f"pyfa library not loaded: {e}"


@pytest.fixture(scope="session")
def fake_cuda_build(tmp_path_factory):
    """libpyfa's C ABI over tests/c/fake_cuda.cpp (a stand-in for the CUDA backend), built
    once per test session as pyfa's version, so that pyfa's loader also takes it."""
    pytest.importorskip("cffi")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler to build the fake CUDA backend")
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_limits
    return gpu_limits.build_fake(tmp_path_factory.mktemp("fake_cuda") / "libpyfa.so", pyfa.get_include(),
                                 version=pyfa.__version__)


@pytest.fixture(scope="module")
def fake_cuda_library(fake_cuda_build, tmp_path_factory):
    """A copy of the fake CUDA library of this module's own: a process that loads it gets
    state of its own, never another module's."""
    folder = tmp_path_factory.mktemp("fake_cuda_copy")
    return Path(shutil.copy(fake_cuda_build, folder / "libpyfa.so"))


def _sh(command, cwd):
    run = subprocess.run(["/bin/sh", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{command}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


@pytest.fixture(scope="session")
def cmake_build(tmp_path_factory):
    """An emulator-only CMake build of this source tree, and its `cmake --install` into a
    prefix: (build folder, prefix), for the tests that need a build tree or a prefix of
    their own (marked xdist_group("cmake_build"), so that one worker builds it once).
    Unoptimised: what is checked here is the layout, linking and the bits (which the
    numerical contract keeps the same at every optimisation level), and -O0 builds it in
    less than half the time."""
    cmake, cc = shutil.which("cmake"), shutil.which("cc")
    if cmake is None or cc is None:
        pytest.skip("cmake and cc are needed to build the library with CMake")
    tmp = tmp_path_factory.mktemp("cmake-install")
    build, prefix = tmp / "build", tmp / "prefix"
    q = shlex.quote
    _sh(f"{q(cmake)} -S {q(str(ROOT))} -B {q(str(build))} -DPYFA_WITH_CUDA=OFF "
       "-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 "
       f"&& {q(cmake)} --build {q(str(build))} -j2 "
       f"&& {q(cmake)} --install {q(str(build))} --prefix {q(str(prefix))}", cwd=tmp)
    return build, prefix
