// emu_backend.cpp: the kernels compiled as C++ and launched on the emulator (cuda/emu).
// The kernel files are the very ones nvcc compiles in cuda_backend.cu.
#include <cstring>
#include <string>

#include "kernels/registry.cuh"
#include "launch/internal.h"

namespace pyfa {

pyfa_status emu_profile(pyfa_device_profile* profile) {
    std::memset(profile, 0, sizeof(*profile));
    std::strncpy(profile->name, "pyfa emulator (H200 profile)", sizeof(profile->name) - 1);
    profile->smem_per_block = 227 * 1024;  // an H200's opt-in shared memory per block
    profile->max_threads_per_block = 1024;
    profile->sm_count = 132;
    return PYFA_OK;
}

pyfa_status emu_launch(int kernel, const AttentionParams& p, const LaunchShape& shape,
                       const pyfa_config& config) {
    const PYFA_KERNELS::KernelFn fn = PYFA_KERNELS::kernel_fn(kernel);
    if (!fn) return fail(PYFA_ERROR_INTERNAL, std::string("emulator: no kernel ") + kernel_name(kernel));
    pyfa_emu::LaunchOptions options;
    options.order = config.emu_order;
    options.seed = config.emu_seed;
    options.workers = config.emu_workers;
    std::string error;
    const bool ok = pyfa_emu::launch(dim3(shape.grid[0], shape.grid[1], shape.grid[2]),
                                     dim3(shape.threads), static_cast<size_t>(shape.smem_bytes),
                                     options, [&] { fn(p); }, &error);
    if (!ok) return fail(PYFA_ERROR_EMULATION, std::string(kernel_name(kernel)) + ": " + error);
    return PYFA_OK;
}

}  // namespace pyfa
