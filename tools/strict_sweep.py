"""strict_sweep.py: the emulator's strict mode (docs/emulator.md, "Strict mode") over the
whole case grid of tests/grid.py: every case x FA1/FA2 forward and backward x variant
(reference, and the fast kernels where the case's head dim and tiles have them) x mask
(none, causal, a sliding window), on the emulator with emu_check="strict". Each case's
outputs must equal plain emulation's bit for bit; a hazard is printed with its report.

    python tools/strict_sweep.py                  # the whole grid (minutes)
    python tools/strict_sweep.py --quick          # the grid's first 6 cases, no window
    python tools/strict_sweep.py --fast-tiles     # also every fast instantiation (d 64 and 128,
                                                  # Br 64 and 128) on a tail case
    python tools/strict_sweep.py --mods           # each run also with every score modification
                                                  # (bias, bias of one row, ALiBi, softcap,
                                                  # dropout) and as packed sequences
    python tools/strict_sweep.py --json out.json

The last line is the summary: "strict sweep: N runs, H hazards, M mismatches, S s
(plain emulation T s)". Exit status 1 when anything was found.
"""

import argparse
import itertools
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pyfa  # noqa: E402

MASKS = [(False, None), (True, None), (False, (3, 2))]


def grid_cases():
    from grid import CASES  # tests/grid.py: (B, H, Nq, Nk, d, Br, Bc)
    return CASES


def fast_cases():
    """Every fast kernel's instantiation on a tail (N = 70 is not a multiple of 64)."""
    return [(1, 2, 70, 70, d, br, 64) for d in (64, 128) for br in (64, 128)]


# The score modifications (pyfa.checks.ScoreMods) of --mods, each a function of the
# case's (rng, B, H, Nq, Nk); "varlen" packs the batch as sequences of different lengths.
MODS = {
    "none": lambda rng, B, H, Nq, Nk: {},
    "bias": lambda rng, B, H, Nq, Nk: dict(bias=rng.standard_normal((1, H, Nq, Nk), dtype=np.float32)),
    "bias_one_row": lambda rng, B, H, Nq, Nk: dict(bias=rng.standard_normal((B, 1, 1, Nk), dtype=np.float32)),
    "alibi": lambda rng, B, H, Nq, Nk: dict(alibi_slopes=rng.uniform(0.1, 1.0, H).astype(np.float32)),
    "softcap": lambda rng, B, H, Nq, Nk: dict(softcap=5.0),
    "dropout": lambda rng, B, H, Nq, Nk: dict(dropout_p=0.25, seed=5),
    "varlen": None,
}


def run_ops(case, causal, window, variant, emu_check, mod="none"):
    """Every op's outputs for one case on the emulator, with the wall time it took."""
    B, H, Nq, Nk, d, Br, Bc = case
    rng = np.random.default_rng(Nq * 7919 + Nk * 31 + d)
    if mod == "varlen":
        return run_varlen(case, causal, window, variant, emu_check, rng)
    q = rng.standard_normal((B, H, Nq, d), dtype=np.float32)
    k = rng.standard_normal((B, H, Nk, d), dtype=np.float32)
    v = rng.standard_normal((B, H, Nk, d), dtype=np.float32)
    do = rng.standard_normal((B, H, Nq, d), dtype=np.float32)
    options = pyfa.Options(backend="emu", block_r=Br, block_c=Bc, variant=variant, emu_check=emu_check)
    kw = dict(causal=causal, window=window, options=options, **MODS[mod](rng, B, H, Nq, Nk))
    t0 = time.perf_counter()
    o2, lse = pyfa.fa2_forward(q, k, v, **kw)
    g2 = pyfa.fa2_backward(q, k, v, o2, lse, do, **kw)
    o1, m1, l1 = pyfa.fa1_forward(q, k, v, **kw)
    g1 = pyfa.fa1_backward(q, k, v, o1, m1, l1, do, **kw)
    return [o2, lse, *g2, o1, m1, l1, *g1], time.perf_counter() - t0


def run_varlen(case, causal, window, variant, emu_check, rng):
    """The case as packed sequences: B + 1 of them, of the case's lengths and a third of
    them (a tail in every tile)."""
    B, H, Nq, Nk, d, Br, Bc = case
    lq = [Nq] * B + [max(1, Nq // 3)]
    lk = [Nk] * B + [max(1, Nk // 3)]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], H, d), dtype=np.float32)
    k = rng.standard_normal((ck[-1], H, d), dtype=np.float32)
    v = rng.standard_normal((ck[-1], H, d), dtype=np.float32)
    do = rng.standard_normal((cq[-1], H, d), dtype=np.float32)
    options = pyfa.Options(backend="emu", block_r=Br, block_c=Bc, variant=variant, emu_check=emu_check)
    t0 = time.perf_counter()
    out = []
    for algo in ("fa2", "fa1"):
        kw = dict(causal=causal, window=window, algo=algo, options=options)
        res = pyfa.attention_varlen(q, k, v, cq, ck, return_lse=algo == "fa2", **kw)
        out += list(res) if isinstance(res, tuple) else [res]
        out += list(pyfa.attention_varlen_grad(q, k, v, do, cq, ck, **kw))
    return out, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the grid's first 6 cases, no window")
    ap.add_argument("--fast-tiles", action="store_true", help="also every fast kernel instantiation")
    ap.add_argument("--mods", action="store_true", help="every run with each score modification and packed")
    ap.add_argument("--json", help="write every run's result here")
    args = ap.parse_args(argv)
    mods = list(MODS) if args.mods else ["none"]

    cases = grid_cases()[:6] if args.quick else grid_cases()
    masks = MASKS[:2] if args.quick else MASKS
    if args.fast_tiles:
        cases = list(cases) + fast_cases()
    runs, hazards, mismatches = [], 0, 0
    strict_s = plain_s = 0.0
    for case in cases:
        # "auto" runs the fast kernels where they apply at these tiles (aligned tensors,
        # d 64 or 128, their tiles) and the readable ones elsewhere.
        for variant, (causal, window), mod in itertools.product(("reference", "auto"), masks, mods):
            name = f"{case} {variant} causal={causal} window={window}" + ("" if mod == "none" else f" {mod}")
            try:
                plain, tp = run_ops(case, causal, window, variant, "off", mod)
            except ValueError as e:  # tiles the library refuses for this case
                runs.append({"case": name, "status": "refused", "detail": str(e)})
                continue
            try:
                strict, ts = run_ops(case, causal, window, variant, "strict", mod)
            except pyfa.KernelHazardError as e:
                hazards += 1
                runs.append({"case": name, "status": "hazard", "check": e.check, "detail": str(e)})
                print(f"HAZARD {name}: {e}", flush=True)
                continue
            strict_s += ts
            plain_s += tp
            same = all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
                       for a, b in zip(strict, plain))
            if not same:
                mismatches += 1
                print(f"MISMATCH {name}: strict mode's bits differ from plain emulation's", flush=True)
            runs.append({"case": name, "status": "clean" if same else "mismatch",
                         "strict_s": round(ts, 3), "plain_s": round(tp, 3)})
            print(f"{'ok' if same else 'MISMATCH'} {name}: strict {ts:.2f} s, plain {tp:.2f} s", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"runs": runs, "hazards": hazards, "mismatches": mismatches,
                                                       "strict_s": strict_s, "plain_s": plain_s}, indent=1))
    ratio = f", {strict_s / plain_s:.1f}x" if plain_s > 0 else ""
    print(f"strict sweep: {len(runs)} runs, {hazards} hazards, {mismatches} mismatches, "
          f"{strict_s:.1f} s (plain emulation {plain_s:.1f} s{ratio})")
    return 1 if hazards or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
