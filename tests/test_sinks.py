"""Attention sinks (gpt-oss's learned sinks): pyfa.merge_sinks, pyfa.sinks_grad and
pyfa.torch.attention(sinks=), against a float64 softmax that has the sink as one more
column, and bit for bit against their written order (docs/numerics.md, "Attention sinks")."""
import numpy as np
import pytest

import pyfa

torch = pytest.importorskip("torch")
import pyfa.torch  # noqa: E402

KW = dict(options=pyfa.Options(backend="cpu"))


def reference(q, k, v, sinks, causal, bias=None):
    """O and LSE of softmax([scale Q K^T + bias | sink]) without the sink's column, in float64:
    q (B, H, Nq, d), k, v (B, Hkv, Nk, d) tensors, sinks (H,)."""
    B, H, Nq, d = q.shape
    g = H // k.shape[1]
    K, V = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    S = q @ K.transpose(-1, -2) / np.sqrt(d)
    if bias is not None:
        S = S + bias
    if causal:
        Nk = K.shape[2]
        S = S.masked_fill(~torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq), -float("inf"))
    C = torch.cat([S, sinks.reshape(1, H, 1, 1).expand(B, H, Nq, 1)], -1)
    return torch.softmax(C, -1)[..., :-1] @ V, torch.logsumexp(C, -1)


def problem(B=2, H=4, Hkv=2, Nq=5, Nk=7, d=8, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f(B, H, Nq, d), f(B, Hkv, Nk, d), f(B, Hkv, Nk, d), f(H)


@pytest.mark.parametrize("causal", [False, True])
def test_merge_sinks_and_sinks_grad_against_float64(causal):
    q, k, v, s = problem(seed=int(causal))
    o, lse = pyfa.fa2_forward(q, k, v, causal=causal, **KW)
    o1, lse1 = pyfa.merge_sinks(o, lse, s)
    Q, K, V, S = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v, s))
    O, L = reference(Q, K, V, S, causal)
    assert np.abs(o1 - O.detach().numpy()).max() < 2e-6 and np.abs(lse1 - L.detach().numpy()).max() < 2e-6
    rng = np.random.default_rng(7)
    do, dlse = rng.standard_normal(o.shape).astype(np.float32), rng.standard_normal(lse.shape).astype(np.float32)
    ((O * torch.tensor(do, dtype=torch.float64)).sum() + (L * torch.tensor(dlse, dtype=torch.float64)).sum()).backward()
    assert np.abs(pyfa.sinks_grad(o1, lse1, do, s, dlse) - S.grad.numpy()).max() < 2e-6
    # The plain backward on the merged state is the gradient of q, k, v (the sink adds no dP).
    dq, dk, dv = pyfa.fa2_backward(q, k, v, o1, lse1, do, causal=causal, **KW)
    assert np.abs(dv - V.grad.numpy()).max() < 2e-6


def test_merge_sinks_is_merge_states_and_sinks_grad_its_written_sum():
    q, k, v, s = problem(seed=3)
    s[1] = -np.inf  # a head without a sink keeps its bits
    o, lse = pyfa.fa2_forward(q, k, v, **KW)
    o1, lse1 = pyfa.merge_sinks(o, lse, s)
    want = pyfa.merge_states([o, np.zeros_like(o)], [lse, np.broadcast_to(s[None, :, None], lse.shape)])
    assert np.array_equal(o1, want[0]) and np.array_equal(lse1, want[1])
    assert np.array_equal(o1[:, 1], o[:, 1]) and np.array_equal(lse1[:, 1], lse[:, 1])
    do = np.random.default_rng(4).standard_normal(o.shape).astype(np.float32)
    D = pyfa.sim.numerics.canonical_nan(pyfa.sim.numerics.dot(do, o1))
    p = pyfa.sim.numerics.exp(s[None, :, None] - lse1)
    for h in range(4):
        acc = np.float32(0)
        for b in range(2):
            for i in range(5):
                acc = np.float32(acc + np.float32(p[b, h, i] * (np.float32(0) - D[b, h, i])))
        assert pyfa.sinks_grad(o1, lse1, do, s)[h] == acc
    # bnhd: the same bits through a transposed layout
    o_t = np.ascontiguousarray(o.transpose(0, 2, 1, 3))
    o2, lse2 = pyfa.merge_sinks(o_t, lse, s, layout="bnhd")
    assert np.array_equal(o2, o1.transpose(0, 2, 1, 3)) and np.array_equal(lse2, lse1)
    assert np.array_equal(pyfa.sinks_grad(o2, lse2, np.ascontiguousarray(do.transpose(0, 2, 1, 3)), s,
                                          layout="bnhd"), pyfa.sinks_grad(o1, lse1, do, s))


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_attention_with_sinks_trains_as_float64(layout, with_bias):
    q, k, v, s = problem(seed=5)
    bias = np.random.default_rng(6).standard_normal((1, 4, 5, 7)).astype(np.float32) if with_bias else None
    move = (lambda x: x) if layout == "bhnd" else (lambda x: x.transpose(1, 2))
    want = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v, s)]
    B64 = None if bias is None else torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    O, L = reference(*want, True, B64)
    rng = np.random.default_rng(8)
    go, gl = (torch.tensor(rng.standard_normal(t.shape), dtype=torch.float64) for t in (O, L))
    ((O * go).sum() + (L * gl).sum()).backward()
    got = [torch.tensor(x, requires_grad=True) for x in (q, k, v, s)]
    b32 = None if bias is None else torch.tensor(bias, requires_grad=True)
    o, lse = pyfa.torch.attention(*(move(t) for t in got[:3]), causal=True, layout=layout, bias=b32,
                                  sinks=got[3], return_lse=True, backend="cpu")
    assert (move(o).double() - O).abs().max() < 2e-6 and (lse.double() - L).abs().max() < 2e-6
    ((move(o) * go.float()).sum() + (lse * gl.float()).sum()).backward()
    for t, w in zip(got + ([b32] if bias is not None else []), want + ([B64] if bias is not None else [])):
        assert (t.grad.double() - w.grad).abs().max() < 4e-6
    # The bits: pyfa.torch's are merge_sinks' of the plain call, and its sinks' gradient sinks_grad's.
    qn, kn, vn = (np.ascontiguousarray(move(torch.tensor(x)).numpy()) for x in (q, k, v))
    o0, lse0 = pyfa.fa2_forward(qn, kn, vn, causal=True, layout=layout, bias=bias, **KW)
    o1, lse1 = pyfa.merge_sinks(o0, lse0, s, layout)
    assert np.array_equal(o.detach().numpy(), o1) and np.array_equal(lse.detach().numpy(), lse1)
    s2 = torch.tensor(s, requires_grad=True)
    o2 = pyfa.torch.attention(*(move(torch.tensor(x)) for x in (q, k, v)), causal=True, layout=layout,
                              bias=None if bias is None else torch.tensor(bias), sinks=s2, backend="cpu")
    do = rng.standard_normal(o2.shape).astype(np.float32)
    o2.backward(torch.tensor(do))
    assert np.array_equal(s2.grad.numpy(), pyfa.sinks_grad(o1, lse1, do, s, layout=layout))


def test_rows_that_see_nothing_attend_to_the_sink_alone():
    q = torch.randn(1, 2, 3, 4)
    s = torch.tensor([0.5, -1.0], requires_grad=True)
    o, lse = pyfa.torch.attention(q, torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4), sinks=s,
                                  return_lse=True, backend="cpu")
    assert not o.any() and torch.equal(lse, s.detach()[None, :, None].expand(1, 2, 3))
    lse.sum().backward()  # d lse / d s = 1 where the sink takes every row's probability
    assert torch.equal(s.grad, torch.tensor([3.0, 3.0]))


def test_sinks_refused_by_name():
    q = torch.zeros(1, 2, 3, 4)
    for sinks, exc, needle in ((torch.zeros(3), ValueError, r"sinks: expected shape \(2,\)"),
                               (torch.zeros(2, dtype=torch.float64), TypeError, "sinks: expected dtype torch.float32"),
                               (np.zeros(2, np.float32), TypeError, "sinks: expected a torch.Tensor"),
                               (torch.tensor([0.0, float("nan")]), ValueError, "sinks: must be finite or -inf")):
        with pytest.raises(exc, match=needle):
            pyfa.torch.attention(q, q, q, sinks=sinks, backend="cpu")
    o, lse = pyfa.fa2_forward(np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 2, 3, 4), np.float32),
                              np.zeros((1, 2, 3, 4), np.float32), **KW)
    with pytest.raises(pyfa.InvalidArgumentError, match=r"lse: expected shape \(1, 2, 3\)"):
        pyfa.merge_sinks(o, lse[:, :, :2], np.zeros(2, np.float32))


def test_sinks_ops_pass_opcheck():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    s = torch.randn(2, requires_grad=True)
    args = (q, k, v, True, None, None, "bottom_right", None, "bhnd", None, None, "cpu", 0.0, 0, 0, None, None, 0, s)
    torch.library.opcheck(torch.ops.pyfa.fa2_forward.default, args)
    o, lse = torch.ops.pyfa.fa2_forward(*args)
    torch.library.opcheck(torch.ops.pyfa.sinks_grad.default, (o.detach(), lse.detach(), torch.randn(1, 2, 4, 8),
                                                             s.detach(), None, "bhnd"))


def test_a_head_without_a_sink_gets_a_zero_gradient_where_rows_see_no_key():
    # -inf is no sink: its gradient is 0, also in rows that see no key (LSE' = -inf there,
    # where exp(-inf - -inf) would be NaN).
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 2, 9, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g)
    for kk, causal in ((k, True), (k[:, :, :0], False)):
        s = torch.tensor([-float("inf"), 0.5], requires_grad=True)
        o, lse = pyfa.torch.attention(q, kk, kk, sinks=s, causal=causal, return_lse=True, backend="cpu")
        (o.sum() + lse.masked_fill(lse.isinf(), 0).sum()).backward()
        assert s.grad[0] == 0 and torch.isfinite(s.grad).all()
    o, lse = np.zeros((1, 1, 2, 4), np.float32), np.full((1, 1, 2), -np.inf, np.float32)
    assert pyfa.sinks_grad(o, lse, np.ones_like(o), np.array([-np.inf], np.float32))[0] == 0


def test_double_backward_through_the_sinks_is_refused_by_pyfa():
    q = torch.randn(1, 2, 4, 8)
    s = torch.randn(2, requires_grad=True)
    (g,) = torch.autograd.grad(pyfa.torch.attention(q, q, q, sinks=s, backend="cpu").sum(), s, create_graph=True)
    with pytest.raises(RuntimeError, match="pyfa::sinks_grad: double backward .* is not supported"):
        g.sum().backward()


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_numpy_attention_and_attention_grad_take_sinks(layout):
    q, k, v, s = problem(seed=11)
    if layout == "bnhd":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    do = np.random.default_rng(12).standard_normal(q.shape).astype(np.float32)
    o0, lse0 = pyfa.fa2_forward(q, k, v, causal=True, layout=layout, **KW)
    o1, lse1 = pyfa.merge_sinks(o0, lse0, s, layout)
    assert np.array_equal(pyfa.attention(q, k, v, causal=True, layout=layout, sinks=s, **KW), o1)
    out = np.empty_like(q)
    assert pyfa.attention(q, k, v, causal=True, layout=layout, sinks=s, out=out, **KW) is out
    assert np.array_equal(out, o1)
    got = pyfa.attention_grad(q, k, v, do, causal=True, layout=layout, sinks=s, **KW)
    want = pyfa.fa2_backward(q, k, v, o1, lse1, do, causal=True, layout=layout, **KW)
    assert len(got) == 5 and np.array_equal(got[0], o1)
    assert all(np.array_equal(a, b) for a, b in zip(got[1:4], want))
    assert np.array_equal(got[4], pyfa.sinks_grad(o1, lse1, do, s, layout=layout))
    # torch CPU tensors through the NumPy API: the same bits, as tensors.
    t = [torch.from_numpy(x) for x in (q, k, v, do, s)]
    tg = pyfa.attention_grad(*t[:4], causal=True, layout=layout, sinks=t[4], **KW)
    assert isinstance(tg[4], torch.Tensor) and np.array_equal(tg[4].numpy(), got[4])


def test_numpy_sinks_refused_before_anything_is_written():
    q = np.zeros((1, 2, 3, 4), np.float32)
    for kw, exc, needle in ((dict(sinks=np.zeros(3, np.float32)), ValueError, r"sinks: expected shape \(2,\)"),
                            (dict(sinks=np.zeros(2)), TypeError, "sinks: expected a float32 array"),
                            (dict(sinks=np.array([np.nan, 0], np.float32)), ValueError, "must be finite or -inf"),
                            (dict(sinks=np.zeros(2, np.float32), algo="fa1"), ValueError, "only algo='fa2'")):
        out = np.full_like(q, 7)
        with pytest.raises(exc, match=needle):
            pyfa.attention(q, q, q, out=out, **kw, **KW)
        assert (out == 7).all()
    with pytest.raises(ValueError, match="sinks: pyfa.attention_grad under pyfa.prepare"):
        pyfa.prepare(pyfa.attention_grad, q, q, q, q, sinks=np.zeros(2, np.float32), **KW)
