"""pallas_kernels.split_sum: K-split partials summed in one fixed order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import split_sum


def test_sums_left_to_right():
  # Left to right: (1e8 + 1) rounds to 1e8, minus 1e8 is 0, plus 1 is 1. Pairwise,
  # (1e8 + 1) + (-1e8 + 1) is 0: the order shows in the result.
  parts = jnp.asarray([[1e8], [1.0], [-1e8], [1.0]], jnp.float32)
  assert float(split_sum.sum_splits(parts, jnp.float32)[0]) == 1.0
  assert float(jax.jit(split_sum.sum_splits, static_argnums=1)(parts, jnp.float32)[0]) == 1.0


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7, 16])
def test_equals_the_float32_chain_then_cast(splits):
  rng = np.random.default_rng(splits)
  parts = rng.standard_normal((splits, 5, 33)).astype(np.float32) * 100
  want = parts[0].copy()
  for p in parts[1:]:
    want = (want + p).astype(np.float32)
  got = split_sum.sum_splits(jnp.asarray(parts), jnp.bfloat16)
  assert got.dtype == jnp.bfloat16 and got.shape == (5, 33)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                want.astype(jnp.bfloat16).astype(np.float32))


def test_same_bits_in_a_scan_and_alone():
  """The scanned program and the direct call sum the same partials to the same bits."""
  rng = np.random.default_rng(0)
  parts = jnp.asarray(rng.standard_normal((3, 4, 16, 128)), jnp.float32)
  alone = [jax.jit(lambda p: split_sum.sum_splits(p, jnp.bfloat16))(parts[i])
           for i in range(3)]
  scanned = jax.jit(lambda ps: jax.lax.scan(
      lambda c, p: (c, split_sum.sum_splits(p, jnp.bfloat16)), 0, ps)[1])(parts)
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(scanned[i], np.float32),
                                  np.asarray(alone[i], np.float32))


def test_refuses_no_splits():
  with pytest.raises(ValueError, match="splits >= 1"):
    split_sum.sum_splits(jnp.zeros((0, 3), jnp.float32), jnp.float32)
