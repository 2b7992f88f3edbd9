"""What every simulated kernel function shares around its body: the Options it takes
(pyfa/options.py; the simulator uses block_r, block_c and progress), the deprecated
block_r=, block_c= keywords, and the progress callback.

Progress is counted in bytes through HBM: `total` is the IO model's count for the call
(count_io, which the simulator's own record equals: tests/test_io_*.py) and `done` the
bytes the simulated kernels have recorded so far, reported as each tile's transfer is
recorded (pyfa/sim/io.py observer).
"""

import dataclasses
import functools
import inspect

import numpy as np

from ..checks import (EMPTY_VALUES, ScoreMods, caller_shape, check_bias, check_like, check_qkv, check_rows,
                      check_split_size, is_empty, mask_bounds, resolve_scale)
from ..errors import CancelledError
from ..options import cancels, resolve
from . import io
from .count import count_io
from .merge import checked_sinks

TILES = ("block_r", "block_c")


class _Reporter:
    def __init__(self, function, progress, total):
        self.function, self.progress, self.total, self.done = function, progress, total, 0

    def report(self):
        if cancels(self.progress(min(self.done, self.total), self.total)):
            raise CancelledError(f"{self.function}: cancelled by its progress callback")

    def __call__(self, nbytes):
        self.done += nbytes
        self.report()


def _total(algo, passes, args, kwargs, options):
    layout = kwargs.get("layout", "bhnd")
    q4, k4, _, _, heads_kv = check_qkv(*args[:3], layout)
    B, H, Nq, d = q4.shape
    mask = {n: kwargs[n] for n in ("causal", "window", "causal_align") if n in kwargs}
    if kwargs.get("bias") is not None:  # checked by the kernel's own ScoreMods.resolve first
        mask["bias"] = tuple(np.shape(kwargs["bias"]))
    return count_io(algo, passes=passes, batch=B, heads=H, seqlen_q=Nq, seqlen_k=k4.shape[2],
                    head_dim=d, heads_kv=heads_kv, block_r=options.block_r,
                    block_c=options.block_c, **mask).total


ROWS = ("lse", "m", "l")  # per-row tensors, (B, H, Nq); the others are 4-D


def _empty(name, result_class, tensors, kwargs, named):
    """The result of an empty problem (Nq = 0 or Nk = 0), as pyfa's API gives it
    (checks.EMPTY_VALUES), after the checks the kernel would make, the score modifications
    (every keyword but the kernel's own, `named`) and split_size included; None when the
    problem is not empty."""
    layout = kwargs.get("layout", "bhnd")
    q4, k4, _, rank, heads_kv = check_qkv(tensors["q"], tensors["k"], tensors["v"], layout)
    if not is_empty(q4.shape[2], k4.shape[2]):
        return None
    dims = (*q4.shape[:3], k4.shape[2], q4.shape[3], heads_kv)
    ScoreMods.resolve(name, dims, kwargs.get("causal_align", "bottom_right"),
                      **{n: x for n, x in kwargs.items() if n not in named})
    check_split_size(kwargs.get("split_size"), q4.shape[3])
    for name, x in tensors.items():
        if name in ROWS:
            check_rows(name, x, q4)
        elif name not in ("q", "k", "v"):
            check_like(name, x, q4, layout)
    mask_bounds(kwargs.get("causal", False), kwargs.get("window"),
                kwargs.get("causal_align", "bottom_right"), q4.shape[2], k4.shape[2])
    resolve_scale(kwargs.get("scale"), q4.shape[3])
    fields = {}
    for f in dataclasses.fields(result_class):
        if f.name == "io":
            fields["io"] = io.IORecord(label=f"{result_class.__name__}: empty problem")
            continue
        if f.name == "dbias":  # with bias=: zeros of its shape
            if kwargs.get("bias") is not None:
                bias = check_bias("bias", kwargs["bias"], (*q4.shape[:3], k4.shape[2]))
                fields["dbias"] = np.zeros(bias.shape, np.float32)
            continue
        shape = (q4.shape[:3][4 - rank:] if f.name in ROWS else
                 caller_shape((k4 if f.name in ("dk", "dv") else q4).shape, rank, layout))
        fields[f.name] = np.full(shape, EMPTY_VALUES[f.name], np.float32)
    sinks = checked_sinks(kwargs.get("sinks"), q4.shape[1]) if "sinks" in named else None
    if sinks is not None:  # rows that see no key: the sink's state (O = 0, LSE = sinks[h])
        fields["lse"] = np.broadcast_to(sinks[None, :, None], q4.shape[:3]).reshape(fields["lse"].shape).copy()
    return result_class(**fields)


def simulated(algo, passes, result_class):
    """Decorates the simulated kernel function of (algo, passes), whose body takes
    block_r= and block_c= and returns a result_class: the public function takes options=
    instead (a pyfa.Options; None: the enclosing `with pyfa.Options(...)` block's),
    reports progress, and answers an empty problem (Nq = 0 or Nk = 0) itself."""
    def wrap(kernel):
        name = f"pyfa.sim.{kernel.__name__}"
        parameters = inspect.signature(kernel).parameters.items()
        tensor_names = [n for n, p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
        named = {n for n, p in parameters if p.kind != p.VAR_KEYWORD}

        @functools.wraps(kernel)
        def run(*args, options=None, **kwargs):
            legacy = {n: kwargs.pop(n) for n in TILES if n in kwargs}
            options = resolve(name, options, legacy, allowed=TILES)
            tiles = dict(block_r=options.block_r, block_c=options.block_c)
            empty = _empty(name, result_class, dict(zip(tensor_names, args)), kwargs, named)
            if empty is not None:
                return empty
            if options.progress is None:
                return kernel(*args, **tiles, **kwargs)
            reporter = _Reporter(name, options.progress, _total(algo, passes, args, kwargs, options))
            token = io.observer.set(reporter)
            try:
                result = kernel(*args, **tiles, **kwargs)
            finally:
                io.observer.reset(token)
            if reporter.done < reporter.total:
                reporter.done = reporter.total
                reporter.report()
            return result

        signature = inspect.signature(kernel)
        params = [p for n, p in signature.parameters.items() if n not in TILES]
        at = next((n for n, p in enumerate(params) if p.kind == p.VAR_KEYWORD), len(params))
        params.insert(at, inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None))
        run.__signature__ = signature.replace(parameters=params)
        return run
    return wrap
