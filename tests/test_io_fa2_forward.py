"""FA2 forward's IO record: the simulator counts what count_io counts, and both equal
the closed form."""

import time

import pytest

import pyfa
from reference import make_inputs

SHAPES = [(1, 1, 1, 1, 4, 4, 4), (2, 3, 37, 53, 16, 8, 16), (1, 2, 64, 64, 32, 16, 16),
          (1, 1, 70, 40, 8, 32, 16), (1, 1, 40, 70, 8, 5, 7)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,Nq,Nk,d,Br,Bc", SHAPES)
def test_simulator_and_count_io_agree(B, H, Nq, Nk, d, Br, Bc, causal):
    q, k, v = make_inputs((B, H, Nq, d), (B, H, Nk, d), seed=1)
    sim = pyfa.sim.fa2_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)
    counted = pyfa.sim.count_io("fa2", batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                                block_r=Br, block_c=Bc, causal=causal)
    assert sim.io == counted
    assert sim.io.total == counted.total > 0


@pytest.mark.parametrize("B,H,Nq,Nk,d,Br,Bc", SHAPES + [(4, 8, 2048, 2048, 64, 32, 32)])
def test_noncausal_closed_form(B, H, Nq, Nk, d, Br, Bc):
    io = pyfa.sim.count_io("fa2", batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                           block_r=Br, block_c=Bc)
    Tr = -(-Nq // Br)
    assert io.reads == {"Q": 4 * B * H * Nq * d, "K": 4 * B * H * Tr * Nk * d, "V": 4 * B * H * Tr * Nk * d}
    assert io.writes == {"O": 4 * B * H * Nq * d, "LSE": 4 * B * H * Nq}


def test_causal_closed_form_square():
    # Nq = Nk = N, Br = Bc = b dividing N: Q tile i visits K/V tiles 0..i.
    B, H, N, d, b = 2, 2, 256, 16, 32
    io = pyfa.sim.count_io("fa2", batch=B, heads=H, seqlen_q=N, seqlen_k=N, head_dim=d,
                           block_r=b, block_c=b, causal=True)
    T = N // b
    tiles = T * (T + 1) // 2
    assert io.reads["K"] == io.reads["V"] == 4 * B * H * tiles * b * d


def test_dtype_bytes_scales_tensors_not_statistics():
    kw = dict(batch=2, heads=2, seqlen_q=64, seqlen_k=64, head_dim=16, block_r=16, block_c=16)
    io4 = pyfa.sim.count_io("fa2", **kw)
    io2 = pyfa.sim.count_io("fa2", dtype_bytes=2, **kw)
    assert io2.reads["K"] * 2 == io4.reads["K"] and io2.writes["LSE"] == io4.writes["LSE"]


def test_count_io_is_fast_at_scale():
    start = time.perf_counter()
    io = pyfa.sim.count_io("fa2", batch=64, heads=16, seqlen_q=16384, seqlen_k=16384,
                           head_dim=64, causal=True)
    assert time.perf_counter() - start < 5.0
    assert io.total > 0


def test_record_prints_a_table():
    io = pyfa.sim.count_io("fa2", batch=1, heads=1, seqlen_q=2048, seqlen_k=2048, head_dim=64)
    text = str(io)
    for name in ("Q", "K", "V", "O", "LSE", "total", "MiB"):
        assert name in text


def test_count_io_rejects_bad_arguments():
    with pytest.raises(ValueError, match="algo"):
        pyfa.sim.count_io("fa9", batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=1)
    with pytest.raises(ValueError, match="head_dim"):
        pyfa.sim.count_io("fa2", batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=0)
    with pytest.raises(ValueError, match="passes"):
        pyfa.sim.count_io("fa2", passes="sideways", batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=1)
