"""pyfa.torch with dropout: autograd against a float64 reference that applies
pyfa.dropout_mask explicitly, seeds from torch's generator, and the drop-ins taking
dropout_p. Needs torch (the torch venv); skipped without it."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import pyfa  # noqa: E402
import pyfa.torch as pt  # noqa: E402


def reference(q, k, v, keep, p, causal):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ kr.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:  # bottom-right aligned, as pyfa.torch.attention's default
        Nq, Nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Nq, Nk, dtype=torch.bool).triu(Nk - Nq + 1), -float("inf"))
    o = (torch.softmax(s, -1) * keep / (1 - p)) @ vr
    return o, (q, k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_matches_a_float64_reference_with_the_mask(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 23, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 31, 16, requires_grad=True) for _ in range(2))
    p, seed, offset = 0.25, 2 ** 64 - 3, 2 ** 63 + 1  # beyond int64: passed as two's complement
    o = pt.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, offset=offset, backend="cpu")
    do = torch.randn_like(o)
    o.backward(do)
    keep = torch.from_numpy(pyfa.dropout_mask(2, 4, 23, 31, dropout_p=p, seed=seed, offset=offset))
    o_ref, leaves = reference(q, k, v, keep, float(np.float32(p)), causal)
    o_ref.backward(do.double())
    for got, want in [(o, o_ref)] + [(t.grad, r.grad) for t, r in zip((q, k, v), leaves)]:
        assert (got.double() - want).abs().max() <= 2e-5 * max(1.0, want.abs().max().item())
    # The same bits as pyfa's own call with the same seed and offset.
    same = pyfa.attention(q.detach(), k.detach(), v.detach(), causal=causal, dropout_p=p, seed=seed,
                          offset=offset, options=pyfa.Options(backend="cpu"))
    assert torch.equal(o.detach(), same)


def test_seed_none_follows_torch_manual_seed():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    torch.manual_seed(7)
    a, b = pt.attention(q, k, v, dropout_p=0.5), pt.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    assert torch.equal(pt.attention(q, k, v, dropout_p=0.5), a)
    assert not torch.equal(a, b)  # successive calls drop differently
    assert torch.equal(pt.attention(q, k, v, dropout_p=0.0), pt.attention(q, k, v))


def test_backward_regenerates_the_forward_mask_with_a_drawn_seed():
    q, k, v = (torch.randn(1, 2, 19, 8).requires_grad_() for _ in range(3))
    torch.manual_seed(3)
    o = pt.attention(q, k, v, dropout_p=0.4)
    o.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    torch.manual_seed(3)
    seed = int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64)) % 2 ** 64
    want = pyfa.attention_grad(q.detach(), k.detach(), v.detach(), torch.ones_like(o), dropout_p=0.4, seed=seed)
    assert torch.equal(o.detach(), want[0])
    for g, w in zip(grads, want[1:]):
        assert torch.equal(g, w)


def test_drop_ins_take_dropout_and_refuse_bad_values():
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    torch.manual_seed(1)
    x = pt.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(1)
    assert torch.equal(x, pt.attention(q, k, v, causal_align="top_left", dropout_p=0.2))
    assert not torch.equal(x, pt.scaled_dot_product_attention(q, k, v))
    y = pt.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.2)
    assert y.shape == (1, 12, 2, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        pt.attention(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="dropout_p"):
        pt.scaled_dot_product_attention(q, k, v, dropout_p="0.1")
