"""The score pipeline: the twin of src/common/score.h, and the one place in the simulator
where a score is formed, modified and differentiated (docs/numerics.md, "The score
pipeline").

Forward:  s = dot_rows(Q, K) * scale; S = score_mod(s, ...); S = -inf where hidden.
Backward: dS = P * (dP - D); dS = score_mod_grad(dS, s, S, ...), reading the scaled score s
or the modified S, whichever the modification's gradient is written in (score.h ScoreAt).
A hidden score takes no part in any product: the simulators pass `keep` (the visible
scores) to numerics.dot_rows, which leaves such a step out rather than multiplying it by 0.

`mods` is the call's pyfa.checks.ScoreMods, resolved once per call by the simulated
kernel functions from their keyword arguments; the index arguments b, h (batch and query
head), i, j (query row and key) are integer arrays that broadcast against the scores, and
a modification reads what it needs of them and of mods.
"""

import numpy as np

from . import numerics as nx

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
    return s


def score_mod_grad(mods, dS, s, S, b, h, i, j):
    """dS of the modified scores S -> dS of the scaled scores s they were made from
    (score.h score_mod_grad; s and S are its ScoreAt)."""
    if mods.softcap is not None:  # dS (1 - t^2), t = S_c / c, S_c softcap's output
        c = np.float32(mods.softcap)
        S_c = c * nx.tanh(s / c) if mods.alibi_slopes is not None else S
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


def score_grad(mods, P, dp, D, s, S, b, h, i, j):
    """dS with respect to the scaled scores s, S = score_mod(s) (score.h score_grad); D
    broadcasts against P."""
    return score_mod_grad(mods, P * (dp - D), s, S, b, h, i, j)
