"""``qjax.write_kv_cache`` and its kernel (``pallas_kernels/kv_cache_write.py``): every
implementation equals a numpy loop bit for bit, on random caches (never zeros: a slot the
call must not write keeps its old value, which the comparison checks), odd row widths,
positions outside the cache (negative and past the end) and layers counted from either
end, concrete or traced."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import needs_gpu, on_device, random_cache, seed_from, small_llama
from flax_layers import llama
from pallas_kernels import kv_cache_write as kernel

IMPLS = ("xla", "interpret") + (("pallas",) if jax.devices()[0].platform == "gpu" else ())
# (layers, batch, slots, kv_heads, head_dim, new tokens per sequence)
SHAPES = ((3, 1, 16, 3, 64, 1), (2, 3, 9, 2, 24, 4), (1, 1, 5, 1, 7, 3), (4, 2, 33, 8, 128, 1),
          (2, 2, 40, 5, 80, 17), (1, 4, 7, 1, 256, 7))


def _inputs(rng, shape, dtype=jnp.bfloat16, new_dtype=None):
  layers, b, slots, kv, d, t = shape
  cache = lambda: jnp.asarray(rng.standard_normal((layers, b, slots, kv, d)), dtype)
  new = lambda: jnp.asarray(rng.standard_normal((b, t, kv, d)), new_dtype or dtype)
  # Distinct positions per sequence (one write per slot), some outside [0, slots).
  pos = np.stack([rng.permutation(np.arange(-3, slots + 3))[:t] for _ in range(b)])
  return cache(), cache(), new(), new(), jnp.asarray(pos, jnp.int32)


def reference(k_cache, v_cache, k, v, positions, layer):
  """The numpy loop: ``cache[layer, b, p] = new[b, i]`` where ``0 <= p < slots`` and the
  layer lies in ``[-layers, layers)``."""
  kc, vc = np.array(k_cache), np.array(v_cache)
  layers, _, slots = kc.shape[:3]
  if not -layers <= layer < layers:
    return kc, vc
  for b, row in enumerate(np.asarray(positions)):
    for i, p in enumerate(row):
      if 0 <= p < slots:
        kc[layer, b, p] = np.asarray(k[b, i]).astype(kc.dtype)
        vc[layer, b, p] = np.asarray(v[b, i]).astype(vc.dtype)
  return kc, vc


def _same(got, want):
  """Bit for bit (as raw bytes: NaN payloads and signed zeros included)."""
  got = np.asarray(got)
  assert got.shape == want.shape and got.dtype == want.dtype
  assert got.tobytes() == want.tobytes(), np.argwhere(
      got.view(np.uint8).reshape(got.shape + (-1,)) != want.view(np.uint8).reshape(
          want.shape + (-1,)))[:5]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_the_numpy_loop(request, impl, shape):
  rng = np.random.default_rng(seed_from(request.node.name))
  kc, vc, k, v, pos = _inputs(rng, shape)
  layers = shape[0]
  for layer in sorted({0, layers - 1, -1, -layers}):
    got = qjax.write_kv_cache(kc, vc, k, v, pos, layer=layer, implementation=impl)
    for g, w in zip(got, reference(kc, vc, k, v, pos, layer)):
      _same(g, w)


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_layer_and_positions(request, impl):
  """Under jit with the layer traced: every layer from either end, and one outside the
  cache writes nothing (concrete ones are refused, below)."""
  rng = np.random.default_rng(seed_from(request.node.name))
  shape = (3, 2, 12, 2, 48, 3)
  kc, vc, k, v, pos = _inputs(rng, shape)
  run = jax.jit(lambda kc, vc, k, v, pos, layer: qjax.write_kv_cache(
      kc, vc, k, v, pos, layer=layer, implementation=impl))
  for layer in (-5, -4, -3, -1, 0, 2, 3, 7):
    got = run(kc, vc, k, v, pos, jnp.int32(layer))
    for g, w in zip(got, reference(kc, vc, k, v, pos, layer)):
      _same(g, w)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_layer_cache_and_cast(request, impl):
  """A 4-D cache (layer None), and float32 keys written into a bfloat16 cache (rounded
  as ``astype`` rounds them)."""
  rng = np.random.default_rng(seed_from(request.node.name))
  kc, vc, k, v, pos = _inputs(rng, (1, 2, 10, 3, 32, 4), new_dtype=jnp.float32)
  got = qjax.write_kv_cache(kc[0], vc[0], k, v, pos, implementation=impl)
  want = reference(kc, vc, k, v, pos, 0)
  for g, w in zip(got, want):
    _same(g, w[0])


def test_every_slot_of_a_sequence(request):
  """Writing all slots of every sequence in one call (prefill from position 0) leaves
  nothing of the old layer: the interpret kernel equals XLA, and both equal the new keys."""
  rng = np.random.default_rng(seed_from(request.node.name))
  layers, b, slots, kv, d = 2, 3, 11, 2, 40
  kc, vc, k, v, _ = _inputs(rng, (layers, b, slots, kv, d, slots))
  pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (b, slots))
  for impl in ("xla", "interpret"):
    nk, nv = qjax.write_kv_cache(kc, vc, k, v, pos, layer=1, implementation=impl)
    _same(nk[1], np.asarray(k))
    _same(nv[1], np.asarray(v))
    _same(nk[0], np.asarray(kc[0]))


def test_errors_name_the_argument():
  kc = jnp.ones((2, 1, 8, 2, 4), jnp.bfloat16)
  new = jnp.ones((1, 1, 2, 4), jnp.bfloat16)
  pos = jnp.zeros((1, 1), jnp.int32)
  with pytest.raises(ValueError, match="layer=2 is outside a cache of 2 layers"):
    qjax.write_kv_cache(kc, kc, new, new, pos, layer=2)
  with pytest.raises(ValueError, match=r"want \[layers, batch, slots"):
    qjax.write_kv_cache(kc[0], kc[0], new, new, pos, layer=0)
  with pytest.raises(ValueError, match="pass layer= for a stacked cache"):
    qjax.write_kv_cache(kc, kc, new, new, pos)
  with pytest.raises(ValueError, match="must have one shape and dtype"):
    qjax.write_kv_cache(kc, kc.astype(jnp.float32), new, new, pos, layer=0)
  with pytest.raises(ValueError, match=r"want both \[batch=1, seq, kv_heads=2, head_dim=4\]"):
    qjax.write_kv_cache(kc, kc, new[..., :3], new[..., :3], pos, layer=0)
  with pytest.raises(ValueError, match=r"positions of shape \(1, 2\).*want \[batch, seq\]"):
    qjax.write_kv_cache(kc, kc, new, new, jnp.zeros((1, 2), jnp.int32), layer=0)
  with pytest.raises(ValueError, match="positions of shape .* float32"):
    qjax.write_kv_cache(kc, kc, new, new, jnp.zeros((1, 1), jnp.float32), layer=0)
  with pytest.raises(ValueError, match="layer of shape"):
    qjax.write_kv_cache(kc, kc, new, new, pos, layer=jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="implementation="):
    qjax.write_kv_cache(kc, kc, new, new, pos, layer=0, implementation="cuda")


def test_implementation_name():
  on_gpu = jax.devices()[0].platform == "gpu"
  name = qjax.kv_cache_write_implementation_name
  assert name(jnp.bfloat16) == name() == ("pallas_triton" if on_gpu else "xla")
  assert name(jnp.float32) == "xla"
  assert name(jnp.bfloat16, "interpret") == "pallas_triton-interpret"
  assert name(jnp.bfloat16, "xla") == "xla"


def test_llama_decode_at_a_position_outside_writes_nothing(request):
  """A decode step at a position outside the cache leaves every slot as it was (the
  scatter used to wrap -1 onto the last slot) and gives NaN logits."""
  rng = np.random.default_rng(seed_from(request.node.name))
  cfg, params = small_llama(rng)
  cache = random_cache(cfg, rng, 1, 8)
  for impl in ("xla", "interpret"):
    c = dataclasses.replace(cfg, implementation=impl)
    for pos in (-1, 8):
      logits, new = llama.decode_step(params, jnp.array([5]), jnp.array([pos]),
                                      on_device(cache), cfg=c)
      assert np.isnan(np.asarray(logits)).all()
      for n in ("k", "v"):
        _same(new[n], cache[n])


def test_llama_decode_writes_its_slot(request):
  """One decode step writes exactly the slot of its position in every layer (the kernel in
  interpret mode and XLA alike); every other slot keeps its bits, and the logits agree."""
  rng = np.random.default_rng(seed_from(request.node.name))
  cfg, params = small_llama(rng)
  cache = random_cache(cfg, rng, 2, 12)
  pos = jnp.array([2, 11])
  # float32 dots at float32 accuracy (a GPU's default is TF32).
  with jax.default_matmul_precision("highest"):
    outs = {impl: llama.decode_step(params, jnp.array([5, 7]), pos, on_device(cache),
                                    cfg=dataclasses.replace(cfg, implementation=impl))
            for impl in ("xla", "interpret")}
  (lx, cx), (li, ci) = outs["xla"], outs["interpret"]
  np.testing.assert_allclose(np.asarray(li), np.asarray(lx), rtol=1e-4, atol=1e-4)
  for n in ("k", "v"):
    changed = np.any(np.asarray(ci[n]) != cache[n], axis=(3, 4))
    want = np.zeros_like(changed)
    want[:, 0, 2] = want[:, 1, 11] = True
    np.testing.assert_array_equal(changed, want)
    # The new keys themselves come from each implementation's matmuls: close, not equal.
    np.testing.assert_allclose(np.asarray(ci[n]), np.asarray(cx[n]), rtol=1e-4, atol=1e-5)


@needs_gpu
class TestKvCacheWriteGpu:
  """The compiled kernel, bit for bit, and in place inside a loop."""

  @pytest.mark.parametrize("shape", SHAPES, ids=str)
  def test_pallas_equals_the_numpy_loop(self, request, shape):
    rng = np.random.default_rng(seed_from(request.node.name))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
      kc, vc, k, v, pos = _inputs(rng, shape, dtype)
      run = jax.jit(lambda *a: kernel.write_kv_cache(*a))
      for layer in (0, shape[0] - 1, -1):
        got = run(kc, vc, k, v, pos, jnp.asarray([layer], jnp.int32))
        for g, w in zip(got, reference(kc, vc, k, v, pos, layer)):
          _same(g, w)

  def test_in_a_scan_over_layers(self, request):
    """Each layer of a scan writes its slot through the kernel; the result equals the XLA
    path's scan."""
    rng = np.random.default_rng(seed_from(request.node.name))
    kc, vc, k, v, pos = _inputs(rng, (6, 2, 64, 4, 64, 1))

    def scanned(impl):
      def body(carry, layer):
        kc, vc = carry
        return qjax.write_kv_cache(kc, vc, k * (layer + 1), v, pos, layer=layer,
                                   implementation=impl), None
      return jax.jit(lambda kc, vc: jax.lax.scan(body, (kc, vc), jnp.arange(6))[0])

    for g, w in zip(scanned("pallas")(kc, vc), scanned("xla")(kc, vc)):
      _same(g, np.asarray(w))


@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.int32, jnp.uint8, jnp.bool_])
def test_non_float_cache_is_refused(cache_dtype):
  """A cache that is not floating point would truncate the float keys cast into it: the
  check refuses it by dtype (static, also under jit) and names the dtype."""
  rng = np.random.default_rng(5)
  kc, vc, k, v, pos = _inputs(rng, (2, 3, 9, 2, 24, 4), jnp.float32)
  kc, vc = kc.astype(cache_dtype), vc.astype(cache_dtype)
  with pytest.raises(ValueError, match=rf"dtype {jnp.dtype(cache_dtype).name}.*floating"):
    qjax.write_kv_cache(kc, vc, k, v, pos, layer=1, implementation="xla")
  with pytest.raises(ValueError, match="floating"):
    jax.jit(lambda a, b: qjax.write_kv_cache(a, b, k, v, pos, layer=1))(kc, vc)


def test_float_keys_of_another_dtype_are_cast():
  """Mixing float dtypes is documented (k / v cast to the cache's dtype) and still runs."""
  rng = np.random.default_rng(6)
  shape = (2, 3, 9, 2, 24, 4)
  kc, vc, k, v, pos = _inputs(rng, shape, jnp.bfloat16, new_dtype=jnp.float32)
  got = qjax.write_kv_cache(kc, vc, k, v, pos, layer=-1, implementation="xla")
  want = reference(kc, vc, k, v, pos, -1)  # numpy's own float32 -> bfloat16 cast
  _same(got[0], want[0])
  _same(got[1], want[1])
