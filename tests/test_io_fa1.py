"""FA1's IO records (forward: Algorithm 1, backward: Algorithm 4): the simulators count what
count_io counts, both equal the closed forms of docs/io_closed_forms.md, and the published
hand analysis of the forward loop is reproduced."""

import time

import pytest

import pyfa
from reference import make_inputs

MiB, GiB = 1 << 20, 1 << 30

SHAPES = [(1, 1, 1, 1, 4, 4, 4), (2, 3, 37, 53, 16, 8, 16), (1, 2, 64, 64, 32, 16, 16),
          (1, 1, 70, 40, 8, 32, 16), (1, 1, 40, 70, 8, 5, 7), (1, 1, 30, 12, 4, 4, 2)]


def count(passes, B, H, Nq, Nk, d, Br, Bc, causal=False, **kw):
    return pyfa.sim.count_io("fa1", passes=passes, batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk,
                             head_dim=d, block_r=Br, block_c=Bc, causal=causal, **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,Nq,Nk,d,Br,Bc", SHAPES)
def test_simulators_and_count_io_agree(B, H, Nq, Nk, d, Br, Bc, causal):
    q, k, v, do = make_inputs((B, H, Nq, d), (B, H, Nk, d), 1, "do")
    fwd = pyfa.sim.fa1_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)
    bwd = pyfa.sim.fa1_backward(q, k, v, fwd.o, fwd.m, fwd.l, do, causal=causal, block_r=Br,
                                block_c=Bc)
    assert fwd.io == count("forward", B, H, Nq, Nk, d, Br, Bc, causal)
    assert bwd.io == count("backward", B, H, Nq, Nk, d, Br, Bc, causal)
    assert fwd.io + bwd.io == count("both", B, H, Nq, Nk, d, Br, Bc, causal)


def forward_closed_form(B, H, Nq, Nk, d, visits):
    """`visits`: sum over K/V tiles j of the Q rows visited (Tc * Nq without causal)."""
    BH = B * H
    reads = {"K": 4 * BH * Nk * d, "V": 4 * BH * Nk * d, "Q": 4 * BH * visits * d,
             "O": 4 * BH * visits * d, "m": 4 * BH * visits, "l": 4 * BH * visits}
    # The initialization (O = 0, m = -inf, l = 0) writes each once more.
    writes = {"O": 4 * BH * (visits + Nq) * d, "m": 4 * BH * (visits + Nq), "l": 4 * BH * (visits + Nq)}
    return reads, writes


def backward_closed_form(B, H, Nq, Nk, d, visits):
    BH = B * H
    reads = {"K": 4 * BH * Nk * d, "V": 4 * BH * Nk * d, "m": 4 * BH * visits, "l": 4 * BH * visits}
    for name in ("Q", "O", "dO", "dQ"):
        reads[name] = 4 * BH * visits * d
    # dQ = 0 first, then written back at every visit; dK_j, dV_j once.
    writes = {"dQ": 4 * BH * (visits + Nq) * d, "dK": 4 * BH * Nk * d, "dV": 4 * BH * Nk * d}
    return reads, writes


@pytest.mark.parametrize("B,H,Nq,Nk,d,Br,Bc", SHAPES + [(4, 8, 2048, 2048, 64, 32, 32)])
def test_noncausal_closed_forms(B, H, Nq, Nk, d, Br, Bc):
    Tc = -(-Nk // Bc)
    for passes, form in (("forward", forward_closed_form), ("backward", backward_closed_form)):
        io = count(passes, B, H, Nq, Nk, d, Br, Bc)
        reads, writes = form(B, H, Nq, Nk, d, Tc * Nq)
        assert io.reads == reads and io.writes == writes


@pytest.mark.parametrize("N,Br,Bc", [(256, 32, 32), (256, 16, 64), (240, 8, 48), (96, 32, 96)])
def test_causal_closed_forms(N, Br, Bc):
    # Nq = Nk = N, Br dividing Bc and Bc dividing N: K/V tile j starts at key j*Bc, which
    # rows j*Bc.. see, and Q tile j*Bc/Br is the first visited: N - j*Bc rows. Summed over
    # j: Tc*N - Bc*Tc*(Tc-1)/2.
    B, H, d = 2, 3, 16
    Tc = N // Bc
    visits = Tc * N - Bc * Tc * (Tc - 1) // 2
    for passes, form in (("forward", forward_closed_form), ("backward", backward_closed_form)):
        io = count(passes, B, H, N, N, d, Br, Bc, causal=True)
        reads, writes = form(B, H, N, N, d, visits)
        assert io.reads == reads and io.writes == writes


def test_published_hand_analysis_of_the_forward_loop():
    # B=4, H=8, N=2048, d=64, Br=Bc=32: K and V are read once (16 MiB each); Q and O once
    # per K/V tile (64 tiles: 1 GiB each); O written once per K/V tile (1 GiB) plus its
    # initialization (16 MiB); m and l read and written once per K/V tile (16 MiB each),
    # plus their initialization (256 KiB each).
    start = time.perf_counter()
    io = count("forward", 4, 8, 2048, 2048, 64, 32, 32)
    assert time.perf_counter() - start < 1.0
    assert io.reads == {"K": 16 * MiB, "V": 16 * MiB, "Q": GiB, "O": GiB, "m": 16 * MiB, "l": 16 * MiB}
    assert io.writes == {"O": GiB + 16 * MiB, "m": 16 * MiB + 256 * 1024, "l": 16 * MiB + 256 * 1024}


@pytest.mark.parametrize("passes", ["forward", "backward"])
@pytest.mark.parametrize("causal", [False, True])
def test_bytes_fall_as_bc_grows(passes, causal):
    totals = [count(passes, 2, 2, 512, 512, 64, 32, Bc, causal).total
              for Bc in (4, 8, 16, 32, 64, 128, 256, 512)]
    assert all(a > b for a, b in zip(totals, totals[1:])), totals


def test_default_tiles_are_the_kernels():
    kw = dict(batch=1, heads=1, seqlen_q=1000, seqlen_k=1000, head_dim=64)
    assert pyfa.sim.count_io("fa1", **kw) == count("forward", 1, 1, 1000, 1000, 64, 64, 227)
    assert pyfa.sim.count_io("fa1", passes="backward", **kw) == \
        count("backward", 1, 1, 1000, 1000, 64, 64, 128)


def test_dtype_bytes_scales_tensors_not_statistics():
    io4 = count("both", 2, 2, 64, 64, 16, 16, 16)
    io2 = count("both", 2, 2, 64, 64, 16, 16, 16, dtype_bytes=2)
    assert io2.reads["Q"] * 2 == io4.reads["Q"] and io2.writes["dQ"] * 2 == io4.writes["dQ"]
    assert io2.reads["m"] == io4.reads["m"] and io2.writes["l"] == io4.writes["l"]


def test_count_io_is_fast_at_scale():
    start = time.perf_counter()
    io = pyfa.sim.count_io("fa1", passes="both", batch=64, heads=16, seqlen_q=16384,
                           seqlen_k=16384, head_dim=64, block_r=16, block_c=16, causal=True)
    assert time.perf_counter() - start < 1.0
    assert io.total > 0
