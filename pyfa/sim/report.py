"""The HBM-IO report's command line: `python -m pyfa.sim report` and
`python -m pyfa.sim sweep`. The counting is pyfa/sim/report_model.py's, the formatting
pyfa/sim/report_render.py's.
"""

import argparse
import json
import sys
import threading
import time
from dataclasses import replace

from .report_model import (PRESETS, PROFILES, SWEEP_DEFAULTS, Setup, available_algorithms,
                           build_report, report_steps, run_sweep)
from .report_render import (PASS_WORDS, plot_sweep, render_markdown, render_sweep_markdown,
                            render_sweep_text, render_text)


# A command's progress bar appears only once a call has run this long: a short call
# leaves no trace on the terminal.
PROGRESS_DELAY_S = 1.0


def progress_wanted(flag, stream=None):
    """--progress / --no-progress as given, else whether stderr is a terminal."""
    return flag if flag is not None else (stream or sys.stderr).isatty()


class Progress:
    """A one-line progress bar on stderr (plain text, redrawn in place with \\r); silent
    when disabled, and until `delay` seconds have passed since it was made.

    Driven either by step() (one of `total` steps done: the sweep's counts) or as a
    progress(done, total) callback (pyfa.Options(progress=bar): the library's and the
    simulator's calls), which never cancels. The library may call it from several of its
    threads at once, hence the lock; the bar never moves back."""

    def __init__(self, total, label, enabled, stream=None, delay=0.0):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.delay = delay
        self.done = 0
        self.drawn = False
        self.last_draw = None
        self.lock = threading.Lock()
        self.start = time.perf_counter()

    def step(self, what=""):
        with self.lock:
            self.done += 1
            self._draw(what, steps=True)

    def __call__(self, done, total):
        with self.lock:
            if total > 0:
                self.total = total
                self.done = max(self.done, min(done, total))
                self._draw("", steps=False)
        return None

    def _draw(self, what, steps):
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        if elapsed < self.delay:
            return
        finished = self.done >= self.total
        # At most ten redraws a second, but always the last one.
        if self.last_draw is not None and not finished and now - self.last_draw < 0.1:
            return
        self.drawn, self.last_draw = True, now
        filled = 30 * self.done // self.total
        count = (f"{self.done}/{self.total}" if steps
                 else f"{100 * self.done // self.total:3d}%")
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] "
                          f"{count} {elapsed:5.1f}s {what:<24}")
        self.stream.flush()

    def finish(self):
        """The call returned: the bar at its end (a library reports progress now and then,
        not necessarily at the last step)."""
        with self.lock:
            self.done = self.total
            self._draw("", steps=False)

    def close(self):
        """Ends the bar's line, if one was drawn."""
        with self.lock:
            if self.drawn:
                self.stream.write("\n")
                self.stream.flush()
                self.drawn = False


# ---------------------------------------------------------------- command line

def _int_list(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")


def _window(text):
    """LEFT,RIGHT, each an int or "none" (unbounded)."""
    parts = [x.strip().lower() for x in text.split(",")]
    try:
        if len(parts) != 2:
            raise ValueError
        return tuple(None if x in ("none", "") else int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (ints or none), got {text!r}")


def _name_list(text):
    return [] if text.strip().lower() == "none" else [x.strip() for x in text.split(",") if x.strip()]


def _add_common(ap):
    g = ap.add_argument_group("problem (a preset's values unless given)")
    g.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration")
    g.add_argument("--batch", "-B", type=int)
    g.add_argument("--heads", "-H", type=int)
    g.add_argument("--seqlen", "-N", type=int, help="sets both seqlen_q and seqlen_k")
    g.add_argument("--seqlen-q", type=int)
    g.add_argument("--seqlen-k", type=int)
    g.add_argument("--head-dim", "-d", type=int)
    g.add_argument("--heads-kv", type=int, help="K/V heads (grouped-query attention; default: "
                                                "as many as query heads)")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--window", type=_window, metavar="LEFT,RIGHT",
                   help="sliding window: keys visible left and right of the diagonal, ints "
                        "or none (unbounded); causal makes RIGHT 0")
    g.add_argument("--causal-align", choices=["bottom_right", "top_left"],
                   help="where the diagonal sits when Nq != Nk (default bottom_right)")
    g.add_argument("--dtype-bytes", type=int, help="bytes per tensor element (2: fp16, 4: fp32)")
    g = ap.add_argument_group("what to count")
    g.add_argument("--passes", choices=list(PASS_WORDS))
    g.add_argument("--algos", type=_name_list,
                   help="comma-separated algorithms (default: all registered: "
                        + ", ".join(available_algorithms()) + ")")
    g.add_argument("--standard-passes", type=_name_list,
                   help="elementwise passes of the unfused model: any of scale,mask,dropout, "
                        "or none")
    g.add_argument("--block-r", "--br", type=int, help="Br for every kernel (default: profile's)")
    g.add_argument("--block-c", "--bc", type=int, help="Bc for every kernel (default: profile's)")
    g.add_argument("--profile", choices=sorted(PROFILES), help="device profile (default emu)")
    g.add_argument("--smem-kib", type=int, help="shared memory per block, overriding the profile")
    g = ap.add_argument_group("output")
    g.add_argument("--format", choices=["text", "markdown", "json"], default="text")
    g.add_argument("--out", help="write the report to this file instead of stdout")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr for counts that take over "
                        f"{PROGRESS_DELAY_S:g} s (default: when stderr is a terminal)")


def setup_from_args(args):
    preset = PRESETS[args.preset]["setup"] if args.preset else Setup()
    given = {
        "batch": args.batch, "heads": args.heads, "seqlen_q": args.seqlen_q or args.seqlen,
        "seqlen_k": args.seqlen_k or args.seqlen, "head_dim": args.head_dim,
        "heads_kv": args.heads_kv, "window": args.window, "causal_align": args.causal_align,
        "causal": args.causal, "dtype_bytes": args.dtype_bytes, "passes": args.passes,
        "block_r": args.block_r, "block_c": args.block_c, "profile": args.profile,
        "smem_kib": args.smem_kib,
        "standard_passes": tuple(args.standard_passes) if args.standard_passes is not None else None,
        "algos": args.algos,
    }
    return replace(preset, **{k: v for k, v in given.items() if v is not None})


def _emit(text, path):
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m pyfa.sim",
        description="HBM-IO reports of pyfa's simulator: bytes each attention algorithm "
                    "moves through HBM, per tensor, against unfused standard attention.")
    sub = ap.add_subparsers(dest="command", required=True)
    presets = "presets:\n" + "\n".join(f"  {k}: {v['description']}" for k, v in PRESETS.items())
    rp = sub.add_parser("report", help="per-tensor tables, totals, ratios, asymptotic forms",
                        epilog=presets, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(rp)
    rp.add_argument("--steps", action="store_true", help="also list the standard model's steps")
    sp = sub.add_parser("sweep", help="total bytes against Bc, Br or N", epilog=presets,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(sp)
    sp.add_argument("--over", choices=list(SWEEP_DEFAULTS), default="bc")
    sp.add_argument("--values", type=_int_list, help="comma-separated values (default: "
                    + "; ".join(f"{k}: {','.join(map(str, v))}" for k, v in SWEEP_DEFAULTS.items())
                    + ")")
    sp.add_argument("--plot", metavar="FILE.png", help="also write a PNG plot (needs matplotlib)")
    args = ap.parse_args(argv)

    try:
        s = setup_from_args(args)
        show = progress_wanted(args.progress)
        if args.command == "report":
            bar = Progress(report_steps(s), "report", show, delay=PROGRESS_DELAY_S)
            try:
                r = build_report(s, preset=args.preset, on_step=bar.step)
            finally:
                bar.close()
            if args.format == "json":
                text = json.dumps(r, indent=2, ensure_ascii=False) + "\n"
            elif args.format == "markdown":
                text = render_markdown(r, steps=args.steps)
            else:
                text = render_text(r, steps=args.steps)
        else:
            values = args.values or SWEEP_DEFAULTS[args.over]
            algos = s.algos or available_algorithms()
            bar = Progress(len(values) * len(algos), f"sweep {args.over}", show,
                           delay=PROGRESS_DELAY_S)
            try:
                sw = run_sweep(s, args.over, values, on_step=bar.step)
            finally:
                bar.close()
            if args.plot:
                plot_sweep(sw, args.plot)
            if args.format == "json":
                text = json.dumps(sw, indent=2, ensure_ascii=False) + "\n"
            elif args.format == "markdown":
                text = render_sweep_markdown(sw)
            else:
                text = render_sweep_text(sw)
    except ValueError as e:
        ap.error(str(e))
    _emit(text, args.out)
    return 0
