// The AVX-512 build of the cpu backend's tile code (compiled with -mavx512f -mfma; run
// only where the CPU and the OS support AVX-512F). 32 zmm registers: 2 x 6 register
// tiles of sums. A decode step prefetches its next K/V tile under the current one's
// transposes (PYFA_CPU_DECODE_PREFETCH): on Zen 4, 11-17% less time per step on a dense
// cache. The forward's V_j and the backward's Q_i, dO_i are read in place from d = 32
// (PYFA_CPU_IN_PLACE_D): on Zen 4, 2-3.5% less time per forward at d = 32 to 128 and
// 1-2% per forward + backward (docs/cpu_backend.md, Zen 4).
#if defined(__AVX512F__) && defined(__FMA__)
#define PYFA_CPU_NS avx512
#define PYFA_CPU_NAME "avx512"
#define PYFA_CPU_W 16
#define PYFA_CPU_RI 2
#define PYFA_CPU_RJ 6
#define PYFA_CPU_IN_PLACE_D 32
#define PYFA_CPU_DECODE_PREFETCH 1
#define PYFA_CPU_TABLE kIsaAvx512
#include "backends/cpu/cpu_impl.h"
#else
#error "cpu_avx512.cpp must be compiled with -mavx512f -mfma"
#endif
