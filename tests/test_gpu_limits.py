"""Every launch the library can make, on every architecture it is built for, within that
architecture's limits: without a GPU. The tile chooser is the library's own (the C ABI
over tests/c/fake_cuda.cpp, given each architecture's profile from tools/gpu_limits.py);
registers and static shared memory are ptxas's, read back from docs/gpu_limits.md (made
by tools/gpu_limits.py, which runs ptxas per architecture: too slow for a test)."""

import re
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_limits  # noqa: E402

DOC = ROOT / "docs" / "gpu_limits.md"


@pytest.fixture(scope="module")
def fake(fake_cuda_library):
    path = fake_cuda_library
    return gpu_limits.Fake(*gpu_limits.open_fake(path))


_plans = {}


def plans_on(fake, arch_name):
    """The chooser's launches on one architecture, made once per module."""
    if arch_name not in _plans:
        _plans[arch_name] = gpu_limits.launch_plans(fake, gpu_limits.ARCHS[arch_name], gpu_limits.table_rows())
    return _plans[arch_name]


def doc_facts():
    """{(arch, kernel row name): (function, registers, spills, static smem)} of the doc."""
    facts = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[0] in gpu_limits.ARCHS and cells[3].isdigit():
            facts[(cells[0], cells[1])] = (cells[2].strip("`"), int(cells[3]), int(cells[4]), int(cells[5]))
    return facts


def ptxas_of(arch_name):
    """The doc's facts for one architecture, as gpu_limits.check_launches takes them."""
    return {fn: dict(registers=regs, spill_stores=spills, spill_loads=0, smem_static=static)
            for (a, _), (fn, regs, spills, static) in doc_facts().items() if a == arch_name}


def test_the_doc_covers_every_kernel_on_every_architecture():
    facts = doc_facts()
    rows = gpu_limits.table_rows()
    assert len(rows) >= 21
    for arch in gpu_limits.ARCHS:
        for _, name, fn in rows:
            assert (arch, name) in facts, f"docs/gpu_limits.md lacks {name} on {arch}: rerun tools/gpu_limits.py"
            assert facts[(arch, name)][0] == fn
        for name, fn, _, _ in gpu_limits.direct_launches():
            assert (arch, name) in facts, f"docs/gpu_limits.md lacks {name} on {arch}: rerun tools/gpu_limits.py"
            assert facts[(arch, name)][0] == fn


def test_every_global_function_is_a_row_or_a_direct_launch():
    # Every __global__ function of src/ is launched through the kernel table or by a
    # `<<<...>>>` of the CUDA backend that direct_launches reads: none escapes the limits.
    kernel = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)_kernel\b")
    found = {name for path in (ROOT / "src").rglob("*") if path.suffix in (".cu", ".cuh", ".h")
             for name in kernel.findall(path.read_text())}
    covered = {fn.split("<")[0].removesuffix("_kernel") for _, _, fn in gpu_limits.table_rows()}
    covered |= {fn for _, fn, _, _ in gpu_limits.direct_launches()}
    assert "dbias_fold" in found and found <= covered, sorted(found - covered)


# Launches known to exceed a limit, each exactly as docs/gpu_limits.md has it; none now
# (sm_100's spills in the fast FA2 forward at d = 128 went with the bias's row pointers,
# PYFA_FAST_BIAS_ROWS in kernels/fast/forward_tiles.h). Listed, not hidden: the test fails
# when one changes, better or worse, so that the list follows the kernels.
KNOWN = {}


@pytest.mark.parametrize("arch_name", list(gpu_limits.ARCHS))
def test_every_launch_fits_the_architecture(fake, arch_name):
    arch = gpu_limits.ARCHS[arch_name]
    rows = gpu_limits.table_rows()
    plans = plans_on(fake, arch_name)
    assert {row for row, *_ in plans} >= {0, 1, 2, 3, 4, 5}  # every reference kernel is launched
    for (row, threads, smem), where in plans.items():
        assert 0 < smem <= arch.smem_block_optin, (row, where)
        assert threads <= arch.threads_block, (row, where)
    results = gpu_limits.check_launches(arch, plans, ptxas_of(arch_name), rows, fake)
    problems = {r[0]: r[-1] for r in results if r[-1]}
    known = {name: [why] for (a, name), why in KNOWN.items() if a == arch_name}
    assert problems == known
    # The doc's own verdicts agree with the check's.
    for line in DOC.read_text().splitlines():
        if line.startswith(f"| {arch_name} |") and line.count("|") == 13:
            name = line.split("|")[2].strip()
            verdict = f"| NO: {known[name][0]} |" if name in known else "| yes |"
            assert line.rstrip().endswith(verdict), line


def test_the_check_fails_when_a_limit_is_exceeded(fake):
    # The chooser told an A100's 163 KiB, checked against a T4's 64 KiB: the launches it
    # picks do not fit, and the check says so. Registers: 255 per thread at 1024 threads
    # leave no block on an SM.
    turing = gpu_limits.ARCHS["sm_75"]
    rows = gpu_limits.table_rows()
    results = gpu_limits.check_launches(turing, plans_on(fake, "sm_80"), ptxas_of("sm_75"), rows, fake)
    assert any("shared memory >" in p for r in results for p in r[-1])
    assert gpu_limits.blocks_per_sm(turing, 255, 1024, 0)[0] == 0
    # The direct launches are held to the same limits: the fold's 256 threads on a device
    # of 128 per block.
    small = gpu_limits.Arch(0, "", 1024, 1024, 0, 128, 2048, 32, 65536, 255)
    fold = [r for r in gpu_limits.check_launches(small, {}, ptxas_of("sm_75"), [], fake) if r[0] == "dbias_fold"]
    assert fold and "256 threads > 128" in fold[0][-1]
    assert gpu_limits.blocks_per_sm(turing, 64, 256, 0) == (4, "threads")


def test_turing_tiles_fit_64_kib(fake):
    turing = gpu_limits.ARCHS["sm_75"]
    for op in gpu_limits.OPS:
        for d in (16, 32, 64, 128, 256):
            status, message, checks = fake.call(op, turing, head_dim=d)
            assert status == 0, message
            assert checks and all(smem <= 64 * 1024 for _, _, smem, *_ in checks)
    # The fast kernels' tiles need more: on Turing the fast variant says so.
    status, message, _ = fake.call("fa2_forward", turing, head_dim=64, variant=gpu_limits.VARIANTS["fast"])
    assert status == 1 and "do not fit in fake GPU 0's 65536 bytes" in message


def test_grids_at_the_largest_problems_the_api_takes(fake):
    grids, (status, message, _) = gpu_limits.grid_check(fake)
    assert {op for op, _, _ in grids} == set(gpu_limits.OPS)
    assert max(g[1] for _, _, g in grids) == 65535 and max(g[2] for _, _, g in grids) == 65535
    assert max(g[0] for _, _, g in grids) == 2 ** 31 - 1
    for _, _, grid in grids:
        assert all(1 <= n <= m for n, m in zip(grid, gpu_limits.MAX_GRID)), grid
    assert status == 1 and "2^31-1 tiles" in message
    for batch, heads in ((65536, 1), (1, 65536)):
        status, message, checks = fake.call("fa2_forward", batch=batch, heads=heads, seqlen=16, head_dim=16,
                                            refuse_launch=True)
        assert status == 1 and "at most 65535" in message and checks == []


def test_the_doc_matches_the_chooser(fake):
    # The doc's thread and dynamic-shared-memory columns are what the chooser does now.
    text_ = DOC.read_text()
    rows = gpu_limits.table_rows()
    for arch_name, arch in gpu_limits.ARCHS.items():
        for name, fn, regs, spills, static, threads, smem, where, blocks, limiter, _ in gpu_limits.check_launches(
                arch, plans_on(fake, arch_name), ptxas_of(arch_name), rows, fake):
            shown = f"| {arch_name} | {name} | `{fn}` | {regs} | {spills} | {static} | {threads or '-'} | " \
                    f"{'-' if smem is None else smem} | {where} | {blocks} | {limiter} |"
            assert shown in text_, f"{shown}: rerun tools/gpu_limits.py --write docs/gpu_limits.md"


def test_profiles_are_those_of_the_guide():
    # Spot checks of the table against the CUDA C++ Programming Guide's numbers.
    a = gpu_limits.ARCHS
    assert a["sm_75"].smem_block_optin == 65536 and a["sm_75"].threads_sm == 1024
    assert a["sm_80"].smem_block_optin == 166912 and a["sm_90"].smem_block_optin == 232448
    assert a["sm_86"].smem_block_optin == a["sm_89"].smem_block_optin == a["sm_120"].smem_block_optin == 101376
    assert re.fullmatch(r"sm_\d+", next(iter(a)))
    assert [x.cc for x in a.values()] == sorted(x.cc for x in a.values())


@pytest.mark.parametrize("arch_name", list(gpu_limits.ARCHS))
def test_copy_stages_follow_the_architecture(fake, arch_name):
    """The fast FA2 backward at d = 128 runs its two-stage dQ and dK/dV rows (tile j+1's
    copies behind tile j's arithmetic) exactly where a block may hold their shared memory
    (sm_90, sm_100: 227 KiB), and the one-stage rows where only those fit (sm_80)."""
    arch = gpu_limits.ARCHS[arch_name]
    names = {row: name for row, name, _ in gpu_limits.table_rows()}
    _, _, checks = fake.call("fa2_backward", arch, head_dim=128, variant=gpu_limits.VARIANTS["fast"],
                             block_r=64, block_c=64)
    launched = {names[row]: smem for row, _, smem, *_ in checks}
    two = {"fa2_backward_dq/fast d=128 64x64 2 stages", "fa2_backward_dkdv/fast d=128 64x64 2 stages"}
    one = {"fa2_backward_dq/fast d=128 64x64", "fa2_backward_dkdv/fast d=128 64x64"}
    if arch.smem_block_optin >= 231424:  # two K_j, V_j (or Q_i, dO_i) buffers
        assert two <= set(launched) and not one & set(launched)
        assert all(launched[n] == 231424 for n in two)
    elif arch.smem_block_optin >= 165888:
        assert one <= set(launched) and not two & set(launched)
    else:
        assert not (one | two) & set(launched)
