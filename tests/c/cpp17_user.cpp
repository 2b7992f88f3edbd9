// A C++17 user of libpyfa. Designated initialisers are C++20, so the structs are
// value-initialised (every field zero, which means the default) and then assigned.
// FA2 forward on the emulator against a direct softmax(Q K^T / sqrt(d)) V in double.
// Exit status 0 on success.
#include <cmath>
#include <cstdio>
#include <vector>

#include "pyfa.h"

int main() {
    constexpr int n = 13, d = 4;
    std::vector<float> q(n * d), k(n * d), v(n * d), o(n * d), lse(n);
    for (int i = 0; i < n * d; ++i) {
        q[i] = std::sin(0.7f * static_cast<float>(i));
        k[i] = std::cos(0.3f * static_cast<float>(i));
        v[i] = static_cast<float>(i % 5) - 2.0f;
    }

    pyfa_problem problem{};
    problem.batch = 1;
    problem.heads = 1;
    problem.seqlen_q = n;
    problem.seqlen_k = n;
    problem.head_dim = d;
    pyfa_config config{};
    config.backend = PYFA_BACKEND_EMU;
    config.emu_workers = 1;

    if (pyfa_abi_version() != PYFA_ABI_VERSION) {
        std::fprintf(stderr, "library ABI %d, header ABI %d\n", pyfa_abi_version(), PYFA_ABI_VERSION);
        return 1;
    }
    pyfa_status st = pyfa_fa2_forward(&problem, &config, q.data(), k.data(), v.data(),
                                      o.data(), lse.data());
    if (st != PYFA_OK) {
        std::fprintf(stderr, "pyfa_fa2_forward: %s: %s\n", pyfa_status_string(st), pyfa_last_error());
        return 1;
    }
    double worst = 0.0;
    for (int i = 0; i < n; ++i) {
        std::vector<double> p(n);
        double m = -INFINITY, l = 0.0;
        for (int j = 0; j < n; ++j) {
            double s = 0.0;
            for (int x = 0; x < d; ++x) s += static_cast<double>(q[i * d + x]) * k[j * d + x];
            p[j] = s / std::sqrt(static_cast<double>(d));
            m = std::fmax(m, p[j]);
        }
        for (int j = 0; j < n; ++j) l += std::exp(p[j] - m);
        for (int x = 0; x < d; ++x) {
            double acc = 0.0;
            for (int j = 0; j < n; ++j) acc += std::exp(p[j] - m) / l * v[j * d + x];
            worst = std::fmax(worst, std::fabs(acc - o[i * d + x]));
        }
        worst = std::fmax(worst, std::fabs(m + std::log(l) - lse[i]));
    }
    std::printf("pyfa %s (C++17): max abs error %.3g\n", pyfa_version(), worst);
    return worst < 1e-5 ? 0 : 1;
}
