"""The unfused standard-attention model (pyfa/sim/standard.py): its bytes equal hand-derived
closed forms pass by pass, the simulator counts what count_io counts, and its float32
values are close to float64 attention and its gradients."""

import itertools

import numpy as np
import pytest

import pyfa
from reference import attention_ref, causal_mask, make_inputs, rel_err

sim = pyfa.sim

SHAPES = [(1, 1, 1), (4, 4, 4), (37, 53, 16), (70, 40, 8), (128, 128, 64), (1024, 1024, 64),
          (2048, 512, 128)]
PASS_COMBOS = list(itertools.product([False, True], repeat=3))  # (scale, mask, dropout)


def closed_form(Nq, Nk, d, scale=False, mask=False, dropout=False):
    """Elements read and written per tensor for one head, derived by hand from the step
    lists in the docstrings of forward_steps / backward_steps."""
    NN, sc, mk, dr = Nq * Nk, int(scale), int(mask), int(dropout)
    fwd_reads = {"Q": Nq * d, "K": Nk * d, "V": Nk * d,
                 "S": NN * (1 + sc + mk),    # softmax, and each scale/mask pass
                 "P": NN,                    # P V, or the dropout pass
                 "P_drop": NN * dr}          # P_drop V
    fwd_writes = {"S": NN * (1 + sc + mk), "P": NN, "P_drop": NN * dr, "O": Nq * d}
    bwd_reads = {"P": NN * (2 - dr),         # softmax's backward, and dV unless dropout
                 "P_drop": NN * dr,          # dV = P_drop^T dO
                 "dO": 2 * Nq * d, "V": Nk * d, "K": Nk * d, "Q": Nq * d,
                 "dP": NN * (1 + dr),        # softmax's backward, and the dropout pass
                 "dS": NN * (2 + sc + mk)}   # dQ, dK, and each scale/mask pass
    bwd_writes = {"dV": Nk * d, "dP": NN * (1 + dr), "dS": NN * (1 + sc + mk),
                  "dQ": Nq * d, "dK": Nk * d}
    return (fwd_reads, fwd_writes), (bwd_reads, bwd_writes)


def scaled(elements, factor):
    return {k: v * factor for k, v in elements.items() if v}


def nonzero(d):
    return {k: v for k, v in d.items() if v}


@pytest.mark.parametrize("scale,mask,dropout", PASS_COMBOS)
@pytest.mark.parametrize("Nq,Nk,d", SHAPES)
@pytest.mark.parametrize("e", [2, 4])
def test_each_pass_matches_its_closed_form(Nq, Nk, d, scale, mask, dropout, e):
    B, H = 2, 3
    (fr, fw), (br, bw) = closed_form(Nq, Nk, d, scale, mask, dropout)
    kw = dict(batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d, dtype_bytes=e,
              scale_pass=scale, mask_pass=mask, dropout_pass=dropout)
    fwd = sim.count_standard_io(passes="forward", **kw)
    bwd = sim.count_standard_io(passes="backward", **kw)
    both = sim.count_standard_io(passes="both", **kw)
    f = e * B * H
    assert nonzero(fwd.reads) == scaled(fr, f) and nonzero(fwd.writes) == scaled(fw, f)
    assert nonzero(bwd.reads) == scaled(br, f) and nonzero(bwd.writes) == scaled(bw, f)
    assert both == fwd + bwd
    # The totals in closed form: every optional pass adds 2 N^2 per direction.
    n = scale + mask + dropout
    assert fwd.total == f * (2 * (Nq + Nk) * d + Nq * Nk * (4 + 2 * n))
    assert bwd.total == f * (4 * (Nq + Nk) * d + Nq * Nk * (7 + 2 * n))


@pytest.mark.parametrize("Nq,Nk,d", SHAPES)
def test_count_io_registers_the_standard_model(Nq, Nk, d):
    kw = dict(batch=2, heads=2, seqlen_q=Nq, seqlen_k=Nk, head_dim=d)
    for passes in ("forward", "backward", "both"):
        via_count_io = sim.count_io("standard", passes=passes, **kw)
        assert via_count_io == sim.count_standard_io(passes=passes, **kw)
        # No tiles and no causal skipping: an unfused framework moves the full matrices.
        assert sim.count_io("standard", passes=passes, causal=True, block_r=7, block_c=3,
                            **kw) == via_count_io


def test_the_paper_io_table_arithmetic():
    # GPT-2 medium, fp16, Algorithms 0 + 3 with no extra pass: 11 N^2 + 12 N d elements
    # per head.
    io = sim.count_io("standard", passes="both", batch=64, heads=16, seqlen_q=1024,
                      seqlen_k=1024, head_dim=64, dtype_bytes=2)
    assert io.total == 2 * 64 * 16 * (11 * 1024 * 1024 + 12 * 1024 * 64)


@pytest.mark.parametrize("scale,mask,dropout", PASS_COMBOS)
@pytest.mark.parametrize("causal", [False, True])
def test_simulator_counts_what_count_io_counts(causal, scale, mask, dropout):
    B, H, Nq, Nk, d = 2, 3, 37, 53, 16
    q, k, v, do = make_inputs((B, H, Nq, d), (B, H, Nk, d), 3, "do")
    opts = dict(scale_pass=scale, mask_pass=mask, dropout_pass=dropout)
    fwd = sim.standard_forward(q, k, v, causal=causal, **opts)
    bwd = sim.standard_backward(q, k, v, fwd.o, fwd.p, do, causal=causal, **opts)
    kw = dict(batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d, causal=causal, **opts)
    assert fwd.io == sim.count_standard_io(passes="forward", **kw)
    assert bwd.io == sim.count_standard_io(passes="backward", **kw)
    # The passes move bytes only: the model's dropout rate is 0.
    plain = sim.standard_forward(q, k, v, causal=causal)
    assert np.array_equal(plain.o, fwd.o)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q,shape_k", [((2, 3, 37, 16), (2, 3, 53, 16)),
                                             ((1, 2, 64, 32), (1, 2, 64, 32)),
                                             ((1, 1, 70, 8), (1, 1, 40, 8)),
                                             ((33, 64), (17, 64))])
def test_forward_is_close_to_float64(shape_q, shape_k, causal):
    q, k, v = make_inputs(shape_q, shape_k, 5)
    r = sim.standard_forward(q, k, v, causal=causal)
    o_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    assert r.o.dtype == np.float32 and r.o.shape == q.shape
    assert r.p.shape == q.shape[:-1] + (k.shape[-2],)
    assert rel_err(r.o, o_ref) < 1e-5
    finite = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(r.lse), finite)
    assert np.abs(r.lse[finite] - lse_ref[finite]).max() < 1e-5
    # Rows of P sum to 1, or are all 0 for a query that sees no key.
    sums = r.p.astype(np.float64).sum(-1)
    assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0))
    if causal:
        assert np.all(r.p[..., causal_mask(q.shape[-2], k.shape[-2])] == 0)


def test_rows_without_keys_get_zero_and_minus_inf():
    q, k, v = make_inputs((1, 1, 8, 4), (1, 1, 3, 4), 9)
    r = sim.standard_forward(q, k, v, causal=True)  # rows 0..4 see no key
    assert np.all(r.o[0, 0, :5] == 0) and np.all(r.lse[0, 0, :5] == -np.inf)
    assert np.all(np.isfinite(r.o))


def grads_ref(q, k, v, do, causal, scale=None):
    """dQ, dK, dV in float64 through D = rowsum(dO * O), the FlashAttention form (a
    different route than the model's rowsum(dP * P))."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.swapaxes(-1, -2) * scale
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isinf(m), 0, m))
    l = p.sum(-1, keepdims=True)
    p = np.where(l > 0, p / np.where(l > 0, l, 1), 0)
    o = p @ v
    D = (do * o).sum(-1, keepdims=True)
    ds = p * (do @ v.swapaxes(-1, -2) - D)
    return scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ do


def test_reference_gradients_are_gradients():
    # Central differences of L = sum(O * dO) in float64 check grads_ref itself.
    q, k, v, do = (x.astype(np.float64) for x in make_inputs((1, 1, 5, 3), (1, 1, 4, 3), 2, "do"))
    loss = lambda q, k, v: (attention_ref(q, k, v, causal=True)[0] * do).sum()
    dq, dk, dv = grads_ref(q, k, v, do, causal=True)
    h = 1e-6
    for x, g, which in ((q, dq, 0), (k, dk, 1), (v, dv, 2)):
        for idx in np.ndindex(x.shape):
            plus, minus = [t.copy() for t in (q, k, v)], [t.copy() for t in (q, k, v)]
            plus[which][idx] += h
            minus[which][idx] -= h
            num = (loss(*plus) - loss(*minus)) / (2 * h)
            assert abs(num - g[idx]) < 1e-6


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q,shape_k", [((2, 3, 37, 16), (2, 3, 53, 16)),
                                             ((1, 1, 70, 8), (1, 1, 40, 8)),
                                             ((33, 64), (17, 64))])
def test_backward_is_close_to_float64(shape_q, shape_k, causal):
    q, k, v, do = make_inputs(shape_q, shape_k, 7, "do")
    fwd = sim.standard_forward(q, k, v, causal=causal)
    r = sim.standard_backward(q, k, v, fwd.o, fwd.p, do, causal=causal)
    dq, dk, dv = grads_ref(q, k, v, do, causal)
    for got, ref in ((r.dq, dq), (r.dk, dk), (r.dv, dv)):
        assert got.dtype == np.float32 and got.shape == ref.shape
        assert rel_err(got, ref) < 1e-5


def test_bad_arguments_are_named():
    q, k, v, do = make_inputs((1, 1, 4, 4), (1, 1, 4, 4), 1, "do")
    fwd = sim.standard_forward(q, k, v)
    with pytest.raises(ValueError, match="^p: "):
        sim.standard_backward(q, k, v, fwd.o, fwd.p[..., :3], do)
    with pytest.raises(TypeError, match="q"):
        sim.standard_forward(q.astype(np.float64), k, v)
    with pytest.raises(ValueError, match="passes"):
        sim.count_standard_io(passes="sideways", batch=1, heads=1, seqlen_q=1, seqlen_k=1,
                              head_dim=1)
    with pytest.raises(ValueError, match="head_dim"):
        sim.count_standard_io(batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=0)
