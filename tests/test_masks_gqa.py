"""Masks, causal alignments and GQA/MQA in the library (the emulator running the kernel
source): bit for bit the simulator's results for every mask x alignment x GQA
combination, Nq > Nk and Nq < Nk, windows narrower than a tile and windows that leave
rows empty, under two thread orders; against the float64 reference; the cpu backend bit
for bit the emulator's; and the C ABI's checks of the new problem fields, each naming
its field."""

import itertools

import numpy as np
import pytest

import pyfa
from pyfa import _lib
from pyfa.sim.mask import Mask
from reference import attention_grad_ref, make_inputs, mask_matrix, rel_err, same_bits

# pyfa.h's enum values, as the loader parses them from the header.
const = _lib.constant

# Nq, Nk with tiles of 4: Nq > Nk, Nq < Nk, equal; none a multiple of the other's tile.
SHAPES = [(13, 6), (6, 13), (11, 11)]
# H, Hkv: MHA, GQA (2 query heads per K/V head), MQA.
HEADS = [(2, 2), (4, 2), (3, 1)]
# (causal, window, causal_align): no mask, causal both ways, windows narrower than a
# 4-wide tile, one-sided windows, the diagonal alone (with Nq != Nk it leaves rows empty
# bottom-right), and a window that leaves rows empty top-left when Nq > Nk.
MASKS = [
    (False, None, "bottom_right"),
    (True, None, "bottom_right"),
    (True, None, "top_left"),
    (False, (1, 2), "bottom_right"),
    (False, (1, 2), "top_left"),
    (True, (2, None), "bottom_right"),
    (True, (2, None), "top_left"),
    (False, (None, 1), "top_left"),
    (False, (0, 0), "bottom_right"),
    (False, (0, 0), "top_left"),
]
TILES = dict(block_r=4, block_c=4)


def mask_id(m):
    causal, window, align = m
    return f"{'causal' if causal else 'full'}-w{window}-{align}".replace(" ", "")


def run_both(q, k, v, do, mask, **emu):
    """Every library function on the emulator and its simulator twin, as pairs of outputs."""
    causal, window, align = mask
    kw = dict(causal=causal, window=window, causal_align=align, **TILES)
    lib = dict(kw, backend="emu", **emu)
    o2, lse = pyfa.fa2_forward(q, k, v, **lib)
    s2 = pyfa.sim.fa2_forward(q, k, v, **kw)
    g2 = pyfa.fa2_backward(q, k, v, o2, lse, do, **lib)
    sg2 = pyfa.sim.fa2_backward(q, k, v, s2.o, s2.lse, do, **kw)
    o1, m1, l1 = pyfa.fa1_forward(q, k, v, **lib)
    s1 = pyfa.sim.fa1_forward(q, k, v, **kw)
    g1 = pyfa.fa1_backward(q, k, v, o1, m1, l1, do, **lib)
    sg1 = pyfa.sim.fa1_backward(q, k, v, s1.o, s1.m, s1.l, do, **kw)
    pairs = {"fa2 o": (o2, s2.o), "fa2 lse": (lse, s2.lse), "fa1 o": (o1, s1.o),
             "fa1 m": (m1, s1.m), "fa1 l": (l1, s1.l)}
    for name, got, want in zip(("dq", "dk", "dv"), g2, (sg2.dq, sg2.dk, sg2.dv)):
        pairs[f"fa2 {name}"] = (got, want)
    for name, got, want in zip(("dq", "dk", "dv"), g1, (sg1.dq, sg1.dk, sg1.dv)):
        pairs[f"fa1 {name}"] = (got, want)
    return pairs


@pytest.mark.parametrize("order", ["reverse", "shuffled"])
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_emulator_equals_simulator_bit_for_bit(mask, order):
    for n, ((Nq, Nk), (H, Hkv)) in enumerate(itertools.product(SHAPES, HEADS)):
        q, k, v, do = make_inputs((1, H, Nq, 8), (1, Hkv, Nk, 8), 100 + n, "do")
        pairs = run_both(q, k, v, do, mask, emu_order=order, emu_seed=n + 1)
        for name, (got, want) in pairs.items():
            assert got.shape == want.shape, (name, Nq, Nk, H, Hkv)
            assert same_bits(got, want), (name, Nq, Nk, H, Hkv)


@pytest.mark.parametrize("algo", ["fa1", "fa2"])
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_library_matches_float64(mask, algo):
    causal, window, align = mask
    for n, ((Nq, Nk), (H, Hkv)) in enumerate(itertools.product(SHAPES, HEADS)):
        q, k, v, do = make_inputs((2, H, Nq, 8), (2, Hkv, Nk, 8), 300 + n, "do")
        got = pyfa.attention_grad(q, k, v, do, causal=causal, window=window, causal_align=align,
                                  algo=algo, backend="emu", **TILES)
        want = attention_grad_ref(q, k, v, do, causal, window=window, causal_align=align)
        for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
            assert g.shape == w.shape, (name, Nq, Nk, H, Hkv)
            assert rel_err(g, w) < 2e-5, (name, Nq, Nk, H, Hkv, rel_err(g, w))


@pytest.mark.parametrize("mask", [m for m in MASKS if m[1] == (0, 0) or m[0]], ids=mask_id)
def test_rows_without_a_visible_key(mask):
    # O = 0 and LSE = -inf (FA1: m = -inf, l = 0) exactly where the mask hides every key,
    # and their gradients are 0; a K/V row no query sees gets dK = dV = 0.
    causal, window, align = mask
    Nq, Nk = 13, 6
    q, k, v, do = make_inputs((1, 2, Nq, 8), (1, 1, Nk, 8), 7, "do")
    hidden = mask_matrix(Nq, Nk, causal, window, align)
    empty_rows, unseen_keys = hidden.all(axis=1), hidden.all(axis=0)
    kw = dict(causal=causal, window=window, causal_align=align, backend="emu", **TILES)
    o, lse = pyfa.fa2_forward(q, k, v, **kw)
    o1, m1, l1 = pyfa.fa1_forward(q, k, v, **kw)
    dq, dk, dv = pyfa.fa2_backward(q, k, v, o, lse, do, **kw)
    assert np.all(o[:, :, empty_rows] == 0) and np.all(lse[:, :, empty_rows] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, ~empty_rows]))
    assert np.all(o1[:, :, empty_rows] == 0) and np.all(m1[:, :, empty_rows] == -np.inf)
    assert np.all(l1[:, :, empty_rows] == 0) and np.all(l1[:, :, ~empty_rows] > 0)
    assert np.all(dq[:, :, empty_rows] == 0)
    assert np.all(dk[:, :, unseen_keys] == 0) and np.all(dv[:, :, unseen_keys] == 0)
    if align == "bottom_right" and window == (0, 0):
        assert empty_rows.any() and unseen_keys.sum() == 0
    if align == "top_left" and window == (0, 0):
        assert empty_rows.sum() == Nq - Nk


def test_top_left_causal_with_more_queries_than_keys_is_pytorchs():
    # PyTorch's is_causal: row i sees keys 0 .. min(i, Nk - 1), so no row is empty; the
    # bottom-right mask hides every key from the first Nq - Nk rows.
    Nq, Nk = 9, 4
    q, k, v = make_inputs((1, 1, Nq, 8), (1, 1, Nk, 8), 3)
    top = pyfa.attention(q, k, v, causal=True, causal_align="top_left", backend="emu")
    bottom = pyfa.attention(q, k, v, causal=True, backend="emu")
    assert np.all(np.abs(top[0, 0, :Nq - Nk]).sum(axis=-1) > 0)
    assert np.all(bottom[0, 0, :Nq - Nk] == 0)
    # The last Nk rows of top-left from row Nk - 1 on see every key, like a full mask.
    full = pyfa.attention(q, k, v, backend="emu")
    assert np.allclose(top[0, 0, Nk - 1:], full[0, 0, Nk - 1:], atol=1e-6)


def test_gqa_equals_repeated_heads_forward_and_summed_gradients():
    # Query head h reads K/V head h // G; dK, dV of a K/V head is the sum of its group's
    # (the sum's order is the kernels', so compare in float64 tolerance, not bits).
    H, Hkv, N = 6, 2, 10
    q, k, v, do = make_inputs((2, H, N, 8), (2, Hkv, N, 8), 5, "do")
    G = H // Hkv
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    for algo in ("fa1", "fa2"):
        o, dq, dk, dv = pyfa.attention_grad(q, k, v, do, causal=True, algo=algo, backend="emu")
        o_r, dq_r, dk_r, dv_r = pyfa.attention_grad(q, kr, vr, do, causal=True, algo=algo,
                                                     backend="emu")
        assert same_bits(o, o_r) and same_bits(dq, dq_r)
        assert dk.shape == k.shape and dv.shape == v.shape
        dk_sum = dk_r.reshape(2, Hkv, G, N, 8).astype(np.float64).sum(axis=2)
        dv_sum = dv_r.reshape(2, Hkv, G, N, 8).astype(np.float64).sum(axis=2)
        assert rel_err(dk, dk_sum) < 1e-5 and rel_err(dv, dv_sum) < 1e-5


def _c_call(**fields):
    """pyfa_fa2_forward through the C ABI on a small problem with `fields` set; returns
    (status, message)."""
    ffi, lib = _lib.load()
    B, H, N, d = 1, 4, 8, 4
    base = dict(batch=B, heads=H, seqlen_q=N, seqlen_k=N, head_dim=d)
    base.update({f: v for f, v in fields.items() if "." not in f})
    pr = ffi.new("pyfa_problem *", base)
    for f, v in fields.items():
        if "." in f:
            tensor, side = f.split(".")
            setattr(getattr(pr, tensor), side, v)
    cfg = ffi.new("pyfa_config *", dict(backend=const("PYFA_BACKEND_EMU"), emu_workers=1))
    x = np.zeros((B, H, N, d), np.float32)
    o = np.full((B, H, N, d), 7.0, np.float32)
    lse = np.full((B, H, N), 7.0, np.float32)
    p = [ffi.cast("float *", ffi.from_buffer(a)) for a in (x, x, x, o, lse)]
    status = lib.pyfa_fa2_forward(pr, cfg, *p)
    message = ffi.string(lib.pyfa_last_error()).decode()
    if status != 0:
        assert np.all(o == 7.0) and np.all(lse == 7.0), "a failed call wrote its outputs"
    return status, message


@pytest.mark.parametrize("fields,names", [
    (dict(heads_kv=3), "problem->heads_kv"),
    (dict(heads_kv=-2), "problem->heads_kv"),
    (dict(heads_kv=8), "problem->heads_kv"),
    (dict(causal_align=max(_lib.enum_values("pyfa_causal_align", "PYFA_ALIGN_").values()) + 1),
     "problem->causal_align"),
    (dict(causal_align=-1), "problem->causal_align"),
    ({"q.row": -4}, "problem->q.row"),
    ({"k.batch": -1}, "problem->k.batch"),
    ({"o.head": -1}, "problem->o.head"),
    ({"v.row": 2**61, "v.head": 1}, "problem->v"),
])
def test_c_abi_refuses_bad_fields_by_name(fields, names):
    status, message = _c_call(**fields)
    assert status == const("PYFA_ERROR_INVALID_ARGUMENT"), message
    assert names in message, message


def test_c_abi_accepts_any_window_values_and_gqa():
    for fields in (dict(heads_kv=2), dict(heads_kv=1),
                   dict(window=1, window_left=-5, window_right=3),
                   dict(window=1, window_left=2**62, window_right=-1),
                   dict(causal_align=const("PYFA_ALIGN_TOP_LEFT"), causal=1)):
        status, message = _c_call(**fields)
        assert status == const("PYFA_OK"), (fields, message)


def test_c_abi_variant():
    ffi, lib = _lib.load()
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=4, seqlen_k=4, head_dim=4))
    x = np.ones((1, 1, 4, 4), np.float32)
    o, lse = np.empty_like(x), np.empty((1, 1, 4), np.float32)
    p = [ffi.cast("float *", ffi.from_buffer(a)) for a in (x, x, x, o, lse)]
    ok, bad = const("PYFA_OK"), const("PYFA_ERROR_INVALID_ARGUMENT")
    past = max(_lib.enum_values("pyfa_variant", "PYFA_VARIANT_").values()) + 1
    # FAST has no kernel for head_dim 4: refused, as is a value outside the enum.
    for variant, want in ((const("PYFA_VARIANT_AUTO"), ok), (const("PYFA_VARIANT_REFERENCE"), ok),
                          (const("PYFA_VARIANT_FAST"), bad), (past, bad), (-1, bad)):
        cfg = ffi.new("pyfa_config *", dict(backend=const("PYFA_BACKEND_EMU"), variant=variant))
        status = lib.pyfa_fa2_forward(pr, cfg, *p)
        assert status == want, (variant, ffi.string(lib.pyfa_last_error()))
        if want != ok:
            assert "config->variant" in ffi.string(lib.pyfa_last_error()).decode()


def test_python_mask_arguments_are_checked_before_the_library():
    q, k, v = make_inputs((1, 2, 4, 8), (1, 2, 4, 8), 0)
    with pytest.raises(ValueError, match="window"):
        pyfa.attention(q, k, v, window=(-1, 2), backend="emu")
    with pytest.raises(TypeError, match="window"):
        pyfa.attention(q, k, v, window=3, backend="emu")
    with pytest.raises(ValueError, match="causal_align"):
        pyfa.attention(q, k, v, causal_align="bottom-right", backend="emu")
    with pytest.raises(ValueError, match="k"):
        pyfa.attention(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1), backend="emu")
    with pytest.raises(ValueError, match="layout"):
        pyfa.attention(q, k, v, layout="nhd", backend="emu")
    assert Mask.resolve(True, (2, 5), "top_left", 4, 4) == Mask(2, 0, 0)


# threads=8: more threads than heads, so the dQ phase runs apart from the dK/dV one.
@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_cpu_backend_equals_emulator(mask, threads):
    causal, window, align = mask
    kw = dict(causal=causal, window=window, causal_align=align, **TILES)
    for n, ((Nq, Nk), (H, Hkv)) in enumerate(itertools.product(SHAPES, HEADS)):
        q, k, v, do = make_inputs((1, H, Nq, 8), (1, Hkv, Nk, 8), 500 + n, "do")
        for algo in ("fa1", "fa2"):
            got = pyfa.attention(q, k, v, algo=algo, backend="cpu", threads=threads, **kw)
            assert same_bits(got, pyfa.attention(q, k, v, algo=algo, backend="emu", **kw))
            got = pyfa.attention_grad(q, k, v, do, algo=algo, backend="cpu", threads=threads, **kw)
            want = pyfa.attention_grad(q, k, v, do, algo=algo, backend="emu", **kw)
            assert all(same_bits(a, b) for a, b in zip(got, want)), (algo, Nq, Nk, H, Hkv)
