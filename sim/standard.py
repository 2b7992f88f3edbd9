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

from .inputs import check_causal, check_count_args, check_like, check_qkv, resolve_scale, restore_rank
from .io import IORecord
from .tiling import causal_masked

F32 = np.float32
NEG_INF = np.float32(-np.inf)

PASS_NAMES = ("scale", "mask", "dropout")


@dataclass(frozen=True)
class Step:
    """One kernel of the unfused pipeline: tensors read and written, in elements."""
    name: str
    reads: tuple   # ((tensor, elements), ...)
    writes: tuple


def forward_steps(Nq, Nk, d, *, scale_pass=False, mask_pass=False, dropout_pass=False):
    """The forward pipeline of one (batch, head), in launch order (Algorithm 0):

    1. S = Q K^T              read Q, K; write S (Nq x Nk)
    2. [scale pass]           read S, write S
    3. [mask pass]            read S, write S
    4. P = softmax(S)         read S, write P
    5. [dropout pass]         read P, write P_drop
    6. O = P V (or P_drop V)  read P (P_drop), V; write O
    """
    NN = Nq * Nk
    steps = [Step("S = Q K^T", (("Q", Nq * d), ("K", Nk * d)), (("S", NN),))]
    if scale_pass:
        steps.append(Step("scale: S = S * scale", (("S", NN),), (("S", NN),)))
    if mask_pass:
        steps.append(Step("mask: S = where(mask, -inf, S)", (("S", NN),), (("S", NN),)))
    steps.append(Step("P = softmax(S)", (("S", NN),), (("P", NN),)))
    pv = "P"
    if dropout_pass:
        steps.append(Step("dropout: P_drop = dropout(P)", (("P", NN),), (("P_drop", NN),)))
        pv = "P_drop"
    steps.append(Step(f"O = {pv} V", ((pv, NN), ("V", Nk * d)), (("O", Nq * d),)))
    return steps


def backward_steps(Nq, Nk, d, *, scale_pass=False, mask_pass=False, dropout_pass=False):
    """The backward pipeline of one (batch, head), in launch order (Algorithm 3, with the
    forward's optional passes undone in reverse order):

    1. dV = P^T dO (P_drop^T dO)         read P (P_drop), dO; write dV
    2. dP = dO V^T                       read dO, V; write dP (Nq x Nk)
    3. [dropout pass]                    read dP, write dP
    4. dS = P * (dP - rowsum(dP * P))    read P, dP; write dS (softmax's backward)
    5. [mask pass]                       read dS, write dS
    6. [scale pass]                      read dS, write dS
    7. dQ = dS K                         read dS, K; write dQ
    8. dK = dS^T Q                       read dS, Q; write dK
    Without the scale pass the scale is folded into the matmuls of steps 7 and 8. O is
    never read: softmax's backward works from the saved P and dP.
    """
    NN = Nq * Nk
    saved = "P_drop" if dropout_pass else "P"
    steps = [Step(f"dV = {saved}^T dO", ((saved, NN), ("dO", Nq * d)), (("dV", Nk * d),)),
             Step("dP = dO V^T", (("dO", Nq * d), ("V", Nk * d)), (("dP", NN),))]
    if dropout_pass:
        steps.append(Step("dropout: dP = dropout'(dP)", (("dP", NN),), (("dP", NN),)))
    steps.append(Step("dS = softmax'(P, dP)", (("P", NN), ("dP", NN)), (("dS", NN),)))
    if mask_pass:
        steps.append(Step("mask: dS = where(mask, 0, dS)", (("dS", NN),), (("dS", NN),)))
    if scale_pass:
        steps.append(Step("scale: dS = dS * scale", (("dS", NN),), (("dS", NN),)))
    steps.append(Step("dQ = dS K", (("dS", NN), ("K", Nk * d)), (("dQ", Nq * d),)))
    steps.append(Step("dK = dS^T Q", (("dS", NN), ("Q", Nq * d)), (("dK", Nk * d),)))
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


# ---- count_io walkers (sim/count.py's signature). Br and Bc are ignored: there are no
# tiles. `causal` is ignored too: an unfused framework still materializes and moves the
# full Nq x Nk matrices, masked entries included; only a fused kernel can skip them.

def standard_forward_io(Nq, Nk, d, Br, Bc, causal, e, *, scale_pass=False, mask_pass=False,
                        dropout_pass=False):
    return steps_record(forward_steps(Nq, Nk, d, scale_pass=scale_pass, mask_pass=mask_pass,
                                      dropout_pass=dropout_pass), e)


def standard_backward_io(Nq, Nk, d, Br, Bc, causal, e, *, scale_pass=False, mask_pass=False,
                         dropout_pass=False):
    return steps_record(backward_steps(Nq, Nk, d, scale_pass=scale_pass, mask_pass=mask_pass,
                                       dropout_pass=dropout_pass), e)


def count_standard_io(*, passes="forward", batch, heads, seqlen_q, seqlen_k, head_dim,
                      causal=False, dtype_bytes=4, scale_pass=False, mask_pass=False,
                      dropout_pass=False):
    """count_io("standard", ...) with the optional elementwise passes. With no pass it
    equals count_io("standard", ...)."""
    check_count_args(passes, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     head_dim=head_dim, dtype_bytes=dtype_bytes)
    causal = check_causal(causal)
    opts = dict(scale_pass=scale_pass, mask_pass=mask_pass, dropout_pass=dropout_pass)
    record = IORecord()
    if passes in ("forward", "both"):
        record = record + standard_forward_io(seqlen_q, seqlen_k, head_dim, None, None, causal,
                                              dtype_bytes, **opts)
    if passes in ("backward", "both"):
        record = record + standard_backward_io(seqlen_q, seqlen_k, head_dim, None, None, causal,
                                               dtype_bytes, **opts)
    out = record.scaled(batch * heads)
    out.label = f"standard {passes}"
    return out


# ---- the simulator: plain NumPy float32, IO counted at 4 bytes.

@dataclass
class StandardForwardResult:
    o: np.ndarray              # like q
    p: np.ndarray              # the saved probabilities, q's shape with d replaced by Nk
    lse: np.ndarray            # q's shape without d; for comparison only (never written)
    io: IORecord
    steps: Optional[list] = None


@dataclass
class StandardBackwardResult:
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    io: IORecord
    steps: Optional[list] = None


def _hidden(causal, Nq, Nk):
    if not causal:
        return np.zeros((Nq, Nk), bool)
    return causal_masked(np.arange(Nq)[:, None], np.arange(Nk)[None, :], Nq, Nk)


def standard_forward(q, k, v, *, causal=False, scale=None, mask_pass=False, scale_pass=False,
                     dropout_pass=False):
    """Unfused standard attention: O = softmax(scale * Q K^T [masked]) V in float32.

    A model of a framework that runs attention as separate kernels (see forward_steps for
    the step list and what each optional pass means); `.io` counts each step's HBM reads
    and writes at 4 bytes per element. The values are computed plainly with NumPy float32
    (its matmul and exp), close to exact attention but not bit-exact with pyfa's kernels or
    any framework. Causal masking follows docs/numerics.md (bottom-right aligned); a row
    that sees no key gets O = 0, P = 0, LSE = -inf. `.lse` is given for comparison with the
    FlashAttention kernels only: the unfused pipeline saves P, not LSE, and its bytes are
    not counted.
    """
    q4, k4, v4, rank, _ = check_qkv(q, k, v)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    causal = check_causal(causal)

    s = np.matmul(q4, k4.swapaxes(-1, -2)) * scale
    s = np.where(_hidden(bool(causal), Nq, Nk), NEG_INF, s).astype(F32)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(m == NEG_INF, F32(0), m)
    ex = np.exp(s - m_safe)  # exp(-inf) = 0 for hidden keys
    l = ex.sum(axis=-1, keepdims=True, dtype=F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, ex / l, F32(0)).astype(F32)
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), NEG_INF).astype(F32)
    o = np.matmul(p, v4).astype(F32)

    steps = forward_steps(Nq, Nk, d, scale_pass=scale_pass, mask_pass=mask_pass,
                          dropout_pass=dropout_pass)
    io = steps_record(steps, 4, label="standard forward (simulated, unfused)").scaled(B * H)
    p_shape = q.shape[:-1] + (Nk,)
    return StandardForwardResult(restore_rank(o, rank), p.reshape(p_shape),
                                 lse.reshape(q.shape[:-1]), io, steps)


def standard_backward(q, k, v, o, p, do, *, causal=False, scale=None, mask_pass=False,
                      scale_pass=False, dropout_pass=False):
    """The backward of standard_forward, unfused (see backward_steps for the step list):

        dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dP * P));
        dQ = scale * dS K;  dK = scale * dS^T Q

    `p` is the forward's saved probabilities (StandardForwardResult.p); `o` is accepted and
    checked for a signature like the FlashAttention backwards', but never read (nor
    counted): softmax's backward works from P and dP. `causal` changes no arithmetic here
    (masked entries of P are 0, so their gradients are 0) and is kept for symmetry with
    standard_forward. Plain NumPy float32, not bit-exact with anything.
    """
    q4, k4, v4, rank, _ = check_qkv(q, k, v)
    B, H, Nq, d = q4.shape
    Nk = k4.shape[2]
    scale = resolve_scale(scale, d)
    check_causal(causal)
    check_like("o", o, q4)
    do4 = check_like("do", do, q4)
    p4 = check_like("p", p, np.broadcast_to(F32(0), (B, H, Nq, Nk)))  # shape only

    dv = np.matmul(p4.swapaxes(-1, -2), do4)
    dp = np.matmul(do4, v4.swapaxes(-1, -2))
    rowdot = (dp * p4).sum(axis=-1, keepdims=True, dtype=F32)
    ds = (p4 * (dp - rowdot)) * scale
    dq = np.matmul(ds, k4)
    dk = np.matmul(ds.swapaxes(-1, -2), q4)

    steps = backward_steps(Nq, Nk, d, scale_pass=scale_pass, mask_pass=mask_pass,
                           dropout_pass=dropout_pass)
    io = steps_record(steps, 4, label="standard backward (simulated, unfused)").scaled(B * H)
    f = lambda x: restore_rank(x.astype(F32), rank)
    return StandardBackwardResult(f(dq), f(dk), f(dv), io, steps)
