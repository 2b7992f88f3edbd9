"""The HBM-IO report's model: for one attention problem, the bytes each algorithm moves
through HBM, per tensor (pyfa/sim/count.py's count_kernels on the chosen device profile, and
the unfused standard model of pyfa/sim/standard.py), beside the papers' asymptotic forms and,
for the GPT-2 medium preset, the FlashAttention paper's measured numbers, with notes on
why they differ; and sweeps of the same over Bc, Br or N.

Everything is a plain JSON-able dict (what --format json prints); pyfa/sim/report_render.py
formats it and pyfa/sim/report.py is the command line.
"""

from dataclasses import asdict, dataclass, replace

import numpy as np

from ..errors import InvalidArgumentError
from . import count as count_mod
from ..checks import MAX_HEAD_DIM
from .mask import Mask, check_causal_align, check_window
from .report_render import PASS_WORDS, _problem_line, gb
from .standard import PASS_NAMES, backward_steps, count_standard_io, forward_steps
from .tiles import EMU_PROFILE, FLOAT_BYTES, DeviceProfile, fa2_launch, resolve_tiles, smem_bytes

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
    # The paper's FlashAttention is FA1 (its Algorithms 1 and 4); FA2 came a year later
    # and has no figure there, so only fa1's bytes are set beside 4.4 GB.
    "flashattention_algorithm": "fa1",
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
    heads_kv: object = None           # K/V heads; None: heads
    window: object = None             # (left, right), each an int >= 0 or None; None: none
    causal_align: str = "bottom_right"
    split_size: object = None         # FA2 forward's split-KV (keys per chunk); None: one chunk

    def device(self):
        p = PROFILES[self.profile]
        if self.smem_kib is not None:
            p = replace(p, name=f"{p.name}, shared memory overridden",
                        smem_per_block=int(self.smem_kib) * 1024)
        return p

    def kv_heads(self):
        return self.heads if self.heads_kv is None else self.heads_kv


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
    "gqa": dict(
        description="a grouped-query model (LLaMA-style): B=1, H=32 query heads sharing "
                    "Hkv=8 K/V heads, N=4096, d=128, causal, fp32, forward + backward; "
                    "standard attention repeats K and V out to 32 heads (repeat_kv)",
        setup=Setup(batch=1, heads=32, heads_kv=8, seqlen_q=4096, seqlen_k=4096, head_dim=128,
                    causal=True, dtype_bytes=4, passes="both"),
        paper=None),
    "sliding-window": dict(
        description="a sliding-window model (Mistral-style): B=1, H=32, Hkv=8, N=16384, "
                    "d=128, causal with a window of 4096 keys to the left, fp32, "
                    "forward + backward",
        setup=Setup(batch=1, heads=32, heads_kv=8, seqlen_q=16384, seqlen_k=16384,
                    head_dim=128, causal=True, window=(4096, 0), dtype_bytes=4,
                    passes="both"),
        paper=None),
    "decode": dict(
        description="one decoding step of a grouped-query model (Llama-3-8B-like): B=16 "
                    "sequences, one new query each (Nq=1), H=32 query heads sharing Hkv=8 K/V "
                    "heads, context 32768, d=128, fp32, forward only, FA2 with split-KV "
                    "(split_size 256, pyfa's 'decode' constant for d=128); the bytes per "
                    "generated token beside the floor (the visible K and V once, plus q and o)",
        setup=Setup(batch=16, heads=32, heads_kv=8, seqlen_q=1, seqlen_k=32768, head_dim=128,
                    causal=True, dtype_bytes=4, passes="forward", split_size=256),
        paper=None),
}


# ---------------------------------------------------------------- counting

def available_algorithms():
    """Algorithms in WALKERS right now, standard first, then by name."""
    names = {a for a, _ in count_mod.WALKERS}
    return sorted(names, key=lambda a: (a != "standard", a))


def _wanted_passes(passes):
    return ["forward", "backward"] if passes == "both" else [passes]


def missing_passes(algo, passes):
    return [p for p in _wanted_passes(passes) if (algo, p) not in count_mod.WALKERS]


def _mask_args(s):
    return dict(heads_kv=s.heads_kv, causal=s.causal, window=s.window,
                causal_align=s.causal_align)


def count(algo, s):
    """(IORecord for the whole batch, [tiles per kernel]) of `algo` under setup `s`:
    count_kernels on the setup's profile; the standard model goes through
    count_standard_io, which knows the optional elementwise passes."""
    if algo == "standard":
        opts = {f"{p}_pass": p in s.standard_passes for p in PASS_NAMES}
        rec = count_standard_io(passes=s.passes, batch=s.batch, heads=s.heads,
                                seqlen_q=s.seqlen_q, seqlen_k=s.seqlen_k, head_dim=s.head_dim,
                                dtype_bytes=s.dtype_bytes, **_mask_args(s), **opts)
        return rec, []
    return count_mod.count_kernels(algo, passes=s.passes, batch=s.batch, heads=s.heads,
                                   seqlen_q=s.seqlen_q, seqlen_k=s.seqlen_k,
                                   head_dim=s.head_dim, block_r=s.block_r, block_c=s.block_c,
                                   dtype_bytes=s.dtype_bytes, profile=s.device(),
                                   split_size=s.split_size if algo == "fa2" else None,
                                   **_mask_args(s))


def decode_floor(s):
    """The least a decoding step can move: every visible key's K and V row once (each K/V
    head's, not each query head's), plus q read and o written (per-row statistics
    not counted). Per query row of the step, Nq * B of them: the generated tokens."""
    e, B, H, Hkv, Nq, d = s.dtype_bytes, s.batch, s.heads, s.kv_heads(), s.seqlen_q, s.head_dim
    mask = Mask.resolve(s.causal, s.window, s.causal_align, Nq, s.seqlen_k)
    hidden = mask.masked(np.arange(Nq)[:, None], np.arange(s.seqlen_k)[None, :])  # (Nq, Nk)
    keys = int(np.count_nonzero(~hidden.all(axis=0)))  # keys some row sees
    return e * B * (2 * Hkv * keys * d + 2 * H * Nq * d)


def decode_section(report, s):
    """Bytes per generated token of each FlashAttention algorithm beside the floor, and
    where each one's excess goes: GQA's re-reads of K and V (one block per query head) and
    split-KV's partial O and LSE (written, then read back by the combine step)."""
    tokens = s.batch * s.seqlen_q
    floor = decode_floor(s)
    G = s.heads // s.kv_heads()
    rows = []
    for a in report["algorithms"]:
        if a["name"] == "standard":
            continue
        kv = a["reads"].get("K", 0) + a["reads"].get("V", 0)
        kv_floor = floor - s.dtype_bytes * s.batch * 2 * s.heads * s.seqlen_q * s.head_dim
        partials = sum(n for t, n in list(a["reads"].items()) + list(a["writes"].items()) if "partials" in t)
        rows.append({"name": a["name"], "bytes_per_token": a["total"] / tokens,
                     "over_floor": a["total"] / floor,
                     "kv_rereads_bytes_per_token": (kv - kv_floor) / tokens,
                     "partials_bytes_per_token": partials / tokens,
                     # The same kernel with each K/V tile read once for its group (the cpu
                     # backend's forward_group): the floor plus the partials and LSE.
                     "grouped_over_floor": (a["total"] - (kv - kv_floor)) / floor})
    dev = s.device()
    Br, Bc = resolve_tiles("fa2_forward", s.head_dim, s.block_r, s.block_c, dev)
    split = count_mod._kernel_split(s.split_size, s.head_dim, "fa2_forward", Br, Bc)
    qg, _ = fa2_launch(s.batch, s.heads, s.kv_heads(), s.seqlen_q, s.seqlen_k, Br, split, s.block_r, dev)
    return {"tokens_per_step": tokens, "floor_bytes_per_token": floor / tokens, "G": G,
            "split_size": s.split_size, "algorithms": rows,
            "fa2_packs": qg > 1}


def tiles_fit(tiles, s):
    """False if some kernel's tiles need more shared memory than the profile has (only
    kernels whose layout pyfa/sim/tiles.py knows are checked)."""
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
            raise InvalidArgumentError(f"{name}: expected an int >= 1, got {value!r}")
    if s.head_dim > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"head_dim: must be in [1, {MAX_HEAD_DIM}], got {s.head_dim}")
    for name in ("block_r", "block_c"):
        value = getattr(s, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidArgumentError(f"{name}: expected an int >= 1, got {value!r}")
    if s.heads_kv is not None:
        count_mod.check_heads_kv(s.heads_kv, s.heads)
    check_window(s.window)
    check_causal_align(s.causal_align)
    if s.passes not in PASS_WORDS:
        raise InvalidArgumentError(f"passes: expected one of {list(PASS_WORDS)}, got {s.passes!r}")
    if s.profile not in PROFILES:
        raise InvalidArgumentError(f"profile: expected one of {list(PROFILES)}, got {s.profile!r}")
    bad = [p for p in s.standard_passes if p not in PASS_NAMES]
    if bad:
        raise InvalidArgumentError(f"standard passes: unknown {bad}; known: {list(PASS_NAMES)}")
    known = available_algorithms()
    bad = [a for a in (s.algos or []) if a not in known]
    if bad:
        raise InvalidArgumentError(f"algos: unknown {bad}; known now: {known}")
    if "standard" not in known:
        raise InvalidArgumentError("the standard model is not registered in count.WALKERS")


# ---------------------------------------------------------------- the report dict

def report_steps(s):
    """How many times build_report calls its on_step: the standard model, then each
    algorithm asked for (counted or skipped)."""
    return 1 + len(s.algos or available_algorithms())


def build_report(s, preset=None, on_step=None):
    """The report as a JSON-able dict: per algorithm its record, totals, ratio to the
    standard model and asymptotic form, and the notes. on_step(text), if given, is called
    after each count, report_steps(s) times (the command line's progress)."""
    _check_setup(s)
    step = on_step or (lambda text: None)
    dev = s.device()
    standard, _ = count("standard", s)
    step("standard model")
    algos, skipped = [], []
    for algo in (s.algos or available_algorithms()):
        missing = missing_passes(algo, s.passes)
        if algo != "standard" and missing:
            skipped.append({"name": algo,
                            "reason": f"no {' or '.join(missing)} walker registered yet"})
            step(f"{algo} (skipped)")
            continue
        record, tiles = count(algo, s)
        step(algo)
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
        raise InvalidArgumentError(f"algos: none of {[x['name'] for x in skipped]} can be counted for "
                         f"passes {s.passes!r}")
    info = PRESETS.get(preset, {})
    paper = info.get("paper")
    if paper:
        # The paper's numbers belong to its problem and passes; compare only on those.
        same = ("batch", "heads", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "window",
                "passes")
        if any(getattr(s, k) != getattr(info["setup"], k) for k in same):
            paper = None
    report = {
        "title": "pyfa HBM-IO report" + (f": preset {preset}" if preset else ""),
        "preset": preset,
        "description": info.get("description"),
        "problem": {**{k: getattr(s, k) for k in ("batch", "heads", "seqlen_q", "seqlen_k",
                                                  "head_dim", "causal", "dtype_bytes",
                                                  "causal_align")},
                    "heads_kv": s.kv_heads(),
                    "window": None if s.window is None else list(s.window)},
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
        "split_size": s.split_size,
    }
    if preset == "decode" or s.seqlen_q <= 8:
        report["decode"] = decode_section(report, s)
    report["notes"] = notes(report, s)
    return report


def _standard_steps(s):
    """The standard model's step list with bytes for the whole batch."""
    opts = {f"{p}_pass": p in s.standard_passes for p in PASS_NAMES}
    rows = []
    for p in _wanted_passes(s.passes):
        make = forward_steps if p == "forward" else backward_steps
        for step in make(s.seqlen_q, s.seqlen_k, s.head_dim, G=s.heads // s.kv_heads(), **opts):
            f = s.dtype_bytes * s.batch * s.kv_heads()
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
                    f"dK, every N×N intermediate written to HBM and read back (pyfa/sim/standard.py), "
                    f"with {passes_text}. A framework moves more than this model: the bool mask "
                    f"and dropout's random mask, workspace, and reductions that re-read rows. "
                    f"The paper measured a whole attention block in a real framework, and the "
                    f"FlashAttention kernels it measured fused masking and dropout; pyfa's "
                    f"kernels have no dropout. Neither side counts the QKV projections."))
    if s.causal or s.window is not None:
        out.append(("Masking",
                    "The FlashAttention walkers visit, for each tile, only the band of tiles "
                    "on the other side that hold a visible key, as the kernels do (causal: "
                    "about half of them for Nq = Nk; a window of W keys: about (W + tile) / N "
                    "of them), and skip the rest; the unfused model still writes and reads "
                    "the full Nq×Nk matrices, masked entries included, as a framework without "
                    "a fused kernel does. The asymptotic forms assume every key visible."))
    if s.kv_heads() != s.heads:
        G = s.heads // s.kv_heads()
        out.append(("Grouped-query attention",
                    f"{s.heads} query heads share {s.kv_heads()} K/V heads ({G} each). FA2's "
                    f"forward and dQ kernel, and FA1's forward, run one block per query head "
                    f"and read K_j, V_j once per query head; FA2's dK/dV kernel and FA1's "
                    f"backward run one block per K/V head, read K_j, V_j once for the whole "
                    f"group and write dK, dV once, summed over the group on chip. The unfused "
                    f"model copies K and V out to {s.heads} heads first (repeat_kv) and sums "
                    f"dK, dV back at the end."))
    dec = report.get("decode")
    if dec:
        per = "; ".join(f"{r['name']} {gb(r['bytes_per_token'])} per token, {r['over_floor']:.3f}× the floor "
                        f"({gb(r['kv_rereads_bytes_per_token'])} of K/V re-reads, "
                        f"{gb(r['partials_bytes_per_token'])} of split partials"
                        + (f"; with each K/V tile read once for its group {r['grouped_over_floor']:.3f}×)"
                           if r["kv_rereads_bytes_per_token"] else ")") for r in dec["algorithms"])
        packs = ("packs the group's query heads into its blocks here (src/core/tiles.cpp pack_gqa: "
                 "their rows then take fewer Q tiles, and the packed grid still holds 4 blocks per SM "
                 "of the profile), so it reads each K/V tile once per group, as the cpu backend's "
                 "decode path does" if dec["fa2_packs"] else
                 "runs one block per query head here (src/core/tiles.cpp pack_gqa packs a group's "
                 "heads only where their rows then take fewer Q tiles and the packed grid still "
                 "holds 4 blocks per SM of the profile), so each of the "
                 f"{dec['G']} query heads of a group reads K_j and V_j again")
        split = (f"split-KV with {dec['split_size']} keys per chunk: each chunk writes a partial O "
                 f"and LSE of every query row and the combine step reads them back, "
                 f"2·(d + 1)·4 bytes per row and chunk" if dec["split_size"]
                 else "no split-KV (one chunk: no partials)")
        out.append(("Decoding: bytes per generated token",
                    f"A decoding step generates {dec['tokens_per_step']} tokens (one per query row). "
                    f"The floor is every visible key's K and V row read once per K/V head, plus q "
                    f"read and o written: {gb(dec['floor_bytes_per_token'])} per token. {per}. The "
                    f"excess over the floor has two sources: K/V re-reads, where blocks serve one "
                    f"query head each (FA1's forward always; FA2's forward, "
                    f"src/kernels/fa2_forward.cuh, {packs}); and {split}."))
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


# ---------------------------------------------------------------- sweeps

SWEEP_DEFAULTS = {"bc": [8, 16, 32, 64, 128, 256], "br": [8, 16, 32, 64, 128, 256],
                  "n": [256, 512, 1024, 2048, 4096, 8192, 16384]}
SWEEP_LABELS = {"bc": "Bc (K/V tile rows)", "br": "Br (Q tile rows)", "n": "N = Nq = Nk"}


def run_sweep(s, over, values, on_step=None):
    """Total bytes of each algorithm at each value of Bc, Br or N (the rest from `s`);
    on_step(text), if given, is called after each count (the command line's progress)."""
    if over not in SWEEP_DEFAULTS:
        raise InvalidArgumentError(f"over: expected one of {list(SWEEP_DEFAULTS)}, got {over!r}")
    _check_setup(s)
    algos = [a for a in (s.algos or available_algorithms())
             if a == "standard" or not missing_passes(a, s.passes)]
    if not algos:
        raise InvalidArgumentError(f"algos: none of {s.algos} can be counted for passes {s.passes!r}")
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
            if on_step:
                on_step(f"{over}={v} {a}")
        rows.append(row)
    return {"over": over, "label": SWEEP_LABELS[over], "algorithms": algos,
            "setup": {k: (list(x) if isinstance(x, tuple) else x) for k, x in asdict(s).items()},
            "problem_line": _problem_line({"problem": {**asdict(s), **(  # N is what varies
                dict(seqlen_q="N", seqlen_k="N") if over == "n" else {})}, "passes": s.passes}),
            "profile": s.device().name, "rows": rows}
