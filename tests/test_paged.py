"""Paged K/V read in place (pyfa.h ABI 10: problem->page_size, num_pages and
tensors->block_table, forwards only). Row for row the bits of the same keys gathered into
a packed batch, on the emulator (the readable kernels, under two thread orders and in
strict mode), the cpu backend (1 and 2 threads) and the simulator, FA2 split and not and
FA1, page sizes 1 to 64 with shuffled and shared pages; the rows past a sequence's keys
and the pages nobody uses hold NaN and are never read. pyfa.attention_with_kvcache reads
a paged cache without copying it. The fast kernels, the backwards and bad tables are
refused, naming the argument, with nothing written."""

import re
import tracemalloc

import numpy as np
import pytest

import pyfa
from pyfa import api, varlen
from pyfa.checks import Pages
from test_varlen import offsets, same_bits

pytestmark = pytest.mark.xdist_group("varlen")


def problem(seed, page_size, H=4, Hkv=2, d=32):
    """(q, k_pages, v_pages, cu_q, cu_k, used, pages) and the same keys packed (k_t, v_t,
    cu_t): three sequences (one without keys), pages shuffled, sequence 2's first page
    shared with sequence 0's where that is a full one, NaN in every row nobody reads."""
    rng = np.random.default_rng(seed)
    lens_q, used = np.array([3, 1, 5]), np.array([37, 0, 50], np.int32)
    max_pages = -(-int(used.max()) // page_size) + 1
    n_pages = 3 * max_pages + 2
    k = np.full((n_pages, page_size, Hkv, d), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    table = rng.permutation(n_pages)[:3 * max_pages].reshape(3, max_pages).astype(np.int32)
    share = page_size <= used[0]  # a full page of sequence 0's is sequence 2's first too
    if share:
        table[2, 0] = table[0, 0]
    logical = []
    for b in range(3):
        kb = rng.standard_normal((int(used[b]), Hkv, d)).astype(np.float32)
        vb = rng.standard_normal((int(used[b]), Hkv, d)).astype(np.float32)
        if b == 2 and share:
            kb[:page_size], vb[:page_size] = logical[0][0][:page_size], logical[0][1][:page_size]
        for n in range(int(used[b])):
            k[table[b, n // page_size], n % page_size] = kb[n]
            v[table[b, n // page_size], n % page_size] = vb[n]
        logical.append((kb, vb))
    q = rng.standard_normal((int(lens_q.sum()), H, d)).astype(np.float32)
    cu_k = offsets(np.full(3, max_pages * page_size))
    pages = Pages(np.ascontiguousarray(table.reshape(-1)), page_size, n_pages)
    k_t = np.concatenate([kb for kb, _ in logical])
    v_t = np.concatenate([vb for _, vb in logical])
    return (q, k.reshape(-1, Hkv, d), v.reshape(-1, Hkv, d), offsets(lens_q), cu_k, used, pages, k_t, v_t,
            offsets(used))


OPTIONS = {
    "emu": pyfa.Options(backend="emu", block_r=8, block_c=8),
    "emu-reverse": pyfa.Options(backend="emu", block_r=4, block_c=16, emu_order="reverse"),
    "emu-strict": pyfa.Options(backend="emu", block_r=8, block_c=8, emu_check="strict"),
    "cpu": pyfa.Options(backend="cpu", threads=2),
    "cpu-1": pyfa.Options(backend="cpu", threads=1, block_r=8, block_c=16),
}


@pytest.mark.parametrize("run", sorted(OPTIONS))
@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
@pytest.mark.parametrize("algo,split", [("fa2", None), ("fa2", 16), ("fa1", None)])
def test_rows_equal_the_gathered_keys(run, page_size, algo, split):
    q, k, v, cu_q, cu_k, used, pages, k_t, v_t, cu_t = problem(page_size, page_size)
    opts = OPTIONS[run]
    if split and not opts.block_c:
        split = 64  # the cpu backend's default Bc at d = 32
    op, kw = f"{algo}_forward", dict(causal=True, options=opts, split_size=split)
    got = varlen.run(op, dict(q=q, k=k, v=v), cu_q, cu_k, seqused_k=used, pages=pages, **kw)
    want = varlen.run(op, dict(q=q, k=k_t, v=v_t), cu_q, cu_t, **kw)
    for g, w in zip(got, want):
        assert not np.any(np.isnan(g))
        assert same_bits(g, w)
    if algo == "fa2" and opts.block_c:  # the simulator, on the same tiles
        tiles = pyfa.Options(block_r=opts.block_r, block_c=opts.block_c)
        sim = pyfa.sim.fa2_forward_varlen(q, k, v, cu_q, cu_k, seqused_k=used, pages=pages, causal=True,
                                          split_size=split, options=tiles)
        assert same_bits(sim.o, got[0]) and same_bits(sim.lse, got[1])


def flash_paged(page_size, **kw):
    """problem() as flash-attn's flash_attn_varlen_func(block_table=) takes it: k, v the
    (num_pages, page_size, Hkv, d) pages, the (B, max_pages) table, cu_seqlens_k the
    sequences' own key offsets; and the same keys packed."""
    q, k, v, cu_q, _, used, pages, k_t, v_t, cu_t = problem(page_size, page_size, **kw)
    Hkv, d = k.shape[1:]
    kp, vp = (x.reshape(-1, page_size, Hkv, d) for x in (k, v))
    return q, kp, vp, cu_q, cu_t, pages.table.reshape(3, -1), k_t, v_t


@pytest.mark.parametrize("run", ["emu", "cpu", "cpu-1"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("algo,split", [("fa2", None), ("fa2", 16), ("fa1", None)])
def test_attention_varlen_takes_a_block_table(run, page_size, algo, split):
    """pyfa.attention_varlen(block_table=) gives the bits of the keys packed, row for row;
    the simulator's pyfa.sim.attention_varlen the same on the emulator's tiles."""
    q, kp, vp, cu_q, cu_k, table, k_t, v_t = flash_paged(page_size)
    opts = OPTIONS[run]
    kw = dict(causal=True, window=(9, 0), algo=algo, options=opts)
    if split:  # the cpu backend's default Bc at d = 32 is 64
        kw["split_size"] = split if opts.block_c else 64
    got = pyfa.attention_varlen(q, kp, vp, cu_q, cu_k, block_table=table, **kw)
    want = pyfa.attention_varlen(q, k_t, v_t, cu_q, cu_k, **kw)
    assert not np.any(np.isnan(got)) and same_bits(got, want)
    if run == "emu":
        tiles = pyfa.Options(block_r=opts.block_r, block_c=opts.block_c)
        sim = pyfa.sim.attention_varlen(q, kp, vp, cu_q, cu_k, block_table=table, **{**kw, "options": tiles})
        assert same_bits(sim.o, got)


def test_attention_varlen_checks_the_block_table():
    """Bad paged arguments are refused naming the argument, the out= array untouched."""
    q, kp, vp, cu_q, cu_k, table, *_ = flash_paged(4)
    out = np.full_like(q, 7.0)
    bad = {
        "block_table: expected dtype int32, got int64": dict(block_table=table.astype(np.int64)),
        r"block_table: expected 3 rows \(one per sequence\)": dict(block_table=table[:2]),
        r"block_table: sequence 0 names pages \[-1": dict(block_table=np.where(table == table[0, 0], -1, table)),
        "cu_seqlens_k: sequence 2 has 50 keys, beyond the 40 its block_table row maps":
            dict(block_table=table[:, :10]),
        "seqused_k: not taken with block_table": dict(block_table=table, seqused_k=np.zeros(3, np.int32)),
        r"v: shape \(\d+, 4, 2, 32\) differs from k's": dict(block_table=table, v=vp[:-1]),
        "k: expected 4 dimensions": dict(block_table=table, k=kp.reshape(-1, 2, 32), v=vp.reshape(-1, 2, 32)),
        r"cu_seqlens_k\[2\]: 37 is below the offset before it": dict(block_table=table,
                                                                     cu_seqlens_k=cu_k[[0, 3, 1, 2]]),
    }
    for message, args in bad.items():
        call = {"k": kp, "v": vp, "cu_seqlens_k": cu_k, **args}
        with pytest.raises(pyfa.PyfaError, match=message):
            pyfa.attention_varlen(q, call.pop("k"), call.pop("v"), cu_q, call.pop("cu_seqlens_k"), out=out,
                                  **call)
        assert np.all(out == 7.0)


def test_paged_cache_read_in_place():
    """attention_with_kvcache hands the pages to the kernels as they lie: the call's NumPy
    allocations stay far below the cache's size, and the bits are the dense cache's."""
    rng = np.random.default_rng(3)
    B, N, page, H, Hkv, d = 2, 4096, 16, 8, 2, 64
    per = N // page
    k_dense = rng.standard_normal((B, N, Hkv, d)).astype(np.float32)
    v_dense = rng.standard_normal((B, N, Hkv, d)).astype(np.float32)
    table = rng.permutation(B * per).reshape(B, per).astype(np.int32)
    k_pages = np.empty((B * per, page, Hkv, d), np.float32)
    v_pages = np.empty_like(k_pages)
    k_pages[table] = k_dense.reshape(B, per, page, Hkv, d)
    v_pages[table] = v_dense.reshape(B, per, page, Hkv, d)
    seqlens = np.array([4000, 3501], np.int32)
    q = rng.standard_normal((B, 1, H, d)).astype(np.float32)
    opts = pyfa.Options(backend="cpu")
    pyfa.attention_with_kvcache(q, k_pages, v_pages, seqlens, block_table=table, options=opts)  # warm
    tracemalloc.start()
    o = pyfa.attention_with_kvcache(q, k_pages, v_pages, seqlens, block_table=table, options=opts)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < k_pages.nbytes // 8, (peak, k_pages.nbytes)
    assert same_bits(o, pyfa.attention_with_kvcache(q, k_dense, v_dense, seqlens, options=opts))


def test_fast_kernels_refuse_pages():
    q, k, v, cu_q, cu_k, used, pages, *_ = problem(0, 16, d=64)
    with pytest.raises(pyfa.InvalidArgumentError, match="takes no paged K/V"):
        varlen.run("fa2_forward", dict(q=q, k=k, v=v), cu_q, cu_k, seqused_k=used, pages=pages,
                   options=pyfa.Options(backend="emu", variant="fast"))


def test_library_checks_the_pages():
    """Through pyfa_run directly, as a C caller: a table without a page size or the other
    way round, a page size without packed sequences, a backward, an offset that does not
    start a page, a page outside num_pages, logical rows that are not whole pages and
    num_pages 0 are refused naming the field, with nothing written; an ABI 9 caller's
    structs (which end before the fields) run unpaged as before."""
    from pyfa import _lib
    ffi, lib = _lib.load()
    rng = np.random.default_rng(5)
    H, d, ps = 2, 16, 4
    kv = rng.standard_normal((5 * ps, H, d)).astype(np.float32)  # 5 pages
    q = rng.standard_normal((4, H, d)).astype(np.float32)
    o = np.full_like(q, 7.0)
    lse = np.full((H, 4), 7.0, np.float32)
    grads = [np.full_like(q, 7.0), np.full_like(kv, 7.0), np.full_like(kv, 7.0)]
    cu_q = offsets([2, 2])

    def call(table=(3, 1, 0, 4), cu_k=(0, 8, 16), used=(6, 5), page_size=ps, num_pages=5, varlen=1,
             op=lib.PYFA_OP_FA2_FORWARD, total_k=16, sizes=None):
        table, cu_k = np.array(table, np.int32), np.array(cu_k, np.int32)
        used = None if used is None else np.array(used, np.int32)
        pr = ffi.new("pyfa_problem *")
        pr.struct_size = ffi.sizeof("pyfa_problem") if sizes is None else sizes[0]
        pr.batch, pr.heads, pr.seqlen_q, pr.seqlen_k, pr.head_dim = 2, H, 2, 8, d
        pr.varlen, pr.total_q, pr.total_k = varlen, 4, total_k
        pr.page_size, pr.num_pages = page_size, num_pages
        named = [("q", q), ("k", kv), ("v", kv), ("o", o), ("lse", lse)]
        if op == lib.PYFA_OP_FA2_BACKWARD:
            named += [("do", q), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])]
        t = api._tensors("PYFA_MEMORY_HOST", {n: x.ctypes.data for n, x in named})
        if sizes is not None:
            t.struct_size = sizes[1]
        if varlen:
            t.cu_seqlens_q.data = ffi.cast("void *", cu_q.ctypes.data)
            t.cu_seqlens_k.data = ffi.cast("void *", cu_k.ctypes.data)
            if used is not None:
                t.seqused_k.data = ffi.cast("void *", used.ctypes.data)
        if table.size:
            t.block_table.data = ffi.cast("void *", table.ctypes.data)
        cfg = ffi.new("pyfa_config *")
        cfg.backend = api.BACKENDS["cpu"]
        status = lib.pyfa_run(op, pr, cfg, t, ffi.NULL)
        return status, ffi.string(lib.pyfa_last_error()).decode()

    cases = [
        (dict(page_size=0, num_pages=0), r"tensors->block_table: given, but problem->page_size is 0"),
        (dict(table=()), r"tensors->block_table.data: null pointer, but problem->page_size"),
        (dict(varlen=0), r"problem->page_size: paged K/V takes packed sequences"),
        (dict(page_size=-1), r"problem->page_size: must be >= 1"),
        (dict(num_pages=0), r"problem->num_pages: must be >= 1"),
        (dict(page_size=0), r"problem->num_pages: must be 0 without problem->page_size"),
        (dict(total_k=15, cu_k=(0, 8, 15)), r"problem->total_k: must be a multiple of problem->page_size"),
        (dict(cu_k=(0, 6, 16), used=(6, 5)), r"tensors->cu_seqlens_k\[1\]: must be a multiple of"),
        (dict(table=(3, 5, 0, 4)), r"tensors->block_table\[1\]: page 5 of sequence 0 is outside \[0, "
                                   r"problem->num_pages = 5\)"),
        (dict(table=(3, 1, -1, 4)), r"tensors->block_table\[2\]: page -1 of sequence 1"),
        (dict(op=lib.PYFA_OP_FA2_BACKWARD, used=None), r"problem->page_size: paged K/V is for the forwards"),
    ]
    for kw, message in cases:
        status, text = call(**kw)
        assert status == lib.PYFA_ERROR_INVALID_ARGUMENT, (kw, text)
        assert re.search(message, text), text
        assert np.all(o == 7.0) and np.all(lse == 7.0) and all(np.all(g == 7.0) for g in grads)
    # Entries past a sequence's keys in use are not read: sequence 1 uses 5 keys, pages
    # 0 and 4; sequence 0 uses 6, pages 3 and 1.
    assert call(table=(3, 1, 0, 4)) == (lib.PYFA_OK, "")
    rows = lambda pages, n: np.concatenate([kv[p * ps:(p + 1) * ps] for p in pages])[:n]
    k_t = np.concatenate([rows([3, 1], 6), rows([0, 4], 5)])
    want = pyfa.attention_varlen(q, k_t, k_t, cu_q, offsets([6, 5]), options=pyfa.Options(backend="cpu"))
    assert same_bits(o, want)
    o[:] = 7.0
    assert call(table=(3, 1, 0, 99), used=(6, 4)) == (lib.PYFA_OK, "")  # page 99 is never reached
    assert same_bits(o, pyfa.attention_varlen(q, np.concatenate([rows([3, 1], 6), rows([0], 4)]),
                                              np.concatenate([rows([3, 1], 6), rows([0], 4)]), cu_q,
                                              offsets([6, 4]), options=pyfa.Options(backend="cpu")))
    # ABI 9's structs end before page_size and block_table: the call runs unpaged, its
    # k the 16 logical rows in order.
    o[:] = 7.0
    abi9 = (ffi.offsetof("pyfa_problem", "page_size"), ffi.offsetof("pyfa_tensors", "block_table"))
    assert call(sizes=abi9, used=(8, 8)) == (lib.PYFA_OK, "")
    assert same_bits(o, pyfa.attention_varlen(q, kv[:16], kv[:16], cu_q, offsets([8, 8]),
                                              options=pyfa.Options(backend="cpu")))
