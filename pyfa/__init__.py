"""pyfa: FlashAttention-1 and -2 in fp32, as a CUDA library with a C ABI, on NumPy buffers.

    import numpy as np, pyfa
    o = pyfa.attention(q, k, v, causal=True)          # on the best backend here
    r = pyfa.sim.fa2_forward(q, k, v, causal=True)    # the simulator: r.o, r.lse, r.io
    o = pyfa.attention(q, k, v, options=pyfa.Options(backend="emu", block_r=32))
    with pyfa.Options(backend="cpu", threads=4):      # how the calls in this block run
        o = pyfa.attention(q, k, v)

Keywords say what is computed (causal, window, causal_align, scale, layout); a
pyfa.Options says how (backend, tiles, variant, threads, the emulator's knobs,
progress). Every error pyfa raises is a pyfa.Error; argument errors are also
ValueError or TypeError, alike from the library and the simulator.

The compiled library is loaded on first use, and the simulator (the subpackage pyfa.sim)
is imported on first use of pyfa.sim, so `import pyfa.sim` works without the library and
`import pyfa` never imports the simulator.
"""

import importlib

from ._version import __version__  # (the loader compares it with the library's)
from ._config import get_include, get_library
from .api import (
    attention, attention_grad, backends, default_tiles, device_profile, dropout_mask, fa1_backward,
    fa1_forward, fa2_backward, fa2_forward, library_version, smem_bytes, unavailable_backends,
)
from .errors import (
    ArgumentTypeError, BackendUnavailableError, CancelledError, CudaError, EmulationError, Error,
    InternalError, InvalidArgumentError, KernelHazardError, LibraryNotFoundError, OutOfMemoryError,
    PyfaError, TileTooLargeError,
)
from .kvcache import attention_with_kvcache, merge_sinks, merge_states, sinks_grad
from .options import Options
from .prepared import PreparedCall, prepare
from .varlen import attention_varlen, attention_varlen_grad


def __getattr__(name):
    # pyfa.sim without `import pyfa.sim`: the simulator loads when first asked for.
    if name == "sim":
        return importlib.import_module(".sim", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ArgumentTypeError", "BackendUnavailableError", "CancelledError", "CudaError",
    "EmulationError", "Error", "InternalError", "InvalidArgumentError", "KernelHazardError",
    "LibraryNotFoundError", "Options", "OutOfMemoryError", "PreparedCall", "PyfaError", "TileTooLargeError",
    "attention", "attention_grad", "attention_varlen", "attention_varlen_grad", "attention_with_kvcache",
    "backends", "default_tiles", "device_profile", "dropout_mask",
    "fa1_backward", "fa1_forward", "fa2_backward", "fa2_forward", "get_include",
    "get_library", "library_version", "merge_sinks", "merge_states", "prepare", "sim", "sinks_grad", "smem_bytes",
    "unavailable_backends",
]
