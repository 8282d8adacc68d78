"""Reverse-mode derivatives through the kernel paths (qjax/_src/autodiff.py).

A call that runs a Pallas kernel takes its backward pass from the XLA path, so its
gradients must be the XLA path's, bit for bit, on every format; the XLA path's gradient
with respect to x must be ``dy @ W^T`` in float64 (W the weight's own dequantization),
and with respect to INT4 group scales ``sum over the group of q * (x^T dy)``. The forward
value of a differentiated call must be the kernel's own output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import qjax
from conftest import needs_gpu, on_gpu, rel_err, seed_from
from qjax._src import autodiff
from qjax._src import check
from qjax._src import dispatch

TOL = 1e-5  # float32 x and cotangent, float32 accumulation
FLOAT0 = jax.dtypes.float0


def _inputs(rng, m, k, n, dtype=jnp.float32):
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  return x, dy


def _grads(impl, x, w, dy):
  """``(y, dL/dx, dL/dw)`` for ``L = <matmul(x, w), dy>``, jitted."""

  def loss(x_, w_):
    y = qjax.matmul(x_, w_, implementation=impl)
    return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32)), y

  (_, y), (gx, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True,
                                                allow_int=True))(x, w)
  return y, gx, gw


@pytest.fixture(autouse=True)
def _float32_at_float32():
  """The float64 comparisons need float32 products: on a GPU jax's default rounds float32
  dots to TF32 (relative error about 3e-4)."""
  with jax.default_matmul_precision("highest"):
    yield


def _assert_same(u, v, what):
  """Equal bits on the CPU. On a GPU the kernel's and the XLA path's programs are two
  XLA programs whose backward passes XLA fuses differently, and a reordered float sum
  moved one bf16 element of a scale cotangent by one unit (H100, session 27): within
  1e-3 there. A 16-bit scale's cotangent may overflow to inf (a sum over the group of
  codes times x^T dy): both sides must then hold the same non-finite values."""
  if on_gpu():
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    finite = np.isfinite(u) & np.isfinite(v)
    np.testing.assert_array_equal(u[~finite], v[~finite], err_msg=what)
    assert rel_err(u[finite], v[finite]) < 1e-3, what
  else:
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=what)


def _assert_same_tree(a, b, what):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for i, (u, v) in enumerate(zip(la, lb)):
    assert u.dtype == v.dtype, (what, i, u.dtype, v.dtype)
    if u.dtype != FLOAT0:
      _assert_same(u, v, f"{what} leaf {i}")


_CASES = {c.name: c for c in check.format_cases()}


def _field_itemsize(w, i) -> int:
  return jnp.dtype(jax.tree.leaves(w)[i].dtype).itemsize


@pytest.mark.parametrize("name", sorted(_CASES))
def test_kernel_path_gradients_are_the_xla_paths(name):
  case = _CASES[name]
  rng = np.random.default_rng(seed_from(name))
  k, n = case.fit(256, 70)
  w = case.build(rng, k, n)
  x, dy = _inputs(rng, 3, k, n)
  y_x, gx_x, gw_x = _grads("xla", x, w, dy)
  try:
    y_k, gx_k, gw_k = _grads("interpret", x, w, dy)
  except NotImplementedError:
    # GPT-OSS's layout has the XLA path only, and Hopper's wgmma kernel (the NK formats)
    # no interpret mode: test_pallas_kernel_gradients_are_the_xla_paths on the GPU.
    assert not dispatch.kernels_for(w) or name.split("-")[0].endswith("_nk"), name
  else:
    # The forward value is the kernel's, as without differentiation.
    np.testing.assert_array_equal(
        np.asarray(y_k), np.asarray(jax.jit(lambda a, b: qjax.matmul(
            a, b, implementation="interpret"))(x, w)))
    assert rel_err(y_k, y_x) < TOL
    _assert_same(gx_k, gx_x, f"{name}: dL/dx")
    _assert_same_tree(gw_k, gw_x, f"{name}: weight cotangent")
  # The XLA path's dL/dx against float64.
  wd = np.asarray(jax.device_get(w.dequantize()), np.float64)
  ref = np.asarray(dy, np.float64) @ wd.T
  assert rel_err(gx_x, ref) < TOL, name
  # Integer fields get float0 cotangents; every float field a real one.
  for leaf, g in zip(jax.tree.leaves(w), jax.tree.leaves(gw_x)):
    want_float0 = not jnp.issubdtype(leaf.dtype, jnp.inexact)
    assert (g.dtype == FLOAT0) == want_float0, (name, leaf.dtype, g.dtype)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_int4_scale_gradient_against_float64(m, dtype, impl):
  # bf16 x runs the XLA paths that dequantize with bit operations (two bf16 columns per
  # uint32 word; one row: a sum over the packed words), whose own derivative in the
  # scales was zero before session 27.
  rng = np.random.default_rng(seed_from(f"scale-grad-{m}-{jnp.dtype(dtype).name}"))
  k, n, g = 256, 48, 64
  w = qjax.quantize(jnp.asarray(rng.standard_normal((k, n)) / 16, jnp.float32),
                    group_size=g, scale_dtype=jnp.float32)
  x, dy = _inputs(rng, m, k, n, dtype)
  _, _, gw = _grads(impl, x, w, dy)
  codes = np.asarray(w.dequantize(), np.float64) / np.repeat(
      np.asarray(w.scales, np.float64), g, axis=0)       # the signed codes q [K, N]
  # x^T dy [K, N], dy rounded to x's dtype as the output's cotangent is
  outer = np.asarray(x, np.float64).T @ np.asarray(dy.astype(dtype), np.float64)
  ref = (codes * outer).reshape(k // g, g, n).sum(axis=1)
  assert rel_err(gw.scales, ref) < (TOL if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("name", sorted(_CASES))
def test_xla_path_weight_gradient_is_the_dequantized_products(name, m, dtype):
  """Every float array of every format: the XLA path's cotangent equals that of
  ``x @ w.dequantize()`` in float32."""
  case = _CASES[name]
  rng = np.random.default_rng(seed_from(f"wgrad-{name}-{m}-{jnp.dtype(dtype).name}"))
  k, n = case.fit(256, 70)
  w = case.build(rng, k, n)
  x, dy = _inputs(rng, m, k, n, dtype)
  _, _, got = _grads("xla", x, w, dy)
  want = jax.grad(lambda w_: jnp.vdot(
      x.astype(jnp.float32) @ w_.dequantize().astype(jnp.float32),
      dy.astype(dtype).astype(jnp.float32)), allow_int=True)(w)
  for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    assert a.dtype == b.dtype, (name, i, a.dtype, b.dtype)
    if a.dtype == FLOAT0:
      continue
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    # A 16-bit scale's cotangent may overflow (GGUF's f16 super-block scales): the same
    # infinities on both sides.
    finite = np.isfinite(a) & np.isfinite(b)
    np.testing.assert_array_equal(a[~finite], b[~finite], err_msg=f"{name} leaf {i}")
    assert finite.any(), (name, i)
    # float32: the same products (a 16-bit field's cotangent rounded to it: on the H100
    # the sums' order differs, 2e-5 to 5e-5 in session 27); bf16: the output's cotangent
    # in bf16; float8 fields (NVFP4's block scales) hold their cotangent in float8.
    itemsize = _field_itemsize(w, i)
    if itemsize == 1:
      tol = 5e-2
    elif dtype != jnp.float32:
      tol = 1e-2
    elif itemsize != 4:
      tol = 1e-3
    else:
      # A float32 field of one element (NVFP4's tensor scale) takes the sum of all K x N
      # products: on the H100 XLA sums them in another order than the reference, and the
      # sum cancels (-321.5127 against -321.5176 for nvfp4_nk at M = 1, 1.5e-5; session 31).
      tol = 1e-4 if a.size == 1 else TOL
    assert rel_err(a[finite], b[finite]) < tol, (name, i)



def test_value_and_grad_of_a_bfloat16_call_keeps_dtypes():
  rng = np.random.default_rng(seed_from("bf16-dtypes"))
  w = qjax.quantize(jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.float32))
  x, dy = _inputs(rng, 4, 256, 64, jnp.bfloat16)
  y, gx, gw = _grads("interpret", x, w, dy)
  assert y.dtype == gx.dtype == jnp.bfloat16
  assert gw.scales.dtype == w.scales.dtype
  _, gx_x, _ = _grads("xla", x, w, dy)
  _assert_same(gx.astype(jnp.float32), gx_x.astype(jnp.float32), "dL/dx")


def test_forward_mode_names_its_limit_and_xla_takes_it():
  rng = np.random.default_rng(seed_from("jvp"))
  w = qjax.quantize(jnp.asarray(rng.standard_normal((128, 32)), jnp.float32))
  x, _ = _inputs(rng, 2, 128, 32)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda a: qjax.matmul(a, w, implementation="interpret"), (x,), (x,))
  y, t = jax.jvp(lambda a: qjax.matmul(a, w, implementation="xla"), (x,), (x,))
  _assert_same(y, t, "the tangent of a map linear in x")


def test_picks_a_kernel():
  """The wrap decision: a kernel's name wraps, "xla" does not, and a choice that raises
  one of the dispatcher's errors counts as XLA; anything else propagates."""
  assert autodiff.picks_a_kernel(lambda: "pallas_triton")
  assert not autodiff.picks_a_kernel(lambda: "xla")
  for error in (NotImplementedError, ValueError, TypeError):
    def raising(error=error):
      raise error("no kernel here")
    assert not autodiff.picks_a_kernel(raising)
  with pytest.raises(KeyError):
    autodiff.picks_a_kernel(lambda: {}["x"])
  w = qjax.quantize(jnp.ones((128, 32), jnp.float32))
  x = jnp.ones((2, 128), jnp.bfloat16)
  assert dispatch._runs_a_kernel(x, w, "interpret")
  assert not dispatch._runs_a_kernel(x, w, "xla")
  assert not dispatch._runs_a_kernel(x, jnp.ones((128, 32)), "interpret")  # a float W


def test_layer_of_under_scan():
  rng = np.random.default_rng(seed_from("layer_of"))
  ws = [qjax.quantize(jnp.asarray(rng.standard_normal((128, 128)) / 11, jnp.float32),
                      group_size=64, scale_dtype=jnp.float32) for _ in range(3)]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  x, _ = _inputs(rng, 2, 128, 128)

  def run(impl):
    def loss(x_, stack_):
      def body(h, i):
        return jnp.tanh(qjax.matmul(h, qjax.layer_of(stack_, i), implementation=impl)), None
      return jnp.sum(jax.lax.scan(body, x_, jnp.arange(3))[0] ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(x, stack)

  gx_k, gs_k = run("interpret")
  gx_x, gs_x = run("xla")
  # tanh between the layers: each backward step sees the kernel's forward values, which
  # may differ from the XLA path's in the last bits.
  assert rel_err(gx_k, gx_x) < TOL
  assert rel_err(gs_k.scales, gs_x.scales) < TOL
  assert float(jnp.abs(gs_k.scales).sum()) > 0


@pytest.mark.parametrize("mode", ["column", "row"])
def test_sharded_matmul(mode):
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  rng = np.random.default_rng(seed_from(f"sharded-{mode}"))
  w = qjax.quantize(jnp.asarray(rng.standard_normal((256, 96)) / 16, jnp.float32))
  x, dy = _inputs(rng, 3, 256, 96)
  grads = {impl: jax.grad(lambda a: jnp.vdot(
      qjax.sharded_matmul(a, w, mesh, "tp", mode, implementation=impl), dy))(x)
           for impl in ("interpret", "xla")}
  _assert_same(grads["interpret"], grads["xla"], f"{mode}: dL/dx")
  ref = np.asarray(dy, np.float64) @ np.asarray(w.dequantize(), np.float64).T
  assert rel_err(grads["xla"], ref) < TOL


@pytest.mark.parametrize("impl", ["interpret", "interpret:pallas_triton",
                                  "interpret:pallas_triton_gemv"])
@pytest.mark.parametrize("rows_per_pair", [False, True])
def test_moe_matmul(impl, rows_per_pair):
  rng = np.random.default_rng(seed_from(f"moe-{impl}-{rows_per_pair}"))
  w = qjax.quantize_mxfp4(jnp.asarray(rng.standard_normal((5, 96, 40)) / 10, jnp.float32))
  ids = jnp.asarray([[0, 2], [2, 4], [1, 0]], jnp.int32)
  x = jnp.asarray(rng.standard_normal((3, 2, 96) if rows_per_pair else (3, 96)),
                  jnp.float32)
  dy = jnp.asarray(rng.standard_normal((3, 2, 40)), jnp.float32)

  def grads(implementation):
    def loss(x_, w_):
      return jnp.vdot(qjax.moe_matmul(x_, w_, ids, implementation=implementation), dy)
    return jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(x, w)

  gx_k, gw_k = grads(impl)
  gx_x, gw_x = grads("xla")
  _assert_same(gx_k, gx_x, "dL/dx")
  _assert_same_tree(gw_k, gw_x, "experts' cotangent")
  wd = np.asarray(w.dequantize(), np.float64)[np.asarray(ids)]    # [T, top_k, K, N]
  per_pair = np.einsum("tjn,tjkn->tjk", np.asarray(dy, np.float64), wd)
  ref = per_pair if rows_per_pair else per_pair.sum(axis=1)
  assert rel_err(gx_x, ref) < TOL


def test_flax_layers_differentiate_through_the_kernel():
  from flax import nnx
  from flax_layers import Int4Dense, Int4Linear
  rng = np.random.default_rng(seed_from("flax"))
  x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
  params = {impl: Int4Dense(24, implementation=impl).init(jax.random.key(0), x)
            for impl in ("interpret", "xla")}
  grads = {impl: jax.grad(lambda a, impl=impl: jnp.sum(jnp.sin(Int4Dense(
      24, implementation=impl).apply(params[impl], a))))(x) for impl in params}
  # sin of the output: the backward pass sees the kernel's forward values.
  assert rel_err(grads["interpret"], grads["xla"]) < TOL
  assert float(jnp.abs(grads["xla"]).sum()) > 0

  layers = {impl: Int4Linear(128, 24, implementation=impl, rngs=nnx.Rngs(0))
            for impl in ("interpret", "xla")}
  nnx_grads = {impl: jax.grad(lambda a, layer=layer: jnp.sum(jnp.sin(layer(a))))(x)
               for impl, layer in layers.items()}
  assert rel_err(nnx_grads["interpret"], nnx_grads["xla"]) < TOL


# -- the compiled kernels (GPU) -----------------------------------------------------------

_GPU_FORMATS = ["int4-sym-g128", "int4-asym-g64-f16", "int4_nk-sym-g128",
                "int4_nk-asym-g64-f16", "mxfp4", "nvfp4", "mxfp4_nk", "gguf-Q4_K",
                "marlin-sym-g128"]


@needs_gpu
@pytest.mark.parametrize("m", [1, 16, 200])
@pytest.mark.parametrize("name", _GPU_FORMATS)
def test_pallas_kernel_gradients_are_the_xla_paths(name, m):
  case = _CASES[name]
  rng = np.random.default_rng(seed_from(f"gpu-{name}-{m}"))
  k, n = case.fit(1024, 384)
  w = case.build(rng, k, n)
  x, dy = _inputs(rng, m, k, n, jnp.bfloat16)
  y_k, gx_k, gw_k = _grads("pallas", x, w, dy)
  _, gx_x, gw_x = _grads("xla", x, w, dy)
  plain = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="pallas"))(x, w)
  np.testing.assert_array_equal(np.asarray(y_k, np.float32), np.asarray(plain, np.float32))
  _assert_same(gx_k.astype(jnp.float32), gx_x.astype(jnp.float32), f"{name}: dL/dx")
  _assert_same_tree(gw_k, gw_x, f"{name}: weight cotangent")
  wd = np.asarray(jax.device_get(w.dequantize()), np.float64)
  assert rel_err(gx_k, np.asarray(dy, np.float64) @ wd.T) < 1e-2  # bf16 x, dy and dL/dx


@needs_gpu
@pytest.mark.parametrize("tokens", [1, 4, 40])
def test_pallas_moe_gradients_are_the_xla_paths(tokens):
  rng = np.random.default_rng(seed_from(f"gpu-moe-{tokens}"))
  w = qjax.quantize_mxfp4(jnp.asarray(rng.standard_normal((8, 512, 256)) / 22, jnp.float32))
  ids = jnp.asarray(rng.integers(0, 8, (tokens, 2)), jnp.int32)
  x = jnp.asarray(rng.standard_normal((tokens, 512)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((tokens, 2, 256)), jnp.bfloat16)
  grads = {impl: jax.jit(jax.grad(lambda a, impl=impl: jnp.vdot(
      qjax.moe_matmul(a, w, ids, implementation=impl).astype(jnp.float32),
      dy.astype(jnp.float32))))(x) for impl in ("pallas", "xla")}
  _assert_same(grads["pallas"].astype(jnp.float32), grads["xla"].astype(jnp.float32),
               "dL/dx")
  wd = np.asarray(w.dequantize(), np.float64)[np.asarray(ids)]    # [T, 2, K, N]
  ref = np.einsum("tjn,tjkn->tk", np.asarray(dy, np.float64), wd)
  assert rel_err(grads["pallas"], ref) < 1e-2  # bf16 x, dy and dL/dx


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_xla_path_weight_gradient_is_the_dequantized_products(dtype):
  """NVFP4 experts in the NK layout (float8 block scales, float32 global scales): the XLA
  path's cotangent of each float array equals that of the selected experts' float32
  products with ``w.dequantize()``."""
  rng = np.random.default_rng(seed_from(f"moe-wgrad-{jnp.dtype(dtype).name}"))
  w = qjax.to_nvfp4_nk(qjax.quantize_nvfp4(
      jnp.asarray(rng.standard_normal((4, 128, 128)) / 10, jnp.float32)))
  ids = jnp.asarray([[0, 2], [3, 1], [1, 1]], jnp.int32)
  x = jnp.asarray(rng.standard_normal((3, 128)), dtype)
  dy = jnp.asarray(rng.standard_normal((3, 2, 128)), jnp.float32)
  got = jax.grad(lambda w_: jnp.vdot(qjax.moe_matmul(
      x, w_, ids, implementation="xla").astype(jnp.float32), dy), allow_int=True)(w)
  want = jax.grad(lambda w_: jnp.vdot(jnp.einsum(
      "tk,tjkn->tjn", x.astype(jnp.float32), w_.dequantize()[ids]),
      dy.astype(dtype).astype(jnp.float32)), allow_int=True)(w)
  floats = 0
  for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    assert a.dtype == b.dtype, (i, a.dtype, b.dtype)
    if a.dtype == FLOAT0:
      continue
    floats += 1
    itemsize = _field_itemsize(w, i)
    tol = 5e-2 if itemsize == 1 else (TOL if dtype == jnp.float32 else 1e-2)
    assert rel_err(a, b) < tol, (i, a.dtype)
  assert floats == 2  # the block scales and the global scales
