"""``llama.decode_loop`` / ``llama.decode_tokens``: several decode steps in one XLA loop give
the tokens, cache and key of one ``decode_and_sample`` call per token, and stop where the
caller's loop would."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import on_device, random_cache, seed_from, small_llama
from flax_layers import llama


def _state(cfg, rng, first=5, pos=3, slots=24):
  return jnp.array([first]), jnp.array([pos]), random_cache(cfg, rng, 1, slots), jax.random.key(7)


def _one_call_per_token(params, cfg, token, pos, cache, key, count, stop, **kw):
  """The reference: decode_and_sample per token, stopping after a stop token or -1."""
  ids, cache = [], on_device(cache)
  for _ in range(count):
    token, pos, cache, key = llama.decode_and_sample(params, token, pos, cache, key, cfg=cfg,
                                                     **kw)
    ids.append(int(token[0]))
    if ids[-1] in stop or ids[-1] < 0:
      break
  return ids, token, pos, cache, key


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("count", [0, 1, 5, 8])
def test_equals_one_call_per_token(request, temperature, count):
  rng = np.random.default_rng(seed_from(request.node.name))
  cfg, params = small_llama(rng)
  token, pos, cache, key = _state(cfg, rng)
  kw = dict(temperature=temperature, top_p=0.9 if temperature else 1.0)
  want, wtoken, wpos, wcache, wkey = _one_call_per_token(params, cfg, token, pos, cache, key,
                                                         count, (), **kw)
  tokens, steps, gtoken, gpos, gcache, gkey = llama.decode_tokens(
      params, token, pos, on_device(cache), key, jnp.int32(count), jnp.array([-2]), cfg=cfg,
      max_steps=8, **kw)
  assert int(steps) == count == len(want)
  assert np.asarray(tokens[:, 0]).tolist() == want + [-2] * (8 - count)
  if count:
    assert int(gtoken[0]) == int(wtoken[0]) and int(gpos[0]) == int(wpos[0]) == 3 + count
  for n in ("k", "v"):
    np.testing.assert_allclose(np.asarray(gcache[n]), np.asarray(wcache[n]), rtol=1e-5,
                               atol=1e-6)
  np.testing.assert_array_equal(jax.random.key_data(gkey), jax.random.key_data(wkey))


def test_stops_at_a_stop_token_and_at_nan(request):
  """The loop ends after the first stop token (its steps and key as a caller's loop that
  stops there), and after a -1 (NaN logits: a position past the cache)."""
  rng = np.random.default_rng(seed_from(request.node.name))
  cfg, params = small_llama(rng)
  token, pos, cache, key = _state(cfg, rng)
  free, *_ = _one_call_per_token(params, cfg, token, pos, cache, key, 6, ())
  stop = free[2]  # the third token ends it
  want, *_, wkey = _one_call_per_token(params, cfg, token, pos, cache, key, 6, (stop,))
  tokens, steps, *_, gkey = llama.decode_tokens(
      params, token, pos, on_device(cache), key, jnp.int32(6), jnp.array([stop, 99]), cfg=cfg,
      max_steps=8)
  assert int(steps) == len(want) == free.index(stop) + 1
  assert np.asarray(tokens[:len(want), 0]).tolist() == want
  np.testing.assert_array_equal(jax.random.key_data(gkey), jax.random.key_data(wkey))
  # steps at positions 21 .. 23 are in a 24-slot cache, 24 is not: NaN logits, -1 ends it
  tokens, steps, *_ = llama.decode_tokens(
      params, token, jnp.array([21]), on_device(cache), key, jnp.int32(6), jnp.array([-2]),
      cfg=cfg, max_steps=8)
  ids = np.asarray(tokens[:, 0]).tolist()
  assert int(steps) == 4 and ids[3] == -1 and min(ids[:3]) >= 0 and ids[4:] == [-2] * 4
