"""The backend interface (src/core/internal.h): a fourth backend is one file and one
registration line. tests/c/toy_backend.cpp forwards every op to the cpu backend under an
id (100) and a label of its own; built into a copy of the library (the pyfa_toy target of
the build tree), it runs each op with the cpu backend's bits and is reported like any
other backend, while AUTO never picks it."""

import shutil
import subprocess

import numpy as np
import pytest

from pyfa import _lib

TOY = 100


# The toy is built in a CMake build tree: the loaded library's own in a checkout, else the
# suite's shared one (conftest.py's cmake_build), which one worker builds for every module
# of this group.
pytestmark = pytest.mark.xdist_group("cmake_build")


@pytest.fixture(scope="module")
def toy(request):
    build = _lib.library_path().parent
    if not (build / "CMakeCache.txt").exists():
        build = request.getfixturevalue("cmake_build")[0]
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not found: the pyfa_toy target needs it")
    r = subprocess.run([cmake, "--build", str(build), "--target", "pyfa_toy"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ffi, _ = _lib.load()
    return ffi, ffi.dlopen(str(build / "libpyfa_toy.so"))


def call(ffi, L, backend, op, variant=0):
    rng = np.random.default_rng(op)
    B, H, HKV, NQ, NK, D = 2, 4, 2, 19, 21, 32
    q = rng.standard_normal((B, H, NQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, NK, D)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((B, H, NQ, D)).astype(np.float32)
    o, rows = np.zeros_like(q), np.zeros((B, H, NQ), np.float32)
    names = {0: dict(o=o, lse=rows), 2: dict(o=o, m=rows, l=rows.copy())}
    p = ffi.new("pyfa_problem*")
    p.struct_size = ffi.sizeof("pyfa_problem")
    p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim, p.causal = B, H, HKV, NQ, NK, D, 1
    c = ffi.new("pyfa_config*")
    c.struct_size = ffi.sizeof("pyfa_config")
    c.backend, c.threads, c.variant = backend, 2, variant
    t = ffi.new("pyfa_tensors*")
    t.struct_size = ffi.sizeof("pyfa_tensors")
    keep = []

    def bind(name, a):
        keep.append(a)
        getattr(t, name).data = ffi.cast("void*", ffi.from_buffer(a))

    for name, a in dict(q=q, k=k, v=v).items():
        bind(name, a)
    fwd = 0 if op in (0, 1) else 2
    for name, a in names[fwd].items():
        bind(name, a)
    if op in (1, 3):
        # The backward's inputs: the forward's outputs, computed first on the same backend.
        st = L.pyfa_run(fwd, p, c, t, ffi.NULL)
        assert st == 0, ffi.string(L.pyfa_last_error()).decode()
        bind("dout", do)
        outs = dict(dq=np.zeros_like(q), dk=np.zeros_like(k), dv=np.zeros_like(v))
        for name, a in outs.items():
            bind(name, a)
    else:
        outs = names[fwd]
    st = L.pyfa_run(op, p, c, t, ffi.NULL)
    return st, ffi.string(L.pyfa_last_error()).decode(), {n: a.copy() for n, a in outs.items()}


@pytest.mark.parametrize("op", [0, 1, 2, 3])
def test_the_toy_backend_runs_every_op_with_the_cpu_backends_bits(toy, op):
    ffi, L = toy
    _, main = _lib.load()
    st, msg, got = call(ffi, L, TOY, op)
    assert st == 0, msg
    st, msg, want = call(ffi, main, 3, op)
    assert st == 0, msg
    for name in want:
        assert np.isfinite(got[name]).all() and np.any(got[name] != 0), name
        assert got[name].tobytes() == want[name].tobytes(), name


def test_the_toy_backend_is_reported_like_the_others_and_auto_never_picks_it(toy):
    ffi, L = toy
    assert L.pyfa_backend_available(TOY) == 1 and L.pyfa_backend_compiled(TOY) == 1
    assert ffi.string(L.pyfa_backend_reason(TOY)) == b""
    assert L.pyfa_backend_available(TOY + 1) == 0
    assert ffi.string(L.pyfa_backend_reason(TOY + 1)) == b"unknown backend"
    prof = ffi.new("pyfa_device_profile*")
    assert L.pyfa_device_profile_get(TOY, prof) == 0
    assert ffi.string(prof.name).decode().startswith("pyfa cpu")
    auto = ffi.new("pyfa_device_profile*")
    assert L.pyfa_device_profile_get(0, auto) == 0
    assert ffi.string(auto.name) == ffi.string(prof.name)  # AUTO: cuda (absent here) or cpu, never the toy
    if L.pyfa_backend_available(1):
        pytest.fail("this check assumes no GPU; AUTO would pick CUDA")
    st, msg, _ = call(ffi, L, TOY, 0, variant=2)
    assert st == 1 and msg.startswith("config->variant: fast: the toy backend has kernels of its own"), msg
