"""pyfa.Options: how a call runs, apart from what it computes.

The functions of pyfa (and of pyfa.sim) take the problem's semantics as keywords (causal,
window, causal_align, scale, layout) and everything about execution (backend, tiles,
kernel variant, threads, the emulator's knobs, a progress callback) in one Options value:

    o = pyfa.attention(q, k, v, causal=True, options=pyfa.Options(backend="emu"))
    with pyfa.Options(backend="cpu", threads=4):
        o = pyfa.attention(q, k, v)          # the calls in this context run so

An Options in a `with` block is the default of every call in that context (a
contextvars.ContextVar, so each thread and each asyncio task has its own); options=
given to a call replaces it for that call. The keywords these options replace still work
for one release, with a DeprecationWarning naming the replacement. Needs neither the
compiled library nor the simulator, which both use it.
"""

import contextvars
import dataclasses
import warnings
from typing import Callable, Optional

import numpy as np

from .checks import check_int, check_tile
from .errors import ArgumentTypeError, Error, InvalidArgumentError

# progress(done, total): True cancels the call.
Progress = Callable[[int, int], Optional[bool]]


def cancels(answer):
    """Whether a progress callback's answer cancels its call: True (or NumPy's True) does,
    None and False do not; anything else is refused rather than read by its truth."""
    if answer is None or isinstance(answer, (bool, np.bool_)):
        return bool(answer)
    raise ArgumentTypeError(f"progress: must return None, False or True (True cancels), got "
                            f"{type(answer).__name__}")

INT_MAX = 2**31 - 1
EMU_CHECKS = ("off", "strict")  # Options.emu_check: "strict" sets PYFA_FLAG_EMU_STRICT


@dataclasses.dataclass(frozen=True)
class Options:
    """How a call runs; none of it changes the results' bits (docs/numerics.md), except
    block_r, block_c (Br, Bc) and variant where they pick the tiles.

    backend: "auto" (CUDA when a GPU is usable, else "cpu"), "cuda", "cpu" (native,
    vectorised) or "emu" (the kernel source run by the emulator). block_r, block_c: the
    tiles Br, Bc; None: the kernel's default. variant: "auto", "reference" or "fast"
    (see pyfa.fa2_forward). threads: OS threads of the cpu backend (0: one per core,
    fewer on calls too small to gain from them). emu_order ("forward", "reverse",
    "shuffled"), emu_seed, emu_workers: the emulator's thread order after each barrier,
    the seed of "shuffled", its OS threads (0: one per core). progress: None, or a callable(done, total) called now and then while a call
    runs; returning True cancels it (pyfa.CancelledError). emu_check: "off", or "strict":
    the emulator checks every shared and global access of its kernels and raises
    pyfa.KernelHazardError at the first hazard (docs/emulator.md; many times slower).

    The simulator (pyfa.sim) uses block_r, block_c and progress; the others choose how
    the library computes bits that the simulator reproduces whatever they are.
    """
    backend: str = "auto"
    block_r: Optional[int] = None
    block_c: Optional[int] = None
    variant: str = "auto"
    threads: int = 0
    emu_order: str = "forward"
    emu_seed: int = 0
    emu_workers: int = 0
    progress: Optional[Progress] = None
    emu_check: str = "off"

    def __post_init__(self):
        # The names of backends, variants and orders are pyfa.h's, checked by the call
        # that uses them (the simulator never reads them, and needs no header).
        for name in ("backend", "variant", "emu_order", "emu_check"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ArgumentTypeError(f"{name}: expected a str, got {type(value).__name__} {value!r}")
        if self.emu_check not in EMU_CHECKS:
            raise InvalidArgumentError(f"emu_check: expected one of {', '.join(map(repr, EMU_CHECKS))}, "
                                       f"got {self.emu_check!r}")
        check_tile("block_r", self.block_r)
        check_tile("block_c", self.block_c)
        check_int("threads", self.threads, 0, INT_MAX)
        check_int("emu_seed", self.emu_seed, 0, 2**64 - 1)
        check_int("emu_workers", self.emu_workers, 0, INT_MAX)
        if self.progress is not None and not callable(self.progress):
            raise ArgumentTypeError(f"progress: expected a callable(done, total) or None, "
                                    f"got {type(self.progress).__name__}")

    def replace(self, **changes) -> "Options":
        """A copy with some fields changed (an unknown name is a TypeError); this Options
        itself when there are none, as it is frozen (pyfa.torch asks on every call)."""
        return dataclasses.replace(self, **changes) if changes else self

    def __enter__(self) -> "Options":
        _active.set(_active.get() + (self,))
        return self

    def __exit__(self, *exc):
        stack = _active.get()
        if not stack or stack[-1] is not self:
            raise RuntimeError("pyfa.Options: contexts must be left in the order they were entered")
        _active.set(stack[:-1])
        return False

    @staticmethod
    def current() -> "Options":
        """The Options in effect here: the innermost `with` block's, else the defaults."""
        stack = _active.get()
        return stack[-1] if stack else _DEFAULT


_DEFAULT = Options()
# The Options of the enclosing `with` blocks, innermost last (a tuple, so that a context
# copied into another thread or task never shares a list with this one).
_active = contextvars.ContextVar("pyfa_options", default=())

FIELDS = tuple(f.name for f in dataclasses.fields(Options))


def _init_naming_unknown_options(init):
    # The dataclass's own __init__ refuses an unknown name with a plain TypeError; pyfa's
    # errors are pyfa.Error, and this one lists what there is (replace() comes here too).
    def __init__(self, *args, **given):
        for name in given:
            if name not in FIELDS:
                raise ArgumentTypeError(f"pyfa.Options: unknown option {name!r} (the options: "
                                        f"{', '.join(FIELDS)})")
        try:
            init(self, *args, **given)
        except TypeError as e:  # too many positional arguments, one given twice
            if isinstance(e, Error):
                raise
            raise ArgumentTypeError(f"pyfa.Options: {e}") from None
    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
    return __init__


Options.__init__ = _init_naming_unknown_options(Options.__init__)


def resolve(function, options, legacy, allowed=FIELDS):
    """The Options a call to `function` (its public name, for messages) runs with:
    `options` (an Options, or None for the context's), with the deprecated keyword forms
    in `legacy` ({name: value}, only names in `allowed`) applied over it."""
    if options is None:
        options = Options.current()
    elif not isinstance(options, Options):
        raise ArgumentTypeError(f"options: expected a pyfa.Options or None, got {type(options).__name__}")
    if not legacy:
        return options
    for name in legacy:
        if name not in allowed:
            raise ArgumentTypeError(f"{function}() got an unexpected keyword argument {name!r}")
    given = ", ".join(f"{name}=..." for name in legacy)
    warnings.warn(f"{function}(..., {given}) is deprecated and will be removed in the next "
                  f"release: pass options=pyfa.Options({given}) or run the call inside "
                  f"`with pyfa.Options({given}):`", DeprecationWarning, stacklevel=3)
    return options.replace(**legacy)
