"""pyfa.prepare: one call checked and set up once, then replayed on the same arrays.

A decoding loop calls the same op on the same buffers thousands of times, and at a
context of 8k keys the Python around each call (argument checks, the library's
structs, outputs) is a tenth of a CPU decoding step (docs/cpu_backend.md). A
PreparedCall keeps what one call built and makes only the library calls again, as a
replayed CUDA graph or FlashInfer's plan/run do: the arrays are bound by reference, and
each replay reads their contents as they are then.

How it records: prepare() runs the call once with a _Recording active on this thread;
pyfa.api's host path reports each library call (its entry point and structs) and every
array the library reads or writes. A recording is refused where a replay would differ
from a fresh call: an array pyfa had to copy (a replay would read the stale copy) or an
output written through a staging copy, CUDA arrays, and calls that run no kernel.
"""

import contextlib
import inspect
import threading
from typing import Any, Callable

import numpy as np

from . import _lib
from .errors import ArgumentTypeError, InvalidArgumentError

_state = threading.local()


def recording():
    """The _Recording of the prepare() running on this thread, or None."""
    return getattr(_state, "recording", None)


@contextlib.contextmanager
def paused():
    """A block whose library calls a prepare() running on this thread does not record
    (checks that run a call of their own)."""
    rec = recording()
    _state.recording = None
    try:
        yield
    finally:
        _state.recording = rec


class _Recording:
    def __init__(self, function, roots, quiet=False):
        self.function = function
        self.roots = roots  # the caller's NumPy arrays: what a replay may read and write
        self.ours = []      # arrays pyfa allocated (outputs) that the replays write again
        self.steps = []     # (entry point, config, args, progress, quick)
        self.keep = []      # what keeps the steps' structs and addresses alive
        self.around = None  # the function's own work around its steps on each replay
        self.quiet = quiet  # capturing(): a copy marks the recording refused instead of raising
        self.refused = False

    def bound(self, label, x):
        """Refuses the recording unless the library's array x is (a view of) one of the
        caller's arrays or an output pyfa allocated for this call."""
        if any(np.may_share_memory(x, r) for r in self.roots + self.ours):
            self.keep.append(x)
            return
        if self.quiet:
            self.refused = True
            return
        raise InvalidArgumentError(
            f"{label}: {self.function} reads a copy pyfa made of it (strides the library cannot "
            "address, or not a NumPy array of its dtype), so a replay would not see its changes; pass "
            "a NumPy array of the dtype it takes, its last axis contiguous, or call the function directly")

    def output(self, label, given, view, written):
        """An output: allocated by pyfa (given None) or the caller's, written in place."""
        if given is None:
            self.ours.append(written)
            self.keep.append(written)
        elif view is not written:
            if self.quiet:
                self.refused = True
                return
            raise InvalidArgumentError(
                f"{label}: not C-contiguous, so pyfa writes it through a staging copy after each "
                "call; pass a C-contiguous array to prepare()")
        else:
            self.bound(label, written)

    def step(self, fn, config, args, progress, quick):
        self.steps.append((fn, config, args, progress, quick))
        self.keep.append(args)

    def replay_around(self, around):
        """around(steps): what a replay runs instead of steps() alone (the function's checks
        of the values it reads on the host, writes before and after its library calls)."""
        self.around = around


@contextlib.contextmanager
def capturing(function, roots):
    """A block whose library calls are recorded as prepare() records them, for a plan (a
    call's set-up kept for later calls on other arrays of the same kinds, which rebind
    it): where prepare() would refuse (an array pyfa copies), the recording is marked
    refused instead, and the call goes on as a plain one. Yields the _Recording."""
    if recording() is not None:
        raise InvalidArgumentError(f"{function}: capturing() while a recording runs on this thread")
    rec = _Recording(function, roots, quiet=True)
    _state.recording = rec
    try:
        yield rec
    finally:
        _state.recording = None


def _leaves(value):
    """The arguments inside value, tuples, lists and dicts (out=, keywords) opened."""
    if isinstance(value, (tuple, list)):
        for x in value:
            yield from _leaves(x)
    elif isinstance(value, dict):
        for x in value.values():
            yield from _leaves(x)
    else:
        yield value


class PreparedCall:
    """A pyfa call set up once (pyfa.prepare); calling it makes the library calls again
    on the same arrays and returns what the first call returned (the same output arrays,
    written again). Not to be called from two threads at once: they share outputs."""

    def __init__(self, function: str, steps, keep, result, around=None):
        self.function = function
        self._steps = steps
        self._keep = keep
        self._around = around
        self.result = result

    def _run_steps(self):
        for fn, config, args, progress, quick in self._steps:
            with _lib.interrupts_after():
                _lib.call(fn, config, *args, progress=progress, quick=quick)

    def __call__(self) -> Any:
        if self._around is None:
            self._run_steps()
        else:
            self._around(self._run_steps)
        return self.result

    def __repr__(self):
        return f"<pyfa.PreparedCall of {self.function}: {len(self._steps)} library call(s)>"


def prepare(function: Callable, *args, **kwargs) -> PreparedCall:
    """function(*args, **kwargs), made once now and set up to be made again: returns a
    PreparedCall p; p() makes the same library calls on the same arrays, skipping the
    Python that checks the arguments and builds the library's structs (0.07 of 0.085 ms
    for a small decoding step, about a tenth of one at 8k keys on the CPU), and returns
    what the first call returned, its outputs written again. p.result: that first
    return value.

    function: pyfa.attention, attention_grad, fa1_forward, fa2_forward, fa1_backward,
    fa2_backward or attention_with_kvcache; its arguments as that function takes them,
    NumPy arrays only.
    Arrays are bound by reference, like a replayed CUDA graph's: each p() reads the
    current contents of q, k, v, ... (write a decoding step's new query into q, or the
    cache's new rows into k and v, in place) and writes the outputs (out= arrays, or
    those the first call allocated) in place. Everything else (shapes, strides, options,
    the enclosing `with pyfa.Options(...)`, masks, scale, score modifications) is fixed
    when prepared (dropout's seed and offset too: every replay draws the same mask). The
    bits are those of the function called afresh on the same contents.

    attention_with_kvcache: each replay reads cache_seqlens (and block_table) again,
    checks them as the call does, appends k_new and v_new at cache_seqlens and attends
    to cache_seqlens + Nnew keys; prepare() itself makes the first such step. A decoding
    loop writes the next token's q, k_new, v_new in place and adds Nnew to cache_seqlens
    between replays; its rows have the bits of one prefill with a fixed split_size. Its
    sinks= are read and checked again on each replay before the append. Elsewhere sinks=
    are bound as the other arrays are (the library reads them; a replay does not check
    their values again); attention_grad with sinks (whose dsinks is NumPy's, after the
    library's calls) is refused.

    Refused (InvalidArgumentError naming the argument) where a replay could not be the
    fresh call: an array pyfa would copy rather than read in place (a last axis that is
    not contiguous), an out= array that is not C-contiguous, CUDA arrays, Nq = 0
    or Nk = 0 (no kernel runs). Errors, cancellation and Ctrl-C behave on every replay as
    in the function itself: a replay that fails leaves the outputs (and the cache) as
    they were."""
    from . import api, kvcache
    name = getattr(function, "__name__", None)
    if function not in (api.attention, api.attention_grad, api.fa1_forward, api.fa2_forward,
                        api.fa1_backward, api.fa2_backward, kvcache.attention_with_kvcache):
        raise ArgumentTypeError(
            "function: pyfa.prepare takes pyfa.attention, attention_grad, fa1_forward, fa2_forward, "
            f"fa1_backward, fa2_backward or attention_with_kvcache, got {name or type(function).__name__}")
    label = f"pyfa.prepare({name})"
    if recording() is not None:
        raise InvalidArgumentError(f"{label}: called while another prepare() records on this thread")
    try:
        named = inspect.signature(function).bind(*args, **kwargs).arguments
    except TypeError as e:
        raise ArgumentTypeError(f"{label}: {e}") from None
    roots = []
    for key, value in named.items():
        for x in _leaves(value):
            if isinstance(x, np.ndarray):
                roots.append(x)
            elif hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
                raise ArgumentTypeError(f"{key}: {label} takes NumPy arrays only, got {type(x).__name__}")
    rec = _Recording(label, roots)
    _state.recording = rec
    try:
        result = function(*args, **kwargs)
    finally:
        _state.recording = None
    if not rec.steps:
        raise InvalidArgumentError(f"{label}: Nq = 0 or Nk = 0, so no kernel runs; there is nothing to replay")
    return PreparedCall(name, rec.steps, rec.keep, result, rec.around)
