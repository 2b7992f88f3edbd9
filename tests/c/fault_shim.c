/* fault_shim.c: an LD_PRELOAD allocator that fails on purpose, for tests/test_abi_safety.py.

   Every allocation (malloc, calloc, realloc, the aligned ones; C++ operator new calls
   malloc) is counted while counting is on; once FAIL_AFTER of them have succeeded, every
   later one returns NULL with errno = ENOMEM. Counting starts at load time when the
   environment variable FAULTSHIM_FAIL_AFTER holds N; a program that knows the shim
   (tests/c/fault_driver.c) instead brackets each call with faultshim_begin(N) and
   faultshim_end(). Memory itself comes from glibc's own allocator (__libc_*). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>

extern void* __libc_malloc(size_t size);
extern void* __libc_calloc(size_t count, size_t size);
extern void* __libc_realloc(void* ptr, size_t size);
extern void* __libc_memalign(size_t alignment, size_t size);
extern void __libc_free(void* ptr);

static atomic_int counting;
static atomic_long seen;        /* allocations asked for since counting began */
static atomic_long fail_after;  /* allocations that succeed first; -1: all do */
static atomic_long failed;      /* allocations refused since counting began */

static int refuse(void) {
    if (!atomic_load(&counting)) return 0;
    const long n = atomic_fetch_add(&seen, 1);
    const long limit = atomic_load(&fail_after);
    if (limit < 0 || n < limit) return 0;
    atomic_fetch_add(&failed, 1);
    errno = ENOMEM;
    return 1;
}

void faultshim_begin(long n) {
    atomic_store(&counting, 0);
    atomic_store(&seen, 0);
    atomic_store(&failed, 0);
    atomic_store(&fail_after, n);
    atomic_store(&counting, 1);
}

/* Stops counting; returns the allocations asked for since faultshim_begin. */
long faultshim_end(void) {
    atomic_store(&counting, 0);
    return atomic_load(&seen);
}

long faultshim_failed(void) { return atomic_load(&failed); }

__attribute__((constructor)) static void faultshim_init(void) {
    const char* text = getenv("FAULTSHIM_FAIL_AFTER");
    if (text && *text) faultshim_begin(strtol(text, NULL, 10));
}

void* malloc(size_t size) { return refuse() ? NULL : __libc_malloc(size); }
void* calloc(size_t count, size_t size) { return refuse() ? NULL : __libc_calloc(count, size); }
void* realloc(void* ptr, size_t size) { return refuse() ? NULL : __libc_realloc(ptr, size); }
void free(void* ptr) { __libc_free(ptr); }
void* memalign(size_t alignment, size_t size) { return refuse() ? NULL : __libc_memalign(alignment, size); }
void* aligned_alloc(size_t alignment, size_t size) { return memalign(alignment, size); }

int posix_memalign(void** out, size_t alignment, size_t size) {
    if (refuse()) return ENOMEM;
    void* ptr = __libc_memalign(alignment, size);
    if (!ptr) return ENOMEM;
    *out = ptr;
    return 0;
}
