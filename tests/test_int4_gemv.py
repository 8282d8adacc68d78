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
  """The chunk's PTX, emulated bit for bit (ptx_emulator), equals
  ``acc + s * (sum_j x_j (W_j + q_j) - c)`` with ``q_j`` nibble ``j`` of the word: the
  shifts, masks and exponent bases put every nibble where the docstring says."""
  import ptx_emulator  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(f"ptx-chunk-{planes}"))
  shape = (64,)
  words = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
  xs = [rng.standard_normal(shape) for _ in planes]
  c, s, acc = rng.standard_normal(shape), rng.uniform(0.5, 2, shape), rng.standard_normal(shape)
  ops = {"$1": words, **{f"${2 + i}": x for i, x in enumerate(xs)}}
  ops.update({f"${2 + len(planes)}": c, f"${3 + len(planes)}": s, f"${4 + len(planes)}": acc})
  got = ptx_emulator.run(int4_gemv._chunk_ptx(planes), ops, shape)["$0"]
  total = -c
  for x, j in zip(xs, planes):
    q = (words >> np.uint32(4 * j)) & np.uint32(0xF)
    total = total + x * (int4_gemv._WEIGHT[j % 2] + q)
  np.testing.assert_allclose(got, acc + s * total, rtol=1e-12, atol=1e-12)


def test_weighted_sum_ptx_is_the_weighted_sum():
  import ptx_emulator  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from("weighted-sum"))
  weights = (264.0, 24.0, 264.0, 24.0, 256.0, 16.0, 0.5, -3.0)
  xs = [rng.standard_normal((32,)) for _ in weights]
  got = ptx_emulator.run(int4_gemv._weighted_sum_ptx(weights),
                         {f"${i + 1}": x for i, x in enumerate(xs)}, (32,))["$0"]
  np.testing.assert_allclose(got, sum(w * x for w, x in zip(weights, xs)), rtol=1e-12)
