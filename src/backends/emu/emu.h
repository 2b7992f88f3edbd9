// emu.h: what a kernel file needs from CUDA when it is compiled as plain C++ and run on
// the CPU by the emulation runtime (context.cpp, scheduler.cpp, shuffle.cpp).
//
// Model: one OS worker runs one block at a time; the block's threads are cooperatively
// scheduled fibers on that worker. A fiber runs until it reaches __syncthreads(), a warp
// shuffle, or its end; the scheduler then resumes the next fiber in the chosen order.
// threadIdx and friends are thread_local globals that the scheduler sets before each
// resume, which is sound because a fiber never migrates to another OS thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

extern thread_local dim3 threadIdx;
extern thread_local dim3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __align__(n) alignas(n)

constexpr int warpSize = 32;

namespace pyfa_emu {

enum class ShflMode : int { Idx = 0, Up = 1, Down = 2, Xor = 3 };

// Block-wide barrier over the block's live (not yet returned) threads. file/line name
// the call site: threads waiting at different sites are an error, never a hang.
void syncthreads(const char* file, int line);

// Warp shuffle on raw 32-bit values: every lane of `mask` must arrive, then each gets
// the value of its source lane (CUDA semantics for width and out-of-range lanes).
uint32_t shfl(uint32_t mask, uint32_t value, int lane_arg, int width, ShflMode mode,
              const char* file, int line);

// The block's dynamic shared memory: `smem_bytes` of the launch, 16-byte aligned,
// filled with NaN (0xFFFFFFFF words) before every block so reads before writes show.
unsigned char* dynamic_smem();

// At most this many OS workers per launch. Blocks run one per worker, so workers beyond
// the host's cores buy nothing, and each costs an OS thread, a fiber stack per thread of
// the block and its own shared memory (500 workers took 210 MB). 256 is above the core
// count of most hosts and bounds one launch to 256 x 1024 guarded stacks.
constexpr int kMaxWorkers = 256;

// Usable stack of each emulated thread, in bytes; a guard region lies below it
// (context.cpp). The library's kernels use at most 1.6 KiB of it, in optimised, -O0 and
// AddressSanitizer builds alike (tests/emu/emu_faults.cpp, "stack"); the rest is a margin
// that costs address space, not memory, since untouched pages are never backed.
constexpr size_t kFiberStackBytes = 64 * 1024;

class StrictSession;  // strict.h

struct LaunchOptions {
    int order = 0;          // 0 forward, 1 reverse, 2 shuffled (see pyfa_emu_order)
    uint64_t seed = 0;      // for the shuffled order
    int workers = 0;        // OS threads, at most kMaxWorkers; 0: one per core, capped there
    // Called now and then (at most about every 50 ms, from one worker at a time, never
    // from an emulated thread) with blocks done and blocks in the grid, and once more
    // with done == total when the grid is complete. A nonzero return stops the launch.
    int (*progress)(void* user, int64_t done, int64_t total) = nullptr;
    void* progress_user = nullptr;
    // Strict mode (strict.h): every shared and global access of the kernel is checked
    // against this session's record; nullptr runs the launch unchecked. The body must
    // then be a kernel of the instrumented compilation (emu_strict_kernels.cpp).
    StrictSession* strict = nullptr;
};

// Why a launch failed.
enum class Error : int {
    None = 0,
    InvalidLaunch,    // a block over 1024 threads, an empty grid, bad options, ...
    Divergence,       // barrier divergence, deadlock, or a shuffle used against its rules
    KernelException,  // a kernel thread threw a C++ exception
    OutOfMemory,      // no worker could get its fiber stacks and shared memory
    Cancelled,        // the progress callback returned nonzero
    Hazard,           // strict mode: a race, async, init, bounds, align or barrier hazard
};

struct LaunchResult {
    Error error = Error::None;
    int workers = 0;         // workers that got their stacks and ran blocks
    char message[1024] = {};  // why it failed ("" on success); built without allocating
};

// Runs body() once per thread of every block of the grid and returns when all are done,
// or stops at the first failure (the remaining blocks are then not run). Never throws:
// every failure, running out of memory included, comes back in *result.
Error launch(dim3 grid, dim3 block, size_t smem_bytes, const LaunchOptions& options,
             const std::function<void()>& body, LaunchResult* result) noexcept;

// Diagnostics: mean cost in ns of one fiber context switch, from a ping-pong of
// `switches`; a negative value when no fiber stack could be had.
double context_switch_ns(long switches) noexcept;

// Frees the workers at rest (kept between launches with their fiber stacks and shared
// memory); later launches make new ones.
void release_workers() noexcept;

// Diagnostics: deepest stack use in bytes of any emulated thread so far, over the
// workers at rest (kept between launches).
size_t stack_high_water() noexcept;

}  // namespace pyfa_emu

#define __syncthreads() ::pyfa_emu::syncthreads(__FILE__, __LINE__)

// Strict mode's hooks for the accesses the compiler's instrumentation cannot see as what
// they are (strict.cpp): 8- and 16-byte vector loads and stores, and cp.async with its
// commit and wait. Outside a strict launch each is the plain operation.
namespace pyfa_emu {
void strict_load(void* out, const void* p, int bytes, const char* file, int line);
void strict_store(void* p, const void* in, int bytes, const char* file, int line);
void strict_cp_async(void* dst, const void* src, bool valid, const char* file, int line);
void strict_cp_commit();
void strict_cp_wait(int n, const char* file, int line);
}  // namespace pyfa_emu

namespace pyfa_emu_detail {
template <class T>
inline uint32_t to_bits(T v) {
    static_assert(sizeof(T) == 4, "emulated shuffles move 32-bit values");
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}
template <class T>
inline T from_bits(uint32_t u) {
    T v;
    std::memcpy(&v, &u, 4);
    return v;
}
}  // namespace pyfa_emu_detail

#define PYFA_EMU_SHFL(mask, v, lane, width, mode)                                              \
    pyfa_emu_detail::from_bits<std::decay_t<decltype(v)>>(::pyfa_emu::shfl(                               \
        (mask), pyfa_emu_detail::to_bits(v), (lane), (width), (mode), __FILE__, __LINE__))
#define __shfl_sync(mask, v, lane, ...) \
    PYFA_EMU_SHFL(mask, v, lane, pyfa_emu_width(__VA_ARGS__), ::pyfa_emu::ShflMode::Idx)
#define __shfl_up_sync(mask, v, delta, ...) \
    PYFA_EMU_SHFL(mask, v, delta, pyfa_emu_width(__VA_ARGS__), ::pyfa_emu::ShflMode::Up)
#define __shfl_down_sync(mask, v, delta, ...) \
    PYFA_EMU_SHFL(mask, v, delta, pyfa_emu_width(__VA_ARGS__), ::pyfa_emu::ShflMode::Down)
#define __shfl_xor_sync(mask, v, lanemask, ...) \
    PYFA_EMU_SHFL(mask, v, lanemask, pyfa_emu_width(__VA_ARGS__), ::pyfa_emu::ShflMode::Xor)

inline int pyfa_emu_width() { return warpSize; }
inline int pyfa_emu_width(int w) { return w; }

inline float __int_as_float(int i) { return pyfa_emu_detail::from_bits<float>(static_cast<uint32_t>(i)); }
inline int __float_as_int(float f) { return static_cast<int>(pyfa_emu_detail::to_bits(f)); }
inline float __uint_as_float(unsigned u) { return pyfa_emu_detail::from_bits<float>(u); }
inline unsigned __float_as_uint(float f) { return pyfa_emu_detail::to_bits(f); }
