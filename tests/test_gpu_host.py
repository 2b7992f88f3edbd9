"""The CUDA backend's host side, without a GPU: which devices it runs on
(src/backends/cuda/device_rules.h, fed made-up facts by tests/c/fake_cuda.cpp), which
device a *_device call runs on, that its tiles come from that device, and how Python
switches device and allocates outputs for a call on a stream (fake torch and CuPy).
The architecture builds: sm_75 with this nvcc, sm_70 and sm_60 with CUDA 12's."""

import os
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

from pyfa._lib import constant
from pyfa import _arrays

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_limits  # noqa: E402

CUDA, AUTO = constant("PYFA_BACKEND_CUDA"), constant("PYFA_BACKEND_AUTO")
OK, INVALID, UNAVAILABLE = (constant(f"PYFA_{name}") for name in
                            ("OK", "ERROR_INVALID_ARGUMENT", "ERROR_BACKEND_UNAVAILABLE"))


@pytest.fixture(scope="module")
def fake(fake_cuda_library):
    path = fake_cuda_library
    return gpu_limits.Fake(*gpu_limits.open_fake(path))


def text(fake, p):
    return fake.ffi.string(p).decode()


def log(fake):
    return text(fake, fake.lib.fake_cuda_log()).splitlines()


# ---- which devices CUDA is available on

def availability(fake, built, major, minor, image_loads=1):
    fake.lib.fake_cuda_reset(-1, -1)
    fake.lib.fake_cuda_set_device(built.encode(), major, minor, image_loads)
    return fake.lib.pyfa_backend_available(CUDA), text(fake, fake.lib.pyfa_backend_reason(CUDA))


@pytest.mark.parametrize("major, minor", [(7, 5), (6, 1)])
def test_an_unbuilt_architecture_makes_auto_run_on_the_cpu_naming_why(fake, major, minor):
    usable, reason = availability(fake, "80 90 120", major, minor)
    assert usable == 0
    assert f"sm_{major}{minor}" in reason and f"compute capability {major}.{minor}" in reason
    assert '"80 90 120"' in reason and "fake GPU" in reason
    # A host call with AUTO goes to the cpu backend (the fake's logs its call and
    # refuses it): nothing was checked or launched on CUDA.
    lib, ffi = fake.lib, fake.ffi
    x, r = ffi.new("float[64]"), ffi.new("float[16]")
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=16, seqlen_k=16, head_dim=4))
    cfg = ffi.new("pyfa_config *", dict(backend=AUTO))
    lib.pyfa_fa2_forward(pr, cfg, x, x, x, ffi.new("float[64]"), r)
    assert log(fake) == ["cpu run"]
    # A *_device call with AUTO, or any call asking for CUDA, is refused with the reason.
    status = lib.pyfa_fa2_forward_device(pr, cfg, x, x, x, ffi.new("float[64]"), r, ffi.NULL)
    assert status == UNAVAILABLE and f"sm_{major}{minor}" in text(fake, lib.pyfa_last_error())
    cfg.backend = CUDA
    status = lib.pyfa_fa2_forward(pr, cfg, x, x, x, ffi.new("float[64]"), r)
    assert status == UNAVAILABLE and f"sm_{major}{minor}" in text(fake, lib.pyfa_last_error())
    assert log(fake) == ["cpu run"]  # nothing more


def test_a_kernel_image_that_does_not_load_makes_cuda_unavailable(fake):
    usable, reason = availability(fake, "75 80 90 100 120", 9, 0, image_loads=0)
    assert usable == 0 and "cudaErrorNoKernelImageForDevice" in reason and "sm_90" in reason


@pytest.mark.parametrize("built, major, minor, usable", [
    ("75 80 90 100 120", 7, 5, 1),   # Turing: its own SASS
    ("80 90 120", 8, 6, 1),          # sm_80 SASS runs on 8.6
    ("80 90 120", 8, 9, 1),
    ("90 120", 8, 6, 0),             # nothing of major 8, and no PTX older than 8.6
    ("80 90 120", 10, 0, 1),         # B200 JIT-compiles the compute_90 PTX
    ("80-real 90-real", 10, 0, 0),   # SASS only: nothing for 10.0
    ("80-virtual", 9, 0, 1),         # PTX only
    ("90a", 9, 0, 1),
    ("90a", 12, 0, 0),               # arch-specific: that exact device only
    ("100f", 10, 3, 1),              # family-specific: within 10.x
    ("100f", 12, 0, 0),
    ("native", 7, 5, 1),             # names no architecture: the image check decides
    ("75;80;90", 6, 1, 0),           # CMake's list separator
])
def test_architecture_rules(fake, built, major, minor, usable):
    got, reason = availability(fake, built, major, minor)
    assert got == usable, reason
    assert (reason == "") == bool(usable)


def test_cmake_builds_turing_and_blackwell_by_default():
    text_ = (ROOT / "CMakeLists.txt").read_text()
    line = next(l for l in text_.splitlines() if "set(CMAKE_CUDA_ARCHITECTURES" in l)
    assert line.split("ARCHITECTURES")[1].strip(" )").split() == ["75", "80", "90", "100", "120"]


# ---- which device a *_device call runs on

HOST, DEVICE, MANAGED = 0, 1, 2


def device_call(fake, places, current=0, stream_device=-1, fail_check=-1, profile1=None):
    """fa2_forward_device with q, k, v, o, lse placed as `places` says ({name: (kind,
    device)}, the rest device 0's); (status, message, log, current device after, last
    launch [device, Br, Bc, launches])."""
    lib, ffi = fake.lib, fake.ffi
    lib.fake_cuda_reset(fail_check, -1)
    if profile1 is not None:
        lib.fake_cuda_set_profile(1, *profile1)
    tensors = {n: ffi.new("float[]", 4 * 64 * 64) for n in ("q", "k", "v", "o")}
    tensors["lse"] = ffi.new("float[]", 64)
    for name, (kind, device) in places.items():
        lib.fake_cuda_place(tensors[name], kind, device)
    lib.fake_cuda_set_current(current)
    lib.fake_cuda_set_stream_device(stream_device)
    pr = ffi.new("pyfa_problem *", dict(batch=1, heads=1, seqlen_q=64, seqlen_k=64, head_dim=64))
    cfg = ffi.new("pyfa_config *", dict(backend=CUDA, variant=1))
    status = lib.pyfa_fa2_forward_device(pr, cfg, *(tensors[n] for n in ("q", "k", "v", "o", "lse")),
                                         ffi.cast("void *", 0x1234))
    last = ffi.new("int[4]")
    lib.fake_cuda_last_launch(last)
    return status, text(fake, lib.pyfa_last_error()), log(fake), lib.fake_cuda_current(), list(last)


ALL_ON_1 = {n: (DEVICE, 1) for n in ("q", "k", "v", "o", "lse")}


def test_a_device_call_runs_on_the_device_of_q_and_switches_back(fake):
    status, message, events, after, last = device_call(fake, ALL_ON_1, current=0)
    assert status == OK, message
    assert events[0] == "device 1" and events[-1] == "device 0"
    assert any(e.startswith("launch") for e in events[1:-1])
    assert after == 0 and last[0] == 1


def test_a_device_call_on_the_current_device_switches_nothing(fake):
    status, message, events, after, last = device_call(fake, ALL_ON_1, current=1)
    assert status == OK, message
    assert not any(e.startswith("device") for e in events) and after == 1 and last[0] == 1


def test_tiles_come_from_the_device_of_q(fake):
    # Device 1 has Turing's 64 KiB per block, device 0 (current) an H200's 227 KiB: the
    # default tiles are those of device 1's profile.
    turing = gpu_limits.ARCHS["sm_75"]
    status, message, _, _, last = device_call(fake, ALL_ON_1, profile1=(turing.smem_block_optin, 1024))
    assert status == OK, message
    lib, ffi = fake.lib, fake.ffi
    br, bc = ffi.new("int *"), ffi.new("int *")
    for device, smem in ((1, turing.smem_block_optin), (0, 227 * 1024)):
        lib.fake_cuda_reset(-1, -1)
        lib.fake_cuda_set_profile(device, smem, 1024)
        lib.fake_cuda_set_current(device)
        assert lib.pyfa_default_tiles(1, 64, CUDA, br, bc) == OK
        if device == 1:
            assert last[1:3] == [br[0], bc[0]]
        else:
            assert last[1:3] != [br[0], bc[0]]  # H200 tiles differ: the check can fail


@pytest.mark.parametrize("places, named", [
    ({"q": (DEVICE, 1)}, "k: on CUDA device 0, but q is on device 1"),
    ({"v": (HOST, 0)}, "v: a host pointer"),
    ({**ALL_ON_1, "lse": (DEVICE, 2)}, "lse: on CUDA device 2, but q is on device 1"),
])
def test_mixed_devices_and_host_pointers_are_refused_naming_the_tensor(fake, places, named):
    status, message, events, after, _ = device_call(fake, places, current=0)
    assert status == INVALID and named in message
    assert events == [] and after == 0


def test_managed_memory_goes_with_the_device_tensors(fake):
    status, message, _, after, last = device_call(fake, {**ALL_ON_1, "k": (MANAGED, 0)}, current=0)
    assert status == OK, message
    assert last[0] == 1 and after == 0


def test_a_stream_of_another_device_is_refused(fake):
    status, message, events, after, _ = device_call(fake, ALL_ON_1, current=0, stream_device=0)
    assert status == INVALID and "stream: belongs to CUDA device 0, but q is on device 1" in message
    assert events == [] and after == 0
    status, message, *_ = device_call(fake, ALL_ON_1, current=0, stream_device=1)
    assert status == OK, message


def test_a_failed_call_switches_back_too(fake):
    status, message, events, after, _ = device_call(fake, ALL_ON_1, current=0, fail_check=1)
    assert status != OK and "refused" in message
    assert events[0] == "device 1" and events[-1] == "device 0" and after == 0


# ---- Python: the device switch and outputs allocated for the call's stream

class FakeTorchStream:
    def __init__(self, handle, device=None):
        self.cuda_stream, self.device = handle, device


def fake_torch(current_device=0, current_stream=0):
    calls = []
    state = dict(device=current_device, stream=FakeTorchStream(current_stream))

    class Tensor:
        def __init__(self, shape, stream):
            self.shape, self.allocated_on, self.recorded = shape, stream, []

        def record_stream(self, s):
            calls.append(("record_stream", s.cuda_stream))
            self.recorded.append(s.cuda_stream)

    @contextmanager
    def stream(s):
        before = state["stream"]
        state["stream"] = s
        try:
            yield
        finally:
            state["stream"] = before

    def set_device(i):
        calls.append(("set_device", i))
        state["device"] = i

    cuda = types.SimpleNamespace(current_device=lambda: state["device"], set_device=set_device,
                                 current_stream=lambda device=None: state["stream"],
                                 default_stream=lambda device=None: FakeTorchStream(0),
                                 ExternalStream=FakeTorchStream, stream=stream)
    torch = types.SimpleNamespace(
        cuda=cuda, float32="float32", device=lambda kind, index: (kind, index),
        empty=lambda shape, dtype, device: Tensor(shape, state["stream"].cuda_stream))
    return torch, calls, state


def test_device_switch_switches_to_device_0_from_another(monkeypatch):
    torch, calls, state = fake_torch(current_device=1)
    monkeypatch.setitem(sys.modules, "torch", torch)
    switch = _arrays.device_switch("torch", 0)
    restore = switch()
    assert state["device"] == 0
    restore()
    assert calls == [("set_device", 0), ("set_device", 1)] and state["device"] == 1


def test_device_switch_leaves_the_current_device_alone(monkeypatch):
    torch, calls, _ = fake_torch(current_device=2)
    monkeypatch.setitem(sys.modules, "torch", torch)
    _arrays.device_switch("torch", 2)()()
    assert calls == []


def test_without_torch_or_cupy_the_library_switches_itself(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert _arrays.device_switch("jaxlib", 1) is None
    assert _arrays.device_switch("torch", None) is None


def test_torch_outputs_are_allocated_on_the_call_stream_and_recorded_on_the_current(monkeypatch):
    torch, calls, state = fake_torch(current_stream=0x10)
    monkeypatch.setitem(sys.modules, "torch", torch)
    allocate, lib = _arrays.allocator_for("torch")
    out = allocate((2, 3), 0, 0x55)
    assert lib == "torch" and out.allocated_on == 0x55 and calls == [("record_stream", 0x10)]
    assert state["stream"].cuda_stream == 0x10  # torch's current stream is left as it was
    calls.clear()
    same = allocate((2, 3), 0, 0x10)
    assert same.allocated_on == 0x10 and calls == []


def test_torch_outputs_for_the_default_stream_from_a_side_stream(monkeypatch):
    torch, calls, state = fake_torch(current_stream=0x10)
    monkeypatch.setitem(sys.modules, "torch", torch)
    out = _arrays.allocator_for("torch")[0]((4,), 0, 0)
    assert out.allocated_on == 0 and calls == [("record_stream", 0x10)] and state["stream"].cuda_stream == 0x10


def test_torch_default_stream_spellings_are_one_stream(monkeypatch):
    torch, calls, _ = fake_torch(current_stream=0)
    monkeypatch.setitem(sys.modules, "torch", torch)
    out = _arrays.allocator_for("torch")[0]((4,), 0, 1)  # 1: cudaStreamLegacy, torch's default
    assert out.allocated_on == 0 and calls == []


def test_cupy_outputs_are_allocated_under_the_call_stream(monkeypatch):
    state = dict(stream=types.SimpleNamespace(ptr=0x20))

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            self.before, state["stream"] = state["stream"], self

        def __exit__(self, *exc):
            state["stream"] = self.before

    @contextmanager
    def device(i):
        yield

    cupy = types.SimpleNamespace(
        float32="float32",
        empty=lambda shape, dtype: types.SimpleNamespace(shape=shape, allocated_on=state["stream"].ptr),
        cuda=types.SimpleNamespace(Device=device, ExternalStream=Stream, Stream=types.SimpleNamespace(null=Stream(0)),
                                   get_current_stream=lambda: state["stream"]))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    allocate, _ = _arrays.allocator_for("cupy")
    assert allocate((3,), 0, 0x77).allocated_on == 0x77
    assert allocate((3,), 0, 0).allocated_on == 0
    assert allocate((3,), 0, 0x20).allocated_on == 0x20 and state["stream"].ptr == 0x20


# ---- the architectures build

def cuda12_tools():
    """(libnvrtc, ptxas) of CUDA 12, or None: $PYFA_CUDA12 (a folder holding the
    nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 packages' nvidia/ tree), else this
    Python's site-packages."""
    roots = [Path(os.environ["PYFA_CUDA12"])] if os.environ.get("PYFA_CUDA12") else []
    roots += [Path(p) for p in sys.path if p.endswith("site-packages")]
    for root in roots:
        nvrtc = sorted(root.glob("nvidia/cuda_nvrtc/lib/libnvrtc.so.12*"))
        ptxas = root / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
        if nvrtc and ptxas.is_file():
            return str(nvrtc[0]), str(ptxas)
    return None


# NVRTC compiles device code only, without the C++ library's headers: these stand in for
# the few the kernels include (what device code uses of them).
SHIMS = {
    "cstdint": "typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t;\n"
               "typedef unsigned long long uint64_t; typedef unsigned long long uintptr_t;\n"
               "typedef unsigned char uint8_t;\n"
               "namespace std { using ::int32_t; using ::uint32_t; using ::int64_t; using ::uint64_t;\n"
               "using ::uintptr_t; using ::uint8_t; }\n#define INT32_MAX 2147483647\n#define INT64_MAX 9223372036854775807LL\n",
    "cstddef": "namespace std { using ::size_t; using ::ptrdiff_t; }\n",
    "cmath": "#define INFINITY __int_as_float(0x7f800000)\n#define NAN __int_as_float(0x7fffffff)\n",
    "pyfa_export.h": "#define PYFA_API\n",
}
SHIMS.update({"stdint.h": SHIMS["cstdint"], "stddef.h": "", "cstring": "", "cuda_runtime.h": "", "climits": "",
              "cfloat": "", "algorithm": "", "type_traits": "", "utility": "", "limits": ""})


@pytest.mark.slow
@pytest.mark.parametrize("cc", ["70", "60"])
def test_volta_and_pascal_kernels_build_with_cuda_12(cc, tmp_path):
    # nvcc 13 builds sm_75 and later only (CMakeLists.txt's default list starts at 75).
    # Below sm_80 the kernels take async_copy.h's synchronous path, so Volta and Pascal
    # build the code Turing runs: every kernel, compiled by CUDA 12's NVRTC and ptxas.
    # The host code around them does not depend on the architecture.
    tools = cuda12_tools()
    if tools is None:
        pytest.skip("CUDA 12's NVRTC and ptxas not found: pip install nvidia-cuda-nvrtc-cu12 "
                    "nvidia-cuda-nvcc-cu12 (into this Python, or a folder named by $PYFA_CUDA12)")
    import ctypes
    for name, body in SHIMS.items():
        (tmp_path / name).write_text("#pragma once\n" + body)
    nvrtc = ctypes.CDLL(tools[0])
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), b'#include "kernels/registry.cuh"\n', b"kernels.cu",
                                    0, None, None) == 0
    opts = [f"--gpu-architecture=compute_{cc}", "-std=c++17", f"-I{ROOT / 'src'}", f"-I{ROOT / 'src' / 'include'}",
            f"-I{tmp_path}", "-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
            # NVRTC has no host side: the headers' host declarations (pyfa.h, the kernel
            # registry's function table) are taken as device ones instead of refused.
            "-default-device"]
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts)))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log_ = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log_)
    assert status == 0, log_.value.decode()[-3000:]
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    (tmp_path / "kernels.ptx").write_bytes(ptx.value)
    entries = ptx.value.decode().count(".entry ")
    assert entries == len(gpu_limits.table_rows())  # every kernel of the table
    run = subprocess.run([tools[1], f"--gpu-name=sm_{cc}", str(tmp_path / "kernels.ptx"), "-o",
                          str(tmp_path / "kernels.cubin")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "kernels.cubin").stat().st_size > 0
