// toy_backend.cpp: a fourth backend, for tests/test_backend_interface.py only. It proves
// that a backend is one file plus its registration line: it forwards everything to the
// cpu backend under an id and a label of its own, so its results are the cpu backend's
// bits (what it refuses, it refuses in its own name). Built into a copy of the library (the pyfa_toy target), never into libpyfa.
#include "core/internal.h"

namespace pyfa {

namespace {

// Above every pyfa_backend; what a test passes as config->backend.
constexpr int kToyId = 100;

const Backend& cpu() { return *find_backend(PYFA_BACKEND_CPU); }

class ToyBackend final : public Backend {
public:
    int id() const override { return kToyId; }
    const char* label() const override { return "the toy backend"; }
    pyfa_status profile(pyfa_device_profile* profile) const override { return cpu().profile(profile); }
    bool runs_table_kernels() const override { return cpu().runs_table_kernels(); }
    bool dense_only() const override { return cpu().dense_only(); }
    bool runs_whole_op() const override { return cpu().runs_whole_op(); }
    pyfa_status run_op(int op, const AttentionParams* params, size_t count, const pyfa_config& cfg) const override {
        return cpu().run_op(op, params, count, cfg);
    }
};

}  // namespace

PYFA_REGISTER_BACKEND(ToyBackend)

}  // namespace pyfa
