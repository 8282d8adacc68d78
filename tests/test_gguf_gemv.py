"""The GGUF GEMV kernel (pallas_kernels/gguf_gemv.py): Q8_0 / Q4_K / Q5_K / Q6_K at M = 1.

Every output is checked against float64 ``x @ W``, W the weight's own ``dequantize()`` in
float64 (bit-identical to gguf's, which one shape per type also checks against
``gguf.quants.dequantize``), on random blocks, in interpret mode (CPU) and compiled (GPU
only). Outputs are poisoned (NaN) before the run so an unwritten column fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import needs_gpu, rel_err, seed_from
from qjax._src import gguf_formats as gf
from qjax._src import gguf_tiled
from pallas_kernels import gguf_gemv
from pallas_kernels import gguf_matmul

gguf = pytest.importorskip("gguf")
import ptx_emulator  # noqa: E402
from test_gguf_kernels import _matmul_blocks, _weight  # noqa: E402

TYPES = gguf_tiled.TYPES
# (K, N): K = 2304 is 18 K-tiles (steps and split-K), 576 (Q8_0 only) is not a multiple
# of 128 (padded planes); N odd or not a multiple of block_n.
SHAPES = ((256, 40), (512, 200), (2304, 1000))
Q8_PADDED = (576, 33)
# Relative error bounds per x dtype: the output's own rounding for bf16 / f16.
BOUND = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}


def _tiled(ggml_type: str, k: int, n: int, seed: int):
  """``(GGUFTiledWeight, W [K, N] float64 from its dequantize(), W from gguf-py)``."""
  w, wd_gguf = _weight(ggml_type, k, n, seed)
  tw = gguf_tiled.GGUFTiledWeight.from_gguf(w)
  return tw, np.asarray(tw.dequantize(), np.float64), wd_gguf


def _x(request, k: int, dtype, m: int = 1) -> jax.Array:
  rng = np.random.default_rng(seed_from(request.node.nodeid + jnp.dtype(dtype).name))
  return jnp.asarray(rng.standard_normal((m, k)), dtype)


def _check(y, x, wd, dtype, what) -> float:
  assert y.shape == (x.shape[0], wd.shape[1]) and y.dtype == jnp.dtype(dtype), what
  y = np.asarray(y, np.float64)
  assert np.isfinite(y).all(), f"unwritten (poisoned) or non-finite outputs: {what}"
  err = rel_err(y, np.asarray(x, np.float64) @ wd)
  assert err < BOUND[dtype], (what, err)
  return err


def _cases():
  for t in TYPES:
    for k, n in SHAPES + ((Q8_PADDED,) if t == "Q8_0" else ()):
      yield pytest.param(t, k, n, id=f"{t}-K{k}-N{n}")


# -- interpret mode ------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type,k,n", list(_cases()))
def test_matches_float64(request, ggml_type, k, n):
  tw, wd, wd_gguf = _tiled(ggml_type, k, n, seed_from(request.node.nodeid) % 1000)
  np.testing.assert_array_equal(wd, wd_gguf)  # the reference is gguf's own
  run = jax.jit(lambda a, b: gguf_gemv.gguf_gemv(a, b, interpret=True, poison=True))
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    x = _x(request, k, dtype)
    _check(run(x, tw), x, wd, dtype, jnp.dtype(dtype).name)


CONFIGS = (
    qjax.KernelConfig(block_m=1, block_n=32, block_k=128, split_k=2, num_warps=4,
                      num_stages=1),
    qjax.KernelConfig(block_m=1, block_n=128, block_k=256, split_k=3, num_warps=8,
                      num_stages=2),
    qjax.KernelConfig(block_m=1, block_n=64, block_k=128, split_k=1, num_warps=2,
                      num_stages=3),
    qjax.KernelConfig(block_m=1, block_n=16, block_k=512, split_k=18, num_warps=1,
                      num_stages=1),
)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_configs_split_k_and_ragged_n(request, ggml_type):
  """split_k 2 / 3 / 18 (and one that does not divide: lowered), multi-step loops with
  prefetch depth 1-3, block_k 128-512, N = 200 ragged for every block_n."""
  k, n = 2304, 200
  tw, wd, _ = _tiled(ggml_type, k, n, 5)
  for i, cfg in enumerate(CONFIGS):
    dtype = (jnp.bfloat16, jnp.float32)[i % 2]
    x = _x(request, k, dtype)
    y = gguf_gemv.gguf_gemv(x, tw, interpret=True, config=cfg, poison=True)
    _check(y, x, wd, dtype, cfg)


def test_block_weight_converted_per_call(request):
  w, wd = _weight("Q5_K", 512, 70, 9)
  x = _x(request, 512, jnp.float32)
  _check(gguf_gemv.gguf_gemv(x, w, interpret=True, poison=True), x, wd, jnp.float32, "Q5_K")


def test_rejects_rows_and_stacks():
  tw, _, _ = _tiled("Q4_K", 256, 40, 1)
  with pytest.raises(ValueError, match="x \\[1, K\\]"):
    gguf_gemv.gguf_gemv(jnp.ones((2, 256)), tw, interpret=True)
  with pytest.raises(ValueError, match="x \\[1, K\\]"):
    gguf_gemv.gguf_gemv(jnp.ones((1, 512)), tw, interpret=True)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), tw)
  with pytest.raises(NotImplementedError, match="vmap"):
    gguf_gemv.gguf_gemv(jnp.ones((1, 256)), stacked, interpret=True)


def test_supports():
  for t in TYPES:
    assert gguf_gemv.supports(1, 2048, 8192, t)
    assert not gguf_gemv.supports(2, 2048, 8192, t)
  assert not gguf_gemv.supports(1, 2048, 8192, "Q4_0")


@pytest.mark.parametrize("k,n", [(2048, 8192), (8192, 2048), (2048, 2048), (2048, 512),
                                 (2048, 128256)])
def test_heuristic_fills_the_gpu(k, n):
  """At least 2 programs per SM of an H100 (132 SMs), K splits that divide the tiles, and
  alternatives that differ from it."""
  cfg = gguf_gemv.heuristic_config(1, k, n)
  tiles = k // 128
  tps, split, steps = gguf_gemv.loop_shape(cfg, tiles)
  assert (tps, split) == (cfg.block_k // 128, cfg.split_k) and tps * split * steps == tiles
  programs = -(-n // cfg.block_n) * split
  assert programs >= min(2 * 132, -(-n // cfg.block_n) * tiles), (cfg, programs)
  alts = gguf_gemv.alternative_configs(1, k, n)
  assert 2 <= len(alts) <= 4 and cfg not in alts


# -- the PTX strings, on the emulator --------------------------------------------------------


def test_ptx_fma_and_lop3_emulated():
  rng = np.random.default_rng(3)
  a, b, c = (rng.standard_normal(64).astype(np.float32) for _ in range(3))
  got = ptx_emulator.emulate(gguf_gemv.FMA_PTX, {1: a, 2: b, 3: c})
  np.testing.assert_allclose(got, a.astype(np.float64) * b + c, rtol=1e-6)
  words = rng.integers(0, 2**32, 64, dtype=np.uint32)
  other = rng.integers(0, 2**32, 64, dtype=np.uint32)
  for mask in (0xF << 19, 3 << 21, 1 << 22):
    got = ptx_emulator.emulate(gguf_gemv.and_or_ptx(mask, 0x3F800000), {1: words})
    np.testing.assert_array_equal(got, (words & np.uint32(mask)) | np.uint32(0x3F800000))
    got = ptx_emulator.emulate(gguf_gemv.and_or_ptx(mask, None), {1: words, 2: other})
    np.testing.assert_array_equal(got, (words & np.uint32(mask)) | other)


# -- dispatch ---------------------------------------------------------------------------------


def _spy(monkeypatch):
  calls = []
  real = gguf_gemv.gguf_gemv

  def spy(x, w, **kw):
    calls.append(x.shape)
    return real(x, w, **kw)
  monkeypatch.setattr(gguf_gemv, "gguf_gemv", spy)
  return calls


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dispatcher_runs_gemv_at_one_row_only(request, monkeypatch, ggml_type):
  calls = _spy(monkeypatch)
  tw, wd, _ = _tiled(ggml_type, 256, 48, 11)
  assert qjax.implementation_name(tw, "interpret") == "pallas_triton-interpret"
  for m in (1, 3):
    x = _x(request, 256, jnp.bfloat16, m)
    y = qjax.matmul(x, tw, implementation="interpret")
    _check(y, x, wd, jnp.bfloat16, m)
  assert calls == [(1, 256)], calls


def test_tiled_config_keeps_the_tiled_kernel(request, monkeypatch):
  """A config with block_m >= 16 runs the tiled kernel at M = 1; block_m = 1 the GEMV."""
  calls = _spy(monkeypatch)
  tw, wd, _ = _tiled("Q6_K", 512, 40, 2)
  x = _x(request, 512, jnp.float32)
  tiled = qjax.KernelConfig(block_m=16, block_n=32, block_k=128, split_k=2)
  # float32 dots at float32 accuracy (on a GPU interpret mode's dot defaults to TF32).
  with jax.default_matmul_precision("highest"):
    y = gguf_matmul.gguf_matmul(x, tw, interpret=True, config=tiled, poison=True)
  assert rel_err(y, np.asarray(x, np.float64) @ wd) < 1e-5 and not calls
  gemv = dataclasses.replace(tiled, block_m=1)
  y = gguf_matmul.gguf_matmul(x, tw, interpret=True, config=gemv, poison=True)
  _check(y, x, wd, jnp.float32, "gemv")
  assert calls == [(1, 512)]


# -- compiled (GPU) ---------------------------------------------------------------------------

GPU_SHAPES = ((2048, 8192), (8192, 2048), (2048, 2048), (2048, 512))
# Compiled bounds: bf16 output rounding; float32 x multiplies exactly in the kernel's FMAs.
GPU_BOUND = {jnp.bfloat16: 1e-2, jnp.float32: 1e-4}


def _gpu_cases():
  for t in TYPES:
    for k, n in GPU_SHAPES + (((2048, 128256),) if t == "Q6_K" else ()):
      yield pytest.param(t, k, n, id=f"{t}-{k}x{n}")


def _gpu_weight(ggml_type: str, k: int, n: int, seed: int):
  """Random blocks as in the interpret tests; the float64 reference from the weight's own
  (exact) dequantize, since gguf-py's takes minutes at 2048 x 128256."""
  raw = _matmul_blocks(ggml_type, n, k, seed)
  tw = jax.jit(gguf_tiled.GGUFTiledWeight.from_gguf)(gf.from_gguf_bytes(raw, ggml_type, (k, n)))
  return tw, np.asarray(jax.jit(lambda a: a.dequantize())(tw), np.float64)


@needs_gpu
class TestGgufGemvPallasGpu:

  @pytest.mark.parametrize("ggml_type,k,n", list(_gpu_cases()))
  def test_pallas_gemv_benchmark_shapes(self, request, ggml_type, k, n):
    tw, wd = _gpu_weight(ggml_type, k, n, seed_from(request.node.nodeid) % 1000)
    run = jax.jit(lambda a, b: gguf_gemv.gguf_gemv(a, b, poison=True))
    for dtype, bound in GPU_BOUND.items():
      x = _x(request, k, dtype)
      y = np.asarray(run(x, tw), np.float64)
      assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
      err = rel_err(y, np.asarray(x, np.float64) @ wd)
      assert err < bound, (jnp.dtype(dtype).name, err)

  @pytest.mark.parametrize("ggml_type", TYPES)
  def test_pallas_gemv_alternative_configs_and_auto(self, request, ggml_type):
    k, n = 2048, 2048
    tw, wd = _gpu_weight(ggml_type, k, n, 3)
    x = _x(request, k, jnp.bfloat16)
    ref = np.asarray(x, np.float64) @ wd
    for cfg in gguf_gemv.alternative_configs(1, k, n):
      y = gguf_gemv.gguf_gemv(x, tw, config=cfg, poison=True)
      assert rel_err(y, ref) < 1e-2, cfg
    assert qjax.implementation_name(tw) == "pallas_triton"
    assert rel_err(jax.jit(qjax.matmul)(x, tw), ref) < 1e-2
