"""The native cpu backend: every instruction-set build (forced through PYFA_CPU_ISA) and
every thread count give the simulator's and the emulator's bits, forward and backward,
both algorithms; the threads knob, cancellation through config->progress, and the
errors of the ISA switch. (tests/grid.py also runs the shared grid, the random shapes and
the special values on "cpu" with its default build and thread count.)"""

import functools
import os
import platform
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import grid
import pyfa
from pyfa import _lib
from reference import make_inputs, same_bits
from test_random_shapes import draw, simulated as simulated_draw
from test_special_values import poisoned_inputs

# Children import the pyfa under test from here.
ROOT = Path(pyfa.__file__).resolve().parents[1]


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


X86 = platform.machine().lower() in ("x86_64", "amd64")
FLAGS = cpu_flags()
# What each build needs (src/backends/cpu/cpu_backend.cpp): None when we cannot tell here.
NEEDS = {"avx512_wide": {"avx512f", "fma"}, "avx512": {"avx512f", "fma"}, "avx2": {"avx2", "fma"},
         "portable": set()}


def expected_available(isa):
    if isa == "portable":
        return True
    if not X86:
        return False
    return None if FLAGS is None else NEEDS[isa] <= FLAGS


ISAS = ["avx512_wide", "avx512", "avx2", "portable"]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Forces one build for the test; skipped (with the reason) where this CPU lacks it."""
    name = request.param
    if not expected_available(name):
        pytest.skip(f"this CPU cannot run the {name} build")
    monkeypatch.setenv("PYFA_CPU_ISA", name)
    return name


@pytest.mark.parametrize("name", ISAS)
def test_isa_switch_runs_exactly_the_builds_this_cpu_supports(name, monkeypatch):
    expected = expected_available(name)
    if expected is None:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    monkeypatch.setenv("PYFA_CPU_ISA", name)
    q, k, v = make_inputs((1, 1, 8, 8), (1, 1, 8, 8), seed=1)
    # The cpu profile's name says which build a call takes now (tools/bench.py prints it).
    profile = pyfa.device_profile("cpu")["name"]
    if expected:
        o = pyfa.attention(q, k, v, backend="cpu")
        assert same_bits(o, pyfa.attention(q, k, v, backend="emu"))
        assert profile.startswith(f"pyfa cpu {name} "), profile
    else:
        with pytest.raises(pyfa.BackendUnavailableError, match=f"PYFA_CPU_ISA={name}"):
            pyfa.attention(q, k, v, backend="cpu")
        assert profile.startswith("pyfa cpu none "), profile


def cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@pytest.mark.parametrize("setting", [None, "auto"])
def test_auto_takes_the_schedule_of_this_microarchitecture(setting, monkeypatch):
    """auto: the best instruction set, and on AVX-512 the schedule of the vendor's cores
    (docs/cpu_backend.md): the 4 x 6 register tiles on Intel, 2 x 6 elsewhere."""
    if setting is None:
        monkeypatch.delenv("PYFA_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("PYFA_CPU_ISA", setting)
    if FLAGS is None or not X86:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    if NEEDS["avx512"] <= FLAGS:
        want = "avx512_wide" if cpu_vendor() == "GenuineIntel" else "avx512"
    else:
        want = "avx2" if NEEDS["avx2"] <= FLAGS else "portable"
    assert pyfa.device_profile("cpu")["name"].startswith(f"pyfa cpu {want} ")


def test_unknown_isa_names_the_variable(monkeypatch):
    monkeypatch.setenv("PYFA_CPU_ISA", "sse9")
    q, k, v = make_inputs((1, 1, 4, 4), (1, 1, 4, 4), seed=1)
    with pytest.raises(pyfa.PyfaError, match="PYFA_CPU_ISA.*sse9"):
        pyfa.attention(q, k, v, backend="cpu")
    assert pyfa.device_profile("cpu")["name"].startswith("pyfa cpu none ")


# The shared grid, plus default tiles where the algorithms' defaults differ (FA1 at d = 96
# and 256, FA2's backward at d = 256 with 32 x 32 tiles; at Nq >= 128 the FA2 forward's
# items of 64 rows over those 32-row tiles) and a head count above the thread counts, so
# the one-pass backward (a head per thread) runs beside the split one.
CASES = grid.CASES + [
    (1, 1, 90, 90, 96, None, None),
    (1, 1, 45, 70, 256, None, None),
    (1, 1, 150, 140, 256, None, None),
    (2, 3, 80, 80, 32, 16, 16),
]


def split(kw, **execution):
    """kw as (the semantic keywords, a pyfa.Options of the rest and `execution`)."""
    chosen = {n: x for n, x in kw.items() if n in pyfa.options.FIELDS}
    return ({n: x for n, x in kw.items() if n not in chosen},
            pyfa.Options(**chosen, **execution))


def simulate(q, k, v, do, kw):
    kw, options = split(kw)
    f2 = pyfa.sim.fa2_forward(q, k, v, **kw, options=options)
    b2 = pyfa.sim.fa2_backward(q, k, v, f2.o, f2.lse, do, **kw, options=options)
    f1 = pyfa.sim.fa1_forward(q, k, v, **kw, options=options)
    b1 = pyfa.sim.fa1_backward(q, k, v, f1.o, f1.m, f1.l, do, **kw, options=options)
    return (f2.o, f2.lse), (b2.dq, b2.dk, b2.dv), (f1.o, f1.m, f1.l), (b1.dq, b1.dk, b1.dv)


@functools.lru_cache(maxsize=None)
def simulated(case, causal):
    B, H, Nq, Nk, d, Br, Bc = case
    q, k, v, do = make_inputs((B, H, Nq, d), (B, H, Nk, d), grid.case_seed(case), "do")
    kw = dict(causal=causal, block_r=Br, block_c=Bc)
    return (q, k, v, do), kw, simulate(q, k, v, do, kw)


def run_cpu(inputs, kw, **run):
    """fa2 forward, fa2 backward, fa1 forward, fa1 backward on the cpu backend, each
    backward from the simulator-equal forward results."""
    q, k, v, do = inputs
    kw, options = split(kw, backend="cpu", **run)
    f2 = pyfa.fa2_forward(q, k, v, **kw, options=options)
    b2 = pyfa.fa2_backward(q, k, v, *f2, do, **kw, options=options)
    f1 = pyfa.fa1_forward(q, k, v, **kw, options=options)
    b1 = pyfa.fa1_backward(q, k, v, *f1, do, **kw, options=options)
    return f2, b2, f1, b1


NAMES = ("fa2 forward", "fa2 backward", "fa1 forward", "fa1 backward")


def assert_same(got, want, what):
    for name, g, w in zip(NAMES, got, want):
        for n, (a, b) in enumerate(zip(g, w)):
            assert same_bits(a, b), f"{name}, output {n}: {what}"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
# One xdist group per case, for both tests below: simulated() runs once per case and mask.
@pytest.mark.parametrize("case", grid.grouped(CASES, "cpu_backend"))
def test_every_build_and_thread_count_equals_the_simulator(case, causal, threads, isa):
    inputs, kw, want = simulated(case, causal)
    assert_same(run_cpu(inputs, kw, threads=threads), want, f"{isa}, {threads} threads")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", grid.grouped(CASES[-4:], "cpu_backend"))
def test_equals_the_emulator(case, causal, isa):
    (q, k, v, do), kw, _ = simulated(case, causal)
    got = run_cpu((q, k, v, do), kw, threads=2)
    f2 = pyfa.fa2_forward(q, k, v, backend="emu", **kw)
    f1 = pyfa.fa1_forward(q, k, v, backend="emu", **kw)
    want = (f2, pyfa.fa2_backward(q, k, v, *f2, do, backend="emu", **kw),
            f1, pyfa.fa1_backward(q, k, v, *f1, do, backend="emu", **kw))
    assert_same(got, want, isa)


# Each seed in test_random_shapes.py's xdist group of it: the simulator's results of a
# seed are computed once for both files.
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.xdist_group(f"random_shapes-{s}"))
                                  for s in range(0, 48, 3)])
def test_random_shapes_every_build(seed, isa):
    (q, k, v, do), kw, _ = draw(seed)
    f2, b2, f1, b1 = simulated_draw(seed)
    want = (f2.o, f2.lse), (b2.dq, b2.dk, b2.dv), (f1.o, f1.m, f1.l), (b1.dq, b1.dk, b1.dv)
    assert_same(run_cpu((q, k, v, do), kw, threads=1 + seed % 3), want, f"{isa} {kw}")


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_special_values_every_build(seed, causal, isa):
    q, k, v, do = poisoned_inputs(seed)
    kw = dict(causal=causal, block_r=4, block_c=8)
    want = simulate(q, k, v, do, kw)
    for threads in (1, 2):
        got = run_cpu((q, k, v, do), kw, threads=threads)
        assert np.isnan(got[0][0]).any(), "the poisoned inputs should reach the output"
        assert_same(got, want, f"{isa}, {threads} threads")


def test_results_do_not_depend_on_the_thread_count():
    # Default tiles, several row and column blocks, heads fewer and more than the threads.
    for B, H in ((1, 1), (2, 3)):
        q, k, v, do = make_inputs((B, H, 200, 64), (B, H, 260, 64), B * H, "do")
        first = None
        for threads in (0, 1, 2, 3, 5):
            got = run_cpu((q, k, v, do), dict(causal=True), threads=threads)
            if first is None:
                first = got
            else:
                assert_same(got, first, f"B={B} H={H} threads={threads}")


def test_calls_from_several_threads_at_once_keep_their_bits():
    # The library keeps its worker threads between calls (src/backends/cpu/thread_pool.cpp); a call
    # that finds them busy with another call starts threads of its own.
    q, k, v, do = make_inputs((2, 3, 200, 64), (2, 3, 260, 64), 6, "do")
    want = run_cpu((q, k, v, do), dict(causal=True), threads=1)
    results, errors = {}, []

    def caller(n):
        try:
            for _ in range(3):
                results.setdefault(n, []).append(run_cpu((q, k, v, do), dict(causal=True), threads=2 + n % 2))
        except Exception as e:  # reported below, with the thread's number
            errors.append((n, e))

    callers = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(300)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3] and all(len(r) == 3 for r in results.values())
    for n, runs in results.items():
        for got in runs:
            assert_same(got, want, f"caller {n}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_multithreaded_calls():
    # The parent's worker threads are not in a child forked after a call: the child must
    # start its own instead of waiting for threads that do not exist.
    code = textwrap.dedent("""
        import os
        import numpy as np
        import pyfa
        q = np.random.default_rng(1).standard_normal((1, 4, 256, 32), dtype=np.float32)
        first = pyfa.attention(q, q, q, backend="cpu", threads=2)
        pid = os.fork()
        if pid == 0:
            again = pyfa.attention(q, q, q, backend="cpu", threads=3)
            os._exit(0 if np.array_equal(again, first) else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["child", "0"], run.stdout + run.stderr


def test_auto_is_cpu_without_a_gpu_and_backends_lists_cpu():
    assert "cpu" in pyfa.backends() and "emu" in pyfa.backends()
    if grid.HAS_CUDA:
        pytest.skip("a GPU is here: auto means CUDA")
    q, k, v = make_inputs((1, 2, 30, 16), (1, 2, 30, 16), seed=2)
    ffi, lib = _lib.load()
    assert lib.pyfa_backend_available(lib.PYFA_BACKEND_CPU) == 1 and lib.pyfa_backend_compiled(lib.PYFA_BACKEND_CPU) == 1
    assert same_bits(pyfa.attention(q, k, v), pyfa.attention(q, k, v, backend="cpu"))


def test_default_tiles_are_the_emulators():
    for d in (1, 64, 96, 128, 256):
        for kernel in pyfa.api.KERNELS:
            assert pyfa.default_tiles(kernel, d, "cpu") == pyfa.default_tiles(kernel, d, "emu")
    assert pyfa.device_profile("cpu")["smem_per_block"] == pyfa.device_profile("emu")["smem_per_block"]


def test_threads_argument_is_checked():
    q, k, v = make_inputs((4, 4), (4, 4), seed=1)
    with pytest.raises(ValueError, match="threads"):
        pyfa.attention(q, k, v, backend="cpu", threads=-1)
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match="threads"):
            pyfa.attention(q, k, v, backend="cpu", threads=bad)


def c_call(threads=0, progress=None, flags=0, struct_size=None):
    """pyfa_fa2_backward on the cpu backend through the C ABI, outputs prefilled with 7;
    struct_size None: sizeof(pyfa_config)."""
    ffi, lib = _lib.load()
    q, k, v, do = make_inputs((2, 2, 256, 32), (2, 2, 256, 32), 3, "do")
    o, lse = pyfa.fa2_forward(q, k, v, backend="cpu")
    outs = [np.full_like(q, 7.0) for _ in range(3)]
    pr = ffi.new("pyfa_problem *", dict(batch=2, heads=2, seqlen_q=256, seqlen_k=256, head_dim=32))
    cfg = ffi.new("pyfa_config *", dict(backend=3, block_r=16, block_c=16, threads=threads, flags=flags))
    cfg.struct_size = ffi.sizeof("pyfa_config") if struct_size is None else struct_size
    if progress is not None:
        cfg.progress = progress
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    st = lib.pyfa_fa2_backward(pr, cfg, *(ptr(x) for x in (q, k, v, o, lse, do)), *(ptr(x) for x in outs))
    return st, outs, ffi.string(lib.pyfa_last_error()).decode()


def test_negative_threads_through_the_c_abi_names_the_field():
    st, outs, msg = c_call(threads=-2)
    assert st == 1 and "config->threads" in msg
    assert all(np.all(x == 7.0) for x in outs)


def test_progress_reports_and_cancels_without_writing():
    ffi, _ = _lib.load()
    seen = []

    @ffi.callback("int(void *, int64_t, int64_t)")
    def watch(user, done, total):
        seen.append((done, total))
        return 0

    st, outs, _ = c_call(threads=2, progress=watch)
    assert st == 0 and seen, "progress was never called"
    assert all(0 < done <= total for done, total in seen)
    ref = c_call(threads=2)[1]
    assert all(same_bits(a, b) for a, b in zip(outs, ref))

    calls = []

    @ffi.callback("int(void *, int64_t, int64_t)")
    def stop(user, done, total):
        calls.append(done)
        return 1

    st, outs, msg = c_call(threads=2, progress=stop)
    assert st == 8 and "cancel" in msg, msg
    assert len(calls) == 1, "polled again after asking to stop"
    assert all(np.all(x == 7.0) for x in outs), "a cancelled call wrote the caller's outputs"


def test_in_place_writes_the_outputs_directly_and_only_when_asked():
    ffi, lib = _lib.load()
    calls = []

    @ffi.callback("int(void *, int64_t, int64_t)")
    def stop(user, done, total):
        calls.append(done)
        return 1

    in_place = lib.PYFA_FLAG_IN_PLACE
    # The same bits either way.
    st, outs, _ = c_call(threads=2, flags=in_place)
    assert st == 0 and all(same_bits(a, b) for a, b in zip(outs, c_call(threads=2)[1]))
    # Cancelled at the first poll, after the first work item: in place, that item's
    # outputs are already in the caller's arrays; staged, nothing is.
    st, outs, _ = c_call(threads=1, progress=stop, flags=in_place)
    assert st == 8 and any(np.any(x != 7.0) for x in outs), "in place, yet nothing was written"
    # struct_size 0 is ABI 3's layout, which ends before flags: they are not read.
    st, outs, _ = c_call(threads=1, progress=stop, flags=in_place, struct_size=0)
    assert st == 8 and all(np.all(x == 7.0) for x in outs), "struct_size 0 read config->flags"
    st, outs, msg = c_call(flags=in_place | 8)
    assert st == 1 and "config->flags" in msg and all(np.all(x == 7.0) for x in outs)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_peak_memory_is_inputs_and_outputs_and_a_few_tiles():
    # Issue 13: a call needs its inputs, its outputs and O(threads x tile), nothing N x N
    # and no second copy of the outputs. In a fresh process, the high-water mark of its
    # resident memory (VmHWM) is read before and after one forward and one backward.
    code = textwrap.dedent("""
        import numpy as np
        import pyfa
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        B, H, N, d = 1, 4, 2048, 128
        rng = np.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((B, H, N, d), dtype=np.float32) for _ in range(4))
        small = q[:, :, :64]
        pyfa.fa2_backward(small, small, small, *pyfa.fa2_forward(small, small, small, backend="cpu"),
                          small, backend="cpu", threads=2)
        base = hwm()
        o, lse = pyfa.fa2_forward(q, k, v, backend="cpu", threads=2)
        fwd = hwm() - base
        grads = pyfa.fa2_backward(q, k, v, o, lse, do, backend="cpu", threads=2)
        bwd = hwm() - base
        print(fwd, bwd, q.nbytes)
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    fwd, bwd, tensor = map(int, run.stdout.split())
    # Two threads' workspaces (about 0.4 MiB each at d = 128), stacks, allocator noise;
    # a staged copy of the outputs (4 MiB forward, 12 MiB backward) does not fit.
    slack = 2 << 20
    # Forward: O and LSE (tensor + tensor / d); then dQ, dK, dV and D (B x H x N) too.
    assert fwd <= tensor + tensor // 128 + slack, (fwd / 2**20, tensor / 2**20)
    assert bwd <= fwd + 3 * tensor + tensor // 128 + slack, (bwd / 2**20, tensor / 2**20)


@pytest.mark.slow
def test_bench_sweep_smoke_prints_ratios_on_its_last_line():
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(pyfa.__file__).resolve().parent.parent),
                                                    env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, str(root / "tools" / "bench.py"), "--sweep", "--smoke", "--sizes", "64",
                        "--head-dims", "16", "--threads", "1", "2", "--rounds", "1", "--repeats", "1",
                        "--gap", "0", "--contenders", "cpu,numpy"],
                       cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert re.match(r"summary: sweep B=1 H=4 cpu/numpy throughput: geomean=\d+\.\d+x over 8, min=", lines[-1]), lines[-1]
    rows = [l for l in lines if re.match(r"\s+64\s+16\s+(True|False)\s+[12]\s+(cpu|numpy)\s", l)]
    assert len(rows) == 8, p.stdout


# Decoding shapes (Nq <= kGroupRows = 8, src/backends/cpu/cpu_kernels.h) take the grouped
# forward (forward_group: a GQA group's query heads together, lanes along keys). Each
# case: (B, H, Hkv, Nq, Nk, d, Br, Bc, keywords); d = 40 and 20 leave edges of the W x W
# transposes, Nk not a multiple of Bc a short last tile; d = 64 and 128 take the transposes
# with a constant row stride and P~ V's whole-row register tiles over V read in place.
# R = G * Nq rows of at most 8 (AVX-512) or 4 (AVX2, portable) with d a multiple of the
# vector width take the scores in registers (scores_in_registers), the others K_j^T in
# memory: R = 1 to 8 appear below.
SLOPES = np.linspace(0.05, 0.6, 8, dtype=np.float32)
DECODE_CASES = [
    (1, 8, 2, 1, 77, 40, 16, 16, {}),
    (2, 4, 4, 3, 53, 20, 4, 8, dict(causal=True)),
    (1, 6, 1, 8, 100, 32, 8, 16, dict(window=(17, 2))),
    (1, 8, 2, 1, 77, 40, 16, 16, dict(split_size=32)),
    (1, 8, 4, 2, 90, 48, 16, 16, dict(causal=True, split_size=48, softcap=3.0, alibi_slopes=SLOPES)),
    (2, 4, 2, 5, 41, 16, 8, 8, dict(causal=True, dropout_p=0.3, seed=7)),
    (1, 4, 2, 2, 37, 24, 8, 8, dict(bias=True)),
    (1, 4, 1, 1, 150, 128, 16, 32, {}),
    (1, 8, 2, 2, 97, 64, 8, 32, dict(causal=True, softcap=2.0)),
    (1, 6, 2, 2, 45, 32, 8, 16, dict(causal=True)),
    (2, 2, 2, 1, 70, 64, 16, 32, {}),
    (1, 7, 1, 1, 33, 16, 8, 16, dict(window=(5, 0))),
    (1, 4, 2, 1, 64, 32, 8, 16, {}),
    (1, 10, 2, 1, 64, 32, 8, 16, dict(causal=True)),
]


@functools.lru_cache(maxsize=None)
def decode_case(n):
    B, H, Hkv, Nq, Nk, d, Br, Bc, kw = DECODE_CASES[n]
    rng = np.random.default_rng(100 + n)
    q = rng.standard_normal((B, H, Nq, d), dtype=np.float32)
    k, v = (rng.standard_normal((B, Hkv, Nk, d), dtype=np.float32) for _ in range(2))
    kw = dict(kw, block_r=Br, block_c=Bc)
    if kw.get("bias"):
        kw["bias"] = rng.standard_normal((B, H, Nq, Nk), dtype=np.float32)
    if n == 0:  # special values, as test_special_values poisons them
        for x in (q, k, v):
            x.flat[rng.integers(0, x.size, 3)] = [np.inf, -np.inf, np.nan]
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"][:H]
    sem, options = split(kw)
    sim = pyfa.sim.fa2_forward(q, k, v, **sem, options=options)
    return (q, k, v), kw, (sim.o, sim.lse)


@pytest.mark.parametrize("n", range(len(DECODE_CASES)))
def test_decode_shapes_equal_the_simulator(n, isa):
    (q, k, v), kw, want = decode_case(n)
    sem, _ = split(kw)
    for threads in (1, 3):
        _, options = split(kw, backend="cpu", threads=threads)
        got = pyfa.fa2_forward(q, k, v, **sem, options=options)
        assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), f"{isa}, {threads} threads, {kw}"


def test_split_decode_runs_of_chunks_equal_the_simulator(isa):
    """A split decoding step's items are runs of consecutive chunks of one K/V head, each
    chunk's last tile prefetching the next one's first: 18 chunks of 64 keys make runs of
    4 (a short last run of 2) on one thread, 2 on two, 1 on three; the bits stay the
    simulator's."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 4, 1, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 1, 1100, 64), dtype=np.float32) for _ in range(2))
    want = pyfa.sim.fa2_forward(q, k, v, split_size=64, block_c=64)
    for threads in (1, 2, 3):
        got = pyfa.fa2_forward(q, k, v, split_size=64, block_c=64,
                               options=pyfa.Options(backend="cpu", threads=threads))
        assert same_bits(got[0], want.o) and same_bits(got[1], want.lse), f"{isa}, {threads} threads"


def test_decode_varlen_equals_the_simulator():
    # Packed sequences of 1, 0 and 3 query rows against 50, 9 and 70 keys, GQA 4:1.
    rng = np.random.default_rng(5)
    lq, lk = [1, 0, 3], [50, 9, 70]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], 8, 32), dtype=np.float32)
    k, v = (rng.standard_normal((ck[-1], 2, 32), dtype=np.float32) for _ in range(2))
    tiles = dict(block_r=8, block_c=16)
    want = pyfa.sim.fa2_forward_varlen(q, k, v, cq, ck, causal=True, options=pyfa.Options(**tiles))
    got = pyfa.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True,
                                options=pyfa.Options(backend="cpu", threads=2, **tiles))
    assert same_bits(got[0], want.o) and same_bits(got[1], want.lse)


def in_line_at(a, offset):
    """A copy of `a` starting `offset` floats past a 64-byte line, NaN around it (what
    the loads of whole lines read beside the array must never reach a result)."""
    raw = np.full(a.size + 32, np.nan, np.float32)
    start = (-raw.ctypes.data // 4) % 16 + offset
    out = raw[start:start + a.size].reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("d", [16, 80, 128])
def test_decode_k_and_v_anywhere_in_a_line_every_build(d, isa):
    """K and V rows that start anywhere in a 64-byte line (NumPy's large arrays start 16
    bytes past one): S = Q K^T in blocks from the line boundary before x = 0 (their lanes
    outside the row, NaN here, take no step), P~ V reading V in place (loads that
    straddle two lines) or gathered (pages of 3), in tiles the mask cuts (causal, 3 rows)
    or not, and rows a stride apart that is no whole line: the simulator's bits at every
    offset, on every build."""
    rng = np.random.default_rng(d + 1)
    B, N, H, Hkv, page = 1, 100, 8, 2, 3
    tiles = dict(block_r=8, block_c=32)
    q = rng.standard_normal((B, H, 3, d), dtype=np.float32)
    k, v = (rng.standard_normal((B, Hkv, N, d), dtype=np.float32) for _ in range(2))
    dense = pyfa.sim.fa2_forward(q, k, v, causal=True, **tiles)
    qc = np.ascontiguousarray(q[:, :, -1:].transpose(0, 2, 1, 3))
    kc, vc = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
    lens = np.array([N], np.int32)
    cache = pyfa.sim.attention_with_kvcache(qc, kc, vc, lens, return_lse=True, options=pyfa.Options(**tiles))
    per = -(-N // page)
    table = rng.permutation(per).astype(np.int32).reshape(1, per)
    kp, vp = (np.zeros((per, page, Hkv, d), np.float32) for _ in range(2))
    for x, pages in ((kc, kp), (vc, vp)):
        padded = np.zeros((1, per * page, Hkv, d), np.float32)
        padded[:, :N] = x
        pages[table] = padded.reshape(1, per, page, Hkv, d)
    wide = np.full((B, N, Hkv, d + 4), np.nan, np.float32)  # rows (Hkv (d + 4)) floats apart
    for offset in (0, 1, 4, 7, 12, 15):
        placed = {}
        for name, x in dict(k=k, v=v, kc=kc, vc=vc, kp=kp, vp=vp, kw=wide, vw=wide).items():
            placed[name] = in_line_at(x, offset)
        placed["kw"][..., :d] = kc
        placed["vw"][..., :d] = vc
        for threads in (1, 2):
            cpu = pyfa.Options(backend="cpu", threads=threads, **tiles)
            where = f"{isa}, K and V at +{offset} floats, {threads} threads"
            got = pyfa.fa2_forward(q, placed["k"], placed["v"], causal=True, options=cpu)
            assert same_bits(got[0], dense.o) and same_bits(got[1], dense.lse), where + ", dense causal"
            for kk, vv, tb in (("kc", "vc", None), ("kp", "vp", table), ("kw", "vw", None)):
                got = pyfa.attention_with_kvcache(qc, placed[kk][..., :d], placed[vv][..., :d], lens, block_table=tb,
                                                  return_lse=True, options=cpu)
                assert same_bits(got[0], cache[0]) and same_bits(got[1], cache[1]), f"{where}, {kk}"


@pytest.mark.parametrize("d", [40, 128])
def test_decode_kv_caches_every_build(d, isa):
    """A decoding step against flash-attn's (B, N, Hkv, d) cache and against paged caches
    (pages of 3, 16 and 48 rows, shuffled; with 48, tiles of 32 keys alternate between
    lying in one page, read in place, and crossing two, gathered): rows a stride apart,
    read with the next tile prefetched on every build (forward_group). An item takes all
    four K/V heads (one run of each key row) except with 3 threads and no split, where it
    takes two (runs a row stride apart): the simulator's bits every way, dense layout or
    pages, split or not."""
    rng = np.random.default_rng(d)
    B, N, H, Hkv = 2, 150, 8, 4
    q = rng.standard_normal((B, 1, H, d), dtype=np.float32)
    k, v = (rng.standard_normal((B, N, Hkv, d), dtype=np.float32) for _ in range(2))
    lens = np.array([150, 97], np.int32)
    caches = [(k, v, None)]
    for page in (3, 16, 48):
        per = -(-N // page)
        table = rng.permutation(B * per).astype(np.int32).reshape(B, per)
        pages = []
        for x in (k, v):
            padded = np.zeros((B, per * page, Hkv, d), np.float32)
            padded[:, :N] = x
            paged = np.full((B * per, page, Hkv, d), np.nan, np.float32)
            paged[table] = padded.reshape(B, per, page, Hkv, d)
            pages.append(paged)
        caches.append((*pages, table))
    for split_size in (None, 64):
        tiles = dict(block_r=16, block_c=32)
        want = pyfa.sim.attention_with_kvcache(q, k, v, lens, split_size=split_size, return_lse=True,
                                               options=pyfa.Options(**tiles))
        for kc, vc, table in caches:
            for threads in (1, 3):
                got = pyfa.attention_with_kvcache(q, kc, vc, lens, block_table=table, split_size=split_size,
                                                  return_lse=True,
                                                  options=pyfa.Options(backend="cpu", threads=threads, **tiles))
                where = f"{isa}, {threads} threads, pages {None if table is None else kc.shape[1]}, split {split_size}"
                assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), where
