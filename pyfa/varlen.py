"""Packed sequences (varlen): pyfa's flash_attn_varlen_func.

Documents of different lengths concatenated along the rows, each attending only to
itself: q (total_q, H, d), k and v (total_k, Hkv, d), and int32 offsets cu_seqlens_q,
cu_seqlens_k of B + 1 entries (first 0, non-decreasing, last the total), sequence b
owning rows cu[b] .. cu[b + 1] - 1. These run the same ops as the dense calls (pyfa/api.py
_run) with the offsets as two more tensors of pyfa_run and the problem marked packed
(pyfa.h, "Packed sequences"): the kernels find each block's sequence from the offsets,
so a row's bits equal those of the dense call of its own sequence alone
(docs/numerics.md, "Packed sequences"). As tensors the packed arrays are one (N, H, d)
batch in layout "bnhd", which is how the dense machinery takes them, and per-row
statistics come back as (H, total_q), flash-attn's softmax_lse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _arrays, _lib
from . import api
from .checks import (Pages, c_aligned, check_max_seqlen, check_offsets, check_offsets_shape, check_seqused,
                     check_varlen_rank)
from .errors import ArgumentTypeError, InvalidArgumentError
from .options import Options

__all__ = ["attention_varlen", "attention_varlen_grad"]


@dataclass
class Varlen:
    """The offsets of one call, checked, as the library takes them."""
    batch: int
    max_q: int          # the grid's bound of the query lengths (>= 1 for the library)
    max_k: int
    pointers: dict      # {"cu_seqlens_q": address, "cu_seqlens_k": address}
    keep: tuple         # the arrays behind the addresses, alive for the call
    offsets_q: Optional[tuple] = None  # host offsets, where they were read
    offsets_k: Optional[tuple] = None
    pages: Optional[Pages] = None      # paged K/V: its table is pointers["block_table"]

    def apply(self, problem, total_q, total_k):
        """problem (a pyfa_problem made for the packed tensors as one batch) marked packed."""
        ffi, _ = _lib.load()
        problem.struct_size = ffi.sizeof("pyfa_problem")
        problem.varlen = 1
        problem.batch = self.batch
        problem.seqlen_q, problem.seqlen_k = max(1, self.max_q), max(1, self.max_k)
        problem.total_q, problem.total_k = total_q, total_k
        if self.pages is not None:  # k, v hold the pages; the offsets count logical rows
            problem.page_size, problem.num_pages = self.pages.page_size, self.pages.num_pages
            problem.total_k = self.pages.logical_rows


def _shape(name, x):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise ArgumentTypeError(f"{name}: expected {_arrays.ARRAY_HELP}, got {type(x).__name__}")
    return tuple(int(n) for n in shape)


def _device_offsets(name, x, batch):
    """CUDA offsets through __cuda_array_interface__: (address, B). Their values stay on the
    device (the library cannot check them there: pyfa.h)."""
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise ArgumentTypeError(f"{name}: a CUDA array without __cuda_array_interface__; pass a "
                                f"PyTorch or CuPy int32 tensor")
    shape = tuple(cai["shape"])
    b = check_offsets_shape(name, shape, cai["typestr"], batch)
    if cai.get("strides") not in (None, (4,)):
        raise InvalidArgumentError(f"{name}: must be contiguous, got byte strides {cai['strides']}")
    return int(cai["data"][0]), b


def _host_copy(name, x):
    """CUDA offsets copied to the host, to compute a max_seqlen not given."""
    for method in ("cpu", "get"):
        if hasattr(x, method):
            a = getattr(x, method)()
            return np.asarray(a.numpy() if hasattr(a, "numpy") else a)
    raise InvalidArgumentError(f"{name}: on a CUDA device pyfa cannot copy from; give max_seqlen_q "
                               f"and max_seqlen_k")


def resolve_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, pages=None):
    """The offsets checked against q (total_q, H, d) and k (total_k, Hkv, d), and the key
    counts seqused_k (None: every key of each sequence): a Varlen. pages (host arrays
    only): a checks.Pages, k then holding the pages and the offsets logical rows."""
    check_varlen_rank("q", _shape("q", q))
    check_varlen_rank("k", _shape("k", k))
    total_q, total_k = _shape("q", q)[0], _shape("k", k)[0]
    if pages is not None:
        total_k = pages.logical_rows
    named = {"q": q, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    if seqused_k is not None:
        named["seqused_k"] = seqused_k
    place = _arrays.common_place(named)
    if place.kind == "cpu":
        cu_q = _arrays.host_array("cu_seqlens_q", cu_seqlens_q)
        cu_k = _arrays.host_array("cu_seqlens_k", cu_seqlens_k)
        offsets_q = check_offsets("cu_seqlens_q", cu_q, total_q)
        offsets_k = check_offsets("cu_seqlens_k", cu_k, total_k, len(offsets_q) - 1)
        keep = [c_aligned(cu_q), c_aligned(cu_k)]
        fields = ["cu_seqlens_q", "cu_seqlens_k"]
        attended = offsets_k  # the offsets whose lengths bound max_seqlen_k
        if seqused_k is not None:
            used = _arrays.host_array("seqused_k", seqused_k)
            attended = (0,) + tuple(np.cumsum(check_seqused("seqused_k", used, offsets_k)).tolist())
            keep.append(c_aligned(used))
            fields.append("seqused_k")
        if pages is not None:
            keep.append(pages.table)
            fields.append("block_table")
        pointers = {f: a.__array_interface__["data"][0] for f, a in zip(fields, keep)}
        return Varlen(len(offsets_q) - 1, check_max_seqlen("max_seqlen_q", max_seqlen_q, offsets_q),
                      check_max_seqlen("max_seqlen_k", max_seqlen_k, attended), pointers, tuple(keep),
                      offsets_q, offsets_k, pages)
    if pages is not None:
        raise InvalidArgumentError("k: paged K/V is taken from host (NumPy) arrays only in this version")
    ptr_q, batch = _device_offsets("cu_seqlens_q", cu_seqlens_q, None)
    ptr_k, _ = _device_offsets("cu_seqlens_k", cu_seqlens_k, batch)
    pointers = {"cu_seqlens_q": ptr_q, "cu_seqlens_k": ptr_k}
    if seqused_k is not None:
        cai = getattr(seqused_k, "__cuda_array_interface__", None)
        if cai is None or cai["typestr"] not in ("<i4", "|i4") or tuple(cai["shape"]) != (batch,) \
                or cai.get("strides") not in (None, (4,)):
            raise InvalidArgumentError(f"seqused_k: expected a contiguous int32 CUDA array of shape ({batch},)")
        pointers["seqused_k"] = int(cai["data"][0])
    maxima = []
    for name, cu, value in (("max_seqlen_q", cu_seqlens_q, max_seqlen_q),
                            ("max_seqlen_k", cu_seqlens_k, max_seqlen_k)):
        if value is None:
            host = _host_copy(name.replace("max_seqlen", "cu_seqlens"), cu)
            value = int(np.max(np.diff(host.astype(np.int64))))
        maxima.append(check_max_seqlen(name, value, (0, 0)))
    return Varlen(batch, *maxima, pointers, (cu_seqlens_q, cu_seqlens_k, seqused_k))


def run(op_name, args, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
        causal=False, window=None, causal_align="bottom_right", scale=None, options=None, out=None,
        stream=None, mods=None, function=None, split_size=None, seqused_k=None, pages=None, sinks=None):
    """Runs op `op_name` ("fa2_forward", ...) on packed tensors args ({name: array}: q, k,
    v (total, heads, d), o and do like q, lse, m, l (H, total_q)); returns its outputs,
    gradients shaped like their inputs, statistics (H, total_q)."""
    for name in ("q", "k", "v", "o", "do"):
        if name in args:
            check_varlen_rank(name, _shape(name, args[name]))
    varlen = resolve_varlen(args["q"], args["k"], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_k, pages)
    return api._run(op_name, args, causal=causal, window=window, causal_align=causal_align, scale=scale,
                    layout="bnhd", options=options, out=out, stream=stream, mods=mods or {},
                    varlen=varlen, function=function, split_size=split_size, sinks=sinks)


def _fa2_splits(function, algo, split_size):
    if algo == "fa1" and split_size not in (None, 0):
        raise InvalidArgumentError(f"split_size: only algo='fa2' splits ({function}), got {split_size!r}")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None, causal: bool = False, window=None,
                     causal_align: str = "bottom_right", scale: Optional[float] = None,
                     algo: str = "fa2", return_lse: bool = False, options: Optional[Options] = None,
                     out=None, stream: Any = None, split_size: Union[None, int, str] = None,
                     seqused_k=None, block_table=None, **mods):
    """Attention over packed sequences (flash-attn's flash_attn_varlen_func): each of the B
    sequences attends only to itself.

    q: (total_q, H, d) float32; k, v: (total_k, Hkv, d), H % Hkv == 0; cu_seqlens_q,
    cu_seqlens_k: int32 (B + 1,) offsets, first 0, non-decreasing, last total_q (total_k):
    sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and keys
    cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v. max_seqlen_q, max_seqlen_k: the
    longest lengths (None: computed from the offsets, which on CUDA copies them to the
    host; given: checked to be at least the longest on the CPU, trusted on CUDA). The
    mask applies per sequence: with bottom-right alignment sequence b's diagonal is
    off = Nk_b - Nq_b. A sequence may be empty; one with queries and no keys gets O = 0
    (LSE = -inf). Returns o (total_q, H, d), or (o, lse) with return_lse (lse (H, total_q),
    flash-attn's softmax_lse; algo "fa2" only). Row r's bits equal those of the dense
    call (pyfa.attention) of its own sequence alone. split_size: FA2's split-KV, as in
    pyfa.fa2_forward (each sequence's keys in chunks of split_size from its own first key),
    so row r also has the bits of the split dense call of its sequence. seqused_k
    (flash-attn's): None, or int32 (B,) on q's device: sequence b attends to its first
    seqused_k[b] keys only (each at most its cu_seqlens_k length; the mask aligned to that
    count), the rest of its rows unread, which is how a dense KV cache is read in place
    (pyfa.attention_with_kvcache). bias (as in pyfa.attention): broadcastable to
    (B, H, max_seqlen_q, max_seqlen_k), B the sequences; sequence b adds the corner
    bias[b, h, :Nq_b, :Nk_b] (one row: bias[b, h, 0, :Nk_b]), so max_seqlen_k, when given,
    must be the bias's last axis. block_table (flash-attn's, NumPy): int32 (B, max_pages),
    k and v then (num_pages, page_size, Hkv, d) pages, any page size, shared or in any
    order: sequence b's keys are its cu_seqlens_k[b + 1] - cu_seqlens_k[b] first logical
    rows, logical key n at row n % page_size of page block_table[b, n // page_size]
    (forward only, without seqused_k). sinks (as in pyfa.attention): float32 (H,) on q's
    device, merged into each row's final state by the FA2 forward, so that row r keeps
    the bits of its sequence's dense call with sinks. Other arguments as in
    pyfa.attention; out: an array like q to write O into. A repeated call on CPU arrays
    reuses its set-up as the dense calls do (pyfa.attention), keyed by the arrays' shapes
    and strides and the number of sequences, with each call's offsets checked afresh:
    new lengths in the same buffers keep it."""
    options, mods = api._keywords("pyfa.attention_varlen", options, mods)
    api._algo(algo)
    _fa2_splits("pyfa.attention_varlen", algo, split_size)
    sinks = api._sinks_keyword("pyfa.attention_varlen", mods, algo, q, "bnhd")
    if not isinstance(return_lse, bool):
        raise ArgumentTypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if return_lse and algo != "fa2":
        raise InvalidArgumentError("return_lse: only algo='fa2' keeps the LSE (FA1 keeps m and l)")
    pages = None
    if block_table is not None:
        from .kvcache import paged_varlen
        k, v, cu_seqlens_k, seqused_k, pages = paged_varlen(k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, window=window,
              causal_align=causal_align, scale=scale, options=options, stream=stream, mods=mods,
              function="pyfa.attention_varlen", split_size=split_size, seqused_k=seqused_k, pages=pages)
    extra = 2 if algo == "fa1" else 1
    outs = run(f"{algo}_forward", dict(q=q, k=k, v=v), cu_seqlens_q, cu_seqlens_k,
               out=None if out is None else (out,) + (None,) * extra, sinks=sinks, **kw)
    return (outs[0], outs[1]) if return_lse else outs[0]


def attention_varlen_grad(q, k, v, do, cu_seqlens_q, cu_seqlens_k, *,
                          max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                          causal: bool = False, window=None, causal_align: str = "bottom_right",
                          scale: Optional[float] = None, algo: str = "fa2",
                          options: Optional[Options] = None, out=None, stream: Any = None,
                          split_size: Union[None, int, str] = None, **mods) -> Tuple[Any, Any, Any, Any]:
    """The forward and backward of attention_varlen for the incoming gradient do (like q):
    returns (o, dq, dk, dv), shaped like q, q, k, v, and with bias= a fifth, dbias of the
    bias's shape: sequence b's dS in its corner, +0 beyond it, summed over an axis the bias
    broadcasts as pyfa.attention_grad sums (the sequences in increasing order). Arguments
    as in attention_varlen; out: (o, dq, dk, dv[, dbias]), each None to allocate it (o
    written as pyfa.attention_grad writes it: once the backward has succeeded).
    split_size (FA2): given to the split forward and the split backward
    (pyfa.fa2_backward's: dQ folded per key chunk, dK and dV per query chunk, each sequence
    chunked from its own first row and key). Deterministic, and row for row the bits of
    pyfa.attention_grad (with the same split_size) on each sequence alone. sinks (as in
    attention_varlen): the backward runs on the merged state and dsinks (pyfa.sinks_grad,
    summed over the packed rows in order) comes last."""
    options, mods = api._keywords("pyfa.attention_varlen_grad", options, mods)
    api._algo(algo)
    _fa2_splits("pyfa.attention_varlen_grad", algo, split_size)
    sinks = api._sinks_keyword("pyfa.attention_varlen_grad", mods, algo, q, "bnhd", grad=True)
    with_dbias = mods.get("bias") is not None
    outs = api._out_dict("attention_varlen_grad",
                         ("o", "dq", "dk", "dv") + (("dbias",) if with_dbias else ()), out)
    check_varlen_rank("do", _shape("do", do))
    for name, x in (("q", q), ("k", k)):
        check_varlen_rank(name, _shape(name, x))
    # do, and the out= arrays, checked before any kernel runs.
    intake = api._intake(dict(q=q, k=k, v=v, do=do), stream, options.backend, "bnhd", outs)
    api._refuse_given_overlaps(intake, outs)
    kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, window=window,
              causal_align=causal_align, scale=scale, options=options, stream=stream, mods=mods,
              function="pyfa.attention_varlen_grad", split_size=split_size)
    grads = (outs["dq"], outs["dk"], outs["dv"]) + ((outs["dbias"],) if with_dbias else ())
    offsets = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    with _lib.interrupts_after():  # as in pyfa.attention_grad
        o_out, finish = api._stage_o(intake, outs, f"{algo}_forward", api._array_keywords({**mods, **offsets}))
        if algo == "fa1":
            o, m, l = run("fa1_forward", dict(q=q, k=k, v=v), cu_seqlens_q, cu_seqlens_k,
                          out=(o_out, None, None), **kw)
            _lib.raise_pending_interrupt()
            grads = run("fa1_backward", dict(q=q, k=k, v=v, o=o, m=m, l=l, do=do), cu_seqlens_q,
                        cu_seqlens_k, out=grads, **kw)
        else:
            o, lse = run("fa2_forward", dict(q=q, k=k, v=v), cu_seqlens_q, cu_seqlens_k,
                         out=(o_out, None), sinks=sinks, **kw)
            _lib.raise_pending_interrupt()
            grads = run("fa2_backward", dict(q=q, k=k, v=v, o=o, lse=lse, do=do), cu_seqlens_q,
                        cu_seqlens_k, out=grads, **kw)
            if sinks is not None:
                grads = (*grads, api._sinks_grad(o, lse, do, sinks, "bnhd", q))
        return (finish(o), *grads)
