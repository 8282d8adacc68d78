"""An audit of the public APIs as a demanding user meets them: sharding, host offload,
codebook layers, model-wide quantization and the Int4 layers.

Every product is checked against a float64 numpy reference written here (the weight's own
dequantization, or the format's invariant rebuilt from its rotation matrices), on random
inputs with odd shapes and leading batch axes; every misuse must raise an error that
names the bad value. The CPU platform is split into 8 devices by tests/conftest.py.
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_layers
import qjax
from conftest import rel_err, seed_from
from flax_layers import QuantRule, quantize_model, quantize_nnx_model
from qjax._src import packing
from qjax._src import rotation as rotation_lib
from test_sharding import _mesh  # a mesh of n devices, or a skip where fewer exist

TOL = 1e-5  # float32 activations, float32 accumulation


def _rng(request) -> np.random.Generator:
  return np.random.default_rng(seed_from(request.node.nodeid))


def _f32(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _ref(x, w) -> np.ndarray:
  """float64 ``x @ W`` with W the weight's own dequantization."""
  return np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64)


# -- sharding ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_sharded_matmul_with_leading_batch_axes(request, mode, n):
  """x ``[2, 3, K]``: the x and y specs cover every leading axis."""
  rng = _rng(request)
  w = qjax.quantize(_f32(rng, (512, 40), 1 / 16), group_size=64, symmetric=False)
  x = _f32(rng, (2, 3, 512))
  y = qjax.sharded_matmul(x, w, _mesh(n), "tp", mode)
  assert y.shape == (2, 3, 40) and y.dtype == jnp.float32
  assert rel_err(y, _ref(x, w)) < TOL


@pytest.mark.parametrize("mode", ["column", "row"])
def test_sharded_matmul_refuses_a_weight_split_for_another_mesh(request, mode):
  """A ShardedWeight wrapped over 2 devices, run on a mesh of 4 or along another axis:
  an error naming both, not a shape check of per-device sizes or a shard_map spec error."""
  rng = _rng(request)
  w = qjax.quantize(_f32(rng, (512, 40), 1 / 16), group_size=64)
  x = _f32(rng, (3, 512))
  sw = qjax.ShardedWeight.of(w, _mesh(2), "tp", mode)
  with pytest.raises(ValueError, match=r"split over 2 devices along 'tp', but the mesh has "
                     r"4 along it .*qjax.ShardedWeight.of\(w, mesh, axis, mode\)"):
    qjax.sharded_matmul(x, sw, _mesh(4), "tp")
  with pytest.raises(ValueError, match=r"split along mesh axis 'tp', not axis='x'"):
    qjax.sharded_matmul(x, sw, _mesh(2, "x"), "x")
  with pytest.raises(TypeError, match="already a ShardedWeight"):
    qjax.ShardedWeight.of(sw, _mesh(2), "tp", mode)
  assert rel_err(qjax.sharded_matmul(x, sw, _mesh(2), "tp"), _ref(x, w)) < TOL


@pytest.mark.parametrize("mode", ["expert", "column", "row"])
def test_sharded_moe_matmul_refuses_a_weight_split_for_another_mesh(request, mode):
  rng = _rng(request)
  w = qjax.quantize_mxfp4(_f32(rng, (4, 256, 40), 1 / 16))
  x = _f32(rng, (3, 256))
  ids = jnp.asarray(rng.integers(0, 4, (3, 2)), jnp.int32)
  sw = qjax.ShardedWeight.of(w, _mesh(2), "tp", mode)
  with pytest.raises(ValueError, match=r"split over 2 devices along 'tp', but the mesh has 4"):
    qjax.sharded_moe_matmul(x, sw, ids, _mesh(4), "tp")


@pytest.mark.parametrize("mode", ["column", "row"])
def test_sharded_matmul_x_of_the_wrong_k_names_the_global_sizes(request, mode):
  """Row-parallel, x is split along K inside: the error must name the whole x and K,
  not a device's half of each."""
  rng = _rng(request)
  w = qjax.quantize(_f32(rng, (512, 40), 1 / 16), group_size=64)
  with pytest.raises(ValueError, match=r"x.shape=\(3, 256\): the last dim must equal "
                     r"K=512 of the weight of shape \(512, 40\)"):
    qjax.sharded_matmul(_f32(rng, (3, 256)), w, _mesh(2), "tp", mode)
  experts = qjax.quantize_mxfp4(_f32(rng, (4, 256, 40), 1 / 16))
  ids = jnp.zeros((3, 2), jnp.int32)
  with pytest.raises(ValueError, match=r"x.shape=\(3, 128\): the last dim must equal K=256"):
    qjax.sharded_moe_matmul(_f32(rng, (3, 128)), experts, ids, _mesh(2), "tp", mode)


def test_tp_forward_refuses_params_not_sharded_for_its_mesh():
  from test_sharding import llama_case  # pylint: disable=g-import-not-at-top
  cfg, params, tokens = llama_case(False)
  sharded = flax_layers.shard_llama_params(params, _mesh(2), cfg)
  with pytest.raises(ValueError, match=r"params/layers_0/attn/./kernel: the ShardedWeight is "
                     r"split over 2 devices along 'tp', but the mesh has 4.*place the "
                     r"params with shard_llama_params\(params, mesh, cfg, axis\)"):
    flax_layers.tp_forward(sharded, tokens, cfg=cfg, mesh=_mesh(4))
  with pytest.raises(ValueError, match=r"params/layers_0/attn/./kernel: a Int4Weight, not a "
                     r"qjax.ShardedWeight; place the params with shard_llama_params"):
    flax_layers.tp_forward(params, tokens, cfg=cfg, mesh=_mesh(2))


# -- codebook weights, their layers, host offload ------------------------------------------


def _invariant(w: qjax.CodebookWeight) -> np.ndarray:
  """float64 ``[K, N]`` from the docstring's invariant: ``W_g = Pi_g^T @ (codebook[idx_g]
  * norms_g / sqrt(d))`` per pass, pass 2 with ``seed + 1``."""
  k, n = w.shape
  d = w.group_size
  out = np.zeros((k, n))
  passes = [(w.codes, w.norms, w.codebook, w.seed)]
  if w.codes2 is not None:
    passes.append((w.codes2, w.norms2, w.codebook2, w.seed + 1))
  for codes, norms, codebook, seed in passes:
    idx = np.asarray(packing.unpack_codes(jax.device_put(codes), k, packing.NATIVE_TILE_K))
    levels = np.asarray(codebook, np.float64)[idx.astype(int)].reshape(k // d, d, n)
    rotated = levels * np.asarray(norms, np.float64)[:, None, :] / np.sqrt(d)
    pi = np.asarray(rotation_lib.matrices(w.rotation, d, k // d, seed), np.float64)
    out += np.einsum("gij,gin->gjn", pi, rotated).reshape(k, n)
  return out


@pytest.mark.parametrize("rotation", rotation_lib.ROTATIONS)
@pytest.mark.parametrize("group,passes", [(64, 2), (128, 1), (128, 2)])
def test_codebook_layers_follow_the_invariant(request, rotation, group, passes):
  """The rotation on the right side (W's rows, x's columns), both passes summed: the
  matmul and both layers against the invariant rebuilt from the rotation matrices."""
  rng = _rng(request)
  k, n = 384, 24
  wf = _f32(rng, (k, n), 1 / 16)
  w = qjax.quantize_codebook(wf, group=group, passes=passes, rotation=rotation, seed=11)
  want_w = _invariant(w)
  assert np.abs(want_w - np.asarray(w.dequantize(), np.float64)).max() < 1e-5
  # The invariant is a good approximation of the float weight (the rotation is inverted).
  assert rel_err(want_w, wf) < (0.12 if passes == 1 else 0.015)
  x = _f32(rng, (2, 3, k))
  bias = _f32(rng, (n,))
  want = np.asarray(x, np.float64) @ want_w + np.asarray(bias, np.float64)
  assert rel_err(qjax.matmul(x, w) + bias, want) < TOL
  dense = flax_layers.CodebookDense(n).apply({"params": {"kernel": w, "bias": bias}}, x)
  linear = flax_layers.CodebookLinear(k, n, kernel=w)
  linear.bias = nnx.Param(bias)
  assert rel_err(dense, want) < TOL
  np.testing.assert_array_equal(np.asarray(linear(x)), np.asarray(dense))


def test_codebook_linear_offload_of_a_one_pass_kernel_is_refused(request):
  """quantize_codebook refuses offload_pass2 without a pass 2; so must the layer given a
  kernel, instead of dropping the option."""
  rng = _rng(request)
  one = qjax.quantize_codebook(_f32(rng, (128, 16)), passes=1)
  with pytest.raises(ValueError, match=r"offload_pass2=True needs a two-pass "
                     r"CodebookWeight kernel, got passes=1"):
    flax_layers.CodebookLinear(128, 16, kernel=one, offload_pass2=True)
  int4 = qjax.quantize(_f32(rng, (128, 16)), group_size=64)
  with pytest.raises(ValueError, match=r"got Int4Weight"):
    flax_layers.CodebookLinear(128, 16, kernel=int4, offload_pass2=True)
  two = qjax.quantize_codebook(_f32(rng, (128, 16)), passes=2)
  layer = flax_layers.CodebookLinear(128, 16, kernel=two, offload_pass2=True)
  assert layer.kernel.codes2.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("bad", [0, 3])
def test_stack_layers_refuses_mixed_norm_dtypes(request, bad):
  """Layers whose norms differ in dtype cannot share one scan: an error naming the
  layer and the dtypes, not a pytree-structure error from inside the scan."""
  rng = _rng(request)
  ws = [qjax.quantize_codebook(_f32(rng, (128, 128)), passes=2, seed=3,
                               norm_dtype=jnp.float16 if i == bad else jnp.bfloat16)
        for i in range(6)]
  with pytest.raises(ValueError, match=r"has norms / norms2 of dtypes \('(float16|bfloat16)'"
                     r".*same norm_dtype"):
    qjax.stack_layers(ws)


def test_stacked_forward_offloaded_equals_on_device_odd_layer_count(request):
  """Pass 2 in pinned host memory gives exactly the on-device result, 5 layers (scanned
  pairs and a tail), x with leading batch axes."""
  rng = _rng(request)
  ws = [qjax.quantize_codebook(_f32(rng, (128, 128)), passes=2, seed=5) for _ in range(5)]
  x = _f32(rng, (2, 3, 128))
  forward = qjax.make_stacked_forward(implementation="xla")
  host = forward(qjax.stack_layers(ws, offload_pass2=True), x)
  device = forward(qjax.stack_layers(ws, offload_pass2=False), x)
  np.testing.assert_array_equal(np.asarray(host), np.asarray(device))
  h = np.asarray(x, np.float64)
  for w in ws:
    h = h @ _invariant(w)
    h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)
  assert rel_err(host, h) < 1e-4


def test_place_pass2_memory_kinds_are_named():
  with pytest.raises(ValueError, match=r"memory_kind='unpinned_host' must be one of"):
    qjax.place_pass2({}, "unpinned_host")


# -- model-wide quantization, Int4 layers ---------------------------------------------------


def test_quant_rule_symmetric_must_be_a_bool():
  """``symmetric="no"`` is truthy: it would quantize symmetrically, silently."""
  with pytest.raises(ValueError, match=r"QuantRule.symmetric='no' must be True"):
    QuantRule("kernel", symmetric="no")


def test_quantize_model_linen_and_nnx_agree_on_the_same_weights(request):
  """The same float weights through quantize_model (linen params, Int4Dense) and
  quantize_nnx_model (nnx.Linear -> Int4Linear): equal outputs, both near float64."""
  rng = _rng(request)
  k, h, n = 96, 160, 24  # K=96 and 160 only divide into groups of 32
  up, down = _f32(rng, (k, h), 1 / 8), _f32(rng, (h, n), 1 / 8)
  b_up, b_down = _f32(rng, (h,), 0.1), _f32(rng, (n,), 0.1)
  rules = [QuantRule(r"up/kernel$", group_size=32, symmetric=False),
           QuantRule(r"kernel$", group_size=None)]

  class LinenMlp(nn.Module):

    @nn.compact
    def __call__(self, x):
      y = jax.nn.relu(flax_layers.Int4Dense(h, name="up")(x))
      return flax_layers.Int4Dense(n, name="down")(y)

  class NnxMlp(nnx.Module):

    def __init__(self):
      self.up = nnx.Linear(k, h, rngs=nnx.Rngs(0))
      self.down = nnx.Linear(h, n, rngs=nnx.Rngs(1))
      self.up.kernel, self.up.bias = nnx.Param(up), nnx.Param(b_up)
      self.down.kernel, self.down.bias = nnx.Param(down), nnx.Param(b_down)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  params = {"up": {"kernel": up, "bias": b_up}, "down": {"kernel": down, "bias": b_down}}
  qparams, report = quantize_model(params, rules, warn_unused=False)
  assert report.quantized == {"up/kernel": rules[0], "down/kernel": rules[1]}
  qmodel, nreport = quantize_nnx_model(NnxMlp(), rules, warn_unused=False)
  assert nreport.quantized == report.quantized
  assert isinstance(qmodel.up, flax_layers.Int4Linear)
  x = _f32(rng, (2, 5, k))
  y_linen = LinenMlp().apply({"params": qparams}, x)
  y_nnx = qmodel(x)
  np.testing.assert_array_equal(np.asarray(y_linen), np.asarray(y_nnx))
  x64 = np.asarray(x, np.float64)
  hid = np.maximum(_ref(x64, qparams["up"]["kernel"]) + np.asarray(b_up, np.float64), 0)
  want = _ref(hid, qparams["down"]["kernel"]) + np.asarray(b_down, np.float64)
  assert rel_err(y_linen, want) < TOL


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("use_bias", [True, False])
def test_int4_layers_dtype_bias_and_batch_axes(request, dtype, use_bias):
  rng = _rng(request)
  k, n = 192, 40
  w = qjax.quantize(_f32(rng, (k, n), 1 / 16), group_size=64, symmetric=False)
  bias = _f32(rng, (n,))
  x = _f32(rng, (2, 3, k))
  params = {"kernel": w, **({"bias": bias} if use_bias else {})}
  y = flax_layers.Int4Dense(n, use_bias=use_bias, dtype=dtype).apply({"params": params}, x)
  layer = flax_layers.Int4Linear(k, n, kernel=w, use_bias=use_bias, dtype=dtype)
  if use_bias:
    layer.bias = nnx.Param(bias)
  want_dtype = jnp.float32 if dtype is None else dtype
  assert y.shape == (2, 3, n) and y.dtype == want_dtype
  np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(y))
  xr = np.asarray(jnp.asarray(x, want_dtype), np.float64)
  want = _ref(xr, w) + (np.asarray(bias, np.float64) if use_bias else 0)
  assert rel_err(y, want) < (TOL if dtype is None else 1e-2)


def test_int4_layers_kernel_of_the_wrong_shape_is_named(request):
  rng = _rng(request)
  w = qjax.quantize(_f32(rng, (128, 24)), group_size=64)
  x = _f32(rng, (2, 128))
  with pytest.raises(ValueError, match=r"kernel of logical shape \(128, 24\) does not fit x "
                     r"with 128 features and features=32"):
    flax_layers.Int4Dense(32).apply({"params": {"kernel": w, "bias": jnp.zeros(32)}}, x)
  with pytest.raises(ValueError, match=r"kernel of logical shape \(128, 24\) is not "
                     r"\(128, 32\)"):
    flax_layers.Int4Linear(128, 32, kernel=w)
