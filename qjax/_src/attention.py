"""``qjax.decode_attention``: one query per sequence against a KV cache, and the registry of
its kernels.

At decode (one new token per sequence) attention reads the whole cache once and does
little arithmetic on it: a memory-bound product and sum per layer, like the GEMVs around
it. qjax defines the contract and its XLA implementation here; a faster implementation (a
Pallas kernel that reads each cached key and value once, skips masked slots and splits
the slots over programs: ``pallas_kernels.decode_attention``) registers itself with
:func:`register_decode_attention_kernel`, as the matmul kernels register with
:mod:`qjax._src.dispatch`. Implementation names are those of :func:`qjax.matmul`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import autodiff
from qjax._src import dispatch

log = logging.getLogger("qjax")

# The score of a masked slot: the float32 minimum (not -inf: exp(-inf - -inf) is NaN where
# every slot seen so far is masked).
MASKED_SCORE = float(np.finfo(np.float32).min)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
  """A registered kernel of one of the four attention operations: decode
  (:func:`register_decode_attention_kernel`), causal, write and write_decode (their
  ``register_*_kernel`` functions say what ``fn`` takes). Below, decode's.

  Attributes:
    name: e.g. "pallas_triton".
    fn: for decode, ``fn(q, k_cache, v_cache, mask, layer, sinks, *, scale, interpret) ->
      [batch, heads, head_dim]`` in q's dtype, with the arguments of
      :func:`decode_attention` checked and normalized: ``k_cache`` / ``v_cache`` always
      ``[layers, batch, slots, kv_heads, head_dim]``, ``layer`` a ``[1]`` int32 array in
      ``[-layers, layers)`` (negative: from the end; a traced layer is passed as it is,
      so that no extra XLA op runs before the kernel, which must clamp one outside that
      range to the nearest end, ``[0, layers)`` after the wrap, as the XLA path does),
      ``mask`` ``[batch, slots]`` bool,
      ``sinks`` None or ``[heads]`` float32, ``scale`` a float. Raises
      NotImplementedError naming an argument it cannot handle (``implementation=None``
      then runs the XLA path).
    supported_on: whether it compiles for a device (interpret mode runs anywhere).
  """
  name: str
  fn: Callable[..., jax.Array]
  supported_on: Callable[[jax.Device], bool]


# The registered kernels of each attention operation: "decode" (:func:`decode_attention`),
# "causal" (:func:`qjax.causal_attention`), "write" (:func:`qjax.write_kv_cache`, the
# new keys and values written into a cache) and "write_decode" (both at one decode step:
# :func:`qjax.write_and_decode_attention`).
_KERNELS: dict[str, list[AttentionBackend]] = {"decode": [], "causal": [], "write": [],
                                               "write_decode": []}


def register(op: str, backend: AttentionBackend) -> None:
  """Registers ``backend`` for the attention operation ``op`` ("decode", "causal", "write"
  or "write_decode"): the first registered is the default of "pallas" / "interpret", a later
  registration of a name replaces that backend. The jitted model steps
  (``flax_layers.llama.decode_step`` ...) trace again on their next call, as after any
  registration."""
  _KERNELS[op] = dispatch.replaced_in_place(_KERNELS[op], backend)
  autodiff.registry_changed()


def kernels(op: str) -> list[AttentionBackend]:
  """The registered kernels of the attention operation ``op`` (plugins loaded first)."""
  dispatch.load_plugins()
  return list(_KERNELS[op])


def register_decode_attention_kernel(backend: AttentionBackend) -> None:
  """Registers a kernel for :func:`decode_attention`; the first registered is the default
  of "pallas" / "interpret", a later registration of a name replaces that backend. The
  jitted model steps (``flax_layers.llama.decode_step`` ...) trace again on their next
  call, as after any registration."""
  register("decode", backend)


def decode_attention_kernels() -> list[AttentionBackend]:
  """The registered :func:`decode_attention` kernels (plugins loaded first)."""
  return kernels("decode")


def resolve_in(op: str, dtype, implementation: str | None,
               xla: Callable[..., jax.Array]) -> tuple[str, Callable[..., jax.Array]]:
  """The implementation the attention operation ``op`` runs for queries of ``dtype``: its
  name and a function ``fn(*normalized arguments, **keywords)`` (the attention ops'
  keyword is ``scale``); ``xla`` is the operation's XLA path (``fn(*args, **keywords)``).
  ``implementation=None``: the first kernel that supports the default device, for 16-bit
  queries, falling back to ``xla`` where it raises NotImplementedError."""
  if implementation not in (None, *dispatch.IMPLEMENTATIONS):
    raise ValueError(f"{implementation=} must be None or one of {dispatch.IMPLEMENTATIONS}")
  if implementation == "xla":
    return "xla", xla
  registered = kernels(op)
  what = f"{op}-attention kernel"
  if implementation in ("pallas", "interpret"):
    name, backend, interpret = dispatch.explicit_kernel(
        registered, implementation, what,
        f"no {what} is registered; use implementation='xla' (is pallas_kernels "
        "installed?)")
    return name, functools.partial(_kernel_call, backend, xla, interpret)
  backend = next((b for b in registered if b.supported_on(dispatch.default_device())), None)
  if backend is None or dispatch.runs_xla_for_dtype(dtype):
    return "xla", xla

  def auto(*args, **keywords):
    try:
      return _kernel_call(backend, xla, False, *args, **keywords)
    except NotImplementedError as e:
      log.info("%s fell back to XLA: %s", backend.name, e)
      return xla(*args, **keywords)

  return backend.name, auto


def _kernel_call(backend: AttentionBackend, xla: Callable[..., jax.Array], interpret: bool,
                 *args: Any, **keywords: Any) -> jax.Array:
  """``backend.fn(*args, **keywords)``, differentiated in reverse mode as the XLA path
  ``xla(*args, **keywords)`` (:func:`qjax._src.autodiff.kernel_call`, as the matmul
  kernels are)."""
  return autodiff.kernel_call(
      lambda *a: backend.fn(*a, **keywords, interpret=interpret),
      lambda *a: xla(*a, **keywords), *args)


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
  """``softmax(scores)`` over the last axis, float32; with ``sinks`` (float32,
  broadcastable to ``scores[..., :1]``) each row's denominator also holds its sink logit,
  which weighs no value (GPT-OSS)."""
  if sinks is None:
    return jax.nn.softmax(scores, axis=-1)
  sink = jnp.broadcast_to(sinks, (*scores.shape[:-1], 1)).astype(scores.dtype)
  return jax.nn.softmax(jnp.concatenate([scores, sink], -1), axis=-1)[..., :-1]


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
           sinks: jax.Array | None, scale: float) -> jax.Array:
  """Several queries per sequence in XLA: ``q [b, t, heads, d]`` over ``keys`` /
  ``values`` ``[b, s, kv_heads, d]`` where ``mask [b, t, s]``, sinks None or ``[heads]``
  -> ``[b, t, heads, d]`` in q's dtype (float32 scores and softmax, the probabilities
  rounded to q's dtype before they weigh the values; float32 products at
  ``Precision.HIGHEST``). The ``[b, heads, t, s]`` scores
  are materialized: the kernels of :func:`qjax.causal_attention` are not."""
  b, t, heads, d = q.shape
  kv_heads = keys.shape[2]
  g = heads // kv_heads
  qg = q.reshape(b, t, kv_heads, g, d)
  # float32 at full precision, as every XLA path of qjax (a GPU's default is TF32).
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys.astype(q.dtype), precision=precision,
                      preferred_element_type=jnp.float32) * scale
  scores = jnp.where(mask[:, None, None], scores, MASKED_SCORE)
  if sinks is not None:  # [b, kv, g, t, 1]
    sinks = jnp.asarray(sinks, jnp.float32).reshape(1, kv_heads, g, 1, 1)
  probs = softmax_with_sinks(scores, sinks).astype(q.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, values.astype(q.dtype), precision=precision,
                    preferred_element_type=jnp.float32).astype(q.dtype).reshape(
                        b, t, heads, d)


def check_decode_arguments(q, k_cache, v_cache, mask, layer, sinks):
  """The arguments of :func:`decode_attention` checked; returns ``(k_cache, v_cache,
  layer)`` with the caches 5-D and ``layer`` a ``[1]`` int32 array."""
  if q.ndim != 3:
    raise ValueError(f"q.shape={tuple(q.shape)}: want [batch, heads, head_dim] (one query "
                     "per sequence)")
  if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in dispatch.ACTIVATION_DTYPES]:
    raise ValueError(f"q.dtype={jnp.dtype(q.dtype).name} is not supported; cast q to "
                     "bfloat16, float16 or float32")
  if tuple(k_cache.shape) != tuple(v_cache.shape):
    raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                     "must have one shape")
  k_cache, v_cache, layer = stacked_caches(k_cache, v_cache, layer)
  b, heads, d = q.shape
  _, cb, slots, kv_heads, cd = k_cache.shape
  if cb != b or cd != d or heads % kv_heads:
    raise ValueError(f"q {tuple(q.shape)} does not fit a cache of batch {cb}, {kv_heads} KV "
                     f"heads of {cd}: want q [batch={cb}, a multiple of {kv_heads} heads, "
                     f"head_dim={cd}]")
  if tuple(mask.shape) != (b, slots):
    raise ValueError(f"mask.shape={tuple(mask.shape)}: want [batch, slots] = ({b}, {slots})")
  if jnp.dtype(mask.dtype) != jnp.dtype(bool):  # static: no device sync
    raise ValueError(f"mask.dtype={jnp.dtype(mask.dtype).name}: want bool (True: attend); "
                     "pass a bool array, e.g. mask != 0 (a float mask is not a bias)")
  if sinks is not None and tuple(jnp.shape(sinks)) != (heads,):
    raise ValueError(f"sinks of shape {tuple(jnp.shape(sinks))}: want [heads] = ({heads},)")
  return k_cache, v_cache, layer_array(layer, k_cache.shape[0])


def stacked_caches(k_cache, v_cache, layer):
  """``(k_cache, v_cache, layer)`` of a cache call's arguments, 4-D caches (``layer``
  None) as one layer of a stacked cache (layer 0); ValueError where the caches' rank does
  not match ``layer``."""
  want = 4 if layer is None else 5
  if k_cache.ndim != want:
    raise ValueError(
        f"k_cache.shape={tuple(k_cache.shape)} with layer={layer!r}: want "
        + ("[batch, slots, kv_heads, head_dim] (pass layer= for a stacked cache)"
           if layer is None else "[layers, batch, slots, kv_heads, head_dim]"))
  if layer is None:
    return k_cache[None], v_cache[None], 0
  return k_cache, v_cache, layer


def layer_array(layer, layers: int):
  """``layer`` of a stacked cache of ``layers`` as a ``[1]`` int32 array: an int checked
  and taken modulo ``layers``, a scalar integer array (maybe traced) as it is."""
  if isinstance(layer, (int, np.integer)):
    if not -layers <= int(layer) < layers:
      raise ValueError(f"layer={int(layer)} is outside a cache of {layers} layers")
    return np.asarray([int(layer) % layers], np.int32)
  if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
    raise ValueError(f"layer of shape {jnp.shape(layer)} and dtype "
                     f"{jnp.result_type(layer)}: want an int or a scalar integer array")
  return jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array, *,
                     layer: Any = None, sinks: jax.Array | None = None,
                     scale: float | None = None, implementation: str | None = None
                     ) -> jax.Array:
  """Grouped-query attention of one query per sequence over a KV cache.

  ``out[b, h] = sum_s p[b, h, s] v[b, s, h // g]`` with ``p = softmax_s(scale * q[b, h] .
  k[b, s, h // g])`` over the slots where ``mask[b, s]`` (``g = heads // kv_heads``);
  with ``sinks``, head ``h``'s softmax also holds the logit ``sinks[h]``, which weighs no
  value (GPT-OSS). Scores and the softmax in float32.

  Args:
    q: ``[batch, heads, head_dim]`` in bfloat16, float16 or float32.
    k_cache, v_cache: ``[batch, slots, kv_heads, head_dim]``, or ``[layers, batch, slots,
      kv_heads, head_dim]`` with ``layer``: the whole model's cache, of which layer
      ``layer`` is read in place (no copy of it).
    mask: ``[batch, slots]`` bool, the slots each query attends to (a kernel reads no key
      or value of a masked slot).
    layer: the layer of a stacked cache (an int, checked, or a scalar integer array, e.g.
      a scan's counter: negative counts from the end; a traced value is not checked:
      one outside ``[-layers, layers)`` reads the nearest end's layer, on the XLA path
      and in the kernel alike); None for a 4-D cache.
    sinks: optional ``[heads]`` float, each head's sink logit.
    scale: the factor on the scores; None: ``1 / sqrt(head_dim)``.
    implementation: None (a registered kernel where it supports the device and q is
      16-bit, else XLA), "xla", "pallas" or "interpret" (as :func:`qjax.matmul`).

  Returns:
    ``[batch, heads, head_dim]`` in q's dtype.

  Raises:
    ValueError: naming the argument, for shapes that do not fit each other, a q dtype
      other than the three above, a ``mask`` that is not bool (an int or float mask is
      refused, not read as a bias: pass ``mask != 0``), an int ``layer`` outside the
      cache, or ``sinks`` not ``[heads]``. These checks read shapes and dtypes only.

  A query whose slots are all masked gets zeros (every implementation). Through a kernel,
  reverse mode (``jax.grad``) takes the XLA path's derivative; forward mode is the XLA
  path's alone.

  >>> import jax.numpy as jnp, qjax
  >>> q = jnp.ones((1, 8, 64), jnp.bfloat16)
  >>> k = v = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  >>> mask = jnp.arange(16)[None] < 5
  >>> qjax.decode_attention(q, k, v, mask, implementation="xla").shape
  (1, 8, 64)
  """
  k_cache, v_cache, layer = check_decode_arguments(q, k_cache, v_cache, mask, layer, sinks)
  mask = jnp.asarray(mask, bool)
  if sinks is not None:
    sinks = jnp.asarray(sinks, jnp.float32)
  scale = float(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
  _, fn = resolve(q.dtype, implementation)
  return fn(q, k_cache, v_cache, mask, layer, sinks, scale=scale)


def resolve(dtype, implementation: str | None) -> tuple[str, Callable[..., jax.Array]]:
  """The implementation :func:`decode_attention` runs for queries of ``dtype``: its name
  and a function of the normalized arguments."""
  return resolve_in("decode", dtype, implementation, decode_attention_xla)


def decode_attention_implementation_name(dtype=jnp.bfloat16,
                                         implementation: str | None = None) -> str:
  """The name of the implementation :func:`decode_attention` would run here for queries
  of ``dtype`` ("xla", "pallas_triton", "pallas_triton-interpret", ...).

  >>> import jax.numpy as jnp, qjax
  >>> qjax.decode_attention_implementation_name(jnp.float32)  # float32: XLA by default
  'xla'
  """
  return resolve(dtype, implementation)[0]


def decode_attention_xla(q, k_cache, v_cache, mask, layer, sinks, *, scale: float):
  """The XLA path of :func:`decode_attention` on its normalized arguments (see
  :class:`AttentionBackend`).

  The scores and the weighted sum of values are each a product and a sum that XLA fuses
  with the dynamic slice of the layer out of the whole cache, reading it in place; as a
  dot, the slice would be copied and transposed first (H100, 16 layers of 8 KV heads x 64
  at 4096 slots: about 120 us a step; docs/experiments/s36_kv_cache.py). The
  probabilities are rounded to q's dtype before they weigh the values.
  """
  b, heads, d = q.shape
  kv_heads = k_cache.shape[3]
  g = heads // kv_heads
  at = jnp.where(layer[0] < 0, layer[0] + k_cache.shape[0], layer[0])
  at = jnp.clip(at, 0, k_cache.shape[0] - 1)  # a traced layer outside: the nearest one
  keys = jax.lax.dynamic_index_in_dim(k_cache, at, keepdims=False).astype(q.dtype)
  values = jax.lax.dynamic_index_in_dim(v_cache, at, keepdims=False).astype(q.dtype)
  qg = q.reshape(b, kv_heads, g, 1, d).astype(jnp.float32)
  k = jnp.swapaxes(keys, 1, 2)[:, :, None].astype(jnp.float32)  # [b, kv, 1, s, d]
  scores = (qg * k).sum(-1) * scale  # [b, kv, g, s]
  scores = jnp.where(mask[:, None, None], scores, MASKED_SCORE)
  # With sinks, one more logit per head in the denominator.
  probs = softmax_with_sinks(scores, None if sinks is None else sinks.reshape(kv_heads, g, 1))
  p = probs.astype(q.dtype)[..., None].astype(jnp.float32)  # [b, kv, g, s, 1]
  v = jnp.swapaxes(values, 1, 2)[:, :, None].astype(jnp.float32)  # [b, kv, 1, s, d]
  out = (p * v).sum(-2).astype(q.dtype).reshape(b, heads, d)
  # No slot to attend to: zeros (the softmax alone would give the mean of the values).
  return jnp.where(jnp.any(mask, axis=-1)[:, None, None], out, jnp.zeros_like(out))
