// smem_ubsan.cpp: every kernel table row's shared-memory size (src/core/tiles.cpp over
// src/common/smem.h) at the extremes of its arguments, for tests/test_abi_safety.py, which
// builds it with -fsanitize=undefined so that any signed overflow stops the program. A
// size is exact or -1; it prints "smem: ok" when every answer is.
#include <cstdint>
#include <cstdio>

#include "core/internal.h"
#include "kernels/table.h"

int main() {
    const int64_t extremes[] = {1, 2, 64, 128, 0x7fffffff, INT64_MAX / 8, INT64_MAX / 2, INT64_MAX - 1, INT64_MAX};
    int bad = 0;
    for (int id = -1; id <= kKernelRows; ++id)
        for (int64_t br : extremes)
            for (int64_t bc : extremes)
                for (int64_t d : extremes) {
                    const int64_t n = pyfa::smem_bytes(id, br, bc, d);
                    if (n < -1 || (n >= 0 && n % 4 != 0)) {
                        std::printf("smem: row %d (%lld, %lld, %lld): %lld\n", id, static_cast<long long>(br),
                                    static_cast<long long>(bc), static_cast<long long>(d), static_cast<long long>(n));
                        ++bad;
                    }
                    for (int variant = -1; variant <= 3; ++variant)
                        if (pyfa::variant_smem_bytes(id, variant, br, bc, d) < -1) ++bad;
                }
    std::printf("smem: %s\n", bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
