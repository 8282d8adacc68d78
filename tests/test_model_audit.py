"""Audit of the Llama model, its Hugging Face export and tensor parallelism as a user
runs them (session 48's helper audit): each test is a defect that was found — a silent
loss or wrong value, or an error that named neither the bad value nor what to do."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_layers
from flax_layers import hf_checkpoint
from flax_layers import llama
import test_generation_audit
from test_generation_audit import VOCAB, _config, _model


@pytest.fixture(scope="module")
def model():
  cfg = _config("gqa3x1")
  params, _ = _model(cfg, 1)
  return cfg, params


@pytest.mark.parametrize("field,value,match", [
    ("rope_base", 0.0, r"rope_base=0\.0 must be a positive finite number"),
    ("rope_base", float("inf"), r"rope_base=inf must be a positive finite number"),
    ("rms_eps", -1.0, r"rms_eps=-1\.0 must be a finite number >= 0"),
    ("context_length", 0, r"context_length=0 must be a positive int"),
    ("dtype", jnp.int8, r"dtype=.*int8.* must be a float dtype"),
])
def test_config_refuses_impossible_numbers(field, value, match):
  """rope_base 0 and rms_eps -1 gave NaN logits, context_length 0 was accepted, and an
  int8 dtype was blamed on x's dtype inside a matmul."""
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(_config("gqa3x1"), **{field: value})


def test_token_ids_outside_the_vocabulary_give_nan_logits(model):
  """An id past the vocabulary gave NaN logits but a negative one silently took the last
  row (jnp.take wraps): both have no row now, and give NaN, as do the later positions of
  their sequence (they attend to it); other sequences are untouched."""
  cfg, params = model
  ids = jnp.asarray([[5, 7, 9], [-1, 7, 9], [VOCAB, 7, 9], [VOCAB - 1, 7, 9]], jnp.int32)
  logits = np.asarray(llama.forward(params, ids, cfg=cfg))
  nan = np.isnan(logits).any(axis=-1)
  assert nan.tolist() == [[False] * 3, [True] * 3, [True] * 3, [False] * 3]
  np.testing.assert_array_equal(logits[0], np.asarray(llama.forward(params, ids[:1], cfg=cfg))[0])


@pytest.mark.parametrize("tokens,match", [
    (np.asarray([1, 2, 3], np.int32), r"tokens of shape \(3,\) must be \[batch, seq\]"),
    (np.asarray([[1.0, 2.0]], np.float32), r"tokens of dtype float32 must be integer"),
])
def test_tokens_of_the_wrong_rank_or_dtype_are_named(model, tokens, match):
  """1-D tokens failed with an IndexError; float tokens were truncated to ints."""
  cfg, params = model
  with pytest.raises(ValueError, match=match):
    llama.forward(params, jnp.asarray(tokens), cfg=cfg)
  cache = llama.init_cache(cfg, 1, 8)
  with pytest.raises(ValueError, match="token of"):
    llama.decode_step(params, jnp.asarray([[1]], jnp.int32), 0, cache, cfg=cfg)


@pytest.mark.parametrize("change,match", [
    (dict(vocab_size=VOCAB + 1), r"param 'embed' has shape \(96, 80\), want \(96, 81\)"),
    (dict(num_layers=3), r"the params hold 2 layers, the config num_layers=3"),
    (dict(num_layers=1), r"the params hold 2 layers, the config num_layers=1"),
    (dict(num_layers=3, scan_layers=False), r"the params have no 'layers_0'"),
])
def test_params_of_another_model_are_named(model, change, match):
  """A config of a larger vocabulary ran and returned the table's width of logits;
  another layer count failed in lax.scan ("different leading axis sizes")."""
  cfg, params = model
  with pytest.raises(ValueError, match=match):
    llama.forward(params, jnp.asarray([[1, 2]], jnp.int32),
                  cfg=dataclasses.replace(cfg, **change))


def test_unrolled_params_with_extra_layers_are_named(model):
  """Unrolled (``layers_{i}``) params with more layers than the config: the extra ones
  were ignored."""
  cfg, params = model
  p = dict(params["params"])
  blocks = p.pop("blocks")
  for i in range(3):
    p[f"layers_{i}"] = jax.tree.map(lambda a, i=min(i, 1): a[i], blocks)
  unrolled = dataclasses.replace(cfg, scan_layers=False)
  with pytest.raises(ValueError, match="the params hold 3 layers, the config num_layers=2"):
    llama.forward({"params": p}, jnp.asarray([[1, 2]], jnp.int32), cfg=unrolled)


def test_init_cache_refuses_a_batch_below_one(model):
  cfg, _ = model
  with pytest.raises(ValueError, match="batch=0 must be a positive int"):
    llama.init_cache(cfg, 0, 4)


@pytest.mark.parametrize("change,match", [
    (dict(o_bias=True), "o_bias=True"),
    (dict(attn_sinks=True), "attn_sinks=True"),
    (dict(sliding_window=3, sliding_layers=(True, False)), "sliding_window=3"),
    (dict(yarn=llama.YarnScaling(factor=4.0, original_context=512)), "yarn"),
])
def test_hf_export_refuses_what_a_llama_config_cannot_hold(model, tmp_path, change, match):
  """save_hf_llama wrote such models without these options (the reloaded model's logits
  differed by 3.6); now refused by name before anything is written."""
  cfg, params = model
  with pytest.raises(ValueError, match=f"{match}.*the HF Llama config has no place"):
    hf_checkpoint.save_hf_llama(tmp_path / "out", params, dataclasses.replace(cfg, **change))
  assert not (tmp_path / "out").exists()


def test_hf_export_of_fused_projections_is_named(model, tmp_path):
  """fuse_projections' params gave a bare KeyError 'q'."""
  cfg, params = model
  with pytest.raises(ValueError, match=r"^(\w+/)?attn/qkv, (\w+/)?mlp/gate_up: projections "
                     r"joined by flax_layers\.fuse_projections; save .*before "
                     "fuse_projections"):
    hf_checkpoint.save_hf_llama(tmp_path / "out", llama.fuse_projections(params), cfg)


def test_tensor_parallel_splits_attention_sinks_with_the_heads(monkeypatch):
  """GPT-OSS's attention sinks (one logit per head) were replicated while each device runs
  its own heads: "sinks of shape (4,), want (num_heads=2,)". Split with the heads, the
  logits equal one device's."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (tests/conftest.py sets 8 CPU devices)")
  # Widths whose halves are whole 32-row groups (the row-parallel o and down).
  monkeypatch.setattr(test_generation_audit, "HIDDEN", 128)
  monkeypatch.setattr(test_generation_audit, "FFN", 128)
  monkeypatch.setitem(test_generation_audit.SHAPES, "tp", (4, 2, 32, 32))
  cfg = _config("tp", attn_sinks=True, o_bias=True)
  params, _ = _model(dataclasses.replace(cfg, attn_sinks=False, o_bias=False), 2)
  rng = np.random.default_rng(3)
  attn = params["params"]["blocks"]["attn"]
  attn["sinks"] = jnp.asarray(rng.standard_normal((cfg.num_layers, cfg.num_heads)),
                              jnp.float32)
  attn["o"]["bias"] = jnp.asarray(rng.standard_normal((cfg.num_layers, cfg.hidden_size))
                                  * 0.3, jnp.float32)
  ids = jnp.asarray(rng.integers(0, VOCAB, (2, 7)), jnp.int32)
  want = np.asarray(llama.forward(params, ids, cfg=cfg))
  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  sharded = flax_layers.shard_llama_params(flax_layers.splittable_layouts(params, 2), mesh,
                                           cfg)
  got = np.asarray(flax_layers.tp_forward(sharded, ids, cfg=cfg, mesh=mesh))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
