"""pyfa.torch.attention_varlen: the varlen custom operators give, row for row, the bits of
pyfa.torch.attention on each sequence alone, forward, LSE and gradients (the LSE's
included), softcap too; torch.compile(fullgraph=True) with max_seqlen given. Runs when
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


def test_attention_varlen_compiles_without_a_graph_break():
    cq, ck, q, k, v, do, _ = packed(1)

    def f(q, k, v):
        return pyfa.torch.attention_varlen(q, k, v, cq, ck, max_seqlen_q=12, max_seqlen_k=16, causal=True, **KW)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


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
