"""FlashAttention-2 forward, simulated: the twin of cuda/kernels/fa2_forward.cuh.

The loops are the kernel's: Q row blocks i (the grid), K/V tiles j, then within a tile
the same fp32 operations in the same order (docs/numerics.md). Only independent work is
vectorized: all heads and all row blocks i at once, and all elements of a tile. Rows and
columns past the end of the sequence are padded; the padding only ever meets operations
that leave the real elements unchanged (max with -inf, adding +0), and is cut away.
"""

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from .inputs import check_causal, check_qkv, resolve_scale, restore_rank
from .io import IORecord
from .tiles import launch_tiles
from .tiling import causal_masked, ceil_div, kv_tile_end

F32 = np.float32
NEG_INF = np.float32(-np.inf)


@dataclass
class Fa2ForwardResult:
    o: np.ndarray    # like q
    lse: np.ndarray  # q's shape without d
    io: IORecord


@nx.ieee_arithmetic
def fa2_forward(q, k, v, *, causal=False, scale=None, block_r=None, block_c=None):
    q4, k4, v4, rank = check_qkv(q, k, v)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    Br, Bc = launch_tiles("fa2_forward", d, block_r, block_c)
    causal = check_causal(causal)

    BH, Tr, Tc = B * H, ceil_div(Nq, Br), ceil_div(Nk, Bc)
    io = IORecord(label=f"FA2 forward (simulated), Br={Br}, Bc={Bc}")
    nbytes = lambda rows: rows * d * 4

    # Q_i for every row block at once: (BH, Tr, Br, d), rows past Nq zero.
    Qi = np.zeros((BH, Tr * Br, d), F32)
    Qi[:, :Nq] = q4.reshape(BH, Nq, d)
    Qi = Qi.reshape(BH, Tr, Br, d)
    io.read("Q", BH * nbytes(Nq))
    Oi = np.zeros((BH, Tr, Br, d), F32)
    mi = np.full((BH, Tr, Br), NEG_INF, F32)
    li = np.zeros((BH, Tr, Br), F32)

    rows = (np.arange(Tr)[:, None] * Br + np.arange(Br)[None, :])  # (Tr, Br) query index
    br_of = np.minimum(Br, Nq - np.arange(Tr) * Br)
    Tc_visit = np.array([kv_tile_end(causal, i * Br, br_of[i], Nq, Nk, Bc) for i in range(Tr)])
    K = k4.reshape(BH, Nk, d)
    V = v4.reshape(BH, Nk, d)

    for j in range(Tc):
        col0 = j * Bc
        bc = min(Bc, Nk - col0)
        # Row blocks that visit tile j: a suffix i >= i0, since Tc_visit grows with i.
        active = np.nonzero(j < Tc_visit)[0]
        if active.size == 0:
            continue
        a = active[0]
        Kj = np.zeros((BH, Bc, d), F32)
        Vj = np.zeros((BH, Bc, d), F32)
        Kj[:, :bc] = K[:, col0:col0 + bc]
        Vj[:, :bc] = V[:, col0:col0 + bc]
        io.read("K", BH * active.size * nbytes(bc))
        io.read("V", BH * active.size * nbytes(bc))

        # S_ij[r, c] = scale * sum_x Q_i[r, x] K_j[c, x], x in order.
        Q_a = Qi[:, a:]
        cols = col0 + np.arange(Bc)
        hidden = cols[None, None, :] >= Nk  # padding columns
        if causal:
            hidden = hidden | causal_masked(rows[a:, :, None], cols[None, None, :], Nq, Nk)
        S = nx.scores(Q_a, Kj[:, None], scale, hidden[None])

        m_old = mi[:, a:]
        m_new = m_old
        for c in range(Bc):
            m_new = nx.maximum(m_new, S[..., c])
        alpha = nx.exp(m_old - nx.safe_max(m_new))
        P = nx.exp(S - nx.safe_max(m_new)[..., None])

        rowsum = np.zeros_like(m_new)
        for c in range(Bc):
            rowsum = rowsum + P[..., c]
        l_new = nx.fma32(alpha, li[:, a:], rowsum)
        # pv[r, x] = sum_c P[r, c] V_j[c, x], c in order, one fma per step.
        pv = nx.dot_rows(P, np.swapaxes(Vj, -1, -2)[:, None])
        O_new = nx.fma32(alpha[..., None], Oi[:, a:], pv)

        mi[:, a:], li[:, a:], Oi[:, a:] = m_new, l_new, O_new

    with np.errstate(divide="ignore", invalid="ignore"):
        O = np.where(li[..., None] == 0, F32(0), Oi / li[..., None])
        LSE = np.where(li == 0, NEG_INF, mi + nx.log(li))
    O = nx.canonical_nan(O.reshape(BH, Tr * Br, d)[:, :Nq].reshape(B, H, Nq, d))
    LSE = nx.canonical_nan(LSE.reshape(BH, Tr * Br)[:, :Nq].reshape(B, H, Nq))
    io.write("O", BH * nbytes(Nq))
    io.write("LSE", BH * Nq * 4)
    return Fa2ForwardResult(restore_rank(O, rank), LSE.reshape(q.shape[:-1]), io)
