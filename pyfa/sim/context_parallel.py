"""The communication of pyfa.torch.context_parallel_attention (docs/context_parallel.md),
modelled without torch: which sequence rows each rank's shard holds, which blocks of the
split structure some row sees, and the bytes each rank sends. pyfa/context_parallel.py
plans its transfers with these very functions, so the model and the run cannot drift."""

from typing import List, NamedTuple

from ..checks import mask_bounds
from ..errors import InvalidArgumentError


class _Piece(NamedTuple):
    """Rows [local, local + length) of a shard are rows [start, start + length) of the
    sequence."""
    local: int
    start: int
    length: int


def shard_rows(rank: int, world_size: int, shard_len: int, zigzag: bool = False) -> List[_Piece]:
    """The sequence rows a rank's shard holds, in shard order: one piece [rank * L, (rank +
    1) * L) contiguously, or with zigzag (load-balanced causal sharding: the sequence cut
    into 2P pieces of L / 2) pieces rank and 2P - 1 - rank."""
    if not zigzag:
        return [_Piece(0, rank * shard_len, shard_len)]
    half = shard_len // 2
    return [_Piece(0, rank * half, half), _Piece(half, (2 * world_size - 1 - rank) * half, half)]


def chunks(pieces, S):
    """(local row, sequence row) of each split chunk of a shard, in shard order."""
    return [(p.local + c, p.start + c) for p in pieces for c in range(0, p.length, S)]


def block_sees(left, right, q0, nq, k0, nk):
    """Some row of [q0, q0 + nq) sees some key of [k0, k0 + nk) under the sides left,
    right of the whole sequence's mask (key j visible to row i iff i - left <= j <= i +
    right: Nq = Nk, so both alignments put the diagonal at j = i)."""
    return max(k0 - (q0 + nq - 1), -left) <= min(k0 + nk - 1 - q0, right)


SCHEDULES = ("auto", "ring", "wavefront")


def ring_schedule(schedule: str, zigzag: bool) -> str:
    """The schedule a ring-mode call runs: "auto" is the wavefront for contiguous shards
    and the ring for zigzag ones (the wavefront takes contiguous shards only)."""
    if schedule not in SCHEDULES:
        raise InvalidArgumentError(f"schedule: expected one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    if schedule == "auto":
        return "ring" if zigzag else "wavefront"
    if schedule == "wavefront" and zigzag:
        raise InvalidArgumentError("schedule='wavefront' takes contiguous shards: with zigzag=True the dK/dV of a key "
                                   "piece would visit each rank twice (query pieces r and 2P - 1 - r); use "
                                   "schedule='ring' or 'auto'")
    return schedule


def shard_sees(left, right, world_size, shard_len, zigzag, r, j):
    """Some row of rank r's shard sees some key of rank j's shard (then r computes blocks
    with j's K/V)."""
    return any(block_sees(left, right, a.start, a.length, b.start, b.length)
               for a in shard_rows(r, world_size, shard_len, zigzag)
               for b in shard_rows(j, world_size, shard_len, zigzag))


def wavefront_chain(left, right, world_size, shard_len, j):
    """The ranks whose rows see key shard j, ascending: the wavefront schedule sends j's K/V
    from its owner to each of them and passes j's dK/dV accumulator along them in this
    order (ascending ranks are ascending query chunks for contiguous shards), the last
    sending it home to j."""
    return [r for r in range(world_size) if shard_sees(left, right, world_size, shard_len, False, r, j)]


def kept_shard(left, right, world_size, shard_len, r):
    """The key shard whose K/V rank r keeps from the wavefront's forward for its backward
    (one shard: O(N / P) memory), or None: that of rank r - 1 where r's rows see it. Then
    rank r - 1 does not send its K/V to r again, which takes every rank but the last
    from (3P - 2) to 3 (P - 1) shards without a mask: K and V across each link once per
    pass, their gradients once."""
    if r >= 1 and shard_sees(left, right, world_size, shard_len, False, r, r - 1):
        return r - 1
    return None


def context_parallel_bytes(mode: str, world_size: int, *, batch: int, heads: int, heads_kv: int,
                           shard_len: int, head_dim: int, split_size: int, causal: bool = False,
                           window=None, zigzag: bool = False, backward: bool = True,
                           schedule: str = "auto") -> List[int]:
    """Bytes each rank sends in one context_parallel_attention call (forward, plus the
    backward when backward=True), as a formula of the sizes: pyfa.sim.io's model of the
    communication (docs/context_parallel.md, "Modes and what is communicated").
    Ring mode, schedule "ring": K and V (2 B Hkv L d floats) cross the P - 1 links of the
    ring once per pass; the backward sends K and V round again and returns one dK and one
    dV partial per (query chunk of the rank, key chunk of the owner) block that some row
    sees. Schedule "wavefront": each owner sends its K and V to every rank whose rows see
    them, once in the forward and, but to the rank that kept them (kept_shard), once in
    the backward, where the dK/dV accumulator of each key shard (2 B Hkv L d floats)
    passes along those ranks ascending (wavefront_chain), the last sending it home.
    "auto": ring_schedule.
    Ulysses: each all-to-all sends (P - 1) / P of its tensor; q, k, v and O in the forward,
    dO, dq, dk, dv in the backward (LSE, B H L floats, goes back in the forward too)."""
    P, L, S = world_size, shard_len, split_size
    kv = 2 * batch * heads_kv * L * head_dim * 4
    if mode == "ulysses":
        q = batch * heads * L * head_dim * 4
        fwd = (2 * q + kv + batch * heads * L * 4) * (P - 1) // P
        bwd = (2 * q + kv) * (P - 1) // P
        return [fwd + (bwd if backward else 0)] * P
    bounds = mask_bounds(causal, window, "top_left", P * L, P * L)
    if ring_schedule(schedule, zigzag) == "wavefront":
        out = []
        for r in range(P):
            kv_sends = sum(shard_sees(bounds.left, bounds.right, P, L, False, x, r) for x in range(P) if x != r)
            resends = kv_sends - (r + 1 < P and kept_shard(bounds.left, bounds.right, P, L, r + 1) == r)
            acc_sends = 0
            for j in range(P):
                chain = wavefront_chain(bounds.left, bounds.right, P, L, j)
                if r in chain and (r != chain[-1] or r != j):
                    acc_sends += 1
            out.append(kv * (kv_sends + ((resends + acc_sends) if backward else 0)))
        return out
    out = []
    block = 2 * batch * heads_kv * S * head_dim * 4
    for r in range(P):
        sent = (P - 1) * kv * (2 if backward else 1)
        if backward:
            mine = chunks(shard_rows(r, P, L, zigzag), S)
            for other in range(P):
                if other != r:
                    sent += block * sum(block_sees(bounds.left, bounds.right, q0, S, k0, S) for _, k0 in chunks(shard_rows(other, P, L, zigzag), S)
                                        for _, q0 in mine)
        out.append(sent)
    return out


__all__ = ["SCHEDULES", "block_sees", "chunks", "context_parallel_bytes", "kept_shard", "ring_schedule",
           "shard_rows", "shard_sees", "wavefront_chain"]
