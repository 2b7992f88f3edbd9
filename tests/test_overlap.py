"""Outputs that share memory (src/include/pyfa.h): outputs overlapping each other are
refused, naming both, and so are outputs overlapping an input where outputs are written in
place (PYFA_FLAG_IN_PLACE, device pointers); views that interleave without sharing an
element, such as q, k, v or dq, dk, dv packed as (B, N, 3, H, d), keep working."""

import numpy as np
import pytest

from pyfa import _lib

B, H, N, D = 2, 3, 17, 8
IN_PLACE = 1


def setup(flags=0, backend=3):
    ffi, L = _lib.load()
    p = ffi.new("pyfa_problem*")
    p.struct_size = ffi.sizeof("pyfa_problem")
    p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim, p.causal = B, H, N, N, D, 1
    c = ffi.new("pyfa_config*")
    c.struct_size = ffi.sizeof("pyfa_config")
    c.backend, c.threads, c.emu_workers, c.flags = backend, 1, 1, flags
    return ffi, L, p, c


def ptr(ffi, a, offset=0):
    return ffi.cast("float*", ffi.from_buffer(a)) + offset


def message(ffi, L):
    return ffi.string(L.pyfa_last_error()).decode()


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(4)]


def test_outputs_overlapping_each_other_are_refused_naming_both():
    ffi, L, p, c = setup()
    q, k, v, _ = inputs()
    o = np.full(B * H * N * D, 7.0, np.float32)
    # lse inside o's span.
    st = L.pyfa_fa2_forward(p, c, ptr(ffi, q), ptr(ffi, k), ptr(ffi, v), ptr(ffi, o), ptr(ffi, o, 40))
    assert st == 1 and message(ffi, L) == "o and lse: the outputs overlap in memory"
    assert np.all(o == 7.0)
    do = inputs(1)[0]
    lse = np.zeros((B, H, N), np.float32)
    dq, dkv = np.full_like(q, 7.0), np.full_like(k, 7.0)
    st = L.pyfa_fa2_backward(p, c, ptr(ffi, q), ptr(ffi, k), ptr(ffi, v), ptr(ffi, q), ptr(ffi, lse), ptr(ffi, do),
                             ptr(ffi, dq), ptr(ffi, dkv), ptr(ffi, dkv))
    assert st == 1 and message(ffi, L) == "dk and dv: the outputs overlap in memory"
    assert np.all(dq == 7.0) and np.all(dkv == 7.0)


@pytest.mark.parametrize("backend", [2, 3])
def test_packed_outputs_that_share_no_element_keep_working(backend):
    # dq, dk, dv as views into one (B, N, 3, H, d) array, q, k, v into another.
    ffi, L, p, c = setup(IN_PLACE, backend)
    q, k, v, do = inputs(2)
    o, lse = np.zeros_like(q), np.zeros((B, H, N), np.float32)
    assert L.pyfa_fa2_forward(p, c, ptr(ffi, q), ptr(ffi, k), ptr(ffi, v), ptr(ffi, o), ptr(ffi, lse)) == 0
    want = [np.zeros_like(q) for _ in range(3)]
    assert L.pyfa_fa2_backward(p, c, ptr(ffi, q), ptr(ffi, k), ptr(ffi, v), ptr(ffi, o), ptr(ffi, lse), ptr(ffi, do),
                               *(ptr(ffi, w) for w in want)) == 0, message(ffi, L)
    packed_in = np.stack([q, k, v], axis=2).transpose(0, 3, 2, 1, 4).copy()  # (B, N, 3, H, d)
    packed = np.full((B, N, 3, H, D), 7.0, np.float32)
    for t in ("q", "k", "v", "dq", "dk", "dv"):
        s = getattr(p, t)
        s.batch, s.head, s.row = N * 3 * H * D, D, 3 * H * D
    st = L.pyfa_fa2_backward(p, c, ptr(ffi, packed_in), ptr(ffi, packed_in, H * D), ptr(ffi, packed_in, 2 * H * D),
                             ptr(ffi, o), ptr(ffi, lse), ptr(ffi, do), ptr(ffi, packed), ptr(ffi, packed, H * D),
                             ptr(ffi, packed, 2 * H * D))
    assert st == 0, message(ffi, L)
    for x, w in enumerate(want):
        assert packed[:, :, x].transpose(0, 2, 1, 3).tobytes() == w.tobytes()
    # Shifted by half a row, dk's rows share elements with dq's: refused.
    st = L.pyfa_fa2_backward(p, c, ptr(ffi, packed_in), ptr(ffi, packed_in, H * D), ptr(ffi, packed_in, 2 * H * D),
                             ptr(ffi, o), ptr(ffi, lse), ptr(ffi, do), ptr(ffi, packed), ptr(ffi, packed, D // 2),
                             ptr(ffi, packed, 2 * H * D))
    assert st == 1 and message(ffi, L) == "dq and dk: the outputs overlap in memory"


def test_an_output_over_an_input_is_refused_where_it_is_written_in_place():
    q, k, v, _ = inputs(3)
    ffi, L, p, c = setup()
    lse = np.zeros((B, H, N), np.float32)
    want, want_lse = np.zeros_like(q), np.zeros_like(lse)
    assert L.pyfa_fa2_forward(p, c, ptr(ffi, q), ptr(ffi, k), ptr(ffi, v), ptr(ffi, want), ptr(ffi, want_lse)) == 0
    # Staged (no PYFA_FLAG_IN_PLACE): o may be q's own memory; every input is read first.
    q2 = q.copy()
    assert L.pyfa_fa2_forward(p, c, ptr(ffi, q2), ptr(ffi, k), ptr(ffi, v), ptr(ffi, q2), ptr(ffi, lse)) == 0
    assert q2.tobytes() == want.tobytes()
    # In place, on the host or through device pointers: refused, naming both.
    ffi, L, p, c = setup(IN_PLACE)
    q2 = q.copy()
    st = L.pyfa_fa2_forward(p, c, ptr(ffi, q2), ptr(ffi, k), ptr(ffi, v), ptr(ffi, q2), ptr(ffi, lse))
    assert st == 1 and message(ffi, L).startswith("o and q: the output overlaps the input in memory")
    assert q2.tobytes() == q.tobytes()
    ffi, L, p, c = setup(0, backend=2)
    st = L.pyfa_fa2_forward_device(p, c, ptr(ffi, q2), ptr(ffi, k), ptr(ffi, v), ptr(ffi, want), ptr(ffi, k, 5),
                                   ffi.NULL)
    assert st == 1 and message(ffi, L).startswith("lse and k: the output overlaps the input in memory")


def test_different_layouts_whose_spans_meet_are_refused_conservatively():
    # lse kept in the gaps of a strided o: the strides differ, so the spans decide.
    ffi, L, p, c = setup()
    q, k, v, _ = inputs(4)
    big = np.full(B * H * N * 2 * D, 7.0, np.float32)
    p.o.batch, p.o.head, p.o.row = H * N * 2 * D, N * 2 * D, 2 * D
    st = L.pyfa_fa2_forward(p, c, ptr(ffi, q), ptr(ffi, k), ptr(ffi, v), ptr(ffi, big), ptr(ffi, big, D))
    assert st == 1 and message(ffi, L) == "o and lse: the outputs overlap in memory"
    assert np.all(big == 7.0)
