"""Packing of 4-bit codes into uint32 words along K, in a tiled order.

A *tile order* with tile size ``tile_k`` (a multiple of 8) stores the codes of rows
``[t * tile_k, (t + 1) * tile_k)`` in ``tile_k // 8`` words per column: nibble ``j``
(bits ``4j .. 4j+3``) of word ``r`` of tile ``t`` holds logical row
``t * tile_k + j * (tile_k // 8) + r``.

* ``tile_k = 8`` is the plain GPTQ order: word ``r`` holds rows ``8r .. 8r+7``, low
  nibble first.
* ``tile_k = 128`` (:data:`NATIVE_TILE_K`) is the kernel-native order: after one load
  of ``[tile_k // 8, block_n]`` words, ``(words >> 4j) & 0xF`` is the contiguous row
  slab ``j`` of the tile, so a kernel needs neither an interleave nor a value slice.
  (Measured on the H100: this beat unpacking the plain order with a broadcast and a
  reshape into one ``[block_k, block_n]`` tile by 1.7-2.6x at M <= 16.)

Repacking between tile orders is lossless and jittable.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

PLAIN_TILE_K = 8
NATIVE_TILE_K = 128


def padded_rows(k: int, tile_k: int) -> int:
  """Rows of K once padded to a whole number of tiles."""
  return -(-k // tile_k) * tile_k


def check_tile_k(tile_k: int) -> None:
  if tile_k < 8 or tile_k % 8:
    raise ValueError(f"{tile_k=} must be a positive multiple of 8")


def pack_codes(codes: jax.Array, tile_k: int) -> jax.Array:
  """Packs 4-bit codes into uint32 words in tile order.

  Args:
    codes: ``[K, N]`` integer array with values in ``[0, 15]`` (any leading batch dims).
    tile_k: the tile order (8 = plain, 128 = kernel-native).

  Returns:
    ``[Kp // 8, N]`` uint32 with ``Kp = padded_rows(K, tile_k)``; padding rows hold 0.
  """
  check_tile_k(tile_k)
  xp = np if isinstance(codes, np.ndarray) else jnp
  *batch, k, n = codes.shape
  kp = padded_rows(k, tile_k)
  codes = codes.astype(xp.uint32)
  if kp != k:
    pad = [(0, 0)] * len(batch) + [(0, kp - k), (0, 0)]
    codes = xp.pad(codes, pad)
  planes = codes.reshape(*batch, kp // tile_k, 8, tile_k // 8, n)
  shifts = (xp.arange(8, dtype=xp.uint32) * 4).reshape(8, 1, 1)
  words = planes << shifts
  # The nibbles are disjoint, so a sum is the bitwise or.
  words = words.sum(axis=-3, dtype=xp.uint32)
  return words.reshape(*batch, kp // 8, n)


def unpack_codes(words: jax.Array, k: int, tile_k: int) -> jax.Array:
  """Inverse of :func:`pack_codes`.

  Args:
    words: ``[Kp // 8, N]`` uint32 (any leading batch dims).
    k: the logical number of rows.
    tile_k: the tile order the words were packed in.

  Returns:
    ``[K, N]`` uint8 codes in ``[0, 15]``.
  """
  check_tile_k(tile_k)
  xp = np if isinstance(words, np.ndarray) else jnp
  *batch, kw, n = words.shape
  kp = kw * 8
  if kp % tile_k or kp < k:
    raise ValueError(f"{words.shape=} does not hold {k=} rows in tile order {tile_k=}")
  tiles = words.reshape(*batch, kp // tile_k, 1, tile_k // 8, n)
  shifts = (xp.arange(8, dtype=xp.uint32) * 4).reshape(8, 1, 1)
  codes = (tiles >> shifts) & xp.uint32(0xF)
  codes = codes.reshape(*batch, kp, n)[..., :k, :]
  return codes.astype(xp.uint8)


def repack_codes(words: jax.Array, k: int, tile_k_from: int, tile_k_to: int) -> jax.Array:
  """Converts packed words from one tile order to another, losslessly."""
  if tile_k_from == tile_k_to:
    return words
  return pack_codes(unpack_codes(words, k, tile_k_from), tile_k_to)


def rows_by_plane(a: jax.Array, kp: int, tile_k: int) -> jax.Array:
  """Per-row values ``a [K, N]`` -> ``[Kp // tile_k, 8, tile_k // 8, N]``, indexed like the
  nibbles of the packed words (tile, nibble plane, word), zero on the ``Kp - K`` padding
  rows."""
  k = a.shape[0]
  return jnp.pad(a, ((0, kp - k), (0, 0))).reshape(kp // tile_k, 8, tile_k // 8, -1)


def word_plane_sum(x: jax.Array, words: jax.Array, k: int, tile_k: int,
                   plane_values: Callable[[int, jax.Array], jax.Array]) -> jax.Array:
  """``y [M, N] = sum_k x[m, k] W[k, n]`` in float32 as one multiply-and-sum over the
  packed words, with no dot: each word's 8 nibbles, turned into weights and multiplied by
  their 8 elements of x, are summed in one term, so XLA's reduction reads every word once.
  The XLA paths' one-row formulation (INT4 and FP4 ``matmul_reduce``).

  Args:
    x: ``[M, K]`` activations (computed in float32).
    words: ``[Kp // 8, N]`` uint32 codes in tile order ``tile_k``: nibble ``j`` of word
      ``r`` of tile ``t`` is row ``t * tile_k + j * tile_k / 8 + r``.
    plane_values: ``(j, q) -> [Kp // tile_k, tile_k // 8, N]`` float32 weights of nibble
      plane ``j`` from its codes ``q`` (uint32 in ``[0, 15]``, same shape); see
      :func:`rows_by_plane` for per-row parameters in that order.
  """
  m = x.shape[0]
  kp = words.shape[0] * 8
  tiles, slab = kp // tile_k, tile_k // 8
  words = words.reshape(tiles, slab, -1)
  xr = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kp - k))).reshape(m, tiles, 8, slab, 1)
  acc = None
  for j in range(8):
    term = xr[:, :, j] * plane_values(j, (words >> (4 * j)) & 0xF)  # [M, tiles, slab, N]
    acc = term if acc is None else acc + term
  return acc.sum(axis=(1, 2))
