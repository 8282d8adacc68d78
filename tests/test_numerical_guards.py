"""Quantizers refuse NaN and Inf, give all-zero groups zero scales, and never let a
scale overflow its dtype silently."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import int4

QUANTIZERS = {
    "int4-sym": lambda w, **kw: qjax.quantize(w, group_size=32, **kw),
    "int4-asym": lambda w, **kw: qjax.quantize(w, group_size=32, symmetric=False, **kw),
    "mxfp4": qjax.quantize_mxfp4,
    "nvfp4": qjax.quantize_nvfp4,
}


def _rel_err(deq, w) -> float:
  w = np.asarray(w, np.float64)  # float32 norms of 1e30-sized values overflow
  return float(np.linalg.norm(np.asarray(deq, np.float64) - w) / np.linalg.norm(w))


def _weight(seed=0, k=64, n=16):
  return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_non_finite_weights_raise_naming_the_tensor(kind, bad):
  w = _weight()
  w[37, 5] = bad
  with pytest.raises(ValueError, match=r"layers\.3\.mlp\.up has 1 non-finite values "
                     r"\(first at index \(37, 5\)"):
    QUANTIZERS[kind](w, name="layers.3.mlp.up")


def test_non_finite_check_skips_traced_weights():
  """Documented: under jit the values are unknown, so nothing is checked."""
  w = _weight()
  w[0, 0] = np.nan
  qw = jax.jit(lambda a: qjax.quantize(a, group_size=32))(w)
  assert qw.shape == w.shape


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_all_zero_groups_give_zero_weights_without_nan(kind):
  w = _weight(1)
  w[:32, :4] = 0.0       # whole 32-row groups (16- and 32-row blocks too) of 4 columns
  w[:, 10] = 0.0         # a whole column
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    qw = QUANTIZERS[kind](w)
  deq = np.asarray(qw.dequantize())
  assert np.isfinite(deq).all()
  assert (deq[:32, :4] == 0).all() and (deq[:, 10] == 0).all()
  if kind.startswith("int4"):
    scales = np.asarray(qw.scales, np.float32)
    assert (scales[0, :4] == 0).all() and (scales[:, 10] == 0).all()
  y = qjax.matmul(jnp.ones((2, 64), jnp.float32), qw, implementation="xla")
  assert np.isfinite(np.asarray(y)).all()


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_all_zero_matrix(kind):
  qw = QUANTIZERS[kind](np.zeros((64, 8), np.float32))
  deq = np.asarray(qw.dequantize())
  assert np.isfinite(deq).all() and (deq == 0).all()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("magnitude", [1e6, 1e-9])
def test_float16_scales_out_of_range_fall_back_to_float32(symmetric, magnitude):
  w = _weight(2) * magnitude
  w[:, :3] = _weight(3)[:, :3]  # columns of ordinary size: only some groups are out of range
  with pytest.warns(int4.ScaleRangeWarning, match=r"^big\.w: \d+ group scales do not fit "
                    r"float16 .* using float32 scales"):
    qw = qjax.quantize(w, group_size=32, symmetric=symmetric, scale_dtype=jnp.float16,
                       name="big.w")
  assert qw.scales.dtype == jnp.float32
  deq = np.asarray(qw.dequantize(), np.float64)
  err = _rel_err(deq, w)
  assert np.isfinite(deq).all() and err < 0.2, err


def test_float16_scales_in_range_stay_float16():
  w = _weight(4) * 100.0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    qw = qjax.quantize(w, group_size=32, scale_dtype=jnp.float16)
  assert qw.scales.dtype == jnp.float16


def test_bfloat16_scales_hold_extreme_ranges():
  w = _weight(5) * 1e30
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    qw = qjax.quantize(w, group_size=32, scale_dtype=jnp.bfloat16)
  deq = np.asarray(qw.dequantize(), np.float64)
  assert _rel_err(deq, w) < 0.2


def test_range_beyond_float32_raises():
  w = np.zeros((32, 2), np.float32)
  w[0, 1], w[1, 1] = -3e38, 3e38  # max - min overflows float32
  with pytest.raises(ValueError, match=r"scales of huge in float32 has 1 non-finite"):
    qjax.quantize(w, group_size=32, symmetric=False, scale_dtype=jnp.float32, name="huge")


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("magnitude", [1e30, 1e-30])
def test_fp4_extreme_ranges_stay_finite(kind, magnitude):
  w = _weight(6) * magnitude
  deq = np.asarray(QUANTIZERS[kind](w).dequantize(), np.float64)
  assert np.isfinite(deq).all()
  assert _rel_err(deq, w) < 0.3
