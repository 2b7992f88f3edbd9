// emu_backend.cpp: the kernels compiled as C++ and launched on the emulator (src/backends/emu).
// The kernel files are the very ones nvcc compiles in cuda_backend.cu.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "backends/emu/strict_params.h"
#include "kernels/registry.cuh"
#include "core/internal.h"

namespace pyfa {

#if PYFA_EMU_STRICT_AVAILABLE
// The instrumented compilation of the kernels (emu_strict_kernels.cpp).
PYFA_KERNELS::KernelFn emu_strict_kernel(int id);
#endif

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
        case pyfa_emu::Error::Hazard: return PYFA_ERROR_KERNEL_HAZARD;
        // The launcher checks every launch before it gets here, and the kernels throw
        // nothing: either is a bug of the library.
        case pyfa_emu::Error::InvalidLaunch:
        case pyfa_emu::Error::KernelException: return PYFA_ERROR_INTERNAL;
    }
    return PYFA_ERROR_INTERNAL;
}

// ---- strict mode (strict.h)

// PYFA_EMU_CHECK: unset, "" or "off": plain; "strict": every launch strict. Read once.
enum class EnvCheck { Off, Strict, Invalid };
EnvCheck env_check() {
    static const EnvCheck check = [] {
        const char* v = std::getenv("PYFA_EMU_CHECK");
        if (!v || !*v || std::strcmp(v, "off") == 0) return EnvCheck::Off;
        return std::strcmp(v, "strict") == 0 ? EnvCheck::Strict : EnvCheck::Invalid;
    }();
    return check;
}

// PYFA_EMU_SMEM_PER_BLOCK: the emulated device's shared memory per block, in bytes, so that
// the tiles and kernel rows chosen are a smaller GPU's (166912: an A100's, whose fast FA2
// backward at d = 128 runs its one-stage rows); unset or empty: an H200's. Read once; 0
// when the value is not a whole number of bytes from 1024 to 1 GiB.
constexpr int64_t kMinEnvSmem = 1024, kMaxEnvSmem = int64_t(1) << 30;
int64_t env_smem_per_block() {
    static const int64_t bytes = [] {
        const char* v = std::getenv("PYFA_EMU_SMEM_PER_BLOCK");
        if (!v || !*v) return int64_t(-1);
        char* end = nullptr;
        errno = 0;
        const long long n = std::strtoll(v, &end, 10);
        const bool ok = errno == 0 && *end == '\0' && n >= kMinEnvSmem && n <= kMaxEnvSmem;
        return ok ? static_cast<int64_t>(n) : int64_t(0);
    }();
    return bytes;
}

struct RowFacts {
    int kernel, variant;
    SmemLayout layout;
};

// The table row's pyfa_kernel, variant and shared-memory layout for p's tiles.
bool row_facts(int id, const AttentionParams& p, RowFacts* f) {
    switch (id) {
#define PYFA_KERNEL_FACTS(ID, NAME, KERNEL, VARIANT, D, BR, BC, FN, LAYOUT, THREADS, GRID) \
    case ID: *f = RowFacts{KERNEL, VARIANT, LAYOUT(p.block_r, p.block_c, p.head_dim)}; return true;
        PYFA_KERNEL_TABLE(PYFA_KERNEL_FACTS)
#undef PYFA_KERNEL_FACTS
    }
    return false;
}

pyfa_status emu_launch(int kernel, const AttentionParams& p, const LaunchShape& shape,
                       const pyfa_config& config) {
    char message[sizeof(pyfa_emu::LaunchResult::message) + 192];
    if (config.emu_workers < 0 || config.emu_workers > pyfa_emu::kMaxWorkers) {
        std::snprintf(message, sizeof message,
                      "config->emu_workers: expected 0 (one per core) to %d, got %d",
                      pyfa_emu::kMaxWorkers, config.emu_workers);
        return report(PYFA_ERROR_INVALID_ARGUMENT, message);
    }
    const EnvCheck env = env_check();
    if (env == EnvCheck::Invalid) {
        std::snprintf(message, sizeof message,
                      "environment variable PYFA_EMU_CHECK: expected \"strict\" or \"off\", got \"%.40s\"",
                      std::getenv("PYFA_EMU_CHECK"));
        return report(PYFA_ERROR_INVALID_ARGUMENT, message);
    }
    const bool strict = (config.flags & PYFA_FLAG_EMU_STRICT) || env == EnvCheck::Strict;
#if PYFA_EMU_STRICT_AVAILABLE
    const PYFA_KERNELS::KernelFn fn = strict ? emu_strict_kernel(kernel) : PYFA_KERNELS::kernel_fn(kernel);
#else
    if (strict)
        return report(PYFA_ERROR_INVALID_ARGUMENT,
                      "config->flags: PYFA_FLAG_EMU_STRICT (or PYFA_EMU_CHECK=strict), but this library was "
                      "built without the emulator's strict mode (its compiler lacks -fsanitize=thread, or "
                      "the build is sanitized otherwise)");
    const PYFA_KERNELS::KernelFn fn = PYFA_KERNELS::kernel_fn(kernel);
#endif
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
    RowFacts facts{};
    if (!row_facts(kernel, p, &facts)) {
        std::snprintf(message, sizeof message, "emulator: no kernel %s", kernel_name(kernel));
        return report(PYFA_ERROR_INTERNAL, message);
    }
    char label[128];
    std::snprintf(label, sizeof label, "%s (%s variant)", kernel_name(kernel),
                  facts.variant == PYFA_VARIANT_FAST ? "fast" : "reference");
    pyfa_emu::StrictSession session(label);
    AttentionParams run = p;
    if (strict) {
        if (!pyfa_emu::strict_tensors(session, facts.kernel, p, run))
            return report(PYFA_ERROR_OUT_OF_MEMORY, "emulator: out of memory for strict mode's tensor copies");
        for (int t = 0; t < facts.layout.count; ++t)
            session.add_term(facts.layout.name[t], facts.layout.offset[t], facts.layout.floats[t],
                             facts.layout.width[t]);
        options.strict = &session;
    }
    pyfa_emu::LaunchResult result;
    try {
        const std::function<void()> body = [fn, &run] { fn(run); };
        pyfa_emu::launch(dim3(shape.grid[0], shape.grid[1], shape.grid[2]), dim3(shape.threads),
                         static_cast<size_t>(shape.smem_bytes), options, body, &result);
    } catch (...) {  // only making the std::function can throw; launch() never does
        return report(PYFA_ERROR_OUT_OF_MEMORY, "emulator: out of memory before the launch");
    }
    if (result.error == pyfa_emu::Error::None) {
        if (strict) session.write_back();
        return PYFA_OK;
    }
    // A hazard's message names the kernel and its variant itself.
    if (result.error == pyfa_emu::Error::Hazard) return report(status_of(result.error), result.message);
    std::snprintf(message, sizeof message, "%s: %s", strict ? label : kernel_name(kernel), result.message);
    return report(status_of(result.error), message);
}

// Host memory, the kernel table's kernels launched one by one; the emulator asks
// config->progress itself, between blocks.
class EmuBackend final : public Backend {
public:
    int id() const override { return PYFA_BACKEND_EMU; }
    const char* label() const override { return "the emulator"; }
    pyfa_status profile(pyfa_device_profile* profile) const override {
        const int64_t smem = env_smem_per_block();
        if (smem == 0) {
            char message[192];
            std::snprintf(message, sizeof message,
                          "environment variable PYFA_EMU_SMEM_PER_BLOCK: expected bytes, %lld to %lld, got \"%.40s\"",
                          static_cast<long long>(kMinEnvSmem), static_cast<long long>(kMaxEnvSmem),
                          std::getenv("PYFA_EMU_SMEM_PER_BLOCK"));
            return report(PYFA_ERROR_INVALID_ARGUMENT, message);
        }
        emulated_h200_profile("pyfa emulator (H200 profile)", profile);
        if (smem > 0) {
            profile->smem_per_block = smem;
            std::snprintf(profile->name, sizeof profile->name, "pyfa emulator (%lld B per block)",
                          static_cast<long long>(smem));
        }
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
