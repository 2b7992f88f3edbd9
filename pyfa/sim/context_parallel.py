"""The communication of pyfa.torch.context_parallel_attention (docs/context_parallel.md),
modelled without torch: which sequence rows each rank's shard holds, which blocks of the
split structure some row sees, and the bytes each rank sends. pyfa/context_parallel.py
plans its transfers with these very functions, so the model and the run cannot drift."""

from typing import List, NamedTuple

from ..checks import mask_bounds


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


def context_parallel_bytes(mode: str, world_size: int, *, batch: int, heads: int, heads_kv: int,
                        shard_len: int, head_dim: int, split_size: int, causal: bool = False,
                        window=None, zigzag: bool = False, backward: bool = True) -> List[int]:
    """Bytes each rank sends in one context_parallel_attention call (forward, plus the
    backward when backward=True), as a formula of the sizes: pyfa.sim.io's model of the
    communication. Ring: K and V (2 B Hkv L d floats) cross the P - 1 links of the ring
    once per pass; the backward sends K and V round again and returns one dK and one dV
    partial per (query chunk of the rank, key chunk of the owner) block that some row sees.
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


__all__ = ["block_sees", "chunks", "context_parallel_bytes", "shard_rows"]
