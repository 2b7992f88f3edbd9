"""pyfa.torch.attention: differentiable FA2 (pyfa's custom operators) whose gradients are
pyfa.attention_grad's bit for bit, and which trains. Runs when torch imports."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyfa

torch = pytest.importorskip("torch")
import pyfa.torch  # noqa: E402  (needs torch)

KW = dict(backend="emu", block_r=8, block_c=8)


def bits(t):
    return (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t).view(np.uint32)


def leaves(*arrays, device="cpu"):
    return [torch.from_numpy(a.copy()).to(device).requires_grad_() for a in arrays]


@pytest.mark.parametrize("causal, shape_k", [(False, (2, 3, 20, 8)), (True, (2, 3, 27, 8))])
def test_gradients_equal_attention_grad_bit_for_bit(causal, shape_k):
    rng = np.random.default_rng(11)
    q, do = (rng.standard_normal((2, 3, 20, 8), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal(shape_k, dtype=np.float32) for _ in range(2))
    tq, tk, tv = leaves(q, k, v)
    o = pyfa.torch.attention(tq, tk, tv, causal=causal, scale=0.3, **KW)
    o.backward(torch.from_numpy(do))
    expected = pyfa.attention_grad(q, k, v, do, causal=causal, scale=0.3, **KW)
    for got, want in zip((o, tq.grad, tk.grad, tv.grad), expected):
        assert np.array_equal(bits(got), bits(want))


def test_gradients_match_plain_torch_attention():
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((3, 24, 16), dtype=np.float32) for _ in range(3))  # (H, N, d)
    a = leaves(q, k, v)
    b = leaves(q, k, v)
    pyfa.torch.attention(*a, causal=True, **KW).square().sum().backward()
    s = (b[0] @ b[1].transpose(-1, -2)) / 4.0
    s = s.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(s, -1) @ b[2]).square().sum().backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-5)


def test_only_the_inputs_that_require_grad_get_one():
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((2, 16, 8), dtype=np.float32) for _ in range(3))
    tq = torch.from_numpy(q).requires_grad_()
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    pyfa.torch.attention(tq, tk, tv, **KW).sum().backward()  # an expanded (stride 0) gradient
    assert tq.grad is not None and tk.grad is None and tv.grad is None
    expected = pyfa.attention_grad(q, k, v, np.ones_like(q), **KW)[1]
    assert np.array_equal(bits(tq.grad), bits(expected))


def test_training_a_tiny_model_lowers_its_loss():
    # A one-layer attention model learns a fixed random attention "teacher" (same
    # architecture, plain torch math) by a few steps of SGD on fixed data.
    g = torch.Generator().manual_seed(0)
    B, N, E, H, d = 4, 16, 16, 2, 8

    def projections():
        return [torch.randn(E, H * d, generator=g) / E ** 0.5 for _ in range(3)]

    def heads(x, w):
        return (x @ w).reshape(B, N, H, d).transpose(1, 2).contiguous()

    x = torch.randn(B, N, E, generator=g)
    teacher = projections()
    with torch.no_grad():
        tq, tk, tv = (heads(x, w) for w in teacher)
        target = torch.softmax(tq @ tk.transpose(-1, -2) / d ** 0.5, -1) @ tv
    weights = [w.requires_grad_() for w in projections()]
    opt = torch.optim.SGD(weights, lr=0.5)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        o = pyfa.torch.attention(*(heads(x, w) for w in weights), **KW)
        loss = (o - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.75 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_windows_alignment_and_gqa_equal_attention_grad_bit_for_bit():
    rng = np.random.default_rng(12)
    q, do = (rng.standard_normal((1, 4, 19, 8), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 13, 8), dtype=np.float32) for _ in range(2))
    mask = dict(causal=True, window=(5, None), causal_align="top_left")
    tq, tk, tv = leaves(q, k, v)
    o = pyfa.torch.attention(tq, tk, tv, **mask, **KW)
    o.backward(torch.from_numpy(do))
    expected = pyfa.attention_grad(q, k, v, do, **mask, **KW)
    assert tk.grad.shape == (1, 2, 13, 8)
    for got, want in zip((o, tq.grad, tk.grad, tv.grad), expected):
        assert np.array_equal(bits(got), bits(want))


def test_non_tensors_are_refused():
    with pytest.raises(TypeError, match="k: expected a torch.Tensor, got ndarray"):
        pyfa.torch.attention(torch.zeros(4, 4), np.zeros((4, 4), np.float32), torch.zeros(4, 4))


def test_import_without_torch_says_what_is_missing():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import pyfa.torch\nexcept ImportError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(pyfa.__file__).resolve().parents[1])})
    assert run.returncode == 0, run.stderr
    assert "pyfa.torch needs PyTorch, which is not installed here" in run.stdout


def test_cuda_torch_autograd_equals_attention_grad():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if "cuda" not in pyfa.backends():
        pytest.skip(f"pyfa's CUDA backend cannot run here: {pyfa.unavailable_backends().get('cuda')}")
    rng = np.random.default_rng(14)
    q, k, v, do = (rng.standard_normal((2, 4, 64, 32), dtype=np.float32) for _ in range(4))
    tq, tk, tv = leaves(q, k, v, device="cuda")
    o = pyfa.torch.attention(tq, tk, tv, causal=True)
    o.backward(torch.from_numpy(do).cuda())
    torch.cuda.synchronize()
    for got, want in zip((o, tq.grad, tk.grad, tv.grad),
                         pyfa.attention_grad(q, k, v, do, causal=True, backend="cuda")):
        assert got.is_cuda and np.array_equal(bits(got), bits(want))
