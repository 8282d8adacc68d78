"""``qjax.moe_matmul`` of MXFP4NKWeight / NVFP4NKWeight expert stacks, and Hopper's grouped
wgmma kernel for them (``pallas_kernels.int4_wgmma.fp4_nk_moe_matmul``).

CPU: the XLA route against float64 (the experts decoded with ml_dtypes); the kernel's
configurations are legal; it declines what it lacks; it lowers for CUDA (chained and not,
both formats, a layer of a stack of expert stacks read in place) and reads only the
selected experts' weights (its operands are the stacks, indexed in the kernel). GPU
(Hopper): the compiled kernel against float64 on fresh random codes, scales, routings and
activations, with its output buffer poisoned, for GPT-OSS's K = N = 2880, odd N (a column
tile overlapping the one before it), several tokens per expert, K splits, chained and
unchained tiles, and ``qjax.layer_of``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import moe
from qjax._src import stacked
from pallas_kernels import int4_wgmma as kw
from tests.conftest import child_env, needs_gpu, pallas_operand_shapes, rel_err, seed_from
from tests.test_fp4_nk import assert_each_output_close, make_case, needs_hopper, weight_f64

FMTS = ["mxfp4", "nvfp4"]
WGMMA = "pallas:mosaic_gpu_wgmma"


def make_moe(name, tokens, experts, k, n, top_k, fmt="mxfp4", *, lead=()):
  """x ``[T, K]`` bf16, routing ``[T, top_k]`` (distinct experts per token), the experts
  as the row-major FP4 format and in their NK form."""
  x, w, wn = make_case(name, tokens, k, n, fmt, lead=(*lead, experts))
  rng = np.random.default_rng(seed_from(name + "/ids"))
  ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
  return x, w, wn, jnp.asarray(ids, jnp.int32)


def moe_reference(x, w, ids):
  """float64 ``[T, top_k, N]``: each token times each of its experts."""
  wd = weight_f64(w)                                            # [E, K, N]
  xs = np.asarray(x.astype(jnp.float32), np.float64)
  return np.einsum("tk,tjkn->tjn", xs, wd[np.asarray(ids)])


def assert_moe_close(y, ref):
  y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
  assert y.shape == ref.shape and np.isfinite(y).all(), "unwritten (poisoned) or non-finite"
  assert_each_output_close(y.reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1]))


# ---------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 3), (9, 1)])
def test_xla_route_matches_float64(request, fmt, tokens, top_k):
  x, w, wn, ids = make_moe(request.node.nodeid, tokens, 6, 256, 40, top_k, fmt)
  y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation="xla"))(x, wn, ids)
  assert y.shape == (tokens, top_k, 40) and y.dtype == jnp.bfloat16
  # The XLA route rounds each weight to bf16 (NVFP4's tensor scale makes them inexact).
  ref = moe_reference(x, w, ids)
  assert rel_err(np.asarray(y.astype(jnp.float32)), ref) < 1e-2
  if fmt == "mxfp4":  # exact weights: only the output's rounding remains
    assert_moe_close(y, ref)


def test_moe_matmul_names_the_formats_it_takes():
  w = qjax.quantize_nvfp4(jnp.ones((3, 64, 32)))  # NVFP4Weight: no MoE path (its NK form has)
  with pytest.raises(NotImplementedError, match="MXFP4NKWeight, NVFP4NKWeight, Int4Weight"):
    qjax.moe_matmul(jnp.ones((2, 64)), w, jnp.zeros((2, 1), jnp.int32))


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="checks the CPU route")
def test_cpu_route_is_xla(request):
  _, _, wn, _ = make_moe(request.node.nodeid, 1, 4, 64, 128, 1)
  assert moe.moe_implementation_name(wn, None, 4) == "xla"


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pairs,experts,k,n", [
    (4, 128, 2880, 2880), (256, 128, 2880, 2880), (256, 128, 2880, 5760), (8, 4, 4096, 1024),
    (16384, 128, 2880, 2880), (6, 5, 512, 128), (6, 8, 256, 320), (40, 32, 7168, 2048)])
def test_moe_config_for_is_legal(fmt, pairs, experts, k, n):
  """Steps divide each split of K, the stages fit in shared memory, and chained tiles
  have stages dividing their steps."""
  cfg = kw.moe_config_for(pairs, experts, k, n, fmt)
  block = kw._FP4_FORMATS[fmt].block_size
  assert k % cfg.split_k == 0 and (k // cfg.split_k) % cfg.tile_k == 0
  steps = k // cfg.split_k // cfg.tile_k
  assert cfg.stages >= 2 and not cfg.scale_accumulator
  assert cfg.stages * cfg.stage_bytes(block, 1) + cfg.epilogue_bytes() <= kw._SMEM_MAX
  if cfg.chain_tiles:
    assert steps % cfg.stages == 0
  if (pairs, k, n) == (256, 2880, 2880):  # what the H100 sweep chose (BENCHMARKS.md)
    assert (cfg.tile_m, cfg.tile_k, cfg.stages, cfg.chain_tiles) == (8, 320, 3, True)


def test_kernel_declines_what_it_lacks(request):
  x, _, wn, ids = make_moe(request.node.nodeid, 2, 4, 256, 128, 2)
  pair_rows = jnp.arange(4, dtype=jnp.int32) // 2
  pairs = ids.reshape(-1)
  with pytest.raises(NotImplementedError, match="interpret"):
    kw.fp4_nk_moe_matmul(x, wn, pair_rows, pairs, interpret=True)
  with pytest.raises(NotImplementedError, match="bf16"):
    kw.fp4_nk_moe_matmul(x.astype(jnp.float32), wn, pair_rows, pairs)
  with pytest.raises(NotImplementedError, match="leading"):
    kw.fp4_nk_moe_matmul(x, jax.tree.map(lambda a: a[0], wn), pair_rows, pairs)
  _, _, narrow, _ = make_moe(request.node.nodeid, 2, 4, 256, 120, 2)
  with pytest.raises(NotImplementedError, match="N=120"):
    kw.fp4_nk_moe_matmul(x, narrow, pair_rows, pairs)
  bad = kw.WgmmaConfig(tile_m=8, tile_k=128, epi_m=8, stages=3, chain_tiles=True)
  with pytest.raises(NotImplementedError, match="chain_tiles needs stages"):
    kw.fp4_nk_moe_matmul(x, wn, pair_rows, pairs, config=bad, num_sms=132)


def lower_for_cuda(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("chain", [False, True])
def test_kernel_lowers_for_cuda_reading_the_stack(request, fmt, chain):
  """The kernel's operands are the whole expert stacks (it indexes the selected experts
  itself, so no gather of their weights runs first), and it lowers for CUDA."""
  experts, k, n = 8, 2880, 2880
  x, _, wn, ids = make_moe(request.node.nodeid, 3, experts, k, n, 2, fmt)
  cfg = dataclasses.replace(kw.moe_config_for(6, experts, k, n, fmt), chain_tiles=chain)
  if not chain:
    cfg = dataclasses.replace(cfg, stages=4)

  def fn(a, b, c):
    return kw.fp4_nk_moe_matmul(a, b, jnp.arange(6, dtype=jnp.int32) // 2, c.reshape(-1),
                                config=cfg, num_sms=132)
  calls = pallas_operand_shapes(jax.make_jaxpr(fn)(x, wn, ids).jaxpr)
  assert calls and all((experts, n, k) in s and (experts, k // wn.block_size, n) in s
                       for s in calls), calls
  assert "mosaic_gpu" in lower_for_cuda(fn, x, wn, ids)


def test_kernel_reads_a_layer_of_expert_stacks_in_place(request):
  layers, experts, k, n = 2, 4, 512, 256
  x, _, stack, ids = make_moe(request.node.nodeid, 3, experts, k, n, 2, lead=(layers,))

  def fn(s, a, c):
    def body(carry, i):
      with stacked.reads_in_place(qjax.layer_of(s, i)) as layer:
        return carry, kw.fp4_nk_moe_matmul(a, layer, jnp.arange(6, dtype=jnp.int32) // 2,
                                           c.reshape(-1), num_sms=132)
    return jax.lax.scan(body, 0, jnp.arange(layers))[1]
  calls = pallas_operand_shapes(jax.make_jaxpr(fn)(stack, x, ids).jaxpr)
  assert calls and all((layers, experts, n, k) in s for s in calls), calls
  assert "mosaic_gpu" in lower_for_cuda(fn, stack, x, ids)


# ---------------------------------------------------------------------------------- GPU


def poisoned_moe_run(fn, x, wn, ids, cfg):
  """Runs ``fn`` right after freeing a NaN buffer of the size of the kernel's output
  (``[split_k, row tiles, tile_m, N]``, or ``[split_k, pairs, 1, N]`` for a row tile per
  pair), so a tile the kernel fails to write reads NaN."""
  pairs = ids.size
  c = cfg or kw.moe_default_config(pairs, wn, jax.devices()[0].core_count)
  tiles = moe.max_row_tiles(pairs, wn.codes.shape[-3], c.tile_m)
  rows = c.tile_m
  if kw.per_pair_route(pairs, wn):  # a row per pair, written in place
    tiles, rows = pairs, 1
  poison = jnp.full((c.split_k, tiles, rows, wn.shape[1]), jnp.nan,
                    jnp.float32 if c.split_k > 1 else jnp.bfloat16)
  poison.block_until_ready()
  poison.delete()
  return fn(x, wn, ids)


GPU_CASES = [  # tokens, experts, k, n, top_k, config overrides
    # Experts of 2880 x 2880 kept to 16 here: the codes are drawn in numpy.
    (1, 12, 2880, 2880, 4, {}), (5, 8, 2880, 2880, 4, {}), (64, 16, 2880, 2880, 4, {}),
    (33, 16, 2880, 2880, 4, {}), (4, 8, 2880, 5760, 2, {}), (3, 8, 256, 320, 2, {}),
    (7, 5, 512, 128, 3, {}), (40, 4, 1024, 384, 2, {}),
    (9, 8, 2880, 2880, 4, dict(tile_k=64, split_k=1, stages=4, chain_tiles=False)),
    (9, 8, 2880, 2880, 4, dict(tile_k=192, split_k=3, stages=5, chain_tiles=True)),
    (9, 8, 2880, 2880, 4, dict(tile_k=576, split_k=1, stages=3, chain_tiles=False)),
    (20, 8, 2880, 2880, 4, dict(tile_m=16, epi_m=16, tile_k=192, split_k=5, stages=3)),
    (2, 16, 2880, 2880, 4, dict(tile_k=64, split_k=1, stages=9, chain_tiles=True)),
    (8, 3, 512, 256, 2, {}),  # 16 pairs, one row tile each, experts repeated
]


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tokens,experts,k,n,top_k,over", GPU_CASES)
def test_wgmma_moe_matches_float64(request, fmt, tokens, experts, k, n, top_k, over):
  x, w, wn, ids = make_moe(request.node.nodeid, tokens, experts, k, n, top_k, fmt)
  cfg = None
  if over:
    cfg = dataclasses.replace(kw.moe_config_for(tokens * top_k, experts, k, n, fmt), **over)

  def fn(a, b, c):
    if cfg is None:
      return qjax.moe_matmul(a, b, c, implementation=WGMMA)
    pair_rows = jnp.arange(c.size, dtype=jnp.int32) // c.shape[1]
    return kw.fp4_nk_moe_matmul(a, b, pair_rows, c.reshape(-1), config=cfg).reshape(
        *c.shape, -1)
  y = poisoned_moe_run(jax.jit(fn), x, wn, ids, cfg)
  assert_moe_close(y, moe_reference(x, w, ids))


def force_route(monkeypatch, route):
  """Makes fp4_nk_moe_matmul take ``route``: "per_pair" (a row tile per pair), "slots"
  (grouped tiles from moe.tile_slots) or "sort" (grouped tiles from group_by_expert)."""
  monkeypatch.setattr(kw, "per_pair_route", lambda pairs, w: route == "per_pair")
  monkeypatch.setattr(moe, "TILE_SLOTS_MAX_COMPARISONS", 1 << 40 if route == "slots" else 0)


ROUTES = ["per_pair", "slots", "sort"]


@pytest.mark.parametrize("route", ROUTES)
def test_each_route_lowers_for_cuda(request, monkeypatch, route):
  force_route(monkeypatch, route)
  experts, k, n = 8, 512, 256
  x, _, wn, ids = make_moe(request.node.nodeid, 20, experts, k, n, 2)

  def fn(a, b, c):
    return kw.fp4_nk_moe_matmul(a, b, jnp.arange(40, dtype=jnp.int32) // 2, c.reshape(-1),
                                num_sms=132)
  text = lower_for_cuda(fn, x, wn, ids)
  assert "mosaic_gpu" in text
  assert ("stablehlo.sort" in text) == (route == "sort")
  calls = pallas_operand_shapes(jax.make_jaxpr(fn)(x, wn, ids).jaxpr)
  if route == "per_pair":  # the kernel reads the rows as they are: no gathered row tiles
    assert calls and all((20, 1, k) in shapes for shapes in calls), calls


@pytest.mark.parametrize("fmt", FMTS)
def test_one_row_is_handed_no_row_table(request, fmt):
  """One token's pairs all multiply row 0: the per-pair route hands the kernel x as
  ``[1, 1, K]`` and the experts alone, not a table of rows (all zero, which XLA would
  materialize by a broadcast kernel before the call); more rows do get the table."""
  experts, k, n, top_k = 6, 512, 256, 4  # experts != pairs: NVFP4's [E] tensor scales
  for tokens in (1, 2):
    x, _, wn, ids = make_moe(f"{request.node.nodeid}/{tokens}", tokens, experts, k, n, top_k,
                             fmt)
    pairs = tokens * top_k

    def fn(a, b, c):
      return kw.fp4_nk_moe_matmul(a, b, jnp.arange(pairs, dtype=jnp.int32) // top_k,
                                  c.reshape(-1), num_sms=132)
    calls = pallas_operand_shapes(jax.make_jaxpr(fn)(x, wn, ids).jaxpr)
    assert len(calls) == 1, calls
    assert (tokens, 1, k) in calls[0], calls
    assert calls[0].count((pairs,)) == (1 if tokens == 1 else 2), calls
    assert "mosaic_gpu" in lower_for_cuda(fn, x, wn, ids)


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("route", ROUTES)
def test_wgmma_moe_every_route(request, monkeypatch, route):
  """The same calls with a row tile per pair, and grouped by expert with either table."""
  force_route(monkeypatch, route)
  for tokens, experts, top_k in [(1, 8, 4), (3, 4, 2), (12, 6, 3)]:
    x, w, wn, ids = make_moe(f"{request.node.nodeid}/{tokens}", tokens, experts, 1024, 384,
                             top_k)
    y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=WGMMA))(x, wn, ids)
    assert_moe_close(y, moe_reference(x, w, ids))


@needs_gpu
@needs_hopper
def test_wgmma_moe_is_the_default_and_takes_rows_per_expert(request):
  """On Hopper, moe_matmul of an NK stack picks the wgmma kernel; x of one row per
  (token, selected expert), as an MoE MLP's down projection passes it."""
  x, w, wn, ids = make_moe(request.node.nodeid, 6, 16, 512, 256, 2)
  assert moe.moe_implementation_name(wn, None, 12) == "mosaic_gpu_wgmma"
  rows = jax.random.normal(jax.random.key(seed_from(request.node.nodeid)), (6, 2, 512),
                           jnp.float32).astype(jnp.bfloat16)
  y = jax.jit(qjax.moe_matmul)(rows, wn, ids)
  wd = weight_f64(w)[np.asarray(ids)]                           # [T, top_k, K, N]
  ref = np.einsum("tjk,tjkn->tjn", np.asarray(rows.astype(jnp.float32), np.float64), wd)
  assert_moe_close(y, ref)


@needs_gpu
@needs_hopper
def test_wgmma_moe_layer_of(request):
  layers = 2
  x, w, stack, ids = make_moe(request.node.nodeid, 5, 8, 1024, 256, 2, lead=(layers,))

  def fn(s, a, c):
    return jax.lax.scan(lambda carry, i: (carry, qjax.moe_matmul(
        a, qjax.layer_of(s, i), c, implementation=WGMMA)), 0, jnp.arange(layers))[1]
  got = jax.jit(fn)(stack, x, ids)
  for i in range(layers):
    assert_moe_close(got[i], moe_reference(x, jax.tree.map(lambda a, i=i: a[i], w), ids))


def _moe_block_both_layouts(implementation):
  """flax_layers.MXFP4MoE applied with its MXFP4Weight params and with the same experts
  converted to MXFP4NKWeight (``qjax.to_mxfp4_nk``)."""
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  layer = MXFP4MoE(num_experts=8, top_k=2, intermediate_size=128, activation="gpt_oss",
                   implementation=implementation)
  x = jax.random.normal(jax.random.key(7), (5, 256), jnp.float32).astype(jnp.bfloat16)
  params = layer.init(jax.random.key(8), x)
  nk = jax.tree.map(lambda a: a, params)
  nk["params"] = dict(params["params"], **{
      name: qjax.to_mxfp4_nk(params["params"][name]) for name in ("gate_up", "down")})
  y_row = jax.jit(layer.apply)(params, x)
  y_nk = jax.jit(layer.apply)(nk, x)
  return np.asarray(y_row.astype(jnp.float32)), np.asarray(y_nk.astype(jnp.float32))


def test_moe_block_takes_nk_experts_xla():
  y_row, y_nk = _moe_block_both_layouts("xla")
  assert np.isfinite(y_nk).all()
  np.testing.assert_array_equal(y_nk, y_row)  # the same weights, the same XLA route


@needs_gpu
@needs_hopper
def test_moe_block_takes_nk_experts_on_hopper():
  """Default routes: the Triton MoE kernels for MXFP4Weight, wgmma for the NK form."""
  y_row, y_nk = _moe_block_both_layouts(None)
  assert rel_err(y_nk, y_row) < 1e-2


def test_decode_configs_example_lowers_each_config():
  """examples/moe_decode_configs.py: every configuration it times passes the kernel's
  checks and lowers for CUDA at one token of GPT-OSS-sized experts; on a machine without
  Hopper it refuses with exit code 2, naming what it needs."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).parent.parent / "examples" / "moe_decode_configs.py"
  spec = importlib.util.spec_from_file_location("moe_decode_configs", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  experts, k, n, top_k = 4, 2880, 2880, 4
  x, _, wn, ids = make_moe("decode_configs", 1, experts, k, n, top_k)
  variants = mod._variants(kw.moe_config_for(top_k, experts, k, n, "mxfp4"))  # pylint: disable=protected-access
  assert list(variants)[0] == "default" and len(set(variants.values())) == len(variants)
  for name, cfg in variants.items():
    fn = lambda a, b, c, cfg=cfg: kw.fp4_nk_moe_matmul(
        a, b, jnp.zeros((top_k,), jnp.int32), c.reshape(-1), config=cfg, num_sms=132)
    assert "mosaic_gpu" in lower_for_cuda(fn, x, wn, ids), name
  if not kw.supported(jax.devices()[0]):
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=child_env(),
                          timeout=120)
    assert proc.returncode == 2 and "Hopper" in proc.stderr, proc.stderr


def _ids_out_of_range(ids, experts):
  """ids with three pairs out of ``[0, E)`` (-1, E, E + 3), and the mask of those."""
  ids = np.array(ids)
  ids[0, -1], ids[-1, 0], ids[len(ids) // 2, 0] = -1, experts, experts + 3
  return jnp.asarray(ids), (ids < 0) | (ids >= experts)


def _assert_nan_rows_only(y, x, w, ids, invalid, exact_weights=True):
  """NaN rows exactly at the invalid pairs, every other pair its own expert's product
  (within the output's rounding; 1e-2 where the route rounds weights to bf16)."""
  y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
  assert np.isnan(y[invalid]).all() and np.isfinite(y[~invalid]).all()
  ref = moe_reference(x, w, np.where(invalid, 0, np.asarray(ids)))
  if exact_weights:
    assert_each_output_close(y[~invalid], ref[~invalid])
  else:
    assert rel_err(y[~invalid], ref[~invalid]) < 1e-2


@pytest.mark.parametrize("fmt", FMTS)
def test_xla_route_ids_out_of_range(request, fmt):
  """Traced ids out of range: NaN rows for those pairs only (moe.checked_experts)."""
  x, w, wn, ids = make_moe(request.node.nodeid, 5, 6, 256, 40, 3, fmt)
  ids, invalid = _ids_out_of_range(ids, 6)
  y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation="xla"))(x, wn, ids)
  # As test_xla_route_matches_float64: NVFP4's tensor scale makes bf16 weights inexact.
  _assert_nan_rows_only(y, x, w, ids, invalid, exact_weights=fmt == "mxfp4")


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fmt", FMTS)
def test_wgmma_moe_ids_out_of_range(request, monkeypatch, route, fmt):
  """Every wgmma route: a traced id out of range reads no memory outside the stack (the
  per-pair kernel clamps it, the grouped routes group the clamped id) and gives that pair
  a NaN row; the other pairs are unaffected."""
  force_route(monkeypatch, route)
  for tokens, experts, top_k in [(1, 8, 4), (3, 4, 2), (12, 6, 3)]:
    x, w, wn, ids = make_moe(f"{request.node.nodeid}/{tokens}", tokens, experts, 1024, 384,
                             top_k, fmt)
    ids, invalid = _ids_out_of_range(ids, experts)
    y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=WGMMA))(x, wn, ids)
    _assert_nan_rows_only(y, x, w, ids, invalid)
