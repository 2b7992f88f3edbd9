#!/usr/bin/env python3
"""CPU benchmark: pyfa's cpu backend, emulator and simulator against plain NumPy attention
(and PyTorch's CPU SDPA when torch imports).

Two modes. The default compares, on one shape and in one process, every pyfa CPU path
with NumPy (below). --sweep is the cpu backend's benchmark (issue 13, tools/README.md):
FA2 on "cpu" against torch SDPA and NumPy over N, d, causal and thread counts, each
contender timed in a process of its own; its last line holds the throughput ratios.

Every column runs in the same process, on the same float32 inputs:
  numpy   softmax(scale * Q K^T) V as matmul, softmax, matmul; for the backward the
          textbook gradient from the saved O (P recomputed, dV = P^T dO, dS = P o (dP - D))
  cpu     the native cpu backend (backend "cpu"): the same bits, vectorised
  emu     the CUDA kernels run on the CPU by the emulator (backend "emu"): the readable ones
  emu/fast  the same with variant="fast" (the register-tiled kernels, at their own default
          tiles); where an algorithm has none, the column names what is missing
  sim     the NumPy simulator of the same kernels (pyfa.sim)
  torch   torch.nn.functional.scaled_dot_product_attention on the CPU (backward:
          autograd.grad of it), when torch imports
Forward passes go through pyfa.attention(algo=...); backward passes alone through
pyfa.<algo>_backward and pyfa.sim.<algo>_backward, from the simulator's saved forward
tensors. Algorithms are discovered at run time (pyfa.api._FORWARD), so new kernels are
covered without changes here.

Timing: one warm-up call per column, then --repeats rounds, each round timing every
column of a group once in turn, so that load from other processes falls on all columns
alike; each figure is the median over the rounds (the fastest round beside it), each
ratio that median over NumPy's (above 1: slower than NumPy). The load average is printed
before and after: on a busy machine NumPy's multithreaded BLAS can slow down far more than
single-threaded code. The last line is a one-line summary.

    python tools/bench.py --quick      # B=1 H=4 N=256 d=64
    python tools/bench.py --smoke      # tiny, for the test suite
    python tools/bench.py              # B=1 H=8 N=1024 d=64
    python tools/bench.py --sweep      # cpu vs torch vs NumPy, N 1024/2048, d 64/128
"""

import argparse
import inspect
import json
import os
import math
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_probe  # noqa: E402  (tools/cpu_probe.py, beside this script)

import pyfa
from pyfa.sim.mask import Mask

PRESETS = {  # (batch, heads, seqlen, head_dim, repeats)
    "smoke": (1, 2, 64, 32, 3),
    "quick": (1, 4, 256, 64, 5),
    "full": (1, 8, 1024, 64, 3),
}
SAVED = ("o", "lse", "m", "l")  # forward results a backward pass may take


def causal_hidden(nq, nk):
    """True where key c is hidden from query r (bottom-right aligned, pyfa.sim.mask)."""
    mask = Mask.resolve(True, None, "bottom_right", nq, nk)
    return mask.masked(np.arange(nq)[:, None], np.arange(nk)[None, :])


def numpy_probs(q, k, causal, scale):
    s = np.matmul(q, k.swapaxes(-1, -2))
    s *= scale
    if causal:
        s[..., causal_hidden(q.shape[-2], k.shape[-2])] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s, out=s)
    p /= p.sum(axis=-1, keepdims=True)
    return p


def numpy_forward(q, k, v, causal, scale):
    return np.matmul(numpy_probs(q, k, causal, scale), v)


def numpy_backward(q, k, v, o, do, causal, scale):
    """(dQ, dK, dV) of O = softmax(scale Q K^T) V, P recomputed as a fused kernel would."""
    p = numpy_probs(q, k, causal, scale)
    dv = np.matmul(p.swapaxes(-1, -2), do)
    dp = np.matmul(do, v.swapaxes(-1, -2))
    ds = p * (dp - np.sum(do * o, axis=-1, keepdims=True))
    ds *= scale
    return np.matmul(ds, k), np.matmul(ds.swapaxes(-1, -2), q), dv


def import_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


# The execution options of the columns (pyfa.Options: the simulator takes them too and
# uses only what it simulates).
EMU_REFERENCE = pyfa.Options(backend="emu", variant="reference")
EMU_FAST = pyfa.Options(backend="emu", variant="fast")
CPU = pyfa.Options(backend="cpu")


def bind_by_name(fn, tensors, extra):
    """A call of fn with the arrays its parameters name (q, k, v, o, lse, m, l, do, ...)
    and the keywords of `extra` it takes; None when it requires a parameter we lack."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    args, kwargs = [], {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in tensors:
            if p.kind == p.POSITIONAL_ONLY:
                args.append(tensors[name])
            else:
                kwargs[name] = tensors[name]
        elif name in extra:
            kwargs[name] = extra[name]
        elif p.default is p.empty:
            return None
    return lambda: fn(*args, **kwargs)


def same_bits(a, b):
    return all(np.array_equal(np.asarray(x, np.float32).view(np.uint32), np.asarray(y, np.float32).view(np.uint32))
               for x, y in zip(a, b))


def blas_name():
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy has no mode="dicts"; the name is only informative
        return "unknown"


def flops_forward(b, h, n, d, causal):
    """4 B H N^2 d (the two matmuls), halved under the causal mask: the FA2 paper's count."""
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


class Column:
    """One timed column: a call, and what to say about its result (given all results)."""

    def __init__(self, name, fn, note=None):
        self.name, self.fn, self.note_fn = name, fn, note
        self.times, self.result, self.note = [], None, ""


def time_group(columns, repeats, gap=0.0, burst=0, warm_ms=0.0):
    """Warm-up, then `repeats` rounds over the columns in turn. A column whose call fails
    (a kernel still in the works, say) keeps the error as its note and is left out.
    burst > 0: in each round a column waits `gap` idle seconds (so that threads the previous
    contender left spinning, BLAS's or OpenMP's, are quiet), makes untimed calls back to
    back until `warm_ms` have passed (at least one: its own threads wake up), then `burst`
    timed calls back to back, as a decoding loop makes them."""
    live = []
    for c in columns:
        if c.fn is None:
            continue
        try:
            c.result = c.fn()
            live.append(c)
        except Exception as e:
            c.note = f"error: {type(e).__name__}: {e}"
    for _ in range(repeats):
        for c in live:
            if burst:
                time.sleep(gap)
                start = time.perf_counter()
                c.fn()
                while (time.perf_counter() - start) * 1e3 < warm_ms:
                    c.fn()
            for _ in range(burst or 1):
                t0 = time.perf_counter()
                c.fn()
                c.times.append((time.perf_counter() - t0) * 1e3)
    results = {c.name: c.result for c in live}
    for c in live:
        if c.note_fn:
            c.note = c.note_fn(c.result, results) or ""
    return [(c.name, statistics.median(c.times) if c.times else None, min(c.times, default=None), c.note)
            for c in columns]


def run(args):
    b, h, n, d, repeats = PRESETS[args.preset]
    b, h, n, d = (args.batch or b, args.heads or h, args.seqlen or n, args.head_dim or d)
    repeats = args.repeats or repeats
    rng = np.random.default_rng(args.seed)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=np.float32) for _ in range(4))
    scale = np.float32(1.0) / np.sqrt(np.float32(d))
    causal = args.causal
    torch = import_torch()

    print(f"pyfa bench (CPU): B={b} H={h} N={n} d={d} causal={causal}; 1 warm-up, median of {repeats} "
          f"interleaved rounds; {os.cpu_count()} cores ({platform.machine()}), load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"numpy {np.__version__} (BLAS {blas_name()}); pyfa {pyfa.__version__}, library "
          f"{pyfa.library_version()}; torch {torch.__version__ if torch else 'not installed'}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if var in os.environ:
            print(f"note: {var}={os.environ[var]} is set; the NumPy figures are as run with it")

    fwd_flops = flops_forward(b, h, n, d, causal)
    o_ref = numpy_forward(q, k, v, causal, scale)
    if torch is not None:
        tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, do))
        sdpa = torch.nn.functional.scaled_dot_product_attention

    def emu_note(o, results):
        return f"max|emu - numpy| / max|numpy| = {np.abs(o - o_ref).max() / np.abs(o_ref).max():.1e}"

    def bits_note(get_sim, get_emu):
        def note(sim, results):
            if results.get("emu") is None:
                return ""
            same = same_bits(get_emu(results["emu"]), get_sim(sim))
            return "emu == sim bit for bit" if same else "emu != sim: BITS DIFFER"
        return note

    def cpu_note(as_list):
        def note(cpu, results):
            if results.get("emu") is None:
                return ""
            return "cpu == emu bit for bit" if same_bits(as_list(cpu), as_list(results["emu"])) else \
                "cpu != emu: BITS DIFFER"
        return note

    def fast_note(kernels):
        def note(_, results):
            tiles = ", ".join(f"{kn} {'x'.join(map(str, pyfa.default_tiles(kn, d, 'emu', variant='fast')))}"
                              for kn in kernels)
            return f"variant fast, tiles {tiles}"
        return note

    groups, sims = [], {}  # sims: algo -> the simulator's forward result (saved tensors)
    for algo in sorted(pyfa.api._FORWARD):
        sim_fn = getattr(pyfa.sim, f"{algo}_forward", None)
        cols = [Column("numpy", lambda: numpy_forward(q, k, v, causal, scale)),
                Column("emu", lambda: pyfa.attention(q, k, v, causal=causal, algo=algo,
                                                     options=EMU_REFERENCE), emu_note),
                Column("emu/fast", lambda: pyfa.attention(q, k, v, causal=causal, algo=algo,
                                                          options=EMU_FAST),
                       fast_note(pyfa.api.OPS[f"{algo}_forward"].kernels)),
                Column("cpu", lambda: pyfa.attention(q, k, v, causal=causal, algo=algo, options=CPU),
                       cpu_note(lambda o: [o])),
                Column("sim", sim_fn and (lambda: sim_fn(q, k, v, causal=causal)),
                       bits_note(lambda r: [r.o], lambda o: [o]))]
        sim_col = cols[-1]
        if sim_fn is None:
            sim_col.note = f"pyfa.sim has no {algo}_forward"
        if torch is not None:
            cols.append(Column("torch", lambda: sdpa(tq, tk, tv, is_causal=causal),
                               lambda r, _: f"{torch.get_num_threads()} threads"))
        groups.append((f"{algo} forward", time_group(cols, repeats), fwd_flops))
        sims[algo] = sim_col.result

    for algo in sorted(pyfa.api._FORWARD):
        bwd = getattr(pyfa, f"{algo}_backward", None) or getattr(pyfa.api, f"{algo}_backward", None)
        if bwd is None:
            continue
        saved = {"q": q, "k": k, "v": v, "do": do, "dout": do}
        if sims.get(algo) is not None:
            saved.update({t: getattr(sims[algo], t) for t in SAVED if hasattr(sims[algo], t)})
        sim_fn = getattr(pyfa.sim, f"{algo}_backward", None)
        cols = [Column("numpy", lambda: numpy_backward(q, k, v, o_ref, do, causal, scale)),
                Column("emu", bind_by_name(bwd, saved, {"causal": causal, "options": EMU_REFERENCE})),
                Column("emu/fast", bind_by_name(bwd, saved, {"causal": causal, "options": EMU_FAST}),
                       fast_note(pyfa.api.OPS[f"{algo}_backward"].kernels)),
                Column("cpu", bind_by_name(bwd, saved, {"causal": causal, "options": CPU}), cpu_note(lambda g: g)),
                Column("sim", sim_fn and bind_by_name(sim_fn, saved, {"causal": causal}),
                       bits_note(lambda r: [r.dq, r.dk, r.dv], lambda g: g))]
        for c in cols[1:4]:
            if c.fn is None:
                c.note = f"pyfa.{algo}_backward: arguments not known, or no saved forward tensors"
        if cols[4].fn is None:
            cols[4].note = f"pyfa.sim.{algo}_backward not found or its arguments not known"
        if torch is not None:
            leaves = [t.clone().requires_grad_() for t in (tq, tk, tv)]
            out = sdpa(*leaves, is_causal=causal)
            cols.append(Column("torch", lambda: torch.autograd.grad(out, leaves, tdo, retain_graph=True),
                               lambda r, _: "autograd.grad of SDPA"))
        groups.append((f"{algo} backward", time_group(cols, repeats), 2.5 * fwd_flops))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return (b, h, n, d, repeats), groups


def report(shape, groups):
    b, h, n, d, _ = shape
    print("FLOPs: forward 4*B*H*N^2*d (halved if causal), backward 2.5x forward, as in the FA2 paper")
    print(f"{'':18} {'column':8} {'ms':>10} {'x numpy':>9} {'GFLOP/s':>9} {'min ms':>10}  note")
    parts = []
    for label, cols, flops in groups:
        base = cols[0][1]
        ratios = []
        for name, ms, fastest, note in cols:
            if ms is None:
                print(f"{label:18} {name:8} {'-':>10} {'-':>9} {'-':>9} {'-':>10}  {note}".rstrip())
                continue
            ratio = ms / base
            print(f"{label:18} {name:8} {ms:10.3f} {ratio:8.2f}x {flops / ms / 1e6:9.2f} {fastest:10.3f}  "
                  f"{note}".rstrip())
            if name != "numpy":
                ratios.append(f"{name}/numpy={ratio:.2f}x")
        parts.append(f"{label.replace('forward', 'fwd').replace('backward', 'bwd')}: " + " ".join(ratios))
    return f"summary: B={b} H={h} N={n} d={d} " + " | ".join(parts)


# ---------------------------------------------------------------------------------------
# --sweep: the cpu backend against PyTorch's CPU SDPA and NumPy (issue 13's benchmark)
# ---------------------------------------------------------------------------------------
CONTENDERS = ("cpu", "torch", "numpy")
# Not in the default set: FA1 on the cpu backend (its ratio reads FA2's throughput over
# FA1's; issue 13 asks FA1 for at least half of FA2's, i.e. at most 2x).
EXTRA_CONTENDERS = ("cpu_fa1",)
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def peak_rss_mib():
    """This process's peak resident memory: VmHWM where Linux has it, since ru_maxrss
    survives fork and exec, so a worker reported its parent's peak (the sweep process
    that had imported torch) whenever that was higher than its own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# Each sweep process warms each pass up for at least this long (and 2 calls) before timing;
# --sweep --smoke only makes the 2 calls, and measures the FMA peak in one short run.
WARMUP_S = 0.3
SMOKE_PEAK = dict(seconds=0.02, tries=1)


def sweep_worker(spec):
    """One contender at one configuration, alone in this process: warm-up, then `repeats`
    timed forward calls and `repeats` timed forward+backward calls. Prints one JSON line."""
    name, b, h, n, d = spec["name"], spec["batch"], spec["heads"], spec["seqlen"], spec["head_dim"]
    causal, threads, repeats = spec["causal"], spec["threads"], spec["repeats"]
    rng = np.random.default_rng(spec["seed"])
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=np.float32) for _ in range(4))
    scale = np.float32(1.0) / np.sqrt(np.float32(d))
    if name == "cpu":
        def fwd():
            return pyfa.fa2_forward(q, k, v, causal=causal,
                                    options=pyfa.Options(backend="cpu", threads=threads))

        def fwd_bwd():
            o, lse = fwd()
            return pyfa.fa2_backward(q, k, v, o, lse, do, causal=causal,
                                    options=pyfa.Options(backend="cpu", threads=threads))
    elif name == "cpu_fa1":
        def fwd():
            return pyfa.fa1_forward(q, k, v, causal=causal,
                                    options=pyfa.Options(backend="cpu", threads=threads))

        def fwd_bwd():
            o, m, l = fwd()
            return pyfa.fa1_backward(q, k, v, o, m, l, do, causal=causal,
                                    options=pyfa.Options(backend="cpu", threads=threads))
    elif name == "torch":
        torch = import_torch()
        if torch is None:
            print(json.dumps({"error": "torch does not import"}))
            return 0
        torch.set_num_threads(threads)
        tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, do))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd():
            with torch.no_grad():
                return sdpa(tq, tk, tv, is_causal=causal)

        def fwd_bwd():
            leaves = [t.clone().requires_grad_() for t in (tq, tk, tv)]
            return torch.autograd.grad(sdpa(*leaves, is_causal=causal), leaves, tdo)
    else:
        def fwd():
            return numpy_forward(q, k, v, causal, scale)

        def fwd_bwd():
            o = fwd()
            return numpy_backward(q, k, v, o, do, causal, scale)
    rss_inputs = peak_rss_mib()
    times = {"fwd": [], "fwd+bwd": []}
    cpu_times = {"fwd": [], "fwd+bwd": []}
    for label, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        # Warm-up: torch's first few calls run slower than its later ones (8.5 ms, then
        # 6.6 ms at N=1024 d=64 on two threads), so one call is not enough to be fair to it.
        warm_until, warm_calls = time.perf_counter() + spec["warmup_s"], 0
        while warm_calls < 2 or time.perf_counter() < warm_until:
            fn()
            warm_calls += 1
        for _ in range(repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[label].append((time.perf_counter() - t0) * 1e3)
            cpu_times[label].append((time.process_time() - c0) * 1e3)
    print(json.dumps({"times": times, "cpu_times": cpu_times, "rss_inputs_mib": rss_inputs,
                      "peak_rss_mib": peak_rss_mib(),
                      "threads_note": torch.get_num_threads() if name == "torch" else threads}))
    return 0


def run_worker(spec, gap_s):
    """spec's contender in a fresh process, its BLAS/OpenMP threads set before NumPy loads;
    then an idle gap, so that no helper thread left spinning reaches the next one."""
    env = dict(os.environ)
    for var in THREAD_VARS:
        env[var] = str(spec["threads"])
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                       capture_output=True, text=True, env=env)
    time.sleep(gap_s)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def geomean(xs):
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def sweep(args):
    contenders = [c for c in args.contenders.split(",") if c]
    for c in contenders:
        if c not in CONTENDERS + EXTRA_CONTENDERS:
            raise SystemExit(f"--contenders: unknown {c!r}; expected some of "
                             f"{','.join(CONTENDERS + EXTRA_CONTENDERS)}")
    configs = [(n, d, causal, t) for n in args.sizes for d in args.head_dims for causal in (False, True)
               for t in args.threads]
    torch = import_torch() if "torch" in contenders else None
    warmup_s = 0 if args.preset == "smoke" else WARMUP_S
    print(f"pyfa bench --sweep: FA2 on the cpu backend vs {', '.join(c for c in contenders if c != 'cpu')}; "
          f"B={args.batch} H={args.heads}; each contender in its own process, {args.rounds} round(s) of "
          f"{args.repeats} timed calls after a warm-up of {warmup_s} s, {args.gap:.1f} s idle between processes")
    print(f"{os.cpu_count()} cores ({platform.machine()}), load average {os.getloadavg()[0]:.2f} at the start; "
          f"numpy {np.__version__} (BLAS {blas_name()}); torch {torch.__version__ if torch else 'not used'}; "
          f"PYFA_CPU_ISA={os.environ.get('PYFA_CPU_ISA', 'auto')}")
    ident = cpu_probe.identity()
    probe = SMOKE_PEAK if args.preset == "smoke" else dict(seconds=0.15, tries=5)
    peaks = {t: cpu_probe.fma_peak(ident["isa"], t, **probe) for t in sorted(set(args.threads))}
    print(f"CPU: {ident['model_name']} ({ident['vendor']} family {ident['family']} model {ident['model']}: "
          f"{ident['microarchitecture']}); the cpu backend runs its {ident['isa']} build")
    print(f"FMA peak measured now (tools/fma_peak.c, the best of {probe['tries']} run(s) of {probe['seconds']} s): "
          + ", ".join(f"{t} thread(s) {pk:.1f} GFLOP/s" if pk else f"{t} thread(s) not measured ({why})"
                      for t, (pk, why) in peaks.items()))
    print("GFLOP/s: forward 4*B*H*N^2*d (halved if causal), forward+backward 3.5x that; %pk: that over the "
          "FMA peak of as many threads; "
          "ms: median over all timed calls (min beside it); RSS: the process's peak, and above its inputs "
          "(one forward+backward's outputs O, LSE, dQ, dK, dV: about 16*B*H*N*d bytes); "
          "cpu: the process's CPU ms per call (all its threads), the steadier figure on a busy machine")
    print(f"{'N':>5} {'d':>4} {'causal':>6} {'thr':>3} {'contender':9} {'fwd ms':>9} {'min':>8} {'GFLOP/s':>8} "
          f"{'%pk':>4} {'f+b ms':>9} {'min':>8} {'GFLOP/s':>8} {'%pk':>4} {'RSS MiB':>8} {'+MiB':>6} "
          f"{'fwd cpu':>9} {'f+b cpu':>9}")
    of_peak = []  # (n, d, causal, threads, fwd %, f+b %) of the cpu backend
    ratios = {c: [] for c in contenders if c != "cpu"}
    cpu_ratios = {c: [] for c in contenders if c != "cpu"}
    fast_ratios = {c: [] for c in contenders if c != "cpu"}  # of each column's fastest call
    for n, d, causal, threads in configs:
        flops = flops_forward(args.batch, args.heads, n, d, causal)
        times = {c: {"fwd": [], "fwd+bwd": []} for c in contenders}
        cpu_times = {c: {"fwd": [], "fwd+bwd": []} for c in contenders}
        info = {c: {} for c in contenders}
        for r in range(args.rounds):
            order = contenders if r % 2 == 0 else contenders[::-1]
            for c in order:
                spec = dict(name=c, batch=args.batch, heads=args.heads, seqlen=n, head_dim=d, causal=causal,
                            threads=threads, repeats=args.repeats, seed=args.seed, warmup_s=warmup_s)
                res = run_worker(spec, args.gap)
                if "error" in res:
                    info[c]["error"] = res["error"]
                    continue
                for label in ("fwd", "fwd+bwd"):
                    times[c][label] += res["times"][label]
                    cpu_times[c][label] += res["cpu_times"][label]
                info[c]["rss"] = max(info[c].get("rss", 0), res["peak_rss_mib"])
                info[c]["extra"] = max(info[c].get("extra", 0), res["peak_rss_mib"] - res["rss_inputs_mib"])
        medians, cpu_medians, fastest = {}, {}, {}
        for c in contenders:
            head = f"{n:5d} {d:4d} {str(causal):>6} {threads:3d} {c:9}"
            if "error" in info[c] and not times[c]["fwd"]:
                print(f"{head} error: {info[c]['error']}")
                continue
            f, fb = times[c]["fwd"], times[c]["fwd+bwd"]
            medians[c] = (statistics.median(f), statistics.median(fb))
            fastest[c] = (min(f), min(fb))
            cpu_medians[c] = (statistics.median(cpu_times[c]["fwd"]), statistics.median(cpu_times[c]["fwd+bwd"]))
            gf, gfb = flops / medians[c][0] / 1e6, 3.5 * flops / medians[c][1] / 1e6
            pk = peaks[threads][0]
            pf, pfb = (f"{100 * gf / pk:4.0f}", f"{100 * gfb / pk:4.0f}") if pk else ("-", "-")
            if pk and c == "cpu":
                of_peak.append((n, d, causal, threads, 100 * gf / pk, 100 * gfb / pk))
            print(f"{head} {medians[c][0]:9.2f} {min(f):8.2f} {gf:8.1f} {pf:>4} "
                  f"{medians[c][1]:9.2f} {min(fb):8.2f} {gfb:8.1f} {pfb:>4} "
                  f"{info[c]['rss']:8.0f} {info[c]['extra']:6.0f} {cpu_medians[c][0]:9.2f} {cpu_medians[c][1]:9.2f}")
        if "cpu" in medians:
            for c in ratios:
                if c in medians:
                    label = f"N={n} d={d} causal={int(causal)} t={threads}"
                    ratios[c].append((label, "fwd", medians[c][0] / medians["cpu"][0]))
                    ratios[c].append((label, "fwd+bwd", medians[c][1] / medians["cpu"][1]))
                    for n_pass, name_pass in enumerate(("fwd", "fwd+bwd")):
                        fast_ratios[c].append((label, name_pass, fastest[c][n_pass] / fastest["cpu"][n_pass]))
                        if cpu_medians["cpu"][n_pass] > 0:
                            cpu_ratios[c].append((label, name_pass,
                                                  cpu_medians[c][n_pass] / cpu_medians["cpu"][n_pass]))
    print(f"load average {os.getloadavg()[0]:.2f} at the end; FMA peak again: " + ", ".join(
        f"{t} thread(s) {pk:.1f} GFLOP/s" for t, (pk, _) in
        ((t, cpu_probe.fma_peak(ident["isa"], t, **probe)) for t in peaks) if pk))
    parts = []
    for c, rs in ratios.items():
        if not rs:
            parts.append(f"cpu vs {c}: no figures")
            continue
        geo = geomean(x for _, _, x in rs)
        cr = [x for _, _, x in cpu_ratios[c] if x > 0]
        others = f", by CPU time {geomean(cr):.2f}x" if cr else ""
        if fast_ratios[c] and c != "cpu_fa1":
            low = min(fast_ratios[c], key=lambda t: t[2])
            others += (f", by fastest call {geomean(x for _, _, x in fast_ratios[c]):.2f}x "
                       f"(min {low[2]:.2f}x, {low[0]} {low[1]})")
        if c == "cpu_fa1":  # the worst case for FA1 is the highest ratio
            worst, name, edge = max(rs, key=lambda t: t[2]), "fa2/fa1 on cpu", "max"
        else:
            worst, name, edge = min(rs, key=lambda t: t[2]), f"cpu/{c}", "min"
        parts.append(f"{name} throughput: geomean={geo:.2f}x over {len(rs)}, "
                     f"{edge}={worst[2]:.2f}x ({worst[0]} {worst[1]}){others}")
    # Issue 25's peak targets: one thread, non-causal, d >= 64, N >= 1024.
    target = [(f, fb) for n, d, causal, t, f, fb in of_peak if t == 1 and not causal and d >= 64 and n >= 1024]
    if target:
        parts.append("cpu 1 thread non-causal d>=64 of FMA peak: fwd median {:.0f}% (min {:.0f}%), "
                     "fwd+bwd median {:.0f}% (min {:.0f}%)".format(
                         statistics.median(f for f, _ in target), min(f for f, _ in target),
                         statistics.median(fb for _, fb in target), min(fb for _, fb in target)))
    return "summary: sweep B={} H={} ".format(args.batch, args.heads) + " | ".join(parts)


# ---------------------------------------------------------------------------------------
# --decode: one decoding step against a dense KV cache (issue 21 part 7), and --varlen:
# packed sequences beside SDPA on the padded batch (issue 21's bench line)
# ---------------------------------------------------------------------------------------
DECODE_PRESETS = {  # (batch, heads, heads_kv, head_dim, contexts, repeats)
    "smoke": (1, 4, 2, 32, (256,), 3),
    "full": (1, 32, 8, 128, (8192, 32768), 7),
}


def stream_read(parts, pool):
    """Reads every element of `parts` once (one part per thread): a dot product of each
    part with itself in blocks, the tightest streaming read NumPy has (BLAS sdot)."""
    block = 1 << 20

    def read(a):
        for i in range(0, a.size, block):
            np.dot(a[i:i + block], a[i:i + block])

    list(pool.map(read, parts))


def stream_read_blas(buf):
    """One BLAS sdot over the whole array, BLAS's own threads splitting it."""
    np.dot(buf, buf)


DECODE_BURST = 3  # timed calls per column and round
DECODE_PAGE = 16  # --decode-kvcache's paged column: rows per page (vLLM's default block size)


def placed(x, offset):
    """A copy of x whose data starts `offset` bytes past a 64-byte boundary (None: x as
    NumPy placed it; large NumPy arrays start 16 bytes past one, PyTorch's tensors at one)."""
    if offset is None:
        return x
    buf = np.empty(x.nbytes + 64, np.uint8)
    start = (offset - buf.__array_interface__["data"][0]) % 64
    a = buf[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    a[...] = x
    return a


def decode_bytes(b, h, hkv, n, d):
    """The floor of one decoding step: the visible K and V once, plus q and o."""
    return 4 * (2 * b * hkv * n * d + 2 * b * h * d)


def decode_from_c(loop, dims, threads, q, k, v, buf, repeats, gap, warm_ms):
    """({"cpu from C": times, "read from C": times} (ms), the step's o): tools/decode_loop.c's
    bursts of the cpu column's step (pyfa_fa2_forward, `threads` threads) and of a
    streaming read of buf, each after `gap` idle seconds and `warm_ms` of untimed calls,
    alternating, for `repeats` rounds. Raises RuntimeError when a call fails."""
    import ctypes
    ffi, lib = pyfa._lib.load()
    b, h, hkv, n, d = dims
    problem, config = ffi.new("pyfa_problem *"), ffi.new("pyfa_config *")
    problem.struct_size, config.struct_size = ffi.sizeof("pyfa_problem"), ffi.sizeof("pyfa_config")
    problem.batch, problem.heads, problem.heads_kv = b, h, hkv
    problem.seqlen_q, problem.seqlen_k, problem.head_dim = 1, n, d
    config.backend, config.threads, config.flags = lib.PYFA_BACKEND_CPU, threads, lib.PYFA_FLAG_IN_PLACE
    address = [int(ffi.cast("uintptr_t", x)) for x in (lib.pyfa_fa2_forward, problem, config)]
    o, lse = np.empty((b, h, 1, d), np.float32), np.empty((b, h, 1), np.float32)
    out = (ctypes.c_double * DECODE_BURST)()
    times = {"cpu from C": [], "read from C": []}
    for _ in range(repeats):
        time.sleep(gap)
        if loop.decode_loop_read(buf.ctypes.data, buf.size, threads, warm_ms, DECODE_BURST, out) != 0:
            raise RuntimeError("decode_loop_read failed to start its threads")
        times["read from C"] += list(out)
        time.sleep(gap)
        st = loop.decode_loop_step(*address, *(x.ctypes.data for x in (q, k, v, o, lse)), warm_ms, DECODE_BURST, out)
        if st != 0:
            raise RuntimeError(f"pyfa_fa2_forward returned {st}: {pyfa._lib.last_error()}")
        times["cpu from C"] += list(out)
    return times, o


def decode(args):
    from concurrent.futures import ThreadPoolExecutor
    b, h, hkv, d, contexts, repeats = DECODE_PRESETS["smoke" if args.preset == "smoke" else "full"]
    b, h, d = args.batch or b, args.heads or h, args.head_dim or d
    hkv = args.heads_kv or hkv
    contexts = tuple(args.contexts or contexts)
    repeats = args.repeats or repeats
    threads = args.decode_threads or os.cpu_count()
    torch = import_torch()
    if torch is not None:
        torch.set_num_threads(threads)
    split = pyfa.checks.decode_split_size(d)
    pool = ThreadPoolExecutor(threads)
    cpu = pyfa.Options(backend="cpu", threads=threads)
    print(f"pyfa bench --decode (CPU): one decoding step (Nq = 1) against a dense KV cache, B={b} H={h} "
          f"Hkv={hkv} d={d}, contexts {', '.join(map(str, contexts))}; {threads} threads everywhere; "
          f"1 warm-up, median of {repeats} interleaved rounds; {os.cpu_count()} cores ({platform.machine()}), "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"numpy {np.__version__} (BLAS {blas_name()}); pyfa {pyfa.__version__}; "
          f"torch {torch.__version__ if torch else 'not installed'}")
    print("q, K, V placed " + ("where NumPy put them (large arrays 16 bytes past a 64-byte boundary)"
                              if args.decode_offset is None else f"{args.decode_offset} bytes past a 64-byte "
                              "boundary (--decode-offset)"))
    print("GB/s: the step's floor bytes (K and V of the context once, plus q and o) over its time; "
          "read parts / read blas: a streaming read (BLAS sdot) of an array of those bytes, one part per "
          "thread / one call with BLAS's own threads, in the same rounds; bandwidth: the faster of the two; "
          f"% bw: GB/s over it; in each round a column idles {args.decode_gap} s, makes untimed calls back "
          f"to back for {args.decode_warm:g} ms (at least one), then {DECODE_BURST} timed calls back to back")
    print("columns: cpu = pyfa.fa2_forward on the cpu backend, cache (B, Hkv, N, d) read in place; "
          f"cpu split = the same with split_size={split} ('decode'); cpu prep = the cpu column's call "
          "through pyfa.prepare (set up once, replayed on the same arrays, as a decoding loop would); kvcache = "
          "pyfa.attention_with_kvcache on a (B, N, Hkv, d) cache (flash-attn's layout, read in place as packed "
          "sequences with seqused_k); kv prep = the kvcache column's call through pyfa.prepare; kv split = "
          f"the kvcache column's call with split_size={split}; kv paged = "
          f"kvcache's call on a paged cache, pages of {DECODE_PAGE} rows in shuffled order, read through the "
          "block table; "
          "torch gqa = SDPA with enable_gqa=True; torch exp = SDPA on K/V expanded to H heads beforehand "
          "(outside the timing)")
    loop = None
    if args.decode_c:
        print("from C (--decode-c): the cpu column's step (pyfa_fa2_forward) and a streaming read of the floor "
              "bytes on the same threads, warm-up and timed calls back to back in C (tools/decode_loop.c), after "
              "the same idle spell, in rounds of their own after the other columns'; their note gives the step's "
              "share of that read")
        loop, why = cpu_probe.decode_loop(cpu_probe.identity()["isa"])
        if loop is None:
            print(f"--decode-c: {why}")
    print(f"{'context':>8} {'column':11} {'ms':>9} {'min ms':>9} {'GB/s':>7} {'% bw':>6} {'x torch':>8}  note")
    rng = np.random.default_rng(args.seed)
    rows = []
    for n in contexts:
        q, k, v = (placed(rng.standard_normal(shape, dtype=np.float32), args.decode_offset)
                   for shape in ((b, h, 1, d), (b, hkv, n, d), (b, hkv, n, d)))
        nbytes = decode_bytes(b, h, hkv, n, d)
        buf = np.ones(nbytes // 4, np.float32)
        parts = np.array_split(buf, threads)
        lens = np.full(b, n, np.int32)
        cols = [Column("read parts", lambda: stream_read(parts, pool)),
                Column("read blas", lambda: stream_read_blas(buf)),
                Column("cpu", lambda: pyfa.fa2_forward(q, k, v, options=cpu)),
                Column("cpu split", lambda: pyfa.fa2_forward(q, k, v, split_size=split, options=cpu)),
                Column("cpu prep", pyfa.prepare(pyfa.fa2_forward, q, k, v, options=cpu))]
        if args.decode_kvcache:
            qc, kc, vc = (placed(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), args.decode_offset)
                          for x in (q, k, v))
            cols.append(Column("kvcache", lambda: pyfa.attention_with_kvcache(qc, kc, vc, lens, options=cpu)))
            cols.append(Column("kv prep", pyfa.prepare(pyfa.attention_with_kvcache, qc, kc, vc, lens, options=cpu)))
            cols.append(Column("kv split", lambda: pyfa.attention_with_kvcache(qc, kc, vc, lens, split_size=split,
                                                                              options=cpu)))
            per = -(-n // DECODE_PAGE)
            table = rng.permutation(b * per).astype(np.int32).reshape(b, per)
            kp, vp = (np.zeros((b * per, DECODE_PAGE, hkv, d), np.float32) for _ in range(2))
            for x, pages in ((kc, kp), (vc, vp)):
                padded = np.zeros((b, per * DECODE_PAGE, hkv, d), np.float32)
                padded[:, :n] = x
                pages[table] = padded.reshape(b, per, DECODE_PAGE, hkv, d)
            cols.append(Column("kv paged", lambda: pyfa.attention_with_kvcache(qc, kp, vp, lens, block_table=table,
                                                                              options=cpu)))
        if torch is not None:
            sdpa = torch.nn.functional.scaled_dot_product_attention
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            tke, tve = (t.repeat_interleave(h // hkv, dim=1) for t in (tk, tv))

            def torch_gqa():
                with torch.no_grad():
                    return sdpa(tq, tk, tv, enable_gqa=True)

            def torch_exp():
                with torch.no_grad():
                    return sdpa(tq, tke, tve)
            cols += [Column("torch gqa", torch_gqa), Column("torch exp", torch_exp)]
        timed = time_group(cols, repeats, gap=args.decode_gap, burst=DECODE_BURST, warm_ms=args.decode_warm)
        # The bandwidth: the faster of the two streaming reads (by median).
        reads = [t for t in timed if t[0].startswith("read")]
        best = min(reads, key=lambda t: t[1])
        timed = [("bandwidth", best[1], best[2], f"the faster read: {best[0]}")] + timed
        res = {c.name: c.result for c in cols}
        from_c = {}
        if loop is not None:
            c_times, c_o = decode_from_c(loop, (b, h, hkv, n, d), threads, q, k, v, buf, repeats,
                                         args.decode_gap, args.decode_warm)
            from_c = {name: statistics.median(ts) for name, ts in c_times.items()}
            share = 100 * from_c["read from C"] / from_c["cpu from C"]
            bits = "the cpu column's bits" if same_bits([c_o], [res["cpu"][0]]) else "BITS DIFFER from cpu's"
            timed += [("read from C", from_c["read from C"], min(c_times["read from C"]), "tools/decode_loop.c"),
                      ("cpu from C", from_c["cpu from C"], min(c_times["cpu from C"]),
                       f"{share:.0f}% of the read from C; {bits}")]
        emu_bits = same_bits([res["cpu"][0]], [pyfa.fa2_forward(q, k, v, options=pyfa.Options(
            backend="emu"))[0]]) if args.preset == "smoke" else None
        bw = timed[0][1]
        gbs = {name: nbytes / ms / 1e6 for name, ms, _, _ in timed if ms}
        tbest = min((ms for name, ms, _, _ in timed if name.startswith("torch") and ms), default=None)
        for name, ms, fastest, note in timed:
            if ms is None:
                print(f"{n:8d} {name:11} {'-':>9} {'-':>9} {'-':>7} {'-':>6} {'-':>8}  {note}".rstrip())
                continue
            if name == "cpu" and emu_bits is not None:
                note = "cpu == emu bit for bit" if emu_bits else "cpu != emu: BITS DIFFER"
            # O of each column, flattened: (B, Nq, H, d) and (B, H, Nq, d) agree at Nq = 1.
            for mine, base in (("cpu prep", "cpu"), ("kv prep", "kvcache"), ("kv split", "cpu split")):
                if name == mine and base in res:
                    same = same_bits(*([np.ravel(res[c] if c.startswith("kv") else res[c][0])] for c in (name, base)))
                    note = f"the {base} column's bits" if same else f"BITS DIFFER from {base}'s"
            if name in res and name.startswith("cpu") and res.get("torch gqa") is not None:
                ref = torch.from_numpy(res[name][0])
                err = float((ref - res["torch gqa"]).abs().max())
                note = (note + f" max|cpu - torch| {err:.1e}").strip()
            pct = 100 * gbs[name] / gbs["bandwidth"]
            xt = (f"{tbest / ms:7.2f}x" if tbest and not name.startswith(("torch", "read")) and name != "bandwidth"
                  and "from C" not in name else "-")
            print(f"{n:8d} {name:11} {ms:9.3f} {fastest:9.3f} {gbs[name]:7.2f} {pct:5.0f}% {xt:>8}  {note}".rstrip())
        rows.append((n, {name: ms for name, ms, _, _ in timed}, gbs, from_c))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    parts_out = []
    for n, ms, gbs, from_c in rows:
        torch_ms = [ms[c] for c in ("torch gqa", "torch exp") if ms.get(c)]
        best_cpu = max(("cpu", "cpu split", "cpu prep"), key=lambda c: gbs.get(c, 0))
        s = (f"N={n}: {best_cpu} {gbs[best_cpu]:.1f} GB/s = {100 * gbs[best_cpu] / gbs['bandwidth']:.0f}% of "
             f"{gbs['bandwidth']:.1f} GB/s measured")
        if torch_ms:
            s += f", {min(torch_ms) / ms[best_cpu]:.2f}x torch's best"
        if from_c:
            s += f"; from C: cpu {100 * from_c['read from C'] / from_c['cpu from C']:.0f}% of the read"
        parts_out.append(s)
    return "summary: decode B={} H={} Hkv={} d={} {}".format(b, h, hkv, d, " | ".join(parts_out))


VARLEN_PRESETS = {  # (heads, head_dim, sequence lengths, repeats)
    "smoke": (2, 32, (40, 7, 64, 23), 3),
    "full": (8, 64, (1024, 217, 640, 1536, 96, 800), 5),
}


def varlen(args):
    h, d, lengths, repeats = VARLEN_PRESETS["smoke" if args.preset == "smoke" else "full"]
    h, d = args.heads or h, args.head_dim or d
    repeats = args.repeats or repeats
    threads = args.decode_threads or os.cpu_count()
    causal = args.causal
    torch = import_torch()
    if torch is not None:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(args.seed)
    total, nmax, bsz = sum(lengths), max(lengths), len(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((total, h, d), dtype=np.float32) for _ in range(3))
    cpu = pyfa.Options(backend="cpu", threads=threads)
    print(f"pyfa bench --varlen (CPU): {bsz} packed sequences of lengths {', '.join(map(str, lengths))} "
          f"(total {total}, longest {nmax}), H={h} d={d} causal={causal}; {threads} threads; 1 warm-up, "
          f"median of {repeats} interleaved rounds; load average {os.getloadavg()[0]:.2f} at the start")
    print("columns: varlen = pyfa.attention_varlen on the cpu backend (packed, no padding); "
          "torch padded = SDPA on the batch padded to the longest, a boolean mask hiding the padding keys"
          + (" and the causal mask" if causal else ""))
    flops = sum(4.0 * h * n * n * d / (2 if causal else 1) for n in lengths)
    cols = [Column("varlen", lambda: pyfa.attention_varlen(q, k, v, cu, cu, causal=causal, options=cpu))]
    pad = np.zeros((bsz, h, nmax, d), np.float32)
    qp, kp, vp = pad.copy(), pad.copy(), pad.copy()
    for i, n in enumerate(lengths):
        for src, dst in ((q, qp), (k, kp), (v, vp)):
            dst[i, :, :n] = src[cu[i]:cu[i + 1]].transpose(1, 0, 2)
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        keep = np.zeros((bsz, 1, nmax, nmax), bool)
        for i, n in enumerate(lengths):
            keep[i, :, :, :n] = True
            if causal:  # bottom-right within each sequence, as pyfa's default: the same rows
                keep[i, :, :n, :n] &= ~causal_hidden(n, n)
            keep[i, :, n:, 0] = True  # padding rows see one key, so that no row is all -inf (NaN)
        tq, tk, tv, tm = (torch.from_numpy(x) for x in (qp, kp, vp, keep))

        def torch_padded():
            with torch.no_grad():
                return sdpa(tq, tk, tv, attn_mask=tm)
        cols.append(Column("torch padded", torch_padded))
    timed = time_group(cols, repeats)
    res = {c.name: c.result for c in cols}
    if "torch padded" in res and res["torch padded"] is not None:
        o_t = res["torch padded"].numpy()
        err = max(float(np.abs(res["varlen"][cu[i]:cu[i + 1]].transpose(1, 0, 2) - o_t[i, :, :n]).max())
                  for i, n in enumerate(lengths))
        print(f"max|varlen - torch padded| over the valid rows: {err:.1e}")
    print(f"{'column':13} {'ms':>9} {'min ms':>9} {'GFLOP/s':>8} {'x torch':>8}  note")
    tms = next((ms for name, ms, _, _ in timed if name == "torch padded"), None)
    for name, ms, fastest, note in timed:
        if ms is None:
            print(f"{name:13} {'-':>9} {'-':>9} {'-':>8} {'-':>8}  {note}".rstrip())
            continue
        xt = f"{tms / ms:7.2f}x" if tms and name != "torch padded" else "-"
        print(f"{name:13} {ms:9.3f} {fastest:9.3f} {flops / ms / 1e6:8.2f} {xt:>8}  {note}".rstrip())
    print("GFLOP/s: the packed batch's useful FLOPs (4 H n^2 d per sequence, halved if causal) for every column")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    ms = {name: t for name, t, _, _ in timed}
    out = f"summary: varlen {bsz} sequences H={h} d={d} causal={int(causal)}: varlen {ms['varlen']:.2f} ms"
    if tms:
        out += f", torch padded {tms:.2f} ms ({tms / ms['varlen']:.2f}x varlen's time)"
    return out


# (B, H, Hkv, Nq, Nk, d): a small model's attention at short lengths, one at a length where
# the kernels' work begins to weigh, and one decoding step with grouped heads.
TORCH_CALL_SHAPES = {
    "smoke": [(1, 2, 2, 16, 16, 32)],
    "full": [(1, 4, 4, 64, 64, 64), (2, 8, 8, 256, 256, 64), (1, 32, 8, 1, 1024, 128)],
}


def torch_calls(args):
    """pyfa.torch.attention against torch's SDPA per call, on shapes whose work is small
    enough that the cost of a call around the kernels shows: the forward under no_grad and
    the forward + backward (q, k, v require grad), causal where Nq = Nk, in one process, the
    columns of a shape alternating call by call."""
    torch = import_torch()
    if torch is None:
        return "summary: torch-calls: torch is not installed here"
    import pyfa.torch as pt
    threads = args.decode_threads or 1
    torch.set_num_threads(threads)
    repeats = args.repeats or (3 if args.preset == "smoke" else 200)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print(f"pyfa bench --torch-calls (CPU): per call, causal where Nq = Nk; {threads} thread(s) for both; "
          f"median of {repeats} calls alternating with the other column's; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"{'B':>3} {'H':>3} {'Hkv':>3} {'Nq':>5} {'Nk':>5} {'d':>4}  {'pass':9} {'pyfa us':>9} {'sdpa us':>9} "
          f"{'x sdpa':>7}")
    gen = torch.Generator().manual_seed(args.seed)
    ratios = []
    with pyfa.Options(threads=threads):
        for b, h, hkv, nq, nk, d in TORCH_CALL_SHAPES["smoke" if args.preset == "smoke" else "full"]:
            q = torch.randn(b, h, nq, d, generator=gen)
            k, v = (torch.randn(b, hkv, nk, d, generator=gen) for _ in range(2))
            gqa = dict(enable_gqa=True) if hkv != h else {}
            # Causal where Nq = Nk (SDPA aligns it top-left, pyfa as causal_align says);
            # the decoding step's one row sees every key.
            causal = nq == nk
            for name, grad in (("fwd", False), ("fwd+bwd", True)):
                qg, kg, vg = (t.clone().requires_grad_(grad) for t in (q, k, v))

                def pass_of(attend):
                    def call():
                        with torch.set_grad_enabled(grad):
                            o = attend(qg, kg, vg)
                            if grad:
                                o.sum().backward()
                        return o.detach()
                    return call
                cols = [Column("pyfa", pass_of(lambda q_, k_, v_: pt.attention(q_, k_, v_, causal=causal,
                                                                                causal_align="top_left"))),
                        Column("sdpa", pass_of(lambda q_, k_, v_: sdpa(q_, k_, v_, is_causal=causal, **gqa)))]
                timed = time_group(cols, repeats)
                (_, pyfa_ms, _, note), (_, torch_ms, _, tnote) = timed
                if pyfa_ms is None or torch_ms is None:
                    print(f"{b:3} {h:3} {hkv:3} {nq:5} {nk:5} {d:4}  {name:9} {note or tnote}")
                    continue
                err = float((cols[0].result - cols[1].result).abs().max())
                ratios.append(torch_ms / pyfa_ms)
                print(f"{b:3} {h:3} {hkv:3} {nq:5} {nk:5} {d:4}  {name:9} {pyfa_ms * 1e3:9.1f} {torch_ms * 1e3:9.1f} "
                      f"{torch_ms / pyfa_ms:6.2f}x  max|pyfa - sdpa| {err:.1e}")
    print("x sdpa: SDPA's time over pyfa's (above 1: pyfa faster)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if not ratios:
        return "summary: torch-calls: no pass ran (see the notes above)"
    return (f"summary: torch-calls: pyfa.torch.attention / SDPA per call, geometric mean {geomean(ratios):.2f}x, "
            f"lowest {min(ratios):.2f}x over {len(ratios)} passes")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="preset", action="store_const", const="quick",
                      help="B=1 H=4 N=256 d=64, 5 rounds")
    size.add_argument("--smoke", dest="preset", action="store_const", const="smoke",
                      help="B=1 H=2 N=64 d=32, 3 rounds (for the tests); with --sweep: no warm-up beyond "
                           "2 calls, the FMA peak from one run of 0.02 s")
    ap.set_defaults(preset="full")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seqlen", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--repeats", type=int, help="timed rounds")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures here")
    sw = ap.add_argument_group("--sweep (the cpu backend against torch and NumPy)")
    sw.add_argument("--sweep", action="store_true", help="run the sweep instead")
    sw.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="N (Nq = Nk)")
    sw.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    sw.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    sw.add_argument("--rounds", type=int, default=3, help="processes per contender and configuration")
    sw.add_argument("--gap", type=float, default=0.5, help="idle seconds after each process")
    sw.add_argument("--contenders", default=",".join(CONTENDERS))
    dc = ap.add_argument_group("--decode and --varlen (issue 21: decoding against a KV cache, packed sequences)")
    dc.add_argument("--decode", action="store_true",
                    help="one decoding step: B=1 H=32 Hkv=8 d=128, contexts 8192 and 32768 (--smoke: tiny)")
    dc.add_argument("--varlen", action="store_true", help="packed sequences beside SDPA on the padded batch")
    dc.add_argument("--torch-calls", action="store_true",
                    help="pyfa.torch.attention against SDPA per call, on small shapes (the cost of a call)")
    dc.add_argument("--heads-kv", type=int, help="--decode: K/V heads")
    dc.add_argument("--contexts", type=int, nargs="+", help="--decode: context lengths")
    dc.add_argument("--decode-threads", type=int, help="threads of every column (default: one per core)")
    dc.add_argument("--decode-gap", type=float, default=0.2,
                    help="idle seconds before each column's calls in a round (BLAS and OpenMP threads spin "
                         "~0.1 s after a call)")
    dc.add_argument("--decode-warm", type=float, default=300.0,
                    help="untimed milliseconds of calls after each idle spell, before the timed ones (0: one "
                         "call); after 0.2 s idle a 2-thread step at 8k ran up to 1.3x slower for its first "
                         "150 ms here (tools/README.md)")
    dc.add_argument("--decode-offset", type=int, choices=range(0, 64, 4), metavar="{0,4,...,60}",
                    help="--decode: place q, K and V this many bytes past a 64-byte boundary (default: where "
                         "NumPy puts them, 16 bytes past one for the large ones)")
    dc.add_argument("--decode-kvcache", action="store_true",
                    help="--decode: also time pyfa.attention_with_kvcache on a flash-attn layout cache")
    dc.add_argument("--decode-c", action="store_true",
                    help="--decode: also time the cpu column's step and a streaming read from C "
                         "(tools/decode_loop.c: no Python between the calls)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return sweep_worker(json.loads(args.worker))
    if args.decode or args.varlen or args.torch_calls:
        if args.decode:
            print(decode(args))
        if args.varlen:
            print(varlen(args))
        if args.torch_calls:
            print(torch_calls(args))
        return 0
    if args.sweep:
        args.batch, args.heads = args.batch or 1, args.heads or 4
        args.repeats = args.repeats or 3
        print(sweep(args))
        return 0

    shape, groups = run(args)
    summary = report(shape, groups)
    if args.json:
        data = {"shape": dict(zip(("batch", "heads", "seqlen", "head_dim", "repeats"), shape)),
                "causal": args.causal,
                "groups": [{"label": label, "flops": flops,
                            "columns": [{"name": c, "ms": ms, "min_ms": fastest, "note": note}
                                        for c, ms, fastest, note in cols]}
                           for label, cols, flops in groups],
                "summary": summary}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
