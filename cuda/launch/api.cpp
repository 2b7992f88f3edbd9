// api.cpp: the C ABI of include/pyfa.h.
//
// Every public operation (FA2 forward, ...) is described once as an Op: the tensors it
// reads and writes, its scratch tensors and its kernels in launch order. run_op checks
// the arguments (naming the bad one), resolves the backend and the tiles, and runs the
// kernels. The host-pointer entry points compute into library-owned buffers and copy the
// outputs to the caller only once every kernel has succeeded, so a failure never leaves
// the caller's memory half written.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "common/tiling.h"
#include "launch/internal.h"

namespace pyfa {

namespace {

enum TensorId { T_Q, T_K, T_V, T_O, T_LSE, T_M, T_L, T_DO, T_DQ, T_DK, T_DV, T_D };

struct TensorSlot {
    const char* name;  // the argument's name, as in pyfa.h
    bool key_rows;     // rows are Nk (K, V, dK, dV) rather than Nq
    bool per_row;      // one value per row (LSE, m, l, D) rather than d
};

const TensorSlot kTensors[] = {
    {"q", false, false},  {"k", true, false},   {"v", true, false},   {"o", false, false},
    {"lse", false, true}, {"m", false, true},   {"l", false, true},   {"do", false, false},
    {"dq", false, false}, {"dk", true, false},  {"dv", true, false},  {"D", false, true},
};

int64_t tensor_elems(TensorId t, const pyfa_problem& pr) {
    const TensorSlot& s = kTensors[t];
    return pr.batch * pr.heads * (s.key_rows ? pr.seqlen_k : pr.seqlen_q) * (s.per_row ? 1 : pr.head_dim);
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
    }
    return p.o;
}

struct Op {
    const char* name;
    std::vector<TensorId> inputs, outputs, scratch;
    std::vector<int> kernels;
};

const Op kFa2Forward = {"pyfa_fa2_forward", {T_Q, T_K, T_V}, {T_O, T_LSE}, {}, {PYFA_KERNEL_FA2_FORWARD}};
const Op kFa1Forward = {"pyfa_fa1_forward", {T_Q, T_K, T_V}, {T_O, T_M, T_L}, {}, {PYFA_KERNEL_FA1_FORWARD}};
const Op kFa1Backward = {"pyfa_fa1_backward", {T_Q, T_K, T_V, T_O, T_M, T_L, T_DO}, {T_DQ, T_DK, T_DV}, {},
                         {PYFA_KERNEL_FA1_BACKWARD}};
const Op kFa2Backward = {"pyfa_fa2_backward", {T_Q, T_K, T_V, T_O, T_LSE, T_DO}, {T_DQ, T_DK, T_DV}, {T_D},
                         {PYFA_KERNEL_FA2_BACKWARD_PREPROCESS, PYFA_KERNEL_FA2_BACKWARD_DKDV,
                          PYFA_KERNEL_FA2_BACKWARD_DQ}};

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGridYZ = 65535;

pyfa_status check_problem(const pyfa_problem* pr) {
    if (!pr) return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: null pointer");
    const struct { const char* name; int64_t value; } dims[] = {
        {"problem->batch", pr->batch},       {"problem->heads", pr->heads},
        {"problem->seqlen_q", pr->seqlen_q}, {"problem->seqlen_k", pr->seqlen_k},
        {"problem->head_dim", pr->head_dim}};
    for (const auto& dim : dims)
        if (dim.value < 1)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        std::string(dim.name) + ": must be >= 1, got " + std::to_string(dim.value));
    if (pr->head_dim > kMaxHeadDim)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->head_dim: must be in [1, 256], got " +
                                                     std::to_string(pr->head_dim));
    if (pr->batch > kMaxGridYZ || pr->heads > kMaxGridYZ)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    std::string(pr->batch > kMaxGridYZ ? "problem->batch" : "problem->heads") +
                        ": at most 65535 (a grid dimension), got " +
                        std::to_string(pr->batch > kMaxGridYZ ? pr->batch : pr->heads));
    // Every tensor's element count must fit comfortably in int64 and size_t.
    const double elems = static_cast<double>(pr->batch) * static_cast<double>(pr->heads) *
                         static_cast<double>(pr->seqlen_q > pr->seqlen_k ? pr->seqlen_q : pr->seqlen_k) *
                         static_cast<double>(pr->head_dim);
    if (elems > 1e17)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: tensors of over 1e17 elements");
    if (!std::isfinite(pr->scale))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->scale: must be finite (0 means 1/sqrt(d))");
    return PYFA_OK;
}

pyfa_status resolve_backend(const pyfa_config& cfg, int* backend) {
    switch (cfg.backend) {
        case PYFA_BACKEND_AUTO: *backend = cuda_available() ? PYFA_BACKEND_CUDA : PYFA_BACKEND_CPU; return PYFA_OK;
        case PYFA_BACKEND_EMU: *backend = PYFA_BACKEND_EMU; return PYFA_OK;
        case PYFA_BACKEND_CPU: *backend = PYFA_BACKEND_CPU; return PYFA_OK;
        case PYFA_BACKEND_CUDA:
            if (!cuda_compiled())
                return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "config->backend: CUDA asked for, but this libpyfa was built without nvcc");
            if (!cuda_available())
                return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "config->backend: CUDA asked for, but no usable GPU was found");
            *backend = PYFA_BACKEND_CUDA;
            return PYFA_OK;
    }
    return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->backend: unknown backend " + std::to_string(cfg.backend));
}

pyfa_status profile_of(int backend, pyfa_device_profile* profile) {
    if (backend == PYFA_BACKEND_CPU) return cpu_profile(profile);
    return backend == PYFA_BACKEND_CUDA ? cuda_profile(profile) : emu_profile(profile);
}

// Tiles for one kernel: the caller's, else the default; checked against the device.
pyfa_status kernel_tiles(int kernel, const pyfa_config& cfg, int64_t d,
                         const pyfa_device_profile& profile, int* Br, int* Bc) {
    if (cfg.block_r < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->block_r: must be >= 1 (0 for the default), got " + std::to_string(cfg.block_r));
    if (cfg.block_c < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->block_c: must be >= 1 (0 for the default), got " + std::to_string(cfg.block_c));
    int r = 0, c = 0;
    if (cfg.block_r == 0 || cfg.block_c == 0) {
        const pyfa_status st = default_tiles(kernel, d, profile, &r, &c);
        if (st != PYFA_OK) return st;
    }
    r = cfg.block_r ? cfg.block_r : r;
    c = cfg.block_c ? cfg.block_c : c;
    const int64_t need = smem_bytes(kernel, r, c, d);
    if (need > profile.smem_per_block)
        return fail(PYFA_ERROR_TILE_TOO_LARGE,
                    std::string(kernel_name(kernel)) + ": block_r=" + std::to_string(r) + ", block_c=" +
                        std::to_string(c) + " at head_dim=" + std::to_string(d) + " need " +
                        std::to_string(need) + " bytes of shared memory (" +
                        smem_breakdown(kernel, r, c, d) + "), but " + profile.name + " allows " +
                        std::to_string(profile.smem_per_block) + " per block");
    *Br = r;
    *Bc = c;
    return PYFA_OK;
}

// Buffers owned by one call; freed on every path out.
struct Scratch {
    int backend = PYFA_BACKEND_EMU;
    void* stream = nullptr;
    std::vector<void*> owned;
    pyfa_status alloc(size_t bytes, float** out) {
        void* ptr = nullptr;
        if (backend == PYFA_BACKEND_CUDA) {
            const pyfa_status st = cuda_malloc(&ptr, bytes, stream);
            if (st != PYFA_OK) return st;
        } else {
            ptr = std::malloc(bytes ? bytes : 1);
            if (!ptr) return fail(PYFA_ERROR_OUT_OF_MEMORY, "out of host memory for " + std::to_string(bytes) + " bytes");
        }
        owned.push_back(ptr);
        *out = static_cast<float*>(ptr);
        return PYFA_OK;
    }
    ~Scratch() {
        for (void* ptr : owned) {
            if (backend == PYFA_BACKEND_CUDA) cuda_free(ptr, stream);
            else std::free(ptr);
        }
    }
};

pyfa_status run_op_unguarded(const Op& op, const pyfa_problem* problem, const pyfa_config* config,
                             const float* const* inputs, float* const* outputs,
                             bool device_pointers, void* stream) {
    pyfa_status st = check_problem(problem);
    if (st != PYFA_OK) return st;
    const pyfa_config cfg = config ? *config : pyfa_config{};
    for (size_t t = 0; t < op.inputs.size(); ++t)
        if (!inputs[t]) return fail(PYFA_ERROR_INVALID_ARGUMENT, std::string(kTensors[op.inputs[t]].name) + ": null pointer");
    for (size_t t = 0; t < op.outputs.size(); ++t)
        if (!outputs[t]) return fail(PYFA_ERROR_INVALID_ARGUMENT, std::string(kTensors[op.outputs[t]].name) + ": null pointer");
    if (cfg.emu_order < PYFA_EMU_ORDER_FORWARD || cfg.emu_order > PYFA_EMU_ORDER_SHUFFLED)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->emu_order: unknown order " + std::to_string(cfg.emu_order));
    if (cfg.emu_workers < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->emu_workers: must be >= 0, got " + std::to_string(cfg.emu_workers));

    int backend = PYFA_BACKEND_EMU;
    if ((st = resolve_backend(cfg, &backend)) != PYFA_OK) return st;
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

    std::vector<AttentionParams> launches;
    std::vector<LaunchShape> shapes;
    for (int kernel : op.kernels) {
        AttentionParams p = base;
        if ((st = kernel_tiles(kernel, cfg, p.head_dim, profile, &p.block_r, &p.block_c)) != PYFA_OK) return st;
        if (ceil_div(p.seqlen_q, p.block_r) > 0x7fffffff || ceil_div(p.seqlen_k, p.block_c) > 0x7fffffff)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: more than 2^31-1 tiles along a sequence");
        launches.push_back(p);
        shapes.push_back(launch_shape(kernel, p));
    }

    // Bind tensors. Host entry points: inputs are copied to the GPU (the emulator reads
    // them in place); outputs always go to owned buffers first.
    Scratch owned;
    owned.backend = backend;
    owned.stream = stream;
    AttentionParams bound = base;
    const bool staged_inputs = !device_pointers && backend == PYFA_BACKEND_CUDA;
    for (size_t t = 0; t < op.inputs.size(); ++t) {
        float*& slot = param_slot(bound, op.inputs[t]);
        slot = const_cast<float*>(inputs[t]);
        if (staged_inputs) {
            const size_t bytes = sizeof(float) * static_cast<size_t>(tensor_elems(op.inputs[t], *problem));
            if ((st = owned.alloc(bytes, &slot)) != PYFA_OK) return st;
            if ((st = cuda_copy_to_device(slot, inputs[t], bytes)) != PYFA_OK) return st;
        }
    }
    for (size_t t = 0; t < op.outputs.size(); ++t) {
        float*& slot = param_slot(bound, op.outputs[t]);
        slot = outputs[t];
        if (!device_pointers) {
            const size_t bytes = sizeof(float) * static_cast<size_t>(tensor_elems(op.outputs[t], *problem));
            if ((st = owned.alloc(bytes, &slot)) != PYFA_OK) return st;
        }
    }
    for (TensorId t : op.scratch) {
        const size_t bytes = sizeof(float) * static_cast<size_t>(tensor_elems(t, *problem));
        if ((st = owned.alloc(bytes, &param_slot(bound, t))) != PYFA_OK) return st;
    }

    if (backend == PYFA_BACKEND_CPU) {
        // The cpu backend takes the whole op at once: it may fuse the op's kernels.
        std::vector<AttentionParams> tiled(op.kernels.size(), bound);
        for (size_t n = 0; n < tiled.size(); ++n) {
            tiled[n].block_r = launches[n].block_r;
            tiled[n].block_c = launches[n].block_c;
        }
        if ((st = cpu_run(op.kernels.data(), tiled.data(), tiled.size(), cfg)) != PYFA_OK) return st;
    } else {
        for (size_t n = 0; n < op.kernels.size(); ++n) {
            AttentionParams p = bound;
            p.block_r = launches[n].block_r;
            p.block_c = launches[n].block_c;
            st = backend == PYFA_BACKEND_CUDA ? cuda_launch(op.kernels[n], p, shapes[n], stream)
                                              : emu_launch(op.kernels[n], p, shapes[n], cfg);
            if (st != PYFA_OK) return st;
        }
    }

    if (!device_pointers) {
        if (backend == PYFA_BACKEND_CUDA && (st = cuda_synchronize()) != PYFA_OK) return st;
        for (size_t t = 0; t < op.outputs.size(); ++t) {
            const size_t bytes = sizeof(float) * static_cast<size_t>(tensor_elems(op.outputs[t], *problem));
            const float* src = param_slot(bound, op.outputs[t]);
            if (backend == PYFA_BACKEND_CUDA) {
                if ((st = cuda_copy_to_host(outputs[t], src, bytes)) != PYFA_OK) return st;
            } else {
                std::memcpy(outputs[t], src, bytes);
            }
        }
    }
    return PYFA_OK;
}

// No C++ exception may cross the C ABI (it would terminate the caller's process): an
// allocation failure or any other throw becomes a status and a message.
pyfa_status run_op(const Op& op, const pyfa_problem* problem, const pyfa_config* config,
                   const float* const* inputs, float* const* outputs, bool device_pointers,
                   void* stream) {
    clear_error();
    try {
        return run_op_unguarded(op, problem, config, inputs, outputs, device_pointers, stream);
    } catch (const std::bad_alloc&) {
        return fail(PYFA_ERROR_OUT_OF_MEMORY, std::string(op.name) + ": out of host memory");
    } catch (const std::exception& e) {
        return fail(PYFA_ERROR_INTERNAL, std::string(op.name) + ": " + e.what());
    } catch (...) {
        return fail(PYFA_ERROR_INTERNAL, std::string(op.name) + ": unknown exception");
    }
}

}  // namespace

}  // namespace pyfa

using namespace pyfa;

extern "C" {

PYFA_API const char* pyfa_version(void) { return PYFA_VERSION_STRING; }

PYFA_API int pyfa_abi_version(void) { return PYFA_ABI_VERSION; }

PYFA_API int pyfa_backend_available(int backend) {
    switch (backend) {
        case PYFA_BACKEND_EMU: return 1;
        case PYFA_BACKEND_CPU: return 1;
        case PYFA_BACKEND_CUDA: return cuda_available() ? 1 : 0;
        case PYFA_BACKEND_AUTO: return 1;
    }
    return 0;
}

PYFA_API int pyfa_backend_compiled(int backend) {
    switch (backend) {
        case PYFA_BACKEND_EMU: return 1;
        case PYFA_BACKEND_CPU: return 1;
        case PYFA_BACKEND_CUDA: return cuda_compiled() ? 1 : 0;
    }
    return 0;
}

PYFA_API const char* pyfa_backend_reason(int backend) {
    if (pyfa_backend_available(backend)) return "";
    if (backend == PYFA_BACKEND_CUDA)
        return cuda_compiled() ? "no usable CUDA GPU was found" : "this libpyfa was built without nvcc";
    return "unknown backend";
}

PYFA_API pyfa_status pyfa_device_profile_get(int backend, pyfa_device_profile* profile) {
    clear_error();
    if (!profile) return fail(PYFA_ERROR_INVALID_ARGUMENT, "profile: null pointer");
    pyfa_config cfg{};
    cfg.backend = backend;
    int resolved = PYFA_BACKEND_EMU;
    const pyfa_status st = resolve_backend(cfg, &resolved);
    if (st != PYFA_OK) return st;
    return profile_of(resolved, profile);
}

PYFA_API int64_t pyfa_smem_bytes(int kernel, int block_r, int block_c, int64_t head_dim) {
    return smem_bytes(kernel, block_r, block_c, head_dim);
}

PYFA_API pyfa_status pyfa_default_tiles(int kernel, int64_t head_dim, int backend, int* block_r, int* block_c) {
    clear_error();
    if (!block_r || !block_c) return fail(PYFA_ERROR_INVALID_ARGUMENT, "block_r, block_c: null pointer");
    if (head_dim < 1 || head_dim > kMaxHeadDim)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "head_dim: must be in [1, 256], got " + std::to_string(head_dim));
    pyfa_device_profile profile;
    const pyfa_status st = pyfa_device_profile_get(backend, &profile);
    if (st != PYFA_OK) return st;
    return default_tiles(kernel, head_dim, profile, block_r, block_c);
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
