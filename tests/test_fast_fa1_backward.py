"""The fast FA1 backward (src/kernels/fast/fa1_backward_fast.cuh): the same bits as the
simulator, and so as the readable kernel, on every case it takes, under two thread orders;
variant selection (fast names what it lacks, auto falls back, auto with the fast kernel's
tiles runs it)."""

import numpy as np
import pytest

import grid
import pyfa
from reference import same_bits
from test_fast_kernels import MASKED, SPECIALS  # the masks and special values of the FA2 tests

# (B, H, Hkv, Nq, Nk, d): both head dims, one tile and less, Q tails of every residue of 4
# (the dS^T Q and P^T dO loops' last 1..3 rows), K/V tails of residues 1, 3 and 8 (the dS K
# loop's last keys), Nq != Nk both ways (with causal and Nq > Nk the first rows see no key,
# l = 0), and grouped-query heads (dK~_j, dV~_j summed over g in order, dQ of every head of
# the group).
CASES = [
    (1, 1, 1, 64, 64, 64),
    (2, 1, 1, 70, 131, 64),
    (1, 2, 2, 131, 67, 64),
    (1, 1, 1, 1, 1, 64),
    (1, 1, 1, 129, 200, 64),
    (1, 4, 2, 194, 45, 64),
    (1, 3, 1, 75, 130, 64),
    (1, 1, 1, 64, 64, 128),
    (1, 2, 1, 131, 70, 128),
    (2, 1, 1, 45, 190, 128),
]
BR, BC = 64, 64


def case_id(case):
    B, H, Hkv, Nq, Nk, d = case
    return f"B{B}H{H}Hkv{Hkv}-Nq{Nq}-Nk{Nk}-d{d}"


def inputs(case, layout="bhnd", seed=None):
    B, H, Hkv, Nq, Nk, d = case
    rng = np.random.default_rng(seed if seed is not None else sum(case))
    shape = (lambda h, n: (B, h, n, d)) if layout == "bhnd" else (lambda h, n: (B, n, h, d))
    q, do = (rng.standard_normal(shape(H, Nq), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal(shape(Hkv, Nk), dtype=np.float32) for _ in range(2))
    return q, k, v, do


def simulated(q, k, v, do, layout="bhnd", **mask):
    """The FA1 forward's O, m, l and the simulated backward, both at the fast tiles."""
    fwd = pyfa.sim.fa1_forward(q, k, v, layout=layout, block_r=BR, block_c=BC, **mask)
    sim = pyfa.sim.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, layout=layout, block_r=BR,
                                block_c=BC, **mask)
    return fwd, sim


def check(q, k, v, do, fwd, sim, backend, order, variant="fast", layout="bhnd", **mask):
    dq, dk, dv = pyfa.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, layout=layout, block_r=BR,
                                   block_c=BC, backend=backend, emu_order=order,
                                   variant=variant, **mask)
    assert same_bits(dq, sim.dq), "dQ differs from the simulator"
    assert same_bits(dk, sim.dk), "dK differs from the simulator"
    assert same_bits(dv, sim.dv), "dV differs from the simulator"
    return dq, dk, dv


_SIM = {}


@pytest.mark.parametrize("backend,order", grid.RUNS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", grid.grouped(CASES, "fast_fa1_backward", case_id))
def test_fast_fa1_backward_equals_the_simulator(case, causal, backend, order):
    if (case, causal) not in _SIM:
        q, k, v, do = inputs(case)
        _SIM[case, causal] = (q, k, v, do), simulated(q, k, v, do, causal=causal)
    (q, k, v, do), (fwd, sim) = _SIM[case, causal]
    if backend == "cpu":  # the cpu backend's kernels are its own
        with pytest.raises(ValueError, match="config->variant: fast: the cpu backend"):
            pyfa.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, causal=causal, block_r=BR,
                              block_c=BC, backend=backend, variant="fast")
        return
    check(q, k, v, do, fwd, sim, backend, order, causal=causal)


# Windows (both alignments, one side unbounded, a band of one key; the fast FA2 kernels'
# list) and the (B, N, H, d) layout, which the kernel reads through Mask and the strides.
# Top-left alignment with Nq < Nk leaves the last K/V tiles an empty band: dK = dV = +0.
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("mask", MASKED, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_fast_fa1_backward_windows_gqa_layouts(mask, layout):
    case = (1, 4, 2, 150, 97, 64) if layout == "bhnd" else (1, 3, 1, 70, 200, 128)
    q, k, v, do = inputs(case, layout)
    fwd, sim = simulated(q, k, v, do, layout, **mask)
    for order in ("forward", "reverse"):
        check(q, k, v, do, fwd, sim, "emu", order, layout=layout, **mask)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fast_fa1_backward_special_values(d, causal, order):
    q, k, v, do = inputs((1, 2, 2, 70, 90, d), seed=60 + causal)
    rng = np.random.default_rng(61 + causal)
    q[0, 0, 3] = 1e-30
    k[0, 0, ::3] = -1e-30
    for x in (q, k, v, do):
        x.flat[rng.integers(0, x.size, 6)] = rng.choice(SPECIALS, 6)
    fwd, sim = simulated(q, k, v, do, causal=causal)
    dq, dk, dv = check(q, k, v, do, fwd, sim, "emu", order, causal=causal)
    assert np.isnan(dq).any() and np.isnan(dk).any()  # the specials reach the outputs


def test_fast_names_what_it_lacks():
    q, k, v, do = inputs((1, 1, 1, 20, 20, 64))
    fwd = pyfa.sim.fa1_forward(q, k, v, block_r=32, block_c=64)
    with pytest.raises(ValueError, match=r"config->variant: fast: the fast fa1_backward at head_dim=64 "
                                         r"has tiles \(block_r x block_c\) 64x64, not 32x64"):
        pyfa.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, block_r=32, block_c=64, backend="emu",
                          variant="fast")
    q40, k40, v40, do40 = (x[..., :40].copy() for x in (q, k, v, do))
    fwd40 = pyfa.sim.fa1_forward(q40, k40, v40, block_r=64, block_c=64)
    with pytest.raises(ValueError, match=r"config->variant: fast: the fast fa1_backward is compiled for "
                                         r"head_dim 64, 128, not 40"):
        pyfa.fa1_backward(q40, k40, v40, fwd40.o, fwd40.m, fwd40.l, do40, block_r=64, block_c=64,
                          backend="emu", variant="fast")
    with pytest.raises(ValueError, match=r"variant: fast: .*fa1_backward is compiled for head_dim 64, 128, "
                                         r"not 96"):
        pyfa.default_tiles("fa1_backward", 96, backend="emu", variant="fast")


def test_fast_needs_aligned_tensors():
    q, k, v, do = inputs((1, 1, 1, 30, 40, 64))
    raw = np.zeros(q.size + 1, np.float32)
    shifted = raw[1:].reshape(q.shape)  # 4 bytes past an aligned buffer
    shifted[...] = q
    assert shifted.ctypes.data % 16 != 0
    fwd, sim = simulated(q, k, v, do)
    with pytest.raises(ValueError, match=r"config->variant: fast: .*16-byte aligned"):
        pyfa.fa1_backward(shifted, k, v, fwd.o, fwd.m, fwd.l, do, block_r=BR, block_c=BC,
                          backend="emu", variant="fast")
    check(shifted, k, v, do, fwd, sim, "emu", "forward", variant="auto")


def test_auto_falls_back_and_runs_the_fast_kernel_at_its_tiles():
    # Tiles the fast kernel lacks: auto runs the readable kernel at those tiles.
    q, k, v, do = inputs((1, 2, 1, 90, 70, 64))
    fwd = pyfa.sim.fa1_forward(q, k, v, block_r=32, block_c=32)
    sim = pyfa.sim.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, block_r=32, block_c=32)
    dq, dk, dv = pyfa.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, block_r=32, block_c=32,
                                   backend="emu", variant="auto")
    assert same_bits(dq, sim.dq) and same_bits(dk, sim.dk) and same_bits(dv, sim.dv)
    # At 64 x 64 auto selects the fast row: its shared-memory layout, not the readable one's.
    # K_j^T, V_j^T, K_j, Q_i, dO_i, O_i, P^T, dS^T, D_i: at d = 128 it just fits an H200's
    # 227 KiB, at d = 64 an A100's 163 KiB too.
    for d in (64, 128):
        fast = pyfa.smem_bytes("fa1_backward", BR, BC, d, variant="fast")
        assert fast == 4 * (6 * 64 * d + 2 * 64 * 68 + 64)
        assert fast <= (227 if d == 128 else 163) * 1024
        assert pyfa.smem_bytes("fa1_backward", BR, BC, d, variant="auto") == fast
        assert pyfa.smem_bytes("fa1_backward", BR, BC, d, variant="reference") != fast
        assert pyfa.default_tiles("fa1_backward", d, backend="emu", variant="fast") == (BR, BC)
        # Without tiles auto keeps the readable kernel's default tiles (the paper's rule:
        # 64 x 128 at d = 64, which the fast kernel lacks; 64 x 64 at d = 128, which it has).
        assert pyfa.default_tiles("fa1_backward", d, backend="emu", variant="auto") == \
            pyfa.sim.default_tiles("fa1_backward", d)
    fwd, sim = simulated(q, k, v, do)
    for order in ("forward", "reverse"):
        check(q, k, v, do, fwd, sim, "emu", order, variant="auto")
