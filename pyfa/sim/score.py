"""The score pipeline: the twin of src/common/score.h, and the one place in the simulator
where a score is formed, modified and differentiated (docs/numerics.md, "The score
pipeline").

Forward:  s = dot_rows(Q, K) * scale; S = score_mod(s, ...); S = -inf where hidden.
Backward: dS_S = P * (dP - D) (score_grad_S, what dBias sums); dS_s = score_mod_grad(dS_S,
s, S, ...) (what dQ and dK take), reading the scaled score s or the modified S, whichever
the modification's gradient is written in (score.h ScoreAt).
A hidden score takes no part in any product: the simulators pass `keep` (the visible
scores) to numerics.dot_rows, which leaves such a step out rather than multiplying it by 0.

`mods` is the call's pyfa.checks.ScoreMods, resolved once per call by the simulated
kernel functions from their keyword arguments; the index arguments b, h (batch and query
head), i, j (query row and key) are integer arrays that broadcast against the scores, and
a modification reads what it needs of them and of mods.
"""

import contextlib
import contextvars
import functools

import numpy as np

from . import numerics as nx
from .dropout import Dropout

_NEG_INF = np.float32(-np.inf)


def score_mod(mods, s, b, h, i, j):
    """The modification of the scaled scores s (score.h score_mod)."""
    if mods.softcap is not None:  # S = c tanh(s / c)
        c = np.float32(mods.softcap)
        s = c * nx.tanh(s / c)
    if mods.alibi_slopes is not None:  # S - slope * |i + off - j|, the distance in integers
        slope = np.asarray(mods.alibi_slopes)[b, h]
        distance = np.abs(np.asarray(i, np.int64) + mods.off - np.asarray(j, np.int64)).astype(np.float32)
        s = s - slope * distance
    # The additive bias, last (after scaling, softcap and ALiBi): its gradient is dS itself.
    if mods.bias is not None:
        s = s + mods.bias.at(b, h, i, j)
    return s


def score_mod_grad(mods, dS, s, S, b, h, i, j):
    """dS of the modified scores S -> dS of the scaled scores s they were made from
    (score.h score_mod_grad; s and S are its ScoreAt)."""
    if mods.softcap is not None:  # dS (1 - t^2), t = S_c / c, S_c softcap's output
        c = np.float32(mods.softcap)
        S_c = c * nx.tanh(s / c) if mods.alibi_slopes is not None or mods.bias is not None else S
        t = S_c / c
        dS = dS * (np.float32(1) - t * t)
    return dS


def scaled_scores(Q, K, scale):
    """s = (Q K^T) * scale, each inner product pyfa_dot's (score.h scaled_score)."""
    return nx.dot_rows(Q, K) * np.float32(scale)


def finish(mods, s, hidden, b, h, i, j):
    """S from the scaled scores: -inf where hidden, else the modification (score_finish)."""
    return np.where(hidden, _NEG_INF, score_mod(mods, s, b, h, i, j))


def scores(mods, Q, K, scale, hidden, b, h, i, j):
    """S = finish(scaled_scores(Q, K, scale), ...) (score.h attention_score), with Q, K
    shaped as dot_rows takes them and `hidden` broadcasting against the result."""
    return finish(mods, scaled_scores(Q, K, scale), hidden, b, h, i, j)


def score_grad_S(mods, P, dp, D, b, h, i, j):
    """dS with respect to the modified scores S (score.h score_grad_S, softmax_grad): what
    dBias sums; D broadcasts against P."""
    # Dropout: dP = (dO_i V_j^T) o Z / (1 - p), the forward's decisions.
    return P * (dropped(mods, dp, b, h, i, j) - D)


def score_grad(mods, P, dp, D, s, S, b, h, i, j):
    """dS with respect to the scaled scores s, S = score_mod(s) (score.h score_grad): the
    two steps score_grad_S, then score_mod_grad."""
    return score_mod_grad(mods, score_grad_S(mods, P, dp, D, b, h, i, j), s, S, b, h, i, j)


@functools.lru_cache(maxsize=64)
def _dropout(p, seed, offset, origin):
    return Dropout.make(p, seed, offset, origin)


def dropout(mods):
    """The call's resolved dropout (dropout.py Dropout; off when mods.dropout_p is 0)."""
    return _dropout(mods.dropout_p, mods.seed or 0, mods.offset, mods.dropout_origin)


# The library's b of a simulated call's batch element 0: the simulator runs packed
# sequences one at a time (pyfa/sim/varlen.py), each as batch element 0 of a dense call,
# while the library keys sequence b's dropout on b.
_BATCH0 = contextvars.ContextVar("pyfa_sim_batch0", default=0)


@contextlib.contextmanager
def batch_offset(b0):
    """Within it, the score pipeline's batch element b is the library's b0 + b."""
    token = _BATCH0.set(b0)
    try:
        yield
    finally:
        _BATCH0.reset(token)


def dropped(mods, P, b, h, i, j):
    """P o Z / (1 - p) of dropout.h's Dropout::apply: what P V (and the backward's dV and
    dP) take in place of P."""
    return dropout(mods).apply(P, b + _BATCH0.get(), h, i, j)


# ---- dBias (issue 27): the twin of score.h's dbias_clear and dbias_tile.

def dbias_start(mods, BH, Nq_pad, Nk_pad):
    """The (BH, Nq_pad or 1, Nk_pad) dS sums of a backward that writes dBias (+0 where no tile
    visits), or None without a bias."""
    if mods.bias is None:
        return None
    return np.zeros((BH, 1 if mods.bias.sums_rows() else Nq_pad, Nk_pad), np.float32)


def dbias_tiles(mods, dB, dS, keep, bh, rows, cols):
    """Adds visited tiles to dB (dbias_start): dS (dS_S, score_grad_S's) and keep
    (..., T, Br, Bc), T tiles of rows
    rows (T, Br) in increasing order, whose keys are cols (..., T, 1, Bc) or broadcast; bh
    the query head b * H + h of each, broadcasting. Rows of Nq: dS where kept, else +0.
    One row: per tile, the sum over its kept rows r in order, added to the running one."""
    shape = np.broadcast_shapes(dS.shape, np.shape(cols), np.shape(bh))
    dS = np.broadcast_to(dS, shape)
    keep = np.broadcast_to(keep, shape)
    bh = np.broadcast_to(bh, shape)
    cols = np.broadcast_to(cols, shape)
    if not mods.bias.sums_rows():
        r = np.broadcast_to(rows[..., None], shape)
        dB[bh, r, cols] = np.where(keep, nx.canonical_nan(dS), np.float32(0))
        return
    bh0, c0 = bh[..., 0, :], cols[..., 0, :]
    for t in range(shape[-3]):
        acc = dB[bh0[..., t, :], 0, c0[..., t, :]]
        for r in range(shape[-2]):
            acc = np.where(keep[..., t, r, :], acc + dS[..., t, r, :], acc)
        dB[bh0[..., t, :], 0, c0[..., t, :]] = nx.canonical_nan(acc)


def bias_io(mods, io, scores):
    """The bias read for `scores` scores of visited tiles (4 bytes each): the IO model
    counts a visited tile's whole bias, as a tile load moves it."""
    if mods.bias is not None and scores:
        io.read("Bias", scores * 4)


def dbias_io(mods, io, cleared, tiled, rows_full):
    """dBias through HBM: `cleared` keys whose running sum starts at +0 and `tiled` keys
    of visited tiles whose sum is read and written back (one row), or `rows_full` floats
    each written once (rows of Nq)."""
    if mods.bias is None:
        return
    written, read = (cleared + tiled, tiled) if mods.bias.sums_rows() else (rows_full, 0)
    if written:
        io.write("dBias", written * 4)
    if read:
        io.read("dBias", read * 4)


def dbias_result(mods, dB, B, H, Nq, Nk):
    """dBias of the bias's shape from dB: cut to (B, H, Nq or 1, Nk), then, over each of B,
    H (of more than one) that the bias lacks, the fold of score.h dbias_fold_at: from +0,
    part's (b, h) in increasing order, b outer, one fp32 addition each."""
    rows = 1 if mods.bias.sums_rows() else Nq
    return dbias_fold(mods.bias, dB[:, :rows, :Nk].reshape(B, H, rows, Nk))


def dbias_fold(bias, part):
    """dBias of `bias`'s shape from the (B, H, rows, Nk) dS sums `part` (dbias_result)."""
    B, H, rows, Nk = part.shape
    sum_b, sum_h = not bias.full[0], not bias.full[1]
    if not (sum_b or sum_h):
        return part.reshape(bias.shape)
    out = np.zeros((1 if sum_b else B, 1 if sum_h else H, rows, Nk), np.float32)
    for b in range(B):
        for h in range(H):
            t = (0 if sum_b else b, 0 if sum_h else h)
            out[t] = out[t] + part[b, h]
    return nx.canonical_nan(out).reshape(bias.shape)
