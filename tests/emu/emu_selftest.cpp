// emu_selftest.cpp: checks the host emulation runtime (src/backends/emu) with small kernels written
// as CUDA source. Prints one PASS/FAIL line per check; exits 0 only if all pass.
#include "backends/emu/emu.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

int g_passed = 0, g_failed = 0;

void check(bool ok, const std::string& name, const std::string& detail = std::string()) {
    (ok ? g_passed : g_failed)++;
    std::printf("%s: %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.empty() ? "" : " -- ",
                detail.c_str());
    std::fflush(stdout);
}

pyfa_emu::Error g_last_error = pyfa_emu::Error::None;  // of the last run()

bool run(dim3 grid, dim3 block, size_t smem, int order, const std::function<void()>& body,
         std::string* err = nullptr, int workers = 2, uint64_t seed = 12345) {
    pyfa_emu::LaunchOptions opt;
    opt.order = order;
    opt.seed = seed;
    opt.workers = workers;
    pyfa_emu::LaunchResult result;
    g_last_error = pyfa_emu::launch(grid, block, smem, opt, body, &result);
    if (err) *err = result.message;
    return g_last_error == pyfa_emu::Error::None;
}

bool contains(const std::string& s, const std::string& part) {
    return s.find(part) != std::string::npos;
}

uint32_t bits(float f) { return __float_as_uint(f); }

// ---- kernels --------------------------------------------------------------------------

__global__ void reduce_ok(const float* in, float* out) {
    float* s = reinterpret_cast<float*>(pyfa_emu::dynamic_smem());
    const unsigned t = threadIdx.x, n = blockDim.x;
    s[t] = in[blockIdx.x * n + t];
    __syncthreads();
    for (unsigned stride = n / 2; stride > 0; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// The same reduction with the barrier inside the loop forgotten.
__global__ void reduce_missing_barrier(const float* in, float* out) {
    float* s = reinterpret_cast<float*>(pyfa_emu::dynamic_smem());
    const unsigned t = threadIdx.x, n = blockDim.x;
    s[t] = in[blockIdx.x * n + t];
    __syncthreads();
    for (unsigned stride = n / 2; stride > 0; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

int g_line_a = 0, g_line_b = 0;

__global__ void two_barrier_sites() {
    if (threadIdx.x < 16) {
        g_line_a = __LINE__; __syncthreads();
    } else {
        g_line_b = __LINE__; __syncthreads();
    }
}

int g_line_bar = 0, g_line_shfl = 0;

__global__ void half_barrier_half_shuffle() {
    int v = int(threadIdx.x);
    if (threadIdx.x < 16) {
        g_line_bar = __LINE__; __syncthreads();
    } else {
        g_line_shfl = __LINE__; v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    }
    (void)v;
}

int g_line_s1 = 0, g_line_s2 = 0;

__global__ void shuffle_sites_differ() {
    int v = int(threadIdx.x);
    if (threadIdx.x % 2 == 0) {
        g_line_s1 = __LINE__; v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    } else {
        g_line_s2 = __LINE__; v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    }
    (void)v;
}

__global__ void shuffle_after_return() {
    if (threadIdx.x == 7) return;
    int v = __shfl_down_sync(0xFFFFFFFFu, int(threadIdx.x), 1);
    (void)v;
}

struct ShflOut {
    float xor_f;
    int xor_i;
    int bcast;
    float bcast_f;
    float down16;
    int down16_i;
    int up8;
    int idx8;
    int xor16;
};

int shfl_value(unsigned t) { return int(t * 3 + 1); }

__global__ void shuffles(ShflOut* out) {
    const unsigned t = threadIdx.x + blockIdx.x * blockDim.x;
    const unsigned mask = 0xFFFFFFFFu;
    const int iv = shfl_value(threadIdx.x);
    float f = float(iv);
    for (int off = 16; off > 0; off >>= 1) f += __shfl_xor_sync(mask, f, off);
    int i = iv;
    for (int off = 16; off > 0; off >>= 1) i += __shfl_xor_sync(mask, i, off);
    out[t].xor_f = f;
    out[t].xor_i = i;
    out[t].bcast = __shfl_sync(mask, iv, 3);
    const float fv = float(iv);
    out[t].bcast_f = __shfl_sync(mask, fv, 3);
    out[t].down16 = __shfl_down_sync(mask, float(iv), 3, 16);
    out[t].down16_i = __shfl_down_sync(mask, iv, 3, 16);
    out[t].up8 = __shfl_up_sync(mask, iv, 2, 8);
    out[t].idx8 = __shfl_sync(mask, iv, 10, 8);
    out[t].xor16 = __shfl_xor_sync(mask, iv, 16, 16);
}

// Block of 40 threads: the second warp has only 8 lanes.
__global__ void partial_warp(int* out) {
    const unsigned t = threadIdx.x;
    const unsigned mask = t < 32 ? 0xFFFFFFFFu : 0xFFu;
    int v = shfl_value(t);
    const int top = t < 32 ? 16 : 4;
    for (int off = top; off > 0; off >>= 1) v += __shfl_xor_sync(mask, v, off);
    out[t] = v;
}

std::atomic<int> g_smem_bad{0};

__global__ void smem_poison(size_t bytes) {
    unsigned char* s = pyfa_emu::dynamic_smem();
    if ((reinterpret_cast<uintptr_t>(s) & 15) != 0) g_smem_bad++;
    if (threadIdx.x == 0) {
        for (size_t b = 0; b < bytes; ++b)
            if (s[b] != 0xFF) g_smem_bad++;
    }
    float* f = reinterpret_cast<float*>(s);
    if (!std::isnan(f[threadIdx.x])) g_smem_bad++;
    __syncthreads();
    f[threadIdx.x] = float(threadIdx.x);
    s[bytes - 1] = 0;
}

__global__ void early_return(int* out) {
    int* s = reinterpret_cast<int*>(pyfa_emu::dynamic_smem());
    const unsigned t = threadIdx.x;
    if (t >= 100) return;
    s[t] = int(t) + 1;
    __syncthreads();
    if (t >= 50) return;
    s[t] += s[t + 50];
    __syncthreads();
    if (t == 0) {
        int sum = 0;
        for (int k = 0; k < 50; ++k) sum += s[k];
        out[blockIdx.x] = sum;
    }
}

struct Idx {
    dim3 t0, b0, bd0, gd0, t1, b1;
};

__global__ void indices_3d(Idx* out) {
    const unsigned tl = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned bl = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    Idx& r = out[bl * blockDim.x * blockDim.y * blockDim.z + tl];
    r.t0 = threadIdx;
    r.b0 = blockIdx;
    r.bd0 = blockDim;
    r.gd0 = gridDim;
    __syncthreads();
    r.t1 = threadIdx;
    r.b1 = blockIdx;
}

__global__ void throws_in_block1() {
    __syncthreads();
    if (blockIdx.x == 1 && threadIdx.x == 5) throw std::runtime_error("kernel boom 42");
    __syncthreads();
}

__global__ void throws_int() {
    if (threadIdx.x == 3) throw 17;
}

std::atomic<int> g_blocks_started{0};

__global__ void fail_first_block() {
    if (threadIdx.x == 0) g_blocks_started++;
    if (blockIdx.x == 0 && threadIdx.x == 0) throw std::runtime_error("stop");
    __syncthreads();
}

__global__ void many_barriers(int* out) {
    int* s = reinterpret_cast<int*>(pyfa_emu::dynamic_smem());
    const unsigned t = threadIdx.x;
    s[t] = 0;
    for (int k = 0; k < 21; ++k) {
        __syncthreads();
        s[(t + unsigned(k)) % blockDim.x] += 1;
    }
    __syncthreads();
    if (t == 0) {
        int sum = 0;
        for (unsigned k = 0; k < blockDim.x; ++k) sum += s[k];
        out[blockIdx.x] = sum;
    }
}


// ---- stack overflow: each must end the process with a signal, never return

// Not a tail call and not foldable: every level keeps 1 KiB live across the next call.
__attribute__((noinline)) int recurse(int depth) {
    volatile char pad[1024];
    pad[0] = char(depth);
    pad[1023] = char(depth >> 8);
    if (depth == 0) return pad[0];
    return recurse(depth - 1) + pad[1023];
}

std::atomic<int> g_sink{0};

__global__ void deep_recursion() {
    // Twice the stack in 1 KiB frames.
    g_sink += recurse(int(2 * pyfa_emu::kFiberStackBytes / 1024));
}

// One frame half again as large as the whole stack, written from its lowest address up:
// the first store lands below the stack's end.
__attribute__((noinline)) void big_frame() {
    volatile char big[pyfa_emu::kFiberStackBytes + pyfa_emu::kFiberStackBytes / 2];
    for (size_t i = 0; i < sizeof big; i += 512) big[i] = char(i);
    g_sink += big[sizeof big / 2];
}

__global__ void big_local_array() { big_frame(); }

// ---- floating-point environment

// x * 0.5 for x the smallest normal float is subnormal: 0 under flush-to-zero; a
// subnormal input reads as 0 under denormals-are-zero.
__global__ void halve(const float* in, float* out) {
    const unsigned t = threadIdx.x + blockIdx.x * blockDim.x;
    volatile float x = in[t];
    out[t] = x * 0.5f;
}

// ---- progress and cancellation

__global__ void barrier_rounds(long rounds, std::atomic<int>* finished) {
    for (long r = 0; r < rounds; ++r) __syncthreads();
    if (threadIdx.x == 0) ++*finished;
}

__global__ void count_blocks(std::atomic<int>* started) {
    if (threadIdx.x == 0) ++*started;
}

// ---- checks ---------------------------------------------------------------------------

void check_reduction() {
    const unsigned blocks = 8, n = 256;
    std::vector<float> in(blocks * n);
    for (size_t i = 0; i < in.size(); ++i) in[i] = float((i * 7) % 13);
    std::vector<float> expect(blocks, 0.0f);
    for (unsigned b = 0; b < blocks; ++b)
        for (unsigned t = 0; t < n; ++t) expect[b] += in[b * n + t];  // small integers: exact

    for (int order = 0; order < 3; ++order) {
        std::vector<float> out(blocks, -1.0f);
        std::string err;
        bool ok = run(dim3(blocks), dim3(n), n * sizeof(float), order,
                      [&] { reduce_ok(in.data(), out.data()); }, &err);
        bool exact = ok;
        for (unsigned b = 0; b < blocks && exact; ++b) exact = bits(out[b]) == bits(expect[b]);
        check(exact, "tree reduction with barriers is exact, order " + std::to_string(order), err);
    }

    std::vector<std::vector<float>> outs;
    std::string detail;
    bool wrong_or_differs = false;
    for (int order = 0; order < 3; ++order) {
        std::vector<float> out(blocks, -1.0f);
        std::string err;
        bool ok = run(dim3(blocks), dim3(n), n * sizeof(float), order,
                      [&] { reduce_missing_barrier(in.data(), out.data()); }, &err);
        if (!ok) {
            check(false, "missing barrier launch runs", err);
            return;
        }
        bool right = true;
        for (unsigned b = 0; b < blocks; ++b) right = right && bits(out[b]) == bits(expect[b]);
        detail += "order " + std::to_string(order) + (right ? " right; " : " wrong; ");
        if (!right) wrong_or_differs = true;
        if (!outs.empty())
            for (unsigned b = 0; b < blocks; ++b)
                if (bits(out[b]) != bits(outs[0][b])) wrong_or_differs = true;
        outs.push_back(out);
    }
    check(wrong_or_differs, "missing barrier gives a wrong or order-dependent sum", detail);

    // A shuffled order is a function of the seed.
    std::vector<float> a(blocks), b(blocks);
    run(dim3(blocks), dim3(n), n * sizeof(float), 2,
        [&] { reduce_missing_barrier(in.data(), a.data()); }, nullptr, 2, 99);
    run(dim3(blocks), dim3(n), n * sizeof(float), 2,
        [&] { reduce_missing_barrier(in.data(), b.data()); }, nullptr, 1, 99);
    bool same = true;
    for (unsigned k = 0; k < blocks; ++k) same = same && bits(a[k]) == bits(b[k]);
    check(same, "shuffled order is reproducible from the seed (any worker count)");
}

void check_errors() {
    std::string err;
    bool ok = run(dim3(1), dim3(32), 0, 0, [] { two_barrier_sites(); }, &err, 1);
    check(!ok && g_last_error == pyfa_emu::Error::Divergence &&
              contains(err, ":" + std::to_string(g_line_a)) &&
              contains(err, ":" + std::to_string(g_line_b)) && contains(err, "block (0,0,0)"),
          "two __syncthreads sites -> divergence error naming both lines", err);

    err.clear();
    ok = run(dim3(2), dim3(64), 0, 2, [] { half_barrier_half_shuffle(); }, &err, 1);
    check(!ok && contains(err, ":" + std::to_string(g_line_bar)) &&
              contains(err, ":" + std::to_string(g_line_shfl)),
          "half warp at __syncthreads, half in a shuffle -> error, no hang", err);

    err.clear();
    ok = run(dim3(1), dim3(32), 0, 0, [] { shuffle_sites_differ(); }, &err, 1);
    check(!ok && contains(err, ":" + std::to_string(g_line_s1)) &&
              contains(err, ":" + std::to_string(g_line_s2)),
          "lanes of a warp at different shuffle sites -> error", err);

    err.clear();
    ok = run(dim3(1), dim3(32), 0, 1, [] { shuffle_after_return(); }, &err, 1);
    check(!ok && contains(err, "returned") && contains(err, "thread 7"),
          "shuffle waiting for a returned lane -> error", err);

    err.clear();
    ok = run(dim3(4), dim3(64), 0, 0, [] { throws_in_block1(); }, &err, 2);
    check(!ok && g_last_error == pyfa_emu::Error::KernelException && contains(err, "kernel boom 42"),
          "kernel exception -> error with its message", err);

    err.clear();
    ok = run(dim3(1), dim3(8), 0, 0, [] { throws_int(); }, &err, 1);
    check(!ok && !err.empty(), "kernel throwing a non-std exception -> error", err);

    g_blocks_started = 0;
    err.clear();
    ok = run(dim3(1000), dim3(64), 0, 0, [] { fail_first_block(); }, &err, 1);
    check(!ok && g_blocks_started.load() < 1000,
          "an error stops the remaining blocks",
          std::to_string(g_blocks_started.load()) + " blocks started; " + err);

    std::string e1, e2, e3, e4;
    bool r1 = run(dim3(1), dim3(2048), 0, 0, [] {}, &e1);
    bool r2 = run(dim3(0, 1, 1), dim3(32), 0, 0, [] {}, &e2);
    bool r3 = run(dim3(1, 0, 1), dim3(32), 0, 0, [] {}, &e3);
    bool r4 = run(dim3(1), dim3(32, 1, 0), 0, 0, [] {}, &e4);
    check(!r1 && !r2 && !r3 && !r4 && g_last_error == pyfa_emu::Error::InvalidLaunch &&
              !e1.empty() && !e2.empty() && !e3.empty() && !e4.empty(),
          "invalid launches (2048 threads, empty grid or block dim) -> error", e1 + " | " + e2);
    std::string e5;
    bool r5 = run(dim3(1), dim3(32), 0, 0, [] {}, &e5, pyfa_emu::kMaxWorkers + 1);
    check(!r5 && g_last_error == pyfa_emu::Error::InvalidLaunch && contains(e5, "workers"),
          "more workers than kMaxWorkers -> invalid launch", e5);

    int count = 0;
    ok = run(dim3(3), dim3(64), 0, 0, [&] {
        if (threadIdx.x == 0) __atomic_fetch_add(&count, 1, __ATOMIC_RELAXED);
    }, &err, 1);
    check(ok && count == 3, "a launch after failed launches works", err);
}

void check_shuffles() {
    const unsigned blocks = 2, n = 64;
    for (int order = 0; order < 3; ++order) {
        std::vector<ShflOut> out(blocks * n);
        std::string err;
        bool ok = run(dim3(blocks), dim3(n), 0, order, [&] { shuffles(out.data()); }, &err);
        bool xr = ok, bc = ok, dn = ok, up = ok, ix = ok, x16 = ok;
        for (unsigned g = 0; g < blocks * n; ++g) {
            const unsigned t = g % n, lane = t % 32, w0 = t - lane;
            int sum = 0;
            for (unsigned l = 0; l < 32; ++l) sum += shfl_value(w0 + l);
            const ShflOut& r = out[g];
            xr = xr && r.xor_i == sum && bits(r.xor_f) == bits(float(sum));
            bc = bc && r.bcast == shfl_value(w0 + 3) && bits(r.bcast_f) == bits(float(shfl_value(w0 + 3)));
            const unsigned dsrc = (lane % 16) + 3 < 16 ? lane + 3 : lane;
            dn = dn && bits(r.down16) == bits(float(shfl_value(w0 + dsrc))) &&
                 r.down16_i == shfl_value(w0 + dsrc);
            const unsigned usrc = lane % 8 >= 2 ? lane - 2 : lane;
            up = up && r.up8 == shfl_value(w0 + usrc);
            ix = ix && r.idx8 == shfl_value(w0 + (lane / 8) * 8 + 2);
            // CUDA: a lane may read an earlier segment, never a later one.
            const unsigned xsrc = lane >= 16 ? lane - 16 : lane;
            x16 = x16 && r.xor16 == shfl_value(w0 + xsrc);
        }
        const std::string o = ", order " + std::to_string(order);
        check(xr, "__shfl_xor_sync butterfly sum, float and int" + o, err);
        check(bc, "__shfl_sync broadcast from lane 3, float and int" + o, err);
        check(dn, "__shfl_down_sync delta 3 width 16, float and int" + o, err);
        check(up, "__shfl_up_sync delta 2 width 8" + o, err);
        check(ix, "__shfl_sync lane 10 width 8" + o, err);
        check(x16, "__shfl_xor_sync 16 width 16" + o, err);
    }

    std::vector<int> out(40, 0);
    std::string err;
    bool ok = run(dim3(1), dim3(40), 0, 2, [&] { partial_warp(out.data()); }, &err);
    int s0 = 0, s1 = 0;
    for (unsigned t = 0; t < 32; ++t) s0 += shfl_value(t);
    for (unsigned t = 32; t < 40; ++t) s1 += shfl_value(t);
    bool good = ok;
    for (unsigned t = 0; t < 40; ++t) good = good && out[t] == (t < 32 ? s0 : s1);
    check(good, "shuffles in a partial last warp (8 lanes)", err);
}

void check_smem() {
    const size_t bytes = 1000;
    g_smem_bad = 0;
    std::string err;
    bool ok = run(dim3(3), dim3(64), bytes, 0, [] { smem_poison(1000); }, &err, 1);
    check(ok && g_smem_bad.load() == 0,
          "dynamic shared memory reads NaN before written, every block on one worker",
          std::to_string(g_smem_bad.load()) + " bad; " + err);

    int bad = 0;
    ok = run(dim3(2), dim3(4), 0, 0, [&] {
        unsigned char* s = pyfa_emu::dynamic_smem();
        bool fine = s && (reinterpret_cast<uintptr_t>(s) & 15) == 0;
        for (int k = 0; fine && k < 16; ++k) fine = s[k] == 0xFF;
        if (!fine) __atomic_fetch_add(&bad, 1, __ATOMIC_RELAXED);
        __syncthreads();
        if (threadIdx.x == 0) s[0] = 1;
    }, &err, 1);
    check(ok && bad == 0, "smem_bytes 0 still gives 16 aligned poisoned bytes", err);
}

void check_early_return() {
    for (int order = 0; order < 3; ++order) {
        std::vector<int> out(4, 0);
        std::string err;
        bool ok = run(dim3(4), dim3(128), 128 * sizeof(int), order,
                      [&] { early_return(out.data()); }, &err);
        bool good = ok;
        for (int v : out) good = good && v == 5050;
        check(good, "early-returned threads do not block later barriers, order " +
                        std::to_string(order), err);
    }
}

bool eq(dim3 a, dim3 b) { return a.x == b.x && a.y == b.y && a.z == b.z; }

void check_indices() {
    const dim3 grid(2, 3, 4), block(4, 2, 3);
    const unsigned nb = 24, nt = 24;
    std::vector<Idx> out(nb * nt);
    std::string err;
    bool ok = run(grid, block, 0, 2, [&] { indices_3d(out.data()); }, &err);
    bool good = ok;
    for (unsigned bz = 0; bz < 4; ++bz)
        for (unsigned by = 0; by < 3; ++by)
            for (unsigned bx = 0; bx < 2; ++bx)
                for (unsigned tz = 0; tz < 3; ++tz)
                    for (unsigned ty = 0; ty < 2; ++ty)
                        for (unsigned tx = 0; tx < 4; ++tx) {
                            const unsigned bl = bx + 2 * (by + 3 * bz);
                            const unsigned tl = tx + 4 * (ty + 2 * tz);
                            const Idx& r = out[bl * nt + tl];
                            const dim3 t(tx, ty, tz), b(bx, by, bz);
                            good = good && eq(r.t0, t) && eq(r.t1, t) && eq(r.b0, b) &&
                                   eq(r.b1, b) && eq(r.bd0, block) && eq(r.gd0, grid);
                        }
    check(good, "3-D grid and block indices (before and after a barrier)", err);
}

void check_concurrent_launches() {
    const unsigned blocks = 16, n = 128;
    std::vector<float> in(blocks * n);
    for (size_t i = 0; i < in.size(); ++i) in[i] = float(i % 5);
    std::vector<float> out1(blocks), out2(blocks);
    bool ok1 = false, ok2 = false;
    std::thread th([&] {
        for (int r = 0; r < 5 && (r == 0 || ok1); ++r)
            ok1 = run(dim3(blocks), dim3(n), n * 4, 2, [&] { reduce_ok(in.data(), out1.data()); });
    });
    for (int r = 0; r < 5 && (r == 0 || ok2); ++r)
        ok2 = run(dim3(blocks), dim3(n), n * 4, 1, [&] { reduce_ok(in.data(), out2.data()); });
    th.join();
    bool good = ok1 && ok2;
    for (unsigned b = 0; b < blocks; ++b) {
        float e = 0;
        for (unsigned t = 0; t < n; ++t) e += in[b * n + t];
        good = good && out1[b] == e && out2[b] == e;
    }
    check(good, "launches from two host threads at once");
}

void check_timing() {
    const unsigned blocks = 64, n = 128;
    std::vector<int> out(blocks, 0);
    std::string err;
    const auto t0 = std::chrono::steady_clock::now();
    bool ok = run(dim3(blocks), dim3(n), n * sizeof(int), 0, [&] { many_barriers(out.data()); },
                  &err, 0);
    const auto t1 = std::chrono::steady_clock::now();
    bool good = ok;
    for (int v : out) good = good && v == int(21 * n);
    const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    char buf[128];
    std::snprintf(buf, sizeof buf, "%.2f ms", ms);
    check(good, "64 blocks x 128 threads x 21 barriers", std::string(buf) + (err.empty() ? "" : "; " + err));

    const double ns = pyfa_emu::context_switch_ns(1000000);
    std::snprintf(buf, sizeof buf, "%.2f ns per switch", ns);
    check(ns > 0 && ns < 10000, "context switch ping-pong over 1e6 switches", buf);
}


// Runs `body` in a child process and returns its wait status.
int in_child(const std::function<void()>& body) {
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        body();
        std::_Exit(0);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
    return status;
}

std::string wait_str(int status) {
    if (status == -1) return "fork or waitpid failed";
    if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
    return "exited with " + std::to_string(WEXITSTATUS(status));
}

void check_stack_overflow() {
    const struct {
        const char* name;
        void (*kernel)();
    } cases[] = {{"recursion to twice the stack", deep_recursion},
                 {"a local array 1.5x the stack", big_local_array}};
    for (const auto& c : cases) {
        const int status = in_child([&] {
            std::string err;
            // Exit codes tell what happened if no signal does: 3 returned OK, 4 an error.
            std::_Exit(run(dim3(1), dim3(32), 0, 0, c.kernel, &err, 1) ? 3 : 4);
        });
        bool died = status != -1 && WIFSIGNALED(status) &&
                    (WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS);
#if defined(__SANITIZE_ADDRESS__)
        // AddressSanitizer catches the fault itself, reports a stack overflow and exits 1.
        died = died || (status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 1);
#endif
        check(died, std::string("stack overflow by ") + c.name + " dies with SIGSEGV, never returns",
              wait_str(status));
    }
}

#if defined(__x86_64__)
uint32_t get_mxcsr() {
    uint32_t m;
    asm volatile("stmxcsr %0" : "=m"(m));
    return m;
}
void set_mxcsr(uint32_t m) { asm volatile("ldmxcsr %0" : : "m"(m)); }
#endif

void check_fp_environment() {
#if defined(__x86_64__)
    const unsigned blocks = 4, n = 64;
    std::vector<float> in(blocks * n);
    for (size_t i = 0; i < in.size(); ++i)
        in[i] = i % 2 ? 1.17549435e-38f * float(1 + i % 7) : 1.0e-39f * float(1 + i % 5);
    std::vector<float> expect(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
        volatile float x = in[i];
        expect[i] = x * 0.5f;
    }
    const uint32_t saved = get_mxcsr();
    const uint32_t ftz_daz = saved | 0x8040u;  // bit 15 flush-to-zero, bit 6 denormals-are-zero
    for (int workers : {1, 2}) {
        std::vector<float> out(in.size(), -1.0f);
        std::string err;
        set_mxcsr(ftz_daz);
        const bool ok = run(dim3(blocks), dim3(n), 0, 0, [&] { halve(in.data(), out.data()); }, &err, workers);
        const uint32_t after = get_mxcsr();
        set_mxcsr(saved);
        bool same = ok;
        for (size_t i = 0; i < in.size(); ++i) same = same && bits(out[i]) == bits(expect[i]);
        char detail[96];
        std::snprintf(detail, sizeof detail, "MXCSR set 0x%x, after the launch 0x%x; ", ftz_daz, after);
        check(same && after == ftz_daz,
              "caller with FTZ/DAZ: kernels keep subnormals, caller's MXCSR kept, " +
                  std::to_string(workers) + " worker(s)",
              detail + err);
    }
#else
    check(true, "FP environment check is x86-64 only (skipped here)");
#endif
}

struct ProgressLog {
    std::atomic<int> calls{0};
    int cancel_at = 0;  // 0: never cancel
    std::vector<std::pair<int64_t, int64_t>> seen;  // only one thread calls at a time
    std::atomic<int> inside{0};
    bool overlapped = false;
    std::chrono::steady_clock::time_point cancelled_at;
};

int progress_cb(void* user, int64_t done, int64_t total) {
    ProgressLog* log = static_cast<ProgressLog*>(user);
    if (log->inside.fetch_add(1) != 0) log->overlapped = true;
    log->seen.emplace_back(done, total);
    const int n = ++log->calls;
    const bool stop = log->cancel_at && n >= log->cancel_at;
    if (stop) log->cancelled_at = std::chrono::steady_clock::now();
    log->inside.fetch_sub(1);
    return stop ? 1 : 0;
}

pyfa_emu::Error run_with_progress(dim3 grid, dim3 block, int workers, ProgressLog* log,
                                  const std::function<void()>& body, std::string* err) {
    pyfa_emu::LaunchOptions opt;
    opt.workers = workers;
    opt.progress = progress_cb;
    opt.progress_user = log;
    pyfa_emu::LaunchResult result;
    const pyfa_emu::Error e = pyfa_emu::launch(grid, block, 0, opt, body, &result);
    *err = result.message;
    return e;
}

double ms_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

void check_progress() {
    // A grid of short blocks, not cancelled: calls come, done never decreases, the last
    // call reports the whole grid.
    {
        ProgressLog log;
        std::atomic<int> finished{0};
        std::string err;
        const unsigned blocks = 400;
        const pyfa_emu::Error e = run_with_progress(dim3(blocks), dim3(64), 2, &log,
                                                    [&] { barrier_rounds(400, &finished); }, &err);
        bool monotone = true, totals = true;
        for (size_t i = 0; i < log.seen.size(); ++i) {
            totals = totals && log.seen[i].second == blocks && log.seen[i].first <= blocks;
            if (i) monotone = monotone && log.seen[i].first >= log.seen[i - 1].first;
        }
        const bool last_full = !log.seen.empty() && log.seen.back().first == blocks;
        check(e == pyfa_emu::Error::None && finished.load() == int(blocks) && log.seen.size() >= 2 &&
                  monotone && totals && last_full && !log.overlapped,
              "progress: (blocks done, blocks total), non-decreasing, ends with the whole grid",
              std::to_string(log.seen.size()) + " calls; " + err);
    }
    // One block that would run for many seconds: cancelled inside it, at a barrier.
    {
        ProgressLog log;
        log.cancel_at = 2;
        std::atomic<int> finished{0};
        std::string err;
        const auto t0 = std::chrono::steady_clock::now();
        const pyfa_emu::Error e = run_with_progress(dim3(1), dim3(128), 1, &log,
                                                    [&] { barrier_rounds(100000000L, &finished); }, &err);
        const double total_ms = ms_since(t0), after_ms = ms_since(log.cancelled_at);
        char detail[160];
        std::snprintf(detail, sizeof detail, "%d calls, returned %.1f ms after the cancelling call, %.1f ms in all; ",
                      log.calls.load(), after_ms, total_ms);
        check(e == pyfa_emu::Error::Cancelled && finished.load() == 0 && log.calls.load() == 2 &&
                  after_ms < 250 && contains(err, "cancelled"),
              "progress returning nonzero cancels a long block at a barrier", detail + err);
    }
    // Blocks without barriers: cancelled between blocks, the rest never start.
    {
        ProgressLog log;
        log.cancel_at = 1;
        std::atomic<int> started{0};
        std::string err;
        const unsigned blocks = 2000000;
        const pyfa_emu::Error e = run_with_progress(dim3(blocks), dim3(32), 2, &log,
                                                    [&] { count_blocks(&started); }, &err);
        check(e == pyfa_emu::Error::Cancelled && started.load() < int(blocks) && log.calls.load() == 1,
              "progress returning nonzero stops the remaining blocks",
              std::to_string(started.load()) + " of " + std::to_string(blocks) + " blocks started; " + err);
    }
    std::string err;
    std::atomic<int> finished{0};
    bool ok = run(dim3(3), dim3(64), 0, 0, [&] { barrier_rounds(3, &finished); }, &err, 2);
    check(ok && finished.load() == 3, "a launch after a cancelled one works", err);
}

}  // namespace

int main() {
    // A hang is a failure too; the runtime promises never to hang.
    std::thread([] {
        std::this_thread::sleep_for(std::chrono::seconds(120));
        std::printf("FAIL: watchdog: the self-test did not finish in 120 s\n");
        std::fflush(stdout);
        std::_Exit(2);
    }).detach();

    check_reduction();
    check_errors();
    check_shuffles();
    check_smem();
    check_early_return();
    check_indices();
    check_concurrent_launches();
    check_stack_overflow();
    check_fp_environment();
    check_progress();
    check_timing();
    std::printf("info: deepest fiber stack use %zu of %zu bytes\n", pyfa_emu::stack_high_water(),
                pyfa_emu::kFiberStackBytes);

    std::printf("emu selftest: %d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
