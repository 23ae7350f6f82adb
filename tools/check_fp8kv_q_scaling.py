"""Host model of two steps of the fp8 KV-cache decode (ffi/cuda/attention/decode/), run on the CPU:

1. bf16 q -> f16 (LoadQRows, decode_fp8kv::QRowExponent / Pow2): each row times 2^e with its max
   |q| in [2^14, 2^15), converted round-to-nearest; checks on every bf16 binade as a row max,
   zero / subnormal / inf / NaN rows, mixed-binade rows and 2000 random rows of 1e-35..1e35: no
   overflow, elements within 2^-31 of the row max exact, the rest off by at most 2^-25 in scaled
   units, and a score's error far under float32 accumulation's.
2. The V fragments of decode_fp8kv::SoftmaxPv: one byte permute for two n tiles gives the pairs
   the former one-permute-per-tile code gave, at kD = 64 and 128.

  python3 tools/check_fp8kv_q_scaling.py   (numpy and ml_dtypes, both jax's dependencies)
"""
import numpy as np
import ml_dtypes
bf16, f16 = ml_dtypes.bfloat16, np.float16

def qrow_exponent(amax):  # QRowExponent: float32 exponent field
    biased = (np.float32(amax).view(np.uint32) >> 23) & 0xff
    return min(141 - int(biased), 126)

def pow2(e):
    assert -126 <= e <= 127
    return np.uint32((127 + e) << 23).view(np.float32)

def scale_row(qb):  # qb: bf16 row -> (f16 row, inv_pow2 float32)
    x = qb.astype(np.float32)
    amax = np.float32(0)
    for v in np.abs(x):
        amax = np.fmax(amax, v)  # fmaxf drops NaN
    e = qrow_exponent(amax)
    with np.errstate(over='ignore', under='ignore', invalid='ignore'):
        scaled = (x * pow2(e)).astype(np.float32)
        h = scaled.astype(f16)   # round to nearest even, as __float2half_rn
    return h, pow2(-e), e

rng = np.random.default_rng(0)
def check_row(qb, name):
    h, inv, e = scale_row(qb)
    x = qb.astype(np.float64)
    finite = np.isfinite(x).all()
    if not finite:
        # inf stays inf, NaN stays NaN: the row's output is non-finite as the reference's
        assert np.array_equal(np.isnan(h), np.isnan(x)) and np.array_equal(np.isinf(h), np.isinf(x)), name
        return
    assert np.isfinite(h).all(), (name, 'overflow')
    back = h.astype(np.float64) * float(inv)
    amax = np.abs(x).max()
    err = np.abs(back - x)
    if amax == 0:
        assert (back == 0).all(); return
    assert np.abs(h.astype(np.float64)).max() < 2.0**15, name
    assert amax * 2.0**e >= 2.0**14 or e == 126, (name, e)
    exact = np.abs(x) >= amax * 2.0**-31 if e < 126 else np.abs(x) * 2.0**e >= 2.0**-17
    assert (err[exact] == 0).all(), (name, 'inexact above 2^-31 of max')
    # below: rounding of an f16 subnormal, half its ulp 2^-25, in unscaled units
    assert (err <= 2.0**-25 * float(inv) * 1.0000001).all(), (name, err.max())
    # a score's error against fp32 accumulation's: sum |err_i| |k_i| vs 2^-24 sum |q_i| |k_i|
    k = rng.uniform(-448, 448, x.shape)
    s_err = np.abs(err * k).sum(); s_mag = np.abs(x * k).sum()
    assert s_err <= 2.0**-30 * s_mag or s_err <= 2.0**-30 * amax * 448, (name, s_err, s_mag)

D = 128
rows = {
  'normal': rng.standard_normal(D),
  'huge': rng.standard_normal(D) * 1e30,
  'bf16 max': np.full(D, float(ml_dtypes.finfo(bf16).max)) * np.sign(rng.standard_normal(D)),
  'tiny': rng.standard_normal(D) * 1e-30,
  'bf16 subnormal': rng.integers(1, 127, D) * 2.0**-133,
  'zeros': np.zeros(D),
  'one nonzero': np.where(np.arange(D) == 5, 3.0, 0.0),
  'wide range': rng.standard_normal(D) * 2.0 ** rng.integers(-60, 20, D),
  'max and flushers': np.concatenate([[2.0**20], 2.0 ** -rng.integers(0, 60, D - 1) * 2.0**20]),
  'inf': np.where(np.arange(D) == 3, np.inf, 1.0),
  'nan': np.where(np.arange(D) == 3, np.nan, 1.0),
}
for _ in range(2000):
    rows[f'rand{_}'] = rng.standard_normal(D) * 10.0 ** rng.uniform(-35, 35)
for name, r in rows.items():
    check_row(np.asarray(r).astype(bf16), name)
# every bf16 binade as a row max
for b in range(-133, 128):
    check_row((np.array([1.0, -0.75, 0.3, 1e-3]) * 2.0**b).astype(bf16), f'binade {b}')
print('q scaling: all', len(rows) + 261, 'rows ok')

# V permutes: old (one pair per permute) vs new (two pairs per permute) give the same B fragments.
def byte_perm(x, y, s):
    b = [(x >> (8 * i)) & 0xff for i in range(4)] + [(y >> (8 * i)) & 0xff for i in range(4)]
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))
for kd in (64, 128):
    lane_bytes = kd // 8
    w = rng.integers(0, 2**32, (4, lane_bytes // 4), dtype=np.uint64).astype(int)
    old = {}
    for t in range(kd // 8):
        sel = (t % 4) | ((4 + t % 4) << 4)
        old[t] = (byte_perm(w[0][t // 4], w[1][t // 4], sel) & 0xffff,
                  byte_perm(w[2][t // 4], w[3][t // 4], sel) & 0xffff)
    for t in range(0, kd // 8, 2):
        b0 = t % 4
        sel = b0 | ((4 + b0) << 4) | ((b0 + 1) << 8) | ((5 + b0) << 12)
        r01 = byte_perm(w[0][t // 4], w[1][t // 4], sel)
        r23 = byte_perm(w[2][t // 4], w[3][t // 4], sel)
        assert (r01 & 0xffff, r23 & 0xffff) == old[t]
        assert (r01 >> 16, r23 >> 16) == old[t + 1]
print('V permutes: same fragments as one pair per permute, kD 64 and 128')
