"""pyfa_run, the entry point every per-op function wraps (src/include/pyfa.h): the same
bits as the per-op entry points, including for a C program compiled against the ABI 4
header; named tensors refused where the op does not take them or needs them; strides
given in one place."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import pyfa
from pyfa import _lib

HERE = Path(__file__).resolve().parent
OP = dict(fa2_forward=0, fa2_backward=1, fa1_forward=2, fa1_backward=3)
B, H, HKV, NQ, NK, D = 2, 4, 2, 9, 13, 16


def lib():
    return _lib.load()


def problem(ffi, **fields):
    p = ffi.new("pyfa_problem*")
    p.struct_size = ffi.sizeof("pyfa_problem")
    p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim = B, H, HKV, NQ, NK, D
    p.causal = 1
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def config(ffi, backend):
    c = ffi.new("pyfa_config*")
    c.struct_size = ffi.sizeof("pyfa_config")
    c.backend, c.block_r, c.block_c, c.emu_workers, c.threads = backend, 4, 8, 1, 1
    return c


def tensors(ffi, memory=0, **arrays):
    """A pyfa_tensors naming each array (a (array, strides) pair for explicit strides)."""
    t = ffi.new("pyfa_tensors*")
    t.struct_size = ffi.sizeof("pyfa_tensors")
    t.memory = memory
    for name, a in arrays.items():
        strides = (0, 0, 0)
        if isinstance(a, tuple):
            a, strides = a
        field = getattr(t, name)
        field.data = ffi.cast("void*", ffi.from_buffer(a))
        field.strides.batch, field.strides.head, field.strides.row = strides
    return t


def run(op, p, c, t, stream=None):
    ffi, L = lib()
    st = L.pyfa_run(OP[op], p, c, t, ffi.NULL if stream is None else stream)
    return st, ffi.string(L.pyfa_last_error()).decode()


def rand(*shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def abi4_outputs(tmp_path_factory):
    """tests/c/abi4_user.c built against the ABI 4 header, run on emu and cpu."""
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler to build the ABI 4 program")
    out = tmp_path_factory.mktemp("abi4")
    exe = out / "abi4_user"
    library = _lib.library_path()
    # The ABI 4 header first; pyfa_export.h comes from the library's include folder.
    subprocess.run([cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{HERE / 'c' / 'abi4'}",
                    f"-I{pyfa.get_include()}", str(HERE / "c" / "abi4_user.c"), "-o", str(exe), str(library),
                    f"-Wl,-rpath,{library.parent}"], check=True)
    sizes = dict(q=B * H * NQ * D, k=B * HKV * NK * D, rows=B * H * NQ)
    order = [("q", "q"), ("k", "k"), ("v", "k"), ("dout", "q"), ("o", "q"), ("lse", "rows"), ("dq", "q"),
             ("dk", "k"), ("dv", "k"), ("o1", "q"), ("m1", "rows"), ("l1", "rows"), ("dq1", "q"), ("dk1", "k"),
             ("dv1", "k")]
    results = {}
    for backend in (2, 3):
        path = out / f"outputs_{backend}.bin"
        r = subprocess.run([str(exe), str(backend), str(path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "abi4_user: ok" in r.stdout
        flat = np.fromfile(path, dtype=np.float32)
        assert flat.size == sum(sizes[s] for _, s in order)
        arrays, at = {}, 0
        for name, size in order:
            arrays[name] = flat[at:at + sizes[size]].copy()
            at += sizes[size]
        results[backend] = arrays
    return results


@pytest.mark.parametrize("backend", [2, 3])
def test_an_abi4_program_gets_the_bits_of_pyfa_run(abi4_outputs, backend):
    ffi, L = lib()
    a = abi4_outputs[backend]
    q_strides = (NQ * H * D, D, H * D)  # the program's q is a (B, N, H, d) view
    p, c = problem(ffi), config(ffi, backend)
    outs = {n: np.full_like(a[n], 7.0) for n in ("o", "lse", "dq", "dk", "dv", "o1", "m1", "l1", "dq1", "dk1",
                                                  "dv1")}
    ins = dict(q=(a["q"], q_strides), k=a["k"], v=a["v"])
    steps = [
        ("fa2_forward", dict(ins, o=outs["o"], lse=outs["lse"])),
        ("fa2_backward", dict(ins, o=a["o"], lse=a["lse"], dout=a["dout"], dq=outs["dq"], dk=outs["dk"],
                              dv=outs["dv"])),
        ("fa1_forward", dict(ins, o=outs["o1"], m=outs["m1"], l=outs["l1"])),
        ("fa1_backward", dict(ins, o=a["o1"], m=a["m1"], l=a["l1"], dout=a["dout"], dq=outs["dq1"],
                              dk=outs["dk1"], dv=outs["dv1"])),
    ]
    for op, named in steps:
        st, msg = run(op, p, c, tensors(ffi, **named))
        assert st == 0, f"{op}: {msg}"
    for name, got in outs.items():
        assert got.tobytes() == a[name].tobytes(), name
    # Not a trivial agreement: the outputs are finite and not what the buffers held.
    assert np.isfinite(outs["dq"]).all() and not np.all(outs["o"] == 7.0)


def test_pyfa_run_equals_the_per_op_entry_point_with_problem_strides():
    # The same (B, N, H, d) view of q given in the problem (the per-op way) or in the tensor.
    ffi, L = lib()
    q = rand(B, NQ, H, D, seed=1)
    k, v = rand(B, HKV, NK, D, seed=2), rand(B, HKV, NK, D, seed=3)
    strides = (NQ * H * D, D, H * D)
    o1, lse1 = np.zeros((B, H, NQ, D), np.float32), np.zeros((B, H, NQ), np.float32)
    o2, lse2 = o1.copy(), lse1.copy()
    p = problem(ffi)
    p.q.batch, p.q.head, p.q.row = strides
    c = config(ffi, 3)
    fp = lambda a: ffi.cast("float*", ffi.from_buffer(a))  # noqa: E731
    assert L.pyfa_fa2_forward(p, c, fp(q), fp(k), fp(v), fp(o1), fp(lse1)) == 0
    st, msg = run("fa2_forward", problem(ffi), c, tensors(ffi, q=(q, strides), k=k, v=v, o=o2, lse=lse2))
    assert st == 0, msg
    assert o1.tobytes() == o2.tobytes() and lse1.tobytes() == lse2.tobytes()
    # Both places, the same strides: accepted; different ones: refused, naming both.
    st, msg = run("fa2_forward", p, c, tensors(ffi, q=(q, strides), k=k, v=v, o=o2, lse=lse2))
    assert st == 0, msg
    st, msg = run("fa2_forward", p, c, tensors(ffi, q=(q, (NQ * H * D, D, 2 * H * D)), k=k, v=v, o=o2, lse=lse2))
    assert st == 1 and "tensors->q.strides" in msg and "problem->q" in msg, msg


def test_pyfa_run_refuses_tensors_the_op_does_not_take_or_lacks():
    ffi, L = lib()
    q, k, v = rand(B, H, NQ, D, seed=1), rand(B, HKV, NK, D, seed=2), rand(B, HKV, NK, D, seed=3)
    o, lse, m = np.full((B, H, NQ, D), 7, np.float32), np.full((B, H, NQ), 7, np.float32), np.zeros((B, H, NQ),
                                                                                                     np.float32)
    p, c = problem(ffi), config(ffi, 3)
    st, msg = run("fa2_forward", p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=lse, m=m))
    assert st == 1 and msg == "tensors->m: given, but pyfa_fa2_forward does not take it (leave it zero)"
    st, msg = run("fa2_forward", p, c, tensors(ffi, q=q, k=k, v=v, o=o))
    assert st == 1 and msg == "tensors->lse.data: null pointer, but pyfa_fa2_forward writes it"
    st, msg = run("fa2_backward", p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=lse, dq=q.copy(), dk=k.copy(),
                                                 dv=v.copy()))
    assert st == 1 and msg == "tensors->dout.data: null pointer, but pyfa_fa2_backward reads it"
    st, msg = run("fa2_forward", p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=(lse, (1, 1, 1))))
    assert st == 1 and msg.startswith("tensors->lse.strides: must be 0"), msg
    assert np.all(o == 7) and np.all(lse == 7)
    st, msg = run("fa2_forward", p, c, tensors(ffi, 2, q=q, k=k, v=v, o=o, lse=lse))
    assert st == 1 and msg.startswith("tensors->memory: must be"), msg
    st, msg = run("fa2_forward", p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=lse), stream=ffi.cast("void*", 1))
    assert st == 1 and msg.startswith("stream: must be NULL for host tensors"), msg
    st = L.pyfa_run(4, p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=lse), ffi.NULL)
    assert st == 1 and ffi.string(L.pyfa_last_error()).decode().startswith("op: unknown op 4")
    bad = tensors(ffi, q=q, k=k, v=v, o=o, lse=lse)
    for size in (8, ffi.sizeof("pyfa_tensors") + 8):
        bad.struct_size = size
        st, msg = run("fa2_forward", p, c, bad)
        assert st == 1 and msg.startswith(f"tensors->struct_size: {size} is not the size of a layout"), msg
    st = L.pyfa_run(0, p, c, ffi.NULL, ffi.NULL)
    assert st == 1 and ffi.string(L.pyfa_last_error()).decode() == "tensors: null pointer"
    # Device memory on a host backend is the *_device entry point's behaviour: host pointers.
    st, msg = run("fa2_forward", p, c, tensors(ffi, 1, q=q, k=k, v=v, o=o, lse=lse))
    assert st == 0, msg
    assert not np.all(o == 7)
