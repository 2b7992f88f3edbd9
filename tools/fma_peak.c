/* fma_peak.c: the FMA peak of one core, for tools/bench.py (compiled by it at run time with
 * the flags of the cpu backend's build it reports against: -mavx512f -mfma or -mavx2 -mfma).
 *
 * fma_peak_loop(n) runs n steps of C independent chains of vector fused multiply-adds,
 * C * W * 2 * n flops (W floats per vector); C covers the FMA latency times the FMA ports
 * (4 cycles x 2 ports on the x86 cores measured so far), so the loop is bound by the ports'
 * throughput alone. The empty asm keeps the compiler from folding or spilling the chains. */
#include <stdint.h>
#include <immintrin.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define CHAINS 12
#define WIDTH 16
#elif defined(__FMA__)
typedef __m256 vec;
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
#define CHAINS 10
#define WIDTH 8
#else
#error "fma_peak.c needs -mavx512f -mfma or -mavx2 -mfma"
#endif

int fma_peak_width(void) { return WIDTH; }
int fma_peak_chains(void) { return CHAINS; }

float fma_peak_loop(int64_t n) {
    const vec b = SET1(0.999999f), c = SET1(1e-7f);
    vec a0 = SET1(1.0f), a1 = SET1(1.1f), a2 = SET1(1.2f), a3 = SET1(1.3f), a4 = SET1(1.4f);
    vec a5 = SET1(1.5f), a6 = SET1(1.6f), a7 = SET1(1.7f), a8 = SET1(1.8f), a9 = SET1(1.9f);
#if CHAINS == 12
    vec a10 = SET1(2.0f), a11 = SET1(2.1f);
#endif
    for (int64_t k = 0; k < n; ++k) {
        a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c);
        a4 = FMA(a4, b, c); a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c);
        a8 = FMA(a8, b, c); a9 = FMA(a9, b, c);
#if CHAINS == 12
        a10 = FMA(a10, b, c); a11 = FMA(a11, b, c);
        __asm__ volatile("" : "+v"(a10), "+v"(a11));
#endif
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4));
        __asm__ volatile("" : "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9));
    }
    vec s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9;
#if CHAINS == 12
    s = s + a10 + a11;
#endif
    float out[WIDTH];
    *(vec*)out = s;
    return out[0];
}
