"""``qjax.moe_matmul`` of Int4NKWeight expert stacks (GPTQ / AWQ / compressed-tensors experts
after ``qjax.to_int4_nk``) and Hopper's grouped wgmma kernel for them
(``pallas_kernels.int4_wgmma.int4_nk_moe_matmul``).

The reference is test_int4_moe's: each selected expert decoded from the Int4Weight's stored
arrays in float64 numpy (``(q - z) * s``), never through qjax; experts no pair selects have
NaN scales, so a kernel that read one would show; every code word is random.

CPU: the XLA route against that reference (symmetric and zero points, bf16 and f16
scales); the kernel's default configurations are legal for the shapes of real MoE models;
it declines what it lacks, naming it; it lowers for CUDA on each route, handed the whole
stacks (codes, scales and zero points indexed in the kernel); ``qjax.kernel_layouts``
converts INT4 expert stacks for it on a stand-in Hopper. GPU (Hopper): the compiled kernel
against the reference, output poisoned first, on per-pair and grouped routes, K splits,
chained and unchained tiles, mma.sync / scales on the accumulator / scales on the weights,
group sizes 64 / 128 / 256, odd N, ids out of range, and ``qjax.layer_of``.
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
from tests.conftest import needs_gpu, pallas_operand_shapes, seed_from
from tests.test_int4_moe import check, make_experts, make_rows, nan_unselected, random_ids
from tests.test_int4_nk import needs_hopper
from tests.test_kernel_layouts import HOPPER
from tests.test_moe_nk import ROUTES, force_route, lower_for_cuda, poisoned_moe_run

WGMMA = "pallas:mosaic_gpu_wgmma"


def make_case(name, tokens, experts, top_k, k, n, *, group=128, form="sym",
              scale_dtype=jnp.bfloat16, lead=()):
  """rows ``[T, K]`` bf16, ids ``[T, top_k]``, the Int4Weight experts (NaN scales where no
  pair selects them) and their Int4NKWeight form; ``lead``: a stack of such stacks."""
  rng = np.random.default_rng(seed_from(name))
  ids = random_ids(rng, tokens, experts, top_k)
  stacks = [nan_unselected(make_experts(rng, experts, k, n, group=group, form=form,
                                        scale_dtype=scale_dtype), ids.reshape(-1))
            for _ in range(int(np.prod(lead)))]
  w = stacks[0] if not lead else jax.tree.map(
      lambda *a: jnp.stack(a).reshape(*lead, *a[0].shape), *stacks)
  return make_rows(rng, tokens, k, jnp.bfloat16), jnp.asarray(ids), w, qjax.to_int4_nk(w)


def pair_args(tokens, top_k, ids):
  """moe_matmul's canonical form of rows ``[T, K]``: each pair's row, each pair's expert."""
  return jnp.arange(tokens * top_k, dtype=jnp.int32) // top_k, ids.reshape(-1)


def check_pairs(y, x, w, ids):
  """``y [T, top_k, N]`` (or ``[P, N]``) against the float64 reference of every pair."""
  t, top_k = ids.shape
  pair_rows, pair_experts = pair_args(t, top_k, ids)
  return check(jnp.asarray(y).reshape(t * top_k, -1), x, w, pair_rows, pair_experts,
               jnp.bfloat16)


# ---------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("form,scale_dtype", [("sym", jnp.bfloat16), ("zeros", jnp.float16),
                                              ("zeros", jnp.bfloat16)])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 6, 2), (5, 4, 3), (9, 3, 1)])
def test_xla_route_matches_float64(request, form, scale_dtype, tokens, experts, top_k):
  x, ids, w, wn = make_case(request.node.nodeid, tokens, experts, top_k, 256, 40,
                            group=64, form=form, scale_dtype=scale_dtype)
  assert moe.takes_format(wn) and qjax.Int4NKWeight in moe.MOE_FORMATS
  y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation="xla"))(x, wn, ids)
  assert y.shape == (tokens, top_k, 40) and y.dtype == jnp.bfloat16
  check_pairs(y, x, w, ids)


# Real models' expert shapes (K, N, group): Qwen3-30B-A3B's gate / up and down (2048 x 768,
# 768 x 2048), Mixtral's (4096 x 14336, 14336 x 4096), DeepSeek-V2-Lite's (2048 x 1408),
# and small ones.
MODEL_SHAPES = [(2048, 768, 128), (768, 2048, 128), (4096, 14336, 128), (14336, 4096, 128),
                (2048, 1408, 64), (1024, 384, 256), (512, 128, 128)]


@pytest.mark.parametrize("k,n,group", MODEL_SHAPES)
@pytest.mark.parametrize("zeros,scale_dtype", [(False, jnp.bfloat16), (True, jnp.float16)])
@pytest.mark.parametrize("pairs", [1, 8, 32, 33, 256, 2048, 16384])
def test_default_config_is_legal(k, n, group, zeros, scale_dtype, pairs):
  """What the kernel checks per expert holds, the stages fit in shared memory, chained
  tiles have stages dividing their steps, and nothing is declined for these weights."""
  w = kw.abstract_weight(k, n, group_size=group, zero_points=zeros, scale_dtype=scale_dtype)
  stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct((64, *a.shape), a.dtype), w)
  cfg = kw.moe_default_config(pairs, stack)
  kw._check_steps(w, cfg)  # pylint: disable=protected-access
  smem = cfg.stages * cfg.stage_bytes(*kw._scale_args(w)) + cfg.epilogue_bytes()  # pylint: disable=protected-access
  assert cfg.stages >= 2 and smem <= kw._SMEM_MAX  # pylint: disable=protected-access
  if cfg.chain_tiles:
    assert (k // cfg.split_k // cfg.tile_k) % cfg.stages == 0
  assert cfg.mma_sync == (cfg.tile_m == 8) and (not cfg.mma_sync or cfg.scale_accumulator)
  assert kw.moe_declines(stack, jnp.bfloat16) is None


# H200 (docs/experiments/s46_per_pair.py): format, experts, K, N, pairs, whether the row
# tile per pair was the faster route (by more than 3 %).
MEASURED_ROUTES = [
    ("mxfp4", 128, 2880, 2880, 16, True), ("mxfp4", 128, 2880, 2880, 32, True),
    ("mxfp4", 128, 2880, 2880, 128, False), ("mxfp4", 32, 2880, 2880, 16, True),
    ("mxfp4", 32, 2880, 2880, 64, False), ("int4", 128, 2048, 768, 32, True),
    ("int4", 128, 2048, 768, 64, True), ("int4", 128, 2048, 768, 128, True),
    ("int4", 128, 2048, 768, 512, False), ("int4", 128, 768, 2048, 128, True),
    ("int4", 128, 768, 2048, 256, False), ("int4", 8, 4096, 14336, 16, False),
    ("int4", 8, 4096, 14336, 32, False)]


@pytest.mark.parametrize("fmt,experts,k,n,pairs,want", MEASURED_ROUTES)
def test_per_pair_route_takes_the_measured_faster_route(fmt, experts, k, n, pairs, want):
  w = kw.abstract_weight(k, n, fp4=None if fmt == "int4" else fmt)
  stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct((experts, *a.shape), a.dtype), w)
  assert kw.per_pair_route(pairs, stack) == want
  layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct((3, *a.shape), a.dtype), stack)
  assert kw.per_pair_route(pairs, layers) == want  # a stack of expert stacks: the same


def test_kernel_declines_what_it_lacks(request):
  x, ids, _, wn = make_case(request.node.nodeid, 2, 4, 2, 256, 128)
  pair_rows, pairs = pair_args(2, 2, ids)
  with pytest.raises(NotImplementedError, match="interpret"):
    kw.int4_nk_moe_matmul(x, wn, pair_rows, pairs, interpret=True)
  with pytest.raises(NotImplementedError, match="bf16"):
    kw.int4_nk_moe_matmul(x.astype(jnp.float16), wn, pair_rows, pairs)
  with pytest.raises(NotImplementedError, match="leading expert axis"):
    kw.int4_nk_moe_matmul(x, jax.tree.map(lambda a: a[0], wn), pair_rows, pairs)
  with pytest.raises(NotImplementedError, match="takes an Int4NKWeight expert stack"):
    kw.int4_nk_moe_matmul(x, qjax.to_mxfp4_nk(qjax.quantize_mxfp4(jnp.ones((4, 256, 128)))),
                          pair_rows, pairs)
  with pytest.raises(NotImplementedError, match="int4_nk_moe_matmul takes Int4NKWeight"):
    kw.fp4_nk_moe_matmul(x, wn, pair_rows, pairs)
  for (k, n, group, scale_dtype), match in [
      ((256, 120, 128, jnp.bfloat16), "N=120"),
      ((256, 128, 32, jnp.bfloat16), "group_size=32"),  # GGUF Q4_0's blocks
      ((256, 128, 128, jnp.float32), "scales of dtype float32")]:
    _, _, _, bad = make_case(f"{request.node.nodeid}/{n}/{group}", 2, 4, 2, k, n, group=group,
                             scale_dtype=scale_dtype)
    with pytest.raises(NotImplementedError, match=match):
      kw.int4_nk_moe_matmul(x, bad, pair_rows, pairs)
    assert match in kw.moe_declines(bad, jnp.bfloat16)
  assert kw.moe_declines(wn, jnp.bfloat16) is None
  assert "float32" in kw.moe_declines(wn, jnp.float32)
  bad_cfg = kw.WgmmaConfig(tile_m=8, tile_k=192, epi_m=8, stages=2, scale_accumulator=True,
                           mma_sync=True)
  with pytest.raises(NotImplementedError, match="powers of two"):
    kw.int4_nk_moe_matmul(x, wn, pair_rows, pairs, config=bad_cfg, num_sms=132)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("form,scale_dtype", [("sym", jnp.bfloat16), ("zeros", jnp.float16)])
def test_kernel_lowers_for_cuda_reading_the_stacks(request, monkeypatch, route, form,
                                                   scale_dtype):
  """On each route the kernel is handed the whole stacks of codes, scales and zero points
  (no gather of the selected experts' weights runs first), and lowers for CUDA."""
  force_route(monkeypatch, route)
  tokens, experts, top_k, k, n = 20, 8, 2, 512, 256
  x, ids, _, wn = make_case(request.node.nodeid, tokens, experts, top_k, k, n, form=form,
                            scale_dtype=scale_dtype)

  def fn(a, b, c):
    return kw.int4_nk_moe_matmul(a, b, *pair_args(tokens, top_k, c), num_sms=132)
  calls = pallas_operand_shapes(jax.make_jaxpr(fn)(x, wn, ids).jaxpr)
  stacks = [(experts, n, k), (experts, k // 128, n)]
  assert calls and all(all(s in shapes for s in stacks) for shapes in calls), calls
  if form == "zeros":
    assert all(shapes.count((experts, k // 128, n)) == 2 for shapes in calls), calls
  text = lower_for_cuda(fn, x, wn, ids)
  assert "mosaic_gpu" in text
  assert ("stablehlo.sort" in text) == (route == "sort")


def test_kernel_lowers_a_layer_of_expert_stacks_in_place(request):
  layers, experts, k, n = 2, 4, 512, 256
  x, ids, _, stack = make_case(request.node.nodeid, 3, experts, 2, k, n, form="zeros",
                               lead=(layers,))

  def fn(s, a, c):
    def body(carry, i):
      with stacked.reads_in_place(qjax.layer_of(s, i)) as layer:
        return carry, kw.int4_nk_moe_matmul(a, layer, *pair_args(3, 2, c), num_sms=132)
    return jax.lax.scan(body, 0, jnp.arange(layers))[1]
  calls = pallas_operand_shapes(jax.make_jaxpr(fn)(stack, x, ids).jaxpr)
  assert calls and all((layers, experts, n, k) in s and
                       s.count((layers, experts, k // 128, n)) == 2 for s in calls), calls
  assert "mosaic_gpu" in lower_for_cuda(fn, stack, x, ids)


def test_kernel_layouts_converts_int4_expert_stacks_on_hopper(request):
  """GPTQ / AWQ-style expert stacks (groups of 128, zero points, f16 scales) become
  Int4NKWeight for the MoE kernel, bit-exact; GGUF Q4_0-style groups of 32 stay."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  awq = make_experts(rng, 4, 256, 144, form="zeros", scale_dtype=jnp.float16)
  q4_0 = make_experts(rng, 4, 256, 128, group=32)
  tree = {"moe": {"gate_up": awq, "down": q4_0}}
  new, report = qjax.kernel_layouts(tree, device=HOPPER, experts=lambda p: p.startswith("moe/"),
                                    with_report=True)
  assert type(new["moe"]["gate_up"]) is qjax.Int4NKWeight
  np.testing.assert_array_equal(np.asarray(new["moe"]["gate_up"].dequantize()),
                                np.asarray(awq.dequantize()))
  assert new["moe"]["down"] is q4_0
  assert "group_size=32" in next(c.reason for c in report if c.path == "moe/down")
  # Not named as experts: checked against the dense kernel, which declines N = 144.
  assert qjax.kernel_layouts(tree, device=HOPPER)["moe"]["gate_up"] is awq


def test_generate_converts_int4_expert_stacks_on_hopper(request):
  """``qjax generate``'s ``moe_kernel_layouts`` (after an HF folder's GPTQ / AWQ experts
  load as Int4Weight stacks ``[layers, E, ...]``): on a stand-in Hopper the stacks the
  wgmma MoE kernel takes become Int4NKWeight, bit-exact; groups of 32 stay; weights
  outside ``moe`` stay even where a kernel would take their NK form; on a device without
  the wgmma kernel nothing changes."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(request.node.nodeid))

  def layers(**kw_args):
    return jax.tree.map(lambda *a: jnp.stack(a), *[make_experts(rng, 4, 256, 128, **kw_args)
                                                   for _ in range(2)])
  gate, down = layers(form="zeros", scale_dtype=jnp.float16), layers(group=32)
  attn = qjax.quantize(jnp.asarray(rng.standard_normal((256, 128)), jnp.float32))
  router = jnp.ones((2, 256, 4))
  params = {"params": {"blocks": {"attn": {"q": attn}, "moe": {
      "router": router, "gate": gate, "down": down}}}}
  assert generate.moe_kernel_layouts(params, jnp.bfloat16) is params
  if not kw.supported(jax.devices()[0]):  # no MoE kernel's layout changes here
    assert params["params"]["blocks"]["moe"]["gate"] is gate
  generate.moe_kernel_layouts(params, jnp.bfloat16, device=HOPPER)
  moe_params = params["params"]["blocks"]["moe"]
  assert type(moe_params["gate"]) is qjax.Int4NKWeight
  assert moe_params["gate"].codes.shape == (2, 4, 128, 32)
  np.testing.assert_array_equal(np.asarray(moe_params["gate"].dequantize()),
                                np.asarray(gate.dequantize()))
  assert moe_params["down"] is down and moe_params["router"] is router
  assert params["params"]["blocks"]["attn"]["q"] is attn
  # float32 activations: every layout runs XLA, nothing converts
  params["params"]["blocks"]["moe"]["gate"] = gate
  generate.moe_kernel_layouts(params, jnp.float32, device=HOPPER)
  assert params["params"]["blocks"]["moe"]["gate"] is gate


# ---------------------------------------------------------------------------------- GPU

GPU_CASES = [  # tokens, experts, top_k, K, N, group, form, scale dtype, config overrides
    (1, 128, 8, 2048, 768, 128, "sym", jnp.bfloat16, {}),  # Qwen3-30B-A3B, one token
    (1, 16, 8, 768, 2048, 128, "zeros", jnp.float16, {}),  # ... its down projection
    (4, 32, 8, 2048, 768, 128, "zeros", jnp.bfloat16, {}),  # 32 pairs: a row tile each
    (5, 16, 8, 2048, 768, 64, "zeros", jnp.float16, {}),   # 40 pairs: grouped
    (64, 16, 8, 1024, 384, 128, "sym", jnp.float16, {}),
    (300, 8, 2, 512, 320, 256, "zeros", jnp.bfloat16, {}),  # N = 320: overlapping tiles
    (256, 16, 8, 1024, 256, 128, "zeros", jnp.float16, {}),  # 2048 pairs
    (40, 8, 2, 4096, 1024, 128, "zeros", jnp.float16, {}),
    (9, 8, 4, 2048, 768, 128, "zeros", jnp.bfloat16,
     dict(tile_k=128, split_k=1, stages=4, chain_tiles=False)),
    (20, 8, 4, 2048, 768, 128, "zeros", jnp.float16,
     dict(tile_m=16, epi_m=16, tile_k=256, split_k=2, stages=2, chain_tiles=True,
          scale_accumulator=True, mma_sync=False)),
    (20, 8, 4, 2048, 768, 64, "zeros", jnp.float16,
     dict(tile_m=16, epi_m=16, tile_k=64, split_k=1, stages=4, chain_tiles=True,
          scale_accumulator=False, mma_sync=False)),
    (8, 3, 2, 512, 256, 128, "zeros", jnp.bfloat16, {}),  # 16 pairs, experts repeated
]


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("tokens,experts,top_k,k,n,group,form,scale_dtype,over", GPU_CASES)
def test_wgmma_moe_matches_float64(request, tokens, experts, top_k, k, n, group, form,
                                   scale_dtype, over):
  x, ids, w, wn = make_case(request.node.nodeid, tokens, experts, top_k, k, n, group=group,
                            form=form, scale_dtype=scale_dtype)
  cfg = None
  if over:
    cfg = dataclasses.replace(kw.moe_default_config(tokens * top_k, wn), **over)

  def fn(a, b, c):
    if cfg is None:
      return qjax.moe_matmul(a, b, c, implementation=WGMMA)
    return kw.int4_nk_moe_matmul(a, b, *pair_args(tokens, top_k, c), config=cfg)
  check_pairs(poisoned_moe_run(jax.jit(fn), x, wn, ids, cfg), x, w, ids)


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("route", ROUTES)
def test_wgmma_moe_every_route(request, monkeypatch, route):
  """The same calls with a row tile per pair, and grouped by expert with either table;
  ids out of range give NaN rows for those pairs only."""
  force_route(monkeypatch, route)
  for tokens, experts, top_k in [(1, 8, 4), (3, 4, 2), (12, 6, 3)]:
    x, ids, w, wn = make_case(f"{request.node.nodeid}/{tokens}", tokens, experts, top_k,
                              1024, 384, form="zeros", scale_dtype=jnp.float16)
    y = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=WGMMA))(x, wn, ids)
    check_pairs(y, x, w, ids)
    bad = np.asarray(ids).copy()
    bad[0, -1] = experts
    y = np.asarray(jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=WGMMA))(
        x, wn, jnp.asarray(bad)).astype(jnp.float32))
    assert np.isnan(y[0, -1]).all()
    mask = np.ones(ids.shape, bool)
    mask[0, -1] = False
    assert np.isfinite(y[mask]).all()


@needs_gpu
@needs_hopper
def test_wgmma_moe_is_the_default_on_hopper(request):
  x, ids, w, wn = make_case(request.node.nodeid, 6, 16, 2, 512, 256, form="zeros")
  assert moe.moe_implementation_name(wn, None, 12) == "mosaic_gpu_wgmma"
  check_pairs(jax.jit(qjax.moe_matmul)(x, wn, ids), x, w, ids)


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("tokens", [2, 40])
def test_wgmma_moe_layer_of(request, tokens):
  layers = 2
  x, ids, w, stack = make_case(request.node.nodeid, tokens, 8, 2, 1024, 256, form="zeros",
                               scale_dtype=jnp.float16, lead=(layers,))

  def fn(s, a, c):
    return jax.lax.scan(lambda carry, i: (carry, qjax.moe_matmul(
        a, qjax.layer_of(s, i), c, implementation=WGMMA)), 0, jnp.arange(layers))[1]
  got = jax.jit(fn)(stack, x, ids)
  for i in range(layers):
    check_pairs(got[i], x, jax.tree.map(lambda a, i=i: a[i], w), ids)
