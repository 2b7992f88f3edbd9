// emu_backend.cpp: the kernels compiled as C++ and launched on the emulator (src/backends/emu).
// The kernel files are the very ones nvcc compiles in cuda_backend.cu.
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "kernels/registry.cuh"
#include "core/internal.h"

namespace pyfa {

namespace {

// Every failure here is reported from a fixed buffer, so that running out of memory is
// reported as such; if even the message cannot be stored, the status still goes back.
pyfa_status report(pyfa_status status, const char* message) noexcept {
    try {
        return fail(status, message);
    } catch (...) {
        return status;
    }
}

pyfa_status status_of(pyfa_emu::Error error) {
    switch (error) {
        case pyfa_emu::Error::None: return PYFA_OK;
        case pyfa_emu::Error::Divergence: return PYFA_ERROR_EMULATION;
        case pyfa_emu::Error::OutOfMemory: return PYFA_ERROR_OUT_OF_MEMORY;
        case pyfa_emu::Error::Cancelled: return PYFA_ERROR_CANCELLED;
        // The launcher checks every launch before it gets here, and the kernels throw
        // nothing: either is a bug of the library.
        case pyfa_emu::Error::InvalidLaunch:
        case pyfa_emu::Error::KernelException: return PYFA_ERROR_INTERNAL;
    }
    return PYFA_ERROR_INTERNAL;
}

pyfa_status emu_launch(int kernel, const AttentionParams& p, const LaunchShape& shape,
                       const pyfa_config& config) {
    char message[sizeof(pyfa_emu::LaunchResult::message) + 64];
    if (config.emu_workers < 0 || config.emu_workers > pyfa_emu::kMaxWorkers) {
        std::snprintf(message, sizeof message,
                      "config->emu_workers: expected 0 (one per core) to %d, got %d",
                      pyfa_emu::kMaxWorkers, config.emu_workers);
        return report(PYFA_ERROR_INVALID_ARGUMENT, message);
    }
    const PYFA_KERNELS::KernelFn fn = PYFA_KERNELS::kernel_fn(kernel);
    if (!fn) {
        std::snprintf(message, sizeof message, "emulator: no kernel %s", kernel_name(kernel));
        return report(PYFA_ERROR_INTERNAL, message);
    }
    pyfa_emu::LaunchOptions options;
    options.order = config.emu_order;
    options.seed = config.emu_seed;
    options.workers = config.emu_workers;
    static_assert(std::is_same<decltype(options.progress), decltype(config.progress)>::value,
                  "the emulator's progress callback is pyfa_config's");
    options.progress = config.progress;
    options.progress_user = config.progress_user;
    pyfa_emu::LaunchResult result;
    try {
        const std::function<void()> body = [fn, &p] { fn(p); };
        pyfa_emu::launch(dim3(shape.grid[0], shape.grid[1], shape.grid[2]), dim3(shape.threads),
                         static_cast<size_t>(shape.smem_bytes), options, body, &result);
    } catch (...) {  // only making the std::function can throw; launch() never does
        return report(PYFA_ERROR_OUT_OF_MEMORY, "emulator: out of memory before the launch");
    }
    if (result.error == pyfa_emu::Error::None) return PYFA_OK;
    std::snprintf(message, sizeof message, "%s: %s", kernel_name(kernel), result.message);
    return report(status_of(result.error), message);
}

// Host memory, the kernel table's kernels launched one by one; the emulator asks
// config->progress itself, between blocks.
class EmuBackend final : public Backend {
public:
    int id() const override { return PYFA_BACKEND_EMU; }
    const char* label() const override { return "the emulator"; }
    pyfa_status profile(pyfa_device_profile* profile) const override {
        emulated_h200_profile("pyfa emulator (H200 profile)", profile);
        return PYFA_OK;
    }
    pyfa_status launch(int kernel, const AttentionParams& p, const LaunchShape& shape, const pyfa_config& cfg,
                       void*) const override {
        return emu_launch(kernel, p, shape, cfg);
    }
};

}  // namespace

PYFA_REGISTER_BACKEND(EmuBackend)

}  // namespace pyfa
