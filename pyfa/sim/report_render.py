"""The HBM-IO report's rendering: the report and sweep dicts of pyfa/sim/report_model.py as
text, Markdown or a PNG plot. Nothing here counts; it only formats."""

import textwrap

PASS_WORDS = {"forward": "forward", "backward": "backward", "both": "forward + backward"}


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


def _mask_words(p):
    """The mask of a problem dict in words: causal or not, the window, the alignment."""
    window = p.get("window")
    if not p["causal"] and window is None:
        return "no mask"
    parts = []
    if p["causal"]:
        parts.append("causal")
    if window is not None:
        side = lambda x: "∞" if x is None else str(x)
        parts.append(f"window ({side(window[0])}, {side(window[1])})")
    align = p.get("causal_align", "bottom_right").replace("_", "-")
    return " + ".join(parts) + f", {align} aligned"


def _problem_line(r):
    p = r["problem"]
    n = (f"Nq=Nk={p['seqlen_q']}" if p["seqlen_q"] == p["seqlen_k"]
         else f"Nq={p['seqlen_q']} Nk={p['seqlen_k']}")
    hkv = p.get("heads_kv")
    heads = f"H={p['heads']}" + (f" Hkv={hkv}" if hkv not in (None, p["heads"]) else "")
    dt = {2: " (fp16)", 4: " (fp32)"}.get(p["dtype_bytes"], "")
    return (f"B={p['batch']} {heads} {n} d={p['head_dim']}, {_mask_words(p)}, tensors at "
            f"{p['dtype_bytes']} bytes{dt}, {PASS_WORDS[r['passes']]}")


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
    dec = r.get("decode")
    if dec:
        rows = [("floor", _num(dec["floor_bytes_per_token"], 1e6), "1.000", "—", "—")]
        for a in dec["algorithms"]:
            rows.append((a["name"], _num(a["bytes_per_token"], 1e6), f"{a['over_floor']:.3f}",
                         _num(a["kv_rereads_bytes_per_token"], 1e6), _num(a["partials_bytes_per_token"], 1e6)))
            if a["kv_rereads_bytes_per_token"]:
                rows.append((f"{a['name']}, K/V once per group",
                             _num(a["bytes_per_token"] - a["kv_rereads_bytes_per_token"], 1e6),
                             f"{a['grouped_over_floor']:.3f}", "0", _num(a["partials_bytes_per_token"], 1e6)))
        split = f"split_size {dec['split_size']}" if dec["split_size"] else "no split-KV"
        secs.append(("table", f"Decoding: bytes per generated token ({dec['tokens_per_step']} tokens per step, "
                              f"{split}; MB = 10⁶ bytes; the floor: the visible K and V once per K/V "
                              f"head, plus q and o; target 1.05× the floor)",
                     (["kernel", "MB per token", "× floor", "K/V re-reads MB", "split partials MB"],
                      rows, "lrrrr")))
    if r["skipped"]:
        secs.append(("text", None, "Not shown: " + "; ".join(
            f"{x['name']} ({x['reason']})" for x in r["skipped"]) + "."))
    if r["paper"]:
        p = r["paper"]
        rows = []
        measured = {"standard": p["standard_bytes"],
                    p["flashattention_algorithm"]: p["flashattention_bytes"]}
        for a in r["algorithms"]:
            paper = measured.get(a["name"])
            rows.append((a["name"], "—" if paper is None else f"{paper / 1e9:.1f}",
                         f"{a['total'] / 1e9:.3f}",
                         "—" if paper is None else f"{a['total'] / paper:.2f}"))
        paper_ratio = p["standard_bytes"] / p["flashattention_bytes"]
        secs.append(("table", f"Against the paper ({p['source']}; FlashAttention, which is "
                              f"{p['flashattention_algorithm']}, moved {paper_ratio:.1f}× "
                              f"less than standard attention there; — : not in the paper)",
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
    """Writes the sweep as a PNG (needs matplotlib: pip install ".[report]" at a pyfa
    checkout's root, or pip install matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        raise SystemExit('--plot needs matplotlib: pip install matplotlib (or pip install '
                         '".[report]" at a pyfa checkout\'s root)') from None
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
