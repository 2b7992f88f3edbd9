"""Context parallelism on torch.distributed (docs/context_parallel.md): attention over a
sequence sharded across the ranks of a process group, with the bits of one device.

Each rank holds a shard of L rows of q, k and v. The sequence (N = P * L rows, P ranks)
is cut into chunks of split_size rows, and every reduction is a fold over those chunks
in ascending order, exactly as pyfa.torch.attention(..., split_size=S) folds them on one
device (docs/numerics.md, "Split-KV" and "FA2 backward"): O and LSE merge the per-key-chunk
partials (pyfa.merge_states), dQ adds the per-key-chunk partials, dK and dV add the
per-query-chunk partials, each from +0, chunks ascending. Each partial is one pyfa call
on a block (query rows, key chunk) of the whole problem, its mask placed by
diagonal_offset, so it is the very partial the one-device split computes. The number of
ranks, the order in which K/V arrive and the sharding change which rank computes a
block, never its bits or the order of a fold: the same bits on 1, 2 or 8 ranks.

Modes: "ring" moves K/V shards between the ranks, in one of two schedules: "ring" passes
them between neighbours (rank r sends to r - 1 and receives from r + 1, the next step's
transfer overlapping this step's blocks), "wavefront" sends each from its owner to the
ranks that need it and passes each key shard's dK/dV accumulator up the ranks, so that no
rank holds more than a few shards (docs/context_parallel.md, "Memory per rank");
"ulysses" turns the sequence shards into head shards with all-to-all, runs one
pyfa.torch.attention per rank over the whole sequence, and turns the result back.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import numbers
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from . import api
from .checks import _check_dropout, check_int, check_softcap, mask_bounds
from .errors import ArgumentTypeError, InvalidArgumentError
from .kvcache import merge_states
from .sim.context_parallel import (block_sees, chunks, kept_shard, ring_schedule, shard_rows, shard_sees,
                                  wavefront_chain)

_MODES = ("ring", "ulysses")
# Tags of the wavefront schedule's messages (each pass waits for all of its own, so the
# forward and the backward may use the same): + 2 * shard, one per tensor of a pair.
_KV_TAG, _ACC_TAG, _HOME_TAG = 2 << 20, 3 << 20, 4 << 20


class _Plan(NamedTuple):
    group: object
    rank: int
    world: int
    peers: tuple        # global rank of each group rank
    shard_len: int
    split: int
    zigzag: bool
    schedule: str       # "ring" or "wavefront" (ring mode)
    axis: int           # the sequence axis of q, k, v (2 in "bhnd", 1 in "bnhd")
    left: int           # the mask's sides over the whole sequence, finite
    right: int
    call: dict          # the keywords of every block's pyfa call but diagonal_offset
    timeout: datetime.timedelta
    stats: Optional[dict]
    bias: Optional[Tensor]  # (B|1, H|1, L|1, N): the shard's query rows over all N keys

    def bias_of(self, ql, nq, k0, nk, backward=False, grad=False):
        """The block call's bias keywords: the bias of its nq query rows from local row ql
        and its nk keys from key k0; a backward's dbias only with grad."""
        if self.bias is None:
            return {}
        b = self.bias if self.bias.shape[2] == 1 else self.bias.narrow(2, ql, nq)
        return dict(bias=b.narrow(3, k0, nk), **({"bias_grad": grad} if backward else {}))

    def backward_block(self, q, k_src, v_src, o, lse, do, ql, q0, kl, k0, dbias):
        """dQ, dK, dV of the block (this rank's query chunk from local row ql, sequence row
        q0; key chunk from local row kl of k_src, v_src, sequence row k0): the one-device
        split's partials. dbias (or None): its rows ql.. and keys k0.. take the block's
        dBias, which is the one-device call's there, element by element (docs/numerics.md,
        "FA2 backward": dBias does not fold by chunk)."""
        S = self.split
        grads = api.fa2_backward(self.rows(q, ql, S), self.rows(k_src, kl, S), self.rows(v_src, kl, S),
                                 self.rows(o, ql, S), lse.narrow(2, ql, S), self.rows(do, ql, S),
                                 **self.at(q0, k0), **self.call,
                                 **self.bias_of(ql, S, k0, S, backward=True, grad=dbias is not None))
        if dbias is not None:
            dbias.narrow(2, ql, S).narrow(3, k0, S).copy_(grads[3])
        return grads[:3]

    def at(self, q0, k0):
        """The block call's place in the whole problem: its query rows from row q0 and keys
        from key k0 (the mask's diagonal, and dropout's decisions where it is on)."""
        where = dict(diagonal_offset=q0 - k0)
        if "dropout_p" in self.call:
            where["dropout_origin"] = (0, 0, q0, k0)
        return where

    def sees(self, q0, nq, k0, nk):
        return block_sees(self.left, self.right, q0, nq, k0, nk)

    def rows(self, t, start, n):
        return t.narrow(self.axis, start, n)

    def shard_sees(self, r, j):
        return shard_sees(self.left, self.right, self.world, self.shard_len, self.zigzag, r, j)

    def hold(self, tensors):
        """Counts the buffers `tensors` (received K/V, dK/dV partials or accumulators) as
        held; comm_stats["peak_held_bytes"] is the most held at once."""
        if self.stats is not None:
            held = self.stats.get("_held", 0) + sum(t.numel() * t.element_size() for t in tensors)
            self.stats["_held"] = held
            self.stats["peak_held_bytes"] = max(self.stats.get("peak_held_bytes", 0), held)

    def drop(self, tensors):
        if self.stats is not None:
            self.stats["_held"] -= sum(t.numel() * t.element_size() for t in tensors)
            if not self.stats["_held"]:
                del self.stats["_held"]


def _wait(plan, works, step):
    for w in works:
        try:
            w.wait(timeout=plan.timeout)
        except RuntimeError as e:
            raise TimeoutError(f"pyfa.torch.context_parallel_attention: {step}: no answer within "
                               f"{plan.timeout.total_seconds():g} s on rank {plan.rank}, or a peer failed "
                               f"({e})") from None


def _send_recv(plan, sends, recvs, dst, src, tag0):
    """Starts sending the tensors `sends` to group rank dst and receiving into `recvs`
    from group rank src; returns the works."""
    works = []
    for n, t in enumerate(sends):
        works.append(dist.isend(t, plan.peers[dst], group=plan.group, tag=tag0 + n))
        if plan.stats is not None:
            plan.stats["bytes_sent"] = plan.stats.get("bytes_sent", 0) + t.numel() * t.element_size()
    for n, t in enumerate(recvs):
        works.append(dist.irecv(t, plan.peers[src], group=plan.group, tag=tag0 + n))
    return works


def _ring(plan, kv, step_name):
    """Yields (owner, tensors) of each rank's K/V-side tensors `kv` in ring order (the own
    shard first, then ranks r + 1, r + 2, ... mod P), receiving the next while the caller
    computes on the current one."""
    P, r = plan.world, plan.rank
    cur = [t.contiguous() for t in kv]
    for t in range(P):
        works, nxt = [], None
        if t < P - 1:
            nxt = [torch.empty_like(x) for x in cur]
            plan.hold(nxt)
            works = _send_recv(plan, cur, nxt, (r - 1) % P, (r + 1) % P, tag0=16 * t)
        yield (r + t) % P, cur
        _wait(plan, works, f"{step_name} step {t + 1} of {P - 1} (K/V from rank {(r + 1) % P})")
        cur = nxt


def _in_order(plan, kv, step_name, needed):
    """Yields (owner, local row, sequence row, tensors) of every key chunk of the sequence
    in ascending sequence order, the K/V-side tensors `kv` of its owner's shard received
    through the ring (_ring). A shard that arrives before its chunks' turn is held (its
    K/V, not partial results) until then, and dropped once its chunks are done; one none
    of whose chunks is needed(sequence row) is not held (tensors None)."""
    P, S = plan.world, plan.split
    order = sorted((k0, owner, kl) for owner in range(P)
                   for kl, k0 in chunks(shard_rows(owner, P, plan.shard_len, plan.zigzag), S))
    held, left = {}, {owner: plan.shard_len // S for owner in range(P)}
    n = 0
    for owner, tensors in _ring(plan, kv, step_name):
        mine = chunks(shard_rows(owner, P, plan.shard_len, plan.zigzag), S)
        held[owner] = tensors if any(needed(k0) for _, k0 in mine) else None
        if held[owner] is None and owner != plan.rank:
            plan.drop(tensors)
        while n < len(order) and order[n][1] in held:
            k0, o, kl = order[n]
            yield o, kl, k0, held[o]
            n += 1
            left[o] -= 1
            if left[o] == 0:
                if o != plan.rank and held[o] is not None:
                    plan.drop(held[o])
                del held[o]


def _merge(acc, part, axis):
    """merge_states of two (O, LSE) states, the accumulator first (None: empty); O's
    sequence axis is `axis` (LSE's is 2)."""
    if acc is None:
        return part
    (oa, la), (oc, lc) = acc, part
    rows = (lambda t: t.cpu().numpy()) if axis == 2 else (lambda t: t.transpose(1, 2).cpu().numpy())
    o, lse = merge_states(np.stack([rows(oa), rows(oc)]), np.stack([la.cpu().numpy(), lc.cpu().numpy()]))
    o = torch.from_numpy(o).to(oa.device)
    return (o if axis == 2 else o.transpose(1, 2)), torch.from_numpy(lse).to(la.device)


def _add(acc, part):
    """acc + part, the accumulator starting at +0."""
    return (torch.zeros_like(part) if acc is None else acc) + part


def _from_owners(plan, kv, step_name, kept=None, backward=False):
    """The wavefront schedule's K/V: yields (j, tensors) for each key shard j that some row
    of this rank sees, j ascending, the K/V-side tensors `kv` of rank j's shard received
    straight from its owner (the own shard: `kv`), the next one's transfer overlapping the
    caller's compute on the current one: at most two received shards held. Sends `kv` to
    every rank whose rows see this rank's keys, each once. kept (a dict, or None where no
    backward follows): the forward puts the shard of kept_shard in it and does not drop
    it; the backward takes it from there, and its owner does not send it again."""
    P, r = plan.world, plan.rank
    mine = [t.contiguous() for t in kv]
    keep = None if kept is None else kept_shard(plan.left, plan.right, P, plan.shard_len, r)
    if backward and keep is not None and keep not in kept:
        raise RuntimeError("pyfa.torch.context_parallel_attention: a second backward through the same call "
                           "(retain_graph=True): schedule='wavefront' hands the K/V shard it kept from the "
                           "forward to the first backward; use schedule='ring' to run the backward twice")
    sends = []
    for dst in range(P):
        if dst != r and plan.shard_sees(dst, r) and not (
                backward and kept_shard(plan.left, plan.right, P, plan.shard_len, dst) == r):
            sends += _send_recv(plan, mine, [], dst, None, tag0=_KV_TAG + 2 * r)
    need = [j for j in range(P) if plan.shard_sees(r, j)]

    def start(j):
        if j == r:
            return mine, []
        if backward and j == keep:
            return kept.pop(j), []
        bufs = [torch.empty_like(t) for t in mine]
        plan.hold(bufs)
        return bufs, _send_recv(plan, [], bufs, None, j, tag0=_KV_TAG + 2 * j)

    nxt = start(need[0]) if need else None
    for n, j in enumerate(need):
        cur, works = nxt
        if n + 1 < len(need):
            nxt = start(need[n + 1])
        _wait(plan, works, f"{step_name}: K/V of rank {j}")
        yield j, cur
        if j == keep and not backward:
            kept[j] = cur
        elif j != r:
            plan.drop(cur)
    _wait(plan, sends, f"{step_name}: sending this rank's K/V")


def _key_chunks(plan, kv, step_name, needed, kept=None):
    """(owner, local row, sequence row, tensors) of every key chunk, ascending, that this
    rank may need (needed(sequence row) in the ring; in the wavefront, of every shard some
    row sees), the K/V-side tensors `kv` of its owner's shard from the plan's schedule;
    kept: _from_owners'."""
    if plan.schedule == "ring":
        yield from _in_order(plan, kv, step_name, needed)
        return
    for j, tensors in _from_owners(plan, kv, step_name, kept):
        for kl, k0 in chunks(shard_rows(j, plan.world, plan.shard_len, False), plan.split):
            yield j, kl, k0, tensors


def _ring_forward(plan, q, k, v, kept=None):
    S = plan.split
    pieces = shard_rows(plan.rank, plan.world, plan.shard_len, plan.zigzag)
    acc = [None] * len(pieces)  # (O, LSE) of each query piece over the key chunks so far

    def needed(k0):
        return any(plan.sees(p.start, p.length, k0, S) for p in pieces)

    for _, kl, k0, kv_src in _key_chunks(plan, (k, v), "forward", needed, kept):
        for n, p in enumerate(pieces):
            if plan.sees(p.start, p.length, k0, S):
                k_src, v_src = kv_src
                part = api.fa2_forward(plan.rows(q, p.local, p.length), plan.rows(k_src, kl, S),
                                       plan.rows(v_src, kl, S), **plan.at(p.start, k0), **plan.call,
                                       **plan.bias_of(p.local, p.length, k0, S))
                acc[n] = _merge(acc[n], part, plan.axis)
    o, lse = torch.zeros_like(q), q.new_full(q.shape[:1] + (q.shape[1 if plan.axis == 2 else 2], q.shape[plan.axis]),
                                             -math.inf)
    for p, state in zip(pieces, acc):
        if state is not None:
            plan.rows(o, p.local, p.length).copy_(state[0])
            lse.narrow(2, p.local, p.length).copy_(state[1])
    return o, lse


def _ring_backward(plan, q, k, v, o, lse, do, dbias):
    S, P, r = plan.split, plan.world, plan.rank
    mine = chunks(shard_rows(r, P, plan.shard_len, plan.zigzag), S)
    dq_acc = {ql: None for ql, _ in mine}
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    # dK/dV partials of this rank's key chunks, from every rank: {(key local row, query row): (dk, dv)}
    kv_parts = {}
    outgoing = {owner: [] for owner in range(P)}
    left = {owner: plan.shard_len // S for owner in range(P)}
    sends, messages, own_parts = [], [], []

    def needed(k0):
        return any(plan.sees(q0, S, k0, S) for _, q0 in mine)

    for owner, kl, k0, kv_src in _in_order(plan, (k, v), "backward", needed):
        for ql, q0 in mine:
            if not plan.sees(q0, S, k0, S):
                continue
            dq_b, dk_b, dv_b = plan.backward_block(q, *kv_src, o, lse, do, ql, q0, kl, k0, dbias)
            dq_acc[ql] = _add(dq_acc[ql], dq_b)
            plan.hold((dk_b, dv_b))
            if owner == r:
                kv_parts[(kl, q0)] = (dk_b, dv_b)
                own_parts += [dk_b, dv_b]
            else:
                outgoing[owner] += [dk_b, dv_b]
        left[owner] -= 1
        if left[owner] == 0 and outgoing[owner]:
            # One message of this rank's partials for the owner's key chunks, in the order
            # the owner enumerates them (its key chunks ascending, then this rank's query chunks).
            parts = outgoing.pop(owner)
            msg = torch.stack(parts).contiguous()
            plan.hold([msg])
            plan.drop(parts)
            sends += _send_recv(plan, [msg], [], owner, None, tag0=1 << 20)
            messages.append(msg)
    # The other ranks' partials of this rank's key chunks: each rank sends one message.
    mine_k = sorted(mine, key=lambda c: c[1])
    recvs = []
    for other in range(P):
        if other == r:
            continue
        theirs_q = chunks(shard_rows(other, P, plan.shard_len, plan.zigzag), S)
        blocks = [(kl, q0) for kl, k0 in mine_k for _, q0 in theirs_q if plan.sees(q0, S, k0, S)]
        if not blocks:
            continue
        like = plan.rows(k, 0, S)
        msg = torch.empty((2 * len(blocks),) + tuple(like.shape), dtype=k.dtype, device=k.device)
        plan.hold([msg])
        messages.append(msg)
        recvs.append((blocks, msg, _send_recv(plan, [], [msg], None, other, tag0=1 << 20)))
    for blocks, msg, works in recvs:
        _wait(plan, works, "backward: dK/dV partials from another rank")
        for n, key in enumerate(blocks):
            kv_parts[key] = (msg[2 * n], msg[2 * n + 1])
    _wait(plan, sends, "backward: sending dK/dV partials")
    plan.drop(messages)
    dq = _dq_out(plan, q, mine, dq_acc)
    # dK_b, dV_b: the partials of the query chunks in ascending sequence order.
    for kl, _ in mine_k:
        acc_k = acc_v = None
        for _, (pk, pv) in sorted(((key, val) for key, val in kv_parts.items() if key[0] == kl),
                                  key=lambda item: item[0][1]):
            acc_k, acc_v = _add(acc_k, pk), _add(acc_v, pv)
        if acc_k is not None:
            plan.rows(dk, kl, S).copy_(acc_k)
            plan.rows(dv, kl, S).copy_(acc_v)
    plan.drop(own_parts)
    return dq, dk, dv


def _wavefront_backward(plan, q, k, v, o, lse, do, kept, dbias):
    """The backward in the wavefront schedule (contiguous shards): rank r takes the key
    shards j its rows see in ascending order, K/V from their owners (_from_owners), and
    with them the dK/dV accumulator of shard j from the previous rank of j's chain
    (wavefront_chain: the ranks that see j, ascending, so ascending query chunks), adds its
    own query chunks' partials to it in ascending order and passes it on; the last rank
    sends it home. So every fold is the one-device split's (dQ over key chunks ascending,
    dK/dV over query chunks ascending, each from +0) with O(1) shards in flight: rank r
    works on shard j at step r + j, 2P - 1 steps in all. kept: the forward's (_from_owners);
    dbias: plan.backward_block's."""
    S, P, r = plan.split, plan.world, plan.rank
    mine = chunks(shard_rows(r, P, plan.shard_len, False), S)
    dq_acc = {ql: None for ql, _ in mine}
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)  # contiguous: received into
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    chains = [wavefront_chain(plan.left, plan.right, P, plan.shard_len, j) for j in range(P)]
    home = []
    if chains[r] and chains[r][-1] != r:
        # The last rank of this shard's chain sends its dK/dV home, straight into the outputs.
        home = _send_recv(plan, [], [dk, dv], None, chains[r][-1], tag0=_HOME_TAG)
    need = [j for j in range(P) if r in chains[j]]

    def start(j):
        """Shard j's accumulator (dK, dV): +0 at the chain's first rank, else received; the
        outputs themselves where this rank is the whole chain of its own shard."""
        if chains[j] == [r]:
            return (dk, dv), [], None
        at = chains[j].index(r)
        bufs = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (dk, dv)]
        plan.hold(bufs)
        if at == 0:
            return bufs, [], None
        return bufs, _send_recv(plan, [], bufs, None, chains[j][at - 1], tag0=_ACC_TAG + 2 * j), chains[j][at - 1]

    nxt = start(need[0]) if need else None
    sending = None  # (tensors, works) of the accumulator last sent on: at most one in flight
    for n, (j, (k_src, v_src)) in enumerate(_from_owners(plan, (k, v), "backward", kept, backward=True)):
        (acc_k, acc_v), works, src = nxt
        if n + 1 < len(need):
            nxt = start(need[n + 1])
        _wait(plan, works, f"backward: the dK/dV of rank {j}'s keys from rank {src}")
        for ql, q0 in mine:
            for kl, k0 in chunks(shard_rows(j, P, plan.shard_len, False), S):
                if not plan.sees(q0, S, k0, S):
                    continue
                dq_b, dk_b, dv_b = plan.backward_block(q, k_src, v_src, o, lse, do, ql, q0, kl, k0, dbias)
                dq_acc[ql] = _add(dq_acc[ql], dq_b)
                plan.rows(acc_k, kl, S).add_(dk_b)
                plan.rows(acc_v, kl, S).add_(dv_b)
        if sending is not None:
            _wait(plan, sending[1], "backward: passing on a dK/dV accumulator")
            plan.drop(sending[0])
            sending = None
        at = chains[j].index(r)
        if at + 1 < len(chains[j]):
            sending = ((acc_k, acc_v), _send_recv(plan, [acc_k, acc_v], [], chains[j][at + 1], None,
                                                  tag0=_ACC_TAG + 2 * j))
        elif j != r:
            sending = ((acc_k, acc_v), _send_recv(plan, [acc_k, acc_v], [], j, None, tag0=_HOME_TAG))
        elif acc_k is not dk:
            dk.copy_(acc_k)
            dv.copy_(acc_v)
            plan.drop((acc_k, acc_v))
    if sending is not None:
        _wait(plan, sending[1], "backward: passing on the last dK/dV accumulator")
        plan.drop(sending[0])
    if home:
        _wait(plan, home, f"backward: this rank's dK/dV from rank {chains[r][-1]}")
    return _dq_out(plan, q, mine, dq_acc), dk, dv


def _dq_out(plan, q, mine, dq_acc):
    """The shard's dQ from the folded chunks (a chunk no key reaches: +0)."""
    dq = torch.zeros_like(q)
    for ql, _ in mine:
        if dq_acc[ql] is not None:
            plan.rows(dq, ql, plan.split).copy_(dq_acc[ql])
    return dq


class _Attention(torch.autograd.Function):
    """O and LSE of q, k, v, and their gradients: in ring mode `how` is the _Plan whose
    blocks compute them; in Ulysses mode the keywords of one split call over the whole
    sequence on the rank's heads (what pyfa.torch.attention(..., split_size=S) runs).
    bias (ring mode, or None): the plan's bias as the caller's graph holds it, given here
    only so that its gradient (each block's dBias in its rows and keys) reaches it."""

    @staticmethod
    def forward(ctx, q, k, v, how, bias=None):
        q, k, v = q.detach(), k.detach(), v.detach()
        ctx.kept = None
        if isinstance(how, dict):
            o, lse = api.fa2_forward(q, k, v, **how)
        else:
            # The wavefront keeps one received K/V shard for the backward, where one follows.
            ctx.kept = {} if how.schedule == "wavefront" and any(ctx.needs_input_grad[:3]) else None
            o, lse = _ring_forward(how, q, k, v, ctx.kept)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.how = how
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = (t.detach() for t in ctx.saved_tensors)
        do = torch.zeros_like(o) if do is None else do.detach().contiguous()
        how = ctx.how
        # Blocks the mask hides keep +0, as the one-device dBias does there.
        dbias = torch.zeros(how.bias.shape, dtype=torch.float32, device=how.bias.device) if ctx.needs_input_grad[4] \
            else None
        if isinstance(how, dict):
            dq, dk, dv = api.fa2_backward(q, k, v, o, lse, do, **how)
        elif how.schedule == "ring":
            dq, dk, dv = _ring_backward(how, q, k, v, o, lse, do, dbias)
        else:
            dq, dk, dv = _wavefront_backward(how, q, k, v, o, lse, do, ctx.kept, dbias)
        return dq, dk, dv, None, dbias


def _all_to_all(plan, x, scatter, gather):
    """x split into P parts along axis `scatter`, part s sent to rank s; the P parts
    received concatenated along axis `gather` in rank order."""
    P = plan.world
    parts = torch.stack(x.chunk(P, dim=scatter)).contiguous()
    out = torch.empty_like(parts)
    if plan.stats is not None:
        plan.stats["bytes_sent"] = plan.stats.get("bytes_sent", 0) + parts[0].numel() * parts.element_size() * (P - 1)
    work = dist.all_to_all_single(out, parts, group=plan.group, async_op=True)
    _wait(plan, [work], "ulysses all-to-all")
    return torch.cat(out.unbind(0), dim=gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, scatter, gather):
        ctx.args = (plan, scatter, gather)
        return _all_to_all(plan, x, scatter, gather)

    @staticmethod
    def backward(ctx, g):
        plan, scatter, gather = ctx.args
        return _all_to_all(plan, g, gather, scatter), None, None, None


def _ulysses(plan, q, k, v, H):
    head_axis = 1 if plan.axis == 2 else 2
    seq, heads = plan.axis, head_axis
    qh, kh, vh = (_AllToAll.apply(t, plan, heads, seq) for t in (q, k, v))
    per = H // plan.world
    call = dict(plan.call, split_size=plan.split)
    if "alibi_slopes" in call:
        slopes = call["alibi_slopes"]
        call["alibi_slopes"] = slopes.narrow(slopes.dim() - 1, plan.rank * per, per)
    if "dropout_p" in call:
        call["dropout_origin"] = (0, plan.rank * per, 0, 0)
    o, lse = _Attention.apply(qh, kh, vh, call, None)
    o = _AllToAll.apply(o, plan, seq, heads)
    lse = _all_to_all(plan, lse.detach(), 2, 1)
    return o, lse


def _agreed_seed(seed, group, device):
    """dropout's seed: the caller's (checked), or one drawn from torch's default generator on
    every rank (each advances its generator as a pyfa.torch.attention call would) and group
    rank 0's taken by all."""
    if seed is not None:
        return seed
    drawn = torch.tensor([int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64))], device=device)
    dist.broadcast(drawn, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(drawn.item()) % 2 ** 64


def _agree(plan, q, k, v, signature):
    """Every rank's shapes and arguments, compared (one all-gather of a digest per field,
    waited on with the call's timeout): a clear error instead of a hang or wrong bits
    when the ranks disagree."""
    names = ("q's shape", "k's shape", "v's shape", "device kind") + tuple(signature)
    fields = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.device.type) + tuple(signature.values())
    digest = [int.from_bytes(hashlib.sha256(repr(f).encode()).digest()[:7], "little") for f in fields]
    mine = torch.tensor(digest, dtype=torch.int64, device=q.device)
    everyone = [torch.empty_like(mine) for _ in range(plan.world)]
    work = dist.all_gather(everyone, mine, group=plan.group, async_op=True)
    _wait(plan, [work], "agreeing on the shapes and arguments of every rank")
    for rank, theirs in enumerate(everyone):
        for name, field, a, b in zip(names, fields, digest, theirs.tolist()):
            if a != b:
                raise InvalidArgumentError(f"pyfa.torch.context_parallel_attention: rank {rank}'s {name} "
                                           f"differs from rank {plan.rank}'s ({field!r}); every rank holds an "
                                           f"equal shard and passes the same arguments")


def _shard_bias(bias, mode, B, H, L, N):
    """The rank's bias as a 4-dimensional view (B|1, H|1, L|1, N), or a ValueError or
    TypeError naming what cannot be honoured. One that requires grad comes as
    pyfa.torch.attention takes it (a broadcast B or H at size 1, so that autograd sums its
    gradient there), with its L rows."""
    from . import torch as pt
    pt._check_tensor("bias", bias)
    if mode != "ring":
        raise InvalidArgumentError("bias: only mode='ring' takes a bias (in Ulysses mode each rank would need "
                                   "every row of its heads' bias)")
    if bias.dtype != torch.float32:
        raise ArgumentTypeError(f"bias: expected dtype torch.float32, got {bias.dtype}")
    if bias.dim() > 4:
        raise InvalidArgumentError(f"bias: expected at most 4 dimensions, got shape {tuple(bias.shape)}")
    b = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    want = (B, H, L, N)
    if b.shape[3] != N or any(n not in (1, w) for n, w in zip(b.shape[:3], want[:3])):
        raise InvalidArgumentError(f"bias: shape {tuple(bias.shape)} does not broadcast to (B, H, L, N) = {want} "
                                   "(this rank's query rows over the whole sequence's keys)")
    if not bias.requires_grad:
        return b
    b = pt._bias_operand(b)
    if b.shape[2] == 1 and L > 1:
        # Its dBias would be a sum over the rows of every rank, which no rank folds in the
        # one-device order (docs/numerics.md, "The additive bias").
        raise InvalidArgumentError("bias: one row for all of this rank's query rows, and it requires grad: its dbias "
                                   "would sum the rows of every rank, which context_parallel_attention does not fold; "
                                   "pass it with its L rows (bias.expand(...).contiguous()) or bias.detach()")
    return b


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, *, split_size: int,
                               group=None, mode: str = "ring", schedule: str = "auto",
                               zigzag: bool = False,
                               causal: bool = False, window=None, scale: Optional[float] = None,
                               layout: str = "bhnd", softcap: Optional[float] = None,
                               alibi_slopes: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                               dropout_p: float = 0.0, seed: Optional[int] = None, offset: int = 0,
                               return_lse: bool = False,
                               block_r: Optional[int] = None, block_c: Optional[int] = None,
                               backend: str = "auto", timeout: float = 300.0,
                               comm_stats: Optional[dict] = None):
    """Attention over a sequence sharded across the ranks of `group` (default: the world),
    differentiable; each rank passes its shard and gets its shard of O (and, in the
    backward, of dQ, dK, dV). The bits equal those of pyfa.torch.attention on the whole
    sequence with the same split_size, whatever the number of ranks or the mode.

    q: (B, H, L, d) in layout "bhnd" or (B, L, H, d) in "bnhd", float32; k, v likewise with
    Hkv heads (H % Hkv == 0). Every rank's shard has the same L, a multiple of split_size
    (with zigzag, of 2 * split_size). The sequence is the ranks' shards in rank order, or,
    with zigzag=True (ring mode, for causal masks: every rank gets an equal share of the
    work), 2P pieces of L / 2 of which rank r holds pieces r and 2P - 1 - r, in that order.
    causal, window, scale, softcap, alibi_slopes: as in pyfa.torch.attention, over the
    whole sequence (Nq = Nk, so causal_align does not matter). mode: "ring" or "ulysses"
    (all-to-all over heads: H and Hkv divisible by the world size). schedule (ring mode):
    "wavefront" (each owner sends its K/V to the ranks that need them, the dK/dV
    accumulator of each key shard passes up the ranks and goes home, rank r keeping rank
    r - 1's K/V from the forward for the backward: 3 (P - 1) K/V shards sent per rank,
    O(1) shards held, 2P - 1 steps in the backward; contiguous shards only; one backward
    per call), "ring" (K/V round the
    ring, each rank holding shards that come before their turn and the owner every dK/dV
    partial of its keys: P steps), or "auto" (the wavefront, the ring with zigzag); the
    bits are the same for every schedule. return_lse: also
    return the shard's LSE (B, H, L), not differentiable. timeout: seconds any one
    transfer may take before TimeoutError names it. comm_stats: a dict that gets
    "bytes_sent", this rank's bytes sent by the call (forward and backward added up), and
    in ring mode "peak_held_bytes", the most bytes of received K/V and of dK/dV partials or
    accumulators the rank held at once beyond its own shards.
    bias (ring mode): a float32 CPU tensor broadcastable to (B, H, L, N), N = P * L: the
    additive bias of this rank's query rows (in its shard's order, zigzag included) over
    all N keys in sequence order; each block call takes its rows and keys of it. It gets
    a gradient when it requires one, the one-device call's dBias of its rows (summed over
    a broadcast B or H as there); one that requires grad must have its L rows (a row
    broadcast over them would sum rows of every rank, which is refused).
    dropout_p, seed, offset: as in pyfa.torch.attention, the mask of the whole problem
    (each block call draws the decisions of its rows, keys and heads there: dropout_origin);
    seed=None draws one from torch's default generator on every rank and takes group
    rank 0's, so that the ranks agree.
    Refused: a bias in Ulysses mode, or one row of bias that requires grad; tensors on a device the
    group's backend cannot serve (gloo: CPU; NCCL: CUDA)."""
    from . import torch as pt
    for name, t in (("q", q), ("k", k), ("v", v)):
        pt._check_tensor(name, t)
        if t.dim() != 4:
            raise InvalidArgumentError(f"{name}: expected 4 dimensions, got shape {tuple(t.shape)}")
    if mode not in _MODES:
        raise InvalidArgumentError(f"mode: expected 'ring' or 'ulysses', got {mode!r}")
    if layout not in ("bhnd", "bnhd"):
        raise InvalidArgumentError(f"layout: expected 'bhnd' or 'bnhd', got {layout!r}")
    pt._check_bool("causal", causal)
    pt._check_bool("zigzag", zigzag)
    pt._check_bool("return_lse", return_lse)
    B, H, L, Nk, d, Hkv = pt._dims(q, k, v, layout)
    if Nk != L:
        raise InvalidArgumentError(f"k: shard length {Nk} differs from q's {L} (q, k and v are sharded alike)")
    split = check_int("split_size", split_size, 1, 1 << 40)
    unit = 2 * split if zigzag else split
    if L % unit:
        raise InvalidArgumentError(f"q: shard length {L} must be a multiple of {'2 * ' if zigzag else ''}split_size "
                                   f"= {unit}")
    if zigzag and mode != "ring":
        raise InvalidArgumentError("zigzag: only mode='ring' takes the zigzag sharding")
    if mode == "ulysses" and schedule != "auto":
        raise InvalidArgumentError(f"schedule: only mode='ring' takes a schedule, got {schedule!r} with mode='ulysses'")
    plan_schedule = ring_schedule(schedule, zigzag)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise InvalidArgumentError(f"timeout: expected seconds > 0, got {timeout!r}")
    softcap = check_softcap(softcap)
    drop = _check_dropout(dropout_p, 0 if seed is None else seed, offset)  # a seed of None is drawn below
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pyfa.torch.context_parallel_attention: torch.distributed is not initialised "
                           "(torch.distributed.init_process_group first)")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if bias is not None:
        bias = _shard_bias(bias, mode, B, H, L, world * L)
    peers = tuple(dist.get_global_rank(group, i) if group is not None else i for i in range(world))
    kind = dist.get_backend(group)
    wants = {"gloo": "cpu", "nccl": "cuda"}.get(str(kind))
    if wants is not None and q.device.type != wants:
        raise InvalidArgumentError(f"q: on {q.device}, but the group's backend {kind} takes {wants} tensors")
    if mode == "ulysses" and (H % world or Hkv % world):
        raise InvalidArgumentError(f"mode='ulysses': the heads (H = {H}, Hkv = {Hkv}) must be divisible by the "
                                   f"world size {world}, so that each rank takes whole groups of query heads with "
                                   f"their K/V head")
    bounds = mask_bounds(causal, window, "top_left", world * L, world * L)
    if alibi_slopes is not None:
        pt._check_tensor("alibi_slopes", alibi_slopes)
        alibi_slopes = alibi_slopes.detach().to(q.device, torch.float32).contiguous()
    call = dict(causal=causal, window=window, causal_align="top_left", scale=scale, layout=layout,
                options=pt._options(backend, block_r, block_c))
    if softcap is not None:
        call["softcap"] = softcap
    if alibi_slopes is not None:
        call["alibi_slopes"] = alibi_slopes
    if drop["dropout_p"]:
        call.update(drop, seed=_agreed_seed(seed, group, q.device))
    plan = _Plan(group, rank, world, peers, L, split, zigzag, plan_schedule, 2 if layout == "bhnd" else 1, bounds.left,
                 bounds.right, call, datetime.timedelta(seconds=float(timeout)), comm_stats,
                 None if bias is None else bias.detach())
    signature = dict(mode=mode, schedule=plan_schedule, zigzag=zigzag, split_size=split, causal=causal, window=window, scale=scale,
                     layout=layout, softcap=softcap, backend=backend, block_r=block_r, block_c=block_c,
                     alibi_slopes=None if alibi_slopes is None else alibi_slopes.cpu().tolist(),
                     bias=None if bias is None else tuple(bias.shape),
                     dropout=(drop["dropout_p"], call.get("seed"), drop["offset"]))
    _agree(plan, q, k, v, signature)
    if mode == "ulysses":
        o, lse = _ulysses(plan, q, k, v, H)
    else:
        o, lse = _Attention.apply(q, k, v, plan, bias if bias is not None and bias.requires_grad else None)
    return (o, lse) if return_lse else o


__all__ = ["context_parallel_attention"]
