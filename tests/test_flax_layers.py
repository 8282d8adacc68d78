"""Int4Dense (linen) and Int4Linear (NNX) against nn.Dense / nnx.Linear on the
dequantized kernel."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qjax
from flax_layers import Int4Dense, Int4Linear, quantize_dense_params
from conftest import on_gpu, rel_err

# On the GPU the int4 layer runs the Pallas kernel, whose f32 dots use TF32 (~3e-4).
TOL = 1e-2 if on_gpu() else 1e-5
HIGHEST = jax.lax.Precision.HIGHEST


@pytest.mark.parametrize("group_size,symmetric", [(128, True), (32, False), (None, True)])
def test_linen_matches_dense_on_dequantized_kernel(rng, group_size, symmetric):
  x = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
  dense = nn.Dense(96, precision=HIGHEST)
  params = dense.init(jax.random.key(0), x)["params"]
  params["bias"] = jnp.asarray(rng.standard_normal(96), jnp.float32)
  qparams = quantize_dense_params(params, group_size=group_size, symmetric=symmetric)
  y = jax.jit(lambda p, x: Int4Dense(96).apply({"params": p}, x))(qparams, x)
  deq = {"kernel": qparams["kernel"].dequantize(), "bias": params["bias"]}
  ref = dense.apply({"params": deq}, x)
  assert rel_err(y, ref) < TOL


def test_linen_init_and_model(rng):
  class Mlp(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = jax.nn.gelu(Int4Dense(128, group_size=64)(x))
      return Int4Dense(16, use_bias=False, dtype=jnp.bfloat16)(h)

  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  variables = Mlp().init(jax.random.key(1), x)
  k0 = variables["params"]["Int4Dense_0"]["kernel"]
  assert isinstance(k0, qjax.Int4Weight) and k0.shape == (64, 128) and k0.group_size == 64
  y = jax.jit(Mlp().apply)(variables, x)
  assert y.shape == (3, 16) and y.dtype == jnp.bfloat16
  p = variables["params"]
  h = jax.nn.gelu(np.asarray(x, np.float64) @ np.asarray(k0.dequantize(), np.float64)
                  + np.asarray(p["Int4Dense_0"]["bias"]))
  ref = h @ np.asarray(p["Int4Dense_1"]["kernel"].dequantize(), np.float64)
  assert rel_err(y, ref) < 1e-2


def test_nnx_matches_linear_and_linen(rng):
  lin = nnx.Linear(256, 48, rngs=nnx.Rngs(0))
  q = Int4Linear.from_linear(lin, group_size=128)
  x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
  ref_lin = nnx.Linear(256, 48, precision=HIGHEST, rngs=nnx.Rngs(1))
  ref_lin.kernel = nnx.Param(q.kernel.get_value().dequantize() if hasattr(q.kernel, "get_value")
                             else q.kernel.value.dequantize())
  ref_lin.bias = lin.bias
  y = nnx.jit(lambda m, x: m(x))(q, x)
  assert rel_err(y, ref_lin(x)) < TOL
  # The linen twin on the same params agrees exactly.
  kernel = q.kernel.get_value() if hasattr(q.kernel, "get_value") else q.kernel.value
  bias = q.bias.get_value() if hasattr(q.bias, "get_value") else q.bias.value
  y2 = Int4Dense(48).apply({"params": {"kernel": kernel, "bias": bias}}, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))


def test_nnx_from_prequantized_and_errors(rng):
  w = qjax.quantize(rng.standard_normal((128, 8)).astype(np.float32))
  layer = Int4Linear(128, 8, use_bias=False, kernel=w)
  assert layer(jnp.ones((1, 128))).shape == (1, 8)
  with pytest.raises(ValueError, match=r"\(128, 8\) is not \(64, 8\)"):
    Int4Linear(64, 8, kernel=w)
  with pytest.raises(ValueError, match="rngs"):
    Int4Linear(64, 8)
  with pytest.raises(ValueError, match="dtype=int32"):
    layer(jnp.ones((1, 128)).astype(jnp.int32)) if False else Int4Dense(8, dtype=jnp.int32).apply(
        {"params": {"kernel": w, "bias": jnp.zeros(8)}}, jnp.ones((1, 128)))


def _dot_precisions(jaxpr):
  """The ``precision`` of every dot_general in ``jaxpr`` and its sub-jaxprs."""
  from jax.extend import core as jex_core  # pylint: disable=g-import-not-at-top
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for sub in jex_core.jaxprs_in_params(eqn.params):
      found += _dot_precisions(sub)
  return found


def test_float_kernel_takes_the_layers_precision(rng):
  """A kernel left float (a skip rule) multiplies at the layer's ``precision``, as
  ``nn.Dense``: linen and NNX; the values match nn.Dense's at HIGHEST."""
  w = rng.standard_normal((128, 24)).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
  highest = jax.lax.Precision.HIGHEST
  for precision in (None, highest):
    layer = Int4Dense(24, use_bias=False, precision=precision)
    fn = lambda p, a: layer.apply({"params": p}, a)  # noqa: E731
    got = _dot_precisions(jax.make_jaxpr(fn)({"kernel": jnp.asarray(w)}, x).jaxpr)
    assert got and all(p in ((precision, precision), precision) for p in got), got
  y = Int4Dense(24, use_bias=False, precision=highest).apply({"params": {"kernel": w}}, x)
  want = nn.Dense(24, use_bias=False, precision=highest).apply({"params": {"kernel": w}}, x)
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
  lin = Int4Linear(128, 24, use_bias=False, precision=highest, rngs=nnx.Rngs(0))
  lin.kernel = nnx.Param(jnp.asarray(w))
  got = _dot_precisions(jax.make_jaxpr(lambda a: lin(a))(x).jaxpr)
  assert got and all(p in ((highest, highest), highest) for p in got), got
