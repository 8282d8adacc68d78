"""``qjax.causal_attention`` (qjax/_src/causal_attention.py) and its flash-attention kernel
(pallas_kernels/prefill_attention.py).

Every output is checked against a float64 numpy causal softmax attention written here, on
random queries, keys and values, with grouped heads (g = 1, 3, 4, 16), head dims 32 / 64 /
80 / 128, prompt lengths that are not multiples of the kernel's blocks (one token too),
sliding windows (int and traced, one key to beyond the prompt), sink logits; the kernel
in interpret mode (CPU) and compiled (GPU only), its output poisoned (NaN) before the run
so an unwritten element fails, with blocks small enough for several query and key blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import check_attention as _check, needs_gpu, seed_from, small_llama
from flax_layers import llama
from pallas_kernels import prefill_attention as kernel
from qjax._src import attention
from qjax._src import causal_attention as causal

# Relative error bounds per dtype (the output's rounding and the probabilities', rounded to
# q's dtype before they weigh the values); float32 on the GPU multiplies in TF32.
BOUND = {jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}
GPU_BOUND = {jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3, jnp.float32: 2e-3}

# (batch, seq, heads, kv_heads, head_dim)
SHAPES = (
    (1, 37, 8, 2, 64),     # g = 4, seq not a multiple of 16
    (2, 100, 9, 3, 64),    # SmolLM2's g = 3, two sequences
    (1, 130, 4, 4, 80),    # g = 1, head_dim not a power of two
    (1, 200, 16, 1, 128),  # multi-query
    (3, 17, 6, 2, 32),     # three sequences, one block and a row
    (2, 1, 4, 2, 64),      # one token
)
WINDOWS = (None, 1, 7, 64)
SMALL = kernel.PrefillConfig(block_q=32, block_k=16, num_warps=4, num_stages=2)
ZERO = np.zeros((8,), np.int32)  # offsets of prompts from position 0


def _rng(request, extra: str = "") -> np.random.Generator:
  return np.random.default_rng(seed_from(request.node.nodeid + extra))


def _inputs(rng, shape, dtype, sinks=False):
  b, t, heads, kv_heads, d = shape
  q = jnp.asarray(rng.standard_normal((b, t, heads, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, t, kv_heads, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, t, kv_heads, d)), dtype)
  sk = jnp.asarray(rng.standard_normal(heads) * 2, jnp.float32) if sinks else None
  return q, k, v, sk


def reference(q, k, v, window=None, sinks=None, scale=None, offset=None) -> np.ndarray:
  """float64 causal softmax attention: q ``[b, t, heads, d]``, k / v ``[b, s, kv_heads,
  d]``; query ``i`` of sequence ``b`` (position ``p = offset[b] + i``, offset None: 0)
  sees keys ``j <= p`` with ``p - j < window``; sinks None or ``[heads]``; zeros for a
  row with no key."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, heads, d = q.shape
  keys = k.shape[1]
  g = heads // k.shape[2]
  scale = 1 / np.sqrt(d) if scale is None else scale
  offset = np.zeros(b, int) if offset is None else np.broadcast_to(offset, (b,))
  out = np.zeros_like(q)
  for bi in range(b):
    i, j = offset[bi] + np.arange(t)[:, None], np.arange(keys)[None, :]
    seen = (j <= i) & (i - j < (keys + 1 if window is None else window))
    for h in range(heads):
      s = np.where(seen, q[bi, :, h] @ k[bi, :, h // g].T * scale, -np.inf)  # [t, keys]
      top = s.max(1, keepdims=True)
      if sinks is not None:
        top = np.maximum(top, float(sinks[h]))
      top = np.where(np.isfinite(top), top, 0.0)
      e = np.exp(s - top)
      den = e.sum(1, keepdims=True)
      if sinks is not None:
        den = den + np.exp(float(sinks[h]) - top)
      out[bi, :, h] = np.where(den > 0, (e / np.where(den > 0, den, 1)) @ v[bi, :, h // g],
                               0.0)
  return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("sinks", [False, True])
def test_matches_float64(request, shape, implementation, sinks):
  rng = _rng(request)
  q, k, v, sk = _inputs(rng, shape, jnp.bfloat16, sinks)
  out = qjax.causal_attention(q, k, v, sinks=sk, implementation=implementation)
  _check(out, reference(q, k, v, sinks=sk), q, BOUND[jnp.bfloat16], (shape, implementation))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d:
                         jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_windows_and_dtypes(request, window, dtype, implementation):
  rng = _rng(request)
  q, k, v, _ = _inputs(rng, (2, 100, 9, 3, 64), dtype)
  # Interpret mode's float32 dots take jax's default precision (TF32 on a GPU).
  with jax.default_matmul_precision("highest"):
    out = qjax.causal_attention(q, k, v, window=window, implementation=implementation)
  _check(out, reference(q, k, v, window), q, BOUND[dtype], (window, implementation))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("shape", [(1, 37, 8, 2, 64), (2, 100, 9, 3, 80)], ids=str)
def test_kernel_small_blocks_poisoned(request, window, sinks, shape):
  """Several query and key blocks, a window that starts inside a block: every output
  element written (poisoned buffer) and right; the window traced as well as static."""
  rng = _rng(request)
  q, k, v, sk = _inputs(rng, shape, jnp.bfloat16, sinks)
  ref = reference(q, k, v, window, sk)
  w = np.asarray([window or shape[1]], np.int32)
  scale = shape[4] ** -0.5
  out = kernel.causal_attention(q, k, v, ZERO[:shape[0]], w, sk, scale=scale, interpret=True,
                                config=SMALL, poison=True)
  _check(out, ref, q, BOUND[jnp.bfloat16], "static window")
  traced = jax.jit(lambda w: kernel.causal_attention(q, k, v, ZERO[:shape[0]], w, sk,
                                                     scale=scale, interpret=True,
                                                     config=SMALL))(w)
  np.testing.assert_array_equal(np.asarray(traced, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_traced_window_and_scale(request, implementation):
  """A window passed as a traced scalar (as a scan over layers chooses it) equals the
  int; a window beyond the prompt is no window; ``scale`` replaces 1 / sqrt(d)."""
  rng = _rng(request)
  q, k, v, _ = _inputs(rng, (1, 40, 4, 2, 32), jnp.bfloat16)
  fn = jax.jit(lambda w: qjax.causal_attention(q, k, v, window=w, scale=0.3,
                                               implementation=implementation))
  for window in (3, 40, 1000):
    got = fn(jnp.int32(window))
    _check(got, reference(q, k, v, window, scale=0.3), q, BOUND[jnp.bfloat16], window)
    static = qjax.causal_attention(q, k, v, window=window, scale=0.3,
                                   implementation=implementation)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(static, np.float32))
  none = qjax.causal_attention(q, k, v, scale=0.3, implementation=implementation)
  np.testing.assert_array_equal(np.asarray(none, np.float32),
                                np.asarray(fn(jnp.int32(1000)), np.float32))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_traced_window_below_one_gives_zeros(implementation):
  q = jnp.ones((1, 5, 2, 16), jnp.bfloat16)
  out = jax.jit(lambda w: qjax.causal_attention(q, q, q, window=w,
                                                implementation=implementation))(jnp.int32(0))
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def test_gradient_through_the_kernel_is_the_xla_paths(request):
  """``jax.grad`` through the kernel (interpret) takes the XLA path's backward pass: the
  same gradients in q, k, v and the sinks, with a traced window."""
  rng = _rng(request)
  q, k, v, sk = _inputs(rng, (1, 21, 4, 2, 16), jnp.float32, sinks=True)
  cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def loss(impl):
    return lambda *a: (qjax.causal_attention(a[0], a[1], a[2], sinks=a[3], window=a[4],
                                             implementation=impl) * cot).sum()

  args = (q, k, v, sk, jnp.int32(6))
  with jax.default_matmul_precision("highest"):
    want = jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(*args)
    got = jax.jit(jax.grad(loss("interpret"), argnums=(0, 1, 2, 3)))(*args)
  for g, w in zip(got, want):
    assert float(jnp.abs(w).max()) > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_xla_path_differentiates():
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 2, 16)), jnp.float32)
  grad = jax.grad(lambda q: qjax.causal_attention(q, q, q, implementation="xla").sum())(q)
  assert np.isfinite(np.asarray(grad)).all() and float(jnp.abs(grad).max()) > 0


# (batch, queries, keys, heads, kv_heads, head_dim, offsets): queries from a position past 0
# over a cache of keys that holds the earlier positions (and, past the last query, slots
# not yet written, here random: they must not be seen).
OFFSET_CASES = (
    (1, 5, 40, 8, 2, 64, (35,)),         # a short turn at the cache's end
    (2, 37, 100, 9, 3, 64, (50, 13)),     # two sequences at different positions
    (1, 64, 64, 4, 4, 32, (0,)),          # offset 0: the prompt's own keys
    (3, 17, 90, 6, 2, 80, (1, 40, 73)),   # blocks that start mid key-block
    (1, 1, 33, 4, 2, 64, (32,)),          # one query, the decode case
    (16, 20, 60, 4, 2, 32, tuple(range(14, 30))),  # every offset modulo the small blocks
)


def _offset_case(request, case, window):
  """``(q, k, v, sinks, offset, float64 reference)`` of an :data:`OFFSET_CASES` row."""
  b, t, s, heads, kv_heads, d, offsets = case
  q, k, v, sk = _inputs(_rng(request), (b, s, heads, kv_heads, d), jnp.bfloat16, sinks=True)
  q = q[:, :t]
  offset = np.asarray(offsets, np.int32)
  return q, k, v, sk, offset, reference(q, k, v, window, sk, offset=offset)


@pytest.mark.parametrize("case", OFFSET_CASES, ids=str)
@pytest.mark.parametrize("window", [None, 1, 7, 30])
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_offset_over_a_cache_matches_float64(request, case, window, implementation):
  q, k, v, sk, offset, ref = _offset_case(request, case, window)
  s, d = k.shape[1], k.shape[3]
  out = qjax.causal_attention(q, k, v, offset=offset, window=window, sinks=sk,
                              implementation=implementation)
  _check(out, ref, q, BOUND[jnp.bfloat16], (case, window, implementation))
  if implementation == "interpret":  # small blocks, poisoned; offset and window traced
    w = np.asarray([window or s], np.int32)
    run = jax.jit(lambda o, w: kernel.causal_attention(
        q, k, v, o, w, sk, scale=d ** -0.5, interpret=True, config=SMALL, poison=True))
    _check(run(offset, w), ref, q, BOUND[jnp.bfloat16], (case, window, "small blocks"))


def test_offset_as_an_int_and_traced():
  rng = np.random.default_rng(7)
  q, k, v, _ = _inputs(rng, (2, 30, 4, 2, 32), jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = qjax.causal_attention(q[:, :6], k, v, offset=np.asarray([24, 24]),
                                 implementation="xla")
  got = qjax.causal_attention(q[:, :6], k, v, offset=24, implementation="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  traced = jax.jit(lambda o: qjax.causal_attention(q[:, :6], k, v, offset=o,
                                                   implementation="interpret"))
  with jax.default_matmul_precision("highest"):  # float32: no TF32 on a GPU
    got = traced(jnp.int32(24))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("args,match", [
    (dict(q=(1, 5, 4, 16), k=(1, 5, 2, 16), window=0), "window=0 must be at least 1"),
    (dict(q=(1, 5, 4), k=(1, 5, 2, 16)), r"want \[batch, seq, heads, head_dim\]"),
    (dict(q=(1, 5, 4, 16), k=(2, 5, 2, 16)), "does not fit keys"),
    (dict(q=(1, 5, 4, 16), k=(1, 6, 2, 16)), "without offset= they must be equal"),
    (dict(q=(1, 5, 4, 16), k=(1, 9, 2, 16), offset=5), r"offset\[0\]=5: the 5 queries at "
     r"positions 5 \.\. 9 must lie inside the 9 keys \(0 <= offset <= 4\)"),
    (dict(q=(2, 5, 4, 16), k=(2, 9, 2, 16), offset=np.asarray([0, -1])), r"offset\[1\]=-1"),
    (dict(q=(2, 5, 4, 16), k=(2, 9, 2, 16), offset=np.zeros(3, np.int32)),
     r"offset of shape \(3,\).*want an int or \[batch\] = \(2,\)"),
    (dict(q=(1, 5, 4, 16), k=(1, 9, 2, 16), offset=1.5), "offset of shape"),
    (dict(q=(1, 5, 3, 16), k=(1, 5, 2, 16)), "multiple of 2 heads"),
    (dict(q=(1, 5, 4, 16), k=(1, 5, 2, 16), sinks=(3,)), r"sinks of shape \(3,\)"),
    (dict(q=(1, 5, 4, 16), k=(1, 5, 2, 16), window=np.ones(2, np.int32)),
     "want None, an int or a scalar integer array"),
])
def test_errors_name_the_bad_value(args, match):
  q = jnp.ones(args["q"], jnp.bfloat16)
  k = jnp.ones(args["k"], jnp.bfloat16)
  sinks = None if "sinks" not in args else jnp.ones(args["sinks"])
  with pytest.raises(ValueError, match=match):
    qjax.causal_attention(q, k, k, offset=args.get("offset"), window=args.get("window"),
                          sinks=sinks)


def test_bad_dtype_and_implementation():
  q = jnp.ones((1, 4, 2, 16), jnp.int8)
  with pytest.raises(ValueError, match="q.dtype=int8"):
    qjax.causal_attention(q, q, q)
  q = jnp.ones((1, 4, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="implementation='cuda'"):
    qjax.causal_attention(q, q, q, implementation="cuda")


def test_kernel_refuses_wide_heads_and_auto_falls_back(monkeypatch):
  """A head_dim above 256: NotImplementedError from the kernel; ``implementation=None``
  then runs XLA."""
  q = jnp.ones((1, 4, 2, 272), jnp.bfloat16)
  w = np.asarray([4], np.int32)
  with pytest.raises(NotImplementedError, match="head_dim=272"):
    kernel.causal_attention(q, q, q, ZERO[:1], w, None, scale=0.1, interpret=True)
  backend = causal.causal_attention_kernels()[0]
  monkeypatch.setattr(attention, "_KERNELS", {**attention._KERNELS, "causal": [  # pylint: disable=protected-access
      qjax.AttentionBackend(backend.name, backend.fn, lambda d: True)]})
  want = qjax.causal_attention(q, q, q, implementation="xla")
  np.testing.assert_array_equal(np.asarray(qjax.causal_attention(q, q, q), np.float32),
                                np.asarray(want, np.float32))


def test_implementation_names(monkeypatch):
  name = qjax.causal_attention_implementation_name
  assert name(jnp.bfloat16, "xla") == "xla"
  assert name(jnp.bfloat16, "interpret") == "pallas_triton-interpret"
  on_gpu = jax.devices()[0].platform == "gpu"
  assert name(jnp.bfloat16) == name() == ("pallas_triton" if on_gpu else "xla")
  assert name(jnp.float32) == "xla"  # the kernel's dots would be TF32 on the GPU
  assert llama.attention_implementation("pallas", "causal") == "pallas"
  monkeypatch.setattr(attention, "_KERNELS", {**attention._KERNELS, "causal": []})  # pylint: disable=protected-access
  assert llama.attention_implementation("pallas", "causal") == "xla"
  assert llama.attention_implementation("pallas") == "pallas"  # decode keeps its kernel
  with pytest.raises(NotImplementedError, match="no causal-attention kernel"):
    name(jnp.bfloat16, "pallas")


def test_registration_replaces_by_name(monkeypatch):
  monkeypatch.setattr(attention, "_KERNELS", dict(attention._KERNELS))  # pylint: disable=protected-access
  fake = qjax.AttentionBackend(name="pallas_triton", fn=lambda *a, **k: None,
                               supported_on=lambda d: False)
  qjax.register_causal_attention_kernel(fake)
  assert causal.causal_attention_kernels() == [fake]
  other = qjax.AttentionBackend(name="other", fn=lambda *a, **k: None,
                                supported_on=lambda d: False)
  qjax.register_causal_attention_kernel(other)
  assert [b.name for b in causal.causal_attention_kernels()] == ["pallas_triton", "other"]
  assert attention.decode_attention_kernels()[0].name == "pallas_triton"


@pytest.mark.parametrize("scan_layers", [True, False])
def test_llama_prefill_kernel_equals_xla(request, scan_layers, monkeypatch):
  """``llama.prefill``'s attention (``fresh_prompt``) by the causal kernel (interpret)
  gives the logits of its XLA path and of the whole-cache path, with sliding-window layers
  and sink logits: in a scan over layers (the window a traced choice) and unrolled (a
  Python one)."""
  rng = _rng(request)
  cfg, params = small_llama(rng, scan_layers)
  b, t = 2, 23
  tokens = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  original = causal.resolve
  outs = {}
  with jax.default_matmul_precision("highest"):  # float32 model: no TF32 on a GPU
    for impl in ("xla", "interpret"):
      monkeypatch.setattr(causal, "resolve",
                          lambda dtype, implementation, impl=impl: original(dtype, impl))
      outs[impl] = np.asarray(llama.Llama(cfg, fresh_prompt=True).apply(
          params, tokens, positions, llama.init_cache(cfg, b, 32))[0])
    whole = np.asarray(llama.Llama(cfg).apply(params, tokens, positions,
                                              llama.init_cache(cfg, b, 32))[0])
  assert np.isfinite(whole).all() and np.abs(whole).max() > 0
  for impl, got in outs.items():
    np.testing.assert_allclose(got, whole, rtol=0, atol=1e-4 * np.abs(whole).max(),
                               err_msg=impl)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_llama_extend_in_chunks_equals_one_prefill(request, scan_layers, monkeypatch):
  """``llama.extend`` after ``llama.prefill`` (a next turn; chunks of 1 and 13 tokens, the
  two sequences from different positions) gives the logits of one prefill of the whole
  sequence, its attention by XLA and by the kernel (interpret), with sliding-window
  layers and sinks, scanned and unrolled."""
  rng = _rng(request)
  cfg, params = small_llama(rng, scan_layers)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 30)), jnp.int32)
  original = causal.resolve
  with jax.default_matmul_precision("highest"):  # float32 model: no TF32 on a GPU
    whole = np.asarray(llama.prefill(params, tokens, llama.init_cache(cfg, 2, 32),
                                     cfg=cfg)[0])
    for impl in ("xla", "interpret"):
      monkeypatch.setattr(causal, "resolve",
                          lambda dtype, implementation, impl=impl: original(dtype, impl))
      llama.extend.clear_cache()
      _, cache = llama.prefill(params, tokens[:, :9], llama.init_cache(cfg, 2, 32), cfg=cfg)
      start = np.asarray([9, 5])  # the second sequence runs again from position 5
      for size in (1, 13, 3):
        chunk = jnp.stack([tokens[i, p:p + size] for i, p in enumerate(start)])
        logits, cache = llama.extend(params, chunk, jnp.asarray(start), cache, cfg=cfg)
        for i, p in enumerate(start):
          want = whole[i, p:p + size]
          np.testing.assert_allclose(np.asarray(logits[i]), want, rtol=0,
                                     atol=1e-4 * np.abs(want).max(),
                                     err_msg=f"{impl}, chunk of {size} from {p}")
        start = start + size
  llama.extend.clear_cache()


def test_llama_extend_past_the_cache_gives_nan_logits():
  rng = np.random.default_rng(3)
  cfg, params = small_llama(rng, True)
  _, cache = llama.prefill(params, jnp.ones((1, 6), jnp.int32), llama.init_cache(cfg, 1, 8),
                           cfg=cfg)
  logits, _ = llama.extend(params, jnp.ones((1, 4), jnp.int32), 6, cache, cfg=cfg)
  assert np.isfinite(np.asarray(logits[0, :2])).all()
  assert np.isnan(np.asarray(logits[0, 2:])).all()


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES + ((1, 1000, 32, 8, 64), (2, 700, 32, 8, 128)),
                         ids=str)
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("sinks", [False, True])
def test_compiled_kernel_on_gpu(request, shape, window, sinks):
  """The compiled kernel (default blocks and the small ones), poisoned output."""
  rng = _rng(request)
  q, k, v, sk = _inputs(rng, shape, jnp.bfloat16, sinks)
  ref = reference(q, k, v, window, sk)
  w = np.asarray([window or shape[1]], np.int32)
  for config in (None, SMALL):
    out = kernel.causal_attention(q, k, v, ZERO[:shape[0]], w, sk, scale=shape[4] ** -0.5,
                                  config=config, poison=True)
    _check(out, ref, q, GPU_BOUND[jnp.bfloat16], (shape, config))


@needs_gpu
@pytest.mark.parametrize("case", OFFSET_CASES + ((2, 700, 3000, 32, 8, 128, (2300, 1017)),
                                                 (1, 1000, 4096, 32, 8, 64, (3096,))),
                         ids=str)
@pytest.mark.parametrize("window", [None, 30])
def test_compiled_kernel_with_offsets_on_gpu(request, case, window):
  """The compiled kernel from offsets past 0 over a longer cache (default blocks and the
  small ones), sinks, poisoned output."""
  q, k, v, sk, offset, ref = _offset_case(request, case, window)
  s, d = k.shape[1], k.shape[3]
  w = np.asarray([window or s], np.int32)
  for config in (None, SMALL):
    out = kernel.causal_attention(q, k, v, offset, w, sk, scale=d ** -0.5, config=config,
                                  poison=True)
    _check(out, ref, q, GPU_BOUND[jnp.bfloat16], (case, window, config))


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d:
                         jnp.dtype(d).name)
def test_compiled_dtypes_on_gpu(request, dtype):
  rng = _rng(request)
  q, k, v, _ = _inputs(rng, (2, 300, 9, 3, 64), dtype)
  out = qjax.causal_attention(q, k, v, window=100, implementation="pallas")
  _check(out, reference(q, k, v, 100), q, GPU_BOUND[dtype], jnp.dtype(dtype).name)


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="the CPU smoke run; on a GPU "
                    "`qjax bench --attention --prefill` times the full shapes (BENCHMARKS.md)")
def test_bench_prefill_cpu_smoke(tmp_path, capsys):
  """``qjax bench --attention --prefill`` on the CPU: XLA and interpret, rows in the JSON,
  the causal FLOP count; ``--prefill`` without ``--attention`` is a usage error."""
  import json  # pylint: disable=g-import-not-at-top
  from qjax._src import attention_bench  # pylint: disable=g-import-not-at-top
  from qjax._src import cli  # pylint: disable=g-import-not-at-top
  path = tmp_path / "prefill.json"
  assert cli.main(["bench", "--attention", "--prefill", "--calls", "1", "--m", "2",
                   "--attention-slots", "20,33", "--attention-heads", "6/2/32", "--json",
                   str(path)]) == 0
  out = capsys.readouterr().out
  assert "qjax.causal_attention" in out and "interpret xXLA" in out
  rows = json.loads(path.read_text())["prefill_rows"]
  assert [(r["batch"], r["tokens"]) for r in rows] == [(2, 20), (2, 33)]
  for r in rows:
    assert set(r["times_us"]) == {"xla", "interpret"}
    assert all(t > 0 for t in r["times_us"].values())
  # 2 products x 2 FLOP per multiply-add x batch 2 x 6 heads x 32 x (20 * 21 / 2) pairs.
  assert attention_bench.causal_flops(2, 20, 6, 32) == 2 * 2 * 2 * 6 * 32 * 210
  with pytest.raises(SystemExit):
    cli.main(["bench", "--prefill"])
  assert "--prefill is an option of --attention" in capsys.readouterr().err
