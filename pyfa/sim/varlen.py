"""Packed sequences (varlen), simulated: the twin of the kernels run with cu_seqlens.

A packed call's grid is the dense one over B sequences, each block finding its sequence's
rows, lengths and mask (off = Nk_b - Nq_b bottom-right) from the offsets, and a block
past its sequence's rows returning at once (src/common/params.h, Sequence). Every other
block walks exactly the tiles, and does exactly the fp32 operations, of the dense call of
its sequence alone; so the faithful mirror is that dense simulated kernel run on each
sequence in turn, its outputs written to the sequence's rows. The IO record is the sum of
the sequences' records; an empty sequence (no queries or no keys), which the dense
simulator answers without a kernel, is counted as the varlen kernels move its bytes
(count.count_io_varlen). A bias (B, H, max_seqlen_q, max_seqlen_k) gives each sequence
its corner; its dBias starts at +0 whole, each sequence's kernels clear the rows beyond
their own of their keys, and the fold over a broadcast B or H is the dense one's.
"""

import numpy as np

from ..checks import (VARLEN_SHAPES, Bias, check_bias, check_max_seqlen, check_offsets, check_qkv,
                      check_seqused, check_varlen_rank)
from ..errors import InvalidArgumentError
from ..options import resolve
from . import score
from .count import count_io_varlen
from .fa1_backward import fa1_backward
from .fa1_forward import fa1_forward
from .fa2_backward import fa2_backward
from .fa2_forward import fa2_forward
from .io import IORecord
from .tiles import launch_grid

__all__ = ["attention_varlen", "fa1_backward_varlen", "fa1_forward_varlen", "fa2_backward_varlen",
           "fa2_forward_varlen"]

# The dense simulated kernels by (algo, pass), their tensor arguments in order.
_KERNELS = {
    ("fa2", "forward"): (fa2_forward, ("q", "k", "v")),
    ("fa2", "backward"): (fa2_backward, ("q", "k", "v", "o", "lse", "do")),
    ("fa1", "forward"): (fa1_forward, ("q", "k", "v")),
    ("fa1", "backward"): (fa1_backward, ("q", "k", "v", "o", "m", "l", "do")),
}
_KEY_ROWS = ("k", "v", "dk", "dv")
_STATS = ("lse", "m", "l")


def _run(algo, passes, function, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
         options, kwargs, seqused_k=None, pages=None):
    kernel, names = _KERNELS[(algo, passes)]
    for name in names:
        if name not in _STATS:
            check_varlen_rank(name, np.shape(tensors[name]))
    q4, k4, _, _, heads_kv = check_qkv(tensors["q"], tensors["k"], tensors["v"], "bnhd")
    H, d = q4.shape[1], q4.shape[3]
    offsets_q = check_offsets("cu_seqlens_q", cu_seqlens_q, q4.shape[2])
    # Paged (a checks.Pages), k and v hold the pages and the offsets count logical rows.
    total_k = k4.shape[2] if pages is None else pages.logical_rows
    offsets_k = check_offsets("cu_seqlens_k", cu_seqlens_k, total_k, len(offsets_q) - 1)
    # Sequence b's keys: rows ka .. kz - 1, the first seqused_k[b] of its own where given.
    used = check_seqused("seqused_k", seqused_k, offsets_k)
    lengths = used if used is not None else np.diff(offsets_k).tolist()
    key_rows = [(a, a + n) for a, n in zip(offsets_k, lengths)]
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, offsets_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, (0,) + tuple(np.cumsum(lengths).tolist()))
    for name in names:
        x = tensors[name]
        want = (H, q4.shape[2]) if name in _STATS else None
        if want is not None and np.shape(x) != want:
            raise InvalidArgumentError(f"{name}: expected one value per query row, shape {want} "
                                       f"(H, total_q), got {np.shape(x)}")
        if name in ("o", "do") and np.shape(x) != np.shape(tensors["q"]):
            raise InvalidArgumentError(f"{name}: expected shape {VARLEN_SHAPES[name]} = "
                                       f"{np.shape(tensors['q'])}, got {np.shape(x)}")
    B = len(offsets_q) - 1
    # A bias is (B, H, max_seqlen_q, max_seqlen_k), broadcastable: sequence b reads the
    # corner of its own lengths, as the kernels index it by (b, h, i, j) within b.
    bias = kwargs.get("bias")
    if bias is not None:
        bias = check_bias(function, bias, (B, H, max_q, max_k))
    options = resolve(function, options, {}, allowed=("block_r", "block_c"))
    if options.progress is not None:
        raise InvalidArgumentError(f"options.progress: {function} does not report progress")

    slopes = kwargs.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2 and np.shape(slopes)[0] != len(offsets_q) - 1:
        raise InvalidArgumentError(f"alibi_slopes: expected shape ({H},) or ({len(offsets_q) - 1}, {H}), "
                                   f"got {np.shape(slopes)}")
    parts, io = [], IORecord(label=f"{function} (simulated, {len(offsets_q) - 1} sequences)")
    for (qa, qz), (ka, kz) in zip(zip(offsets_q, offsets_q[1:]), key_rows):
        keys = slice(ka, kz) if pages is None else pages.rows(ka, kz)
        args = [tensors[n][:, qa:qz] if n in _STATS else
                tensors[n][keys] if n in _KEY_ROWS else tensors[n][qa:qz] for n in names]
        # Sequence b draws dropout as batch element b (score.batch_offset) and takes row b
        # of (B, H) ALiBi slopes.
        kw = kwargs
        if slopes is not None and np.ndim(slopes) == 2:
            kw = dict(kwargs, alibi_slopes=np.asarray(slopes)[len(parts):len(parts) + 1])
        if bias is not None:
            kw = dict(kw, bias=_corner(bias, len(parts), H, qz - qa, kz - ka))
        # One launch serves the batch: the FA2 forward's GQA packing is decided for its
        # bounds (tiles.launch_grid), as the library decides it.
        with score.batch_offset(len(parts)), launch_grid(len(offsets_q) - 1, max_q, max_k):
            r = kernel(*args, layout="bnhd", options=options, **kw)
        if qz == qa or kz == ka:  # answered without a kernel: count what the varlen kernels move
            r.io = count_io_varlen(algo, passes=passes, cu_seqlens_q=[0, qz - qa], cu_seqlens_k=[0, kz - ka],
                                   heads=H, head_dim=d, heads_kv=heads_kv, block_r=options.block_r,
                                   block_c=options.block_c, sinks=kwargs.get("sinks") is not None,
                                   **{n: kwargs[n] for n in ("causal", "window", "causal_align", "split_size")
                                      if n in kwargs})
        parts.append(r)
        io = io + r.io
    fields = {}
    for f in type(parts[0]).__dataclass_fields__:
        if f in ("io", "dbias") or getattr(parts[0], f) is None:
            continue
        axis = 1 if f in _STATS else 0
        fields[f] = np.concatenate([getattr(r, f) for r in parts], axis=axis)
    if bias is not None and passes == "backward":
        fields["dbias"] = _dbias(bias, parts, offsets_q, key_rows, H, max_q, max_k, io)
    return type(parts[0])(**fields, io=io)


def _corner(bias, b, H, nq, nk):
    """Sequence b's (1, H, nq or 1, nk) corner of the checked packed bias, the heads
    materialised (so that its dS comes back per head, to be folded as the library folds
    the whole batch's), its row mode the whole bias's."""
    v = bias.view[b if bias.full[0] else 0][None]
    v = v[:, :, :nq, :nk] if bias.full[2] else v[..., :nk]
    v = np.ascontiguousarray(np.broadcast_to(v, (1, H) + v.shape[2:]))
    return Bias(v, v.shape, (True, True, bias.full[2]), v, one_row=bias.sums_rows())


def _dbias(bias, parts, offsets_q, key_rows, H, max_q, max_k, io):
    """dBias of a packed backward: each sequence's dS in its corner of (B, H, max_q or 1,
    max_k), +0 elsewhere, folded over the bias's broadcast B and H as a dense call's
    (score.dbias_fold). The library starts the whole array at +0 (api.cpp) and each
    sequence's kernels clear all max_q rows of its keys' tiles, beyond its own Nq_b: both
    written through HBM, counted here beside the sequences' own records."""
    rows = 1 if bias.sums_rows() else max(1, max_q)
    part = np.zeros((len(parts), H, rows, max_k), np.float32)
    io.write("dBias", part.size * 4)
    for b, (r, (ka, kz)) in enumerate(zip(parts, key_rows)):
        nq, nk = offsets_q[b + 1] - offsets_q[b], kz - ka
        corner = r.dbias[0]  # (H, nq or 1, nk)
        part[b, :, :corner.shape[1], :nk] = corner
        extra = (rows - nq if rows > 1 else int(nq == 0)) * nk
        if extra > 0:
            io.write("dBias", H * extra * 4)
    return score.dbias_fold(bias, part)


def fa2_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                       options=None, seqused_k=None, pages=None, **kwargs):
    """FA2 forward over packed sequences (pyfa.attention_varlen's kernel): q (total_q, H, d),
    k, v (total_k, Hkv, d), int32 offsets, seqused_k as in pyfa.attention_varlen; returns
    Fa2ForwardResult with o (total_q, H, d), lse (H, total_q) and the IO record. Keywords
    as pyfa.sim.fa2_forward's (no layout). pages: a pyfa.checks.Pages (pyfa.h's paged
    K/V), k and v then the pages' rows."""
    return _run("fa2", "forward", "pyfa.sim.fa2_forward_varlen", dict(q=q, k=k, v=v), cu_seqlens_q,
                cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, kwargs, seqused_k, pages)


def fa2_backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                        max_seqlen_k=None, options=None, **kwargs):
    """FA2 backward over packed sequences: Fa2BackwardResult with dq, dk, dv like q, k, v."""
    return _run("fa2", "backward", "pyfa.sim.fa2_backward_varlen", dict(q=q, k=k, v=v, o=o, lse=lse, do=do),
                cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, kwargs)


def fa1_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                       options=None, seqused_k=None, pages=None, **kwargs):
    """FA1 forward over packed sequences: Fa1ForwardResult with o, m and l (H, total_q);
    pages as in fa2_forward_varlen."""
    return _run("fa1", "forward", "pyfa.sim.fa1_forward_varlen", dict(q=q, k=k, v=v), cu_seqlens_q,
                cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, kwargs, seqused_k, pages)


def fa1_backward_varlen(q, k, v, o, m, l, do, cu_seqlens_q, cu_seqlens_k, *,  # noqa: E741 (the paper's l)
                        max_seqlen_q=None, max_seqlen_k=None, options=None, **kwargs):
    """FA1 backward over packed sequences: Fa1BackwardResult with dq, dk, dv."""
    return _run("fa1", "backward", "pyfa.sim.fa1_backward_varlen",
                dict(q=q, k=k, v=v, o=o, m=m, l=l, do=do), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, options, kwargs)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, algo="fa2", block_table=None, **kwargs):
    """The simulated forward of pyfa.attention_varlen for algo "fa1" or "fa2": its result
    (o, and lse or m, l, and the IO record); block_table as there (paged k, v)."""
    forward = {"fa2": fa2_forward_varlen, "fa1": fa1_forward_varlen}
    if algo not in forward:
        raise InvalidArgumentError(f"algo: expected one of ['fa1', 'fa2'], got {algo!r}")
    if block_table is not None:
        from ..kvcache import paged_varlen
        k, v, cu_seqlens_k, kwargs["seqused_k"], kwargs["pages"] = paged_varlen(
            k, v, cu_seqlens_q, cu_seqlens_k, kwargs.get("seqused_k"), block_table)
    return forward[algo](q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *,
                           block_table=None, split_size=None, return_lse=False, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None, options=None,
                           **kwargs):
    """pyfa.attention_with_kvcache, simulated: the same checks, rotary embedding, append
    (in place) and packing (pyfa/kvcache.py), then fa2_forward_varlen, a paged cache
    through its pages. Returns o, or (o, lse)."""
    from ..kvcache import Rotary, _batch_index_table, with_kvcache

    rotary = Rotary.resolve(rotary_cos, rotary_sin, rotary_interleaved, q, k_new, kwargs.get("causal"),
                            kwargs.get("window"))
    if cache_batch_idx is not None:
        block_table = _batch_index_table(cache_batch_idx, block_table, q, k_cache, k_new)

    def run(q_p, k_p, v_p, cu_q, cu_k, used, pages):
        r = fa2_forward_varlen(q_p, k_p, v_p, cu_q, cu_k, options=options, split_size=split_size,
                               seqused_k=used, pages=pages, **kwargs)
        return r.o, r.lse

    return with_kvcache(run, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, return_lse,
                        kwargs.get("bias"), rotary=rotary, leftpad=cache_leftpad)
