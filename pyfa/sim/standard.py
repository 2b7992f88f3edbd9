"""Standard attention, unfused: the baseline FlashAttention is measured against.

This models what a framework without a fused attention kernel does (the FlashAttention
paper's Algorithms 0 and 3): every step is its own kernel, and every intermediate N x N
matrix (scores S, probabilities P, their gradients dP and dS) makes a round trip through
HBM. The HBM traffic of that pipeline is what this module counts; the numbers it computes
are plain NumPy float32 and are a model of such a framework, not bit-exact with any
kernel or framework (docs/numerics.md does not apply here).

The pipeline is written once, as a list of steps (`forward_steps`, `backward_steps`),
each naming the tensors it reads and writes. The simulator functions (`standard_forward`,
`standard_backward`), the count_io walkers and the report all take their bytes from it.

Optional elementwise passes model the unfused pipeline of a GPT-style model (e.g.
HuggingFace GPT-2's eager attention: matmul, divide by sqrt(d), causal `where`, softmax,
dropout, matmul). Each pass reads and writes one N x N matrix, in the forward and again
in the backward:
  - scale_pass:   S = S * scale as its own kernel (otherwise folded into the QK^T matmul,
                  as a GEMM's alpha does, and into the dQ/dK matmuls in the backward);
  - mask_pass:    S = where(mask, -inf, S) as its own kernel (otherwise the mask is
                  applied inside the softmax, as a fused masked softmax does);
  - dropout_pass: P_drop = dropout(P) as its own kernel, saved for the backward beside
                  P. The model's dropout rate is 0: the pass moves the bytes but leaves
                  the values alone (pyfa's kernels have no dropout), and the random mask
                  a real dropout also stores is not counted.
Counts are exact for the steps listed; what a real framework adds (workspace, the bool
mask tensor, reductions that re-read a row) is not modelled.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..checks import (check_count_args, check_like, check_qkv, resolve_scale, restore_rank,
                     restore_rows)
from .io import IORecord
from .mask import Mask
from .tiling import kv_heads

F32 = np.float32
NEG_INF = np.float32(-np.inf)

PASS_NAMES = ("scale", "mask", "dropout")


@dataclass(frozen=True)
class Step:
    """One kernel of the unfused pipeline: tensors read and written, in elements."""
    name: str
    reads: tuple   # ((tensor, elements), ...)
    writes: tuple


def forward_steps(Nq, Nk, d, *, G=1, scale_pass=False, mask_pass=False, dropout_pass=False):
    """The forward pipeline of one (batch, K/V head), i.e. of the G = H / Hkv query heads
    that share it, in launch order (Algorithm 0):

    0. [G > 1] K_rep, V_rep = K, V repeated  read K, V; write G copies of each
    1. S = Q K^T              read Q, K; write S (Nq x Nk)
    2. [scale pass]           read S, write S
    3. [mask pass]            read S, write S
    4. P = softmax(S)         read S, write P
    5. [dropout pass]         read P, write P_drop
    6. O = P V (or P_drop V)  read P (P_drop), V; write O
    Step 0 is grouped-query attention as an unfused framework runs it (HuggingFace's
    repeat_kv): K and V copied out to one head per query head, and the matmuls then read
    the copies.
    """
    NN = G * Nq * Nk
    k, v = ("K_rep", "V_rep") if G > 1 else ("K", "V")
    steps = []
    if G > 1:
        steps.append(Step("K_rep = repeat(K)", (("K", Nk * d),), (("K_rep", G * Nk * d),)))
        steps.append(Step("V_rep = repeat(V)", (("V", Nk * d),), (("V_rep", G * Nk * d),)))
    steps.append(Step(f"S = Q {k}^T", (("Q", G * Nq * d), (k, G * Nk * d)), (("S", NN),)))
    if scale_pass:
        steps.append(Step("scale: S = S * scale", (("S", NN),), (("S", NN),)))
    if mask_pass:
        steps.append(Step("mask: S = where(mask, -inf, S)", (("S", NN),), (("S", NN),)))
    steps.append(Step("P = softmax(S)", (("S", NN),), (("P", NN),)))
    pv = "P"
    if dropout_pass:
        steps.append(Step("dropout: P_drop = dropout(P)", (("P", NN),), (("P_drop", NN),)))
        pv = "P_drop"
    steps.append(Step(f"O = {pv} {v}", ((pv, NN), (v, G * Nk * d)), (("O", G * Nq * d),)))
    return steps


def backward_steps(Nq, Nk, d, *, G=1, scale_pass=False, mask_pass=False, dropout_pass=False):
    """The backward pipeline of one (batch, K/V head), in launch order (Algorithm 3, with
    the forward's optional passes undone in reverse order):

    1. dV = P^T dO (P_drop^T dO)         read P (P_drop), dO; write dV
    2. dP = dO V^T                       read dO, V; write dP (Nq x Nk)
    3. [dropout pass]                    read dP, write dP
    4. dS = P * (dP - rowsum(dP * P))    read P, dP; write dS (softmax's backward)
    5. [mask pass]                       read dS, write dS
    6. [scale pass]                      read dS, write dS
    7. dQ = dS K                         read dS, K; write dQ
    8. dK = dS^T Q                       read dS, Q; write dK
    9. [G > 1] dK, dV = the sums of dK_rep, dV_rep over the group
    Without the scale pass the scale is folded into the matmuls of steps 7 and 8. O is
    never read: softmax's backward works from the saved P and dP. With G > 1, steps 1-8
    work on the repeated K_rep, V_rep and produce dK_rep, dV_rep, one per query head.
    """
    NN = G * Nq * Nk
    k, v, dk, dv = ("K_rep", "V_rep", "dK_rep", "dV_rep") if G > 1 else ("K", "V", "dK", "dV")
    saved = "P_drop" if dropout_pass else "P"
    steps = [Step(f"{dv} = {saved}^T dO", ((saved, NN), ("dO", G * Nq * d)), ((dv, G * Nk * d),)),
             Step(f"dP = dO {v}^T", (("dO", G * Nq * d), (v, G * Nk * d)), (("dP", NN),))]
    if dropout_pass:
        steps.append(Step("dropout: dP = dropout'(dP)", (("dP", NN),), (("dP", NN),)))
    steps.append(Step("dS = softmax'(P, dP)", (("P", NN), ("dP", NN)), (("dS", NN),)))
    if mask_pass:
        steps.append(Step("mask: dS = where(mask, 0, dS)", (("dS", NN),), (("dS", NN),)))
    if scale_pass:
        steps.append(Step("scale: dS = dS * scale", (("dS", NN),), (("dS", NN),)))
    steps.append(Step(f"dQ = dS {k}", (("dS", NN), (k, G * Nk * d)), (("dQ", G * Nq * d),)))
    steps.append(Step(f"{dk} = dS^T Q", (("dS", NN), ("Q", G * Nq * d)), ((dk, G * Nk * d),)))
    if G > 1:
        steps.append(Step("dK = sum over the group of dK_rep", (("dK_rep", G * Nk * d),),
                          (("dK", Nk * d),)))
        steps.append(Step("dV = sum over the group of dV_rep", (("dV_rep", G * Nk * d),),
                          (("dV", Nk * d),)))
    return steps


def steps_record(steps, e, label=""):
    """The IO record of a step list, every tensor at e bytes per element."""
    io = IORecord(label=label)
    for step in steps:
        for tensor, n in step.reads:
            io.read(tensor, n * e)
        for tensor, n in step.writes:
            io.write(tensor, n * e)
    return io


# ---- count_io walkers (pyfa/sim/count.py's, on a count.Walk). The tiles are ignored: there
# are none. The mask is ignored too: an unfused framework still materializes and moves
# the full Nq x Nk matrices, masked entries included; only a fused kernel can skip them.

def standard_forward_io(w, *, scale_pass=False, mask_pass=False, dropout_pass=False):
    return steps_record(forward_steps(w.Nq, w.Nk, w.d, G=w.G, scale_pass=scale_pass,
                                      mask_pass=mask_pass, dropout_pass=dropout_pass), w.e)


def standard_backward_io(w, *, scale_pass=False, mask_pass=False, dropout_pass=False):
    return steps_record(backward_steps(w.Nq, w.Nk, w.d, G=w.G, scale_pass=scale_pass,
                                       mask_pass=mask_pass, dropout_pass=dropout_pass), w.e)


def count_standard_io(*, passes="forward", batch, heads, seqlen_q, seqlen_k, head_dim,
                      heads_kv=None, causal=False, window=None, causal_align="bottom_right",
                      dtype_bytes=4, scale_pass=False, mask_pass=False, dropout_pass=False):
    """count_io("standard", ...) with the optional elementwise passes. With no pass it
    equals count_io("standard", ...)."""
    from .count import Walk, check_heads_kv  # count imports this module
    check_count_args(passes, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     head_dim=head_dim, dtype_bytes=dtype_bytes)
    Hkv = check_heads_kv(heads_kv, heads)
    mask = Mask.resolve(causal, window, causal_align, seqlen_q, seqlen_k)
    w = Walk(seqlen_q, seqlen_k, head_dim, heads // Hkv, None, None, mask, dtype_bytes)
    opts = dict(scale_pass=scale_pass, mask_pass=mask_pass, dropout_pass=dropout_pass)
    record = IORecord()
    if passes in ("forward", "both"):
        record = record + standard_forward_io(w, **opts)
    if passes in ("backward", "both"):
        record = record + standard_backward_io(w, **opts)
    out = record.scaled(batch * Hkv)
    out.label = f"standard {passes}"
    return out


# ---- the simulator: plain NumPy float32, IO counted at 4 bytes.

@dataclass
class StandardForwardResult:
    o: np.ndarray              # like q, in the layout asked for
    p: np.ndarray              # the saved probabilities, (B, H, Nq, Nk) in either layout
    lse: np.ndarray            # (B, H, Nq); for comparison only (never written)
    io: IORecord
    steps: Optional[list] = None


@dataclass
class StandardBackwardResult:
    dq: np.ndarray             # like q
    dk: np.ndarray             # like k (Hkv heads)
    dv: np.ndarray             # like v
    io: IORecord
    steps: Optional[list] = None


def standard_forward(q, k, v, *, causal=False, window=None, causal_align="bottom_right",
                     scale=None, layout="bhnd", mask_pass=False, scale_pass=False,
                     dropout_pass=False):
    """Unfused standard attention: O = softmax(scale * Q K^T [masked]) V in float32.

    A model of a framework that runs attention as separate kernels (see forward_steps for
    the step list and what each optional pass means); `.io` counts each step's HBM reads
    and writes at 4 bytes per element. The values are computed plainly with NumPy float32
    (its matmul and exp), close to exact attention but not bit-exact with pyfa's kernels or
    any framework. The mask is pyfa/sim/mask.py's; a row that sees no key gets O = 0, P = 0,
    LSE = -inf. `.lse` is given for comparison with the FlashAttention kernels only: the
    unfused pipeline saves P, not LSE, and its bytes are not counted. `.p` is
    (B, H, Nq, Nk) (without q's missing leading axes) in either layout.
    """
    q4, k4, v4, rank, Hkv = check_qkv(q, k, v, layout)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    mask = Mask.resolve(causal, window, causal_align, Nq, Nk)

    s = np.matmul(q4, kv_heads(k4, H).swapaxes(-1, -2)) * scale
    hidden = mask.masked(np.arange(Nq)[:, None], np.arange(Nk)[None, :])
    s = np.where(hidden, NEG_INF, s).astype(F32)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(m == NEG_INF, F32(0), m)
    ex = np.exp(s - m_safe)  # exp(-inf) = 0 for hidden keys
    l = ex.sum(axis=-1, keepdims=True, dtype=F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, ex / l, F32(0)).astype(F32)
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), NEG_INF).astype(F32)
    o = np.matmul(p, kv_heads(v4, H)).astype(F32)

    steps = forward_steps(Nq, Nk, d, G=H // Hkv, scale_pass=scale_pass, mask_pass=mask_pass,
                          dropout_pass=dropout_pass)
    io = steps_record(steps, 4, label="standard forward (simulated, unfused)").scaled(B * Hkv)
    return StandardForwardResult(restore_rank(o, rank, layout), restore_rank(p, rank),
                                 restore_rows(lse, rank), io, steps)


def standard_backward(q, k, v, o, p, do, *, causal=False, window=None,
                      causal_align="bottom_right", scale=None, layout="bhnd", mask_pass=False,
                      scale_pass=False, dropout_pass=False):
    """The backward of standard_forward, unfused (see backward_steps for the step list):

        dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dP * P));
        dQ = scale * dS K;  dK = scale * dS^T Q

    (dK and dV of a K/V head summed over its query heads). `p` is the forward's saved
    probabilities (StandardForwardResult.p); `o` is accepted and checked for a signature
    like the FlashAttention backwards', but never read (nor counted): softmax's backward
    works from P and dP. The mask changes no arithmetic here (masked entries of P are 0,
    so their gradients are 0); its arguments are checked and kept for symmetry with
    standard_forward. Plain NumPy float32, not bit-exact with anything.
    """
    q4, k4, v4, rank, Hkv = check_qkv(q, k, v, layout)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    G = H // Hkv
    scale = resolve_scale(scale, d)
    Mask.resolve(causal, window, causal_align, Nq, Nk)
    check_like("o", o, q4, layout)
    do4 = check_like("do", do, q4, layout)
    p4 = check_like("p", p, np.broadcast_to(F32(0), (B, H, Nq, Nk)))  # shape only

    dv = np.matmul(p4.swapaxes(-1, -2), do4)
    dp = np.matmul(do4, kv_heads(v4, H).swapaxes(-1, -2))
    rowdot = (dp * p4).sum(axis=-1, keepdims=True, dtype=F32)
    ds = (p4 * (dp - rowdot)) * scale
    dq = np.matmul(ds, kv_heads(k4, H))
    dk = np.matmul(ds.swapaxes(-1, -2), q4)
    group_sum = lambda x: x.reshape(B, Hkv, G, Nk, d).sum(axis=2, dtype=F32)

    steps = backward_steps(Nq, Nk, d, G=G, scale_pass=scale_pass, mask_pass=mask_pass,
                           dropout_pass=dropout_pass)
    io = steps_record(steps, 4, label="standard backward (simulated, unfused)").scaled(B * Hkv)
    f = lambda x: restore_rank(x.astype(F32), rank, layout)
    return StandardBackwardResult(f(dq), f(group_sum(dk)), f(group_sum(dv)), io, steps)
