"""``qjax.layer_of``: one layer of a stacked weight, read in place by the kernels.

Under ``lax.scan`` the layer's kernel must give bit for bit what it gives for that layer's
own arrays, and the ``pallas_call`` must receive the stacked arrays (no per-layer copy).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import bench
from conftest import needs_gpu
from conftest import pallas_operand_shapes
from flax_layers import Int4Dense, MXFP4MoE, llama
from flax_layers.scan import layer_params, scan_layers

LAYERS = 3


def _stack(ws):
  return jax.tree.map(lambda *a: jnp.stack(a), *ws)


def _weights(fmt, k, n):
  if fmt == "int4":  # asymmetric, with zero points, so every optional ref is exercised
    return [qjax.quantize(jax.random.normal(jax.random.key(i), (k, n)), group_size=64,
                          symmetric=False) for i in range(LAYERS)]
  return [bench.random_weight(fmt, k, n, jax.random.key(7 * i + 1)) for i in range(LAYERS)]


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4", "codebook"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("implementation", [
    "interpret", "xla", pytest.param("pallas", marks=needs_gpu)])
def test_scanned_layers_equal_each_layer_bit_for_bit(fmt, m, implementation):
  k, n = 256, 96
  ws = _weights(fmt, k, n)
  stack = _stack(ws)
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)

  def scanned(x, stack):
    def body(carry, i):
      return carry, qjax.matmul(x, qjax.layer_of(stack, i), implementation=implementation)
    return jax.lax.scan(body, 0, jnp.arange(LAYERS))[1]

  got = np.asarray(jax.jit(scanned)(x, stack).astype(jnp.float32))
  for i, w in enumerate(ws):
    want = np.asarray(jax.jit(lambda x, w: qjax.matmul(x, w, implementation=implementation))(
        x, w).astype(jnp.float32))
    np.testing.assert_array_equal(got[i], want, err_msg=f"layer {i}")
  if implementation != "xla":
    calls = pallas_operand_shapes(jax.make_jaxpr(scanned)(x, stack).jaxpr)
    assert calls, "no pallas_call traced"
    codes = jax.tree.leaves(stack)[0].shape
    for shapes in calls:  # the stacked codes themselves reach the kernel
      assert any(s[0] == LAYERS and s[1:] == codes[1:] for s in shapes if s), shapes


def test_an_array_the_wrapper_derives_is_passed_as_it_is():
  # Codes in the plain tile order: the kernel wrapper repacks them to its own order, a new
  # array that is not a layer slice; the result must still be each layer's.
  ws = [qjax.quantize(jax.random.normal(jax.random.key(i), (256, 64))).repack(
      qjax.PLAIN_TILE_K) for i in range(LAYERS)]
  stack = _stack(ws)
  x = jax.random.normal(jax.random.key(0), (1, 256), jnp.bfloat16)
  got = jax.lax.map(lambda i: qjax.matmul(x, qjax.layer_of(stack, i), implementation="interpret"),
                    jnp.arange(LAYERS))
  for i, w in enumerate(ws):
    np.testing.assert_array_equal(np.asarray(got[i]),
                                  np.asarray(qjax.matmul(x, w, implementation="interpret")))


@pytest.mark.parametrize("implementation", [
    "interpret", "xla", pytest.param("pallas", marks=needs_gpu)])
def test_an_index_outside_the_stack_is_clamped(implementation):
  """Kernels reading in place normalize the layer index as the XLA path's slice does
  (negative from the end, then clamped), instead of reading memory outside the stack."""
  ws = _weights("int4", 256, 96)
  stack = _stack(ws)
  x = jax.random.normal(jax.random.key(3), (2, 256), jnp.bfloat16)
  run = jax.jit(lambda x, s, i: qjax.matmul(x, qjax.layer_of(s, i),
                                            implementation=implementation))
  for index, layer in [(LAYERS + 2, LAYERS - 1), (-1, LAYERS - 1), (-LAYERS - 3, 0)]:
    want = jax.jit(lambda x, w: qjax.matmul(x, w, implementation=implementation))(
        x, ws[layer])
    np.testing.assert_array_equal(np.asarray(run(x, stack, jnp.int32(index))),
                                  np.asarray(want), err_msg=f"index {index}")


def test_normalized_index_picks_what_dynamic_index_picks():
  from qjax._src import stacked  # pylint: disable=g-import-not-at-top
  layers = jnp.arange(LAYERS)
  for index in range(-2 * LAYERS, 2 * LAYERS):
    want = int(jax.lax.dynamic_index_in_dim(layers, jnp.int32(index), keepdims=False))
    assert int(stacked.normalized_index(jnp.int32(index), LAYERS)) == want, index


def test_layer_of_rejects_bad_arguments():
  w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  stack = _stack([w, w])
  with pytest.raises(TypeError, match="quantized weight"):
    qjax.layer_of(jnp.ones((2, 256, 64)), 0)
  with pytest.raises(TypeError, match="integer scalar"):
    qjax.layer_of(stack, jnp.zeros((2,), jnp.int32))
  with pytest.raises(TypeError, match="integer scalar"):
    qjax.layer_of(stack, 0.5)
  ragged = qjax.Int4Weight(codes=stack.codes, scales=stack.scales[:1], zeros=None,
                           shape=w.shape, group_size=w.group_size)
  with pytest.raises(ValueError, match="leading sizes \\[1, 2\\]"):
    qjax.layer_of(ragged, 0)
  view = qjax.layer_of(stack, 1)
  assert view.shape == (256, 64) and view.num_layers == 2
  assert view.format_cls is qjax.Int4Weight
  assert qjax.implementation_name(view, "xla") == "xla"


def test_layer_of_a_split_stack():
  """A ShardedWeight of a stack (tensor-parallel scanned layers) is a valid stack too; its
  layers have the stack's format (end-to-end: tests/test_sharding.py)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  split = qjax.ShardedWeight.of(_stack([w, w, w]), mesh, "tp", "column")
  view = qjax.layer_of(split, 2)
  assert view.format_cls is qjax.Int4Weight and view.num_layers == 3
  assert view.shape == (256, 64)
  assert qjax.implementation_name(view, "interpret") == "pallas_triton-interpret"
  assert qjax.implementation_name(view, "xla") == "xla"
  x = jnp.ones((1, 256), jnp.float32)
  np.testing.assert_array_equal(np.asarray(qjax.matmul(x, view, implementation="xla")),
                                np.asarray(qjax.matmul(x, w, implementation="xla")))


def test_llama_scan_hands_the_kernels_the_stacked_weights(tmp_path):
  # The small AWQ Llama that test_hf_checkpoint writes (it needs safetensors).
  import test_hf_checkpoint as hf_case  # pylint: disable=g-import-not-at-top

  qdir, _, _ = hf_case._write_case(tmp_path, np.random.default_rng(0), "awq")
  cfg, params = hf_case.hf.load_hf_llama(qdir, progress=False,
                                         convert=lambda n, w: w.to_int4())
  cfg = dataclasses.replace(cfg, implementation="interpret", dtype=jnp.bfloat16)
  tokens = jnp.asarray(hf_case.TOKENS)
  jaxpr = jax.make_jaxpr(lambda p: llama.forward(p, tokens, cfg=cfg))(params).jaxpr
  calls = pallas_operand_shapes(jaxpr)
  # The prompt's causal attention kernel, traced once in the scan body, takes q, k, v
  # [batch, seq, heads, head_dim] and the window [1]; the matmuls take x [M, K].
  attention_calls = [shapes for shapes in calls if len(shapes[0]) == 4]
  assert len(attention_calls) == 1, calls
  calls = [shapes for shapes in calls if len(shapes[0]) == 2]
  # q, k, v, o, gate, up and down, traced once in the scan body, take the stacked codes
  # and the layer index ([1] int32, last); the output head is a plain call.
  in_layers = [shapes for shapes in calls if shapes[-1] == (1,)]
  assert len(in_layers) == 7 and len(calls) == 8, calls
  for shapes in in_layers:
    assert shapes[1][0] == cfg.num_layers, shapes
  xla_path = llama.forward(params, tokens, cfg=dataclasses.replace(cfg, implementation="xla"))
  scanned = llama.forward(params, tokens, cfg=cfg)
  assert float(jnp.max(jnp.abs(scanned - xla_path))) < 0.05 * float(jnp.max(jnp.abs(xla_path)))


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("implementation", [
    "interpret", "xla", pytest.param("pallas", marks=needs_gpu)])
def test_scanned_moe_layers_equal_each_layer_bit_for_bit(tokens, implementation):
  experts, k, n, top_k = 4, 128, 64, 2
  ws = [qjax.quantize_mxfp4(jax.random.normal(jax.random.key(i), (experts, k, n)))
        for i in range(LAYERS)]
  stack = _stack(ws)
  x = jax.random.normal(jax.random.key(5), (tokens, k), jnp.bfloat16)
  ids = jax.random.randint(jax.random.key(6), (tokens, top_k), 0, experts)

  def scanned(x, stack):
    def body(carry, i):
      return carry, qjax.moe_matmul(x, qjax.layer_of(stack, i), ids,
                                    implementation=implementation)
    return jax.lax.scan(body, 0, jnp.arange(LAYERS))[1]

  got = np.asarray(jax.jit(scanned)(x, stack).astype(jnp.float32))
  for i, w in enumerate(ws):
    want = jax.jit(lambda x, w: qjax.moe_matmul(x, w, ids, implementation=implementation))(
        x, w)
    np.testing.assert_array_equal(got[i], np.asarray(want.astype(jnp.float32)),
                                  err_msg=f"layer {i}")
  if implementation != "xla":
    calls = pallas_operand_shapes(jax.make_jaxpr(scanned)(x, stack).jaxpr)
    codes = stack.codes.shape
    assert calls and all(any(s == codes for s in shapes) for shapes in calls), calls


class _Residual(nn.Module):
  """h + tanh(Int4Dense(h)): a layer body with a quantized kernel and a float bias."""
  implementation: str | None = None

  @nn.compact
  def __call__(self, h, scale):
    return h + jnp.tanh(Int4Dense(h.shape[-1], implementation=self.implementation)(h)) * scale, h


@pytest.mark.parametrize("implementation", [
    "interpret", "xla", pytest.param("pallas", marks=needs_gpu)])
def test_scan_layers_equals_applying_each_layer(implementation):
  x = jax.random.normal(jax.random.key(0), (2, 256), jnp.bfloat16)
  per_layer = [_Residual().init(jax.random.key(i + 1), x, 1.0)["params"] for i in range(LAYERS)]
  stacked = _stack(per_layer)
  scales = jnp.asarray([0.5, 1.0, 2.0], jnp.bfloat16)
  module = _Residual(implementation)
  final, ys = jax.jit(lambda p, x: scan_layers(module, p, x, scales))(stacked, x)
  h = x
  for i, params in enumerate(per_layer):
    np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(h), err_msg=f"layer {i}")
    h, _ = jax.jit(module.apply)({"params": params}, h, scales[i])
  np.testing.assert_array_equal(np.asarray(final), np.asarray(h))
  if implementation != "xla":
    jaxpr = jax.make_jaxpr(lambda p, x: scan_layers(module, p, x, scales))(stacked, x).jaxpr
    [shapes] = pallas_operand_shapes(jaxpr)
    assert shapes[1] == stacked["Int4Dense_0"]["kernel"].codes.shape, shapes


def test_scan_layers_unrolled_equals_the_loop():
  """``unroll=2`` over 3 layers (two iterations, the second partial) gives the rolled
  loop's result and per-layer outputs."""
  x = jax.random.normal(jax.random.key(0), (2, 256), jnp.float32)
  per_layer = [_Residual().init(jax.random.key(i + 1), x, 1.0)["params"] for i in range(LAYERS)]
  stacked = _stack(per_layer)
  scales = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
  module = _Residual("xla")
  runs = [jax.jit(lambda p, x, u=u: scan_layers(module, p, x, scales, unroll=u))(stacked, x)
          for u in (1, 2)]
  for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_layer_params_slices_floats_and_views_quantized_weights():
  w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  stacked = {"dense": {"kernel": _stack([w, w]), "bias": jnp.arange(4.0).reshape(2, 2)}}
  got = layer_params(stacked, jnp.int32(1))
  assert isinstance(got["dense"]["kernel"], qjax.LayerOf)
  np.testing.assert_array_equal(np.asarray(got["dense"]["bias"]), [2.0, 3.0])
  with pytest.raises(ValueError, match="leading \\[layers\\] axis"):
    scan_layers(_Residual(), {}, jnp.ones((1, 256)))


class _MoELayer(nn.Module):
  implementation: str | None = None

  @nn.compact
  def __call__(self, h, _):
    moe = MXFP4MoE(num_experts=4, top_k=2, intermediate_size=64,
                   implementation=self.implementation)
    return h + moe(h), None


@pytest.mark.parametrize("implementation", ["interpret", "xla"])
def test_scan_layers_runs_the_moe_block(implementation):
  x = jax.random.normal(jax.random.key(0), (3, 128), jnp.bfloat16)
  per_layer = [_MoELayer().init(jax.random.key(i + 1), x, None)["params"]
               for i in range(LAYERS)]
  module = _MoELayer(implementation)
  final, _ = jax.jit(lambda p, x: scan_layers(module, p, x))(_stack(per_layer), x)
  h = x
  for params in per_layer:
    h, _ = jax.jit(module.apply)({"params": params}, h, None)
  np.testing.assert_array_equal(np.asarray(final), np.asarray(h))
