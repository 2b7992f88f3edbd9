"""pyfa's Python API: argument checks, then one call into libpyfa.

Tensors come from any library: NumPy arrays, and any array with __dlpack__ or
__cuda_array_interface__ (pyfa/_arrays.py). CPU arrays of any strides are accepted and go
to the host entry points: those whose last axis is contiguous (a transposed (B, N, H, d)
array, q, k, v as views into one packed array, ...) in place with their strides, others
copied to C-contiguous float32 first. CUDA arrays go to the *_device entry points on the
producer's stream. Inputs are never written; outputs are fresh arrays of q's kind in the
layout asked for, or the out= arrays given.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _arrays, _lib, prepared
from ._arrays import Array, ArrayLike
from .checks import (
    EMPTY_VALUES, MAX_HEAD_DIM, SCORE_MOD_KEYWORDS, Bias, ScoreMods, as_4d, c_aligned, caller_shape,
    check_dropout_mask, check_int, check_layout, check_like,
    check_qkv, check_split_size,
    check_rows, check_sizes, element_strides, is_empty, mask_bounds, refuse_self_overlap, resolve_scale,
)
from .errors import ArgumentTypeError, BackendUnavailableError, InvalidArgumentError
from .options import Options, Progress  # noqa: F401 (Progress: the callback's type)
from .options import FIELDS as OPTION_FIELDS
from .options import resolve as resolve_options


class HeaderEnum(Mapping):
    """{name: value} of one enum of pyfa.h, read from the header (pyfa/_lib.py
    header_ffi) on first use: the values live in pyfa.h alone. Names are the enumerators'
    lower-cased, without their common prefix (PYFA_BACKEND_CPU is "cpu"); `order`, when
    given, lists every name in the order iteration gives them."""

    def __init__(self, enum, prefix, order=None):
        self.enum, self.prefix, self.order = enum, prefix, order
        self._checked = None  # the values, once read and checked (the header is parsed once)

    def _values(self):
        if self._checked is not None:
            return self._checked
        values = _lib.enum_values(self.enum, self.prefix)
        if self.order is not None and sorted(self.order) != sorted(values):
            raise _lib.LibraryNotFoundError(
                f"pyfa.h's enum {self.enum} has {sorted(values)}, but this pyfa package "
                f"knows {sorted(self.order)}")
        self._checked = values
        return values

    def __getitem__(self, name):
        return self._values()[name]

    def __iter__(self):
        return iter(self.order if self.order is not None else self._values())

    def __len__(self):
        return len(self._values())

    def __repr__(self):
        return f"HeaderEnum({self.enum}: {dict(self)})"


# pyfa_backend; "auto" first, then the others best first (backends() keeps this order).
BACKENDS = HeaderEnum("pyfa_backend", "PYFA_BACKEND_", order=("auto", "cuda", "cpu", "emu"))
EMU_ORDERS = HeaderEnum("pyfa_emu_order", "PYFA_EMU_ORDER_")
KERNELS = HeaderEnum("pyfa_kernel", "PYFA_KERNEL_")
CAUSAL_ALIGNS = HeaderEnum("pyfa_causal_align", "PYFA_ALIGN_")
# pyfa_variant: "fast" runs the register-tiled kernels (an error where they do not
# apply), "reference" the readable ones, "auto" fast where it applies.
VARIANTS = HeaderEnum("pyfa_variant", "PYFA_VARIANT_")

INT_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# Every tensor of the C ABI by the name the Python API and errors use (pyfa.h spells dO
# "dout", `do` being a C keyword), with the kind of its shape: "query" (B, H, Nq, d),
# "key" (B, Hkv, Nk, d) or "row" (B, H, Nq), one float per query row.
TENSOR_KINDS = {"q": "query", "k": "key", "v": "key", "o": "query", "do": "query",
                "lse": "row", "m": "row", "l": "row", "dq": "query", "dk": "key", "dv": "key"}
# The pyfa_tensors field of each tensor (pyfa.h), and the pyfa_problem field holding each
# 4-D tensor's strides: its name, but for "do".
C_FIELDS = {n: "dout" if n == "do" else n for n in TENSOR_KINDS}
STRIDE_FIELDS = {n: C_FIELDS[n] for n, kind in TENSOR_KINDS.items() if kind != "row"}


def tensor_shape(name, batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv=None):
    """The (B, heads, N, d) or (B, H, Nq) shape of tensor `name` (a TENSOR_KINDS key) in a
    problem of these sizes; heads_kv None means heads."""
    kind = TENSOR_KINDS[name]
    if kind == "row":
        return (batch, heads, seqlen_q)
    if kind == "query":
        return (batch, heads, seqlen_q, head_dim)
    return (batch, heads if heads_kv is None else heads_kv, seqlen_k, head_dim)


@dataclass(frozen=True)
class Op:
    """One operation of the C ABI, as the API, the tools and the tests call it.

    c_function takes (problem, config, *inputs, *outputs) as host pointers; its twin
    device_function takes device pointers and then a stream (pyfa.h). Both are named
    after the op, the one place that ties an op to its C entry points."""
    name: str        # "fa2_forward": also the name of the Python function
    algo: str        # "fa1" or "fa2"
    pass_: str       # "forward" or "backward"
    inputs: tuple    # TENSOR_KINDS names, in C argument order
    outputs: tuple   # TENSOR_KINDS names, in C argument order, after the inputs
    kernels: tuple   # KERNELS names, in launch order

    @property
    def c_op(self):
        """Its pyfa_op, what pyfa_run takes."""
        return _lib.constant("PYFA_OP_" + self.name.upper())

    @property
    def c_function(self):
        return "pyfa_" + self.name

    @property
    def device_function(self):
        return self.c_function + "_device"

    def output_shapes(self, batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv=None):
        return {t: tensor_shape(t, batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv)
                for t in self.outputs}


OPS = {op.name: op for op in (
    Op("fa2_forward", "fa2", "forward",
       ("q", "k", "v"), ("o", "lse"), ("fa2_forward",)),
    Op("fa2_backward", "fa2", "backward",
       ("q", "k", "v", "o", "lse", "do"), ("dq", "dk", "dv"),
       ("fa2_backward_preprocess", "fa2_backward_dkdv", "fa2_backward_dq")),
    Op("fa1_forward", "fa1", "forward",
       ("q", "k", "v"), ("o", "m", "l"), ("fa1_forward",)),
    Op("fa1_backward", "fa1", "backward",
       ("q", "k", "v", "o", "m", "l", "do"), ("dq", "dk", "dv"), ("fa1_backward",)),
)}


def _choice(name, value, table):
    if not isinstance(value, str) or value not in table:
        raise InvalidArgumentError(f"{name}: expected one of {sorted(table)}, got {value!r}")
    return table[value]


_auto_checked = False


def _warn_if_auto_falls_back(lib):
    """Once per process: backend="auto" on a library built with CUDA that cannot use it
    here runs far slower on the CPU; say so, and why."""
    global _auto_checked
    if _auto_checked:
        return
    _auto_checked = True
    cuda = BACKENDS["cuda"]
    if lib.pyfa_backend_compiled(cuda) and not lib.pyfa_backend_available(cuda):
        warnings.warn(f"pyfa: backend='auto' falls back to the CPU: this libpyfa has a CUDA "
                      f"backend, but it cannot run here ({_reason(lib, cuda)})",
                      RuntimeWarning, stacklevel=5)


def _reason(lib, backend):
    ffi, _ = _lib.load()
    return ffi.string(lib.pyfa_backend_reason(backend)).decode("utf-8", "replace")


def _config(options):
    """The pyfa_config of an Options (pyfa/options.py), its names checked against pyfa.h."""
    ffi, lib = _lib.load()
    cfg = ffi.new("pyfa_config *")
    cfg.struct_size = ffi.sizeof("pyfa_config")  # this layout, flags included
    cfg.variant = _choice("variant", options.variant, VARIANTS)
    cfg.backend = _choice("backend", options.backend, BACKENDS)
    if options.backend == "auto":
        _warn_if_auto_falls_back(lib)
    cfg.block_r = options.block_r or 0
    cfg.block_c = options.block_c or 0
    cfg.emu_order = _choice("emu_order", options.emu_order, EMU_ORDERS)
    cfg.emu_seed = options.emu_seed
    cfg.emu_workers = options.emu_workers
    cfg.threads = options.threads
    if options.emu_check == "strict":
        cfg.flags |= lib.PYFA_FLAG_EMU_STRICT
    return cfg


# ScoreMods' fields, read on every call: dataclasses.fields builds its tuple each time.
_MOD_FIELDS = tuple(f.name for f in dataclasses.fields(ScoreMods))
# (ScoreMods field, pyfa_problem field) of the scalar modifications the problem carries.
_PROBLEM_MOD_FIELDS = tuple((f.name, f.metadata.get("problem", f.name)) for f in dataclasses.fields(ScoreMods)
                            if f.metadata.get("pyfa_problem", True))


def _problem(dims, scale, causal, window, causal_align, mods):
    """The pyfa_problem (struct_size: this header's layout, the score modifications'
    fields included; the packed sequences' fields are set by pyfa.varlen.Varlen.apply) of sizes
    dims = (B, H, Nq, Nk, d, Hkv), the mask arguments, checked as the simulator checks
    them, and the score modifications (a checks.ScoreMods: each scalar field copied to
    the pyfa_problem field of its name); the strides are set by the caller. A window side wider than Nq + Nk is passed
    as Nq + Nk (checks.mask_bounds: the same mask), so any int fits int64_t."""
    ffi, _ = _lib.load()
    bounds = mask_bounds(causal, window, causal_align, dims[2], dims[3], mods.diagonal_offset)
    pr = ffi.new("pyfa_problem *")
    pr.struct_size = ffi.sizeof("pyfa_problem")
    pr.batch, pr.heads, pr.seqlen_q, pr.seqlen_k, pr.head_dim, pr.heads_kv = dims
    pr.scale = float(resolve_scale(scale, dims[4]))
    pr.causal = 1 if causal else 0
    if window is not None:
        left, right = window
        pr.window = 1
        pr.window_left = -1 if left is None else bounds.left
        pr.window_right = -1 if right is None else bounds.right
    pr.causal_align = CAUSAL_ALIGNS[causal_align]
    for name, field in _PROBLEM_MOD_FIELDS:
        value = getattr(mods, name)
        if isinstance(value, (int, float, tuple)):
            setattr(pr, field, list(value) if isinstance(value, tuple) else value)
    return pr


def _set_mod_tensors(tensors, problem, mod_tensors):
    """The score modifications' arrays (_mod_tensors) into the pyfa_tensors fields of their
    names; their element strides go where the ABI keeps them: pyfa_problem's
    <name>_strides where it has one (bias), else the tensor's own (alibi_slopes)."""
    if not mod_tensors:
        return
    ffi, _ = _lib.load()
    in_problem = dict(ffi.typeof("pyfa_problem").fields)
    for name, (address, strides) in mod_tensors.items():
        field = getattr(tensors, name)
        field.data = ffi.cast("void *", address)
        st = getattr(problem, name + "_strides") if name + "_strides" in in_problem else field.strides
        st.batch, st.head, st.row = strides


def _check_mods_place(mods, intake):
    """A modification's array lives where q does: pyfa reads it on the CPU only, for now."""
    for name in _MOD_FIELDS:
        value = getattr(mods, name)
        if not isinstance(value, Bias):
            continue
        if intake.place.kind != "cpu":
            raise InvalidArgumentError(f"{name}: pyfa's Python API takes a bias with CPU arrays "
                                       f"only (q is on {intake.place}); the C ABI takes device pointers")
        if value.view is None:
            raise InvalidArgumentError(f"{name}: on another device than q (the CPU)")


def _set_strides(problem, strides):
    """strides: {tensor name: (batch, head, row) element strides, or None for dense}."""
    for name, st in strides.items():
        if st is not None and name in STRIDE_FIELDS:
            s = getattr(problem, STRIDE_FIELDS[name])
            s.batch, s.head, s.row = st


def _strides(x4):
    """The (batch, head, row) element strides the library takes for the (B, heads, N, d)
    NumPy view x4, or None when it cannot address x4 in place. An axis of length 1 gets
    its dense stride (any value would do), so that all three are 0 only for a tensor
    broadcast along every axis, which pyfa.h would read as dense: that one is copied."""
    strides = element_strides(x4)
    if strides is None:
        return None
    B, H, N, d = x4.shape
    strides = tuple(dense if n == 1 else s
                    for n, s, dense in zip((B, H, N), strides, (H * N * d, N * d, d)))
    return None if strides == (0, 0, 0) else strides


def _in_place(x):
    """A checked CPU view as the library can address it (x itself when it can, else a
    C-contiguous copy) and its strides (None for a per-row tensor, always dense)."""
    if x.ndim == 3:
        return c_aligned(x), None
    strides = _strides(x)
    if strides is None:
        x = c_aligned(x)
        strides = _strides(x)
    return x, strides


def _device_strides(t, shape4, rank, layout):
    """The (batch, head, row) element strides of the CUDA array t (the caller's rank and
    layout) seen as the (B, heads, N, d) tensor of shape4. As for CPU views (_strides), an
    axis of length 1 gets its dense stride, so only a tensor broadcast along every axis
    would read as all zeros (dense): that one is refused."""
    if t.strides is None:
        return _layout_strides(shape4, rank, layout)
    caller = (0,) * (4 - rank) + tuple(t.strides)
    b, first, second = caller[:3]
    h, n = (second, first) if layout == "bnhd" and rank > 2 else (first, second)
    B, H, N, d = shape4
    strides = tuple(dense if size == 1 else s
                    for size, s, dense in zip((B, H, N), (b, h, n), (H * N * d, N * d, d)))
    if strides == (0, 0, 0):
        raise InvalidArgumentError(f"{t.name}: broadcast along every axis; pass a materialised array")
    return strides


def _layout_strides(shape4, rank, layout):
    """The strides of a C-contiguous array in the caller's layout, seen as the (B, H, N, d)
    tensor of shape4: None (dense) unless it is (B, N, H, d)."""
    if layout == "bhnd" or rank == 2:
        return None
    B, H, N, d = shape4
    return (N * H * d, d, H * d)


def _tensors(memory, pointers, varlen=None):
    """The pyfa_tensors of a pyfa_run call: `memory` a pyfa_memory name, `pointers`
    {tensor name: address (an int or a cffi pointer)}; strides travel in pyfa_problem.
    Every call goes through pyfa_run, so an op's new tensor is a field here, not an
    argument of a new entry point. varlen: a pyfa.varlen.Varlen, whose offsets are two
    more (its pointers name their pyfa_tensors fields); the score modifications' arrays
    follow (_set_mod_tensors)."""
    ffi, _ = _lib.load()
    t = ffi.new("pyfa_tensors *")
    t.struct_size = ffi.sizeof("pyfa_tensors")
    t.memory = _lib.constant(memory)
    for name, address in pointers.items():
        getattr(t, C_FIELDS[name]).data = ffi.cast("void *", address)
    for field, address in (varlen.pointers.items() if varlen is not None else ()):
        getattr(t, field).data = ffi.cast("void *", address)
    return t


def _mod_tensors(mods, intake, grad=False):
    """The score modifications' arrays (a checks.ScoreMods field holding one goes to the
    pyfa_tensors field of its name) as {field: (address, (batch, head, row) element
    strides)}, with {field: the object that keeps it alive}. Each is a (B, H[, Nq, Nk]) view,
    a broadcast axis of stride 0, its last axis contiguous. On the CPU they are the NumPy
    views ScoreMods checked; for CUDA arrays they must be on q's device (refused, naming
    the field, otherwise: pyfa does not copy them over). A checks.Bias gives its view,
    as a backward that writes dbias takes it when `grad` (checks.Bias.for_grad)."""
    ffi, _ = _lib.load()
    found, keep = {}, {}
    for name in _MOD_FIELDS:
        x = getattr(mods, name)
        if x is None or isinstance(x, (bool, int, float, str, tuple)):
            continue
        if isinstance(x, Bias):  # on the CPU (_check_mods_place)
            view = x.for_grad() if grad else x.view
            keep[name] = view
            found[name] = (_address(ffi, view), element_strides(view))
            continue
        on_cpu = isinstance(x, np.ndarray)
        if (intake.place.kind == "cpu") != on_cpu:
            raise InvalidArgumentError(
                f"{name}: on {'the CPU' if on_cpu else _arrays.place_of(name, x)}, but q is on "
                f"{intake.place}; give it where q is")
        if on_cpu:
            keep[name] = x
            # An axis of length 1 takes its dense stride: all zeros would read as dense
            # (pyfa.h), and a (B, 1) view broadcast from (1,) has them.
            address, shape = _address(ffi, x), x.shape
            strides = tuple(s // 4 if n > 1 else math.prod(shape[a + 1:])
                            for a, (n, s) in enumerate(zip(shape, x.strides)))
        else:
            place = _arrays.place_of(name, x)
            if place.index is not None and intake.place.index is not None and place != intake.place:
                raise InvalidArgumentError(f"{name}: on {place}, but q is on {intake.place}")
            t = _arrays.device_tensor(name, x, intake.stream)
            keep[name] = t
            shape = t.shape
            strides = t.strides if t.strides is not None else \
                tuple(int(np.prod(shape[n + 1:])) for n in range(len(shape)))
            address = t.ptr
            if len(shape) == 1:  # (H,): shared by every batch element
                shape, strides = (1,) + shape, (0,) + strides
            if shape[-1] == 1:  # one head: any stride, but all zeros would read as dense
                strides = tuple(strides[:-1]) + (1,)
            if not any(strides):
                raise InvalidArgumentError(f"{name}: broadcast along every axis (strides 0), which "
                                           "pyfa.h reads as dense; pass a materialised array")
        found[name] = (address, (tuple(strides) + (0, 0))[:3])
    return found, keep


def _address(ffi, x):
    """A float * to element 0 of the NumPy view x (a view may start anywhere in its base)."""
    return ffi.cast("float *", x.__array_interface__["data"][0])


def _as_4d_shape(name, shape, rank=None, layout="bhnd"):
    # The device twin of pyfa.checks.as_tensor and as_4d's shape rules, with their messages.
    if len(shape) not in (2, 3, 4):
        words = "(B, H, N, d), (H, N, d)" if layout == "bhnd" else "(B, N, H, d), (N, H, d)"
        raise InvalidArgumentError(f"{name}: expected shape {words} or (N, d), got {shape}")
    if rank is not None and len(shape) != rank:
        raise InvalidArgumentError(f"{name}: expected {rank} dimensions like q, got shape {shape}")
    s = (1,) * (4 - len(shape)) + tuple(shape)
    return (s[0], s[2], s[1], s[3]) if layout == "bnhd" and len(shape) > 2 else s


def _check_device_shapes(tensors, layout):
    """checks.check_qkv, check_like and check_rows on the shapes of DeviceTensors
    (same rules, same messages); returns (dims, rank)."""
    q, k, v = tensors["q"].shape, tensors["k"].shape, tensors["v"].shape
    q4 = _as_4d_shape("q", q, layout=layout)
    rank = len(q)
    k4 = _as_4d_shape("k", k, rank, layout)
    B, H, Nq, d = q4
    Hkv = k4[1]
    if k4[0] != B:
        raise InvalidArgumentError(f"k: batch {k4[0]} differs from q's {B}")
    if k4[3] != d:
        raise InvalidArgumentError(f"k: head dim {k4[3]} differs from q's {d}")
    if v != k:
        raise InvalidArgumentError(f"v: shape {v} differs from k's {k}")
    check_sizes(q4, k4, q, k)
    if H % Hkv != 0:
        raise InvalidArgumentError(f"k: its {Hkv} heads must divide q's {H} heads (grouped-query "
                         f"attention), got q {q}, k {k}")
    if d > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"q: head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    for name, t in tensors.items():
        if name in ("q", "k", "v"):
            continue
        if TENSOR_KINDS[name] == "row":
            if not 1 <= len(t.shape) <= 3 or (1,) * (3 - len(t.shape)) + t.shape != q4[:3]:
                raise InvalidArgumentError(f"{name}: expected one value per query row, shape {q4[:3]} "
                                 f"(or without its leading 1s), got {t.shape}")
        elif _as_4d_shape(name, t.shape, layout=layout) != q4:
            raise InvalidArgumentError(f"{name}: expected shape {caller_shape(q4, 4, layout)} "
                             f"(layout {layout!r}), got {t.shape}")
    return (B, H, Nq, k4[2], d, Hkv), rank


@dataclass
class _Intake:
    """The tensor arguments of one call, checked: where they live, and their memory."""
    place: _arrays.Place
    kind: str         # q's library: outputs are made of this kind
    tensors: dict     # name -> NumPy (B, heads, N, d) view (rows: dense (B, H, Nq)) the
                      # library can address, or DeviceTensor
    strides: dict     # name -> (batch, head, row) element strides, or None for dense
    dims: tuple       # (B, H, Nq, Nk, d, Hkv)
    rank: int         # q's rank as the caller gave it
    layout: str       # "bhnd" or "bnhd", of every 4-D tensor in and out
    stream: int       # the cudaStream_t a CUDA call runs on (0 on the CPU)
    memory: dict      # name -> the caller's memory of each input: a NumPy array, or the
                      # DeviceTensor (what an output must not overlap)

    def shape4(self, name):
        return tensor_shape(name, *self.dims)

    def shape(self, name):
        """The shape of tensor `name` at the caller's rank and in the caller's layout."""
        full = self.shape4(name)
        if TENSOR_KINDS[name] == "row":
            return full[4 - self.rank:3]
        return caller_shape(full, self.rank, self.layout)


def _cuda_stream(args, place, stream):
    """The cudaStream_t of a call on CUDA arrays: stream= when given, else the producer's
    current stream (PyTorch, CuPy), else the stream a __cuda_array_interface__ names, else
    the default stream. A __cuda_array_interface__ array on another stream is refused:
    pyfa cannot order one stream after another."""
    if stream is not None:
        handle = _arrays.stream_handle(stream)
    else:
        handle = _arrays.current_stream(args["q"], place)
    named = {n: s for n, s in ((n, _arrays.cai_stream(x)) for n, x in args.items() if x is not None)
             if s is not None}
    if handle is None:
        handle = next(iter(named.values()), 0)
    same = {0, 1} if handle in (0, 1) else {handle}  # 0 and 1 both name the legacy default stream
    for name, s in named.items():
        if s not in same:
            raise InvalidArgumentError(f"{name}: its __cuda_array_interface__ is on stream {s:#x}, but this "
                             f"call runs on stream {handle:#x}; synchronize first or pass stream=")
    return handle


def _intake(args, stream, backend, layout, outs=None):
    """Checks the tensor arguments {name: caller's array} (and the given outputs' place):
    all on one device, float32, shapes as the op needs in `layout`; for CUDA arrays, that
    the backend can run them, before anything is exported. CPU arrays are seen as
    (B, heads, N, d) views, copied only when the library cannot address them."""
    layout = check_layout(layout)
    labelled = {**args, **{f"out ({n})": x for n, x in (outs or {}).items()}}
    place = _arrays.common_place(labelled)
    kind = _arrays.library_of(args["q"])
    if place.kind == "cpu":
        if stream is not None:
            raise InvalidArgumentError("stream: only CUDA arrays run on a stream, and these are on the CPU")
        arrays = {n: _arrays.host_array(n, x) for n, x in args.items()}
        q4, k4, v4, rank, heads_kv = check_qkv(arrays["q"], arrays["k"], arrays["v"], layout)
        views = dict(q=q4, k=k4, v=v4)
        for name, x in arrays.items():
            if name not in views:
                views[name] = (check_rows(name, x, q4) if TENSOR_KINDS[name] == "row"
                               else check_like(name, x, q4, layout))
        tensors, strides = {}, {}
        for name, x in views.items():
            tensors[name], strides[name] = _in_place(x)
        dims = (*q4.shape[:3], k4.shape[2], q4.shape[3], heads_kv)
        return _Intake(place, kind, tensors, strides, dims, rank, layout, 0, arrays)
    _check_cuda_backend(backend, place)
    handle = _cuda_stream(labelled, place, stream)
    tensors = {n: _arrays.device_tensor(n, x, handle) for n, x in args.items()}
    dims, rank = _check_device_shapes(tensors, layout)
    for n, t in tensors.items():
        if TENSOR_KINDS[n] == "row" and not t.contiguous:
            raise InvalidArgumentError(f"{n}: a per-row CUDA tensor must be C-contiguous")
    strides = {n: None if TENSOR_KINDS[n] == "row"
               else _device_strides(t, tensor_shape(n, *dims), rank, layout)
               for n, t in tensors.items()}
    return _Intake(place, kind, tensors, strides, dims, rank, layout, handle, tensors)


def _out_dict(op_name, names, out):
    """out= as {output name: array or None}: one array for a single output, else a tuple
    or list with one entry (an array, or None for "allocate it") per output."""
    if out is None:
        return {n: None for n in names}
    if len(names) == 1 and not isinstance(out, (tuple, list)):
        return {names[0]: out}
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise ArgumentTypeError(f"out: expected a tuple of {len(names)} arrays or Nones "
                        f"({', '.join(names)}) for {op_name}, got {type(out).__name__}"
                        f"{'' if not isinstance(out, (tuple, list)) else f' of {len(out)}'}")
    return dict(zip(names, out))


def refuse_overlaps(outputs, inputs, overlap):
    """InvalidArgumentError naming both when one of `outputs` ([(label, memory)]) shares
    memory with another output or with one of `inputs`, as overlap(a, b) decides (NumPy:
    np.shares_memory; device arrays: their pointer spans). The kernels read every input
    tile after tile while they write the outputs, and write each output once: any such
    overlap would give wrong data or change an input. The rule of every backend, checked
    before anything is written."""
    for i, (name, x) in enumerate(outputs):
        for other, y in outputs[i + 1:] + inputs:
            if overlap(x, y):
                raise InvalidArgumentError(f"{name}: overlaps {other}; outputs must not share "
                                           f"memory with each other or with the inputs")


def _spans_overlap(t, u):
    return t.ptr < u.ptr + u.nbytes and u.ptr < t.ptr + t.nbytes


def _refuse_given_overlaps(intake, outs):
    """refuse_overlaps on the out= arrays given (None entries skipped) and the inputs,
    for a call of several ops that must refuse before its first op writes."""
    given = [(f"out ({n})", x) for n, x in outs.items() if x is not None]
    if intake.place.kind == "cpu":
        given = [(label, _arrays.host_array(label, x)) for label, x in given]
        # Anything else is refused with its own message by the op that takes it.
        given = [(label, a) for label, a in given if isinstance(a, np.ndarray)]
        refuse_overlaps(given, list(intake.memory.items()), np.shares_memory)
    else:
        given = [(label, _arrays.device_tensor(label, x, intake.stream)) for label, x in given]
        refuse_overlaps(given, list(intake.memory.items()), _spans_overlap)


def _host_outputs(op, intake, outs, others=()):
    """{name: (caller's object or None, its NumPy view or None, the NumPy array the library
    writes)}, each in the caller's rank and layout. A given output is written directly
    when it is C-contiguous, otherwise through a fresh array copied into it after
    success; one that overlaps another output, itself, an input or one of `others`
    ([(label, NumPy array)]: the score modifications' and packed sequences' arrays) is
    refused."""
    result = {}
    for name in op.outputs:
        shape, given = intake.shape(name), outs[name]
        if given is None:
            result[name] = (None, None, np.empty(shape, np.float32))
            continue
        label = f"out ({name})"
        a = _arrays.host_array(label, given)
        if not isinstance(a, np.ndarray):
            raise ArgumentTypeError(f"{label}: expected {_arrays.ARRAY_HELP}, got {type(given).__name__}")
        if a.dtype != np.float32:
            raise ArgumentTypeError(f"{label}: expected dtype float32, got {a.dtype}")
        if a.shape != shape:
            raise InvalidArgumentError(f"{label}: expected shape {shape}, got {a.shape}")
        if not a.flags.writeable:
            raise InvalidArgumentError(f"{label}: is read-only")
        if not a.flags.c_contiguous:
            refuse_self_overlap(label, a.shape, a.strides, a.itemsize)
        result[name] = (given, a, a if a.flags.c_contiguous else np.empty(shape, np.float32))
    refuse_overlaps([(f"out ({n})", view) for n, (_, view, _) in result.items() if view is not None],
                    list(intake.memory.items()) + list(others), np.shares_memory)
    return result


def _run_host(op, intake, outs, problem, config, progress, varlen=None, mod_tensors=None, dbias=None,
              others=(), plan_key=None):
    """The host entry point's call; plan_key (_plan_key's, or None): the key under which
    the call's set-up is kept for the calls that differ from it only in their arrays."""
    ffi, lib = _lib.load()
    targets = _host_outputs(op, intake, outs, others)
    if dbias is not None:
        refuse_overlaps([("out (dbias)", dbias[1][1])] if dbias[1] else [],
                        [(f"out ({n})", view) for n, (_, view, _) in targets.items() if view is not None],
                        np.shares_memory)
    _set_strides(problem, {n: intake.strides[n] for n in op.inputs})
    _set_strides(problem, {n: _layout_strides(intake.shape4(n), intake.rank, intake.layout)
                           for n in op.outputs if TENSOR_KINDS[n] != "row"})
    tensors = _tensors("PYFA_MEMORY_HOST",
                       {**{n: _address(ffi, intake.tensors[n]) for n in op.inputs},
                        **{n: _address(ffi, w) for n, (_, _, w) in targets.items()}}, varlen)
    _set_mod_tensors(tensors, problem, mod_tensors)
    if dbias is not None:  # our own array, written by the library in the bias's shape
        tensors.dbias.data = ffi.cast("void *", _address(ffi, dbias[0]))
    rec = prepared.recording()
    if rec is not None:
        if dbias is not None and dbias[1] is not None:
            raise InvalidArgumentError(f"out (dbias): {rec.function} writes it through a staging copy; "
                                       "leave it to pyfa to allocate")
        for n, x in zip(varlen.pointers, varlen.keep) if varlen is not None else ():
            rec.bound(n, x)
        for n in op.inputs:
            rec.bound(n, intake.tensors[n])
        for n, (given, view, written) in targets.items():
            rec.output(f"out ({n})", given, view, written)
        if dbias is not None:
            rec.output("dbias", None, None, dbias[0])
    if all(view is not written for _, view, written in targets.values()):
        # Every array the library writes is ours until the call returns: a cancelled call
        # may leave them partly written, and no staging copy is needed.
        config.flags |= lib.PYFA_FLAG_IN_PLACE
    emulated = config.backend == lib.PYFA_BACKEND_EMU
    args = (op.c_op, problem, config, tensors, ffi.NULL)
    quick = _work(op, intake.dims) <= _lib.QUICK_WORK["emu" if emulated else "native"]
    _lib.call(lib.pyfa_run, config, *args, progress=progress, quick=quick)
    if rec is not None:
        # The outputs pyfa allocated are the caller's once returned: a replay that fails
        # or is cancelled must leave them as they were, so replays stage them.
        config.flags &= ~lib.PYFA_FLAG_IN_PLACE
        rec.step(lib.pyfa_run, config, args, progress, quick)
    if plan_key is not None:
        _Plan.keep(plan_key, op, intake, targets, problem, config, tensors, quick)
    results = []
    for given, view, written in targets.values():
        if given is None:
            results.append(_arrays.as_kind(intake.kind, written))
            continue
        if view is not written:
            np.copyto(view, written)
        results.append(given)
    return tuple(results)


# ---- Plans: a host call's checked set-up (its pyfa_problem, pyfa_config and pyfa_tensors)
# kept per thread and reused by a later call that differs from it only in the contents and
# addresses of its arrays: the same op, keywords and options, and arrays of the same type,
# shapes, strides and dtypes, which every check would pass as they passed. A model's layers
# and pyfa.torch make the same call on fresh arrays thousands of times, and for a small
# problem the checks cost as much as the kernels (docs/torch.md). Only calls that read the
# caller's arrays in place and write outputs pyfa allocates: no out=, no array keywords
# but sinks (whose values the calling function checks on every call), no progress or
# recording. Packed sequences are kept by their kind (the number of sequences, which
# counts and pages they have); each call's own offsets, checked, are rebound.
# attention_with_kvcache keeps plans of its own (pyfa/kvcache.py).
_PLAN_LIMIT = 64
_thread_plans = threading.local()


def _plans_of_thread():
    plans = getattr(_thread_plans, "plans", None)
    if plans is None:
        plans = _thread_plans.plans = {}
    return plans


def _plan_key(op_name, args, keywords, mods):
    """The key of a call whose set-up may be kept (see above), or None."""
    *rest, options, out, stream, varlen, function, split_size, sinks = keywords
    if out is not None and not (type(out) in (tuple, list) and all(x is None for x in out)):
        return None  # out= arrays are checked against the inputs on every call
    if stream is not None:
        return None
    if varlen is not None:
        # Packed sequences: kept by their kind, each call's offsets checked (resolve_varlen)
        # and rebound; dropout_origin's check reads the longest lengths, so it is not kept.
        if varlen.offsets_q is None or "dropout_origin" in mods:
            return None
        pages = varlen.pages
        varlen = (varlen.batch, tuple(varlen.pointers),
                  None if pages is None else (pages.page_size, pages.num_pages, pages.logical_rows))
    # The sinks (checked by the calling function on every call, as the arrays are) by their kind.
    key = plan_key(op_name, [*args.values(), sinks], (*rest, function, split_size, varlen, *sorted(mods.items())),
                   options)
    # out= of Nones keyed by its type and length, which _out_dict checks.
    return None if key is None else key + (None if out is None else (type(out), len(out)),)


def plan_key(name, arrays, scalars, options):
    """The key of a call of `name` on `arrays` (NumPy arrays or None) with the keywords
    `scalars` and the resolved `options`, under which its set-up may be kept: the arrays'
    types, shapes, strides, dtypes and writeability, the keywords with their types (True
    and 1 are checked differently), the options; or None where the call's set-up is not
    kept (an array that is not NumPy's, a keyword that is an array, a progress callback,
    a pyfa.prepare recording)."""
    if options.progress is not None or prepared.recording() is not None:
        return None
    kinds = []
    for x in arrays:
        if x is None:
            kinds.append(None)
            continue
        if type(x) is not np.ndarray:
            return None
        kinds.append((x.shape, x.strides, x.dtype.str, x.flags.writeable))
    if not _plain(scalars):
        return None
    try:
        hash(options)
    except Exception:  # noqa: BLE001 (an Options field that does not hash: not kept)
        return None
    return name, options, tuple(kinds), _typed(scalars)


def keep_plan(key, plan):
    """Keeps `plan` under `key` for this thread (the oldest goes beyond _PLAN_LIMIT)."""
    plans = _plans_of_thread()
    if len(plans) >= _PLAN_LIMIT:
        plans.pop(next(iter(plans)))
    plans[key] = plan


def _plain(v):
    """Whether v is None, a bool, int, float or str, or a tuple of such: a keyword that
    compares by value (an array-like one is checked on every call)."""
    return v is None or type(v) in (bool, int, float, str) or (type(v) is tuple and all(_plain(x) for x in v))


def _typed(v):
    """A _plain value with the type of every element beside it."""
    return tuple(_typed(x) for x in v) if type(v) is tuple else (type(v), v)


class _Plan:
    """One kept set-up: the library's structs, rebound to each call's arrays."""

    def __init__(self, op, inputs, outputs, problem, config, tensors, quick, totals):
        self.op, self.inputs, self.outputs = op, inputs, outputs
        self.problem, self.config, self.tensors, self.quick = problem, config, tensors, quick
        self.totals = totals  # (Nq, Nk) of the tensors: packed sequences' total rows
        self.lib = _lib.load()[1]  # the structs are this library's

    @classmethod
    def keep(cls, key, op, intake, targets, problem, config, tensors, quick):
        """Keeps the call's set-up under `key` where it read the caller's arrays in place
        (no copy: each array the library read starts where the caller's does) and wrote
        only outputs it allocated."""
        ffi, _ = _lib.load()
        for n in op.inputs:
            if intake.memory[n] is not intake.tensors[n] and \
                    _address(ffi, intake.memory[n]) != _address(ffi, intake.tensors[n]):
                return
        if any(given is not None for given, _, _ in targets.values()):
            return
        outputs = [(getattr(tensors, C_FIELDS[n]), written.shape) for n, (_, _, written) in targets.items()]
        keep_plan(key, cls(op, [(n, getattr(tensors, C_FIELDS[n])) for n in op.inputs], outputs, problem, config,
                           tensors, quick, intake.dims[2:4]))

    def run(self, args, varlen=None, sinks=None):
        """The call on `args` (arrays of the kept call's kinds, shapes, strides and dtypes),
        packed sequences `varlen` (the call's checked offsets, of the kept call's kind) and
        sinks (checked), or None where an array is not aligned to a float as the kept
        call's were (the full path then copies it), or where another library has been
        loaded since."""
        ffi, lib = _lib.load()
        if lib is not self.lib:
            return None
        for name, field in self.inputs:
            address = args[name].__array_interface__["data"][0]
            if address % 4:
                return None
            field.data = ffi.cast("void *", address)
        if varlen is not None:
            varlen.apply(self.problem, *self.totals)
            for field, address in varlen.pointers.items():
                getattr(self.tensors, field).data = ffi.cast("void *", address)
        if sinks is not None:
            sinks = c_aligned(sinks)  # as _sinks_tensor reads them, alive for the call
            self.tensors.sinks.data = ffi.cast("void *", _address(ffi, sinks))
        results = []
        for field, shape in self.outputs:
            a = np.empty(shape, np.float32)
            field.data = ffi.cast("void *", a.__array_interface__["data"][0])
            results.append(a)
        with _lib.interrupts_after():
            _lib.call(lib.pyfa_run, self.config, self.op.c_op, self.problem, self.config, self.tensors, ffi.NULL,
                      quick=self.quick)
        return tuple(results)


def _work(op, dims):
    """The multiply-adds of op on dims (B, H, Nq, Nk, d, ...), a backward's taken as three
    forwards'; for packed sequences (dims of the whole batch) an upper bound."""
    b, h, nq, nk, d = dims[:5]
    return b * h * nq * nk * d * (3 if op.pass_ == "backward" else 1)


def _run_empty(op, intake, outs, others=()):
    """The outputs of an empty problem (Nq = 0 or Nk = 0), EMPTY_VALUES, without the
    library (which refuses zero lengths). On CUDA arrays only outputs with no elements can
    be made without a kernel; others are refused."""
    if intake.place.kind != "cpu":
        for name in op.outputs:
            if np.prod(intake.shape(name)) > 0:
                raise InvalidArgumentError(
                    f"q, k: Nq = {intake.dims[2]}, Nk = {intake.dims[3]} leaves {name} to be "
                    f"filled with {EMPTY_VALUES[name]}, which pyfa does not do on CUDA arrays")
        results = []
        for name in op.outputs:
            shape, given, label = intake.shape(name), outs[name], f"out ({name})"
            if given is None:
                allocate, _ = _arrays.allocator_for(intake.kind)
                results.append(_arrays.as_kind(intake.kind, allocate(shape, intake.place.index)))
                continue
            t = _arrays.device_tensor(label, given, intake.stream)
            if t.shape != shape:
                raise InvalidArgumentError(f"{label}: expected shape {shape}, got {t.shape}")
            results.append(given)
        return tuple(results)
    results = []
    for name, (given, view, written) in _host_outputs(op, intake, outs, others).items():
        target = written if view is None else view
        target[...] = EMPTY_VALUES[name]
        results.append(_arrays.as_kind(intake.kind, target) if given is None else given)
    return tuple(results)


def _check_cuda_backend(backend, place):
    _choice("backend", backend, BACKENDS)
    if backend == "emu":
        raise InvalidArgumentError(f"backend: 'emu' runs on host memory, but the arrays are on {place}; "
                         f"use 'auto' or 'cuda'")
    _, lib = _lib.load()
    cuda = BACKENDS["cuda"]
    if not lib.pyfa_backend_available(cuda):
        raise BackendUnavailableError(
            f"q: a CUDA array (on {place}), but pyfa's CUDA backend cannot run here: "
            f"{_reason(lib, cuda)}", _lib.constant("PYFA_ERROR_BACKEND_UNAVAILABLE"))


def _run_device(op, intake, outs, problem, config, progress, varlen=None, mod_tensors=None):
    """Enqueues OPS[op] on intake.stream with the arrays' device pointers: no host copy."""
    ffi, lib = _lib.load()
    targets = {}
    for name in op.outputs:
        shape, given = intake.shape(name), outs[name]
        label = f"out ({name})"
        if given is None:
            allocate, _ = _arrays.allocator_for(intake.kind)
            array = allocate(shape, intake.place.index, intake.stream)
            t = _arrays.device_tensor(label, array, intake.stream)
        else:
            array = given
            t = _arrays.device_tensor(label, given, intake.stream)
            if t.shape != shape:
                raise InvalidArgumentError(f"{label}: expected shape {shape}, got {t.shape}")
            if t.readonly:
                raise InvalidArgumentError(f"{label}: is read-only")
            if t.strides is not None:
                refuse_self_overlap(label, t.shape, tuple(4 * st for st in t.strides))
        targets[name] = (given, array, t)
    refuse_overlaps([(f"out ({n})", t) for n, (_, _, t) in targets.items()],
                    list(intake.memory.items()), _spans_overlap)
    _set_strides(problem, {n: intake.strides[n] for n in op.inputs})
    for n, (_, _, t) in targets.items():
        if TENSOR_KINDS[n] == "row" and not t.contiguous:
            raise InvalidArgumentError(f"out ({n}): a per-row CUDA tensor must be C-contiguous")
    _set_strides(problem, {n: _device_strides(t, intake.shape4(n), intake.rank, intake.layout)
                           for n, (_, _, t) in targets.items() if TENSOR_KINDS[n] != "row"})
    fn = lib.pyfa_run
    switch = _arrays.device_switch(intake.kind, intake.place.index)
    if switch is not None:
        entry = fn

        def fn(*args):
            restore = switch()
            try:
                return entry(*args)
            finally:
                restore()
    tensors = _tensors("PYFA_MEMORY_DEVICE",
                       {**{n: intake.tensors[n].ptr for n in op.inputs},
                        **{n: t.ptr for n, (_, _, t) in targets.items()}}, varlen)
    _set_mod_tensors(tensors, problem, mod_tensors)
    _lib.call(fn, config, op.c_op, problem, config, tensors, ffi.cast("void *", intake.stream),
              progress=progress)
    return tuple(given if given is not None else _arrays.as_kind(intake.kind, array)
                 for given, array, _ in targets.values())


def _keywords(function, options, kwargs):
    """(the Options, the score modifications) of a call to `function` (its public name)
    from options= and its other keyword arguments: an Options field given as a keyword is
    the deprecated form of options= (pyfa/options.py), any other keyword a score
    modification, checked later by checks.ScoreMods."""
    legacy = {n: kwargs.pop(n) for n in list(kwargs) if n in OPTION_FIELDS}
    # Refused here, by the name the caller called (attention passes them on to the forward,
    # whose own check would name it); bias_grad and sinks are checked by the calls that take them.
    for name in kwargs:
        if name not in SCORE_MOD_KEYWORDS and name not in ("bias_grad", "sinks"):
            raise ArgumentTypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return resolve_options(function, options, legacy), kwargs


def _run(op_name, args, *, causal, window, causal_align, scale, layout, options, out,
         stream, mods, varlen=None, function=None, split_size=None, sinks=None):
    """Runs OPS[op_name] on the caller's arrays `args` ({name: array}, op.inputs order)
    with the resolved Options `options`; returns its outputs in op.outputs order, at the
    caller's rank and in its layout, of q's kind (or the out= arrays given). CPU arrays
    take the host entry point, CUDA arrays the device one. varlen: packed sequences (a
    pyfa.varlen.Varlen), the tensors then one (total, heads, d) batch in layout "bnhd";
    function: the public name errors use (default pyfa.<op_name>); split_size: the FA2
    forward's keys per chunk, the FA2 backward's rows and keys per chunk
    (checks.check_split_size); sinks: the FA2 forward's (_sinks_keyword's), or None."""
    key = _plan_key(op_name, args, (causal, window, causal_align, scale, layout, options, out, stream,
                                    varlen, function, split_size, sinks), mods)
    plan = _plans_of_thread().get(key) if key is not None else None
    if plan is not None:
        results = plan.run(args, varlen, sinks)
        if results is not None:
            return results
    op = OPS[op_name]
    # A backward given a bias also returns dbias, last (docs/numerics.md §2).
    bias_grad = _bias_grad(function or f"pyfa.{op_name}", mods, op.pass_ == "backward")
    with_dbias = bias_grad and mods.get("bias") is not None
    outs = _out_dict(op_name, op.outputs + (("dbias",) if with_dbias else ()), out)
    dbias_out = outs.pop("dbias", None)
    intake = _intake(args, stream, options.backend, layout, outs)
    # Packed sequences: one batch of total rows, whose modifications ((B, H) ALiBi slopes,
    # a (B, H, max_seqlen_q, max_seqlen_k) bias) count the sequences as the batch and the
    # longest lengths as Nq, Nk (each sequence reads its own corner).
    dims = intake.dims if varlen is None else (varlen.batch, intake.dims[1], varlen.max_q, varlen.max_k,
                                               *intake.dims[4:])
    keywords = dict(mods)
    mods = ScoreMods.resolve(function or f"pyfa.{op_name}", dims, causal_align, **mods)
    _check_mods_place(mods, intake)
    dbias = _dbias_target(mods.bias, dbias_out, intake) if with_dbias else None
    if is_empty(*intake.dims[2:4]):
        mask_bounds(causal, window, causal_align, *intake.dims[2:4])
        resolve_scale(scale, intake.dims[4])
        _check_run_options(op, options, split_size, intake, dims, keywords)
        results = _run_empty(op, intake, outs, _other_inputs(keywords, varlen, sinks))
        if dbias is not None:
            dbias[0][...] = 0
        if sinks is not None and intake.place.kind == "cpu":  # rows with no key: O = 0, LSE = the sink
            _merge_sinks_in_place(results[0], results[1], sinks, layout)
        return results + _dbias_results(dbias, intake)
    problem = _problem(intake.dims, scale, causal, window, causal_align, mods)
    if varlen is not None:
        varlen.apply(problem, intake.dims[2], intake.dims[3])
    split_size = check_split_size(split_size, intake.dims[4])
    if split_size:
        problem.struct_size = _lib.load()[0].sizeof("pyfa_problem")
        problem.split_size = split_size
    config = _config(options)
    mod_tensors, mod_arrays = _mod_tensors(mods, intake, grad=dbias is not None)
    if sinks is not None:
        mod_tensors["sinks"], mod_arrays["sinks"] = _sinks_tensor(sinks, intake)
    rec = prepared.recording()
    if rec is not None:
        if intake.place.kind != "cpu":
            raise InvalidArgumentError(f"q: {rec.function} takes CPU arrays only, got one on {intake.place}")
        for name, x in mod_arrays.items():
            rec.bound(name, x)
    with _lib.interrupts_after():
        if intake.place.kind == "cpu":
            results = _run_host(op, intake, outs, problem, config, options.progress, varlen, mod_tensors, dbias,
                                _other_inputs(keywords, varlen, sinks), key if dbias is None and rec is None else None)
            return results + _dbias_results(dbias, intake)
        return _run_device(op, intake, outs, problem, config, options.progress, varlen, mod_tensors)


def _check_run_options(op, options, split_size, intake, dims, mods):
    """For an empty problem, where no kernel runs: options and split_size checked as a run
    checks them, by the library itself on a problem of one row and key of the same batch,
    heads and head dim (CPU arrays), with the score modifications `mods` (the keywords,
    already checked against the real sizes; a bias as one element), so that an argument
    pyfa cannot honour, alone or with a modification, is refused whatever the sizes."""
    B, H, _, _, d, Hkv = dims  # packed sequences: B the sequences
    if B < 1:  # no sequences: slopes of none are not the library's to check
        B, mods = 1, {n: x for n, x in mods.items() if n != "alibi_slopes"}
    _config(options)
    check_split_size(split_size, d)
    if intake.place.kind != "cpu":
        return
    one = {n: np.zeros(tensor_shape(n, B, H, 1, 1, d, Hkv), np.float32) for n in op.inputs}
    if mods.get("bias") is not None:
        mods = {**mods, "bias": np.zeros((1, 1, 1, 1), np.float32)}
    with prepared.paused():
        _run(op.name, one, causal=False, window=None, causal_align="bottom_right", scale=None, layout="bhnd",
             options=options.replace(progress=None), out=None, stream=None, mods=mods, split_size=split_size)


def _other_inputs(keywords, varlen, sinks=None):
    """[(label, NumPy array)]: the CPU arrays a call reads besides its tensors (the score
    modifications' keywords, the packed sequences' offsets, counts and block table, the
    sinks), which its outputs must not overlap either."""
    found = _array_keywords(keywords) + ([("sinks", sinks)] if isinstance(sinks, np.ndarray) else [])
    if varlen is not None:
        found += [(name, x) for name, x in zip(varlen.pointers, varlen.keep) if isinstance(x, np.ndarray)]
    return found


def _stage_o(intake, outs, forward, others):
    """For a call that runs a forward and then a backward (attention_grad): (what the
    forward writes o into, a function that completes the caller's o from it once the
    backward has succeeded). A CPU out= o is checked now (as the forward would) and written
    only at the end, so that a backward that fails or is cancelled leaves it as it was;
    others: [(label, NumPy array)] it must not overlap either (the keywords' arrays).
    Under pyfa.prepare, and for CUDA arrays, the forward writes it directly."""
    given = outs["o"]
    if given is None or intake.place.kind != "cpu" or prepared.recording() is not None:
        return given, lambda o: o
    op = OPS[forward]
    _, view, _ = _host_outputs(op, intake, {n: given if n == "o" else None for n in op.outputs}, others)["o"]

    def finish(o):
        np.copyto(view, o)
        return given
    return None, finish


def _array_keywords(mods):
    """[(name, NumPy array)]: the CPU arrays among a call's score-modification keywords."""
    found = []
    for name, x in mods.items():
        try:
            a = _arrays.host_array(name, x.given if isinstance(x, Bias) else x)
        except TypeError:  # refused with its own message by the call that takes it
            continue
        if isinstance(a, np.ndarray):
            found.append((name, a))
    return found


def _bias_grad(function, mods, backward):
    """Pops bias_grad (a backward's: whether it computes dbias) from the keywords `mods`."""
    if "bias_grad" not in mods:
        return backward
    if not backward:
        raise ArgumentTypeError(f"{function}() got an unexpected keyword argument 'bias_grad' "
                                "(a backward's: whether it returns dbias)")
    given = mods.pop("bias_grad")
    if not isinstance(given, (bool, np.bool_)):
        raise ArgumentTypeError(f"bias_grad: expected a bool, got {type(given).__name__}")
    return bool(given)


def _dbias_target(bias, given, intake):
    """(the array dbias is folded into, the caller's out= or None): dbias has the bias's
    shape; an out= array is checked as the others are and written only after success."""
    if given is None:
        return np.empty(bias.shape, np.float32), None
    a = _arrays.host_array("out (dbias)", given)
    if not isinstance(a, np.ndarray):
        raise ArgumentTypeError(f"out (dbias): expected {_arrays.ARRAY_HELP}, got {type(given).__name__}")
    if a.dtype != np.float32:
        raise ArgumentTypeError(f"out (dbias): expected dtype float32, got {a.dtype}")
    if a.shape != bias.shape:
        raise InvalidArgumentError(f"out (dbias): expected shape {bias.shape} (the bias's), got {a.shape}")
    if not a.flags.writeable:
        raise InvalidArgumentError("out (dbias): is read-only")
    refuse_self_overlap("out (dbias)", a.shape, a.strides, a.itemsize)
    refuse_overlaps([("out (dbias)", a)], list(intake.memory.items()) + [("bias", bias.view)], np.shares_memory)
    return np.empty(bias.shape, np.float32), (given, a)


def _dbias_results(dbias, intake):
    if dbias is None:
        return ()
    written, given = dbias
    if given is None:
        return (_arrays.as_kind(intake.kind, written),)
    np.copyto(given[1], written)
    return (given[0],)


_COMMON_DOC = """
    causal: key j hidden from query i when j > i + off; window: None or (left, right),
    each an int >= 0 or None (unbounded): key j visible to query i iff
    i + off - left <= j <= i + off + right (causal sets right = 0; a side of Nq + Nk or
    more is the unbounded one, whatever its size); causal_align:
    "bottom_right" (off = Nk - Nq, flash-attn's) or "top_left" (off = 0, PyTorch's
    is_causal). layout: "bhnd" (B, H, N, d) or "bnhd" (B, N, H, d), flash-attn's, for
    every 4-D tensor in and out; per-row tensors (lse, m, l) are (B, H, Nq) in both.
    k and v may have Hkv heads, H % Hkv == 0 (grouped-query attention: query head h
    reads K/V head h // (H // Hkv)); dk and dv then have Hkv heads, each the sum over
    its group's query heads.

    **mods: the score modifications (pyfa.checks.ScoreMods, docs/numerics.md §2), the
    same keywords as the simulator's; any other keyword is a TypeError naming it.
    softcap (None, or a float > 0): each scaled score s becomes softcap * tanh(s / softcap),
    before the mask. alibi_slopes (None, or float32 slopes of shape (H,) or (B, H), on q's
    device): then S - slope * |i + off - j|, after softcap, with off causal_align's.
    dropout_p (in [0, 1), 0 off), seed (an int in [0, 2^64), required when dropout_p > 0
    so that the mask is reproducible) and offset (an int in [0, 2^64), 0 by default):
    dropout of P in P V, its mask a pure function of (seed, offset, b, h, i, j) that the
    backward regenerates; pyfa.dropout_mask returns it (docs/numerics.md, "Dropout").
    bias=: a float32 CPU array broadcastable to (B, H, Nq, Nk) (any of B, H, Nq of 1 or
    a broadcast view; Nk whole), added to the scaled score before the mask; -inf gives
    the score P = 0 exactly (a row all -inf: O = 0, LSE = -inf), NaN is a NaN score. The
    backwards then also return dbias, of the bias's shape, last: dS summed over the
    bias's broadcast axes in one fixed order (docs/numerics.md §2), the same bits on every
    backend, thread count and, given the forward's outputs, backward tiles; unless
    bias_grad=False (backwards only, True by default): no dbias (nor its scratch and
    writes), and the same dq, dk, dv bits.
    diagonal_offset (an int, 0 by default): added to the mask's off, so that the call is
    the block (rows P + i, keys K + j, diagonal_offset = P - K) of a larger problem, with
    its mask and ALiBi distances; dropout_origin ((B0, H0, P, K), ints >= 0, zeros by
    default): the call's element (b, h, i, j) draws the dropout decision of (B0 + b,
    H0 + h, P + i, K + j), that larger problem's (context parallelism; docs/numerics.md §2).
    (An Options field given as a keyword, e.g. block_r=, is the deprecated form of
    options=.)

    Arrays: NumPy, or any array with __dlpack__ (PyTorch, CuPy, JAX, ...) or
    __cuda_array_interface__, all on one device. CPU arrays run as NumPy arrays (any
    strides; read in place when the last axis is contiguous, else copied); CUDA arrays
    need a contiguous last axis (any other strides, no copy) and go to
    the device entry point with no host copy, enqueued on `stream` (an int cudaStream_t or
    a PyTorch/CuPy stream object; default: the producer's current stream). Outputs are
    arrays of q's library (NumPy for a producer pyfa cannot hand DLPack to), or the
    `out` arrays given, written in place; an out= array that shares memory with another
    output or with an input is refused (ValueError naming both) before anything is
    written. Nq = 0 or Nk = 0 gives PyTorch SDPA's answer without running a kernel:
    empty outputs, or O = 0, LSE = m = -inf, l = 0 and zero gradients.

    A call on CPU arrays that repeats an earlier one on the same thread with arrays of the
    same shapes, strides and dtypes (the same keywords and options; no out= arrays, array
    keywords but sinks, or progress) reuses that call's checked set-up, rebound to its
    arrays: the same bits, about 60 us less per call (pyfa/api.py, "Plans").

    Ctrl-C (or options.progress returning True) cancels a running call: the library
    stops and KeyboardInterrupt (CancelledError) is raised, with nothing of the
    caller's written. A Ctrl-C that comes after the library has finished, or during a
    call short enough to run on the main thread (milliseconds, tens at most), is too
    late to cancel: the call completes every output (out= arrays are never left partly
    written) and then raises KeyboardInterrupt.

    options.variant: "auto" (the fast, register-tiled kernels where they apply, else the
    readable ones), "reference" (the readable ones) or "fast" (ValueError naming what
    they lack where they do not apply); at the same tiles, the same bits either way.
    Without tiles "auto" keeps the readable kernels' default tiles wherever they set
    the bits (so FA1, whose defaults follow the paper's rule, runs its fast kernels only
    with tiles they are compiled for, e.g. block_r=block_c=64), and "fast" uses its own
    (pyfa.default_tiles(..., variant="fast")). The cpu backend has kernels of its own
    ("fast" is refused there)."""


Window = Optional[Tuple[Optional[int], Optional[int]]]


def fa2_forward(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
                window: Window = None, causal_align: str = "bottom_right",
                scale: Optional[float] = None, layout: str = "bhnd",
                options: Optional[Options] = None,
                out: Optional[Sequence[Optional[ArrayLike]]] = None, stream: Any = None,
                split_size: Union[None, int, str] = None, **mods) -> Tuple[Array, Array]:
    """FlashAttention-2 forward. Returns (o, lse): o like q, lse (log-sum-exp of each
    query row's scaled scores, -inf for a row with no visible key) q's shape without d.
    out: (o, lse), either None to allocate it.

    split_size: split-KV (flash-decoding with a fixed split size, docs/numerics.md):
    None or 0, one chunk; an int, keys per chunk, a multiple of the kernel's Bc, each
    chunk's partial (O, LSE) folded in ascending chunk order (pyfa.merge_states); or
    "decode", pyfa.checks.decode_split_size(d). With a fixed split size a row's bits
    depend on its q row and its visible keys alone (prefill equals decode).

    sinks: None, or float32 (H,) on q's device (gpt-oss's learned attention sinks, -inf
    for a head without one): a logit per query head that joins every row's softmax and
    carries no value. Each row's (o, lse) is the attention's merged with the state
    (0, sinks[h]) by merge_states' rule (pyfa.merge_sinks: the same bits), after the
    split chunks; a row that sees no key gets o = 0, lse = sinks[h]. fa2_backward on
    that (o, lse) is then the gradient of q, k, v, and pyfa.sinks_grad that of the sinks."""
    options, mods = _keywords("pyfa.fa2_forward", options, mods)
    sinks = _sinks_keyword("pyfa.fa2_forward", mods, "fa2", q, layout)
    return _run("fa2_forward", dict(q=q, k=k, v=v), causal=causal, window=window,
                causal_align=causal_align, scale=scale, layout=layout, options=options,
                out=out, stream=stream, mods=mods, split_size=split_size, sinks=sinks)


def fa2_backward(q: ArrayLike, k: ArrayLike, v: ArrayLike, o: ArrayLike, lse: ArrayLike,
                 do: ArrayLike, *, causal: bool = False, window: Window = None,
                 causal_align: str = "bottom_right", scale: Optional[float] = None,
                 layout: str = "bhnd", options: Optional[Options] = None,
                 out: Optional[Sequence[Optional[ArrayLike]]] = None, stream: Any = None,
                 split_size: Union[None, int, str] = None, **mods) -> Tuple[Array, Array, Array]:
    """FlashAttention-2 backward from the forward's saved o and lse (fa2_forward) and the
    incoming gradient do (like o). Returns (dq, dk, dv), shaped like q, k, v. The mask
    and scale must be the forward's. Deterministic: the same inputs give the same bits.
    out: (dq, dk, dv), each None to allocate it.

    split_size: the split backward (docs/numerics.md, "FA2 backward"): None or 0, none;
    an int S, a multiple of the dQ kernel's Bc and the dK/dV kernel's Br: dQ summed per
    key chunk of S keys and dK, dV per query chunk of S rows, the chunk sums folded in
    ascending chunk order, so that folding separate calls on the (query chunk, key
    chunk) blocks gives the same bits; or "decode", pyfa.checks.decode_split_size(d).
    With a bias, dbias (last) is the unsplit one, bit for bit."""
    options, mods = _keywords("pyfa.fa2_backward", options, mods)
    return _run("fa2_backward", dict(q=q, k=k, v=v, o=o, lse=lse, do=do), causal=causal,
                window=window, causal_align=causal_align, scale=scale, layout=layout,
                options=options, out=out, stream=stream, mods=mods, split_size=split_size)


def fa1_forward(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
                window: Window = None, causal_align: str = "bottom_right",
                scale: Optional[float] = None, layout: str = "bhnd",
                options: Optional[Options] = None,
                out: Optional[Sequence[Optional[ArrayLike]]] = None, stream: Any = None,
                **mods) -> Tuple[Array, Array, Array]:
    """FlashAttention-1 forward (the paper's Algorithm 1 as written). Returns (o, m, l):
    o like q; m (row max of the scaled scores) and l (sum of exp(score - m)) q's shape
    without d, as the paper keeps them for the backward; a row with no visible key gets
    o = 0, m = -inf, l = 0. out: (o, m, l), each None to allocate it."""
    options, mods = _keywords("pyfa.fa1_forward", options, mods)
    return _run("fa1_forward", dict(q=q, k=k, v=v), causal=causal, window=window,
                causal_align=causal_align, scale=scale, layout=layout, options=options,
                out=out, stream=stream, mods=mods)


def fa1_backward(q: ArrayLike, k: ArrayLike, v: ArrayLike, o: ArrayLike, m: ArrayLike,
                 l: ArrayLike, do: ArrayLike, *, causal: bool = False,  # noqa: E741 (the paper's l)
                 window: Window = None, causal_align: str = "bottom_right",
                 scale: Optional[float] = None, layout: str = "bhnd",
                 options: Optional[Options] = None,
                 out: Optional[Sequence[Optional[ArrayLike]]] = None, stream: Any = None,
                 **mods) -> Tuple[Array, Array, Array]:
    """FlashAttention-1 backward (the paper's Algorithm 4) from the forward's saved o, m, l
    (fa1_forward) and the incoming gradient do (like o). Returns (dq, dk, dv), shaped like
    q, k, v. The mask and scale must be the forward's. Deterministic: no atomics.
    out: (dq, dk, dv), each None to allocate it."""
    options, mods = _keywords("pyfa.fa1_backward", options, mods)
    return _run("fa1_backward", dict(q=q, k=k, v=v, o=o, m=m, l=l, do=do), causal=causal,
                window=window, causal_align=causal_align, scale=scale, layout=layout,
                options=options, out=out, stream=stream, mods=mods)


def _sinks_keyword(function, mods, algo, q, layout, grad=False):
    """The sinks keyword of a call that takes them (fa2_forward, attention, attention_grad,
    their varlen twins and attention_with_kvcache, whose q is "bnhd"), popped from mods and
    checked before anything runs or is written, or None: a NumPy float32 (H,) array with
    no NaN or +inf, or a CUDA array (checked by _sinks_tensor; its values are the
    caller's to give, as CUDA ALiBi slopes are). The library's FA2 forward merges them
    into each row's final state. A call that also returns dsinks (grad: pyfa.sinks_grad,
    NumPy, after the backward) takes CPU arrays only and is not one pyfa.prepare replays."""
    sinks = mods.pop("sinks", None)
    if sinks is None:
        return None
    if algo != "fa2":
        raise InvalidArgumentError(f"sinks: only algo='fa2' takes sinks (they join its LSE), got {algo!r}")
    if _arrays.common_place({"q": q, "sinks": sinks}).kind != "cpu":
        if grad:
            raise InvalidArgumentError(f"sinks: {function} computes dsinks on the CPU only in this version "
                                       "(the forward takes CUDA sinks)")
        return sinks
    if grad and prepared.recording() is not None:
        raise InvalidArgumentError(f"sinks: {function} under pyfa.prepare replays the library's calls alone, "
                                   "and dsinks is computed after them; prepare the forward with sinks and the "
                                   "backward without, and call pyfa.sinks_grad")
    s = _arrays.host_array("sinks", sinks)
    if not isinstance(s, np.ndarray) or s.dtype != np.float32:
        raise ArgumentTypeError(f"sinks: expected a float32 array (H,), got "
                                f"{getattr(s, 'dtype', type(s).__name__)}")
    qh = _arrays.host_array("q", q)
    if isinstance(qh, np.ndarray) and 2 <= qh.ndim <= 4:
        from .sim.merge import check_sinks  # the merge's own checks: one per head, no NaN or +inf
        check_sinks(s, as_4d(qh, check_layout(layout)).shape[1])
    return s


def _sinks_tensor(sinks, intake):
    """((address, strides (0, 0, 0)), what keeps it alive): the pyfa_tensors.sinks of a
    library call, the checked NumPy array (a copy where it is not contiguous and aligned)
    or a contiguous CUDA float32 array (H,) on q's device."""
    ffi, _ = _lib.load()
    H = intake.dims[1]
    if isinstance(sinks, np.ndarray):
        s = c_aligned(sinks)
        return (_address(ffi, s), (0, 0, 0)), s
    if intake.place.kind == "cpu":
        raise InvalidArgumentError(f"sinks: on {_arrays.place_of('sinks', sinks)}, but q is on the CPU")
    place = _arrays.place_of("sinks", sinks)
    if place.index is not None and intake.place.index is not None and place != intake.place:
        raise InvalidArgumentError(f"sinks: on {place}, but q is on {intake.place}")
    t = _arrays.device_tensor("sinks", sinks, intake.stream)
    if t.shape != (H,):
        raise InvalidArgumentError(f"sinks: expected shape ({H},), one per query head, got {t.shape}")
    if t.strides not in (None, (1,)):
        raise InvalidArgumentError(f"sinks: must be contiguous, got element strides {t.strides}")
    return (t.ptr, (0, 0, 0)), t


def _merge_sinks_in_place(o, lse, sinks, layout):
    """o and lse (a forward's with no key, at the caller's rank and layout, CPU) replaced
    by their merge with the sinks (pyfa.merge_sinks), as the library merges a row's."""
    from .kvcache import merge_sinks
    o4 = as_4d(_arrays.host_array("o", o), layout)
    lse_h = _arrays.host_array("lse", lse)
    lse3 = lse_h[(None,) * (3 - lse_h.ndim)]
    merged_o, merged_lse = merge_sinks(o4, lse3, sinks)
    np.copyto(o4, merged_o)
    np.copyto(lse3, merged_lse)


def _sinks_grad(o, lse, do, sinks, layout, q):
    """dsinks (pyfa.sinks_grad, as q's kind) from the merged o and lse of
    _merge_sinks_in_place and the incoming gradient do, at the caller's rank and layout."""
    from .kvcache import sinks_grad
    lse_h = _arrays.host_array("lse", lse)
    dsinks = sinks_grad(as_4d(_arrays.host_array("o", o), layout), lse_h[(None,) * (3 - lse_h.ndim)],
                        as_4d(np.asarray(_arrays.host_array("do", do), np.float32), layout), sinks)
    return _arrays.as_kind(_arrays.library_of(q), dsinks)


# algo -> the forward pass; attention() takes its first output, O.
_FORWARD = {"fa1": fa1_forward, "fa2": fa2_forward}


def _algo(algo):
    if not isinstance(algo, str) or algo not in _FORWARD:
        raise InvalidArgumentError(f"algo: expected one of {sorted(_FORWARD)}, got {algo!r}")
    return algo


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
              window: Window = None, causal_align: str = "bottom_right",
              scale: Optional[float] = None, algo: str = "fa2", layout: str = "bhnd",
              options: Optional[Options] = None, out: Optional[ArrayLike] = None,
              stream: Any = None, split_size: Union[None, int, str] = None, **mods) -> Array:
    """O = softmax(scale * Q K^T [masked]) V by FlashAttention.

    q: (B, H, Nq, d), (H, Nq, d) or (Nq, d) float32 in layout "bhnd" ((B, Nq, H, d), ...
    in "bnhd"); k, v: the same with Nk rows and Hkv heads. algo: "fa1" or "fa2". How it
    runs (backend, tiles, threads, progress, ...) is `options`, a pyfa.Options (None: the
    enclosing `with pyfa.Options(...)` block's, else the defaults: the best backend
    here). out: an array like q to write O into. split_size: FA2's split-KV
    (pyfa.fa2_forward); FA1 refuses it. sinks: None, or float32 (H,) on q's device
    (gpt-oss's learned attention sinks): as in pyfa.fa2_forward; FA1 refuses them."""
    options, mods = _keywords("pyfa.attention", options, mods)
    fn = _FORWARD[_algo(algo)]
    if algo == "fa1":  # refuses sinks by name; FA2's are fa2_forward's to check
        _sinks_keyword("pyfa.attention", mods, algo, q, layout)
    extra = 2 if algo == "fa1" else 1  # m, l or lse: allocated
    if algo == "fa1":
        if split_size not in (None, 0):
            raise InvalidArgumentError(f"split_size: only algo='fa2' splits the keys, got {split_size!r}")
    else:
        mods = dict(mods, split_size=split_size)
    return fn(q, k, v, causal=causal, window=window, causal_align=causal_align, scale=scale,
              layout=layout, options=options,
              out=None if out is None else (out,) + (None,) * extra, stream=stream, **mods)[0]


def attention_grad(q: ArrayLike, k: ArrayLike, v: ArrayLike, do: ArrayLike, *,
                   causal: bool = False, window: Window = None,
                   causal_align: str = "bottom_right", scale: Optional[float] = None,
                   algo: str = "fa2", layout: str = "bhnd", options: Optional[Options] = None,
                   out: Optional[Sequence[Optional[ArrayLike]]] = None, stream: Any = None,
                   split_size: Union[None, int, str] = None, **mods) -> Tuple[Array, Array, Array, Array]:
    """The forward and backward of attention(q, k, v, ...) for the incoming gradient do
    (like the output): returns (o, dq, dk, dv), o like q and the gradients like q, k, v.
    Arguments as in attention(); do is checked before any kernel runs; options.progress
    sees each of the two calls in turn. out: (o, dq, dk, dv), each None to allocate it;
    a CPU out= o is written once the backward has succeeded (a backward that fails or is
    cancelled leaves it as it was; not so in pyfa.prepare's replays, which write it with
    the forward). A Ctrl-C during the forward is raised before the backward.
    With bias=: (o, dq, dk, dv, dbias), dbias of the bias's shape (out= then takes five),
    unless bias_grad=False.
    split_size: algo "fa2" only, given to both the split forward (fa2_forward) and the
    split backward (fa2_backward).
    sinks: as in attention(), CPU arrays only; the backward then runs on the merged state
    and dsinks (pyfa.sinks_grad, the sinks' shape, q's kind) comes last."""
    options, mods = _keywords("pyfa.attention_grad", options, mods)
    _algo(algo)
    sinks = _sinks_keyword("pyfa.attention_grad", mods, algo, q, layout, grad=True)
    bias_grad = _bias_grad("pyfa.attention_grad", mods, True)
    with_dbias = bias_grad and mods.get("bias") is not None
    outs = _out_dict("attention_grad", ("o", "dq", "dk", "dv") + (("dbias",) if with_dbias else ()), out)
    intake = _intake(dict(q=q, k=k, v=v, do=do), stream, options.backend, layout, outs)
    _refuse_given_overlaps(intake, outs)
    kw = dict(causal=causal, window=window, causal_align=causal_align, scale=scale,
              layout=layout, options=options, stream=stream, **mods)
    grads = (outs["dq"], outs["dk"], outs["dv"]) + ((outs["dbias"],) if with_dbias else ())
    if algo == "fa1" and split_size not in (None, 0):
        raise InvalidArgumentError(f"split_size: only algo='fa2' splits, got {split_size!r}")
    # One interrupts_after block over both calls: a Ctrl-C after the backward is raised
    # once o is complete.
    with _lib.interrupts_after():
        o_out, finish = _stage_o(intake, outs, f"{algo}_forward", _array_keywords(mods))
        if algo == "fa1":
            o, m, l = fa1_forward(q, k, v, out=(o_out, None, None), **kw)
            _lib.raise_pending_interrupt()
            grads = fa1_backward(q, k, v, o, m, l, do, out=grads, bias_grad=bias_grad, **kw)
        else:
            o, lse = fa2_forward(q, k, v, out=(o_out, None), split_size=split_size,
                                 **(kw if sinks is None else dict(kw, sinks=sinks)))
            _lib.raise_pending_interrupt()
            grads = fa2_backward(q, k, v, o, lse, do, out=grads, split_size=split_size, bias_grad=bias_grad,
                                 **kw)
            if sinks is not None:
                grads = (*grads, _sinks_grad(o, lse, do, sinks, layout, q))
        return (finish(o), *grads)


for _f in (fa2_forward, fa2_backward, fa1_forward, fa1_backward, attention, attention_grad):
    if _f.__doc__:  # absent under python -OO
        _f.__doc__ += "\n" + _COMMON_DOC
del _f


def backends() -> List[str]:
    """The backends that can run here, best first ("cuda" only with a usable GPU);
    unavailable_backends() says why the others cannot."""
    _, lib = _lib.load()
    return [name for name, b in BACKENDS.items() if name != "auto" and lib.pyfa_backend_available(b)]


def unavailable_backends() -> Dict[str, str]:
    """{backend: why it cannot run here} for each backend that cannot, e.g.
    {"cuda": "this libpyfa was built without nvcc"}; the reason is the library's own
    (pyfa_backend_reason), the CUDA driver's error where there is one."""
    _, lib = _lib.load()
    return {name: _reason(lib, b) for name, b in BACKENDS.items()
            if name != "auto" and not lib.pyfa_backend_available(b)}


def device_profile(backend: str = "auto") -> Dict[str, Union[str, int]]:
    """The limits the kernels are sized against: a dict with name, smem_per_block,
    max_threads_per_block, sm_count."""
    ffi, lib = _lib.load()
    prof = ffi.new("pyfa_device_profile *")
    _lib.check(lib.pyfa_device_profile_get(_choice("backend", backend, BACKENDS), prof))
    return {"name": ffi.string(prof.name).decode(), "smem_per_block": prof.smem_per_block,
            "max_threads_per_block": prof.max_threads_per_block, "sm_count": prof.sm_count}


def default_tiles(kernel: str, head_dim: int, backend: str = "auto",
                  variant: str = "reference") -> Tuple[int, int]:
    """(Br, Bc) the library uses for `kernel` (e.g. "fa2_forward") at this head dim when
    no tiles are given: the readable kernel's ("reference", what pyfa.sim mirrors), the
    fast kernel's ("fast": ValueError naming what it lacks where it has none, and on the
    cpu backend, whose kernels are its own) or what variant="auto" runs."""
    ffi, lib = _lib.load()
    kernel_id = _choice("kernel", kernel, KERNELS)
    d = check_int("head_dim", head_dim, 1, MAX_HEAD_DIM)
    br, bc = ffi.new("int *"), ffi.new("int *")
    _lib.check(lib.pyfa_variant_default_tiles(kernel_id, _choice("variant", variant, VARIANTS), d,
                                              _choice("backend", backend, BACKENDS), br, bc))
    return br[0], bc[0]


def smem_bytes(kernel: str, block_r: int, block_c: int, head_dim: int,
               variant: str = "reference") -> int:
    """Bytes of dynamic shared memory `kernel` (of this variant) needs for these tiles; 0
    when the library has no size for them (a value out of its range). An unknown kernel or
    variant name is an InvalidArgumentError naming it."""
    _, lib = _lib.load()
    return lib.pyfa_variant_smem_bytes(_choice("kernel", kernel, KERNELS),
                                       _choice("variant", variant, VARIANTS),
                                       check_int("block_r", block_r, -INT_MAX - 1, INT_MAX),
                                       check_int("block_c", block_c, -INT_MAX - 1, INT_MAX),
                                       check_int("head_dim", head_dim, -INT64_MAX - 1, INT64_MAX))


def dropout_mask(batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, dropout_p: float,
                 seed: Optional[int], offset: int = 0, dropout_origin=(0, 0, 0, 0)) -> np.ndarray:
    """The keep decisions of dropout (docs/numerics.md, "Dropout") as a bool array
    (B, H, Nq, Nk), True where element (b, h, i, j) of P is kept: what the kernels apply
    for these dropout_p, seed, offset and dropout_origin (the role of flash-attn's
    return_attn_probs), computed by the library with the function the kernels call.
    pyfa.sim.dropout_mask gives the same bits in NumPy. dropout_p 0: all True."""
    dims, mods = check_dropout_mask("pyfa.dropout_mask", batch, heads, seqlen_q, seqlen_k, dropout_p, seed,
                                    offset, dropout_origin)
    keep = np.zeros(dims, np.uint8)
    if keep.size:
        ffi, lib = _lib.load()
        problem = _problem(dims + (1, dims[1]), None, False, None, "bottom_right", mods)
        _lib.check(lib.pyfa_dropout_mask(problem, ffi.cast("uint8_t *", keep.ctypes.data)))
    return keep.view(np.bool_)


def library_version() -> str:
    """The version of the loaded libpyfa (pyfa_version()); equals pyfa.__version__."""
    ffi, lib = _lib.load()
    return ffi.string(lib.pyfa_version()).decode()
