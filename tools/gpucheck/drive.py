"""gpu_bench.py drive: each op once per case through the Python API, the program that
compute-sanitizer and ncu watch."""

from .common import entry_cmd, forward_of, ops

DRIVE_SIZES = {
    # Small problems with tails (N not a multiple of the tiles), Nq != Nk both ways, the
    # default tiles and small explicit ones, both masks, two head dims: for memcheck.
    "small": [dict(batch=1, heads=2, seqlen_q=nq, seqlen_k=nk, head_dim=d, tiles=t, causal=c)
              for d in (64, 128) for nq, nk in ((70, 90), (90, 70)) for t in (None, (16, 32))
              for c in (False, True)],
    # Racecheck instruments every shared-memory access and runs far slower: two cases,
    # still both tile shapes and both masks (a missing barrier does not depend on d).
    "race": [dict(batch=1, heads=2, seqlen_q=70, seqlen_k=90, head_dim=64, tiles=None, causal=False),
             dict(batch=1, heads=2, seqlen_q=90, seqlen_k=70, head_dim=64, tiles=(16, 32), causal=True)],
}


def drive_op(op, case, backend, emu_check="off"):
    """One call of `op` (an OPS entry) through its Python function; a backward op first
    runs its forward for the tensors it reads. Inputs are passed in op.inputs order, the
    order of both the C function and the Python one."""
    import numpy as np
    import pyfa
    rng = np.random.default_rng(7)
    b, h, nq, nk, d = (case[k] for k in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim"))
    tensors = {t: rng.standard_normal(pyfa.api.tensor_shape(t, b, h, nq, nk, d), dtype=np.float32)
               for t in ("q", "k", "v", "do")}
    tiles = dict(zip(("block_r", "block_c"), case["tiles"])) if case["tiles"] else {}
    kw = dict(causal=case["causal"], options=pyfa.Options(backend=backend, emu_check=emu_check, **tiles))
    if op.pass_ == "backward":
        fwd = forward_of(op)
        outs = getattr(pyfa, fwd.name)(*[tensors[t] for t in fwd.inputs], **kw)
        tensors.update(zip(fwd.outputs, outs))
    return getattr(pyfa, op.name)(*[tensors[t] for t in op.inputs], **kw)


def cmd_drive(args):
    import pyfa
    names = [op.name for op in ops()] if args.ops == "all" else args.ops.split(",")
    if args.shape:
        b, h, n, d = args.shape
        cases = [dict(batch=b, heads=h, seqlen_q=n, seqlen_k=n, head_dim=d, tiles=None, causal=False)]
    else:
        cases = DRIVE_SIZES[args.size]
    errors = launches = 0
    for name in names:
        for case in cases:
            try:
                drive_op(pyfa.api.OPS[name], case, args.backend, args.emu_check)
                launches += 1
            except ValueError as e:  # the library's own argument checks (e.g. tiles it rejects)
                print(f"drive: {name} {case}: rejected: {e}")
            except Exception as e:  # reported; the other ops still run under the tool
                errors += 1
                print(f"drive: {name} {case}: {type(e).__name__}: {e}")
    print(f"drive: done, {launches} calls of {', '.join(names)}, {errors} errors")
    return 1 if errors else 0


def drive_cmd(names, size, backend="cuda", emu_check="off"):
    """The driven program: `size` is a DRIVE_SIZES name or a shape (B, H, N, d)."""
    how = ["--size", size] if isinstance(size, str) else ["--shape", *size]
    strict = ["--emu-check", emu_check] if emu_check != "off" else []
    return entry_cmd("drive", "--ops", ",".join(names), *how, "--backend", backend, *strict)


def add_parser(sub):
    p = sub.add_parser("drive", help="run ops once (the program the tools watch)")
    p.add_argument("--ops", default="all", help="comma-separated ops (e.g. fa2_forward) or 'all'")
    p.add_argument("--size", choices=sorted(DRIVE_SIZES), default="small")
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "N", "D"),
                   help="instead of --size: one call at this shape, default tiles, no mask")
    p.add_argument("--backend", choices=["cuda", "emu"], default="cuda")
    p.add_argument("--emu-check", choices=["off", "strict"], default="off",
                   help="the emulator's strict mode (with --backend emu)")
    p.set_defaults(run=cmd_drive)
