"""Kept set-ups of host calls (pyfa/api.py, "Plans"): a call that differs from an earlier
one on the same thread only in its arrays' contents and addresses reuses that call's
checked structs; anything else takes the full path, with its checks."""
import threading

import numpy as np
import pytest

import pyfa
from pyfa import api

OPTS = pyfa.Options(backend="cpu")
rng = np.random.default_rng(11)


def qkv(shape=(2, 4, 33, 32)):
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]


@pytest.fixture(autouse=True)
def no_plans():
    api._plans_of_thread().clear()
    yield
    api._plans_of_thread().clear()


def test_a_repeated_call_reuses_its_plan_with_the_bits_of_a_fresh_one():
    q, k, v = qkv()
    first = pyfa.fa2_forward(q, k, v, causal=True, options=OPTS)
    plans = api._plans_of_thread()
    assert len(plans) == 1
    (plan,) = plans.values()
    calls = []
    run = plan.run
    plan.run = lambda args: calls.append(1) or run(args)
    q2, k2, v2 = qkv()
    again = pyfa.fa2_forward(q2, k2, v2, causal=True, options=OPTS)
    assert calls == [1] and len(plans) == 1
    plans.clear()
    fresh = pyfa.fa2_forward(q2, k2, v2, causal=True, options=OPTS)
    assert all(np.array_equal(a, b) for a, b in zip(again, fresh))
    assert not any(np.shares_memory(a, b) for a in again for b in first)  # outputs are new arrays


def test_what_a_plan_is_keyed_by():
    q, k, v = qkv()
    pyfa.fa2_forward(q, k, v, causal=True, options=OPTS)
    pyfa.fa2_forward(q, k, v, causal=1, options=OPTS)  # another type: checked again, kept apart
    pyfa.fa2_forward(q, k, v, causal=True, options=pyfa.Options(backend="cpu", threads=1))
    pyfa.fa2_forward(q[:, :, :20], k, v, causal=True, options=OPTS)  # another shape (and strides)
    pyfa.fa2_forward(q, k, v, causal=True, options=OPTS, out=(None, None))  # out of Nones: its own key
    assert len(api._plans_of_thread()) == 5
    with pytest.raises(pyfa.ArgumentTypeError, match="out: expected a tuple of 2"):
        pyfa.fa2_forward(q, k, v, causal=True, options=OPTS, out=(None,))
    with pytest.raises(pyfa.InvalidArgumentError, match="head dim"):
        pyfa.fa2_forward(q, k[..., :16], v, causal=True, options=OPTS)


def test_calls_with_arrays_pyfa_checks_or_copies_are_not_kept():
    q, k, v = qkv()
    o = np.empty_like(q)
    pyfa.fa2_forward(q, k, v, options=OPTS, out=(o, None))                 # an out= array
    pyfa.fa2_forward(q, k, v, options=OPTS, softcap=2.0, alibi_slopes=np.ones(4, np.float32))
    pyfa.fa2_forward(q, k, v, options=OPTS, sinks=np.zeros(4, np.float32))
    pyfa.fa2_forward(np.asfortranarray(q), k, v, options=OPTS)            # copied: not in place
    pyfa.fa2_forward(q, k, v, options=pyfa.Options(backend="cpu", progress=lambda d, t: False))
    assert len(api._plans_of_thread()) == 0


def test_a_misaligned_array_takes_the_full_path():
    q, k, v = qkv((1, 2, 16, 32))
    pyfa.fa2_forward(q, k, v, options=OPTS)
    buf = np.zeros(q.nbytes + 2, np.uint8)
    q_off = np.frombuffer(buf.data, np.float32, q.size, offset=2).reshape(q.shape)  # off a float's alignment
    q_off[...] = q
    assert q_off.strides == q.strides and q_off.__array_interface__["data"][0] % 4
    got = pyfa.fa2_forward(q_off, k, v, options=OPTS)
    want = pyfa.fa2_forward(q, k, v, options=OPTS)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_plans_are_per_thread():
    q, k, v = qkv()
    pyfa.fa2_forward(q, k, v, options=OPTS)
    seen = []
    t = threading.Thread(target=lambda: seen.append(len(api._plans_of_thread())))
    t.start()
    t.join()
    assert seen == [0] and len(api._plans_of_thread()) == 1


def test_the_cache_keeps_a_bounded_number_of_plans():
    q, k, v = qkv((1, 1, 70, 16))
    for n in range(1, api._PLAN_LIMIT + 6):
        pyfa.fa2_forward(q[:, :, :n], k, v, options=OPTS)
    assert len(api._plans_of_thread()) == api._PLAN_LIMIT
