"""An audit of qjax.moe_matmul and flax_layers.MXFP4MoE as a user meets them: arguments
it must refuse by name, and the odd shapes, dtypes and routings the other MoE tests leave
out, against the float64 references of test_moe.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import rel_err
from test_moe import make_experts, np_moe_block, np_moe_matmul, random_ids

IMPLEMENTATIONS = ["xla", "interpret", "interpret:pallas_triton",
                   "interpret:pallas_triton_gemv"]


# ------------------------------------------------------------------------ moe_matmul


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad", [4, -1])
def test_concrete_ids_out_of_range_raise_on_every_implementation(rng, implementation, bad):
  """The docstring: concrete ids out of range raise ValueError. The kernel routes ran
  under jit, where the ids are traced, and gave NaN rows instead (before this audit)."""
  w = make_experts(rng, 4, 64, 32)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  ids = jnp.asarray(np.array([[0, 1], [2, bad], [3, 0]], np.int32))
  with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
    qjax.moe_matmul(x, w, ids, implementation=implementation)


def test_concrete_ids_out_of_range_raise_for_a_layer_of_a_stack(rng):
  ws = [make_experts(rng, 4, 64, 32) for _ in range(2)]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
    qjax.moe_matmul(x, qjax.layer_of(stack, 1), jnp.array([[0, 4]] * 3),
                    implementation="interpret")
  ids = random_ids(rng, 3, 4, 2)
  got = qjax.moe_matmul(x, qjax.layer_of(stack, 1), jnp.asarray(ids),
                        implementation="interpret")
  assert rel_err(got, np_moe_matmul(x, ws[1], ids)) < 1e-5


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_arguments_that_are_not_arrays_are_named(rng, implementation):
  w = make_experts(rng, 4, 64, 32)
  x = jnp.ones((3, 64), jnp.float32)
  ids = [[0, 1], [2, 3], [1, 0]]
  with pytest.raises(TypeError, match=r"expert_ids must be a jax or numpy array, got list"):
    qjax.moe_matmul(x, w, ids, implementation=implementation)
  with pytest.raises(TypeError, match=r"expert_ids must be a jax or numpy array, got int"):
    qjax.moe_matmul(x[:1], w, 2, implementation=implementation)
  with pytest.raises(TypeError, match=r"x must be a jax or numpy array, got list"):
    qjax.moe_matmul(np.asarray(x).tolist(), w, jnp.asarray(ids),
                    implementation=implementation)


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.uint32, np.int8])
def test_expert_id_dtypes(rng, dtype):
  """Any integer ids (numpy int64 too) route as their values; bool and float refuse."""
  w = make_experts(rng, 4, 64, 40)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  ids = random_ids(rng, 3, 4, 2)
  y = qjax.moe_matmul(x, w, ids.astype(dtype), implementation="xla")
  assert y.dtype == jnp.float32 and rel_err(y, np_moe_matmul(x, w, ids)) < 1e-5
  for bad in (bool, np.float32):
    with pytest.raises(ValueError, match=r"\[T, top_k\] integers"):
      qjax.moe_matmul(x, w, ids.astype(bad), implementation="xla")


# (T, E, K, N, top_k, one row per pair, dtype): K and N off the 128 grid, E = 1,
# top_k = 1 and top_k = E.
ODD_CASES = [(3, 4, 96, 40, 2, False, jnp.float32), (3, 1, 32, 24, 1, True, jnp.bfloat16),
             (3, 3, 160, 8, 3, True, jnp.float16), (1, 5, 64, 33, 5, False, jnp.float32)]


@pytest.mark.parametrize("case", ODD_CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_odd_shapes_every_implementation_matches_float64(rng, case):
  t, e, k, n, top_k, per_pair, dtype = case
  w = make_experts(rng, e, k, n)
  ids = random_ids(rng, t, e, top_k)
  x = jnp.asarray(rng.standard_normal((t, top_k, k) if per_pair else (t, k)), dtype)
  want = np_moe_matmul(x, w, ids)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  for implementation in ["xla", "interpret:pallas_triton", "interpret:pallas_triton_gemv"]:
    # float32 at float32 accuracy: the interpreted kernels' dots follow jax's default
    # precision, one TF32 product on the GPU (off by ~1e-3 there, session 30).
    with jax.default_matmul_precision("highest"):
      y = qjax.moe_matmul(x, w, jnp.asarray(ids), implementation=implementation)
    assert y.shape == (t, top_k, n) and y.dtype == dtype, implementation
    assert rel_err(y, want) < tol, implementation


# ------------------------------------------------------------------------- MXFP4MoE


def test_moe_block_refuses_expert_weights_it_cannot_run(rng):
  """A GPT-OSS checkpoint's weight as stored, or float weights: a TypeError naming the
  param and the conversion (was an AttributeError on ``.codes``)."""
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  layer = MXFP4MoE(num_experts=4, top_k=2, intermediate_size=32, implementation="xla")
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  params = layer.init(jax.random.key(0), x)["params"]
  stored = qjax.GptOssMXFP4Weight.from_mxfp4(params["gate_up"])
  with pytest.raises(TypeError, match=r"gate_up: params hold a GptOssMXFP4Weight.*to_mxfp4"):
    layer.apply({"params": dict(params, gate_up=stored)}, x)
  with pytest.raises(TypeError, match=r"down: params hold a .*quantize_mxfp4"):
    layer.apply({"params": dict(params, down=params["down"].dequantize())}, x)
  converted = dict(params, gate_up=stored.to_mxfp4())  # the conversion it names works
  np.testing.assert_array_equal(np.asarray(layer.apply({"params": converted}, x)),
                                np.asarray(layer.apply({"params": params}, x)))


@pytest.mark.parametrize("e,top_k,gating,activation", [
    (1, 1, "topk_softmax", "gpt_oss"), (4, 4, "softmax_topk", "swiglu"),
    (5, 1, "softmax_topk", "gpt_oss")])
def test_moe_block_edge_routings_match_float64(rng, e, top_k, gating, activation):
  """E = 1, top_k = E and top_k = 1, three tokens, every bias non-zero."""
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  d, f = 64, 32
  layer = MXFP4MoE(num_experts=e, top_k=top_k, intermediate_size=f, gating=gating,
                   activation=activation, use_bias=True, implementation="xla")
  x = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
  params = layer.init(jax.random.key(1), x)["params"]
  assert params["router_kernel"].shape == (d, e) and params["router_bias"].shape == (e,)
  assert params["gate_up_bias"].shape == (e, 2 * f) and params["down_bias"].shape == (e, d)
  assert params["gate_up"].shape == (d, 2 * f) and params["down"].shape == (f, d)
  assert params["gate_up"].codes.shape[0] == params["down"].codes.shape[0] == e
  params = {k: (jnp.asarray(rng.standard_normal(v.shape) * 0.5, jnp.float32)
                if k.endswith("_bias") else v) for k, v in params.items()}
  y = layer.apply({"params": params}, x)
  assert y.shape == (3, d) and y.dtype == jnp.float32
  assert rel_err(y, np_moe_block(x, params, top_k, gating, activation)) < 1e-5


def test_moe_block_top_k_above_experts_is_named():
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  layer = MXFP4MoE(num_experts=4, top_k=5, intermediate_size=32)
  with pytest.raises(ValueError, match=r"top_k=5 must be an int in \[1, 4\]"):
    layer.init(jax.random.key(0), jnp.ones((3, 64)))


def test_moe_block_dtypes(rng):
  """dtype sets the output and the expert matmuls; param_dtype the float params."""
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  layer = MXFP4MoE(num_experts=4, top_k=2, intermediate_size=32, use_bias=True,
                   dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, implementation="xla")
  params = layer.init(jax.random.key(2), x)["params"]
  for name in ("router_kernel", "router_bias", "gate_up_bias", "down_bias"):
    assert params[name].dtype == jnp.bfloat16, name
  y = layer.apply({"params": params}, x)
  assert y.dtype == jnp.bfloat16
  xb = x.astype(jnp.bfloat16)  # the layer routes the tokens in its dtype
  assert rel_err(y, np_moe_block(xb, params, 2, "topk_softmax", "swiglu")) < 2e-2


# ------------------------------------------- session 48's audit: sharding, offload, save


def test_sharded_moe_matmul_refuses_concrete_ids_out_of_range(rng):
  """qjax.moe_matmul refused them; sharded_moe_matmul returned NaN rows for the bad
  pairs in expert and column mode."""
  from test_sharding import _mesh  # pylint: disable=g-import-not-at-top
  mesh = _mesh(4)
  w = make_experts(rng, 8, 64, 32)
  x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
  for mode in ("expert", "column"):
    with pytest.raises(ValueError, match=r"range over \[-1, 9\]; they must lie in \[0, 8\)"):
      qjax.sharded_moe_matmul(x, w, jnp.asarray([[0, 9], [-1, 3]]), mesh, "tp", mode)
  ids = jnp.asarray([[0, 7], [1, 3]])
  got = qjax.sharded_moe_matmul(x, w, ids, mesh, "tp", "expert")
  assert rel_err(got, np_moe_matmul(x, w, ids)) < 1e-5


def test_moe_matmul_errors_give_the_right_advice(rng):
  """An NVFP4Weight stack was told to use .to_mxfp4(); a Hopper-only NK stack on the CPU
  to try implementation='interpret' (it has none)."""
  import pallas_kernels  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
  ids = jnp.asarray([[0, 1], [2, 3]])
  nv = qjax.quantize_nvfp4(jnp.asarray(rng.standard_normal((4, 64, 32)), jnp.float32))
  with pytest.raises(NotImplementedError, match=r"qjax\.to_nvfp4_nk\(w\)"):
    qjax.moe_matmul(x, nv, ids)
  if jax.devices()[0].platform == "cpu":
    with pytest.raises(NotImplementedError, match=r"use implementation='xla' \(it has no "
                       "interpret mode\\)"):
      qjax.moe_matmul(x.astype(jnp.bfloat16), qjax.to_nvfp4_nk(nv), ids,
                      implementation="pallas")


def test_view_weights_and_sharded_load_names_are_checked(rng, tmp_path):
  """save of a ShardedWeight / LayerOf ended "flatten nested dicts"; load_sharded ignored
  a misspelled name (its weight loaded whole on every device); partition_specs in expert
  mode of a weight without experts gave P(None, None) where shard_weight refuses it."""
  from test_sharding import _mesh  # pylint: disable=g-import-not-at-top
  mesh = _mesh(2)
  w = qjax.quantize(jnp.asarray(rng.standard_normal((128, 64)), jnp.float32), group_size=64)
  with pytest.raises(TypeError, match=r"'w' is a ShardedWeight, a view of a weight; save its "
                     r"global weight, value\.weight\(\)"):
    qjax.save(tmp_path / "a.qjax", {"w": qjax.ShardedWeight.of(w, mesh, "tp", "column")})
  stack = jax.tree.map(lambda *a: jnp.stack(a), w, w)
  with pytest.raises(TypeError, match=r"'w' is a LayerOf.*value\.stack"):
    qjax.save(tmp_path / "a.qjax", {"w": qjax.layer_of(stack, 0)})
  qjax.save(tmp_path / "b.qjax", {"w": w})
  with pytest.raises(ValueError, match=r"modes names \['v'\], which .* does not hold; its "
                     r"names: \['w'\]"):
    qjax.load_sharded(tmp_path / "b.qjax", mesh, "tp", {"v": "column"})
  got = qjax.load_sharded(tmp_path / "b.qjax", mesh, "tp", {"w": "column"})["w"]
  np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(w.dequantize()))
  with pytest.raises(ValueError, match="has no leading expert axis"):
    qjax.partition_specs(w, "expert", "ep")


def test_stack_layers_refuses_layers_that_are_not_square(rng):
  """Non-square layers were accepted and failed at the forward pass ("the last dim must
  equal K")."""
  layers = [qjax.quantize_codebook(jnp.asarray(rng.standard_normal((128, 64)), jnp.float32),
                                   group=64, passes=2) for _ in range(3)]
  with pytest.raises(ValueError, match=r"layer 0 has shape \(128, 64\); a stack of layers "
                     r"needs square \[D, D\] weights"):
    qjax.stack_layers(layers, offload_pass2=False)
