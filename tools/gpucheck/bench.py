"""gpu_bench.py bench: every op's device entry point (pyfa.api.OPS, `<c_function>_device`)
timed with CUDA events on PyTorch's device tensors, checked against and timed beside
PyTorch's SDPA on the same inputs, once per kernel variant (--variants: the readable
kernels as `<op>`, the fast ones as `<op>/fast` where every kernel of the op has one, and
`<op>/auto` where it runs what neither of those runs: some kernels fast, others not). --backend emu runs the same plumbing on the emulator
(host pointers, wall clock), without a GPU."""

import math
import statistics
import time

from .common import (FLOPS_CONVENTION, deadline, flops, forward_of, fp32_peak, ops, peak_shares,
                     write_json)

BENCH_SEQLENS = [1024, 2048, 4096, 8192]
# (head_dim, tiles): None tiles are the library's defaults for the device.
BENCH_VARIANTS = [(64, None), (64, (32, 32)), (128, None), (128, (32, 32))]
BENCH_BATCH, BENCH_HEADS = 4, 8
# pyfa.api.VARIANTS timed side by side; "reference" rows keep the op's plain name. "auto"
# times an op whose kernels are only partly fast (e.g. the FA2 backward with a fast dQ only).
BENCH_KERNEL_VARIANTS = ["reference", "fast", "auto"]
GRADS = ("dq", "dk", "dv")

# Decoding (issue 21): one split-KV step of a Llama-3-8B-like model (32 query heads over 8
# K/V heads, d = 128, Nq = 1, split_size "decode"), (batch, context) pairs; the emulator's
# are small. GB/s: the step's floor (K and V once, q and o) over its median time.
DECODE_SHAPE = dict(heads=32, heads_kv=8, head_dim=128)
DECODE_PLAN = {"cuda": [(1, 8192), (1, 32768), (16, 8192), (16, 32768)], "emu": [(1, 64)]}

# What the SDPA rows are: PyTorch picks its memory-efficient kernel for fp32 inputs, and
# that kernel runs its matmuls on tensor cores in 3xTF32 mode (three TF32 products per
# fp32 one), whatever the TF32 flags say: not plain fp32 arithmetic on CUDA cores, so the
# CUDA-core peaks do not apply to it.
SDPA_LABEL = ("torch SDPA, fp32 inputs: memory-efficient kernel on tensor cores in 3xTF32 mode "
              "(not CUDA-core fp32; the fp32 peaks do not apply)")


class TorchCuda:
    """Device tensors from PyTorch, CUDA-event timing, SDPA as the reference."""

    name = "cuda"

    def __init__(self):
        import torch
        self.torch = torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        # No TF32 in PyTorch's plain matmuls; SDPA's fp32 kernel is another matter (SDPA_LABEL).
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(1234)
        props = torch.cuda.get_device_properties(0)
        self.device_name = props.name
        self.l2_bytes = getattr(props, "L2_cache_size", 50 << 20)

    def randn(self, shape):
        return self.torch.randn(shape, device="cuda", dtype=self.torch.float32, generator=self.gen)

    def empty(self, shape):
        return self.torch.empty(shape, device="cuda", dtype=self.torch.float32)

    def poison(self, t):
        t.fill_(float("nan"))

    def repeat_heads(self, t, g):
        return t.repeat_interleave(g, dim=1)

    def address(self, t):
        return t.data_ptr()

    def stream(self):
        return self.torch.cuda.current_stream().cuda_stream

    def sync(self):
        self.torch.cuda.synchronize()

    def time_ms(self, fn, reps):
        """Per-call times of reps back-to-back calls, each between two events."""
        ev = [(self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        for r, (start, end) in enumerate(ev):
            start.record()
            fn(r)
            end.record()
        self.torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in ev]

    def all_finite(self, t):
        return bool(self.torch.isfinite(t).all().item())

    def rel_err(self, x, ref):
        return float(((x - ref).abs().max() / ref.abs().max()).item())

    def reference(self, pass_, q, k, v, do, causal):
        """{'o': O} or {'dq', 'dk', 'dv'} from SDPA on the same fp32 inputs (3xTF32 keeps
        it near fp32 accuracy; the check below allows 1e-3 relative)."""
        F = self.torch.nn.functional
        if pass_ == "forward":
            with self.torch.no_grad():
                return {"o": F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        return dict(zip(GRADS, self.torch.autograd.grad(out, leaves, do)))

    def sdpa_runner(self, pass_, sets, causal):
        F = self.torch.nn.functional
        if pass_ == "forward":
            def run(r):
                s = sets[r % len(sets)]
                with self.torch.no_grad():
                    F.scaled_dot_product_attention(s["q"], s["k"], s["v"], is_causal=causal)
            return run
        graphs = []
        for s in sets:
            leaves = [s[n].detach().requires_grad_() for n in ("q", "k", "v")]
            graphs.append((F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, s["do"]))

        def run(r):
            out, leaves, do = graphs[r % len(graphs)]
            self.torch.autograd.grad(out, leaves, do, retain_graph=True)
        return run


class HostEmu:
    """NumPy buffers on the emulator (whose _device entry points take host pointers) and
    wall-clock timing: lets the bench's plumbing run on a machine without a GPU."""

    name = "emu"
    device_name = "pyfa emulator (CPU)"
    l2_bytes = 0

    def __init__(self):
        import numpy as np
        self.np = np
        self.rng = np.random.default_rng(1234)
        from pyfa import _lib
        self.ffi, _ = _lib.load()

    def randn(self, shape):
        return self.rng.standard_normal(shape, dtype=self.np.float32)

    def empty(self, shape):
        return self.np.empty(shape, self.np.float32)

    def poison(self, t):
        t.fill(self.np.nan)

    def repeat_heads(self, t, g):
        return self.np.repeat(t, g, axis=1)

    def address(self, t):
        return int(self.ffi.cast("uintptr_t", self.ffi.from_buffer(t)))

    def stream(self):
        return 0

    def sync(self):
        pass

    def time_ms(self, fn, reps):
        out = []
        for r in range(reps):
            t0 = time.perf_counter()
            fn(r)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def all_finite(self, t):
        return bool(self.np.isfinite(t).all())

    def rel_err(self, x, ref):
        return float(self.np.abs(x.astype(self.np.float64) - ref).max() / self.np.abs(ref).max())

    def reference(self, pass_, q, k, v, do, causal):
        np = self.np
        q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
        s = q64 @ k64.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
        if causal:
            from pyfa.sim.mask import Mask
            nq, nk = q.shape[-2], k.shape[-2]
            s[..., Mask.resolve(True, None, "bottom_right", nq, nk).masked(
                np.arange(nq)[:, None], np.arange(nk)[None, :])] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = p @ v64
        if pass_ == "forward":
            return {"o": o}
        dv = p.swapaxes(-1, -2) @ do64
        ds = p * (do64 @ v64.swapaxes(-1, -2) - (do64 * o).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
        return {"dq": ds @ k64, "dk": ds.swapaxes(-1, -2) @ q64, "dv": dv}

    def sdpa_runner(self, pass_, sets, causal):
        return None


def call_device(op, problem, config, tensors, backend):
    """op's device entry point on the tensors named in op.inputs and op.outputs."""
    from pyfa import _lib
    ffi, lib = _lib.load()
    fn = getattr(lib, op.device_function)
    pointers = [ffi.cast("float *", backend.address(tensors[t])) for t in op.inputs + op.outputs]
    _lib.check(fn(problem, config, *pointers, ffi.cast("void *", backend.stream())))


def make_problem(b, h, nq, nk, d, causal):
    from pyfa import _lib
    ffi, _ = _lib.load()
    return ffi.new("pyfa_problem *", {"batch": b, "heads": h, "seqlen_q": nq, "seqlen_k": nk,
                                      "head_dim": d, "scale": 0.0, "causal": int(causal)})


def make_config(backend_name, tiles, variant="reference"):
    import pyfa
    ffi, _ = pyfa._lib.load()
    br, bc = tiles or (0, 0)
    return ffi.new("pyfa_config *", {"backend": pyfa.api.BACKENDS[backend_name], "block_r": br,
                                     "block_c": bc, "variant": pyfa.api.VARIANTS[variant]})


def op_label(op, variant):
    return op.name if variant == "reference" else f"{op.name}/{variant}"


def variant_tiles(op, d, tiles, backend_name, variant):
    """({kernel: [Br, Bc]}, {kernel: variant it runs}) for the op's kernels under
    `variant`, or a string saying why the row is not worth timing: "fast" where a kernel
    has no fast version (or not for these tiles), "auto" where it would run the readable
    kernels only (the reference row times that)."""
    import pyfa
    used, runs = {}, {}
    for k in op.kernels:
        fast = None
        try:
            fast = pyfa.default_tiles(k, d, backend_name, variant="fast")
        except ValueError as e:
            why = str(e)
        if fast is not None and tiles and pyfa.smem_bytes(k, *tiles, d, variant="fast") == 0:
            fast, why = None, f"{k}: no fast kernel for tiles {tiles_label(tiles)}"
        if variant == "fast" and fast is None:
            return why
        runs[k] = "fast" if fast is not None and variant != "reference" else "reference"
        used[k] = list(tiles or (fast if runs[k] == "fast" else
                                 pyfa.default_tiles(k, d, backend_name, variant="reference")))
    if variant == "auto" and "fast" not in runs.values():
        return "no fast kernel applies (auto runs the readable ones: the reference row)"
    if variant == "auto" and variant_tiles(op, d, tiles, backend_name, "fast") == (used, runs):
        return "auto runs what the fast row runs"
    return used, runs


def bench_plan(seqlens, variants):
    """[(N, d, tiles)] in the order they run: N ascending, so that a time budget that
    runs out drops the largest problems, never a whole op."""
    return [(n, d, tiles) for n in seqlens for d, tiles in variants]


def choose_reps(first_ms, target_ms, lo=3, hi=20):
    return max(lo, min(hi, int(target_ms / max(first_ms, 1e-3))))


def tiles_label(tiles):
    return f"{tiles[0]}x{tiles[1]}" if tiles else "default"


def dry_run(args, seqlens, variants):
    for op in ops():
        print(f"  {op.name}: {op.device_function}(problem, config, {', '.join(op.inputs + op.outputs)}, "
              f"stream); kernels {', '.join(op.kernels)}")
    print(f"  would time decoding steps (B, N): {args.decode or DECODE_PLAN[args.backend]}")
    passes = " and ".join(sorted({op.pass_ for op in ops()}, reverse=True))
    for n, d, tiles in bench_plan(seqlens, variants):
        print(f"  would time B={args.batch} H={args.heads} N={n} d={d} tiles={tiles_label(tiles)}: "
              f"{', '.join(op_label(op, v) for op in ops() for v in args.variants)}{f', torch SDPA {passes}' if tiles is None else ''}")
    return 0


def cmd_bench(args):
    import pyfa
    seqlens = args.seqlens or BENCH_SEQLENS
    variants = [(d, t) for d, t in BENCH_VARIANTS if not args.head_dims or d in args.head_dims]
    if args.dry_run:
        return dry_run(args, seqlens, variants)
    batch, heads = args.batch, args.heads
    backend = TorchCuda() if args.backend == "cuda" else HostEmu()
    peak, peak_source = fp32_peak(backend.device_name)
    result = {"device": backend.device_name, "backend": backend.name, "fp32_peak_tflops": peak,
              "fp32_peak_source": peak_source, "batch": batch, "heads": heads, "causal": args.causal,
              "flops_convention": FLOPS_CONVENTION, "sdpa": SDPA_LABEL,
              "ops": [op.name for op in ops()], "records": []}
    print(f"bench on {backend.device_name}: fp32 peak {peak or 'unknown'} TFLOP/s with FMA "
          f"({peak_source}); B={batch} H={heads} causal={args.causal}")
    last = {}  # (op, d) -> (N, ms per call): predicts the next size's cost

    def record(rec):
        result["records"].append(rec)
        write_json(args.out, result)
        if rec.get("ms") is None:
            print(f"  {rec['op']:20} N={rec['N']:5} d={rec['d']:3} tiles={rec['tiles']:8} {rec['status']}")
            return
        share = rec.get("peak_share") or {}
        frac = ("" if share.get("fma") is None else
                f"{100 * share['fma']:.1f}% of FMA peak, {100 * share['mul_add']:.1f}% of mul+add peak")
        err = f"rel err {rec['rel_err']:.1e}" if rec.get("rel_err") is not None else ""
        print(f"  {rec['op']:20} N={rec['N']:5} d={rec['d']:3} tiles={rec['tiles']:8} {rec['ms']:9.3f} ms "
              f"{rec['tflops']:7.3f} TFLOP/s {frac} {err} {rec['status'] if rec['status'] != 'ok' else ''}".rstrip())

    def timed(base, pass_, call, n, d):
        first = backend.time_ms(call, 1)[0]
        reps = choose_reps(first, args.target_ms)
        times = backend.time_ms(call, reps)
        ms = statistics.median(times)
        last[(base["op"], d)] = (n, ms)
        tf = flops(pass_, batch, heads, n, n, d, args.causal) / (ms * 1e-3) / 1e12
        return {**base, "ms": ms, "ms_min": min(times), "reps": reps, "tflops": tf}

    def out_of_time(name, n, d):
        prev = last.get((name, d))
        predicted = prev[1] * 1e-3 * (n / prev[0]) ** 2 * 25 if prev else 0.0
        return time.time() + predicted + 2 > deadline()

    # The decoding steps first: a few seconds, never starved by the larger problems below.
    result["decode"] = []
    for rec in decode_steps(args, backend):
        result["decode"].append(rec)
        write_json(args.out, result)
        print(f"  decode B={rec['B']:2} N={rec['N']:6} split={rec['split_size']} packed={rec['packed']}: "
              + (f"{rec['ms']:.3f} ms, {rec['gbs']:.0f} GB/s, rel err {rec['rel_err']:.1e} {rec['status']}"
                 if rec.get("ms") is not None else rec["status"]))
    for n, d, tiles in bench_plan(seqlens, variants):
        per_set = 4 * batch * heads * n * d * 4 * 2  # q, k, v, do and as much again of outputs
        n_sets = 1 if not backend.l2_bytes else max(1, min(4, math.ceil(4 * backend.l2_bytes / per_set)))
        sets = [{name: backend.randn((batch, heads, n, d)) for name in ("q", "k", "v", "do")}
                for _ in range(n_sets)]
        problem = make_problem(batch, heads, n, n, d, args.causal)
        refs = {}
        for op, variant in [(op, v) for op in ops() for v in args.variants]:
            config = make_config(backend.name, tiles, variant)
            base = {"op": op_label(op, variant), "variant": variant, "N": n, "d": d,
                    "tiles": tiles_label(tiles), "sets": n_sets}
            if out_of_time(base["op"], n, d):
                record({**base, "ms": None, "status": "skipped: time budget"})
                continue
            plan = variant_tiles(op, d, tiles, backend.name, variant)
            if isinstance(plan, str):
                record({**base, "ms": None, "status": f"skipped: {plan}"})
                continue
            used, runs = plan
            try:
                shapes = op.output_shapes(batch, heads, n, n, d)
                outs = {t: backend.empty(shape) for t, shape in shapes.items()}
                per_set_tensors = []
                for s in sets:
                    tensors = dict(s)
                    if op.pass_ == "backward":  # the forward's outputs it reads (o, lse or m, l)
                        fwd = forward_of(op)
                        fouts = {t: backend.empty(shape)
                                 for t, shape in fwd.output_shapes(batch, heads, n, n, d).items()}
                        # Any variant of the forward makes valid inputs; the backward's
                        # variant may have no forward twin.
                        call_device(fwd, problem, make_config(backend.name, tiles, "auto"),
                                    {**s, **fouts}, backend)
                        tensors.update(fouts)
                    tensors.update(outs)
                    per_set_tensors.append(tensors)
                backend.sync()
                for t in outs.values():
                    backend.poison(t)
                call_device(op, problem, config, per_set_tensors[0], backend)  # also the warm-up
                backend.sync()
                finite = all(backend.all_finite(t) for t in outs.values())
                s0 = sets[0]
                if op.pass_ not in refs:
                    refs[op.pass_] = backend.reference(op.pass_, s0["q"], s0["k"], s0["v"], s0["do"], args.causal)
                compared = [t for t in refs[op.pass_] if t in outs]
                err = max((backend.rel_err(outs[t], refs[op.pass_][t]) for t in compared), default=None)

                def call(r, op=op, tl=per_set_tensors):
                    call_device(op, problem, config, tl[r % len(tl)], backend)
                rec = timed(base, op.pass_, call, n, d)
                ok = finite and err is not None and err < 1e-3
                record({**rec, "peak_share": peak_shares(rec["tflops"], peak), "rel_err": err,
                        "compared": compared, "all_outputs_written": finite, "tiles_used": used, "kernel_variants": runs,
                        "status": "ok" if ok else "CHECK FAILED (outputs not all written or rel err >= 1e-3)"})
                del outs, per_set_tensors
            except Exception as e:  # recorded, and the next configuration still runs
                record({**base, "ms": None, "status": f"error: {type(e).__name__}: {e}"})
        for pass_ in (sorted({op.pass_ for op in ops()}, reverse=True) if tiles is None else []):
            base = {"op": f"torch_sdpa_{pass_}", "N": n, "d": d, "tiles": "-", "sets": n_sets}
            if out_of_time(base["op"], n, d):
                record({**base, "ms": None, "status": "skipped: time budget"})
                continue
            try:
                run = backend.sdpa_runner(pass_, sets, args.causal)
                if run is None:
                    continue
                run(0)
                backend.sync()
                record({**timed(base, pass_, run, n, d), "peak_share": None, "status": "ok"})
            except Exception as e:
                record({**base, "ms": None, "status": f"error: {type(e).__name__}: {e}"})
        del sets
    write_json(args.out, result)
    failed = [r for r in result["records"] + result["decode"] if r["status"].startswith(("CHECK", "error"))]
    print(f"bench: {len(result['records'])} records, {len(failed)} failed, "
          f"{len([r for r in result['records'] if r['status'].startswith('skipped')])} skipped")
    return 1 if failed else 0


def decode_steps(args, backend):
    """Records of the decoding steps (DECODE_PLAN, or --decode B,N ...): time, GB/s, whether
    the FA2 forward's blocks pack each K/V head's query heads (pyfa.sim.tiles.fa2_launch on
    the device's SM count), and the relative error of the first sequence's output against
    the backend's reference on K and V repeated out to the query heads."""
    import pyfa
    from pyfa import _lib
    from pyfa.sim.tiles import DeviceProfile, fa2_launch
    ffi, _ = _lib.load()
    H, Hkv, d = DECODE_SHAPE["heads"], DECODE_SHAPE["heads_kv"], DECODE_SHAPE["head_dim"]
    split = pyfa.checks.decode_split_size(d)
    prof = pyfa.device_profile(backend.name)
    sms = DeviceProfile(prof["name"], prof["smem_per_block"], prof["max_threads_per_block"], prof["sm_count"])
    op = pyfa.api.OPS["fa2_forward"]
    plan = args.decode or DECODE_PLAN[backend.name]
    for b, n in plan:
        base = {"B": b, "N": n, "H": H, "Hkv": Hkv, "d": d, "split_size": split,
                "packed": fa2_launch(b, H, Hkv, 1, n, pyfa.default_tiles("fa2_forward", d, backend.name)[0],
                                     split, None, sms)[0] > 1}
        if time.time() + 5 > deadline():
            yield {**base, "ms": None, "status": "skipped: time budget"}
            continue
        try:
            t = {"q": backend.randn((b, H, 1, d)), "k": backend.randn((b, Hkv, n, d)),
                 "v": backend.randn((b, Hkv, n, d)), "o": backend.empty((b, H, 1, d)),
                 "lse": backend.empty((b, H, 1))}
            problem = ffi.new("pyfa_problem *", {"batch": b, "heads": H, "heads_kv": Hkv, "seqlen_q": 1,
                                                 "seqlen_k": n, "head_dim": d, "causal": 1,
                                                 "split_size": split})
            config = make_config(backend.name, None, "auto")
            backend.poison(t["o"])
            call_device(op, problem, config, t, backend)
            backend.sync()
            g = H // Hkv
            # One query aligned bottom-right sees every key: the reference runs unmasked (SDPA's
            # is_causal would align it top-left, to key 0 alone).
            ref = backend.reference("forward", t["q"][:1], backend.repeat_heads(t["k"][:1], g),
                                    backend.repeat_heads(t["v"][:1], g), t["q"][:1], False)["o"]
            err = backend.rel_err(t["o"][:1], ref)
            call = lambda r: call_device(op, problem, config, t, backend)  # noqa: E731
            times = backend.time_ms(call, choose_reps(backend.time_ms(call, 1)[0], args.target_ms, hi=10))
            ms = statistics.median(times)
            floor = 4 * (2 * b * Hkv * n * d + 2 * b * H * d)
            ok = backend.all_finite(t["o"]) and err < 1e-3
            yield {**base, "ms": ms, "ms_min": min(times), "gbs": floor / ms / 1e6, "rel_err": err,
                   "status": "ok" if ok else "CHECK FAILED (outputs not all written or rel err >= 1e-3)"}
        except Exception as e:  # recorded, and the next step still runs
            yield {**base, "ms": None, "status": f"error: {type(e).__name__}: {e}"}


def decode_pair(text):
    b, n = (int(x) for x in text.split(","))
    return b, n


def add_parser(sub):
    p = sub.add_parser("bench", help="time every op's device entry point beside torch SDPA")
    p.add_argument("--decode", type=decode_pair, nargs="*", metavar="B,N",
                   help="decoding steps to time (batch, context); default DECODE_PLAN's for the backend")
    p.add_argument("--out")
    p.add_argument("--backend", choices=["cuda", "emu"], default="cuda",
                   help="emu: the emulator on host buffers, to try this step without a GPU")
    p.add_argument("--seqlens", type=int, nargs="+")
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--batch", type=int, default=BENCH_BATCH)
    p.add_argument("--heads", type=int, default=BENCH_HEADS)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--target-ms", type=float, default=100.0,
                   help="timed calls per measurement: about this many ms' worth, 3 to 20")
    p.add_argument("--variants", nargs="+", default=BENCH_KERNEL_VARIANTS,
                   choices=["reference", "fast", "auto"], help="kernel variants timed side by side")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(run=cmd_bench)
