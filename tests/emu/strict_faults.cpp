// strict_faults.cpp: the strict emulator's mutation tests (tests/test_emu_strict.py). Two
// real kernels, the readable FA2 forward and the fast one (d = 64, 64 x 64), built with
// their fault hooks (src/common/fault.h) and the strict instrumentation, each run once
// per fault given on the command line:
//
//   strict_faults FAULT...   FAULT: none, race, init, bounds, barrier (readable kernel);
//                            fast-none, async_count, async_drop, align, warp_race,
//                            warp_mask (fast); mods-none, bias, alibi, cu_seqlens (the
//                            readable forward), dbias-none, dbias (the readable dK/dV)
//
// Each run prints one line, "FAULT: ok" or "FAULT: hazard: <the report>"; the test holds
// each report to the hazard its fault plants. The faults of the score modifications'
// tensors and of packed sequences' offsets shift the kernel's pointer to that tensor by
// one element after strict mode registered it: every index into it off by one, as a
// wrong index would be, so that strict mode must know the tensor's true extent (its
// broadcast strides, its B + 1 offsets) to report it.
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/emu/strict_params.h"
#include "common/smem.h"
#include "dense_params.h"
#include "kernels/fa2_backward.cuh"
#include "kernels/fa2_forward.cuh"
#include "kernels/fast/fa2_forward_fast.cuh"

namespace {

const char* g_fault = "";

}  // namespace

bool pyfa_fault(const char* name) { return std::strcmp(name, g_fault) == 0; }

namespace {

// Non-causal self-attention, B = 1, H = 2, d = 64; N has a tail tile for both kernels.
struct Problem {
    int64_t B = 1, H = 2, N, d = 64;
    std::vector<float> q, k, v, o, lse;

    explicit Problem(int64_t N_) : N(N_) {
        std::mt19937 gen(7);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto* t : {&q, &k, &v, &o}) {
            t->resize(size_t(B * H * N * d));
            for (float& x : *t) x = normal(gen);
        }
        lse.assign(size_t(B * H * N), 0.0f);
    }

    AttentionParams params(int Br, int Bc) {
        AttentionParams p = dense_params(B, H, N, d, /*causal=*/0, Br, Bc);
        p.q = q.data();
        p.k = k.data();
        p.v = v.data();
        p.o = o.data();
        p.lse = lse.data();
        return p;
    }
};

void report(const char* fault, const pyfa_emu::LaunchResult& result);

void run(const char* fault) {
    const bool fast = std::strncmp(fault, "fast", 4) == 0 || !std::strcmp(fault, "async_count") ||
                      !std::strcmp(fault, "async_drop") || !std::strcmp(fault, "align") ||
                      !std::strcmp(fault, "warp_race") || !std::strcmp(fault, "warp_mask");
    g_fault = fault;
    const int Br = fast ? 64 : 16, Bc = fast ? 64 : 16;
    Problem prob(fast ? 96 : 40);
    const AttentionParams p = prob.params(Br, Bc);
    pyfa_emu::StrictSession session(fast ? "fa2_forward/fast d=64 64x64 (fast variant)"
                                         : "fa2_forward (reference variant)");
    AttentionParams run = p;
    if (!pyfa_emu::strict_tensors(session, PYFA_KERNEL_FA2_FORWARD, p, run)) {
        std::printf("%s: FAIL: out of memory\n", fault);
        return;
    }
    const SmemLayout L = fast ? fa2_forward_fast_smem(Br, Bc, p.head_dim) : fa2_forward_smem(Br, Bc, p.head_dim);
    for (int t = 0; t < L.count; ++t) session.add_term(L.name[t], L.offset[t], L.floats[t], L.width[t]);
    pyfa_emu::LaunchOptions options;
    options.strict = &session;
    options.workers = 1;
    const std::function<void()> body = [&run, fast] {
        if (fast)
            pyfa_emu_strict_kernels::fa2_forward_fast_kernel<64, 64>(run);
        else
            pyfa_emu_strict_kernels::fa2_forward_kernel(run);
    };
    const unsigned threads = fast ? unsigned(fa2_forward_fast_threads(Br)) : unsigned(kFa2ForwardThreads);
    const dim3 grid(unsigned((p.seqlen_q + Br - 1) / Br), unsigned(p.heads), unsigned(p.batch));
    pyfa_emu::LaunchResult result;
    pyfa_emu::launch(grid, dim3(threads), size_t(L.bytes()), options, body, &result);
    report(fault, result);
}

void report(const char* fault, const pyfa_emu::LaunchResult& result) {
    if (result.error == pyfa_emu::Error::None)
        std::printf("%s: ok\n", fault);
    else if (result.error == pyfa_emu::Error::Hazard)
        std::printf("%s: hazard: %s\n", fault, result.message);
    else
        std::printf("%s: error %d: %s\n", fault, int(result.error), result.message);
    std::fflush(stdout);
}

// The readable FA2 forward with a bias broadcast over B and H whose rows are padded
// (row stride Nk + 4) and ALiBi slopes of shape (H,) (batch stride 0), or on two packed
// sequences; the fault shifts the kernel's pointer to one of those tensors by one.
void run_mods(const char* fault) {
    const bool packed = !std::strcmp(fault, "cu_seqlens");
    const int Br = 16, Bc = 16;
    Problem prob(40);
    AttentionParams p = prob.params(Br, Bc);
    const int64_t N = prob.N, ldb = N + 4;
    std::vector<float> bias(size_t(N * ldb), 0.5f), slopes(size_t(prob.H), 0.25f);
    for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < N; ++j) bias[size_t(i * ldb + j)] = 0.01f * float((i * 7 + j) % 13);
    const int32_t cu[3] = {0, 17, int32_t(N)};
    if (packed) {
        // One batch of N rows in two sequences of 17 and 23, (H, total) per-row tensors.
        const TensorStrides rows{prob.H * N * prob.d, prob.d, prob.H * prob.d};
        p.q_strides = p.k_strides = p.v_strides = p.o_strides = rows;
        p.batch = 2;
        p.cu_seqlens_q = p.cu_seqlens_k = cu;
        p.total_q = N;
        p.causal_align = 0;
        p.seqlen_q = p.seqlen_k = 23;
    } else {
        p.bias = bias.data();
        p.bias_strides = TensorStrides{0, 0, ldb};
        p.alibi_slopes = slopes.data();
        p.alibi_strides = TensorStrides{0, 1, 0};
    }
    pyfa_emu::StrictSession session("fa2_forward (reference variant)");
    AttentionParams run = p;
    if (!pyfa_emu::strict_tensors(session, PYFA_KERNEL_FA2_FORWARD, p, run)) {
        std::printf("%s: FAIL: out of memory\n", fault);
        return;
    }
    if (!std::strcmp(fault, "bias")) run.bias += 1;
    if (!std::strcmp(fault, "alibi")) run.alibi_slopes += 1;
    if (packed) run.cu_seqlens_q += 1;
    const SmemLayout L = fa2_forward_smem(Br, Bc, p.head_dim);
    for (int t = 0; t < L.count; ++t) session.add_term(L.name[t], L.offset[t], L.floats[t], L.width[t]);
    pyfa_emu::LaunchOptions options;
    options.strict = &session;
    options.workers = 1;
    const std::function<void()> body = [&run] { pyfa_emu_strict_kernels::fa2_forward_kernel(run); };
    const dim3 grid(unsigned((p.seqlen_q + Br - 1) / Br), unsigned(p.heads), unsigned(p.batch));
    pyfa_emu::LaunchResult result;
    pyfa_emu::launch(grid, dim3(kFa2ForwardThreads), size_t(L.bytes()), options, body, &result);
    report(fault, result);
}

// The readable FA2 dK/dV kernel with a dense bias, writing dS into dbias; the fault
// shifts the kernel's dbias pointer by one.
void run_dbias(const char* fault) {
    const int Br = 16, Bc = 16;
    Problem prob(40);
    AttentionParams p = prob.params(Br, Bc);
    const int64_t B = prob.B, H = prob.H, N = prob.N, d = prob.d;
    std::vector<float> dout(prob.o), drow(size_t(B * H * N), 0.125f), dk(size_t(B * H * N * d)), dv(dk);
    std::vector<float> bias(size_t(B * H * N * N), 0.25f), dbias(bias.size());
    p.dout = dout.data();
    p.drow = drow.data();
    p.dk = dk.data();
    p.dv = dv.data();
    p.bias = bias.data();
    p.bias_strides = TensorStrides{H * N * N, N * N, N};
    p.dbias = dbias.data();
    pyfa_emu::StrictSession session("fa2_backward_dkdv (reference variant)");
    AttentionParams run = p;
    if (!pyfa_emu::strict_tensors(session, PYFA_KERNEL_FA2_BACKWARD_DKDV, p, run)) {
        std::printf("%s: FAIL: out of memory\n", fault);
        return;
    }
    if (!std::strcmp(fault, "dbias")) run.dbias += 1;
    const SmemLayout L = fa2_backward_dkdv_smem(Br, Bc, d);
    for (int t = 0; t < L.count; ++t) session.add_term(L.name[t], L.offset[t], L.floats[t], L.width[t]);
    pyfa_emu::LaunchOptions options;
    options.strict = &session;
    options.workers = 1;
    const std::function<void()> body = [&run] { pyfa_emu_strict_kernels::fa2_backward_dkdv_kernel(run); };
    const dim3 grid(unsigned((p.seqlen_k + Bc - 1) / Bc), unsigned(p.heads_kv), unsigned(p.batch));
    pyfa_emu::LaunchResult result;
    pyfa_emu::launch(grid, dim3(kFa2BackwardThreads), size_t(L.bytes()), options, body, &result);
    report(fault, result);
}

}  // namespace

int main(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
        const char* f = argv[i];
        if (!std::strcmp(f, "mods-none") || !std::strcmp(f, "bias") || !std::strcmp(f, "alibi") ||
            !std::strcmp(f, "cu_seqlens"))
            run_mods(f);
        else if (!std::strncmp(f, "dbias", 5))
            run_dbias(f);
        else
            run(f);
    }
    return 0;
}
