"""FlashAttention-2 backward, simulated: the twin of src/kernels/fa2_backward.cuh.

Three kernels, as on the device: the preprocess (D = rowsum(dO o O), per query head),
the dK/dV kernel (one block per (K/V column block j, K/V head), walking for each query
head g of its group, in order, the Q row blocks i of its band) and the dQ kernel (one
block per (Q row block i, query head), walking the K/V column blocks j of its band).
Each keeps its kernel's loops and performs the same fp32 operations in the same order
(docs/numerics.md, "FA2 backward"); only independent work is vectorized: all heads and
all blocks of the grid at once, and all elements of a tile. Rows past Nq and columns
past Nk are padded (zero rows of Q, dO, K, V, and P = dS = +0 set outright), so they add
exactly +0 to the sums, which leaves them unchanged; the padding is cut away at the end.

Each kernel takes its own default tiles unless block_r / block_c are given, as the
library does (sim.tiles.default_tiles).
"""

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from . import score
from .calls import simulated
from ..checks import ScoreMods, check_split_size, check_like, check_qkv, check_rows, resolve_scale, restore_rank
from ..errors import InvalidArgumentError
from .io import IORecord
from .mask import Mask
from .tiles import launch_tiles
from .tiling import ceil_div, kv_heads

F32 = np.float32
NEG_INF = np.float32(-np.inf)


@dataclass
class Fa2BackwardResult:
    dq: np.ndarray  # like q, in the layout asked for
    dk: np.ndarray  # like k (Hkv heads)
    dv: np.ndarray  # like v
    io: IORecord
    dbias: object = None  # with bias=: dBias, the bias's shape (docs/numerics.md §2)


def _pad_rows(x, rows):
    """(BH, N, ...) -> (BH, rows, ...) with zero rows appended."""
    out = np.zeros((x.shape[0], rows) + x.shape[2:], F32)
    out[:, :x.shape[1]] = x
    return out


def _p_ds(Qi, dOi, LSEi, Di, Kj, Vj, masked, pad, scale, mods, bh, H, rows, cols):
    """fa2_backward_p_ds on whole tiles: P_ij, dS_ij (with respect to s, score_grad) of
    shape (..., Br, Bc), keep, the scores that take part in the products, and dS_S (with
    respect to S, score_grad_S: dBias's; the kernel's dS_ij before score_mod_grad_tile).

    Qi, dOi: (BH, X, Br, d); LSEi, Di: (BH, X, Br); Kj, Vj: (BH, Y, Bc, d) with X and Y
    broadcastable; masked, pad: (X or Y, Br, Bc), True where the mask hides the
    score, and where the row or column is padding; bh: the query head index (b * H + h)
    broadcasting against the tiles; rows, cols: the query and key indices. A hidden or
    padding score gets P = dS = +0 by selection and keep False: it is left out of every
    product whatever the real inputs hold."""
    hidden = masked[None]
    s = score.scaled_scores(Qi, Kj, scale)
    S = score.finish(mods, s, hidden, bh // H, bh % H, rows, cols)
    no_key = (LSEi == NEG_INF)[..., None]
    # The kernel selects P = 0 for LSE = -inf; the 0 subtracted here instead keeps
    # -inf - (-inf) out of the arithmetic and is never selected.
    lse = np.where(no_key, F32(0), LSEi[..., None])
    P = np.where(no_key, F32(0), nx.exp(S - lse))
    dS_S = score.score_grad_S(mods, P, nx.dot_rows(dOi, Vj), Di[..., None], bh // H, bh % H, rows, cols)
    dS = score.score_mod_grad(mods, dS_S, s, S, bh // H, bh % H, rows, cols)
    keep = ~(hidden | pad[None])
    # dV takes P o Z / (1 - p) (dropout), dS above P undropped.
    P = score.dropped(mods, P, bh // H, bh % H, rows, cols)
    zero = F32(0)
    return np.where(keep, P, zero), np.where(keep, dS, zero), keep, np.where(keep, dS_S, zero)


def _preprocess(O, dO, io):
    """D[r] = pyfa_dot(dO[r], O[r]), x in order, stored canonical. O, dO: (BH, Nq, d)."""
    BH, Nq, d = O.shape
    D = nx.canonical_nan(nx.dot(dO, O))
    io.read("O", BH * Nq * d * 4)
    io.read("dO", BH * Nq * d * 4)
    io.write("D", BH * Nq * 4)
    return D


def _dkdv(Q, K, V, dO, LSE, D, Br, Bc, scale, mods, mask, io, Hkv, dB=None, split_size=0):
    """The dK/dV kernel: blocks (j, K/V head) (vectorized) walk, for each query head g of
    their group in increasing order, the Q row blocks i of their band mask.q_tiles(j) in
    increasing order. Q, dO: (BHkv, G, Nq, d); LSE, D: (BHkv, G, Nq); K, V: (BHkv, Nk, d).
    split_size > 0: query chunks of split_size rows outermost, each chunk's sums from +0
    folded into the output in ascending chunk order (split_fold in common/merge.h)."""
    BHkv, G, Nq, d = Q.shape
    Nk = K.shape[1]
    Tr, Tc = ceil_div(Nq, Br), ceil_div(Nk, Bc)
    Kj = _pad_rows(K, Tc * Bc).reshape(BHkv, Tc, Bc, d)
    Vj = _pad_rows(V, Tc * Bc).reshape(BHkv, Tc, Bc, d)
    dKj = np.zeros((BHkv, Tc, Bc, d), F32)
    dVj = np.zeros((BHkv, Tc, Bc, d), F32)

    cols = np.arange(Tc)[:, None] * Bc + np.arange(Bc)[None, :]  # (Tc, Bc) key index
    bands = np.array([mask.q_tiles(j * Bc, min(Bc, Nk - j * Bc), Br, Nq) for j in range(Tc)])
    # K_j, V_j are loaded only by the blocks j that some Q tile visits.
    seen = sum(min(Bc, Nk - j * Bc) for j in range(Tc) if bands[j, 0] < bands[j, 1])
    io.read("K", BHkv * seen * d * 4)
    io.read("V", BHkv * seen * d * 4)
    per = split_size // Br if split_size else Tr  # Q tiles per query chunk
    acc_dK = np.zeros((BHkv, Tc, Bc, d), F32)
    acc_dV = np.zeros((BHkv, Tc, Bc, d), F32)
    widths = np.array([min(Bc, Nk - j * Bc) for j in range(Tc)], np.int64)
    folded = np.zeros(Tc, bool)
    for lo in range(0, max(Tr, 1), per):
        for g in range(G):
            # The score pipeline's query head index b * H + h of each block's head hk * G + g.
            bh = (np.arange(BHkv) // Hkv * (Hkv * G) + np.arange(BHkv) % Hkv * G + g).reshape(BHkv, 1, 1, 1)
            Qp, dOp = _pad_rows(Q[:, g], Tr * Br), _pad_rows(dO[:, g], Tr * Br)
            LSEp = np.full((BHkv, Tr * Br), NEG_INF, F32)
            LSEp[:, :Nq] = LSE[:, g]
            Dp = _pad_rows(D[:, g], Tr * Br)
            for i in range(lo, min(lo + per, Tr)):
                row0 = i * Br
                br = min(Br, Nq - row0)
                # column blocks whose band holds Q tile i
                active = np.nonzero((bands[:, 0] <= i) & (i < bands[:, 1]))[0]
                if active.size == 0:
                    continue
                sl = slice(row0, row0 + Br)
                Qi, dOi = Qp[:, None, sl], dOp[:, None, sl]
                LSEi, Di = LSEp[:, None, sl], Dp[:, None, sl]
                io.read("Q", BHkv * active.size * br * d * 4)
                io.read("dO", BHkv * active.size * br * d * 4)
                io.read("LSE", BHkv * active.size * br * 4)
                io.read("D", BHkv * active.size * br * 4)
                keys = int(sum(min(Bc, Nk - j * Bc) for j in active))
                score.bias_io(mods, io, BHkv * br * keys)
                if dB is not None:
                    score.dbias_io(mods, io, 0, BHkv * keys, 0)

                rows = row0 + np.arange(Br)
                c = cols[active][:, None, :]
                pad = (c >= Nk) | (rows[None, :, None] >= Nq)
                masked = mask.masked(rows[None, :, None], c)
                P, dS, keep, dS_S = _p_ds(Qi, dOi, LSEi, Di, Kj[:, active], Vj[:, active], masked, pad, scale,
                                          mods, bh, Hkv * G, rows[None, :, None], c)
                if dB is not None:
                    score.dbias_tiles(mods, dB, dS_S, keep, bh, rows[None, :], c)

                # dV_j += P^T dO_i, dK_j += dS^T Q_i, each summed over the rows that see the
                # key, r in order; a key that no row of the tile sees takes no step.
                keep_t = np.swapaxes(keep, -1, -2)
                steps = keep_t.any(axis=-1)[..., None]
                dv = nx.dot_rows(np.swapaxes(P, -1, -2), np.swapaxes(dOi, -1, -2), keep_t)
                dk = nx.dot_rows(np.swapaxes(dS, -1, -2), np.swapaxes(Qi, -1, -2), keep_t)
                dVj[:, active] = np.where(steps, dVj[:, active] + dv, dVj[:, active])
                dKj[:, active] = np.where(steps, dKj[:, active] + dk, dKj[:, active])
        if split_size:
            # Blocks whose band meets the chunk fold its partials; the others skip it.
            hit = ((bands[:, 0] < lo + per) & (bands[:, 1] > lo) & (bands[:, 0] < bands[:, 1]))[None, :, None, None]
            acc_dK = np.where(hit, acc_dK + nx.canonical_nan(dKj * scale), acc_dK)
            acc_dV = np.where(hit, acc_dV + nx.canonical_nan(dVj), acc_dV)
            dKj[:] = 0
            dVj[:] = 0
            # The accumulator is the output (split_fold): written at every fold, read back
            # at every fold but a block's first.
            hit_j = hit[0, :, 0, 0]
            for name in ("dK", "dV"):
                io.write(name, BHkv * int(widths[hit_j].sum()) * d * 4)
                io.read(name, BHkv * int(widths[hit_j & folded].sum()) * d * 4)
            folded |= hit_j

    if dB is not None:  # the one-row sums' starts, or every element of the rows of Nq
        score.dbias_io(mods, io, BHkv * G * Nk, 0, BHkv * G * Nq * Nk)
    if split_size:
        for name in ("dK", "dV"):  # the blocks no query sees write +0
            io.write(name, BHkv * int(widths[~folded].sum()) * d * 4)
        dK = nx.canonical_nan(acc_dK.reshape(BHkv, Tc * Bc, d)[:, :Nk])
        dV = nx.canonical_nan(acc_dV.reshape(BHkv, Tc * Bc, d)[:, :Nk])
        return dK, dV
    dK = nx.canonical_nan((dKj * scale).reshape(BHkv, Tc * Bc, d)[:, :Nk])
    dV = nx.canonical_nan(dVj.reshape(BHkv, Tc * Bc, d)[:, :Nk])
    io.write("dK", BHkv * Nk * d * 4)
    io.write("dV", BHkv * Nk * d * 4)
    return dK, dV


def _dq(Q, K, V, dO, LSE, D, Br, Bc, scale, mods, mask, io, H, split_size=0):
    """The dQ kernel: blocks (i, query head) (vectorized) walk the K/V column blocks j of
    their band mask.kv_tiles(i) in increasing order. Q, dO: (BH, Nq, d); K, V: (BH, Nk, d),
    the K/V head of each query head. split_size > 0: each key chunk's dQ_i from +0, folded
    into the output after the chunk's last tile, chunks ascending (split_fold)."""
    BH, Nq, d = Q.shape
    Nk = K.shape[1]
    Tr, Tc = ceil_div(Nq, Br), ceil_div(Nk, Bc)
    Qi = _pad_rows(Q, Tr * Br).reshape(BH, Tr, Br, d)
    dOi = _pad_rows(dO, Tr * Br).reshape(BH, Tr, Br, d)
    LSEi = np.full((BH, Tr * Br), NEG_INF, F32)
    LSEi[:, :Nq] = LSE
    LSEi = LSEi.reshape(BH, Tr, Br)
    Di = _pad_rows(D, Tr * Br).reshape(BH, Tr, Br)
    io.read("Q", BH * Nq * d * 4)
    io.read("dO", BH * Nq * d * 4)
    io.read("LSE", BH * Nq * 4)
    io.read("D", BH * Nq * 4)
    Kp, Vp = _pad_rows(K, Tc * Bc), _pad_rows(V, Tc * Bc)
    dQi = np.zeros((BH, Tr, Br, d), F32)
    per = split_size // Bc if split_size else 0  # K/V tiles per key chunk
    acc = np.zeros((BH, Tr, Br, d), F32)
    heights = np.array([min(Br, Nq - i * Br) for i in range(Tr)], np.int64)
    hit = np.zeros(Tr, bool)     # blocks that visit a tile of the current chunk
    folded = np.zeros(Tr, bool)  # blocks that folded a chunk before

    rows = np.arange(Tr)[:, None] * Br + np.arange(Br)[None, :]  # (Tr, Br) query index
    for j in range(Tc):
        col0 = j * Bc
        bc = min(Bc, Nk - col0)
        # The row blocks whose band holds j are the band q_tiles(j) (pyfa/sim/mask.py).
        a, z = mask.q_tiles(col0, bc, Br, Nq)
        if per and ((j + 1) % per == 0 or j + 1 == Tc):
            end_of_chunk = True
        else:
            end_of_chunk = False
        if a == z:
            if end_of_chunk:
                acc, dQi, hit, folded = _dq_fold(acc, dQi, hit, folded, scale, heights, d, BH, io)
            continue
        hit[a:z] = True
        Kj, Vj = Kp[:, None, col0:col0 + Bc], Vp[:, None, col0:col0 + Bc]
        io.read("K", BH * (z - a) * bc * d * 4)
        io.read("V", BH * (z - a) * bc * d * 4)
        score.bias_io(mods, io, BH * (min(Nq, z * Br) - a * Br) * bc)

        r, c = rows[a:z, :, None], (col0 + np.arange(Bc))[None, None, :]
        pad = (c >= Nk) | (r >= Nq)
        masked = mask.masked(r, c)
        bh = np.arange(BH).reshape(BH, 1, 1, 1)
        _, dS, keep, _ = _p_ds(Qi[:, a:z], dOi[:, a:z], LSEi[:, a:z], Di[:, a:z], Kj, Vj, masked, pad, scale,
                            mods, bh, H, r, c)

        # dQ_i += dS_ij K_j, summed over the row's visible keys, c in order; a row that
        # sees no key of the tile takes no step.
        steps = keep.any(axis=-1)[..., None]
        dq = nx.dot_rows(dS, np.swapaxes(Kj, -1, -2), keep)
        dQi[:, a:z] = np.where(steps, dQi[:, a:z] + dq, dQi[:, a:z])
        if end_of_chunk:
            acc, dQi, hit, folded = _dq_fold(acc, dQi, hit, folded, scale, heights, d, BH, io)

    if per:
        io.write("dQ", BH * int(heights[~folded].sum()) * d * 4)  # blocks no key reaches write +0
        return nx.canonical_nan(acc.reshape(BH, Tr * Br, d)[:, :Nq])
    dQ = nx.canonical_nan((dQi * scale).reshape(BH, Tr * Br, d)[:, :Nq])
    io.write("dQ", BH * Nq * d * 4)
    return dQ


def _dq_fold(acc, dQi, hit, folded, scale, heights, d, BH, io):
    """The blocks that visited a tile of the chunk just ended fold its partial: acc + canonical(dQ_i * scale);
    the output is the accumulator (written at every fold, read back past a block's first)."""
    h = hit[None, :, None, None]
    acc = np.where(h, acc + nx.canonical_nan(dQi * scale), acc)
    io.write("dQ", BH * int(heights[hit].sum()) * d * 4)
    io.read("dQ", BH * int(heights[hit & folded].sum()) * d * 4)
    return acc, np.zeros_like(dQi), np.zeros_like(hit), folded | hit


@simulated("fa2", "backward", Fa2BackwardResult)
@nx.ieee_arithmetic
def fa2_backward(q, k, v, o, lse, do, *, causal=False, window=None, causal_align="bottom_right",
                 scale=None, block_r=None, block_c=None, layout="bhnd", split_size=None, **mods):
    """dQ, dK, dV of O = softmax(scale * Q K^T [masked]) V from the forward's O and LSE
    (pyfa.sim.fa2_forward) and dO; .io counts every HBM byte of the three kernels. dK and
    dV have k's Hkv heads, each summed over its group's query heads in increasing order.
    split_size: the split backward, as pyfa.fa2_backward's (docs/numerics.md, "FA2
    backward", "Split-KV")."""
    q4, k4, v4, rank, Hkv = check_qkv(q, k, v, layout)
    o4 = check_like("o", o, q4, layout)
    do4 = check_like("do", do, q4, layout)
    lse3 = check_rows("lse", lse, q4)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    G = H // Hkv
    scale = resolve_scale(scale, d)
    mods = ScoreMods.resolve("pyfa.sim.fa2_backward", (B, H, Nq, Nk, d, Hkv), causal_align, **mods)
    mask = Mask.resolve(causal, window, causal_align, Nq, Nk, mods.diagonal_offset)
    BH, BHkv = B * H, B * Hkv
    Q, dO, LSE = q4.reshape(BH, Nq, d), do4.reshape(BH, Nq, d), lse3.reshape(BH, Nq)
    O = o4.reshape(BH, Nq, d)
    K, V = k4.reshape(BHkv, Nk, d), v4.reshape(BHkv, Nk, d)
    launch_tiles("fa2_backward_preprocess", d, block_r, block_c)  # refused first, as in the library
    Br_kv, Bc_kv = launch_tiles("fa2_backward_dkdv", d, block_r, block_c)
    Br_q, Bc_q = launch_tiles("fa2_backward_dq", d, block_r, block_c)
    split_size = check_split_size(split_size, d)
    if split_size and split_size % Bc_q:
        raise InvalidArgumentError(f"split_size: must be a multiple of fa2_backward_dq's Bc = {Bc_q}, got {split_size}")
    if split_size and split_size % Br_kv:
        raise InvalidArgumentError(f"split_size: must be a multiple of fa2_backward_dkdv's Br = {Br_kv}, "
                                   f"got {split_size}")
    io = IORecord(label=f"FA2 backward (simulated), dK/dV Br={Br_kv}, Bc={Bc_kv}; "
                        f"dQ Br={Br_q}, Bc={Bc_q}")

    D = _preprocess(O, dO, io)
    # Query head h = hk * G + g: (B*H, ...) is (B*Hkv, G, ...) without a copy.
    group = lambda x: x.reshape((BHkv, G) + x.shape[1:])
    dB = score.dbias_start(mods, BH, ceil_div(Nq, Br_kv) * Br_kv, ceil_div(Nk, Bc_kv) * Bc_kv)
    dK, dV = _dkdv(group(Q), K, V, group(dO), group(LSE), group(D), Br_kv, Bc_kv, scale, mods, mask, io, Hkv,
                   dB, split_size)
    K_h = kv_heads(k4, H).reshape(BH, Nk, d)
    V_h = kv_heads(v4, H).reshape(BH, Nk, d)
    dQ = _dq(Q, K_h, V_h, dO, LSE, D, Br_q, Bc_q, scale, mods, mask, io, H, split_size)
    return Fa2BackwardResult(restore_rank(dQ.reshape(B, H, Nq, d), rank, layout),
                             restore_rank(dK.reshape(B, Hkv, Nk, d), rank, layout),
                             restore_rank(dV.reshape(B, Hkv, Nk, d), rank, layout), io,
                             None if dB is None else score.dbias_result(mods, dB, B, H, Nq, Nk))
