"""pyfa.torch's custom operators: torch.compile without a graph break and the same bits
as eager, opcheck, the autocast rule, dtypes, vmap, double backward, layout=,
return_lse=, empty sequences, and the eager calls that skip the dispatcher. Runs when
torch imports."""

import math

import numpy as np
import pytest

import pyfa

torch = pytest.importorskip("torch")
import pyfa.torch  # noqa: E402  (needs torch)

KW = dict(backend="cpu")


def leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def op_args(q, k, v, causal=True, layout="bhnd"):
    return (q, k, v, causal, None, None, "bottom_right", None, layout, None, None, "cpu")


@pytest.mark.xdist_group("inductor")
def test_compile_fullgraph_equals_eager_bit_for_bit():
    q, k, v = leaves((2, 4, 12, 8), (2, 2, 15, 8), (2, 2, 15, 8))

    def f(q, k, v):
        o, lse = pyfa.torch.attention(q * 0.5, k, v, causal=True, return_lse=True, **KW)
        return o * 2.0, lse

    eager = f(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    do = torch.randn_like(eager[0])
    ge = torch.autograd.grad(eager[0], (q, k, v), do)
    gc = torch.autograd.grad(compiled[0], (q, k, v), do)
    for a, b in zip(ge, gc):
        assert torch.equal(a, b)


@pytest.mark.xdist_group("inductor")
def test_compile_of_a_module_has_no_graph_break():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(*x.shape[:2], 3, 2, 8).unbind(2)  # (B, N, H, d)
            return pyfa.torch.attention(q, k, v, causal=True, layout="bnhd", **KW).sum()

    torch._dynamo.reset()
    model = Block()
    x = torch.randn(2, 10, 16)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch.compile(model, fullgraph=True)(x).backward()
    assert model.qkv.weight.grad is not None


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_opcheck_forward_and_backward(layout):
    q, k, v = (t.detach() for t in leaves((2, 4, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8)))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    torch.library.opcheck(torch.ops.pyfa.fa2_forward.default, op_args(q, k, v, layout=layout))
    grad_args = op_args(*(t.clone().requires_grad_() for t in (q, k, v)), layout=layout)
    torch.library.opcheck(torch.ops.pyfa.fa2_forward.default, grad_args)
    o, lse = torch.ops.pyfa.fa2_forward(*op_args(q, k, v, layout=layout))
    bwd = op_args(q, k, v, layout=layout)
    torch.library.opcheck(torch.ops.pyfa.fa2_backward.default,
                          bwd[:3] + (o, lse, torch.randn_like(o)) + bwd[3:])


def test_autocast_runs_the_op_in_float32():
    q, k, v = leaves((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = pyfa.torch.attention(*(t.bfloat16() for t in (q, k, v)), **KW)
    assert o.dtype == torch.float32
    want = pyfa.torch.attention(*(t.bfloat16().float() for t in (q, k, v)), **KW)
    assert torch.equal(o, want)
    o.sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()



def test_autocast_gradients_of_a_bias_and_sinks_are_those_of_their_float32_values():
    # Under autocast the backward (run outside it) gets the saved tensors in float32 too.
    q, k, v, bias, sinks = leaves((2, 6, 8), (2, 5, 8), (2, 5, 8), (6, 5), (2,), seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = pyfa.torch.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=bias.bfloat16(),
                                 sinks=sinks.bfloat16(), causal=True, **KW)
    assert o.dtype == torch.float32
    got = torch.autograd.grad(o.square().sum(), (q, k, v, bias, sinks))
    rounded = [t.detach().bfloat16().float().requires_grad_() for t in (q, k, v, bias, sinks)]
    o32 = pyfa.torch.attention(*rounded[:3], bias=rounded[3], sinks=rounded[4], causal=True, **KW)
    assert torch.equal(o, o32)
    want = torch.autograd.grad(o32.square().sum(), rounded)
    for g, w in zip(got, want):
        # Each gradient comes back in its input's dtype (float32 here), autograd's cast of
        # bfloat16's gradient included.
        assert g.dtype == torch.float32 and torch.equal(g, w.bfloat16().float())

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_non_float32_is_one_clear_type_error(dtype):
    q = torch.zeros(2, 4, 8)
    with pytest.raises(TypeError, match=f"k: expected dtype torch.float32, got {dtype}"):
        pyfa.torch.attention(q, q.to(dtype), q, **KW)


def test_float64_under_autocast_is_refused_too():
    # autocast leaves float64 alone, so the op sees it.
    q = torch.zeros(2, 4, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="q: expected dtype torch.float32, got torch.float64"):
            pyfa.torch.attention(q, q, q, **KW)


def test_double_backward_is_refused():
    q, k, v = leaves((2, 6, 8), (2, 6, 8), (2, 6, 8))
    o = pyfa.torch.attention(q, k, v, **KW)
    (gq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        gq.sum().backward()


def test_vmap_folds_the_mapped_axis_into_the_batch():
    q, k, v = (t.detach() for t in leaves((3, 2, 4, 9, 8), (2, 2, 9, 8), (2, 2, 9, 8)))
    mapped = torch.vmap(lambda x: pyfa.torch.attention(x, k, v, causal=True, **KW))(q)
    for i in range(3):
        assert torch.equal(mapped[i], pyfa.torch.attention(q[i], k, v, causal=True, **KW))
    # The backward's own vmap rule, on the operator itself.
    do = torch.randn(3, 2, 4, 9, 8)
    opts = op_args(q, k, v, causal=False)[3:]
    fwd = torch.vmap(lambda x: torch.ops.pyfa.fa2_forward(x, k, v, *opts))(q)
    grads = torch.vmap(lambda x, o, lse, g: torch.ops.pyfa.fa2_backward(x, k, v, o, lse, g, *opts))(
        q, *fwd, do)
    for i in range(3):
        want = pyfa.attention_grad(q[i].numpy(), k.numpy(), v.numpy(), do[i].numpy(), **KW)
        assert np.array_equal(fwd[0][i].numpy(), want[0])
        for got, w in zip(grads, want[1:]):
            assert np.array_equal(got[i].numpy(), w)


@pytest.mark.parametrize("slopes", ["H", "BH", "mapped H", "mapped BH"])
def test_vmap_takes_alibi_slopes_per_head_per_batch_element_or_mapped(slopes):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 2, 5, 8, generator=g) for _ in range(3))
    shape = {"H": (2,), "BH": (2, 2), "mapped H": (3, 2), "mapped BH": (3, 2, 2)}[slopes]
    s = torch.rand(shape, generator=g)
    mapped = slopes.startswith("mapped")
    leaves_ = [t.clone().requires_grad_() for t in (q, k, v)]
    f = lambda a, b, c, sl: pyfa.torch.attention(a, b, c, causal=True, alibi_slopes=sl, **KW)  # noqa: E731
    o = torch.vmap(f, in_dims=(0, 0, 0, 0 if mapped else None))(*leaves_, s)
    o.sum().backward()
    for i in range(3):
        alone = [t[i].clone().requires_grad_() for t in (q, k, v)]
        want = f(*alone, s[i] if mapped else s)
        want.sum().backward()
        assert torch.equal(o[i], want)
        for t, a in zip(leaves_, alone):
            assert torch.equal(t.grad[i], a.grad)


def test_torch_func_transforms_of_the_gradient_are_refused_by_torch():
    # torch's custom-op autograd is not a functorch transform (torch.func.grad, vjp): torch
    # itself refuses; loss.backward() and torch.autograd.grad are the supported ways.
    q, k, v = (t.detach() for t in leaves((2, 6, 8), (2, 6, 8), (2, 6, 8)))
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.grad(lambda x: pyfa.torch.attention(x, k, v, **KW).sum())(q)


def test_bnhd_layout_equals_bhnd_bit_for_bit():
    q, k, v = leaves((2, 4, 12, 8), (2, 2, 12, 8), (2, 2, 12, 8))
    o1, lse1 = pyfa.torch.attention(q, k, v, causal=True, return_lse=True, **KW)
    tq, tk, tv = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    o2, lse2 = pyfa.torch.attention(tq, tk, tv, causal=True, layout="bnhd", return_lse=True, **KW)
    assert o2.shape == (2, 12, 4, 8) and lse2.shape == (2, 4, 12)
    assert torch.equal(o1.transpose(1, 2), o2) and torch.equal(lse1, lse2)
    do = torch.randn_like(o1)
    o1.backward(do)
    o2.backward(do.transpose(1, 2))
    for a, b in zip((q, k, v), (tq, tk, tv)):
        assert torch.equal(a.grad.transpose(1, 2), b.grad)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_lse_and_its_gradient_match_plain_torch(layout):
    q, k, v = leaves((2, 4, 10, 8), (2, 2, 14, 8), (2, 2, 14, 8), seed=3)  # GQA
    w = torch.randn(2, 4, 10)
    args = [t.detach().transpose(1, 2).requires_grad_() if layout == "bnhd" else t for t in (q, k, v)]
    o, lse = pyfa.torch.attention(*args, causal=True, scale=0.4, layout=layout, return_lse=True,
                                  **KW)
    if layout == "bnhd":
        o = o.transpose(1, 2)
    (o.square().sum() + (w * lse).sum()).backward()
    got = [t.grad.transpose(1, 2) if layout == "bnhd" else t.grad.clone() for t in args]
    for t in (q, k, v):
        t.grad = None
    kr, vr = (t.repeat_interleave(2, 1) for t in (k, v))
    s = 0.4 * q @ kr.transpose(-1, -2)
    s = s.masked_fill(torch.ones(10, 14, dtype=torch.bool).triu(14 - 10 + 1), -math.inf)
    want_lse = torch.logsumexp(s, -1)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    ((torch.softmax(s, -1) @ vr).square().sum() + (w * want_lse).sum()).backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)


def test_an_unused_lse_leaves_the_gradients_as_attention_grad():
    q, k, v = leaves((2, 9, 8), (2, 9, 8), (2, 9, 8), seed=4)
    o, _ = pyfa.torch.attention(q, k, v, causal=True, return_lse=True, **KW)
    o.sum().backward()
    want = pyfa.attention_grad(*(t.detach().numpy() for t in (q, k, v)), np.ones((2, 9, 8), np.float32),
                               causal=True, **KW)
    for t, w in zip((q, k, v), want[1:]):
        assert np.array_equal(t.grad.numpy(), w)


def test_empty_sequences_as_sdpa():
    F = torch.nn.functional
    q, k, v = leaves((1, 2, 3, 4), (1, 2, 0, 4), (1, 2, 0, 4))
    o, lse = pyfa.torch.attention(q, k, v, return_lse=True, **KW)
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v)) and not o.any()
    assert lse.shape == (1, 2, 3) and torch.isneginf(lse).all()
    o.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == (1, 2, 0, 4)
    q0 = torch.zeros(1, 2, 0, 4, requires_grad=True)
    o0 = pyfa.torch.attention(q0, torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), **KW)
    assert o0.shape == (1, 2, 0, 4)
    o0.sum().backward()
    assert q0.grad.shape == (1, 2, 0, 4)


def test_no_heads_or_no_batch_is_an_empty_problem_as_in_sdpa():
    F = torch.nn.functional
    for shape in ((1, 0, 3, 4), (0, 2, 3, 4)):
        q = torch.zeros(shape, requires_grad=True)
        o = pyfa.torch.attention(q, q, q, **KW)
        assert o.shape == F.scaled_dot_product_attention(q, q, q).shape == shape
        o.sum().backward()
        assert q.grad.shape == shape
    with pytest.raises(ValueError, match="k: its 0 heads must divide q's 2 heads"):
        pyfa.torch.attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 0, 3, 4), torch.zeros(1, 0, 3, 4), **KW)


def test_empty_problem_checks_the_bias_shape():
    q, k = torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 5, 4)
    for grad in (False, True):
        with pytest.raises(ValueError, match=r"bias: shape \(3, 5, 7, 9\) does not broadcast"):
            pyfa.torch.attention(q, k, k, bias=torch.zeros(3, 5, 7, 9, requires_grad=grad), **KW)
    assert pyfa.torch.attention(q, k, k, bias=torch.zeros(2, 1, 5), **KW).shape == (1, 2, 0, 4)


def test_shape_errors_name_the_argument():
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="k: its 3 heads must divide q's 4 heads"):
        pyfa.torch.attention(q, torch.zeros(1, 3, 0, 8), torch.zeros(1, 3, 0, 8), **KW)
    with pytest.raises(ValueError, match="layout: expected 'bhnd' or 'bnhd'"):
        pyfa.torch.attention(q, q, q, layout="nhd", **KW)
    with pytest.raises(ValueError, match="v: expected 4 dimensions like q"):
        pyfa.torch.attention(q, q, q[0], **KW)


def test_empty_sequences_still_check_every_argument():
    q, k = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 0, 4)
    with pytest.raises(ValueError, match="causal_align: expected 'bottom_right' or 'top_left'"):
        pyfa.torch.attention(q, k, k, causal_align="middle", **KW)
    with pytest.raises(ValueError, match="backend"):
        pyfa.torch.attention(q, k, k, backend="tpu")


def _seen_ops(fn):
    """The operators a TorchDispatchMode sees while fn() runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))
    with Seen() as seen:
        fn()
    return seen.names


@pytest.fixture
def decided(monkeypatch):
    """Each answer of pyfa.torch._plain_eager (True: the operator's body ran directly), in
    call order."""
    answers = []
    plain = pyfa.torch._plain_eager
    monkeypatch.setattr(pyfa.torch, "_plain_eager", lambda inputs: answers.append(plain(inputs)) or answers[-1])
    return answers


@pytest.mark.parametrize("call", ["attention", "bias", "varlen"])
def test_no_grad_eager_calls_skip_the_dispatcher_and_keep_the_operators_bits(call, decided):
    """Without a gradient wanted, plain CPU calls run the operator's body directly
    (_plain_eager) with the operator's bits, while a dispatch mode, which has to see the
    operator, still does."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 4, 9, 16), (2, 2, 11, 16), (2, 2, 11, 16)))
    if call == "varlen":
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        cuk = torch.tensor([0, 5, 11], dtype=torch.int32)
        packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
        run = lambda: pyfa.torch.attention_varlen(*packed, cu, cuk, causal=True, backend="cpu")
        op = "pyfa.fa2_varlen_forward"
    elif call == "bias":
        bias = torch.randn((2, 1, 9, 11), generator=g)
        run = lambda: pyfa.torch.attention(q, k, v, bias=bias, causal=True, **KW)
        op = "pyfa.fa2_forward_bias"
    else:
        run = lambda: pyfa.torch.attention(q, k, v, causal=True, softcap=5.0, **KW)
        op = "pyfa.fa2_forward"
    fast = run()
    assert decided == [True]
    slow = None

    def through_the_dispatcher():
        nonlocal slow
        slow = run()
    names = _seen_ops(through_the_dispatcher)
    assert decided == [True, False] and any(n.startswith(op + ".") for n in names), (decided, names)
    assert torch.equal(fast, slow) and fast.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(run(), fast)


def test_no_grad_under_autocast_vmap_and_the_profiler_still_runs_the_operator(decided):
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        o = pyfa.torch.attention(*(t.bfloat16() for t in (q, k, v)), **KW)  # the body alone refuses bfloat16
    assert o.dtype == torch.float32 and decided == [False]
    assert torch.equal(o, pyfa.torch.attention(*(t.bfloat16().float() for t in (q, k, v)), **KW))
    mapped = torch.vmap(lambda x: pyfa.torch.attention(x, k[0], v[0], **KW))(q)
    assert decided == [False, True, False] and torch.equal(mapped[0], pyfa.torch.attention(q[0], k[0], v[0], **KW))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pyfa.torch.attention(q, k, v, **KW)
    assert any(e.name == "pyfa::fa2_forward" for e in prof.events()), sorted({e.name for e in prof.events()})


@pytest.mark.parametrize("call", ["attention", "bias", "varlen"])
def test_a_plain_backward_runs_the_operators_bodies_with_their_bits(call, decided):
    """The forward inside the autograd.Function and the backward's operators run their
    bodies too (_call_op), with the gradients the operators give under a dispatch mode.
    (A double backward still reaches the operators' rules: test_double_backward_is_refused.)"""
    g = torch.Generator().manual_seed(4)
    shapes = ((1, 4, 7, 8), (1, 2, 10, 8), (1, 2, 10, 8))
    base = [torch.randn(s, generator=g) for s in shapes]
    bias = torch.randn((1, 4, 7, 10), generator=g)

    def grads():
        q, k, v = (x.clone().requires_grad_() for x in base)
        if call == "varlen":
            packed = [t[0].transpose(0, 1) for t in (q, k, v)]
            o, lse = pyfa.torch.attention_varlen(*packed, torch.tensor([0, 3, 7], dtype=torch.int32),
                                                 torch.tensor([0, 4, 10], dtype=torch.int32), causal=True,
                                                 return_lse=True, backend="cpu")
        else:
            o, lse = pyfa.torch.attention(q, k, v, causal=True, return_lse=True,
                                          bias=bias if call == "bias" else None, **KW)
        (o.square().sum() + lse.sum()).backward()
        return q.grad, k.grad, v.grad
    fast = grads()
    assert decided and all(decided), decided
    slow = []
    names = _seen_ops(lambda: slow.extend(grads()))
    backward = {"attention": "pyfa.fa2_backward.", "bias": "pyfa.fa2_backward_bias.",
                "varlen": "pyfa.fa2_varlen_backward."}[call]
    assert any(n.startswith(backward) for n in names), names
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
