"""Score modifications (docs/numerics.md §2): each one, on FA1 and FA2, forward and
backward, gives the simulator's bits on every backend, variant, emulator order and cpu
thread count, over causal masks, windows, both alignments and GQA; and its results are
within twice the error (against float64) of a plain float32 computation of the same
formula, NumPy's and, where torch imports, PyTorch's.

A modification is one entry of MODS: its keywords and its formula in float64, written
here from the definition (not from pyfa's code). The shared tests walk every entry."""

import re
from typing import Callable, NamedTuple

import numpy as np
import pytest

import pyfa
import pyfa.sim
from conftest import HAS_CUDA
from pyfa import _lib
from pyfa.sim import numerics as nx
from reference import make_inputs, mask_matrix, same_bits


class Mod(NamedTuple):
    # The keywords of a problem with B batch elements and H query heads.
    kwargs: Callable
    # S of the scaled scores s (float64 or float32, (B, H, Nq, Nk)) under the keywords kw;
    # at: (b, h, i, j, off) index arrays broadcasting against s, off the causal alignment's
    # offset.
    scores: Callable
    # dS/ds at s, S = scores(s): the factor the gradient with respect to S is multiplied by.
    slope: Callable


def _softcap_scores(s, at, kw):
    c = kw["softcap"]
    return c * np.tanh(s / s.dtype.type(c))


def _softcap_slope(s, S, at, kw):
    t = np.tanh(s / s.dtype.type(kw["softcap"]))
    return 1 - t * t


def _alibi_scores(s, at, kw):
    b, h, i, j, off = at
    slopes = np.broadcast_to(kw["alibi_slopes"], s.shape[:2]).astype(s.dtype)
    return s - slopes[b, h] * np.abs(i + off - j).astype(s.dtype)


def _geometric_slopes(B, H):
    """ALiBi's slopes of H heads (BLOOM's): 2^(-8 (h + 1) / H)."""
    return (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)


def _random_slopes(B, H):
    return np.random.default_rng(B * 100 + H).uniform(0, 0.5, (B, H)).astype(np.float32)


MODS = {
    "softcap": Mod(lambda B, H: dict(softcap=1.5), _softcap_scores, _softcap_slope),
    "alibi-H": Mod(lambda B, H: dict(alibi_slopes=_geometric_slopes(B, H)), _alibi_scores,
                   lambda s, S, at, kw: 1),
    "alibi-BH": Mod(lambda B, H: dict(alibi_slopes=_random_slopes(B, H)), _alibi_scores,
                    lambda s, S, at, kw: 1),
    "softcap+alibi": Mod(lambda B, H: dict(softcap=1.5, alibi_slopes=_random_slopes(B, H)),
                         lambda s, at, kw: _alibi_scores(_softcap_scores(s, at, kw), at, kw),
                         _softcap_slope),
}

# (B, H, Hkv, Nq, Nk, d, Br, Bc) and the masks (causal, window, causal_align) each runs
# under: tails, GQA, more queries than keys (the first rows of a bottom-right causal mask
# see no key), and the fast kernels' head dims and tiles (their role-split backwards
# recompute the score for the gradient of a modification).
CASES = [
    ((1, 4, 2, 37, 53, 16, 16, 16), [(False, None, "bottom_right"), (True, None, "top_left"),
                                     (False, (8, 4), "bottom_right"), (True, (24, None), "top_left")]),
    ((1, 2, 1, 80, 66, 64, 64, 64), [(True, None, "bottom_right")]),
    ((1, 1, 1, 65, 70, 128, 64, 64), [(False, (20, 5), "top_left")]),
]
FAST_TILES = {(64, 64, 64), (128, 64, 64)}  # (d, Br, Bc) every fast kernel takes
# The inputs are scaled up so that the scores reach the modifications' non-linear ranges
# (for softcap 1.5: s / c beyond the polynomial branch of tanh, and some beyond its clamp).
INPUT_SCALE = np.float32(2.5)


def _params():
    # Every modification on every case; where a case lists more masks than two, each
    # modification takes two of them, rotating with its place in MODS.
    for n, mod in enumerate(MODS):
        for case, masks in CASES:
            chosen = masks if len(masks) <= 2 else [masks[n % len(masks)], masks[(n + 2) % len(masks)]]
            for mask in chosen:
                yield pytest.param(mod, case, mask, id=f"{mod}-{case}-{mask}")


def _inputs(case, seed=7):
    B, H, Hkv, Nq, Nk, d, _, _ = case
    q, k, v, do = make_inputs((B, H, Nq, d), (B, Hkv, Nk, d), seed, True)
    return q * INPUT_SCALE, k * INPUT_SCALE, v, do


def _runs(case):
    """(name, Options) of every run a case is compared under."""
    _, _, _, _, _, d, Br, Bc = case
    runs = [(f"emu-{order}-reference", pyfa.Options(backend="emu", emu_order=order, variant="reference"))
            for order in ("forward", "reverse")]
    if (d, Br, Bc) in FAST_TILES:
        # Variant auto at the fast kernels' tiles: the fast kernels whose rows take the
        # modification (common/fast_takes.h), the readable ones for the rest
        # (test_variant_fast_equals_the_reference_and_the_simulator forces "fast").
        runs += [(f"emu-{order}-auto", pyfa.Options(backend="emu", emu_order=order, variant="auto"))
                 for order in ("forward", "reverse")]
    runs += [(f"cpu-threads{t}", pyfa.Options(backend="cpu", threads=t)) for t in (1, 2, 3)]
    if HAS_CUDA:
        runs += [("cuda-reference", pyfa.Options(backend="cuda", variant="reference"))]
        if (d, Br, Bc) in FAST_TILES:
            runs += [("cuda-auto", pyfa.Options(backend="cuda", variant="auto"))]
    return [(name, o.replace(block_r=Br, block_c=Bc)) for name, o in runs]


@pytest.mark.parametrize("mod,case,mask", _params())
def test_every_backend_and_variant_equals_the_simulator(mod, case, mask):
    q, k, v, do = _inputs(case)
    causal, window, align = mask
    kw = dict(causal=causal, window=window, causal_align=align, **MODS[mod].kwargs(*case[:2]))
    tiles = pyfa.Options(block_r=case[6], block_c=case[7])
    f2 = pyfa.sim.fa2_forward(q, k, v, options=tiles, **kw)
    b2 = pyfa.sim.fa2_backward(q, k, v, f2.o, f2.lse, do, options=tiles, **kw)
    f1 = pyfa.sim.fa1_forward(q, k, v, options=tiles, **kw)
    b1 = pyfa.sim.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do, options=tiles, **kw)
    # The modification is in force: the results differ from the unmodified ones.
    plain = pyfa.fa2_forward(q, k, v, causal=causal, window=window, causal_align=align,
                             options=pyfa.Options(backend="cpu", block_r=case[6], block_c=case[7]))
    assert not same_bits(plain[0], f2.o)
    for name, options in _runs(case):
        got = pyfa.fa2_forward(q, k, v, options=options, **kw)
        assert all(same_bits(g, w) for g, w in zip(got, (f2.o, f2.lse))), ("fa2_forward", name)
        got = pyfa.fa2_backward(q, k, v, f2.o, f2.lse, do, options=options, **kw)
        assert all(same_bits(g, w) for g, w in zip(got, (b2.dq, b2.dk, b2.dv))), ("fa2_backward", name)
        got = pyfa.fa1_forward(q, k, v, options=options, **kw)
        assert all(same_bits(g, w) for g, w in zip(got, (f1.o, f1.m, f1.l))), ("fa1_forward", name)
        got = pyfa.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do, options=options, **kw)
        assert all(same_bits(g, w) for g, w in zip(got, (b1.dq, b1.dk, b1.dv))), ("fa1_backward", name)


# ---- the fast (register-tiled) kernels: variant "fast" forced, where their rows take the
# modification (src/common/fast_takes.h), and refused by name where they do not

# What each fast kernel takes, per head dim: fast_takes.h's table as this test expects it
# (written out, so that a row that gains or loses a modification shows here). No fast
# kernel writes dBias ("dbias output", asked of the dK/dV and FA1 backward kernels by any
# backward with a bias). Softcap and ALiBi are left out where ptxas spilled with them (the
# FA2 dK/dV kernel, the FA1 forward's ALiBi, the FA1 backward's softcap, and the FA1
# kernels at d = 128) and in the FA2 dQ and dK/dV kernels at d = 128, whose registers
# their two-stage copies take.
FAST_TAKES = {
    ("fa2_forward", 64): {"softcap", "ALiBi", "dropout", "bias"},
    ("fa2_forward", 128): {"softcap", "ALiBi", "bias"},
    ("fa1_forward", 64): {"softcap", "dropout", "bias"},
    ("fa1_forward", 128): set(),
    ("fa2_backward_dq", 64): {"softcap", "ALiBi", "dropout", "bias"},
    ("fa2_backward_dq", 128): {"dropout", "bias"},
    ("fa2_backward_dkdv", 64): set(),
    ("fa2_backward_dkdv", 128): {"dropout"},
    ("fa1_backward", 64): {"ALiBi", "dropout", "bias"},
    ("fa1_backward", 128): {"dropout", "bias"},
}
FAST_KERNELS = {"fa2_forward": ["fa2_forward"], "fa2_backward": ["fa2_backward_dq", "fa2_backward_dkdv"],
                "fa1_forward": ["fa1_forward"], "fa1_backward": ["fa1_backward"]}
WRITES_DBIAS = {"fa2_backward_dkdv", "fa1_backward"}

# (B, H, Hkv, Nq, Nk), the mask and what else the call asks: GQA under causal masks (rows
# that see no key with Nq > Nk), a window with a bias broadcast over the batch, dropout
# with a causal mask and tails.
FAST_EXTRAS = {
    "causal-gqa": ((2, 4, 2, 75, 130), (True, None, "bottom_right"), {}),
    "window-bias": ((2, 2, 1, 130, 70), (False, (20, 5), "top_left"), {"bias": (1, 2, 130, 70)}),
    "causal-dropout": ((1, 2, 1, 70, 67), (True, None, "top_left"), {"dropout_p": 0.2, "seed": 5}),
}
FAST_MODS = ["softcap", "alibi-BH", "softcap+alibi"]


def _fast_asks(function, mods):
    """What a call of `function` with keywords `mods` asks of each of its kernels."""
    asks = {"softcap": "softcap" in mods, "ALiBi": "alibi_slopes" in mods, "dropout": "dropout_p" in mods,
            "bias": "bias" in mods}
    out = {}
    for kernel in FAST_KERNELS[function]:
        need = {n for n, on in asks.items() if on}
        if "bias" in mods and kernel in WRITES_DBIAS:
            need.add("dbias output")
        out[kernel] = need
    return out


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("extra", sorted(FAST_EXTRAS))
@pytest.mark.parametrize("mod", FAST_MODS)
def test_variant_fast_equals_the_reference_and_the_simulator(mod, extra, d):
    shape, (causal, window, align), asked = FAST_EXTRAS[extra]
    B, H, Hkv, Nq, Nk = shape
    q, k, v, do = _inputs((B, H, Hkv, Nq, Nk, d, 0, 0), seed=d + len(extra))
    mods = dict(MODS[mod].kwargs(B, H))
    if "bias" in asked:
        mods["bias"] = np.random.default_rng(d).standard_normal(asked["bias"], dtype=np.float32)
    mods.update({n: x for n, x in asked.items() if n != "bias"})
    kw = dict(causal=causal, window=window, causal_align=align, **mods)
    # The forwards at both of their fast row tiles (Br 64 and 128), the backwards at theirs.
    fwd_tiles = (128, 64) if (d + len(extra) + len(mod)) % 2 else (64, 64)
    f2 = pyfa.sim.fa2_forward(q, k, v, block_r=fwd_tiles[0], block_c=fwd_tiles[1], **kw)
    f1 = pyfa.sim.fa1_forward(q, k, v, block_r=fwd_tiles[0], block_c=fwd_tiles[1], **kw)
    calls = {"fa2_forward": ((q, k, v), fwd_tiles, lambda: (f2.o, f2.lse)),
             "fa1_forward": ((q, k, v), fwd_tiles, lambda: (f1.o, f1.m, f1.l))}

    def b2():
        r = pyfa.sim.fa2_backward(q, k, v, f2.o, f2.lse, do, block_r=64, block_c=64, **kw)
        return (r.dq, r.dk, r.dv) + ((r.dbias,) if "bias" in mods else ())

    def b1():
        r = pyfa.sim.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do, block_r=64, block_c=64, **kw)
        return (r.dq, r.dk, r.dv) + ((r.dbias,) if "bias" in mods else ())
    calls["fa2_backward"] = ((q, k, v, f2.o, f2.lse, do), (64, 64), b2)
    calls["fa1_backward"] = ((q, k, v, f1.o, f1.m, f1.l, do), (64, 64), b1)
    for function, (args, (br, bc), simulated) in calls.items():
        fast = pyfa.Options(backend="emu", variant="fast", block_r=br, block_c=bc)
        missing = {kern: need - FAST_TAKES[kern, d] for kern, need in _fast_asks(function, mods).items()}
        variant = "fast"
        if any(missing.values()):
            # Refused, naming a kernel that lacks something and one thing it lacks; variant
            # auto runs the fast kernels that take it all (the FA2 dQ of a backward whose
            # dK/dV kernel lacks it) beside the readable ones.
            with pytest.raises(pyfa.InvalidArgumentError, match="config->variant: fast: the fast ") as err:
                getattr(pyfa, function)(*args, options=fast, **kw)
            named = re.search(r"the fast (\w+) at head_dim (\d+) takes no ([\w ]+?) \(", str(err.value))
            assert named and int(named[2]) == d and named[3] in missing[named[1]], str(err.value)
            variant = "auto"
        want = simulated()
        ref = getattr(pyfa, function)(*args, options=fast.replace(variant="reference"), **kw)
        assert all(same_bits(g, w) for g, w in zip(ref, want)) and len(ref) == len(want), (function, "reference")
        for order in ("forward", "reverse"):
            got = getattr(pyfa, function)(*args, options=fast.replace(emu_order=order, variant=variant), **kw)
            assert len(got) == len(want), (function, variant, order)
            for n, (g, w) in enumerate(zip(got, want)):
                assert same_bits(g, w), (function, variant, order, n)



# ---- accuracy against float64

def rms_err(x, ref):
    """The relative RMS error ||x - ref|| / ||ref||: steadier than the largest element's,
    which one unlucky rounding decides."""
    x, ref = np.asarray(x, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def _explicit(q, k, v, do, mod, kw, mask, dtype):
    """O, dQ, dK, dV of the modified attention (keywords kw) computed plainly in `dtype`
    (K and V repeated to q's heads; dK, dV summed back over each group), from the
    modification's own formula."""
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    scale = dtype(1 / np.sqrt(d))
    s = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
    causal, window, align = mask
    off = Nk - Nq if align == "bottom_right" else 0
    at = (np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None],
          np.arange(Nq)[:, None], np.arange(Nk)[None, :], off)
    S = mod.scores(s, at, kw)
    hidden = mask_matrix(Nq, Nk, causal, window, align)
    S = np.where(hidden, -np.inf, S)
    m = S.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0, m)
    P = np.exp(S - m)
    P = P / np.where(P.sum(-1, keepdims=True) > 0, P.sum(-1, keepdims=True), 1)
    o = P @ vr
    dP = do @ np.swapaxes(vr, -1, -2)
    dS = P * (dP - (do * o).sum(-1, keepdims=True)) * np.where(hidden, 0, mod.slope(s, S, at, kw))
    dq = dS @ kr * scale
    dk = (np.swapaxes(dS, -1, -2) @ q * scale).reshape(B, Hkv, G, Nk, d).sum(2)
    dv = (np.swapaxes(P, -1, -2) @ do).reshape(B, Hkv, G, Nk, d).sum(2)
    return o, dq, dk, dv


ACCURACY_MASKS = [(False, None, "bottom_right"), (True, None, "top_left"), (True, (20, 3), "bottom_right")]


@pytest.mark.parametrize("mask", ACCURACY_MASKS, ids=str)
@pytest.mark.parametrize("mod", sorted(MODS))
def test_as_accurate_as_a_float32_computation(mod, mask):
    case = (1, 4, 2, 64, 80, 32, 0, 0)
    q, k, v, do = _inputs(case, seed=11)
    causal, window, align = mask
    mods = MODS[mod].kwargs(*case[:2])
    kw = dict(causal=causal, window=window, causal_align=align, **mods)
    exact = _explicit(q, k, v, do, MODS[mod], mods, mask, np.float64)
    plain = _explicit(q, k, v, do, MODS[mod], mods, mask, np.float32)
    cpu = pyfa.Options(backend="cpu")
    got2 = pyfa.attention_grad(q, k, v, do, options=cpu, **kw)
    got1 = pyfa.attention_grad(q, k, v, do, algo="fa1", options=cpu, **kw)
    for name, g2, g1, p, e in zip(("o", "dq", "dk", "dv"), got2, got1, plain, exact):
        # pyfa's dV, a sum over the query rows in order (docs/numerics.md §5), measures 2.0
        # to 2.1 times NumPy's blocked float32 product's error with no modification at all
        # (and with ALiBi, which leaves P as sharp); the modifications add nothing to that.
        bound = (2.5 if name == "dv" else 2) * rms_err(p, e)
        assert rms_err(g2, e) <= bound, (name, "fa2", rms_err(g2, e), rms_err(p, e))
        assert rms_err(g1, e) <= bound, (name, "fa1", rms_err(g1, e), rms_err(p, e))


# ---- softcap's arguments

@pytest.mark.parametrize("bad,error", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                       (1e39, ValueError), (1e-50, ValueError), ("2", TypeError),
                                       (True, TypeError), (2j, TypeError)])
def test_softcap_refuses_bad_values_by_name(bad, error):
    q, k, v, do = _inputs(CASES[0][0])
    for call in (lambda: pyfa.attention(q, k, v, softcap=bad, options=pyfa.Options(backend="cpu")),
                 lambda: pyfa.attention_grad(q, k, v, do, softcap=bad, options=pyfa.Options(backend="cpu")),
                 lambda: pyfa.sim.fa2_forward(q, k, v, softcap=bad),
                 lambda: pyfa.sim.fa1_backward(q, k, v, q, q[..., 0], q[..., 0], do, softcap=bad)):
        with pytest.raises(error, match="softcap"):
            call()


def test_softcap_zero_or_none_is_off_and_a_float32_is_taken_exactly():
    q, k, v, _ = _inputs(CASES[0][0])
    cpu = pyfa.Options(backend="cpu")
    plain = pyfa.attention(q, k, v, options=cpu)
    assert same_bits(pyfa.attention(q, k, v, softcap=0, options=cpu), plain)
    assert same_bits(pyfa.attention(q, k, v, softcap=None, options=cpu), plain)
    # An int, and a float that rounds to the same float32, are that float32.
    assert same_bits(pyfa.attention(q, k, v, softcap=3, options=cpu),
                     pyfa.attention(q, k, v, softcap=3.0000000001, options=cpu))
    assert same_bits(pyfa.attention(q, k, v, softcap=3, options=cpu), pyfa.sim.fa2_forward(q, k, v, softcap=3).o)


RAW = (2, 3, 4, 5, 8)  # B, H, Nq, Nk, d of _raw_forward
RAW_Q, RAW_K = (np.random.default_rng(3).standard_normal(shape, dtype=np.float32)
                for shape in ((2, 3, 4, 8), (2, 3, 5, 8)))


def _raw_forward(ffi, L, softcap=0.0, struct_size=None, slopes=None, strides=(0, 0, 0),
                 tensors_size=None):
    """pyfa_run's FA2 forward (cpu backend) on RAW with problem->softcap, the ALiBi
    slopes and their strides, and the given struct sizes (None: this header's); returns
    (status, message, o)."""
    B, H, Nq, Nk, d = RAW
    o, lse = np.full_like(RAW_Q, 7.0), np.full((B, H, Nq), 7.0, np.float32)
    p = ffi.new("pyfa_problem *")
    p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim = B, H, H, Nq, Nk, d
    p.softcap = softcap
    p.struct_size = ffi.sizeof("pyfa_problem") if struct_size is None else struct_size
    c = ffi.new("pyfa_config *")
    c.struct_size = ffi.sizeof("pyfa_config")
    c.backend = _lib.enum_values("pyfa_backend", "PYFA_BACKEND_")["cpu"]
    t = ffi.new("pyfa_tensors *")
    t.struct_size = ffi.sizeof("pyfa_tensors") if tensors_size is None else tensors_size
    for name, a in (("q", RAW_Q), ("k", RAW_K), ("v", RAW_K), ("o", o), ("lse", lse)):
        getattr(t, name).data = ffi.cast("void *", ffi.from_buffer(a))
    if slopes is not None:
        t.alibi_slopes.data = ffi.cast("void *", ffi.from_buffer(slopes))
    t.alibi_slopes.strides.batch, t.alibi_slopes.strides.head, t.alibi_slopes.strides.row = strides
    status = L.pyfa_run(0, p, c, t, ffi.NULL)
    return status, ffi.string(L.pyfa_last_error()).decode(), o


def test_the_c_abi_checks_problem_softcap_and_keeps_the_older_layout():
    ffi, L = _lib.load()
    for bad in (-1.0, float("nan"), float("inf"), float("-inf")):
        status, message, o = _raw_forward(ffi, L, bad)
        assert status != 0 and "problem->softcap" in message, message
        assert (o == 7.0).all()  # nothing of the caller's written
    status, _, o = _raw_forward(ffi, L, 2.0)
    assert status == 0 and not (o == 7.0).any()
    assert same_bits(o, pyfa.sim.fa2_forward(RAW_Q, RAW_K, RAW_K, softcap=2.0).o)
    # The layout before ABI 6's fields (ABI 3 to 5, which end before varlen) is still
    # accepted and reads no softcap: a caller compiled against it gets the unmodified scores.
    status, _, o_old = _raw_forward(ffi, L, -1.0, ffi.offsetof("pyfa_problem", "varlen"))
    status_off, _, o_off = _raw_forward(ffi, L, 0.0)
    assert status == 0 and status_off == 0 and same_bits(o_old, o_off)


def test_the_c_abi_reads_alibi_slopes_at_their_strides():
    ffi, L = _lib.load()
    B, H = RAW[:2]
    slopes = _random_slopes(B, H)
    # All-zero strides: a dense (B, H) array; (0, 1, 0): an (H,) array for every b.
    for strides, given, python in [((0, 0, 0), slopes, slopes), ((H, 1, 0), slopes, slopes),
                                   ((0, 1, 0), slopes[0], slopes[0]), ((1, B, 0), slopes.T.copy(), slopes)]:
        status, message, o = _raw_forward(ffi, L, slopes=given, strides=strides)
        assert status == 0, message
        assert same_bits(o, pyfa.sim.fa2_forward(RAW_Q, RAW_K, RAW_K, alibi_slopes=python).o), strides
    # Strides whose span leaves int64_t (b * batch + h * head would overflow and wrap
    # the address) are refused as every tensor's are.
    for strides in ((-1, 1, 0), (H, -1, 0), (H, 1, 1), (0, 2**62, 0), (2**63 - 1, 1, 0), (1, 2**61, 0)):
        status, message, o = _raw_forward(ffi, L, slopes=slopes, strides=strides)
        assert status != 0 and "tensors->alibi_slopes.strides" in message, message
        assert (o == 7.0).all()
    status, message, _ = _raw_forward(ffi, L, strides=(H, 1, 0))
    assert status != 0 and "tensors->alibi_slopes.strides: given without data" in message
    # The layout before ABI 6's fields (ABI 5's, which ends before cu_seqlens_q) is still
    # accepted and has no ALiBi.
    status, _, o_old = _raw_forward(ffi, L, slopes=slopes, tensors_size=ffi.offsetof("pyfa_tensors", "cu_seqlens_q"))
    status_off, _, o_off = _raw_forward(ffi, L)
    assert status == 0 and status_off == 0 and same_bits(o_old, o_off)


@pytest.mark.parametrize("bad,error,match", [
    (np.zeros(5, np.float32), ValueError, r"expected shape \(4,\) or \(1, 4\)"),
    (np.zeros((1, 4, 1), np.float32), ValueError, "expected shape"),
    (np.array([0.5, np.nan, 0.5, 0.5], np.float32), ValueError, "finite"),
    (np.array([1e39, 0, 0, 0]), ValueError, "finite"),
    (np.zeros(4, complex), TypeError, "dtype complex128"),
    (np.zeros(4, bool), TypeError, "dtype bool"),
    (["a", "b", "c", "d"], TypeError, "dtype <U1"),
])
def test_alibi_slopes_refuses_bad_values_by_name(bad, error, match):
    q, k, v, do = _inputs(CASES[0][0])
    for call in (lambda: pyfa.attention(q, k, v, alibi_slopes=bad, options=pyfa.Options(backend="cpu")),
                 lambda: pyfa.attention_grad(q, k, v, do, alibi_slopes=bad, options=pyfa.Options(backend="emu")),
                 lambda: pyfa.sim.fa1_forward(q, k, v, alibi_slopes=bad)):
        with pytest.raises(error, match="alibi_slopes: .*" + match):
            call()


@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_one_head_s_slopes_serve_every_batch_element(backend):
    # (H,) slopes with H = 1 broadcast to (B, 1) are strides (0, 0): passed as such they
    # read as a dense (B, H) array, and batch b >= 1 read past the slopes (found by a fuzz).
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 1, 5, 16), dtype=np.float32)
    k, v = (rng.standard_normal((3, 1, 9, 16), dtype=np.float32) for _ in range(2))
    slopes = np.array([0.3], np.float32)
    want = pyfa.sim.fa2_forward(q, k, v, alibi_slopes=slopes)
    o, lse = pyfa.fa2_forward(q, k, v, alibi_slopes=slopes, options=pyfa.Options(backend=backend))
    assert same_bits(o, want.o) and same_bits(lse, want.lse)
    g = pyfa.attention_grad(q, k, v, q, alibi_slopes=slopes, options=pyfa.Options(backend=backend))
    gs = pyfa.sim.fa2_backward(q, k, v, want.o, want.lse, q, alibi_slopes=slopes)
    assert all(same_bits(a, b) for a, b in zip(g[1:], (gs.dq, gs.dk, gs.dv)))


def test_alibi_slopes_take_lists_and_other_dtypes_as_float32():
    q, k, v, _ = _inputs(CASES[0][0])
    cpu = pyfa.Options(backend="cpu")
    want = pyfa.attention(q, k, v, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32), options=cpu)
    assert same_bits(pyfa.attention(q, k, v, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], options=cpu), want)
    assert same_bits(pyfa.attention(q, k, v, alibi_slopes=np.array([[0.5, 0.25, 0.125, 0.0625]]), options=cpu),
                     want)
    # Zero slopes are no ALiBi.
    assert same_bits(pyfa.attention(q, k, v, alibi_slopes=np.zeros(4), options=cpu),
                     pyfa.attention(q, k, v, options=cpu))


# ---- tanh: pyfa's own (numerics.h pyfa_tanh, pyfa/sim/numerics.py tanh)

def _sweep(step):
    """Every step-th positive float32 below 12 (beyond the clamp at 9.5), and their
    negatives: the polynomial branch, the exp branch, and subnormals."""
    x = np.arange(0, 0x41400000, step, dtype=np.uint32).view(np.float32)
    return np.concatenate([x, -x[1:]])


def _library_tanh(x, backend):
    """tanh(x) as the library computes it, read from an FA2 forward's LSE: one key, d = 1,
    q = x, k = 1, scale = 1 and softcap = 1 make each row's score S = tanh(x) (s = x * 1
    exactly), and a row with one key has LSE = S + log(1) = S."""
    q = x.reshape(1, 1, -1, 1)
    one = np.ones((1, 1, 1, 1), np.float32)
    _, lse = pyfa.fa2_forward(q, one, one, scale=1.0, softcap=1.0, options=pyfa.Options(backend=backend))
    return lse.reshape(-1)


@pytest.mark.parametrize("backend,step", [("cpu", 2003), ("emu", 40009)])
def test_tanh_in_c_equals_numpy_bit_for_bit(backend, step):
    # The cpu backend runs tanh's vector form (GCC vectors, lanes along query rows), the
    # emulator the kernels' scalar form. -0 is left out: s = fma(-0, 1, +0) is +0.
    x = _sweep(step)
    x = x[x.view(np.uint32) != 0x80000000]
    got = _library_tanh(x, backend)
    assert same_bits(got, nx.tanh(x)), np.flatnonzero(got.view(np.uint32) != nx.tanh(x).view(np.uint32))[:10]


# Measured over all 2^32 float32 inputs (docs/numerics_exp_log.md, "tanh").
TANH_MAX_ULP = 1.0813  # the measured 1.0812, rounded up


def test_tanh_accuracy_and_shape():
    x = _sweep(1009)
    y = nx.tanh(x)
    ref = np.tanh(x.astype(np.float64))
    ulp = np.ldexp(1.0, np.maximum(np.frexp(ref)[1] - 24, -149))
    err = np.abs(y - ref) / ulp
    print(f"\ntanh: max {err.max():.4f} ulp (at {float(x[err.argmax()]).hex()}) over {x.size} inputs")
    assert err.max() <= TANH_MAX_ULP
    pos = x[: x.size // 2 + 1]
    assert (np.diff(nx.tanh(pos)) >= 0).all()  # monotone
    assert same_bits(nx.tanh(-pos), -nx.tanh(pos))  # odd, zeros' signs included


def test_tanh_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-20, 9.02, 9.5, 50.0, 3e38],
                 np.float32)
    y = nx.tanh(x)
    want = np.array([0.0, -0.0, 1.0, -1.0, np.nan, 1e-45, -1e-45, 1e-20, 1.0, 1.0, 1.0, 1.0], np.float32)
    assert same_bits(y, want)
    assert np.isnan(nx.tanh(np.float32(np.nan))) and nx.tanh(np.float32(0.5)).dtype == np.float32
    with pytest.raises(TypeError):
        nx.tanh(np.zeros(3))  # float64 is refused, as by exp and log


def test_tanh_exp_branch_is_pyfa_exp():
    # Its E = exp(2|x|) is pyfa_exp's, bit for bit, though formed without exponent bits:
    # tanh|x| = 1 - 2/(E + 1) with that E, for |x| from 0.75 to the clamp.
    a = np.arange(0x3F400000, 0x41180000, 97, dtype=np.uint32).view(np.float32)
    E = nx.exp(a + a)
    want = np.float32(1) - np.float32(2) / (E + np.float32(1))
    assert same_bits(nx.tanh(a), want)


# ---- pyfa.torch (where torch imports)

def test_torch_attention_with_mods_against_float64():
    torch = pytest.importorskip("torch")
    import pyfa.torch as pt
    B, H, Hkv, Nq, Nk, d = 1, 4, 2, 33, 47, 16
    q, k, v, do = _inputs((B, H, Hkv, Nq, Nk, d, 0, 0), seed=5)
    w = np.random.default_rng(5).standard_normal((B, H, Nq))
    hidden = torch.tensor(mask_matrix(Nq, Nk, True))  # causal, bottom-right: flash-attn's
    dist = torch.tensor(np.abs(np.arange(Nq)[:, None] + Nk - Nq - np.arange(Nk)[None, :]))
    for mod in MODS.values():
        kw = {n: torch.tensor(x) if isinstance(x, np.ndarray) else x for n, x in mod.kwargs(B, H).items()}
        got = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        o, lse = pt.attention(*got, causal=True, return_lse=True, backend="cpu", **kw)
        ((o * torch.tensor(do)).sum() + (lse * torch.tensor(w, dtype=torch.float32)).sum()).backward()

        def plain(dtype):
            t = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v)]
            kr, vr = (x.repeat_interleave(H // Hkv, 1) for x in t[1:])
            S = t[0] @ kr.transpose(-1, -2) / np.sqrt(d)
            if "softcap" in kw:
                S = kw["softcap"] * torch.tanh(S / kw["softcap"])
            if "alibi_slopes" in kw:
                slopes = kw["alibi_slopes"].to(dtype).expand(B, H)[..., None, None]
                S = S - slopes * dist.to(dtype)
            S = S.masked_fill(hidden, -float("inf"))
            lse = torch.logsumexp(S, -1)
            o = torch.softmax(S, -1) @ vr
            ((o * torch.tensor(do, dtype=dtype)).sum() + (lse * torch.tensor(w, dtype=dtype)).sum()).backward()
            return [o, lse] + [x.grad for x in t]

        exact, f32 = plain(torch.float64), plain(torch.float32)
        mine = [o, lse] + [x.grad for x in got]
        for name, a, p, e in zip(("o", "lse", "dq", "dk", "dv"), mine, f32, exact):
            e = e.detach().numpy()
            bound = (2.5 if name == "dv" else 2) * rms_err(p.detach().numpy(), e)  # dv: as above
            assert rms_err(a.detach().numpy(), e) <= bound, (name, rms_err(a.detach().numpy(), e), bound)
        # flash-attn's drop-in passes softcap and alibi_slopes through: the same bits in its layout.
        fa = pt.flash_attn_func(*(torch.tensor(x).transpose(1, 2) for x in (q, k, v)), causal=True, **kw)
        assert same_bits(fa.transpose(1, 2).detach().numpy(), o.detach().numpy())


@pytest.mark.parametrize("algo", ["fa1", "fa2"])
def test_packed_sequences_take_alibi_and_softcap_as_each_sequence_alone(algo):
    # ALiBi's distance uses each sequence's own diagonal offset (Nk_b - Nq_b bottom-right)
    # and its row b of (B, H) slopes: every row equals the dense call of its sequence
    # alone, forward and gradients, on emu, cpu and the simulator.
    rng = np.random.default_rng(21)
    cu_q, cu_k = np.array([0, 6, 6, 17], np.int32), np.array([0, 9, 13, 30], np.int32)
    q, do = (rng.standard_normal((17, 4, 16), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((30, 2, 16), dtype=np.float32) for _ in range(2))
    slopes = rng.random((3, 4), dtype=np.float32)
    kw = dict(causal=True, softcap=3.0, algo=algo)
    sim = pyfa.sim.attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes, **kw)
    for backend in ("cpu", "emu"):
        opts = pyfa.Options(backend=backend)
        o, dq, dk, dv = pyfa.attention_varlen_grad(q, k, v, do, cu_q, cu_k, alibi_slopes=slopes, options=opts, **kw)
        assert same_bits(o, sim.o), backend
        for b in (0, 2):  # sequence 1 has no queries
            qa, qz, ka, kz = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            alone = pyfa.attention_grad(q[None, qa:qz], k[None, ka:kz], v[None, ka:kz], do[None, qa:qz],
                                        layout="bnhd", alibi_slopes=slopes[b:b + 1], options=opts, **kw)
            assert same_bits(o[qa:qz], alone[0][0]) and same_bits(dq[qa:qz], alone[1][0]), (backend, b)
            assert same_bits(dk[ka:kz], alone[2][0]) and same_bits(dv[ka:kz], alone[3][0]), (backend, b)
    with pytest.raises(pyfa.InvalidArgumentError, match="alibi_slopes"):
        pyfa.attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes[:2])
    with pytest.raises(pyfa.InvalidArgumentError, match="alibi_slopes"):
        pyfa.sim.attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes[:2])
