"""Fused FP4 (E2M1) dequantize + matmul in Pallas, for MXFP4 and NVFP4, lowered to Triton.

Contract (qjax's XLA path is the reference): ``y = x @ W`` with ``W[k, n] = e2m1(q[k, n])
* scale[k // B, n]`` (MXFP4: ``B = 32``, ``scale = 2 ** (e - 127)``; NVFP4: ``B = 16``,
``scale = f32(e4m3) * global_scale``); float32 accumulation, output in x's dtype.

How the kernel reads the weight: as the INT4 kernel does. Codes arrive in the
kernel-native tile order (``tile_k = 128``): one load of ``[16, block_n]`` uint32 words
holds 8 row slabs of 16, slab ``j`` in nibble ``j``; each slab is multiplied against a
``[block_m, 16]`` slice of x loaded from the ref.

E2M1 to float in registers, without a table (the Marlin bit trick): shift the word so
that slab ``j``'s nibble ``s e1 e0 m`` sits in bits 12..15, then
``(v & 0x8000) | ((v & 0x7000) >> 3)`` is the float16 with sign ``s``, exponent field
``e1 e0`` and mantissa ``m``: exactly ``e2m1 * 2**-14`` (the code ``e = 0, m = 1`` becomes
the f16 subnormal ``2**-15``, so the subnormal needs no special case). bf16 and f32
activations take that f16 widened (exact: every such value is a normal bf16). The
``2**14`` and the block scale (and NVFP4's tensor scale) are one multiply per block and
column of the f32 partial product, after the dots:
``acc += (x_b @ (e2m1_b * 2**-14)) * (2**14 * scale_b)``.

Block scales are decoded from their bytes in the kernel: E8M0 ``e`` is the float32 with
bits ``e << 23``; e4m3 bits ``s eeee mmm`` become the float16 ``s 0eeee mmm0000000``
(``= e4m3 * 2**-8``, subnormals included) widened to f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import KernelConfig
from qjax import MXFP4Weight
from qjax import NVFP4Weight
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import int4_matmul

_load = common.load

E2M1_TO_F16_SCALE = 2.0 ** 14    # the f16 built from E2M1 bits is value * 2**-14
E4M3_TO_F16_SCALE = 2.0 ** 8     # the f16 built from e4m3 bits is value * 2**-8

heuristic_config = int4_matmul.heuristic_config
candidate_configs = int4_matmul.candidate_configs


def _e2m1_slab(words: jax.Array, j: int, dtype) -> jax.Array:
  """Slab ``j`` of ``[16, block_n]`` uint32 words -> E2M1 values * 2**-14 in ``dtype``."""
  shift = 4 * j - 12  # moves nibble j to bits 12..15
  if shift > 0:
    v = words >> shift
  elif shift < 0:
    v = words << -shift
  else:
    v = words
  bits = (v & 0x8000) | ((v & 0x7000) >> 3)
  w16 = lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
  if jnp.dtype(dtype) == jnp.float16:
    return w16
  # Through f32: two plain widen / narrow conversions, both exact here.
  return w16.astype(jnp.float32).astype(dtype)


def _e8m0_to_f32(e: jax.Array) -> jax.Array:
  """uint8 E8M0 bytes -> float32 ``2 ** (e - 127)`` (0: 2**-127, 255: NaN)."""
  e = e.astype(jnp.uint32)
  bits = jnp.where(e == 0, 0x00400000, e << 23)
  bits = jnp.where(e == 255, 0x7FC00000, bits)
  return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _e4m3_to_f32_times_2_pow_minus_8(b: jax.Array) -> jax.Array:
  """uint8 float8_e4m3fn bits -> float32 ``e4m3 * 2**-8`` (0x7F / 0xFF: NaN)."""
  b = b.astype(jnp.uint32)
  bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
  v = lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
  return jnp.where((b & 0x7F) == 0x7F, jnp.nan, v)


def scale_decoder(scale_format: str, global_scale=None):
  """``(decode, factor)`` for a scale format: ``decode(bytes) * factor`` is the f32
  multiplier of a block's partial product ``x_b @ (e2m1_b * 2**-14)``.

  ``global_scale`` (NVFP4's tensor scale, a loaded ``[1, 1]`` f32 array) is folded into
  ``factor``; None for MXFP4.
  """
  if scale_format == "e8m0":
    decode, fixed = _e8m0_to_f32, E2M1_TO_F16_SCALE
  elif scale_format == "e4m3":
    decode, fixed = _e4m3_to_f32_times_2_pow_minus_8, E2M1_TO_F16_SCALE * E4M3_TO_F16_SCALE
  else:
    raise ValueError(f"{scale_format=} must be 'e8m0' (MXFP4) or 'e4m3' (NVFP4)")
  return decode, (fixed if global_scale is None else global_scale * fixed)


def accumulate_k_tile(acc, words, load_x, load_scale, *, k_tile, tile_k, block_size,
                      dtype, decode, factor):
  """``acc + x[:, k_tile : k_tile + tile_k] @ W[k_tile : k_tile + tile_k, cols]``.

  The dequantize-in-registers step every FP4 kernel shares: slab ``j`` of the packed
  words is turned into E2M1 values (times 2**-14) and multiplied against the matching
  ``[block_m, slab]`` slice of x; the block scale is applied to the f32 partial product
  of each block, after the dots.

  Args:
    acc: ``[block_m, block_n]`` float32.
    words: ``[tile_k // 8, block_n]`` uint32 codes of one K-tile (tile order ``tile_k``).
    load_x: ``load_x(k0) -> [block_m, tile_k // 8]`` activations of rows ``k0 ..``,
      loaded from the ref (with the caller's masks).
    load_scale: ``load_scale(g) -> [1, block_n]`` uint8 scale bytes of block row ``g``.
    k_tile: first K row of the tile (traced or static).
    dtype: the activations' dtype (the dots run in it).
    decode, factor: from :func:`scale_decoder`.
  """
  slab = tile_k // 8
  slabs_per_block = block_size // slab
  for b in range(tile_k // block_size):
    part = None
    for p in range(slabs_per_block):
      j = b * slabs_per_block + p
      d = plgpu.dot(load_x(k_tile + j * slab), _e2m1_slab(words, j, dtype))  # f32
      part = d if part is None else part + d
    scale = decode(load_scale(k_tile // block_size + b))
    acc += part * (scale * factor)
  return acc


def _fp4_kernel(x_ref, w_ref, s_ref, g_ref, o_ref, *, m, k, scale_format, block_size,
                tile_k, block_m, block_n, block_k, steps_per_split, split_k):
  """One ``[block_m, block_n]`` output tile over ``steps_per_split`` K steps.

  Refs (whole arrays):
    x_ref: ``[M, K]`` bf16 / f16 / f32.
    w_ref: ``[Kp // 8, N]`` uint32 E2M1 codes in tile order ``tile_k``.
    s_ref: ``[K // B, N]`` uint8 scale bytes (E8M0 or e4m3 bits, per ``scale_format``).
    g_ref: ``[1, 1]`` float32 tensor scale (NVFP4), or None.
    o_ref: ``[M, N]`` in x's dtype (split_k == 1) or ``[split_k, M, N]`` float32.
  """
  pid_n, pid_m, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n = w_ref.shape[1]
  num_blocks = s_ref.shape[0]
  m0 = pid_m * block_m
  n0 = pid_n * block_n
  m_mask = (m0 + jnp.arange(block_m)) < m
  n_mask = (n0 + jnp.arange(block_n)) < n
  # Masks along the contiguous axis keep Triton from vectorizing: only where ragged.
  m_ragged, n_ragged, k_ragged = m % block_m != 0, n % block_n != 0, k % tile_k != 0
  slab = tile_k // 8
  decode, factor = scale_decoder(scale_format, None if g_ref is None else g_ref[...])

  def load_x(k0):
    x_mask = m_mask[:, None] if m_ragged else None
    if k_ragged:
      kx = ((k0 + jnp.arange(slab)) < k)[None, :]
      x_mask = kx if x_mask is None else x_mask & kx
    return _load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, slab)], x_mask)

  def load_scale(g):
    s_mask = n_mask[None, :] & (g < num_blocks) if (n_ragged or k_ragged) else None
    return _load(s_ref.at[pl.ds(g, 1), pl.ds(n0, block_n)], s_mask)

  def step(i, acc):
    k_step = (pid_k * steps_per_split + i) * block_k
    for t in range(block_k // tile_k):
      k_tile = k_step + t * tile_k
      words = _load(w_ref.at[pl.ds(k_tile // 8, slab), pl.ds(n0, block_n)],
                    mask=n_mask[None, :] if n_ragged else None)
      acc = accumulate_k_tile(acc, words, load_x, load_scale, k_tile=k_tile, tile_k=tile_k,
                              block_size=block_size, dtype=x_ref.dtype, decode=decode,
                              factor=factor)
    return acc

  acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
  out_mask = m_mask[:, None] & n_mask[None, :] if (m_ragged or n_ragged) else None
  common.store_tile(o_ref, acc, m0=m0, n0=n0, block_m=block_m, block_n=block_n, pid_k=pid_k,
                    split_k=split_k, mask=out_mask)


def fp4_matmul(x: jax.Array, w: MXFP4Weight | NVFP4Weight, *, interpret: bool = False,
               config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype with the fused kernel.

  Codes in another tile order than the kernel-native one are repacked first (lossless;
  store weights in the native order to avoid that per call).

  Args:
    poison: for tests: the output buffer starts as NaN (aliased into the kernel), so an
      element the kernel fails to write shows up as NaN.

  Raises:
    NotImplementedError: batched codes (vmap instead).
  """
  if not isinstance(w, (MXFP4Weight, NVFP4Weight)):
    raise TypeError(f"fp4_matmul takes an MXFP4Weight or NVFP4Weight, got {type(w).__name__}")
  if w.codes.ndim != 2:
    raise NotImplementedError(
        f"codes of shape {w.codes.shape}: the kernel takes one [K, N] weight; vmap over "
        "leading axes")
  if w.tile_k != packing.NATIVE_TILE_K:
    w = w.repack(packing.NATIVE_TILE_K)
  m, k = x.shape
  n = w.shape[1]
  if config is None:
    config = _lookup_config(w.format_name, m, k, n) or heuristic_config(m, k, n)
  config = int4_matmul.legalize(config, k, w.tile_k)
  steps = w.codes.shape[0] * 8 // config.block_k
  split_k = config.split_k
  if isinstance(w, NVFP4Weight):
    scale_format = "e4m3"
    scales = lax.bitcast_convert_type(w.scales, jnp.uint8)
    global_scale = jnp.asarray(w.global_scale, jnp.float32).reshape(1, 1)
  else:
    scale_format, scales, global_scale = "e8m0", w.scales, None
  kernel = functools.partial(
      _fp4_kernel, m=m, k=k, scale_format=scale_format, block_size=w.block_size,
      tile_k=w.tile_k, block_m=config.block_m, block_n=config.block_n,
      block_k=config.block_k, steps_per_split=steps // split_k, split_k=split_k)
  return common.launch(kernel, [x, w.codes, scales, global_scale], m=m, n=n, dtype=x.dtype,
                       config=config, interpret=interpret, poison=poison,
                       name=f"qjax_{w.format_name}_matmul")


def _lookup_config(fmt: str, m: int, k: int, n: int) -> KernelConfig | None:
  from qjax._src import tuning  # pylint: disable=g-import-not-at-top
  return tuning.lookup(jax.devices()[0].device_kind, fmt, m, k, n)
