"""``qjax.write_kv_cache``: new tokens' keys and values written into a KV cache, and the
registry of its kernels.

A decoder layer writes each new token's key and value into its slot of the cache before it
attends. As an XLA scatter with out-of-range positions dropped (``.at[...].set(mode=
"drop")``) that is four kernels a layer at decode: the old slot read, a select, and one
dynamic-update-slice each for keys and values (H200, SmolLM2-135M: 5.3 us of a layer's
42; ``docs/experiments/s39_decode_profile.py --sequence``). A kernel writes both in one
launch, in place (``pallas_kernels.kv_cache_write``), registered with
:func:`register_kv_cache_write_kernel` as the attention kernels are; implementation names
are those of :func:`qjax.matmul`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qjax._src import attention


def register_kv_cache_write_kernel(backend: attention.AttentionBackend) -> None:
  """Registers a kernel for :func:`write_kv_cache` (``backend.fn(k_cache, v_cache, k, v,
  positions, layer, *, interpret) -> (k_cache, v_cache)`` on the normalized arguments of
  :func:`write_kv_cache_xla`); the first registered is the default of "pallas" /
  "interpret", a later registration of a name replaces that backend, and the jitted model
  steps trace again."""
  attention.register("write", backend)


def kv_cache_write_kernels() -> list[attention.AttentionBackend]:
  """The registered :func:`write_kv_cache` kernels (plugins loaded first)."""
  return attention.kernels("write")


def check_write_arguments(k_cache, v_cache, k, v, positions, layer):
  """The arguments of :func:`write_kv_cache` checked; returns ``(k_cache, v_cache, layer,
  stacked)`` with the caches 5-D, ``layer`` a ``[1]`` int32 array and ``stacked`` whether
  the caches came 5-D."""
  if tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.dtype != v_cache.dtype:
    raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                     f"{tuple(v_cache.shape)} {v_cache.dtype} must have one shape and dtype")
  if not jnp.issubdtype(k_cache.dtype, jnp.floating):  # static: no device sync
    raise ValueError(f"k_cache / v_cache of dtype {jnp.dtype(k_cache.dtype).name}: the cache "
                     "must be floating point (bfloat16, float16 or float32; keys and values "
                     "are cast to it, an integer cache would truncate them): allocate it "
                     "with a float dtype")
  stacked = layer is not None
  k_cache, v_cache, layer = attention.stacked_caches(k_cache, v_cache, layer)
  _, b, _, kv_heads, d = k_cache.shape
  if tuple(k.shape) != tuple(v.shape) or k.ndim != 4 or (k.shape[0], *k.shape[2:]) != (
      b, kv_heads, d):
    raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit a cache of "
                     f"batch {b}, {kv_heads} KV heads of {d}: want both [batch={b}, seq, "
                     f"kv_heads={kv_heads}, head_dim={d}]")
  t = k.shape[1]
  if tuple(jnp.shape(positions)) != (b, t) or not jnp.issubdtype(
      jnp.result_type(positions), jnp.integer):
    raise ValueError(f"positions of shape {tuple(jnp.shape(positions))} and dtype "
                     f"{jnp.result_type(positions)}: want [batch, seq] = ({b}, {t}) integers")
  return k_cache, v_cache, attention.layer_array(layer, k_cache.shape[0]), stacked


def write_kv_cache(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
                   positions: jax.Array, *, layer: Any = None,
                   implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """New tokens' keys and values written into their slots of a KV cache.

  ``k_cache[layer, b, positions[b, i]] = k[b, i]`` and the same for ``v``, for every
  sequence ``b`` and token ``i`` whose position lies in ``[0, slots)``; a position outside
  it (negative ones included) writes nothing, and neither does a traced ``layer`` outside
  ``[-layers, layers)``. Two tokens of a sequence at one position: one of them is written.
  Exact (the values are cast to the cache's dtype) on every implementation.

  Args:
    k_cache, v_cache: ``[batch, slots, kv_heads, head_dim]``, or ``[layers, batch, slots,
      kv_heads, head_dim]`` with ``layer``: the whole model's cache, of which layer
      ``layer`` is written; floating point, one dtype for both.
    k, v: ``[batch, seq, kv_heads, head_dim]``, the new tokens' keys and values.
    positions: ``[batch, seq]`` integers, each token's slot.
    layer: the layer of a stacked cache (an int, checked, or a scalar integer array, e.g.
      a scan's counter; negative counts from the end); None for a 4-D cache.
    implementation: None (a registered kernel where it supports the device and the cache
      is 16-bit, else XLA), "xla", "pallas" or "interpret" (as :func:`qjax.matmul`).

  Returns:
    ``(k_cache, v_cache)`` updated, of the shapes given. Under ``jax.jit`` the kernel and
    XLA write the caches' buffers in place where the old caches are not used afterwards
    (a loop's carry; donated arguments), else XLA copies them first.

  Raises:
    ValueError: naming the argument, for caches of different shapes or dtypes, a cache
      that is not floating point (e.g. int8: keys would be truncated; any float dtype
      is taken, and ``k`` / ``v`` of another float dtype are cast to it), ``k`` / ``v``
      that do not fit the cache, ``positions`` not ``[batch, seq]`` integers, or an int
      ``layer`` outside the cache. These checks read shapes and dtypes only.

  >>> import jax.numpy as jnp, qjax
  >>> kc = vc = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
  >>> new = jnp.ones((1, 2, 2, 4), jnp.bfloat16)
  >>> kc, vc = qjax.write_kv_cache(kc, vc, new, new, jnp.array([[3, 9]]),
  ...                              implementation="xla")  # position 9: not written
  >>> kc[0, :, 0, 0].tolist()
  [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
  """
  k_cache, v_cache, layer, stacked = check_write_arguments(k_cache, v_cache, k, v, positions,
                                                           layer)
  k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
  positions = jnp.asarray(positions, jnp.int32)
  _, fn = resolve(k_cache.dtype, implementation)
  k_cache, v_cache = fn(k_cache, v_cache, k, v, positions, layer)
  if not stacked:
    return k_cache[0], v_cache[0]
  return k_cache, v_cache


def resolve(dtype, implementation: str | None):
  """The implementation :func:`write_kv_cache` runs for a cache of ``dtype``: its name and
  a function of the normalized arguments."""
  return attention.resolve_in("write", dtype, implementation, write_kv_cache_xla)


def kv_cache_write_implementation_name(dtype=jnp.bfloat16,
                                       implementation: str | None = None) -> str:
  """The name of the implementation :func:`write_kv_cache` would run here for a cache of
  ``dtype`` ("xla", "pallas_triton", "pallas_triton-interpret", ...).

  >>> import jax.numpy as jnp, qjax
  >>> qjax.kv_cache_write_implementation_name(jnp.float32)  # float32: XLA by default
  'xla'
  """
  return resolve(dtype, implementation)[0]


def write_kv_cache_xla(k_cache, v_cache, k, v, positions, layer):
  """The XLA path of :func:`write_kv_cache` on its normalized arguments: caches ``[layers,
  b, slots, kv_heads, d]``, k / v ``[b, t, kv_heads, d]`` in the caches' dtype, positions
  ``[b, t]`` int32, layer a ``[1]`` int32 array (negative: from the end; traced allowed)
  -> ``(k_cache, v_cache)``. A scatter whose out-of-range slots are dropped; the positions
  and the layer are range-checked here, since ``.at[]`` would wrap negative ones."""
  layers, b, slots = k_cache.shape[:3]
  at = jnp.where(layer[0] < 0, layer[0] + layers, layer[0])
  ok = (positions >= 0) & (positions < slots) & (at >= 0) & (at < layers)
  slot = jnp.where(ok, positions, slots)  # slots: past the end, dropped
  at = jnp.clip(at, 0, layers - 1)
  rows = jnp.arange(b)[:, None]
  return (k_cache.at[at, rows, slot].set(k, mode="drop"),
          v_cache.at[at, rows, slot].set(v, mode="drop"))
