"""Causal attention of a prompt (prefill) in Pallas, lowered to Triton: flash attention.

Contract: :func:`qjax.causal_attention` (``qjax._src.causal_attention``): queries at
positions ``offset[b] + i`` over keys at positions ``0 .. s - 1`` (the prompt's own keys,
``offset`` 0, or a cache that already holds the earlier ones). A program owns one
(sequence, query head) pair and ``block_q`` consecutive queries. It walks the key blocks
its queries can see, from the window's first (or 0) to the block of its last query (the
causal mask hides the later ones, which are not read), and keeps flash attention's
running softmax: per block the scores ``q [block_q, D] @ k^T`` and the weighted values
``p @ v`` on the tensor cores, the maximum, the sum of exponentials and the weighted
values rescaled as the maximum grows. The ``[t, t]`` scores never leave the registers.

The query blocks are numbered last first (``program_id(1)`` counts down): under the causal
mask the last ones hold the most work, and started first they leave the short ones to
fill the GPU's tail. The query heads of one KV head are neighbours along grid axis 0, so
their programs can share key / value blocks through the L2 cache (neither ordering's
effect was measured on its own).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels import decode_attention
from qjax._src import attention

_f32 = jnp.float32
LOG2E = 1.4426950408889634  # log2(e)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
  """Static launch parameters.

  Attributes:
    block_q: queries per program (a power of two, at least 16; cut to the sequence).
    block_k: keys per loop step (a power of two, at least 16).
    num_warps: Triton warps per program.
    num_stages: Triton's software pipelining depth of the key / value loads (cut until
      the stages fit ``decode_attention.STAGE_BYTES`` of shared memory).
  """
  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two >= 16")


def _kernel(q_ref, k_ref, v_ref, offset_ref, window_ref, sinks_ref, o_ref, *, heads: int,
            g: int, d: int, t: int, s: int, block_q: int, block_k: int, scale: float,
            interpret: bool):
  """One (sequence, query head, query block) program.

  Refs: q and o ``[b, t, heads, d]``; k, v ``[b, s, kv_heads, d]``; offset ``[b]`` int32
  (query ``i`` of sequence ``b`` sits at position ``p = offset[b] + i``); window ``[1]``
  int32 (query ``p`` sees keys ``p - window < j <= p``, ``j < s``); sinks ``[heads]``
  float32 or None.
  """
  pair = pl.program_id(0)
  qb = pl.num_programs(1) - 1 - pl.program_id(1)  # the longest rows first
  bi, hq = pair // heads, pair % heads
  hk = hq // g
  dp = max(16, common.next_pow2(d))
  cols = jnp.arange(dp) < d
  q0 = qb * block_q
  rows = q0 + jnp.arange(block_q) < t
  p0 = offset_ref[bi] + q0  # the block's first query position
  qpos = p0 + jnp.arange(block_q)
  q = common.load(q_ref.at[bi, pl.ds(q0, block_q), hq, pl.ds(0, dp)],
                  rows[:, None] & cols[None, :])
  precision = common.dot_precision(q.dtype, interpret)
  window = window_ref[0]
  # Scores in base 2: exp2 of scale * log2(e) * q.k is exp of scale * q.k.
  scale2 = scale * LOG2E
  # Key blocks [lo, hi): from the block of the first query's earliest key to the block of
  # the last query (later keys are hidden from every query here). Those in [full_lo,
  # full_hi) are seen whole by every query of the block and skip the mask.
  lo = jnp.maximum(p0 - window + 1, 0) // block_k
  hi = (jnp.minimum(p0 + jnp.minimum(block_q, t - q0), s) + block_k - 1) // block_k
  full_lo = jnp.clip(-((window - p0 - block_q) // block_k), lo, hi)
  full_hi = jnp.clip(jnp.minimum(p0 + 1, s) // block_k, full_lo, hi)

  def step(i, carry, *, masked: bool):
    m, l, acc = carry
    k0 = i * block_k
    kpos = k0 + jnp.arange(block_k)
    kv_mask = (kpos < s)[:, None] & cols[None, :]
    k = common.load(k_ref.at[bi, pl.ds(k0, block_k), hk, pl.ds(0, dp)], kv_mask)
    scores = plgpu.dot(q, k.astype(q.dtype), trans_b=True, precision=precision) * scale2
    if masked:
      seen = ((kpos[None, :] <= qpos[:, None]) & (qpos[:, None] - kpos[None, :] < window)
              & (kpos < s)[None, :])
      scores = jnp.where(seen, scores, attention.MASKED_SCORE)  # [block_q, block_k]
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(scores - m_new[:, None])
    v = common.load(v_ref.at[bi, pl.ds(k0, block_k), hk, pl.ds(0, dp)], kv_mask)
    pv = plgpu.dot(p.astype(q.dtype), v.astype(q.dtype), precision=precision)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

  if sinks_ref is None:
    m0, l0 = jnp.full((block_q,), attention.MASKED_SCORE, _f32), jnp.zeros((block_q,), _f32)
  else:  # the sink logit starts the running softmax: exp(sink - m) = 1 in the sum
    m0 = jnp.full((block_q,), sinks_ref[hq] * LOG2E, _f32)
    l0 = jnp.ones((block_q,), _f32)
  carry = (m0, l0, jnp.zeros((block_q, dp), _f32))
  carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  _, l, acc = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
  # A window below 1 leaves every row without a key: zeros, as the XLA path gives.
  out = jnp.where(window >= 1, acc / l[:, None], 0.0)
  plgpu.store(o_ref.at[bi, pl.ds(q0, block_q), hq, pl.ds(0, dp)], out.astype(o_ref.dtype),
              mask=rows[:, None] & cols[None, :])


def launch_shape(t: int, d: int, itemsize: int, config: PrefillConfig, s: int | None = None
                 ) -> tuple[int, int, int]:
  """``(block_q, block_k, num_stages)``: the blocks cut to the ``t`` queries and ``s``
  keys (default ``t``; 16 at least) and the stages to the shared memory
  (``decode_attention.fitted``)."""
  block_q = min(config.block_q, max(16, common.next_pow2(t)))
  block_k = min(config.block_k, max(16, common.next_pow2(t if s is None else s)))
  row_bytes = max(16, common.next_pow2(d)) * itemsize
  block_k, num_stages = decode_attention.fitted(block_k, config.num_stages, row_bytes)
  return block_q, block_k, num_stages


def causal_attention(q, k, v, offset, window, sinks, *, scale: float, interpret: bool = False,
                     config: PrefillConfig | None = None, poison: bool = False
                     ) -> jax.Array:
  """:func:`qjax.causal_attention` on its normalized arguments (see
  ``qjax._src.causal_attention.causal_attention_xla``): q ``[b, t, heads, d]``, k / v ``[b,
  s, kv_heads, d]``, offset ``[b]`` int32, window ``[1]`` int32, sinks None or ``[heads]``
  float32 -> ``[b, t, heads, d]`` in q's dtype.

  Args:
    config: block sizes, warps, stages; None: :class:`PrefillConfig`'s defaults.
    poison: for tests: the output starts as NaN, so an unwritten element shows.

  Raises:
    NotImplementedError: a head_dim above 256 (the program's registers).
  """
  config = config or PrefillConfig()
  b, t, heads, d = q.shape
  g = heads // k.shape[2]
  if d > 256:
    raise NotImplementedError(f"head_dim={d}: the prefill-attention kernel takes up to 256")
  itemsize = max(jnp.dtype(q.dtype).itemsize, jnp.dtype(k.dtype).itemsize)
  s = k.shape[1]
  block_q, block_k, num_stages = launch_shape(t, d, itemsize, config, s)
  out_shape = [jax.ShapeDtypeStruct((b, t, heads, d), q.dtype)]
  kernel = functools.partial(_kernel, heads=heads, g=g, d=d, t=t, s=s, block_q=block_q,
                             block_k=block_k, scale=scale, interpret=interpret)
  args = [q, k, v, jnp.asarray(offset, jnp.int32), jnp.asarray(window, jnp.int32), sinks]
  aliases = {}
  if poison:
    kernel, args, aliases = common.poisoned_outputs(kernel, args, out_shape)
  call = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(b * heads, pl.cdiv(t, block_q)),
      input_output_aliases=aliases, interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=num_stages),
      name="qjax_prefill_attention")
  return jax.jit(call)(*args)[0]  # a jit boundary: dead-code elimination drops unused calls
