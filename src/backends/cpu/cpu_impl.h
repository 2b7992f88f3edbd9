// cpu_impl.h: the cpu backend's tile code, compiled once per instruction set. The file
// that includes it defines
//   PYFA_CPU_NS     a namespace of its own (so the builds never meet at link time)
//   PYFA_CPU_W      floats per vector (16: AVX-512, 8: AVX2 and the portable build)
//   PYFA_CPU_RI     vectors along the lanes' axis per register tile
//   PYFA_CPU_RJ     broadcast operands per register tile
//   PYFA_CPU_TABLE  the name of the pyfa_cpu::Isa it exports
// and may define
//   PYFA_CPU_IN_PLACE_D  the head dimension from which the forward's V_j and the
//                        backward's Q_i, dO_i are read in place rather than copied into
//                        padded buffers (default 256)
//   PYFA_CPU_DECODE_PREFETCH  1: a decode item reads only its first K/V tile ahead
//                        (touch_lines) and prefetches each next one under the current
//                        one's transposes (NextTile); 0 (default): on a dense cache it
//                        reads every tile ahead (the AVX2 and portable builds: with AVX2
//                        on Zen 4 the two measured alike); rows a stride apart are
//                        prefetched on every build (forward_group)
// and is compiled with that instruction set's flags (CMakeLists.txt).
//
// Every output element gets exactly the operations and order of docs/numerics.md. The
// vectors (GCC vector extensions) run across independent output elements only: rows of
// S in the forward, columns of S in the backward, or the head dimension x. Each lane does
// the scalar code's IEEE operations in the scalar code's order, so every build gives the
// same bits; no sum is ever split or reassociated, and exp and log below are
// pyfa_exp and pyfa_log (common/numerics.h) line for line.
//
// Nothing here has external linkage but the table: inline functions shared with other
// files would be compiled with this file's flags and could be picked by the linker for a
// build meant for a CPU without them.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/merge.h"
#include "common/numerics.h"
#include "common/params.h"
#include "common/score.h"
#include "backends/cpu/contract.h"
#include "backends/cpu/cpu_kernels.h"

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace pyfa_cpu {
namespace PYFA_CPU_NS {
namespace {

constexpr int W = PYFA_CPU_W;
constexpr int RI = PYFA_CPU_RI;
constexpr int RJ = PYFA_CPU_RJ;
#ifndef PYFA_CPU_IN_PLACE_D
#define PYFA_CPU_IN_PLACE_D 256
#endif
constexpr int64_t IN_PLACE_D = PYFA_CPU_IN_PLACE_D;
#ifndef PYFA_CPU_DECODE_PREFETCH
#define PYFA_CPU_DECODE_PREFETCH 0
#endif
constexpr bool DECODE_PREFETCH = PYFA_CPU_DECODE_PREFETCH;

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

// Broadcasts. Not `vf{} + a`: that is an IEEE addition (+0 + -0 = +0), not a copy.
inline vf splat(float a) {
    const vf v = {a};
    return __builtin_shuffle(v, vi{});
}
inline vi splati(int32_t a) {
    const vi v = {a};
    return __builtin_shuffle(v, vi{});
}
// Every buffer a vector is loaded from is 64-byte aligned with rows a multiple of W.
inline vf ld(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void st(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }
// A load from (a store to) the caller's tensors, which need not be aligned (as fast when
// they are).
inline vf ldu(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void stu(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vi iota() {
    vi v;
    for (int k = 0; k < W; ++k) v[k] = k;
    return v;
}

// madd's vector twin (contract.h): a * b + c with one rounding.
inline vf vmadd(vf a, vf b, vf c) {
#if PYFA_CPU_W == 16 && defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, c);
#elif PYFA_CPU_W == 8 && defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    vf r;
    for (int k = 0; k < W; ++k) r[k] = __builtin_fmaf(a[k], b[k], c[k]);
    return r;
#endif
}

// keep ? vmadd(a, b, c) : c, lane by lane (a selected product's step). With AVX-512 one
// merge-masked fused multiply-add instead of the sum and a blend after it.
inline vf vmadd_if(vi keep, vf a, vf b, vf c) {
#if PYFA_CPU_W == 16 && defined(__AVX512F__)
    const __m512i m = reinterpret_cast<__m512i>(keep);
    return _mm512_mask3_fmadd_ps(a, b, c, _mm512_test_epi32_mask(m, m));
#else
    const vf t = vmadd(a, b, c);
    return keep ? t : c;
#endif
}

inline float ssafe(float m) { return m == -INFINITY ? 0.0f : m; }  // safe_max
inline vf vmax(vf a, vf b) { return b > a ? b : a; }  // pyfa_max
inline vf vsafe(vf m) { return m == splat(-INFINITY) ? splat(0.0f) : m; }  // safe_max
// canon, lane by lane: any NaN becomes 0x7FC00000.
inline vf vcanon(vf v) {
    const vi nan = splati(0x7FC00000);
    return v == v ? v : reinterpret_cast<vf>(nan);
}

// True when every lane of the comparison mask m is set.
inline bool all_set(vi m) {
#if PYFA_CPU_W == 8 && defined(__AVX__)
    return _mm256_movemask_ps(reinterpret_cast<__m256>(m)) == 0xFF;
#elif PYFA_CPU_W == 16 && defined(__AVX512F__)
    return _mm512_cmpneq_epi32_mask(reinterpret_cast<__m512i>(m), _mm512_setzero_si512()) == 0xFFFF;
#else
    int32_t a = -1;
    for (int k = 0; k < W; ++k) a &= m[k];
    return a != 0;
#endif
}

// pyfa_exp's range reduction and polynomial, lane by lane: x = n ln2 + r; returns
// p = 1 + r + r^2 q(r) ~ e^r and n. Both paths of vexp share it.
inline vf vexp_reduced(vf x, vi& n) {
    vf t = x * PYFA_LOG2E;
    t = t + PYFA_ROUND_MAGIC;
    const vf nf = t - PYFA_ROUND_MAGIC;
    n = reinterpret_cast<vi>(t) - static_cast<int32_t>(PYFA_ROUND_MAGIC_BITS);
    vf r = x - nf * PYFA_LN2_HI;
    r = r - nf * PYFA_LN2_LO;
    vf q = splat(PYFA_EXP_C6);
    q = q * r + PYFA_EXP_C5;
    q = q * r + PYFA_EXP_C4;
    q = q * r + PYFA_EXP_C3;
    q = q * r + PYFA_EXP_C2;
    const vf r2 = r * r;
    q = r2 * q;
    q = r + q;
    return q + 0x1p+0f;
}

// pyfa_exp, lane by lane. Two shortcuts that change no result:
// - When every lane lies in [EXP_FAST_LO, EXP_FAST_HI] (the usual case in a softmax), the
//   clamps and the final selects are identities, n lies in [-124, 127] and p in
//   [0.70, 1.42], so p * 2^n1 * 2^n2 (two exact scalings) is the normal number whose bits
//   are p's with n added to the exponent field: one integer addition instead of the two
//   factors. Everything before that is pyfa_exp's operations on the same values.
// - Otherwise a lane below X_LO (or NaN) computes with the stand-in 0 rather than X_LO.
//   Its result is replaced by the final selects either way, and X_LO's would pass through
//   subnormal numbers, which cost a microcode assist per operation on many CPUs; every
//   masked score (-inf) is such a lane.
constexpr float EXP_FAST_LO = -86.0f, EXP_FAST_HI = 88.0f;
inline vf vexp(vf x) {
    vi n;
    if (all_set((x >= splat(EXP_FAST_LO)) & (x <= splat(EXP_FAST_HI)))) {
        const vf p = vexp_reduced(x, n);
        return reinterpret_cast<vf>(reinterpret_cast<vi>(p) + (n << 23));
    }
    vf xc = x >= splat(PYFA_EXP_X_LO) ? x : splat(0.0f);
    xc = xc > splat(PYFA_EXP_X_HI) ? splat(PYFA_EXP_X_HI) : xc;
    const vf p = vexp_reduced(xc, n);
    const vi n1 = ((n + 150) >> 1) - 75;
    const vi n2 = n - n1;
    const vf s1 = reinterpret_cast<vf>((n1 + 127) << 23);
    const vf s2 = reinterpret_cast<vf>((n2 + 127) << 23);
    vf y = p * s1;
    y = y * s2;
    y = x > splat(PYFA_EXP_X_HI) ? splat(INFINITY) : y;
    y = x < splat(PYFA_EXP_X_LO) ? splat(0.0f) : y;
    y = x != x ? x : y;
    return y;
}

// pyfa_log, lane by lane.
inline vf vlog(vf x) {
    const vf inf = splat(INFINITY), one = splat(0x1p+0f);
    vf xs = x > splat(0.0f) ? x : one;
    xs = xs < inf ? xs : one;
    const vi sub = xs < splat(0x1p-126f);
    xs = sub ? xs * 0x1p+23f : xs;
    const vi ebias = sub ? splati(-23 - 127) : splati(-127);
    const vi ix = reinterpret_cast<vi>(xs);
    vi e = (ix >> 23) + ebias;  // xs > 0: the sign bit is clear, so >> is the unsigned shift
    vf m = reinterpret_cast<vf>((ix & 0x007FFFFF) | 0x3F800000);
    const vi big = m > splat(PYFA_LOG_SQRT2);
    m = big ? m * 0x1p-1f : m;
    e = big ? e + 1 : e;
    const vf f = m - 0x1p+0f;
    const vf s = f / (f + 0x1p+1f);
    const vf z = s * s;
    vf R = splat(PYFA_LOG_D3);
    R = R * z + PYFA_LOG_D2;
    R = R * z + PYFA_LOG_D1;
    R = R * z;
    vf lm = f - R;
    lm = s * lm;
    lm = f - lm;
    const vf ef = __builtin_convertvector(e, vf);
    vf y = ef * PYFA_LN2_LO;
    y = y + lm;
    y = ef * PYFA_LN2_HI + y;
    y = x == inf ? inf : y;
    y = x == splat(0.0f) ? splat(-INFINITY) : y;
    y = x < splat(0.0f) ? splat(__builtin_nanf("")) : y;
    y = x != x ? x : y;
    return y;
}

inline int64_t round_up(int64_t a, int64_t w) { return (a + w - 1) / w * w; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int32_t clamp32(int64_t v, int64_t lo, int64_t hi) {
    return static_cast<int32_t>(v < lo ? lo : v > hi ? hi : v);
}

// ---------------------------------------------------------------------------------------
// The one product loop. For the lanes i = i0 .. (a multiple of W) and the operands j:
//     acc[j][i] = sum_k A[k * lda + i] * B[j * sj + k * sk],   k = 0 .. K-1 in order, from +0
// then epi(j, i, acc) stores or combines it. A holds the vectors (lanes contiguous), B the
// scalars broadcast to every lane. A register tile of NI vectors by NJ operands keeps
// NI * NJ independent sums in flight, each a plain in-order chain.
// ---------------------------------------------------------------------------------------
// C, when given, holds sums stopped part way (C[j * ldc + i]): they go on from there, so
// the chain of fused multiply-adds of each sum is the same as in one call. Always inlined:
// left out of line (GCC's choice once it has more callers) it ran slower at d = 64.
//
// Sel decides which steps take part: NoSel, every step (a tile the mask leaves whole), or a
// selection whose keep(k, i, j) gives the lanes i .. i+W-1 of operand j whose step k is
// kept. A step left out leaves its sum as it is: a hidden score takes no part in a product
// (common/score.h), whatever the other operand holds.
// The epilogues and helpers each product loop calls per vector, always inlined: left out
// of line (GCC's choice in backward_kv), every call spilled the register tile's sums.
#define PYFA_CPU_EPI __attribute__((always_inline))

struct NoSel {
    static constexpr bool on = false;
    vi keep(int64_t, int64_t, int64_t) const { return vi{}; }
};

// The steps of a register tile's lanes i0 .. i0+ni-1 under a selection: outside [begin,
// end) every lane leaves its sum as it is (no step is taken); in [all_begin, all_end)
// every lane takes it (no select). begin <= all_begin <= all_end <= end.
struct StepSpan {
    int64_t begin, all_begin, all_end, end;
    static StepSpan of(int64_t K, int64_t some_lo, int64_t some_hi, int64_t all_lo, int64_t all_hi) {
        const int64_t b = some_lo > 0 ? some_lo : 0, e = some_hi + 1 < K ? some_hi + 1 : K;
        if (e <= b) return StepSpan{0, 0, 0, 0};
        int64_t ab = all_lo > b ? all_lo : b, ae = all_hi + 1 < e ? all_hi + 1 : e;
        if (ae <= ab) ab = ae = b;
        return StepSpan{b, ab, ae, e};
    }
    // Steps k that are keys, taken by rows r_min .. r_max of band b (lo <= k - r <= hi):
    // some row takes k in [r_min + lo, r_max + hi], every row in [r_max + lo, r_min + hi].
    static StepSpan keys_of_rows(int64_t K, const Band& b, int64_t r_min, int64_t r_max) {
        return of(K, r_min + b.lo, r_max + b.hi, r_max + b.lo, r_min + b.hi);
    }
};

// A register tile's hook, called before each step k (NoHook: none).
struct NoHook {
    void operator()(int64_t) const {}
};
template <int NI, int NJ, class Epi, class Sel, class Hook = NoHook>
__attribute__((always_inline)) inline void micro(const float* A, int64_t lda, const float* B,
                                                 int64_t sj, int64_t sk, int64_t K, int64_t i0,
                                                 int64_t j0, Epi& epi, const Sel& sel,
                                                 const float* C = nullptr, int64_t ldc = 0, Hook hook = Hook{}) {
    vf acc[NJ][NI];
    for (int jj = 0; jj < NJ; ++jj)
        for (int ii = 0; ii < NI; ++ii)
            acc[jj][ii] = C ? ld(C + (j0 + jj) * ldc + i0 + ii * W) : vf{};
    const float* a = A + i0;
    const float* b = B + j0 * sj;
    auto steps = [&](int64_t k0, int64_t k1, auto selecting) PYFA_CPU_EPI {
#pragma GCC unroll 4
        for (int64_t k = k0; k < k1; ++k) {
            hook(k);
            vf av[NI];
            for (int ii = 0; ii < NI; ++ii) av[ii] = ldu(a + k * lda + ii * W);
            for (int jj = 0; jj < NJ; ++jj) {
                const vf bv = splat(b[jj * sj + k * sk]);
                for (int ii = 0; ii < NI; ++ii) {
                    if constexpr (decltype(selecting)::value) {
                        acc[jj][ii] = vmadd_if(sel.keep(k, i0 + ii * W, j0 + jj), av[ii], bv, acc[jj][ii]);
                    } else {
                        acc[jj][ii] = vmadd(av[ii], bv, acc[jj][ii]);
                    }
                }
            }
        }
    };
    if constexpr (Sel::on) {
        // A step no lane takes changes no sum, and one every lane takes needs no select.
        const StepSpan sp = sel.span(i0, NI * W, j0, NJ, K);
        steps(sp.begin, sp.all_begin, std::true_type{});
        steps(sp.all_begin, sp.all_end, std::false_type{});
        steps(sp.all_end, sp.end, std::true_type{});
    } else {
        steps(0, K, std::false_type{});
    }
    for (int jj = 0; jj < NJ; ++jj)
        for (int ii = 0; ii < NI; ++ii) epi(j0 + jj, i0 + ii * W, acc[jj][ii]);
}

template <int NI, int NJ, class Epi, class Sel>
inline void micro_tail(int64_t rem, const float* A, int64_t lda, const float* B, int64_t sj,
                       int64_t sk, int64_t K, int64_t i0, int64_t j0, Epi& epi, const Sel& sel,
                       const float* C = nullptr, int64_t ldc = 0) {
    if constexpr (NJ > 0) {
        if (rem == NJ) micro<NI, NJ>(A, lda, B, sj, sk, K, i0, j0, epi, sel, C, ldc);
        else micro_tail<NI, NJ - 1>(rem, A, lda, B, sj, sk, K, i0, j0, epi, sel, C, ldc);
    }
}

template <int NI, class Epi, class Sel>
inline void gemm_cols(const float* A, int64_t lda, const float* B, int64_t sj, int64_t sk,
                      int64_t K, int64_t nj, int64_t i0, Epi& epi, const Sel& sel) {
    int64_t j = 0;
    for (; j + RJ <= nj; j += RJ) micro<NI, RJ>(A, lda, B, sj, sk, K, i0, j, epi, sel);
    micro_tail<NI, RJ - 1>(nj - j, A, lda, B, sj, sk, K, i0, j, epi, sel);
}

// The lanes 0 .. ni-1 (a multiple of W) in blocks of RI vectors (at most MAXNI), then of 2
// (where RI is larger: a 32-row tile at d = 256 keeps two vectors a step), then of 1:
// f(std::integral_constant<int, NI>{}, i0) for each block.
template <int MAXNI = RI, class F>
inline void lane_blocks(int64_t ni, F&& f) {
    constexpr int NB = MAXNI < RI ? MAXNI : RI;
    int64_t i = 0;
    for (; i + NB * W <= ni; i += NB * W) f(std::integral_constant<int, NB>{}, i);
    if constexpr (NB > 2)
        for (; i + 2 * W <= ni; i += 2 * W) f(std::integral_constant<int, 2>{}, i);
    for (; i < ni; i += W) f(std::integral_constant<int, 1>{}, i);
}

// A selected product (a tile the mask cuts) takes its lanes at most SEL_NI vectors at a
// time: the fewer lanes a register tile holds, the more of its steps no lane takes
// (skipped) or every lane takes (no select; StepSpan). At 64 rows a causal diagonal tile
// in blocks of 4 vectors had every step but one to select; in blocks of 2, a quarter of
// the steps are skipped and a quarter need no select.
constexpr int SEL_NI = 2;
template <class Sel>
constexpr int lanes_per_block() { return Sel::on ? SEL_NI : RI; }

// ni: lanes, a multiple of W; nj: operands.
template <class Epi, class Sel = NoSel>
inline void gemm(const float* A, int64_t lda, int64_t ni, const float* B, int64_t sj, int64_t sk,
                 int64_t K, int64_t nj, Epi epi, const Sel& sel = Sel{}) {
    lane_blocks<lanes_per_block<Sel>()>(ni, [&](auto NI, int64_t i) {
        gemm_cols<decltype(NI)::value>(A, lda, B, sj, sk, K, nj, i, epi, sel);
    });
}

// gemm with the register tile turned on its side: up to WI vectors of lanes by NJW operands,
// for an A whose rows are streamed from memory once (the decode step's V_j): each step k
// then reads whole lines of a row in order, where gemm's RI-vector blocks walk the rows
// once per block. The same sums in the same order; only which independent sums share a
// pass differs.
constexpr int WI = W >= 16 ? 8 : 4;
constexpr int NJW = 2;
template <class Epi, class Sel = NoSel, class Hook = NoHook>
inline void gemm_wide(const float* A, int64_t lda, int64_t ni, const float* B, int64_t sj, int64_t sk,
                      int64_t K, int64_t nj, Epi epi, const Sel& sel = Sel{}, Hook hook = Hook{}) {
    int64_t i = 0;
    for (; i + WI * W <= ni; i += WI * W) {
        int64_t j = 0;
        for (; j + NJW <= nj; j += NJW) micro<WI, NJW>(A, lda, B, sj, sk, K, i, j, epi, sel, nullptr, 0, hook);
        micro_tail<WI, NJW - 1>(nj - j, A, lda, B, sj, sk, K, i, j, epi, sel);
    }
    for (; i < ni; i += W) gemm_cols<1>(A, lda, B, sj, sk, K, nj, i, epi, sel);
}

// How many times gemm_wide calls its hook: once per step of each whole register tile.
inline int64_t gemm_wide_hooked_steps(int64_t ni, int64_t K, int64_t nj) {
    return ni / (WI * W) * (nj / NJW) * K;
}

// C[j * ldc + i] = sum_k A[k * lda + i] * B[j * sj + k * sk], as gemm stores it, but in
// blocks of KB along k: each sum is stopped in C after a block and goes on from there with
// the next, so its chain is unchanged, while a block of A and of B stays in L1 for every
// register tile (at d = 128 the whole Q_i^T and K_j are 32 KiB each, L1's size here).
constexpr int64_t KB = 64;
inline void gemm_store_kb(const float* A, int64_t lda, int64_t ni, const float* B, int64_t sj,
                          int64_t sk, int64_t K, int64_t nj, float* C, int64_t ldc) {
    auto epi = [&](int64_t j, int64_t i, vf acc) PYFA_CPU_EPI { st(C + j * ldc + i, acc); };
    const NoSel all;
    if (K <= KB) return gemm(A, lda, ni, B, sj, sk, K, nj, epi);
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t kn = min64(KB, K - k0);
        const float* Ak = A + k0 * lda;
        const float* Bk = B + k0 * sk;
        const float* Ck = k0 == 0 ? nullptr : C;
        lane_blocks(ni, [&](auto NI, int64_t i) {
            int64_t j = 0;
            for (; j + RJ <= nj; j += RJ) micro<decltype(NI)::value, RJ>(Ak, lda, Bk, sj, sk, kn, i, j, epi, all, Ck, ldc);
            micro_tail<decltype(NI)::value, RJ - 1>(nj - j, Ak, lda, Bk, sj, sk, kn, i, j, epi, all, Ck, ldc);
        });
    }
}

// gemm for the forward's P~_ij V_j when V_j is wider than KB (too large for L1 beside the
// rest): the operands outside and the lanes inside, so a group of RJ columns of V_j stays
// in L1 while every lane block passes and P~_ij is re-read from L1 instead of V_j from L2.
// The same sums in the same order as gemm; only the order in which independent sums are
// computed differs. A narrower V_j fits L1, and gemm's order re-reads less. (The
// backward's dV, dK products measured no faster this way, so they keep gemm.)
template <class Epi, class Sel = NoSel>
inline void gemm_jo(const float* A, int64_t lda, int64_t ni, const float* B, int64_t sj, int64_t sk,
                    int64_t K, int64_t nj, Epi epi, const Sel& sel = Sel{}) {
    if (nj <= KB) return gemm(A, lda, ni, B, sj, sk, K, nj, epi, sel);
    int64_t j = 0;
    for (; j + RJ <= nj; j += RJ)
        lane_blocks<lanes_per_block<Sel>()>(ni, [&](auto NI, int64_t i) {
            micro<decltype(NI)::value, RJ>(A, lda, B, sj, sk, K, i, j, epi, sel);
        });
    if (j < nj)
        lane_blocks<lanes_per_block<Sel>()>(ni, [&](auto NI, int64_t i) {
            micro_tail<decltype(NI)::value, RJ - 1>(nj - j, A, lda, B, sj, sk, K, i, j, epi, sel);
        });
}

// The mask seen from one tile, in vector form: the tile's Band (common/mask.h) with its
// edges clamped to the lanes' range of c - r (|c - r| < 2^31 there), tested by the band's
// own visible_diff. rows_lane: the lanes run along rows (the forward), else along keys.
struct VBand {
    vi lo, hi;
    Band band;
    VBand(const Band& b, int64_t span) : band(b) {
        lo = splati(clamp32(b.lo, -span, span));
        hi = splati(clamp32(b.hi, -span, span));
    }
    // Lanes r .. r+W-1 against key c (the forward's lanes).
    vi rows_see(vi r, int64_t c) const { return Band::visible_diff<vi, vi>(splati(static_cast<int32_t>(c)) - r, lo, hi); }
    // Keys c .. c+W-1 against row r (the backward's lanes).
    vi keys_seen(vi c, int64_t r) const { return Band::visible_diff<vi, vi>(c - splati(static_cast<int32_t>(r)), lo, hi); }
};

// Selections of the products (micro's Sel). Forward P V: lanes are rows, steps k keys.
struct SelRowsKeys {
    static constexpr bool on = true;
    const VBand* vb;
    vi lane;
    vi keep(int64_t k, int64_t i, int64_t) const { return vb->rows_see(lane + static_cast<int32_t>(i), k); }
    // The lanes' rows i0 .. i0+ni-1.
    StepSpan span(int64_t i0, int64_t ni, int64_t, int64_t, int64_t K) const {
        return StepSpan::keys_of_rows(K, vb->band, i0, i0 + ni - 1);
    }
};
// Backward P^T dO and dS^T Q: lanes are keys, steps k rows.
struct SelKeysRows {
    static constexpr bool on = true;
    const VBand* vb;
    vi lane;
    vi keep(int64_t k, int64_t i, int64_t) const { return vb->keys_seen(lane + static_cast<int32_t>(i), k); }
    // Keys i0 .. i0+ni-1: rows lo <= c - r <= hi for some key, for every key.
    StepSpan span(int64_t i0, int64_t ni, int64_t, int64_t, int64_t K) const {
        const Band& b = vb->band;
        return StepSpan::of(K, i0 - b.hi, i0 + ni - 1 - b.lo, i0 + ni - 1 - b.hi, i0 - b.lo);
    }
};
// Backward dS K: lanes are the head dimension, steps k keys, operands j rows.
struct SelOpsKeys {
    static constexpr bool on = true;
    const Band* band;
    vi keep(int64_t k, int64_t, int64_t j) const { return splati(band->visible(j, k) ? -1 : 0); }
    // The operands' rows j0 .. j0+nj-1.
    StepSpan span(int64_t, int64_t, int64_t j0, int64_t nj, int64_t K) const {
        return StepSpan::keys_of_rows(K, *band, j0, j0 + nj - 1);
    }
};

// One stage of a W x W transpose: swaps bit H of the row index with bit H of the lane.
template <int H>
__attribute__((always_inline)) inline void transpose_stage(vf* rows) {
    vi lo, hi;
    for (int k = 0; k < W; ++k) {
        lo[k] = (k & H) ? W + k - H : k;
        hi[k] = (k & H) ? W + k : k + H;
    }
    for (int i = 0; i < W; ++i)
        if (!(i & H)) {
            const vf a = rows[i], b = rows[i + H];
            rows[i] = __builtin_shuffle(a, b, lo);
            rows[i + H] = __builtin_shuffle(a, b, hi);
        }
}

// Inlined where it is used, so that the rows stay in registers: GCC had made it a call,
// which passes them through memory (18% of a decoding step's time).
__attribute__((always_inline)) inline void transpose(vf* rows) {
    transpose_stage<1>(rows);
    transpose_stage<2>(rows);
    transpose_stage<4>(rows);
    if constexpr (W >= 16) transpose_stage<8>(rows);
}

// The lines of the next K_j and V_j of a decode item (keys n0 .. n0 + rows - 1 of the
// heads' rows at K and V, row strides ldk and ldv, paged or not: params.h kv_row;
// row_lines lines of each row from its first), prefetched into L2 a few at a time (issue)
// while the current tile is computed. The step is bound by reading K and V; reading each
// tile first (touch_lines) and then computing on it left the core idle on memory half the
// time, and the prefetches keep the reads in flight under the transposes instead. Into
// L2, not L1: the current tile's V_j and K_j^T use L1.
struct NextTile {
    const AttentionParams& p;
    const float *K, *V;
    int64_t ldk, ldv, n0, rows, row_lines;
    int64_t per_block = 0;                   // issued per W x W block of a transpose
    int64_t t = rows ? 0 : 2, r = 0, e = 0;  // the next line: of K (t = 0) or V, row r, line e
    const float* row = rows ? K + p.kv_row(n0) * ldk : nullptr;

    int64_t lines() const { return 2 * rows * row_lines; }
    // The position is walked in locals: kept in the struct (reached through a pointer
    // from the transposes), each prefetch cost a load and a store of it. Inlined: called
    // from P~ V's steps, a call would spill the register tile's sums around it.
    __attribute__((always_inline)) void issue(int64_t n) {
        constexpr int64_t line = 64 / sizeof(float);
        int64_t t_ = t, r_ = r, e_ = e;
        const float* row_ = row;
        for (; n > 0 && t_ < 2; --n) {
            __builtin_prefetch(row_ + e_ * line, 0, 2);
            if (++e_ < row_lines) continue;
            e_ = 0;
            if (++r_ == rows) r_ = 0, ++t_;
            if (t_ < 2) row_ = t_ ? V + p.kv_row(n0 + r_) * ldv : K + p.kv_row(n0 + r_) * ldk;
        }
        t = t_, r = r_, e = e_, row = row_;
    }
};

// KT[x * Cp + c] = K[c * ld + x] for c < bc, 0 for bc <= c < Cp (K_j or Q_i transposed,
// O_i transposed back), W x W blocks through registers, the edges element by element: an
// element at a time, the stores W * 4 bytes apart missed L1 at d = 256 and took half of
// the forward's own time there. D: d as a constant where it is one of the usual head dims
// and the rows are dense (ld = d; 0 otherwise): then the W row offsets of a block are
// immediates instead of W values that outgrow the registers and were spilled.
template <int64_t D>
inline void transpose_tile_d(const float* K, int64_t bc, int64_t dd, int64_t ldd, float* KT, int64_t Cp,
                             NextTile* pf) {
    const int64_t d = D ? D : dd, ld = D ? D : ldd;
    const int64_t cw = bc / W * W, xw = d / W * W;
    for (int64_t c0 = 0; c0 < cw; c0 += W) {
        const float* Kc = K + c0 * ld;  // (W, d), row stride ld
        for (int64_t x0 = 0; x0 < xw; x0 += W) {
            if (pf) pf->issue(pf->per_block);
            vf rows[W];
            for (int k = 0; k < W; ++k) rows[k] = ldu(Kc + k * ld + x0);
            transpose(rows);
            for (int k = 0; k < W; ++k) stu(KT + (x0 + k) * Cp + c0, rows[k]);
        }
    }
    for (int64_t x = 0; x < d; ++x) {
        for (int64_t c = x < xw ? cw : 0; c < Cp; ++c) KT[x * Cp + c] = c < bc ? K[c * ld + x] : 0.0f;
    }
}

// pf (or null): prefetches issued between the blocks.
inline void transpose_tile(const float* K, int64_t bc, int64_t d, int64_t ld, float* KT, int64_t Cp,
                           NextTile* pf = nullptr) {
    if (d == 64 && ld == 64) return transpose_tile_d<64>(K, bc, d, ld, KT, Cp, pf);
    if (d == 128 && ld == 128) return transpose_tile_d<128>(K, bc, d, ld, KT, Cp, pf);
    transpose_tile_d<0>(K, bc, d, ld, KT, Cp, pf);
}

// A decode group's scores S[n * Cp + c] = sum_x Q[n * ldq + x] K[c * ld + x] (the R rows of
// Q at Q, ldq apart; K_j's bc rows at K, ld apart; lanes c >= bc get +0), with each W x W
// block of K_j transposed in registers and consumed there: the same chains as
// transpose_tile + gemm_store_kb (x = 0 .. d-1 in order from +0, one fma per step), without
// storing K_j^T (as large as L1 at d = 128) and reading it back. R sums stay in registers
// beside the W rows of a block, so only R <= RMAX, d a multiple of W; false otherwise.
// D: d as a constant (0: dd); LD: the row stride as one (0: ldd, a (B, N, Hkv, d) cache's).
template <int R, int64_t D, int64_t LD = D>
inline void scores_in_registers_d(const float* K, int64_t bc, int64_t dd, int64_t ldd, const float* Q,
                                  int64_t ldq, float* S, int64_t Cp, NextTile* pf) {
    const int64_t d = D ? D : dd, ld = LD ? LD : ldd;
    for (int64_t c0 = 0; c0 < Cp; c0 += W) {
        const int64_t rows_here = min64(W, bc - c0);
        const float* Kc = K + c0 * ld;  // (rows_here, d), row stride ld
        vf acc[R];
        for (int n = 0; n < R; ++n) acc[n] = vf{};
        for (int64_t x0 = 0; x0 < d; x0 += W) {
            if (pf) pf->issue(pf->per_block);
            vf rows[W];
            for (int k = 0; k < W; ++k) rows[k] = rows_here == W || k < rows_here ? ldu(Kc + k * ld + x0) : vf{};
            transpose(rows);  // rows[k]: K[c0 .. c0+W-1, x0 + k]
            // Unrolled, so that rows[k] is a register: rolled, GCC kept the rows on the stack.
#pragma GCC unroll 16
            for (int k = 0; k < W; ++k)
                for (int n = 0; n < R; ++n) acc[n] = vmadd(rows[k], splat(Q[n * ldq + x0 + k]), acc[n]);
        }
        for (int n = 0; n < R; ++n) st(S + n * Cp + c0, acc[n]);
    }
}

template <int R>
inline void scores_in_registers_r(const float* K, int64_t bc, int64_t d, int64_t ld, const float* Q,
                                  int64_t ldq, float* S, int64_t Cp, NextTile* pf) {
    if (d == 64 && ld == 64) return scores_in_registers_d<R, 64>(K, bc, d, ld, Q, ldq, S, Cp, pf);
    if (d == 128 && ld == 128) return scores_in_registers_d<R, 128>(K, bc, d, ld, Q, ldq, S, Cp, pf);
    if (d == 128) return scores_in_registers_d<R, 128, 0>(K, bc, d, ld, Q, ldq, S, Cp, pf);
    scores_in_registers_d<R, 0>(K, bc, d, ld, Q, ldq, S, Cp, pf);
}

// 32 vector registers hold a block's 16 rows and 8 sums; 16 hold 8 rows and 4.
constexpr int RMAX = W >= 16 ? 8 : 4;
template <int R = 1>
inline bool scores_in_registers(const float* K, int64_t bc, int64_t d, int64_t ld, const float* Q,
                                int64_t ldq, int64_t rows, float* S, int64_t Cp, NextTile* pf) {
    if (d % W != 0) return false;
    if (rows == R) {
        scores_in_registers_r<R>(K, bc, d, ld, Q, ldq, S, Cp, pf);
        return true;
    }
    if constexpr (R < RMAX) return scores_in_registers<R + 1>(K, bc, d, ld, Q, ldq, rows, S, Cp, pf);
    return false;
}

// ---------------------------------------------------------------------------------------
// Forward (FA1 and FA2), one Q tile: lanes are the tile's rows, so the row max, the row
// sum and every per-row factor are element-wise across the Bc scores of a column.
// ---------------------------------------------------------------------------------------
// Row stride of the copies of V_j (forward), Q_i, dO_i and K_j (backward): the products
// that walk them down a column (P~ V, dV, dK, dQ) would find rows d = 64 or 128 floats
// apart in a few L1 sets only and evict each other; W floats more spread them over all
// sets. (The forward's S = Q K^T reads K_j in place: a padded copy measured no faster.)
inline int64_t pad_stride(int64_t d) { return round_up(d, W) + W; }

struct FwdBufs {
    int64_t Rp, Ep;
    float *QT, *S, *OT, *m, *l, *a, *b, *g, *Vj, *Kp;
};

inline FwdBufs fwd_bufs(const AttentionParams& p, float* ws) {
    FwdBufs f;
    f.Rp = round_up(p.block_r, W);
    const int64_t d = p.head_dim;
    f.QT = ws;                     // (d, Rp)   Q_i transposed, rows past br zero
    f.S = f.QT + d * f.Rp;         // (Bc, Rp)  S_ij transposed, then P~_ij
    f.OT = f.S + p.block_c * f.Rp; // (d, Rp)   O_i transposed
    f.m = f.OT + d * f.Rp;         // (Rp)
    f.l = f.m + f.Rp;              // (Rp)
    f.a = f.l + f.Rp;              // (Rp)      FA2: alpha; FA1: o_scale; at the end LSE
    f.b = f.a + f.Rp;              // (Rp)      FA1: beta
    f.g = f.b + f.Rp;              // (Rp)      lanes of rows that see a key of a cut tile (vi bits)
    f.Ep = pad_stride(d);
    f.Vj = f.g + f.Rp;             // (Bc, Ep)  V_j, rows padded to Ep
    f.Kp = f.Vj + p.block_c * f.Ep; // (Bc, d)   paged K/V: K_j's rows gathered
    return f;
}

inline size_t fwd_floats(const AttentionParams& p) {
    const int64_t Rp = round_up(p.block_r, W);
    return static_cast<size_t>(2 * p.head_dim * Rp + p.block_c * Rp + 5 * Rp +
                               p.block_c * pad_stride(p.head_dim) + p.block_c * p.head_dim);
}

// Reads one float of every 64-byte line of the rows x[r * ld .. r * ld + d), r < rows, in
// address order; sink keeps the reads (its first element is overwritten later). One chain
// of adds, so a line per add: from memory that pace measured faster than four chains'
// (Zen 4, the avx2 build's dense decoding step, which reads every tile so: 6.2 against 9.0
// ms on one thread at N = 8192), the faster reads crowding out the hardware prefetchers.
inline void touch_lines(const float* x, int64_t rows, int64_t d, int64_t ld, float* sink) {
    constexpr int64_t line = 64 / sizeof(float);
    float t = 0.0f;
    if (ld == d) {
        for (int64_t e = 0; e < rows * d; e += line) t += x[e];
    } else {
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t e = 0; e < d; e += line) t += x[r * ld + e];
    }
    sink[0] = t;
}

// A K/V head's rows as the forwards read them: K_j, V_j of keys n0 .. n0 + bc - 1 of
// sequence s. X: the head's row 0 in k or v (row stride ld). Unpaged, the rows are
// evenly spaced and read where they lie; paged (params.h kv_row), row(n) finds each,
// and tile() reads a tile in place where it lies in one page (pages of Bc keys or more,
// flash-attn's 256), else gathers it into a dense (bc, d) copy for the products that take
// one stride.
struct KvRows {
    const AttentionParams& p;
    const float* X;
    int64_t ld;
    const float* row(int64_t n) const { return X + p.kv_row(n) * ld; }
    // touch_lines of rows n0 .. n0 + bc - 1, `width` floats of each from the head's.
    void touch(int64_t n0, int64_t bc, int64_t width, float* sink) const {
        if (!p.block_table) return touch_lines(X + n0 * ld, bc, width, ld, sink);
        for (int64_t c = 0; c < bc; ++c) touch_lines(row(n0 + c), 1, width, width, sink);
    }
    // Whether keys n0 .. n0 + bc - 1 lie evenly spaced, ld apart: unpaged, or in one page.
    bool even(int64_t n0, int64_t bc) const {
        return !p.block_table || n0 / p.page_size == (n0 + bc - 1) / p.page_size;
    }
    // The tile's rows (K_j's or V_j's) at (return value, return value + *stride, ...).
    const float* tile(int64_t n0, int64_t bc, float* dense, int64_t* stride) const {
        const int64_t d = p.head_dim;
        const bool in_place = even(n0, bc);
        *stride = in_place ? ld : d;
        if (in_place) return row(n0);
        for (int64_t c = 0; c < bc; ++c) std::memcpy(dense + c * d, row(n0 + c), sizeof(float) * static_cast<size_t>(d));
        return dense;
    }
};
inline KvRows k_rows(const AttentionParams& p, const Sequence& s, int64_t hk) {
    return KvRows{p, p.k + p.k_strides.at(s.batch, hk, 0), p.k_strides.row};
}
inline KvRows v_rows(const AttentionParams& p, const Sequence& s, int64_t hk) {
    return KvRows{p, p.v + p.v_strides.at(s.batch, hk, 0), p.v_strides.row};
}

// The K/V head (b * Hkv + hk) that query head bh = b * H + h reads: hk = h / (H / Hkv).
inline int64_t kv_head(const AttentionParams& p, int64_t bh) {
    return (bh / p.heads) * p.heads_kv + (bh % p.heads) / (p.heads / p.heads_kv);
}

// Where query head bh = b * H + h finds its rows in this backend's tensors, which are
// dense (the dispatcher gathers strided ones): its sequence b (common/params.h), the
// element of its row 0 in q, o, dO, dQ (row stride d) and in lse, m, l, D.
struct QHead {
    Sequence s;
    int64_t b, h;
    int64_t rows;
    int64_t stat;
};

inline QHead q_head(const AttentionParams& p, int64_t bh) {
    const int64_t b = bh / p.heads, h = bh % p.heads;
    const Sequence s = p.sequence(b);
    return QHead{s, b, h, p.q_strides.at(s.batch, h, s.q0), p.stat_at(s, h)};
}

// The sequence of K/V head bkv = b * Hkv + hk, and the element of its key 0 in k, v, dK, dV.
inline Sequence kv_sequence(const AttentionParams& p, int64_t bkv) { return p.sequence(bkv / p.heads_kv); }
inline int64_t kv_rows(const AttentionParams& p, int64_t bkv) {
    const Sequence s = kv_sequence(p, bkv);
    return p.k_strides.at(s.batch, bkv % p.heads_kv, s.k0);
}

void forward(const Ctx& ctx, int64_t bh, int64_t i, float* ws) {
    const AttentionParams& p = ctx.p;
    const QHead qh = q_head(p, bh);
    const int64_t d = p.head_dim, Nq = qh.s.Nq, Nk = qh.s.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t row0 = i * Br, br = min64(Br, Nq - row0);
    if (br <= 0) return;  // past its sequence's rows
    const FwdBufs f = fwd_bufs(p, ws);
    const int64_t Rp = f.Rp;
    const float* Q = p.q + qh.rows + row0 * d;  // (br, d)
    const vf scale = splat(p.scale), ninf = splat(-INFINITY), zero = splat(0.0f);
    const vi lane = iota();
    const bool plain = score_mod_is_none(p);

    transpose_tile(Q, br, d, d, f.QT, Rp);
    for (int64_t e = 0; e < d * Rp; ++e) f.OT[e] = 0.0f;
    for (int64_t r = 0; r < Rp; ++r) {
        f.m[r] = -INFINITY;
        f.l[r] = 0.0f;
    }

    // K and V as the caller laid them out (forwards_read_strided_kv), paged or not.
    const int64_t hk = kv_head(p, bh) % p.heads_kv;
    const KvRows Kh = k_rows(p, qh.s, hk), Vh = v_rows(p, qh.s, hk);
    const TileRange visit = ctx.kv_tiles(qh.b, i);
    for (int64_t j = visit.begin; j < visit.end; ++j) {
        const int64_t col0 = j * Bc, bc = min64(Bc, Nk - col0);
        int64_t ldk = 0;
        const float* K = Kh.tile(qh.s.k0 + col0, bc, f.Kp, &ldk);  // (bc, d), row stride ldk
        // S^T[c][r] = sum_x Q[r,x] K[c,x].
        gemm_store_kb(f.QT, Rp, Rp, K, ldk, 1, d, bc, f.S, Rp);
        // The score pipeline (common/score.h) on S^T, lanes along rows. In a tile the mask
        // cuts, a row that sees none of its keys takes no step (g), and hidden scores are
        // left out of P V; a whole tile keeps the plain loops.
        const Band band = qh.s.mask.band(row0, col0);
        const bool cut = band.cuts(br, bc);
        const VBand vb(band, Rp + Bc + 1);

        for (int64_t iv = 0; iv < Rp; iv += W) {
            const vi rl = lane + static_cast<int32_t>(iv);
            float* Sv = f.S + iv;
            vi sees = splati(cut ? 0 : -1);
            if (!ctx.fa1) {
                const vf m_old = ld(f.m + iv);
                vf m_new = m_old;
                for (int64_t c = 0; c < bc; ++c) {
                    vf s = ld(Sv + c * Rp) * scale;
                    if (!plain) s = score_mod(p, s, bh / p.heads, bh % p.heads, rl + static_cast<int32_t>(row0), col0 + c);
                    if (cut) {
                        const vi vis = vb.rows_see(rl, c);
                        s = vis ? s : ninf;
                        sees |= vis;
                    }
                    st(Sv + c * Rp, s);
                    m_new = vmax(m_new, s);
                }
                const vf ms = vsafe(m_new);
                const vf alpha = vexp(m_old - ms);
                vf rowsum = zero;
                for (int64_t c = 0; c < bc; ++c) {
                    const vf pc = vexp(ld(Sv + c * Rp) - ms);
                    st(Sv + c * Rp, pc);
                    rowsum = rowsum + pc;
                }
                st(f.a + iv, alpha);
                st(f.m + iv, sees ? m_new : m_old);
                st(f.l + iv, sees ? vmadd(alpha, ld(f.l + iv), rowsum) : ld(f.l + iv));
            } else {
                vf mt = ninf;
                for (int64_t c = 0; c < bc; ++c) {
                    vf s = ld(Sv + c * Rp) * scale;
                    if (!plain) s = score_mod(p, s, bh / p.heads, bh % p.heads, rl + static_cast<int32_t>(row0), col0 + c);
                    if (cut) {
                        const vi vis = vb.rows_see(rl, c);
                        s = vis ? s : ninf;
                        sees |= vis;
                    }
                    st(Sv + c * Rp, s);
                    mt = vmax(mt, s);
                }
                const vf mts = vsafe(mt);
                vf lt = zero;
                for (int64_t c = 0; c < bc; ++c) {
                    const vf pc = vexp(ld(Sv + c * Rp) - mts);
                    st(Sv + c * Rp, pc);
                    lt = lt + pc;
                }
                const vf m_old = ld(f.m + iv), l_old = ld(f.l + iv);
                const vf m_new = vmax(m_old, mt);
                const vf ms = vsafe(m_new);
                const vf alpha = vexp(m_old - ms), beta = vexp(mt - ms);
                const vf os = l_old * alpha;
                st(f.a + iv, os);
                st(f.b + iv, beta);
                st(f.l + iv, sees ? vmadd(beta, lt, os) : l_old);
                st(f.m + iv, sees ? m_new : m_old);
            }
            st(f.g + iv, reinterpret_cast<vf>(sees));
        }

        // P V takes P~ o Z / (1 - p) (common/dropout.h); l above took P~ undropped.
        for (int64_t r = 0; p.dropout.on() && r < br; ++r)
            p.dropout.apply_row(f.S + r, bc, bh / p.heads, bh % p.heads, row0 + r, col0, Rp);
        // pv^T[x][r] = sum_c P~[r,c] V[c,x], then the row update.
        // V_j as the caller laid it out from d = IN_PLACE_D: at d = 256 its 32-row tiles
        // give P~ V two vector steps per element of V_j, so a copy (a load and a store
        // each) costs more than the padding saves (9% of a forward on Sapphire Rapids,
        // where reading in place also wins from d = 64, and on Zen 4 from d = 32: 2-3.5%
        // in 2026-12; an earlier kernel there had the copy faster at d = 128).
        int64_t ldv = f.Ep;
        const float* Vj = f.Vj;
        if (!p.block_table && d >= IN_PLACE_D) {
            Vj = Vh.tile(qh.s.k0 + col0, bc, f.Vj, &ldv);
        } else {
            for (int64_t c = 0; c < bc; ++c)
                std::memcpy(f.Vj + c * f.Ep, Vh.row(qh.s.k0 + col0 + c), sizeof(float) * static_cast<size_t>(d));
        }
        auto fa2_step = [&](int64_t x, int64_t r, vf pv) PYFA_CPU_EPI {
            float* o = f.OT + x * Rp + r;
            const vf next = vmadd(ld(f.a + r), ld(o), pv);
            st(o, cut ? (reinterpret_cast<vi>(ld(f.g + r)) ? next : ld(o)) : next);
        };
        auto fa1_step = [&](int64_t x, int64_t r, vf pv) PYFA_CPU_EPI {
            float* o = f.OT + x * Rp + r;
            const vf ln = ld(f.l + r);
            const vf num = vmadd(ld(f.a + r), ld(o), ld(f.b + r) * pv);
            const vf next = ln == zero ? zero : num / ln;
            st(o, cut ? (reinterpret_cast<vi>(ld(f.g + r)) ? next : ld(o)) : next);
        };
        if (!cut) {
            if (!ctx.fa1) gemm_jo(f.S, Rp, Rp, Vj, 1, ldv, bc, d, fa2_step);
            else gemm_jo(f.S, Rp, Rp, Vj, 1, ldv, bc, d, fa1_step);
        } else {
            const SelRowsKeys sel{&vb, lane};
            if (!ctx.fa1) gemm_jo(f.S, Rp, Rp, Vj, 1, ldv, bc, d, fa2_step, sel);
            else gemm_jo(f.S, Rp, Rp, Vj, 1, ldv, bc, d, fa1_step, sel);
        }
    }

    float* O = p.o + qh.rows + row0 * d;  // (br, d)
    if (!ctx.fa1) {
        // O = O / l, LSE = m + log(l); a row that saw no key: O = 0, LSE = -inf.
        for (int64_t iv = 0; iv < Rp; iv += W) {
            const vf l = ld(f.l + iv);
            for (int64_t x = 0; x < d; ++x) {
                float* o = f.OT + x * Rp + iv;
                st(o, vcanon(l == zero ? zero : ld(o) / l));
            }
            st(f.a + iv, l == zero ? ninf : ld(f.m + iv) + vlog(l));
        }
        float* LSE = p.lse + qh.stat + row0;  // (br)
        for (int64_t r = 0; r < br; ++r) LSE[r] = canon(f.a[r]);
    } else {
        float* m = p.m + qh.stat + row0;  // (br)
        float* l = p.l + qh.stat + row0;  // (br)
        for (int64_t r = 0; r < br; ++r) {
            m[r] = canon(f.m[r]);
            l[r] = canon(f.l[r]);
        }
        for (int64_t e = 0; e < d * Rp; e += W) st(f.OT + e, vcanon(ld(f.OT + e)));
    }
    transpose_tile(f.OT, d, br, Rp, O, d);  // O[r * d + x] = OT[x * Rp + r], canonical above
    if (!ctx.fa1 && p.sinks && p.final_state())  // attention sinks join the final state (common/merge.h)
        for (int64_t r = 0; r < br; ++r) merge_sink_row(O + r * d, d, p.lse + qh.stat + row0 + r, p.sink(qh.h));
}

// ---------------------------------------------------------------------------------------
// FA2 forward of a short Q tile (decoding: Nq = 1 or a few rows) for a whole GQA group:
// the rows n = g * br + r of the K/V head's G query heads are served together, so each
// K_j, V_j is read from memory once per step for all of them, not once per query head;
// and the lanes run along keys (S = Q K^T, the exp) and along x (P~ V), not along rows,
// of which such a tile has fewer than a vector holds. Every row gets the forward's
// operations in the forward's order (docs/numerics.md, FA2 forward): the same fused
// chains over x and over c, and the row max and row sum as the same sequential chains
// over c (a scalar chain per row: reordered they could differ in a NaN or a zero's sign).
// ---------------------------------------------------------------------------------------
// A lane mask's element as stored in a float buffer, and back.
inline float lane_bits(int32_t v) {
    float f;
    std::memcpy(&f, &v, sizeof f);
    return f;
}
inline bool lane_set(float f) {
    int32_t v;
    std::memcpy(&v, &f, sizeof v);
    return v != 0;
}

// out[n] = f(... f(f(init[n], S[n][0]), S[n][1]) ..., S[n][bc - 1]) for the rows n < R of
// S (row stride Cp): each row's chain in order, four rows' chains interleaved so that
// they overlap instead of each waiting on its own latency.
template <class F>
inline void row_chains(const float* S, int64_t Cp, int64_t R, int64_t bc, const float* init, float* out, F f) {
    constexpr int64_t NB = 4;
    for (int64_t n0 = 0; n0 < R; n0 += NB) {
        const float* row[NB];
        float acc[NB];
        for (int64_t k = 0; k < NB; ++k) {
            const int64_t n = n0 + k < R ? n0 + k : n0;  // past R: a stand-in, not stored
            row[k] = S + n * Cp;
            acc[k] = init[n];
        }
        for (int64_t c = 0; c < bc; ++c)
            for (int64_t k = 0; k < NB; ++k) acc[k] = f(acc[k], row[k][c]);
        for (int64_t k = 0; k < NB && n0 + k < R; ++k) out[n0 + k] = acc[k];
    }
}

struct GrpBufs {
    int64_t R, Rw, Cp, Dp, Ep, slot;
    float *KT, *S, *Vj, *mn, *ms, *alpha, *rowsum, *sees, *Kp;  // one tile's, shared by the heads
    float *Qg, *O, *m, *l;  // the running state of one K/V head's group (head())

    // The buffers with the state of the item's k-th K/V head.
    GrpBufs head(int64_t k) const {
        GrpBufs g = *this;
        g.Qg += k * slot;
        g.O += k * slot;
        g.m += k * slot;
        g.l += k * slot;
        return g;
    }
};

// Rows of the group tile: G query heads by the grid's Q tile (at most Nq rows).
inline int64_t group_rows(const AttentionParams& p) {
    const int64_t br = p.seqlen_q < p.block_r ? p.seqlen_q : p.block_r;
    return p.heads / p.heads_kv * br;
}

inline GrpBufs grp_bufs(const AttentionParams& p, float* ws) {
    GrpBufs g;
    const int64_t d = p.head_dim, Bc = p.block_c;
    g.R = group_rows(p);
    g.Rw = round_up(g.R, W);
    g.Cp = round_up(Bc, W);
    g.Dp = round_up(d, W);
    g.Ep = pad_stride(d);
    g.KT = ws;                      // (d, Cp)   K_j transposed, keys past bc zero
    g.S = g.KT + d * g.Cp;          // (R, Cp)   S_ij, then P~_ij
    g.Vj = g.S + g.R * g.Cp;        // (Bc, Ep)  V_j, columns d .. Dp-1 zero
    g.mn = g.Vj + Bc * g.Ep;        // (Rw) each: m_new, safe_max(m_new), alpha, rowsum,
    g.ms = g.mn + g.Rw;             //            and the lanes of rows that see a key of
    g.alpha = g.ms + g.Rw;          //            a cut tile (vi bits)
    g.rowsum = g.alpha + g.Rw;
    g.sees = g.rowsum + g.Rw;
    g.Kp = g.sees + g.Rw;           // (Bc, d)   paged K/V: K_j's rows gathered
    g.Qg = g.Kp + round_up(Bc * d, W);  // per head, slot floats apart (every buffer
                                        // starts on a vector):
    g.O = g.Qg + g.R * g.Ep;        //   (R, Ep) the group's q rows, (R, Dp) O rows,
    g.m = g.O + g.R * g.Dp;         //   (Rw) m and (Rw) l
    g.l = g.m + g.Rw;
    g.slot = g.R * g.Ep + g.R * g.Dp + 2 * g.Rw;
    return g;
}

inline size_t grp_floats(const AttentionParams& p, int64_t heads) {
    const int64_t d = p.head_dim, Bc = p.block_c, R = group_rows(p), Rw = round_up(R, W);
    const int64_t Cp = round_up(Bc, W), Ep = pad_stride(d), Dp = round_up(d, W);
    return static_cast<size_t>(d * Cp + R * Cp + Bc * Ep + 5 * Rw + round_up(Bc * d, W) +
                               heads * (R * Ep + R * Dp + 2 * Rw));
}

// P~ V in a cut tile: lanes along x, steps k keys, operands j the group's rows (row j % br
// of the tile).
struct SelGroupKeys {
    static constexpr bool on = true;
    const Band* band;
    int64_t br;
    vi keep(int64_t k, int64_t, int64_t j) const { return splati(band->visible(j % br, k) ? -1 : 0); }
    // The operands' rows j % br, j = j0 .. j0+nj-1: some row takes k within the rows'
    // extreme spans, every row within their common one.
    StepSpan span(int64_t, int64_t, int64_t j0, int64_t nj, int64_t K) const {
        int64_t r_min = j0 % br, r_max = r_min;
        for (int64_t j = j0 + 1; j < j0 + nj; ++j) {
            r_min = min64(r_min, j % br);
            r_max = max64(r_max, j % br);
        }
        return StepSpan::keys_of_rows(K, *band, r_min, r_max);
    }
};

// Q tile i of the groups of query heads of ctx.group_heads adjacent K/V heads: item u is
// batch element b = u / (Hkv / group_heads), K/V heads hk0 = u % (Hkv / group_heads) *
// group_heads onwards; O and LSE. Each K/V head's group (its G query heads) is computed
// as alone, tile by tile in the heads' order: only the reads of a tile are shared, which
// for heads adjacent in memory (a (B, N, Hkv, d) or paged cache) makes each key row's
// block of heads one run of memory instead of Hkv runs a row stride apart.
void forward_group(const Ctx& ctx, int64_t u, int64_t i, float* ws) {
    const AttentionParams& p = ctx.p;
    const int64_t nh = ctx.group_heads, b = u / (p.heads_kv / nh), hk0 = u % (p.heads_kv / nh) * nh;
    const Sequence seq = p.sequence(b);
    const int64_t d = p.head_dim, Nq = seq.Nq, Nk = seq.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t row0 = i * Br, br = min64(Br, Nq - row0);
    if (br <= 0) return;  // past its sequence's rows
    const int64_t G = p.heads / p.heads_kv;
    const GrpBufs all = grp_bufs(p, ws);
    const int64_t R = G * br, Rw = round_up(R, W), Cp = all.Cp, Dp = all.Dp, Ep = all.Ep;
    const bool plain = score_mod_is_none(p);
    const vf scale = splat(p.scale), ninf = splat(-INFINITY), zero = splat(0.0f);
    const vi lane = iota();

    for (int64_t k = 0; k < nh; ++k) {
        const GrpBufs g = all.head(k);
        const int64_t h0 = (hk0 + k) * G;
        for (int64_t n = 0; n < R; ++n) {
            const float* Q = p.q + q_head(p, b * p.heads + h0 + n / br).rows + (row0 + n % br) * d;  // (d)
            std::memcpy(g.Qg + n * Ep, Q, sizeof(float) * static_cast<size_t>(d));
        }
        for (int64_t e = 0; e < R * Dp; ++e) g.O[e] = 0.0f;
        for (int64_t n = 0; n < Rw; ++n) {
            g.m[n] = -INFINITY;
            g.l[n] = 0.0f;
        }
    }
    for (int64_t c = 0; c < Bc; ++c)  // the columns d .. Dp-1 the products read; the rest is copied
        for (int64_t x = d; x < Dp; ++x) all.Vj[c * Ep + x] = 0.0f;

    // K and V as the caller laid them out (forwards_read_strided_kv), paged or not.
    const bool paged = p.block_table != nullptr;
    const KvRows K0 = k_rows(p, seq, hk0), V0 = v_rows(p, seq, hk0);
    // Rows a stride apart (a (B, N, Hkv, d) or paged cache: each on its own 4 KiB page,
    // which the hardware prefetchers do not cross) are prefetched on every build: on Zen 4
    // a third less time per step with AVX-512, a sixth with AVX2 (docs/cpu_backend.md).
    const bool prefetch = DECODE_PREFETCH || paged || K0.ld != nh * d || V0.ld != nh * d;
    const TileRange visit = ctx.kv_tiles(b, i);
    for (int64_t j = visit.begin; j < visit.end; ++j) {
        const int64_t col0 = j * Bc, bc = min64(Bc, Nk - col0), n0 = seq.k0 + col0;
        // K_j and V_j (of the item's heads) read once in address order before they are
        // used: a sequential stream the hardware prefetchers follow, where the transpose's
        // W-row blocks and the product's passes alone left most of the step waiting on
        // memory (the step is memory-bound). With `prefetch` that is the first tile
        // only: the next ones come in under this one's transposes (NextTile, paged or not;
        // docs/cpu_backend.md, Emerald Rapids), and not even that where the call before
        // (a split's previous chunk) prefetched it: read again from L2, one line per add
        // of touch_lines' chain, it took a sixth of a step at 64-key chunks. (One head's
        // paged rows: read where a tile lies in one page, else gathered below, each row
        // once in order.)
        const bool prefetched = prefetch && (j > visit.begin || ctx.first_prefetched);
        if ((!paged || nh > 1) && !prefetched) {
            K0.touch(n0, bc, nh * d, all.S);
            V0.touch(n0, bc, nh * d, all.S);
        }
        const bool more = j + 1 < visit.end || (ctx.prefetch_past && col0 + Bc < Nk);
        const int64_t next_rows = !prefetch || !more ? 0 : min64(Bc, Nk - col0 - Bc);
        NextTile pf{p, K0.X, V0.X, K0.ld, V0.ld, n0 + Bc, next_rows,
                    ceil_div(nh * d, 64 / static_cast<int64_t>(sizeof(float)))};
        // Half the lines go out under the transposes, half under P~ V's steps (those of its
        // whole register tiles), so that reads stay in flight through the whole tile: all
        // under the transposes, one Zen 4 thread took 5.5-6.0 against 4.6-4.9 ms at N = 8192.
        const int64_t pv_steps = nh * gemm_wide_hooked_steps(Dp, bc, R);
        const int64_t under_pv = pv_steps ? pf.lines() / 2 : 0;
        pf.per_block = ceil_div(pf.lines() - under_pv, nh * (bc / W) * (d / W) + 1);
        const int64_t per_step = pv_steps ? ceil_div(under_pv, pv_steps) : 0;
        const Band band = seq.mask.band(row0, col0);
        const bool cut = band.cuts(br, bc);
        const VBand vb(band, Cp + Br + 1);
        for (int64_t k = 0; k < nh; ++k) {
            const GrpBufs g = all.head(k);
            const int64_t h0 = (hk0 + k) * G;
            const KvRows Kh = k_rows(p, seq, hk0 + k), Vh = v_rows(p, seq, hk0 + k);
            int64_t ldk = 0;
            const float* K = Kh.tile(n0, bc, g.Kp, &ldk);  // (bc, d), row stride ldk
            // S[n][c] = sum_x Q[n,x] K[c,x].
            if (!scores_in_registers(K, bc, d, ldk, g.Qg, Ep, R, g.S, Cp, &pf)) {
                transpose_tile(K, bc, d, ldk, g.KT, Cp, &pf);
                gemm_store_kb(g.KT, Cp, Cp, g.Qg, Ep, 1, d, R, g.S, Cp);
            }
            // P~ V reads V_j in place when its rows fill whole vectors (each line once: the
            // lanes of x partition them) and are evenly spaced, else from a copy padded to Dp.
            const bool v_in_place = d == Dp && Vh.even(n0, bc);
            for (int64_t c = 0; !v_in_place && c < bc; ++c)
                std::memcpy(g.Vj + c * Ep, Vh.row(n0 + c), sizeof(float) * static_cast<size_t>(d));
            const float* Vsrc = v_in_place ? Vh.row(n0) : g.Vj;
            const int64_t Vld = v_in_place ? Vh.ld : Ep;

            // Steps 1-2: the score pipeline along keys, then the row max.
            for (int64_t n = 0; n < R; ++n) {
                const int64_t r = n % br, h = h0 + n / br;
                float* Sr = g.S + n * Cp;
                for (int64_t cv = 0; cv < Cp; cv += W) {
                    const vi cl = lane + static_cast<int32_t>(cv);
                    vf s = ld(Sr + cv) * scale;
                    if (!plain) s = score_mod(p, s, b, h, row0 + r, cl + static_cast<int32_t>(col0));
                    if (cut) s = vb.keys_seen(cl, r) ? s : ninf;
                    st(Sr + cv, s);
                }
                const TileRange seen = band.cols(r, bc);
                g.sees[n] = lane_bits(!cut || seen.begin != seen.end ? -1 : 0);
            }
            row_chains(g.S, Cp, R, bc, g.m, g.mn, [](float acc, float x) { return x > acc ? x : acc; });
            for (int64_t n = R; n < Rw; ++n) {
                g.mn[n] = -INFINITY;
                g.sees[n] = 0.0f;
            }
            for (int64_t nv = 0; nv < Rw; nv += W) {
                const vf ms = vsafe(ld(g.mn + nv));
                st(g.ms + nv, ms);
                st(g.alpha + nv, vexp(ld(g.m + nv) - ms));
            }
            // Steps 3-4: P~ = exp(S - safe_max(m_new)) along keys, the row sum in order.
            for (int64_t n = 0; n < R; ++n) {
                float* Sr = g.S + n * Cp;
                const vf ms = splat(g.ms[n]);
                for (int64_t cv = 0; cv < Cp; cv += W) st(Sr + cv, vexp(ld(Sr + cv) - ms));
            }
            for (int64_t n = 0; n < R; ++n) g.rowsum[n] = 0.0f;
            row_chains(g.S, Cp, R, bc, g.rowsum, g.rowsum, [](float acc, float x) { return acc + x; });
            for (int64_t n = R; n < Rw; ++n) g.rowsum[n] = 0.0f;
            for (int64_t nv = 0; nv < Rw; nv += W) {
                const vi sees = reinterpret_cast<vi>(ld(g.sees + nv));
                st(g.l + nv, sees ? vmadd(ld(g.alpha + nv), ld(g.l + nv), ld(g.rowsum + nv)) : ld(g.l + nv));
                st(g.m + nv, sees ? ld(g.mn + nv) : ld(g.m + nv));
            }
            // P V takes P~ o Z / (1 - p) (common/dropout.h); l above took P~ undropped.
            for (int64_t n = 0; p.dropout.on() && n < R; ++n)
                p.dropout.apply_row(g.S + n * Cp, bc, b, h0 + n / br, row0 + n % br, col0);
            // Step 5: pv[n][x] = sum_c P~[n,c] V[c,x], then O = fma(alpha, O, pv).
            auto step = [&](int64_t n, int64_t x, vf pv) PYFA_CPU_EPI {
                float* o = g.O + n * Dp + x;
                const vf next = vmadd(splat(g.alpha[n]), ld(o), pv);
                st(o, cut ? (lane_set(g.sees[n]) ? next : ld(o)) : next);
            };
            auto prefetch_some = [&](int64_t) PYFA_CPU_EPI { pf.issue(per_step); };
            if (!cut) gemm_wide(Vsrc, Vld, Dp, g.S, Cp, 1, bc, R, step, NoSel{}, prefetch_some);
            else gemm_wide(Vsrc, Vld, Dp, g.S, Cp, 1, bc, R, step, SelGroupKeys{&band, br}, prefetch_some);
            if (k == nh - 1) pf.issue(pf.lines());  // what the steps left, if any
        }
    }

    // O = O / l, LSE = m + log(l); a row that saw no key: O = 0, LSE = -inf.
    for (int64_t k = 0; k < nh; ++k) {
        const GrpBufs g = all.head(k);
        const int64_t h0 = (hk0 + k) * G;
        for (int64_t n = R; n < Rw; ++n) {
            g.m[n] = 0.0f;
            g.l[n] = 0x1p+0f;
        }
        for (int64_t nv = 0; nv < Rw; nv += W) {
            const vf l = ld(g.l + nv);
            st(g.alpha + nv, l == zero ? ninf : ld(g.m + nv) + vlog(l));
        }
        for (int64_t n = 0; n < R; ++n) {
            const QHead qh = q_head(p, b * p.heads + h0 + n / br);
            const int64_t r = n % br;
            const float ln = g.l[n];
            float* O = p.o + qh.rows + (row0 + r) * d;  // (d)
            const float* On = g.O + n * Dp;
            for (int64_t x = 0; x < d; ++x) O[x] = canon(ln == 0.0f ? 0.0f : On[x] / ln);
            p.lse[qh.stat + row0 + r] = canon(g.alpha[n]);
            if (p.sinks && p.final_state()) merge_sink_row(O, d, p.lse + qh.stat + row0 + r, p.sink(qh.h));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Backward (FA1 and FA2): lanes are the columns c of a K/V tile, so K_j and V_j are
// transposed once per tile and Q_i, dO_i are read in place as broadcast scalars. dK_j and
// dV_j are kept transposed, dQ rows with lanes along x.
// ---------------------------------------------------------------------------------------
struct BwdBufs {
    int64_t Cp, Dp, Ep;
    float *KT, *VT, *Kp, *P, *dS, *dKT, *dVT, *dQi, *Qi, *dOi, *g;
    float* dSS;  // dbias_splits_grad only: dS_S for dbias_tile, b.dS then holds dS_s; else null
};

inline BwdBufs bwd_bufs(const AttentionParams& p, float* ws) {
    BwdBufs b;
    const int64_t d = p.head_dim, Br = p.block_r, Bc = p.block_c;
    b.Cp = round_up(Bc, W);
    b.Dp = round_up(d, W);
    b.Ep = pad_stride(d);
    b.KT = ws;                 // (d, Cp)   K_j transposed, columns past bc zero
    b.VT = b.KT + d * b.Cp;    // (d, Cp)   V_j transposed
    b.Kp = b.VT + d * b.Cp;    // (Bc, Ep)  K_j, columns d .. Dp-1 zero
    b.P = b.Kp + Bc * b.Ep;    // (Br, Cp)  S_ij, then P_ij
    b.dS = b.P + Br * b.Cp;    // (Br, Cp)  dP_ij, then dS_ij
    b.dKT = b.dS + Br * b.Cp;  // (d, Cp)   dK_j transposed, accumulated
    b.dVT = b.dKT + d * b.Cp;  // (d, Cp)   dV_j transposed, accumulated
    b.dQi = b.dVT + d * b.Cp;  // (Br, Dp)  dQ rows of tile i
    b.Qi = b.dQi + Br * b.Dp;  // (Br, Ep)  Q_i, rows padded to Ep
    b.dOi = b.Qi + Br * b.Ep;  // (Br, Ep)  dO_i, rows padded to Ep
    b.g = b.dOi + Br * b.Ep;   // (Cp)      lanes of keys that a row of a cut tile sees (vi bits)
    b.dSS = dbias_splits_grad(p) ? b.g + b.Cp : nullptr;  // (Br, Cp) dS_S
    return b;
}

inline size_t bwd_floats(const AttentionParams& p) {
    const int64_t d = p.head_dim, Br = p.block_r, Bc = p.block_c;
    const int64_t Cp = round_up(Bc, W), Dp = round_up(d, W), Ep = pad_stride(d);
    const int64_t dSS = dbias_splits_grad(p) ? Br * Cp : 0;
    return static_cast<size_t>(4 * d * Cp + Bc * Ep + 2 * Br * Cp + Br * Dp + 2 * Br * Ep + Cp + dSS);
}

size_t workspace_floats(const Ctx& ctx) {
    const size_t a = fwd_floats(ctx.p), b = bwd_floats(ctx.p), c = ctx.group ? grp_floats(ctx.p, ctx.group_heads) : 0;
    return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

// K_j, V_j of K/V head bkv (b * Hkv + hk).
void load_kv(const Ctx& ctx, const BwdBufs& b, int64_t bkv, int64_t j, bool with_kp) {
    const AttentionParams& p = ctx.p;
    const int64_t d = p.head_dim, Nk = kv_sequence(p, bkv).Nk, Bc = p.block_c;
    const int64_t col0 = j * Bc, bc = min64(Bc, Nk - col0);
    const float* K = p.k + kv_rows(p, bkv) + col0 * d;  // (bc, d)
    const float* V = p.v + kv_rows(p, bkv) + col0 * d;  // (bc, d)
    for (int64_t c = 0; c < b.Cp; ++c)
        for (int64_t x = 0; x < d; ++x) {
            b.KT[x * b.Cp + c] = c < bc ? K[c * d + x] : 0.0f;
            b.VT[x * b.Cp + c] = c < bc ? V[c * d + x] : 0.0f;
        }
    if (with_kp)
        for (int64_t c = 0; c < bc; ++c)
            for (int64_t x = 0; x < b.Dp; ++x) b.Kp[c * b.Ep + x] = x < d ? K[c * d + x] : 0.0f;
}

// Q_i and dO_i of head bh: copied into b.Qi, b.dOi (rows padded to Ep), or from d =
// IN_PLACE_D where they lie in the backend's dense tensors (row stride d), as the
// forward reads V_j: at d = 256 a tile pair does two vector steps per element of Q_i and
// of dO_i in each product, and their copies cost 7% of a backward on Sapphire Rapids.
struct QRows {
    const float* Qi;   // (br, d) at row stride ld
    const float* dOi;  // (br, d) at row stride ld
    int64_t ld;
};
QRows load_q(const Ctx& ctx, const BwdBufs& b, int64_t bh, int64_t i) {
    const AttentionParams& p = ctx.p;
    const QHead qh = q_head(p, bh);
    const int64_t d = p.head_dim, Nq = qh.s.Nq, Br = p.block_r;
    const int64_t row0 = i * Br, br = min64(Br, Nq - row0);
    const float* Q = p.q + qh.rows + row0 * d;      // (br, d)
    const float* dO = p.dout + qh.rows + row0 * d;  // (br, d)
    if (d >= IN_PLACE_D) return QRows{Q, dO, d};
    for (int64_t r = 0; r < br; ++r) {
        std::memcpy(b.Qi + r * b.Ep, Q + r * d, sizeof(float) * static_cast<size_t>(d));
        std::memcpy(b.dOi + r * b.Ep, dO + r * d, sizeof(float) * static_cast<size_t>(d));
    }
    return QRows{b.Qi, b.dOi, b.Ep};
}

// P_ij into b.P and dS_ij into b.dS, rows r < br of Q tile i (loaded by load_q), columns
// of K/V tile j (loaded by load_kv): the score pipeline (common/score.h), lanes along keys.
// In a tile the mask cuts, a hidden score gets P = dS = 0 by selection and b.g marks the
// keys some row of the tile sees. With b.dSS, dS with respect to S (dBias's) goes there
// too, b.dS takes it through score_mod_grad (the kernels' two steps in one pass).
void tile_pair(const Ctx& ctx, const BwdBufs& b, const QRows& q, int64_t bh, int64_t i, int64_t j) {
    const AttentionParams& p = ctx.p;
    const QHead qh = q_head(p, bh);
    const int64_t d = p.head_dim, Nq = qh.s.Nq;
    const int64_t Br = p.block_r, Bc = p.block_c, Cp = b.Cp;
    const int64_t row0 = i * Br, br = min64(Br, Nq - row0), col0 = j * Bc;
    const int64_t bc = min64(Bc, qh.s.Nk - col0);
    // S[r][c] = sum_x Q[r,x] K[c,x]; dP[r][c] = sum_x dO[r,x] V[c,x].
    gemm_store_kb(b.KT, Cp, Cp, q.Qi, q.ld, 1, d, br, b.P, Cp);
    gemm_store_kb(b.VT, Cp, Cp, q.dOi, q.ld, 1, d, br, b.dS, Cp);

    const vf scale = splat(p.scale), zero = splat(0.0f);
    const vi lane = iota();
    const int64_t base = qh.stat + row0;
    const int64_t bi = qh.b, hi = qh.h;
    const Band band = qh.s.mask.band(row0, col0);
    const bool cut = band.cuts(br, bc);
    const VBand vb(band, Cp + Br + 1);
    if (cut)
        for (int64_t cv = 0; cv < Cp; cv += W) st(b.g + cv, zero);
    const bool plain = score_mod_is_none(p);
    for (int64_t r = 0; r < br; ++r) {
        const vf Dr = splat(ctx.D[base + r]);
        float* Pr = b.P + r * Cp;
        float* dSr = b.dS + r * Cp;
        const float lse = ctx.fa1 ? 0.0f : p.lse[base + r];
        const float lr = ctx.fa1 ? p.l[base + r] : 0.0f;
        const vf vlse = splat(lse), ms = splat(ctx.fa1 ? ssafe(p.m[base + r]) : 0.0f), vl = splat(lr);
        // Dropout (common/dropout.h): dS takes dP o Z / (1 - p), as score_grad does.
        p.dropout.apply_row(dSr, bc, bi, hi, row0 + r, col0);
        for (int64_t cv = 0; cv < Cp; cv += W) {
            const vi cl = lane + static_cast<int32_t>(cv);
            const vf s = ld(Pr + cv) * scale;
            const vf S = plain ? s : score_mod(p, s, bi, hi, row0 + r, cl + static_cast<int32_t>(col0));
            vf P;
            if (!ctx.fa1) P = lse == -INFINITY ? zero : vexp(S - vlse);
            else P = lr == 0.0f ? zero : vexp(S - ms) / vl;
            vf dS_S = softmax_grad(P, ld(dSr + cv), Dr);
            vf dS = score_mod_grad(p, dS_S, ScoreAt<vf>{s, S}, bi, hi, row0 + r, cl + static_cast<int32_t>(col0));
            if (cut) {
                const vi vis = vb.keys_seen(cl, r);
                P = vis ? P : zero;
                dS = vis ? dS : zero;
                dS_S = vis ? dS_S : zero;
                st(b.g + cv, reinterpret_cast<vf>(reinterpret_cast<vi>(ld(b.g + cv)) | vis));
            }
            st(Pr + cv, P);
            st(dSr + cv, dS);
            if (b.dSS) st(b.dSS + r * Cp + cv, dS_S);
        }
        p.dropout.apply_row(Pr, bc, bi, hi, row0 + r, col0);  // dV takes P o Z / (1 - p), dS P undropped
    }
}

// dK_j, dV_j of K/V head bkv = b * Hkv + hk, summed over its group's query heads
// h = hk * G + g, g = 0 .. G-1, and their Q tiles, in the kernels' order.
void backward_kv(const Ctx& ctx, int64_t bkv, int64_t j, bool with_dq, float* ws) {
    const AttentionParams& p = ctx.p;
    const Sequence seq = kv_sequence(p, bkv);
    const int64_t d = p.head_dim, Nq = seq.Nq, Nk = seq.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t col0 = j * Bc, bc = min64(Bc, Nk - col0);
    if (bc <= 0) return;  // past its sequence's keys
    const BwdBufs b = bwd_bufs(p, ws);
    const int64_t Cp = b.Cp, Dp = b.Dp, Ep = b.Ep;
    const vf scale = splat(p.scale);
    const vi lane = iota();
    load_kv(ctx, b, bkv, j, with_dq);
    for (int64_t e = 0; e < d * Cp; ++e) {
        b.dKT[e] = 0.0f;
        b.dVT[e] = 0.0f;
    }

    float* dK = p.dk + kv_rows(p, bkv) + col0 * d;  // (bc, d)
    float* dV = p.dv + kv_rows(p, bkv) + col0 * d;  // (bc, d)
    const int64_t G = p.heads / p.heads_kv;
    // Split backward (the kernel's order): query chunks of per Q tiles, chunk outer, then
    // the group's heads, then the chunk's tiles; each chunk's sums folded into dK, dV.
    const TileRange band_all = ctx.q_tiles(bkv / p.heads_kv, j);
    const int64_t per = p.split_size > 0 ? p.split_size / Br : 0;
    const bool any = band_all.begin < band_all.end;
    const int64_t c_first = per > 0 && any ? band_all.begin / per : 0;
    const int64_t c_end = per > 0 ? (any ? (band_all.end - 1) / per + 1 : 0) : 1;
    if (p.dbias)  // started once, not per chunk (the kernel's comment)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t bh = (bkv / p.heads_kv) * p.heads + (bkv % p.heads_kv) * G + g;
            dbias_clear(p, bh / p.heads, bh % p.heads, min64(band_all.begin * Br, Nq), min64(band_all.end * Br, Nq),
                        col0, bc, 0, 1);
        }
    for (int64_t chunk = c_first; chunk < c_end; ++chunk) {
        const TileRange visit =
            per > 0 ? TileRange{max64(band_all.begin, chunk * per), min64(band_all.end, (chunk + 1) * per)} : band_all;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t bh = (bkv / p.heads_kv) * p.heads + (bkv % p.heads_kv) * G + g;
            for (int64_t i = visit.begin; i < visit.end; ++i) {
                const int64_t row0 = i * Br, br = min64(Br, Nq - row0);
                const QRows q = load_q(ctx, b, bh, i);
                tile_pair(ctx, b, q, bh, i, j);
                if (p.dbias)
                    dbias_tile(p, b.dSS ? b.dSS : b.dS, Cp, seq.mask.band(row0, col0), bh / p.heads, bh % p.heads, row0,
                               br, col0, bc, 0, 1);
                // In a tile the mask cuts, hidden scores are left out of every product and a
                // key (a row) that no row (key) of the tile sees takes no step.
                const Band band = seq.mask.band(row0, col0);
                const bool cut = band.cuts(br, bc);
                const VBand vb(band, Cp + Br + 1);
                const SelKeysRows by_keys{&vb, lane};
                auto step = [&](int64_t c, vf next, vf old) PYFA_CPU_EPI {
                    return cut ? (reinterpret_cast<vi>(ld(b.g + c)) ? next : old) : next;
                };
                // dv^T[x][c] = sum_r P[r,c] dO[r,x]; dk^T[x][c] = sum_r dS[r,c] Q[r,x].
                auto dv_step = [&](int64_t x, int64_t c, vf dv) PYFA_CPU_EPI {
                    float* a = b.dVT + x * Cp + c;
                    st(a, step(c, ld(a) + dv, ld(a)));
                };
                auto dk_step = [&](int64_t x, int64_t c, vf dk) PYFA_CPU_EPI {
                    float* a = b.dKT + x * Cp + c;
                    st(a, step(c, ctx.fa1 ? vmadd(scale, dk, ld(a)) : ld(a) + dk, ld(a)));
                };
                if (!cut) {
                    gemm(b.P, Cp, Cp, q.dOi, 1, q.ld, br, d, dv_step);
                    gemm(b.dS, Cp, Cp, q.Qi, 1, q.ld, br, d, dk_step);
                } else {
                    gemm(b.P, Cp, Cp, q.dOi, 1, q.ld, br, d, dv_step, by_keys);
                    gemm(b.dS, Cp, Cp, q.Qi, 1, q.ld, br, d, dk_step, by_keys);
                }
                if (with_dq) {
                    // dq[r][x] = sum_c dS[r,c] K[c,x], added to the head's dQ rows in place.
                    auto store = [&](int64_t r, int64_t x, vf dq) PYFA_CPU_EPI { st(b.dQi + r * Dp + x, dq); };
                    if (!cut) gemm(b.Kp, Ep, Dp, b.dS, Cp, 1, bc, br, store);
                    else gemm(b.Kp, Ep, Dp, b.dS, Cp, 1, bc, br, store, SelOpsKeys{&band});
                    float* dQ = p.dq + q_head(p, bh).rows + row0 * d;  // (br, d)
                    for (int64_t r = 0; r < br; ++r) {
                        if (cut && band.cols(r, bc).begin == band.cols(r, bc).end) continue;
                        const float* dq = b.dQi + r * Dp;
                        float* out = dQ + r * d;
                        if (!ctx.fa1)
                            for (int64_t x = 0; x < d; ++x) out[x] = out[x] + dq[x];
                        else
                            for (int64_t x = 0; x < d; ++x) out[x] = madd(p.scale, dq[x], out[x]);
                    }
                }
            }
        }
        if (per > 0)
            for (int64_t c = 0; c < bc; ++c)
                for (int64_t x = 0; x < d; ++x) {
                    split_fold(&dK[c * d + x], &b.dKT[x * Cp + c], p.scale, chunk == c_first);
                    split_fold(&dV[c * d + x], &b.dVT[x * Cp + c], 1.0f, chunk == c_first);
                }
    }
    if (per > 0) {
        if (c_first == c_end)  // no query sees the tile: acc = +0
            for (int64_t e = 0; e < bc * d; ++e) dK[e] = dV[e] = 0.0f;
        return;
    }

    for (int64_t c = 0; c < bc; ++c)
        for (int64_t x = 0; x < d; ++x) {
            const float dk = b.dKT[x * Cp + c];
            dK[c * d + x] = canon(ctx.fa1 ? dk : dk * p.scale);
            dV[c * d + x] = canon(b.dVT[x * Cp + c]);
        }
}

void backward_dq(const Ctx& ctx, int64_t bh, int64_t i, float* ws) {
    const AttentionParams& p = ctx.p;
    const QHead qh = q_head(p, bh);
    const int64_t d = p.head_dim, Nq = qh.s.Nq, Nk = qh.s.Nk;
    const int64_t Br = p.block_r, Bc = p.block_c;
    const int64_t row0 = i * Br, br = min64(Br, Nq - row0);
    if (br <= 0) return;  // past its sequence's rows
    const BwdBufs b = bwd_bufs(p, ws);
    const int64_t Dp = b.Dp, Cp = b.Cp;
    const vf scale = splat(p.scale);
    for (int64_t e = 0; e < br * Dp; ++e) b.dQi[e] = 0.0f;
    const QRows q = load_q(ctx, b, bh, i);

    const TileRange visit = ctx.kv_tiles(qh.b, i);
    const int64_t per = p.split_size > 0 ? p.split_size / Bc : 0;  // K/V tiles per key chunk
    float* dQ = p.dq + qh.rows + row0 * d;  // (br, d)
    for (int64_t j = visit.begin; j < visit.end; ++j) {
        const int64_t bc = min64(Bc, Nk - j * Bc);
        load_kv(ctx, b, kv_head(p, bh), j, true);
        tile_pair(ctx, b, q, bh, i, j);
        // In a tile the mask cuts, hidden scores are left out of dS K and a row that sees
        // no key of the tile takes no step.
        const Band band = qh.s.mask.band(row0, j * Bc);
        const bool cut = band.cuts(br, bc);
        auto dq_step = [&](int64_t r, int64_t x, vf dq) PYFA_CPU_EPI {
            if (cut && band.cols(r, bc).begin == band.cols(r, bc).end) return;
            float* a = b.dQi + r * Dp + x;
            st(a, ctx.fa1 ? vmadd(scale, dq, ld(a)) : ld(a) + dq);
        };
        if (!cut) gemm(b.Kp, b.Ep, Dp, b.dS, Cp, 1, bc, br, dq_step);
        else gemm(b.Kp, b.Ep, Dp, b.dS, Cp, 1, bc, br, dq_step, SelOpsKeys{&band});
        // Split backward: the chunk's last visited tile folds its dQ_i into dQ (the kernel's).
        if (per > 0 && (j + 1 == visit.end || (j + 1) % per == 0))
            for (int64_t r = 0; r < br; ++r)
                for (int64_t x = 0; x < d; ++x)
                    split_fold(&dQ[r * d + x], &b.dQi[r * Dp + x], p.scale, j / per == visit.begin / per);
    }
    if (per > 0) {
        if (visit.begin == visit.end)  // no chunk folded: acc = +0
            for (int64_t e = 0; e < br * d; ++e) dQ[e] = 0.0f;
        return;
    }
    for (int64_t r = 0; r < br; ++r)
        for (int64_t x = 0; x < d; ++x) {
            const float dq = b.dQi[r * Dp + x];
            dQ[r * d + x] = canon(ctx.fa1 ? dq : dq * p.scale);
        }
}

void zero_dq(const Ctx& ctx, int64_t bh) {
    const AttentionParams& p = ctx.p;
    const QHead qh = q_head(p, bh);
    const int64_t n = qh.s.Nq * p.head_dim;
    std::memset(p.dq + qh.rows, 0, sizeof(float) * static_cast<size_t>(n));
}

void finish_dq(const Ctx& ctx, int64_t bh) {
    const AttentionParams& p = ctx.p;
    const QHead qh = q_head(p, bh);
    const int64_t n = qh.s.Nq * p.head_dim;
    float* dQ = p.dq + qh.rows;  // (Nq, d)
    for (int64_t e = 0; e < n; ++e) dQ[e] = canon(ctx.fa1 ? dQ[e] : dQ[e] * p.scale);
}

// D[r] = sum_x dO[r,x] O[r,x], x = 0 .. d-1 in order from +0.
void rowdot(const Ctx& ctx, int64_t bh, int64_t i) {
    const AttentionParams& p = ctx.p;
    const QHead qh = q_head(p, bh);
    const int64_t d = p.head_dim, Nq = qh.s.Nq, Br = p.block_r;
    const int64_t row0 = i * Br, br = min64(Br, Nq - row0);
    if (br <= 0) return;  // past its sequence's rows
    const float* O = p.o + qh.rows + row0 * d;      // (br, d)
    const float* dO = p.dout + qh.rows + row0 * d;  // (br, d)
    float* D = ctx.D + qh.stat + row0;              // (br)
    // RB rows at a time: RB independent chains instead of one latency-bound chain.
    constexpr int64_t RB = 8;
    int64_t r = 0;
    for (; r + RB <= br; r += RB) {
        float s[RB] = {};
        for (int64_t x = 0; x < d; ++x)
            for (int64_t k = 0; k < RB; ++k) s[k] = madd(dO[(r + k) * d + x], O[(r + k) * d + x], s[k]);
        for (int64_t k = 0; k < RB; ++k) D[r + k] = s[k];
    }
    for (; r < br; ++r) {
        float s = 0.0f;
        for (int64_t x = 0; x < d; ++x) s = madd(dO[r * d + x], O[r * d + x], s);
        D[r] = s;
    }
}

}  // namespace
}  // namespace PYFA_CPU_NS

extern const Isa PYFA_CPU_TABLE;
const Isa PYFA_CPU_TABLE = {
    PYFA_CPU_NAME,           PYFA_CPU_W,
    PYFA_CPU_NS::workspace_floats, PYFA_CPU_NS::forward,
    PYFA_CPU_NS::rowdot,     PYFA_CPU_NS::backward_kv,
    PYFA_CPU_NS::backward_dq, PYFA_CPU_NS::zero_dq,
    PYFA_CPU_NS::finish_dq,   PYFA_CPU_NS::forward_group,
};

}  // namespace pyfa_cpu
