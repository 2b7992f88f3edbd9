"""pyfa as a transformers attention backend: attn_implementation="pyfa".

    import pyfa.integrations.transformers as pyfa_hf
    pyfa_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="pyfa")

register() adds "pyfa" to transformers' AttentionInterface (attention_forward below) and
to its AttentionMaskInterface (transformers' own sdpa_mask: a boolean (B, 1, Nq, Nk) mask,
True = visible, or None where SDPA's is_causal would do), so the mask of every batch
always reaches pyfa. A mask FA2 computes by its own means is read as such, batch row by
batch row: the visible keys of row b are a contiguous span [s, e) cut by a band around a
diagonal, as padding (left or right) with a causal, a sliding-window or a full mask makes
them; the mask is read on the host (on CUDA, one synchronisation per layer). A batch
whose rows share one pattern runs as one call; otherwise each row runs alone on its span.
Query rows that see no key (left padding's padded rows) get O = 0. Any other mask (and a
float mask, which SDPA adds to the scores) becomes pyfa's additive bias: 0 where visible,
-inf where hidden, in one call with the bias's gradient path. The model's attention
dropout (in training) and logit softcap (Gemma 2) are pyfa's dropout_p and softcap, and
gpt-oss's learned attention sinks (s_aux) pyfa.torch.attention's sinks.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .. import torch as pyfa_torch
from ..errors import InvalidArgumentError

__all__ = ["register", "attention_forward", "NAME"]

NAME = "pyfa"


def _spans(visible):
    """Per batch row of visible (B, Nq, Nk) bool: (qs, qe, s, e, left, right), the rows
    [qs, qe) that see a key, the keys [s, e) some row sees, and the band such that in that
    box key j' is visible to row i' iff i' - left <= j' <= i' + right (pyfa's window,
    top-left); None when the mask is not of that form. A side at least the box's size
    does not restrict it."""
    B, Nq, Nk = visible.shape
    rows, keys = visible.any(2), visible.any(1)
    batch = torch.arange(B, device=visible.device)
    iq, ik = torch.arange(Nq, device=visible.device), torch.arange(Nk, device=visible.device)
    big = Nq + Nk
    qs = torch.where(rows, iq, big).amin(1)
    qe = torch.where(rows, iq + 1, 0).amax(1)
    s = torch.where(keys, ik, big).amin(1)
    e = torch.where(keys, ik + 1, 0).amax(1)
    # The band's right side from the last key the first row sees; its left side from the
    # first key the last row sees (both relative to the box).
    first_row = visible[batch, qs.clamp(max=Nq - 1)]
    last_row = visible[batch, (qe - 1).clamp(min=0)]
    right = torch.where(first_row, ik, -1).amax(1) - s
    left = (qe - 1 - qs) - (torch.where(last_row, ik, big).amin(1) - s)
    i, j = iq[None, :, None], ik[None, None, :]
    qs3, s3 = qs[:, None, None], s[:, None, None]
    box = (qs3 <= i) & (i < qe[:, None, None]) & (s3 <= j) & (j < e[:, None, None])
    diagonal = (j - s3) - (i - qs3)
    expected = box & (diagonal <= right[:, None, None]) & (-diagonal <= left[:, None, None])
    exact = (expected == visible).all((1, 2)) | ~rows.any(1)
    if not bool(exact.all()):
        return None
    return [tuple(x) for x in torch.stack((qs, qe, s, e, left, right), 1).tolist()]


# transformers hands every layer of a forward the same mask tensor (two, alternating, in
# models with sliding and full layers): the spans of the last few are remembered, and found
# again only for another tensor or after it changed in place (its _version).
_RECENT_SPANS = []  # [(weakref to the mask, (its _version, B), its spans)], newest last
_REMEMBERED = 4


def _spans_of(mask, B, Nq, Nk):
    """_spans of a boolean (B or 1, 1, Nq, Nk) mask, remembered for that tensor (not while
    torch.compile traces, nor for an inference-mode tensor, which has no version counter)."""
    try:
        key = None if torch.compiler.is_compiling() else (mask._version, B)
    except RuntimeError:
        key = None
    if key is None:
        return _spans(mask[:, 0].expand(B, Nq, Nk))
    for ref, k, spans in _RECENT_SPANS:
        if ref() is mask and k == key:
            return spans
    spans = _spans(mask[:, 0].expand(B, Nq, Nk))
    live = [e for e in _RECENT_SPANS if e[0]() is not None and e[0]() is not mask]
    _RECENT_SPANS[:] = live[max(0, len(live) + 1 - _REMEMBERED):]
    _RECENT_SPANS.append((weakref.ref(mask), key, spans))
    return spans


def _refuse_mask(why):
    raise InvalidArgumentError(f"attention_mask: {why}")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, softcap: Optional[float] = None, **kwargs):
    """transformers' attention-function contract: query (B, H, Nq, d), key, value
    (B, Hkv, Nk, d) -> (attn_output (B, Nq, H, d), None). attention_mask: what the "pyfa"
    mask function made (sdpa_mask's bool (B, 1, Nq, Nk), True = visible, or None: then,
    as in transformers' SDPA backend, causal (top-left) iff Nq > 1 and the module is
    causal), or a float (B or 1, 1, Nq, Nk) mask added to the scores as SDPA adds it.
    dropout: pyfa.torch.attention's dropout_p, its seed drawn from torch's generator;
    softcap: pyfa's softcap. s_aux (gpt-oss's learned sinks, (H,)): pyfa.torch.attention's
    sinks. Refused, naming the argument: position_bias and sinks (another model's keyword)."""
    # s_aux is gpt-oss's (H,) sinks; a model's own `sinks` keyword (e.g. per-token ones,
    # (B, H, Nq, 1)) is another thing: refused, never ignored.
    for name in ("position_bias", "sinks"):
        if kwargs.get(name) is not None:
            raise InvalidArgumentError(f"{name}: not supported by pyfa's attention backend")
    B, _, Nq, _ = query.shape
    Nk = key.shape[2]
    # pyfa reads (B, N, H, d) views in place and writes O as transformers wants it back.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    kw = dict(scale=scaling, layout="bnhd")
    if dropout:
        kw["dropout_p"] = float(dropout)
    if softcap:
        kw["softcap"] = float(softcap)
    if kwargs.get("s_aux") is not None:
        kw["sinks"] = kwargs["s_aux"]
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = pyfa_torch.attention(q, k, v, causal=bool(causal and Nq > 1),
                                   causal_align="top_left", **kw)
        return out, None
    if not isinstance(attention_mask, torch.Tensor) or not (
            attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
        _refuse_mask(f"expected a boolean or float mask, got "
                     f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}")
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 \
            or attention_mask.shape[2:] != (Nq, Nk) or attention_mask.shape[0] not in (1, B):
        _refuse_mask(f"expected shape ({B}, 1, {Nq}, {Nk}), got {tuple(attention_mask.shape)}")
    spans = None
    if attention_mask.dtype == torch.bool:
        spans = _spans_of(attention_mask, B, Nq, Nk)
    if spans is None:
        return _with_bias(q, k, v, attention_mask, kw), None
    if len(set(spans)) == 1:
        groups = [(slice(None), spans[0])]
    else:
        groups = [(slice(b, b + 1), span) for b, span in enumerate(spans)]
    full = (0, Nq, 0, Nk)
    out = None
    for rows, (qs, qe, s, e, left, right) in groups:
        if qs >= qe:
            continue  # a batch row that sees nothing keeps O = 0
        # The band as pyfa's mask: causal at right = 0; a side as wide as the box, none.
        causal = right == 0
        left = None if left >= qe - qs - 1 else left
        right = None if causal or right >= e - s - 1 else right
        window = None if left is None and right is None else (left, right)
        o = pyfa_torch.attention(q[rows, qs:qe], k[rows, s:e], v[rows, s:e], causal=causal,
                                 window=window, causal_align="top_left", **kw)
        if len(groups) == 1 and (qs, qe, s, e) == full:
            return o, None
        if out is None:
            out = query.new_zeros((B, Nq) + tuple(o.shape[2:]))
        out[rows, qs:qe] = o
    if out is None:
        out = query.new_zeros((B, Nq, query.shape[1], query.shape[3]))
    return out, None


def _with_bias(q, k, v, mask, kw):
    """The mask as pyfa's additive bias (B or 1, 1, Nq, Nk): a boolean one as 0 / -inf, a
    float one as it is (SDPA's float attn_mask)."""
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        bias = bias.masked_fill(~mask, float("-inf"))
    else:
        bias = mask.to(torch.float32)
    return pyfa_torch.attention(q, k, v, bias=bias, **kw)


def register(name: str = NAME) -> str:
    """Registers pyfa under `name` with transformers' AttentionInterface and
    AttentionMaskInterface (both needed: with only the first, transformers hands the
    attention function no mask at all); returns the name, for attn_implementation=."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
