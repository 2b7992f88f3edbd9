"""Strided and packed inputs: the library reads them in place (their strides go through
the C ABI, no copy) and gives the same bits as contiguous copies; outputs come back in
the layout asked for; inputs whose last axis is not contiguous are copied and still
give the same bits."""

import tracemalloc

import numpy as np
import pytest

import pyfa
from pyfa import _lib
from reference import make_inputs, same_bits

TILES = dict(block_r=4, block_c=4, backend="emu")


def bhnd(x):
    """A (B, N, H, d) tensor as a C-contiguous (B, H, N, d) copy."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def all_functions(q, k, v, do, **kw):
    """Every library function's outputs, backwards fed from the forwards."""
    o2, lse = pyfa.fa2_forward(q, k, v, **kw)
    g2 = pyfa.fa2_backward(q, k, v, o2, lse, do, **kw)
    o1, m, l = pyfa.fa1_forward(q, k, v, **kw)
    g1 = pyfa.fa1_backward(q, k, v, o1, m, l, do, **kw)
    return dict(o2=o2, lse=lse, dq2=g2[0], dk2=g2[1], dv2=g2[2], o1=o1, m=m, l=l, dq1=g1[0],
                dk1=g1[1], dv1=g1[2])


ROWS = ("lse", "m", "l")


@pytest.mark.parametrize("heads_kv", [3, 1])
def test_bnhd_layout_gives_the_bits_of_bhnd(heads_kv):
    B, N, H, d = 2, 9, 3, 8
    q, k, v, do = make_inputs((B, N, H, d), (B, N + 2, heads_kv, d), 1, "do")
    mask = dict(causal=True, window=(3, None), causal_align="top_left")
    got = all_functions(q, k, v, do, layout="bnhd", **mask, **TILES)
    want = all_functions(bhnd(q), bhnd(k), bhnd(v), bhnd(do), **mask, **TILES)
    for name, x in got.items():
        if name in ROWS:  # per-row tensors are (B, H, Nq) in both layouts
            assert same_bits(x, want[name]), name
        else:
            assert x.flags.c_contiguous and x.shape[1] == (N if "k" not in name and "v" not in name
                                                           else N + 2), name
            assert same_bits(bhnd(x), want[name]), name


def test_packed_qkv_views_give_the_bits_of_contiguous_copies():
    # flash-attn's packed QKV: q, k, v are views into one (B, N, 3, H, d) array.
    B, N, H, d = 2, 10, 2, 8
    rng = np.random.default_rng(4)
    qkv = rng.standard_normal((B, N, 3, H, d), dtype=np.float32)
    do = rng.standard_normal((B, N, H, d), dtype=np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous and q.base is not None
    got = all_functions(q, k, v, do, layout="bnhd", causal=True, **TILES)
    want = all_functions(bhnd(q), bhnd(k), bhnd(v), bhnd(do), causal=True, **TILES)
    for name, x in got.items():
        assert same_bits(x if name in ROWS else bhnd(x), want[name]), name


def test_transposed_bnhd_array_in_bhnd_layout():
    # q.transpose(0, 2, 1, 3) of a (B, N, H, d) array is a (B, H, N, d) view with a row
    # stride of H * d: read in place, same bits as its copy.
    q, k, v, do = make_inputs((1, 12, 4, 16), (1, 7, 2, 16), 9, "do")
    views = [x.transpose(0, 2, 1, 3) for x in (q, k, v, do)]
    got = all_functions(*views, window=(2, 2), **TILES)
    want = all_functions(*(np.ascontiguousarray(x) for x in views), window=(2, 2), **TILES)
    for name, x in got.items():
        assert x.flags.c_contiguous, name
        assert same_bits(x, want[name]), name


def test_views_with_offsets_gaps_and_broadcasts():
    # A view starting inside its base (an offset pointer), every other head (a head
    # stride of 2 N d), rows with gaps between them, and V broadcast along the batch.
    rng = np.random.default_rng(2)
    big = rng.standard_normal((2, 6, 9, 24), dtype=np.float32)
    q = big[:, 1::2, :, 3:11]            # (2, 3, 9, 8), rows 24 apart, starts at offset
    k = big[:, :3, 1:8, 12:20]           # (2, 3, 7, 8)
    v = np.broadcast_to(big[:1, 3:6, 2:9, :8], (2, 3, 7, 8))  # batch stride 0
    do = rng.standard_normal((2, 3, 9, 8), dtype=np.float32)
    got = all_functions(q, k, v, do, causal=True, **TILES)
    want = all_functions(*(np.ascontiguousarray(x) for x in (q, k, v, do)), causal=True, **TILES)
    for name, x in got.items():
        assert same_bits(x, want[name]), name


def test_inputs_without_a_contiguous_last_axis_are_copied_and_agree():
    q, k, v = make_inputs((1, 2, 6, 8), (1, 2, 6, 8), 3)
    q_f = np.asfortranarray(q)
    k_rev = k[..., ::-1].copy()[..., ::-1]  # same values, last-axis stride -4
    assert k_rev.strides[-1] < 0
    got = pyfa.attention(q_f, k_rev, v, **TILES)
    assert same_bits(got, pyfa.attention(q, k, v, **TILES))


def _peak_during(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak - before


def test_strided_inputs_are_not_copied():
    # NumPy reports its allocations to tracemalloc. A call on packed (B, N, 3, H, d)
    # views may allocate its outputs (o and lse) and small change, but no copy of q, k
    # or v; a q whose last axis is strided must be copied, and the same measure sees it.
    B, N, H, d = 1, 128, 4, 64
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, N, 3, H, d), dtype=np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    one = q.size * 4  # bytes of one of q, k, v (128 KiB)
    pyfa.fa2_forward(q, k, v, layout="bnhd", **TILES)  # load the library first
    (o, lse), peak = _peak_during(lambda: pyfa.fa2_forward(q, k, v, layout="bnhd", **TILES))
    outputs = o.nbytes + lse.nbytes
    assert peak < outputs + one // 4, (peak, outputs)
    q_odd = np.repeat(q, 2, axis=-1)[..., ::2]  # the same values, last axis 8 bytes apart
    _, peak_copy = _peak_during(lambda: pyfa.fa2_forward(q_odd, k, v, layout="bnhd", **TILES))
    assert peak_copy >= outputs + one, (peak_copy, outputs)


def test_c_abi_strides_and_extent_checks():
    # The C ABI reads strides straight: a (B, N, H, d) buffer described by its strides
    # gives the bits of the dense copy; strided outputs are written row by row and leave
    # the gaps between rows alone.
    ffi, lib = _lib.load()
    B, N, H, d = 2, 5, 3, 4
    q, k, v = make_inputs((B, N, H, d), (B, N, H, d), 8)
    pr = ffi.new("pyfa_problem *", dict(batch=B, heads=H, seqlen_q=N, seqlen_k=N, head_dim=d,
                                        causal=1))
    for name in ("q", "k", "v"):
        s = getattr(pr, name)
        s.batch, s.head, s.row = N * H * d, d, H * d
    o_wide = np.full((B, N, H, d + 3), 7.0, np.float32)  # rows of the output 3 floats apart
    pr.o.batch, pr.o.head, pr.o.row = N * H * (d + 3), d + 3, H * (d + 3)
    lse = np.empty((B, H, N), np.float32)
    cfg = ffi.new("pyfa_config *", dict(backend=2, block_r=2, block_c=2))
    ptr = [ffi.cast("float *", ffi.from_buffer(x)) for x in (q, k, v, o_wide, lse)]
    assert lib.pyfa_fa2_forward(pr, cfg, *ptr) == 0, ffi.string(lib.pyfa_last_error())
    want_o, want_lse = pyfa.fa2_forward(bhnd(q), bhnd(k), bhnd(v), causal=True, block_r=2,
                                        block_c=2, backend="emu")
    assert same_bits(bhnd(o_wide[..., :d]), want_o) and same_bits(lse, want_lse)
    assert np.all(o_wide[..., d:] == 7.0), "a gap between output rows was written"


def test_cpu_backend_takes_strided_inputs():
    # The cpu backend addresses dense tensors: the library gathers strided inputs (no
    # Python copy; the forwards' K and V are read in place) and the bits are the emulator's.
    B, N, H, d = 2, 10, 2, 8
    rng = np.random.default_rng(6)
    qkv = rng.standard_normal((B, N, 3, H, d), dtype=np.float32)
    do = rng.standard_normal((B, N, H, d), dtype=np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    kw = dict(layout="bnhd", causal=True, block_r=4, block_c=4)
    got = all_functions(q, k, v, do, backend="cpu", **kw)
    want = all_functions(q, k, v, do, backend="emu", **kw)
    for name, x in got.items():
        assert same_bits(x, want[name]), name


@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("Nq", [1, 5, 21])
def test_cpu_forwards_read_strided_kv_in_place(d, Nq):
    # The cpu backend's forwards take K and V through their strides (a (B, N, Hkv, d)
    # cache: row stride Hkv d), the decode path (Nq <= 8, the query heads of a K/V head
    # as one tile) and the tiled one alike, split or not; the bits are those of dense
    # copies and of the emulator.
    B, H, Hkv, Nk = 2, 4, 2, 150
    q, k, v = make_inputs((B, Nq, H, d), (B, Nk, Hkv, d), d + Nq)
    for kw in (dict(causal=True), dict(window=(37, 0), split_size=64), dict(split_size=64)):
        kw.update(block_r=16, block_c=32, layout="bnhd")
        for fwd in (pyfa.fa2_forward, pyfa.fa1_forward):
            if fwd is pyfa.fa1_forward and "split_size" in kw:
                continue
            got = fwd(q, k, v, backend="cpu", **kw)
            dense = fwd(q, bhnd(k).transpose(0, 2, 1, 3), bhnd(v).transpose(0, 2, 1, 3),
                        backend="cpu", **kw)
            emu = fwd(q, k, v, backend="emu", **kw)
            for a, b, c in zip(got, dense, emu):
                assert same_bits(a, b) and same_bits(a, c), (fwd.__name__, kw)


FAKE_CHILD = r"""
import json, sys
import cffi
import numpy as np
sys.path.insert(0, sys.argv[2])
from pyfa import _lib
ffi = cffi.FFI()
ffi.cdef(_lib._read_header()[1])
lib = ffi.dlopen(sys.argv[1])
B, N, H, Hkv, d = 2, 5, 4, 2, 4
pr = ffi.new("pyfa_problem *", dict(batch=B, heads=H, heads_kv=Hkv, seqlen_q=N, seqlen_k=N,
                                    head_dim=d))
cfg = ffi.new("pyfa_config *", dict(backend=1, block_r=2, block_c=2))
q = np.zeros((B, N, H, d), np.float32)       # (B, N, H, d): strides given below
kv = np.zeros((B, Hkv, N, d), np.float32)
o = np.full((B, N, H, d + 3), 7.0, np.float32)  # 3 floats of gap after every row
lse = np.zeros((B, H, N), np.float32)
pr.q.batch, pr.q.head, pr.q.row = N * H * d, d, H * d
pr.o.batch, pr.o.head, pr.o.row = N * H * (d + 3), d + 3, H * (d + 3)
ptr = lambda x: ffi.cast("float *", ffi.from_buffer(x))
st_fwd = lib.pyfa_fa2_forward(pr, cfg, ptr(q), ptr(kv), ptr(kv), ptr(o), ptr(lse))
dq, dk, dv = np.zeros((B, H, N, d), np.float32), np.zeros_like(kv), np.zeros_like(kv)
st_bwd = lib.pyfa_fa2_backward(pr, cfg, ptr(q), ptr(kv), ptr(kv), ptr(o), ptr(lse), ptr(q),
                               ptr(dq), ptr(dk), ptr(dv))
print(json.dumps(dict(fwd=st_fwd, bwd=st_bwd, rows=sorted(set(o[..., :d].ravel().tolist())),
                      gaps=sorted(set(o[..., d:].ravel().tolist())),
                      lse=sorted(set(lse.ravel().tolist())), dk=sorted(set(dk.ravel().tolist())),
                      dv=sorted(set(dv.ravel().tolist())),
                      error=ffi.string(lib.pyfa_last_error()).decode())))
"""


def test_cuda_host_entry_writes_strided_outputs_row_by_row(fake_cuda_library):
    # The C ABI over tests/c/fake_cuda.cpp (whose kernels fill o = 1, lse = 2, dk = 6,
    # dv = 7): a host entry point stages its outputs dense on the "GPU" and writes the
    # caller's strided o row by row, leaving the gaps between rows; dK, dV of a
    # grouped-query problem have Hkv heads.
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = fake_cuda_library
    run = subprocess.run([sys.executable, "-c", FAKE_CHILD, str(out), str(root)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["fwd"] == 0 and r["bwd"] == 0, r["error"]
    assert r["rows"] == [1.0] and r["gaps"] == [7.0] and r["lse"] == [2.0]
    assert r["dk"] == [6.0] and r["dv"] == [7.0]
