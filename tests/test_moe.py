"""qjax.moe_matmul (XLA, Pallas interpret, compiled Pallas on the GPU) and the MXFP4MoE
block against float64 numpy references built from the stored arrays with ml_dtypes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import moe
from conftest import needs_gpu, on_gpu, rel_err, seed_from
from test_fp4 import np_dequantize

# ------------------------------------------------------------------ numpy references


def make_experts(rng, e, k, n, scale=1.0):
  """Random MXFP4 experts [E, K, N] quantized from Gaussian weights."""
  return qjax.quantize_mxfp4(jnp.asarray(rng.standard_normal((e, k, n)) * scale, jnp.float32))


def np_expert(w, e) -> np.ndarray:
  """float64 [K, N] of expert e, dequantized from its own arrays only."""
  return np_dequantize(jax.tree.map(lambda a: np.asarray(a[e]), w))


def np_pair_products(x_pairs, w, ids) -> np.ndarray:
  """float64 ``x_pairs[..., j, :] @ W[ids[..., j]]``, one selected expert at a time
  (unselected experts are never decoded; memory stays at one expert)."""
  x_pairs = np.asarray(x_pairs, np.float64)
  ids = np.asarray(ids)
  flat_x = x_pairs.reshape(-1, x_pairs.shape[-1])
  flat_ids = ids.reshape(-1)
  out = np.zeros((flat_ids.size, w.shape[1]))
  for e in np.unique(flat_ids):
    sel = flat_ids == e
    out[sel] = flat_x[sel] @ np_expert(w, int(e))
  return out.reshape(*ids.shape, w.shape[1])


def np_moe_matmul(x, w, ids) -> np.ndarray:
  """float64 y[t, j] = x[t] (or x[t, j]) @ W[ids[t, j]]."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  if x.ndim == 2:
    x = np.broadcast_to(x[:, None, :], (*np.shape(ids), x.shape[-1]))
  return np_pair_products(x, w, ids)


def random_ids(rng, t, e, top_k):
  """[T, top_k] distinct experts per token (as a router's top-k gives)."""
  return np.stack([rng.choice(e, top_k, replace=False) for _ in range(t)]).astype(np.int32)


def _kernel(x, w, ids, *, interpret, config=None):
  """The fused kernel with a poisoned output buffer, through the canonical form."""
  from pallas_kernels import fp4_moe  # pylint: disable=g-import-not-at-top
  t, top_k = ids.shape

  def f(x, w, ids):
    rows = x if x.ndim == 2 else x.reshape(t * top_k, -1)
    pair_rows = jnp.arange(t * top_k) // (top_k if x.ndim == 2 else 1)
    y = fp4_moe.mxfp4_moe_matmul(rows, w, pair_rows.astype(jnp.int32),
                                 ids.reshape(-1).astype(jnp.int32), interpret=interpret,
                                 config=config, poison=True)
    return y.reshape(t, top_k, -1)

  return jax.jit(f)(x, w, jnp.asarray(ids))


# ------------------------------------------------------------------------- routing


@pytest.mark.parametrize("p,e,block_m", [(1, 4, 16), (12, 4, 16), (256, 128, 16),
                                         (200, 8, 64), (7, 8, 2)])
def test_group_by_expert_tiles_cover_each_group_once(rng, p, e, block_m):
  ids = rng.integers(0, e, p).astype(np.int32)
  ids[: p // 2] = 1  # one expert receives at least half the pairs
  g = jax.tree.map(np.asarray, moe.group_by_expert(jnp.asarray(ids), e, block_m))
  assert (ids[g.order] == np.sort(ids, kind="stable")).all()
  np.testing.assert_array_equal(g.group_sizes, np.bincount(ids, minlength=e))
  covered = np.zeros(p, int)
  for ex, s, end in zip(g.tile_experts, g.tile_starts, g.tile_ends):
    assert 0 <= end - s <= block_m
    assert ex in ids, "a tile names an expert no pair selected"
    covered[s:end] += 1
    assert (ids[g.order[s:end]] == ex).all()
  assert (covered == 1).all()
  active = int(np.sum(-(-np.bincount(ids, minlength=e) // block_m)))
  assert active <= len(g.tile_experts) == moe.max_row_tiles(p, e, block_m)


@pytest.mark.parametrize("by", ["comparison", "sort"])
@pytest.mark.parametrize("p,e,tile_m", [(1, 4, 16), (12, 4, 16), (256, 128, 8),
                                        (200, 8, 64), (7, 8, 2), (64, 128, 8)])
def test_tile_slots_are_group_by_experts_tiles(rng, monkeypatch, p, e, tile_m, by):
  """tile_slots (by comparisons, or above its limit by a sort) puts each pair in the tile
  and row that group_by_expert's table gives it, and the slot table inverts the pair
  table."""
  monkeypatch.setattr(moe, "TILE_SLOTS_MAX_COMPARISONS", 1 << 40 if by == "comparison" else 0)
  ids = rng.integers(0, e, p).astype(np.int32)
  ids[: p // 3] = e - 1  # one expert receives a third of the pairs
  g = jax.tree.map(np.asarray, moe.group_by_expert(jnp.asarray(ids), e, tile_m))
  s = jax.tree.map(np.asarray, jax.jit(moe.tile_slots, static_argnums=(1, 2))(
      jnp.asarray(ids), e, tile_m))
  tiles = moe.max_row_tiles(p, e, tile_m)
  assert s.tile_experts.shape == s.tile_rows.shape == (tiles,)
  assert s.source.shape == (tiles * tile_m,)
  np.testing.assert_array_equal(s.tile_rows, g.tile_ends - g.tile_starts)
  assert int(s.active) == int(np.sum(s.tile_rows > 0))
  assert (s.tile_rows[: int(s.active)] > 0).all() and (s.tile_rows[int(s.active):] == 0).all()
  assert np.isin(s.tile_experts, ids).all(), "a tile names an expert no pair selected"
  for t in range(int(s.active)):
    assert s.tile_experts[t] == g.tile_experts[t]
    np.testing.assert_array_equal(s.source[t * tile_m: t * tile_m + s.tile_rows[t]],
                                  g.order[g.tile_starts[t]: g.tile_ends[t]])
  np.testing.assert_array_equal(s.source[s.slot], np.arange(p))
  assert np.sum(s.source < p) == p and (s.source[s.source >= p] == p).all()


# ------------------------------------------------------------------------ the suite

# (T, E, top_k): decode and prefill sizes, every top_k that fits.
ROUTINGS = [(t, e, k) for t in (1, 3, 64) for e in (4, 8) for k in (1, 2, 4) if k <= e]
K, N = 160, 40  # K a multiple of 32 but not of 128; N not a multiple of any block


def routing_id(r):
  return f"T{r[0]}-E{r[1]}-top{r[2]}"


class MoESuite:
  """Subclasses set ``run(x, w, ids) -> [T, top_k, N]``."""

  def run(self, x, w, ids):
    raise NotImplementedError

  def check(self, x, w, ids, tol=1e-2):
    y = self.run(x, w, jnp.asarray(ids))
    t, top_k = ids.shape
    assert y.shape == (t, top_k, w.shape[1]) and y.dtype == x.dtype
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
    err = rel_err(y, np_moe_matmul(x, w, ids))
    assert err < tol, err
    return y

  @pytest.mark.parametrize("routing", ROUTINGS, ids=routing_id)
  def test_matches_float64(self, request, routing):
    t, e, top_k = routing
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, e, K, N)
    x = jnp.asarray(rng.standard_normal((t, K)), jnp.float32)
    self.check(x, w, random_ids(rng, t, e, top_k))

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_one_expert_takes_all_and_others_none(self, request, dtype):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 8, 96, 72)
    x = jnp.asarray(rng.standard_normal((37, 96)), dtype)
    ids = np.full((37, 2), 5, np.int32)
    ids[:, 1] = 2  # experts 2 and 5 get every token, the other six none
    self.check(x, w, ids)

  def test_one_row_per_pair(self, request):
    """x [T, top_k, K]: the down projection's form."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 4, 64, 48)
    x = jnp.asarray(rng.standard_normal((5, 2, 64)), jnp.bfloat16)
    self.check(x, w, random_ids(rng, 5, 4, 2))

  def test_unselected_experts_are_not_read(self, request):
    """Experts no token selects get NaN scales (E8M0 255): reading them would spread NaN
    into the output."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    e = 8
    w = make_experts(rng, e, K, N)
    ids = np.array([[1, 6], [6, 3], [1, 3]], np.int32)
    unused = np.setdiff1d(np.arange(e), ids)
    scales = np.asarray(w.scales).copy()
    scales[unused] = 255
    w = qjax.MXFP4Weight(codes=w.codes, scales=jnp.asarray(scales), shape=w.shape)
    x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
    self.check(x, w, ids)


class TestXla(MoESuite):

  def run(self, x, w, ids):
    return jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation="xla"))(x, w, ids)

  def test_gather_and_ragged_paths_agree(self, request):
    """P < E takes the gathered-experts path, P >= E the ragged_dot one."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 8, 64, 32)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    ids = random_ids(rng, 6, 8, 2)
    both = np.asarray(self.run(x, w, ids))                      # P = 12 >= 8: ragged
    few = np.concatenate([np.asarray(self.run(x[i:i + 1], w, ids[i:i + 1]))  # P = 2: gather
                          for i in range(6)])
    # The same products summed in another order: float32 rounding of the sums (the H100:
    # 4.8e-6 at |y| up to 24, 2e-7 of the largest output).
    np.testing.assert_allclose(both, few, rtol=1e-6, atol=2e-6 * np.abs(few).max())


class TestInterpret(MoESuite):

  def run(self, x, w, ids):
    return _kernel(x, w, ids, interpret=True)

  @pytest.mark.parametrize("cfg", [
      qjax.KernelConfig(block_m=16, block_n=32, block_k=128),
      qjax.KernelConfig(block_m=16, block_n=16, block_k=256, split_k=2),
      qjax.KernelConfig(block_m=32, block_n=64, block_k=128, split_k=3)])
  def test_configs_and_split_k(self, request, cfg):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 8, 352, 40)
    x = jnp.asarray(rng.standard_normal((21, 352)), jnp.bfloat16)
    ids = random_ids(rng, 21, 8, 2)
    ids[:12, 0] = 7  # a group longer than one row block
    y = _kernel(x, w, ids, interpret=True, config=cfg)
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert rel_err(np.asarray(y, np.float32), np_moe_matmul(x, w, ids)) < 1e-2

  def test_dispatcher_routes_interpret(self, request):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 4, 64, 32)
    assert qjax.moe_implementation_name(w, "interpret") == "pallas_triton-interpret"
    assert qjax.moe_implementation_name(w, "xla") == "xla"
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    ids = random_ids(rng, 3, 4, 2)
    y = qjax.moe_matmul(x, w, jnp.asarray(ids), implementation="interpret")
    assert rel_err(y, np_moe_matmul(x, w, ids)) < 1e-2

  def test_plain_tile_order_is_repacked(self, request):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 4, 160, 24)
    x = jnp.asarray(rng.standard_normal((4, 160)), jnp.float32)
    ids = random_ids(rng, 4, 4, 2)
    y = self.run(x, w.repack(8), ids)
    assert rel_err(np.asarray(y), np_moe_matmul(x, w, ids)) < 1e-2


@pytest.mark.parametrize("tokens,top_k", [(1, 4), (3, 2), (5000, 4)])
@pytest.mark.parametrize("shared_row", [True, False])
def test_pair_rows(monkeypatch, tokens, top_k, shared_row):
  """Each pair's row: p // top_k where a token's experts share its row, else p; a constant
  of the program up to _CONSTANT_PAIR_ROWS_MAX pairs, computed above (both the same)."""
  p = np.arange(tokens * top_k)
  want = p // top_k if shared_row else p
  got = moe._pair_rows(tokens, top_k, shared_row=shared_row)  # pylint: disable=protected-access
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), want)
  hlo = jax.jit(lambda: moe._pair_rows(tokens, top_k, shared_row=shared_row)).lower().as_text()
  assert ("iota" in hlo) == (tokens * top_k > moe._CONSTANT_PAIR_ROWS_MAX)
  monkeypatch.setattr(moe, "_CONSTANT_PAIR_ROWS_MAX", 0)  # the computed form
  computed = jax.jit(lambda: moe._pair_rows(tokens, top_k, shared_row=shared_row))()
  np.testing.assert_array_equal(np.asarray(computed), want)


def test_bad_arguments_are_named(rng):
  w = make_experts(rng, 4, 64, 32)
  x = jnp.ones((3, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
    qjax.moe_matmul(x, w, jnp.array([[0, 4]] * 3))
  with pytest.raises(ValueError, match=r"must be \[T, K\]"):
    qjax.moe_matmul(jnp.ones((2, 64)), w, jnp.zeros((3, 2), jnp.int32))
  with pytest.raises(ValueError, match="one leading expert axis"):
    qjax.moe_matmul(x, make_experts(rng, 1, 64, 32).repack(128).__class__(
        codes=w.codes[0], scales=w.scales[0], shape=w.shape), jnp.zeros((3, 1), jnp.int32))
  with pytest.raises(NotImplementedError, match="MXFP4Weight"):
    qjax.moe_matmul(x, qjax.quantize_nvfp4(jnp.ones((4, 64, 32))), jnp.zeros((3, 1), jnp.int32))
  with pytest.raises(ValueError, match="implementation="):
    qjax.moe_matmul(x, w, jnp.zeros((3, 1), jnp.int32), implementation="triton")


# --------------------------------------------------------------------- the MoE block


def np_moe_block(x, params, top_k, gating, activation) -> np.ndarray:
  """float64 forward of MXFP4MoE from the stored arrays."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  logits = x @ np.asarray(params["router_kernel"], np.float64)
  if "router_bias" in params:
    logits = logits + np.asarray(params["router_bias"], np.float64)
  ids = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
  top = np.take_along_axis(logits, ids, axis=-1)
  if gating == "topk_softmax":
    gate = np.exp(top - top.max(-1, keepdims=True))
    gate /= gate.sum(-1, keepdims=True)
  else:
    p = np.exp(logits - logits.max(-1, keepdims=True))
    gate = np.take_along_axis(p / p.sum(-1, keepdims=True), ids, axis=-1)
  h = np_moe_matmul(x, params["gate_up"], ids)
  if "gate_up_bias" in params:
    h = h + np.asarray(params["gate_up_bias"], np.float64)[ids]
  f = h.shape[-1] // 2
  if activation == "swiglu":
    g, u = h[..., :f], h[..., f:]
    a = g / (1 + np.exp(-g)) * u
  else:
    g = np.minimum(h[..., 0::2], 7.0)
    u = np.clip(h[..., 1::2], -7.0, 7.0)
    a = (u + 1) * g / (1 + np.exp(-1.702 * g))
  y = np_pair_products(a, params["down"], ids)
  if "down_bias" in params:
    y = y + np.asarray(params["down_bias"], np.float64)[ids]
  return np.einsum("tj,tjd->td", gate, y)


BLOCK_CASES = [  # (T, E, top_k, gating, activation, use_bias, implementation)
    (3, 4, 2, "topk_softmax", "swiglu", False, "xla"),
    (200, 8, 2, "softmax_topk", "gpt_oss", True, "xla"),
    (1, 8, 4, "topk_softmax", "gpt_oss", True, "interpret"),
    (130, 8, 2, "topk_softmax", "swiglu", False, "interpret"),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_block_matches_float64(request, case):
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  t, e, top_k, gating, activation, use_bias, impl = case
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  d, f = 64, 96
  layer = MXFP4MoE(num_experts=e, top_k=top_k, intermediate_size=f, gating=gating,
                   activation=activation, use_bias=use_bias, implementation=impl)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
  params = layer.init(jax.random.key(seed_from(request.node.nodeid)), x)["params"]
  if use_bias:  # non-zero biases, so that a missing one fails
    params = {k: (jnp.asarray(rng.standard_normal(v.shape) * 0.1, jnp.float32)
                  if k.endswith("_bias") else v) for k, v in params.items()}
  y = jax.jit(lambda p, v: layer.apply({"params": p}, v))(params, x)
  assert y.shape == (t, d) and y.dtype == jnp.float32
  assert rel_err(y, np_moe_block(x, params, top_k, gating, activation)) < 1e-2


def test_moe_block_leading_axes_and_param_check(rng):
  from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
  layer = MXFP4MoE(num_experts=4, top_k=2, intermediate_size=32, implementation="xla")
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
  params = layer.init(jax.random.key(0), x)["params"]
  y = layer.apply({"params": params}, x)
  assert y.shape == (2, 3, 64) and y.dtype == jnp.bfloat16
  flat = layer.apply({"params": params}, x.reshape(6, 64))
  np.testing.assert_array_equal(np.asarray(y).reshape(6, 64), np.asarray(flat))
  wrong = dict(params, down=make_experts(rng, 4, 64, 64))
  with pytest.raises(ValueError, match="down"):
    layer.apply({"params": wrong}, x)


# ----------------------------------------------------------------------- the GPU suite


@needs_gpu
class TestPallasGpu(MoESuite):

  def run(self, x, w, ids):
    return _kernel(x, w, ids, interpret=False)

  @pytest.mark.parametrize("t", [1, 4, 16, 64])
  @pytest.mark.parametrize("e", [32, 128])
  def test_gpt_oss_shape(self, request, t, e):
    """GPT-OSS-like experts: 2880 x 2880, top-4, bf16 activations."""
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    # Random codes and E8M0 scales 2**-7 .. 2**-5 (quantizing 128 float experts on the
    # device would need several GB).
    codes = rng.integers(0, 2**32, (e, 2944 // 8, 2880), dtype=np.uint32)
    scales = rng.integers(120, 123, (e, 2880 // 32, 2880), dtype=np.uint8)
    w = qjax.MXFP4Weight(codes=jnp.asarray(codes), scales=jnp.asarray(scales),
                         shape=(2880, 2880))
    x = jnp.asarray(rng.standard_normal((t, 2880)), jnp.bfloat16)
    self.check(x, w, random_ids(rng, t, e, 4))

  def test_auto_picks_pallas(self, request):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w = make_experts(rng, 8, 256, 128)
    assert qjax.moe_implementation_name(w) == "pallas_triton"
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    ids = random_ids(rng, 5, 8, 2)
    y = jax.jit(qjax.moe_matmul)(x, w, jnp.asarray(ids))
    assert rel_err(np.asarray(y, np.float32), np_moe_matmul(x, w, ids)) < 1e-2

  @pytest.mark.parametrize("t", [1, 64])
  def test_moe_block_gpt_oss_like(self, request, t):
    from flax_layers import MXFP4MoE  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    layer = MXFP4MoE(num_experts=32, top_k=4, intermediate_size=2880, activation="gpt_oss",
                     use_bias=True)
    x = jnp.asarray(rng.standard_normal((t, 2880)), jnp.bfloat16)
    # init draws the experts in float32 (2 GB) before quantizing them: on the host, so that
    # beside other test workers on the GPU only the MXFP4 params (0.3 GB) go there.
    with jax.default_device(jax.devices("cpu")[0]):
      params = layer.clone(implementation="xla").init(jax.random.key(0), x)["params"]
    params = jax.device_put(params, jax.devices()[0])
    y = jax.jit(lambda p, v: layer.apply({"params": p}, v))(params, x)
    ref = np_moe_block(x, params, 4, "topk_softmax", "gpt_oss")
    assert rel_err(np.asarray(y, np.float32), ref) < 2e-2


def test_bench_moe_floor_counts_selected_experts_only(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from qjax._src import cli  # pylint: disable=g-import-not-at-top
  path = tmp_path / "moe.json"
  assert cli.main(["bench", "--moe", "--calls", "1", "--m", "3", "--shapes", "128x64",
                   "--moe-experts", "4", "--moe-top-k", "2", "--json", str(path)]) == 0
  (row,) = json.loads(path.read_text())["moe_rows"]
  assert set(row["times_us"]) == {"default", "grouped", "gemv", "wgmma", "xla", "dequant_all"}
  # Hopper's wgmma kernel runs neither on a CPU nor for N = 64 (it needs N >= 128): NaN,
  # not an error (the H100 raised NotImplementedError here before session 25).
  assert math.isnan(row["times_us"]["wgmma"])
  assert all(math.isfinite(t) for name, t in row["times_us"].items() if name != "wgmma")
  assert 2 <= row["selected_experts"] <= 4
  per_expert = 128 * 64 // 2 + 128 // 32 * 64  # packed codes + E8M0 scales
  io_bytes = 3 * 128 * 2 + 3 * 2 * 64 * 2     # x and the [T, top_k, N] output, bf16
  assert row["floor_bytes"] == pytest.approx(row["selected_experts"] * per_expert + io_bytes)


@pytest.mark.parametrize("implementation", [
    "xla", "interpret", "interpret:pallas_triton", "interpret:pallas_triton_gemv",
    pytest.param("pallas:pallas_triton", marks=needs_gpu),
    pytest.param("pallas:pallas_triton_gemv", marks=needs_gpu)])
@pytest.mark.parametrize("tokens,experts", [(3, 4), (2, 16)])  # pairs >= E and < E (XLA)
def test_traced_ids_out_of_range_give_nan_rows_only(rng, implementation, tokens, experts):
  """Under jit the ids cannot be checked: a pair whose id is outside [0, E) (-1, -2, E,
  E + 5) gets a NaN row, on every implementation, and every other pair still gets its own
  expert's product (before session 29 the grouped paths' sort let one bad id move valid
  pairs to other experts)."""
  k, n, top_k = 64, 32, 3
  w = make_experts(rng, experts, k, n, scale=0.1)
  x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
  ids = random_ids(rng, tokens, experts, top_k)
  bad = [(0, 1, -1), (tokens - 1, 0, experts), (tokens - 1, 2, -2)]
  if tokens > 2:
    bad.append((1, 2, experts + 5))
  for t, j, e in bad:
    ids[t, j] = e
  fn = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c, implementation=implementation))
  y = np.asarray(fn(x, w, jnp.asarray(ids)), np.float64)
  invalid = (ids < 0) | (ids >= experts)
  assert np.isnan(y[invalid]).all()
  good = np.where(invalid, 0, ids)
  ref = np_moe_matmul(x, w, good)
  assert np.isfinite(y[~invalid]).all()
  # float32 x: the grouped Triton kernel's dots are one TF32 product on a GPU (README).
  tf32 = on_gpu() and implementation.endswith("pallas_triton")
  assert rel_err(y[~invalid], ref[~invalid]) < (2e-3 if tf32 else 1e-5)
