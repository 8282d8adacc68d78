"""Keys and values of new tokens written into a KV cache in place: one launch for both.

Contract: :func:`qjax.write_kv_cache` on its normalized arguments
(``qjax._src.kv_cache.write_kv_cache_xla``): ``k_cache[layer, b, positions[b, i]] = k[b,
i]`` and the same for ``v``, where the position lies in ``[0, slots)`` and the layer in
``[-layers, layers)`` (negative: from the end); nothing is written elsewhere.

One program per token (grid ``(batch, seq)``) copies the token's ``kv_heads * head_dim``
keys and values (one row each: the caches are seen as ``[layers, batch, slots, kv_heads *
head_dim]``, a free reshape) into its slot; a token out of range stores under an all-false
mask. The caches are aliased to the outputs, so the rest of each buffer is left as it was
and XLA updates it in place where the old cache is dead (a scan's carry). On the GPU this
replaces XLA's four kernels of the scatter (the old slot read, a select, and two
dynamic-update-slices).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common


def _kernel(k_ref, v_ref, pos_ref, layer_ref, kc_in, vc_in, kc_out, vc_out, *, width: int):
  """One token's row. Refs: k, v ``[b, t, width]``; positions ``[b, t]`` int32; layer
  ``[1]`` int32; caches (in and out: one buffer) ``[layers, b, slots, width]``."""
  del kc_in, vc_in  # the outputs' buffers
  bi, ti = pl.program_id(0), pl.program_id(1)
  layers, _, slots, _ = kc_out.shape
  layer = layer_ref[0]
  layer = jnp.where(layer < 0, layer + layers, layer)
  p = pos_ref[bi, ti]
  ok = (p >= 0) & (p < slots) & (layer >= 0) & (layer < layers)
  at, slot = jnp.clip(layer, 0, layers - 1), jnp.clip(p, 0, slots - 1)
  wp = common.next_pow2(width)
  cols = jnp.arange(wp) < width
  for src, dst in ((k_ref, kc_out), (v_ref, vc_out)):
    row = common.load(src.at[bi, ti, pl.ds(0, wp)], cols)
    plgpu.store(dst.at[at, bi, slot, pl.ds(0, wp)], row, mask=cols & ok)


def write_kv_cache(k_cache, v_cache, k, v, positions, layer, *, interpret: bool = False):
  """:func:`qjax.write_kv_cache` on its normalized arguments: caches ``[layers, b, slots,
  kv_heads, d]``, k / v ``[b, t, kv_heads, d]`` in the caches' dtype, positions ``[b, t]``
  int32, layer ``[1]`` int32 -> ``(k_cache, v_cache)``.

  Raises:
    NotImplementedError: a row of more than 16384 values (``kv_heads * head_dim``: one
      program's registers).
  """
  layers, b, slots, kv_heads, d = k_cache.shape
  t = k.shape[1]
  width = kv_heads * d
  if width > 16384:
    raise NotImplementedError(f"kv_heads * head_dim = {width}: the cache-write kernel takes "
                              "rows of up to 16384 values")
  flat = (layers, b, slots, width)
  out_shape = [jax.ShapeDtypeStruct(flat, k_cache.dtype)] * 2
  call = pl.pallas_call(
      functools.partial(_kernel, width=width), out_shape=out_shape, grid=(b, t),
      input_output_aliases={4: 0, 5: 1}, interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=1 if width <= 1024 else 4,
                                           num_stages=1),
      name="qjax_kv_cache_write")
  kc, vc = call(k.reshape(b, t, width), v.reshape(b, t, width), positions, layer,
                k_cache.reshape(flat), v_cache.reshape(flat))
  return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
