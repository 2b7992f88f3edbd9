"""count_io: the kernels' HBM traffic counted by walking their loops without arithmetic.

Each walker follows one kernel's loop nest for one (batch, K/V head), i.e. for the
G = H / Hkv query heads that share it: the same tile bands (pyfa/sim/mask.py), the same
skipping and the same head mapping as the kernel and its simulator, and adds up what each
load and store moves, every time it is done. Kernels with one block per query head count
one head and scale by G; the blocks that serve a whole group (FA2's dK/dV kernel, FA1's
backward) read K_j and V_j once for the group. All K/V heads are alike, so the record is
then scaled by B*Hkv. A walk is per tile row (O(Tr + Tc) steps), milliseconds for
B=64, H=16, N=16384.

What is loaded per visited tile pair follows the bands exactly. Q_i in FA2's forward and
dQ kernel is loaded once per block even when its band is empty (the block still writes
O_i = 0, LSE_i = -inf, dQ_i = 0); K_j and V_j, in FA1's loops and FA2's dK/dV kernel, are
loaded only for a K/V tile that some Q tile visits (dK_j = dV_j = 0 are written anyway).

Tensors (Q, K, V, O, dO, dQ, dK, dV) are counted at `dtype_bytes` per element; the
per-row statistics (LSE, m, l, D) at 4 bytes, since implementations keep them in fp32
whatever the tensors' type. With dtype_bytes=4 the counts equal the simulator's.
"""

import numbers
from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..checks import check_count_args, check_offsets, check_split_size, check_tile
from .io import IORecord
from .mask import Mask
from .tiles import EMU_PROFILE, DeviceProfile, fa2_launch, resolve_tiles
from .tiling import ceil_div

STAT_BYTES = 4


@dataclass(frozen=True)
class Walk:
    """One (batch, K/V head) of a problem, as a walker sees it."""
    Nq: int
    Nk: int
    d: int
    G: int          # query heads per K/V head, H / Hkv
    Br: object      # None for a model without tiles
    Bc: object
    mask: Mask
    e: int          # bytes per tensor element
    bias_rows: object = None  # an additive bias (issue 27): its rows, Nq or 1; None: none
    split: int = 0  # FA2's split_size (split-KV, the split backward); 0: one chunk
    pack: bool = False  # the FA2 forward's blocks pack the group's rows (tiles.fa2_launch)
    sinks: bool = False  # the FA2 forward merges attention sinks into the rows' final state

    def bias_io(self, io, scores, backward=False, tiles=0):
        """A bias's traffic (pyfa/sim/score.py bias_io, dbias_io): `scores` scores of visited
        tiles read; in a backward, dBias too: each of Nq x Nk written once, or (one row)
        each key's running sum started once and read and written back for `tiles` visited
        tile pairs of keys (the keys of each counted once per pair)."""
        if self.bias_rows is None:
            return
        if scores:
            io.read("Bias", scores * self.e)
        if not backward:
            return
        if self.bias_rows != 1:
            io.write("dBias", self.Nq * self.Nk * self.e)
            return
        io.write("dBias", (self.Nk + tiles) * self.e)
        if tiles:
            io.read("dBias", tiles * self.e)

    def tile_keys(self):
        """Sum over K/V tiles j of (Q tiles visiting j) * bc_j: the keys of every visited
        tile pair."""
        total = 0
        for j in range(self.Tc):
            begin, end = self.mask.q_tiles(*self.col_tile(j), self.Br, self.Nq)
            total += max(0, end - begin) * self.col_tile(j)[1]
        return total

    def row_tile(self, i):
        """(row0, br) of Q tile i."""
        return i * self.Br, min(self.Br, self.Nq - i * self.Br)

    def col_tile(self, j):
        return j * self.Bc, min(self.Bc, self.Nk - j * self.Bc)

    def keys_visited(self, i):
        """Keys in the K/V tiles Q tile i visits (the tiles of its band, whole)."""
        begin, end = self.mask.kv_tiles(*self.row_tile(i), self.Bc, self.Nk)
        return max(0, min(self.Nk, end * self.Bc) - begin * self.Bc)

    def keys_seen(self):
        """Keys in the K/V tiles that some Q tile visits: what the blocks that walk the
        K/V tiles in their outer loop load."""
        return sum(self.col_tile(j)[1] for j in range(self.Tc) if self.rows_visited(j))

    def rows_visited(self, j):
        """Query rows in the Q tiles that visit K/V tile j."""
        begin, end = self.mask.q_tiles(*self.col_tile(j), self.Br, self.Nq)
        return max(0, min(self.Nq, end * self.Br) - begin * self.Br)

    def chunks_meeting_rows(self, j):
        """Split backward: the query chunks (split rows each) that K/V tile j's band of Q
        tiles meets, each of which the dK/dV block folds once."""
        begin, end = self.mask.q_tiles(*self.col_tile(j), self.Br, self.Nq)
        per = self.split // self.Br
        return (end - 1) // per - begin // per + 1 if begin < end else 0

    def chunks_meeting_keys(self):
        """Split backward: for each Q tile i, the key chunks (split keys each) holding a K/V
        tile whose band holds i, each of which the dQ block folds once."""
        per, hits = self.split // self.Bc, [set() for _ in range(self.Tr)]
        for j in range(self.Tc):
            begin, end = self.mask.q_tiles(*self.col_tile(j), self.Br, self.Nq)
            for i in range(begin, end):
                hits[i].add(j // per)
        return [len(h) for h in hits]

    @property
    def Tr(self):
        return ceil_div(self.Nq, self.Br)

    @property
    def Tc(self):
        return ceil_div(self.Nk, self.Bc)


def fa2_forward_io(w):
    """src/kernels/fa2_forward.cuh, per block row (a query head; packed, w.pack, the
    group's G heads, their G * Nq rows query by query): Q_i read once, K_j and V_j once per
    visited (i, j), O_i and LSE_i written once."""
    qg = w.G if w.pack else 1
    rows = qg * w.Nq
    io = IORecord()
    io.read("Q", rows * w.d * w.e)
    scores = 0
    for t in range(ceil_div(rows, w.Br)):
        r0, br = t * w.Br, min(w.Br, rows - t * w.Br)
        i0, i1 = r0 // qg, (r0 + br - 1) // qg  # the tile's first and last query
        begin, end = w.mask.kv_tiles(i0, i1 - i0 + 1, w.Bc, w.Nk)
        keys = max(0, min(w.Nk, end * w.Bc) - begin * w.Bc)
        io.read("K", keys * w.d * w.e)
        io.read("V", keys * w.d * w.e)
        scores += br * keys
    if w.split:
        # Split-KV: every chunk writes its partial O, LSE of every row (LSE = -inf where a
        # row sees none of it), and the combine step reads them all back, as the simulator.
        chunks = ceil_div(w.Nk, w.split)
        io.write("O partials", chunks * rows * w.d * w.e)
        io.write("LSE partials", chunks * rows * STAT_BYTES)
        io.read("O partials", chunks * rows * w.d * w.e)
        io.read("LSE partials", chunks * rows * STAT_BYTES)
    io.write("O", rows * w.d * w.e)
    io.write("LSE", rows * STAT_BYTES)
    if w.sinks:
        # One float per row tile and head where the final state is written: the epilogue's
        # tiles of the block row, or, split, the combine's, one head per block, never packed.
        io.read("sinks", qg * (ceil_div(w.Nq, w.Br) if w.split else ceil_div(rows, w.Br)) * STAT_BYTES)
    w.bias_io(io, scores)
    return io.scaled(w.G // qg)


def fa2_backward_preprocess_io(w):
    """fa2_backward_preprocess_kernel, per query head: O and dO read once, D written once."""
    io = IORecord()
    io.read("O", w.Nq * w.d * w.e)
    io.read("dO", w.Nq * w.d * w.e)
    io.write("D", w.Nq * STAT_BYTES)
    return io.scaled(w.G)


def fa2_backward_dkdv_io(w):
    """fa2_backward_dkdv_kernel, one block per (j, K/V head): K_j, V_j read once (when
    some Q tile visits j); for each of the group's G query heads, Q_i, dO_i, LSE_i, D_i
    once per visited (j, i); dK_j, dV_j written once."""
    io = IORecord()
    io.read("K", w.keys_seen() * w.d * w.e)
    io.read("V", w.keys_seen() * w.d * w.e)
    for j in range(w.Tc):
        rows = w.G * w.rows_visited(j)
        io.read("Q", rows * w.d * w.e)
        io.read("dO", rows * w.d * w.e)
        io.read("LSE", rows * STAT_BYTES)
        io.read("D", rows * STAT_BYTES)
    if w.split:
        # The split backward: dK_j, dV_j (the accumulators, split_fold) written at each
        # query chunk the block folds and read back at each but its first; a block no
        # query reaches writes +0 once.
        for j in range(w.Tc):
            folds, bc = w.chunks_meeting_rows(j), w.col_tile(j)[1]
            for name in ("dK", "dV"):
                io.write(name, max(folds, 1) * bc * w.d * w.e)
                io.read(name, max(folds - 1, 0) * bc * w.d * w.e)
    else:
        io.write("dK", w.Nk * w.d * w.e)
        io.write("dV", w.Nk * w.d * w.e)
    for _ in range(w.G):
        w.bias_io(io, sum(w.rows_visited(j) * w.col_tile(j)[1] for j in range(w.Tc)), True, w.tile_keys())
    return io


def fa2_backward_dq_io(w):
    """fa2_backward_dq_kernel, per query head: Q_i, dO_i, LSE_i, D_i read once; K_j, V_j
    once per visited (i, j); dQ_i written once."""
    io = IORecord()
    io.read("Q", w.Nq * w.d * w.e)
    io.read("dO", w.Nq * w.d * w.e)
    io.read("LSE", w.Nq * STAT_BYTES)
    io.read("D", w.Nq * STAT_BYTES)
    for i in range(w.Tr):
        keys = w.keys_visited(i)
        io.read("K", keys * w.d * w.e)
        io.read("V", keys * w.d * w.e)
    if w.split:  # as dK/dV's above, per key chunk
        for i, folds in enumerate(w.chunks_meeting_keys()):
            io.write("dQ", max(folds, 1) * w.row_tile(i)[1] * w.d * w.e)
            io.read("dQ", max(folds - 1, 0) * w.row_tile(i)[1] * w.d * w.e)
    else:
        io.write("dQ", w.Nq * w.d * w.e)
    w.bias_io(io, sum(w.row_tile(i)[1] * w.keys_visited(i) for i in range(w.Tr)))
    return io.scaled(w.G)


def fa1_forward_io(w):
    """src/kernels/fa1_forward.cuh, per query head: O, m, l initialized in HBM; K_j, V_j
    read once (when some Q tile visits j); Q_i, O_i, m_i, l_i read and O_i, m_i, l_i
    written once per visited (j, i)."""
    io = IORecord()
    io.write("O", w.Nq * w.d * w.e)
    io.write("m", w.Nq * STAT_BYTES)
    io.write("l", w.Nq * STAT_BYTES)
    io.read("K", w.keys_seen() * w.d * w.e)
    io.read("V", w.keys_seen() * w.d * w.e)
    for j in range(w.Tc):
        rows = w.rows_visited(j)
        io.read("Q", rows * w.d * w.e)
        io.read("O", rows * w.d * w.e)
        io.read("m", rows * STAT_BYTES)
        io.read("l", rows * STAT_BYTES)
        io.write("O", rows * w.d * w.e)
        io.write("m", rows * STAT_BYTES)
        io.write("l", rows * STAT_BYTES)
    w.bias_io(io, sum(w.rows_visited(j) * w.col_tile(j)[1] for j in range(w.Tc)))
    return io.scaled(w.G)


def fa1_backward_io(w):
    """src/kernels/fa1_backward.cuh, one block per K/V head: dQ of its G query heads
    initialized in HBM; K_j, V_j read once (when some Q tile visits j); for each query head
    g, Q_i, O_i, dO_i, dQ_i, m_i, l_i read and dQ_i written once per visited (j, i); dK_j,
    dV_j written once."""
    io = IORecord()
    io.write("dQ", w.G * w.Nq * w.d * w.e)
    io.read("K", w.keys_seen() * w.d * w.e)
    io.read("V", w.keys_seen() * w.d * w.e)
    for j in range(w.Tc):
        rows = w.G * w.rows_visited(j)
        for name in ("Q", "dO", "O", "dQ"):
            io.read(name, rows * w.d * w.e)
        io.read("m", rows * STAT_BYTES)
        io.read("l", rows * STAT_BYTES)
        io.write("dQ", rows * w.d * w.e)
    io.write("dK", w.Nk * w.d * w.e)
    io.write("dV", w.Nk * w.d * w.e)
    for _ in range(w.G):
        w.bias_io(io, sum(w.rows_visited(j) * w.col_tile(j)[1] for j in range(w.Tc)), True, w.tile_keys())
    return io


# (algorithm, pass) -> [(kernel whose default tiles apply, walker)], in launch order.
WALKERS = {
    ("fa2", "forward"): [("fa2_forward", fa2_forward_io)],
    ("fa1", "forward"): [("fa1_forward", fa1_forward_io)],
    ("fa1", "backward"): [("fa1_backward", fa1_backward_io)],
    ("fa2", "backward"): [("fa2_backward_preprocess", fa2_backward_preprocess_io),
                          ("fa2_backward_dkdv", fa2_backward_dkdv_io),
                          ("fa2_backward_dq", fa2_backward_dq_io)],
}


def algorithms():
    """The algorithms in WALKERS now: computed on each call, since walkers are also
    registered after this module's import (the standard model, at the end of this file)."""
    return sorted({a for a, _ in WALKERS})


def check_heads_kv(heads_kv, heads):
    """Hkv: None (as many as query heads) or an int >= 1 dividing heads."""
    if heads_kv is None:
        return heads
    if isinstance(heads_kv, bool) or not isinstance(heads_kv, numbers.Integral) or heads_kv < 1:
        raise InvalidArgumentError(f"heads_kv: expected None or an int >= 1, got {heads_kv!r}")
    if heads % heads_kv:
        raise InvalidArgumentError(f"heads_kv: {heads_kv} must divide heads ({heads})")
    return int(heads_kv)


def count_kernels(algo, *, passes="forward", batch, heads, seqlen_q, seqlen_k, head_dim,
                  heads_kv=None, block_r=None, block_c=None, causal=False, window=None,
                  causal_align="bottom_right", dtype_bytes=4, profile=EMU_PROFILE, bias=None,
                  split_size=None, sinks=False):
    """count_io's record, and the tiles each kernel was counted with:
    [{"pass", "kernel", "block_r", "block_c"}] in launch order (empty for the unfused
    standard model)."""
    if algo not in algorithms():
        raise InvalidArgumentError(f"algo: unknown algorithm {algo!r}; known: {algorithms()}")
    check_count_args(passes, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     head_dim=head_dim, dtype_bytes=dtype_bytes)
    Hkv = check_heads_kv(heads_kv, heads)
    mask = Mask.resolve(causal, window, causal_align, seqlen_q, seqlen_k)
    if not isinstance(profile, DeviceProfile):
        raise ArgumentTypeError(f"profile: expected a sim.DeviceProfile, got {type(profile).__name__}")
    bias_rows = _bias_rows(bias, algo, batch, heads, seqlen_q, seqlen_k)
    wanted = ["forward", "backward"] if passes == "both" else [passes]
    _check_split_algo(split_size, algo)
    _check_sinks(sinks, algo, passes)
    record, tiles = IORecord(), []
    for p in wanted:
        if (algo, p) not in WALKERS:
            raise InvalidArgumentError(f"passes: {algo} has no {p} pass in this version")
        for kernel, walker in WALKERS[(algo, p)]:
            if kernel is None:  # a model without tiles (the unfused standard attention)
                Br, Bc = check_tile("block_r", block_r), check_tile("block_c", block_c)
            else:
                Br, Bc = resolve_tiles(kernel, head_dim, block_r, block_c, profile)
            split = _kernel_split(split_size, head_dim, kernel, Br, Bc)
            pack, Br = _fa2_forward_launch(kernel, batch, heads, Hkv, seqlen_q, seqlen_k, Br, split, block_r, profile)
            if kernel is not None:
                tiles.append({"pass": p, "kernel": kernel, "block_r": Br, "block_c": Bc})
            w = Walk(seqlen_q, seqlen_k, head_dim, heads // Hkv, Br, Bc, mask, dtype_bytes, bias_rows,
                     split, pack, sinks and kernel == "fa2_forward")
            record = record + walker(w)
    out = record.scaled(batch * Hkv)
    out.label = f"{algo} {passes}"
    return out, tiles


def _fa2_forward_launch(kernel, B, H, Hkv, Nq, Nk, Br, split, block_r, profile):
    """(packed, Br) of `kernel`'s launch: tiles.fa2_launch's for the FA2 forward, else
    (False, Br)."""
    if kernel != "fa2_forward":
        return False, Br
    qg, Br = fa2_launch(B, H, Hkv, Nq, Nk, Br, split, block_r, profile)
    return qg > 1, Br


def _check_sinks(sinks, algo, passes):
    if not isinstance(sinks, bool):
        raise ArgumentTypeError(f"sinks: expected a bool, got {type(sinks).__name__}")
    if sinks and (algo != "fa2" or passes == "backward"):
        raise InvalidArgumentError("sinks: only the FA2 forward reads them")


def _check_split_algo(split_size, algo):
    if split_size not in (None, 0) and algo != "fa2":
        raise InvalidArgumentError(f"split_size: only fa2 splits, got {split_size!r} for {algo}")


def _kernel_split(split_size, head_dim, kernel, Br, Bc):
    """The split a kernel is counted with: a multiple of its Bc (the forward, dQ) or its Br
    (dK/dV, whose chunks are of query rows), as the library checks it; 0 for the rest."""
    if kernel in ("fa2_forward", "fa2_backward_dq"):
        return check_split_size(split_size, head_dim, Bc)
    if kernel == "fa2_backward_dkdv":
        split = check_split_size(split_size, head_dim)
        if split % Br:
            raise InvalidArgumentError(f"split_size: must be a multiple of fa2_backward_dkdv's Br = {Br}, "
                                       f"got {split}")
        return split
    return 0


def count_io(algo, *, passes="forward", batch, heads, seqlen_q, seqlen_k, head_dim,
             heads_kv=None, block_r=None, block_c=None, causal=False, window=None,
             causal_align="bottom_right", dtype_bytes=4, profile=EMU_PROFILE, bias=None,
             split_size=None, sinks=False):
    """The IO record of `algo` ("fa1", "fa2", "standard") for `passes` ("forward",
    "backward", "both"), counted without arithmetic. heads_kv: K/V heads (None: heads);
    window, causal, causal_align: the mask, as the kernels take it (pyfa/sim/mask.py). None
    tiles are each kernel's defaults on `profile` (sim.tiles.default_tiles). bias: the
    shape of an additive bias (issue 27; broadcastable to (B, H, Nq, Nk)) or None: its
    reads per visited tile and, in a backward, dBias's traffic (docs/io_closed_forms.md).
    split_size: FA2's split (pyfa.fa2_forward's and fa2_backward's; "decode" its
    constant): in the forward each chunk's partial O and LSE written and read back by the
    combine step; in the backward dQ, dK and dV written at each chunk a block folds and read
    back at each but its first (split_fold: the output is the accumulator). sinks: whether
    the FA2 forward merges attention sinks (one float read per row tile and head where a
    row's final state is written)."""
    return count_kernels(algo, passes=passes, batch=batch, heads=heads, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_k, head_dim=head_dim, heads_kv=heads_kv,
                         block_r=block_r, block_c=block_c, causal=causal, window=window,
                         causal_align=causal_align, dtype_bytes=dtype_bytes, profile=profile,
                         bias=bias, split_size=split_size, sinks=sinks)[0]


def _bias_rows(bias, algo, B, H, Nq, Nk):
    """The rows (Nq or 1) of a bias of shape `bias` (checked as pyfa.checks checks one),
    or None for none."""
    if bias is None:
        return None
    shape = tuple(bias) if isinstance(bias, (tuple, list)) else None
    if shape is None or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in shape):
        raise ArgumentTypeError(f"bias: expected the bias's shape, a tuple of ints, got {bias!r}")
    if algo == "standard":
        raise InvalidArgumentError("bias: the standard model counts no bias")
    padded = (1,) * (4 - len(shape)) + shape
    if not 1 <= len(shape) <= 4 or padded[3] != Nk or any(n not in (1, m) for n, m in zip(padded[:3], (B, H, Nq))):
        raise InvalidArgumentError(f"bias: shape {shape} does not broadcast to (B, H, Nq, Nk) = {(B, H, Nq, Nk)} "
                                   f"with its last axis the Nk keys")
    return padded[2]


# The unfused standard-attention model (pyfa/sim/standard.py): no kernel, hence no tiles.
from .standard import standard_backward_io, standard_forward_io  # noqa: E402

WALKERS[("standard", "forward")] = [(None, standard_forward_io)]
WALKERS[("standard", "backward")] = [(None, standard_backward_io)]


def count_io_varlen(algo, *, passes="forward", cu_seqlens_q, cu_seqlens_k, heads, head_dim,
                    heads_kv=None, block_r=None, block_c=None, causal=False, window=None,
                    causal_align="bottom_right", dtype_bytes=4, profile=EMU_PROFILE, split_size=None,
                    bias=None, sinks=False):
    """count_io of packed sequences (pyfa.attention_varlen): the sum over the sequences of
    each one's walk, as the varlen kernels read them. A block past its sequence's rows
    (keys) returns at once and moves nothing, so a sequence costs what its own dense call
    would, empty ones included: with Nq_b = 0 FA2's dK/dV kernel still writes dK = dV = 0,
    with Nk_b = 0 the forward still reads Q and writes O = 0, LSE = -inf. algo "fa1" or
    "fa2"; the offsets are int32 arrays (or sequences of ints) of B + 1 entries; split_size
    as count_io's, each sequence split alone. bias: the shape of a packed bias (broadcastable
    to (B, H, max_seqlen_q, max_seqlen_k)); in a backward dBias also starts at +0 whole,
    and with rows each sequence clears the rows beyond its own of its keys. sinks: as
    count_io's, each sequence's rows reading their heads' sinks."""
    if algo not in ("fa1", "fa2"):
        raise InvalidArgumentError(f"algo: expected 'fa1' or 'fa2' for packed sequences, got {algo!r}")
    offsets = []
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        cu = np.asarray(cu)
        if cu.dtype.kind != "i":
            raise ArgumentTypeError(f"{name}: expected integer offsets, got dtype {cu.dtype}")
        cu = cu.astype(np.int32)
        offsets.append(check_offsets(name, cu, int(cu[-1]) if cu.ndim == 1 and cu.size else 0,
                                     None if not offsets else len(offsets[0]) - 1))
    check_count_args(passes, heads=heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    Hkv = check_heads_kv(heads_kv, heads)
    Mask.resolve(causal, window, causal_align, 1, 1)  # the mask arguments, checked once
    if not isinstance(profile, DeviceProfile):
        raise ArgumentTypeError(f"profile: expected a sim.DeviceProfile, got {type(profile).__name__}")
    wanted = ["forward", "backward"] if passes == "both" else [passes]
    _check_split_algo(split_size, algo)
    _check_sinks(sinks, algo, passes)
    lengths = [(qz - qa, kz - ka) for (qa, qz), (ka, kz) in zip(zip(offsets[0], offsets[0][1:]),
                                                                 zip(offsets[1], offsets[1][1:]))]
    B = len(lengths)
    rows = max_k = None
    longest_q, longest_k = (max((n[a] for n in lengths), default=0) for a in (0, 1))
    if bias is not None:
        shape = (1,) * (4 - len(tuple(bias))) + tuple(bias) if isinstance(bias, (tuple, list)) else None
        rows = _bias_rows(bias, algo, B, heads, shape[2] if shape else 1, shape[3] if shape else 0)
        max_k = shape[3]
        if max_k < longest_k or (rows != 1 and rows < longest_q):
            raise InvalidArgumentError(f"bias: shape {tuple(bias)} is shorter than the longest sequence "
                                       f"({longest_q} queries, {longest_k} keys)")
    record = IORecord()
    for p in wanted:
        for kernel, walker in WALKERS[(algo, p)]:
            Br, Bc = resolve_tiles(kernel, head_dim, block_r, block_c, profile)
            split = _kernel_split(split_size, head_dim, kernel, Br, Bc)
            # One launch for the batch: packing decided for its bounds (varlen.py likewise).
            pack, Br = _fa2_forward_launch(kernel, B, heads, Hkv, longest_q, longest_k, Br, split, block_r,
                                           profile)
            for nq, nk in lengths:
                mask = Mask.resolve(causal, window, causal_align, nq, nk)
                record = record + walker(Walk(nq, nk, head_dim, heads // Hkv, Br, Bc, mask, dtype_bytes,
                                              rows, split, pack, sinks and kernel == "fa2_forward"))
    out = record.scaled(Hkv)
    if bias is not None and "backward" in wanted:
        out.write("dBias", B * heads * rows * max_k * dtype_bytes)
        if rows != 1:
            out.write("dBias", sum(heads * (rows - nq) * nk for nq, nk in lengths) * dtype_bytes)
    out.label = f"{algo} {passes} (packed, {len(offsets[0]) - 1} sequences)"
    return out
