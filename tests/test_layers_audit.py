"""Audit of the Flax layers as a user runs them (linen and NNX under jax.jit): split
weights, input dtypes and ranks, empty batches, stacks of mismatched layer counts."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
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


# ------------------------------------------------------ session 48's audit of the layers


def _stack(ws):
  return jax.tree.map(lambda *a: jnp.stack(a), *ws)


@pytest.mark.parametrize("quantize", [
    lambda w: qjax.quantize(w, group_size=64),
    lambda w: qjax.quantize_codebook(w, group=64),
    qjax.quantize_mxfp4,
])
def test_a_stacked_weight_without_layer_of_is_named(rng, quantize):
  """Stacked (nn.scan) kernels given to a layer as they are: INT4 and codebook failed in a
  reshape deep in the matmul ("cannot reshape array of shape (3, 2, 8)"); every format
  now names the stack and qjax.layer_of."""
  stack = _stack([quantize(_f32(rng, (128, 64))) for _ in range(3)])
  x = _f32(rng, (2, 128))
  with pytest.raises(ValueError, match=r"of shape \(128, 64\) holds arrays that dequantize to "
                     r"\(3, 128, 64\): a stack of weights.*qjax\.layer_of\(stack, i\)"):
    qjax.matmul(x, stack)
  with pytest.raises(ValueError, match="a stack of weights"):
    flax_layers.Int4Dense(64).apply({"params": {"kernel": stack, "bias": jnp.zeros(64)}}, x)
  got = qjax.matmul(x, qjax.layer_of(stack, 1))
  want = _ref(x, jax.tree.map(lambda a: a[1], stack))
  assert rel_err(got, want) < TOL


@pytest.mark.parametrize("quantize", [
    qjax.quantize, qjax.quantize_mxfp4, qjax.quantize_nvfp4,
    lambda w: qjax.quantize_codebook(w, group=64),
    lambda w: flax_layers.quantize_dense_params({"kernel": w}),
])
def test_quantizing_a_quantized_weight_is_named(rng, quantize):
  """Was an AttributeError ('Int4Weight' object has no attribute 'dtype')."""
  w = qjax.quantize(_f32(rng, (128, 64)), group_size=64)
  with pytest.raises(ValueError, match=r"is already quantized \(Int4Weight of shape "
                     r"\(128, 64\)\); quantize the float weight"):
    quantize(w)


@pytest.mark.parametrize("make", [
    lambda: flax_layers.Int4Dense(0).init(jax.random.key(0), jnp.ones((1, 128))),
    lambda: flax_layers.CodebookDense(-4).init(jax.random.key(0), jnp.ones((1, 128))),
    lambda: flax_layers.Int4Linear(128, 0, rngs=nnx.Rngs(0)),
    lambda: flax_layers.CodebookLinear(0, 64, rngs=nnx.Rngs(0)),
    lambda: flax_layers.MXFP4MoE(num_experts=0, top_k=1, intermediate_size=64).init(
        jax.random.key(0), jnp.ones((1, 64))),
    lambda: flax_layers.MXFP4MoE(num_experts=4, top_k=1, intermediate_size=0).init(
        jax.random.key(0), jnp.ones((1, 64))),
])
def test_zero_or_negative_widths_are_named(make):
  """Were a ZeroDivisionError or a broadcasting TypeError from the initializers."""
  with pytest.raises(ValueError, match=r"(features|num_experts|intermediate_size)=-?\d+ "
                     "must be a positive int"):
    make()


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale_dtype=jnp.int8), r"QuantRule\.scale_dtype=.*must be bfloat16, float16 or "
     "float32"),
    (dict(group_size=128.0), r"QuantRule\.group_size=128\.0 must be one of .* \(an int\)"),
])
def test_quant_rule_refuses_bad_options_at_once(kwargs, match):
  """An int8 scale_dtype was accepted and failed later without the parameter's path; a
  float group size passed the rule and was refused by qjax.quantize."""
  with pytest.raises(ValueError, match=match):
    flax_layers.QuantRule("kernel$", **kwargs)


def test_quantize_model_names_a_single_rule_and_stacked_kernels(rng):
  """One QuantRule instead of a list: "'QuantRule' object is not iterable". A stacked
  kernel: the error asked to narrow a pattern that already ends in kernel$."""
  params = {"dense": {"kernel": _f32(rng, (128, 64))}}
  rule = flax_layers.QuantRule("kernel$", group_size=64)
  with pytest.raises(TypeError, match="not one rule: pass \\[rule\\]"):
    flax_layers.quantize_model(params, rule)
  stacked = {"blocks": {"kernel": _f32(rng, (3, 128, 64))}}
  with pytest.raises(ValueError, match=r"a kernel with leading axes \(3,\) \(layers stacked by "
                     r"nn\.scan, or experts\); set QuantRule\(\.\.\., stacked_axes=1\)"):
    flax_layers.quantize_model(stacked, [rule])


def test_codebook_group_errors_name_the_group_argument(rng):
  """CodebookDense(group=100) was refused as "group_size=100", a name it does not take."""
  with pytest.raises(ValueError, match=r"^group=100 is not supported"):
    flax_layers.CodebookDense(64, group=100).init(jax.random.key(0), jnp.ones((1, 128)))
  with pytest.raises(ValueError, match=r"^group=100 is not supported"):
    qjax.quantize_codebook(_f32(rng, (200, 64)), group=100)


def test_save_names_a_frozen_dict(tmp_path):
  """A FrozenDict value was stored as its keys' strings and refused for dtype <U15."""
  from flax.core import FrozenDict  # pylint: disable=g-import-not-at-top
  with pytest.raises(TypeError, match=r"'params' is a FrozenDict, not an array.*flatten "
                     "nested dicts"):
    qjax.save(tmp_path / "m.qjax", {"params": FrozenDict({"a": jnp.ones(3)})})
