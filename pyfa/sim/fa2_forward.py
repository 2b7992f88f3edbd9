"""FlashAttention-2 forward, simulated: the twin of src/kernels/fa2_forward.cuh.

The loops are the kernel's: one block per (Q row block i, query head h, batch b), each
walking the K/V tiles j of its band mask.kv_tiles(i) in increasing order, then within a
tile the same fp32 operations in the same order (docs/numerics.md). Query head h reads
K/V head h // (H / Hkv). With GQA packing (tiles.grid_launch, as the library decides)
a block is a (Q row block i, K/V head, batch b) instead, its rows the group's G heads
taken query by query: row R is query R // G of head hk * G + R % G. Only independent
work is vectorized: all blocks and all row blocks i at once (those whose band holds j),
and all elements of a tile. Rows and
columns past the end of the sequence are padded; the padding only ever meets operations
that leave the real elements unchanged (max with -inf, adding +0), and is cut away.
"""

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from . import score
from .calls import simulated
from ..checks import ScoreMods, check_qkv, check_split_size, resolve_scale, restore_rank, restore_rows
from .io import IORecord
from .mask import Mask
from .merge import checked_sinks, merge_sinks, merge_states
from .tiles import grid_launch, launch_tiles
from .tiling import ceil_div, kv_heads

F32 = np.float32
NEG_INF = np.float32(-np.inf)


@dataclass
class Fa2ForwardResult:
    o: np.ndarray    # like q, in the layout asked for
    lse: np.ndarray  # (B, H, Nq) without q's missing leading axes, whatever the layout
    io: IORecord


@simulated("fa2", "forward", Fa2ForwardResult)
@nx.ieee_arithmetic
def fa2_forward(q, k, v, *, causal=False, window=None, causal_align="bottom_right", scale=None,
                block_r=None, block_c=None, layout="bhnd", split_size=None, sinks=None, **mods):
    q4, k4, v4, rank, Hkv = check_qkv(q, k, v, layout)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    Br, Bc = launch_tiles("fa2_forward", d, block_r, block_c)
    split_size = check_split_size(split_size, d, Bc)
    mods = ScoreMods.resolve("pyfa.sim.fa2_forward", (B, H, Nq, Nk, d, Hkv), causal_align, **mods)
    mask = Mask.resolve(causal, window, causal_align, Nq, Nk, mods.diagonal_offset)
    sinks = checked_sinks(sinks, H)

    # Blocks: NB per Q row block, each of NR rows (qg query heads' Nq, query by query).
    qg, Br = grid_launch(B, H, Hkv, Nq, Nk, Br, split_size, block_r)
    Hb, NR = H // qg, qg * Nq
    NB, Tr, Tc = B * Hb, ceil_div(NR, Br), ceil_div(Nk, Bc)
    io = IORecord(label=f"FA2 forward (simulated), Br={Br}, Bc={Bc}")
    nbytes = lambda rows: rows * d * 4

    # Q_i for every row block at once: (NB, Tr, Br, d), rows past NR zero.
    Qi = np.zeros((NB, Tr * Br, d), F32)
    Qi[:, :NR] = _pack(q4, qg)
    Qi = Qi.reshape(NB, Tr, Br, d)
    io.read("Q", NB * nbytes(NR))
    R = (np.arange(Tr)[:, None] * Br + np.arange(Br)[None, :])  # (Tr, Br) row of the block
    rows = R // qg  # its query index
    x = np.arange(NB).reshape(NB, 1, 1, 1)
    # The score pipeline's (b, h) of each block's rows: (NB, 1, 1, 1), (NB, Tr, Br, 1).
    bb, hh = x // Hb, (x % Hb) * qg + (R % qg)[None, :, :, None]
    K = (k4 if qg > 1 else kv_heads(k4, H)).reshape(NB, Nk, d)
    V = (v4 if qg > 1 else kv_heads(v4, H)).reshape(NB, Nk, d)
    # Split-KV (params.h): chunk c visits the K/V tiles of keys [c * split_size, (c + 1) *
    # split_size) and yields a partial (O, LSE); merge_states folds them in ascending order.
    per = Tc if not split_size else split_size // Bc
    parts_o, parts_lse = [], []
    for lo in range(0, max(Tc, 1) if not split_size else ceil_div(Nk, split_size) * per, per):
        Oi = np.zeros((NB, Tr, Br, d), F32)
        mi = np.full((NB, Tr, Br), NEG_INF, F32)
        li = np.zeros((NB, Tr, Br), F32)

        for j in range(lo, min(lo + per, Tc)):
            col0 = j * Bc
            bc = min(Bc, Nk - col0)
            # The row blocks whose band kv_tiles(i) holds j are exactly those holding a row
            # of the queries q_tiles(j) (as tiles of 1): each block visits j, and they are
            # vectorized together.
            qa, qz = mask.q_tiles(col0, bc, 1, Nq)
            if qa == qz:
                continue
            a, z = qa * qg // Br, (qz * qg - 1) // Br + 1
            Kj = np.zeros((NB, Bc, d), F32)
            Vj = np.zeros((NB, Bc, d), F32)
            Kj[:, :bc] = K[:, col0:col0 + bc]
            Vj[:, :bc] = V[:, col0:col0 + bc]
            io.read("K", NB * (z - a) * nbytes(bc))
            io.read("V", NB * (z - a) * nbytes(bc))
            score.bias_io(mods, io, NB * (min(NR, z * Br) - a * Br) * bc)

            # S_ij: the score pipeline (pyfa/sim/score.py), its sums x in order.
            Q_a = Qi[:, a:z]
            cols = col0 + np.arange(Bc)
            hidden = (cols[None, None, :] >= Nk) | mask.masked(rows[a:z, :, None], cols[None, None, :])
            S = score.scores(mods, Q_a, Kj[:, None], scale, hidden[None], bb, hh[:, a:z],
                             rows[a:z, :, None], cols[None, None, :])
            # A row that sees no key of the tile takes no step; a hidden score is left out of P V.
            keep = ~hidden[None]
            steps = keep.any(axis=-1)

            m_old = mi[:, a:z]
            m_new = m_old
            for c in range(Bc):
                m_new = nx.maximum(m_new, S[..., c])
            alpha = nx.exp(m_old - nx.safe_max(m_new))
            P = nx.exp(S - nx.safe_max(m_new)[..., None])

            rowsum = np.zeros_like(m_new)
            for c in range(Bc):
                rowsum = rowsum + P[..., c]
            l_new = nx.fma32(alpha, li[:, a:z], rowsum)
            # pv[r, x] = sum_c P[r, c] V_j[c, x], c in order, one fma per step; P V takes
            # P o Z / (1 - p) (dropout), l above P undropped.
            P = score.dropped(mods, P, bb, hh[:, a:z], rows[a:z, :, None], cols[None, None, :])
            pv = nx.dot_rows(P, np.swapaxes(Vj, -1, -2)[:, None], keep)
            O_new = nx.fma32(alpha[..., None], Oi[:, a:z], pv)

            mi[:, a:z] = np.where(steps, m_new, mi[:, a:z])
            li[:, a:z] = np.where(steps, l_new, li[:, a:z])
            Oi[:, a:z] = np.where(steps[..., None], O_new, Oi[:, a:z])

        with np.errstate(divide="ignore", invalid="ignore"):
            O = np.where(li[..., None] == 0, F32(0), Oi / li[..., None])
            LSE = np.where(li == 0, NEG_INF, mi + nx.log(li))

        parts_o.append(O)
        parts_lse.append(LSE)
        if split_size:
            io.write("O partials", NB * nbytes(NR))
            io.write("LSE partials", NB * NR * 4)
    if split_size:
        O, LSE = merge_states(np.stack(parts_o), np.stack(parts_lse))
        io.read("O partials", len(parts_o) * NB * nbytes(NR))
        io.read("LSE partials", len(parts_o) * NB * NR * 4)
    O = nx.canonical_nan(_unpack(O.reshape(NB, Tr * Br, d)[:, :NR], B, H, qg))
    LSE = nx.canonical_nan(_unpack(LSE.reshape(NB, Tr * Br, 1)[:, :NR], B, H, qg)[..., 0])
    if sinks is not None:
        # Each row's final state merged with its head's sink where it is written: by the
        # epilogue (each Q tile reads its rows' heads' sinks) or, split, by the combine (its
        # row tiles one head each, never packed).
        O, LSE = merge_sinks(O, LSE, sinks)
        io.read("sinks", (B * H * ceil_div(Nq, Br) if split_size else NB * Tr * qg) * 4)
    io.write("O", NB * nbytes(NR))
    io.write("LSE", NB * NR * 4)
    return Fa2ForwardResult(restore_rank(O, rank, layout), restore_rows(LSE, rank), io)


def _pack(x4, qg):
    """(B, H, Nq, d) -> the blocks' rows (B * H / qg, qg * Nq, d): row R of block
    b * (H / qg) + y is query R // qg of head y * qg + R % qg."""
    B, H, Nq, d = x4.shape
    return x4.reshape(B, H // qg, qg, Nq, d).transpose(0, 1, 3, 2, 4).reshape(B * H // qg, Nq * qg, d)


def _unpack(rows, B, H, qg):
    """_pack's inverse: the blocks' rows (B * H / qg, qg * Nq, e) -> (B, H, Nq, e)."""
    Nq, e = rows.shape[1] // qg, rows.shape[2]
    return rows.reshape(B, H // qg, Nq, qg, e).transpose(0, 1, 3, 2, 4).reshape(B, H, Nq, e)
