"""qjax.moe_matmul on INT4 expert stacks (qjax.Int4Weight with a leading [E] axis): the
XLA path, the grouped kernel (pallas_kernels.int4_moe) and the per-pair GEMV kernel
(pallas_kernels.int4_moe_gemv) against a float64 numpy reference; GGUF Q4_0 / Q4_1 expert
stacks' lossless conversion to that stack.

The reference decodes each selected expert from its stored arrays in numpy (codes
unpacked by ``packing.unpack_codes``, ``(q - z) * s`` or ``q * s + b`` in float64), never
through qjax's dequantize. Inputs are fresh random draws: every 32-bit code word (the
padding rows past K included, so a kernel that let them through would show), random
scales, zero points and biases, activations without zeros; experts no pair selects have
NaN scales, so reading one shows; kernel outputs are poisoned (NaN) before each run.

On the CPU the kernels run in interpret mode. On an NVIDIA GPU the compiled kernels run
in the ``TestPallasGpu*`` classes and the ``test_pallas_gpu_*`` tests (``-k pallas``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import needs_gpu, on_gpu, pallas_operand_shapes, rel_err, seed_from
from qjax._src import kernel_layouts
from qjax._src import moe
from qjax._src import packing

GROUPED, GEMV = "pallas_triton", "pallas_triton_gemv"


def _grouped():
  from pallas_kernels import int4_moe  # pylint: disable=g-import-not-at-top
  return int4_moe


def _gemv():
  from pallas_kernels import int4_moe_gemv  # pylint: disable=g-import-not-at-top
  return int4_moe_gemv


# ----------------------------------------------------------------------------- inputs


def make_experts(rng, e, k, n, *, group=128, form="sym", scale_dtype=jnp.bfloat16,
                 tile_k=packing.NATIVE_TILE_K):
  """E experts of random code words (every bit pattern, padding rows included) and random
  group parameters: scales ``(0.5 .. 1.5) / sqrt(K)``, zero points 0..15 (``form="zeros"``),
  biases ``N(0, 1) / sqrt(K)`` (``form="biases"``); ``group`` None: one per column."""
  g = group or k
  kp = packing.padded_rows(k, tile_k)
  codes = rng.integers(0, 2**32, (e, kp // 8, n), dtype=np.uint64).astype(np.uint32)
  groups = (e, k // g, n)
  scales = jnp.asarray(rng.uniform(0.5, 1.5, groups) / np.sqrt(k), scale_dtype)
  zeros = jnp.asarray(rng.integers(0, 16, groups), jnp.uint8) if form == "zeros" else None
  biases = (jnp.asarray(rng.standard_normal(groups) / np.sqrt(k), scale_dtype)
            if form == "biases" else None)
  return qjax.Int4Weight(codes=jnp.asarray(codes), scales=scales, zeros=zeros, biases=biases,
                         shape=(k, n), group_size=g, tile_k=tile_k)


def nan_unselected(w, pair_experts):
  """``w`` with NaN scales for every expert no pair selects."""
  scales = np.asarray(w.scales.astype(jnp.float32)).copy()
  scales[np.setdiff1d(np.arange(scales.shape[0]), pair_experts)] = np.nan
  return qjax.Int4Weight(codes=w.codes, scales=jnp.asarray(scales, w.scales.dtype),
                         zeros=w.zeros, biases=w.biases, shape=w.shape,
                         group_size=w.group_size, tile_k=w.tile_k)


def make_rows(rng, r, k, dtype):
  """Standard normal activations, none zero."""
  x = rng.standard_normal((r, k))
  return jnp.asarray(np.where(np.abs(x) < 1e-3, 1e-3, x), dtype)


def random_ids(rng, t, e, top_k):
  """[T, top_k] distinct experts per token (as a router's top-k gives)."""
  return np.stack([rng.choice(e, top_k, replace=False) for _ in range(t)]).astype(np.int32)


def np_expert(w, e) -> np.ndarray:
  """float64 ``[K, N]`` of expert ``e``, from its stored arrays only."""
  k = w.shape[0]
  g = w.group_size
  q = packing.unpack_codes(np.asarray(w.codes[e]), k, w.tile_k).astype(np.float64)
  group = lambda a: np.repeat(np.asarray(a[e].astype(jnp.float32), np.float64), g, axis=0)
  if w.biases is not None:
    return q * group(w.scales) + group(w.biases)
  z = 8.0 if w.zeros is None else np.repeat(np.asarray(w.zeros[e], np.float64), g, axis=0)
  return (q - z) * group(w.scales)


def np_pairs(rows, w, pair_rows, pair_experts):
  """float64 ``[P, N]`` products and their bound ``|x| @ |W|`` (selected experts only)."""
  x = np.asarray(jnp.asarray(rows, jnp.float32), np.float64)[np.asarray(pair_rows)]
  pair_experts = np.asarray(pair_experts)
  out = np.zeros((len(pair_experts), w.shape[1]))
  bound = np.zeros_like(out)
  for e in np.unique(pair_experts):
    sel = pair_experts == e
    wd = np_expert(w, int(e))
    out[sel] = x[sel] @ wd
    bound[sel] = np.abs(x[sel]) @ np.abs(wd)
  return out, bound


def check(y, rows, w, pair_rows, pair_experts, dtype, tol=1e-2) -> float:
  """Shape, dtype, no poison left; error < ``tol`` over all outputs and per element
  relative to ``sum_k |x_k W_kn|``. Returns the largest per-element error / bound."""
  assert y.shape == (len(pair_rows), w.shape[1]) and y.dtype == jnp.dtype(dtype)
  y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
  assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
  ref, bound = np_pairs(rows, w, pair_rows, pair_experts)
  assert rel_err(y, ref) < tol, (dtype, rel_err(y, ref))
  worst = float(np.max(np.abs(y - ref) / bound))
  assert worst <= tol, (dtype, worst)
  return worst


# ----------------------------------------------------------------------------- the suite

# (T, E, top_k, K, N, group, form, scale dtype, x dtype): decode and prefill sizes (pairs
# below and above E, which moves the XLA path from gathered experts to ragged_dot); every
# group size, one group per column, symmetric / zero points / biases, each scale and
# activation dtype; K off the 128-row tile (96, 160, 200, 288), odd N and N of one column.
CASES = [
    (1, 8, 2, 160, 40, 32, "sym", jnp.bfloat16, jnp.bfloat16),
    (1, 128, 8, 256, 64, 128, "zeros", jnp.bfloat16, jnp.bfloat16),
    (3, 4, 2, 256, 33, 64, "zeros", jnp.float16, jnp.float16),
    (5, 6, 3, 384, 130, 128, "biases", jnp.float32, jnp.float32),
    (2, 16, 4, 200, 64, None, "zeros", jnp.bfloat16, jnp.bfloat16),
    (7, 4, 1, 512, 96, 256, "sym", jnp.float16, jnp.bfloat16),
    (4, 8, 2, 96, 7, 32, "biases", jnp.float16, jnp.float16),
    (3, 5, 5, 288, 1, 32, "sym", jnp.float32, jnp.float32),
    (37, 8, 2, 160, 40, None, "biases", jnp.bfloat16, jnp.float32),
    (64, 8, 2, 256, 48, 64, "sym", jnp.bfloat16, jnp.float16),
]


def case_id(c):
  t, e, top_k, k, n, g, form, sdt, xdt = c
  return (f"T{t}-E{e}-top{top_k}-{k}x{n}-g{g or 'K'}-{form}-s{jnp.dtype(sdt).name}"
          f"-x{jnp.dtype(xdt).name}")


class Int4MoESuite:
  """Subclasses set ``run(rows, w, pair_rows, pair_experts, config=None) -> [P, N]``;
  ``poisons_unselected``: whether experts no pair selects may hold NaN scales."""
  poisons_unselected = True

  def run(self, rows, w, pair_rows, pair_experts, config=None):
    raise NotImplementedError

  def poison(self, w, pair_experts):
    """``w`` with NaN scales on its unselected experts where this implementation must
    not read them (every kernel; XLA's gathered route, for fewer pairs than experts)."""
    if self.poisons_unselected or len(pair_experts) < w.codes.shape[0]:
      return nan_unselected(w, pair_experts)
    return w

  @pytest.mark.parametrize("case", CASES, ids=case_id)
  def test_matches_float64(self, request, case):
    t, e, top_k, k, n, g, form, sdt, xdt = case
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, e, k, n, group=g, form=form, scale_dtype=sdt)
    ids = random_ids(rng, t, e, top_k)
    if t > 2:
      ids[: t // 2 + 1, 0] = ids[0, 0]  # one expert serves half the tokens
    pair_experts = ids.reshape(-1)
    w = self.poison(w, pair_experts)
    x = make_rows(rng, t, k, xdt)
    pair_rows = np.arange(t * top_k, dtype=np.int32) // top_k
    y = self.run(x, w, pair_rows, pair_experts)
    worst = check(y, x, w, pair_rows, pair_experts, xdt)
    print(f"{case_id(case)}: max |y - ref| / (|x| @ |W|) = {worst:.2e}")

  def test_one_row_per_pair_and_repeated_pairs(self, request):
    """Rows of their own per pair (the down projection's x [T, top_k, K]), one pair
    appearing twice, one expert shared by most pairs."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 6, 160, 72, group=32, form="zeros")
    pair_rows = np.array([0, 1, 2, 3, 4, 4, 5], np.int32)
    pair_experts = np.array([2, 2, 5, 2, 0, 0, 2], np.int32)
    w = self.poison(w, pair_experts)
    x = make_rows(rng, 6, 160, jnp.bfloat16)
    check(self.run(x, w, pair_rows, pair_experts), x, w, pair_rows, pair_experts,
          jnp.bfloat16)

  def test_plain_tile_order_is_repacked(self, request):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 4, 288, 24, group=32, form="biases", tile_k=packing.PLAIN_TILE_K)
    pair_rows, pair_experts = np.array([0, 0, 1, 2], np.int32), np.array([3, 1, 3, 0], np.int32)
    x = make_rows(rng, 3, 288, jnp.float32)
    check(self.run(x, self.poison(w, pair_experts), pair_rows, pair_experts), x, w,
          pair_rows, pair_experts, jnp.float32)


class XlaSuite(Int4MoESuite):
  poisons_unselected = False  # ragged_dot dequantizes every expert

  def run(self, rows, w, pair_rows, pair_experts, config=None):
    del config
    return jax.jit(moe.moe_matmul_xla)(rows, w, jnp.asarray(pair_rows),
                                       jnp.asarray(pair_experts))


class TestXla(XlaSuite):
  pass


class TestXlaGatheredSum(XlaSuite):
  """The fused decode route the GGUF stacks take (``gathered_sum=True``), also right for
  Int4Weight (moe_matmul's own route for it is the MXFP4 one)."""

  def run(self, rows, w, pair_rows, pair_experts, config=None):
    del config
    fn = jax.jit(lambda *a: moe.moe_matmul_xla(*a, gathered_sum=True))
    return fn(rows, w, jnp.asarray(pair_rows), jnp.asarray(pair_experts))


class KernelSuite(Int4MoESuite):
  interpret: bool
  kernel: str  # "grouped" or "gemv"

  def run(self, rows, w, pair_rows, pair_experts, config=None):
    mod = _grouped() if self.kernel == "grouped" else _gemv()
    fn = mod.int4_moe_matmul if self.kernel == "grouped" else mod.int4_moe_gemv
    return jax.jit(lambda *a: fn(*a, config=config, poison=True, interpret=self.interpret))(
        rows, w, jnp.asarray(pair_rows), jnp.asarray(pair_experts))

  def test_moe_matmul_by_name(self, request):
    """``implementation="interpret:NAME"`` / ``"pallas:NAME"`` runs this kernel through
    ``qjax.moe_matmul`` under jit; x of ``[T, K]`` and of ``[T, top_k, K]``."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 8, 160, 48, group=32, form="zeros")
    name = GROUPED if self.kernel == "grouped" else GEMV
    impl = f"{'interpret' if self.interpret else 'pallas'}:{name}"
    assert qjax.moe_implementation_name(w, impl) == name + ("-interpret" if self.interpret
                                                            else "")
    ids = np.array([[1, 6], [6, 3], [1, 1]], np.int32)
    for x in (make_rows(rng, 3, 160, jnp.bfloat16),
              jnp.asarray(rng.standard_normal((3, 2, 160)), jnp.bfloat16)):
      y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=impl))(
          x, w, jnp.asarray(ids))
      assert y.shape == (3, 2, 48) and y.dtype == jnp.bfloat16
      rows = x if x.ndim == 2 else x.reshape(6, 160)
      pair_rows = np.arange(6, dtype=np.int32) // (2 if x.ndim == 2 else 1)
      check(y.reshape(6, 48), rows, w, pair_rows, ids.reshape(-1), jnp.bfloat16)


class GroupedSuite(KernelSuite):
  kernel = "grouped"

  @pytest.mark.parametrize("cfg", [
      qjax.KernelConfig(block_m=16, block_n=32, block_k=128),
      qjax.KernelConfig(block_m=16, block_n=16, block_k=256, split_k=2),
      qjax.KernelConfig(block_m=32, block_n=64, block_k=128, split_k=3),
      qjax.KernelConfig(block_m=64, block_n=32, block_k=512, split_k=1)])
  def test_configs_and_split_k(self, request, cfg):
    """K = 352 (3 K-tiles, ragged), N = 40, a group longer than one row block."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 8, 352, 40, group=32, form="biases")
    ids = random_ids(rng, 21, 8, 2)
    ids[:12, 0] = 7
    pair_rows, pair_experts = np.arange(42, dtype=np.int32) // 2, ids.reshape(-1)
    x = make_rows(rng, 21, 352, jnp.bfloat16)
    y = self.run(x, nan_unselected(w, pair_experts), pair_rows, pair_experts, cfg)
    check(y, x, w, pair_rows, pair_experts, jnp.bfloat16)

  def test_groups_of_48_rows(self, request):
    """Groups of 48 rows (whole slabs that do not divide the 128-row tile): the grouped
    kernel takes them, the GEMV kernel declines them and auto routing skips it."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 5, 288, 40, group=48, form="zeros")
    pair_rows, pair_experts = np.array([0, 0, 1], np.int32), np.array([4, 1, 1], np.int32)
    x = make_rows(rng, 2, 288, jnp.float16)
    check(self.run(x, nan_unselected(w, pair_experts), pair_rows, pair_experts), x, w,
          pair_rows, pair_experts, jnp.float16)
    assert _gemv().declines(w) is not None and _grouped().declines(w) is None
    mode = "interpret" if self.interpret else "pallas"
    assert qjax.moe_implementation_name(w, mode, 3) == GROUPED + (
        "-interpret" if self.interpret else "")
    with pytest.raises(NotImplementedError, match="group_size=48"):
      _gemv().int4_moe_gemv(x, w, jnp.asarray(pair_rows), jnp.asarray(pair_experts),
                            interpret=True)


class GemvSuite(KernelSuite):
  kernel = "gemv"

  @pytest.mark.parametrize("bn,bk,split,depth,warps", [
      (32, 128, 1, 1, 4), (64, 256, 2, 1, 4), (128, 256, 3, 2, 8), (64, 512, 1, 2, 4),
      (32, 128, 13, 1, 4), (64, 128, 5, 2, 4), (128, 128, 4, 3, 8), (64, 128, 99, 1, 4)])
  def test_loop_shapes(self, request, bn, bk, split, depth, warps):
    """13 K-tiles (K = 1568, off the tile; groups of 32), N = 100, under each loop shape:
    splits that divide the tiles, splits whose last one runs past the end (5 and 4 of
    13), more splits than tiles."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 6, 1568, 100, group=32, form="zeros")
    pair_rows, pair_experts = np.array([1, 0, 1], np.int32), np.array([5, 2, 2], np.int32)
    x = make_rows(rng, 2, 1568, jnp.bfloat16)
    cfg = qjax.KernelConfig(block_m=1, block_n=bn, block_k=bk, split_k=split,
                            num_warps=warps, num_stages=depth)
    y = self.run(x, nan_unselected(w, pair_experts), pair_rows, pair_experts, cfg)
    check(y, x, w, pair_rows, pair_experts, jnp.bfloat16)

  @pytest.mark.parametrize("group", [None, 256])
  def test_k_tail_with_long_groups(self, request, group):
    """K = 640 (5 K-tiles) in 2 splits of 3 steps, one group per column or groups of 256
    (each spans two tiles): the steps past the end read nothing and add nothing."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    k = 640 if group is None else 768
    w = make_experts(rng, 5, k, 64, group=group, form="biases", scale_dtype=jnp.float32)
    pair_rows, pair_experts = np.array([0, 2, 1, 2], np.int32), np.array([0, 3, 3, 4], np.int32)
    x = make_rows(rng, 3, k, jnp.float32)
    cfg = qjax.KernelConfig(block_m=1, block_n=64, block_k=128, split_k=2, num_stages=1)
    y = self.run(x, nan_unselected(w, pair_experts), pair_rows, pair_experts, cfg)
    check(y, x, w, pair_rows, pair_experts, jnp.float32)

  def test_constant_row_zero_is_not_handed_to_the_kernel(self, request):
    """One token's pair rows (all zero, a constant under jit) are not an operand."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 9, 256, 40, group=64)
    impl = f"{'interpret' if self.interpret else 'pallas'}:{GEMV}"
    for tokens in (1, 2):
      ids = jnp.asarray(random_ids(rng, tokens, 9, 4))
      x = make_rows(rng, tokens, 256, jnp.bfloat16)
      fn = lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=impl)
      calls = pallas_operand_shapes(jax.make_jaxpr(fn)(x, w, ids).jaxpr)
      assert len(calls) == 1 and calls[0].count((tokens * 4,)) == tokens, calls
      y = jax.jit(fn)(x, w, ids)
      check(y.reshape(tokens * 4, 40), x, w, np.arange(tokens * 4) // 4,
            np.asarray(ids).reshape(-1), jnp.bfloat16)


class TestInterpretGrouped(GroupedSuite):
  interpret = True


class TestInterpretGemv(GemvSuite):
  interpret = True


@needs_gpu
class TestPallasGpuGrouped(GroupedSuite):
  interpret = False


@needs_gpu
class TestPallasGpuGemv(GemvSuite):
  interpret = False


# ------------------------------------------------------------------ the front and routing


IMPLEMENTATIONS = ["xla", "interpret", f"interpret:{GROUPED}", f"interpret:{GEMV}",
                   pytest.param(f"pallas:{GROUPED}", marks=needs_gpu),
                   pytest.param(f"pallas:{GEMV}", marks=needs_gpu),
                   pytest.param("pallas", marks=needs_gpu)]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("tokens,experts", [(3, 4), (2, 16)])  # pairs >= E and < E (XLA)
def test_traced_ids_out_of_range_give_nan_rows_only(rng, implementation, tokens, experts):
  """Under jit the ids cannot be checked: a pair whose id is outside [0, E) gets a NaN
  row, on every implementation, and every other pair its own expert's product."""
  k, n, top_k = 160, 40, 3
  w = make_experts(rng, experts, k, n, group=32, form="zeros")
  x = make_rows(rng, tokens, k, jnp.float32)
  ids = random_ids(rng, tokens, experts, top_k)
  bad = [(0, 1, -1), (tokens - 1, 0, experts), (tokens - 1, 2, -2)]
  if tokens > 2:
    bad.append((1, 2, experts + 5))
  for t, j, e in bad:
    ids[t, j] = e
  fn = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=implementation))
  y = np.asarray(fn(x, w, jnp.asarray(ids)), np.float64).reshape(tokens * top_k, n)
  invalid = ((ids < 0) | (ids >= experts)).reshape(-1)
  assert np.isnan(y[invalid]).all()
  pair_rows = (np.arange(tokens * top_k) // top_k)[~invalid]
  good = ids.reshape(-1)[~invalid]
  # float32 x: the grouped Triton kernel's dots are one TF32 product on a GPU (README),
  # interpreted there too (test_moe.py's rule; the H100 run found it).
  tf32 = implementation == "pallas" or implementation.endswith(GROUPED)
  tol = 2e-3 if on_gpu() and tf32 else 1e-5
  check(y[~invalid].astype(np.float32), x, w, pair_rows, good, jnp.float32, tol=tol)
  with pytest.raises(ValueError, match=rf"must lie in \[0, {experts}\)"):
    qjax.moe_matmul(x, w, jnp.asarray(ids), implementation=implementation)


def test_default_routing_by_pairs(rng):
  """None / "pallas" / "interpret" pick the GEMV kernel for 1 to MAX_PAIRS pairs that
  repeat few experts and the grouped kernel past that, as for MXFP4; XLA on a CPU; the
  registered names."""
  gemv = _gemv()
  w = make_experts(rng, 4, 128, 32)
  many = make_experts(rng, 128, 128, 32)
  for experts, pairs, name in ((w, 1, GEMV), (w, 6, GEMV), (w, 8, GROUPED),
                               (many, gemv.MAX_PAIRS, GEMV),
                               (many, gemv.MAX_PAIRS + 1, GROUPED), (w, None, GROUPED)):
    assert qjax.moe_implementation_name(experts, "interpret", pairs) == name + "-interpret"
    assert qjax.moe_implementation_name(experts, None, pairs) == (name if on_gpu() else "xla")
    assert qjax.moe_implementation_name(experts, "xla", pairs) == "xla"
  names = [b.name for b in moe.moe_kernels_for_format(qjax.Int4Weight)]
  assert names == [GROUPED, GEMV]
  assert moe.takes_format(w) and qjax.Int4Weight in moe.MOE_FORMATS


def test_bad_arguments_are_named(rng):
  w = make_experts(rng, 4, 128, 32, group=64)
  x = jnp.ones((3, 128), jnp.float32)
  with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
    qjax.moe_matmul(x, w, jnp.array([[0, 4]] * 3))
  with pytest.raises(ValueError, match=r"must be \[T, K\]"):
    qjax.moe_matmul(jnp.ones((2, 128)), w, jnp.zeros((3, 2), jnp.int32))
  one = jax.tree.map(lambda a: a[0], w)
  with pytest.raises(ValueError, match="one leading expert axis"):
    qjax.moe_matmul(x, one, jnp.zeros((3, 1), jnp.int32))
  rows, pairs = jnp.ones((2, 128), jnp.bfloat16), jnp.zeros((3,), jnp.int32)
  mxfp4 = qjax.quantize_mxfp4(jnp.ones((4, 128, 32)))
  with pytest.raises(NotImplementedError, match="Int4Weight with one leading expert axis, "
                     "got MXFP4Weight"):
    _grouped().int4_moe_matmul(rows, mxfp4, pairs, pairs, interpret=True)
  with pytest.raises(NotImplementedError, match="Int4Weight with one leading expert axis, "
                     r"got Int4Weight with codes of shape \(16, 32\)"):
    _gemv().int4_moe_gemv(rows, one, pairs, pairs, interpret=True)
  with pytest.raises(ValueError, match=r"rows must be \[R >= 1, K=128\], got shape \(2, 64\)"):
    _gemv().int4_moe_gemv(jnp.ones((2, 64)), w, pairs, pairs, interpret=True)
  with pytest.raises(ValueError, match=r"shapes \(3,\) and \(2,\)"):
    _gemv().int4_moe_gemv(rows, w, pairs, pairs[:2], interpret=True)
  # The dense kernel reads one matrix: it declines a stack (qjax.kernel_layouts asks).
  from pallas_kernels import int4_matmul  # pylint: disable=g-import-not-at-top
  assert "expert stack" in int4_matmul.declines(w) and int4_matmul.declines(one) is None


@pytest.mark.parametrize("implementation", ["xla", f"interpret:{GROUPED}",
                                            f"interpret:{GEMV}",
                                            pytest.param("pallas", marks=needs_gpu)])
@pytest.mark.parametrize("tokens", [1, 6])
def test_scanned_layers_of_expert_stacks_equal_each_layer_bit_for_bit(implementation,
                                                                      tokens):
  """``qjax.layer_of`` on ``[layers, E, ...]`` arrays (a scanned MoE model's experts): each
  scanned layer equals that layer's own call bit for bit, and the kernels are handed the
  whole stack (read in place, no copy of the layer)."""
  rng = np.random.default_rng(seed_from(f"layers-{implementation}-{tokens}"))
  layers, experts, k, n, top_k = 3, 4, 160, 40, 2
  ws = [make_experts(rng, experts, k, n, group=32, form=f)
        for f in ("zeros", "zeros", "zeros")]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  x = make_rows(rng, tokens, k, jnp.bfloat16)
  ids = jnp.asarray(random_ids(rng, tokens, experts, top_k))

  def scanned(x, stack):
    def body(carry, i):
      return carry, qjax.moe_matmul(x, qjax.layer_of(stack, i), ids,
                                    implementation=implementation)
    return jax.lax.scan(body, 0, jnp.arange(layers))[1]

  got = np.asarray(jax.jit(scanned)(x, stack).astype(jnp.float32))
  for i, w in enumerate(ws):
    want = jax.jit(lambda x, w: qjax.moe_matmul(x, w, ids, implementation=implementation))(
        x, w)
    np.testing.assert_array_equal(got[i], np.asarray(want.astype(jnp.float32)),
                                  err_msg=f"layer {i}")
    check(want.reshape(tokens * top_k, n), x, w, np.arange(tokens * top_k) // top_k,
          np.asarray(ids).reshape(-1), jnp.bfloat16)
  if implementation != "xla":
    calls = pallas_operand_shapes(jax.make_jaxpr(scanned)(x, stack).jaxpr)
    assert calls and all(stack.codes.shape in shapes and stack.zeros.shape in shapes
                         for shapes in calls), calls


def test_gradient_through_the_kernels_is_the_xla_one(rng):
  """Reverse mode through a kernel call is the XLA path's backward pass."""
  w = make_experts(rng, 6, 160, 40, group=32, form="biases", scale_dtype=jnp.float32)
  x = make_rows(rng, 3, 160, jnp.float32)
  ids = jnp.asarray(random_ids(rng, 3, 6, 2))
  g = jnp.asarray(rng.standard_normal((3, 2, 40)), jnp.float32)
  grads = [jax.grad(lambda x_: jnp.sum(qjax.moe_matmul(x_, w, ids, implementation=i) * g))(x)
           for i in ("xla", f"interpret:{GROUPED}", f"interpret:{GEMV}")]
  want = np.einsum("tjn,tjkn->tk", np.asarray(g, np.float64),
                   np.stack([np_expert(w, e) for e in range(6)])[np.asarray(ids)])
  for got in grads:
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------- GGUF expert stacks


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
def test_gguf_stack_converts_bit_exactly(ggml_type):
  """A GGUF Q4_0 / Q4_1 expert stack (``[E, N, row bytes]``, as a 3-D tensor loads)
  converts to an Int4Weight stack whose dequantization is gguf-py's bit for bit, through
  ``to_int4`` (jitted, both tile orders), ``gguf_tiled.kernel_layout`` and
  ``kernel_layouts.convert_to``; each expert's slice equals that expert's own 2-D
  conversion; and moe_matmul on it matches the GGUF stack's XLA path."""
  gguf = pytest.importorskip("gguf")
  import test_gguf_formats  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_formats as gf  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_tiled  # pylint: disable=g-import-not-at-top
  e, n, k = 5, 40, 96
  cls = gf.BLOCK_FORMATS[ggml_type]
  raw = np.concatenate([test_gguf_formats._raw_blocks(ggml_type, n, k, seed)  # pylint: disable=protected-access
                        for seed in range(e)]).reshape(e, n, -1)
  stack = cls.from_bytes(raw, (k, n), (e,))
  assert stack.leading_axes == (e,)
  want = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]),
                    np.float32).swapaxes(-1, -2)                      # [E, K, N]
  bits = lambda a: np.asarray(a, np.float32).view(np.uint32)
  converted = [jax.jit(lambda w: w.to_int4())(stack), stack.to_int4(packing.PLAIN_TILE_K),
               gguf_tiled.kernel_layout(stack),
               kernel_layouts.convert_to(stack, qjax.Int4Weight)]
  for w in converted:
    assert isinstance(w, qjax.Int4Weight) and w.codes.shape[0] == e and w.group_size == 32
    np.testing.assert_array_equal(bits(w.dequantize()), bits(want))
    for i in range(e):  # numpy's decode of the stored arrays agrees too
      np.testing.assert_array_equal(np_expert(w, i).astype(np.float32), want[i])
  w = converted[0]
  for i in (0, e - 1):
    one = jax.tree.map(lambda a, i=i: a[i], stack)
    assert one.leading_axes == ()
    dense = one.to_int4()  # the 2-D conversion, unchanged
    assert dense.codes.ndim == 2
    for field in ("codes", "scales", "zeros", "biases"):
      a, b = getattr(dense, field), getattr(w, field)
      assert (a is None) == (b is None), field
      if a is not None:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b[i]), err_msg=field)
  rng = np.random.default_rng(seed_from(ggml_type))
  x = make_rows(rng, 2, k, jnp.float32)
  ids = jnp.asarray(random_ids(rng, 2, e, 2))
  ref = np.asarray(qjax.moe_matmul(x, stack, ids, implementation="xla"))
  for impl in ("xla", f"interpret:{GROUPED}", f"interpret:{GEMV}"):
    y = np.asarray(qjax.moe_matmul(x, w, ids, implementation=impl))
    assert np.max(np.abs(y - ref)) <= 2e-6 * np.max(np.abs(ref)), impl


def test_kernel_layouts_convert_q4_stacks_for_the_moe_kernels():
  """On Hopper, ``qjax.kernel_layouts`` gives a Q4_0 expert stack the Int4Weight stack the
  INT4 MoE kernels read where ``experts`` names it, and keeps it where the dense kernel
  would have to (it reads one matrix)."""
  pytest.importorskip("gguf")
  import test_gguf_formats  # pylint: disable=g-import-not-at-top
  import test_kernel_layouts  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_formats as gf  # pylint: disable=g-import-not-at-top
  raw = test_gguf_formats._raw_blocks("Q4_0", 4 * 24, 128, 1).reshape(4, 24, -1)  # pylint: disable=protected-access
  stack = gf.GGUFQ4_0.from_bytes(raw, (128, 24), (4,))
  hopper = test_kernel_layouts.HOPPER
  tree, (choice,) = qjax.kernel_layouts({"w": stack}, device=hopper, experts=lambda p: True,
                                        with_report=True)
  assert isinstance(tree["w"], qjax.Int4Weight) and tree["w"].codes.shape[0] == 4, choice
  assert "Int4Weight's kernel runs it" in choice.reason
  tree, (choice,) = qjax.kernel_layouts({"w": stack}, device=hopper, with_report=True)
  assert tree["w"] is stack and "expert stack" in choice.reason, choice


# ----------------------------------------------------------------------- the GPU suite


@needs_gpu
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
@pytest.mark.parametrize("shape,group,form", [
    ((2048, 768), 128, "sym"),     # Qwen3-30B-A3B's gate / up experts, GPTQ-like
    ((768, 2048), 32, "biases"),   # its down experts as GGUF Q4_1 gives them
    ((2880, 2880), 32, "sym")])    # GPT-OSS's, GGUF Q4_0-like (K off the 128-row tile)
def test_pallas_gpu_model_shapes(request, tokens, shape, group, form):
  """128 experts, top-8, bf16 activations, heuristic configs, through ``qjax.moe_matmul``
  (auto: the GEMV kernel up to MAX_PAIRS pairs, the grouped one beyond) and each kernel by
  name, against float64."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  k, n = shape
  w = make_experts(rng, 128, k, n, group=group, form=form,
                   scale_dtype=jnp.float16 if group == 32 else jnp.bfloat16)
  ids = random_ids(rng, tokens, 128, 8)
  x = make_rows(rng, tokens, k, jnp.bfloat16)
  pair_rows, pair_experts = np.arange(tokens * 8) // 8, ids.reshape(-1)
  for impl in (None, f"pallas:{GROUPED}", f"pallas:{GEMV}"):
    y = jax.jit(lambda a, b, c, i=impl: qjax.moe_matmul(a, b, c, implementation=i))(
        x, w, jnp.asarray(ids))
    worst = check(y.reshape(tokens * 8, n), x, w, pair_rows, pair_experts, jnp.bfloat16)
    print(f"{impl}: max |y - ref| / (|x| @ |W|) = {worst:.2e}")


@needs_gpu
def test_pallas_gpu_auto_picks_the_kernels(rng):
  w = make_experts(rng, 8, 256, 128)
  assert qjax.moe_implementation_name(w, None, 4) == GEMV
  assert qjax.moe_implementation_name(w, None, 256) == GROUPED


# --------------------------------------------------------------------- without a GPU


@pytest.mark.parametrize("kernel", ["grouped", "gemv"])
@pytest.mark.parametrize("k,n,group,form,dtype,split", [
    (2880, 2880, 32, "sym", jnp.bfloat16, None), (160, 40, 32, "zeros", jnp.float16, 2),
    (640, 130, None, "biases", jnp.float32, 2), (768, 64, 256, "zeros", jnp.bfloat16, 3)])
def test_lowers_to_triton(kernel, k, n, group, form, dtype, split):
  """The compiled kernels' Pallas -> Triton lowering runs on any host (no GPU compile):
  ragged and whole K, ragged N, K-tail masks (GEMV), scalar tile-table and pair loads,
  every weight form."""
  rng = np.random.default_rng(0)
  w = make_experts(rng, 6, k, n, group=group, form=form)
  rows = jnp.ones((3, k), dtype)
  pairs = jnp.asarray([0, 1, 2, 2], jnp.int32)
  if kernel == "grouped":
    cfg = None if split is None else qjax.KernelConfig(block_m=16, block_n=32, block_k=128,
                                                       split_k=split)
    fn = lambda *a: _grouped().int4_moe_matmul(*a, config=cfg)
  else:
    cfg = None if split is None else qjax.KernelConfig(block_m=1, block_n=64, block_k=128,
                                                       split_k=split)
    fn = lambda *a: _gemv().int4_moe_gemv(*a, config=cfg)
  lowered = jax.jit(fn).trace(rows, w, pairs, pairs).lower(lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text()


def test_bench_moe_times_int4_experts(tmp_path, capsys):
  """``qjax bench --moe --format int4`` (the CPU smoke run): every column but wgmma (Hopper
  only, said once) is timed, and the floor counts the selected experts' codes and bf16
  group-128 scales."""
  import json  # pylint: disable=g-import-not-at-top
  import math  # pylint: disable=g-import-not-at-top
  from qjax._src import cli  # pylint: disable=g-import-not-at-top
  path = tmp_path / "moe.json"
  assert cli.main(["bench", "--moe", "--format", "int4", "--calls", "1", "--m", "3",
                   "--shapes", "256x64", "--moe-experts", "4", "--moe-top-k", "2",
                   "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "4 INT4 (symmetric, group 128) experts of 256x64" in out, out
  assert out.count("# nan wgmma: Hopper's wgmma MoE kernel does not run on") == 1, out
  (row,) = json.loads(path.read_text())["moe_rows"]
  assert row["format"] == "int4"
  assert math.isnan(row["times_us"]["wgmma"])
  assert all(math.isfinite(t) for name, t in row["times_us"].items() if name != "wgmma")
  per_expert = 256 * 64 // 2 + 256 // 128 * 64 * 2  # packed codes + bf16 scales
  io_bytes = 3 * 256 * 2 + 3 * 2 * 64 * 2           # x and the [T, top_k, N] output, bf16
  assert row["floor_bytes"] == pytest.approx(row["selected_experts"] * per_expert + io_bytes)


@pytest.mark.parametrize("on_gpu_defaults", [True, False])
def test_bench_moe_defaults_fit_int4_experts(on_gpu_defaults):
  """``qjax bench --moe --format int4`` without --shapes builds its experts: the GPU
  default for MXFP4 (GPT-OSS's K = 2880) is not a multiple of INT4's group 128, so INT4
  takes Qwen3-30B-A3B's 2048x768, top-8 (the H100 run raised on 2880 before)."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  cfg = bench.moe_defaults("int4", on_gpu_defaults)
  assert cfg["k"] % 128 == 0 and cfg["top_k"] <= cfg["experts"]
  w = bench.random_weight("int4", cfg["k"], cfg["n"], jax.random.key(0))
  assert w.shape == (cfg["k"], cfg["n"])
  assert bench.moe_defaults("mxfp4", on_gpu_defaults)["k"] == (2880 if on_gpu_defaults else 256)
