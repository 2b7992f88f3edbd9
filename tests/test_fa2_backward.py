"""FA2 backward: the kernels (emulated, or on a GPU) equal their simulator bit for bit,
the gradients are accurate against float64 and against finite differences, and the
result is deterministic."""

import functools

import numpy as np
import pytest

import grid
import pyfa
from pyfa import _lib
from reference import attention_grad_ref, attention_ref, make_inputs, rel_err, same_bits

# pyfa.h's enum values, as the loader parses them from the header.
const = _lib.constant

# The shared grid (tests/grid.py), plus the default tiles at d = 256 (32 x 32 for dK/dV
# and dQ).
CASES = grid.CASES + [
    (1, 1, 45, 38, 256, None, None),
]


@functools.lru_cache(maxsize=None)
def simulated(case, causal):
    """Inputs, the forward's (o, lse) and the simulated backward of one case."""
    B, H, Nq, Nk, d, Br, Bc = case
    q, k, v, do = make_inputs((B, H, Nq, d), (B, H, Nk, d), grid.case_seed(case), "do")
    fwd = pyfa.sim.fa2_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)
    bwd = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=causal, block_r=Br, block_c=Bc)
    return (q, k, v, do), (fwd.o, fwd.lse), bwd


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case,backend,order,variant", grid.variant_params(CASES))
def test_kernel_equals_simulator_bitwise(case, causal, backend, order, variant):
    (q, k, v, do), (o, lse), sim = simulated(case, causal)
    _, _, _, _, _, Br, Bc = case
    got = grid.run_variant("fa2_backward", case, variant, lambda: pyfa.fa2_backward(
        q, k, v, o, lse, do, causal=causal, block_r=Br, block_c=Bc, backend=backend,
        emu_order=order, variant=variant))
    if got is None:
        return
    dq, dk, dv = got
    assert same_bits(dq, sim.dq), "dQ differs from the simulator"
    assert same_bits(dk, sim.dk), "dK differs from the simulator"
    assert same_bits(dv, sim.dv), "dV differs from the simulator"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=grid.case_id)
def test_accuracy_against_float64(case, causal):
    (q, k, v, do), _, sim = simulated(case, causal)
    _, dq_ref, dk_ref, dv_ref = attention_grad_ref(q, k, v, do, causal)
    for name, got, ref in (("dq", sim.dq, dq_ref), ("dk", sim.dk, dk_ref), ("dv", sim.dv, dv_ref)):
        assert np.all(np.isfinite(got)), name
        assert rel_err(got, ref) < 1e-4, name


@pytest.mark.parametrize("causal", [False, True])
def test_finite_differences(causal):
    # Central differences in float64 of the float64 loss sum(attention_ref(q, k, v) * dO),
    # taken at the float32 inputs, against the kernel's float32 gradients. In float64 a
    # step of 1e-6 leaves a difference error near 1e-10, far below the kernel's own fp32
    # error (about 1e-6 relative), so a tolerance of 1e-4 tests the kernel, not the
    # differencing; fp32 differences would need a step near 1e-2 and carry errors of that
    # order. The reference's forward is independent of the backward formulas under test.
    # Nq > Nk: with causal, row 0 sees no key and its exact gradient is 0.
    q, k, v, do = make_inputs((1, 1, 5, 3), (1, 1, 4, 3), 21, "do")
    dq, dk, dv = pyfa.fa2_backward(q, k, v, *pyfa.fa2_forward(q, k, v, causal=causal, backend="emu"),
                                   do, causal=causal, block_r=2, block_c=3, backend="emu")
    args = [x.astype(np.float64) for x in (q, k, v)]
    loss = lambda a: float(np.sum(attention_ref(*a, causal=causal)[0] * do.astype(np.float64)))
    h = 1e-6
    for which, got in enumerate((dq, dk, dv)):
        fd = np.zeros(got.shape)
        for idx in np.ndindex(got.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += h
            minus[which][idx] -= h
            fd[idx] = (loss(plus) - loss(minus)) / (2 * h)
        assert rel_err(got, fd) < 1e-4, "dq dk dv".split()[which]
    if causal:
        assert np.all(dq[0, 0, 0] == 0)


def test_fully_masked_rows_give_zero_gradients_and_no_nan():
    # Nq > Nk with causal: query i sees keys j <= i - 6, so rows 0..5 see none; their
    # LSE is -inf, P = 0 there, dQ = 0, and they add nothing to dK, dV.
    q, k, v, do = make_inputs((1, 2, 10, 8), (1, 2, 4, 8), 3, "do")
    o, lse = pyfa.fa2_forward(q, k, v, causal=True, block_r=4, block_c=2, backend="emu")
    assert np.all(np.isneginf(lse[:, :, :6]))
    dq, dk, dv = pyfa.fa2_backward(q, k, v, o, lse, do, causal=True, block_r=4, block_c=2, backend="emu")
    for x in (dq, dk, dv):
        assert not np.any(np.isnan(x)) and np.all(np.isfinite(x))
    assert np.all(dq[:, :, :6] == 0) and np.any(dq[:, :, 6:] != 0)
    # The masked rows' dO does not reach dK or dV.
    do2 = do.copy()
    do2[:, :, :6] = 1e3
    dq2, dk2, dv2 = pyfa.fa2_backward(q, k, v, o, lse, do2, causal=True, block_r=4, block_c=2, backend="emu")
    assert same_bits(dk2, dk) and same_bits(dv2, dv) and same_bits(dq2, dq)
    sim = pyfa.sim.fa2_backward(q, k, v, o, lse, do, causal=True, block_r=4, block_c=2)
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)


def test_repeated_calls_and_thread_orders_are_identical():
    q, k, v, do = make_inputs((2, 2, 50, 24), (2, 2, 43, 24), 11, "do")
    o, lse = pyfa.fa2_forward(q, k, v, causal=True, backend="emu")
    kw = dict(causal=True, block_r=16, block_c=8, backend="emu")
    first = pyfa.fa2_backward(q, k, v, o, lse, do, **kw)
    runs = [dict(emu_workers=w) for w in (1, 2, 3)]
    runs += [dict(emu_order="shuffled", emu_seed=s) for s in (1, 2)] + [dict(emu_order="reverse")]
    for extra in runs:
        again = pyfa.fa2_backward(q, k, v, o, lse, do, **kw, **extra)
        assert all(same_bits(a, b) for a, b in zip(first, again)), extra


def test_attention_grad_is_forward_then_backward():
    q, k, v, do = make_inputs((1, 2, 24, 16), (1, 2, 20, 16), 5, "do")
    o, dq, dk, dv = pyfa.attention_grad(q, k, v, do, causal=True, block_r=8, block_c=16, backend="emu")
    o2, lse2 = pyfa.fa2_forward(q, k, v, causal=True, block_r=8, block_c=16, backend="emu")
    grads = pyfa.fa2_backward(q, k, v, o2, lse2, do, causal=True, block_r=8, block_c=16, backend="emu")
    assert same_bits(o, o2) and all(same_bits(a, b) for a, b in zip((dq, dk, dv), grads))
    assert same_bits(o, pyfa.attention(q, k, v, causal=True, block_r=8, block_c=16, backend="emu"))
    # A scale other than the default, default tiles, and the 2-D form.
    o, dq, dk, dv = pyfa.attention_grad(q[0, 1], k[0, 1], v[0, 1], do[0, 1], scale=0.3, backend="emu")
    assert dq.shape == (24, 16) and dk.shape == dv.shape == (20, 16)
    refs = attention_grad_ref(q[0, 1], k[0, 1], v[0, 1], do[0, 1], scale=0.3)
    for got, ref in zip((o, dq, dk, dv), refs):
        assert rel_err(got, ref) < 1e-4
    with pytest.raises(ValueError, match="algo"):
        pyfa.attention_grad(q, k, v, do, algo="fa9", backend="emu")


def test_backward_accepts_noncontiguous_inputs():
    q, k, v, do = make_inputs((1, 2, 24, 16), (1, 2, 24, 16), 8, "do")
    o, lse = pyfa.fa2_forward(q, k, v, backend="emu")
    ref = pyfa.fa2_backward(q, k, v, o, lse, do, backend="emu")
    big = np.zeros((1, 2, 48, 16), np.float32)
    big[:, :, ::2] = do
    dot = np.ascontiguousarray(o.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    got = pyfa.fa2_backward(q, k, v, dot, lse, big[:, :, ::2], backend="emu")
    assert all(same_bits(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("fix,exc,needle", [
    (dict(o=np.zeros((1, 2, 24, 8), np.float32)), ValueError, "^o:"),
    (dict(do=np.zeros((1, 2, 24, 16), np.float64)), TypeError, "^do:"),
    (dict(lse=np.zeros((1, 2, 23), np.float32)), ValueError, "^lse:"),
    (dict(block_r=0), ValueError, "block_r"),
    (dict(emu_order="sideways"), ValueError, "emu_order"),
])
def test_python_argument_errors(fix, exc, needle):
    q, k, v, do = make_inputs((1, 2, 24, 16), (1, 2, 20, 16), 1, "do")
    tensors = dict(o=np.zeros_like(q), lse=np.zeros((1, 2, 24), np.float32), do=do)
    kw = {}
    for key, value in fix.items():
        (tensors if key in tensors else kw)[key] = value
    with pytest.raises(exc, match=needle):
        pyfa.fa2_backward(q, k, v, tensors["o"], tensors["lse"], tensors["do"], backend="emu", **kw)
    if "emu_order" not in kw:  # the simulator has no backend arguments
        with pytest.raises(exc, match=needle):
            pyfa.sim.fa2_backward(q, k, v, tensors["o"], tensors["lse"], tensors["do"], **kw)


def test_tile_too_large_names_the_kernel():
    q, k, v, do = make_inputs((1, 1, 8, 256), (1, 1, 8, 256), 1, "do")
    o, lse = pyfa.fa2_forward(q, k, v, backend="emu")
    with pytest.raises(pyfa.TileTooLargeError, match="fa2_backward_dkdv"):
        pyfa.fa2_backward(q, k, v, o, lse, do, block_r=64, block_c=64, backend="emu")


def _c_backward(device, null=None, Nq=6, Nk=5, d=4):
    """Calls pyfa_fa2_backward(_device) on the emulator with host buffers; returns
    (status, message, dq, dk, dv), the outputs pre-filled with 7."""
    ffi, lib = _lib.load()
    q, k, v, do = make_inputs((Nq, d), (Nk, d), 2, "do")
    o, lse = pyfa.fa2_forward(q, k, v, causal=True, backend="emu")
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                                        scale=0.0, causal=1))
    cfg = ffi.new("pyfa_config *", dict(backend=const("PYFA_BACKEND_EMU")))
    outs = [np.full((Nq, d), 7.0, np.float32), np.full((Nk, d), 7.0, np.float32),
            np.full((Nk, d), 7.0, np.float32)]
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    args = [ptr(x) for x in (q, k, v, o, lse, do, *outs)]
    if null is not None:
        args[null] = ffi.NULL
    if device:
        status = lib.pyfa_fa2_backward_device(pr, cfg, *args, ffi.NULL)
    else:
        status = lib.pyfa_fa2_backward(pr, cfg, *args)
    return status, ffi.string(lib.pyfa_last_error()).decode(), (q, k, v, o, lse, do), outs


@pytest.mark.parametrize("null,needle", [(5, "do: null pointer"), (4, "lse: null pointer"),
                                         (3, "o: null pointer"), (6, "dq: null pointer"),
                                         (8, "dv: null pointer")])
def test_c_abi_errors_name_the_argument_and_write_nothing(null, needle):
    status, message, _, outs = _c_backward(False, null)
    assert status == const("PYFA_ERROR_INVALID_ARGUMENT") and needle in message
    assert all(np.all(x == 7.0) for x in outs)


def test_c_abi_host_and_device_entry_points_agree():
    status, message, (q, k, v, o, lse, do), host = _c_backward(False)
    assert status == const("PYFA_OK") and message == ""
    status, _, _, device = _c_backward(True)
    assert status == const("PYFA_OK")
    sim = pyfa.sim.fa2_backward(q, k, v, o, lse, do, causal=True)
    for got_h, got_d, ref in zip(host, device, (sim.dq, sim.dk, sim.dv)):
        assert same_bits(got_h, ref) and same_bits(got_d, ref)
