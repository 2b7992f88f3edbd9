"""The simulator's fma32 against pyfa_fma as the host C++ compiler builds it (std::fmaf, what
the emulator runs), bit for bit, on about 11 million adversarial cases; and the NaN rule
pyfa_canonical_nan against its twin canonical_nan.

Needs g++ (skipped without it). The C side is tests/numerics/numerics_check.cpp.
"""

import importlib.util
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CHECK_SRC = REPO / "tests" / "numerics" / "numerics_check.cpp"

_spec = importlib.util.spec_from_file_location("_pyfa_sim_numerics_fma_under_test",
                                               REPO / "pyfa" / "sim" / "numerics.py")
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)

F32 = np.float32
CANONICAL_NAN = 0x7FC00000


def bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def f32_exact(x64):
    """float64 values that must be float32 values, as float32 (asserts nothing was rounded)."""
    y = np.asarray(x64, np.float64).astype(np.float32)
    assert np.array_equal(y.astype(np.float64), x64, equal_nan=True), "case not a float32 value"
    return y


@pytest.fixture(scope="module")
def c_side(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    d = tmp_path_factory.mktemp("fma")
    exe = d / "numerics_check"
    subprocess.run([gxx, "-std=c++17", "-O2", "-ffp-contract=off", "-I", str(REPO / "src"),
                    str(CHECK_SRC), "-o", str(exe)], check=True)

    def run(fn, *arrays):
        inp, out = d / f"{fn}.in", d / f"{fn}.out"
        flat = [np.ascontiguousarray(a, np.float32).reshape(-1) for a in arrays]
        np.concatenate(flat).tofile(inp)
        subprocess.run([str(exe), fn, str(inp), str(out)], check=True)
        return np.fromfile(out, dtype=np.float32)

    return run


# --------------------------------------------------------------------------- the cases

def random_bits(rng, n):
    """Every class at once: NaNs with payloads, infinities, zeros, subnormals, normals."""
    return tuple(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(F32)
                 for _ in range(3))


def normals(rng, n):
    return tuple(rng.standard_normal(n, dtype=F32) for _ in range(3))


def cancellation(rng, n):
    """c within a few float32 ulps of -a*b: the exact sum is a few bits of the product's tail."""
    a, b = rng.standard_normal(n, dtype=F32), rng.standard_normal(n, dtype=F32)
    c = -(a * b)
    c = (bits(c).astype(np.int64) + rng.integers(-4, 5, n)).astype(np.uint32).view(F32)
    return a, b, c


def ties(rng, n, exponents, c_lo=2**23):
    """a*b + c on or next to a float32 midpoint, in both directions.

    a = A 2^ea, b = B 2^eb with A = x 2^16 + 1, B = x 2^16 - 1 (x odd, below 2^7), so that
    a*b = (x^2 2^32 - 1) 2^E, E = ea + eb: an odd multiple of h = 2^(E+32) minus a tail of
    2^E. c = C 2^(E+33) with C up to 2^24 puts the sum where the float32 spacing is 2h (or
    below 2^-126, where it is 2^-149 = 2h when E = -182), so the sum lies 2^E off a float32
    midpoint: far less than half a float64 ulp, so adding in float64 lands exactly on the
    midpoint and only the correction rounds it the right way. A quarter of the cases drop
    the tail (A = B = x 2^16): true ties, rounded to even. Random signs give both
    directions."""
    x = 2 * rng.integers(0, 64, n) + 1
    E = rng.choice(exponents, n)
    true_tie = rng.random(n) < 0.25
    A = np.where(true_tie, x * 2**16, x * 2**16 + 1).astype(np.float64)
    B = np.where(true_tie, x * 2**16, x * 2**16 - 1).astype(np.float64)
    ea = E // 2
    eb = E - ea
    C = rng.integers(c_lo, 2**24, n).astype(np.float64)
    sign = lambda: np.where(rng.random(n) < 0.5, -1.0, 1.0)
    a = f32_exact(sign() * np.ldexp(A, ea))
    b = f32_exact(sign() * np.ldexp(B, eb))
    c = f32_exact(sign() * np.ldexp(C, E + 33))
    return a, b, c


def subnormal_results(rng, n):
    """Products and sums below 2^-126: the float32 result has fewer significant bits."""
    a = f32_exact(np.ldexp(rng.uniform(1, 2, n).astype(F32).astype(np.float64),
                           rng.integers(-80, -40, n)))
    b = f32_exact(np.ldexp(rng.uniform(1, 2, n).astype(F32).astype(np.float64),
                           rng.integers(-110, -40, n)) * np.where(rng.random(n) < 0.5, -1, 1))
    c = (rng.integers(0, 1 << 24, n, dtype=np.uint64).astype(np.uint32)
         | np.where(rng.random(n) < 0.5, np.uint32(0x80000000), np.uint32(0))).view(F32)
    c = np.where(rng.random(n) < 0.1, F32(0), c)
    return a, b, c


def overflow_threshold(rng, n):
    """Sums at and around 2^128 - 2^103, the midpoint between FLT_MAX and the first value
    that rounds to infinity, with tails either way; and c = +-FLT_MAX against products of
    all sizes."""
    a1, b1, c1 = ties(rng, n // 2, np.array([70, 71]), c_lo=2**24 - 64)
    fmax = np.finfo(F32).max
    m = n - n // 2
    a2 = rng.standard_normal(m, dtype=F32) * F32(2.0 ** 60)
    b2 = rng.standard_normal(m, dtype=F32) * F32(2.0 ** rng.integers(20, 70))
    c2 = np.where(rng.random(m) < 0.5, fmax, -fmax).astype(F32)
    return np.concatenate([a1, a2]), np.concatenate([b1, b2]), np.concatenate([c1, c2])


def signed_zeros(rng, n):
    """Exact zero sums (a*b = -c, both exact), zero products and zero addends of both signs."""
    a = f32_exact(rng.integers(-2**11, 2**11, n) * np.ldexp(1.0, rng.integers(-60, 50, n)))
    b = f32_exact(rng.integers(-2**11, 2**11, n) * np.ldexp(1.0, rng.integers(-50, 50, n)))
    c = -(a * b)  # exact: 22 significant bits at most, normal range
    pick = rng.integers(0, 4, n)
    zero = lambda: np.where(rng.random(n) < 0.5, F32(-0.0), F32(0.0))
    a = np.where(pick == 1, zero(), a)
    c = np.where(pick == 2, zero(), c)
    b = np.where(pick == 3, zero(), b)
    return a, b, c


def special_operands(rng, n):
    """NaN (several payloads, both signs), +-Inf, +-0, +-FLT_MAX, the smallest subnormals and
    ordinary numbers in every position."""
    pool = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA12345, 0xFFFFFFFF,
                     0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF,
                     0x00000001, 0x80000001, 0x3F800000, 0xBF800000, 0x40490FDB],
                    np.uint32).view(F32)
    return tuple(pool[rng.integers(0, pool.size, n)] for _ in range(3))


CASES = {
    "random bit patterns": (random_bits, 3_000_000),
    "standard normals": (normals, 1_000_000),
    "cancellation": (cancellation, 1_000_000),
    "ties, normal range": (lambda rng, n: ties(rng, n, np.arange(-150, 70)), 3_000_000),
    "ties, subnormal results": (lambda rng, n: ties(rng, n, np.array([-182]), c_lo=2**21), 500_000),
    "subnormal results": (subnormal_results, 1_000_000),
    "overflow threshold": (overflow_threshold, 500_000),
    "signed zeros": (signed_zeros, 500_000),
    "NaN and Inf operands": (special_operands, 500_000),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fma32_equals_c_fmaf_bit_for_bit(name, c_side):
    make, n = CASES[name]
    rng = np.random.default_rng(list(CASES).index(name))
    a, b, c = make(rng, n)
    assert a.dtype == b.dtype == c.dtype == F32 and a.size == b.size == c.size == n
    want = c_side("fma", a, b, c)
    got = numerics.fma32(a, b, c)
    nan = np.isnan(want)
    # NaN payloads are not part of the contract: every stored NaN is canonicalised.
    assert np.array_equal(np.isnan(got), nan), f"{name}: NaN where C has none, or the reverse"
    bad = np.flatnonzero(bits(got)[~nan] != bits(want)[~nan])
    assert bad.size == 0, (f"{name}: {bad.size} of {n} differ, first "
                           f"a={a[~nan][bad[0]]!r} b={b[~nan][bad[0]]!r} c={c[~nan][bad[0]]!r}")


def naive(a, b, c):
    """a*b + c through float64, rounded twice: what fma32 corrects."""
    with np.errstate(over="ignore"):
        return (a.astype(np.float64) * b + c).astype(F32)


@pytest.mark.parametrize("name", ["ties, normal range", "ties, subnormal results",
                                  "overflow threshold"])
def test_the_tie_cases_need_the_correction(name, c_side):
    """The constructed ties really are double-rounding traps, in both directions (the naive
    float64 route rounds some of them wrong, up and down), and include true ties."""
    make, n = CASES[name]
    a, b, c = make(np.random.default_rng(100), 200_000)
    want = c_side("fma", a, b, c)
    wrong = naive(a, b, c) != want
    assert wrong.sum() > 1000, f"{name}: only {wrong.sum()} cases defeat the naive route"
    too_big = np.abs(naive(a, b, c)[wrong].astype(np.float64)) > np.abs(want[wrong])
    assert 0 < too_big.sum() < wrong.sum(), "the traps should fail both ways"


def test_fma32_keeps_shapes_scalars_and_dtypes():
    a = np.arange(6, dtype=F32).reshape(2, 3)
    y = numerics.fma32(a, F32(2), np.ones(3, F32))
    assert y.dtype == F32 and y.shape == (2, 3)
    assert np.array_equal(y, a * 2 + 1)
    s = numerics.fma32(F32(3), F32(4), F32(5))
    assert isinstance(s, np.float32) and s == 17
    with pytest.raises(TypeError):
        numerics.fma32(np.ones(2), np.ones(2, F32), np.ones(2, F32))


def test_dot_rows_is_a_chain_of_fmas():
    """dot_rows equals fma32 applied step by step, x in order from +0, and differs from the
    unfused multiply-then-add somewhere (so the fusion is really there)."""
    rng = np.random.default_rng(7)
    A = rng.standard_normal((3, 17, 40), dtype=F32)
    Bm = rng.standard_normal((3, 11, 40), dtype=F32)
    want = np.zeros((3, 17, 11), F32)
    unfused = np.zeros((3, 17, 11), F32)
    for x in range(40):
        want = numerics.fma32(A[:, :, None, x], Bm[:, None, :, x], want)
        unfused = unfused + A[:, :, None, x] * Bm[:, None, :, x]
    got = numerics.dot_rows(A, Bm)
    assert np.array_equal(bits(got), bits(want))
    assert not np.array_equal(bits(got), bits(unfused))
    assert np.array_equal(bits(numerics.dot(A[:, :, None], Bm[:, None])), bits(want))


def test_canonical_nan_matches_c(c_side):
    rng = np.random.default_rng(3)
    x = np.concatenate([random_bits(rng, 1_000_000)[0],
                        np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000,
                                  0x80000000], np.uint32).view(F32)])
    got = numerics.canonical_nan(x)
    assert np.array_equal(bits(got), bits(c_side("nan", x)))
    nan = np.isnan(x)
    assert np.all(bits(got)[nan] == CANONICAL_NAN)
    assert np.array_equal(bits(got)[~nan], bits(x)[~nan])
