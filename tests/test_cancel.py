"""Cancelling long calls: Ctrl-C (SIGINT) reaches Python as KeyboardInterrupt within a
fraction of a second, and the library stays usable; a progress callback sees the work
advance and can cancel it (pyfa.CancelledError), writing nothing of the caller's."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import pyfa

# The children run from here, with it first on PYTHONPATH: they import the pyfa under test
# (`python -c` puts the current directory first on sys.path).
ROOT = Path(pyfa.__file__).resolve().parents[1]

# A child that starts an emulated FA1 forward of several seconds, reports when it is in
# the call, and on KeyboardInterrupt prints the (system-wide monotonic) time it got it,
# then makes a second, small call that must still succeed bit for bit.
CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    import pyfa
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 2048, 64), dtype=np.float32)
    small = q[:, :1, :40]
    pyfa.fa1_forward(small, small, small, backend="emu")  # load the library first
    print("calling", flush=True)
    t0 = time.monotonic()
    try:
        pyfa.fa1_forward(q, q, q, backend="emu")
        print("finished uninterrupted after", time.monotonic() - t0, flush=True)
    except KeyboardInterrupt:
        print("interrupted at", time.monotonic(), flush=True)
    o, m, l = pyfa.fa1_forward(small, small, small, backend="emu")
    r = pyfa.sim.fa1_forward(small, small, small)
    same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in ((o, r.o), (m, r.m), (l, r.l)))
    print("second call", "ok" if same else "DIFFERS", flush=True)
""")


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child needs POSIX")
def test_ctrl_c_interrupts_a_long_call_and_the_library_stays_usable():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "calling", child.stderr.read()
        time.sleep(0.5)  # well inside the call
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    lines = out.splitlines()
    assert child.returncode == 0, out + err
    assert lines[0].startswith("interrupted at"), out
    latency = float(lines[0].split()[-1]) - sent
    assert latency < 0.5, f"KeyboardInterrupt {latency:.2f} s after SIGINT"
    assert lines[1] == "second call ok", out


# A stand-in for a library call that keeps pyfa.h's progress contract: it reports its work
# through config->progress every 10 ms and returns PYFA_ERROR_CANCELLED soon after a
# nonzero answer. It checks the Python side (helper thread, callback, Ctrl-C) on its own.
STAND_IN = textwrap.dedent("""
    import time
    from pyfa._lib import constant
    def stand_in(config, seconds, steps=None):
        total = int(seconds / 0.01)
        for done in range(total + 1):
            if config.progress(config.progress_user, done, total):
                return constant("PYFA_ERROR_CANCELLED")
            if steps is not None:
                steps.append(done)
            time.sleep(0.01)
        return constant("PYFA_OK")
""")
exec(STAND_IN)


def _stand_in_call(seconds, progress=None):
    ffi, _ = pyfa._lib.load()
    config = ffi.new("pyfa_config *")
    steps = []
    pyfa._lib.call(lambda: stand_in(config, seconds, steps), config, progress=progress)
    return steps


def test_python_side_with_a_stand_in_call():
    assert len(_stand_in_call(0.1)) == 11  # runs to the end when nobody cancels
    seen = []
    _stand_in_call(0.05, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 5) for i in range(6)]
    with pytest.raises(pyfa.CancelledError):
        _stand_in_call(10, progress=lambda done, total: done == 3 or None)
    with pytest.raises(LookupError, match="mine"):
        _stand_in_call(10, progress=lambda done, total: (_ for _ in ()).throw(LookupError("mine")))


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child needs POSIX")
def test_ctrl_c_with_a_stand_in_call():
    code = STAND_IN + textwrap.dedent("""
        import time
        import pyfa
        ffi, _ = pyfa._lib.load()
        config = ffi.new("pyfa_config *")
        steps = []
        print("calling", flush=True)
        try:
            pyfa._lib.call(lambda: stand_in(config, 30, steps), config)
        except KeyboardInterrupt:
            at = time.monotonic()
            n = len(steps)
            time.sleep(0.1)
            print("interrupted at", at, "stopped", n == len(steps), flush=True)
        pyfa._lib.call(lambda: stand_in(config, 0.02), config)
        print("second call ok", flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "calling", child.stderr.read()
        time.sleep(0.3)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, out + err
    first, second = out.splitlines()
    words = first.split()
    assert words[:2] == ["interrupted", "at"] and words[-2:] == ["stopped", "True"], out
    assert float(words[2]) - sent < 0.2, f"KeyboardInterrupt {float(words[2]) - sent:.2f} s after SIGINT"
    assert second == "second call ok"


def test_progress_sees_the_work_advance():
    # About a second of emulation: progress is called "now and then", not at every step.
    q = np.random.default_rng(1).standard_normal((1, 2, 1024, 64), dtype=np.float32)
    seen = []
    o, m, l = pyfa.fa1_forward(q, q, q, backend="emu", progress=lambda done, total: seen.append((done, total)))
    assert seen, "progress was never called"
    assert all(0 <= done <= total for done, total in seen), seen
    r = pyfa.sim.fa1_forward(q, q, q)
    assert np.array_equal(o.view(np.uint32), r.o.view(np.uint32))


def test_progress_returning_true_cancels():
    q = np.random.default_rng(2).standard_normal((1, 4, 1024, 64), dtype=np.float32)
    calls = []

    def stop(done, total):
        calls.append(done)
        return True

    t0 = time.monotonic()
    with pytest.raises(pyfa.CancelledError):
        pyfa.fa1_forward(q, q, q, backend="emu", progress=stop)
    assert calls and time.monotonic() - t0 < 1.0
    # Usable afterwards, and None returned by progress cancels nothing.
    small = q[:, :, :32]
    o, _, _ = pyfa.fa1_forward(small, small, small, backend="emu", progress=lambda d, t: None)
    assert np.array_equal(o.view(np.uint32), pyfa.sim.fa1_forward(small, small, small).o.view(np.uint32))


def test_an_exception_in_progress_reaches_the_caller():
    q = np.random.default_rng(3).standard_normal((1, 4, 1024, 64), dtype=np.float32)

    def broken(done, total):
        raise LookupError("from progress")

    with pytest.raises(LookupError, match="from progress"):
        pyfa.fa1_forward(q, q, q, backend="emu", progress=broken)


def test_calls_from_other_threads_run_there():
    q = np.random.default_rng(4).standard_normal((1, 2, 64, 32), dtype=np.float32)
    out = {}

    def worker():
        try:
            out["o"] = pyfa.attention(q, q, q, backend="emu")
            pyfa.attention(q, q, q, backend="emu", block_r=0)
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert np.array_equal(out["o"], pyfa.attention(q, q, q, backend="emu"))
    assert isinstance(out["error"], ValueError) and "block_r" in str(out["error"])


def test_a_forked_child_gets_a_helper_thread_of_its_own():
    # The main thread's calls go to one long-lived helper thread; a child forked after the
    # first call inherits its queue but not the thread, and must start its own.
    code = textwrap.dedent("""
        import os
        import numpy as np
        import pyfa
        q = np.random.default_rng(1).standard_normal((1, 2, 40, 16), dtype=np.float32)
        first = pyfa.attention(q, q, q, backend="cpu")
        pid = os.fork()
        if pid == 0:
            again = pyfa.attention(q, q, q, backend="cpu")
            os._exit(0 if np.array_equal(again, first) else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(), cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["child", "0"], run.stdout + run.stderr


def test_library_errors_keep_their_message_across_the_helper_thread():
    # The library's message is per thread: it must be read on the thread that called.
    q = np.zeros((1, 1, 8, 256), np.float32)
    with pytest.raises(pyfa.TileTooLargeError, match=r"need \d+ bytes"):
        pyfa.attention(q, q, q, block_r=256, block_c=256, backend="emu")


def test_auto_says_once_why_cuda_is_not_used():
    code = textwrap.dedent("""
        import warnings
        import numpy as np
        import pyfa
        q = np.zeros((4, 8), np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pyfa.attention(q, q, q)
            pyfa.attention(q, q, q)
        for w in caught:
            print(w.category.__name__, w.message)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=child_env(), cwd=ROOT)
    assert run.returncode == 0, run.stderr
    ffi, lib = pyfa._lib.load()
    lines = run.stdout.splitlines()
    if lib.pyfa_backend_compiled(lib.PYFA_BACKEND_CUDA) and not lib.pyfa_backend_available(lib.PYFA_BACKEND_CUDA):
        reason = pyfa.unavailable_backends()["cuda"]
        assert reason
        assert lines == [f"RuntimeWarning pyfa: backend='auto' falls back to the CPU: this libpyfa "
                         f"has a CUDA backend, but it cannot run here ({reason})"]
    else:  # CUDA usable, or not built in: auto runs where it should, nothing to say
        assert lines == []
    assert ("cuda" in pyfa.backends()) != ("cuda" in pyfa.unavailable_backends())
