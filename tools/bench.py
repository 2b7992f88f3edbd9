#!/usr/bin/env python3
"""CPU benchmark: pyfa's emulator and simulator against plain NumPy attention.

Every column runs in the same process, on the same float32 inputs, one after another:
  numpy   softmax(scale * Q K^T) V as matmul, softmax, matmul (and, for the backward,
          the textbook gradient: P recomputed, dV = P^T dO, dS = P o (dO V^T - D), ...)
  emu     the CUDA kernels run on the CPU by the emulator (pyfa.attention, backend "emu")
  sim     the NumPy simulator of the same kernels (pyfa.sim.<algo>_forward)
  torch   torch.nn.functional.scaled_dot_product_attention on the CPU, when torch imports
Each figure is the median wall time of --repeats calls after one warm-up call; the ratio
is that time over NumPy's (above 1: slower than NumPy). Algorithms are discovered at run
time (pyfa.api._FORWARD; the backward when pyfa.attention_grad exists), so new kernels
are covered without changes here. The last line is a one-line summary.

    python tools/bench.py --quick      # B=1 H=4 N=256 d=64, well under a minute
    python tools/bench.py --smoke      # tiny, for the test suite
    python tools/bench.py              # B=1 H=8 N=1024 d=64
"""

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import pyfa

PRESETS = {  # (batch, heads, seqlen, head_dim, repeats)
    "smoke": (1, 2, 64, 32, 3),
    "quick": (1, 4, 256, 64, 5),
    "full": (1, 8, 1024, 64, 3),
}


def median_ms(fn, repeats):
    """Median wall time of `repeats` calls in ms, after one warm-up call; and its result."""
    result = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), result


def causal_hidden(nq, nk):
    """True where key c is hidden from query r (bottom-right aligned, docs/numerics.md)."""
    return np.arange(nk)[None, :] > np.arange(nq)[:, None] + (nk - nq)


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
    drow = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - drow)
    ds *= scale
    return np.matmul(ds, k), np.matmul(ds.swapaxes(-1, -2), q), dv


def import_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def bind_by_name(fn, tensors, causal):
    """Calls fn with the arrays its parameters name (q, k, v, do, o, lse, ...); None when
    a required parameter is not one we have."""
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
        elif name == "causal":
            kwargs["causal"] = causal
        elif p.default is p.empty:
            return None
    return lambda: fn(*args, **kwargs)


def blas_name():
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy has no mode="dicts"; the name is then only informative
        return "unknown"


def flops_forward(b, h, n, d, causal):
    """4 B H N^2 d (the two matmuls), halved under the causal mask: the FA2 paper's count."""
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


def run(args):
    b, h, n, d, repeats = PRESETS[args.preset]
    b, h, n, d = (args.batch or b, args.heads or h, args.seqlen or n, args.head_dim or d)
    repeats = args.repeats or repeats
    rng = np.random.default_rng(args.seed)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=np.float32) for _ in range(4))
    scale = np.float32(1.0) / np.sqrt(np.float32(d))
    torch = import_torch()

    print(f"pyfa bench (CPU): B={b} H={h} N={n} d={d} causal={args.causal}; median of {repeats} "
          f"after 1 warm-up; {os.cpu_count()} cores; {platform.processor() or platform.machine()}")
    print(f"numpy {np.__version__} (BLAS {blas_name()}); pyfa {pyfa.__version__}, library "
          f"{pyfa.library_version()}; torch {torch.__version__ if torch else 'not installed'}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if var in os.environ:
            print(f"note: {var}={os.environ[var]} is set; the NumPy figures are as run with it")

    groups = []  # (label, [(column, ms or None, note)], flops)
    fwd_flops = flops_forward(b, h, n, d, args.causal)
    numpy_fwd_ms, o_np = median_ms(lambda: numpy_forward(q, k, v, args.causal, scale), repeats)

    sims = {}
    for algo in sorted(pyfa.api._FORWARD):
        cols = [("numpy", numpy_fwd_ms, "")]
        emu_ms, o_emu = median_ms(lambda: pyfa.attention(q, k, v, causal=args.causal, algo=algo,
                                                         backend="emu"), repeats)
        err = np.abs(o_emu - o_np).max() / np.abs(o_np).max()
        cols.append(("emu", emu_ms, f"max|emu - numpy| / max|numpy| = {err:.1e}"))
        sim_fn = getattr(pyfa.sim, f"{algo}_forward", None)
        if sim_fn is not None:
            sim_ms, sim_res = median_ms(lambda: sim_fn(q, k, v, causal=args.causal), repeats)
            sims[algo] = sim_res
            same = np.array_equal(o_emu.view(np.uint32), np.asarray(sim_res.o).view(np.uint32))
            cols.append(("sim", sim_ms, "emu == sim bit for bit" if same else "emu != sim: BITS DIFFER"))
        else:
            cols.append(("sim", None, f"pyfa.sim has no {algo}_forward"))
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            t_ms, _ = median_ms(lambda: sdpa(tq, tk, tv, is_causal=args.causal), repeats)
            cols.append(("torch", t_ms, f"{torch.get_num_threads()} threads"))
        groups.append((f"{algo} forward", cols, fwd_flops))

    if hasattr(pyfa, "attention_grad"):
        numpy_bwd_ms, _ = median_ms(lambda: numpy_backward(q, k, v, o_np, do, args.causal, scale), repeats)
        for algo in sorted(pyfa.api._FORWARD):
            cols = [("numpy", numpy_bwd_ms, "")]
            try:
                emu_ms, _ = median_ms(lambda: pyfa.attention_grad(q, k, v, do, causal=args.causal, algo=algo,
                                                                  backend="emu"), repeats)
            except (ValueError, TypeError, NotImplementedError) as e:
                cols.append(("emu", None, f"no backward: {e}"))
                groups.append((f"{algo} backward", cols, 2.5 * fwd_flops))
                continue
            cols.append(("emu", emu_ms, ""))
            sim_fn = getattr(pyfa.sim, f"{algo}_backward", None)
            fwd = sims.get(algo)
            named = {"q": q, "k": k, "v": v, "do": do, "dout": do, "dO": do}
            if fwd is not None:
                named.update({name: getattr(fwd, name) for name in ("o", "lse", "m", "l") if hasattr(fwd, name)})
            call = bind_by_name(sim_fn, named, args.causal) if sim_fn is not None else None
            if call is not None:
                sim_ms, _ = median_ms(call, repeats)
                cols.append(("sim", sim_ms, ""))
            else:
                cols.append(("sim", None, f"pyfa.sim.{algo}_backward not found or its arguments not known"))
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
                tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
                tdo = torch.from_numpy(do)
                t_ms, _ = median_ms(lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True),
                                    repeats)
                cols.append(("torch", t_ms, "backward of SDPA only (autograd.grad)"))
            groups.append((f"{algo} backward", cols, 2.5 * fwd_flops))
    return (b, h, n, d, repeats), groups


def report(shape, groups):
    b, h, n, d, _ = shape
    print("FLOPs: forward 4*B*H*N^2*d (halved if causal), backward 2.5x forward, as in the FA2 paper")
    print(f"{'':18} {'column':7} {'ms':>10} {'x numpy':>9} {'GFLOP/s':>9}  note")
    parts = []
    for label, cols, flops in groups:
        base = cols[0][1]
        ratios = []
        for name, ms, note in cols:
            if ms is None:
                print(f"{label:18} {name:7} {'-':>10} {'-':>9} {'-':>9}  {note}")
                continue
            ratio = ms / base
            print(f"{label:18} {name:7} {ms:10.3f} {ratio:8.2f}x {flops / ms / 1e6:9.2f}  {note}")
            if name != "numpy":
                ratios.append(f"{name}/numpy={ratio:.2f}x")
        parts.append(f"{label.replace('forward', 'fwd').replace('backward', 'bwd')}: " + " ".join(ratios))
    return f"summary: B={b} H={h} N={n} d={d} " + " | ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="preset", action="store_const", const="quick",
                      help="B=1 H=4 N=256 d=64, 5 repeats")
    size.add_argument("--smoke", dest="preset", action="store_const", const="smoke",
                      help="B=1 H=2 N=64 d=32, 3 repeats (for the tests)")
    ap.set_defaults(preset="full")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seqlen", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    shape, groups = run(args)
    summary = report(shape, groups)
    if args.json:
        data = {"shape": dict(zip(("batch", "heads", "seqlen", "head_dim", "repeats"), shape)),
                "causal": args.causal,
                "groups": [{"label": label, "flops": flops,
                            "columns": [{"name": c, "ms": ms, "note": note} for c, ms, note in cols]}
                           for label, cols, flops in groups],
                "summary": summary}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
