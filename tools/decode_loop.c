/* decode_loop.c: issue 21's decoding step and a streaming read of the same bytes, timed
 * from C, for tools/bench.py --decode-c (compiled by it at run time with the flags of the
 * cpu backend's build it reports against, as fma_peak.c is).
 *
 * bench.py's columns are timed from Python, and between two steps Python's own work for
 * the next call (~0.3 ms at N = 8192, on caches the step's 64 MiB stream left cold;
 * docs/cpu_backend.md) counts against the step. Here the untimed warm-up calls and the
 * timed burst run back to back in C, so the two rows say what the library and the memory
 * do without Python; the idle spell before each burst stays bench.py's. The read's
 * threads wait on a condition variable between calls, as the cpu backend's pool does, so
 * that neither side pays a wake-up the other does not. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* pyfa_fa2_forward, its pyfa_problem and pyfa_config filled in by the caller (bench.py,
 * through pyfa's own cffi declarations of pyfa.h: the layouts stay in one place). */
typedef int (*fa2_forward_fn)(const void* problem, const void* config, const float* q, const float* k,
                              const float* v, float* o, float* lse);

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

/* Calls fwd (pyfa_fa2_forward) on `problem` and `config` with q, k, v, o, lse as
 * pyfa.h lays them out until warm_ms have passed (at least once), then `burst` more,
 * each timed into times[] (ms). Returns the first non-zero status, 0 when every call
 * succeeded. */
int decode_loop_step(void* fwd, const void* problem, const void* config, const float* q, const float* k,
                     const float* v, float* o, float* lse, double warm_ms, int burst, double* times) {
    const fa2_forward_fn f = (fa2_forward_fn)fwd;
    const void *p = problem, *c = config;
    int st = 0;
    const double until = now_ms() + warm_ms;
    do {
        if ((st = f(p, c, q, k, v, o, lse)) != 0) return st;
    } while (now_ms() < until);
    for (int i = 0; i < burst; ++i) {
        const double t0 = now_ms();
        if ((st = f(p, c, q, k, v, o, lse)) != 0) return st;
        times[i] = now_ms() - t0;
    }
    return 0;
}

/* The read: part t of n floats (t = 0 on the caller) summed in 4 independent chains of
 * vectors, so that the loads, not the additions, bound it. */
typedef float vec __attribute__((vector_size(64)));
enum { MOST_THREADS = 64 };
static struct {
    pthread_mutex_t m;
    pthread_cond_t go, done;
    pthread_t th[MOST_THREADS];
    int started, wanted, pending;
    unsigned long generation;
    const float* a;
    size_t n;
    float sink[MOST_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static float read_part(const float* a, size_t n) {
    vec s[4] = {{0}, {0}, {0}, {0}};
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int c = 0; c < 4; ++c) {
            vec x;
            memcpy(&x, a + i + 16 * c, sizeof x);
            s[c] += x;
        }
    float r = 0;
    for (; i < n; ++i) r += a[i];
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 16; ++l) r += s[c][l];
    return r;
}

static void read_share(int t) {
    const size_t per = pool.n / (size_t)pool.wanted, from = per * (size_t)t;
    const size_t count = t == pool.wanted - 1 ? pool.n - from : per;
    pool.sink[t] = read_part(pool.a + from, count);
}

static void* read_worker(void* arg) {
    const int t = (int)(intptr_t)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&pool.m);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.go, &pool.m);
        seen = pool.generation;
        if (t >= pool.wanted) continue;
        pthread_mutex_unlock(&pool.m);
        read_share(t);
        pthread_mutex_lock(&pool.m);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static int read_once(const float* a, size_t n, int threads) {
    pthread_mutex_lock(&pool.m);
    while (pool.started < threads - 1) {
        if (pthread_create(&pool.th[pool.started], NULL, read_worker, (void*)(intptr_t)(pool.started + 1)) != 0) {
            pthread_mutex_unlock(&pool.m);
            return -1;
        }
        pthread_detach(pool.th[pool.started]);
        ++pool.started;
    }
    pool.a = a;
    pool.n = n;
    pool.wanted = threads;
    pool.pending = threads - 1;
    ++pool.generation;
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.m);
    read_share(0);
    pthread_mutex_lock(&pool.m);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.m);
    pthread_mutex_unlock(&pool.m);
    return 0;
}

/* Reads the n floats at a once per call, split over `threads` threads (at most
 * MOST_THREADS), with decode_loop_step's warm-up and burst. Returns 0, or -1 when a
 * thread could not be started or `threads` is out of range. */
int decode_loop_read(const float* a, size_t n, int threads, double warm_ms, int burst, double* times) {
    if (threads < 1 || threads > MOST_THREADS) return -1;
    const double until = now_ms() + warm_ms;
    do {
        if (read_once(a, n, threads) != 0) return -1;
    } while (now_ms() < until);
    for (int i = 0; i < burst; ++i) {
        const double t0 = now_ms();
        if (read_once(a, n, threads) != 0) return -1;
        times[i] = now_ms() - t0;
    }
    return 0;
}
