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
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backends/cuda/cuda_functions.h"

namespace {

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
bool cuda_available() { return true; }
const char* cuda_unavailable_reason() { return ""; }

pyfa_status cuda_profile(pyfa_device_profile* profile) {
    std::memset(profile, 0, sizeof(*profile));
    std::strncpy(profile->name, "fake GPU", sizeof(profile->name) - 1);
    profile->smem_per_block = 227 * 1024;
    profile->max_threads_per_block = 1024;
    profile->sm_count = 132;
    return PYFA_OK;
}

pyfa_status cuda_library_stream(void** stream) {
    *stream = kLibraryStream;
    return PYFA_OK;
}

pyfa_status cuda_check_launch(int kernel, const LaunchShape&) {
    log_event("check %s", kernel_name(kernel));
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

}  // namespace pyfa

extern "C" {

__attribute__((visibility("default"))) void fake_cuda_reset(int fail_check, int fail_launch) {
    g_log.clear();
    g_fail_check = fail_check;
    g_fail_launch = fail_launch;
    g_launches = 0;
}

__attribute__((visibility("default"))) const char* fake_cuda_log(void) { return g_log.c_str(); }

__attribute__((visibility("default"))) int fake_cuda_live(void) { return g_live; }

__attribute__((visibility("default"))) void fake_cuda_strides(int64_t* q, int64_t* o) {
    std::memcpy(q, g_q_strides, sizeof g_q_strides);
    std::memcpy(o, g_o_strides, sizeof g_o_strides);
}

}  // extern "C"
