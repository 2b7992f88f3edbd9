"""The HBM-IO report: `python -m pyfa.sim report` and `python -m pyfa.sim sweep`.

For one attention problem it counts, per tensor, the bytes each algorithm moves through
HBM (sim/count.py's walkers, whichever algorithms and passes WALKERS holds when it runs,
and the unfused standard model of sim/standard.py), then prints them beside each other,
beside the papers' asymptotic forms, and, for the GPT-2 medium preset, beside the
FlashAttention paper's measured numbers, with notes on why they differ. A sweep does the
same over Bc, Br or N, as a table and optionally a PNG plot.

Everything is computed into a plain dict first (what --format json prints); the text and
markdown renderers only format that dict.
"""

import argparse
import json
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, replace

from . import count as count_mod
from .inputs import MAX_HEAD_DIM
from .io import IORecord
from .standard import PASS_NAMES, backward_steps, count_standard_io, forward_steps
from .tiles import EMU_PROFILE, FLOAT_BYTES, DeviceProfile, default_tiles, smem_bytes

# Device profiles for default tiles and the M of Theta(N^2 d^2 / M). The A100's is the
# shared memory one block may opt in to on sm_80 (163 KiB), the GPU of the paper's table.
PROFILES = {
    "emu": EMU_PROFILE,
    "a100": DeviceProfile("A100 (sm_80)", 163 * 1024, 1024, 108),
    "h100": DeviceProfile("H100 SXM (sm_90)", 227 * 1024, 1024, 132),
}

# The FlashAttention paper (Dao et al., 2022), Figure 2 left: GPT-2 medium attention,
# forward + backward on an A100 in fp16, HBM reads + writes measured.
PAPER_GPT2 = {
    "source": "FlashAttention (Dao et al., 2022), Figure 2: GPT-2 medium, A100, fp16, "
              "forward + backward, measured",
    "standard_bytes": 40.3e9,
    "flashattention_bytes": 4.4e9,
}


@dataclass(frozen=True)
class Setup:
    """Everything one report needs: the problem, the passes, tiles and the profile."""
    batch: int = 1
    heads: int = 1
    seqlen_q: int = 1024
    seqlen_k: int = 1024
    head_dim: int = 64
    causal: bool = False
    dtype_bytes: int = 4
    passes: str = "both"              # "forward", "backward" or "both"
    block_r: object = None            # None: each kernel's default for the profile
    block_c: object = None
    profile: str = "emu"
    smem_kib: object = None           # overrides the profile's shared memory
    standard_passes: tuple = ()       # subset of standard.PASS_NAMES
    algos: object = None              # None: every algorithm in WALKERS

    def device(self):
        p = PROFILES[self.profile]
        if self.smem_kib is not None:
            p = replace(p, name=f"{p.name}, shared memory overridden",
                        smem_per_block=int(self.smem_kib) * 1024)
        return p


PRESETS = {
    "gpt2-medium": dict(
        description="GPT-2 medium attention, the FlashAttention paper's IO table "
                    "(Figure 2): B=64, H=16, N=1024, d=64, causal, fp16, forward + backward; "
                    "standard attention as HuggingFace GPT-2's eager pipeline "
                    "(scale, mask and dropout passes)",
        setup=Setup(batch=64, heads=16, seqlen_q=1024, seqlen_k=1024, head_dim=64, causal=True,
                    dtype_bytes=2, passes="both", standard_passes=PASS_NAMES),
        paper=PAPER_GPT2),
    "v1-table": dict(
        description="the v1 IO table's configuration: B=4, H=8, N=2048, d=64, Br=Bc=32, "
                    "fp32, not causal, forward + backward",
        setup=Setup(batch=4, heads=8, seqlen_q=2048, seqlen_k=2048, head_dim=64, causal=False,
                    dtype_bytes=4, passes="both", block_r=32, block_c=32),
        paper=None),
}

PASS_WORDS = {"forward": "forward", "backward": "backward", "both": "forward + backward"}


# ---------------------------------------------------------------- counting

def available_algorithms():
    """Algorithms in WALKERS right now, standard first, then by name."""
    names = {a for a, _ in count_mod.WALKERS}
    return sorted(names, key=lambda a: (a != "standard", a))


def _wanted_passes(passes):
    return ["forward", "backward"] if passes == "both" else [passes]


def missing_passes(algo, passes):
    return [p for p in _wanted_passes(passes) if (algo, p) not in count_mod.WALKERS]


def kernel_tiles(kernel, s):
    """(Br, Bc) for one kernel: the caller's, else the kernel's default for the profile.
    kernel None is a model without tiles (the unfused standard attention)."""
    if kernel is None:
        return None, None
    Br, Bc = default_tiles(kernel, s.head_dim, s.device())
    return (s.block_r or Br, s.block_c or Bc)


def count(algo, s):
    """(IORecord for the whole batch, [tile rows]) of `algo` under setup `s`. The same loop
    as count_io, with tiles from the chosen profile; the standard model goes through
    count_standard_io, which knows the optional elementwise passes."""
    if algo == "standard":
        opts = {f"{p}_pass": p in s.standard_passes for p in PASS_NAMES}
        rec = count_standard_io(passes=s.passes, batch=s.batch, heads=s.heads,
                                seqlen_q=s.seqlen_q, seqlen_k=s.seqlen_k, head_dim=s.head_dim,
                                causal=s.causal, dtype_bytes=s.dtype_bytes, **opts)
        return rec, []
    record, tiles = IORecord(), []
    for p in _wanted_passes(s.passes):
        for kernel, walker in count_mod.WALKERS[(algo, p)]:
            Br, Bc = kernel_tiles(kernel, s)
            record = record + walker(s.seqlen_q, s.seqlen_k, s.head_dim, Br, Bc, s.causal,
                                     s.dtype_bytes)
            if kernel is not None:
                tiles.append({"pass": p, "kernel": kernel, "block_r": Br, "block_c": Bc})
    out = record.scaled(s.batch * s.heads)
    out.label = f"{algo} {s.passes}"
    return out, tiles


def tiles_fit(tiles, s):
    """False if some kernel's tiles need more shared memory than the profile has (only
    kernels whose layout sim/tiles.py knows are checked)."""
    for t in tiles:
        try:
            need = smem_bytes(t["kernel"], t["block_r"], t["block_c"], s.head_dim)
        except ValueError:
            continue
        if need > s.device().smem_per_block:
            return False
    return True


def smem_elements(s):
    """M of the asymptotic form: shared memory per block in fp32 elements, since pyfa's
    kernels keep their tiles in fp32 whatever dtype_bytes the count assumes."""
    return s.device().smem_per_block // FLOAT_BYTES


def asymptotic(algo, s):
    """The papers' asymptotic HBM access, evaluated with every hidden constant set to 1,
    once per pass: standard Theta(N d + N^2) as e*B*H*(Nq*d + Nq*Nk) bytes,
    FlashAttention Theta(N^2 d^2 / M) as e*B*H*Nq*Nk*d^2/M bytes."""
    e, BH, Nq, Nk, d = s.dtype_bytes, s.batch * s.heads, s.seqlen_q, s.seqlen_k, s.head_dim
    n = len(_wanted_passes(s.passes))
    if algo == "standard":
        return {"form": "Θ(Nd + N²)", "evaluated_as": "e·B·H·(Nq·d + Nq·Nk) per pass",
                "bytes": n * e * BH * (Nq * d + Nq * Nk)}
    M = smem_elements(s)
    return {"form": "Θ(N²d²/M)", "evaluated_as": f"e·B·H·Nq·Nk·d²/M per pass, M = {M}",
            "bytes": n * e * BH * Nq * Nk * d * d / M}


def _check_setup(s):
    for name in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "dtype_bytes"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if s.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim: must be in [1, {MAX_HEAD_DIM}], got {s.head_dim}")
    for name in ("block_r", "block_c"):
        value = getattr(s, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if s.passes not in PASS_WORDS:
        raise ValueError(f"passes: expected one of {list(PASS_WORDS)}, got {s.passes!r}")
    if s.profile not in PROFILES:
        raise ValueError(f"profile: expected one of {list(PROFILES)}, got {s.profile!r}")
    bad = [p for p in s.standard_passes if p not in PASS_NAMES]
    if bad:
        raise ValueError(f"standard passes: unknown {bad}; known: {list(PASS_NAMES)}")
    known = available_algorithms()
    bad = [a for a in (s.algos or []) if a not in known]
    if bad:
        raise ValueError(f"algos: unknown {bad}; known now: {known}")
    if "standard" not in known:
        raise ValueError("the standard model is not registered in count.WALKERS")


# ---------------------------------------------------------------- the report dict

def build_report(s, preset=None):
    """The report as a JSON-able dict: per algorithm its record, totals, ratio to the
    standard model and asymptotic form, and the notes."""
    _check_setup(s)
    dev = s.device()
    standard, _ = count("standard", s)
    algos, skipped = [], []
    for algo in (s.algos or available_algorithms()):
        missing = missing_passes(algo, s.passes)
        if algo != "standard" and missing:
            skipped.append({"name": algo,
                            "reason": f"no {' or '.join(missing)} walker registered yet"})
            continue
        record, tiles = count(algo, s)
        asym = asymptotic(algo, s)
        asym["counted_over_form"] = record.total / asym["bytes"]
        algos.append({
            "name": algo,
            "passes": s.passes,
            "tiles": tiles,
            "tiles_fit_profile": tiles_fit(tiles, s),
            "reads": dict(record.reads),
            "writes": dict(record.writes),
            "total_reads": record.total_reads,
            "total_writes": record.total_writes,
            "total": record.total,
            "vs_standard": record.total / standard.total,
            "asymptotic": asym,
        })
    if not algos:
        raise ValueError(f"algos: none of {[x['name'] for x in skipped]} can be counted for "
                         f"passes {s.passes!r}")
    info = PRESETS.get(preset, {})
    paper = info.get("paper")
    if paper:
        # The paper's numbers belong to its problem and passes; compare only on those.
        same = ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "passes")
        if any(getattr(s, k) != getattr(info["setup"], k) for k in same):
            paper = None
    report = {
        "title": "pyfa HBM-IO report" + (f": preset {preset}" if preset else ""),
        "preset": preset,
        "description": info.get("description"),
        "problem": {k: getattr(s, k) for k in ("batch", "heads", "seqlen_q", "seqlen_k",
                                               "head_dim", "causal", "dtype_bytes")},
        "passes": s.passes,
        "profile": {"name": dev.name, "smem_per_block": dev.smem_per_block,
                    "M_fp32_elements": smem_elements(s)},
        "block_r": s.block_r,
        "block_c": s.block_c,
        "standard_passes": list(s.standard_passes),
        "standard_steps": _standard_steps(s),
        "algorithms": algos,
        "skipped": skipped,
        "paper": paper,
    }
    report["notes"] = notes(report, s)
    return report


def _standard_steps(s):
    """The standard model's step list with bytes for the whole batch."""
    opts = {f"{p}_pass": p in s.standard_passes for p in PASS_NAMES}
    rows = []
    for p in _wanted_passes(s.passes):
        make = forward_steps if p == "forward" else backward_steps
        for step in make(s.seqlen_q, s.seqlen_k, s.head_dim, **opts):
            f = s.dtype_bytes * s.batch * s.heads
            rows.append({"pass": p, "step": step.name,
                         "read": sum(n for _, n in step.reads) * f,
                         "written": sum(n for _, n in step.writes) * f})
    return rows


def _by_name(report, name):
    return next((a for a in report["algorithms"] if a["name"] == name), None)


def notes(report, s):
    """Short paragraphs on why the counted bytes differ from the paper's measured ones."""
    out = []
    std = _by_name(report, "standard")
    flash = [a for a in report["algorithms"] if a["name"] != "standard"]
    e = s.dtype_bytes
    other_e = 4 if e != 4 else 2
    alt = replace(s, dtype_bytes=other_e)
    alt_std = count("standard", alt)[0].total
    alt_flash = ", ".join(f"{a['name']} {gb(count(a['name'], alt)[0].total)}" for a in flash)
    out.append(("Element size",
                f"The paper's kernels and its measured numbers used fp16 tensors (2 bytes per "
                f"element); pyfa's kernels compute in fp32 (4 bytes). This report counts "
                f"tensors at {e} bytes per element; per-row statistics (LSE, m, l, D) stay at "
                f"4 bytes whatever the tensors' size, as implementations keep them in fp32. At "
                f"{other_e} bytes per element the same problem counts standard "
                f"{gb(alt_std)}" + (f", {alt_flash}." if alt_flash else ".")))

    base = replace(s, standard_passes=())
    base_total = count("standard", base)[0].total
    if std is not None:
        if s.standard_passes:
            per_pass = (std["total"] - base_total) / len(s.standard_passes)
            passes_text = (f"the {', '.join(s.standard_passes)} passes modelled as separate "
                           f"kernels, each reading and writing an Nq×Nk matrix once per "
                           f"direction ({gb(per_pass)} each here); without them the model "
                           f"counts {gb(base_total)}")
        else:
            one = count("standard", replace(s, standard_passes=("scale",)))[0].total
            passes_text = (f"scale and mask folded into the matmul and softmax, no dropout "
                           f"(add them with --standard-passes scale,mask,dropout: each adds "
                           f"{gb(one - base_total)})")
        out.append(("Which passes are counted",
                    f"The standard model is an unfused pipeline, step by step: S = QKᵀ, "
                    f"softmax, O = PV, and in the backward dV, dP, softmax's backward, dQ and "
                    f"dK, every N×N intermediate written to HBM and read back (sim/standard.py), "
                    f"with {passes_text}. A framework moves more than this model: the bool mask "
                    f"and dropout's random mask, workspace, and reductions that re-read rows. "
                    f"The paper measured a whole attention block in a real framework, and the "
                    f"FlashAttention kernels it measured fused masking and dropout; pyfa's "
                    f"kernels have no dropout. Neither side counts the QKV projections."))
    if s.causal:
        out.append(("Causal masking",
                    "The FlashAttention walkers skip K/V tiles that are fully masked (about "
                    "half of them for Nq = Nk), as the kernels do; the unfused model still "
                    "writes and reads the full Nq×Nk matrices, masked entries included, as a "
                    "framework without a fused kernel does."))
    if flash:
        tiles = "; ".join(f"{a['name']}: " + ", ".join(dict.fromkeys(  # unique, in order
            f"{t['kernel']} {t['block_r']}×{t['block_c']}" for t in a["tiles"]))
            for a in flash if a["tiles"])
        out.append(("Tiles",
                    f"FlashAttention's bytes depend on its tiles: FA1 re-reads Q, O and the "
                    f"row statistics once per K/V block; FA2's forward re-reads K and V once "
                    f"per Q row block, its backward Q and dO once per K/V block (dK/dV kernel) "
                    f"and K and V once per Q row block (dQ kernel). These counts use "
                    f"{tiles or 'no tiles'}; the paper's A100 kernels "
                    f"used their own, so their re-read counts differ (`python -m pyfa.sim "
                    f"sweep --over bc` shows the dependence)."))
    out.append(("Caches",
                "This is a pure HBM model: every load and store is charged to HBM. On a GPU "
                "the L2 cache (40 MB on an A100, 50 MB on an H100) absorbs part of the "
                "traffic: FlashAttention's K/V tiles re-read by neighbouring row blocks, and "
                "in the unfused pipeline part of an N×N matrix read back right after it was "
                "written. DRAM bytes measured with Nsight Compute are therefore lower than "
                "these counts, the more so the more a kernel re-reads."))
    paper = report.get("paper")
    example = paper["standard_bytes"] if paper else 40.3e9
    out.append(("Units",
                f"GB here is 10⁹ bytes and GiB 2³⁰ bytes; the paper reports GB. For example "
                f"{example / 1e9:.1f} GB = {example / 2**30:.1f} GiB."))
    return [{"title": t, "text": x} for t, x in out]


# ---------------------------------------------------------------- formatting

def gb(nbytes):
    """Bytes in the decimal unit that suits them (GB for the problems of the papers)."""
    unit, size = _unit(nbytes)
    return f"{_num(nbytes, size)} {unit}"


UNIT_SIZES = {"GB": "10⁹", "MB": "10⁶", "kB": "10³", "GiB": "2³⁰", "MiB": "2²⁰", "KiB": "2¹⁰",
              "B": "1"}


def _unit(largest):
    """A decimal unit for a table whose largest entry is `largest` bytes."""
    for name, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= size:
            return name, size
    return "B", 1


def _binary_unit(largest):
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def _num(x, size):
    return f"{x / size:,.3f}" if size > 1 else f"{int(x):,}"


def _problem_line(r):
    p = r["problem"]
    n = (f"Nq=Nk={p['seqlen_q']}" if p["seqlen_q"] == p["seqlen_k"]
         else f"Nq={p['seqlen_q']} Nk={p['seqlen_k']}")
    dt = {2: " (fp16)", 4: " (fp32)"}.get(p["dtype_bytes"], "")
    return (f"B={p['batch']} H={p['heads']} {n} d={p['head_dim']}, "
            f"{'causal' if p['causal'] else 'not causal'}, tensors at {p['dtype_bytes']} "
            f"bytes{dt}, {PASS_WORDS[r['passes']]}")


def _tiles_text(a):
    if a["name"] == "standard":
        return "unfused, no tiles"
    text = ", ".join(f"{t['kernel']} {t['block_r']}×{t['block_c']}" for t in a["tiles"])
    return text + ("" if a["tiles_fit_profile"] else " (exceeds the profile's shared memory)")


def _tensor_rows(a):
    names = list(a["reads"]) + [n for n in a["writes"] if n not in a["reads"]]
    return [(n, a["reads"].get(n, 0), a["writes"].get(n, 0)) for n in names]


def _table(header, rows, align):
    """A plain text table; align is a string of 'l'/'r' per column."""
    cells = [header] + rows
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if a == "l" else str(c).rjust(w)
                              for c, w, a in zip(r, widths, align))
    lines = [fmt(header), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return lines


def _md_table(header, rows, align):
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def _sections(r, steps=False):
    """The report as (kind, title, payload) sections, shared by text and markdown."""
    largest = max(a["total"] for a in r["algorithms"])
    unit, size = _unit(largest)
    bunit, bsize = _binary_unit(largest)
    secs = []
    meta = [("problem", _problem_line(r)),
            ("device", f"{r['profile']['name']}: {r['profile']['smem_per_block'] // 1024} KiB "
                       f"shared memory per block, M = {r['profile']['M_fp32_elements']} fp32 "
                       f"elements"),
            ("standard", "unfused" + (f", with {', '.join(r['standard_passes'])} passes"
                                      if r["standard_passes"] else ", no elementwise passes"))]
    if r["description"]:
        meta.insert(0, ("preset", r["description"]))
    secs.append(("meta", None, meta))
    if steps:
        rows = [(x["pass"], x["step"], _num(x["read"], size), _num(x["written"], size))
                for x in r["standard_steps"]]
        secs.append(("table", "Standard model, step by step",
                     (["pass", "step", f"read {unit}", f"written {unit}"], rows, "llrr")))
    for a in r["algorithms"]:
        rows = [(n, _num(rd, size), _num(wr, size), _num(rd + wr, size),
                 f"{100 * (rd + wr) / a['total']:.1f}%") for n, rd, wr in _tensor_rows(a)]
        rows.append(("total", _num(a["total_reads"], size), _num(a["total_writes"], size),
                     _num(a["total"], size), "100.0%"))
        secs.append(("table", f"{a['name']}: {PASS_WORDS[a['passes']]} ({_tiles_text(a)})",
                     (["tensor", f"read {unit}", f"written {unit}", f"total {unit}", "share"],
                      rows, "lrrrr")))
    rows = []
    for a in r["algorithms"]:
        ratio = a["vs_standard"]
        if a["name"] == "standard":
            vs = "1"
        elif ratio <= 1:
            vs = f"{ratio:.3f} ({1 / ratio:.1f}× less)"
        else:
            vs = f"{ratio:.3f} ({ratio:.1f}× more)"
        asym = a["asymptotic"]
        rows.append((a["name"], _num(a["total"], size), _num(a["total"], bsize), vs,
                     asym["form"], _num(asym["bytes"], size), f"{asym['counted_over_form']:.1f}"))
    secs.append(("table", f"Totals ({unit} = {UNIT_SIZES[unit]} bytes, "
                           f"{bunit} = {UNIT_SIZES[bunit]} bytes)",
                 (["algorithm", f"total {unit}", f"total {bunit}", "vs standard",
                   "asymptotic form", f"form {unit}", "counted / form"], rows, "lrrrlrr")))
    forms = sorted({(a["asymptotic"]["form"], a["asymptotic"]["evaluated_as"])
                    for a in r["algorithms"]}, key=lambda f: f[0] != "Θ(Nd + N²)")
    secs.append(("text", None,
                 "Asymptotic forms (FlashAttention paper, Theorem 2 and its backward "
                 "counterpart) are evaluated with every hidden constant set to 1: "
                 + "; ".join(f"{f} as {ev}" for f, ev in forms)
                 + ". Θ hides constants, so the counted/form ratio is not expected to be 1."))
    if r["skipped"]:
        secs.append(("text", None, "Not shown: " + "; ".join(
            f"{x['name']} ({x['reason']})" for x in r["skipped"]) + "."))
    if r["paper"]:
        p = r["paper"]
        rows = []
        for a in r["algorithms"]:
            paper = p["standard_bytes"] if a["name"] == "standard" else p["flashattention_bytes"]
            rows.append((a["name"], f"{paper / 1e9:.1f}", f"{a['total'] / 1e9:.3f}",
                         f"{a['total'] / paper:.2f}"))
        paper_ratio = p["standard_bytes"] / p["flashattention_bytes"]
        secs.append(("table", f"Against the paper ({p['source']}; FlashAttention moved "
                              f"{paper_ratio:.1f}× less than standard attention there)",
                     (["algorithm", "paper GB", "counted GB", "counted / paper"], rows, "lrrr")))
    secs.append(("notes", "Notes", r["notes"]))
    return secs


def render_text(r, steps=False, width=92):
    out = [r["title"], "=" * len(r["title"])]
    for kind, title, payload in _sections(r, steps):
        if kind == "meta":
            w = max(len(k) for k, _ in payload)
            for k, v in payload:
                wrapped = textwrap.wrap(v, width - w - 2)
                out.append(f"{k:<{w}}  {wrapped[0]}")
                out += [" " * (w + 2) + line for line in wrapped[1:]]
        elif kind == "table":
            out += [""] + textwrap.wrap(title, width) + _table(*payload)
        elif kind == "text":
            out += [""] + textwrap.wrap(payload, width)
        elif kind == "notes":
            out += ["", title]
            for n in payload:
                out += [""] + textwrap.wrap(f"{n['title']}. {n['text']}", width)
    return "\n".join(out) + "\n"


def render_markdown(r, steps=False):
    out = [f"# {r['title']}", ""]
    for kind, title, payload in _sections(r, steps):
        if kind == "meta":
            out += [f"- **{k}**: {v}" for k, v in payload]
        elif kind == "table":
            out += ["", f"**{title}**", ""] + _md_table(*payload)
        elif kind == "text":
            out += ["", payload]
        elif kind == "notes":
            out += ["", f"## {title}"]
            for n in payload:
                out += ["", f"**{n['title']}.** {n['text']}"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- sweeps

SWEEP_DEFAULTS = {"bc": [8, 16, 32, 64, 128, 256], "br": [8, 16, 32, 64, 128, 256],
                  "n": [256, 512, 1024, 2048, 4096, 8192, 16384]}
SWEEP_LABELS = {"bc": "Bc (K/V tile rows)", "br": "Br (Q tile rows)", "n": "N = Nq = Nk"}


class Progress:
    """A one-line progress bar on stderr; silent when disabled."""

    def __init__(self, total, label, enabled, stream=None):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()

    def step(self, what=""):
        self.done += 1
        if not self.enabled:
            return
        filled = 30 * self.done // self.total
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] "
                          f"{self.done}/{self.total} {elapsed:5.1f}s {what:<24}")
        self.stream.flush()

    def close(self):
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def run_sweep(s, over, values, progress=False):
    """Total bytes of each algorithm at each value of Bc, Br or N (the rest from `s`)."""
    if over not in SWEEP_DEFAULTS:
        raise ValueError(f"over: expected one of {list(SWEEP_DEFAULTS)}, got {over!r}")
    _check_setup(s)
    algos = [a for a in (s.algos or available_algorithms())
             if a == "standard" or not missing_passes(a, s.passes)]
    if not algos:
        raise ValueError(f"algos: none of {s.algos} can be counted for passes {s.passes!r}")
    bar = Progress(len(values) * len(algos), f"sweep {over}", progress)
    rows = []
    for v in values:
        at = {"bc": dict(block_c=v), "br": dict(block_r=v),
              "n": dict(seqlen_q=v, seqlen_k=v)}[over]
        sv = replace(s, **at)
        _check_setup(sv)
        row = {"value": v, "bytes": {}, "fits": {}}
        for a in algos:
            rec, tiles = count(a, sv)
            row["bytes"][a] = rec.total
            row["fits"][a] = tiles_fit(tiles, sv)
            bar.step(f"{over}={v} {a}")
        rows.append(row)
    bar.close()
    return {"over": over, "label": SWEEP_LABELS[over], "algorithms": algos,
            "setup": {k: (list(x) if isinstance(x, tuple) else x) for k, x in asdict(s).items()},
            "problem_line": _problem_line({"problem": {**asdict(s), **(  # N is what varies
                dict(seqlen_q="N", seqlen_k="N") if over == "n" else {})}, "passes": s.passes}),
            "profile": s.device().name, "rows": rows}


def _sweep_table(sw):
    largest = max(max(r["bytes"].values()) for r in sw["rows"])
    unit, size = _unit(largest)
    header = ["N" if sw["over"] == "n" else {"bc": "Bc", "br": "Br"}[sw["over"]]]
    header += [f"{a} {unit}" for a in sw["algorithms"]]
    rows = [[str(r["value"])] + [_num(r["bytes"][a], size) + ("" if r["fits"][a] else "*")
                                 for a in sw["algorithms"]] for r in sw["rows"]]
    return header, rows, "r" * len(header)


def _sweep_footer(sw):
    fixed = {"bc": "Br", "br": "Bc", "n": "tiles"}[sw["over"]]
    s = sw["setup"]
    tile = {"bc": s["block_r"], "br": s["block_c"]}.get(sw["over"])
    text = (f"{sw['problem_line']}; {fixed}: "
            + (str(tile) if tile else "each kernel's default") + f"; profile {sw['profile']}.")
    if any(not ok for r in sw["rows"] for ok in r["fits"].values()):
        text += " * : these tiles exceed the profile's shared memory (counted anyway)."
    return text


def render_sweep_text(sw, width=92):
    title = f"HBM bytes against {sw['label']}"
    out = [title, "=" * len(title)] + _table(*_sweep_table(sw))
    return "\n".join(out + [""] + textwrap.wrap(_sweep_footer(sw), width)) + "\n"


def render_sweep_markdown(sw):
    out = [f"# HBM bytes against {sw['label']}", ""] + _md_table(*_sweep_table(sw))
    return "\n".join(out + ["", _sweep_footer(sw)]) + "\n"


def plot_sweep(sw, path):
    """Writes the sweep as a PNG (needs matplotlib: pip install "pyfa[report]")."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        raise SystemExit('--plot needs matplotlib: pip install "pyfa[report]" '
                         '(or pip install matplotlib)') from None
    xs = [r["value"] for r in sw["rows"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for a in sw["algorithms"]:
        gbs = [r["bytes"][a] / 1e9 for r in sw["rows"]]
        line, = ax.plot(xs, gbs, marker="o", label=a, linestyle="--" if a == "standard" else "-")
        # Hollow markers: tiles that exceed the profile's shared memory (the table's *).
        over = [(x, y) for x, y, r in zip(xs, gbs, sw["rows"]) if not r["fits"][a]]
        if over:
            ax.plot(*zip(*over), linestyle="none", marker="o", color=line.get_color(),
                    markerfacecolor="white")
    ax.set_xscale("log", base=2)
    ys = [b for r in sw["rows"] for b in r["bytes"].values()]
    if max(ys) > 20 * min(ys):  # a log axis only where the values span decades
        ax.set_yscale("log")
        # Ticks at 1, 2, 5 x 10^k, written as plain numbers.
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0, top=1.1 * max(ys) / 1e9)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel(sw["label"])
    ax.set_ylabel("HBM bytes read + written (GB, 10⁹)")
    ax.set_title(f"HBM bytes against {sw['label']}", fontsize=11)
    footer = _sweep_footer(sw).replace("* : these tiles", "Hollow markers: tiles")
    ax.text(0.01, -0.22, textwrap.fill(footer, 100), transform=ax.transAxes,
            fontsize=6.5, va="top")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------- command line

def _int_list(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")


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
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None)
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


def setup_from_args(args):
    preset = PRESETS[args.preset]["setup"] if args.preset else Setup()
    given = {
        "batch": args.batch, "heads": args.heads, "seqlen_q": args.seqlen_q or args.seqlen,
        "seqlen_k": args.seqlen_k or args.seqlen, "head_dim": args.head_dim,
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
    sp.add_argument("--progress", action="store_true", default=None,
                    help="show a progress bar (default: when stderr is a terminal)")
    args = ap.parse_args(argv)

    try:
        s = setup_from_args(args)
        if args.command == "report":
            r = build_report(s, preset=args.preset)
            if args.format == "json":
                text = json.dumps(r, indent=2, ensure_ascii=False) + "\n"
            elif args.format == "markdown":
                text = render_markdown(r, steps=args.steps)
            else:
                text = render_text(r, steps=args.steps)
        else:
            progress = args.progress if args.progress is not None else sys.stderr.isatty()
            sw = run_sweep(s, args.over, args.values or SWEEP_DEFAULTS[args.over], progress)
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
