// numerics.h: pyfa's own float32 fma, max, exp and log, the inner product and the NaN rule.
//
// The kernels (under nvcc and under g++ for the emulator) and the NumPy simulator
// (pyfa/sim/numerics.py) must produce identical float32 bits. libm, CUDA's expf/__expf and
// NumPy's exp/log all differ from one another, so these functions are built only from
// operations that IEEE 754 rounds the same way everywhere: float32 add, sub, mul, div,
// fused multiply-add (one rounding), comparisons and selects, integer arithmetic on
// exponent bits, and int->float conversion of small integers. Every fusion is written as
// pyfa_fma; the library is compiled with nvcc -fmad=false and g++ -ffp-contract=off so that
// nothing else is fused behind our back. Every step below is mirrored, in the same order,
// by pyfa/sim/numerics.py. The contract: docs/numerics.md; exp and log: docs/numerics_exp_log.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/device.h"

// Bit casts. Device code uses the intrinsics; host code (g++, and nvcc's host pass)
// uses memcpy, the well-defined way in C++17.
PYFA_HD uint32_t pyfa_float_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
#endif
}

PYFA_HD float pyfa_bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
}

// a*b + c rounded once (IEEE fusedMultiplyAdd). The one fused operation of the library:
// docs/numerics.md lists every place that uses it. NumPy twin: pyfa/sim/numerics.py fma32.
PYFA_HD float pyfa_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return std::fmaf(a, b, c);
#endif
}

// Every float a kernel stores to global memory goes through this: a GPU's arithmetic
// returns its own canonical NaN while x86 keeps an operand's payload, so the one NaN
// pattern 0x7FC00000 is what makes CUDA, the emulator and the simulator agree bit for bit.
// NumPy twin: pyfa/sim/numerics.py canonical_nan.
PYFA_HD float pyfa_canonical_nan(float x) { return (x != x) ? pyfa_bits_float(0x7FC00000u) : x; }

// The project's max: NaN in b is ignored, NaN in a propagates, ties (including -0 vs +0)
// keep a. NumPy twin: np.where(b > a, b, a). Not fmaxf and not np.maximum, which disagree
// with each other on NaN and signed zeros.
PYFA_HD float pyfa_max(float a, float b) { return (b > a) ? b : a; }

// ---------------------------------------------------------------------------------------
// exp
// ---------------------------------------------------------------------------------------
// X_HI: the largest float whose exact exp rounds to a finite float (exp(X_HI) is about
// 0.99999 * FLT_MAX; the next float up has exp above FLT_MAX + ulp/2).
#define PYFA_EXP_X_HI 0x1.62e42ep+6f   // 88.72283172607422
// X_LO: the smallest float whose exact exp is above 2^-150, i.e. rounds to a non-zero
// (subnormal) float. Below it the result is +0 exactly; from it upward subnormal results
// are produced by gradual underflow (see the final scaling).
#define PYFA_EXP_X_LO -0x1.9fe368p+6f  // -103.97207641601562
#define PYFA_LOG2E 0x1.715476p+0f      // 1/ln2 rounded to float
// ln2 = LN2_HI + LN2_LO. LN2_HI has 16 significant bits, so n * LN2_HI is exact for every
// |n| < 256 (n is in [-150, 128] here), and x - n*LN2_HI is computed without the error a
// single float ln2 would bring (n * 2^-25 relative, far above 1 ulp for large n).
#define PYFA_LN2_HI 0x1.62e4p-1f       // 0.693145751953125
#define PYFA_LN2_LO 0x1.7f7d1cp-20f    // ln2 - LN2_HI, rounded to float
// 1.5 * 2^23: adding it to a float of magnitude < 2^22 leaves the integer nearest to that
// float (ties to even) in the low mantissa bits; subtracting it gives that integer back.
#define PYFA_ROUND_MAGIC 0x1.8p+23f
#define PYFA_ROUND_MAGIC_BITS 0x4B400000u
// e^r ~ 1 + r + r^2*(C2 + r*(C3 + r*(C4 + r*(C5 + r*C6)))) for |r| <= ln2/2 + 2e-4:
// a relative-error minimax fit (Lawson's algorithm, C0 fixed to 1 so that exp(0) == 1),
// coefficients rounded to float. Truncation error 2.0e-9 relative (0.03 ulp of 2^-24).
// C1 rounds to exactly 1.0f, which the evaluation order below relies on.
#define PYFA_EXP_C2 0x1.fffffcp-2f
#define PYFA_EXP_C3 0x1.555418p-3f
#define PYFA_EXP_C4 0x1.555824p-5f
#define PYFA_EXP_C5 0x1.1267f2p-7f
#define PYFA_EXP_C6 0x1.6ae6c6p-10f

PYFA_HD float pyfa_exp(float x) {
    // Clamp into [X_LO, X_HI] first, so every later step works on a finite value with n in
    // [-150, 128]; the special cases are selected at the end. (x >= X_LO) is false for NaN,
    // which therefore also takes the harmless stand-in X_LO.
    float xc = (x >= PYFA_EXP_X_LO) ? x : PYFA_EXP_X_LO;
    xc = (xc > PYFA_EXP_X_HI) ? PYFA_EXP_X_HI : xc;

    // Range reduction x = n*ln2 + r, n = round(x / ln2), |r| <= ln2/2 (plus rounding).
    float t = xc * PYFA_LOG2E;
    t = t + PYFA_ROUND_MAGIC;                     // n sits in the low bits of t
    const float nf = t - PYFA_ROUND_MAGIC;         // n as a float (exact)
    const int32_t n = (int32_t)(pyfa_float_bits(t) - PYFA_ROUND_MAGIC_BITS);  // n as an int
    // Cody-Waite: subtract n*ln2 in two parts (n*LN2_HI is exact, see above).
    float r = xc - nf * PYFA_LN2_HI;
    r = r - nf * PYFA_LN2_LO;

    // e^r = 1 + (r + r^2 * Q(r)), Q by Horner's rule. C1 == 1, so this is the fitted
    // polynomial; the order keeps r itself as the leading term of e^r - 1, so the
    // roundings inside Q and r^2*Q (whose magnitude is below |r|/4) move the result far less
    // than one ulp of r. Measured over every float input: max error 1.15 ulp and exp
    // monotone, where a plain Horner evaluation down to the constant 1 gave 1.36 ulp and
    // 2979 adjacent inputs whose results decrease.
    float q = PYFA_EXP_C6;
    q = q * r + PYFA_EXP_C5;
    q = q * r + PYFA_EXP_C4;
    q = q * r + PYFA_EXP_C3;
    q = q * r + PYFA_EXP_C2;
    const float r2 = r * r;
    q = r2 * q;
    q = r + q;
    const float p = q + 0x1p+0f;

    // result = p * 2^n. 2^n itself is out of float range at both ends (n = 128, and
    // n < -126 gives subnormal powers), so multiply by 2^n1 then 2^n2 with n1 + n2 = n,
    // both in [-75, 64]: each factor is built from exponent bits alone, the first product
    // is exact, and the second rounds once (into the subnormals when the result is tiny).
    // k = n + 150 >= 0 keeps the shift on a non-negative value.
    const int32_t n1 = ((n + 150) >> 1) - 75;
    const int32_t n2 = n - n1;
    const float s1 = pyfa_bits_float((uint32_t)(n1 + 127) << 23);
    const float s2 = pyfa_bits_float((uint32_t)(n2 + 127) << 23);
    float y = p * s1;
    y = y * s2;

    // Special cases, last so that they override the stand-in computations.
    y = (x > PYFA_EXP_X_HI) ? pyfa_bits_float(0x7F800000u) : y;  // overflow, +inf -> +inf
    y = (x < PYFA_EXP_X_LO) ? 0.0f : y;                          // underflow, -inf -> +0
    y = (x != x) ? x : y;                                        // NaN -> the same NaN
    return y;
}

// ---------------------------------------------------------------------------------------
// log
// ---------------------------------------------------------------------------------------
// m is reduced into [SQRT_HALF, SQRT2) so that |log m| <= ln2/2 and s stays small.
#define PYFA_LOG_SQRT2 0x1.6a09e6p+0f  // sqrt(2) rounded down to float
// log(1+f) = 2 atanh(s), s = f/(2+f), = f - s*(f - R) with
// R = 2s^2/3 + 2s^4/5 + ... ~ z*(D1 + z*(D2 + z*D3)), z = s*s, |s| <= 0.1716.
// The identity follows from f - 2s = s*f. Writing it this way keeps the exact f as the
// leading term, so the roundings of s (two) only touch the small correction s*(f - R).
// D1..D3: minimax fit (Lawson's algorithm) of R weighted by the relative error of log(1+f);
// truncation error 8.1e-10 relative (0.014 ulp of 2^-24).
#define PYFA_LOG_D1 0x1.55557ap-1f
#define PYFA_LOG_D2 0x1.995eacp-2f
#define PYFA_LOG_D3 0x1.31e4fap-2f

PYFA_HD float pyfa_log(float x) {
    // Stand-in 1.0 for everything that is not positive and finite (NaN, negatives, zeros,
    // +inf); those are selected at the end.
    const float inf = pyfa_bits_float(0x7F800000u);
    float xs = (x > 0.0f) ? x : 0x1p+0f;
    xs = (xs < inf) ? xs : 0x1p+0f;

    // Subnormal inputs: scale by 2^23 (exact) so that the exponent field is meaningful.
    const bool sub = xs < 0x1p-126f;
    xs = sub ? xs * 0x1p+23f : xs;
    const int32_t ebias = sub ? -23 - 127 : -127;

    // x = 2^e * m, m in [1, 2) from the bits, then moved into [sqrt(1/2), sqrt(2)).
    const uint32_t ix = pyfa_float_bits(xs);
    int32_t e = (int32_t)(ix >> 23) + ebias;
    float m = pyfa_bits_float((ix & 0x007FFFFFu) | 0x3F800000u);
    const bool big = m > PYFA_LOG_SQRT2;
    m = big ? m * 0x1p-1f : m;                    // exact
    e = big ? e + 1 : e;

    const float f = m - 0x1p+0f;                   // exact (Sterbenz)
    const float s = f / (f + 0x1p+1f);             // IEEE division: correctly rounded
    const float z = s * s;
    float R = PYFA_LOG_D3;
    R = R * z + PYFA_LOG_D2;
    R = R * z + PYFA_LOG_D1;
    R = R * z;
    float lm = f - R;
    lm = s * lm;
    lm = f - lm;                                   // log m

    // log x = e*ln2 + log m, with ln2 split as in exp: e*LN2_HI is exact (|e| <= 150), the
    // small parts are added first and the large exact part last.
    const float ef = (float)e;
    float y = ef * PYFA_LN2_LO;
    y = y + lm;
    y = ef * PYFA_LN2_HI + y;

    y = (x == inf) ? inf : y;                                    // +inf -> +inf
    y = (x == 0.0f) ? -inf : y;                                  // +-0 -> -inf
    y = (x < 0.0f) ? pyfa_bits_float(0x7FC00000u) : y;          // negative -> NaN
    y = (x != x) ? x : y;                                        // NaN -> the same NaN
    return y;
}

// ---------------------------------------------------------------------------------------
// tanh
// ---------------------------------------------------------------------------------------
// Written once for a float (the kernels) and for the cpu backend's GCC vectors of floats:
// only arithmetic, comparisons and selects that both types have, no bit casts, and every
// constant a float operand. docs/numerics_exp_log.md, "tanh".
// Below SMALL the odd polynomial, from it on 1 - 2/(E + 1) with E = exp(2|x|); SMALL
// balances the two branches' errors (measured: both below 1.4 ulp there).
#define PYFA_TANH_SMALL 0x1.8p-1f   // 0.75
// Below TINY tanh(x) rounds to x itself (x^3/3 is under half an ulp of x): x is returned,
// which also keeps -0 (the polynomial's x + x*q gives +0 for it).
#define PYFA_TANH_TINY 0x1p-12f
// tanh(x) rounds to 1 for |x| above 9.011 (1 - tanh x < 2^-25); clamping |x| at 9.5 keeps
// E = exp(2|x|) below 2^28, its 2^n within the five doublings below, and gives exactly 1
// above it.
#define PYFA_TANH_CLAMP 0x1.3p+3f   // 9.5
// tanh x ~ x + x*z*(T1 + z*(T2 + ... + z*T6)), z = x^2, for |x| < SMALL: a minimax fit
// (Lawson's algorithm) weighted by the relative error of tanh; truncation error 1.8e-9
// relative (0.03 ulp of 2^-24), coefficients rounded to float.
#define PYFA_TANH_T1 -0x1.555548p-2f
#define PYFA_TANH_T2 0x1.110d92p-3f
#define PYFA_TANH_T3 -0x1.b97804p-5f
#define PYFA_TANH_T4 0x1.5f504p-6f
#define PYFA_TANH_T5 -0x1.f4bf78p-8f
#define PYFA_TANH_T6 0x1.c497cap-10f

template <class T>
PYFA_LANES PYFA_HD T pyfa_tanh(T x) {
    const T a = x < 0.0f ? -x : x;  // NaN stays NaN, and takes the clamp below

    // |x| < SMALL: x + x*q, q = z*P(z) by Horner's rule. The exact x leads and |x*q| < |x|/5,
    // so q's roundings move the result far less than one ulp.
    const T z = x * x;
    T q = z * PYFA_TANH_T6 + PYFA_TANH_T5;
    q = q * z + PYFA_TANH_T4;
    q = q * z + PYFA_TANH_T3;
    q = q * z + PYFA_TANH_T2;
    q = q * z + PYFA_TANH_T1;
    q = q * z;
    const T small = x + x * q;

    // |x| >= SMALL: E = exp(u), u = 2 min(|x|, CLAMP) in [0, 19], by pyfa_exp's steps (the
    // same n, r and p, so E == pyfa_exp(u) bit for bit), except that p * 2^n is formed by
    // exact multiplications by 2^16, 2^8, 2^4, 2^2, 2 (n in [0, 28]) instead of exponent
    // bits.
    T u = a < PYFA_TANH_CLAMP ? a : PYFA_TANH_CLAMP;
    u = u + u;
    T t = u * PYFA_LOG2E;
    t = t + PYFA_ROUND_MAGIC;
    const T nf = t - PYFA_ROUND_MAGIC;  // n, an integer in [0, 28], as a float
    T r = u - nf * PYFA_LN2_HI;
    r = r - nf * PYFA_LN2_LO;
    T p = r * PYFA_EXP_C6 + PYFA_EXP_C5;
    p = p * r + PYFA_EXP_C4;
    p = p * r + PYFA_EXP_C3;
    p = p * r + PYFA_EXP_C2;
    const T r2 = r * r;
    p = r2 * p;
    p = r + p;
    T E = p + 0x1p+0f;
    T k = nf;  // n taken apart into powers of two, largest first
    E = k >= 16.0f ? E * 0x1p+16f : E;
    k = k >= 16.0f ? k - 16.0f : k;
    E = k >= 8.0f ? E * 0x1p+8f : E;
    k = k >= 8.0f ? k - 8.0f : k;
    E = k >= 4.0f ? E * 0x1p+4f : E;
    k = k >= 4.0f ? k - 4.0f : k;
    E = k >= 2.0f ? E * 0x1p+2f : E;
    k = k >= 2.0f ? k - 2.0f : k;
    E = k >= 1.0f ? E * 0x1p+1f : E;
    // tanh|x| = 1 - 2/(E + 1): the exact 1 leads and the correction (at most 0.37) carries
    // E's error. Every step is monotone in E (pyfa_exp is monotone, and a correctly rounded
    // add or division of a monotone operand stays monotone), so this branch is; 1 - 2e/(1 + e)
    // with e = exp(-2|x|) was as accurate but not monotone (19 220 adjacent inputs).
    T big = 0x1p+1f / (E + 0x1p+0f);
    big = 0x1p+0f - big;
    big = x < 0.0f ? -big : big;

    T y = a < PYFA_TANH_SMALL ? small : big;
    y = a < PYFA_TANH_TINY ? x : y;
    y = x != x ? x : y;  // NaN -> the same NaN
    return y;
}

// The row max to subtract before exp: a row that has seen no visible key yet has
// m = -inf and subtracts 0 instead, so exp(-inf - m) is exp(-inf) = 0, never exp(NaN).
PYFA_HD float safe_max(float m) { return m == -INFINITY ? 0.0f : m; }

// Every inner product over the head dimension: sum_x a[x] * b[x], x = 0 .. n-1 in order
// from +0, one fma per step. NumPy twins: pyfa/sim/numerics.py dot, dot_rows.
PYFA_HD float pyfa_dot(const float* a, const float* b, int64_t n) {
    float s = 0.0f;
    for (int64_t x = 0; x < n; ++x) s = pyfa_fma(a[x], b[x], s);
    return s;
}
