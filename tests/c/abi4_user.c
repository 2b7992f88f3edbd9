/* A C program of ABI 4, compiled against tests/c/abi4/pyfa.h and linked with today's
   libpyfa: every op through the per-op entry points, with the ABI 4 sizes of pyfa_problem
   and pyfa_config, on the backend argv[1] names (2: emu, 3: cpu). q is a (B, N, H, d)
   view (problem->q strides). It writes argv[2]: the inputs, then every output, raw
   float32 in the order of the writes below, so that tests/test_run.py can run the same
   ops through pyfa_run and compare the bits. Exit status 0 when every call succeeded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyfa.h"

#if PYFA_ABI_VERSION != 4
#error "tests/c/abi4_user.c must be compiled against the ABI 4 header (tests/c/abi4)"
#endif

enum { B = 2, H = 4, HKV = 2, NQ = 9, NK = 13, D = 16 };
enum { QE = B * H * NQ * D, KE = B * HKV * NK * D, ROWS = B * H * NQ };

static float q[QE], k[KE], v[KE], dout[QE];
static float o[QE], lse[ROWS], dq[QE], dk[KE], dv[KE];
static float o1[QE], m1[ROWS], l1[ROWS], dq1[QE], dk1[KE], dv1[KE];

static int check(pyfa_status st, const char* what) {
    if (st == PYFA_OK) return 0;
    fprintf(stderr, "abi4_user: %s: %s\n", what, pyfa_last_error());
    return 1;
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    unsigned seed = 4u;
    float* inputs[] = {q, k, v, dout};
    const int sizes[] = {QE, KE, KE, QE};
    for (int t = 0; t < 4; ++t)
        for (int i = 0; i < sizes[t]; ++i) {
            seed = seed * 1103515245u + 12345u;
            inputs[t][i] = (float)((seed >> 8) % 2000) / 1000.0f - 1.0f;
        }

    pyfa_problem problem;
    memset(&problem, 0, sizeof(problem));
    problem.struct_size = sizeof(problem);
    problem.batch = B;
    problem.heads = H;
    problem.heads_kv = HKV;
    problem.seqlen_q = NQ;
    problem.seqlen_k = NK;
    problem.head_dim = D;
    problem.causal = 1;
    /* q read as (B, N, H, d): element (b, h, n, x) at b*N*H*d + h*d + n*H*d + x */
    problem.q.batch = NQ * H * D;
    problem.q.head = D;
    problem.q.row = H * D;

    pyfa_config config;
    memset(&config, 0, sizeof(config));
    config.struct_size = sizeof(config);
    config.backend = atoi(argv[1]);
    config.block_r = 4;
    config.block_c = 8;
    config.emu_workers = 1;
    config.threads = 1;

    int failed = 0;
    failed += check(pyfa_fa2_forward(&problem, &config, q, k, v, o, lse), "pyfa_fa2_forward");
    failed += check(pyfa_fa2_backward(&problem, &config, q, k, v, o, lse, dout, dq, dk, dv), "pyfa_fa2_backward");
    failed += check(pyfa_fa1_forward(&problem, &config, q, k, v, o1, m1, l1), "pyfa_fa1_forward");
    failed += check(pyfa_fa1_backward(&problem, &config, q, k, v, o1, m1, l1, dout, dq1, dk1, dv1),
                    "pyfa_fa1_backward");
    if (failed) return 1;

    FILE* f = fopen(argv[2], "wb");
    if (!f) return 3;
    const struct { const float* data; size_t n; } outs[] = {
        {q, QE},  {k, KE},  {v, KE},    {dout, QE}, {o, QE},   {lse, ROWS}, {dq, QE},  {dk, KE},
        {dv, KE}, {o1, QE}, {m1, ROWS}, {l1, ROWS}, {dq1, QE}, {dk1, KE},   {dv1, KE}};
    for (size_t t = 0; t < sizeof(outs) / sizeof(outs[0]); ++t)
        if (fwrite(outs[t].data, sizeof(float), outs[t].n, f) != outs[t].n) return 4;
    if (fclose(f) != 0) return 5;
    printf("abi4_user: ok (struct sizes %zu, %zu)\n", sizeof(pyfa_problem), sizeof(pyfa_config));
    return 0;
}
