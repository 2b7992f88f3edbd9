"""count_io: the kernels' HBM traffic counted by walking their loops without arithmetic.

Each walker follows one kernel's loop nest for a single (batch, head), the same tile
bounds and causal skips as the kernel and its simulator, and adds up what each load and
store moves; all heads are alike, so the record is then scaled by B*H. The walk is per
tile row (O(Tr + Tc) steps), fast enough for B=64, H=16, N=16384 in milliseconds.

Tensors (Q, K, V, O, dO, dQ, dK, dV) are counted at `dtype_bytes` per element; the
per-row statistics (LSE, m, l, D) at 4 bytes, since implementations keep them in fp32
whatever the tensors' type. With dtype_bytes=4 the counts equal the simulator's.
"""

from .inputs import check_causal, check_count_args, check_tile
from .io import IORecord
from .tiles import resolve_tiles
from .tiling import ceil_div, kv_tile_end, q_tile_begin

STAT_BYTES = 4


def _tiles(kernel, d, block_r, block_c):
    # kernel None: a model without tiles (the unfused standard attention ignores Br, Bc).
    if kernel is None:
        return check_tile("block_r", block_r), check_tile("block_c", block_c)
    return resolve_tiles(kernel, d, block_r, block_c)


def fa2_forward_io(Nq, Nk, d, Br, Bc, causal, e):
    """One head of cuda/kernels/fa2_forward.cuh: Q_i read once, K_j and V_j once per
    visited (i, j), O_i and LSE_i written once."""
    io = IORecord()
    io.read("Q", Nq * d * e)
    for i in range(ceil_div(Nq, Br)):
        br = min(Br, Nq - i * Br)
        end = kv_tile_end(causal, i * Br, br, Nq, Nk, Bc)
        keys = min(end * Bc, Nk)  # rows of K (and V) in tiles 0 .. end-1
        io.read("K", keys * d * e)
        io.read("V", keys * d * e)
    io.write("O", Nq * d * e)
    io.write("LSE", Nq * STAT_BYTES)
    return io


def fa2_backward_preprocess_io(Nq, Nk, d, Br, Bc, causal, e):
    """One head of fa2_backward_preprocess_kernel: O and dO read once, D written once."""
    io = IORecord()
    io.read("O", Nq * d * e)
    io.read("dO", Nq * d * e)
    io.write("D", Nq * STAT_BYTES)
    return io


def fa2_backward_dkdv_io(Nq, Nk, d, Br, Bc, causal, e):
    """One head of fa2_backward_dkdv_kernel: K_j, V_j read once; Q_i, dO_i, LSE_i, D_i
    once per visited (j, i); dK_j, dV_j written once."""
    io = IORecord()
    io.read("K", Nk * d * e)
    io.read("V", Nk * d * e)
    for j in range(ceil_div(Nk, Bc)):
        rows = Nq - q_tile_begin(causal, j * Bc, Nq, Nk, Br) * Br  # rows of tiles begin .. Tr-1
        io.read("Q", rows * d * e)
        io.read("dO", rows * d * e)
        io.read("LSE", rows * STAT_BYTES)
        io.read("D", rows * STAT_BYTES)
    io.write("dK", Nk * d * e)
    io.write("dV", Nk * d * e)
    return io


def fa2_backward_dq_io(Nq, Nk, d, Br, Bc, causal, e):
    """One head of fa2_backward_dq_kernel: Q_i, dO_i, LSE_i, D_i read once; K_j, V_j once
    per visited (i, j); dQ_i written once."""
    io = IORecord()
    io.read("Q", Nq * d * e)
    io.read("dO", Nq * d * e)
    io.read("LSE", Nq * STAT_BYTES)
    io.read("D", Nq * STAT_BYTES)
    for i in range(ceil_div(Nq, Br)):
        br = min(Br, Nq - i * Br)
        keys = min(kv_tile_end(causal, i * Br, br, Nq, Nk, Bc) * Bc, Nk)
        io.read("K", keys * d * e)
        io.read("V", keys * d * e)
    io.write("dQ", Nq * d * e)
    return io


def fa1_forward_io(Nq, Nk, d, Br, Bc, causal, e):
    """One head of cuda/kernels/fa1_forward.cuh: O, m, l initialized in HBM; K_j, V_j read
    once; Q_i, O_i, m_i, l_i read and O_i, m_i, l_i written once per visited (j, i)."""
    io = IORecord()
    io.write("O", Nq * d * e)
    io.write("m", Nq * STAT_BYTES)
    io.write("l", Nq * STAT_BYTES)
    io.read("K", Nk * d * e)
    io.read("V", Nk * d * e)
    for j in range(ceil_div(Nk, Bc)):
        rows = Nq - q_tile_begin(causal, j * Bc, Nq, Nk, Br) * Br  # rows of tiles begin .. Tr-1
        io.read("Q", rows * d * e)
        io.read("O", rows * d * e)
        io.read("m", rows * STAT_BYTES)
        io.read("l", rows * STAT_BYTES)
        io.write("O", rows * d * e)
        io.write("m", rows * STAT_BYTES)
        io.write("l", rows * STAT_BYTES)
    return io


def fa1_backward_io(Nq, Nk, d, Br, Bc, causal, e):
    """One head of cuda/kernels/fa1_backward.cuh: dQ initialized in HBM; K_j, V_j read once;
    Q_i, O_i, dO_i, dQ_i, m_i, l_i read and dQ_i written once per visited (j, i); dK_j,
    dV_j written once."""
    io = IORecord()
    io.write("dQ", Nq * d * e)
    io.read("K", Nk * d * e)
    io.read("V", Nk * d * e)
    for j in range(ceil_div(Nk, Bc)):
        rows = Nq - q_tile_begin(causal, j * Bc, Nq, Nk, Br) * Br
        for name in ("Q", "dO", "O", "dQ"):
            io.read(name, rows * d * e)
        io.read("m", rows * STAT_BYTES)
        io.read("l", rows * STAT_BYTES)
        io.write("dQ", rows * d * e)
    io.write("dK", Nk * d * e)
    io.write("dV", Nk * d * e)
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


def count_io(algo, *, passes="forward", batch, heads, seqlen_q, seqlen_k, head_dim,
             block_r=None, block_c=None, causal=False, dtype_bytes=4):
    """The IO record of `algo` ("fa1", "fa2", ...) for `passes` ("forward", "backward",
    "both"), counted without arithmetic. None tiles are the library's defaults for the
    emulated device profile (sim.tiles.default_tiles)."""
    if algo not in algorithms():
        raise ValueError(f"algo: unknown algorithm {algo!r}; known: {algorithms()}")
    check_count_args(passes, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     head_dim=head_dim, dtype_bytes=dtype_bytes)
    causal = check_causal(causal)
    wanted = ["forward", "backward"] if passes == "both" else [passes]
    record = IORecord()
    for p in wanted:
        if (algo, p) not in WALKERS:
            raise ValueError(f"passes: {algo} has no {p} pass in this version")
        for kernel, walker in WALKERS[(algo, p)]:
            Br, Bc = _tiles(kernel, head_dim, block_r, block_c)
            record = record + walker(seqlen_q, seqlen_k, head_dim, Br, Bc, causal, dtype_bytes)
    out = record.scaled(batch * heads)
    out.label = f"{algo} {passes}"
    return out


# The unfused standard-attention model (sim/standard.py): no kernel, hence no tiles.
from .standard import standard_backward_io, standard_forward_io  # noqa: E402

WALKERS[("standard", "forward")] = [(None, standard_forward_io)]
WALKERS[("standard", "backward")] = [(None, standard_backward_io)]
