"""Packed sequences with a fixed split size (issue 21, parts 1 and 4): pyfa.attention_varlen
and attention_varlen_grad take split_size, and every row of a packed batch keeps the bits
of its own sequence's split dense call, forward and backward, on the emulator, the cpu
backend and the simulator; count_io's split backward (dQ, dK, dV folded per chunk: each
fold writes the output and reads it back) equals the simulator's record, dense and packed;
FA1 refuses a split by name."""

import functools

import numpy as np
import pytest

import pyfa
import pyfa.sim as sim
from reference import same_bits

S = 16  # two 8-row (8-key) tiles per chunk
OPTS = {
    "emu": pyfa.Options(backend="emu", block_r=8, block_c=8, variant="reference"),
    "cpu": pyfa.Options(backend="cpu", block_r=8, block_c=8),
}
SLOPES = np.array([0.25, 0.0625], np.float32)
# (name, keywords): masks, windows, GQA (2 query heads on 1 K/V head) and softcap with ALiBi.
CASES = [
    ("plain", {}),
    ("causal", dict(causal=True)),
    ("causal-top-left", dict(causal=True, causal_align="top_left")),
    ("window", dict(window=(5, 3))),
    ("softcap-alibi", dict(causal=True, softcap=4.0, alibi_slopes=SLOPES)),
]


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@functools.lru_cache(maxsize=None)
def problem(seed):
    """Sequences of random lengths around the chunk size (tails, one longer than three
    chunks), one without queries and one without keys, packed."""
    rng = np.random.default_rng(seed)
    lens_q = np.array([int(rng.integers(1, 40)), 0, int(rng.integers(1, 30)), 51])
    lens_k = np.array([int(rng.integers(1, 40)), int(rng.integers(1, 20)), 0, 37])
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    f = lambda n, h: rng.standard_normal((n, h, 16)).astype(np.float32)
    return cu_q, cu_k, f(cu_q[-1], 2), f(cu_k[-1], 1), f(cu_k[-1], 1), f(cu_q[-1], 2)


def case(name):
    return next(kw for n, kw in CASES if n == name)


@functools.lru_cache(maxsize=None)
def alone(seed, name, backend):
    """Each sequence's own dense split call: [(o, lse, dq, dk, dv)]."""
    cu_q, cu_k, q, k, v, do = problem(seed)
    kw = dict(case(name), layout="bnhd", options=OPTS[backend], split_size=S)
    out = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs, dos = (q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]],
                           do[cu_q[b]:cu_q[b + 1]])
        o, lse = pyfa.fa2_forward(qs, ks, vs, **kw)
        _, dq, dk, dv = pyfa.attention_grad(qs, ks, vs, dos, **kw)
        out.append((o, lse, dq, dk, dv))
    return out


def check_rows(seed, name, backend, o, lse, dq, dk, dv):
    cu_q, cu_k = problem(seed)[:2]
    for b, (ro, rlse, rdq, rdk, rdv) in enumerate(alone(seed, name, backend)):
        qa, qz, ka, kz = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        assert same_bits(o[qa:qz], ro), (b, "o")
        if lse is not None:
            assert same_bits(lse[:, qa:qz], rlse), (b, "lse")
        assert same_bits(dq[qa:qz], rdq), (b, "dq")
        assert same_bits(dk[ka:kz], rdk), (b, "dk")
        assert same_bits(dv[ka:kz], rdv), (b, "dv")


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", [n for n, _ in CASES])
@pytest.mark.parametrize("backend", ["emu", "cpu"])
def test_packed_split_rows_equal_their_sequence_alone(seed, name, backend):
    cu_q, cu_k, q, k, v, do = problem(seed)
    kw = dict(case(name), options=OPTS[backend], split_size=S)
    o, lse = pyfa.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    o2, dq, dk, dv = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, **kw)
    assert same_bits(o2, o)
    check_rows(seed, name, backend, o, lse, dq, dk, dv)
    # The split is not the unsplit computation: some row's bits move (else the test
    # would not tell a split_size that is ignored).
    _, dq0, dk0, dv0 = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, **dict(kw, split_size=None))
    assert not (same_bits(dq0, dq) and same_bits(dk0, dk) and same_bits(dv0, dv))


@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_simulated_packed_split_equals_the_library_and_counts(name):
    """The simulator's packed split forward and backward have the library's bits, and their
    IO records are count_io_varlen's with the same split."""
    seed = 3
    cu_q, cu_k, q, k, v, do = problem(seed)
    kw = dict(case(name), split_size=S)
    f = sim.fa2_forward_varlen(q, k, v, cu_q, cu_k, options=OPTS["emu"], **kw)
    g = sim.fa2_backward_varlen(q, k, v, f.o, f.lse, do, cu_q, cu_k, options=OPTS["emu"], **kw)
    check_rows(seed, name, "emu", f.o, f.lse, g.dq, g.dk, g.dv)
    mask = {n: x for n, x in kw.items() if n in ("causal", "window", "causal_align", "split_size")}
    for passes, record in (("forward", f.io), ("backward", g.io)):
        model = sim.count_io_varlen("fa2", passes=passes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, heads=2,
                                    head_dim=16, heads_kv=1, block_r=8, block_c=8, **mask)
        assert (model.reads, model.writes) == (record.reads, record.writes), passes


@pytest.mark.parametrize("Nq,Nk,split,kw", [
    (45, 70, 16, {}), (70, 45, 32, dict(causal=True)), (64, 64, 16, dict(window=(9, 0))),
    (40, 90, 48, dict(causal=True, causal_align="top_left")), (20, 20, 64, {}),
    (45, 70, 16, dict(causal=True, bias=(4, 45, 70))), (70, 45, 32, dict(bias=(2, 1, 1, 45))),
])
def test_count_io_of_the_split_backward_is_the_simulators(Nq, Nk, split, kw):
    """Dense: every fold's write of dQ (dK, dV) and its read back past a block's first
    fold, and the +0 of a block no chunk reaches, as the simulator records them; a bias's
    reads and dBias's traffic, which the split leaves as they are unsplit."""
    rng = np.random.default_rng(Nq * Nk)
    if "bias" in kw:
        kw = dict(kw, bias=rng.standard_normal(kw["bias"], dtype=np.float32))
    q = rng.standard_normal((2, 4, Nq, 16), dtype=np.float32)
    k = rng.standard_normal((2, 2, Nk, 16), dtype=np.float32)
    v = rng.standard_normal((2, 2, Nk, 16), dtype=np.float32)
    do = rng.standard_normal(q.shape, dtype=np.float32)
    opts = pyfa.Options(block_r=8, block_c=16)
    f = sim.fa2_forward(q, k, v, options=opts, **kw)
    g = sim.fa2_backward(q, k, v, f.o, f.lse, do, split_size=split, options=opts, **kw)
    shapes = {n: (x.shape if n == "bias" else x) for n, x in kw.items()}
    model = sim.count_io("fa2", passes="backward", batch=2, heads=4, heads_kv=2, seqlen_q=Nq, seqlen_k=Nk,
                         head_dim=16, block_r=8, block_c=16, split_size=split, **shapes)
    assert (model.reads, model.writes) == (g.io.reads, g.io.writes)
    unsplit = sim.count_io("fa2", passes="backward", batch=2, heads=4, heads_kv=2, seqlen_q=Nq, seqlen_k=Nk,
                           head_dim=16, block_r=8, block_c=16, **shapes)
    for name in ("Bias", "dBias"):
        assert (model.reads.get(name), model.writes.get(name)) == (unsplit.reads.get(name),
                                                                   unsplit.writes.get(name)), name
    # Without a mask: one chunk where the split covers the keys, else dQ read back.
    if not kw:
        more = model.reads.get("dQ", 0) > unsplit.reads.get("dQ", 0)
        assert more == (split < Nk), (model.reads, unsplit.reads)


def test_split_refusals_name_the_argument():
    cu_q, cu_k, q, k, v, do = problem(1)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.attention_varlen(q, k, v, cu_q, cu_k, algo="fa1", split_size=S)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, algo="fa1", split_size=S)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):  # not a multiple of Bc
        pyfa.attention_varlen(q, k, v, cu_q, cu_k, split_size=12, options=OPTS["cpu"])
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        sim.count_io("fa1", passes="backward", batch=1, heads=1, seqlen_q=8, seqlen_k=8, head_dim=16,
                     split_size=16)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):  # dK/dV's Br = 8 does not divide 12
        sim.count_io("fa2", passes="backward", batch=1, heads=1, seqlen_q=8, seqlen_k=8, head_dim=16,
                     block_r=8, block_c=4, split_size=12)


def test_torch_attention_varlen_split_equals_each_sequence():
    """pyfa.torch.attention_varlen(split_size=): outputs and gradients of every row those of
    pyfa.torch.attention(split_size=) on its sequence alone."""
    torch = pytest.importorskip("torch")
    import pyfa.torch as pt

    cu_q, cu_k, q, k, v, do = problem(2)
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    o = pt.attention_varlen(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), causal=True,
                            split_size=S, block_r=8, block_c=8, backend="cpu")
    o.backward(torch.from_numpy(do))
    for b in range(len(cu_q) - 1):
        qa, qz, ka, kz = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qz == qa or kz == ka:
            continue
        xs = [torch.from_numpy(x[a:z].copy()).requires_grad_() for x, a, z in ((q, qa, qz), (k, ka, kz), (v, ka, kz))]
        ob = pt.attention(*xs, causal=True, split_size=S, layout="bnhd", block_r=8, block_c=8, backend="cpu")
        ob.backward(torch.from_numpy(do[qa:qz]))
        assert same_bits(o.detach()[qa:qz].numpy(), ob.detach().numpy()), b
        for got, ref, (a, z) in ((tq.grad, xs[0].grad, (qa, qz)), (tk.grad, xs[1].grad, (ka, kz)),
                                 (tv.grad, xs[2].grad, (ka, kz))):
            assert same_bits(got[a:z].numpy(), ref.numpy()), b
    with pytest.raises(ValueError, match="split_size"):
        pt.attention_varlen(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), split_size=0)


def test_torch_attention_varlen_split_bias_gradient_equals_each_sequence():
    """pyfa.torch.attention_varlen(split_size=, bias=) with a bias that requires grad: each
    sequence's corner of the bias's gradient has the bits of the dense split call on that
    sequence alone with that corner as its bias, +0 beyond it."""
    torch = pytest.importorskip("torch")
    import pyfa.torch as pt

    cu_q, cu_k, q, k, v, do = problem(1)
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    rng = np.random.default_rng(5)
    bias = torch.from_numpy(rng.standard_normal((len(lq), 2, lq.max(), lk.max()), dtype=np.float32))
    bias.requires_grad_()
    kw = dict(causal=True, split_size=S, block_r=8, block_c=8, backend="cpu")
    o = pt.attention_varlen(*(torch.from_numpy(x) for x in (q, k, v)), torch.from_numpy(cu_q),
                            torch.from_numpy(cu_k), bias=bias, **kw)
    o.backward(torch.from_numpy(do))
    db = bias.grad
    compared = 0
    for b in range(len(lq)):
        assert not db[b, :, lq[b]:, :].any() and not db[b, :, :, lk[b]:].any(), b
        if lq[b] == 0 or lk[b] == 0:
            continue
        qa, qz, ka, kz = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        corner = bias.detach()[b:b + 1, :, :lq[b], :lk[b]].clone().requires_grad_()
        xs = [torch.from_numpy(x[a:z].copy()) for x, a, z in ((q, qa, qz), (k, ka, kz), (v, ka, kz))]
        pt.attention(*xs, layout="bnhd", bias=corner, **kw).backward(torch.from_numpy(do[qa:qz]))
        assert corner.grad.count_nonzero() > 0, b
        assert same_bits(db[b:b + 1, :, :lq[b], :lk[b]].numpy(), corner.grad.numpy()), b
        compared += 1
    assert compared >= 2
