"""flash-attn's rotary embedding, cache_batch_idx and cache_leftpad in
attention_with_kvcache (pyfa/kvcache.py) and pyfa.torch.flash_attn_with_kvcache. Rotary:
q and k_new turned at their positions before the append, with the bits of turning them by
hand (flash-attn's reference formula, written here apart) and calling without it;
decoding with it through a paged cache, or through a kept plan on fresh arrays, equals
fresh calls and one prefill. cache_batch_idx: the bits of the gathered caches, the
appends in the named slots only. cache_leftpad: the bits of the cache with its padding
cut off. The simulator twin the same bits; every refusal before anything is written."""
import numpy as np
import pytest

import pyfa
import pyfa.sim
from reference import same_bits as _same_bits


def same_bits(a, b):
    """same_bits over tuples (o, lse) too."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    return _same_bits(a, b)


CPU = pyfa.Options(backend="cpu")
rng = np.random.default_rng(21)


def tables(rows, half):
    """cos, sin (rows, half) of RoPE's angles p * theta_j."""
    theta = (10000.0 ** (-np.arange(half) / half)).astype(np.float32)
    angles = np.arange(rows, dtype=np.float32)[:, None] * theta[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def by_hand(x, cos, sin, positions, interleaved):
    """flash-attn's reference, apply_rotary_emb_torch's formula on NumPy float32:
    x * cos + rotate_half(x) * sin on the first rotary_dim dims, cos and sin repeated to
    full width (each product and the sum rounded)."""
    half = cos.shape[1]
    ro = 2 * half
    c, s = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
    if interleaved:
        c, s = np.repeat(c, 2, axis=-1), np.repeat(s, 2, axis=-1)
        x1, x2 = x[..., 0:ro:2], x[..., 1:ro:2]
        turned = np.stack([-x2, x1], axis=-1).reshape(x[..., :ro].shape)
    else:
        c, s = np.concatenate([c, c], axis=-1), np.concatenate([s, s], axis=-1)
        turned = np.concatenate([-x[..., half:ro], x[..., :half]], axis=-1)
    return np.concatenate([x[..., :ro] * c + turned * s, x[..., ro:]], axis=-1).astype(np.float32)


def case(B=2, Nq=3, H=4, Hkv=2, d=32, rows=40):
    q = rng.standard_normal((B, Nq, H, d), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((B, rows, Hkv, d), dtype=np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((B, Nq, Hkv, d), dtype=np.float32) for _ in range(2))
    return q, k_cache, v_cache, k_new, v_new


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("half", [16, 6])  # rotary_dim = d, and 12 of 32 dims
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(4, 0)), {}])
def test_the_rotation_is_flash_attns_formula_bit_for_bit(interleaved, half, mask):
    q, k_cache, v_cache, k_new, v_new = case()
    cos, sin = tables(40, half)
    lens = np.array([5, 20], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    got = pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                      rotary_interleaved=interleaved, return_lse=True, options=CPU, **mask)
    follow = bool(mask)  # causal or a window: the queries are the new rows
    keys = lens[:, None].astype(np.int64) + np.arange(3)
    queries = keys if follow else np.broadcast_to(lens[:, None].astype(np.int64), (2, 3))
    want = pyfa.attention_with_kvcache(by_hand(q, cos, sin, queries, interleaved), kc, vc, lens,
                                       by_hand(k_new, cos, sin, keys, interleaved), v_new, return_lse=True,
                                       options=CPU, **mask)
    assert same_bits(got, want)
    assert np.array_equal(k_cache, kc) and np.array_equal(v_cache, vc)  # the cache holds the turned keys
    rows = np.arange(2)[:, None], keys
    assert not np.array_equal(k_cache[rows], k_new) and np.array_equal(v_cache[rows], v_new)
    k_cache[rows], v_cache[rows] = 0, 0  # the simulator twin appends the same rows anew
    sim = pyfa.sim.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                          rotary_interleaved=interleaved, return_lse=True, **mask)
    assert same_bits(sim, got) and np.array_equal(k_cache, kc) and np.array_equal(v_cache, vc)


def test_decoding_with_rotary_through_a_paged_cache_equals_one_prefill():
    B, H, Hkv, d, n, page = 1, 4, 2, 32, 12, 3
    cos, sin = tables(n, d // 2)
    q, k, v = (rng.standard_normal((B, n, heads, d), dtype=np.float32) for heads in (H, Hkv, Hkv))
    table = rng.permutation(n // page).astype(np.int32)[None]
    k_pages, v_pages = (np.zeros((n // page, page, Hkv, d), np.float32) for _ in range(2))
    kw = dict(causal=True, split_size=64, rotary_cos=cos, rotary_sin=sin, options=CPU)
    steps = [pyfa.attention_with_kvcache(q[:, t:t + 1], k_pages, v_pages, np.array([t], np.int32), k[:, t:t + 1],
                                         v[:, t:t + 1], block_table=table, **kw) for t in range(n)]
    k_dense, v_dense = (np.zeros((B, n, Hkv, d), np.float32) for _ in range(2))
    prefill = pyfa.attention_with_kvcache(q, k_dense, v_dense, np.array([0], np.int32), k, v, **kw)
    assert same_bits(np.concatenate(steps, axis=1), prefill)
    assert np.array_equal(k_pages[table[0]].reshape(k_dense.shape), k_dense)


def test_every_refusal_names_its_argument_and_writes_nothing():
    q, k_cache, v_cache, k_new, v_new = case()
    cos, sin = tables(40, 16)
    lens = np.array([5, 20], np.int32)
    before = k_cache.copy(), v_cache.copy()

    def call(**kw):
        args = dict(k_new=k_new, v_new=v_new, rotary_cos=cos, rotary_sin=sin, options=CPU, causal=True)
        args.update(kw)
        return pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, **args)

    for kw, error, match in [
            (dict(rotary_sin=None), pyfa.InvalidArgumentError, "rotary_cos, rotary_sin: give both"),
            (dict(k_new=None, v_new=None), pyfa.InvalidArgumentError, "rotary_cos: .*give k_new and v_new"),
            (dict(rotary_sin=sin[:, :8]), pyfa.InvalidArgumentError, "rotary_sin: shape"),
            (dict(rotary_cos=tables(40, 17)[0], rotary_sin=tables(40, 17)[1]), pyfa.InvalidArgumentError,
             "rotary_dim = 2 \\* 17 exceeds the head dim 32"),
            (dict(rotary_cos=cos.astype(np.float64)), pyfa.ArgumentTypeError, "rotary_cos: expected dtype float32"),
            (dict(rotary_cos=cos[0]), pyfa.InvalidArgumentError, "rotary_cos: expected shape"),
            (dict(rotary_interleaved=1), pyfa.ArgumentTypeError, "rotary_interleaved: expected a bool"),
            (dict(rotary_cos=cos[:22], rotary_sin=sin[:22]), pyfa.InvalidArgumentError,
             "rotary_cos: 22 rows .* position 22 is needed")]:
        with pytest.raises(error, match=match):
            call(**kw)
    with pytest.raises(pyfa.InvalidArgumentError, match="rotary_cos: .*replays the library's call alone"):
        pyfa.prepare(pyfa.attention_with_kvcache, q, k_cache, v_cache, lens, k_new, v_new, rotary_cos=cos,
                     rotary_sin=sin, options=CPU)
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])


def test_flash_attn_with_kvcache_takes_the_rotary_tables():
    torch = pytest.importorskip("torch")
    import pyfa.torch as pt
    q, k_cache, v_cache, k_new, v_new = case()
    cos, sin = tables(40, 8)
    lens = np.array([5, 20], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    t = torch.from_numpy
    got = pt.flash_attn_with_kvcache(t(q), t(k_cache), t(v_cache), t(k_new), t(v_new), t(cos), t(sin),
                                     cache_seqlens=t(lens), causal=True, rotary_interleaved=False)
    want = pyfa.attention_with_kvcache(q, kc, vc, lens, k_new, v_new, rotary_cos=cos, rotary_sin=sin, causal=True,
                                       rotary_interleaved=False)
    assert same_bits(got.numpy(), want) and np.array_equal(k_cache, kc)
    with pytest.raises(pyfa.InvalidArgumentError, match="rotary_cos: .*give k_new and v_new"):
        pt.flash_attn_with_kvcache(t(q), t(k_cache), t(v_cache), rotary_cos=t(cos), rotary_sin=t(sin),
                                   cache_seqlens=t(lens))


# flash-attn's cache_batch_idx: sequence b's cache is batch element cache_batch_idx[b].
def test_cache_batch_idx_reads_and_appends_to_the_named_batch_elements():
    B, H, Hkv, d, rows, slots = 3, 4, 2, 32, 24, 5
    k_cache, v_cache = (rng.standard_normal((slots, rows, Hkv, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((B, 2, H, d), dtype=np.float32)
    k_new, v_new = (rng.standard_normal((B, 2, Hkv, d), dtype=np.float32) for _ in range(2))
    index = np.array([4, 0, 2], np.int32)
    lens = np.array([7, 0, 19], np.int32)
    gathered = [x[index].copy() for x in (k_cache, v_cache)]
    start = k_cache.copy()
    kw = dict(causal=True, split_size=64, return_lse=True, options=CPU)
    got = pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, cache_batch_idx=index, **kw)
    want = pyfa.attention_with_kvcache(q, *gathered, lens, k_new, v_new, **kw)  # the same caches, gathered
    assert same_bits(got, want)
    assert np.array_equal(k_cache[index], gathered[0]) and np.array_equal(v_cache[index], gathered[1])
    assert np.array_equal(k_cache[[1, 3]], start[[1, 3]])  # the other slots are not written
    sim = pyfa.sim.attention_with_kvcache(q, *[x.copy() for x in gathered], lens, k_new, v_new, causal=True,
                                          split_size=64, return_lse=True)
    assert same_bits(sim, got)
    shared = np.array([1, 1, 3], np.int32)  # read-only, a slot may serve two sequences
    before = k_cache.copy()
    one = pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, cache_batch_idx=shared, **kw)
    two = pyfa.attention_with_kvcache(q, k_cache[shared], v_cache[shared], lens, **kw)
    assert same_bits(one, two) and np.array_equal(k_cache, before)


def test_cache_batch_idx_refusals_name_it_and_write_nothing():
    k_cache, v_cache = (rng.standard_normal((4, 8, 2, 32), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((2, 1, 4, 32), dtype=np.float32)
    k_new, v_new = (rng.standard_normal((2, 1, 2, 32), dtype=np.float32) for _ in range(2))
    lens = np.array([3, 3], np.int32)
    before = k_cache.copy()
    for index, match in [(np.array([1, 1], np.int32), "names a batch element twice"),
                         (np.array([1, 4], np.int32), r"outside \[0, 4\)"),
                         (np.array([1], np.int32), r"expected shape \(2,\)"),
                         (np.array([1, 2], np.int64), "expected dtype int32")]:
        with pytest.raises((pyfa.InvalidArgumentError, pyfa.ArgumentTypeError),
                           match=f"cache_batch_idx: .*{match}"):
            pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, cache_batch_idx=index,
                                        options=CPU)
    with pytest.raises(pyfa.InvalidArgumentError, match="cache_batch_idx: not taken with block_table"):
        pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new,
                                    cache_batch_idx=np.array([0, 1], np.int32),
                                    block_table=np.array([[0], [1]], np.int32), options=CPU)
    assert np.array_equal(k_cache, before)


def test_flash_attn_with_kvcache_takes_cache_batch_idx():
    torch = pytest.importorskip("torch")
    import pyfa.torch as pt
    k_cache, v_cache = (rng.standard_normal((4, 8, 2, 32), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((2, 1, 4, 32), dtype=np.float32)
    index = np.array([3, 0], np.int32)
    t = torch.from_numpy
    got = pt.flash_attn_with_kvcache(t(q), t(k_cache), t(v_cache), cache_batch_idx=t(index), causal=True)
    want = pt.flash_attn_with_kvcache(t(q), t(k_cache[index]), t(v_cache[index]), causal=True)
    assert same_bits(got.numpy(), want.numpy())


def test_a_rotary_decoding_loop_on_fresh_arrays_keeps_its_plan_with_the_bits_of_fresh_calls():
    from pyfa import api, kvcache
    api._plans_of_thread().clear()
    B, H, Hkv, d, n = 2, 4, 2, 32, 6
    cos, sin = tables(16, 12)
    caches = [np.zeros((B, 24, Hkv, d), np.float32) for _ in range(4)]
    steps = [[rng.standard_normal((B, 1, heads, d), dtype=np.float32) for heads in (H, Hkv, Hkv)] for _ in range(n)]
    kw = dict(causal=True, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, return_lse=True, options=CPU)
    planned, runs = [], []
    for t, (q, k_new, v_new) in enumerate(steps):
        lens = np.full(B, t, np.int32)
        planned.append(pyfa.attention_with_kvcache(q.copy(), caches[0], caches[1], lens, k_new.copy(),
                                                   v_new.copy(), **dict(kw, rotary_cos=cos.copy())))
        plans = [p for p in api._plans_of_thread().values() if isinstance(p, kvcache._Plan)]
        assert len(plans) == 1
        if t == 0:
            run = plans[0].run
            plans[0].run = lambda *a: runs.append(1) or run(*a)
    assert len(runs) == n - 1
    fresh = []
    for t, (q, k_new, v_new) in enumerate(steps):
        api._plans_of_thread().clear()
        fresh.append(pyfa.attention_with_kvcache(q, caches[2], caches[3], np.full(B, t, np.int32), k_new, v_new,
                                                 **kw))
    assert all(same_bits(a, b) for a, b in zip(planned, fresh))
    assert np.array_equal(caches[0], caches[2]) and np.array_equal(caches[1], caches[3])
    pyfa.attention_with_kvcache(q, caches[2], caches[3], np.full(B, n, np.int32), k_new, v_new, **kw)
    before = caches[2].copy()
    with pytest.raises(pyfa.InvalidArgumentError, match="rotary_cos: 16 rows .* position 16"):  # a planned call's
        pyfa.attention_with_kvcache(q, caches[2], caches[3], np.full(B, 16, np.int32), k_new, v_new, **kw)
    assert np.array_equal(caches[2], before)


# flash-attn's cache_leftpad: sequence b's cache starts at row cache_leftpad[b].
@pytest.mark.parametrize("extra", [{}, dict(rotary=True), dict(causal=False, window=(3, 0))])
def test_a_left_padded_sequence_has_the_bits_of_its_cache_without_the_padding(extra):
    B, H, Hkv, d, rows = 3, 4, 2, 32, 24
    k_cache, v_cache = (rng.standard_normal((B, rows, Hkv, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((B, 2, H, d), dtype=np.float32)
    k_new, v_new = (rng.standard_normal((B, 2, Hkv, d), dtype=np.float32) for _ in range(2))
    lens, pad = np.array([9, 4, 20], np.int32), np.array([3, 4, 0], np.int32)
    kw = dict(causal=True, split_size=64, return_lse=True, options=CPU)
    kw.update({n: x for n, x in extra.items() if n != "rotary"})
    cos, sin = tables(24, 8)
    rot = dict(rotary_cos=cos, rotary_sin=sin) if extra.get("rotary") else {}
    kc, vc = k_cache.copy(), v_cache.copy()
    o, lse = pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, cache_leftpad=pad, **kw, **rot)
    for b in range(B):  # sequence b alone, its padding cut off (rotary tables shifted: positions are rows)
        p = int(pad[b])
        shifted = dict(rotary_cos=cos[p:], rotary_sin=sin[p:]) if rot else {}
        ob, lseb = pyfa.attention_with_kvcache(q[b:b + 1], kc[b:b + 1, p:], vc[b:b + 1, p:], lens[b:b + 1] - p,
                                               k_new[b:b + 1], v_new[b:b + 1], **kw, **shifted)
        assert same_bits(o[b:b + 1], ob) and same_bits(lse[b:b + 1], lseb)
        assert np.array_equal(k_cache[b, p:], kc[b, p:]) and np.array_equal(v_cache[b, p:], vc[b, p:])
    kc2, vc2 = (x.copy() for x in (kc, vc))  # the simulator twin against the library, on fresh caches
    kc3, vc3 = (x.copy() for x in (kc, vc))
    lib = pyfa.attention_with_kvcache(q, kc2, vc2, lens, k_new, v_new, cache_leftpad=pad, **kw, **rot)
    sim = pyfa.sim.attention_with_kvcache(q, kc3, vc3, lens, k_new, v_new, cache_leftpad=pad,
                                          **{n: x for n, x in kw.items() if n != "options"}, **rot)
    assert same_bits(lib, sim)


def test_left_padding_is_refused_where_it_cannot_be_honoured_and_writes_nothing():
    B, H, Hkv, d, rows = 2, 4, 2, 32, 16
    k_cache, v_cache = (rng.standard_normal((B, rows, Hkv, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((B, 1, H, d), dtype=np.float32)
    k_new, v_new = (rng.standard_normal((B, 1, Hkv, d), dtype=np.float32) for _ in range(2))
    lens = np.array([10, 12], np.int32)
    o, lse = pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, cache_leftpad=lens.copy(), return_lse=True,
                                         options=CPU)
    assert np.all(np.isneginf(lse)) and not o.any()  # padded to the end: no key left
    before = k_cache.copy()
    for kw, match in [(dict(cache_leftpad=np.array([11, 0], np.int32)), r"each must be in \[0, cache_seqlens\[b\]\]"),
                      (dict(cache_leftpad=np.array([-1, 0], np.int32)), r"each must be in \[0, cache_seqlens\[b\]\]"),
                      (dict(cache_leftpad=np.array([1], np.int32)), r"expected shape \(2,\)"),
                      (dict(cache_leftpad=np.array([1, 1], np.int64)), "expected dtype int32"),
                      (dict(cache_leftpad=np.array([1, 1], np.int32), cache_batch_idx=np.array([1, 0], np.int32)),
                       "taken with a dense cache only")]:
        with pytest.raises((pyfa.InvalidArgumentError, pyfa.ArgumentTypeError), match=f"cache_leftpad: {match}"):
            pyfa.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, options=CPU, **kw)
    with pytest.raises(pyfa.InvalidArgumentError, match="cache_leftpad: .*left padding moves their start"):
        pyfa.prepare(pyfa.attention_with_kvcache, q, k_cache, v_cache, lens, k_new, v_new,
                     cache_leftpad=np.array([1, 1], np.int32), options=CPU)
    assert np.array_equal(k_cache, before)


def test_flash_attn_with_kvcache_takes_cache_leftpad():
    torch = pytest.importorskip("torch")
    import pyfa.torch as pt
    k_cache, v_cache = (rng.standard_normal((2, 8, 2, 32), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((2, 1, 4, 32), dtype=np.float32)
    t = torch.from_numpy
    got = pt.flash_attn_with_kvcache(t(q), t(k_cache), t(v_cache), cache_seqlens=t(np.array([8, 6], np.int32)),
                                     cache_leftpad=t(np.array([3, 0], np.int32)), causal=True)
    one = pt.flash_attn_with_kvcache(t(q[:1]), t(k_cache[:1, 3:]), t(v_cache[:1, 3:]), causal=True)
    two = pt.flash_attn_with_kvcache(t(q[1:]), t(k_cache[1:, :6]), t(v_cache[1:, :6]), causal=True)
    assert same_bits(got.numpy(), np.concatenate([one.numpy(), two.numpy()]))
