"""NumPy twins of src/common/numerics.h: pyfa's float32 max, exp, log and tanh.

Every function performs exactly the float32 operations of its C/CUDA twin, in the same
order, vectorized over arrays, so that the simulator reproduces the kernels' bits.
Rules that keep it that way (docs/numerics.md, "1. Arithmetic"):

* every constant is an np.float32 made from the same hex literal as in the header, and
  every intermediate stays float32 (a float64 operand would silently promote); the one
  exception is fma32, which computes in float64 internally and returns float32;
* one NumPy ufunc per C operation, and fma32 exactly where the C side calls pyfa_fma, so
  nothing is fused that C does not fuse and nothing is reassociated;
* np.exp / np.log / np.maximum are never used: they differ from the C side;
* bit manipulation goes through .view(np.int32) / .view(np.uint32).

Special cases are computed on a harmless stand-in value and selected at the end with
np.where, exactly as the C code does with ?:. Imports only numpy.
"""

import numpy as np

__all__ = ["exp", "log", "tanh", "maximum", "fma32", "canonical_nan", "check_float_environment"]


def _c(hex_literal):
    """An np.float32 constant from a C99 hex-float literal (without the 'f' suffix)."""
    value = float.fromhex(hex_literal)
    c = np.float32(value)
    if float(c) != value:  # every constant must be exactly representable
        raise ValueError(f"{hex_literal} is not a float32 value")
    return c


_ONE = _c("0x1p+0")
_TWO = _c("0x1p+1")
_HALF = _c("0x1p-1")
_ZERO = _c("0x0p+0")
_INF = np.float32(np.inf)
_QNAN = np.array([0x7FC00000], dtype=np.uint32).view(np.float32)[0]

# exp (names and values as in numerics.h, PYFA_ prefix dropped)
_EXP_X_HI = _c("0x1.62e42ep+6")    # largest float whose exp is finite
_EXP_X_LO = _c("-0x1.9fe368p+6")   # smallest float whose exp rounds to non-zero
_LOG2E = _c("0x1.715476p+0")
_LN2_HI = _c("0x1.62e4p-1")        # 16 significant bits: n * LN2_HI exact for |n| < 256
_LN2_LO = _c("0x1.7f7d1cp-20")
_ROUND_MAGIC = _c("0x1.8p+23")     # 1.5 * 2^23
_ROUND_MAGIC_BITS = np.int32(0x4B400000)
_EXP_C2 = _c("0x1.fffffcp-2")
_EXP_C3 = _c("0x1.555418p-3")
_EXP_C4 = _c("0x1.555824p-5")
_EXP_C5 = _c("0x1.1267f2p-7")
_EXP_C6 = _c("0x1.6ae6c6p-10")

# log
_LOG_SQRT2 = _c("0x1.6a09e6p+0")
_LOG_D1 = _c("0x1.55557ap-1")
_LOG_D2 = _c("0x1.995eacp-2")
_LOG_D3 = _c("0x1.31e4fap-2")
_MIN_NORMAL = _c("0x1p-126")

# tanh
_TANH_SMALL = _c("0x1.8p-1")       # below: the odd polynomial; from it on: 1 - 2/(E + 1)
_TANH_CLAMP = _c("0x1.3p+3")       # |x| clamped at 9.5: tanh rounds to 1 from 9.011 on
_TANH_T = tuple(_c(h) for h in ("-0x1.555548p-2", "0x1.110d92p-3", "-0x1.b97804p-5",
                                "0x1.5f504p-6", "-0x1.f4bf78p-8", "0x1.c497cap-10"))  # T1..T6
# 2^n of E = p * 2^n as exact doublings: (a power of two m, 2^m), largest first
_TANH_DOUBLINGS = tuple((np.float32(m), _c(f"0x1p+{m}")) for m in (16, 8, 4, 2, 1))
_TANH_TINY = _c("0x1p-12")         # below: tanh x rounds to x
_TWO_POW_23 = _c("0x1p+23")


def _prepare(x):
    """Returns (float32 ndarray, was_scalar). Refuses NumPy data of another dtype: a
    float64 intermediate handed over by mistake would otherwise be rounded silently."""
    if isinstance(x, (np.ndarray, np.generic)):
        if x.dtype != np.float32:
            raise TypeError(f"sim.numerics takes float32 data, got {x.dtype}")
        arr = np.asarray(x)
    else:  # Python numbers and lists of them
        arr = np.asarray(x, dtype=np.float32)
    return arr, arr.ndim == 0


def _flat(x):
    """A contiguous 1-d float32 copy or view, so that .view() works for any input."""
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _finish(y, scalar):
    return y[()] if scalar else y


# Elements per step: the temporaries of one step then stay (mostly) in cache, which measured
# 2.5-4x faster than whole-array temporaries (docs/numerics_exp_log.md).
_CHUNK = 1 << 16


def _apply(kernel, x):
    x0, scalar = _prepare(x)
    flat = _flat(x0)
    out = np.empty(flat.shape, dtype=np.float32)
    with np.errstate(all="ignore"):  # inf and NaN are intended results
        for start in range(0, flat.size, _CHUNK):
            y = kernel(flat[start:start + _CHUNK])
            if y.dtype != np.float32:  # a promotion would break the bit-for-bit contract
                raise AssertionError(f"sim.numerics computed in {y.dtype}")
            out[start:start + _CHUNK] = y
    return _finish(out.reshape(x0.shape), scalar)


def maximum(a, b):
    """pyfa_max: (b > a) ? b : a. NaN in b is ignored, NaN in a propagates, ties
    (including -0 vs +0) keep a. Broadcasts like any ufunc."""
    a, sa = _prepare(a)
    b, sb = _prepare(b)
    with np.errstate(invalid="ignore"):
        y = np.where(b > a, b, a)
    return _finish(y, sa and sb)


def exp(x):
    """pyfa_exp, bit for bit: float32 in, float32 out, elementwise (scalars give an
    np.float32). See numerics.h for why each step is there."""
    return _apply(_exp_chunk, x)


def log(x):
    """pyfa_log, bit for bit: float32 in, float32 out, elementwise (scalars give an
    np.float32). See numerics.h for why each step is there."""
    return _apply(_log_chunk, x)


def tanh(x):
    """pyfa_tanh, bit for bit: float32 in, float32 out, elementwise (scalars give an
    np.float32). See numerics.h for why each step is there."""
    return _apply(_tanh_chunk, x)


def _exp_chunk(x):
    # Clamp (NaN takes X_LO: the comparison is false), compute, select specials last.
    xc = np.where(x >= _EXP_X_LO, x, _EXP_X_LO)
    xc = np.where(xc > _EXP_X_HI, _EXP_X_HI, xc)

    t = xc * _LOG2E
    t = t + _ROUND_MAGIC
    nf = t - _ROUND_MAGIC
    n = t.view(np.int32) - _ROUND_MAGIC_BITS
    r = xc - nf * _LN2_HI
    r = r - nf * _LN2_LO

    q = _EXP_C6 * r + _EXP_C5
    q = q * r + _EXP_C4
    q = q * r + _EXP_C3
    q = q * r + _EXP_C2
    r2 = r * r
    q = r2 * q
    q = r + q
    p = q + _ONE

    n1 = ((n + np.int32(150)) >> np.int32(1)) - np.int32(75)
    n2 = n - n1
    s1 = ((n1 + np.int32(127)) << np.int32(23)).view(np.float32)
    s2 = ((n2 + np.int32(127)) << np.int32(23)).view(np.float32)
    y = p * s1
    y = y * s2

    y = np.where(x > _EXP_X_HI, _INF, y)
    y = np.where(x < _EXP_X_LO, _ZERO, y)
    y = np.where(x != x, x, y)
    return y


def _log_chunk(x):
    xs = np.where(x > _ZERO, x, _ONE)
    xs = np.where(xs < _INF, xs, _ONE)

    sub = xs < _MIN_NORMAL
    xs = np.where(sub, xs * _TWO_POW_23, xs)
    ebias = np.where(sub, np.int32(-23 - 127), np.int32(-127))

    ix = xs.view(np.uint32)
    e = (ix >> np.uint32(23)).astype(np.int32) + ebias
    m = ((ix & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000)).view(np.float32)
    big = m > _LOG_SQRT2
    m = np.where(big, m * _HALF, m)
    e = np.where(big, e + np.int32(1), e)

    f = m - _ONE
    s = f / (f + _TWO)
    z = s * s
    R = _LOG_D3 * z + _LOG_D2
    R = R * z + _LOG_D1
    R = R * z
    lm = f - R
    lm = s * lm
    lm = f - lm

    ef = e.astype(np.float32)
    y = ef * _LN2_LO
    y = y + lm
    y = ef * _LN2_HI + y

    y = np.where(x == _INF, _INF, y)
    y = np.where(x == _ZERO, -_INF, y)
    y = np.where(x < _ZERO, _QNAN, y)
    y = np.where(x != x, x, y)
    return y


def _tanh_chunk(x):
    a = np.where(x < _ZERO, -x, x)

    z = x * x
    T1, T2, T3, T4, T5, T6 = _TANH_T
    q = z * T6 + T5
    q = q * z + T4
    q = q * z + T3
    q = q * z + T2
    q = q * z + T1
    q = q * z
    small = x + x * q

    u = np.where(a < _TANH_CLAMP, a, _TANH_CLAMP)
    u = u + u
    t = u * _LOG2E
    t = t + _ROUND_MAGIC
    nf = t - _ROUND_MAGIC
    r = u - nf * _LN2_HI
    r = r - nf * _LN2_LO
    p = r * _EXP_C6 + _EXP_C5
    p = p * r + _EXP_C4
    p = p * r + _EXP_C3
    p = p * r + _EXP_C2
    r2 = r * r
    p = r2 * p
    p = r + p
    E = p + _ONE
    k = nf
    for power, factor in _TANH_DOUBLINGS:
        step = k >= power
        E = np.where(step, E * factor, E)
        k = np.where(step, k - power, k)
    big = _TWO / (E + _ONE)
    big = _ONE - big
    big = np.where(x < _ZERO, -big, big)

    y = np.where(a < _TANH_SMALL, small, big)
    y = np.where(a < _TANH_TINY, x, y)
    y = np.where(x != x, x, y)
    return y


def check_float_environment():
    """Raises RuntimeError unless float32 arithmetic in this process is plain IEEE:
    subnormal results survive (no flush-to-zero), subnormal inputs are not read as zero
    (no denormals-are-zero), and rounding is to nearest-even. A shared library built with
    -ffast-math switches the whole process to FTZ/DAZ when it is loaded; the simulator
    would then silently stop matching the kernels."""
    tiny = np.float32(1e-38)
    milli = np.float32(1e-3)
    sub = np.float32(1e-40)
    two = np.float32(2.0)
    one = np.float32(1.0)
    eps_half = np.float32(2.0 ** -24)
    problems = []
    with np.errstate(all="ignore"):
        # Scalar and array paths (the latter goes through the SIMD loops).
        if tiny * milli == 0 or (np.array([tiny] * 8, np.float32) * milli == 0).any():
            problems.append("float32 subnormal results are flushed to zero (FTZ)")
        if sub * two == 0 or (np.array([sub] * 8, np.float32) * two == 0).any():
            problems.append("float32 subnormal inputs are read as zero (DAZ)")
        if one + eps_half != one or one + np.float32(3 * 2.0 ** -24) != np.float32(1 + 2.0 ** -22):
            problems.append("float32 rounding is not round-to-nearest-even")
    if problems:
        raise RuntimeError(
            "sim.numerics: the floating-point environment is not IEEE default ("
            + "; ".join(problems)
            + "); was a library built with -ffast-math loaded into this process?"
        )


check_float_environment()


def safe_max(m):
    """The row max to subtract before exp (numerics.h safe_max): -inf, a row that has
    seen no visible key yet, is taken as 0 so that exp(-inf - m) is 0, never NaN."""
    m = np.asarray(m, dtype=np.float32)
    return np.where(m == -_INF, _ZERO, m)


# ------------------------------------------------------------------------------------- fma
# fma32 mirrors pyfa_fma (fmaf: a*b + c rounded once). The product of two float32 numbers is
# exact in float64 (24 + 24 significant bits < 53), so p + c rounded to float64 and then to
# float32 rounds twice. That second rounding goes wrong only when the first one lands
# exactly on a midpoint between two adjacent float32 numbers while the exact sum was not
# there: the cast then breaks a tie that is not one. Those sums are found by their bits and
# moved one float64 ulp toward the exact sum (its TwoSum residual says which way), so the
# cast rounds them the right way. A zero residual is a true tie, which the cast already
# rounds to even.
_U64_ONE = np.uint64(1)
_U64_MINUS_ONE = np.uint64(0xFFFFFFFFFFFFFFFF)  # adding it subtracts one, modulo 2^64
_U64_ZERO = np.uint64(0)
# Every float32 midpoint has its low 28 float64 significand bits zero: in the float32 normal
# range a float32 ulp is 2^29 float64 ulps and a midpoint's low 29 bits are exactly 1 << 28;
# below 2^-126 midpoints are odd multiples of 2^-150, coarser still.
_LOW28 = np.uint64((1 << 28) - 1)
_LOW29 = np.uint64((1 << 29) - 1)
_HALF29 = np.uint64(1 << 28)
_F64_MIN_NORMAL32 = 2.0 ** -126
_F64_TWO_POW_150 = 2.0 ** 150
_F64_MINUS_ZERO = np.float64(-0.0)


class _FmaScratch:
    """The buffers of one fma32 step, allocated once per loop and reused at every step."""

    def __init__(self, shape):
        self.p = np.empty(shape, np.float64)   # the exact products, filled by the caller
        self.s = np.empty(shape, np.float64)   # p + c, rounded once
        self.r = np.empty(shape, np.float64)   # the float32 result, widened (exact)
        self.u = np.empty(shape, np.uint64)
        self.cand = np.empty(shape, bool)
        self.inexact = np.empty(shape, bool)


def _fma_step(c64, out, w):
    """out = fmaf(a, b, c) given w.p = a*b (float64, exact) and c64 = c (float64, exactly a
    float32 value), all C-contiguous and of one shape; also leaves w.r = float64(out). Must
    run under np.errstate(all="ignore")."""
    s = w.s
    np.add(w.p, c64, out=s)
    np.copyto(out, s, casting="same_kind")  # the float32 rounding: nearest, ties to even
    np.copyto(w.r, out)
    # Candidates for a false tie: sums with their low 28 bits zero that the cast rounded.
    # Zeros and other exact float32 values, common in padded tiles, are not candidates.
    np.bitwise_and(s.view(np.uint64), _LOW28, out=w.u)
    np.equal(w.u, _U64_ZERO, out=w.cand)
    np.not_equal(s, w.r, out=w.inexact)
    np.logical_and(w.cand, w.inexact, out=w.cand)
    if np.count_nonzero(w.cand):  # ndarray.any's Python wrapper cost more than the test
        # Flat indices, found once: the candidates are few, the arrays are not.
        idx = np.flatnonzero(w.cand)
        ss = s.reshape(-1)[idx]
        finite = ss == ss  # a NaN sum (!= itself, so a candidate) has no tie to settle
        if not finite.all():
            idx, ss = idx[finite], ss[finite]
            if not idx.size:
                return
        ss = _settle_midpoints(ss, w.p.reshape(-1)[idx], c64.reshape(-1)[idx])
        fixed = ss.astype(np.float32)
        out.reshape(-1)[idx] = fixed
        w.r.reshape(-1)[idx] = fixed


def _settle_midpoints(ss, pp, cc):
    """The candidate sums ss = pp + cc (float64, rounded once), each that sits on a float32
    midpoint the exact sum is not on moved one float64 ulp toward the exact sum, so that the
    float32 cast rounds it the right way."""
    # TwoSum: err = (pp + cc) - ss exactly.
    b_virtual = ss - pp
    err = (pp - (ss - b_virtual)) + (cc - b_virtual)
    bits = ss.view(np.uint64)
    mag = np.abs(ss)
    scaled = mag * _F64_TWO_POW_150  # exact; an odd integer iff |ss| is a subnormal midpoint
    sub_mid = (scaled == np.floor(scaled)) & (np.fmod(scaled, 2.0) == 1.0)
    normal_mid = (bits & _LOW29) == _HALF29
    mid = np.where(mag < _F64_MIN_NORMAL32, sub_mid, normal_mid)
    move = mid & (err != 0) & np.isfinite(ss)
    # bits + 1 moves away from zero, bits - 1 toward it, for either sign.
    away = (err > 0) == (ss > 0)
    bits = np.where(move, bits + np.where(away, _U64_ONE, _U64_MINUS_ONE), bits)
    return bits.view(np.float64)


def fma32(a, b, c):
    """pyfa_fma, bit for bit: a*b + c rounded once to float32 (C's fmaf), elementwise with
    broadcasting; float32 in, float32 out (scalars give an np.float32). A NaN result is a
    NaN; its payload is not part of the contract (see canonical_nan)."""
    a, sa = _prepare(a)
    b, sb = _prepare(b)
    c, sc = _prepare(c)
    shape = np.broadcast_shapes(a.shape, b.shape, c.shape)
    a, b, c = (np.ascontiguousarray(np.broadcast_to(x, shape)).reshape(-1) for x in (a, b, c))
    out = np.empty(a.size, np.float32)
    w = _FmaScratch(min(a.size, _CHUNK))
    with np.errstate(all="ignore"):
        for start in range(0, a.size, _CHUNK):
            n = min(_CHUNK, a.size - start)
            if n != w.p.size:
                w = _FmaScratch(n)
            part = slice(start, start + n)
            np.multiply(a[part], b[part], out=w.p, dtype=np.float64)
            _fma_step(c[part].astype(np.float64), out[part], w)
    return _finish(out.reshape(shape), sa and sb and sc)


_CANONICAL_NAN_BITS = np.uint32(0x7FC00000)


def canonical_nan(x):
    """pyfa_canonical_nan: every NaN becomes the one quiet NaN 0x7FC00000, anything else is
    kept. The kernels pass every float they store to global memory through it: a GPU's
    arithmetic returns its own canonical NaN where x86 and NumPy keep operand payloads, so
    only canonical NaNs compare bit for bit across backends."""
    x, scalar = _prepare(x)
    y = np.where(x != x, _CANONICAL_NAN_BITS.view(np.float32), x)
    return _finish(y, scalar)


def dot(a, b):
    """Row by row pyfa_dot: out[...] = sum_x a[..., x] * b[..., x], x in order from +0, each
    step one fma: s = fma32(a[x], b[x], s)."""
    a64 = np.ascontiguousarray(np.moveaxis(a, -1, 0), np.float64)  # (n, ...)
    b64 = np.ascontiguousarray(np.moveaxis(b, -1, 0), np.float64)
    shape = np.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    return _fma_sum(a64, b64, shape)


def dot_rows(A, B, keep=None):
    """All inner products of rows of A with rows of B, each summed like pyfa_dot:
    out[..., r, c] = sum_x A[..., r, x] * B[..., c, x], x in order from +0, each step one
    fma: s = fma32(A[r, x], B[c, x], s). A: (..., R, n), B: (..., C, n), leading axes
    broadcast; returns (..., R, C) float32. The x axis is moved to the front only so that
    each step reads contiguous slices; the operands are widened to float64 once (exactly),
    and every step works in the same reused buffers.

    keep, when given, is a bool array broadcasting against A: a step x whose A[..., r, x]
    is not kept leaves the sums of row r as they are (the kernels' selection, which leaves
    a hidden score out of a product rather than multiplying it by zero)."""
    At = np.ascontiguousarray(np.moveaxis(A, -1, 0), np.float64)[..., :, None]  # (n, ..., R, 1)
    Bt = np.ascontiguousarray(np.moveaxis(B, -1, 0), np.float64)[..., None, :]  # (n, ..., 1, C)
    shape = np.broadcast_shapes(At.shape[1:], Bt.shape[1:])
    if keep is not None:
        keep = np.moveaxis(np.broadcast_to(keep, A.shape), -1, 0)[..., :, None]  # (n, ..., R, 1)
    return _fma_sum(At, Bt, shape, keep)


def _fma_sum(a64, b64, shape, keep=None):
    """s = +0; for x in order: s = fma32(a64[x], b64[x], s); a64, b64 float64 (exactly
    float32 values) broadcasting to `shape` after their first axis. With keep (like a64):
    s stays where keep[x] is False."""
    total, w = np.zeros(shape, np.float32), _FmaScratch(shape)
    c64 = np.zeros(shape, np.float64)
    skip = None if keep is None else ~keep
    with np.errstate(all="ignore"):
        for x in range(a64.shape[0]):
            if skip is not None and not np.count_nonzero(keep[x]):
                continue
            np.multiply(a64[x], b64[x], out=w.p)
            if skip is not None:
                # A product of -0 leaves every s as it is, +-0 and Inf and NaN included, and
                # exactly: fma(a, b, s) = s + (-0) = s, so a skipped step costs no copy.
                np.copyto(w.p, _F64_MINUS_ZERO, where=skip[x])
            _fma_step(c64, total, w)
            c64, w.r = w.r, c64  # the result is the next step's addend
    return total


# The simulators' arithmetic runs under this: like the kernels, they turn Inf and NaN
# inputs into Inf and NaN results, which NumPy would otherwise report as warnings.
ieee_arithmetic = np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore")
