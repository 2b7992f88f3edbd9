"""The HBM-IO report (pyfa/sim/report_model.py, report_render.py and report.py, the command
line `python -m pyfa.sim`): every registered algorithm's counts against its closed form,
FA1's bytes against Bc, the presets, and the command line (formats, sweeps, plot,
progress bar). Whatever algorithms pyfa/sim/count.py's WALKERS holds are tested; "standard"
and "fa2" must be there."""

import io
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import pyfa
from pyfa.sim import count as count_mod
from pyfa.sim import report, report_model, report_render

WALKED = sorted(count_mod.WALKERS)        # (algo, pass) pairs registered now
ALGOS = report_model.available_algorithms()


def ceil_div(a, b):
    return -(-a // b)


# Closed forms per (algo, pass) for one non-causal head: (bytes read, bytes written) per
# tensor, tensors at e bytes per element, row statistics (LSE, D, m, l) at 4.
def closed_form(algo, p, Nq, Nk, d, Br, Bc, e):
    Tr, Tc = ceil_div(Nq, Br), ceil_div(Nk, Bc)
    NN, q, kv = Nq * Nk * e, Nq * d * e, Nk * d * e
    if (algo, p) == ("standard", "forward"):
        return {"Q": q, "K": kv, "V": kv, "S": NN, "P": NN}, {"S": NN, "P": NN, "O": q}
    if (algo, p) == ("standard", "backward"):
        return {"P": 2 * NN, "dO": 2 * q, "V": kv, "dP": NN, "dS": 2 * NN, "K": kv,
                      "Q": q}, {"dV": kv, "dP": NN, "dS": NN, "dQ": q, "dK": kv}
    if (algo, p) == ("fa2", "forward"):
        # Q once, K and V once per Q row block; O and LSE written once.
        return {"Q": q, "K": Tr * kv, "V": Tr * kv}, {"O": q, "LSE": 4 * Nq}
    if (algo, p) == ("fa2", "backward"):
        # Preprocess: O, dO once, D written. dK/dV kernel: K, V once, Q, dO, LSE, D once
        # per K/V tile. dQ kernel: Q, dO, LSE, D once, K and V once per Q row block.
        return {"O": q, "dO": (Tc + 2) * q, "K": (Tr + 1) * kv, "V": (Tr + 1) * kv,
                      "Q": (Tc + 1) * q, "LSE": (Tc + 1) * 4 * Nq, "D": (Tc + 1) * 4 * Nq}, \
            {"D": 4 * Nq, "dK": kv, "dV": kv, "dQ": q}
    if (algo, p) == ("fa1", "forward"):
        # O, m, l initialized in HBM; K_j, V_j once (outer loop); Q_i, O_i, m_i, l_i read
        # and O_i, m_i, l_i written once per K/V tile.
        return {"K": kv, "V": kv, "Q": Tc * q, "O": Tc * q, "m": Tc * 4 * Nq,
                      "l": Tc * 4 * Nq}, \
            {"O": (Tc + 1) * q, "m": (Tc + 1) * 4 * Nq, "l": (Tc + 1) * 4 * Nq}
    if (algo, p) == ("fa1", "backward"):
        # dQ initialized in HBM; K_j, V_j read and dK_j, dV_j written once (outer loop);
        # Q_i, dO_i, O_i, dQ_i, m_i, l_i read and dQ_i written once per K/V tile.
        return {"K": kv, "V": kv, "Q": Tc * q, "dO": Tc * q, "O": Tc * q,
                      "dQ": Tc * q, "m": Tc * 4 * Nq, "l": Tc * 4 * Nq}, \
            {"dQ": (Tc + 1) * q, "dK": kv, "dV": kv}
    return None


GRID = [(1, 1, 1, 1, 1), (37, 53, 16, 8, 16), (64, 64, 32, 16, 16), (70, 40, 8, 32, 16),
        (40, 70, 8, 5, 7), (256, 256, 64, 32, 64), (1024, 1024, 64, 64, 32),
        (2048, 2048, 64, 32, 32)]


def test_standard_and_fa2_are_registered():
    assert "standard" in ALGOS and "fa2" in ALGOS
    assert ALGOS[0] == "standard"


@pytest.mark.parametrize("algo,p", WALKED)
@pytest.mark.parametrize("Nq,Nk,d,Br,Bc", GRID)
@pytest.mark.parametrize("e", [2, 4])
def test_counts_match_closed_forms(algo, p, Nq, Nk, d, Br, Bc, e):
    form = closed_form(algo, p, Nq, Nk, d, Br, Bc, e)
    if form is None:
        pytest.fail(f"no closed form written for ({algo!r}, {p!r}): add one to this test")
    reads, writes = form
    B, H = 2, 3
    io_ = pyfa.sim.count_io(algo, passes=p, batch=B, heads=H, seqlen_q=Nq, seqlen_k=Nk,
                            head_dim=d, block_r=Br, block_c=Bc, dtype_bytes=e)
    assert io_.reads == {k: v * B * H for k, v in reads.items()}
    assert io_.writes == {k: v * B * H for k, v in writes.items()}


# Causal, Nq = Nk = T*b, Br = Bc = b: tile pairs (i, j) with j <= i are visited, T(T+1)/2
# of them, so each re-read tensor moves T(T+1)/2 tiles (plus what is read once).
CAUSAL_REREADS = {
    ("fa2", "forward"): {"K": 0, "V": 0},
    ("fa2", "backward"): {"K": 1, "V": 1, "Q": 1},  # the dQ kernel / the dK/dV kernel
    ("fa1", "forward"): {"Q": 0},
    ("fa1", "backward"): {"Q": 0},
}


@pytest.mark.parametrize("algo,p", [k for k in WALKED if k[0] != "standard"])
@pytest.mark.parametrize("T,b,d", [(1, 16, 8), (4, 16, 8), (8, 32, 64), (16, 64, 64)])
def test_causal_counts_match_closed_forms(algo, p, T, b, d):
    if (algo, p) not in CAUSAL_REREADS:
        pytest.fail(f"no causal closed form written for ({algo!r}, {p!r}): add one")
    N, e = T * b, 2
    io_ = pyfa.sim.count_io(algo, passes=p, batch=1, heads=1, seqlen_q=N, seqlen_k=N,
                            head_dim=d, block_r=b, block_c=b, causal=True, dtype_bytes=e)
    for tensor, once in CAUSAL_REREADS[(algo, p)].items():
        assert io_.reads[tensor] == (T * (T + 1) // 2 + once * T) * b * d * e, tensor


@pytest.mark.parametrize("algo,p", WALKED)
def test_counts_scale_with_batch_and_heads_and_causal_never_adds(algo, p):
    kw = dict(passes=p, seqlen_q=100, seqlen_k=130, head_dim=16, block_r=16, block_c=32)
    one = pyfa.sim.count_io(algo, batch=1, heads=1, **kw)
    many = pyfa.sim.count_io(algo, batch=3, heads=5, **kw)
    assert many == one.scaled(15) and one.total > 0
    causal = pyfa.sim.count_io(algo, batch=1, heads=1, causal=True, **kw)
    assert causal.total <= one.total


@pytest.mark.parametrize("passes", ["forward", "backward", "both"])
def test_report_counts_are_count_io(passes):
    s = report_model.Setup(batch=2, heads=3, seqlen_q=300, seqlen_k=200, head_dim=32, causal=True,
                     dtype_bytes=2, passes=passes)
    r = report_model.build_report(s)
    shown = {a["name"]: a for a in r["algorithms"]}
    for algo in ALGOS:
        if report_model.missing_passes(algo, passes):
            assert algo in [x["name"] for x in r["skipped"]]
            continue
        want = pyfa.sim.count_io(algo, passes=passes, batch=2, heads=3, seqlen_q=300,
                                 seqlen_k=200, head_dim=32, causal=True, dtype_bytes=2)
        a = shown[algo]
        assert (a["reads"], a["writes"], a["total"]) == (want.reads, want.writes, want.total)
        assert a["vs_standard"] == pytest.approx(want.total / shown["standard"]["total"])


def test_standard_passes_reach_the_report():
    s = report_model.Setup(batch=1, heads=1, seqlen_q=64, seqlen_k=64, head_dim=8, passes="both")
    plain = report_model.count("standard", s)[0]
    all3 = replace(s, standard_passes=("scale", "mask", "dropout"))
    with_passes = report_model.count("standard", all3)[0]
    # Three passes, each a read and a write of a 64 x 64 matrix, forward and backward.
    assert with_passes.total - plain.total == 3 * 2 * 2 * 64 * 64 * 4


def test_a_smaller_profile_gives_smaller_default_tiles():
    s = report_model.Setup(head_dim=256, passes="forward", algos=["fa2"])
    small = replace(s, smem_kib=48)
    big_tiles = report_model.count("fa2", s)[1]
    small_tiles = report_model.count("fa2", small)[1]
    assert small_tiles[0]["block_r"] < big_tiles[0]["block_r"]
    assert report_model.tiles_fit(small_tiles, small)


def _fa1_passes():
    return [p for p in ("forward", "backward") if ("fa1", p) in count_mod.WALKERS]


@pytest.mark.parametrize("p", ["forward", "backward"])
def test_fa1_bytes_fall_as_bc_grows(p):
    if ("fa1", p) not in count_mod.WALKERS:
        pytest.skip(f"fa1 has no {p} walker registered yet")
    s = report_model.Setup(batch=2, heads=2, seqlen_q=512, seqlen_k=512, head_dim=64, passes=p,
                     block_r=32, algos=["fa1"])
    for causal in (False, True):
        sw = report_model.run_sweep(replace(s, causal=causal), "bc",
                              [4, 8, 16, 32, 64, 128, 256, 512])
        totals = [row["bytes"]["fa1"] for row in sw["rows"]]
        assert all(a > b for a, b in zip(totals, totals[1:])), totals


def test_fa2_forward_bytes_fall_as_br_grows():
    s = report_model.Setup(batch=1, heads=2, seqlen_q=512, seqlen_k=512, head_dim=64,
                     passes="forward", block_c=32, algos=["fa2"])
    sw = report_model.run_sweep(s, "br", [8, 16, 32, 64, 128, 256])
    totals = [row["bytes"]["fa2"] for row in sw["rows"]]
    assert all(a > b for a, b in zip(totals, totals[1:])), totals


def test_sweep_over_n_grows_quadratically_for_standard():
    s = report_model.Setup(batch=1, heads=1, head_dim=64, passes="forward", algos=["standard"])
    sw = report_model.run_sweep(s, "n", [1024, 2048, 4096])
    b = [row["bytes"]["standard"] for row in sw["rows"]]
    assert 3.5 < b[1] / b[0] < 4 and 3.5 < b[2] / b[1] < 4


def test_progress_bar_draws_only_when_enabled():
    out = io.StringIO()
    bar = report.Progress(4, "sweep", True, stream=out)
    for _ in range(4):
        bar.step("x")
    bar.close()
    assert "4/4" in out.getvalue() and "#" * 30 in out.getvalue()
    quiet = io.StringIO()
    bar = report.Progress(4, "sweep", False, stream=quiet)
    bar.step()
    bar.close()
    assert quiet.getvalue() == ""


# ---- the command line, run as a user runs it

def _run_cli(*args, progress_delay=None):
    """python -m pyfa.sim ARGS in a child; progress_delay replaces PROGRESS_DELAY_S there (0:
    a bar from the first step, however fast the machine)."""
    env = dict(os.environ)
    # The subprocess must import this very pyfa (installed or the source tree).
    root = str(Path(pyfa.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if progress_delay is None:
        command = ["-m", "pyfa.sim", *args]
    else:
        command = ["-c", "import sys; from pyfa.sim import report; "
                         f"report.PROGRESS_DELAY_S = {progress_delay!r}; sys.exit(report.main(sys.argv[1:]))",
                   *args]
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=60)


def test_gpt2_medium_preset_runs_fast_and_compares_every_algorithm():
    start = time.perf_counter()
    proc = _run_cli("report", "--preset", "gpt2-medium")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 5.0, f"took {elapsed:.1f} s"
    text = proc.stdout
    assert "B=64 H=16 Nq=Nk=1024 d=64" in text and "forward + backward" in text
    totals = text[text.index("Totals"):]
    for algo in ALGOS:
        if report_model.missing_passes(algo, "both"):
            assert "Not shown: " in text and algo in text.split("Not shown: ")[1]
        else:
            assert any(line.split()[:1] == [algo] for line in totals.splitlines()), algo
    for word in ("40.3", "GiB", "Θ(Nd + N²)", "Element size", "Which passes", "Caches"):
        assert word in text


def test_json_and_markdown_formats_parse(tmp_path):
    proc = _run_cli("report", "--preset", "v1-table", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["problem"]["batch"] == 4 and r["block_r"] == r["block_c"] == 32
    names = [a["name"] for a in r["algorithms"]]
    assert names[0] == "standard"
    std = pyfa.sim.count_io("standard", passes="both", batch=4, heads=8, seqlen_q=2048,
                            seqlen_k=2048, head_dim=64)
    assert r["algorithms"][0]["total"] == std.total

    out = tmp_path / "report.md"
    proc = _run_cli("report", "--preset", "gpt2-medium", "--format", "markdown", "--steps",
                    "--out", str(out))
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    md = out.read_text(encoding="utf-8")
    assert md.startswith("# pyfa HBM-IO report")
    # Every table is well formed: a header, a separator, rows with as many cells.
    tables, current = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) >= 3
    for t in tables:
        assert set(t[1].replace("|", "").replace(" ", "")) <= set("-:")
        assert len({row.count("|") for row in t}) == 1


def test_sweep_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    proc = _run_cli("sweep", "--over", "bc", "--values", "16,32,64,128", "--preset",
                    "v1-table", "--passes", "forward", "--plot", str(png), "--progress",
                    progress_delay=0)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size < 100_000
    assert "Bc" in proc.stdout
    # The progress bar goes to stderr, never into the table.
    assert "sweep bc [" in proc.stderr and "sweep bc [" not in proc.stdout


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    s = report_model.Setup(passes="forward", algos=["standard"])
    sw = report_model.run_sweep(s, "bc", [16, 32])
    with pytest.raises(SystemExit, match=r'pip install matplotlib'):
        report_render.plot_sweep(sw, tmp_path / "x.png")


def test_bad_arguments_are_reported():
    proc = _run_cli("report", "--algos", "fa9")
    assert proc.returncode == 2 and "fa9" in proc.stderr
    proc = _run_cli("report", "--standard-passes", "sideways")
    assert proc.returncode == 2 and "sideways" in proc.stderr


@pytest.mark.parametrize("preset,want", [
    ("gqa", dict(batch=1, heads=32, heads_kv=8, seqlen_q=4096, seqlen_k=4096, head_dim=128,
                 causal=True)),
    ("sliding-window", dict(batch=1, heads=32, heads_kv=8, seqlen_q=16384, seqlen_k=16384,
                            head_dim=128, causal=True, window=(4096, None))),
])
def test_gqa_and_sliding_window_presets_are_count_io(preset, want):
    r = report_model.build_report(report_model.PRESETS[preset]["setup"], preset=preset)
    assert r["problem"]["heads_kv"] == 8
    for a in r["algorithms"]:
        rec = pyfa.sim.count_io(a["name"], passes="both", **want)
        assert (a["reads"], a["writes"]) == (rec.reads, rec.writes), a["name"]
    titles = [n["title"] for n in r["notes"]]
    assert "Grouped-query attention" in titles and "Masking" in titles
    text = report_render.render_text(r)
    assert "Hkv=8" in text and "causal" in text


def test_mask_and_heads_options_reach_the_report():
    proc = _run_cli("report", "-N", "512", "-H", "4", "--heads-kv", "2", "--causal",
                    "--window", "64,none", "--causal-align", "top_left", "--seqlen-q", "256",
                    "--format", "json", "--algos", "fa2", "--passes", "forward")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["problem"]["window"] == [64, None] and r["problem"]["causal_align"] == "top_left"
    want = pyfa.sim.count_io("fa2", batch=1, heads=4, heads_kv=2, seqlen_q=256, seqlen_k=512,
                             head_dim=64, causal=True, window=(64, None), causal_align="top_left")
    fa2 = next(a for a in r["algorithms"] if a["name"] == "fa2")
    assert fa2["total"] == want.total
    for args, word in ((["--window", "3"], "--window"), (["--window", "-1,2"], "window"),
                       (["-H", "6", "--heads-kv", "4"], "heads_kv")):
        proc = _run_cli("report", *args)
        assert proc.returncode == 2 and word in proc.stderr, proc.stderr


def test_paper_figure_stands_beside_fa1_only():
    # The paper's 4.4 GB was measured for FlashAttention as it then was: FA1.
    proc = _run_cli("report", "--preset", "gpt2-medium", "--algos", "standard,fa1,fa2")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout[proc.stdout.index("Against the paper"):proc.stdout.index("Notes")]
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()
            if line.split()[:1] in (["standard"], ["fa1"], ["fa2"])}
    assert rows["standard"][0] == "40.3" and rows["fa1"][0] == "4.4"
    assert rows["fa2"][0] == "—" and rows["fa2"][2] == "—"
    assert "4.4" not in " ".join(rows["fa2"])


@pytest.mark.parametrize("Nq,Nk,split_size,causal", [(1, 77, 32, False), (5, 70, 16, True), (3, 40, 64, False)])
def test_split_kv_counts_are_the_simulators(Nq, Nk, split_size, causal):
    # The walker's partial O/LSE writes and the combine step's reads equal what the
    # simulator records walking the same chunks (GQA 4:2, short last tile and chunk).
    import numpy as np
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, Nq, 16), dtype=np.float32)
    k, v = (rng.standard_normal((2, 2, Nk, 16), dtype=np.float32) for _ in range(2))
    tiles = pyfa.Options(block_r=8, block_c=16)
    sim = pyfa.sim.fa2_forward(q, k, v, causal=causal, split_size=split_size, options=tiles)
    rec = pyfa.sim.count_io("fa2", batch=2, heads=4, heads_kv=2, seqlen_q=Nq, seqlen_k=Nk, head_dim=16,
                            block_r=8, block_c=16, causal=causal, split_size=split_size)
    assert (rec.reads, rec.writes) == (sim.io.reads, sim.io.writes)
    assert rec.reads["O partials"] == ceil_div(Nk, split_size) * 2 * 4 * Nq * 16 * 4
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.sim.count_io("fa1", batch=1, heads=1, seqlen_q=1, seqlen_k=64, head_dim=16, split_size=32)
    with pytest.raises(pyfa.InvalidArgumentError, match="split_size"):
        pyfa.sim.count_io("fa2", batch=1, heads=1, seqlen_q=1, seqlen_k=64, head_dim=16, block_c=16,
                          split_size=24)


def test_decode_preset_shows_bytes_per_token_beside_the_floor():
    s = report_model.PRESETS["decode"]["setup"]
    t0 = time.perf_counter()
    r = report_model.build_report(s, preset="decode")
    assert time.perf_counter() - t0 < 5, "the walkers count per tile row, not per element"
    B, H, Hkv, Nk, d = 16, 32, 8, 32768, 128
    floor = 4 * (2 * Hkv * Nk * d + 2 * H * d)  # per token: one sequence's K/V once, q and o
    dec = r["decode"]
    assert dec["tokens_per_step"] == B and dec["floor_bytes_per_token"] == floor
    fa2 = next(a for a in dec["algorithms"] if a["name"] == "fa2")
    want = pyfa.sim.count_io("fa2", batch=B, heads=H, heads_kv=Hkv, seqlen_q=1, seqlen_k=Nk, head_dim=d,
                             causal=True, split_size=256)
    assert fa2["bytes_per_token"] * B == want.total
    # FA2's forward packs each group's 4 query heads into its blocks here (16 x 8 x 128
    # blocks, far above 4 per SM): K/V once per group, so the step is the floor plus the
    # partials (128 chunks x (d + 1) x 4 bytes, written and read) and LSE.
    partials = 2 * (Nk // 256) * H * (d + 1) * 4
    assert dec["fa2_packs"]
    # Each block's 4 rows in a Q tile of 8 (src/core/api.cpp few_rows), counted as run.
    fa2_tiles = next(a for a in r["algorithms"] if a["name"] == "fa2")["tiles"]
    assert [(t["kernel"], t["block_r"], t["block_c"]) for t in fa2_tiles] == [("fa2_forward", 8, 64)]
    assert fa2["partials_bytes_per_token"] == partials
    assert fa2["kv_rereads_bytes_per_token"] == 0
    assert fa2["bytes_per_token"] == floor + partials + H * 4
    assert fa2["over_floor"] <= 1.05
    # FA1's forward runs one block per query head: each K/V tile 4 times.
    fa1 = next(a for a in dec["algorithms"] if a["name"] == "fa1")
    assert fa1["kv_rereads_bytes_per_token"] == 3 * 2 * Hkv * Nk * d * 4
    assert fa1["over_floor"] > 1.05 and fa1["grouped_over_floor"] <= 1.06
    text = report_render.render_text(r)
    assert "bytes per generated token" in text and "re-reads" in text
    assert "Decoding: bytes per generated token" in [n["title"] for n in r["notes"]]
    note = next(n["text"] for n in r["notes"] if n["title"] == "Decoding: bytes per generated token")
    assert "packs the group's query heads" in note
    # Batch 1 at context 8192 would pack into 32 x 8 = 256 blocks, under 4 per SM of the
    # profile's 132: it keeps one block per query head (1024 blocks) and says so.
    one = report_model.build_report(replace(s, batch=1, seqlen_k=8192), preset="decode")
    assert not one["decode"]["fa2_packs"]
    fa2_one = next(a for a in one["decode"]["algorithms"] if a["name"] == "fa2")
    assert fa2_one["kv_rereads_bytes_per_token"] == 3 * 2 * Hkv * 8192 * d * 4
    assert "runs one block per query head here" in next(
        n["text"] for n in one["notes"] if n["title"] == "Decoding: bytes per generated token")


def test_pack_gqa_rule():
    """The rule (src/core/tiles.cpp pack_gqa; the emulator's launches in tests/test_kvcache.py
    follow it): pack only where it takes fewer blocks and keeps 4 blocks per SM."""
    from pyfa.sim.tiles import EMU_PROFILE, pack_gqa
    assert pack_gqa(16, 32, 8, 1, 64, 128) and pack_gqa(1, 32, 8, 1, 64, 66)
    assert not pack_gqa(1, 32, 8, 1, 64, 65)  # 8 x 65 = 520 blocks < 4 x 132
    assert not pack_gqa(16, 32, 32, 1, 64, 128)  # no GQA
    assert not pack_gqa(16, 32, 8, 64, 64, 128)  # a head's rows fill its tiles: no fewer blocks
    assert not pack_gqa(16, 32, 8, 128, 64, 128)
    assert pack_gqa(16, 32, 8, 40, 64, 128)  # 160 rows in 3 tiles, not 4 x 1
    assert EMU_PROFILE.sm_count == 132
