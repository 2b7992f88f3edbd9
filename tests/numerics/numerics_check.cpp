// numerics_check: applies pyfa_exp, pyfa_log, pyfa_canonical_nan, pyfa_max or pyfa_fma
// (src/common/numerics.h), as compiled by the host C++ compiler, to raw float32 data, for
// tests/test_numerics.py and tests/test_fma.py.
//
//   numerics_check exp|log|nan IN OUT  OUT[i] = f(IN[i])
//   numerics_check max IN OUT   IN holds a[0..n) then b[0..n); OUT[i] = pyfa_max(a[i], b[i])
//   numerics_check fma IN OUT   IN holds a, b, c, n each; OUT[i] = pyfa_fma(a[i], b[i], c[i])
//
// Files are raw native-endian float32. Exit status 0 on success, 2 on a usage or I/O error.
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/numerics.h"

static bool read_all(const char* path, std::vector<float>* out) {
    FILE* f = std::fopen(path, "rb");
    if (!f) return false;
    std::fseek(f, 0, SEEK_END);
    const long bytes = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    if (bytes < 0 || bytes % 4 != 0) {
        std::fclose(f);
        return false;
    }
    out->resize(static_cast<size_t>(bytes) / 4);
    const size_t got = out->empty() ? 0 : std::fread(out->data(), 4, out->size(), f);
    std::fclose(f);
    return got == out->size();
}

static bool write_all(const char* path, const std::vector<float>& v) {
    FILE* f = std::fopen(path, "wb");
    if (!f) return false;
    const size_t put = v.empty() ? 0 : std::fwrite(v.data(), 4, v.size(), f);
    return std::fclose(f) == 0 && put == v.size();
}

int main(int argc, char** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s exp|log|nan|max|fma IN OUT\n", argv[0]);
        return 2;
    }
    std::vector<float> in;
    if (!read_all(argv[2], &in)) {
        std::fprintf(stderr, "cannot read %s\n", argv[2]);
        return 2;
    }
    std::vector<float> out;
    if (std::strcmp(argv[1], "exp") == 0) {
        out.resize(in.size());
        for (size_t i = 0; i < in.size(); ++i) out[i] = pyfa_exp(in[i]);
    } else if (std::strcmp(argv[1], "log") == 0) {
        out.resize(in.size());
        for (size_t i = 0; i < in.size(); ++i) out[i] = pyfa_log(in[i]);
    } else if (std::strcmp(argv[1], "nan") == 0) {
        out.resize(in.size());
        for (size_t i = 0; i < in.size(); ++i) out[i] = pyfa_canonical_nan(in[i]);
    } else if (std::strcmp(argv[1], "fma") == 0 && in.size() % 3 == 0) {
        const size_t n = in.size() / 3;
        out.resize(n);
        for (size_t i = 0; i < n; ++i) out[i] = pyfa_fma(in[i], in[n + i], in[2 * n + i]);
    } else if (std::strcmp(argv[1], "max") == 0 && in.size() % 2 == 0) {
        const size_t n = in.size() / 2;
        out.resize(n);
        for (size_t i = 0; i < n; ++i) out[i] = pyfa_max(in[i], in[n + i]);
    } else {
        std::fprintf(stderr, "unknown function %s (or bad input length)\n", argv[1]);
        return 2;
    }
    if (!write_all(argv[3], out)) {
        std::fprintf(stderr, "cannot write %s\n", argv[3]);
        return 2;
    }
    return 0;
}
