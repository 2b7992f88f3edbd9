// contract.h: the one switch between the numerical contract's two versions, for the cpu
// backend (cuda/cpu). docs/numerics.md lists every place where an operation is a
// multiply followed by an add; under version 1 that is two roundings (a * b, then + c),
// under version 2 one (fmaf). Every such place in cuda/cpu goes through madd (or vmadd,
// its vector twin in cpu_impl.h), so flipping PYFA_CPU_CONTRACT changes all of them at
// once and nothing else. Version 2 also canonicalises every NaN stored to an output.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// The switch. A build may also pass -DPYFA_CPU_CONTRACT=2 to try version 2 early.
#ifndef PYFA_CPU_CONTRACT
#define PYFA_CPU_CONTRACT 1
#endif

// static: each instruction-set file gets its own copy compiled with its own flags, so the
// linker can never hand the portable path an AVX-512 body of the same inline function.
static inline float madd(float a, float b, float c) {
#if PYFA_CPU_CONTRACT == 2
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

// What every float stored to an output goes through.
static inline float canon(float x) {
#if PYFA_CPU_CONTRACT == 2
    if (x != x) {
        const uint32_t nan = 0x7FC00000u;
        std::memcpy(&x, &nan, sizeof x);
    }
#endif
    return x;
}
