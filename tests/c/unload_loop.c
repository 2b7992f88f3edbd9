/* unload_loop.c: loads libpyfa (argv[1]), runs one emulated FA2 forward on two workers,
   and unloads it, argv[2] times over, for tests/test_abi_safety.py. Prints the number of
   lines of /proc/self/maps after the first few cycles and after the last one: what the
   library leaves behind at unload (the emulator's parked workers, each a few hundred
   mappings) makes the second grow with the cycles. Exit status 0 when every call
   succeeded. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyfa.h"

typedef pyfa_status (*fa2_forward_fn)(const pyfa_problem*, const pyfa_config*, const float*, const float*,
                                      const float*, float*, float*);

enum { N = 64, D = 16 };
static float q[N * D], o[N * D], lse[N];

static long maps_lines(void) {
    FILE* f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    long lines = 0;
    int c;
    while ((c = fgetc(f)) != EOF) lines += c == '\n';
    fclose(f);
    return lines;
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    const int cycles = atoi(argv[2]);
    for (int i = 0; i < N * D; ++i) q[i] = (float)(i % 7) - 3.0f;
    long early = -1;
    for (int n = 0; n < cycles; ++n) {
        void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            fprintf(stderr, "unload_loop: %s\n", dlerror());
            return 3;
        }
        fa2_forward_fn fwd = (fa2_forward_fn)dlsym(lib, "pyfa_fa2_forward");
        if (!fwd) return 4;
        pyfa_problem problem;
        memset(&problem, 0, sizeof(problem));
        problem.batch = 1;
        problem.heads = 1;
        problem.seqlen_q = N;
        problem.seqlen_k = N;
        problem.head_dim = D;
        pyfa_config config;
        memset(&config, 0, sizeof(config));
        config.backend = PYFA_BACKEND_EMU;
        config.block_r = 16;
        config.block_c = 16;
        config.emu_workers = 2;
        if (fwd(&problem, &config, q, q, q, o, lse) != PYFA_OK) {
            fprintf(stderr, "unload_loop: the call failed in cycle %d\n", n);
            return 5;
        }
        if (dlclose(lib) != 0) return 6;
        if (n == 4) early = maps_lines();
    }
    printf("maps %ld %ld\n", early, maps_lines());
    return 0;
}
