import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path


def _share_the_cores_between_workers():
    """One OpenMP (torch) and OpenBLAS (numpy) thread per core a pytest-xdist worker has of
    its own, unless the environment says otherwise. Each pool otherwise starts one thread
    per core in every worker, and its threads spin while they wait for each other: with
    every worker running, the cores are oversubscribed and the torch tests took about twice
    their CPU time. pyfa's own threads are the tests' to choose and are left alone. Before
    numpy and torch are imported: their pools read this once, at start-up."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and hasattr(os, "sched_getaffinity"):
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))


_share_the_cores_between_workers()

import pytest  # noqa: E402

import pyfa  # noqa: E402

try:
    import fcntl
except ImportError:  # no file locks (Windows): each xdist worker builds its own
    fcntl = None

ROOT = Path(__file__).resolve().parent.parent


def _cuda_usable():
    try:
        return "cuda" in pyfa.backends()
    except pyfa.LibraryNotFoundError:
        return False


HAS_CUDA = _cuda_usable()


# The xdist groups (tests/test_suite.py checks that they take effect): cmake_build and
# ptxas_build share one build each, context_parallel one spawn of the ranks, inductor one
# process's torch.compile start-up (tens of seconds the first time in a process).
def pytest_collection_modifyitems(config, items):
    """The slow tests (builds and tools, seconds each) first: pytest-xdist hands out the
    rest behind them, so that no long test starts late and runs alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def built_once(tmp_path_factory, name, make):
    """A folder that make(folder) fills once per test run: under pytest-xdist the first
    worker to ask builds it while the others wait for it, and all of them share it; a
    failed make leaves nothing behind, so the next worker to ask tries again."""
    root = tmp_path_factory.getbasetemp()
    if fcntl is not None and os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder, done = root / f"built-{name}", root / f"built-{name}.done"
    with open(root / f"built-{name}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


def pytest_report_header(config):
    try:
        return f"pyfa backends: {pyfa.backends()}, library {pyfa.library_version()}"
    except pyfa.LibraryNotFoundError as e:
        return f"pyfa library not loaded: {e}"


@pytest.fixture(scope="session")
def fake_cuda_build(tmp_path_factory):
    """libpyfa's C ABI over tests/c/fake_cuda.cpp (a stand-in for the CUDA backend), built
    once per test run (for every xdist worker) as pyfa's version, so that pyfa's loader
    also takes it."""
    pytest.importorskip("cffi")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler to build the fake CUDA backend")
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_limits
    folder = built_once(tmp_path_factory, "fake_cuda",
                        lambda out: gpu_limits.build_fake(out / "libpyfa.so", pyfa.get_include(),
                                                          version=pyfa.__version__))
    return folder / "libpyfa.so"


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
    their own (marked xdist_group("cmake_build"), and built_once besides, so that it is
    built once per run even where a second worker asks for it).
    Unoptimised: what is checked here is the layout, linking and the bits (which the
    numerical contract keeps the same at every optimisation level), and -O0 builds it in
    less than half the time."""
    cmake, cc = shutil.which("cmake"), shutil.which("cc")
    if cmake is None or cc is None:
        pytest.skip("cmake and cc are needed to build the library with CMake")
    q = shlex.quote

    def make(tmp):
        build, prefix = tmp / "build", tmp / "prefix"
        _sh(f"{q(cmake)} -S {q(str(ROOT))} -B {q(str(build))} -DPYFA_WITH_CUDA=OFF "
           "-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 "
           f"&& {q(cmake)} --build {q(str(build))} -j2 "
           f"&& {q(cmake)} --install {q(str(build))} --prefix {q(str(prefix))}", cwd=tmp)

    tmp = built_once(tmp_path_factory, "cmake-install", make)
    return tmp / "build", tmp / "prefix"
