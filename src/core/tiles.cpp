// tiles.cpp: the kernel table (kernels/table.h) expanded: names, launch geometry,
// shared-memory sizes, default tiles and the choice between variants.
// pyfa/sim/tiles.py mirrors the default-tile rules; tests/test_tiles.py holds them equal.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/score.h"
#include "common/smem.h"
#include "common/tiling.h"
#include "kernels/table.h"
#include "core/internal.h"

namespace pyfa {

namespace {

// (grid x, grid y): x the Q tiles, the K/V tiles or 1; y the query heads or the K/V heads
// (a kernel that serves a K/V head's whole group of query heads).
enum Grid { kGridQTiles, kGridKvTilesKvHeads, kGridHeads, kGridKvHeads };

struct Row {
    int id;
    const char* name;
    int kernel, variant, d, br, bc;
    Grid grid;
};

#define PYFA_KERNEL_ROW(ID, NAME, KERNEL, VARIANT, D, BR, BC, FN, LAYOUT, THREADS, GRID) \
    Row{ID, NAME, KERNEL, VARIANT, D, BR, BC, GRID},
const Row kRows[] = {PYFA_KERNEL_TABLE(PYFA_KERNEL_ROW)};
#undef PYFA_KERNEL_ROW
static_assert(sizeof(kRows) / sizeof(kRows[0]) == kKernelRows, "kKernelRows counts the table");

const Row* row_of(int id) {
    if (id < 0 || id >= kKernelRows || kRows[id].id != id) return nullptr;
    return &kRows[id];
}

bool layout_of(int id, int64_t Br, int64_t Bc, int64_t d, SmemLayout* L) {
    switch (id) {
#define PYFA_KERNEL_LAYOUT(ID, NAME, KERNEL, VARIANT, D, BR, BC, FN, LAYOUT, THREADS, GRID) \
    case ID: *L = LAYOUT(Br, Bc, d); return true;
        PYFA_KERNEL_TABLE(PYFA_KERNEL_LAYOUT)
#undef PYFA_KERNEL_LAYOUT
    }
    return false;
}

unsigned threads_of(int id, int64_t Br) {
    switch (id) {
#define PYFA_KERNEL_THREADS(ID, NAME, KERNEL, VARIANT, D, BR, BC, FN, LAYOUT, THREADS, GRID) \
    case ID: return static_cast<unsigned>(THREADS);
        PYFA_KERNEL_TABLE(PYFA_KERNEL_THREADS)
#undef PYFA_KERNEL_THREADS
    }
    return 0;
}

}  // namespace

const char* kernel_name(int kernel) {
    const Row* r = row_of(kernel);
    return r ? r->name : "unknown kernel";
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
// time, Br following it down whenever it would exceed Bc, until the layout fits. A side
// the caller fixed (fixed_br, fixed_bc > 0) stays as given and only the other one moves:
// Bc starts from the paper's value, Br from min(Bc, d).
static pyfa_status fa1_default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile,
                                     int fixed_br, int fixed_bc, int* Br, int* Bc) {
    const int64_t limit = profile.smem_per_block;
    const int64_t M = limit / static_cast<int64_t>(sizeof(float));
    // Bc may not exceed what a pyfa_config can hold; far below that it no longer fits.
    int64_t c = fixed_bc ? fixed_bc : min64(max64(1, ceil_div(M, 4 * d)), INT32_MAX);
    int64_t r = fixed_br ? fixed_br : min64(c, d);
    while (!smem_fits(kernel, r, c, d, limit)) {
        if (!fixed_bc && c > 1) {
            --c;
            if (!fixed_br) r = min64(r, c);
        } else if (!fixed_br && r > 1) {
            --r;
        } else {
            break;
        }
    }
    if (!fixed_br && !fixed_bc && !smem_fits(kernel, r, c, d, limit))
        return fail(PYFA_ERROR_TILE_TOO_LARGE, "%s: even 1 x 1 tiles at head_dim=%lld do not fit in %lld bytes",
                    kernel_name(kernel), static_cast<long long>(d), static_cast<long long>(limit));
    *Br = static_cast<int>(r);
    *Bc = static_cast<int>(c);
    return PYFA_OK;
}

// Start from 64 x 64 and halve both until the tiles fit the device's shared memory; a
// side the caller fixed (> 0) stays, and the other is halved alone. Tiles that still do
// not fit with the free side at 1 are returned as they are, for the caller's size check
// to refuse with the full breakdown.
pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int fixed_br,
                          int fixed_bc, int* Br, int* Bc) {
    if (!row_of(kernel) || row_of(kernel)->variant != PYFA_VARIANT_REFERENCE)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "kernel: unknown kernel %d", kernel);
    if (d < 1)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "head_dim: must be >= 1, got %lld", static_cast<long long>(d));
    if (fixed_br && fixed_bc) {
        *Br = fixed_br;
        *Bc = fixed_bc;
        return PYFA_OK;
    }
    if (kernel == PYFA_KERNEL_FA1_FORWARD || kernel == PYFA_KERNEL_FA1_BACKWARD)
        return fa1_default_tiles(kernel, d, profile, fixed_br, fixed_bc, Br, Bc);
    const int64_t limit = profile.smem_per_block;
    int r = fixed_br ? fixed_br : 64, c = fixed_bc ? fixed_bc : 64;
    while (!smem_fits(kernel, r, c, d, limit) && (fixed_br ? c : r) > 1) {
        if (!fixed_br) r /= 2;
        if (!fixed_bc) c /= 2;
    }
    if (!fixed_br && !fixed_bc && !smem_fits(kernel, r, c, d, limit))
        return fail(PYFA_ERROR_TILE_TOO_LARGE, "%s: even 1 x 1 tiles at head_dim=%lld do not fit in %lld bytes",
                    kernel_name(kernel), static_cast<long long>(d), static_cast<long long>(limit));
    *Br = r;
    *Bc = c;
    return PYFA_OK;
}

pyfa_status default_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int* Br, int* Bc) {
    return default_tiles(kernel, d, profile, 0, 0, Br, Bc);
}

LaunchShape launch_shape(int kernel, const AttentionParams& p) {
    LaunchShape s{};
    const Row* row = row_of(kernel);
    if (!row) return s;
    s.smem_bytes = smem_bytes(kernel, p.block_r, p.block_c, p.head_dim);
    s.threads = threads_of(kernel, p.block_r);
    switch (row->grid) {
        case kGridQTiles: s.grid[0] = static_cast<unsigned>(ceil_div(p.seqlen_q * p.packed_heads(), p.block_r)); break;
        case kGridKvTilesKvHeads: s.grid[0] = static_cast<unsigned>(ceil_div(p.seqlen_k, p.block_c)); break;
        case kGridHeads:  // one block per (head, batch): FA1's parallelism
        case kGridKvHeads: s.grid[0] = 1; break;
    }
    const bool kv = row->grid == kGridKvTilesKvHeads || row->grid == kGridKvHeads || p.pack_gqa;
    s.grid[1] = static_cast<unsigned>(kv ? p.heads_kv : p.heads);
    s.grid[2] = static_cast<unsigned>(p.batch);
    return s;
}

// Packing a group's rows into shared Q tiles pays where it takes fewer blocks, each of
// which reads its K/V tiles once: G heads of Nq rows need ceil(G*Nq/Br) tiles, not
// G*ceil(Nq/Br), fewer wherever a head's last tile is part empty (decoding's Nq = 1 fills
// 1 row of Br, and G heads take 1 tile, not G). It costs parallelism, so
// it is taken only while the packed grid still holds 4 blocks per SM, enough resident
// blocks for the loads of some to run behind the arithmetic of others; below that the
// G-fold re-reads (mostly L2 hits) cost less than idle SMs.
bool pack_gqa(int64_t B, int64_t H, int64_t Hkv, int64_t Nq, int64_t Br, int64_t chunks, int sm_count) {
    const int64_t G = H / Hkv, packed = ceil_div(G * Nq, Br);
    if (G <= 1 || packed >= G * ceil_div(Nq, Br)) return false;
    return B * Hkv * max64(chunks, 1) * packed >= 4 * static_cast<int64_t>(sm_count);
}

namespace {

// The fast row for `kernel` at head dim d with the asked tiles (0: any) that fits the
// device, the one with the most rows per tile, and of rows with the same tiles (the same
// bits) the one with the most shared memory: more copy stages, so more of the copies run
// behind the arithmetic; nullptr if none. *why names what is
// missing when there is none.
const Row* fast_row(int kernel, int64_t d, int want_br, int want_bc, const pyfa_device_profile& profile,
                    char* why, size_t why_size) {
    const Row* best = nullptr;
    bool any = false, any_d = false, any_tiles = false;
    char dims[64] = "", tiles[96] = "";
    size_t nd = 0, nt = 0;
    for (const Row& r : kRows) {
        if (r.kernel != kernel || r.variant != PYFA_VARIANT_FAST) continue;
        char dim[16];
        std::snprintf(dim, sizeof(dim), "%d", r.d);
        if (!any || std::strstr(dims, dim) == nullptr)
            nd += std::snprintf(dims + nd, sizeof(dims) - nd, "%s%d", any ? ", " : "", r.d);
        any = true;
        if (r.d != d) continue;
        nt += std::snprintf(tiles + nt, sizeof(tiles) - nt, "%s%dx%d", any_d ? ", " : "", r.br, r.bc);
        any_d = true;
        if ((want_br && want_br != r.br) || (want_bc && want_bc != r.bc)) continue;
        any_tiles = true;
        if (!smem_fits(r.id, r.br, r.bc, r.d, profile.smem_per_block)) continue;
        if (!best || r.br > best->br ||
            (r.br == best->br && smem_bytes(r.id, r.br, r.bc, r.d) > smem_bytes(best->id, best->br, best->bc, best->d)))
            best = &r;
    }
    if (best) return best;
    const char* name = kernel_name(kernel);
    if (!any)
        std::snprintf(why, why_size, "%s has no fast variant yet", name);
    else if (!any_d)
        std::snprintf(why, why_size, "the fast %s is compiled for head_dim %s, not %lld", name, dims,
                      static_cast<long long>(d));
    else if (!any_tiles)
        std::snprintf(why, why_size, "the fast %s at head_dim=%lld has tiles (block_r x block_c) %s, not %dx%d",
                      name, static_cast<long long>(d), tiles, want_br, want_bc);
    else
        std::snprintf(why, why_size, "the fast %s's tiles at head_dim=%lld do not fit in %s's %lld bytes of "
                      "shared memory per block", name, static_cast<long long>(d), profile.name,
                      static_cast<long long>(profile.smem_per_block));
    return nullptr;
}

// Which tile sides a kernel's results depend on (docs/numerics.md): FA2's forward and dQ
// sum each row over K/V tiles of Bc columns and treat rows alone, so Br never changes a
// bit; the dK/dV kernel sums over Q tiles of Br rows and treats columns alone; FA1 updates
// O, l, m per (K/V tile, Q tile) pair and depends on both; the preprocess on neither.
struct TileSides {
    bool br, bc;
};
TileSides tile_sides_in_bits(int kernel) {
    switch (kernel) {
        case PYFA_KERNEL_FA2_FORWARD:
        case PYFA_KERNEL_FA2_BACKWARD_DQ: return {false, true};
        case PYFA_KERNEL_FA2_BACKWARD_DKDV: return {true, false};
        case PYFA_KERNEL_FA2_BACKWARD_PREPROCESS: return {false, false};
        default: return {true, true};
    }
}

// Variant auto gives the reference kernel's bits: a side the caller left to the default
// is pinned to the reference's default wherever it changes the results (so without tiles
// FA1, whose defaults follow the paper's rule, stays on the readable kernel unless a fast
// one has exactly those tiles). 0 leaves a side free.
// The preprocess (one dot per row, bound by memory) has one form, which serves the fast
// FA2 backward as it serves the readable one.
bool one_form(int kernel) { return kernel == PYFA_KERNEL_FA2_BACKWARD_PREPROCESS; }

// What a call asks of a kernel beyond plain masked attention (common/fast_takes.h).
unsigned fast_needs(int kernel, const AttentionParams& p) {
    // dBias is written by the kernels that visit every (i, j) once.
    const bool writes_dbias = kernel == PYFA_KERNEL_FA2_BACKWARD_DKDV || kernel == PYFA_KERNEL_FA1_BACKWARD;
    return (p.softcap != 0.0f ? kTakesSoftcap : 0u) | (p.alibi_slopes ? kTakesAlibi : 0u) |
           (p.dropout.on() ? kTakesDropout : 0u) | (p.bias ? kTakesBias : 0u) |
           (p.dbias && writes_dbias ? kTakesDbias : 0u) | (p.split_size > 0 ? kTakesSplit : 0u) |
           (p.block_table ? kTakesPages : 0u) | (p.sinks ? kTakesSinks : 0u);
}

pyfa_status auto_wanted_tiles(int kernel, int64_t d, const pyfa_device_profile& profile, int* want_br,
                              int* want_bc) {
    if (*want_br && *want_bc) return PYFA_OK;
    int r = 0, c = 0;
    const pyfa_status st = default_tiles(kernel, d, profile, *want_br, *want_bc, &r, &c);
    if (st != PYFA_OK) return st;
    const TileSides sides = tile_sides_in_bits(kernel);
    if (!*want_br && sides.br) *want_br = r;
    if (!*want_bc && sides.bc) *want_bc = c;
    return PYFA_OK;
}

}  // namespace

pyfa_status select_kernel(int kernel, int variant, const AttentionParams& p, int want_br, int want_bc,
                          bool aligned, const pyfa_device_profile& profile, int* id, int* Br, int* Bc) {
    if (variant < PYFA_VARIANT_AUTO || variant > PYFA_VARIANT_FAST)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->variant: unknown variant %d", variant);
    *id = kernel;
    if (variant == PYFA_VARIANT_REFERENCE || one_form(kernel)) return PYFA_OK;
    // A default the reference cannot size is the reference's error to report.
    if (variant == PYFA_VARIANT_AUTO && want_br >= 0 && want_bc >= 0 &&
        auto_wanted_tiles(kernel, p.head_dim, profile, &want_br, &want_bc) != PYFA_OK)
        return PYFA_OK;
    char why[256] = "";
    const Row* r = fast_row(kernel, p.head_dim, want_br, want_bc, profile, why, sizeof(why));
    // The fast kernels index inside a head with 32-bit integers.
    const TensorStrides* st[] = {&p.q_strides, &p.k_strides, &p.v_strides, &p.o_strides,
                                 &p.dout_strides, &p.dq_strides, &p.dk_strides, &p.dv_strides};
    bool small = true;
    for (const TensorStrides* t : st)
        small = small && t->row <= INT32_MAX / (max64(p.seqlen_q, p.seqlen_k) + 1);
    const unsigned missing = fast_needs(kernel, p) & ~fast_takes(kernel, p.head_dim);
    if (r && missing) {
        std::snprintf(why, sizeof(why), "the fast %s at head_dim %lld takes no %s",
                      kernel_name(kernel), static_cast<long long>(p.head_dim), fast_takes_name(missing));
        r = nullptr;
    } else if (r && !aligned)
        std::snprintf(why, sizeof(why), "the fast %s needs 16-byte aligned tensors", kernel_name(kernel));
    else if (r && !small)
        std::snprintf(why, sizeof(why), "the fast %s needs row stride * seqlen < 2^31 in every tensor",
                      kernel_name(kernel));
    if (r && aligned && small) {
        *id = r->id;
        *Br = r->br;
        *Bc = r->bc;
        return PYFA_OK;
    }
    if (variant == PYFA_VARIANT_AUTO) return PYFA_OK;
    return fail(PYFA_ERROR_INVALID_ARGUMENT, "config->variant: fast: %s (variant auto runs the reference kernel)",
                why);
}

pyfa_status variant_default_tiles(int kernel, int variant, int64_t d, const pyfa_device_profile& profile,
                                  int* Br, int* Bc) {
    if (variant < PYFA_VARIANT_AUTO || variant > PYFA_VARIANT_FAST)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "variant: unknown variant %d", variant);
    if (!row_of(kernel) || row_of(kernel)->variant != PYFA_VARIANT_REFERENCE)
        return fail(PYFA_ERROR_INVALID_ARGUMENT, "kernel: unknown kernel %d", kernel);
    if (variant != PYFA_VARIANT_REFERENCE && !one_form(kernel)) {
        char why[256] = "";
        int want_br = 0, want_bc = 0;
        if (variant == PYFA_VARIANT_AUTO) {
            const pyfa_status st = auto_wanted_tiles(kernel, d, profile, &want_br, &want_bc);
            if (st != PYFA_OK) return st;
        }
        const Row* r = fast_row(kernel, d, want_br, want_bc, profile, why, sizeof(why));
        if (r) {
            *Br = r->br;
            *Bc = r->bc;
            return PYFA_OK;
        }
        if (variant == PYFA_VARIANT_FAST) return fail(PYFA_ERROR_INVALID_ARGUMENT, "variant: fast: %s", why);
    }
    return default_tiles(kernel, d, profile, Br, Bc);
}

int64_t variant_smem_bytes(int kernel, int variant, int64_t Br, int64_t Bc, int64_t d) {
    // Only a pyfa_kernel: the fast rows' ids are the library's own.
    if (!row_of(kernel) || row_of(kernel)->variant != PYFA_VARIANT_REFERENCE) return -1;
    if (variant < PYFA_VARIANT_AUTO || variant > PYFA_VARIANT_FAST) return -1;
    if (variant == PYFA_VARIANT_REFERENCE || one_form(kernel)) return smem_bytes(kernel, Br, Bc, d);
    // Of a kernel's rows at these tiles (one per number of copy stages) the least: what
    // a device must hold for the fast variant to run at all.
    int64_t least = -1;
    for (const Row& r : kRows)
        if (r.kernel == kernel && r.variant == PYFA_VARIANT_FAST && r.d == d && r.br == Br && r.bc == Bc) {
            const int64_t need = smem_bytes(r.id, Br, Bc, d);
            if (least < 0 || (need >= 0 && need < least)) least = need;
        }
    if (least >= 0) return least;
    return variant == PYFA_VARIANT_AUTO ? smem_bytes(kernel, Br, Bc, d) : -1;
}

}  // namespace pyfa
