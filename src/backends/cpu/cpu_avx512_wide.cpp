// The AVX-512 build for cores with two 512-bit FMA pipes (Intel's server cores since
// Skylake-SP; measured on Sapphire Rapids): 4 x 6 register tiles, 24 sums in flight and
// 10 loads per 24 fused multiply-adds, where cpu_avx512.cpp's 2 x 6 keeps 12 with 8 loads
// per 12; and the forward's V_j and the backward's Q_i, dO_i are read in place from
// d = 64 (cpu_impl.h); a decode step prefetches its next K/V tile under the current one's
// transposes (PYFA_CPU_DECODE_PREFETCH, measured faster on Emerald Rapids). The same tile code, hence the same bits; auto picks it on Intel
// CPUs (cpu_backend.cpp), the 2 x 6 build elsewhere (docs/cpu_backend.md, "Measured").
#if defined(__AVX512F__) && defined(__FMA__)
#define PYFA_CPU_NS avx512_wide
#define PYFA_CPU_NAME "avx512_wide"
#define PYFA_CPU_W 16
#define PYFA_CPU_RI 4
#define PYFA_CPU_RJ 6
#define PYFA_CPU_IN_PLACE_D 64
#define PYFA_CPU_DECODE_PREFETCH 1
#define PYFA_CPU_TABLE kIsaAvx512Wide
#include "backends/cpu/cpu_impl.h"
#else
#error "cpu_avx512_wide.cpp must be compiled with -mavx512f -mfma"
#endif
