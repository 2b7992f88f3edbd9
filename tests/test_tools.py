"""tools/: the CPU benchmark, the GPU check's dry run and its plumbing, the ptxas report.

The GPU path of tools/device_check.sh cannot run without a GPU; what can is checked here:
its dry run and budget, the parsing of ncu and compute-sanitizer output, and gpu_bench's
steps end to end on the emulator, with stand-in `ncu` and `compute-sanitizer` scripts.
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyfa

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))

from gpucheck import common, ncu, sanitize  # noqa: E402


def tool_env(extra_path=None):
    """The scripts import pyfa normally: make them find the one this test imported."""
    env = dict(os.environ)
    here = str(Path(pyfa.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.pop("PYFA_STEP_DEADLINE", None)
    if extra_path:
        env["PATH"] = f"{extra_path}{os.pathsep}{env['PATH']}"
    return env


def run(args, timeout=120, env=None):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env or tool_env())


def kernels_with_layout():
    return [k for k in pyfa.api.KERNELS if pyfa.smem_bytes(k, 32, 32, 64) > 0]


def test_bench_smoke_prints_ratios_on_its_last_line():
    p = run([sys.executable, str(TOOLS / "bench.py"), "--smoke"])
    assert p.returncode == 0, p.stdout + p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: "), last
    assert re.search(r"\bemu/numpy=\d+\.\d+x", last), last
    assert re.search(r"\bsim/numpy=\d+\.\d+x", last), last
    for algo in pyfa.api._FORWARD:
        assert f"{algo} fwd:" in last
    assert "BITS DIFFER" not in p.stdout


def test_bench_decode_and_varlen_smoke_print_bandwidth_and_torch_side_by_side():
    p = run([sys.executable, str(TOOLS / "bench.py"), "--decode", "--varlen", "--smoke", "--decode-threads", "2",
             "--decode-kvcache", "--decode-c", "--decode-warm", "20", "--decode-gap", "0"])
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "BITS DIFFER" not in out and "cpu == emu bit for bit" in out, out
    rows = {line[9:20].strip() for line in out.splitlines() if line.startswith("     256 ")}
    assert {"bandwidth", "cpu", "cpu prep", "kvcache", "kv prep", "kv paged"} <= rows, out
    assert "the cpu column's bits" in out and "the kvcache column's bits" in out, out
    if platform.machine() in ("x86_64", "AMD64") and shutil.which("cc"):  # tools/decode_loop.c, compiled
        assert {"read from C", "cpu from C"} <= rows, out
        assert re.search(r"\d+% of the read from C; the cpu column's bits", out), out
    summaries = [line for line in out.splitlines() if line.startswith("summary: ")]
    assert len(summaries) == 2, out
    assert re.search(r"N=256: cpu( split| prep)? \d+\.\d GB/s = \d+% of \d+\.\d GB/s measured", summaries[0]), out
    assert summaries[1].startswith("summary: varlen 4 sequences") and "ms" in summaries[1], out


def test_bench_torch_calls_smoke_prints_both_columns_and_a_ratio(capsys):
    torch = pytest.importorskip("torch")
    import bench  # tools/bench.py, in this process: torch is imported once

    threads = torch.get_num_threads()
    try:
        summary = bench.main(["--torch-calls", "--smoke"])
    finally:
        torch.set_num_threads(threads)  # the bench sets its own
    out = capsys.readouterr().out
    assert summary == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith("  1   2   2")]
    assert [r[6] for r in rows] == ["fwd", "fwd+bwd"], out
    for r in rows:  # pyfa us, sdpa us, ratio, and the two outputs within fp32 of each other
        assert float(r[7]) > 0 and float(r[8]) > 0 and r[9].endswith("x"), out
        assert float(r[-1]) < 1e-5, out
    assert re.search(r"^summary: torch-calls: .* geometric mean \d+\.\d\dx, lowest \d+\.\d\dx over 2 passes$",
                     out, re.M), out


def test_device_check_dry_run_lists_every_step_within_its_budget(tmp_path):
    p = run(["bash", str(TOOLS / "device_check.sh"), "--dry-run", str(tmp_path)], timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    steps = re.findall(r"^== step (\w+) \(timeout (\d+)s\): (.+)$", p.stdout, re.M)
    names = [name for name, _, _ in steps]
    assert names == ["wheels", "info", "build", "tests", "sanitizer", "bench", "ncu"]
    budget = re.search(r"^budget: step timeouts .* = (\d+)s: fits in (\d+)s$", p.stdout, re.M)
    assert budget, p.stdout
    total, limit = int(budget.group(1)), int(budget.group(2))
    assert total == sum(int(t) for _, t, _ in steps) + 15 and total <= limit <= 430
    # tools/README.md's step table gives the same timeouts.
    table = dict(re.findall(r"^\| (\w+) \| (\d+) s \|", (TOOLS / "README.md").read_text(), re.M))
    assert table == {name: t for name, t, _ in steps}
    commands = {name: cmd for name, _, cmd in steps}
    assert "pip install" in commands["wheels"] and "--no-index" in commands["wheels"]
    assert "-DCMAKE_CUDA_ARCHITECTURES=" in commands["build"]
    assert "pytest" in commands["tests"] and "-k cuda" in commands["tests"]
    assert "ptxas" not in p.stdout
    for op in pyfa.api.OPS:  # each op under each tool, and in the bench plan
        assert re.search(rf"compute-sanitizer --tool memcheck .*drive --ops \S*{op}", p.stdout)
        assert re.search(rf"compute-sanitizer --tool racecheck .*drive --ops \S*{op}", p.stdout)
        assert re.search(rf"compute-sanitizer --tool initcheck .*drive --ops \S*{op}", p.stdout)
        assert re.search(rf"compute-sanitizer --tool synccheck .*drive --ops \S*{op}", p.stdout)
        assert re.search(rf"would run: .*drive --ops \S*{op}\S* --size race --backend emu --emu-check strict", p.stdout)
        assert re.search(rf"ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum .*--ops {op} ", p.stdout)
        assert re.search(rf"would time B=4 H=8 N=8192 d=128 tiles=32x32: .*{op}", p.stdout)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mode"] == "dry-run"
    assert [s["step"] for s in summary["steps"]] == names
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "device_check.log").is_file()
    # The summary comes last, its step table first: it is what the output's tail keeps.
    assert p.stdout.rstrip().endswith((tmp_path / "summary.md").read_text().rstrip())
    assert len(p.stdout) < 12000


def test_a_budget_the_steps_overrun_fails_the_dry_run(tmp_path):
    env = tool_env()
    env["PYFA_CHECK_BUDGET_S"] = "300"
    p = run(["bash", str(TOOLS / "device_check.sh"), "--dry-run", str(tmp_path)], timeout=60, env=env)
    assert p.returncode == 1 and "DOES NOT FIT in 300s" in p.stdout


def test_tool_output_parsers():
    clean = "========= COMPUTE-SANITIZER\ndrive: done, 4 calls\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitize.classify_sanitizer("memcheck", 0, clean) == ("clean", 0)
    bad = "drive: done\n========= Invalid __global__ write of size 4\n========= ERROR SUMMARY: 3 errors\n"
    assert sanitize.classify_sanitizer("memcheck", 86, bad) == ("errors found", 3)
    race = "drive: done\n========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n"
    assert sanitize.classify_sanitizer("racecheck", 86, race) == ("errors found", 1)
    broken = "========= Error: Device not supported\n========= Target application returned an error\n"
    assert sanitize.classify_sanitizer("memcheck", 1, broken)[0] == "tool not working here"
    assert sanitize.classify_sanitizer("memcheck", None, "")[0] == "timeout"

    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    row = ('"{id}","9","python3","h","pyfa_cuda_kernels::{k}_kernel(AttentionParams)","1","7","(128, 1, 1)",'
           '"(8, 2, 1)","0","9.0","Command line profiler metrics","{m}","byte","{v}"')
    out = "\n".join(["==PROF== Connected to process 9", "drive: done", head,
                     row.format(id=0, k="fa2_forward", m="dram__bytes_read.sum", v="1,000"),
                     row.format(id=0, k="fa2_forward", m="dram__bytes_write.sum", v="500"),
                     row.format(id=1, k="fa2_forward", m="dram__bytes_read.sum", v="2,000")])
    got = ncu.parse_ncu_csv(out)
    assert got == {"fa2_forward": {"launches": 2, "dram__bytes_read.sum": 3000.0, "dram__bytes_write.sum": 500.0}}


FAKE_SANITIZER = """#!/bin/bash
tool=memcheck
while [[ "$1" == --* ]]; do [ "$1" = --tool ] && tool=$2; shift 2; done
"$@"; rc=$?
[ $tool = racecheck ] && echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" \
  || echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""

FAKE_NCU = """#!/bin/bash
while [[ "$1" == --* ]]; do if [ "$1" = --csv ]; then shift; else shift 2; fi; done
"$@"
echo '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
echo '"0","pyfa_cuda_kernels::fa2_forward_kernel(AttentionParams)","dram__bytes_read.sum","byte","1,234"'
echo '"0","pyfa_cuda_kernels::fa2_forward_kernel(AttentionParams)","dram__bytes_write.sum","byte","99"'
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash for the stand-in tools")
def test_gpu_steps_run_on_the_emulator_with_stand_in_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("compute-sanitizer", FAKE_SANITIZER), ("ncu", FAKE_NCU)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = tool_env(extra_path=bin_dir)
    script = str(TOOLS / "gpu_bench.py")

    # One small case set for all four tools and the strict emulator beside them.
    p = run([sys.executable, script, "sanitize", "--backend", "emu", "--cases", "race",
             "--out", str(tmp_path / "sanitize.json")], env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads((tmp_path / "sanitize.json").read_text())
    assert [(r["tool"], r["status"]) for r in result["runs"]] == [
        ("memcheck", "clean"), ("racecheck", "clean"), ("initcheck", "clean"), ("synccheck", "clean")]
    assert {size: r["status"] for size, r in result["strict"].items()} == {"race": "clean"}
    assert re.search(r"initcheck +race +clean +clean \(init\)", p.stdout), p.stdout

    shape = dict(batch=1, heads=2, seqlen_q=48, seqlen_k=48, head_dim=16)
    p = run([sys.executable, script, "ncu", "--backend", "emu", "--shape", "1", "2", "48", "16",
             "--out", str(tmp_path / "ncu.json")], env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    fa2 = next(e for e in json.loads((tmp_path / "ncu.json").read_text())["ops"] if e["op"] == "fa2_forward")
    assert fa2["status"] == "ok"
    expected = pyfa.sim.count_io("fa2", passes="forward", **shape)
    assert fa2["passes"]["forward"] == {"ncu_read": 1234.0, "ncu_write": 99.0, "kernels": ["fa2_forward"],
                                        "sim_read": expected.total_reads, "sim_write": expected.total_writes,
                                        "tiles_match": True}

    p = run([sys.executable, script, "bench", "--backend", "emu", "--seqlens", "40", "--head-dims", "64",
             "--batch", "1", "--heads", "1", "--target-ms", "1", "--out", str(tmp_path / "bench.json")], env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    bench = json.loads((tmp_path / "bench.json").read_text())
    records = bench["records"]
    timed = {(r["op"], r["tiles"]) for r in records if r["status"] == "ok"}
    # The decoding step (split-KV, GQA) checked against the reference and timed first.
    assert [(r["B"], r["N"], r["status"], r["packed"]) for r in bench["decode"]] == [(1, 64, "ok", False)]
    assert bench["decode"][0]["rel_err"] < 1e-5 and bench["decode"][0]["ms"] > 0
    for op in pyfa.api.OPS:
        assert {(op, "default"), (op, "32x32")} <= timed, records
    # The fast variant beside the readable one where the op has it, skipped (named) where not.
    assert ("fa2_forward/fast", "default") in timed, records
    skipped = {r["op"]: r["status"] for r in records if r["status"].startswith("skipped")}
    # The FA2 backward runs fast at its default tiles (one preprocess serves both variants);
    # at 32 x 32 its dK/dV kernel has no fast form.
    assert ("fa2_backward/fast", "default") in timed, records
    assert "fa2_backward_dkdv: no fast kernel for tiles 32x32" in skipped["fa2_backward/fast"]
    assert "auto runs what the fast row runs" in skipped["fa2_backward/auto"]
    assert "auto runs the readable ones" in skipped["fa1_forward/auto"]
    kinds = {r["op"]: r.get("kernel_variants") for r in records if r["status"] == "ok" and r["tiles"] == "default"}
    assert kinds["fa2_backward/fast"] == {"fa2_backward_preprocess": "fast",
                                          "fa2_backward_dkdv": "fast", "fa2_backward_dq": "fast"}

    (tmp_path / "steps.tsv").write_text("bench\tok\t0\t1\t150\tpython3 tools/gpu_bench.py bench\n")
    p = run([sys.executable, script, "summarize", "--work", str(tmp_path), "--out", str(tmp_path / "out")], env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| fa2_forward | 40 | 64 | default |" in md
    assert "- memcheck: clean" in md and "| fa2_forward | forward | fa2_forward | 1.23 kB | 99 B |" in md


@pytest.fixture(scope="module")
def ptxas_build(tmp_path_factory):
    """ptxas_report.py's one sm_90 compile, which the SASS report reads too: (the run, the
    folder of its ptxas.json and kernels.cubin)."""
    tmp = tmp_path_factory.mktemp("ptxas")
    p = run([sys.executable, str(TOOLS / "ptxas_report.py"), "--json", str(tmp / "ptxas.json"),
             "--cubin", str(tmp / "kernels.cubin")], timeout=600)
    return p, tmp


NVCC_MISSING = common.find_tool("nvcc", ["/usr/local/cuda/bin/nvcc"]) is None


@pytest.mark.slow
@pytest.mark.xdist_group("ptxas_build")
@pytest.mark.skipif(NVCC_MISSING, reason="nvcc not found")
def test_ptxas_report_has_a_row_per_kernel_and_no_spills(ptxas_build):
    import ptxas_report
    p, tmp = ptxas_build
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp / "ptxas.json").read_text())
    rows = {r["kernel"]: r for r in report["kernels"]}
    for kernel in kernels_with_layout():
        assert kernel in rows, f"no ptxas row for {kernel}: {sorted(rows)}"
        assert re.search(rf"^\| {kernel} \| \d+ \|", p.stdout, re.M)
    for r in rows.values():
        assert (r["spill_stores"], r["spill_loads"]) == (0, 0), r
        assert r["fma_rn_f32"] > 0 or r["kernel"] in ptxas_report.NO_PRODUCTS, \
            f"{r['kernel']}: inner products not fused"
    assert report["fma_rn_f32_total"] == sum(r["fma_rn_f32"] for r in rows.values())


def _sass_tools_missing():
    import sass_report
    if sass_report.ptxas_report.find_nvcc() is None:
        return "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)"
    for tool in ("cuobjdump", "nvdisasm"):
        if sass_report.find_tool(tool) is None:
            return f"{tool} not found (pip install nvidia-cuda-{tool}, the dev extra)"
    return None


@pytest.fixture(scope="module")
def sass_report_run(ptxas_build, tmp_path_factory):
    """sass_report.py over ptxas_build's cubin: (the run, its JSON rows)."""
    _, build = ptxas_build
    assert (build / "kernels.cubin").is_file(), "ptxas_report.py --cubin kept no cubin"
    out = tmp_path_factory.mktemp("sass") / "sass.json"
    p = run([sys.executable, str(TOOLS / "sass_report.py"), "--cubin", str(build / "kernels.cubin"),
             "--ptxas-json", str(build / "ptxas.json"), "--json", str(out)], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(out.read_text())
    p.decode = report["decode"]
    return p, report["rows"]


@pytest.mark.slow
@pytest.mark.xdist_group("ptxas_build")
@pytest.mark.skipif(_sass_tools_missing() is not None, reason=str(_sass_tools_missing()))
def test_sass_report_rows_and_summary(sass_report_run):
    p, rows = sass_report_run
    names = {r["name"] for r in rows}
    for kernel in kernels_with_layout():
        assert f"{kernel}/reference" in names, sorted(names)
    import ptxas_report
    for r in rows:
        assert r["spill_bytes"] == 0, r
        if r["kernel"] in ptxas_report.NO_PRODUCTS:  # no inner product: no hot loop, no forecast
            assert r["hot_loops"] == 0 and r["forecast_tflops"] is None, r
            continue
        assert r["hot_loops"] >= 1, f"{r['name']}: no innermost loop with an FFMA found"
        assert 0 < r["fp_share"] <= 1 and r["lds_per_flop"] >= 0, r
        assert r["forecast_tflops"] is not None and 0 < r["forecast_tflops"] < 67, r
    # The decoding steps on the readable FA2 forward: batch 1 at 8k unpacked (1024 blocks:
    # 7.8 per SM), the others packed, at the IO model's bytes (4.01x and 1.016x the floor).
    dec = {(x["batch"], x["context"]): x for x in p.decode}
    assert set(dec) == {(1, 8192), (1, 32768), (16, 8192), (16, 32768)}
    assert not dec[(1, 8192)]["packed"] and dec[(1, 8192)]["blocks"] == 32 * 32
    assert all(x["packed"] for k, x in dec.items() if k != (1, 8192))
    assert dec[(16, 32768)]["blocks"] == 16 * 8 * 128 and dec[(16, 32768)]["over_floor"] < 1.05
    assert dec[(1, 8192)]["over_floor"] > 4
    for x in dec.values():
        assert x["forecast_us"] == pytest.approx(x["hbm_bytes"] / 4.8e6)
        # A Q tile of the block's few rows (8 x 64): more resident blocks than 64 x 64's one.
        assert (x["block_r"], x["block_c"]) == (8, 64) and x["resident_per_sm"] >= 2, x
    assert "Decoding steps on fa2_forward/reference" in p.stdout
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: ")
    parts = last[len("summary: "):].split(" | ")
    d64 = [r for r in rows if r["head_dim"] == 64 and r["default_tiles"]]
    assert len(parts) == len(d64)
    for part in parts:
        if part.split("/")[0] in ptxas_report.NO_PRODUCTS:
            assert re.fullmatch(r"[a-z0-9_]+/reference fp_share=- lds_per_flop=- forecast_tflops=-", part), part
            continue
        assert re.fullmatch(r"[a-z0-9_]+/(reference|fast) fp_share=[\d.]+ lds_per_flop=[\d.]+ "
                            r"forecast_tflops=[\d.]+", part), part
    # Every fast kernel with a copy of its inner product for cut tiles has it told apart
    # (tools/README.md, "Masked-tile loops"); a readable kernel has none.
    # The unmasked copies test no mask per element: every fast kernel's hot loops are at
    # least 80% floating point (a per-element test in the loop an unmasked tile runs took
    # the FA1 backward to 0.39 and the dQ kernel to 0.65).
    for r in rows:
        if r["variant"] == "fast":
            assert r["masked_loops"] >= 1 and r["hot_masked"]["flop"] > 0, r
            assert r["fp_share"] >= 0.8, r
        if r["variant"] == "reference":
            assert r["masked_loops"] == 0, r
    # Issue 12's targets for the fast FA2 forward at its default tiles, d = 64 and 128.
    for r in rows:
        if r["name"] == "fa2_forward/fast" and r["default_tiles"]:
            assert r["fp_share"] >= 0.85 and r["lds_per_flop"] <= 0.1 and r["forecast_tflops"] >= 34, r
            assert r["int_div"] == 0, r
    assert {r["head_dim"] for r in rows if r["name"] == "fa2_forward/fast"} == {64, 128}


def test_sass_report_finds_the_blocks_only_a_cut_tile_enters():
    import sass_report
    src = """if (!cut) {
    a();  // { not a brace that counts
} else {
    b();
}
if (cut && x) { c(); }
if (cut) {
    d();
}
"""
    assert sass_report.cut_only_lines(src) == {3, 4, 5, 7, 8, 9}
    loop = {"start": 0, "end": 0x30}
    chain_at = {0x0: (("k.cuh", 4),), 0x10: (("h.h", 9), ("k.cuh", 4)), 0x20: (("k.cuh", 2),)}
    cut = {"k.cuh": {3, 4, 5}}.get
    assert sass_report.masked_tile_loop(loop, chain_at, lambda f: cut(f, set()))
    chain_at[0x30] = (("k.cuh", 1),)
    assert not sass_report.masked_tile_loop(loop, chain_at, lambda f: cut(f, set()))  # half: not most


@pytest.mark.slow
@pytest.mark.xdist_group("ptxas_build")
@pytest.mark.skipif(_sass_tools_missing() is not None, reason=str(_sass_tools_missing()))
def test_fast_kernels_store_o_dq_dk_dv_128_bits_at_a_time(sass_report_run):
    # Issue 23 (F5): every fast kernel stores O, dQ, dK, dV 128 bits at a time; the only
    # narrower global stores are of the per-row statistics (LSE; FA1's m and l), one
    # float per row.
    _, rows = sass_report_run
    fast = [r for r in rows if r["variant"] == "fast"]
    assert {r["kernel"] for r in fast} == {"fa2_forward", "fa2_backward_dq", "fa2_backward_dkdv",
                                           "fa1_forward", "fa1_backward"}
    for r in fast:
        assert r["global_stores"].get("128", 0) > 0 and r["split_vector_stores"] == 0, \
            (r["function"], r["global_stores"], r["narrow_store_sites"])
        for site in r["narrow_store_sites"]:
            path, line = site.rsplit(":", 1)
            text = (ROOT / "src" / path).read_text().splitlines()[int(line) - 1]
            assert re.search(r"\b(lse|m|l)\[", text), f"{r['function']}: a narrow store at {site}: {text.strip()}"
    assert any(r["narrow_store_sites"] for r in fast if r["kernel"] == "fa2_forward")  # LSE: sites are read
