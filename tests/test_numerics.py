"""pyfa's own float32 exp/log/max: the C++ build of src/common/numerics.h against the NumPy
twins in pyfa/sim/numerics.py (bit for bit), and both against float64 references (accuracy).

Needs g++ (skipped without it). About 4.3 million inputs per function.
"""

import importlib.util
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CHECK_SRC = REPO / "tests" / "numerics" / "numerics_check.cpp"

# Loaded from its path so that the test does not depend on pyfa/sim/__init__.py.
_spec = importlib.util.spec_from_file_location("_pyfa_sim_numerics_under_test",
                                               REPO / "pyfa" / "sim" / "numerics.py")
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)

F32_MAX = float(np.finfo(np.float32).max)
X_HI = np.float32(float.fromhex("0x1.62e42ep+6"))
X_LO = np.float32(float.fromhex("-0x1.9fe368p+6"))
ULP_LIMIT = 2.0


# ------------------------------------------------------------------------------ helpers

def f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def run_of_neighbours(center, count):
    """`count` consecutive floats on each side of each value in `center` (same sign)."""
    c = bits(np.atleast_1d(np.float32(center))).astype(np.int64)
    offs = np.arange(-count, count + 1, dtype=np.int64)
    b = (c[:, None] + offs[None, :]).reshape(-1)
    b = b[(b >= 0) & (b <= 0xFFFFFFFF)]
    return f32(b.astype(np.uint32))


def special_values():
    return f32([
        0x00000000, 0x80000000,              # +-0
        0x7F800000, 0xFF800000,              # +-inf
        0x7FC00000, 0xFFC00000,              # quiet NaNs
        0x7F800001, 0x7FBFFFFF, 0xFFA00000,  # signalling / payload NaNs
        0x00000001, 0x80000001,              # smallest subnormals
        0x007FFFFF, 0x807FFFFF,              # largest subnormals
        0x00800000, 0x80800000,              # FLT_MIN
        0x7F7FFFFF, 0xFF7FFFFF,              # FLT_MAX
        0x3F800000, 0xBF800000,              # +-1
    ])


def random_bit_patterns(rng, n):
    return f32(rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32))


def exp_inputs():
    rng = np.random.default_rng(20240611)
    ln2 = np.log(2.0)
    # Where n = round(x / ln2) changes: x = (k + 1/2) ln2, k over the whole range.
    transitions = np.array([(k + 0.5) * ln2 for k in range(-151, 129)], dtype=np.float32)
    parts = [
        special_values(),
        random_bit_patterns(rng, 2_000_000),
        np.linspace(-104.0, 89.0, 1_900_001).astype(np.float32),
        rng.uniform(-104.0, 0.0, 200_000).astype(np.float32),   # the softmax range
        run_of_neighbours(X_HI, 2000),
        run_of_neighbours(X_LO, 2000),
        run_of_neighbours(np.float32(1e-30), 5000),
        run_of_neighbours(np.float32(-1e-30), 5000),
        run_of_neighbours(np.float32(0.3466), 5000),
        run_of_neighbours(np.float32(-0.3466), 5000),
        run_of_neighbours(transitions, 200),
        run_of_neighbours(np.float32(-87.33654), 2000),         # results near FLT_MIN
    ]
    return np.concatenate(parts).astype(np.float32)


def log_inputs():
    rng = np.random.default_rng(20240612)
    powers = np.ldexp(np.float32(1.0), np.arange(-149, 128)).astype(np.float32)
    parts = [
        special_values(),
        random_bit_patterns(rng, 2_000_000),
        np.geomspace(1e-6, 1e6, 2_000_001).astype(np.float32),
        run_of_neighbours(np.float32(1.0), 20000),
        run_of_neighbours(powers[powers > 0], 100),
        run_of_neighbours(np.float32(np.sqrt(2.0)), 5000),
        run_of_neighbours(np.float32(np.sqrt(0.5)), 5000),
        run_of_neighbours(np.float32(F32_MAX), 2000),
        f32(np.arange(1, 0x00800000, 97, dtype=np.uint32)),      # subnormals
    ]
    return np.concatenate(parts).astype(np.float32)


def same_bits(a, b):
    """Elementwise: identical bits, or both NaN (NaN payloads differ between platforms)."""
    return (bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b))


def ulp_error(y, ref):
    """|y - ref| in units of the float32 ulp of ref (ref in float64, normal range)."""
    _, e = np.frexp(ref)                 # |ref| = m * 2^e, m in [0.5, 1)
    e = np.maximum(e - 1, -126)          # floor(log2 |ref|), clamped to the normal range
    return np.abs(y.astype(np.float64) - ref) / np.ldexp(1.0, e - 23)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    d = tmp_path_factory.mktemp("numerics")
    exe = d / "numerics_check"
    subprocess.run([gxx, "-std=c++17", "-O2", "-ffp-contract=off", "-I", str(REPO / "src"),
                    str(CHECK_SRC), "-o", str(exe)], check=True)

    def run(fn, x):
        inp, out = d / f"{fn}.in", d / f"{fn}.out"
        np.ascontiguousarray(x, dtype=np.float32).tofile(inp)
        subprocess.run([str(exe), fn, str(inp), str(out)], check=True)
        return np.fromfile(out, dtype=np.float32)

    return run


@pytest.fixture(scope="module")
def exp_results(checker):
    x = exp_inputs()
    return x, checker("exp", x), numerics.exp(x)


@pytest.fixture(scope="module")
def log_results(checker):
    x = log_inputs()
    return x, checker("log", x), numerics.log(x)


# -------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("which", ["exp", "log"])
def test_c_and_numpy_agree_bit_for_bit(which, exp_results, log_results):
    x, yc, ys = exp_results if which == "exp" else log_results
    assert x.size >= 4_000_000
    assert ys.dtype == np.float32 and ys.shape == x.shape
    ok = same_bits(yc, ys)
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (
        f"{which}: {bad.size} of {x.size} differ, e.g. x={x[bad[:5]]!r} "
        f"C={yc[bad[:5]]!r} NumPy={ys[bad[:5]]!r}")


def test_exp_accuracy(exp_results):
    x, y, _ = exp_results
    with np.errstate(all="ignore"):
        ref = np.exp(x.astype(np.float64))
    normal = np.isfinite(x) & (ref >= 2.0**-126) & (ref <= F32_MAX)
    err = ulp_error(y[normal], ref[normal])
    neg = x[normal] <= 0
    print(f"\nexp: max ulp {err.max():.4f} over {normal.sum()} normal results "
          f"(x <= 0: {err[neg].max():.4f})")
    assert err.max() <= ULP_LIMIT, x[normal][np.argmax(err)]
    # Subnormal results: error within one unit of 2^-149.
    subn = np.isfinite(x) & (ref < 2.0**-126)
    abs_err = np.abs(y[subn].astype(np.float64) - ref[subn]) / 2.0**-149
    print(f"exp: max error {abs_err.max():.4f} x 2^-149 over {subn.sum()} subnormal/zero results")
    assert abs_err.max() <= 1.0


def test_log_accuracy(log_results):
    x, y, _ = log_results
    pos = np.isfinite(x) & (x > 0)
    ref = np.log(x[pos].astype(np.float64))
    nz = ref != 0
    err = ulp_error(y[pos][nz], ref[nz])
    normal_in = x[pos][nz] >= 2.0**-126
    print(f"\nlog: max ulp {err[normal_in].max():.4f} over {normal_in.sum()} normal inputs, "
          f"{err.max():.4f} including subnormal inputs")
    assert err.max() <= ULP_LIMIT, x[pos][nz][np.argmax(err)]


def test_exp_special_values(checker):
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    x = np.array([0.0, -0.0, -inf, inf, nan, X_HI, np.nextafter(X_HI, inf), X_LO,
                  np.nextafter(X_LO, -inf), 1.0], dtype=np.float32)
    for y in (checker("exp", x), numerics.exp(x)):
        assert bits(y[0]) == bits(np.float32(1.0))        # exp(+0) == 1 exactly
        assert bits(y[1]) == bits(np.float32(1.0))        # exp(-0) == 1 exactly
        assert bits(y[2]) == 0                            # exp(-inf) == +0 exactly
        assert y[3] == inf and np.isnan(y[4])
        assert np.isfinite(y[5]) and y[5] > np.float32(3e38)
        assert y[6] == inf
        assert y[7] > 0 and bits(y[8]) == 0               # last non-zero, first zero
        assert y[9] == np.float32(np.e)
    assert numerics.exp(0.0) == np.float32(1.0)
    assert isinstance(numerics.exp(0.0), np.float32)


def test_log_special_values(checker):
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    x = np.array([1.0, 0.0, -0.0, -1.0, -inf, inf, nan, 2.0, 1.4e-45], dtype=np.float32)
    for y in (checker("log", x), numerics.log(x)):
        assert bits(y[0]) == 0                            # log(1) == +0 exactly
        assert y[1] == -inf and y[2] == -inf
        assert np.isnan(y[3]) and np.isnan(y[4]) and np.isnan(y[6])
        assert y[5] == inf
        assert y[7] == np.float32(np.log(2.0))
        assert y[8] == np.float32(np.log(2.0**-149))
    assert isinstance(numerics.log(1.0), np.float32)


@pytest.mark.parametrize("which", ["exp", "log"])
def test_monotonic(which, exp_results, log_results):
    x, y, _ = exp_results if which == "exp" else log_results
    keep = ~np.isnan(x) & ((x >= 0) if which == "log" else True)
    order = np.argsort(x[keep], kind="stable")
    ys = y[keep][order].astype(np.float64)
    assert not np.isnan(ys).any()
    with np.errstate(invalid="ignore"):  # inf - inf between equal infinite results
        drops = np.flatnonzero(np.diff(ys) < 0)
    assert drops.size == 0, x[keep][order][drops[:5]]


def test_maximum_rule(checker):
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    a = np.array([1.0, nan, 1.0, -0.0, 0.0, -inf, 2.0, nan], dtype=np.float32)
    b = np.array([2.0, 1.0, nan, 0.0, -0.0, -inf, 2.0, nan], dtype=np.float32)
    rng = np.random.default_rng(3)
    ra, rb = random_bit_patterns(rng, 100_000), random_bit_patterns(rng, 100_000)
    a, b = np.concatenate([a, ra]), np.concatenate([b, rb])
    yc = checker("max", np.concatenate([a, b]))
    ys = numerics.maximum(a, b)
    assert same_bits(yc, ys).all()
    assert ys[0] == 2.0
    assert np.isnan(ys[1])                  # NaN in a propagates
    assert ys[2] == 1.0                     # NaN in b is ignored
    assert bits(ys[3]) == 0x80000000        # ties keep a: max(-0, +0) == -0
    assert bits(ys[4]) == 0x00000000        # max(+0, -0) == +0
    assert ys[5] == -inf and ys[6] == 2.0 and np.isnan(ys[7])


def test_inputs_of_other_dtypes_are_refused():
    with pytest.raises(TypeError):
        numerics.exp(np.zeros(3, dtype=np.float64))
    y = numerics.log(np.ones((2, 3), dtype=np.float32)[:, ::2])   # non-contiguous view
    assert y.shape == (2, 2) and y.dtype == np.float32 and (bits(y) == 0).all()


def test_float_environment_check_passes():
    numerics.check_float_environment()
