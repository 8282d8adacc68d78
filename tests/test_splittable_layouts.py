"""``flax_layers.splittable_layouts``: INT4 projections whose 128-row tiles cannot split
over the devices of a row split are repacked to plain order, losslessly, so the
tensor-parallel model runs (``qjax generate --devices 3`` on SmolLM2 with the kernels'
layouts failed on 4 H200s: K = 576 over 3 devices is 192 rows each)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_layers
import qjax
from conftest import seed_from
from flax_layers import llama
from qjax._src import split_rules


def _int4(rng, k, n, layers=None):
  def one():
    return qjax.quantize(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32),
                         group_size=32)
  if layers is None:
    return one()
  return jax.tree.map(lambda *a: jnp.stack(a), *[one() for _ in range(layers)])


def test_only_the_weights_that_do_not_split_are_repacked(request):
  rng = np.random.default_rng(seed_from(request.node.name))
  o, q, down = _int4(rng, 576, 64, 2), _int4(rng, 576, 192, 2), _int4(rng, 1536, 64, 2)
  params = {"params": {"blocks": {"attn": {"o": {"kernel": o}, "q": {"kernel": q}},
                                  "mlp": {"down": {"kernel": down}},
                                  "attn_norm": {"scale": jnp.ones(576)}}}}
  # The error names the remedy.
  with pytest.raises(ValueError, match=r"192 rows per device.*w\.repack\(8\).*"
                     r"flax_layers\.splittable_layouts\(params, n\)"):
    split_rules.check_split(o, "row", 3)
  out = flax_layers.splittable_layouts(params, 3)["params"]["blocks"]
  new_o = out["attn"]["o"]["kernel"]
  assert new_o.tile_k == 8 and o.tile_k == 128
  split_rules.check_split(new_o, "row", 3)
  np.testing.assert_array_equal(np.asarray(new_o.dequantize()), np.asarray(o.dequantize()))
  assert out["attn"]["q"]["kernel"] is q  # column split of 192 columns: whole already
  assert out["mlp"]["down"]["kernel"] is down  # 512 rows each: whole 128-row tiles
  assert out["attn_norm"]["scale"] is params["params"]["blocks"]["attn_norm"]["scale"]
  # over 2 devices o's 288 rows are no whole tiles either; over 1 nothing changes
  assert flax_layers.splittable_layouts(params, 1)["params"]["blocks"]["attn"]["o"][
      "kernel"] is o


def test_tensor_parallel_model_runs_after_the_relayout(request):
  """A 3-head model whose o projection has K = 192 (64 rows a device): sharding it as
  quantized fails; after splittable_layouts tp_forward equals the one-device forward."""
  if jax.device_count() < 3:
    pytest.skip("needs 3 devices (tests/conftest.py sets 8 CPU devices)")
  rng = np.random.default_rng(seed_from(request.node.name))
  cfg = llama.LlamaConfig(vocab_size=32, hidden_size=192, num_layers=2, num_heads=3,
                          num_kv_heads=3, head_dim=64, ffn_size=384, dtype=jnp.float32)
  layers = 2

  def norm():
    return {"scale": jnp.asarray(1 + 0.2 * rng.standard_normal((layers, 192)), jnp.float32)}

  params = {"params": {
      "embed": _int4(rng, 192, 32), "final_norm": {"scale": jnp.ones(192)},
      "blocks": {"attn_norm": norm(), "ffn_norm": norm(),
                 "attn": {n: {"kernel": _int4(rng, 192, 192, layers)} for n in "qkvo"},
                 "mlp": {"gate": {"kernel": _int4(rng, 192, 384, layers)},
                         "up": {"kernel": _int4(rng, 192, 384, layers)},
                         "down": {"kernel": _int4(rng, 384, 192, layers)}}}}}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("tp",))
  with pytest.raises(ValueError, match="attn/o/kernel: row-parallel Int4Weight"):
    flax_layers.shard_llama_params(params, mesh, cfg)
  tokens = jnp.asarray(rng.integers(0, 32, (2, 7)), jnp.int32)
  want = np.asarray(llama.forward(params, tokens, cfg=cfg))
  sharded = flax_layers.shard_llama_params(flax_layers.splittable_layouts(params, 3), mesh,
                                           cfg)
  got = np.asarray(flax_layers.tp_forward(sharded, tokens, cfg=cfg, mesh=mesh))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
