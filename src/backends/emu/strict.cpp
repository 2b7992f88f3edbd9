// strict.cpp: the emulator's strict mode (strict.h): the access record, the checks, and
// the hooks the instrumented kernels call.
//
// The record, per 4-byte word of the block's shared memory: the last write (thread,
// barrier epoch, warp-sync generation, site), the reads since it in the current epoch
// (the last reader, and a summary of the others: their warp, or "several", and the
// latest generation), whether any thread wrote it, and the cp.async in flight into it.
// The epoch counts the block's __syncthreads; the generation counts the full-warp syncs
// of each warp (a shuffle or __syncwarp that every lane of the warp takes part in). Two
// accesses by different threads are ordered when a __syncthreads lies between them, or,
// for two lanes of one warp, a full-warp sync. Every lane of a warp, and every thread of
// the block, is always in the same generation and epoch (they are rendezvous), so the
// record needs no vector clocks.
#include "backends/emu/strict.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "backends/emu/worker.h"

namespace pyfa_emu {
namespace detail {
namespace {

constexpr uint16_t kNoWarp = 0xFFFF;     // no other reader
constexpr uint16_t kManyWarps = 0xFFFE;  // readers in more than one warp
constexpr unsigned kGroupRing = 64;      // cp.async groups per thread whose wait is remembered

// Where an access came from: a source line (the vector and cp.async hooks know theirs) or
// the address of the instrumented instruction.
struct Where {
    const void* at = nullptr;  // a file name when line > 0, else a code address
    int line = 0;
};

struct WordRec {
    uint32_t stamp;      // the block this record belongs to; any other means "fresh"
    uint32_t w_epoch, w_gen, r_epoch, r1_gen, rx_gen;
    uint32_t a_group;    // cp.async in flight: its group (0: none)
    uint32_t u_epoch, u_gen;  // the first read while no thread had written the word (0: none)
    uint16_t w_tid, r1_tid, rx_tid, rx_warp, a_tid, u_tid;
    uint8_t written;
    Where w_at, r_at, a_at, u_at;
};

}  // namespace

struct StrictBlock {
    size_t words = 0;
    unsigned nthreads = 0;
    std::unique_ptr<WordRec[]> rec;
    uint32_t stamp = 0;
    uint32_t epoch = 1;
    const char* epoch_file = nullptr;  // the __syncthreads that began the epoch
    int epoch_line = 0;
    std::unique_ptr<uint32_t[]> gen;        // per warp
    std::unique_ptr<uint32_t[]> committed;  // per thread: cp.async groups committed
    std::unique_ptr<uint32_t[]> waited;     // per thread: groups up to this one are complete
    std::unique_ptr<uint32_t[]> wait_epoch; // per thread, kGroupRing: the epoch of each group's wait
};

void StrictBlockDeleter::operator()(StrictBlock* b) const noexcept { delete b; }

namespace {

// Paths from the source tree's src/ on.
const char* short_path(const char* file) {
    if (!file) return "?";
    const char* best = file;
    for (const char* p = file; (p = std::strstr(p, "src/")) != nullptr; ++p) best = p + 4;
    return best;
}

void put_where(Msg& m, Where w) {
    if (w.line > 0) {
        m << short_path(static_cast<const char*>(w.at)) << ":" << w.line;
        return;
    }
    Dl_info info;
    if (w.at && dladdr(w.at, &info) && info.dli_fbase) {
        const char* name = info.dli_fname ? std::strrchr(info.dli_fname, '/') : nullptr;
        name = name ? name + 1 : (info.dli_fname ? info.dli_fname : "?");
        const uintptr_t off = reinterpret_cast<uintptr_t>(w.at) - reinterpret_cast<uintptr_t>(info.dli_fbase);
        m << "code " << name << "+" << Hex32{uint32_t(off)};
        return;
    }
    m << "code ?";
}

void put_tid(Msg& m, const Worker& w, unsigned id) {
    m << "thread ";
    put_thread(m, w, id);
    m << " (warp " << id / 32 << ")";
}

void put_epoch(Msg& m, const StrictBlock& B) {
    if (B.epoch_file)
        m << "since the __syncthreads at " << short_path(B.epoch_file) << ":" << B.epoch_line;
    else
        m << "since the block began";
}

// "K_j[3, 17] (shared memory, float 1234)".
void put_shared_word(Msg& m, const StrictSession& S, size_t word) {
    for (int i = 0; i < S.term_count(); ++i) {
        const StrictSession::Term& t = S.term(i);
        if (int64_t(word) < t.offset || int64_t(word) >= t.offset + t.floats) continue;
        const int64_t k = int64_t(word) - t.offset, width = std::max<int64_t>(1, t.width);
        m << "shared " << t.name << "[" << k / width << ", " << k % width << "] (float " << word
          << " of dynamic shared memory)";
        return;
    }
    m << "shared memory float " << word << " (in no term of the layout)";
}

Msg hazard(Worker& w, const char* check) {
    Msg m = w.fail(Error::Hazard);
    m << "check " << check << " in " << w.strict->kernel() << ": ";
    return m;
}

inline unsigned current_tid(const Worker& w) { return unsigned(w.current - w.fibers.get()); }

inline WordRec& word(StrictBlock& B, size_t k) {
    WordRec& r = B.rec[k];
    if (r.stamp != B.stamp) {
        std::memset(static_cast<void*>(&r), 0, sizeof r);
        r.stamp = B.stamp;
        r.rx_warp = kNoWarp;
    }
    return r;
}

inline bool ordered(unsigned a_tid, uint32_t a_epoch, uint32_t a_gen, unsigned b_tid, uint32_t epoch,
                    const StrictBlock& B) {
    if (a_epoch != epoch || a_tid == b_tid) return true;
    return a_tid / 32 == b_tid / 32 && a_gen < B.gen[b_tid / 32];
}

uint32_t group_wait_epoch(const StrictBlock& B, unsigned t, uint32_t g) {
    if (B.waited[t] >= g + kGroupRing) return 0;  // long complete
    return B.wait_epoch[size_t(t) * kGroupRing + g % kGroupRing];
}

// The copy in flight into r, as thread u sees it: complete once its issuer waited for its
// group and, for any other thread, a __syncthreads followed the wait.
bool copy_done(const StrictBlock& B, const WordRec& r, unsigned u) {
    if (B.waited[r.a_tid] < r.a_group) return false;
    return u == r.a_tid || B.epoch > group_wait_epoch(B, r.a_tid, r.a_group);
}

// The completed copy becomes the issuer's write at the time of its wait.
void settle(StrictBlock& B, WordRec& r) {
    r.w_epoch = group_wait_epoch(B, r.a_tid, r.a_group);
    r.w_gen = 0;
    r.w_tid = r.a_tid;
    r.w_at = r.a_at;
    r.a_group = 0;
}

void report_in_flight(Worker& w, StrictBlock& B, const WordRec& r, size_t k, unsigned u, const char* what,
                      Where at) {
    Msg m = hazard(w, "async");
    put_tid(m, w, u);
    m << " " << what << " ";
    put_shared_word(m, *w.strict, k);
    m << " at ";
    put_where(m, at);
    m << " while the cp.async of ";
    put_tid(m, w, r.a_tid);
    m << " at ";
    put_where(m, r.a_at);
    m << " (group " << r.a_group << ") is in flight: ";
    if (B.waited[r.a_tid] < r.a_group)
        m << "its issuer has waited for groups up to " << B.waited[r.a_tid] << " only (committed "
          << B.committed[r.a_tid] << ")";
    else
        m << "its issuer waited for it, but no __syncthreads has followed the wait";
}

void report_race(Worker& w, StrictBlock& B, size_t k, unsigned u, bool write, Where at, unsigned other,
                 bool other_wrote, Where other_at) {
    Msg m = hazard(w, "race");
    put_shared_word(m, *w.strict, k);
    m << ": ";
    put_tid(m, w, u);
    m << (write ? " writes it" : " reads it") << " at ";
    put_where(m, at);
    m << " and ";
    put_tid(m, w, other);
    m << (other_wrote ? " wrote it" : " read it") << " at ";
    put_where(m, other_at);
    m << " with no barrier between them (both ";
    put_epoch(m, B);
    m << ")";
}

// One access of thread u to shared word k.
void report_uninitialised(Worker& w, const WordRec& r, size_t k) {
    Msg m = hazard(w, "init");
    put_tid(m, w, r.u_tid);
    m << " reads ";
    put_shared_word(m, *w.strict, k);
    m << " at ";
    put_where(m, r.u_at);
    m << " before any thread of the block has written it";
}

// A read of a word no thread has written yet is an init hazard only once it is clear that
// no concurrent write follows it (that would be a race instead, whichever order the
// threads ran in): when the first write comes ordered after it, or the block ends.
void shared_word(Worker& w, StrictBlock& B, size_t k, bool write, Where at) {
    const unsigned u = current_tid(w);
    const unsigned warp = u / 32;
    const uint32_t epoch = B.epoch, gen = B.gen[warp];
    WordRec& r = word(B, k);
    if (r.a_group) {
        if (!copy_done(B, r, u)) {
            report_in_flight(w, B, r, k, u, write ? "writes" : "reads", at);
            return;
        }
        settle(B, r);
    }
    if (r.w_epoch && !ordered(r.w_tid, r.w_epoch, r.w_gen, u, epoch, B)) {
        report_race(w, B, k, u, write, at, r.w_tid, true, r.w_at);
        return;
    }
    if (write) {
        if (r.r_epoch == epoch) {
            if (!ordered(r.r1_tid, r.r_epoch, r.r1_gen, u, epoch, B)) {
                report_race(w, B, k, u, true, at, r.r1_tid, false, r.r_at);
                return;
            }
            if (r.rx_warp != kNoWarp && !(r.rx_warp == warp && r.rx_gen < gen) && r.rx_tid != u) {
                report_race(w, B, k, u, true, at, r.rx_tid, false, Where{});
                return;
            }
        }
        if (r.u_epoch) {
            report_uninitialised(w, r, k);
            return;
        }
        r.w_epoch = epoch;
        r.w_gen = gen;
        r.w_tid = uint16_t(u);
        r.w_at = at;
        r.written = 1;
        r.r_epoch = 0;
        r.rx_warp = kNoWarp;
        return;
    }
    if (!r.written && !r.u_epoch) {
        r.u_epoch = epoch;
        r.u_gen = gen;
        r.u_tid = uint16_t(u);
        r.u_at = at;
    }
    if (r.r_epoch != epoch) {
        r.r_epoch = epoch;
        r.r1_tid = uint16_t(u);
        r.r1_gen = gen;
        r.r_at = at;
        r.rx_warp = kNoWarp;
        r.rx_gen = 0;
    } else if (r.r1_tid == u) {
        r.r1_gen = gen;
        r.r_at = at;
    } else {
        const uint16_t w1 = uint16_t(r.r1_tid / 32);
        r.rx_warp = (r.rx_warp == kNoWarp || r.rx_warp == w1) ? w1 : kManyWarps;
        r.rx_gen = std::max(r.rx_gen, r.r1_gen);
        r.rx_tid = r.r1_tid;
        r.r1_tid = uint16_t(u);
        r.r1_gen = gen;
        r.r_at = at;
    }
}

const char* kind_of(bool write) { return write ? "write" : "read"; }

// An access to [a, a + n) that lies within shared memory or its red zones.
void shared_access(Worker& w, StrictBlock& B, uintptr_t a, size_t n, bool write, Where at, bool vector) {
    const uintptr_t s0 = reinterpret_cast<uintptr_t>(w.smem);
    const uintptr_t s1 = s0 + w.smem_bytes;
    if (a < s0 || a + n > s1) {
        Msg m = hazard(w, "bounds");
        put_tid(m, w, current_tid(w));
        m << ": " << n << "-byte " << kind_of(write) << " at byte ";
        if (a < s0)
            m << "-" << (s0 - a);
        else
            m << (a - s0);
        m << " of dynamic shared memory, outside the " << w.smem_bytes << " bytes the kernel was launched with, at ";
        put_where(m, at);
        return;
    }
    if ((vector || n == 8 || n == 16) && a % n) {
        Msg m = hazard(w, "align");
        put_tid(m, w, current_tid(w));
        m << ": " << n << "-byte " << kind_of(write) << " of ";
        put_shared_word(m, *w.strict, (a - s0) / 4);
        m << " at ";
        put_where(m, at);
        m << ": byte offset " << (a - s0) << " is not a multiple of " << n;
        return;
    }
    for (size_t k = (a - s0) / 4, end = (a + n - 1 - s0) / 4; k <= end && !w.failed(); ++k)
        shared_word(w, B, k, write, at);
}

// Element k of tensor T as (b, h, n, x) when the strides decompose it, else its offset.
void put_element(Msg& m, const StrictSession::Tensor& T, int64_t k) {
    int order[3] = {0, 1, 2};
    std::sort(order, order + 3, [&](int a, int b) { return T.strides[a] > T.strides[b]; });
    int64_t idx[4] = {}, rest = k;
    for (int o : order) {
        if (T.strides[o] <= 0) continue;
        idx[o] = rest / T.strides[o];
        rest %= T.strides[o];
    }
    idx[3] = rest;
    bool ok = k >= 0;
    for (int i = 0; i < 4 && ok; ++i) ok = idx[i] >= 0 && idx[i] < T.dims[i];
    if (ok)
        m << T.name << "[" << idx[0] << ", " << idx[1] << ", " << idx[2] << ", " << idx[3] << "]";
    else
        m << T.name << " at element offset " << k;
}

void put_shape(Msg& m, const StrictSession::Tensor& T) {
    m << " (shape (" << T.dims[0] << ", " << T.dims[1] << ", " << T.dims[2] << ", " << T.dims[3]
      << "), strides (" << T.strides[0] << ", " << T.strides[1] << ", " << T.strides[2] << ", 1))";
}

void global_access(Worker& w, StrictSession::Tensor& T, uintptr_t a, size_t n, bool write, Where at,
                   bool vector) {
    const unsigned u = current_tid(w);
    const intptr_t rel = intptr_t(a) - intptr_t(T.lo);
    const int64_t first = rel >= 0 ? rel / 4 : -((-rel + 3) / 4);
    if (a < T.lo || a + n > T.hi) {
        Msg m = hazard(w, "bounds");
        put_tid(m, w, u);
        m << ": " << n << "-byte " << kind_of(write) << " of " << T.name << " at element offset " << first
          << ", " << (a < T.lo ? "before its first element" : "past its last element") << " (offset "
          << T.span - 1 << ")";
        put_shape(m, T);
        m << ", at ";
        put_where(m, at);
        return;
    }
    if ((vector || n == 8 || n == 16) ? a % n : a % 4) {
        Msg m = hazard(w, "align");
        put_tid(m, w, u);
        m << ": " << n << "-byte " << kind_of(write) << " of ";
        put_element(m, T, first);
        m << " at ";
        put_where(m, at);
        m << ": address " << Hex32{uint32_t(reinterpret_cast<uintptr_t>(T.user) + uintptr_t(rel))}
          << " (low 32 bits, in the caller's tensor) is not a multiple of " << (vector ? n : 4);
        return;
    }
    for (int64_t k = first, end = (rel + int64_t(n) - 1) / 4; k <= end; ++k) {
        std::atomic<uint8_t>& s = T.shadow[size_t(k)];
        const uint8_t bits = s.load(std::memory_order_relaxed);
        if (!(bits & 1) || (write && !T.output)) {
            Msg m = hazard(w, "bounds");
            put_tid(m, w, u);
            m << ": " << kind_of(write) << " of " << T.name << " at element offset " << k;
            if (bits & 1)
                m << ", an input of this kernel";
            else
                m << ", which is not an element of it";
            put_shape(m, T);
            m << ", at ";
            put_where(m, at);
            return;
        }
        if (write) {
            if (!(bits & 2)) s.fetch_or(2, std::memory_order_relaxed);
        } else if (T.output && !(bits & 2)) {
            Msg m = hazard(w, "init");
            put_tid(m, w, u);
            m << " reads ";
            put_element(m, T, k);
            m << " at ";
            put_where(m, at);
            m << ", an output no thread of this launch has written";
            return;
        }
    }
}

// Every access of a strict launch's kernel code comes here.
void access(const void* p, size_t n, bool write, Where at, bool vector) {
    Worker* w = t_worker;
    if (!w || !w->strict || !w->current || w->failed()) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t s0 = reinterpret_cast<uintptr_t>(w->smem);
    if (a + n > s0 - w->smem_pad && a < s0 + w->smem_bytes + w->smem_pad) {
        shared_access(*w, *w->strict_block, a, n, write, at, vector);
        return;
    }
    StrictSession& S = *w->strict;
    for (int i = 0; i < S.tensor_count(); ++i) {
        StrictSession::Tensor& T = S.tensor(i);
        if (T.copy && a + n > T.lo - kStrictRedZoneBytes && a < T.hi + kStrictRedZoneBytes) {
            global_access(*w, T, a, n, write, at, vector);
            return;
        }
    }
}

inline Where code(const void* pc) { return Where{pc, 0}; }

}  // namespace

bool strict_attach(Worker& w, unsigned nthreads, size_t smem_bytes) noexcept {
    StrictBlock* B = w.strict_block.get();
    if (!B) {
        B = new (std::nothrow) StrictBlock;
        if (!B) return false;
        w.strict_block.reset(B);
    }
    const size_t words = (smem_bytes + 3) / 4;
    if (B->words < words || !B->rec) {
        B->rec.reset(new (std::nothrow) WordRec[std::max<size_t>(words, 1)]);
        if (!B->rec) return false;
        std::memset(static_cast<void*>(B->rec.get()), 0, sizeof(WordRec) * std::max<size_t>(words, 1));
        B->words = words;
        B->stamp = 0;
    }
    if (B->nthreads < nthreads || !B->committed) {
        const unsigned warps = (nthreads + 31) / 32;
        B->gen.reset(new (std::nothrow) uint32_t[warps]);
        B->committed.reset(new (std::nothrow) uint32_t[nthreads]);
        B->waited.reset(new (std::nothrow) uint32_t[nthreads]);
        B->wait_epoch.reset(new (std::nothrow) uint32_t[size_t(nthreads) * kGroupRing]);
        if (!B->gen || !B->committed || !B->waited || !B->wait_epoch) {
            B->committed.reset();
            return false;
        }
        B->nthreads = nthreads;
    }
    return true;
}

void strict_block_begin(Worker& w) noexcept {
    StrictBlock& B = *w.strict_block;
    if (++B.stamp == 0) {
        std::memset(static_cast<void*>(B.rec.get()), 0, sizeof(WordRec) * std::max<size_t>(B.words, 1));
        B.stamp = 1;
    }
    B.epoch = 1;
    B.epoch_file = nullptr;
    B.epoch_line = 0;
    const unsigned n = w.nthreads, warps = (n + 31) / 32;
    std::fill(B.gen.get(), B.gen.get() + warps, 1u);
    std::fill(B.committed.get(), B.committed.get() + n, 0u);
    std::fill(B.waited.get(), B.waited.get() + n, 0u);
    std::fill(B.wait_epoch.get(), B.wait_epoch.get() + size_t(n) * kGroupRing, 0u);
}

bool strict_block_end(Worker& w) noexcept {
    StrictBlock& B = *w.strict_block;
    for (size_t k = 0; k < B.words; ++k) {
        const WordRec& r = B.rec[k];
        if (r.stamp == B.stamp && r.u_epoch) {
            report_uninitialised(w, r, k);
            return false;
        }
    }
    return true;
}

bool strict_barrier(Worker& w, const char* file, int line) noexcept {
    if (w.live < w.nthreads) {
        Msg m = hazard(w, "barrier");
        m << "the __syncthreads at " << short_path(file) << ":" << line << " is not reached by every thread: ";
        unsigned shown = 0;
        for (unsigned i = 0; i < w.nthreads && shown < 8; ++i) {
            if (w.fibers[i].state != State::Done) continue;
            m << (shown ? ", " : "threads ");
            put_thread(m, w, i);
            ++shown;
        }
        m << (shown == 8 ? ", ... have returned" : " have returned");
        return false;
    }
    StrictBlock& B = *w.strict_block;
    ++B.epoch;
    B.epoch_file = file;
    B.epoch_line = line;
    return true;
}

void strict_warp_sync(Worker& w, unsigned warp, uint32_t group) noexcept {
    const unsigned lanes = std::min(32u, w.nthreads - warp * 32);
    const uint32_t all = lanes == 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1);
    if (group == all) ++w.strict_block->gen[warp];
}

}  // namespace detail

// ---------------------------------------------------------------------------------------
// The session.
// ---------------------------------------------------------------------------------------
StrictSession::~StrictSession() {
    for (int i = 0; i < ntensors_; ++i) std::free(tensors_[i].raw);
}

float* StrictSession::add_tensor(const char* name, float* data, const int64_t dims[4],
                                 const int64_t strides[3], bool output) noexcept {
    if (!data) return data;
    for (int i = 0; i < 4; ++i)
        if (dims[i] <= 0) return data;
    for (int i = 0; i < 3; ++i)
        if (strides[i] < 0) return nullptr;
    if (ntensors_ == kMaxTensors) return nullptr;
    Tensor& T = tensors_[ntensors_];
    T.name = name;
    T.user = data;
    T.output = output;
    for (int i = 0; i < 4; ++i) T.dims[i] = dims[i];
    for (int i = 0; i < 3; ++i) T.strides[i] = strides[i];
    T.strides[3] = 1;
    T.span = (dims[0] - 1) * strides[0] + (dims[1] - 1) * strides[1] + (dims[2] - 1) * strides[2] + dims[3];
    const size_t bytes = size_t(T.span) * sizeof(float);
    // The copy keeps the caller's address modulo 64, so alignment is checked as it is.
    const size_t phase = reinterpret_cast<uintptr_t>(data) % 64;
    T.raw = static_cast<unsigned char*>(std::malloc(bytes + 2 * kStrictRedZoneBytes + 128));
    T.shadow.reset(new (std::nothrow) std::atomic<uint8_t>[size_t(T.span)]());
    if (!T.raw || !T.shadow) {
        std::free(T.raw);
        T.raw = nullptr;
        T.shadow.reset();
        return nullptr;
    }
    uintptr_t base = reinterpret_cast<uintptr_t>(T.raw) + kStrictRedZoneBytes;
    base = (base + 63) / 64 * 64 + phase;
    T.copy = reinterpret_cast<float*>(base);
    std::memset(T.raw, 0xFF, bytes + 2 * kStrictRedZoneBytes + 128);
    std::memcpy(T.copy, data, bytes);
    T.lo = base;
    T.hi = base + bytes;
    for (int64_t b = 0; b < dims[0]; ++b)
        for (int64_t h = 0; h < dims[1]; ++h)
            for (int64_t n = 0; n < dims[2]; ++n) {
                const int64_t at = b * strides[0] + h * strides[1] + n * strides[2];
                for (int64_t x = 0; x < dims[3]; ++x) T.shadow[size_t(at + x)].store(1, std::memory_order_relaxed);
            }
    ++ntensors_;
    return T.copy;
}

void StrictSession::add_term(const char* name, int64_t offset, int64_t floats, int64_t width) noexcept {
    if (nterms_ < kMaxTerms) terms_[nterms_++] = Term{name, offset, floats, width};
}

void StrictSession::write_back() noexcept {
    for (int i = 0; i < ntensors_; ++i) {
        const Tensor& T = tensors_[i];
        if (!T.output) continue;
        for (int64_t b = 0; b < T.dims[0]; ++b)
            for (int64_t h = 0; h < T.dims[1]; ++h)
                for (int64_t n = 0; n < T.dims[2]; ++n) {
                    const int64_t at = b * T.strides[0] + h * T.strides[1] + n * T.strides[2];
                    std::memcpy(T.user + at, T.copy + at, size_t(T.dims[3]) * sizeof(float));
                }
    }
}

// ---------------------------------------------------------------------------------------
// Hooks of src/common (emu.h).
// ---------------------------------------------------------------------------------------
void strict_load(void* out, const void* p, int bytes, const char* file, int line) {
    detail::access(p, size_t(bytes), false, detail::Where{file, line}, true);
    std::memcpy(out, p, size_t(bytes));
}

void strict_store(void* p, const void* in, int bytes, const char* file, int line) {
    detail::access(p, size_t(bytes), true, detail::Where{file, line}, true);
    std::memcpy(p, in, size_t(bytes));
}

void strict_cp_async(void* dst, const void* src, bool valid, const char* file, int line) {
    using namespace detail;
    Worker* w = t_worker;
    const Where at{file, line};
    if (w && w->strict && w->current && !w->failed()) {
        const unsigned u = current_tid(*w);
        const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s0 = reinterpret_cast<uintptr_t>(w->smem);
        if (d % 16 || (valid && reinterpret_cast<uintptr_t>(src) % 16)) {
            Msg m = hazard(*w, "align");
            put_tid(m, *w, u);
            m << ": cp.async at " << short_path(file) << ":" << line << " with "
              << (d % 16 ? "destination" : "source") << " address "
              << Hex32{uint32_t(d % 16 ? d : reinterpret_cast<uintptr_t>(src))}
              << " (low 32 bits), not a multiple of 16";
            if (d % 16 && d >= s0 && d < s0 + w->smem_bytes) {
                m << ": ";
                put_shared_word(m, *w->strict, (d - s0) / 4);
            }
            return;
        }
        if (valid) access(src, 16, false, at, true);
        if (w->failed()) return;
        if (d < s0 || d + 16 > s0 + w->smem_bytes) {
            shared_access(*w, *w->strict_block, d, 16, true, at, true);  // reports bounds
            if (w->failed()) return;
        }
        StrictBlock& B = *w->strict_block;
        for (size_t k = (d - s0) / 4; k < (d - s0) / 4 + 4 && !w->failed(); ++k) {
            WordRec& r = word(B, k);
            if (r.a_group) {
                if (!copy_done(B, r, u)) {
                    report_in_flight(*w, B, r, k, u, "starts a new cp.async into", at);
                    return;
                }
                settle(B, r);
            }
            shared_word(*w, B, k, true, at);
            if (w->failed()) return;
            WordRec& q = word(B, k);
            q.a_tid = uint16_t(u);
            q.a_group = B.committed[u] + 1;
            q.a_at = at;
        }
        if (w->failed()) return;
    }
    if (valid)
        std::memcpy(dst, src, 16);
    else
        std::memset(dst, 0, 16);
}

void strict_cp_commit() {
    detail::Worker* w = detail::t_worker;
    if (w && w->strict && w->current) ++w->strict_block->committed[detail::current_tid(*w)];
}

void strict_cp_wait(int n, const char*, int) {
    using namespace detail;
    Worker* w = t_worker;
    if (!w || !w->strict || !w->current) return;
    StrictBlock& B = *w->strict_block;
    const unsigned u = current_tid(*w);
    const uint32_t c = B.committed[u];
    const uint32_t target = c > uint32_t(n) ? c - uint32_t(n) : 0;
    for (uint32_t g = std::max(B.waited[u] + 1, target >= kGroupRing ? target - kGroupRing + 1 : 1); g <= target; ++g)
        B.wait_epoch[size_t(u) * kGroupRing + g % kGroupRing] = B.epoch;
    B.waited[u] = std::max(B.waited[u], target);
}

}  // namespace pyfa_emu

// ---------------------------------------------------------------------------------------
// The compiler's instrumentation (-fsanitize=thread on emu_strict_kernels.cpp only): a
// call before every load and store of the kernels' code, with its address and size. These
// definitions stand in for the ThreadSanitizer runtime, which is never linked; hidden, so
// that a process running under the real one keeps its own.
// ---------------------------------------------------------------------------------------
// Left out of a build sanitized otherwise (CMakeLists.txt sets PYFA_EMU_STRICT_HOOKS=0):
// there GCC declares these names as built-ins of its own, with which some of them conflict.
#ifndef PYFA_EMU_STRICT_HOOKS
#define PYFA_EMU_STRICT_HOOKS 1
#endif
#if PYFA_EMU_STRICT_HOOKS
#define PYFA_STRICT_HOOK extern "C" __attribute__((visibility("hidden"))) void
#define PYFA_STRICT_ACCESS(N)                                                                      \
    PYFA_STRICT_HOOK __tsan_read##N(void* p) {                                                     \
        pyfa_emu::detail::access(p, N, false, pyfa_emu::detail::code(__builtin_return_address(0)), false); \
    }                                                                                              \
    PYFA_STRICT_HOOK __tsan_write##N(void* p) {                                                    \
        pyfa_emu::detail::access(p, N, true, pyfa_emu::detail::code(__builtin_return_address(0)), false);  \
    }                                                                                              \
    PYFA_STRICT_HOOK __tsan_unaligned_read##N(void* p) {                                           \
        pyfa_emu::detail::access(p, N, false, pyfa_emu::detail::code(__builtin_return_address(0)), false); \
    }                                                                                              \
    PYFA_STRICT_HOOK __tsan_unaligned_write##N(void* p) {                                          \
        pyfa_emu::detail::access(p, N, true, pyfa_emu::detail::code(__builtin_return_address(0)), false);  \
    }
PYFA_STRICT_ACCESS(1)
PYFA_STRICT_ACCESS(2)
PYFA_STRICT_ACCESS(4)
PYFA_STRICT_ACCESS(8)
PYFA_STRICT_ACCESS(16)
#undef PYFA_STRICT_ACCESS

PYFA_STRICT_HOOK __tsan_read_range(void* p, unsigned long n) {
    pyfa_emu::detail::access(p, n, false, pyfa_emu::detail::code(__builtin_return_address(0)), false);
}
PYFA_STRICT_HOOK __tsan_write_range(void* p, unsigned long n) {
    pyfa_emu::detail::access(p, n, true, pyfa_emu::detail::code(__builtin_return_address(0)), false);
}
PYFA_STRICT_HOOK __tsan_init() {}
PYFA_STRICT_HOOK __tsan_func_entry(void*) {}
PYFA_STRICT_HOOK __tsan_func_exit() {}
#undef PYFA_STRICT_HOOK
#endif  // PYFA_EMU_STRICT_HOOKS
