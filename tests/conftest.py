import shutil
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
