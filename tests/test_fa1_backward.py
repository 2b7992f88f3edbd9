"""FA1 backward (Algorithm 4): the kernel (emulated, or on a GPU) equals its simulator bit
for bit, the gradients match float64 and finite differences, and fully masked rows give
zero gradients."""

import functools

import numpy as np
import pytest

import grid
import pyfa
from pyfa import _lib
from reference import attention_grad_ref, attention_ref, make_inputs, rel_err, same_bits

# pyfa.h's enum values, as the loader parses them from the header.
const = _lib.constant

# The shared grid (tests/grid.py), plus Br > Bc with Nq > Nk, and the default tiles
# (None: 64 x 128 at d = 64, 36 x 36 at d = 256).
CASES = grid.CASES + [
    (1, 1, 30, 12, 8, 4, 2),
    (1, 2, 150, 140, 64, None, None),
    (1, 1, 50, 45, 256, None, None),
]


@functools.lru_cache(maxsize=None)
def simulated(case, causal):
    """Inputs, the forward's (o, m, l) from the simulator, and the simulated backward."""
    B, H, Nq, Nk, d, Br, Bc = case
    q, k, v, do = make_inputs((B, H, Nq, d), (B, H, Nk, d), grid.case_seed(case), "do")
    fwd = pyfa.sim.fa1_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)
    bwd = pyfa.sim.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, causal=causal,
                                block_r=Br, block_c=Bc)
    return (q, k, v, do), fwd, bwd


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case,backend,order,variant", grid.variant_params(CASES))
def test_kernel_equals_simulator_bitwise(case, causal, backend, order, variant):
    (q, k, v, do), fwd, sim = simulated(case, causal)
    _, _, _, _, _, Br, Bc = case
    got = grid.run_variant("fa1_backward", case, variant, lambda: pyfa.fa1_backward(
        q, k, v, fwd.o, fwd.m, fwd.l, do, causal=causal, block_r=Br, block_c=Bc,
        backend=backend, emu_order=order, variant=variant))
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
    for got, ref in ((sim.dq, dq_ref), (sim.dk, dk_ref), (sim.dv, dv_ref)):
        assert np.all(np.isfinite(got))
        assert rel_err(got, ref) < 1e-4


def test_finite_differences_on_tiny_sizes():
    # loss = sum(O * dO). Central differences of the float64 forward check the kernel's
    # gradient tightly; central differences of the kernel's own fp32 forward check that
    # its forward and backward agree, with a tolerance for fp32 rounding.
    q, k, v, do = make_inputs((1, 1, 3, 4), (1, 1, 5, 4), 21, "do")
    for causal in (False, True):
        o, m, l = pyfa.fa1_forward(q, k, v, causal=causal, block_r=2, block_c=2, backend="emu")
        grads = pyfa.fa1_backward(q, k, v, o, m, l, do, causal=causal, block_r=2, block_c=2,
                                  backend="emu")
        for which, grad in enumerate(grads):
            x = (q, k, v)[which]
            fd64 = np.zeros(x.shape)
            fd32 = np.zeros(x.shape)
            for idx in np.ndindex(x.shape):
                for sign in (1, -1):
                    args = [a.astype(np.float64) for a in (q, k, v)]
                    args[which][idx] += sign * 1e-6
                    fd64[idx] += sign * np.sum(attention_ref(*args, causal)[0] * do) / 2e-6
                    args32 = [a.copy() for a in (q, k, v)]
                    args32[which][idx] += np.float32(sign * 1e-2)
                    o32 = pyfa.fa1_forward(*args32, causal=causal, block_r=2, block_c=2, backend="emu")[0]
                    fd32[idx] += sign * np.sum(o32.astype(np.float64) * do) / 2e-2
            assert rel_err(grad, fd64) < 1e-4, ("dq", "dk", "dv")[which]
            assert rel_err(grad, fd32) < 5e-4, ("dq", "dk", "dv")[which]


def test_fully_masked_rows_give_zero_gradients():
    # Nq > Nk with causal: the first 6 query rows see no key (m = -inf, l = 0).
    q, k, v, do = make_inputs((1, 1, 10, 8), (1, 1, 4, 8), 3, "do")
    o, m, l = pyfa.fa1_forward(q, k, v, causal=True, block_r=4, block_c=2, backend="emu")
    assert np.all(l[0, 0, :6] == 0) and np.all(np.isneginf(m[0, 0, :6]))
    dq, dk, dv = pyfa.fa1_backward(q, k, v, o, m, l, do, causal=True, block_r=4, block_c=2,
                                   backend="emu")
    assert np.all(dq[0, 0, :6] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    _, dq_ref, dk_ref, dv_ref = attention_grad_ref(q, k, v, do, True)
    assert rel_err(dq, dq_ref) < 1e-4 and rel_err(dk, dk_ref) < 1e-4 and rel_err(dv, dv_ref) < 1e-4
    sim = pyfa.sim.fa1_backward(q, k, v, o, m, l, do, causal=True, block_r=4, block_c=2)
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)


def test_dq_is_initialized_before_it_is_read():
    # The device-pointer entry point accumulates dQ straight in the caller's buffer: fill
    # it (and dK, dV) with NaN or Inf first; the result must not change.
    ffi, lib = _lib.load()
    q, k, v, do = make_inputs((2, 1, 17, 8), (2, 1, 21, 8), 5, "do")
    o, m, l = pyfa.fa1_forward(q, k, v, block_r=4, block_c=8, backend="emu")
    want = pyfa.fa1_backward(q, k, v, o, m, l, do, block_r=4, block_c=8, backend="emu")
    ptr = lambda x: ffi.cast("float *", ffi.from_buffer(x))
    for fill in (np.nan, np.inf):
        got = [np.full(x.shape, fill, np.float32) for x in (q, k, v)]
        problem = ffi.new("pyfa_problem *", {"batch": 2, "heads": 1, "seqlen_q": 17, "seqlen_k": 21,
                                              "head_dim": 8})
        config = ffi.new("pyfa_config *", {"backend": const("PYFA_BACKEND_EMU"), "block_r": 4, "block_c": 8})
        _lib.check(lib.pyfa_fa1_backward_device(problem, config, ptr(q), ptr(k), ptr(v), ptr(o),
                                                ptr(m), ptr(l), ptr(do), *map(ptr, got), ffi.NULL))
        assert all(same_bits(a, b) for a, b in zip(got, want))


def test_shuffled_order_and_repeated_calls_give_the_same_bits():
    q, k, v, do = make_inputs((2, 2, 45, 32), (2, 2, 38, 32), 7, "do")
    o, m, l = pyfa.fa1_forward(q, k, v, causal=True, block_r=16, block_c=8, backend="emu")
    ref = pyfa.fa1_backward(q, k, v, o, m, l, do, causal=True, block_r=16, block_c=8, backend="emu")
    for seed in (1, 2):
        out = pyfa.fa1_backward(q, k, v, o, m, l, do, causal=True, block_r=16, block_c=8,
                                backend="emu", emu_order="shuffled", emu_seed=seed)
        assert all(same_bits(a, b) for a, b in zip(out, ref))
    for workers in (1, 3):
        out = pyfa.fa1_backward(q, k, v, o, m, l, do, causal=True, block_r=16, block_c=8,
                                backend="emu", emu_workers=workers)
        assert all(same_bits(a, b) for a, b in zip(out, ref))


def test_attention_grad_runs_fa1_forward_then_backward():
    q, k, v, do = make_inputs((1, 2, 30, 8), (1, 2, 26, 8), 9, "do")
    o, dq, dk, dv = pyfa.attention_grad(q, k, v, do, causal=True, algo="fa1", block_r=8,
                                        block_c=4, backend="emu")
    fo, fm, fl = pyfa.fa1_forward(q, k, v, causal=True, block_r=8, block_c=4, backend="emu")
    grads = pyfa.fa1_backward(q, k, v, fo, fm, fl, do, causal=True, block_r=8, block_c=4,
                              backend="emu")
    assert same_bits(o, fo) and all(same_bits(a, b) for a, b in zip((dq, dk, dv), grads))
    assert same_bits(o, pyfa.attention(q, k, v, causal=True, algo="fa1", block_r=8, block_c=4,
                                       backend="emu"))


def test_ranks_and_shapes():
    q, k, v, do = make_inputs((2, 3, 12, 8), (2, 3, 9, 8), 13, "do")
    o, m, l = pyfa.fa1_forward(q, k, v, backend="emu")
    g4 = pyfa.fa1_backward(q, k, v, o, m, l, do, backend="emu")
    g2 = pyfa.fa1_backward(q[1, 2], k[1, 2], v[1, 2], o[1, 2], m[1, 2], l[1, 2], do[1, 2],
                           backend="emu")
    assert [g.shape for g in g2] == [(12, 8), (9, 8), (9, 8)]
    assert all(same_bits(a, b[1, 2]) for a, b in zip(g2, g4))
    # m and l may also come as (B, H, Nq) beside a rank-2 q.
    g2b = pyfa.fa1_backward(q[1, 2], k[1, 2], v[1, 2], o[1, 2], m[1:2, 2:3], l[1:2, 2:3], do[1, 2],
                            backend="emu")
    assert all(same_bits(a, b) for a, b in zip(g2, g2b))


@pytest.mark.parametrize("name,bad,exc,needle", [
    ("m", [0.0] * 12, TypeError, "m: expected a numpy.ndarray"),
    ("l", np.zeros((1, 1, 11), np.float32), ValueError, "l: expected"),
    ("m", np.zeros((1, 1, 12), np.float64), TypeError, "m: expected dtype float32"),
    ("do", np.zeros((1, 1, 12, 4), np.float32), ValueError, "do: expected shape"),
    ("o", np.zeros((1, 1, 12, 8), np.float64), TypeError, "o: expected dtype float32"),
])
def test_bad_saved_tensors_are_named(name, bad, exc, needle):
    q, k, v, do = make_inputs((1, 1, 12, 8), (1, 1, 9, 8), 1, "do")
    args = dict(o=q.copy(), m=np.zeros((1, 1, 12), np.float32), l=np.ones((1, 1, 12), np.float32), do=do)
    args[name] = bad
    with pytest.raises(exc, match=needle):
        pyfa.fa1_backward(q, k, v, args["o"], args["m"], args["l"], args["do"], backend="emu")
    with pytest.raises(exc, match=needle):
        pyfa.sim.fa1_backward(q, k, v, args["o"], args["m"], args["l"], args["do"])


def test_c_abi_names_a_null_do():
    ffi, lib = _lib.load()
    q, k, v, do = make_inputs((1, 1, 4, 4), (1, 1, 4, 4), 2, "do")
    rows = np.zeros((1, 1, 4), np.float32)
    outs = [np.full(q.shape, 7, np.float32) for _ in range(3)]
    ptr = lambda x: ffi.cast("float *", ffi.from_buffer(x))
    problem = ffi.new("pyfa_problem *", {"batch": 1, "heads": 1, "seqlen_q": 4, "seqlen_k": 4, "head_dim": 4})
    config = ffi.new("pyfa_config *", {"backend": const("PYFA_BACKEND_EMU")})
    st = lib.pyfa_fa1_backward(problem, config, ptr(q), ptr(k), ptr(v), ptr(q), ptr(rows), ptr(rows),
                               ffi.NULL, *map(ptr, outs))
    assert st == lib.PYFA_ERROR_INVALID_ARGUMENT
    assert ffi.string(lib.pyfa_last_error()).decode() == "do: null pointer"
    assert all(np.all(x == 7) for x in outs)
    st = lib.pyfa_fa1_forward(problem, config, ptr(q), ptr(k), ptr(v), ptr(outs[0]), ffi.NULL, ptr(rows))
    assert st == lib.PYFA_ERROR_INVALID_ARGUMENT
    assert ffi.string(lib.pyfa_last_error()).decode() == "m: null pointer"
