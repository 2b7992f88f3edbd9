// tiles.cpp: launch geometry, shared-memory sizes and default tiles of every kernel.
// sim/tiles.py mirrors the default-tile rules; tests/test_tiles.py holds them equal.
#include <string>

#include "common/smem.h"
#include "common/tiling.h"
#include "launch/internal.h"

namespace pyfa {

namespace {

bool layout_of(int kernel, int64_t Br, int64_t Bc, int64_t d, SmemLayout* L) {
    switch (kernel) {
        case PYFA_KERNEL_FA2_FORWARD: *L = fa2_forward_smem(Br, Bc, d); return true;
        default: return false;
    }
}

}  // namespace

const char* kernel_name(int kernel) {
    switch (kernel) {
        case PYFA_KERNEL_FA1_FORWARD: return "fa1_forward";
        case PYFA_KERNEL_FA2_FORWARD: return "fa2_forward";
        case PYFA_KERNEL_FA1_BACKWARD: return "fa1_backward";
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS: return "fa2_backward_preprocess";
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: return "fa2_backward_dkdv";
        case PYFA_KERNEL_FA2_BACKWARD_DQ: return "fa2_backward_dq";
    }
    return "unknown kernel";
}

int64_t smem_bytes(int kernel, int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    if (Br < 1 || Bc < 1 || d < 1 || !layout_of(kernel, Br, Bc, d, &L)) return 0;
    return L.bytes();
}

std::string smem_breakdown(int kernel, int64_t Br, int64_t Bc, int64_t d) {
    SmemLayout L;
    if (!layout_of(kernel, Br, Bc, d, &L)) return "";
    std::string s;
    for (int t = 0; t < L.count; ++t) {
        if (t) s += " + ";
        s += std::string(L.name[t]) + " " + std::to_string(L.floats[t] * 4);
    }
    return s;
}

// Start from 64 x 64 and halve both until the tiles fit the device's shared memory.
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int* Br,
                          int* Bc) {
    SmemLayout L;
    if (!layout_of(kernel, 1, 1, 1, &L))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "kernel: unknown kernel " + std::to_string(kernel));
    int r = 64, c = 64;
    while (r > 1 && smem_bytes(kernel, r, c, d) > profile.smem_per_block) {
        r /= 2;
        c /= 2;
    }
    if (smem_bytes(kernel, r, c, d) > profile.smem_per_block)
        return fail(PYFA_ERROR_TILE_TOO_LARGE, std::string(kernel_name(kernel)) +
                                                   ": even 1 x 1 tiles do not fit in " +
                                                   std::to_string(profile.smem_per_block) + " bytes");
    *Br = r;
    *Bc = c;
    return PYFA_OK;
}

LaunchShape launch_shape(int kernel, const AttentionParams& p) {
    const int64_t Tr = ceil_div(p.seqlen_q, p.block_r);
    LaunchShape s{};
    s.smem_bytes = smem_bytes(kernel, p.block_r, p.block_c, p.head_dim);
    switch (kernel) {
        case PYFA_KERNEL_FA2_FORWARD:
            s.grid[0] = static_cast<unsigned>(Tr);
            s.grid[1] = static_cast<unsigned>(p.heads);
            s.grid[2] = static_cast<unsigned>(p.batch);
            s.threads = kFa2ForwardThreads;
            break;
        default:
            break;
    }
    return s;
}

}  // namespace pyfa
