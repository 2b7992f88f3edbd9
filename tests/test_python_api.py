"""The Python layering: pyfa.Options (execution apart from semantics), one exception
hierarchy, the simulator as a subpackage that `import pyfa` leaves alone, and the
Python-side promises: windows of any size, empty problems, overlapping outputs refused,
Ctrl-C after success, PYFA_LIBRARY as given, `--help` listing every flag."""

import asyncio
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import pyfa
from pyfa import _lib
from reference import make_inputs, same_bits

ROOT = Path(pyfa.__file__).resolve().parents[1]
Q, K, V, DO = make_inputs((1, 2, 16, 8), (1, 2, 12, 8), 3, "do")
EMU = pyfa.Options(backend="emu", block_r=8, block_c=4)
SEMANTICS = ["causal", "window", "causal_align", "scale"]


def child(code, **env):
    """Runs code in a fresh Python that imports this pyfa; returns its stdout."""
    environ = dict(os.environ, **env)
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=environ, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


# ---- semantics keywords, one order; execution in pyfa.Options

@pytest.mark.parametrize("fn", [pyfa.attention, pyfa.attention_grad, pyfa.fa1_forward,
                                pyfa.fa1_backward, pyfa.fa2_forward, pyfa.fa2_backward,
                                pyfa.sim.fa1_forward, pyfa.sim.fa1_backward,
                                pyfa.sim.fa2_forward, pyfa.sim.fa2_backward])
def test_every_function_takes_the_semantics_in_one_order_and_options(fn):
    keywords = [n for n, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY]
    assert [n for n in keywords if n in SEMANTICS] == SEMANTICS
    assert keywords.index("scale") < keywords.index("layout") < keywords.index("options")
    assert not set(keywords) & set(pyfa.options.FIELDS), "execution belongs in options="


def test_options_give_the_bits_the_old_keywords_gave():
    with pytest.warns(DeprecationWarning, match=r"pyfa\.fa2_forward\(\.\.\., backend=\.\.\., "
                                                r"block_r=\.\.\., block_c=\.\.\.\) is deprecated.*"
                                                r"options=pyfa\.Options\(backend=\.\.\."):
        old = pyfa.fa2_forward(Q, K, V, causal=True, backend="emu", block_r=8, block_c=4)
    new = pyfa.fa2_forward(Q, K, V, causal=True, options=EMU)
    sim = pyfa.sim.fa2_forward(Q, K, V, causal=True, options=EMU)
    assert all(same_bits(a, b) for a, b in zip(old, new))
    assert same_bits(new[0], sim.o) and same_bits(new[1], sim.lse)
    with pytest.warns(DeprecationWarning, match=r"pyfa\.sim\.fa2_forward\(\.\.\., block_r=\.\.\."):
        old_sim = pyfa.sim.fa2_forward(Q, K, V, causal=True, block_r=8, block_c=4)
    assert same_bits(old_sim.o, sim.o)


def test_the_new_forms_never_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pyfa.attention_grad(Q, K, V, DO, options=EMU)
        with EMU:
            pyfa.attention(Q, K, V)
            pyfa.sim.fa1_forward(Q, K, V)


def test_a_with_block_sets_the_default_and_options_replace_it():
    calls = []
    record = pyfa.Options(backend="emu", progress=lambda done, total: calls.append("ctx"))
    with record as entered:
        assert entered is record and pyfa.Options.current() is record
        pyfa.fa2_forward(Q, K, V)
        assert calls and set(calls) == {"ctx"}
        calls.clear()
        pyfa.fa2_forward(Q, K, V, options=pyfa.Options(backend="emu"))
        assert not calls, "options= replaces the context's options"
        with pyfa.Options(backend="cpu") as inner:
            assert pyfa.Options.current() is inner
        assert pyfa.Options.current() is record
    assert pyfa.Options.current() == pyfa.Options()


def test_the_context_is_per_thread_and_per_task():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(backend):
        with pyfa.Options(backend=backend):
            barrier.wait()
            seen[backend] = pyfa.Options.current().backend

    threads = [threading.Thread(target=worker, args=(b,)) for b in ("emu", "cpu")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"emu": "emu", "cpu": "cpu"}

    async def task(threads_):
        with pyfa.Options(threads=threads_):
            await asyncio.sleep(0.01)
            return pyfa.Options.current().threads

    async def both():
        return await asyncio.gather(task(1), task(2))

    assert asyncio.run(both()) == [1, 2]


def test_unknown_names_and_bad_values_are_refused():
    with pytest.raises(TypeError, match="blok_r"):
        pyfa.Options(blok_r=4)
    with pytest.raises(TypeError, match="blok_r"):
        pyfa.fa2_forward(Q, K, V, blok_r=4)
    with pytest.raises(TypeError, match="backend"):
        pyfa.sim.fa2_forward(Q, K, V, backend="emu")  # the simulator never took it
    with pytest.raises(TypeError, match="options: expected a pyfa.Options"):
        pyfa.attention(Q, K, V, options={"backend": "emu"})
    with pytest.raises(ValueError, match="block_r"):
        pyfa.Options(block_r=0)
    with pytest.raises(ValueError, match="backend"):
        pyfa.attention(Q, K, V, options=pyfa.Options(backend="gpu"))
    with pytest.raises(TypeError, match="progress"):
        pyfa.Options(progress=3)


def test_the_simulator_reports_progress_and_can_be_cancelled():
    seen = []
    f = pyfa.sim.fa2_forward(Q, K, V, options=pyfa.Options(block_r=8, block_c=4))
    for call in (lambda o: pyfa.sim.fa2_forward(Q, K, V, options=o),
                 lambda o: pyfa.sim.fa2_backward(Q, K, V, f.o, f.lse, DO, options=o)):
        seen.clear()
        result = call(pyfa.Options(block_r=8, block_c=4, progress=lambda d, t: seen.append((d, t))))
        assert len(seen) > 2 and all(0 <= d <= t for d, t in seen)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        assert seen[-1] == (result.io.total, result.io.total)
        with pytest.raises(pyfa.CancelledError, match="cancelled by its progress callback"):
            call(pyfa.Options(progress=lambda d, t: d > 0))


# ---- one exception hierarchy

def test_every_status_of_the_header_has_its_class():
    statuses = _lib.enum_values("pyfa_status", "PYFA_ERROR_")
    assert set(statuses) == {n.lower() for n in pyfa.errors.STATUS_CLASSES}
    classes = _lib.status_classes()
    assert classes[_lib.constant("PYFA_ERROR_TILE_TOO_LARGE")] is pyfa.TileTooLargeError
    assert classes[_lib.constant("PYFA_ERROR_CANCELLED")] is pyfa.CancelledError
    assert all(issubclass(c, pyfa.Error) for c in classes.values())


def test_the_simulator_and_the_library_raise_the_same_classes():
    assert pyfa.PyfaError is pyfa.Error
    assert issubclass(pyfa.InvalidArgumentError, ValueError)
    assert issubclass(pyfa.ArgumentTypeError, TypeError)
    assert issubclass(pyfa.TileTooLargeError, pyfa.InvalidArgumentError)
    assert pyfa.sim.TileTooLargeError is pyfa.TileTooLargeError
    for call in (pyfa.fa2_forward, pyfa.sim.fa2_forward):
        with pytest.raises(pyfa.InvalidArgumentError, match="causal_align"):
            call(Q, K, V, causal_align="middle")
        with pytest.raises(pyfa.ArgumentTypeError, match="q: expected"):
            call(Q.astype(np.float64), K, V)
    big = pyfa.Options(backend="emu", block_r=1024, block_c=1024)
    for call in (pyfa.fa2_forward, pyfa.sim.fa2_forward):
        with pytest.raises(pyfa.TileTooLargeError) as e:
            call(Q, K, V, options=big)
        assert isinstance(e.value, pyfa.Error) and isinstance(e.value, ValueError)


# ---- the simulator: a declared subpackage, imported on first use

def test_import_pyfa_leaves_the_simulator_alone():
    out = child("""
        import sys, pyfa
        print(sorted(m for m in sys.modules if m.startswith("pyfa.sim")))
        print(pyfa.sim.fa2_forward.__module__, "pyfa.sim" in sys.modules)
    """)
    assert out.splitlines() == ["[]", "pyfa.sim.fa2_forward True"]


def test_python_m_pyfa_sim_runs_from_a_checkout():
    out = subprocess.run([sys.executable, "-m", "pyfa.sim", "report", "--preset", "gpt2-medium"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0 and "fa2" in out.stdout, out.stderr


# ---- windows of any size, empty problems

@pytest.mark.parametrize("window", [(2**70, 0), (0, 2**70), (2**70, 2**70), (2**63, None)])
def test_a_window_wider_than_any_distance_is_the_unbounded_one(window):
    unbounded = tuple(None if side is None or side > Q.shape[2] + K.shape[2] else side
                      for side in window)
    want = pyfa.sim.fa2_forward(Q, K, V, window=unbounded, options=EMU)
    got = pyfa.fa2_forward(Q, K, V, window=window, options=EMU)
    sim = pyfa.sim.fa2_forward(Q, K, V, window=window, options=EMU)
    assert same_bits(got[0], sim.o) and same_bits(got[1], sim.lse)
    assert same_bits(sim.o, want.o)


@pytest.mark.parametrize("nq, nk", [(0, 12), (16, 0), (0, 0)])
@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_empty_problems_give_sdpa_s_answer(nq, nk, backend):
    q = np.ones((1, 2, nq, 8), np.float32)
    k = np.ones((1, 2, nk, 8), np.float32)
    opts = pyfa.Options(backend=backend)
    o, lse = pyfa.fa2_forward(q, k, k, options=opts)
    o1, m, l = pyfa.fa1_forward(q, k, k, options=opts)
    assert o.shape == o1.shape == q.shape and lse.shape == m.shape == l.shape == q.shape[:3]
    assert not o.any() and not o1.any() and np.all(lse == -np.inf) and np.all(m == -np.inf)
    assert not l.any()
    out = tuple(np.full_like(a, 7.0) for a in (q, q, k, k))
    got = pyfa.attention_grad(q, k, k, q, causal=True, options=opts, out=out)
    assert all(g is x and not g.any() for g, x in zip(got, out))
    assert [g.shape for g in got] == [q.shape, q.shape, k.shape, k.shape]
    sim = pyfa.sim.fa2_forward(q, k, k)
    assert same_bits(sim.o, o) and same_bits(sim.lse, lse) and sim.io.total == 0
    sim1 = pyfa.sim.fa1_backward(q, k, k, o1, m, l, q)
    assert [x.shape for x in (sim1.dq, sim1.dk, sim1.dv)] == [q.shape, k.shape, k.shape]
    assert not (sim1.dq.any() or sim1.dk.any() or sim1.dv.any())


@pytest.mark.parametrize("options, split_size, error", [
    (dict(backend="bogus"), None, "backend"), (dict(threads=10**9), None, "threads"),
    (dict(backend="cpu", variant="fast"), None, "variant"), (dict(block_r=2**20), None, "block_r"),
    (dict(emu_order="bogus"), None, "emu_order"), ({}, -5, "split_size"), ({}, "bogus", "split_size")])
def test_empty_problems_refuse_options_as_a_run_does(options, split_size, error):
    # No kernel runs, but what a run would refuse is refused (the library checks it on one row).
    q, k = np.ones((1, 2, 0, 8), np.float32), np.ones((1, 2, 4, 8), np.float32)
    with pytest.raises(pyfa.Error, match=error):
        pyfa.attention(q, k, k, split_size=split_size, options=pyfa.Options(**options))
    with pytest.raises(pyfa.Error, match=error):
        pyfa.fa2_backward(q, k, k, q, np.zeros((1, 2, 0), np.float32), q, split_size=split_size,
                          options=pyfa.Options(**options))


def test_empty_problems_are_still_checked():
    q, k = np.ones((1, 2, 0, 8), np.float32), np.ones((1, 2, 4, 8), np.float32)
    for call in (pyfa.fa2_forward, pyfa.sim.fa2_forward):
        with pytest.raises(ValueError, match="window"):
            call(q, k, k, window=(-1, 0))
        with pytest.raises(ValueError, match="every dimension but the sequence lengths"):
            call(np.ones((1, 0, 0, 8), np.float32), k, k)
    with pytest.raises(ValueError, match="lse"):
        pyfa.sim.fa2_backward(q, k, k, q, np.zeros((1, 2, 1), np.float32), q)
    with pytest.raises(ValueError, match="lse"):
        pyfa.fa2_backward(q, k, k, q, np.zeros((1, 2, 1), np.float32), q)


# ---- overlapping outputs

def test_overlapping_outputs_are_refused_before_anything_is_written():
    o, lse = pyfa.fa2_forward(Q, K, V, options=EMU)
    x = np.full(Q.shape, 7.0, np.float32)
    with pytest.raises(ValueError, match=r"out \(dq\): overlaps out \(dk\)"):
        pyfa.fa2_backward(Q, Q, Q, o, lse, DO, options=EMU, out=(x, x, None))
    packed = np.full(Q.size + Q.shape[2] * 2, 7.0, np.float32)
    o_in, lse_in = packed[:Q.size].reshape(Q.shape), packed[Q.size - 16:Q.size + 16].reshape(1, 2, 16)
    with pytest.raises(ValueError, match=r"out \(o\): overlaps out \(lse\)"):
        pyfa.fa2_forward(Q, K, V, options=EMU, out=(o_in, lse_in))
    q = Q.copy()
    with pytest.raises(ValueError, match=r"out \(o\): overlaps q"):
        pyfa.attention(q, K, V, options=EMU, out=q)
    assert same_bits(q, Q)
    grads = tuple(np.full_like(a, 7.0) for a in (Q, Q, K))
    with pytest.raises(ValueError, match=r"out \(o\): overlaps out \(dq\)"):
        pyfa.attention_grad(Q, K, V, DO, options=EMU, out=(grads[0], grads[0], grads[2], None))
    assert np.all(x == 7.0) and np.all(packed == 7.0) and all(np.all(g == 7.0) for g in grads)
    # Views that interleave without sharing an element are fine.
    both = np.zeros((1, 2, 16, 16), np.float32)
    o2, _ = pyfa.fa2_forward(Q, K, V, options=EMU, out=(both[..., :8], None))
    assert same_bits(o2, o)


# ---- Ctrl-C after the library succeeded

def test_ctrl_c_after_success_raises_only_once_out_is_complete():
    # Both ways a main-thread call runs: on the helper thread, and (quick) on the main one.
    out = child("""
        import os, signal, threading, time
        import numpy as np, pyfa
        from pyfa import _lib
        real = _lib.call

        def late(quick):
            def call(fn, config, *args, progress=None, quick=None):
                def then_interrupt(*a):
                    status = fn(*a)
                    print("on main", threading.current_thread() is threading.main_thread())
                    os.kill(os.getpid(), signal.SIGINT)   # lands after the library succeeded
                    time.sleep(0.3)
                    return status
                return real(then_interrupt, config, *args, progress=progress, quick=forced)
            forced = quick
            return call

        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, 2, 16, 8), dtype=np.float32)
        want = pyfa.fa2_forward(q, q, q, options=pyfa.Options(backend="emu"))
        for quick in (False, True):
            o = np.full(q.shape, 7.0, np.float32)                          # written directly
            lse = np.full((1, 2, 32), 7.0, np.float32)[:, :, ::2]          # staged, copied after
            _lib.call = late(quick)
            try:
                pyfa.fa2_forward(q, q, q, options=pyfa.Options(backend="emu"), out=(o, lse))
                print("no interrupt")
            except KeyboardInterrupt:
                print("interrupted", np.array_equal(o, want[0]), np.array_equal(lse, want[1]))
            _lib.call = real
            print("next call", np.array_equal(pyfa.fa2_forward(q, q, q)[0], want[0]))
    """)
    assert out.splitlines() == ["on main False", "interrupted True True", "next call True"] + \
        ["on main True", "interrupted True True", "next call True"]


def test_small_calls_run_on_the_main_thread_large_ones_stay_cancellable():
    # The hand-off to the helper thread is skipped for calls of at most QUICK_WORK (by backend),
    # and only while SIGINT has Python's own handler; a Ctrl-C during such a call that
    # then fails is raised at once (nothing of the caller's was written).
    out = child("""
        import os, signal, threading
        import numpy as np, pyfa
        from pyfa import _lib
        real = _lib.call
        seen = []

        def spy(fn, config, *args, progress=None, quick=False):
            def where(*a):
                seen.append(threading.current_thread() is threading.main_thread())
                return fn(*a)
            return real(where, config, *args, progress=progress, quick=quick)

        _lib.call = spy
        rng = np.random.default_rng(0)
        small = rng.standard_normal((1, 2, 16, 8), dtype=np.float32)
        mid = rng.standard_normal((1, 4, 256, 64), dtype=np.float32)     # 4 * 256 * 256 * 64 = 2^24
        large = rng.standard_normal((1, 4, 1024, 128), dtype=np.float32)  # 4 * 1024 * 1024 * 128 = 2^29
        cpu = pyfa.Options(backend="cpu")
        pyfa.fa2_forward(small, small, small, options=cpu)
        pyfa.attention_grad(small, small, small, small, options=cpu)   # two calls: forward, backward
        pyfa.fa2_forward(mid, mid, mid, options=cpu)                   # quick natively,
        pyfa.fa2_forward(mid, mid, mid, options=pyfa.Options(backend="emu"))  # not emulated
        pyfa.fa2_forward(large, large, large, options=cpu)
        signal.signal(signal.SIGINT, lambda *a: None)
        pyfa.fa2_forward(small, small, small, options=cpu)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(seen)
        _lib.call = real
        ffi, _ = _lib.load()
        config = ffi.new("pyfa_config *")
        def fails():
            os.kill(os.getpid(), signal.SIGINT)
            return _lib.constant("PYFA_ERROR_INVALID_ARGUMENT")
        try:
            _lib.call(fails, config, quick=True)
        except KeyboardInterrupt:
            print("interrupted")
    """)
    assert out.splitlines() == ["[True, True, True, True, False, False, False]", "interrupted"]


# ---- the loader and the command line

def test_pyfa_library_without_a_slash_loads_that_file(tmp_path):
    shutil.copy(_lib.library_path(), tmp_path / "libpyfa.so")
    for name in ("libpyfa.so", "./libpyfa.so"):
        env = dict(os.environ, PYFA_LIBRARY=name,
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        run = subprocess.run([sys.executable, "-c", "import pyfa; print(pyfa._lib.library_path())"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == str(tmp_path / "libpyfa.so")


def test_help_lists_every_flag():
    run = subprocess.run([sys.executable, "-m", "pyfa", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0
    for flag in ("--batch", "--seqlen", "--backend", "--cflags", "--libs", "--cmake-dir"):
        assert flag in run.stdout, flag


# ---- enum values live in pyfa.h alone

def test_no_second_table_of_enum_values_in_python():
    import ast
    files = sorted((ROOT / "pyfa").rglob("*.py")) + [Path(__file__).parent / "emu_abi.py"]
    tables = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Dict) and len(node.keys) > 1
                    and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys)
                    and all(isinstance(v, ast.Constant) and type(v.value) is int for v in node.values)):
                tables.append(f"{path.name}:{node.lineno}")
    assert not tables, f"name -> int tables (read them from pyfa.h): {tables}"
    header = _lib.enum_values("pyfa_backend", "PYFA_BACKEND_")
    assert dict(pyfa.api.BACKENDS) == dict(header) and list(pyfa.api.BACKENDS)[0] == "auto"


# ---- score modifications: one keyword list (checks.ScoreMods) for pyfa and pyfa.sim

@pytest.mark.parametrize("function", ["attention", "attention_grad", "fa2_forward", "fa1_forward"])
def test_a_keyword_that_names_no_modification_is_refused_by_name(function):
    import pyfa.sim
    args = (Q, K, V, DO) if function == "attention_grad" else (Q, K, V)
    for module in (pyfa, pyfa.sim) if hasattr(pyfa.sim, function) else (pyfa,):
        with pytest.raises(TypeError, match="unexpected keyword argument 'softcapp'"):
            getattr(module, function)(*args, softcapp=30.0, options=EMU)
