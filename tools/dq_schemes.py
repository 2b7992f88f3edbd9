#!/usr/bin/env python3
"""Two atomic-free ways to compute FA2's dQ, counted: HBM bytes, FLOPs, scratch memory.

  A  "dq kernel" (what pyfa does): a second kernel, one block per Q row block i, walks
     the K/V column blocks j, recomputes S_ij, P_ij, dP_ij, dS_ij and accumulates
     dQ_i = sum_j dS_ij K_j on chip. Its bytes are pyfa.sim.count_io's, the walkers of
     the real kernels (pyfa/sim/count.py).
  B  "partial buffers": the dK/dV kernel also forms dS_ij K_j for every visited (j, i)
     and stores it as partial j of dQ_i in a scratch buffer; a reduction kernel, one
     block per Q row block, adds the partials j = 0, 1, ... in order and writes dQ_i.
     Its walkers are below: the preprocess and dK/dV walkers of A plus the partials.

Both are deterministic and give the same bits (the fixed order of the partial sums over j
is the same). Counts are per the kernels' loop nests at the library's default tiles for
the emulated H200 profile (sim.tiles.default_tiles), fp32:
  - bytes: every HBM read and write, statistics (LSE, D) included;
  - FLOPs: 2 br bc d per matmul per visited tile pair (A: 4 in dK/dV + 3 in dQ;
    B: 5 in dK/dV), plus one per element for the elementwise steps (scale, mask select
    not counted, exp, dP - D, times P) and the adds of B's reduction; exps listed apart;
  - scratch: what the call allocates besides its inputs and outputs (D; B adds the
    partials, at least one br x d tile per visited pair).

    python tools/dq_schemes.py              # the table of docs/fa2_backward_dq.md
    python tools/dq_schemes.py --markdown
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyfa.sim as sim  # noqa: E402  (pure NumPy: no compiled library needed)
from pyfa.sim.count import (STAT_BYTES, Walk, fa2_backward_dkdv_io,  # noqa: E402
                            fa2_backward_preprocess_io)
from pyfa.sim.io import format_bytes  # noqa: E402
from pyfa.sim.mask import Mask  # noqa: E402
from pyfa.sim.tiling import ceil_div  # noqa: E402


def _mask(causal, Nq, Nk):
    return Mask.resolve(causal, None, "bottom_right", Nq, Nk)


def _kv_tiles_visited(causal, i, Nq, Nk, Br, Bc):
    """How many K/V tiles Q tile i visits."""
    begin, end = _mask(causal, Nq, Nk).kv_tiles(i * Br, min(Br, Nq - i * Br), Bc, Nk)
    return end - begin


def visited_pairs(Nq, Nk, Br, Bc, causal):
    """(br, bc) of every tile pair the kernels visit (the same set for both walks)."""
    mask = _mask(causal, Nq, Nk)
    for j in range(ceil_div(Nk, Bc)):
        bc = min(Bc, Nk - j * Bc)
        for i in range(*mask.q_tiles(j * Bc, bc, Br, Nq)):
            yield min(Br, Nq - i * Br), bc


def scheme_b_io(Nq, Nk, d, Br, Bc, causal, e=4):
    """One head of scheme B: preprocess, dK/dV with partial dQ stores, reduction."""
    w = Walk(Nq, Nk, d, 1, Br, Bc, _mask(causal, Nq, Nk), e)
    io = fa2_backward_preprocess_io(w) + fa2_backward_dkdv_io(w)
    for br, _ in visited_pairs(Nq, Nk, Br, Bc, causal):
        io.write("dQ partials", br * d * e)
    for i in range(ceil_div(Nq, Br)):
        br = min(Br, Nq - i * Br)
        io.read("dQ partials", _kv_tiles_visited(causal, i, Nq, Nk, Br, Bc) * br * d * e)
    io.write("dQ", Nq * d * e)
    return io


def flops(Nq, Nk, d, Br_kv, Bc_kv, Br_q, Bc_q, causal, scheme):
    """(FLOPs, exps) of one head; the preprocess (2 Nq d) is in both."""
    total, exps = 2 * Nq * d, 0
    for br, bc in visited_pairs(Nq, Nk, Br_kv, Bc_kv, causal):
        # S, dP, dV, dK (+ dQ partial in B); elementwise: scale, exp's argument, dP - D, P x.
        total += (4 if scheme == "A" else 5) * 2 * br * bc * d + 4 * br * bc
        exps += br * bc
    if scheme == "A":
        for br, bc in visited_pairs(Nq, Nk, Br_q, Bc_q, causal):
            total += 3 * 2 * br * bc * d + 4 * br * bc
            exps += br * bc
        total += Nq * d  # the final scaling
    else:
        for i in range(ceil_div(Nq, Br_kv)):
            br = min(Br_kv, Nq - i * Br_kv)
            total += _kv_tiles_visited(causal, i, Nq, Nk, Br_kv, Bc_kv) * br * d  # the adds
        total += Nq * d
    return total, exps


def compare(B, H, N, d, causal):
    Br_kv, Bc_kv = sim.default_tiles("fa2_backward_dkdv", d)
    Br_q, Bc_q = sim.default_tiles("fa2_backward_dq", d)
    a = sim.count_io("fa2", passes="backward", batch=B, heads=H, seqlen_q=N, seqlen_k=N,
                     head_dim=d, causal=causal)
    b = scheme_b_io(N, N, d, Br_kv, Bc_kv, causal).scaled(B * H)
    fa, ea = flops(N, N, d, Br_kv, Bc_kv, Br_q, Bc_q, causal, "A")
    fb, eb = flops(N, N, d, Br_kv, Bc_kv, Br_q, Bc_q, causal, "B")
    partials = b.writes["dQ partials"]
    return {"N": N, "d": d, "causal": causal, "tiles": f"{Br_kv}x{Bc_kv}",
            "bytes_A": a.total, "bytes_B": b.total,
            "flops_A": fa * B * H, "flops_B": fb * B * H, "exp_A": ea * B * H, "exp_B": eb * B * H,
            "scratch_A": B * H * N * STAT_BYTES, "scratch_B": B * H * N * STAT_BYTES + partials,
            "inputs": 3 * B * H * N * d * 4}


def rows(B=4, H=8, Ns=(1024, 2048, 8192), ds=(64, 128)):
    return [compare(B, H, N, d, c) for d in ds for N in Ns for c in (False, True)]


def table(results, markdown=False):
    head = ["N", "d", "causal", "tiles", "HBM A", "HBM B", "B/A", "GFLOP A", "GFLOP B", "B/A",
            "scratch A", "scratch B", "B scratch / (Q+K+V)"]
    lines = []
    for r in results:
        lines.append([str(r["N"]), str(r["d"]), "yes" if r["causal"] else "no", r["tiles"],
                      format_bytes(r["bytes_A"]), format_bytes(r["bytes_B"]),
                      f"{r['bytes_B'] / r['bytes_A']:.4f}",
                      f"{r['flops_A'] / 1e9:.1f}", f"{r['flops_B'] / 1e9:.1f}",
                      f"{r['flops_B'] / r['flops_A']:.3f}",
                      format_bytes(r["scratch_A"]), format_bytes(r["scratch_B"]),
                      f"{r['scratch_B'] / r['inputs']:.1f}x"])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[k]) for line in lines)) for k, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head), "-" * len(fmt(head))] + [fmt(line) for line in lines])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="a Markdown table")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 8192])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    args = ap.parse_args(argv)
    print(f"B={args.batch}, H={args.heads}, Nq=Nk=N, fp32, default tiles (emulated H200); "
          f"A = separate dQ kernel (pyfa), B = per-column-block partial dQ buffers + reduction")
    print(table(rows(args.batch, args.heads, tuple(args.seqlen), tuple(args.head_dim)), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
