"""FlashAttention-1 backward, simulated: the twin of src/kernels/fa1_backward.cuh.

The loops are the kernel's (Dao et al. 2022, Algorithm 4): one block per (K/V head,
batch); K/V tiles j outside, then the group's query heads g (h = hk * G + g), then the Q
tiles i of the band mask.q_tiles(j); P_ij recomputed from Q, K, m and l; D_i =
rowsum(dO_i o O_i) recomputed at every (j, g, i); dQ_i read, updated and written back to
HBM at every (j, g, i); dK~_j and dV~_j accumulated over (g, i) on chip and written once
per j. The same fp32 operations in the same order (docs/numerics.md). Vectorized over
heads, over the Q tiles of one j (independent except for the dK~_j, dV~_j accumulation,
which is then done tile by tile, g outer, i inner) and over the elements of a tile.
Padded rows have P = 0 and dO = 0, padded columns P = 0 and K = V = 0: they add only
zeros to sums that started at +0, and are cut away.
"""

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from . import score
from .calls import simulated
from ..checks import ScoreMods, check_like, check_qkv, check_rows, resolve_scale, restore_rank
from .io import IORecord
from .mask import Mask
from .tiles import launch_tiles
from .tiling import ceil_div

F32 = np.float32
NEG_INF = np.float32(-np.inf)


@dataclass
class Fa1BackwardResult:
    dq: np.ndarray  # like q, in the layout asked for
    dk: np.ndarray  # like k (Hkv heads)
    dv: np.ndarray  # like v
    io: IORecord
    dbias: object = None  # with bias=: dBias, the bias's shape (docs/numerics.md §2)


@simulated("fa1", "backward", Fa1BackwardResult)
@nx.ieee_arithmetic
def fa1_backward(q, k, v, o, m, l, do, *, causal=False, window=None, causal_align="bottom_right",
                 scale=None, block_r=None, block_c=None, layout="bhnd", **mods):
    q4, k4, v4, rank, Hkv = check_qkv(q, k, v, layout)
    o4 = check_like("o", o, q4, layout)
    do4 = check_like("do", do, q4, layout)
    m3 = check_rows("m", m, q4)
    l3 = check_rows("l", l, q4)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    G = H // Hkv
    scale = resolve_scale(scale, d)
    Br, Bc = launch_tiles("fa1_backward", d, block_r, block_c)
    mods = ScoreMods.resolve("pyfa.sim.fa1_backward", (B, H, Nq, Nk, d, Hkv), causal_align, **mods)
    mask = Mask.resolve(causal, window, causal_align, Nq, Nk, mods.diagonal_offset)

    BH, BHkv, Tr, Tc = B * H, B * Hkv, ceil_div(Nq, Br), ceil_div(Nk, Bc)
    # Array widths: a tile never holds more rows than Nq or more columns than Nk (a tile
    # wider than the sequence is the only tile), so the padding stops there.
    Wr, Wc = min(Br, Nq), min(Bc, Nk)
    io = IORecord(label=f"FA1 backward (simulated), Br={Br}, Bc={Bc}")
    nbytes = lambda rows: rows * d * 4

    def row_blocks(x, fill):
        """(BH, Nq, ...) -> (BHkv, G, Tr, Wr, ...), rows past Nq set to `fill`; query head
        h = hk * G + g."""
        out = np.full((BH, Tr * Wr) + x.shape[2:], fill, F32)
        out[:, :Nq] = x
        return out.reshape((BHkv, G, Tr, Wr) + x.shape[2:])

    Qi = row_blocks(q4.reshape(BH, Nq, d), 0)
    Oi = row_blocks(o4.reshape(BH, Nq, d), 0)
    dOi = row_blocks(do4.reshape(BH, Nq, d), 0)
    mi = row_blocks(m3.reshape(BH, Nq), NEG_INF)
    li = row_blocks(l3.reshape(BH, Nq), 0)
    rows = np.arange(Tr)[:, None] * Wr + np.arange(Wr)[None, :]  # (Tr, Wr) query index
    # The score pipeline's (b, h) of each query head: (BHkv, G, 1, 1, 1).
    bh = (np.arange(BHkv)[:, None] // Hkv * H + np.arange(BHkv)[:, None] % Hkv * G
          + np.arange(G)[None, :]).reshape(BHkv, G, 1, 1, 1)
    K = k4.reshape(BHkv, Nk, d)
    V = v4.reshape(BHkv, Nk, d)

    # dQ = 0 in HBM, written by the kernel before its first read.
    dQ = np.zeros((BHkv, G, Tr, Wr, d), F32)
    io.write("dQ", BH * nbytes(Nq))
    dK = np.zeros((BHkv, Nk, d), F32)
    dV = np.zeros((BHkv, Nk, d), F32)
    dB = score.dbias_start(mods, BH, Tr * Wr, Tc * Bc)

    for j in range(Tc):
        col0 = j * Bc
        bc = min(Bc, Nk - col0)
        dKj = np.zeros((BHkv, Wc, d), F32)
        dVj = np.zeros((BHkv, Wc, d), F32)

        # Q tiles i in [a, z) see some key of tile j; the others are skipped. Every query
        # head g of the group walks them, g outer. K_j, V_j are loaded only when some Q
        # tile visits j; dK_j = dV_j = 0 are written all the same.
        a, z = mask.q_tiles(col0, bc, Br, Nq)
        n_rows = min(Nq, z * Br) - a * Br
        if a < z:
            Kj = np.zeros((BHkv, Wc, d), F32)
            Vj = np.zeros((BHkv, Wc, d), F32)
            Kj[:, :bc] = K[:, col0:col0 + bc]
            Vj[:, :bc] = V[:, col0:col0 + bc]
            io.read("K", BHkv * nbytes(bc))
            io.read("V", BHkv * nbytes(bc))
            for name in ("Q", "dO", "O", "dQ"):
                io.read(name, BH * nbytes(n_rows))
            io.read("m", BH * n_rows * 4)
            io.read("l", BH * n_rows * 4)
            io.write("dQ", BH * nbytes(n_rows))
            score.bias_io(mods, io, BH * n_rows * bc)
            score.dbias_io(mods, io, 0, BH * (z - a) * bc, 0)

            Q_a, dO_a, O_a = Qi[:, :, a:z], dOi[:, :, a:z], Oi[:, :, a:z]
            m_a, l_a = mi[:, :, a:z], li[:, :, a:z]
            Kg, Vg = Kj[:, None, None], Vj[:, None, None]  # (BHkv, 1, 1, Wc, d)

            # The score pipeline (pyfa/sim/score.py): S, -inf if hidden; P_ij = exp(S - m_i) / l_i,
            # 0 where l_i = 0. A hidden score (or a padding row or column) is 0 in P and dS
            # by selection and is left out of every product (keep).
            cols = col0 + np.arange(Wc)
            r_a, c_a = rows[a:z, :, None], cols[None, None]
            hidden = (cols[None, None, :] >= Nk) | mask.masked(r_a, c_a)
            keep = ~(hidden | (r_a >= Nq))[None, None]  # (1, 1, z-a, Wr, Wc)
            s = score.scaled_scores(Q_a, Kg, scale)
            S = score.finish(mods, s, hidden[None, None], bh // H, bh % H, r_a, c_a)
            with np.errstate(divide="ignore", invalid="ignore"):
                P = np.where(keep & (l_a[..., None] != 0),
                             nx.exp(S - nx.safe_max(m_a)[..., None]) / l_a[..., None], F32(0))

            # dP_ij = dO_i V_j^T and D_i = rowsum(dO_i o O_i), x in order.
            dP = nx.dot_rows(dO_a, Vg)
            D = nx.dot(dO_a, O_a)
            # dS_S with respect to S (dBias's), dS with respect to s (dQ's and dK's).
            dS_S = score.score_grad_S(mods, P, dP, D[..., None], bh // H, bh % H, r_a, c_a)
            dS = np.where(keep, score.score_mod_grad(mods, dS_S, s, S, bh // H, bh % H, r_a, c_a), F32(0))
            if dB is not None:
                score.dbias_tiles(mods, dB, np.where(keep, dS_S, F32(0)), keep, bh, rows[a:z], c_a)
            keep_t = np.swapaxes(keep, -1, -2)
            # A row that sees no key of the tile, or a key that no row of it sees, takes no step.
            row_steps = keep.any(axis=-1)                # (1, 1, z-a, Wr)
            col_steps = keep_t.any(axis=-1)[0, 0]        # (z-a, Wc)

            # dV~_j = dV~_j + P_ij^T dO_i: the product per tile (r in order), then the
            # tiles added in the kernel's order: query heads g, then Q tiles i. dV takes
            # P o Z / (1 - p) (dropout), dS above P undropped.
            P = score.dropped(mods, P, bh // H, bh % H, r_a, c_a)
            t = nx.dot_rows(np.swapaxes(P, -1, -2), np.swapaxes(dO_a, -1, -2), keep_t)
            for g in range(G):
                for n in range(z - a):
                    dVj = np.where(col_steps[n][:, None], dVj + t[:, g, n], dVj)

            # dQ_i = fma(scale, dS_ij K_j, dQ_i) (c in order), in HBM.
            t = nx.dot_rows(dS, np.swapaxes(Kg, -1, -2), keep)
            dQ[:, :, a:z] = np.where(row_steps[..., None],
                                     nx.canonical_nan(nx.fma32(F32(scale), t, dQ[:, :, a:z])), dQ[:, :, a:z])

            # dK~_j = fma(scale, dS_ij^T Q_i, dK~_j) (r in order), in the same order.
            t = nx.dot_rows(np.swapaxes(dS, -1, -2), np.swapaxes(Q_a, -1, -2), keep_t)
            for g in range(G):
                for n in range(z - a):
                    dKj = np.where(col_steps[n][:, None], nx.fma32(F32(scale), t[:, g, n], dKj), dKj)

        dK[:, col0:col0 + bc] = nx.canonical_nan(dKj[:, :bc])
        dV[:, col0:col0 + bc] = nx.canonical_nan(dVj[:, :bc])
        io.write("dK", BHkv * nbytes(bc))
        io.write("dV", BHkv * nbytes(bc))
        score.dbias_io(mods, io, BH * bc, 0, 0)
    score.dbias_io(mods, io, 0, 0, BH * Nq * Nk)

    dQ = dQ.reshape(BH, Tr * Wr, d)[:, :Nq].reshape(B, H, Nq, d)
    return Fa1BackwardResult(restore_rank(dQ, rank, layout),
                             restore_rank(dK.reshape(B, Hkv, Nk, d), rank, layout),
                             restore_rank(dV.reshape(B, Hkv, Nk, d), rank, layout), io,
                             None if dB is None else score.dbias_result(mods, dB, B, H, Nq, Nk))
