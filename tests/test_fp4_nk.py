"""MXFP4NKWeight and NVFP4NKWeight (E2M1 codes ``[N, K // 8]``, block scales) and the
wgmma kernel's FP4 form.

CPU: the layout conversion is bit-exact both ways and stores the codes in the documented
fragment order; decoding every E2M1 code with random scales equals ml_dtypes'; the XLA
path against float64; save / load; the kernel's configurations and argument checks; the
kernel lowers for CUDA, also reading a layer of a stack in place. GPU (Hopper): the
compiled kernel against float64 on fresh random codes and scales, outputs poisoned, many
shapes and configurations, chained tiles, ``qjax.layer_of``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qjax
from qjax._src import fp4_nk
from qjax._src import packing
from qjax._src import stacked
from pallas_kernels import int4_wgmma as kw
from tests.conftest import (assert_same_bits, needs_gpu, pallas_operand_shapes, rel_err,
                            seed_from)
from tests.test_int4_nk import _poisoned_run  # the kernel's output buffer first holds NaN

needs_hopper = pytest.mark.skipif(
    not kw.supported(jax.devices()[0]),
    reason="the wgmma kernel needs an NVIDIA Hopper GPU (sm_90)")


FMTS = ["mxfp4", "nvfp4"]
# Default block scale bits: E8M0 exponents 2**-9 .. 2**8, float8_e4m3fn 2**-6 .. 240.
SCALE_BITS = {"mxfp4": (118, 136), "nvfp4": (0x08, 0x78)}


def make_case(name, m, k, n, fmt="mxfp4", *, dtype=jnp.bfloat16, scale_bits=None, lead=()):
  """x ``[m, k]``, an MXFP4Weight or NVFP4Weight of uniformly random codes (all 16) and
  block scale bits in ``scale_bits`` (half-open; default :data:`SCALE_BITS`), and its
  [N, K // 8] form."""
  rng = np.random.default_rng(seed_from(name))
  q = jnp.asarray(rng.integers(0, 16, (*lead, k, n)), jnp.uint8)
  codes = packing.pack_codes(q, qjax.NATIVE_TILE_K)  # K padded to the tile with code 0
  lo, hi = scale_bits or SCALE_BITS[fmt]
  if fmt == "mxfp4":
    scales = jnp.asarray(rng.integers(lo, hi, (*lead, k // 32, n)), jnp.uint8)
    w = qjax.MXFP4Weight(codes=codes, scales=scales, shape=(k, n))
    wn = qjax.to_mxfp4_nk(w)
  else:
    bits = rng.integers(lo, hi, (*lead, k // 16, n)).astype(np.uint8)
    scales = jnp.asarray(bits.view(ml_dtypes.float8_e4m3fn))
    g = jnp.asarray(rng.uniform(0.5, 2.0, lead) / 512, jnp.float32)
    w = qjax.NVFP4Weight(codes=codes, scales=scales, global_scale=g, shape=(k, n))
    wn = qjax.to_nvfp4_nk(w)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  return x, w, wn


def weight_f64(w):
  """float64 ``[K, N]`` of an MXFP4Weight or NVFP4Weight, decoded with ml_dtypes."""
  q = np.asarray(w.unpacked_codes(), np.uint8)
  values = q.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
  if isinstance(w, qjax.MXFP4Weight):
    scales = np.asarray(w.scales, np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return values * np.repeat(scales.astype(np.float64), 32, axis=-2)
  scales = np.asarray(w.scales).astype(np.float64)
  g = np.asarray(w.global_scale, np.float64)[..., None, None]
  return values * np.repeat(scales, 16, axis=-2) * g


def reference(x, w):
  return np.asarray(x.astype(jnp.float32), np.float64) @ weight_f64(w)


def assert_each_output_close(y, ref):
  """Each output within the kernel's only roundings: the weights and x are exact in
  bf16, so what remains is y's rounding to bf16 (half an ulp: 2**-9 of |y| relative to
  its leading bit, so at most 2**-8 of |y|) and float32 sums (far below 1e-3 of the rms)."""
  slack = 2.0 ** -8 * np.abs(ref) + 1e-3 * np.sqrt(np.mean(ref ** 2))
  worst = np.max(np.abs(y - ref) / slack)
  assert worst <= 1.0, f"an output is off by {worst:.2f}x its rounding bound"


# Where bit b (mantissa, exponent low, exponent high, sign) of code e of a word is stored:
# pairs (e, e + 4) for e = 0..2 one rotation apart from bf16's bits 8..6 and 15 (and their
# high-half mirror), pair 3 with its exponents and signs in place.
STORED_BIT = {0: (0, 1, 2, 9), 1: (4, 5, 6, 13), 2: (10, 11, 12, 19), 3: (14, 7, 8, 15),
              4: (16, 17, 18, 25), 5: (20, 21, 22, 29), 6: (26, 27, 28, 3),
              7: (30, 23, 24, 31)}


def fragment_order_reference(q):
  """numpy: code e of word (n, 4t + c) is q[32t + 8 (e % 4) + 2c + e // 4, n], its bits
  where :data:`STORED_BIT` says."""
  k, n = q.shape
  words = np.zeros((n, k // 8), np.uint64)
  for t in range(k // 32):
    for c in range(4):
      for e in range(8):
        code = q[32 * t + 8 * (e % 4) + 2 * c + e // 4, :].astype(np.uint64)
        for b, at in enumerate(STORED_BIT[e]):
          words[:, 4 * t + c] |= (code >> np.uint64(b) & np.uint64(1)) << np.uint64(at)
  return words.astype(np.uint32)


def test_stored_bits_are_the_documented_ones_and_invert():
  assert {e: tuple(v) for e, v in enumerate(fp4_nk.STORED_BIT)} == STORED_BIT
  words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(
      np.uint32)
  for conv in (np.asarray, jnp.asarray):
    w = conv(words)
    np.testing.assert_array_equal(np.asarray(fp4_nk.from_stored_words(
        fp4_nk.to_stored_words(w))), words)
    np.testing.assert_array_equal(np.asarray(fp4_nk.to_stored_words(
        fp4_nk.from_stored_words(w))), words)
    for e in range(8):
      np.testing.assert_array_equal(
          np.asarray(fp4_nk.stored_nibble(fp4_nk.to_stored_words(w), e)),
          (words >> np.uint32(4 * e)) & np.uint32(0xF))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pair", range(4))
def test_pair_ptx_makes_each_pairs_weights_exactly(request, fmt, pair):
  """The kernel's PTX of each pair of a stored word (tests/ptx_emulator.py) gives the two
  codes' E2M1 values times the block scale as bf16, exactly, for all 256 code pairs (the
  word's other codes random), and, for NVFP4, 2**-8 of that (the epilogue restores it)."""
  import ptx_emulator  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  lo, hi = np.meshgrid(np.arange(16), np.arange(16))
  lo, hi = lo.ravel().astype(np.uint32), hi.ravel().astype(np.uint32)
  frag = rng.integers(0, 2 ** 32, lo.shape, dtype=np.uint64).astype(np.uint32)
  frag &= ~np.uint32(0xF << 4 * pair | 0xF << 4 * (pair + 4))
  frag |= lo << np.uint32(4 * pair) | hi << np.uint32(4 * (pair + 4))
  if fmt == "mxfp4":
    e = rng.integers(100, 150, lo.shape)
    scale = np.exp2(e - 127.0)
    factor = (e << 7).astype(np.uint32)  # E8M0 as bf16 bits
    shift = 0
  else:
    bits = rng.integers(0x08, 0x7F, lo.shape).astype(np.uint8) | (
        rng.integers(0, 2, lo.shape).astype(np.uint8) << 7)
    scale = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    factor = (scale * 2.0 ** 118).astype(ml_dtypes.bfloat16).view(np.uint16).astype(
        np.uint32)
    shift = 8
  asm = kw._e2m1_pair_ptx(pair, fmt)
  asm = asm.replace("{ ", "{\n").replace("; ", ";\n").replace(" }", "\n}")
  out = ptx_emulator.emulate(asm, {1: fp4_nk.to_stored_words(frag),
                                   2: factor | factor << np.uint32(16)})
  for half, code in ((0, lo), (16, hi)):
    got = ((out >> np.uint32(half)) & np.uint32(0xFFFF)).astype(np.uint16).view(
        ml_dtypes.bfloat16).astype(np.float64)
    want = code.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64) * scale
    np.testing.assert_array_equal(got, want * 2.0 ** -shift)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 too


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k,n", [(32, 8), (256, 37), (992, 24), (512, 130)])
def test_layout_is_bit_exact(request, k, n, fmt):
  _, w, wn = make_case(request.node.nodeid, 1, k, n, fmt)
  q = np.asarray(w.unpacked_codes())
  np.testing.assert_array_equal(np.asarray(wn.codes), fragment_order_reference(q))
  np.testing.assert_array_equal(np.asarray(wn.codes_nk()), q.T)
  np.testing.assert_array_equal(np.asarray(wn.dequantize()), np.asarray(w.dequantize()))
  back = wn.to_mxfp4() if fmt == "mxfp4" else wn.to_nvfp4()
  assert type(back) is type(w)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The same bytes, moved (MXFP4Weight pads K to its tile of 128 with zero codes).
  assert wn.nbytes == w.nbytes - (-k % 128) * n // 2


# sha256 of the eight pair PTX texts (both formats) as compiled and matched on the H100
# (session 21: tests/test_fp4_nk.py and tests/test_moe_nk.py, 254 passed).
_VALIDATED_PAIR_PTX_SHA256 = "af3dcb28f6ec5679993cd6409639ec2de26eeb2bbdd506859b23507229bd7cde"


def test_pair_ptx_is_the_one_validated_on_the_gpu():
  """ptxas runs on the GPU machine only: a changed text must run the GPU tests first (then
  update the hash)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  text = "\n".join(kw._e2m1_pair_ptx(i, f) for f in FMTS for i in range(4))
  assert hashlib.sha256(text.encode()).hexdigest() == _VALIDATED_PAIR_PTX_SHA256


@pytest.mark.parametrize("fmt", FMTS)
def test_every_code_and_random_scales_decode_as_ml_dtypes(request, fmt):
  """All 16 E2M1 codes in every block. MXFP4: exponents over E8M0's range but for the
  NaN (255) and the two whose float32 products are subnormal (0, 1: flushed by XLA on
  the CPU). NVFP4: every finite float8_e4m3fn but its subnormals, either sign."""
  k, n = 64, 48
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  q = np.stack([rng.permutation(16) for _ in range(k // 16 * n)]).reshape(k // 16, n, 16)
  q = q.transpose(0, 2, 1).reshape(k, n).astype(np.uint8)
  codes = packing.pack_codes(jnp.asarray(q), qjax.NATIVE_TILE_K)
  if fmt == "mxfp4":
    scales = rng.integers(2, 255, (k // 32, n)).astype(np.uint8)
    w = qjax.MXFP4Weight(codes=codes, scales=jnp.asarray(scales), shape=(k, n))
    wn = qjax.to_mxfp4_nk(w)
  else:
    bits = (rng.integers(0x08, 0x7F, (k // 16, n)) | (rng.integers(0, 2, (k // 16, n)) << 7))
    scales = jnp.asarray(bits.astype(np.uint8).view(ml_dtypes.float8_e4m3fn))
    w = qjax.NVFP4Weight(codes=codes, scales=scales, global_scale=jnp.float32(0.75),
                         shape=(k, n))
    wn = qjax.to_nvfp4_nk(w)
  got = np.asarray(wn.dequantize_nk(jnp.float32), np.float64)
  np.testing.assert_array_equal(got, weight_f64(w).T)


@pytest.mark.parametrize("fmt", FMTS)
def test_conversion_is_jittable_and_takes_a_stack(request, fmt):
  _, w, wn = make_case(request.node.nodeid, 1, 256, 48, fmt, lead=(3,))
  jitted = jax.jit(qjax.to_mxfp4_nk if fmt == "mxfp4" else qjax.to_nvfp4_nk)(w)
  assert jitted.codes.shape == (3, 48, 32) and jitted.scales.shape == (3, 256 // 32 * (
      1 if fmt == "mxfp4" else 2), 48)
  np.testing.assert_array_equal(np.asarray(jitted.codes), np.asarray(wn.codes))
  np.testing.assert_array_equal(np.asarray(wn.dequantize()), np.asarray(w.dequantize()))


def test_rejects_what_it_cannot_hold(request):
  _, w, wn = make_case(request.node.nodeid, 1, 256, 32)
  with pytest.raises(TypeError, match="MXFP4Weight"):
    qjax.to_mxfp4_nk(qjax.quantize(jnp.ones((256, 32))))
  with pytest.raises(ValueError, match=r"codes must be \(32, 32\)"):
    dataclasses.replace(wn, codes=wn.codes[:, :16])
  with pytest.raises(ValueError, match=r"scales must be \(8, 32\) of dtype \['uint8'\]"):
    dataclasses.replace(wn, scales=wn.scales.astype(jnp.float32))
  with pytest.raises(ValueError, match="K=48, N=32. needs K a positive multiple of 32"):
    qjax.MXFP4NKWeight(codes=jnp.zeros((32, 6), jnp.uint32), scales=jnp.zeros((1, 32),
                       jnp.uint8), shape=(48, 32))
  with pytest.raises(TypeError, match="NVFP4Weight"):
    qjax.to_nvfp4_nk(w)
  _, _, nv = make_case(request.node.nodeid, 1, 256, 32, "nvfp4")
  with pytest.raises(ValueError, match=r"global_scale must be \(\) of dtype float32"):
    dataclasses.replace(nv, global_scale=jnp.ones((2,), jnp.float32))
  with pytest.raises(ValueError, match=r"scales must be \(16, 32\) of dtype \['float8_e4m3fn'\]"):
    dataclasses.replace(nv, scales=nv.scales.astype(jnp.float32))


@pytest.mark.parametrize("fmt", FMTS)
def test_save_and_load(request, tmp_path, fmt):
  _, w, wn = make_case(request.node.nodeid, 1, 256, 40, fmt)
  qjax.save(tmp_path / "w.qjax", {"w": wn})
  back = qjax.load(tmp_path / "w.qjax")["w"]
  assert type(back) is type(wn)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(wn)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(w.dequantize()))
  # A file of sessions 19-20 (nibbles in order, format "mxfp4_nk") must not load as this.
  raw = (tmp_path / "w.qjax").read_bytes()
  old = raw.replace(f'\\"{fmt}_nk.v2\\"'.encode(), f'\\"{fmt}_nk\\"   '.encode())
  assert old != raw
  (tmp_path / "old.qjax").write_bytes(old)
  with pytest.raises(ValueError, match=f"'{fmt}_nk' is retired.*to_{fmt}_nk"):
    qjax.load(tmp_path / "old.qjax")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,k,n,dtype", [
    (1, 256, 128, jnp.bfloat16), (5, 384, 37, jnp.bfloat16), (33, 512, 96, jnp.float16),
    (7, 256, 64, jnp.float32), (2, 992, 24, jnp.bfloat16),
    # one row: the fused multiply-and-sum over the words
    (1, 512, 40, jnp.float32), (1, 992, 24, jnp.float16)])
def test_xla_path(request, m, k, n, dtype, fmt):
  x, w, wn = make_case(request.node.nodeid, m, k, n, fmt, dtype=dtype)
  y = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="xla"))(x, wn)
  assert y.shape == (m, n) and y.dtype == dtype
  assert rel_err(y, reference(x, w)) < (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("fmt", FMTS)
def test_dispatch_on_this_device(request, fmt):
  x, _, wn = make_case(request.node.nodeid, 3, 256, 128, fmt)
  on_hopper = kw.supported(jax.devices()[0])
  assert qjax.implementation_name(wn) == ("mosaic_gpu_wgmma" if on_hopper else "xla")
  with pytest.raises(NotImplementedError, match="no interpret mode"):
    qjax.matmul(x, wn, implementation="interpret")


def _abstract(fmt, k, n, lead=()):
  """An abstract MXFP4NKWeight or NVFP4NKWeight ``[K, N]`` (ShapeDtypeStruct leaves)."""
  codes = jax.ShapeDtypeStruct((*lead, n, k // 8), jnp.uint32)
  if fmt == "mxfp4":
    return qjax.MXFP4NKWeight(codes=codes, shape=(k, n), scales=jax.ShapeDtypeStruct(
        (*lead, k // 32, n), jnp.uint8))
  return qjax.NVFP4NKWeight(
      codes=codes, scales=jax.ShapeDtypeStruct((*lead, k // 16, n), jnp.float8_e4m3fn),
      global_scale=jax.ShapeDtypeStruct(lead, jnp.float32), shape=(k, n))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 8, 16, 64, 100, 256, 2048])
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672),
                                 (2880, 5760), (1024, 384)])
def test_config_for_is_legal(m, k, n, fmt):
  """config_for(fmt=...) passes the kernel's checks and fits shared memory with its
  one-byte scale rows (one per 32 or 16 of K)."""
  cfg = kw.config_for(m, k, n, 32, fp4=fmt)
  assert not cfg.scale_accumulator
  assert cfg.mma_sync == (cfg.tile_m == 8)
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  wn = _abstract(fmt, k, n)
  # What the kernel runs with no config given and no tuning table entry.
  assert kw.default_config(m, wn, table=False) == cfg
  kw._check(x, wn, cfg)  # pylint: disable=protected-access
  block = wn.block_size
  assert cfg.stages * cfg.stage_bytes(block, 1) + cfg.epilogue_bytes() <= kw._SMEM_MAX


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,n,want", [
    # (tile_k, stages, split_k, chained) for GPT-OSS's K = 2880 (session 24's H100 sweep):
    # steps of 320, three stages; K split in 5 (steps of 192) or 3 where the tiles are few.
    (1, 11520, (320, 3, 1, False)), (16, 11520, (320, 3, 1, False)),
    (64, 5760, (320, 3, 1, False)), (1, 201088, (320, 3, 1, True)),
    (1, 5120, (320, 3, 3, False)), (16, 4096, (320, 3, 3, False)),
    (64, 5120, (320, 2, 3, False)), (1, 2944, (192, 3, 5, False)),
    (16, 512, (192, 3, 5, False)), (256, 5120, (64, 8, 1, False))])
def test_config_for_k2880_takes_steps_of_320(m, n, want, fmt):
  cfg = kw.config_for(m, 2880, n, 32, fp4=fmt)
  assert (cfg.tile_k, cfg.stages, cfg.split_k, cfg.chain_tiles) == want


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_declines_what_it_lacks(request, fmt):
  x, _, wn = make_case(request.node.nodeid, 16, 256, 128, fmt)
  with pytest.raises(NotImplementedError, match="bf16 activations"):
    kw.fp4_nk_matmul(x.astype(jnp.float32), wn)
  with pytest.raises(NotImplementedError, match="scale_accumulator"):
    kw.fp4_nk_matmul(x, wn, config=kw.WgmmaConfig(tile_m=16, tile_k=256, epi_m=16,
                                                  scale_accumulator=True))
  _, _, narrow = make_case(request.node.nodeid, 16, 256, 64, fmt)
  with pytest.raises(NotImplementedError, match="N=64 is not a multiple"):
    kw.fp4_nk_matmul(x, narrow, config=kw.WgmmaConfig(tile_m=16, tile_k=256, epi_m=16))
  with pytest.raises(NotImplementedError, match="tile_k=512"):
    kw.fp4_nk_matmul(x, wn, config=kw.WgmmaConfig(tile_m=16, tile_k=512, epi_m=16))


# mma.sync in place of wgmma: 1-2 column tiles of 8, products of 128 of K (of 64 for
# GPT-OSS's K = 2880 in steps of 320 or 192), split K, tile_n 128.
MMA_SYNC_CASES = [
    (5, 1024, 256, kw.WgmmaConfig(tile_m=8, tile_k=512, epi_m=8, split_k=2, stages=2,
                                  mma_sync=True)),
    (13, 2880, 384, kw.WgmmaConfig(tile_m=16, tile_k=320, epi_m=16, stages=3, mma_sync=True)),
    (1, 2880, 640, kw.WgmmaConfig(tile_m=8, tile_k=192, epi_m=8, stages=4, mma_sync=True)),
    (2, 1024, 512, kw.WgmmaConfig(tile_n=128, tile_m=8, tile_k=256, epi_m=8, stages=3,
                                  mma_sync=True)),
]

LOWERED = [(1, 4096, 4096, None), (16, 2048, 512, None), (300, 1024, 512, None),
           (64, 1024, 256, kw.WgmmaConfig(tile_m=64, tile_k=64, stages=3)),
           (40, 1536, 384, kw.WgmmaConfig(tile_m=40, tile_k=512, epi_m=40, stages=2)),
           *MMA_SYNC_CASES]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,k,n,cfg", LOWERED)
def test_kernel_lowers_for_cuda(m, k, n, cfg, fmt):
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  wn = _abstract(fmt, k, n)
  lowered = jax.jit(lambda a, b: kw.fp4_nk_matmul(a, b, config=cfg, num_sms=132)).trace(
      x, wn).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
  # K splits are added in split order (common.sum_splits), never by a reduce.
  assert "stablehlo.reduce" not in lowered.as_text()


def _scanned(stack, x, layers):
  def body(carry, i):
    return carry, qjax.matmul(x, qjax.layer_of(stack, i), implementation="pallas")
  return jax.lax.scan(body, 0, jnp.arange(layers))[1]


def _scanned_wgmma(stack, x, layers):
  """:func:`_scanned` with the kernel called directly, so that it also traces on a CPU."""
  def body(carry, i):
    with stacked.reads_in_place(qjax.layer_of(stack, i)) as layer:
      return carry, kw.fp4_nk_matmul(x, layer, num_sms=132)
  return jax.lax.scan(body, 0, jnp.arange(layers))[1]


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_reads_a_layer_of_a_stack_in_place(request, fmt):
  layers, k, n = 3, 1024, 256
  x, _, stack = make_case(request.node.nodeid, 16, k, n, fmt, lead=(layers,))
  calls = pallas_operand_shapes(jax.make_jaxpr(_scanned_wgmma, static_argnums=2)(
      stack, x, layers).jaxpr)
  assert calls, "no pallas_call traced"
  for shapes in calls:
    assert (layers, n, k) in shapes and (layers, k // stack.block_size, n) in shapes, shapes
  lowered = jax.jit(_scanned_wgmma, static_argnums=2).trace(stack, x, layers).lower(
      lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


GPU_CASES = [
    (1, 256, 128, None), (3, 512, 256, None), (7, 512, 384, None), (16, 1024, 256, None),
    (40, 2048, 1280, None), (64, 4096, 4096, None), (100, 1024, 384, None),
    (130, 2880, 640, None), (300, 512, 640, None), (2048, 1024, 1024, None),
    (1, 2880, 5120, None), (16, 2880, 1152, None), (61, 2880, 256, None),
    (1, 8192, 1024, None),
    (200, 1024, 256, kw.WgmmaConfig(tile_m=64, tile_k=128, split_k=4, stages=6)),
    (96, 768, 384, kw.WgmmaConfig(tile_m=96, tile_k=64, epi_m=32, stages=5)),
    (256, 512, 256, kw.WgmmaConfig(tile_n=128, tile_m=128, stages=3)),
    (16, 2048, 512, kw.WgmmaConfig(tile_m=16, tile_k=256, epi_m=16, stages=4)),
    (5, 1024, 256, kw.WgmmaConfig(tile_m=8, tile_k=512, epi_m=8, split_k=2)),
    (512, 1024, 512, kw.WgmmaConfig(m_minor=True, snake_width=2)),
    *MMA_SYNC_CASES,
]


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,k,n,cfg", GPU_CASES)
def test_wgmma_matches_float64(request, m, k, n, cfg, fmt):
  x, w, wn = make_case(request.node.nodeid, m, k, n, fmt)
  fn = jax.jit(lambda a, b: kw.fp4_nk_matmul(a, b, config=cfg))
  y = _poisoned_run(fn, x, wn, cfg)
  assert y.shape == (m, n) and np.isfinite(y).all(), "unwritten (poisoned) or non-finite"
  ref = reference(x, w)
  assert rel_err(y, ref) < 1e-2
  assert_each_output_close(y, ref)


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("fmt,scale_bits,x_scale", [
    ("mxfp4", (1, 12), 2.0 ** 120), ("mxfp4", (240, 250), 2.0 ** -120),
    # float8_e4m3fn: subnormals (2**-9 .. 7 * 2**-9), then the largest, then negatives.
    ("nvfp4", (0x01, 0x08), 1.0), ("nvfp4", (0x70, 0x7F), 1.0), ("nvfp4", (0x80, 0xFF), 1.0)])
@pytest.mark.parametrize("m", [3, 16])
def test_wgmma_extreme_scales(request, fmt, scale_bits, x_scale, m):
  """Block scales near the ends of their range (MXFP4 weights down to bf16's subnormals,
  2**-127; NVFP4's subnormal and negative scales): still exact; x is scaled so that the
  outputs are normal bf16 numbers. M = 3 runs mma.sync, M = 16 wgmma."""
  x, w, wn = make_case(request.node.nodeid, m, 1024, 256, fmt, scale_bits=scale_bits)
  x = x * x_scale
  y = _poisoned_run(jax.jit(kw.fp4_nk_matmul), x, wn, None)
  ref = reference(x, w)
  assert np.isfinite(y).all()
  assert_each_output_close(y, ref)


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("num_sms", [1, 5, 12])
@pytest.mark.parametrize("m,mma_sync", [(16, False), (6, True)])
def test_wgmma_chained_tiles(request, num_sms, fmt, m, mma_sync):
  cfg = kw.WgmmaConfig(tile_m=-(-m // 8) * 8, tile_k=512, epi_m=-(-m // 8) * 8, stages=2,
                       chain_tiles=True, mma_sync=mma_sync)
  x, w, wn = make_case(request.node.nodeid, m, 2048, 1536, fmt)
  fn = jax.jit(lambda a, b: kw.fp4_nk_matmul(a, b, config=cfg, num_sms=num_sms))
  y = _poisoned_run(fn, x, wn, cfg)
  assert np.isfinite(y).all()
  assert_each_output_close(y, reference(x, w))


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("fmt", FMTS)
def test_wgmma_layer_of_equals_each_layer(request, fmt):
  layers, k, n = 3, 2048, 384
  x, w, stack = make_case(request.node.nodeid, 16, k, n, fmt, lead=(layers,))
  fn = jax.jit(_scanned, static_argnums=2)
  got = np.asarray(fn(stack, x, layers).astype(jnp.float32))
  one = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="pallas"))
  for i in range(layers):
    layer = jax.tree.map(lambda a, i=i: a[i], stack)
    assert_same_bits(lambda i=i: fn(stack, x, layers)[i].astype(jnp.float32),
                     lambda layer=layer: one(x, layer).astype(jnp.float32),
                     f"layer {i}: scanned stack against the layer's own call")
    assert_each_output_close(got[i], reference(x, jax.tree.map(lambda a, i=i: a[i], w)))


@pytest.mark.parametrize("fmt", FMTS)
def test_flax_int4_dense_takes_the_layout(request, fmt):
  """Int4Dense holds any quantized pytree: an FP4 kernel in the [N, K / 8] layout gives
  the float64 result (XLA here; the wgmma kernel on Hopper)."""
  from flax_layers import Int4Dense  # pylint: disable=g-import-not-at-top
  x, w, wn = make_case(request.node.nodeid, 3, 256, 128, fmt)
  bias = jnp.asarray(np.random.default_rng(1).standard_normal(128), jnp.float32)
  y = Int4Dense(128).apply({"params": {"kernel": wn, "bias": bias}}, x)
  assert y.shape == (3, 128)
  ref = reference(x, w) + np.asarray(bias, np.float64)
  assert rel_err(y, ref) < 1e-2
