// api.cpp: the C ABI of include/pyfa.h.
//
// Every public operation (FA2 forward, ...) is described once as an Op: the tensors it
// reads and writes, its scratch tensors and its kernels in launch order. run_op checks
// the arguments (naming the bad one), resolves the backend and the tiles, checks every
// kernel's launch before the first one runs, and runs the kernels. Outputs go to
// library-owned buffers first wherever the library can stage them (every host entry
// point, and the host-memory backends behind a *_device entry point) and are copied to
// the caller only once every kernel has succeeded, so a failure never leaves the
// caller's memory half written. Staged outputs are dense; the caller's strided outputs
// are written row by row from them, which never touches the gaps between rows (where a
// packed caller keeps other tensors).
//
// No C++ exception may cross the C ABI (it would terminate the caller's process), and
// reporting a failure must work when allocation does not: every extern "C" function runs
// its body under guarded(), and no failure path allocates.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>

#include "common/smem.h"
#include "common/tiling.h"
#include "core/internal.h"

namespace pyfa {

namespace {

enum TensorId { T_NONE, T_Q, T_K, T_V, T_O, T_LSE, T_M, T_L, T_DO, T_DQ, T_DK, T_DV, T_D };

struct TensorSlot {
    const char* name;  // the argument's name, as in pyfa.h
    bool key_rows;     // K, V, dK, dV: rows are Nk rather than Nq, heads Hkv rather than H
    bool per_row;      // one value per row (LSE, m, l, D) rather than d; always dense
    pyfa_strides pyfa_problem::*caller;   // its strides as the caller gives them (4-D tensors)
    TensorStrides AttentionParams::*kernel;  // and as the kernels take them
};

const TensorSlot kTensors[] = {
    {"", false, false, nullptr, nullptr},
    {"q", false, false, &pyfa_problem::q, &AttentionParams::q_strides},
    {"k", true, false, &pyfa_problem::k, &AttentionParams::k_strides},
    {"v", true, false, &pyfa_problem::v, &AttentionParams::v_strides},
    {"o", false, false, &pyfa_problem::o, &AttentionParams::o_strides},
    {"lse", false, true, nullptr, nullptr},
    {"m", false, true, nullptr, nullptr},
    {"l", false, true, nullptr, nullptr},
    {"do", false, false, &pyfa_problem::dout, &AttentionParams::dout_strides},
    {"dq", false, false, &pyfa_problem::dq, &AttentionParams::dq_strides},
    {"dk", true, false, &pyfa_problem::dk, &AttentionParams::dk_strides},
    {"dv", true, false, &pyfa_problem::dv, &AttentionParams::dv_strides},
    {"D", false, true, nullptr, nullptr},
};

// Heads of tensor t (pr.heads_kv already resolved from 0).
int64_t tensor_heads(TensorId t, const pyfa_problem& pr) { return kTensors[t].key_rows ? pr.heads_kv : pr.heads; }
int64_t tensor_rows(TensorId t, const pyfa_problem& pr) { return kTensors[t].key_rows ? pr.seqlen_k : pr.seqlen_q; }

// Elements of tensor t when dense; exact, or -1 when B * heads * rows * cols does not fit
// in int64_t.
int64_t tensor_elems(TensorId t, const pyfa_problem& pr) {
    int64_t n = checked_mul(pr.batch, tensor_heads(t, pr));
    n = checked_mul(n, tensor_rows(t, pr));
    return kTensors[t].per_row ? n : checked_mul(n, pr.head_dim);
}

// Bytes of tensor t when dense; check_problem has made sure they fit.
size_t tensor_bytes(TensorId t, const pyfa_problem& pr) {
    return sizeof(float) * static_cast<size_t>(tensor_elems(t, pr));
}

// The caller's strides of a 4-D tensor; nullptr for a per-row one.
const pyfa_strides* caller_strides(TensorId t, const pyfa_problem& pr) {
    return kTensors[t].caller ? &(pr.*kTensors[t].caller) : nullptr;
}

// The field names of pyfa_problem's strides, for messages ("do" is the argument, "dout"
// the field).
const char* strides_field(TensorId t) { return t == T_DO ? "dout" : kTensors[t].name; }

TensorStrides dense_strides(TensorId t, const pyfa_problem& pr) {
    const int64_t row = pr.head_dim, head = tensor_rows(t, pr) * row;
    return TensorStrides{tensor_heads(t, pr) * head, head, row};
}

// The strides the kernels use for tensor t as the caller laid it out (check_problem has
// checked them).
TensorStrides resolved_strides(TensorId t, const pyfa_problem& pr) {
    const pyfa_strides* s = caller_strides(t, pr);
    if (!s || (s->batch == 0 && s->head == 0 && s->row == 0)) return dense_strides(t, pr);
    return TensorStrides{s->batch, s->head, s->row};
}

bool is_dense(TensorId t, const pyfa_problem& pr) {
    const TensorStrides s = resolved_strides(t, pr), dense = dense_strides(t, pr);
    return s.batch == dense.batch && s.head == dense.head && s.row == dense.row;
}

// Elements from the first to one past the last element tensor t touches in the caller's
// layout: (B-1) sb + (heads-1) sh + (rows-1) sr + d. Exact, or -1 past int64_t.
int64_t tensor_extent(TensorId t, const pyfa_problem& pr) {
    if (kTensors[t].per_row) return tensor_elems(t, pr);
    const TensorStrides s = resolved_strides(t, pr);
    int64_t n = checked_add(checked_mul(pr.batch - 1, s.batch), checked_mul(tensor_heads(t, pr) - 1, s.head));
    n = n < 0 ? -1 : checked_add(n, checked_mul(tensor_rows(t, pr) - 1, s.row));
    return n < 0 ? -1 : checked_add(n, pr.head_dim);
}

// A dense copy of the caller's strided tensor t, gathered row by row.
void gather_rows(TensorId t, const pyfa_problem& pr, const float* in, float* dense) {
    const TensorStrides s = resolved_strides(t, pr);
    const int64_t heads = tensor_heads(t, pr), rows = tensor_rows(t, pr), d = pr.head_dim;
    const size_t row_bytes = sizeof(float) * static_cast<size_t>(d);
    for (int64_t b = 0; b < pr.batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t n = 0; n < rows; ++n)
                std::memcpy(dense + ((b * heads + h) * rows + n) * d, in + s.at(b, h, n), row_bytes);
}

// The caller's copy of tensor t written from `dense`, row by row unless it is dense too.
void scatter_rows(TensorId t, const pyfa_problem& pr, const float* dense, float* out) {
    if (is_dense(t, pr)) {
        std::memcpy(out, dense, tensor_bytes(t, pr));
        return;
    }
    const TensorStrides s = resolved_strides(t, pr);
    const int64_t heads = tensor_heads(t, pr), rows = tensor_rows(t, pr), d = pr.head_dim;
    const size_t row_bytes = sizeof(float) * static_cast<size_t>(d);
    for (int64_t b = 0; b < pr.batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t n = 0; n < rows; ++n)
                std::memcpy(out + s.at(b, h, n), dense + ((b * heads + h) * rows + n) * d, row_bytes);
}

// The kernels' strides of a 4-D tensor; nullptr for the dense per-row ones.
TensorStrides* strides_slot(AttentionParams& p, TensorId t) {
    return kTensors[t].kernel ? &(p.*kTensors[t].kernel) : nullptr;
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

// What struct_size 0 means: ABI 3's layout. pyfa_config's later fields start at or after
// ABI 3's sizeof, never in its tail padding, which an ABI 3 caller leaves unset.
template <class T>
constexpr size_t kAbi3Size = sizeof(T);
template <>
constexpr size_t kAbi3Size<pyfa_config> = offsetof(pyfa_config, flags);
// ABI 3's pyfa_config ended after variant, padded to the struct's alignment (unchanged by
// flags: emu_seed is a uint64_t too).
static_assert(offsetof(pyfa_config, flags) == (offsetof(pyfa_config, variant) + sizeof(int) + alignof(pyfa_config) - 1) /
                                                  alignof(pyfa_config) * alignof(pyfa_config),
              "pyfa_config.flags must start where ABI 3's pyfa_config ended");

// The caller's struct copied into a zeroed one of this library's layout: min(struct_size,
// sizeof) bytes, struct_size 0 meaning ABI 3's size; bytes the library does not know must be 0.
template <class T>
pyfa_status copy_struct(const T* in, const char* field, T* out) {
    *out = T{};
    const uint32_t size = in->struct_size ? in->struct_size : static_cast<uint32_t>(kAbi3Size<T>);
    if (size < sizeof(uint32_t))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: %u is smaller than the field itself (0 means ABI 3's layout)",
                    field, size);
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(in);
    for (size_t n = sizeof(T); n < size; ++n)
        if (bytes[n] != 0)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "%s: %u bytes, but this library (ABI %d) knows %zu and byte %zu beyond them is nonzero: "
                        "a field this library does not have was set",
                        field, size, PYFA_ABI_VERSION, sizeof(T), n);
    std::memcpy(out, in, size < sizeof(T) ? size : sizeof(T));
    out->struct_size = static_cast<uint32_t>(sizeof(T));
    return PYFA_OK;
}

// Checks the caller's problem for an operation taking `tensors` (n of them) and writes
// the library's copy to `out`, with heads_kv resolved from 0.
pyfa_status check_problem(const pyfa_problem* in, const TensorId* tensors, int n, pyfa_problem* out) {
    if (!in) return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: null pointer");
    pyfa_status st = copy_struct(in, "problem->struct_size", out);
    if (st != PYFA_OK) return st;
    pyfa_problem* pr = out;
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
    if (pr->heads_kv == 0) pr->heads_kv = pr->heads;
    if (pr->heads_kv < 0 || pr->heads % pr->heads_kv != 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "problem->heads_kv: must divide heads = %lld (0 means heads), got %lld",
                    static_cast<long long>(pr->heads), static_cast<long long>(pr->heads_kv));
    if (pr->causal_align != PYFA_ALIGN_BOTTOM_RIGHT && pr->causal_align != PYFA_ALIGN_TOP_LEFT)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "problem->causal_align: must be PYFA_ALIGN_BOTTOM_RIGHT (0) or PYFA_ALIGN_TOP_LEFT (1), got %d",
                    pr->causal_align);
    // Exact: q and o (rows Nq), k and v (rows Nk) are the largest dense tensors.
    const struct { TensorId t; const char* shape; } big[] = {{T_Q, "B*H*Nq*d"}, {T_K, "B*Hkv*Nk*d"}};
    for (const auto& x : big) {
        const int64_t elems = tensor_elems(x.t, *pr);
        if (elems < 0 || elems > kMaxTensorElems)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "problem: %s elements (of %s) exceed 2^61 - 1, the most a tensor may hold", x.shape,
                        kTensors[x.t].name);
    }
    for (int t = 0; t < n; ++t) {
        const pyfa_strides* s = caller_strides(tensors[t], *pr);
        if (!s) continue;
        const struct { const char* name; int64_t value; } fields[] = {
            {"batch", s->batch}, {"head", s->head}, {"row", s->row}};
        for (const auto& f : fields)
            if (f.value < 0)
                return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->%s.%s: must be >= 0 (all three 0: dense), got %lld",
                            strides_field(tensors[t]), f.name, static_cast<long long>(f.value));
        // The span the strides imply must be addressable, so that every index the
        // kernels form and every byte count the library stages fits in int64_t.
        const int64_t extent = tensor_extent(tensors[t], *pr);
        if (extent < 0 || extent > kMaxTensorElems)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "problem->%s: the strides (%lld, %lld, %lld) span more than 2^61 - 1 elements",
                        strides_field(tensors[t]), static_cast<long long>(s->batch), static_cast<long long>(s->head),
                        static_cast<long long>(s->row));
    }
    if (!std::isfinite(pr->scale))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->scale: must be finite (0 means 1/sqrt(d))");
    return PYFA_OK;
}

pyfa_status check_config(const pyfa_config* in, pyfa_config* cfg) {
    if (!in) {
        *cfg = pyfa_config{};
        return PYFA_OK;
    }
    pyfa_status st = copy_struct(in, "config->struct_size", cfg);
    if (st != PYFA_OK) return st;
    if (cfg->variant < PYFA_VARIANT_AUTO || cfg->variant > PYFA_VARIANT_FAST)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->variant: unknown variant %d", cfg->variant);
    if (cfg->flags & ~static_cast<uint64_t>(PYFA_FLAG_IN_PLACE))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->flags: unknown bits 0x%llx",
                    static_cast<unsigned long long>(cfg->flags & ~static_cast<uint64_t>(PYFA_FLAG_IN_PLACE)));
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
            *backend = PYFA_BACKEND_CPU;
            return PYFA_OK;
        case PYFA_BACKEND_EMU: *backend = PYFA_BACKEND_EMU; return PYFA_OK;
        case PYFA_BACKEND_CPU: *backend = PYFA_BACKEND_CPU; return PYFA_OK;
        case PYFA_BACKEND_CUDA:
            if (!cuda_available())
                return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "%s: CUDA asked for, but %s", arg,
                            cuda_unavailable_reason());
            *backend = PYFA_BACKEND_CUDA;
            return PYFA_OK;
    }
    return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: unknown backend %d", arg, asked);
}

// Backends that run on host memory (the emulator and the cpu backend) read the
// inputs in place and have their outputs staged by run_op.
bool host_memory(int backend) { return backend != PYFA_BACKEND_CUDA; }

pyfa_status profile_of(int backend, pyfa_device_profile* profile) {
    switch (backend) {
        case PYFA_BACKEND_CUDA: return cuda_profile(profile);
        case PYFA_BACKEND_EMU: return emu_profile(profile);
        case PYFA_BACKEND_CPU: return cpu_profile(profile);
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
        const pyfa_status st = default_tiles(kernel, d, profile, cfg.block_r, cfg.block_c, &r, &c);
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
    const int n_in = count(op.inputs), n_out = count(op.outputs), n_scratch = count(op.scratch);
    TensorId taken[kMaxInputs + kMaxOutputs];
    for (int t = 0; t < n_in; ++t) taken[t] = op.inputs[t];
    for (int t = 0; t < n_out; ++t) taken[n_in + t] = op.outputs[t];
    pyfa_problem pr;
    pyfa_status st = check_problem(problem, taken, n_in + n_out, &pr);
    if (st != PYFA_OK) return st;
    pyfa_config cfg;
    if ((st = check_config(config, &cfg)) != PYFA_OK) return st;
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
    base.batch = pr.batch;
    base.heads = pr.heads;
    base.heads_kv = pr.heads_kv;
    base.seqlen_q = pr.seqlen_q;
    base.seqlen_k = pr.seqlen_k;
    base.head_dim = pr.head_dim;
    base.scale = pr.scale != 0.0f ? pr.scale : 1.0f / std::sqrt(static_cast<float>(pr.head_dim));
    base.mask = make_mask(pr.causal, pr.window, pr.window_left, pr.window_right, pr.causal_align, pr.seqlen_q,
                          pr.seqlen_k);
    for (int t = 0; t < n_in + n_out; ++t)
        if (TensorStrides* slot = strides_slot(base, taken[t])) *slot = resolved_strides(taken[t], pr);

    // Every kernel's tiles and launch are checked before anything is allocated or
    // launched, so that a configuration error never follows a kernel that has written.
    int tiles[kMaxKernels][2];
    int ids[kMaxKernels];  // kernel table rows (kernels/table.h): the variant that runs
    LaunchShape shapes[kMaxKernels];
    // What the fast kernels' 128-bit accesses need: every row of every tensor starts on
    // 16 bytes (the caller's pointers and strides; staged copies keep both).
    bool aligned = true;
    for (int t = 0; t < n_in + n_out; ++t) {
        const void* ptr = t < n_in ? static_cast<const void*>(inputs[t]) : outputs[t - n_in];
        aligned = aligned && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
        if (const TensorStrides* s = strides_slot(base, taken[t]))
            aligned = aligned && s->batch % 4 == 0 && s->head % 4 == 0 && s->row % 4 == 0;
    }
    for (int n = 0; n < op.kernel_count; ++n) {
        const int kernel = op.kernels[n];
        AttentionParams p = base;
        int id = kernel;
        // The cpu backend has kernels of its own: the variants choose between the GPU's
        // (and the emulator's).
        if (backend == PYFA_BACKEND_CPU && cfg.variant == PYFA_VARIANT_FAST)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "config->variant: fast: the cpu backend has kernels of its own; PYFA_VARIANT_FAST "
                        "chooses among the emulator's and CUDA's");
        if (backend != PYFA_BACKEND_CPU &&
            (st = select_kernel(kernel, cfg.variant, p, cfg.block_r, cfg.block_c, aligned, profile, &id,
                                &p.block_r, &p.block_c)) != PYFA_OK)
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

    // Bind tensors. Inputs: their whole span (as the strides lay it out) copied to the GPU
    // for a host entry point on CUDA, else read in place. Outputs: staged dense in owned
    // buffers, copied to the caller's once the call has succeeded, unless written in place:
    // the GPU's own memory (a *_device entry point on CUDA, where the stream orders
    // everything and the kernels write the caller's strides directly), or host memory the
    // caller lets a host backend write (PYFA_FLAG_IN_PLACE; the cpu backend: dense only).
    Scratch owned;
    owned.backend = backend;
    owned.stream = stream;
    Scratch host_owned;  // host bounce buffers of strided outputs coming back from CUDA
    AttentionParams bound = base;
    const bool stage_inputs = !device_pointers && backend == PYFA_BACKEND_CUDA;
    // The cpu backend addresses dense tensors only: strided inputs are gathered first, and
    // strided outputs are always staged.
    const bool dense_only = backend == PYFA_BACKEND_CPU;
    const bool host_in_place = host_memory(backend) && (cfg.flags & PYFA_FLAG_IN_PLACE);
    bool staged[kMaxOutputs] = {};
    bool any_staged = false;
    for (int t = 0; t < n_in; ++t) {
        float*& slot = param_slot(bound, op.inputs[t]);
        slot = const_cast<float*>(inputs[t]);
        if (stage_inputs) {
            const size_t bytes = sizeof(float) * static_cast<size_t>(tensor_extent(op.inputs[t], pr));
            if ((st = owned.alloc(bytes, &slot)) != PYFA_OK) return st;
            if ((st = cuda_copy_to_device(slot, inputs[t], bytes, stream)) != PYFA_OK) return st;
        } else if (dense_only && !kTensors[op.inputs[t]].per_row && !is_dense(op.inputs[t], pr)) {
            if ((st = owned.alloc(tensor_bytes(op.inputs[t], pr), &slot)) != PYFA_OK) return st;
            gather_rows(op.inputs[t], pr, inputs[t], slot);
            *strides_slot(bound, op.inputs[t]) = dense_strides(op.inputs[t], pr);
        }
    }
    for (int t = 0; t < n_out; ++t) {
        float*& slot = param_slot(bound, op.outputs[t]);
        slot = outputs[t];
        staged[t] = backend == PYFA_BACKEND_CUDA
                        ? !device_pointers
                        : !host_in_place || (dense_only && !kTensors[op.outputs[t]].per_row &&
                                             !is_dense(op.outputs[t], pr));
        any_staged = any_staged || staged[t];
        if (staged[t]) {
            if ((st = owned.alloc(tensor_bytes(op.outputs[t], pr), &slot)) != PYFA_OK) return st;
            if (TensorStrides* s = strides_slot(bound, op.outputs[t])) *s = dense_strides(op.outputs[t], pr);
        }
    }
    for (int t = 0; t < n_scratch; ++t)
        if ((st = owned.alloc(tensor_bytes(op.scratch[t], pr), &param_slot(bound, op.scratch[t]))) != PYFA_OK)
            return st;

    // The CUDA backend asks config->progress before each launch. On the library's stream
    // (host entry points) it first waits for the kernels already launched, so that `done`
    // counts finished kernels and a cancel takes effect between them. Work enqueued on the
    // caller's stream cannot be taken back, so a *_device call asks once, before any launch.
    const bool cuda_polls = backend == PYFA_BACKEND_CUDA && cfg.progress;
    if (backend == PYFA_BACKEND_CPU) {
        // The cpu backend takes the whole op at once: it may fuse the op's kernels.
        AttentionParams tiled[kMaxKernels];
        for (int n = 0; n < op.kernel_count; ++n) {
            tiled[n] = bound;
            tiled[n].block_r = tiles[n][0];
            tiled[n].block_c = tiles[n][1];
        }
        if ((st = cpu_run(op.kernels, tiled, static_cast<size_t>(op.kernel_count), cfg)) != PYFA_OK) return st;
    } else {
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
    }

    if (!any_staged) return owned.release();
    if (backend == PYFA_BACKEND_CUDA) {
        if ((st = cuda_synchronize(stream)) != PYFA_OK) return st;
        if (cuda_polls && (st = poll_progress(cfg, op.kernel_count, op.kernel_count)) != PYFA_OK) return st;
    }
    // Strided outputs come back from the GPU into host bounce buffers, allocated before
    // the first caller's byte is written, then go to the caller row by row.
    const float* dense_out[kMaxOutputs] = {};
    for (int t = 0; t < n_out; ++t) {
        const TensorId id = op.outputs[t];
        dense_out[t] = param_slot(bound, id);
        if (!staged[t] || backend != PYFA_BACKEND_CUDA || is_dense(id, pr)) continue;
        float* bounce = nullptr;
        if ((st = host_owned.alloc(tensor_bytes(id, pr), &bounce)) != PYFA_OK) return st;
        if ((st = cuda_copy_to_host(bounce, dense_out[t], tensor_bytes(id, pr), stream)) != PYFA_OK) return st;
        dense_out[t] = bounce;
    }
    if (backend == PYFA_BACKEND_CUDA && (st = cuda_synchronize(stream)) != PYFA_OK) return st;
    for (int t = 0; t < n_out; ++t) {
        const TensorId id = op.outputs[t];
        if (!staged[t]) continue;
        if (backend == PYFA_BACKEND_CUDA && is_dense(id, pr)) {
            if ((st = cuda_copy_to_host(outputs[t], dense_out[t], tensor_bytes(id, pr), stream)) != PYFA_OK) return st;
        } else {
            scatter_rows(id, pr, dense_out[t], outputs[t]);
        }
    }
    if (backend == PYFA_BACKEND_CUDA && (st = cuda_synchronize(stream)) != PYFA_OK) return st;
    host_owned.release();
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

namespace pyfa {
namespace {

// pyfa_default_tiles is pyfa_variant_default_tiles for the readable kernels.
pyfa_status default_tiles_entry(const char* entry, int kernel, int variant, int64_t head_dim, int backend,
                                int* block_r, int* block_c) {
    clear_error();
    return guarded(entry, [&] {
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

}  // namespace
}  // namespace pyfa

extern "C" {

PYFA_API const char* pyfa_version(void) { return PYFA_VERSION_STRING; }

PYFA_API int pyfa_abi_version(void) { return PYFA_ABI_VERSION; }

PYFA_API int pyfa_backend_available(int backend) {
    return guarded_value("pyfa_backend_available", 0, [&] {
        switch (backend) {
            case PYFA_BACKEND_EMU:
            case PYFA_BACKEND_CPU: return 1;
            case PYFA_BACKEND_CUDA: return cuda_available() ? 1 : 0;
            case PYFA_BACKEND_AUTO: return 1;
        }
        return 0;
    });
}

PYFA_API int pyfa_backend_compiled(int backend) {
    return guarded_value("pyfa_backend_compiled", 0, [&] {
        switch (backend) {
            case PYFA_BACKEND_EMU:
            case PYFA_BACKEND_CPU: return 1;
            case PYFA_BACKEND_CUDA: return cuda_compiled() ? 1 : 0;
        }
        return 0;
    });
}

PYFA_API const char* pyfa_backend_reason(int backend) {
    return guarded_value<const char*>("pyfa_backend_reason", "the reason could not be determined", [&] {
        switch (backend) {
            case PYFA_BACKEND_EMU:
            case PYFA_BACKEND_CPU:
            case PYFA_BACKEND_AUTO: return "";
            case PYFA_BACKEND_CUDA: return cuda_unavailable_reason();
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
    return default_tiles_entry("pyfa_default_tiles", kernel, PYFA_VARIANT_REFERENCE, head_dim, backend,
                               block_r, block_c);
}

PYFA_API pyfa_status pyfa_variant_default_tiles(int kernel, int variant, int64_t head_dim, int backend,
                                                int* block_r, int* block_c) {
    return default_tiles_entry("pyfa_variant_default_tiles", kernel, variant, head_dim, backend, block_r,
                               block_c);
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
