/* A plain C99 user of libpyfa: FA2 forward on the emulator, checked against a direct
   softmax(QK^T/sqrt(d))V computed here in double. Exit status 0 on success. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "pyfa.h"

enum { N = 19, D = 8 };

int main(void) {
    float q[N * D], k[N * D], v[N * D], o[N * D], lse[N];
    unsigned seed = 12345u;
    for (int i = 0; i < N * D; ++i) {
        seed = seed * 1103515245u + 12345u;
        q[i] = (float)((seed >> 8) % 2000) / 1000.0f - 1.0f;
        v[i] = (float)(i % 13) - 6.0f;
    }
    for (int i = 0; i < N * D; ++i) k[i] = q[(i * 7) % (N * D)] * 0.5f;
    /* Designated initializers: fields added to the structs later start at zero, which
       always means today's behaviour. */
    pyfa_problem problem = {.batch = 1, .heads = 1, .seqlen_q = N, .seqlen_k = N, .head_dim = D,
                            .scale = 0.0f, .causal = 1};
    pyfa_config config = {.backend = PYFA_BACKEND_EMU, .block_r = 8, .block_c = 4,
                          .emu_order = PYFA_EMU_ORDER_REVERSE, .emu_workers = 1};
    pyfa_status st = pyfa_fa2_forward(&problem, &config, q, k, v, o, lse);
    if (st != PYFA_OK) {
        fprintf(stderr, "pyfa_fa2_forward: %s: %s\n", pyfa_status_string(st), pyfa_last_error());
        return 1;
    }
    double worst = 0.0;
    for (int i = 0; i < N; ++i) {
        double s[N], m = -INFINITY, l = 0.0;
        for (int j = 0; j <= i; ++j) {
            s[j] = 0.0;
            for (int x = 0; x < D; ++x) s[j] += (double)q[i * D + x] * k[j * D + x];
            s[j] /= sqrt((double)D);
            if (s[j] > m) m = s[j];
        }
        for (int j = 0; j <= i; ++j) l += exp(s[j] - m);
        for (int x = 0; x < D; ++x) {
            double acc = 0.0;
            for (int j = 0; j <= i; ++j) acc += exp(s[j] - m) / l * v[j * D + x];
            double err = fabs(acc - o[i * D + x]);
            if (err > worst) worst = err;
        }
        if (fabs(m + log(l) - lse[i]) > 1e-5) {
            fprintf(stderr, "lse[%d] = %g, expected %g\n", i, lse[i], m + log(l));
            return 1;
        }
    }
    /* Bad input is a status, not a crash. */
    problem.head_dim = 0;
    if (pyfa_fa2_forward(&problem, &config, q, k, v, o, lse) != PYFA_ERROR_INVALID_ARGUMENT) return 1;
    printf("pyfa %s: max abs error %.3g\n", pyfa_version(), worst);
    return worst < 1e-5 ? 0 : 1;
}
