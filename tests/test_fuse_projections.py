"""``qjax.concat_columns`` (weights joined along N, losslessly) and
``flax_layers.fuse_projections`` (a Llama's q / k / v and gate / up as one matmul each).

concat_columns: every format with a column rule, quantized at ``[K, N]`` then cut into
column runs along each field's N axis (as a column split does), joins back bit for bit,
leading (stacked-layer) axes included; weights quantized apart join so that the joined
weight dequantizes to their dequantizations side by side (bit for bit; the codebook's,
whose dequantize rotates back by a matmul, within 1e-6 on a GPU), and ``x @ joined``
equals the float64 products side by side. Mismatches are refused by name.

fuse_projections: :mod:`test_generation_audit`'s random INT4 models with the projections
joined still match its float64 reference (forward, and prefill then cached decoding), as
the separate ones do; a layer whose projections do not join (one of another group size)
keeps them apart; ``qkv_bias`` joins with the weights; tensor parallelism refuses joined
params by name. Measured on the CPU (float32): the
joined model's logits equal the separate one's bit for bit on XLA, and both are within
2e-5 of the largest float64 logit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import seed_from
from flax_layers import llama
from qjax._src import codebook
from qjax._src import gguf_formats as gf
from qjax._src import gguf_tiled
from qjax._src import split_rules
from test_generation_audit import VOCAB, _close, _config, _model, _reference_logits

K = 256


def _f32(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _gguf(ggml_type: str, k: int, n: int, rng, tiled: bool):
  cls = gf.BLOCK_FORMATS[ggml_type]
  raw = rng.integers(0, 256, (n, k // cls.block_size, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.standard_normal(raw.shape[:2]) * 1e-2).astype(np.float16)
      raw[..., f.offset:f.offset + 2] = v.view(np.uint8).reshape(*raw.shape[:2], 2)
  w = gf.from_gguf_bytes(raw.reshape(n, -1), ggml_type, (k, n))
  return gguf_tiled.GGUFTiledWeight.from_gguf(w) if tiled else w


# name -> (a [K, N] weight of that format, from the seed's rng)
MAKERS = {
    "int4_sym_g32": lambda r, n: qjax.quantize(_f32(r, (K, n)), group_size=32),
    "int4_asym_g128": lambda r, n: qjax.quantize(_f32(r, (K, n)), group_size=128,
                                                 symmetric=False),
    "int4_nk": lambda r, n: qjax.to_int4_nk(qjax.quantize(_f32(r, (K, n)), group_size=64)),
    "mxfp4": lambda r, n: qjax.quantize_mxfp4(_f32(r, (K, n))),
    "nvfp4": lambda r, n: qjax.quantize_nvfp4(_f32(r, (K, n))),
    "q4_k_tiled": lambda r, n: _gguf("Q4_K", K, n, r, tiled=True),
    "q8_0_tiled": lambda r, n: _gguf("Q8_0", K, n, r, tiled=True),
    "q6_k_blocks": lambda r, n: _gguf("Q6_K", K, n, r, tiled=False),
    "q4_1_blocks": lambda r, n: _gguf("Q4_1", K, n, r, tiled=False),
    "codebook": lambda r, n: qjax.quantize_codebook(_f32(r, (K, n)), passes=2),
}
SPLITS = (40, 24, 8)  # column runs: a multiple of 8, N not a power of two


def _cut(w, start: int, stop: int):
  """Columns ``[start, stop)`` of ``w``: every field with an N axis sliced along it."""
  p = split_rules.parts_of(w)
  arrays = {}
  for name, fa in split_rules.rule_of(p).fields:
    a = p.arrays[name]
    if a is not None and fa.n is not None:
      a = jax.lax.slice_in_dim(a, start, stop, axis=a.ndim + fa.n)
    arrays[name] = a
  static = dict(p.static, shape=(p.static["shape"][0], stop - start))
  return p.cls(**arrays, **static)


def _leaves_equal(a, b) -> None:
  assert type(a) is type(b) and a.shape == b.shape
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("fmt", MAKERS)
def test_cut_weights_join_back_bit_for_bit(fmt, request):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  w = MAKERS[fmt](rng, sum(SPLITS))
  edges = np.cumsum((0,) + SPLITS)
  parts = [_cut(w, a, b) for a, b in zip(edges[:-1], edges[1:])]
  _leaves_equal(qjax.concat_columns(parts), w)


@pytest.mark.parametrize("fmt", ["int4_asym_g128", "mxfp4", "q4_k_tiled", "codebook"])
def test_weights_quantized_apart_join_side_by_side(fmt, request):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  parts = [MAKERS[fmt](rng, n) for n in SPLITS]
  joined = qjax.concat_columns(parts)
  assert joined.shape == (K, sum(SPLITS))
  want = np.concatenate([np.asarray(p.dequantize(), np.float64) for p in parts], axis=1)
  got_w = np.asarray(joined.dequantize(), np.float64)
  if fmt == "codebook":  # its dequantize rotates back by a matmul, whose order of sums on
    # a GPU depends on N (H100: not bit-equal); the joined codes are (the cut test)
    np.testing.assert_allclose(got_w, want, rtol=0, atol=1e-6 * np.abs(want).max())
  else:
    np.testing.assert_array_equal(got_w, want)
  x = np.asarray(_f32(rng, (3, K)), np.float64)
  got = np.asarray(qjax.matmul(jnp.asarray(x, jnp.float32), joined, implementation="xla"),
                   np.float64)
  np.testing.assert_allclose(got, x @ want, rtol=0, atol=2e-5 * np.abs(x @ want).max())


def test_stacked_weights_join_along_n():
  rng = np.random.default_rng(0)
  layers = [[MAKERS["int4_sym_g32"](rng, n) for n in SPLITS] for _ in range(3)]
  stacks = [jax.tree.map(lambda *a: jnp.stack(a), *[layer[i] for layer in layers])
            for i in range(len(SPLITS))]
  joined = qjax.concat_columns(stacks)
  assert joined.codes.shape[0] == 3 and joined.shape == (K, sum(SPLITS))
  for i, layer in enumerate(layers):
    _leaves_equal(jax.tree.map(lambda a: a[i], joined), qjax.concat_columns(layer))


def test_plain_arrays_join_along_the_last_axis():
  a, b = np.ones((2, 5, 3), np.float32), np.zeros((2, 5, 4), np.float32)
  assert qjax.concat_columns([a, b]).shape == (2, 5, 7)
  with pytest.raises(ValueError, match=r"weights\[1\] of shape \(2, 6, 4\)"):
    qjax.concat_columns([a, np.zeros((2, 6, 4), np.float32)])


def test_mismatches_are_refused_by_name():
  rng = np.random.default_rng(1)
  g32, g64 = (qjax.quantize(_f32(rng, (K, 16)), group_size=g) for g in (32, 64))
  with pytest.raises(ValueError, match="at least one"):
    qjax.concat_columns([])
  with pytest.raises(ValueError, match="group_size"):
    qjax.concat_columns([g32, g64])
  with pytest.raises(ValueError, match=r"weights\[1\] is a MXFP4Weight"):
    qjax.concat_columns([g32, MAKERS["mxfp4"](rng, 16)])
  with pytest.raises(ValueError, match="K"):
    qjax.concat_columns([g32, qjax.quantize(_f32(rng, (2 * K, 16)), group_size=32)])
  with pytest.raises(ValueError, match="global_scale"):  # each has its own tensor scale
    qjax.concat_columns([MAKERS["nvfp4"](rng, 16), MAKERS["nvfp4"](rng, 16)])
  with pytest.raises(ValueError, match="codebook"):  # another table of 16 values
    qjax.concat_columns([codebook.quantize_codebook(_f32(rng, (K, 16))),
                         codebook.quantize_codebook(_f32(rng, (K, 16)), codebook="nf4")])
  with pytest.raises(ValueError, match="does not join"):
    qjax.concat_columns([g32, np.zeros((K, 16), np.float32)])


# --- fuse_projections on a model -------------------------------------------------------


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """As test_generation_audit's: float32 dots at float32 accuracy on a GPU too."""
  with jax.default_matmul_precision("highest"):
    yield


def _fused_names(params) -> tuple[set, set]:
  blocks = params["params"]["blocks"]
  return set(blocks["attn"]), set(blocks["mlp"])


@pytest.mark.parametrize("shape", ["gqa3x1", "mha4_partial_rope"])
def test_fused_model_matches_the_float64_reference(shape):
  cfg = _config(shape)
  params, f64 = _model(cfg, seed_from(shape))
  fused = llama.fuse_projections(params)
  assert _fused_names(fused) == ({"qkv", "o"}, {"gate_up", "down"})
  assert _fused_names(params) == ({"q", "k", "v", "o"}, {"gate", "up", "down"})  # unchanged
  ids = np.random.default_rng(seed_from(shape + "ids")).integers(0, VOCAB, 11)
  want = _reference_logits(cfg, f64, ids)
  got = llama.forward(fused, jnp.asarray(ids[None], jnp.int32), cfg=cfg)[0]
  _close(got, want)
  apart = llama.forward(params, jnp.asarray(ids[None], jnp.int32), cfg=cfg)[0]
  _close(got, apart, rel=1e-6)
  # prefill 5 tokens, then decode the rest one at a time against the reference
  logits, cache = llama.prefill(fused, jnp.asarray(ids[None, :5], jnp.int32),
                                llama.init_cache(cfg, 1, 16), cfg=cfg)
  steps = [np.asarray(logits[0, 4])]
  for p in range(5, len(ids)):
    lg, cache = llama.decode_step(fused, jnp.asarray(ids[p:p + 1], jnp.int32),
                                  jnp.asarray([p], jnp.int32), cache, cfg=cfg)
    steps.append(np.asarray(lg[0]))
  _close(np.stack(steps), want[4:])


def _unrolled(params) -> dict:
  blocks = params["params"]["blocks"]
  layers = {f"layers_{i}": jax.tree.map(lambda a: a[i], blocks)
            for i in range(jax.tree.leaves(blocks)[0].shape[0])}
  rest = {k: v for k, v in params["params"].items() if k != "blocks"}
  return {"params": {**rest, **layers}}


def test_a_layer_whose_projections_do_not_join_keeps_them_apart():
  cfg = dataclasses.replace(_config("gqa6x3_partial_rope"), scan_layers=False)
  params, f64 = _model(cfg, seed_from("mixed"))
  params = _unrolled(params)
  # layer 1's v with one scale per column (the reference takes its new values)
  v = params["params"]["layers_1"]["attn"]["v"]["kernel"]
  params["params"]["layers_1"]["attn"]["v"]["kernel"] = qjax.quantize(
      v.dequantize(), group_size=None)
  f64["v"][1] = np.asarray(params["params"]["layers_1"]["attn"]["v"]["kernel"].dequantize(),
                           np.float64)
  fused = llama.fuse_projections(params)["params"]
  assert set(fused["layers_0"]["attn"]) == {"qkv", "o"}
  assert set(fused["layers_1"]["attn"]) == {"q", "k", "v", "o"}
  assert set(fused["layers_1"]["mlp"]) == {"gate_up", "down"}
  ids = np.random.default_rng(2).integers(0, VOCAB, 9)
  got = llama.forward({"params": fused}, jnp.asarray(ids[None], jnp.int32), cfg=cfg)[0]
  _close(got, _reference_logits(cfg, f64, ids))


def test_qkv_biases_join_with_the_weights():
  cfg = dataclasses.replace(_config("gqa3x1"), qkv_bias=True)
  params, _ = _model(cfg, seed_from("bias"))
  rng = np.random.default_rng(3)
  attn = params["params"]["blocks"]["attn"]
  for name in ("q", "k", "v"):
    n = attn[name]["kernel"].shape[1]
    attn[name]["bias"] = jnp.asarray(rng.standard_normal((2, n)), jnp.float32)
  fused = llama.fuse_projections(params)
  qkv = fused["params"]["blocks"]["attn"]["qkv"]
  np.testing.assert_array_equal(
      np.asarray(qkv["bias"]),
      np.concatenate([np.asarray(attn[n]["bias"]) for n in ("q", "k", "v")], axis=-1))
  ids = jnp.asarray(rng.integers(0, VOCAB, (1, 7)), jnp.int32)
  _close(llama.forward(fused, ids, cfg=cfg), llama.forward(params, ids, cfg=cfg), rel=1e-6)


def test_tensor_parallel_refuses_joined_projections():
  """Joined q / k / v cannot split by heads: shard_llama_params names the joined weight
  (rather than replicating it and failing later on its width)."""
  from flax_layers import tensor_parallel as tp
  from test_sharding import _mesh
  cfg = _config("gqa6x3_partial_rope")
  params, _ = _model(cfg, seed_from("tp"))
  with pytest.raises(ValueError, match=r"^blocks/attn/qkv, blocks/mlp/gate_up: projections "
                     r"joined by flax_layers\.fuse_projections; they do not split by heads"):
    tp.shard_llama_params(llama.fuse_projections(params), _mesh(3), cfg)
