"""GGUF expert stacks: 3-D tensors of every supported type (MoE GGUF files such as
Qwen3-MoE's and Mixtral's ``blk.N.ffn_{gate,up,down}_exps.weight``, GGUF dims
``[K, N, E]``) load as one pytree with a leading expert axis, bit-exact against
``gguf.quants.dequantize``, and go through :func:`qjax.moe_matmul`'s XLA path (decode:
the selected experts gathered; more pairs than experts: every expert and ragged_dot)
against a float64 reference of the same contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import qjax  # noqa: E402
import test_gguf_formats as gguf_formats_tests  # noqa: E402
import test_sharding  # noqa: E402  (its _mesh skips where devices are fewer)
from conftest import seed_from  # noqa: E402
from qjax._src import gguf_formats as gf  # noqa: E402
from qjax._src import gguf_io  # noqa: E402
from qjax._src import moe  # noqa: E402

QT = gguf.GGMLQuantizationType
TYPES = (*gf.BLOCK_FORMATS, *gf.DENSE_TYPES)
E = 6


def _k_for(ggml_type: str) -> int:
  """A row length that every block of the type divides (K-quants: 256)."""
  return 256 if ggml_type.endswith("_K") else 96


def _stored(ggml_type: str, e: int, n: int, k: int, seed: int) -> np.ndarray:
  """``[E, N, row_bytes]`` uint8 (block types: as test_gguf_formats draws them, quantized
  by gguf-py where it can, else random blocks with finite scales) or ``[E, N, K]`` values
  (dense), rows of different magnitudes."""
  if ggml_type in gf.BLOCK_FORMATS:
    return gguf_formats_tests._raw_blocks(ggml_type, e * n, k, seed).reshape(e, n, -1)
  rng = np.random.default_rng(seed)
  w = (rng.standard_normal((e, n, k)) * rng.uniform(0.01, 3.0, (e, n, 1))).astype(np.float32)
  if ggml_type == "F16":
    return w.astype(np.float16)
  return w if ggml_type == "F32" else gguf.quants.quantize(w, QT[ggml_type])


def _write(path, tensors: dict[str, tuple[np.ndarray, str]]) -> str:
  writer = gguf.GGUFWriter(str(path), "llama")
  for name, (data, ggml_type) in tensors.items():
    raw_dtype = None if ggml_type in ("F32", "F16") else QT[ggml_type]
    writer.add_tensor(name, data, raw_dtype=raw_dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def _gguf_f32(stored: np.ndarray, ggml_type: str) -> np.ndarray:
  """gguf-py's dequantization, ``[E, N, K]`` float32."""
  return np.asarray(gguf.quants.dequantize(stored, QT[ggml_type]), np.float32)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
  """type -> (loaded stack, gguf's ``[E, K, N]`` float32 values, stored data)."""
  path = tmp_path_factory.mktemp("experts") / "experts.gguf"
  stored = {t: _stored(t, E, 40, _k_for(t), seed_from(t) + i) for i, t in enumerate(TYPES)}
  _write(path, {f"{t}.ffn_gate_exps.weight": (stored[t], t) for t in TYPES})
  tensors = gguf_io.load_gguf(path, progress=False).tensors
  return {t: (tensors[f"{t}.ffn_gate_exps.weight"],
              _gguf_f32(stored[t], t).swapaxes(-1, -2), stored[t]) for t in TYPES}


def _bits(a) -> np.ndarray:
  return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_every_type_loads_as_one_expert_stack(stacks, ggml_type):
  w, want, stored = stacks[ggml_type]
  k = _k_for(ggml_type)
  assert w.shape == (k, 40) and w.leading_axes == (E,), (type(w).__name__, w.shape)
  assert isinstance(w, gf.BLOCK_FORMATS.get(ggml_type, gf.GGUFDense))
  np.testing.assert_array_equal(w.to_bytes(), np.asarray(stored).view(np.uint8).reshape(
      E, 40, -1))
  got = jax.jit(lambda w: w.dequantize())(w)
  assert got.shape == (E, k, 40)
  np.testing.assert_array_equal(_bits(got), _bits(want))  # bit for bit, NaN payloads too
  one = jax.tree.map(lambda a: a[2], w)  # one expert is the 2-D weight of its bytes
  assert one.leading_axes == ()
  np.testing.assert_array_equal(_bits(one.dequantize()), _bits(want[2]))
  with pytest.raises(ValueError, match="leading axes"):
    w.take_rows(jnp.arange(2))


def _reference(x: np.ndarray, w_ekn: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """float64 ``y[t, j] = x[t (, j)] @ W[ids[t, j]]``, ``[T, top_k, N]``."""
  x64, w64 = x.astype(np.float64), w_ekn.astype(np.float64)[ids]      # [T, k, K, N]
  if x.ndim == 2:
    return np.einsum("tk,tjkn->tjn", x64, w64)
  return np.einsum("tjk,tjkn->tjn", x64, w64)


# (tokens, top_k, per-pair rows): 1 and 2 tokens gather their experts (pairs < E), 7
# tokens sort the pairs for ragged_dot (pairs >= E), one expert left unselected.
CALLS = [(1, 2, False), (2, 2, True), (7, 3, False), (7, 2, True)]


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_moe_matmul_on_gguf_stacks_matches_float64(stacks, ggml_type, dtype):
  w, want_w, _ = stacks[ggml_type]
  k = w.shape[0]
  rng = np.random.default_rng(seed_from(f"{ggml_type}-{jnp.dtype(dtype).name}"))
  assert moe.moe_implementation_name(w, None, 2) == "xla"  # no MoE kernel takes GGUF blocks
  for t, top_k, per_pair in CALLS:
    x = rng.standard_normal((t, top_k, k) if per_pair else (t, k)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype), np.float32)  # the values the call sees
    ids = np.stack([rng.choice(E - 1, top_k, replace=False) for _ in range(t)]).astype(
        np.int32)
    want = _reference(x, want_w, ids)
    for fn in (qjax.moe_matmul, jax.jit(qjax.moe_matmul)):
      y = fn(jnp.asarray(x, dtype), w, jnp.asarray(ids))
      assert y.shape == (t, top_k, w.shape[1]) and y.dtype == dtype
      err = np.max(np.abs(np.asarray(y, np.float64) - want)) / np.max(np.abs(want))
      # float32: the products and f32 sums of XLA's dot; bf16: the output's rounding
      assert err < (2e-6 if dtype == jnp.float32 else 8e-3), (t, top_k, per_pair, err)


def test_traced_ids_out_of_range_are_nan_rows(stacks):
  """Under jit the ids cannot be checked: a pair whose id is out of range gets a NaN row,
  the others their products (both paths); concrete ids out of range raise."""
  w, want_w, _ = stacks["Q4_K"]
  rng = np.random.default_rng(1)
  for ids in ([[E, 2]], [[0, 1], [E, 2], [3, -1], [4, 5]]):  # gathered; ragged_dot
    ids = np.asarray(ids, np.int32)
    x = rng.standard_normal((len(ids), w.shape[0])).astype(np.float32)
    y = np.asarray(jax.jit(qjax.moe_matmul)(jnp.asarray(x), w, jnp.asarray(ids)))
    bad = (ids < 0) | (ids >= E)
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    ref = _reference(x, want_w, np.clip(ids, 0, E - 1))
    assert np.max(np.abs(y[~bad] - ref[~bad])) < 2e-6 * np.max(np.abs(ref[~bad]))
  with pytest.raises(ValueError, match=rf"must lie in \[0, {E}\)"):
    qjax.moe_matmul(jnp.asarray(x), w, jnp.asarray(ids))


def test_kernels_and_wrong_stacks_are_refused_clearly(stacks):
  w, _, _ = stacks["Q4_0"]
  x = jnp.ones((1, w.shape[0]), jnp.float32)
  ids = jnp.asarray([[0, 1]], jnp.int32)
  with pytest.raises(NotImplementedError, match="no Pallas MoE kernel is registered for "
                     "GGUFQ4_0.*implementation='xla'"):
    qjax.moe_matmul(x, w, ids, implementation="interpret")
  one = jax.tree.map(lambda a: a[0], w)
  with pytest.raises(ValueError, match=r"leading axes \(\): moe_matmul needs exactly one "
                     "leading expert axis"):
    qjax.moe_matmul(x, one, ids)
  four = jax.tree.map(lambda a: jnp.stack([a, a]), w)
  with pytest.raises(ValueError, match=rf"leading axes \(2, {E}\)"):
    qjax.moe_matmul(x, four, ids)


def test_layer_of_a_stack_of_expert_stacks(stacks):
  """``[layers, E, ...]`` (a scanned MoE model's stacked experts): ``qjax.layer_of`` reads
  one layer in place, equal to that layer's stack."""
  w, _, _ = stacks["Q6_K"]
  other = jax.tree.map(lambda a: a[::-1], w)  # the experts in reverse: another layer
  layers = jax.tree.map(lambda a, b: jnp.stack([a, b]), w, other)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, w.shape[0])), jnp.float32)
  ids = jnp.asarray([[0, 4], [5, 1]], jnp.int32)

  def body(_, i):
    return None, qjax.moe_matmul(x, qjax.layer_of(layers, i), ids)

  _, ys = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(2)))()
  for i, each in enumerate((w, other)):
    want = np.asarray(qjax.moe_matmul(x, each, ids))
    assert np.max(np.abs(np.asarray(ys[i]) - want)) < 1e-6 * np.max(np.abs(want)), i


def test_gradient_in_x_is_the_dense_products(stacks):
  w, want_w, _ = stacks["Q8_0"]
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, w.shape[0])), jnp.float32)
  ids = jnp.asarray([[0, 3], [3, 5]], jnp.int32)
  g = rng.standard_normal((2, 2, w.shape[1]))
  got = jax.grad(lambda x: jnp.sum(qjax.moe_matmul(x, w, ids) * g))(x)
  want = np.einsum("tjn,tjkn->tk", g, want_w.astype(np.float64)[np.asarray(ids)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_expert_parallel_load_reads_only_each_devices_experts(tmp_path):
  """``load_gguf_sharded`` splits a K-quant expert stack by "expert" as it does GPT-OSS's
  MXFP4 one (tests/test_sharding.py): each device holds whole experts, the same values."""
  mesh = test_sharding._mesh(2)  # pylint: disable=protected-access
  stored = _stored("Q4_K", E, 8, 256, 11)
  path = _write(tmp_path / "q4k.gguf", {"blk.0.ffn_up_exps.weight": (stored, "Q4_K")})
  f = qjax.load_gguf_sharded(path, mesh, "tp", {"blk.0.ffn_up_exps.weight": "expert"},
                             wrap=True)
  sw = f.tensors["blk.0.ffn_up_exps.weight"]
  assert sw.format_cls is qjax.GGUFQ4_K and sw.global_shape == (256, 8)
  shards = {tuple(s.data.shape) for s in sw.arrays["qs"].addressable_shards}
  assert shards == {(E // 2, 8, 1, 128)}
  np.testing.assert_array_equal(_bits(sw.weight().dequantize()),
                                _bits(_gguf_f32(stored, "Q4_K").swapaxes(-1, -2)))


def test_unsupported_types_of_more_than_two_dims_raise(tmp_path):
  rng = np.random.default_rng(4)
  raw = gguf.quants.quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), QT.Q5_0)
  path = _write(tmp_path / "q5_0_3d.gguf", {"w": (raw, "Q5_0")})
  with pytest.raises(ValueError, match="3-D Q5_0 tensor .* only for types Q4_0"):
    gguf_io.load_gguf(path, progress=False)


def test_kernel_layouts_keep_stacks_the_dense_kernels_cannot_read(stacks):
  """The dense kernels' layouts (Int4Weight, GGUFTiledWeight) hold one matrix: a GGUF
  expert stack keeps its type under ``qjax.kernel_layouts`` unless ``experts`` names it
  and an MoE kernel reads its converted stack: MXFP4's (MXFP4Weight, either way, as
  before) and Q4_0 / Q4_1's (Int4Weight, whose dense kernel declines a stack).
  ``kernel_layout`` (generate's per-weight convert) converts exactly those three types'
  stacks."""
  import test_kernel_layouts  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_tiled  # pylint: disable=g-import-not-at-top
  hopper = test_kernel_layouts.HOPPER
  for t in gf.BLOCK_FORMATS:
    w, want_w, _ = stacks[t]
    new = gguf_tiled.kernel_layout(w)
    assert gguf_tiled.converts(w) == (new is not w), t  # generate skips the rest
    trees, reasons = [], []
    for experts in (None, lambda path: True):
      tree, (choice,) = qjax.kernel_layouts({"w": w}, device=hopper, experts=experts,
                                            with_report=True)
      trees.append(tree["w"])
      reasons.append(choice.reason)
    if t in ("MXFP4", "Q4_0", "Q4_1"):
      target = qjax.MXFP4Weight if t == "MXFP4" else qjax.Int4Weight
      assert isinstance(new, target) and new.codes.shape[0] == E, t
      np.testing.assert_array_equal(_bits(new.dequantize()), _bits(want_w))
      assert type(trees[1]) is target, (t, reasons)  # as an expert stack: the MoE kernel
      if t == "MXFP4":
        assert type(trees[0]) is target, (t, reasons)
      else:  # the dense INT4 kernel reads one matrix
        assert trees[0] is w and "expert stack" in reasons[0], reasons
      continue
    assert new is w and trees[0] is w and trees[1] is w, t
    assert "a stack of (6,) matrices" in reasons[0], reasons  # the dense kernel's check
    assert "no kernel for" in reasons[1], reasons  # as an expert stack: no MoE kernel
    with pytest.raises(ValueError, match=r"needs a single matrix; this one has leading axes "
                       r"\(6,\)"):
      gguf_tiled.GGUFTiledWeight.from_gguf(w)


def test_generate_converts_exactly_the_weights_kernel_layout_changes(request):
  """``qjax generate``'s load-time convert runs jitted ``kernel_layout`` only where it
  changes the layout (``gguf_tiled.converts``): a jitted identity would copy the weight
  (a float embedding, say) for nothing."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_tiled  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(request.node.name))
  convert = generate._kernel_layouts("interpret")  # pylint: disable=protected-access
  dense = gf.GGUFDense.from_bytes(rng.standard_normal((64, 32)).astype(np.float32),
                                  (32, 64), "F32")
  assert not gguf_tiled.converts(dense) and gguf_tiled.kernel_layout(dense) is dense
  assert convert("token_embd.weight", dense) is dense
  for t in ("Q4_0", "Q8_0", "Q4_K", "MXFP4"):
    k = 256
    raw = gguf_formats_tests._raw_blocks(t, 3, k, 1)  # pylint: disable=protected-access
    w = gf.from_gguf_bytes(raw, t, (k, 3), ())
    assert gguf_tiled.converts(w), t
    got = convert("blk.0.attn_q.weight", w)
    want = gguf_tiled.kernel_layout(w)
    assert type(got) is type(want), t
    np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(want.dequantize()))
