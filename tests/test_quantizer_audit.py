"""The quantizers under extreme and hostile inputs, against float64 numpy implementations
of their documented rules: float64 weights beyond float32, tensors near float32's
smallest normal, huge and tiny codebook weights, empty shapes, the MX scale's ends."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qjax
from qjax._src import int4

QUANTIZERS = {
    "int4-sym": lambda w, **kw: qjax.quantize(w, group_size=32, **kw),
    "int4-asym": lambda w, **kw: qjax.quantize(w, group_size=32, symmetric=False, **kw),
    "mxfp4": qjax.quantize_mxfp4,
    "nvfp4": qjax.quantize_nvfp4,
    "codebook": lambda w, **kw: qjax.quantize_codebook(w, group=64, **kw),
}
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _weight(seed=0, k=64, n=8, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal((k, n)).astype(dtype)


def _rel_err(deq, w) -> float:
  w = np.asarray(w, np.float64)
  return float(np.linalg.norm(np.asarray(deq, np.float64) - w) / np.linalg.norm(w))


def np_round_e2m1(v: np.ndarray) -> np.ndarray:
  """float64 -> nearest E2M1 value (ml_dtypes' round to nearest even), saturating at 6."""
  a = np.minimum(np.abs(v), 6.0)
  return np.sign(v) * a.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)


def np_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """float64 OCP MX rule: (E8M0 exponents [K // 32, N], E2M1 values [K, N])."""
  k, n = w.shape
  wb = w.astype(np.float64).reshape(k // 32, 32, n)
  amax = np.abs(wb).max(axis=1)
  with np.errstate(divide="ignore"):
    shared = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
  shared = np.clip(shared, -127, 127)
  values = np_round_e2m1(wb / 2.0 ** shared[:, None, :])
  return shared.astype(int), values.reshape(k, n)


def np_int4(w: np.ndarray, group: int, symmetric: bool) -> np.ndarray:
  """float64 min-max round-to-nearest INT4 quantize-dequantize (the docstring's rule)."""
  k, n = w.shape
  g = w.astype(np.float64).reshape(k // group, group, n)
  if symmetric:
    s = np.abs(g).max(1) / 7
    safe = np.where(s > 0, s, 1.0)[:, None]
    return (np.clip(np.round(g / safe), -8, 7) * s[:, None]).reshape(k, n)
  lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
  s = (hi - lo) / 15
  safe = np.where(s > 0, s, 1.0)
  z = np.clip(np.round(-lo / safe), 0, 15)[:, None]
  q = np.clip(np.round(g / safe[:, None]) + z, 0, 15)
  return ((q - z) * s[:, None]).reshape(k, n)


# ----------------------------------------------------------------- hostile weights


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_float64_beyond_float32_raises_naming_the_value(kind):
  """A finite float64 weight of 1e300 became Inf in float32: MXFP4 silently stored
  0.75 for it, NVFP4 NaN for its whole tensor, INT4 blamed its "scales", the codebook
  called it non-finite."""
  w = _weight(k=128).astype(np.float64)
  w[37, 5] = -1e300
  with pytest.raises(ValueError, match=r"^layers\.0\.q has 1 values beyond float32's range "
                     r"\(first at index \(37, 5\): -1e\+300\)"):
    QUANTIZERS[kind](w, name="layers.0.q")


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_float64_within_float32_quantizes_like_float32(kind):
  w = _weight(1, k=128) * 1e30
  a = QUANTIZERS[kind](w.astype(np.float64))
  b = QUANTIZERS[kind](w)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_codebook_non_finite_names_the_position():
  w = _weight(k=128)
  w[70, 3] = np.nan
  with pytest.raises(ValueError, match=r"^up has 1 non-finite values \(first at index "
                     r"\(70, 3\): nan\)"):
    qjax.quantize_codebook(w, name="up")


@pytest.mark.parametrize("magnitude", [1e-35, 1e-36, 1e-37])
def test_nvfp4_tiny_tensor_gives_finite_scales(magnitude):
  """amax / (6 * 448) below float32's smallest normal was flushed to 0, and every block
  scale became amax / 0 = NaN in e4m3 (silently: the whole tensor decoded as NaN)."""
  w = (_weight(2) * np.float32(magnitude)).astype(np.float32)
  qw = qjax.quantize_nvfp4(w)
  scales = np.asarray(qw.scales).astype(np.float32)
  assert np.isfinite(scales).all() and scales.max() <= 448
  assert float(qw.global_scale) == max(np.abs(w).max() / np.float32(2688),
                                       np.finfo(np.float32).tiny)
  deq = np.asarray(qw.dequantize(), np.float64)
  assert np.isfinite(deq).all()
  if magnitude >= 1e-36:  # far enough above float32's smallest normal to keep precision
    assert _rel_err(deq, w) < 0.15


def test_nvfp4_global_scale_of_zero_and_ordinary_tensors():
  zero = qjax.quantize_nvfp4(np.zeros((32, 4), np.float32))
  assert float(zero.global_scale) == 1.0
  assert (np.asarray(zero.scales).astype(np.float32) == 0).all()
  w = _weight(3)
  w[17, 2] = 9.0  # the tensor's amax: its block scale saturates e4m3 at exactly 448
  qw = qjax.quantize_nvfp4(w)
  assert float(qw.global_scale) == np.float32(9.0) / np.float32(6 * 448)
  assert np.asarray(qw.scales).astype(np.float32)[1, 2] == 448.0
  assert np.asarray(qw.dequantize())[17, 2] == pytest.approx(9.0, rel=1e-6)


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_empty_shapes_are_refused_or_kept(kind):
  """NVFP4 with K = 0 failed in jnp.max ("zero-size array to reduction operation")."""
  for shape in ((0, 4), (64, 0)):
    try:
      qw = QUANTIZERS[kind](np.zeros(shape, np.float32))
    except ValueError as e:
      assert "must be positive" in str(e), e
    else:
      assert qw.shape == shape


def test_int4_per_channel_empty_k_is_refused():
  """group_size=None with K = 0 divided by zero (ZeroDivisionError)."""
  with pytest.raises(ValueError, match=r"^w has shape \(0, 4\); K and N must be positive"):
    qjax.quantize(np.zeros((0, 4), np.float32), group_size=None)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, np.float64])
@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_input_dtypes_and_one_column(kind, dtype):
  w = _weight(4, k=128, n=1)
  w = w.astype(np.float64) if dtype is np.float64 else jnp.asarray(w, dtype)
  qw = QUANTIZERS[kind](w)
  ref = QUANTIZERS[kind](np.asarray(w, np.float32))
  np.testing.assert_array_equal(np.asarray(qw.dequantize()), np.asarray(ref.dequantize()))
  assert qw.shape == (128, 1)


# -------------------------------------------------------------------------- INT4


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e30])
def test_int4_within_2_percent_of_float64_rule(symmetric, magnitude):
  w = _weight(5, k=128, n=16) * np.float32(magnitude)
  w[3, 0] = 50 * magnitude  # a single huge value in a group
  w[32:64, 1] = 0.0  # an all-zero group
  qw = qjax.quantize(w, group_size=32, symmetric=symmetric, scale_dtype=jnp.float32)
  ours = np.asarray(qw.dequantize(), np.float64)
  ref = np_int4(w, 32, symmetric)
  err, err_ref = np.linalg.norm(ours - w), np.linalg.norm(ref - w)
  assert abs(err / err_ref - 1) < 0.02, (err, err_ref)
  assert (ours[32:64, 1] == 0).all()


def test_int4_mse_never_worse_than_minmax_per_group():
  w = np.random.default_rng(6).standard_t(2, (128, 8)).astype(np.float32)
  err = lambda method: np.sum(
      (np.asarray(qjax.quantize(w, group_size=32, method=method, scale_dtype=jnp.float32)
                  .dequantize(), np.float64) - w).reshape(4, 32, 8) ** 2, axis=1)
  assert (err("mse") <= err("minmax") * (1 + 1e-6)).all()


# ------------------------------------------------------------------------- MXFP4


def test_mxfp4_matches_float64_rule_in_every_binade():
  """Codes and E8M0 exponents equal the float64 OCP rule for block maxima from 2**-100
  to the float32 maximum, maxima exactly at powers of two and just under them, and
  values that round to 6 or saturate (scaled amax in [4, 8) always)."""
  rng = np.random.default_rng(7)
  exps = np.arange(-100, 128, 7)
  w = rng.uniform(-1, 1, (96, exps.size)) * 2.0 ** exps
  w[0] = 2.0 ** exps  # block 0: max exactly a power of two
  w[32] = 2.0 ** exps * (1 - 2.0 ** -24)  # block 1: just under one (rounds to 8 -> 6)
  w[64] = 2.0 ** exps * 1.4375  # block 2: 5.75 scaled: rounds to 6, the largest value
  w[65] = -(2.0 ** exps) * 1.25  # 5.0 scaled: a tie, to 4 (even)
  w = w.astype(np.float32)
  w[-1, -1] = np.finfo(np.float32).max  # block 2 of the last column: 2**127 * 1.99
  qw = qjax.quantize_mxfp4(w)
  shared, values = np_mxfp4(w)
  np.testing.assert_array_equal(np.asarray(qw.scales).astype(int) - 127, shared)
  codes = np.asarray(qw.unpacked_codes()).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
  np.testing.assert_array_equal(codes, values)
  assert np.asarray(qw.scales).max() == 125 + 127  # float32 max: 2**127 * 1.99 -> 2**125
  np.testing.assert_array_equal(np.abs(codes[64, :-1]), 6.0)
  np.testing.assert_array_equal(codes[65, :-1], -4.0)
  assert codes[-1, -1] == 6.0 and codes[64, -1] == 0.5  # 2**124 * 1.4375 / 2**125


def test_mxfp4_scale_clamps_at_2_to_the_minus_127():
  """Blocks whose rule exponent is below -127 clamp to E8M0's smallest scale (byte 0);
  their codes are the rule's for 2**-127."""
  w = np.zeros((64, 3), np.float32)
  w[0, 0] = 2.0 ** -126  # floor(log2) - 2 = -128 -> -127: 2**-126 / 2**-127 = 2
  w[1, 0] = 2.0 ** -126 * 1.5  # 3
  w[32, 1] = 2.0 ** -124  # exactly -126 -> no clamp: 4
  qw = qjax.quantize_mxfp4(w)
  e = np.asarray(qw.scales).astype(int) - 127
  assert e[0, 0] == -127 and e[1, 1] == -126 and e[0, 2] == -127
  codes = np.asarray(qw.unpacked_codes()).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
  assert codes[0, 0] == 2 and codes[1, 0] == 3 and codes[32, 1] == 4


# ---------------------------------------------------------------------- codebook


@pytest.mark.parametrize("power", [-70, 70, 120])
def test_codebook_is_scale_invariant(power):
  """Sums of squares overflowed float32 for weights above 1e18 (NaN norms, NaN weight)
  and underflowed below 1e-19 (every norm 0: the weight decoded to zeros)."""
  w = _weight(8, k=128, n=8)
  base = qjax.quantize_codebook(w, group=64, norm_dtype=jnp.float32)
  big = qjax.quantize_codebook(w * np.float32(2.0 ** power), group=64,
                               norm_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(big.codes), np.asarray(base.codes))
  np.testing.assert_array_equal(np.asarray(big.norms),
                                np.asarray(base.norms) * np.float32(2.0 ** power))


def test_codebook_single_huge_value_in_a_group():
  w = _weight(9, k=128, n=8)
  w[5, 0] = 1e30
  deq = np.asarray(qjax.quantize_codebook(w, group=64).dequantize(), np.float64)
  assert np.isfinite(deq).all()
  assert abs(deq[5, 0] / 1e30 - 1) < 0.1
  np.testing.assert_allclose(deq[:, 1:], np.asarray(
      qjax.quantize_codebook(w[:, 1:], group=64).dequantize()))


@pytest.mark.parametrize("magnitude", [1e4, 1e-9])
def test_codebook_float16_norms_out_of_range_fall_back_to_float32(magnitude):
  """float16 norms overflowed silently (weights of 1e4: Inf norms, NaN weight) or lost
  precision as subnormals (1e-8: 14 % error); now float32 with a warning, as INT4."""
  w = _weight(10, k=128, n=8)
  w[:, 3:] *= np.float32(magnitude)
  with pytest.warns(int4.ScaleRangeWarning, match=r"^big: \d+ norms do not fit float16 .* "
                    "using float32 norms"):
    qw = qjax.quantize_codebook(w, group=64, norm_dtype=jnp.float16, name="big")
  assert qw.norms.dtype == jnp.float32
  deq = np.asarray(qw.dequantize(), np.float64)
  assert np.isfinite(deq).all()
  assert _rel_err(deq[:, 3:], w[:, 3:]) < 0.12


def test_codebook_float16_norms_in_range_stay_float16():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    qw = qjax.quantize_codebook(_weight(11, k=128) * 100, group=64, passes=2,
                                norm_dtype=jnp.float16)
  assert qw.norms.dtype == jnp.float16 and qw.norms2.dtype == jnp.float16


def test_codebook_norms_beyond_float32_raise():
  w = _weight(12, k=128, n=4)
  w[:, 2] = np.float32(3e38) * np.sign(w[:, 2])
  with pytest.raises(ValueError, match=r"norms of huge in float32 has 1 non-finite"):
    qjax.quantize_codebook(w, group=128, norm_dtype=jnp.float32, name="huge")


def test_codebook_jit_skips_the_checks():
  w = _weight(13, k=128)
  qw = jax.jit(lambda a: qjax.quantize_codebook(a, group=64, norm_dtype=jnp.float16))(w)
  ref = qjax.quantize_codebook(w, group=64, norm_dtype=jnp.float16)
  assert qw.norms.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(qw.codes), np.asarray(ref.codes))
