// errors.cpp: per-thread last-error message and status names.
//
// Reporting a failure must not allocate: the failure being reported is often an
// allocation that failed, and a throw from here would cross the C ABI. The message lives
// in a fixed per-thread buffer, written with vsnprintf (which does not allocate for the
// conversions used here: %s, %d, %lld, %llu, %zu, %g) and cut at its end if too long.
#include <cstdarg>
#include <cstdio>
#include <string>

#include "core/internal.h"

namespace {
thread_local char last_error[pyfa::kMaxErrorLength];
}

namespace pyfa {

pyfa_status fail(pyfa_status status, const char* format, ...) {
    va_list args;
    va_start(args, format);
    const int n = std::vsnprintf(last_error, sizeof(last_error), format, args);
    va_end(args);
    if (n < 0) last_error[0] = '\0';
    return status;
}

pyfa_status fail(pyfa_status status, const std::string& message) {
    return fail(status, "%s", message.c_str());
}

void clear_error() { last_error[0] = '\0'; }

}  // namespace pyfa

extern "C" {

PYFA_API const char* pyfa_last_error(void) { return last_error; }

PYFA_API const char* pyfa_status_string(pyfa_status status) {
    switch (status) {
        case PYFA_OK: return "ok";
        case PYFA_ERROR_INVALID_ARGUMENT: return "invalid argument";
        case PYFA_ERROR_TILE_TOO_LARGE: return "tile too large for shared memory";
        case PYFA_ERROR_BACKEND_UNAVAILABLE: return "backend unavailable";
        case PYFA_ERROR_CUDA: return "CUDA error";
        case PYFA_ERROR_EMULATION: return "emulation error";
        case PYFA_ERROR_OUT_OF_MEMORY: return "out of memory";
        case PYFA_ERROR_INTERNAL: return "internal error";
        case PYFA_ERROR_CANCELLED: return "cancelled";
        case PYFA_ERROR_KERNEL_HAZARD: return "kernel hazard";
    }
    return "unknown status";
}

}  // extern "C"
