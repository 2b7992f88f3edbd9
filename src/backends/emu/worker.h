// worker.h: the scheduler's state (scheduler.cpp), shared with the shuffle emulation
// (shuffle.cpp). Internal to src/backends/emu.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "backends/emu/emu.h"
#include "backends/emu/fiber.h"

namespace pyfa_emu {
namespace detail {

constexpr uint32_t kPoison = 0xFFFFFFFFu;  // a NaN as float32, what undefined values read as
constexpr size_t kMessageBytes = sizeof(LaunchResult::message);

// Builds a message in a fixed buffer, truncating what does not fit: reporting a failure
// never allocates, so it works when memory has run out.
class Msg {
public:
    Msg(char* buf, size_t cap) : buf_(buf), cap_(cap) {
        if (cap_) buf_[0] = '\0';
    }
    Msg& operator<<(const char* s) {
        while (s && *s) put(*s++);
        return *this;
    }
    template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
    Msg& operator<<(T v) {
        unsigned long long u = static_cast<unsigned long long>(v);
        if (std::is_signed_v<T> && v < 0) {
            put('-');
            u = 0ull - u;
        }
        char digits[24];
        int n = 0;
        do {
            digits[n++] = char('0' + u % 10);
            u /= 10;
        } while (u);
        while (n) put(digits[--n]);
        return *this;
    }
    void put(char c) {
        if (len_ + 1 >= cap_) return;
        buf_[len_++] = c;
        buf_[len_] = '\0';
    }

private:
    char* buf_;
    size_t cap_;
    size_t len_ = 0;
};

// Things a message names, each written by an operator<< (scheduler.cpp).
struct Hex32 {
    uint32_t v;
};
struct Dim {
    dim3 d;
};
struct Site {
    const char* file;
    int line;
};

enum class State : uint8_t { Runnable, Barrier, Shfl, Done };

struct Worker;
struct StrictBlock;  // strict.cpp: the access record of the block a strict worker runs
struct StrictBlockDeleter {
    void operator()(StrictBlock* b) const noexcept;
};

struct Fiber {
    Context ctx;
    unsigned char* stack = nullptr;  // lowest usable address; a guard region lies below
    Worker* worker = nullptr;
    State state = State::Runnable;
    const char* file = nullptr;  // site of the barrier or shuffle it waits at
    int line = 0;
    uint32_t mask = 0, value = 0, result = 0;
    int lane_arg = 0, width = 0;
    ShflMode mode = ShflMode::Idx;
    bool threw = false;
    bool listed = false;  // scratch of describe_waiters
    char what[160] = {};  // the exception's what(), when it threw one
    void* asan_fake = nullptr;
};

// One launch, shared by its workers.
struct LaunchShared {
    dim3 grid, block;
    unsigned nthreads = 0;
    size_t smem_bytes = 0;
    LaunchOptions options;
    const std::function<void()>* body = nullptr;
    uint64_t total_blocks = 0;
    std::atomic<uint64_t> next{0};         // next block to hand out
    std::atomic<uint64_t> blocks_done{0};
    std::atomic<int> workers_running{0};
    std::atomic<bool> stop{false};         // a failure or a cancellation: finish nothing more
    std::atomic<bool> claimed{false};      // the first failure owns error and message
    Error error = Error::None;
    char message[kMessageBytes] = {};

    // Progress: the next time (steady clock, ns) it is due, and who is reporting now.
    std::atomic<int64_t> progress_due_ns{0};
    std::atomic<bool> progress_busy{false};

    void fail(Error kind, const char* msg) noexcept;
};

// What one OS thread needs to run blocks: stacks and shared memory, obtained before it
// takes its first block of a launch, and kept for later blocks and launches (at rest in
// a pool between launches).
struct Worker {
    Worker* next_free = nullptr;  // in the pool of workers at rest
    StackPool stacks;
    std::unique_ptr<Fiber[]> fibers;
    unsigned fiber_capacity = 0;
    std::unique_ptr<unsigned[]> order;
    unsigned char* smem_raw = nullptr;  // malloc'd; smem_capacity + 15 bytes
    size_t smem_capacity = 0;
    unsigned char* smem = nullptr;

    // Thread-local addresses kept in memory: in a shared library GCC would otherwise recompute
    // them (a __tls_get_addr call each) after every context switch instead of keeping them.
    dim3 *tls_tid = nullptr, *tls_bid = nullptr, *tls_bdim = nullptr, *tls_gdim = nullptr;

    // Strict mode (strict.h): the launch's session, nullptr in a plain launch, and this
    // worker's record of the block it runs. Shared memory then has red zones of
    // kStrictRedZoneBytes on both sides, smem_pad bytes each.
    StrictSession* strict = nullptr;
    std::unique_ptr<StrictBlock, StrictBlockDeleter> strict_block;
    size_t smem_pad = 0;
    size_t smem_bytes = 0;  // of the launch

    Context sched;
    AsanStack sched_stack;
    const std::function<void()>* body = nullptr;
    Fiber* current = nullptr;
    bool in_block = false;

    // The block being run.
    dim3 bidx, bdim;
    unsigned nthreads = 0;
    unsigned live = 0, runnable = 0;
    Error error = Error::None;
    char message[kMessageBytes] = {};

    Worker() = default;
    ~Worker();
    Worker(const Worker&) = delete;
    Worker& operator=(const Worker&) = delete;

    // The block's first failure wins; later ones write into a discarded buffer. The
    // message starts with the block's name.
    Msg fail(Error kind);
    bool failed() const { return error != Error::None; }
};

// The worker of this OS thread while it runs blocks (nullptr otherwise). __thread, not
// thread_local: a plain TLS slot, without the wrapper call C++ puts on extern thread_local.
extern __thread Worker* t_worker __attribute__((visibility("hidden")));

// Suspends the running fiber and returns to its worker's scheduler.
inline void park(Worker* w, Fiber* f) {
    asan_start(&f->asan_fake, w->sched_stack.bottom, w->sched_stack.size);
    ctx_switch(f->ctx, w->sched);
    asan_finish(f->asan_fake, &w->sched_stack);
}

// Message pieces (scheduler.cpp).
Msg& operator<<(Msg& m, Hex32 h);
Msg& operator<<(Msg& m, Dim d);
Msg& operator<<(Msg& m, Site s);
// A thread by its linear id: "7", or "(1,2,0)" in a 2-D or 3-D block.
void put_thread(Msg& m, const Worker& w, unsigned id);
bool same_site(const Fiber& a, const Fiber& b);

// Strict mode (strict.cpp), called by the scheduler of a strict launch.
// Before the worker's first block: false when the record's memory cannot be had.
bool strict_attach(Worker& w, unsigned nthreads, size_t smem_bytes) noexcept;
// Before each block: a fresh record.
void strict_block_begin(Worker& w) noexcept;
// After each block: false, with the block failed, when a shared word was read that no
// thread ever wrote.
bool strict_block_end(Worker& w) noexcept;
// Every live thread waits at one __syncthreads: false, with the block failed, when some
// thread has returned instead; otherwise the barrier is recorded.
bool strict_barrier(Worker& w, const char* file, int line) noexcept;
// The lanes `group` of `warp` passed a warp sync (a shuffle or __syncwarp) together.
void strict_warp_sync(Worker& w, unsigned warp, uint32_t group) noexcept;

// The shuffle emulation (shuffle.cpp), called by the scheduler.
// After fiber `id` parked at a shuffle: releases its group once every lane has arrived.
void shfl_arrived(Worker& w, unsigned id);
// After fiber `id` returned: fails the block if a lane still waits for it at a shuffle.
void shfl_check_returned(Worker& w, unsigned id);

}  // namespace detail
}  // namespace pyfa_emu
