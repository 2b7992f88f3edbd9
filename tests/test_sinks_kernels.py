"""Attention sinks inside the FA2 forward (pyfa.h's tensors->sinks): every kernel, backend
and the simulator merge each row's final state with its head's sink, bit for bit the
merge of the plain forward's (o, lse) by pyfa.merge_sinks, split or not, packed or not
(docs/numerics.md, "Attention sinks"). No torch here: these run in every CI."""
import numpy as np
import pytest

import pyfa
from test_run import config, lib, problem, run, tensors

rng = np.random.default_rng(2026)


def arrays(B, H, Hkv, Nq, Nk, d):
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    sinks = (2 * f(H)).astype(np.float32)
    sinks[1] = -np.inf  # a head without a sink keeps its bits
    sinks[-1] = 30.0    # a sink that outweighs every key
    return f(B, H, Nq, d), f(B, Hkv, Nk, d), f(B, Hkv, Nk, d), sinks


SHAPES = {  # (B, H, Hkv, Nq, Nk, d)
    "prefill": (2, 4, 2, 70, 75, 64),
    "decode": (2, 8, 2, 1, 200, 64),  # one row per head: the FA2 forward packs the GQA group
}
# (backend, variant, threads, shape, split_size); the fast FA2 forward neither splits nor
# packs GQA groups (select_kernel), so it runs the unsplit prefill (and below).
RUNS = [(backend, "reference" if backend == "emu" else "auto", threads, shape, split)
        for backend, threads in (("emu", 0), ("cpu", 1), ("cpu", 3))
        for shape in sorted(SHAPES) for split in (None, 64)] + [("emu", "fast", 0, "prefill", None)]


@pytest.mark.parametrize("backend,variant,threads,shape,split_size", RUNS)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_sinks_are_the_merge_and_the_simulator(backend, variant, threads, shape, split_size, causal):
    q, k, v, s = arrays(*SHAPES[shape])
    # The emulator in strict mode: the epilogue reads back other threads' writes of O and
    # LSE, so its barriers are checked too.
    opts = pyfa.Options(backend=backend, variant=variant, threads=threads,
                        emu_check="strict" if backend == "emu" else "off",
                        **({"block_r": 64, "block_c": 64} if variant == "fast" else {}))
    kw = dict(causal=causal, split_size=split_size, options=opts)
    o, lse = pyfa.fa2_forward(q, k, v, **kw)
    want = pyfa.merge_sinks(o, lse, s)
    got = pyfa.fa2_forward(q, k, v, sinks=s, **kw)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    sim = pyfa.sim.fa2_forward(q, k, v, causal=causal, split_size=split_size, sinks=s,
                               options=pyfa.Options(block_r=opts.block_r, block_c=opts.block_c))
    assert np.array_equal(sim.o, got[0]) and np.array_equal(sim.lse, got[1])
    # The sinks changed the rows of every head but the one without (and a causal prefill's
    # rows are not all masked).
    changed = (got[1] != lse).any(axis=(0, 2))
    assert not changed[1] and changed[[0, 2, -1]].all()


@pytest.mark.parametrize("backend", ["emu", "cpu"])
def test_packed_rows_with_no_key_get_the_sink(backend):
    # Sequence 1 has no keys, sequence 2 no queries: rows that see nothing get O = 0 and
    # LSE = the sink, and every row equals its own sequence's dense call with sinks.
    H, Hkv, d = 4, 2, 32
    lq, lk = [5, 3, 0, 6], [7, 0, 4, 9]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], H, d), dtype=np.float32)
    k = rng.standard_normal((ck[-1], Hkv, d), dtype=np.float32)
    v = rng.standard_normal((ck[-1], Hkv, d), dtype=np.float32)
    s = np.array([0.5, -np.inf, 3.0, -2.0], np.float32)
    opts = pyfa.Options(backend=backend, threads=2)
    o, lse = pyfa.attention_varlen(q, k, v, cq, ck, causal=True, sinks=s, return_lse=True, options=opts)
    assert np.array_equal(o[cq[1]:cq[2]], np.zeros((3, H, d), np.float32))
    assert np.array_equal(lse[:, cq[1]:cq[2]], np.repeat(s[:, None], 3, axis=1))
    sim = pyfa.sim.attention_varlen(q, k, v, cq, ck, causal=True, sinks=s)
    assert np.array_equal(sim.o, o) and np.array_equal(sim.lse, lse)
    for b in range(len(lq)):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ob, lb = pyfa.fa2_forward(q[None, rows], k[None, keys], v[None, keys], causal=True, sinks=s,
                                  layout="bnhd", options=opts)
        assert np.array_equal(ob[0], o[rows]) and np.array_equal(lb[0], lse[:, rows])


@pytest.mark.parametrize("d,block_r", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_the_fast_fa2_forward_merges_the_sinks_as_the_readable_one(d, block_r):
    # Every instantiation of the fast kernel (d, Br), rows past the last tile's end
    # included (Nq = 150), in strict mode; without sinks its bits are unchanged.
    q, k, v, s = arrays(2, 4, 2, 150, 170, d)
    tiles = dict(backend="emu", block_r=block_r, block_c=64)
    for sinks in (s, None):
        fast = pyfa.fa2_forward(q, k, v, causal=True, sinks=sinks,
                                options=pyfa.Options(variant="fast", emu_check="strict", **tiles))
        ref = pyfa.fa2_forward(q, k, v, causal=True, sinks=sinks, options=pyfa.Options(variant="reference", **tiles))
        assert np.array_equal(fast[0], ref[0]) and np.array_equal(fast[1], ref[1])


def test_prepared_attention_reads_the_sinks_on_each_replay():
    q, k, v, s = arrays(1, 4, 4, 16, 16, 32)
    s = s.copy()
    opts = pyfa.Options(backend="cpu")
    call = pyfa.prepare(pyfa.attention, q, k, v, sinks=s, options=opts)
    s[0] = 5.0  # in place: the replay reads the new value
    assert np.array_equal(call(), pyfa.attention(q, k, v, sinks=s.copy(), options=opts))


def test_the_c_abi_takes_sinks_for_the_fa2_forward_only():
    ffi, L = lib()
    B, H, HKV, NQ, NK, D = 2, 4, 2, 9, 13, 16
    f = lambda *sh: rng.standard_normal(sh, dtype=np.float32)  # noqa: E731
    q, k, v, do = f(B, H, NQ, D), f(B, HKV, NK, D), f(B, HKV, NK, D), f(B, H, NQ, D)
    o, lse = np.zeros_like(q), np.zeros((B, H, NQ), np.float32)
    s = f(H)
    p, c = problem(ffi), config(ffi, 2)  # the emulator
    assert run("fa2_forward", p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=lse, sinks=s)) == (0, "")
    want = pyfa.fa2_forward(q, k, v, causal=True, sinks=s, options=pyfa.Options(backend="emu", block_r=4,
                                                                               block_c=8))
    assert np.array_equal(o, want[0]) and np.array_equal(lse, want[1])
    dq, dk, dv = np.full_like(q, 7), np.full_like(k, 7), np.full_like(v, 7)
    st, msg = run("fa2_backward", p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=lse, dout=do, dq=dq, dk=dk, dv=dv,
                                                sinks=s))
    assert st == L.PYFA_ERROR_INVALID_ARGUMENT and "tensors->sinks: only pyfa_fa2_forward takes them" in msg
    assert (dq == 7).all() and (dk == 7).all() and (dv == 7).all()
    st, msg = run("fa2_forward", p, c, tensors(ffi, q=q, k=k, v=v, o=o, lse=lse, sinks=(s, (0, 1, 0))))
    assert st == L.PYFA_ERROR_INVALID_ARGUMENT and "tensors->sinks.strides: must be 0" in msg
    with pytest.raises(TypeError, match="unexpected keyword argument 'sinks'"):
        pyfa.fa2_backward(q, k, v, o, lse, do, sinks=s)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("split_size", [None, 64])
def test_the_io_model_counts_the_sinks_reads(shape, split_size):
    B, H, Hkv, Nq, Nk, d = SHAPES[shape]
    q, k, v, s = arrays(B, H, Hkv, Nq, Nk, d)
    sim = pyfa.sim.fa2_forward(q, k, v, causal=True, split_size=split_size, sinks=s)
    kw = dict(batch=B, heads=H, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=d, causal=True,
              split_size=split_size)
    with_sinks = pyfa.sim.count_io("fa2", sinks=True, **kw)
    assert sim.io.reads == with_sinks.reads and sim.io.writes == with_sinks.writes
    assert with_sinks.total - pyfa.sim.count_io("fa2", **kw).total == sim.io.reads["sinks"] > 0


@pytest.mark.skipif("cuda" not in pyfa.backends(), reason="no usable CUDA GPU here")
@pytest.mark.parametrize("variant,split_size", [("reference", None), ("reference", 64), ("auto", None)])
def test_cuda_kernels_merge_the_sinks_as_the_emulator(variant, split_size):
    # Host arrays on the CUDA backend: the sinks staged to the device with the inputs.
    for shape in sorted(SHAPES):
        q, k, v, s = arrays(*SHAPES[shape])
        tiles = dict(block_r=64, block_c=64)
        got = pyfa.fa2_forward(q, k, v, causal=True, split_size=split_size, sinks=s,
                               options=pyfa.Options(backend="cuda", variant=variant, **tiles))
        want = pyfa.fa2_forward(q, k, v, causal=True, split_size=split_size, sinks=s,
                                options=pyfa.Options(backend="emu", **tiles))
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), shape


def test_the_packed_io_model_counts_the_sinks_reads():
    # Sequences with no keys still merge their rows with the sinks; one with no queries
    # reads none.
    H, Hkv, d = 4, 2, 32
    cq, ck = np.array([0, 5, 8, 8, 14], np.int32), np.array([0, 7, 7, 11, 20], np.int32)
    q = rng.standard_normal((cq[-1], H, d), dtype=np.float32)
    k = rng.standard_normal((ck[-1], Hkv, d), dtype=np.float32)
    s = np.array([0.5, -np.inf, 3.0, -2.0], np.float32)
    sim = pyfa.sim.attention_varlen(q, k, k, cq, ck, causal=True, sinks=s)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, heads=H, heads_kv=Hkv, head_dim=d, causal=True)
    counted = pyfa.sim.count_io_varlen("fa2", sinks=True, **kw)
    assert sim.io.reads == counted.reads and sim.io.writes == counted.writes
    assert counted.reads["sinks"] > 0 and "sinks" not in pyfa.sim.count_io_varlen("fa2", **kw).reads
    with pytest.raises(pyfa.InvalidArgumentError, match="sinks: only the FA2 forward reads them"):
        pyfa.sim.count_io_varlen("fa2", passes="backward", sinks=True, **kw)
