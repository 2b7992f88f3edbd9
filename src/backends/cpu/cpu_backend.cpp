// cpu_backend.cpp: the cpu backend's dispatcher. It picks an instruction-set build of the
// tile code (cpu_impl.h), cuts an operation into work items, runs them on a few threads
// and polls config->progress between them. Results never depend on the thread count:
// the items of one phase write disjoint outputs, and each sum is computed whole by the
// one item that owns it, in the contract's order (docs/numerics.md, docs/cpu_backend.md).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "common/merge.h"
#include "common/tiling.h"
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/thread_pool.h"
#include "core/internal.h"

namespace pyfa {

namespace {

using pyfa_cpu::Ctx;
using pyfa_cpu::Isa;

// The builds by name; both AVX-512 ones need the same instructions.
bool cpu_has(const std::string& what) {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (what == "avx512" || what == "avx512_wide")
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    if (what == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return what == "portable";
}

const Isa* isa_named(const std::string& name) {
#if defined(__x86_64__) || defined(_M_X64)
    if (name == "avx512_wide") return &pyfa_cpu::kIsaAvx512Wide;
    if (name == "avx512") return &pyfa_cpu::kIsaAvx512;
    if (name == "avx2") return &pyfa_cpu::kIsaAvx2;
#endif
    if (name == "portable") return &pyfa_cpu::kIsaPortable;
    return nullptr;
}

// auto's AVX-512 schedule: the 4 x 6 register tiles on Intel, whose server cores have two
// 512-bit FMA pipes (measured faster on Sapphire Rapids); 2 x 6 elsewhere (Zen 4 runs one
// 512-bit FMA a cycle, and its measured schedule is that one).
const char* avx512_schedule() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel")) return "avx512_wide";
#endif
    return "avx512";
}

// The best build this CPU runs, or the one PYFA_CPU_ISA names (read at every call, so a
// test can run each build in one process); null, with *why, when that cannot run.
const Isa* chosen_isa(pyfa_status* code, std::string* why) {
    const char* env = std::getenv("PYFA_CPU_ISA");
    const std::string want = env ? env : "";
    if (want.empty() || want == "auto") {
        for (const char* name : {"avx512", "avx2", "portable"})
            if (isa_named(name) && cpu_has(name))
                return isa_named(std::string(name) == "avx512" ? avx512_schedule() : name);
    }
    if (want == "avx512_wide" || want == "avx512" || want == "avx2" || want == "portable") {
        if (isa_named(want) && cpu_has(want)) return isa_named(want);
        *code = PYFA_ERROR_BACKEND_UNAVAILABLE;
        *why = "PYFA_CPU_ISA=" + want + ": this CPU (or this build) cannot run that instruction set";
        return nullptr;
    }
    *code = PYFA_ERROR_INVALID_ARGUMENT;
    *why = "PYFA_CPU_ISA: expected avx512_wide, avx512, avx2, portable or auto, got '" + want + "'";
    return nullptr;
}

pyfa_status pick_isa(const Isa** isa) {
    pyfa_status code = PYFA_OK;
    std::string why;
    *isa = chosen_isa(&code, &why);
    return *isa ? PYFA_OK : fail(code, why);
}

// Cores this process may run on (its affinity mask where the OS has one).
int cores() {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// One phase: `items` independent work items; the next phase starts when all are done.
struct Phase {
    int64_t items;
    std::function<void(int64_t item, float* ws)> run;
};

class Runner {
public:
    Runner(const pyfa_config& cfg, int threads, int64_t total) : cfg_(cfg), threads_(threads), total_(total) {}

    // Runs every phase in order; PYFA_ERROR_CANCELLED when progress asked to stop.
    pyfa_status run(const std::vector<Phase>& phases, size_t ws_floats) {
        // No more threads than the largest phase has items.
        int64_t most = 1;
        for (const Phase& ph : phases) most = std::max(most, ph.items);
        threads_ = static_cast<int>(std::min<int64_t>(threads_, most));
        // Each thread's workspace starts on a 64-byte boundary, zeroed as the kernels expect.
        const size_t stride = (ws_floats + 15) / 16 * 16, floats = stride * static_cast<size_t>(threads_);
        float* const base = static_cast<float*>(host_take(floats * sizeof(float)));
        if (!base)
            return fail(PYFA_ERROR_OUT_OF_MEMORY, "out of host memory for the cpu backend's %zu-byte workspace",
                        floats * sizeof(float));
        std::memset(base, 0, floats * sizeof(float));
        struct Give {
            float* p;
            ~Give() { host_give(p); }
        } give{base};
        for (const Phase& ph : phases) {
            if (stop_) break;
            std::atomic<int64_t> next{0};
            auto worker = [&](int t) {
                float* ws = base + stride * static_cast<size_t>(t);
                while (!stop_) {
                    const int64_t k = next.fetch_add(1);
                    if (k >= ph.items) break;
                    ph.run(k, ws);
                }
            };
            pyfa_cpu::run_on_threads(static_cast<int>(std::min<int64_t>(threads_, ph.items)), worker);
        }
        return cancelled_ ? fail(PYFA_ERROR_CANCELLED, "cancelled by config->progress") : PYFA_OK;
    }

    // After each unit of work: counts it and, at most every 50 ms and from one thread at a
    // time, reports to config->progress.
    void done_one() {
        const int64_t done = done_.fetch_add(1) + 1;
        if (!cfg_.progress || stop_ || !poll_.try_lock()) return;
        const auto now = std::chrono::steady_clock::now();
        if (!stop_ && (!polled_ || now - last_ >= std::chrono::milliseconds(50))) {
            polled_ = true;
            last_ = now;
            if (cfg_.progress(cfg_.progress_user, done, total_) != 0) {
                cancelled_ = true;
                stop_ = true;
            }
        }
        poll_.unlock();
    }

    bool stopped() const { return stop_; }

private:
    const pyfa_config& cfg_;
    int threads_;
    int64_t total_;
    std::atomic<int64_t> done_{0};
    std::atomic<bool> stop_{false};
    std::atomic<bool> cancelled_{false};
    std::mutex poll_;
    bool polled_ = false;
    std::chrono::steady_clock::time_point last_;
};

// The mask's bands: for each Q tile its K/V tiles, for each K/V tile its Q tiles; of
// each sequence of a packed batch (b * T + t), of the one all sequences share otherwise.
// A tile past its sequence's rows (keys) gets an empty band. band(s, t) is tile t's band
// in sequence s, called only for a tile inside it; T is the tiles per sequence.
template <class BandOf>
void bands(const AttentionParams& p, int64_t T, BandOf band, std::vector<int64_t>* begin, std::vector<int64_t>* end) {
    const int64_t B = p.cu_seqlens_q ? p.batch : 1;
    begin->resize(static_cast<size_t>(B * T));
    end->resize(static_cast<size_t>(B * T));
    for (int64_t b = 0; b < B; ++b) {
        const Sequence s = p.sequence(b);
        for (int64_t t = 0; t < T; ++t) {
            const TileRange r = band(s, t);
            (*begin)[static_cast<size_t>(b * T + t)] = r.begin;
            (*end)[static_cast<size_t>(b * T + t)] = r.end;
        }
    }
}

void kv_bands(const AttentionParams& p, std::vector<int64_t>* begin, std::vector<int64_t>* end) {
    bands(p, ceil_div(p.seqlen_q, p.block_r), [&p](const Sequence& s, int64_t i) {
        const int64_t row0 = i * p.block_r;
        return row0 < s.Nq ? p.split_tiles(s.mask.kv_tiles(row0, min64(p.block_r, s.Nq - row0), p.block_c, s.Nk),
                                           p.block_c)
                           : TileRange{0, 0};
    }, begin, end);
}

void q_bands(const AttentionParams& p, std::vector<int64_t>* begin, std::vector<int64_t>* end) {
    bands(p, ceil_div(p.seqlen_k, p.block_c), [&p](const Sequence& s, int64_t j) {
        const int64_t col0 = j * p.block_c;
        return col0 < s.Nk ? s.mask.q_tiles(col0, min64(p.block_c, s.Nk - col0), p.block_r, s.Nq) : TileRange{0, 0};
    }, begin, end);
}

// split_combine_tile (common/merge.h) with each row's fold computed once for all its d
// elements: a step's weights depend only on the parts' LSE (MergeStep), so
// merge_state_element computes the same w_a, w_c, w (two exps and a log per part) for
// every x of a row. Here each step is computed once per row and applied to the row's
// elements: the same bits, without d times the exps (at d = 128 the exps of the
// per-element fold cost more than the chunks themselves). The sink is the last part.
void combine_tile(const AttentionParams& p, int64_t i, int64_t h, int64_t b) {
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, row0 = i * p.block_r;
    if (row0 >= seq.Nq) return;
    const int64_t br = min64(p.block_r, seq.Nq - row0);
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t r = 0; r < br; ++r) {
        const float* O_part = p.o_part + p.o_part_strides.at(seq.batch, h, seq.q0 + row0 + r);  // (d) of chunk 0
        const float* LSE_part = p.lse_part + p.stat_at(seq, h) + row0 + r;                       // of chunk 0
        float acc_lse = -INFINITY;
        for (int64_t x = 0; x < d; ++x) acc[static_cast<size_t>(x)] = 0.0f;
        for (int64_t c = 0; c < p.split_count; ++c) {
            const MergeStep step = merge_step(acc_lse, LSE_part[c * p.lse_part_step]);
            const float* o_c = O_part + c * p.o_part_step;  // (d)
            if (step.kind != MergeStep::kSkip)
                for (int64_t x = 0; x < d; ++x) {
                    float& a = acc[static_cast<size_t>(x)];
                    a = step.apply(a, o_c[x]);
                }
            acc_lse = step.lse;
        }
        const MergeStep sink = merge_step(acc_lse, p.sink(h));
        float* O = p.o + p.o_strides.at(seq.batch, h, seq.q0 + row0 + r);  // (d)
        for (int64_t x = 0; x < d; ++x) O[x] = pyfa_canonical_nan(sink.apply(acc[static_cast<size_t>(x)], 0.0f));
        p.lse[p.stat_at(seq, h) + row0 + r] = pyfa_canonical_nan(sink.lse);
    }
}

// The tile tables of one context, kept alive beside it.
struct Plan {
    Ctx ctx{};
    std::vector<int64_t> kv_begin, kv_end, q_begin, q_end;
    // backward: the split backward walks every chunk of the band itself (split_size there
    // folds the chunks, backward_kv and backward_dq), so its bands are not cut to one chunk.
    Plan(const AttentionParams& p, bool fa1, float* D, bool backward = false) {
        ctx.p = p;
        ctx.fa1 = fa1;
        ctx.D = D;
        AttentionParams whole = p;
        if (backward) whole.split_size = 0;
        kv_bands(whole, &kv_begin, &kv_end);
        q_bands(p, &q_begin, &q_end);
        ctx.kv_begin = kv_begin.data();
        ctx.kv_end = kv_end.data();
        ctx.q_begin = q_begin.data();
        ctx.q_end = q_end.data();
        ctx.Tr = ceil_div(p.seqlen_q, p.block_r);
        ctx.Tc = ceil_div(p.seqlen_k, p.block_c);
        ctx.per_sequence = p.cu_seqlens_q != nullptr;
    }
    int64_t Tr() const { return ctx.Tr; }
    int64_t Tc() const { return ctx.Tc; }
};

// config->threads = 0: one thread per core, but no more than one per kWorkPerThread
// multiply-adds of the op (an upper bound: masks and packed sequences do less), since
// waking a parked thread and waiting for it costs about 0.1 ms on the 2-core machines
// measured (a decoding step at context 256 took 0.45 ms on two threads, 0.44 on one).
constexpr int64_t kWorkPerThread = int64_t{1} << 21;
int auto_threads(int op, const AttentionParams& p) {
    const bool backward = op == PYFA_OP_FA1_BACKWARD || op == PYFA_OP_FA2_BACKWARD;
    const double work = static_cast<double>(p.batch) * p.heads * p.seqlen_q * p.seqlen_k * p.head_dim *
                        (backward ? 3 : 1);
    const double most = std::max(1.0, work / static_cast<double>(kWorkPerThread));
    return most < cores() ? static_cast<int>(most) : cores();
}

// params[n]: the op's kernel n with its tiles, in launch order (count of them).
pyfa_status cpu_run(int op, const AttentionParams* params, size_t count, const pyfa_config& cfg) {
    if (cfg.threads < 0)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->threads: must be >= 0 (0: one per core), got " +
                                                     std::to_string(cfg.threads));
    const Isa* isa = nullptr;
    pyfa_status st = pick_isa(&isa);
    if (st != PYFA_OK) return st;
    const AttentionParams& p0 = params[0];
    int threads = cfg.threads;
    if (threads == 0) threads = auto_threads(op, p0);

    const int64_t BH = p0.batch * p0.heads;
    std::vector<Phase> phases;
    std::vector<Plan> plans;
    plans.reserve(3);
    std::vector<float> fa1_D;
    int64_t total = 0;
    Runner* runner = nullptr;  // set below, before any phase runs

    if (op == PYFA_OP_FA2_FORWARD && count > 1 && params[count - 1].split_count > 0) {
        // Split-KV, every launch at once (api.cpp): params[c] computes chunk c's partial
        // (O, LSE) for c < count - 1, params[count - 1] folds them (common/merge.h). All
        // chunks are one phase, so that a long context costs two phases rather than a
        // pool hand-off per chunk (which at 128 chunks took longer than the chunks). An
        // item is a run of consecutive chunks of one head, read in address order by one
        // thread, so that a chunk's last tile prefetches the next one's first (decoding:
        // a chunk of 256 keys is 4 tiles, and its first tile's read was not overlapped);
        // runs as long as still leave 4 items per thread.
        const int64_t chunks = static_cast<int64_t>(count) - 1;
        const bool group = p0.seqlen_q <= pyfa_cpu::kGroupRows;  // as the unsplit decode below
        const int64_t Tr = ceil_div(p0.seqlen_q, p0.block_r);
        const int64_t nh = group ? pyfa_cpu::group_heads(p0, threads, chunks * Tr) : 1;
        const int64_t units = (group ? p0.batch * p0.heads_kv / nh : BH) * Tr;
        const int64_t run = std::clamp<int64_t>(units * chunks / (4 * static_cast<int64_t>(threads)), 1, chunks);
        const int64_t runs = ceil_div(chunks, run);
        plans.reserve(static_cast<size_t>(chunks));
        for (int64_t c = 0; c < chunks; ++c) {
            plans.emplace_back(params[c], false, nullptr);
            plans.back().ctx.group = group;
            plans.back().ctx.group_heads = nh;
            plans.back().ctx.prefetch_past = (c + 1) % run != 0 && c + 1 < chunks;
            plans.back().ctx.first_prefetched = c % run != 0;
        }
        phases.push_back({runs * units, [&, Tr, chunks, run, runs, group](int64_t k, float* ws) {
                              const int64_t u = k / runs, first = k % runs * run;
                              for (int64_t c = first; c < std::min(first + run, chunks); ++c) {
                                  const Plan& f = plans[static_cast<size_t>(c)];
                                  if (group) isa->forward_group(f.ctx, u / Tr, u % Tr, ws);
                                  else isa->forward(f.ctx, u / Tr, Tr - 1 - u % Tr, ws);
                                  runner->done_one();
                              }
                          }});
        const AttentionParams& fold = params[count - 1];
        phases.push_back({BH * Tr, [&, Tr](int64_t k, float*) {
                              const int64_t bh = k / Tr;
                              combine_tile(fold, k % Tr, bh % fold.heads, bh / fold.heads);
                              runner->done_one();
                          }});
        total = chunks * units + BH * Tr;
    } else if (op == PYFA_OP_FA2_FORWARD && count == 1 && p0.seqlen_q <= pyfa_cpu::kGroupRows) {
        // Decoding: one item per Q tile of each K/V head's group of query heads, so that
        // the group reads K_j, V_j once (memory-bound: the bytes of K and V are the cost).
        plans.emplace_back(p0, false, nullptr);
        plans[0].ctx.group = true;
        plans[0].ctx.group_heads = pyfa_cpu::group_heads(p0, threads, plans[0].Tr());
        const Plan& f = plans[0];
        const int64_t Tr = f.Tr(), BHkv = p0.batch * p0.heads_kv / f.ctx.group_heads;
        phases.push_back({BHkv * Tr, [&, Tr](int64_t k, float* ws) {
                              isa->forward_group(f.ctx, k / Tr, k % Tr, ws);
                              runner->done_one();
                          }});
        total = BHkv * Tr;
    } else if ((op == PYFA_OP_FA2_FORWARD || op == PYFA_OP_FA1_FORWARD) && count == 1) {
        // Q tiles of 64 rows where the profile's are 32 (d >= 256): each K_j, V_j then
        // serves twice the rows per pass (FA2 forward 4-6% faster at N = 1024, d = 256 on
        // Sapphire Rapids). Br changes no bit (docs/numerics.md); only long dense batches,
        // whose last tile is the only one partly empty.
        AttentionParams pf = p0;
        if (op == PYFA_OP_FA2_FORWARD && !p0.cu_seqlens_q && p0.head_dim >= 256 && p0.block_r < 64 &&
            p0.seqlen_q >= 128)
            pf.block_r = 64;
        plans.emplace_back(pf, op == PYFA_OP_FA1_FORWARD, nullptr);
        const Plan& f = plans[0];
        const int64_t Tr = f.Tr();
        // Head by head, so that the threads walk one head's K and V (which at d = 128
        // outgrow L2) while they are still in the caches; within a head Q tiles from the
        // last: under a causal mask the last ones visit the most K/V tiles, and handing out
        // the longest items first keeps the threads evenly busy.
        phases.push_back({BH * Tr, [&, Tr](int64_t k, float* ws) {
                              isa->forward(f.ctx, k / Tr, Tr - 1 - k % Tr, ws);
                              runner->done_one();
                          }});
        total = BH * Tr;
    } else if ((op == PYFA_OP_FA1_BACKWARD && count == 1) || (op == PYFA_OP_FA2_BACKWARD && count == 3)) {
        const bool fa1 = op == PYFA_OP_FA1_BACKWARD;
        float* D = p0.drow;
        if (fa1) {
            // Laid out as lse: (B, H, Nq), or (H, total_q) packed.
            fa1_D.resize(static_cast<size_t>(p0.cu_seqlens_q ? p0.heads * p0.total_q : BH * p0.seqlen_q));
            D = fa1_D.data();
        }
        plans.emplace_back(p0, fa1, D, true);                      // D = rowsum(dO o O)
        plans.emplace_back(fa1 ? p0 : params[1], fa1, D, true);    // dK, dV
        plans.emplace_back(fa1 ? p0 : params[2], fa1, D, true);    // dQ
        const Plan& pre = plans[0];
        const Plan& kv = plans[1];
        const Plan& dq = plans[2];
        const int64_t Trp = pre.Tr();
        total = BH * Trp;
        // One pass over the tile pairs can also build dQ when the dQ kernel's tiles are the
        // dK/dV kernel's (then both walk the same pairs) and a K/V head per thread keeps
        // the threads busy: K/V tiles j in increasing order on one thread give each dQ row
        // of the head's group its sum over j in the dQ kernel's order.
        const int64_t G = p0.heads / p0.heads_kv, BHkv = p0.batch * p0.heads_kv;
        // The split backward folds dQ per key chunk, which the fused pass (dQ summed in
        // place across K/V tiles) does not: it takes the two kernels' passes.
        const bool fused = kv.ctx.p.block_r == dq.ctx.p.block_r && kv.ctx.p.block_c == dq.ctx.p.block_c &&
                           BHkv >= threads && p0.split_size == 0;
        const int64_t Tc = kv.Tc(), Tr = dq.Tr();
        if (!fused)
            phases.push_back({BH * Trp, [&, Trp](int64_t k, float*) {
                                  isa->rowdot(pre.ctx, k / Trp, k % Trp);
                                  runner->done_one();
                              }});
        if (fused) {
            // Query head bkv / Hkv * H + (bkv % Hkv) * G + g of K/V head bkv. Only this item
            // reads those heads' D, so it computes them first: no phase of its own, whose
            // start and end would cost more than its work on two threads.
            phases.push_back({BHkv, [&, Tc, G, Trp](int64_t bkv, float* ws) {
                                  const AttentionParams& p = kv.ctx.p;
                                  const int64_t bh0 = (bkv / p.heads_kv) * p.heads + (bkv % p.heads_kv) * G;
                                  for (int64_t g = 0; g < G; ++g)
                                      for (int64_t i = 0; i < Trp; ++i) {
                                          isa->rowdot(pre.ctx, bh0 + g, i);
                                          runner->done_one();
                                      }
                                  for (int64_t g = 0; g < G; ++g) isa->zero_dq(kv.ctx, bh0 + g);
                                  for (int64_t j = 0; j < Tc && !runner->stopped(); ++j) {
                                      isa->backward_kv(kv.ctx, bkv, j, true, ws);
                                      runner->done_one();
                                  }
                                  for (int64_t g = 0; g < G; ++g) isa->finish_dq(kv.ctx, bh0 + g);
                              }});
            total += BHkv * Tc;
        } else {
            // K/V tiles from the first and Q tiles from the last: the longest first.
            phases.push_back({BHkv * Tc, [&, BHkv](int64_t k, float* ws) {
                                  isa->backward_kv(kv.ctx, k % BHkv, k / BHkv, false, ws);
                                  runner->done_one();
                              }});
            phases.push_back({BH * Tr, [&, Tr, BH](int64_t k, float* ws) {
                                  isa->backward_dq(dq.ctx, k % BH, Tr - 1 - k / BH, ws);
                                  runner->done_one();
                              }});
            total += BHkv * Tc + BH * Tr;
        }
    } else {
        return fail(PYFA_ERROR_INTERNAL, "cpu backend: no implementation of op %d with %zu kernels", op, count);
    }

    size_t ws = 0;
    for (const Plan& pl : plans) ws = std::max(ws, isa->workspace_floats(pl.ctx));
    Runner r(cfg, threads, total);
    runner = &r;
    return r.run(phases, ws);
}

// Host memory; kernels of its own, which take a whole op at once (it may fuse the op's
// kernels) and ask config->progress themselves.
class CpuBackend final : public Backend {
public:
    int id() const override { return PYFA_BACKEND_CPU; }
    const char* label() const override { return "the cpu backend"; }
    int auto_rank() const override { return 2; }
    pyfa_status profile(pyfa_device_profile* profile) const override {
        // The name says which instruction-set build a call would run now (PYFA_CPU_ISA).
        pyfa_status code = PYFA_OK;
        std::string why;
        const Isa* isa = chosen_isa(&code, &why);
        const std::string name = isa ? std::string("pyfa cpu ") + isa->name + " (tiles of the emulator's H200 profile)"
                                     : std::string("pyfa cpu none (PYFA_CPU_ISA cannot run here)");
        emulated_h200_profile(name.c_str(), profile);
        return PYFA_OK;
    }
    bool runs_table_kernels() const override { return false; }
    bool dense_only() const override { return true; }
    bool forwards_read_strided_kv() const override { return true; }
    bool runs_whole_op() const override { return true; }
    pyfa_status run_op(int op, const AttentionParams* params, size_t count, const pyfa_config& cfg) const override {
        return cpu_run(op, params, count, cfg);
    }
};

}  // namespace

PYFA_REGISTER_BACKEND(CpuBackend)

}  // namespace pyfa
