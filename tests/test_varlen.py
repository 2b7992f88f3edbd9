"""Packed sequences (pyfa.attention_varlen): row r of a varlen call equals row r of the
dense call of its own sequence alone, bit for bit (docs/numerics.md, "Packed
sequences"), forward and backward, FA1 and FA2, on the emulator (readable and fast
kernels), the cpu backend (threads 1, 2, 3) and the simulator; and the rows of a padded
dense batch where padding cannot reach them. Random decompositions include empty
sequences (no queries, no keys, both). Bad offsets are refused naming the argument,
before anything is written; the simulator's IO record equals count_io_varlen's."""

import functools

import numpy as np
import pytest

import pyfa
from conftest import HAS_CUDA
from pyfa import api
from pyfa.varlen import Varlen

# (causal, window, causal_align)
MASKS = [
    (False, None, "bottom_right"),
    (True, None, "bottom_right"),
    (True, None, "top_left"),
    (False, (3, 2), "bottom_right"),
    (False, (None, 0), "top_left"),
]
# One worker runs the module, so the dense references (dense, below) are shared by the
# backends of a case.
pytestmark = pytest.mark.xdist_group("varlen")


def same_bits(a, b):
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@functools.lru_cache(maxsize=None)
def problem(seed, H=2, Hkv=1, d=16, longest=19):
    """A random decomposition: B sequences of random lengths (some empty), and the packed
    q, k, v, do."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(2, 5))
    lens_q = rng.integers(0, longest + 1, B)
    lens_k = rng.integers(0, longest + 1, B)
    lens_q[0], lens_k[0] = max(lens_q[0], 1), max(lens_k[0], 1)  # some work in every case
    if B > 2:
        lens_q[1], lens_k[2] = 0, 0  # a sequence without queries, one without keys
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    f = lambda n, h: rng.standard_normal((n, h, d)).astype(np.float32)
    return cu_q, cu_k, f(cu_q[-1], H), f(cu_k[-1], Hkv), f(cu_k[-1], Hkv), f(cu_q[-1], H)


OPTS = {
    "emu": pyfa.Options(backend="emu", block_r=8, block_c=8, variant="reference"),
    "cpu": pyfa.Options(backend="cpu", block_r=8, block_c=8),
}


@functools.lru_cache(maxsize=None)
def dense(seed, algo, mask, backend="emu"):
    """Each sequence alone, by the dense API: [(o, stats..., dq, dk, dv) or None]."""
    cu_q, cu_k, q, k, v, do = problem(seed)
    causal, window, align = mask
    kw = dict(causal=causal, window=window, causal_align=align, layout="bnhd", options=OPTS[backend])
    out = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs, dos = (q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]],
                           do[cu_q[b]:cu_q[b + 1]])
        fwd = pyfa.fa2_forward(qs, ks, vs, **kw) if algo == "fa2" else pyfa.fa1_forward(qs, ks, vs, **kw)
        _, dq, dk, dv = pyfa.attention_grad(qs, ks, vs, dos, algo=algo, **kw)
        out.append((*fwd, dq, dk, dv))
    return out


def check_rows(seed, algo, mask, got_fwd, got_grads, backend="emu"):
    cu_q, cu_k = problem(seed)[:2]
    for b, ref in enumerate(dense(seed, algo, mask, backend)):
        qa, qz, ka, kz = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        n_stats = len(got_fwd) - 1
        assert same_bits(got_fwd[0][qa:qz], ref[0]), (b, "o")
        for s in range(n_stats):
            assert same_bits(got_fwd[1 + s][:, qa:qz], ref[1 + s]), (b, "stats")
        dq, dk, dv = ref[-3:]
        assert same_bits(got_grads[0][qa:qz], dq), (b, "dq")
        assert same_bits(got_grads[1][ka:kz], dk), (b, "dk")
        assert same_bits(got_grads[2][ka:kz], dv), (b, "dv")


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("algo", ["fa2", "fa1"])
def test_varlen_rows_equal_their_sequence_alone(seed, mask, algo):
    """emu, cpu and the simulator: every row's output, statistics and gradients are those
    of its sequence's own dense call; the simulator's IO record is count_io_varlen's."""
    cu_q, cu_k, q, k, v, do = problem(seed)
    causal, window, align = mask
    kw = dict(causal=causal, window=window, causal_align=align)
    for backend in ("emu", "cpu"):
        opts = OPTS[backend]
        fwd = pyfa.attention_varlen(q, k, v, cu_q, cu_k, algo=algo, return_lse=algo == "fa2", options=opts, **kw)
        if algo == "fa1":  # the library's m and l, through the op itself
            fwd = pyfa.varlen.run("fa1_forward", dict(q=q, k=k, v=v), cu_q, cu_k, options=opts, **kw)
        o, *grads = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, algo=algo, options=opts, **kw)
        assert same_bits(o, fwd[0])
        assert same_bits(pyfa.attention_varlen(q, k, v, cu_q, cu_k, algo=algo, options=opts, **kw), o)
        check_rows(seed, algo, mask, fwd, grads, "emu")
    sim = pyfa.sim
    f = getattr(sim, f"{algo}_forward_varlen")(q, k, v, cu_q, cu_k, options=OPTS["emu"], **kw)
    stats = (f.lse,) if algo == "fa2" else (f.m, f.l)
    g = getattr(sim, f"{algo}_backward_varlen")(q, k, v, f.o, *stats, do, cu_q, cu_k, options=OPTS["emu"], **kw)
    check_rows(seed, algo, mask, (f.o, *stats), (g.dq, g.dk, g.dv), "emu")
    H, d, Hkv = q.shape[1], q.shape[2], k.shape[1]
    for passes, record in (("forward", f.io), ("backward", g.io)):
        model = sim.count_io_varlen(algo, passes=passes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, heads=H,
                                    head_dim=d, heads_kv=Hkv, block_r=8, block_c=8, **kw)
        assert (model.reads, model.writes) == (record.reads, record.writes), passes


def test_varlen_gqa_and_empty_sequences_values():
    """GQA with 4 query heads on 2 K/V heads; a sequence with queries and no keys gets
    O = 0, LSE = -inf and dQ = 0, one with keys and no queries dK = dV = 0."""
    cu_q, cu_k = offsets([6, 0, 5]), offsets([9, 7, 0])
    rng = np.random.default_rng(7)
    q = rng.standard_normal((11, 4, 16)).astype(np.float32)
    k = rng.standard_normal((16, 2, 16)).astype(np.float32)
    v = rng.standard_normal((16, 2, 16)).astype(np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    opts = OPTS["cpu"]
    o, lse = pyfa.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, options=opts)
    _, dq, dk, dv = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, options=opts)
    assert lse.shape == (4, 11) and o.shape == q.shape
    assert np.all(o[6:] == 0) and np.all(lse[:, 6:] == -np.inf) and np.all(dq[6:] == 0)
    assert np.all(dk[9:] == 0) and np.all(dv[9:] == 0)
    od, lsed = pyfa.fa2_forward(q[:6], k[:9], v[:9], layout="bnhd", options=opts)
    assert same_bits(o[:6], od) and same_bits(lse[:, :6], lsed)
    r = pyfa.sim.attention_varlen(q, k, v, cu_q, cu_k, options=opts)
    assert same_bits(r.o, o) and same_bits(r.lse, lse)
    ref = np.einsum("qhd,khd->hqk", q[:6].astype(np.float64), np.repeat(k[:9], 2, axis=1)) / 4.0
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.allclose(np.einsum("hqk,khd->qhd", p, np.repeat(v[:9], 2, axis=1)), o[:6], atol=1e-5)


def test_varlen_threads_and_padded_batch():
    """cpu threads 1, 2, 3 give the same bits; a padded dense batch of the same sequences
    (self-attention, causal: padding is never seen by a real row) has the same rows, and
    the same dK, dV rows where the padded rows' dO is zero."""
    lengths = [13, 4, 17, 1]
    cu = offsets(lengths)
    rng = np.random.default_rng(3)
    H, d, N = 2, 16, max(lengths)
    q, k, v, do = (rng.standard_normal((cu[-1], H, d)).astype(np.float32) for _ in range(4))
    runs = [pyfa.attention_varlen_grad(q, k, v, do, cu, cu, causal=True,
                                       options=pyfa.Options(backend="cpu", threads=t)) for t in (1, 2, 3)]
    for other in runs[1:]:
        assert all(same_bits(a, b) for a, b in zip(runs[0], other))
    pad = np.zeros((4, len(lengths), N, H, d), np.float32)
    for b, n in enumerate(lengths):
        for t, x in enumerate((q, k, v, do)):
            pad[t, b, :n] = x[cu[b]:cu[b + 1]]
    o, dq, dk, dv = pyfa.attention_grad(*pad, causal=True, layout="bnhd", options=pyfa.Options(backend="cpu"))
    for b, n in enumerate(lengths):
        rows = slice(cu[b], cu[b + 1])
        for got, want in zip(runs[0], (o, dq, dk, dv)):
            assert same_bits(got[rows], want[b, :n])


def test_varlen_fast_kernels():
    """The register-tiled kernels (d = 64, 64 x 64 tiles) on the emulator: a sequence
    longer than a tile, an empty one and a short one, FA2 and FA1 (forward and
    backward), against the readable kernels at the same tiles and the dense call."""
    cu_q, cu_k = offsets([70, 0, 9]), offsets([66, 5, 0])
    rng = np.random.default_rng(11)
    q = rng.standard_normal((79, 2, 64)).astype(np.float32)
    k = rng.standard_normal((71, 1, 64)).astype(np.float32)
    v = rng.standard_normal((71, 1, 64)).astype(np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    for algo in ("fa2", "fa1"):
        runs = {variant: pyfa.attention_varlen_grad(
            q, k, v, do, cu_q, cu_k, causal=True, algo=algo,
            options=pyfa.Options(backend="emu", block_r=64, block_c=64, variant=variant))
            for variant in ("fast", "reference")}
        assert all(same_bits(a, b) for a, b in zip(runs["fast"], runs["reference"])), algo
        o, dq, dk, dv = pyfa.attention_grad(q[:70], k[:66], v[:66], do[:70], causal=True, algo=algo,
                                            layout="bnhd",
                                            options=pyfa.Options(backend="emu", block_r=64, block_c=64))
        got = runs["fast"]
        assert same_bits(got[0][:70], o) and same_bits(got[1][:70], dq)
        assert same_bits(got[2][:66], dk) and same_bits(got[3][:66], dv)


@pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here")
def test_varlen_cuda_matches_emu():
    """On the GPU, host arrays (the offsets copied to the device) give the emulator's bits."""
    cu_q, cu_k, q, k, v, do = problem(2)
    emu = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, causal=True, options=OPTS["emu"])
    gpu = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, causal=True,
                                     options=pyfa.Options(backend="cuda", block_r=8, block_c=8))
    assert all(same_bits(a, b) for a, b in zip(emu, gpu))


def test_varlen_empty_totals():
    """No queries at all: empty outputs; no keys at all: O = 0, LSE = -inf, zero grads."""
    q = np.ones((0, 2, 8), np.float32)
    k = np.ones((5, 2, 8), np.float32)
    o = pyfa.attention_varlen(q, k, k, offsets([0, 0]), offsets([2, 3]))
    assert o.shape == (0, 2, 8)
    q = np.ones((4, 2, 8), np.float32)
    k = np.ones((0, 2, 8), np.float32)
    o, lse = pyfa.attention_varlen(q, k, k, offsets([1, 3]), offsets([0, 0]), return_lse=True)
    assert np.all(o == 0) and np.all(lse == -np.inf)
    _, dq, dk, dv = pyfa.attention_varlen_grad(q, k, k, q, offsets([1, 3]), offsets([0, 0]))
    assert np.all(dq == 0) and dk.shape == (0, 2, 8)


BAD = [
    (dict(cu_seqlens_q=np.array([0, 3, 8], np.int64)), TypeError, "cu_seqlens_q: expected dtype int32"),
    (dict(cu_seqlens_q=np.array([0, 9, 8], np.int32)), ValueError, r"cu_seqlens_q\[2\]: 8 is below"),
    (dict(cu_seqlens_q=np.array([1, 3, 8], np.int32)), ValueError, r"cu_seqlens_q\[0\]: must be 0"),
    (dict(cu_seqlens_k=np.array([0, 3, 7], np.int32)), ValueError, r"cu_seqlens_k\[2\]: must be the 8 rows"),
    (dict(cu_seqlens_k=np.array([0, 8], np.int32)), ValueError, "cu_seqlens_k: 2 offsets, but cu_seqlens_q has 3"),
    (dict(cu_seqlens_q=np.array([[0, 3, 8]], np.int32)), ValueError, "cu_seqlens_q: expected a 1-D array"),
    (dict(max_seqlen_q=4), ValueError, r"max_seqlen_q: 4 is below the longest sequence \(5 rows\)"),
    (dict(q=np.zeros((1, 8, 2, 16), np.float32)), ValueError, r"q: expected a packed tensor \(total_q, H, d\)"),
]


@pytest.mark.parametrize("change, error, message", BAD, ids=[b[2][:30] for b in BAD])
def test_varlen_bad_input_names_the_argument(change, error, message):
    rng = np.random.default_rng(0)
    args = dict(q=rng.standard_normal((8, 2, 16)).astype(np.float32),
                k=rng.standard_normal((8, 2, 16)).astype(np.float32),
                v=rng.standard_normal((8, 2, 16)).astype(np.float32),
                cu_seqlens_q=offsets([3, 5]), cu_seqlens_k=offsets([3, 5]))
    args.update(change)
    out = np.full((8, 2, 16), 7.0, np.float32)
    kw = {n: args.pop(n) for n in ("max_seqlen_q",) if n in args}
    with pytest.raises(error, match=message):
        pyfa.attention_varlen(*args.values(), out=out if args["q"].ndim == 3 else None,
                              options=pyfa.Options(backend="cpu"), **kw)
    assert np.all(out == 7.0)
    with pytest.raises(error, match=message):
        pyfa.sim.fa2_forward_varlen(*args.values(), **kw)


@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_library_checks_offsets_on_the_host(backend):
    """The library's own checks (a C caller's): offsets past the bound, decreasing, or
    not ending at the total are refused naming them, and out= is left as it was."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 2, 16)).astype(np.float32)
    cases = [
        ((0, 3, 8), (0, 3, 8), 4, r"tensors->cu_seqlens_q: sequence 1 has 5 rows, more than problem->seqlen_q = 4"),
        ((0, 3, 8), (0, 9, 8), 9, r"tensors->cu_seqlens_k\[2\]: 8 is below the offset before it"),
        ((0, 3, 7), (0, 3, 8), 8, r"tensors->cu_seqlens_q\[2\]: must be problem->total_q = 8, got 7"),
        ((2, 3, 8), (0, 3, 8), 8, r"tensors->cu_seqlens_q\[0\]: must be 0, got 2"),
    ]
    for cq, ck, longest, message in cases:
        cu = [np.array(c, np.int32) for c in (cq, ck)]
        varlen = Varlen(2, longest, longest, {"cu_seqlens_q": cu[0].ctypes.data, "cu_seqlens_k": cu[1].ctypes.data},
                        tuple(cu))
        out = np.full((8, 2, 16), 7.0, np.float32)
        with pytest.raises(pyfa.InvalidArgumentError, match=message):
            api._run("fa2_forward", dict(q=q, k=q, v=q), causal=False, window=None, causal_align="bottom_right",
                     scale=None, layout="bnhd", options=pyfa.Options(backend=backend), out=(out, None),
                     stream=None, mods={}, varlen=varlen)
        assert np.all(out == 7.0)


def test_c_abi_offsets_need_the_varlen_layout():
    """Through pyfa_run directly: offsets without problem->varlen are refused, as is
    problem->varlen with a problem of ABI 5's layout (which ends before it: the library
    reads it as 0); a tensor of offsets with strides is refused naming it."""
    from pyfa import _lib
    ffi, lib = _lib.load()
    q = np.random.default_rng(5).standard_normal((8, 2, 16)).astype(np.float32)
    o = np.zeros_like(q)
    lse = np.zeros((2, 8), np.float32)
    cu = offsets([3, 5])

    def call(struct_size, strides=0):
        pr = ffi.new("pyfa_problem *")
        pr.struct_size = struct_size
        pr.batch, pr.heads, pr.seqlen_q, pr.seqlen_k, pr.head_dim = 2, 2, 5, 5, 16
        pr.varlen, pr.total_q, pr.total_k = 1, 8, 8
        t = api._tensors("PYFA_MEMORY_HOST", {n: x.ctypes.data for n, x in
                                              (("q", q), ("k", q), ("v", q), ("o", o), ("lse", lse))})
        t.cu_seqlens_q.data = t.cu_seqlens_k.data = ffi.cast("void *", cu.ctypes.data)
        t.cu_seqlens_k.strides.row = strides
        cfg = ffi.new("pyfa_config *")
        cfg.backend = api.BACKENDS["cpu"]
        status = lib.pyfa_run(lib.PYFA_OP_FA2_FORWARD, pr, cfg, t, ffi.NULL)
        return status, ffi.string(lib.pyfa_last_error()).decode()

    abi5 = ffi.offsetof("pyfa_problem", "varlen")
    status, message = call(abi5)
    assert status == lib.PYFA_ERROR_INVALID_ARGUMENT
    assert "tensors->cu_seqlens_q: given, but problem->varlen is 0" in message
    status, message = call(ffi.sizeof("pyfa_problem"), strides=1)
    assert "tensors->cu_seqlens_k.strides: must be 0" in message
    assert call(ffi.sizeof("pyfa_problem")) == (lib.PYFA_OK, "")
    want = pyfa.attention_varlen(q, q, q, cu, cu, options=pyfa.Options(backend="cpu"))
    assert same_bits(o, want)
