"""The M = 1 INT4 kernel (pallas_kernels.int4_gemv) against the float64 reference.

Every group layout it takes (16, 32, 64, 128, 256, one group), zero points, float biases
and the symmetric form, ragged N and K, and each loop shape (K-tiles per step, split-K,
prefetch depth). Interpret mode on the CPU; the compiled kernel (PTX dequantization) on a
GPU. Outputs are poisoned before each run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
import ptx_emulator
from conftest import needs_gpu, rel_err, seed_from
from test_matmul import reference

# (K, N, group_size): odd N, K off the 128-row tile, every group layout.
SHAPES = [(256, 64, 128), (384, 70, 32), (640, 33, 64), (512, 96, 16), (1024, 48, 256),
          (200, 130, None), (96, 8, 32), (1536, 200, 128)]
FORMS = ("sym", "zeros", "biases")


def _weight(rng, k, n, g, form):
  """Random codes in the kernel's tile order (any 4-bit pattern is a valid weight) and
  random group parameters; group sizes qjax.quantize does not produce included."""
  g = g or k
  kp = -(-k // qjax.NATIVE_TILE_K) * qjax.NATIVE_TILE_K
  codes = jnp.asarray(rng.integers(0, 2**32, (kp // 8, n), dtype=np.uint64), jnp.uint32)
  groups = (k // g, n)
  scales = jnp.asarray(rng.uniform(0.5, 1.5, groups) / np.sqrt(k), jnp.bfloat16)
  zeros = jnp.asarray(rng.integers(0, 16, groups), jnp.uint8) if form == "zeros" else None
  biases = (jnp.asarray(rng.standard_normal(groups) / np.sqrt(k), jnp.bfloat16)
            if form == "biases" else None)
  return qjax.Int4Weight(codes=codes, scales=scales, zeros=zeros, shape=(k, n), group_size=g,
                         biases=biases)


class GemvSuite:
  interpret: bool

  def run(self, x, w, config=None):
    from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
    return jax.jit(lambda a, b: int4_gemv.int4_gemv(a, b, config=config, poison=True,
                                                    interpret=self.interpret))(x, w)

  @pytest.mark.parametrize("form", FORMS)
  @pytest.mark.parametrize("k,n,g", SHAPES, ids=lambda v: str(v))
  def test_matches_float64(self, request, k, n, g, form):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = _weight(rng, k, n, g, form)
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
      x = jnp.asarray(rng.standard_normal((1, k)), dt)
      y = self.run(x, w)
      assert y.shape == (1, n) and y.dtype == jnp.dtype(dt)
      y = np.asarray(y, np.float64)
      assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
      assert rel_err(y, reference(x, w)) < 1e-2, dt

  @pytest.mark.parametrize("bn,bk,split,depth,warps", [
      (32, 128, 1, 0, 4), (64, 256, 2, 1, 4), (128, 256, 3, 2, 8), (64, 512, 1, 2, 4),
      (32, 128, 12, 1, 4), (128, 128, 4, 3, 8)])
  def test_loop_shapes(self, request, bn, bk, split, depth, warps):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = _weight(rng, 1536, 100, 128, "zeros")
    x = jnp.asarray(rng.standard_normal((1, 1536)), jnp.bfloat16)
    cfg = qjax.KernelConfig(block_m=1, block_n=bn, block_k=bk, split_k=split,
                            num_warps=warps, num_stages=max(depth, 1))
    if depth == 0:
      from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
      y = int4_gemv.int4_gemv(x, w, config=cfg, interpret=self.interpret, poison=True)
    else:
      y = self.run(x, w, cfg)
    assert rel_err(y, reference(x, w)) < 1e-2

  def test_matmul_routes_one_row_here(self, request):
    """qjax's INT4 kernel sends M = 1 to the GEMV kernel and M > 1 to the tiled one; both
    agree with the reference."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = _weight(rng, 512, 64, 64, "sym")
    impl = "interpret" if self.interpret else "pallas"
    for m in (1, 2):
      x = jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16)
      y = qjax.matmul(x, w, implementation=impl)
      assert rel_err(y, reference(x, w)) < 1e-2


def test_supports():
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  assert int4_gemv.supports(1, 4096, 128) and int4_gemv.supports(1, 4096, 256)
  assert int4_gemv.supports(1, 200, 200)  # one group, K off the tile
  assert not int4_gemv.supports(2, 4096, 128)
  assert not int4_gemv.supports(1, 4096, 48)  # groups straddle K-tiles unevenly
  with pytest.raises(ValueError, match="group_size 48"):
    w = _weight(np.random.default_rng(0), 96, 8, 48, "sym")
    int4_gemv.int4_gemv(jnp.ones((1, 96), jnp.bfloat16), w, interpret=True)


def test_ptx_chunk_is_well_formed():
  """Each chunk's PTX names every operand it is given, once per plane, in order."""
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  for planes in ((0,), (1,), (0, 1), (2, 3, 4, 5), tuple(range(8))):
    asm = int4_gemv._chunk_ptx(planes)
    for i in range(len(planes) + 5):  # $0 out, $1 word, x planes, c, s, acc
      assert f"${i}" in asm, (planes, i)
    assert f"${len(planes) + 5}" not in asm
    assert asm.count("lop3.b32") == len(planes)  # one LOP3 and one FMA per nibble
    assert asm.count("fma.rn.f32 p,") == len(planes)
    assert asm.count("fma.rn.f32 $0") == 1


class TestInterpret(GemvSuite):
  interpret = True


@needs_gpu
class TestPallasGpu(GemvSuite):
  interpret = False


@pytest.mark.parametrize("planes", [tuple(range(8)), (0, 1, 2, 3), (4, 5, 6, 7), (2, 3),
                                    (6, 7), (1,), (4,)])
def test_ptx_chunk_computes_its_contract(planes):
  """The chunk's PTX, emulated (tests/ptx_emulator.py), equals
  ``acc + s * (sum_j x_j (W_j + q_j) - c)`` with ``q_j`` nibble ``j`` of the word: the
  shifts, masks and exponent bases put every nibble where the docstring says."""
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(f"ptx-chunk-{planes}"))
  shape = (64,)
  words = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
  xs = [rng.standard_normal(shape).astype(np.float32) for _ in planes]
  c, s, acc = (rng.standard_normal(shape).astype(np.float32) for _ in "csa")
  ops = {1: words, **{2 + i: x for i, x in enumerate(xs)}}
  ops.update({2 + len(planes): c, 3 + len(planes): s, 4 + len(planes): acc})
  got = ptx_emulator.emulate(int4_gemv._chunk_ptx(planes), ops).astype(np.float64)
  total, bound = -c.astype(np.float64), np.abs(c).astype(np.float64)
  for x, j in zip(xs, planes):
    v = int4_gemv._WEIGHT[j % 2] + ((words >> np.uint32(4 * j)) & np.uint32(0xF))
    total, bound = total + x * v, bound + np.abs(x * v)
  want = acc + s.astype(np.float64) * total
  assert (np.abs(got - want) <= 1e-6 * (np.abs(acc) + np.abs(s) * bound)).all()


def test_weighted_sum_ptx_is_the_weighted_sum():
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from("weighted-sum"))
  weights = (264.0, 24.0, 264.0, 24.0, 256.0, 16.0, 0.5, -3.0)
  xs = [rng.standard_normal((32,)).astype(np.float32) for _ in weights]
  got = ptx_emulator.emulate(int4_gemv._weighted_sum_ptx(weights),
                             {i + 1: x for i, x in enumerate(xs)})
  want = sum(w * x.astype(np.float64) for w, x in zip(weights, xs))
  bound = sum(abs(w) * np.abs(x) for w, x in zip(weights, xs))
  assert (np.abs(got - want) <= 1e-6 * bound).all()


def _ptx_texts():
  """Every chunk and FMA-chain PTX the kernel emits (groups of 8, 4, 2 and 1 planes)."""
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  chunks = [tuple(range(c, c + p)) for p in (8, 4, 2, 1) for c in range(0, 8, p)]
  texts = [int4_gemv._chunk_ptx(c) for c in chunks]
  for c in chunks:
    weights = [int4_gemv._WEIGHT[j % 2] for j in c]
    texts += [int4_gemv._weighted_sum_ptx(tuple(weights)),
              int4_gemv._weighted_sum_ptx(tuple(w + 8.0 for w in weights))]
  return "\n".join(texts)


def test_ptx_text_is_the_validated_one():
  """The PTX is byte for byte what compiled and matched float64 on the H100 (2026-11-23,
  commit 3979228: 31 compiled cases of this file); a deliberate change must update the
  hash here and run the GPU tests again."""
  import hashlib  # pylint: disable=g-import-not-at-top
  assert hashlib.sha256(_ptx_texts().encode()).hexdigest() == (
      "3c7a64caef741953b257605c7e994e1e41de9701bb0530bf345ceef516f407fc")


@pytest.mark.parametrize("k,n,tps,split", [
    (8192, 28672, 1, 2), (4096, 14336, 1, 4), (14336, 4096, 1, 14),  # one tile per step
    (4096, 4096, 2, 16),  # two steps or fewer per program: one step of two tiles
    (1536, 576, 1, 12),  # ... unless that halves a launch below MIN_PROGRAMS programs
    (384, 70, 1, 3), (200, 130, 1, 2)])
def test_heuristic_config(k, n, tps, split):
  """The settings the H100 sweep of 2026-11-23 picked for the Llama shapes, legal as they
  stand (loop_shape keeps them), and about TARGET_PROGRAMS programs where K allows."""
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  cfg = int4_gemv.heuristic_config(k, n)
  assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (1, 64, 4, 1)
  assert (cfg.block_k // qjax.NATIVE_TILE_K, cfg.split_k) == (tps, split)
  tiles = -(-k // qjax.NATIVE_TILE_K)
  assert int4_gemv.loop_shape(cfg, tiles)[:2] == (tps, split)
  # The FP4 kernel keeps two tiles per step wherever K has an even number of tiles.
  fp4 = int4_gemv.heuristic_config(k, n, single_tile_steps=False)
  assert fp4.block_k == qjax.NATIVE_TILE_K * (2 if tiles % 2 == 0 else 1)


def test_candidate_configs_are_legal_gemv_configs():
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  for k, n in ((4096, 4096), (8192, 28672), (384, 70)):
    tiles = -(-k // qjax.NATIVE_TILE_K)
    cfgs = int4_gemv.candidate_configs(k, n)
    assert cfgs and len(set(cfgs)) == len(cfgs)
    for cfg in cfgs:
      assert cfg.block_m == 1
      tps, split, steps = int4_gemv.loop_shape(cfg, tiles)
      assert (cfg.block_k // qjax.NATIVE_TILE_K, cfg.split_k) == (tps, split)
      assert tps * split * steps == tiles
