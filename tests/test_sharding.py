"""Quantized weights split across devices: column-, row- and expert-parallel.

Runs on a mesh of up to 8 CPU devices (tests/conftest.py sets
``--xla_force_host_platform_device_count=8`` before jax starts). Every split product is
checked against the single-device product and against float64 ``x @ W`` with W the
weight's own dequantization; shapes are odd but valid at every mesh size.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import qjax
from conftest import pallas_operand_shapes, rel_err, seed_from
from qjax._src import check
from qjax._src import gguf_formats as gf
from qjax._src import gguf_tiled
from qjax._src import sharding as sharding_lib
from qjax._src import split_rules

MESH_SIZES = (1, 2, 4, 8)
TOL = 1e-5  # float32 activations, float32 accumulation


def _mesh(n: int, name: str = "tp") -> Mesh:
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, has {jax.device_count()} (XLA_FLAGS="
                f"{os.environ.get('XLA_FLAGS')!r})")
  return Mesh(np.array(jax.devices()[:n]), (name,))


def _highest_precision():
  """float32 dots at full precision: on a GPU the interpreted kernels' and the attention's
  dots are one TF32 product by default (1e-4 to 1e-3 off on two H100s, session 32),
  against TOL = 1e-5 here."""
  return jax.default_matmul_precision("highest")


# -- weights ------------------------------------------------------------------------------

_quantize = jax.jit(qjax.quantize, static_argnames=(
    "group_size", "symmetric", "scale_dtype", "method", "tile_k", "name"))
_mxfp4 = jax.jit(qjax.quantize_mxfp4, static_argnames=("tile_k", "name"))
_nvfp4 = jax.jit(qjax.quantize_nvfp4, static_argnames=("tile_k", "name"))
_codebook = jax.jit(qjax.quantize_codebook, static_argnames=(
    "group", "passes", "codebook", "rotation", "seed", "norm_dtype", "offload_pass2", "name"))
_matmul = jax.jit(qjax.matmul, static_argnames=("implementation",))
_moe_matmul = jax.jit(qjax.moe_matmul, static_argnames=("implementation",))
_dequantize = jax.jit(lambda w: w.dequantize())


def _normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)


def gguf_blocks(ggml_type: str, k: int, n: int, seed: int) -> gf.GGUFBlockWeight:
  """Random GGUF blocks (every code and sub-scale bit random) with small f16 scales."""
  raw = check.gguf_blocks(np.random.default_rng(seed), ggml_type, k, n)
  return gf.from_gguf_bytes(raw, ggml_type, (k, n))


# name -> builder(rng). K splits into whole tiles and groups over 8 devices; N is 8 times
# an odd number.
WEIGHTS = {
    "int4-g128": lambda r: _quantize(_normal(r, (1024, 40)), group_size=128),
    "int4-asym-g32-plain-f16": lambda r: _quantize(
        _normal(r, (768, 56)), group_size=32, symmetric=False, tile_k=8,
        scale_dtype=jnp.float16),
    "int4-biases-q4_1": lambda r: gguf_blocks("Q4_1", 1024, 24, 5).to_int4(),
    "int4_nk-g128": lambda r: qjax.to_int4_nk(_quantize(_normal(r, (1024, 40)),
                                                        group_size=128)),
    "mxfp4": lambda r: _mxfp4(_normal(r, (1024, 24))),
    "nvfp4": lambda r: _nvfp4(_normal(r, (1024, 40))),
    "gguf-q4_k-tiled": lambda r: gguf_tiled.GGUFTiledWeight.from_gguf(
        gguf_blocks("Q4_K", 2048, 24, 1)),
    "gguf-q8_0-tiled": lambda r: gguf_tiled.GGUFTiledWeight.from_gguf(
        gguf_blocks("Q8_0", 1024, 40, 2)),
    "gguf-q6_k-blocks": lambda r: gguf_blocks("Q6_K", 2048, 8, 3),
}


@functools.lru_cache(maxsize=None)
def weight_case(name: str):
  """(w, x [3, K] float32, single-device y, float64 reference)."""
  rng = np.random.default_rng(seed_from(name))
  w = WEIGHTS[name](rng)
  x = jnp.asarray(rng.standard_normal((3, w.shape[0])), jnp.float32)
  ref = np.asarray(x, np.float64) @ np.asarray(_dequantize(w), np.float64)
  return w, x, _matmul(x, w), ref


# -- column and row parallel, every format, every mesh size -------------------------------


@pytest.mark.parametrize("n", MESH_SIZES)
@pytest.mark.parametrize("mode", ["column", "row"])
@pytest.mark.parametrize("case", list(WEIGHTS))
def test_split_matmul_matches_single_device(case, mode, n):
  mesh = _mesh(n)
  w, x, single, ref = weight_case(case)
  y = qjax.sharded_matmul(x, w, mesh, "tp", mode)
  assert y.shape == single.shape and y.dtype == x.dtype
  assert rel_err(y, single) < TOL
  assert rel_err(y, ref) < TOL
  if mode == "column" and n > 1:
    assert y.sharding.spec == P(None, "tp")  # each device holds its columns


@pytest.mark.parametrize("case", [*WEIGHTS, "codebook-two-pass"])
def test_ahead_of_time_lower_and_compile(case):
  """``jax.jit(f).lower(w, x).compile()`` (AOT, as used to read a schedule or shard ahead
  of time) on every format: lowering rebuilds the weight from ArgInfo stand-ins, which
  the format's shape checks must let through."""
  if case == "codebook-two-pass":
    w = _codebook(_normal(np.random.default_rng(7), (256, 24)), group=128, passes=2)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, 256)), jnp.float32)
  else:
    w, x, _, _ = weight_case(case)
  single = _matmul(x, w, implementation="xla")
  f = jax.jit(lambda w, x: qjax.matmul(x, w, implementation="xla"))
  compiled = f.lower(w, x).compile()
  y = compiled(w, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(single))


@pytest.mark.parametrize("mode", ["column", "row"])
@pytest.mark.parametrize("case", ["int4-g128", "nvfp4", "gguf-q4_k-tiled", "gguf-q6_k-blocks"])
def test_plain_jit_with_named_shardings(case, mode):
  """GSPMD: qjax.matmul under jax.jit on a weight whose arrays carry NamedShardings."""
  mesh = _mesh(4)
  w, x, single, ref = weight_case(case)
  ws = qjax.shard_weight(w, mesh, "tp", mode)
  assert type(ws) is type(w) and ws.shape == w.shape
  specs = qjax.partition_specs(w, mode, "tp")
  for a, s in zip(jax.tree.leaves(ws), jax.tree.leaves(specs)):
    assert a.sharding == NamedSharding(mesh, s)
  y = _matmul(x, ws)
  assert rel_err(y, single) < TOL and rel_err(y, ref) < TOL


@pytest.mark.parametrize("case,mode", [("int4-g128", "row"), ("gguf-q4_k-tiled", "column"),
                                       ("mxfp4", "row")])
def test_pallas_interpret_under_shard_map(case, mode):
  mesh = _mesh(2)
  w, x, _, ref = weight_case(case)
  with _highest_precision():
    y = qjax.sharded_matmul(x, w, mesh, "tp", mode, implementation="interpret")
  assert rel_err(y, ref) < TOL


def test_bf16_row_parallel_sums_partials_in_float32():
  mesh = _mesh(8)
  w, x, _, ref = weight_case("int4-g128")
  xb = x.astype(jnp.bfloat16)
  ref = np.asarray(xb, np.float64) @ np.asarray(_dequantize(w), np.float64)
  y = qjax.sharded_matmul(xb, w, mesh, "tp", "row")
  assert y.dtype == jnp.bfloat16
  assert rel_err(y, ref) < 1e-2
  assert rel_err(y, _matmul(xb, w)) < 1e-2


def test_explicit_axes_mesh():
  """jax.make_mesh gives Explicit axes in recent jax: inputs are resharded to the specs."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  mesh = jax.make_mesh((4,), ("tp",))
  w, x, single, _ = weight_case("int4-g128")
  for mode in ("column", "row"):
    assert rel_err(qjax.sharded_matmul(x, w, mesh, "tp", mode), single) < TOL


def test_codebook_column_parallel():
  mesh = _mesh(2)
  rng = np.random.default_rng(seed_from("codebook"))
  w = _codebook(_normal(rng, (256, 48)), group=128, passes=2)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
  y = qjax.sharded_matmul(x, w, mesh, "tp", "column")
  assert rel_err(y, _matmul(x, w)) < TOL


def test_place_pass2_moves_a_split_codebook_weights_pass2():
  """qjax.place_pass2 reaches into a ShardedWeight (it left it alone before): pass 2's
  arrays go to pinned host memory with their shardings, pass 1 stays, and the product
  inside shard_map and outside it is still the single-device one; back to the device."""
  mesh = _mesh(2)
  rng = np.random.default_rng(seed_from("codebook-pass2"))
  w = _codebook(_normal(rng, (256, 48)), group=128, passes=2)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
  sw = qjax.ShardedWeight.of(w, mesh, "tp", "column")
  moved = qjax.place_pass2({"w": sw, "b": jnp.ones(3)}, "pinned_host")
  arrays = moved["w"].arrays
  for f, a in arrays.items():
    if a is None:
      continue
    want = "pinned_host" if f in ("codes2", "norms2", "codebook2") else "device"
    assert a.sharding.memory_kind == want, f
    assert a.sharding.spec == sw.arrays[f].sharding.spec, f
  assert moved["b"].sharding.memory_kind == "device"
  single = _matmul(x, w)
  assert rel_err(qjax.sharded_matmul(x, moved["w"], mesh, "tp"), single) < TOL
  assert rel_err(jax.jit(lambda x, w: qjax.matmul(x, w))(x, moved["w"]), single) < TOL
  back = qjax.place_pass2(moved, "device")["w"]
  assert {a.sharding.memory_kind for a in back.arrays.values() if a is not None} == {"device"}
  one_pass = qjax.ShardedWeight.of(_codebook(_normal(rng, (256, 48)), group=128), mesh, "tp",
                                   "column")
  assert qjax.place_pass2(one_pass, "pinned_host") is one_pass


# -- the wrapper ----------------------------------------------------------------------------


def test_sharded_weight_local_and_global_views():
  mesh = _mesh(4)
  w, x, single, _ = weight_case("int4-g128")
  sw = qjax.ShardedWeight.of(w, mesh, "tp", "row")
  assert not sw.is_local and sw.shape == (1024, 40) == sw.global_shape
  assert sw.arrays["codes"].sharding.spec == P("tp", None)
  # Each device holds only its tiles: [Kp // 8 / 4, N].
  assert {s.data.shape for s in sw.arrays["codes"].addressable_shards} == {(32, 40)}
  assert sw.partition_specs().arrays == {"codes": P("tp", None), "scales": P("tp", None),
                                         "zeros": None, "biases": None}
  # Outside shard_map, qjax.matmul uses the global weight (under jit: GSPMD).
  assert rel_err(_matmul(x, sw), single) < TOL
  seen = {}

  def body(x, sw):
    seen["local"], seen["shape"] = sw.is_local, sw.shape
    seen["local_weight"] = sw.local()
    return qjax.matmul(x, sw)  # psum inside

  fn = sharding_lib.shard_map(body, mesh, in_specs=(P(None, "tp"), sw.partition_specs()),
                              out_specs=P())
  y = jax.jit(fn)(x, sw)
  assert seen["local"] and seen["shape"] == (256, 40)
  assert isinstance(seen["local_weight"], qjax.Int4Weight)
  assert rel_err(y, single) < TOL


def test_stacked_layers_split_under_scan():
  """Leading [layers] axes stay whole; lax.scan slices a ShardedWeight like any pytree."""
  mesh = _mesh(4)
  rng = np.random.default_rng(seed_from("stacked"))
  ws = [_quantize(_normal(rng, (512, 512)), group_size=64) for _ in range(3)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
  col = qjax.ShardedWeight.of(stacked, mesh, "tp", "column")
  row = qjax.ShardedWeight.of(stacked, mesh, "tp", "row")
  assert col.arrays["codes"].sharding.spec == P(None, None, "tp")
  assert row.arrays["codes"].sharding.spec == P(None, "tp", None)

  def body(x, col, row):
    def layer(h, ws):
      c, r = ws
      return jnp.tanh(qjax.matmul(jnp.tanh(qjax.matmul(h, c)), r)), None
    return jax.lax.scan(layer, x, (col, row))[0]

  fn = sharding_lib.shard_map(body, mesh, in_specs=(P(), col.partition_specs(),
                                                    row.partition_specs()), out_specs=P())
  y = jax.jit(fn)(x, col, row)
  h = x
  for w in ws:
    h = jnp.tanh(_matmul(jnp.tanh(_matmul(h, w)), w))
  assert rel_err(y, h) < TOL


# -- expert parallel ----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def moe_case():
  rng = np.random.default_rng(seed_from("moe"))
  e, k, n, t, top_k = 8, 256, 40, 5, 2
  w = _mxfp4(_normal(rng, (e, k, n)))
  x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, e, (t, top_k)), jnp.int32)
  wd = np.asarray(jax.jit(jax.vmap(lambda w: w.dequantize()))(w), np.float64)  # [E, K, N]
  ref = np.einsum("tk,tjkn->tjn", np.asarray(x, np.float64), wd[np.asarray(ids)])
  return w, x, ids, ref


@pytest.mark.parametrize("n", MESH_SIZES)
def test_expert_parallel_moe_matmul(n):
  mesh = _mesh(n, "ep")
  w, x, ids, ref = moe_case()
  single = _moe_matmul(x, w, ids, implementation="xla")
  y = qjax.sharded_moe_matmul(x, w, ids, mesh, "ep", "expert")
  assert y.shape == single.shape
  assert rel_err(y, single) < TOL and rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode", ["expert", "column", "row"])
def test_sharded_moe_ids_out_of_range_give_nan_rows(mode):
  """Traced ids outside [0, E) (under jax.jit) give those pairs NaN rows, as unsharded;
  in expert mode such an id belongs to no device (it used to sum to 0). Concrete ones
  raise, as moe_matmul's do (tests/test_moe_audit.py)."""
  mesh = _mesh(2, "ep")
  w, x, ids, ref = moe_case()
  bad = np.array(ids)
  bad[0, 1], bad[3, 0], bad[4, 1] = -1, 8, 11
  invalid = (bad < 0) | (bad >= 8)
  run = jax.jit(lambda ids_: qjax.sharded_moe_matmul(x, w, ids_, mesh, "ep", mode,
                                                     implementation="xla"))
  y = np.asarray(run(jnp.asarray(bad)), np.float64)
  assert np.isnan(y[invalid]).all() and np.isfinite(y[~invalid]).all()
  wd = np.asarray(jax.jit(jax.vmap(lambda w: w.dequantize()))(w), np.float64)
  want = np.einsum("tk,tjkn->tjn", np.asarray(x, np.float64), wd[np.where(invalid, 0, bad)])
  assert rel_err(y[~invalid], want[~invalid]) < TOL


@pytest.mark.parametrize("mode", ["column", "row"])
def test_moe_experts_split_by_columns_or_rows(mode):
  mesh = _mesh(2)
  w, x, ids, ref = moe_case()
  y = qjax.sharded_moe_matmul(x, w, ids, mesh, "tp", mode)
  assert rel_err(y, ref) < TOL
  # One row per selected expert (the down projection's input).
  x3 = jnp.broadcast_to(x[:, None], (*ids.shape, x.shape[-1]))
  assert rel_err(qjax.sharded_moe_matmul(x3, w, ids, mesh, "tp", mode), ref) < TOL


def test_expert_parallel_pallas_interpret():
  mesh = _mesh(2, "ep")
  w, x, ids, ref = moe_case()
  y = qjax.sharded_moe_matmul(x, w, ids, mesh, "ep", "expert", implementation="interpret")
  assert rel_err(y, ref) < TOL


def test_moe_layer_expert_parallel():
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  mesh = _mesh(4, "ep")
  rng = np.random.default_rng(seed_from("moe-layer"))
  layer = MXFP4MoE(num_experts=8, top_k=2, intermediate_size=64, use_bias=True,
                   implementation="xla")
  x = jnp.asarray(rng.standard_normal((6, 128)), jnp.float32)
  params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
  params["gate_up_bias"] = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
  single = jax.jit(lambda p, x: layer.apply({"params": p}, x))(params, x)
  sharded = dict(params)
  for name in ("gate_up", "down"):
    sharded[name] = qjax.ShardedWeight.of(params[name], mesh, "ep", "expert")
  specs = {k: v.partition_specs() if isinstance(v, qjax.ShardedWeight) else P()
           for k, v in sharded.items()}
  fn = sharding_lib.shard_map(lambda p, x: layer.apply({"params": p}, x), mesh,
                              in_specs=(specs, P()), out_specs=P())
  y = jax.jit(fn)(sharded, x)
  assert rel_err(y, single) < TOL


def test_moe_layers_expert_parallel_scanned_read_the_stack_in_place():
  """Two devices, two MXFP4MoE layers run by flax_layers.scan_layers over expert-split
  stacked weights: equal to the single-device layers, and the kernels (interpret mode) take
  each device's slice of the stack rather than a per-layer copy."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax_layers import MXFP4MoE, scan_layers  # pylint: disable=g-import-not-at-top
  mesh = _mesh(2, "ep")

  class Layer(nn.Module):

    @nn.compact
    def __call__(self, h, _):
      moe = MXFP4MoE(num_experts=8, top_k=2, intermediate_size=64,
                     implementation="interpret", name="moe")
      return h + moe(h), None

  x = jnp.asarray(np.random.default_rng(seed_from("moe-scan")).standard_normal((6, 128)),
                  jnp.float32)
  per_layer = [Layer().init(jax.random.key(i), x, None)["params"] for i in range(2)]
  want = x
  for p in per_layer:
    want = Layer().apply({"params": p}, want, None)[0]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
  sharded = {"moe": {name: (qjax.ShardedWeight.of(v, mesh, "ep", "expert")
                            if name in ("gate_up", "down") else v)
                     for name, v in stacked["moe"].items()}}
  assert qjax.moe_implementation_name(sharded["moe"]["down"],
                                     "interpret") == "pallas_triton-interpret"
  is_split = lambda v: isinstance(v, qjax.ShardedWeight)
  specs = jax.tree.map(lambda v: v.partition_specs() if is_split(v) else P(), sharded,
                       is_leaf=is_split)
  fn = sharding_lib.shard_map(lambda p, x: scan_layers(Layer(), p, x, None)[0], mesh,
                              in_specs=(specs, P()), out_specs=P())
  assert rel_err(jax.jit(fn)(sharded, x), want) < TOL
  local = {tuple(sharded["moe"][n].arrays["codes"].sharding.shard_shape(
      sharded["moe"][n].arrays["codes"].shape)) for n in ("gate_up", "down")}
  calls = pallas_operand_shapes(jax.make_jaxpr(fn)(sharded, x).jaxpr)
  assert len([c for c in calls if any(s in local for s in c)]) == 2, (calls, local)


# -- errors -------------------------------------------------------------------------------


def test_row_split_inside_a_tile_is_refused():
  w = _quantize(_normal(np.random.default_rng(0), (768, 16)), group_size=128)
  with pytest.raises(ValueError, match=r"row-parallel Int4Weight: K=768 over 8 devices gives "
                     r"96 rows per device, but each device needs a multiple of 128 rows "
                     r"\(whole 128-row packed tiles \(tile_k=128\) and whole groups "
                     r"\(group_size=128\)\); valid device counts: 1, 2, 3, 6 \(nearest to "
                     r"8: 6\)"):
    qjax.shard_weight(w, _mesh(8), "tp", "row")


def test_row_split_inside_a_group_is_refused():
  w = _quantize(_normal(np.random.default_rng(0), (512, 16)), group_size=128, tile_k=8)
  with pytest.raises(ValueError, match=r"64 rows per device.*multiple of 128 rows.*"
                     r"group_size=128.*valid device counts: 1, 2, 4 \(nearest to 8: 4\)"):
    qjax.check_split(w, "row", 8)
  qjax.check_split(w.repack(8), "row", 4)  # whole groups of 128: fine


def test_row_split_of_a_padded_k_is_refused():
  w = _quantize(_normal(np.random.default_rng(0), (576, 16)), group_size=64)  # Kp = 640
  with pytest.raises(ValueError, match=r"K=576 is not a multiple of 128 itself, so no "
                     r"split of this layout is valid"):
    qjax.check_split(w, "row", 2)
  qjax.check_split(w, "row", 1)


def test_uneven_column_and_expert_splits_are_refused():
  w, _, _, _ = weight_case("int4-g128")
  with pytest.raises(ValueError, match=r"column-parallel Int4Weight: N=40 columns do not "
                     r"split evenly over 3 devices; valid device counts: 1, 2, 4, 5, 8, 10"
                     r".*nearest to 3: 2, 4"):
    qjax.check_split(w, "column", 3)
  experts = _mxfp4(_normal(np.random.default_rng(0), (6, 64, 16)))
  with pytest.raises(ValueError, match=r"E=6 experts do not split evenly over 4 devices; "
                     r"valid device counts: 1, 2, 3, 6 \(nearest to 4: 3, 6\)"):
    qjax.check_split(experts, "expert", 4)
  with pytest.raises(ValueError, match="no leading expert axis"):
    qjax.check_split(w, "expert", 2)
  with pytest.raises(ValueError, match="mode='rows' must be one of"):
    qjax.check_split(w, "rows", 2)


def test_unsupported_splits_name_the_reason():
  rng = np.random.default_rng(0)
  cb = _codebook(_normal(rng, (256, 16)), group=128)
  with pytest.raises(ValueError, match="rotation is drawn from its index along K"):
    qjax.check_split(cb, "row", 2)
  with pytest.raises(TypeError, match=r"GPTQWeight has no sharding rule \(convert it first"):
    split_rules.rule_for(qjax.GPTQWeight, {})
  with pytest.raises(ValueError, match="mesh axis 'model' is not in the mesh"):
    qjax.shard_weight(weight_case("nvfp4")[0], _mesh(2), "model", "column")
  sw = qjax.ShardedWeight.of(moe_case()[0], _mesh(2), "tp", "expert")
  with pytest.raises(ValueError, match="multiplies through qjax.moe_matmul"):
    qjax.matmul(jnp.ones((1, 256)), sw)


# -- explicit mesh axes (jax.make_mesh's default axis type) --------------------------------


def _explicit_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  if jax.device_count() < int(np.prod(shape)):
    pytest.skip(f"needs {int(np.prod(shape))} devices, has {jax.device_count()}")
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


@pytest.mark.parametrize("mode", ["column", "row"])
@pytest.mark.parametrize("case", [*WEIGHTS, "codebook-two-pass"])
def test_explicit_mesh_axes(case, mode):
  """Plain jax.jit over a weight split on a mesh of explicit axes, and a ShardedWeight
  outside shard_map: the XLA path runs under auto_axes (its reshapes and gathers of a
  split weight raised ShardingTypeError: int4_nk, GGUF blocks, codebook), y is split as
  the weight's columns (column-wise) or whole (row-wise), and jax.grad goes through."""
  if case == "codebook-two-pass":
    if mode == "row":
      pytest.skip("codebook weights split by columns only (test_unsupported_splits...)")
    rng = np.random.default_rng(seed_from(case))
    w = _codebook(_normal(rng, (256, 24)), group=128, passes=2)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    single = _matmul(x, w)
    ref = np.asarray(x, np.float64) @ np.asarray(_dequantize(w), np.float64)
  else:
    w, x, single, ref = weight_case(case)
  mesh = _explicit_mesh((4 if jax.device_count() >= 4 else 2,), ("tp",))  # 2 GPUs too
  matmul = jax.jit(lambda x, w: qjax.matmul(x, w))
  for placed in (qjax.shard_weight(w, mesh, "tp", mode), qjax.ShardedWeight.of(w, mesh, "tp",
                                                                               mode)):
    y = matmul(x, placed)
    assert rel_err(y, single) < TOL and rel_err(y, ref) < TOL
    assert y.sharding.spec == (P(None, "tp") if mode == "column" else P(None, None))
  ws = qjax.shard_weight(w, mesh, "tp", mode)
  grad = jax.jit(jax.grad(lambda x, w: qjax.matmul(x, w).sum()))(x, ws)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(_dequantize(w)).sum(1)[None]
                             .repeat(3, 0), rtol=1e-5, atol=1e-5)


def test_explicit_mesh_rows_of_x_keep_their_axis():
  """x split by rows over a data axis, W by columns over a model axis (both explicit):
  y is split over both, and the product is the single-device one."""
  mesh = _explicit_mesh((2, 4), ("dp", "tp"))
  w, _, _, _ = weight_case("int4_nk-g128")
  rng = np.random.default_rng(seed_from("explicit-rows"))
  x = jnp.asarray(rng.standard_normal((2, 5, w.shape[0])), jnp.float32)
  xs = jax.device_put(x, NamedSharding(mesh, P("dp", None, None)))
  y = jax.jit(lambda x, w: qjax.matmul(x, w))(xs, qjax.shard_weight(w, mesh, "tp", "column"))
  assert y.sharding.spec == P("dp", None, "tp")
  assert rel_err(y, _matmul(x, w)) < TOL


@pytest.mark.parametrize("mode", ["expert", "column"])
def test_explicit_mesh_axes_moe(mode):
  """moe_matmul under jax.jit on experts split over an explicit axis (ragged_dot's
  explicit sharding rule is not implemented in jax; the XLA path runs under auto_axes)."""
  mesh = _explicit_mesh((4 if jax.device_count() >= 4 else 2,), ("ep",))
  w, x, ids, ref = moe_case()
  moe = jax.jit(lambda x, w, i: qjax.moe_matmul(x, w, i))
  for placed in (qjax.shard_weight(w, mesh, "ep", mode), qjax.ShardedWeight.of(w, mesh, "ep",
                                                                               mode)):
    assert rel_err(moe(x, placed, ids), ref) < TOL


# -- loading into a sharding --------------------------------------------------------------


def _shard_shapes(a: jax.Array) -> set[tuple[int, ...]]:
  return {tuple(s.data.shape) for s in a.addressable_shards}


def test_load_saved_file_into_a_sharding(tmp_path):
  mesh = _mesh(4)
  w, x, single, _ = weight_case("int4-asym-g32-plain-f16")   # K=768, N=56
  v, _, v_single, _ = weight_case("nvfp4")                    # K=1024, N=40
  path = tmp_path / "layer.safetensors"
  qjax.save(path, {"up": w, "down": v, "norm": np.arange(7, dtype=np.float32)})
  out = qjax.load_sharded(path, mesh, "tp", {"up": "column", "down": "row"})
  assert _shard_shapes(out["up"].codes) == {(96, 14)}          # [K // 8, N / 4]
  assert _shard_shapes(out["up"].zeros) == {(24, 14)}
  assert _shard_shapes(out["down"].codes) == {(32, 40)}        # [Kp // 8 / 4, N]
  assert _shard_shapes(out["down"].global_scale) == {()}
  assert out["norm"].sharding.spec == P() and len(_shard_shapes(out["norm"])) == 1
  assert rel_err(_matmul(x, out["up"]), single) < TOL
  wrapped = qjax.load_sharded(path, mesh, "tp", lambda name, _: {"down": "row"}.get(name),
                              wrap=True)
  assert isinstance(wrapped["down"], qjax.ShardedWeight)
  xv = weight_case("nvfp4")[1]
  assert rel_err(qjax.sharded_matmul(xv, wrapped["down"], mesh, "tp"), v_single) < TOL
  with pytest.raises(ValueError, match="down: row-parallel NVFP4Weight: K=1024 over 3"):
    qjax.load_sharded(path, _mesh(3), "tp", {"down": "row"})


def test_load_gguf_into_a_sharding(tmp_path):
  gguf = pytest.importorskip("gguf")
  mesh = _mesh(4)
  blocks = {"q4k.weight": gguf_blocks("Q4_K", 1024, 40, 11),
            "q8.weight": gguf_blocks("Q8_0", 512, 24, 12)}
  writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
  for name, w in blocks.items():
    writer.add_tensor(name, w.to_bytes(), raw_dtype=gguf.GGMLQuantizationType[w.ggml_type])
  writer.add_tensor("norm.weight", np.linspace(-1, 1, 24, dtype=np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  f = qjax.load_gguf_sharded(tmp_path / "m.gguf", mesh, "tp",
                             {"q4k.weight": "row", "q8.weight": "column"}, wrap=True)
  q4k, q8 = f.tensors["q4k.weight"], f.tensors["q8.weight"]
  assert f.tensor_types["q4k.weight"] == "Q4_K"
  assert _shard_shapes(q4k.arrays["qs"]) == {(40, 1, 128)}    # one 256-block per device
  assert _shard_shapes(q8.arrays["qs"]) == {(6, 16, 32)}      # 24 / 4 block rows
  assert f.tensors["norm.weight"].sharding.spec == P()
  rng = np.random.default_rng(seed_from("gguf-load"))
  for sw, w in ((q4k, blocks["q4k.weight"]), (q8, blocks["q8.weight"])):
    x = jnp.asarray(rng.standard_normal((3, w.shape[0])), jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(_dequantize(w), np.float64)
    assert rel_err(qjax.sharded_matmul(x, sw, mesh, "tp"), ref) < TOL
    # The kernel layout, converted on each device from its own blocks.
    tiled = sw.map_local(gguf_tiled.GGUFTiledWeight.from_gguf, mesh)
    assert tiled.format_cls is qjax.GGUFTiledWeight and tiled.global_shape == w.shape
    np.testing.assert_array_equal(_dequantize(tiled.weight()), _dequantize(w))
    assert rel_err(qjax.sharded_matmul(x, tiled, mesh, "tp"), ref) < TOL
  # Q8_0 in 32-blocks splits row-wise 8 ways (64 rows), its 128-row tiled layout does not.
  rows = qjax.ShardedWeight.of(blocks["q8.weight"], _mesh(8), "tp", "row")
  with pytest.raises(ValueError, match=r"GGUFTiledWeight: K=512 over 8 devices gives 64 "
                     r"rows per device, but each device needs a multiple of 128 rows"):
    rows.map_local(gguf_tiled.GGUFTiledWeight.from_gguf, _mesh(8))


# -- the Llama model, tensor parallel -----------------------------------------------------


@functools.lru_cache(maxsize=None)
def llama_case(scan_layers: bool):
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  cfg = llama.LlamaConfig(vocab_size=96, hidden_size=128, num_layers=2, num_heads=8,
                          num_kv_heads=4, head_dim=16, ffn_size=256, scan_layers=scan_layers)
  rng = np.random.default_rng(seed_from("llama"))

  def q(k, n):  # tile_k=8 and groups of 32: o's K=128 splits 4 ways into 32 rows
    return _quantize(_normal(rng, (k, n)), group_size=32, tile_k=8)

  def norm():
    return jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.float32)

  layers = [{"attn_norm": {"scale": norm()},
             "attn": {"q": {"kernel": q(128, 128)}, "k": {"kernel": q(128, 64)},
                      "v": {"kernel": q(128, 64)}, "o": {"kernel": q(128, 128)}},
             "ffn_norm": {"scale": norm()},
             "mlp": {"gate": {"kernel": q(128, 256)}, "up": {"kernel": q(128, 256)},
                     "down": {"kernel": q(256, 128)}}} for _ in range(cfg.num_layers)]
  blocks = ({"blocks": jax.tree.map(lambda *a: jnp.stack(a), *layers)} if scan_layers
            else {f"layers_{i}": layer for i, layer in enumerate(layers)})
  params = {"params": {"embed": q(128, 96), **blocks, "final_norm": {"scale": norm()}}}
  tokens = jnp.asarray(rng.integers(0, 96, (2, 7)), jnp.int32)
  return cfg, params, tokens


def test_load_gguf_experts_split_reads_only_each_devices_experts(tmp_path, monkeypatch):
  """A GPT-OSS-style 3-D MXFP4 tensor (GGUF dims [K, N, E]) split by expert: each device
  reads only its experts from the memory map, and the placed weight equals load_gguf's."""
  gguf = pytest.importorskip("gguf")
  from qjax._src import sharded_load  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from("gguf-experts"))
  e, n, k = 8, 24, 96
  w = (rng.standard_normal((e, n, k)) * rng.uniform(1e-3, 10.0, (e, n, 1))).astype(np.float32)
  raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)  # [E, N, K // 32 * 17]
  path = tmp_path / "experts.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tensor("blk.0.ffn_gate_exps.weight", raw,
                    raw_dtype=gguf.GGMLQuantizationType.MXFP4)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  reads = []
  original = sharded_load.BlockFieldView.__getitem__

  def spy(self, idx):
    out = original(self, idx)
    reads.append(out.shape[0])
    return out

  monkeypatch.setattr(sharded_load.BlockFieldView, "__getitem__", spy)
  mesh = _mesh(4)
  f = qjax.load_gguf_sharded(path, mesh, "tp", {"blk.0.ffn_gate_exps.weight": "expert"},
                             wrap=True)
  sw = f.tensors["blk.0.ffn_gate_exps.weight"]
  assert sw.format_cls is qjax.GGUFMXFP4 and sw.global_shape == (k, n)
  assert _shard_shapes(sw.arrays["e"]) == {(2, n, k // 32)}
  assert _shard_shapes(sw.arrays["qs"]) == {(2, n, k // 32, 16)}
  assert reads and set(reads) == {e // 4}  # never the whole stack
  whole = qjax.load_gguf(path, progress=False).tensors["blk.0.ffn_gate_exps.weight"]
  np.testing.assert_array_equal(np.asarray(_dequantize(sw.weight())),
                                np.asarray(_dequantize(whole)))
  with pytest.raises(ValueError, match="E=8 experts do not split evenly over 3"):
    qjax.load_gguf_sharded(path, _mesh(3), "tp", {"blk.0.ffn_gate_exps.weight": "expert"})


def test_block_field_view_takes_slices_only():
  from qjax._src import sharded_load  # pylint: disable=g-import-not-at-top
  field = gf.GGUFMXFP4.block_fields[0]
  view = sharded_load.BlockFieldView(np.zeros((2, 3, 4, 17), np.uint8), field)
  assert view.shape[:3] == (2, 3, 4) and view[0:1].shape[:3] == (1, 3, 4)
  with pytest.raises(TypeError, match="slices only"):
    view[0]


def test_llama_tensor_parallel_logits_match_single_device():
  """Four devices, unrolled layers: the logits of a forward pass."""
  import flax_layers  # pylint: disable=g-import-not-at-top
  mesh = _mesh(4)
  cfg, params, tokens = llama_case(False)
  single = flax_layers.forward(params, tokens, cfg=cfg)
  sharded = flax_layers.shard_llama_params(params, mesh, cfg)
  attn = sharded["params"]["layers_0"]["attn"]
  assert attn["q"]["kernel"].mode == "column" and attn["o"]["kernel"].mode == "row"
  logits = flax_layers.tp_forward(sharded, tokens, cfg=cfg, mesh=mesh)
  assert logits.shape == single.shape
  assert rel_err(logits, single) < TOL


@pytest.mark.parametrize("implementation", [None, "interpret"])
def test_llama_tensor_parallel_prefill_and_decode_match_single_device(implementation):
  """Two devices, scanned layers: prefill into a KV cache split by KV heads, one decode;
  with the kernels (interpret mode) the decode step writes and attends each device's KV
  heads in one kernel (qjax.write_and_decode_attention) inside shard_map, against one
  device's default path."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import flax_layers  # pylint: disable=g-import-not-at-top
  mesh = _mesh(2)
  cfg, params, tokens = llama_case(True)
  with _highest_precision():
    want_prefill, cache = flax_layers.prefill(params, tokens,
                                              flax_layers.init_cache(cfg, 2, 8), cfg=cfg)
    want, _ = flax_layers.decode_step(params, tokens[:, -1], 7, cache, cfg=cfg)
    cfg = dataclasses.replace(cfg, implementation=implementation)
    sharded = flax_layers.shard_llama_params(params, mesh, cfg)
    assert sharded["params"]["blocks"]["mlp"]["down"]["kernel"].mode == "row"
    tp_cache = flax_layers.init_tp_cache(cfg, 2, 8, mesh)
    assert tp_cache["k"].sharding.spec == P(None, None, None, "tp", None)
    got_prefill, tp_cache = flax_layers.tp_prefill(sharded, tokens, tp_cache, cfg=cfg,
                                                   mesh=mesh)
    got, _ = flax_layers.tp_decode_step(sharded, tokens[:, -1], 7, tp_cache, cfg=cfg,
                                        mesh=mesh)
  assert rel_err(got_prefill, want_prefill) < TOL
  assert rel_err(got, want) < TOL


def test_llama_tensor_parallel_extend_matches_single_device():
  """Two devices, scanned layers: a prefill of 5 tokens, then tp_extend of the other 2
  (the second sequence from position 3) over the split cache, against llama.extend."""
  import flax_layers  # pylint: disable=g-import-not-at-top
  mesh = _mesh(2)
  cfg, params, tokens = llama_case(True)
  start = jnp.asarray([5, 3], jnp.int32)
  chunk = jnp.stack([tokens[0, 5:7], tokens[1, 3:5]])
  with _highest_precision():
    _, cache = flax_layers.prefill(params, tokens[:, :5], flax_layers.init_cache(cfg, 2, 8),
                                   cfg=cfg)
    want, _ = flax_layers.extend(params, chunk, start, cache, cfg=cfg)
    whole = flax_layers.forward(params, tokens, cfg=cfg)
    sharded = flax_layers.shard_llama_params(params, mesh, cfg)
    _, tp_cache = flax_layers.tp_prefill(sharded, tokens[:, :5],
                                         flax_layers.init_tp_cache(cfg, 2, 8, mesh), cfg=cfg,
                                         mesh=mesh)
    got, _ = flax_layers.tp_extend(sharded, chunk, start, tp_cache, cfg=cfg, mesh=mesh)
  assert rel_err(got, want) < TOL
  assert tokens.shape[1] == 7 and rel_err(want[0], whole[0, 5:7]) < TOL  # extend is the whole prefill's rows


def test_llama_tensor_parallel_scanned_layers_read_the_stack_in_place():
  """Two devices, scanned layers, the kernels (interpret mode): each layer's kernels take
  the device's slice of the whole stack (qjax.layer_of through the ShardedWeight), not a
  per-layer copy, and the logits match the single-device forward."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import flax_layers  # pylint: disable=g-import-not-at-top
  mesh = _mesh(2)
  cfg, params, tokens = llama_case(True)
  cfg = dataclasses.replace(cfg, implementation="interpret")
  with _highest_precision():
    single = flax_layers.forward(params, tokens, cfg=cfg)
    sharded = flax_layers.shard_llama_params(params, mesh, cfg)
    run = lambda p, t: flax_layers.tp_forward(p, t, cfg=cfg, mesh=mesh)
    assert rel_err(run(sharded, tokens), single) < TOL
  stacked = sharded["params"]["blocks"]
  local = {tuple(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(stacked)
           if a.ndim >= 3}  # each device's slice of a stacked quantized array
  calls = pallas_operand_shapes(jax.make_jaxpr(run)(sharded, tokens).jaxpr)
  # q, k, v, o, gate, up, down: traced once in the scan body, each handed its stacked
  # arrays (3-D: a per-layer copy would be 2-D).
  assert len([c for c in calls if any(s in local for s in c)]) == 7, (calls, local)


def test_llama_head_counts_must_divide():
  import flax_layers  # pylint: disable=g-import-not-at-top
  cfg, params, _ = llama_case(True)
  with pytest.raises(ValueError, match=r"num_kv_heads=4 is not; valid device counts: "
                     r"\[1, 2, 4\]"):
    flax_layers.shard_llama_params(params, _mesh(8), cfg)
