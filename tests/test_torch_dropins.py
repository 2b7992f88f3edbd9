"""pyfa.torch's drop-ins: scaled_dot_product_attention against torch's over its argument
grid, flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache against plain
torch math with flash-attn's conventions, and every refusal naming its argument."""

import math

import pytest

torch = pytest.importorskip("torch")
import pyfa.torch  # noqa: E402  (needs torch)

F = torch.nn.functional


def tensors(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def reference(q, k, v, visible, scale=None):
    """softmax(scale q k^T) v over (..., H, Nq, d) and (..., H, Nk, d) with a (Nq, Nk)
    bool mask; rows that see nothing give 0. Also LSE (-inf for those rows)."""
    s = (scale if scale is not None else q.shape[-1] ** -0.5) * q @ k.transpose(-1, -2)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(13, 13), (7, 19), (19, 7)])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_equals_torch_sdpa(is_causal, nq, nk, heads_kv, scale):
    q, k, v = tensors((2, 4, nq, 16), (2, heads_kv, nk, 16), (2, heads_kv, nk, 16))
    kw = dict(is_causal=is_causal, scale=scale, enable_gqa=heads_kv != 4)
    got = pyfa.torch.scaled_dot_product_attention(q, k, v, **kw)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    close(got, want)
    for a, b in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        close(a, b)


@pytest.mark.parametrize("shape", [(9, 8), (3, 9, 8), (2, 3, 2, 9, 8)])
def test_sdpa_takes_torch_sdpa_ranks(shape):
    q, k, v = tensors(shape, shape, shape)
    close(pyfa.torch.scaled_dot_product_attention(q, k, v, is_causal=True),
          F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("shape", [(2, 1, 7, 1), (7, 1), (1, 4, 1, 1)])
def test_sdpa_takes_a_mask_broadcast_over_the_keys_as_torch(shape):
    # One value per query row (or per head): PyTorch broadcasts the key axis as any other.
    # Such a mask shifts a row's scores alike, so its exact gradient is 0 (both give ~1e-6).
    q, k, v = tensors((2, 4, 7, 16), (2, 4, 9, 16), (2, 4, 9, 16))
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(3)).requires_grad_()
    got = pyfa.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    close(got, want)
    g, w = grads(got, (q, k, v, mask)), grads(want, (q, k, v, mask))
    for a, b in zip(g[:3], w[:3]):
        close(a, b)
    assert g[3].shape == mask.shape and g[3].abs().max() < 1e-4
    keep = torch.ones(7, 1, dtype=torch.bool)
    close(pyfa.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep),
          F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_sdpa_takes_an_autocast_dtype_mask_under_autocast():
    q, k, v = tensors((1, 4, 5, 16), (1, 4, 6, 16), (1, 4, 6, 16))
    mask = torch.randn(5, 6).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pyfa.torch.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask)
    assert got.dtype == torch.float32
    want = pyfa.torch.scaled_dot_product_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                                                   attn_mask=mask.float())
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="attn_mask: expected dtype"):  # outside autocast, as torch
        pyfa.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_sdpa_refuses_what_it_cannot_honour():
    q = torch.zeros(1, 4, 5, 8)
    sdpa = pyfa.torch.scaled_dot_product_attention
    for nq in (5, 0):  # torch refuses the first and answers the empty one unchecked
        with pytest.raises(ValueError, match=r"attn_mask: shape \(3, 5, 7, 9\) does not broadcast"):
            sdpa(q[:, :, :nq], q, q, attn_mask=torch.zeros(3, 5, 7, 9))
    with pytest.raises(ValueError, match="attn_mask: given with is_causal=True"):
        sdpa(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        sdpa(q, q, q, dropout_p=1.5)
    kv = torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="key: 2 heads differ from query's 4; pass enable_gqa=True"):
        sdpa(q, kv, kv)
    kv3 = torch.zeros(1, 3, 5, 8)
    with pytest.raises(ValueError, match="key: its 3 heads must divide query's 4"):
        sdpa(q, kv3, kv3, enable_gqa=True)
    with pytest.raises(ValueError, match="value: head dim 4 differs from key's 8"):
        sdpa(q, q, torch.zeros(1, 4, 5, 4))
    with pytest.raises(TypeError, match="is_causal: expected a bool"):
        sdpa(q, q, q, is_causal=1)


def test_sdpa_empty_keys_as_torch():
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 0, 4), (1, 2, 0, 4))
    assert torch.equal(pyfa.torch.scaled_dot_product_attention(q, k, v),
                       F.scaled_dot_product_attention(q, k, v))


def flash_visible(nq, nk, causal, window):
    """flash-attn's mask: bottom-right diagonal, window (left, right) with -1 unbounded."""
    i = torch.arange(nq)[:, None] + nk - nq
    j = torch.arange(nk)[None, :]
    left, right = window
    right = 0 if causal else right
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2)),
                                            (True, (4, -1))])
@pytest.mark.parametrize("nq, nk", [(11, 11), (6, 14), (14, 6)])
def test_flash_attn_func_equals_flash_attn_semantics(causal, window, nq, nk):
    q, k, v = tensors((2, nq, 4, 8), (2, nk, 2, 8), (2, nk, 2, 8))
    out, lse, probs = pyfa.torch.flash_attn_func(q, k, v, softmax_scale=0.5, causal=causal,
                                                 window_size=window, return_attn_probs=True)
    assert probs is None and out.shape == (2, nq, 4, 8) and lse.shape == (2, 4, nq)
    rep = [t.transpose(1, 2).repeat_interleave(2, 1) for t in (k, v)]
    want, want_lse = reference(q.transpose(1, 2), *rep, flash_visible(nq, nk, causal, window), 0.5)
    close(out, want.transpose(1, 2))
    # flash-attn's LSE of a row that sees no key is +inf.
    close(lse, torch.where(torch.isneginf(want_lse), math.inf, want_lse))
    assert torch.equal(pyfa.torch.flash_attn_func(q, k, v, softmax_scale=0.5, causal=causal,
                                                  window_size=window), out)
    for a, b in zip(grads(out, (q, k, v)), grads(want.transpose(1, 2), (q, k, v))):
        close(a, b)


def test_flash_attn_func_refuses_what_it_cannot_honour():
    q = torch.zeros(1, 5, 2, 8)
    fa = pyfa.torch.flash_attn_func
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        fa(q, q, q, dropout_p=-0.1)
    with pytest.raises(ValueError, match="softcap: must be finite and > 0"):
        fa(q, q, q, softcap=-30.0)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \("):
        fa(q, q, q, alibi_slopes=torch.zeros(q.shape[2] + 1))
    with pytest.raises(ValueError, match="window_size: left side must be an int >= 0, or -1"):
        fa(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"q: expected shape \(B, N, H, d\)"):
        fa(q[0], q[0], q[0])


def test_flash_attn_varlen_func_equals_each_sequence_alone():
    lens_q, lens_k = [3, 0, 5, 4], [6, 2, 5, 0]
    cq = torch.tensor([0, 3, 3, 8, 12], dtype=torch.int32)
    ck = torch.tensor([0, 6, 8, 13, 13], dtype=torch.int32)
    q, k, v = tensors((12, 4, 8), (13, 2, 8), (13, 2, 8))
    out, lse, _ = pyfa.torch.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, causal=True,
                                                    return_attn_probs=True)
    assert out.shape == (12, 4, 8) and lse.shape == (4, 12)
    wants = []
    for (q0, q1), (k0, k1) in zip(zip(cq.tolist(), cq.tolist()[1:]), zip(ck.tolist(), ck.tolist()[1:])):
        rep = [t[k0:k1].transpose(0, 1).repeat_interleave(2, 0) for t in (k, v)]
        o, l_ = reference(q[q0:q1].transpose(0, 1), *rep, flash_visible(q1 - q0, k1 - k0, True, (-1, -1)))
        wants.append((o.transpose(0, 1), l_))
    want = torch.cat([w[0] for w in wants])
    want_lse = torch.cat([w[1] for w in wants], 1)
    close(out, want)
    close(lse, torch.where(torch.isneginf(want_lse), math.inf, want_lse))
    for a, b in zip(grads(out, (q, k, v)), grads(want, (q, k, v))):
        close(a, b)


def test_flash_attn_varlen_func_checks_the_offsets():
    q = torch.zeros(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    varlen = pyfa.torch.flash_attn_varlen_func
    with pytest.raises(ValueError, match=r"max_seqlen_q: 3 is below the longest sequence \(4 rows\)"):
        varlen(q, q, q, cu, cu, 3, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[2\]: 2 is below the offset before it \(4\)"):
        varlen(q, q, q, cu, torch.tensor([0, 4, 2], dtype=torch.int32), 4, 4)
    with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype torch.int32"):
        varlen(q, q, q, cu.long(), cu, 4, 4)
    with pytest.raises(ValueError, match=r"k: expected shape \(num_pages, page_size, Hkv, d\) \(block_table"):
        varlen(q, q, q, cu, cu, 4, 4, block_table=torch.zeros(2, 1, dtype=torch.int32))


def test_flash_attn_varlen_func_reads_pages_through_the_block_table():
    """flash-attn's paged varlen call: the bits of the same keys packed, row for row, the
    LSE too; no gradient (refused where one would be recorded), no dropout."""
    g = torch.Generator().manual_seed(4)
    lens_q, lens_k, page, H, Hkv, d = [3, 0, 6], [7, 2, 11], 3, 4, 2, 8
    cq = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    ck = torch.tensor([0, 7, 9, 20], dtype=torch.int32)
    q = torch.randn(9, H, d, generator=g)
    k, v = (torch.randn(20, Hkv, d, generator=g) for _ in range(2))
    table = torch.randperm(14, generator=g)[:12].reshape(3, 4).to(torch.int32)
    pages = [torch.full((14, page, Hkv, d), math.nan) for _ in range(2)]
    for b in range(3):
        for n in range(lens_k[b]):
            for dense, paged in zip((k, v), pages):
                paged[table[b, n // page], n % page] = dense[int(ck[b]) + n]
    varlen = pyfa.torch.flash_attn_varlen_func
    for causal in (False, True):
        got = varlen(q, *pages, cq, ck, 6, 11, causal=causal, return_attn_probs=True, block_table=table)
        want = varlen(q, k, v, cq, ck, 6, 11, causal=causal, return_attn_probs=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="block_table: paged K/V has no backward in pyfa"):
        varlen(q.clone().requires_grad_(), *pages, cq, ck, 6, 11, block_table=table)
    with torch.no_grad():
        assert torch.equal(varlen(q.clone().requires_grad_(), *pages, cq, ck, 6, 11, block_table=table),
                           varlen(q, k, v, cq, ck, 6, 11))
    with pytest.raises(ValueError, match="dropout_p: not taken with block_table"):
        varlen(q, *pages, cq, ck, 6, 11, dropout_p=0.1, block_table=table)
    with pytest.raises(ValueError, match="block_table: flash_attn_varlen_func with a block_table is pyfa's on CPU"):
        varlen(q, *pages, cq, ck, 6, 11, block_table=table.to("meta"))


def test_flash_attn_with_kvcache_honours_cache_seqlens():
    q, kc, vc = (t.detach() for t in tensors((3, 2, 4, 8), (3, 10, 2, 8), (3, 10, 2, 8)))
    lengths = torch.tensor([10, 4, 7], dtype=torch.int32)
    out, lse = pyfa.torch.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True,
                                                  return_softmax_lse=True)
    for b, n in enumerate(lengths.tolist()):
        want = pyfa.torch.flash_attn_func(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n],
                                          causal=True, return_attn_probs=True)
        assert torch.equal(out[b:b + 1], want[0]) and torch.equal(lse[b:b + 1], want[1])
    same = pyfa.torch.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=6)
    assert torch.equal(same, pyfa.torch.flash_attn_func(q, kc[:, :6], vc[:, :6]))
    # Lengths that differ: CPU tensors run one packed call, with each batch element's bits;
    # a grad-requiring q still runs the per-element calls, differentiable.
    slopes = torch.rand(3, 4) * 0.3
    sinks = torch.randn(4)
    kw = dict(causal=True, softcap=5.0, alibi_slopes=slopes, window_size=(3, 0), s_aux=sinks)
    packed = pyfa.torch.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, **kw)
    qg = q.clone().requires_grad_()
    per = pyfa.torch.flash_attn_with_kvcache(qg, kc, vc, cache_seqlens=lengths, **kw)
    assert torch.equal(packed, per.detach())
    per.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()



def test_flash_attn_with_kvcache_appends_in_place_and_reads_pages():
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, d, N = 2, 4, 2, 16, 11
    q = torch.randn(B, 3, H, d, generator=g)
    k_all, v_all = (torch.randn(B, N, Hkv, d, generator=g) for _ in range(2))
    lengths = torch.tensor([5, 8], dtype=torch.int32)  # keys cached before the 3 new ones
    kc, vc = torch.zeros(B, 16, Hkv, d), torch.zeros(B, 16, Hkv, d)
    for b, n in enumerate(lengths.tolist()):
        kc[b, :n], vc[b, :n] = k_all[b, :n], v_all[b, :n]
    k_new = torch.stack([k_all[b, n:n + 3] for b, n in enumerate(lengths.tolist())])
    v_new = torch.stack([v_all[b, n:n + 3] for b, n in enumerate(lengths.tolist())])
    out, lse = pyfa.torch.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lengths,
                                                   causal=True, return_softmax_lse=True)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(kc[b, :n + 3], k_all[b, :n + 3]) and torch.equal(vc[b, :n + 3], v_all[b, :n + 3])
        assert not kc[b, n + 3:].any()  # nothing written past the new rows
        want = pyfa.torch.flash_attn_func(q[b:b + 1], k_all[b:b + 1, :n + 3], v_all[b:b + 1, :n + 3],
                                          causal=True, return_attn_probs=True)
        assert torch.equal(out[b:b + 1], want[0]) and torch.equal(lse[b:b + 1], want[1])
    # The same cache as shuffled pages of 3 rows: the same bits.
    pages = torch.zeros(12, 3, Hkv, d), torch.zeros(12, 3, Hkv, d)
    table = torch.randperm(12, generator=g).reshape(B, 6).to(torch.int32)
    for b in range(B):
        for n in range(16):
            for cache, paged in zip((kc, vc), pages):
                paged[table[b, n // 3], n % 3] = cache[b, n]
    paged_out = pyfa.torch.flash_attn_with_kvcache(q, *pages, cache_seqlens=lengths + 3, causal=True,
                                                   block_table=table)
    assert torch.equal(paged_out, out)

def test_flash_attn_with_kvcache_refuses_what_it_cannot_honour():
    q, kc = torch.zeros(1, 1, 2, 8), torch.zeros(1, 4, 2, 8)
    kv = pyfa.torch.flash_attn_with_kvcache
    with pytest.raises(ValueError, match="num_splits: pyfa splits the keys by a fixed size"):
        kv(q, kc, kc, num_splits=2)
    with pytest.raises(ValueError, match="rotary_cos: .*is pyfa's on CPU tensors only"):
        kv(q, kc.clone(), kc.clone(), k=torch.zeros(1, 1, 2, 8), v=torch.zeros(1, 1, 2, 8), cache_seqlens=1,
           rotary_cos=torch.zeros(4, 4, device="meta"), rotary_sin=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="k: appending to the cache, a block_table, cache_batch_idx, "
                                         "cache_leftpad or the rotary embedding is pyfa's on CPU"):
        kv(q, kc.clone(), kc.clone(), k=torch.zeros(1, 1, 2, 8, device="meta"),
           v=torch.zeros(1, 1, 2, 8), cache_seqlens=1)
    with pytest.raises(ValueError, match="cache_seqlens: required with k, v or block_table"):
        kv(q, kc.clone(), kc.clone(), k=torch.zeros(1, 1, 2, 8), v=torch.zeros(1, 1, 2, 8))
    with pytest.raises(ValueError, match=r"cache_seqlens: each length must be in \[0, 4\]"):
        kv(q, kc, kc, cache_seqlens=5)


@pytest.mark.xdist_group("inductor")
@pytest.mark.parametrize("dropin", ["sdpa", "flash"])
def test_dropins_compile_fullgraph_to_eager_bits(dropin):
    def f(q, k, v):
        if dropin == "sdpa":
            return (pyfa.torch.scaled_dot_product_attention(q, k, v, is_causal=True),)
        return pyfa.torch.flash_attn_func(q, k, v, causal=True, window_size=(3, -1),
                                          return_attn_probs=True)[:2]

    q, k, v = (t.detach() for t in tensors((2, 4, 9, 8), (2, 4, 9, 8), (2, 4, 9, 8)))
    torch._dynamo.reset()
    for a, b in zip(f(q, k, v), torch.compile(f, fullgraph=True)(q, k, v)):
        assert torch.equal(a, b)
