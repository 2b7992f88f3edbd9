"""pyfa: FlashAttention-1 and -2 in fp32, as a CUDA library with a C ABI, on NumPy buffers.

    import numpy as np, pyfa
    o = pyfa.attention(q, k, v, causal=True)          # on the best backend here
    r = pyfa.sim.fa2_forward(q, k, v, causal=True)    # the simulator: r.o, r.lse, r.io

The compiled library is loaded on first use, so `import pyfa.sim` works without it.
"""

import importlib.util
import sys
from pathlib import Path


def _attach_simulator():
    # Installed, the simulator is the subpackage pyfa/sim; in a source checkout it is the
    # top-level sim/ folder, loaded here under the same name.
    here = Path(__file__).resolve().parent
    if (here / "sim" / "__init__.py").is_file() or "pyfa.sim" in sys.modules:
        return
    init = here.parent / "sim" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "pyfa.sim", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyfa.sim"] = module
    spec.loader.exec_module(module)


_attach_simulator()

from ._version import __version__  # noqa: E402  (the loader compares it with the library's)
from . import sim  # noqa: E402
from ._config import get_include, get_library  # noqa: E402
from ._lib import (  # noqa: E402
    BackendUnavailableError, CancelledError, CudaError, EmulationError, InvalidArgumentError,
    LibraryNotFoundError, OutOfMemoryError, PyfaError,
)
from .api import (  # noqa: E402
    attention, attention_grad, backends, default_tiles, device_profile, fa1_backward,
    fa1_forward, fa2_backward, fa2_forward, library_version, smem_bytes, unavailable_backends,
)
from .sim.tiles import TileTooLargeError  # noqa: E402  (the library's errors derive from it)

__all__ = [
    "BackendUnavailableError", "CancelledError", "CudaError", "EmulationError",
    "InvalidArgumentError", "LibraryNotFoundError", "OutOfMemoryError", "PyfaError",
    "TileTooLargeError", "attention", "attention_grad", "backends", "default_tiles",
    "device_profile", "fa1_backward", "fa1_forward", "fa2_backward", "fa2_forward",
    "get_include", "get_library", "library_version", "sim", "smem_bytes",
    "unavailable_backends",
]
