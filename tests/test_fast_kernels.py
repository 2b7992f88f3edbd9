"""The fast (register-tiled) kernels: the same bits as the readable kernels and the
simulator on every case they take, under two thread orders; variant selection (auto falls
back, fast names what it lacks); and the argument behind the ordered row-max tree."""

import functools
import itertools
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import grid
import pyfa
from reference import make_inputs, same_bits

# (B, H, Nq, Nk, d, Br, Bc) the fast FA2 forward takes: both head dims and both row tiles,
# one tile and less, tails of every residue of 4 (the P V loop's last 1..3 keys), Nq != Nk
# both ways (with causal and Nq > Nk the first rows see no key), and the default tiles.
FAST_CASES = [
    (1, 1, 64, 64, 64, 64, 64),
    (2, 2, 70, 131, 64, 64, 64),
    (1, 1, 1, 1, 64, 64, 64),
    (1, 2, 130, 67, 64, 128, 64),
    (1, 1, 200, 66, 128, 128, 64),
    (1, 1, 45, 190, 128, 64, 64),
    (1, 1, 129, 129, 128, 128, 64),
    (1, 2, 150, 150, 64, None, None),
    (1, 1, 100, 100, 128, None, None),
]

VARIANTS = ["reference", "fast"]


def _simulated(case, causal):
    B, H, Nq, Nk, d, Br, Bc = case
    q, k, v = make_inputs((B, H, Nq, d), (B, H, Nk, d), seed=grid.case_seed(case))
    return (q, k, v), pyfa.sim.fa2_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)


_SIM = {}


def simulated(case, causal):
    if (case, causal) not in _SIM:
        _SIM[case, causal] = _simulated(case, causal)
    return _SIM[case, causal]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend,order", grid.RUNS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", grid.grouped(FAST_CASES, "fast_fa2_forward"))
def test_fa2_forward_variants_equal_the_simulator(case, causal, backend, order, variant):
    (q, k, v), sim = simulated(case, causal)
    _, _, _, _, _, Br, Bc = case
    if backend == "cpu" and variant == "fast":  # the cpu backend's kernels are its own
        with pytest.raises(ValueError, match="config->variant: fast: the cpu backend"):
            pyfa.fa2_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc, backend=backend,
                             variant=variant)
        return
    o, lse = pyfa.fa2_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc, backend=backend,
                              emu_order=order, variant=variant)
    assert same_bits(o, sim.o), "O differs from the simulator"
    assert same_bits(lse, sim.lse), "LSE differs from the simulator"


# NaNs with payloads, infinities, huge values, the smallest subnormal and tiny values
# whose products round to -0 (scores of either zero sign in one row).
SPECIALS = np.concatenate([
    np.array([0x7FC00000, 0xFFC00000, 0x7FC01234], np.uint32).view(np.float32),
    np.array([np.inf, -np.inf, 3e38, -3e38, 1e-45, 1e-30, -1e-30, 0.0, -0.0], np.float32)])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fast_forward_special_values(d, causal, order):
    rng = np.random.default_rng(d + causal)
    q = rng.standard_normal((1, 2, 70, d), dtype=np.float32)
    k = rng.standard_normal((1, 2, 90, d), dtype=np.float32)
    v = rng.standard_normal((1, 2, 90, d), dtype=np.float32)
    # Rows of tiny values: their scores are +-0, ties of the row max across lanes.
    q[0, 0, 3] = 1e-30
    k[0, 0, ::3] = -1e-30
    for x in (q, k, v):
        x.flat[rng.integers(0, x.size, 6)] = rng.choice(SPECIALS, 6)
    sim = pyfa.sim.fa2_forward(q, k, v, causal=causal, block_r=64, block_c=64)
    o, lse = pyfa.fa2_forward(q, k, v, causal=causal, block_r=64, block_c=64, backend="emu",
                              emu_order=order, variant="fast")
    assert same_bits(o, sim.o) and same_bits(lse, sim.lse)


def test_auto_falls_back_and_fast_names_what_it_lacks():
    q, k, v = make_inputs((1, 1, 20, 40), (1, 1, 20, 40), seed=1)
    sim = pyfa.sim.fa2_forward(q, k, v, block_r=16, block_c=16)
    o, lse = pyfa.fa2_forward(q, k, v, block_r=16, block_c=16, backend="emu", variant="auto")
    assert same_bits(o, sim.o) and same_bits(lse, sim.lse)
    with pytest.raises(ValueError, match=r"config->variant: fast: .*head_dim 64, 128, not 40"):
        pyfa.fa2_forward(q, k, v, backend="emu", variant="fast")
    q, k, v = make_inputs((1, 1, 20, 64), (1, 1, 20, 64), seed=1)
    with pytest.raises(ValueError, match=r"config->variant: fast: .*64x64, 128x64, not 32x64"):
        pyfa.fa2_forward(q, k, v, block_r=32, block_c=64, backend="emu", variant="fast")
    with pytest.raises(ValueError, match=r"variant: expected one of"):
        pyfa.fa2_forward(q, k, v, backend="emu", variant="quick")


def test_fast_needs_aligned_tensors():
    q, k, v = make_inputs((1, 1, 20, 64), (1, 1, 20, 64), seed=2)
    raw = np.zeros(q.size + 1, np.float32)
    shifted = raw[1:].reshape(q.shape)  # 4 bytes past an aligned buffer
    shifted[...] = q
    assert shifted.ctypes.data % 16 != 0
    with pytest.raises(ValueError, match=r"config->variant: fast: .*16-byte aligned"):
        pyfa.fa2_forward(shifted, k, v, backend="emu", variant="fast")
    sim = pyfa.sim.fa2_forward(q, k, v, block_r=64, block_c=64)
    o, lse = pyfa.fa2_forward(shifted, k, v, block_r=64, block_c=64, backend="emu", variant="auto")
    assert same_bits(o, sim.o) and same_bits(lse, sim.lse)


def test_default_tiles_per_variant():
    for d in (64, 128):
        assert pyfa.default_tiles("fa2_forward", d, backend="emu") == pyfa.sim.default_tiles("fa2_forward", d)
        fast = pyfa.default_tiles("fa2_forward", d, backend="emu", variant="fast")
        assert fast == (128, 64)  # the emulator's H200 profile holds the larger tile
        assert pyfa.default_tiles("fa2_forward", d, backend="emu", variant="auto") == fast
        assert pyfa.smem_bytes("fa2_forward", *fast, d, variant="fast") <= 227 * 1024
    assert pyfa.smem_bytes("fa2_forward", 32, 64, 64, variant="fast") == 0
    assert pyfa.default_tiles("fa2_forward", 40, backend="emu", variant="auto") == \
        pyfa.sim.default_tiles("fa2_forward", 40)
    # The fast dQ kernel holds Q_i, dO_i and dQ_i: Br = 128 fits at d = 64 only.
    assert pyfa.default_tiles("fa2_backward_dq", 64, backend="emu", variant="fast") == (128, 64)
    assert pyfa.default_tiles("fa2_backward_dq", 128, backend="emu", variant="fast") == (64, 64)


# ---- the ordered row max (src/kernels/fast/fast_common.h, ordered_row_max16)

def f32(x):
    return np.float32(x)


def bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def pyfa_max(a, b):
    """docs/numerics.md: (b > a) ? b : a (NaN on the right ignored, ties keep a)."""
    return b if b > a else a


def sequential(m_old, row):
    m = m_old
    for s in row:
        m = pyfa_max(m, s)
    return m


def ordered_tree(m_old, row, lanes):
    """The kernel's reduction: each lane folds its own consecutive columns from m_old, then
    the xor-butterfly of ordered_row_max16 (the lower lanes on the left), as lane 0 sees it."""
    per = len(row) // lanes
    part = [sequential(m_old, row[i * per:(i + 1) * per]) for i in range(lanes)]
    o = 1
    while o < lanes:
        part = [pyfa_max(part[i ^ o], part[i]) if i & o else pyfa_max(part[i], part[i ^ o])
                for i in range(lanes)]
        o <<= 1
    assert len({bits(p) for p in part}) == 1, "the lanes disagree"
    return part[0]


VALUES = [f32("nan"), f32(-np.inf), f32(-0.0), f32(0.0), f32(1.0), f32(np.inf)]


def vmax(a, b):
    """pyfa_max on arrays (pyfa/sim/numerics.py's form)."""
    return np.where(b > a, b, a)


def test_ordered_tree_equals_the_sequential_scan_exhaustively():
    # Every row of 8 columns over 4 lanes (2 columns each) drawn from the classes the
    # order relation tells apart, from every starting m: 6^9 cases, bit for bit.
    vals = np.array(VALUES, np.float32)
    idx = np.indices((6,) * 8).reshape(8, -1).T
    rows = vals[idx]                                 # (6^8, 8)
    for m_old in vals:
        m = np.full(len(rows), m_old, np.float32)
        seq = m.copy()
        for c in range(8):
            seq = vmax(seq, rows[:, c])
        part = [vmax(vmax(m, rows[:, 2 * i]), rows[:, 2 * i + 1]) for i in range(4)]
        o = 1
        while o < 4:
            part = [vmax(part[i ^ o], part[i]) if i & o else vmax(part[i], part[i ^ o])
                    for i in range(4)]
            o <<= 1
        for p in part:
            assert np.array_equal(p.view(np.uint32), seq.view(np.uint32)), m_old


def test_ordered_tree_equals_the_sequential_scan_at_kernel_width():
    # 64 columns over 16 lanes, as in the kernel, with many ties and special values.
    rng = np.random.default_rng(5)
    pool = np.array(VALUES + [f32(2.0), f32(-1.0)], np.float32)
    for _ in range(3000):
        row = list(rng.choice(pool, 64))
        m_old = rng.choice(pool)
        assert bits(ordered_tree(m_old, row, 16)) == bits(sequential(m_old, row))


def test_an_unseeded_tree_would_differ():
    # Why the lanes start from m_old: a plain tree over the scores lets a NaN on the left
    # win, which the sequential scan never does.
    row = [f32("nan"), f32(1.0)]
    assert np.isnan(pyfa_max(row[0], row[1]))
    assert sequential(f32(-np.inf), row) == 1.0


# Masks (windows, both alignments), grouped-query heads and the (B, N, H, d) layout, which
# the fast kernel reads through Mask, the head mapping and the strides.
MASKED = [
    dict(causal=True, causal_align="top_left"),
    dict(window=(20, 5)),
    dict(window=(None, 0), causal_align="top_left"),
    dict(window=(7, None), causal=True),
    dict(window=(0, 0)),
]


def mask_id(m):
    return "-".join(f"{k}={v}" for k, v in m.items())


@functools.lru_cache(maxsize=None)
def simulated_masked_forward(m, heads, heads_kv, layout):
    """The inputs and the simulator's forward of MASKED[m] with these heads and layout,
    shared by both variants (the mask's xdist group keeps them on one worker)."""
    d = 64 if heads_kv == 2 else 128
    Nq, Nk = (150, 97) if heads_kv == 2 else (70, 200)
    rng = np.random.default_rng(heads + Nq)
    shape_q = (1, heads, Nq, d) if layout == "bhnd" else (1, Nq, heads, d)
    shape_k = (1, heads_kv, Nk, d) if layout == "bhnd" else (1, Nk, heads_kv, d)
    q = rng.standard_normal(shape_q, dtype=np.float32)
    k, v = (rng.standard_normal(shape_k, dtype=np.float32) for _ in range(2))
    return (q, k, v), pyfa.sim.fa2_forward(q, k, v, layout=layout, block_r=64, block_c=64, **MASKED[m])


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("heads,heads_kv", [(4, 2), (3, 1)])
@pytest.mark.parametrize("m", [pytest.param(m, id=mask_id(mask), marks=pytest.mark.xdist_group(f"fast_forward_mask{m}"))
                               for m, mask in enumerate(MASKED)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_forward_masks_gqa_layouts(m, heads, heads_kv, layout, variant):
    mask = MASKED[m]
    (q, k, v), sim = simulated_masked_forward(m, heads, heads_kv, layout)
    for order in ("forward", "reverse"):
        o, lse = pyfa.fa2_forward(q, k, v, layout=layout, block_r=64, block_c=64, backend="emu",
                                  emu_order=order, variant=variant, **mask)
        assert same_bits(o, sim.o) and same_bits(lse, sim.lse), order


# The FA2 backward: its dQ and dK/dV kernels have fast variants (auto and fast run them
# beside the one preprocess kernel; tests/test_variants.py).
BACKWARD_CASES = [
    (1, 2, 100, 130, 64, 64, 64),
    (1, 1, 200, 77, 64, 128, 64),
    (2, 1, 70, 131, 128, 64, 64),
    (1, 1, 45, 190, 128, None, None),
]


@functools.lru_cache(maxsize=None)
def simulated_backward(case, causal):
    """The inputs of a backward case, the simulator's forward (default tiles) and its
    backward at the case's tiles: computed once and shared (read only) by every run of the
    case, which its xdist group keeps on one worker."""
    B, H, Nq, Nk, d, Br, Bc = case
    q, k, v, do = make_inputs((B, H, Nq, d), (B, H, Nk, d), grid.case_seed(case), True)
    fwd = pyfa.sim.fa2_forward(q, k, v, causal=causal)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=causal, block_r=Br, block_c=Bc)
    return (q, k, v, do), fwd, sim


@pytest.mark.parametrize("variant", ["reference", "auto"])
@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", grid.grouped(BACKWARD_CASES, "fast_dq"))
def test_fa2_backward_with_the_fast_dq_equals_the_simulator(case, causal, order, variant):
    _, _, _, _, _, Br, Bc = case
    (q, k, v, do), fwd, sim = simulated_backward(case, causal)
    dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=causal, block_r=Br,
                                   block_c=Bc, backend="emu", emu_order=order, variant=variant)
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", MASKED, ids=mask_id)
def test_fast_dq_masks_gqa(mask, d):
    # d = 128 runs the two-role dQ kernel (fa2_backward_dq_fast_roles); Nq, Nk with tails.
    rng = np.random.default_rng(9 + d)
    Nq, Nk = (110, 90) if d == 64 else (75, 150)
    q, do = (rng.standard_normal((1, 4, Nq, d), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, Nk, d), dtype=np.float32) for _ in range(2))
    fwd = pyfa.sim.fa2_forward(q, k, v, **mask)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=64, block_c=64, **mask)
    for order in ("forward", "reverse"):
        dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=64, block_c=64,
                                       backend="emu", emu_order=order, variant="auto", **mask)
        assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv), order


def test_fast_dq_tiles_at_d128():
    # Q_i^T, dO_i^T, K_j, V_j, P_ij, dS_ij (dQ_i in registers): an A100's 163 KiB holds it.
    assert pyfa.smem_bytes("fa2_backward_dq", 64, 64, 128, variant="fast") == \
        4 * (4 * 64 * 128 + 2 * 64 * 68)
    assert pyfa.smem_bytes("fa2_backward_dq", 128, 64, 128, variant="fast") == 0
    # Tiles it lacks: variant auto runs the readable dQ (and dK/dV) kernel at those tiles.
    q, k, v, do = make_inputs((1, 1, 150, 128), (1, 1, 140, 128), 6, True)
    fwd = pyfa.sim.fa2_forward(q, k, v)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=32, block_c=64)
    dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=32, block_c=64,
                                   backend="emu", variant="auto")
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)


# The fast dK/dV kernel (d = 64 and 128, Br = Bc = 64; variant auto runs it inside
# fa2_backward). Q tails of every residue of 4 (the dS^T Q loop's last 1..3 rows), K/V
# tails, one tile and less, and Nq != Nk both ways, so that with causal some K/V tiles have
# an empty band (dK = dV = +0) and some query rows see no key (LSE = -inf, P = 0).
DKDV_CASES = [
    (1, 1, 64, 64, 64, 64, 64),
    (2, 1, 70, 131, 64, 64, 64),
    (1, 2, 131, 67, 64, 64, 64),
    (1, 1, 1, 1, 64, 64, 64),
    (1, 1, 129, 200, 64, 64, 64),
    (1, 1, 200, 45, 64, 64, 64),
    (1, 1, 64, 64, 128, 64, 64),
    (2, 1, 70, 131, 128, 64, 64),
    (1, 2, 131, 67, 128, 64, 64),
    (1, 1, 1, 1, 128, 64, 64),
    (1, 1, 129, 200, 128, 64, 64),
    (1, 1, 202, 45, 128, 64, 64),
    (1, 1, 63, 30, 128, None, None),
]

# The emulator under both thread orders, and the GPU when one is here (the cpu backend's
# kernels are its own: variant auto never runs a fast kernel there).
DKDV_RUNS = [r for r in grid.RUNS if getattr(r, "values", r)[0] != "cpu"]


@pytest.mark.parametrize("variant", ["reference", "auto"])
@pytest.mark.parametrize("backend,order", DKDV_RUNS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", grid.grouped(DKDV_CASES, "fast_dkdv"))
def test_fa2_backward_with_the_fast_dkdv_equals_the_simulator(case, causal, backend, order, variant):
    _, _, _, _, _, Br, Bc = case
    (q, k, v, do), fwd, sim = simulated_backward(case, causal)
    dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=causal, block_r=Br,
                                   block_c=Bc, backend=backend, emu_order=order, variant=variant)
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("mask", MASKED, ids=mask_id)
def test_fast_dkdv_masks_gqa_layouts(mask, layout, d):
    # Three query heads per K/V head: dK, dV sum over g = 0, 1, 2 in order.
    rng = np.random.default_rng(len(mask) + len(layout) + d)
    Nq, Nk = (75, 130) if d == 64 else (133, 70)
    shape_q = (1, 3, Nq, d) if layout == "bhnd" else (1, Nq, 3, d)
    shape_k = (1, 1, Nk, d) if layout == "bhnd" else (1, Nk, 1, d)
    q, do = (rng.standard_normal(shape_q, dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal(shape_k, dtype=np.float32) for _ in range(2))
    fwd = pyfa.sim.fa2_forward(q, k, v, layout=layout, **mask)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, layout=layout, block_r=64,
                                block_c=64, **mask)
    for order in ("forward", "reverse"):
        dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, layout=layout, block_r=64,
                                       block_c=64, backend="emu", emu_order=order,
                                       variant="auto", **mask)
        assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv), order


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fast_dkdv_special_values(d, causal, order):
    rng = np.random.default_rng(40 + causal + d)
    q, do = (rng.standard_normal((1, 2, 70, d), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 90, d), dtype=np.float32) for _ in range(2))
    q[0, 0, 3] = 1e-30
    k[0, 0, ::3] = -1e-30
    for x in (q, k, v, do):
        x.flat[rng.integers(0, x.size, 6)] = rng.choice(SPECIALS, 6)
    fwd = pyfa.sim.fa2_forward(q, k, v, causal=causal, block_r=64, block_c=64)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=causal, block_r=64, block_c=64)
    dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=causal, block_r=64,
                                   block_c=64, backend="emu", emu_order=order, variant="auto")
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)
    assert np.isnan(dk).any() and np.isnan(dv).any()  # the specials reach dK and dV


def test_fast_dkdv_tiles():
    for d in (64, 128):
        assert pyfa.default_tiles("fa2_backward_dkdv", d, backend="emu", variant="fast") == (64, 64)
        assert pyfa.default_tiles("fa2_backward_dkdv", d, backend="emu", variant="auto") == (64, 64)
        # K_j^T, V_j^T, Q_i, dO_i, P^T, dS^T (dK_j, dV_j in registers): an A100's 163 KiB
        # (166,912 bytes) holds it at d = 128.
        assert pyfa.smem_bytes("fa2_backward_dkdv", 64, 64, d, variant="fast") == \
            4 * (4 * 64 * d + 2 * 64 * 68)
        assert pyfa.smem_bytes("fa2_backward_dkdv", 128, 64, d, variant="fast") == 0
        assert pyfa.smem_bytes("fa2_backward_dkdv", 32, 32, d, variant="fast") == 0
    assert pyfa.smem_bytes("fa2_backward_dkdv", 64, 64, 128, variant="fast") <= 166912
    for d in (32, 96, 256):
        with pytest.raises(ValueError, match=r"variant: fast: .*fa2_backward_dkdv is compiled for "
                                             rf"head_dim 64, 128, not {d}"):
            pyfa.default_tiles("fa2_backward_dkdv", d, backend="emu", variant="fast")


# The copy stages of the fast FA2 backward at d = 128 (kernel table rows 21, 22: tile j+1's
# K_j, V_j, the next step's Q_i, dO_i copied behind this one's arithmetic) need 231,424
# bytes a block: the emulator's H200 profile runs them in every test above. An A100's
# 166,912 bytes (PYFA_EMU_SMEM_PER_BLOCK, read once per process: a process of its own)
# leave the chooser only the one-stage rows (12, 20, 165,888 bytes), the ones an A100 runs:
# both must give the simulator's bits, plainly and in strict mode.
ONE_STAGE_CASES = [  # (H, Hkv, Nq, Nk, mask): tails, GQA (the dK/dV kernel's next head), masks
    (2, 1, 131, 67, dict(causal=True)),
    (1, 1, 70, 200, dict()),
    (3, 1, 129, 130, dict(window=(20, 5))),
]
ONE_STAGE_SCRIPT = """
import ast, sys
import numpy as np, pyfa
folder = sys.argv[1]
data = np.load(folder + "/in.npz")
out = {"smem": np.array(pyfa.device_profile("emu")["smem_per_block"])}
for n, (_, _, _, _, mask) in enumerate(ast.literal_eval(sys.argv[2])):
    args = [data[f"{n}-{t}"] for t in ("q", "k", "v", "o", "lse", "do")]
    for check in ("off", "strict"):
        options = pyfa.Options(backend="emu", block_r=64, block_c=64, variant="fast", emu_check=check)
        for name, x in zip(("dq", "dk", "dv"), pyfa.fa2_backward(*args, options=options, **mask)):
            out[f"{n}-{check}-{name}"] = x
np.savez(folder + "/out.npz", **out)
"""


def run_emulated_elsewhere(script, smem, *args):
    env = dict(os.environ, PYFA_EMU_SMEM_PER_BLOCK=smem)
    env.pop("PYFA_EMU_CHECK", None)
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.xdist_group("one_stage")
def test_fast_backward_one_stage_rows_equal_the_simulator(tmp_path):
    rng = np.random.default_rng(61)
    inputs, sims = {}, []
    for n, (H, Hkv, Nq, Nk, mask) in enumerate(ONE_STAGE_CASES):
        q, do = (rng.standard_normal((1, H, Nq, 128), dtype=np.float32) for _ in range(2))
        k, v = (rng.standard_normal((1, Hkv, Nk, 128), dtype=np.float32) for _ in range(2))
        fwd = pyfa.sim.fa2_forward(q, k, v, **mask)
        sims.append(pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=64, block_c=64, **mask))
        inputs.update({f"{n}-q": q, f"{n}-k": k, f"{n}-v": v, f"{n}-o": fwd.o, f"{n}-lse": fwd.lse, f"{n}-do": do})
        # Here (the H200 profile): the two-stage rows, the same bits.
        dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, block_r=64, block_c=64, backend="emu",
                                       variant="fast", **mask)
        assert same_bits(dq, sims[n].dq) and same_bits(dk, sims[n].dk) and same_bits(dv, sims[n].dv), n
    np.savez(tmp_path / "in.npz", **inputs)
    run = run_emulated_elsewhere(ONE_STAGE_SCRIPT, "166912", tmp_path, repr(ONE_STAGE_CASES))
    assert run.returncode == 0, run.stdout + run.stderr
    got = np.load(tmp_path / "out.npz")
    assert int(got["smem"]) == 166912
    for n, sim in enumerate(sims):
        for check in ("off", "strict"):
            assert same_bits(got[f"{n}-{check}-dq"], sim.dq), (n, check)
            assert same_bits(got[f"{n}-{check}-dk"], sim.dk), (n, check)
            assert same_bits(got[f"{n}-{check}-dv"], sim.dv), (n, check)


PROFILE_SCRIPT = """
import numpy as np, pyfa
print("profile", pyfa.device_profile("emu")["smem_per_block"])
q = np.ones((1, 1, 70, 128), np.float32)
fwd = pyfa.sim.fa2_forward(q, q, q)
try:
    pyfa.fa2_backward(q, q, q, fwd.o, fwd.lse, q, options=pyfa.Options(backend="emu", variant="fast"))
    print("fast ran")
except pyfa.Error as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("smem, expect", [
    # The one-stage rows' 165,888 bytes are the least the fast backward at d = 128 takes.
    ("165888", ["profile 165888", "fast ran"]),
    ("165887", ["profile 165887", "refused:", "65887 bytes"]),
    ("lots", ["PYFA_EMU_SMEM_PER_BLOCK: expected bytes, 1024 to 1073741824, got \"lots\""]),
    ("512", ["PYFA_EMU_SMEM_PER_BLOCK: expected bytes"]),
])
def test_the_emulated_shared_memory_per_block(smem, expect):
    run = run_emulated_elsewhere(PROFILE_SCRIPT, smem)
    for words in expect:
        assert words in run.stdout + run.stderr, run.stdout + run.stderr


@pytest.mark.parametrize("d,tiles", [(128, (32, 32)), (128, (64, 32)), (96, (64, 64)), (256, (32, 32))])
def test_fast_dkdv_auto_falls_back(d, tiles):
    # Tiles or a head dim the fast dK/dV lacks: variant auto runs the readable kernel.
    q, k, v, do = make_inputs((1, 2, 70, d), (1, 2, 75, d), d + tiles[0], True)
    fwd = pyfa.sim.fa2_forward(q, k, v, causal=True)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=True, block_r=tiles[0],
                                block_c=tiles[1])
    dq, dk, dv = pyfa.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=True, block_r=tiles[0],
                                   block_c=tiles[1], backend="emu", variant="auto")
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)


# ---- the fast kernels' includes (issue 26): what the backwards share with the forwards
# lives in fast_common.h, so that no backward kernel depends on a forward kernel's file.

def _fast_includes(name, fast_dir):
    """The files of src/kernels/fast that `name` includes, directly or through another."""
    seen, todo = set(), [name]
    while todo:
        text = (fast_dir / todo.pop()).read_text()
        for inc in re.findall(r'#include "kernels/fast/([^"]+)"', text):
            if inc not in seen:
                seen.add(inc)
                todo.append(inc)
    return seen


def test_fast_backwards_include_no_forward_kernel():
    fast_dir = Path(__file__).resolve().parents[1] / "src" / "kernels" / "fast"
    forward = {"fa2_forward_fast.cuh", "fa1_forward_fast.cuh", "forward_tiles.h"}
    for name in ("fa2_backward_dkdv_fast.cuh", "fa2_backward_dq_fast.cuh", "fa1_backward_fast.cuh", "fast_tiles.h"):
        included = _fast_includes(name, fast_dir)
        assert "fast_common.h" in included, name
        assert not included & forward, (name, sorted(included & forward))
