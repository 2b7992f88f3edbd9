"""Split-KV and merging states (docs/numerics.md, "Merging states", "Split-KV"):
pyfa.merge_states folds parts in ascending order and skips -inf ones; the split FA2
forward of every backend (emulator readable and fast kernels, cpu backend) equals the
simulator's bit for bit, equals merge_states of the per-chunk calls, and a row's bits do
not depend on Nq: a causal prefill with split_size equals decoding row by row with it."""

import functools

import numpy as np
import pytest

import pyfa
import pyfa.sim
from conftest import HAS_CUDA

NEG_INF = np.float32(-np.inf)
# (backend, variant, tiles): every implementation of the FA2 forward that runs here.
RUNS = [("cpu", "auto", None), ("emu", "reference", None), ("emu", "auto", 64)]


def same_bits(a, b):
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def options(backend, variant, tiles):
    kw = dict(block_r=tiles, block_c=tiles) if tiles else {}
    return pyfa.Options(backend=backend, variant=variant, **kw)


@functools.lru_cache(maxsize=None)
def problem(B, H, Hkv, Nq, Nk, d, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Nq, d), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, Nk, d), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, Nk, d), dtype=np.float32)
    return q, k, v


@functools.lru_cache(maxsize=None)
def simulated(split, causal, tiles):
    q, k, v = problem(2, 4, 2, 37, 150, 64)
    opts = pyfa.Options(block_r=tiles, block_c=tiles) if tiles else None
    r = pyfa.sim.fa2_forward(q, k, v, causal=causal, split_size=split, options=opts)
    return r.o, r.lse


# ---- merge_states

def test_merge_folds_in_ascending_order_and_skips_empty_parts():
    rng = np.random.default_rng(1)
    o = rng.standard_normal((4, 3, 8), dtype=np.float32)
    lse = rng.standard_normal((4, 3), dtype=np.float32) * 4
    lse[1, 0] = NEG_INF  # row 0: part 1 saw no key
    lse[:, 2] = NEG_INF  # row 2: no part saw a key
    got_o, got_lse = pyfa.merge_states(o, lse)
    acc_o, acc_lse = o[0], lse[0]
    for c in range(1, 4):
        acc_o, acc_lse = pyfa.merge_states(np.stack([acc_o, o[c]]), np.stack([acc_lse, lse[c]]))
    assert same_bits(got_o, acc_o) and same_bits(got_lse, acc_lse)
    # A -inf part changes nothing: row 0 is the merge of parts 0, 2, 3.
    keep = [0, 2, 3]
    o3, lse3 = pyfa.merge_states(o[keep, :1], lse[keep, :1])
    assert same_bits(got_o[:1], o3) and same_bits(got_lse[:1], lse3)
    assert not np.all(got_o[:1] == pyfa.merge_states(o[:, :1], np.where(lse[:, :1] == NEG_INF, 0, lse[:, :1]))[0])
    # No part saw a key: O = 0, LSE = -inf.
    assert np.all(got_o[2] == 0) and got_lse[2] == NEG_INF
    # One part: itself (rows 0 and 1; row 2's -inf gives O = 0).
    one_o, one_lse = pyfa.merge_states(o[:1], lse[:1])
    assert same_bits(one_o[:2], o[0, :2]) and same_bits(one_lse, lse[0]) and np.all(one_o[2] == 0)
    # The union of keys: close to softmax over both parts' weights.
    w = np.exp(lse.astype(np.float64)[:, 1])
    want = (w[:, None] * o[:, 1]).sum(0) / w.sum()
    np.testing.assert_allclose(got_o[1], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_lse[1], np.log(w.sum()), rtol=1e-6)


def test_merge_refuses_bad_shapes():
    o = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="lse_parts"):
        pyfa.merge_states(o, np.zeros((2, 4), np.float32))
    with pytest.raises(pyfa.ArgumentTypeError, match="o_parts: expected float32"):
        pyfa.merge_states(o.astype(np.float64), np.zeros((2, 3), np.float32))
    with pytest.raises(pyfa.InvalidArgumentError, match="o_parts"):
        pyfa.merge_states(np.zeros((0, 3, 4), np.float32), np.zeros((0, 3), np.float32))


# ---- split-KV

@pytest.mark.parametrize("run", RUNS, ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("split,causal", [(None, True), (64, True), (128, False), (192, True)])
def test_split_forward_equals_the_simulator(run, split, causal):
    q, k, v = problem(2, 4, 2, 37, 150, 64)
    o, lse = pyfa.fa2_forward(q, k, v, causal=causal, split_size=split, options=options(*run))
    want_o, want_lse = simulated(split, causal, run[2])
    assert same_bits(o, want_o) and same_bits(lse, want_lse)


def test_split_changes_only_rounding():
    for causal in (False, True):
        o0, l0 = simulated(None, causal, None)
        o1, l1 = simulated(64 if causal else 128, causal, None)
        np.testing.assert_allclose(o1, o0, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=1e-6)



MODS = {
    "softcap": lambda rng, H, Nq, Nk: dict(softcap=5.0),
    "alibi": lambda rng, H, Nq, Nk: dict(alibi_slopes=rng.random((H,), dtype=np.float32)),
    "bias": lambda rng, H, Nq, Nk: dict(bias=rng.standard_normal((1, H, Nq, Nk), dtype=np.float32)),
    "dropout": lambda rng, H, Nq, Nk: dict(dropout_p=0.2, seed=7),
}


@pytest.mark.parametrize("mod", sorted(MODS))
def test_split_forward_with_score_modifications_equals_the_simulator(mod):
    # Each modification is a function of (b, h, i, j) with j the global key index, so a
    # chunk applies it as the unsplit call does; the fold adds only its own rounding.
    q, k, v = problem(2, 4, 2, 5, 150, 64)
    mods = MODS[mod](np.random.default_rng(4), 4, 5, 150)
    for causal in (False, True):
        want = pyfa.sim.fa2_forward(q, k, v, causal=causal, split_size=64,
                                    options=pyfa.Options(block_r=16, block_c=32), **mods)
        for backend in ("cpu", "emu"):
            opts = pyfa.Options(backend=backend, block_r=16, block_c=32)
            o, lse = pyfa.fa2_forward(q, k, v, causal=causal, split_size=64, options=opts, **mods)
            assert same_bits(o, want.o) and same_bits(lse, want.lse), (mod, causal, backend)
            unsplit = pyfa.fa2_forward(q, k, v, causal=causal, options=opts, **mods)[0]
            np.testing.assert_allclose(o, unsplit, rtol=1e-5, atol=2e-6)

@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_split_equals_merge_of_the_chunks(backend):
    # Without a mask chunk c's partial is the call on keys [c * S, (c + 1) * S) alone.
    q, k, v = problem(1, 2, 1, 5, 150, 32, seed=2)
    S, opts = 64, pyfa.Options(backend=backend)
    parts = [pyfa.fa2_forward(q, k[:, :, a:a + S], v[:, :, a:a + S], options=opts) for a in range(0, 150, S)]
    want_o, want_lse = pyfa.merge_states([p[0] for p in parts], [p[1] for p in parts])
    o, lse = pyfa.fa2_forward(q, k, v, split_size=S, options=opts)
    assert same_bits(o, want_o) and same_bits(lse, want_lse)


@pytest.mark.parametrize("run", RUNS[:2], ids=lambda r: "-".join(map(str, r)))
def test_prefill_equals_decode_row_by_row_with_split(run):
    q, k, v = problem(1, 2, 1, 40, 140, 64, seed=3)
    o, lse = pyfa.fa2_forward(q, k, v, causal=True, split_size=64, options=options(*run))
    off = 140 - 40
    for t in (0, 1, 17, 28, 39):
        n = off + t + 1  # the keys row t sees
        ot, lt = pyfa.fa2_forward(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], causal=True, split_size=64,
                                  options=options(*run))
        assert same_bits(ot[:, :, 0], o[:, :, t]) and same_bits(lt[:, :, 0], lse[:, :, t])


@pytest.mark.parametrize("nq", [1, 40])
def test_split_forward_is_one_launch_for_every_chunk(nq):
    """On a backend driven launch by launch (the emulator, as CUDA), every chunk of a split
    forward is in one launch (Tr x chunks blocks along x) before the combine, for 2 or 16
    chunks, where a launch per chunk would leave a decoding step's grid at Tr x H x B
    blocks at a time. The emulator's progress reports each launch's blocks as its total.
    The bits are the simulator's (and the per-chunk merge's, test above)."""
    rng = np.random.default_rng(9)
    for n in (64, 512):
        q = rng.standard_normal((1, 4, nq, 16), dtype=np.float32)
        k, v = (rng.standard_normal((1, 2, n, 16), dtype=np.float32) for _ in range(2))
        seen = []
        opts = pyfa.Options(backend="emu", variant="reference", block_r=8, block_c=8,
                            progress=lambda done, total: seen.append(total))
        o, lse = pyfa.fa2_forward(q, k, v, split_size=32, options=opts)
        tiles_h = -(-nq // 8) * 4  # Tr x H x B
        assert set(seen) == {n // 32 * tiles_h, tiles_h}, (n, seen)
        want = pyfa.sim.fa2_forward(q, k, v, split_size=32, options=pyfa.Options(block_r=8, block_c=8))
        assert same_bits(o, want.o) and same_bits(lse, want.lse)


@pytest.mark.parametrize("H,Hkv,nq,chunks,mods", [
    (8, 4, 1, 33, {}),  # decoding: 2 heads' rows in one Q tile of 8
    (8, 2, 5, 22, {"alibi": True, "bias": True}),  # 4 heads x 5 queries: tiles cut between queries
    (8, 2, 3, 33, {"dropout": True}),
])
def test_gqa_packing_reads_kv_once_per_group_with_the_same_bits(H, Hkv, nq, chunks, mods):
    """Where a head's rows fill less than a Q tile and the packed grid keeps 4 blocks per
    SM (src/core/tiles.cpp pack_gqa), the readable FA2 forward serves a K/V head's G query
    heads per block, their rows query by query: fewer blocks (the emulator's progress
    reports each launch's), K_j and V_j read once per group (the simulator's count, which
    walks the same packed tiles, equals count_io's), and every bit as each sequence alone,
    unpacked (too small a grid to pack), as the simulator and as the cpu backend; causal,
    with per-head score modifications and dropout keyed on each row's own head."""
    B, d, G = 4, 16, H // Hkv
    Nk = chunks * 16
    q, k, v = problem(B, H, Hkv, nq, Nk, d, seed=nq)
    kw = dict(causal=True, split_size=16)
    rng = np.random.default_rng(nq)
    if mods.get("alibi"):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, (B, H)).astype(np.float32)
    if mods.get("bias"):
        kw["bias"] = rng.standard_normal((1, H, nq, Nk), dtype=np.float32)
    if mods.get("dropout"):
        kw.update(dropout_p=0.25, seed=5)
    tiles = dict(block_r=8, block_c=16)
    packed = -(-G * nq // 8)
    assert B * Hkv * chunks * packed == 4 * 132  # the emulated H200's 132 SMs: just enough to pack
    seen = []
    o, lse = pyfa.fa2_forward(q, k, v, options=pyfa.Options(
        backend="emu", variant="reference", progress=lambda done, total: seen.append(total), **tiles), **kw)
    # The chunks' launch, then the combine's (progress may report a launch more than once).
    launches = [t for n, t in enumerate(seen) if n == 0 or seen[n - 1] != t]
    assert launches == [chunks * packed * Hkv * B, -(-nq // 8) * H * B], seen
    want = pyfa.sim.fa2_forward(q, k, v, options=pyfa.Options(**tiles), **kw)
    assert same_bits(o, want.o) and same_bits(lse, want.lse)
    rec = pyfa.sim.count_io("fa2", batch=B, heads=H, heads_kv=Hkv, seqlen_q=nq, seqlen_k=Nk, head_dim=d,
                            causal=True, split_size=16, bias=kw["bias"].shape if "bias" in kw else None, **tiles)
    assert (rec.reads, rec.writes) == (want.io.reads, want.io.writes)
    assert rec.reads["K"] <= B * Hkv * packed * Nk * d * 4  # each K/V tile once per packed Q tile
    cpu = pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu", **tiles), **kw)
    assert same_bits(cpu[0], o) and same_bits(cpu[1], lse)
    for b in range(B):
        one = dict(kw, alibi_slopes=kw["alibi_slopes"][b:b + 1]) if "alibi_slopes" in kw else kw
        if "dropout_p" in kw:  # sequence b alone draws as batch element 0: compare without a batch
            break
        seen.clear()
        ob, lb = pyfa.fa2_forward(q[b:b + 1], k[b:b + 1], v[b:b + 1], options=pyfa.Options(
            backend="emu", variant="reference", progress=lambda done, total: seen.append(total), **tiles), **one)
        assert seen[0] == chunks * -(-nq // 8) * H  # unpacked: one block per query head
        assert same_bits(ob, o[b:b + 1]) and same_bits(lb, lse[b:b + 1]), b


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here")
def test_gqa_packed_decode_on_cuda():
    """On the GPU (tools/device_check.sh runs the tests named cuda): a decoding step of 8
    sequences, 8 query heads over 2 K/V heads, split at 32 keys: 1024 packed blocks, which
    pack on any GPU of up to 256 SMs (the launch's block count says so), with the
    simulator's bits, the emulator's and the cpu backend's."""
    B, H, Hkv, Nk, d, split = 8, 8, 2, 2048, 64, 32
    q, k, v = problem(B, H, Hkv, 1, Nk, d, seed=3)
    tiles = dict(block_r=16, block_c=32)
    sms = pyfa.device_profile("cuda")["sm_count"]
    seen = []
    o, lse = pyfa.fa2_forward(q, k, v, causal=True, split_size=split, options=pyfa.Options(
        backend="cuda", variant="reference", progress=lambda done, total: seen.append(total), **tiles))
    if B * Hkv * (Nk // split) >= 4 * sms:
        assert seen[0] == B * Hkv * (Nk // split), (seen, sms)
    want = pyfa.sim.fa2_forward(q, k, v, causal=True, split_size=split, options=pyfa.Options(**tiles))
    assert same_bits(o, want.o) and same_bits(lse, want.lse)
    for backend in ("emu", "cpu"):
        r = pyfa.fa2_forward(q, k, v, causal=True, split_size=split, options=pyfa.Options(backend=backend, **tiles))
        assert same_bits(r[0], o) and same_bits(r[1], lse), backend


def test_gqa_packing_through_a_paged_cache():
    """A decoding step through a shuffled paged cache of 4 sequences of different lengths
    (one launch for the batch: the emulator packs it), row for row the simulator's and the
    cpu backend's, and each sequence's own unpacked step."""
    rng = np.random.default_rng(21)
    B, H, Hkv, d, page = 4, 8, 4, 16, 16
    lengths = np.array([527, 300, 11, 400], np.int32)  # cached keys; the step adds one
    q = rng.standard_normal((B, 1, H, d), dtype=np.float32)
    k = rng.standard_normal((B, 528, Hkv, d), dtype=np.float32)
    v = rng.standard_normal((B, 528, Hkv, d), dtype=np.float32)
    kc, vc, table = paged(rng, k, v, page, 528 // page)
    for b, n in enumerate(lengths):
        for n0 in range(0, n, page):
            rows = slice(n0, min(n, n0 + page))
            kc[table[b, n0 // page], :rows.stop - n0] = k[b, rows]
            vc[table[b, n0 // page], :rows.stop - n0] = v[b, rows]
    tiles = dict(block_r=8, block_c=16)
    new = [(k[b:b + 1, n:n + 1], v[b:b + 1, n:n + 1]) for b, n in enumerate(lengths)]
    kn, vn = (np.concatenate([x[i] for x in new]) for i in (0, 1))
    outs = {}
    for backend in ("emu", "cpu", "sim"):
        call = pyfa.sim.attention_with_kvcache if backend == "sim" else pyfa.attention_with_kvcache
        opts = pyfa.Options(**tiles) if backend == "sim" else pyfa.Options(backend=backend, **tiles)
        kb, vb = kc.copy(), vc.copy()
        outs[backend] = call(q, kb, vb, lengths, kn, vn, block_table=table, causal=True, split_size=16,
                             return_lse=True, options=opts)
    for backend in ("cpu", "sim"):
        assert all(same_bits(a, b) for a, b in zip(outs[backend], outs["emu"])), backend
    for b, n in enumerate(lengths):
        kb, vb = kc.copy(), vc.copy()
        o, lse = pyfa.attention_with_kvcache(q[b:b + 1], kb, vb, lengths[b:b + 1], kn[b:b + 1], vn[b:b + 1],
                                             block_table=table[b:b + 1], causal=True, split_size=16,
                                             return_lse=True, options=pyfa.Options(backend="emu", **tiles))
        assert same_bits(o, outs["emu"][0][b:b + 1]) and same_bits(lse, outs["emu"][1][b:b + 1]), b


def test_split_size_refused_where_it_cannot_apply():
    q, k, v = problem(1, 2, 1, 5, 150, 32, seed=2)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size.*multiple"):
        pyfa.fa2_forward(q, k, v, split_size=65, options=pyfa.Options(backend="cpu"))
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.fa2_forward(q, k, v, split_size=-64)
    # The C ABI takes any split_size >= 0 (Python bounds it to 2^40): near 2^63 the chunk
    # count is still counted (it once overflowed, skipping the multiple-of-Bc check) and
    # one chunk is one chunk.
    from pyfa import _lib
    ffi, L = _lib.load()

    def raw(split_size):
        B, H, Nq, d = q.shape
        o, lse = np.full_like(q, 7.0), np.full((B, H, Nq), 7.0, np.float32)
        p = ffi.new("pyfa_problem *")
        p.struct_size = ffi.sizeof("pyfa_problem")
        p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim = B, H, Nq, k.shape[2], d
        p.heads_kv, p.split_size = k.shape[1], split_size
        c = ffi.new("pyfa_config *")
        c.struct_size = ffi.sizeof("pyfa_config")
        c.backend = _lib.enum_values("pyfa_backend", "PYFA_BACKEND_")["cpu"]
        t = ffi.new("pyfa_tensors *")
        t.struct_size = ffi.sizeof("pyfa_tensors")
        for name, a in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
            getattr(t, name).data = ffi.cast("void *", ffi.from_buffer(a))
        status = L.pyfa_run(0, p, c, t, ffi.NULL)
        return status, ffi.string(L.pyfa_last_error()).decode(), o, lse

    status, message, o, _ = raw(2**63 - 1)
    assert status != 0 and "split_size: must be a multiple" in message and (o == 7.0).all(), message
    one, huge = raw(192), raw(2**63 - 64)
    assert one[0] == 0 and huge[0] == 0 and same_bits(one[2], huge[2]) and same_bits(one[3], huge[3])
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.fa2_forward(q, k, v, split_size="often")
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.attention(q, k, v, algo="fa1", split_size=64)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size.*multiple"):
        pyfa.sim.fa2_forward(q, k, v, split_size=65)
    # The fast FA2 forward does not split (yet): "fast" is refused naming why, "auto" runs
    # the readable kernel (RUNS above).
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        q64, k64, v64 = problem(1, 2, 1, 5, 150, 64)
        pyfa.fa2_forward(q64, k64, v64, split_size=64,
                         options=pyfa.Options(backend="emu", variant="fast", block_r=64, block_c=64))


def test_decode_split_size_is_a_constant_of_d():
    from pyfa.checks import decode_split_size
    q, k, v = problem(1, 2, 1, 1, 150, 32, seed=2)
    o, lse = pyfa.fa2_forward(q, k, v, split_size="decode")
    want = pyfa.sim.fa2_forward(q, k, v, split_size=decode_split_size(32))
    assert same_bits(o, want.o) and same_bits(lse, want.lse)
    assert [decode_split_size(d) for d in (32, 64, 128, 256)] == [512, 512, 256, 128]


# ---- the KV cache, dense and paged

def paged(rng, k, v, page_size, pages_per_seq, spare=3):
    """Empty paged caches with room for pages_per_seq pages per sequence of k's batch, the
    pages shuffled (and spare ones nobody uses), and their block table."""
    B, _, Hkv, d = k.shape
    n = B * pages_per_seq + spare
    kc = np.full((n, page_size, Hkv, d), np.nan, np.float32)
    vc = np.full((n, page_size, Hkv, d), np.nan, np.float32)
    table = rng.permutation(n)[:B * pages_per_seq].reshape(B, pages_per_seq).astype(np.int32)
    return kc, vc, table


TILES16 = dict(block_r=16, block_c=16)  # so that 23 tokens make two chunks of split_size 16


@functools.lru_cache(maxsize=None)
def tokens(seed=4):
    # Two sequences of 23 tokens, flash-attn's layout (B, N, heads, d).
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 23, 4, 32), dtype=np.float32)
    k = rng.standard_normal((2, 23, 2, 32), dtype=np.float32)
    v = rng.standard_normal((2, 23, 2, 32), dtype=np.float32)
    return q, k, v


@functools.lru_cache(maxsize=None)
def prefill(backend, split):
    q, k, v = tokens()
    bhnd = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return pyfa.fa2_forward(bhnd(q), bhnd(k), bhnd(v), causal=True, split_size=split,
                            options=pyfa.Options(backend=backend, **TILES16))


@pytest.mark.parametrize("backend,page_size,split", [
    ("cpu", 1, None), ("cpu", 3, 16), ("cpu", 16, None), ("cpu", 16, 16), ("emu", 3, 16), ("sim", 3, 16)])
def test_decode_through_a_paged_cache_equals_prefill(backend, page_size, split):
    q, k, v = tokens()
    o_pre, lse_pre = prefill("cpu" if backend == "sim" else backend, split)
    rng = np.random.default_rng(page_size)
    N = q.shape[1]
    kc, vc, table = paged(rng, k, v, page_size, -(-N // page_size))
    call = pyfa.sim.attention_with_kvcache if backend == "sim" else pyfa.attention_with_kvcache
    opts = pyfa.Options(**TILES16) if backend == "sim" else pyfa.Options(backend=backend, **TILES16)
    # A chunked prefill of 5 tokens, then one token at a time.
    steps = [(0, 5)] + [(t, t + 1) for t in range(5, N)]
    for a, z in steps:
        o, lse = call(q[:, a:z], kc, vc, np.full(2, a, np.int32), k[:, a:z], v[:, a:z], block_table=table,
                      causal=True, split_size=split, return_lse=True, options=opts)
        assert same_bits(o.transpose(0, 2, 1, 3), o_pre[:, :, a:z]), (a, z)
        assert same_bits(lse, lse_pre[:, :, a:z]), (a, z)



@pytest.mark.parametrize("backend,page_size,split", [
    ("cpu", 256, 16), ("cpu", 256, None), ("cpu", 7, 16), ("emu", 1, 16)])
def test_batch_invariance_chunked_prefill_then_mixed_decode(backend, page_size, split):
    # Three sequences of different lengths share one shuffled page pool. Each is prefilled
    # alone in chunks of random lengths, then all three decode their last tokens in one
    # batch, each at its own position: every row has the bits of its own one-shot prefill.
    rng = np.random.default_rng(11 + page_size)
    lengths, tail, H, Hkv, d = [23, 9, 30], 4, 4, 2, 32
    seqs = [tuple(rng.standard_normal((1, n, h, d), dtype=np.float32) for h in (H, Hkv, Hkv)) for n in lengths]
    opts = pyfa.Options(backend=backend, **TILES16)
    bhnd = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    want = [pyfa.fa2_forward(bhnd(q), bhnd(k), bhnd(v), causal=True, split_size=split, options=opts)
            for q, k, v in seqs]
    per_seq = -(-max(lengths) // page_size)
    n_pages = len(lengths) * per_seq + 2
    kc = np.full((n_pages, page_size, Hkv, d), np.nan, np.float32)
    vc = np.full_like(kc, np.nan)
    table = rng.permutation(n_pages)[:len(lengths) * per_seq].reshape(len(lengths), per_seq).astype(np.int32)
    for b, (q, k, v) in enumerate(seqs):
        a = 0
        while a < lengths[b] - tail:
            z = min(lengths[b] - tail, a + int(rng.integers(1, 8)))
            o, lse = pyfa.attention_with_kvcache(q[:, a:z], kc, vc, np.array([a], np.int32), k[:, a:z], v[:, a:z],
                                                 block_table=table[b:b + 1], causal=True, split_size=split,
                                                 return_lse=True, options=opts)
            assert same_bits(o.transpose(0, 2, 1, 3), want[b][0][:, :, a:z]), (b, a, z)
            assert same_bits(lse, want[b][1][:, :, a:z]), (b, a, z)
            a = z
    for t in range(tail):
        pos = [n - tail + t for n in lengths]
        pick = lambda i: np.concatenate([x[i][:, p:p + 1] for x, p in zip(seqs, pos)])
        o, lse = pyfa.attention_with_kvcache(pick(0), kc, vc, np.array(pos, np.int32), pick(1), pick(2),
                                             block_table=table, causal=True, split_size=split, return_lse=True,
                                             options=opts)
        for b, p in enumerate(pos):
            assert same_bits(o[b:b + 1].transpose(0, 2, 1, 3), want[b][0][:, :, p:p + 1]), (b, p)
            assert same_bits(lse[b:b + 1], want[b][1][:, :, p:p + 1]), (b, p)

def test_dense_cache_equals_varlen_and_the_paged_cache():
    q, k, v = tokens()
    rng = np.random.default_rng(7)
    lens = np.array([9, 17], np.int32)  # keys already cached
    kc = rng.standard_normal((2, 23, 2, 32), dtype=np.float32)
    vc = rng.standard_normal((2, 23, 2, 32), dtype=np.float32)
    nq = 4
    o, lse = pyfa.attention_with_kvcache(q[:, :nq], kc, vc, lens, causal=True, return_lse=True)
    # The same sequences as one varlen call.
    kp = np.concatenate([kc[b, :lens[b]] for b in range(2)])
    vp = np.concatenate([vc[b, :lens[b]] for b in range(2)])
    cu_k = np.array([0, lens[0], lens.sum()], np.int32)
    cu_q = np.array([0, nq, 2 * nq], np.int32)
    ov, lv = pyfa.attention_varlen(q[:, :nq].reshape(2 * nq, 4, 32), kp, vp, cu_q, cu_k, causal=True,
                                   return_lse=True)
    assert same_bits(o.reshape(2 * nq, 4, 32), ov)
    assert same_bits(lse, lv.reshape(4, 2, nq).transpose(1, 0, 2))
    # Paged, page size 4, pages shared: both sequences' first page is the same one.
    kg, vg, table = paged(rng, kc, vc, 4, 6)
    table[1, 0] = table[0, 0]
    kc[1, :4], vc[1, :4] = kc[0, :4], vc[0, :4]
    for b in range(2):
        for n in range(lens[b]):
            kg[table[b, n // 4], n % 4], vg[table[b, n // 4], n % 4] = kc[b, n], vc[b, n]
    o_dense = pyfa.attention_with_kvcache(q[:, :nq], kc, vc, lens, causal=True)
    o_paged = pyfa.attention_with_kvcache(q[:, :nq], kg, vg, lens, block_table=table, causal=True)
    assert same_bits(o_dense, o_paged)


@pytest.mark.parametrize("page_size", [None, 3])
def test_append_writes_exactly_the_new_rows(page_size):
    q, k, v = tokens()
    rng = np.random.default_rng(8)
    lens = np.array([2, 11], np.int32)
    if page_size is None:
        kc = rng.standard_normal((2, 20, 2, 32), dtype=np.float32)
        vc = rng.standard_normal((2, 20, 2, 32), dtype=np.float32)
        table, where = None, lambda b, n: (b, n)
    else:
        kc, vc, table = paged(rng, k, v, page_size, 7)
        kc[:] = rng.standard_normal(kc.shape, dtype=np.float32)
        vc[:] = rng.standard_normal(vc.shape, dtype=np.float32)
        where = lambda b, n: (table[b, n // page_size], n % page_size)
    k0, v0 = kc.copy(), vc.copy()
    pyfa.attention_with_kvcache(q[:, :3], kc, vc, lens, k[:, :3], v[:, :3], block_table=table)
    changed = np.zeros(kc.shape[:2], bool)
    for b in range(2):
        for t in range(3):
            changed[where(b, lens[b] + t)] = True
            assert same_bits(kc[where(b, lens[b] + t)], k[b, t]) and same_bits(vc[where(b, lens[b] + t)], v[b, t])
    assert same_bits(kc[~changed], k0[~changed]) and same_bits(vc[~changed], v0[~changed])


def test_bad_input_is_refused_and_writes_nothing():
    q, k, v = tokens()
    rng = np.random.default_rng(9)
    kc, vc, table = paged(rng, k, v, 4, 3)
    kc[:] = 1.0
    vc[:] = 2.0
    k0, v0 = kc.copy(), vc.copy()
    lens = np.array([8, 9], np.int32)
    args = (q[:, :2], kc, vc)
    new = (k[:, :2], v[:, :2])
    cases = [
        ("cache_seqlens", dict(cache_seqlens=np.array([8, 11], np.int32))),  # 11 + 2 > 12
        ("cache_seqlens", dict(cache_seqlens=lens.astype(np.int64))),
        ("cache_seqlens", dict(cache_seqlens=np.array([8, -1], np.int32))),
        ("block_table", dict(block_table=np.where(table == table[1, 2], 99, table).astype(np.int32))),
        ("block_table", dict(block_table=table.astype(np.int64))),
        ("k_new and k_cache", dict(k_new=kc[:2, :2])),
        ("v_new", dict(v_new=None)),
        ("split_size", dict(split_size=6)),  # refused by the library after the append: undone
    ]
    for name, change in cases:
        kw = dict(cache_seqlens=lens, k_new=new[0], v_new=new[1], block_table=table, split_size=None)
        kw.update(change)
        cache_seqlens = kw.pop("cache_seqlens")
        with pytest.raises((pyfa.InvalidArgumentError, pyfa.ArgumentTypeError), match=name):
            pyfa.attention_with_kvcache(*args, cache_seqlens, causal=True, **kw)
        assert same_bits(kc, k0) and same_bits(vc, v0), name
