"""Int4NKWeight (codes ``[N, K // 8]``) and its Hopper wgmma kernel (Pallas Mosaic GPU).

CPU: the layout conversion is bit-exact both ways and stores the codes in the documented
fragment order (a numpy reference of ``SLOT_TO_K``), symmetric or with integer zero points;
the XLA path against a float64 reference; save / load; the kernel's configurations and
argument checks; the kernel lowers for CUDA (Mosaic GPU's layout inference and lowering run
without a GPU). GPU (Hopper): the compiled kernel against float64 on fresh random inputs,
many shapes including odd M, N and K, every configuration family, zero points and f16
scales.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from pallas_kernels import int4_wgmma as kw
from qjax._src import stacked
from tests.conftest import (assert_same_bits, needs_gpu, pallas_operand_shapes, rel_err,
                            seed_from)
# float64 x @ W of an Int4Weight, decoded in numpy from its codes, scales and zero points
from tests.test_matmul import reference


def make_case(name, m, k, n, group=128, dtype=jnp.bfloat16, scale_dtype=jnp.bfloat16,
              symmetric=True):
  """x ``[m, k]``, an Int4Weight from Gaussian weights (integer zero points unless
  ``symmetric``; their mean is shifted so that the zero points spread), and its
  Int4NKWeight."""
  rng = np.random.default_rng(seed_from(name))
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  wf = rng.standard_normal((k, n)) * 0.05 + (0 if symmetric else rng.uniform(-0.05, 0.05, n))
  w = qjax.quantize(jnp.asarray(wf, jnp.float32), group_size=group, scale_dtype=scale_dtype,
                    symmetric=symmetric)
  return x, w, qjax.to_int4_nk(w)


def fragment_order_reference(q):
  """numpy: the words of ``q [K, N]`` (codes in [-8, 7]) as the format documents them:
  nibble e of word (n, 4t + c) holds q[32t + 8 (e % 4) + 2c + e // 4, n], two's
  complement."""
  k, n = q.shape
  words = np.zeros((n, k // 8), np.uint64)
  for t in range(k // 32):
    for c in range(4):
      for e in range(8):
        kk = 32 * t + 8 * (e % 4) + 2 * c + e // 4
        words[:, 4 * t + c] |= (q[kk, :].astype(np.int64) & 0xF).astype(np.uint64) << (4 * e)
  return words.astype(np.uint32)


@pytest.mark.parametrize("k,n,group", [(128, 8, 128), (384, 37, 128), (992, 24, None),
                                       (256, 130, 256), (512, 64, 32)])
def test_layout_is_bit_exact(request, k, n, group):
  _, w, wn = make_case(request.node.nodeid, 1, k, n, group)
  assert wn.codes.shape == (n, k // 8) and wn.codes.dtype == jnp.uint32
  assert wn.scales is w.scales
  q = np.asarray(w.unpacked_codes(), np.int64) - 8
  np.testing.assert_array_equal(np.asarray(wn.codes), fragment_order_reference(q))
  # Viewed as int4 [N, K] (XLA's nibble order), the words are W^T with K permuted by
  # SLOT_TO_K in each run of 32.
  from qjax._src import int4_nk  # pylint: disable=g-import-not-at-top
  view = np.asarray(jax.lax.bitcast_convert_type(wn.codes, jnp.int4).reshape(n, k)
                    .astype(jnp.int8))
  perm = (np.arange(k) // 32 * 32 + int4_nk.SLOT_TO_K[np.arange(k) % 32])
  np.testing.assert_array_equal(view, q.T[:, perm])
  np.testing.assert_array_equal(np.asarray(wn.signed_codes()), q.T)
  np.testing.assert_array_equal(np.asarray(wn.dequantize()), np.asarray(w.dequantize()))
  back = wn.to_int4(tile_k=w.tile_k)
  np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(w.codes))
  assert back.shape == w.shape and back.group_size == w.group_size and back.symmetric


@pytest.mark.parametrize("k,n,group,scale_dtype", [(256, 40, 64, jnp.float16),
                                                   (384, 37, 128, jnp.bfloat16),
                                                   (992, 24, None, jnp.float32)])
def test_zero_points_layout_is_bit_exact(request, k, n, group, scale_dtype):
  """An Int4Weight with integer zero points (AWQ, GPTQ and compressed-tensors' asymmetric
  form) keeps its codes as q - 8 and its zero points as they are; dequantize() and the
  way back are bit-exact."""
  _, w, wn = make_case(request.node.nodeid, 1, k, n, group, scale_dtype=scale_dtype,
                       symmetric=False)
  zeros = np.asarray(w.zeros)
  assert len(np.unique(zeros)) > 3, "the case should spread its zero points"
  assert not wn.symmetric and wn.zeros is w.zeros and wn.scales is w.scales
  q = np.asarray(w.unpacked_codes(), np.int64) - 8
  np.testing.assert_array_equal(np.asarray(wn.codes), fragment_order_reference(q))
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    assert_same_bits(lambda dtype=dtype: wn.dequantize(dtype),
                     lambda dtype=dtype: w.dequantize(dtype), f"dequantize({dtype})")
  g = w.group_size
  want = ((q + 8 - np.repeat(zeros, g, axis=0).astype(np.int64)).astype(np.float32)
          * np.repeat(np.asarray(w.scales.astype(jnp.float32)), g, axis=0))  # float32 math
  np.testing.assert_array_equal(np.asarray(wn.dequantize()), want)
  back = wn.to_int4(tile_k=w.tile_k)
  np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(w.codes))
  np.testing.assert_array_equal(np.asarray(back.zeros), zeros)


def test_layout_of_a_stack(request):
  ws = [make_case(f"{request.node.nodeid}{i}", 1, 256, 64)[1] for i in range(3)]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  wn = qjax.to_int4_nk(stack)
  assert wn.codes.shape == (3, 64, 32)
  for i, w in enumerate(ws):
    np.testing.assert_array_equal(np.asarray(wn.dequantize()[i]), np.asarray(w.dequantize()))


def test_conversion_is_jittable(request):
  _, w, wn = make_case(request.node.nodeid, 1, 256, 48)
  jitted = jax.jit(qjax.to_int4_nk)(w)
  np.testing.assert_array_equal(np.asarray(jitted.codes), np.asarray(wn.codes))


def test_rejects_what_it_cannot_hold(request):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  wf = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
  sym = qjax.quantize(wf)
  biased = qjax.Int4Weight(codes=sym.codes, scales=sym.scales, zeros=None, biases=sym.scales,
                           shape=sym.shape, group_size=sym.group_size)
  with pytest.raises(ValueError, match="float biases"):
    qjax.to_int4_nk(biased)
  with pytest.raises(TypeError, match="Int4Weight"):
    qjax.to_int4_nk(wf)
  wn = qjax.to_int4_nk(qjax.quantize(wf))
  with pytest.raises(ValueError, match=r"codes must be \(32, 32\)"):
    dataclasses.replace(wn, codes=wn.codes[:, :16])
  with pytest.raises(ValueError, match="group_size"):
    dataclasses.replace(wn, group_size=96)
  with pytest.raises(ValueError, match="group_size=16 must be a multiple of 32"):
    dataclasses.replace(wn, group_size=16)
  with pytest.raises(ValueError, match=r"zeros must be \(2, 32\)"):
    dataclasses.replace(wn, zeros=jnp.zeros((4, 32), jnp.uint8))
  odd_k = qjax.quantize(jnp.asarray(rng.standard_normal((1000, 8)), jnp.float32),
                        group_size=None)
  with pytest.raises(ValueError, match="K=1000 .* multiples of 32"):
    qjax.to_int4_nk(odd_k)


def test_save_and_load(request, tmp_path):
  _, w, wn = make_case(request.node.nodeid, 1, 256, 40, 64)
  _, wa, wna = make_case(request.node.nodeid + "a", 1, 256, 40, 64, symmetric=False)
  qjax.save(tmp_path / "w.qjax", {"w": wn, "asym": wna})
  loaded = qjax.load(tmp_path / "w.qjax")
  back = loaded["w"]
  assert isinstance(back, qjax.Int4NKWeight) and back.group_size == 64
  assert back.zeros is None
  np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(wn.codes))
  np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(w.dequantize()))
  np.testing.assert_array_equal(np.asarray(loaded["asym"].zeros), np.asarray(wa.zeros))
  np.testing.assert_array_equal(np.asarray(loaded["asym"].dequantize()),
                                np.asarray(wa.dequantize()))
  # A file of session 16's plain word order (format "int4_nk") must not load as this one.
  raw = (tmp_path / "w.qjax").read_bytes()
  old = raw.replace(b'\\"int4_nk.v2\\"', b'\\"int4_nk\\"   ')  # same header length
  assert old != raw
  (tmp_path / "old.qjax").write_bytes(old)
  with pytest.raises(ValueError, match="'int4_nk' is retired.*to_int4_nk"):
    qjax.load(tmp_path / "old.qjax")


@pytest.mark.parametrize("m,k,n,group,dtype", [
    (1, 256, 128, 128, jnp.bfloat16), (5, 384, 37, 128, jnp.bfloat16),
    (33, 512, 96, 64, jnp.float16), (7, 256, 64, 256, jnp.float32),
    (1, 512, 40, 32, jnp.float32), (1, 992, 24, None, jnp.float16),
    (3, 992, 24, None, jnp.bfloat16)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_xla_path(request, m, k, n, group, dtype, symmetric):
  x, w, wn = make_case(request.node.nodeid, m, k, n, group, dtype, symmetric=symmetric)
  y = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="xla"))(x, wn)
  assert y.shape == (m, n) and y.dtype == dtype
  assert rel_err(y, reference(x, w)) < (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("group,dtype,symmetric", [
    (32, jnp.bfloat16, True), (128, jnp.float16, True), (None, jnp.bfloat16, True),
    (64, jnp.bfloat16, False), (None, jnp.float16, False)])
def test_xla_dequantization_in_word_pairs_is_bit_exact(request, group, dtype, symmetric):
  from qjax._src import int4_nk  # pylint: disable=g-import-not-at-top
  _, _, wn = make_case(request.node.nodeid, 1, 512, 72, group, symmetric=symmetric)
  pairs = jax.jit(int4_nk._dequantize_nk_pairs, static_argnums=1)(wn, dtype)
  plain = wn.dequantize_nk(dtype)
  np.testing.assert_array_equal(np.asarray(pairs.view(jnp.uint16)),
                                np.asarray(plain.view(jnp.uint16)))


def test_dispatch_on_this_device(request):
  x, _, wn = make_case(request.node.nodeid, 3, 256, 128)
  on_hopper = kw.supported(jax.devices()[0])
  assert qjax.implementation_name(wn) == ("mosaic_gpu_wgmma" if on_hopper else "xla")
  with pytest.raises(NotImplementedError, match="no interpret mode"):
    qjax.matmul(x, wn, implementation="interpret")


@pytest.mark.parametrize("m", [1, 8, 16, 64, 100, 256, 512, 2048])
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672),
                                 (1024, 384)])
def test_config_for_is_legal(m, k, n):
  cfg = kw.config_for(m, k, n, 128)
  # Small M takes one row tile (M rounded up to 8), large M tiles of 128 or 256 rows.
  assert cfg.tile_m == (-(-m // 8) * 8 if m <= 128 else cfg.tile_m) and cfg.tile_m in (
      *range(8, 129, 8), 256)
  assert cfg.stages >= 2
  assert cfg.stages * cfg.stage_bytes(128) + cfg.epilogue_bytes() <= (
      kw._SMEM_MAX if cfg.tile_k > 128 else kw._SMEM_BUDGET)
  assert k % (cfg.split_k * 128) == 0 and (128 % cfg.tile_k == 0 or cfg.tile_k % 128 == 0)
  assert (k // cfg.split_k) % cfg.tile_k == 0
  tiles = -(-m // cfg.tile_m) * (n // 128)
  assert cfg.split_k == 1 or tiles * cfg.split_k <= 132
  # Tiles chain where some CTA runs two or more and the stages divide a tile's K steps.
  steps = k // cfg.split_k // cfg.tile_k
  assert cfg.chain_tiles == (tiles * cfg.split_k > 132 and steps % cfg.stages == 0)
  assert cfg.scale_accumulator == (cfg.tile_m <= 32)
  assert cfg.mma_sync == (cfg.tile_m == 8)
  if tiles * cfg.split_k <= 132 and cfg.tile_k > 128:
    # One tile per CTA: at most 1536 of K in flight (BENCHMARKS.md, session 21).
    assert cfg.stages * cfg.tile_k <= 1536
  if cfg.tile_m <= 64 and cfg.tile_k == 512:  # 512-wide steps only where 3 stages fit
    assert 3 * cfg.stage_bytes(128) + cfg.epilogue_bytes() <= kw._SMEM_MAX


@pytest.mark.parametrize("m,k,n,want", [
    # (tile_k, stages, split_k, chained) as the session 21 sweep chose them (H100).
    (1, 4096, 14336, (512, 3, 1, False)), (16, 14336, 4096, (512, 3, 4, False)),
    (64, 4096, 14336, (256, 4, 1, False)), (64, 8192, 28672, (256, 4, 1, True)),
    (16, 8192, 28672, (512, 4, 1, True))])
def test_config_for_takes_the_swept_small_m_configs(m, k, n, want):
  cfg = kw.config_for(m, k, n, 128)
  assert (cfg.tile_k, cfg.stages, cfg.split_k, cfg.chain_tiles) == want


@pytest.mark.parametrize("field,value", [("tile_n", 96), ("tile_m", 12), ("tile_m", 264),
                                         ("tile_k", 32), ("epi_m", 24), ("split_k", 0),
                                         ("stages", True), ("consumers", 3),
                                         ("snake_width", -1), ("scale_accumulator", 1),
                                         ("chain_tiles", None), ("mma_sync", "yes")])
def test_config_validation_names_the_field(field, value):
  with pytest.raises(ValueError, match=f"WgmmaConfig.{field}"):
    kw.WgmmaConfig(**{field: value})


@pytest.mark.parametrize("fp4", [None, "mxfp4", "nvfp4"])
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 14336), (8192, 28672), (1024, 384),
                                 (2880, 5760)])
def test_candidate_configs_run_and_start_with_the_heuristic(m, k, n, fp4):
  """The tuner's search space: config_for's choice first, no repeats, every config one the
  kernel runs for the weight (its checks and shared memory), the row tile of config_for,
  768-2048 of K in flight, tiles chained exactly where config_for's rule chains them."""
  if fp4 is None and k % 128:
    pytest.skip("INT4 of groups of 128 needs K a multiple of 128")
  w = kw.abstract_weight(k, n, fp4=fp4)
  base = kw.config_for(m, k, n, w.block_size if fp4 else 128, 132, fp4=fp4)
  cands = kw.candidate_configs(m, w, 132)
  assert cands[0] == base and len(set(cands)) == len(cands) > 1
  for cfg in cands[1:]:
    assert kw.config_error(m, w, cfg) is None, cfg
    assert (cfg.tile_m, cfg.scale_accumulator, cfg.mma_sync) == (
        base.tile_m, base.scale_accumulator, base.mma_sync)
    assert cfg.stages * cfg.tile_k in (768, 1024, 1536, 2048)
    tiles = -(-m // cfg.tile_m) * (n // (2 * cfg.tile_n))
    steps = k // cfg.split_k // cfg.tile_k
    assert steps >= 2
    assert cfg.chain_tiles == (tiles * cfg.split_k > 132 and steps % cfg.stages == 0)
    if fp4 and k % 128:
      assert cfg.tile_k in (192, 320)
  if n % 256 == 0 and m <= 16:  # wider column tiles (at M = 64 they overflow shared memory)
    assert {c.tile_n for c in cands} == {64, 128}


def test_config_error_names_what_does_not_fit():
  w = kw.abstract_weight(4096, 4096)
  assert kw.config_error(16, w, kw.config_for(16, 4096, 4096, 128)) is None
  big = kw.WgmmaConfig(tile_m=256, tile_k=512, stages=8)
  assert "more than" in kw.config_error(256, w, big) and "shared memory" in kw.config_error(
      256, w, big)
  assert "not a multiple of tile_k=512" in kw.config_error(
      1, w, kw.WgmmaConfig(tile_m=8, epi_m=8, tile_k=512, split_k=16, stages=2))
  fp4 = kw.abstract_weight(2880, 5760, fp4="mxfp4")
  assert "scale_accumulator" in kw.config_error(1, fp4, kw.WgmmaConfig(
      tile_m=8, epi_m=8, tile_k=320, stages=2, scale_accumulator=True))


class _FakeHopper:
  device_kind = "Test H200"
  core_count = 132


@pytest.fixture
def tuning_table(tmp_path, monkeypatch):
  """A tuning table directory of its own, and a device that looks like a 132-SM Hopper to
  the wgmma kernel's table lookup."""
  from qjax._src import tuning  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tuning, "DATA_DIR", tmp_path)
  monkeypatch.setattr(kw, "_table_device", _FakeHopper)
  tuning._table.cache_clear()
  yield tuning
  tuning._table.cache_clear()


def test_default_config_takes_the_table_entry_that_runs(request, tuning_table,
                                                       monkeypatch):
  """default_config (what the kernel runs with no config) takes the tuning table's entry
  for the device kind, format, M bucket, K and N where the grid has the device's SM count
  and the entry runs the weight; config_for elsewhere."""
  k, n = 2048, 512
  _, _, wn = make_case(request.node.nodeid, 3, k, n)
  tuned = kw.WgmmaConfig(tile_n=128, tile_m=8, tile_k=256, stages=4, epi_m=8, split_k=2,
                         scale_accumulator=True, mma_sync=True)
  assert tuned != kw.config_for(3, k, n, 128) and kw.config_error(3, wn, tuned) is None
  # A stale entry at M bucket 16: K split more ways than K has groups of 128.
  stale = dataclasses.replace(tuned, tile_m=16, epi_m=16, mma_sync=False, split_k=32)
  entry = lambda fmt, m, cfg: {"format": fmt, "m_bucket": m, "k": k, "n": n,
                               "config": cfg.to_json(), "us": 1.0}
  tuning_table.write_table(_FakeHopper.device_kind, [
      entry("int4nk", 4, tuned), entry("int4nk", 16, stale), entry("mxfp4nk", 8, tuned)])
  assert kw.default_config(3, wn) == tuned
  assert kw.default_config(4, wn, 132) == tuned
  assert kw.default_config(3, wn, table=False) == kw.config_for(3, k, n, 128)
  assert kw.default_config(3, wn, 66) == kw.config_for(3, k, n, 128, 66)  # another grid
  assert kw.default_config(5, wn) == kw.config_for(5, k, n, 128)  # bucket 8: mxfp4nk only
  assert kw.default_config(16, wn) == kw.config_for(16, k, n, 128)  # the stale entry
  # The kernel launches with it.
  launched = []

  class Launched(Exception):
    pass

  def run_kernel(x, w, cfg, num_sms, tile_table=None):
    launched.append(cfg)
    raise Launched

  monkeypatch.setattr(kw, "_run_kernel", run_kernel)
  x = jnp.ones((3, k), jnp.bfloat16)
  with pytest.raises(Launched):
    kw.int4_nk_matmul(x, wn)
  assert launched == [tuned]


def test_tuner_writes_wgmma_entries_the_kernel_reads(request, tuning_table, monkeypatch):
  """qjax bench --tune --format int4nk sweeps candidate_configs and writes the fastest
  correct one as a WgmmaConfig entry, which default_config then returns (the timings and
  the check are mocked: the kernel needs a Hopper GPU)."""
  import importlib  # pylint: disable=g-import-not-at-top
  importlib.import_module("pallas_kernels")
  from qjax._src import bench, devtime  # pylint: disable=g-import-not-at-top
  k, n, m = 1024, 512, 16
  cands = kw.candidate_configs(m, kw.abstract_weight(k, n), 132)
  times = {c: 10.0 - 0.1 * i for i, c in enumerate(cands)}  # the last one is fastest
  order = iter(cands)
  monkeypatch.setattr(bench.devtime, "device_time", lambda *a, **kw_: devtime.Timing(
      us=times[next(order)], source="trace"))
  monkeypatch.setattr(bench.jax, "devices", lambda *a: [_FakeHopper()])
  monkeypatch.setattr(kw, "_grid_sms", lambda interpret, num_sms: 132)
  checked = []

  def fastest_correct(timed, backend, x, w, log):
    checked.append([c for _, c in timed])
    return timed[1]  # as if the fastest computed something else

  monkeypatch.setattr(bench, "_fastest_correct", fastest_correct)
  entries = bench.tune([(k, n)], [m], "int4nk", calls=2, log=lambda s: None)
  assert checked == [cands[::-1]]  # fastest first
  assert entries == [{"format": "int4nk", "m_bucket": 16, "k": k, "n": n,
                      "config": cands[-2].to_json(), "us": round(times[cands[-2]], 2)}]
  _, _, wn = make_case(request.node.nodeid, m, k, n)
  assert kw.default_config(m, wn) == cands[-2]


def test_kernel_declines_what_it_lacks(request):
  x, w, wn = make_case(request.node.nodeid, 4, 256, 128)
  cases = [
      (x.astype(jnp.float16), wn, "bf16 activations"),
      (x, qjax.to_int4_nk(make_case(request.node.nodeid, 4, 256, 128,
                                    scale_dtype=jnp.float32)[1]), "bf16 or f16 scales"),
      (x, qjax.to_int4_nk(make_case(request.node.nodeid, 4, 256, 64)[1]), "N=64"),
      (x, qjax.to_int4_nk(make_case(request.node.nodeid, 4, 256, 128, group=32)[1]),
       "group_size=32"),
      (x, w, "takes an Int4NKWeight"),
  ]
  for xi, wi, match in cases:
    with pytest.raises(NotImplementedError, match=match):
      kw.int4_nk_matmul(xi, wi, num_sms=132)
  with pytest.raises(NotImplementedError, match="mma_sync with INT4 needs scale_accumulator"):
    kw.int4_nk_matmul(x, wn, num_sms=132, config=kw.WgmmaConfig(
        tile_m=8, tile_k=128, epi_m=8, mma_sync=True))
  with pytest.raises(NotImplementedError, match="stages=3 to divide the 2 K steps"):
    kw.int4_nk_matmul(x, wn, num_sms=132, config=kw.WgmmaConfig(
        tile_m=8, tile_k=128, epi_m=8, stages=3, chain_tiles=True))


def test_kernel_with_no_rows(request):
  x, _, wn = make_case(request.node.nodeid, 2, 256, 128)
  y = kw.int4_nk_matmul(x[:0], wn, num_sms=132)
  assert y.shape == (0, 128) and y.dtype == jnp.bfloat16


# mma.sync in place of wgmma: 1-3 column tiles of 8 (x's rows), K steps of 64-512 (one or
# several groups per step), split K, two row tiles of 64 per warpgroup (tile_n 128).
MMA_SYNC_CASES = [
    (3, 2048, 768, kw.WgmmaConfig(tile_m=8, tile_k=512, epi_m=8, split_k=2, stages=2,
                                  scale_accumulator=True, mma_sync=True)),
    (13, 1024, 384, kw.WgmmaConfig(tile_m=16, tile_k=256, epi_m=16, stages=3,
                                   scale_accumulator=True, mma_sync=True)),
    (20, 1536, 256, kw.WgmmaConfig(tile_m=24, tile_k=128, epi_m=24, stages=4,
                                   scale_accumulator=True, mma_sync=True)),
    (1, 1024, 640, kw.WgmmaConfig(tile_m=8, tile_k=64, epi_m=8, stages=5,
                                  scale_accumulator=True, mma_sync=True)),
    (6, 1024, 512, kw.WgmmaConfig(tile_n=128, tile_m=8, tile_k=256, epi_m=8, stages=3,
                                  scale_accumulator=True, mma_sync=True)),
]

LOWERED = [
    (2048, 4096, 4096, None), (1, 4096, 4096, None), (16, 4096, 14336, None),
    (64, 4096, 4096, None), (100, 1024, 384, None),
    (512, 1024, 512, kw.WgmmaConfig(m_minor=True)),
    (64, 1024, 256, kw.WgmmaConfig(tile_m=64, tile_k=128, split_k=2, stages=6)),
    (128, 512, 256, kw.WgmmaConfig(tile_n=128, tile_m=128, stages=3)),
    (512, 1024, 768, kw.WgmmaConfig(snake_width=2)),
    (300, 1024, 512, kw.WgmmaConfig(tile_m=128, tile_k=128, stages=4, chain_tiles=True)),
    (16, 1024, 512, kw.WgmmaConfig(tile_m=16, tile_k=256, epi_m=16, stages=4)),
    (16, 1024, 512, kw.WgmmaConfig(tile_m=16, tile_k=512, epi_m=16, stages=2,
                                   scale_accumulator=True)),
    *MMA_SYNC_CASES,
]


def test_padded_rows():
  cfg = kw.WgmmaConfig(tile_m=64)
  assert [kw.padded_rows(m, cfg) for m in (1, 7, 8, 9, 64, 65)] == [1, 7, 64, 64, 64, 128]
  assert kw.padded_rows(20, kw.WgmmaConfig(tile_m=24, epi_m=24)) == 24


@pytest.mark.parametrize("m,k,n,cfg", LOWERED)
def test_kernel_lowers_for_cuda(m, k, n, cfg):
  """Mosaic GPU's layout inference and lowering to its dialect run here without a GPU
  (PTX and the launch need one: the GPU tests below)."""
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  wn = qjax.Int4NKWeight(codes=jax.ShapeDtypeStruct((n, k // 8), jnp.uint32),
                         scales=jax.ShapeDtypeStruct((k // 128, n), jnp.bfloat16),
                         shape=(k, n), group_size=128)
  lowered = jax.jit(lambda a, b: kw.int4_nk_matmul(a, b, config=cfg, num_sms=132)).trace(
      x, wn).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
  # K splits are added in split order (common.sum_splits), never by a reduce.
  assert "stablehlo.reduce" not in lowered.as_text()


# Weights the kernel takes besides symmetric ones with bf16 scales: (symmetric, scale dtype).
ZERO_POINT_AND_F16_VARIANTS = [(False, jnp.bfloat16), (True, jnp.float16), (False, jnp.float16)]


@pytest.mark.parametrize("symmetric,scale_dtype", ZERO_POINT_AND_F16_VARIANTS)
@pytest.mark.parametrize("m,k,n,cfg", [LOWERED[1], LOWERED[2], LOWERED[3], LOWERED[0],
                                       LOWERED[6], LOWERED[-1]])
def test_kernel_lowers_zero_points_and_f16_scales(m, k, n, cfg, symmetric, scale_dtype):
  """With zero points the pipeline copies a uint8 row per group and column more (the
  stage's bytes count it); f16 scales take the float32 multiply."""
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  wn = kw.abstract_weight(k, n, zero_points=not symmetric, scale_dtype=scale_dtype)
  c = cfg or kw.default_config(m, wn, 132, table=False)
  assert kw.config_error(m, wn, c) is None
  lowered = jax.jit(lambda a, b: kw.int4_nk_matmul(a, b, config=c, num_sms=132)).trace(
      x, wn).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_zero_points_take_shared_memory():
  """A byte per group and column more per stage: config_for and config_error count it."""
  sym = kw.abstract_weight(4096, 4096, group_size=64)
  asym = kw.abstract_weight(4096, 4096, group_size=64, zero_points=True)
  cfg = kw.WgmmaConfig(tile_n=128, tile_m=16, tile_k=256, epi_m=16, stages=5)
  assert cfg.stage_bytes(64, 3) - cfg.stage_bytes(64, 2) == 2 * 128 * 256 // 64
  scale_args = kw._scale_args  # pylint: disable=protected-access
  assert scale_args(sym) == (64, 2) and scale_args(asym) == (64, 3)
  assert kw.config_error(16, sym, cfg) is None  # 231424 bytes: the limit
  assert "236544 bytes of shared memory" in kw.config_error(16, asym, cfg)
  for m in (1, 16, 64, 256, 2048):
    assert kw.config_error(m, asym, kw.default_config(m, asym, 132, table=False)) is None


def test_float32_scales_are_declined():
  wn = kw.abstract_weight(1024, 256, scale_dtype=jnp.float32)
  assert "float32" in kw.declines(wn, jnp.bfloat16)
  assert kw.declines(kw.abstract_weight(1024, 256, scale_dtype=jnp.float16,
                                        zero_points=True), jnp.bfloat16) is None


needs_hopper = pytest.mark.skipif(
    not kw.supported(jax.devices()[0]),
    reason="the wgmma kernel needs an NVIDIA Hopper GPU (sm_90)")


def _poisoned_run(fn, x, wn, cfg):
  """Runs the kernel right after freeing a NaN buffer of its output's size, so the
  allocator hands that memory to the output: a tile the kernel does not write stays NaN
  (XLA may place the output elsewhere; the float64 comparison still fails then, since
  the inputs are fresh)."""
  m, n = x.shape[0], wn.shape[1]
  c = cfg or kw.default_config(m, wn, jax.devices()[0].core_count)
  rows = kw.padded_rows(m, c)  # the rows of the kernel's output
  poison = jnp.full((c.split_k, rows, n), jnp.nan,
                    jnp.float32 if c.split_k > 1 else jnp.bfloat16)
  poison.block_until_ready()
  poison.delete()
  return np.asarray(fn(x, wn).astype(jnp.float32))


GPU_CASES = [
    (1, 256, 128, None), (7, 512, 384, None), (16, 1024, 256, None), (64, 4096, 4096, None),
    (100, 1024, 384, None), (256, 2048, 512, None), (300, 512, 640, None),
    (2048, 1024, 1024, None), (520, 4096, 1280, None),
    (512, 1024, 512, kw.WgmmaConfig(m_minor=True)),
    (200, 1024, 256, kw.WgmmaConfig(tile_m=64, tile_k=128, split_k=4, stages=6)),
    (256, 512, 256, kw.WgmmaConfig(tile_n=128, tile_m=128, stages=3)),
    (96, 768, 384, kw.WgmmaConfig(tile_m=96, tile_k=64, epi_m=32, stages=5)),
    (3, 2048, 768, kw.WgmmaConfig(tile_m=8, tile_k=128, epi_m=8, split_k=2)),
    (5, 1024, 256, kw.WgmmaConfig(tile_m=64, tile_k=128)),
    (768, 1024, 768, kw.WgmmaConfig(snake_width=2)),
    (512, 512, 1024, kw.WgmmaConfig(m_minor=True, snake_width=4)),
    (16, 1024, 512, kw.WgmmaConfig(tile_m=16, tile_k=256, epi_m=16, stages=4)),
    (1, 2048, 256, kw.WgmmaConfig(tile_m=8, tile_k=256, epi_m=8, split_k=2)),
    (64, 1536, 384, kw.WgmmaConfig(tile_m=64, tile_k=256, stages=3)),
    (16, 2048, 512, kw.WgmmaConfig(tile_m=16, tile_k=512, epi_m=16, stages=4,
                                   scale_accumulator=True)),
    (3, 1024, 384, kw.WgmmaConfig(tile_m=8, tile_k=128, epi_m=8, split_k=2,
                                  scale_accumulator=True)),
    *MMA_SYNC_CASES,
]


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("m,k,n,cfg", GPU_CASES)
def test_wgmma_matches_float64(request, m, k, n, cfg):
  x, w, wn = make_case(request.node.nodeid, m, k, n)
  fn = jax.jit(lambda a, b: kw.int4_nk_matmul(a, b, config=cfg))
  y = _poisoned_run(fn, x, wn, cfg)
  assert y.shape == (m, n)
  assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
  ref = reference(x, w)
  assert rel_err(y, ref) < 1e-2
  # Every element is right, not just the norm: bf16 rounding of the weight and of y
  # leaves each output within a few 2^-9 of the outputs' rms.
  rms = np.sqrt(np.mean(ref ** 2))
  assert np.abs(y - ref).max() < 2e-2 * rms


# One case of each family of GPU_CASES (mma.sync, K splits, scales on the accumulator,
# wide and narrow K steps, 64 to 256 rows) for the zero-point and f16-scale variants.
ZERO_POINT_GPU_CASES = [GPU_CASES[i] for i in (0, 1, 3, 5, 7, 12, 13, 17, 19, 20)] + [
    MMA_SYNC_CASES[0], MMA_SYNC_CASES[3]]


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("symmetric,scale_dtype", ZERO_POINT_AND_F16_VARIANTS)
@pytest.mark.parametrize("m,k,n,cfg", ZERO_POINT_GPU_CASES)
def test_wgmma_zero_points_and_f16_scales_match_float64(request, m, k, n, cfg, symmetric,
                                                        scale_dtype):
  """Integer zero points (AWQ, GPTQ asymmetric) and f16 scales (GPTQ's, AWQ's) on the
  compiled kernel against float64, outputs poisoned first."""
  x, w, wn = make_case(request.node.nodeid, m, k, n, scale_dtype=scale_dtype,
                       symmetric=symmetric)
  y = _poisoned_run(jax.jit(lambda a, b: kw.int4_nk_matmul(a, b, config=cfg)), x, wn, cfg)
  assert y.shape == (m, n) and np.isfinite(y).all(), "unwritten or non-finite outputs"
  ref = reference(x, w)
  assert rel_err(y, ref) < 1e-2
  # Each output within its own rounding bound: the weight rounded to bf16 at most once
  # (2^-8 relative; none with scales on the float32 side), float32 sums, y rounded to bf16.
  xa = np.abs(np.asarray(x.astype(jnp.float32), np.float64))
  bound = 2.0 ** -8 * (xa @ np.abs(np.asarray(w.dequantize(), np.float64)) + np.abs(ref))
  excess = np.abs(y - ref) - (1.01 * bound + 1e-6)
  assert excess.max() <= 0, f"{(excess > 0).sum()} outputs past their bound"


@needs_gpu
@needs_hopper
def test_wgmma_runs_an_awq_like_weight_from_kernel_layouts(request):
  """An asymmetric Int4Weight with f16 scales (AWQ's form) converts on Hopper and the
  default route runs the wgmma kernel; its chained config at one row, with zero points."""
  for m in (1, 16, 300):
    x, w, _ = make_case(f"{request.node.nodeid}-{m}", m, 2048, 1536, scale_dtype=jnp.float16,
                        symmetric=False)
    wn = qjax.kernel_layouts({"w": w})["w"]
    assert isinstance(wn, qjax.Int4NKWeight) and wn.zeros is not None
    assert qjax.implementation_name(wn) == "mosaic_gpu_wgmma"
    y = np.asarray(jax.jit(qjax.matmul)(x, wn).astype(jnp.float32))
    ref = reference(x, w)
    assert np.abs(y - ref).max() < 2e-2 * np.sqrt(np.mean(ref ** 2)), m
  cfg = kw.WgmmaConfig(tile_m=8, tile_k=512, epi_m=8, stages=2, chain_tiles=True,
                       scale_accumulator=True, mma_sync=True)
  fn = jax.jit(lambda a, b: kw.int4_nk_matmul(a, b, config=cfg, num_sms=5))
  x, w, wn = make_case(request.node.nodeid, 5, 2048, 1536, symmetric=False)
  y = _poisoned_run(fn, x, wn, cfg)
  ref = reference(x, w)
  assert np.abs(y - ref).max() < 2e-2 * np.sqrt(np.mean(ref ** 2))


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("num_sms", [1, 5, 12])
@pytest.mark.parametrize("m,k,n,cfg", [
    (300, 1024, 512, kw.WgmmaConfig(tile_m=128, tile_k=128, stages=4, chain_tiles=True)),
    # config_for's small-M form: 512-wide steps, scales on the accumulator.
    (16, 2048, 1536, kw.WgmmaConfig(tile_m=16, tile_k=512, epi_m=16, stages=2,
                                    chain_tiles=True, scale_accumulator=True)),
    (5, 2048, 1536, kw.WgmmaConfig(tile_m=8, tile_k=512, epi_m=8, stages=2, chain_tiles=True,
                                   scale_accumulator=True, mma_sync=True)),
])
def test_wgmma_chained_tiles(request, num_sms, m, k, n, cfg):
  """12 tiles over 1, 5 or 12 CTAs: 12 tiles in one chained pipeline, 2 or 3 per CTA, or
  one per CTA (each starts a chain it never stops)."""
  x, w, wn = make_case(request.node.nodeid, m, k, n)
  fn = jax.jit(lambda a, b: kw.int4_nk_matmul(a, b, config=cfg, num_sms=num_sms))
  y = _poisoned_run(fn, x, wn, cfg)
  assert y.shape == (m, n) and np.isfinite(y).all()
  ref = reference(x, w)
  assert np.abs(y - ref).max() < 2e-2 * np.sqrt(np.mean(ref ** 2))


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("group", [64, 256])
def test_wgmma_group_sizes(request, group):
  x, w, wn = make_case(request.node.nodeid, 130, 1024, 256, group)
  y = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="pallas"))(x, wn)
  assert rel_err(y, reference(x, w)) < 1e-2


def _family_samples(cands):
  """The first and last candidate of each (tile_n, split_k, chain_tiles) family."""
  families = {}
  for c in cands:
    families.setdefault((c.tile_n, c.split_k, c.chain_tiles), []).append(c)
  return [c for f in families.values() for c in {f[0]: 0, f[-1]: 0}]


def _float64_case(fmt, m, k, n, seed):
  """x ``[m, k]`` bf16, a random ``fmt`` NK weight (bench.random_weight) and the float64
  x @ W of its exact dequantization."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  key = jax.random.key(seed)
  w = bench.random_weight(fmt, k, n, key)
  x = jax.random.normal(jax.random.fold_in(key, 99), (m, k), jnp.float32).astype(jnp.bfloat16)
  ref = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(
      w.dequantize(jnp.float32), np.float64)
  return x, w, ref


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("fmt", ["int4nk", "mxfp4nk", "nvfp4nk"])
@pytest.mark.parametrize("m,k,n", [(1, 4096, 512), (16, 2048, 768), (1, 1024, 17408)])
def test_tuner_candidates_match_float64(request, fmt, m, k, n):
  """Any candidate may win a sweep and enter the table: a sample of each family of the
  search space (column tile, K split, chained or not; the first and last K step / stage
  count) compiles and matches float64, outputs poisoned first."""
  x, w, ref = _float64_case(fmt, m, k, n, seed_from(request.node.nodeid))
  fn = kw.int4_nk_matmul if fmt == "int4nk" else kw.fp4_nk_matmul
  rms = np.sqrt(np.mean(ref ** 2))
  for cfg in _family_samples(kw.candidate_configs(m, w, jax.devices()[0].core_count)):
    y = _poisoned_run(jax.jit(lambda a, b, cfg=cfg: fn(a, b, config=cfg)), x, w, cfg)
    assert y.shape == (m, n) and np.isfinite(y).all(), cfg
    assert rel_err(y, ref) < 1e-2 and np.abs(y - ref).max() < 2e-2 * rms, cfg


@needs_gpu
@needs_hopper
def test_shipped_table_entries_match_the_xla_path():
  """Every wgmma entry of this device's shipped tuning table (what the kernel runs with no
  config at those shapes) against the XLA path at full float32 precision."""
  from qjax._src import bench, tuning  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  table = tuning.read_table(tuning.DATA_DIR / tuning.device_file_name(device.device_kind))
  entries = [(key, cfg) for key, cfg in table.items() if key[0] in kw.TABLE_FORMATS.values()]
  if not entries:
    pytest.skip(f"no wgmma entries shipped for {device.device_kind}")
  for (fmt, m, k, n), cfg in entries:
    w = bench.random_weight(fmt, k, n, jax.random.key(m))
    x = jax.random.normal(jax.random.key(k + n), (m, k), jnp.float32).astype(jnp.bfloat16)
    assert kw.default_config(m, w, device.core_count) == cfg
    fn = kw.int4_nk_matmul if fmt == "int4nk" else kw.fp4_nk_matmul
    y = _poisoned_run(jax.jit(fn), x, w, cfg)
    with jax.default_matmul_precision("highest"):
      ref = np.asarray(qjax.matmul(x.astype(jnp.float32), w, implementation="xla"),
                       np.float64)
    assert np.isfinite(y).all() and rel_err(y, ref) < 1e-2, (fmt, m, k, n, cfg)


@needs_gpu
@needs_hopper
def test_tune_writes_an_entry_the_default_route_runs(request, tmp_path, monkeypatch):
  """bench.tune on the GPU (wall-clock timings: CUPTI does not attach in pytest-xdist
  workers) sweeps one small int4nk shape and writes its winner; qjax.matmul then runs
  it and matches float64."""
  from qjax._src import bench, devtime, tuning  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  def wall_time(fn, arg_sets, *, calls=5, warmup=1):
    for a in arg_sets[:warmup]:
      jax.block_until_ready(fn(*a))
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)])
    return devtime.Timing(us=(time.perf_counter() - t0) / calls * 1e6, source="wall")

  monkeypatch.setattr(bench.devtime, "device_time", wall_time)
  monkeypatch.setattr(tuning, "DATA_DIR", tmp_path)
  tuning._table.cache_clear()
  try:
    m, k, n = 5, 2048, 512
    entries = bench.tune([(k, n)], [m], "int4nk", calls=4, log=lambda s: None)
    assert [(e["format"], e["m_bucket"], e["k"], e["n"]) for e in entries] == [
        ("int4nk", 8, k, n)]
    cfg = tuning.WgmmaConfig.from_json(entries[0]["config"])
    x, w, wn = make_case(request.node.nodeid, m, k, n)
    assert kw.default_config(m, wn, jax.devices()[0].core_count) == cfg
    y = _poisoned_run(jax.jit(qjax.matmul), x, wn, cfg)
    assert rel_err(y, reference(x, w)) < 1e-2
  finally:
    tuning._table.cache_clear()


@needs_gpu
@needs_hopper
def test_wgmma_default_route(request):
  x, w, wn = make_case(request.node.nodeid, 48, 512, 256)
  assert qjax.implementation_name(wn) == "mosaic_gpu_wgmma"
  y = jax.jit(qjax.matmul)(x.reshape(4, 12, 512), wn)
  assert y.shape == (4, 12, 256)
  assert rel_err(y.reshape(48, 256), reference(x, w)) < 1e-2
  # Arguments it does not take fall back to XLA under the default route.
  y32 = qjax.matmul(x.astype(jnp.float32), wn)
  assert rel_err(y32, reference(x, w)) < 1e-5


def test_flax_int4_dense_takes_the_layout(request):
  """Int4Dense holds any quantized pytree: params converted to the [N, K / 8] layout give
  the same outputs (XLA here; the wgmma kernel on Hopper)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax_layers import Int4Dense, quantize_dense_params  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  params = quantize_dense_params(nn.Dense(128).init(jax.random.key(0), x)["params"],
                                 group_size=128)
  nk = jax.tree.map(lambda a: qjax.to_int4_nk(a) if isinstance(a, qjax.Int4Weight) else a,
                    params, is_leaf=lambda a: isinstance(a, qjax.Int4Weight))
  assert isinstance(nk["kernel"], qjax.Int4NKWeight)
  y = Int4Dense(128).apply({"params": params}, x)
  y_nk = Int4Dense(128).apply({"params": nk}, x)
  ref = reference(x, params["kernel"]) + np.asarray(params["bias"], np.float64)
  assert rel_err(y_nk, ref) < 1e-2
  if not kw.supported(jax.devices()[0]):  # both through XLA's dequantize-and-dot
    np.testing.assert_array_equal(np.asarray(y_nk), np.asarray(y))


def test_bench_floor_counts_the_same_bytes_as_int4():
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  key = jax.random.key(0)
  a, b = bench.random_weight("int4", 4096, 512, key), bench.random_weight("int4nk", 4096, 512, key)
  assert isinstance(b, qjax.Int4NKWeight) and b.codes.shape == (512, 512)
  np.testing.assert_array_equal(np.asarray(b.dequantize()), np.asarray(a.dequantize()))
  assert bench.floor_weight_bytes(a) == bench.floor_weight_bytes(b)


def _profile_example():
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).parent.parent / "examples" / "wgmma_profile.py"
  spec = importlib.util.spec_from_file_location("wgmma_profile", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_profile_summary_of_a_trace():
  """examples/wgmma_profile.py's summary of Mosaic GPU profiler events (B / E per
  warpgroup, cycles / 1000 in "ts")."""
  mod = _profile_example()
  events = []
  for tid in (1, 2):
    t = 0.0
    for name, dur in (("convert", 0.3), ("wgmma", 0.1), ("convert", 0.5)):
      events += [{"name": name, "ph": "B", "ts": t, "tid": tid},
                 {"name": name, "ph": "E", "ts": t + dur, "tid": tid}]
      t += dur + 0.1  # 0.1 between scopes: barrier waits
  scopes, span = mod.summarise(events)
  assert span == pytest.approx(1100.0)
  assert scopes["convert"][0] == 4 and scopes["convert"][1] == pytest.approx(400.0)
  assert scopes["convert"][2] == pytest.approx(0.8 / 1.1)
  assert scopes["wgmma"] == (2, pytest.approx(100.0), pytest.approx(0.1 / 1.1))


def test_profile_makes_room_for_its_buffer():
  """The example's smaller configurations when the profiler's buffer does not fit: one
  stage fewer, then half the K step, chained only where the stages divide the steps."""
  mod = _profile_example()
  k = 8192
  cfg = kw.WgmmaConfig(tile_m=64, tile_k=512, stages=2, chain_tiles=True)
  smaller = mod.room_for_profiler(cfg, k)
  assert (smaller.tile_k, smaller.stages, smaller.chain_tiles) == (256, 2, True)
  assert smaller.stages * smaller.stage_bytes() < cfg.stages * cfg.stage_bytes()
  three = dataclasses.replace(cfg, tile_k=256, stages=4)
  assert mod.room_for_profiler(three, k).stages == 3
  assert not mod.room_for_profiler(three, k).chain_tiles  # 32 steps, 3 stages
  assert mod.room_for_profiler(kw.WgmmaConfig(tile_k=128, stages=2), k) is None


def _scanned_wgmma(stack, x, layers):
  """The kernel on each layer of ``stack`` under lax.scan, as ``qjax.matmul`` runs it for
  ``qjax.layer_of`` (called directly so that it also traces on a CPU)."""
  def body(carry, i):
    with stacked.reads_in_place(qjax.layer_of(stack, i)) as layer:
      return carry, kw.int4_nk_matmul(x, layer, num_sms=132)
  return jax.lax.scan(body, 0, jnp.arange(layers))[1]


def _scanned_matmul(stack, x, layers):
  def body(carry, i):
    return carry, qjax.matmul(x, qjax.layer_of(stack, i), implementation="pallas")
  return jax.lax.scan(body, 0, jnp.arange(layers))[1]


@pytest.mark.parametrize("symmetric", [True, False])
def test_kernel_reads_a_layer_of_a_stack_in_place(request, symmetric):
  """Under ``qjax.layer_of`` the Mosaic kernel is handed the stacked codes and scales
  (and zero points; no per-layer copy) and lowers for CUDA;
  test_wgmma_layer_of_equals_each_layer runs it on a GPU."""
  layers, k, n = 3, 1024, 256
  cases = [make_case(f"{request.node.nodeid}-{i}", 16, k, n, symmetric=symmetric)
           for i in range(layers)]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *[c[2] for c in cases])
  x = cases[0][0]
  calls = pallas_operand_shapes(jax.make_jaxpr(_scanned_wgmma, static_argnums=2)(
      stack, x, layers).jaxpr)
  assert calls, "no pallas_call traced"
  for shapes in calls:
    assert (layers, n, k) in shapes and (layers, k // 128, n) in shapes, shapes
    assert shapes.count((layers, k // 128, n)) == (1 if symmetric else 2), shapes
  lowered = jax.jit(_scanned_wgmma, static_argnums=2).trace(stack, x, layers).lower(
      lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("symmetric", [True, False])
def test_wgmma_layer_of_equals_each_layer(request, symmetric):
  layers, k, n = 3, 2048, 384
  cases = [make_case(f"{request.node.nodeid}-{i}", 16, k, n, symmetric=symmetric)
           for i in range(layers)]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *[c[2] for c in cases])
  x = cases[0][0]
  fn = jax.jit(_scanned_matmul, static_argnums=2)
  calls = pallas_operand_shapes(jax.make_jaxpr(fn, static_argnums=2)(stack, x, layers).jaxpr)
  assert calls and all((layers, n, k) in shapes for shapes in calls), calls
  got = np.asarray(fn(stack, x, layers).astype(jnp.float32))
  one = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="pallas"))
  for i, (_, w, wn) in enumerate(cases):
    assert_same_bits(lambda i=i: fn(stack, x, layers)[i].astype(jnp.float32),
                     lambda wn=wn: one(x, wn).astype(jnp.float32),
                     f"layer {i}: scanned stack against the layer's own call")
    ref = reference(x, w)
    assert np.abs(got[i] - ref).max() < 2e-2 * np.sqrt(np.mean(ref ** 2))
  # Indices outside the stack read the layer XLA's slice would (last, from the end).
  one = jax.jit(lambda s, a, i: qjax.matmul(a, qjax.layer_of(s, i), implementation="pallas"))
  for index in (-1, layers + 1):
    np.testing.assert_array_equal(
        np.asarray(one(stack, x, jnp.int32(index)).astype(jnp.float32)), got[layers - 1])


@pytest.mark.skipif(kw.supported(jax.devices()[0]), reason="checks the CPU refusal")
def test_breakdown_example_refuses_a_machine_without_hopper(capsys):
  """examples/wgmma_breakdown.py times GPU kernels only: elsewhere it says so (exit 2)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).parent.parent / "examples" / "wgmma_breakdown.py"
  spec = importlib.util.spec_from_file_location("wgmma_breakdown", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert list(mod.VARIANTS) == ["full", "empty body", "1 group/step"]
  with pytest.raises(SystemExit) as e:
    mod.main(["--shapes", "256x128"])
  assert e.value.code == 2 and "needs a Hopper GPU" in capsys.readouterr().err


# sha256 of the mma.sync and ldmatrix PTX texts as compiled and matched on the H100
# (session 23: tests/test_int4_nk.py and tests/test_fp4_nk.py, 357 passed).
_VALIDATED_MMA_SYNC_PTX_SHA256 = "702b1d8e7a5a8b75c696f7ee24dc303dca339ce47ca45163cd48f368f5106197"


def test_mma_sync_ptx_is_the_one_validated_on_the_gpu():
  """ptxas runs on the GPU machine only: a changed text must run the GPU tests first (then
  update the hash)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  text = kw._MMA_M16N8K16 + "\n" + kw._LDMATRIX_X4  # pylint: disable=protected-access
  assert hashlib.sha256(text.encode()).hexdigest() == _VALIDATED_MMA_SYNC_PTX_SHA256


# sha256 of the zero point's PTX (a byte -> bf16 128 + z, both halves) as compiled and
# matched on the H200 (session 45: the zero-point GPU cases of this file, 144 passed).
_VALIDATED_ZERO_POINT_PTX_SHA256 = (
    "cc01564be6ba86a3dd8e1cbe2dee02b61cc11c17af4132f812be75612684e620")


def test_zero_point_ptx_is_the_one_validated_on_the_gpu():
  """As the mma.sync text above: a changed text must run the GPU tests first."""
  import hashlib  # pylint: disable=g-import-not-at-top
  text = kw._ZERO_TO_BF16X2  # pylint: disable=protected-access
  assert hashlib.sha256(text.encode()).hexdigest() == _VALIDATED_ZERO_POINT_PTX_SHA256
