"""``qjax.causal_attention``: a prompt's queries over its own keys (prefill), or over a cache
that holds the earlier positions too (a next turn, a prompt in chunks), and the registry of
its kernels.

A prompt run from position 0 attends causally to itself: query ``i`` sees keys ``j <= i``
(and, in a sliding-window layer, ``i - j < window``); run from position ``offset``, query
``i`` sits at ``p = offset + i`` and sees the keys ``j <= p`` (``p - j < window``) of the
cache. Its XLA path materializes the ``[b,
heads, t, t]`` float32 scores (2 GiB a layer for 32 heads at 4096 tokens, written and
read several times); a kernel (flash attention: ``pallas_kernels.prefill_attention``)
keeps them in registers, block by block, and skips the blocks the mask hides. Kernels
register with :func:`register_causal_attention_kernel`, as the decode-attention kernels
do; implementation names are those of :func:`qjax.matmul`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import attention
from qjax._src import dispatch


def register_causal_attention_kernel(backend: attention.AttentionBackend) -> None:
  """Registers a kernel for :func:`causal_attention` (``backend.fn(q, k, v, offset, window,
  sinks, *, scale, interpret)`` on the normalized arguments of :func:`causal_attention_xla`);
  the first registered is the default of "pallas" / "interpret", a later registration of
  a name replaces that backend, and the jitted model steps trace again."""
  attention.register("causal", backend)


def causal_attention_kernels() -> list[attention.AttentionBackend]:
  """The registered :func:`causal_attention` kernels (plugins loaded first)."""
  return attention.kernels("causal")


def _check(q, k, v, offset, window, sinks) -> tuple[jax.Array, jax.Array]:
  """The arguments of :func:`causal_attention` checked; returns ``(offset, window)`` as a
  ``[batch]`` and a ``[1]`` int32 array (zeros, and ``s`` where None)."""
  if q.ndim != 4:
    raise ValueError(f"q.shape={tuple(q.shape)}: want [batch, seq, heads, head_dim]")
  if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in dispatch.ACTIVATION_DTYPES]:
    raise ValueError(f"q.dtype={jnp.dtype(q.dtype).name} is not supported; cast q to "
                     "bfloat16, float16 or float32")
  if tuple(k.shape) != tuple(v.shape) or k.ndim != 4:
    raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)}: want one shape, [batch, "
                     "seq, kv_heads, head_dim]")
  b, t, heads, d = q.shape
  kb, s, kv_heads, kd = k.shape
  if (kb, kd) != (b, d) or heads % kv_heads:
    raise ValueError(f"q {tuple(q.shape)} does not fit keys {tuple(k.shape)}: want q [batch="
                     f"{kb}, seq, a multiple of {kv_heads} heads, head_dim={kd}]")
  if offset is None and s != t:
    raise ValueError(f"q {tuple(q.shape)} has {t} queries and k {tuple(k.shape)} {s} keys: "
                     "without offset= they must be equal (a prompt over its own keys); pass "
                     "offset=, the queries' first position, for keys of earlier positions")
  if sinks is not None and tuple(jnp.shape(sinks)) != (heads,):
    raise ValueError(f"sinks of shape {tuple(jnp.shape(sinks))}: want [heads] = ({heads},)")
  offset = _check_offset(offset, b, t, s)
  if window is None:
    return offset, np.asarray([max(s, 1)], np.int32)
  if isinstance(window, (int, np.integer)):
    if int(window) < 1:
      raise ValueError(f"window={int(window)} must be at least 1 (the query's own key), or "
                       "None for no window")
    return offset, np.asarray([min(int(window), max(s, 1))], np.int32)
  if jnp.shape(window) != () or not jnp.issubdtype(jnp.result_type(window), jnp.integer):
    raise ValueError(f"window of shape {jnp.shape(window)} and dtype "
                     f"{jnp.result_type(window)}: want None, an int or a scalar integer "
                     "array")
  return offset, jnp.reshape(jnp.asarray(window, jnp.int32), (1,))


def _check_offset(offset, b: int, t: int, s: int) -> jax.Array:
  """``offset`` as a ``[b]`` int32 array (zeros for None); a concrete one must leave the
  ``t`` queries inside the ``s`` keys."""
  if offset is None:
    return np.zeros((b,), np.int32)
  if isinstance(offset, (int, np.integer)):
    offset = np.full((b,), int(offset), np.int64)
  if not jnp.issubdtype(jnp.result_type(offset), jnp.integer) or jnp.ndim(offset) > 1 or (
      jnp.ndim(offset) == 1 and jnp.shape(offset)[0] != b):
    raise ValueError(f"offset of shape {jnp.shape(offset)} and dtype "
                     f"{jnp.result_type(offset)}: want an int or [batch] = ({b},) integers, "
                     "each sequence's first query position")
  if not isinstance(offset, jax.core.Tracer):
    concrete = np.broadcast_to(np.asarray(offset), (b,))
    bad = (concrete < 0) | (concrete + t > s)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(f"offset[{i}]={int(concrete[i])}: the {t} queries at positions "
                       f"{int(concrete[i])} .. {int(concrete[i]) + t - 1} must lie inside "
                       f"the {s} keys (0 <= offset <= {s - t})")
  return jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (b,))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, offset: Any = None,
                     window: Any = None, sinks: jax.Array | None = None,
                     scale: float | None = None, implementation: str | None = None
                     ) -> jax.Array:
  """Grouped-query causal attention of a sequence's queries over its keys: a prompt's
  prefill from position 0 (its own keys), or from ``offset`` over a cache that already
  holds the earlier positions' keys (a conversation's next turn, a long prompt in chunks).

  ``out[b, i, h] = sum_j p[b, h, i, j] v[b, j, h // g]`` with ``p = softmax_j(scale *
  q[b, i, h] . k[b, j, h // g])`` over ``j <= P`` and, with a ``window``, ``P - j <
  window``, where ``P = offset[b] + i`` is query ``i``'s position (``g = heads //
  kv_heads``); with ``sinks``, head ``h``'s softmax also holds the logit ``sinks[h]``,
  which weighs no value (GPT-OSS). Scores and the softmax in float32, the probabilities
  rounded to q's dtype before they weigh the values.

  Args:
    q: ``[batch, seq, heads, head_dim]`` in bfloat16, float16 or float32.
    k, v: ``[batch, keys, kv_heads, head_dim]`` (heads a multiple of kv_heads), the keys
      and values of positions ``0 .. keys - 1`` (the queries' own included); ``keys ==
      seq`` unless ``offset`` is given.
    offset: None (the queries sit at ``0 .. seq - 1``), an int or ``[batch]`` integers:
      each sequence's first query position, with ``offset + seq <= keys`` (checked when
      concrete; keys past a query's position are not read).
    window: None (every earlier key), an int >= 1, or a scalar integer array (e.g. a
      layer's window chosen inside a scan over layers; a traced value is not checked,
      and one below 1 leaves rows with no key: zeros on the XLA path).
    sinks: optional ``[heads]`` float, each head's sink logit.
    scale: the factor on the scores; None: ``1 / sqrt(head_dim)``.
    implementation: None (a registered kernel where it supports the device and q is
      16-bit, else XLA), "xla", "pallas" or "interpret" (as :func:`qjax.matmul`).

  Returns:
    ``[batch, seq, heads, head_dim]`` in q's dtype.

  Through a kernel, reverse mode (``jax.grad``) takes the XLA path's derivative (which
  materializes the scores in the backward pass); forward mode is the XLA path's alone.

  >>> import jax.numpy as jnp, qjax
  >>> q = jnp.ones((1, 5, 8, 64), jnp.bfloat16)
  >>> k = v = jnp.ones((1, 5, 2, 64), jnp.bfloat16)
  >>> qjax.causal_attention(q, k, v, window=2, implementation="xla").shape
  (1, 5, 8, 64)
  """
  offset, window = _check(q, k, v, offset, window, sinks)
  if sinks is not None:
    sinks = jnp.asarray(sinks, jnp.float32)
  scale = float(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
  _, fn = resolve(q.dtype, implementation)
  return fn(q, k, v, offset, window, sinks, scale=scale)


def resolve(dtype, implementation: str | None):
  """The implementation :func:`causal_attention` runs for queries of ``dtype``: its name
  and a function of the normalized arguments."""
  return attention.resolve_in("causal", dtype, implementation, causal_attention_xla)


def causal_attention_implementation_name(dtype=jnp.bfloat16,
                                         implementation: str | None = None) -> str:
  """The name of the implementation :func:`causal_attention` would run here for queries of
  ``dtype`` ("xla", "pallas_triton", "pallas_triton-interpret", ...).

  >>> import jax.numpy as jnp, qjax
  >>> qjax.causal_attention_implementation_name(jnp.float32)  # float32: XLA by default
  'xla'
  """
  return resolve(dtype, implementation)[0]


def causal_mask(t: int, s: int, offset: jax.Array, window: jax.Array) -> jax.Array:
  """``[b, t, s]`` bool: query ``i`` of sequence ``b`` (position ``p = offset[b] + i``)
  sees key ``j`` where ``j <= p`` and ``p - j < window[0]``."""
  p = offset[:, None, None] + jnp.arange(t)[None, :, None]
  j = jnp.arange(s)[None, None, :]
  return (j <= p) & (p - j < window[0])


def causal_attention_xla(q, k, v, offset, window, sinks, *, scale: float) -> jax.Array:
  """The XLA path of :func:`causal_attention` on its normalized arguments: q ``[b, t,
  heads, d]``, k / v ``[b, s, kv_heads, d]``, offset a ``[b]`` int32 array (each
  sequence's first query position; traced allowed), window a ``[1]`` int32 array (``s``:
  no window; traced allowed), sinks None or ``[heads]`` float32 -> ``[b, t, heads, d]`` in
  q's dtype. Materializes the ``[b, heads, t, s]`` scores (:func:`attention.attend`).
  Rows with no key (a window below 1) get zeros."""
  t, s = q.shape[1], k.shape[1]
  mask = causal_mask(t, s, offset, window)
  out = attention.attend(q, k, v, mask, sinks, scale)
  return jnp.where(window[0] >= 1, out, jnp.zeros_like(out))
