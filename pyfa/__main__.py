"""python -m pyfa: the demo. FA2 forward on the best backend here, checked bit for bit
against the simulator, with the simulator's HBM-IO table beside unfused standard
attention's."""

import argparse
import sys
import time

import numpy as np

import pyfa
from pyfa import _config
from pyfa.sim.io import format_bytes
from pyfa.sim.report import PROGRESS_DELAY_S, Progress, progress_wanted


def int_in(lo, hi=None):
    """An argparse type: an int in [lo, hi], refused with a usage error otherwise."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    return parse


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if _config.wanted(argv):
        return _config.main(argv)
    ap = argparse.ArgumentParser(prog="python -m pyfa", description=__doc__)
    ap.add_argument("--batch", type=int_in(1), default=1)
    ap.add_argument("--heads", type=int_in(1), default=4)
    ap.add_argument("--seqlen", type=int_in(1), default=256)
    ap.add_argument("--head-dim", type=int_in(1, pyfa.checks.MAX_HEAD_DIM), default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backend", default="auto", choices=list(pyfa.api.BACKENDS))
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help=f"a progress bar on stderr for calls that take over {PROGRESS_DELAY_S:g} s "
                         "(default: when stderr is a terminal)")
    build = ap.add_argument_group(
        "build flags", "instead of the demo: flags for compiling C or C++ programs against "
                       "this pyfa, like pkg-config (several print on one line, in the order given)")
    for flag, help in _config.FLAGS.items():
        build.add_argument(flag, action="store_true", help=help)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    backend = args.backend if args.backend != "auto" else pyfa.backends()[0]
    if backend not in pyfa.backends():
        ap.error(f"argument --backend: {backend} cannot run here: {pyfa.unavailable_backends()[backend]}")
    print(f"pyfa {pyfa.__version__} (library {pyfa.library_version()}), backends here: {pyfa.backends()}")
    for name, why in pyfa.unavailable_backends().items():
        print(f"  {name} unavailable: {why}")
    print(f"FA2 forward, B={args.batch} H={args.heads} N={args.seqlen} d={args.head_dim} "
          f"causal={args.causal}, tiles {pyfa.default_tiles('fa2_forward', args.head_dim, backend)} "
          f"on {backend} ({pyfa.device_profile(backend)['name']})")

    show = progress_wanted(args.progress)
    t0 = time.perf_counter()
    bar = Progress(1, f"kernel ({backend})", show, delay=PROGRESS_DELAY_S)
    try:
        o, lse = pyfa.fa2_forward(q, k, v, causal=args.causal,
                                  options=pyfa.Options(backend=backend, progress=bar))
        bar.finish()
    finally:
        bar.close()
    t1 = time.perf_counter()
    bar = Progress(1, "simulator", show, delay=PROGRESS_DELAY_S)
    try:
        sim = pyfa.sim.fa2_forward(q, k, v, causal=args.causal,
                                   options=pyfa.Options(progress=bar))
        bar.finish()
    finally:
        bar.close()
    t2 = time.perf_counter()
    same = np.array_equal(o.view(np.uint32), sim.o.view(np.uint32)) and \
        np.array_equal(lse.view(np.uint32), sim.lse.view(np.uint32))
    print(f"kernel {t1 - t0:.3f} s, simulator {t2 - t1:.3f} s")
    print(f"kernel == simulator bit for bit: {'yes' if same else 'NO'}")
    print()
    print(sim.io)
    print()
    print(io_comparison(sim.io, args))
    return 0 if same else 1


def io_comparison(fa2, args):
    """FA2's HBM bytes beside unfused standard attention's for the demo's problem (the
    simulator's model of it, pyfa/sim/standard.py): the comparison FlashAttention is for."""
    standard = pyfa.sim.count_io("standard", batch=args.batch, heads=args.heads,
                                 seqlen_q=args.seqlen, seqlen_k=args.seqlen,
                                 head_dim=args.head_dim, causal=args.causal)
    rows = [("FA2 (simulated above)", fa2), ("standard attention (unfused)", standard)]
    w = max(len(name) for name, _ in rows)
    lines = ["HBM bytes, forward: FA2 beside standard attention",
             f"{'algorithm':<{w}}  {'read':>12}  {'written':>12}  {'total':>12}"]
    for name, r in rows:
        lines.append(f"{name:<{w}}  {format_bytes(r.total_reads):>12}  "
                     f"{format_bytes(r.total_writes):>12}  {format_bytes(r.total):>12}")
    lines.append(f"standard attention moves {standard.total / fa2.total:.2f}x FA2's bytes")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
