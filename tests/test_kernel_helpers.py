"""Direct tests of pallas_kernels helpers that the kernel tests reach only inside a kernel:
int4_gemv.divisor_near / loop_shape / heuristic_config; int4_matmul.x_sum_* (both paths:
``plgpu.dot`` is a plain ``dot_general`` outside a kernel); fp4_codec.scale_decoder (tensor
scale, ``use_ptx``), kernel_scales, use_ptx_scales; fp4_matmul.paired_decode,
accumulate_k_tile; fp4_gemv.Plan, accumulate (word_step's plain path); common.store_tile
and LayerRef (through an interpret-mode pallas_call where they need refs).

References: brute force over divisors, float64 numpy, ml_dtypes for E2M1 / E8M0 / e4m3,
codes packed into the native tile order here. Tested directly elsewhere, so not here:
e8m0_to_f32 and e4m3_to_f32_times_2_pow_minus_8 on all 256 bytes, scale_decoder without a
tensor scale (test_fp4_gemv.py), pairs_fit and sum_by_dot (test_matmul.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import qjax
from pallas_kernels import common
from pallas_kernels import fp4_codec
from pallas_kernels import fp4_gemv
from pallas_kernels import fp4_matmul
from pallas_kernels import int4_gemv
from pallas_kernels import int4_matmul

_SCALE_DTYPES = {"e8m0": ml_dtypes.float8_e8m0fnu, "e4m3": ml_dtypes.float8_e4m3fn}
_BLOCK = {"e8m0": 32, "e4m3": 16}  # MXFP4 and NVFP4 rows per scale


def _pack_native(codes):
  """``[K, N]`` codes (K a multiple of 128) -> ``[K // 8, N]`` uint32 words: nibble ``j``
  of word ``r`` of K-tile ``t`` is row ``128 t + 16 j + r``."""
  k, n = codes.shape
  c = codes.astype(np.uint32).reshape(k // 128, 8, 16, n)
  shifts = (4 * np.arange(8, dtype=np.uint32))[None, :, None, None]
  return np.bitwise_or.reduce(c << shifts, axis=1).reshape(k // 8, n)


def _scale_f64(data, fmt):
  return np.asarray(data, np.uint8).view(_SCALE_DTYPES[fmt]).astype(np.float64)


def _fp4_problem(rng, fmt, k, n, m=1):
  """Random nonzero x ``[m, K]``, codes (all 16, -0 and the subnormal included), scale
  bytes (E8M0 near 127; e4m3 of either sign, not 0 or NaN), a tensor scale (e4m3 only)
  and the float64 W."""
  x = rng.standard_normal((m, k))
  x = np.where(np.abs(x) < 1e-3, 1e-3, x)
  codes = rng.integers(0, 16, (k, n), dtype=np.uint8)
  shape = (k // _BLOCK[fmt], n)
  scales = (rng.integers(117, 138, shape, dtype=np.uint8) if fmt == "e8m0" else
            rng.integers(1, 0x7F, shape, np.uint8) | rng.integers(0, 2, shape, np.uint8) << 7)
  g = np.float32(10.0 ** rng.uniform(-2, 2)) if fmt == "e4m3" else None
  w = (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
       * np.repeat(_scale_f64(scales, fmt), _BLOCK[fmt], axis=0) * (1.0 if g is None else g))
  return x, codes, scales, g, w


# ----------------------------------------------------------------------- int4_gemv


def _nearest(count, target):
  """The divisor of ``count`` nearest ``target``, the smaller on a tie (from divisor pairs)."""
  divisors = {d for i in range(1, int(count ** 0.5) + 1) if count % i == 0
              for d in (i, count // i)}
  return min(divisors, key=lambda d: (abs(d - target), d))


def test_divisor_near_picks_the_closest_divisor_smallest_on_ties(rng):
  assert int4_gemv.divisor_near(12, 5) == 4  # 4 and 6 tie: the smaller
  assert int4_gemv.divisor_near(23, 7) == 1 and int4_gemv.divisor_near(896, 1e9) == 896
  for count in list(range(1, 130)) + [896, 1001, 2048]:
    for target in [0.0, 1.0, count, *rng.uniform(0, 1.5 * count, 4)]:
      assert int4_gemv.divisor_near(count, target) == _nearest(count, target), (count, target)


@pytest.mark.parametrize("tiles", [1, 2, 3, 5, 12, 23, 36, 64, 112, 113])
def test_loop_shape_is_the_largest_fitting_shape(tiles):
  """Tiles per step: the first of ``block_k / 128`` halved that divides ``tiles``; split_k:
  the largest divisor of the step count not above the config's; every tile once."""
  for block_k in (64, 128, 256, 512, 1024):
    for split in (1, 2, 3, 5, 7, 40, 1000):
      cfg = qjax.KernelConfig(block_m=1, block_n=64, block_k=block_k, split_k=split)
      tps, s, steps = int4_gemv.loop_shape(cfg, tiles)
      want_tps = next(t for t in (8, 4, 2, 1) if t <= max(1, block_k // 128) and tiles % t == 0)
      want_s = max(d for d in range(1, min(split, tiles // want_tps) + 1)
                   if (tiles // want_tps) % d == 0)
      assert (tps, s, steps) == (want_tps, want_s, tiles // want_tps // want_s)
      assert tps * s * steps == tiles


def test_heuristic_config_is_legal_on_random_shapes(rng):
  """Two tiles per step where K's tile count is even and (single-tile steps) one step
  would leave a program two tiles or fewer while two-tile steps keep MIN_PROGRAMS
  programs; split_k the divisor nearest TARGET_PROGRAMS programs; legal as it stands
  (loop_shape keeps it)."""
  shapes = [(768, 28672), (1536, 14336), (4096, 4096), (200, 130),  # edges of the 2-step rule
            (1536, 576), (2048, 512), (1024, 1024)]
  for k, n in shapes + list(zip(2 ** rng.uniform(0, 15, 40), 2 ** rng.uniform(0, 15, 40))):
    tiles, cols = -(-int(k) // 128), -(-int(n) // 64)
    for single in (True, False):
      cfg = int4_gemv.heuristic_config(int(k), int(n), single_tile_steps=single)
      target = int4_gemv.TARGET_PROGRAMS / cols
      keeps = tiles % 2 == 0 and cols * _nearest(tiles // 2, target) >= int4_gemv.MIN_PROGRAMS
      tps = 2 if tiles % 2 == 0 and (
          not single or (tiles // _nearest(tiles, target) <= 2 and keeps)) else 1
      assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (1, 64, 1)
      assert (cfg.block_k, cfg.split_k) == (128 * tps, _nearest(tiles // tps, target)), (k, n)
      assert int4_gemv.loop_shape(cfg, tiles)[:2] == (tps, cfg.split_k), (k, n)


# --------------------------------------------------------------------- int4_matmul


@pytest.mark.parametrize("by_dot,dtype", [(False, jnp.float32), (False, jnp.bfloat16),
                                          (True, jnp.bfloat16), (True, jnp.float16)])
@pytest.mark.parametrize("block_m,block_n,slabs", [(1, 16, 1), (3, 8, 5), (17, 32, 3)])
def test_x_sum_helpers_sum_each_row(rng, by_dot, dtype, block_m, block_n, slabs):
  """start, add per 16-column slab, total: each row's sum of x, broadcast over the
  columns by the dot, one column by the vector adds."""
  x = jnp.asarray(rng.standard_normal((block_m, 16 * slabs)) + 0.5, dtype)
  xpart = int4_matmul.x_sum_start(block_m, block_n, 16, by_dot)
  assert xpart.dtype == jnp.float32 and not np.asarray(xpart).any()
  assert xpart.shape == (block_m, block_n if by_dot else 16)
  for p in range(slabs):
    xpart = int4_matmul.x_sum_add(xpart, x[:, 16 * p:16 * (p + 1)], by_dot)
  total = np.asarray(int4_matmul.x_sum_total(xpart, by_dot))
  x64 = np.asarray(x, np.float64)
  want = np.broadcast_to(x64.sum(1, keepdims=True), (block_m, block_n if by_dot else 1))
  assert total.shape == want.shape and total.dtype == np.float32
  assert (np.abs(total - want) <= 1e-6 * np.abs(x64).sum(1, keepdims=True)).all()


# ------------------------------------------------------------------------ fp4_codec


@pytest.mark.parametrize("fmt", ["e8m0", "e4m3"])
def test_scale_decoder_folds_the_tensor_scale_on_all_256_bytes(fmt):
  """``decode(b) * factor`` is the byte's value times ``2**14`` and the tensor scale, to
  one f32 rounding (NaN bytes stay NaN; E8M0 where the product is a normal f32);
  with ``use_ptx`` the PTX decoders, whose e4m3 gives the value itself (no ``2**8``)."""
  data = np.arange(256, dtype=np.uint8)
  g = np.float32(0.3712)
  decode, factor = fp4_codec.scale_decoder(fmt, jnp.full((1, 1), g))
  got = np.asarray(decode(jnp.asarray(data)) * factor, np.float64).ravel()
  want = _scale_f64(data, fmt) * 2.0 ** 14 * np.float64(g)
  assert np.array_equal(np.isnan(got), np.isnan(want))
  # E8M0 0 decodes to the f32 subnormal 2**-127, which XLA's CPU multiply flushes to 0.
  ok = (np.abs(want) >= 2.0 ** -126) & (np.abs(want) < 2.0 ** 128) & (data > 0)
  assert ok.sum() == (242 if fmt == "e8m0" else 252)
  assert (np.abs(got[ok] - want[ok]) <= 2.0 ** -24 * np.abs(want[ok])).all()
  ptx_decode, ptx_factor = fp4_codec.scale_decoder(fmt, use_ptx=True)
  ptx = {"e8m0": fp4_codec.e8m0_to_f32_ptx, "e4m3": fp4_codec.e4m3_to_f32_ptx}
  assert ptx_decode is ptx[fmt] and ptx_factor == 2.0 ** 14


@pytest.mark.parametrize("fmt", ["e8m0", "e4m3"])
def test_kernel_scales_gives_format_bytes_and_tensor_scale(rng, fmt):
  _, codes, scales, g, _ = _fp4_problem(rng, fmt, 256, 7)
  words = jnp.asarray(_pack_native(codes))
  if fmt == "e8m0":
    w = qjax.MXFP4Weight(codes=words, scales=jnp.asarray(scales), shape=(256, 7))
  else:
    w = qjax.NVFP4Weight(codes=words, scales=jnp.asarray(scales.view(ml_dtypes.float8_e4m3fn)),
                         global_scale=jnp.float32(g), shape=(256, 7))
  got_fmt, got_bytes, got_g = fp4_codec.kernel_scales(w)
  assert got_fmt == fmt and got_bytes.dtype == jnp.uint8
  assert np.array_equal(np.asarray(got_bytes), scales)
  if fmt == "e8m0":
    assert got_g is None
  else:
    assert got_g.shape == (1, 1) and got_g.dtype == jnp.float32 and float(got_g[0, 0]) == g


def test_use_ptx_scales_conditions(monkeypatch):
  for block_n in (1, 8, 15, 16, 17, 64, 256):
    for interpret in (False, True):
      want = not interpret and block_n >= 16
      assert fp4_codec.use_ptx_scales(block_n, interpret) == want, (block_n, interpret)
  monkeypatch.setattr(fp4_codec, "PTX_SCALES", False)
  assert not fp4_codec.use_ptx_scales(64, False)


# ----------------------------------------------------------------------- fp4_matmul


def test_paired_decode_conditions(monkeypatch):
  """Compiled kernels with 16-bit x, and 16 * block_n words a multiple of 64 per warp."""
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    for block_n in (8, 16, 32, 64, 128):
      for warps in (4, 8):
        for interpret in (False, True):
          want = (not interpret and dtype != jnp.float32
                  and (16 * block_n) % (64 * warps) == 0)
          got = fp4_matmul.paired_decode(dtype, block_n, warps, interpret)
          assert got == want, (dtype, block_n, warps, interpret)
  monkeypatch.setattr(fp4_matmul, "PAIRED_PTX", False)
  assert not fp4_matmul.paired_decode(jnp.bfloat16, 64, 4, False)


@pytest.mark.parametrize("fmt", ["e8m0", "e4m3"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_accumulate_k_tile_matches_float64(rng, fmt, dtype):
  """Two K-tiles (the second at ``k_tile = 128``) onto a nonzero acc, factor per block;
  and from zero with the factor left to the caller (``factor=None``)."""
  m, n = 5, 24
  x, codes, scales, g, w = _fp4_problem(rng, fmt, 256, n, m)
  xq = jnp.asarray(x, dtype)
  words = jnp.asarray(_pack_native(codes))
  decode, factor = fp4_codec.scale_decoder(fmt, None if g is None else jnp.full((1, 1), g))
  acc0 = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  # float32 dots at HIGHEST: a GPU's default is one TF32 product (about 1e-4 off).
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  kw = dict(load_x=lambda k0: xq[:, k0:k0 + 16], tile_k=128, block_size=_BLOCK[fmt],
            dtype=dtype, decode=decode, load_scale=lambda b: jnp.asarray(scales[b:b + 1]),
            precision=precision)
  with_f, without = acc0, jnp.zeros((m, n), jnp.float32)
  for t in (0, 1):
    tile = words[16 * t:16 * (t + 1)]
    with_f = fp4_matmul.accumulate_k_tile(with_f, tile, k_tile=128 * t, factor=factor, **kw)
    without = fp4_matmul.accumulate_k_tile(without, tile, k_tile=128 * t, **kw)
  x64 = np.asarray(xq, np.float64)
  ref, bound = x64 @ w, np.abs(x64) @ np.abs(w)
  assert (np.abs(np.asarray(with_f) - np.asarray(acc0) - ref) <= 1e-5 * (bound + 1)).all()
  assert (np.abs(np.asarray(without * factor) - ref) <= 1e-5 * bound).all()


# ------------------------------------------------------------------------- fp4_gemv


def test_plan_properties_and_frozen():
  plan = fp4_gemv.Plan(k=256, block_size=32, scale_format="e8m0", block_n=64,
                       tiles_per_step=1, steps=2, split_k=1, depth=1, use_ptx=False)
  assert (plan.block_slabs, plan.blocks_per_tile, plan.ptx_scales) == (2, 4, False)
  nv = dataclasses.replace(plan, block_size=16, scale_format="e4m3")
  assert (nv.block_slabs, nv.blocks_per_tile) == (1, 8)
  assert hash(plan) == hash(dataclasses.replace(plan)) and plan != nv
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.k = 128


@pytest.mark.parametrize("fmt", ["e8m0", "e4m3"])
@pytest.mark.parametrize("tps,split,steps,depth", [(1, 1, 1, 1), (2, 1, 2, 1), (1, 3, 2, 2),
                                                   (2, 2, 1, 1), (1, 2, 3, 3)])
def test_accumulate_over_the_splits_matches_float64(rng, fmt, tps, split, steps, depth):
  """The K loop (word_step's plain path) of every split, summed over its 16 rows and
  splits and times the decoder's factor: ``x @ W``, each K-tile once."""
  k, n = 128 * tps * split * steps, 7
  x, codes, scales, g, w = _fp4_problem(rng, fmt, k, n)
  words, xt = jnp.asarray(_pack_native(codes)), jnp.asarray(x.reshape(k, 1), jnp.float32)
  s = jnp.asarray(scales)
  decode, factor = fp4_codec.scale_decoder(fmt, None if g is None else jnp.full((1, 1), g))
  plan = fp4_gemv.Plan(k=k, block_size=_BLOCK[fmt], scale_format=fmt, block_n=n,
                       tiles_per_step=tps, steps=steps, split_k=split, depth=depth,
                       use_ptx=False)
  out = 0.0
  for pid_k in range(split):
    acc = fp4_gemv.accumulate(plan, pid_k,
                              lambda t: lax.dynamic_slice(words, (16 * t, 0), (16, n)),
                              lambda r: lax.dynamic_slice(xt, (r, 0), (16, 1)),
                              lambda b: decode(lax.dynamic_slice(s, (b, 0), (1, n))))
    assert acc.shape == (16, n) and acc.dtype == jnp.float32
    out = out + np.asarray(jnp.sum(acc, axis=0, keepdims=True) * factor, np.float64)
  x64 = np.asarray(xt, np.float64).T
  assert (np.abs(out - x64 @ w) <= 1e-5 * (np.abs(x64) @ np.abs(w))).all()


# --------------------------------------------------------------------------- common


@pytest.mark.parametrize("split_k", [1, 3])
def test_store_tile_writes_each_tile_once(rng, split_k):
  """Ragged 5 x 13 output in 4 x 8 tiles: split_k 1 casts to bfloat16 into ``[M, N]``,
  split_k 3 stores ``(pid_k + 1) * tile`` as float32 into slice ``pid_k``."""
  m, n, bm, bn = 5, 13, 4, 8
  src = (rng.standard_normal((m, n)) + 3.0).astype(np.float32)

  def kernel(s_ref, o_ref):
    pid_n, pid_m, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = pid_m * bm, pid_n * bn
    mask = ((m0 + jnp.arange(bm)) < m)[:, None] & ((n0 + jnp.arange(bn)) < n)[None, :]
    acc = common.load(s_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], mask) * (pid_k + 1.0)
    common.store_tile(o_ref, acc, m0=m0, n0=n0, block_m=bm, block_n=bn, pid_k=pid_k,
                      split_k=split_k, mask=mask)

  shape = (m, n) if split_k == 1 else (split_k, m, n)
  dtype = jnp.bfloat16 if split_k == 1 else jnp.float32
  poisoned = jnp.full(shape, jnp.nan, dtype)
  out = pl.pallas_call(lambda s, _, o: kernel(s, o), out_shape=jax.ShapeDtypeStruct(shape, dtype),
                       grid=(2, 2, split_k), input_output_aliases={1: 0},
                       interpret=True)(jnp.asarray(src), poisoned)
  want = (np.asarray(jnp.asarray(src, jnp.bfloat16)) if split_k == 1
          else np.stack([src * np.float32(p + 1) for p in range(split_k)]))
  assert out.dtype == dtype and np.array_equal(np.asarray(out), want)


def test_layer_ref_indexes_one_layer(rng):
  """Shape, rank, dtype and ``[idx]`` (Ellipsis anywhere) are one layer's, against numpy;
  ``.at[...]`` inside a kernel loads that layer's slice."""
  stacked = rng.standard_normal((3, 5, 6, 7))
  ref = common.LayerRef(stacked, 2)
  assert (ref.shape, ref.ndim, ref.dtype) == ((5, 6, 7), 3, stacked.dtype)
  for idx in [..., 1, (1, 2), (..., 4), (0, ...), (slice(1, 4), ..., slice(None, None, 2)),
              (0, ..., 1, 2)]:
    assert np.array_equal(ref[idx], stacked[2][idx]), idx
  tiles = rng.standard_normal((4, 6, 9)).astype(np.float32)

  def kernel(t_ref, layer_ref, o_ref):
    layer = common.LayerRef(t_ref, layer_ref[0])
    o_ref[...] = common.load(layer.at[pl.ds(2, 3), pl.ds(1, 8)]) + layer[..., 0:8][0:3]

  for layer in (1, 3):
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3, 8), jnp.float32),
                         interpret=True)(jnp.asarray(tiles), jnp.asarray([layer], jnp.int32))
    assert np.array_equal(np.asarray(out), tiles[layer, 2:5, 1:9] + tiles[layer, 0:3, 0:8])


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7, 16])
def test_sum_splits_adds_in_split_order(rng, splits):
  """``p[0] + p[1] + ...`` bit for bit as numpy's float32 adds in that order, on partials
  of mixed magnitudes (so another order rounds differently), and no reduce in the program
  (XLA's emitters may add a reduce's terms in any order)."""
  p = (rng.standard_normal((splits, 5, 33)) *
       10.0 ** rng.integers(-3, 4, (splits, 1, 33))).astype(np.float32)
  want = p[0].copy()
  for q in p[1:]:
    want = want + q
  fn = jax.jit(common.sum_splits)
  np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(p))), want)
  assert "reduce" not in fn.lower(jnp.asarray(p)).as_text()


def test_split_k_launch_adds_the_splits_without_a_reduce(rng):
  """A Triton kernel's float32 partials of K splits, lowered for CUDA: summed by
  common.sum_splits (adds in split order), not by a reduce over the split axis."""
  w = qjax.quantize(jnp.asarray(rng.standard_normal((512, 128)), jnp.float32))
  x = jnp.asarray(rng.standard_normal((2, 512)), jnp.bfloat16)
  cfg = qjax.KernelConfig(block_m=16, block_n=64, block_k=128, split_k=4)
  text = jax.jit(lambda a, b: int4_matmul.int4_matmul(a, b, config=cfg)).trace(
      x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text
  assert "stablehlo.reduce" not in text
