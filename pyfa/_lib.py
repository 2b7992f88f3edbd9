"""Loading libpyfa through cffi (ABI mode) and turning its statuses into exceptions.

The declarations come from the public header itself (the part between PYFA_CDEF_BEGIN
and PYFA_CDEF_END), so the Python side cannot drift from the C ABI.
"""

import os
import re
import sys
import threading
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_SOURCE_ROOT = _HERE.parent

_lock = threading.Lock()
_loaded = None
_loaded_path = None


class PyfaError(RuntimeError):
    """A failure reported by libpyfa; .status is the pyfa_status code."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class LibraryNotFoundError(PyfaError, ImportError):
    """libpyfa could not be found or loaded."""


class BackendUnavailableError(PyfaError):
    """The backend asked for cannot run here (e.g. CUDA without a GPU)."""


class TileTooLargeError(PyfaError, ValueError):
    """The tiles need more shared memory than the device has."""


class EmulationError(PyfaError):
    """The emulator found a barrier divergence or a deadlock in a kernel."""


class CudaError(PyfaError):
    """A CUDA runtime call failed."""


_STATUS_ERRORS = {
    1: lambda msg, st: _InvalidArgument(msg, st),
    2: TileTooLargeError,
    3: BackendUnavailableError,
    4: CudaError,
    5: EmulationError,
    6: lambda msg, st: _OutOfMemory(msg, st),
}


class _InvalidArgument(PyfaError, ValueError):
    pass


class _OutOfMemory(PyfaError, MemoryError):
    pass


def _header_paths():
    return [_HERE / "include" / "pyfa.h", _SOURCE_ROOT / "cuda" / "include" / "pyfa.h"]


def _library_names():
    if sys.platform == "darwin":
        return ["libpyfa.dylib"]
    if sys.platform == "win32":
        return ["pyfa.dll", "libpyfa.dll"]
    return ["libpyfa.so"]


def _cdef_from_header():
    for path in _header_paths():
        if path.is_file():
            text = path.read_text()
            m = re.search(r"/\* PYFA_CDEF_BEGIN \*/(.*)/\* PYFA_CDEF_END \*/", text, re.S)
            if not m:
                raise LibraryNotFoundError(f"{path}: no PYFA_CDEF_BEGIN/END section")
            return m.group(1).replace("PYFA_API ", "")
    tried = ", ".join(str(p) for p in _header_paths())
    raise LibraryNotFoundError(f"pyfa.h not found; tried {tried}")


def _candidates():
    """(origin, path) in the order tried. PYFA_LIBRARY, when set, is the only place: a
    library the caller named explicitly is never silently swapped for another one.
    Otherwise the installed package, then a source checkout's CMake build folder."""
    env = os.environ.get("PYFA_LIBRARY")
    if env:
        yield "PYFA_LIBRARY", Path(env)
        return
    for name in _library_names():
        yield "package", _HERE / name
    if (_SOURCE_ROOT / "CMakeLists.txt").is_file():
        for name in _library_names():
            yield "source checkout build", _SOURCE_ROOT / "build" / name


def load():
    """The (ffi, lib) pair, loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        try:
            import cffi
        except ImportError as e:
            raise LibraryNotFoundError("pyfa needs the 'cffi' package to load libpyfa "
                                       "(pip install cffi)") from e
        ffi = cffi.FFI()
        ffi.cdef(_cdef_from_header())
        tried = []
        for origin, path in _candidates():
            if not path.is_file():
                tried.append(f"{path} ({origin}: no such file)")
                continue
            try:
                lib = ffi.dlopen(str(path))
            except OSError as e:
                tried.append(f"{path} ({origin}: {e})")
                continue
            _loaded = (ffi, lib)
            global _loaded_path
            _loaded_path = path
            return _loaded
        raise LibraryNotFoundError(
            "libpyfa could not be loaded; tried: " + "; ".join(tried) +
            ". Install pyfa with 'pip install .' or set PYFA_LIBRARY to the library's path.")


def library_path():
    """Where the loaded libpyfa lives."""
    load()
    return _loaded_path


def header_path():
    """The public header pyfa.h that belongs with the library."""
    for path in _header_paths():
        if path.is_file():
            return path
    return None


def check(status):
    """Raises the exception for a pyfa_status other than PYFA_OK, with the library's message."""
    if status == 0:
        return
    ffi, lib = load()
    message = ffi.string(lib.pyfa_last_error()).decode("utf-8", "replace")
    name = ffi.string(lib.pyfa_status_string(status)).decode()
    text = f"{message} [{name}]" if message else name
    raise _STATUS_ERRORS.get(status, PyfaError)(text, status)
