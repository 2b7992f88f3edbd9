// backend.cpp: the registry of backends, and what a Backend does unless it says
// otherwise (host memory; no kernel it cannot run; no whole-op path).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/score.h"
#include "core/internal.h"

namespace pyfa {

namespace {

// Filled while the library loads, before any call can read it: zero-initialised
// storage, so the order in which the backends' files register does not matter.
struct Registry {
    const Backend* backends[kMaxBackends];
    int count;
};
Registry g_registry;

// Where b goes in the AUTO order: by auto_rank, 0 (never) last; ties by id.
bool before(const Backend* a, const Backend* b) {
    const unsigned ra = static_cast<unsigned>(a->auto_rank() - 1), rb = static_cast<unsigned>(b->auto_rank() - 1);
    return ra != rb ? ra < rb : a->id() < b->id();
}

}  // namespace

void register_backend(const Backend* b) {
    Registry& r = g_registry;
    if (r.count == kMaxBackends || find_backend(b->id())) return;
    int n = r.count++;
    for (; n > 0 && before(b, r.backends[n - 1]); --n) r.backends[n] = r.backends[n - 1];
    r.backends[n] = b;
}

const Backend* find_backend(int id) {
    for (int n = 0; n < g_registry.count; ++n)
        if (g_registry.backends[n]->id() == id) return g_registry.backends[n];
    return nullptr;
}

int backend_count() { return g_registry.count; }

const Backend* backend_at(int n) { return n >= 0 && n < g_registry.count ? g_registry.backends[n] : nullptr; }

void emulated_h200_profile(const char* name, pyfa_device_profile* profile) {
    std::memset(profile, 0, sizeof(*profile));
    std::strncpy(profile->name, name, sizeof(profile->name) - 1);
    profile->smem_per_block = 227 * 1024;  // an H200's opt-in shared memory per block
    profile->max_threads_per_block = 1024;
    profile->sm_count = 132;
}

pyfa_status Backend::supports(int, const AttentionParams&, const pyfa_config& cfg) const {
    if (!runs_table_kernels() && cfg.variant == PYFA_VARIANT_FAST)
        return fail(PYFA_ERROR_INVALID_ARGUMENT,
                    "config->variant: fast: %s has kernels of its own; PYFA_VARIANT_FAST chooses among the "
                    "emulator's and CUDA's",
                    label());
    return PYFA_OK;
}

pyfa_status Backend::enter_device(const char* const*, const void* const*, int, void*, DeviceScope*) const {
    return PYFA_OK;
}

pyfa_status Backend::check_launch(int, const LaunchShape&) const { return PYFA_OK; }

pyfa_status Backend::launch(int kernel, const AttentionParams&, const LaunchShape&, const pyfa_config&,
                            void*) const {
    return fail(PYFA_ERROR_INTERNAL, "%s launches no single kernel (%s)", label(), kernel_name(kernel));
}

pyfa_status Backend::run_op(int op, const AttentionParams*, size_t, const pyfa_config&) const {
    return fail(PYFA_ERROR_INTERNAL, "%s runs no whole op (%d)", label(), op);
}

pyfa_status Backend::fold_dbias(const DbiasFold& fold, void*) const {
    for (int64_t e = 0; e < fold.elems(); ++e) fold.out[e] = dbias_fold_at(fold, e);
    return PYFA_OK;
}

pyfa_status Backend::library_stream(void** stream) const {
    *stream = nullptr;
    return PYFA_OK;
}

namespace {

// A block's size lives in the 64 bytes before what host_take returns.
constexpr size_t kHeader = 64;

struct HostKeep {
    std::mutex lock;
    void* blocks[kHostKeepBlocks] = {};  // their headers, the most recently given last
    int count = 0;
    size_t bytes = 0;
    ~HostKeep() {
        for (int n = 0; n < count; ++n) std::free(blocks[n]);
    }
};

HostKeep& host_keep() {
    static HostKeep keep;
    return keep;
}

size_t block_size(const void* header) { return *static_cast<const size_t*>(header); }

size_t keep_limit() {
    const char* text = std::getenv("PYFA_HOST_KEEP_BYTES");
    if (!text) return kHostKeepBytes;
    char* end = nullptr;
    const unsigned long long n = std::strtoull(text, &end, 10);
    return *text >= '0' && *text <= '9' && end && *end == '\0' ? static_cast<size_t>(n) : 0;
}

}  // namespace

void* host_take(size_t bytes) {
    const size_t size = (bytes + 63) / 64 * 64;
    HostKeep& keep = host_keep();
    {
        std::lock_guard<std::mutex> hold(keep.lock);
        // The smallest kept block that fits, unless it is more than twice as large.
        int best = -1;
        for (int n = 0; n < keep.count; ++n) {
            const size_t have = block_size(keep.blocks[n]);
            if (have >= size && have <= 2 * size + 4096 && (best < 0 || have < block_size(keep.blocks[best])))
                best = n;
        }
        if (best >= 0) {
            void* header = keep.blocks[best];
            keep.bytes -= block_size(header);
            std::memmove(keep.blocks + best, keep.blocks + best + 1, sizeof(void*) * (keep.count - best - 1));
            --keep.count;
            return static_cast<char*>(header) + kHeader;
        }
    }
    if (size > SIZE_MAX - kHeader) return nullptr;
    void* header = std::aligned_alloc(64, size + kHeader);
    if (!header) return nullptr;
    *static_cast<size_t*>(header) = size;
    return static_cast<char*>(header) + kHeader;
}

void host_give(void* ptr) {
    if (!ptr) return;
    void* header = static_cast<char*>(ptr) - kHeader;
    const size_t size = block_size(header);
    HostKeep& keep = host_keep();
    void* drop[kHostKeepBlocks + 1] = {};
    int dropped = 0;
    const size_t limit = keep_limit();
    if (size <= limit) {
        std::lock_guard<std::mutex> hold(keep.lock);
        while (keep.count > 0 && (keep.count == kHostKeepBlocks || keep.bytes + size > limit)) {
            drop[dropped++] = keep.blocks[0];  // the least recently given first
            keep.bytes -= block_size(keep.blocks[0]);
            std::memmove(keep.blocks, keep.blocks + 1, sizeof(void*) * (keep.count - 1));
            --keep.count;
        }
        keep.blocks[keep.count++] = header;
        keep.bytes += size;
    } else {
        drop[dropped++] = header;
    }
    for (int n = 0; n < dropped; ++n) std::free(drop[n]);
}

pyfa_status Backend::allocate(void** ptr, size_t bytes, void*) const {
    *ptr = host_take(bytes ? bytes : 1);
    if (!*ptr) return fail(PYFA_ERROR_OUT_OF_MEMORY, "out of host memory for %zu bytes", bytes);
    return PYFA_OK;
}

pyfa_status Backend::deallocate(void* ptr, void*) const {
    host_give(ptr);
    return PYFA_OK;
}

pyfa_status Backend::copy_to_device(void* dst, const void* src, size_t bytes, void*) const {
    std::memcpy(dst, src, bytes);
    return PYFA_OK;
}

pyfa_status Backend::copy_to_host(void* dst, const void* src, size_t bytes, void*) const {
    std::memcpy(dst, src, bytes);
    return PYFA_OK;
}

pyfa_status Backend::synchronize(void*) const { return PYFA_OK; }

}  // namespace pyfa
