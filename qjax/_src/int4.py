"""Affine INT4 weights with group scales: the pytree, its quantizer and its dequantizer."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import formats
from qjax._src import packing

SCALE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
GROUP_SIZES = (32, 64, 128, 256)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class Int4Weight(formats.QuantizedWeight):
  """Affine 4-bit weight of logical shape ``[K, N]``, used as ``y = x @ W``.

  Invariant, with codes ``q`` in ``[0, 15]`` and ``g = k // G``:

  * integer zero points: ``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``;
  * symmetric (no zeros, no biases): the same with ``zeros = 8`` (signed int4 stored in
    offset binary);
  * float biases (GGUF Q4_1 / K-quant style): ``W[k, n] = q[k, n] * scales[g, n] +
    biases[g, n]``.

  Attributes:
    codes: ``[Kp // 8, N]`` uint32, 8 codes per word along K in tile order ``tile_k``
      (see :mod:`qjax._src.packing`); ``Kp`` is K rounded up to ``tile_k``.
    scales: ``[K // G, N]`` bf16, f16 or f32.
    zeros: ``[K // G, N]`` uint8 zero points in ``[0, 15]`` (asymmetric), or None.
    biases: ``[K // G, N]`` float offsets in the scales' dtype, or None; never together
      with zeros.
    shape: the logical ``(K, N)``.
    group_size: ``G``; equal to K for one group per column (per-channel).
    tile_k: packing order of ``codes`` (128, the default: kernel-native; 8: plain GPTQ
      order).

  Construction checks shapes and dtypes only, not values: a NaN or Inf in ``scales`` (or
  ``biases``) is accepted and gives NaN or Inf in that group of that column of
  :meth:`dequantize` and of ``qjax.matmul``'s output column ``n``. :func:`quantize` checks
  that a concrete float weight (not a tracer under ``jax.jit``) is finite, and that its
  scales are, before making one.
  """

  format_name = "int4"

  codes: jax.Array
  scales: jax.Array
  zeros: jax.Array | None
  shape: tuple[int, int] = formats.static_field()
  group_size: int = formats.static_field()
  tile_k: int = formats.static_field(default=packing.NATIVE_TILE_K)
  biases: jax.Array | None = None

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    if k % self.group_size:
      raise ValueError(
          f"K={k} must be a multiple of group_size={self.group_size}; pad K or choose a "
          "group size that divides it")
    if self.zeros is not None and self.biases is not None:
      raise ValueError("Int4Weight takes integer zeros or float biases, not both")
    if not self._leaves_concrete_2d():
      return
    kp = packing.padded_rows(k, self.tile_k)
    want = {"codes": ((kp // 8, n), (jnp.uint32,)),
            "scales": ((k // self.group_size, n), SCALE_DTYPES)}
    if self.zeros is not None:
      want["zeros"] = ((k // self.group_size, n), (jnp.uint8,))
    if self.biases is not None:
      want["biases"] = ((k // self.group_size, n), SCALE_DTYPES)
    formats.check_trailing_fields(
        self, want,
        f"shape={self.shape}, group_size={self.group_size}, tile_k={self.tile_k}")

  @property
  def symmetric(self) -> bool:
    """Whether the codes are signed around 0: no ``zeros`` and no ``biases``."""
    return self.zeros is None and self.biases is None

  @property
  def num_groups(self) -> int:
    """Scale groups along K: ``K // group_size``."""
    return self.shape[0] // self.group_size

  def unpacked_codes(self) -> jax.Array:
    """``[K, N]`` uint8 codes in ``[0, 15]``."""
    return packing.unpack_codes(self.codes, self.shape[0], self.tile_k)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[K, N]`` in ``dtype`` (computed in float32): ``(q - z) * s``."""
    return dequantize_int4(self, dtype)

  def repack(self, tile_k: int) -> "Int4Weight":
    """The same weight with codes in another tile order (lossless, jittable)."""
    words = packing.repack_codes(self.codes, self.shape[0], self.tile_k, tile_k)
    return dataclasses.replace(self, codes=words, tile_k=tile_k)


def _expand_groups(a: jax.Array, group_size: int) -> jax.Array:
  """``[..., K // G, N]`` -> ``[..., K, N]`` by repeating each group row G times."""
  return jnp.repeat(a, group_size, axis=-2)


def dequantize_int4(w: Int4Weight, dtype=jnp.float32) -> jax.Array:
  """``[K, N]`` W in ``dtype``: ``(q - z) * s`` (``z = 8`` when symmetric) or
  ``q * s + b``, computed in float32 and rounded once to ``dtype``.

  For a 16-bit ``dtype`` the columns are computed in pairs (:func:`formats.column_pairs`),
  which XLA's GPU fusion writes 1.4x faster; the values are the same.
  """
  k, tile_k, g = w.shape[0], w.tile_k, w.group_size

  def columns(codes, scales, zeros, biases):
    q = packing.unpack_codes(codes, k, tile_k).astype(jnp.float32)
    s = _expand_groups(scales.astype(jnp.float32), g)
    if biases is not None:
      wd = q * s + _expand_groups(biases.astype(jnp.float32), g)
    else:
      z = jnp.float32(8) if zeros is None else _expand_groups(zeros.astype(jnp.float32), g)
      wd = (q - z) * s
    return wd.astype(dtype)

  return formats.column_pairs(columns, (w.codes, w.scales, w.zeros, w.biases), dtype)


def check_finite(w, name: str) -> None:
  """Raises ValueError naming ``name`` if a concrete ``w`` holds NaN or Inf, or (float64
  input) finite values beyond float32's range, which the quantizers' float32 arithmetic
  would turn into Inf. No check under jit: a tracer has no values."""
  if isinstance(w, jax.core.Tracer):
    return
  a = np.asarray(w)
  bad = ~np.isfinite(a)
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{name} has {int(bad.sum())} non-finite values (first at index {idx}: {a[idx]}); "
        "quantization needs finite weights")
  if a.dtype.itemsize > 4:
    with np.errstate(over="ignore"):
      bad = np.isinf(a.astype(np.float32))
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(
          f"{name} has {int(bad.sum())} values beyond float32's range (first at index "
          f"{idx}: {a[idx]}); quantization computes in float32: rescale the weight")


class ScaleRangeWarning(UserWarning):
  """The requested scale dtype cannot hold a weight's scales; float32 is used instead."""


MAX_SCALE_ROUNDING = 0.01  # relative rounding of a scale beyond which float32 is used


def _scale_dtype_that_fits(wg, symmetric: bool, scale_dtype, name: str):
  """``scale_dtype``, or float32 (with a warning) when some min-max scale of ``wg``
  ``[K // G, G, N]`` overflows it, rounds to zero, or loses over 1% (float16 subnormals):
  a float16 scale holds 6.1e-5 to 65504 at full precision, so groups with a range beyond
  about 4.6e5 or below 4e-4 need float32 scales."""
  if jnp.dtype(scale_dtype) == jnp.dtype(jnp.float32) or isinstance(wg, jax.core.Tracer):
    return scale_dtype
  if symmetric:
    need = jnp.max(jnp.abs(wg), axis=1) / 7.0
  else:
    need = (jnp.maximum(jnp.max(wg, axis=1), 0.0) - jnp.minimum(jnp.min(wg, axis=1), 0.0)) / 15.0
  return dtype_that_fits(need, scale_dtype, name, what="group scales", option="scale_dtype")


def dtype_that_fits(need, dtype, name: str, *, what: str, option: str):
  """``dtype``, or float32 with a :class:`ScaleRangeWarning` (naming ``name``, ``what``
  and the keyword ``option`` that picks the dtype) when some of the concrete float32
  values ``need [G, N]`` (scales or norms, >= 0) overflow ``dtype``, round to zero in it
  or lose over :data:`MAX_SCALE_ROUNDING` of their value. The warning points at the
  caller of the quantizer that called this through one helper."""
  need = np.asarray(need, np.float64)
  held = np.asarray(jnp.asarray(need, jnp.float32).astype(dtype), np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    bad = ~np.isfinite(held) | ((need > 0) & (np.abs(held - need) > MAX_SCALE_ROUNDING * need))
  if not bad.any():
    return dtype
  g, n = (int(i) for i in np.argwhere(bad)[0])
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.warn(
      f"{name}: {int(bad.sum())} {what} do not fit {jnp.dtype(dtype).name} "
      f"(group {g}, column {n} needs {need[g, n]:.3g}, which it holds as {held[g, n]:.3g}); "
      f"using float32 {what.split()[-1]}. Pass {option}=jnp.float32 (or bfloat16) to choose "
      "it yourself, or rescale the weight.", ScaleRangeWarning, stacklevel=4)
  return jnp.float32


def quantize(
    w: jax.Array,
    *,
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype=jnp.bfloat16,
    method: Literal["minmax", "mse"] = "minmax",
    tile_k: int = packing.NATIVE_TILE_K,
    name: str = "w",
) -> Int4Weight:
  """Round-to-nearest INT4 quantization of a ``[K, N]`` weight used as ``y = x @ W``.

  Args:
    w: ``[K, N]`` float weight.
    group_size: rows of K sharing one scale: 32, 64, 128 or 256; None for one group
      per column (per-channel).
    symmetric: signed int4 with ``scale = absmax / 7`` (True) or unsigned int4 with a
      zero point spanning ``[min(w, 0), max(w, 0)]`` (False).
    scale_dtype: bf16, f16 or f32.
    method: "minmax" uses the full range; "mse" tries 20 ranges per group, from the
      full one down to half of it, and keeps the one with the smallest squared
      reconstruction error.
    tile_k: packing order of the codes (default: the kernel-native order).
    name: the weight's name, used in error and warning messages.

  Returns:
    An :class:`Int4Weight`.

  Raises:
    ValueError: naming ``name``, when ``w`` is not a float ``[K, N]`` matrix (or is
      already quantized), is empty, holds NaN or Inf or (float64) values beyond float32's
      range, or when a scale is not finite even in float32 (a group spanning more than
      the float32 range); naming the argument, for a ``group_size``, ``scale_dtype``,
      ``method`` or ``tile_k`` not listed above, or K not a multiple of ``group_size``.

  Guards: for a concrete ``w`` (not a tracer under ``jax.jit``, where values are
  unknown), non-finite weights raise, and when the min-max scales overflow
  ``scale_dtype``, round to zero in it, or lose over 1% (float16 subnormals), float32
  scales are used with a :class:`ScaleRangeWarning`. Under ``jit`` neither check runs:
  check the weights before tracing. All-zero groups get zero scales and decode to zeros,
  as do groups whose scale is below float32's smallest normal (max ``|w|`` under about
  8e-38 symmetric): XLA flushes subnormal floats to zero.

  >>> import jax, jax.numpy as jnp, qjax
  >>> w = jax.random.normal(jax.random.key(0), (256, 64))
  >>> qw = qjax.quantize(w, group_size=128)
  >>> qw.codes.shape, qw.scales.shape, qw.scales.dtype
  ((32, 64), (2, 64), dtype(bfloat16))
  >>> bool(jnp.linalg.norm(qw.dequantize() - w) / jnp.linalg.norm(w) < 0.15)
  True
  """
  formats.check_not_quantized(w, name)
  if getattr(w, "ndim", None) != 2:
    raise ValueError(f"{name} must be a [K, N] matrix, got shape {getattr(w, 'shape', None)}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got dtype {w.dtype}")
  k, n = w.shape
  if k <= 0 or n <= 0:
    raise ValueError(f"{name} has shape {tuple(w.shape)}; K and N must be positive")
  if group_size is None:
    group_size = k
  elif (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))
        or group_size not in GROUP_SIZES):
    raise ValueError(
        f"{group_size=} is not supported; use one of {GROUP_SIZES} (an int) or None "
        "(per-channel)")
  if k % group_size:
    raise ValueError(
        f"K={k} must be a multiple of group_size={group_size}; pad K or choose a group "
        "size that divides it")
  if jnp.dtype(scale_dtype) not in [jnp.dtype(d) for d in SCALE_DTYPES]:
    raise ValueError(f"{scale_dtype=} must be one of bfloat16, float16, float32")
  if method not in ("minmax", "mse"):
    raise ValueError(f"{method=} must be 'minmax' or 'mse'")
  check_finite(w, name)

  wg = jnp.asarray(w, jnp.float32).reshape(k // group_size, group_size, n)
  scale_dtype = _scale_dtype_that_fits(wg, symmetric, scale_dtype, name)
  if method == "minmax":
    shrink = jnp.ones((1,), jnp.float32)
  else:
    shrink = jnp.linspace(1.0, 0.5, 20, dtype=jnp.float32)

  def keep_better(best, p):
    cand = _fit_groups(wg, p, symmetric=symmetric, scale_dtype=scale_dtype)
    better = cand[3] < best[3]  # [K // G, N]
    pick = lambda c, b: jnp.where(better[:, None, :] if c.ndim == 3 else better, c, b)
    return jax.tree.map(pick, cand, best), None

  first = _fit_groups(wg, shrink[0], symmetric=symmetric, scale_dtype=scale_dtype)
  # Candidates are scanned one at a time so memory stays a few copies of w.
  (scales, zeros, codes, _), _ = jax.lax.scan(keep_better, first, shrink[1:])

  if not isinstance(scales, jax.core.Tracer):
    check_finite(scales.astype(jnp.float32), f"scales of {name} in {jnp.dtype(scale_dtype).name}")
  words = packing.pack_codes(codes.reshape(k, n), tile_k)
  return Int4Weight(
      codes=words,
      scales=scales,
      zeros=None if symmetric else zeros.astype(jnp.uint8),
      shape=(k, n),
      group_size=group_size,
      tile_k=tile_k,
  )


def _fit_groups(wg, shrink, *, symmetric, scale_dtype):
  """Scales, zero points, codes and squared error for one range-shrink factor.

  Args:
    wg: ``[K // G, G, N]`` float32.
    shrink: scalar in (0, 1].
  Returns:
    scales ``[K // G, N]`` scale_dtype, zeros ``[K // G, N]`` f32, codes
    ``[K // G, G, N]`` uint8, err ``[K // G, N]`` f32.
  """
  if symmetric:
    amax = jnp.max(jnp.abs(wg), axis=1) * shrink
    scales = (amax / 7.0).astype(scale_dtype)
    s = scales.astype(jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)
    q = jnp.clip(jnp.round(wg / safe[:, None]), -8, 7)
    zeros = jnp.full_like(s, 8.0)
    codes = (q + 8).astype(jnp.uint8)
    deq = q * s[:, None]
  else:
    lo = jnp.minimum(jnp.min(wg, axis=1), 0.0) * shrink
    hi = jnp.maximum(jnp.max(wg, axis=1), 0.0) * shrink
    scales = ((hi - lo) / 15.0).astype(scale_dtype)
    s = scales.astype(jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)
    zeros = jnp.clip(jnp.round(-lo / safe), 0, 15)
    q = jnp.clip(jnp.round(wg / safe[:, None]) + zeros[:, None], 0, 15)
    codes = q.astype(jnp.uint8)
    deq = (q - zeros[:, None]) * s[:, None]
  err = jnp.sum((deq - wg) ** 2, axis=1)
  return scales, zeros, codes, err


def dequantize(w) -> jax.Array:
  """The float32 matrix a quantized weight stands for: ``w.dequantize()``.

  Args:
    w: any :class:`~qjax.QuantizedWeight` (:class:`~qjax.Int4Weight`,
      :class:`~qjax.MXFP4Weight`, a GGUF format, ...), possibly with leading stack axes
      (experts, layers) for the formats whose ``dequantize`` takes them.

  Returns:
    ``[K, N]`` float32, or ``[..., K, N]`` for a stacked weight. No value is checked: a
    NaN or Inf scale gives NaN or Inf in its group / block of the result.

  Raises:
    TypeError: naming the type, when ``w`` is not a quantized weight (e.g. a plain array:
      it is already dense).

  >>> import jax, qjax
  >>> w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  >>> qjax.dequantize(w).shape, qjax.dequantize(w).dtype
  ((256, 64), dtype('float32'))
  """
  if not isinstance(w, formats.QuantizedWeight):
    raise TypeError(f"expected a quantized weight, got {type(w).__name__}")
  return w.dequantize()


# The formulation of matmul_xla: "auto" (int4_xla_variants.select: by M on a GPU, where
# it was measured; "materialize" elsewhere), "materialize", or a name in
# int4_xla_variants.VARIANTS. Read when matmul_xla is traced, so set it before the first
# call of a jitted function (a cached trace keeps the variant it was traced with).
XLA_VARIANT = "auto"


def matmul_xla(x: jax.Array, w: Int4Weight, variant: str | None = None) -> jax.Array:
  """Reference ``x [M, K] @ dequantize(w) [K, N] -> [M, N]`` in x's dtype, f32 accumulation.

  ``variant`` (default: the module's ``XLA_VARIANT``) picks the XLA formulation; see
  :mod:`qjax._src.int4_xla_variants`. All agree to within float rounding.
  """
  variant = XLA_VARIANT if variant is None else variant
  if variant != "materialize":
    from qjax._src import int4_xla_variants  # pylint: disable=g-import-not-at-top
    return int4_xla_variants.matmul(x, w, variant)
  return matmul_xla_materialize(x, w)


def matmul_xla_materialize(x: jax.Array, w: Int4Weight) -> jax.Array:
  """``matmul_xla`` by materializing the dequantized ``[K, N]`` W in x's dtype
  (:func:`dequantize_int4`), then ``jnp.dot``."""
  return formats.dense_dot(x, dequantize_int4(w, dtype=x.dtype))
