"""The Marlin INT4 layout (IST-DASLab Marlin, vLLM ``gptq_marlin`` / ``awq_marlin``).

Marlin stores a ``[K, N]`` weight so that one 128-bit load per thread of a warp yields
exactly the B-operand fragments of ``mma.m16n8k16`` for a 16 x 64 tile (four 16 x 16
blocks side by side); no ``ldmatrix`` and no shuffle. This module reads and writes that
layout; it does not run the Marlin CUDA kernel.

Layout, for codes ``q [K, N]`` in ``[0, 15]`` (derived from the tensor-core fragment
layout; :func:`tile_order` builds it):

* ``qweight [K // 16, 2 * N]`` int32. Row ``t`` holds the 16 rows ``16t .. 16t + 15`` of
  every column, in chunks of 128 words = 1024 codes per 16 x 64 tile (tile ``c`` covers
  columns ``64c .. 64c + 63``). Inside a chunk, lane ``l`` of the warp (0..31) owns 32
  codes (4 words): for each 16 x 16 block ``j`` (0..3), the 8 codes at rows
  ``2 (l % 4) + {0, 1}`` and ``2 (l % 4) + 8 + {0, 1}`` of columns ``l // 4`` and
  ``l // 4 + 8`` (the m16n8k16 B fragments of two n8 halves). Those 8 codes go into one
  word with the nibble interleave ``[0, 2, 4, 6, 1, 3, 5, 7]`` (so that one
  ``lop3`` + shift dequantizes two fp16 pairs at a time).
* ``scales [K // G, N]`` in the checkpoint's float dtype (fp16 / bf16), columns permuted
  within blocks: grouped (``G < K``) as the transpose of every 8 x 8 block of 64 columns;
  per-channel (``G == K``) by the 32-column permutation ``8i + 2a + b <- 8a + 2i + b``.
* ``qzeros [K // G, N // 8]`` int32 or None (symmetric: zero point 8, vLLM's
  ``uint4b8``). The zero points get the grouped scale permutation (also when
  per-channel), then the nibble interleave ``[0, 2, 4, 6, 1, 3, 5, 7]`` per word.

``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]`` with ``z = 8`` when symmetric.
Act-order checkpoints are sorted by group before repacking (as vLLM does); this layout
has no ``g_idx``: use :meth:`GPTQWeight.to_int4`'s permutation first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import checkpoint_layouts as cl
from qjax._src import dispatch
from qjax._src import formats
from qjax._src import int4

TILE_K = 16
TILE_N = 64
NIBBLE_INTERLEAVE = cl.AWQ_ORDER  # (0, 2, 4, 6, 1, 3, 5, 7): nibble i <- code INTERLEAVE[i]


@functools.lru_cache(maxsize=None)
def tile_order() -> np.ndarray:
  """``[1024]`` int: the position in a 16 x 64 tile (``16 * 64`` row-major as
  ``block j, row r, col c`` = ``256 j + 16 r + c``) of each code in storage order.

  Storage index ``32 lane + 8 j + i`` (word ``4 lane + j`` of the tile, nibble ``i``)
  holds the code that the fragment order puts at slot ``NIBBLE_INTERLEAVE[i]``; the
  fragment slot ``s = 4 half + 2 hi + lo`` of lane ``lane`` in block ``j`` is row
  ``2 (lane % 4) + 8 hi + lo``, column ``lane // 4 + 8 half``.
  """
  lane = np.arange(32)[:, None, None]
  j = np.arange(4)[None, :, None]
  slot = np.asarray(NIBBLE_INTERLEAVE)[None, None, :]
  half, hi, lo = slot // 4, (slot // 2) % 2, slot % 2
  row = 2 * (lane % 4) + 8 * hi + lo
  col = lane // 4 + 8 * half
  return (256 * j + 16 * row + col).reshape(-1)


@functools.lru_cache(maxsize=None)
def _code_source(n: int) -> np.ndarray:
  """``[16 N]`` int: for storage position ``p`` of one ``qweight`` row (before packing),
  the index ``r * N + col`` in that row-block's ``[16, N]`` codes."""
  order = tile_order()
  p = np.arange(16 * n)
  tile, e = p // 1024, order[p % 1024]
  block, r, c = e // 256, (e // 16) % 16, e % 16
  col = 64 * tile + 16 * block + c
  return (r * n + col).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _code_destination(n: int) -> np.ndarray:
  """The inverse permutation of :func:`_code_source`."""
  return np.argsort(_code_source(n)).astype(np.int32)


def _scale_columns(n: int, per_channel: bool) -> np.ndarray:
  """``[N]`` int: stored column ``i`` holds logical column ``result[i]``."""
  if per_channel:  # 32-column blocks: stored 8i + 2a + b <- logical 8a + 2i + b
    idx = np.arange(32).reshape(4, 4, 2).transpose(1, 0, 2).reshape(-1)
    width = 32
  else:  # 64-column blocks: the transpose of an 8 x 8 block
    idx = np.arange(64).reshape(8, 8).T.reshape(-1)
    width = 64
  return (np.arange(n // width)[:, None] * width + idx[None, :]).reshape(-1)


def _check_tiles(k: int, n: int, who: str) -> None:
  if k % TILE_K or n % TILE_N:
    raise ValueError(
        f"{who}: shape (K={k}, N={n}) must have K a multiple of {TILE_K} and N a multiple "
        f"of {TILE_N} (Marlin's 16 x 64 tiles); keep such a weight as GPTQ or Int4Weight")


def _permute_columns(a: jax.Array, cols: np.ndarray) -> jax.Array:
  return jnp.take(a, jnp.asarray(cols), axis=-1)


def _unpermute_columns(a: jax.Array, cols: np.ndarray) -> jax.Array:
  return jnp.take(a, jnp.asarray(np.argsort(cols)), axis=-1)


def pack_marlin_codes(codes: jax.Array) -> jax.Array:
  """``[K, N]`` codes in ``[0, 15]`` -> ``[K // 16, 2 N]`` int32 Marlin words."""
  k, n = codes.shape
  rows = jnp.asarray(codes).astype(jnp.uint8).reshape(k // TILE_K, TILE_K * n)
  ordered = jnp.take(rows, jnp.asarray(_code_source(n)), axis=1)  # [K // 16, 16 N]
  return cl._pack_last(ordered.reshape(k // TILE_K, 2 * n, 8))


def unpack_marlin_codes(words: jax.Array, k: int, n: int) -> jax.Array:
  """Inverse of :func:`pack_marlin_codes`: ``[K // 16, 2 N]`` int32 -> ``[K, N]`` uint8."""
  ordered = cl._nibbles_last(words).reshape(k // TILE_K, TILE_K * n)
  rows = jnp.take(ordered, jnp.asarray(_code_destination(n)), axis=1)
  return rows.reshape(k, n)


@formats.register_format
@dataclasses.dataclass(frozen=True)
class MarlinWeight(cl._ContiguousGroups, formats.QuantizedWeight):
  """Marlin-layout 4-bit weight of logical shape ``[K, N]`` (see the module docstring).

  ``W[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n]``, ``z = 8`` without qzeros.

  Attributes:
    qweight: ``[K // 16, 2 N]`` int32 in Marlin tile order.
    scales: ``[K // G, N]`` float (f16, bf16 or f32), Marlin column order.
    qzeros: ``[K // G, N // 8]`` int32 zero points (Marlin column order, nibble
      interleave), or None (symmetric, ``uint4b8``).
    shape: the logical ``(K, N)``; K a multiple of 16, N of 64.
    group_size: ``G`` (-1 or K: per-channel).
  """

  format_name = "marlin"

  qweight: jax.Array
  scales: jax.Array
  qzeros: jax.Array | None
  shape: tuple[int, int] = formats.static_field()
  group_size: int = formats.static_field()

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    gs = k if int(self.group_size) == -1 else int(self.group_size)
    object.__setattr__(self, "group_size", gs)
    cl._check_logical("MarlinWeight", k, n, gs)
    _check_tiles(k, n, "MarlinWeight")
    if not self._leaves_concrete_2d():
      return
    ctx = f"shape={self.shape}, group_size={gs}"
    cl._check_array("MarlinWeight", "qweight", self.qweight, (k // TILE_K, 2 * n),
                    (jnp.int32,), ctx)
    cl._check_array("MarlinWeight", "scales", self.scales, (k // gs, n), int4.SCALE_DTYPES,
                    ctx)
    if self.qzeros is not None:
      cl._check_array("MarlinWeight", "qzeros", self.qzeros, (k // gs, n // 8),
                      (jnp.int32,), ctx)

  @property
  def per_channel(self) -> bool:
    """Whether one scale covers a whole column (``group_size == K``)."""
    return self.group_size == self.shape[0]

  @property
  def symmetric(self) -> bool:
    """Whether there are no zero points (``qzeros`` is None)."""
    return self.qzeros is None

  def unpack(self):
    """``(codes [K, N] uint8, scales [K // G, N], zeros [K // G, N] uint8 or None, None)``
    in logical order (exact)."""
    k, n = self.shape
    codes = unpack_marlin_codes(self.qweight, k, n)
    scales = _unpermute_columns(self.scales, _scale_columns(n, self.per_channel))
    zeros = None
    if self.qzeros is not None:
      z = cl.AWQWeight._unpack_awq(self.qzeros)  # undoes the nibble interleave
      zeros = _unpermute_columns(z, _scale_columns(n, per_channel=False))
    return codes, scales, zeros, None

  @classmethod
  def from_int4(cls, w: int4.Int4Weight) -> "MarlinWeight":
    """Packs an :class:`Int4Weight` (no biases) in Marlin order; lossless, jittable."""
    codes, scales, zeros = cl._int4_parts(w, "MarlinWeight.from_int4")
    k, n = w.shape
    _check_tiles(k, n, "MarlinWeight.from_int4")
    per_channel = w.group_size == k
    qzeros = None
    if zeros is not None:
      qzeros = cl.AWQWeight._pack_awq(_permute_columns(zeros, _scale_columns(n, False)))
    return cls(qweight=pack_marlin_codes(codes),
               scales=_permute_columns(scales, _scale_columns(n, per_channel)),
               qzeros=qzeros, shape=(k, n), group_size=w.group_size)


dispatch.register_xla(MarlinWeight, cl.matmul_xla)
dispatch.register_repack(MarlinWeight, int4.Int4Weight, cl.repack_for_int4_kernel)
