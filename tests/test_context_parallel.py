"""Context parallelism (pyfa.torch.context_parallel_attention, issue 22) in spawned gloo
process groups of 1, 2, 3 and 4 ranks (tests/cp_worker.py): the shards of O, dQ, dK and
dV gathered from the ranks equal one process's pyfa.torch.attention with the same
split_size bit for bit, in ring mode (both schedules, wavefront and ring, equal to each
other) and Ulysses mode, causal and not, zigzag, GQA, windows, softcap, ALiBi, a bias
(ring mode, with its dBias where it requires grad) and dropout; the
bytes each rank sends equal the model's (pyfa.sim.context_parallel_bytes); the wavefront
holds O(1) shards per rank; misuse gets an error naming it, and no hang."""

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

# One worker runs the module: the ranks are spawned once (built_once), and the other worker
# goes on with the rest of the suite instead of waiting on their lock.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("context_parallel")]
WORLD_SIZES = (1, 2, 3, 4)


def _worker(out, what, timeout):
    # The ranks import the pyfa this test imported, installed or not.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(pyfa.__file__).parents[1])] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, str(Path(w.__file__)), str(out), what], check=True, timeout=timeout, env=env)


def _spawn(out):
    _worker(out, str(max(WORLD_SIZES)), 900)


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
    for key in ("o", "dq", "dk", "dv", "dbias"):
        if parts[0].get(key) is None:
            continue
        like = parts[0][key]
        at = 2 if key == "dbias" else axis  # a bias is (B, H, rows, keys) in both layouts
        shape = list(like.shape)
        shape[at] = w.seqlen(name)
        t = torch.zeros(shape)
        for part in parts:
            t.index_copy_(at, part["rows"], part[key])
        full[key] = t
    return full


@functools.lru_cache(maxsize=None)
def one_device(name, dropout=True):
    heads, heads_kv, layout, kw = w.CASES[name]
    left_out = ("mode", "zigzag", "schedule") + (() if dropout else ("dropout_p", "seed", "offset"))
    kw = {k: x for k, x in kw.items() if k not in left_out}
    if "bias" in kw:
        kw["bias"] = w.full_bias(name)
    q, k, v, do = w.inputs(name)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = pt.attention(q, k, v, layout=layout, split_size=w.S, **w.TILES, **kw)
    o.backward(do)
    out = dict(o=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    if "bias" in kw and kw["bias"].requires_grad:
        out["dbias"] = kw["bias"].grad
    return out


@pytest.mark.parametrize("name", list(w.CASES))
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_shards_equal_one_device_bit_for_bit(runs, P, name):
    got = gathered(runs, P, name)
    if got is None:
        assert w.CASES[name][1] % P, "only Ulysses with Hkv not divisible by P is left out"
        return
    ref = one_device(name)
    assert got.keys() == ref.keys(), (P, name)  # dbias where the bias requires grad
    for key in ref:
        assert torch.equal(got[key], ref[key]), (P, name, key, (got[key] - ref[key]).abs().max().item())


def test_bias_cases_take_a_gradient():
    """The cases whose bias requires grad get a dBias that is far from all zeros (more
    than a twentieth nonzero: the window case shows about a quarter of the keys), so its
    bit-equality above is the kernels' dS; +0 above a causal diagonal."""
    names = [n for n in w.CASES if w.CASES[n][3].get("bias", (0, 0, False))[2]]
    assert len(names) >= 3
    for name in names:
        db = one_device(name)["dbias"]
        assert db.shape == w.full_bias(name).shape and db.count_nonzero() > db.numel() // 20, name
        if w.CASES[name][3].get("causal"):
            assert torch.equal(db.triu(1), torch.zeros_like(db)), name


def test_dropout_cases_drop():
    """The dropout cases' one-device results differ from the same calls without dropout
    (so their bit-equality above is dropout's)."""
    for name in [n for n in w.CASES if "dropout_p" in w.CASES[n][3]]:
        assert not torch.equal(one_device(name)["o"], one_device(name, dropout=False)["o"]), name


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
        split_size=w.S, causal=kw.get("causal", False), window=kw.get("window"), zigzag=kw.get("zigzag", False),
        schedule=kw.get("schedule", "auto"))
    assert [runs[(P, r)][name]["bytes"] for r in range(P)] == model, (P, name)
    if P > 1 and kw.get("mode", "ring") == "ring" and not kw.get("causal") and kw.get("window") is None:
        # Without a mask K and V cross each of the P - 1 links once per pass (forward,
        # backward), and the dK/dV come back.
        kv = 2 * w.B * heads_kv * (w.seqlen(name) // P) * w.D * 4
        assert min(model) >= 3 * (P - 1) * kv


SCHEDULE_PAIRS = (("ring", "ring_by_ring"), ("ring_causal", "ring_by_ring_causal"),
                  ("ring_dropout", "ring_dropout_by_ring"))


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_schedules_equal_each_other(runs, P):
    for wave, ring in SCHEDULE_PAIRS:
        assert w.CASES[wave][3].get("schedule", "auto") != "ring" and w.CASES[ring][3]["schedule"] == "ring"
        a, b = gathered(runs, P, wave), gathered(runs, P, ring)
        assert all(torch.equal(a[key], b[key]) for key in a), (P, wave, ring)


def _kv_shard_bytes(name, P):
    """Bytes of one rank's K and V shards in case `name`."""
    return 2 * w.B * w.CASES[name][1] * (w.seqlen(name) // P) * w.D * 4


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_wavefront_holds_O1_shards(runs, P):
    # docs/context_parallel.md, "Memory per rank": at most two received K/V shards, the
    # one kept from the forward and three dK/dV accumulators (being folded, arriving,
    # leaving), whatever P.
    for name in ("ring", "ring_causal", "ring_mods"):
        for r in range(P):
            held = runs[(P, r)][name]["held"]
            assert held <= 6 * _kv_shard_bytes(name, P), (P, r, name, held)
            assert (held > 0) == (P > 1), (P, r, name, held)
    if P == 4:
        # Non-causal, every shard needed: rank 1 holds all five at once.
        assert runs[(4, 1)]["ring"]["held"] == 5 * _kv_shard_bytes("ring", 4)
        # The ring holds K/V shards before their turn and every dK/dV partial of its keys:
        # more, growing with P.
        assert runs[(4, 1)]["ring_by_ring"]["held"] > 6 * _kv_shard_bytes("ring_by_ring", 4)


@pytest.mark.parametrize("P", (2, 3, 4, 8))
def test_wavefront_volume_against_the_formula(P):
    # Non-causal, c = 4 chunks per shard. The formula: K and V cross every link once in the
    # forward, twice with their gradients in the backward, 3 (P - 1) shards per rank. The
    # wavefront's dK/dV accumulator of each shard visits every rank and then goes home
    # (unless its owner is the last rank): one shard more on every rank but the last, and
    # one less in the backward's K/V, which rank r + 1 kept from the forward: the formula
    # exactly on every rank.
    B, Hkv, L, d, S = 1, 2, 32, 16, 8
    kv = 2 * B * Hkv * L * d * 4
    sizes = dict(batch=B, heads=4, heads_kv=Hkv, shard_len=L, head_dim=d, split_size=S)
    wave = pyfa.sim.context_parallel_bytes("ring", P, schedule="wavefront", **sizes)
    assert wave == [3 * (P - 1) * kv] * P
    assert pyfa.sim.context_parallel_bytes("ring", P, schedule="auto", **sizes) == wave
    # The ring schedule returns every block's partial: c partials per (rank, owner).
    ring = pyfa.sim.context_parallel_bytes("ring", P, schedule="ring", **sizes)
    assert ring == [(P - 1) * (2 + L // S) * kv] * P
    fwd = pyfa.sim.context_parallel_bytes("ring", P, schedule="wavefront", backward=False, **sizes)
    assert fwd == [(P - 1) * kv] * P


def test_wavefront_chain_for_causal_masks():
    # Causal: key shard j is seen by ranks j .. P - 1 only; its K/V go to ranks > j (in the
    # backward but to j + 1, which kept them) and its accumulator starts at the owner, so
    # rank P - 1 sends only the accumulators home.
    from pyfa.sim.context_parallel import wavefront_chain
    P, L = 4, 16
    assert [wavefront_chain(P * L, 0, P, L, j) for j in range(P)] == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [3]]
    kv = 2 * 1 * 1 * L * 8 * 4
    got = pyfa.sim.context_parallel_bytes("ring", P, batch=1, heads=1, heads_kv=1, shard_len=L, head_dim=8,
                                          split_size=8, causal=True, schedule="wavefront")
    assert got == [kv * (2 * P - 2 - r) for r in range(P)]


def test_ring_kv_volume_formula():
    # The ring schedule, one chunk per shard, non-causal: K, V round twice plus one dK, dV
    # partial per other rank, the formula exactly.
    P, L = 4, 64
    kv = 2 * 1 * 2 * L * 16 * 4
    sizes = dict(batch=1, heads=4, heads_kv=2, shard_len=L, head_dim=16, split_size=L, schedule="ring")
    assert pyfa.sim.context_parallel_bytes("ring", P, **sizes) == [3 * (P - 1) * kv] * P
    assert pyfa.sim.context_parallel_bytes("ring", P, backward=False, **sizes) == [(P - 1) * kv] * P


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
        assert m["bias_grad"].startswith("bias: one row for all of this rank's query rows, and it requires grad")
        assert m["bias_ulysses"].startswith("bias: only mode='ring' takes a bias")
        assert m["seed_none"] == (True, False)  # rank 0's seed taken; dropout on
        assert "dropout differs" in m["seed_differs"]
        assert m["bias_shape"] == (f"bias: shape (1, 1, 16, {16 * P + 1}) does not broadcast to (B, H, L, N) = "
                                   f"(1, 2, 16, {16 * P}) (this rank's query rows over the whole sequence's keys)")
        if P == 3:
            assert "divisible by the world size 3" in m["ulysses_heads"]
        if r == 0:
            assert "no answer within 1 s" in m["twice"]
        else:
            assert "a second backward through the same call" in m["twice"]
    message, seconds = runs[(P, 0)]["misuse"]["timeout"]
    assert "agreeing on the shapes and arguments" in message and "within 1 s" in message
    assert 0.9 < seconds < 30


def test_refusals_without_a_group():
    q = torch.zeros(1, 2, 16, 8)
    with pytest.raises(RuntimeError, match="not initialised"):
        pt.context_parallel_attention(q, q, q, split_size=8)
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        pt.context_parallel_attention(q, q, q, split_size=8, dropout_p=1.5)
    with pytest.raises(TypeError, match="dropout_p: expected a real number"):
        pt.context_parallel_attention(q, q, q, split_size=8, dropout_p="0.1")
    with pytest.raises(ValueError, match="offset"):
        pt.context_parallel_attention(q, q, q, split_size=8, dropout_p=0.1, offset=-1)
    with pytest.raises(ValueError, match="schedule: expected one of 'auto', 'ring', 'wavefront', got 'tree'"):
        pt.context_parallel_attention(q, q, q, split_size=8, schedule="tree")
    with pytest.raises(ValueError, match="schedule='wavefront' takes contiguous shards"):
        pt.context_parallel_attention(q, q, q, split_size=8, causal=True, zigzag=True, schedule="wavefront")
    with pytest.raises(ValueError, match="only mode='ring' takes a schedule"):
        pt.context_parallel_attention(q, q, q, split_size=8, mode="ulysses", schedule="ring")


@pytest.mark.gpu
def test_nccl_cuda_one_rank_equals_one_device_on_the_cpu(tmp_path):
    """A one-rank NCCL group on CUDA tensors (what tools/device_check.sh's `-k cuda` runs):
    O, dQ, dK, dV equal one CPU process's pyfa.torch.attention bit for bit (every backend
    gives the same bits), and CPU tensors in an NCCL group are refused naming q."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("no CUDA device or no NCCL in this torch")
    _worker(tmp_path, "nccl", 300)
    res = torch.load(tmp_path / "nccl.pt")
    assert res["cpu_refused"] and res["cpu_refused"].startswith("q:"), res["cpu_refused"]
    for name in w.NCCL_CASES:
        ref = one_device(name)
        for key in ("o", "dq", "dk", "dv"):
            assert torch.equal(res[name][key], ref[key]), (name, key)
