"""``qjax.decode_attention`` (qjax/_src/attention.py) and its kernel
(pallas_kernels/decode_attention.py).

Every output is checked against a float64 numpy softmax attention written here, on random
queries, caches and masks (random, causal prefixes, sliding windows, one slot, none), with
grouped heads (g = 1, 3, 4, 16), head dims 32 / 64 / 80 / 128, slot counts that are not
multiples of the kernel's step, stacked caches read at a layer, sink logits; the kernel in
interpret mode (CPU) and compiled (GPU only), its outputs poisoned (NaN) before the run so
an unwritten element fails; one split per program and several.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import check_attention as _check, needs_gpu, rel_err, seed_from
from flax_layers import llama
from pallas_kernels import decode_attention as kernel
from qjax._src import attention

# Relative error bounds per dtype: the output's own rounding (and the probabilities',
# rounded to q's dtype before they weigh the values) for 16-bit; float32 on the GPU
# multiplies in TF32 in the kernel.
BOUND = {jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}
GPU_BOUND = {jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3, jnp.float32: 2e-3}

# (batch, heads, kv_heads, head_dim, slots, layers)
SHAPES = (
    (1, 8, 2, 64, 37, 1),      # g = 4, slots not a multiple of 16
    (2, 9, 3, 64, 200, 3),     # SmolLM2's g = 3 (padded to 16 rows), a stacked cache
    (1, 32, 8, 64, 300, 2),    # Llama-3.2-1B's heads
    (2, 4, 4, 80, 130, 2),     # g = 1, head_dim not a power of two
    (1, 16, 1, 128, 1000, 1),  # multi-query, 16 heads on one KV head
    (3, 6, 2, 32, 17, 2),      # three sequences, fewer slots than one step
)
MASKS = ("random", "prefix", "window", "one")


def _rng(request, extra: str = "") -> np.random.Generator:
  return np.random.default_rng(seed_from(request.node.nodeid + extra))


def _mask(rng, kind: str, b: int, slots: int) -> np.ndarray:
  """``[b, slots]`` bool with at least one slot per row."""
  pos = rng.integers(0, slots, b)
  s = np.arange(slots)[None]
  if kind == "random":
    mask = rng.random((b, slots)) < 0.6
  elif kind == "prefix":  # causal decode: slots <= position
    mask = s <= pos[:, None]
  elif kind == "window":  # a sliding window of 8 ending at the position
    mask = (s <= pos[:, None]) & (pos[:, None] - s < 8)
  else:
    mask = s == pos[:, None]
  mask[np.arange(b), pos] = True
  return mask


def _inputs(rng, shape, dtype, mask_kind="random", sinks=False):
  b, heads, kv_heads, d, slots, layers = shape
  q = jnp.asarray(rng.standard_normal((b, heads, d)), dtype)
  k = jnp.asarray(rng.standard_normal((layers, b, slots, kv_heads, d)), dtype)
  v = jnp.asarray(rng.standard_normal((layers, b, slots, kv_heads, d)), dtype)
  mask = _mask(rng, mask_kind, b, slots)
  sk = jnp.asarray(rng.standard_normal(heads) * 2, jnp.float32) if sinks else None
  return q, k, v, mask, sk


def reference(q, k, v, mask, sinks=None, scale=None) -> np.ndarray:
  """float64 softmax attention: q ``[b, heads, d]``, k / v ``[b, slots, kv_heads, d]``,
  mask ``[b, slots]``, sinks None or ``[heads]``; zeros where a row has no slot."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, heads, d = q.shape
  g = heads // k.shape[2]
  scale = 1 / np.sqrt(d) if scale is None else scale
  out = np.zeros_like(q)
  for bi in range(b):
    if not mask[bi].any():
      continue
    for h in range(heads):
      s = k[bi, :, h // g] @ q[bi, h] * scale
      s = np.where(mask[bi], s, -np.inf)
      top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
      e = np.exp(s - top)
      den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
      out[bi, h] = (e / den) @ v[bi, :, h // g]
  return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("sinks", [False, True])
def test_matches_float64(request, shape, implementation, sinks):
  rng = _rng(request)
  q, k, v, mask, sk = _inputs(rng, shape, jnp.bfloat16, sinks=sinks)
  layer = shape[5] - 1
  out = qjax.decode_attention(q, k, v, jnp.asarray(mask), layer=layer, sinks=sk,
                              implementation=implementation)
  _check(out, reference(q, k[layer], v[layer], mask, sk), q, BOUND[jnp.bfloat16],
         (shape, implementation))


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d:
                         jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_masks_and_dtypes(request, mask_kind, dtype, implementation):
  rng = _rng(request)
  shape = (2, 9, 3, 64, 200, 1)
  q, k, v, mask, _ = _inputs(rng, shape, dtype, mask_kind)
  # Interpret mode's float32 dots take jax's default precision (TF32 on a GPU).
  with jax.default_matmul_precision("highest"):
    out = qjax.decode_attention(q, k[0], v[0], jnp.asarray(mask),
                                implementation=implementation)
  _check(out, reference(q, k[0], v[0], mask), q, BOUND[dtype], (mask_kind, implementation))


# (block_s, splits): one program per (sequence, KV head), several, more than the steps.
CONFIGS = ((64, 1), (16, 3), (32, None), (16, 100))


@pytest.mark.parametrize("block_s,splits", CONFIGS)
@pytest.mark.parametrize("sinks", [False, True])
def test_kernel_configs_poisoned(request, block_s, splits, sinks):
  """Every config writes every output element (poisoned buffers) and matches."""
  rng = _rng(request)
  shape = (2, 9, 3, 64, 130, 2)
  q, k, v, mask, sk = _inputs(rng, shape, jnp.bfloat16, "prefix", sinks)
  config = kernel.AttentionConfig(block_s=block_s, splits=splits)
  out = kernel.decode_attention(q, k, v, jnp.asarray(mask), jnp.asarray([1], jnp.int32),
                                sk, scale=1 / 8, interpret=True, config=config, poison=True)
  _check(out, reference(q, k[1], v[1], mask, sk), q, BOUND[jnp.bfloat16], config)


def test_loop_shape_leaves_no_split_empty():
  for slots in (1, 16, 17, 256, 4096, 4097, 32768):
    for batch, kv_heads in ((1, 8), (1, 1), (4, 8), (64, 8)):
      for config in (kernel.AttentionConfig(), kernel.AttentionConfig(block_s=16, splits=7)):
        block_s, splits, steps = kernel.loop_shape(batch, kv_heads, slots, config)
        chunks = -(-slots // block_s)
        assert 1 <= splits <= chunks and (splits - 1) * steps < chunks <= splits * steps
  # Long caches spread over the GPU; many sequences keep one program per pair.
  assert kernel.loop_shape(1, 8, 4096, kernel.AttentionConfig()) == (128, 32, 1)
  assert kernel.loop_shape(1, 8, 256, kernel.AttentionConfig()) == (64, 4, 1)
  assert kernel.loop_shape(64, 8, 4096, kernel.AttentionConfig())[1] == 1
  # Wide rows take smaller steps; the stages' blocks fit the shared-memory budget.
  assert kernel.loop_shape(1, 8, 4096, kernel.AttentionConfig(), row_bytes=256)[0] == 64
  for row_bytes in (32, 128, 256, 512, 1024):
    for block_s in (16, 64, 128, 256):
      b, stages = kernel.fitted(block_s, 3, row_bytes)
      assert 16 <= b <= block_s and 1 <= stages <= 3
      assert 2 * b * row_bytes * stages <= kernel.STAGE_BYTES or b == 16


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_no_slot_gives_zeros(request, implementation):
  rng = _rng(request)
  q, k, v, mask, _ = _inputs(rng, (2, 8, 2, 64, 40, 1), jnp.bfloat16)
  mask[1] = False
  for sk in (None, jnp.ones(8, jnp.float32)):
    out = qjax.decode_attention(q, k[0], v[0], jnp.asarray(mask), sinks=sk,
                                implementation=implementation)
    assert np.all(np.asarray(out[1], np.float32) == 0)
    _check(out[:1], reference(q[:1], k[0, :1], v[0, :1], mask[:1], sk), q[:1],
           BOUND[jnp.bfloat16], implementation)


def test_masked_slots_are_not_read(request):
  """NaN keys and values in masked slots do not reach the output of the kernel (it does
  not load them); the XLA path multiplies them by zero probabilities, so it is given the
  same cache with those slots zeroed."""
  rng = _rng(request)
  q, k, v, mask, _ = _inputs(rng, (1, 8, 2, 64, 100, 1), jnp.bfloat16, "prefix")
  poisoned = jnp.where(jnp.asarray(mask)[None, :, :, None, None], k, jnp.nan)
  out = qjax.decode_attention(q, poisoned, jnp.where(jnp.isnan(poisoned), jnp.nan, v),
                              jnp.asarray(mask), layer=0, implementation="interpret")
  _check(out, reference(q, k[0], v[0], mask), q, BOUND[jnp.bfloat16], "NaN in masked slots")


def test_layer_index_forms(request):
  """An int, a negative int and a traced scalar (a scan's counter) read the same layer."""
  rng = _rng(request)
  q, k, v, mask, _ = _inputs(rng, (1, 8, 2, 64, 50, 4), jnp.bfloat16)
  ref = reference(q, k[2], v[2], mask)
  for impl in ("xla", "interpret"):
    for layer in (2, -2, np.int64(2)):
      out = qjax.decode_attention(q, k, v, jnp.asarray(mask), layer=layer, implementation=impl)
      _check(out, ref, q, BOUND[jnp.bfloat16], (impl, layer))
    run = jax.jit(lambda i, impl=impl: qjax.decode_attention(
        q, k, v, jnp.asarray(mask), layer=i, implementation=impl))
    for traced in (2, -2):  # a traced negative layer counts from the end too
      _check(run(jnp.int32(traced)), ref, q, BOUND[jnp.bfloat16], (impl, "traced", traced))


def test_traced_layer_outside_the_cache_is_clamped(request):
  """A traced layer past either end of the cache reads the nearest end's layer, on the
  XLA path and in the kernel (which read outside the cache's buffer before, on the GPU;
  interpret mode's loads clamp by themselves, so this runs compiled there too)."""
  rng = _rng(request)
  q, k, v, mask, _ = _inputs(rng, (2, 8, 2, 64, 70, 3), jnp.bfloat16, "prefix")
  impls = ("xla", "interpret") + (("pallas",) if jax.devices()[0].platform == "gpu" else ())
  for impl in impls:
    run = jax.jit(lambda i, impl=impl: qjax.decode_attention(
        q, k, v, jnp.asarray(mask), layer=i, implementation=impl))
    for traced, want in ((3, 2), (40, 2), (-4, 0), (-1000, 0)):
      _check(run(jnp.int32(traced)), reference(q, k[want], v[want], mask), q,
             BOUND[jnp.bfloat16], (impl, traced))


def test_scale_argument(request):
  rng = _rng(request)
  q, k, v, mask, _ = _inputs(rng, (1, 4, 2, 32, 30, 1), jnp.float32)
  for impl in ("xla", "interpret"):
    with jax.default_matmul_precision("highest"):  # interpret's float32 dots: no TF32
      out = qjax.decode_attention(q, k[0], v[0], jnp.asarray(mask), scale=0.3,
                                  implementation=impl)
    _check(out, reference(q, k[0], v[0], mask, scale=0.3), q, BOUND[jnp.float32], impl)


def test_gradient_through_the_kernel_is_the_xla_paths(request):
  """``jax.grad`` through the decode kernel (interpret) takes the XLA path's backward
  pass: the same gradients in q, the cache and the sinks."""
  rng = _rng(request)
  q, k, v, mask, sk = _inputs(rng, (2, 4, 2, 16, 30, 2), jnp.float32, sinks=True)
  mask = jnp.asarray(mask)

  def loss(impl):
    return lambda q_, k_, v_, s_: qjax.decode_attention(
        q_, k_, v_, mask, layer=1, sinks=s_, implementation=impl).sum()

  with jax.default_matmul_precision("highest"):
    want = jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(q, k, v, sk)
    got = jax.grad(loss("interpret"), argnums=(0, 1, 2, 3))(q, k, v, sk)
  for g, w in zip(got, want):
    assert float(jnp.abs(w).max()) > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_xla_path_is_differentiable(request):
  rng = _rng(request)
  q, k, v, mask, _ = _inputs(rng, (1, 4, 2, 32, 30, 1), jnp.float32)
  grad = jax.grad(lambda q_: qjax.decode_attention(q_, k[0], v[0], jnp.asarray(mask),
                                                   implementation="xla").sum())(q)
  assert grad.shape == q.shape and bool(jnp.all(jnp.isfinite(grad)))
  assert float(jnp.abs(grad).max()) > 0


@pytest.mark.parametrize("bad,match", [
    (dict(q=np.zeros((1, 8, 1, 64))), "one query per sequence"),
    (dict(q=np.zeros((1, 8, 64), np.int32)), "q.dtype=int32"),
    (dict(v=np.zeros((1, 1, 41, 2, 64))), "must have one shape"),
    (dict(k=np.zeros((1, 40, 2, 64)), v=np.zeros((1, 40, 2, 64)), layer=0), "layers, batch"),
    (dict(layer=None), "pass layer="),
    (dict(q=np.zeros((1, 7, 64))), "a multiple of 2 heads"),
    (dict(mask=np.ones((1, 39), bool)), r"mask.shape=\(1, 39\)"),
    (dict(sinks=np.zeros(7)), r"sinks of shape \(7,\)"),
    (dict(layer=3), "layer=3 is outside a cache of 1 layers"),
    (dict(layer=np.zeros(2, np.int32)), r"layer of shape \(2,\)"),
    (dict(implementation="cuda"), "implementation='cuda'"),
])
def test_errors_name_the_bad_value(bad, match):
  args = dict(q=np.zeros((1, 8, 64)), k=np.zeros((1, 1, 40, 2, 64)),
              v=np.zeros((1, 1, 40, 2, 64)), mask=np.ones((1, 40), bool), layer=0,
              sinks=None, implementation="xla")
  args.update(bad)
  to = lambda a: None if a is None else jnp.asarray(a, jnp.bfloat16 if np.asarray(a).dtype
                                                    == np.float64 else None)
  if isinstance(args["layer"], np.ndarray):
    args["layer"] = jnp.asarray(args["layer"])
  with pytest.raises(ValueError, match=match):
    qjax.decode_attention(to(args["q"]), to(args["k"]), to(args["v"]),
                          jnp.asarray(args["mask"]), layer=args["layer"],
                          sinks=to(args["sinks"]), implementation=args["implementation"])


def test_kernel_refuses_wide_heads():
  q = jnp.zeros((1, 2, 512), jnp.bfloat16)
  k = jnp.zeros((1, 1, 8, 1, 512), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim=512"):
    kernel.decode_attention(q, k, k, jnp.ones((1, 8), bool), jnp.zeros((1,), jnp.int32),
                            None, scale=1.0, interpret=True)
  # implementation=None falls back to XLA where the kernel declines (on a GPU); on the
  # CPU it runs XLA anyway.
  out = qjax.decode_attention(q, k[0], k[0], jnp.ones((1, 8), bool))
  assert out.shape == q.shape


def test_implementation_names():
  name = qjax.decode_attention_implementation_name
  assert name(jnp.bfloat16, "xla") == "xla"
  assert name(jnp.bfloat16, "interpret") == "pallas_triton-interpret"
  on_gpu = jax.devices()[0].platform == "gpu"
  assert name(jnp.bfloat16) == name() == ("pallas_triton" if on_gpu else "xla")
  # float32 queries run XLA by default (the kernel's dots would be TF32 on the GPU).
  assert name(jnp.float32) == "xla"
  assert llama.attention_implementation("pallas") == "pallas"
  before = dict(attention._KERNELS)  # pylint: disable=protected-access
  try:  # without a kernel, the layers' "pallas" runs XLA (as their matmul does)
    attention._KERNELS = {**before, "decode": []}  # pylint: disable=protected-access
    assert llama.attention_implementation("pallas") == "xla"
    with pytest.raises(NotImplementedError, match="no decode-attention kernel"):
      name(jnp.bfloat16, "pallas")
  finally:
    attention._KERNELS = before  # pylint: disable=protected-access


def test_registration_replaces_by_name():
  """A backend registered under an existing name replaces it in place; the first
  registered stays the default; functions marked ``retraced_on_registration`` trace
  again."""
  before = dict(attention._KERNELS)  # pylint: disable=protected-access
  traces = []

  @qjax.retraced_on_registration
  @jax.jit
  def step(x):
    traces.append(1)
    return x + 1

  try:
    step(1.0)
    step(1.0)
    fake = qjax.AttentionBackend(name="pallas_triton", fn=lambda *a, **k: None,
                                 supported_on=lambda d: False)
    qjax.register_decode_attention_kernel(fake)
    step(1.0)  # traced again: a jitted model step picks up the new kernel
    assert len(traces) == 2
    assert attention.decode_attention_kernels()[0] is fake
    other = qjax.AttentionBackend(name="other", fn=lambda *a, **k: None,
                                  supported_on=lambda d: False)
    qjax.register_decode_attention_kernel(other)
    assert [b.name for b in attention.decode_attention_kernels()] == ["pallas_triton", "other"]
  finally:
    attention._KERNELS = before  # pylint: disable=protected-access


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="the CPU smoke run; on a GPU "
                    "`qjax bench --attention` times the full shapes (BENCHMARKS.md)")
def test_bench_attention_cpu_smoke(tmp_path, capsys):
  """``qjax bench --attention`` on the CPU: XLA and interpret, rows in the JSON, a floor
  from the attended bytes."""
  from qjax._src import attention_bench  # pylint: disable=g-import-not-at-top
  from qjax._src import cli  # pylint: disable=g-import-not-at-top
  path = tmp_path / "att.json"
  assert cli.main(["bench", "--attention", "--calls", "1", "--m", "2", "--attention-slots",
                   "40", "--attention-heads", "6/2/32", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "interpret xXLA" in out and "CPU run" in out
  import json  # pylint: disable=g-import-not-at-top
  rows = json.loads(path.read_text())["attention_rows"]
  assert [(r["batch"], r["slots"], r["filled"]) for r in rows] == [(2, 40, 0.5), (2, 40, 1.0)]
  for r in rows:
    assert set(r["times_us"]) == {"xla", "interpret"}
    assert all(t > 0 for t in r["times_us"].values()) and r["floor_us"] > 0
  # The floor's bytes: 20 (then 40) attended slots of keys and values, q and the output.
  assert attention_bench.attended_bytes(2, 40, 0.5, 6, 2, 32) == 2 * (2 * 2 * 20 * 2 * 32
                                                                        + 2 * 2 * 6 * 32)


@needs_gpu
class TestDecodeAttentionGpu:
  """The compiled kernel on the GPU, poisoned, against float64."""

  @pytest.mark.parametrize("shape", SHAPES + ((1, 32, 8, 64, 4096, 2), (4, 32, 8, 128, 2000, 1)),
                           ids=str)
  @pytest.mark.parametrize("mask_kind", ["random", "prefix", "window"])
  def test_pallas_matches_float64(self, request, shape, mask_kind):
    for dtype, bound in GPU_BOUND.items():
      for sinks in (False, True):
        rng = _rng(request, jnp.dtype(dtype).name + str(sinks))
        q, k, v, mask, sk = _inputs(rng, shape, dtype, mask_kind, sinks)
        layer = jnp.asarray([shape[5] - 1], jnp.int32)
        run = jax.jit(lambda *a: kernel.decode_attention(*a, scale=shape[3] ** -0.5,
                                                         poison=True))
        out = run(q, k, v, jnp.asarray(mask), layer, sk)
        ref = reference(q, k[-1], v[-1], mask, sk)
        _check(out, ref, q, bound, (shape, mask_kind, dtype, sinks))

  @pytest.mark.parametrize("block_s,splits", CONFIGS + ((128, None), (32, 1)))
  def test_pallas_configs(self, request, block_s, splits):
    rng = _rng(request)
    q, k, v, mask, sk = _inputs(rng, (2, 9, 3, 64, 777, 2), jnp.bfloat16, "prefix", True)
    config = kernel.AttentionConfig(block_s=block_s, splits=splits)
    out = jax.jit(lambda *a: kernel.decode_attention(*a, scale=0.125, config=config,
                                                     poison=True))(
        q, k, v, jnp.asarray(mask), jnp.asarray([0], jnp.int32), sk)
    _check(out, reference(q, k[0], v[0], mask, sk), q, GPU_BOUND[jnp.bfloat16], config)

  def test_pallas_is_auto_and_matches_xla(self, request):
    rng = _rng(request)
    q, k, v, mask, _ = _inputs(rng, (1, 32, 8, 64, 1024, 3), jnp.bfloat16, "prefix")
    assert qjax.decode_attention_implementation_name(q.dtype) == "pallas_triton"
    auto = qjax.decode_attention(q, k, v, jnp.asarray(mask), layer=1)
    xla = qjax.decode_attention(q, k, v, jnp.asarray(mask), layer=1, implementation="xla")
    ref = reference(q, k[1], v[1], mask)
    _check(auto, ref, q, GPU_BOUND[jnp.bfloat16], "auto")
    assert rel_err(auto, xla) < GPU_BOUND[jnp.bfloat16]


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.float32, jnp.bfloat16])
def test_non_bool_mask_is_refused(dtype):
  """An int or float mask (0.5 included) is refused by its static dtype, not read as a
  bias or truthiness; the message names the dtype and says to pass a bool array."""
  rng = np.random.default_rng(3)
  q, k, v, mask, _ = _inputs(rng, (2, 4, 2, 8, 5, 1), jnp.float32)
  bad = jnp.where(jnp.asarray(mask), 0.5, 0.0).astype(dtype)
  with pytest.raises(ValueError, match=rf"mask\.dtype={jnp.dtype(dtype).name}.*bool array"):
    qjax.decode_attention(q, k[0], v[0], bad, implementation="xla")
  with pytest.raises(ValueError, match=rf"mask\.dtype={jnp.dtype(dtype).name}"):
    jax.jit(lambda m: qjax.decode_attention(q, k[0], v[0], m, implementation="xla"))(bad)
  # The bool mask of the same slots runs.
  out = qjax.decode_attention(q, k[0], v[0], jnp.asarray(mask), implementation="xla")
  assert out.shape == q.shape
