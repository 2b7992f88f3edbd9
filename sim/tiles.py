"""Shared-memory layouts, device profiles and default tiles: the twin of
cuda/common/smem.h and the default-tile rules in cuda/launch/tiles.cpp.

tests/test_tiles.py checks every function here against the compiled library.
"""

from dataclasses import dataclass

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

# The C enum pyfa_kernel.
KERNELS = {
    "fa1_forward": 0,
    "fa2_forward": 1,
    "fa1_backward": 2,
    "fa2_backward_preprocess": 3,
    "fa2_backward_dkdv": 4,
    "fa2_backward_dq": 5,
}


def fa2_forward_smem(Br, Bc, d):
    """Terms (name, floats) in memory order: cuda/common/smem.h fa2_forward_smem."""
    return [("Q_i", Br * d), ("K_j", Bc * d), ("V_j", Bc * d), ("S_ij", Br * Bc),
            ("O_i", Br * d), ("m_i", Br), ("l_i", Br), ("alpha", Br)]


SMEM_LAYOUTS = {
    "fa2_forward": fa2_forward_smem,
}


def smem_terms(kernel, Br, Bc, d):
    try:
        layout = SMEM_LAYOUTS[kernel]
    except KeyError:
        raise ValueError(f"kernel: unknown kernel {kernel!r}; known: {sorted(SMEM_LAYOUTS)}") from None
    return layout(Br, Bc, d)


def smem_bytes(kernel, Br, Bc, d):
    """Bytes of dynamic shared memory `kernel` needs for tiles Br x Bc at head dim d."""
    return FLOAT_BYTES * sum(n for _, n in smem_terms(kernel, Br, Bc, d))


def fits(kernel, Br, Bc, d, profile=EMU_PROFILE):
    return smem_bytes(kernel, Br, Bc, d) <= profile.smem_per_block


def default_tiles(kernel, d, profile=EMU_PROFILE):
    """(Br, Bc) the library uses when none are given. Start from 64 x 64 and halve both
    until the tiles fit the profile's shared memory."""
    if kernel not in SMEM_LAYOUTS:
        raise ValueError(f"kernel: unknown kernel {kernel!r}; known: {sorted(SMEM_LAYOUTS)}")
    Br = Bc = 64
    while Br > 1 and not fits(kernel, Br, Bc, d, profile):
        Br //= 2
        Bc //= 2
    return Br, Bc
