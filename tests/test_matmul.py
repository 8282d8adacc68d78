"""qjax.matmul on Int4Weight: every implementation against a float64 numpy reference.

One base class holds the suite; subclasses run it on the XLA path, on the Pallas kernel
in interpret mode (CPU) and on the compiled kernel (GPU only). Inputs are drawn fresh per
case from a seed derived from the test name; kernel outputs are poisoned (NaN) before
the run so an unwritten tile fails.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import packing
from conftest import needs_gpu, on_gpu, rel_err, seed_from

MS = (1, 3, 16, 100, 257)
SHAPES = ((256, 384), (4096, 4096), (4096, 11008))
GROUPS = (32, 128, None)
# Ordered so that cases sharing a weight run together (see _weight's cache).
CASES = [(m, shape, g, sym, dt) for shape, g, sym in itertools.product(SHAPES, GROUPS,
                                                                      (True, False))
         for m, dt in itertools.product(MS, (jnp.bfloat16, jnp.float16))]


def case_id(c):
  m, (k, n), g, sym, dt = c
  return f"M{m}-K{k}-N{n}-G{g or 'chan'}-{'sym' if sym else 'asym'}-{jnp.dtype(dt).name}"


def reference(x, w):
  """float64 x @ W, W rebuilt in numpy from the unpacked codes (not qjax.dequantize)."""
  k, n = w.shape
  q = packing.unpack_codes(np.asarray(w.codes), k, w.tile_k).astype(np.float64)
  s = np.repeat(np.asarray(w.scales, np.float64), w.group_size, axis=0)
  if w.biases is not None:
    wd = q * s + np.repeat(np.asarray(w.biases, np.float64), w.group_size, axis=0)
  else:
    z = 8.0 if w.zeros is None else np.repeat(np.asarray(w.zeros, np.float64), w.group_size,
                                              axis=0)
    wd = (q - z) * s
  return np.asarray(x, np.float64) @ wd


@functools.lru_cache(maxsize=4)
def _weight(k, n, group_size, symmetric):
  """One quantized weight per (shape, group, symmetry), shared by the M and dtype cases
  (quantizing 4096 x 11008 on a 2-core CPU dominates the suite otherwise)."""
  rng = np.random.default_rng(seed_from(f"w-{k}-{n}-{group_size}-{symmetric}"))
  return qjax.quantize(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k),
                       group_size=group_size, symmetric=symmetric)


def make_case(name, m, k, n, group_size, symmetric, dtype):
  """A fresh x per test (seeded from its name) and the shared weight of its kind."""
  rng = np.random.default_rng(seed_from(name))
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  return x, _weight(k, n, group_size, symmetric)


class MatmulSuite:
  """Subclasses set ``run(x, w) -> y``."""

  def run(self, x, w):
    raise NotImplementedError

  @pytest.mark.parametrize("case", CASES, ids=case_id)
  def test_matches_float64(self, request, case):
    m, (k, n), g, sym, dt = case
    x, w = make_case(request.node.nodeid, m, k, n, g, sym, dt)
    y = self.run(x, w)
    assert y.shape == (m, n) and y.dtype == jnp.dtype(dt)
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
    assert rel_err(y, reference(x, w)) < 1e-2

  @pytest.mark.parametrize("m,k,n,g", [(5, 96, 33, 32), (17, 200, 70, None), (2, 384, 1, 128),
                                       (9, 640, 130, 64), (1, 96, 33, 32), (1, 200, 70, None),
                                       (1, 640, 130, 64)])
  def test_ragged_shapes_and_float_biases(self, request, m, k, n, g):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = qjax.quantize(rng.standard_normal((k, n)).astype(np.float32), group_size=g,
                      symmetric=False, scale_dtype=jnp.float16)
    w = qjax.Int4Weight(codes=w.codes, scales=w.scales, zeros=None, shape=w.shape,
                        group_size=w.group_size,
                        biases=jnp.asarray(rng.standard_normal(w.scales.shape), jnp.float16))
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
      x = jnp.asarray(rng.standard_normal((m, k)), dt)
      y = np.asarray(self.run(x, w), np.float64)
      assert np.isfinite(y).all()
      assert rel_err(y, reference(x, w)) < 1e-2, dt

  def test_group_size_that_does_not_divide_the_k_step(self, request):
    """A 48-row group (a legal Int4Weight, not a power of two) in 128-row K-tiles: the
    kernel's scale chunks must not straddle two groups."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    k, n = 384, 64
    codes = rng.integers(0, 16, (k, n)).astype(np.uint32)
    w = qjax.Int4Weight(codes=packing.pack_codes(jnp.asarray(codes), qjax.NATIVE_TILE_K),
                        scales=jnp.asarray(rng.uniform(0.5, 1.5, (k // 48, n)), jnp.bfloat16),
                        zeros=None, shape=(k, n), group_size=48)
    for m in (1, 5):
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      y = np.asarray(self.run(x, w), np.float64)
      assert np.isfinite(y).all()
      assert rel_err(y, reference(x, w)) < 1e-2, m

  @pytest.mark.parametrize("by_dot", [True, False], ids=["x_sum_by_dot", "x_sum_by_adds"])
  def test_both_ways_of_summing_x(self, request, monkeypatch, by_dot):
    """The kernels sum x (for the zero point / bias term) either with a dot against ones
    or with vector adds; both must give the float64 result, with zero points and with
    float biases, at a 16-row block (where the dot is the default)."""
    from pallas_kernels import int4_matmul as km  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(km, "SUM_BY_DOT", by_dot)
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    k, n = 384, 96
    w = qjax.quantize(rng.standard_normal((k, n)).astype(np.float32), group_size=64,
                      symmetric=False)
    wb = qjax.Int4Weight(codes=w.codes, scales=w.scales, zeros=None, shape=w.shape,
                         group_size=w.group_size,
                         biases=jnp.asarray(rng.standard_normal(w.scales.shape), jnp.bfloat16))
    for weight in (w, wb):
      for dt in (jnp.bfloat16, jnp.float16):
        x = jnp.asarray(rng.standard_normal((7, k)), dt)
        y = np.asarray(self.run(x, weight), np.float64)
        assert np.isfinite(y).all()
        assert rel_err(y, reference(x, weight)) < 1e-2, (dt, weight.biases is None)

  def test_plain_order_weights(self, request):
    x, w = make_case(request.node.nodeid, 4, 256, 64, 64, False, jnp.bfloat16)
    y = np.asarray(self.run(x, w.repack(packing.PLAIN_TILE_K)), np.float64)
    assert rel_err(y, reference(x, w)) < 1e-2


class TestXla(MatmulSuite):

  def run(self, x, w):
    return jax.jit(lambda a, b: qjax.matmul(a, b, implementation="xla"))(x, w)

  def test_leading_dims(self, request):
    x, w = make_case(request.node.nodeid, 6, 256, 32, 128, True, jnp.float32)
    y = qjax.matmul(x.reshape(2, 3, 256), w, implementation="xla")
    assert y.shape == (2, 3, 32)
    assert rel_err(y.reshape(6, 32), reference(x, w)) < 1e-5


def _kernel(x, w, interpret):
  from pallas_kernels import int4_matmul as km  # pylint: disable=g-import-not-at-top
  config = None
  if interpret and w.shape[0] >= 1024:
    # Big blocks keep interpret mode (one Python step per program) fast on the CPU.
    config = qjax.KernelConfig(block_m=64 if x.shape[0] > 16 else 16, block_n=256,
                               block_k=512)
  return jax.jit(lambda a, b: km.int4_matmul(a, b, interpret=interpret, config=config,
                                             poison=True))(x, w)


class TestInterpret(MatmulSuite):

  def run(self, x, w):
    return _kernel(x, w, interpret=True)

  def test_dispatcher_routes_interpret(self, request):
    x, w = make_case(request.node.nodeid, 3, 256, 64, 32, True, jnp.bfloat16)
    assert qjax.implementation_name(w, "interpret") == "pallas_triton-interpret"
    y = qjax.matmul(x, w, implementation="interpret")
    assert rel_err(y, reference(x, w)) < 1e-2


@needs_gpu
class TestPallasGpu(MatmulSuite):

  def run(self, x, w):
    return _kernel(x, w, interpret=False)

  def test_auto_picks_pallas_for_small_m(self, request):
    x, w = make_case(request.node.nodeid, 16, 4096, 4096, 128, True, jnp.bfloat16)
    assert qjax.implementation_name(w) == "pallas_triton"
    assert rel_err(jax.jit(qjax.matmul)(x, w), reference(x, w)) < 1e-2


def test_pallas_without_gpu_says_so():
  if on_gpu():
    pytest.skip("this machine has a GPU")
  w = qjax.quantize(np.ones((128, 8), np.float32))
  with pytest.raises(NotImplementedError, match="interpret"):
    qjax.matmul(jnp.ones((1, 128), jnp.bfloat16), w, implementation="pallas")


@pytest.mark.parametrize("nibble", range(8))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_pair_ptx_decodes_both_words(nibble, dtype):
  """The tiled kernel's two-weights-per-LOP3 PTX, emulated bit for bit: the low half of
  the result is ``C + q`` of the first word's nibble, the high half of the second's, for
  every nibble position (the PRMT selector and the odd-nibble shift)."""
  import ptx_emulator  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_matmul as km  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(f"pair-ptx-{nibble}"))
  a, b = (rng.integers(0, 2**32, (256,), dtype=np.uint64).astype(np.uint32) for _ in "ab")
  dt = jnp.dtype(dtype)
  got = ptx_emulator.emulate(km._pair_ptx(nibble, km._MAGIC_PAIR[dt]), {1: a, 2: b})
  halves = [(got & np.uint32(0xFFFF)).astype(np.uint16),
            (got >> np.uint32(16)).astype(np.uint16)]
  magic_bits, offset = km._MAGIC[dt]
  for half, word in zip(halves, (a, b)):
    q = ((word >> np.uint32(4 * nibble)) & np.uint32(0xF)).astype(np.float64)
    values = np.asarray(jnp.asarray(half).view(dt), np.float64)
    np.testing.assert_array_equal(values, offset + q)
    assert (half & ~np.uint16(0xF) == magic_bits).all()


def test_x_sum_by_dot_only_for_16_bit_x_and_small_row_blocks():
  from pallas_kernels import int4_matmul as km  # pylint: disable=g-import-not-at-top
  assert km.sum_by_dot(jnp.bfloat16, 16) and km.sum_by_dot(jnp.float16, 16)
  assert not km.sum_by_dot(jnp.float32, 16)  # a float32 dot would round x (tf32)
  assert km.sum_by_dot(jnp.bfloat16, 32)
  assert not km.sum_by_dot(jnp.bfloat16, 64)  # measured slower at 64-row blocks


def test_int4_tiles_of_32_rows_between_16_and_64():
  from pallas_kernels import int4_matmul as km  # pylint: disable=g-import-not-at-top
  assert km.int4_heuristic_config(16, 4096, 4096).block_m == 16
  assert km.int4_heuristic_config(48, 4096, 4096).block_m == 32
  assert km.int4_heuristic_config(64, 4096, 14336).block_m == 32
  assert km.int4_heuristic_config(100, 4096, 4096).block_m == 64
  blocks = {c.block_m for c in km.int4_candidate_configs(64, 4096, 4096)}
  assert blocks == {32, 64}
  assert {c.block_m for c in km.int4_candidate_configs(20, 4096, 4096)} == {32}


def test_pairs_fit_needs_an_even_share_per_thread():
  from pallas_kernels import int4_matmul as km  # pylint: disable=g-import-not-at-top
  assert km.pairs_fit(16, 32, 4) and km.pairs_fit(16, 64, 4) and km.pairs_fit(16, 32, 8)
  assert not km.pairs_fit(16, 16, 8) and not km.pairs_fit(16, 8, 4)


def test_pair_ptx_text_is_the_validated_one():
  """The paired dequantization's PTX is byte for byte what compiled and matched float64
  on the H100 (2026-11-23, commit a25a672: 116 compiled cases of this file); a deliberate
  change must update the hash here and run the GPU tests again."""
  import hashlib  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_matmul as km  # pylint: disable=g-import-not-at-top
  text = "\n".join(km._pair_ptx(nibble, km._MAGIC_PAIR[jnp.dtype(dt)])
                   for dt in (jnp.bfloat16, jnp.float16) for nibble in range(8))
  assert hashlib.sha256(text.encode()).hexdigest() == (
      "9e12fa545bf9c37ec11cfd1672607e571b6531db40f122b4ca09eeb547cd1f97")


def test_int4_gemv_leaves_small_weights_to_xla():
  """At one row of x, symmetric weights of groups >= 128 under 2M elements run faster
  through XLA (H100 bench); biased, zero-point or small-group weights keep the kernel."""
  from pallas_kernels import int4_gemv  # pylint: disable=g-import-not-at-top

  def weight(k, n, **kw):
    return qjax.quantize(np.ones((k, n), np.float32), **kw)

  assert int4_gemv.xla_is_faster(1, weight(1024, 1024))
  assert int4_gemv.xla_is_faster(1, weight(512, 1536))
  assert not int4_gemv.xla_is_faster(1, weight(512, 1536, symmetric=False))
  assert not int4_gemv.xla_is_faster(1, weight(2048, 1024))  # 2M: the kernel's
  assert not int4_gemv.xla_is_faster(16, weight(512, 512))
  assert not int4_gemv.xla_is_faster(1, weight(512, 512, group_size=32))
  biased = weight(512, 512)
  biased = dataclasses.replace(biased, biases=biased.scales, zeros=None)
  assert not int4_gemv.xla_is_faster(1, biased)


def test_auto_routes_by_the_backends_rules(monkeypatch):
  """implementation=None runs the kernel except above auto_max_m or where
  auto_prefers_xla says so, and implementation_name names what runs."""
  from qjax._src import dispatch  # pylint: disable=g-import-not-at-top
  w = qjax.quantize(jax.random.normal(jax.random.key(seed_from("auto")), (256, 128)) / 16)
  calls = []

  def fake_kernel(x2, w_, *, interpret, config=None):
    calls.append(x2.shape[0])
    return jnp.full((x2.shape[0], w_.shape[1]), 7.0, x2.dtype)

  fake = qjax.Backend(name="fake", fn=fake_kernel, supported_on=lambda d: True,
                      auto_max_m=8,
                      auto_prefers_xla=lambda m, w_: m == 1 and w_.shape[0] * w_.shape[1] < 10**5)
  monkeypatch.setitem(dispatch._KERNELS, qjax.Int4Weight, [fake])
  for m, runs_xla in ((1, True), (2, False), (8, False), (9, True)):
    x = jax.random.normal(jax.random.key(m), (m, 256), jnp.float32).astype(jnp.bfloat16)
    y = qjax.matmul(x, w)
    want = qjax.matmul(x, w, implementation="xla")
    if runs_xla:
      np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    else:
      assert (np.asarray(y) == 7.0).all()
    assert qjax.implementation_name(w, m=m) == ("xla" if runs_xla else "fake"), m
    # float32 x always takes the XLA path (the kernels' dots would round it to TF32).
    x32 = x.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(qjax.matmul(x32, w)),
                                  np.asarray(qjax.matmul(x32, w, implementation="xla")))
    assert qjax.implementation_name(w, m=m, dtype=jnp.float32) == "xla"
  assert calls == [2, 8]
  bigger = qjax.quantize(jax.random.normal(jax.random.key(1), (512, 256)) / 16)  # 131072
  assert qjax.implementation_name(bigger, m=1) == "fake"
