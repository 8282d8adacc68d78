"""GPTQ / AWQ / compressed-tensors layouts: float64 numpy references and lossless to_int4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax._src import checkpoint_layouts as cl
from qjax._src import dispatch
from qjax._src import int4
from qjax._src import packing

SHAPES = [(256, 64), (384, 40)]
GROUPS = [32, 128]


def _random_int4(rng, k, n, g, symmetric, tile_k=packing.NATIVE_TILE_K):
  codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
  scales = (rng.standard_normal((k // g, n)) * 0.05).astype(np.float16)
  zeros = None if symmetric else rng.integers(1, 16, (k // g, n)).astype(np.uint8)
  return int4.Int4Weight(codes=packing.pack_codes(jnp.asarray(codes), tile_k),
                         scales=jnp.asarray(scales),
                         zeros=None if zeros is None else jnp.asarray(zeros),
                         shape=(k, n), group_size=g, tile_k=tile_k), codes, scales, zeros


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def _u32(a):
  return np.asarray(a).astype(np.int64) & 0xFFFFFFFF


# ------------------------------------------------------ independent float64 references


def ref_gptq(qweight, qzeros, scales, g_idx, group_size, version):
  qw, qz = _u32(qweight), _u32(qzeros)
  kw, n = qw.shape
  k = kw * 8
  q = np.zeros((k, n), np.int64)
  for r in range(kw):
    for i in range(8):
      q[8 * r + i] = (qw[r] >> (4 * i)) & 0xF
  ng, nw = qz.shape
  z = np.zeros((ng, nw * 8), np.int64)
  for c in range(nw):
    for i in range(8):
      z[:, 8 * c + i] = (qz[:, c] >> (4 * i)) & 0xF
  if version == 1:
    z = z + 1
  g = np.arange(k) // group_size if g_idx is None else np.asarray(g_idx)
  s = np.asarray(scales, np.float64)
  return (q - z[g]) * s[g]


def ref_awq(qweight, qzeros, scales, group_size):
  order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds column 8c + order[i] (AutoAWQ pack)

  def unpack(words):
    w = _u32(words)
    r, nw = w.shape
    out = np.zeros((r, nw * 8), np.int64)
    for c in range(nw):
      for i in range(8):
        out[:, 8 * c + order[i]] = (w[:, c] >> (4 * i)) & 0xF
    return out

  q, z = unpack(qweight), unpack(qzeros)
  k = q.shape[0]
  g = np.arange(k) // group_size
  return (q - z[g]) * np.asarray(scales, np.float64)[g]


def ref_ct_unpack_zero_point(packed, n):
  """compressed-tensors ``unpack_from_int32(zp, 4, (N, K // G), packed_dim=0)``
  (compressors/quantized_compressors/pack_quantized.py): ``[ceil(N / 8), K // G]`` int32
  -> ``[N, K // G]`` signed zero points."""
  p = _u32(packed)
  out = np.zeros((p.shape[0] * 8, p.shape[1]), np.int64)
  for i in range(8):
    out[i::8, :] = (p >> (4 * i)) & 0xF
  return out[:n] - 8


def ref_ct_pack_zero_point(zp):
  """compressed-tensors ``pack_to_int32(zp, 4, packed_dim=0)``: ``[N, K // G]`` int8 in
  [-8, 7] -> offset binary, transposed, padded to 8 columns, 8 per int32 low nibble
  first, transposed back: ``[ceil(N / 8), K // G]`` int32."""
  v = (zp.astype(np.int64) + 8).T
  v = np.pad(v, ((0, 0), (0, -v.shape[1] % 8)))
  rows, cols = v.shape
  words = (v.reshape(rows, cols // 8, 8) << (4 * np.arange(8))).sum(-1)
  return words.astype(np.uint32).view(np.int32).T


def ref_ct(weight_packed, weight_scale, weight_zero_point, group_size):
  wp = _u32(weight_packed)
  n, kw = wp.shape
  v = np.zeros((n, kw * 8), np.int64)
  for j in range(kw):
    for i in range(8):
      v[:, 8 * j + i] = ((wp[:, j] >> (4 * i)) & 0xF) - 8
  g = np.arange(kw * 8) // group_size
  if weight_zero_point is not None and np.asarray(weight_zero_point).dtype == np.int32:
    weight_zero_point = ref_ct_unpack_zero_point(weight_zero_point, n)
  zp = 0 if weight_zero_point is None else np.asarray(weight_zero_point, np.int64)[:, g]
  w_nk = (v - zp) * np.asarray(weight_scale, np.float64)[:, g]
  return w_nk.T


def ref_int4(codes, scales, zeros, g):
  k = codes.shape[0]
  gi = np.arange(k) // g
  z = 8 if zeros is None else zeros.astype(np.int64)[gi]
  return (codes.astype(np.int64) - z) * scales.astype(np.float64)[gi]


# -------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_trips_match_reference(rng, k, n, g, symmetric):
  w, codes, scales, zeros = _random_int4(rng, k, n, g, symmetric)
  want = ref_int4(codes, scales, zeros, g)
  np.testing.assert_array_equal(np.asarray(w.dequantize(), np.float64), want)
  base = _bits(w.dequantize())
  layouts = [cl.GPTQWeight.from_int4(w, zero_point_version=1),
             cl.GPTQWeight.from_int4(w, zero_point_version=2),
             cl.AWQWeight.from_int4(w), cl.CompressedTensorsWeight.from_int4(w),
             cl.CompressedTensorsWeight.from_int4(w, pack_zero_point=False)]
  for lay in layouts:
    if isinstance(lay, cl.GPTQWeight):
      ref = ref_gptq(lay.qweight, lay.qzeros, lay.scales, None, g, lay.zero_point_version)
      assert lay.symmetric == symmetric
    elif isinstance(lay, cl.AWQWeight):
      ref = ref_awq(lay.qweight, lay.qzeros, lay.scales, g)
    else:
      ref = ref_ct(lay.weight_packed, lay.weight_scale, lay.weight_zero_point, g)
      assert lay.symmetric == symmetric
    np.testing.assert_array_equal(ref, want, err_msg=type(lay).__name__)
    np.testing.assert_array_equal(np.asarray(lay.dequantize(), np.float64), ref)
    for tile_k in (packing.NATIVE_TILE_K, packing.PLAIN_TILE_K):
      w4 = lay.to_int4(tile_k=tile_k)
      assert isinstance(w4, int4.Int4Weight) and w4.tile_k == tile_k
      np.testing.assert_array_equal(_bits(w4.dequantize()), base)
    uc, us, uz, ug = lay.unpack()
    assert uc.shape == (k, n) and uc.dtype == jnp.uint8 and ug is None
    np.testing.assert_array_equal(np.asarray(uc), codes)
    np.testing.assert_array_equal(np.asarray(us, np.float32), scales.astype(np.float32))
    zz = np.full((k // g, n), 8) if uz is None else np.asarray(uz)
    np.testing.assert_array_equal(zz, np.full((k // g, n), 8) if zeros is None else zeros)


def test_stored_conventions(rng):
  k, n, g = 256, 64, 128
  w, codes, scales, zeros = _random_int4(rng, k, n, g, symmetric=True)
  # Symmetric GPTQ stores 8 (v2) / 7 (v1) in every nibble.
  assert (_u32(cl.GPTQWeight.from_int4(w, zero_point_version=2).qzeros) == 0x88888888).all()
  assert (_u32(cl.GPTQWeight.from_int4(w, zero_point_version=1).qzeros) == 0x77777777).all()
  # Asymmetric v1 = v2 minus 0x11111111 per word, as GPTQModel converts
  # (gptqmodel/utils/model.py convert_gptq_v2_to_v1_format_module; AutoGPTQ
  # auto_gptq/modeling/_utils.py convert_gptq_v2_to_v1_format), exact for zeros >= 1.
  wa, *_ = _random_int4(rng, k, n, g, symmetric=False)  # zeros in [1, 15]
  v1 = _u32(cl.GPTQWeight.from_int4(wa, zero_point_version=1).qzeros)
  v2 = _u32(cl.GPTQWeight.from_int4(wa, zero_point_version=2).qzeros)
  np.testing.assert_array_equal(v1, (v2 - 0x11111111) & 0xFFFFFFFF)
  # AWQ: columns 0..7 = 0..7 land in nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7.
  c = np.tile(np.arange(8, dtype=np.uint8), (k, n // 8))
  wc = int4.Int4Weight(codes=packing.pack_codes(jnp.asarray(c), 128), scales=w.scales,
                       zeros=jnp.zeros((k // g, n), jnp.uint8), shape=(k, n), group_size=g)
  assert (_u32(cl.AWQWeight.from_int4(wc).qweight) == 0x75316420).all()
  # compressed-tensors: code q stored as is (= signed value + 8), low nibble first.
  r = np.tile(np.arange(8, dtype=np.uint8)[:, None], (k // 8, n))
  wr = int4.Int4Weight(codes=packing.pack_codes(jnp.asarray(r), 128), scales=w.scales,
                       zeros=None, shape=(k, n), group_size=g)
  ct = cl.CompressedTensorsWeight.from_int4(wr)
  assert ct.weight_packed.shape == (n, k // 8) and (_u32(ct.weight_packed) == 0x76543210).all()
  np.testing.assert_array_equal(np.asarray(ct.dequantize())[:8, 0],
                                (np.arange(8) - 8) * scales[0, 0].astype(np.float32))


@pytest.mark.parametrize("n", [64, 36])
def test_compressed_tensors_packed_zero_point(rng, n):
  """Asymmetric zero points as compressed-tensors (>= April 2025) writes them: int32
  packed along N, ``[ceil(N / 8), K // G]``."""
  k, g = 256, 32
  codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
  scales = (rng.standard_normal((k // g, n)) * 0.05).astype(np.float16)
  zp = rng.integers(-8, 8, (n, k // g)).astype(np.int8)  # signed, [N, K // G]
  packed_zp = ref_ct_pack_zero_point(zp)
  assert packed_zp.shape == (-(-n // 8), k // g) and packed_zp.dtype == np.int32
  np.testing.assert_array_equal(ref_ct_unpack_zero_point(packed_zp, n), zp)
  weight_packed = np.asarray(cl._pack_last(jnp.asarray(codes.T.reshape(n, k // 8, 8))))
  ct = cl.CompressedTensorsWeight(weight_packed=jnp.asarray(weight_packed),
                                  weight_scale=jnp.asarray(scales.T),
                                  weight_zero_point=jnp.asarray(packed_zp),
                                  weight_shape=(n, k), group_size=g)
  assert ct.zero_point_packed and not ct.symmetric
  want = ref_ct(weight_packed, scales.T, packed_zp, g)
  np.testing.assert_array_equal(np.asarray(ct.dequantize(), np.float64), want)
  _, _, zeros, _ = ct.unpack()
  np.testing.assert_array_equal(np.asarray(zeros), (zp.astype(np.int64) + 8).T)
  w4 = jax.jit(lambda c: c.to_int4())(ct)
  np.testing.assert_array_equal(_bits(w4.dequantize()), _bits(want))
  back = cl.CompressedTensorsWeight.from_int4(w4)
  np.testing.assert_array_equal(np.asarray(back.weight_zero_point), packed_zp)
  unpacked = cl.CompressedTensorsWeight.from_int4(w4, pack_zero_point=False)
  np.testing.assert_array_equal(np.asarray(unpacked.weight_zero_point), zp)
  with pytest.raises(ValueError, match=r"weight_zero_point must be \(%d, 8\)" % -(-n // 8)):
    cl.CompressedTensorsWeight(weight_packed=ct.weight_packed, weight_scale=ct.weight_scale,
                               weight_zero_point=jnp.asarray(packed_zp[:1]),
                               weight_shape=(n, k), group_size=g)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_act_order(rng, k, n, g, version, symmetric):
  w, codes, scales, zeros = _random_int4(rng, k, n, g, symmetric)
  g_idx = rng.permutation(np.arange(k) // g).astype(np.int32)
  lay = cl.GPTQWeight.from_int4(w, zero_point_version=version, g_idx=jnp.asarray(g_idx))
  ref = ref_gptq(lay.qweight, lay.qzeros, lay.scales, g_idx, g, version)
  zf = np.full((k // g, n), 8.0) if zeros is None else zeros.astype(np.float64)
  np.testing.assert_array_equal(ref, (codes - zf[g_idx]) * scales.astype(np.float64)[g_idx])
  deq = np.asarray(lay.dequantize())
  np.testing.assert_array_equal(deq.astype(np.float64), ref)
  assert lay.unpack()[3] is lay.g_idx
  out = lay.to_int4()
  assert isinstance(out, tuple)
  w4, perm = out
  assert perm.shape == (k,) and perm.dtype == jnp.int32
  perm = np.asarray(perm)
  np.testing.assert_array_equal(np.sort(perm), np.arange(k))
  np.testing.assert_array_equal(_bits(w4.dequantize()), _bits(deq[perm]))
  assert (w4.zeros is None) == symmetric
  # x[:, perm] @ W_int4 == x @ W, checked against float64.
  x = rng.standard_normal((5, k)).astype(np.float32)
  y_ref = x.astype(np.float64) @ ref
  y4 = dispatch.matmul(jnp.asarray(x[:, perm]), w4, implementation="xla")
  y = dispatch.matmul(jnp.asarray(x), lay, implementation="xla")
  for got in (y4, y):
    np.testing.assert_allclose(np.asarray(got, np.float64), y_ref, rtol=1e-5, atol=1e-5)


def test_gptq_trivial_g_idx_gives_plain_int4(rng):
  k, n, g = 256, 64, 32
  w, *_ = _random_int4(rng, k, n, g, symmetric=False)
  lay = cl.GPTQWeight.from_int4(w, g_idx=jnp.arange(k, dtype=jnp.int32) // g)
  w4 = lay.to_int4()
  assert isinstance(w4, int4.Int4Weight)
  np.testing.assert_array_equal(_bits(w4.dequantize()), _bits(w.dequantize()))


def test_jit_and_tree_map(rng):
  k, n, g = 384, 40, 128
  w, *_ = _random_int4(rng, k, n, g, symmetric=False)
  base = _bits(w.dequantize())
  g_idx = jnp.asarray(rng.permutation(np.arange(k) // g).astype(np.int32))
  for lay in [cl.GPTQWeight.from_int4(w, zero_point_version=1), cl.AWQWeight.from_int4(w),
              cl.CompressedTensorsWeight.from_int4(w)]:
    same = jax.tree.map(lambda a: a, lay)
    assert type(same) is type(lay) and same.shape == (k, n)
    assert jax.tree.structure(same) == jax.tree.structure(lay)
    np.testing.assert_array_equal(_bits(jax.jit(lambda l: l.dequantize())(lay)), base)
    w4 = jax.jit(lambda l: l.to_int4())(lay)
    np.testing.assert_array_equal(_bits(w4.dequantize()), base)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    y = jax.jit(lambda x, l: dispatch.matmul(x, l, implementation="xla"))(x, lay)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w.dequantize()),
                               rtol=1e-5, atol=1e-5)
  lay = cl.GPTQWeight.from_int4(w, g_idx=g_idx)
  w4, perm = jax.jit(lambda l: l.to_int4())(lay)
  np.testing.assert_array_equal(_bits(w4.dequantize()),
                                _bits(np.asarray(lay.dequantize())[np.asarray(perm)]))


def test_errors(rng):
  k, n, g = 256, 64, 128
  w, *_ = _random_int4(rng, k, n, g, symmetric=False)
  lay = cl.GPTQWeight.from_int4(w)
  with pytest.raises(ValueError, match=r"qweight must be \(32, 64\).*got \(31, 64\)"):
    cl.GPTQWeight(qweight=lay.qweight[:31], qzeros=lay.qzeros, scales=lay.scales,
                  g_idx=None, shape=(k, n), group_size=g)
  with pytest.raises(ValueError, match=r"qzeros must be \(2, 8\)"):
    cl.GPTQWeight(qweight=lay.qweight, qzeros=lay.qzeros.T, scales=lay.scales,
                  g_idx=None, shape=(k, n), group_size=g)
  with pytest.raises(ValueError, match=r"K=256 must be a multiple of group_size=96"):
    cl.GPTQWeight(qweight=lay.qweight, qzeros=lay.qzeros, scales=lay.scales,
                  g_idx=None, shape=(k, n), group_size=96)
  with pytest.raises(ValueError, match=r"zero_point_version=3"):
    cl.GPTQWeight(qweight=lay.qweight, qzeros=lay.qzeros, scales=lay.scales,
                  g_idx=None, shape=(k, n), group_size=g, zero_point_version=3)
  with pytest.raises(ValueError, match=r"g_idx\[0\]=5 is outside \[0, 2\)"):
    cl.GPTQWeight(qweight=lay.qweight, qzeros=lay.qzeros, scales=lay.scales,
                  g_idx=jnp.full((k,), 5, jnp.int32), shape=(k, n), group_size=g)
  bad = jnp.zeros((k,), jnp.int32)  # every row in group 0
  with pytest.raises(ValueError, match=r"group 0 256 rows, not group_size=128"):
    cl.GPTQWeight.from_int4(w, g_idx=bad).to_int4()
  with pytest.raises(ValueError, match=r"N=36 must be a multiple of 8"):
    cl.AWQWeight(qweight=jnp.zeros((k, 4), jnp.int32), qzeros=jnp.zeros((2, 4), jnp.int32),
                 scales=jnp.zeros((2, 36), jnp.float16), shape=(k, 36), group_size=g)
  awq = cl.AWQWeight.from_int4(w)
  with pytest.raises(ValueError, match=r"AWQWeight.scales must be \(2, 64\).*int32"):
    cl.AWQWeight(qweight=awq.qweight, qzeros=awq.qzeros, scales=awq.qzeros.astype(jnp.int32),
                 shape=(k, n), group_size=g)
  ct = cl.CompressedTensorsWeight.from_int4(w)
  with pytest.raises(ValueError, match=r"weight_packed must be \(64, 32\).*got \(32, 64\)"):
    cl.CompressedTensorsWeight(weight_packed=ct.weight_packed.T, weight_scale=ct.weight_scale,
                               weight_zero_point=ct.weight_zero_point, weight_shape=(n, k),
                               group_size=g)
  with pytest.raises(ValueError, match=r"outside \[-8, 7\]"):
    cl.CompressedTensorsWeight(weight_packed=ct.weight_packed, weight_scale=ct.weight_scale,
                               weight_zero_point=jnp.full((n, 2), 9, jnp.int8),
                               weight_shape=(n, k), group_size=g)
  # v1 cannot store a zero point of 0; symmetric GPTQ must hold zeros of 8.
  w0 = int4.Int4Weight(codes=w.codes, scales=w.scales, zeros=jnp.zeros_like(w.zeros),
                       shape=(k, n), group_size=g)
  with pytest.raises(ValueError, match=r"outside \[1, 16\]"):
    cl.GPTQWeight.from_int4(w0, zero_point_version=1)
  with pytest.raises(ValueError, match=r"GPTQWeight: symmetric=True but .* not 8"):
    cl.GPTQWeight(qweight=lay.qweight, qzeros=lay.qzeros, scales=lay.scales, g_idx=None,
                  shape=(k, n), group_size=g, symmetric=True)
  wb = int4.Int4Weight(codes=w.codes, scales=w.scales, zeros=None, biases=w.scales,
                       shape=(k, n), group_size=g)
  with pytest.raises(ValueError, match=r"biases"):
    cl.AWQWeight.from_int4(wb)
