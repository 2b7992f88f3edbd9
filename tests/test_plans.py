"""Kept set-ups of host calls (pyfa/api.py, "Plans"): a call that differs from an earlier
one on the same thread only in its arrays' contents and addresses reuses that call's
checked structs; anything else takes the full path, with its checks."""
import threading

import numpy as np
import pytest

import pyfa
from pyfa import api

OPTS = pyfa.Options(backend="cpu")
rng = np.random.default_rng(11)


def qkv(shape=(2, 4, 33, 32)):
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]


@pytest.fixture(autouse=True)
def no_plans():
    api._plans_of_thread().clear()
    yield
    api._plans_of_thread().clear()


def test_a_repeated_call_reuses_its_plan_with_the_bits_of_a_fresh_one():
    q, k, v = qkv()
    first = pyfa.fa2_forward(q, k, v, causal=True, options=OPTS)
    plans = api._plans_of_thread()
    assert len(plans) == 1
    (plan,) = plans.values()
    calls = []
    run = plan.run
    plan.run = lambda *a: calls.append(1) or run(*a)
    q2, k2, v2 = qkv()
    again = pyfa.fa2_forward(q2, k2, v2, causal=True, options=OPTS)
    assert calls == [1] and len(plans) == 1
    plans.clear()
    fresh = pyfa.fa2_forward(q2, k2, v2, causal=True, options=OPTS)
    assert all(np.array_equal(a, b) for a, b in zip(again, fresh))
    assert not any(np.shares_memory(a, b) for a in again for b in first)  # outputs are new arrays


def test_what_a_plan_is_keyed_by():
    q, k, v = qkv()
    pyfa.fa2_forward(q, k, v, causal=True, options=OPTS)
    pyfa.fa2_forward(q, k, v, causal=1, options=OPTS)  # another type: checked again, kept apart
    pyfa.fa2_forward(q, k, v, causal=True, options=pyfa.Options(backend="cpu", threads=1))
    pyfa.fa2_forward(q[:, :, :20], k, v, causal=True, options=OPTS)  # another shape (and strides)
    pyfa.fa2_forward(q, k, v, causal=True, options=OPTS, out=(None, None))  # out of Nones: its own key
    assert len(api._plans_of_thread()) == 5
    with pytest.raises(pyfa.ArgumentTypeError, match="out: expected a tuple of 2"):
        pyfa.fa2_forward(q, k, v, causal=True, options=OPTS, out=(None,))
    with pytest.raises(pyfa.InvalidArgumentError, match="head dim"):
        pyfa.fa2_forward(q, k[..., :16], v, causal=True, options=OPTS)


def test_calls_with_arrays_pyfa_checks_or_copies_are_not_kept():
    q, k, v = qkv()
    o = np.empty_like(q)
    pyfa.fa2_forward(q, k, v, options=OPTS, out=(o, None))                 # an out= array
    pyfa.fa2_forward(q, k, v, options=OPTS, softcap=2.0, alibi_slopes=np.ones(4, np.float32))
    pyfa.fa2_forward(np.asfortranarray(q), k, v, options=OPTS)            # copied: not in place
    pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu", progress=lambda d, t: False))
    assert len(api._plans_of_thread()) == 0


def test_sinks_are_rebound_and_checked_on_every_call():
    q, k, v = qkv()
    sinks = [rng.standard_normal(4).astype(np.float32) for _ in range(3)]
    got = [pyfa.attention(q, k, v, causal=True, sinks=s, options=OPTS) for s in sinks]
    got.append(pyfa.attention(q, k, v, causal=True, sinks=np.repeat(sinks[0], 2)[::2], options=OPTS))  # strided
    assert len(api._plans_of_thread()) == 2
    with pytest.raises(pyfa.InvalidArgumentError, match="sinks: must be finite"):
        pyfa.attention(q, k, v, causal=True, sinks=np.full(4, np.nan, np.float32), options=OPTS)
    api._plans_of_thread().clear()
    want = [pyfa.attention(q, k, v, causal=True, sinks=s, options=OPTS) for s in sinks + [sinks[0]]]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert not np.array_equal(got[0], got[1])


def test_a_misaligned_array_takes_the_full_path():
    q, k, v = qkv((1, 2, 16, 32))
    pyfa.fa2_forward(q, k, v, options=OPTS)
    buf = np.zeros(q.nbytes + 2, np.uint8)
    q_off = np.frombuffer(buf.data, np.float32, q.size, offset=2).reshape(q.shape)  # off a float's alignment
    q_off[...] = q
    assert q_off.strides == q.strides and q_off.__array_interface__["data"][0] % 4
    got = pyfa.fa2_forward(q_off, k, v, options=OPTS)
    want = pyfa.fa2_forward(q, k, v, options=OPTS)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("function", ["forward", "grad"])
def test_packed_sequences_of_new_lengths_reuse_the_plan_of_their_kind(function):
    H, d, T = 4, 32, 60
    q, k, v, do = (rng.standard_normal((T, H, d), dtype=np.float32) for _ in range(4))
    kw = dict(causal=True, options=OPTS, split_size=64)

    def call(cu_q, cu_k, **extra):
        if function == "forward":
            return pyfa.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw, **extra)
        return pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, **kw, **extra)

    call(_offsets([20, 30, 10]), _offsets([25, 5, 30]))
    plans = dict(api._plans_of_thread())
    assert len(plans) == (1 if function == "forward" else 2)  # attention_varlen_grad: forward, backward
    runs = []
    for plan in plans.values():
        run = plan.run
        plan.run = lambda *a, run=run: runs.append(1) or run(*a)
    cases = [(_offsets([0, 60, 0]), _offsets([10, 40, 10])),   # empty sequences, other longest ones
             (_offsets([1, 1, 58]), _offsets([58, 1, 1]))]
    got = [call(*c) for c in cases]
    assert len(runs) == len(got) * len(plans) and len(api._plans_of_thread()) == len(plans)
    extra = [dict(seqused_k=np.array([3, 0, 7], np.int32))] if function == "forward" else []
    for e in extra:  # counts (attention_varlen's): another kind, its own plan
        got.append(call(*cases[0], **e))
        assert len(api._plans_of_thread()) == 2 * len(plans)
    api._plans_of_thread().clear()
    want = [call(*c) for c in cases] + [call(*cases[0], **e) for e in extra]
    for a, b in zip(got, want):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(pyfa.InvalidArgumentError, match="cu_seqlens_q"):
        call(_offsets([30, 40, -10]), cases[0][1])  # checked on every call


def test_plans_are_per_thread():
    q, k, v = qkv()
    pyfa.fa2_forward(q, k, v, options=OPTS)
    seen = []
    t = threading.Thread(target=lambda: seen.append(len(api._plans_of_thread())))
    t.start()
    t.join()
    assert seen == [0] and len(api._plans_of_thread()) == 1


def test_the_cache_keeps_a_bounded_number_of_plans():
    q, k, v = qkv((1, 1, 70, 16))
    for n in range(1, api._PLAN_LIMIT + 6):
        pyfa.fa2_forward(q[:, :, :n], k, v, options=OPTS)
    assert len(api._plans_of_thread()) == api._PLAN_LIMIT


# attention_with_kvcache's own plans (pyfa/kvcache.py, _Plan): a decoding loop on fresh
# arrays of the same kinds rebinds the first call's set-up.
def _cache_case(paged, B=2, H=4, Hkv=2, d=32, page=5, pages=14, rows=24):
    shape = (pages, page, Hkv, d) if paged else (B, rows, Hkv, d)
    k_cache, v_cache = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    table = rng.permutation(pages).astype(np.int32).reshape(B, -1) if paged else None
    return k_cache, v_cache, table


def _steps(n, B=2, H=4, Hkv=2, d=32):
    """n decoding steps' fresh (q, k_new, v_new)."""
    return [tuple(rng.standard_normal((B, 1, heads, d), dtype=np.float32) for heads in (H, Hkv, Hkv))
            for _ in range(n)]


def _kvplans():
    from pyfa import kvcache
    return [p for p in api._plans_of_thread().values() if isinstance(p, kvcache._Plan)]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("extra", [{}, {"split_size": 64, "causal": True, "sinks": "yes", "softcap": 3.0}])
def test_a_decoding_loop_on_fresh_arrays_reuses_its_plan_with_the_bits_of_fresh_calls(paged, extra):
    kw = dict(extra, return_lse=True, options=OPTS)
    if kw.get("sinks") == "yes":
        kw["sinks"] = rng.standard_normal(4).astype(np.float32)
    k_cache, v_cache, table = _cache_case(paged)
    kc, vc = k_cache.copy(), v_cache.copy()
    steps = _steps(6)
    planned, fresh = [], []
    for n, (q, k_new, v_new) in enumerate(steps):
        lens = np.array([3 + n, 9 + n], np.int32)  # a fresh cache_seqlens each step, as a loop makes
        planned.append(pyfa.attention_with_kvcache(q.copy(), k_cache, v_cache, lens, k_new.copy(), v_new.copy(),
                                                   block_table=table, **kw))
        assert len(_kvplans()) == 1
    runs = []
    plan, = _kvplans()
    run = plan.run
    plan.run = lambda *a: runs.append(1) or run(*a)
    q, k_new, v_new = _steps(1)[0]
    planned.append(pyfa.attention_with_kvcache(q, k_cache, v_cache, np.array([9, 15], np.int32), k_new, v_new,
                                               block_table=table, **kw))
    assert runs == [1]
    for n, (q, k_new, v_new) in enumerate(steps + [(q, k_new, v_new)]):
        api._plans_of_thread().clear()
        lens = np.array([3 + n, 9 + n], np.int32)
        fresh.append(pyfa.attention_with_kvcache(q, kc, vc, lens, k_new, v_new, block_table=table, **kw))
    assert np.array_equal(k_cache, kc) and np.array_equal(v_cache, vc)
    for a, b in zip(planned, fresh):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.shares_memory(planned[-1][0], planned[-2][0])  # each call's outputs are its own


def test_a_kept_plan_holds_none_of_the_callers_arrays():
    import gc
    import weakref
    k_cache, v_cache, table = _cache_case(True)
    q, k_new, v_new = _steps(1)[0]
    lens = np.array([3, 9], np.int32)
    refs = [weakref.ref(x) for x in (q, k_cache, v_cache, table, k_new, v_new, lens)]
    pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, block_table=table, options=OPTS)
    assert len(_kvplans()) == 1
    del q, k_cache, v_cache, table, k_new, v_new, lens
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_planned_call_checks_what_it_reads_and_writes_nothing_on_failure(monkeypatch):
    k_cache, v_cache, table = _cache_case(True)
    q, k_new, v_new = _steps(1)[0]
    # New rows as views of (B, 1, H, d) arrays: strides that a view of q can have too.
    k_new, v_new = (np.concatenate([x, x], axis=2)[:, :, :2] for x in (k_new, v_new))
    sinks = np.zeros(4, np.float32)
    call = dict(block_table=table, sinks=sinks, options=OPTS)
    pyfa.attention_with_kvcache(q, k_cache, v_cache, np.array([3, 9], np.int32), k_new, v_new, **call)
    assert len(_kvplans()) == 1
    before = k_cache.copy(), v_cache.copy()

    def unchanged():
        return np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])

    with pytest.raises(pyfa.InvalidArgumentError, match="cache_seqlens: sequence 1 holds 35 keys"):
        pyfa.attention_with_kvcache(q, k_cache, v_cache, np.array([3, 35], np.int32), k_new, v_new, **call)
    bad = table.copy()
    bad[0, 0] = 99
    with pytest.raises(pyfa.InvalidArgumentError, match="block_table: sequence 0 names pages"):
        pyfa.attention_with_kvcache(q, k_cache, v_cache, np.array([3, 9], np.int32), k_new, v_new,
                                    **dict(call, block_table=bad))
    with pytest.raises(pyfa.InvalidArgumentError, match="sinks: must be finite"):
        pyfa.attention_with_kvcache(q, k_cache, v_cache, np.array([3, 9], np.int32), k_new, v_new,
                                    **dict(call, sinks=np.full(4, np.nan, np.float32)))
    with pytest.raises(pyfa.InvalidArgumentError, match="k_new and q: share memory"):
        pyfa.attention_with_kvcache(q, k_cache, v_cache, np.array([3, 9], np.int32), q[:, :, 2:], v_new, **call)
    assert unchanged() and len(_kvplans()) == 1

    def failing(*args, **kwargs):
        raise pyfa.CancelledError("cancelled (stand-in)")
    monkeypatch.setattr(pyfa._lib, "call", failing)
    with pytest.raises(pyfa.CancelledError):
        pyfa.attention_with_kvcache(q, k_cache, v_cache, np.array([3, 9], np.int32), k_new, v_new, **call)
    assert unchanged()  # the append is undone


def test_kvcache_calls_that_copy_are_not_kept_and_a_misaligned_one_takes_the_full_path():
    k_cache, v_cache, _ = _cache_case(False)
    q, k_new, v_new = _steps(1)[0]
    lens = np.array([3, 9], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    pyfa.attention_with_kvcache(np.asfortranarray(q), k_cache, v_cache, lens, options=OPTS)  # q copied
    pyfa.attention_with_kvcache(q, k_cache, v_cache, lens,
                                options=pyfa.Options(backend="cpu", progress=lambda d, t: False))
    assert _kvplans() == []
    want = pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, options=OPTS)
    assert len(_kvplans()) == 1
    buf = np.zeros(q.nbytes + 2, np.uint8)
    q_off = np.frombuffer(buf.data, np.float32, q.size, offset=2).reshape(q.shape)
    q_off[...] = q
    got = pyfa.attention_with_kvcache(q_off, kc, vc, lens, k_new, v_new, options=OPTS)
    assert np.array_equal(got, want) and np.array_equal(kc, k_cache)


def test_prepare_of_a_kvcache_call_with_no_query_is_refused_by_name():
    k_cache, v_cache, _ = _cache_case(False)
    q = np.zeros((2, 0, 4, 32), np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="Nq = 0 or Nk = 0, so no kernel runs"):
        pyfa.prepare(pyfa.attention_with_kvcache, q, k_cache, v_cache, np.array([3, 9], np.int32), options=OPTS)
