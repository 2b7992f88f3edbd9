// fiber.h: the emulator's machine layer (context.cpp): switching between fiber contexts,
// fiber stacks with guard pages, the floating-point environment kernels run in, and the
// sanitizer hooks. Internal to src/backends/emu.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cfenv>

#include "backends/emu/emu.h"

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

// PYFA_EMU_USE_UCONTEXT forces the portable path (e.g. where CET shadow stacks are enforced).
#if !defined(PYFA_EMU_USE_UCONTEXT) && defined(__ELF__) && !defined(_WIN32) && \
    (defined(__x86_64__) || defined(__aarch64__))
#define PYFA_EMU_CTX_ASM 1
#else
#include <ucontext.h>
#endif

#if defined(PYFA_EMU_CTX_ASM)
extern "C" __attribute__((visibility("hidden"))) void pyfa_emu_ctx_switch(void** save_sp,
                                                                         void* load_sp);
#endif

namespace pyfa_emu {
namespace detail {

using EntryFn = void (*)(void*);

#if defined(PYFA_EMU_CTX_ASM)
// A suspended context is just its stack pointer; its callee-saved state lies on its stack.
struct Context {
    void* sp = nullptr;
};
inline void ctx_switch(Context& from, Context& to) { pyfa_emu_ctx_switch(&from.sp, to.sp); }
#else
struct Context {
    ucontext_t uc;
};
inline void ctx_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// Prepares `c` so that the first switch to it runs fn(arg) on [stack, stack + size), in
// the default floating-point environment; fn must never return.
void ctx_make(Context& c, unsigned char* stack, size_t size, EntryFn fn, void* arg);

// The FP environment every kernel thread runs in, whatever the caller's: round to
// nearest, all exceptions masked, no flush-to-zero and no denormals-are-zero (the
// numerical contract, docs/numerics.md). FpEnvScope puts the calling OS thread in it and
// gives the thread its own environment back, status flags included, when it ends.
class FpEnvScope {
public:
    FpEnvScope() noexcept;
    ~FpEnvScope();
    FpEnvScope(const FpEnvScope&) = delete;
    FpEnvScope& operator=(const FpEnvScope&) = delete;

private:
    fenv_t saved_;
};

// Fiber stacks of one worker, in one mapping: below each stack of kFiberStackBytes lies
// a guard region that is never accessible, so an overflow faults (SIGSEGV) at once
// instead of overwriting the neighbouring stack. Kept and reused across blocks.
class StackPool {
public:
    StackPool() = default;
    ~StackPool();
    StackPool(const StackPool&) = delete;
    StackPool& operator=(const StackPool&) = delete;

    // At least n stacks; false, with the pool empty, when the memory cannot be had.
    bool reserve(unsigned n) noexcept;
    unsigned size() const { return count_; }
    // Lowest usable address of stack i; the stack is kFiberStackBytes long.
    unsigned char* stack(unsigned i) const { return base_ + size_t(i) * stride() + guard_bytes(); }
    // Deepest use of any stack so far, from the bytes that are no longer zero.
    size_t high_water() const noexcept;

    static size_t guard_bytes();

private:
    static size_t stride() { return guard_bytes() + kFiberStackBytes; }
    void release() noexcept;

    unsigned char* base_ = nullptr;
    size_t bytes_ = 0;
    unsigned count_ = 0;
    unsigned* valgrind_ids_ = nullptr;
};

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

}  // namespace detail
}  // namespace pyfa_emu
