"""Every XLA formulation of the int4 matmul (qjax._src.int4_xla_variants) against float64.

Weights are built from random words (padding nibbles of a ragged K included, which every
variant must ignore), random scales, zero points and biases, not from qjax.quantize.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import int4
from qjax._src import int4_xla_variants as variants
from qjax._src import packing
from conftest import rel_err, seed_from

VARIANTS = tuple(variants.VARIANTS)
# (M, K, N, group size or None for per-channel, scale dtype): ragged K (not a multiple of
# the 128-row tile) and ragged N included.
SHAPES = ((16, 256, 384, 128, jnp.bfloat16), (1, 96, 33, 32, jnp.float16),
          (5, 200, 70, None, jnp.float32), (17, 416, 130, 32, jnp.bfloat16))
KINDS = ("symmetric", "zeros", "biases")
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}


def random_weight(rng, k, n, group_size, scale_dtype, kind, tile_k=packing.NATIVE_TILE_K):
  g = group_size or k
  words = rng.integers(0, 2**32, (packing.padded_rows(k, tile_k) // 8, n), dtype=np.uint32)
  scales = jnp.asarray(rng.uniform(0.5, 1.5, (k // g, n)) / np.sqrt(k), scale_dtype)
  zeros = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8) if kind == "zeros" else None
  biases = (jnp.asarray(rng.standard_normal((k // g, n)) * 0.1, scale_dtype)
            if kind == "biases" else None)
  return qjax.Int4Weight(codes=jnp.asarray(words), scales=scales, zeros=zeros, shape=(k, n),
                         group_size=g, tile_k=tile_k, biases=biases)


def reference(x, w):
  """float64 x @ W, W rebuilt in numpy from the words."""
  k, _ = w.shape
  q = packing.unpack_codes(np.asarray(w.codes), k, w.tile_k).astype(np.float64)
  rep = lambda a: np.repeat(np.asarray(a, np.float64), w.group_size, axis=0)
  if w.biases is not None:
    wd = q * rep(w.scales) + rep(w.biases)
  else:
    wd = (q - (8.0 if w.zeros is None else rep(w.zeros))) * rep(w.scales)
  return np.asarray(x, np.float64) @ wd


def check(variant, x, w):
  y = jax.jit(lambda a, b: variants.matmul(a, b, variant))(x, w)
  assert y.shape == (x.shape[0], w.shape[1]) and y.dtype == x.dtype
  y = np.asarray(y, np.float64)
  assert np.isfinite(y).all()
  err = rel_err(y, reference(x, w))
  assert err < TOL[x.dtype.type], (variant, x.dtype, err)


# Each (shape, kind) pair runs with one x dtype, in a Latin square: every variant meets
# each dtype with every shape and with every kind (a third of the full product's compiles).
CASES = [(shape, kind, DTYPES[(i + j) % 3]) for i, shape in enumerate(SHAPES)
         for j, kind in enumerate(KINDS)]


def case_id(case):
  (m, k, n, g, _), kind, dt = case
  return f"M{m}-K{k}-N{n}-G{g or 'chan'}-{kind}-{jnp.dtype(dt).name}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_float64(request, variant, case):
  (m, k, n, g, scale_dtype), kind, dt = case
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  w = random_weight(rng, k, n, g, scale_dtype, kind)
  check(variant, jnp.asarray(rng.standard_normal((m, k)), dt), w)


@pytest.mark.parametrize("variant", VARIANTS)
def test_plain_tile_order(request, variant):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  w = random_weight(rng, 192, 48, 64, jnp.bfloat16, "zeros", tile_k=packing.PLAIN_TILE_K)
  check(variant, jnp.asarray(rng.standard_normal((3, 192)), jnp.bfloat16), w)


def test_int4_is_materialize_bit_for_bit(request):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  for kind in KINDS:
    w = random_weight(rng, 256, 64, 32, jnp.bfloat16, kind)
    for dt in (jnp.bfloat16, jnp.float32):
      e = jnp.eye(256, dtype=dt)  # x = I: y is the dequantized W itself
      np.testing.assert_array_equal(np.asarray(variants.matmul_int4(e, w)),
                                    np.asarray(int4.matmul_xla_materialize(e, w)))


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dense_dot_writes_x_dtype_from_the_dot(request, dt):
  """formats.dense_dot (every XLA fallback's dot): x's dtype straight from the dot, no
  float32 result converted afterwards (that convert was a second kernel on the GPU), and
  the float64 product within the dtype's tolerance."""
  from qjax._src import formats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  x = jnp.asarray(rng.standard_normal((5, 300)), dt)
  wd = jnp.asarray(rng.standard_normal((300, 70)) / 17, dt)
  y = formats.dense_dot(x, wd)
  assert y.dtype == x.dtype
  ref = np.asarray(x, np.float64) @ np.asarray(wd, np.float64)
  assert rel_err(np.asarray(y, np.float64), ref) < TOL[dt]
  eqns = jax.make_jaxpr(formats.dense_dot)(x, wd).jaxpr.eqns
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 1 and dots[0].outvars[0].aval.dtype == x.dtype
  assert eqns[-1] is dots[0], [e.primitive.name for e in eqns]  # nothing after the dot


def test_switch_routes_matmul_xla(request, monkeypatch):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  w = random_weight(rng, 256, 40, 128, jnp.bfloat16, "symmetric")
  x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
  assert int4.XLA_VARIANT == "auto"
  calls = []
  monkeypatch.setitem(variants.VARIANTS, "reduce",
                      lambda a, b: calls.append(a.shape) or variants.matmul_reduce(a, b))
  monkeypatch.setattr(int4, "XLA_VARIANT", "reduce")
  y = qjax.matmul(x, w, implementation="xla")
  assert calls == [(6, 256)] and y.shape == (2, 3, 40)
  assert rel_err(y.reshape(6, 40), reference(x.reshape(6, 256), w)) < 1e-5
  monkeypatch.setattr(int4, "XLA_VARIANT", "nope")
  with pytest.raises(ValueError, match="unknown int4 XLA variant 'nope'"):
    qjax.matmul(x, w, implementation="xla")


def test_auto_uses_select(monkeypatch, request):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  w = random_weight(rng, 128, 16, 32, jnp.bfloat16, "zeros")
  monkeypatch.setattr(variants, "AUTO_RULES", ((4, "reduce"), (None, "folded")))
  monkeypatch.setattr(variants, "AUTO_PLATFORMS", (jax.devices()[0].platform,))
  assert [variants.select(m, w) for m in (1, 4, 5, 300)] == ["reduce"] * 2 + ["folded"] * 2
  monkeypatch.setattr(variants, "AUTO_PLATFORMS", ())
  assert variants.select(1, w) == "materialize"
  check("auto", jnp.asarray(rng.standard_normal((7, 128)), jnp.float32), w)


def test_bench_example_runs(capsys):
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "xla_fallback_bench.py"
  spec = importlib.util.spec_from_file_location("xla_fallback_bench", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert mod.main(["--tiny", "--shapes", "256x64", "--ms", "1,3", "--calls", "1"]) == 0
  out = capsys.readouterr().out
  assert "materialize" in out and "naive" in out and "FAIL" not in out
  assert len([l for l in out.splitlines() if l.startswith("  256    64")]) == 2


@pytest.mark.parametrize("dt", (jnp.bfloat16, jnp.float16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", (6, 7), ids=("even_n", "odd_n"))
def test_column_pairs_is_columns_bit_for_bit(request, dt, n):
  """formats.column_pairs: two columns per uint32 word, the same bits as computing all
  columns at once (batch dims and a None input passed through; odd N unpaired)."""
  from qjax._src import formats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  a = jnp.asarray(rng.standard_normal((2, 5, n)) * 100, jnp.float32)
  b = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
  seen = []

  def columns(u, none, v):
    seen.append((u.shape, none))
    return jnp.exp(u / 50) * v - u

  y = jax.jit(lambda u, v: formats.column_pairs(columns, (u, None, v), dt))(a, b)
  want = columns(a, None, b).astype(dt)
  assert y.shape == (2, 5, n) and y.dtype == dt
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))
  assert seen[0] == (((2, 5, n // 2), None) if n % 2 == 0 else ((2, 5, n), None))
  f32 = formats.column_pairs(columns, (a, None, b), jnp.float32)  # not paired
  np.testing.assert_array_equal(np.asarray(f32), np.asarray(columns(a, None, b)))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_int4_in_16_bits_is_float32_rounded(request, kind):
  """int4.dequantize_int4 in bf16 / f16 (the materialize path's W, two columns per word)
  rounds the float32 W once: bit for bit, ragged K and odd N included."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  for k, n in ((256, 64), (200, 33)):
    w = random_weight(rng, k, n, 8 if k == 200 else 32, jnp.bfloat16, kind)
    full = np.asarray(int4.dequantize_int4(w), np.float32)
    for dt in (jnp.bfloat16, jnp.float16):
      got = np.asarray(jax.jit(lambda v: int4.dequantize_int4(v, dt))(w))
      np.testing.assert_array_equal(got.view(np.uint16),
                                    full.astype(dt).view(np.uint16), err_msg=f"{k}x{n} {dt}")
