"""INT4 weights stored by output column: codes ``[N, K // 8]`` in the order of
Hopper's wgmma register fragments.

:class:`~qjax.Int4Weight` packs eight codes of one column per word and lays the words out
``[K // 8, N]``, the layout of the Triton kernels (GEMV and tiled). This format holds the
same weight with the words transposed, ``[N, K // 8]``, and the codes as two's-complement
``q - 8``. Within each run of 32 codes of a row (four words), the codes are permuted so that
word ``c`` holds exactly the codes that thread ``c`` of a four-thread row group holds in
wgmma's register operand layout (:data:`SLOT_TO_K`). The Hopper ``wgmma`` kernel
(``pallas_kernels.int4_wgmma``, Pallas Mosaic GPU) loads the words with the tensor memory
accelerator, then each thread reads whole 32-bit words from shared memory and converts them
to bf16 in place as the left operand of ``W^T x^T``: no register shuffles (BENCHMARKS.md,
session 17: 3-11 % faster than the plain ``jnp.int4 [N, K]`` order of session 16).

Convert once, at load: ``qjax.to_int4_nk(w)`` from an :class:`~qjax.Int4Weight`, symmetric
or with integer zero points (AWQ, GPTQ and compressed-tensors' asymmetric checkpoints;
bit-exact, and :meth:`Int4NKWeight.to_int4` is its inverse). Float biases (GGUF Q4_1 /
K-quant style) have no form here. ``qjax.kernel_layouts`` converts on Hopper: there the
wgmma kernel beats ``Int4Weight``'s kernels at every M but one row of 4096x4096 (H100:
slower there, sessions 17-23; H200: equal, sessions 43-45, BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import dispatch
from qjax._src import formats
from qjax._src import int4
from qjax._src import packing


# Codes per permuted run: four words, one per thread of a wgmma row group.
CHUNK = 32
# SLOT_TO_K[8 c + e] = the K offset (within a run of 32) of the code held by nibble e of
# word c: thread c of wgmma's register layout holds the K pairs (2c + 8i, 2c + 8i + 1),
# i = 0..3, and nibbles i and i + 4 of its word are the pair i, so one shift and one LOP3
# put both codes of a pair into the two halves of a 32-bit register.
SLOT_TO_K = np.array([8 * (e % 4) + 2 * c + e // 4 for c in range(4) for e in range(8)])
K_TO_SLOT = np.argsort(SLOT_TO_K)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class Int4NKWeight(formats.QuantizedWeight):
  """4-bit weight of logical shape ``[K, N]``, used as ``y = x @ W``.

  Symmetric: ``W[k, n] = c[n, k] * scales[k // G, n]`` with integer codes ``c`` in
  ``[-8, 7]`` (the ``q - 8`` of a symmetric :class:`~qjax.Int4Weight`). With integer zero
  points: ``W[k, n] = (c[n, k] + 8 - zeros[k // G, n]) * scales[k // G, n]``, which is
  ``(q - z) * s`` of the :class:`~qjax.Int4Weight` it was converted from (the codes are
  stored as ``q - 8`` either way).

  Attributes:
    codes: ``[N, K // 8]`` uint32; bits ``4e .. 4e + 3`` of word ``(n, 4t + c)`` hold
      ``c[n, 32t + 8 (e % 4) + 2c + e // 4]`` in two's complement (``c`` in 0..3, ``e``
      in 0..7; :data:`SLOT_TO_K`). Bitcast to ``jnp.int4 [N, K]`` they are ``W^T`` with K
      permuted within each run of 32.
    scales: ``[K // G, N]`` bf16, f16 or f32.
    shape: the logical ``(K, N)``; K a multiple of 32.
    group_size: ``G``; a multiple of 32 dividing K (K itself for one scale per column).
    zeros: ``[K // G, N]`` uint8 zero points in ``[0, 15]``, or None (symmetric: 8).
  """

  # ".v2": the fragment order of session 17. Files of session 16's plain order (format
  # "int4_nk") no longer load, rather than load wrong.
  format_name = "int4_nk.v2"

  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, int] = formats.static_field()
  group_size: int = formats.static_field()
  zeros: jax.Array | None = None

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    if k % CHUNK:
      raise ValueError(f"Int4NKWeight needs K={k} to be a multiple of {CHUNK} (codes are "
                       f"permuted in runs of {CHUNK}); pad K or keep the Int4Weight")
    if self.group_size <= 0 or k % self.group_size or self.group_size % CHUNK:
      raise ValueError(
          f"group_size={self.group_size} must be a multiple of {CHUNK} dividing K={k}; "
          "choose such a group size or keep the Int4Weight")
    if not self._leaves_concrete_2d():
      return
    want = {"codes": ((n, k // 8), (jnp.uint32,)),
            "scales": ((k // self.group_size, n), int4.SCALE_DTYPES)}
    if self.zeros is not None:
      want["zeros"] = ((k // self.group_size, n), (jnp.uint8,))
    formats.check_trailing_fields(self, want,
                                  f"shape={self.shape}, group_size={self.group_size}")

  @property
  def symmetric(self) -> bool:
    """Whether the zero point is 8 everywhere (no ``zeros``)."""
    return self.zeros is None

  @property
  def num_groups(self) -> int:
    """Scale groups along K: ``K // group_size``."""
    return self.shape[0] // self.group_size

  def signed_codes(self) -> jax.Array:
    """``[..., N, K]`` int8 codes ``c`` in ``[-8, 7]``, K in logical order."""
    v = fragment_nibbles(self.codes, self.shape[0]).astype(jnp.int8)
    return (v ^ 8) - 8  # two's complement nibbles

  def offsets(self) -> jax.Array | None:
    """``[..., N, K // G]`` float32 ``8 - zeros`` (what each group adds to ``c``: ``W = (c +
    offset) * s``), or None when symmetric."""
    if self.zeros is None:
      return None
    return 8.0 - jnp.swapaxes(self.zeros, -1, -2).astype(jnp.float32)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[K, N]`` W in ``dtype``: ``(c + 8 - z) * s`` computed in float32, rounded once."""
    return jnp.swapaxes(self.dequantize_nk(dtype), -1, -2)

  def dequantize_nk(self, dtype=jnp.float32) -> jax.Array:
    """``[N, K]`` W^T in ``dtype``: ``(c + 8 - z) * s`` computed in float32, rounded once."""
    s = jnp.repeat(jnp.swapaxes(self.scales, -1, -2).astype(jnp.float32), self.group_size,
                   axis=-1)  # [..., N, K]
    c = self.signed_codes().astype(jnp.float32)
    if self.zeros is not None:
      c = c + jnp.repeat(self.offsets(), self.group_size, axis=-1)
    return (c * s).astype(dtype)

  def to_int4(self, tile_k: int = packing.NATIVE_TILE_K) -> int4.Int4Weight:
    """The same weight as an :class:`~qjax.Int4Weight` (symmetric or with the same zero
    points; lossless, jittable)."""
    q = (jnp.swapaxes(self.signed_codes(), -1, -2).astype(jnp.int32) + 8).astype(jnp.uint8)
    return int4.Int4Weight(codes=packing.pack_codes(q, tile_k), scales=self.scales,
                           zeros=self.zeros,
                           shape=self.shape, group_size=self.group_size, tile_k=tile_k)


def to_int4_nk(w: int4.Int4Weight) -> Int4NKWeight:
  """``w`` in the ``[N, K // 8]`` layout of :class:`Int4NKWeight`: bit-exact, jittable.

  Args:
    w: an :class:`~qjax.Int4Weight`, symmetric or with integer zero points (not float
      biases); K and its group size multiples of 32. Its scales and zero points are kept
      as they are (dtype included); its ``tile_k`` may be any.

  Returns:
    An :class:`Int4NKWeight` with ``codes: [N, K // 8] uint32`` in wgmma fragment order,
    ``scales: [K // G, N]`` and ``zeros: [K // G, N] uint8`` (or None) shared with ``w``;
    ``dequantize()`` equals ``w.dequantize()`` bit for bit.

  Raises:
    TypeError: when ``w`` is not an :class:`~qjax.Int4Weight` (naming its type).
    ValueError: when ``w`` has float ``biases`` (keep the Int4Weight), or K or
      ``group_size`` is not a multiple of 32 (naming both).

  >>> import jax, qjax
  >>> w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 128)))
  >>> wn = qjax.to_int4_nk(w)
  >>> wn.codes.shape, bool((wn.dequantize() == w.dequantize()).all())
  ((128, 32), True)
  """
  if not isinstance(w, int4.Int4Weight):
    raise TypeError(f"to_int4_nk takes an Int4Weight, got {type(w).__name__}")
  if w.biases is not None:
    raise ValueError(
        "to_int4_nk takes a symmetric Int4Weight or one with integer zero points: this one "
        "has float biases (W = q * s + b, GGUF Q4_1 / K-quant style), which the [N, K / 8] "
        "layout does not hold; keep the Int4Weight")
  k, n = w.shape
  if k % CHUNK or w.group_size % CHUNK:
    raise ValueError(f"to_int4_nk needs K={k} and group_size={w.group_size} to be "
                     f"multiples of {CHUNK}; keep the Int4Weight for this shape")
  return Int4NKWeight(codes=_nk_codes(w), scales=w.scales, shape=w.shape,
                      group_size=w.group_size, zeros=w.zeros)


@jax.jit
def _nk_codes(w: int4.Int4Weight) -> jax.Array:
  """The fragment-order words of ``w``'s codes (``q - 8``), as one compiled program per
  shape (2048 x 8192 on a 2-core CPU: ~15 ms, where the eager ops apart took ~440 ms)."""
  q = w.unpacked_codes().astype(jnp.uint32)  # [..., K, N] in [0, 15]
  return fragment_words(q ^ jnp.uint32(8))  # q - 8 in 4-bit two's complement


def fragment_words(q: jax.Array) -> jax.Array:
  """``q [..., K, N]`` 4-bit codes (integers in ``[0, 15]``; K a multiple of 32) ->
  ``[..., N, K // 8]`` uint32 words in fragment order: nibble ``e`` of word ``(n, 4t + c)``
  holds ``q[32t + SLOT_TO_K[8c + e], n]``. The layout of every ``[N, K // 8]`` format
  (INT4 here, E2M1 in :mod:`qjax._src.fp4_nk`); :func:`fragment_nibbles` inverts it."""
  *lead, k, n = q.shape
  slots = q.astype(jnp.uint32).reshape(*lead, k // CHUNK, CHUNK, n)[..., SLOT_TO_K, :]
  words = packing.pack_codes(slots.reshape(*lead, k, n), packing.PLAIN_TILE_K)
  return jnp.swapaxes(words, -1, -2)


def fragment_nibbles(codes: jax.Array, k: int) -> jax.Array:
  """``codes [..., N, K // 8]`` words in fragment order -> ``[..., N, K]`` uint8 nibbles
  in ``[0, 15]``, K in logical order (the inverse of :func:`fragment_words`)."""
  planes = [((codes >> jnp.uint32(4 * e)) & jnp.uint32(0xF)).astype(jnp.uint8)
            for e in range(8)]  # 8 x [..., N, K // 8]
  lead = codes.shape[:-1]
  slots = jnp.stack(planes, axis=-1).reshape(*lead, k // CHUNK, CHUNK)
  return slots[..., K_TO_SLOT].reshape(*lead, k)


def x_in_fragment_order(x: jax.Array) -> jax.Array:
  """One row ``x [1, K]`` -> ``[K // 8, 8]`` float32 in the codes' storage order:
  element ``[j, e]`` multiplies nibble ``e`` of word ``j``. Nibble ``e = 4b + i`` of word
  ``4t + c`` is K = 32t + 8i + 2c + b: a transpose of (i, c, b)."""
  k = x.shape[-1]
  return jnp.transpose(x.astype(jnp.float32).reshape(k // CHUNK, 4, 4, 2),
                       (0, 2, 3, 1)).reshape(k // 8, 8)


def _signed_planes(codes: jax.Array, dtype=jnp.float32) -> list[jax.Array]:
  """The 8 nibble planes of ``codes [..., N, K // 8]`` as codes in ``[-8, 7]`` of
  ``dtype``: plane ``e`` holds nibble ``e`` of word ``[n, j]`` (storage order; its K is
  given by :data:`SLOT_TO_K`; the two's-complement nibble ``v`` is ``(v ^ 8) - 8``)."""
  planes = []
  for i in range(8):
    v = ((codes >> jnp.uint32(4 * i)) & jnp.uint32(0xF)).astype(jnp.int32)
    planes.append(((v ^ 8) - 8).astype(dtype))
  return planes


def _row_xla(x: jax.Array, w: Int4NKWeight) -> jax.Array:
  """One row: ``x [1, K] @ W`` as one multiply-and-sum over the packed words (XLA fuses
  the unpacking into the reduction, reading each word once), float32 throughout."""
  k, n = w.shape
  xs = x_in_fragment_order(x)
  acc = sum(p * xs[:, i] for i, p in enumerate(_signed_planes(w.codes)))  # [N, K // 8]
  per_group = acc.reshape(n, k // w.group_size, w.group_size // 8).sum(-1)  # [N, K // G]
  if w.zeros is not None:  # + (8 - z) times each group's sum of x
    x_sums = x[0].astype(jnp.float32).reshape(k // w.group_size, w.group_size).sum(-1)
    per_group = per_group + w.offsets() * x_sums
  y = (per_group * w.scales.T.astype(jnp.float32)).sum(-1)
  return y[None].astype(x.dtype)


def _dequantize_nk_pairs(w: Int4NKWeight, dtype) -> jax.Array:
  """``[N, K]`` W^T in a 16-bit ``dtype``, bit for bit :meth:`Int4NKWeight.dequantize_nk`,
  written as uint32 words of two neighbouring K (XLA writes 16-bit results an element at
  a time, far below bandwidth; see :func:`formats.column_pairs`)."""
  k, n = w.shape
  s = jnp.repeat(w.scales.T.astype(jnp.float32), w.group_size // 8, axis=1)  # [N, K // 8]
  planes = _signed_planes(w.codes)
  if w.zeros is not None:  # c + 8 - z
    off = jnp.repeat(w.offsets(), w.group_size // 8, axis=1)  # [N, K // 8]
    planes = [p + off for p in planes]

  def bits(v):
    return jax.lax.bitcast_convert_type((v * s).astype(dtype), jnp.uint16).astype(jnp.uint32)

  # Nibbles p, p + 4 of word 4t + c are K = 32t + 8p + 2c (+ 1): the K pair 16t + 4p + c.
  pairs = [(bits(planes[p]) | (bits(planes[p + 4]) << jnp.uint32(16))
            ).reshape(n, k // CHUNK, 4) for p in range(4)]  # [N, t, c] each
  words = jnp.stack(pairs, axis=-2)  # [N, t, p, c]: K pairs in order
  return jax.lax.bitcast_convert_type(words, dtype).reshape(n, k)


def matmul_xla(x: jax.Array, w: Int4NKWeight) -> jax.Array:
  """``x [M, K] @ W`` in x's dtype. One row: a fused multiply-and-sum over the packed
  words. More rows: W^T dequantized in x's dtype (float32 math, one rounding; 16-bit
  dtypes written two per word) and contracted on its K axis, so XLA's GEMM reads W^T as
  it is."""
  if x.shape[0] == 1 and w.codes.ndim == 2:
    return _row_xla(x, w)
  if jnp.dtype(x.dtype).itemsize == 2 and w.codes.ndim == 2:
    wt = _dequantize_nk_pairs(w, x.dtype)
  else:
    wt = w.dequantize_nk(x.dtype)
  if x.dtype == jnp.float32:
    return jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  return jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())))


dispatch.register_xla(Int4NKWeight, matmul_xla)
