"""The M = 1 FP4 kernel (pallas_kernels.fp4_gemv) against the float64 reference.

Both formats (MXFP4 blocks of 32, NVFP4 blocks of 16), every activation dtype, ragged N
and K off the 128-row tile, random codes (all 16 E2M1 codes, the subnormal and -0
included) and random scales over a wide range, each loop shape (K-tiles per step,
split-K, prefetch depth). The reference is ``x @ W`` in float64 with W decoded by
ml_dtypes (tests/test_fp4.py's ``np_dequantize``). Outputs are poisoned before each run.

On the CPU the kernel runs in interpret mode (the plain-ops word step), and the inline PTX
word step is checked by a small PTX emulator. On an NVIDIA GPU the compiled kernel runs,
in both variants ("ptx" and "plain"): ``pytest -k "Gpu or pallas"``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qjax
from qjax._src import dispatch
from qjax._src import packing
import ptx_emulator
from conftest import needs_gpu, rel_err, seed_from
from test_fp4 import np_dequantize, np_e2m1

FORMATS = ("mxfp4", "nvfp4")
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# (K, N): K of one block, K off the 128-row tile (96, 4096 + 32, GPT-OSS's 2880), N of one
# column, odd N, N off block_n.
SHAPES = [(32, 1), (32, 130), (96, 7), (96, 2880), (4128, 64), (4128, 7), (2880, 130),
          (2880, 1), (1024, 2880)]


def _gemv():
  from pallas_kernels import fp4_gemv  # pylint: disable=g-import-not-at-top
  return fp4_gemv


# --------------------------------------------------------------------------- inputs


def _scale_bytes(rng, fmt, shape, dtype):
  """Random scale bytes over a wide range that keeps ``x @ W`` finite in ``dtype``.

  MXFP4: E8M0 exponents around 127 (float16 outputs allow a narrower span). NVFP4: any
  e4m3 magnitude but 0 and NaN (subnormals included), either sign.
  """
  if fmt == "mxfp4":
    lo, hi = (127 - 12, 127 + 3) if dtype == jnp.float16 else (127 - 60, 127 + 60)
    return rng.integers(lo, hi, shape, dtype=np.uint8)
  bits = rng.integers(1, 0x7F, shape, dtype=np.uint8)
  bits |= rng.integers(0, 2, shape, dtype=np.uint8) << 7
  return bits.view(ml_dtypes.float8_e4m3fn)


def make_weight(rng, fmt, k, n, dtype=jnp.float32):
  """Random codes in the kernel's tile order (every 4-bit pattern is a valid E2M1 code)
  and random scales."""
  kp = packing.padded_rows(k, packing.NATIVE_TILE_K)
  codes = rng.integers(0, 16, (kp, n), dtype=np.uint8)
  codes[k:] = 0  # padding rows hold code 0
  words = jnp.asarray(packing.pack_codes(codes, packing.NATIVE_TILE_K))
  if fmt == "mxfp4":
    scales = _scale_bytes(rng, fmt, (k // 32, n), dtype)
    return qjax.MXFP4Weight(codes=words, scales=jnp.asarray(scales), shape=(k, n))
  scales = _scale_bytes(rng, fmt, (k // 16, n), dtype)
  span = (-4.0, -3.0) if dtype == jnp.float16 else (-6.0, 3.0)
  g = np.float32(10.0 ** rng.uniform(*span))
  return qjax.NVFP4Weight(codes=words, scales=jnp.asarray(scales), global_scale=jnp.float32(g),
                          shape=(k, n))


def make_x(rng, k, dtype):
  """Standard normal activations, none zero."""
  x = rng.standard_normal((1, k))
  x = np.where(np.abs(x) < 1e-3, 1e-3, x)
  return jnp.asarray(x, dtype)


def check(y, x, w, dtype):
  """Shape, dtype, no poison left, and error < 1e-2 both over the whole row and per
  column relative to ``sum_k |x_k W_kn|`` (scales differ by up to 2**120 between
  columns)."""
  n = w.shape[1]
  assert y.shape == (1, n) and y.dtype == jnp.dtype(dtype)
  y = np.asarray(y, np.float64)
  assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
  xd = np.asarray(x, np.float64)
  wd = np_dequantize(w)
  ref = xd @ wd
  assert rel_err(y, ref) < 1e-2, dtype
  scale = np.abs(xd) @ np.abs(wd)
  assert (np.abs(y - ref) <= 1e-2 * scale).all(), dtype


# ---------------------------------------------------------------------------- suites


class GemvSuite:
  interpret: bool
  variant = "ptx"

  def run(self, x, w, config=None, variant=None):
    fn = _gemv().fp4_gemv
    return jax.jit(lambda a, b: fn(a, b, config=config, variant=variant or self.variant,
                                   poison=True, interpret=self.interpret))(x, w)

  @pytest.mark.parametrize("fmt", FORMATS)
  @pytest.mark.parametrize("k,n", SHAPES, ids=lambda v: str(v))
  def test_matches_float64(self, request, fmt, k, n):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    for dt in DTYPES:
      w = make_weight(rng, fmt, k, n, dt)
      x = make_x(rng, k, dt)
      check(self.run(x, w), x, w, dt)

  @pytest.mark.parametrize("fmt", FORMATS)
  @pytest.mark.parametrize("bn,bk,split,depth,warps", [
      (32, 128, 1, 1, 4), (64, 256, 2, 1, 4), (128, 256, 3, 2, 8), (64, 512, 1, 2, 4),
      (32, 128, 13, 1, 4), (128, 128, 4, 3, 8), (16, 128, 2, 1, 4), (256, 256, 1, 1, 8)])
  def test_loop_shapes(self, request, fmt, bn, bk, split, depth, warps):
    """13 K-tiles (K = 1568, off the tile) and N = 100 under each loop shape (block_k and
    split_k are fitted to the 13 tiles)."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_weight(rng, fmt, 1568, 100, jnp.bfloat16)
    x = make_x(rng, 1568, jnp.bfloat16)
    cfg = qjax.KernelConfig(block_m=1, block_n=bn, block_k=bk, split_k=split,
                            num_warps=warps, num_stages=depth)
    check(self.run(x, w, cfg), x, w, jnp.bfloat16)

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_plain_tile_order_is_repacked(self, request, fmt):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_weight(rng, fmt, 288, 40)
    x = make_x(rng, 288, jnp.float32)
    check(self.run(x, w.repack(packing.PLAIN_TILE_K)), x, w, jnp.float32)

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_matmul_routes_one_row_here(self, request, monkeypatch, fmt):
    """qjax's FP4 kernel sends M = 1 to the GEMV kernel and M > 1 to the tiled one; both
    agree with the reference."""
    fp4_gemv = _gemv()
    calls = []
    real = fp4_gemv.fp4_gemv

    def spy(x, w, **kw):
      calls.append(x.shape)
      return real(x, w, **kw)

    monkeypatch.setattr(fp4_gemv, "fp4_gemv", spy)
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_weight(rng, fmt, 512, 64, jnp.bfloat16)
    impl = "interpret" if self.interpret else "pallas"
    for m in (1, 2):
      x = jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16)
      y = qjax.matmul(x, w, implementation=impl)
      assert rel_err(y, np.asarray(x, np.float64) @ np_dequantize(w)) < 1e-2
    assert calls == [(1, 512)]

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_nan_scale_poisons_only_its_column(self, request, fmt):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_weight(rng, fmt, 256, 64)
    scales = np.asarray(w.scales).copy()
    # E8M0 255; e4m3 0x7F (NaN, which the hardware conversion must keep).
    scales[3, 5] = 255 if fmt == "mxfp4" else np.uint8(0x7F).view(ml_dtypes.float8_e4m3fn)
    w = dataclasses.replace(w, scales=jnp.asarray(scales))
    y = np.asarray(self.run(make_x(rng, 256, jnp.float32), w))
    assert np.isnan(y[0, 5]) and np.isfinite(np.delete(y[0], 5)).all()


class TestInterpret(GemvSuite):
  interpret = True


@needs_gpu
class TestPallasGpu(GemvSuite):
  interpret = False


@needs_gpu
class TestPallasGpuPlainVariant(GemvSuite):
  interpret = False
  variant = "plain"


@needs_gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", [(4096, 4096), (2880, 5760), (14336, 4096)])
def test_pallas_gpu_ptx_matches_plain_variant(request, fmt, k, n):
  """The inline-PTX and plain-ops word steps compute the same sums (up to FMA rounding)."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  w = make_weight(rng, fmt, k, n, jnp.bfloat16)
  x = make_x(rng, k, jnp.float32)
  fn = _gemv().fp4_gemv
  ys = [np.asarray(jax.jit(lambda a, b, v=v: fn(a, b, variant=v, poison=True))(x, w),
                   np.float64) for v in ("ptx", "plain")]
  scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np_dequantize(w))
  assert (np.abs(ys[0] - ys[1]) <= 1e-5 * scale).all()
  check(ys[0].astype(np.float32), x, w, jnp.float32)


_SCALE_DTYPES = {"e8m0": ml_dtypes.float8_e8m0fnu, "e4m3": ml_dtypes.float8_e4m3fn}


def _same_floats(got, want):
  """Bit for bit, NaN where NaN (its payload aside)."""
  assert np.array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@needs_gpu
@pytest.mark.parametrize("fmt", ["e8m0", "e4m3"])
@pytest.mark.parametrize("block_n,num_warps", [(16, 4), (64, 4), (256, 8)])
def test_pallas_gpu_ptx_scales_decode_all_256_bytes(fmt, block_n, num_warps):
  """The inline-PTX scale decoders the GEMV kernels use give every byte's E8M0 /
  float8_e4m3fn value bit for bit (NaN for E8M0 255 and e4m3 0x7F / 0xFF), in row blocks
  of the kernels' widths."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fp4_codec  # pylint: disable=g-import-not-at-top
  assert fp4_codec.ptx_scales_fit(block_n)
  decode = fp4_codec.e8m0_to_f32_ptx if fmt == "e8m0" else fp4_codec.e4m3_to_f32_ptx
  data = np.arange(256, dtype=np.uint8).reshape(1, 256)

  def kernel(b_ref, o_ref):
    j = pl.program_id(0) * block_n
    b = plgpu.load(b_ref.at[pl.ds(0, 1), pl.ds(j, block_n)])
    plgpu.store(o_ref.at[pl.ds(0, 1), pl.ds(j, block_n)], decode(b))

  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 256), jnp.float32),
                       grid=(256 // block_n,),
                       compiler_params=plgpu.CompilerParams(num_warps=num_warps))(
                           jnp.asarray(data))
  _same_floats(np.asarray(out), data.view(_SCALE_DTYPES[fmt]).astype(np.float32))


@pytest.mark.parametrize("fmt", ["e8m0", "e4m3"])
def test_scale_decoders_decode_all_256_bytes(fmt):
  """The jnp scale decoders of the kernels' interpret and non-PTX paths, on every byte:
  E8M0 as ``2 ** (e - 127)`` and float8_e4m3fn times ``2 ** -8``, against ml_dtypes bit
  for bit (NaN for E8M0 255 and e4m3 0x7F / 0xFF), and ``scale_decoder``'s factor makes
  the same scale from either decoder."""
  from pallas_kernels import fp4_codec  # pylint: disable=g-import-not-at-top
  data = np.arange(256, dtype=np.uint8)
  want = data.view(_SCALE_DTYPES[fmt]).astype(np.float32)
  if fmt == "e8m0":
    got = fp4_codec.e8m0_to_f32(jnp.asarray(data))
  else:
    got = fp4_codec.e4m3_to_f32_times_2_pow_minus_8(jnp.asarray(data))
    want = want * np.float32(2.0 ** -8)
  _same_floats(np.asarray(got), want)
  decode, factor = fp4_codec.scale_decoder(fmt)
  scale = np.asarray(decode(jnp.asarray(data))) * np.float32(factor)
  _same_floats(scale, data.view(_SCALE_DTYPES[fmt]).astype(np.float32)
               * np.float32(fp4_codec.E2M1_TO_F16_SCALE))
  with pytest.raises(ValueError, match="e8m0"):
    fp4_codec.scale_decoder("e5m2")


def test_e8m0_ptx_emulated_decodes_all_256_bytes():
  """On the CPU: the E8M0 decoder's PTX, run by the emulator on all 256 bytes (four per
  word, as Triton packs them), gives ml_dtypes' float8_e8m0fnu values bit for bit."""
  from pallas_kernels import fp4_codec  # pylint: disable=g-import-not-at-top
  data = np.arange(256, dtype=np.uint8)
  words = data.view(np.uint32)  # byte i of a word is element i
  for i in range(4):
    got = ptx_emulator.emulate(fp4_codec._E8M0X4_PTX, {4: words}, result=f"${i}")
    _same_floats(got.astype(np.uint32).view(np.float32),
                 data[i::4].view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


# ----------------------------------------------------------------------- the PTX step


def test_supports_and_bad_arguments():
  fp4_gemv = _gemv()
  assert fp4_gemv.supports(1, 2880, 32) and fp4_gemv.supports(1, 4128, 16)
  assert not fp4_gemv.supports(2, 4096, 32)
  assert not fp4_gemv.supports(1, 4096, 8) and not fp4_gemv.supports(1, 4096, 48)
  w = make_weight(np.random.default_rng(0), "mxfp4", 96, 8)
  with pytest.raises(ValueError, match=r"x \(2, 96\)"):
    fp4_gemv.fp4_gemv(jnp.ones((2, 96), jnp.bfloat16), w, interpret=True)
  with pytest.raises(ValueError, match="variant='cuda'"):
    fp4_gemv.fp4_gemv(jnp.ones((1, 96), jnp.bfloat16), w, variant="cuda", interpret=True)
  with pytest.raises(TypeError, match="Int4Weight"):
    fp4_gemv.fp4_gemv(jnp.ones((1, 256)), qjax.quantize(jnp.ones((256, 8))), interpret=True)


def test_candidate_configs_are_gemv_configs_at_one_row():
  from pallas_kernels import fp4_matmul  # pylint: disable=g-import-not-at-top
  cfgs = fp4_matmul.fp4_candidate_configs(1, 2880, 5760)
  assert cfgs and all(c.block_m == 1 for c in cfgs) and len(set(cfgs)) == len(cfgs)
  tiled = fp4_matmul.fp4_candidate_configs(8, 2880, 5760)
  assert all(c.block_m > 1 for c in tiled) and len(set(tiled)) == len(tiled)
  # Above one row the tuner also measures each tile with the scales decoded in PTX.
  plain = [c for c in tiled if not c.ptx_scales]
  assert {dataclasses.replace(c, ptx_scales=False) for c in tiled if c.ptx_scales} == set(plain)
  backend = dispatch.kernels_for_format(qjax.NVFP4Weight)[0]
  assert backend.candidate_configs(1, 4096, 4096)[0].block_m == 1


@pytest.mark.parametrize("block_slabs", [1, 2])
def test_ptx_word_step_emulated_equals_plain_and_float64(rng, block_slabs):
  """The inline PTX (run by the emulator), the plain JAX step and float64 agree on random
  words, every E2M1 code included."""
  fp4_gemv = _gemv()
  blocks = 8 // block_slabs
  shape = (16, 64)
  words = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
  xs = [rng.standard_normal((16, 1)).astype(np.float32) for _ in range(8)]
  scales = [(2.0 ** rng.integers(-20, 20, (1, 64))).astype(np.float32) for _ in range(blocks)]
  acc = rng.standard_normal(shape).astype(np.float32)

  asm = fp4_gemv._word_ptx(block_slabs)
  operands = {1: words}
  operands.update({2 + j: np.broadcast_to(x, shape) for j, x in enumerate(xs)})
  operands.update({10 + b: np.broadcast_to(s, shape) for b, s in enumerate(scales)})
  operands[10 + blocks] = acc
  emulated = ptx_emulator.emulate(asm, operands).astype(np.float64)

  plain = np.asarray(fp4_gemv._word_plain(
      jnp.asarray(words), [jnp.asarray(x) for x in xs], [jnp.asarray(s) for s in scales],
      jnp.asarray(acc), block_slabs), np.float64)

  want, bound = acc.astype(np.float64), np.abs(acc).astype(np.float64)
  for j in range(8):
    v = np_e2m1((words >> (4 * j)) & 0xF) * 2.0 ** -14
    term = xs[j].astype(np.float64) * v * scales[j // block_slabs]
    want, bound = want + term, bound + np.abs(term)
  assert (np.abs(emulated - want) <= 1e-6 * bound).all()
  assert (np.abs(plain - want) <= 1e-6 * bound).all()


def test_ptx_word_step_is_well_formed():
  """Each operand appears, $0 is written once and last, and one LOP3 per nibble pair."""
  fp4_gemv = _gemv()
  for block_slabs in (1, 2):
    asm = fp4_gemv._word_ptx(block_slabs)
    last = 10 + 8 // block_slabs
    for i in range(last + 1):
      assert f"${i}" in asm, (block_slabs, i)
    assert f"${last + 1}" not in asm
    assert asm.count("lop3.b32") == 4 and asm.count("cvt.f32.f16") == 8
    assert asm.count("$0") == 1 and asm.splitlines()[-2].startswith("fma.rn.f32 $0")


# sha256 of _word_ptx(block_slabs) as validated on the H100 (the MoE GEMV kernel shares it).
_VALIDATED_PTX_SHA256 = {
    1: "fa86bafd0529f8055f9a7f9f67f262980b7b6930812ddbe151c011d4d848e78c",
    2: "509d302da5ee12c310f663d355869ef6fb5ed434bbff9f5526525a49fb5cf1a0",
}


@pytest.mark.parametrize("block_slabs", [1, 2])
def test_ptx_word_step_text_is_unchanged(block_slabs):
  """The word step's PTX is byte for byte the one validated on the GPU; a deliberate
  change must update the hash here (and be validated again)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  asm = _gemv()._word_ptx(block_slabs)
  assert hashlib.sha256(asm.encode()).hexdigest() == _VALIDATED_PTX_SHA256[block_slabs]
