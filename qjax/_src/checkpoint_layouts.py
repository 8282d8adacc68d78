"""INT4 checkpoint layouts of GPTQ, AWQ and compressed-tensors, kept as stored.

Every class here is a pytree of logical shape ``[K, N]`` (``y = x @ W``) holding the
tensors exactly as the checkpoint stores them (int32 words, nothing repacked at load).
Each one has:

* ``unpack() -> (codes, scales, zeros, g_idx)``: ``codes [K, N]`` uint8 in ``[0, 15]``,
  ``scales [K // G, N]`` in the stored float dtype, ``zeros [K // G, N]`` uint8 (the
  effective zero point) or None (meaning 8), ``g_idx [K]`` int32 or None (meaning
  ``k // G``). In every layout ``W[k, n] = (codes[k, n] - zeros[g, n]) * scales[g, n]``
  with ``g = g_idx[k]``.
* ``dequantize() -> [K, N]`` float32 (jittable), computed as
  ``(float32(q) - float32(z)) * float32(s)``: the same arithmetic as
  :func:`qjax._src.int4.dequantize_int4`, so ``to_int4()`` is bit-exact.
* ``to_int4(tile_k)``: the lossless :class:`~qjax._src.int4.Int4Weight`.
* ``from_int4(w)``: the inverse packer (for tests and for writing checkpoints).

Conventions implemented (per the reference packers):

* GPTQ (AutoGPTQ / GPTQModel): ``qweight [K // 8, N]`` int32, nibble ``i`` (bits
  ``4i..4i+3``) of word ``r`` holds row ``8r + i``; ``qzeros [K // G, N // 8]`` int32,
  nibble ``i`` of word ``c`` holds column ``8c + i``. ``zero_point_version=1`` (AutoGPTQ's
  v1 format) stores ``z - 1`` (so the effective zero is ``nibble + 1``, in ``[1, 16]``);
  ``zero_point_version=2`` (GPTQModel's v2) stores ``z``.
* AWQ (AutoAWQ GEMM): ``qweight [K, N // 8]`` int32; nibble ``i`` of word ``c`` holds
  column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (unpacking
  reads column ``j`` from nibble ``AWQ_REVERSE_ORDER[j]``, ``[0, 4, 1, 5, 2, 6, 3, 7]``);
  ``qzeros [K // G, N // 8]`` int32 in the same order, stored as is.
* compressed-tensors ``pack-quantized`` (int4): ``weight_packed [N, K // 8]`` int32,
  nibble ``i`` of word ``j`` holds ``k = 8j + i``; values are signed int4 ``v`` in
  ``[-8, 7]`` stored in offset binary ``v + 8``. ``W = (v - zp) * scale`` with
  ``zp = 0`` when there is no ``weight_zero_point``. Asymmetric zero points, as
  compressed-tensors writes them since its zero-point packing (PR #296, April 2025;
  ``pack_to_int32(zero_point, num_bits, packed_dim=0)`` in
  ``compressors/quantized_compressors/pack_quantized.py``), are int32
  ``[ceil(N / 8), K // G]`` packed along the *output* axis: nibble ``i`` of word
  ``[r, g]`` holds ``zp[8r + i, g] + 8``, padding nibbles 0. The unpacked int8
  ``[N, K // G]`` form (earlier versions, in-memory) is accepted too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import dispatch
from qjax._src import formats
from qjax._src import int4
from qjax._src import packing

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

_SHIFTS = tuple(4 * i for i in range(8))


# ------------------------------------------------------------------------------ helpers


def _is_concrete(*arrays: Any) -> bool:
  return all(a is None or not isinstance(a, jax.core.Tracer) for a in arrays)


def _as_u32(words: jax.Array) -> jax.Array:
  """int32 words -> the same bits as uint32 (no sign issues when shifting)."""
  return jax.lax.bitcast_convert_type(jnp.asarray(words), jnp.uint32)


def _nibbles_last(words: jax.Array) -> jax.Array:
  """``[..., W]`` int32 -> ``[..., W, 8]`` uint8: nibble ``i`` at index ``i``."""
  w = _as_u32(words)[..., None]
  shifts = jnp.asarray(_SHIFTS, jnp.uint32)
  return ((w >> shifts) & jnp.uint32(0xF)).astype(jnp.uint8)


def _pack_last(nibbles: jax.Array) -> jax.Array:
  """``[..., W, 8]`` integers in ``[0, 15]`` -> ``[..., W]`` int32, index ``i`` at nibble ``i``."""
  v = jnp.asarray(nibbles).astype(jnp.uint32) << jnp.asarray(_SHIFTS, jnp.uint32)
  words = v.sum(axis=-1, dtype=jnp.uint32)  # disjoint nibbles: sum == or
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def _pack_rows(codes: jax.Array) -> jax.Array:
  """``[K, N]`` codes -> ``[K // 8, N]`` int32, 8 rows per word, low nibble first."""
  k, n = codes.shape
  return _pack_last(jnp.asarray(codes).reshape(k // 8, 8, n).transpose(0, 2, 1))


def _unpack_rows(words: jax.Array) -> jax.Array:
  """Inverse of :func:`_pack_rows`: ``[K // 8, N]`` int32 -> ``[K, N]`` uint8."""
  kw, n = words.shape
  return _nibbles_last(words).transpose(0, 2, 1).reshape(kw * 8, n)


@functools.partial(jax.jit, static_argnames=("tile_k",))
def _rows_in_tile_order(qweight: jax.Array, perm: jax.Array | None, tile_k: int) -> jax.Array:
  """GPTQ's ``qweight [K // 8, N]`` int32 (row ``8r + i`` at nibble ``i`` of word ``r``),
  rows permuted by ``perm [K]`` (None: as they are), as :class:`Int4Weight` codes in tile
  order ``tile_k``: one compiled program per shape."""
  codes = _unpack_rows(qweight)
  if perm is not None:
    codes = jnp.take(codes, perm, axis=0)
  return packing.pack_codes(codes, tile_k)


def _pack_cols(a: jax.Array) -> jax.Array:
  """``[R, N]`` values -> ``[R, N // 8]`` int32, 8 columns per word, low nibble first."""
  r, n = a.shape
  return _pack_last(jnp.asarray(a).reshape(r, n // 8, 8))


def _unpack_cols(words: jax.Array) -> jax.Array:
  """Inverse of :func:`_pack_cols`: ``[..., R, N // 8]`` int32 -> ``[..., R, N]`` uint8
  (leading axes: stacks of layers or experts)."""
  return _nibbles_last(words).reshape(*words.shape[:-1], words.shape[-1] * 8)


def _dequant(codes, scales, zeros, group_of_row) -> jax.Array:
  """``(f32(q) - f32(z)) * f32(s)`` with group rows gathered by ``group_of_row [K]``.

  ``zeros=None`` means 8. The arithmetic matches :func:`int4.dequantize_int4`.
  """
  q = codes.astype(jnp.float32)
  s = jnp.take(scales.astype(jnp.float32), group_of_row, axis=0)
  z = jnp.float32(8) if zeros is None else jnp.take(
      zeros.astype(jnp.float32), group_of_row, axis=0)
  return (q - z) * s


def _contiguous_groups(k: int, group_size: int) -> jax.Array:
  return jnp.arange(k, dtype=jnp.int32) // group_size


def _check_array(cls_name: str, name: str, a: Any, shape: tuple[int, ...], dtypes,
                 context: str) -> None:
  dts = [jnp.dtype(d) for d in dtypes]
  # Trailing dims only: layers stacked along leading axes (nn.scan) keep their shapes.
  if tuple(a.shape[a.ndim - len(shape):]) != tuple(shape) or jnp.dtype(a.dtype) not in dts:
    raise ValueError(
        f"{cls_name}.{name} must be {tuple(shape)} of dtype {[d.name for d in dts]}, got "
        f"{tuple(a.shape)} {jnp.dtype(a.dtype).name} ({context})")


def _check_logical(cls_name: str, k: int, n: int, group_size: int) -> None:
  if k <= 0 or n <= 0:
    raise ValueError(f"{cls_name}: shape (K={k}, N={n}) must be positive")
  if k % 8:
    raise ValueError(f"{cls_name}: K={k} must be a multiple of 8 (8 codes per int32 word)")
  if group_size <= 0 or k % group_size:
    raise ValueError(f"{cls_name}: K={k} must be a multiple of group_size={group_size}")


def _int4_parts(w: int4.Int4Weight, who: str):
  """``(codes [K, N] uint8, scales, zeros or None)`` of an Int4Weight; rejects biases."""
  if not isinstance(w, int4.Int4Weight):
    raise TypeError(f"{who} expects an Int4Weight, got {type(w).__name__}")
  if w.biases is not None:
    raise ValueError(
        f"{who}: Int4Weight with float biases (W = q * s + b) has no integer zero point "
        "and cannot be stored in this layout")
  return w.unpacked_codes(), w.scales, w.zeros


def _check_zero_range(z: jax.Array, lo: int, hi: int, what: str) -> None:
  if not _is_concrete(z):
    return
  a = np.asarray(z).astype(np.int64)
  bad = (a < lo) | (a > hi)
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{what}: {int(bad.sum())} zero points outside [{lo}, {hi}] (first at group/column "
        f"{idx}: {a[idx]})")


# --------------------------------------------------------------------------------- GPTQ


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GPTQWeight(formats.QuantizedWeight):
  """GPTQ (AutoGPTQ / GPTQModel) 4-bit weight of logical shape ``[K, N]``, as stored.

  ``W[k, n] = (q[k, n] - z[g, n]) * scales[g, n]`` with ``g = g_idx[k]`` (or ``k // G``
  without ``g_idx``) and ``z = nibble + 1`` (v1) or ``z = nibble`` (v2).

  Attributes:
    qweight: ``[K // 8, N]`` int32; nibble ``i`` of word ``r`` holds row ``8r + i``.
    qzeros: ``[K // G, N // 8]`` int32; nibble ``i`` of word ``c`` holds column ``8c + i``.
    scales: ``[K // G, N]`` float16 (bf16 / f32 also accepted).
    g_idx: ``[K]`` int32 group of each row (act-order / desc_act), or None.
    shape: the logical ``(K, N)``.
    group_size: ``G``; -1 (per-channel) is stored as K.
    zero_point_version: 1 (stored ``z - 1``, AutoGPTQ) or 2 (stored ``z``, GPTQModel).
    symmetric: the checkpoint's ``sym`` flag; qzeros are still stored (8 in v2, 7 in v1).
      Only ``to_int4`` uses it (to emit a symmetric Int4Weight, without the zeros);
      dequantization always reads the stored zeros. Checked against them when the arrays
      are concrete (a ValueError names the first zero point that is not 8), so that a
      weight built outside ``jit`` agrees with its flag wherever ``to_int4`` runs.
  """

  format_name = "gptq"

  qweight: jax.Array
  qzeros: jax.Array
  scales: jax.Array
  g_idx: jax.Array | None
  shape: tuple[int, int] = formats.static_field()
  group_size: int = formats.static_field()
  zero_point_version: int = formats.static_field(default=2)
  symmetric: bool = formats.static_field(default=False)

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    gs = k if int(self.group_size) == -1 else int(self.group_size)
    object.__setattr__(self, "group_size", gs)
    object.__setattr__(self, "symmetric", bool(self.symmetric))
    if self.zero_point_version not in (1, 2):
      raise ValueError(
          f"GPTQWeight: zero_point_version={self.zero_point_version!r} must be 1 (AutoGPTQ, "
          "stored z - 1) or 2 (GPTQModel, stored z)")
    _check_logical("GPTQWeight", k, n, gs)
    if n % 8:
      raise ValueError(f"GPTQWeight: N={n} must be a multiple of 8 (qzeros pack 8 columns)")
    if not self._leaves_concrete_2d():
      return
    ctx = f"shape={self.shape}, group_size={gs}"
    _check_array("GPTQWeight", "qweight", self.qweight, (k // 8, n), (jnp.int32,), ctx)
    _check_array("GPTQWeight", "qzeros", self.qzeros, (k // gs, n // 8), (jnp.int32,), ctx)
    _check_array("GPTQWeight", "scales", self.scales, (k // gs, n), int4.SCALE_DTYPES, ctx)
    if self.symmetric and _is_concrete(self.qzeros):  # (stacks too: leading axes)
      zs = np.asarray(self._zeros())
      if (zs != 8).any():
        idx = tuple(int(i) for i in np.argwhere(zs != 8)[0])
        raise ValueError(
            f"GPTQWeight: symmetric=True but the effective zero point at group/column {idx} "
            f"is {int(zs[idx])}, not 8 (zero_point_version={self.zero_point_version}); the "
            "stored zeros disagree with the symmetric flag (quantization_config sym=true, "
            "which is also GPTQ's default where config.json omits it): construct the "
            "GPTQWeight with symmetric=False (config.json: \"sym\": false), or check "
            "checkpoint_format (v1 stores z - 1, gptq_v2 stores z)")
    if self.g_idx is not None:
      _check_array("GPTQWeight", "g_idx", self.g_idx, (k,), (jnp.int32,), ctx)
      if _is_concrete(self.g_idx):
        gi = np.asarray(self.g_idx)
        bad = (gi < 0) | (gi >= k // gs)
        if bad.any():
          i = int(np.argwhere(bad)[0, 0])
          raise ValueError(
              f"GPTQWeight.g_idx[{i}]={int(gi[i])} is outside [0, {k // gs}) "
              f"(K // group_size groups, {ctx})")

  @property
  def num_groups(self) -> int:
    """Quantization groups along K: ``K // group_size``."""
    return self.shape[0] // self.group_size

  def _group_of_row(self) -> jax.Array:
    if self.g_idx is None:
      return _contiguous_groups(self.shape[0], self.group_size)
    return self.g_idx

  def unpack(self):
    """``(codes [K, N] uint8, scales [K // G, N], zeros [K // G, N] uint8, g_idx or None)``.

    ``zeros`` are the effective zero points (``nibble + 1`` for v1, so up to 16).
    """
    return _unpack_rows(self.qweight), self.scales, self._zeros(), self.g_idx

  def _zeros(self) -> jax.Array:
    """The effective zero points ``[..., K // G, N]`` uint8 (``nibble + 1`` for v1)."""
    zeros = _unpack_cols(self.qzeros)
    return zeros + jnp.uint8(1) if self.zero_point_version == 1 else zeros

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[K, N]`` in ``dtype`` (computed in float32): ``(q - z[g_idx[k]]) * s[g_idx[k]]``."""
    codes, scales, zeros, _ = self.unpack()
    return _dequant(codes, scales, zeros, self._group_of_row()).astype(dtype)

  def to_int4(self, tile_k: int = packing.NATIVE_TILE_K):
    """The lossless :class:`Int4Weight`, with a row permutation under act-order.

    Returns:
      * without ``g_idx``, or with the trivial ``g_idx[k] == k // G`` (checked when
        concrete): an :class:`Int4Weight` ``w4`` with ``w4.dequantize()`` bit-identical
        to ``self.dequantize()``;
      * otherwise (including any traced ``g_idx``) a tuple ``(w4, perm)`` with ``perm``
        ``[K]`` int32 = ``argsort(g_idx, stable)``: ``w4.dequantize() ==
        self.dequantize()[perm]`` bit for bit, hence ``x[:, perm] @ w4 == x @ W``
        (permute the activations' K axis by ``perm`` before the int4 matmul).

    Raises:
      ValueError: (concrete arrays only) a group of ``g_idx`` does not hold exactly G
        rows, or v1 zero points equal 16 (stored nibble 15, not representable).
    """
    k, n = self.shape
    gs = self.group_size
    # The zero points and g_idx (small) are checked here; the codes, K x N, are unpacked and
    # packed again by one compiled program (2048 x 8192 on a 2-core CPU: 0.6 ms, where the
    # eager ops took ~110 ms).
    scales, zeros, g_idx = self.scales, self._zeros(), self.g_idx
    what = (f"GPTQWeight.to_int4 (zero_point_version={self.zero_point_version}; effective "
            "zeros must fit 4 bits")
    if self.zero_point_version == 1:  # qzeros hold z - 1: nibble 15 reads as 16
      what += ("; v1 stores z - 1, so a stored nibble 15 reads as 16, which is what "
               "AutoGPTQ's v1 packing writes for a zero point of 0 (z - 1 underflows)")
    _check_zero_range(zeros, 0, 15, what + ")")
    if self.symmetric:  # zeros all 8: checked when the weight was built from arrays
      zeros = None
    perm = None
    if g_idx is not None:
      trivial = False
      if _is_concrete(g_idx):
        gi = np.asarray(g_idx)
        counts = np.bincount(gi, minlength=k // gs)
        if (counts != gs).any():
          g = int(np.argwhere(counts != gs)[0, 0])
          raise ValueError(
              f"GPTQWeight.to_int4: g_idx gives group {g} {int(counts[g])} rows, not "
              f"group_size={gs}; such a weight has no row permutation into contiguous "
              "groups")
        trivial = bool(np.array_equal(gi, np.arange(k) // gs))
      if not trivial:
        perm = jnp.argsort(g_idx, stable=True).astype(jnp.int32)
    w4 = int4.Int4Weight(
        codes=_rows_in_tile_order(self.qweight, perm, tile_k),
        scales=scales,
        zeros=None if zeros is None else zeros.astype(jnp.uint8),
        shape=(k, n),
        group_size=gs,
        tile_k=tile_k,
    )
    return w4 if perm is None else (w4, perm)

  @classmethod
  def from_int4(cls, w: int4.Int4Weight, zero_point_version: int = 2,
                g_idx: jax.Array | None = None) -> "GPTQWeight":
    """Packs an :class:`Int4Weight` as GPTQ (``symmetric`` when ``w.zeros`` is None).

    Args:
      w: the weight (no biases).
      zero_point_version: 1 (store ``z - 1``; zero points of 0 are not representable)
        or 2.
      g_idx: optional ``[K]`` int32 group per row, stored as is (the codes are not
        reordered: the result means ``(q[k] - z[g_idx[k]]) * s[g_idx[k]]``).
    """
    codes, scales, zeros = _int4_parts(w, "GPTQWeight.from_int4")
    if zero_point_version not in (1, 2):
      raise ValueError(f"{zero_point_version=} must be 1 or 2")
    k, n = w.shape
    symmetric = zeros is None
    z = jnp.full((k // w.group_size, n), 8, jnp.uint8) if symmetric else zeros
    if zero_point_version == 1:
      _check_zero_range(z, 1, 16, "GPTQWeight.from_int4(zero_point_version=1) stores z - 1")
      z = z - jnp.uint8(1)
    return cls(qweight=_pack_rows(codes), qzeros=_pack_cols(z), scales=scales,
               g_idx=None if g_idx is None else jnp.asarray(g_idx, jnp.int32),
               shape=(k, n), group_size=w.group_size,
               zero_point_version=zero_point_version, symmetric=symmetric)


# ---------------------------------------------------------------------------------- AWQ


@functools.partial(jax.jit, static_argnames=("tile_k",))
def _contiguous_to_int4(w: Any, tile_k: int) -> int4.Int4Weight:
  """:meth:`_ContiguousGroups.to_int4` as one compiled program."""
  codes, scales, zeros, _ = w.unpack()
  return int4.Int4Weight(codes=packing.pack_codes(codes, tile_k), scales=scales, zeros=zeros,
                         shape=w.shape, group_size=w.group_size, tile_k=tile_k)


class _ContiguousGroups:
  """``dequantize`` and ``to_int4`` of layouts whose group of row k is ``k // G``
  (no act-order): ``unpack()`` gives codes, scales and zero points (None: z = 8)."""

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[K, N]`` in ``dtype`` (computed in float32): ``(q - z) * s``."""
    codes, scales, zeros, _ = self.unpack()
    groups = _contiguous_groups(self.shape[0], self.group_size)
    return _dequant(codes, scales, zeros, groups).astype(dtype)

  def to_int4(self, tile_k: int = packing.NATIVE_TILE_K) -> int4.Int4Weight:
    """Lossless :class:`Int4Weight` (bit-identical ``dequantize``; symmetric iff there is
    no zero point); jittable, and one compiled program per shape when called eagerly."""
    return _contiguous_to_int4(self, tile_k)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class AWQWeight(_ContiguousGroups, formats.QuantizedWeight):
  """AutoAWQ GEMM 4-bit weight of logical shape ``[K, N]``, as stored.

  ``W[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n]``.

  Attributes:
    qweight: ``[K, N // 8]`` int32; nibble ``i`` of word ``c`` holds column
      ``8c + AWQ_ORDER[i]``, ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``.
    qzeros: ``[K // G, N // 8]`` int32 zero points in the same nibble order, stored as is.
    scales: ``[K // G, N]`` float16 (bf16 / f32 also accepted).
    shape: the logical ``(K, N)``.
    group_size: ``G``.
  """

  format_name = "awq"

  qweight: jax.Array
  qzeros: jax.Array
  scales: jax.Array
  shape: tuple[int, int] = formats.static_field()
  group_size: int = formats.static_field()

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    gs = k if int(self.group_size) == -1 else int(self.group_size)
    object.__setattr__(self, "group_size", gs)
    _check_logical("AWQWeight", k, n, gs)
    if n % 8:
      raise ValueError(f"AWQWeight: N={n} must be a multiple of 8 (8 columns per word)")
    if not self._leaves_concrete_2d():
      return
    ctx = f"shape={self.shape}, group_size={gs}"
    _check_array("AWQWeight", "qweight", self.qweight, (k, n // 8), (jnp.int32,), ctx)
    _check_array("AWQWeight", "qzeros", self.qzeros, (k // gs, n // 8), (jnp.int32,), ctx)
    _check_array("AWQWeight", "scales", self.scales, (k // gs, n), int4.SCALE_DTYPES, ctx)

  @staticmethod
  def _unpack_awq(words: jax.Array) -> jax.Array:
    """``[R, N // 8]`` int32 -> ``[R, N]`` uint8: column ``8c + j`` from nibble
    ``AWQ_REVERSE_ORDER[j]``."""
    r, nw = words.shape
    nib = _nibbles_last(words)[..., jnp.asarray(AWQ_REVERSE_ORDER)]
    return nib.reshape(r, nw * 8)

  @staticmethod
  def _pack_awq(a: jax.Array) -> jax.Array:
    """``[R, N]`` -> ``[R, N // 8]`` int32: nibble ``i`` holds column ``8c + AWQ_ORDER[i]``."""
    r, n = a.shape
    cols = jnp.asarray(a).reshape(r, n // 8, 8)[..., jnp.asarray(AWQ_ORDER)]
    return _pack_last(cols)

  def unpack(self):
    """``(codes [K, N] uint8, scales [K // G, N], zeros [K // G, N] uint8, None)``."""
    return (self._unpack_awq(self.qweight), self.scales, self._unpack_awq(self.qzeros),
            None)

  @classmethod
  def from_int4(cls, w: int4.Int4Weight) -> "AWQWeight":
    """Packs an :class:`Int4Weight` as AWQ (a symmetric one gets stored zeros of 8)."""
    codes, scales, zeros = _int4_parts(w, "AWQWeight.from_int4")
    k, n = w.shape
    if n % 8:
      raise ValueError(f"AWQWeight.from_int4: N={n} must be a multiple of 8")
    z = jnp.full((k // w.group_size, n), 8, jnp.uint8) if zeros is None else zeros
    return cls(qweight=cls._pack_awq(codes), qzeros=cls._pack_awq(z), scales=scales,
               shape=(k, n), group_size=w.group_size)


# --------------------------------------------------------------------- compressed-tensors


@formats.register_format
@dataclasses.dataclass(frozen=True)
class CompressedTensorsWeight(_ContiguousGroups, formats.QuantizedWeight):
  """compressed-tensors ``pack-quantized`` int4 weight of logical shape ``[K, N]``.

  Stored like the torch ``Linear.weight`` ``[N, K]``. Values are signed int4 ``v`` in
  ``[-8, 7]`` kept in offset binary (nibble ``= v + 8``);
  ``W[k, n] = (v[n, k] - zp[n, g]) * weight_scale[n, g]`` with ``g = k // G`` and
  ``zp = 0`` without ``weight_zero_point``. In Int4Weight terms: codes ``v + 8``, zero
  points ``zp + 8``.

  Attributes:
    weight_packed: ``[N, K // 8]`` int32; nibble ``i`` of word ``j`` holds ``k = 8j + i``.
    weight_scale: ``[N, K // G]`` float (bf16, f16 or f32).
    weight_zero_point: ``[ceil(N / 8), K // G]`` int32, signed zero points ``zp`` in
      ``[-8, 7]`` packed along N in offset binary (what compressed-tensors writes); or
      ``[N, K // G]`` int8 ``zp`` unpacked; or None (symmetric).
    weight_shape: the stored ``(N, K)``.
    group_size: ``G`` (K for per-channel).
  """

  format_name = "compressed_tensors_pack_quantized"

  weight_packed: jax.Array
  weight_scale: jax.Array
  weight_zero_point: jax.Array | None
  weight_shape: tuple[int, int] = formats.static_field()
  group_size: int = formats.static_field()

  def __post_init__(self):
    object.__setattr__(self, "weight_shape", tuple(int(d) for d in self.weight_shape))
    n, k = self.weight_shape
    gs = k if int(self.group_size) == -1 else int(self.group_size)
    object.__setattr__(self, "group_size", gs)
    _check_logical("CompressedTensorsWeight", k, n, gs)
    if not self._leaves_concrete_2d():
      return
    ctx = f"weight_shape=(N={n}, K={k}), group_size={gs}"
    _check_array("CompressedTensorsWeight", "weight_packed", self.weight_packed,
                 (n, k // 8), (jnp.int32,), ctx)
    _check_array("CompressedTensorsWeight", "weight_scale", self.weight_scale,
                 (n, k // gs), int4.SCALE_DTYPES, ctx)
    zp = self.weight_zero_point
    if zp is not None:
      if jnp.dtype(zp.dtype) == jnp.dtype(jnp.int32):  # packed along N
        _check_array("CompressedTensorsWeight", "weight_zero_point", zp,
                     (-(-n // 8), k // gs), (jnp.int32,), ctx + "; packed along N")
      else:
        _check_array("CompressedTensorsWeight", "weight_zero_point", zp, (n, k // gs),
                     (jnp.int8, jnp.int32), ctx + "; int32 when packed along N as "
                     f"({-(-n // 8)}, {k // gs}), int8 unpacked")
        _check_zero_range(zp, -8, 7, "CompressedTensorsWeight.weight_zero_point (signed int4)")

  @property
  def shape(self) -> tuple[int, int]:
    """The logical ``(K, N)``."""
    n, k = self.weight_shape
    return (k, n)

  @property
  def symmetric(self) -> bool:
    """Whether the checkpoint has no zero points (codes are signed around 0)."""
    return self.weight_zero_point is None

  @property
  def zero_point_packed(self) -> bool:
    """Whether ``weight_zero_point`` is int32 packed along N (the library's format)."""
    zp = self.weight_zero_point
    return zp is not None and jnp.dtype(zp.dtype) == jnp.dtype(jnp.int32)

  def unpack(self):
    """``(codes [K, N] uint8 = v + 8, scales [K // G, N], zeros [K // G, N] uint8 = zp + 8
    or None, None)``."""
    n, k = self.weight_shape
    codes = _nibbles_last(self.weight_packed).reshape(n, k).T
    zeros = None
    zp = self.weight_zero_point
    if zp is not None and self.zero_point_packed:
      zeros = _unpack_cols(zp.T)[:, :n]  # [K // G, N] nibbles = zp + 8
    elif zp is not None:
      zeros = (zp.astype(jnp.int32) + 8).astype(jnp.uint8).T
    return codes, self.weight_scale.T, zeros, None

  @classmethod
  def from_int4(cls, w: int4.Int4Weight, *, pack_zero_point: bool = True
                ) -> "CompressedTensorsWeight":
    """Packs an :class:`Int4Weight` (codes ``q`` stored as ``v = q - 8``, zeros as
    ``zp = z - 8``).

    Args:
      w: the weight (no biases).
      pack_zero_point: store zero points as compressed-tensors writes them (int32
        ``[ceil(N / 8), K // G]`` packed along N); False: int8 ``[N, K // G]``.
    """
    codes, scales, zeros = _int4_parts(w, "CompressedTensorsWeight.from_int4")
    k, n = w.shape
    packed = _pack_last(codes.T.reshape(n, k // 8, 8))
    if zeros is None:
      zp = None
    elif pack_zero_point:  # nibble i of word [r, g] = z[g, 8r + i] = zp + 8
      padded = jnp.pad(zeros, ((0, 0), (0, -n % 8)))
      zp = _pack_cols(padded).T
    else:
      zp = (zeros.astype(jnp.int32) - 8).astype(jnp.int8).T
    return cls(weight_packed=packed, weight_scale=scales.T, weight_zero_point=zp,
               weight_shape=(n, k), group_size=w.group_size)


# ----------------------------------------------------------------------------- dispatch


def matmul_xla(x: jax.Array, w: Any) -> jax.Array:
  """``x [M, K] @ dequantize(w) [K, N] -> [M, N]`` in x's dtype, f32 accumulation."""
  return formats.dense_dot(x, w.dequantize())


def repack_for_int4_kernel(x: jax.Array, w: Any) -> tuple[jax.Array, int4.Int4Weight]:
  """``(x [M, K], w) -> (x', w4)`` with ``x' @ w4 == x @ W``: the lossless
  :class:`Int4Weight` of ``w`` and, under GPTQ act-order, x's columns permuted by
  ``perm`` (see :meth:`GPTQWeight.to_int4`). Lets the int4 kernels serve these layouts."""
  out = w.to_int4()
  if isinstance(out, tuple):
    w4, perm = out
    return jnp.take(x, perm, axis=-1), w4
  return x, out


LAYOUT_FORMATS = (GPTQWeight, AWQWeight, CompressedTensorsWeight)

for _cls in LAYOUT_FORMATS:
  dispatch.register_xla(_cls, matmul_xla)
  dispatch.register_repack(_cls, int4.Int4Weight, repack_for_int4_kernel)
del _cls
