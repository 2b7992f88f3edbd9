"""pyfa for PyTorch: FA2 as custom operators, differentiable, traceable by torch.compile.

    import pyfa.torch
    o = pyfa.torch.attention(q, k, v, causal=True)   # q, k, v: float32 tensors, CPU or CUDA
    o.sum().backward()                               # q.grad, k.grad, v.grad by FA2's backward

Two operators are registered with torch.library: pyfa::fa2_forward (q, k, v -> o, lse) and
pyfa::fa2_backward (q, k, v, o, lse, do -> dq, dk, dv), each with a fake (meta)
implementation, so torch.compile(fullgraph=True) traces through them; an autograd rule
(the forward saves O and LSE, the backward is FA2's, deterministic: the same gradient bits
on every run, equal to pyfa.attention_grad's); a vmap rule (the vmapped axis is folded into
the batch); and an autocast rule (under torch.autocast the inputs are cast to float32, the
only dtype pyfa computes in). CUDA tensors run on the current stream of their device
without a host copy.

Drop-ins with the conventions of their originals: scaled_dot_product_attention
(torch.nn.functional's), flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache
(flash-attn's). Each refuses, naming the argument, what pyfa cannot honour yet. docs/torch.md
says what each one takes. Needs torch (installed with the checkout's "torch" extra).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

try:
    import torch
except ImportError as e:
    raise ImportError("pyfa.torch needs PyTorch, which is not installed here "
                      "(pip install torch, or pip install \".[torch]\" from a pyfa checkout)") from e
if not all(hasattr(torch.library, f) for f in ("custom_op", "register_vmap", "register_autocast")):
    raise ImportError(f"pyfa.torch needs PyTorch >= 2.5 (torch.library.custom_op, register_vmap, "
                      f"register_autocast), found {torch.__version__}")
from torch import Tensor
from torch.utils import _python_dispatch

from . import api, varlen
from .kvcache import merge_sinks, sinks_grad
from .checks import check_bias, check_int, check_softcap, check_tile, check_window
from .errors import ArgumentTypeError, InvalidArgumentError
from .options import Options

__all__ = ["attention", "context_parallel_attention", "attention_varlen", "scaled_dot_product_attention", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache"]

_LAYOUTS = ("bhnd", "bnhd")


def _on_device_of(t):
    # torch exports a CUDA tensor through DLPack only while its device is the current one.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _operand(t):
    """A tensor as pyfa's NumPy API takes it: a CPU tensor as the NumPy view of its memory
    (what DLPack would give, at a third of the cost per call), anything else detached, for
    DLPack (which refuses a tensor that requires grad) and its checks."""
    t = t.detach()
    return t.numpy() if t.is_cpu and t.layout == torch.strided and not t.is_neg() else t


def _call(fn, *tensors, **kw):
    """fn (pyfa.fa2_forward or fa2_backward) on the tensors, its outputs as tensors."""
    with _on_device_of(tensors[0]):
        results = fn(*map(_operand, tensors), **kw)
    return tuple(torch.from_numpy(r) if isinstance(r, np.ndarray) else r for r in results)


def _check_dtype(name, t):
    if t.dtype != torch.float32:
        raise ArgumentTypeError(f"{name}: expected dtype torch.float32, got {t.dtype} (pyfa computes in "
                                f"fp32 only; under torch.autocast pyfa's ops cast their inputs to float32)")


def _dims(q, k, v, layout):
    """(B, H, Nq, Nk, d, Hkv) of 4-D q, k, v in `layout`, checked by pyfa's rules except
    that sizes of 0 are allowed (the library refuses them; these ops answer them as SDPA
    does)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise InvalidArgumentError(f"{name}: expected 4 dimensions, got shape {tuple(t.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise InvalidArgumentError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    if layout == "bnhd":
        (B, Nq, H, d), (Bk, Nk, Hkv, dk) = q.shape, k.shape
    else:
        (B, H, Nq, d), (Bk, Hkv, Nk, dk) = q.shape, k.shape
    if Bk != B:
        raise InvalidArgumentError(f"k: batch {Bk} differs from q's {B}")
    if dk != d:
        raise InvalidArgumentError(f"k: head dim {dk} differs from q's {d}")
    if d < 1:
        raise InvalidArgumentError(f"q: head dim must be >= 1, got {d}")
    # No heads at all is an empty problem, as a batch of none is (SDPA answers both).
    if (H % Hkv != 0) if Hkv else H != 0:
        raise InvalidArgumentError(f"k: its {Hkv} heads must divide q's {H} heads (grouped-query "
                                   f"attention), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return B, H, Nq, Nk, d, Hkv


def _keywords(causal, window_left, window_right, causal_align, scale, layout, block_r, block_c,
              backend, dropout_p=0.0, seed=0, offset=0, softcap=None, alibi_slopes=None, split_size=0):
    """pyfa's keywords from the operators' flat arguments (a window with both sides
    unbounded is no window; seed and offset travel as int64, their two's complement),
    the score modifications (pyfa.checks.ScoreMods) included."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    drop = dict(dropout_p=dropout_p, seed=seed % 2 ** 64, offset=offset % 2 ** 64) if dropout_p else {}
    mods = {name: x for name, x in (("softcap", softcap), ("alibi_slopes", alibi_slopes)) if x is not None}
    if alibi_slopes is not None:
        mods["alibi_slopes"] = alibi_slopes.detach()
    if split_size:
        mods["split_size"] = split_size
    return dict(causal=causal, window=window, causal_align=causal_align, scale=scale,
                layout=layout, options=_options(backend, block_r, block_c), **drop, **mods)


def _options(backend, block_r, block_c):
    """The execution options of a pyfa call from the operators' flat arguments: those of
    the enclosing `with pyfa.Options(...)` (threads, emulator order, ...), with the
    backend and tiles the caller gave here in place of its own."""
    given = {name: value for name, value in (("backend", backend), ("block_r", block_r),
                                             ("block_c", block_c)) if value not in (None, "auto")}
    return Options.current().replace(**given)


def _check_options(q, kw, k=None):
    """Checks the keywords kw as pyfa checks them, for a call with nothing to compute (the
    library refuses empty tensors): by pyfa itself, on a problem of one row and one key
    of q's head dim on q's device (with k: of q's batch and q's and k's heads, so that
    (H,) or (B, H) ALiBi slopes fit), so that an argument is refused, never ignored,
    whatever the sizes."""
    rows, heads = (1, 2) if kw["layout"] == "bnhd" else (2, 1)
    if k is not None and q.dim() == 4 and min(q.shape[0], q.shape[heads], k.shape[heads]) > 0:
        one_q = q.new_zeros(q.shape[:rows] + (1,) + q.shape[rows + 1:])
        one_k = q.new_zeros(k.shape[:rows] + (1,) + k.shape[rows + 1:])
    else:
        one_q = one_k = q.new_zeros((1, 1, 1, q.shape[-1]))
        kw = {**kw, "layout": "bhnd"}
        kw.pop("alibi_slopes", None)  # sized for heads or a batch this stand-in lacks
    with _on_device_of(q):
        api.fa2_forward(one_q, one_k, one_k, **kw)


# The operators' non-tensor arguments, in schema order after the tensors.
_OPTION_NAMES = ("causal", "window_left", "window_right", "causal_align", "scale", "layout",
                 "block_r", "block_c", "backend", "dropout_p", "seed", "offset", "softcap",
                 "alibi_slopes", "split_size")


# Each differentiable operator's Python body, by name: _differentiable calls it directly
# where nothing but the caller would see the operator.
_BODIES = {}


def _custom_op(name):
    """torch.library.custom_op(name) (functional: no argument mutated), keeping the
    function itself in _BODIES."""
    def register(fn):
        _BODIES[name] = fn
        return torch.library.custom_op(name, mutates_args=())(fn)
    return register


@_custom_op("pyfa::fa2_forward")
def _fa2_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, window_left: Optional[int],
                 window_right: Optional[int], causal_align: str, scale: Optional[float],
                 layout: str, block_r: Optional[int], block_c: Optional[int],
                 backend: str, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                 softcap: Optional[float] = None,
                 alibi_slopes: Optional[Tensor] = None, split_size: int = 0,
                 sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """q: (B, H, Nq, d) in `layout`; k, v: (B, Hkv, Nk, d) in `layout`, float32. Returns
    o (like q, C-contiguous) and lse (B, H, Nq); with sinks ((H,), on q's device), those
    of attention with sinks (pyfa.fa2_forward's)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_dtype(name, t)
    B, H, Nq, Nk, _, _ = _dims(q, k, v, layout)
    kw = _keywords(causal, window_left, window_right, causal_align, scale, layout, block_r,
                   block_c, backend, dropout_p, seed, offset, softcap, alibi_slopes, split_size)
    if q.numel() == 0 or k.numel() == 0:
        # No query rows, or no keys: every row sees nothing (O = 0, LSE = -inf).
        _check_options(q, kw, k)
        return _with_sinks(q.new_zeros(q.shape), q.new_full((B, H, Nq), -math.inf), sinks, layout)
    return _call(api.fa2_forward, q, k, v, **kw, **_fa2_forward_sinks(sinks))


@_fa2_forward.register_fake
def _fa2_forward_fake(q, k, v, causal, window_left, window_right, causal_align, scale, layout,
                      block_r, block_c, backend, dropout_p=0.0, seed=0, offset=0, softcap=None,
                      alibi_slopes=None, split_size=0, sinks=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_dtype(name, t)
    B, H, Nq, _, _, _ = _dims(q, k, v, layout)
    return q.new_empty(q.shape), q.new_empty((B, H, Nq))


@_custom_op("pyfa::fa2_backward")
def _fa2_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                  causal: bool, window_left: Optional[int], window_right: Optional[int],
                  causal_align: str, scale: Optional[float], layout: str,
                  block_r: Optional[int], block_c: Optional[int],
                  backend: str, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                  softcap: Optional[float] = None,
                  alibi_slopes: Optional[Tensor] = None, split_size: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """FA2's backward from fa2_forward's o and lse and the gradient do (like o); returns
    dq, dk, dv like q, k, v (C-contiguous)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("do", do)):
        _check_dtype(name, t)
    _dims(q, k, v, layout)
    kw = _keywords(causal, window_left, window_right, causal_align, scale, layout, block_r,
                   block_c, backend, dropout_p, seed, offset, softcap, alibi_slopes, split_size)
    if q.numel() == 0 or k.numel() == 0:
        _check_options(q, kw, k)
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    # CUDA tensors must be C-contiguous (a gradient may come expanded or transposed).
    return _call(api.fa2_backward, q, k, v, o, lse, do.contiguous(), **kw)


@_fa2_backward.register_fake
def _fa2_backward_fake(q, k, v, o, lse, do, *options):
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("do", do)):
        _check_dtype(name, t)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _forward_setup(ctx, inputs, output):
    q, k, v, *options = inputs
    # The backward of attention with sinks is the plain one on the merged (o, lse): the
    # backward operators take the options without the sinks.
    ctx.save_for_backward(q, k, v, *output, options[-1])
    ctx.options = options[:-1]
    # An unused output's gradient stays None: no work for an LSE nobody differentiates.
    ctx.set_materialize_grads(False)


def _fa2_forward_sinks(sinks):
    """pyfa.fa2_forward's sinks= for the operators' sinks tensor (the library merges them
    into each row's final state), or none."""
    if sinks is None:
        return {}
    _check_dtype("sinks", sinks)
    return {"sinks": _operand(sinks)}


def _with_sinks(o, lse, sinks, layout):
    """(o, lse) of an empty problem, merged with the sinks where there are any
    (pyfa.merge_sinks, on the CPU)."""
    if sinks is None:
        return o, lse
    _check_dtype("sinks", sinks)
    if o.device.type != "cpu" or sinks.device.type != "cpu":
        raise InvalidArgumentError(f"sinks: pyfa merges sinks on the CPU only in this version; q on {o.device}, "
                                   f"sinks on {sinks.device}")
    o, lse = merge_sinks(o.numpy(), lse.numpy(), sinks.detach().numpy(), layout)
    return torch.from_numpy(np.ascontiguousarray(o)), torch.from_numpy(lse)


def _sinks_gradient(ctx, o, lse, do, dlse, sinks, layout=None):
    """The sinks' gradient (pyfa::sinks_grad), or None where they need none; the sinks
    are the operator's last input, layout (None) the dense operators' option."""
    if sinks is None or not ctx.needs_input_grad[-1]:
        return None
    if layout is None:
        layout = dict(zip(_OPTION_NAMES, ctx.options))["layout"]
    return _call_op("pyfa::sinks_grad", o, lse, do, sinks, dlse, layout)


@_custom_op("pyfa::sinks_grad")
def _sinks_grad(o: Tensor, lse: Tensor, do: Tensor, sinks: Tensor, dlse: Optional[Tensor],
                layout: str) -> Tensor:
    """pyfa.sinks_grad on CPU tensors: the sinks' (H,) gradient from the merged (o, lse)."""
    if o.device.type != "cpu" or sinks.device.type != "cpu":
        raise InvalidArgumentError(f"sinks: pyfa computes the sinks' gradient on the CPU only in this version; "
                                   f"o on {o.device}, sinks on {sinks.device}")
    return torch.from_numpy(sinks_grad(o.numpy(), lse.numpy(), do.numpy(), sinks.detach().numpy(),
                                       None if dlse is None else dlse.numpy(), layout))


@_sinks_grad.register_fake
def _sinks_grad_fake(o, lse, do, sinks, dlse, layout):
    return sinks.new_empty(sinks.shape)


def _undropped(names, options):
    """An operator's options (named by `names`, in schema order) with dropout_p 0."""
    return [0.0 if name == "dropout_p" else x for name, x in zip(names, options)]


def _lse_gradient(q, k, v, lse, dlse, options):
    """The gradients of sum(dlse * lse) for q and k: dLSE_i/dS_ij = P_ij, so they are FA2's
    backward with dS = P dlse in place of P (dP - D), through the score modifications'
    gradients like any dS. One more FA2 backward, no N x N matrix, given V = 0 (so dP = 0),
    O = e_0 and dO = -dlse e_0 (so D_i = dO_i . O_i = -dlse_i exactly). LSE takes P
    undropped, so this call runs without dropout."""
    options = _undropped(_OPTION_NAMES, options)
    opts = dict(zip(_OPTION_NAMES, options))
    # dlse is (B, H, Nq); q's rows are (B, H, Nq, :) or, in "bnhd", (B, Nq, H, :).
    g = dlse.transpose(1, 2) if opts["layout"] == "bnhd" else dlse
    o_unit, do_lse = torch.zeros_like(q), torch.zeros_like(q)
    o_unit[..., 0] = 1
    do_lse[..., 0] = -g
    dq, dk, _ = _call_op("pyfa::fa2_backward", q, k, torch.zeros_like(v), o_unit, lse, do_lse, *options)
    return dq, dk


def _forward_backward(ctx, do, dlse):
    q, k, v, o, lse, sinks = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _call_op("pyfa::fa2_backward", q, k, v, o, lse, do, *ctx.options)
    if dlse is not None:
        # Rows that see no key have LSE = -inf for any q, k: their gradient is zero.
        dlse = torch.where(torch.isinf(lse), torch.zeros_like(dlse), dlse)
        lq, lk = _lse_gradient(q, k, v, lse, dlse, ctx.options)
        dq, dk = dq + lq, dk + lk
    return (dq, dk, dv) + (None,) * len(ctx.options) + (_sinks_gradient(ctx, o, lse, do, dlse, sinks),)


def _backward_setup(ctx, inputs, output):
    pass


def _no_double_backward(ctx, ddq, ddk, ddv, op="pyfa::fa2_backward"):
    raise RuntimeError(f"{op}: double backward (a gradient of pyfa's gradient, "
                       "e.g. torch.autograd.grad(..., create_graph=True) then another backward) "
                       "is not supported")


torch.library.register_autograd("pyfa::fa2_forward", _forward_backward,
                                setup_context=_forward_setup)
torch.library.register_autograd("pyfa::fa2_backward", _no_double_backward,
                                setup_context=_backward_setup)


def _no_double_backward_sinks(ctx, ddsinks):
    _no_double_backward(ctx, None, None, None, op="pyfa::sinks_grad")


torch.library.register_autograd("pyfa::sinks_grad", _no_double_backward_sinks, setup_context=_backward_setup)


def _fold(x, bdim, size):
    """x with its vmapped axis bdim (None: not vmapped, so broadcast) folded into axis 0:
    each vmapped slice is its own batch elements, the same problem as computed alone."""
    x = x.expand(size, *x.shape) if bdim is None else x.movedim(bdim, 0)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(x, size):
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


def _fold_slopes(options, dims, q, q_dim, n):
    """The operators' options under vmap, ALiBi slopes made those of the folded batch (row
    s * B + b of vmapped slice s and batch element b): (B, H) slopes repeat for every
    slice; mapped ones are each slice's own, (H,) or (B, H) per slice."""
    i = _OPTION_NAMES.index("alibi_slopes")
    if i >= len(options):  # torch leaves trailing arguments at their defaults out
        return options
    slopes, d = options[i], dims[i]
    if slopes is None or (d is None and slopes.dim() == 1):
        return options
    B = q.shape[0] if q_dim is None else q.movedim(q_dim, 0).shape[1]
    if d is None:
        slopes = slopes.repeat(n, 1)
    else:
        slopes = slopes.movedim(d, 0)
        if slopes.dim() == 2:
            slopes = slopes[:, None].expand(n, B, slopes.shape[-1])
        slopes = slopes.reshape(n * B, slopes.shape[-1])
    return (*options[:i], slopes, *options[i + 1:])


def _forward_vmap(info, in_dims, q, k, v, *options):
    sinks = 3 + len(_OPTION_NAMES)
    if len(in_dims) > sinks and in_dims[sinks] is not None:
        raise InvalidArgumentError("sinks: pyfa.torch.attention takes one sink per head, not a vmapped batch of them")
    n = info.batch_size
    options = _fold_slopes(options, in_dims[3:], q, in_dims[0], n)
    o, lse = torch.ops.pyfa.fa2_forward(*(_fold(t, d, n) for t, d in zip((q, k, v), in_dims)),
                                        *options)
    return (_unfold(o, n), _unfold(lse, n)), (0, 0)


def _backward_vmap(info, in_dims, q, k, v, o, lse, do, *options):
    n = info.batch_size
    options = _fold_slopes(options, in_dims[6:], q, in_dims[0], n)
    grads = torch.ops.pyfa.fa2_backward(
        *(_fold(t, d, n) for t, d in zip((q, k, v, o, lse, do), in_dims)), *options)
    return tuple(_unfold(g, n) for g in grads), (0, 0, 0)


torch.library.register_vmap("pyfa::fa2_forward", _forward_vmap)
torch.library.register_vmap("pyfa::fa2_backward", _backward_vmap)


# ---- additive bias (issue 27): a pair of operators of its own, the unbiased ones' schema
# with the bias after v (pyfa::fa2_backward_bias also returns dbias, the bias's shape).

@_custom_op("pyfa::fa2_forward_bias")
def _fa2_forward_bias(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, causal: bool,
                      window_left: Optional[int], window_right: Optional[int], causal_align: str,
                      scale: Optional[float], layout: str, block_r: Optional[int],
                      block_c: Optional[int], backend: str,
                      dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                      softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                      split_size: int = 0, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """pyfa::fa2_forward with an additive float32 bias broadcastable to (B, H, Nq, Nk)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        _check_dtype(name, t)
    B, H, Nq, Nk, _, _ = _dims(q, k, v, layout)
    kw = _keywords(causal, window_left, window_right, causal_align, scale, layout, block_r,
                   block_c, backend, dropout_p, seed, offset, softcap, alibi_slopes, split_size)
    if q.numel() == 0 or k.numel() == 0:
        _check_options(q, kw, k)
        check_bias("bias", bias.detach(), (B, H, Nq, Nk))
        return _with_sinks(q.new_zeros(q.shape), q.new_full((B, H, Nq), -math.inf), sinks, layout)
    return _call(api.fa2_forward, q, k, v, bias=_operand(bias), **kw, **_fa2_forward_sinks(sinks))


@_fa2_forward_bias.register_fake
def _fa2_forward_bias_fake(q, k, v, bias, *options):
    for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        _check_dtype(name, t)
    B, H, Nq, _, _, _ = _dims(q, k, v, options[5])
    return q.new_empty(q.shape), q.new_empty((B, H, Nq))


@_custom_op("pyfa::fa2_backward_bias")
def _fa2_backward_bias(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, o: Tensor, lse: Tensor,
                       do: Tensor, causal: bool, window_left: Optional[int],
                       window_right: Optional[int], causal_align: str, scale: Optional[float],
                       layout: str, block_r: Optional[int], block_c: Optional[int],
                       backend: str, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                       softcap: Optional[float] = None,
                       alibi_slopes: Optional[Tensor] = None,
                       split_size: int = 0, bias_grad: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """pyfa::fa2_backward with the forward's bias; returns dq, dk, dv and dbias (the
    bias's shape: dS summed over its broadcast axes, docs/numerics.md §2), or with
    bias_grad=False an empty dbias, not computed."""
    for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias), ("o", o), ("lse", lse), ("do", do)):
        _check_dtype(name, t)
    B, H, Nq, Nk, _, _ = _dims(q, k, v, layout)
    kw = _keywords(causal, window_left, window_right, causal_align, scale, layout, block_r,
                   block_c, backend, dropout_p, seed, offset, softcap, alibi_slopes, split_size)
    dbias_shape = bias.shape if bias_grad else (0,)
    if q.numel() == 0 or k.numel() == 0:
        _check_options(q, kw, k)
        check_bias("bias", bias.detach(), (B, H, Nq, Nk))
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape), bias.new_zeros(dbias_shape)
    grads = _call(api.fa2_backward, q, k, v, o, lse, do.contiguous(), bias=_operand(bias),
                  bias_grad=bias_grad, **kw)
    return grads if bias_grad else (*grads, bias.new_empty(0))


@_fa2_backward_bias.register_fake
def _fa2_backward_bias_fake(q, k, v, bias, o, lse, do, *options, bias_grad=True):
    for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias), ("o", o), ("lse", lse), ("do", do)):
        _check_dtype(name, t)
    if len(options) > len(_OPTION_NAMES):  # bias_grad given by position
        options, bias_grad = options[:-1], options[-1]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            bias.new_empty(bias.shape if bias_grad else (0,)))


def _forward_bias_setup(ctx, inputs, output):
    q, k, v, bias, *options = inputs
    ctx.save_for_backward(q, k, v, bias, *output, options[-1])  # the sinks last, as _forward_setup
    ctx.options = options[:-1]
    ctx.set_materialize_grads(False)


def _forward_bias_backward(ctx, do, dlse):
    q, k, v, bias, o, lse, sinks = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    # A bias that needs no gradient takes a backward without dbias: no scratch, no writes.
    need = ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _call_op("pyfa::fa2_backward_bias", q, k, v, bias, o, lse, do, *ctx.options, need)
    if dlse is not None:
        # dLSE_i / dS_ij = P_ij: the backward's dS = P (dP - D) is P * dlse when V = 0
        # (dP = 0) and O, dO are -1 and dlse in one column (D = -dlse); its dq, dk, dbias
        # are then the LSE's gradients. Rows that see no key: zero. LSE takes P undropped,
        # so this call runs without dropout.
        dlse = torch.where(torch.isinf(lse), torch.zeros_like(dlse), dlse)
        options = [0.0 if name == "dropout_p" else x for name, x in zip(_OPTION_NAMES, ctx.options)]
        layout = dict(zip(_OPTION_NAMES, options))["layout"]
        g = dlse.transpose(1, 2) if layout == "bnhd" else dlse
        o1, do1 = torch.zeros_like(q), torch.zeros_like(q)
        o1[..., 0] = -1.0
        do1[..., 0] = g
        lq, lk, _, lb = _call_op("pyfa::fa2_backward_bias", q, k, torch.zeros_like(v), bias, o1, lse, do1,
                                 *options, need)
        dq, dk, dbias = dq + lq, dk + lk, dbias + lb
    return ((dq, dk, dv, dbias if need else None) + (None,) * len(ctx.options)
            + (_sinks_gradient(ctx, o, lse, do, dlse, sinks),))


def _no_double_backward_bias(ctx, ddq, ddk, ddv, ddbias):
    _no_double_backward(ctx, ddq, ddk, ddv)


torch.library.register_autograd("pyfa::fa2_forward_bias", _forward_bias_backward,
                                setup_context=_forward_bias_setup)
torch.library.register_autograd("pyfa::fa2_backward_bias", _no_double_backward_bias,
                                setup_context=_backward_setup)


def _bias_operand(bias):
    """The bias as pyfa's operator takes it: an axis broadcast by stride 0 (an expanded
    tensor) taken at size 1, so that its gradient is the sum over that axis (autograd's
    expand rule then gives the tensor it was expanded from the same sum); a leaf that
    requires grad is read as it is, copied where it has stride 0 (its .grad is per element)."""
    _check_tensor("bias", bias)
    if bias.requires_grad and bias.is_leaf:
        return bias if all(s != 0 or n == 1 for n, s in zip(bias.shape, bias.stride())) else bias.contiguous()
    for axis, (n, s) in enumerate(zip(bias.shape[:-1], bias.stride()[:-1])):
        if n > 1 and s == 0:
            bias = bias.narrow(axis, 0, 1)
    return bias

for _op in ("pyfa::fa2_forward", "pyfa::fa2_backward", "pyfa::fa2_forward_bias", "pyfa::fa2_backward_bias"):
    for _device in ("cpu", "cuda"):
        torch.library.register_autocast(_op, _device, torch.float32)
del _op, _device


def _plain_eager(inputs):
    """Whether a call with no gradient wanted may run its operator's Python body directly:
    every tensor a plain CPU one (no subclass, fake or functorch-wrapped tensor) and
    nothing that has to see the operator itself (torch.compile, tracing, a dispatch or
    function mode, autocast, the profiler). Where one of these cannot be asked, no."""
    if torch.compiler.is_compiling():  # first: what follows would break torch.compile's graph
        return False
    try:
        for x in inputs:
            if isinstance(x, Tensor) and (type(x) is not Tensor or not x.is_cpu
                                          or torch._C._functorch.is_functorch_wrapped_tensor(x)):
                return False
        return not (torch.jit.is_tracing()
                    or _python_dispatch.is_in_torch_dispatch_mode() or torch._C._len_torch_dispatch_stack()
                    or torch._C._is_torch_function_mode_enabled() or torch._C._is_any_autocast_enabled()
                    or torch.autograd.profiler._is_profiler_enabled)
    except AttributeError:  # a PyTorch without one of these
        return False


def _wants_grad(inputs):
    return torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in inputs)


def _call_op(name, *inputs):
    """The operator `name` on inputs, as its Python body where no gradient is wanted and
    the call is plain eager CPU work (_plain_eager): a call without one, the forward
    inside an autograd.Function, the backwards' operators (a double backward, with
    create_graph, goes through the operators, whose rules refuse it). Through the
    dispatcher a small backward cost about 50 us more here (124 against 75 us)."""
    if not _wants_grad(inputs) and _plain_eager(inputs):
        return _BODIES[name](*inputs)
    return getattr(torch.ops.pyfa, name.split("::")[1])(*inputs)


def _differentiable(name, setup_context, backward):
    """The operator `name` called through an autograd.Function with the autograd rule
    registered for it (the same setup_context and backward) where a gradient is wanted.
    PyTorch's own autograd layer for a custom operator (2.13) fills in the schema's
    defaults on every forward through a pybind property, quadratic in the number of
    arguments (19 for fa2_forward: about 90 us of a call that costs about 300); an
    autograd.Function around the operator skips it (torch.ops.pyfa.* called directly keep
    their own rule). Where no gradient is wanted and the call is plain eager CPU work
    (_plain_eager), the operator's body runs directly, as the dispatcher would have run
    it after about 35 us of its own (a tiny call here: 89 -> 62 us); so does the forward
    inside the Function and the backward's operators (_call_op). The operator's autocast
    rule casts what the forward computes on; the floating-point tensors saved for the
    backward are cast the same way, as the backward runs outside autocast."""
    op = getattr(torch.ops.pyfa, name.split("::")[1])

    class Function(torch.autograd.Function):
        generate_vmap_rule = True  # the operators' own vmap rules, inside

        @staticmethod
        def forward(*inputs):
            return _call_op(name, *inputs)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, [x.float() if isinstance(x, Tensor) and x.is_floating_point() else x
                                for x in inputs], output)

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)
    Function.__name__ = Function.__qualname__ = op.__name__

    def call(*inputs):
        # The Function only where a gradient is wanted: torch.compile (2.13) fails inside
        # an autograd.Function none of whose inputs requires one.
        return Function.apply(*inputs) if _wants_grad(inputs) else _call_op(name, *inputs)
    return call


_ATTENTION = _differentiable("pyfa::fa2_forward", _forward_setup, _forward_backward)
_ATTENTION_BIAS = _differentiable("pyfa::fa2_forward_bias", _forward_bias_setup, _forward_bias_backward)


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _check_str(name, x):
    # Checked here: torch's schema would refuse anything else with a RuntimeError of its own.
    if not isinstance(x, str):
        raise ArgumentTypeError(f"{name}: expected a str, got {type(x).__name__}")


def _check_bool(name, x):
    if not isinstance(x, bool):
        raise ArgumentTypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return x


def _dropout_args(dropout_p, seed, offset):
    """(dropout_p, seed, offset) as the operators take them: seed and offset as int64 (their
    two's complement), seed drawn from torch's default generator when None and dropout_p > 0.
    Plain Python, which torch.compile traces; the operators check the rest as pyfa does
    (pyfa.checks.ScoreMods). Drawing a seed reads a tensor: a graph break under
    torch.compile, where a seed of one's own avoids it."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ArgumentTypeError(f"dropout_p: expected a float in [0, 1), got {type(dropout_p).__name__}")
    # Checked without dropout too, as pyfa.attention checks them: refused, never ignored.
    if seed is not None:
        seed = check_int("seed", seed, 0, 2 ** 64 - 1)
    offset = check_int("offset", offset, 0, 2 ** 64 - 1)
    if dropout_p == 0:
        return 0.0, 0, 0
    if seed is None:
        seed = int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64)) % 2 ** 64
    signed = lambda x: x - 2 ** 64 if x >= 2 ** 63 else x
    return float(dropout_p), signed(seed), signed(offset)


class _Keywords(NamedTuple):
    left: Optional[int]
    right: Optional[int]
    block_r: Optional[int]
    block_c: Optional[int]
    scale: Optional[float]
    dropout_p: float
    seed: int
    offset: int
    softcap: Optional[float]
    alibi_slopes: Optional[Tensor]
    split: int


def _checked_keywords(q, causal, return_lse, window, block_r, block_c, backend, causal_align, scale,
                      dropout_p, seed, offset, softcap, alibi_slopes, split_size):
    """The keywords attention and attention_varlen share, checked by pyfa's rules before
    torch's schema sees them (it would refuse with RuntimeErrors of its own), in the
    operators' form."""
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    left, right = check_window(window)
    block_r, block_c = check_tile("block_r", block_r), check_tile("block_c", block_c)
    _check_str("backend", backend)
    _check_str("causal_align", causal_align)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise ArgumentTypeError(f"scale: expected a float or None, got {type(scale).__name__}")
        scale = float(scale)
    dropout_p, seed, offset = _dropout_args(dropout_p, seed, offset)
    softcap = check_softcap(softcap)
    split = 0 if split_size is None else check_int("split_size", split_size, 1, 1 << 40)
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes)
        alibi_slopes = alibi_slopes.detach().to(q.device, torch.float32).contiguous()
    return _Keywords(left, right, block_r, block_c, scale, dropout_p, seed, offset, softcap, alibi_slopes,
                     split)


def _to_4d(t, rank, layout):
    """The 4-D view of a rank-2 or -3 tensor in `layout` (leading unit axes added)."""
    if rank == 4:
        return t
    if rank == 3:
        return t.unsqueeze(0)
    return t[None, None] if layout == "bhnd" else t[None, :, None]


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              window: Optional[Tuple[Optional[int], Optional[int]]] = None,
              causal_align: str = "bottom_right", scale: Optional[float] = None,
              layout: str = "bhnd", return_lse: bool = False, block_r: Optional[int] = None,
              block_c: Optional[int] = None, backend: str = "auto", dropout_p: float = 0.0,
              seed: Optional[int] = None, offset: int = 0, bias: Optional[Tensor] = None,
              softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
              split_size: Optional[int] = None, sinks: Optional[Tensor] = None):
    """O = softmax(scale * Q K^T [mask]) V by FlashAttention-2, differentiable.

    q: (B, H, Nq, d), (H, Nq, d) or (Nq, d) float32 in layout "bhnd"; (B, Nq, H, d),
    (Nq, H, d) or (Nq, d) in "bnhd"; k, v: the same with Nk rows and H or a divisor of H
    heads (GQA); all on one device (CPU, or CUDA: contiguous last axis). causal, window,
    causal_align, scale, block_r, block_c, backend: as in pyfa.attention. O comes back
    in `layout`, C-contiguous. return_lse: also return LSE, (B, H, Nq) (q's shape without
    d, in that order in both layouts), -inf for a row that sees no key; it is
    differentiable too. Nq = 0 gives an empty O; Nk = 0 gives O = 0 and LSE = -inf, and
    zero gradients. Gradients flow to whichever of q, k, v require them.

    dropout_p in [0, 1): dropout of the attention probabilities in P V (docs/numerics.md,
    "Dropout"; LSE is that of P undropped), applied whenever dropout_p > 0, as SDPA does;
    the backward regenerates the forward's mask. seed, offset: ints in [0, 2^64) that
    decide the mask (pyfa.dropout_mask(B, H, Nq, Nk, dropout_p=, seed=, offset=) returns
    it); seed=None draws a fresh 64-bit seed from torch's default (CPU) generator on every
    call, so that torch.manual_seed makes a run reproducible and successive calls drop
    differently (offset is then 0).

    bias: a float32 tensor broadcastable to (B, H, Nq, Nk) (in both layouts), added to
    the scaled scores before the mask (pyfa.attention's bias=); it gets a gradient when
    it requires one, summed over the axes it broadcasts in one fixed order; it combines
    with dropout, softcap and ALiBi below (its gradient is that of the score it is added
    to, after softcap).

    Score modifications (docs/numerics.md §2), differentiated too: softcap (None, or a
    float > 0; 0 is off, as in flash-attn): each scaled score s becomes softcap * tanh(s /
    softcap), before the mask; alibi_slopes (None, or a tensor (H,) or (B, H), moved to
    q's device as float32; no gradient): then S - slope * |i + off - j|, after softcap,
    off causal_align's offset (flash-attn's ALiBi).

    split_size: None, or keys per chunk (a multiple of the kernels' tiles): the split
    structure (docs/numerics.md, "Split-KV"), forward and backward, whose bits
    pyfa.torch.context_parallel_attention reproduces on any number of ranks.

    sinks: None, or a float32 tensor (H,) on q's device (gpt-oss's learned attention
    sinks): a logit per query head that joins every row's softmax and has no value, so
    that a row may attend to nothing (the FA2 forward merges the attention with the
    sink's state, as pyfa.merge_sinks does; -inf is no sink); LSE then counts it.
    Differentiable on the CPU: its gradient is pyfa.sinks_grad's."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise InvalidArgumentError(f"layout: expected 'bhnd' or 'bnhd', got {layout!r}")
    rank = q.dim()
    if rank not in (2, 3, 4):
        words = "(B, H, N, d), (H, N, d)" if layout == "bhnd" else "(B, N, H, d), (N, H, d)"
        raise InvalidArgumentError(f"q: expected shape {words} or (N, d), got {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != rank:
            raise InvalidArgumentError(f"{name}: expected {rank} dimensions like q, got shape {tuple(t.shape)}")
    a = _checked_keywords(q, causal, return_lse, window, block_r, block_c, backend, causal_align, scale,
                          dropout_p, seed, offset, softcap, alibi_slopes, split_size)
    tensors = (_to_4d(q, rank, layout), _to_4d(k, rank, layout), _to_4d(v, rank, layout))
    options = (causal, a.left, a.right, causal_align, a.scale, layout, a.block_r, a.block_c, backend)
    if sinks is not None:  # dtype, shape and place: the operator's to check (autocast casts it)
        _check_tensor("sinks", sinks)
    mods = (a.dropout_p, a.seed, a.offset, a.softcap, a.alibi_slopes, a.split, sinks)
    if bias is not None:
        o, lse = _ATTENTION_BIAS(*tensors, _bias_operand(bias), *options, *mods)
    else:
        o, lse = _ATTENTION(*tensors, *options, *mods)
    if rank < 4:
        o = o.reshape(q.shape)
        lse = lse.reshape(lse.shape[4 - rank:])
    return (o, lse) if return_lse else o


def _refuse(name, value, why):
    raise InvalidArgumentError(f"{name}: {why}, got {value!r}")


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics, by pyfa.

    query (..., H, L, E), key and value (..., Hkv, S, E) with the same leading axes
    (or (L, E) and (S, E)); is_causal is top-left aligned (query i sees keys j <= i), as
    in PyTorch; Hkv != H only with enable_gqa=True (H % Hkv == 0). Refused, naming the
    argument: value's head dim differing from key's, and leading axes that would need
    broadcasting. float32 only (under torch.autocast: cast to float32). dropout_p > 0
    applies dropout whenever given, as SDPA does (callers pass 0 outside training), its
    seed drawn from torch's default generator (pyfa.torch.attention, seed=None).
    attn_mask, broadcastable to (..., H, L, S) as in PyTorch (its key axis too): bool
    (True: attend) is the bias 0 / -inf, float32 is added to the scores
    (pyfa.torch.attention's bias=, with its gradient); a query row that attends to no key
    gets 0. Not with is_causal (PyTorch refuses the pair too)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
    bias = None
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask)
        if is_causal:
            raise InvalidArgumentError("attn_mask: given with is_causal=True; PyTorch refuses the pair too "
                                       "(fold the causal mask into attn_mask)")
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=attn_mask.device)
            bias = bias.masked_fill(~attn_mask, -math.inf)
        elif attn_mask.dtype == torch.float32:
            bias = attn_mask
        elif attn_mask.is_floating_point() and torch.is_autocast_enabled(attn_mask.device.type):
            # Under autocast a mask comes in the autocast dtype, like the inputs pyfa casts up.
            bias = attn_mask.float()
        else:
            raise ArgumentTypeError(f"attn_mask: expected dtype torch.bool or torch.float32 (or the autocast "
                                    f"dtype under torch.autocast), got {attn_mask.dtype}")
    drop = dict(dropout_p=dropout_p)
    _check_bool("is_causal", is_causal)
    _check_bool("enable_gqa", enable_gqa)
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise InvalidArgumentError(f"query, key, value: expected the same number (>= 2) of dimensions, "
                                   f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if value.shape[-1] != key.shape[-1]:
        raise InvalidArgumentError(f"value: head dim {value.shape[-1]} differs from key's {key.shape[-1]}; "
                                   f"pyfa needs them equal")
    if value.shape[:-1] != key.shape[:-1]:
        raise InvalidArgumentError(f"value: shape {tuple(value.shape)} differs from key's {tuple(key.shape)} "
                                   f"before the last axis")
    lead = query.shape[:-3] if query.dim() > 3 else ()
    if key.shape[:len(lead)] != lead:
        raise InvalidArgumentError(f"key: leading dimensions {tuple(key.shape[:len(lead)])} differ from "
                                   f"query's {tuple(lead)}; pyfa does not broadcast them")
    if query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        hq, hkv = query.shape[-3], key.shape[-3]
        if not enable_gqa:
            raise InvalidArgumentError(f"key: {hkv} heads differ from query's {hq}; pass enable_gqa=True "
                                       f"for grouped-query attention (as torch's SDPA requires)")
        if hkv == 0 or hq % hkv != 0:
            raise InvalidArgumentError(f"key: its {hkv} heads must divide query's {hq} heads "
                                       f"(enable_gqa=True)")
    if bias is not None:
        scores = tuple(query.shape[:-1]) + (key.shape[-2],)
        try:
            fits = torch.broadcast_shapes(bias.shape, scores) == scores
        except RuntimeError:
            fits = False
        if not fits:
            raise InvalidArgumentError(f"attn_mask: shape {tuple(attn_mask.shape)} does not broadcast to "
                                       f"the scores' {scores} (query's shape, the keys last)")
    if bias is not None and bias.dim() >= 1 and bias.shape[-1] == 1 and key.shape[-2] != 1:
        # One value for every key (PyTorch broadcasts the key axis too; pyfa's bias has it
        # whole): expanded, so that a gradient sums back over it.
        bias = bias.expand(*bias.shape[:-1], key.shape[-2])
    if query.dim() > 4:
        flat = [t.reshape(-1, *t.shape[-3:]) for t in (query, key, value)]
        if bias is not None:
            if bias.dim() > query.dim():
                raise InvalidArgumentError(f"attn_mask: shape {tuple(attn_mask.shape)} has more dimensions than "
                                           f"query")
            bias = bias.reshape((1,) * (query.dim() - bias.dim()) + tuple(bias.shape))
            tail = tuple(bias.shape[-3:])
            bias = (bias.reshape(1, *tail) if all(n == 1 for n in bias.shape[:-3])
                    else bias.expand(*lead, *tail).reshape(-1, *tail))
        o = attention(*flat, causal=is_causal, causal_align="top_left", scale=scale, bias=bias, **drop)
        return o.reshape(*lead, *o.shape[1:])
    return attention(query, key, value, causal=is_causal, causal_align="top_left", scale=scale, bias=bias,
                     **drop)


def _flash_window(window_size):
    """flash-attn's window_size (left, right), -1 unbounded, as pyfa's window."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ArgumentTypeError(f"window_size: expected a pair (left, right), got {window_size!r}")
    sides = []
    for side, x in zip(("left", "right"), window_size):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < -1:
            raise InvalidArgumentError(f"window_size: {side} side must be an int >= 0, or -1 (unbounded), "
                                       f"got {x!r}")
        sides.append(None if x == -1 else int(x))
    return None if sides == [None, None] else tuple(sides)


def _check_flash_extras(softcap, alibi_slopes, deterministic):
    """The score modifications of a flash-attn call as pyfa.torch.attention's keywords."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ArgumentTypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    # pyfa is always deterministic, which satisfies either request.
    _check_bool("deterministic", deterministic)
    return dict(softcap=check_softcap(softcap), alibi_slopes=alibi_slopes)


def _batch_element(mods, b, keep_batch=False):
    """The keywords of _check_flash_extras for batch element b alone: (B, H) slopes give
    their row b ((1, H) with keep_batch, for a 4-D call)."""
    slopes = mods["alibi_slopes"]
    if isinstance(slopes, torch.Tensor) and slopes.dim() == 2:
        slopes = slopes[b:b + 1] if keep_batch else slopes[b]
    return {**mods, "alibi_slopes": slopes}


def _flash_lse(lse):
    # flash-attn's LSE of a row that sees no key is +inf; pyfa's is -inf.
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """flash-attn 2's flash_attn_func by pyfa: q (B, Nq, H, d), k, v (B, Nk, Hkv, d),
    H % Hkv == 0; causal is bottom-right aligned and window_size (left, right) counts
    keys either side of that diagonal, -1 unbounded (causal forces right = 0), as in
    flash-attn. Returns out (B, Nq, H, d); with return_attn_probs=True, the tuple
    (out, softmax_lse, None): softmax_lse (B, H, Nq) float32 (+inf for a row that sees no
    key, flash-attn's convention), and None where flash-attn returns its testing-only
    attention probabilities, which pyfa does not compute. softcap: 0.0 (off) or > 0, and
    alibi_slopes: None or (H,) or (B, H) float32, as in flash-attn (pyfa.torch.attention's).
    deterministic: pyfa always is. dropout_p > 0: dropout, its seed drawn from torch's
    default generator as in pyfa.torch.attention (seed=None); pyfa.dropout_mask gives a
    mask for a seed of one's own."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise InvalidArgumentError(f"{name}: expected shape (B, N, H, d), got {tuple(t.shape)}")
    mods = _check_flash_extras(softcap, alibi_slopes, deterministic)
    _check_bool("return_attn_probs", return_attn_probs)
    o, lse = attention(q, k, v, causal=causal, window=_flash_window(window_size),
                       scale=softmax_scale, layout="bnhd", return_lse=True, dropout_p=dropout_p, **mods)
    return (o, _flash_lse(lse), None) if return_attn_probs else o


def _varlen_keywords(causal, window_left, window_right, causal_align, scale, block_r, block_c,
                     backend, softcap=None, alibi_slopes=None, split_size=0, dropout_p=0.0, seed=0,
                     offset=0):
    kw = _keywords(causal, window_left, window_right, causal_align, scale, "bnhd", block_r,
                   block_c, backend, dropout_p, seed, offset, softcap=softcap, alibi_slopes=alibi_slopes,
                   split_size=split_size)
    del kw["layout"]
    return kw


def _run_varlen(op_name, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kw):
    """pyfa.varlen.run with the flat keywords of _varlen_keywords (the score modifications
    travel as its mods)."""
    kw = dict(kw)
    mods = {name: kw.pop(name) for name in ("softcap", "alibi_slopes", "bias", "dropout_p", "seed", "offset")
            if name in kw}
    return varlen.run(op_name, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, function="pyfa.torch.attention_varlen", mods=mods, **kw)


@_custom_op("pyfa::fa2_varlen_forward")
def _fa2_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                        window_left: Optional[int], window_right: Optional[int], causal_align: str,
                        scale: Optional[float], block_r: Optional[int], block_c: Optional[int],
                        backend: str, softcap: Optional[float] = None,
                        alibi_slopes: Optional[Tensor] = None, split_size: int = 0,
                        dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                        bias: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Packed sequences (pyfa.attention_varlen): q (total_q, H, d), k, v (total_k, Hkv, d),
    int32 offsets, bias None or broadcastable to (B, H, max_seqlen_q, max_seqlen_k);
    returns o like q and lse (H, total_q); with sinks ((H,), on q's device), those of
    attention with sinks (pyfa.attention_varlen's)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_dtype(name, t)
    kw = _varlen_keywords(causal, window_left, window_right, causal_align, scale, block_r, block_c,
                          backend, softcap, alibi_slopes, split_size, dropout_p, seed, offset)
    if bias is not None:
        kw["bias"] = bias.detach()
    with _on_device_of(q):
        if q.is_cuda and (q.numel() == 0 or k.numel() == 0):
            _check_options(q, {**kw, "layout": "bnhd"})
            o, lse = q.new_zeros(q.shape), q.new_full((q.shape[1], q.shape[0]), -math.inf)
            # The packed rows are one "bnhd" batch to the merge, as in pyfa.attention_varlen.
            o, lse = _with_sinks(o[None], lse[None], sinks, "bnhd")
            return o[0], lse[0]
        if sinks is not None:
            _check_dtype("sinks", sinks)
            kw["sinks"] = api._sinks_keyword("pyfa.torch.attention_varlen", {"sinks": _operand(sinks)}, "fa2",
                                             _operand(q), "bnhd")
        return _run_varlen("fa2_forward", dict(q=q.detach(), k=k.detach(), v=v.detach()), cu_seqlens_q,
                           cu_seqlens_k, max_seqlen_q, max_seqlen_k, kw)


@_fa2_varlen_forward.register_fake
def _fa2_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_dtype(name, t)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]))


@_custom_op("pyfa::fa2_varlen_backward")
def _fa2_varlen_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                         cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, causal: bool, window_left: Optional[int],
                         window_right: Optional[int], causal_align: str, scale: Optional[float],
                         block_r: Optional[int], block_c: Optional[int],
                         backend: str, softcap: Optional[float] = None,
                         alibi_slopes: Optional[Tensor] = None, split_size: int = 0,
                         dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                         bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """FA2's backward of fa2_varlen_forward: dq, dk, dv like q, k, v, and dbias of the
    bias's shape (an empty tensor without a bias)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("do", do)):
        _check_dtype(name, t)
    kw = _varlen_keywords(causal, window_left, window_right, causal_align, scale, block_r, block_c,
                          backend, softcap, alibi_slopes, split_size, dropout_p, seed, offset)
    if bias is not None:
        kw["bias"] = bias.detach()
    no_dbias = q.new_empty(0)
    with _on_device_of(q):
        if q.is_cuda and (q.numel() == 0 or k.numel() == 0):
            _check_options(q, {**kw, "layout": "bnhd"})
            return (q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape),
                    no_dbias if bias is None else bias.new_zeros(bias.shape))
        grads = _run_varlen("fa2_backward", dict(q=q.detach(), k=k.detach(), v=v.detach(), o=o.detach(),
                                                 lse=lse.detach(), do=do.detach().contiguous()),
                            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kw)
        return tuple(grads) if bias is not None else (*grads, no_dbias)


@_fa2_varlen_backward.register_fake
def _fa2_varlen_backward_fake(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, window_left, window_right, causal_align, scale, block_r, block_c,
                              backend, softcap=None, alibi_slopes=None, split_size=0, dropout_p=0.0,
                              seed=0, offset=0, bias=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0) if bias is None else bias.new_empty(bias.shape))


# fa2_varlen_forward's arguments after the offsets, in schema order (the bias last; then the
# sinks, which the backward does not take).
_VARLEN_OPTION_NAMES = ("max_seqlen_q", "max_seqlen_k", "causal", "window_left", "window_right",
                        "causal_align", "scale", "block_r", "block_c", "backend", "softcap",
                        "alibi_slopes", "split_size", "dropout_p", "seed", "offset", "bias")


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *options = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output, options[-1])  # the sinks last, as _forward_setup
    ctx.options = options[:-1]
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, do, dlse):
    q, k, v, cu_q, cu_k, o, lse, sinks = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dbias = _call_op("pyfa::fa2_varlen_backward", q, k, v, o, lse, do, cu_q, cu_k, *ctx.options)
    if dlse is not None:
        # As _lse_gradient (the same steps, so each sequence's bits are the dense call's):
        # FA2's backward with V = 0, O = e_0 and dO = -dlse e_0, whose dS is P dlse, and P
        # undropped.
        dlse = torch.where(torch.isinf(lse), torch.zeros_like(dlse), dlse)
        o_unit, do_lse = torch.zeros_like(q), torch.zeros_like(q)
        o_unit[..., 0] = 1
        do_lse[..., 0] = -dlse.transpose(0, 1)
        undropped = _undropped(_VARLEN_OPTION_NAMES, ctx.options)
        lq, lk, _, lb = _call_op("pyfa::fa2_varlen_backward", q, k, torch.zeros_like(v), o_unit, lse,
                                 do_lse, cu_q, cu_k, *undropped)
        dq, dk, dbias = dq + lq, dk + lk, dbias + lb
    # The bias is the last option (fa2_varlen_forward's schema), found from the front: the
    # dispatcher leaves trailing arguments at their defaults (no sinks) out of needs_input_grad.
    bias_grad = dbias if ctx.options[-1] is not None and ctx.needs_input_grad[4 + len(ctx.options)] else None
    dsinks = _sinks_gradient(ctx, o[None], lse[None], do[None], None if dlse is None else dlse[None], sinks,
                             "bnhd")
    return (dq, dk, dv) + (None,) * (1 + len(ctx.options)) + (bias_grad, dsinks)


torch.library.register_autograd("pyfa::fa2_varlen_forward", _varlen_backward, setup_context=_varlen_setup)
torch.library.register_autograd("pyfa::fa2_varlen_backward", _no_double_backward_bias,
                                setup_context=_backward_setup)
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("pyfa::fa2_varlen_forward", _device, torch.float32)
    torch.library.register_autocast("pyfa::fa2_varlen_backward", _device, torch.float32)
del _device
_ATTENTION_VARLEN = _differentiable("pyfa::fa2_varlen_forward", _varlen_setup, _varlen_backward)


def _check_offsets(name, cu):
    _check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise ArgumentTypeError(f"{name}: expected dtype torch.int32 (flash-attn's cu_seqlens), got {cu.dtype}")


def _longest(name, cu, given):
    """max_seqlen: given, or the longest length of the offsets cu (read on the host)."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, numbers.Integral):
            raise ArgumentTypeError(f"{name}: expected an int or None, got {type(given).__name__}")
        return int(given)
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     causal: bool = False, window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                     causal_align: str = "bottom_right", scale: Optional[float] = None,
                     return_lse: bool = False, block_r: Optional[int] = None,
                     block_c: Optional[int] = None, backend: str = "auto",
                     softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                     split_size: Optional[int] = None, bias: Optional[Tensor] = None,
                     dropout_p: float = 0.0, seed: Optional[int] = None, offset: int = 0,
                     sinks: Optional[Tensor] = None):
    """Attention over packed sequences by FA2's varlen kernels (pyfa.attention_varlen),
    differentiable: q (total_q, H, d), k, v (total_k, Hkv, d) float32, cu_seqlens_q,
    cu_seqlens_k int32 (B + 1,) offsets on q's device. max_seqlen_q, max_seqlen_k: the
    longest lengths (None: computed, which reads the offsets on the host). Masks apply
    per sequence (bottom-right: off = Nk_b - Nq_b). Returns o (total_q, H, d), or (o, lse)
    with return_lse, lse (H, total_q) and differentiable; row r's bits are those of
    pyfa.torch.attention on its own sequence alone (with dropout: as batch element b),
    gradients included. softcap and alibi_slopes ((H,) or (B, H), B the sequences) as in
    pyfa.torch.attention. dropout_p, seed, offset: as in pyfa.torch.attention (seed=None
    draws one from torch's default generator), sequence b dropping as batch element b of
    a dense call, its own rows and keys numbered from 0 (pyfa.attention_varlen's). bias:
    a float32 tensor
    broadcastable to (B, H, max_seqlen_q, max_seqlen_k) on the CPU, sequence b adding the
    corner of its own lengths (pyfa.attention_varlen's bias=); it gets a gradient when it
    requires one (+0 beyond each corner). split_size: as in pyfa.torch.attention, the
    split forward and backward per sequence, so that each row keeps the bits of its
    sequence's split call alone, the bias's gradient included. sinks: as in
    pyfa.torch.attention (float32 (H,), CPU, differentiable), each row merged with its
    head's sink as in its sequence's call alone; their gradient sums the packed rows in
    order (pyfa.attention_varlen_grad's dsinks)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() != 3:
            raise InvalidArgumentError(f"{name}: expected a packed tensor (total, heads, d), got shape "
                                       f"{tuple(t.shape)}")
    _check_offsets("cu_seqlens_q", cu_seqlens_q)
    _check_offsets("cu_seqlens_k", cu_seqlens_k)
    a = _checked_keywords(q, causal, return_lse, window, block_r, block_c, backend, causal_align, scale,
                          dropout_p, seed, offset, softcap, alibi_slopes, split_size)
    if sinks is not None:  # dtype, shape and place: the operator's to check, as in attention
        _check_tensor("sinks", sinks)
    max_q = _longest("max_seqlen_q", cu_seqlens_q, max_seqlen_q)
    max_k = _longest("max_seqlen_k", cu_seqlens_k, max_seqlen_k)
    o, lse = _ATTENTION_VARLEN(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal,
                               a.left, a.right, causal_align, a.scale, a.block_r, a.block_c,
                               backend, a.softcap, a.alibi_slopes, a.split, a.dropout_p, a.seed,
                               a.offset, None if bias is None else _bias_operand(bias), sinks)
    return (o, lse) if return_lse else o


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Optional[Tensor] = None, *, s_aux: Optional[Tensor] = None):
    """flash-attn 2's flash_attn_varlen_func by pyfa's varlen kernels (attention_varlen): q
    (total_q, H, d), k, v (total_k, Hkv, d), sequence b being rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
    and v (int32 offsets); masks as in flash_attn_func, per sequence; max_seqlen_q,
    max_seqlen_k at least the longest lengths (checked where the offsets are on the CPU).
    Returns out (total_q, H, d); with return_attn_probs=True, (out, softmax_lse, None),
    softmax_lse (H, total_q) as in flash_attn_func. dropout_p > 0: dropout as in
    flash_attn_func, its seed drawn from torch's default generator. Refused: as
    flash_attn_func.

    block_table (int32 (B, max_pages), as in flash-attn): k, v are then pages
    (num_pages, page_size, Hkv, d), any page size, sequence b's keys the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] logical rows of its table row
    (pyfa.attention_varlen's block_table): CPU tensors, forward only (no gradient, as in
    flash-attn's paged path; refused where one would be recorded), without dropout.

    s_aux (keyword only; vLLM's flash-attn fork's name): gpt-oss's attention sinks,
    attention_varlen's sinks, float32 (H,) on the CPU (a refusal may call them sinks)."""
    paged = block_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        pages = paged and name != "q"
        if t.dim() != (4 if pages else 3):
            want = "(num_pages, page_size, Hkv, d) (block_table given)" if pages else "(total, H, d)"
            raise InvalidArgumentError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    mods = _check_flash_extras(softcap, alibi_slopes, deterministic)
    _check_bool("return_attn_probs", return_attn_probs)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, numbers.Integral):
            raise ArgumentTypeError(f"{name}: expected an int, got {type(m).__name__}")
    if paged:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                             dropout_p, softmax_scale, causal, _flash_window(window_size), mods,
                             return_attn_probs, s_aux)
    o, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                              max_seqlen_k=max_seqlen_k, causal=causal, window=_flash_window(window_size),
                              scale=softmax_scale, return_lse=True, softcap=mods["softcap"],
                              alibi_slopes=mods["alibi_slopes"], dropout_p=dropout_p, sinks=s_aux)
    return (o, _flash_lse(lse), None) if return_attn_probs else o


def _host_views(named, what):
    """NumPy views of the CPU tensors `named` ({name: tensor or None}) for the NumPy entry
    points behind `what`, which take no CUDA tensors yet."""
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise InvalidArgumentError(f"{name}: {what} is pyfa's on CPU tensors only in this version, got one on "
                                       f"{t.device}")
        if t.dtype not in (torch.float32, torch.int32, torch.int64, torch.bool):  # NumPy has no bfloat16
            raise ArgumentTypeError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    return {name: (t.detach().numpy() if t is not None else None) for name, t in named.items()}


def _host_mods(mods):
    """The score modifications of _check_flash_extras as NumPy keywords (None left out)."""
    return {name: (x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x)
            for name, x in mods.items() if x is not None}


def _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, dropout_p,
                  scale, causal, window, mods, return_probs, s_aux):
    """flash_attn_varlen_func with a block_table: pyfa.attention_varlen on NumPy views of the
    CPU tensors (the pages read in place)."""
    from .varlen import attention_varlen as varlen_numpy

    arrays = _host_views(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              block_table=block_table, s_aux=s_aux), "flash_attn_varlen_func with a block_table")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise InvalidArgumentError("block_table: paged K/V has no backward in pyfa (nor in flash-attn); call under "
                                   "torch.no_grad() or on tensors that do not require grad")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        _refuse("dropout_p", dropout_p, "not taken with block_table (paged K/V is the inference path); 0 only")
    extras = _host_mods(mods)
    o, lse = varlen_numpy(arrays["q"], arrays["k"], arrays["v"], arrays["cu_seqlens_q"], arrays["cu_seqlens_k"],
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, window=window,
                          scale=scale, return_lse=True, block_table=arrays["block_table"], sinks=arrays["s_aux"],
                          **extras)
    o, lse = (torch.from_numpy(np.ascontiguousarray(x)) for x in (o, lse))
    return (o, _flash_lse(lse), None) if return_probs else o


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None, cache_seqlens=None,
                            cache_batch_idx: Optional[Tensor] = None,
                            cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False, *,
                            s_aux: Optional[Tensor] = None):
    """flash-attn 2's flash_attn_with_kvcache by pyfa, for a dense cache read as it is:
    q (B, Nq, H, d), k_cache, v_cache (B, Ncache, Hkv, d); batch element b attends to the
    first cache_seqlens[b] keys (cache_seqlens: None = all Ncache, an int, or an int
    tensor (B,)), the masks, softcap and alibi_slopes as in flash_attn_func (bottom-right,
    so the queries are the last Nq positions). Returns out (B, Nq, H, d), or (out, softmax_lse (B, H, Nq)) with
    return_softmax_lse=True.

    k, v (B, Nnew, Hkv, d) new keys and values, and block_table (int32 (B, max_pages), the
    caches then (num_pages, page_size, Hkv, d), any page size): pyfa.attention_with_kvcache
    on CPU tensors, k and v written into the caller's caches at cache_seqlens in place
    before attending (cache_seqlens then an int32 tensor (B,) or an int); no gradient, as in
    flash-attn. rotary_cos, rotary_sin (float32 (S_ro, rotary_dim / 2), CPU, with k and v):
    flash-attn's rotary embedding of q and k before the append (rotary_interleaved as
    there), pyfa.attention_with_kvcache's; cache_batch_idx (int32 (B,), CPU, a dense cache):
    sequence b reads (and appends to) the cache's batch element cache_batch_idx[b], distinct
    where k and v are given; cache_leftpad (int32 (B,), CPU): sequence b's cache starts at
    that row. Refused, naming the argument (pyfa has no kernel for them yet): num_splits > 1
    (pyfa's split is a fixed size, pyfa.attention_with_kvcache's split_size, never a count;
    0 and 1 are honoured), and k, v, block_table, the rotary tables, cache_batch_idx or
    cache_leftpad on CUDA tensors. s_aux (keyword only; vLLM's flash-attn fork's name):
    gpt-oss's attention sinks, float32 (H,) on the CPU, as pyfa.torch.attention's sinks (a
    refusal may call them sinks), checked before k and v are written."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise InvalidArgumentError(f"{name}: expected shape (B, N, H, d), got {tuple(t.shape)}")
    mods = _check_flash_extras(softcap, alibi_slopes, False)
    _check_bool("rotary_interleaved", rotary_interleaved)
    _check_bool("return_softmax_lse", return_softmax_lse)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise InvalidArgumentError(f"num_splits: expected an int >= 0, got {num_splits!r}")
    if num_splits > 1:
        _refuse("num_splits", num_splits, "pyfa splits the keys by a fixed size, never by a count "
                "(pyfa.attention_with_kvcache(split_size=...)); 0 or 1 only")
    window = _flash_window(window_size)
    if k is not None or v is not None or block_table is not None or rotary_cos is not None or \
            rotary_sin is not None or cache_batch_idx is not None or cache_leftpad is not None:
        return _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale,
                             causal, window, mods, return_softmax_lse, s_aux,
                             (rotary_cos, rotary_sin, rotary_interleaved), cache_batch_idx, cache_leftpad)
    B, ncache = q.shape[0], k_cache.shape[1]
    if cache_seqlens is None:
        lengths = [ncache] * B
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lengths = [int(cache_seqlens)] * B
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.shape == (B,) \
            and not cache_seqlens.is_floating_point():
        lengths = cache_seqlens.tolist()
    else:
        raise InvalidArgumentError(f"cache_seqlens: expected None, an int or an int tensor ({B},), got "
                                   f"{cache_seqlens!r}")
    if any(not 0 <= n <= ncache for n in lengths):
        raise InvalidArgumentError(f"cache_seqlens: each length must be in [0, {ncache}] (the cache's "
                                   f"length), got {lengths}")
    kw = dict(causal=causal, window=window, scale=softmax_scale, layout="bnhd", return_lse=True, sinks=s_aux,
              **mods)
    if len(set(lengths)) <= 1:
        n = lengths[0] if lengths else ncache
        o, lse = attention(q, k_cache[:, :n], v_cache[:, :n], **kw)
    elif all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad
             for t in (q, k_cache, v_cache)) and not any(
                 isinstance(x, torch.Tensor) and x.requires_grad for x in (*mods.values(), s_aux)):
        # One packed call for the batch, the caches read in place (each row's bits those of
        # its own sequence's call: docs/numerics.md, "Packed sequences").
        return _with_kvcache(q, k_cache, v_cache, None, None, torch.tensor(lengths, dtype=torch.int32), None,
                             softmax_scale, causal, window, mods, return_softmax_lse, s_aux)
    else:
        slopes = mods.get("alibi_slopes")
        if isinstance(slopes, torch.Tensor) and slopes.dim() == 2 and slopes.shape[0] != q.shape[0]:
            raise InvalidArgumentError(f"alibi_slopes: expected shape ({q.shape[2]},) or ({q.shape[0]}, "
                                       f"{q.shape[2]}), got {tuple(slopes.shape)}")
        parts = [attention(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                           **{**kw, **_batch_element(mods, b, keep_batch=True)})
                 for b, n in enumerate(lengths)]
        o, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return (o, _flash_lse(lse)) if return_softmax_lse else o


def _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal, window, mods,
                  return_lse, s_aux, rotary=(None, None, True), cache_batch_idx=None, cache_leftpad=None):
    """flash_attn_with_kvcache's appending, paged, rotary, batch-indexed or left-padded call:
    pyfa.attention_with_kvcache on NumPy views of the CPU tensors, so the caches are
    updated in place; rotary: (cos, sin, interleaved)."""
    from .kvcache import attention_with_kvcache

    cos, sin, interleaved = rotary
    arrays = _host_views(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table,
                              s_aux=s_aux, rotary_cos=cos, rotary_sin=sin, cache_batch_idx=cache_batch_idx,
                              cache_leftpad=cache_leftpad),
                         "appending to the cache, a block_table, cache_batch_idx, cache_leftpad or the rotary "
                         "embedding")
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.full(q.shape[0], int(cache_seqlens), np.int32)
    elif isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = cache_seqlens.numpy()
    elif cache_seqlens is None:
        if k is not None or v is not None or block_table is not None:
            raise InvalidArgumentError("cache_seqlens: required with k, v or block_table (where the keys end)")
        cache_seqlens = np.full(q.shape[0], k_cache.shape[1], np.int32)  # the whole of each cache
    mods = _host_mods(mods)
    out = attention_with_kvcache(arrays["q"], arrays["k_cache"], arrays["v_cache"], cache_seqlens,
                                 arrays["k"], arrays["v"], block_table=arrays["block_table"], causal=causal,
                                 window=window, scale=scale, return_lse=True, sinks=arrays["s_aux"],
                                 rotary_cos=arrays["rotary_cos"], rotary_sin=arrays["rotary_sin"],
                                 rotary_interleaved=interleaved, cache_batch_idx=arrays["cache_batch_idx"],
                                 cache_leftpad=arrays["cache_leftpad"], **mods)
    o, lse = (torch.from_numpy(np.ascontiguousarray(x)) for x in out)
    return (o, _flash_lse(lse)) if return_lse else o


# Context parallelism (docs/context_parallel.md): its own module, beside these operators.
from .context_parallel import context_parallel_attention  # noqa: E402
