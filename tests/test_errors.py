"""Bad input: a clear error naming the argument, from Python and from the C ABI alike,
and nothing of the caller's written."""

import numpy as np
import pytest

import pyfa
from pyfa import _lib
from reference import make_inputs

Q, K, V = make_inputs((1, 2, 16, 8), (1, 2, 12, 8), seed=0)


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(q=Q.astype(np.float64)), TypeError, "q: expected dtype float32"),
    (dict(k=K[..., :4]), ValueError, "k: head dim"),
    (dict(v=V[:, :, :5]), ValueError, "v: shape"),
    (dict(k=K[0]), ValueError, "k: expected 4 dimensions"),
    (dict(q=Q.tolist()), TypeError, "q: expected a numpy.ndarray"),
    (dict(block_r=0), ValueError, "block_r"),
    (dict(block_c=-3), ValueError, "block_c"),
    (dict(block_r=2.5), TypeError, "block_r"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=float("inf")), ValueError, "scale"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(algo="fa3"), ValueError, "algo"),
    (dict(backend="tpu"), ValueError, "backend"),
    (dict(emu_order="sideways"), ValueError, "emu_order"),
    (dict(causal="yes"), TypeError, "causal"),
])
def test_python_argument_errors(kwargs, exc, needle):
    args = dict(q=Q, k=K, v=V)
    args.update(kwargs)
    with pytest.raises(exc, match=needle):
        pyfa.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_head_dim_out_of_range():
    q = np.zeros((4, 300), np.float32)
    with pytest.raises(ValueError, match=r"head dim must be in \[1, 256\]"):
        pyfa.attention(q, q, q, backend="emu")


def test_tile_too_large_names_the_bytes():
    q = np.zeros((1, 1, 8, 256), np.float32)
    with pytest.raises(pyfa.TileTooLargeError) as info:
        pyfa.attention(q, q, q, block_r=256, block_c=256, backend="emu")
    msg = str(info.value)
    need = pyfa.sim.smem_bytes("fa2_forward", 256, 256, 256)
    assert f"need {need} bytes" in msg and "Q_i 262144" in msg and str(227 * 1024) in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.skipif("cuda" in pyfa.backends(), reason="this machine has a usable GPU")
def test_cuda_backend_unavailable_is_reported():
    with pytest.raises(pyfa.BackendUnavailableError, match="backend"):
        pyfa.attention(Q, Q, Q, backend="cuda")


def _c_call(problem_fields, null=None):
    """Calls pyfa_fa2_forward directly; returns (status, message, o_after)."""
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=8,
                                        scale=0.0, causal=0))
    for name, value in problem_fields.items():
        setattr(pr, name, value)
    cfg = ffi.new("pyfa_config *", dict(backend=2))
    x = np.ones((4, 8), np.float32)
    o = np.full((4, 8), 7.0, np.float32)
    lse = np.full(4, 7.0, np.float32)
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    args = [ptr(x), ptr(x), ptr(x), ptr(o), ptr(lse)]
    if null is not None:
        args[null] = ffi.NULL
    status = lib.pyfa_fa2_forward(pr, cfg, *args)
    return status, ffi.string(lib.pyfa_last_error()).decode(), o, lse


@pytest.mark.parametrize("fields,null,needle", [
    ({"head_dim": 0}, None, "problem->head_dim"),
    ({"head_dim": 257}, None, "problem->head_dim"),
    ({"seqlen_q": -1}, None, "problem->seqlen_q"),
    ({"batch": 70000}, None, "problem->batch"),
    ({"scale": float("nan")}, None, "problem->scale"),
    ({}, 0, "q: null pointer"),
    ({}, 4, "lse: null pointer"),
])
def test_c_abi_errors_name_the_argument_and_write_nothing(fields, null, needle):
    status, message, o, lse = _c_call(fields, null)
    assert status == 1 and needle in message
    assert np.all(o == 7.0) and np.all(lse == 7.0)


def test_c_abi_null_problem_and_unknown_backend():
    ffi, lib = _lib.load()
    x = np.zeros(8, np.float32)
    p = ffi.cast("float *", ffi.from_buffer(x))
    assert lib.pyfa_fa2_forward(ffi.NULL, ffi.NULL, p, p, p, p, p) == 1
    assert "problem: null pointer" in ffi.string(lib.pyfa_last_error()).decode()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=8))
    cfg = ffi.new("pyfa_config *", dict(backend=9))
    assert lib.pyfa_fa2_forward(pr, cfg, p, p, p, p, p) == 1
    assert "config->backend" in ffi.string(lib.pyfa_last_error()).decode()


def test_c_abi_success_clears_last_error():
    status, message, o, _ = _c_call({"head_dim": 0})
    assert status == 1 and message
    status, message, o, _ = _c_call({})
    assert status == 0 and message == "" and np.allclose(o, 1.0)


def _device_call(backend, block_r=0):
    """pyfa_fa2_forward_device on host buffers; returns (status, message, o, lse)."""
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=8))
    cfg = ffi.new("pyfa_config *", dict(backend=backend, block_r=block_r, emu_workers=1))
    x = np.ones((4, 8), np.float32)
    o = np.full((4, 8), 7.0, np.float32)
    lse = np.full(4, 7.0, np.float32)
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    status = lib.pyfa_fa2_forward_device(pr, cfg, ptr(x), ptr(x), ptr(x), ptr(o), ptr(lse), ffi.NULL)
    return status, ffi.string(lib.pyfa_last_error()).decode(), o, lse


@pytest.mark.skipif("cuda" in pyfa.backends(), reason="this machine has a usable GPU")
def test_auto_on_a_device_entry_point_never_runs_the_emulator():
    # The pointers of a *_device call are the GPU's: without CUDA, AUTO is an error that
    # says why CUDA is unavailable, and nothing is written.
    _, lib = _lib.load()
    status, message, o, lse = _device_call(backend=0)
    assert status == 3, message
    assert "*_device" in message and _lib.load()[0].string(lib.pyfa_backend_reason(1)).decode() in message
    assert np.all(o == 7.0) and np.all(lse == 7.0)


def test_emu_on_a_device_entry_point_takes_host_pointers():
    status, message, o, lse = _device_call(backend=2)
    assert status == 0 and message == ""
    assert np.allclose(o, 1.0) and np.all(np.isfinite(lse))
    # A failure there writes nothing either.
    status, message, o, lse = _device_call(backend=2, block_r=1 << 30)
    assert status == 2 and "block_r=1073741824" in message
    assert np.all(o == 7.0) and np.all(lse == 7.0)


def test_cpu_backend_is_reported_unavailable_with_a_reason():
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=8))
    cfg = ffi.new("pyfa_config *", dict(backend=3))
    x = np.ones((4, 8), np.float32)
    o = np.full((4, 8), 7.0, np.float32)
    lse = np.full(4, 7.0, np.float32)
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    if lib.pyfa_backend_available(3):
        pytest.skip("this libpyfa has the cpu backend")
    assert lib.pyfa_fa2_forward(pr, cfg, ptr(x), ptr(x), ptr(x), ptr(o), ptr(lse)) == 3
    assert "config->backend: the cpu backend" in ffi.string(lib.pyfa_last_error()).decode()
    assert ffi.string(lib.pyfa_backend_reason(3)).decode()
    assert np.all(o == 7.0) and np.all(lse == 7.0)


def test_backend_reason_says_why_and_is_empty_when_usable():
    ffi, lib = _lib.load()
    assert ffi.string(lib.pyfa_backend_reason(2)).decode() == ""
    cuda_reason = ffi.string(lib.pyfa_backend_reason(1)).decode()
    if lib.pyfa_backend_available(1):
        assert cuda_reason == ""
    elif not lib.pyfa_backend_compiled(1):
        assert "without nvcc" in cuda_reason
    else:
        # The runtime's own words: an error name such as cudaErrorNoDevice.
        assert "cudaError" in cuda_reason or "0 devices" in cuda_reason
    assert ffi.string(lib.pyfa_backend_reason(42)).decode() == "unknown backend"


def test_c_abi_rejects_negative_threads():
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=8))
    cfg = ffi.new("pyfa_config *", dict(backend=2, threads=-1))
    x = np.ones((4, 8), np.float32)
    p = ffi.cast("float *", ffi.from_buffer(x))
    assert lib.pyfa_fa2_forward(pr, cfg, p, p, p, p, p) == 1
    assert "config->threads" in ffi.string(lib.pyfa_last_error()).decode()

