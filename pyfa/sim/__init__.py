"""pyfa.sim: the pure-NumPy simulator of pyfa's kernels.

Each kernel has a twin here that walks the same tile loops and performs the same fp32
operations in the same order (docs/numerics.md), so its results equal the kernel's bit
for bit, and that counts every byte moved through HBM. Importing it needs NumPy only,
never the compiled library.

The kernel functions take the library's semantics keywords (causal, window,
causal_align, scale, layout) and options= (a pyfa.Options, or the enclosing
`with pyfa.Options(...)` block's), of which they use the tiles (block_r, block_c) and
progress: progress(done, total) is called as each tile's HBM traffic is counted, in
bytes of the call's IO record, and returning True cancels (pyfa.CancelledError). They
raise pyfa's exceptions (pyfa/errors.py), as the library's API does.
"""

from .context_parallel import context_parallel_bytes
from .count import count_io, count_io_varlen
from .dropout import dropout_mask
from .fa1_backward import Fa1BackwardResult, fa1_backward
from .fa1_forward import Fa1ForwardResult, fa1_forward
from .fa2_backward import Fa2BackwardResult, fa2_backward
from .fa2_forward import Fa2ForwardResult, fa2_forward
from .io import IORecord, format_bytes
from .mask import Mask
from .merge import merge_sinks, merge_states, sinks_grad
from .standard import count_standard_io, standard_backward, standard_forward
from .tiles import EMU_PROFILE, DeviceProfile, TileTooLargeError, default_tiles, smem_bytes, smem_terms
from .varlen import (attention_varlen, attention_with_kvcache, fa1_backward_varlen, fa1_forward_varlen, fa2_backward_varlen,
                     fa2_forward_varlen)

__all__ = [
    "count_standard_io", "standard_backward", "standard_forward",
    "DeviceProfile", "EMU_PROFILE", "Mask", "TileTooLargeError", "Fa2ForwardResult", "IORecord",
    "context_parallel_bytes", "count_io", "count_io_varlen", "dropout_mask",
    "attention_varlen", "attention_with_kvcache", "fa1_backward_varlen", "fa1_forward_varlen", "fa2_backward_varlen",
    "fa2_forward_varlen",
    "default_tiles", "fa2_forward", "format_bytes", "merge_sinks", "merge_states", "sinks_grad", "smem_bytes",
    "smem_terms",
    "Fa2BackwardResult", "fa2_backward",
    "Fa1BackwardResult", "Fa1ForwardResult", "fa1_backward", "fa1_forward",
]
