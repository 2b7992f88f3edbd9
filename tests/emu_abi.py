"""libpyfa's C ABI called through cffi directly, on the emulator, for the tests of what the
Python API does not show: the progress callback, cancellation, the FP environment of the
calling thread, out-of-memory statuses."""

import numpy as np

from pyfa import _lib, api

# The values come from pyfa.h, through the loader's parse of it.
EMU = _lib.constant("PYFA_BACKEND_EMU")
OK = _lib.constant("PYFA_OK")
INVALID_ARGUMENT = _lib.constant("PYFA_ERROR_INVALID_ARGUMENT")
OUT_OF_MEMORY = _lib.constant("PYFA_ERROR_OUT_OF_MEMORY")
CANCELLED = _lib.constant("PYFA_ERROR_CANCELLED")

# C function: the tensors it takes, inputs then outputs, in the order of its arguments.
OPS = {op.c_function: op.inputs + op.outputs for op in api.OPS.values()}
ROW_TENSORS = tuple(n for n, kind in api.TENSOR_KINDS.items() if kind == "row")  # (B, H, N)


def load():
    return _lib.load()


def tensors(names, B, H, N, d, fill=None, seed=0):
    """float32 tensors of the problem's shapes: standard normal, or all `fill`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in names:
        shape = (B, H, N) if name in ROW_TENSORS else (B, H, N, d)
        out[name] = (np.full(shape, fill, np.float32) if fill is not None
                     else rng.standard_normal(shape, dtype=np.float32))
    return out


def call(fn_name, tensors_by_name, *, causal=False, workers=2, block_r=0, block_c=0,
         progress=None):
    """Calls fn_name on the emulator; returns (status, last error message)."""
    ffi, lib = load()
    q = tensors_by_name["q"]
    k = tensors_by_name["k"]
    problem = ffi.new("pyfa_problem *", {
        "batch": q.shape[0], "heads": q.shape[1], "seqlen_q": q.shape[2],
        "seqlen_k": k.shape[2], "head_dim": q.shape[3], "scale": 0.0, "causal": int(causal)})
    config = ffi.new("pyfa_config *", {
        "backend": EMU, "block_r": block_r, "block_c": block_c, "emu_workers": workers})
    if progress is not None:
        config.progress = progress
    ptrs = [ffi.cast("float *", ffi.from_buffer(tensors_by_name[name]))
            for name in OPS[fn_name]]
    status = getattr(lib, fn_name)(problem, config, *ptrs)
    message = ffi.string(lib.pyfa_last_error()).decode()
    return status, message


def progress_callback(fn):
    """fn(done, total) -> int as a pyfa_config.progress; keep the result alive during the call."""
    ffi, _ = load()
    return ffi.callback("int(void *, int64_t, int64_t)", lambda user, done, total: fn(done, total))
