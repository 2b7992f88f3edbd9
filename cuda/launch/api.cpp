// api.cpp: the C ABI of include/pyfa.h.
//
// Every public operation (FA2 forward, ...) is described once as an Op: the tensors it
// reads and writes, its scratch tensors and its kernels in launch order. run_op checks
// the arguments (naming the bad one), resolves the backend and the tiles, checks every
// kernel's launch before the first one runs, and runs the kernels. Outputs go to
// library-owned buffers first wherever the library can stage them (every host entry
// point, and the host-memory backends behind a *_device entry point) and are copied to
// the caller only once every kernel has succeeded, so a failure never leaves the
// caller's memory half written.
//
// No C++ exception may cross the C ABI (it would terminate the caller's process), and
// reporting a failure must work when allocation does not: every extern "C" function runs
// its body under guarded(), and no failure path allocates.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>

#include "common/smem.h"
#include "common/tiling.h"
#include "launch/internal.h"

namespace pyfa {

namespace {

enum TensorId { T_NONE, T_Q, T_K, T_V, T_O, T_LSE, T_M, T_L, T_DO, T_DQ, T_DK, T_DV, T_D };

struct TensorSlot {
    const char* name;  // the argument's name, as in pyfa.h
    bool key_rows;     // rows are Nk (K, V, dK, dV) rather than Nq
    bool per_row;      // one value per row (LSE, m, l, D) rather than d
};

const TensorSlot kTensors[] = {
    {"", false, false},    {"q", false, false},  {"k", true, false},  {"v", true, false},
    {"o", false, false},   {"lse", false, true}, {"m", false, true},  {"l", false, true},
    {"do", false, false},  {"dq", false, false}, {"dk", true, false}, {"dv", true, false},
    {"D", false, true},
};

// Elements of tensor t; exact, or -1 when B * H * rows * cols does not fit in int64_t.
int64_t tensor_elems(TensorId t, const pyfa_problem& pr) {
    const TensorSlot& s = kTensors[t];
    int64_t n = checked_mul(pr.batch, pr.heads);
    n = checked_mul(n, s.key_rows ? pr.seqlen_k : pr.seqlen_q);
    return s.per_row ? n : checked_mul(n, pr.head_dim);
}

// Bytes of tensor t; check_problem has made sure they fit.
size_t tensor_bytes(TensorId t, const pyfa_problem& pr) {
    return sizeof(float) * static_cast<size_t>(tensor_elems(t, pr));
}

float*& param_slot(AttentionParams& p, TensorId t) {
    switch (t) {
        case T_Q: return const_cast<float*&>(p.q);
        case T_K: return const_cast<float*&>(p.k);
        case T_V: return const_cast<float*&>(p.v);
        case T_O: return p.o;
        case T_LSE: return p.lse;
        case T_M: return p.m;
        case T_L: return p.l;
        case T_DO: return const_cast<float*&>(p.dout);
        case T_DQ: return p.dq;
        case T_DK: return p.dk;
        case T_DV: return p.dv;
        case T_D: return p.drow;
        case T_NONE: break;
    }
    return p.o;
}

// Fixed-size lists, ended by T_NONE (the zero the aggregate fills in), so that the
// operation table needs no allocation, not even when the library is loaded.
constexpr int kMaxInputs = 8, kMaxOutputs = 4, kMaxScratch = 2, kMaxKernels = 4;
constexpr int kMaxOwned = kMaxInputs + kMaxOutputs + kMaxScratch;

template <int N>
int count(const TensorId (&list)[N]) {
    int n = 0;
    while (n < N && list[n] != T_NONE) ++n;
    return n;
}

struct Op {
    const char* name;
    TensorId inputs[kMaxInputs];
    TensorId outputs[kMaxOutputs];
    TensorId scratch[kMaxScratch];
    int kernel_count;
    int kernels[kMaxKernels];  // in launch order
};

const Op kFa2Forward = {"pyfa_fa2_forward", {T_Q, T_K, T_V}, {T_O, T_LSE}, {}, 1, {PYFA_KERNEL_FA2_FORWARD}};
const Op kFa1Forward = {"pyfa_fa1_forward", {T_Q, T_K, T_V}, {T_O, T_M, T_L}, {}, 1, {PYFA_KERNEL_FA1_FORWARD}};
const Op kFa1Backward = {"pyfa_fa1_backward", {T_Q, T_K, T_V, T_O, T_M, T_L, T_DO}, {T_DQ, T_DK, T_DV}, {}, 1,
                         {PYFA_KERNEL_FA1_BACKWARD}};
const Op kFa2Backward = {"pyfa_fa2_backward", {T_Q, T_K, T_V, T_O, T_LSE, T_DO}, {T_DQ, T_DK, T_DV}, {T_D}, 3,
                         {PYFA_KERNEL_FA2_BACKWARD_PREPROCESS, PYFA_KERNEL_FA2_BACKWARD_DKDV,
                          PYFA_KERNEL_FA2_BACKWARD_DQ}};

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridYZ = 65535;
// The kernels index every tensor in int64_t and the library sizes it in bytes, so a
// tensor's byte count must fit in int64_t (and so in size_t).
constexpr int64_t kMaxTensorElems = INT64_MAX / static_cast<int64_t>(sizeof(float));

pyfa_status check_problem(const pyfa_problem* pr) {
    if (!pr) return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: null pointer");
    const struct { const char* name; int64_t value; } dims[] = {
        {"problem->batch", pr->batch},       {"problem->heads", pr->heads},
        {"problem->seqlen_q", pr->seqlen_q}, {"problem->seqlen_k", pr->seqlen_k},
        {"problem->head_dim", pr->head_dim}};
    for (const auto& dim : dims)
        if (dim.value < 1)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: must be >= 1, got %lld", dim.name,
                        static_cast<long long>(dim.value));
    if (pr->head_dim > kMaxHeadDim)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->head_dim: must be in [1, 256], got %lld",
                    static_cast<long long>(pr->head_dim));
    if (pr->batch > kMaxGridYZ || pr->heads > kMaxGridYZ) {
        const bool b = pr->batch > kMaxGridYZ;
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: at most 65535 (a grid dimension), got %lld",
                    b ? "problem->batch" : "problem->heads", static_cast<long long>(b ? pr->batch : pr->heads));
    }
    // Exact: q and o (rows Nq), k and v (rows Nk) are the largest tensors.
    const struct { TensorId t; const char* shape; } big[] = {{T_Q, "B*H*Nq*d"}, {T_K, "B*H*Nk*d"}};
    for (const auto& x : big) {
        const int64_t n = tensor_elems(x.t, *pr);
        if (n < 0 || n > kMaxTensorElems)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "problem: %s elements (of %s) exceed 2^61 - 1, the most a tensor may hold", x.shape,
                        kTensors[x.t].name);
    }
    if (!std::isfinite(pr->scale))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->scale: must be finite (0 means 1/sqrt(d))");
    return PYFA_OK;
}

// The backend a call runs on; `arg` names the argument in messages. On a *_device entry
// point AUTO means CUDA or an error, never a host-memory backend: the pointers are the GPU's.
pyfa_status resolve_backend(int asked, bool device_pointers, const char* arg, int* backend) {
    switch (asked) {
        case PYFA_BACKEND_AUTO:
            if (cuda_available()) {
                *backend = PYFA_BACKEND_CUDA;
                return PYFA_OK;
            }
            if (device_pointers)
                return fail(PYFA_ERROR_BACKEND_UNAVAILABLE,
                            "%s: AUTO on a *_device entry point needs CUDA (device pointers), but CUDA "
                            "is unavailable: %s",
                            arg, cuda_unavailable_reason());
            *backend = PYFA_BACKEND_EMU;
            return PYFA_OK;
        case PYFA_BACKEND_EMU: *backend = PYFA_BACKEND_EMU; return PYFA_OK;
        case PYFA_BACKEND_CUDA:
            if (!cuda_available())
                return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "%s: CUDA asked for, but %s", arg,
                            cuda_unavailable_reason());
            *backend = PYFA_BACKEND_CUDA;
            return PYFA_OK;
        case PYFA_BACKEND_CPU:
            return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "%s: the cpu backend is not part of this libpyfa yet",
                        arg);
    }
    return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: unknown backend %d", arg, asked);
}

// Backends that run on host memory (the emulator; the cpu backend to come) read the
// inputs in place and have their outputs staged by run_op.
bool host_memory(int backend) { return backend != PYFA_BACKEND_CUDA; }

pyfa_status profile_of(int backend, pyfa_device_profile* profile) {
    switch (backend) {
        case PYFA_BACKEND_CUDA: return cuda_profile(profile);
        case PYFA_BACKEND_EMU: return emu_profile(profile);
    }
    return fail(PYFA_ERROR_INTERNAL, "no device profile for backend %d", backend);
}

pyfa_status launch_kernel(int backend, int kernel, const AttentionParams& p, const LaunchShape& shape,
                          const pyfa_config& cfg, void* stream) {
    switch (backend) {
        case PYFA_BACKEND_CUDA: return cuda_launch(kernel, p, shape, stream);
        case PYFA_BACKEND_EMU: return emu_launch(kernel, p, shape, cfg);
    }
    return fail(PYFA_ERROR_INTERNAL, "no launcher for backend %d", backend);
}

// Tiles for one kernel: the caller's, else the default; checked against the device.
pyfa_status kernel_tiles(int kernel, const pyfa_config& cfg, int64_t d,
                         const pyfa_device_profile& profile, int* Br, int* Bc) {
    if (cfg.block_r < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->block_r: must be >= 1 (0 for the default), got %d",
                    cfg.block_r);
    if (cfg.block_c < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->block_c: must be >= 1 (0 for the default), got %d",
                    cfg.block_c);
    int r = 0, c = 0;
    if (cfg.block_r == 0 || cfg.block_c == 0) {
        const pyfa_status st = default_tiles(kernel, d, profile, &r, &c);
        if (st != PYFA_OK) return st;
    }
    r = cfg.block_r ? cfg.block_r : r;
    c = cfg.block_c ? cfg.block_c : c;
    if (!smem_fits(kernel, r, c, d, profile.smem_per_block)) {
        char terms[512];
        smem_breakdown(kernel, r, c, d, terms, sizeof(terms));
        const int64_t need = smem_bytes(kernel, r, c, d);
        char need_text[48];
        if (need >= 0)
            std::snprintf(need_text, sizeof(need_text), "%lld", static_cast<long long>(need));
        else
            std::snprintf(need_text, sizeof(need_text), "more than 2^63 - 1");
        return fail(PYFA_ERROR_TILE_TOO_LARGE,
                    "%s: block_r=%d, block_c=%d at head_dim=%lld need %s bytes of shared memory (%s), "
                    "but %s allows %lld per block",
                    kernel_name(kernel), r, c, static_cast<long long>(d), need_text, terms, profile.name,
                    static_cast<long long>(profile.smem_per_block));
    }
    *Br = r;
    *Bc = c;
    return PYFA_OK;
}

// Buffers owned by one call; freed on every path out.
struct Scratch {
    int backend = PYFA_BACKEND_EMU;
    void* stream = nullptr;
    void* owned[kMaxOwned] = {};
    int count = 0;
    pyfa_status alloc(size_t bytes, float** out) {
        if (count == kMaxOwned) return fail(PYFA_ERROR_INTERNAL, "more than %d buffers in one call", kMaxOwned);
        void* ptr = nullptr;
        if (backend == PYFA_BACKEND_CUDA) {
            const pyfa_status st = cuda_malloc(&ptr, bytes, stream);
            if (st != PYFA_OK) return st;
        } else {
            ptr = std::malloc(bytes ? bytes : 1);
            if (!ptr) return fail(PYFA_ERROR_OUT_OF_MEMORY, "out of host memory for %zu bytes", bytes);
        }
        owned[count++] = ptr;
        *out = static_cast<float*>(ptr);
        return PYFA_OK;
    }
    // Frees every buffer; the first failure (CUDA only) is the status.
    pyfa_status release() {
        pyfa_status first = PYFA_OK;
        for (int n = 0; n < count; ++n) {
            if (backend == PYFA_BACKEND_CUDA) {
                const pyfa_status st = cuda_free(owned[n], stream);
                if (first == PYFA_OK) first = st;
            } else {
                std::free(owned[n]);
            }
        }
        count = 0;
        return first;
    }
    // Only a failed call leaves buffers here; its message stays the one reported.
    ~Scratch() {
        if (count == 0) return;
        char kept[kMaxErrorLength];
        std::snprintf(kept, sizeof(kept), "%s", pyfa_last_error());
        release();
        fail(PYFA_OK, "%s", kept);
    }
};

// config->progress for the CUDA backend, in kernels: a nonzero return cancels the call.
pyfa_status poll_progress(const pyfa_config& cfg, int64_t done, int64_t total) {
    if (cfg.progress && cfg.progress(cfg.progress_user, done, total) != 0)
        return fail(PYFA_ERROR_CANCELLED, "cancelled by config->progress after %lld of %lld kernels",
                    static_cast<long long>(done), static_cast<long long>(total));
    return PYFA_OK;
}

pyfa_status run_op_unguarded(const Op& op, const pyfa_problem* problem, const pyfa_config* config,
                             const float* const* inputs, float* const* outputs,
                             bool device_pointers, void* stream) {
    pyfa_status st = check_problem(problem);
    if (st != PYFA_OK) return st;
    const pyfa_config cfg = config ? *config : pyfa_config{};
    const int n_in = count(op.inputs), n_out = count(op.outputs), n_scratch = count(op.scratch);
    for (int t = 0; t < n_in; ++t)
        if (!inputs[t]) return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: null pointer", kTensors[op.inputs[t]].name);
    for (int t = 0; t < n_out; ++t)
        if (!outputs[t]) return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: null pointer", kTensors[op.outputs[t]].name);
    if (cfg.emu_order < PYFA_EMU_ORDER_FORWARD || cfg.emu_order > PYFA_EMU_ORDER_SHUFFLED)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->emu_order: unknown order %d", cfg.emu_order);
    if (cfg.emu_workers < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->emu_workers: must be >= 0, got %d", cfg.emu_workers);
    if (cfg.threads < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->threads: must be >= 0, got %d", cfg.threads);

    int backend = PYFA_BACKEND_EMU;
    if ((st = resolve_backend(cfg.backend, device_pointers, "config->backend", &backend)) != PYFA_OK) return st;
    pyfa_device_profile profile;
    if ((st = profile_of(backend, &profile)) != PYFA_OK) return st;

    AttentionParams base{};
    base.batch = problem->batch;
    base.heads = problem->heads;
    base.seqlen_q = problem->seqlen_q;
    base.seqlen_k = problem->seqlen_k;
    base.head_dim = problem->head_dim;
    base.scale = problem->scale != 0.0f ? problem->scale : 1.0f / std::sqrt(static_cast<float>(problem->head_dim));
    base.causal = problem->causal != 0;

    // Every kernel's tiles and launch are checked before anything is allocated or
    // launched, so that a configuration error never follows a kernel that has written.
    int tiles[kMaxKernels][2];
    int ids[kMaxKernels];  // kernel table rows (kernels/table.h): the variant that runs
    LaunchShape shapes[kMaxKernels];
    bool aligned = true;  // what the fast kernels' 128-bit accesses need
    for (int t = 0; t < n_in; ++t) aligned = aligned && reinterpret_cast<uintptr_t>(inputs[t]) % 16 == 0;
    for (int t = 0; t < n_out; ++t) aligned = aligned && reinterpret_cast<uintptr_t>(outputs[t]) % 16 == 0;
    for (int n = 0; n < op.kernel_count; ++n) {
        const int kernel = op.kernels[n];
        AttentionParams p = base;
        int id = kernel;
        if ((st = select_kernel(kernel, cfg.variant, p, cfg.block_r, cfg.block_c, aligned, profile, &id, &p.block_r,
                                &p.block_c)) != PYFA_OK)
            return st;
        if (id == kernel && (st = kernel_tiles(kernel, cfg, p.head_dim, profile, &p.block_r, &p.block_c)) != PYFA_OK)
            return st;
        if (ceil_div(p.seqlen_q, p.block_r) > kMaxGridX || ceil_div(p.seqlen_k, p.block_c) > kMaxGridX)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: more than 2^31-1 tiles along a sequence");
        tiles[n][0] = p.block_r;
        tiles[n][1] = p.block_c;
        ids[n] = id;
        shapes[n] = launch_shape(id, p);
        if (backend == PYFA_BACKEND_CUDA && (st = cuda_check_launch(id, shapes[n])) != PYFA_OK) return st;
    }

    // Host entry points on CUDA work on the library's own stream.
    if (backend == PYFA_BACKEND_CUDA && !device_pointers && (st = cuda_library_stream(&stream)) != PYFA_OK)
        return st;

    // Bind tensors. Inputs: copied to the GPU for a host entry point on CUDA, else read in
    // place. Outputs: staged in owned buffers unless they are the GPU's own (a *_device
    // entry point on CUDA, where the stream orders everything).
    Scratch owned;
    owned.backend = backend;
    owned.stream = stream;
    AttentionParams bound = base;
    const bool stage_inputs = !device_pointers && backend == PYFA_BACKEND_CUDA;
    const bool stage_outputs = !device_pointers || host_memory(backend);
    for (int t = 0; t < n_in; ++t) {
        float*& slot = param_slot(bound, op.inputs[t]);
        slot = const_cast<float*>(inputs[t]);
        if (stage_inputs) {
            const size_t bytes = tensor_bytes(op.inputs[t], *problem);
            if ((st = owned.alloc(bytes, &slot)) != PYFA_OK) return st;
            if ((st = cuda_copy_to_device(slot, inputs[t], bytes, stream)) != PYFA_OK) return st;
        }
    }
    for (int t = 0; t < n_out; ++t) {
        float*& slot = param_slot(bound, op.outputs[t]);
        slot = outputs[t];
        if (stage_outputs && (st = owned.alloc(tensor_bytes(op.outputs[t], *problem), &slot)) != PYFA_OK)
            return st;
    }
    for (int t = 0; t < n_scratch; ++t)
        if ((st = owned.alloc(tensor_bytes(op.scratch[t], *problem), &param_slot(bound, op.scratch[t]))) != PYFA_OK)
            return st;

    // The CUDA backend asks config->progress before each launch. On the library's stream
    // (host entry points) it first waits for the kernels already launched, so that `done`
    // counts finished kernels and a cancel takes effect between them. Work enqueued on the
    // caller's stream cannot be taken back, so a *_device call asks once, before any launch.
    const bool cuda_polls = backend == PYFA_BACKEND_CUDA && cfg.progress;
    for (int n = 0; n < op.kernel_count; ++n) {
        if (cuda_polls && (n == 0 || !device_pointers)) {
            if (n > 0 && (st = cuda_synchronize(stream)) != PYFA_OK) return st;
            if ((st = poll_progress(cfg, n, op.kernel_count)) != PYFA_OK) return st;
        }
        AttentionParams p = bound;
        p.block_r = tiles[n][0];
        p.block_c = tiles[n][1];
        if ((st = launch_kernel(backend, ids[n], p, shapes[n], cfg, stream)) != PYFA_OK) return st;
    }

    if (!stage_outputs) return owned.release();
    if (backend == PYFA_BACKEND_CUDA) {
        if ((st = cuda_synchronize(stream)) != PYFA_OK) return st;
        if (cuda_polls && (st = poll_progress(cfg, op.kernel_count, op.kernel_count)) != PYFA_OK) return st;
    }
    for (int t = 0; t < n_out; ++t) {
        const size_t bytes = tensor_bytes(op.outputs[t], *problem);
        const float* src = param_slot(bound, op.outputs[t]);
        if (backend == PYFA_BACKEND_CUDA) {
            if ((st = cuda_copy_to_host(outputs[t], src, bytes, stream)) != PYFA_OK) return st;
        } else {
            std::memcpy(outputs[t], src, bytes);
        }
    }
    if (backend == PYFA_BACKEND_CUDA && (st = cuda_synchronize(stream)) != PYFA_OK) return st;
    return owned.release();
}

// Runs body() and turns anything it throws into a status; the handlers allocate nothing.
template <class Body>
pyfa_status guarded(const char* where, Body&& body) noexcept {
    try {
        return body();
    } catch (const std::bad_alloc&) {
        return fail(PYFA_ERROR_OUT_OF_MEMORY, "%s: out of host memory", where);
    } catch (const std::exception& e) {
        return fail(PYFA_ERROR_INTERNAL, "%s: %s", where, e.what());
    } catch (...) {
        return fail(PYFA_ERROR_INTERNAL, "%s: unknown exception", where);
    }
}

// The same for a function that returns a value: `failed` when body() throws.
template <class T, class Body>
T guarded_value(const char* where, T failed, Body&& body) noexcept {
    T result = failed;
    const pyfa_status st = guarded(where, [&] {
        result = body();
        return PYFA_OK;
    });
    return st == PYFA_OK ? result : failed;
}

pyfa_status run_op(const Op& op, const pyfa_problem* problem, const pyfa_config* config,
                   const float* const* inputs, float* const* outputs, bool device_pointers,
                   void* stream) noexcept {
    clear_error();
    return guarded(op.name, [&] {
        return run_op_unguarded(op, problem, config, inputs, outputs, device_pointers, stream);
    });
}

pyfa_status device_profile_get(int backend, pyfa_device_profile* profile) {
    if (!profile) return fail(PYFA_ERROR_INVALID_ARGUMENT, "profile: null pointer");
    int resolved = PYFA_BACKEND_EMU;
    const pyfa_status st = resolve_backend(backend, false, "backend", &resolved);
    if (st != PYFA_OK) return st;
    return profile_of(resolved, profile);
}

}  // namespace

}  // namespace pyfa

using namespace pyfa;

extern "C" {

PYFA_API const char* pyfa_version(void) { return PYFA_VERSION_STRING; }

PYFA_API int pyfa_abi_version(void) { return PYFA_ABI_VERSION; }

PYFA_API int pyfa_backend_available(int backend) {
    return guarded_value("pyfa_backend_available", 0, [&] {
        switch (backend) {
            case PYFA_BACKEND_EMU: return 1;
            case PYFA_BACKEND_CUDA: return cuda_available() ? 1 : 0;
            case PYFA_BACKEND_AUTO: return 1;
        }
        return 0;
    });
}

PYFA_API int pyfa_backend_compiled(int backend) {
    return guarded_value("pyfa_backend_compiled", 0, [&] {
        switch (backend) {
            case PYFA_BACKEND_EMU: return 1;
            case PYFA_BACKEND_CUDA: return cuda_compiled() ? 1 : 0;
        }
        return 0;
    });
}

PYFA_API const char* pyfa_backend_reason(int backend) {
    return guarded_value<const char*>("pyfa_backend_reason", "the reason could not be determined", [&] {
        switch (backend) {
            case PYFA_BACKEND_EMU:
            case PYFA_BACKEND_AUTO: return "";
            case PYFA_BACKEND_CUDA: return cuda_unavailable_reason();
            case PYFA_BACKEND_CPU: return "the cpu backend is not part of this libpyfa yet";
        }
        return "unknown backend";
    });
}

PYFA_API pyfa_status pyfa_device_profile_get(int backend, pyfa_device_profile* profile) {
    clear_error();
    return guarded("pyfa_device_profile_get", [&] { return device_profile_get(backend, profile); });
}

PYFA_API int64_t pyfa_smem_bytes(int kernel, int block_r, int block_c, int64_t head_dim) {
    return guarded_value<int64_t>("pyfa_smem_bytes", 0, [&] {
        const int64_t bytes = variant_smem_bytes(kernel, PYFA_VARIANT_REFERENCE, block_r, block_c, head_dim);
        return bytes > 0 ? bytes : 0;
    });
}

PYFA_API int64_t pyfa_variant_smem_bytes(int kernel, int variant, int block_r, int block_c, int64_t head_dim) {
    return guarded_value<int64_t>("pyfa_variant_smem_bytes", 0, [&] {
        const int64_t bytes = variant_smem_bytes(kernel, variant, block_r, block_c, head_dim);
        return bytes > 0 ? bytes : 0;
    });
}

PYFA_API pyfa_status pyfa_default_tiles(int kernel, int64_t head_dim, int backend, int* block_r, int* block_c) {
    clear_error();
    return guarded("pyfa_default_tiles", [&] {
        if (!block_r || !block_c) return fail(PYFA_ERROR_INVALID_ARGUMENT, "block_r, block_c: null pointer");
        if (head_dim < 1 || head_dim > kMaxHeadDim)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "head_dim: must be in [1, 256], got %lld",
                        static_cast<long long>(head_dim));
        pyfa_device_profile profile;
        const pyfa_status st = device_profile_get(backend, &profile);
        if (st != PYFA_OK) return st;
        return default_tiles(kernel, head_dim, profile, block_r, block_c);
    });
}

PYFA_API pyfa_status pyfa_variant_default_tiles(int kernel, int variant, int64_t head_dim, int backend,
                                                int* block_r, int* block_c) {
    clear_error();
    return guarded("pyfa_variant_default_tiles", [&] {
        if (!block_r || !block_c) return fail(PYFA_ERROR_INVALID_ARGUMENT, "block_r, block_c: null pointer");
        if (head_dim < 1 || head_dim > kMaxHeadDim)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "head_dim: must be in [1, 256], got %lld",
                        static_cast<long long>(head_dim));
        pyfa_device_profile profile;
        const pyfa_status st = device_profile_get(backend, &profile);
        if (st != PYFA_OK) return st;
        return variant_default_tiles(kernel, variant, head_dim, profile, block_r, block_c);
    });
}

PYFA_API pyfa_status pyfa_fa2_forward(const pyfa_problem* problem, const pyfa_config* config,
                                      const float* q, const float* k, const float* v, float* o, float* lse) {
    const float* in[] = {q, k, v};
    float* out[] = {o, lse};
    return run_op(kFa2Forward, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa2_forward_device(const pyfa_problem* problem, const pyfa_config* config,
                                             const float* q, const float* k, const float* v, float* o,
                                             float* lse, void* stream) {
    const float* in[] = {q, k, v};
    float* out[] = {o, lse};
    return run_op(kFa2Forward, problem, config, in, out, true, stream);
}

PYFA_API pyfa_status pyfa_fa2_backward(const pyfa_problem* problem, const pyfa_config* config,
                                       const float* q, const float* k, const float* v, const float* o,
                                       const float* lse, const float* dout, float* dq, float* dk,
                                       float* dv) {
    const float* in[] = {q, k, v, o, lse, dout};
    float* out[] = {dq, dk, dv};
    return run_op(kFa2Backward, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa2_backward_device(const pyfa_problem* problem, const pyfa_config* config,
                                              const float* q, const float* k, const float* v,
                                              const float* o, const float* lse, const float* dout,
                                              float* dq, float* dk, float* dv, void* stream) {
    const float* in[] = {q, k, v, o, lse, dout};
    float* out[] = {dq, dk, dv};
    return run_op(kFa2Backward, problem, config, in, out, true, stream);
}

PYFA_API pyfa_status pyfa_fa1_forward(const pyfa_problem* problem, const pyfa_config* config,
                                      const float* q, const float* k, const float* v, float* o, float* m,
                                      float* l) {
    const float* in[] = {q, k, v};
    float* out[] = {o, m, l};
    return run_op(kFa1Forward, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa1_forward_device(const pyfa_problem* problem, const pyfa_config* config,
                                             const float* q, const float* k, const float* v, float* o,
                                             float* m, float* l, void* stream) {
    const float* in[] = {q, k, v};
    float* out[] = {o, m, l};
    return run_op(kFa1Forward, problem, config, in, out, true, stream);
}

PYFA_API pyfa_status pyfa_fa1_backward(const pyfa_problem* problem, const pyfa_config* config,
                                       const float* q, const float* k, const float* v, const float* o,
                                       const float* m, const float* l, const float* dout, float* dq,
                                       float* dk, float* dv) {
    const float* in[] = {q, k, v, o, m, l, dout};
    float* out[] = {dq, dk, dv};
    return run_op(kFa1Backward, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa1_backward_device(const pyfa_problem* problem, const pyfa_config* config,
                                              const float* q, const float* k, const float* v,
                                              const float* o, const float* m, const float* l,
                                              const float* dout, float* dq, float* dk, float* dv,
                                              void* stream) {
    const float* in[] = {q, k, v, o, m, l, dout};
    float* out[] = {dq, dk, dv};
    return run_op(kFa1Backward, problem, config, in, out, true, stream);
}

}  // extern "C"
