"""Context parallelism (pyfa.torch.context_parallel_attention, issue 22) in spawned gloo
process groups of 1, 2, 3 and 4 ranks (tests/cp_worker.py): the shards of O, dQ, dK and
dV gathered from the ranks equal one process's pyfa.torch.attention with the same
split_size bit for bit, in ring and Ulysses modes, causal and not, zigzag, GQA, windows,
softcap and ALiBi; the bytes each rank sends equal the model's
(pyfa.sim.context_parallel_bytes); misuse gets an error naming it, and no hang."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import pyfa  # noqa: E402
import pyfa.sim  # noqa: E402
import pyfa.torch as pt  # noqa: E402
from conftest import built_once  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import cp_worker as w  # noqa: E402

pytestmark = pytest.mark.slow
WORLD_SIZES = (1, 2, 3, 4)


def _spawn(out):
    # The ranks import the pyfa this test imported, installed or not.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(pyfa.__file__).parents[1])] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, str(Path(w.__file__)), str(out), str(max(WORLD_SIZES))], check=True,
                   timeout=900, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = built_once(tmp_path_factory, "context_parallel", _spawn)
    return {(P, r): torch.load(out / f"P{P}_r{r}.pt") for P in WORLD_SIZES for r in range(P)}


def gathered(runs, P, name):
    """The whole sequence's O, dQ, dK, dV from the ranks' shards, or None where the case
    does not apply at this world size."""
    heads, heads_kv, layout, _ = w.CASES[name]
    parts = [runs[(P, r)][name] for r in range(P)]
    if parts[0] is None:
        return None
    axis = 2 if layout == "bhnd" else 1
    full = {}
    for key in ("o", "dq", "dk", "dv"):
        like = parts[0][key]
        shape = list(like.shape)
        shape[axis] = w.seqlen(name)
        t = torch.zeros(shape)
        for part in parts:
            t.index_copy_(axis, part["rows"], part[key])
        full[key] = t
    return full


@functools.lru_cache(maxsize=None)
def one_device(name):
    heads, heads_kv, layout, kw = w.CASES[name]
    kw = {k: x for k, x in kw.items() if k not in ("mode", "zigzag")}
    q, k, v, do = w.inputs(name)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = pt.attention(q, k, v, layout=layout, split_size=w.S, **w.TILES, **kw)
    o.backward(do)
    return dict(o=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


@pytest.mark.parametrize("name", list(w.CASES))
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_shards_equal_one_device_bit_for_bit(runs, P, name):
    got = gathered(runs, P, name)
    if got is None:
        assert w.CASES[name][1] % P, "only Ulysses with Hkv not divisible by P is left out"
        return
    ref = one_device(name)
    for key in ("o", "dq", "dk", "dv"):
        assert torch.equal(got[key], ref[key]), (P, name, key, (got[key] - ref[key]).abs().max().item())


@pytest.mark.parametrize("name", list(w.CASES))
def test_equal_across_world_sizes(runs, name):
    base = gathered(runs, 1, name)
    for P in WORLD_SIZES[1:]:
        got = gathered(runs, P, name)
        if got is not None:
            assert all(torch.equal(got[key], base[key]) for key in base), (P, name)


@pytest.mark.parametrize("name", list(w.CASES))
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_bytes_sent_are_the_models(runs, P, name):
    heads, heads_kv, layout, kw = w.CASES[name]
    if runs[(P, 0)][name] is None:
        return
    model = pyfa.sim.context_parallel_bytes(
        kw.get("mode", "ring"), P, batch=w.B, heads=heads, heads_kv=heads_kv, shard_len=w.seqlen(name) // P, head_dim=w.D,
        split_size=w.S, causal=kw.get("causal", False), window=kw.get("window"), zigzag=kw.get("zigzag", False))
    for r in range(P):
        sent = runs[(P, r)][name]["bytes"]
        assert model[r] <= sent * 1.1 and sent <= model[r] * 1.1, (P, r, name, sent, model[r])
    if P > 1 and kw.get("mode", "ring") == "ring":
        # K and V cross each of the P - 1 links once per pass (forward, backward).
        kv = 2 * w.B * heads_kv * (w.seqlen(name) // P) * w.D * 4
        assert min(model) >= 2 * (P - 1) * kv


def test_ring_kv_volume_formula():
    # One chunk per shard, non-causal: K, V round twice plus one dK, dV partial per other rank.
    P, L = 4, 64
    kv = 2 * 1 * 2 * L * 16 * 4
    got = pyfa.sim.context_parallel_bytes("ring", P, batch=1, heads=4, heads_kv=2, shard_len=L, head_dim=16,
                                          split_size=L)
    assert got == [3 * (P - 1) * kv] * P
    fwd = pyfa.sim.context_parallel_bytes("ring", P, batch=1, heads=4, heads_kv=2, shard_len=L, head_dim=16,
                                          split_size=L, backward=False)
    assert fwd == [(P - 1) * kv] * P


def test_ddp_step_gradients_equal_on_both_ranks_and_one_process(runs):
    one = runs[(1, 0)]["ddp"]
    for r in range(2):
        got = runs[(2, r)]["ddp"]
        assert got.keys() == one.keys()
        assert all(torch.equal(got[n], one[n]) for n in one), r


@pytest.mark.parametrize("P", (2, 3))
def test_misuse_is_named(runs, P):
    for r in range(P):
        m = runs[(P, r)]["misuse"]
        assert "q's shape differs" in m["shard"] and "rank" in m["shard"]
        assert "causal differs" in m["args"]
        assert "on meta, but the group's backend gloo takes cpu tensors" in m["device"]
        if P == 3:
            assert "divisible by the world size 3" in m["ulysses_heads"]
    message, seconds = runs[(P, 0)]["misuse"]["timeout"]
    assert "agreeing on the shapes and arguments" in message and "within 1 s" in message
    assert 0.9 < seconds < 30


def test_refusals_without_a_group():
    q = torch.zeros(1, 2, 16, 8)
    with pytest.raises(RuntimeError, match="not initialised"):
        pt.context_parallel_attention(q, q, q, split_size=8)
    with pytest.raises(TypeError, match="dropout_p"):
        pt.context_parallel_attention(q, q, q, split_size=8, dropout_p=0.1)
