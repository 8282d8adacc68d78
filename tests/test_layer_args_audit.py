"""Arguments of the public layer helpers that failed deep inside JAX or passed silently
(session 49's API audit): apply_rope, route, init_cache, quantize_dense_params, sample."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_layers import llama
from flax_layers import moe
from flax_layers import quantize_dense_params

from conftest import seed_from


def _x(shape=(2, 3, 2, 8)):
  rng = np.random.default_rng(seed_from("rope-args"))
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


POS = jnp.asarray([[0, 1, 2], [5, 6, 7]], jnp.int32)


@pytest.mark.parametrize("x, positions, rope_dim, factors, match", [
    (_x(), POS, 3, None, r"rope_dim=3 must be an even int in \[2, 8\]"),
    (_x(), POS, 10, None, r"rope_dim=10 must be an even int in \[2, 8\]"),
    (_x(), POS, 8.0, None, r"rope_dim=8\.0 must be an even int"),
    (_x(), POS[0], 8, None, r"positions of shape \(3,\) and dtype int32 must be integer "
                            r"\[batch, seq\] = \[2, 3\]"),
    (_x(), POS.astype(jnp.float32), 8, None, r"dtype float32 must be integer"),
    (_x(), POS[:, :2], 8, None, r"positions of shape \(2, 2\)"),
    (_x(), POS, 8, jnp.ones((3,)), r"freq_factors of shape \(3,\) must be \[rope_dim // "
                                   r"2\] = \[4\]"),
    (_x((3, 2, 8)), POS, 8, None, r"x of shape \(3, 2, 8\) must be \[batch, seq, heads, "
                                  r"head_dim\]"),
])
def test_apply_rope_names_the_bad_argument(x, positions, rope_dim, factors, match):
  """These gave a reshape TypeError, an IndexError, an incompatible-shapes TypeError, or
  (3-D x) a silently wrong result."""
  with pytest.raises(ValueError, match=match):
    llama.apply_rope(x, positions, 10000.0, rope_dim, freq_factors=factors)


def test_apply_rope_broadcasts_a_batch_of_one_positions():
  x = _x()
  got = llama.apply_rope(x, POS[:1], 10000.0, 8, neox=True)
  want = llama.apply_rope(x, jnp.broadcast_to(POS[:1], (2, 3)), 10000.0, 8, neox=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("top_k", [2.5, True, 0, 5])
def test_route_refuses_top_k_that_is_not_an_expert_count(top_k):
  logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4)), jnp.float32)
  with pytest.raises(ValueError, match=rf"top_k={top_k!r} must be an int in \[1, 4\]"):
    moe.route(logits, top_k)


@pytest.mark.parametrize("batch, max_len, match", [
    (1.5, 4, r"batch=1\.5 must be a positive int"),
    (1, 4.0, r"max_len=4\.0 must be a positive int"),
    (1, 0, r"max_len=0 must be a positive int"),
])
def test_init_cache_refuses_non_integer_sizes(batch, max_len, match):
  cfg = llama.LlamaConfig(vocab_size=32, hidden_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=32, ffn_size=128)
  with pytest.raises(ValueError, match=match):
    llama.init_cache(cfg, batch, max_len)


def test_quantize_dense_params_checks_the_bias_and_the_keys():
  """A bias of the wrong length passed and failed at apply with ScopeParamShapeError;
  other keys were carried along."""
  kernel = jnp.asarray(np.random.default_rng(2).standard_normal((64, 3)), jnp.float32)
  with pytest.raises(ValueError, match=r"bias of shape \(5,\) does not match the kernel of "
                     r"shape \(64, 3\): it must be \[N\] = \[3\]"):
    quantize_dense_params({"kernel": kernel, "bias": jnp.ones(5)}, group_size=32)
  with pytest.raises(ValueError, match=r"params hold \['foo'\] besides 'kernel' and 'bias'"):
    quantize_dense_params({"kernel": kernel, "foo": jnp.ones(3)}, group_size=32)
  out = quantize_dense_params({"kernel": kernel, "bias": jnp.arange(3.0)}, group_size=32)
  np.testing.assert_array_equal(np.asarray(out["bias"]), [0.0, 1.0, 2.0])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_gives_no_token_for_a_row_without_a_possible_token(temperature):
  """A row of only -inf gave token 0; now -1, as a NaN row does. Other rows are drawn."""
  logits = jnp.asarray([[-jnp.inf] * 5, [0.0, 3.0, -jnp.inf, 1.0, 0.5],
                        [-jnp.inf, -jnp.inf, 2.0, -jnp.inf, -jnp.inf]], jnp.float32)
  got = np.asarray(llama.sample(logits, jax.random.key(0), temperature=temperature))
  assert got[0] == -1 and got[2] == 2
  assert got[1] in ((1,) if temperature == 0 else (0, 1, 3, 4))


def test_sample_hint_for_logits_with_a_sequence_axis():
  with pytest.raises(ValueError, match=r"must be \[batch, vocab\]; for \[batch, seq, vocab\] "
                     r"pass the position to sample, e\.g\. logits\[:, -1\]"):
    llama.sample(jnp.zeros((2, 3, 5)))
  with pytest.raises(ValueError, match=r"add a batch axis"):
    llama.sample(jnp.zeros((5,)))


@pytest.mark.parametrize("temperature", [1e-39, 1e-38, 1e-30, 1e-6])
def test_sample_at_a_tiny_temperature_is_greedy(temperature):
  """Temperatures of 1e-38 and below gave token 0 for every row (the logits overflowed,
  or the subnormal temperature was flushed to zero, and the softmax was NaN)."""
  rng = np.random.default_rng(seed_from("tiny-temperature"))
  logits = jnp.asarray(rng.standard_normal((6, 50)) * 30, jnp.float32)
  want = np.asarray(jnp.argmax(logits, axis=-1))
  for seed in range(3):
    got = llama.sample(logits, jax.random.key(seed), temperature=temperature, top_p=0.9)
    np.testing.assert_array_equal(np.asarray(got), want)
