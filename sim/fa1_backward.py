"""FlashAttention-1 backward, simulated: the twin of cuda/kernels/fa1_backward.cuh.

The loops are the kernel's (Dao et al. 2022, Algorithm 4): K/V tiles j outside, Q tiles i
inside; P_ij recomputed from Q, K, m and l; D_i = rowsum(dO_i o O_i) recomputed at every
(j, i); dQ_i read, updated and written back to HBM at every (j, i); dK~_j and dV~_j
accumulated over i on chip and written once per j. The same fp32 operations in the same
order (docs/numerics.md). Vectorized over heads, over the Q tiles of one j (independent
except for the dK~_j, dV~_j accumulation, which is then done tile by tile in increasing
i) and over the elements of a tile. Padded rows have P = 0 and dO = 0, padded columns
P = 0 and K = V = 0: they add only zeros to sums that started at +0, and are cut away.
"""

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from .inputs import check_causal, check_like, check_qkv, check_rows, resolve_scale, restore_rank
from .io import IORecord
from .tiles import launch_tiles
from .tiling import causal_masked, ceil_div, q_tile_begin

F32 = np.float32
NEG_INF = np.float32(-np.inf)


@dataclass
class Fa1BackwardResult:
    dq: np.ndarray  # like q
    dk: np.ndarray  # like k
    dv: np.ndarray  # like v
    io: IORecord


@nx.ieee_arithmetic
def fa1_backward(q, k, v, o, m, l, do, *, causal=False, scale=None, block_r=None,
                 block_c=None):
    q4, k4, v4, rank = check_qkv(q, k, v)
    o4 = check_like("o", o, q4)
    do4 = check_like("do", do, q4)
    m3 = check_rows("m", m, q4)
    l3 = check_rows("l", l, q4)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    Br, Bc = launch_tiles("fa1_backward", d, block_r, block_c)
    causal = check_causal(causal)

    BH, Tr, Tc = B * H, ceil_div(Nq, Br), ceil_div(Nk, Bc)
    # Array widths: a tile never holds more rows than Nq or more columns than Nk (a tile
    # wider than the sequence is the only tile), so the padding stops there.
    Wr, Wc = min(Br, Nq), min(Bc, Nk)
    io = IORecord(label=f"FA1 backward (simulated), Br={Br}, Bc={Bc}")
    nbytes = lambda rows: rows * d * 4

    def row_blocks(x, fill):
        """(BH, Nq, ...) -> (BH, Tr, Wr, ...), rows past Nq set to `fill`."""
        out = np.full((BH, Tr * Wr) + x.shape[2:], fill, F32)
        out[:, :Nq] = x
        return out.reshape((BH, Tr, Wr) + x.shape[2:])

    Qi = row_blocks(q4.reshape(BH, Nq, d), 0)
    Oi = row_blocks(o4.reshape(BH, Nq, d), 0)
    dOi = row_blocks(do4.reshape(BH, Nq, d), 0)
    mi = row_blocks(m3.reshape(BH, Nq), NEG_INF)
    li = row_blocks(l3.reshape(BH, Nq), 0)
    rows = np.arange(Tr)[:, None] * Wr + np.arange(Wr)[None, :]  # (Tr, Wr) query index
    K = k4.reshape(BH, Nk, d)
    V = v4.reshape(BH, Nk, d)

    # dQ = 0 in HBM, written by the kernel before its first read.
    dQ = np.zeros((BH, Tr, Wr, d), F32)
    io.write("dQ", BH * nbytes(Nq))
    dK = np.zeros((BH, Nk, d), F32)
    dV = np.zeros((BH, Nk, d), F32)

    for j in range(Tc):
        col0 = j * Bc
        bc = min(Bc, Nk - col0)
        Kj = np.zeros((BH, Wc, d), F32)
        Vj = np.zeros((BH, Wc, d), F32)
        Kj[:, :bc] = K[:, col0:col0 + bc]
        Vj[:, :bc] = V[:, col0:col0 + bc]
        io.read("K", BH * nbytes(bc))
        io.read("V", BH * nbytes(bc))
        dKj = np.zeros((BH, Wc, d), F32)
        dVj = np.zeros((BH, Wc, d), F32)

        # Q tiles i >= a see some key of tile j; the earlier ones are skipped (causal).
        a = q_tile_begin(causal, col0, Nq, Nk, Br)
        n_rows = Nq - a * Br
        if a < Tr:
            for name in ("Q", "dO", "O", "dQ"):
                io.read(name, BH * nbytes(n_rows))
            io.read("m", BH * n_rows * 4)
            io.read("l", BH * n_rows * 4)
            io.write("dQ", BH * nbytes(n_rows))

            Q_a, dO_a, O_a = Qi[:, a:], dOi[:, a:], Oi[:, a:]
            m_a, l_a = mi[:, a:], li[:, a:]
            A = Tr - a

            # S = scale * Q_i K_j^T, -inf if masked; P_ij = exp(S - m_i) / l_i, 0 where l_i = 0.
            cols = col0 + np.arange(Wc)
            hidden = cols[None, None, :] >= Nk  # padding columns
            if causal:
                hidden = hidden | causal_masked(rows[a:, :, None], cols[None, None, :], Nq, Nk)
            S = nx.scores(Q_a, Kj[:, None], scale, hidden[None])
            with np.errstate(divide="ignore", invalid="ignore"):
                P = np.where(l_a[..., None] == 0, F32(0),
                             nx.exp(S - nx.safe_max(m_a)[..., None]) / l_a[..., None])

            # dP_ij = dO_i V_j^T and D_i = rowsum(dO_i o O_i), x in order.
            dP = nx.dot_rows(dO_a, Vj[:, None])
            D = nx.dot(dO_a, O_a)
            dS = P * (dP - D[..., None])

            # dV~_j = dV~_j + P_ij^T dO_i: the product per tile (r in order), then the
            # tiles added in increasing i, as the kernel's inner loop does.
            t = nx.dot_rows(np.swapaxes(P, -1, -2), np.swapaxes(dO_a, -1, -2))
            for n in range(A):
                dVj = dVj + t[:, n]

            # dQ_i = fma(scale, dS_ij K_j, dQ_i) (c in order), in HBM.
            t = nx.dot_rows(dS, np.swapaxes(Kj, -1, -2)[:, None])
            dQ[:, a:] = nx.canonical_nan(nx.fma32(F32(scale), t, dQ[:, a:]))

            # dK~_j = fma(scale, dS_ij^T Q_i, dK~_j) (r in order), tiles in increasing i.
            t = nx.dot_rows(np.swapaxes(dS, -1, -2), np.swapaxes(Q_a, -1, -2))
            for n in range(A):
                dKj = nx.fma32(F32(scale), t[:, n], dKj)

        dK[:, col0:col0 + bc] = nx.canonical_nan(dKj[:, :bc])
        dV[:, col0:col0 + bc] = nx.canonical_nan(dVj[:, :bc])
        io.write("dK", BH * nbytes(bc))
        io.write("dV", BH * nbytes(bc))

    dQ = dQ.reshape(BH, Tr * Wr, d)[:, :Nq].reshape(B, H, Nq, d)
    return Fa1BackwardResult(restore_rank(dQ, rank), restore_rank(dK.reshape(B, H, Nk, d), rank),
                             restore_rank(dV.reshape(B, H, Nk, d), rank), io)
