"""FP4 block-scale decoding in registers, shared by the FP4 kernels (tiled, GEMV, MoE).

Every FP4 kernel here builds E2M1 weights as float16 bit patterns worth
``e2m1 * 2**-14`` (exact, the subnormal code included) and multiplies the f32 partial
product of each block by its decoded scale times :func:`scale_decoder`'s ``factor``,
which folds the ``2**14`` back in (and NVFP4's ``2**8`` and tensor scale).

Block scales are decoded from their bytes: E8M0 ``e`` is the float32 with bits
``e << 23``; e4m3 bits ``s eeee mmm`` become the float16 ``s 0eeee mmm0000000``
(``= e4m3 * 2**-8``, subnormals included) widened to f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from qjax import NVFP4Weight

E2M1_TO_F16_SCALE = 2.0 ** 14    # the f16 built from E2M1 bits is value * 2**-14
E4M3_TO_F16_SCALE = 2.0 ** 8     # the f16 built from e4m3 bits is value * 2**-8


def e8m0_to_f32(e: jax.Array) -> jax.Array:
  """uint8 E8M0 bytes -> float32 ``2 ** (e - 127)`` (0: 2**-127, 255: NaN)."""
  e = e.astype(jnp.uint32)
  bits = jnp.where(e == 0, 0x00400000, e << 23)
  bits = jnp.where(e == 255, 0x7FC00000, bits)
  return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def e4m3_to_f32_times_2_pow_minus_8(b: jax.Array) -> jax.Array:
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
    decode, fixed = e8m0_to_f32, E2M1_TO_F16_SCALE
  elif scale_format == "e4m3":
    decode, fixed = e4m3_to_f32_times_2_pow_minus_8, E2M1_TO_F16_SCALE * E4M3_TO_F16_SCALE
  else:
    raise ValueError(f"{scale_format=} must be 'e8m0' (MXFP4) or 'e4m3' (NVFP4)")
  return decode, (fixed if global_scale is None else global_scale * fixed)


def kernel_scales(w) -> tuple[str, jax.Array, jax.Array | None]:
  """``(scale_format, scale bytes [K // B, N] uint8, tensor scale [1, 1] f32 or None)``
  of an MXFP4Weight or NVFP4Weight, as the kernels take them."""
  if isinstance(w, NVFP4Weight):
    return ("e4m3", lax.bitcast_convert_type(w.scales, jnp.uint8),
            jnp.asarray(w.global_scale, jnp.float32).reshape(1, 1))
  return "e8m0", w.scales, None
