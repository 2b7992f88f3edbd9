"""gpu_bench.py sanitize: compute-sanitizer memcheck, racecheck, initcheck and synccheck over
`drive`, and beside them the emulator's strict mode (docs/emulator.md) over the same cases:
its race, async, init, bounds, align and barrier checks are the emulator's counterparts of
the four tools, so a hazard one side finds and the other misses shows in one table."""

import re
import time

from .common import TOOL_NOT_WORKING, find_sanitizer, left_s, ops, run_cmd, write_json
from .drive import DRIVE_SIZES, drive_cmd

SANITIZER_TOOLS = ["memcheck", "racecheck", "initcheck", "synccheck"]
SANITIZER_SIZES = {"memcheck": "small", "racecheck": "race", "initcheck": "small", "synccheck": "race"}
# The strict emulator's checks that answer each tool's question.
STRICT_COUNTERPART = {"memcheck": "bounds, align", "racecheck": "race, async", "initcheck": "init",
                      "synccheck": "barrier"}


def classify_strict(rc, out):
    """Status of one strict-mode run of `drive` on the emulator."""
    if rc is None:
        return "timeout"
    if "KernelHazardError" in out:
        return "hazards found"
    if "drive: done" in out and rc == 0:
        return "clean"
    return "failed (see output)"


def case_sets(args):
    """tool -> the DRIVE_SIZES set it runs over (--cases: one set for all)."""
    return {t: args.cases or s for t, s in SANITIZER_SIZES.items()}


def run_strict(names, result, args):
    """The strict emulator over each case set the tools use, once per set."""
    result["strict"] = {}
    sizes = sorted(set(case_sets(args).values()))
    for index, size in enumerate(sizes):
        cmd = drive_cmd(names, size, "emu", "strict")
        if args.dry_run:
            print("  would run: " + " ".join(cmd))
            continue
        if left_s() < 10:
            result["strict"][size] = {"status": "skipped: time budget", "command": cmd}
            continue
        t0 = time.time()
        # A third of what is left, shared by the case sets: the four tools get the rest.
        rc, out = run_cmd(cmd, min(args.timeout, (left_s() - 5) / 3 / (len(sizes) - index)))
        status = classify_strict(rc, out)
        result["strict"][size] = {"status": status, "rc": rc, "seconds": round(time.time() - t0, 1),
                                  "command": cmd, "output_tail": out[-3000:]}
        print(f"strict emulator ({size} cases): {status} ({result['strict'][size]['seconds']} s)")
        if status != "clean":
            print(out[-2000:])


def print_verdicts(result, args):
    """compute-sanitizer's verdict beside strict mode's, tool by tool."""
    print("tool       cases  compute-sanitizer       strict emulator (its checks)")
    runs = {r["tool"]: r for r in result["runs"]}
    for tool in SANITIZER_TOOLS:
        size = case_sets(args)[tool]
        gpu = runs.get(tool, {}).get("status", "not run")
        emu = result.get("strict", {}).get(size, {}).get("status", "not run")
        print(f"{tool:<10} {size:<6} {gpu:<23} {emu} ({STRICT_COUNTERPART[tool]})")


def classify_sanitizer(tool, rc, out):
    """(status, error count) of one compute-sanitizer run over `drive`."""
    errors = None
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", out)
    if m:
        errors = int(m.group(1))
    m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", out)
    if m:
        errors = int(m.group(1))
    done = "drive: done" in out
    if rc is None:
        return "timeout", errors
    if errors:
        return "errors found", errors
    if any(p in out for p in TOOL_NOT_WORKING) or (not done and errors is None):
        return "tool not working here", errors
    if done and rc == 0:
        return "clean", errors or 0
    return "failed (see output)", errors


def cmd_sanitize(args):
    tool_path = find_sanitizer() or "compute-sanitizer"
    names = [op.name for op in ops()]
    result = {"tool": tool_path, "ops": names,
              "cases": {t: DRIVE_SIZES[s] for t, s in case_sets(args).items()}, "runs": []}
    run_strict(names, result, args)
    for index, tool in enumerate(SANITIZER_TOOLS):
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "86", "--print-limit", "20",
               *drive_cmd(names, case_sets(args)[tool], args.backend)]
        if args.dry_run:
            print("  would run: " + " ".join(cmd))
            continue
        if not find_sanitizer():
            if index == 0:
                print("compute-sanitizer: not found (PATH, /usr/local/cuda/bin, /usr/local/cuda/compute-sanitizer): "
                      "its four tools are skipped; the strict emulator's verdicts stand alone")
            result["runs"].append({"tool": tool, "status": "not installed", "command": cmd})
            continue
        if left_s() < 10:
            result["runs"].append({"tool": tool, "status": "skipped: time budget", "command": cmd})
            continue
        t0 = time.time()
        # An equal share of what is left for this and each later tool.
        share = (left_s() - 5) / (len(SANITIZER_TOOLS) - index)
        rc, out = run_cmd(cmd, min(args.timeout, share))
        status, errors = classify_sanitizer(tool, rc, out)
        run = {"tool": tool, "status": status, "errors": errors, "rc": rc,
               "seconds": round(time.time() - t0, 1), "command": cmd, "output_tail": out[-3000:]}
        result["runs"].append(run)
        print(f"compute-sanitizer {tool}: {status}" + (f", {errors} errors" if errors else "")
              + f" ({run['seconds']} s, ops {', '.join(names)})")
        if status != "clean":
            print(out[-2000:])
        write_json(args.out, result)
        if status == "tool not working here":
            # The same tool fails the same way on every run; spend the time elsewhere.
            for rest in SANITIZER_TOOLS[index + 1:]:
                result["runs"].append({"tool": rest, "status": "skipped: the tool does not work here"})
            break
    if args.dry_run:
        print(f"  ops: {', '.join(names)}; memcheck {len(DRIVE_SIZES['small'])} small cases each (B=1 H=2, "
              "Nq/Nk 70/90 and 90/70, d 64 and 128, default and 16x32 tiles, causal or not), "
              f"racecheck {len(DRIVE_SIZES['race'])} of them at d=64; initcheck as memcheck, synccheck as "
              "racecheck; the strict emulator over both sets")
        return 0
    print_verdicts(result, args)
    write_json(args.out, result)
    bad = ("errors found", "failed (see output)", "hazards found")
    return 1 if any(r["status"] in bad for r in [*result["runs"], *result["strict"].values()]) else 0


def add_parser(sub):
    p = sub.add_parser("sanitize", help="compute-sanitizer's four tools and the strict emulator over drive")
    p.add_argument("--out")
    p.add_argument("--timeout", type=float, default=120, help="seconds per tool run")
    p.add_argument("--backend", choices=["cuda", "emu"], default="cuda",
                   help="backend of the driven program (emu: to try the plumbing without a GPU)")
    p.add_argument("--cases", choices=sorted(DRIVE_SIZES),
                   help="one case set for every tool and the strict emulator (default: each tool's own)")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(run=cmd_sanitize)
