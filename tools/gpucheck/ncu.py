"""gpu_bench.py ncu: DRAM bytes read and written per kernel, measured by ncu over one
`drive` call per op, beside the simulator's HBM count (pyfa.sim.count_io)."""

import csv
import time

from .common import (TOOL_NOT_WORKING, find_ncu, fmt_bytes, forward_of, kernel_key, left_s, ops, run_cmd,
                     write_json)
from .drive import drive_cmd

NCU_SHAPE = dict(batch=4, heads=8, seqlen_q=2048, seqlen_k=2048, head_dim=64)
NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"


def parse_ncu_csv(out):
    """{kernel key: {metric: summed value, launches}} from `ncu --csv` output (rows are
    the lines that start with a quote; the others are the program's)."""
    rows = [line for line in out.splitlines() if line.startswith('"')]
    per_launch = {}
    for row in csv.DictReader(rows):
        name, metric, value = row.get("Kernel Name"), row.get("Metric Name"), row.get("Metric Value")
        if not name or not metric or value is None:
            continue
        try:
            number = float(value.replace(",", ""))
        except ValueError:
            continue
        launch = per_launch.setdefault(row.get("ID"), {"kernel": kernel_key(name), "metrics": {}})
        launch["metrics"][metric] = number
    kernels = {}
    for launch in per_launch.values():
        k = kernels.setdefault(launch["kernel"], {"launches": 0})
        k["launches"] += 1
        for metric, v in launch["metrics"].items():
            k[metric] = k.get(metric, 0) + v
    return kernels


def pass_rows(op, kernels, shape, backend):
    """{pass: row} for the passes `op`'s drive call ran (a backward runs its forward
    first), each the ncu bytes of that pass's kernels beside count_io's."""
    import pyfa
    ran = [forward_of(op), op] if op.pass_ == "backward" else [op]
    rows = {}
    for o in ran:
        mine = {k: v for k, v in kernels.items() if k in o.kernels}
        row = {"ncu_read": sum(v.get("dram__bytes_read.sum", 0) for v in mine.values()) if mine else None,
               "ncu_write": sum(v.get("dram__bytes_write.sum", 0) for v in mine.values()) if mine else None,
               "kernels": sorted(mine)}
        io = pyfa.sim.count_io(o.algo, passes=o.pass_, **shape)
        row.update(sim_read=io.total_reads, sim_write=io.total_writes)
        # count_io uses the emulated profile's default tiles; the GPU run used the library's.
        try:
            row["tiles_match"] = all(tuple(pyfa.default_tiles(k, shape["head_dim"], backend))
                                     == tuple(pyfa.sim.default_tiles(k, shape["head_dim"])) for k in o.kernels)
        except pyfa.PyfaError as e:
            row["tiles_match"] = f"unknown: {e}"
        rows[o.pass_] = row
    return rows


def cmd_ncu(args):
    ncu = find_ncu() or "ncu"
    shape = dict(NCU_SHAPE)
    if args.shape:
        shape.update(zip(("batch", "heads", "seqlen_q", "head_dim"), args.shape), seqlen_k=args.shape[2])
    result = {"tool": ncu, "shape": shape, "metrics": NCU_METRICS, "ops": []}
    all_ops = ops()
    for index, op in enumerate(all_ops):
        cmd = [ncu, "--metrics", NCU_METRICS, "--clock-control", "none", "--print-units", "base",
               "--csv", *drive_cmd([op.name], [shape[k] for k in ("batch", "heads", "seqlen_q", "head_dim")],
                                   args.backend)]
        if args.dry_run:
            print("  would run: " + " ".join(cmd))
            continue
        entry = {"op": op.name, "command": cmd}
        result["ops"].append(entry)
        if not find_ncu():
            entry["status"] = "not installed"
            continue
        if left_s() < 15:
            entry["status"] = "skipped: time budget"
            continue
        t0 = time.time()
        rc, out = run_cmd(cmd, min(args.timeout, (left_s() - 5) / (len(all_ops) - index)))
        entry["seconds"] = round(time.time() - t0, 1)
        kernels = parse_ncu_csv(out or "")
        entry["kernels"] = kernels
        if rc is None:
            entry["status"] = "timeout"
        elif not kernels:
            entry["status"] = ("tool not working here" if any(p in out for p in TOOL_NOT_WORKING)
                               else f"no kernel measured (rc {rc})")
            entry["output_tail"] = out[-3000:]
        else:
            entry["status"] = "ok" if rc == 0 else f"measured, but rc {rc}"
        entry["passes"] = pass_rows(op, kernels, shape, args.backend)
        for pass_, row in entry["passes"].items():
            print(f"ncu {op.name} ({pass_} kernels {', '.join(row['kernels']) or 'none'}): DRAM read "
                  f"{fmt_bytes(row['ncu_read'])}, written {fmt_bytes(row['ncu_write'])}; simulator "
                  f"HBM read {fmt_bytes(row['sim_read'])}, written {fmt_bytes(row['sim_write'])}")
        if entry["status"] != "ok":
            print(f"ncu {op.name}: {entry['status']}")
        write_json(args.out, result)
        if entry["status"] == "tool not working here":
            break
    if args.dry_run:
        s = shape
        print(f"  shape B={s['batch']} H={s['heads']} N={s['seqlen_q']} d={s['head_dim']}, default tiles; "
              f"beside pyfa.sim.count_io(algo, passes=..., same shape)")
        return 0
    write_json(args.out, result)
    return 0


def add_parser(sub):
    p = sub.add_parser("ncu", help="DRAM bytes per kernel beside pyfa.sim.count_io")
    p.add_argument("--out")
    p.add_argument("--timeout", type=float, default=60, help="seconds per tool run")
    p.add_argument("--backend", choices=["cuda", "emu"], default="cuda",
                   help="backend of the driven program (emu: to try the plumbing without a GPU)")
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "N", "D"),
                   help="problem to measure (default: %s)" % " ".join(
                       str(NCU_SHAPE[k]) for k in ("batch", "heads", "seqlen_q", "head_dim")))
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(run=cmd_ncu)
