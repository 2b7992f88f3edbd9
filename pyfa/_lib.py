"""Loading libpyfa through cffi (ABI mode), checking that it is the library the header
describes, and calling it: statuses become exceptions, and long calls stay cancellable.

The declarations come from the public header itself (the part between PYFA_CDEF_BEGIN
and PYFA_CDEF_END), so the Python side cannot drift from the C ABI. ABI mode resolves
symbols lazily and cannot see a function's signature, so load() resolves every declared
name at once and compares the library's pyfa_abi_version() with the header's
PYFA_ABI_VERSION: any other shared library is refused there, not at its first call.
"""

import functools
import os
import re
import signal
import sys
import threading
import types
from pathlib import Path
from queue import SimpleQueue

# signal's own functions without its wrappers' enum conversions (~15 us of a quick call).
try:
    import _signal
except ImportError:  # an interpreter without CPython's module
    _signal = signal

from ._version import DISTRIBUTION
from .errors import Error, LibraryNotFoundError, STATUS_CLASSES
from .options import cancels

_HERE = Path(__file__).resolve().parent
_SOURCE_ROOT = _HERE.parent

_lock = threading.Lock()
_header_lock = threading.Lock()
_loaded = None
_loaded_path = None
_header_ffi = None  # (ffi, header path, PYFA_ABI_VERSION), parsed once


def header_ffi():
    """A cffi FFI holding the declarations of pyfa.h (no library loaded): the one source
    of every enum value and struct layout the Python side uses. Needs cffi and the
    header, never the compiled library."""
    global _header_ffi
    with _header_lock:
        if _header_ffi is None:
            try:
                import cffi
            except ImportError as e:
                raise LibraryNotFoundError("pyfa needs the 'cffi' package to load libpyfa "
                                           "(pip install cffi)") from e
            header, cdef, abi = _read_header()
            ffi = cffi.FFI()
            ffi.cdef(cdef)
            _header_ffi = (ffi, header, abi)
        return _header_ffi[0]


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def enum_values(enum, prefix):
    """{name: value} of the header's `enum <enum>`, each name lower-cased without
    `prefix`, in increasing value: enum_values("pyfa_backend", "PYFA_BACKEND_") is
    {"auto": ..., "cuda": ..., ...}."""
    elements = header_ffi().typeof(f"enum {enum}").relements
    return types.MappingProxyType({name[len(prefix):].lower(): value
                                   for name, value in sorted(elements.items(), key=lambda e: e[1])
                                   if name.startswith(prefix)})


@functools.lru_cache(maxsize=None)
def _constants():
    ffi = header_ffi()
    values = {}
    for name in ffi.list_types()[0]:
        t = ffi.typeof(name)
        if t.kind == "enum":
            values.update(t.relements)
    return values


def constant(name):
    """The value of one enumerator of pyfa.h by its C name, e.g. constant("PYFA_OK")."""
    try:
        return _constants()[name]
    except KeyError:
        raise KeyError(f"pyfa.h declares no enumerator {name}") from None


def status_classes():
    """{pyfa_status value: exception class}, from the header's status names and
    errors.STATUS_CLASSES."""
    return {value: STATUS_CLASSES.get(name.upper(), Error)
            for name, value in enum_values("pyfa_status", "PYFA_ERROR_").items()}


def _header_paths():
    return [_HERE / "include" / "pyfa.h", _SOURCE_ROOT / "src" / "include" / "pyfa.h"]


def _library_names():
    if sys.platform == "darwin":
        return ["libpyfa.dylib"]
    if sys.platform == "win32":
        return ["pyfa.dll", "libpyfa.dll"]
    return ["libpyfa.so"]


def _read_header():
    """(path, cdef text, PYFA_ABI_VERSION) of the first header found."""
    for path in _header_paths():
        if path.is_file():
            text = path.read_text()
            m = re.search(r"/\* PYFA_CDEF_BEGIN \*/(.*)/\* PYFA_CDEF_END \*/", text, re.S)
            if not m:
                raise LibraryNotFoundError(f"{path}: no PYFA_CDEF_BEGIN/END section")
            abi = re.search(r"^#define PYFA_ABI_VERSION (\d+)\s*$", text, re.M)
            if not abi:
                raise LibraryNotFoundError(f"{path}: no '#define PYFA_ABI_VERSION <number>' line")
            return path, m.group(1).replace("PYFA_API ", ""), int(abi.group(1))
    tried = ", ".join(str(p) for p in _header_paths())
    raise LibraryNotFoundError(f"pyfa.h not found; tried {tried}")


def _installed_libraries():
    """The libraries pip installed with this distribution (pyfa-fp32), when this package is not
    that installation: `python -m pyfa` at a checkout's root imports the checkout's pyfa/
    (the current directory comes first on sys.path), which has no library of its own."""
    try:
        from importlib import metadata
        dist = metadata.distribution(DISTRIBUTION)
        files = dist.files or []
    except Exception:  # not installed, or metadata unreadable: nothing to add
        return []
    found = []
    for f in files:
        if f.name in _library_names() and f.parent.name == "pyfa":
            path = Path(dist.locate_file(f)).resolve()
            if path.parent != _HERE:
                found.append(path)
    return found


def _candidates():
    """(origin, path) in the order tried. PYFA_LIBRARY, when set, is the only place: a
    library the caller named explicitly is never silently swapped for another one.
    Otherwise the package's own folder, then a source checkout's CMake build folder, then
    the library of an installed pyfa (see _installed_libraries)."""
    env = os.environ.get("PYFA_LIBRARY")
    if env:
        # Made absolute here, so that the file checked is the file loaded: a bare name
        # would send dlopen through the system's search path instead.
        yield "PYFA_LIBRARY", Path(env).absolute()
        return
    for name in _library_names():
        yield "package", _HERE / name
    if (_SOURCE_ROOT / "CMakeLists.txt").is_file():
        for name in _library_names():
            yield "source checkout build", _SOURCE_ROOT / "build" / name
        for path in _installed_libraries():
            yield "installed pyfa", path


def _mismatch(ffi, lib, header, abi):
    """Why `lib` is not the library `header` describes, or None when it is."""
    missing = []
    for name in dir(lib):
        try:
            getattr(lib, name)
        except AttributeError:
            missing.append(name)
    if missing:
        return (f"not libpyfa for {header}: {len(missing)} declared symbols do not resolve "
                f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    got = lib.pyfa_abi_version()
    if got != abi:
        return f"ABI version {got}, but {header} declares PYFA_ABI_VERSION {abi}"
    from . import __version__
    version = ffi.string(lib.pyfa_version()).decode("utf-8", "replace")
    if version != __version__:
        return f"library version {version}, but the pyfa package is {__version__}"
    return None


def load():
    """The (ffi, lib) pair, loaded and checked once per process."""
    global _loaded, _loaded_path
    with _lock:
        if _loaded is not None:
            return _loaded
        ffi = header_ffi()
        _, header, abi = _header_ffi
        tried = []
        for origin, path in _candidates():
            if path.is_dir():
                tried.append(f"{path} ({origin}: is a directory, not a library file)")
                continue
            if not path.is_file():
                tried.append(f"{path} ({origin}: no such file)")
                continue
            try:
                lib = ffi.dlopen(str(path))
            except OSError as e:
                tried.append(f"{path} ({origin}: {e})")
                continue
            why = _mismatch(ffi, lib, header, abi)
            if why:
                ffi.dlclose(lib)
                tried.append(f"{path} ({origin}: {why})")
                continue
            _init_progress(ffi)
            _loaded, _loaded_path = (ffi, lib), path
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


def error(status, message):
    """The exception for a pyfa_status other than PYFA_OK and the library's message."""
    ffi, lib = load()
    name = ffi.string(lib.pyfa_status_string(status)).decode()
    text = f"{message} [{name}]" if message else name
    return status_classes().get(status, Error)(text, status)


def last_error():
    """pyfa_last_error() of the calling thread (the message is per thread)."""
    ffi, lib = load()
    return ffi.string(lib.pyfa_last_error()).decode("utf-8", "replace")


def _ok():
    return constant("PYFA_OK")


def check(status):
    """Raises the exception for a pyfa_status other than PYFA_OK, with the library's message.
    Call it on the thread that made the failed call."""
    if status != _ok():
        raise error(status, last_error())


# ---- calls that can be cancelled

# How often the waiting thread wakes to see a Ctrl-C: Python runs signal handlers only
# between bytecodes of the main thread, and a join with a timeout lets it do so.
_POLL_S = 0.02

_progress_callback = None

# Work (multiply-adds, api.py's _work) up to which a call counts as quick (call's quick=),
# by backend: emulated, 2^22 is tens of milliseconds; natively (cpu, cuda) 2^27 is a few
# milliseconds of a forward and at most ~30 of a memory-bound step (a decoding step
# reads 4 bytes per multiply-add without GQA: 0.5 GB at 20 GB/s). A Ctrl-C waits that
# long. The hand-off costs more than its ~0.1 ms warm: back to back, a 2-thread
# decoding step at N = 8192 (2^25), whose K/V stream leaves every cache cold, took
# 2.62-3.19 ms handed off against 2.14-2.85 on the main thread (Zen 4, medians of 300,
# alternating); after an idle spell and 300 ms of calls (bench.py --decode) the two
# measured alike.
QUICK_WORK = {"emu": 1 << 22, "native": 1 << 27}

# The main thread's calls run on one long-lived helper thread. A thread started per call
# cost the cpu backend's two-thread calls about a third of their speed (measured at
# N = 1024, d = 64: median 18 ms against 13 ms), its workers starting out crowded on one
# core; a thread that lives on keeps its place.
_helper_queue = None
_helper_pid = None
_helper_lock = threading.Lock()
_header_lock = threading.Lock()


def _helper():
    """The queue of the helper thread, started on first use (and again in a forked child,
    which inherits the queue but not the thread)."""
    global _helper_queue, _helper_pid
    with _helper_lock:
        if _helper_queue is None or _helper_pid != os.getpid():
            queue = SimpleQueue()

            def serve():
                while True:
                    queue.get()()

            threading.Thread(target=serve, name="pyfa calls", daemon=True).start()
            _helper_queue, _helper_pid = queue, os.getpid()
        return _helper_queue


class _Progress:
    """One call's progress state, reached from the library's threads through a handle."""

    def __init__(self, user):
        self.user = user
        self.cancel = False
        self.error = None

    def __call__(self, done, total):
        if self.cancel:
            return 1
        if self.user is not None:
            try:
                if cancels(self.user(done, total)):
                    self.cancel = True
            except BaseException as e:  # re-raised on the caller's thread
                self.error = e
                self.cancel = True
        return 1 if self.cancel else 0


def _init_progress(ffi):
    global _progress_callback

    # error=1: should the callback itself fail, the call is cancelled rather than left running.
    @ffi.callback("int(void *, int64_t, int64_t)", error=1)
    def on_progress(user, done, total):
        return ffi.from_handle(user)(done, total)

    _progress_callback = on_progress


class _Completion(threading.local):
    depth = 0            # interrupts_after blocks open on this thread
    interrupted = False  # a Ctrl-C arrived after a call had already succeeded


_completion = _Completion()


class interrupts_after:
    """`with _lib.interrupts_after(): ...` around one API call that writes outputs: a
    Ctrl-C that lands when the library call has already succeeded (too late to cancel)
    is raised as KeyboardInterrupt when the block ends, after the block has completed
    every output (its staging copies into out= arrays included), so that out= arrays are
    never left partly written. Inside an exception the pending interrupt is dropped in
    favour of that exception."""

    def __enter__(self):
        if _completion.depth == 0:
            _completion.interrupted = False
        _completion.depth += 1

    def __exit__(self, kind, value, tb):
        _completion.depth -= 1
        if _completion.depth == 0 and _completion.interrupted:
            _completion.interrupted = False
            if kind is None:
                raise KeyboardInterrupt
        return False


def raise_pending_interrupt():
    """Inside an interrupts_after block, between two calls: a Ctrl-C that arrived during
    the first (after it had succeeded) is raised now rather than after the next."""
    if _completion.interrupted:
        _completion.interrupted = False
        raise KeyboardInterrupt


def call(fn, config, *args, progress=None, quick=False):
    """fn(*args), a libpyfa entry point whose pyfa_config is `config`, raising its status.

    progress(done, total) is called now and then while the call runs (on some library
    thread); returning True cancels the call, which then raises CancelledError. On the
    main thread the call runs on a long-lived helper thread while this one waits in short
    waits, so that Ctrl-C is seen at once: it cancels the call through the progress
    callback and waits for the library to stop. The contract, in both cases a
    KeyboardInterrupt: when the library stopped (cancelled), it wrote nothing of the
    caller's; when the call had already succeeded, its outputs are complete, and inside
    an interrupts_after block (every API call) the interrupt is raised only once the
    block has completed them. Elsewhere (other threads) the call runs on the calling
    thread.

    quick=True (a call the caller knows takes milliseconds, tens at most: QUICK_WORK)
    runs on the main thread itself, skipping the hand-off to the helper thread and back
    (~0.1 ms warm, more after a step that left the caches cold: most of a small decoding
    step's time, back to back up to a sixth of one at N = 8192). A Ctrl-C then cannot
    stop it, but the call is over within tens of milliseconds and the interrupt keeps
    the contract of a call that had already succeeded: SIGINT's handler is swapped for
    one that notes it (signal.signal runs a pending handler before it swaps, so none is
    lost or run late). Only while SIGINT has Python's default handler: another handler
    runs as it would.
    """
    ffi, _ = load()
    state = _Progress(progress)
    handle = ffi.new_handle(state)
    config.progress = _progress_callback
    config.progress_user = handle
    result = {}

    def run():
        try:
            status = fn(*args)
        except BaseException as e:  # e.g. cffi refusing an argument: raised on the caller's thread
            result["exception"] = e
            return
        result["status"] = status
        if status != _ok():
            result["message"] = last_error()

    if threading.current_thread() is not threading.main_thread():
        run()
    elif quick and _signal.getsignal(_signal.SIGINT) is signal.default_int_handler:
        noted = []
        _signal.signal(_signal.SIGINT, lambda signum, frame: noted.append(signum))
        try:
            run()
        finally:
            _signal.signal(_signal.SIGINT, signal.default_int_handler)
        if noted:
            if not (result.get("status") == _ok() and _completion.depth):
                raise KeyboardInterrupt
            _completion.interrupted = True
    else:
        # Waits on an Event, not Thread.join: before Python 3.13 a KeyboardInterrupt that
        # lands inside join() can mark a thread that is still running as stopped, and the
        # call would then be abandoned while it still runs.
        done = threading.Event()

        def run_and_signal():
            try:
                run()
            finally:
                done.set()

        _helper().put(run_and_signal)
        try:
            while not done.wait(_POLL_S):
                pass
        except KeyboardInterrupt:
            state.cancel = True
            while not done.is_set():
                try:
                    done.wait(_POLL_S)
                except KeyboardInterrupt:  # pressed again: the call is stopping already
                    pass
            finished = result.get("status") == _ok() and state.error is None
            if not (finished and _completion.depth):
                raise
            # Too late to stop: the library has written its outputs. The API call that
            # made this one completes its outputs first, then raises (interrupts_after).
            _completion.interrupted = True
    if state.error is not None:
        raise state.error
    if "exception" in result:
        raise result["exception"]
    status = result.get("status")
    if status is None:
        raise Error("the library call ended without a status")
    if status != _ok():
        raise error(status, result.get("message", ""))
