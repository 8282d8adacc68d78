"""Packing of 4-bit codes: bit-exact round trips in every tile order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax._src import packing


@pytest.mark.parametrize("tile_k", [8, 16, 128, 256])
@pytest.mark.parametrize("k,n", [(8, 1), (96, 33), (200, 7), (384, 64), (1000, 3)])
def test_round_trip_numpy_and_jax(rng, tile_k, k, n):
  codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
  words = packing.pack_codes(codes, tile_k)
  assert words.dtype == np.uint32
  assert words.shape == (packing.padded_rows(k, tile_k) // 8, n)
  np.testing.assert_array_equal(packing.unpack_codes(words, k, tile_k), codes)
  words_j = jax.jit(packing.pack_codes, static_argnums=1)(jnp.asarray(codes), tile_k)
  np.testing.assert_array_equal(np.asarray(words_j), words)
  np.testing.assert_array_equal(np.asarray(packing.unpack_codes(words_j, k, tile_k)), codes)


def test_plain_order_is_gptq(rng):
  codes = rng.integers(0, 16, (16, 5)).astype(np.uint8)
  words = packing.pack_codes(codes, 8)
  expect = np.zeros((2, 5), np.uint32)
  for i in range(8):  # the seed's pack_int4_to_uint32
    expect |= codes[i::8].astype(np.uint32) << (4 * i)
  np.testing.assert_array_equal(words, expect)


def test_native_order_puts_slabs_in_nibbles(rng):
  codes = rng.integers(0, 16, (128, 3)).astype(np.uint8)
  words = packing.pack_codes(codes, 128)
  for j in range(8):
    np.testing.assert_array_equal((words >> (4 * j)) & 0xF, codes[16 * j:16 * (j + 1)])


@pytest.mark.parametrize("src,dst", [(8, 128), (128, 8), (128, 256), (16, 8)])
def test_repack_is_lossless(rng, src, dst):
  codes = rng.integers(0, 16, (384, 9)).astype(np.uint8)
  words = packing.pack_codes(jnp.asarray(codes), src)
  out = jax.jit(packing.repack_codes, static_argnums=(1, 2, 3))(words, 384, src, dst)
  np.testing.assert_array_equal(np.asarray(packing.unpack_codes(out, 384, dst)), codes)


def test_bad_tile():
  with pytest.raises(ValueError, match="tile_k=12"):
    packing.pack_codes(np.zeros((16, 2), np.uint8), 12)
