"""Deferred RMSNorms (``LlamaConfig.defer_norm``): each norm before a matmul hands it
``x * scale`` and multiplies its output rows by ``1 / rms(x)``; the model's logits and
caches must be the normalized model's up to rounding, checked against float64."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import on_device, random_cache, seed_from, small_llama
from flax_layers import llama


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 40), (5, 7)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_parts_against_float64(request, shape, dtype):
  rng = np.random.default_rng(seed_from(request.node.name))
  x = (rng.standard_normal(shape) * 30 + 5).astype(np.float32)
  scale = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
  eps = 1e-5
  norm = llama.RMSNorm(eps, deferred=True)
  xs, inv_rms = norm.apply({"params": {"scale": jnp.asarray(scale)}}, jnp.asarray(x, dtype))
  xd = np.asarray(jnp.asarray(x, dtype), np.float64)  # what the norm reads
  want_inv = 1 / np.sqrt(np.mean(xd * xd, -1, keepdims=True) + eps)
  assert xs.dtype == dtype and inv_rms.dtype == jnp.float32 and inv_rms.shape == (*shape[:-1], 1)
  np.testing.assert_allclose(np.asarray(inv_rms, np.float64), want_inv, rtol=1e-6)
  tol = 1e-6 if dtype == jnp.float32 else 8e-3  # one rounding to dtype
  np.testing.assert_allclose(np.asarray(xs, np.float64), xd * scale, rtol=tol)
  # the product the matmul then sees is the normalized x's
  full = llama.RMSNorm(eps).apply({"params": {"scale": jnp.asarray(scale)}},
                                  jnp.asarray(x, dtype))
  np.testing.assert_allclose(np.asarray(xs, np.float64) * np.asarray(inv_rms, np.float64),
                             np.asarray(full, np.float64), rtol=2 * tol, atol=2 * tol)


def test_norm_deferred_only_where_the_dtype_allows():
  cfg = llama.LlamaConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
                          num_kv_heads=1, head_dim=8, ffn_size=8)
  assert cfg.defer_norm and cfg.norm_deferred  # float32
  assert dataclasses.replace(cfg, dtype=jnp.bfloat16).norm_deferred
  assert not dataclasses.replace(cfg, dtype=jnp.float16).norm_deferred  # range
  assert not dataclasses.replace(cfg, defer_norm=False).norm_deferred


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 6e-2)])
def test_model_deferred_equals_normalized(request, dtype, tol):
  """Prefill and a decode step, deferred and not: logits within rounding of each other
  (relative to the largest logit), the caches too; both near the float32 model's."""
  rng = np.random.default_rng(seed_from(request.node.name))
  cfg, params = small_llama(rng)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  cache = random_cache(cfg, rng, 2, 16)
  out = {}
  for defer in (True, False):
    c = dataclasses.replace(cfg, dtype=dtype, defer_norm=defer)
    assert c.norm_deferred == defer
    ca = {n: v.astype(dtype) for n, v in cache.items()}
    logits, ca = llama.prefill(params, tokens, on_device(ca), cfg=c)
    step, ca = llama.decode_step(params, tokens[:, -1], jnp.array([9, 9]), ca, cfg=c)
    out[defer] = [np.asarray(a, np.float64) for a in (logits, step, ca["k"], ca["v"])]
  for a, b in zip(out[True], out[False]):
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=tol * np.abs(b).max())
