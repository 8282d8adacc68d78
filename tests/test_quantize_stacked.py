"""quantize_model with ``QuantRule(stacked_axes=...)``: kernels stacked by ``nn.scan``
(layers) or by experts, quantized slice by slice into one Int4Weight with leading axes,
which ``nn.scan``, ``flax_layers.scan_layers``, ``qjax.layer_of`` and ``qjax.moe_matmul``
take. Each slice equals ``qjax.quantize`` of it bit for bit; the models' outputs match a
float64 forward pass of the dequantized weights."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qjax
import flax_layers
from flax_layers import Int4Dense, QuantRule, quantize_model, quantize_nnx_model
from conftest import rel_err

L, D, H = 3, 128, 256


class _Layer(nn.Module):
  quantized: bool = False

  @nn.compact
  def __call__(self, h, _):
    if self.quantized:
      dense = functools.partial(Int4Dense, implementation="xla", group_size=64,
                                symmetric=False)
    else:
      dense = nn.Dense
    up = dense(H, name="up")(h)
    return h + dense(D, name="down")(jnp.tanh(up)), None


class _Scanned(nn.Module):
  quantized: bool = False

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=L)
    return stack(self.quantized, name="layers")(x, None)[0]


RULE = QuantRule(r"layers/\w+/kernel$", group_size=64, symmetric=False, stacked_axes=1)


def _forward64(layers, x):
  """The scanned model in float64 from ``{"up": (kernel [L, D, H], bias), "down": ...}``
  with float kernels."""
  h = np.asarray(x, np.float64)
  for i in range(L):
    dense = lambda v, n: v @ layers[n][0][i] + layers[n][1][i]
    h = h + dense(np.tanh(dense(h, "up")), "down")
  return h


def _as64(params, dequantize):
  out = {}
  for n in ("up", "down"):
    kernel = params["layers"][n]["kernel"]
    if dequantize:
      kernel = [qjax.layer_of(kernel, i).layer().dequantize() for i in range(L)]
    out[n] = (np.asarray(kernel, np.float64),
              np.asarray(params["layers"][n]["bias"], np.float64))
  return out


def _v(var):
  return var.get_value() if hasattr(var, "get_value") else var.value


def _assert_same_weight(got, want):
  assert type(got) is type(want) and got.shape == want.shape
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nn_scan_params_quantize_slice_by_slice_and_run_scanned(rng):
  x = jnp.asarray(rng.standard_normal((5, D)), jnp.float32)
  params = _Scanned().init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
  assert params["layers"]["up"]["kernel"].shape == (L, D, H)
  qparams, report = quantize_model(params, [RULE])
  assert sorted(report.quantized) == ["layers/down/kernel", "layers/up/kernel"]
  for n in ("up", "down"):
    kernel, q = params["layers"][n]["kernel"], qparams["layers"][n]["kernel"]
    assert isinstance(q, qjax.Int4Weight) and q.shape == kernel.shape[1:]
    assert q.codes.shape[0] == q.scales.shape[0] == q.zeros.shape[0] == L
    for i in range(L):
      _assert_same_weight(qjax.layer_of(q, i).layer(), qjax.quantize(
          kernel[i], group_size=64, symmetric=False))
  # nn.scan slices the stacked Int4Weight for each layer's Int4Dense.
  got = jax.jit(_Scanned(quantized=True).apply)({"params": qparams}, x)
  want = _forward64(_as64(qparams, dequantize=True), x)
  assert rel_err(got, want) < 1e-5
  # The dequantized kernels are the float ones within int4 rounding error.
  for n, (deq, _) in _as64(qparams, dequantize=True).items():
    assert 0.02 < rel_err(deq, _as64(params, dequantize=False)[n][0]) < 0.15
  # scan_layers reads the same stack through qjax.layer_of.
  final, _ = jax.jit(lambda p, h: flax_layers.scan_layers(_Layer(quantized=True), p, h))(
      qparams["layers"], x)
  assert rel_err(final, want) < 1e-5


def test_two_stacked_axes_keep_their_shape(rng):
  w = jnp.asarray(rng.standard_normal((2, 3, 256, 40)), jnp.bfloat16)
  rule = QuantRule("kernel$", group_size=128, stacked_axes=2, method="mse")
  q = quantize_model({"kernel": w}, [rule])[0]["kernel"]
  assert q.shape == (256, 40) and q.codes.shape == (2, 3, 32, 40)
  assert q.scales.shape == (2, 3, 2, 40) and q.zeros is None
  for i, j in np.ndindex(2, 3):
    _assert_same_weight(jax.tree.map(lambda a: a[i, j], q),
                        qjax.quantize(w[i, j], group_size=128, method="mse"))


def test_expert_stack_runs_moe_matmul(rng):
  e, k, n = 4, 128, 48
  w = jnp.asarray(rng.standard_normal((e, k, n)), jnp.float32)
  q, report = quantize_model({"experts": {"kernel": w}},
                             [QuantRule("kernel$", group_size=32, stacked_axes=1)])
  q = q["experts"]["kernel"]
  x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
  ids = jnp.asarray([[0, 3], [2, 2], [1, 0]], jnp.int32)
  got = qjax.moe_matmul(x, q, ids, implementation="xla")
  dense = np.stack([np.asarray(jax.tree.map(lambda a: a[i], q).dequantize(), np.float64)
                    for i in range(e)])
  want = np.einsum("tk,tjkn->tjn", np.asarray(x, np.float64), dense[np.asarray(ids)])
  assert got.shape == (3, 2, n) and rel_err(got, want) < 1e-5


def test_a_slice_needing_float32_scales_makes_every_slice_float32(rng):
  """float16 scales overflow for the slice of large weights (ScaleRangeWarning): the
  stack keeps float32 scales for all slices, each equal to its own quantization."""
  w = rng.standard_normal((3, 128, 16)).astype(np.float32)
  w[1] *= 1e6
  rule = QuantRule("kernel$", group_size=32, scale_dtype=jnp.float16, stacked_axes=1)
  with pytest.warns(qjax.ScaleRangeWarning):
    q = quantize_model({"kernel": jnp.asarray(w)}, [rule])[0]["kernel"]
  assert q.scales.dtype == jnp.float32
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", qjax.ScaleRangeWarning)
    for i in range(3):
      one = qjax.quantize(jnp.asarray(w[i]), group_size=32, scale_dtype=jnp.float16)
      assert one.scales.dtype == (jnp.float32 if i == 1 else jnp.float16)
      np.testing.assert_array_equal(np.asarray(q.codes[i]), np.asarray(one.codes))
      np.testing.assert_array_equal(np.asarray(q.scales[i]),
                                    np.asarray(one.scales, np.float32))


def test_nnx_vmapped_layers(rng):
  """Layers made by ``nnx.vmap`` (a stacked ``nnx.Linear``), run by ``nnx.scan``: the
  stacked kernel becomes an Int4Linear whose kernel ``nnx.scan`` slices per layer."""

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h):
      return h + jnp.tanh(self.lin(h))

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(rngs)

  blocks = make(nnx.Rngs(int(rng.integers(1 << 30))))
  assert _v(blocks.lin.kernel).shape == (L, D, D)
  qblocks, report = quantize_nnx_model(
      blocks, [QuantRule("kernel$", group_size=32, stacked_axes=1)], implementation="xla")
  assert list(report.quantized) == ["lin/kernel"]
  assert isinstance(qblocks.lin, flax_layers.Int4Linear)

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def run(block, h):
    return block(h)

  x = jnp.asarray(rng.standard_normal((2, D)), jnp.float32)
  got = run(qblocks, x)
  kernel = _v(qblocks.lin.kernel)
  h = np.asarray(x, np.float64)
  for i in range(L):
    w = np.asarray(jax.tree.map(lambda a: a[i], kernel).dequantize(), np.float64)
    h = h + np.tanh(h @ w + np.asarray(_v(qblocks.lin.bias)[i], np.float64))
  assert rel_err(got, h) < 1e-5


@pytest.mark.parametrize("shape, axes, match", [
    ((3, 128, 64), 0, r"of shape \(3, 128, 64\): a kernel with leading axes \(3,\) .* "
                      r"stacked_axes=1"),
    ((2, 3, 128, 64), 0, r"leading axes \(2, 3\) .* stacked_axes=2"),
    ((128, 64), 1, r"\(stacked_axes=1\) matched 'kernel' of shape \(128, 64\); only 3-D "
                   r"\[stack, K, N\] kernels"),
    ((2, 3, 128, 64), 1, r"only 3-D \[stack, K, N\]"),
    ((0, 128, 64), 1, r"'kernel' of shape \(0, 128, 64\) stacks no \[K, N\] slice"),
    ((3, 96, 64), 1, r"'kernel' has K=96 rows, not a multiple of group_size=64"),
])
def test_stacked_shape_errors_name_the_path_and_the_fix(rng, shape, axes, match):
  params = {"kernel": jnp.asarray(rng.standard_normal(shape), jnp.float32)}
  with pytest.raises(ValueError, match=match):
    quantize_model(params, [QuantRule("kernel$", group_size=64, stacked_axes=axes)])


def test_a_bad_slice_is_named_by_its_index(rng):
  w = rng.standard_normal((2, 2, 128, 8)).astype(np.float32)
  w[1, 0, 5, 3] = np.nan
  with pytest.raises(ValueError, match=r"kernel\[1, 0\]"):
    quantize_model({"kernel": jnp.asarray(w)},
                   [QuantRule("kernel$", group_size=64, stacked_axes=2)])


@pytest.mark.parametrize("axes", [-1, True, 1.0, "1"])
def test_stacked_axes_must_be_a_count(axes):
  with pytest.raises(ValueError, match=rf"QuantRule\.stacked_axes={axes!r} must be an int"):
    QuantRule("kernel$", stacked_axes=axes)


# ----------------------------------------------------------------------------- FP4 rules


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_rules_quantize_as_the_fp4_quantizers_and_run_in_int4_dense(rng, fmt):
  quantize = {"mxfp4": qjax.quantize_mxfp4, "nvfp4": qjax.quantize_nvfp4}[fmt]
  x = jnp.asarray(rng.standard_normal((5, D)), jnp.float32)
  params = _Scanned().init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
  qparams, report = quantize_model(params, [QuantRule(r"up/kernel$", format=fmt,
                                                      stacked_axes=1)])
  assert list(report.quantized) == ["layers/up/kernel"]
  assert f"layers/up/kernel: {fmt} (rule" in str(report)
  assert not qjax.is_quantized(qparams["layers"]["down"]["kernel"])
  q = qparams["layers"]["up"]["kernel"]
  assert q.shape == (D, H)
  for i in range(L):  # each slice as the quantizer makes it of that slice alone
    _assert_same_weight(jax.tree.map(lambda a: a[i], q),
                        quantize(params["layers"]["up"]["kernel"][i]))
  # A 2-D kernel through a linen Int4Dense, which takes any quantized weight.
  w = jnp.asarray(rng.standard_normal((D, 48)), jnp.float32)
  dense = {"kernel": w, "bias": jnp.asarray(rng.standard_normal(48), jnp.float32)}
  qd = quantize_model(dense, [QuantRule("kernel$", format=fmt)])[0]
  _assert_same_weight(qd["kernel"], quantize(w))
  got = Int4Dense(48, implementation="xla").apply({"params": qd}, x)
  want = (np.asarray(x, np.float64) @ np.asarray(qd["kernel"].dequantize(), np.float64)
          + np.asarray(dense["bias"], np.float64))
  assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("kwargs", [dict(group_size=64), dict(group_size=None),
                                    dict(symmetric=False), dict(method="mse"),
                                    dict(scale_dtype=jnp.float32)])
def test_fp4_rules_take_no_int4_options(kwargs):
  name = next(iter(kwargs))
  with pytest.raises(ValueError, match=rf"QuantRule\(format='nvfp4'\) takes no {name}: "
                     r"NVFP4 fixes its scales \(one per 16 rows of K\)"):
    QuantRule("kernel$", format="nvfp4", **kwargs)


def test_fp4_rule_names_a_k_off_the_block(rng):
  params = {"a": {"kernel": jnp.asarray(rng.standard_normal((48, 8)), jnp.float32)}}
  with pytest.raises(ValueError, match=r"'a/kernel' has K=48 rows, not a multiple of "
                     r"MXFP4's block of 32"):
    quantize_model(params, [QuantRule("kernel$", format="mxfp4")])
  q = quantize_model(params, [QuantRule("kernel$", format="nvfp4")])[0]["a"]["kernel"]
  assert isinstance(q, qjax.NVFP4Weight) and q.shape == (48, 8)


def test_nnx_linear_quantized_to_mxfp4(rng):
  model = nnx.Linear(D, 40, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  qmodel, _ = quantize_nnx_model(model, [QuantRule("kernel$", format="mxfp4")],
                                 implementation="xla")
  assert isinstance(qmodel, flax_layers.Int4Linear)
  kernel = _v(qmodel.kernel)
  _assert_same_weight(kernel, qjax.quantize_mxfp4(_v(model.kernel)))
  x = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
  want = (np.asarray(x, np.float64) @ np.asarray(kernel.dequantize(), np.float64)
          + np.asarray(_v(model.bias), np.float64))
  assert rel_err(qmodel(x), want) < 1e-5
