"""gpu_bench.py summarize: the steps' JSON merged into summary.json and summary.md.

summary.md puts the steps and the timings first: the device tool returns only the end of
the output, and device_check.sh prints this last, so what matters most must be short."""

import time
from pathlib import Path

from .common import fmt_bytes, load_json, write_json


def junit_counts(path):
    """Test counts from pytest's JUnit XML, all tests and those run on the cuda backend."""
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {"all": dict(passed=0, failed=0, skipped=0), "cuda": dict(passed=0, failed=0, skipped=0),
           "failed": [], "skipped": []}
    for case in root.iter("testcase"):
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        out["all"][outcome] += 1
        if "cuda" in case.get("name", ""):
            out["cuda"][outcome] += 1
        if outcome == "failed":
            out["failed"].append(f"{case.get('classname')}::{case.get('name')}")
        elif outcome == "skipped" and "cuda" in case.get("name", ""):
            # A GPU check that skipped checked nothing: say which, and why.
            why = case.find("skipped").get("message", "")
            out["skipped"].append(f"{case.get('classname')}::{case.get('name')}: {why}")
    return out


def read_steps(path):
    steps = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 6:
            steps.append({"step": parts[0], "status": parts[1], "rc": parts[2], "seconds": parts[3],
                          "timeout_s": parts[4], "command": parts[5]})
    return steps


def cmd_summarize(args):
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": args.mode,
               "steps": read_steps(work / "steps.tsv"), "info": load_json(work / "info.json"),
               "tests": junit_counts(out / "pytest.xml"), "sanitizer": load_json(work / "sanitize.json"),
               "bench": load_json(work / "bench.json"), "ncu": load_json(work / "ncu.json")}
    write_json(out / "summary.json", summary)
    md = markdown(summary)
    (out / "summary.md").write_text(md)
    print(md)
    return 0


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def timing_lines(b):
    clock = "CUDA events" if b.get("backend") == "cuda" else "wall clock, emulator"
    peak = b.get("fp32_peak_tflops")
    peaks = (f"{peak:g} TFLOP/s with FMA (pyfa's kernels fuse every inner-product step, so this is "
             f"their ceiling), {peak / 2:g} multiply-then-add" if peak else "unknown")
    lines = [f"## Timings ({clock}, median)", "",
             f"{b['device']}, B={b['batch']} H={b['heads']} causal={b['causal']}; FLOPs: "
             f"{b['flops_convention']}; fp32 peak {peaks}; x SDPA: time over torch SDPA's at the same "
             f"N and d. torch_sdpa rows: {b.get('sdpa')}.", "",
             "| op | N | d | tiles | ms | TFLOP/s | % FMA peak | % mul+add peak | x SDPA | rel err | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    sdpa = {(r["op"], r["N"], r["d"]): r["ms"] for r in b["records"]
            if r["op"].startswith("torch_sdpa_") and r.get("ms")}
    for r in b["records"]:
        if r.get("ms") is None:
            lines.append(f"| {r['op']} | {r['N']} | {r['d']} | {r['tiles']} | - | - | - | - | - | - | {r['status']} |")
            continue
        share = r.get("peak_share") or {}
        if r["op"].startswith("torch_sdpa_"):
            fma = mul_add = "n/a (tensor cores)"
            vs = "-"
        else:
            fma, mul_add = pct(share.get("fma")), pct(share.get("mul_add"))
            pass_ = "backward" if "backward" in r["op"] else "forward"
            ref = sdpa.get((f"torch_sdpa_{pass_}", r["N"], r["d"]))
            vs = f"{r['ms'] / ref:.2f}" if ref else "-"
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        lines.append(f"| {r['op']} | {r['N']} | {r['d']} | {r['tiles']} | {r['ms']:.3f} | {r['tflops']:.2f} | "
                     f"{fma} | {mul_add} | {vs} | {err} | {r['status']} |")
    lines.append("")
    if b.get("decode"):
        lines += ["Decoding steps (fa2_forward, Nq = 1, split-KV, variant auto; GB/s: K and V once plus "
                  "q and o over the median time; packed: a block serves a K/V head's query heads):", "",
                  "| B | N | H / Hkv | d | split | packed | ms | GB/s | rel err | status |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in b["decode"]:
            timing = (f"{r['ms']:.3f} | {r['gbs']:.0f} | {r['rel_err']:.1e}" if r.get("ms") is not None
                      else "- | - | -")
            lines.append(f"| {r['B']} | {r['N']} | {r['H']} / {r['Hkv']} | {r['d']} | {r['split_size']} | "
                         f"{r['packed']} | {timing} | {r['status']} |")
        lines.append("")
    return lines


def markdown(s):
    lines = [f"# pyfa device check ({s['mode']}, {s['generated']})", ""]
    lines += ["| step | status | rc | seconds | timeout s |", "|---|---|---|---|---|"]
    lines += [f"| {x['step']} | {x['status']} | {x['rc']} | {x['seconds']} | {x['timeout_s']} |" for x in s["steps"]]
    lines.append("")
    if s["mode"] == "dry-run":
        lines += ["Dry run: nothing was built, tested or measured; the log lists each command.", ""]
    t = s.get("tests")
    if t:
        lines += [f"Tests on the cuda backend: {t['cuda']['passed']} passed, {t['cuda']['failed']} failed, "
                  f"{t['cuda']['skipped']} skipped (of all run: {t['all']['passed']} passed, "
                  f"{t['all']['failed']} failed, {t['all']['skipped']} skipped)."]
        lines += [f"- FAILED {name}" for name in t.get("failed", [])[:20]]
        lines += [f"- skipped {name}" for name in t.get("skipped", [])[:20]]
        lines.append("")
    b = s.get("bench")
    if b:
        lines += timing_lines(b)
    info = s.get("info") or {}
    gpu = info.get("gpu") or {}
    if info:
        lines += [f"- GPU: {gpu.get('name', '?')} (compute capability {gpu.get('compute_cap', '?')}, "
                  f"{gpu.get('memory.total', '?')}), driver {gpu.get('driver_version', '?')}; nvcc "
                  f"{info.get('nvcc')}; {info.get('cmake')}; Python {info.get('python')}; torch "
                  f"{(info.get('torch') or {}).get('version')}", ""]
    san = s.get("sanitizer")
    if san:
        lines += ["## compute-sanitizer, and the strict emulator over the same cases", ""]
        lines += [f"- {r['tool']}: {r['status']}" + (f" ({r['errors']} errors)" if r.get("errors") else "")
                  for r in san.get("runs", [])]
        lines += [f"- strict emulator, {size} cases: {r['status']}" for size, r in (san.get("strict") or {}).items()]
        lines.append("")
    n = s.get("ncu")
    if n:
        sh = n["shape"]
        lines += ["## DRAM bytes (ncu) beside the simulator's HBM count", "",
                  f"B={sh['batch']} H={sh['heads']} N={sh['seqlen_q']} d={sh['head_dim']}, default tiles, "
                  f"one call; ncu {n['metrics']} --clock-control none", "",
                  "| op | pass | kernels | ncu read | ncu write | sim read | sim write | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in n.get("ops", []):
            for pass_, r in (e.get("passes") or {"-": {}}).items():
                lines.append(f"| {e['op']} | {pass_} | {', '.join(r.get('kernels', [])) or '-'} | "
                             f"{fmt_bytes(r.get('ncu_read'))} | {fmt_bytes(r.get('ncu_write'))} | "
                             f"{fmt_bytes(r.get('sim_read'))} | {fmt_bytes(r.get('sim_write'))} | {e.get('status')} |")
        lines.append("")
    return "\n".join(lines)


def add_parser(sub):
    p = sub.add_parser("summarize", help="merge the steps' JSON into summary.json and summary.md")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="gpu")
    p.set_defaults(run=cmd_summarize)
