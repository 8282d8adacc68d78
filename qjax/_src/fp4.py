"""FP4 (E2M1) weights with block scales: MXFP4 and NVFP4, their quantizers and decoders.

An E2M1 code is 4 bits ``s e1 e0 m``: sign, two exponent bits (bias 1), one mantissa
bit. Its magnitudes, by the low three bits, are ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (``e = 0``
is subnormal: ``m * 0.5``). Codes are packed 8 per uint32 word along K in the same tile
orders as INT4 codes (:mod:`qjax._src.packing`), so the GPU kernel reads both alike.

* MXFP4 (OCP Microscaling): one E8M0 scale per 32 rows of K, stored as its biased
  exponent byte ``e`` (uint8): ``scale = 2 ** (e - 127)``, ``e = 255`` is NaN.
  ``W[k, n] = e2m1(q[k, n]) * 2 ** (e[k // 32, n] - 127)``.
* NVFP4: one float8_e4m3fn scale per 16 rows of K and one float32 scale per tensor:
  ``W[k, n] = (e2m1(q[k, n]) * f32(s[k // 16, n])) * global_scale`` (the inner product is
  exact in float32, so the weight is the correctly rounded product).

Subnormal float32 results (MXFP4 scale bytes 0 and 1, or NVFP4 products below 2**-126)
are flushed to zero by XLA on the CPU; every other value decodes exactly.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import formats
from qjax._src import int4
from qjax._src import packing

E2M1_MAX = 6.0        # largest E2M1 magnitude
E2M1_EMAX = 2         # exponent of E2M1_MAX: 6 = 1.5 * 2**2
E4M3_MAX = 448.0      # largest float8_e4m3fn magnitude
E8M0_BIAS = 127
E8M0_NAN = 255
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32


# ------------------------------------------------------------------------------ codecs


def decode_e2m1(codes: jax.Array) -> jax.Array:
  """E2M1 codes (any integer dtype, values in ``[0, 15]``) -> float32 values, exactly.

  Built from the float32 bits, with no ``exp2``: ``e > 0`` is the normal float
  ``2 ** (e - 1) * (1 + m / 2)`` (exponent field ``e + 126``, mantissa MSB ``m``), and
  the subnormal E2M1 code ``e = 0, m = 1`` is 0.5 (bits ``0x3F000000``), so no float32
  subnormal is ever made; the sign goes to bit 31.
  """
  q = jnp.asarray(codes).astype(jnp.uint32)
  e = (q >> 1) & 3
  m = q & 1
  normal = ((e + 126) << 23) | (m << 22)
  magnitude = jnp.where(e == 0, m * jnp.uint32(0x3F000000), normal)
  return jax.lax.bitcast_convert_type(magnitude | ((q & 8) << 28), jnp.float32)


def encode_e2m1(v: jax.Array) -> jax.Array:
  """float32 values (already divided by their scale) -> uint8 E2M1 codes.

  Rounds to the nearest E2M1 value, ties to even (the even code), and saturates
  magnitudes above 6 to 6. The sign bit follows the sign of ``v`` (so small negatives
  give -0, code 8).
  """
  v = jnp.asarray(v, jnp.float32)
  a = jnp.abs(v)
  # Spacing of the E2M1 grid around a: 0.5 below 2, 1 in [2, 4), 2 from 4 on. The grid
  # index a / step has the parity of the code, so jnp.round (half to even) ties to the
  # even code.
  step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
  r = jnp.minimum(jnp.round(a / step) * step, E2M1_MAX)
  index = jnp.where(r < 2.0, 2.0 * r, jnp.where(r < 4.0, r + 2.0, 0.5 * r + 4.0))
  sign = jnp.signbit(v).astype(jnp.uint8) << 3
  return index.astype(jnp.uint8) | sign


def decode_e8m0(e: jax.Array) -> jax.Array:
  """E8M0 biased exponents (uint8) -> float32 ``2 ** (e - 127)``, exactly; 255 -> NaN.

  Built from the float32 bit pattern: ``e << 23`` for ``e >= 1``; ``e = 0`` is the
  subnormal ``2 ** -127`` (bits ``0x00400000``).
  """
  e = jnp.asarray(e).astype(jnp.uint32)
  bits = jnp.where(e == 0, jnp.uint32(0x00400000), e << 23)
  bits = jnp.where(e == E8M0_NAN, jnp.uint32(0x7FC00000), bits)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _pow2(n: jax.Array) -> jax.Array:
  """float32 ``2 ** n`` for integer ``n`` in ``[-126, 127]``, built from its bits."""
  return jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)


# ----------------------------------------------------------------------------- pytrees


class _FP4Weight(formats.QuantizedWeight):
  """What MXFP4 and NVFP4 share: packed E2M1 codes and one scale row per block."""

  block_size: ClassVar[int]
  scale_dtype: ClassVar[np.dtype]
  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, int]
  tile_k: int

  def _validate(self, extra: dict) -> None:
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    packing.check_tile_k(self.tile_k)
    k, n = self.shape
    name = type(self).__name__
    if k <= 0 or n <= 0:
      raise ValueError(f"{name}: shape (K={k}, N={n}) must be positive")
    if k % self.block_size:
      raise ValueError(
          f"{name}: K={k} must be a multiple of the block size {self.block_size}; pad K "
          "with zero rows")
    if not self._leaves_concrete_2d():
      return
    kp = packing.padded_rows(k, self.tile_k)
    want = {"codes": ((kp // 8, n), jnp.uint32),
            "scales": ((k // self.block_size, n), self.scale_dtype), **extra}
    batch = tuple(self.codes.shape[:-2])  # leading (expert) axes, shared by every array
    for field, (shape, dtype) in want.items():
      a = getattr(self, field)
      if tuple(a.shape) != batch + shape or jnp.dtype(a.dtype) != jnp.dtype(dtype):
        raise ValueError(
            f"{name}.{field} must be {batch + shape} of dtype {jnp.dtype(dtype).name}, got "
            f"{tuple(a.shape)} {jnp.dtype(a.dtype).name} (shape={self.shape}, "
            f"tile_k={self.tile_k}, leading axes {batch})")

  @property
  def num_blocks(self) -> int:
    """Scale blocks along K: ``K // block_size``."""
    return self.shape[0] // self.block_size

  def unpacked_codes(self) -> jax.Array:
    """``[..., K, N]`` uint8 E2M1 codes in ``[0, 15]``."""
    return packing.unpack_codes(self.codes, self.shape[0], self.tile_k)

  def repack(self, tile_k: int):
    """The same weight with codes in another tile order (lossless, jittable)."""
    words = packing.repack_codes(self.codes, self.shape[0], self.tile_k, tile_k)
    return dataclasses.replace(self, codes=words, tile_k=tile_k)

  def block_scales(self) -> jax.Array:  # pragma: no cover - abstract
    """``[..., K // B, N]`` float32 multiplier of each block's E2M1 values."""
    raise NotImplementedError

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[..., K, N]``: ``e2m1(q) * block scale``, computed in float32 and rounded once
    to ``dtype``; for a 16-bit ``dtype`` two columns per 32-bit word
    (:func:`formats.column_pairs`: the same values, written faster by XLA on a GPU)."""

    def columns(codes, scales):
      part = dataclasses.replace(self, codes=codes, scales=scales,
                                 shape=(self.shape[0], codes.shape[-1]))
      values = decode_e2m1(part.unpacked_codes())
      block = jnp.repeat(part.block_scales(), self.block_size, axis=-2)
      return part._finish(values * block).astype(dtype)  # pylint: disable=protected-access

    return formats.column_pairs(columns, (self.codes, self.scales), dtype)

  def _finish(self, w: jax.Array) -> jax.Array:
    return w


@formats.register_format
@dataclasses.dataclass(frozen=True)
class MXFP4Weight(_FP4Weight):
  """MXFP4 weight of logical shape ``[K, N]`` (``y = x @ W``): E2M1 codes, E8M0 scale
  per 32 rows of K.

  ``W[k, n] = e2m1(q[k, n]) * 2 ** (scales[k // 32, n] - 127)``.

  Attributes:
    codes: ``[Kp // 8, N]`` uint32, 8 E2M1 codes per word along K in tile order
      ``tile_k`` (see :mod:`qjax._src.packing`); ``Kp`` is K rounded up to ``tile_k``,
      padding codes are 0 (+0.0).
    scales: ``[K // 32, N]`` uint8 E8M0 biased exponents (255 is NaN).
    shape: the logical ``(K, N)``; K a multiple of 32.
    tile_k: packing order of ``codes`` (128, the default: kernel-native).

  Leading batch axes (experts) may precede the last two axes of both arrays.

  Construction checks shapes and dtypes only, not values: a scale byte of 255 (E8M0 NaN)
  is accepted and gives NaN in its block of 32 rows of that column, in :meth:`dequantize`
  and in ``qjax.matmul``'s output column. :func:`quantize_mxfp4` checks that a concrete
  float weight is finite before quantizing it (not a tracer under ``jax.jit``).
  """

  format_name = "mxfp4"
  block_size = MXFP4_BLOCK
  scale_dtype = np.dtype(np.uint8)

  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, int] = formats.static_field()
  tile_k: int = formats.static_field(default=packing.NATIVE_TILE_K)

  def __post_init__(self):
    self._validate({})

  def block_scales(self) -> jax.Array:
    """The decoded E8M0 scales: what each block's E2M1 values are multiplied by.

    Returns:
      ``[..., K // 32, N]`` float32, ``2 ** (scales - 127)`` exactly (``scales == 0``
      gives the float32 subnormal ``2 ** -127``; ``scales == 255`` gives NaN, the E8M0
      NaN, which makes that block of :meth:`dequantize` NaN).
    """
    return decode_e8m0(self.scales)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class NVFP4Weight(_FP4Weight):
  """NVFP4 weight of logical shape ``[K, N]`` (``y = x @ W``): E2M1 codes, float8_e4m3fn
  scale per 16 rows of K, float32 scale per tensor.

  ``W[k, n] = (e2m1(q[k, n]) * f32(scales[k // 16, n])) * global_scale``.

  Attributes:
    codes: ``[Kp // 8, N]`` uint32 in tile order ``tile_k`` (as :class:`MXFP4Weight`).
    scales: ``[K // 16, N]`` float8_e4m3fn block scales.
    global_scale: ``[]`` float32 tensor scale (``[E]`` with a leading expert axis).
    shape: the logical ``(K, N)``; K a multiple of 16.
    tile_k: packing order of ``codes``.

  Construction checks shapes and dtypes only, not values: a NaN block scale (e4m3fn
  ``0x7F`` / ``0xFF``) is accepted and gives NaN in its block of 16 rows of that column,
  and a NaN or Inf ``global_scale`` makes the whole weight NaN or Inf, in
  :meth:`dequantize` and in ``qjax.matmul``'s output. :func:`quantize_nvfp4` checks that a
  concrete float weight is finite before quantizing it (not a tracer under ``jax.jit``).
  """

  format_name = "nvfp4"
  block_size = NVFP4_BLOCK
  scale_dtype = np.dtype(jnp.float8_e4m3fn)

  codes: jax.Array
  scales: jax.Array
  global_scale: jax.Array
  shape: tuple[int, int] = formats.static_field()
  tile_k: int = formats.static_field(default=packing.NATIVE_TILE_K)

  def __post_init__(self):
    self._validate({"global_scale": ((), jnp.float32)})

  def block_scales(self) -> jax.Array:
    """The float8_e4m3fn block scales as float32 (exact), without ``global_scale``.

    Returns:
      ``[..., K // 16, N]`` float32; :meth:`dequantize` is ``e2m1(q) * block_scales()``
      per block, then times ``global_scale``. A NaN scale (e4m3fn bytes ``0x7F`` /
      ``0xFF``) stays NaN and makes that block NaN.
    """
    return self.scales.astype(jnp.float32)

  def _finish(self, w: jax.Array) -> jax.Array:
    g = jnp.asarray(self.global_scale, jnp.float32)
    return w * g[..., None, None]


# -------------------------------------------------------------------------- quantizers


def _check_weight(w, block: int, name: str) -> tuple[int, int]:
  formats.check_not_quantized(w, name)
  if getattr(w, "ndim", 0) < 2:
    raise ValueError(
        f"{name} must be a [..., K, N] matrix, got shape {getattr(w, 'shape', None)}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got dtype {w.dtype}")
  k, n = w.shape[-2:]
  if k <= 0 or n <= 0:
    raise ValueError(f"{name} has shape {tuple(w.shape)}; K and N must be positive")
  if k % block:
    raise ValueError(
        f"K={k} of {name} must be a multiple of the block size {block}; pad K with zero rows")
  int4.check_finite(w, name)
  return k, n


def _blocks(w: jax.Array, block: int) -> jax.Array:
  """``[..., K, N]`` -> ``[..., K // B, B, N]`` float32."""
  *batch, k, n = w.shape
  return jnp.asarray(w, jnp.float32).reshape(*batch, k // block, block, n)


def quantize_mxfp4(w: jax.Array, *, tile_k: int = packing.NATIVE_TILE_K,
                   name: str = "w") -> MXFP4Weight:
  """MXFP4 quantization of a ``[..., K, N]`` weight with the OCP MX scale rule.

  Per block of 32 rows: shared exponent ``floor(log2(amax)) - 2`` (2 is the exponent of
  E2M1's largest value 6), clamped to E8M0's ``[-127, 127]`` (all-zero blocks get
  -127); elements ``w / 2**shared`` rounded to the nearest E2M1 value, ties to even,
  saturating at +-6.

  A concrete ``w`` holding NaN or Inf raises ValueError naming ``name`` (under
  ``jax.jit`` values are unknown and nothing is checked). Scales are powers of two from
  2**-127 to 2**126, so no finite float32 range overflows them.

  Args:
    w: ``[..., K, N]`` float weight (leading axes: a stack, e.g. experts).
    tile_k: packing order of the codes (default: the kernel-native order).
    name: the weight's name, used in error messages.

  Raises:
    ValueError: naming ``name``, when ``w`` is not a float array of at least two axes
      (or is already quantized), is empty, holds NaN or Inf (concrete ``w`` only), or K
      is not a multiple of the block (32); or a ``tile_k`` the packing does not take.

  >>> import jax, qjax
  >>> qw = qjax.quantize_mxfp4(jax.random.normal(jax.random.key(0), (256, 64)))
  >>> qw.codes.shape, qw.scales.shape, qw.scales.dtype
  ((32, 64), (8, 64), dtype('uint8'))
  """
  k, n = _check_weight(w, MXFP4_BLOCK, name)
  wb = _blocks(w, MXFP4_BLOCK)
  amax = jnp.max(jnp.abs(wb), axis=-2)                      # [..., K // 32, N]
  _, exponent = jnp.frexp(amax)                             # amax = f * 2**exponent, f in [.5, 1)
  shared = jnp.where(amax > 0, exponent - 1 - E2M1_EMAX, -E8M0_BIAS)
  shared = jnp.clip(shared, -E8M0_BIAS, E8M0_BIAS - 1)      # 2**-shared stays a normal float
  codes = encode_e2m1(wb * _pow2(-shared)[..., None, :])
  *batch, _, _ = w.shape
  return MXFP4Weight(
      codes=packing.pack_codes(codes.reshape(*batch, k, n), tile_k),
      scales=(shared + E8M0_BIAS).astype(jnp.uint8),
      shape=(k, n), tile_k=tile_k)


def quantize_nvfp4(w: jax.Array, *, tile_k: int = packing.NATIVE_TILE_K,
                   name: str = "w") -> NVFP4Weight:
  """NVFP4 quantization of a ``[..., K, N]`` weight with the two-level scale.

  ``global_scale = amax(w) / (6 * 448)`` per matrix (1 for an all-zero matrix, at
  least 2**-126, float32's smallest normal, so tensors below 3.2e-35 get block scales
  under 448 instead of NaN); block
  scale ``s = e4m3(amax_block / (6 * global_scale))`` (round to nearest even); elements
  ``w / (f32(s) * global_scale)`` rounded to the nearest E2M1 value, ties to even,
  saturating at +-6 (blocks whose scale rounds to 0 get code 0).

  A concrete ``w`` holding NaN or Inf raises ValueError naming ``name`` (under
  ``jax.jit`` values are unknown and nothing is checked). The block scales are relative
  to the tensor's ``amax``, so they cannot overflow float8_e4m3fn; blocks below
  ``amax / (448 * 512 * 6)`` round to zero (NVFP4's own range, 2**-9 to 448 per block).

  Args:
    w: ``[..., K, N]`` float weight (leading axes: a stack, e.g. experts).
    tile_k: packing order of the codes (default: the kernel-native order).
    name: the weight's name, used in error messages.

  Raises:
    ValueError: naming ``name``, when ``w`` is not a float array of at least two axes
      (or is already quantized), is empty, holds NaN or Inf (concrete ``w`` only), or K
      is not a multiple of the block (16); or a ``tile_k`` the packing does not take.

  >>> import jax, qjax
  >>> qw = qjax.quantize_nvfp4(jax.random.normal(jax.random.key(0), (256, 64)))
  >>> qw.scales.shape, qw.scales.dtype, qw.global_scale.shape
  ((16, 64), dtype(float8_e4m3fn), ())
  """
  k, n = _check_weight(w, NVFP4_BLOCK, name)
  wb = _blocks(w, NVFP4_BLOCK)
  amax = jnp.max(jnp.abs(wb), axis=(-3, -2, -1))            # [...]
  # Floored at float32's smallest normal: below it (amax < 3.2e-35) XLA flushes the
  # subnormal quotient to zero and every block scale would be amax / 0 = NaN in e4m3.
  global_scale = jnp.where(
      amax > 0, jnp.maximum(amax / (E2M1_MAX * E4M3_MAX), F32_TINY), 1.0).astype(jnp.float32)
  g = global_scale[..., None, None]
  block_amax = jnp.max(jnp.abs(wb), axis=-2)                # [..., K // 16, N]
  # One division: XLA rewrites (a / b) / c as a / (b * c) under jit, so two divisions
  # would round differently jitted and eager (the H100 gave other codes).
  scales = (block_amax / (E2M1_MAX * g)).astype(jnp.float8_e4m3fn)
  # The elements divide by the scale as stored (rounded to e4m3). The barrier keeps XLA
  # from fusing the round trip f32 -> e4m3 -> f32 away: on the H100 (jax 0.11.2) a
  # jitted quantize_nvfp4 divided by the unrounded scale, and about 5 % of the codes
  # came out one step off the rule (eager and the CPU were right).
  step = jax.lax.optimization_barrier(scales).astype(jnp.float32) * g
  safe = jnp.where(step > 0, step, 1.0)
  v = jnp.where((step > 0)[..., None, :], wb / safe[..., None, :], 0.0)
  *batch, _, _ = w.shape
  return NVFP4Weight(
      codes=packing.pack_codes(encode_e2m1(v).reshape(*batch, k, n), tile_k),
      scales=scales, global_scale=global_scale, shape=(k, n), tile_k=tile_k)


# --------------------------------------------------------------------------------- XLA


def matmul_xla(x: jax.Array, w: _FP4Weight, variant: str | None = None) -> jax.Array:
  """Reference ``x [M, K] @ W [K, N] -> [M, N]`` in x's dtype, f32 accumulation.

  ``variant``: ``"materialize"`` dequantizes W in x's dtype and runs ``jnp.dot``;
  ``"reduce"`` (:func:`matmul_reduce`) reads each code word once, with no dot. None picks
  :func:`select_variant`'s. Both agree to within float rounding.
  """
  if w.codes.ndim != 2:
    raise NotImplementedError(
        f"codes of shape {w.codes.shape}: matmul takes one [K, N] weight; vmap over "
        "leading axes")
  variant = select_variant(x.shape[0]) if variant is None else variant
  if variant == "reduce":
    return matmul_reduce(x, w)
  if variant != "materialize":
    raise ValueError(f"unknown FP4 XLA variant {variant!r}; known: materialize, reduce")
  return formats.dense_dot(x, w.dequantize(x.dtype))


# Where matmul_xla reads the words once instead of dequantizing W: one row of x, on the
# platforms it was measured on (the INT4 path's rule, int4_xla_variants.AUTO_RULES; H100
# figures in BENCHMARKS.md). Elsewhere W is dequantized, as every test first ran it.
REDUCE_MAX_M = 1
REDUCE_PLATFORMS = ("gpu",)


def select_variant(m: int) -> str:
  """The XLA formulation :func:`matmul_xla` runs for ``m`` rows of x."""
  if m <= REDUCE_MAX_M and jax.devices()[0].platform in REDUCE_PLATFORMS:
    return "reduce"
  return "materialize"


def matmul_reduce(x: jax.Array, w: _FP4Weight) -> jax.Array:
  """``y[m, n] = sum_k x[m, k] W[k, n]`` in float32 as one fused multiply-and-sum over
  the code words (:func:`packing.word_plane_sum`): each word's 8 nibbles are decoded,
  scaled and multiplied by their 8 elements of x in one term, so XLA's reduction reads
  every word once (0.53 byte per weight) and writes no dequantized W. For small M: the
  arithmetic is M times one row's.

  Shapes: x ``[M, K]``; codes ``[Kp // 8, N]`` in tile order ``tile_k``.
  """
  scales = jnp.repeat(w.block_scales(), w.block_size, axis=0)  # [K, N] f32
  scales = packing.rows_by_plane(scales, w.codes.shape[0] * 8, w.tile_k)
  y = packing.word_plane_sum(x, w.codes, x.shape[1], w.tile_k,
                             lambda j, q: decode_e2m1(q) * scales[:, j])
  if isinstance(w, NVFP4Weight):
    y = y * jnp.asarray(w.global_scale, jnp.float32)
  return y.astype(x.dtype)
