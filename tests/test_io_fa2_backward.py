"""FA2 backward's IO record: the simulator counts what count_io counts, and both equal
the closed forms of docs/io_closed_forms.md ("FA2 backward")."""

import time

import pytest

import pyfa
from reference import make_inputs

# (B, H, Nq, Nk, d, Br, Bc): tails, Br != Bc both ways, Nq != Nk both ways, 1 x 1 tiles,
# and the default tiles (None).
SHAPES = [(1, 1, 1, 1, 4, 4, 4), (2, 3, 37, 53, 16, 8, 16), (1, 2, 64, 64, 32, 16, 16),
          (1, 1, 70, 40, 8, 32, 16), (1, 1, 40, 70, 8, 5, 7), (1, 1, 9, 6, 3, 1, 1),
          (1, 2, 90, 77, 8, None, None)]


def count(passes="backward", **kw):
    return pyfa.sim.count_io("fa2", passes=passes, **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,Nq,Nk,d,Br,Bc", SHAPES)
def test_simulator_and_count_io_agree(B, H, Nq, Nk, d, Br, Bc, causal):
    q, k, v, do = make_inputs((B, H, Nq, d), (B, H, Nk, d), 1, "do")
    fwd = pyfa.sim.fa2_forward(q, k, v, causal=causal, block_r=Br, block_c=Bc)
    sim = pyfa.sim.fa2_backward(q, k, v, fwd.o, fwd.lse, do, causal=causal, block_r=Br, block_c=Bc)
    counted = count(batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d, block_r=Br,
                    block_c=Bc, causal=causal)
    assert sim.io == counted
    assert sim.io.total == counted.total > 0
    both = count("both", batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d, block_r=Br,
                 block_c=Bc, causal=causal)
    assert both == fwd.io + sim.io


def noncausal_closed_form(B, H, Nq, Nk, d, Br, Bc, e=4):
    """Per docs/io_closed_forms.md, with Tc = ceil(Nk / Bc) column blocks of the dK/dV
    kernel and Tr = ceil(Nq / Br) row blocks of the dQ kernel."""
    Tc, Tr = -(-Nk // Bc), -(-Nq // Br)
    BH, q, kv, row = B * H, Nq * d * e, Nk * d * e, Nq * 4
    reads = {"O": BH * q, "dO": BH * (Tc + 2) * q, "Q": BH * (Tc + 1) * q,
             "K": BH * (Tr + 1) * kv, "V": BH * (Tr + 1) * kv,
             "LSE": BH * (Tc + 1) * row, "D": BH * (Tc + 1) * row}
    writes = {"D": BH * row, "dQ": BH * q, "dK": BH * kv, "dV": BH * kv}
    return reads, writes


@pytest.mark.parametrize("B,H,Nq,Nk,d,Br,Bc",
                         [s for s in SHAPES if s[5]] + [(4, 8, 2048, 2048, 64, 32, 32),
                                                         (4, 8, 2048, 2048, 64, 64, 64)])
def test_noncausal_closed_form(B, H, Nq, Nk, d, Br, Bc):
    io = count(batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d, block_r=Br, block_c=Bc)
    reads, writes = noncausal_closed_form(B, H, Nq, Nk, d, Br, Bc)
    assert io.reads == reads and io.writes == writes


@pytest.mark.parametrize("Br,Bc", [(32, 32), (16, 32), (32, 16), (8, 64), (1, 1)])
def test_causal_closed_form_square(Br, Bc):
    # Nq = Nk = N, Br | N and Bc | N, one of them dividing the other. Column block j of
    # the dK/dV kernel reads the rows from floor(j Bc / Br) Br on; row block i of the dQ
    # kernel reads the keys below ceil((i + 1) Br / Bc) Bc. Summed over the blocks:
    #   rows read by the dK/dV kernel = N (Tc + max(1, Br / Bc)) / 2
    #   keys read by the dQ kernel    = N (Tr + max(1, Bc / Br)) / 2
    # which for Br = Bc = b is b T (T + 1) / 2, the forward's count of visited tiles.
    B, H, N, d = 2, 3, 256, 16
    io = count(batch=B, heads=H, seqlen_q=N, seqlen_k=N, head_dim=d, block_r=Br, block_c=Bc,
               causal=True)
    Tr, Tc = N // Br, N // Bc
    rows = N * (Tc + max(1, Br // Bc)) // 2
    keys = N * (Tr + max(1, Bc // Br)) // 2
    BH = B * H
    assert io.reads["Q"] == BH * (rows + N) * d * 4
    assert io.reads["dO"] == BH * (rows + 2 * N) * d * 4
    assert io.reads["LSE"] == io.reads["D"] == BH * (rows + N) * 4
    assert io.reads["K"] == io.reads["V"] == BH * (N + keys) * d * 4
    assert io.reads["O"] == BH * N * d * 4
    assert io.writes == {"D": BH * N * 4, "dQ": BH * N * d * 4, "dK": BH * N * d * 4,
                         "dV": BH * N * d * 4}


def test_both_passes_are_forward_plus_backward():
    kw = dict(batch=4, heads=8, seqlen_q=2048, seqlen_k=1536, head_dim=64, causal=True)
    assert count("both", **kw) == count("forward", **kw) + count("backward", **kw)
    kw = dict(kw, block_r=32, block_c=16, causal=False)
    assert count("both", **kw) == count("forward", **kw) + count("backward", **kw)


def test_default_tiles_are_each_kernels_own():
    # At d = 256 the dK/dV and dQ kernels default to 32 x 32 and the preprocess to 64 x 64;
    # D and O do not depend on tiles, so the defaults are the 32 x 32 closed form.
    kw = dict(batch=1, heads=2, seqlen_q=100, seqlen_k=90, head_dim=256)
    reads, writes = noncausal_closed_form(1, 2, 100, 90, 256, 32, 32)
    io = count(**kw)
    assert io.reads == reads and io.writes == writes


def test_dtype_bytes_scales_tensors_not_statistics():
    kw = dict(batch=2, heads=2, seqlen_q=64, seqlen_k=64, head_dim=16, block_r=16, block_c=16)
    io4, io2 = count(**kw), count(dtype_bytes=2, **kw)
    for t in ("Q", "K", "V", "O", "dO"):
        assert io2.reads[t] * 2 == io4.reads[t]
    for t in ("dQ", "dK", "dV"):
        assert io2.writes[t] * 2 == io4.writes[t]
    assert io2.reads["LSE"] == io4.reads["LSE"] and io2.reads["D"] == io4.reads["D"]
    assert io2.writes["D"] == io4.writes["D"]


def test_count_io_is_fast_at_scale():
    start = time.perf_counter()
    io = count("both", batch=64, heads=16, seqlen_q=16384, seqlen_k=16384, head_dim=64, causal=True)
    assert time.perf_counter() - start < 5.0
    assert io.total > 0


def test_record_prints_a_table():
    text = str(count(batch=4, heads=8, seqlen_q=2048, seqlen_k=2048, head_dim=64))
    for name in ("dO", "dQ", "dK", "dV", "LSE", "D", "total", "MiB"):
        assert name in text


def test_dq_scheme_record_of_the_decision():
    # tools/dq_schemes.py, the numbers behind docs/fa2_backward_dq.md. Non-causal, Nq = Nk
    # = N, one tile size for all kernels (so Tr = Tc): scheme B writes and reads back
    # Tc x N x d of partials where A re-reads K and V Tr times, so A moves exactly the dQ
    # kernel's single read of Q, dO, LSE and D more.
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / "dq_schemes.py"
    spec = importlib.util.spec_from_file_location("pyfa_tools_dq_schemes", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    N, d, b = 256, 32, 32
    a = count(batch=1, heads=1, seqlen_q=N, seqlen_k=N, head_dim=d, block_r=b, block_c=b)
    bio = tool.scheme_b_io(N, N, d, b, b, False)
    assert a.total - bio.total == 2 * N * d * 4 + 2 * N * 4
    assert bio.writes["dQ partials"] == bio.reads["dQ partials"] == (N // b) * N * d * 4
    r = tool.compare(4, 8, 2048, 64, True)
    assert r["bytes_A"] == count(batch=4, heads=8, seqlen_q=2048, seqlen_k=2048, head_dim=64,
                                 causal=True).total
    assert 0.70 < r["flops_B"] / r["flops_A"] < 0.72
