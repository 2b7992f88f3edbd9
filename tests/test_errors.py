"""Bad input: a clear error naming the argument, from Python and from the C ABI alike,
and nothing of the caller's written."""

import numpy as np
import pytest

import pyfa
from pyfa import _lib
from reference import make_inputs

# pyfa.h's enum values, as the loader parses them from the header.
const = _lib.constant

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


def _c_call(problem_fields, null=None, misaligned=None):
    """Calls pyfa_fa2_forward directly; returns (status, message, o_after); null: the
    argument passed as NULL, misaligned: the one passed a byte past its array."""
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=8,
                                        scale=0.0, causal=0))
    for name, value in problem_fields.items():
        setattr(pr, name, value)
    cfg = ffi.new("pyfa_config *", dict(backend=const("PYFA_BACKEND_EMU")))
    x = np.ones((4, 8), np.float32)
    o = np.full((4, 8), 7.0, np.float32)
    lse = np.full(4, 7.0, np.float32)
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    args = [ptr(x), ptr(x), ptr(x), ptr(o), ptr(lse)]
    if null is not None:
        args[null] = ffi.NULL
    if misaligned is not None:
        args[misaligned] = ffi.cast("float *", ffi.cast("char *", args[misaligned]) + 1)
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
    assert status == const("PYFA_ERROR_INVALID_ARGUMENT") and needle in message
    assert np.all(o == 7.0) and np.all(lse == 7.0)


@pytest.mark.parametrize("misaligned,needle", [(0, "q: not aligned to a float"), (3, "o: not aligned to a float")])
def test_c_abi_refuses_pointers_off_the_float_grid_and_writes_nothing(misaligned, needle):
    status, message, o, lse = _c_call({}, misaligned=misaligned)
    assert status == const("PYFA_ERROR_INVALID_ARGUMENT") and needle in message
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
    assert status == const("PYFA_ERROR_INVALID_ARGUMENT") and message
    status, message, o, _ = _c_call({})
    assert status == const("PYFA_OK") and message == "" and np.allclose(o, 1.0)


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
    status, message, o, lse = _device_call(backend=const("PYFA_BACKEND_AUTO"))
    assert status == const("PYFA_ERROR_BACKEND_UNAVAILABLE"), message
    assert "*_device" in message and _lib.load()[0].string(lib.pyfa_backend_reason(const("PYFA_BACKEND_CUDA"))).decode() in message
    assert np.all(o == 7.0) and np.all(lse == 7.0)


def test_emu_on_a_device_entry_point_takes_host_pointers():
    status, message, o, lse = _device_call(backend=const("PYFA_BACKEND_EMU"))
    assert status == const("PYFA_OK") and message == ""
    assert np.allclose(o, 1.0) and np.all(np.isfinite(lse))
    # A failure there writes nothing either.
    status, message, o, lse = _device_call(backend=const("PYFA_BACKEND_EMU"), block_r=1 << 30)
    assert status == const("PYFA_ERROR_TILE_TOO_LARGE") and "block_r=1073741824" in message
    assert np.all(o == 7.0) and np.all(lse == 7.0)


def test_backend_reason_says_why_and_is_empty_when_usable():
    ffi, lib = _lib.load()
    assert ffi.string(lib.pyfa_backend_reason(const("PYFA_BACKEND_EMU"))).decode() == ""
    cuda_reason = ffi.string(lib.pyfa_backend_reason(const("PYFA_BACKEND_CUDA"))).decode()
    if lib.pyfa_backend_available(const("PYFA_BACKEND_CUDA")):
        assert cuda_reason == ""
    elif not lib.pyfa_backend_compiled(const("PYFA_BACKEND_CUDA")):
        assert "without nvcc" in cuda_reason
    else:
        # The runtime's own words: an error name such as cudaErrorNoDevice.
        assert "cudaError" in cuda_reason or "0 devices" in cuda_reason
    assert ffi.string(lib.pyfa_backend_reason(42)).decode() == "unknown backend"


def test_c_abi_rejects_negative_threads():
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=8))
    cfg = ffi.new("pyfa_config *", dict(backend=const("PYFA_BACKEND_EMU"), threads=-1))
    x = np.ones((4, 8), np.float32)
    p = ffi.cast("float *", ffi.from_buffer(x))
    assert lib.pyfa_fa2_forward(pr, cfg, p, p, p, p, p) == 1
    assert "config->threads" in ffi.string(lib.pyfa_last_error()).decode()


BAD_CAUSAL = ["False", None, 2, 0.5, [0], np.array([1, 0]), 1.0]


def _every_causal_taker():
    """(name, call(causal)) for every function that takes causal: the library's, the
    simulator's and the IO counts."""
    q, k, v = Q, K, V
    do = Q.copy()
    rows = np.zeros(Q.shape[:3], np.float32)
    sizes = dict(batch=1, heads=2, seqlen_q=16, seqlen_k=12, head_dim=8)
    calls = {
        "pyfa.attention": lambda c: pyfa.attention(q, k, v, causal=c, backend="emu"),
        "pyfa.attention_grad": lambda c: pyfa.attention_grad(q, k, v, do, causal=c, backend="emu"),
        "pyfa.fa2_forward": lambda c: pyfa.fa2_forward(q, k, v, causal=c, backend="emu"),
        "pyfa.fa1_forward": lambda c: pyfa.fa1_forward(q, k, v, causal=c, backend="emu"),
        "pyfa.fa2_backward": lambda c: pyfa.fa2_backward(q, k, v, q, rows, do, causal=c, backend="emu"),
        "pyfa.fa1_backward": lambda c: pyfa.fa1_backward(q, k, v, q, rows, rows, do, causal=c, backend="emu"),
        "sim.fa2_forward": lambda c: pyfa.sim.fa2_forward(q, k, v, causal=c),
        "sim.fa1_forward": lambda c: pyfa.sim.fa1_forward(q, k, v, causal=c),
        "sim.fa2_backward": lambda c: pyfa.sim.fa2_backward(q, k, v, q, rows, do, causal=c),
        "sim.fa1_backward": lambda c: pyfa.sim.fa1_backward(q, k, v, q, rows, rows, do, causal=c),
        "sim.standard_forward": lambda c: pyfa.sim.standard_forward(q, k, v, causal=c),
        "sim.standard_backward": lambda c: pyfa.sim.standard_backward(
            q, k, v, q, np.zeros((1, 2, 16, 12), np.float32), do, causal=c),
        "sim.count_standard_io": lambda c: pyfa.sim.count_standard_io(causal=c, **sizes),
    }
    for algo in pyfa.sim.count.algorithms():
        calls[f"sim.count_io({algo})"] = lambda c, a=algo: pyfa.sim.count_io(a, causal=c, **sizes)
    return sorted(calls.items())


@pytest.mark.parametrize("name,call", _every_causal_taker(), ids=lambda x: x if isinstance(x, str) else "")
def test_causal_is_checked_alike_everywhere(name, call):
    for bad in BAD_CAUSAL:
        with pytest.raises(TypeError, match="causal"):
            call(bad)
    for good in (True, False, np.True_, 0, 1):
        call(good)


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(emu_workers=2**31), ValueError, "emu_workers"),
    (dict(emu_workers=-1), ValueError, "emu_workers"),
    (dict(emu_workers=2.0), TypeError, "emu_workers"),
    (dict(emu_seed=2**64), ValueError, "emu_seed"),
    (dict(scale=10**400), ValueError, "scale"),
    (dict(scale=-10**400), ValueError, "scale"),
    (dict(scale=1e39), ValueError, "scale"),
    (dict(scale=1e-50), ValueError, "scale"),
    (dict(block_r=2**31), ValueError, "block_r"),
    (dict(progress=3), TypeError, "progress"),
])
def test_out_of_range_numbers_name_the_argument_and_never_warn(kwargs, exc, needle):
    import warnings
    execution = {k: v for k, v in kwargs.items() if k in pyfa.options.FIELDS}
    semantic = {k: v for k, v in kwargs.items() if k not in execution}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(exc, match=needle):
            pyfa.fa2_forward(Q, K, V, **semantic,
                             options=pyfa.Options(backend="emu", **execution))
        if "block_r" in kwargs or "scale" in kwargs:  # the simulator takes these too, and must refuse them alike
            with pytest.raises(exc, match=needle):
                pyfa.sim.fa2_forward(Q, K, V, **semantic, options=pyfa.Options(**execution))


@pytest.mark.parametrize("call,exc,needle", [
    (lambda: pyfa.smem_bytes("fa2_forward", 2**31, 4, 8), ValueError, "block_r"),
    (lambda: pyfa.smem_bytes("fa2_forward", 4, 2**31, 8), ValueError, "block_c"),
    (lambda: pyfa.smem_bytes("fa2_forward", 4, 4, 2**63), ValueError, "head_dim"),
    (lambda: pyfa.smem_bytes("fa2_forward", 4.0, 4, 8), TypeError, "block_r"),
    (lambda: pyfa.smem_bytes("fa9", 4, 4, 8), ValueError, "kernel"),
    (lambda: pyfa.default_tiles("fa2_forward", 2.5), TypeError, "head_dim"),
    (lambda: pyfa.default_tiles("fa2_forward", "64"), TypeError, "head_dim"),
    (lambda: pyfa.default_tiles("fa2_forward", 0), ValueError, "head_dim"),
    (lambda: pyfa.default_tiles("fa2_forward", 257), ValueError, "head_dim"),
    (lambda: pyfa.default_tiles("fa2_forward", 64, backend="gpu"), ValueError, "backend"),
    (lambda: pyfa.default_tiles("fa2_forward", 64, backend="cpu", variant="fast"), ValueError,
     "variant: fast: the cpu backend has kernels of its own"),
    (lambda: pyfa.smem_bytes("nope", 64, 64, 64), ValueError, "kernel: expected one of"),
])
def test_query_functions_name_the_argument(call, exc, needle):
    with pytest.raises(exc, match=needle):
        call()


def test_unknown_options_are_pyfa_errors_listing_the_options():
    for call in (lambda: pyfa.Options(blockr=32), lambda: pyfa.Options().replace(thread=2)):
        with pytest.raises(pyfa.ArgumentTypeError, match=r"unknown option '(blockr|thread)' \(the options: backend, "):
            call()
    q = np.zeros((1, 1, 2, 4), np.float32)
    for call, name in ((pyfa.attention, "pyfa.attention"), (pyfa.attention_grad, "pyfa.attention_grad")):
        with pytest.raises(pyfa.ArgumentTypeError, match=rf"{name}\(\) got an unexpected keyword argument 'bogus'"):
            call(q, q, q, *((q,) if call is pyfa.attention_grad else ()), bogus=1)
    assert pyfa.Options("cpu", 32).block_r == 32
    with pytest.raises(pyfa.ArgumentTypeError, match="multiple values for argument 'backend'"):
        pyfa.Options("cpu", backend="cuda")


def test_smem_bytes_of_sizes_in_range_is_the_library_s_answer():
    assert pyfa.smem_bytes("fa2_forward", 64, 64, 64) == pyfa.sim.smem_bytes("fa2_forward", 64, 64, 64)
    assert pyfa.smem_bytes("fa2_forward", 0, 64, 64) == 0  # out of the library's range: 0, as pyfa.h says


def test_error_classes_are_public_and_both_kinds():
    assert issubclass(pyfa.InvalidArgumentError, (pyfa.PyfaError, ValueError))
    assert issubclass(pyfa.InvalidArgumentError, ValueError)
    assert issubclass(pyfa.OutOfMemoryError, pyfa.PyfaError) and issubclass(pyfa.OutOfMemoryError, MemoryError)
    assert issubclass(pyfa.CancelledError, pyfa.PyfaError)
    assert issubclass(pyfa.TileTooLargeError, ValueError)
    assert pyfa.TileTooLargeError is pyfa.sim.TileTooLargeError
    status, message, _, _ = _c_call({"head_dim": 0})
    err = _lib.error(status, message)
    assert type(err) is pyfa.InvalidArgumentError and "problem->head_dim" in str(err) and err.status == const("PYFA_ERROR_INVALID_ARGUMENT")
    for status, cls in ((2, pyfa.TileTooLargeError), (6, pyfa.OutOfMemoryError), (8, pyfa.CancelledError)):
        err = _lib.error(status, "")
        assert isinstance(err, cls) and isinstance(err, pyfa.PyfaError), (status, type(err))


def test_invalid_argument_from_the_library_is_public():
    # block_r above what the API allows never reaches the library; a C-level refusal does.
    ffi, lib = _lib.load()
    with pytest.raises(pyfa.InvalidArgumentError, match="head_dim"):
        _lib.check(lib.pyfa_default_tiles(const("PYFA_KERNEL_FA2_FORWARD"), 0, const("PYFA_BACKEND_EMU"), ffi.new("int *"), ffi.new("int *")))


@pytest.mark.parametrize("argv,needle", [
    (["--seqlen", "0"], "--seqlen: must be >= 1"),
    (["--batch", "-1"], "--batch: must be >= 1"),
    (["--heads", "x"], "--heads: expected an integer"),
    (["--head-dim", "300"], "--head-dim: must be in [1, 256]"),
    (["--backend", "cuda"], "--backend: cuda cannot run here"),
])
def test_demo_arguments_are_usage_errors(argv, needle, capsys):
    if argv[0] == "--backend" and argv[1] in pyfa.backends():
        pytest.skip(f"{argv[1]} can run here")
    from pyfa.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_c_abi_caps_threads():
    # config->threads is OS threads: at most 256, like emu_workers; more is refused by name.
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=8))
    q = np.ones((4, 8), np.float32)
    o, lse = np.full((4, 8), 7.0, np.float32), np.full(4, 7.0, np.float32)
    p = lambda a: ffi.cast("float *", ffi.from_buffer(a))  # noqa: E731
    for threads, status in ((256, 0), (257, 1), (2**31 - 1, 1)):
        cfg = ffi.new("pyfa_config *", dict(backend=3, threads=threads))
        assert lib.pyfa_fa2_forward(pr, cfg, p(q), p(q), p(q), p(o), p(lse)) == status, threads
        if status:
            assert ffi.string(lib.pyfa_last_error()).decode() == \
                f"config->threads: expected 0 (one per core) to 256, got {threads}"
    assert np.all(o == 1.0)  # the one call that ran: uniform V gives O = 1


# ---- found by a fuzzing helper (2026-12-07): each a pyfa.Error naming its argument
def _torch():
    return pytest.importorskip("torch")


def test_arrays_pyfa_cannot_take_are_pyfa_errors():
    for bad in (Q.tolist(), 3.0, "q"):
        with pytest.raises(pyfa.ArgumentTypeError, match="q"):
            pyfa.attention(bad, K, V)
    with pytest.raises(pyfa.ArgumentTypeError, match="out"):
        pyfa.attention(Q, K, V, out=[[0.0]])
    torch = _torch()
    with pytest.raises(pyfa.ArgumentTypeError, match="q: could not be read through DLPack"):
        pyfa.attention(torch.from_numpy(Q).requires_grad_(), K, V)


def test_pyfa_torch_refuses_with_pyfa_errors():
    torch = _torch()
    import pyfa.torch as pt
    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    for call, exc, needle in [
            (lambda: pt.attention(Q, k, v), pyfa.ArgumentTypeError, "q: expected a torch.Tensor"),
            (lambda: pt.attention(q.double(), k, v), pyfa.ArgumentTypeError, "q: expected dtype"),
            (lambda: pt.attention(q, k, v, causal=1), pyfa.ArgumentTypeError, "causal"),
            (lambda: pt.attention(q, k, v, layout="nhbd"), pyfa.InvalidArgumentError, "layout"),
            (lambda: pt.attention(q, k, v, block_r=1.5), pyfa.ArgumentTypeError, "block_r"),
            (lambda: pt.attention(q, k, v, block_c=0), pyfa.InvalidArgumentError, "block_c"),
            # Without dropout too: refused, never ignored.
            (lambda: pt.attention(q, k, v, seed=-1), pyfa.InvalidArgumentError, "seed"),
            (lambda: pt.attention(q, k, v, offset="x"), pyfa.ArgumentTypeError, "offset")]:
        with pytest.raises(exc, match=needle):
            call()


def test_varlen_and_cache_arguments_name_themselves():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((12, 2, 8), dtype=np.float32) for _ in range(3))
    cu = np.array([0, 5, 12], np.int32)
    # A max_seqlen beyond the packed rows is a padded batch's (flash-attn's callers pass one).
    o = pyfa.attention_varlen(q, k, v, cu, cu, max_seqlen_q=16, max_seqlen_k=16)
    assert np.array_equal(o, pyfa.attention_varlen(q, k, v, cu, cu))
    qc = rng.standard_normal((1, 1, 2, 8), dtype=np.float32)
    kc = rng.standard_normal((1, 16, 2, 8), dtype=np.float32)
    lens = np.array([4], np.int32)
    with pytest.raises(pyfa.ArgumentTypeError, match="return_lse"):
        pyfa.attention_with_kvcache(qc, kc, kc.copy(), lens, return_lse="no")
    with pytest.raises(pyfa.InvalidArgumentError, match="q: batch must be >= 1"):
        pyfa.attention_with_kvcache(qc[:0], kc[:0], kc[:0].copy(), lens[:0])
    with pytest.raises(pyfa.InvalidArgumentError, match="block_table: .* at least one page"):
        pyfa.attention_with_kvcache(qc, kc, kc.copy(), lens, block_table=np.zeros((1, 0), np.int32))
    with pytest.raises(pyfa.ArgumentTypeError, match="cache_seqlens: expected dtype int32"):
        pyfa.attention_with_kvcache(qc, kc, kc.copy(), lens.astype(np.int64))
    with pytest.raises(pyfa.ArgumentTypeError, match="k_cache: expected dtype float32"):
        pyfa.attention_with_kvcache(qc, kc.astype(np.float64), kc.copy(), lens)


def test_pyfa_torch_empty_problems_and_flash_extras():
    torch = _torch()
    import pyfa.torch as pt
    q = torch.randn(1, 4, 3, 8)
    o = pt.attention(q, q[:, :, :0], q[:, :, :0], alibi_slopes=torch.rand(4))
    assert o.shape == q.shape and not o.any()
    for kw, exc, needle in [(dict(backend=None), pyfa.ArgumentTypeError, "backend"),
                            (dict(causal_align=None), pyfa.ArgumentTypeError, "causal_align")]:
        with pytest.raises(exc, match=needle):
            pt.attention(q, q, q, **kw)
    qc, kc, vc = torch.randn(2, 1, 4, 8), torch.randn(2, 4, 4, 8), torch.randn(2, 4, 4, 8)
    with pytest.raises(pyfa.InvalidArgumentError, match="alibi_slopes"):
        pt.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=torch.tensor([1, 2]), alibi_slopes=torch.rand(5, 4))
    with pytest.raises(pyfa.ArgumentTypeError, match="q: expected dtype"):
        pt.flash_attn_with_kvcache(qc.bfloat16(), kc, vc, k=torch.randn(2, 1, 4, 8), v=torch.randn(2, 1, 4, 8),
                                   cache_seqlens=0)
    o = pt.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=torch.tensor([0, 2], dtype=torch.int32),
                                   alibi_slopes=torch.rand(4))
    assert o.shape == qc.shape and not o[0].any()
