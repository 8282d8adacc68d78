"""MXFP4 and NVFP4 weights stored by output column: E2M1 codes ``[N, K // 8]`` in the
order of Hopper's wgmma register fragments, for the wgmma kernel.

:class:`~qjax.MXFP4Weight` packs eight E2M1 codes of one column per word and lays the
words out ``[K // 8, N]`` (the Triton kernels' layout). This format holds the same weight
with the words transposed, ``[N, K // 8]``, and the codes of each run of 32 permuted as
:class:`~qjax.Int4NKWeight` permutes its INT4 codes (``int4_nk.SLOT_TO_K``): the Hopper
``wgmma`` kernel (``pallas_kernels.int4_wgmma``) loads them alike and only converts each
pair of codes differently (E2M1 bits placed into bf16 and a multiply, no lookup table).
A run of 32 codes is one MXFP4 block, so each register's four pairs share a scale (two
NVFP4 blocks: pairs 0, 1 and pairs 2, 3).

Convert once, at load: ``qjax.to_mxfp4_nk(w)`` from an :class:`~qjax.MXFP4Weight`,
``qjax.to_nvfp4_nk(w)`` from an :class:`~qjax.NVFP4Weight` (bit-exact;
:meth:`MXFP4NKWeight.to_mxfp4` and :meth:`NVFP4NKWeight.to_nvfp4` are the inverses).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import dispatch
from qjax._src import formats
from qjax._src import fp4
from qjax._src import int4_nk
from qjax._src import packing


# Where each E2M1 code's bits lie in a stored word. In fragment order (int4_nk.fragment_words)
# nibble e of a word holds one code, and the wgmma kernel converts pair i of the word, nibbles
# i (low bf16 half) and i + 4 (high half), into bf16 bits: exponent and mantissa at 8..6 and
# 22..24's mirror, signs at 15 and 31. The stored word places the bits so that, for pairs 0..2,
# one 32-bit rotation puts all eight in place (then one AND), and for pair 3 six are in place
# and the mantissa bits need a shift: 9 integer instructions per word instead of 15.
# STORED_BIT[e][b]: the stored position of bit b (0: mantissa, 1, 2: exponent, 3: sign) of
# nibble e. A pair-i code of "start" t has its bits at t, t + 1, t + 2 and sign at t + 9,
# the high code 16 further on (mod 32); rotating left by 6 - t (mod 32) places them.
_PAIR_START = (0, 4, 10)  # pairs 0, 1, 2; pair 3 takes the remaining bits
PAIR_ROTATION = tuple((6 - t) % 32 for t in _PAIR_START)


def _stored_bits() -> tuple[tuple[int, int, int, int], ...]:
  low, high = {}, {}
  for i, t in enumerate(_PAIR_START):
    low[i] = (t, t + 1, t + 2, t + 9)
    high[i] = tuple((b + 16) % 32 for b in low[i])
  low[3], high[3] = (14, 7, 8, 15), (30, 23, 24, 31)  # e1 e0 and s in place, m at 14 / 30
  return tuple(low[e] if e < 4 else high[e - 4] for e in range(8))


STORED_BIT = _stored_bits()
assert sorted(b for code in STORED_BIT for b in code) == list(range(32))


def _moves(e: int) -> dict[int, int]:
  """``{shift: mask}`` of nibble ``e``: its bits at ``4e + b`` move to ``STORED_BIT[e][b]``,
  grouped by shift (``stored - fragment``), the mask over the fragment-order bits."""
  moves: dict[int, int] = {}
  for b, stored in enumerate(STORED_BIT[e]):
    moves[stored - (4 * e + b)] = moves.get(stored - (4 * e + b), 0) | 1 << (4 * e + b)
  return moves


def _shift(words, by: int):
  """``words`` shifted left by ``by`` bits (right where negative), uint32."""
  return words << np.uint32(by) if by >= 0 else words >> np.uint32(-by)


def _bitwise_or(parts):
  """The bitwise OR of the arrays ``parts`` (an iterable of at least one)."""
  return functools.reduce(operator.or_, parts)


def to_stored_words(words):
  """Fragment-order words (``int4_nk.fragment_words``) -> the stored words of the FP4 NK
  formats (:data:`STORED_BIT`); uint32 numpy or jax arrays, elementwise."""
  return _bitwise_or(_shift(words & np.uint32(mask), by)
                     for e in range(8) for by, mask in _moves(e).items())


def stored_nibble(stored, e: int):
  """Nibble ``e`` of the fragment-order word (an E2M1 code in ``[0, 15]``, uint32) from
  stored words."""
  fragment_bits = _bitwise_or(_shift(stored, -by) & np.uint32(mask)
                              for by, mask in _moves(e).items())
  return _shift(fragment_bits, -4 * e)


def from_stored_words(stored):
  """The inverse of :func:`to_stored_words`."""
  return _bitwise_or(_shift(stored_nibble(stored, e), 4 * e) for e in range(8))


class _FP4NKWeight(formats.QuantizedWeight):
  """What MXFP4NKWeight and NVFP4NKWeight share: E2M1 codes ``[N, K // 8]`` in fragment
  order and one scale row per block of K."""

  block_size: ClassVar[int]
  scale_dtype: ClassVar[np.dtype]
  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, int]

  def _validate(self, extra: dict) -> None:
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    name = type(self).__name__
    if k <= 0 or n <= 0 or k % int4_nk.CHUNK:
      raise ValueError(f"{name}: shape (K={k}, N={n}) needs K a positive multiple of "
                       f"{int4_nk.CHUNK}; keep the {name[:-8]}Weight for this shape")
    if not self._leaves_concrete_2d():
      return
    want = {"codes": ((n, k // 8), (jnp.uint32,)),
            "scales": ((k // self.block_size, n), (self.scale_dtype,)), **extra}
    formats.check_trailing_fields(self, want, f"shape={self.shape}")

  @property
  def num_blocks(self) -> int:
    """Scale blocks along K: ``K // block_size``."""
    return self.shape[0] // self.block_size

  def codes_nk(self) -> jax.Array:
    """``[..., N, K]`` uint8 E2M1 codes in ``[0, 15]``, K in logical order."""
    return int4_nk.fragment_nibbles(from_stored_words(self.codes), self.shape[0])

  def block_scales(self) -> jax.Array:  # pragma: no cover - abstract
    """``[..., K // B, N]`` float32 multiplier of each block's E2M1 values."""
    raise NotImplementedError

  def _finish(self, w: jax.Array) -> jax.Array:
    return w

  def dequantize_nk(self, dtype=jnp.float32) -> jax.Array:
    """``[..., N, K]`` W^T in ``dtype``: computed in float32 as the row-major format's
    :meth:`~qjax.MXFP4Weight.dequantize` does, rounded once."""
    s = jnp.repeat(jnp.swapaxes(self.block_scales(), -1, -2), self.block_size,
                   axis=-1)  # [..., N, K]
    return self._finish(fp4.decode_e2m1(self.codes_nk()) * s).astype(dtype)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[..., K, N]`` W in ``dtype`` (see :meth:`dequantize_nk`)."""
    return jnp.swapaxes(self.dequantize_nk(dtype), -1, -2)

  def _row_major_codes(self, tile_k: int) -> jax.Array:
    return packing.pack_codes(jnp.swapaxes(self.codes_nk(), -1, -2), tile_k)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class MXFP4NKWeight(_FP4NKWeight):
  """MXFP4 weight of logical shape ``[K, N]`` (``y = x @ W``) with codes stored by column.

  ``W[k, n] = e2m1(q[n, k]) * 2 ** (scales[k // 32, n] - 127)``.

  Attributes:
    codes: ``[N, K // 8]`` uint32; word ``(n, 4t + c)`` holds the E2M1 codes ``q[n, 32t
      + 8 (e % 4) + 2c + e // 4]``, e = 0..7 (``int4_nk.SLOT_TO_K``), bit b of code e at
      bit ``STORED_BIT[e][b]`` (:data:`STORED_BIT`: where the wgmma kernel converts them
      with the fewest instructions).
    scales: ``[K // 32, N]`` uint8 E8M0 biased exponents (255 is NaN), as
      :class:`~qjax.MXFP4Weight`'s.
    shape: the logical ``(K, N)``; K a multiple of 32.
  """

  # ".v2": the stored bit order of session 21 (STORED_BIT).
  format_name = "mxfp4_nk.v2"
  block_size = fp4.MXFP4_BLOCK
  scale_dtype = np.dtype(np.uint8)

  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, int] = formats.static_field()

  def __post_init__(self):
    self._validate({})

  def block_scales(self) -> jax.Array:
    """The decoded E8M0 scales: what each block's E2M1 values are multiplied by.

    Returns:
      ``[..., K // 32, N]`` float32, ``2 ** (scales - 127)`` exactly (``scales == 0``
      gives the float32 subnormal ``2 ** -127``; ``scales == 255`` gives NaN, the E8M0
      NaN, which makes that block of :meth:`dequantize` NaN).
    """
    return fp4.decode_e8m0(self.scales)

  def to_mxfp4(self, tile_k: int = packing.NATIVE_TILE_K) -> fp4.MXFP4Weight:
    """The same weight as an :class:`~qjax.MXFP4Weight` (lossless, jittable)."""
    return fp4.MXFP4Weight(codes=self._row_major_codes(tile_k), scales=self.scales,
                           shape=self.shape, tile_k=tile_k)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class NVFP4NKWeight(_FP4NKWeight):
  """NVFP4 weight of logical shape ``[K, N]`` (``y = x @ W``) with codes stored by column.

  ``W[k, n] = (e2m1(q[n, k]) * f32(scales[k // 16, n])) * global_scale``.

  Attributes:
    codes: ``[N, K // 8]`` uint32 in the fragment order of :class:`MXFP4NKWeight`; each
      register's four pairs span two NVFP4 blocks (pairs 0, 1 and 2, 3).
    scales: ``[K // 16, N]`` float8_e4m3fn block scales, as :class:`~qjax.NVFP4Weight`'s.
    global_scale: ``[]`` float32 tensor scale.
    shape: the logical ``(K, N)``; K a multiple of 32.
  """

  format_name = "nvfp4_nk.v2"
  block_size = fp4.NVFP4_BLOCK
  scale_dtype = np.dtype(jnp.float8_e4m3fn)

  codes: jax.Array
  scales: jax.Array
  global_scale: jax.Array
  shape: tuple[int, int] = formats.static_field()

  def __post_init__(self):
    self._validate({})
    if not self._leaves_concrete_2d():
      return
    g, lead = self.global_scale, tuple(self.codes.shape[:-2])
    if tuple(g.shape) != lead or jnp.dtype(g.dtype) != jnp.float32:
      raise ValueError(f"NVFP4NKWeight.global_scale must be {lead} of dtype float32 (one "
                       f"per weight of the stack), got {tuple(g.shape)} "
                       f"{jnp.dtype(g.dtype).name} (shape={self.shape})")

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

  def to_nvfp4(self, tile_k: int = packing.NATIVE_TILE_K) -> fp4.NVFP4Weight:
    """The same weight as an :class:`~qjax.NVFP4Weight` (lossless, jittable)."""
    return fp4.NVFP4Weight(codes=self._row_major_codes(tile_k), scales=self.scales,
                           global_scale=self.global_scale, shape=self.shape, tile_k=tile_k)


def _fragment_codes(w) -> jax.Array:
  """``[..., N, K // 8]`` words of ``w``'s E2M1 codes in fragment order."""
  k = w.shape[0]
  if k % int4_nk.CHUNK:
    raise ValueError(f"{type(w).__name__} with K={k}: the [N, K // 8] layout needs K to be "
                     f"a multiple of {int4_nk.CHUNK}")
  return _fragment_words_of(w)


@jax.jit
def _fragment_words_of(w) -> jax.Array:
  """:func:`_fragment_codes`' words as one compiled program per shape (MXFP4 2048 x 8192
  on a 2-core CPU: ~5 ms, where the eager ops apart took ~240 ms)."""
  return to_stored_words(int4_nk.fragment_words(w.unpacked_codes()))


def to_mxfp4_nk(w: fp4.MXFP4Weight) -> MXFP4NKWeight:
  """``w`` in the ``[N, K // 8]`` layout of :class:`MXFP4NKWeight`: bit-exact, jittable.

  Args:
    w: an :class:`~qjax.MXFP4Weight` with K a multiple of 32 (any ``tile_k``).

  Returns:
    An :class:`MXFP4NKWeight` with ``codes: [N, K // 8] uint32`` (fragment order, bits
    placed as :data:`STORED_BIT` says) and ``w``'s ``scales: [K // 32, N] uint8`` as they
    are; ``dequantize()`` equals ``w.dequantize()`` bit for bit, and ``to_mxfp4()`` gives
    ``w`` back.

  Raises:
    TypeError: when ``w`` is not an :class:`~qjax.MXFP4Weight` (naming its type).

  >>> import jax, qjax
  >>> w = qjax.quantize_mxfp4(jax.random.normal(jax.random.key(0), (256, 128)))
  >>> wn = qjax.to_mxfp4_nk(w)
  >>> wn.codes.shape, bool((wn.dequantize() == w.dequantize()).all())
  ((128, 32), True)
  """
  if not isinstance(w, fp4.MXFP4Weight):
    raise TypeError(f"to_mxfp4_nk takes an MXFP4Weight, got {type(w).__name__}")
  return MXFP4NKWeight(codes=_fragment_codes(w), scales=w.scales, shape=w.shape)


def to_nvfp4_nk(w: fp4.NVFP4Weight) -> NVFP4NKWeight:
  """``w`` in the ``[N, K // 8]`` layout of :class:`NVFP4NKWeight`: bit-exact, jittable.

  Args:
    w: an :class:`~qjax.NVFP4Weight` with K a multiple of 32 (two NVFP4 blocks per run of
      32 codes; any ``tile_k``).

  Returns:
    An :class:`NVFP4NKWeight` with ``codes: [N, K // 8] uint32`` (fragment order, bits
    placed as :data:`STORED_BIT` says), and ``w``'s ``scales: [K // 16, N]``
    float8_e4m3fn and ``global_scale: [] float32`` as they are; ``dequantize()`` equals
    ``w.dequantize()`` bit for bit, and ``to_nvfp4()`` gives ``w`` back.

  Raises:
    TypeError: when ``w`` is not an :class:`~qjax.NVFP4Weight` (naming its type).
    ValueError: for K not a multiple of 32 (K = 16 * odd is a valid NVFP4Weight that this
      layout cannot hold: keep the NVFP4Weight).

  >>> import jax, qjax
  >>> w = qjax.quantize_nvfp4(jax.random.normal(jax.random.key(0), (256, 128)))
  >>> wn = qjax.to_nvfp4_nk(w)
  >>> wn.codes.shape, bool((wn.dequantize() == w.dequantize()).all())
  ((128, 32), True)
  """
  if not isinstance(w, fp4.NVFP4Weight):
    raise TypeError(f"to_nvfp4_nk takes an NVFP4Weight, got {type(w).__name__}")
  return NVFP4NKWeight(codes=_fragment_codes(w), scales=w.scales,
                       global_scale=w.global_scale, shape=w.shape)


# Nibbles of a word by NVFP4 block within its 32-code run: nibbles i and i + 4 of word c
# are K 8i + 2c and 8i + 2c + 1, so nibbles 0, 1, 4, 5 lie in K 0..15, the others in 16..31.
_NIBBLES_BY_HALF_RUN = ((0, 1, 4, 5), (2, 3, 6, 7))


def _row_xla(x: jax.Array, w: _FP4NKWeight) -> jax.Array:
  """One row: ``x [1, K] @ W`` as one multiply-and-sum over the packed words (XLA fuses
  the decoding into the reduction and reads each word once), float32 throughout: per
  block, the sum of its codes' E2M1 values times x, then times the block's scale."""
  k, n = w.shape
  xs = int4_nk.x_in_fragment_order(x)
  terms = [fp4.decode_e2m1(stored_nibble(w.codes, e)) * xs[:, e]
           for e in range(8)]  # [N, K // 8] each
  runs = k // int4_nk.CHUNK
  if w.block_size == int4_nk.CHUNK:  # MXFP4: a run is a block
    per_block = sum(terms).reshape(n, runs, 4).sum(-1)  # [N, K // 32]
  else:  # NVFP4: two blocks per run, split by nibble
    halves = [sum(terms[e] for e in nibbles).reshape(n, runs, 4).sum(-1)
              for nibbles in _NIBBLES_BY_HALF_RUN]
    per_block = jnp.stack(halves, axis=-1).reshape(n, 2 * runs)  # [N, K // 16]
  y = (per_block * w.block_scales().T).sum(-1)  # [N]
  if isinstance(w, NVFP4NKWeight):
    y = y * w.global_scale
  return y[None].astype(x.dtype)


def matmul_xla(x: jax.Array, w: _FP4NKWeight) -> jax.Array:
  """``x [M, K] @ W`` in x's dtype. One row: a fused multiply-and-sum over the packed
  words (:func:`_row_xla`). More rows: W^T dequantized in x's dtype (float32 math, one
  rounding) and contracted on its K axis; float32 x at HIGHEST precision."""
  if w.codes.ndim != 2:
    raise NotImplementedError(
        f"codes of shape {w.codes.shape}: matmul takes one [K, N] weight (qjax.layer_of "
        "names one layer of a stack)")
  if x.shape[0] == 1:
    return _row_xla(x, w)
  wt = w.dequantize_nk(x.dtype)
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=x.dtype)


dispatch.register_xla(MXFP4NKWeight, matmul_xla)
dispatch.register_xla(NVFP4NKWeight, matmul_xla)

