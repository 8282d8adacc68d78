"""Marlin layout: codes and scales packed by a numpy transcription of Marlin's published
packer load bit for bit; lossless round trips; matmul on XLA and the interpreted kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import dispatch
from qjax._src import int4
from qjax._src import marlin_layout as ml
from qjax._src import packing
from conftest import needs_gpu, on_gpu, rel_err

# ------------------------------------------------------------- reference Marlin packer
# A transcription, in numpy, of the packing procedure published in IST-DASLab/marlin
# marlin/__init__.py (`_get_perms`, `Layer.pack`) and in vLLM
# vllm/model_executor/layers/quantization/utils/marlin_utils_test.py (`get_weight_perm`,
# `marlin_permute_weights`, `marlin_weights`) and marlin_utils.py
# (`get_scale_perms`, `marlin_permute_scales`, `marlin_zero_points`). Written here from
# the procedure (loops as published), independent of qjax's vectorized implementation.


def ref_weight_perm():
  perm = []
  for i in range(32):
    perm1 = []
    col = i // 4
    for block in [0, 1]:
      for row in [2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1]:
        perm1.append(16 * row + col + 8 * block)
    for j in range(4):
      perm.extend([p + 256 * j for p in perm1])
  perm = np.array(perm)
  interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
  return perm.reshape((-1, 8))[:, interleave].ravel()


def ref_scale_perms():
  scale_perm = []
  for i in range(8):
    scale_perm.extend([i + 8 * j for j in range(8)])
  scale_perm_single = []
  for i in range(4):
    scale_perm_single.extend([2 * i + j for j in [0, 1, 8, 9, 16, 17, 24, 25]])
  return np.array(scale_perm), np.array(scale_perm_single)


def ref_pack_cols(a):
  """[R, N] -> [R, N // 8] int32, value i::8 at nibble i (vLLM pack_cols)."""
  a = a.astype(np.uint32)
  out = np.zeros((a.shape[0], a.shape[1] // 8), np.uint32)
  for i in range(8):
    out |= a[:, i::8] << (4 * i)
  return out.view(np.int32)


def ref_marlin_pack(codes, scales, zeros, group_size):
  """codes [K, N] in [0, 15], scales [K // G, N], zeros [K // G, N] or None ->
  (qweight [K // 16, 2N] int32, scales [K // G, N], qzeros [K // G, N // 8] or None)."""
  k, n = codes.shape
  tile = 16
  w = codes.reshape((k // tile, tile, n // tile, tile)).transpose((0, 2, 1, 3))
  w = w.reshape((k // tile, n * tile))
  perm = ref_weight_perm()
  w = w.reshape((-1, perm.size))[:, perm].reshape(w.shape)
  qweight = ref_pack_cols(w)
  scale_perm, scale_perm_single = ref_scale_perms()
  if group_size < k:
    s = scales.reshape((-1, len(scale_perm)))[:, scale_perm]
  else:
    s = scales.reshape((-1, len(scale_perm_single)))[:, scale_perm_single]
  s = s.reshape((-1, n))
  qzeros = None
  if zeros is not None:
    z = zeros.reshape((-1, len(scale_perm)))[:, scale_perm]
    z = z.reshape((-1, 8))[:, np.array([0, 2, 4, 6, 1, 3, 5, 7])].ravel().reshape((-1, n))
    qzeros = ref_pack_cols(z)
  return qweight, s, qzeros


# ------------------------------------------------------------------------------- tests

CASES = [(256, 128, 128, True), (256, 128, 32, False), (128, 64, 128, True),
         (384, 192, 64, False), (256, 128, 256, False)]  # the last: per-channel (G == K)


def _random(rng, k, n, g, symmetric):
  codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
  scales = (rng.standard_normal((k // g, n)) * 0.05).astype(np.float16)
  zeros = None if symmetric else rng.integers(0, 16, (k // g, n)).astype(np.uint8)
  return codes, scales, zeros


def _int4(codes, scales, zeros, g, tile_k=packing.NATIVE_TILE_K):
  k, n = codes.shape
  return int4.Int4Weight(codes=packing.pack_codes(jnp.asarray(codes), tile_k),
                         scales=jnp.asarray(scales),
                         zeros=None if zeros is None else jnp.asarray(zeros),
                         shape=(k, n), group_size=g, tile_k=tile_k)


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def test_tile_order_is_the_published_permutation():
  np.testing.assert_array_equal(ml.tile_order(), ref_weight_perm())


@pytest.mark.parametrize("k,n,g,symmetric", CASES)
def test_reference_packed_loads_exactly(rng, k, n, g, symmetric):
  codes, scales, zeros = _random(rng, k, n, g, symmetric)
  qweight, s, qzeros = ref_marlin_pack(codes, scales, zeros, g)
  lay = qjax.MarlinWeight(qweight=jnp.asarray(qweight), scales=jnp.asarray(s),
                          qzeros=None if qzeros is None else jnp.asarray(qzeros),
                          shape=(k, n), group_size=g)
  uc, us, uz, ug = lay.unpack()
  assert uc.dtype == jnp.uint8 and ug is None
  np.testing.assert_array_equal(np.asarray(uc), codes)
  np.testing.assert_array_equal(np.asarray(us), scales)
  if zeros is None:
    assert uz is None and lay.symmetric
  else:
    np.testing.assert_array_equal(np.asarray(uz), zeros)
  # float64 reference of W and exact dequantization.
  gi = np.arange(k) // g
  z = 8.0 if zeros is None else zeros.astype(np.float64)[gi]
  w_ref = (codes - z) * scales.astype(np.float64)[gi]
  np.testing.assert_array_equal(np.asarray(lay.dequantize(), np.float64), w_ref)
  # qjax's packer writes the same words as the reference.
  back = qjax.MarlinWeight.from_int4(_int4(codes, scales, zeros, g))
  np.testing.assert_array_equal(np.asarray(back.qweight), qweight)
  np.testing.assert_array_equal(np.asarray(back.scales), s)
  if qzeros is not None:
    np.testing.assert_array_equal(np.asarray(back.qzeros), qzeros)


@pytest.mark.parametrize("k,n,g,symmetric", CASES)
def test_round_trip_bit_exact(rng, k, n, g, symmetric):
  codes, scales, zeros = _random(rng, k, n, g, symmetric)
  for tile_k in (packing.NATIVE_TILE_K, packing.PLAIN_TILE_K):
    w = _int4(codes, scales, zeros, g, tile_k)
    lay = jax.jit(qjax.MarlinWeight.from_int4)(w)
    w4 = jax.jit(lambda l, t=tile_k: l.to_int4(tile_k=t))(lay)
    assert isinstance(w4, qjax.Int4Weight) and w4.tile_k == tile_k
    for name in ("codes", "scales", "zeros"):
      a, b = getattr(w, name), getattr(w4, name)
      assert (a is None) == (b is None), name
      if a is not None:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    np.testing.assert_array_equal(_bits(lay.dequantize()), _bits(w.dequantize()))
    # and through the other layouts: Marlin -> GPTQ -> Int4 -> Marlin
    again = qjax.MarlinWeight.from_int4(qjax.GPTQWeight.from_int4(w4).to_int4())
    np.testing.assert_array_equal(np.asarray(again.qweight), np.asarray(lay.qweight))


_GPU = needs_gpu
IMPLEMENTATIONS = ["xla", "interpret", pytest.param("pallas", marks=_GPU)]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("k,n,g,symmetric", [(256, 128, 128, True), (256, 128, 32, False),
                                             (512, 192, 64, False)])
def test_matmul_matches_float64(rng, implementation, k, n, g, symmetric):
  codes, scales, zeros = _random(rng, k, n, g, symmetric)
  qweight, s, qzeros = ref_marlin_pack(codes, scales, zeros, g)
  lay = qjax.MarlinWeight(qweight=jnp.asarray(qweight), scales=jnp.asarray(s),
                          qzeros=None if qzeros is None else jnp.asarray(qzeros),
                          shape=(k, n), group_size=g)
  gi = np.arange(k) // g
  z = 8.0 if zeros is None else zeros.astype(np.float64)[gi]
  w_ref = (codes - z) * scales.astype(np.float64)[gi]
  x = rng.standard_normal((5, k)).astype(np.float32)
  y = jax.jit(lambda x, l: qjax.matmul(x, l, implementation=implementation))(
      jnp.asarray(x, jnp.bfloat16), lay)
  assert y.shape == (5, n) and y.dtype == jnp.bfloat16
  assert rel_err(y, x.astype(np.float64) @ w_ref) < 1e-2
  if implementation != "xla":
    assert qjax.implementation_name(lay, implementation).startswith("pallas_triton")


@pytest.mark.parametrize("implementation", ["interpret", pytest.param("pallas", marks=_GPU)])
def test_checkpoint_layouts_route_to_the_int4_kernel(rng, implementation):
  """GPTQ (act-order too), AWQ and compressed-tensors run the interpreted int4 kernel
  through the repack route, and match float64."""
  k, n, g = 256, 64, 64
  codes, scales, zeros = _random(rng, k, n, g, symmetric=False)
  zeros = np.maximum(zeros, 1)  # GPTQ v1 cannot store a zero point of 0
  w = _int4(codes, scales, zeros, g)
  g_idx = jnp.asarray(rng.permutation(np.arange(k) // g).astype(np.int32))
  layouts = [qjax.GPTQWeight.from_int4(w, zero_point_version=1),
             qjax.GPTQWeight.from_int4(w, g_idx=g_idx), qjax.AWQWeight.from_int4(w),
             qjax.CompressedTensorsWeight.from_int4(w)]
  x = rng.standard_normal((3, k)).astype(np.float32)
  for lay in layouts:
    assert dispatch.kernels_for(lay), type(lay).__name__
    y = qjax.matmul(jnp.asarray(x), lay, implementation=implementation)
    ref = x.astype(np.float64) @ np.asarray(lay.dequantize(), np.float64)
    # float32 x: the compiled kernel's dots may round operands to TF32, and so do the
    # interpreted kernel's on a GPU (its dots run through XLA there).
    exact = implementation == "interpret" and not on_gpu()
    assert rel_err(y, ref) < (1e-5 if exact else 1e-3), type(lay).__name__


def test_errors(rng):
  codes, scales, zeros = _random(rng, 256, 96, 128, symmetric=True)
  with pytest.raises(ValueError, match=r"N=96\).*N a multiple of 64"):
    qjax.MarlinWeight.from_int4(_int4(codes, scales, zeros, 128))
  codes, scales, zeros = _random(rng, 256, 128, 128, symmetric=True)
  lay = qjax.MarlinWeight.from_int4(_int4(codes, scales, zeros, 128))
  with pytest.raises(ValueError, match=r"MarlinWeight.qweight must be \(16, 256\).*"
                     r"got \(8, 256\)"):
    qjax.MarlinWeight(qweight=lay.qweight[:8], scales=lay.scales, qzeros=None,
                      shape=(256, 128), group_size=128)
  with pytest.raises(ValueError, match=r"K=256 must be a multiple of group_size=96"):
    qjax.MarlinWeight(qweight=lay.qweight, scales=lay.scales, qzeros=None,
                      shape=(256, 128), group_size=96)


def test_save_load(rng, tmp_path):
  codes, scales, zeros = _random(rng, 128, 64, 32, symmetric=False)
  lay = qjax.MarlinWeight.from_int4(_int4(codes, scales, zeros, 32))
  sym = qjax.MarlinWeight.from_int4(_int4(codes, scales, None, 32))
  qjax.save(tmp_path / "m.safetensors", {"a": lay, "s": sym})
  got = qjax.load(tmp_path / "m.safetensors")
  for name, want in (("a", lay), ("s", sym)):
    assert isinstance(got[name], qjax.MarlinWeight) and got[name].shape == (128, 64)
    np.testing.assert_array_equal(_bits(got[name].dequantize()), _bits(want.dequantize()))
