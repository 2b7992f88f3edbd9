"""Progress and cancellation on the emulator, through the C ABI (pyfa_config.progress).

The emulator reports (blocks done, blocks in the grid) of the kernel it is running, at
most about every 50 ms and once more when the grid is complete; a nonzero return stops
the call with PYFA_ERROR_CANCELLED, inside a block if need be (FA1 runs one block per
(batch, head), each for seconds), and nothing the caller passed in is written."""

import time

import numpy as np

import emu_abi
import pyfa.sim

SENTINEL = 1234.5


class Recorder:
    """A progress callback that logs its calls and asks to stop at call `cancel_at`."""

    def __init__(self, cancel_at=None):
        self.cancel_at = cancel_at
        self.calls = []  # (time, done, total)
        self.cancelled_at = None
        self.callback = emu_abi.progress_callback(self)

    def __call__(self, done, total):
        now = time.monotonic()
        self.calls.append((now, done, total))
        if self.cancel_at is not None and len(self.calls) >= self.cancel_at:
            self.cancelled_at = now
            return 1
        return 0


def untouched(outputs):
    return all(np.all(a == np.float32(SENTINEL)) for a in outputs.values())


def test_progress_cancels_a_long_fa1_forward_quickly():
    B, H, N, d = 1, 2, 2048, 64  # two blocks of about a second each, uncancelled
    inputs = emu_abi.tensors(("q", "k", "v"), B, H, N, d, seed=1)
    outputs = emu_abi.tensors(("o", "m", "l"), B, H, N, d, fill=SENTINEL)
    rec = Recorder(cancel_at=3)
    start = time.monotonic()
    status, message = emu_abi.call("pyfa_fa1_forward", {**inputs, **outputs}, workers=2,
                                   progress=rec.callback)
    returned = time.monotonic()

    assert status == emu_abi.CANCELLED, message
    assert "cancelled" in message
    assert len(rec.calls) == 3
    assert all(total == B * H for _, _, total in rec.calls)
    assert all(done < B * H for _, done, _ in rec.calls), "cancelled inside the blocks"
    # Calls about 50 ms apart, the call stopping within a fraction of a second of the
    # callback's answer (bounds loose enough for a loaded machine).
    assert rec.calls[0][0] - start >= 0.04
    assert returned - rec.cancelled_at < 0.5, f"{returned - rec.cancelled_at:.3f} s to stop"
    assert untouched(outputs), "a cancelled call wrote the caller's buffers"

    # The library stays usable, with the same results as the simulator.
    small = emu_abi.tensors(("q", "k", "v"), 1, 2, 40, 16, seed=2)
    out = emu_abi.tensors(("o", "m", "l"), 1, 2, 40, 16, fill=SENTINEL)
    status, message = emu_abi.call("pyfa_fa1_forward", {**small, **out}, workers=2,
                                   block_r=8, block_c=16)
    assert status == emu_abi.OK, message
    sim = pyfa.sim.fa1_forward(small["q"], small["k"], small["v"], block_r=8, block_c=16)
    assert np.array_equal(out["o"].view(np.uint32), np.asarray(sim.o, np.float32).view(np.uint32))


def test_progress_reports_blocks_and_ends_complete():
    B, H, N, d = 1, 4, 512, 64
    t = {**emu_abi.tensors(("q", "k", "v"), B, H, N, d, seed=3),
         **emu_abi.tensors(("o", "m", "l"), B, H, N, d, fill=SENTINEL)}
    rec = Recorder()
    status, message = emu_abi.call("pyfa_fa1_forward", t, workers=2, progress=rec.callback)
    assert status == emu_abi.OK, message
    dones = [done for _, done, _ in rec.calls]
    assert rec.calls, "no progress call at all"
    assert all(total == B * H for _, _, total in rec.calls)
    assert dones == sorted(dones) and dones[-1] == B * H


def test_cancel_in_a_multi_kernel_call_writes_nothing():
    # FA2 backward: three kernels; stop during one of them.
    B, H, N, d = 1, 2, 768, 64
    t = emu_abi.tensors(("q", "k", "v", "do"), B, H, N, d, seed=4)
    fwd = pyfa.sim.fa2_forward(t["q"], t["k"], t["v"])
    t["o"] = np.asarray(fwd.o, np.float32)
    t["lse"] = np.asarray(fwd.lse, np.float32)
    outputs = emu_abi.tensors(("dq", "dk", "dv"), B, H, N, d, fill=SENTINEL)
    rec = Recorder(cancel_at=2)
    status, message = emu_abi.call("pyfa_fa2_backward", {**t, **outputs}, workers=2,
                                   progress=rec.callback)
    assert status == emu_abi.CANCELLED, message
    assert untouched(outputs)
