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
// Backends are reached only through the Backend interface (core/internal.h) and the
// registry: nothing here names one. What differs between them (host or device memory,
// dense tensors only, a whole op at once, progress polled per kernel) is a property.
//
// No C++ exception may cross the C ABI (it would terminate the caller's process), and
// reporting a failure must work when allocation does not: every extern "C" function runs
// its body under guarded(), and no failure path allocates.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <vector>

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
    pyfa_tensor pyfa_tensors::*named;     // its field in pyfa_run's tensors (not for scratch)
};

const TensorSlot kTensors[] = {
    {"", false, false, nullptr, nullptr, nullptr},
    {"q", false, false, &pyfa_problem::q, &AttentionParams::q_strides, &pyfa_tensors::q},
    {"k", true, false, &pyfa_problem::k, &AttentionParams::k_strides, &pyfa_tensors::k},
    {"v", true, false, &pyfa_problem::v, &AttentionParams::v_strides, &pyfa_tensors::v},
    {"o", false, false, &pyfa_problem::o, &AttentionParams::o_strides, &pyfa_tensors::o},
    {"lse", false, true, nullptr, nullptr, &pyfa_tensors::lse},
    {"m", false, true, nullptr, nullptr, &pyfa_tensors::m},
    {"l", false, true, nullptr, nullptr, &pyfa_tensors::l},
    {"do", false, false, &pyfa_problem::dout, &AttentionParams::dout_strides, &pyfa_tensors::dout},
    {"dq", false, false, &pyfa_problem::dq, &AttentionParams::dq_strides, &pyfa_tensors::dq},
    {"dk", true, false, &pyfa_problem::dk, &AttentionParams::dk_strides, &pyfa_tensors::dk},
    {"dv", true, false, &pyfa_problem::dv, &AttentionParams::dv_strides, &pyfa_tensors::dv},
    {"D", false, true, nullptr, nullptr, nullptr},
};
// The tensors a caller names (T_Q .. T_DV); T_D is the library's own.
constexpr int kNamedTensors = T_DV + 1;

bool all_zero(const pyfa_strides& s) { return s.batch == 0 && s.head == 0 && s.row == 0; }

// Heads of tensor t (pr.heads_kv already resolved from 0).
int64_t tensor_heads(TensorId t, const pyfa_problem& pr) { return kTensors[t].key_rows ? pr.heads_kv : pr.heads; }
// Packed sequences (pr.varlen) are, as tensors, one batch of total_q (total_k) rows: every
// function below sizes, copies and compares them so; only the kernels see the sequences.
int64_t tensor_batch(const pyfa_problem& pr) { return pr.varlen ? 1 : pr.batch; }
int64_t tensor_rows(TensorId t, const pyfa_problem& pr) {
    // Paged, k and v hold the pages (check_problem has bounded the product).
    if (pr.varlen && pr.page_size > 0 && (t == T_K || t == T_V)) return pr.num_pages * pr.page_size;
    if (pr.varlen) return kTensors[t].key_rows ? pr.total_k : pr.total_q;
    return kTensors[t].key_rows ? pr.seqlen_k : pr.seqlen_q;
}

// Elements of tensor t when dense; exact, or -1 when B * heads * rows * cols does not fit
// in int64_t.
int64_t tensor_elems(TensorId t, const pyfa_problem& pr) {
    int64_t n = checked_mul(tensor_batch(pr), tensor_heads(t, pr));
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

// The layout of the library's own copies (staged outputs, gathered inputs): row-major
// (B, heads, N, d), packed sequences included ((1, heads, total, d)).
TensorStrides dense_strides(TensorId t, const pyfa_problem& pr) {
    const int64_t row = pr.head_dim, head = tensor_rows(t, pr) * row;
    return TensorStrides{tensor_heads(t, pr) * head, head, row};
}

// The strides the kernels use for tensor t as the caller laid it out (check_problem has
// checked them). All zero: dense, which for packed sequences is (total, heads, d).
TensorStrides resolved_strides(TensorId t, const pyfa_problem& pr) {
    const pyfa_strides* s = caller_strides(t, pr);
    if (s && pr.varlen && all_zero(*s)) {
        const int64_t head = pr.head_dim, row = tensor_heads(t, pr) * head;
        return TensorStrides{tensor_rows(t, pr) * row, head, row};
    }
    if (!s || all_zero(*s)) return dense_strides(t, pr);
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
    int64_t n = checked_add(checked_mul(tensor_batch(pr) - 1, s.batch), checked_mul(tensor_heads(t, pr) - 1, s.head));
    n = n < 0 ? -1 : checked_add(n, checked_mul(tensor_rows(t, pr) - 1, s.row));
    return n < 0 ? -1 : checked_add(n, pr.head_dim);
}

// Tensor t as the caller laid it out, in bytes: up to three dimensions (stride, count) of
// rows `width` bytes long (a per-row tensor: rows of one float).
struct ByteLayout {
    int64_t stride[3];
    int64_t count[3];
    int64_t width;
};

ByteLayout byte_layout(TensorId t, const pyfa_problem& pr) {
    const int64_t f = static_cast<int64_t>(sizeof(float));
    const int64_t heads = tensor_heads(t, pr), rows = tensor_rows(t, pr);
    const int64_t batch = tensor_batch(pr);
    if (kTensors[t].per_row) return ByteLayout{{heads * rows * f, rows * f, f}, {batch, heads, rows}, f};
    const TensorStrides s = resolved_strides(t, pr);
    return ByteLayout{{s.batch * f, s.head * f, s.row * f}, {batch, heads, rows}, pr.head_dim * f};
}

// Whether some row of a (at byte address a0) and some row of b (at b0) share a byte.
// Two tensors whose strides differ are taken to overlap when their spans intersect
// (conservative). With the same strides and row width, and strides nested (each at least
// the span of the dimensions inside it, as in any view of one array, packed ones such as
// (B, N, 3, H, d) included), the answer is exact: a row of a at a0 + sum s_i a_i meets one
// of b at b0 + sum s_i b_i iff |(a0 - b0) - sum s_i k_i| < width for some k_i = b_i - a_i,
// and nesting leaves at most two candidates for each k_i, outermost first.
bool rows_meet(const ByteLayout& a, uintptr_t a0, const ByteLayout& b, uintptr_t b0) {
    auto span = [](const ByteLayout& l) {
        __int128 n = l.width;
        for (int i = 0; i < 3; ++i) n += static_cast<__int128>(l.stride[i]) * (l.count[i] - 1);
        return n;
    };
    const __int128 a_end = static_cast<__int128>(a0) + span(a), b_end = static_cast<__int128>(b0) + span(b);
    if (a_end <= static_cast<__int128>(b0) || b_end <= static_cast<__int128>(a0)) return false;
    if (a.width != b.width) return true;
    for (int i = 0; i < 3; ++i)
        if (a.stride[i] != b.stride[i]) return true;
    // Dimensions outermost first, without those of one element in both.
    int order[3], n = 0;
    for (int i = 0; i < 3; ++i)
        if (a.count[i] > 1 || b.count[i] > 1) order[n++] = i;
    for (int m = 1; m < n; ++m)
        for (int j = m; j > 0 && a.stride[order[j]] > a.stride[order[j - 1]]; --j) std::swap(order[j], order[j - 1]);
    __int128 inside = a.width;  // the span of the dimensions inside the current one
    for (int m = n - 1; m >= 0; --m) {
        const int i = order[m];
        if (a.stride[i] < inside) return true;  // not nested
        inside += static_cast<__int128>(a.stride[i]) * (std::max(a.count[i], b.count[i]) - 1);
    }
    struct Search {
        const ByteLayout& a;
        const ByteLayout& b;
        const int* order;
        int n;
        bool from(int m, __int128 r) const {
            if (m >= n || m >= 3) return r < a.width && -r < a.width;
            const int i = order[m];
            const __int128 s = a.stride[i], lo = 1 - a.count[i], hi = b.count[i] - 1;
            __int128 k = r / s;
            if (k * s > r) --k;  // floor
            for (__int128 c = k; c <= k + 1; ++c)
                if (c >= lo && c <= hi && from(m + 1, r - s * c)) return true;
            return false;
        }
    };
    const Search search{a, b, order, n};
    return search.from(0, static_cast<__int128>(a0) - static_cast<__int128>(b0));
}

// A dense copy of the caller's strided tensor t, gathered row by row.
void gather_rows(TensorId t, const pyfa_problem& pr, const float* in, float* dense) {
    const TensorStrides s = resolved_strides(t, pr);
    const int64_t heads = tensor_heads(t, pr), rows = tensor_rows(t, pr), d = pr.head_dim;
    const size_t row_bytes = sizeof(float) * static_cast<size_t>(d);
    for (int64_t b = 0; b < tensor_batch(pr); ++b)
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
    for (int64_t b = 0; b < tensor_batch(pr); ++b)
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
// + the offsets of packed sequences, bias, dbias and its fold's scratch, split-KV's partial O and LSE
constexpr int kMaxOwned = kMaxInputs + kMaxOutputs + kMaxScratch + 5 + 2;

template <int N>
int count(const TensorId (&list)[N]) {
    int n = 0;
    while (n < N && list[n] != T_NONE) ++n;
    return n;
}

struct Op {
    int op;            // its pyfa_op, the row's index in kOps
    const char* name;
    TensorId inputs[kMaxInputs];
    TensorId outputs[kMaxOutputs];
    TensorId scratch[kMaxScratch];
    int kernel_count;
    int kernels[kMaxKernels];  // in launch order
};

// One row per pyfa_op, in its order.
const Op kOps[] = {
    {PYFA_OP_FA2_FORWARD, "pyfa_fa2_forward", {T_Q, T_K, T_V}, {T_O, T_LSE}, {}, 1, {PYFA_KERNEL_FA2_FORWARD}},
    {PYFA_OP_FA2_BACKWARD, "pyfa_fa2_backward", {T_Q, T_K, T_V, T_O, T_LSE, T_DO}, {T_DQ, T_DK, T_DV}, {T_D}, 3,
     {PYFA_KERNEL_FA2_BACKWARD_PREPROCESS, PYFA_KERNEL_FA2_BACKWARD_DKDV, PYFA_KERNEL_FA2_BACKWARD_DQ}},
    {PYFA_OP_FA1_FORWARD, "pyfa_fa1_forward", {T_Q, T_K, T_V}, {T_O, T_M, T_L}, {}, 1, {PYFA_KERNEL_FA1_FORWARD}},
    {PYFA_OP_FA1_BACKWARD, "pyfa_fa1_backward", {T_Q, T_K, T_V, T_O, T_M, T_L, T_DO}, {T_DQ, T_DK, T_DV}, {}, 1,
     {PYFA_KERNEL_FA1_BACKWARD}},
};
constexpr int kOpCount = static_cast<int>(sizeof(kOps) / sizeof(kOps[0]));

constexpr int64_t kMaxHeadDim = 256;
// config->threads: each is an OS thread, so the count is bounded as emu_workers is.
constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridYZ = 65535;
// The kernels index every tensor in int64_t and the library sizes it in bytes, so a
// tensor's byte count must fit in int64_t (and so in size_t).
constexpr int64_t kMaxTensorElems = INT64_MAX / static_cast<int64_t>(sizeof(float));

// Every published layout of each struct, as its struct_size: the sizes a caller may
// pass, oldest first, and 0 for the first. Any other size, smaller (it would end inside
// a field) or larger (fields this library does not have), is refused without reading a
// byte past struct_size or past the library's own struct. A field added later goes at the
// end, starting at or after the previous layout's sizeof (never in its tail padding,
// which an older caller leaves unset), and the new sizeof joins the list.
template <class T>
struct Layouts;
template <>
struct Layouts<pyfa_problem> {
    static constexpr size_t sizes[] = {offsetof(pyfa_problem, varlen),      // ABI 3 to 5
                                       offsetof(pyfa_problem, split_size),       // ABI 6: packed sequences, score modifications
                                       offsetof(pyfa_problem, diagonal_offset),  // ABI 7: split_size
                                       offsetof(pyfa_problem, page_size),        // ABI 8 and 9: diagonal_offset
                                       offsetof(pyfa_problem, dropout_origin),   // ABI 10: page_size, num_pages
                                       sizeof(pyfa_problem)};                    // ABI 11: dropout_origin
    static constexpr int first_abi = 3;
};
static_assert(offsetof(pyfa_problem, varlen) == offsetof(pyfa_problem, dv) + sizeof(pyfa_strides),
              "pyfa_problem.varlen, ABI 6's first field, must start where ABI 5's pyfa_problem ended");
static_assert(offsetof(pyfa_problem, page_size) == offsetof(pyfa_problem, diagonal_offset) + sizeof(int64_t),
              "pyfa_problem.page_size must start where ABI 9's pyfa_problem ended");
static_assert(offsetof(pyfa_problem, dropout_origin) == offsetof(pyfa_problem, num_pages) + sizeof(int64_t),
              "pyfa_problem.dropout_origin must start where ABI 10's pyfa_problem ended");
template <>
struct Layouts<pyfa_config> {
    static constexpr size_t sizes[] = {offsetof(pyfa_config, flags),  // ABI 3: up to variant
                                       sizeof(pyfa_config)};          // ABI 4 and 5: flags
    static constexpr int first_abi = 3;
};
template <>
struct Layouts<pyfa_tensors> {
    static constexpr size_t sizes[] = {offsetof(pyfa_tensors, cu_seqlens_q),  // ABI 5
                                       offsetof(pyfa_tensors, seqused_k),     // ABI 6 to 8: cu_seqlens_q, _k, ...
                                       offsetof(pyfa_tensors, block_table),   // ABI 9: seqused_k
                                       offsetof(pyfa_tensors, sinks),         // ABI 10 and 11: block_table
                                       sizeof(pyfa_tensors)};                 // ABI 12: sinks
    static constexpr int first_abi = 5;
};
static_assert(offsetof(pyfa_tensors, cu_seqlens_q) == offsetof(pyfa_tensors, dv) + sizeof(pyfa_tensor),
              "pyfa_tensors.cu_seqlens_q must start where ABI 5's pyfa_tensors ended");
static_assert(offsetof(pyfa_tensors, seqused_k) == offsetof(pyfa_tensors, alibi_slopes) + sizeof(pyfa_tensor),
              "pyfa_tensors.seqused_k must start where ABI 8's pyfa_tensors ended");
static_assert(offsetof(pyfa_tensors, block_table) == offsetof(pyfa_tensors, seqused_k) + sizeof(pyfa_tensor),
              "pyfa_tensors.block_table must start where ABI 9's pyfa_tensors ended");
static_assert(offsetof(pyfa_tensors, sinks) == offsetof(pyfa_tensors, block_table) + sizeof(pyfa_tensor),
              "pyfa_tensors.sinks must start where ABI 11's pyfa_tensors ended");
// ABI 3's pyfa_config ended after variant, padded to the struct's alignment (unchanged by
// flags: emu_seed is a uint64_t too).
static_assert(offsetof(pyfa_config, flags) == (offsetof(pyfa_config, variant) + sizeof(int) + alignof(pyfa_config) - 1) /
                                                  alignof(pyfa_config) * alignof(pyfa_config),
              "pyfa_config.flags must start where ABI 3's pyfa_config ended");

// The caller's struct copied into a zeroed one of this library's layout: struct_size
// bytes of one of the published layouts (0: the first), so a caller of an older layout
// gets zero, "as before", for every later field.
template <class T>
pyfa_status copy_struct(const T* in, const char* field, T* out) {
    *out = T{};
    constexpr size_t n_layouts = sizeof(Layouts<T>::sizes) / sizeof(Layouts<T>::sizes[0]);
    static_assert(Layouts<T>::sizes[n_layouts - 1] == sizeof(T), "the newest layout is this library's struct");
    const uint32_t asked = in->struct_size;
    const size_t size = asked ? asked : Layouts<T>::sizes[0];
    bool known = false;
    for (size_t n = 0; n < n_layouts; ++n) known = known || Layouts<T>::sizes[n] == size;
    if (!known) {
        char list[96] = "0";
        size_t at = 1;
        for (size_t n = 0; n < n_layouts && at < sizeof(list); ++n)
            at += static_cast<size_t>(std::snprintf(list + at, sizeof(list) - at, "%s%zu",
                                                    n + 1 == n_layouts ? " or " : ", ", Layouts<T>::sizes[n]));
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "%s: %u is not the size of a layout this library (ABI %d) knows: %s (0: ABI %d's, sizeof: "
                    "this header's)",
                    field, asked, PYFA_ABI_VERSION, list, Layouts<T>::first_abi);
    }
    std::memcpy(out, in, size);
    out->struct_size = static_cast<uint32_t>(sizeof(T));
    return PYFA_OK;
}

// ---- additive bias (issue 27): tensors->bias, an input of every op, and tensors->dbias,
// an optional output of the backwards. Not TensorIds: bias is (B, H, Nq, Nk) through
// problem->bias_strides as given (0 broadcasts), dbias dense in the bias's shape. The
// kernels write dS per query head, (B, H, Nq or 1, Nk): into dbias itself, or into
// scratch folded over the broadcast B and H afterwards (Backend::fold_dbias).
struct BiasTensors {
    const float* bias = nullptr;
    float* dbias = nullptr;
};

int64_t dbias_rows(const pyfa_problem& pr) { return pr.bias_strides.row ? pr.seqlen_q : 1; }

// The fold of the kernels' dS (part) into dbias (out), its sizes; sum_b or sum_h when the
// bias broadcasts along B (H) and there is more than one.
DbiasFold dbias_fold(const pyfa_problem& pr) {
    DbiasFold f{};
    f.batch = pr.batch;
    f.heads = pr.heads;
    f.rows = dbias_rows(pr);
    f.keys = pr.seqlen_k;
    f.sum_b = pr.bias_strides.batch == 0 && pr.batch > 1;
    f.sum_h = pr.bias_strides.head == 0 && pr.heads > 1;
    return f;
}

// Elements of dS per query head, as the kernels write them, or -1 past int64_t; dbias
// holds as many or fewer.
int64_t dbias_elems(const pyfa_problem& pr) {
    return checked_mul(checked_mul(checked_mul(pr.batch, pr.heads), dbias_rows(pr)), pr.seqlen_k);
}

// Elements from bias's first to one past its last, or -1 past int64_t.
int64_t bias_extent(const pyfa_problem& pr) {
    const pyfa_strides& s = pr.bias_strides;
    int64_t n = checked_add(checked_mul(pr.batch - 1, s.batch), checked_mul(pr.heads - 1, s.head));
    n = n < 0 ? -1 : checked_add(n, checked_mul(pr.seqlen_q - 1, s.row));
    return n < 0 ? -1 : checked_add(n, pr.seqlen_k);
}

ByteLayout bias_layout(const pyfa_problem& pr, bool grad) {
    const int64_t f = static_cast<int64_t>(sizeof(float)), w = pr.seqlen_k * f;
    if (grad) {
        const DbiasFold f = dbias_fold(pr);
        const int64_t b = f.sum_b ? 1 : pr.batch, h = f.sum_h ? 1 : pr.heads;
        return ByteLayout{{h * f.rows * w, f.rows * w, w}, {b, h, f.rows}, w};
    }
    const pyfa_strides& s = pr.bias_strides;
    return ByteLayout{{s.batch * f, s.head * f, s.row * f}, {pr.batch, pr.heads, pr.seqlen_q}, w};
}

pyfa_status check_bias(const Op& op, const pyfa_tensors& named, const pyfa_problem& pr, BiasTensors* out) {
    const struct { const char* name; const pyfa_tensor& t; } given[] = {{"bias", named.bias}, {"dbias", named.dbias}};
    for (const auto& g : given)
        if (!all_zero(g.t.strides))
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "tensors->%s.strides: must be 0 (the bias's strides are problem->bias_strides)", g.name);
    out->bias = static_cast<const float*>(named.bias.data);
    out->dbias = static_cast<float*>(named.dbias.data);
    if (out->dbias && op.op != PYFA_OP_FA2_BACKWARD && op.op != PYFA_OP_FA1_BACKWARD)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->dbias: given, but %s does not take it (leave it zero)",
                    op.name);
    if (out->dbias && !out->bias)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->dbias: given without tensors->bias");
    if (!out->bias) return PYFA_OK;
    const pyfa_strides& s = pr.bias_strides;
    const struct { const char* name; int64_t value; } fields[] = {{"batch", s.batch}, {"head", s.head}, {"row", s.row}};
    for (const auto& f : fields)
        if (f.value < 0)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->bias_strides.%s: must be >= 0 (0 broadcasts), got %lld",
                        f.name, static_cast<long long>(f.value));
    const int64_t extent = bias_extent(pr), grad = dbias_elems(pr);
    if (extent < 0 || extent > kMaxTensorElems || grad < 0 || grad > kMaxTensorElems)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "problem->bias_strides: bias or dbias spans more than 2^61 - 1 elements");
    return PYFA_OK;
}

// dbias shares no byte with any other tensor of the call, input or output: the kernels read
// the inputs while they write it.
pyfa_status check_bias_overlaps(const Op& op, const pyfa_problem& pr, const float* const* inputs,
                                float* const* outputs, const BiasTensors& bt) {
    if (!bt.dbias) return PYFA_OK;
    const ByteLayout lg = bias_layout(pr, true);
    const uintptr_t pg = reinterpret_cast<uintptr_t>(bt.dbias);
    if (rows_meet(lg, pg, bias_layout(pr, false), reinterpret_cast<uintptr_t>(bt.bias)))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "dbias and bias: dbias overlaps another tensor in memory");
    const int n_in = count(op.inputs), n_out = count(op.outputs);
    for (int t = 0; t < n_in + n_out; ++t) {
        const TensorId id = t < n_in ? op.inputs[t] : op.outputs[t - n_in];
        const void* ptr = t < n_in ? static_cast<const void*>(inputs[t]) : outputs[t - n_in];
        if (rows_meet(lg, pg, byte_layout(id, pr), reinterpret_cast<uintptr_t>(ptr)))
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "dbias and %s: dbias overlaps another tensor in memory",
                        kTensors[id].name);
    }
    return PYFA_OK;
}

// Outputs sharing a byte with each other are refused, and with an input too where the
// outputs may be written in place (`in_place`), since a kernel could then read what
// another has written.
pyfa_status check_overlaps(const Op& op, const pyfa_problem& pr, const float* const* inputs,
                           float* const* outputs, bool in_place) {
    const int n_in = count(op.inputs), n_out = count(op.outputs);
    for (int x = 0; x < n_out; ++x) {
        const ByteLayout lx = byte_layout(op.outputs[x], pr);
        const uintptr_t px = reinterpret_cast<uintptr_t>(outputs[x]);
        for (int y = x + 1; y < n_out; ++y)
            if (rows_meet(lx, px, byte_layout(op.outputs[y], pr), reinterpret_cast<uintptr_t>(outputs[y])))
                return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s and %s: the outputs overlap in memory",
                            kTensors[op.outputs[x]].name, kTensors[op.outputs[y]].name);
        for (int y = 0; in_place && y < n_in; ++y)
            if (rows_meet(lx, px, byte_layout(op.inputs[y], pr), reinterpret_cast<uintptr_t>(inputs[y])))
                return fail(PYFA_ERROR_INVALID_ARGUMENT,
                            "%s and %s: the output overlaps the input in memory, which outputs written in place "
                            "(PYFA_FLAG_IN_PLACE, device pointers) must not",
                            kTensors[op.outputs[x]].name, kTensors[op.inputs[y]].name);
    }
    return PYFA_OK;
}

// Dropout's fields (common/dropout.h): p in [0, 1), and rows and keys the 32-bit counter
// words of the keep decision address (b, h, i, and j / 4, each moved by dropout_origin)
// without wrapping.
pyfa_status check_dropout(const pyfa_problem& pr) {
    if (!(pr.dropout_p >= 0.0f && pr.dropout_p < 1.0f))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->dropout_p: must be in [0, 1) (0: no dropout), got %g",
                    static_cast<double>(pr.dropout_p));
    if (pr.dropout_p > 0.0f && (pr.seqlen_q > (int64_t{1} << 32) || pr.seqlen_k > (int64_t{1} << 34)))
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "problem->dropout_p: dropout addresses at most 2^32 query rows and 2^34 keys, got seqlen_q "
                    "%lld, seqlen_k %lld",
                    static_cast<long long>(pr.seqlen_q), static_cast<long long>(pr.seqlen_k));
    const int64_t extent[4] = {pr.batch, pr.heads, pr.seqlen_q, pr.seqlen_k};
    const int64_t most[4] = {int64_t{1} << 32, int64_t{1} << 32, int64_t{1} << 32, int64_t{1} << 34};
    const char* axis[4] = {"B0 + batch <= 2^32", "H0 + heads <= 2^32", "P + seqlen_q <= 2^32",
                           "K + seqlen_k <= 2^34"};
    // Without dropout nothing is addressed: the bounds, which a problem past 2^34 keys
    // would fail whatever the origin, are dropout's.
    for (int a = 0; a < 4; ++a)
        if (pr.dropout_origin[a] < 0 || (pr.dropout_p > 0.0f && pr.dropout_origin[a] > most[a] - extent[a]))
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->dropout_origin[%d]: must be >= 0 with %s, got %lld",
                        a, axis[a], static_cast<long long>(pr.dropout_origin[a]));
    return PYFA_OK;
}

// Checks the caller's problem for an operation taking `tensors` (n of them) and writes
// the library's copy to `out`, with heads_kv resolved from 0.
// A tensor's strides given in pyfa_run's tensors (all zero for the per-op entry points)
// replace the problem's, which must then be zero or the same.
pyfa_status check_problem(const pyfa_problem* in, const TensorId* tensors, int n, const pyfa_tensors& named,
                          pyfa_problem* out) {
    if (!in) return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: null pointer");
    pyfa_status st = copy_struct(in, "problem->struct_size", out);
    if (st != PYFA_OK) return st;
    pyfa_problem* pr = out;
    for (int t = 0; t < n; ++t) {
        const pyfa_strides& given = (named.*kTensors[tensors[t]].named).strides;
        pyfa_strides* s = kTensors[tensors[t]].caller ? &(pr->*kTensors[tensors[t]].caller) : nullptr;
        if (all_zero(given)) continue;
        const char* field = strides_field(tensors[t]);
        if (!s)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "tensors->%s.strides: must be 0 (lse, m and l are always dense), got (%lld, %lld, %lld)",
                        field, static_cast<long long>(given.batch), static_cast<long long>(given.head),
                        static_cast<long long>(given.row));
        if (!all_zero(*s) && (s->batch != given.batch || s->head != given.head || s->row != given.row))
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "tensors->%s.strides: (%lld, %lld, %lld) contradict problem->%s (%lld, %lld, %lld); give "
                        "a tensor's strides in one of the two and leave the other 0",
                        field, static_cast<long long>(given.batch), static_cast<long long>(given.head),
                        static_cast<long long>(given.row), field, static_cast<long long>(s->batch),
                        static_cast<long long>(s->head), static_cast<long long>(s->row));
        *s = given;
    }
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
    // Packed sequences: the tensors' rows (an empty batch has nothing to compute).
    if (pr->varlen && (pr->total_q < 1 || pr->total_k < 1)) {
        const bool q = pr->total_q < 1;
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: must be >= 1 with problem->varlen, got %lld",
                    q ? "problem->total_q" : "problem->total_k",
                    static_cast<long long>(q ? pr->total_q : pr->total_k));
    }
    // Paged K/V: its shape, before anything sizes k and v by it.
    if (pr->page_size < 0 || (pr->page_size > 0 && !pr->varlen))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->page_size: %s, got %lld",
                    pr->page_size < 0 ? "must be >= 1 (0: not paged)"
                                      : "paged K/V takes packed sequences (problem->varlen)",
                    static_cast<long long>(pr->page_size));
    if (pr->page_size == 0 && pr->num_pages != 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->num_pages: must be 0 without problem->page_size, got %lld",
                    static_cast<long long>(pr->num_pages));
    if (pr->page_size > 0) {
        if (pr->num_pages < 1 || checked_mul(pr->num_pages, pr->page_size) < 0 ||
            pr->num_pages * pr->page_size > kMaxTensorElems)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "problem->num_pages: must be >= 1 with num_pages * page_size rows addressable, got %lld",
                        static_cast<long long>(pr->num_pages));
        if (pr->total_k % pr->page_size != 0)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "problem->total_k: must be a multiple of problem->page_size = %lld when paged "
                        "(the logical rows are whole pages), got %lld",
                        static_cast<long long>(pr->page_size), static_cast<long long>(pr->total_k));
    }
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
    if (!(pr->softcap >= 0.0f) || !std::isfinite(pr->softcap))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->softcap: must be finite and > 0 (0 means off), got %g",
                    static_cast<double>(pr->softcap));
    return check_dropout(*pr);
}

// ---- Packed sequences (varlen): the offsets' place in the call, and their checks.
struct SeqOffsets {
    const char* name;                 // as in messages: the pyfa_tensors field
    pyfa_tensor pyfa_tensors::*field;
    int64_t pyfa_problem::*total;     // the rows they must end at
    int64_t pyfa_problem::*longest;   // the bound of every length
    const char* total_name;
    const char* longest_name;
};
const SeqOffsets kSeqOffsets[] = {
    {"cu_seqlens_q", &pyfa_tensors::cu_seqlens_q, &pyfa_problem::total_q, &pyfa_problem::seqlen_q,
     "problem->total_q", "problem->seqlen_q"},
    {"cu_seqlens_k", &pyfa_tensors::cu_seqlens_k, &pyfa_problem::total_k, &pyfa_problem::seqlen_k,
     "problem->total_k", "problem->seqlen_k"},
};

// What can be checked without reading the offsets: given exactly when problem->varlen
// asks for them, without strides (check_problem has checked the totals).
pyfa_status check_varlen(const pyfa_problem& pr, const pyfa_tensors& named) {
    for (const SeqOffsets& o : kSeqOffsets) {
        const pyfa_tensor& t = named.*o.field;
        if (!all_zero(t.strides))
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->%s.strides: must be 0 (the offsets are dense int32)",
                        o.name);
        if (!pr.varlen && t.data)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "tensors->%s: given, but problem->varlen is 0 (a dense batch takes no offsets)", o.name);
        if (pr.varlen && !t.data)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "tensors->%s.data: null pointer, but problem->varlen asks for packed sequences", o.name);
    }
    const pyfa_tensor& used = named.seqused_k;
    if (!all_zero(used.strides))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->seqused_k.strides: must be 0 (the lengths are dense int32)");
    if (used.data && !pr.varlen)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->seqused_k: given, but problem->varlen is 0 (it counts the keys of packed sequences)");
    const pyfa_tensor& table = named.block_table;
    if (!all_zero(table.strides))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->block_table.strides: must be 0 (the table is dense int32)");
    if (table.data && pr.page_size == 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->block_table: given, but problem->page_size is 0 (the table maps pages of that size)");
    if (!table.data && pr.page_size > 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->block_table.data: null pointer, but problem->page_size asks for paged K/V");
    return PYFA_OK;
}

// The offsets themselves, where they are host memory: first 0, monotone, last the total,
// every length at most the bound the grid is sized for.
pyfa_status check_offsets(const pyfa_problem& pr, const pyfa_tensors& named) {
    for (const SeqOffsets& o : kSeqOffsets) {
        const int32_t* cu = static_cast<const int32_t*>((named.*o.field).data);
        if (cu[0] != 0)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->%s[0]: must be 0, got %d", o.name, cu[0]);
        for (int64_t b = 0; b < pr.batch; ++b) {
            const int64_t len = static_cast<int64_t>(cu[b + 1]) - cu[b];
            if (len < 0)
                return fail(PYFA_ERROR_INVALID_ARGUMENT,
                            "tensors->%s[%lld]: %d is below the offset before it (%d); offsets must not decrease",
                            o.name, static_cast<long long>(b + 1), cu[b + 1], cu[b]);
            // With seqused_k the keys a sequence attends to are its counts, bounded below.
            const bool counted = o.field == &pyfa_tensors::cu_seqlens_k && named.seqused_k.data;
            if (len > pr.*o.longest && !counted)
                return fail(PYFA_ERROR_INVALID_ARGUMENT,
                            "tensors->%s: sequence %lld has %lld rows, more than %s = %lld (the longest)", o.name,
                            static_cast<long long>(b), static_cast<long long>(len), o.longest_name,
                            static_cast<long long>(pr.*o.longest));
        }
        if (cu[pr.batch] != pr.*o.total)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->%s[%lld]: must be %s = %lld, got %d", o.name,
                        static_cast<long long>(pr.batch), o.total_name, static_cast<long long>(pr.*o.total),
                        cu[pr.batch]);
    }
    const int32_t* used = static_cast<const int32_t*>(named.seqused_k.data);
    const int32_t* cu_k = static_cast<const int32_t*>(named.cu_seqlens_k.data);
    for (int64_t b = 0; used && b < pr.batch; ++b)
        if (used[b] < 0 || used[b] > cu_k[b + 1] - cu_k[b] || used[b] > pr.seqlen_k)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "tensors->seqused_k[%lld]: must be in [0, %lld] (sequence %lld's keys in cu_seqlens_k, "
                        "and problem->seqlen_k, the longest), got %d",
                        static_cast<long long>(b),
                        static_cast<long long>(std::min<int64_t>(cu_k[b + 1] - cu_k[b], pr.seqlen_k)),
                        static_cast<long long>(b), used[b]);
    const int32_t* table = static_cast<const int32_t*>(named.block_table.data);
    for (int64_t b = 0; table && b < pr.batch; ++b) {
        const int64_t ps = pr.page_size, nk = used ? used[b] : cu_k[b + 1] - cu_k[b];
        if (cu_k[b] % ps != 0)
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "tensors->cu_seqlens_k[%lld]: must be a multiple of problem->page_size = %lld when paged "
                        "(a sequence starts a page), got %d",
                        static_cast<long long>(b), static_cast<long long>(ps), cu_k[b]);
        for (int64_t e = cu_k[b] / ps; e < (cu_k[b] + nk + ps - 1) / ps; ++e)
            if (table[e] < 0 || table[e] >= pr.num_pages)
                return fail(PYFA_ERROR_INVALID_ARGUMENT,
                            "tensors->block_table[%lld]: page %d of sequence %lld is outside [0, problem->num_pages "
                            "= %lld)",
                            static_cast<long long>(e), table[e], static_cast<long long>(b),
                            static_cast<long long>(pr.num_pages));
    }
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
    constexpr uint64_t known_flags = PYFA_FLAG_IN_PLACE | PYFA_FLAG_EMU_STRICT;
    if (cfg->flags & ~known_flags)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->flags: unknown bits 0x%llx",
                    static_cast<unsigned long long>(cfg->flags & ~known_flags));
    return PYFA_OK;
}

// The backend a call runs on; `arg` names the argument in messages. AUTO tries the
// backends in their auto_rank order, and on a *_device entry point takes only a
// device-memory one, never a host-memory one: the pointers are the GPU's.
pyfa_status resolve_backend(int asked, bool device_pointers, const char* arg, const Backend** backend) {
    if (asked == PYFA_BACKEND_AUTO) {
        const Backend* device = nullptr;  // the first device-memory backend AUTO would try
        for (int n = 0; n < backend_count(); ++n) {
            const Backend* b = backend_at(n);
            if (b->auto_rank() == 0) break;
            if (device_pointers && b->memory() != Memory::Device) continue;
            if (!device) device = device_pointers ? b : nullptr;
            if (b->available()) {
                *backend = b;
                return PYFA_OK;
            }
            if (!device_pointers && b->memory() == Memory::Device && !device) device = b;
        }
        if (device_pointers && device)
            return fail(PYFA_ERROR_BACKEND_UNAVAILABLE,
                        "%s: AUTO on a *_device entry point needs %s (device pointers), but %s "
                        "is unavailable: %s",
                        arg, device->label(), device->label(), device->unavailable_reason());
        return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "%s: AUTO found no backend that can run here%s", arg,
                    device_pointers ? " on device pointers" : "");
    }
    const Backend* b = find_backend(asked);
    if (!b) return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: unknown backend %d", arg, asked);
    if (!b->available())
        return fail(PYFA_ERROR_BACKEND_UNAVAILABLE, "%s: %s asked for, but %s", arg, b->label(),
                    b->unavailable_reason());
    *backend = b;
    return PYFA_OK;
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
    const Backend* backend = nullptr;  // whose memory the buffers are; nullptr: the host's
    void* stream = nullptr;
    void* owned[kMaxOwned] = {};
    int count = 0;
    pyfa_status alloc(size_t bytes, float** out) {
        if (count == kMaxOwned) return fail(PYFA_ERROR_INTERNAL, "more than %d buffers in one call", kMaxOwned);
        void* ptr = nullptr;
        if (backend) {
            const pyfa_status st = backend->allocate(&ptr, bytes, stream);
            if (st != PYFA_OK) return st;
        } else if (!(ptr = host_take(bytes ? bytes : 1))) {
            return fail(PYFA_ERROR_OUT_OF_MEMORY, "out of host memory for %zu bytes", bytes);
        }
        owned[count++] = ptr;
        *out = static_cast<float*>(ptr);
        return PYFA_OK;
    }
    // Frees every buffer; the first failure is the status.
    pyfa_status release() {
        pyfa_status first = PYFA_OK;
        for (int n = 0; n < count; ++n) {
            const pyfa_status st = backend ? backend->deallocate(owned[n], stream) : (host_give(owned[n]), PYFA_OK);
            if (first == PYFA_OK) first = st;
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

// config->progress for a backend that is polled per kernel, in kernels: a nonzero return cancels the call.
pyfa_status poll_progress(const pyfa_config& cfg, int64_t done, int64_t total) {
    if (cfg.progress && cfg.progress(cfg.progress_user, done, total) != 0)
        return fail(PYFA_ERROR_CANCELLED, "cancelled by config->progress after %lld of %lld kernels",
                    static_cast<long long>(done), static_cast<long long>(total));
    return PYFA_OK;
}

// `via_run`: called as pyfa_run, whose messages name the tensors' fields; the per-op
// entry points name their arguments.
pyfa_status run_op_unguarded(const Op& op, const pyfa_problem* problem, const pyfa_config* config,
                             const pyfa_tensors* tensors_in, void* stream, bool via_run) {
    const int n_in = count(op.inputs), n_out = count(op.outputs), n_scratch = count(op.scratch);
    TensorId taken[kMaxInputs + kMaxOutputs];
    for (int t = 0; t < n_in; ++t) taken[t] = op.inputs[t];
    for (int t = 0; t < n_out; ++t) taken[n_in + t] = op.outputs[t];
    if (!tensors_in) return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors: null pointer");
    pyfa_tensors named;
    pyfa_status st = copy_struct(tensors_in, "tensors->struct_size", &named);
    if (st != PYFA_OK) return st;
    if (named.memory != PYFA_MEMORY_HOST && named.memory != PYFA_MEMORY_DEVICE)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->memory: must be PYFA_MEMORY_HOST (0) or PYFA_MEMORY_DEVICE (1), got %d", named.memory);
    const bool device_pointers = named.memory == PYFA_MEMORY_DEVICE;
    if (!device_pointers && stream)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "stream: must be NULL for host tensors (host calls work on the library's own stream)");
    for (int t = T_Q; t < kNamedTensors; ++t) {
        const pyfa_tensor& given = named.*kTensors[t].named;
        bool takes = false;
        for (int u = 0; u < n_in + n_out; ++u) takes = takes || taken[u] == t;
        if (!takes && (given.data || !all_zero(given.strides)))
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->%s: given, but %s does not take it (leave it zero)",
                        strides_field(static_cast<TensorId>(t)), op.name);
    }
    pyfa_problem pr;
    if ((st = check_problem(problem, taken, n_in + n_out, named, &pr)) != PYFA_OK) return st;
    if ((st = check_varlen(pr, named)) != PYFA_OK) return st;
    if (named.seqused_k.data && op.op != PYFA_OP_FA2_FORWARD && op.op != PYFA_OP_FA1_FORWARD)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->seqused_k: only the forwards take it; %s does not (the gradient rows of unused "
                    "keys would be left unwritten)",
                    op.name);
    if (pr.page_size > 0 && op.op != PYFA_OP_FA2_FORWARD && op.op != PYFA_OP_FA1_FORWARD)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "problem->page_size: paged K/V is for the forwards; %s does not take it (its dK and dV are "
                    "not paged)",
                    op.name);
    // ALiBi's slopes: (B, H) floats at the given strides.
    const pyfa_tensor& alibi = named.alibi_slopes;
    pyfa_strides alibi_strides = alibi.strides;
    if (all_zero(alibi_strides)) alibi_strides = pyfa_strides{pr.heads, 1, 0};
    if (alibi.data && (alibi_strides.batch < 0 || alibi_strides.head < 0 || alibi_strides.row != 0))
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->alibi_slopes.strides: batch and head must be >= 0 and row 0, got (%lld, %lld, %lld)",
                    static_cast<long long>(alibi_strides.batch), static_cast<long long>(alibi_strides.head),
                    static_cast<long long>(alibi_strides.row));
    if (!alibi.data && !all_zero(alibi.strides))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->alibi_slopes.strides: given without data");
    if (reinterpret_cast<uintptr_t>(alibi.data) % alignof(float) != 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->alibi_slopes.data: not aligned to a float (%zu bytes)",
                    alignof(float));
    // One past the last slope read, in elements; exact, or -1 past int64_t. Bounded as every
    // tensor's span is, so that the index each kernel forms (b * batch + h * head) fits.
    const int64_t alibi_extent = checked_add(
        checked_add(checked_mul(pr.batch - 1, alibi_strides.batch), checked_mul(pr.heads - 1, alibi_strides.head)),
        1);
    if (alibi.data && (alibi_extent < 0 || alibi_extent > kMaxTensorElems))
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->alibi_slopes.strides: the strides (%lld, %lld, 0) span more than 2^61 - 1 elements",
                    static_cast<long long>(alibi_strides.batch), static_cast<long long>(alibi_strides.head));
    // Attention sinks: (H) floats, read by the FA2 forward's last step only.
    const pyfa_tensor& sinks = named.sinks;
    if (!all_zero(sinks.strides))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->sinks.strides: must be 0 (the sinks are dense (heads,))");
    if (sinks.data && op.op != PYFA_OP_FA2_FORWARD)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "tensors->sinks: only pyfa_fa2_forward takes them; %s does not (a backward takes the forward's "
                    "merged o and lse and needs none)",
                    op.name);
    if (reinterpret_cast<uintptr_t>(sinks.data) % alignof(float) != 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->sinks.data: not aligned to a float (%zu bytes)",
                    alignof(float));
    if (pr.split_size < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->split_size: must be >= 0 (0: no split), got %lld",
                    static_cast<long long>(pr.split_size));
    if (pr.split_size > 0 && op.op != PYFA_OP_FA2_FORWARD && op.op != PYFA_OP_FA2_BACKWARD)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "problem->split_size: only pyfa_fa2_forward and pyfa_fa2_backward split; %s takes 0, got %lld",
                    op.name, static_cast<long long>(pr.split_size));
    constexpr int64_t kMaxDiagonalOffset = int64_t{1} << 40;
    if (pr.diagonal_offset < -kMaxDiagonalOffset || pr.diagonal_offset > kMaxDiagonalOffset)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->diagonal_offset: must be in [-2^40, 2^40], got %lld",
                    static_cast<long long>(pr.diagonal_offset));
    pyfa_config cfg;
    if ((st = check_config(config, &cfg)) != PYFA_OK) return st;
    BiasTensors bt;
    if ((st = check_bias(op, named, pr, &bt)) != PYFA_OK) return st;
    const float* inputs[kMaxInputs] = {};
    float* outputs[kMaxOutputs] = {};
    for (int t = 0; t < n_in + n_out; ++t) {
        float* data = static_cast<float*>((named.*kTensors[taken[t]].named).data);
        if (!data && via_run)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->%s.data: null pointer, but %s %s it",
                        strides_field(taken[t]), op.name, t < n_in ? "reads" : "writes");
        if (!data) return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: null pointer", kTensors[taken[t]].name);
        // A float the kernels load is a float's width apart from the next: a pointer off
        // that grid is no float array (and misaligned loads are undefined behaviour).
        if (reinterpret_cast<uintptr_t>(data) % alignof(float) != 0 && via_run)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "tensors->%s.data: not aligned to a float (%zu bytes)",
                        strides_field(taken[t]), alignof(float));
        if (reinterpret_cast<uintptr_t>(data) % alignof(float) != 0)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: not aligned to a float (%zu bytes)",
                        kTensors[taken[t]].name, alignof(float));
        if (t < n_in)
            inputs[t] = data;
        else
            outputs[t - n_in] = data;
    }
    if (cfg.emu_order < PYFA_EMU_ORDER_FORWARD || cfg.emu_order > PYFA_EMU_ORDER_SHUFFLED)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->emu_order: unknown order %d", cfg.emu_order);
    if (cfg.emu_workers < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->emu_workers: must be >= 0, got %d", cfg.emu_workers);
    if (cfg.threads < 0 || cfg.threads > kMaxThreads)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->threads: expected 0 (one per core) to %d, got %d",
                    kMaxThreads, cfg.threads);

    const Backend* be = nullptr;
    if ((st = resolve_backend(cfg.backend, device_pointers, "config->backend", &be)) != PYFA_OK) return st;
    const Backend& backend = *be;
    // A *_device call runs on the device that owns q, made current here (profile, tiles
    // and launches below all follow it) and put back when the call returns.
    DeviceScope device_scope;
    if (device_pointers) {
        const char* names[kMaxInputs + kMaxOutputs + 4];
        const void* pointers[kMaxInputs + kMaxOutputs + 4];
        int n = 0;
        for (int t = 0; t < n_in + n_out; ++t, ++n) {
            names[t] = kTensors[taken[t]].name;
            pointers[t] = t < n_in ? static_cast<const void*>(inputs[t]) : outputs[t - n_in];
        }
        if (bt.bias) names[n] = "bias", pointers[n++] = bt.bias;
        if (bt.dbias) names[n] = "dbias", pointers[n++] = bt.dbias;
        if (alibi.data) names[n] = "alibi_slopes", pointers[n++] = alibi.data;
        if (sinks.data) names[n] = "sinks", pointers[n++] = sinks.data;
        if ((st = backend.enter_device(names, pointers, n, stream, &device_scope)) != PYFA_OK) return st;
    }
    pyfa_device_profile profile;
    if ((st = backend.profile(&profile)) != PYFA_OK) return st;
    // Offsets the host can read (host pointers, or a host-memory backend's) are checked
    // here; a device-memory backend's device pointers cannot be (pyfa.h).
    if (pr.varlen && (!device_pointers || backend.memory() != Memory::Device) &&
        (st = check_offsets(pr, named)) != PYFA_OK)
        return st;

    AttentionParams base{};
    base.batch = pr.batch;
    base.heads = pr.heads;
    base.heads_kv = pr.heads_kv;
    base.seqlen_q = pr.seqlen_q;
    base.seqlen_k = pr.seqlen_k;
    base.head_dim = pr.head_dim;
    base.scale = pr.scale != 0.0f ? pr.scale : 1.0f / std::sqrt(static_cast<float>(pr.head_dim));
    base.split_size = pr.split_size;  // the fast FA2 forward does not split: select_kernel
    base.mask = make_mask(pr.causal, pr.window, pr.window_left, pr.window_right, pr.causal_align, pr.seqlen_q,
                          pr.seqlen_k, pr.diagonal_offset);
    if (pr.varlen) {
        base.cu_seqlens_q = static_cast<const int32_t*>(named.cu_seqlens_q.data);
        base.cu_seqlens_k = static_cast<const int32_t*>(named.cu_seqlens_k.data);
        base.seqused_k = static_cast<const int32_t*>(named.seqused_k.data);
        base.block_table = static_cast<const int32_t*>(named.block_table.data);
        base.page_size = pr.page_size;
        base.num_pages = pr.num_pages;
        base.total_q = pr.total_q;
        base.causal_align = pr.causal_align;
    }
    base.softcap = pr.softcap;
    base.alibi_slopes = static_cast<const float*>(alibi.data);
    base.alibi_strides = TensorStrides{alibi_strides.batch, alibi_strides.head, 0};
    base.sinks = static_cast<const float*>(sinks.data);
    for (int t = 0; t < n_in + n_out; ++t)
        if (TensorStrides* slot = strides_slot(base, taken[t])) *slot = resolved_strides(taken[t], pr);
    base.dropout = Dropout::make(pr.dropout_p, pr.dropout_seed, pr.dropout_offset, pr.dropout_origin);
    base.bias = bt.bias;
    base.dbias = bt.dbias;
    if (bt.bias) base.bias_strides = TensorStrides{pr.bias_strides.batch, pr.bias_strides.head, pr.bias_strides.row};

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
    if ((st = backend.supports(op.op, base, cfg)) != PYFA_OK) return st;
    for (int n = 0; n < op.kernel_count; ++n) {
        const int kernel = op.kernels[n];
        AttentionParams p = base;
        int id = kernel;
        // A backend with kernels of its own runs the readable kernels' tiles: the
        // variants choose among the table's kernels.
        if (backend.runs_table_kernels() &&
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
        if ((st = backend.check_launch(id, shapes[n])) != PYFA_OK) return st;
    }
    // Split backward: each kernel walks the chunks itself, in one launch; the chunks are
    // whole numbers of the dQ kernel's K/V tiles and of the dK/dV kernel's Q tiles.
    if (pr.split_size > 0 && op.op == PYFA_OP_FA2_BACKWARD) {
        for (int n = 0; n < op.kernel_count; ++n) {
            const bool dq = op.kernels[n] == PYFA_KERNEL_FA2_BACKWARD_DQ;
            if (!dq && op.kernels[n] != PYFA_KERNEL_FA2_BACKWARD_DKDV) continue;
            const int tile = dq ? tiles[n][1] : tiles[n][0];
            if (pr.split_size % tile != 0)
                return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->split_size: must be a multiple of %s's %s = %d, got %lld",
                            kernel_name(ids[n]), dq ? "Bc" : "Br", tile, static_cast<long long>(pr.split_size));
        }
    }
    // Split-KV: chunks of split_size keys, each a whole number of the kernel's K/V tiles.
    // (seqlen_k - 1) / split_size + 1, not ceil_div: a + b - 1 overflows for a split_size near 2^63.
    const int64_t split_chunks = pr.split_size > 0 && op.op == PYFA_OP_FA2_FORWARD && pr.seqlen_k > 0
                                     ? (pr.seqlen_k - 1) / pr.split_size + 1
                                     : 0;
    if (split_chunks > 0 && pr.split_size % tiles[0][1] != 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "problem->split_size: must be a multiple of %s's Bc = %d, got %lld", kernel_name(ids[0]),
                    tiles[0][1], static_cast<long long>(pr.split_size));
    if (split_chunks > 0 && (checked_mul(split_chunks, tensor_elems(T_O, pr)) < 0 ||
                             checked_mul(split_chunks, tensor_elems(T_O, pr)) > kMaxTensorElems))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem->split_size: %lld chunks of O do not fit in memory",
                    static_cast<long long>(split_chunks));

    // GQA packing of the readable FA2 forward's blocks (params.h pack_gqa), where its grid
    // x still holds the packed tiles; the combine launch of a split forward keeps one
    // query head per block. (pyfa/sim/tiles.py fa2_launch decides both of these alike.)
    const bool readable_fa2_forward =
        op.op == PYFA_OP_FA2_FORWARD && backend.runs_table_kernels() && ids[0] == PYFA_KERNEL_FA2_FORWARD;
    if (readable_fa2_forward && ceil_div(base.seqlen_q * (base.heads / base.heads_kv), tiles[0][0]) <= kMaxGridX &&
        pack_gqa(base.batch, base.heads, base.heads_kv, base.seqlen_q, tiles[0][0], split_chunks, profile.sm_count))
        base.pack_gqa = 1;
    // A decoding step's rows fill a few of a default Q tile's 64: where the caller left Br
    // to the default, the readable FA2 forward takes the rows its blocks hold, rounded up
    // to 8, so that its smaller shared memory lets more blocks share an SM (at d = 128,
    // 64 x 64 tiles leave room for one). Br changes no bit of the FA2 forward
    // (docs/numerics.md) and no byte it moves: each block's rows are one Q tile either way.
    const int64_t block_rows = base.seqlen_q * base.packed_heads();
    const bool few_rows = readable_fa2_forward && cfg.block_r == 0 && block_rows < tiles[0][0];
    if (few_rows) tiles[0][0] = static_cast<int>(min64(tiles[0][0], max64(8, ceil_div(block_rows, 8) * 8)));
    if (base.pack_gqa || few_rows) {
        AttentionParams p = base;
        p.block_r = tiles[0][0];
        p.block_c = tiles[0][1];
        shapes[0] = launch_shape(ids[0], p);
        if ((st = backend.check_launch(ids[0], shapes[0])) != PYFA_OK) return st;
    }

    // Last of the argument checks, so that the others are reported first.
    const bool in_place = device_pointers || (cfg.flags & PYFA_FLAG_IN_PLACE);
    if ((st = check_overlaps(op, pr, inputs, outputs, in_place)) != PYFA_OK) return st;
    for (int x = 0; in_place && pr.varlen && x < n_out; ++x)
        for (const SeqOffsets& o : kSeqOffsets) {
            const ByteLayout offsets{{0, 0, 4}, {1, 1, pr.batch + 1}, 4};
            if (rows_meet(byte_layout(op.outputs[x], pr), reinterpret_cast<uintptr_t>(outputs[x]), offsets,
                          reinterpret_cast<uintptr_t>((named.*o.field).data)))
                return fail(PYFA_ERROR_INVALID_ARGUMENT,
                            "%s and %s: the output overlaps the input in memory, which outputs written in place "
                            "(PYFA_FLAG_IN_PLACE, device pointers) must not",
                            kTensors[op.outputs[x]].name, o.name);
        }
    if ((st = check_bias_overlaps(op, pr, inputs, outputs, bt)) != PYFA_OK) return st;

    // On a device-memory backend the host entry points work on the library's own stream.
    const bool device_backend = backend.memory() == Memory::Device;
    if (device_backend && !device_pointers && (st = backend.library_stream(&stream)) != PYFA_OK) return st;

    // Bind tensors. Inputs: their whole span (as the strides lay it out) copied over for a
    // host entry point on a device-memory backend, else read in place. Outputs: staged
    // dense in owned buffers, copied to the caller's once the call has succeeded, unless
    // written in place: device memory (a *_device entry point on a device-memory backend,
    // where the stream orders everything and the kernels write the caller's strides
    // directly), or host memory the caller lets a host backend write (PYFA_FLAG_IN_PLACE;
    // a dense_only backend: dense outputs only).
    Scratch owned;
    owned.backend = &backend;
    owned.stream = stream;
    Scratch host_owned;  // host bounce buffers of strided outputs coming back from the device
    AttentionParams bound = base;
    const bool stage_inputs = !device_pointers && device_backend;
    const bool dense_only = backend.dense_only();
    const bool strided_kv = backend.forwards_read_strided_kv() &&
                            (op.op == PYFA_OP_FA2_FORWARD || op.op == PYFA_OP_FA1_FORWARD);
    const bool host_in_place = !device_backend && (cfg.flags & PYFA_FLAG_IN_PLACE);
    bool staged[kMaxOutputs] = {};
    bool any_staged = false;
    for (int t = 0; t < n_in; ++t) {
        float*& slot = param_slot(bound, op.inputs[t]);
        slot = const_cast<float*>(inputs[t]);
        if (stage_inputs) {
            const size_t bytes = sizeof(float) * static_cast<size_t>(tensor_extent(op.inputs[t], pr));
            if ((st = owned.alloc(bytes, &slot)) != PYFA_OK) return st;
            if ((st = backend.copy_to_device(slot, inputs[t], bytes, stream)) != PYFA_OK) return st;
        } else if (dense_only && !kTensors[op.inputs[t]].per_row && !is_dense(op.inputs[t], pr) &&
                   !(strided_kv && (op.inputs[t] == T_K || op.inputs[t] == T_V))) {
            if ((st = owned.alloc(tensor_bytes(op.inputs[t], pr), &slot)) != PYFA_OK) return st;
            gather_rows(op.inputs[t], pr, inputs[t], slot);
            *strides_slot(bound, op.inputs[t]) = dense_strides(op.inputs[t], pr);
        }
    }
    // The offsets go to the device as the inputs do.
    if (stage_inputs && pr.varlen) {
        const int32_t** cu[] = {&bound.cu_seqlens_q, &bound.cu_seqlens_k, &bound.seqused_k, &bound.block_table};
        const int64_t count[] = {pr.batch + 1, pr.batch + 1, pr.batch, pr.page_size ? pr.total_k / pr.page_size : 0};
        for (int n = 0; n < 4; ++n) {
            if (!*cu[n]) continue;
            const size_t bytes = sizeof(int32_t) * static_cast<size_t>(count[n]);
            float* copy = nullptr;
            if ((st = owned.alloc(bytes, &copy)) != PYFA_OK) return st;
            if ((st = backend.copy_to_device(copy, *cu[n], bytes, stream)) != PYFA_OK) return st;
            *cu[n] = reinterpret_cast<const int32_t*>(copy);
        }
    }
    for (int t = 0; t < n_out; ++t) {
        float*& slot = param_slot(bound, op.outputs[t]);
        slot = outputs[t];
        staged[t] = device_backend
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
    // The bias travels as the inputs do (its span), dbias is staged as the outputs are;
    // the kernels write into it, or into scratch of the backend's that is then folded.
    DbiasFold fold = dbias_fold(pr);
    const bool folds = bt.dbias && (fold.sum_b || fold.sum_h);
    const size_t dbias_bytes = bt.dbias ? sizeof(float) * static_cast<size_t>(fold.elems()) : 0;
    const bool dbias_staged = bt.dbias && (device_backend ? !device_pointers : !host_in_place);
    if (bt.bias && stage_inputs) {
        const size_t bytes = sizeof(float) * static_cast<size_t>(bias_extent(pr));
        float* slot = nullptr;
        if ((st = owned.alloc(bytes, &slot)) != PYFA_OK) return st;
        if ((st = backend.copy_to_device(slot, bt.bias, bytes, stream)) != PYFA_OK) return st;
        bound.bias = slot;
    }
    if (dbias_staged && (st = owned.alloc(dbias_bytes, &bound.dbias)) != PYFA_OK) return st;
    any_staged = any_staged || dbias_staged;
    float* const dbias_written = bound.dbias;  // the caller's dbias, or its staging buffer
    if (folds) {
        fold.out = dbias_written;
        float* part = nullptr;
        if ((st = owned.alloc(sizeof(float) * static_cast<size_t>(dbias_elems(pr)), &part)) != PYFA_OK) return st;
        fold.part = bound.dbias = part;
    }
    // Packed sequences: the kernels of sequence b write dS_b into its rows (all Nq of the
    // grid: dbias_clear) of its keys' tiles only; the keys from Nk_b to the grid's Nk
    // start at +0 here, as a dense call's hidden keys end.
    std::vector<float> dbias_zeros;
    if (bt.dbias && pr.varlen) {
        dbias_zeros.assign(static_cast<size_t>(dbias_elems(pr)), 0.0f);
        if ((st = backend.copy_to_device(bound.dbias, dbias_zeros.data(), sizeof(float) * dbias_zeros.size(),
                                         stream)) != PYFA_OK)
            return st;
    }
    if (bound.alibi_slopes && stage_inputs) {
        float* slopes = nullptr;
        const size_t bytes = sizeof(float) * static_cast<size_t>(alibi_extent);
        if ((st = owned.alloc(bytes, &slopes)) != PYFA_OK) return st;
        if ((st = backend.copy_to_device(slopes, bound.alibi_slopes, bytes, stream)) != PYFA_OK) return st;
        bound.alibi_slopes = slopes;
    }
    if (bound.sinks && stage_inputs) {
        float* sinks_copy = nullptr;
        const size_t bytes = sizeof(float) * static_cast<size_t>(pr.heads);
        if ((st = owned.alloc(bytes, &sinks_copy)) != PYFA_OK) return st;
        if ((st = backend.copy_to_device(sinks_copy, bound.sinks, bytes, stream)) != PYFA_OK) return st;
        bound.sinks = sinks_copy;
    }
    // Split-KV's launches: the forward kernel over the chunks, their partial (O, LSE) in
    // scratch laid out as the library's own copies, then its combine launch (params.h).
    float* o_part = nullptr;
    float* lse_part = nullptr;
    const int64_t o_step = tensor_elems(T_O, pr), lse_step = tensor_elems(T_LSE, pr);
    if (split_chunks > 0) {
        if ((st = owned.alloc(tensor_bytes(T_O, pr) * static_cast<size_t>(split_chunks), &o_part)) != PYFA_OK)
            return st;
        if ((st = owned.alloc(tensor_bytes(T_LSE, pr) * static_cast<size_t>(split_chunks), &lse_part)) != PYFA_OK)
            return st;
    }
    // Launch n of the call's launches: the op's kernels, or the split forward's chunks
    // (`per` a launch: all of them in one grid of Tr x chunks blocks along x, as many as
    // that axis holds, or one each for a backend that runs the whole op) and its combine.
    const int64_t Tr = std::max<int64_t>(1, ceil_div(bound.seqlen_q * bound.packed_heads(), tiles[0][0]));  // chunk_block's (params.h)
    const int64_t per = split_chunks == 0 || backend.runs_whole_op()
                            ? 1
                            : std::max<int64_t>(1, std::min<int64_t>(split_chunks, kMaxGridX / Tr));
    const int64_t chunk_launches = split_chunks > 0 ? ceil_div(split_chunks, per) : 0;
    const int64_t launches = split_chunks > 0 ? chunk_launches + 1 : op.kernel_count;
    auto launch_params = [&](int64_t n, int* kernel_n) {
        const int k = split_chunks > 0 ? 0 : static_cast<int>(n);
        *kernel_n = k;
        AttentionParams p = bound;
        p.block_r = tiles[k][0];
        p.block_c = tiles[k][1];
        if (split_chunks == 0) return p;
        p.split_size = pr.split_size;
        p.o_part_step = o_step;
        p.lse_part_step = lse_step;
        if (n < chunk_launches) {
            p.split_index = n * per;
            p.split_launch_chunks = per > 1 ? std::min(per, split_chunks - p.split_index) : 0;
            p.o = o_part + p.split_index * o_step;
            p.o_strides = dense_strides(T_O, pr);
            p.lse = lse_part + p.split_index * lse_step;
        } else {
            p.pack_gqa = 0;
            p.split_count = split_chunks;
            p.o_part = o_part;
            p.lse_part = lse_part;
            p.o_part_strides = dense_strides(T_O, pr);
        }
        return p;
    };

    // A backend polled per kernel is asked before each launch. On the library's stream
    // (host entry points) the dispatcher first waits for the kernels already launched, so
    // that `done` counts finished kernels and a cancel takes effect between them. Work
    // enqueued on the caller's stream cannot be taken back, so a *_device call asks once,
    // before any launch.
    const bool polls = backend.polls_progress_per_kernel() && cfg.progress;
    if (backend.runs_whole_op() && split_chunks > 0) {
        std::vector<AttentionParams> all;  // the chunks, then the combine
        all.reserve(static_cast<size_t>(launches));
        for (int64_t n = 0; n < launches; ++n) {
            int k = 0;
            all.push_back(launch_params(n, &k));
        }
        if ((st = backend.run_op(op.op, all.data(), all.size(), cfg)) != PYFA_OK) return st;
    } else if (backend.runs_whole_op()) {
        AttentionParams tiled[kMaxKernels];
        for (int n = 0; n < op.kernel_count; ++n) {
            tiled[n] = bound;
            tiled[n].block_r = tiles[n][0];
            tiled[n].block_c = tiles[n][1];
        }
        if ((st = backend.run_op(op.op, tiled, static_cast<size_t>(op.kernel_count), cfg)) != PYFA_OK) return st;
    } else {
        for (int64_t n = 0; n < launches; ++n) {
            if (polls && (n == 0 || !device_pointers)) {
                if (n > 0 && (st = backend.synchronize(stream)) != PYFA_OK) return st;
                if ((st = poll_progress(cfg, n, launches)) != PYFA_OK) return st;
            }
            int k = 0;
            const AttentionParams p = launch_params(n, &k);
            LaunchShape shape = p.split_count > 0 ? launch_shape(ids[k], p) : shapes[k];
            if (p.split_launch_chunks > 1) shape.grid[0] *= static_cast<unsigned>(p.split_launch_chunks);
            if ((st = backend.launch(ids[k], p, shape, cfg, stream)) != PYFA_OK) return st;
        }
    }
    if (folds && (st = backend.fold_dbias(fold, stream)) != PYFA_OK) return st;

    if (!any_staged) return owned.release();
    if (device_backend) {
        if ((st = backend.synchronize(stream)) != PYFA_OK) return st;
        if (polls && (st = poll_progress(cfg, launches, launches)) != PYFA_OK) return st;
    }
    // Strided outputs come back from the GPU into host bounce buffers, allocated before
    // the first caller's byte is written, then go to the caller row by row.
    const float* dense_out[kMaxOutputs] = {};
    for (int t = 0; t < n_out; ++t) {
        const TensorId id = op.outputs[t];
        dense_out[t] = param_slot(bound, id);
        if (!staged[t] || !device_backend || is_dense(id, pr)) continue;
        float* bounce = nullptr;
        if ((st = host_owned.alloc(tensor_bytes(id, pr), &bounce)) != PYFA_OK) return st;
        if ((st = backend.copy_to_host(bounce, dense_out[t], tensor_bytes(id, pr), stream)) != PYFA_OK) return st;
        dense_out[t] = bounce;
    }
    if (device_backend && (st = backend.synchronize(stream)) != PYFA_OK) return st;
    for (int t = 0; t < n_out; ++t) {
        const TensorId id = op.outputs[t];
        if (!staged[t]) continue;
        if (device_backend && is_dense(id, pr)) {
            if ((st = backend.copy_to_host(outputs[t], dense_out[t], tensor_bytes(id, pr), stream)) != PYFA_OK)
                return st;
        } else {
            scatter_rows(id, pr, dense_out[t], outputs[t]);
        }
    }
    if (dbias_staged) {
        if (device_backend) {
            if ((st = backend.copy_to_host(bt.dbias, dbias_written, dbias_bytes, stream)) != PYFA_OK) return st;
        } else {
            std::memcpy(bt.dbias, dbias_written, dbias_bytes);
        }
    }
    if (device_backend && (st = backend.synchronize(stream)) != PYFA_OK) return st;
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

// A per-op entry point: its pointers become pyfa_run's tensors, with the strides left
// to the problem.
pyfa_status run_op(int op_id, const pyfa_problem* problem, const pyfa_config* config,
                   const float* const* inputs, float* const* outputs, bool device_pointers,
                   void* stream) noexcept {
    clear_error();
    const Op& op = kOps[op_id];
    return guarded(op.name, [&] {
        pyfa_tensors named{};
        named.struct_size = sizeof(named);
        named.memory = device_pointers ? PYFA_MEMORY_DEVICE : PYFA_MEMORY_HOST;
        for (int t = 0; t < count(op.inputs); ++t)
            (named.*kTensors[op.inputs[t]].named).data = const_cast<float*>(inputs[t]);
        for (int t = 0; t < count(op.outputs); ++t) (named.*kTensors[op.outputs[t]].named).data = outputs[t];
        return run_op_unguarded(op, problem, config, &named, stream, false);
    });
}

pyfa_status device_profile_get(int backend, pyfa_device_profile* profile) {
    if (!profile) return fail(PYFA_ERROR_INVALID_ARGUMENT, "profile: null pointer");
    const Backend* resolved = nullptr;
    const pyfa_status st = resolve_backend(backend, false, "backend", &resolved);
    if (st != PYFA_OK) return st;
    return resolved->profile(profile);
}

// The keep decisions Z[b, h, i, j] of the problem's dropout, by the function the kernels
// call (common/dropout.h).
pyfa_status dropout_mask(const pyfa_problem* problem, uint8_t* keep) {
    if (!problem) return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: null pointer");
    pyfa_problem pr;
    pyfa_status st = copy_struct(problem, "problem->struct_size", &pr);
    if (st != PYFA_OK) return st;
    const struct { const char* name; int64_t value; } dims[] = {
        {"problem->batch", pr.batch}, {"problem->heads", pr.heads},
        {"problem->seqlen_q", pr.seqlen_q}, {"problem->seqlen_k", pr.seqlen_k}};
    for (const auto& dim : dims)
        if (dim.value < 1)
            return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: must be >= 1, got %lld", dim.name,
                        static_cast<long long>(dim.value));
    if (pr.batch > kMaxGridYZ || pr.heads > kMaxGridYZ) {
        const bool b = pr.batch > kMaxGridYZ;
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "%s: at most 65535 (a grid dimension), got %lld",
                    b ? "problem->batch" : "problem->heads", static_cast<long long>(b ? pr.batch : pr.heads));
    }
    if ((st = check_dropout(pr)) != PYFA_OK) return st;
    if (pr.seqlen_q > INT64_MAX / pr.seqlen_k / (pr.batch * pr.heads))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "problem: B*H*Nq*Nk elements of keep exceed 2^63 - 1");
    if (!keep) return fail(PYFA_ERROR_INVALID_ARGUMENT, "keep: null pointer");
    const Dropout d = Dropout::make(pr.dropout_p, pr.dropout_seed, pr.dropout_offset, pr.dropout_origin);
    uint8_t* out = keep;
    for (int64_t b = 0; b < pr.batch; ++b)
        for (int64_t h = 0; h < pr.heads; ++h)
            for (int64_t i = 0; i < pr.seqlen_q; ++i)
                for (int64_t j = 0; j < pr.seqlen_k; ++j) *out++ = d.keep(b, h, i, j) ? 1 : 0;
    return PYFA_OK;
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
        // Named, a backend with kernels of its own has no fast tiles (as a run refuses the
        // variant there); AUTO answers for the kernel table, whichever backend runs it.
        const Backend* named = backend == PYFA_BACKEND_AUTO ? nullptr : find_backend(backend);
        if (variant == PYFA_VARIANT_FAST && named && !named->runs_table_kernels())
            return fail(PYFA_ERROR_INVALID_ARGUMENT,
                        "variant: fast: %s has kernels of its own; PYFA_VARIANT_FAST names the emulator's and "
                        "CUDA's register-tiled ones",
                        named->label());
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
        if (backend == PYFA_BACKEND_AUTO) return 1;
        const Backend* b = find_backend(backend);
        return b && b->available() ? 1 : 0;
    });
}

PYFA_API int pyfa_backend_compiled(int backend) {
    return guarded_value("pyfa_backend_compiled", 0, [&] {
        const Backend* b = find_backend(backend);
        return b && b->compiled() ? 1 : 0;
    });
}

PYFA_API const char* pyfa_backend_reason(int backend) {
    return guarded_value<const char*>("pyfa_backend_reason", "the reason could not be determined", [&] {
        if (backend == PYFA_BACKEND_AUTO) return "";
        const Backend* b = find_backend(backend);
        return b ? b->unavailable_reason() : "unknown backend";
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

PYFA_API pyfa_status pyfa_run(int op, const pyfa_problem* problem, const pyfa_config* config,
                              const pyfa_tensors* tensors, void* stream) {
    clear_error();
    if (op < 0 || op >= kOpCount)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "op: unknown op %d (a pyfa_op, 0 to %d)", op, kOpCount - 1);
    return guarded(kOps[op].name,
                   [&] { return run_op_unguarded(kOps[op], problem, config, tensors, stream, true); });
}

PYFA_API pyfa_status pyfa_fa2_forward(const pyfa_problem* problem, const pyfa_config* config,
                                      const float* q, const float* k, const float* v, float* o, float* lse) {
    const float* in[] = {q, k, v};
    float* out[] = {o, lse};
    return run_op(PYFA_OP_FA2_FORWARD, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa2_forward_device(const pyfa_problem* problem, const pyfa_config* config,
                                             const float* q, const float* k, const float* v, float* o,
                                             float* lse, void* stream) {
    const float* in[] = {q, k, v};
    float* out[] = {o, lse};
    return run_op(PYFA_OP_FA2_FORWARD, problem, config, in, out, true, stream);
}

PYFA_API pyfa_status pyfa_fa2_backward(const pyfa_problem* problem, const pyfa_config* config,
                                       const float* q, const float* k, const float* v, const float* o,
                                       const float* lse, const float* dout, float* dq, float* dk,
                                       float* dv) {
    const float* in[] = {q, k, v, o, lse, dout};
    float* out[] = {dq, dk, dv};
    return run_op(PYFA_OP_FA2_BACKWARD, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa2_backward_device(const pyfa_problem* problem, const pyfa_config* config,
                                              const float* q, const float* k, const float* v,
                                              const float* o, const float* lse, const float* dout,
                                              float* dq, float* dk, float* dv, void* stream) {
    const float* in[] = {q, k, v, o, lse, dout};
    float* out[] = {dq, dk, dv};
    return run_op(PYFA_OP_FA2_BACKWARD, problem, config, in, out, true, stream);
}

PYFA_API pyfa_status pyfa_fa1_forward(const pyfa_problem* problem, const pyfa_config* config,
                                      const float* q, const float* k, const float* v, float* o, float* m,
                                      float* l) {
    const float* in[] = {q, k, v};
    float* out[] = {o, m, l};
    return run_op(PYFA_OP_FA1_FORWARD, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa1_forward_device(const pyfa_problem* problem, const pyfa_config* config,
                                             const float* q, const float* k, const float* v, float* o,
                                             float* m, float* l, void* stream) {
    const float* in[] = {q, k, v};
    float* out[] = {o, m, l};
    return run_op(PYFA_OP_FA1_FORWARD, problem, config, in, out, true, stream);
}

PYFA_API pyfa_status pyfa_fa1_backward(const pyfa_problem* problem, const pyfa_config* config,
                                       const float* q, const float* k, const float* v, const float* o,
                                       const float* m, const float* l, const float* dout, float* dq,
                                       float* dk, float* dv) {
    const float* in[] = {q, k, v, o, m, l, dout};
    float* out[] = {dq, dk, dv};
    return run_op(PYFA_OP_FA1_BACKWARD, problem, config, in, out, false, nullptr);
}

PYFA_API pyfa_status pyfa_fa1_backward_device(const pyfa_problem* problem, const pyfa_config* config,
                                              const float* q, const float* k, const float* v,
                                              const float* o, const float* m, const float* l,
                                              const float* dout, float* dq, float* dk, float* dv,
                                              void* stream) {
    const float* in[] = {q, k, v, o, m, l, dout};
    float* out[] = {dq, dk, dv};
    return run_op(PYFA_OP_FA1_BACKWARD, problem, config, in, out, true, stream);
}

PYFA_API pyfa_status pyfa_dropout_mask(const pyfa_problem* problem, uint8_t* keep) {
    clear_error();
    return guarded("pyfa_dropout_mask", [&] { return dropout_mask(problem, keep); });
}

}  // extern "C"
