"""``qjax.write_and_decode_attention``: a decode step's new keys and values written into the
KV cache and its queries attended over it, as one operation, and the registry of its
kernels.

At decode each layer writes one token's key and value into its slot and then attends over
the cache with one query. As :func:`qjax.write_kv_cache` and :func:`qjax.decode_attention`
that is two kernels, and XLA computes the queries' RoPE in a fusion apart from the keys'
(each feeds a different kernel): four launches a layer besides the combine of the splits.
One kernel that writes the row and attends (``pallas_kernels.decode_attention``) takes
the queries, keys and values as one operand, so XLA computes them in one fusion: two
launches (SmolLM2 on an H200: 464 -> 404 a decode step, BENCHMARKS.md session 42).
Every implementation equals :func:`qjax.write_kv_cache` followed by
:func:`qjax.decode_attention`, up to the attention's rounding; the XLA path is exactly
that.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import attention, kv_cache


def register_write_and_decode_attention_kernel(backend: attention.AttentionBackend) -> None:
  """Registers a kernel for :func:`write_and_decode_attention` (``backend.fn(q, k, v,
  k_cache, v_cache, positions, mask, layer, sinks, *, scale, interpret) -> (out, k_cache,
  v_cache)`` on the normalized arguments of :func:`write_and_decode_attention_xla`); the
  first registered is the default of "pallas" / "interpret", a later registration of a
  name replaces that backend, and the jitted model steps trace again."""
  attention.register("write_decode", backend)


def write_and_decode_attention_kernels() -> list[attention.AttentionBackend]:
  """The registered :func:`write_and_decode_attention` kernels (plugins loaded first)."""
  return attention.kernels("write_decode")


def write_and_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                               v_cache: jax.Array, positions: jax.Array, mask: jax.Array, *,
                               layer: Any = None, sinks: jax.Array | None = None,
                               scale: float | None = None, implementation: str | None = None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decode step's attention: the new keys and values written into the cache, then
  one query per sequence attended over it.

  The same as ``k_cache, v_cache = qjax.write_kv_cache(k_cache, v_cache, k[:, None],
  v[:, None], positions[:, None], layer=layer)`` followed by ``qjax.decode_attention(q,
  k_cache, v_cache, mask, layer=layer, sinks=sinks, scale=scale)``: a position outside
  ``[0, slots)`` writes nothing, the mask says which slots (the new one among them, where
  it holds) each query attends to.

  Args:
    q: ``[batch, heads, head_dim]`` in bfloat16, float16 or float32.
    k, v: ``[batch, kv_heads, head_dim]``, the new token's key and value per sequence
      (cast to the cache's dtype).
    k_cache, v_cache: ``[batch, slots, kv_heads, head_dim]``, or ``[layers, batch, slots,
      kv_heads, head_dim]`` with ``layer`` (written and read in place).
    positions: ``[batch]`` integers, each new token's slot.
    mask: ``[batch, slots]`` bool, the slots each query attends to (another dtype is
      refused, as in :func:`qjax.decode_attention`; the caches must be floating point, as
      in :func:`qjax.write_kv_cache`).
    layer, sinks, scale: as :func:`qjax.decode_attention` (a traced ``layer`` outside
      ``[-layers, layers)`` writes nothing and reads the nearest end's layer).
    implementation: None (a registered kernel where it supports the device and q is
      16-bit, else XLA), "xla", "pallas" or "interpret" (as :func:`qjax.matmul`). Where
      no joined kernel runs, the write and the attention run apart, each through its own
      registry (:func:`resolve`).

  Returns:
    ``(out [batch, heads, head_dim] in q's dtype, k_cache, v_cache)``, the caches of the
    shapes given (updated in place under ``jax.jit`` where the old ones are dead).

  >>> import jax.numpy as jnp, qjax
  >>> q = jnp.ones((1, 4, 8), jnp.bfloat16)
  >>> kc = vc = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
  >>> new = jnp.full((1, 2, 8), 2.0, jnp.bfloat16)
  >>> out, kc, vc = qjax.write_and_decode_attention(
  ...     q, new, new, kc, vc, jnp.array([3]), jnp.arange(16)[None] == 3,
  ...     implementation="xla")  # attends to slot 3 alone: the new value
  >>> out[0, 0, :2].tolist(), kc[0, 3, 0, 0].item()
  ([2.0, 2.0], 2.0)
  """
  if q.ndim != 3:
    raise ValueError(f"q.shape={tuple(q.shape)}: want [batch, heads, head_dim] (one query "
                     "per sequence)")
  if tuple(k.shape) != tuple(v.shape) or k.ndim != 3:
    raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)}: want both [batch, "
                     "kv_heads, head_dim] (one new token per sequence)")
  if jnp.ndim(positions) != 1:
    raise ValueError(f"positions of shape {tuple(jnp.shape(positions))}: want [batch] "
                     "(one new token per sequence)")
  stacked = layer is not None
  # The attention's checks (q, caches, mask, sinks), then the write's (k / v, positions).
  attention.check_decode_arguments(q, k_cache, v_cache, mask, layer, sinks)
  k_cache, v_cache, layer, _ = kv_cache.check_write_arguments(
      k_cache, v_cache, k[:, None], v[:, None], jnp.reshape(positions, (-1, 1)), layer)
  k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
  positions = jnp.asarray(positions, jnp.int32)
  mask = jnp.asarray(mask, bool)
  if sinks is not None:
    sinks = jnp.asarray(sinks, jnp.float32)
  scale = float(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
  _, fn = resolve(q.dtype, implementation, cache_dtype=k_cache.dtype)
  out, k_cache, v_cache = fn(q, k, v, k_cache, v_cache, positions, mask, layer, sinks,
                             scale=scale)
  if not stacked:
    return out, k_cache[0], v_cache[0]
  return out, k_cache, v_cache


def resolve(dtype, implementation: str | None, *, cache_dtype=None):
  """The implementation :func:`write_and_decode_attention` runs for queries of ``dtype``
  (and a cache of ``cache_dtype``, None: the same): its name and a function of the
  normalized arguments.

  Where no joined kernel runs (none registered, or none for this device) but a kernel of
  :func:`qjax.write_kv_cache` or :func:`qjax.decode_attention` does, the two operations
  run apart, each through its own registry (a plugin that registers only a decode
  kernel still runs at a model's decode step); the name is then ``"W write, D
  attention"``. With ``implementation`` "pallas" / "interpret" and no joined kernel
  registered, each part runs its registered kernel, or XLA where it has none.
  """
  def joined(impl):
    return attention.resolve_in("write_decode", dtype, impl, write_and_decode_attention_xla)

  if implementation == "xla":
    return "xla", write_and_decode_attention_xla
  if implementation is None:
    name, fn = joined(None)
    if name != "xla":
      return name, fn
  elif write_and_decode_attention_kernels() or not (attention.kernels("write")
                                                    or attention.kernels("decode")):
    return joined(implementation)  # the joined kernel, or that registry's error
  return _apart(dtype, implementation, dtype if cache_dtype is None else cache_dtype)


def _apart(dtype, implementation: str | None, cache_dtype):
  """:func:`qjax.write_kv_cache`'s implementation followed by
  :func:`qjax.decode_attention`'s, each resolved in its own registry (for ``implementation``
  "pallas" / "interpret", XLA for an operation with no kernel registered); the joined XLA
  path where both are XLA."""
  def part(op):
    if implementation in ("pallas", "interpret") and not attention.kernels(op):
      return "xla"
    return implementation
  write_name, write = kv_cache.resolve(cache_dtype, part("write"))
  decode_name, decode = attention.resolve(dtype, part("decode"))
  if write_name == decode_name == "xla":
    return "xla", write_and_decode_attention_xla

  def fn(q, k, v, k_cache, v_cache, positions, mask, layer, sinks, *, scale):
    k_cache, v_cache = write(k_cache, v_cache, k[:, None], v[:, None], positions[:, None],
                             layer)
    return decode(q, k_cache, v_cache, mask, layer, sinks, scale=scale), k_cache, v_cache

  return f"{write_name} write, {decode_name} attention", fn


def write_and_decode_attention_implementation_name(dtype=jnp.bfloat16,
                                                   implementation: str | None = None) -> str:
  """The name of the implementation :func:`write_and_decode_attention` would run here for
  queries of ``dtype`` ("xla", "pallas_triton", "pallas_triton-interpret", ...).

  >>> import jax.numpy as jnp, qjax
  >>> qjax.write_and_decode_attention_implementation_name(jnp.float32)  # XLA by default
  'xla'
  """
  return resolve(dtype, implementation)[0]


def write_and_decode_attention_xla(q, k, v, k_cache, v_cache, positions, mask, layer, sinks,
                                   *, scale: float):
  """The XLA path of :func:`write_and_decode_attention` on its normalized arguments: q
  ``[b, heads, d]``, k / v ``[b, kv_heads, d]`` in the caches' dtype, caches ``[layers, b,
  slots, kv_heads, d]``, positions ``[b]`` int32, mask ``[b, slots]`` bool, layer ``[1]``
  int32 (negative: from the end; traced allowed), sinks None or ``[heads]`` float32 ->
  ``(out, k_cache, v_cache)``: :func:`qjax.write_kv_cache`'s XLA path, then
  :func:`qjax.decode_attention`'s."""
  k_cache, v_cache = kv_cache.write_kv_cache_xla(k_cache, v_cache, k[:, None], v[:, None],
                                                 positions[:, None], layer)
  out = attention.decode_attention_xla(q, k_cache, v_cache, mask, layer, sinks, scale=scale)
  return out, k_cache, v_cache
