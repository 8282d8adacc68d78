"""Public methods that no other test names, each against an independent reference (the
format's definition through ml_dtypes, gguf's own dequantizer, GPT-OSS's recipe in numpy,
or plain byte indexing), on random non-zero inputs with odd sizes where the format allows.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qjax
from qjax._src import fp4
from qjax._src import fp4_nk
from qjax._src import gguf_formats as gf
from qjax._src import gguf_tiled
from qjax._src import packing
from conftest import seed_from
import test_fp4
import test_marlin_layout

gguf = pytest.importorskip("gguf")


@pytest.fixture
def rng(request):
  return np.random.default_rng(seed_from(request.node.nodeid))


# -- block_scales of the four FP4 classes ---------------------------------------------------


def _e8m0_reference(scale_bytes) -> np.ndarray:
  """E8M0 bytes decoded by ml_dtypes (2 ** (e - 127); 255 is NaN), as float64."""
  return np.asarray(scale_bytes).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def _e4m3_reference(scales) -> np.ndarray:
  """The stored float8_e4m3fn bytes decoded by ml_dtypes, as float64."""
  raw = np.asarray(scales).view(np.uint8)
  return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _scale_bytes(rng, shape) -> np.ndarray:
  """Random bytes with the edge values (0, 1, 127, 254, 255) among them."""
  b = rng.integers(0, 256, shape, dtype=np.uint8)
  b.reshape(-1)[:5] = [0, 1, 127, 254, 255]
  return b


@pytest.mark.parametrize("lead", [(), (3,)])
def test_mxfp4_block_scales(rng, lead):
  k, n = 96, 13  # 3 blocks, K padded to one 128-row tile, odd N
  kp = packing.padded_rows(k, packing.NATIVE_TILE_K)
  codes = rng.integers(0, 2**32, (*lead, kp // 8, n), dtype=np.uint32)
  scales = _scale_bytes(rng, (*lead, k // 32, n))
  w = qjax.MXFP4Weight(codes=jnp.asarray(codes), scales=jnp.asarray(scales), shape=(k, n))
  got = np.asarray(w.block_scales())
  assert got.dtype == np.float32 and got.shape == (*lead, k // 32, n)
  np.testing.assert_array_equal(got.astype(np.float64), _e8m0_reference(scales))


def test_mxfp4_nk_block_scales(rng):
  k, n = 160, 7
  codes = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
  scales = _scale_bytes(rng, (k // 32, n))
  w = fp4_nk.MXFP4NKWeight(codes=jnp.asarray(codes), scales=jnp.asarray(scales), shape=(k, n))
  got = np.asarray(w.block_scales())
  assert got.dtype == np.float32 and got.shape == (k // 32, n)
  np.testing.assert_array_equal(got.astype(np.float64), _e8m0_reference(scales))


@pytest.mark.parametrize("nk", [False, True])
def test_nvfp4_block_scales(rng, nk):
  k, n = (96, 11) if nk else (48, 11)  # NK needs K % 32 == 0; row-major K % 16
  raw = rng.integers(0, 256, (k // 16, n), dtype=np.uint8)
  raw.reshape(-1)[:4] = [0x00, 0x01, 0x7E, 0x7F]  # zero, smallest subnormal, 448, NaN
  scales = jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn))
  g = jnp.float32(0.37)  # block_scales excludes the tensor scale
  if nk:
    codes = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
    w = fp4_nk.NVFP4NKWeight(codes=jnp.asarray(codes), scales=scales, global_scale=g,
                             shape=(k, n))
  else:
    kp = packing.padded_rows(k, packing.NATIVE_TILE_K)
    codes = rng.integers(0, 2**32, (kp // 8, n), dtype=np.uint32)
    w = fp4.NVFP4Weight(codes=jnp.asarray(codes), scales=scales, global_scale=g,
                        shape=(k, n))
  got = np.asarray(w.block_scales())
  assert got.dtype == np.float32 and got.shape == (k // 16, n)
  np.testing.assert_array_equal(got.astype(np.float64), _e4m3_reference(scales))


# -- GGUFBlockWeight.num_blocks / block_grid / split_blocks -----------------------------------


def _random_rows(rng, ggml_type: str, k: int, n: int, leading=()) -> np.ndarray:
  """``[*leading, N, row_bytes]`` uint8: random blocks with finite non-zero f16 fields."""
  cls = gf.BLOCK_FORMATS[ggml_type]
  nb = k // cls.block_size
  raw = rng.integers(0, 256, (*leading, n, nb, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.uniform(0.5, 2.0, raw.shape[:-1]) * rng.choice([-1, 1], raw.shape[:-1]) * 0.01)
      raw[..., f.offset:f.offset + 2] = v.astype("<f2").view(np.uint8).reshape(
          *raw.shape[:-1], 2)
  return raw.reshape(*leading, n, nb * cls.type_size)


GGUF_CASES = [("Q4_0", 96, 5, ()), ("Q8_0", 160, 3, ()), ("Q4_K", 768, 3, ()),
              ("Q6_K", 512, 5, (3,)), ("Q5_K", 256, 7, (2,))]


@pytest.mark.parametrize("ggml_type,k,n,leading", GGUF_CASES)
def test_gguf_num_blocks_and_block_grid(rng, ggml_type, k, n, leading):
  cls = gf.BLOCK_FORMATS[ggml_type]
  raw = _random_rows(rng, ggml_type, k, n, leading)
  w = gf.from_gguf_bytes(raw, ggml_type, (k, n), leading)
  assert w.num_blocks == k // {"Q4_0": 32, "Q8_0": 32}.get(ggml_type, 256)
  grid = cls.block_grid(raw, (k, n), leading)
  nb = w.num_blocks
  assert grid.dtype == np.uint8 and grid.shape == (*leading, n, nb, cls.type_size)
  flat = raw.reshape(-1)
  rows = int(np.prod(leading, dtype=np.int64)) * n
  for r in range(rows):  # block b of row r: bytes [(r * nb + b) * size, + size) of the file
    for b in range(nb):
      start = (r * nb + b) * cls.type_size
      np.testing.assert_array_equal(grid.reshape(rows, nb, -1)[r, b],
                                    flat[start:start + cls.type_size])
  with pytest.raises(ValueError, match=f"needs {raw.size} bytes, got {raw.size - 1}"):
    cls.block_grid(flat[:-1], (k, n), leading)


@pytest.mark.parametrize("ggml_type,k,n,leading", GGUF_CASES)
def test_gguf_split_blocks(rng, ggml_type, k, n, leading):
  """Every field of every block equals its bytes decoded little-endian by hand."""
  cls = gf.BLOCK_FORMATS[ggml_type]
  raw = _random_rows(rng, ggml_type, k, n, leading)
  parts = cls.split_blocks(raw, (k, n), leading)
  nb = k // cls.block_size
  rows = int(np.prod(leading, dtype=np.int64)) * n
  blocks = raw.reshape(rows, nb, cls.type_size)
  assert sorted(parts) == sorted(f.name for f in cls.block_fields)
  for f in cls.block_fields:
    got = parts[f.name]
    assert got.dtype == np.dtype(f.dtype) and got.shape == (*leading, n, nb, *f.tail)
    got = got.reshape(rows, nb, -1)
    for r in range(rows):
      for b in range(nb):
        chunk = bytes(blocks[r, b, f.offset:f.offset + f.nbytes])
        want = np.frombuffer(chunk, np.dtype(f.dtype).newbyteorder("<"))
        np.testing.assert_array_equal(got[r, b].view(np.uint8), want.view(np.uint8))


# -- GGUFTiledWeight.scale_rows / high_bits / padded_k / group_affine ---------------------------

# GGUF's definitions: rows per d (a block of 32, or a 256-row super-block for the K-quants),
# code bits beyond the low 4 (Q8_0 keeps int8 codes of its own), and the group of a sub-scale.
TILED_SPEC = {"Q8_0": (32, 0, 32), "Q4_K": (256, 0, 32), "Q5_K": (256, 1, 32),
              "Q6_K": (256, 2, 16)}
CODE_FIELDS = {"Q8_0": ("qs",), "Q4_K": ("qs",), "Q5_K": ("qs", "qh"), "Q6_K": ("ql", "qh")}


def _with_codes(raw, ggml_type: str, k: int, n: int, code: int, zero_dmin: bool):
  """``raw`` with every code set to ``code`` (0 or 1: low bits only, high bits 0) and,
  with ``zero_dmin``, the K-quants' ``dmin`` set to 0."""
  cls = gf.BLOCK_FORMATS[ggml_type]
  blocks = raw.reshape(n, k // cls.block_size, cls.type_size).copy()
  for f in cls.block_fields:
    if f.name in CODE_FIELDS[ggml_type]:
      low = f.name != "qh"
      byte = (0x11 if ggml_type != "Q8_0" else 0x01) * code if low else 0
      blocks[..., f.offset:f.offset + f.nbytes] = byte
    if f.name == "dmin" and zero_dmin:
      blocks[..., f.offset:f.offset + f.nbytes] = 0
  return blocks.reshape(raw.shape)


def _gguf_dequantize(raw, ggml_type) -> np.ndarray:
  """gguf's own dequantizer: ``[K, N]`` float64."""
  return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]).astype(
      np.float64).T


@pytest.mark.parametrize("ggml_type,k,n", [("Q8_0", 160, 5), ("Q4_K", 768, 3),
                                           ("Q5_K", 256, 7), ("Q6_K", 512, 5)])
def test_gguf_tiled_properties_and_group_affine(rng, ggml_type, k, n):
  raw = _random_rows(rng, ggml_type, k, n)
  t = gguf_tiled.GGUFTiledWeight.from_gguf(gf.from_gguf_bytes(raw, ggml_type, (k, n)))
  scale_rows, high_bits, group = TILED_SPEC[ggml_type]
  assert (t.scale_rows, t.high_bits) == (scale_rows, high_bits)
  assert t.padded_k == -(-k // 128) * 128 and t.padded_k % 128 == 0 and t.padded_k >= k
  s, b = t.group_affine()
  assert s.dtype == b.dtype == jnp.float32 and s.shape == b.shape == (k // group, n)
  # W = s * q + b per group: codes 0 give b, codes 1 with dmin = 0 give s (Q6_K: codes 0
  # give -32 s), each product exact in float32, read at each group's first row.
  zero = _gguf_dequantize(_with_codes(raw, ggml_type, k, n, 0, False), ggml_type)[::group]
  one = _gguf_dequantize(_with_codes(raw, ggml_type, k, n, 1, True), ggml_type)[::group]
  if ggml_type == "Q6_K":
    want_s, want_b = zero / -32.0, zero
  elif ggml_type == "Q8_0":
    want_s, want_b = one, np.zeros_like(one)
  else:
    want_s, want_b = one, zero
  assert np.count_nonzero(want_s) > want_s.size // 2  # random, mostly non-zero scales
  np.testing.assert_array_equal(np.asarray(s, np.float64), want_s)
  np.testing.assert_array_equal(np.asarray(b, np.float64), want_b)


# -- MarlinWeight.per_channel, GptOssMXFP4Weight.output_rows, LayerStack ----------------------


@pytest.mark.parametrize("k,n,g,symmetric", test_marlin_layout.CASES)
def test_marlin_per_channel(rng, k, n, g, symmetric):
  codes, scales, zeros = test_marlin_layout._random(rng, k, n, g, symmetric)
  qweight, s, qzeros = test_marlin_layout.ref_marlin_pack(codes, scales, zeros, g)
  lay = qjax.MarlinWeight(qweight=jnp.asarray(qweight), scales=jnp.asarray(s),
                          qzeros=None if qzeros is None else jnp.asarray(qzeros),
                          shape=(k, n), group_size=g)
  # One scale row per column: the scales' K extent is 1.
  assert lay.per_channel is (np.asarray(lay.scales).shape[0] == 1)
  assert lay.per_channel is (g == k)


@pytest.mark.parametrize("index", [slice(0, None, 2), slice(1, None, 2), slice(2, 9),
                                   slice(None, None, -3)])
def test_gpt_oss_output_rows(rng, index):
  k, n = 96, 11  # 3 blocks of 32, odd N
  blocks = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
  scales = rng.integers(118, 134, (n, k // 32), dtype=np.uint8)
  w = qjax.GptOssMXFP4Weight(blocks=jnp.asarray(blocks), scales=jnp.asarray(scales),
                             shape=(k, n))
  part = w.output_rows(index)
  rows = np.arange(n)[index]
  assert isinstance(part, qjax.GptOssMXFP4Weight) and part.shape == (k, len(rows))
  want = test_fp4.np_gpt_oss_dequantize(blocks[rows], scales[rows]).T  # [K, rows]
  np.testing.assert_array_equal(np.asarray(part.dequantize(), np.float64), want)


@pytest.mark.parametrize("num,group,carried", [(7, 2, 1), (5, 3, None), (3, 8, None),
                                               (9, 4, 3)])
def test_prefetch_buffer_bytes(rng, num, group, carried):
  ws = [qjax.quantize_codebook(rng.standard_normal((128, 128)).astype(np.float32),
                               passes=2, seed=3) for _ in range(num)]
  stack = qjax.stack_layers(ws, offload_pass2=False, group=group, carried=carried)
  g = min(group, num)
  c = g if carried is None else carried
  # Every layer's pass 2 takes the same bytes; G + C of them (at most L) are buffered.
  one, rest = divmod(stack.pass2_bytes(), num)
  assert rest == 0 and one > 0
  assert stack.prefetch_buffer_bytes() == min(g + c, num) * one
