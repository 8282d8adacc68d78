"""FP4 block-scale decoding in registers, shared by the FP4 kernels (tiled, GEMV, MoE).

Every FP4 kernel here builds E2M1 weights as float16 bit patterns worth
``e2m1 * 2**-14`` (exact, the subnormal code included) and multiplies the f32 partial
product of each block by its decoded scale times :func:`scale_decoder`'s ``factor``,
which folds the ``2**14`` back in (and NVFP4's ``2**8`` and tensor scale).

Block scales are decoded from their bytes: E8M0 ``e`` is the float32 with bits
``e << 23``; e4m3 bits ``s eeee mmm`` become the float16 ``s 0eeee mmm0000000``
(``= e4m3 * 2**-8``, subnormals included) widened to f32. Compiled kernels may decode e4m3
with the hardware's own conversion instead (:func:`e4m3_to_f32_ptx`, sm_89 and later: one
``cvt.rn.f16x2.e4m3x2`` per two bytes), which gives the value itself (factor without
``2**8``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

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


# PTX: four float8_e4m3fn bytes ($4, byte i = element i) -> their four float32 values
# ($0..$3), exactly (NaN, subnormals and -0 included): two hardware conversions to f16x2.
_E4M3X4_PTX = """{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 p, q;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
mov.b32 {h0, h1}, p;
mov.b32 {h2, h3}, q;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
}"""


def e4m3_to_f32_ptx(b: jax.Array) -> jax.Array:
  """uint8 float8_e4m3fn bits -> float32 values (0x7F / 0xFF: NaN), in a compiled
  Pallas-Triton kernel on sm_89 or later, four bytes per inline-PTX instance: each thread
  must hold a multiple of 4 consecutive bytes (:func:`ptx_scales_fit`)."""
  [out] = plgpu.elementwise_inline_asm(
      _E4M3X4_PTX, args=[b], constraints="=f,=f,=f,=f,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.float32)])
  return out


def ptx_scales_fit(block_n: int, num_warps: int) -> bool:
  """Whether :func:`e4m3_to_f32_ptx` takes a ``[1, block_n]`` row of scale bytes: groups
  of 4 consecutive bytes (measured: 16 to 256 columns with 4 or 8 warps compile and match
  the reference on an H100; tests/test_fp4_gemv.py)."""
  del num_warps  # Triton packs the bytes for any warp count (compiled for 4 and 8).
  return block_n >= 16


def scale_decoder(scale_format: str, global_scale=None, *, use_ptx: bool = False):
  """``(decode, factor)`` for a scale format: ``decode(bytes) * factor`` is the f32
  multiplier of a block's partial product ``x_b @ (e2m1_b * 2**-14)``.

  ``global_scale`` (NVFP4's tensor scale, a loaded ``[1, 1]`` f32 array) is folded into
  ``factor``; None for MXFP4. ``use_ptx``: decode e4m3 with :func:`e4m3_to_f32_ptx`
  (compiled kernels only; E8M0 has no such instruction before sm_100).
  """
  if scale_format == "e8m0":
    decode, fixed = e8m0_to_f32, E2M1_TO_F16_SCALE
  elif scale_format == "e4m3" and use_ptx:
    decode, fixed = e4m3_to_f32_ptx, E2M1_TO_F16_SCALE
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
