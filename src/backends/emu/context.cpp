// context.cpp: the emulator's machine layer declared in fiber.h: the context switch (a
// small hand-written one, ucontext where none exists), guarded fiber stacks, and the
// floating-point environment kernel threads run in.
#include "backends/emu/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define PYFA_EMU_VALGRIND 1
#endif
#endif

// ---------------------------------------------------------------------------------------
// Context switch. A new context's stack is prepared so that the first switch to it
// "returns" into pyfa_emu_ctx_start, which calls fn(arg).
// ---------------------------------------------------------------------------------------
#if defined(PYFA_EMU_CTX_ASM) && defined(__x86_64__)
// MXCSR and the x87 control word are callee-saved under the SysV ABI, so they travel too:
// each fiber keeps its own FP environment. It leaves by pop+jmp, not ret: a ret into
// another stack always misses the return-address predictor, which measured 3x slower
// (17 ns against 5.5 ns per switch). Aligned to a cache line: starting 32 bytes into one,
// the same code measured 12 ns against 6 ns per switch.
asm(R"(
    .pushsection .text
    .globl pyfa_emu_ctx_switch
    .hidden pyfa_emu_ctx_switch
    .type pyfa_emu_ctx_switch, @function
    .p2align 6
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
#elif defined(PYFA_EMU_CTX_ASM) && defined(__aarch64__)
// Leaves by ret, not br: under BTI a br to a return address would fault. FPCR is not
// saved: it is per OS thread, and FpEnvScope sets it before any fiber of the worker runs.
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
#endif

#if defined(PYFA_EMU_CTX_ASM)
extern "C" __attribute__((visibility("hidden"))) void pyfa_emu_ctx_start();
#endif

namespace pyfa_emu {
namespace detail {

#if defined(__x86_64__)
// The power-on defaults (what FE_DFL_ENV means): every exception masked, round to
// nearest, no FTZ (MXCSR bit 15) and no DAZ (bit 6); x87 at 64-bit precision.
constexpr uint32_t kDefaultMxcsr = 0x1F80;
constexpr uint16_t kDefaultX87Control = 0x037F;
#endif

#if defined(PYFA_EMU_CTX_ASM)
void ctx_make(Context& c, unsigned char* stack, size_t size, EntryFn fn, void* arg) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
#if defined(__x86_64__)
    // Layout popped by pyfa_emu_ctx_switch: csr word, r15, r14, r13, r12, rbx, rbp, return.
    // The csr word is the default environment, never the caller's.
    uint64_t* frame = reinterpret_cast<uint64_t*>(top - 64);
    frame[0] = uint64_t(kDefaultMxcsr) | (uint64_t(kDefaultX87Control) << 32);
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
#else
namespace {
void ctx_trampoline(unsigned hi, unsigned lo, unsigned fhi, unsigned flo) {
    void* arg = reinterpret_cast<void*>((uintptr_t(hi) << 16 << 16) | uintptr_t(lo));
    EntryFn fn = reinterpret_cast<EntryFn>((uintptr_t(fhi) << 16 << 16) | uintptr_t(flo));
    fn(arg);
}
}  // namespace

// getcontext records the FP environment of the calling worker, which FpEnvScope has set
// to the default before any block runs.
void ctx_make(Context& c, unsigned char* stack, size_t size, EntryFn fn, void* arg) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    uintptr_t a = reinterpret_cast<uintptr_t>(arg), f = reinterpret_cast<uintptr_t>(fn);
    makecontext(&c.uc, reinterpret_cast<void (*)()>(&ctx_trampoline), 4,
                unsigned(a >> 16 >> 16), unsigned(a), unsigned(f >> 16 >> 16), unsigned(f));
}
#endif

// ---------------------------------------------------------------------------------------
// Floating-point environment.
// ---------------------------------------------------------------------------------------
FpEnvScope::FpEnvScope() noexcept {
    fegetenv(&saved_);
#if defined(__x86_64__)
    const uint32_t mxcsr = kDefaultMxcsr;
    const uint16_t control = kDefaultX87Control;
    asm volatile("fnclex\n\tfldcw %0\n\tldmxcsr %1" : : "m"(control), "m"(mxcsr));
#else
    fesetenv(FE_DFL_ENV);
#endif
}

FpEnvScope::~FpEnvScope() { fesetenv(&saved_); }

// ---------------------------------------------------------------------------------------
// Fiber stacks.
// ---------------------------------------------------------------------------------------

// The compilers used here do not probe large frames page by page unless asked
// (-fstack-clash-protection), so one frame can step over a single guard page: a guard as
// large as a whole stack catches any frame up to that size. It is address space only;
// nothing backs it. One page more makes the stride between stacks an odd number of
// pages: with a power-of-two stride every fiber's frames fell into the same cache and
// TLB sets, and a barrier-heavy launch ran 1.5x slower.
size_t StackPool::guard_bytes() {
    static const size_t bytes = [] {
        const long page = sysconf(_SC_PAGESIZE);
        const size_t p = page > 0 ? size_t(page) : 4096;
        return (kFiberStackBytes + p - 1) / p * p + p;
    }();
    return bytes;
}

StackPool::~StackPool() { release(); }

void StackPool::release() noexcept {
    if (!base_) return;
#if defined(PYFA_EMU_VALGRIND)
    if (valgrind_ids_) {
        for (unsigned i = 0; i < count_; ++i) VALGRIND_STACK_DEREGISTER(valgrind_ids_[i]);
    }
#endif
    std::free(valgrind_ids_);
    valgrind_ids_ = nullptr;
    munmap(base_, bytes_);
    base_ = nullptr;
    bytes_ = 0;
    count_ = 0;
}

bool StackPool::reserve(unsigned n) noexcept {
    if (n <= count_) return true;
    // No fiber is alive between blocks, so the old stacks can simply go.
    release();
    static_assert(kFiberStackBytes % 4096 == 0, "fiber stacks are whole pages");
    const size_t bytes = size_t(n) * stride();
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
#if defined(MAP_STACK)
    flags |= MAP_STACK;
#endif
    void* p = mmap(nullptr, bytes, PROT_NONE, flags, -1, 0);
    if (p == MAP_FAILED) return false;
    base_ = static_cast<unsigned char*>(p);
    bytes_ = bytes;
#if defined(PYFA_EMU_VALGRIND)
    valgrind_ids_ = static_cast<unsigned*>(std::malloc(sizeof(unsigned) * n));
    if (!valgrind_ids_) {
        release();
        return false;
    }
#endif
    for (unsigned i = 0; i < n; ++i) {
        if (mprotect(stack(i), kFiberStackBytes, PROT_READ | PROT_WRITE) != 0) {
            release();
            return false;
        }
#if defined(PYFA_EMU_VALGRIND)
        valgrind_ids_[i] = VALGRIND_STACK_REGISTER(stack(i), stack(i) + kFiberStackBytes);
#endif
        count_ = i + 1;
    }
    return true;
}

size_t StackPool::high_water() const noexcept {
    // Reads stacks below their fibers' stack pointers on purpose.
#if defined(PYFA_EMU_VALGRIND)
    VALGRIND_DISABLE_ERROR_REPORTING;
#endif
    size_t deepest = 0;
    for (unsigned i = 0; i < count_; ++i) {
        const unsigned char* s = stack(i);
        size_t untouched = 0;
        while (untouched < kFiberStackBytes && s[untouched] == 0) ++untouched;
        deepest = std::max(deepest, kFiberStackBytes - untouched);
    }
#if defined(PYFA_EMU_VALGRIND)
    VALGRIND_ENABLE_ERROR_REPORTING;
#endif
    return deepest;
}

namespace {

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
}  // namespace detail

double context_switch_ns(long switches) noexcept {
    using namespace detail;
    const long rounds = std::max(1L, switches / 2);
    StackPool pool;
    if (!pool.reserve(1)) return -1.0;
    unsigned char* stack = pool.stack(0);
    PingPong p;
    ctx_make(p.fiber, stack, kFiberStackBytes, &pingpong_entry, &p);
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < rounds; ++i) {
        void* fake = nullptr;
        asan_start(&fake, stack, kFiberStackBytes);
        ctx_switch(p.main, p.fiber);
        asan_finish(fake, nullptr);
    }
    const auto t1 = std::chrono::steady_clock::now();
    // The fiber stays parked in its loop; its frame holds nothing that needs destroying.
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(2 * rounds);
}

}  // namespace pyfa_emu
