"""GGUF (llama.cpp) weight types as qjax pytrees, kept in the file's own block layout.

GGUF stores a weight used as ``y = x @ W`` as ``N`` rows of length ``K`` (numpy shape
``[N, K]``), each row a run of blocks along K. The classes here keep that storage order
(nothing is transposed at load): every block field is a typed view of the block bytes,
so a weight takes exactly the bytes it takes in the file. The logical shape is
``(K, N)`` as for every qjax format, and ``dequantize()`` returns ``[K, N]`` float32
equal bit for bit to ``gguf.quants.dequantize(raw, qtype).T``.

Bit-exactness does not depend on how XLA fuses the arithmetic: in every block type the
products (an f16 scale times small integers) are exact in float32, so at most one
rounding happens per value whether or not a multiply-add is contracted into an FMA.
MXFP4 values are assembled from their float32 bits (no arithmetic), which also keeps the
subnormals that XLA's CPU multiply would flush to zero.

This module needs numpy and jax only; reading files (and the ``gguf`` package) lives in
:mod:`qjax._src.gguf_io`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qjax._src import dispatch
from qjax._src import formats
from qjax._src import fp4
from qjax._src import int4
from qjax._src import packing

QK_K = 256


@dataclasses.dataclass(frozen=True)
class _Field:
  """One field of a block: ``nbytes`` bytes at ``offset``, viewed as ``dtype``.

  ``tail`` is the field's shape inside one block (``()`` for a scalar).
  """
  name: str
  offset: int
  nbytes: int
  dtype: Any
  tail: tuple[int, ...]


class GGUFBlockWeight(formats.QuantizedWeight):
  """Base of the GGUF block-quantized formats (logical shape ``[K, N]``).

  Subclasses declare ``ggml_type`` (the GGUF type name), ``block_size`` (weights per
  block), ``type_size`` (bytes per block) and ``block_fields`` (the block layout), and
  implement ``_rows_f32(**fields)``, the dequantization of stored rows.
  """

  ggml_type: ClassVar[str]
  block_size: ClassVar[int]
  type_size: ClassVar[int]
  block_fields: ClassVar[tuple[_Field, ...]]

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    if k % self.block_size:
      raise ValueError(
          f"{type(self).__name__}: K={k} (row length) must be a multiple of the "
          f"{self.ggml_type} block size {self.block_size}")
    if not self._leaves_concrete_2d():
      return
    nb = k // self.block_size
    leading = None
    for f in self.block_fields:
      a = getattr(self, f.name)
      want = (n, nb, *f.tail)
      got = tuple(a.shape[-len(want):]) if a.ndim >= len(want) else tuple(a.shape)
      if got != want or jnp.dtype(a.dtype) != jnp.dtype(f.dtype):
        raise ValueError(
            f"{type(self).__name__}.{f.name} must be {want} of dtype "
            f"{jnp.dtype(f.dtype).name}, got {tuple(a.shape)} {jnp.dtype(a.dtype).name} "
            f"(shape={self.shape})")
      lead = tuple(a.shape[:a.ndim - len(want)])
      if leading is not None and lead != leading:
        raise ValueError(
            f"{type(self).__name__}: the block fields have different leading axes "
            f"({leading} and {lead} on {f.name!r}); every field carries the same ones")
      leading = lead

  @property
  def num_blocks(self) -> int:
    """Blocks per stored row (``K // block_size``)."""
    return self.shape[0] // self.block_size

  @property
  def leading_axes(self) -> tuple[int, ...]:
    """The leading (expert) axes before the ``[N, K // block_size]`` block grid; ``()``
    for a single matrix."""
    f = self.block_fields[0]
    a = getattr(self, f.name)
    return tuple(a.shape[:a.ndim - 2 - len(f.tail)])

  @classmethod
  def row_bytes(cls, k: int) -> int:
    """Bytes of one stored row of ``k`` elements: ``k // block_size`` blocks of
    ``type_size`` bytes."""
    return k // cls.block_size * cls.type_size

  @classmethod
  def from_bytes(cls, raw: Any, shape: tuple[int, int], leading: tuple[int, ...] = ()):
    """The weight from its stored bytes.

    Args:
      raw: ``[*leading, N, K // block_size * type_size]`` uint8 (any buffer of that many
        bytes: a memory map, ``bytes``), the tensor's data as GGUF stores it.
      shape: the logical ``(K, N)`` (of each matrix when there are leading axes).
      leading: leading axes (experts) in numpy order, e.g. ``(E,)`` for a GGUF tensor of
        dims ``[K, N, E]``; every field then carries them first.

    Returns:
      The weight, its arrays on the default device.
    """
    fields = {k: jnp.asarray(v) for k, v in cls.split_blocks(raw, shape, leading).items()}
    return cls(**fields, shape=tuple(int(d) for d in shape))

  @classmethod
  def block_grid(cls, raw: Any, shape: tuple[int, int], leading: tuple[int, ...] = ()
                 ) -> np.ndarray:
    """Stored bytes as ``[*leading, N, K // block_size, type_size]`` uint8, a view (no
    copy of a contiguous buffer or memory map), after checking K and the byte count."""
    k, n = (int(d) for d in shape)
    leading = tuple(int(d) for d in leading)
    if k % cls.block_size:
      raise ValueError(
          f"{cls.__name__}: K={k} (row length) must be a multiple of the {cls.ggml_type} "
          f"block size {cls.block_size}")
    nb = k // cls.block_size
    rows = n * int(np.prod(leading, dtype=np.int64))
    raw = _as_bytes(raw)
    if raw.size != rows * nb * cls.type_size:
      what = f"{leading} x " if leading else ""
      raise ValueError(
          f"{cls.__name__} of shape {what}(K={k}, N={n}) needs {rows * nb * cls.type_size} "
          f"bytes, got {raw.size} (array shape {raw.shape})")
    return raw.reshape(*leading, n, nb, cls.type_size)

  @classmethod
  def split_blocks(cls, raw: Any, shape: tuple[int, int], leading: tuple[int, ...] = ()
                   ) -> dict[str, np.ndarray]:
    """Splits stored bytes into the numpy block fields (views of contiguous copies)."""
    blocks = cls.block_grid(raw, shape, leading)
    grid = blocks.shape[:-1]
    out = {}
    for f in cls.block_fields:
      part = np.ascontiguousarray(blocks[..., f.offset:f.offset + f.nbytes])
      out[f.name] = part.view(f.dtype).reshape(*grid, *f.tail)
    return out

  def to_bytes(self) -> np.ndarray:
    """``[*leading, N, K // block_size * type_size]`` uint8: the tensor's bytes as GGUF
    stores them."""
    k, n = self.shape
    nb = self.num_blocks
    lead = self.leading_axes
    parts = [np.asarray(getattr(self, f.name)).reshape(*lead, n, nb, -1).view(np.uint8)
             for f in self.block_fields]
    return np.concatenate(parts, axis=-1).reshape(*lead, n, nb * self.type_size)

  def _single_matrix(self, what: str) -> None:
    """Raises for a stack (leading axes): ``what`` converts one matrix."""
    if self.leading_axes:
      raise ValueError(f"{type(self).__name__}.{what} needs a single matrix; this one has "
                       f"leading axes {self.leading_axes} (an expert stack, which "
                       "qjax.moe_matmul takes as it is; index one matrix first)")

  def _fields(self) -> dict[str, jax.Array]:
    return {f.name: getattr(self, f.name) for f in self.block_fields}

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[*leading, K, N]`` in ``dtype``; in float32 (the default) bit-identical to
    ``gguf.quants.dequantize(...)`` with its last two axes swapped."""
    rows = self._rows_f32(**self._fields())  # [*leading, N, nb, block_size]
    k, n = self.shape
    return jnp.swapaxes(rows.reshape(*self.leading_axes, n, k), -1, -2).astype(dtype)

  def take_rows(self, ids: jax.Array) -> jax.Array:
    """Dequantized stored rows ``ids`` (columns of W): ``[*ids.shape, K]`` float32.

    Only the gathered rows are dequantized (token-embedding lookup).
    """
    if self.leading_axes:
      raise ValueError(f"take_rows needs a single matrix; this {type(self).__name__} has "
                       f"leading axes {self.leading_axes} (index one expert first)")
    ids = jnp.asarray(ids)
    fields = {name: jnp.take(a, ids, axis=0) for name, a in self._fields().items()}
    rows = self._rows_f32(**fields)
    return rows.reshape(*ids.shape, self.shape[0])

  @staticmethod
  def _rows_f32(**fields: jax.Array) -> jax.Array:  # pragma: no cover - abstract
    """``[..., nb, block_size]`` float32 from the fields of ``[..., nb]`` blocks."""
    raise NotImplementedError


def _as_bytes(raw: Any) -> np.ndarray:
  """A flat uint8 view of an array or buffer (a copy only if it is not contiguous)."""
  if isinstance(raw, (bytes, bytearray, memoryview)):
    return np.frombuffer(raw, np.uint8)
  a = np.ascontiguousarray(np.asarray(raw))
  return a.reshape(-1).view(np.uint8)


def _f32(a: jax.Array) -> jax.Array:
  return a.astype(jnp.float32)


def _nibbles(qs: jax.Array, groups: int) -> jax.Array:
  """``[..., groups * L]`` uint8 -> ``[..., groups, 2, L]``: low nibbles, then high."""
  q = qs.reshape(*qs.shape[:-1], groups, 1, qs.shape[-1] // groups)
  return (q >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)) & jnp.uint8(0x0F)


def _q4k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``[..., 12]`` uint8 packed 6-bit scales and mins -> two ``[..., 8]`` uint8."""
  s = scales.reshape(*scales.shape[:-1], 3, 4)
  d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
  sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
  mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc, mn


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFQ4_0(GGUFBlockWeight):
  """GGUF Q4_0 of logical shape ``[K, N]``: blocks of 32, ``w = d * (q - 8)``.

  Attributes:
    d: ``[N, K // 32]`` float16 block scales.
    qs: ``[N, K // 32, 16]`` uint8; byte ``j`` holds code ``j`` (low nibble) and code
      ``j + 16`` (high nibble) of the block.
    shape: the logical ``(K, N)``.
  """

  format_name = "gguf_q4_0"
  ggml_type = "Q4_0"
  block_size = 32
  type_size = 18
  block_fields = (_Field("d", 0, 2, np.float16, ()), _Field("qs", 2, 16, np.uint8, (16,)))

  d: jax.Array
  qs: jax.Array
  shape: tuple[int, int] = formats.static_field()

  @staticmethod
  def _codes(qs):
    """``[..., nb, 32]`` uint8 codes in ``[0, 15]``."""
    return _nibbles(qs, 1).reshape(*qs.shape[:-1], 32)

  @staticmethod
  def _rows_f32(d, qs):
    q = GGUFQ4_0._codes(qs).astype(jnp.int8) - jnp.int8(8)
    return _f32(d)[..., None] * _f32(q)

  def to_int4(self, tile_k: int = packing.NATIVE_TILE_K) -> int4.Int4Weight:
    """Lossless :class:`Int4Weight` (symmetric, group 32, f16 scales); jittable.

    An expert stack (leading axes, e.g. ``[E]``) gives the Int4Weight stack that
    ``qjax.moe_matmul``'s INT4 kernels read: codes ``[*leading, Kp // 8, N]``, scales
    ``[*leading, K // 32, N]``.
    """
    return int4.Int4Weight(
        codes=_int4_codes(self, tile_k), scales=jnp.swapaxes(self.d, -1, -2), zeros=None,
        shape=self.shape, group_size=32, tile_k=tile_k)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFQ4_1(GGUFBlockWeight):
  """GGUF Q4_1 of logical shape ``[K, N]``: blocks of 32, ``w = d * q + m``.

  Attributes:
    d: ``[N, K // 32]`` float16 block scales.
    m: ``[N, K // 32]`` float16 block minimums.
    qs: ``[N, K // 32, 16]`` uint8; byte ``j`` holds codes ``j`` (low nibble) and
      ``j + 16`` (high nibble).
    shape: the logical ``(K, N)``.
  """

  format_name = "gguf_q4_1"
  ggml_type = "Q4_1"
  block_size = 32
  type_size = 20
  block_fields = (_Field("d", 0, 2, np.float16, ()), _Field("m", 2, 2, np.float16, ()),
                  _Field("qs", 4, 16, np.uint8, (16,)))

  d: jax.Array
  m: jax.Array
  qs: jax.Array
  shape: tuple[int, int] = formats.static_field()

  @staticmethod
  def _rows_f32(d, m, qs):
    q = _f32(GGUFQ4_0._codes(qs))
    return (_f32(d)[..., None] * q) + _f32(m)[..., None]

  def to_int4(self, tile_k: int = packing.NATIVE_TILE_K) -> int4.Int4Weight:
    """Lossless :class:`Int4Weight` with ``W = q * s + b`` (f16 scales and biases);
    jittable. An expert stack gives an Int4Weight stack, as :meth:`GGUFQ4_0.to_int4`."""
    return int4.Int4Weight(
        codes=_int4_codes(self, tile_k), scales=jnp.swapaxes(self.d, -1, -2), zeros=None,
        biases=jnp.swapaxes(self.m, -1, -2), shape=self.shape, group_size=32,
        tile_k=tile_k)


def _int4_codes(w: GGUFQ4_0 | GGUFQ4_1, tile_k: int) -> jax.Array:
  """``[*leading, Kp // 8, N]`` uint32: the 4-bit codes of a Q4_0 / Q4_1 weight (or stack)
  packed in tile order ``tile_k``, the stored rows (columns of W) transposed to K-major."""
  k, n = w.shape
  codes = GGUFQ4_0._codes(w.qs).reshape(*w.leading_axes, n, k)  # pylint: disable=protected-access
  return packing.pack_codes(jnp.swapaxes(codes, -1, -2), tile_k)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFQ8_0(GGUFBlockWeight):
  """GGUF Q8_0 of logical shape ``[K, N]``: blocks of 32, ``w = d * q``.

  Attributes:
    d: ``[N, K // 32]`` float16 block scales.
    qs: ``[N, K // 32, 32]`` int8 codes.
    shape: the logical ``(K, N)``.
  """

  format_name = "gguf_q8_0"
  ggml_type = "Q8_0"
  block_size = 32
  type_size = 34
  block_fields = (_Field("d", 0, 2, np.float16, ()), _Field("qs", 2, 32, np.int8, (32,)))

  d: jax.Array
  qs: jax.Array
  shape: tuple[int, int] = formats.static_field()

  @staticmethod
  def _rows_f32(d, qs):
    return _f32(qs) * _f32(d)[..., None]


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFQ4_K(GGUFBlockWeight):
  """GGUF Q4_K of logical shape ``[K, N]``: superblocks of 256 in 8 sub-blocks of 32.

  ``w = d * sc[j] * q - dmin * mn[j]`` with 6-bit sub-block scales and mins.

  Attributes:
    d: ``[N, K // 256]`` float16 superblock scales.
    dmin: ``[N, K // 256]`` float16 superblock min scales.
    scales: ``[N, K // 256, 12]`` uint8, 8 scales and 8 mins packed at 6 bits.
    qs: ``[N, K // 256, 128]`` uint8 4-bit codes; 32-byte chunk ``c`` holds sub-blocks
      ``2c`` (low nibbles) and ``2c + 1`` (high nibbles).
    shape: the logical ``(K, N)``.
  """

  format_name = "gguf_q4_k"
  ggml_type = "Q4_K"
  block_size = QK_K
  type_size = 144
  block_fields = (_Field("d", 0, 2, np.float16, ()), _Field("dmin", 2, 2, np.float16, ()),
                  _Field("scales", 4, 12, np.uint8, (12,)),
                  _Field("qs", 16, 128, np.uint8, (128,)))

  d: jax.Array
  dmin: jax.Array
  scales: jax.Array
  qs: jax.Array
  shape: tuple[int, int] = formats.static_field()

  @staticmethod
  def _codes(qs):
    """``[..., nb, 256]`` uint8 codes in ``[0, 15]``."""
    return _nibbles(qs, 4).reshape(*qs.shape[:-1], QK_K)

  def codes(self) -> jax.Array:
    """``[N, K // 256, 256]`` uint8 codes in ``[0, 15]`` (storage order)."""
    return self._codes(self.qs)

  @staticmethod
  def _rows_f32(d, dmin, scales, qs):
    sc, mn = _q4k_scale_min(scales)
    dl = (_f32(d)[..., None] * _f32(sc))[..., None]  # [..., 8, 1]
    ml = (_f32(dmin)[..., None] * _f32(mn))[..., None]
    q = _f32(GGUFQ4_K._codes(qs).reshape(*qs.shape[:-1], 8, 32))
    return (dl * q - ml).reshape(*qs.shape[:-1], QK_K)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFQ5_K(GGUFBlockWeight):
  """GGUF Q5_K of logical shape ``[K, N]``: as Q4_K with a fifth bit per code.

  Attributes:
    d: ``[N, K // 256]`` float16 superblock scales.
    dmin: ``[N, K // 256]`` float16 superblock min scales.
    scales: ``[N, K // 256, 12]`` uint8, 8 scales and 8 mins packed at 6 bits.
    qh: ``[N, K // 256, 32]`` uint8; bit ``j`` of byte ``i`` is the high bit of code
      ``i`` of sub-block ``j``.
    qs: ``[N, K // 256, 128]`` uint8 low 4 bits, laid out as Q4_K's.
    shape: the logical ``(K, N)``.
  """

  format_name = "gguf_q5_k"
  ggml_type = "Q5_K"
  block_size = QK_K
  type_size = 176
  block_fields = (_Field("d", 0, 2, np.float16, ()), _Field("dmin", 2, 2, np.float16, ()),
                  _Field("scales", 4, 12, np.uint8, (12,)),
                  _Field("qh", 16, 32, np.uint8, (32,)),
                  _Field("qs", 48, 128, np.uint8, (128,)))

  d: jax.Array
  dmin: jax.Array
  scales: jax.Array
  qh: jax.Array
  qs: jax.Array
  shape: tuple[int, int] = formats.static_field()

  @staticmethod
  def _codes(qh, qs):
    """``[..., nb, 256]`` uint8 codes in ``[0, 31]``."""
    lead = qs.shape[:-1]
    ql = _nibbles(qs, 4).reshape(*lead, 8, 32)
    hi = (qh[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & jnp.uint8(1)
    return (ql | (hi << jnp.uint8(4))).reshape(*lead, QK_K)

  def codes(self) -> jax.Array:
    """``[N, K // 256, 256]`` uint8 codes in ``[0, 31]`` (storage order)."""
    return self._codes(self.qh, self.qs)

  @staticmethod
  def _rows_f32(d, dmin, scales, qh, qs):
    lead = qs.shape[:-1]
    sc, mn = _q4k_scale_min(scales)
    dl = (_f32(d)[..., None] * _f32(sc))[..., None]
    ml = (_f32(dmin)[..., None] * _f32(mn))[..., None]
    q = _f32(GGUFQ5_K._codes(qh, qs).reshape(*lead, 8, 32))
    return (dl * q - ml).reshape(*lead, QK_K)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFQ6_K(GGUFBlockWeight):
  """GGUF Q6_K of logical shape ``[K, N]``: superblocks of 256 in 16 sub-blocks of 16.

  ``w = d * scales[j] * (q - 32)`` with 6-bit codes ``q``.

  Attributes:
    ql: ``[N, K // 256, 128]`` uint8 low 4 bits of the codes.
    qh: ``[N, K // 256, 64]`` uint8 high 2 bits of the codes, 4 per byte.
    scales: ``[N, K // 256, 16]`` int8 sub-block scales.
    d: ``[N, K // 256]`` float16 superblock scales.
    shape: the logical ``(K, N)``.
  """

  format_name = "gguf_q6_k"
  ggml_type = "Q6_K"
  block_size = QK_K
  type_size = 210
  block_fields = (_Field("ql", 0, 128, np.uint8, (128,)), _Field("qh", 128, 64, np.uint8, (64,)),
                  _Field("scales", 192, 16, np.int8, (16,)),
                  _Field("d", 208, 2, np.float16, ()))

  ql: jax.Array
  qh: jax.Array
  scales: jax.Array
  d: jax.Array
  shape: tuple[int, int] = formats.static_field()

  @staticmethod
  def _codes(ql, qh):
    """``[..., nb, 256]`` uint8 codes in ``[0, 63]`` (``w = d * sc * (q - 32)``)."""
    lead = ql.shape[:-1]
    lo = _nibbles(ql, 2).reshape(*lead, 8, 32)
    h = qh.reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
    h = (h & jnp.uint8(3)).reshape(*lead, 8, 32)
    return (lo | (h << jnp.uint8(4))).reshape(*lead, QK_K)

  def codes(self) -> jax.Array:
    """``[N, K // 256, 256]`` uint8 codes in ``[0, 63]`` (storage order)."""
    return self._codes(self.ql, self.qh)

  @staticmethod
  def _rows_f32(ql, qh, scales, d):
    lead = ql.shape[:-1]
    dd = (_f32(d)[..., None] * _f32(scales))[..., None]  # [..., 16, 1]
    q = GGUFQ6_K._codes(ql, qh).astype(jnp.int8) - jnp.int8(32)
    q = _f32(q.reshape(*lead, 16, 16))
    return (dd * q).reshape(*lead, QK_K)


def _mxfp4_bits(e: jax.Array, codes: jax.Array) -> jax.Array:
  """float32 bits of ``kvalue[code] * 2 ** (e - 128)``, built from integers.

  ``e``: ``[..., 1]`` uint8; ``codes``: ``[..., B]`` uint8 in ``[0, 15]``. A doubled E2M1
  magnitude ``kvalue`` (``0, 1, 2, 3, 4, 6, 8, 12`` by the low three code bits) is ``f *
  2 ** p`` with ``p = i >> 1`` and ``f = 1.5`` for ``i`` in ``{3, 5, 7}``, else 1, so
  the value is ``f * 2 ** E`` with ``E = p + e - 128`` in ``[-128, 130]``: a normal float
  for ``-126 <= E <= 127``, a subnormal below (``(2 or 3) << (E + 148)`` ulps), infinity
  above. gguf multiplies in float32 and rounds nothing (every product is exact or
  overflows), so these are its bits; XLA, which flushes subnormal products to zero on the
  CPU, never multiplies here.
  """
  i = (codes & 7).astype(jnp.int32)
  big = ((i & 1) == 1) & (i > 1)                              # f = 1.5
  exp = (i >> 1) + e.astype(jnp.int32) - 128                  # E
  normal = ((jnp.clip(exp, -126, 127) + 127) << 23) | (big.astype(jnp.int32) << 22)
  sub = (2 + big.astype(jnp.int32)) << jnp.clip(exp + 148, 0, 31)
  mag = jnp.where(exp > 127, 0x7F800000, jnp.where(exp < -126, sub, normal))
  mag = jnp.where(i == 0, 0, mag).astype(jnp.uint32)
  sign = jnp.where((i != 0) & ((codes & 8) != 0), jnp.uint32(0x80000000), jnp.uint32(0))
  return jax.lax.bitcast_convert_type(mag | sign, jnp.float32)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFMXFP4(GGUFBlockWeight):
  """GGUF MXFP4 of logical shape ``[K, N]``: blocks of 32 E2M1 codes, one E8M0 byte.

  gguf (``gguf.quants.MXFP4``, ggml's ``block_mxfp4``) decodes a code with the doubled
  E2M1 table ``kvalues = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12)`` times the half scale
  ``2 ** (e - 128)`` (``ggml_e8m0_to_fp32_half``). The factors of 2 cancel:
  ``w = e2m1(q) * 2 ** (e - 127)``, OCP MXFP4's decoding of the same code and byte,
  except that gguf gives ``-0`` (code 8) as ``+0`` and ``e = 255`` as ``2 ** 127`` (OCP:
  NaN). :meth:`to_mxfp4` keeps the codes and bytes and folds those two cases exactly.

  Attributes:
    e: ``[N, K // 32]`` uint8 E8M0 biased exponents.
    qs: ``[N, K // 32, 16]`` uint8; byte ``j`` holds code ``j`` (low nibble) and code
      ``j + 16`` (high nibble) of the block, as Q4_0.
    shape: the logical ``(K, N)``.

  Leading (expert) axes may precede both fields (``e [E, N, K // 32]``, ``qs [E, N,
  K // 32, 16]``: a GGUF ``[K, N, E]`` tensor such as GPT-OSS's ``ffn_*_exps``); ``shape``
  stays the per-expert ``(K, N)``, :meth:`dequantize` gives ``[E, K, N]`` and
  :meth:`to_mxfp4` the stacked weight (codes ``[E, Kp // 8, N]``, scales ``[E, K // 32,
  N]``) that :func:`qjax.moe_matmul` takes.
  """

  format_name = "gguf_mxfp4"
  ggml_type = "MXFP4"
  block_size = fp4.MXFP4_BLOCK
  type_size = 17
  block_fields = (_Field("e", 0, 1, np.uint8, ()), _Field("qs", 1, 16, np.uint8, (16,)))

  e: jax.Array
  qs: jax.Array
  shape: tuple[int, int] = formats.static_field()

  def codes(self) -> jax.Array:
    """``[N, K // 32, 32]`` uint8 E2M1 codes in ``[0, 15]`` (storage order)."""
    return GGUFQ4_0._codes(self.qs)

  @staticmethod
  def _rows_f32(e, qs):
    return _mxfp4_bits(e[..., None], GGUFQ4_0._codes(qs))

  def to_mxfp4(self, tile_k: int = packing.NATIVE_TILE_K) -> fp4.MXFP4Weight:
    """The same values as :class:`~qjax._src.fp4.MXFP4Weight` (jittable).

    Codes and scale bytes are kept, except: code 8 (gguf decodes it as ``+0``) becomes
    code 0, and a block with ``e = 255`` (``2 ** 127`` in gguf, NaN in OCP; llama.cpp's
    quantizer writes at most 252) becomes ``e = 254`` with doubled values: gguf's
    ``+-1 * 2 ** 127`` is ``e2m1(+-1.0) * 2 ** 127`` and its larger values overflow to
    ``+-inf`` as ``e2m1(+-2.0) * 2 ** 127`` does. ``to_mxfp4().dequantize()`` then
    equals :meth:`dequantize` bit for bit for every scale byte from 2 up (bytes 0 and 1
    give a subnormal scale or subnormal products, which XLA flushes to zero on the CPU).
    """
    k, n = self.shape
    lead = self.leading_axes
    codes = self.codes()                                     # [*leading, N, nb, 32]
    top = (self.e == 255)[..., None]
    i = codes & jnp.uint8(7)
    doubled = jnp.where(i == 0, 0, jnp.where(i == 1, 2, 4)).astype(jnp.uint8)
    codes = jnp.where(top, doubled | (codes & jnp.uint8(8)), codes)
    codes = jnp.where(codes == 8, jnp.uint8(0), codes)
    scales = jnp.where(self.e == 255, jnp.uint8(254), self.e)
    codes = jnp.swapaxes(codes.reshape(*lead, n, k), -1, -2)  # [*leading, K, N]
    return fp4.MXFP4Weight(codes=packing.pack_codes(codes, tile_k),
                           scales=jnp.swapaxes(scales, -1, -2), shape=(k, n), tile_k=tile_k)


_DENSE_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFDense(formats.QuantizedWeight):
  """A GGUF F32, F16 or BF16 matrix of logical shape ``[K, N]``, stored as in the file.

  Attributes:
    data: ``[*leading, N, K]`` float32, float16 or bfloat16 (``W = data.T``; leading
      axes for a stack of matrices, e.g. ``[E, N, K]`` for MoE experts).
    shape: the logical ``(K, N)`` (of each matrix).
  """

  format_name = "gguf_dense"

  data: jax.Array
  shape: tuple[int, int] = formats.static_field()

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    if not self._leaves_concrete_2d():
      return
    k, n = self.shape
    dtypes = [jnp.dtype(d) for d in _DENSE_TYPES.values()]
    if tuple(self.data.shape[-2:]) != (n, k) or jnp.dtype(self.data.dtype) not in dtypes:
      raise ValueError(
          f"GGUFDense.data must be [N, K] = {(n, k)} of dtype float32, float16 or "
          f"bfloat16, got {tuple(self.data.shape)} {jnp.dtype(self.data.dtype).name} "
          f"(shape={self.shape})")

  @property
  def leading_axes(self) -> tuple[int, ...]:
    """The leading (expert) axes before ``[N, K]``; ``()`` for a single matrix."""
    return tuple(self.data.shape[:-2])

  @property
  def ggml_type(self) -> str:
    """The GGUF type name of ``data``'s dtype: "F32", "F16" or "BF16"."""
    return {jnp.dtype(v): k for k, v in _DENSE_TYPES.items()}[jnp.dtype(self.data.dtype)]

  @classmethod
  def from_bytes(cls, raw: Any, shape: tuple[int, int], ggml_type: str,
                 leading: tuple[int, ...] = ()) -> "GGUFDense":
    """From the stored ``[*leading, N, K]`` elements (or their bytes) of type F32, F16 or
    BF16; ``leading`` as :meth:`GGUFBlockWeight.from_bytes`."""
    if ggml_type not in _DENSE_TYPES:
      raise ValueError(f"{ggml_type=} must be one of {sorted(_DENSE_TYPES)}")
    k, n = (int(d) for d in shape)
    leading = tuple(int(d) for d in leading)
    count = k * n * int(np.prod(leading, dtype=np.int64))
    a = _as_bytes(raw).view(_DENSE_TYPES[ggml_type])
    if a.size != count:
      what = f"{leading} x " if leading else ""
      raise ValueError(f"GGUFDense of shape {what}(K={k}, N={n}) needs {count} {ggml_type} "
                       f"values, got {a.size}")
    return cls(data=jnp.asarray(a.reshape(*leading, n, k)), shape=(k, n))

  def to_bytes(self) -> np.ndarray:
    """``[*leading, N, K * itemsize]`` uint8: the tensor's bytes as GGUF stores them."""
    return np.asarray(self.data).view(np.uint8)

  @staticmethod
  def _rows_f32(data: jax.Array, ids: jax.Array | None = None) -> jax.Array:
    """Rows ``ids`` (all rows if None) of ``data`` in float32."""
    if jnp.dtype(data.dtype) == jnp.dtype(jnp.bfloat16):
      # As gguf: the 16 bits become the high half of a float32. Gathering the bits rather
      # than the bf16 values keeps NaN payloads bit for bit.
      bits = jax.lax.bitcast_convert_type(data, jnp.uint16)
      if ids is not None:
        bits = jnp.take(bits, ids, axis=0)
      return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)
    if ids is not None:
      data = jnp.take(data, ids, axis=0)
    return data.astype(jnp.float32)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[*leading, K, N]`` in ``dtype`` (float32 by default)."""
    return jnp.swapaxes(self._rows_f32(self.data), -1, -2).astype(dtype)

  def take_rows(self, ids: jax.Array) -> jax.Array:
    """Stored rows ``ids`` (columns of W): ``[*ids.shape, K]`` float32."""
    if self.leading_axes:
      raise ValueError(f"take_rows needs a single matrix; this GGUFDense has leading axes "
                       f"{self.leading_axes} (index one expert first)")
    return self._rows_f32(self.data, jnp.asarray(ids))


BLOCK_FORMATS: dict[str, type[GGUFBlockWeight]] = {
    cls.ggml_type: cls
    for cls in (GGUFQ4_0, GGUFQ4_1, GGUFQ8_0, GGUFQ4_K, GGUFQ5_K, GGUFQ6_K, GGUFMXFP4)}
"""GGUF type name -> block format class."""

DENSE_TYPES = tuple(_DENSE_TYPES)
SUPPORTED_TYPES = (*BLOCK_FORMATS, *DENSE_TYPES)


def from_gguf_bytes(raw: Any, ggml_type: str, shape: tuple[int, int],
                    leading: tuple[int, ...] = ()):
  """The qjax pytree of a 2-D GGUF tensor (or a stack of them, see ``leading``).

  Args:
    raw: the tensor's stored data (``[*leading, N, row_bytes]`` uint8 for block types,
      ``[*leading, N, K]`` elements or their bytes for F32 / F16 / BF16).
    ggml_type: the GGUF type name, e.g. "Q4_K".
    shape: the logical ``(K, N)`` (GGUF's ``ne0, ne1``).
    leading: leading axes in numpy order (GGUF's ``ne3, ne2``; ``(E,)`` for the MoE
      experts of a ``[K, N, E]`` tensor).
  """
  if ggml_type in BLOCK_FORMATS:
    return BLOCK_FORMATS[ggml_type].from_bytes(raw, shape, leading)
  if ggml_type in _DENSE_TYPES:
    return GGUFDense.from_bytes(raw, shape, ggml_type, leading)
  raise ValueError(f"GGUF type {ggml_type} is not supported; supported: {list(SUPPORTED_TYPES)}")


def embedding_rows(w: Any, ids: jax.Array) -> jax.Array:
  """Rows ``ids`` of an embedding table stored as ``W [K=hidden, N=vocab]``.

  Args:
    w: a GGUF format pytree (only the gathered rows are dequantized), another quantized
      weight (dequantized whole), or a plain ``[N, K]`` array as GGUF stores it.
    ids: integer token ids of any shape.

  Returns:
    ``[*ids.shape, K]`` float32.
  """
  ids = jnp.asarray(ids)
  if hasattr(w, "take_rows"):
    return w.take_rows(ids)
  if isinstance(w, formats.QuantizedWeight):
    return jnp.take(w.dequantize().T, ids, axis=0)
  return jnp.take(jnp.asarray(w), ids, axis=0).astype(jnp.float32)


def matmul_xla(x: jax.Array, w: Any) -> jax.Array:
  """``x [M, K] @ dequantize(w) [K, N] -> [M, N]`` in x's dtype, f32 accumulation."""
  return formats.dense_dot(x, w.dequantize())


for _cls in (*BLOCK_FORMATS.values(), GGUFDense):
  dispatch.register_xla(_cls, matmul_xla)
del _cls
# MXFP4 runs the FP4 kernels after its lossless to_mxfp4 (per call; convert once at load
# with gguf_tiled.kernel_layout where speed matters).
dispatch.register_repack(GGUFMXFP4, fp4.MXFP4Weight, lambda x, w: (x, w.to_mxfp4()))
