"""The per-pair MoE GEMV kernel (pallas_kernels.fp4_moe_gemv) against float64.

The reference multiplies each pair's row by its expert decoded by ml_dtypes
(tests/test_fp4.py's ``np_dequantize``) in float64. Inputs are fresh random draws: all 16
E2M1 codes, E8M0 scales over a wide range, activations without zeros, repeated experts and
one expert shared by several pairs; experts no pair selects have NaN scales (E8M0 255), so
reading one would show. Outputs are poisoned before each run.

On the CPU the kernel runs in interpret mode (the plain-ops word step; the PTX word step is
fp4_gemv's, checked by test_fp4_gemv.py's emulator) and its Triton lowering is checked
without compiling. On an NVIDIA GPU the compiled kernel runs in both variants:
``pytest -k "Gpu or pallas"``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import moe
from qjax._src import packing
from conftest import needs_gpu, on_gpu, pallas_operand_shapes, rel_err, seed_from
from test_fp4 import np_dequantize

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# (P, K, N): one pair, odd P, top-4, 16 pairs; K of two blocks, K off the 128-row tile,
# GPT-OSS's 2880; N of one column, odd N, N off block_n, 2880.
CASES = [(1, 64, 7), (3, 96, 130), (4, 2880, 1), (16, 96, 7), (4, 64, 2880), (3, 2880, 130),
         (16, 160, 40)]


def _mod():
  from pallas_kernels import fp4_moe_gemv  # pylint: disable=g-import-not-at-top
  return fp4_moe_gemv


# ----------------------------------------------------------------------------- inputs


def make_experts(rng, e, k, n, dtype=jnp.float32):
  """E experts of random codes in the kernel's tile order and random E8M0 scales (a
  narrower span for float16 outputs)."""
  kp = packing.padded_rows(k, packing.NATIVE_TILE_K)
  codes = rng.integers(0, 16, (e, kp, n), dtype=np.uint8)
  codes[:, k:] = 0  # padding rows hold code 0
  words = np.stack([packing.pack_codes(c, packing.NATIVE_TILE_K) for c in codes])
  lo, hi = (127 - 12, 127 + 3) if dtype == jnp.float16 else (127 - 60, 127 + 60)
  scales = rng.integers(lo, hi, (e, k // 32, n), dtype=np.uint8)
  return qjax.MXFP4Weight(codes=jnp.asarray(words), scales=jnp.asarray(scales), shape=(k, n))


def nan_unselected(w, pair_experts):
  """``w`` with E8M0 NaN scales for every expert no pair selects."""
  scales = np.asarray(w.scales).copy()
  scales[np.setdiff1d(np.arange(scales.shape[0]), pair_experts)] = 255
  return qjax.MXFP4Weight(codes=w.codes, scales=jnp.asarray(scales), shape=w.shape)


def make_rows(rng, r, k, dtype):
  """Standard normal activations, none zero."""
  x = rng.standard_normal((r, k))
  return jnp.asarray(np.where(np.abs(x) < 1e-3, 1e-3, x), dtype)


def make_pairs(rng, p, r, e):
  """``[P]`` rows and experts: random, with one expert shared by several pairs and a
  (row, expert) pair repeated where P allows."""
  rows = rng.integers(0, r, p).astype(np.int32)
  experts = rng.integers(0, e, p).astype(np.int32)
  if p >= 3:
    experts[: p // 2 + 1] = experts[0]   # one expert serves half the pairs
    rows[1], experts[1] = rows[0], experts[0]  # and one pair appears twice
  return rows, experts


def np_reference(rows, w, pair_rows, pair_experts):
  """float64 ``[P, N]``: each pair's row @ its expert (only selected experts decoded)."""
  x = np.asarray(jnp.asarray(rows, jnp.float32), np.float64)[pair_rows]
  out = np.zeros((len(pair_rows), w.shape[1]))
  bound = np.zeros_like(out)
  for e in np.unique(pair_experts):
    sel = pair_experts == e
    wd = np_dequantize(jax.tree.map(lambda a: np.asarray(a[e]), w))
    out[sel] = x[sel] @ wd
    bound[sel] = np.abs(x[sel]) @ np.abs(wd)
  return out, bound


def check(y, rows, w, pair_rows, pair_experts, dtype):
  """Shape, dtype, no poison left, error < 1e-2 over all outputs and per element relative
  to ``sum_k |x_k W_kn|`` (scales differ by up to 2**120 between columns)."""
  assert y.shape == (len(pair_rows), w.shape[1]) and y.dtype == jnp.dtype(dtype)
  y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
  assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
  ref, bound = np_reference(rows, w, pair_rows, pair_experts)
  assert rel_err(y, ref) < 1e-2, dtype
  assert (np.abs(y - ref) <= 1e-2 * bound).all(), dtype


# ----------------------------------------------------------------------------- suites


class MoEGemvSuite:
  interpret: bool
  variant = "ptx"

  def run(self, rows, w, pair_rows, pair_experts, config=None):
    fn = _mod().mxfp4_moe_gemv
    return jax.jit(lambda *a: fn(*a, config=config, variant=self.variant, poison=True,
                                 interpret=self.interpret))(
                                     rows, w, jnp.asarray(pair_rows), jnp.asarray(pair_experts))

  @pytest.mark.parametrize("p,k,n", CASES, ids=lambda v: str(v))
  def test_matches_float64(self, request, p, k, n):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    e, r = 12, 5
    for dt in DTYPES:
      pair_rows, pair_experts = make_pairs(rng, p, r, e)
      w = nan_unselected(make_experts(rng, e, k, n, dt), pair_experts)
      rows = make_rows(rng, r, k, dt)
      check(self.run(rows, w, pair_rows, pair_experts), rows, w, pair_rows, pair_experts, dt)

  @pytest.mark.parametrize("bn,bk,split,depth,warps", [
      (32, 128, 1, 1, 4), (64, 256, 2, 1, 4), (128, 256, 3, 2, 8), (64, 512, 1, 2, 4),
      (32, 128, 13, 1, 4), (64, 128, 5, 2, 4), (128, 128, 4, 3, 8), (64, 128, 99, 1, 4)])
  def test_loop_shapes(self, request, bn, bk, split, depth, warps):
    """13 K-tiles (K = 1568, off the tile), N = 100, under each loop shape: splits that
    divide the tiles, splits whose last one runs past the end (5 and 4 of 13), more
    splits than tiles."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    pair_rows, pair_experts = make_pairs(rng, 3, 2, 6)
    w = nan_unselected(make_experts(rng, 6, 1568, 100, jnp.bfloat16), pair_experts)
    rows = make_rows(rng, 2, 1568, jnp.bfloat16)
    cfg = qjax.KernelConfig(block_m=1, block_n=bn, block_k=bk, split_k=split,
                            num_warps=warps, num_stages=depth)
    check(self.run(rows, w, pair_rows, pair_experts, cfg), rows, w, pair_rows, pair_experts,
          jnp.bfloat16)

  def test_k_tail_on_whole_tiles(self, request):
    """K = 640 (5 whole K-tiles, no ragged K mask) in 2 splits of 3 steps: the x loads of
    the step past the end are masked by the tail alone."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    pair_rows, pair_experts = make_pairs(rng, 4, 3, 5)
    w = nan_unselected(make_experts(rng, 5, 640, 64), pair_experts)
    rows = make_rows(rng, 3, 640, jnp.float32)
    cfg = qjax.KernelConfig(block_m=1, block_n=64, block_k=128, split_k=2, num_stages=1)
    check(self.run(rows, w, pair_rows, pair_experts, cfg), rows, w, pair_rows, pair_experts,
          jnp.float32)

  def test_out_of_range_ids_give_nan_rows(self, request):
    """Experts outside [0, E) and rows outside [0, R): that pair's row is NaN, the others
    are exact."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 4, 96, 40)
    rows = make_rows(rng, 3, 96, jnp.float32)
    pair_rows = np.array([0, 1, 2, 3, -1, 2], np.int32)
    pair_experts = np.array([4, 3, -1, 0, 1, 2], np.int32)
    y = np.asarray(self.run(rows, w, pair_rows, pair_experts))
    bad = np.array([True, False, True, True, True, False])
    assert np.isnan(y[bad]).all()
    check(y[~bad], rows, w, pair_rows[~bad], pair_experts[~bad], jnp.float32)

  def test_constant_row_zero_is_not_handed_to_the_kernel(self, request):
    """Concrete all-zero pair rows (one token's, as ``qjax.moe_matmul`` passes them) are
    left out of the kernel's operands, which then reads row 0; traced or nonzero pair rows
    are handed over. Both match float64, poisoned outputs, experts' NaN scales unread."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    fn = _mod().mxfp4_moe_gemv
    p, k, n = 4, 2880, 130
    for r, pair_rows in ((1, np.zeros(p, np.int32)), (3, np.array([2, 0, 2, 1], np.int32))):
      _, pair_experts = make_pairs(rng, p, r, 9)
      w = nan_unselected(make_experts(rng, 9, k, n, jnp.bfloat16), pair_experts)
      rows = make_rows(rng, r, k, jnp.bfloat16)

      def call(a, b, e, rows_arg=pair_rows):
        return fn(a, b, rows_arg, e, variant=self.variant, poison=True,
                  interpret=self.interpret)
      calls = pallas_operand_shapes(jax.make_jaxpr(call)(rows, w, jnp.asarray(pair_experts)).jaxpr)
      assert len(calls) == 1 and calls[0].count((p,)) == (1 if r == 1 else 2), calls
      traced = pallas_operand_shapes(jax.make_jaxpr(
          lambda a, b, e, q: call(a, b, e, q))(rows, w, jnp.asarray(pair_experts),
                                               jnp.asarray(pair_rows)).jaxpr)
      assert traced[0].count((p,)) == 2, traced
      y = jax.jit(call)(rows, w, jnp.asarray(pair_experts))
      check(y, rows, w, pair_rows, pair_experts, jnp.bfloat16)
    # qjax.moe_matmul's pair rows are concrete under jit too: one token's are left out.
    impl = f"{'interpret' if self.interpret else 'pallas'}:{_mod().BACKEND_NAME}"
    for tokens in (1, 2):
      ids = jnp.asarray(rng.choice(9, (tokens, p), replace=False), jnp.int32)
      calls = pallas_operand_shapes(jax.make_jaxpr(
          lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=impl))(
              make_rows(rng, tokens, k, jnp.bfloat16), w, ids).jaxpr)
      assert len(calls) == 1 and calls[0].count((tokens * p,)) == tokens, calls

  def test_plain_tile_order_is_repacked(self, request):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    pair_rows, pair_experts = make_pairs(rng, 4, 2, 4)
    w = make_experts(rng, 4, 288, 40)
    rows = make_rows(rng, 2, 288, jnp.float32)
    y = self.run(rows, w.repack(packing.PLAIN_TILE_K), pair_rows, pair_experts)
    check(y, rows, w, pair_rows, pair_experts, jnp.float32)

  def test_moe_matmul_by_name_matches_float64(self, request):
    """``implementation="pallas:NAME"`` / ``"interpret:NAME"`` runs this kernel; x of
    ``[T, K]`` and of ``[T, top_k, K]``."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 8, 160, 48)
    impl = f"{'interpret' if self.interpret else 'pallas'}:{_mod().BACKEND_NAME}"
    assert qjax.moe_implementation_name(w, impl) == (
        _mod().BACKEND_NAME + ("-interpret" if self.interpret else ""))
    ids = np.array([[1, 6], [6, 3], [1, 1]], np.int32)
    for x in (make_rows(rng, 3, 160, jnp.bfloat16),
              jnp.asarray(rng.standard_normal((3, 2, 160)), jnp.bfloat16)):
      y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=impl))(
          x, w, jnp.asarray(ids))
      assert y.shape == (3, 2, 48) and y.dtype == jnp.bfloat16
      rows = x if x.ndim == 2 else x.reshape(6, 160)
      pair_rows = np.arange(6, dtype=np.int32) // (2 if x.ndim == 2 else 1)
      check(y.reshape(6, 48), rows, w, pair_rows, ids.reshape(-1), jnp.bfloat16)


class TestInterpret(MoEGemvSuite):
  interpret = True


@needs_gpu
class TestPallasGpu(MoEGemvSuite):
  interpret = False


@needs_gpu
class TestPallasGpuPlainVariant(MoEGemvSuite):
  interpret = False
  variant = "plain"


@needs_gpu
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("e", [32, 128])
def test_pallas_gpu_gpt_oss_shape_both_variants(request, t, e):
  """GPT-OSS-like experts (2880 x 2880), top-4, bf16, heuristic configs: both variants
  against float64, and against each other up to FMA rounding."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  codes = rng.integers(0, 2**32, (e, 2944 // 8, 2880), dtype=np.uint32)
  scales = rng.integers(115, 130, (e, 2880 // 32, 2880), dtype=np.uint8)
  w = qjax.MXFP4Weight(codes=jnp.asarray(codes), scales=jnp.asarray(scales),
                       shape=(2880, 2880))
  ids = np.stack([rng.choice(e, 4, replace=False) for _ in range(t)]).astype(np.int32)
  pair_rows = np.arange(4 * t, dtype=np.int32) // 4
  pair_experts = ids.reshape(-1)
  w = nan_unselected(w, pair_experts)
  rows = make_rows(rng, t, 2880, jnp.bfloat16)
  fn = _mod().mxfp4_moe_gemv
  ys = []
  for variant in ("ptx", "plain"):
    y = jax.jit(lambda *a, v=variant: fn(*a, variant=v, poison=True))(
        rows, w, jnp.asarray(pair_rows), jnp.asarray(pair_experts))
    check(y, rows, w, pair_rows, pair_experts, jnp.bfloat16)
    ys.append(np.asarray(jnp.asarray(y, jnp.float32)))
  _, bound = np_reference(rows, w, pair_rows, pair_experts)
  assert (np.abs(ys[0] - ys[1]) <= 1e-2 * bound).all()  # bf16 outputs


# --------------------------------------------------------------------- without a GPU


@pytest.mark.parametrize("variant", ["ptx", "plain"])
@pytest.mark.parametrize("p,k,n,split", [(4, 2880, 2880, None), (3, 96, 130, 2),
                                         (1, 640, 64, 2)])
def test_lowers_to_triton(p, k, n, split, variant):
  """The compiled kernel's Pallas -> Triton lowering runs on any host (no GPU compile):
  ragged and whole K, ragged N, K-tail masks, scalar pair loads."""
  mod = _mod()
  rng = np.random.default_rng(0)
  w = make_experts(rng, 6, k, n)
  rows = jnp.ones((2, k), jnp.bfloat16)
  pairs = jnp.zeros((p,), jnp.int32)
  cfg = None if split is None else qjax.KernelConfig(block_m=1, block_n=64, block_k=128,
                                                     split_k=split)
  lowered = jax.jit(lambda *a: mod.mxfp4_moe_gemv(*a, variant=variant, config=cfg)).trace(
      rows, w, pairs, pairs).lower(lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text()


def test_heuristic_config_fills_the_gpu():
  """At GPT-OSS's 2880 x 2880 (23 K-tiles, 45 column blocks of 64): 1035, 900 and 720
  programs for 1, 4 and 16 pairs; split_k never leaves an empty split."""
  mod = _mod()
  tiles = 2944 // 128
  programs = {}
  for p in (1, 4, 16, 64):
    cfg = mod.heuristic_config(p, 2880, 2880)
    tps, split, steps = mod.loop_shape(cfg, tiles)
    assert (split - 1) * steps * tps < tiles <= split * steps * tps
    programs[p] = p * 45 * split
  assert programs == {1: 1035, 4: 900, 16: 720, 64: 2880}


@pytest.mark.parametrize("tiles", [1, 2, 5, 13, 23, 36, 112])
def test_loop_shape_covers_each_tile_once(tiles):
  mod = _mod()
  for bk in (128, 256, 512):
    for split in (1, 2, 3, 5, 7, 40, 200):
      cfg = qjax.KernelConfig(block_m=1, block_n=64, block_k=bk, split_k=split)
      tps, s, steps = mod.loop_shape(cfg, tiles)
      assert tiles % tps == 0 and 1 <= s <= max(1, split) and steps >= 1
      assert (s - 1) * steps * tps < tiles <= s * steps * tps, (tiles, bk, split)


def test_supports_and_bad_arguments():
  mod = _mod()
  assert mod.supports(1, 2880) and mod.supports(mod.MAX_PAIRS, 2880) and mod.supports(4, 64, 32)
  assert not mod.supports(mod.MAX_PAIRS + 1, 2880) and not mod.supports(0, 2880)
  assert not mod.supports(4, 2880, 16) and not mod.supports(4, 48)
  rng = np.random.default_rng(0)
  w = make_experts(rng, 4, 96, 8)
  rows, pairs = jnp.ones((2, 96), jnp.bfloat16), jnp.zeros((3,), jnp.int32)
  with pytest.raises(ValueError, match=r"rows must be \[R >= 1, K=96\], got shape \(2, 64\)"):
    mod.mxfp4_moe_gemv(jnp.ones((2, 64)), w, pairs, pairs, interpret=True)
  with pytest.raises(ValueError, match="rows.dtype=int32"):
    mod.mxfp4_moe_gemv(jnp.ones((2, 96), jnp.int32), w, pairs, pairs, interpret=True)
  with pytest.raises(ValueError, match=r"shapes \(3,\) and \(2,\)"):
    mod.mxfp4_moe_gemv(rows, w, pairs, pairs[:2], interpret=True)
  with pytest.raises(ValueError, match="variant='cuda'"):
    mod.mxfp4_moe_gemv(rows, w, pairs, pairs, variant="cuda", interpret=True)
  with pytest.raises(NotImplementedError, match="NVFP4Weight"):
    mod.mxfp4_moe_gemv(rows, qjax.quantize_nvfp4(jnp.ones((4, 96, 8))), pairs, pairs,
                       interpret=True)


def test_default_routing_by_pairs(request):
  """None / "pallas" / "interpret" pick the GEMV kernel for 1 to MAX_PAIRS (token, expert)
  pairs that repeat few experts (at most GEMV_MAX_REPEATS pairs per expected distinct
  expert) and the grouped kernel past that (or when the pair count is not known); both
  give the float64 result through moe_matmul. Unknown names and malformed choices are
  named in the error."""
  from pallas_kernels import moe_common  # pylint: disable=g-import-not-at-top
  mod = _mod()
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  w = make_experts(rng, 4, 64, 32)
  many = make_experts(rng, 128, 64, 32)
  gemv, grouped = mod.BACKEND_NAME, "pallas_triton"
  assert moe_common.GEMV_MAX_REPEATS == 2.0  # 4 experts: 1.82 pairs each at 6, 2.22 at 8
  for experts, pairs, name in ((w, 1, gemv), (w, 6, gemv), (w, 8, grouped),
                               (many, mod.MAX_PAIRS, gemv), (many, mod.MAX_PAIRS + 1, grouped),
                               (w, None, grouped)):
    assert qjax.moe_implementation_name(experts, "interpret", pairs) == name + "-interpret"
    assert qjax.moe_implementation_name(experts, None, pairs) == (name if on_gpu() else "xla")
    assert qjax.moe_implementation_name(experts, "xla", pairs) == "xla"
  for t in (3, mod.MAX_PAIRS // 2 + 1):  # 6 pairs: GEMV; MAX_PAIRS + 2 pairs: grouped
    ids = rng.integers(0, 4, (t, 2)).astype(np.int32)
    x = make_rows(rng, t, 64, jnp.float32)
    y = qjax.moe_matmul(x, w, jnp.asarray(ids), implementation="interpret")
    check(y.reshape(2 * t, 32), x, w, np.arange(2 * t, dtype=np.int32) // 2,
          ids.reshape(-1), jnp.float32)
  names = [b.name for b in moe.moe_kernels_for_format(qjax.MXFP4Weight)]
  assert names == ["pallas_triton", mod.BACKEND_NAME]
  with pytest.raises(NotImplementedError, match="'nope'.*registered: "):
    qjax.moe_implementation_name(w, "pallas:nope")
  for bad in ("xla:pallas_triton", "pallas:", "gemv"):
    with pytest.raises(ValueError, match="implementation="):
      qjax.moe_implementation_name(w, bad)


@pytest.mark.parametrize("experts,pairs,want", [
    (8, 2, True), (8, 8, True), (8, 16, False), (8, 32, False),  # Mixtral's 8 (H200)
    (128, 64, True), (128, 128, True), (128, 129, False), (4, 0, False)])
def test_gemv_is_meant_for_few_repeats(experts, pairs, want):
  """The GEMV kernels' rule against the H200's measured faster route (moe_common's
  table): 8 INT4 experts of 4096x14336 lost to the grouped kernel from 16 pairs; 128
  experts kept the GEMV up to MAX_PAIRS."""
  from pallas_kernels import moe_common  # pylint: disable=g-import-not-at-top
  assert moe_common.gemv_meant_for(pairs, experts) == want
  assert _mod().supports(pairs, 2880, num_experts=experts) == want
