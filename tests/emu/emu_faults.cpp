// emu_faults.cpp: the emulator with the library's real kernels, under stress.
//
//   emu_faults sweep   (under LD_PRELOAD=fail_alloc.so) runs an FA2 forward launch again
//                      and again, letting the first N memory requests succeed and failing
//                      the rest, for every N until one launch needs no more than N: each
//                      launch must return OK with the exact result, or OutOfMemory; never
//                      anything else, never a crash or std::terminate; and with every
//                      worker but the launching thread refused its memory, the launch
//                      must go on with that one.
//   emu_faults stack   prints each kernel's deepest fiber stack use, in bytes.
//
// Prints "FAIL: ..." lines and exits nonzero on failure; the last line is a summary.
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/smem.h"
#include "dense_params.h"
#include "kernels/fa1_backward.cuh"
#include "kernels/fa1_forward.cuh"
#include "kernels/fa2_backward.cuh"
#include "kernels/fa2_forward.cuh"

namespace {

using ArmFn = void (*)(long, int);
using DisarmFn = long (*)();

int g_failed = 0;

void fail(const std::string& what) {
    ++g_failed;
    std::printf("FAIL: %s\n", what.c_str());
    std::fflush(stdout);
}

// One causal self-attention problem (B = 1, H = 2) and every buffer any kernel takes.
struct Problem {
    int64_t B = 1, H = 2, N, d;
    int Br, Bc;
    std::vector<float> q, k, v, o, lse, m, l, dout, dq, dk, dv, drow;

    Problem(uint32_t seed, int64_t N_, int64_t d_, int Br_, int Bc_) : N(N_), d(d_), Br(Br_), Bc(Bc_) {
        std::mt19937 gen(seed);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        const size_t big = size_t(B * H * N * d), small = size_t(B * H * N);
        for (auto* t : {&q, &k, &v, &o, &dout, &dq, &dk, &dv}) {
            t->resize(big);
            for (float& x : *t) x = normal(gen);
        }
        for (auto* t : {&lse, &m, &l, &drow}) {
            t->resize(small);
            for (float& x : *t) x = 1.0f + std::abs(normal(gen));
        }
    }

    AttentionParams params() {
        AttentionParams p = dense_params(B, H, N, d, /*causal=*/1, Br, Bc);
        p.q = q.data();
        p.k = k.data();
        p.v = v.data();
        p.o = o.data();
        p.lse = lse.data();
        p.m = m.data();
        p.l = l.data();
        p.dout = dout.data();
        p.dq = dq.data();
        p.dk = dk.data();
        p.dv = dv.data();
        p.drow = drow.data();
        return p;
    }
};

// The readable kernels only: the fast ones (kernels/fast/) would cost most of this
// program's compile time, and neither mode runs them.
using KernelFn = void (*)(AttentionParams);

struct Shape {
    KernelFn fn;
    const char* name;
    dim3 grid;
    unsigned threads;
    size_t smem;
};

std::vector<Shape> shapes(const Problem& pr) {
    const unsigned Tr = unsigned((pr.N + pr.Br - 1) / pr.Br), Tc = unsigned((pr.N + pr.Bc - 1) / pr.Bc);
    const unsigned H = unsigned(pr.H), B = unsigned(pr.B);
    auto bytes = [](SmemLayout L) { return size_t(L.bytes()); };
    return {
        {PYFA_KERNELS::fa2_forward_kernel, "fa2_forward", dim3(Tr, H, B), kFa2ForwardThreads,
         bytes(fa2_forward_smem(pr.Br, pr.Bc, pr.d))},
        {PYFA_KERNELS::fa1_forward_kernel, "fa1_forward", dim3(1, H, B), kFa1ForwardThreads,
         bytes(fa1_forward_smem(pr.Br, pr.Bc, pr.d))},
        {PYFA_KERNELS::fa1_backward_kernel, "fa1_backward", dim3(1, H, B), kFa1BackwardThreads,
         bytes(fa1_backward_smem(pr.Br, pr.Bc, pr.d))},
        {PYFA_KERNELS::fa2_backward_preprocess_kernel, "fa2_backward_preprocess", dim3(Tr, H, B),
         kFa2BackwardThreads, bytes(fa2_backward_preprocess_smem(pr.Br, pr.Bc, pr.d))},
        {PYFA_KERNELS::fa2_backward_dkdv_kernel, "fa2_backward_dkdv", dim3(Tc, H, B), kFa2BackwardThreads,
         bytes(fa2_backward_dkdv_smem(pr.Br, pr.Bc, pr.d))},
        {PYFA_KERNELS::fa2_backward_dq_kernel, "fa2_backward_dq", dim3(Tr, H, B), kFa2BackwardThreads,
         bytes(fa2_backward_dq_smem(pr.Br, pr.Bc, pr.d))},
    };
}

pyfa_emu::Error launch(const Shape& s, const std::function<void()>& body, int workers,
                       pyfa_emu::LaunchResult* result) {
    pyfa_emu::LaunchOptions opt;
    opt.workers = workers;
    return pyfa_emu::launch(s.grid, dim3(s.threads), s.smem, opt, body, result);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

int sweep() {
    const ArmFn arm = reinterpret_cast<ArmFn>(dlsym(RTLD_DEFAULT, "pyfa_shim_arm"));
    const DisarmFn disarm = reinterpret_cast<DisarmFn>(dlsym(RTLD_DEFAULT, "pyfa_shim_disarm"));
    if (!arm || !disarm) {
        std::printf("FAIL: run me with LD_PRELOAD=fail_alloc.so\n");
        return 2;
    }
    Problem pr(7, 96, 32, 32, 16);
    const AttentionParams p = pr.params();
    const Shape fwd = shapes(pr)[0];
    const KernelFn fn = fwd.fn;
    const std::function<void()> body = [fn, &p] { fn(p); };
    pyfa_emu::LaunchResult result;
    if (launch(fwd, body, 1, &result) != pyfa_emu::Error::None) {
        fail(std::string("reference launch: ") + result.message);
        return 1;
    }
    const std::vector<float> o_ref = pr.o, lse_ref = pr.lse;

    int trials = 0;
    const struct {
        int kinds;
        const char* name;
    } kinds[] = {{1, "heap"}, {2, "mappings"}, {3, "heap and mappings"}};
    for (const auto& kind : kinds) {
        for (int workers : {1, 3}) {
            int ok = 0, oom = 0, dropped = 0;
            for (long n = 0;; ++n) {
                pyfa_emu::release_workers();  // every launch gets its memory anew
                std::fill(pr.o.begin(), pr.o.end(), -7.0f);
                std::fill(pr.lse.begin(), pr.lse.end(), -7.0f);
                arm(n, kind.kinds);
                const pyfa_emu::Error e = launch(fwd, body, workers, &result);
                const long failures = disarm();
                ++trials;
                const std::string where = std::string(kind.name) + ", " + std::to_string(workers) +
                                          " workers, " + std::to_string(n) + " requests granted: ";
                if (e == pyfa_emu::Error::None) {
                    ++ok;
                    if (result.workers < workers) ++dropped;
                    if (!same_bits(pr.o, o_ref) || !same_bits(pr.lse, lse_ref))
                        fail(where + "launch returned OK with a wrong result");
                } else if (e == pyfa_emu::Error::OutOfMemory) {
                    ++oom;
                    if (!std::strstr(result.message, "out of memory"))
                        fail(where + "OutOfMemory without saying so: " + result.message);
                } else {
                    fail(where + "error " + std::to_string(int(e)) +
                         " instead of OK or OutOfMemory: " + result.message);
                }
                if (failures == 0) break;  // the launch had every request it made
                if (n > 100000) {
                    fail(where + "sweep did not end");
                    break;
                }
            }
            std::printf("sweep %s, %d workers: %d OK (%d with fewer workers), %d out of memory\n",
                        kind.name, workers, ok, dropped, oom);
            if (oom == 0) fail(std::string(kind.name) + ": no launch ran out of memory; the shim did nothing");
        }
        // Which worker of a sweep's launch runs out first is up to the scheduler; here
        // every worker but the launching thread's own is refused, so the launch must go
        // on with that one alone. A worker that starts only after the launching thread
        // has drained the grid asks for nothing (it takes the pooled memory): such a try
        // refused nobody and is made again.
        const std::string where = std::string(kind.name) + " refused to all workers but one: ";
        long failures = 0;
        pyfa_emu::Error e = pyfa_emu::Error::None;
        for (int attempt = 0; attempt < 50 && e == pyfa_emu::Error::None && failures == 0; ++attempt) {
            pyfa_emu::release_workers();
            std::fill(pr.o.begin(), pr.o.end(), -7.0f);
            std::fill(pr.lse.begin(), pr.lse.end(), -7.0f);
            arm(0, kind.kinds | 4);
            e = launch(fwd, body, 3, &result);
            failures = disarm();
            ++trials;
            if (e == pyfa_emu::Error::None && result.workers != 1)
                fail(where + std::to_string(result.workers) + " workers ran blocks");
            if (e == pyfa_emu::Error::None && (!same_bits(pr.o, o_ref) || !same_bits(pr.lse, lse_ref)))
                fail(where + "launch returned OK with a wrong result");
        }
        if (e != pyfa_emu::Error::None)
            fail(where + "error " + std::to_string(int(e)) + ": " + result.message);
        else if (failures == 0)
            fail(where + "no worker was refused in 50 launches");
        else
            std::printf("%s refused to all workers but one: went on with 1 of 3\n", kind.name);
    }
    std::printf("emu faults: %d launches, %d failed checks\n", trials, g_failed);
    return g_failed ? 1 : 0;
}

int stack() {
    for (int64_t d : {32, 64, 128, 256}) {
        Problem pr(11, 48, d, 16, 16);
        const AttentionParams p = pr.params();
        for (const Shape& s : shapes(pr)) {
            const KernelFn fn = s.fn;
            pyfa_emu::release_workers();  // a fresh stack shows this kernel's use alone
            pyfa_emu::LaunchResult result;
            if (launch(s, [fn, &p] { fn(p); }, 1, &result) != pyfa_emu::Error::None) {
                fail(std::string(s.name) + ": " + result.message);
                continue;
            }
            std::printf("stack %s d=%lld: %zu bytes\n", s.name, static_cast<long long>(d),
                        pyfa_emu::stack_high_water());
        }
    }
    std::printf("emu faults: %d failed checks\n", g_failed);
    return g_failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "sweep") return sweep();
    if (mode == "stack") return stack();
    std::printf("usage: emu_faults sweep|stack\n");
    return 2;
}
