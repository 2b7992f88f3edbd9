"""Shared-memory layouts, device profiles and default tiles: the twin of
src/common/smem.h and the default-tile rules in src/core/tiles.cpp.

tests/test_tiles.py checks every function here against the compiled library.
"""

import contextlib
import contextvars
from dataclasses import dataclass
from functools import lru_cache

from ..errors import InvalidArgumentError, TileTooLargeError  # noqa: F401 (also sim's name)
from ..checks import check_tile

FLOAT_BYTES = 4


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    smem_per_block: int         # bytes of shared memory one block may opt in to
    max_threads_per_block: int
    sm_count: int


# The emulator's device: an H200's limits (227 KiB opt-in shared memory per block,
# 1024 threads per block, 132 SMs), so the emulator sizes tiles as that GPU would.
EMU_PROFILE = DeviceProfile("pyfa emulator (H200 profile)", 227 * 1024, 1024, 132)



def padded(row):
    """smem.h padded: a row stride one float longer, so that the rows a warp reads at the
    same column fall in different shared-memory banks."""
    return row + 1


def fa2_forward_smem(Br, Bc, d):
    """Terms (name, floats) in memory order: src/common/smem.h fa2_forward_smem."""
    return [("Q_i", Br * d), ("K_j", Bc * padded(d)), ("V_j", Bc * d),
            ("S_ij", Br * padded(Bc)), ("O_i", Br * d), ("m_i", Br), ("l_i", Br), ("alpha", Br)]


def fa2_backward_preprocess_smem(Br, Bc, d):
    """src/common/smem.h fa2_backward_preprocess_smem (Bc unused)."""
    return [("dO_i", Br * padded(d))]


def fa2_backward_dkdv_smem(Br, Bc, d):
    """src/common/smem.h fa2_backward_dkdv_smem."""
    return [("K_j", Bc * padded(d)), ("V_j", Bc * padded(d)), ("dK_j", Bc * d),
            ("dV_j", Bc * d), ("Q_i", Br * d), ("dO_i", Br * d), ("P_ij", Br * Bc),
            ("dS_ij", Br * Bc), ("LSE_i", Br), ("D_i", Br)]


def fa2_backward_dq_smem(Br, Bc, d):
    """src/common/smem.h fa2_backward_dq_smem."""
    return [("Q_i", Br * d), ("dO_i", Br * d), ("dQ_i", Br * d), ("K_j", Bc * padded(d)),
            ("V_j", Bc * padded(d)), ("dS_ij", Br * Bc), ("LSE_i", Br), ("D_i", Br)]


def fa1_forward_smem(Br, Bc, d):
    """Terms (name, floats) in memory order: src/common/smem.h fa1_forward_smem."""
    return [("K_j", Bc * padded(d)), ("V_j", Bc * d), ("Q_i", Br * d),
            ("S_ij", Br * padded(Bc)), ("m~_ij", Br), ("l_new", Br), ("o_scale", Br),
            ("pv_scale", Br)]


def fa1_backward_smem(Br, Bc, d):
    """Terms (name, floats) in memory order: src/common/smem.h fa1_backward_smem."""
    return [("K_j", Bc * padded(d)), ("V_j", Bc * padded(d)), ("dK_j", Bc * d),
            ("dV_j", Bc * d), ("Q_i", Br * d), ("dO_i", Br * padded(d)), ("P_ij", Br * Bc),
            ("dS_ij", Br * Bc), ("m_i", Br), ("l_i", Br), ("D_i", Br)]


SMEM_LAYOUTS = {
    "fa2_forward": fa2_forward_smem,
    "fa2_backward_preprocess": fa2_backward_preprocess_smem,
    "fa2_backward_dkdv": fa2_backward_dkdv_smem,
    "fa2_backward_dq": fa2_backward_dq_smem,
    "fa1_forward": fa1_forward_smem,
    "fa1_backward": fa1_backward_smem,
}


def smem_terms(kernel, Br, Bc, d):
    try:
        layout = SMEM_LAYOUTS[kernel]
    except KeyError:
        raise InvalidArgumentError(f"kernel: unknown kernel {kernel!r}; known: {sorted(SMEM_LAYOUTS)}") from None
    return layout(Br, Bc, d)


def smem_bytes(kernel, Br, Bc, d):
    """Bytes of dynamic shared memory `kernel` needs for tiles Br x Bc at head dim d."""
    return FLOAT_BYTES * sum(n for _, n in smem_terms(kernel, Br, Bc, d))


def fits(kernel, Br, Bc, d, profile=EMU_PROFILE):
    return smem_bytes(kernel, Br, Bc, d) <= profile.smem_per_block


def default_tiles(kernel, d, profile=EMU_PROFILE, block_r=None, block_c=None):
    """(Br, Bc) the library uses when none are given: the kernel's own rule in
    DEFAULT_TILE_RULES, else start from 64 x 64 and halve both until the tiles fit the
    profile's shared memory. A side the caller gives (block_r, block_c) stays, and only the
    other one follows the rule, for those tiles (src/core/tiles.cpp default_tiles)."""
    if kernel not in SMEM_LAYOUTS:
        raise InvalidArgumentError(f"kernel: unknown kernel {kernel!r}; known: {sorted(SMEM_LAYOUTS)}")
    if block_r and block_c:
        return block_r, block_c
    if kernel in DEFAULT_TILE_RULES:
        return DEFAULT_TILE_RULES[kernel](kernel, d, profile, block_r, block_c)
    Br = block_r or 64
    Bc = block_c or 64
    while not fits(kernel, Br, Bc, d, profile) and (Bc if block_r else Br) > 1:
        if not block_r:
            Br //= 2
        if not block_c:
            Bc //= 2
    return Br, Bc


def check_fit(kernel, Br, Bc, d, profile=EMU_PROFILE):
    """Raises TileTooLargeError, worded as the library's, when the tiles do not fit."""
    need = smem_bytes(kernel, Br, Bc, d)
    if need > profile.smem_per_block:
        terms = " + ".join(f"{name} {FLOAT_BYTES * n}" for name, n in smem_terms(kernel, Br, Bc, d))
        raise TileTooLargeError(
            f"{kernel}: block_r={Br}, block_c={Bc} at head_dim={d} need {need} bytes of shared "
            f"memory ({terms}), but {profile.name} allows {profile.smem_per_block} per block")


def resolve_tiles(kernel, d, block_r, block_c, profile=EMU_PROFILE):
    """The tiles a kernel runs with: the caller's block_r, block_c where given (checked),
    the kernel's default on `profile` for the other; the C side's kernel_tiles does the
    same. The IO model (count_io) takes them as they are, fitting or not; launch_tiles is
    what a kernel accepts."""
    Br = check_tile("block_r", block_r)
    Bc = check_tile("block_c", block_c)
    if Br is None or Bc is None:
        Br, Bc = default_tiles(kernel, d, profile, Br, Bc)
    return Br, Bc


def launch_tiles(kernel, d, block_r, block_c):
    """resolve_tiles, refused with TileTooLargeError, as the library refuses them, when
    they do not fit the emulated device's shared memory: the simulator runs what the
    library runs, and never allocates tiles no kernel could hold."""
    Br, Bc = resolve_tiles(kernel, d, block_r, block_c)
    check_fit(kernel, Br, Bc, d)
    return Br, Bc


@lru_cache(maxsize=None)
def fa1_default_tiles(kernel, d, profile=EMU_PROFILE, block_r=None, block_c=None):
    """FA1's rule (Dao et al. 2022, Algorithms 1 and 4; src/core/tiles.cpp
    fa1_default_tiles): Bc = ceil(M / 4d), Br = min(Bc, d), M the profile's shared memory
    in floats; then Bc is lowered one at a time, Br following it down whenever it would
    exceed Bc, until the kernel's layout fits. A side the caller gives stays; with Bc
    given, Br starts from min(Bc, d) and is lowered alone."""
    M = profile.smem_per_block // FLOAT_BYTES
    Bc = block_c or max(1, -(-M // (4 * d)))
    Br = block_r or min(Bc, d)
    while not fits(kernel, Br, Bc, d, profile):
        if not block_c and Bc > 1:
            Bc -= 1
            if not block_r:
                Br = min(Br, Bc)
        elif not block_r and Br > 1:
            Br -= 1
        else:
            break
    return Br, Bc


def pack_gqa(B, H, Hkv, Nq, Br, chunks, profile=EMU_PROFILE):
    """Whether the readable FA2 forward packs a K/V head's G = H / Hkv query heads into
    its blocks (src/common/params.h pack_gqa), for a grid of B sequences, Nq query rows,
    Q tiles of Br rows and `chunks` split-KV chunks (1 unsplit): where that takes fewer
    blocks (a head's last Q tile part empty, as decoding's one row) and still leaves 4
    blocks per SM (src/core/tiles.cpp pack_gqa, which says why)."""
    G = H // Hkv
    packed = -(-G * Nq // Br)
    if G <= 1 or packed >= G * -(-Nq // Br):
        return False
    return B * Hkv * max(chunks, 1) * packed >= 4 * profile.sm_count


# The grid a simulated FA2 forward is one part of: (B, Nq, Nk) bounds of a packed batch,
# whose one launch the library sizes, packing decided once for it (pyfa/sim/varlen.py
# runs its sequences one at a time); None: the call's own.
_GRID = contextvars.ContextVar("pyfa_sim_grid", default=None)


@contextlib.contextmanager
def launch_grid(B, Nq, Nk):
    """Within it, grid_launch decides for a launch of B sequences of at most Nq
    queries and Nk keys."""
    token = _GRID.set((B, Nq, Nk))
    try:
        yield
    finally:
        _GRID.reset(token)


def few_rows(Br, rows, block_r):
    """The readable FA2 forward's Q tile where its blocks hold fewer rows than the default
    Br (a decoding step's; src/core/api.cpp few_rows): those rows rounded up to 8, unless
    the caller gave block_r. No bit and no byte depends on it."""
    if block_r or rows >= Br:
        return Br
    return min(Br, max(8, -(-rows // 8) * 8))


def fa2_launch(B, H, Hkv, Nq, Nk, Br, split_size, block_r, profile=EMU_PROFILE):
    """(query heads per block, Br) of the readable FA2 forward's launch for B sequences of
    at most Nq queries and Nk keys, default tiles Br, split_size keys per chunk (0 or None:
    one chunk) and the caller's block_r (None: default): pack_gqa, then few_rows, as
    src/core/api.cpp decides them."""
    qg = H // Hkv if pack_gqa(B, H, Hkv, Nq, Br, -(-Nk // split_size) if split_size else 1, profile) else 1
    return qg, few_rows(Br, qg * Nq, block_r)


def grid_launch(B, H, Hkv, Nq, Nk, Br, split_size, block_r):
    """fa2_launch of a simulated FA2 forward of (B, H, Hkv, Nq, Nk), or of the
    launch_grid it runs within."""
    B, Nq, Nk = _GRID.get() or (B, Nq, Nk)
    return fa2_launch(B, H, Hkv, Nq, Nk, Br, split_size, block_r)


# Kernels whose default tiles follow their own rule rather than FA2's halving.
DEFAULT_TILE_RULES = {
    "fa1_forward": fa1_default_tiles,
    "fa1_backward": fa1_default_tiles,
}
