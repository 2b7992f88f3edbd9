"""FlashAttention-2 backward, simulated: the twin of cuda/kernels/fa2_backward.cuh.

Three kernels, as on the device: the preprocess (D = rowsum(dO o O)), the dK/dV kernel
(one block per K/V column block j, walking the Q row blocks i) and the dQ kernel (one
block per Q row block i, walking the K/V column blocks j). Each keeps its kernel's loops
and performs the same fp32 operations in the same order (docs/numerics.md, "FA2
backward"); only independent work is vectorized: all heads and all blocks of the grid at
once, and all elements of a tile. Rows past Nq and columns past Nk are padded (zero rows
of Q, dO, K, V, and P = dS = +0 set outright), so they add exactly +0 to the sums, which
leaves them unchanged; the padding is cut away at the end.

Each kernel takes its own default tiles unless block_r / block_c are given, as the
library does (sim.tiles.default_tiles).
"""

from dataclasses import dataclass

import numpy as np

from . import numerics as nx
from .inputs import check_causal, check_like, check_qkv, check_rows, resolve_scale, restore_rank
from .io import IORecord
from .tiles import launch_tiles
from .tiling import causal_masked, ceil_div, kv_tile_end, q_tile_begin

F32 = np.float32
NEG_INF = np.float32(-np.inf)


@dataclass
class Fa2BackwardResult:
    dq: np.ndarray  # like q
    dk: np.ndarray  # like k
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
    broadcastable; masked, pad: (X or Y, Br, Bc), True where the causal mask hides the
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


def _dkdv(Q, K, V, dO, LSE, D, Br, Bc, scale, causal, io):
    """The dK/dV kernel: blocks j (vectorized) walk the Q row blocks i in order."""
    BH, Nq, d = Q.shape
    Nk = K.shape[1]
    Tr, Tc = ceil_div(Nq, Br), ceil_div(Nk, Bc)
    Kj = _pad_rows(K, Tc * Bc).reshape(BH, Tc, Bc, d)
    Vj = _pad_rows(V, Tc * Bc).reshape(BH, Tc, Bc, d)
    io.read("K", BH * Nk * d * 4)
    io.read("V", BH * Nk * d * 4)
    Qp, dOp = _pad_rows(Q, Tr * Br), _pad_rows(dO, Tr * Br)
    LSEp = np.full((BH, Tr * Br), NEG_INF, F32)
    LSEp[:, :Nq] = LSE
    Dp = _pad_rows(D, Tr * Br)
    dKj = np.zeros((BH, Tc, Bc, d), F32)
    dVj = np.zeros((BH, Tc, Bc, d), F32)

    cols = np.arange(Tc)[:, None] * Bc + np.arange(Bc)[None, :]  # (Tc, Bc) key index
    begin = np.array([q_tile_begin(causal, j * Bc, Nq, Nk, Br) for j in range(Tc)])
    for i in range(Tr):
        row0 = i * Br
        br = min(Br, Nq - row0)
        active = np.nonzero(begin <= i)[0]  # column blocks whose walk includes Q tile i
        if active.size == 0:
            continue
        sl = slice(row0, row0 + Br)
        Qi, dOi = Qp[:, None, sl], dOp[:, None, sl]
        LSEi, Di = LSEp[:, None, sl], Dp[:, None, sl]
        io.read("Q", BH * active.size * br * d * 4)
        io.read("dO", BH * active.size * br * d * 4)
        io.read("LSE", BH * active.size * br * 4)
        io.read("D", BH * active.size * br * 4)

        rows = row0 + np.arange(Br)
        c = cols[active][:, None, :]
        pad = (c >= Nk) | (rows[None, :, None] >= Nq)
        masked = causal_masked(rows[None, :, None], c, Nq, Nk) & causal
        P, dS = _p_ds(Qi, dOi, LSEi, Di, Kj[:, active], Vj[:, active], masked, pad, scale)

        # dV_j += P^T dO_i, dK_j += dS^T Q_i, each summed r = 0 .. br-1 in order (padded
        # rows add +0).
        dv = nx.dot_rows(np.swapaxes(P, -1, -2), np.swapaxes(dOi, -1, -2))
        dk = nx.dot_rows(np.swapaxes(dS, -1, -2), np.swapaxes(Qi, -1, -2))
        dVj[:, active] = dVj[:, active] + dv
        dKj[:, active] = dKj[:, active] + dk

    dK = nx.canonical_nan((dKj * scale).reshape(BH, Tc * Bc, d)[:, :Nk])
    dV = nx.canonical_nan(dVj.reshape(BH, Tc * Bc, d)[:, :Nk])
    io.write("dK", BH * Nk * d * 4)
    io.write("dV", BH * Nk * d * 4)
    return dK, dV


def _dq(Q, K, V, dO, LSE, D, Br, Bc, scale, causal, io):
    """The dQ kernel: blocks i (vectorized) walk the K/V column blocks j in order."""
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
    br_of = np.minimum(Br, Nq - np.arange(Tr) * Br)
    Tc_visit = np.array([kv_tile_end(causal, i * Br, br_of[i], Nq, Nk, Bc) for i in range(Tr)])
    for j in range(Tc):
        col0 = j * Bc
        bc = min(Bc, Nk - col0)
        active = np.nonzero(j < Tc_visit)[0]  # row blocks whose walk includes K/V tile j
        if active.size == 0:
            continue
        Kj, Vj = Kp[:, None, col0:col0 + Bc], Vp[:, None, col0:col0 + Bc]
        io.read("K", BH * active.size * bc * d * 4)
        io.read("V", BH * active.size * bc * d * 4)

        r, c = rows[active][:, :, None], (col0 + np.arange(Bc))[None, None, :]
        pad = (c >= Nk) | (r >= Nq)
        masked = causal_masked(r, c, Nq, Nk) & causal
        _, dS = _p_ds(Qi[:, active], dOi[:, active], LSEi[:, active], Di[:, active], Kj, Vj,
                      masked, pad, scale)

        # dQ_i += dS_ij K_j, summed c = 0 .. bc-1 in order (padded columns add +0).
        dq = nx.dot_rows(dS, np.swapaxes(Kj, -1, -2))
        dQi[:, active] = dQi[:, active] + dq

    dQ = nx.canonical_nan((dQi * scale).reshape(BH, Tr * Br, d)[:, :Nq])
    io.write("dQ", BH * Nq * d * 4)
    return dQ


@nx.ieee_arithmetic
def fa2_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_r=None, block_c=None):
    """dQ, dK, dV of O = softmax(scale * Q K^T [causal]) V from the forward's O and LSE
    (pyfa.sim.fa2_forward) and dO; .io counts every HBM byte of the three kernels."""
    q4, k4, v4, rank = check_qkv(q, k, v)
    o4 = check_like("o", o, q4)
    do4 = check_like("do", do, q4)
    lse3 = check_rows("lse", lse, q4)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    causal = check_causal(causal)
    BH = B * H
    Q, K, V = q4.reshape(BH, Nq, d), k4.reshape(BH, Nk, d), v4.reshape(BH, Nk, d)
    O, dO, LSE = o4.reshape(BH, Nq, d), do4.reshape(BH, Nq, d), lse3.reshape(BH, Nq)
    launch_tiles("fa2_backward_preprocess", d, block_r, block_c)  # refused first, as in the library
    Br_kv, Bc_kv = launch_tiles("fa2_backward_dkdv", d, block_r, block_c)
    Br_q, Bc_q = launch_tiles("fa2_backward_dq", d, block_r, block_c)
    io = IORecord(label=f"FA2 backward (simulated), dK/dV Br={Br_kv}, Bc={Bc_kv}; "
                        f"dQ Br={Br_q}, Bc={Bc_q}")

    D = _preprocess(O, dO, io)
    dK, dV = _dkdv(Q, K, V, dO, LSE, D, Br_kv, Bc_kv, scale, causal, io)
    dQ = _dq(Q, K, V, dO, LSE, D, Br_q, Bc_q, scale, causal, io)
    return Fa2BackwardResult(restore_rank(dQ.reshape(B, H, Nq, d), rank),
                             restore_rank(dK.reshape(B, H, Nk, d), rank),
                             restore_rank(dV.reshape(B, H, Nk, d), rank), io)
