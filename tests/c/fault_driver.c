/* fault_driver.c: calls every entry point of libpyfa while tests/c/fault_shim.c makes
   allocations fail, for tests/test_abi_safety.py. Run it under LD_PRELOAD=fault_shim.so.

   For each entry point it first counts the allocations of a clean call (A), then repeats
   the call with allocations failing after N = 0, 1, ... of them (every N up to A when A
   is at most MAX_POINTS, else MAX_POINTS values spread over [0, A]). Every call must
   return: a status in range with a message, the caller's outputs untouched on failure
   and equal to the clean call's on success. A crash, abort or terminate ends the
   process; the last "call" line on stdout says where.

   Each call runs on a thread of its own (MODE cold), so that the emulator's per-thread
   caches start empty and their allocations fail too, or on the main thread (warm). The
   thread touches the library's thread-local storage before allocations start failing:
   glibc allocates a library's thread-local block on a thread's first access and aborts
   the process if it cannot, which no library can report as a status.

   usage: fault_driver EMU_WORKERS MAX_POINTS cold|warm
   exit status 0: no violation; 1: a violation (printed); 2: usage or setup error. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyfa.h"

extern void faultshim_begin(long n) __attribute__((weak));
extern long faultshim_end(void) __attribute__((weak));
extern long faultshim_failed(void) __attribute__((weak));

enum { PYFA_MESSAGE_COPY = 256 };
enum { B = 1, H = 2, NQ = 9, NK = 7, D = 8 };
enum { ROWS = B * H * (NQ > NK ? NQ : NK), ELEMS = ROWS * D };

static float q[ELEMS], k[ELEMS], v[ELEMS], o[ELEMS], lse[ROWS], m[ROWS], l[ROWS], dout[ELEMS];
static float out[3][ELEMS];
static const float kSentinel = 7.0f;
static int workers = 1;
static pyfa_problem problem;

static pyfa_config config(int backend) {
    pyfa_config c;
    memset(&c, 0, sizeof(c));
    c.backend = backend;
    c.block_r = 4;
    c.block_c = 4;
    c.emu_order = PYFA_EMU_ORDER_REVERSE;
    c.emu_workers = workers;
    return c;
}

/* Each entry returns a pyfa_status, or 100 when a value-returning function answered
   something other than its clean answer. */
static int e_version(void) { return strcmp(pyfa_version(), PYFA_VERSION_EXPECTED) == 0 ? 0 : 100; }
static int e_abi_version(void) { return pyfa_abi_version() == PYFA_ABI_VERSION ? 0 : 100; }
static int e_status_string(void) { return strcmp(pyfa_status_string(PYFA_ERROR_OUT_OF_MEMORY), "out of memory") ? 100 : 0; }
static int e_last_error(void) { return pyfa_last_error() ? 0 : 100; }
static int e_available(void) {
    return pyfa_backend_available(PYFA_BACKEND_EMU) == 1 && pyfa_backend_available(PYFA_BACKEND_CPU) >= 0 &&
                   pyfa_backend_available(PYFA_BACKEND_CUDA) >= 0 && pyfa_backend_available(99) == 0
               ? 0 : 100;
}
static int e_compiled(void) {
    return pyfa_backend_compiled(PYFA_BACKEND_EMU) == 1 && pyfa_backend_compiled(PYFA_BACKEND_CUDA) >= 0 ? 0 : 100;
}
static int e_reason(void) {
    const char* a = pyfa_backend_reason(PYFA_BACKEND_CUDA);
    const char* b = pyfa_backend_reason(PYFA_BACKEND_EMU);
    return a && b && b[0] == '\0' ? 0 : 100;
}
static int e_profile(void) {
    pyfa_device_profile p;
    return pyfa_device_profile_get(PYFA_BACKEND_EMU, &p);
}
static int e_smem(void) { return pyfa_smem_bytes(PYFA_KERNEL_FA2_FORWARD, 64, 64, 64) == 83200 ? 0 : 100; }
static int e_smem_overflow(void) {
    return pyfa_smem_bytes(PYFA_KERNEL_FA2_FORWARD, 64, 64, (int64_t)1 << 62) == 0 ? 0 : 100;
}
static int e_default_tiles(void) {
    for (int kernel = 0; kernel <= 5; ++kernel) {
        int r = 0, c = 0;
        const int st = pyfa_default_tiles(kernel, 64, PYFA_BACKEND_EMU, &r, &c);
        if (st) return st;
    }
    return 0;
}
static int e_fa2_forward(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa2_forward(&problem, &c, q, k, v, out[0], out[1]);
}
static int e_fa2_forward_auto(void) {
    pyfa_config c = config(PYFA_BACKEND_AUTO);
    return pyfa_fa2_forward(&problem, &c, q, k, v, out[0], out[1]);
}
static int e_fa2_forward_device(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa2_forward_device(&problem, &c, q, k, v, out[0], out[1], NULL);
}
static int e_fa2_forward_tile_too_large(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    c.block_r = 1073764693;
    c.block_c = 2147437157;
    return pyfa_fa2_forward(&problem, &c, q, k, v, out[0], out[1]);
}
static int e_fa2_forward_null(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa2_forward(&problem, &c, q, NULL, v, out[0], out[1]);
}
static int e_fa2_backward(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa2_backward(&problem, &c, q, k, v, o, lse, dout, out[0], out[1], out[2]);
}
static int e_fa2_backward_device(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa2_backward_device(&problem, &c, q, k, v, o, lse, dout, out[0], out[1], out[2], NULL);
}
static int e_fa1_forward(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa1_forward(&problem, &c, q, k, v, out[0], out[1], out[2]);
}
static int e_fa1_forward_device(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa1_forward_device(&problem, &c, q, k, v, out[0], out[1], out[2], NULL);
}
static int e_fa1_backward(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa1_backward(&problem, &c, q, k, v, o, m, l, dout, out[0], out[1], out[2]);
}
static int e_fa1_backward_device(void) {
    pyfa_config c = config(PYFA_BACKEND_EMU);
    return pyfa_fa1_backward_device(&problem, &c, q, k, v, o, m, l, dout, out[0], out[1], out[2], NULL);
}

typedef struct {
    const char* name;
    int (*call)(void);
} Entry;

static const Entry kEntries[] = {
    {"pyfa_version", e_version},
    {"pyfa_abi_version", e_abi_version},
    {"pyfa_status_string", e_status_string},
    {"pyfa_last_error", e_last_error},
    {"pyfa_backend_available", e_available},
    {"pyfa_backend_compiled", e_compiled},
    {"pyfa_backend_reason", e_reason},
    {"pyfa_device_profile_get", e_profile},
    {"pyfa_smem_bytes", e_smem},
    {"pyfa_smem_bytes/overflow", e_smem_overflow},
    {"pyfa_default_tiles", e_default_tiles},
    {"pyfa_fa2_forward", e_fa2_forward},
    {"pyfa_fa2_forward/auto", e_fa2_forward_auto},
    {"pyfa_fa2_forward/tile_too_large", e_fa2_forward_tile_too_large},
    {"pyfa_fa2_forward/null", e_fa2_forward_null},
    {"pyfa_fa2_forward_device", e_fa2_forward_device},
    {"pyfa_fa2_backward", e_fa2_backward},
    {"pyfa_fa2_backward_device", e_fa2_backward_device},
    {"pyfa_fa1_forward", e_fa1_forward},
    {"pyfa_fa1_forward_device", e_fa1_forward_device},
    {"pyfa_fa1_backward", e_fa1_backward},
    {"pyfa_fa1_backward_device", e_fa1_backward_device},
};

static void fill_sentinel(void) {
    for (int t = 0; t < 3; ++t)
        for (int i = 0; i < ELEMS; ++i) out[t][i] = kSentinel;
}

static int untouched(void) {
    for (int t = 0; t < 3; ++t)
        for (int i = 0; i < ELEMS; ++i)
            if (memcmp(&out[t][i], &kSentinel, sizeof(float)) != 0) return 0;
    return 1;
}

static int cold = 1;

typedef struct {
    const Entry* entry;
    long fail_after;
    int status;
    long asked, refused;
    char message[PYFA_MESSAGE_COPY];
} Run;

static void* run_entry(void* arg) {
    Run* r = (Run*)arg;
    (void)pyfa_last_error();
    faultshim_begin(r->fail_after);
    r->status = r->entry->call();
    r->asked = faultshim_end();
    r->refused = faultshim_failed();
    snprintf(r->message, sizeof(r->message), "%s", pyfa_last_error());
    return NULL;
}

static int violations = 0;

static void violation(const Run* r, const char* what) {
    ++violations;
    printf("VIOLATION %s fail_after=%ld status=%d: %s (last error: %s)\n", r->entry->name, r->fail_after, r->status,
           what, r->message);
}

/* Runs e with allocations failing after n (n < 0: none fail). */
static Run run(const Entry* e, long n) {
    Run r = {e, n, -1, 0, 0, ""};
    fill_sentinel();
    if (!cold) {
        run_entry(&r);
        return r;
    }
    pthread_t thread;
    if (pthread_create(&thread, NULL, run_entry, &r) != 0 || pthread_join(thread, NULL) != 0) {
        fprintf(stderr, "fault_driver: cannot run a thread\n");
        exit(2);
    }
    return r;
}

/* One call with allocations failing after n; checks what the call promises. */
static void check_call(const Entry* e, long n, int clean_status, float (*clean)[ELEMS]) {
    printf("call %s fail_after=%ld\n", e->name, n);
    fflush(stdout);
    const Run r = run(e, n);
    const int st = r.status;
    const long asked = r.asked, refused = r.refused;
    printf("done %s fail_after=%ld status=%d allocations=%ld refused=%ld\n", e->name, n, st, asked, refused);
    if (st < PYFA_OK || st > PYFA_ERROR_CANCELLED) {
        violation(&r, "status out of range");
        return;
    }
    if (st != PYFA_OK && r.message[0] == '\0') violation(&r, "failure without a message");
    if (st != clean_status && (refused == 0 || st == PYFA_OK))
        violation(&r, "status differs from the clean call's although no allocation failed");
    if (st != PYFA_OK && !untouched()) violation(&r, "a failed call wrote the caller's outputs");
    if (st == PYFA_OK && memcmp(out, clean, sizeof(out)) != 0)
        violation(&r, "a successful call's outputs differ from the clean call's");
}

int main(int argc, char** argv) {
    if (argc != 4 || (strcmp(argv[3], "cold") && strcmp(argv[3], "warm"))) {
        fprintf(stderr, "usage: fault_driver EMU_WORKERS MAX_POINTS cold|warm\n");
        return 2;
    }
    cold = strcmp(argv[3], "cold") == 0;
    workers = atoi(argv[1]);
    const long max_points = atol(argv[2]);
    if (!faultshim_begin || !faultshim_end || !faultshim_failed) {
        fprintf(stderr, "fault_driver: run me with LD_PRELOAD=fault_shim.so\n");
        return 2;
    }
    problem.batch = B;
    problem.heads = H;
    problem.seqlen_q = NQ;
    problem.seqlen_k = NK;
    problem.head_dim = D;
    problem.causal = 1;
    unsigned seed = 12345u;
    for (int i = 0; i < ELEMS; ++i) {
        seed = seed * 1103515245u + 12345u;
        q[i] = (float)((seed >> 8) % 2000) / 1000.0f - 1.0f;
        k[i] = (float)((seed >> 4) % 1000) / 500.0f - 1.0f;
        v[i] = (float)(i % 13) - 6.0f;
        dout[i] = (float)(i % 7) - 3.0f;
    }
    /* The backward's inputs from a clean forward (this also warms the library up). */
    pyfa_config c = config(PYFA_BACKEND_EMU);
    if (pyfa_fa2_forward(&problem, &c, q, k, v, o, lse) != PYFA_OK ||
        pyfa_fa1_forward(&problem, &c, q, k, v, out[0], m, l) != PYFA_OK) {
        fprintf(stderr, "fault_driver: clean forward failed: %s\n", pyfa_last_error());
        return 2;
    }

    static float clean[3][ELEMS];
    const size_t count = sizeof(kEntries) / sizeof(kEntries[0]);
    for (size_t i = 0; i < count; ++i) {
        const Entry* e = &kEntries[i];
        const Run r = run(e, -1);
        const int clean_status = r.status;
        const long allocations = r.asked;
        memcpy(clean, out, sizeof(out));
        printf("clean %s status=%d allocations=%ld\n", e->name, clean_status, allocations);
        if (clean_status == 100) violation(&r, "wrong answer without any failure");
        const long points = allocations + 1 <= max_points ? allocations + 1 : max_points;
        for (long p = 0; p < points; ++p) {
            const long n = points == allocations + 1 ? p : p * allocations / (points - 1);
            check_call(e, n, clean_status, clean);
        }
        /* The library stays usable after every failure. */
        check_call(e, -1, clean_status, clean);
    }
    printf("fault_driver: %zu entry points, %d violations\n", count, violations);
    return violations ? 1 : 0;
}
