"""The Int4Weight pytree, its quantizer, dequantizer, save/load and argument checks."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax


def numpy_rtn(w, group_size, symmetric, scale_dtype):
  """Independent float64 RTN min-max reference: codes, scales (rounded), zeros."""
  k, n = w.shape
  g32 = w.reshape(k // group_size, group_size, n).astype(np.float32)
  g = g32.astype(np.float64)
  # Scales are computed in float32 (as stored), then rounded to the scale dtype.
  if symmetric:
    s = (np.abs(g32).max(1) / np.float32(7)).astype(scale_dtype).astype(np.float64)
    safe = np.where(s > 0, s, 1.0)
    q = np.clip(np.round(g / safe[:, None]), -8, 7) + 8
    z = np.full_like(s, 8.0)
  else:
    lo, hi = np.minimum(g32.min(1), 0), np.maximum(g32.max(1), 0)
    s = ((hi - lo) / np.float32(15)).astype(scale_dtype).astype(np.float64)
    lo = lo.astype(np.float64)
    safe = np.where(s > 0, s, 1.0)
    z = np.clip(np.round(-lo / safe), 0, 15)
    q = np.clip(np.round(g / safe[:, None]) + z[:, None], 0, 15)
  deq = ((q - z[:, None]) * s[:, None]).reshape(k, n)
  return q.reshape(k, n), s, z, deq


@pytest.mark.parametrize("group_size", [32, 64, 128, 256, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_quantize_matches_numpy_reference(rng, group_size, symmetric, scale_dtype):
  k, n = 512, 24
  w = rng.standard_normal((k, n)).astype(np.float32)
  qw = qjax.quantize(w, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype)
  g = group_size or k
  q, s, z, deq = numpy_rtn(w, g, symmetric, jnp.dtype(scale_dtype))
  codes = np.asarray(qw.unpacked_codes())
  # Rounding ties may differ between float32 and float64 division: allow a handful.
  assert np.mean(codes != q) < 1e-3
  # Equal up to one float32 rounding (XLA may divide by a reciprocal multiply).
  np.testing.assert_allclose(np.asarray(qw.scales, np.float64), s, rtol=2.5e-7, atol=0)
  ref = np.asarray(qw.dequantize(), np.float64)
  assert np.abs(ref - deq).max() <= np.abs(s).max() * 1.0001
  assert qw.scales.dtype == jnp.dtype(scale_dtype)
  assert qw.symmetric == symmetric
  assert qw.group_size == g


def test_mse_clipping_not_worse_than_minmax(rng):
  w = rng.standard_t(3, (1024, 64)).astype(np.float32)  # heavy tails: clipping helps
  err = lambda qw: float(np.linalg.norm(np.asarray(qw.dequantize()) - w))
  e_mm = err(qjax.quantize(w, group_size=128))
  e_mse = err(qjax.quantize(w, group_size=128, method="mse"))
  assert e_mse < e_mm


def test_zero_groups_give_zero_scales_without_nan():
  w = np.zeros((256, 4), np.float32)
  w[:, 0] = 1.0
  for sym in (True, False):
    qw = qjax.quantize(w, group_size=128, symmetric=sym)
    d = np.asarray(qw.dequantize())
    assert np.isfinite(d).all()
    np.testing.assert_array_equal(d[:, 1:], 0.0)
    np.testing.assert_allclose(d[:, 0], 1.0, rtol=1e-2)


def test_pytree_jit_vmap_tree_map_device_put(rng):
  ws = [qjax.quantize(rng.standard_normal((256, 32)).astype(np.float32), group_size=64)
        for _ in range(3)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  assert stacked.codes.shape == (3, 32, 32)
  deq = jax.vmap(lambda w: w.dequantize())(stacked)
  for i, w in enumerate(ws):
    np.testing.assert_array_equal(np.asarray(deq[i]), np.asarray(w.dequantize()))
  x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
  y = jax.jit(jax.vmap(lambda w: qjax.matmul(x, w, implementation="xla")))(stacked)
  assert y.shape == (3, 5, 32)
  moved = jax.device_put(ws[0], jax.devices()[0])
  assert isinstance(moved, qjax.Int4Weight) and moved.shape == (256, 32)
  halved = jax.tree.map(lambda a: a, ws[0])
  assert halved == ws[0] or isinstance(halved, qjax.Int4Weight)
  out = jax.jit(lambda w: w)(ws[1])
  np.testing.assert_array_equal(np.asarray(out.codes), np.asarray(ws[1].codes))


def test_repack_keeps_values(rng):
  qw = qjax.quantize(rng.standard_normal((384, 16)).astype(np.float32), group_size=32,
                     symmetric=False)
  for tile in (8, 256):
    np.testing.assert_array_equal(np.asarray(qw.repack(tile).dequantize()),
                                  np.asarray(qw.dequantize()))


def test_save_load_round_trip(tmp_path, rng):
  qw = qjax.quantize(rng.standard_normal((256, 48)).astype(np.float32), group_size=32,
                     symmetric=False, scale_dtype=jnp.float16)
  bias = rng.standard_normal(48).astype(np.float32)
  path = tmp_path / "layer.safetensors"
  qjax.save(path, {"dense/kernel": qw, "dense/bias": bias})
  out = qjax.load(path)
  assert set(out) == {"dense/kernel", "dense/bias"}
  k = out["dense/kernel"]
  assert isinstance(k, qjax.Int4Weight)
  assert (k.shape, k.group_size, k.tile_k, k.symmetric) == ((256, 48), 32, 128, False)
  np.testing.assert_array_equal(np.asarray(k.dequantize()), np.asarray(qw.dequantize()))
  np.testing.assert_array_equal(out["dense/bias"], bias)
  assert [p.name for p in tmp_path.iterdir()] == ["layer.safetensors"]  # no temp left


def test_load_detects_corruption(tmp_path, rng):
  qw = qjax.quantize(rng.standard_normal((128, 8)).astype(np.float32))
  path = tmp_path / "w.safetensors"
  qjax.save(path, {"w": qw})
  raw = bytearray(path.read_bytes())
  raw[-1] ^= 0xFF
  path.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match="sha256"):
    qjax.load(path)
  path.write_bytes(b"not a safetensors file at all")
  with pytest.raises(ValueError, match="safetensors"):
    qjax.load(path)


def test_killed_save_leaves_previous_file(tmp_path, rng):
  path = tmp_path / "w.safetensors"
  qw = qjax.quantize(rng.standard_normal((128, 8)).astype(np.float32))
  qjax.save(path, {"w": qw})
  script = (
      "import os, signal, numpy as np, qjax\n"
      "from qjax._src import serialization\n"
      "real = os.replace\n"
      "def die(*a):\n"
      "    os.kill(os.getpid(), signal.SIGKILL)\n"
      "serialization.os.replace = die\n"
      f"qjax.save({str(path)!r}, {{'w': np.ones((64, 64), np.float32)}})\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
  assert proc.returncode == -9, proc.stderr.decode()
  out = qjax.load(path)
  np.testing.assert_array_equal(np.asarray(out["w"].dequantize()), np.asarray(qw.dequantize()))


@pytest.mark.parametrize("bad,match", [
    (dict(w=np.ones((100, 8), np.float32), group_size=128), "K=100 must be a multiple of "
     "group_size=128"),
    (dict(w=np.ones((128, 8), np.int32)), "floating point"),
    (dict(w=np.ones((128, 8), np.float32), group_size=48), "group_size=48"),
    (dict(w=np.ones((128, 8), np.float32), group_size=64.0), r"group_size=64.0 .*an int"),
    (dict(w=np.ones((128, 8), np.float32), group_size=True), "group_size=True"),
    (dict(w=np.ones((128, 8), np.float32), scale_dtype=jnp.int8), "scale_dtype"),
    (dict(w=np.ones((128,), np.float32)), r"\[K, N\] matrix"),
])
def test_quantize_rejects_bad_input(bad, match):
  w = bad.pop("w")
  with pytest.raises(ValueError, match=match):
    qjax.quantize(w, **bad)


def test_quantize_rejects_nonfinite_weights_with_name():
  w = np.ones((128, 4), np.float32)
  w[5, 2] = np.nan
  with pytest.raises(ValueError, match=r"layer3.*non-finite.*\(5, 2\)"):
    qjax.quantize(w, name="layer3")


def test_quantize_scale_overflow_in_f16_warns_and_uses_f32():
  w = np.full((128, 2), 1e6, np.float32)  # scale 1.4e5 > f16 max
  with pytest.warns(UserWarning, match="do not fit float16"):
    qw = qjax.quantize(w, scale_dtype=jnp.float16)
  assert qw.scales.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(qw.dequantize()), w, rtol=1e-6)


def test_weight_validates_array_shapes():
  with pytest.raises(ValueError, match="Int4Weight.scales"):
    qjax.Int4Weight(codes=np.zeros((16, 4), np.uint32), scales=np.ones((2, 5), np.float32),
                    zeros=None, shape=(128, 4), group_size=64)
  with pytest.raises(ValueError, match="not both"):
    qjax.Int4Weight(codes=np.zeros((16, 4), np.uint32), scales=np.ones((2, 4), np.float32),
                    zeros=np.zeros((2, 4), np.uint8), biases=np.ones((2, 4), np.float32),
                    shape=(128, 4), group_size=64)


@pytest.mark.parametrize("x,match", [
    (np.ones((2, 100), np.float32), r"last dim must equal K=128"),
    (np.ones((2, 128), np.int32), "x.dtype=int32"),
    (np.ones((2, 128), np.float64), "x.dtype=float64"),
])
def test_matmul_rejects_bad_x(x, match):
  qw = qjax.quantize(np.ones((128, 8), np.float32))
  with pytest.raises(ValueError, match=match):
    qjax.matmul(jnp.asarray(x) if x.dtype != np.float64 else x, qw)


def test_matmul_rejects_unknown_implementation():
  qw = qjax.quantize(np.ones((128, 8), np.float32))
  with pytest.raises(ValueError, match="implementation='cuda'"):
    qjax.matmul(jnp.ones((1, 128)), qw, implementation="cuda")


def test_auto_implementation_on_this_machine():
  qw = qjax.quantize(np.ones((128, 8), np.float32))
  name = qjax.implementation_name(qw, m=16)
  assert name == ("pallas_triton" if jax.devices()[0].platform == "gpu" else "xla")
  # One row of x on a weight this small runs faster through XLA (H100), and so there.
  assert qjax.implementation_name(qw, m=1) == "xla"


def test_implementation_name_follows_rows():
  qw = qjax.quantize(np.ones((128, 8), np.float32))
  assert qjax.implementation_name(qw, m=4096) == "xla"
  assert qjax.implementation_name(qw, "xla", m=1) == "xla"
