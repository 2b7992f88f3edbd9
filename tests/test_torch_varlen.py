"""pyfa.torch.attention_varlen: the varlen custom operators give, row for row, the bits of
pyfa.torch.attention on each sequence alone, forward, LSE and gradients (the LSE's
included), softcap, a bias and dropout too; torch.compile(fullgraph=True) with max_seqlen given. Runs when
torch imports."""

import pytest

import pyfa

torch = pytest.importorskip("torch")
import pyfa.torch  # noqa: E402  (needs torch)

KW = dict(backend="cpu", block_r=8, block_c=8)


def packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0, 7, 7, 19, 22], dtype=torch.int32)
    ck = torch.tensor([0, 9, 14, 14, 30], dtype=torch.int32)
    q, do = (torch.randn(22, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(30, 2, 8, generator=g) for _ in range(2))
    dlse = torch.randn(4, 22, generator=g)
    return cq, ck, q, k, v, do, dlse


@pytest.mark.parametrize("causal,softcap", [(False, None), (True, None), (True, 1.5)])
def test_attention_varlen_equals_each_sequence_alone(causal, softcap):
    cq, ck, q, k, v, do, dlse = packed()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = pyfa.torch.attention_varlen(*leaves, cq, ck, causal=causal, return_lse=True, softcap=softcap, **KW)
    grads = torch.autograd.grad((o * do).sum() + (torch.where(torch.isinf(lse), 0, lse) * dlse).sum(), leaves)
    for b in range(len(cq) - 1):
        qa, qz, ka, kz = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qz == qa:
            continue
        alone = [t.clone().requires_grad_() for t in (q[qa:qz], k[ka:kz], v[ka:kz])]
        ob, lb = pyfa.torch.attention(*alone, causal=causal, layout="bnhd", return_lse=True, softcap=softcap, **KW)
        assert torch.equal(o[qa:qz], ob) and torch.equal(lse[:, qa:qz], lb)
        if kz == ka:
            continue
        loss = (ob * do[qa:qz]).sum() + (torch.where(torch.isinf(lb), 0, lb) * dlse[:, qa:qz]).sum()
        gb = torch.autograd.grad(loss, alone)
        assert torch.equal(grads[0][qa:qz], gb[0])
        # dK, dV of a sequence's keys come from its own queries only.
        assert torch.equal(grads[1][ka:kz], gb[1]) and torch.equal(grads[2][ka:kz], gb[2])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", [True, False])
def test_attention_varlen_bias_equals_each_sequence_alone(causal, rows):
    """A (B, H, max_seqlen_q or 1, max_seqlen_k) bias: each sequence's forward, LSE and
    gradients (the bias's corner of dbias, +0 beyond it) are those of pyfa.torch.attention
    on the sequence alone with its corner."""
    cq, ck, q, k, v, do, dlse = packed(2)
    mq, mk = 12, 16
    bias = torch.randn(4, 4, mq if rows else 1, mk, generator=torch.Generator().manual_seed(5))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    o, lse = pyfa.torch.attention_varlen(*leaves[:3], cq, ck, causal=causal, return_lse=True, bias=leaves[3], **KW)
    grads = torch.autograd.grad((o * do).sum() + (torch.where(torch.isinf(lse), 0, lse) * dlse).sum(), leaves)
    rest = grads[3].clone()
    for b in range(len(cq) - 1):
        qa, qz, ka, kz = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        nq, nk = qz - qa, kz - ka
        if nq == 0 or nk == 0:
            continue
        corner = bias[b:b + 1, :, :nq if rows else 1, :nk]
        alone = [t.clone().requires_grad_() for t in (q[qa:qz], k[ka:kz], v[ka:kz], corner)]
        ob, lb = pyfa.torch.attention(*alone[:3], causal=causal, layout="bnhd", return_lse=True, bias=alone[3], **KW)
        assert torch.equal(o[qa:qz], ob) and torch.equal(lse[:, qa:qz], lb)
        loss = (ob * do[qa:qz]).sum() + (torch.where(torch.isinf(lb), 0, lb) * dlse[:, qa:qz]).sum()
        gb = torch.autograd.grad(loss, alone)
        assert torch.equal(grads[0][qa:qz], gb[0])
        assert torch.equal(grads[1][ka:kz], gb[1]) and torch.equal(grads[2][ka:kz], gb[2])
        assert torch.equal(grads[3][b:b + 1, :, :corner.shape[2], :nk], gb[3])
        rest[b, :, :corner.shape[2], :nk] = 0
    # Sequences 1 (no queries) and the keys past each sequence's own: +0, every bit.
    assert torch.equal(rest.view(torch.int32), torch.zeros_like(rest).view(torch.int32))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen_dropout_is_the_dense_batch_element_of_each_sequence(causal):
    """Sequence b drops as batch element b of a dense call (pyfa.attention_varlen's
    convention): forward, LSE (that of P undropped) and gradients, the LSE's included,
    equal those of element b of a dense batch holding copies of the sequence."""
    cq, ck, q, k, v, do, dlse = packed(4)
    drop = dict(dropout_p=0.3, seed=11, offset=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = pyfa.torch.attention_varlen(*leaves, cq, ck, causal=causal, return_lse=True, **drop, **KW)
    grads = torch.autograd.grad((o * do).sum() + (torch.where(torch.isinf(lse), 0, lse) * dlse).sum(), leaves)
    undropped = pyfa.torch.attention_varlen(q, k, v, cq, ck, causal=causal, **KW)
    assert not torch.equal(o, undropped)
    B = len(cq) - 1
    for b in range(B):
        qa, qz, ka, kz = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qz == qa or kz == ka:
            continue
        dense = [t[a:z].unsqueeze(0).repeat(B, 1, 1, 1).requires_grad_() for t, a, z in
                 ((q, qa, qz), (k, ka, kz), (v, ka, kz))]
        ob, lb = pyfa.torch.attention(*dense, causal=causal, layout="bnhd", return_lse=True, **drop, **KW)
        assert torch.equal(o[qa:qz], ob[b]) and torch.equal(lse[:, qa:qz], lb[b])
        loss = (ob[b] * do[qa:qz]).sum() + (torch.where(torch.isinf(lb[b]), 0, lb[b]) * dlse[:, qa:qz]).sum()
        gb = torch.autograd.grad(loss, dense)
        assert torch.equal(grads[0][qa:qz], gb[0][b])
        assert torch.equal(grads[1][ka:kz], gb[1][b]) and torch.equal(grads[2][ka:kz], gb[2][b])


def test_varlen_dropout_seed_none_follows_torch_manual_seed():
    cq, ck, q, k, v, _, _ = packed(5)
    torch.manual_seed(3)
    first = pyfa.torch.attention_varlen(q, k, v, cq, ck, dropout_p=0.5, **KW)
    second = pyfa.torch.attention_varlen(q, k, v, cq, ck, dropout_p=0.5, **KW)
    torch.manual_seed(3)
    assert torch.equal(pyfa.torch.attention_varlen(q, k, v, cq, ck, dropout_p=0.5, **KW), first)
    assert not torch.equal(first, second)
    torch.manual_seed(3)
    flash = pyfa.torch.flash_attn_varlen_func(q, k, v, cq, ck, 12, 16, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(flash, pyfa.torch.attention_varlen(q, k, v, cq, ck, dropout_p=0.5))
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        pyfa.torch.attention_varlen(q, k, v, cq, ck, dropout_p=1.0, seed=1)


@pytest.mark.xdist_group("inductor")
def test_attention_varlen_compiles_without_a_graph_break():
    cq, ck, q, k, v, do, _ = packed(1)

    def f(q, k, v):
        return pyfa.torch.attention_varlen(q, k, v, cq, ck, max_seqlen_q=12, max_seqlen_k=16, causal=True, **KW)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


def test_attention_varlen_under_autocast_has_the_gradients_of_its_float32_values():
    # The offsets stay int32; the floating-point tensors saved for the backward are cast.
    cq, ck, q, k, v, do, _ = packed(seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bias = torch.randn(4, 4, 12, 16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = pyfa.torch.attention_varlen(*(t.bfloat16() for t in leaves), cq, ck, causal=True,
                                        bias=bias.bfloat16(), **KW)
    assert o.dtype == torch.float32
    got = torch.autograd.grad(o, leaves + [bias], do)
    rounded = [t.detach().bfloat16().float().requires_grad_() for t in leaves + [bias]]
    o32 = pyfa.torch.attention_varlen(*rounded[:3], cq, ck, causal=True, bias=rounded[3], **KW)
    assert torch.equal(o, o32)
    for g, w in zip(got, torch.autograd.grad(o32, rounded, do)):
        assert g.dtype == torch.float32 and torch.equal(g, w.bfloat16().float())

def test_attention_varlen_refuses_int64_offsets():
    cq, ck, q, k, v, _, _ = packed()
    with pytest.raises(TypeError, match="cu_seqlens_k: expected dtype torch.int32"):
        pyfa.torch.attention_varlen(q, k, v, cq, ck.long())


def test_flash_attn_varlen_func_passes_softcap_and_alibi():
    cq, ck, q, k, v, _, _ = packed(1)
    slopes = torch.rand(4, 4, generator=torch.Generator().manual_seed(2))  # (B, H): one row per sequence
    got = pyfa.torch.flash_attn_varlen_func(q, k, v, cq, ck, 12, 16, causal=True, softcap=1.5, alibi_slopes=slopes)
    want = pyfa.torch.attention_varlen(q, k, v, cq, ck, causal=True, softcap=1.5, alibi_slopes=slopes)
    assert torch.equal(got, want)
    assert not torch.equal(got, pyfa.torch.attention_varlen(q, k, v, cq, ck, causal=True, softcap=1.5))
    # Sequence 3 (queries 19..21, keys 14..29) alone, with its row of slopes.
    alone = pyfa.torch.attention(q[19:22], k[14:30], v[14:30], causal=True, softcap=1.5, layout="bnhd",
                                 alibi_slopes=slopes[3])
    assert torch.equal(got[19:22], alone)


@pytest.mark.parametrize("with_bias,dropout_p", [(False, 0.0), (True, 0.0), (True, 0.25)])
def test_varlen_operators_pass_opcheck_and_refuse_double_backward(with_bias, dropout_p):
    cq, ck, q, k, v, do, _ = packed(3)
    bias = torch.randn(4, 4, 12, 16) if with_bias else None
    options = (12, 16, True, None, None, "bottom_right", None, 8, 8, "cpu", None, None, 0, dropout_p, 7, 0, bias)
    torch.library.opcheck(torch.ops.pyfa.fa2_varlen_forward.default, (q, k, v, cq, ck, *options))
    o, lse = torch.ops.pyfa.fa2_varlen_forward(q, k, v, cq, ck, *options)
    torch.library.opcheck(torch.ops.pyfa.fa2_varlen_backward.default, (q, k, v, o, lse, do, cq, ck, *options))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = pyfa.torch.attention_varlen(*leaves, cq, ck, causal=True, bias=bias, **KW)
    dq, = torch.autograd.grad((out * do).sum(), leaves[:1], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()
