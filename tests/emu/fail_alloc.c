/* fail_alloc.c: an LD_PRELOAD shim that makes memory requests fail on demand, for the
 * emulator's fault-injection test (emu_faults.cpp). While armed, the first `budget`
 * requests of the chosen kinds succeed and every later one fails with ENOMEM:
 *   kind 1: the heap (malloc, calloc, realloc, aligned allocations; operator new too);
 *   kind 2: anonymous mappings and making pages accessible (mmap, mprotect);
 *   kind 4, with 1 or 2: only the requests of threads other than the one that armed it
 *   count, so that a launch's own thread keeps its memory whatever the scheduler does.
 * glibc only: the heap calls are forwarded to glibc's own __libc_* entry points. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/types.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);

static atomic_int armed_kinds;
static atomic_long budget;
static atomic_long failures;
static pthread_t armer;

static void* (*real_mmap)(void*, size_t, int, int, int, off_t);
static int (*real_mprotect)(void*, size_t, int);

__attribute__((constructor)) static void resolve(void) {
    real_mmap = (void* (*)(void*, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
    real_mprotect = (int (*)(void*, size_t, int))dlsym(RTLD_NEXT, "mprotect");
}

static int should_fail(int kind) {
    const int armed = atomic_load_explicit(&armed_kinds, memory_order_acquire);
    if (!(armed & kind)) return 0;
    if ((armed & 4) && pthread_equal(pthread_self(), armer)) return 0;
    if (atomic_fetch_sub(&budget, 1) > 0) return 0;
    atomic_fetch_add(&failures, 1);
    errno = ENOMEM;
    return 1;
}

void pyfa_shim_arm(long n, int kinds) {
    atomic_store(&failures, 0);
    atomic_store(&budget, n);
    armer = pthread_self();
    atomic_store(&armed_kinds, kinds);
}

/* Disarms and returns how many requests failed while armed. */
long pyfa_shim_disarm(void) {
    atomic_store(&armed_kinds, 0);
    return atomic_load(&failures);
}

void* malloc(size_t n) { return should_fail(1) ? NULL : __libc_malloc(n); }
void* calloc(size_t n, size_t size) { return should_fail(1) ? NULL : __libc_calloc(n, size); }
void* realloc(void* p, size_t n) { return should_fail(1) ? NULL : __libc_realloc(p, n); }
void* memalign(size_t align, size_t n) { return should_fail(1) ? NULL : __libc_memalign(align, n); }
void* aligned_alloc(size_t align, size_t n) { return memalign(align, n); }
int posix_memalign(void** out, size_t align, size_t n) {
    void* p = memalign(align, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
    if ((flags & MAP_ANONYMOUS) && should_fail(2)) return MAP_FAILED;
    return real_mmap(addr, len, prot, flags, fd, off);
}

int mprotect(void* addr, size_t len, int prot) {
    if (prot != PROT_NONE && should_fail(2)) return -1;
    return real_mprotect(addr, len, prot);
}
