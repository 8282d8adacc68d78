"""Audit of the Flax layers as a user runs them (linen and NNX under jax.jit): split
weights, input dtypes and ranks, empty batches, stacks of mismatched layer counts."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import qjax
import flax_layers
from conftest import rel_err
from test_sharding import _mesh

TOL = 1e-5  # the CPU's XLA path accumulates in float32


def _f32(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _ref(x, w, bias=None):
  """float64 ``x @ dequantize(w) (+ bias)``."""
  y = np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64)
  return y if bias is None else y + np.asarray(bias, np.float64)


@pytest.mark.parametrize("mode", ["column", "row"])
def test_int4_layers_take_a_sharded_weight(rng, mode):
  """A ``qjax.ShardedWeight`` kernel (as ``qjax.matmul`` takes it): outside shard_map the
  global product, inside each device's (was an AttributeError on ``.astype``)."""
  k, n = 256, 64
  w = qjax.quantize(_f32(rng, (k, n), 1 / 16), group_size=64, symmetric=False)
  bias = _f32(rng, (n,))
  x = _f32(rng, (2, 3, k))
  want = _ref(x, w, bias)
  mesh = _mesh(2)
  sw = qjax.ShardedWeight.of(w, mesh, "tp", mode)
  y = jax.jit(lambda p, x: flax_layers.Int4Dense(n).apply({"params": p}, x))(
      {"kernel": sw, "bias": bias}, x)
  assert y.shape == (2, 3, n) and rel_err(y, want) < TOL
  layer = flax_layers.Int4Linear(k, n, kernel=sw)
  layer.bias = flax_layers.dense.nnx.Param(bias)
  np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(y))

  # Inside shard_map: column-wise each device's columns and bias slice; row-wise x's
  # slice of K, the partial products summed, the bias added once.
  if mode == "column":
    x_spec, b_spec, out_spec, local_n = P(), P("tp"), P(None, None, "tp"), n // 2
  else:
    x_spec, b_spec, out_spec, local_n = P(None, None, "tp"), P(), P(), n

  def body(kernel, b, x):
    return flax_layers.Int4Dense(local_n).apply({"params": {"kernel": kernel, "bias": b}}, x)

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(sw.partition_specs(), b_spec, x_spec),
                              out_specs=out_spec))
  assert rel_err(run(sw, bias, x), want) < TOL


def test_non_float_x_is_named_as_x(rng):
  """An int x with dtype=None: the error names x's dtype and what to do (it named a
  ``dtype=int32`` the user never set); with dtype=float32 the int x is cast."""
  k, n = 128, 24
  w = qjax.quantize(_f32(rng, (k, n), 1 / 16), group_size=64)
  xi = jnp.asarray(rng.integers(-8, 8, (3, k)), jnp.int32)
  match = r"x of dtype int32 with dtype=None .* cast x or set the layer's dtype="
  with pytest.raises(ValueError, match=match):
    flax_layers.Int4Dense(n, use_bias=False).apply({"params": {"kernel": w}}, xi)
  with pytest.raises(ValueError, match=match):
    flax_layers.Int4Linear(k, n, kernel=w, use_bias=False)(xi)
  # The MoE block checks before it reads a param.
  moe = flax_layers.MXFP4MoE(num_experts=4, top_k=2, intermediate_size=32)
  with pytest.raises(ValueError, match=match):
    moe.apply({"params": {}}, xi[:, :64])
  with pytest.raises(ValueError, match=r"dtype=int8 must be bfloat16, float16 or float32"):
    moe.clone(dtype=jnp.int8).apply({"params": {}}, _f32(rng, (3, 64)))
  y = flax_layers.Int4Dense(n, use_bias=False, dtype=jnp.float32).apply(
      {"params": {"kernel": w}}, xi)
  assert y.dtype == jnp.float32 and rel_err(y, _ref(xi, w)) < TOL


def test_x_without_a_feature_axis_is_named(rng):
  """A scalar x: a ValueError saying x needs [..., K] (was an IndexError / unpacking
  error from inside the layer)."""
  w = qjax.quantize(_f32(rng, (128, 16), 1 / 16), group_size=64)
  x = jnp.float32(0.5)
  with pytest.raises(ValueError, match=r"x of shape \(\) has no feature axis"):
    flax_layers.Int4Dense(16).apply({"params": {"kernel": w, "bias": jnp.zeros(16)}}, x)
  with pytest.raises(ValueError, match=r"x of shape \(\) has no feature axis"):
    flax_layers.CodebookDense(16).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"x of shape \(\) has no feature axis"):
    flax_layers.MXFP4MoE(num_experts=2, top_k=1, intermediate_size=32).init(
        jax.random.key(0), x)
  # Rank 1 still works, as one row.
  xv = _f32(rng, (128,))
  y = flax_layers.Int4Dense(16, use_bias=False).apply({"params": {"kernel": w}}, xv)
  assert y.shape == (16,) and rel_err(y, _ref(xv, w)) < TOL


def test_moe_block_empty_batch(rng):
  """No tokens (x ``[2, 0, D]``): zeros ``[2, 0, D]`` as the dense layers give, and init
  makes the same params as with tokens (was a ValueError from qjax.moe_matmul)."""
  d = 64
  layer = flax_layers.MXFP4MoE(num_experts=4, top_k=2, intermediate_size=32, use_bias=True,
                               implementation="xla")
  x = _f32(rng, (2, 3, d))
  init = jax.jit(layer.init)
  params = init(jax.random.key(3), x)["params"]
  empty_params = init(jax.random.key(3), x[:, :0])["params"]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, empty_params)
  y = jax.jit(layer.apply)({"params": params}, x[:, :0].astype(jnp.bfloat16))
  assert y.shape == (2, 0, d) and y.dtype == jnp.bfloat16
  assert jax.jit(layer.apply)({"params": params}, x).shape == (2, 3, d)


class _Layer(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(flax_layers.Int4Dense(128, group_size=64)(h)), None


def test_scan_layers_refuses_stacks_of_other_lengths(rng):
  """A param stacked over fewer (or more) layers than the others: a ValueError naming it,
  against the count most params share (a shorter stack was read clamped, its last layer
  reused, a longer one cut)."""
  x = _f32(rng, (2, 128))
  per_layer = [_Layer().init(jax.random.key(i), x, None)["params"] for i in range(3)]
  for p in per_layer:
    p["Int4Dense_0"]["bias"] = _f32(rng, (128,))
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
  h = np.asarray(x, np.float64)
  for p in per_layer:
    h = np.tanh(_ref(h, p["Int4Dense_0"]["kernel"], p["Int4Dense_0"]["bias"]))
  final, _ = jax.jit(lambda p, x: flax_layers.scan_layers(_Layer(), p, x))(stacked, x)
  assert rel_err(final, h) < TOL
  bias = stacked["Int4Dense_0"]["bias"]
  for bad in (bias[:2], jnp.concatenate([bias, bias])):
    wrong = {"Int4Dense_0": dict(stacked["Int4Dense_0"], bias=bad)}
    # bias is the first leaf; the two kernel arrays' count of 3 is the reference.
    with pytest.raises(ValueError, match=(
        rf"stacked_params\['Int4Dense_0'\]\['bias'\] of shape \({bad.shape[0]}, 128\) does "
        r"not have the leading \[layers\] axis of stacked_params\['Int4Dense_0'\]\['kernel'\]"
        r"\.codes \(3 layers, as 2 of the 3 params have\)")):
      flax_layers.scan_layers(_Layer(), wrong, x)
  with pytest.raises(ValueError, match="all 1 of stacked_params' leaves are scalars"):
    flax_layers.scan_layers(_Layer(), {"b": jnp.float32(1)}, x)
