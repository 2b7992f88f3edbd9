"""pyfa.prepare: a call set up once and replayed on the same arrays gives the bits of the
function called afresh on their current contents, writes the same output arrays, and
is refused, with nothing written, wherever a replay could differ from a fresh call."""

import numpy as np
import pytest

import pyfa

BACKENDS = ["emu", "cpu"]


def _arrays(rng, b=2, h=4, hkv=2, nq=37, nk=53, d=32, layout="bhnd"):
    def make(heads, n):
        shape = (b, heads, n, d) if layout == "bhnd" else (b, n, heads, d)
        return rng.standard_normal(shape, dtype=np.float32)
    return make(h, nq), make(hkv, nk), make(hkv, nk), make(h, nq)


def _refill(rng, *arrays):
    for a in arrays:
        a[...] = rng.standard_normal(a.shape, dtype=np.float32)


def _same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


# (function, which of q, k, v, do it takes, keywords): masks, GQA, layouts and every score
# modification, each replayed on new contents.
CASES = [
    ("fa2_forward", "qkv", dict(causal=True)),
    ("fa2_forward", "qkv", dict(window=(9, 4), layout="bnhd")),
    ("fa2_forward", "qkv", dict(split_size="decode", softcap=3.0)),
    ("fa1_forward", "qkv", dict(causal=True, causal_align="top_left")),
    ("attention", "qkv", dict(algo="fa1", dropout_p=0.25, seed=7)),
    ("attention", "qkv", dict(alibi_slopes="array")),
    ("attention_grad", "qkvd", dict(causal=True, bias="array")),
    ("attention_grad", "qkvd", dict(algo="fa1", window=(None, 3), softcap=2.0)),
    ("attention_grad", "qkvd", dict(split_size="decode", bias="array", bias_grad=False)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,takes,kw", CASES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_replay_equals_a_fresh_call(backend, name, takes, kw):
    rng = np.random.default_rng(len(name) + len(kw))
    layout = kw.get("layout", "bhnd")
    q, k, v, do = _arrays(rng, layout=layout)
    kw = dict(kw, options=pyfa.Options(backend=backend))
    if kw.get("alibi_slopes") == "array":
        kw["alibi_slopes"] = rng.uniform(0, 1, (2, 4)).astype(np.float32)
    if kw.get("bias") == "array":
        kw["bias"] = rng.standard_normal((2, 1, q.shape[2], k.shape[2]), dtype=np.float32)
    args = (q, k, v, do) if takes == "qkvd" else (q, k, v)
    fn = getattr(pyfa, name)
    p = pyfa.prepare(fn, *args, **kw)
    assert _same(p.result, fn(*args, **kw))
    first = p.result if isinstance(p.result, tuple) else (p.result,)
    for _ in range(2):
        _refill(rng, *args, *(x for x in (kw.get("alibi_slopes"), kw.get("bias")) if x is not None))
        got = p()
        assert got is p.result  # the same arrays, written again
        assert _same(got, fn(*args, **kw))
    assert all(x is y for x, y in zip(first, got if isinstance(got, tuple) else (got,)))


def test_replay_writes_the_callers_out_arrays_in_place():
    rng = np.random.default_rng(1)
    q, k, v, do = _arrays(rng)
    o, lse = np.empty_like(q), np.empty(q.shape[:3], np.float32)
    p = pyfa.prepare(pyfa.fa2_forward, q, k, v, out=(o, lse), options=pyfa.Options(backend="cpu"))
    assert p.result[0] is o and p.result[1] is lse
    _refill(rng, q, k, v)
    p()
    assert _same((o, lse), pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu")))


def test_a_prepared_decoding_step_reads_what_is_written_in_place():
    # Prepared on zeros, then given token t's query and the cache's first t + 1 rows in
    # place: the replay has the bits of row t of one prefill with the decode split size.
    rng = np.random.default_rng(2)
    d, n = 32, 48
    q_all = rng.standard_normal((1, 4, n, d), dtype=np.float32)
    k_all, v_all = (rng.standard_normal((1, 2, n, d), dtype=np.float32) for _ in range(2))
    opts = pyfa.Options(backend="cpu")
    prefill, _ = pyfa.fa2_forward(q_all, k_all, v_all, causal=True, split_size="decode", options=opts)
    for t in (0, 17, n - 1):
        q, k, v = np.zeros((1, 4, 1, d), np.float32), *(np.zeros((1, 2, t + 1, d), np.float32) for _ in "kv")
        step = pyfa.prepare(pyfa.fa2_forward, q, k, v, split_size="decode", options=opts)
        q[...], k[...], v[...] = q_all[:, :, t:t + 1], k_all[:, :, :t + 1], v_all[:, :, :t + 1]
        assert np.array_equal(step()[0][:, :, 0], prefill[:, :, t])


@pytest.mark.parametrize("case", ["strided k", "list slopes", "strided out", "torch", "empty",
                                  "function", "arguments"])
def test_refused_with_nothing_written(case):
    rng = np.random.default_rng(3)
    q, k, v, _ = _arrays(rng)
    o = np.full_like(q, 7.0)
    kw, args, fn = dict(out=o), (q, k, v), pyfa.attention
    if case == "strided k":
        wide = rng.standard_normal(k.shape[:3] + (2 * k.shape[3],), dtype=np.float32)
        args, match = (q, wide[..., ::2], v), "^k: "
    elif case == "list slopes":
        kw["alibi_slopes"], match = [0.5] * 4, "^alibi_slopes: "
    elif case == "strided out":
        o = np.full(q.shape[::-1], 7.0, np.float32).T
        kw["out"], match = o, r"^out \(o\): not C-contiguous"
    elif case == "torch":
        torch = pytest.importorskip("torch")
        args, match = (torch.from_numpy(q), k, v), "^q: .*NumPy arrays only"
    elif case == "empty":
        args, kw, match = (q[:, :, :0], k, v), {}, "Nq = 0 or Nk = 0"
    elif case == "function":
        fn, match = pyfa.attention_varlen, "^function: "
    else:
        args, match = (q, k), "missing a required argument: 'v'"
    with pytest.raises((pyfa.InvalidArgumentError, pyfa.ArgumentTypeError), match=match):
        pyfa.prepare(fn, *args, **kw)
    if case != "empty":
        assert np.all(o == 7.0)


@pytest.mark.parametrize("given", [False, True])
def test_a_replay_cancelled_by_progress_raises_and_writes_nothing(given):
    # Outputs pyfa allocated are the caller's once returned: a failed replay leaves them
    # as they were, as it leaves out= arrays.
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 4, 256, 64), dtype=np.float32)
    stop = [False]
    opts = pyfa.Options(backend="cpu", threads=1, block_r=32, progress=lambda done, total: stop[0])
    p = pyfa.prepare(pyfa.attention, q, q, q, out=np.empty_like(q) if given else None, options=opts)
    before = p.result.copy()
    stop[0] = True
    q[...] = 0
    with pytest.raises(pyfa.CancelledError):
        p()
    assert np.array_equal(p.result, before)
    stop[0] = False
    assert _same(p(), pyfa.attention(q, q, q, options=pyfa.Options(backend="cpu")))


@pytest.mark.parametrize("page_size", [None, 1, 3, 16])
def test_decoding_token_by_token_through_a_prepared_cache_call_equals_one_prefill(page_size):
    # The loop a server runs: one prepared attention_with_kvcache step, each replay given the
    # next token's q, k_new, v_new in place and cache_seqlens advanced by one. Row t of every
    # sequence has the bits of row t of one prefill of that sequence (the decode split size).
    rng = np.random.default_rng(5 + (page_size or 0))
    B, H, Hkv, d, N = 3, 4, 2, 32, 40
    opts = pyfa.Options(backend="cpu")
    qs = rng.standard_normal((B, N, H, d), dtype=np.float32)
    ks, vs = (rng.standard_normal((B, N, Hkv, d), dtype=np.float32) for _ in range(2))
    table = None
    if page_size is None:
        k_cache = np.zeros((B, N, Hkv, d), np.float32)
    else:
        per = -(-N // page_size)
        table = rng.permutation(B * per).astype(np.int32).reshape(B, per)
        k_cache = np.zeros((B * per, page_size, Hkv, d), np.float32)
    v_cache = np.zeros_like(k_cache)
    lens = np.zeros(B, np.int32)
    q, k_new, v_new = np.zeros((B, 1, H, d), np.float32), *(np.zeros((B, 1, Hkv, d), np.float32) for _ in "kv")
    q[:, 0], k_new[:, 0], v_new[:, 0] = qs[:, 0], ks[:, 0], vs[:, 0]
    step = pyfa.prepare(pyfa.attention_with_kvcache, q, k_cache, v_cache, lens, k_new, v_new,
                        block_table=table, causal=True, split_size="decode", return_lse=True, options=opts)
    o, lse = step.result
    got_o, got_lse = [o.copy()], [lse.copy()]
    for t in range(1, N):
        lens += 1
        q[:, 0], k_new[:, 0], v_new[:, 0] = qs[:, t], ks[:, t], vs[:, t]
        assert step() is step.result
        got_o.append(o.copy())
        got_lse.append(lse.copy())
    for b in range(B):
        ref_o, ref_lse = pyfa.fa2_forward(qs[b:b + 1], ks[b:b + 1], vs[b:b + 1], causal=True, layout="bnhd",
                                          split_size="decode", options=opts)
        assert np.array_equal(np.stack([g[b, 0] for g in got_o]), ref_o[0])
        assert np.array_equal(np.stack([g[b, :, 0] for g in got_lse], axis=1), ref_lse[0])


def test_a_cache_replay_past_the_cache_is_refused_with_nothing_written():
    rng = np.random.default_rng(6)
    B, H, d, N = 2, 2, 16, 8
    k_cache, v_cache = (rng.standard_normal((B, N, H, d), dtype=np.float32) for _ in range(2))
    q, k_new, v_new = (rng.standard_normal((B, 1, H, d), dtype=np.float32) for _ in range(3))
    lens = np.array([3, 5], np.int32)
    step = pyfa.prepare(pyfa.attention_with_kvcache, q, k_cache, v_cache, lens, k_new, v_new,
                        options=pyfa.Options(backend="cpu"))
    before = [x.copy() for x in (k_cache, v_cache, step.result)]
    lens[1] = N
    with pytest.raises(pyfa.InvalidArgumentError, match="^cache_seqlens: sequence 1 holds 8 keys"):
        step()
    assert all(np.array_equal(x, y) for x, y in zip((k_cache, v_cache, step.result), before))
    lens[1] = -1
    with pytest.raises(pyfa.InvalidArgumentError, match="^cache_seqlens: must be >= 0"):
        step()
    assert all(np.array_equal(x, y) for x, y in zip((k_cache, v_cache, step.result), before))


def test_a_cache_call_needs_the_lengths_as_an_array_it_can_read_again():
    # Refused after the checks that need the append: the append is undone.
    rng = np.random.default_rng(7)
    k_cache, v_cache = (rng.standard_normal((1, 8, 2, 16), dtype=np.float32) for _ in range(2))
    q, k_new, v_new = (rng.standard_normal((1, 1, 2, 16), dtype=np.float32) for _ in range(3))
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(pyfa.ArgumentTypeError, match="^cache_seqlens: "):  # a list of ints is int64
        pyfa.prepare(pyfa.attention_with_kvcache, q, k_cache, v_cache, [4], k_new, v_new)
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])
