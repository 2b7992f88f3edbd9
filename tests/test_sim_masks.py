"""Masks, GQA and layouts in the simulator: sim.mask.Mask against NumPy's triangles, its
tile bands against brute force, the argument checks, and every simulator kernel against
the float64 reference for every mask x alignment x GQA combination (Nq > Nk and Nq < Nk,
windows narrower than a tile, windows that leave rows empty), in both layouts and on
strided and packed inputs; the simulators' IO records against count_io and against the
visited tile pairs counted from the mask matrix."""

import functools
import itertools

import numpy as np
import pytest

import pyfa
from pyfa.checks import check_like, check_qkv, check_rows, element_strides, restore_rank
from pyfa.sim.mask import Mask
from reference import (attention_grad_ref, attention_ref, make_inputs, mask_matrix, rel_err,
                       row_stats_ref, same_bits)

ALIGNS = ("bottom_right", "top_left")


def visible_by_triangles(Nq, Nk, causal, window, align):
    """Visibility from np.tri alone: key j visible to row i iff
    i + off - left <= j <= i + off + right, written as two triangles."""
    off = Nk - Nq if align == "bottom_right" else 0
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    vis = np.ones((Nq, Nk), bool)
    if right is not None:
        vis &= np.tri(Nq, Nk, off + right, dtype=bool)          # j <= i + off + right
    if left is not None:
        vis &= ~np.tri(Nq, Nk, off - left - 1, dtype=bool)      # not j <= i + off - left - 1
    return vis


WINDOWS = [None, (0, 0), (1, None), (None, 2), (3, 1), (0, 5), (40, 40)]


@pytest.mark.parametrize("Nq,Nk", [(7, 5), (5, 9), (6, 6), (1, 4), (4, 1)])
def test_mask_is_the_two_triangles(Nq, Nk):
    for causal, window, align in itertools.product((False, True), WINDOWS, ALIGNS):
        want = visible_by_triangles(Nq, Nk, causal, window, align)
        got = ~mask_matrix(Nq, Nk, causal, window, align)
        assert np.array_equal(got, want), (causal, window, align)


def test_mask_conventions():
    # PyTorch's is_causal (top-left): lower triangle from the top-left corner.
    assert np.array_equal(~mask_matrix(3, 5, True, None, "top_left"), np.tri(3, 5, 0, dtype=bool))
    # flash-attn's (bottom-right): the last row sees every key.
    vis = ~mask_matrix(3, 5, True, None, "bottom_right")
    assert vis[-1].all() and vis[0].sum() == 3
    # Nq > Nk, bottom-right: the first Nq - Nk rows see nothing; top-left: all see key 0.
    assert not (~mask_matrix(6, 2, True, None, "bottom_right"))[:4].any()
    assert (~mask_matrix(6, 2, True, None, "top_left"))[:, 0].all()
    # Unbounded sides are held finite, as wide as the problem.
    m = Mask.resolve(False, None, "bottom_right", 10, 30)
    assert (m.left, m.right, m.off) == (40, 40, 20)
    assert Mask.resolve(True, (10**30, 7), "top_left", 10, 30) == Mask(40, 0, 0)


def test_mask_argument_errors_name_the_argument():
    for bad, exc in [((1,), TypeError), ([1, 2, 3], TypeError), (5, TypeError), ("1,2", TypeError),
                     ((1.0, 2), TypeError), ((True, 2), TypeError), ((-1, 2), ValueError),
                     ((1, -3), ValueError)]:
        with pytest.raises(exc, match="window"):
            Mask.resolve(False, bad, "bottom_right", 4, 4)
    for bad, exc in [("bottom-right", ValueError), ("", ValueError), (0, TypeError),
                     (None, TypeError)]:
        with pytest.raises(exc, match="causal_align"):
            Mask.resolve(False, None, bad, 4, 4)
    with pytest.raises(TypeError, match="causal"):
        Mask.resolve("yes", None, "bottom_right", 4, 4)
    assert Mask.resolve(np.bool_(True), [np.int64(2), None], "top_left", 4, 4) == Mask(2, 0, 0)


def brute_bands(vis, Br, Bc):
    """For each Q tile the K/V tiles holding a visible key, and the converse, from the
    mask matrix itself."""
    Nq, Nk = vis.shape
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    hit = np.array([[vis[i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc].any() for j in range(Tc)]
                    for i in range(Tr)])
    return hit


@pytest.mark.parametrize("Nq,Nk,Br,Bc", [(7, 5, 2, 3), (5, 9, 4, 2), (16, 16, 4, 4),
                                         (3, 20, 8, 3), (20, 3, 3, 8), (33, 17, 5, 7)])
def test_tile_ranges_are_exactly_the_visited_band(Nq, Nk, Br, Bc):
    for causal, window, align in itertools.product((False, True), WINDOWS, ALIGNS):
        mask = Mask.resolve(causal, window, align, Nq, Nk)
        hit = brute_bands(~mask.masked(np.arange(Nq)[:, None], np.arange(Nk)[None, :]), Br, Bc)
        for i in range(hit.shape[0]):
            r = mask.kv_tiles(i * Br, min(Br, Nq - i * Br), Bc, Nk)
            assert list(range(*r)) == list(np.nonzero(hit[i])[0]), (causal, window, align, i)
            assert r.begin <= r.end
        for j in range(hit.shape[1]):
            r = mask.q_tiles(j * Bc, min(Bc, Nk - j * Bc), Br, Nq)
            assert list(range(*r)) == list(np.nonzero(hit[:, j])[0]), (causal, window, align, j)


# ---- argument checks: views, layouts, GQA

def test_check_qkv_returns_views_in_either_layout():
    x = np.zeros((2, 7, 3, 6, 8), np.float32)  # a packed (B, N, 3, H, d) QKV
    q, k, v = x[:, :, 0], x[:, :, 1, :2], x[:, :, 2, :2]
    got = check_qkv(q, k, v, layout="bnhd")
    assert got.q.shape == (2, 6, 7, 8) and got.k.shape == (2, 2, 7, 8)
    assert (got.rank, got.heads_kv) == (4, 2)
    assert all(np.shares_memory(a, b) for a, b in ((got.q, q), (got.k, k), (got.v, v)))
    assert element_strides(got.q) == (7 * 3 * 6 * 8, 8, 3 * 6 * 8)
    assert element_strides(got.q[..., ::2]) is None  # the last axis not contiguous
    lse = np.zeros((2, 6, 7), np.float32)
    assert np.shares_memory(check_rows("lse", lse, got.q), lse)
    o = np.zeros((2, 7, 6, 8), np.float32)
    assert np.shares_memory(check_like("o", o, got.q, "bnhd"), o)
    with pytest.raises(ValueError, match="o"):
        check_like("o", o, got.q, "bhnd")
    # Rank 3 drops B; rank 2 is (N, d) in both layouts.
    assert check_qkv(q[0], k[0], v[0], layout="bnhd").q.shape == (1, 6, 7, 8)
    assert check_qkv(q[0, :, 0], k[0, :, 0], v[0, :, 0], layout="bnhd").q.shape == (1, 1, 7, 8)
    back = restore_rank(got.q, 4, "bnhd")
    assert back.shape == q.shape and back.flags.c_contiguous


def test_check_qkv_errors_name_the_argument():
    q, k, v = make_inputs((1, 6, 5, 4), (1, 4, 5, 4), seed=0)
    with pytest.raises(ValueError, match="^k: .*4 heads must divide q's 6"):
        check_qkv(q, k, v)
    with pytest.raises(ValueError, match="^v:"):
        check_qkv(q, k[:, :3], v[:, :2])
    with pytest.raises(ValueError, match="layout"):
        check_qkv(q, q, q, layout="bshd")
    with pytest.raises(TypeError, match="layout"):
        check_qkv(q, q, q, layout=None)
    with pytest.raises(TypeError, match="^k:"):
        check_qkv(q, k.astype(np.float64), v)


# ---- the simulators against float64

# (Nq, Nk, Br, Bc, causal, window, align): the alignments on both Nq > Nk and Nq < Nk;
# windows narrower than a tile; windows that leave rows empty (at the top, bottom-right
# with Nq > Nk; at the bottom, top-left with Nq > Nk); one-sided windows.
MASK_CASES = [
    (17, 23, 4, 8, True, None, "bottom_right"),
    (17, 23, 4, 8, True, None, "top_left"),
    (23, 11, 8, 4, True, None, "bottom_right"),
    (23, 11, 8, 4, True, None, "top_left"),
    (19, 19, 8, 8, False, (2, 1), "bottom_right"),
    (19, 30, 4, 8, True, (3, None), "top_left"),
    (30, 9, 8, 4, False, (0, 0), "top_left"),
    (12, 40, 4, 16, False, (None, 2), "bottom_right"),
    (20, 6, 4, 4, False, (1, 1), "bottom_right"),
    (16, 16, 4, 4, False, (5, 5), "top_left"),
    (9, 25, 16, 4, True, (1, None), "bottom_right"),
    (8, 30, 4, 4, True, None, "top_left"),
]
# (B, H, Hkv): MHA, GQA, MQA
HEADS = [(1, 2, 2), (2, 4, 2), (1, 3, 1)]
D = 8


def case_id(c):
    Nq, Nk, Br, Bc, causal, window, align = c
    w = "none" if window is None else "-".join("inf" if x is None else str(x) for x in window)
    return f"Nq{Nq}-Nk{Nk}-Br{Br}-Bc{Bc}-{'causal' if causal else 'full'}-w{w}-{align}"


def mask_kw(case):
    _, _, _, _, causal, window, align = case
    return dict(causal=causal, window=window, causal_align=align)


@functools.lru_cache(maxsize=None)
def inputs(case, heads):
    Nq, Nk = case[:2]
    B, H, Hkv = heads
    q, k, v, do = make_inputs((B, H, Nq, D), (B, Hkv, Nk, D), 11, "do")
    return q, k, v, do


@functools.lru_cache(maxsize=None)
def simulated(algo, case, heads):
    q, k, v, do = inputs(case, heads)
    Br, Bc = case[2:4]
    kw = dict(mask_kw(case), block_r=Br, block_c=Bc)
    if algo == "fa2":
        f = pyfa.sim.fa2_forward(q, k, v, **kw)
        b = pyfa.sim.fa2_backward(q, k, v, f.o, f.lse, do, **kw)
    else:
        f = pyfa.sim.fa1_forward(q, k, v, **kw)
        b = pyfa.sim.fa1_backward(q, k, v, f.o, f.m, f.l, do, **kw)
    return f, b


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "B{}H{}Hkv{}".format(*h))
@pytest.mark.parametrize("case", MASK_CASES, ids=case_id)
@pytest.mark.parametrize("algo", ["fa1", "fa2"])
def test_simulator_against_float64(algo, case, heads):
    q, k, v, do = inputs(case, heads)
    f, b = simulated(algo, case, heads)
    o_ref, lse_ref = attention_ref(q, k, v, **mask_kw(case))
    assert rel_err(f.o, o_ref) < 1e-5
    empty = np.isneginf(lse_ref)  # rows with no visible key
    assert np.all(f.o[empty] == 0)
    if algo == "fa2":
        assert np.array_equal(np.isneginf(f.lse), empty)
        assert rel_err(f.lse[~empty], lse_ref[~empty]) < 1e-5
    else:
        m_ref, l_ref = row_stats_ref(q, k, **mask_kw(case))
        assert np.array_equal(np.isneginf(f.m), empty) and np.all(f.l[empty] == 0)
        assert rel_err(f.m[~empty], m_ref[~empty]) < 1e-5
        assert rel_err(f.l[~empty], l_ref[~empty]) < 1e-5
    _, dq_ref, dk_ref, dv_ref = attention_grad_ref(q, k, v, do, **mask_kw(case))
    assert b.dk.shape == k.shape and b.dv.shape == v.shape and b.dq.shape == q.shape
    for got, ref in ((b.dq, dq_ref), (b.dk, dk_ref), (b.dv, dv_ref)):
        assert rel_err(got, ref) < 1e-4
    assert np.all(b.dq[empty] == 0)


def test_the_cases_cover_empty_rows_and_both_length_orders():
    kinds = set()
    for case in MASK_CASES:
        Nq, Nk = case[:2]
        vis = ~mask_matrix(Nq, Nk, **mask_kw(case))
        kinds.add(("empty rows", not vis.any(axis=1).all()))
        kinds.add(("Nq vs Nk", np.sign(Nq - Nk)))
        kinds.add(("window narrower than a tile", case[5] is not None and
                   max(x or 0 for x in case[5]) < min(case[2:4])))
    assert {("empty rows", True), ("Nq vs Nk", 1), ("Nq vs Nk", -1),
            ("window narrower than a tile", True)} <= kinds


@pytest.mark.parametrize("case", MASK_CASES[:6], ids=case_id)
@pytest.mark.parametrize("algo", ["fa1", "fa2"])
def test_layouts_strides_and_packed_inputs_give_the_same_bits(algo, case):
    heads = (2, 4, 2)
    q, k, v, do = inputs(case, heads)
    f, b = simulated(algo, case, heads)
    Br, Bc = case[2:4]
    kw = dict(mask_kw(case), block_r=Br, block_c=Bc)
    fwd, bwd = ((pyfa.sim.fa2_forward, pyfa.sim.fa2_backward) if algo == "fa2"
                else (pyfa.sim.fa1_forward, pyfa.sim.fa1_backward))
    stats = (lambda r: (r.lse,)) if algo == "fa2" else (lambda r: (r.m, r.l))
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # (B, N, H, d)

    # flash-attn's layout: outputs come back (B, N, H, d), statistics (B, H, N).
    fb = fwd(t(q), t(k), t(v), layout="bnhd", **kw)
    assert fb.o.shape == t(q).shape and fb.o.flags.c_contiguous
    assert same_bits(fb.o, t(f.o)) and all(same_bits(x, y) for x, y in zip(stats(fb), stats(f)))
    bb = bwd(t(q), t(k), t(v), fb.o, *stats(fb), t(do), layout="bnhd", **kw)
    assert all(same_bits(x, t(y)) for x, y in ((bb.dq, b.dq), (bb.dk, b.dk), (bb.dv, b.dv)))

    # A packed (B, N, H + 2 Hkv, d) QKV, sliced: strided views in layout bnhd.
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if Nq == Nk:
        packed = np.concatenate([t(q), t(k), t(v)], axis=2)
        qp, kp, vp = packed[:, :, :H], packed[:, :, H:H + Hkv], packed[:, :, H + Hkv:]
        fp = fwd(qp, kp, vp, layout="bnhd", **kw)
        assert same_bits(fp.o, fb.o)

    # Strided bhnd views: every other row of a larger array, and a transposed copy.
    big = np.zeros((B, Hkv, 2 * Nk, D), np.float32)
    big[:, :, ::2] = k
    qt = t(q).transpose(0, 2, 1, 3)
    fs = fwd(qt, big[:, :, ::2], v, **kw)
    assert same_bits(fs.o, f.o)
    bs = bwd(qt, big[:, :, ::2], v, fs.o, *stats(fs), do, **kw)
    assert all(same_bits(x, y) for x, y in ((bs.dq, b.dq), (bs.dk, b.dk), (bs.dv, b.dv)))


def test_gqa_equals_repeated_heads_forward_and_summed_gradients():
    # Forward: bit for bit the MHA result on K, V repeated (the head mapping only). The
    # gradients of a group are summed in the kernels' order, so they equal the MHA ones
    # up to rounding.
    case = MASK_CASES[0]
    q, k, v, do = inputs(case, (2, 4, 2))
    kw = dict(mask_kw(case), block_r=4, block_c=8)
    rep = lambda x: np.repeat(x, 2, axis=1)
    for fwd in (pyfa.sim.fa1_forward, pyfa.sim.fa2_forward):
        assert same_bits(fwd(q, k, v, **kw).o, fwd(q, rep(k), rep(v), **kw).o)
    f = pyfa.sim.fa2_forward(q, k, v, **kw)
    g = pyfa.sim.fa2_backward(q, k, v, f.o, f.lse, do, **kw)
    m = pyfa.sim.fa2_backward(q, rep(k), rep(v), f.o, f.lse, do, **kw)
    assert same_bits(g.dq, m.dq)
    assert rel_err(g.dk, m.dk.reshape(2, 2, 2, *k.shape[2:]).sum(axis=2, dtype=np.float64)) < 1e-6


def test_standard_model_takes_masks_gqa_and_layouts():
    case = MASK_CASES[8]
    q, k, v, do = inputs(case, (2, 4, 2))
    r = pyfa.sim.standard_forward(q, k, v, **mask_kw(case))
    o_ref, _ = attention_ref(q, k, v, **mask_kw(case))
    assert rel_err(r.o, o_ref) < 1e-5
    g = pyfa.sim.standard_backward(q, k, v, r.o, r.p, do, **mask_kw(case))
    _, dq_ref, dk_ref, dv_ref = attention_grad_ref(q, k, v, do, **mask_kw(case))
    assert g.dk.shape == k.shape
    for got, ref in ((g.dq, dq_ref), (g.dk, dk_ref), (g.dv, dv_ref)):
        assert rel_err(got, ref) < 1e-4
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    rb = pyfa.sim.standard_forward(t(q), t(k), t(v), layout="bnhd", **mask_kw(case))
    assert np.array_equal(rb.o, t(r.o)) and np.array_equal(rb.lse, r.lse)
    want = pyfa.sim.count_io("standard", passes="both", batch=2, heads=4, heads_kv=2,
                             seqlen_q=q.shape[2], seqlen_k=k.shape[2], head_dim=D)
    assert r.io + g.io == want and want.reads["K"] == 2 * 2 * k.shape[2] * D * 4


# ---- IO: the simulators count what count_io counts, and that is the visited tile pairs

@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "B{}H{}Hkv{}".format(*h))
@pytest.mark.parametrize("case", MASK_CASES, ids=case_id)
@pytest.mark.parametrize("algo", ["fa1", "fa2"])
def test_simulator_io_is_count_io(algo, case, heads):
    f, b = simulated(algo, case, heads)
    B, H, Hkv = heads
    Nq, Nk, Br, Bc = case[:4]
    kw = dict(batch=B, heads=H, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=D,
              block_r=Br, block_c=Bc, **mask_kw(case))
    assert f.io == pyfa.sim.count_io(algo, passes="forward", **kw)
    assert b.io == pyfa.sim.count_io(algo, passes="backward", **kw)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "B{}H{}Hkv{}".format(*h))
@pytest.mark.parametrize("case", MASK_CASES, ids=case_id)
def test_io_follows_the_visited_pairs(case, heads):
    # Counted from the mask matrix: every visited (i, j) costs K_j and V_j in FA2's
    # forward and dQ kernel (per query head), and Q_i, dO_i in FA2's dK/dV kernel and
    # FA1's loops (per query head); K_j, V_j are read once per K/V head by the blocks
    # that serve a group, and only for the K/V tiles some Q tile visits.
    B, H, Hkv = heads
    Nq, Nk, Br, Bc = case[:4]
    hit = brute_bands(~mask_matrix(Nq, Nk, **mask_kw(case)), Br, Bc)
    rows = np.minimum(Br, Nq - np.arange(hit.shape[0]) * Br)
    cols = np.minimum(Bc, Nk - np.arange(hit.shape[1]) * Bc)
    kv_bytes = B * H * int((hit * cols[None, :]).sum()) * D * 4
    q_bytes = B * H * int((hit * rows[:, None]).sum()) * D * 4
    kw = dict(batch=B, heads=H, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=D,
              block_r=Br, block_c=Bc, **mask_kw(case))
    fa2f = pyfa.sim.count_io("fa2", **kw)
    fa2b = pyfa.sim.count_io("fa2", passes="backward", **kw)
    fa1f = pyfa.sim.count_io("fa1", **kw)
    fa1b = pyfa.sim.count_io("fa1", passes="backward", **kw)
    once_q = B * H * Nq * D * 4
    seen = int((hit.any(axis=0) * cols).sum())  # keys in the K/V tiles some Q tile visits
    once_kv = B * Hkv * seen * D * 4
    assert fa2f.reads["K"] == fa2f.reads["V"] == kv_bytes and fa2f.reads["Q"] == once_q
    assert fa2b.reads["K"] == kv_bytes + once_kv
    assert fa2b.reads["Q"] == q_bytes + once_q and fa2b.reads["dO"] == q_bytes + 2 * once_q
    assert fa1f.reads["Q"] == fa1f.reads["O"] == q_bytes
    assert fa1f.reads["K"] == B * H * seen * D * 4
    assert fa1b.reads["Q"] == q_bytes and fa1b.reads["K"] == once_kv
    assert fa1b.writes["dK"] == fa2b.writes["dK"] == B * Hkv * Nk * D * 4
