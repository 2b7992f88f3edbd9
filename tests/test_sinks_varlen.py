"""Attention sinks in packed sequences and the KV cache (docs/numerics.md, "Attention
sinks"): pyfa.attention_varlen(_grad)(sinks=), pyfa.attention_with_kvcache(sinks=) and
pyfa.torch's attention_varlen(sinks=), flash_attn_varlen_func and flash_attn_with_kvcache
(s_aux=). Each packed row has the bits of its sequence's dense call with sinks, dsinks
sums the packed rows in order, decoding through a dense or paged cache has the bits of
one prefill, and all of it is within float32 rounding of a float64 softmax whose sink is
one more column. Refusals name the argument and write nothing of the caller's."""

import numpy as np
import pytest

import pyfa
from reference import same_bits

H, HKV, D = 4, 2, 8
CPU16 = pyfa.Options(backend="cpu", block_r=16, block_c=16)  # so that split_size=16 splits


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(lq, lk, seed, heads_kv=HKV):
    """q, do (total_q, H, D), k, v (total_k, heads_kv, D), sinks (H,) and the offsets."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    cq, ck = offsets(lq), offsets(lk)
    q, k, v, do = f(cq[-1], H, D), f(ck[-1], heads_kv, D), f(ck[-1], heads_kv, D), f(cq[-1], H, D)
    return q, k, v, do, f(H), cq, ck


def reference(q, k, v, sinks, do, dlse, causal, window):
    """One sequence in float64: (o (Nq, H, d), lse (H, Nq), dq, dk, dv, dsinks) of
    softmax([scale q k^T, masked bottom-right | sinks[h]]) without the sink's column, for
    the incoming gradients do (like o) and dlse (like lse)."""
    (Nq, Hq, d), (Nk, Hk, _) = q.shape, k.shape
    heads = lambda x: np.repeat(x.astype(np.float64).transpose(1, 0, 2), Hq // x.shape[1], 0)  # noqa: E731
    Q, K, V, dO = heads(q), heads(k), heads(v), heads(do)
    i, j = np.arange(Nq)[:, None] + Nk - Nq, np.arange(Nk)[None]
    left, right = window or (None, None)
    right = 0 if causal else right
    seen = np.ones((Nq, Nk), bool)
    if left is not None:
        seen &= j >= i - left
    if right is not None:
        seen &= j <= i + right
    S = np.where(seen, Q @ K.transpose(0, 2, 1) / np.sqrt(d), -np.inf)
    s = sinks.astype(np.float64)[:, None]
    m = np.maximum(S.max(-1, initial=-np.inf), s)
    lse = m + np.log(np.exp(S - m[..., None]).sum(-1) + np.exp(s - m))
    P, p_sink = np.exp(S - lse[..., None]), np.exp(s - lse)
    O = P @ V
    Dr = (dO * O).sum(-1)
    dS = P * (dO @ V.transpose(0, 2, 1) - Dr[..., None] + dlse[..., None])
    group = lambda x: x.reshape(Hk, Hq // Hk, Nk, d).sum(1).transpose(1, 0, 2)  # noqa: E731
    return (O.transpose(1, 0, 2), lse, (dS @ K / np.sqrt(d)).transpose(1, 0, 2),
            group(dS.transpose(0, 2, 1) @ Q / np.sqrt(d)), group(P.transpose(0, 2, 1) @ dO),
            (p_sink * (dlse - Dr)).sum(-1))


def packed_reference(q, k, v, sinks, do, dlse, cq, ck, causal, window):
    """reference() of each sequence, packed again (dsinks summed over them)."""
    parts = [reference(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], sinks, do[cq[b]:cq[b + 1]],
                       dlse[:, cq[b]:cq[b + 1]], causal, window) for b in range(len(cq) - 1)]
    o, lse, dq, dk, dv, ds = zip(*parts)
    return (np.concatenate(o), np.concatenate(lse, 1), np.concatenate(dq), np.concatenate(dk), np.concatenate(dv),
            np.sum(ds, 0))


# Sequence 1 has keys and no queries, sequence 2 queries and no keys (they see the sink only).
LQ, LK = [5, 0, 3, 9, 4], [7, 4, 0, 9, 20]


@pytest.mark.parametrize("causal,window,heads_kv", [
    (False, None, HKV), (True, None, HKV), (False, (3, 1), HKV), (True, (4, None), 1), (True, None, H)])
def test_varlen_sinks_against_float64(causal, window, heads_kv):
    q, k, v, do, s, cq, ck = packed(LQ, LK, seed=1, heads_kv=heads_kv)
    want = packed_reference(q, k, v, s, do, np.zeros((H, cq[-1])), cq, ck, causal, window)
    kw = dict(causal=causal, window=window, sinks=s, options=pyfa.Options(backend="cpu"))
    _, lse = pyfa.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    got = pyfa.attention_varlen_grad(q, k, v, do, cq, ck, **kw)
    assert len(got) == 5
    for name, g, w in zip(("lse", "o", "dq", "dk", "dv", "dsinks"), (lse,) + got, want[1:2] + want[:1] + want[2:]):
        assert np.abs(g - w).max() < 2e-6, name


@pytest.mark.parametrize("split", [None, 16])
@pytest.mark.parametrize("causal,window", [(True, None), (False, (5, 2))])
def test_each_packed_row_has_the_bits_of_its_sequence_alone(split, causal, window):
    lq, lk = [11, 0, 3, 23, 6], [17, 5, 0, 23, 30]
    q, k, v, do, s, cq, ck = packed(lq, lk, seed=2)
    kw = dict(causal=causal, window=window, split_size=split, options=CPU16)
    o, lse = pyfa.attention_varlen(q, k, v, cq, ck, return_lse=True, sinks=s, **kw)
    go, dq, dk, dv, dsinks = pyfa.attention_varlen_grad(q, k, v, do, cq, ck, sinks=s, **kw)
    assert same_bits(go, o)
    merged = []
    for b in range(len(lq)):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = lambda x, r: x[None, r]  # noqa: E731  (the sequence as a dense "bnhd" batch of one)
        args = (one(q, rows), one(k, keys), one(v, keys))
        ob, lb = pyfa.fa2_forward(*args, layout="bnhd", **kw)
        ob, lb = pyfa.merge_sinks(ob, lb, s, "bnhd")
        assert same_bits(o[rows], ob[0]) and same_bits(lse[:, rows], lb[0]), b
        grads = pyfa.attention_grad(*args, one(do, rows), layout="bnhd", sinks=s, **kw)
        assert same_bits(grads[0][0], ob[0]), b
        assert same_bits(dq[rows], grads[1][0]) and same_bits(dk[keys], grads[2][0]), b
        assert same_bits(dv[keys], grads[3][0]), b
        merged.append((ob[0], lb[0]))
    # dsinks: one sum over the packed rows in order, that of sinks_grad on their concatenation.
    o_cat, lse_cat = np.concatenate([m[0] for m in merged]), np.concatenate([m[1] for m in merged], 1)
    assert same_bits(dsinks, pyfa.sinks_grad(o_cat[None], lse_cat[None], do[None], s, layout="bnhd"))


def test_sequences_of_one_length_have_the_bits_of_a_dense_batch():
    # Packed rows in order are the dense batch's b, then i: the same dsinks too.
    q, k, v, do, s, cq, ck = packed([6] * 3, [9] * 3, seed=3)
    dense = lambda x: x.reshape(3, -1, *x.shape[1:])  # noqa: E731
    kw = dict(causal=True, sinks=s, options=pyfa.Options(backend="cpu"))
    got = pyfa.attention_varlen_grad(q, k, v, do, cq, ck, **kw)
    want = pyfa.attention_grad(dense(q), dense(k), dense(v), dense(do), layout="bnhd", **kw)
    assert all(same_bits(g, w.reshape(g.shape)) for g, w in zip(got, want))


def test_minus_inf_sinks_give_the_plain_bits():
    q, k, v, do, s, cq, ck = packed(LQ, LK, seed=4)
    opts = pyfa.Options(backend="cpu")
    none = np.full(H, -np.inf, np.float32)
    plain = pyfa.attention_varlen_grad(q, k, v, do, cq, ck, causal=True, options=opts)
    got = pyfa.attention_varlen_grad(q, k, v, do, cq, ck, causal=True, sinks=none, options=opts)
    assert all(same_bits(g, w) for g, w in zip(got, plain)) and same_bits(got[4], np.zeros(H))
    plain_lse = pyfa.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True, options=opts)[1]
    s[1] = -np.inf  # one head without a sink keeps its bits, the others change
    o, lse = pyfa.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True, sinks=s, options=opts)
    assert same_bits(o[:, 1], plain[0][:, 1]) and same_bits(lse[1], plain_lse[1])
    assert not np.array_equal(o[:, 0], plain[0][:, 0])
    qc, kc = q[None, :5], np.concatenate([k[None, :7], np.full((1, 3, HKV, D), np.nan, np.float32)], 1)
    vc = np.concatenate([v[None, :7], np.full((1, 3, HKV, D), np.nan, np.float32)], 1)
    lens = np.array([7], np.int32)
    assert same_bits(pyfa.attention_with_kvcache(qc, kc, vc, lens, causal=True, sinks=none, options=opts),
                     pyfa.attention_with_kvcache(qc, kc, vc, lens, causal=True, options=opts))


@pytest.mark.parametrize("page_size", [None, 3])
@pytest.mark.parametrize("split", [None, 16])
def test_decoding_through_the_cache_has_the_bits_of_one_prefill(page_size, split):
    N, B = 23, 2
    q, k, v, _, s, cq, _ = packed([N] * B, [N] * B, seed=5)
    o_pre, lse_pre = pyfa.attention_varlen(q, k, v, cq, cq, causal=True, return_lse=True, sinks=s,
                                           split_size=split, options=CPU16)
    tok = lambda x: x.reshape(B, N, *x.shape[1:])  # noqa: E731  (flash-attn's (B, N, heads, d))
    q, k, v, o_pre = tok(q), tok(k), tok(v), tok(o_pre)
    lse_pre = lse_pre.reshape(H, B, N).transpose(1, 0, 2)
    rng = np.random.default_rng(6)
    if page_size is None:
        kc, table = np.full((B, N, HKV, D), np.nan, np.float32), None
    else:
        per_seq = -(-N // page_size)
        kc = np.full((B * per_seq + 2, page_size, HKV, D), np.nan, np.float32)
        table = rng.permutation(len(kc))[:B * per_seq].reshape(B, per_seq).astype(np.int32)
    vc = kc.copy()
    for a, z in [(0, 5)] + [(t, t + 1) for t in range(5, N)]:  # a chunk of 5, then token by token
        o, lse = pyfa.attention_with_kvcache(q[:, a:z], kc, vc, np.full(B, a, np.int32), k[:, a:z], v[:, a:z],
                                             block_table=table, causal=True, split_size=split, return_lse=True,
                                             sinks=s, options=CPU16)
        assert same_bits(o, o_pre[:, a:z]) and same_bits(lse, lse_pre[:, :, a:z]), (a, z)


def test_kvcache_sinks_against_float64():
    # A dense cache: sequence 0 holds 6 keys, 1 none; 3 new rows each.
    rng = np.random.default_rng(7)
    f = lambda *sh: rng.standard_normal(sh, dtype=np.float32)  # noqa: E731
    q, kc, vc, kn, vn, s = f(2, 3, H, D), f(2, 12, HKV, D), f(2, 12, HKV, D), f(2, 3, HKV, D), f(2, 3, HKV, D), f(H)
    lens = np.array([6, 0], np.int32)
    o, lse = pyfa.attention_with_kvcache(q, kc, vc, lens, kn, vn, causal=True, window=(2, None), return_lse=True,
                                         sinks=s)
    for b in range(2):
        n = lens[b] + 3
        want = reference(q[b], kc[b, :n], vc[b, :n], s, np.zeros_like(q[b]), np.zeros((H, 3)), True, (2, None))
        assert np.abs(o[b] - want[0]).max() < 2e-6 and np.abs(lse[b] - want[1]).max() < 2e-6


class FakeCuda:
    """Where pyfa asks, a CUDA array (pyfa refuses it before reading it)."""
    __cuda_array_interface__ = dict(shape=(H,), typestr="<f4", data=(0, False), version=3)


BAD_SINKS = [  # (keywords, exception, message)
    (dict(sinks=np.zeros(H + 1, np.float32)), ValueError, rf"sinks: expected shape \({H},\)"),
    (dict(sinks=np.zeros(H)), TypeError, "sinks: expected a float32 array"),
    (dict(sinks=np.array([0, np.nan, 0, 0], np.float32)), ValueError, "sinks: must be finite or -inf"),
    (dict(sinks=np.array([0, np.inf, 0, 0], np.float32)), ValueError, "sinks: must be finite or -inf"),
    (dict(sinks=FakeCuda()), ValueError, "sinks: on cuda"),
]


@pytest.mark.parametrize("kw,exc,needle", BAD_SINKS + [
    (dict(sinks=np.zeros(H, np.float32), algo="fa1"), ValueError, "sinks: only algo='fa2'")])
def test_varlen_refusals_write_nothing(kw, exc, needle):
    q, k, v, do, _, cq, ck = packed(LQ, LK, seed=8)
    out = np.full_like(q, 7)
    with pytest.raises(exc, match=needle):
        pyfa.attention_varlen(q, k, v, cq, ck, out=out, **kw)
    assert (out == 7).all()
    outs = (np.full_like(q, 7), np.full_like(q, 7), np.full_like(k, 7), np.full_like(v, 7))
    with pytest.raises(exc, match=needle):
        pyfa.attention_varlen_grad(q, k, v, do, cq, ck, out=outs, **kw)
    assert all((x == 7).all() for x in outs)


def test_cuda_sinks_of_a_gradient_are_refused_by_name():
    # The forward takes CUDA sinks; a call that returns dsinks (NumPy's) refuses them
    # before the kernels run.
    cq = FakeCuda()
    with pytest.raises(ValueError, match="sinks: pyfa.attention_varlen_grad computes dsinks on the CPU only"):
        pyfa.attention_varlen_grad(FakeCuda(), FakeCuda(), FakeCuda(), FakeCuda(), cq, cq, sinks=FakeCuda())
    with pytest.raises(ValueError, match="sinks: pyfa.attention_grad computes dsinks on the CPU only"):
        pyfa.attention_grad(FakeCuda(), FakeCuda(), FakeCuda(), FakeCuda(), sinks=FakeCuda())


@pytest.mark.parametrize("page_size", [None, 4])
def test_kvcache_refusals_write_nothing(page_size):
    rng = np.random.default_rng(9)
    f = lambda *sh: rng.standard_normal(sh, dtype=np.float32)  # noqa: E731
    q, kn, vn = f(2, 2, H, D), f(2, 2, HKV, D), f(2, 2, HKV, D)
    kc, table = (f(2, 12, HKV, D), None) if page_size is None else (f(7, 4, HKV, D), np.array([[3, 0, 5], [1, 6, 2]],
                                                                                              np.int32))
    vc, lens = f(*kc.shape), np.array([5, 9], np.int32)
    k0, v0 = kc.copy(), vc.copy()
    for kw, exc, needle in BAD_SINKS:
        with pytest.raises(exc, match=needle):
            pyfa.attention_with_kvcache(q, kc, vc, lens, kn, vn, block_table=table, causal=True, **kw)
        assert same_bits(kc, k0) and same_bits(vc, v0), needle
    with pytest.raises(ValueError, match="sinks: expected shape"):
        pyfa.prepare(pyfa.attention_with_kvcache, q, kc, vc, lens, kn, vn, block_table=table,
                     sinks=np.zeros(H + 1, np.float32))
    assert same_bits(kc, k0) and same_bits(vc, v0) and lens.tolist() == [5, 9]


@pytest.mark.parametrize("page_size", [None, 3])
def test_a_prepared_decoding_step_with_sinks_has_the_bits_of_one_prefill(page_size):
    # pyfa.prepare's replays merge the sinks too, reading them by reference and checking
    # them before anything is appended.
    N, B, split = 19, 2, 16
    q, k, v, _, s, cq, _ = packed([N] * B, [N] * B, seed=11)
    o_pre, lse_pre = pyfa.attention_varlen(q, k, v, cq, cq, causal=True, return_lse=True, sinks=s,
                                           split_size=split, options=CPU16)
    tok = lambda x: x.reshape(B, N, *x.shape[1:])  # noqa: E731
    q, k, v, o_pre = tok(q), tok(k), tok(v), tok(o_pre)
    lse_pre = lse_pre.reshape(H, B, N).transpose(1, 0, 2)
    if page_size is None:
        kc, table = np.full((B, N, HKV, D), np.nan, np.float32), None
    else:
        per_seq = -(-N // page_size)
        kc = np.full((B * per_seq, page_size, HKV, D), np.nan, np.float32)
        table = np.random.default_rng(12).permutation(len(kc)).reshape(B, per_seq).astype(np.int32)
    vc = kc.copy()
    kw = dict(block_table=table, causal=True, split_size=split, return_lse=True, options=CPU16)
    pyfa.attention_with_kvcache(q[:, :5], kc, vc, np.zeros(B, np.int32), k[:, :5], v[:, :5], sinks=s, **kw)
    qt, kt, vt, lens, sinks = q[:, 5:6].copy(), k[:, 5:6].copy(), v[:, 5:6].copy(), np.full(B, 5, np.int32), s.copy()
    step = pyfa.prepare(pyfa.attention_with_kvcache, qt, kc, vc, lens, kt, vt, sinks=sinks, **kw)
    o, lse = step.result
    for t in range(5, N):
        if t > 5:
            lens += 1
            qt[...], kt[...], vt[...] = q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]
            if t == 9:  # a sink that became NaN: refused, nothing appended or written
                sinks[1] = np.nan
                before = [x.copy() for x in (kc, vc, o, lse)]
                with pytest.raises(ValueError, match="sinks: must be finite or -inf"):
                    step()
                assert all(same_bits(x, y) for x, y in zip((kc, vc, o, lse), before))
                sinks[1] = s[1]
            step()
        assert same_bits(o, o_pre[:, t:t + 1]) and same_bits(lse, lse_pre[:, :, t:t + 1]), t


# ---- pyfa.torch

@pytest.mark.parametrize("causal,window", [(True, None), (False, (3, 1))])
def test_torch_attention_varlen_sinks_train_as_float64(causal, window):
    torch = pytest.importorskip("torch")
    import pyfa.torch
    q, k, v, do, s, cq, ck = packed(LQ, LK, seed=11)
    dlse = np.random.default_rng(12).standard_normal((H, cq[-1]), dtype=np.float32)
    want = packed_reference(q, k, v, s, do, dlse, cq, ck, causal, window)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, s)]
    o, lse = pyfa.torch.attention_varlen(*leaves[:3], torch.tensor(cq), torch.tensor(ck), causal=causal,
                                         window=window, return_lse=True, sinks=leaves[3], backend="cpu")
    ((o * torch.tensor(do)).sum() + (lse * torch.tensor(dlse)).sum()).backward()
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), [o, lse] + [t.grad for t in leaves], want):
        assert np.abs(g.detach().numpy() - w).max() < 2e-6, name
    # The bits: pyfa.attention_varlen's and, without an LSE gradient, pyfa.attention_varlen_grad's.
    kw = dict(causal=causal, window=window, sinks=s, options=pyfa.Options(backend="cpu"))
    o_np, lse_np = pyfa.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    assert same_bits(o.detach(), o_np) and same_bits(lse.detach(), lse_np)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, s)]
    pyfa.torch.attention_varlen(*leaves[:3], torch.tensor(cq), torch.tensor(ck), causal=causal, window=window,
                                sinks=leaves[3], backend="cpu").backward(torch.tensor(do))
    got = pyfa.attention_varlen_grad(q, k, v, do, cq, ck, **kw)
    assert all(same_bits(t.grad, g) for t, g in zip(leaves, got[1:]))


def test_torch_attention_varlen_takes_a_bias_with_the_sinks():
    # Both get their gradients; each sequence's bias corner has the bits of its dense call.
    torch = pytest.importorskip("torch")
    import pyfa.torch
    q, k, v, do, s, cq, ck = (torch.tensor(x) for x in packed(LQ, LK, seed=16))
    bias = torch.randn(len(LQ), H, 9, 20, generator=torch.Generator().manual_seed(17), requires_grad=True)
    sinks = s.clone().requires_grad_()
    o, lse = pyfa.torch.attention_varlen(q, k, v, cq, ck, causal=True, bias=bias, sinks=sinks, return_lse=True,
                                         backend="cpu")
    o.backward(do)
    assert same_bits(sinks.grad, pyfa.sinks_grad(o.detach()[None].numpy(), lse.detach()[None].numpy(),
                                                 do[None].numpy(), s.numpy(), layout="bnhd"))
    for b in range(len(LQ)):
        rows, keys = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        corner = bias.detach()[b:b + 1, :, :LQ[b], :LK[b]].clone().requires_grad_()
        ob = pyfa.torch.attention(q[None, rows], k[None, keys], v[None, keys], causal=True, layout="bnhd",
                                  bias=corner, sinks=s, backend="cpu")
        ob.backward(do[None, rows])
        assert torch.equal(o[rows], ob[0].detach()) and torch.equal(bias.grad[b:b + 1, :, :LQ[b], :LK[b]],
                                                                     corner.grad), b


def test_torch_varlen_operator_with_sinks_passes_opcheck():
    torch = pytest.importorskip("torch")
    import pyfa.torch
    q, k, v, _, s, cq, ck = (torch.tensor(x) for x in packed(LQ, LK, seed=13))
    options = (9, 20, True, None, None, "bottom_right", None, 8, 8, "cpu", None, None, 0, 0.0, 0, 0, None)
    q, k, v, s = (t.requires_grad_() for t in (q, k, v, s))
    torch.library.opcheck(torch.ops.pyfa.fa2_varlen_forward.default, (q, k, v, cq, ck, *options, s))


def test_torch_drop_ins_take_vllm_s_aux():
    torch = pytest.importorskip("torch")
    import pyfa.torch
    q, k, v, _, s, cq, ck = packed(LQ, LK, seed=14)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
    opts = pyfa.Options(backend="cpu")
    got = pyfa.torch.flash_attn_varlen_func(t(q), t(k), t(v), t(cq), t(ck), 9, 20, causal=True, s_aux=t(s))
    assert same_bits(got, pyfa.attention_varlen(q, k, v, cq, ck, causal=True, sinks=s, options=opts))
    # Paged: sequence b's keys at rows b * 20 onwards of 3 pages of 8 each.
    kp = np.zeros((len(LK) * 3, 8, HKV, D), np.float32)
    vp = np.zeros_like(kp)
    table = np.arange(len(LK) * 3, dtype=np.int32).reshape(len(LK), 3)
    for b, n in enumerate(LK):
        kp.reshape(len(LK), 24, HKV, D)[b, :n], vp.reshape(len(LK), 24, HKV, D)[b, :n] = k[ck[b]:ck[b + 1]], \
            v[ck[b]:ck[b + 1]]
    paged = pyfa.torch.flash_attn_varlen_func(t(q), t(kp), t(vp), t(cq), t(ck), 9, 20, causal=True,
                                              block_table=t(table), s_aux=t(s))
    assert same_bits(paged, got)
    with pytest.raises(TypeError, match="s_aux: expected dtype torch.float32"):
        pyfa.torch.flash_attn_varlen_func(t(q), t(kp), t(vp), t(cq), t(ck), 9, 20, block_table=t(table),
                                          s_aux=t(s).double())
    # The KV cache, read as it is and appended to.
    rng = np.random.default_rng(15)
    f = lambda *sh: rng.standard_normal(sh, dtype=np.float32)  # noqa: E731
    qd, kc, vc, kn, vn = f(2, 3, H, D), f(2, 12, HKV, D), f(2, 12, HKV, D), f(2, 3, HKV, D), f(2, 3, HKV, D)
    lens = np.array([6, 9], np.int32)
    want = pyfa.attention_with_kvcache(qd, kc, vc, lens, causal=True, sinks=s, options=opts)
    got = pyfa.torch.flash_attn_with_kvcache(t(qd), t(kc), t(vc), cache_seqlens=t(lens), causal=True, s_aux=t(s))
    assert same_bits(got, want)
    kc2, vc2 = kc.copy(), vc.copy()
    want = pyfa.attention_with_kvcache(qd, kc, vc, lens, kn, vn, causal=True, sinks=s, options=opts)
    got = pyfa.torch.flash_attn_with_kvcache(t(qd), t(kc2), t(vc2), t(kn), t(vn), cache_seqlens=t(lens),
                                             causal=True, s_aux=t(s))
    assert same_bits(got, want) and same_bits(kc2, kc)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        pyfa.torch.flash_attn_with_kvcache(t(qd), t(kc2), t(vc2), t(kn), t(vn), cache_seqlens=t(lens),
                                           s_aux=t(s[:3]))
    assert same_bits(kc2, kc) and same_bits(vc2, vc)
