"""Decoding: merging partial attention states (pyfa.merge_states).

merge_states is the simulator's pyfa.sim.merge_states (pyfa/sim/merge.py), the twin of
the library's split-KV combine step (src/common/merge.h); it is imported when first
called, so that `import pyfa` does not load the simulator.
"""

from typing import Sequence, Tuple, Union

import numpy as np

ArrayOrParts = Union[np.ndarray, Sequence[np.ndarray]]


def merge_states(o_parts: ArrayOrParts, lse_parts: ArrayOrParts) -> Tuple[np.ndarray, np.ndarray]:
    """Folds P partial attention states of the same rows, in ascending part order, by the
    formula of the library's split-KV combine step (docs/numerics.md, "Merging states"),
    bit for bit.

    o_parts: (P, ..., d) float32 NumPy (or a sequence of P arrays (..., d)), each part's
    O normalised by its own sum, as pyfa.fa2_forward returns it; lse_parts: (P, ...)
    their LSE (-inf: a part that saw no key, which contributes nothing). Returns
    (o (..., d), lse (...)), the attention over the union of the parts' keys; a row no
    part saw gets O = 0, LSE = -inf. For cascades or shards merged by hand: attention
    over keys split into P sets equals the merge of the P calls' (o, lse)."""
    from .sim.merge import merge_states as merge
    return merge(o_parts, lse_parts)
