// emu_strict_kernels.cpp: the kernels compiled once more for the emulator, for its strict
// mode (strict.h). CMakeLists.txt builds this file alone with the compiler's
// ThreadSanitizer instrumentation, whose hooks strict.cpp defines: every load and store
// of the kernels' code reports its address and size first. PYFA_EMU_STRICT gives the
// kernels their own namespace and routes the vector accesses and cp.async of src/common
// to strict.cpp. The plain emulator's compilation (emu_backend.cpp) is not instrumented
// and pays nothing for any of it.
#define PYFA_EMU_STRICT 1

#include "kernels/registry.cuh"

namespace pyfa {

PYFA_KERNELS::KernelFn emu_strict_kernel(int id) { return PYFA_KERNELS::kernel_fn(id); }

}  // namespace pyfa
