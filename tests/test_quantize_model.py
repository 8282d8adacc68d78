"""quantize_model / quantize_nnx_model on a small transformer-shaped model (embedding,
blocks of Dense layers, lm_head), linen and NNX: the intended layers only, the report,
and outputs within the float64 error of the same int4 RTN quantization."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import FrozenDict

import qjax
from flax_layers import Int4Dense, Int4Linear, QuantRule, quantize_model, quantize_nnx_model
from conftest import rel_err


V, D, H, LAYERS = 64, 128, 256, 2
HIGHEST = jax.lax.Precision.HIGHEST

RULE_V = QuantRule(r"attn_v/kernel$", group_size=64)                  # first match wins
RULE_ATTN = QuantRule(r"attn_\w+/kernel$", group_size=32)
RULE_MLP = QuantRule(r"mlp_\w+/kernel$", group_size=128, symmetric=False)
RULE_CONV = QuantRule(r"conv/kernel$")                                 # matches nothing
RULE_ALL = QuantRule(r"kernel$", group_size=32)    # would take lm_head; skipped instead
RULES = [RULE_V, RULE_ATTN, RULE_MLP, RULE_CONV, RULE_ALL]
SKIP = [r"^embed/", r"lm_head"]


def _gelu64(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def forward64(p, tokens):
  """The model in numpy float64. ``p``: {"embedding": [V, D], "blocks": [{"attn_v":
  (kernel, bias), ...}], "lm_head": (kernel, bias)} with float kernels."""
  f = lambda a: np.asarray(a, np.float64)
  dense = lambda x, kb: x @ f(kb[0]) + f(kb[1])
  h = f(p["embedding"])[np.asarray(tokens)]
  for b in p["blocks"]:
    h = h + dense(np.tanh(dense(h, b["attn_v"])), b["attn_o"])
    h = h + dense(_gelu64(dense(h, b["mlp_up"])), b["mlp_down"])
  return dense(h, p["lm_head"])


def _float(k):
  return k.dequantize() if qjax.is_quantized(k) else k


# ---------------------------------------------------------------------------------- linen


class Block(nn.Module):
  quantized: bool = False

  @nn.compact
  def __call__(self, h):
    dense = Int4Dense if self.quantized else lambda f, name: nn.Dense(f, name=name,
                                                                       precision=HIGHEST)
    h = h + dense(D, name="attn_o")(jnp.tanh(dense(D, name="attn_v")(h)))
    return h + dense(D, name="mlp_down")(jax.nn.gelu(dense(H, name="mlp_up")(h)))


class TinyLM(nn.Module):
  quantized: bool = False

  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(V, D, name="embed")(tokens)
    for i in range(LAYERS):
      h = Block(self.quantized, name=f"block_{i}")(h)
    # Left float by SKIP: Int4Dense multiplies it at its precision, as nn.Dense.
    head = Int4Dense(V, name="lm_head", precision=HIGHEST) if self.quantized else nn.Dense(
        V, name="lm_head", precision=HIGHEST)
    return head(h)


def _linen_params(rng):
  tokens = jnp.asarray(rng.integers(0, V, (3, 7)), jnp.int32)
  params = TinyLM().init(jax.random.key(0), tokens)["params"]
  # Non-zero biases so that leaving them alone is visible.
  params = jax.tree_util.tree_map_with_path(
      lambda path, a: a + 0.01 if path[-1].key == "bias" else a, params)
  return params, tokens


def _linen_as_p(params):
  pair = lambda d: (_float(d["kernel"]), d["bias"])
  return {"embedding": params["embed"]["embedding"],
          "blocks": [{n: pair(params[f"block_{i}"][n])
                      for n in ("attn_v", "attn_o", "mlp_up", "mlp_down")}
                     for i in range(LAYERS)],
          "lm_head": pair(params["lm_head"])}


def _expected_paths(fmt):
  want = {}
  for i in range(LAYERS):
    want[fmt(i, "attn_v")] = RULE_V
    want[fmt(i, "attn_o")] = RULE_ATTN
    want[fmt(i, "mlp_up")] = RULE_MLP
    want[fmt(i, "mlp_down")] = RULE_MLP
  return want


def _check_rtn_bound(w, q, rule):
  """Round to nearest: |W - deq| <= s / 2 (symmetric: no clipping at absmax / 7), <= s
  with a rounded zero point (asymmetric)."""
  assert isinstance(q, qjax.Int4Weight) and q.shape == w.shape
  assert q.group_size == rule.group_size and q.symmetric == rule.symmetric
  s = np.repeat(np.asarray(q.scales, np.float64), q.group_size, axis=0)
  err = np.abs(np.asarray(q.dequantize(), np.float64) - np.asarray(w, np.float64))
  bound = (0.5 if rule.symmetric else 1.0) * s * (1 + 1e-6)
  assert (err <= bound).all(), float((err / s).max())


def _check_outputs(y_q, p_float, p_deq, tokens):
  """y_q must sit where the float64 forward of the same dequantized weights sits: its
  error to the float model is the quantization's own float64 error, up to f32 rounding."""
  y_f64 = forward64(p_float, tokens)
  y_deq64 = forward64(p_deq, tokens)
  expected = rel_err(y_deq64, y_f64)
  assert 1e-3 < expected < 0.2, expected  # int4 RTN did something, and nothing absurd
  assert rel_err(y_q, y_deq64) < 1e-4
  assert rel_err(y_q, y_f64) <= expected + 2e-4


def test_linen_rules_report_and_outputs(rng, caplog):
  params, tokens = _linen_params(rng)
  with caplog.at_level(logging.WARNING, logger="flax_layers"):
    qparams, report = quantize_model(params, RULES, skip=SKIP)
  assert report.quantized == _expected_paths(lambda i, n: f"block_{i}/{n}/kernel")
  assert list(report.quantized) == sorted(report.quantized)  # parameter order
  assert report.skipped == {"embed/embedding": r"^embed/", "lm_head/bias": "lm_head",
                            "lm_head/kernel": "lm_head"}
  assert report.unused_rules == (RULE_CONV, RULE_ALL) and report.unused_skips == ()
  assert "conv/kernel$" in caplog.text and "kernel$" in caplog.text
  assert "conv/kernel$" in str(report)
  # Only the intended leaves changed; everything else is the same array.
  flat_q = dict(jax.tree_util.tree_flatten_with_path(
      qparams, is_leaf=qjax.is_quantized)[0])
  for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = "/".join(k.key for k in path)
    if name in report.quantized:
      _check_rtn_bound(a, flat_q[path], report.quantized[name])
    else:
      assert flat_q[path] is a, name
  # The quantized model (Int4Dense in place of nn.Dense) applies the returned params.
  y_q = jax.jit(TinyLM(quantized=True).apply)({"params": qparams}, tokens)
  y_float = TinyLM().apply({"params": params}, tokens)
  assert rel_err(y_float, forward64(_linen_as_p(params), tokens)) < 1e-5
  _check_outputs(y_q, _linen_as_p(params), _linen_as_p(qparams), tokens)


def test_linen_frozendict_with_collection(rng):
  params, _ = _linen_params(rng)
  variables = FrozenDict({"params": params})
  qvars, report = quantize_model(variables, [RULE_MLP], skip=SKIP, warn_unused=False)
  assert isinstance(qvars, FrozenDict)
  assert set(report.quantized) == {f"params/block_{i}/{n}/kernel"
                                   for i in range(LAYERS) for n in ("mlp_up", "mlp_down")}
  assert isinstance(qvars["params"]["block_1"]["mlp_up"]["kernel"], qjax.Int4Weight)
  assert not qjax.is_quantized(qvars["params"]["block_1"]["attn_v"]["kernel"])


def test_errors(rng):
  params, _ = _linen_params(rng)
  with pytest.raises(ValueError, match=r"matched 'block_0/attn_v/bias' of shape \(128,\)"):
    quantize_model(params, [QuantRule(r"attn_v")])
  with pytest.raises(ValueError, match=r"'block_0/attn_v/kernel' has K=128 rows, not a "
                     r"multiple of group_size=256"):
    quantize_model(params, [QuantRule(r"attn_v/kernel", group_size=256)])
  with pytest.raises(ValueError, match=r"QuantRule.pattern='attn\(' is not a valid"):
    QuantRule(r"attn(")
  with pytest.raises(ValueError, match=r"skip pattern='\[' is not a valid"):
    quantize_model(params, [RULE_MLP], skip=["["])
  with pytest.raises(TypeError, match=r"skip='lm_head' must be a sequence"):
    quantize_model(params, [RULE_MLP], skip="lm_head")
  with pytest.raises(ValueError, match=r"format='int3' is not supported"):
    QuantRule("x", format="int3")
  with pytest.raises(ValueError, match=r"group_size=48 must be one of"):
    QuantRule("x", group_size=48)
  qparams, _ = quantize_model(params, [RULE_MLP], warn_unused=False)
  with pytest.raises(ValueError, match=r"'block_0/mlp_down/kernel', which is already "
                     "quantized"):
    quantize_model(qparams, [RULE_MLP])


# ------------------------------------------------------------------------------------ NNX


class NnxBlock(nnx.Module):

  def __init__(self, rngs):
    lin = lambda i, o: nnx.Linear(i, o, precision=HIGHEST, rngs=rngs,
                                  bias_init=nnx.initializers.constant(0.01))
    self.attn_v, self.attn_o = lin(D, D), lin(D, D)
    self.mlp_up, self.mlp_down = lin(D, H), lin(H, D)

  def __call__(self, h):
    h = h + self.attn_o(jnp.tanh(self.attn_v(h)))
    return h + self.mlp_down(jax.nn.gelu(self.mlp_up(h)))


class NnxTinyLM(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
    self.lm_head = nnx.Linear(D, V, precision=HIGHEST, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    for b in self.blocks:
      h = b(h)
    return self.lm_head(h)


def _v(var):
  return var.get_value() if hasattr(var, "get_value") else var.value


def _nnx_as_p(model):
  pair = lambda m: (_float(_v(m.kernel)), _v(m.bias))
  return {"embedding": _v(model.embed.embedding),
          "blocks": [{n: pair(getattr(b, n)) for n in ("attn_v", "attn_o", "mlp_up",
                                                       "mlp_down")}
                     for b in model.blocks],
          "lm_head": pair(model.lm_head)}


def test_nnx_model(rng):
  model = NnxTinyLM(nnx.Rngs(0))
  tokens = jnp.asarray(rng.integers(0, V, (3, 7)), jnp.int32)
  qmodel, report = quantize_nnx_model(model, RULES, skip=SKIP, warn_unused=False)
  assert report.quantized == _expected_paths(lambda i, n: f"blocks/{i}/{n}/kernel")
  assert report.skipped == {"embed/embedding": r"^embed/", "lm_head/bias": "lm_head",
                            "lm_head/kernel": "lm_head"}
  assert report.unused_rules == (RULE_CONV, RULE_ALL)
  for i, b in enumerate(qmodel.blocks):
    for n in ("attn_v", "attn_o", "mlp_up", "mlp_down"):
      layer = getattr(b, n)
      assert isinstance(layer, Int4Linear), (i, n)
      _check_rtn_bound(_v(getattr(model.blocks[i], n).kernel), _v(layer.kernel),
                       report.quantized[f"blocks/{i}/{n}/kernel"])
  assert type(qmodel.lm_head) is nnx.Linear and type(qmodel.embed) is nnx.Embed
  assert type(model.blocks[0].attn_v) is nnx.Linear  # the input model is unchanged
  y_q = nnx.jit(lambda m, t: m(t))(qmodel, tokens)
  assert rel_err(model(tokens), forward64(_nnx_as_p(model), tokens)) < 1e-5
  _check_outputs(y_q, _nnx_as_p(model), _nnx_as_p(qmodel), tokens)


def test_nnx_state(rng):
  """On ``nnx.state``: the Linear kernels' Params hold Int4Weight, which qjax.matmul and
  Int4Linear consume."""
  model = NnxTinyLM(nnx.Rngs(1))
  graphdef, state = nnx.split(model)
  qstate, report = quantize_model(state, [RULE_MLP], skip=SKIP, warn_unused=False)
  assert isinstance(qstate, nnx.State)
  assert set(report.quantized) == {f"blocks/{i}/{n}/kernel"
                                   for i in range(LAYERS) for n in ("mlp_up", "mlp_down")}
  merged = nnx.merge(graphdef, qstate)
  kernel = _v(merged.blocks[1].mlp_up.kernel)
  assert isinstance(kernel, qjax.Int4Weight) and kernel.shape == (D, H)
  assert not qjax.is_quantized(_v(merged.blocks[1].attn_v.kernel))
  x = jnp.asarray(rng.standard_normal((2, D)), jnp.float32)
  layer = Int4Linear(D, H, kernel=kernel, use_bias=False)
  ref = np.asarray(x, np.float64) @ np.asarray(kernel.dequantize(), np.float64)
  assert rel_err(layer(x), ref) < 1e-5
  assert rel_err(qjax.matmul(x, kernel), ref) < 1e-5
