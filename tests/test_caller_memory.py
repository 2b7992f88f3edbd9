"""The caller's memory (the brief's rule: nothing the caller owns is written on failure).
An output may not overlap anything the call reads (the score modifications' arrays and
the packed sequences' offsets included) nor itself; a KV cache that new rows are written
into may not overlap itself; a forward + backward call writes o only once its backward
has succeeded; an array whose elements are not aligned is copied, never handed to the
kernels as a float *."""

import numpy as np
import pytest

import pyfa
import pyfa.sim
from pyfa.errors import CancelledError, InvalidArgumentError, TileTooLargeError

CPU = pyfa.Options(backend="cpu")


def qkv(seed=0, B=1, H=2, N=8, d=16):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, N, d), dtype=np.float32) for _ in range(4)]


def test_an_output_over_a_modification_s_array_is_refused_and_nothing_is_written():
    q, k, v, do = qkv()
    buf = np.zeros(q.size, np.float32)
    o = buf.reshape(q.shape)
    slopes = buf[:2]
    slopes[:] = [0.5, 0.25]
    before = buf.copy()
    with pytest.raises(InvalidArgumentError, match="out \\(o\\): overlaps alibi_slopes"):
        pyfa.attention(q, k, v, alibi_slopes=slopes, out=o, options=CPU)
    with pytest.raises(InvalidArgumentError, match="out \\(o\\): overlaps alibi_slopes"):
        pyfa.attention_grad(q, k, v, do, alibi_slopes=slopes, out=(o, None, None, None), options=CPU)
    bias = buf[:8 * 8].reshape(1, 1, 8, 8)
    with pytest.raises(InvalidArgumentError, match="out \\(o\\): overlaps bias"):
        pyfa.attention_grad(q, k, v, do, bias=bias, out=(o, None, None, None, None), options=CPU)
    assert np.array_equal(buf, before)


def test_an_output_over_the_packed_offsets_is_refused():
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((12, 2, 16), dtype=np.float32) for _ in range(4))
    buf = np.zeros(q.size, np.float32)
    o = buf.reshape(q.shape)
    cu = buf[:3].view(np.int32)
    cu[:] = [0, 5, 12]
    before = buf.copy()
    with pytest.raises(InvalidArgumentError, match="overlaps cu_seqlens_q"):
        pyfa.attention_varlen(q, k, v, cu, cu, out=o, options=CPU)
    with pytest.raises(InvalidArgumentError, match="overlaps cu_seqlens_q"):
        pyfa.attention_varlen_grad(q, k, v, do, cu, cu, out=(o, None, None, None), options=CPU)
    assert np.array_equal(buf, before)


def test_an_output_whose_elements_overlap_is_refused():
    q, k, v, _ = qkv()
    base = np.full((1, 1, 8, 16), 7.0, np.float32)
    o = np.lib.stride_tricks.as_strided(base, q.shape, (base.strides[0], 0, *base.strides[2:]))
    with pytest.raises(InvalidArgumentError, match="out \\(o\\): its elements overlap"):
        pyfa.attention(q, k, v, out=o, options=CPU)
    assert np.all(base == 7.0)
    # Interleaved views that share no element (q, k, v packed side by side) are not overlaps.
    packed = np.zeros((1, 8, 3, 2, 16), np.float32)
    got = pyfa.attention(q, k, v, out=packed[:, :, 0].transpose(0, 2, 1, 3), options=CPU)
    assert np.array_equal(got, pyfa.attention(q, k, v, options=CPU))


def test_new_rows_are_not_written_into_a_cache_whose_rows_overlap():
    rng = np.random.default_rng(2)
    qc = rng.standard_normal((2, 1, 2, 16), dtype=np.float32)
    row = rng.standard_normal((1, 8, 2, 16), dtype=np.float32)
    kc = np.lib.stride_tricks.as_strided(row, (2, 8, 2, 16), (0, *row.strides[1:]))
    vc = rng.standard_normal((2, 8, 2, 16), dtype=np.float32)
    new = [rng.standard_normal((2, 1, 2, 16), dtype=np.float32) for _ in range(2)]
    before = row.copy(), vc.copy()
    with pytest.raises(InvalidArgumentError, match="k_cache: its elements overlap"):
        pyfa.attention_with_kvcache(qc, kc, vc, np.array([3, 3], np.int32), *new, options=CPU)
    assert np.array_equal(row, before[0]) and np.array_equal(vc, before[1])
    # Read only (no new rows), a broadcast cache is fine: the two sequences see the same keys.
    o = pyfa.attention_with_kvcache(qc, kc, vc, np.array([3, 3], np.int32), options=CPU)
    one = pyfa.attention_with_kvcache(qc[1:], kc[1:].copy(), vc[1:], np.array([3], np.int32), options=CPU)
    assert np.array_equal(o[1:], one)


@pytest.mark.parametrize("algo", ["fa2", "fa1"])
def test_a_failing_backward_leaves_the_forward_s_out_as_it_was(algo):
    q, k, v, do = qkv(3)
    o = np.full_like(q, 7.0)
    with pytest.raises(InvalidArgumentError, match="out \\(dq\\)"):
        pyfa.attention_grad(q, k, v, do, algo=algo, out=(o, np.zeros((1, 2, 8, 15), np.float32), None, None),
                            options=CPU)
    assert np.all(o == 7.0)
    # Tiles the forward takes and the backward cannot.
    big = pyfa.Options(backend="emu", block_r=128, block_c=128)
    q, k, v, do = qkv(3, N=128, d=64)
    o = np.full_like(q, 7.0)
    with pytest.raises(TileTooLargeError):
        pyfa.attention_grad(q, k, v, do, algo=algo, out=(o, None, None, None), options=big)
    assert np.all(o == 7.0)
    # Cancelled in its backward: the forward reports once, when its one kernel is done.
    reports = []

    def cancel_in_backward(done, total):
        reports.append(done)
        return len(reports) > 1

    q, k, v, do = qkv(4)
    o = np.full_like(q, 7.0)
    with pytest.raises(CancelledError):
        pyfa.attention_grad(q, k, v, do, algo=algo, out=(o, None, None, None),
                            options=pyfa.Options(backend="emu", progress=cancel_in_backward))
    assert np.all(o == 7.0)
    got = pyfa.attention_grad(q, k, v, do, algo=algo, out=(o, None, None, None), options=CPU)
    want = pyfa.attention_grad(q, k, v, do, algo=algo, options=CPU)
    assert got[0] is o and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_an_unaligned_array_is_copied_before_the_kernels_see_it():
    q, k, v, _ = qkv(5)
    raw = np.zeros(q.nbytes + 1, np.uint8)
    q_odd = raw[1:].view(np.float32).reshape(q.shape)  # C-contiguous, one byte off
    q_odd[...] = q
    assert q_odd.flags.c_contiguous and not q_odd.flags.aligned
    strict = pyfa.Options(backend="emu", emu_check="strict")
    assert np.array_equal(pyfa.attention(q_odd, k, v, options=strict), pyfa.attention(q, k, v, options=strict))
    with pytest.raises(InvalidArgumentError, match="q"):
        pyfa.prepare(pyfa.attention, q_odd, k, v, options=CPU)


@pytest.mark.parametrize("answer, cancels", [(True, True), (np.True_, True), (None, False), (np.False_, False)])
def test_a_progress_callback_s_answer_is_read_as_a_bool(answer, cancels):
    q, k, v, _ = qkv(6, N=64)
    for call in (lambda o: pyfa.attention(q, k, v, options=o), lambda o: pyfa.sim.fa2_forward(q, k, v, options=o)):
        opts = pyfa.Options(backend="emu", progress=lambda done, total: answer)
        if cancels:
            with pytest.raises(CancelledError):
                call(opts)
        else:
            call(opts)


def test_a_progress_callback_answering_anything_else_is_refused():
    q, k, v, _ = qkv(6, N=64)
    opts = pyfa.Options(backend="emu", progress=lambda done, total: 1)
    for call in (pyfa.attention, pyfa.sim.fa2_forward):
        with pytest.raises(TypeError, match="progress: must return None, False or True"):
            call(q, k, v, options=opts)


def test_a_ctrl_c_in_the_forward_is_raised_before_the_backward():
    # The backward would refuse these tiles: the interrupt must not be lost behind its error.
    import os
    import signal
    q, k, v, do = qkv(7, N=128, d=64)
    o = np.full_like(q, 7.0)
    sent = []

    def interrupt_once(done, total):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        pyfa.attention_grad(q, k, v, do, out=(o, None, None, None),
                            options=pyfa.Options(backend="emu", block_r=128, block_c=128, progress=interrupt_once))
    assert sent and np.all(o == 7.0)


def test_empty_problems_check_options_with_their_modifications():
    e, k = np.zeros((1, 2, 0, 64), np.float32), np.zeros((1, 2, 4, 64), np.float32)
    lse = np.zeros((1, 2, 0), np.float32)
    fast = pyfa.Options(backend="emu", variant="fast")
    for mods in (dict(softcap=1.0), dict(alibi_slopes=np.ones(2, np.float32)),
                 dict(bias=np.zeros((1, 2, 0, 4), np.float32))):
        with pytest.raises(pyfa.InvalidArgumentError, match="takes no"):
            pyfa.fa2_backward(e, k, k, e, lse, e, options=fast, **mods)
        # ... and (H,) slopes of two heads fit the check's stand-in problem.
    got = pyfa.fa2_backward(e, k, k, e, lse, e, alibi_slopes=np.ones(2, np.float32), options=CPU)
    assert [g.shape for g in got] == [e.shape, k.shape, k.shape] and not any(g.any() for g in got)
