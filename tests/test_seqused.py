"""seqused_k (pyfa.h ABI 9, flash-attn's): packed sequences that attend to only the first
seqused_k[b] of their key rows. Row for row the bits of the varlen call on the trimmed
packing, on the emulator (readable and fast kernels), the cpu backend and the simulator,
forward FA1 and FA2, split and not; the unused rows are never read (they hold NaN here).
A dense KV cache is read in place through it (pyfa.attention_with_kvcache allocates no
copy of the cache). Bad counts are refused naming the argument, by Python and by the
library's own checks, with nothing written."""

import tracemalloc

import numpy as np
import pytest

import pyfa
from pyfa import api
from test_varlen import offsets, same_bits

pytestmark = pytest.mark.xdist_group("varlen")


def problem(seed, H=4, Hkv=2, d=64):
    """Sequences with room for more keys than they use: (q, k, v, cu_q, cu_k, used) with
    NaN in every unused key row, and the trimmed packing (k_t, v_t, cu_t)."""
    rng = np.random.default_rng(seed)
    B = 4
    lens_q = rng.integers(1, 9, B)
    used = rng.integers(0, 150, B).astype(np.int32)
    used[0] = max(used[0], 70)  # more than one split of 64 keys
    room = used + rng.integers(0, 40, B)
    room[1] = used[1]  # one sequence uses all its rows
    cu_q, cu_k, cu_t = offsets(lens_q), offsets(room), offsets(used)
    q = rng.standard_normal((cu_q[-1], H, d)).astype(np.float32)
    k = np.full((cu_k[-1], Hkv, d), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for b in range(B):
        k[cu_k[b]:cu_k[b] + used[b]] = rng.standard_normal((used[b], Hkv, d))
        v[cu_k[b]:cu_k[b] + used[b]] = rng.standard_normal((used[b], Hkv, d))
    keep = np.concatenate([np.arange(cu_k[b], cu_k[b] + used[b]) for b in range(B)])
    return q, k, v, cu_q, cu_k, used, k[keep], v[keep], cu_t


OPTIONS = {
    "emu": pyfa.Options(backend="emu", block_r=8, block_c=8, variant="reference"),
    "emu-fast": pyfa.Options(backend="emu", variant="fast"),
    "cpu": pyfa.Options(backend="cpu", threads=2),
    "cpu-1": pyfa.Options(backend="cpu", threads=1, block_r=8, block_c=16),
}
MASKS = [dict(causal=False), dict(causal=True), dict(causal=True, causal_align="top_left"),
         dict(window=(5, 0))]


@pytest.mark.parametrize("run", sorted(OPTIONS))
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("algo,split", [("fa2", None), ("fa2", 64), ("fa1", None)])
def test_rows_equal_the_trimmed_packing(run, mask, algo, split):
    q, k, v, cu_q, cu_k, used, k_t, v_t, cu_t = problem(7)
    if run == "emu-fast" and split:
        split = None  # the fast FA2 forward does not split
    kw = dict(algo=algo, return_lse=algo == "fa2", split_size=split, options=OPTIONS[run], **mask)
    got = pyfa.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=used, **kw)
    want = pyfa.attention_varlen(q, k_t, v_t, cu_q, cu_t, **kw)
    for g, w in zip(got if algo == "fa2" else (got,), want if algo == "fa2" else (want,)):
        assert np.all(np.isfinite(g[~np.isinf(g)]))
        assert same_bits(g, w)
    opts = OPTIONS[run]
    if opts.block_c:  # the simulator, on the same tiles
        sim_kw = dict(split_size=split, **mask) if algo == "fa2" else mask
        sim = pyfa.sim.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=used, algo=algo,
                                        options=pyfa.Options(block_r=opts.block_r, block_c=opts.block_c),
                                        **sim_kw)
        assert same_bits(sim.o, got[0] if algo == "fa2" else got)


def test_dense_cache_read_in_place():
    """A dense cache is not copied: the call's NumPy allocations stay far below the
    cache's size (the gather it replaced allocated the visible keys twice over), and its
    bits equal those of the same keys as a packed batch."""
    rng = np.random.default_rng(3)
    B, Nmax, H, Hkv, d = 2, 4096, 8, 2, 64
    k_cache = rng.standard_normal((B, Nmax, Hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((B, Nmax, Hkv, d)).astype(np.float32)
    seqlens = np.array([4000, 3500], np.int32)
    q = rng.standard_normal((B, 1, H, d)).astype(np.float32)
    opts = pyfa.Options(backend="cpu")
    pyfa.attention_with_kvcache(q, k_cache, v_cache, seqlens, options=opts)  # warm: the library loaded
    tracemalloc.start()
    o = pyfa.attention_with_kvcache(q, k_cache, v_cache, seqlens, options=opts)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < k_cache.nbytes // 8, (peak, k_cache.nbytes)
    k_p = np.concatenate([k_cache[b, :seqlens[b]] for b in range(B)])
    v_p = np.concatenate([v_cache[b, :seqlens[b]] for b in range(B)])
    want = pyfa.attention_varlen(q.reshape(B, H, d), k_p, v_p, offsets([1, 1]), offsets(seqlens), options=opts)
    assert same_bits(o.reshape(B, H, d), want)


@pytest.mark.parametrize("change,error,message", [
    (dict(seqused_k=np.array([1, 2, 3], np.int64)), pyfa.ArgumentTypeError, r"seqused_k: expected dtype int32"),
    (dict(seqused_k=np.array([1, 2], np.int32)), pyfa.InvalidArgumentError, r"seqused_k: expected shape \(3,\)"),
    (dict(seqused_k=np.array([1, 6, 0], np.int32)), pyfa.InvalidArgumentError, r"seqused_k\[1\]: must be in \[0, 5\]"),
    (dict(seqused_k=np.array([-1, 0, 0], np.int32)), pyfa.InvalidArgumentError, r"seqused_k\[0\]: must be in"),
    (dict(seqused_k=np.array([1, 2, 3], np.int32), max_seqlen_k=2), pyfa.InvalidArgumentError,
     r"max_seqlen_k: 2 is below the longest sequence \(3 rows\)"),
])
def test_bad_counts_are_refused(change, error, message):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 2, 8)).astype(np.float32)
    k = rng.standard_normal((12, 2, 8)).astype(np.float32)
    cu_q, cu_k = offsets([2, 2, 2]), offsets([4, 5, 3])
    out = np.full_like(q, 7.0)
    with pytest.raises(error, match=message):
        pyfa.attention_varlen(q, k, k, cu_q, cu_k, out=out, options=pyfa.Options(backend="cpu"), **change)
    assert np.all(out == 7.0)
    with pytest.raises(error, match=message):
        pyfa.sim.fa2_forward_varlen(q, k, k, cu_q, cu_k, **change)


def test_library_checks_the_counts():
    """Through pyfa_run directly, as a C caller: counts beyond a sequence's rows or
    problem->seqlen_k, counts without problem->varlen, with strides, or on a backward
    are refused naming tensors->seqused_k, and nothing is written; an ABI 8 caller's
    struct (which ends before the field) runs as before."""
    from pyfa import _lib
    ffi, lib = _lib.load()
    rng = np.random.default_rng(5)
    q = rng.standard_normal((8, 2, 16)).astype(np.float32)
    o = np.full_like(q, 7.0)
    lse = np.full((2, 8), 7.0, np.float32)
    grads = [np.full_like(q, 7.0) for _ in range(3)]
    cu = offsets([3, 5])

    def call(used, varlen=1, seqlen_k=5, strides=0, op=lib.PYFA_OP_FA2_FORWARD, size=None):
        pr = ffi.new("pyfa_problem *")
        pr.struct_size = ffi.sizeof("pyfa_problem")
        pr.batch, pr.heads, pr.seqlen_q, pr.seqlen_k, pr.head_dim = 2, 2, 5, seqlen_k, 16
        pr.varlen, pr.total_q, pr.total_k = varlen, 8, 8
        named = [("q", q), ("k", q), ("v", q), ("o", o), ("lse", lse)]
        if op == lib.PYFA_OP_FA2_BACKWARD:
            named += [("do", q), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])]
        t = api._tensors("PYFA_MEMORY_HOST", {n: x.ctypes.data for n, x in named})
        if size is not None:
            t.struct_size = size
        if varlen:
            t.cu_seqlens_q.data = t.cu_seqlens_k.data = ffi.cast("void *", cu.ctypes.data)
        t.seqused_k.data = ffi.cast("void *", used.ctypes.data)
        t.seqused_k.strides.row = strides
        cfg = ffi.new("pyfa_config *")
        cfg.backend = api.BACKENDS["cpu"]
        status = lib.pyfa_run(op, pr, cfg, t, ffi.NULL)
        return status, ffi.string(lib.pyfa_last_error()).decode()

    cases = [
        (dict(used=np.array([3, 6], np.int32), seqlen_k=6), r"tensors->seqused_k\[1\]: must be in \[0, 5\]"),
        (dict(used=np.array([3, 5], np.int32), seqlen_k=4), r"tensors->seqused_k\[1\]: must be in \[0, 4\]"),
        (dict(used=np.array([3, 5], np.int32), varlen=0), r"tensors->seqused_k: given, but problem->varlen is 0"),
        (dict(used=np.array([3, 5], np.int32), strides=1), r"tensors->seqused_k.strides: must be 0"),
        (dict(used=np.array([3, 5], np.int32), op=lib.PYFA_OP_FA2_BACKWARD),
         r"tensors->seqused_k: only the forwards take it"),
    ]
    for kw, message in cases:
        status, text = call(**kw)
        assert status == lib.PYFA_ERROR_INVALID_ARGUMENT, text
        assert __import__("re").search(message, text), text
        assert np.all(o == 7.0) and np.all(lse == 7.0) and all(np.all(g == 7.0) for g in grads)
    # seqlen_k bounds the counts, not the offsets' lengths: sequence 1 has 5 rows, uses 2.
    assert call(np.array([3, 2], np.int32), seqlen_k=3) == (lib.PYFA_OK, "")
    k_t = np.concatenate([q[0:3], q[3:5]])
    want = pyfa.attention_varlen(q, k_t, k_t, cu, offsets([3, 2]), options=pyfa.Options(backend="cpu"))
    assert same_bits(o, want)
    # ABI 8's pyfa_tensors ends before seqused_k: the counts are not read.
    o[:] = 7.0
    abi8 = ffi.offsetof("pyfa_tensors", "seqused_k")
    assert call(np.array([0, 0], np.int32), size=abi8) == (lib.PYFA_OK, "")
    assert same_bits(o, pyfa.attention_varlen(q, q, q, cu, cu, options=pyfa.Options(backend="cpu")))
