"""Public layer parts with no direct test before: RMSNorm, apply_rope, QuantizedDense,
CodebookOptions, QuantizationReport, LlamaConfig.from_hf_config, ``num_groups`` of the
quantized weights and ShardedWeight.as_weight.

Every number is checked against a float64 numpy reference written here from the
documented math (not through qjax), on fresh random inputs of odd shapes. Int4 weights are
built exactly representable (codes in [-7, 7], every group holding a +-7 and scales with
few mantissa bits), so the quantizer recovers them exactly and ``x @ W`` is known in
float64 without dequantizing through the library.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import qjax
from flax_layers import (CodebookLinear, CodebookOptions, LlamaConfig, QuantizationReport,
                         QuantizedDense, QuantRule, RMSNorm, apply_rope, quantize_model)
from conftest import rel_err, seed_from
from qjax._src import sharding as sharding_lib


_rng = lambda name: np.random.default_rng(seed_from(name))


def exact_int4(rng, k: int, n: int, g: int) -> np.ndarray:
  """A float64 ``[K, N]`` W = q * s that symmetric int4 quantization holds exactly."""
  q = rng.integers(-7, 8, (k, n)).astype(np.float64)
  q[::g] = rng.choice([-7.0, 7.0], (k // g, n))  # absmax of every group is 7 * s
  s = 2.0 ** rng.integers(-7, -2, (k // g, n)) * (1 + rng.integers(0, 8, (k // g, n)) / 8)
  return q * np.repeat(s, g, axis=0)


@pytest.mark.parametrize("shape,eps,dtype,mag", [
    ((3, 7), 1e-5, jnp.float32, 1.0), ((2, 5, 13), 1e-6, jnp.float32, 3.0),
    ((1, 1, 1), 1e-5, jnp.float32, 1.0), ((4, 96), 1e-5, jnp.float32, 1e-3),  # eps dominates
    ((2, 3, 33), 1e-5, jnp.bfloat16, 1.0)])
def test_rmsnorm_matches_float64(shape, eps, dtype, mag):
  rng = _rng(f"rmsnorm{shape}{eps}{mag}")
  x = jnp.asarray(mag * rng.standard_normal(shape), dtype)
  scale = jnp.asarray(rng.uniform(0.5, 2.0, shape[-1]), dtype)
  y = jax.jit(lambda s, x: RMSNorm(eps=eps).apply({"params": {"scale": s}}, x))(scale, x)
  x64, s64 = np.asarray(x, np.float64), np.asarray(scale, np.float64)
  ref = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + eps) * s64
  assert y.dtype == dtype and y.shape == shape
  assert rel_err(y, ref) < (8e-3 if dtype == jnp.bfloat16 else 2e-6)
  with pytest.raises(ValueError, match="param 'scale' must come from params_from_gguf"):
    RMSNorm(eps=eps).init(jax.random.key(0), x)  # no random init (was an AttributeError)


def rope64(x, positions, base, rope_dim):
  """Adjacent pairs (x[2i], x[2i+1]) rotated by pos * base**(-2i/rope_dim) (the
  docstring's llama.cpp NORM convention); dims past rope_dim pass through."""
  out = np.array(x, np.float64)
  for i in range(rope_dim // 2):
    ang = positions[:, :, None] * base ** (-2.0 * i / rope_dim)  # [B, T, 1]
    a, b = out[..., 2 * i].copy(), out[..., 2 * i + 1].copy()
    out[..., 2 * i] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 2 * i + 1] = a * np.sin(ang) + b * np.cos(ang)
  return out


@pytest.mark.parametrize("b,t,heads,head_dim,rope_dim,start,base,dtype", [
    (1, 5, 3, 8, 8, [7], 1e4, jnp.float32), (2, 3, 2, 64, 64, [0, 41], 1e4, jnp.float32),
    (3, 7, 1, 20, 12, [1, 2, 3], 5e5, jnp.float32), (2, 1, 5, 6, 2, [100, 255], 100.0, jnp.float32),
    (2, 3, 4, 16, 16, [0, 9], 1e4, jnp.bfloat16)])
def test_apply_rope_matches_adjacent_pair_reference(b, t, heads, head_dim, rope_dim, start,
                                                    base, dtype):
  rng = _rng(f"rope{b}{t}{heads}{head_dim}{rope_dim}{start}")
  x = jnp.asarray(rng.standard_normal((b, t, heads, head_dim)), dtype)
  pos = np.asarray(start)[:, None] + np.arange(t)[None, :]  # per-row offsets
  y = jax.jit(apply_rope, static_argnums=(2, 3))(x, jnp.asarray(pos, jnp.int32), base, rope_dim)
  x64 = np.asarray(x, np.float64)
  assert y.dtype == dtype and y.shape == x.shape
  assert rel_err(y, rope64(x64, pos, base, rope_dim)) < (8e-3 if dtype == jnp.bfloat16 else 1e-5)
  np.testing.assert_array_equal(np.asarray(y, np.float64)[..., rope_dim:], x64[..., rope_dim:])
  np.testing.assert_array_equal(np.asarray(y, np.float64)[pos == 0], x64[pos == 0])
  if rope_dim > 2:  # not the split-halves (HF rotate_half) pairs (x[i], x[i + rope_dim/2])
    perm = np.concatenate([np.arange(rope_dim).reshape(2, -1).T.ravel(),
                           np.arange(rope_dim, head_dim)])
    hf = np.empty_like(x64)
    hf[..., perm] = rope64(x64[..., perm], pos, base, rope_dim)
    assert rel_err(y, hf) > 0.1


@pytest.mark.parametrize("lead,k,n,g,dtype", [
    ((5,), 192, 40, 64, jnp.float32), ((2, 3), 256, 24, 32, jnp.float32),
    ((1,), 320, 8, 64, jnp.float32), ((3,), 128, 16, 128, jnp.bfloat16)])
def test_quantized_dense_is_x_at_W(lead, k, n, g, dtype):
  rng = _rng(f"qdense{lead}{k}{n}{g}")
  w64 = exact_int4(rng, k, n, g)
  kernel = qjax.quantize(jnp.asarray(w64, jnp.float32), group_size=g)
  x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
  layer = QuantizedDense(n)
  y = jax.jit(lambda p, x: layer.apply({"params": p}, x))({"kernel": kernel}, x)
  assert y.dtype == dtype and y.shape == (*lead, n)
  ref = np.asarray(x, np.float64) @ w64  # QuantizedDense has no bias
  assert rel_err(y, ref) < (8e-3 if dtype == jnp.bfloat16 else 1e-5)
  with pytest.raises(ValueError, match=f"N={n}, want features={n + 1}"):
    QuantizedDense(n + 1).apply({"params": {"kernel": kernel}}, x)
  with pytest.raises(ValueError, match="must come from params_from_gguf"):
    layer.init(jax.random.key(0), x)  # no random init: weights are pretrained


# Lloyd-Max 16-level quantizer of N(0, 1) (Max 1960), and QLoRA's NF4 levels.
LLOYD_MAX_16 = np.array([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326])
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


@pytest.mark.parametrize("k,n", [(192, 40), (128, 9)])
def test_codebook_options_set_the_weight(k, n):
  rng = _rng(f"cbopt{k}{n}")
  w = rng.standard_normal((k, n)).astype(np.float32)
  one = CodebookOptions(group=64).quantize(jnp.asarray(w))
  two = CodebookOptions(group=64, passes=2, codebook="nf4", rotation="orthogonal",
                        seed=5).quantize(jnp.asarray(w))
  fields = lambda c: (c.group_size, c.passes, c.codebook_name, c.rotation, c.seed)
  assert fields(one) == (64, 1, "lloyd", "hadamard", 0)
  assert fields(two) == (64, 2, "nf4", "orthogonal", 5)
  np.testing.assert_allclose(np.asarray(one.codebook),
                             np.concatenate([-LLOYD_MAX_16[::-1], LLOYD_MAX_16]), atol=2e-4)
  np.testing.assert_allclose(np.asarray(two.codebook), NF4, rtol=1e-6)
  e1, e2 = rel_err(one.dequantize(), w), rel_err(two.dequantize(), w)
  assert 0.05 < e1 < 0.12 and e2 < e1 / 4  # 4-bit error, the residual pass cuts it
  # CodebookLinear quantizes its initial kernel with the same options.
  opts = CodebookOptions(group=64, passes=2, codebook="iq4_nl", seed=3)
  layer = CodebookLinear(k, n, group=64, passes=2, codebook="iq4_nl", seed=3, rngs=nnx.Rngs(7))
  want = opts.quantize(nnx.initializers.lecun_normal()(nnx.Rngs(7).params(), (k, n)))
  got = getattr(layer.kernel, "get_value", lambda: layer.kernel.value)()
  np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(want.dequantize()))
  x = rng.standard_normal((3, k)).astype(np.float32)
  assert rel_err(layer(jnp.asarray(x)), x.astype(np.float64) @ np.asarray(
      got.dequantize(), np.float64)) < 1e-5  # bias is zero-initialized


def int4_ref(w, g):
  """Symmetric RTN int4 in float64: scale = group absmax / 7, codes in [-8, 7]."""
  k, n = w.shape
  wg = np.asarray(w, np.float64).reshape(k // g, g, n)
  s = np.abs(wg).max(axis=1, keepdims=True) / 7
  return (np.clip(np.round(wg / s), -8, 7) * s).reshape(k, n)


def test_quantization_report_lists_what_happened(caplog):
  rng = _rng("report")
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  params = {"block_0": {"mlp_up": {"kernel": f(128, 40), "bias": f(40)},
                        "attn_q": {"kernel": f(96, 24)}},
            "block_1": {"mlp_up": {"kernel": f(64, 40)}},
            "head": {"kernel": f(40, 11)}, "norm": {"scale": f(128)}}
  mlp = QuantRule(r"mlp_up/kernel$", group_size=64, scale_dtype=jnp.float32)
  rest = QuantRule(r"/kernel$", group_size=None, scale_dtype=jnp.float32)
  moe = QuantRule(r"experts", group_size=32)
  with caplog.at_level(logging.WARNING, logger="flax_layers"):
    q, report = quantize_model(params, [mlp, rest, moe], skip=[r"^head/", r"lm_head"])
  assert isinstance(report, QuantizationReport)
  assert report.quantized == {"block_0/attn_q/kernel": rest, "block_0/mlp_up/kernel": mlp,
                              "block_1/mlp_up/kernel": mlp}
  assert report.skipped == {"head/kernel": r"^head/"}
  assert report.unused_rules == (moe,) and report.unused_skips == ("lm_head",)
  assert "'experts'" in caplog.text and "'lm_head'" in caplog.text
  text = str(report)
  assert "quantized 3 parameters:" in text and "skipped 1:" in text
  assert "block_0/attn_q/kernel: int4 group_size=None symmetric=True" in text
  for path, g in [("block_0/mlp_up/kernel", 64), ("block_1/mlp_up/kernel", 64),
                  ("block_0/attn_q/kernel", 96)]:
    a, b, c = path.split("/")
    assert q[a][b][c].num_groups == params[a][b][c].shape[0] // g
    assert rel_err(q[a][b][c].dequantize(), int4_ref(params[a][b][c], g)) < 1e-6
  assert q["head"]["kernel"] is params["head"]["kernel"]
  assert q["block_0"]["mlp_up"]["bias"] is params["block_0"]["mlp_up"]["bias"]


SMOLLM = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
          "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
          "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "vocab_size": 49152,
          "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "rope_scaling": None}


@pytest.mark.parametrize("extra,want", [
    ({}, dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
              head_dim=64, ffn_size=1536, rope_base=1e5, rope_dim=64, rms_eps=1e-5,
              context_length=8192)),
    ({"model_type": "mistral", "hidden_size": 5120, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6, "rms_norm_eps": None,
      "max_position_embeddings": None, "sliding_window": None, "vocab_size": 131073},
     dict(vocab_size=131073, num_heads=32, num_kv_heads=8, head_dim=128, rope_dim=128,
          rope_base=1e6, rms_eps=1e-6, context_length=2048)),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
      "num_key_value_heads": None, "hidden_size": 96, "num_attention_heads": 3},
     dict(rope_base=5e5, num_heads=3, num_kv_heads=3, head_dim=32, rope_dim=32))])
def test_from_hf_config_maps_fields(extra, want):
  config = {k: v for k, v in {**SMOLLM, **extra}.items() if v is not None}  # None: absent
  cfg = LlamaConfig.from_hf_config(config, dtype=jnp.bfloat16, scan_layers=False)
  assert {k: getattr(cfg, k) for k in want} == want
  assert cfg.dtype == jnp.bfloat16 and cfg.scan_layers is False


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "intermediate_size", "vocab_size"])
def test_from_hf_config_names_a_missing_key(key):
  config = {k: v for k, v in SMOLLM.items() if k != key}
  with pytest.raises(ValueError, match=f"lacks '{key}'"):
    LlamaConfig.from_hf_config(config)


@pytest.mark.parametrize("extra,match", [
    ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling of rope_type 'llama3' lacks low_freq_factor, high_freq_factor, "
     "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     "rope_scaling of rope_type 'linear' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}},
     "rope_parameters of rope_type 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true"), ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"sliding_window": 4096}, "sliding_window=4096")])
def test_from_hf_config_rejects_what_it_cannot_run(extra, match):
  with pytest.raises(ValueError, match=match):
    LlamaConfig.from_hf_config({**SMOLLM, **extra})
  if "sliding_window" in extra:  # switched off: accepted
    LlamaConfig.from_hf_config({**SMOLLM, **extra, "use_sliding_window": False})


@pytest.mark.parametrize("k,n,g", [(256, 24, 32), (384, 40, 128), (192, 8, None), (320, 16, 64)])
def test_num_groups_is_k_over_group_size(k, n, g):
  want = 1 if g is None else k // g
  w = qjax.quantize(jnp.asarray(_rng(f"ng{k}{n}{g}").standard_normal((k, n)), jnp.float32),
                    group_size=g)
  nk = qjax.to_int4_nk(w)
  gptq = qjax.GPTQWeight(qweight=np.zeros((k // 8, n), np.int32),
                         qzeros=np.zeros((want, n // 8), np.int32),
                         scales=np.ones((want, n), np.float16), g_idx=None, shape=(k, n),
                         group_size=-1 if g is None else g)
  for x in (w, nk, gptq):
    assert x.num_groups == want == x.scales.shape[0], type(x).__name__
  if g in (64, 128):
    cb = qjax.quantize_codebook(jnp.asarray(w.dequantize()), group=g)
    assert cb.num_groups == want == cb.norms.shape[0]


@pytest.mark.parametrize("mode,spec", [("column", P(None, "tp")), ("row", P("tp", None))])
def test_sharded_weight_as_weight(mode, spec):
  if jax.device_count() < 2:  # conftest.py asks for 8 CPU devices
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  k, n, g = 512, 48, 64
  w64 = exact_int4(_rng(f"sharded{mode}"), k, n, g)
  sw = qjax.ShardedWeight.of(qjax.quantize(jnp.asarray(w64, jnp.float32), group_size=g),
                             mesh, "tp", mode)
  outside = sw.as_weight()  # the global weight
  assert isinstance(outside, qjax.Int4Weight) and outside.shape == (k, n)
  assert rel_err(outside.dequantize(), w64) < 1e-6
  seen = []

  def body(s):
    local = s.as_weight()
    seen.append((type(local), local.shape, local.num_groups))
    return local.dequantize()

  got = jax.jit(sharding_lib.shard_map(body, mesh, in_specs=(sw.partition_specs(),),
                                       out_specs=spec))(sw)
  local_shape = (k, n // 2) if mode == "column" else (k // 2, n)
  assert seen == [(qjax.Int4Weight, local_shape, local_shape[0] // g)]
  assert rel_err(got, w64) < 1e-6  # the slices put together are W
