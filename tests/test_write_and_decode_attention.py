"""``qjax.write_and_decode_attention`` (qjax/_src/decode_write.py) and its kernel
(``pallas_kernels.decode_attention.write_and_decode_attention``).

The reference is written here from the two operations' own references: the numpy write
of test_kv_cache_write (the caches must equal it bit for bit: the new rows where their
positions and the layer lie in the cache, every other slot as it was) and the float64
softmax attention of test_decode_attention over the written layer. Random queries, caches
(never zeros: a slot read before its write, or written by mistake, shows) and masks;
grouped heads g = 1, 3, 4, 16, head dims 32 / 64 / 80 / 128, slot counts that are not
multiples of the kernel's step, positions outside the cache (negative and past the end),
the new slot masked and not, layers from either end, concrete and traced; the kernel in
interpret mode (CPU) and compiled (GPU only), its outputs poisoned (NaN) before the run,
one split per program and several.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
import test_decode_attention as attention_tests
import test_kv_cache_write as write_tests
from conftest import (check_attention, needs_gpu, on_device, on_gpu, random_cache, seed_from,
                      small_llama)
from flax_layers import llama
from pallas_kernels import decode_attention as kernel
from qjax._src import attention as qjax_attention
from qjax._src import autodiff as qjax_autodiff

IMPLS = ("xla", "interpret") + (("pallas",) if on_gpu() else ())
BOUND = attention_tests.BOUND
# (batch, heads, kv_heads, head_dim, slots, layers): test_decode_attention's shapes.
SHAPES = attention_tests.SHAPES


def _inputs(rng, shape, dtype, cache_dtype=None, mask_kind="prefix"):
  """``(q, k, v, k_cache, v_cache, positions, mask, sinks)``: one sequence's position
  outside the cache where there are several (negative or past the end), the others'
  mask holding their own slot or (random masks) maybe not."""
  b, heads, kv_heads, d, slots, layers = shape
  cache_dtype = cache_dtype or dtype
  q = jnp.asarray(rng.standard_normal((b, heads, d)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((b, kv_heads, d)), cache_dtype) for _ in "kv")
  kc, vc = (jnp.asarray(rng.standard_normal((layers, b, slots, kv_heads, d)), cache_dtype)
            for _ in "kv")
  mask = attention_tests._mask(rng, mask_kind, b, slots)
  pos = np.asarray([int(np.flatnonzero(row)[-1]) for row in mask])
  if b > 1:
    pos[-1] = rng.choice([-1, slots, slots + 5])
  sinks = jnp.asarray(rng.standard_normal(heads) * 2, jnp.float32)
  return q, k, v, kc, vc, jnp.asarray(pos, jnp.int32), mask, sinks


def reference(q, k, v, k_cache, v_cache, positions, mask, layer, sinks=None, scale=None):
  """``(out float64, k_cache, v_cache)``: the numpy write, then float64 attention over the
  written layer (the nearest end's where ``layer`` lies outside the cache)."""
  kc, vc = write_tests.reference(k_cache, v_cache, k[:, None], v[:, None],
                                 np.asarray(positions)[:, None], layer)
  at = int(np.clip(layer + kc.shape[0] if layer < 0 else layer, 0, kc.shape[0] - 1))
  # The written rows in q's dtype, as a read of the cache gives them.
  keys, values = (np.asarray(jnp.asarray(c[at]).astype(q.dtype)) for c in (kc, vc))
  out = attention_tests.reference(q, keys, values, mask, sinks, scale)
  return out, kc, vc


def _check(got, want, q, bound, what):
  out, kc, vc = got
  check_attention(out, want[0], q, bound, what)
  write_tests._same(kc, want[1])
  write_tests._same(vc, want[2])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sinks", [False, True])
def test_matches_the_write_then_float64(request, shape, impl, sinks):
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  q, k, v, kc, vc, pos, mask, sk = _inputs(rng, shape, jnp.bfloat16, mask_kind="random")
  sk = sk if sinks else None
  layers = shape[5]
  for layer in sorted({0, layers - 1, -1}):
    got = qjax.write_and_decode_attention(q, k, v, kc, vc, pos, jnp.asarray(mask),
                                          layer=layer, sinks=sk, implementation=impl)
    _check(got, reference(q, k, v, kc, vc, pos, mask, layer, sk), q, BOUND[jnp.bfloat16],
           (shape, impl, layer))


@pytest.mark.parametrize("dtype,cache_dtype", [
    (jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16), (jnp.float32, jnp.float32),
    (jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_dtypes(request, dtype, cache_dtype, impl):
  """Queries and caches of one dtype (one operand for q, k and v in the kernel) and of two
  (the new rows apart, in the cache's dtype)."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  shape = (2, 9, 3, 64, 200, 2)
  q, k, v, kc, vc, pos, mask, _ = _inputs(rng, shape, dtype, cache_dtype)
  with jax.default_matmul_precision("highest"):
    got = qjax.write_and_decode_attention(q, k, v, kc, vc, pos, jnp.asarray(mask), layer=1,
                                          implementation=impl)
  gpu_f32 = impl == "pallas" and dtype == jnp.float32
  bound = (attention_tests.GPU_BOUND if gpu_f32 else BOUND)[dtype]
  if cache_dtype == jnp.bfloat16:  # bf16 keys and values round the float32 queries' output
    bound = max(bound, BOUND[jnp.bfloat16])
  _check(got, reference(q, k, v, kc, vc, pos, mask, 1), q, bound, (dtype, cache_dtype))


# (block_s, splits): one program per (sequence, KV head), several, more than the steps.
@pytest.mark.parametrize("block_s,splits", attention_tests.CONFIGS)
@pytest.mark.parametrize("sinks", [False, True])
def test_kernel_configs_poisoned(request, block_s, splits, sinks):
  """Every config writes every output element (poisoned buffers), the rows, and matches:
  split 0 holds the new token wherever its slot lies among the splits'."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  shape = (3, 9, 3, 64, 130, 2)
  q, k, v, kc, vc, pos, mask, sk = _inputs(rng, shape, jnp.bfloat16, mask_kind="prefix")
  sk = sk if sinks else None
  config = kernel.AttentionConfig(block_s=block_s, splits=splits)
  got = kernel.write_and_decode_attention(
      q, k, v, kc, vc, pos, jnp.asarray(mask), jnp.asarray([1], jnp.int32), sk, scale=0.1,
      interpret=True, config=config, poison=True)
  _check(got, reference(q, k, v, kc, vc, pos, mask, 1, sk, scale=0.1), q,
         BOUND[jnp.bfloat16], config)


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_layer_and_a_masked_new_slot(request, impl):
  """Under jit with the layer traced: every layer from either end; one outside the cache
  writes nothing and reads the nearest end's layer, old row at the position included
  (as the two operations apart do). The new slot masked: the row is written, not
  attended."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  shape = (2, 8, 2, 32, 50, 3)
  q, k, v, kc, vc, pos, mask, _ = _inputs(rng, shape, jnp.bfloat16, mask_kind="random")
  pos = jnp.asarray([7, 20], jnp.int32)
  mask[0, 7], mask[1, 20] = False, True
  run = jax.jit(lambda layer, mask: qjax.write_and_decode_attention(
      q, k, v, kc, vc, pos, mask, layer=layer, implementation=impl))
  for layer in (-5, -3, -1, 0, 2, 3, 9):
    _check(run(jnp.int32(layer), jnp.asarray(mask)),
           reference(q, k, v, kc, vc, pos, mask, layer), q, BOUND[jnp.bfloat16], layer)


@pytest.mark.parametrize("impl", IMPLS)
def test_equals_the_two_operations(request, impl):
  """The same as :func:`qjax.write_kv_cache` then :func:`qjax.decode_attention` of one
  implementation: caches bit for bit, outputs to the attention's rounding (the XLA path
  is that composition, bit for bit); a 4-D cache without ``layer``."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  q, k, v, kc, vc, pos, mask, sk = _inputs(rng, (2, 9, 3, 64, 70, 1), jnp.bfloat16)
  got = qjax.write_and_decode_attention(q, k, v, kc[0], vc[0], pos, mask, sinks=sk,
                                        implementation=impl)
  nk, nv = qjax.write_kv_cache(kc[0], vc[0], k[:, None], v[:, None], pos[:, None],
                               implementation=impl)
  want = qjax.decode_attention(q, nk, nv, mask, sinks=sk, implementation=impl)
  write_tests._same(got[1], np.asarray(nk))
  write_tests._same(got[2], np.asarray(nv))
  if impl == "xla":
    write_tests._same(got[0], np.asarray(want))
  else:
    check_attention(got[0], np.asarray(want, np.float64), q, 1e-2, impl)


def test_errors_name_the_argument():
  q = jnp.ones((1, 4, 8), jnp.bfloat16)
  kc = jnp.ones((2, 1, 16, 2, 8), jnp.bfloat16)
  new = jnp.ones((1, 2, 8), jnp.bfloat16)
  pos = jnp.zeros((1,), jnp.int32)
  mask = jnp.ones((1, 16), bool)
  call = qjax.write_and_decode_attention
  with pytest.raises(ValueError, match=r"k \(1, 1, 2, 8\) .*want both \[batch, kv_heads"):
    call(q, new[:, None], new[:, None], kc, kc, pos, mask, layer=0)
  with pytest.raises(ValueError, match=r"positions of shape \(1, 1\): want \[batch\]"):
    call(q, new, new, kc, kc, pos[:, None], mask, layer=0)
  with pytest.raises(ValueError, match=r"q.shape=\(1, 1, 4, 8\)"):
    call(q[None], new, new, kc, kc, pos, mask, layer=0)
  with pytest.raises(ValueError, match="layer=2 is outside a cache of 2 layers"):
    call(q, new, new, kc, kc, pos, mask, layer=2)
  with pytest.raises(ValueError, match=r"mask.shape=\(1, 15\)"):
    call(q, new, new, kc, kc, pos, mask[:, 1:], layer=0)
  with pytest.raises(ValueError, match=r"want both \[batch=1, seq, kv_heads=2, head_dim=8\]"):
    call(q, new[..., :4], new[..., :4], kc, kc, pos, mask, layer=0)
  with pytest.raises(ValueError, match="positions of shape .* float32"):
    call(q, new, new, kc, kc, pos.astype(jnp.float32), mask, layer=0)
  with pytest.raises(ValueError, match="sinks of shape"):
    call(q, new, new, kc, kc, pos, mask, layer=0, sinks=jnp.ones(3))
  with pytest.raises(ValueError, match="implementation="):
    call(q, new, new, kc, kc, pos, mask, layer=0, implementation="cuda")


def test_implementation_name():
  name = qjax.write_and_decode_attention_implementation_name
  assert name(jnp.bfloat16) == name() == ("pallas_triton" if on_gpu() else "xla")
  assert name(jnp.float32) == "xla"
  assert name(jnp.bfloat16, "interpret") == "pallas_triton-interpret"
  assert name(jnp.bfloat16, "xla") == "xla"


def _decode_plugin(calls: list):
  """A decode-attention backend for every device (the XLA path, counting its traces)."""
  def fn(*args, scale, interpret):
    del interpret
    calls.append(1)
    return qjax_attention.decode_attention_xla(*args, scale=scale)
  return qjax.AttentionBackend(name="plugin", fn=fn, supported_on=lambda d: True)


@pytest.mark.parametrize("joined", ["none", "unsupported"])
def test_a_decode_only_plugin_runs_apart(request, monkeypatch, joined):
  """Where no joined kernel runs (none registered, or one that does not run on the
  device) and a plugin registered only a decode kernel, the write (XLA: no write kernel
  here) and the plugin's attention run apart: in direct calls, with "pallas" (no joined
  kernel registered) and in a Llama decode step, whose logits and cache equal (bit for
  bit) the same step's with XLA's attention."""
  calls = []
  registry = qjax_attention._KERNELS  # pylint: disable=protected-access
  kernels = {**registry, "write": [], "decode": [_decode_plugin(calls)]}
  real = registry["write_decode"]
  kernels["write_decode"] = [] if joined == "none" else [
      dataclasses.replace(real[0], supported_on=lambda d: False)]
  monkeypatch.setattr(qjax_attention, "_KERNELS", kernels)
  name = qjax.write_and_decode_attention_implementation_name
  assert name(jnp.bfloat16) == "xla write, plugin attention"
  assert name(jnp.float32) == "xla"  # float32 q: XLA, as decode_attention's own rule
  assert name(jnp.bfloat16, "xla") == "xla"
  if joined == "none":
    assert name(jnp.bfloat16, "pallas") == "xla write, plugin attention"
    assert llama.attention_implementation("pallas", "write_decode") == "pallas"
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  q, k, v, kc, vc, pos, mask, sk = _inputs(rng, (2, 8, 2, 32, 20, 3), jnp.bfloat16)
  out, nk, nv = qjax.write_and_decode_attention(q, k, v, kc, vc, pos, mask, layer=1,
                                                sinks=sk)
  assert calls
  want = qjax.write_and_decode_attention(q, k, v, kc, vc, pos, mask, layer=1, sinks=sk,
                                         implementation="xla")
  for got, w in zip((out, nk, nv), want):
    write_tests._same(got, np.asarray(w))
  calls.clear()
  cfg, params = small_llama(rng)
  cfg = dataclasses.replace(cfg, dtype=jnp.bfloat16)
  cache = random_cache(cfg, rng, 2, 12)
  step = lambda c_: llama.decode_step(params, jnp.array([5, 7]), jnp.array([2, 11]),
                                      on_device(cache), cfg=c_)  # donated: a copy each
  lp, cp = step(cfg)
  assert calls, "the plugin did not run in the decode step"
  kernels["decode"] = []  # the same step with XLA's attention (the plugin's, bit for bit)
  qjax_autodiff.registry_changed()
  calls.clear()
  lx, cx = step(cfg)
  assert not calls
  np.testing.assert_array_equal(np.asarray(lp, np.float32), np.asarray(lx, np.float32))
  for n in ("k", "v"):
    write_tests._same(cp[n], np.asarray(cx[n]))


def test_no_kernel_of_any_part():
  """No joined, write or decode kernel registered: "pallas" names the joined registry's
  error, and the layers run XLA."""
  empty = {"write_decode": [], "write": [], "decode": []}
  with pytest.MonkeyPatch.context() as mp:
    registry = qjax_attention._KERNELS  # pylint: disable=protected-access
    mp.setattr(qjax_attention, "_KERNELS", {**registry, **empty})
    with pytest.raises(NotImplementedError, match="no write_decode-attention kernel"):
      qjax.write_and_decode_attention_implementation_name(jnp.bfloat16, "pallas")
    assert llama.attention_implementation("pallas", "write_decode") == "xla"
    assert qjax.write_and_decode_attention_implementation_name(jnp.bfloat16) == "xla"


def _kernel_names(jaxpr) -> list[str]:
  """The names of the pallas_calls in ``jaxpr`` and its sub-jaxprs."""
  from jax.extend import core as jex_core  # pylint: disable=g-import-not-at-top
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      # "name" (jax 0.10), or an object with a .name in other versions.
      name = eqn.params.get("name", eqn.params.get("name_and_src_info"))
      found.append(str(getattr(name, "name", name)))
    for sub in jex_core.jaxprs_in_params(eqn.params):
      found += _kernel_names(sub)
  return found


def test_llama_decode_runs_one_kernel_for_write_and_attention(request):
  """A Llama decode step with kernels launches the joined kernel once a layer and neither
  of the two apart; its logits and cache equal the XLA path's (which composes the two
  operations as before)."""
  rng = np.random.default_rng(seed_from(request.node.nodeid))
  cfg, params = small_llama(rng)
  cache = random_cache(cfg, rng, 2, 12)
  c = dataclasses.replace(cfg, implementation="interpret")
  step = lambda p, c_: llama.decode_step(p, jnp.array([5, 7]), jnp.array([2, 11]),
                                         on_device(cache), cfg=c_)
  names = _kernel_names(jax.make_jaxpr(lambda p: step(p, c))(params).jaxpr)
  assert "qjax_decode_attention_write" in names, names
  assert "qjax_decode_attention" not in names and "qjax_kv_cache_write" not in names, names
  with jax.default_matmul_precision("highest"):
    (li, ci), (lx, cx) = step(params, c), step(params, cfg)
  np.testing.assert_allclose(np.asarray(li), np.asarray(lx), rtol=1e-4, atol=1e-4)
  for n in ("k", "v"):
    np.testing.assert_allclose(np.asarray(ci[n]), np.asarray(cx[n]), rtol=1e-4, atol=1e-5)


@needs_gpu
class TestWriteAndDecodeAttentionGpu:
  """The compiled kernel: every config poisoned, and inside a scan over layers, as the
  Llama layers run it."""

  @pytest.mark.parametrize("block_s,splits", attention_tests.CONFIGS)
  @pytest.mark.parametrize("shape", SHAPES, ids=str)
  def test_compiled_configs_poisoned(self, request, block_s, splits, shape):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    q, k, v, kc, vc, pos, mask, sk = _inputs(rng, shape, jnp.bfloat16, mask_kind="random")
    config = kernel.AttentionConfig(block_s=block_s, splits=splits)
    layer = shape[5] - 1
    got = jax.jit(lambda *a: kernel.write_and_decode_attention(
        *a, scale=0.1, config=config, poison=True))(
            q, k, v, kc, vc, pos, jnp.asarray(mask), jnp.asarray([layer], jnp.int32), sk)
    _check(got, reference(q, k, v, kc, vc, pos, mask, layer, sk, scale=0.1), q,
           BOUND[jnp.bfloat16], (shape, config))

  def test_in_a_scan_over_layers(self, request):
    rng = np.random.default_rng(seed_from(request.node.nodeid))
    q, k, v, kc, vc, pos, mask, _ = _inputs(rng, (2, 9, 3, 64, 300, 6), jnp.bfloat16)

    def scanned(impl):
      def body(carry, layer):
        kc, vc = carry
        out, kc, vc = qjax.write_and_decode_attention(
            q, k * (layer + 1).astype(k.dtype), v, kc, vc, pos, mask, layer=layer,
            implementation=impl)
        return (kc, vc), out
      return jax.jit(lambda kc, vc: jax.lax.scan(body, (kc, vc), jnp.arange(6)))

    (gk, gv), gout = scanned("pallas")(kc, vc)
    (wk, wv), wout = scanned("xla")(kc, vc)
    write_tests._same(gk, np.asarray(wk))
    write_tests._same(gv, np.asarray(wv))
    for i in range(6):
      check_attention(gout[i], np.asarray(wout[i], np.float64), q, 1e-2, i)
