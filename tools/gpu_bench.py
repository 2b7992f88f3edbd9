#!/usr/bin/env python3
"""The GPU-side steps of tools/device_check.sh, one subcommand each (modules in
tools/gpucheck/):

    info       GPU, driver, nvcc, torch, ncu and compute-sanitizer versions (no pyfa needed)
    bench      times every op's device entry point with CUDA events, beside PyTorch's SDPA
    drive      runs ops once through the Python API (the program the two below watch)
    sanitize   compute-sanitizer memcheck and racecheck over `drive` on small problems
    ncu        DRAM bytes read and written, per kernel, beside pyfa.sim.count_io
    summarize  merges the steps' JSON into summary.json and summary.md

The ops come from pyfa.api.OPS. Every step takes its deadline from PYFA_STEP_DEADLINE
(seconds since the epoch, set by device_check.sh) and, past it, records what it skipped.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpucheck import bench, drive, info, ncu, sanitize, summary  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for module in (info, bench, drive, sanitize, ncu, summary):
        module.add_parser(sub)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
