// shuffle.cpp: warp shuffles (__shfl_*_sync) on the emulator. A lane posts its value and
// parks; when every lane of its mask has posted at the same site with the same mask, all
// results are computed at once (as PTX shfl.sync defines the source lane) and the group
// runs on. Lanes that disagree, or wait for a lane that has returned, fail the block.
#include <algorithm>

#include "backends/emu/worker.h"

namespace pyfa_emu {
namespace detail {
namespace {

inline uint32_t warp_lanes_mask(const Worker& w, unsigned warp) {
    unsigned n = std::min(32u, w.nthreads - warp * 32);
    return n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1);
}

// Source lane as PTX shfl.sync defines it; the lane itself when the source is out of range.
inline unsigned shfl_source(unsigned lane, int arg, int width, ShflMode mode) {
    unsigned b = unsigned(arg) & 31u;
    unsigned segmask = (32u - unsigned(width)) & 31u;
    unsigned min_lane = lane & segmask;
    unsigned max_lane = min_lane | (31u & ~segmask);
    int j;
    bool ok;
    switch (mode) {
        case ShflMode::Up:
            j = int(lane) - int(b);
            ok = j >= int(min_lane);
            break;
        case ShflMode::Down:
            j = int(lane + b);
            ok = j <= int(max_lane);
            break;
        case ShflMode::Xor:
            j = int(lane ^ b);
            ok = j <= int(max_lane);
            break;
        default:
            j = int(min_lane | (b & ~segmask));
            ok = j <= int(max_lane);
            break;
    }
    return ok ? unsigned(j) : lane;
}

void put_thread_named(Msg& m, const Worker& w, unsigned id) {
    m << "thread ";
    put_thread(m, w, id);
}

}  // namespace

void shfl_arrived(Worker& w, unsigned id) {
    Fiber& f = w.fibers[id];
    unsigned warp = id / 32, lane = id % 32, base = warp * 32;
    uint32_t exist = warp_lanes_mask(w, warp);
    uint32_t group = f.mask & exist;
    if (!(f.mask >> lane & 1u)) {
        Msg m = w.fail(Error::Divergence);
        put_thread_named(m, w, id);
        m << " calls a shuffle at " << Site{f.file, f.line} << " with mask " << Hex32{f.mask}
          << ", which does not include its own lane " << lane;
        return;
    }
    if (f.width < 1 || f.width > 32 || (f.width & (f.width - 1)) != 0) {
        Msg m = w.fail(Error::Divergence);
        put_thread_named(m, w, id);
        m << ": shuffle at " << Site{f.file, f.line} << " has width " << f.width
          << " (must be a power of 2 up to 32)";
        return;
    }
    unsigned arrived = 0;
    for (unsigned j = 0; j < 32; ++j) {
        if (!(exist >> j & 1u)) break;
        const Fiber& g = w.fibers[base + j];
        bool g_in_f = group >> j & 1u;
        if (g_in_f && g.state == State::Done) {
            Msg m = w.fail(Error::Divergence);
            put_thread_named(m, w, id);
            m << " waits at a shuffle at " << Site{f.file, f.line} << " (mask " << Hex32{f.mask}
              << ") for ";
            put_thread_named(m, w, base + j);
            m << ", which has returned";
            return;
        }
        if (g.state != State::Shfl) continue;
        bool f_in_g = g.mask >> lane & 1u;
        if ((g_in_f || f_in_g) && (g.mask != f.mask || !same_site(f, g))) {
            Msg m = w.fail(Error::Divergence);
            m << "lanes of warp " << warp << " are at different shuffles: ";
            put_thread_named(m, w, id);
            m << " at " << Site{f.file, f.line} << " (mask " << Hex32{f.mask} << "), ";
            put_thread_named(m, w, base + j);
            m << " at " << Site{g.file, g.line} << " (mask " << Hex32{g.mask} << ")";
            return;
        }
        if (g_in_f) ++arrived;
    }
    if (arrived != unsigned(__builtin_popcount(group))) return;
    // Everyone has posted: compute all results before any lane runs on.
    for (unsigned j = 0; j < 32; ++j) {
        if (!(group >> j & 1u)) continue;
        Fiber& g = w.fibers[base + j];
        unsigned src = shfl_source(j, g.lane_arg, g.width, g.mode);
        g.result = (group >> src & 1u) ? w.fibers[base + src].value : kPoison;
    }
    for (unsigned j = 0; j < 32; ++j) {
        if (!(group >> j & 1u)) continue;
        w.fibers[base + j].state = State::Runnable;
        ++w.runnable;
    }
    if (w.strict) strict_warp_sync(w, warp, group);
}

void shfl_check_returned(Worker& w, unsigned id) {
    unsigned warp = id / 32, lane = id % 32, base = warp * 32;
    uint32_t exist = warp_lanes_mask(w, warp);
    for (unsigned j = 0; j < 32 && (exist >> j & 1u); ++j) {
        const Fiber& g = w.fibers[base + j];
        if (g.state == State::Shfl && (g.mask >> lane & 1u)) {
            Msg m = w.fail(Error::Divergence);
            put_thread_named(m, w, base + j);
            m << " waits at a shuffle at " << Site{g.file, g.line} << " (mask " << Hex32{g.mask}
              << ") for ";
            put_thread_named(m, w, id);
            m << ", which has returned";
            return;
        }
    }
}

}  // namespace detail

uint32_t shfl(uint32_t mask, uint32_t value, int lane_arg, int width, ShflMode mode,
              const char* file, int line) {
    using namespace detail;
    Worker* w = t_worker;
    if (!w || !w->current) return value;
    Fiber* f = w->current;
    f->state = State::Shfl;
    f->mask = mask;
    f->value = value;
    f->lane_arg = lane_arg;
    f->width = width;
    f->mode = mode;
    f->file = file;
    f->line = line;
    park(w, f);
    return f->result;
}

}  // namespace pyfa_emu
