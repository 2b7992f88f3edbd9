// scheduler.cpp: launches (emu.h). Each OS worker takes blocks of the grid one at a time
// and runs the block's CUDA threads as fibers (context.cpp) in the chosen order, round
// by round: a round resumes every runnable fiber once, and when none is left runnable
// the round ends at a barrier, which is released, or in a reported error. Failures are
// reported without allocating, and nothing throws out of launch().
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <thread>

#include "backends/emu/strict.h"
#include "backends/emu/worker.h"

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace pyfa_emu {
namespace detail {

__thread Worker* t_worker = nullptr;

namespace {

constexpr unsigned kMaxBlockThreads = 1024;
constexpr size_t kMaxSmemBytes = size_t(1) << 30;  // a sanity bound, far above any GPU's
// The progress callback is called at most this often; cancellation latency follows it.
constexpr int64_t kProgressIntervalNs = 50'000'000;
// Barrier rounds between looks at the clock while a progress callback is set: a round
// of a real kernel takes microseconds, so this bounds the clock reads' cost without
// delaying a report by more than a fraction of the interval.
constexpr unsigned kRoundsPerClockRead = 16;

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

void copy_message(char* dst, const char* src) {
    const size_t n = strnlen(src, kMessageBytes - 1);
    std::memcpy(dst, src, n);
    dst[n] = '\0';
}

}  // namespace

void LaunchShared::fail(Error kind, const char* msg) noexcept {
    if (!claimed.exchange(true, std::memory_order_acq_rel)) {
        error = kind;
        copy_message(message, msg);
    }
    stop.store(true, std::memory_order_relaxed);
}

Worker::~Worker() { std::free(smem_raw); }

Msg Worker::fail(Error kind) {
    if (failed()) return Msg(nullptr, 0);
    // In strict mode a divergence is the barrier check's hazard.
    const bool barrier = strict && kind == Error::Divergence;
    error = barrier ? Error::Hazard : kind;
    Msg m(message, sizeof message);
    m << "pyfa emu: block " << Dim{bidx} << ": ";
    if (barrier) m << "check barrier in " << strict->kernel() << ": ";
    return m;
}

// ---------------------------------------------------------------------------------------
// Message pieces.
// ---------------------------------------------------------------------------------------
Msg& operator<<(Msg& m, Hex32 h) {
    static const char digits[] = "0123456789abcdef";
    m << "0x";
    for (int i = 28; i >= 0; i -= 4) m.put(digits[(h.v >> i) & 15]);
    return m;
}

Msg& operator<<(Msg& m, Dim d) { return m << "(" << d.d.x << "," << d.d.y << "," << d.d.z << ")"; }

Msg& operator<<(Msg& m, Site s) { return m << (s.file ? s.file : "?") << ":" << s.line; }

void put_thread(Msg& m, const Worker& w, unsigned id) {
    if (w.bdim.y == 1 && w.bdim.z == 1) {
        m << id;
        return;
    }
    unsigned x = id % w.bdim.x, y = (id / w.bdim.x) % w.bdim.y, z = id / (w.bdim.x * w.bdim.y);
    m << Dim{dim3(x, y, z)};
}

bool same_site(const Fiber& a, const Fiber& b) {
    if (a.line != b.line) return false;
    if (a.file == b.file) return true;
    return a.file && b.file && std::strcmp(a.file, b.file) == 0;
}

namespace {

// The threads from `first` on that `in_group` selects, as compact ranges ("0-15, 17"),
// each marked listed.
template <class Pred>
void put_thread_ranges(Msg& m, Worker& w, unsigned first, Pred in_group) {
    unsigned shown = 0;
    for (unsigned i = first; i < w.nthreads;) {
        if (!in_group(w.fibers[i])) {
            ++i;
            continue;
        }
        unsigned j = i;
        while (j + 1 < w.nthreads && in_group(w.fibers[j + 1])) ++j;
        for (unsigned k = i; k <= j; ++k) w.fibers[k].listed = true;
        if (shown == 8) {
            m << ", ...";
        } else if (shown < 8) {
            if (shown) m << ", ";
            put_thread(m, w, i);
            if (j > i) {
                m << "-";
                put_thread(m, w, j);
            }
        }
        ++shown;
        i = j + 1;
    }
}

void put_wait(Msg& m, const Fiber& f) {
    if (f.state == State::Barrier)
        m << "__syncthreads at " << Site{f.file, f.line};
    else
        m << "shuffle (mask " << Hex32{f.mask} << ") at " << Site{f.file, f.line};
}

// Describes every waiting thread, grouped by what it waits at.
void put_waiters(Msg& m, Worker& w) {
    for (unsigned i = 0; i < w.nthreads; ++i) w.fibers[i].listed = false;
    bool any = false;
    for (unsigned i = 0; i < w.nthreads; ++i) {
        const Fiber& f = w.fibers[i];
        if (f.listed || (f.state != State::Barrier && f.state != State::Shfl)) continue;
        if (any) m << "; ";
        any = true;
        m << "threads ";
        put_thread_ranges(m, w, i, [&](const Fiber& g) {
            return !g.listed && g.state == f.state && same_site(f, g) &&
                   (f.state == State::Barrier || g.mask == f.mask);
        });
        m << " wait at ";
        put_wait(m, f);
    }
    for (unsigned i = 0; i < w.nthreads; ++i) {
        if (w.fibers[i].state != State::Done) continue;
        m << "; threads ";
        put_thread_ranges(m, w, i, [](const Fiber& g) { return g.state == State::Done; });
        m << " have returned";
        break;
    }
}

// ---------------------------------------------------------------------------------------
// Fibers.
// ---------------------------------------------------------------------------------------

// Workers at rest, shared by all launches and OS threads: a worker keeps its stacks,
// fibers and shared memory from one launch to the next, so that a launch's fresh threads
// do not map, fault in and unmap them again. Trivially destructible, so it never goes
// away under a launch still running at exit; g_pool_release empties it at unload.
struct WorkerPool {
    std::atomic_flag busy = ATOMIC_FLAG_INIT;
    Worker* head = nullptr;
    size_t count = 0;
    bool closed = false;  // unloading: workers coming back are freed, not kept
};
WorkerPool g_pool;

class PoolLock {
public:
    PoolLock() {
        while (g_pool.busy.test_and_set(std::memory_order_acquire)) std::this_thread::yield();
    }
    ~PoolLock() { g_pool.busy.clear(std::memory_order_release); }
};

// A worker at rest, or a new one; nullptr when there is no memory for it.
Worker* take_worker() noexcept {
    {
        PoolLock lock;
        if (Worker* w = g_pool.head) {
            g_pool.head = w->next_free;
            --g_pool.count;
            return w;
        }
    }
    return new (std::nothrow) Worker;
}

// At most one worker per core stays at rest (what a launch with the default worker
// count uses); the ones beyond free their memory.
void put_back(Worker* w) noexcept {
    static const size_t keep = std::max(1u, std::thread::hardware_concurrency());
    {
        PoolLock lock;
        if (!g_pool.closed && g_pool.count < keep) {
            w->next_free = g_pool.head;
            g_pool.head = w;
            ++g_pool.count;
            return;
        }
    }
    delete w;
}

// When the library is unloaded (dlclose, or the end of the process) the workers at rest
// are freed: each holds a few hundred mappings (fiber stacks and their guards), which a
// process loading and unloading the library would otherwise gather until it reaches the
// mapping limit. Only workers at rest are touched: a launch still running then (another
// thread at process exit) keeps its own and frees them when it ends.
struct PoolRelease {
    ~PoolRelease() {
        Worker* w = nullptr;
        {
            PoolLock lock;
            w = g_pool.head;
            g_pool.head = nullptr;
            g_pool.count = 0;
            g_pool.closed = true;
        }
        while (w) {
            Worker* next = w->next_free;
            delete w;
            w = next;
        }
    }
};
PoolRelease g_pool_release;

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
        std::strncpy(f->what, e.what(), sizeof f->what - 1);
        f->what[sizeof f->what - 1] = '\0';
    } catch (...) {
        f->threw = true;
    }
    f->state = State::Done;
    fiber_exit(f);
}

// Called by the scheduler after fiber `id` returned from the kernel.
void fiber_done(Worker& w, unsigned id) {
    Fiber& f = w.fibers[id];
    --w.live;
    if (f.threw) {
        Msg m = w.fail(Error::KernelException);
        m << "thread ";
        put_thread(m, w, id);
        m << " threw an exception: " << (f.what[0] ? f.what : "(not a std::exception)");
        return;
    }
    shfl_check_returned(w, id);
}

// Nothing can run: either all live threads wait at one barrier, or it is an error.
void release_or_fail(Worker& w) {
    const Fiber* first = nullptr;
    bool ok = true;
    for (unsigned i = 0; i < w.nthreads && ok; ++i) {
        const Fiber& f = w.fibers[i];
        if (f.state == State::Done) continue;
        if (f.state != State::Barrier || (first && !same_site(*first, f))) ok = false;
        if (!first) first = &f;
    }
    if (!ok) {
        Msg m = w.fail(Error::Divergence);
        m << "deadlock or barrier divergence: ";
        put_waiters(m, w);
        return;
    }
    if (w.strict && !strict_barrier(w, first->file, first->line)) return;
    for (unsigned i = 0; i < w.nthreads; ++i) {
        Fiber& f = w.fibers[i];
        if (f.state == State::Barrier) {
            f.state = State::Runnable;
            ++w.runnable;
        }
    }
}

// Everything a block of this launch needs, before the worker takes any block: a worker
// that cannot have it stays out, and the others run the grid.
bool ensure_capacity(Worker& w, unsigned nthreads, size_t smem_bytes, size_t pad) noexcept {
    if (!w.stacks.reserve(nthreads)) return false;
    if (w.fiber_capacity < nthreads) {
        w.fibers.reset();
        w.order.reset();
        w.fiber_capacity = 0;
        w.fibers.reset(new (std::nothrow) Fiber[nthreads]);
        w.order.reset(new (std::nothrow) unsigned[nthreads]);
        if (!w.fibers || !w.order) return false;
        w.fiber_capacity = nthreads;
    }
    const size_t want = std::max<size_t>(smem_bytes, 16) + 2 * pad;
    if (w.smem_capacity < want) {
        std::free(w.smem_raw);
        w.smem_capacity = 0;
        w.smem_raw = static_cast<unsigned char*>(std::malloc(want + 15));
        if (!w.smem_raw) return false;
        w.smem_capacity = want;
    }
    uintptr_t p = reinterpret_cast<uintptr_t>(w.smem_raw);
    w.smem = reinterpret_cast<unsigned char*>((p + 15) & ~uintptr_t(15)) + pad;
    w.smem_pad = pad;
    w.smem_bytes = smem_bytes;
    return true;
}

struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
};

// Calls the progress callback when it is due and no other worker is calling it.
void poll_progress(LaunchShared& L) noexcept {
    const int64_t now = now_ns();
    if (now < L.progress_due_ns.load(std::memory_order_relaxed)) return;
    if (L.progress_busy.exchange(true, std::memory_order_acquire)) return;
    if (now >= L.progress_due_ns.load(std::memory_order_relaxed) &&
        !L.stop.load(std::memory_order_relaxed)) {
        const int64_t done = int64_t(L.blocks_done.load(std::memory_order_relaxed));
        if (L.options.progress(L.options.progress_user, done, int64_t(L.total_blocks)) != 0)
            L.fail(Error::Cancelled, "pyfa emu: cancelled by the progress callback");
        // Counted from the callback's return, so a slow callback does not run back to back.
        L.progress_due_ns.store(now_ns() + kProgressIntervalNs, std::memory_order_relaxed);
    }
    L.progress_busy.store(false, std::memory_order_release);
}

// Runs one block on this OS thread. Returns false with w.error set on failure, or when
// the launch was stopped by another worker.
bool run_block(Worker& w, LaunchShared& L, uint64_t linear) {
    const dim3 grid = L.grid, block = L.block;
    w.bdim = block;
    w.bidx = dim3(unsigned(linear % grid.x), unsigned((linear / grid.x) % grid.y),
                  unsigned(linear / (uint64_t(grid.x) * grid.y)));
    const unsigned n = L.nthreads;
    w.nthreads = n;
    w.error = Error::None;
    w.message[0] = '\0';
    w.body = L.body;
    std::memset(w.smem - w.smem_pad, 0xFF, std::max<size_t>(L.smem_bytes, 16) + 2 * w.smem_pad);
    if (w.strict) strict_block_begin(w);

    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = w.fibers[i];
        f.stack = w.stacks.stack(i);
        f.worker = &w;
        f.state = State::Runnable;
        f.threw = false;
        f.what[0] = '\0';
        f.asan_fake = nullptr;
        asan_unpoison(f.stack, kFiberStackBytes);  // frames of fibers abandoned by a failed block
        ctx_make(f.ctx, f.stack, kFiberStackBytes, &fiber_entry, &f);
    }
    w.live = n;
    w.runnable = n;

    unsigned* const order = w.order.get();
    for (unsigned i = 0; i < n; ++i) order[i] = L.options.order == 1 ? n - 1 - i : i;
    Rng rng{L.options.seed ^ (0xD1B54A32D192ED03ull * (linear + 1))};

    dim3* const t_tid = w.tls_tid;
    dim3* const t_bid = w.tls_bid;
    dim3* const t_bdim = w.tls_bdim;
    dim3* const t_gdim = w.tls_gdim;
    const unsigned bx = block.x, bxy = block.x * block.y;
    const bool progress = L.options.progress != nullptr;
    unsigned rounds = 0;

    while (w.live > 0) {
        if (L.options.order == 2) {
            for (unsigned i = n; i > 1; --i) std::swap(order[i - 1], order[rng.next() % i]);
        }
        for (unsigned k = 0; k < n && w.runnable > 0; ++k) {
            const unsigned id = order[k];
            Fiber& f = w.fibers[id];
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
            if (f.state == State::Shfl)
                shfl_arrived(w, id);
            else if (f.state == State::Done)
                fiber_done(w, id);
            if (w.failed()) return false;
            if (L.stop.load(std::memory_order_relaxed)) return false;
        }
        if (w.live > 0 && w.runnable == 0) {
            release_or_fail(w);
            if (w.failed()) return false;
            if (progress && ++rounds % kRoundsPerClockRead == 0) {
                poll_progress(L);
                if (L.stop.load(std::memory_order_relaxed)) return false;
            }
        }
    }
    return !w.strict || strict_block_end(w);
}

void worker_loop(LaunchShared& L) noexcept {
    // Kernel threads start in the default FP environment (ctx_make); the worker runs in
    // it too, and the calling thread gets its own back when the loop ends.
    FpEnvScope fp_env;
    Worker* const wp = take_worker();
    if (!wp) return;
    const size_t pad = L.options.strict ? kStrictRedZoneBytes : 0;
    if (!ensure_capacity(*wp, L.nthreads, L.smem_bytes, pad) ||
        (L.options.strict && !strict_attach(*wp, L.nthreads, L.smem_bytes))) {
        put_back(wp);
        return;
    }
    Worker& w = *wp;
    w.tls_tid = &threadIdx;
    w.tls_bid = &blockIdx;
    w.tls_bdim = &blockDim;
    w.tls_gdim = &gridDim;
    Worker* saved = t_worker;
    t_worker = &w;
    w.strict = L.options.strict;
    w.in_block = true;
    const bool progress = L.options.progress != nullptr;
    // Counted at its first block: a worker that comes late to a drained grid may have
    // taken a finished worker's memory from the pool, and ran nothing.
    bool counted = false;
    while (!L.stop.load(std::memory_order_relaxed)) {
        uint64_t linear = L.next.fetch_add(1, std::memory_order_relaxed);
        if (linear >= L.total_blocks) break;
        if (!counted) {
            L.workers_running.fetch_add(1, std::memory_order_relaxed);
            counted = true;
        }
        if (!run_block(w, L, linear)) {
            if (w.failed()) L.fail(w.error, w.message);
            break;
        }
        L.blocks_done.fetch_add(1, std::memory_order_relaxed);
        if (progress) poll_progress(L);
    }
    w.in_block = false;
    w.strict = nullptr;
    w.current = nullptr;
    t_worker = saved;
    put_back(wp);
}

bool dims_ok(dim3 grid, dim3 block, Msg& why) {
    if (grid.x < 1 || grid.y < 1 || grid.z < 1) {
        why << "grid " << Dim{grid} << " has an empty dimension";
        return false;
    }
    if (grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
        why << "grid " << Dim{grid} << " exceeds CUDA's limits (2^31-1, 65535, 65535)";
        return false;
    }
    if (block.x < 1 || block.y < 1 || block.z < 1) {
        why << "block " << Dim{block} << " has an empty dimension";
        return false;
    }
    if (block.x > 1024 || block.y > 1024 || block.z > 64 ||
        uint64_t(block.x) * block.y * block.z > kMaxBlockThreads) {
        why << "block " << Dim{block} << " exceeds CUDA's limits (1024 threads, z up to 64)";
        return false;
    }
    return true;
}

Error check_launch(dim3 grid, dim3 block, size_t smem_bytes, const LaunchOptions& options,
                   const std::function<void()>& body, Msg& m) {
    m << "pyfa emu: invalid launch: ";
    if (!dims_ok(grid, block, m)) return Error::InvalidLaunch;
    if (smem_bytes > kMaxSmemBytes) {
        m << smem_bytes << " bytes of dynamic shared memory (the emulator allows up to 1 GiB)";
        return Error::InvalidLaunch;
    }
    if (options.order < 0 || options.order > 2) {
        m << "thread order " << options.order << " (0 forward, 1 reverse, 2 shuffled)";
        return Error::InvalidLaunch;
    }
    if (options.workers < 0 || options.workers > kMaxWorkers) {
        m << options.workers << " workers (0 to " << kMaxWorkers << ")";
        return Error::InvalidLaunch;
    }
    if (!body) {
        m << "empty kernel body";
        return Error::InvalidLaunch;
    }
    if (t_worker) {
        m << "launch called from inside an emulated kernel";
        return Error::InvalidLaunch;
    }
    return Error::None;
}

}  // namespace
}  // namespace detail

void release_workers() noexcept {
    using namespace detail;
    Worker* list;
    {
        PoolLock lock;
        list = g_pool.head;
        g_pool.head = nullptr;
        g_pool.count = 0;
    }
    while (list) {
        Worker* next = list->next_free;
        delete list;
        list = next;
    }
}

size_t stack_high_water() noexcept {
    using namespace detail;
    PoolLock lock;
    size_t deepest = 0;
    for (const Worker* w = g_pool.head; w; w = w->next_free)
        deepest = std::max(deepest, w->stacks.high_water());
    return deepest;
}

void syncthreads(const char* file, int line) {
    using namespace detail;
    Worker* w = t_worker;
    if (!w || !w->current) return;  // outside a kernel thread there is nothing to wait for
    Fiber* f = w->current;
    f->state = State::Barrier;
    f->file = file;
    f->line = line;
    park(w, f);
}

unsigned char* dynamic_smem() {
    detail::Worker* w = detail::t_worker;
    return w && w->in_block ? w->smem : nullptr;
}

Error launch(dim3 grid, dim3 block, size_t smem_bytes, const LaunchOptions& options,
             const std::function<void()>& body, LaunchResult* result) noexcept {
    using namespace detail;
    LaunchResult scratch;
    LaunchResult& res = result ? *result : scratch;
    res.error = Error::None;
    res.workers = 0;
    Msg invalid(res.message, sizeof res.message);
    if ((res.error = check_launch(grid, block, smem_bytes, options, body, invalid)) != Error::None)
        return res.error;
    res.message[0] = '\0';

    LaunchShared L;
    L.grid = grid;
    L.block = block;
    L.nthreads = block.x * block.y * block.z;
    L.smem_bytes = smem_bytes;
    L.options = options;
    L.body = &body;
    L.total_blocks = uint64_t(grid.x) * grid.y * grid.z;
    if (options.progress) L.progress_due_ns.store(now_ns() + kProgressIntervalNs);

    uint64_t nworkers = options.workers > 0 ? unsigned(options.workers)
                                            : std::max(1u, std::thread::hardware_concurrency());
    nworkers = std::min<uint64_t>({nworkers, uint64_t(kMaxWorkers), L.total_blocks});

    // The host thread's own index variables are not the kernel's business: restore them.
    const dim3 saved_t = threadIdx, saved_b = blockIdx, saved_bd = blockDim, saved_gd = gridDim;
    // Fewer workers than asked when threads cannot be made: the ones that exist still
    // drain the grid, as do the ones that get their memory.
    std::thread* threads = static_cast<std::thread*>(
        std::malloc(sizeof(std::thread) * size_t(nworkers - 1 ? nworkers - 1 : 1)));
    uint64_t started = 0;
    if (threads) {
        for (uint64_t i = 1; i < nworkers; ++i) {
            try {
                new (&threads[started]) std::thread(worker_loop, std::ref(L));
                ++started;
            } catch (...) {
                break;
            }
        }
    }
    worker_loop(L);
    for (uint64_t i = 0; i < started; ++i) {
        threads[i].join();
        threads[i].~thread();
    }
    std::free(threads);
    threadIdx = saved_t;
    blockIdx = saved_b;
    blockDim = saved_bd;
    gridDim = saved_gd;
    res.workers = L.workers_running.load();

    if (L.claimed.load(std::memory_order_acquire)) {
        res.error = L.error;
        copy_message(res.message, L.message);
        return res.error;
    }
    if (L.blocks_done.load() < L.total_blocks) {
        // Every worker stayed out for want of memory.
        Msg m(res.message, sizeof res.message);
        m << "pyfa emu: out of memory: no worker could get " << L.nthreads << " fiber stacks of "
          << kFiberStackBytes / 1024 << " KiB and " << smem_bytes << " bytes of shared memory";
        return res.error = Error::OutOfMemory;
    }
    if (options.progress &&
        options.progress(options.progress_user, int64_t(L.total_blocks), int64_t(L.total_blocks)) != 0) {
        copy_message(res.message, "pyfa emu: cancelled by the progress callback");
        return res.error = Error::Cancelled;
    }
    return Error::None;
}

}  // namespace pyfa_emu
