"""FP4 weights (MXFP4, NVFP4): decoding against ml_dtypes, quantizers against a float64
numpy implementation of the same rules, the GPT-OSS layout, and qjax.matmul on every
implementation (XLA, Pallas interpret, compiled Pallas on the GPU) against float64.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qjax
from qjax._src import fp4
from qjax._src import packing
from conftest import needs_gpu, rel_err, seed_from

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ------------------------------------------------------------------ numpy references


def np_e2m1(codes) -> np.ndarray:
  """uint8 codes in [0, 15] -> float64 values, decoded by ml_dtypes."""
  return np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def np_e8m0(e) -> np.ndarray:
  return np.asarray(e, np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def np_dequantize(w) -> np.ndarray:
  """float64 [..., K, N] rebuilt from the stored arrays with ml_dtypes (not qjax)."""
  q = np_e2m1(packing.unpack_codes(np.asarray(w.codes), w.shape[0], w.tile_k))
  if isinstance(w, qjax.MXFP4Weight):
    s = np_e8m0(np.asarray(w.scales))
  else:
    g = np.asarray(w.global_scale, np.float64)[..., None, None]
    s = np.asarray(w.scales).astype(np.float64) * g
  return q * np.repeat(s, w.block_size, axis=-2)


def np_round_e2m1(v: np.ndarray) -> np.ndarray:
  """float64 -> nearest E2M1 value, ties to the even code, saturating at +-6."""
  a = np.minimum(np.abs(v), 6.0)
  dist = np.abs(a[..., None] - E2M1_GRID)
  best = dist.min(axis=-1, keepdims=True)
  ties = dist == best
  # Among the nearest grid points take the even index (code) when there are two.
  even = ties & (np.arange(8) % 2 == 0)
  index = np.where(even.any(axis=-1), np.argmax(even, axis=-1), np.argmax(ties, axis=-1))
  return np.sign(v) * E2M1_GRID[index]


def np_mxfp4(w: np.ndarray) -> np.ndarray:
  """float64 OCP MX quantize-dequantize of [K, N] with blocks of 32 along K."""
  k, n = w.shape
  wb = w.astype(np.float64).reshape(k // 32, 32, n)
  amax = np.abs(wb).max(axis=1, keepdims=True)
  with np.errstate(divide="ignore"):
    shared = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
  x = 2.0 ** np.clip(shared, -127, 127)
  return (np_round_e2m1(wb / x) * x).reshape(k, n)


def np_nvfp4(w: np.ndarray) -> np.ndarray:
  """float64 NVFP4 quantize-dequantize of [K, N]: tensor scale, e4m3 scale per 16."""
  k, n = w.shape
  wb = w.astype(np.float64).reshape(k // 16, 16, n)
  g = np.abs(wb).max() / (6.0 * 448.0)
  s = (np.abs(wb).max(axis=1, keepdims=True) / 6.0 / g).astype(ml_dtypes.float8_e4m3fn)
  step = s.astype(np.float64) * g
  v = np.divide(wb, step, out=np.zeros_like(wb), where=step > 0)
  return (np_round_e2m1(v) * step).reshape(k, n)


# ---------------------------------------------------------------------------- codecs


def test_all_16_e2m1_codes_decode_as_ml_dtypes():
  codes = np.arange(16, dtype=np.uint8)
  got = np.asarray(fp4.decode_e2m1(codes))
  want = np_e2m1(codes)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("nibble", range(8))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_pair_ptx_decodes_both_words_exactly(nibble, dtype):
  """The tiled FP4 kernel's two-weights-per-instance PTX, emulated bit for bit: the low
  half of the result is ``e2m1 * 2**-14`` of the first word's nibble, the high half the
  second word's, for every nibble position and all 16 codes (bf16 through its subnormal
  decode and the exact ``fma.rn.bf16x2`` by ``2**112``)."""
  import ptx_emulator  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fp4_matmul  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(f"fp4-pair-ptx-{nibble}"))
  a, b = (rng.integers(0, 2**32, (512,), dtype=np.uint64).astype(np.uint32) for _ in "ab")
  a[:16] = np.arange(16, dtype=np.uint32) << np.uint32(4 * nibble)  # every code
  b[:16] = np.arange(15, -1, -1, dtype=np.uint32) << np.uint32(4 * nibble)
  dt = jnp.dtype(dtype)
  got = ptx_emulator.emulate(fp4_matmul._e2m1_pair_ptx(nibble, dt.name), {1: a, 2: b})
  for shift, word in ((0, a), (16, b)):
    half = ((got >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16)
    values = half.view(ml_dtypes.bfloat16 if dt == jnp.bfloat16 else np.float16)
    codes = (word >> np.uint32(4 * nibble)) & np.uint32(0xF)
    np.testing.assert_array_equal(values.astype(np.float64), np_e2m1(codes) * 2.0**-14)


def test_all_256_e8m0_scales_decode_as_ml_dtypes():
  e = np.arange(256, dtype=np.uint8)
  np.testing.assert_array_equal(np.asarray(fp4.decode_e8m0(e)), np_e8m0(e).astype(np.float32))


def test_encode_rounds_to_nearest_even_like_ml_dtypes(rng):
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  v = np.concatenate([ties, -ties, rng.uniform(-6, 6, 4000), E2M1_GRID]).astype(np.float32)
  got = np.asarray(fp4.decode_e2m1(fp4.encode_e2m1(v)))
  want = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(fp4.decode_e2m1(fp4.encode_e2m1(
      np.float32([7.0, -100.0, 6.5])))), [6.0, -6.0, 6.0])


def _random_codes(rng, k, n, tile_k=packing.NATIVE_TILE_K):
  codes = rng.integers(0, 16, (k, n), dtype=np.uint8)
  return codes, jnp.asarray(packing.pack_codes(codes, tile_k))


def test_mxfp4_dequantize_exact_for_random_scales(rng):
  k, n = 96, 40
  codes, words = _random_codes(rng, k, n)
  scales = rng.integers(2, 255, (k // 32, n), dtype=np.uint8)  # 0 and 1: subnormal results
  scales[0, :3] = 255  # NaN scales decode as NaN
  w = qjax.MXFP4Weight(codes=words, scales=jnp.asarray(scales), shape=(k, n))
  want = (np_e2m1(codes) * np.repeat(np_e8m0(scales), 32, axis=0)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(w.dequantize()), want)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v.dequantize())(w)), want)


def test_nvfp4_dequantize_exact_for_random_scales(rng):
  k, n = 80, 24
  codes, words = _random_codes(rng, k, n)
  bits = rng.integers(0, 256, (k // 16, n), dtype=np.uint8)
  bits[(bits & 0x7F) == 0x7F] = 0x3C  # no NaN scales
  scales = bits.view(ml_dtypes.float8_e4m3fn)
  g = np.float32(0.3712)
  w = qjax.NVFP4Weight(codes=words, scales=jnp.asarray(scales), global_scale=jnp.float32(g),
                       shape=(k, n))
  exact = np_e2m1(codes) * np.repeat(scales.astype(np.float64), 16, axis=0) * np.float64(g)
  np.testing.assert_array_equal(np.asarray(w.dequantize()), exact.astype(np.float32))


@pytest.mark.parametrize("n", (40, 33), ids=("even_n", "odd_n"))
def test_dequantize_in_16_bits_rounds_the_float32_values(rng, n):
  """dequantize(bf16 / f16) (the XLA path's W, two columns per word for an even N) is the
  float32 W rounded once, bit for bit: MXFP4 and NVFP4, one weight and a batch of 3."""
  k = 64
  for batch in ((), (3,)):
    codes = rng.integers(0, 16, batch + (k, n), dtype=np.uint8)
    words = jnp.asarray(packing.pack_codes(codes, packing.NATIVE_TILE_K))
    e8 = jnp.asarray(rng.integers(110, 136, batch + (k // 32, n), dtype=np.uint8))
    e4 = jnp.asarray(rng.uniform(0.01, 400, batch + (k // 16, n)), jnp.float8_e4m3fn)
    ws = (qjax.MXFP4Weight(codes=words, scales=e8, shape=(k, n)),
          qjax.NVFP4Weight(codes=words, scales=e4, shape=(k, n),
                           global_scale=jnp.full(batch, 0.37, jnp.float32)))
    for w in ws:
      full = np.asarray(w.dequantize(), np.float32)
      for dt in (jnp.bfloat16, jnp.float16):
        got = np.asarray(jax.jit(lambda v: v.dequantize(dt))(w))
        assert got.shape == batch + (k, n)
        np.testing.assert_array_equal(got.view(np.uint16), full.astype(dt).view(np.uint16),
                                      err_msg=f"{type(w).__name__} {batch} {dt}")


# ------------------------------------------------------------------------ quantizers


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("k,n", [(512, 256), (2880, 64)])
def test_quantize_error_within_2_percent_of_float64_rule(rng, fmt, k, n):
  w = rng.standard_normal((k, n)).astype(np.float32) * 0.02
  quantize, np_rule = ((qjax.quantize_mxfp4, np_mxfp4) if fmt == "mxfp4"
                       else (qjax.quantize_nvfp4, np_nvfp4))
  qw = quantize(jnp.asarray(w))
  ours = np.asarray(qw.dequantize(), np.float64)
  ref = np_rule(w)
  err, err_ref = np.linalg.norm(ours - w), np.linalg.norm(ref - w)
  assert abs(err / err_ref - 1) < 0.02, (err, err_ref)
  # The same rule, so elements agree: MXFP4 exactly (power-of-two scales), NVFP4 up to
  # the f32 rounding of its tensor scale, except where f32 and f64 divisions put a value
  # on opposite sides of a rounding tie.
  if fmt == "mxfp4":
    assert np.mean(ours == ref) > 0.9999
  else:
    assert np.mean(np.isclose(ours, ref, rtol=1e-6, atol=0)) > 0.999
  np.testing.assert_array_equal(ours, np_dequantize(qw).astype(np.float32))


def test_mxfp4_scale_rule_and_zero_blocks():
  w = np.zeros((64, 3), np.float32)
  w[0, 0], w[5, 0] = 6.0, -0.7          # amax 6 -> shared exponent 0
  w[32, 1] = 7.5                        # amax in [4, 8) -> exponent 0; 7.5 saturates to 6
  w[40, 2] = 1e-3                       # floor(log2(1e-3)) = -10 -> shared -12
  qw = qjax.quantize_mxfp4(jnp.asarray(w))
  s = np.asarray(qw.scales).astype(int) - 127
  assert s[0, 0] == 0 and s[1, 1] == 0 and s[1, 2] == -12
  assert s[0, 1] == -127 and s[0, 2] == -127  # all-zero blocks
  d = np.asarray(qw.dequantize())
  assert d[0, 0] == 6.0 and d[5, 0] == -0.5 and d[32, 1] == 6.0
  assert d[40, 2] == np.float32(4.0 * 2.0 ** -12)  # 1e-3 / 2**-12 = 4.096 -> 4


@pytest.mark.parametrize("jit", (True, False), ids=("jit", "eager"))
def test_nvfp4_codes_are_the_rule_for_the_stored_scales(rng, jit):
  """Every code of quantize_nvfp4, jitted and eager, is the nearest E2M1 value of
  ``w / (f32(scale) * global_scale)`` for the e4m3 scale it stores (on the H100 a jitted
  quantizer once divided by the unrounded scale: 5 % of the codes one step off)."""
  k, n = 128, 48
  w = rng.standard_normal((k, n)).astype(np.float32)
  f = jax.jit(qjax.quantize_nvfp4) if jit else qjax.quantize_nvfp4
  q = f(jnp.asarray(w))
  step = np.repeat(np.asarray(q.scales).astype(np.float32), 16, axis=0) * np.float32(
      q.global_scale)
  want = np_round_e2m1((w / step).astype(np.float64))
  np.testing.assert_array_equal(np_e2m1(np.asarray(q.unpacked_codes())), want)


@pytest.mark.parametrize("quantize", [qjax.quantize_mxfp4, qjax.quantize_nvfp4])
def test_quantize_batched_equals_per_expert(rng, quantize):
  w = rng.standard_normal((3, 128, 16)).astype(np.float32)
  qb = jax.jit(quantize)(jnp.asarray(w))
  for e in range(3):
    qe = quantize(jnp.asarray(w[e]))
    for a, b in zip(jax.tree.leaves(qb), jax.tree.leaves(qe)):
      np.testing.assert_array_equal(np.asarray(a)[e], np.asarray(b))


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="multiple of the block size 32"):
    qjax.quantize_mxfp4(jnp.ones((48, 8)))
  with pytest.raises(ValueError, match="non-finite"):
    qjax.quantize_nvfp4(jnp.full((16, 8), jnp.inf))
  with pytest.raises(ValueError, match=r"MXFP4Weight.scales must be \(2, 8\)"):
    qjax.MXFP4Weight(codes=jnp.zeros((16, 8), jnp.uint32), scales=jnp.zeros((3, 8), jnp.uint8),
                     shape=(64, 8))


def test_tile_orders_and_save_load_round_trip(rng, tmp_path):
  w = qjax.quantize_nvfp4(jnp.asarray(rng.standard_normal((160, 24)), jnp.float32))
  plain = w.repack(packing.PLAIN_TILE_K)
  np.testing.assert_array_equal(np.asarray(plain.dequantize()), np.asarray(w.dequantize()))
  qjax.save(tmp_path / "w.safetensors", {"a": w, "b": qjax.quantize_mxfp4(jnp.ones((64, 8)))})
  back = qjax.load(tmp_path / "w.safetensors")
  assert isinstance(back["a"], qjax.NVFP4Weight) and back["a"].scales.dtype == w.scales.dtype
  np.testing.assert_array_equal(np.asarray(back["a"].dequantize()), np.asarray(w.dequantize()))
  assert isinstance(back["b"], qjax.MXFP4Weight)


# ------------------------------------------------------------------ GPT-OSS layout


def np_gpt_oss_blocks(codes: np.ndarray) -> np.ndarray:
  """[E, K, N] codes -> GPT-OSS [E, N, K // 32, 16] bytes, low nibble = even k."""
  e, k, n = codes.shape
  nk = codes.transpose(0, 2, 1).reshape(e, n, k // 32, 16, 2)
  # (safetensors writes the raw buffer: keep it C-contiguous)
  return np.ascontiguousarray(nk[..., 0] | (nk[..., 1] << 4), np.uint8)


def np_gpt_oss_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """GPT-OSS's own recipe: LUT of the nibbles interleaved lo, hi, then ldexp by e - 127;
  returns [E, N, K] float64 (the checkpoint's [out, in])."""
  lut = E2M1_GRID.tolist() + [-v for v in E2M1_GRID]
  lut = np.array(lut)
  *lead, nb, _ = blocks.shape
  vals = np.empty((*lead, nb, 32))
  vals[..., 0::2] = lut[blocks & 0xF]
  vals[..., 1::2] = lut[blocks >> 4]
  vals = np.ldexp(vals, (scales.astype(np.int32) - 127)[..., None])
  return vals.reshape(*lead, nb * 32)


def test_gpt_oss_layout_round_trip_bit_exact(rng, tmp_path):
  e, k, n = 3, 2880 // 10 * 2, 40  # K = 576: 18 blocks, not a multiple of 128
  codes = rng.integers(0, 16, (e, k, n), dtype=np.uint8)
  scales_kn = rng.integers(100, 140, (e, k // 32, n), dtype=np.uint8)
  blocks = np_gpt_oss_blocks(codes)
  scales = scales_kn.transpose(0, 2, 1).copy()
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path = tmp_path / "experts.safetensors"
  name = "model.layers.0.mlp.experts.down_proj"
  save_file({f"{name}_blocks": blocks, f"{name}_scales": scales}, str(path))
  g = qjax.read_gpt_oss_mxfp4(path, name)
  assert g.shape == (k, n) and g.blocks.shape == (e, n, k // 32, 16)
  ref = np_gpt_oss_dequantize(blocks, scales).transpose(0, 2, 1)
  np.testing.assert_array_equal(np.asarray(g.dequantize()), ref.astype(np.float32))

  mx = jax.jit(lambda v: v.to_mxfp4())(g)
  assert isinstance(mx, qjax.MXFP4Weight) and mx.codes.shape == (e, 640 // 8, n)
  np.testing.assert_array_equal(np.asarray(mx.unpacked_codes()), codes)
  np.testing.assert_array_equal(np.asarray(mx.scales), scales_kn)
  np.testing.assert_array_equal(np.asarray(mx.dequantize()), np.asarray(g.dequantize()))
  back = jax.jit(qjax.GptOssMXFP4Weight.from_mxfp4)(mx)
  np.testing.assert_array_equal(np.asarray(back.blocks), blocks)
  np.testing.assert_array_equal(np.asarray(back.scales), scales)

  one = jax.tree.map(lambda a: a[1], g)
  x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
  assert rel_err(qjax.matmul(x, one), np.asarray(x, np.float64) @ ref[1]) < 1e-5


@pytest.mark.parametrize("scales_shape", [(40, 18), (1, 40, 18), (2, 40, 18)])
def test_read_gpt_oss_refuses_scales_of_other_experts(rng, tmp_path, scales_shape):
  """Blocks of 3 experts with scales of none, one or two: refused by name (dequantize used
  to broadcast one expert's scales over all of them)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path = tmp_path / "x.safetensors"
  save_file({"a_blocks": rng.integers(0, 256, (3, 40, 18, 16), dtype=np.uint8),
             "a_scales": rng.integers(100, 140, scales_shape, dtype=np.uint8)}, str(path))
  with pytest.raises(ValueError, match=r"blocks \(3, 40, 18, 16\) and scales .* must share "
                     r"their leading expert axes, got \(3,\) and"):
    qjax.read_gpt_oss_mxfp4(path, "a")


def test_read_gpt_oss_names_missing_tensor(tmp_path):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path = tmp_path / "x.safetensors"
  save_file({"a_blocks": np.zeros((1, 2, 1, 16), np.uint8)}, str(path))
  with pytest.raises(KeyError, match="a_scales"):
    qjax.read_gpt_oss_mxfp4(path, "a")


# ------------------------------------------------------------------------- matmul


def reference(x, w) -> np.ndarray:
  return np.asarray(x, np.float64) @ np_dequantize(w)


@functools.lru_cache(maxsize=4)
def _weight(fmt, k, n):
  rng = np.random.default_rng(seed_from(f"fp4-{fmt}-{k}-{n}"))
  w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k))
  return (qjax.quantize_mxfp4 if fmt == "mxfp4" else qjax.quantize_nvfp4)(w)


def make_case(name, fmt, m, k, n, dtype):
  rng = np.random.default_rng(seed_from(name))
  return jnp.asarray(rng.standard_normal((m, k)), dtype), _weight(fmt, k, n)


FORMATS = ("mxfp4", "nvfp4")
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# (m, k, n): odd M and N, K not a multiple of 128 (2880 is GPT-OSS's hidden size).
SMALL = ((1, 256, 384), (5, 96, 33), (17, 2880, 72), (100, 160, 130), (3, 1024, 1000))
LARGE = ((1, 4096, 4096), (16, 4096, 14336), (64, 2880, 5760), (257, 4096, 4096),
         (3, 14336, 4096))


def _cases(shapes):
  return [(fmt, m, k, n, dt) for fmt in FORMATS for (m, k, n) in shapes for dt in DTYPES]


def case_id(c):
  fmt, m, k, n, dt = c
  return f"{fmt}-M{m}-K{k}-N{n}-{jnp.dtype(dt).name}"


class MatmulSuite:
  """Subclasses set ``run(x, w) -> y`` and ``CASES``."""

  CASES = ()

  def run(self, x, w):
    raise NotImplementedError

  def check(self, name, case):
    fmt, m, k, n, dt = case
    x, w = make_case(name, fmt, m, k, n, dt)
    y = self.run(x, w)
    assert y.shape == (m, n) and y.dtype == jnp.dtype(dt)
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
    assert rel_err(y, reference(x, w)) < 1e-2


def _kernel(x, w, interpret, config=None):
  from pallas_kernels import fp4_matmul as km  # pylint: disable=g-import-not-at-top
  return jax.jit(lambda a, b: km.fp4_matmul(a, b, interpret=interpret, config=config,
                                            poison=True))(x, w)


class TestXla(MatmulSuite):

  def run(self, x, w):
    return jax.jit(lambda a, b: qjax.matmul(a, b, implementation="xla"))(x, w)

  @pytest.mark.parametrize("case", _cases(SMALL), ids=case_id)
  def test_matches_float64(self, request, case):
    self.check(request.node.nodeid, case)


  @pytest.mark.parametrize("quantize", [qjax.quantize_mxfp4, qjax.quantize_nvfp4])
  def test_vmap_over_experts(self, rng, quantize):
    w = quantize(jnp.asarray(rng.standard_normal((3, 128, 24)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 2, 128)), jnp.float32)
    y = jax.jit(jax.vmap(lambda a, b: qjax.matmul(a, b, implementation="xla")))(x, w)
    ref = np.einsum("ebk,ekn->ebn", np.asarray(x, np.float64), np_dequantize(w))
    assert y.shape == (3, 2, 24) and rel_err(y, ref) < 1e-5


class TestXlaReduce(MatmulSuite):
  """The XLA formulation that reads each code word once (the GPU's choice at M = 1),
  forced on every platform."""

  def run(self, x, w):
    return jax.jit(lambda a, b: fp4.matmul_xla(a, b, "reduce"))(x, w)

  @pytest.mark.parametrize("case", _cases(SMALL), ids=case_id)
  def test_matches_float64(self, request, case):
    self.check(request.node.nodeid, case)

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_other_tile_order_and_nan_scale(self, request, fmt):
    """Codes in the plain tile order give the same sums; a NaN block scale (E8M0 255,
    e4m3 0x7F) makes its column NaN, as dequantizing W does."""
    x, w = make_case(request.node.nodeid, fmt, 1, 1024, 96, jnp.float32)
    y = fp4.matmul_xla(x, w.repack(packing.PLAIN_TILE_K), "reduce")
    assert rel_err(y, reference(x, w)) < 1e-5
    nan = jnp.uint8(255) if fmt == "mxfp4" else jnp.asarray(0x7F, jnp.uint8).view(
        jnp.float8_e4m3fn)
    bad = dataclasses.replace(w, scales=w.scales.at[3, 5].set(nan))
    y = np.asarray(fp4.matmul_xla(x, bad, "reduce"))
    assert np.isnan(y[0, 5]) and np.isfinite(np.delete(y, 5, axis=1)).all()
    assert np.isnan(np.asarray(fp4.matmul_xla(x, bad, "materialize"))[0, 5])

  def test_variant_names(self):
    x, w = make_case("variant", "mxfp4", 1, 256, 384, jnp.bfloat16)
    with pytest.raises(ValueError, match="'fold'.*materialize, reduce"):
      fp4.matmul_xla(x, w, "fold")
    assert fp4.select_variant(16) == "materialize"
    on_gpu = jax.devices()[0].platform == "gpu"  # the GPU reads the words once at M = 1
    assert fp4.select_variant(1) == ("reduce" if on_gpu else "materialize")


class TestInterpret(MatmulSuite):
  """Interpret mode compiles once per case on the CPU: a few configs, all dtypes."""

  def run(self, x, w):
    # Small blocks so several programs, K steps and ragged edges are exercised.
    return _kernel(x, w, True, qjax.KernelConfig(block_m=16, block_n=64, block_k=256))

  @pytest.mark.parametrize("case", [c for c in _cases(SMALL) if c[3] <= 1024], ids=case_id)
  def test_matches_float64(self, request, case):
    self.check(request.node.nodeid, case)

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_split_k_and_plain_order(self, request, fmt):
    x, w = make_case(request.node.nodeid, fmt, 7, 1024, 96, jnp.bfloat16)
    cfg = qjax.KernelConfig(block_m=16, block_n=32, block_k=128, split_k=4)
    y = _kernel(x, w.repack(packing.PLAIN_TILE_K), True, cfg)
    assert rel_err(y, reference(x, w)) < 1e-2

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_constant_factor_once_per_output(self, request, fmt):
    """``ptx_scales`` configs apply the decoder's constant factor (2**14, NVFP4's tensor
    scale) to each output once; in interpret mode the scales still decode with JAX ops."""
    x, w = make_case(request.node.nodeid, fmt, 5, 1024, 96, jnp.bfloat16)
    cfg = qjax.KernelConfig(block_m=16, block_n=32, block_k=256, split_k=2, ptx_scales=True)
    assert rel_err(_kernel(x, w, True, cfg), reference(x, w)) < 1e-2

  def test_dispatcher_routes_interpret(self, request):
    x, w = make_case(request.node.nodeid, "mxfp4", 3, 256, 384, jnp.float16)
    assert qjax.implementation_name(w, "interpret") == "pallas_triton-interpret"
    assert rel_err(qjax.matmul(x, w, implementation="interpret"), reference(x, w)) < 1e-2

  def test_subnormal_and_extreme_scales(self, request):
    """Every E2M1 code (the subnormal 0.5 included) with scales far from 1 (as far as the
    output dtype can hold the result)."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    k, n = 128, 64
    codes, words = _random_codes(rng, k, n)
    for dt, (lo, hi) in ((jnp.float16, (127 - 12, 127 + 4)), (jnp.bfloat16, (127 - 60, 127 + 60))):
      w = qjax.MXFP4Weight(codes=words, shape=(k, n), scales=jnp.asarray(
          rng.integers(lo, hi, (k // 32, n), dtype=np.uint8)))
      x = jnp.asarray(rng.standard_normal((2, k)), dt)
      y = _kernel(x, w, True, qjax.KernelConfig(block_m=16, block_n=64, block_k=128))
      y = np.asarray(y, np.float64)
      ref = reference(x, w)
      # Scales within a column differ by up to 2**120: compare column by column.
      err = np.abs(y - ref).max(axis=0) / np.abs(ref).max(axis=0)
      assert err.max() < 1e-2, dt


@needs_gpu
class TestPallasGpu(MatmulSuite):

  def run(self, x, w):
    return _kernel(x, w, False)

  @pytest.mark.parametrize("case", _cases(SMALL + LARGE), ids=case_id)
  def test_matches_float64(self, request, case):
    self.check(request.node.nodeid, case)

  @pytest.mark.parametrize("case", [c for c in _cases(SMALL) if c[1] > 1], ids=case_id)
  @pytest.mark.parametrize("block_n", [64, 128])
  def test_scales_in_ptx(self, request, case, block_n):
    """The tiled kernel with its block scales decoded in inline PTX (a tuner choice)."""
    fmt, m, k, n, dt = case
    x, w = make_case(request.node.nodeid, fmt, m, k, n, dt)
    cfg = qjax.KernelConfig(block_m=16, block_n=block_n, block_k=256, split_k=2,
                            ptx_scales=True)
    y = np.asarray(_kernel(x, w, False, cfg), np.float64)
    assert np.isfinite(y).all() and rel_err(y, reference(x, w)) < 1e-2

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_auto_picks_pallas_for_small_m(self, request, fmt):
    x, w = make_case(request.node.nodeid, fmt, 16, 4096, 4096, jnp.bfloat16)
    assert qjax.implementation_name(w) == "pallas_triton"
    assert rel_err(jax.jit(qjax.matmul)(x, w), reference(x, w)) < 1e-2


def test_bench_fp4_formats_floor_from_packed_bytes(tmp_path, capsys):
  import json  # pylint: disable=g-import-not-at-top
  from qjax._src import cli  # pylint: disable=g-import-not-at-top
  path = tmp_path / "b.json"
  assert cli.main(["bench", "--calls", "2", "--m", "1", "--shapes", "256x128", "--impl",
                   "xla", "--format", "mxfp4,nvfp4,mxfp4nk,nvfp4nk", "--json", str(path)]) == 0
  rows = {r["fmt"]: r for r in json.loads(path.read_text())["rows"]}
  io_bytes = 256 * 2 + 128 * 2  # x and the output, bf16
  # codes: 256 * 128 / 2 bytes; scales: one byte per 32 (MXFP4) or 16 (NVFP4) weights.
  assert rows["mxfp4"]["floor_bytes"] == 16384 + 1024 + io_bytes
  assert rows["nvfp4"]["floor_bytes"] == 16384 + 2048 + 4 + io_bytes
  # The [N, K / 8] layouts hold the same bytes.
  assert rows["mxfp4nk"]["floor_bytes"] == rows["mxfp4"]["floor_bytes"]
  assert rows["nvfp4nk"]["floor_bytes"] == rows["nvfp4"]["floor_bytes"]
  with pytest.raises(SystemExit) as e:  # a usage error naming the known formats
    cli.main(["bench", "--format", "fp4", "--m", "1", "--shapes", "256x128"])
  assert e.value.code == 2
  assert "known formats: int4,int4nk,mxfp4,mxfp4nk,nvfp4,nvfp4nk" in capsys.readouterr().err
