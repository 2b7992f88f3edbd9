// emu_runtime.cpp: the host emulation runtime declared in emu.h. Each OS worker runs one
// block at a time; the block's CUDA threads are fibers switched by a small hand-written
// context switch (ucontext where no assembly version exists).
#include "emu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define PYFA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PYFA_EMU_ASAN 1
#endif
#endif
#if defined(PYFA_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

// ---------------------------------------------------------------------------------------
// Context switch. A suspended context is just its stack pointer; the callee-saved state
// lies on its own stack. A new context's stack is prepared so that the first switch to it
// "returns" into pyfa_emu_ctx_start, which calls fn(arg); fn must never return.
// ---------------------------------------------------------------------------------------
// PYFA_EMU_USE_UCONTEXT forces the portable path (e.g. where CET shadow stacks are enforced).
#if defined(PYFA_EMU_USE_UCONTEXT)
#include <ucontext.h>
#elif defined(__x86_64__) && defined(__ELF__) && !defined(_WIN32)
#define PYFA_EMU_CTX_ASM 1
// MXCSR and the x87 control word are callee-saved under the SysV ABI, so they travel too.
// It leaves by pop+jmp, not ret: a ret into another stack always misses the return-address
// predictor, which measured 3x slower (17 ns against 5.5 ns per switch).
asm(R"(
    .pushsection .text
    .globl pyfa_emu_ctx_switch
    .hidden pyfa_emu_ctx_switch
    .type pyfa_emu_ctx_switch, @function
    .p2align 4
pyfa_emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    popq %rcx
    notrack jmpq *%rcx
    .size pyfa_emu_ctx_switch, .-pyfa_emu_ctx_switch

    .globl pyfa_emu_ctx_start
    .hidden pyfa_emu_ctx_start
    .type pyfa_emu_ctx_start, @function
    .p2align 4
pyfa_emu_ctx_start:
    .cfi_startproc
    .cfi_undefined rip
    movq %r12, %rdi
    callq *%r13
    ud2
    .cfi_endproc
    .size pyfa_emu_ctx_start, .-pyfa_emu_ctx_start
    .popsection
)");
#elif defined(__aarch64__) && defined(__ELF__)
#define PYFA_EMU_CTX_ASM 1
// Leaves by ret, not br: under BTI a br to a return address would fault. FPCR is not saved.
asm(R"(
    .pushsection .text
    .globl pyfa_emu_ctx_switch
    .hidden pyfa_emu_ctx_switch
    .type pyfa_emu_ctx_switch, %function
    .p2align 4
pyfa_emu_ctx_switch:
    sub sp, sp, #160
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #160
    ret
    .size pyfa_emu_ctx_switch, .-pyfa_emu_ctx_switch

    .globl pyfa_emu_ctx_start
    .hidden pyfa_emu_ctx_start
    .type pyfa_emu_ctx_start, %function
    .p2align 4
pyfa_emu_ctx_start:
    .cfi_startproc
    .cfi_undefined x30
    mov x0, x19
    blr x20
    brk #0
    .cfi_endproc
    .size pyfa_emu_ctx_start, .-pyfa_emu_ctx_start
    .popsection
)");
#else
#include <ucontext.h>
#endif

#if defined(PYFA_EMU_CTX_ASM)
extern "C" __attribute__((visibility("hidden"))) void pyfa_emu_ctx_switch(void** save_sp,
                                                                         void* load_sp);
extern "C" __attribute__((visibility("hidden"))) void pyfa_emu_ctx_start();
#endif

namespace pyfa_emu {
namespace {

constexpr size_t kFiberStackBytes = 64 * 1024;
constexpr unsigned kMaxBlockThreads = 1024;
constexpr size_t kMaxSmemBytes = size_t(1) << 30;  // a sanity bound, far above any GPU's
constexpr uint64_t kStackCanary = 0x5a17c0de5a17c0deull;
constexpr uint32_t kPoison = 0xFFFFFFFFu;  // a NaN as float32, what undefined values read as

using EntryFn = void (*)(void*);

#if defined(PYFA_EMU_CTX_ASM)
struct Context {
    void* sp = nullptr;
};

void ctx_make(Context& c, unsigned char* stack, size_t size, EntryFn fn, void* arg) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
#if defined(__x86_64__)
    // Layout popped by pyfa_emu_ctx_switch: csr word, r15, r14, r13, r12, rbx, rbp, return.
    uint64_t* frame = reinterpret_cast<uint64_t*>(top - 64);
    uint32_t mxcsr;
    uint16_t fcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fcw));
    frame[0] = uint64_t(mxcsr) | (uint64_t(fcw) << 32);
    frame[1] = 0;
    frame[2] = 0;
    frame[3] = reinterpret_cast<uint64_t>(fn);
    frame[4] = reinterpret_cast<uint64_t>(arg);
    frame[5] = 0;
    frame[6] = 0;
    frame[7] = reinterpret_cast<uint64_t>(&pyfa_emu_ctx_start);
#else
    // Layout: x19..x28, x29, x30, d8..d15.
    uint64_t* frame = reinterpret_cast<uint64_t*>(top - 160);
    for (int i = 0; i < 20; ++i) frame[i] = 0;
    frame[0] = reinterpret_cast<uint64_t>(arg);
    frame[1] = reinterpret_cast<uint64_t>(fn);
    frame[11] = reinterpret_cast<uint64_t>(&pyfa_emu_ctx_start);
#endif
    c.sp = frame;
}

inline void ctx_switch(Context& from, Context& to) { pyfa_emu_ctx_switch(&from.sp, to.sp); }
#else
struct Context {
    ucontext_t uc;
};

void ctx_trampoline(unsigned hi, unsigned lo, unsigned fhi, unsigned flo) {
    void* arg = reinterpret_cast<void*>((uintptr_t(hi) << 16 << 16) | uintptr_t(lo));
    EntryFn fn = reinterpret_cast<EntryFn>((uintptr_t(fhi) << 16 << 16) | uintptr_t(flo));
    fn(arg);
}

void ctx_make(Context& c, unsigned char* stack, size_t size, EntryFn fn, void* arg) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    uintptr_t a = reinterpret_cast<uintptr_t>(arg), f = reinterpret_cast<uintptr_t>(fn);
    makecontext(&c.uc, reinterpret_cast<void (*)()>(&ctx_trampoline), 4,
                unsigned(a >> 16 >> 16), unsigned(a), unsigned(f >> 16 >> 16), unsigned(f));
}

inline void ctx_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// ASan must be told about every stack change, or it reports false errors on fiber stacks.
struct AsanStack {
    const void* bottom = nullptr;
    size_t size = 0;
};
#if defined(PYFA_EMU_ASAN)
inline void asan_start(void** fake_save, const void* bottom, size_t size) {
    __sanitizer_start_switch_fiber(fake_save, bottom, size);
}
inline void asan_finish(void* fake, AsanStack* old) {
    __sanitizer_finish_switch_fiber(fake, old ? &old->bottom : nullptr, old ? &old->size : nullptr);
}
inline void asan_unpoison(void* p, size_t n) { __asan_unpoison_memory_region(p, n); }
#else
inline void asan_start(void**, const void*, size_t) {}
inline void asan_finish(void*, AsanStack*) {}
inline void asan_unpoison(void*, size_t) {}
#endif

// ---------------------------------------------------------------------------------------
// Scheduler state.
// ---------------------------------------------------------------------------------------
enum class State : uint8_t { Runnable, Barrier, Shfl, Done };

struct Worker;

struct Fiber {
    Context ctx;
    unsigned char* stack = nullptr;  // lowest address; holds the overflow canary
    Worker* worker = nullptr;
    State state = State::Runnable;
    const char* file = nullptr;  // site of the barrier or shuffle it waits at
    int line = 0;
    uint32_t mask = 0, value = 0, result = 0;
    int lane_arg = 0, width = 0;
    ShflMode mode = ShflMode::Idx;
    bool threw = false;
    std::string what;
    void* asan_fake = nullptr;
};

struct StackDeleter {
    void operator()(unsigned char* p) const { ::operator delete(p, std::align_val_t(64)); }
};
using StackPtr = std::unique_ptr<unsigned char, StackDeleter>;

struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
};

struct LaunchShared {
    dim3 grid, block;
    size_t smem_bytes;
    LaunchOptions options;
    const std::function<void()>* body;
    uint64_t total_blocks;
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::string error;
    void fail(std::string msg) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!failed.load(std::memory_order_relaxed)) error = std::move(msg);
        failed.store(true, std::memory_order_relaxed);
    }
};

// One per OS thread; stacks and shared memory are kept and reused across blocks and launches.
struct Worker {
    std::vector<StackPtr> stacks;
    std::vector<std::unique_ptr<Fiber>> fibers;
    std::vector<unsigned> order;
    std::unique_ptr<unsigned char[]> smem_raw;
    size_t smem_capacity = 0;
    unsigned char* smem = nullptr;

    // Thread-local addresses kept in memory: in a shared library GCC would otherwise recompute
    // them (a __tls_get_addr call each) after every context switch instead of keeping them.
    dim3 *tls_tid = nullptr, *tls_bid = nullptr, *tls_bdim = nullptr, *tls_gdim = nullptr;

    Context sched;
    AsanStack sched_stack;
    const std::function<void()>* body = nullptr;
    Fiber* current = nullptr;
    bool in_block = false;

    // The block being run.
    dim3 bidx, bdim;
    unsigned nthreads = 0;
    unsigned live = 0, runnable = 0;
    std::string error;
    bool failed = false;

    void fail(std::string msg) {
        if (!failed) error = std::move(msg);
        failed = true;
    }
};

thread_local Worker* t_worker = nullptr;  // set while this OS thread runs a block

// On the heap, so that the scheduler holds a plain pointer and not a thread-local address.
Worker& worker_cache() {
    thread_local std::unique_ptr<Worker> w;
    if (!w) w.reset(new Worker);
    return *w;
}

[[noreturn]] void fiber_exit(Fiber* f) {
    Worker* w = f->worker;
    asan_start(nullptr, w->sched_stack.bottom, w->sched_stack.size);
    ctx_switch(f->ctx, w->sched);
    __builtin_unreachable();
}

void fiber_entry(void* arg) {
    Fiber* f = static_cast<Fiber*>(arg);
    asan_finish(nullptr, &f->worker->sched_stack);
    // Exceptions must end here: unwinding cannot cross the context switch.
    try {
        (*f->worker->body)();
    } catch (const std::exception& e) {
        f->threw = true;
        try {
            f->what = e.what();
        } catch (...) {
        }
    } catch (...) {
        f->threw = true;
    }
    f->state = State::Done;
    fiber_exit(f);
}

void park(Worker* w, Fiber* f) {
    asan_start(&f->asan_fake, w->sched_stack.bottom, w->sched_stack.size);
    ctx_switch(f->ctx, w->sched);
    asan_finish(f->asan_fake, &w->sched_stack);
}

// ---------------------------------------------------------------------------------------
// Messages.
// ---------------------------------------------------------------------------------------
std::string dim_str(dim3 d) {
    return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

std::string site_str(const char* file, int line) {
    return std::string(file ? file : "?") + ":" + std::to_string(line);
}

std::string hex32(uint32_t v) {
    static const char digits[] = "0123456789abcdef";
    std::string s = "0x";
    for (int i = 28; i >= 0; i -= 4) s += digits[(v >> i) & 15];
    return s;
}

std::string thread_str(const Worker& w, unsigned id) {
    if (w.bdim.y == 1 && w.bdim.z == 1) return std::to_string(id);
    unsigned x = id % w.bdim.x, y = (id / w.bdim.x) % w.bdim.y, z = id / (w.bdim.x * w.bdim.y);
    return dim_str(dim3(x, y, z));
}

// Sorted linear ids as compact ranges: "0-15, 17".
std::string threads_str(const Worker& w, const std::vector<unsigned>& ids) {
    std::string s;
    size_t shown = 0;
    for (size_t i = 0; i < ids.size();) {
        size_t j = i;
        while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
        if (shown == 8) {
            s += ", ...";
            break;
        }
        if (!s.empty()) s += ", ";
        s += thread_str(w, ids[i]);
        if (j > i) s += "-" + thread_str(w, ids[j]);
        ++shown;
        i = j + 1;
    }
    return s;
}

std::string block_prefix(const Worker& w) { return "pyfa emu: block " + dim_str(w.bidx) + ": "; }

bool same_site(const Fiber& a, const Fiber& b) {
    if (a.line != b.line) return false;
    if (a.file == b.file) return true;
    return a.file && b.file && std::strcmp(a.file, b.file) == 0;
}

std::string wait_str(const Fiber& f) {
    if (f.state == State::Barrier) return "__syncthreads at " + site_str(f.file, f.line);
    return "shuffle (mask " + hex32(f.mask) + ") at " + site_str(f.file, f.line);
}

// Describes every waiting thread, grouped by what it waits at.
std::string describe_waiters(const Worker& w) {
    std::vector<bool> listed(w.nthreads, false);
    std::string s;
    for (unsigned i = 0; i < w.nthreads; ++i) {
        const Fiber& f = *w.fibers[i];
        if (listed[i] || (f.state != State::Barrier && f.state != State::Shfl)) continue;
        std::vector<unsigned> ids;
        for (unsigned j = i; j < w.nthreads; ++j) {
            const Fiber& g = *w.fibers[j];
            if (!listed[j] && g.state == f.state && same_site(f, g) &&
                (f.state == State::Barrier || g.mask == f.mask)) {
                listed[j] = true;
                ids.push_back(j);
            }
        }
        if (!s.empty()) s += "; ";
        s += "threads " + threads_str(w, ids) + " wait at " + wait_str(f);
    }
    std::vector<unsigned> done;
    for (unsigned i = 0; i < w.nthreads; ++i)
        if (w.fibers[i]->state == State::Done) done.push_back(i);
    if (!done.empty()) s += "; threads " + threads_str(w, done) + " have returned";
    return s;
}

// ---------------------------------------------------------------------------------------
// Warp shuffles.
// ---------------------------------------------------------------------------------------
inline uint32_t warp_lanes_mask(const Worker& w, unsigned warp) {
    unsigned n = std::min(32u, w.nthreads - warp * 32);
    return n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1);
}

// Source lane as PTX shfl.sync defines it; the lane itself when the source is out of range.
inline unsigned shfl_source(unsigned lane, int arg, int width, ShflMode mode) {
    unsigned b = unsigned(arg) & 31u;
    unsigned segmask = (32u - unsigned(width)) & 31u;
    unsigned min_lane = lane & segmask;
    unsigned max_lane = min_lane | (31u & ~segmask);
    int j;
    bool ok;
    switch (mode) {
        case ShflMode::Up:
            j = int(lane) - int(b);
            ok = j >= int(min_lane);
            break;
        case ShflMode::Down:
            j = int(lane + b);
            ok = j <= int(max_lane);
            break;
        case ShflMode::Xor:
            j = int(lane ^ b);
            ok = j <= int(max_lane);
            break;
        default:
            j = int(min_lane | (b & ~segmask));
            ok = j <= int(max_lane);
            break;
    }
    return ok ? unsigned(j) : lane;
}

// Called by the scheduler after fiber `id` parked at a shuffle.
void shfl_arrived(Worker& w, unsigned id) {
    Fiber& f = *w.fibers[id];
    unsigned warp = id / 32, lane = id % 32, base = warp * 32;
    uint32_t exist = warp_lanes_mask(w, warp);
    uint32_t group = f.mask & exist;
    std::string where = "shuffle at " + site_str(f.file, f.line);
    if (!(f.mask >> lane & 1u)) {
        w.fail(block_prefix(w) + "thread " + thread_str(w, id) + " calls a " + where +
               " with mask " + hex32(f.mask) + ", which does not include its own lane " +
               std::to_string(lane));
        return;
    }
    if (f.width < 1 || f.width > 32 || (f.width & (f.width - 1)) != 0) {
        w.fail(block_prefix(w) + "thread " + thread_str(w, id) + ": " + where + " has width " +
               std::to_string(f.width) + " (must be a power of 2 up to 32)");
        return;
    }
    unsigned arrived = 0;
    for (unsigned j = 0; j < 32; ++j) {
        if (!(exist >> j & 1u)) break;
        const Fiber& g = *w.fibers[base + j];
        bool g_in_f = group >> j & 1u;
        if (g_in_f && g.state == State::Done) {
            w.fail(block_prefix(w) + "thread " + thread_str(w, id) + " waits at a " + where +
                   " (mask " + hex32(f.mask) + ") for thread " + thread_str(w, base + j) +
                   ", which has returned");
            return;
        }
        if (g.state != State::Shfl) continue;
        bool f_in_g = g.mask >> lane & 1u;
        if ((g_in_f || f_in_g) && (g.mask != f.mask || !same_site(f, g))) {
            w.fail(block_prefix(w) + "lanes of warp " + std::to_string(warp) +
                   " are at different shuffles: thread " + thread_str(w, id) + " at " +
                   site_str(f.file, f.line) + " (mask " + hex32(f.mask) + "), thread " +
                   thread_str(w, base + j) + " at " + site_str(g.file, g.line) + " (mask " +
                   hex32(g.mask) + ")");
            return;
        }
        if (g_in_f) ++arrived;
    }
    if (arrived != unsigned(__builtin_popcount(group))) return;
    // Everyone has posted: compute all results before any lane runs on.
    for (unsigned j = 0; j < 32; ++j) {
        if (!(group >> j & 1u)) continue;
        Fiber& g = *w.fibers[base + j];
        unsigned src = shfl_source(j, g.lane_arg, g.width, g.mode);
        g.result = (group >> src & 1u) ? w.fibers[base + src]->value : kPoison;
    }
    for (unsigned j = 0; j < 32; ++j) {
        if (!(group >> j & 1u)) continue;
        w.fibers[base + j]->state = State::Runnable;
        ++w.runnable;
    }
}

// Called by the scheduler after fiber `id` returned from the kernel.
void fiber_done(Worker& w, unsigned id) {
    Fiber& f = *w.fibers[id];
    --w.live;
    if (f.threw) {
        w.fail(block_prefix(w) + "thread " + thread_str(w, id) + " threw an exception: " +
               (f.what.empty() ? std::string("(not a std::exception)") : f.what));
        return;
    }
    unsigned warp = id / 32, lane = id % 32, base = warp * 32;
    uint32_t exist = warp_lanes_mask(w, warp);
    for (unsigned j = 0; j < 32 && (exist >> j & 1u); ++j) {
        const Fiber& g = *w.fibers[base + j];
        if (g.state == State::Shfl && (g.mask >> lane & 1u)) {
            w.fail(block_prefix(w) + "thread " + thread_str(w, base + j) + " waits at a shuffle at " +
                   site_str(g.file, g.line) + " (mask " + hex32(g.mask) + ") for thread " +
                   thread_str(w, id) + ", which has returned");
            return;
        }
    }
}

// Nothing can run: either all live threads wait at one barrier, or it is an error.
void release_or_fail(Worker& w) {
    const Fiber* first = nullptr;
    bool ok = true;
    for (unsigned i = 0; i < w.nthreads && ok; ++i) {
        const Fiber& f = *w.fibers[i];
        if (f.state == State::Done) continue;
        if (f.state != State::Barrier || (first && !same_site(*first, f))) ok = false;
        if (!first) first = &f;
    }
    if (!ok) {
        w.fail(block_prefix(w) + "deadlock or barrier divergence: " + describe_waiters(w));
        return;
    }
    for (unsigned i = 0; i < w.nthreads; ++i) {
        Fiber& f = *w.fibers[i];
        if (f.state == State::Barrier) {
            f.state = State::Runnable;
            ++w.runnable;
        }
    }
}

void ensure_capacity(Worker& w, unsigned nthreads, size_t smem_bytes) {
    while (w.stacks.size() < nthreads) {
        void* p = ::operator new(kFiberStackBytes, std::align_val_t(64));
        w.stacks.emplace_back(static_cast<unsigned char*>(p));
    }
    while (w.fibers.size() < nthreads) w.fibers.emplace_back(new Fiber);
    size_t want = std::max<size_t>(smem_bytes, 16);
    if (w.smem_capacity < want) {
        w.smem_raw.reset();
        w.smem_capacity = 0;
        w.smem_raw.reset(new unsigned char[want + 15]);
        w.smem_capacity = want;
    }
    uintptr_t p = reinterpret_cast<uintptr_t>(w.smem_raw.get());
    w.smem = reinterpret_cast<unsigned char*>((p + 15) & ~uintptr_t(15));
}

// Runs one block on this OS thread. Returns false with w.error set on failure.
bool run_block(Worker& w, LaunchShared& L, uint64_t linear) {
    const dim3 grid = L.grid, block = L.block;
    w.bdim = block;
    w.bidx = dim3(unsigned(linear % grid.x), unsigned((linear / grid.x) % grid.y),
                  unsigned(linear / (uint64_t(grid.x) * grid.y)));
    const unsigned n = block.x * block.y * block.z;
    w.nthreads = n;
    w.error.clear();
    w.failed = false;
    w.body = L.body;
    ensure_capacity(w, n, L.smem_bytes);
    std::memset(w.smem, 0xFF, std::max<size_t>(L.smem_bytes, 16));

    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = *w.fibers[i];
        f.stack = w.stacks[i].get();
        f.worker = &w;
        f.state = State::Runnable;
        f.threw = false;
        f.what.clear();
        f.asan_fake = nullptr;
        asan_unpoison(f.stack, kFiberStackBytes);  // frames of fibers abandoned by a failed block
        std::memcpy(f.stack, &kStackCanary, sizeof kStackCanary);
        ctx_make(f.ctx, f.stack, kFiberStackBytes, &fiber_entry, &f);
    }
    w.live = n;
    w.runnable = n;

    std::vector<unsigned>& order = w.order;
    order.resize(n);
    for (unsigned i = 0; i < n; ++i) order[i] = L.options.order == 1 ? n - 1 - i : i;
    Rng rng{L.options.seed ^ (0xD1B54A32D192ED03ull * (linear + 1))};

    dim3* const t_tid = w.tls_tid;
    dim3* const t_bid = w.tls_bid;
    dim3* const t_bdim = w.tls_bdim;
    dim3* const t_gdim = w.tls_gdim;
    const unsigned bx = block.x, bxy = block.x * block.y;

    while (w.live > 0) {
        if (L.options.order == 2) {
            for (unsigned i = n; i > 1; --i) std::swap(order[i - 1], order[rng.next() % i]);
        }
        for (unsigned k = 0; k < n && w.runnable > 0; ++k) {
            const unsigned id = order[k];
            Fiber& f = *w.fibers[id];
            if (f.state != State::Runnable) continue;
            *t_tid = dim3(id % bx, (id / bx) % block.y, id / bxy);
            *t_bid = w.bidx;
            *t_bdim = block;
            *t_gdim = grid;
            w.current = &f;
            void* fake = nullptr;
            asan_start(&fake, f.stack, kFiberStackBytes);
            ctx_switch(w.sched, f.ctx);
            asan_finish(fake, nullptr);
            w.current = nullptr;
            --w.runnable;
            if (std::memcmp(f.stack, &kStackCanary, sizeof kStackCanary) != 0) {
                w.fail(block_prefix(w) + "thread " + thread_str(w, id) +
                       " overflowed its " + std::to_string(kFiberStackBytes / 1024) +
                       " KiB emulated stack");
                return false;
            }
            if (f.state == State::Shfl)
                shfl_arrived(w, id);
            else if (f.state == State::Done)
                fiber_done(w, id);
            if (w.failed) return false;
            if (L.failed.load(std::memory_order_relaxed)) {
                w.fail("pyfa emu: launch stopped by an error in another block");
                return false;
            }
        }
        if (w.live > 0 && w.runnable == 0) {
            release_or_fail(w);
            if (w.failed) return false;
        }
    }
    return true;
}

void worker_loop(LaunchShared& L) {
    Worker& w = worker_cache();
    w.tls_tid = &threadIdx;
    w.tls_bid = &blockIdx;
    w.tls_bdim = &blockDim;
    w.tls_gdim = &gridDim;
    Worker* saved = t_worker;
    t_worker = &w;
    w.in_block = true;
    try {
        while (!L.failed.load(std::memory_order_relaxed)) {
            uint64_t linear = L.next.fetch_add(1, std::memory_order_relaxed);
            if (linear >= L.total_blocks) break;
            if (!run_block(w, L, linear)) {
                L.fail(w.error);
                break;
            }
        }
    } catch (const std::bad_alloc&) {
        L.fail("pyfa emu: out of memory for emulated thread stacks or shared memory");
    } catch (const std::exception& e) {
        L.fail(std::string("pyfa emu: ") + e.what());
    }
    w.in_block = false;
    w.current = nullptr;
    t_worker = saved;
}

bool dims_ok(dim3 grid, dim3 block, std::string* why) {
    if (grid.x < 1 || grid.y < 1 || grid.z < 1) {
        *why = "grid " + dim_str(grid) + " has an empty dimension";
        return false;
    }
    if (grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
        *why = "grid " + dim_str(grid) + " exceeds CUDA's limits (2^31-1, 65535, 65535)";
        return false;
    }
    if (block.x < 1 || block.y < 1 || block.z < 1) {
        *why = "block " + dim_str(block) + " has an empty dimension";
        return false;
    }
    if (block.x > 1024 || block.y > 1024 || block.z > 64 ||
        uint64_t(block.x) * block.y * block.z > kMaxBlockThreads) {
        *why = "block " + dim_str(block) + " exceeds CUDA's limits (1024 threads, z up to 64)";
        return false;
    }
    return true;
}

struct PingPong {
    Context main, fiber;
    AsanStack main_stack;
    void* fake = nullptr;
};

void pingpong_entry(void* arg) {
    PingPong* p = static_cast<PingPong*>(arg);
    asan_finish(nullptr, &p->main_stack);
    for (;;) {
        asan_start(&p->fake, p->main_stack.bottom, p->main_stack.size);
        ctx_switch(p->fiber, p->main);
        asan_finish(p->fake, &p->main_stack);
    }
}

}  // namespace

double context_switch_ns(long switches) {
    const long rounds = std::max(1L, switches / 2);
    StackPtr stack(static_cast<unsigned char*>(
        ::operator new(kFiberStackBytes, std::align_val_t(64))));
    PingPong p;
    ctx_make(p.fiber, stack.get(), kFiberStackBytes, &pingpong_entry, &p);
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < rounds; ++i) {
        void* fake = nullptr;
        asan_start(&fake, stack.get(), kFiberStackBytes);
        ctx_switch(p.main, p.fiber);
        asan_finish(fake, nullptr);
    }
    const auto t1 = std::chrono::steady_clock::now();
    // The fiber stays parked in its loop; its frame holds nothing that needs destroying.
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(2 * rounds);
}

void syncthreads(const char* file, int line) {
    Worker* w = t_worker;
    if (!w || !w->current) return;  // outside a kernel thread there is nothing to wait for
    Fiber* f = w->current;
    f->state = State::Barrier;
    f->file = file;
    f->line = line;
    park(w, f);
}

uint32_t shfl(uint32_t mask, uint32_t value, int lane_arg, int width, ShflMode mode,
              const char* file, int line) {
    Worker* w = t_worker;
    if (!w || !w->current) return value;
    Fiber* f = w->current;
    f->state = State::Shfl;
    f->mask = mask;
    f->value = value;
    f->lane_arg = lane_arg;
    f->width = width;
    f->mode = mode;
    f->file = file;
    f->line = line;
    park(w, f);
    return f->result;
}

unsigned char* dynamic_smem() {
    Worker* w = t_worker;
    return w && w->in_block ? w->smem : nullptr;
}

bool launch(dim3 grid, dim3 block, size_t smem_bytes, const LaunchOptions& options,
            const std::function<void()>& body, std::string* error) {
    std::string scratch;
    std::string& err = error ? *error : scratch;
    err.clear();
    std::string why;
    if (!dims_ok(grid, block, &why)) {
        err = "pyfa emu: invalid launch: " + why;
        return false;
    }
    if (smem_bytes > kMaxSmemBytes) {
        err = "pyfa emu: invalid launch: " + std::to_string(smem_bytes) +
              " bytes of dynamic shared memory (the emulator allows up to 1 GiB)";
        return false;
    }
    if (options.order < 0 || options.order > 2) {
        err = "pyfa emu: invalid launch: thread order " + std::to_string(options.order) +
              " (0 forward, 1 reverse, 2 shuffled)";
        return false;
    }
    if (!body) {
        err = "pyfa emu: invalid launch: empty kernel body";
        return false;
    }
    if (t_worker) {
        err = "pyfa emu: launch called from inside an emulated kernel";
        return false;
    }

    LaunchShared L;
    L.grid = grid;
    L.block = block;
    L.smem_bytes = smem_bytes;
    L.options = options;
    L.body = &body;
    L.total_blocks = uint64_t(grid.x) * grid.y * grid.z;

    uint64_t nworkers = options.workers > 0 ? unsigned(options.workers)
                                            : std::max(1u, std::thread::hardware_concurrency());
    nworkers = std::min<uint64_t>(nworkers, L.total_blocks);

    // The host thread's own index variables are not the kernel's business: restore them.
    const dim3 saved_t = threadIdx, saved_b = blockIdx, saved_bd = blockDim, saved_gd = gridDim;
    std::vector<std::thread> threads;
    try {
        threads.reserve(size_t(nworkers - 1));
        for (uint64_t i = 1; i < nworkers; ++i) threads.emplace_back(worker_loop, std::ref(L));
    } catch (const std::exception&) {
        // Fewer workers than asked: the ones that exist still drain the grid.
    }
    worker_loop(L);
    for (std::thread& t : threads) t.join();
    threadIdx = saved_t;
    blockIdx = saved_b;
    blockDim = saved_bd;
    gridDim = saved_gd;

    if (L.failed.load()) {
        err = L.error;
        return false;
    }
    return true;
}

}  // namespace pyfa_emu
