// The AVX2 + FMA build of the cpu backend's tile code (compiled with -mavx2 -mfma; run
// only where the CPU has both). 16 ymm registers: 2 x 4 register tiles of sums.
#if defined(__AVX2__) && defined(__FMA__)
#define PYFA_CPU_NS avx2
#define PYFA_CPU_NAME "avx2"
#define PYFA_CPU_W 8
#define PYFA_CPU_RI 2
#define PYFA_CPU_RJ 4
#define PYFA_CPU_TABLE kIsaAvx2
#include "backends/cpu/cpu_impl.h"
#else
#error "cpu_avx2.cpp must be compiled with -mavx2 -mfma"
#endif
