"""Decoding: merging partial attention states (pyfa.merge_states) and attention against
a KV cache, dense or paged (pyfa.attention_with_kvcache).

merge_states is the simulator's pyfa.sim.merge_states (pyfa/sim/merge.py), the twin of
the library's split-KV combine step (src/common/merge.h); it is imported when first
called, so that `import pyfa` does not load the simulator.
"""

import contextlib
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from . import _arrays, _lib, prepared
from .checks import Pages, c_aligned, check_offsets, check_offsets_shape, refuse_self_overlap
from .errors import ArgumentTypeError, InvalidArgumentError

ArrayOrParts = Union[np.ndarray, Sequence[np.ndarray]]


def merge_states(o_parts: ArrayOrParts, lse_parts: ArrayOrParts) -> Tuple[np.ndarray, np.ndarray]:
    """Folds P partial attention states of the same rows, in ascending part order, by the
    formula of the library's split-KV combine step (docs/numerics.md, "Merging states"),
    bit for bit.

    o_parts: (P, ..., d) float32 NumPy (or a sequence of P arrays (..., d)), each part's
    O normalised by its own sum, as pyfa.fa2_forward returns it; lse_parts: (P, ...)
    their LSE (-inf: a part that saw no key, which contributes nothing). Returns
    (o (..., d), lse (...)), the attention over the union of the parts' keys; a row no
    part saw gets O = 0, LSE = -inf. For cascades or shards merged by hand: attention
    over keys split into P sets equals the merge of the P calls' (o, lse)."""
    from .sim.merge import merge_states as merge
    return merge(o_parts, lse_parts)


def merge_sinks(o: np.ndarray, lse: np.ndarray, sinks: np.ndarray,
                layout: str = "bhnd") -> Tuple[np.ndarray, np.ndarray]:
    """Attention sinks (gpt-oss's learned sinks): a logit sinks[h] per query head that
    joins every row's softmax and carries no value. Returns (o', lse'): the state (o, lse)
    of pyfa.fa2_forward merged by merge_states, part 0 the attention and part 1 the sink
    (O = 0, LSE = sinks[h]), the bits of the combine step; a row that sees no key gets
    O = 0, LSE = sinks[h]. fa2_backward(q, k, v, o', lse', do) is then the gradient of
    q, k, v (the sink adds no dP), and sinks_grad that of the sinks.

    o: (B, H, Nq, d) float32 NumPy in layout "bhnd", (B, Nq, H, d) in "bnhd"; lse:
    (B, H, Nq); sinks: (H,) float32, -inf for a head without one (its rows keep their
    bits). docs/numerics.md, "Attention sinks"."""
    from .sim.merge import merge_sinks as merge
    return merge(o, lse, sinks, layout)


def sinks_grad(o: np.ndarray, lse: np.ndarray, do: np.ndarray, sinks: np.ndarray,
               dlse: Optional[np.ndarray] = None, layout: str = "bhnd") -> np.ndarray:
    """The gradient (H,) of the sinks of merge_sinks' (o', lse') for the incoming gradients
    do (like o') and dlse (like lse', or None): dsinks[h] = sum over b, then i, from +0 of
    exp(sinks[h] - lse'[b, h, i]) * (dlse - D), D = pyfa_dot(dO_i, O'_i) as the backward
    computes it (docs/numerics.md, "Attention sinks")."""
    from .sim.merge import sinks_grad as grad
    return grad(o, lse, do, sinks, dlse, layout)


# ---- the KV cache (flash-attn's flash_attn_with_kvcache)

def _float32(name, x, ndim):
    if not isinstance(x, np.ndarray):
        raise ArgumentTypeError(f"{name}: expected a NumPy float32 array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ArgumentTypeError(f"{name}: expected dtype float32, got {x.dtype}")
    if x.ndim != ndim:
        raise InvalidArgumentError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    return x


def _int32(name, x, ndim):
    x = np.asarray(x)
    if x.dtype != np.int32:
        raise ArgumentTypeError(f"{name}: expected dtype int32, got {x.dtype}")
    if x.ndim != ndim:
        raise InvalidArgumentError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    return x


def _check_new_rows(q, k_cache, v_cache, k_new, v_new):
    """The new rows, written into the caches, alias no other input."""
    for name, x in dict(q=q, k_cache=k_cache, v_cache=v_cache, v_new=v_new).items():
        if np.shares_memory(k_new, x):
            raise InvalidArgumentError(f"k_new and {name}: share memory; the new keys are written "
                                       "into the cache, so they must not alias another input")
    for name, x in dict(q=q, k_cache=k_cache, v_cache=v_cache).items():
        if np.shares_memory(v_new, x):
            raise InvalidArgumentError(f"v_new and {name}: share memory; the new values are written "
                                       "into the cache, so they must not alias another input")
    if np.shares_memory(k_cache, v_cache):
        raise InvalidArgumentError("k_cache and v_cache: share memory, and the new rows are written "
                                   "into both")


class _Cache:
    """The checked arguments of one attention_with_kvcache call: where logical key n of
    sequence b lives (rows(b, n): the (page or batch index, row) of the cache), and the
    new rows to append. __init__ checks what depends on the arrays' kinds, shapes and
    strides; bind() what depends on their addresses and contents, and so can take the
    arrays of a later call of the same kinds (a plan, below)."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, leftpad=None):
        _float32("q", q, 4)
        B, Nq, H, d = q.shape
        if B < 1:
            raise InvalidArgumentError(f"q: batch must be >= 1, got shape {q.shape}")
        _float32("k_cache", k_cache, 4)
        _float32("v_cache", v_cache, 4)
        if v_cache.shape != k_cache.shape:
            raise InvalidArgumentError(f"v_cache: shape {v_cache.shape} differs from k_cache's {k_cache.shape}")
        _, rows, Hkv, dk = k_cache.shape
        if dk != d:
            raise InvalidArgumentError(f"k_cache: head dim {dk} differs from q's {d}")
        if Hkv < 1 or H % Hkv:
            raise InvalidArgumentError(f"k_cache: its {Hkv} heads must divide q's {H} heads")
        seqlens = _int32("cache_seqlens", cache_seqlens, 1)
        if seqlens.shape != (B,):
            raise InvalidArgumentError(f"cache_seqlens: expected shape ({B},), got {seqlens.shape}")
        if (k_new is None) != (v_new is None):
            raise InvalidArgumentError("k_new, v_new: give both or neither")
        self.n_new = 0
        if k_new is not None:
            _float32("k_new", k_new, 4)
            _float32("v_new", v_new, 4)
            if k_new.shape[0] != B or k_new.shape[2:] != (Hkv, d):
                raise InvalidArgumentError(f"k_new: expected shape ({B}, Nnew, {Hkv}, {d}), got {k_new.shape}")
            if v_new.shape != k_new.shape:
                raise InvalidArgumentError(f"v_new: shape {v_new.shape} differs from k_new's {k_new.shape}")
            _check_new_rows(q, k_cache, v_cache, k_new, v_new)
            for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not x.flags.writeable:
                    raise InvalidArgumentError(f"{name}: read-only, but k_new's rows are written into it")
                # An expanded cache (stride 0) would take one sequence's new row over another's.
                refuse_self_overlap(name, x.shape, x.strides, x.itemsize)
            self.n_new = k_new.shape[1]
        table = None
        if block_table is None:
            self.capacity = rows
            if k_cache.shape[0] != B:
                raise InvalidArgumentError(f"k_cache: batch {k_cache.shape[0]} differs from q's {B} "
                                           "(a paged cache takes block_table)")
        else:
            table = _int32("block_table", block_table, 2)
            if table.shape[0] != B or table.shape[1] < 1:
                raise InvalidArgumentError(f"block_table: expected {B} rows (q's batch) of at least one page, "
                                           f"got shape {table.shape}")
            self.page_size = rows
            self.capacity = table.shape[1] * rows
        if leftpad is not None:
            leftpad = _int32("cache_leftpad", leftpad, 1)
            if leftpad.shape != (B,):
                raise InvalidArgumentError(f"cache_leftpad: expected shape ({B},), got {leftpad.shape}")
            if table is not None:
                raise InvalidArgumentError("cache_leftpad: taken with a dense cache only, not with block_table or "
                                           "cache_batch_idx (as in flash-attn's paged cache)")
        self._bind(q, k_cache, v_cache, seqlens, k_new, v_new, table, leftpad)

    def bind(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, leftpad=None):
        """Takes the arrays of a later call, of the kinds, shapes and strides this one was
        made for (NumPy arrays: a plan's key), and checks their addresses and contents as
        __init__ does."""
        if k_new is not None:
            _check_new_rows(q, k_cache, v_cache, k_new, v_new)
        self._bind(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, leftpad)

    def _bind(self, q, k_cache, v_cache, seqlens, k_new, v_new, table, leftpad):
        self.q, self.k_cache, self.v_cache, self.seqlens = q, k_cache, v_cache, seqlens
        self.k_new, self.v_new, self.table, self.leftpad = k_new, v_new, table, leftpad
        self.refresh()

    def release(self):
        """Lets go of the call's arrays (a kept plan must not hold the caller's memory)."""
        self.q = self.k_cache = self.v_cache = self.seqlens = self.k_new = self.v_new = self.table = None
        self.leftpad = None

    def refresh(self):
        """Reads cache_seqlens (and the block table) as they are now and checks them: each
        sequence's keys after the append (self.lengths) within the cache."""
        if np.any(self.seqlens < 0):
            raise InvalidArgumentError(f"cache_seqlens: must be >= 0, got {self.seqlens.tolist()}")
        self.lengths = self.seqlens.astype(np.int64) + self.n_new
        if np.any(self.lengths > self.capacity):
            b = int(np.argmax(self.lengths > self.capacity))
            raise InvalidArgumentError(f"cache_seqlens: sequence {b} holds {int(self.seqlens[b])} keys, with "
                                       f"{self.n_new} new ones {int(self.lengths[b])}, beyond the cache's "
                                       f"{self.capacity}")
        if self.table is not None:
            _check_table(self.table, self.lengths, self.page_size, self.k_cache.shape[0])
        if self.leftpad is not None and np.any((self.leftpad < 0) | (self.leftpad > self.seqlens)):
            raise InvalidArgumentError(f"cache_leftpad: each must be in [0, cache_seqlens[b]], got "
                                       f"{self.leftpad.tolist()} for cache_seqlens {self.seqlens.tolist()}")

    def rows(self, b, n):
        """(index along the cache's axis 0, row) of logical keys n (an int array) of sequence b."""
        if self.table is None:
            return np.full_like(n, b), n
        return self.table[b, n // self.page_size].astype(np.int64), n % self.page_size

    def append(self):
        """Writes the new rows into the caches; returns what undo() needs to put back."""
        saved = []
        for b in range(self.q.shape[0]):
            where = self.rows(b, np.arange(self.seqlens[b], self.lengths[b]))
            saved.append((where, self.k_cache[where].copy(), self.v_cache[where].copy()))
            self.k_cache[where] = self.k_new[b]
            self.v_cache[where] = self.v_new[b]
        return saved

    def undo(self, saved):
        for where, k, v in reversed(saved):
            self.k_cache[where] = k
            self.v_cache[where] = v

    def packed(self):
        """The call as one packed batch, read in place: (q (B * Nq, H, d), k, v (rows,
        Hkv, d), cu_seqlens_q, cu_seqlens_k, seqused_k, pages). A dense cache is its own
        packed k, v: sequence b is its Nmax rows, of which it uses the first lengths[b]
        (seqused_k); pages None. A paged one is its pages as rows, and pages (a
        checks.Pages: pyfa.h's paged K/V) maps the packed logical rows, b * max_pages *
        page_size onwards for sequence b, onto them through the block table."""
        B, Nq, H, d = self.q.shape
        cu_q = _offsets("q", np.full(B, Nq))
        q = self.q.reshape(B * Nq, H, d)
        _, rows, Hkv, _ = self.k_cache.shape
        # Views where each batch's (page's) rows follow the last's.
        k = self.k_cache.reshape(-1, Hkv, d)
        v = self.v_cache.reshape(-1, Hkv, d)
        used = self.lengths.astype(np.int32)
        if self.table is not None:
            cu_k, pages = _paged_rows(self.table, rows, self.k_cache.shape[0])
            return q, k, v, cu_q, cu_k, used, pages
        cu_k = _offsets("k_cache", np.full(B, rows))
        if self.leftpad is not None:
            # Sequence b's keys start leftpad[b] rows into its Nmax; the packed rows start
            # where sequence 0's do, since the first offset is 0.
            first = int(self.leftpad[0])
            k, v = k[first:], v[first:]
            cu_k[:-1] += self.leftpad
            cu_k -= first
            used -= self.leftpad
        return q, k, v, cu_q, cu_k, used, None


def _batch_index_table(index, block_table, q, k_cache, k_new):
    """flash-attn's cache_batch_idx as a block table of one page per sequence, the dense
    cache's batch elements its pages of Nmax rows: (B, 1) int32, a view of `index`."""
    if block_table is not None:
        raise InvalidArgumentError("cache_batch_idx: not taken with block_table (a paged cache's table already "
                                   "says where each sequence's keys are)")
    index = _int32("cache_batch_idx", index, 1)
    B = q.shape[0] if isinstance(q, np.ndarray) and q.ndim == 4 else None
    if B is not None and index.shape != (B,):
        raise InvalidArgumentError(f"cache_batch_idx: expected shape ({B},), got {index.shape}")
    batches = k_cache.shape[0] if isinstance(k_cache, np.ndarray) and k_cache.ndim == 4 else None
    if batches is not None and np.any((index < 0) | (index >= batches)):
        raise InvalidArgumentError(f"cache_batch_idx: {index.tolist()} names batch elements outside "
                                   f"[0, {batches}) of k_cache")
    if k_new is not None and len(np.unique(index)) != len(index):
        raise InvalidArgumentError(f"cache_batch_idx: {index.tolist()} names a batch element twice, and k_new's "
                                   "rows of both sequences would be written into it")
    return index.reshape(-1, 1)


def _check_table(table, lengths, page_size, num_pages):
    """block_table (B, max_pages): the pages sequence b's lengths[b] keys use, each in
    [0, num_pages)."""
    for b in range(table.shape[0]):
        used = table[b, :-(-int(lengths[b]) // page_size)] if lengths[b] else table[b, :0]
        if np.any((used < 0) | (used >= num_pages)):
            raise InvalidArgumentError(f"block_table: sequence {b} names pages {used.tolist()}, "
                                       f"outside [0, {num_pages})")


def _paged_rows(table, page_size, num_pages):
    """flash-attn's (B, max_pages) block table as pyfa.h's paged K/V: sequence b's keys are
    the packed logical rows b * max_pages * page_size onwards (cu_seqlens_k), which the
    flattened table maps onto the pages (a checks.Pages)."""
    B, max_pages = table.shape
    pages = Pages(c_aligned(table.reshape(-1)), page_size, num_pages)
    return _offsets("block_table", np.full(B, max_pages * page_size)), pages


def paged_varlen(k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table):
    """attention_varlen's block_table (flash-attn's flash_attn_varlen_func with one): k, v
    (num_pages, page_size, Hkv, d) pages, int32 block_table (B, max_pages), sequence b's
    keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] logical rows of its table row.
    Returns the packed call's k, v (rows, Hkv, d), cu_seqlens_k, seqused_k and pages."""
    if seqused_k is not None:
        raise InvalidArgumentError("seqused_k: not taken with block_table (cu_seqlens_k gives each "
                                   "sequence's keys there)")
    cu_q = _arrays.host_array("cu_seqlens_q", cu_seqlens_q)
    host = _arrays.host_array("cu_seqlens_k", cu_seqlens_k)
    for name, x in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", host)):
        if not isinstance(x, np.ndarray):
            raise ArgumentTypeError(f"{name}: with block_table, expected a CPU int32 array (the table is "
                                    f"read on the host), got {type(x).__name__}")
    batch = check_offsets_shape("cu_seqlens_q", cu_q.shape, str(cu_q.dtype))
    _float32("k", k, 4)
    _float32("v", v, 4)
    if v.shape != k.shape:
        raise InvalidArgumentError(f"v: shape {v.shape} differs from k's {k.shape} (both pages)")
    num_pages, page_size, Hkv, d = k.shape
    table = _int32("block_table", block_table, 2)
    if table.shape[0] != batch:
        raise InvalidArgumentError(f"block_table: expected {batch} rows (one per sequence), got {table.shape}")
    check_offsets_shape("cu_seqlens_k", host.shape, str(host.dtype), batch)
    cu = check_offsets("cu_seqlens_k", host, int(host[-1]), batch)  # its total: the logical keys
    lengths = np.diff(np.asarray(cu, np.int64))
    capacity = table.shape[1] * page_size
    if np.any(lengths > capacity):
        b = int(np.argmax(lengths > capacity))
        raise InvalidArgumentError(f"cu_seqlens_k: sequence {b} has {int(lengths[b])} keys, beyond the "
                                   f"{capacity} its block_table row maps")
    _check_table(table, lengths, page_size, num_pages)
    cu_k, pages = _paged_rows(table, page_size, num_pages)
    return k.reshape(-1, Hkv, d), v.reshape(-1, Hkv, d), cu_k, lengths.astype(np.int32), pages


def _offsets(name, lengths):
    """int32 offsets (B + 1) of packed rows of these lengths; refused past int32."""
    cu = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))])
    if cu[-1] > np.iinfo(np.int32).max:
        raise InvalidArgumentError(f"{name}: {int(cu[-1])} rows in all, beyond the int32 offsets "
                                   "packed sequences take")
    return cu.astype(np.int32)


class Rotary:
    """flash-attn's rotary embedding in flash_attn_with_kvcache (rotary_cos, rotary_sin,
    rotary_interleaved), applied by attention_with_kvcache to q and k_new before the
    append, so that the cache holds the rotated keys (docs/numerics.md, "Rotary
    embedding"): new key i of sequence b at position cache_seqlens[b] + i, query i at
    cache_seqlens[b] + i where the mask is causal or a window (the queries are the new
    rows), else every query at cache_seqlens[b]. The first rotary_dim = 2 * cos.shape[1]
    dims of each head turn, in pairs (dims 2j and 2j + 1 when interleaved, GPT-J's; j and
    j + rotary_dim / 2 otherwise, GPT-NeoX's), by the angle whose cosine and sine are row
    p, column j of cos and sin; the other dims are kept."""

    def __init__(self, cos, sin, interleaved, q, queries_follow):
        for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
            if not isinstance(x, np.ndarray):
                raise ArgumentTypeError(f"{name}: expected a NumPy float32 array (S_ro, rotary_dim / 2), "
                                        f"got {type(x).__name__}")
            if x.dtype != np.float32:
                raise ArgumentTypeError(f"{name}: expected dtype float32, got {x.dtype}")
            if x.ndim != 2 or x.shape[1] < 1:
                raise InvalidArgumentError(f"{name}: expected shape (S_ro, rotary_dim / 2), got {x.shape}")
        if sin.shape != cos.shape:
            raise InvalidArgumentError(f"rotary_sin: shape {sin.shape} differs from rotary_cos's {cos.shape}")
        if not isinstance(interleaved, (bool, np.bool_)):
            raise ArgumentTypeError(f"rotary_interleaved: expected a bool, got {type(interleaved).__name__}")
        d = q.shape[-1] if isinstance(q, np.ndarray) and q.ndim == 4 else None
        if d is not None and 2 * cos.shape[1] > d:
            raise InvalidArgumentError(f"rotary_cos: rotary_dim = 2 * {cos.shape[1]} exceeds the head dim {d}")
        self.cos, self.sin, self.interleaved, self.queries_follow = cos, sin, bool(interleaved), queries_follow

    @classmethod
    def resolve(cls, cos, sin, interleaved, q, k_new, causal, window):
        """The checked rotary arguments of a call, or None where it has none; its queries
        are the new rows (they follow cache_seqlens) under causal or a window."""
        if cos is None and sin is None:
            return None
        if cos is None or sin is None:
            raise InvalidArgumentError("rotary_cos, rotary_sin: give both or neither")
        if k_new is None:
            raise InvalidArgumentError("rotary_cos: the rotary embedding turns the new keys k_new (and q) "
                                       "before they are appended; give k_new and v_new")
        return cls(cos, sin, interleaved, q, bool(causal) or window is not None)

    def rotate(self, x, positions):
        """A rotated copy of x (B, N, heads, d), row (b, n) at position positions[b, n]:
        each pair (x1, x2) becomes (x1 c - x2 s, x2 c + x1 s), every product and the sum
        rounded to float32 (no fused multiply-add), as flash-attn's reference
        x * cos + rotate_half(x) * sin rounds them."""
        half = self.cos.shape[1]
        c = self.cos[positions][:, :, None, :]
        s = self.sin[positions][:, :, None, :]
        out = np.array(x, dtype=np.float32, order="C")
        first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if self.interleaved else \
            (slice(0, half), slice(half, 2 * half))
        x1, x2 = x[..., first], x[..., second]
        out[..., first] = x1 * c - x2 * s
        out[..., second] = x2 * c + x1 * s
        return out

    def apply(self, cache):
        """cache.q and cache.k_new replaced by rotated copies at their positions (checked
        against cos's rows first: nothing is written on failure)."""
        B, Nq = cache.q.shape[:2]
        start = cache.seqlens.astype(np.int64)[:, None]
        keys = start + np.arange(cache.n_new)
        queries = start + np.arange(Nq) if self.queries_follow else np.broadcast_to(start, (B, Nq))
        last = max(int(keys.max(initial=0)), int(queries.max(initial=0)))
        if last >= self.cos.shape[0]:
            raise InvalidArgumentError(f"rotary_cos: {self.cos.shape[0]} rows (positions 0 to "
                                       f"{self.cos.shape[0] - 1}), but position {last} is needed")
        cache.k_new = self.rotate(cache.k_new, keys)
        cache.q = self.rotate(cache.q, queries)


def with_kvcache(run, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, return_lse, bias=None,
                 sinks=None, plan_key=None, rotary=None, leftpad=None):
    """attention_with_kvcache's steps around `run` (packed q, k, v, cu_q, cu_k, seqused_k,
    pages -> (o (total_q, H, d), lse (H, total_q))), the library's or the simulator's: checks,
    the append (undone if run fails), the packing, and the outputs' shapes. sinks (checked
    (H,) float32, or None): run's to merge; a prepared call's replays check them again.
    plan_key: where the call runs under prepared.capturing(), the key its plan is kept
    under (_Plan). rotary: a Rotary, or None; leftpad: cache_leftpad, or None."""
    if not isinstance(return_lse, (bool, np.bool_)):
        raise ArgumentTypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if bias is not None:  # its key axis would follow the longest cache_seqlens, not Nmax
        raise InvalidArgumentError("bias: pyfa.attention_with_kvcache takes no bias in this version "
                                   "(pyfa.attention_varlen takes one)")
    cache = _Cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, leftpad)
    rec = prepared.recording()
    if leftpad is not None and rec is not None:
        raise InvalidArgumentError(f"cache_leftpad: {rec.function} replays the library's call on the packed rows "
                                   "as they start now, and left padding moves their start; call the function "
                                   "directly")
    if rotary is not None:
        if rec is not None and not rec.quiet:
            raise InvalidArgumentError(f"rotary_cos: {rec.function} replays the library's call alone, and the "
                                       "rotation is pyfa's copies of q and k_new made before it; rotate q and "
                                       "k_new yourself, or call the function directly")
        rotary.apply(cache)
        if rec is not None:  # a plan's capture: the rotated q and k_new are pyfa's, made on each call
            rec.ours += [cache.q, cache.k_new]
    saved = cache.append() if cache.n_new else []
    try:
        packed = cache.packed()
        if rec is not None:
            _prepare(rec, cache, packed)
        o_rows, lse_rows = run(*packed)
    except BaseException:
        cache.undo(saved)
        raise
    o, lse = _results(q.shape, o_rows, lse_rows)
    if rec is not None and len(rec.steps) == 1:  # none where Nq = 0: prepare() refuses that
        (_, _, (_, problem, *_), _, _), = rec.steps  # the one library call, and its pyfa_problem
        rec.replay_around(lambda steps: _replay(steps, cache, packed[5], problem, o_rows, lse_rows, lse, sinks))
        if plan_key is not None and not rec.refused:
            _Plan.keep(plan_key, cache, packed, rec.steps[0], sinks)
    return (o, lse) if return_lse else o


def _results(shape, o_rows, lse_rows):
    """(o (B, Nq, H, d), lse (B, H, Nq)) from the packed call's o (B * Nq, H, d) and lse
    (H, B * Nq), for q of `shape`."""
    B, Nq, H, d = shape
    o = np.asarray(o_rows).reshape(B, Nq, H, d)
    return o, np.ascontiguousarray(np.asarray(lse_rows).reshape(H, B, Nq).transpose(1, 0, 2))


def _prepare(rec, cache, packed):
    """pyfa.prepare's checks of a cache call: what a replay re-reads must be the caller's
    arrays (cache_seqlens, block_table; the library's call has bound the sinks); the
    packed offsets and counts are pyfa's, rewritten by each replay."""
    rec.bound("cache_seqlens", cache.seqlens)
    if cache.table is not None:
        rec.bound("block_table", cache.table)
    if cache.k_new is not None:
        rec.bound("k_new", cache.k_new)
        rec.bound("v_new", cache.v_new)
    rec.ours += [packed[3], packed[4], packed[5]]


def _attend(cache, used, problem, call):
    """A replayed or planned step after its checks: the new rows appended, the attended
    counts and the grid's longest one rewritten, call() (the library call), the append
    undone if it fails."""
    saved = cache.append() if cache.n_new else []
    try:
        used[...] = cache.lengths
        problem.seqlen_k = max(1, int(cache.lengths.max()))
        call()
    except BaseException:
        cache.undo(saved)
        raise


def _replay(steps, cache, used, problem, o_rows, lse_rows, lse, sinks):
    """One replay of a prepared attention_with_kvcache: cache_seqlens (and the table, and
    the sinks' values) read and checked again, then _attend."""
    cache.refresh()
    if sinks is not None:
        from .sim.merge import check_sinks
        check_sinks(sinks, o_rows.shape[1])
    _attend(cache, used, problem, steps)
    B, H, Nq = lse.shape
    np.copyto(lse, lse_rows.reshape(H, B, Nq).transpose(1, 0, 2))


class _Plan:
    """attention_with_kvcache's plan: a call's set-up kept per thread (pyfa/api.py's plans)
    and rebound to a later call on arrays of the same kinds, shapes and strides, as a
    decoding loop without pyfa.prepare makes (pyfa.torch's flash_attn_with_kvcache, a
    model's layers, each step on fresh arrays). The first call runs under
    prepared.capturing(); where it read every array in place, its library structs, its
    packed offsets and counts (pyfa's) and its _Cache are kept, holding none of the
    caller's arrays between calls. A later call: the checks of its arrays' addresses and
    contents (_Cache.bind; the sinks' values were checked by the call), fresh outputs,
    the structs pointed at its arrays, _attend: the bits of the full call, with about a
    quarter of its Python (0.06-0.09 against 0.3-0.35 ms on Zen 4)."""

    def __init__(self, cache, packed, step, fields):
        _, self.config, (self.c_op, self.problem, _, self.tensors, _), _, self.quick = step
        self.cache, self.used, self.fields = cache, packed[5], fields
        self.keep = step, packed[3:6]  # the structs and the offsets and counts they point to
        self.lib = _lib.load()[1]

    @classmethod
    def keep(cls, key, cache, packed, step, sinks):
        """Keeps the captured call's set-up where the library read the caller's arrays
        themselves (no copy) through the fields a later call rebinds."""
        from . import api
        ffi, lib = _lib.load()
        tensors = step[2][3]
        fields = ["q", "k", "v"] + (["block_table"] if cache.table is not None else []) + \
            (["sinks"] if sinks is not None else [])
        arrays = [cache.q, cache.k_cache, cache.v_cache, cache.table, sinks]
        for field, x in zip(fields, [a for a in arrays if a is not None]):
            if int(ffi.cast("intptr_t", getattr(tensors, field).data)) != x.__array_interface__["data"][0]:
                return
        step[1].flags |= lib.PYFA_FLAG_IN_PLACE  # the outputs are fresh arrays of each call's
        cache.release()
        api.keep_plan(key, cls(cache, packed, step, fields))

    def run(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, sinks, return_lse, rotary=None):
        """The call on these arrays (and rotary, a Rotary of tables of the kept call's
        kinds, or None), or None where one the library reads is not aligned to its item
        size (the full call then copies it) or another library has been loaded since."""
        ffi, lib = _lib.load()
        if lib is not self.lib:
            return None
        read = [x for x in (q if rotary is None else None, k_cache, v_cache, block_table, sinks) if x is not None]
        if any(x.__array_interface__["data"][0] % x.itemsize for x in read):
            return None
        B, Nq, H, d = q.shape
        o_rows, lse_rows = np.empty((B * Nq, H, d), np.float32), np.empty((H, B * Nq), np.float32)

        def call():
            cache = self.cache  # q as the library reads it: the caller's, or pyfa's rotated copy
            arrays = [x for x in (cache.q, cache.k_cache, cache.v_cache, cache.table, sinks) if x is not None]
            pointers = [(field, x.__array_interface__["data"][0]) for field, x in zip(self.fields, arrays)]
            for field, address in pointers + [("o", o_rows.__array_interface__["data"][0]),
                                              ("lse", lse_rows.__array_interface__["data"][0])]:
                getattr(self.tensors, field).data = ffi.cast("void *", address)
            with _lib.interrupts_after():
                _lib.call(lib.pyfa_run, self.config, self.c_op, self.problem, self.config, self.tensors, ffi.NULL,
                          quick=self.quick)

        try:
            self.cache.bind(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
            if rotary is not None:
                rotary.apply(self.cache)
            _attend(self.cache, self.used, self.problem, call)
        finally:
            self.cache.release()
        o, lse = _results(q.shape, o_rows, lse_rows)
        return (o, lse) if return_lse else o


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *,
                           block_table=None, causal: bool = False, window=None,
                           scale: Optional[float] = None, split_size=None, return_lse: bool = False,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved: bool = True,
                           cache_batch_idx=None, cache_leftpad=None, options=None, **mods):
    """Attention against a KV cache (flash-attn's flash_attn_with_kvcache), FA2.

    q: (B, Nq, H, d) float32 NumPy (flash-attn's layout); k_cache, v_cache: (B, Nmax, Hkv,
    d), or paged (num_pages, page_size, Hkv, d) with block_table, int32 (B, max_pages):
    logical key n of sequence b is row n % page_size of page block_table[b, n // page_size]
    (any page size >= 1; pages may be shared and in any order). cache_seqlens: int32 (B,),
    the keys each sequence holds. k_new, v_new: (B, Nnew, Hkv, d), written into the
    caller's caches at cache_seqlens **in place** before attending (nothing else is
    written; refused, with nothing written, where cache_seqlens + Nnew exceeds the cache,
    and undone if the attention fails). Sequence b then attends to its
    cache_seqlens[b] + Nnew keys; causal (and window) are aligned bottom-right, so the Nq
    queries are the sequence's last rows. split_size as in pyfa.fa2_forward: with a fixed
    split size, token t decoded step by step through the cache has the bits of row t of
    one prefill. sinks (as in pyfa.attention): float32 (H,), merged into each row's final
    state by the FA2 forward (checked before anything is appended), so that decoding with
    sinks keeps the bits of one prefill with them. rotary_cos, rotary_sin: float32
    (S_ro, rotary_dim / 2), flash-attn's rotary embedding, applied to q and k_new (which
    it needs) before the append, so the cache holds rotated keys: new key i of sequence
    b at position cache_seqlens[b] + i, and so query i where causal or window is set,
    else every query at cache_seqlens[b]; the first rotary_dim dims of each head turn in
    pairs, (2j, 2j + 1) with rotary_interleaved (the default, flash-attn's here), else
    (j, j + rotary_dim / 2); each product and sum rounded to float32 (docs/numerics.md,
    "Rotary embedding"); not under pyfa.prepare. cache_batch_idx (flash-attn's): int32
    (B,), sequence b's cache is batch element cache_batch_idx[b] of a dense k_cache
    (batch_size_cache, Nmax, Hkv, d) of any batch (read, and appended to, as a block
    table of one page of Nmax rows per sequence); with k_new its entries must differ.
    cache_leftpad (flash-attn's): int32 (B,), each in [0, cache_seqlens[b]]: sequence b's
    cache starts at row cache_leftpad[b] (left padding), so it attends to rows
    cache_leftpad[b] to cache_seqlens[b] + Nnew - 1, the mask aligned to that count (the
    rotary positions stay the rows' own); a dense cache only, not under pyfa.prepare.
    Returns o (B, Nq, H, d), or (o, lse) with return_lse, lse (B, H, Nq).

    The call runs as pyfa.attention_varlen, whose rows equal the dense call of each
    sequence alone: a dense cache read in place (its batches as packed sequences of Nmax
    rows, seqused_k the lengths), a paged one as its pages, the kernels finding each
    key's row through the block table (pyfa.h's paged K/V): neither is copied.

    A call that repeats an earlier one on the same thread with NumPy arrays of the same
    shapes, strides, dtypes and writeability (the same keywords and options; no array
    keywords but sinks, no progress) reuses that call's set-up, checking again what
    depends on the arrays' addresses and contents (cache_seqlens, block_table or
    cache_batch_idx, the sinks, the positions the rotary tables cover, aliasing of k_new
    and v_new), the rotation made afresh: the same bits, about a quarter of the Python
    per step (pyfa/kvcache.py, _Plan). pyfa.prepare, binding the arrays once, saves the
    rest."""
    from . import api, varlen

    options, mods = api._keywords("pyfa.attention_with_kvcache", options, mods)
    # Checked here, before with_kvcache appends k_new and v_new to the caller's caches.
    sinks = api._sinks_keyword("pyfa.attention_with_kvcache", mods, "fa2", q, "bnhd")
    rotary = Rotary.resolve(rotary_cos, rotary_sin, rotary_interleaved, q, k_new, causal, window)
    if cache_batch_idx is not None:
        block_table = _batch_index_table(cache_batch_idx, block_table, q, k_cache, k_new)
    arrays = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, sinks)
    # Left padding moves where the packed keys start, which plans do not rebind.
    key = None if cache_leftpad is not None else api.plan_key(
        "pyfa.attention_with_kvcache", arrays + (rotary_cos, rotary_sin),
        (causal, window, scale, split_size, return_lse, rotary_interleaved, *sorted(mods.items())), options)
    plan = api._plans_of_thread().get(key) if key is not None else None
    if plan is not None:
        result = plan.run(*arrays, return_lse, rotary)
        if result is not None:
            return result

    def run(q_p, k_p, v_p, cu_q, cu_k, used, pages):
        return varlen.run("fa2_forward", dict(q=q_p, k=k_p, v=v_p), cu_q, cu_k, causal=causal,
                          window=window, scale=scale, options=options, mods=mods,
                          function="pyfa.attention_with_kvcache", split_size=split_size, seqused_k=used,
                          pages=pages, sinks=sinks)

    # A call that may be kept runs under capturing(), which records its set-up for _Plan.
    capture = contextlib.nullcontext() if key is None else \
        prepared.capturing("pyfa.attention_with_kvcache", [x for x in arrays if x is not None])
    with capture:
        return with_kvcache(run, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, return_lse,
                            mods.get("bias"), sinks, key, rotary, cache_leftpad)
