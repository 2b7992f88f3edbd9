"""count_io under windows, alignments and GQA against the closed forms of
docs/io_closed_forms.md ("Windows and alignment", "Grouped-query attention")."""

import pytest

import pyfa


def count(algo, passes="forward", **kw):
    return pyfa.sim.count_io(algo, passes=passes, **kw)


def causal_window_pairs(T, c):
    """Visited tile pairs of a causal window of w keys, Nq = Nk = T b, Br = Bc = b,
    c = ceil(w / b): (c + 1)(T - c / 2) while c <= T, the causal T(T + 1) / 2 beyond."""
    c = min(c, T)
    return (c + 1) * (2 * T - c) // 2


def symmetric_window_pairs(T, c):
    """Visited tile pairs of a window (w, w), same tiling: (2c + 1) T - c (c + 1) while
    c < T, every pair T^2 beyond."""
    return T * T if c >= T else (2 * c + 1) * T - c * (c + 1)


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("N,b,w", [(256, 32, 0), (256, 32, 1), (256, 32, 31), (256, 32, 32),
                                   (256, 32, 33), (256, 16, 100), (256, 32, 255), (256, 32, 4096),
                                   (16384, 64, 4096)])
def test_causal_sliding_window_closed_form(N, b, w, align):
    B, H, d = 2, 3, 8
    kw = dict(batch=B, heads=H, seqlen_q=N, seqlen_k=N, head_dim=d, block_r=b, block_c=b,
              causal=True, window=(w, None), causal_align=align)
    T, c = N // b, -(-w // b)
    V = causal_window_pairs(T, c)
    per_pair = B * H * b * d * 4
    fwd = count("fa2", **kw)
    assert fwd.reads["K"] == fwd.reads["V"] == V * per_pair
    bwd = count("fa2", "backward", **kw)
    once = B * H * N * d * 4
    assert bwd.reads["Q"] == V * per_pair + once
    assert bwd.reads["K"] == V * per_pair + once
    fa1 = count("fa1", **kw)
    assert fa1.reads["Q"] == fa1.reads["O"] == V * per_pair
    assert fa1.writes["O"] == V * per_pair + once


@pytest.mark.parametrize("N,b,w", [(256, 32, 0), (256, 32, 5), (256, 32, 64), (256, 32, 300),
                                   (192, 16, 47)])
def test_symmetric_window_closed_form(N, b, w):
    kw = dict(batch=1, heads=1, seqlen_q=N, seqlen_k=N, head_dim=4, block_r=b, block_c=b,
              window=(w, w))
    V = symmetric_window_pairs(N // b, -(-w // b))
    assert count("fa2", **kw).reads["K"] == V * b * 4 * 4
    assert count("fa1", **kw).reads["Q"] == V * b * 4 * 4


def test_unbounded_window_is_no_mask_and_causal_overrides_the_right_side():
    kw = dict(batch=2, heads=2, seqlen_q=100, seqlen_k=70, head_dim=8, block_r=16, block_c=8)
    for algo in ("fa1", "fa2"):
        for passes in ("forward", "backward"):
            plain = count(algo, passes, **kw)
            assert count(algo, passes, window=(None, None), **kw) == plain
            assert count(algo, passes, window=(10**9, 10**9), **kw) == plain
            assert count(algo, passes, causal=True, window=(None, 5), **kw) == \
                count(algo, passes, causal=True, **kw)


def test_alignment_moves_the_band():
    # Nq = 2 Nk, causal: bottom-right leaves the first Nk rows empty (their tiles visit
    # nothing); top-left leaves none, and its last rows see every key.
    Nk, b, d = 64, 16, 4
    kw = dict(batch=1, heads=1, seqlen_q=2 * Nk, seqlen_k=Nk, head_dim=d, block_r=b, block_c=b,
              causal=True)
    T = Nk // b
    br = count("fa2", causal_align="bottom_right", **kw).reads["K"]
    tl = count("fa2", causal_align="top_left", **kw).reads["K"]
    assert br == T * (T + 1) // 2 * b * d * 4
    assert tl == (T * (T + 1) // 2 + T * T) * b * d * 4


@pytest.mark.parametrize("Hkv", [1, 2, 4, 8])
def test_gqa_closed_forms(Hkv):
    # Without a mask: the kernels with a block per query head move what MHA with H heads
    # moves; FA2's dK/dV kernel and FA1's backward read K, V once per K/V head and write
    # dK, dV once per K/V head.
    B, H, Nq, Nk, d, Br, Bc = 2, 8, 96, 80, 16, 32, 16
    kw = dict(batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk, head_dim=d, block_r=Br, block_c=Bc)
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    kv = Nk * d * 4
    assert count("fa2", heads_kv=Hkv, **kw) == count("fa2", **kw)
    assert count("fa1", heads_kv=Hkv, **kw) == count("fa1", **kw)
    f2 = count("fa2", "backward", heads_kv=Hkv, **kw)
    assert f2.reads["K"] == f2.reads["V"] == B * (H * Tr + Hkv) * kv
    assert f2.writes["dK"] == f2.writes["dV"] == B * Hkv * kv
    assert f2.reads["Q"] == B * H * (Tc + 1) * Nq * d * 4
    f1 = count("fa1", "backward", heads_kv=Hkv, **kw)
    assert f1.reads["K"] == f1.reads["V"] == f1.writes["dK"] == f1.writes["dV"] == B * Hkv * kv
    assert f1.reads["Q"] == B * H * Tc * Nq * d * 4
    mha = count("fa1", "backward", **kw)
    assert {t: n for t, n in f1.reads.items() if t not in ("K", "V")} == \
        {t: n for t, n in mha.reads.items() if t not in ("K", "V")}


def test_gqa_in_the_standard_model_repeats_and_sums():
    B, H, Hkv, N, d = 1, 8, 2, 64, 16
    kw = dict(batch=B, heads=H, seqlen_q=N, seqlen_k=N, head_dim=d)
    g = count("standard", "both", heads_kv=Hkv, **kw)
    mha = count("standard", "both", **kw)
    kv, kv_rep = B * Hkv * N * d * 4, B * H * N * d * 4
    assert g.reads["K"] == g.reads["V"] == kv and g.writes["K_rep"] == kv_rep
    assert g.reads["dK_rep"] == kv_rep and g.writes["dK"] == kv
    # The matmuls move what MHA's do; on top come the copies (read K, V, write K_rep,
    # V_rep) and the group sums (read dK_rep, dV_rep, write dK, dV).
    assert g.total - mha.total == 2 * (kv + kv_rep) + 2 * (kv_rep + kv)


def test_heads_kv_and_mask_arguments_are_checked():
    kw = dict(batch=1, heads=6, seqlen_q=8, seqlen_k=8, head_dim=4)
    for bad in (4, 0, -1, 2.0, True):
        with pytest.raises(ValueError, match="heads_kv"):
            count("fa2", heads_kv=bad, **kw)
    with pytest.raises(ValueError, match="window"):
        count("fa2", window=(-1, 0), **kw)
    with pytest.raises(ValueError, match="causal_align"):
        count("fa2", causal_align="center", **kw)
    with pytest.raises(TypeError, match="profile"):
        count("fa2", profile="h100", **kw)


def test_profile_sizes_the_default_tiles():
    small = pyfa.sim.DeviceProfile("small", 48 * 1024, 1024, 1)
    kw = dict(batch=1, heads=1, seqlen_q=1024, seqlen_k=1024, head_dim=256)
    big_tiles = pyfa.sim.count_io("fa2", **kw)
    small_tiles = pyfa.sim.count_io("fa2", profile=small, **kw)
    # Smaller Br: more Q row blocks, each re-reading K and V.
    assert small_tiles.reads["K"] > big_tiles.reads["K"]
    Br = pyfa.sim.default_tiles("fa2_forward", 256, small)[0]
    assert small_tiles.reads["K"] == -(-1024 // Br) * 1024 * 256 * 4
