// strict.h: the emulator's strict mode (strict.cpp). A strict launch runs the kernels'
// instrumented compilation (emu_strict_kernels.cpp), in which the compiler calls a hook
// before every load and store of kernel code (GCC's and Clang's -fsanitize=thread
// instrumentation, with strict.cpp providing the hooks instead of the ThreadSanitizer
// runtime), and the vector accesses and cp.async of src/common call theirs. Each access
// is checked against an access record, never against what one thread order happened to
// do:
//   race     two accesses to a shared-memory word by different threads, one a write, with
//            no __syncthreads between them (nor, for lanes of one warp, a warp sync)
//   async    a cp.async destination read before its copy is complete for the reader (the
//            issuer waited for its group; for other threads a __syncthreads followed), a
//            write or a new copy to it while in flight
//   init     a read of shared memory no thread of the block wrote, or of an output
//            element no thread of the launch wrote
//   bounds   a global access outside its tensor's elements (pointer, shape, strides), a
//            shared access outside the launch's allocation, a write to an input tensor
//   align    8- and 16-byte accesses and cp.async off their alignment
//   barrier  a __syncthreads not reached by every thread or at different sites, a warp
//            sync whose mask does not match its lanes
// Internal to src/backends/emu.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "backends/emu/emu.h"

namespace pyfa_emu {

// Bytes below and above every tensor copy and the shared memory of a strict launch: a
// stray access that lands there is reported and harms nothing. An access further away
// from every tensor is not attributed to one and goes unchecked.
constexpr size_t kStrictRedZoneBytes = 64 * 1024;

// The tensors and shared-memory terms of one strict launch. The caller registers every
// tensor the kernel may address and launches on the copies add_tensor returns; after a
// launch that succeeded, write_back() puts the outputs' elements where the caller's are.
class StrictSession {
public:
    struct Tensor {
        const char* name = nullptr;
        float* user = nullptr;          // the caller's element (0, 0, 0, 0)
        float* copy = nullptr;          // the kernel's, inside red zones
        unsigned char* raw = nullptr;   // the copy's allocation
        int64_t dims[4] = {};           // (B, heads, N, d)
        int64_t strides[4] = {};        // elements; strides[3] is 1
        int64_t span = 0;               // elements from the first to past the last
        bool output = false;
        // Per element of the span: bit 0, an element of the tensor; bit 1, written by
        // this launch. Blocks of a launch run on several OS threads at once.
        std::unique_ptr<std::atomic<uint8_t>[]> shadow;
        uintptr_t lo = 0, hi = 0;       // the copy's span, in bytes
    };
    struct Term {
        const char* name;
        int64_t offset, floats, width;  // in floats; width: floats per row
    };
    static constexpr int kMaxTensors = 24;  // every tensor of AttentionParams (strict_params.h)
    static constexpr int kMaxTerms = 16;

    explicit StrictSession(const char* kernel) : kernel_(kernel) {}
    ~StrictSession();
    StrictSession(const StrictSession&) = delete;
    StrictSession& operator=(const StrictSession&) = delete;

    // A (dims[0], dims[1], dims[2], dims[3]) float tensor with element strides
    // strides[0..2] (the last dimension is contiguous) at `data`. Returns the address the
    // kernel must be given instead; nullptr when out of memory or out of slots. An empty
    // tensor (a zero dimension) or a null `data` is returned as it is.
    float* add_tensor(const char* name, float* data, const int64_t dims[4], const int64_t strides[3],
                      bool output) noexcept;
    void add_term(const char* name, int64_t offset, int64_t floats, int64_t width) noexcept;
    void write_back() noexcept;

    const char* kernel() const { return kernel_; }
    int tensor_count() const { return ntensors_; }
    Tensor& tensor(int i) { return tensors_[i]; }
    int term_count() const { return nterms_; }
    const Term& term(int i) const { return terms_[i]; }

private:
    const char* kernel_;
    Tensor tensors_[kMaxTensors];
    int ntensors_ = 0;
    Term terms_[kMaxTerms] = {};
    int nterms_ = 0;
};

}  // namespace pyfa_emu
