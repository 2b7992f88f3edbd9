"""The emulator's strict mode (src/backends/emu/strict.h, docs/emulator.md "Strict mode"):
each of its six checks reports the hazard a deliberately broken copy of a real kernel
plants (tests/emu/strict_faults.cpp, through the fault hooks of src/common/fault.h), and
the library's kernels run clean and bit for bit as in plain emulation over a
representative set: every kernel and variant, tails, masks, GQA, strided tensors.
tools/strict_sweep.py runs the whole grid of tests/grid.py."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import pyfa
from test_emulator import compiler, emu_runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent
STRICT_FLAGS = ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0",
                "-fno-tree-vectorize", "-fno-tree-slp-vectorize"]


# ---------------------------------------------------------------------------------------
# Mutation tests: each fault must be reported as exactly its hazard.
# ---------------------------------------------------------------------------------------
FAULTS = ["none", "race", "init", "bounds", "barrier",
          "fast-none", "async_count", "async_drop", "align", "warp_race", "warp_mask",
          "mods-none", "bias", "alibi", "cu_seqlens", "dbias-none", "dbias"]


@pytest.fixture(scope="module")
def fault_reports(tmp_path_factory):
    """{fault: its line of output} from one build and one run of strict_faults."""
    cxx = compiler("g++")
    tmp = tmp_path_factory.mktemp("strict_faults")
    common = ["-std=c++17", "-ffp-contract=off", "-pthread", "-I", "src", "-I", pyfa.get_include()]
    obj, exe = tmp / "strict_faults.o", tmp / "strict_faults"
    # The kernels instrumented as the library's strict compilation is (at -O1: the faults
    # need no speed), the runtime plain (the objects the emulator's other tests link).
    build = subprocess.run([cxx, *common, "-O1", *STRICT_FLAGS, "-DPYFA_EMU_STRICT", "-DPYFA_FAULT_HOOKS",
                            "-c", "tests/emu/strict_faults.cpp", "-o", str(obj)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"{cxx} has no -fsanitize=thread instrumentation: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    link = subprocess.run([cxx, *common, "-O1", str(obj), *emu_runtime(tmp_path_factory), "-o", str(exe), "-ldl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert link.returncode == 0, link.stderr
    run = subprocess.run([str(exe), *FAULTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    reports = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert sorted(reports) == sorted(FAULTS), run.stdout
    return reports


REF = "in fa2_forward (reference variant): "
FAST = "in fa2_forward/fast d=64 64x64 (fast variant): "
THREAD = r"thread \d+ \(warp \d+\)"
# A scalar access's site: the code address (addr2line turns it into the kernel's line).
CODE = r"at code \S+\+0x[0-9a-f]+"

# fault -> what its report must say, as regular expressions (all must match).
EXPECTED = {
    # The barrier between the stores of K_j, V_j and the score loop removed: a thread reads
    # a K_j word another thread wrote, with no __syncthreads between.
    "race": ["^hazard: pyfa emu: block \\(\\d+,\\d+,\\d+\\): check race " + re.escape(REF),
             r"shared (K_j|V_j)\[\d+, \d+\]",
             f"{THREAD} (reads|writes) it at code \\S+\\+0x[0-9a-f]+ and {THREAD} (wrote|read) it",
             r"with no barrier between them \(both since the __syncthreads at kernels/fa2_forward\.cuh:\d+\)"],
    # m_i = -inf skipped: the row max reads m_i before any thread wrote it.
    "init": ["check init " + re.escape(REF), THREAD + r" reads shared m_i\[\d+, 0\]",
             CODE + " before any thread of the block has written it"],
    # The Q_i load one element off: the last row of the last head reads past q's end.
    "bounds": ["check bounds " + re.escape(REF),
               THREAD + ": 4-byte read of q at element offset 5120, past its last element "
               r"\(offset 5119\) \(shape \(1, 2, 40, 64\), strides \(5120, 2560, 64, 1\)\), " + CODE],
    # Warp 0 skips the barrier at the top of the K/V loop: the block's threads wait at two
    # different __syncthreads.
    "barrier": ["check barrier " + re.escape(REF), "threads 0-31 wait at __syncthreads at \\S*fa2_forward\\.cuh:\\d+",
                "threads 32-127 wait at __syncthreads at \\S*fa2_forward\\.cuh:\\d+"],
    # wait_group 1 instead of 0: the group of the first V_j is still in flight when it is read.
    "async_count": ["check async " + re.escape(FAST), THREAD + r" reads shared V_j\[\d+, \d+\]",
                    r"the cp\.async of " + THREAD + r" at kernels/fast/forward_tiles\.h:\d+ \(group 1\) is in flight",
                    r"its issuer has waited for groups up to 0 only \(committed \d+\)"],
    # No wait at all: the same, and so for the first read of the first tile.
    "async_drop": ["check async " + re.escape(FAST), r"shared V_j\[\d+, \d+\]", r"\(group 1\) is in flight",
                   r"waited for groups up to 0 only"],
    # Q's 128-bit load one float off its alignment.
    "align": ["check align " + re.escape(FAST), THREAD + r": 16-byte read of q\[0, 0, \d+, \d+\]",
              r"at kernels/fast/fa2_forward_fast\.cuh:\d+", "is not a multiple of 16"],
    # The __syncwarp between the lanes' m_i stores and their reads by lanes 0..15 removed.
    "warp_race": ["check race " + re.escape(FAST), r"shared m_i\[\d+, 0\]",
                  f"{THREAD} (reads|writes) it at code \\S+ and {THREAD} (wrote|read) it",
                  "with no barrier between them"],
    # A shuffle whose mask leaves out half of the lanes that call it.
    "warp_mask": ["check barrier " + re.escape(FAST), r"thread 16 calls a shuffle at \S*fa2_forward_fast\.cuh:\d+ "
                  r"with mask 0x0000ffff, which does not include its own lane 16"],
    # The tensors of the score modifications and of packed sequences, each read (written)
    # one element off: strict mode knows each one's extent. The bias broadcasts over B and
    # H (strides 0) with padded rows: the read past a row's last key lands in the padding.
    "bias": ["check bounds " + re.escape(REF), r"read of bias at element offset \d+, which is not an element of it "
             r"\(shape \(1, 2, 40, 40\), strides \(0, 0, 44, 1\)\)"],
    # ALiBi's slopes (H,): head 1 reads slope 2.
    "alibi": ["check bounds " + re.escape(REF), r"read of alibi_slopes at element offset 2, past its last element "
              r"\(offset 1\) \(shape \(1, 2, 1, 1\), strides \(0, 1, 0, 1\)\)"],
    # Two packed sequences: the last one reads offset B + 1.
    "cu_seqlens": ["check bounds " + re.escape(REF), r"read of cu_seqlens_q at element offset 3, past its last "
                   r"element \(offset 2\) \(shape \(1, 1, 1, 3\)"],
    # dS into dbias (B, H, Nq, Nk), one element on: the last write lands past its end.
    "dbias": ["check bounds in fa2_backward_dkdv \\(reference variant\\): ",
              r"write of dbias at element offset 3200, past its last element \(offset 3199\) "
              r"\(shape \(1, 2, 40, 40\), strides \(3200, 1600, 40, 1\)\)"],
}


# One worker builds and runs the faulty kernels once for every test that reads them.
@pytest.mark.xdist_group("strict_faults")
@pytest.mark.parametrize("fault", ["none", "fast-none", "mods-none", "dbias-none"])
def test_the_unbroken_kernels_run_clean(fault_reports, fault):
    assert fault_reports[fault] == "ok", fault_reports[fault]


@pytest.mark.xdist_group("strict_faults")
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_each_planted_fault_is_reported_as_its_hazard(fault_reports, fault):
    report = fault_reports[fault]
    assert report.startswith("hazard: "), report
    for pattern in EXPECTED[fault]:
        assert re.search(pattern, report), f"{fault}: no /{pattern}/ in:\n{report}"


# What every report names (docs/emulator.md, "The checks"): the block, the check, the
# kernel and its variant, the thread or threads (with their warps), and where: a code
# address for a scalar access, a source line for barriers, shuffles, vector accesses and
# cp.async.
CHECK_OF = {"race": "race", "warp_race": "race", "async_count": "async", "async_drop": "async", "init": "init",
            "bounds": "bounds", "bias": "bounds", "alibi": "bounds", "cu_seqlens": "bounds", "dbias": "bounds",
            "align": "align", "barrier": "barrier", "warp_mask": "barrier"}


@pytest.mark.xdist_group("strict_faults")
@pytest.mark.parametrize("fault", sorted(CHECK_OF))
def test_each_report_names_block_check_kernel_threads_and_site(fault_reports, fault):
    report = fault_reports[fault]
    assert set(CHECK_OF.values()) == {"race", "async", "init", "bounds", "align", "barrier"}
    assert re.match(rf"hazard: pyfa emu: block \(\d+,\d+,\d+\): check {CHECK_OF[fault]} in "
                    r"fa2_(forward|backward_dkdv)\S* .*\((reference|fast) variant\): ", report), report
    assert re.search(r"threads? \d+", report), f"{fault}: no thread named in:\n{report}"
    assert re.search(r"at code \S+\+0x[0-9a-f]+|at \S+\.(cuh|h):\d+", report), f"{fault}: no site in:\n{report}"


@pytest.mark.xdist_group("strict_faults")
def test_race_and_warp_race_name_two_different_threads(fault_reports):
    for fault in ("race", "warp_race"):
        threads = re.findall(r"thread (\d+) \(warp (\d+)\)", fault_reports[fault])
        assert len(threads) == 2 and threads[0][0] != threads[1][0], fault_reports[fault]
    # Lanes of one warp: the missing sync is the warp's own.
    (_, w1), (_, w2) = re.findall(r"thread (\d+) \(warp (\d+)\)", fault_reports["warp_race"])
    assert w1 == w2, fault_reports["warp_race"]


# ---------------------------------------------------------------------------------------
# The library's kernels: clean, and the same bits as plain emulation.
# ---------------------------------------------------------------------------------------
STRICT = dict(backend="emu", emu_check="strict")
PLAIN = dict(backend="emu")

# (B, H, Hkv, Nq, Nk, d, Br, Bc, variant, (causal, window, align), strided)
# Reference kernels on tails, GQA, masks and strided tensors; the fast kernels of d = 64
# (every fast kernel the FA1 and FA2 passes run there) on a tail, causal, with GQA.
CASES = [
    (1, 2, 1, 11, 7, 8, 4, 4, "reference", (False, None, "bottom_right"), False),
    (1, 2, 2, 7, 13, 5, 4, 8, "reference", (True, None, "top_left"), True),
    (2, 2, 1, 9, 9, 4, 8, 4, "reference", (False, (1, 2), "bottom_right"), False),
    (1, 2, 1, 70, 70, 64, 64, 64, "auto", (True, None, "bottom_right"), False),
]


def case_id(c):
    B, H, Hkv, Nq, Nk, d, Br, Bc, variant, (causal, window, align), strided = c
    mask = f"{'causal' if causal else 'full'}-w{window}-{align}".replace(" ", "")
    return f"B{B}H{H}Hkv{Hkv}-Nq{Nq}Nk{Nk}-d{d}-{Br}x{Bc}-{variant}-{mask}{'-strided' if strided else ''}"


def tensor(rng, shape, strided):
    """A float32 array of `shape`; strided: a view whose rows are padded (row stride d + 4)
    and whose heads are interleaved with another tensor's (head stride 2 (N) (d + 4))."""
    if not strided:
        return rng.standard_normal(shape, dtype=np.float32)
    B, H, N, d = shape
    base = rng.standard_normal((B, H, 2, N, d + 4), dtype=np.float32)
    return base[:, :, 0, :, :d]


def run_ops(case, how):
    B, H, Hkv, Nq, Nk, d, Br, Bc, variant, (causal, window, align), strided = case
    rng = np.random.default_rng(Nq * 1000 + Nk * 10 + d)
    q = tensor(rng, (B, H, Nq, d), strided)
    k, v = (tensor(rng, (B, Hkv, Nk, d), strided) for _ in range(2))
    do = tensor(rng, (B, H, Nq, d), strided)
    options = pyfa.Options(block_r=Br, block_c=Bc, variant=variant, **how)
    kw = dict(causal=causal, window=window, causal_align=align, options=options)
    o2, lse = pyfa.fa2_forward(q, k, v, **kw)
    grads2 = pyfa.fa2_backward(q, k, v, o2, lse, do, **kw)
    o1, m1, l1 = pyfa.fa1_forward(q, k, v, **kw)
    grads1 = pyfa.fa1_backward(q, k, v, o1, m1, l1, do, **kw)
    return [o2, lse, *grads2, o1, m1, l1, *grads1]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_library_kernels_run_clean_in_strict_mode_with_the_same_bits(case):
    strict = run_ops(case, STRICT)
    plain = run_ops(case, PLAIN)
    for i, (s, p) in enumerate(zip(strict, plain)):
        assert np.array_equal(np.asarray(s).view(np.uint32), np.asarray(p).view(np.uint32)), f"output {i}"


# The score modifications and packed sequences, whose tensors strict mode registers with
# their true extents (src/backends/emu/strict_params.h): bias (broadcast: stride-0 axes)
# and dbias, ALiBi's slopes, dropout, cu_seqlens. Small reference cases, and the fast
# kernels on a tail where they take the modification (at d = 64 the forward and dQ take a
# bias, those that drop take dropout; softcap and ALiBi where common/fast_takes.h says,
# the FA2 forward at d = 128 too; the rest run the readable kernel).
def mods_of(name, B, H, Nq, Nk, rng):
    if name == "bias":  # broadcast over the batch
        return dict(bias=rng.standard_normal((1, H, Nq, Nk), dtype=np.float32))
    if name == "bias_one_row":  # dbias summed over the query rows
        return dict(bias=rng.standard_normal((B, 1, 1, Nk), dtype=np.float32))
    if name == "alibi":
        return dict(alibi_slopes=rng.uniform(0.1, 1.0, H).astype(np.float32))
    if name == "dropout":
        return dict(dropout_p=0.25, seed=11)
    if name == "softcap_alibi":
        return dict(softcap=2.0, alibi_slopes=rng.uniform(0.1, 1.0, (B, H)).astype(np.float32))
    if name == "softcap_dropout":
        return dict(softcap=2.0, dropout_p=0.25, seed=11)
    if name == "bias_dropout":
        return dict(dropout_p=0.25, seed=11, bias=rng.standard_normal((B, H, Nq, Nk), dtype=np.float32))
    raise AssertionError(name)


MOD_CASES = [
    ("bias", (2, 2, 1, 9, 11, 8, 4, 4, "reference", (True, None, "bottom_right"), False)),
    ("bias_one_row", (2, 2, 2, 7, 9, 4, 4, 8, "reference", (False, (2, 1), "top_left"), True)),
    ("alibi", (2, 2, 1, 9, 11, 8, 4, 4, "reference", (True, None, "top_left"), False)),
    ("dropout", (1, 2, 1, 9, 11, 8, 8, 4, "reference", (False, None, "bottom_right"), False)),
    ("bias_dropout", (1, 2, 1, 70, 70, 64, 64, 64, "auto", (True, None, "bottom_right"), False)),
    # The fast kernels with softcap and ALiBi (their rows of common/fast_takes.h), the
    # role-split backwards recomputing the score for softcap's gradient.
    ("softcap_alibi", (1, 2, 1, 70, 70, 64, 64, 64, "auto", (True, None, "bottom_right"), False)),
    ("softcap_dropout", (1, 2, 1, 70, 66, 64, 64, 64, "auto", (False, (9, 3), "top_left"), False)),
    ("alibi", (1, 2, 1, 66, 70, 64, 64, 64, "auto", (False, None, "bottom_right"), False)),
    ("softcap_alibi", (1, 1, 1, 66, 66, 128, 64, 64, "auto", (True, None, "top_left"), False)),
]


def run_mod_ops(name, case, how):
    B, H, Hkv, Nq, Nk, d, Br, Bc, variant, (causal, window, align), strided = case
    rng = np.random.default_rng(Nq * 1000 + Nk * 10 + d)
    q = tensor(rng, (B, H, Nq, d), strided)
    k, v = (tensor(rng, (B, Hkv, Nk, d), strided) for _ in range(2))
    do = tensor(rng, (B, H, Nq, d), strided)
    mods = mods_of(name, B, H, Nq, Nk, rng)
    options = pyfa.Options(block_r=Br, block_c=Bc, variant=variant, **how)
    kw = dict(causal=causal, window=window, causal_align=align, options=options, **mods)
    o2, lse = pyfa.fa2_forward(q, k, v, **kw)
    grads2 = pyfa.fa2_backward(q, k, v, o2, lse, do, **kw)
    o1, m1, l1 = pyfa.fa1_forward(q, k, v, **kw)
    grads1 = pyfa.fa1_backward(q, k, v, o1, m1, l1, do, **kw)
    return [o2, lse, *grads2, o1, m1, l1, *grads1]


@pytest.mark.parametrize("name, case", MOD_CASES, ids=[f"{n}-{case_id(c)}" for n, c in MOD_CASES])
def test_score_modifications_run_clean_in_strict_mode_with_the_same_bits(name, case):
    strict = run_mod_ops(name, case, STRICT)
    plain = run_mod_ops(name, case, PLAIN)
    assert len(strict) == len(plain) == 11 + 2 * ("bias" in name)  # dbias from each backward
    for i, (s, p) in enumerate(zip(strict, plain)):
        assert np.array_equal(np.asarray(s).view(np.uint32), np.asarray(p).view(np.uint32)), f"output {i}"


# (sequence lengths q, k, H, Hkv, d, Br, Bc, variant, causal): a zero-length sequence, and
# the fast kernels of d = 64 on sequences with tails.
VARLEN_CASES = [
    ((5, 0, 7), (6, 3, 9), 2, 1, 8, 4, 4, "reference", True),
    ((70, 33), (41, 70), 2, 2, 64, 64, 64, "auto", False),
]


def run_varlen_ops(case, how):
    lq, lk, H, Hkv, d, Br, Bc, variant, causal = case
    rng = np.random.default_rng(sum(lq) * 100 + sum(lk))
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], H, d), dtype=np.float32)
    k, v = (rng.standard_normal((ck[-1], Hkv, d), dtype=np.float32) for _ in range(2))
    do = rng.standard_normal((cq[-1], H, d), dtype=np.float32)
    options = pyfa.Options(block_r=Br, block_c=Bc, variant=variant, **how)
    out = []
    for algo in ("fa2", "fa1"):
        kw = dict(causal=causal, algo=algo, options=options)
        out.append(pyfa.attention_varlen(q, k, v, cq, ck, return_lse=algo == "fa2", **kw))
        out += pyfa.attention_varlen_grad(q, k, v, do, cq, ck, **kw)
    return [x for o in out for x in (o if isinstance(o, tuple) else (o,))]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-d{c[4]}-{c[7]}".replace(" ", ""))
def test_packed_sequences_run_clean_in_strict_mode_with_the_same_bits(case):
    strict = run_varlen_ops(case, STRICT)
    plain = run_varlen_ops(case, PLAIN)
    for i, (s, p) in enumerate(zip(strict, plain)):
        assert np.array_equal(np.asarray(s).view(np.uint32), np.asarray(p).view(np.uint32)), f"output {i}"


# ---------------------------------------------------------------------------------------
# The switches.
# ---------------------------------------------------------------------------------------
def test_emu_check_takes_off_and_strict_only():
    assert pyfa.Options(emu_check="strict").emu_check == "strict"
    with pytest.raises(pyfa.InvalidArgumentError, match="emu_check: expected one of 'off', 'strict', got 'on'"):
        pyfa.Options(emu_check="on")
    with pytest.raises(pyfa.ArgumentTypeError, match="emu_check"):
        pyfa.Options(emu_check=True)


def test_kernel_hazard_error_is_an_emulation_error_carrying_its_check():
    err = pyfa.KernelHazardError("pyfa emu: block (0,0,0): check async in fa2_forward (fast variant): ...", 9)
    assert isinstance(err, pyfa.EmulationError) and err.check == "async" and err.status == 9
    assert pyfa.errors.STATUS_CLASSES["KERNEL_HAZARD"] is pyfa.KernelHazardError


SCRIPT = """
import numpy as np, pyfa
q = np.ones((1, 1, 5, 4), np.float32)
o, lse = pyfa.fa2_forward(q, q, q, options=pyfa.Options(backend="emu", block_r=4, block_c=4))
print("ran", float(o.sum()))
"""


@pytest.mark.parametrize("value, expect", [("strict", "ran 20.0"),
                                           ("everything", "PYFA_EMU_CHECK: expected \"strict\" or \"off\"")])
def test_the_environment_switches_strict_mode_for_a_whole_run(value, expect):
    env = dict(os.environ, PYFA_EMU_CHECK=value)
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert expect in run.stdout + run.stderr, run.stdout + run.stderr
