/* pyfa_problem and pyfa_config across layouts (pyfa.h, "Evolution"): a caller that sets
   only the fields of ABI 2 in a zero-initialised struct gets ABI 2's results; ABI 3's
   pyfa_config size hides the later fields, whatever they hold; a struct_size that is no
   published layout's (inside a field, larger than the library's) is refused by name.
   Exit status 0 on success; each failure prints what differed. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "pyfa.h"

enum { B = 1, H = 2, NQ = 11, NK = 7, D = 8, ELEMS = B * H * (NQ > NK ? NQ : NK) * D, ROWS = B * H * NQ };

static float q[ELEMS], k[ELEMS], v[ELEMS];
static float o_ref[ELEMS], lse_ref[ROWS], o[ELEMS], lse[ROWS];
static int failures = 0;

static void expect(int ok, const char* what) {
    if (!ok) {
        fprintf(stderr, "struct_size: %s (last error: %s)\n", what, pyfa_last_error());
        ++failures;
    }
}

static int same_outputs(void) {
    return memcmp(o, o_ref, sizeof(o)) == 0 && memcmp(lse, lse_ref, sizeof(lse)) == 0;
}

static void poison(void) {
    for (int i = 0; i < ELEMS; ++i) o[i] = 7.0f;
    for (int i = 0; i < ROWS; ++i) lse[i] = 7.0f;
}

static int untouched(void) {
    for (int i = 0; i < ELEMS; ++i) if (o[i] != 7.0f) return 0;
    for (int i = 0; i < ROWS; ++i) if (lse[i] != 7.0f) return 0;
    return 1;
}

/* ABI 2's fields only, everything else zero. */
static pyfa_problem todays_problem(void) {
    pyfa_problem p;
    memset(&p, 0, sizeof(p));
    p.batch = B;
    p.heads = H;
    p.seqlen_q = NQ;
    p.seqlen_k = NK;
    p.head_dim = D;
    p.causal = 1;
    return p;
}

static pyfa_config todays_config(void) {
    pyfa_config c;
    memset(&c, 0, sizeof(c));
    c.backend = PYFA_BACKEND_EMU;
    c.block_r = 4;
    c.block_c = 4;
    c.emu_workers = 1;
    return c;
}

/* ABI 2's result: causal, bottom-right (key j visible to row i iff j <= i + NK - NQ),
   in double; rows that see no key have O = 0 and LSE = -inf. */
static double error_against_direct(void) {
    double worst = 0.0;
    for (int h = 0; h < H; ++h)
        for (int i = 0; i < NQ; ++i) {
            const float* qi = q + (h * NQ + i) * D;
            const int last = i + NK - NQ;  /* last visible key */
            const float* kh = k + h * NK * D;
            const float* vh = v + h * NK * D;
            const float* oi = o_ref + (h * NQ + i) * D;
            if (last < 0) {
                for (int x = 0; x < D; ++x) if (oi[x] != 0.0f) return INFINITY;
                if (lse_ref[h * NQ + i] != -INFINITY) return INFINITY;
                continue;
            }
            double s[NK], m = -INFINITY, l = 0.0;
            for (int j = 0; j <= last; ++j) {
                s[j] = 0.0;
                for (int x = 0; x < D; ++x) s[j] += (double)qi[x] * kh[j * D + x];
                s[j] /= sqrt((double)D);
                if (s[j] > m) m = s[j];
            }
            for (int j = 0; j <= last; ++j) l += exp(s[j] - m);
            for (int x = 0; x < D; ++x) {
                double acc = 0.0;
                for (int j = 0; j <= last; ++j) acc += exp(s[j] - m) / l * vh[j * D + x];
                if (fabs(acc - oi[x]) > worst) worst = fabs(acc - oi[x]);
            }
            if (fabs(m + log(l) - lse_ref[h * NQ + i]) > worst) worst = fabs(m + log(l) - lse_ref[h * NQ + i]);
        }
    return worst;
}

int main(void) {
    unsigned seed = 2024u;
    for (int i = 0; i < ELEMS; ++i) {
        seed = seed * 1103515245u + 12345u;
        q[i] = (float)((seed >> 8) % 2000) / 1000.0f - 1.0f;
        k[i] = (float)((seed >> 4) % 1000) / 500.0f - 1.0f;
        v[i] = (float)(i % 11) - 5.0f;
    }

    pyfa_problem problem = todays_problem();
    pyfa_config config = todays_config();
    expect(pyfa_fa2_forward(&problem, &config, q, k, v, o_ref, lse_ref) == PYFA_OK, "today's fields: the call fails");
    const double err = error_against_direct();
    expect(err < 1e-5, "today's fields: not ABI 2's causal bottom-right result");

    /* struct_size = sizeof: the same layout spelled out. */
    problem.struct_size = sizeof(pyfa_problem);
    config.struct_size = sizeof(pyfa_config);
    poison();
    expect(pyfa_fa2_forward(&problem, &config, q, k, v, o, lse) == PYFA_OK && same_outputs(),
           "struct_size = sizeof: not today's bits");

    /* ABI 3's pyfa_config (0, or its size spelled out) ends before flags: they are not
       read, whatever they hold. */
    problem = todays_problem();
    config = todays_config();
    config.flags = (uint64_t)1 << 40;
    config.struct_size = 0;
    poison();
    expect(pyfa_fa2_forward(&problem, &config, q, k, v, o, lse) == PYFA_OK && same_outputs(),
           "config struct_size 0: flags were read");
    config.struct_size = (uint32_t)offsetof(pyfa_config, flags);
    poison();
    expect(pyfa_fa2_forward(&problem, &config, q, k, v, o, lse) == PYFA_OK && same_outputs(),
           "config struct_size = ABI 3's: flags were read");

    /* Sizes of no published layout: one ending inside a field (44: half of the progress
       pointer), a smaller one, a larger one (a newer header's) and the largest: refused
       by name, nothing written, and nothing read beyond the library's struct. */
    const uint32_t bad_config[] = {4, 44, (uint32_t)offsetof(pyfa_config, variant), (uint32_t)sizeof(pyfa_config) + 8,
                                   0xffffffffu};
    for (size_t n = 0; n < sizeof(bad_config) / sizeof(bad_config[0]); ++n) {
        config = todays_config();
        config.struct_size = bad_config[n];
        poison();
        expect(pyfa_fa2_forward(&problem, &config, q, k, v, o, lse) == PYFA_ERROR_INVALID_ARGUMENT &&
                   strstr(pyfa_last_error(), "config->struct_size") && untouched(),
               "config->struct_size of no published layout: not refused by name, or outputs written");
    }
    config = todays_config();
    const uint32_t bad_problem[] = {1, (uint32_t)offsetof(pyfa_problem, heads_kv), (uint32_t)sizeof(pyfa_problem) + 8,
                                    0xffffffffu};
    for (size_t n = 0; n < sizeof(bad_problem) / sizeof(bad_problem[0]); ++n) {
        problem = todays_problem();
        problem.struct_size = bad_problem[n];
        poison();
        expect(pyfa_fa2_forward(&problem, &config, q, k, v, o, lse) == PYFA_ERROR_INVALID_ARGUMENT &&
                   strstr(pyfa_last_error(), "problem->struct_size") && untouched(),
               "problem->struct_size of no published layout: not refused by name, or outputs written");
    }

    /* variant: REFERENCE runs the readable kernels, today's bits. */
    problem = todays_problem();
    config = todays_config();
    config.variant = PYFA_VARIANT_REFERENCE;
    poison();
    expect(pyfa_fa2_forward(&problem, &config, q, k, v, o, lse) == PYFA_OK && same_outputs(),
           "variant REFERENCE: not today's bits");

    printf("struct_size: %s (max abs error of today's result %.3g)\n", failures ? "FAILED" : "ok", err);
    return failures ? 1 : 0;
}
