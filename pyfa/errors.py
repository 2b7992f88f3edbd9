"""pyfa's exceptions: one hierarchy rooted at pyfa.Error, raised alike by the library's
Python API and by the simulator (pyfa.sim), which imports this module and nothing that
needs the compiled library.

Argument errors are also the builtin class a caller would expect (InvalidArgumentError is
a ValueError, ArgumentTypeError a TypeError, TileTooLargeError an InvalidArgumentError),
so `except ValueError` keeps working. Each pyfa_status of src/include/pyfa.h maps to one
class through STATUS_CLASSES, keyed by the status's name; pyfa/_lib.py turns the names
into the header's values.
"""


import re


class Error(Exception):
    """Any error pyfa raises on purpose; .status is the pyfa_status value the library
    returned, or None when the error was found in Python (before or without the library).
    pyfa.PyfaError is another name for it, kept for one release."""

    def __init__(self, message="", status=None):
        super().__init__(message)
        self.status = status


# The name pyfa used before pyfa.Error; kept for one release.
PyfaError = Error


class InvalidArgumentError(Error, ValueError):
    """An argument's value is refused; the message names the argument."""


class ArgumentTypeError(Error, TypeError):
    """An argument's type is refused; the message names the argument."""


class TileTooLargeError(InvalidArgumentError):
    """The tiles need more shared memory than the device has (the library's refusal, and
    the simulator's for the same tiles)."""


class LibraryNotFoundError(Error, ImportError):
    """libpyfa could not be found or loaded, or the file found is not this pyfa's libpyfa."""


class BackendUnavailableError(Error, RuntimeError):
    """The backend asked for cannot run here (e.g. CUDA without a GPU)."""


class CudaError(Error, RuntimeError):
    """A CUDA runtime call failed."""


class EmulationError(Error, RuntimeError):
    """The emulator found a barrier divergence or a deadlock in a kernel."""


class KernelHazardError(EmulationError):
    """The emulator's strict mode (Options(emu_check="strict"), PYFA_EMU_CHECK=strict) found
    a hazard in a kernel: a race, async, init, bounds, align or barrier check failed. The
    message names the kernel and variant, the check, the buffer and element, the threads
    and the site; .check is the check's name (None if the message names none)."""

    def __init__(self, message="", status=None):
        super().__init__(message, status)
        found = re.search(r"check (race|async|init|bounds|align|barrier) in ", message)
        self.check = found.group(1) if found else None


class OutOfMemoryError(Error, MemoryError):
    """The library could not allocate host or device memory."""


class InternalError(Error, RuntimeError):
    """The library hit a state it should never reach: a bug in pyfa."""


class CancelledError(Error, RuntimeError):
    """The call was cancelled by its progress callback; nothing the caller owns was written."""


# pyfa_status name (without its PYFA_ERROR_ prefix) -> the class raised for it. Every
# error status of pyfa.h has an entry (tests/test_errors.py checks it against the header).
STATUS_CLASSES = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "TILE_TOO_LARGE": TileTooLargeError,
    "BACKEND_UNAVAILABLE": BackendUnavailableError,
    "CUDA": CudaError,
    "EMULATION": EmulationError,
    "OUT_OF_MEMORY": OutOfMemoryError,
    "INTERNAL": InternalError,
    "CANCELLED": CancelledError,
    "KERNEL_HAZARD": KernelHazardError,
}

__all__ = [
    "ArgumentTypeError", "BackendUnavailableError", "CancelledError", "CudaError",
    "EmulationError", "Error", "InternalError", "InvalidArgumentError", "KernelHazardError",
    "LibraryNotFoundError", "OutOfMemoryError", "PyfaError", "STATUS_CLASSES",
    "TileTooLargeError",
]
