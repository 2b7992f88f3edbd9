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
from .calls import simulated
from .inputs import check_like, check_qkv, check_rows, resolve_scale, restore_rank
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


def _pad_rows(x, rows):
    """(BH, N, ...) -> (BH, rows, ...) with zero rows appended."""
    out = np.zeros((x.shape[0], rows) + x.shape[2:], F32)
    out[:, :x.shape[1]] = x
    return out


def _p_ds(Qi, dOi, LSEi, Di, Kj, Vj, masked, pad, scale):
    """fa2_backward_p_ds on whole tiles: P_ij and dS_ij of shape (..., Br, Bc).

    Qi, dOi: (BH, X, Br, d); LSEi, Di: (BH, X, Br); Kj, Vj: (BH, Y, Bc, d) with X and Y
    broadcastable; masked, pad: (X or Y, Br, Bc), True where the mask hides the
    score, and where the row or column is padding. Padding gets P = dS = +0 outright, so
    that it adds exactly +0 to the sums whatever the real inputs hold."""
    S = nx.scores(Qi, Kj, scale, masked[None])
    no_key = (LSEi == NEG_INF)[..., None]
    # The kernel selects P = 0 for LSE = -inf; the 0 subtracted here instead keeps
    # -inf - (-inf) out of the arithmetic and is never selected.
    lse = np.where(no_key, F32(0), LSEi[..., None])
    P = np.where(no_key, F32(0), nx.exp(S - lse))
    dS = P * (nx.dot_rows(dOi, Vj) - Di[..., None])
    return np.where(pad[None], F32(0), P), np.where(pad[None], F32(0), dS)


def _preprocess(O, dO, io):
    """D[r] = pyfa_dot(dO[r], O[r]), x in order, stored canonical. O, dO: (BH, Nq, d)."""
    BH, Nq, d = O.shape
    D = nx.canonical_nan(nx.dot(dO, O))
    io.read("O", BH * Nq * d * 4)
    io.read("dO", BH * Nq * d * 4)
    io.write("D", BH * Nq * 4)
    return D


def _dkdv(Q, K, V, dO, LSE, D, Br, Bc, scale, mask, io):
    """The dK/dV kernel: blocks (j, K/V head) (vectorized) walk, for each query head g of
    their group in increasing order, the Q row blocks i of their band mask.q_tiles(j) in
    increasing order. Q, dO: (BHkv, G, Nq, d); LSE, D: (BHkv, G, Nq); K, V: (BHkv, Nk, d)."""
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
    for g in range(G):
        Qp, dOp = _pad_rows(Q[:, g], Tr * Br), _pad_rows(dO[:, g], Tr * Br)
        LSEp = np.full((BHkv, Tr * Br), NEG_INF, F32)
        LSEp[:, :Nq] = LSE[:, g]
        Dp = _pad_rows(D[:, g], Tr * Br)
        for i in range(Tr):
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

            rows = row0 + np.arange(Br)
            c = cols[active][:, None, :]
            pad = (c >= Nk) | (rows[None, :, None] >= Nq)
            masked = mask.masked(rows[None, :, None], c)
            P, dS = _p_ds(Qi, dOi, LSEi, Di, Kj[:, active], Vj[:, active], masked, pad, scale)

            # dV_j += P^T dO_i, dK_j += dS^T Q_i, each summed r = 0 .. br-1 in order
            # (padded rows add +0).
            dv = nx.dot_rows(np.swapaxes(P, -1, -2), np.swapaxes(dOi, -1, -2))
            dk = nx.dot_rows(np.swapaxes(dS, -1, -2), np.swapaxes(Qi, -1, -2))
            dVj[:, active] = dVj[:, active] + dv
            dKj[:, active] = dKj[:, active] + dk

    dK = nx.canonical_nan((dKj * scale).reshape(BHkv, Tc * Bc, d)[:, :Nk])
    dV = nx.canonical_nan(dVj.reshape(BHkv, Tc * Bc, d)[:, :Nk])
    io.write("dK", BHkv * Nk * d * 4)
    io.write("dV", BHkv * Nk * d * 4)
    return dK, dV


def _dq(Q, K, V, dO, LSE, D, Br, Bc, scale, mask, io):
    """The dQ kernel: blocks (i, query head) (vectorized) walk the K/V column blocks j of
    their band mask.kv_tiles(i) in increasing order. Q, dO: (BH, Nq, d); K, V: (BH, Nk, d),
    the K/V head of each query head."""
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

    rows = np.arange(Tr)[:, None] * Br + np.arange(Br)[None, :]  # (Tr, Br) query index
    for j in range(Tc):
        col0 = j * Bc
        bc = min(Bc, Nk - col0)
        # The row blocks whose band holds j are the band q_tiles(j) (pyfa/sim/mask.py).
        a, z = mask.q_tiles(col0, bc, Br, Nq)
        if a == z:
            continue
        Kj, Vj = Kp[:, None, col0:col0 + Bc], Vp[:, None, col0:col0 + Bc]
        io.read("K", BH * (z - a) * bc * d * 4)
        io.read("V", BH * (z - a) * bc * d * 4)

        r, c = rows[a:z, :, None], (col0 + np.arange(Bc))[None, None, :]
        pad = (c >= Nk) | (r >= Nq)
        masked = mask.masked(r, c)
        _, dS = _p_ds(Qi[:, a:z], dOi[:, a:z], LSEi[:, a:z], Di[:, a:z], Kj, Vj, masked, pad, scale)

        # dQ_i += dS_ij K_j, summed c = 0 .. bc-1 in order (padded columns add +0).
        dq = nx.dot_rows(dS, np.swapaxes(Kj, -1, -2))
        dQi[:, a:z] = dQi[:, a:z] + dq

    dQ = nx.canonical_nan((dQi * scale).reshape(BH, Tr * Br, d)[:, :Nq])
    io.write("dQ", BH * Nq * d * 4)
    return dQ


@simulated("fa2", "backward", Fa2BackwardResult)
@nx.ieee_arithmetic
def fa2_backward(q, k, v, o, lse, do, *, causal=False, window=None, causal_align="bottom_right",
                 scale=None, block_r=None, block_c=None, layout="bhnd"):
    """dQ, dK, dV of O = softmax(scale * Q K^T [masked]) V from the forward's O and LSE
    (pyfa.sim.fa2_forward) and dO; .io counts every HBM byte of the three kernels. dK and
    dV have k's Hkv heads, each summed over its group's query heads in increasing order."""
    q4, k4, v4, rank, Hkv = check_qkv(q, k, v, layout)
    o4 = check_like("o", o, q4, layout)
    do4 = check_like("do", do, q4, layout)
    lse3 = check_rows("lse", lse, q4)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    G = H // Hkv
    scale = resolve_scale(scale, d)
    mask = Mask.resolve(causal, window, causal_align, Nq, Nk)
    BH, BHkv = B * H, B * Hkv
    Q, dO, LSE = q4.reshape(BH, Nq, d), do4.reshape(BH, Nq, d), lse3.reshape(BH, Nq)
    O = o4.reshape(BH, Nq, d)
    K, V = k4.reshape(BHkv, Nk, d), v4.reshape(BHkv, Nk, d)
    launch_tiles("fa2_backward_preprocess", d, block_r, block_c)  # refused first, as in the library
    Br_kv, Bc_kv = launch_tiles("fa2_backward_dkdv", d, block_r, block_c)
    Br_q, Bc_q = launch_tiles("fa2_backward_dq", d, block_r, block_c)
    io = IORecord(label=f"FA2 backward (simulated), dK/dV Br={Br_kv}, Bc={Bc_kv}; "
                        f"dQ Br={Br_q}, Bc={Bc_q}")

    D = _preprocess(O, dO, io)
    # Query head h = hk * G + g: (B*H, ...) is (B*Hkv, G, ...) without a copy.
    group = lambda x: x.reshape((BHkv, G) + x.shape[1:])
    dK, dV = _dkdv(group(Q), K, V, group(dO), group(LSE), group(D), Br_kv, Bc_kv, scale, mask, io)
    K_h = kv_heads(k4, H).reshape(BH, Nk, d)
    V_h = kv_heads(v4, H).reshape(BH, Nk, d)
    dQ = _dq(Q, K_h, V_h, dO, LSE, D, Br_q, Bc_q, scale, mask, io)
    return Fa2BackwardResult(restore_rank(dQ.reshape(B, H, Nq, d), rank, layout),
                             restore_rank(dK.reshape(B, Hkv, Nk, d), rank, layout),
                             restore_rank(dV.reshape(B, Hkv, Nk, d), rank, layout), io)
