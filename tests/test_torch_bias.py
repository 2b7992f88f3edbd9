"""pyfa.torch with an additive bias (issue 27): gradients for q, k, v and the bias within
2x PyTorch fp32's error against float64, an expanded bias's gradient reaching the tensor
it was expanded from, SDPA's attn_mask (bool and float), torch.compile's tracing."""

import math

import pytest

torch = pytest.importorskip("torch")
import pyfa.torch  # noqa: E402

B, H, HKV, NQ, NK, D = 2, 2, 1, 9, 11, 8


def inputs(bias_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, NQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, NK, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, NK, D, generator=g, dtype=torch.float64)
    bias = torch.randn(bias_shape, generator=g, dtype=torch.float64)
    bias[..., 2] = -math.inf  # key 2 hidden from every row by the bias
    return q, k, v, bias


def math_attention(q, k, v, bias, causal):
    """PyTorch's attention written out (top-left causal), in the inputs' dtype."""
    k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
    if causal:
        s = s.masked_fill(torch.ones(NQ, NK, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def grads(fn, tensors, weight):
    xs = [t.detach().clone().requires_grad_() for t in tensors]
    (fn(*xs) * weight).sum().backward()
    return [x.grad.double() for x in xs]


@pytest.mark.parametrize("bias_shape", [(NQ, NK), (B, 1, NQ, NK), (1, H, 1, NK)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_against_float64(bias_shape, causal):
    q, k, v, bias = inputs(bias_shape)
    weight = torch.randn(B, H, NQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads(lambda *x: math_attention(*x, causal), (q, k, v, bias), weight)
    f32 = [t.float() for t in (q, k, v, bias)]
    torch32 = grads(lambda *x: math_attention(*x, causal), f32, weight.float())
    got = grads(lambda q, k, v, b: pyfa.torch.attention(q, k, v, bias=b, causal=causal, causal_align="top_left",
                                                       backend="cpu"), f32, weight.float())
    for name, g, t, w in zip(("q", "k", "v", "bias"), got, torch32, want):
        assert g.shape == w.shape, name
        assert torch.isfinite(g).all(), name
        err, ref = (g - w).abs().max().item(), (t - w).abs().max().item()
        assert err <= 2 * ref + 1e-6, (name, err, ref)



def test_bias_with_alibi_and_dropout_against_float64():
    # The modifications together, written out in float64: ALiBi (top-left: off = 0), the
    # bias, the causal mask, then dropout's keep mask (pyfa.dropout_mask) in P V.
    q, k, v, bias = inputs((B, 1, NQ, NK), seed=3)
    p, seed = 0.25, 1234
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64)
    keep = torch.from_numpy(pyfa.dropout_mask(B, H, NQ, NK, dropout_p=p, seed=seed))
    i, j = torch.arange(NQ)[:, None], torch.arange(NK)[None, :]

    def written_out(q, k, v, b):
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        s = s - slopes.to(s.dtype)[:, None, None] * (i - j).abs() + b
        s = s.masked_fill(j > i, -math.inf)
        return (torch.softmax(s, -1) * keep / (1 - p)) @ v

    weight = torch.randn(B, H, NQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = grads(written_out, (q, k, v, bias), weight)
    f32 = [t.float() for t in (q, k, v, bias)]
    torch32 = grads(written_out, f32, weight.float())
    kw = dict(causal=True, causal_align="top_left", alibi_slopes=slopes.float(), dropout_p=p, seed=seed)
    got = grads(lambda q, k, v, b: pyfa.torch.attention(q, k, v, bias=b, backend="cpu", **kw), f32, weight.float())
    for name, g, t, w in zip(("q", "k", "v", "bias"), got, torch32, want):
        assert torch.isfinite(g).all(), name
        err, ref = (g - w).abs().max().item(), (t - w).abs().max().item()
        assert err <= 2 * ref + 1e-6, (name, err, ref)


@pytest.mark.parametrize("bias_shape", [(B, 1, NQ, NK), (1, H, 1, NK)], ids=lambda s: "x".join(map(str, s)))
def test_bias_with_softcap_against_float64(bias_shape):
    # softcap, then the bias, then the causal mask, written out in float64: the bias's
    # gradient is that of the score after softcap, q's and k's go on through tanh. O and
    # LSE both weigh in (LSE's gradient takes its own backward call).
    q, k, v, bias = inputs(bias_shape, seed=4)
    q, k = 2 * q, 2 * k  # scores in softcap's non-linear range
    c = 2.0

    def written_out(q, k, v, b):
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        s = c * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(D) / c) + b
        s = s.masked_fill(torch.ones(NQ, NK, dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(B, H, NQ, D, dtype=torch.float64, generator=g)
    w_lse = torch.randn(B, H, NQ, dtype=torch.float64, generator=g)

    def loss_grads(fn, tensors, dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in tensors]
        o, lse = fn(*xs)
        ((o * weight.to(dtype)).sum() + (lse * w_lse.to(dtype)).sum()).backward()
        return [x.grad.double() for x in xs], o

    want, _ = loss_grads(written_out, (q, k, v, bias), torch.float64)
    torch32, _ = loss_grads(written_out, (q, k, v, bias), torch.float32)
    kw = dict(causal=True, causal_align="top_left", softcap=c, backend="cpu")
    got, o = loss_grads(lambda q, k, v, b: pyfa.torch.attention(q, k, v, bias=b, return_lse=True, **kw),
                        (q, k, v, bias), torch.float32)
    f32 = [t.float() for t in (q, k, v, bias)]
    want_o = pyfa.attention(*(t.numpy() for t in f32[:3]), bias=f32[3].numpy(), causal=True, causal_align="top_left",
                            softcap=c)
    assert torch.equal(o.detach(), torch.from_numpy(want_o))
    for name, a, t, w in zip(("q", "k", "v", "bias"), got, torch32, want):
        assert a.shape == w.shape, name
        assert torch.isfinite(a).all(), name
        err, ref = (a - w).abs().max().item(), (t - w).abs().max().item()
        assert err <= 2 * ref + 1e-6, (name, err, ref)


def test_expanded_bias_gradient_reaches_its_source():
    q, k, v, _ = inputs((NK,))
    q, k, v = (t.float() for t in (q, k, v))
    source = torch.randn(1, 1, 1, NK).requires_grad_()
    pyfa.torch.attention(q, k, v, bias=source.expand(B, H, NQ, NK), backend="cpu").sum().backward()
    other = source.detach().clone().requires_grad_()
    pyfa.torch.attention(q, k, v, bias=other, backend="cpu").sum().backward()
    assert torch.equal(source.grad, other.grad)
    leaf = source.detach().expand(B, H, NQ, NK).requires_grad_()
    pyfa.torch.attention(q, k, v, bias=leaf, backend="cpu").sum().backward()
    assert leaf.grad.shape == (B, H, NQ, NK)
    assert torch.allclose(leaf.grad.sum((0, 1, 2), keepdim=True), source.grad, atol=1e-5)


def test_sdpa_attn_mask():
    q, k, v, _ = inputs((NK,))
    q, k, v = (t.float() for t in (q, k, v))
    k, v = k.expand(B, H, NK, D), v.expand(B, H, NK, D)
    mask = torch.rand(B, 1, NQ, NK, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True  # every row attends to some key
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    got = pyfa.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (got.double() - want).abs().max().item() < 1e-5
    fmask = torch.randn(NQ, NK).requires_grad_()
    pyfa.torch.scaled_dot_product_attention(q, k, v, attn_mask=fmask).sum().backward()
    ref = fmask.detach().double().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=ref).sum().backward()
    assert (fmask.grad.double() - ref.grad).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="attn_mask: given with is_causal=True"):
        pyfa.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with pytest.raises(TypeError, match="attn_mask: expected dtype torch.bool or torch.float32"):
        pyfa.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(torch.int8))


@pytest.mark.xdist_group("inductor")
def test_compile_traces_the_bias_ops():
    q, k, v, bias = (t.float() for t in inputs((NQ, NK)))
    bias = bias.requires_grad_()
    fn = torch.compile(lambda q, k, v, b: pyfa.torch.attention(q, k, v, bias=b), fullgraph=True, backend="eager")
    out = fn(q, k, v, bias)
    out.sum().backward()
    assert torch.equal(out, pyfa.torch.attention(q, k, v, bias=bias.detach()))
    assert bias.grad.shape == (NQ, NK)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_vmap_over_a_bias_runs_each_slice_as_its_own_call():
    # No vmap rule of their own: PyTorch's fallback runs the bias operators slice by slice.
    q, k, v, bias = (t.float() for t in inputs((NQ, NK)))
    qs = torch.stack([q, q.flip(-1), 2 * q])
    got = torch.vmap(lambda x: pyfa.torch.attention(x, k, v, bias=bias, causal=True))(qs)
    for i in range(3):
        assert torch.equal(got[i], pyfa.torch.attention(qs[i], k, v, bias=bias, causal=True))
