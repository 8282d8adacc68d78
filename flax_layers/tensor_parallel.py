"""The Llama model tensor-parallel over one mesh axis (Megatron-style), under shard_map.

Per layer, the attention heads and the MLP's hidden units are split over the ``n``
devices of the axis:

* ``q``, ``k``, ``v``, ``gate``, ``up``: column-parallel (device ``d`` holds heads
  ``[d H / n, (d + 1) H / n)``, KV heads likewise, and its run of ``ffn_size / n`` hidden
  units), so attention and the SwiGLU product need no communication;
* ``o``, ``down``: row-parallel (the matching rows), their partial outputs summed over
  the axis in float32 (one ``psum`` after each, two per layer);
* the biases of ``q``, ``k``, ``v`` (Qwen2) split with their columns, i.e. with the heads,
  and so do GPT-OSS's attention sinks (one logit per head);
* embedding, norms (Qwen3's per-head q / k norms too) and output head: replicated. The KV
  cache is split along its KV heads.

Each device runs the unchanged :class:`flax_layers.Llama` with a local config (``H / n``
heads, ``KV / n`` KV heads, ``ffn_size / n``) on its slices; every projection goes
through :func:`qjax.matmul` with a :class:`qjax.ShardedWeight`, i.e. the device's Pallas
kernel on a GPU.

>>> from jax.sharding import PartitionSpec as P
>>> from flax_layers import tensor_parallel as tp
>>> tp.cache_spec("tp") == P(None, None, None, "tp", None)
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qjax
from qjax._src import sharding as sharding_lib
from qjax._src import split_rules

from flax_layers import llama

COLUMN = ("q", "k", "v", "gate", "up")
ROW = ("o", "down")


def _valid_counts(*sizes: int) -> list[int]:
  g = math.gcd(*sizes)
  return [d for d in range(1, g + 1) if g % d == 0]


def local_config(cfg: llama.LlamaConfig, n: int) -> llama.LlamaConfig:
  """The config one of ``n`` devices runs: ``num_heads / n`` heads, ``num_kv_heads / n``
  KV heads, ``ffn_size / n`` hidden units. A mixture-of-experts model (``cfg.num_experts``
  > 0) is refused: its experts are not split or replicated here."""
  if cfg.moe:
    raise ValueError(f"tensor parallel over {n} devices does not run mixture-of-experts "
                     f"models ({cfg.num_experts} experts, {cfg.experts_per_token} per token) "
                     "yet; run it on one device (--devices 1)")
  sizes = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
           "ffn_size": cfg.ffn_size}
  bad = {k: v for k, v in sizes.items() if v % n}
  if bad:
    raise ValueError(
        f"tensor parallel over {n} devices needs num_heads, num_kv_heads and ffn_size "
        f"divisible by {n}; {', '.join(f'{k}={v}' for k, v in bad.items())} is not; "
        f"valid device counts: {_valid_counts(*sizes.values())}")
  return dataclasses.replace(cfg, num_heads=cfg.num_heads // n,
                             num_kv_heads=cfg.num_kv_heads // n, ffn_size=cfg.ffn_size // n)


def _mode(path: tuple[str, ...]) -> str | None:
  if len(path) >= 2 and path[-1] == "kernel":
    if path[-2] in COLUMN:
      return "column"
    if path[-2] in ROW:
      return "row"
  return None


def _is_bias(path: tuple[str, ...]) -> bool:
  """A leaf split along its last axis with the heads or hidden units: a column-parallel
  projection's bias ``[N]``, or the attention sinks ``attn/sinks [num_heads]`` (GPT-OSS:
  one logit per head); ``[layers, ...]`` when stacked."""
  return len(path) >= 2 and ((path[-1] == "bias" and path[-2] in COLUMN)
                             or path[-2:] == ("attn", "sinks"))


def _bias_spec(ndim: int, axis: Any) -> P:
  return P(*([None] * (ndim - 1)), axis)


def _map_with_path(fn, tree: Mapping, path: tuple[str, ...] = ()) -> dict:
  """``fn(path, value)`` on every entry of nested mappings (quantized weights are values)."""
  return {k: _map_with_path(fn, v, (*path, k)) if isinstance(v, Mapping) else fn((*path, k), v)
          for k, v in tree.items()}


def splittable_layouts(params: dict, n: int) -> dict:
  """``params`` with each :class:`qjax.Int4Weight` projection that cannot split over
  ``n`` devices in its tile order, but can in plain order, repacked there losslessly
  (``repack(8)``: 8-row tiles; ``dequantize()`` bit-identical).

  The kernels' 128-row tiles need whole tiles on each device of a row split: SmolLM2's
  o projection (K = 576) over 3 devices gives 192 rows each, which no 128-row tiling
  splits. In plain order it splits, and each device's INT4 kernel repacks its 192 rows
  (padded) on every call. Every other weight is returned as it is
  (:func:`shard_llama_params` then names what does not split).
  """
  def splits(w, mode):
    try:
      split_rules.check_split(w, mode, n)
    except ValueError:
      return False
    return True

  def relayout(path, v):
    mode = _mode(path)
    if mode is None or not isinstance(v, qjax.Int4Weight) or v.tile_k == 8 or splits(v, mode):
      return v
    plain = v.repack(8)
    return plain if splits(plain, mode) else v
  return _map_with_path(relayout, params)


def shard_llama_params(params: dict, mesh: jax.sharding.Mesh, cfg: llama.LlamaConfig,
                       axis: Any = "tp") -> dict:
  """The Llama params placed for tensor parallelism over ``mesh[axis]``.

  Args:
    params: ``{"params": ...}`` of :class:`flax_layers.Llama` (stacked ``blocks`` or
      per-layer ``layers_{i}``), e.g. from :func:`flax_layers.params_from_gguf`.
    mesh, axis: the devices and the mesh axis to split over.
    cfg: the model's config (its head counts and ffn size must divide by the axis size).

  Returns:
    The same tree with the projections of every block as :class:`qjax.ShardedWeight`
    (q, k, v, gate, up column-parallel; o, down row-parallel), the q / k / v biases and
    the attention sinks split along their last axis (with the heads) and every other leaf
    replicated on the mesh.
    Run it with :func:`tp_forward`, :func:`tp_prefill`, :func:`tp_decode_step`.

  Raises:
    ValueError: a head count or the ffn size does not divide, or a projection cannot
      split (e.g. a row shard that would cut a packed tile), naming the valid counts.
  """
  llama.check_not_fused(params, "they do not split by heads: shard the params as loaded "
                        "(before fuse_projections)")
  n = sharding_lib.mesh_axis_size(mesh, axis)
  local_config(cfg, n)
  everywhere = NamedSharding(mesh, P())

  def place(path, v):
    mode = _mode(path)
    if _is_bias(path):
      return sharding_lib.place(v, NamedSharding(mesh, _bias_spec(v.ndim, axis)))
    if mode is None:
      return jax.tree.map(lambda a: sharding_lib.place(a, everywhere), v)
    try:
      return qjax.ShardedWeight.of(v, mesh, axis, mode)
    except ValueError as e:
      raise ValueError(f"{'/'.join(path)}: {e}") from None

  return _map_with_path(place, params)


def _map_paths(tree: Mapping, path: tuple[str, ...] = ()):
  """``(path, leaf)`` of every entry that is not a mapping."""
  for k, v in tree.items():
    if isinstance(v, Mapping):
      yield from _map_paths(v, (*path, k))
    else:
      yield (*path, k), v


def _projections(tree: Mapping):
  """``(path, weight)`` of every projection kernel (q, k, v, o, gate, up, down)."""
  for path, v in _map_paths(tree):
    if _mode(path) is not None:
      yield path, v


def param_specs(params: dict, axis: Any = "tp") -> dict:
  """PartitionSpecs of :func:`shard_llama_params`'s tree (shard_map in_specs)."""
  def spec(path, v):
    if isinstance(v, qjax.ShardedWeight):
      return v.partition_specs()
    if _is_bias(path):
      return _bias_spec(v.ndim, axis)
    return jax.tree.map(lambda a: P(), v)
  return _map_with_path(spec, params)


def cache_spec(axis: Any) -> P:
  """The KV cache ``[layers, batch, max_len, kv_heads, head_dim]``, split along KV heads."""
  return P(None, None, None, axis, None)


def init_tp_cache(cfg: llama.LlamaConfig, batch: int, max_len: int,
                  mesh: jax.sharding.Mesh, axis: Any = "tp") -> dict[str, jax.Array]:
  """A zero KV cache split along its KV heads over ``mesh[axis]``.

  Args:
    cfg: the model's config (its KV heads must divide by the axis' size).
    batch, max_len: as :func:`flax_layers.init_cache` takes them.
    mesh: the device mesh; axis: its axis to split over.

  Returns:
    ``{"k", "v"}``: each ``[layers, batch, max_len, kv_heads, head_dim]`` in cfg.dtype,
    placed with ``kv_heads`` split over ``mesh[axis]``.

  Raises:
    ValueError: a head count or the ffn size that does not divide by the axis' size, or
      a ``batch`` / ``max_len`` that is not a positive int.
  """
  local_config(cfg, sharding_lib.mesh_axis_size(mesh, axis))
  cache = llama.init_cache(cfg, batch, max_len)
  s = NamedSharding(mesh, cache_spec(axis))
  return {k: jax.device_put(v, s) for k, v in cache.items()}


def _apply(params, tokens, positions, cache, cfg, mesh, axis, fresh_prompt=False,
           contiguous=False):
  local = local_config(cfg, sharding_lib.mesh_axis_size(mesh, axis))
  for path, w in _projections(params):
    try:
      if not isinstance(w, qjax.ShardedWeight):
        raise ValueError(f"a {type(w).__name__}, not a qjax.ShardedWeight")
      sharding_lib.check_mesh(w, mesh, axis)
    except ValueError as e:
      raise ValueError(f"{'/'.join(path)}: {e}; place the params with "
                       "shard_llama_params(params, mesh, cfg, axis)") from None
  cspec = {"k": cache_spec(axis), "v": cache_spec(axis)}

  def body(params, tokens, positions, cache):
    return llama.Llama(local, fresh_prompt=fresh_prompt, contiguous=contiguous).apply(
        params, tokens, positions, cache)

  fn = sharding_lib.shard_map(body, mesh,
                              in_specs=(param_specs(params, axis), P(), P(), cspec),
                              out_specs=(P(), cspec))
  return fn(params, tokens, positions, cache)


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "axis"),
                   donate_argnames=("cache",))
def tp_prefill(params, tokens, cache, *, cfg: llama.LlamaConfig, mesh: jax.sharding.Mesh,
               axis: Any = "tp"):
  """:func:`flax_layers.prefill`, tensor-parallel.

  Args:
    params: from :func:`shard_llama_params`.
    tokens: ``[batch, seq]`` int32 (replicated).
    cache: from :func:`init_tp_cache` (donated).

  Returns:
    (logits ``[batch, seq, vocab]`` float32, replicated; the cache).
  """
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # From position 0, as llama.prefill: the prompt's queries attend to its own keys.
  return _apply(params, tokens.astype(jnp.int32), positions, cache, cfg, mesh, axis,
                fresh_prompt=True)


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "axis"),
                   donate_argnames=("cache",))
def tp_extend(params, tokens, start, cache, *, cfg: llama.LlamaConfig,
              mesh: jax.sharding.Mesh, axis: Any = "tp"):
  """:func:`flax_layers.extend`, tensor-parallel.

  Args:
    params: from :func:`shard_llama_params`.
    tokens: ``[batch, seq]`` int32 (replicated), at positions ``start[b] ..``.
    start: ``[batch]`` or scalar int32, each sequence's first new position.
    cache: from :func:`init_tp_cache` (donated), holding the earlier positions.
    cfg, mesh, axis: as the cache and params were made with (static).

  Returns:
    (logits ``[batch, seq, vocab]`` float32, replicated; the cache).
  """
  b, t = tokens.shape
  start = jnp.broadcast_to(jnp.asarray(start, jnp.int32).reshape(-1), (b,))
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  return _apply(params, tokens.astype(jnp.int32), positions, cache, cfg, mesh, axis,
                contiguous=True)


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "axis"),
                   donate_argnames=("cache",))
def tp_decode_step(params, token, pos, cache, *, cfg: llama.LlamaConfig,
                   mesh: jax.sharding.Mesh, axis: Any = "tp"):
  """:func:`flax_layers.decode_step`, tensor-parallel.

  Args:
    params: from :func:`shard_llama_params`.
    token: ``[batch]`` int32, each sequence's next token.
    pos: ``[batch]`` or scalar int32, its position.
    cache: from :func:`init_tp_cache` (donated).
    cfg, mesh, axis: as the cache and params were made with (static).

  Returns:
    (logits ``[batch, vocab]`` float32, replicated; the cache).
  """
  b = token.shape[0]
  positions = jnp.broadcast_to(jnp.asarray(pos, jnp.int32).reshape(-1), (b,))[:, None]
  logits, cache = _apply(params, token.astype(jnp.int32)[:, None], positions, cache, cfg,
                         mesh, axis)
  return logits[:, 0], cache


def tp_forward(params, tokens, *, cfg: llama.LlamaConfig, mesh: jax.sharding.Mesh,
               axis: Any = "tp") -> jax.Array:
  """:func:`flax_layers.forward`, tensor-parallel: the logits of whole sequences with no
  prior cache.

  Args:
    params: from :func:`shard_llama_params`.
    tokens: ``[batch, seq]`` integer ids.
    cfg, mesh, axis: as the params were placed with.

  Returns:
    ``[batch, seq, vocab]`` float32 logits, replicated.

  Raises:
    ValueError: params not placed by :func:`shard_llama_params` on this mesh and axis
      (naming the projection), or the checks of :func:`init_tp_cache`.
  """
  cache = init_tp_cache(cfg, tokens.shape[0], tokens.shape[1], mesh, axis)
  return tp_prefill(params, tokens, cache, cfg=cfg, mesh=mesh, axis=axis)[0]
