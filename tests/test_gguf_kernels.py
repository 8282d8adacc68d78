"""GGUF weights on the kernels: the lossless plane layout and the Pallas kernels.

Every type's matmul is checked against float64 ``x @ W`` with W decoded by llama.cpp's
own ``gguf.quants.dequantize`` (not by qjax), on random blocks with finite scales, on the
XLA path, the Pallas kernel in interpret mode (CPU) and the compiled kernel (GPU only).
Kernel outputs are poisoned (NaN) before the run so an unwritten tile fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import needs_gpu, rel_err, seed_from
from qjax._src import gguf_formats as gf
from qjax._src import gguf_tiled

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from test_gguf_formats import _assert_bit_equal, _raw_blocks  # noqa: E402

ALL_TYPES = ("Q4_0", "Q4_1", "MXFP4", *gguf_tiled.TYPES)
NOT_TILED = ("Q4_0", "Q4_1", "MXFP4")  # Int4Weight / MXFP4Weight, not GGUFTiledWeight
# (K, N) per type: K a multiple of the block size, some not a multiple of 128 (Q8_0 and
# the 32-blocks), N odd or not a multiple of the kernel's block_n.
SHAPES = {32: [(96, 33), (576, 70), (256, 40)], 256: [(256, 40), (512, 130), (768, 17)]}
MS = (1, 5, 33)


def _matmul_blocks(ggml_type: str, n: int, k: int, seed: int) -> np.ndarray:
  """Random blocks (all code and sub-scale bits random) whose f16 scales keep ``x @ W``
  well inside the float16 range, as a real weight's do."""
  rng = np.random.default_rng(seed)
  cls = gf.BLOCK_FORMATS[ggml_type]
  nb = k // cls.block_size
  raw = rng.integers(0, 256, (n, nb, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.standard_normal((n, nb)) * 0.02 / np.sqrt(k)).astype(np.float16)
      v.reshape(-1)[::11] = np.float16(0.0)
      raw[:, :, f.offset:f.offset + 2] = v.view(np.uint8).reshape(n, nb, 2)
  if ggml_type == "MXFP4":  # E8M0 scales 2**-12 to 2**-4 (at most 0.375 per weight)
    raw[:, :, 0] = rng.integers(115, 124, (n, nb), dtype=np.uint8)
  return raw.reshape(n, nb * cls.type_size)


def _weight(ggml_type: str, k: int, n: int, seed: int):
  raw = _matmul_blocks(ggml_type, n, k, seed)
  w = gf.from_gguf_bytes(raw, ggml_type, (k, n))
  wd = gguf.quants.dequantize(raw, QT[ggml_type]).astype(np.float64).T  # [K, N]
  return w, wd


def _cases():
  for t in ALL_TYPES:
    for k, n in SHAPES[gf.BLOCK_FORMATS[t].block_size]:
      yield pytest.param(t, k, n, id=f"{t}-K{k}-N{n}")


# -- the layout --------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type,k,n", [c for c in _cases() if c.values[0] not in
                                           NOT_TILED])
def test_tiled_layout_is_lossless(ggml_type, k, n):
  for seed in (1, 2):
    raw = _raw_blocks(ggml_type, n, k, seed_from(f"{ggml_type}{k}{n}{seed}"))
    w = gf.from_gguf_bytes(raw, ggml_type, (k, n))
    t = jax.jit(gguf_tiled.GGUFTiledWeight.from_gguf)(w)
    assert t.ggml_type == ggml_type and t.shape == (k, n)
    ref = gguf.quants.dequantize(raw, QT[ggml_type]).T
    _assert_bit_equal(jax.jit(lambda a: a.dequantize())(t), ref)
    # Codes and scales survive as they are (not only their products).
    codes = np.asarray(t.codes())
    if ggml_type == "Q8_0":
      np.testing.assert_array_equal(codes, np.asarray(w.qs).reshape(n, k).T)
    else:
      np.testing.assert_array_equal(codes, np.asarray(w.codes()).reshape(n, k).T)
    ids = np.array([n - 1, 0, n // 2])
    _assert_bit_equal(t.take_rows(jnp.asarray(ids)), ref.T[ids])
    # Nothing widened: at most 1.1x the file's bytes (Q8_0 with K % 128 pads K).
    limit = 1.0 + 128 / k if ggml_type == "Q8_0" and k % 128 else 1.1
    assert t.nbytes <= limit * raw.nbytes, (t.nbytes, raw.nbytes)


@pytest.mark.parametrize("bits", [1, 2])
def test_pack_high_round_trip_and_order(bits):
  rng = np.random.default_rng(bits)
  v = rng.integers(0, 1 << bits, (256, 5), dtype=np.uint8)
  packed = np.asarray(gguf_tiled.pack_high(jnp.asarray(v), bits))
  tile = gguf_tiled.high_tile_rows(bits)
  assert packed.shape == (256 // tile * 16, 5) and packed.dtype == np.uint8
  np.testing.assert_array_equal(np.asarray(gguf_tiled.unpack_high(jnp.asarray(packed), bits)), v)
  # Field j of byte r of tile t is row t * tile + 16 j + r (written out with explicit loops).
  for t in range(256 // tile):
    for j in range(8 // bits):
      for r in range(16):
        got = (packed[t * 16 + r] >> (bits * j)) & ((1 << bits) - 1)
        np.testing.assert_array_equal(got, v[t * tile + 16 * j + r])


def test_tiled_rejects_wrong_fields():
  w, _ = _weight("Q4_K", 256, 8, 3)
  t = gguf_tiled.GGUFTiledWeight.from_gguf(w)
  with pytest.raises(ValueError, match=r"Q4_K.sc must be \(8, 8\) uint8"):
    gguf_tiled.GGUFTiledWeight(**{**t.__dict__, "sc": t.sc.astype(jnp.int8)})
  with pytest.raises(ValueError, match="ggml_type='Q2_K' must be one of"):
    gguf_tiled.GGUFTiledWeight(**{**t.__dict__, "ggml_type": "Q2_K"})
  with pytest.raises(ValueError, match="Q4_0 and Q4_1 convert to Int4Weight"):
    gguf_tiled.GGUFTiledWeight.from_gguf(_weight("Q4_0", 64, 8, 3)[0])
  with pytest.raises(ValueError, match=r"MXFP4 to MXFP4Weight \(to_mxfp4\)"):
    gguf_tiled.GGUFTiledWeight.from_gguf(_weight("MXFP4", 64, 8, 3)[0])


def test_kernel_layout_picks_per_type():
  for t in ALL_TYPES:
    k = gf.BLOCK_FORMATS[t].block_size
    w, wd = _weight(t, k, 4, 5)
    lw = gguf_tiled.kernel_layout(w)
    want = {"Q4_0": qjax.Int4Weight, "Q4_1": qjax.Int4Weight,
            "MXFP4": qjax.MXFP4Weight}.get(t, qjax.GGUFTiledWeight)
    assert isinstance(lw, want), (t, type(lw))
    np.testing.assert_array_equal(np.asarray(lw.dequantize(), np.float64), wd)


# -- matmul ------------------------------------------------------------------------------


class GGUFMatmulSuite:
  """Subclasses set ``run(x, w) -> y``."""

  def run(self, x, w):
    raise NotImplementedError

  @pytest.mark.parametrize("ggml_type,k,n", list(_cases()))
  def test_matches_float64(self, request, ggml_type, k, n):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    w, wd = _weight(ggml_type, k, n, seed_from(request.node.nodeid) % 1000)
    for m, dt in zip(MS, (jnp.bfloat16, jnp.float16, jnp.float32)):
      x = jnp.asarray(rng.standard_normal((m, k)), dt)
      y = self.run(x, w)
      assert y.shape == (m, n) and y.dtype == jnp.dtype(dt)
      y = np.asarray(y, np.float64)
      assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
      err = rel_err(y, np.asarray(x, np.float64) @ wd)
      assert err < 1e-2, (m, jnp.dtype(dt).name, err)


class TestGGUFXla(GGUFMatmulSuite):

  def run(self, x, w):
    return jax.jit(lambda a, b: qjax.matmul(a, b, implementation="xla"))(x, w)

  def test_tiled_layout_xla(self, request):
    w, wd = _weight("Q6_K", 512, 24, 7)
    x = jnp.asarray(np.random.default_rng(seed_from(request.node.nodeid)).standard_normal(
        (3, 512)), jnp.float32)
    y = qjax.matmul(x, gguf_tiled.kernel_layout(w), implementation="xla")
    assert rel_err(y, np.asarray(x, np.float64) @ wd) < 1e-5


def _kernel(x, w, interpret):
  from pallas_kernels import fp4_matmul, gguf_matmul  # pylint: disable=g-import-not-at-top
  lw = gguf_tiled.kernel_layout(w)
  if isinstance(lw, qjax.Int4Weight):
    fn = gguf_matmul.int4_via_layout
  elif isinstance(lw, qjax.MXFP4Weight):  # converted per call, inside the jit
    fn = lambda x, w, **kw: fp4_matmul.fp4_matmul(x, w.to_mxfp4(), **kw)  # noqa: E731
  else:
    fn, w = gguf_matmul.gguf_matmul, lw  # also exercises the per-call conversion below
  return jax.jit(lambda a, b: fn(a, b, interpret=interpret, poison=True))(x, w)


class TestGGUFInterpret(GGUFMatmulSuite):

  def run(self, x, w):
    return _kernel(x, w, interpret=True)

  @pytest.mark.parametrize("ggml_type", ALL_TYPES)
  def test_dispatcher_routes_every_type(self, request, ggml_type):
    k = 256
    w, wd = _weight(ggml_type, k, 48, 11)
    x = jnp.asarray(np.random.default_rng(seed_from(request.node.nodeid)).standard_normal(
        (2, k)), jnp.bfloat16)
    assert qjax.implementation_name(w, "interpret") == "pallas_triton-interpret"
    y = qjax.matmul(x, w, implementation="interpret")
    assert rel_err(y, np.asarray(x, np.float64) @ wd) < 1e-2

  def test_split_k_and_multi_step(self, request):
    from pallas_kernels import gguf_matmul  # pylint: disable=g-import-not-at-top
    w, wd = _weight("Q5_K", 1024, 70, 13)
    x = jnp.asarray(np.random.default_rng(seed_from(request.node.nodeid)).standard_normal(
        (4, 1024)), jnp.bfloat16)
    for cfg in (qjax.KernelConfig(block_m=16, block_n=32, block_k=128, split_k=2),
                qjax.KernelConfig(block_m=16, block_n=64, block_k=256, split_k=1)):
      y = gguf_matmul.gguf_matmul(x, w, interpret=True, config=cfg, poison=True)
      assert rel_err(y, np.asarray(x, np.float64) @ wd) < 1e-2, cfg


@needs_gpu
class TestGGUFPallasGpu(GGUFMatmulSuite):

  def run(self, x, w):
    return _kernel(x, w, interpret=False)

  @pytest.mark.parametrize("ggml_type", ("MXFP4", *gguf_tiled.TYPES))
  def test_large_and_auto(self, request, ggml_type):
    w, wd = _weight(ggml_type, 4096, 1000, 17)
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    lw = gguf_tiled.kernel_layout(w)
    assert qjax.implementation_name(lw) == "pallas_triton"
    for m in (1, 16, 64):
      x = jnp.asarray(rng.standard_normal((m, 4096)), jnp.bfloat16)
      y = jax.jit(qjax.matmul)(x, lw)
      assert rel_err(y, np.asarray(x, np.float64) @ wd) < 1e-2, m
