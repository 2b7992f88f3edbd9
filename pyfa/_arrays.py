"""Arrays from any library: where an argument lives, and its memory, without copies.

pyfa takes NumPy arrays, objects with __dlpack__ (NumPy, PyTorch, CuPy, JAX, ...) and
objects with __cuda_array_interface__ (Numba, ...). CPU arrays become NumPy views
(np.from_dlpack); CUDA arrays become DeviceTensors, a device pointer and a shape read
from the producer's DLPack capsule or interface dict, passed as is to the *_device entry
points. Outputs are made with q's library so that they come back as q's kind.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, Union

import numpy as np

from .errors import ArgumentTypeError, InvalidArgumentError


class SupportsDLPack(Protocol):
    def __dlpack__(self, *, stream: Any = ...) -> Any: ...

    def __dlpack_device__(self) -> Tuple[int, int]: ...


class SupportsCudaArrayInterface(Protocol):
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]: ...


# What every public function takes as a tensor.
ArrayLike = Union[np.ndarray, SupportsDLPack, SupportsCudaArrayInterface]
# What they return: an array of q's kind (see output_kind).
Array = Any

# DLPack's DLDeviceType values pyfa knows.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_NAMES = {4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host",
             12: "ExtDev", 14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}
_DL_FLOAT = 2
_DL_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY of a versioned capsule

ARRAY_HELP = "a numpy.ndarray or an array with __dlpack__ or __cuda_array_interface__"


@dataclass(frozen=True)
class Place:
    """Where an array lives: kind "cpu" or "cuda"; index the CUDA device, None when
    unknown (a __cuda_array_interface__ does not say)."""
    kind: str
    index: Optional[int] = None

    def __str__(self):
        if self.kind == "cpu":
            return "the CPU"
        return "cuda" if self.index is None else f"cuda:{self.index}"


CPU = Place("cpu")


def place_of(name: str, x: Any) -> Place:
    """Where argument `name` lives, asked without exporting it; TypeError for what is no
    array, or an array on a device pyfa cannot use."""
    if isinstance(x, np.ndarray):
        return CPU
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            dev_type, dev_id = x.__dlpack_device__()
        except Exception as e:
            raise ArgumentTypeError(f"{name}: __dlpack_device__() failed: {e}") from e
        if dev_type in (_DL_CPU, _DL_CUDA_HOST):
            return CPU
        if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            return Place("cuda", int(dev_id))
        what = _DL_NAMES.get(int(dev_type), f"DLPack device type {int(dev_type)}")
        raise ArgumentTypeError(f"{name}: a {what} array; pyfa takes CPU and CUDA arrays")
    if hasattr(x, "__cuda_array_interface__"):
        return Place("cuda", None)
    raise ArgumentTypeError(f"{name}: expected {ARRAY_HELP}, of float32, got {type(x).__name__}")


def common_place(arrays: Dict[str, Any]) -> Place:
    """The one place every array of {name: array} (None entries skipped) lives on;
    ValueError naming the first that differs from the first one's."""
    first_name, first = None, None
    for name, x in arrays.items():
        if x is None:
            continue
        p = place_of(name, x)
        if first is None:
            first_name, first = name, p
        elif p.kind != first.kind or (p.kind == "cuda" and None not in (p.index, first.index)
                                      and p.index != first.index):
            raise InvalidArgumentError(f"{name}: on {p}, but {first_name} is on {first}; "
                                       f"every array of one call must be on one device")
        elif first.index is None:
            first = p
    return first if first is not None else CPU


# ---- CPU arrays

def host_array(name: str, x: Any) -> Any:
    """A CPU argument as a NumPy array sharing its memory (anything else is returned as
    is, for the argument checks to refuse with their own message)."""
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        return x
    try:
        return np.from_dlpack(x)
    except Exception as e:  # the producer's own words: e.g. torch's "requires grad"
        raise ArgumentTypeError(f"{name}: could not be read through DLPack: {e}") from e


# ---- CUDA arrays

@dataclass
class DeviceTensor:
    """A CUDA argument: its device pointer, shape and element strides (None: C-contiguous),
    and what keeps its memory exported."""
    name: str
    ptr: int
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]]
    readonly: bool
    owner: Any  # the DLPack capsule or the array; held until the call has enqueued its kernels

    @property
    def nbytes(self) -> int:
        """Bytes from its first element to the end of its last: the memory it spans."""
        if self.strides is None or 0 in self.shape:
            return 4 * int(np.prod(self.shape, dtype=np.int64))
        return 4 * (1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides)))

    @property
    def contiguous(self) -> bool:
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides or ())):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dlpack_stream(handle: int) -> int:
    """The DLPack `stream` argument naming the cudaStream_t `handle`: DLPack forbids 0 on
    CUDA and spells the legacy default stream 1 (which is also cudaStreamLegacy)."""
    return 1 if handle == 0 else handle


def _export(name, x, stream):
    """x.__dlpack__ for a consumer on cudaStream_t `stream`: a versioned capsule where the
    producer makes one, else a legacy one."""
    s = dlpack_stream(stream)
    try:
        try:
            return x.__dlpack__(stream=s, max_version=(1, 0))
        except TypeError:  # a producer older than DLPack 1.0's max_version
            return x.__dlpack__(stream=s)
    except Exception as e:
        raise ArgumentTypeError(f"{name}: could not be exported through DLPack: {e}") from e


def _from_capsule(name, capsule):
    """(DLTensor, read-only) of a DLPack capsule; the capsule keeps it alive. The capsule
    is not renamed: its producer's destructor releases the tensor once it is dropped."""
    if _capsule_valid(capsule, b"dltensor_versioned"):
        m = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
        if m.version.major != 1:
            raise ArgumentTypeError(f"{name}: DLPack {m.version.major}.{m.version.minor}; pyfa reads 1.x")
        return m.dl_tensor, bool(m.flags & _DL_READ_ONLY)
    if _capsule_valid(capsule, b"dltensor"):
        return _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor, False
    raise ArgumentTypeError(f"{name}: __dlpack__() returned no unused DLPack capsule")


def _check_layout(name, shape, strides, dtype_ok, dtype_text):
    """float32, non-negative strides, the last axis contiguous (the shape is the API's to
    check): what the library can address in place."""
    if not dtype_ok:
        raise ArgumentTypeError(f"{name}: expected dtype float32, got {dtype_text}")
    if strides is None or not shape:
        return
    if any(s < 0 for s in strides):
        raise InvalidArgumentError(f"{name}: negative strides are not supported (element strides "
                                   f"{tuple(strides)})")
    if shape[-1] != 1 and strides[-1] != 1:
        raise InvalidArgumentError(f"{name}: the last axis of a CUDA array must be contiguous (shape "
                                   f"{shape}, element strides {tuple(strides)})")


def device_tensor(name: str, x: Any, stream: int) -> DeviceTensor:
    """The CUDA argument `name`, exported for use on cudaStream_t `stream`."""
    if hasattr(x, "__dlpack__"):
        capsule = _export(name, x, stream)
        t, readonly = _from_capsule(name, capsule)
        if t.device.device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
            raise ArgumentTypeError(f"{name}: __dlpack_device__ said CUDA, but its capsule is on "
                                    f"device type {t.device.device_type}")
        ndim = int(t.ndim)
        shape = tuple(int(t.shape[i]) for i in range(ndim))
        strides = None if not t.strides else tuple(int(t.strides[i]) for i in range(ndim))
        dt = t.dtype
        _check_layout(name, shape, strides, (dt.code, dt.bits, dt.lanes) == (_DL_FLOAT, 32, 1),
                      f"DLPack (code {dt.code}, bits {dt.bits}, lanes {dt.lanes})")
        ptr = (t.data or 0) + int(t.byte_offset)
        owner = capsule
    else:
        cai = x.__cuda_array_interface__
        shape = tuple(int(n) for n in cai["shape"])
        try:
            dtype = np.dtype(cai["typestr"])
        except TypeError:
            dtype = None
        strides = cai.get("strides")
        if strides is not None:
            if any(s % 4 for s in strides):
                raise InvalidArgumentError(f"{name}: byte strides {tuple(strides)} are not whole float32s")
            strides = tuple(int(s) // 4 for s in strides)
        _check_layout(name, shape, strides, dtype == np.float32, cai["typestr"])
        if cai.get("mask") is not None:
            raise InvalidArgumentError(f"{name}: masked CUDA arrays are not supported")
        ptr, readonly = int(cai["data"][0] or 0), bool(cai["data"][1])
        owner = x
    if ptr % 4:
        raise InvalidArgumentError(f"{name}: its device pointer {ptr:#x} is not aligned to a float32")
    return DeviceTensor(name, ptr, shape, strides, readonly, owner)


def cai_stream(x: Any) -> Optional[int]:
    """The stream a __cuda_array_interface__ (v3) array asks its consumer to order after,
    or None; __dlpack__ producers are ordered by the DLPack stream argument instead."""
    if hasattr(x, "__dlpack__") or not hasattr(x, "__cuda_array_interface__"):
        return None
    s = x.__cuda_array_interface__.get("stream")
    return None if s is None else int(s)


def stream_handle(stream: Any) -> int:
    """A cudaStream_t as an int, from the `stream` keyword: an int (0: the default stream),
    or a stream object of PyTorch (.cuda_stream), CuPy (.ptr) or the __cuda_stream__
    protocol."""
    if isinstance(stream, bool):
        raise ArgumentTypeError("stream: expected a cudaStream_t as an int or a stream object, got bool")
    if isinstance(stream, int):
        if stream < 0:
            raise InvalidArgumentError(f"stream: a cudaStream_t is not negative, got {stream}")
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ArgumentTypeError(f"stream: expected a cudaStream_t as an int or a stream object "
                            f"(PyTorch, CuPy, __cuda_stream__), got {type(stream).__name__}")


def library_of(x: Any) -> str:
    """The top-level package of x's type: "numpy", "torch", "cupy", "jaxlib", ..."""
    return type(x).__module__.split(".")[0]


def current_stream(x: Any, place: Place) -> Optional[int]:
    """The producer's current stream on x's device, for the libraries that have one."""
    lib = library_of(x)
    if lib == "torch":
        import torch
        return int(torch.cuda.current_stream(place.index).cuda_stream)
    if lib == "cupy":
        import cupy
        with cupy.cuda.Device(place.index):
            return int(cupy.cuda.get_current_stream().ptr)
    return None


# ---- outputs of q's kind

def same_stream(a: int, b: int) -> bool:
    """Whether cudaStream_t handles a and b name one stream (0 and 1 both the legacy
    default stream)."""
    return a == b or {a, b} <= {0, 1}


def _torch_cuda_empty(shape, index, stream):
    """Allocated under `stream`, the call's, so that the caching allocator hands out
    memory no work still queued elsewhere uses, and recorded on torch's current stream,
    where the caller goes on using it, so that it is not reused before that work is done."""
    import torch
    device = torch.device("cuda", index or 0)
    current = torch.cuda.current_stream(device)
    if same_stream(stream, int(current.cuda_stream)):
        return torch.empty(shape, dtype=torch.float32, device=device)
    on = torch.cuda.default_stream(device) if stream in (0, 1) else torch.cuda.ExternalStream(stream, device=device)
    with torch.cuda.stream(on):
        out = torch.empty(shape, dtype=torch.float32, device=device)
    out.record_stream(current)
    return out


def _cupy_cuda_empty(shape, index, stream):
    """Allocated under `stream`, the call's: CuPy's memory pool keeps one free list per
    stream, so the memory is free of work queued on other streams."""
    import cupy
    with cupy.cuda.Device(index or 0):
        if same_stream(stream, int(cupy.cuda.get_current_stream().ptr)):
            return cupy.empty(shape, dtype=cupy.float32)
        on = cupy.cuda.Stream.null if stream == 0 else cupy.cuda.ExternalStream(stream)
        with on:
            return cupy.empty(shape, dtype=cupy.float32)


# library -> (shape, device index, cudaStream_t of the call) -> a fresh C-contiguous
# float32 CUDA array, safe for the call to write on that stream.
ALLOCATORS: Dict[str, Callable[[Tuple[int, ...], Optional[int], int], Any]] = {
    "torch": _torch_cuda_empty,
    "cupy": _cupy_cuda_empty,
}


def _jax_import(a):
    import jax.dlpack
    return jax.dlpack.from_dlpack(a)


# library -> how it takes in a DLPack array without a copy, where its module has no
# from_dlpack of its own at the top level.
_IMPORTERS: Dict[str, Callable[[Any], Any]] = {"jax": _jax_import, "jaxlib": _jax_import}


def as_kind(kind: str, a: Any) -> Any:
    """Array `a` (NumPy, or a CUDA array of some library) as an array of library `kind`,
    sharing its memory; `a` itself where that library has no DLPack import."""
    if kind == library_of(a):
        return a
    importer = _IMPORTERS.get(kind)
    if importer is None:
        importer = getattr(sys.modules.get(kind), "from_dlpack", None)
    return a if importer is None else importer(a)


def device_switch(kind: str, index: Optional[int]) -> Optional[Callable[[], Callable[[], None]]]:
    """A function that makes CUDA device `index` current on the calling thread whenever
    another one is (device 0 included: a thread's current device need not be 0) and
    returns how to put the previous one back; through q's library, or PyTorch or CuPy
    when imported. None when `index` is unknown or neither library is imported: libpyfa
    itself runs a *_device call on the device that owns q, so the switch here only keeps
    the producer library's notion of the current device in step with it."""
    if index is None:
        return None
    for lib in ([kind] if kind in ("torch", "cupy") else []) + ["torch", "cupy"]:
        if lib not in sys.modules:
            continue
        if lib == "torch":
            import torch
            get, put = torch.cuda.current_device, torch.cuda.set_device
        else:
            import cupy
            get, put = cupy.cuda.runtime.getDevice, cupy.cuda.runtime.setDevice

        def switch(get=get, put=put):
            before = get()
            if before == index:
                return lambda: None
            put(index)
            return lambda: put(before)
        return switch
    return None


def allocator_for(kind: str) -> Tuple[Callable[[Tuple[int, ...], Optional[int], int], Any], str]:
    """(allocator, its library) for outputs of q's `kind`: q's own library's, else that of
    PyTorch or CuPy when imported (the outputs then pass to q's kind through DLPack)."""
    if kind in ALLOCATORS:
        return ALLOCATORS[kind], kind
    for lib in ("torch", "cupy"):
        if lib in sys.modules:
            return ALLOCATORS[lib], lib
    raise ArgumentTypeError(f"q: pyfa cannot allocate CUDA outputs for {kind} arrays (it allocates "
                            f"with PyTorch or CuPy, and neither is imported); pass out=")
