"""pyfa for PyTorch training: attention as a torch.autograd.Function.

    import pyfa.torch
    o = pyfa.torch.attention(q, k, v, causal=True)   # q, k, v: float32 tensors, CPU or CUDA
    o.sum().backward()                               # q.grad, k.grad, v.grad by FA2's backward

The forward is pyfa.fa2_forward, which saves O and LSE; the backward is
pyfa.fa2_backward on them, deterministic (no atomics): the same inputs give the same
gradient bits on every run, equal to pyfa.attention_grad's. CUDA tensors run on the
current stream of their device without a host copy. Needs torch (pip install
".[torch]" at a pyfa checkout's root).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

try:
    import torch
except ImportError as e:
    raise ImportError("pyfa.torch needs PyTorch, which is not installed here "
                      "(pip install torch, or pip install \".[torch]\" at a pyfa checkout's root)") from e
from torch.autograd.function import once_differentiable

from . import api

__all__ = ["attention"]


def _options(causal, window, causal_align, scale, block_r, block_c, backend):
    """The keywords of pyfa's FA2 calls, the same for the forward and the backward."""
    return dict(causal=causal, window=window, causal_align=causal_align, scale=scale,
                block_r=block_r, block_c=block_c, backend=backend)


def _on_device_of(t):
    # torch exports a CUDA tensor through DLPack only while its device is the current one.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options):
        # pyfa reads the tensors through DLPack, which refuses tensors that require grad.
        q, k, v = q.detach(), k.detach(), v.detach()
        with _on_device_of(q):
            o, lse = api.fa2_forward(q, k, v, **options)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = options
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        # o comes back from the graph requiring grad; DLPack exports only detached tensors.
        q, k, v, o, lse = (t.detach() for t in ctx.saved_tensors)
        # CUDA tensors must be C-contiguous (a gradient may come expanded or transposed).
        with _on_device_of(q):
            dq, dk, dv = api.fa2_backward(q, k, v, o, lse, do.detach().contiguous(), **ctx.options)
        return dq, dk, dv, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: Optional[Tuple[Optional[int], Optional[int]]] = None,
              causal_align: str = "bottom_right", scale: Optional[float] = None,
              block_r: Optional[int] = None, block_c: Optional[int] = None,
              backend: str = "auto") -> torch.Tensor:
    """O = softmax(scale * Q K^T [mask]) V by FlashAttention-2, differentiable.

    q: (B, H, Nq, d), (H, Nq, d) or (Nq, d) float32; k, v: the same with Nk rows and H or
    a divisor of H heads (GQA); all on one device (CPU, or CUDA: C-contiguous). causal,
    window, causal_align, scale, block_r, block_c, backend: as in pyfa.attention.
    Gradients flow to whichever of q, k, v require them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return _Attention.apply(q, k, v, _options(causal, window, causal_align, scale, block_r, block_c,
                                                     backend))
