// fake_cuda.cpp: a stand-in for cuda_backend.cu, for tests/test_abi_safety.py. Linked with
// the C ABI's own sources (src/core/*.cpp, src/backends/cuda/cuda_adapter.cpp) into a test library, it lets
// the CUDA paths of run_op run without a GPU: "device memory" is host memory, a launch
// fills the tensors its kernel writes with a value of its own, and every call is logged,
// so a test sees which stream each step used, when outputs were copied, and what a
// failed or cancelled call left behind.
//
// Test controls (extern "C", below): fake_cuda_reset(fail_check, fail_launch) makes
// cuda_check_launch fail for kernel id `fail_check` and the `fail_launch`-th launch
// (0-based) fail (-1: none); fake_cuda_log() returns the log, one event per line;
// fake_cuda_live() the buffers allocated and not yet freed; fake_cuda_strides(q, o) the
// (batch, head, row) strides of Q and O at the last launch.
//
// Devices (reset by fake_cuda_reset to one sm_90 device whose kernel image loads, built for
// "75 80 90 100 120", every pointer its device memory): fake_cuda_set_device(built, major,
// minor, image_loads) the facts that src/backends/cuda/device_rules.h decides
// availability from; fake_cuda_place(ptr, kind, device) where a pointer lives (kind 0
// host, 1 device, 2 managed); fake_cuda_set_current(device) the calling thread's current
// device, fake_cuda_current() it; fake_cuda_set_stream_device(device) what
// cudaStreamGetDevice says of a caller's stream (-1: cannot be asked);
// fake_cuda_set_profile(device, smem_per_block, max_threads_per_block) a device's
// profile; fake_cuda_last_launch(out[4]) the device, block_r and block_c of the last
// launch and the number of launches; fake_cuda_checks(out[8][6]) what cuda_check_launch
// saw since the last reset or the last fake_cuda_checks (row, threads, dynamic shared
// memory, grid x, y, z), returning how many. A cpu_run is logged ("cpu run") and refused.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backends/cuda/cuda_functions.h"
#include "common/score.h"
#include "backends/cuda/device_rules.h"

namespace {

constexpr int kFakeDevices = 4;
struct FakeDevice {
    int64_t smem_per_block;
    int max_threads_per_block;
};
FakeDevice g_device_profile[kFakeDevices];
std::string g_built;
int g_major, g_minor, g_image_loads, g_current, g_stream_device, g_launch_device, g_launch_br, g_launch_bc;
char g_reason[512];

struct Placed {
    const void* ptr;
    pyfa::MemoryKind kind;
    int device;
};
Placed g_placed[32];
int g_n_placed;

// What cuda_check_launch saw, per kernel of the last call: row id, threads, dynamic
// shared memory, grid x, y, z.
constexpr int kMaxChecks = 8;
int64_t g_checks[kMaxChecks][6];
int g_n_checks;

void reset_devices() {
    for (FakeDevice& d : g_device_profile) d = FakeDevice{227 * 1024, 1024};
    g_built = "75 80 90 100 120";
    g_major = 9;
    g_minor = 0;
    g_image_loads = 1;
    g_current = 0;
    g_stream_device = -1;
    g_n_placed = 0;
    g_n_checks = 0;
    g_launch_device = g_launch_br = g_launch_bc = -1;
}
const bool g_devices_set = (reset_devices(), true);

std::string g_log;
int g_fail_check = -1, g_fail_launch = -1, g_launches = 0, g_live = 0;
int64_t g_q_strides[3], g_o_strides[3];
int g_library_stream_object;
void* const kLibraryStream = &g_library_stream_object;

const char* stream_name(void* stream) {
    if (stream == kLibraryStream) return "library";
    return stream ? "caller" : "null";
}

void log_event(const char* format, const char* a, const char* b = "") {
    char line[160];
    std::snprintf(line, sizeof(line), format, a, b);
    g_log += line;
    g_log += '\n';
}

void fill(float* p, int64_t n, float value) {
    for (int64_t i = 0; i < n; ++i) p[i] = value;
}

}  // namespace

namespace pyfa {

bool cuda_compiled() { return true; }
// Asked afresh each time (the real backend decides once), so that a test can change the
// facts between calls.
bool cuda_available() {
    const DeviceFacts f{0, "fake GPU", g_major, g_minor, g_image_loads != 0,
                        g_image_loads ? "" : "cudaErrorNoKernelImageForDevice"};
    return device_usable(f, g_built.c_str(), g_reason, sizeof(g_reason));
}
const char* cuda_unavailable_reason() {
    cuda_available();
    return g_reason;
}

pyfa_status cuda_profile(pyfa_device_profile* profile) {
    std::memset(profile, 0, sizeof(*profile));
    std::snprintf(profile->name, sizeof(profile->name), "fake GPU %d", g_current);
    profile->smem_per_block = g_device_profile[g_current].smem_per_block;
    profile->max_threads_per_block = g_device_profile[g_current].max_threads_per_block;
    profile->sm_count = 132;
    return PYFA_OK;
}

pyfa_status cuda_enter_device(const char* const* names, const void* const* pointers, int count, void*,
                              DeviceScope* scope) {
    PointerFacts facts[16];
    for (int t = 0; t < count && t < 16; ++t) {
        facts[t] = PointerFacts{names[t], MemoryKind::kDevice, 0};
        for (int n = 0; n < g_n_placed; ++n)
            if (g_placed[n].ptr == pointers[t]) {
                facts[t].kind = g_placed[n].kind;
                facts[t].device = g_placed[n].device;
            }
    }
    int device = 0;
    char why[256];
    if (!owning_device(facts, count, g_stream_device, &device, why, sizeof(why)))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s", why);
    if (device != g_current) {
        char line[32];
        std::snprintf(line, sizeof(line), "device %d", device);
        log_event("%s%s", line);
        scope->restore = cuda_restore_device;
        scope->previous = g_current;
        g_current = device;
    }
    return PYFA_OK;
}

void cuda_restore_device(int previous) {
    if (previous < 0) return;
    char line[32];
    std::snprintf(line, sizeof(line), "device %d", previous);
    log_event("%s%s", line);
    g_current = previous;
}

pyfa_status cuda_library_stream(void** stream) {
    *stream = kLibraryStream;
    return PYFA_OK;
}

pyfa_status cuda_check_launch(int kernel, const LaunchShape& shape) {
    log_event("check %s", kernel_name(kernel));
    if (g_n_checks < kMaxChecks) {
        int64_t* c = g_checks[g_n_checks++];
        c[0] = kernel;
        c[1] = shape.threads;
        c[2] = shape.smem_bytes;
        for (int a = 0; a < 3; ++a) c[3 + a] = shape.grid[a];
    }
    if (kernel == g_fail_check) return fail(PYFA_ERROR_TILE_TOO_LARGE, "fake: %s refused", kernel_name(kernel));
    return PYFA_OK;
}

pyfa_status cuda_malloc(void** ptr, size_t bytes, void* stream) {
    *ptr = std::malloc(bytes ? bytes : 1);
    if (!*ptr) return fail(PYFA_ERROR_OUT_OF_MEMORY, "fake: out of memory");
    ++g_live;
    log_event("malloc %s", stream_name(stream));
    return PYFA_OK;
}

pyfa_status cuda_free(void* ptr, void* stream) {
    if (!ptr) return PYFA_OK;
    std::free(ptr);
    --g_live;
    log_event("free %s", stream_name(stream));
    return PYFA_OK;
}

pyfa_status cuda_copy_to_device(void* dst, const void* src, size_t bytes, void* stream) {
    std::memcpy(dst, src, bytes);
    log_event("h2d %s", stream_name(stream));
    return PYFA_OK;
}

pyfa_status cuda_copy_to_host(void* dst, const void* src, size_t bytes, void* stream) {
    std::memcpy(dst, src, bytes);
    log_event("d2h %s", stream_name(stream));
    return PYFA_OK;
}

pyfa_status cuda_launch(int kernel, const AttentionParams& p, const LaunchShape&, void* stream) {
    if (g_launches++ == g_fail_launch) {
        log_event("launch-refused %s %s", kernel_name(kernel), stream_name(stream));
        return fail(PYFA_ERROR_CUDA, "fake: launch of %s refused", kernel_name(kernel));
    }
    log_event("launch %s %s", kernel_name(kernel), stream_name(stream));
    g_launch_device = g_current;
    g_launch_br = static_cast<int>(p.block_r);
    g_launch_bc = static_cast<int>(p.block_c);
    const TensorStrides* seen[] = {&p.q_strides, &p.o_strides};
    int64_t* kept[] = {g_q_strides, g_o_strides};
    for (int t = 0; t < 2; ++t) {
        kept[t][0] = seen[t]->batch;
        kept[t][1] = seen[t]->head;
        kept[t][2] = seen[t]->row;
    }
    const int64_t bh = p.batch * p.heads;
    const int64_t q_elems = bh * p.seqlen_q * p.head_dim;
    const int64_t k_elems = p.batch * p.heads_kv * p.seqlen_k * p.head_dim;  // dK, dV have Hkv heads
    const int64_t rows = bh * p.seqlen_q;
    switch (kernel) {
        case PYFA_KERNEL_FA2_FORWARD: fill(p.o, q_elems, 1.0f); fill(p.lse, rows, 2.0f); break;
        case PYFA_KERNEL_FA1_FORWARD:
            fill(p.o, q_elems, 1.0f);
            fill(p.m, rows, 3.0f);
            fill(p.l, rows, 4.0f);
            break;
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS: fill(p.drow, rows, 5.0f); break;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: fill(p.dk, k_elems, 6.0f); fill(p.dv, k_elems, 7.0f); break;
        case PYFA_KERNEL_FA2_BACKWARD_DQ: fill(p.dq, q_elems, 8.0f); break;
        case PYFA_KERNEL_FA1_BACKWARD:
            fill(p.dq, q_elems, 8.0f);
            fill(p.dk, k_elems, 6.0f);
            fill(p.dv, k_elems, 7.0f);
            break;
    }
    return PYFA_OK;
}

pyfa_status cuda_synchronize(void* stream) {
    log_event("sync %s", stream_name(stream));
    return PYFA_OK;
}

// dBias's fold (issue 27) runs on host memory here, as the host backends run it.
pyfa_status cuda_fold_dbias(const DbiasFold& fold, void* stream) {
    for (int64_t e = 0; e < fold.elems(); ++e) fold.out[e] = dbias_fold_at(fold, e);
    log_event("fold %s", stream_name(stream));
    return PYFA_OK;
}

// A stand-in for the cpu backend (the real one is not part of this test library), so
// that a host call AUTO resolves away from CUDA shows up in the log and is refused.
class FakeCpuBackend final : public Backend {
public:
    int id() const override { return PYFA_BACKEND_CPU; }
    const char* label() const override { return "the fake cpu backend"; }
    int auto_rank() const override { return 2; }
    pyfa_status profile(pyfa_device_profile* profile) const override {
        emulated_h200_profile("fake cpu", profile);
        return PYFA_OK;
    }
    bool runs_table_kernels() const override { return false; }
    bool dense_only() const override { return true; }
    bool runs_whole_op() const override { return true; }
    pyfa_status run_op(int, const AttentionParams*, size_t, const pyfa_config&) const override {
        log_event("cpu run%s%s", "");
        return fail(PYFA_ERROR_INTERNAL, "fake: no cpu backend in this test library");
    }
};

PYFA_REGISTER_BACKEND(FakeCpuBackend)

}  // namespace pyfa

extern "C" {

__attribute__((visibility("default"))) void fake_cuda_reset(int fail_check, int fail_launch) {
    g_log.clear();
    g_fail_check = fail_check;
    g_fail_launch = fail_launch;
    g_launches = 0;
    reset_devices();
}

__attribute__((visibility("default"))) void fake_cuda_set_device(const char* built, int major, int minor,
                                                                 int image_loads) {
    g_built = built;
    g_major = major;
    g_minor = minor;
    g_image_loads = image_loads;
}

__attribute__((visibility("default"))) void fake_cuda_place(const void* ptr, int kind, int device) {
    if (g_n_placed < 32)
        g_placed[g_n_placed++] = Placed{ptr, kind == 0 ? pyfa::MemoryKind::kHost
                                             : kind == 1 ? pyfa::MemoryKind::kDevice
                                                         : pyfa::MemoryKind::kManaged, device};
}

__attribute__((visibility("default"))) void fake_cuda_set_current(int device) { g_current = device; }

__attribute__((visibility("default"))) int fake_cuda_current(void) { return g_current; }

__attribute__((visibility("default"))) void fake_cuda_set_stream_device(int device) { g_stream_device = device; }

__attribute__((visibility("default"))) void fake_cuda_set_profile(int device, int64_t smem_per_block,
                                                                  int max_threads_per_block) {
    g_device_profile[device] = FakeDevice{smem_per_block, max_threads_per_block};
}

__attribute__((visibility("default"))) int fake_cuda_checks(int64_t* out) {
    std::memcpy(out, g_checks, sizeof g_checks);
    const int n = g_n_checks;
    g_n_checks = 0;
    return n;
}

__attribute__((visibility("default"))) void fake_cuda_last_launch(int* out) {
    out[0] = g_launch_device;
    out[1] = g_launch_br;
    out[2] = g_launch_bc;
    out[3] = g_launches;
}

__attribute__((visibility("default"))) const char* fake_cuda_log(void) { return g_log.c_str(); }

__attribute__((visibility("default"))) int fake_cuda_live(void) { return g_live; }

__attribute__((visibility("default"))) void fake_cuda_strides(int64_t* q, int64_t* o) {
    std::memcpy(q, g_q_strides, sizeof g_q_strides);
    std::memcpy(o, g_o_strides, sizeof g_o_strides);
}

}  // extern "C"
