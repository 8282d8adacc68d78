"""FP4 block-scale decoding in registers, shared by the FP4 kernels (tiled, GEMV, MoE).

Every FP4 kernel here builds E2M1 weights as float16 bit patterns worth
``e2m1 * 2**-14`` (exact, the subnormal code included) and multiplies the f32 partial
product of each block by its decoded scale times :func:`scale_decoder`'s ``factor``,
which folds the ``2**14`` back in (and NVFP4's ``2**8`` and tensor scale).

Block scales are decoded from their bytes: E8M0 ``e`` is the float32 with bits
``e << 23``; e4m3 bits ``s eeee mmm`` become the float16 ``s 0eeee mmm0000000``
(``= e4m3 * 2**-8``, subnormals included) widened to f32. Compiled kernels may decode
four bytes per inline-PTX instance instead: E8M0 with byte-parallel bit operations and one
PRMT per value (:func:`e8m0_to_f32_ptx`), e4m3 with the hardware's own conversion
(:func:`e4m3_to_f32_ptx`, sm_89 and later: one ``cvt.rn.f16x2.e4m3x2`` per two bytes),
which gives the value itself (factor without ``2**8``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from qjax import NVFP4Weight
from pallas_kernels import int4_gemv

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


def _e8m0x4_ptx() -> str:
  """PTX: four E8M0 bytes ($4, byte i = element i) -> the float32 bits of their values
  ($0..$3), exactly: ``e << 23``, plus bit 22 for ``e = 0`` (``2**-127``) and ``e = 255``
  (NaN ``0x7FC00000``).

  For all four bytes at once: a byte is 0x00 or 0xFF iff ``b ^ (b >> 1)`` has no bit in
  its low seven, which ``+ 0x7F`` turns into a clear bit 7 (no carry leaves a byte);
  ``hi`` holds per byte ``(e & 1) << 7 | special << 6`` and ``lo`` holds ``e >> 1``. Then
  one PRMT per value puts ``lo``'s byte in bits 24-31 and ``hi``'s in bits 16-23
  (``e << 23 | special << 22``) and zeros below (copies of ``lo``'s clear sign bit).
  """
  lines = ["{", ".reg .b32 s, t, f, hi, lo;",
           "shr.u32 s, $4, 1;",
           f"lop3.b32 t, s, $4, 0x7F7F7F7F, {_LOP3_A_XOR_B_AND_C:#04x};",
           "add.u32 t, t, 0x7F7F7F7F;",
           f"lop3.b32 f, t, 0x80808080, 0, {_LOP3_NOT_A_AND_B:#04x};",
           "shr.u32 f, f, 1;",
           "shl.b32 hi, $4, 7;",
           f"lop3.b32 hi, hi, 0x80808080, f, {int4_gemv.LOP3_A_AND_B_OR_C:#04x};",
           "and.b32 lo, s, 0x7F7F7F7F;"]
  for i in range(4):
    selector = (i << 12) | ((4 + i) << 8) | ((8 | i) << 4) | (8 | i)
    lines.append(f"prmt.b32 ${i}, lo, hi, {selector:#06x};")
  lines.append("}")
  return "\n".join(lines)


# LOP3 truth tables (a = 0xF0, b = 0xCC, c = 0xAA).
_LOP3_A_XOR_B_AND_C = 0x28
_LOP3_NOT_A_AND_B = 0x0C
_E8M0X4_PTX = _e8m0x4_ptx()


def e8m0_to_f32_ptx(e: jax.Array) -> jax.Array:
  """uint8 E8M0 bytes -> float32 ``2 ** (e - 127)`` (255: NaN), as :func:`e8m0_to_f32`,
  in a compiled Pallas-Triton kernel: four bytes per inline-PTX instance, about three
  instructions per value and no compare or select (:func:`_e8m0x4_ptx`)."""
  [bits] = plgpu.elementwise_inline_asm(
      _E8M0X4_PTX, args=[e], constraints="=r,=r,=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(e.shape, jnp.int32)])
  return lax.bitcast_convert_type(bits, jnp.float32)


def e4m3_to_f32_ptx(b: jax.Array) -> jax.Array:
  """uint8 float8_e4m3fn bits -> float32 values (0x7F / 0xFF: NaN), in a compiled
  Pallas-Triton kernel on sm_89 or later, four bytes per inline-PTX instance (row widths:
  :func:`ptx_scales_fit`)."""
  [out] = plgpu.elementwise_inline_asm(
      _E4M3X4_PTX, args=[b], constraints="=f,=f,=f,=f,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.float32)])
  return out


def ptx_scales_fit(block_n: int) -> bool:
  """Whether the 4-byte PTX decoders (:func:`e8m0_to_f32_ptx`, :func:`e4m3_to_f32_ptx`)
  take a ``[1, block_n]`` row of scale bytes (measured: 16 to 256 columns with 4 or 8
  warps compile and match the reference on an H100; Triton packs the bytes for either
  warp count; tests/test_fp4_gemv.py)."""
  return block_n >= 16


# Set False to decode block scales with Pallas ops in the compiled kernels too (A/B switch).
PTX_SCALES = True


def use_ptx_scales(block_n: int, interpret: bool) -> bool:
  """Whether a kernel decodes its ``[1, block_n]`` scale rows with the inline-PTX
  decoders: compiled (not interpret mode), :data:`PTX_SCALES` on, and a fitting width."""
  return PTX_SCALES and not interpret and ptx_scales_fit(block_n)


def scale_decoder(scale_format: str, global_scale=None, *, use_ptx: bool = False):
  """``(decode, factor)`` for a scale format: ``decode(bytes) * factor`` is the f32
  multiplier of a block's partial product ``x_b @ (e2m1_b * 2**-14)``.

  ``global_scale`` (NVFP4's tensor scale, a loaded ``[1, 1]`` f32 array) is folded into
  ``factor``; None for MXFP4. ``use_ptx``: decode with inline PTX
  (:func:`e8m0_to_f32_ptx`, :func:`e4m3_to_f32_ptx`; compiled kernels only).
  """
  if scale_format == "e8m0":
    decode, fixed = (e8m0_to_f32_ptx if use_ptx else e8m0_to_f32), E2M1_TO_F16_SCALE
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
