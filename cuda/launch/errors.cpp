// errors.cpp: per-thread last-error message and status names.
#include <string>

#include "launch/internal.h"

namespace {
thread_local std::string last_error;
}

namespace pyfa {

pyfa_status fail(pyfa_status status, const std::string& message) {
    last_error = message;
    return status;
}

void clear_error() { last_error.clear(); }

}  // namespace pyfa

extern "C" {

PYFA_API const char* pyfa_last_error(void) { return last_error.c_str(); }

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
    }
    return "unknown status";
}

}  // extern "C"
