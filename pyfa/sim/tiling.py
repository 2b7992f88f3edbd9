"""Tile counts and the GQA head mapping, shared by the simulator's kernels
and count_io. The mask itself, and the tile ranges it gives, are pyfa/sim/mask.py's."""

import numpy as np


def ceil_div(a, b):
    return (a + b - 1) // b


def kv_heads(x4, H):
    """K or V (B, Hkv, N, d) as seen by each of the H query heads: head h reads K/V head
    h // (H // Hkv). A copy (B, H, N, d); the kernels index instead."""
    G = H // x4.shape[1]
    return x4 if G == 1 else np.repeat(x4, G, axis=1)

