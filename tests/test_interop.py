"""Arrays from other libraries: DLPack and __cuda_array_interface__ producers, out=,
stream=, and the errors for what pyfa cannot take.

CPU paths run everywhere (a DLPack-only object, PyTorch CPU tensors when torch imports).
The CUDA paths run twice: here, against tests/c/fake_cuda.cpp (the C ABI's own sources
with "device memory" in host memory, every launch and copy logged), with fake CUDA
producers that hand out DLPack capsules and interface dicts; and on a GPU with PyTorch
or CuPy (tools/device_check.sh selects the tests named *cuda*).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyfa
from pyfa import _arrays

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

RNG = np.random.default_rng(14)
Q, K, V, DO = (RNG.standard_normal((2, 3, 20, 8), dtype=np.float32) for _ in range(4))
KW = dict(backend="emu", block_r=8, block_c=8)


def bits(a):
    return np.asarray(a).view(np.uint32)


def same_bits(a, b):
    return np.array_equal(bits(a), bits(b))


class DLPackOnly:
    """A CPU producer with nothing but the DLPack protocol, over a NumPy array."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class OnDevice:
    """An array that says it lives on DLPack device `device` and cannot be exported."""

    def __init__(self, device_type, device_id=0):
        self.device = (device_type, device_id)

    def __dlpack__(self, **kwargs):
        raise AssertionError("pyfa exported an array it should have refused first")

    def __dlpack_device__(self):
        return self.device


# ---- CPU producers

@pytest.mark.parametrize("op", ["fa2_forward", "fa1_forward", "fa2_backward", "fa1_backward"])
def test_dlpack_only_object_gives_numpys_bits(op):
    fwd = getattr(pyfa, op.replace("backward", "forward"))
    saved = fwd(Q, K, V, causal=True, **KW)
    args = (Q, K, V) if op.endswith("forward") else (Q, K, V, *saved, DO)
    expected = getattr(pyfa, op)(*args, causal=True, **KW)
    got = getattr(pyfa, op)(*(DLPackOnly(a) for a in args), causal=True, **KW)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        # DLPackOnly's module has no from_dlpack: the outputs come back as NumPy arrays.
        assert type(g) is np.ndarray and same_bits(g, e)


def test_dlpack_only_object_through_attention_and_attention_grad():
    o = pyfa.attention(DLPackOnly(Q), DLPackOnly(K), DLPackOnly(V), **KW)
    assert same_bits(o, pyfa.attention(Q, K, V, **KW))
    got = pyfa.attention_grad(*(DLPackOnly(a) for a in (Q, K, V, DO)), algo="fa1", **KW)
    for g, e in zip(got, pyfa.attention_grad(Q, K, V, DO, algo="fa1", **KW)):
        assert same_bits(g, e)


def test_dlpack_strided_cpu_input_is_read_as_numpy_reads_it():
    qt = np.ascontiguousarray(Q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # (B, N, H, d) memory
    assert not qt.flags.c_contiguous
    assert same_bits(pyfa.attention(DLPackOnly(qt), K, V, **KW), pyfa.attention(Q, K, V, **KW))


def test_capsule_reader_matches_numpys_own_export():
    # The ctypes layout of DLTensor, legacy and versioned, against a real producer.
    a = Q[1, :, 3:]
    for capsule in (a.__dlpack__(), a.__dlpack__(max_version=(1, 0))):
        t, readonly = _arrays._from_capsule("q", capsule)
        assert (t.device.device_type, t.ndim) == (1, 3)
        assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)
        assert tuple(t.shape[i] for i in range(3)) == a.shape
        assert tuple(t.strides[i] for i in range(3)) == tuple(s // 4 for s in a.strides)
        assert t.data + t.byte_offset == a.__array_interface__["data"][0]
        assert readonly is False
    frozen = Q.copy()
    frozen.flags.writeable = False
    assert _arrays._from_capsule("q", frozen.__dlpack__(max_version=(1, 0)))[1] is True


# ---- out=

def test_out_is_written_in_place_and_returned():
    o, lse = np.full_like(Q, np.nan), np.full(Q.shape[:3], np.nan, np.float32)
    ro, rlse = pyfa.fa2_forward(Q, K, V, out=(o, lse), **KW)
    assert ro is o and rlse is lse
    eo, else_ = pyfa.fa2_forward(Q, K, V, **KW)
    assert same_bits(o, eo) and same_bits(lse, else_)


def test_out_none_entries_are_allocated():
    lse = np.empty(Q.shape[:3], np.float32)
    o, rlse = pyfa.fa2_forward(Q, K, V, out=(None, lse), **KW)
    assert rlse is lse and same_bits(o, pyfa.attention(Q, K, V, **KW))


def test_out_strided_is_staged():
    expected = pyfa.attention(Q, K, V, **KW)
    strided = np.zeros((2, 20, 3, 8), np.float32).transpose(0, 2, 1, 3)
    assert pyfa.attention(Q, K, V, out=strided, **KW) is strided
    assert same_bits(strided, expected)


def test_attention_grad_out():
    outs = tuple(np.empty_like(a) for a in (Q, Q, K, V))
    got = pyfa.attention_grad(Q, K, V, DO, out=outs, **KW)
    assert all(g is o for g, o in zip(got, outs))
    for g, e in zip(got, pyfa.attention_grad(Q, K, V, DO, **KW)):
        assert same_bits(g, e)


@pytest.mark.parametrize("out, error, match", [
    (np.empty((2, 3, 20, 8), np.float64), TypeError, r"out \(o\): expected dtype float32"),
    (np.empty((2, 3, 20, 9), np.float32), ValueError, r"out \(o\): expected shape \(2, 3, 20, 8\)"),
    ([0.0], TypeError, r"out \(o\): expected a numpy.ndarray or an array with __dlpack__"),
    (OnDevice(2), ValueError, r"out \(o\): on cuda:0, but q is on the CPU"),
])
def test_out_errors(out, error, match):
    with pytest.raises(error, match=match):
        pyfa.attention(Q, K, V, out=out, **KW)


def test_out_read_only_is_refused_and_left_alone():
    o = np.zeros_like(Q)
    o.flags.writeable = False
    with pytest.raises(ValueError, match=r"out \(o\): is read-only"):
        pyfa.attention(Q, K, V, out=o, **KW)
    assert not o.any()


def test_out_tuple_of_the_wrong_length():
    with pytest.raises(TypeError, match=r"out: expected a tuple of 2 arrays or Nones \(o, lse\)"):
        pyfa.fa2_forward(Q, K, V, out=(np.empty_like(Q),), **KW)
    with pytest.raises(TypeError, match=r"out: expected a tuple of 3 arrays or Nones \(dq, dk, dv\)"):
        pyfa.fa2_backward(Q, K, V, Q, Q[..., 0], DO, out=np.empty_like(Q), **KW)


# ---- errors

@pytest.mark.parametrize("args, error, match", [
    ((DLPackOnly(Q.astype(np.float64)), K, V), TypeError, "q: expected dtype float32, got float64"),
    ((Q, DLPackOnly(K[..., :4]), V), ValueError, "k: head dim 4 differs from q's 8"),
    ((Q, K, OnDevice(10)), TypeError, "v: a ROCm array; pyfa takes CPU and CUDA arrays"),
    ((Q, K, OnDevice(99)), TypeError, "v: a DLPack device type 99 array"),
    ((Q, OnDevice(2), V), ValueError, "k: on cuda:0, but q is on the CPU; every array of one call"),
    ((OnDevice(2, 0), OnDevice(2, 1), V), ValueError, "k: on cuda:1, but q is on cuda:0"),
    ((object(), K, V), TypeError, "q: expected a numpy.ndarray or an array with __dlpack__"),
])
def test_intake_errors_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        pyfa.attention(*args, **KW)


def test_stream_is_for_cuda_arrays_only():
    with pytest.raises(ValueError, match="stream: only CUDA arrays run on a stream"):
        pyfa.attention(Q, K, V, stream=0, **KW)


@pytest.mark.parametrize("stream, error", [(-1, ValueError), (True, TypeError), ("s", TypeError)])
def test_stream_values(stream, error):
    with pytest.raises(error, match="stream: "):
        _arrays.stream_handle(stream)


def test_stream_objects():
    class TorchLike:
        cuda_stream = 0x10

    class CupyLike:
        ptr = 0x20

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x30)

    assert [_arrays.stream_handle(s) for s in (TorchLike(), CupyLike(), Protocol(), 7)] == [0x10, 0x20, 0x30, 7]
    assert _arrays.dlpack_stream(0) == 1 and _arrays.dlpack_stream(0x30) == 0x30


@pytest.mark.skipif("cuda" in pyfa.backends(), reason="needs a library that cannot run CUDA here")
def test_cuda_array_without_a_cuda_backend_is_backend_unavailable():
    reason = pyfa.unavailable_backends()["cuda"]
    cuda = [OnDevice(2) for _ in range(3)]
    with pytest.raises(pyfa.BackendUnavailableError, match="q: a CUDA array") as e:
        pyfa.attention(*cuda)
    assert reason in str(e.value)
    with pytest.raises(ValueError, match="backend: 'emu' runs on host memory, but the arrays are on cuda:0"):
        pyfa.attention(*cuda, backend="emu")


# ---- PyTorch CPU tensors (when torch imports)

def test_torch_cpu_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(a.copy()) for a in (Q, K, V))
    o = pyfa.attention(tq, tk, tv, causal=True, **KW)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.device.type == "cpu"
    assert same_bits(o.numpy(), pyfa.attention(Q, K, V, causal=True, **KW))
    o2, lse = pyfa.fa2_forward(tq.transpose(1, 2).contiguous().transpose(1, 2), tk, tv, causal=True, **KW)
    assert same_bits(o2.numpy(), o.numpy()) and isinstance(lse, torch.Tensor)
    out = torch.empty_like(tq)
    assert pyfa.attention(tq, tk, tv, causal=True, out=out, **KW) is out
    assert torch.equal(out, o)
    with pytest.raises(TypeError, match="q: could not be read through DLPack: .*require"):
        pyfa.attention(tq.clone().requires_grad_(), tk, tv, **KW)
    with pytest.raises(TypeError, match="k: expected dtype float32, got float64"):
        pyfa.attention(tq, tk.double(), tv, **KW)


# ---- CUDA paths against the fake CUDA backend

CHILD = r"""
import ctypes, json, sys
import numpy as np
import pyfa
from pyfa import _arrays

new_capsule = ctypes.pythonapi.PyCapsule_New
new_capsule.restype = ctypes.py_object
new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeCuda:
    # "Device memory" is host memory here (tests/c/fake_cuda.cpp); exported as DLPack
    # capsules on device (kDLCUDA, 0), or as a __cuda_array_interface__ when cai is set.
    def __init__(self, a, cai_stream=False, readonly=False):
        self.a, self.readonly, self.streams, self.keep = a, readonly, [], []
        if cai_stream is not False:
            self.__cuda_array_interface__ = dict(
                shape=a.shape, typestr="<f4", data=(a.__array_interface__["data"][0], readonly),
                strides=None if a.flags.c_contiguous else a.strides, version=3, stream=cai_stream)

    def __getattr__(self, name):
        if name in ("__dlpack__", "__dlpack_device__") and "__cuda_array_interface__" not in self.__dict__:
            return getattr(self, "_" + name.strip("_"))
        raise AttributeError(name)

    def _dlpack_device(self):
        return (2, 0)

    def _dlpack(self, stream=None, max_version=None):
        self.streams.append(stream)
        versioned = max_version is not None and max_version[0] >= 1
        a = self.a
        shape = (ctypes.c_int64 * a.ndim)(*a.shape)
        strides = (ctypes.c_int64 * a.ndim)(*(s // a.itemsize for s in a.strides))
        m = _arrays._DLManagedTensorVersioned() if versioned else _arrays._DLManagedTensor()
        t = m.dl_tensor
        t.data, t.device.device_type, t.ndim = a.__array_interface__["data"][0], 2, a.ndim
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 8 * a.itemsize, 1
        t.shape, t.strides = shape, strides
        if versioned:
            m.version.major, m.flags = 1, 1 if self.readonly else 0
        self.keep += [m, shape, strides]
        return new_capsule(ctypes.addressof(m), b"dltensor_versioned" if versioned else b"dltensor", None)


allocated_on = []  # the stream each output pyfa allocated was made for
_arrays.ALLOCATORS["__main__"] = lambda shape, index, stream: (allocated_on.append(stream),
                                                               FakeCuda(np.zeros(shape, np.float32)))[1]
# The fake's test controls, beside the header's declarations.
import cffi
ffi = cffi.FFI()
ffi.cdef("void fake_cuda_reset(int, int); const char* fake_cuda_log(void);"
         "void fake_cuda_strides(int64_t*, int64_t*);")
lib = ffi.dlopen(str(pyfa._lib.library_path()))
rng = np.random.default_rng(0)
B, H, N, D = 1, 2, 8, 4


def fresh(shape=(B, H, N, D), **kw):
    return FakeCuda(rng.standard_normal(shape, dtype=np.float32), **kw)


def case(fn):
    lib.fake_cuda_reset(-1, -1)
    try:
        value = fn()
        error = None
    except Exception as e:
        # Named by its builtin kind (pyfa's argument errors are ValueErrors, TypeErrors).
        kind = next(c for c in type(e).__mro__ if c.__module__ == "builtins")
        value, error = None, f"{kind.__name__}: {e}"
    log = ffi.string(lib.fake_cuda_log()).decode().split(chr(10))[:-1]
    return dict(value=value, error=error, log=log)


def values(x):
    return sorted(set(np.asarray(x.a if isinstance(x, FakeCuda) else x).ravel().tolist()))


results = {}
q, k, v = fresh(), fresh(), fresh()


def forward_default_stream():
    o, lse = pyfa.fa2_forward(q, k, v, block_r=4, block_c=4)
    return dict(kinds=[type(o).__name__, type(lse).__name__], o=values(o), lse=values(lse),
                lse_shape=list(lse.a.shape), streams=[q.streams[-1], k.streams[-1], v.streams[-1]])
results["forward_default_stream"] = case(forward_default_stream)


def forward_explicit_stream_and_out():
    o, lse = fresh(), fresh((B, H, N))
    ro, rlse = pyfa.fa2_forward(q, k, v, out=(o, lse), stream=0x1234, block_r=4, block_c=4)
    return dict(same=[ro is o, rlse is lse], o=values(o), lse=values(lse),
                streams=[q.streams[-1], o.streams[-1]])
results["forward_explicit_stream_and_out"] = case(forward_explicit_stream_and_out)


def allocated_for_the_stream():
    allocated_on.clear()
    pyfa.fa2_forward(q, k, v, stream=0x4321, block_r=4, block_c=4)
    return dict(allocated_on=list(allocated_on))
results["allocated_for_the_stream"] = case(allocated_for_the_stream)


def rank2_and_legacy_capsules():
    q2 = FakeCuda(rng.standard_normal((N, D), dtype=np.float32))
    q2._dlpack = lambda stream=None, **kw: FakeCuda._dlpack(q2, stream)  # no max_version
    o = pyfa.attention(q2, q2, q2, algo="fa1", block_r=4, block_c=4)
    return dict(shape=list(o.a.shape), o=values(o))
results["rank2_and_legacy_capsules"] = case(rank2_and_legacy_capsules)


def backward_and_grad():
    dq, dk, dv = pyfa.fa2_backward(q, k, v, fresh(), fresh((B, H, N)), fresh(), block_r=4, block_c=4)
    g = pyfa.attention_grad(q, k, v, fresh(), block_r=4, block_c=4)
    f1 = pyfa.fa1_backward(q, k, v, fresh(), fresh((B, H, N)), fresh((B, H, N)), fresh(), block_r=4, block_c=4)
    return dict(fa2=[values(x) for x in (dq, dk, dv)], grad=[values(x) for x in g],
                fa1=[values(x) for x in f1])
results["backward_and_grad"] = case(backward_and_grad)


def cai_arrays():
    qc, kc, vc = (FakeCuda(x.a, cai_stream=0x77) for x in (q, k, v))
    o = pyfa.attention(qc, kc, vc, out=FakeCuda(np.zeros((B, H, N, D), np.float32), cai_stream=0x77),
                       block_r=4, block_c=4)
    return dict(o=values(o))
results["cai_arrays"] = case(cai_arrays)

def cancelled():
    o = FakeCuda(np.full((B, H, N, D), 9.0, np.float32))
    try:
        pyfa.attention(q, k, v, out=o, progress=lambda done, total: True, block_r=4, block_c=4)
    except pyfa.CancelledError as e:
        return dict(error=str(e), o=values(o))
results["cancelled"] = case(cancelled)

def strided():
    # q and out as (B, H, N, D) views of (B, N, H, D) memory: passed with their strides.
    q_bnhd = FakeCuda(rng.standard_normal((B, N, H, D), dtype=np.float32).transpose(0, 2, 1, 3))
    o = FakeCuda(np.zeros((B, N, H, D), np.float32).transpose(0, 2, 1, 3))
    r = pyfa.attention(q_bnhd, k, v, out=o, block_r=4, block_c=4)
    qs, os_ = ffi.new("int64_t[3]"), ffi.new("int64_t[3]")
    lib.fake_cuda_strides(qs, os_)
    return dict(same=r is o, o=values(o), q_strides=list(qs), o_strides=list(os_))
results["strided"] = case(strided)

errors = {
    "cai_stream_mismatch": lambda: pyfa.attention(FakeCuda(q.a, cai_stream=5), k, v, stream=6),
    "last_axis_strided": lambda: pyfa.attention(FakeCuda(np.zeros((B, H, D, N), np.float32).transpose(0, 1, 3, 2)), k, v),
    "float64": lambda: pyfa.attention(FakeCuda(q.a.astype(np.float64)), k, v),
    "emu": lambda: pyfa.attention(q, k, v, backend="emu"),
    "read_only_out": lambda: pyfa.attention(q, k, v, out=fresh(readonly=True)),
    "out_overlaps_input": lambda: pyfa.attention(q, k, v, out=q),
    "out_shape": lambda: pyfa.attention(q, k, v, out=fresh((B, H, N, D + 1))),
    "mixed": lambda: pyfa.attention(q, k.a, v),
    "lse_shape": lambda: pyfa.fa2_backward(q, k, v, q, fresh((B, H, N + 1)), q),
}
for name, fn in errors.items():
    results[name] = case(fn)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def fake_cuda_pyfa(fake_cuda_library):
    """libpyfa's C ABI over tests/c/fake_cuda.cpp, built as pyfa's version so that pyfa
    loads it (PYFA_LIBRARY)."""
    out = fake_cuda_library
    env = dict(os.environ, PYFA_LIBRARY=str(out))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def launches(result):
    return [e for e in result["log"] if e.startswith("launch")]


def test_fake_cuda_arrays_run_on_device_pointers_without_host_copies(fake_cuda_pyfa):
    r = fake_cuda_pyfa["forward_default_stream"]
    assert r["error"] is None, r["error"]
    # The fake's fa2_forward kernel writes o = 1 and lse = 2 through the device pointers.
    assert r["value"]["o"] == [1.0] and r["value"]["lse"] == [2.0]
    assert r["value"]["kinds"] == ["FakeCuda", "FakeCuda"] and r["value"]["lse_shape"] == [1, 2, 8]
    assert launches(r) == ["launch fa2_forward null"]
    assert not [e for e in r["log"] if e.startswith(("h2d", "d2h", "sync"))], r["log"]
    # No producer stream known: the legacy default stream, which DLPack spells 1.
    assert r["value"]["streams"] == [1, 1, 1]


def test_fake_cuda_explicit_stream_and_out(fake_cuda_pyfa):
    r = fake_cuda_pyfa["forward_explicit_stream_and_out"]
    assert r["error"] is None, r["error"]
    assert r["value"]["same"] == [True, True]
    assert r["value"]["o"] == [1.0] and r["value"]["lse"] == [2.0]
    assert launches(r) == ["launch fa2_forward caller"]
    assert r["value"]["streams"] == [0x1234, 0x1234]


def test_fake_cuda_outputs_are_allocated_for_the_call_stream(fake_cuda_pyfa):
    r = fake_cuda_pyfa["allocated_for_the_stream"]
    assert r["error"] is None, r["error"]
    assert r["value"]["allocated_on"] == [0x4321, 0x4321]  # o and lse, for stream=
    assert "launch fa2_forward caller" in r["log"]


def test_fake_cuda_rank2_fa1_and_legacy_capsules(fake_cuda_pyfa):
    r = fake_cuda_pyfa["rank2_and_legacy_capsules"]
    assert r["error"] is None, r["error"]
    assert r["value"] == dict(shape=[8, 4], o=[1.0])
    assert launches(r) == ["launch fa1_forward null"]


def test_fake_cuda_backwards_and_attention_grad(fake_cuda_pyfa):
    r = fake_cuda_pyfa["backward_and_grad"]
    assert r["error"] is None, r["error"]
    # dq = 8, dk = 6, dv = 7 from the fake kernels; attention_grad's o = 1.
    assert r["value"]["fa2"] == [[8.0], [6.0], [7.0]]
    assert r["value"]["grad"] == [[1.0], [8.0], [6.0], [7.0]]
    assert r["value"]["fa1"] == [[8.0], [6.0], [7.0]]
    assert not [e for e in r["log"] if e.startswith(("h2d", "d2h"))], r["log"]
    assert all(e.endswith(" null") for e in launches(r))


def test_fake_cuda_array_interface(fake_cuda_pyfa):
    r = fake_cuda_pyfa["cai_arrays"]
    assert r["error"] is None, r["error"]
    assert r["value"]["o"] == [1.0]
    assert launches(r) == ["launch fa2_forward caller"]  # the stream the interface names


def test_fake_cuda_cancelled_before_enqueuing_writes_nothing(fake_cuda_pyfa):
    r = fake_cuda_pyfa["cancelled"]
    assert r["error"] is None and r["value"] is not None, r
    assert "cancelled" in r["value"]["error"] and r["value"]["o"] == [9.0]
    assert launches(r) == [] and not [e for e in r["log"] if e.startswith("malloc")], r["log"]


def test_fake_cuda_strided_arrays_go_in_place_with_their_strides(fake_cuda_pyfa):
    r = fake_cuda_pyfa["strided"]
    assert r["error"] is None, r["error"]
    assert r["value"]["same"] and r["value"]["o"] == [1.0]
    assert r["value"]["q_strides"] == r["value"]["o_strides"] == [8 * 2 * 4, 4, 2 * 4]
    assert not [e for e in r["log"] if e.startswith(("h2d", "d2h", "malloc"))], r["log"]


@pytest.mark.parametrize("name, message", [
    ("cai_stream_mismatch", "ValueError: q: its __cuda_array_interface__ is on stream 0x5, but this call runs on stream 0x6"),
    ("last_axis_strided", "ValueError: q: the last axis of a CUDA array must be contiguous"),
    ("float64", "TypeError: q: expected dtype float32"),
    ("emu", "ValueError: backend: 'emu' runs on host memory, but the arrays are on cuda:0"),
    ("read_only_out", r"ValueError: out (o): is read-only"),
    ("out_overlaps_input", r"ValueError: out (o): overlaps q"),
    ("out_shape", r"ValueError: out (o): expected shape (1, 2, 8, 4), got (1, 2, 8, 5)"),
    ("mixed", "ValueError: k: on the CPU, but q is on cuda:0"),
    ("lse_shape", "ValueError: lse: expected one value per query row, shape (1, 2, 8)"),
])
def test_fake_cuda_errors_enqueue_nothing(fake_cuda_pyfa, name, message):
    r = fake_cuda_pyfa[name]
    assert r["error"] is not None and r["error"].startswith(message), r["error"]
    assert r["log"] == [], r["log"]


# ---- CUDA paths on a GPU (tools/device_check.sh)

def _torch_cuda():
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if "cuda" not in pyfa.backends():
        pytest.skip(f"pyfa's CUDA backend cannot run here: {pyfa.unavailable_backends().get('cuda')}")
    return torch


def test_cuda_torch_tensors_in_and_out():
    # That no host copy happens is checked against the fake backend above (its log).
    torch = _torch_cuda()
    tq, tk, tv, tdo = (torch.from_numpy(a).cuda() for a in (Q, K, V, DO))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(stream):  # the producer's current stream is the one used
        o, lse = pyfa.fa2_forward(tq, tk, tv, causal=True)
        got = pyfa.attention_grad(tq, tk, tv, tdo, causal=True)
    stream.synchronize()
    assert o.is_cuda and lse.is_cuda and o.device == tq.device
    eo, else_ = pyfa.fa2_forward(Q, K, V, causal=True, backend="cuda")
    assert same_bits(o.cpu().numpy(), eo) and same_bits(lse.cpu().numpy(), else_)
    for g, e in zip(got, pyfa.attention_grad(Q, K, V, DO, causal=True, backend="cuda")):
        assert g.is_cuda and same_bits(g.cpu().numpy(), e)
    out = torch.empty_like(tq)
    assert pyfa.attention(tq, tk, tv, out=out, stream=torch.cuda.current_stream()) is out
    torch.cuda.synchronize()
    assert same_bits(out.cpu().numpy(), pyfa.attention(Q, K, V, backend="cuda"))
    # A (B, H, N, d) view of (B, N, H, d) memory goes in place, with the same bits.
    strided = pyfa.attention(tq.transpose(1, 2).contiguous().transpose(1, 2), tk, tv)
    torch.cuda.synchronize()
    assert same_bits(strided.cpu().numpy(), pyfa.attention(Q, K, V, backend="cuda"))


def test_cuda_cupy_arrays_in_and_out():
    try:
        import cupy
    except ImportError:
        pytest.skip("cupy is not installed")
    if "cuda" not in pyfa.backends():
        pytest.skip(f"pyfa's CUDA backend cannot run here: {pyfa.unavailable_backends().get('cuda')}")
    cq, ck, cv = (cupy.asarray(a) for a in (Q, K, V))
    o = pyfa.attention(cq, ck, cv, causal=True)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(o, cupy.ndarray)
    assert same_bits(cupy.asnumpy(o), pyfa.attention(Q, K, V, causal=True, backend="cuda"))
