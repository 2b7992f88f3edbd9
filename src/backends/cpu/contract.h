// contract.h: the numerical contract's two primitives for the cpu backend (src/backends/cpu), the
// twins of pyfa_fma and pyfa_canonical_nan in src/common/numerics.h. docs/numerics.md
// lists every place where an operation is a fused multiply-add; each such place in
// src/backends/cpu goes through madd (or vmadd, its vector twin in cpu_impl.h), and every float
// stored to an output goes through canon.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// static: each instruction-set file gets its own copy compiled with its own flags, so the
// linker can never hand the portable path an AVX-512 body of the same inline function.
static inline float madd(float a, float b, float c) { return std::fma(a, b, c); }

// Any NaN becomes the one canonical quiet NaN, 0x7FC00000, as on the GPU.
static inline float canon(float x) {
    if (x != x) {
        const uint32_t nan = 0x7FC00000u;
        std::memcpy(&x, &nan, sizeof x);
    }
    return x;
}
