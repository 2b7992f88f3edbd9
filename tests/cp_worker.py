"""Runs pyfa.torch.context_parallel_attention in spawned gloo process groups for
tests/test_context_parallel.py: `python tests/cp_worker.py OUT P` saves, for each
world size P and rank, every case's shard of O, dQ, dK, dV and the bytes sent, and the
outcome of the misuse cases, to OUT/P{P}_r{rank}.pt; `python tests/cp_worker.py OUT nccl`
runs NCCL_CASES on CUDA tensors in a one-rank NCCL group into OUT/nccl.pt."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, D, S = 1, 16, 8


def seqlen(name):
    """N, a multiple of S * P for P = 1 .. 4 (zigzag: of 2 * S * P)."""
    return 192 if CASES[name][3].get("zigzag") else 96
TILES = dict(block_r=8, block_c=8)  # the split size is a multiple of the tiles
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])

# name: (heads, heads_kv, layout, keywords); every case is GQA. Ring mode's schedule
# "auto" is the wavefront for contiguous shards and the ring for zigzag ones.
CASES = {
    "ring": (4, 2, "bhnd", dict()),
    "ring_causal": (4, 2, "bhnd", dict(causal=True, schedule="wavefront")),
    "ring_zigzag": (4, 2, "bhnd", dict(causal=True, zigzag=True)),
    "ring_mods": (4, 2, "bnhd", dict(window=(37, 5), softcap=4.0, alibi_slopes=SLOPES)),
    "ring_by_ring": (4, 2, "bhnd", dict(schedule="ring")),
    "ring_by_ring_causal": (4, 2, "bhnd", dict(causal=True, schedule="ring")),
    # bias=(Bb, Hb, grad): a bias of shape (Bb, Hb, N, N), each rank passing its rows
    # (full_bias), requiring grad or not; Hb = 1 sums dBias over the heads.
    "ring_bias": (4, 2, "bhnd", dict(causal=True, bias=(B, 4, True))),
    "ring_bias_window": (4, 2, "bhnd", dict(window=(21, 3), schedule="ring", bias=(B, 4, True))),
    "ring_bias_zigzag": (4, 2, "bnhd", dict(causal=True, zigzag=True, softcap=4.0, bias=(1, 1, True))),
    "ring_dropout": (4, 2, "bhnd", dict(causal=True, dropout_p=0.25, seed=77, offset=3)),
    "ring_dropout_zigzag": (4, 2, "bnhd", dict(causal=True, zigzag=True, window=(37, 5), alibi_slopes=SLOPES,
                                               dropout_p=0.2, seed=2 ** 64 - 5, bias=(1, 4, False))),
    "ring_dropout_by_ring": (4, 2, "bhnd", dict(causal=True, dropout_p=0.25, seed=77, offset=3, schedule="ring")),
    "ulysses": (8, 4, "bhnd", dict(mode="ulysses")),
    "ulysses_dropout": (8, 4, "bnhd", dict(mode="ulysses", causal=True, softcap=4.0, dropout_p=0.3, seed=9)),
    "ulysses_causal": (8, 4, "bnhd", dict(mode="ulysses", causal=True)),
}


def inputs(name):
    """q, k, v and the upstream gradient do of a case over the whole sequence, (B, H, N, d)."""
    heads, heads_kv, layout, _ = CASES[name]
    N = seqlen(name)
    g = torch.Generator().manual_seed(heads * 7 + heads_kv)
    shapes = [(B, heads, N, D), (B, heads_kv, N, D), (B, heads_kv, N, D), (B, heads, N, D)]
    ts = [torch.randn(*s, generator=g) for s in shapes]
    return [t.transpose(1, 2).contiguous() for t in ts] if layout == "bnhd" else ts


def full_bias(name):
    """The bias of a case over the whole sequence, -inf in a stripe of keys of some rows
    (a row of the stripe sees its other keys)."""
    Bb, Hb, grad = CASES[name][3]["bias"]
    N = seqlen(name)
    bias = torch.randn(Bb, Hb, N, N, generator=torch.Generator().manual_seed(11))
    bias[..., 5::7, 2:N // 3] = -torch.inf
    return bias.requires_grad_(grad)


def rows_of(rank, P, zigzag, N):
    L = N // P
    if not zigzag:
        return list(range(rank * L, (rank + 1) * L))
    h = L // 2
    return list(range(rank * h, rank * h + h)) + list(range((2 * P - 1 - rank) * h, (2 * P - rank) * h))


# The cases a one-rank NCCL group runs on CUDA tensors (no bias: pyfa's Python API takes
# a bias with CPU arrays only, api.py).
NCCL_CASES = ("ring", "ring_zigzag", "ring_mods", "ring_dropout", "ulysses_causal")


def run_case(name, rank, P, group, device="cpu"):
    import pyfa.torch as pt
    heads, heads_kv, layout, kw = CASES[name]
    if kw.get("mode") == "ulysses" and heads_kv % P:
        return None
    axis = 2 if layout == "bhnd" else 1
    idx = torch.tensor(rows_of(rank, P, kw.get("zigzag", False), seqlen(name)))
    q, k, v, do = (t.index_select(axis, idx).to(device) for t in inputs(name))
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    bias = None
    if "bias" in kw:
        bias = full_bias(name)
        bias = bias.detach().index_select(2, idx).requires_grad_(bias.requires_grad)
        kw = dict(kw, bias=bias)
    stats = {}
    o = pt.context_parallel_attention(q, k, v, split_size=S, layout=layout, comm_stats=stats, group=group,
                                      **TILES, **kw)
    o.backward(do)
    return dict(rows=idx, o=o.detach().cpu(), dq=q.grad.cpu(), dk=k.grad.cpu(), dv=v.grad.cpu(),
                bytes=stats.get("bytes_sent", 0),
                held=stats.get("peak_held_bytes", 0), dbias=None if bias is None else bias.grad)


def misuse(rank, P, group, spare, done):
    """The messages of calls the ranks of `group` (P ranks) disagree on; `spare`, a group
    of the same ranks, takes the case that leaves its transfers unfinished. `done`: a file
    rank 0 creates once it has timed out, which the other ranks wait for."""
    import pyfa.torch as pt
    out = {}
    q = torch.randn(1, 2, 16 if rank == 0 else 32, D)
    try:
        pt.context_parallel_attention(q, q, q, split_size=S, group=group, **TILES)
    except ValueError as e:
        out["shard"] = str(e)
    q = torch.randn(1, 2, 16, D)
    try:
        pt.context_parallel_attention(q, q, q, split_size=S, causal=rank == 1, group=group, **TILES)
    except ValueError as e:
        out["args"] = str(e)
    try:
        pt.context_parallel_attention(q, q, q, split_size=S, mode="ulysses", group=group, **TILES)
    except ValueError as e:
        out["ulysses_heads"] = str(e) if P == 3 else None
    N = 16 * P
    for key, bias, mode in (("bias_grad", torch.zeros(1, 1, 1, N, requires_grad=True), "ring"),
                            ("bias_ulysses", torch.zeros(1, 1, 16, N), "ulysses"),
                            ("bias_shape", torch.zeros(1, 1, 16, 16 * P + 1), "ring")):
        try:
            pt.context_parallel_attention(q, q, q, split_size=S, mode=mode, bias=bias, group=group, **TILES)
        except ValueError as e:
            out[key] = str(e)
    # seed=None: each rank draws from its own generator (here all different) and rank 0's
    # draw is taken, so the call equals one given that seed.
    torch.manual_seed(1000 + rank)
    x = torch.randn(1, 2, 16, D, generator=torch.Generator().manual_seed(3))
    drawn = pt.context_parallel_attention(x, x, x, split_size=S, dropout_p=0.5, group=group, **TILES)
    seed0 = int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64,
                              generator=torch.Generator().manual_seed(1000))) % 2 ** 64
    given = pt.context_parallel_attention(x, x, x, split_size=S, dropout_p=0.5, seed=seed0, group=group, **TILES)
    plain = pt.context_parallel_attention(x, x, x, split_size=S, group=group, **TILES)
    out["seed_none"] = (torch.equal(drawn, given), torch.equal(given, plain))
    try:
        pt.context_parallel_attention(x, x, x, split_size=S, dropout_p=0.5, seed=rank, group=group, **TILES)
    except ValueError as e:
        out["seed_differs"] = str(e)
    try:
        meta = q.to("meta")
        pt.context_parallel_attention(meta, meta, meta, split_size=S, group=group, **TILES)
    except ValueError as e:
        out["device"] = str(e)
    # A second backward through a wavefront call: the ranks that kept a K/V shard for the
    # first say so, rank 0 (which keeps none) times out waiting for K/V not sent again.
    x = torch.randn(1, 2, 16, D, requires_grad=True)
    o = pt.context_parallel_attention(x, x, x, split_size=S, timeout=1.0, group=spare, **TILES)
    o.sum().backward(retain_graph=True)
    try:
        o.sum().backward()
    except (RuntimeError, TimeoutError) as e:
        out["twice"] = str(e)
    # Rank 1 never calls: rank 0 must not hang.
    if rank == 0:
        t0 = time.monotonic()
        try:
            pt.context_parallel_attention(q, q, q, split_size=S, timeout=1.0, group=group, **TILES)
        except TimeoutError as e:
            out["timeout"] = (str(e), time.monotonic() - t0)
        open(done, "w").close()
    else:
        # Alive but silent past rank 0's timeouts, however long a loaded machine makes
        # them (a fixed sleep was either too short there or idle time elsewhere), up to the
        # groups' own timeout.
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


def ddp_step(rank, P, group):
    """One DDP training step of a small model with pyfa.torch.attention inside, the same
    batch on every rank: its gradients."""
    import pyfa.torch as pt

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.qkv = torch.nn.Linear(D, 3 * D)
            self.out = torch.nn.Linear(D, D)

        def forward(self, x):
            q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
            return self.out(pt.attention(q, k, v, causal=True, **TILES).squeeze(1))

    model = Block()
    if P > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    x = torch.randn(2, 24, D, generator=torch.Generator().manual_seed(5))
    model(x).square().sum().backward()
    return {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}


def worker(rank, world, port, out):
    """One process of `world`; each world size P of the run is the group of ranks 0 .. P-1
    (every process takes part in making each group, as torch.distributed wants)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    groups = {P: dist.new_group(list(range(P))) for P in range(1, world + 1)}
    spares = {P: dist.new_group(list(range(P))) for P in (2, 3) if P <= world}
    results = {}
    for P, group in groups.items():
        if rank < P:
            res = {name: run_case(name, rank, P, group) for name in CASES}
            if P in (1, 2):
                res["ddp"] = ddp_step(rank, P, group)
            results[P] = res
        dist.barrier()
    # Last: the misuse cases leave their groups' collectives unfinished.
    for P in (2, 3):
        if rank < P <= world:
            results[P]["misuse"] = misuse(rank, P, groups[P], spares[P], os.path.join(out, f"misuse_P{P}.done"))
    for P, res in results.items():
        torch.save(res, os.path.join(out, f"P{P}_r{rank}.pt"))


def nccl_one_rank(out):
    """NCCL_CASES on CUDA tensors in a one-rank NCCL group, and the refusal of CPU tensors
    there, into OUT/nccl.pt."""
    import pyfa.torch as pt
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 20000))
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    res = {name: run_case(name, 0, 1, None, device="cuda") for name in NCCL_CASES}
    q = torch.zeros(1, 2, 16, 16)
    try:
        pt.context_parallel_attention(q, q, q, split_size=S, **TILES)
        res["cpu_refused"] = None
    except ValueError as e:
        res["cpu_refused"] = str(e)
    dist.destroy_process_group()
    torch.save(res, os.path.join(out, "nccl.pt"))


if __name__ == "__main__":
    if sys.argv[2] == "nccl":
        nccl_one_rank(sys.argv[1])
    else:
        out, world = sys.argv[1], int(sys.argv[2])
        mp.spawn(worker, args=(world, 29400 + os.getpid() % 20000, out), nprocs=world)
