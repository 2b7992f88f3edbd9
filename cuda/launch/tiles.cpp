// tiles.cpp: launch geometry, shared-memory sizes and default tiles of every kernel.
// sim/tiles.py mirrors the default-tile rules; tests/test_tiles.py holds them equal.
#include <cstdint>
#include <cstdio>

#include "common/smem.h"
#include "common/tiling.h"
#include "launch/internal.h"

namespace pyfa {

namespace {

bool layout_of(int kernel, int64_t Br, int64_t Bc, int64_t d, SmemLayout* L) {
    switch (kernel) {
        case PYFA_KERNEL_FA2_FORWARD: *L = fa2_forward_smem(Br, Bc, d); return true;
        case PYFA_KERNEL_FA1_FORWARD: *L = fa1_forward_smem(Br, Bc, d); return true;
        case PYFA_KERNEL_FA1_BACKWARD: *L = fa1_backward_smem(Br, Bc, d); return true;
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS: *L = fa2_backward_preprocess_smem(Br, Bc, d); return true;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: *L = fa2_backward_dkdv_smem(Br, Bc, d); return true;
        case PYFA_KERNEL_FA2_BACKWARD_DQ: *L = fa2_backward_dq_smem(Br, Bc, d); return true;
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
    if (Br < 1 || Bc < 1 || d < 1 || !layout_of(kernel, Br, Bc, d, &L)) return -1;
    return L.bytes();
}

bool smem_fits(int kernel, int64_t Br, int64_t Bc, int64_t d, int64_t limit) {
    const int64_t need = smem_bytes(kernel, Br, Bc, d);
    return need >= 0 && need <= limit;
}

void smem_breakdown(int kernel, int64_t Br, int64_t Bc, int64_t d, char* buf, size_t size) {
    SmemLayout L;
    if (!size) return;
    buf[0] = '\0';
    if (!layout_of(kernel, Br, Bc, d, &L)) return;
    size_t used = 0;
    for (int t = 0; t < L.count && used < size; ++t) {
        const int64_t bytes = checked_mul(L.floats[t], static_cast<int64_t>(sizeof(float)));
        const int n = bytes >= 0
                          ? std::snprintf(buf + used, size - used, "%s%s %lld", t ? " + " : "",
                                          L.name[t], static_cast<long long>(bytes))
                          : std::snprintf(buf + used, size - used, "%s%s over 2^63 - 1", t ? " + " : "",
                                          L.name[t]);
        if (n < 0) return;
        used += static_cast<size_t>(n);
    }
}

// FA1's rule (Dao et al. 2022, Algorithms 1 and 4): Bc = ceil(M / 4d), Br = min(Bc, d),
// with M the device's shared memory per block in floats. The paper sizes only Q_i, O_i,
// K_j, V_j against M; the kernels also hold S_ij and more, so Bc is then lowered one at a
// time, Br following it down whenever it would exceed Bc, until the layout fits.
static pyfa_status fa1_default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile,
                                     int* Br, int* Bc) {
    const int64_t limit = profile.smem_per_block;
    const int64_t M = limit / static_cast<int64_t>(sizeof(float));
    // Bc may not exceed what a pyfa_config can hold; far below that it no longer fits.
    int64_t c = min64(max64(1, ceil_div(M, 4 * d)), INT32_MAX);
    int64_t r = min64(c, d);
    while (c > 1 && !smem_fits(kernel, r, c, d, limit)) {
        --c;
        r = min64(r, c);
    }
    if (!smem_fits(kernel, r, c, d, limit))
        return fail(PYFA_ERROR_TILE_TOO_LARGE, "%s: even 1 x 1 tiles at head_dim=%lld do not fit in %lld bytes",
                    kernel_name(kernel), static_cast<long long>(d), static_cast<long long>(limit));
    *Br = static_cast<int>(r);
    *Bc = static_cast<int>(c);
    return PYFA_OK;
}

// Start from 64 x 64 and halve both until the tiles fit the device's shared memory.
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int* Br,
                          int* Bc) {
    SmemLayout L;
    if (!layout_of(kernel, 1, 1, 1, &L))
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "kernel: unknown kernel %d", kernel);
    if (d < 1)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "head_dim: must be >= 1, got %lld", static_cast<long long>(d));
    if (kernel == PYFA_KERNEL_FA1_FORWARD || kernel == PYFA_KERNEL_FA1_BACKWARD)
        return fa1_default_tiles(kernel, d, profile, Br, Bc);
    const int64_t limit = profile.smem_per_block;
    int r = 64, c = 64;
    while (r > 1 && !smem_fits(kernel, r, c, d, limit)) {
        r /= 2;
        c /= 2;
    }
    if (!smem_fits(kernel, r, c, d, limit))
        return fail(PYFA_ERROR_TILE_TOO_LARGE, "%s: even 1 x 1 tiles at head_dim=%lld do not fit in %lld bytes",
                    kernel_name(kernel), static_cast<long long>(d), static_cast<long long>(limit));
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
        case PYFA_KERNEL_FA1_FORWARD:  // one block per (head, batch): FA1's parallelism
            s.grid[0] = 1;
            s.grid[1] = static_cast<unsigned>(p.heads);
            s.grid[2] = static_cast<unsigned>(p.batch);
            s.threads = kFa1ForwardThreads;
            break;
        case PYFA_KERNEL_FA1_BACKWARD:  // one block per (K/V head, batch): it serves the head's group
            s.grid[0] = 1;
            s.grid[1] = static_cast<unsigned>(p.heads_kv);
            s.grid[2] = static_cast<unsigned>(p.batch);
            s.threads = kFa1BackwardThreads;
            break;
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS:
        case PYFA_KERNEL_FA2_BACKWARD_DQ:  // one block per Q row block
            s.grid[0] = static_cast<unsigned>(Tr);
            s.grid[1] = static_cast<unsigned>(p.heads);
            s.grid[2] = static_cast<unsigned>(p.batch);
            s.threads = kFa2BackwardThreads;
            break;
        case PYFA_KERNEL_FA2_BACKWARD_DKDV:  // one block per (K/V column block, K/V head)
            s.grid[0] = static_cast<unsigned>(ceil_div(p.seqlen_k, p.block_c));
            s.grid[1] = static_cast<unsigned>(p.heads_kv);
            s.grid[2] = static_cast<unsigned>(p.batch);
            s.threads = kFa2BackwardThreads;
            break;
        default:
            break;
    }
    return s;
}

}  // namespace pyfa
