// internal.h: the backend interface the C ABI (api.cpp) drives, the tile rules, and the
// helpers the backends share.
// Not installed; the public interface is include/pyfa.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/params.h"
#include "pyfa.h"

namespace pyfa {

// Longest last-error message kept (bytes, with the terminating NUL); longer ones are cut.
constexpr size_t kMaxErrorLength = 1024;

// Sets this thread's last-error message, printf-style, and returns `status`, so that a
// failing check reads `return fail(PYFA_ERROR_..., "q: ...")`. Never allocates or
// throws: it is what reports a failed allocation.
pyfa_status fail(pyfa_status status, const char* format, ...) __attribute__((format(printf, 2, 3)));
// For a caller that already holds its message in a string.
pyfa_status fail(pyfa_status status, const std::string& message);
void clear_error();

// The launch geometry of one kernel for one problem.
struct LaunchShape {
    unsigned grid[3];
    unsigned threads;
    int64_t smem_bytes;
};

// Grid, block and shared memory of `kernel` (a pyfa_kernel) for params p, whose tiles
// have been checked by fits() and whose tile counts fit a grid dimension.
LaunchShape launch_shape(int kernel, const AttentionParams& p);

// Whether the readable FA2 forward packs a K/V head's query heads into its blocks
// (params.h pack_gqa) for a grid of B sequences, H query heads over Hkv K/V heads, Nq
// query rows, Q tiles of Br rows and `chunks` split-KV chunks (1 unsplit) on a device of
// sm_count SMs. Twin: pyfa/sim/tiles.py pack_gqa.
bool pack_gqa(int64_t B, int64_t H, int64_t Hkv, int64_t Nq, int64_t Br, int64_t chunks, int sm_count);

// Exact shared-memory bytes of a kernel's layout, or -1 for an unknown kernel, a size
// below 1, or a size that does not fit in int64_t.
int64_t smem_bytes(int kernel, int64_t Br, int64_t Bc, int64_t d);
// The layout fits in `limit` bytes (false when its size overflows).
bool smem_fits(int kernel, int64_t Br, int64_t Bc, int64_t d, int64_t limit);
// The layout's terms spelled out for messages ("Q_i 16384 + K_j 16640 + ..."), written
// into buf (cut at size).
void smem_breakdown(int kernel, int64_t Br, int64_t Bc, int64_t d, char* buf, size_t size);
const char* kernel_name(int kernel);
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int* Br, int* Bc);
// The default for the sides the caller left free (fixed_br, fixed_bc: 0), given the others.
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int fixed_br,
                          int fixed_bc, int* Br, int* Bc);

// Variants (kernels/table.h). `kernel` is a pyfa_kernel; ids returned are table rows,
// which launch_shape, smem_bytes, kernel_name and the backends take like a pyfa_kernel.
// The row that runs `kernel` for p under `variant`: the reference (*id = kernel, tiles
// left for kernel_tiles) or a fast row with its tiles in *Br, *Bc. want_br, want_bc: the
// caller's tiles (0: default); aligned: every tensor 16-byte aligned with row strides a
// multiple of 4. PYFA_VARIANT_FAST where no fast row applies is an error naming why.
pyfa_status select_kernel(int kernel, int variant, const AttentionParams& p, int want_br, int want_bc,
                          bool aligned, const pyfa_device_profile& profile, int* id, int* Br, int* Bc);
pyfa_status variant_default_tiles(int kernel, int variant, int64_t d, const pyfa_device_profile& profile,
                                  int* Br, int* Bc);
// -1 where the variant has no kernel for these tiles, or `kernel` is no pyfa_kernel (a fast
// row's id, say) or `variant` no pyfa_variant.
int64_t variant_smem_bytes(int kernel, int variant, int64_t Br, int64_t Bc, int64_t d);

// ---- backends
// Each backend (emu, cpu, cuda, and a test's own) is one object implementing Backend,
// registered by one line in its own file:
//     PYFA_REGISTER_BACKEND(MyBackend)
// api.cpp drives every one through this interface alone: what differs between backends
// is a property below, never a test of which backend it is.

// Where a backend's tensors live. Host: the caller's host pointers are read in place
// and the library's buffers are malloc'ed. Device: a host entry point copies the inputs
// over and the outputs back through the hooks below, a *_device entry point hands the
// caller's pointers straight to the kernels.
enum class Memory { Host, Device };

// The device a call made current, put back when the call returns (DeviceScope's
// destructor calls restore(previous)); untouched by backends without devices.
struct DeviceScope {
    void (*restore)(int previous) = nullptr;
    int previous = -1;
    DeviceScope() = default;
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;
    ~DeviceScope() {
        if (restore) restore(previous);
    }
};

class Backend {
public:
    // A pyfa_backend id (or a test backend's own, above them).
    virtual int id() const = 0;
    // For messages: "CUDA", "the emulator", ...
    virtual const char* label() const = 0;
    // Built into this library (CUDA: compiled with nvcc).
    virtual bool compiled() const { return true; }
    // Can run here; decided once per process where that costs.
    virtual bool available() const { return true; }
    // Why available() is false ("" when it is true); the pointer stays valid.
    virtual const char* unavailable_reason() const { return ""; }
    // Where PYFA_BACKEND_AUTO tries it: lower first, 0 never.
    virtual int auto_rank() const { return 0; }
    virtual Memory memory() const { return Memory::Host; }
    // What the kernels are sized against.
    virtual pyfa_status profile(pyfa_device_profile* profile) const = 0;

    // For a *_device call, before anything is sized or run: a backend with devices of its
    // own makes the device that owns the tensors current until `scope` goes, refusing
    // tensors or a stream that live elsewhere (PYFA_ERROR_INVALID_ARGUMENT naming the
    // tensor; names[t] names pointers[t], q first). The default has nothing to switch.
    virtual pyfa_status enter_device(const char* const* names, const void* const* pointers, int count,
                                     void* stream, DeviceScope* scope) const;

    // ---- how an op runs on it
    // Runs the kernel table's rows (kernels/table.h): PYFA_VARIANT_* choose among them.
    // False for a backend with kernels of its own, where PYFA_VARIANT_FAST is refused.
    virtual bool runs_table_kernels() const { return true; }
    // Addresses dense tensors only: strided inputs are gathered first and strided
    // outputs are always staged.
    virtual bool dense_only() const { return false; }
    // A dense_only backend whose forwards still read K and V through their strides (any
    // row and head stride): a packed batch or a KV cache is not copied before a forward.
    virtual bool forwards_read_strided_kv() const { return false; }
    // Takes a whole op at once (run_op) rather than kernel by kernel (launch).
    virtual bool runs_whole_op() const { return false; }
    // config->progress is asked by the dispatcher before each kernel (and once more
    // before the outputs are copied back), rather than by the backend itself.
    virtual bool polls_progress_per_kernel() const { return false; }
    // PYFA_OK when it can run `op` (a pyfa_op) for p and cfg, else the error saying why.
    virtual pyfa_status supports(int op, const AttentionParams& p, const pyfa_config& cfg) const;
    // Checks one kernel's launch on the device before anything runs; launches nothing.
    virtual pyfa_status check_launch(int kernel, const LaunchShape& shape) const;
    // Runs (or enqueues on `stream`) one kernel table row.
    virtual pyfa_status launch(int kernel, const AttentionParams& p, const LaunchShape& shape,
                               const pyfa_config& cfg, void* stream) const;
    // Runs every kernel of `op`, params[n] holding kernel n's tiles (count of them); for a
    // split FA2 forward, every launch of it instead: the chunks' partials, then the
    // combine (params.h, split-KV).
    virtual pyfa_status run_op(int op, const AttentionParams* params, size_t count,
                               const pyfa_config& cfg) const;

    // ---- memory and streams (the defaults are the host's: malloc, memcpy, nothing to wait for)
    // The stream a host entry point works on (and alone waits for).
    virtual pyfa_status library_stream(void** stream) const;
    virtual pyfa_status allocate(void** ptr, size_t bytes, void* stream) const;
    virtual pyfa_status deallocate(void* ptr, void* stream) const;
    virtual pyfa_status copy_to_device(void* dst, const void* src, size_t bytes, void* stream) const;
    virtual pyfa_status copy_to_host(void* dst, const void* src, size_t bytes, void* stream) const;
    // Waits for `stream` alone and reports the first error of the work on it.
    virtual pyfa_status synchronize(void* stream) const;
    // dBias's fold over a bias's broadcast B and H (issue 27), in its memory, on `stream`
    // after the kernels; the default loops on the host (common/score.h dbias_fold_at).
    virtual pyfa_status fold_dbias(const DbiasFold& fold, void* stream) const;

protected:
    ~Backend() = default;
};

// Host scratch for the host backends (Backend::allocate's default, the cpu backend's
// workspaces): 64-byte aligned, nullptr when out of memory. A call's scratch is freed when
// it ends, and a block of more than glibc's mmap threshold (128 KiB) came back as fresh
// pages on every call, whose faults the kernel serialises between the pool's threads (a
// split decoding step at N = 8192 on 2 threads of a Zen 4: 13% of its time). So the last
// few blocks given back are kept for the next call: at most kHostKeepBlocks, and at most
// PYFA_HOST_KEEP_BYTES bytes in all (read at each give; default kHostKeepBytes, 0 keeps
// none, and a value that is not a whole number keeps none).
void* host_take(size_t bytes);
void host_give(void* ptr);
constexpr int kHostKeepBlocks = 8;
constexpr size_t kHostKeepBytes = size_t{64} << 20;

// At most this many backends register.
constexpr int kMaxBackends = 8;
// Adds b to the backends; called by PYFA_REGISTER_BACKEND while the library loads.
// Allocates nothing; a second backend with b's id, or one past kMaxBackends, is dropped
// (ids are unique by construction, and kMaxBackends is well above the backends there are).
void register_backend(const Backend* b);
// The registered backend with this id, or nullptr.
const Backend* find_backend(int id);
// Registered backends, in the order PYFA_BACKEND_AUTO tries them (auto_rank 0 last).
int backend_count();
const Backend* backend_at(int n);

struct BackendRegistrar {
    explicit BackendRegistrar(const Backend* b) { register_backend(b); }
};
#define PYFA_REGISTER_BACKEND_CAT2(a, b) a##b
#define PYFA_REGISTER_BACKEND_CAT(a, b) PYFA_REGISTER_BACKEND_CAT2(a, b)
// One line per backend, at namespace scope in its own file.
#define PYFA_REGISTER_BACKEND(Type)                                                       \
    namespace {                                                                           \
    const Type PYFA_REGISTER_BACKEND_CAT(pyfa_backend_, __LINE__);                        \
    const ::pyfa::BackendRegistrar PYFA_REGISTER_BACKEND_CAT(pyfa_registrar_, __LINE__){ \
        &PYFA_REGISTER_BACKEND_CAT(pyfa_backend_, __LINE__)};                             \
    }

// The emulated device both host backends size their tiles against (an H200's limits),
// named `name`: the cpu backend uses the emulator's, so that default tiles, and with
// them the bits, are the same.
void emulated_h200_profile(const char* name, pyfa_device_profile* profile);


}  // namespace pyfa
