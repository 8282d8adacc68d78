"""Keys and values of new tokens written into a KV cache in place: one launch for both.

Contract: :func:`qjax.write_kv_cache` on its normalized arguments
(``qjax._src.kv_cache.write_kv_cache_xla``): ``k_cache[layer, b, positions[b, i]] = k[b,
i]`` and the same for ``v``, where the position lies in ``[0, slots)`` and the layer in
``[-layers, layers)`` (negative: from the end); nothing is written elsewhere.

One program per token (grid ``(batch, seq)``) copies the token's ``kv_heads * head_dim``
keys and values into its slot: one row each of a ``[batch, seq, 2 * row]`` operand (``row``
that width padded to a power of two), into caches seen as ``[layers, batch, slots,
kv_heads * head_dim]`` (a free reshape); a token out of range stores under an all-false
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


def _kernel(kv_ref, pos_ref, layer_ref, kc_in, vc_in, kc_out, vc_out, *, width: int):
  """One token's row. Refs: kv ``[b, t, 2 * wp]`` (keys at ``[0, width)``, values at
  ``[wp, wp + width)``, ``wp`` the power of two >= width); positions ``[b, t]`` int32;
  layer ``[1]`` int32; caches (in and out: one buffer) ``[layers, b, slots, width]``."""
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
  for start, dst in ((0, kc_out), (wp, vc_out)):
    row = common.load(kv_ref.at[bi, ti, pl.ds(start, wp)], cols)
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
      input_output_aliases={3: 0, 4: 1}, interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=1 if width <= 1024 else 4,
                                           num_stages=1),
      name="qjax_kv_cache_write")
  # Keys and values as one operand: XLA computes both in one fusion (RoPE of the keys,
  # the values' slice of the q / k / v product) where two operands took two.
  # Each padded to a power of two, so both rows load in bounds.
  pad = ((0, 0), (0, 0), (0, common.next_pow2(width) - width))
  kv = jnp.concatenate([jnp.pad(k.reshape(b, t, width), pad),
                        jnp.pad(v.reshape(b, t, width), pad)], axis=-1)
  kc, vc = call(kv, positions, layer, k_cache.reshape(flat), v_cache.reshape(flat))
  return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
