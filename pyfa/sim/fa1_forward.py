"""FlashAttention-1 forward, simulated: the twin of src/kernels/fa1_forward.cuh.

The loops are the kernel's (Dao et al. 2022, Algorithm 1): one block per (query head h,
batch b), reading K/V head h // (H / Hkv); K/V tiles j outside, the Q tiles i of the
band mask.q_tiles(j) inside, O, m and l kept in HBM and rewritten at every visited (j,
i), the same fp32 operations in the same order (docs/numerics.md). Only independent work
is vectorized: all heads, and for one j all Q tiles i at once (the step (j, i) depends
on (j-1, i) only), and all elements of a tile. Rows and columns past the end of the
sequence are padded; the padding only ever meets operations that leave the real elements
unchanged (max with -inf, adding +0), and is cut away.
"""

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from . import score
from .calls import simulated
from ..checks import ScoreMods, check_qkv, resolve_scale, restore_rank, restore_rows
from .io import IORecord
from .mask import Mask
from .tiles import launch_tiles
from .tiling import ceil_div, kv_heads

F32 = np.float32
NEG_INF = np.float32(-np.inf)


@dataclass
class Fa1ForwardResult:
    o: np.ndarray  # like q, in the layout asked for
    m: np.ndarray  # (B, H, Nq) less q's missing axes: the row max, -inf for a row that sees no key
    l: np.ndarray  # (B, H, Nq) likewise: sum_c exp(S[r, c] - m[r]), 0 for such a row
    io: IORecord


@simulated("fa1", "forward", Fa1ForwardResult)
@nx.ieee_arithmetic
def fa1_forward(q, k, v, *, causal=False, window=None, causal_align="bottom_right", scale=None,
                block_r=None, block_c=None, layout="bhnd", **mods):
    q4, k4, v4, rank, Hkv = check_qkv(q, k, v, layout)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    Br, Bc = launch_tiles("fa1_forward", d, block_r, block_c)
    mods = ScoreMods.resolve("pyfa.sim.fa1_forward", (B, H, Nq, Nk, d, Hkv), causal_align, **mods)
    mask = Mask.resolve(causal, window, causal_align, Nq, Nk, mods.diagonal_offset)

    BH, Tr, Tc = B * H, ceil_div(Nq, Br), ceil_div(Nk, Bc)
    # Array widths: a tile never holds more rows than Nq or more columns than Nk (a tile
    # wider than the sequence is the only tile), so the padding stops there.
    Wr, Wc = min(Br, Nq), min(Bc, Nk)
    io = IORecord(label=f"FA1 forward (simulated), Br={Br}, Bc={Bc}")
    nbytes = lambda rows: rows * d * 4

    # O = 0, l = 0, m = -inf in HBM, written by the kernel before anything reads them.
    O = np.zeros((BH, Tr, Wr, d), F32)
    m = np.full((BH, Tr, Wr), NEG_INF, F32)
    l = np.zeros((BH, Tr, Wr), F32)
    io.write("O", BH * nbytes(Nq))
    io.write("m", BH * Nq * 4)
    io.write("l", BH * Nq * 4)

    # Q_i for every row block: (BH, Tr, Wr, d), rows past Nq zero.
    Qi = np.zeros((BH, Tr * Wr, d), F32)
    Qi[:, :Nq] = q4.reshape(BH, Nq, d)
    Qi = Qi.reshape(BH, Tr, Wr, d)
    rows = np.arange(Tr)[:, None] * Wr + np.arange(Wr)[None, :]  # (Tr, Wr) query index
    bh = np.arange(BH).reshape(BH, 1, 1, 1)  # the score pipeline's (b, h) of each head
    K = kv_heads(k4, H).reshape(BH, Nk, d)
    V = kv_heads(v4, H).reshape(BH, Nk, d)

    for j in range(Tc):
        col0 = j * Bc
        bc = min(Bc, Nk - col0)
        # Q tiles i in [a, z) see some key of tile j; the others are skipped, and a tile
        # no row sees is not even loaded.
        a, z = mask.q_tiles(col0, bc, Br, Nq)
        if a == z:
            continue
        Kj = np.zeros((BH, Wc, d), F32)
        Vj = np.zeros((BH, Wc, d), F32)
        Kj[:, :bc] = K[:, col0:col0 + bc]
        Vj[:, :bc] = V[:, col0:col0 + bc]
        io.read("K", BH * nbytes(bc))
        io.read("V", BH * nbytes(bc))
        n_rows = min(Nq, z * Br) - a * Br
        score.bias_io(mods, io, BH * n_rows * bc)
        io.read("Q", BH * nbytes(n_rows))
        io.read("O", BH * nbytes(n_rows))
        io.read("m", BH * n_rows * 4)
        io.read("l", BH * n_rows * 4)

        # S_ij: the score pipeline (pyfa/sim/score.py), its sums x in order.
        Q_a = Qi[:, a:z]
        cols = col0 + np.arange(Wc)
        hidden = (cols[None, None, :] >= Nk) | mask.masked(rows[a:z, :, None], cols[None, None])
        S = score.scores(mods, Q_a, Kj[:, None], scale, hidden[None], bh // H, bh % H,
                         rows[a:z, :, None], cols[None, None])
        # A row that sees no key of the tile takes no step (its O, m, l stay as they are);
        # a hidden score is left out of P V.
        keep = ~hidden[None]
        steps = keep.any(axis=-1)

        # m~_ij = max(-inf, S[r, 0], ...); P~_ij = exp(S_ij - m~_ij); l~_ij = rowsum.
        mt = np.full((BH, z - a, Wr), NEG_INF, F32)
        for c in range(Wc):
            mt = nx.maximum(mt, S[..., c])
        P = nx.exp(S - nx.safe_max(mt)[..., None])
        lt = np.zeros_like(mt)
        for c in range(Wc):
            lt = lt + P[..., c]

        m_old, l_old = m[:, a:z], l[:, a:z]
        m_new = nx.maximum(m_old, mt)
        alpha = nx.exp(m_old - nx.safe_max(m_new))  # exp(m_i - m_new)
        beta = nx.exp(mt - nx.safe_max(m_new))      # exp(m~_ij - m_new)
        o_scale = l_old * alpha
        l_new = nx.fma32(beta, lt, o_scale)

        # pv[r, x] = sum_c P~_ij[r, c] V_j[c, x], c in order, one fma per step; P V takes
        # P~ o Z / (1 - p) (dropout), l~ above P~ undropped.
        P = score.dropped(mods, P, bh // H, bh % H, rows[a:z, :, None], cols[None, None])
        pv = nx.dot_rows(P, np.swapaxes(Vj, -1, -2)[:, None], keep)
        num = nx.fma32(o_scale[..., None], O[:, a:z], beta[..., None] * pv)
        with np.errstate(divide="ignore", invalid="ignore"):
            O_new = np.where(l_new[..., None] == 0, F32(0), num / l_new[..., None])

        # Stored to HBM, so NaNs canonical (docs/numerics.md); l_new above is the on-chip value.
        O[:, a:z] = np.where(steps[..., None], nx.canonical_nan(O_new), O[:, a:z])
        m[:, a:z] = np.where(steps, nx.canonical_nan(m_new), m[:, a:z])
        l[:, a:z] = np.where(steps, nx.canonical_nan(l_new), l[:, a:z])
        io.write("O", BH * nbytes(n_rows))
        io.write("m", BH * n_rows * 4)
        io.write("l", BH * n_rows * 4)

    O = O.reshape(BH, Tr * Wr, d)[:, :Nq].reshape(B, H, Nq, d)
    m = m.reshape(BH, Tr * Wr)[:, :Nq].reshape(B, H, Nq)
    l = l.reshape(BH, Tr * Wr)[:, :Nq].reshape(B, H, Nq)
    return Fa1ForwardResult(restore_rank(O, rank, layout), restore_rows(m, rank),
                            restore_rows(l, rank), io)
