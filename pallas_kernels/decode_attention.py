"""Decode attention (one query per sequence over a KV cache) in Pallas, lowered to Triton.

Contract: :func:`qjax.decode_attention` (``qjax._src.attention``). A program owns one
(sequence, KV head) pair and one run of ``steps * block_s`` cache slots (a split). Per
loop step it loads the step's mask slice and, where the mask holds, the ``[block_s,
head_dim]`` keys and values straight out of the layer's place in the whole cache
``[layers, batch, slots, kv_heads, head_dim]`` (masked slots are not read: a cache filled
to half its length costs half the bytes), and keeps a running softmax (flash attention's
rescaled maximum, sum and weighted values) for the pair's ``g = heads // kv_heads``
query heads at once: the scores are ``q [G, D] @ k^T`` and the values ``p [G, S] @ v`` on
the tensor cores, with ``G`` the query heads padded to 16 rows (the dot's least).

One split per pair: the program divides by the sum (and adds the sink logit) itself and
writes the output. Several (long caches, where the pairs alone would leave most of the
GPU idle): each split writes its float32 maximum, sum and weighted values and XLA combines
them (flash-decoding).

:func:`write_and_decode_attention` (:func:`qjax.write_and_decode_attention`) is the same
kernel with a decode step's new token: split 0 of each pair writes the token's key and
value into the cache (aliased in place) and starts its softmax with them, and no program
reads that slot from the cache, so the write and the attention take one launch.
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
from qjax._src import attention

_f32 = jnp.float32
# Programs a launch aims for where the cache is long enough: two per SM of an H100.
TARGET_PROGRAMS = 264
# Shared memory the pipelined key and value blocks may take (the A100's 164 KiB and the
# H100's 227 KiB also hold the dots' operands).
STAGE_BYTES = 128 * 1024


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static launch parameters.

  Attributes:
    block_s: cache slots per loop step (a power of two, at least 16); None:
      :func:`default_block_s`.
    splits: programs per (sequence, KV head) along the slots; None: enough for about
      ``target_programs`` programs in all, at most one per step of slots.
    target_programs: see ``splits``.
    num_warps: Triton warps per program.
    num_stages: Triton's software pipelining depth of the key / value loads.
  """
  block_s: int | None = None
  splits: int | None = None
  target_programs: int = TARGET_PROGRAMS
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    if self.block_s is not None and (self.block_s < 16 or self.block_s & (self.block_s - 1)):
      raise ValueError(f"block_s={self.block_s} must be a power of two >= 16")
    if self.splits is not None and self.splits < 1:
      raise ValueError(f"splits={self.splits} must be None or >= 1")


def _pow2(n: int) -> int:
  """The least power of two >= ``n``, at least 16 (the dot's least dimension)."""
  return max(16, common.next_pow2(n))


def default_block_s(slots: int, row_bytes: int) -> int:
  """Slots per loop step: 128 where a cache row (one head's keys) is 128 bytes at most and
  the cache has 1024 slots or more, else 64. H100, 32 / 8 heads of 64 in bfloat16, half
  the slots attended (docs/experiments/s37_decode_attention.py), us at batch 1 / 8 with
  64 against 128: 256 slots 3.4 / 4.4 against 3.9 / 4.8; 1024 5.7 / 8.1 against 5.5 /
  7.4; 4096 8.4 / 20.6 against 8.3 / 17.1."""
  return 128 if slots >= 1024 and row_bytes <= 128 else 64


def fitted(block_s: int, num_stages: int, row_bytes: int) -> tuple[int, int]:
  """``(block_s, num_stages)`` cut until the stages' key and value blocks (``2 * block_s
  * row_bytes`` bytes a stage) fit :data:`STAGE_BYTES`: fewer stages first, then fewer
  slots per step (16 at least). On the H100, before this fit, the GPU tests of 128-wide
  heads over 2000 slots failed at 128-slot steps and 3 stages (the traceback was not kept;
  in float32 those stages take 384 KiB); with it they pass."""
  while num_stages > 1 and 2 * block_s * row_bytes * num_stages > STAGE_BYTES:
    num_stages -= 1
  while block_s > 16 and 2 * block_s * row_bytes > STAGE_BYTES:
    block_s //= 2
  return block_s, num_stages


def loop_shape(batch: int, kv_heads: int, slots: int, config: AttentionConfig,
               row_bytes: int = 128) -> tuple[int, int, int]:
  """``(block_s, splits, steps)``: slots per loop step, programs per (sequence, KV head)
  and loop steps per program; no split is left without a slot. ``row_bytes``: one
  head's ``head_dim`` (padded to a power of two) in the compute dtype."""
  block_s = config.block_s or default_block_s(slots, row_bytes)
  block_s, _ = fitted(block_s, config.num_stages, row_bytes)
  chunks = -(-slots // block_s)
  want = config.splits or max(1, config.target_programs // (batch * kv_heads))
  steps = -(-chunks // max(1, min(chunks, want)))
  return block_s, -(-chunks // steps), steps


def _kernel(q_ref, k_ref, v_ref, mask_ref, layer_ref, sinks_ref, new_ref, pos_ref, *out_refs,
            kv_heads: int, g: int, d: int, slots: int, block_s: int, steps: int,
            scale: float, final: bool, new_row: int, interpret: bool):
  """One (sequence, KV head, split) program.

  Refs: q ``[b, rows, d]`` (query head ``i`` at row ``i``); k, v ``[layers, b, slots,
  kv_heads, d]``; mask ``[b, slots]`` bool; layer ``[1]`` int32 (negative: from the
  end); sinks ``[kv_heads, g]`` float32 or None. Outputs: ``final``: o ``[b, kv_heads, g,
  d]``; else acc ``[b, kv_heads, splits, g, d]``, m and l ``[b, kv_heads, splits, g]``
  float32 (the split's maximum score and sum of exponentials).

  With a new token (``pos_ref`` ``[b]`` int32, its slot): its key and value are rows
  ``new_row + h`` and ``new_row + kv_heads + h`` of ``new_ref[b]`` (``[b, rows', d]``, in
  the caches' dtype; None: of ``q_ref[b]``), and two more outputs, the caches
  (aliased to ``k_ref`` / ``v_ref``), follow. Split 0 writes the token's row where its slot
  and the layer lie in the cache and starts its softmax with it (where the mask holds its
  slot); no program reads that slot from the cache, whose row is being written.
  """
  pair, split = pl.program_id(0), pl.program_id(1)
  bi, h = pair // kv_heads, pair % kv_heads
  gp, dp = _pow2(g), _pow2(d)
  rows = jnp.arange(gp) < g
  cols = jnp.arange(dp) < d
  layers = k_ref.shape[0]
  layer = layer_ref[0]
  layer = jnp.where(layer < 0, layer + layers, layer)
  layer_in = (layer >= 0) & (layer < layers)
  # A traced layer outside the cache reads the nearest end's layer, as the XLA path does
  # (a read outside the cache's buffer otherwise).
  layer = jnp.clip(layer, 0, layers - 1)
  q = common.load(q_ref.at[bi, pl.ds(h * g, gp), pl.ds(0, dp)],
                  rows[:, None] & cols[None, :])
  precision = common.dot_precision(q.dtype, interpret)
  m0 = jnp.full((gp,), attention.MASKED_SCORE, _f32)
  l0 = jnp.zeros((gp,), _f32)
  acc0 = jnp.zeros((gp, dp), _f32)
  skip = -1  # a slot no program reads (the new token's)
  if pos_ref is not None:
    k_out, v_out = out_refs[-2:]
    out_refs = out_refs[:-2]
    p = pos_ref[bi]
    lands = (p >= 0) & (p < slots) & layer_in
    slot_p = jnp.clip(p, 0, slots - 1)
    first = split == 0
    source = q_ref if new_ref is None else new_ref
    new_k = common.load(source.at[bi, new_row + h, pl.ds(0, dp)], cols)
    new_v = common.load(source.at[bi, new_row + kv_heads + h, pl.ds(0, dp)], cols)
    plgpu.store(k_out.at[layer, bi, slot_p, h, pl.ds(0, dp)], new_k, mask=cols & lands & first)
    plgpu.store(v_out.at[layer, bi, slot_p, h, pl.ds(0, dp)], new_v, mask=cols & lands & first)
    seen = lands & first & mask_ref[bi, slot_p]
    score = jnp.sum(q.astype(_f32) * new_k.astype(q.dtype).astype(_f32)[None, :], axis=1)
    m0 = jnp.where(seen, score * scale, m0)
    l0 = jnp.where(seen, 1.0, l0)
    acc0 = jnp.where(seen, jnp.broadcast_to(new_v.astype(q.dtype).astype(_f32)[None, :],
                                            (gp, dp)), acc0)
    skip = jnp.where(lands, p, -1)

  def step(i, carry):
    m, l, acc = carry
    s0 = (split * steps + i) * block_s
    slot = s0 + jnp.arange(block_s)
    valid = common.load(mask_ref.at[bi, pl.ds(s0, block_s)], slot < slots, other=False)
    valid = valid & (slot != skip)
    kv_mask = valid[:, None] & cols[None, :]
    k = common.load(k_ref.at[layer, bi, pl.ds(s0, block_s), h, pl.ds(0, dp)], kv_mask)
    scores = plgpu.dot(q, k.astype(q.dtype), trans_b=True, precision=precision) * scale
    scores = jnp.where(valid[None, :], scores, attention.MASKED_SCORE)  # [gp, block_s]
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[:, None])
    v = common.load(v_ref.at[layer, bi, pl.ds(s0, block_s), h, pl.ds(0, dp)], kv_mask)
    pv = plgpu.dot(p.astype(q.dtype), v.astype(q.dtype), precision=precision)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

  m, l, acc = lax.fori_loop(0, steps, step, (m0, l0, acc0))
  if final:
    [o_ref] = out_refs
    if sinks_ref is not None:
      sink = common.load(sinks_ref.at[h, pl.ds(0, gp)], rows, other=attention.MASKED_SCORE)
      top = jnp.maximum(m, sink)
      keep = jnp.exp(m - top)
      l = l * keep + jnp.exp(sink - top)
      acc = acc * keep[:, None]
    out = acc / l[:, None]
    plgpu.store(o_ref.at[bi, h, pl.ds(0, gp), pl.ds(0, dp)], out.astype(o_ref.dtype),
                mask=rows[:, None] & cols[None, :])
    return
  acc_ref, m_ref, l_ref = out_refs
  plgpu.store(acc_ref.at[bi, h, split, pl.ds(0, gp), pl.ds(0, dp)], acc,
              mask=rows[:, None] & cols[None, :])
  plgpu.store(m_ref.at[bi, h, split, pl.ds(0, gp)], m, mask=rows)
  plgpu.store(l_ref.at[bi, h, split, pl.ds(0, gp)], l, mask=rows)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array,
                   sinks: jax.Array | None) -> jax.Array:
  """The splits' partial softmaxes joined: acc ``[b, kv, splits, g, d]``, m and l ``[b,
  kv, splits, g]`` float32, sinks None or ``[kv, g]`` -> ``[b, kv, g, d]`` float32."""
  top = jnp.max(m, axis=2)
  if sinks is not None:
    top = jnp.maximum(top, sinks[None])
  weight = jnp.exp(m - top[:, :, None])
  total = jnp.sum(l * weight, axis=2)
  if sinks is not None:
    total = total + jnp.exp(sinks[None] - top)
  return jnp.sum(acc * weight[..., None], axis=2) / total[..., None]


def _launch_shape(q, k_cache, config: AttentionConfig | None):
  """``(config, block_s, splits, steps, num_stages)`` of a launch for q ``[b, heads, d]``
  over caches ``[layers, b, slots, kv_heads, d]``; NotImplementedError for a head_dim
  above 256 (the program's registers)."""
  config = config or AttentionConfig()
  b, _, d = q.shape
  _, _, slots, kv_heads, _ = k_cache.shape
  if d > 256:
    raise NotImplementedError(f"head_dim={d}: the decode-attention kernel takes up to 256")
  # The stages hold the cache's rows as loaded (then converted to q's dtype).
  row_bytes = _pow2(d) * max(jnp.dtype(q.dtype).itemsize, jnp.dtype(k_cache.dtype).itemsize)
  block_s, splits, steps = loop_shape(b, kv_heads, slots, config, row_bytes)
  _, num_stages = fitted(block_s, config.num_stages, row_bytes)
  return config, block_s, splits, steps, num_stages


def _attend(q, k_cache, v_cache, mask, layer, sinks, new, *, heads: int, scale: float,
            interpret: bool, config: AttentionConfig | None, poison: bool, name: str):
  """The kernel's launch and, with several splits, XLA's combine: the arguments of
  :func:`decode_attention` (q ``[b, rows, d]``, its first ``heads`` rows the queries) and
  ``new`` None or ``(source, new_row, positions)`` (see :func:`_kernel`: the new tokens'
  keys and values ``[b, rows', d]``, None where q's operand holds them; the row where their
  keys start; their ``[b]`` int32 slots). Returns ``[b, heads, d]`` in q's dtype, or with
  ``new`` ``(out, k_cache, v_cache)``."""
  config, block_s, splits, steps, num_stages = _launch_shape(q, k_cache, config)
  b, _, d = q.shape
  _, _, slots, kv_heads, _ = k_cache.shape
  g = heads // kv_heads
  final = splits == 1
  sinks_g = None if sinks is None else sinks.reshape(kv_heads, g)
  if final:
    out_shape = [jax.ShapeDtypeStruct((b, kv_heads, g, d), q.dtype)]
  else:
    out_shape = [jax.ShapeDtypeStruct((b, kv_heads, splits, g, d), _f32),
                 jax.ShapeDtypeStruct((b, kv_heads, splits, g), _f32),
                 jax.ShapeDtypeStruct((b, kv_heads, splits, g), _f32)]
  source, new_row, positions = (None, 0, None) if new is None else new
  kernel = functools.partial(_kernel, kv_heads=kv_heads, g=g, d=d, slots=slots,
                             block_s=block_s, steps=steps, scale=scale, final=final,
                             new_row=new_row, interpret=interpret)
  args = [q, k_cache, v_cache, mask, layer, sinks_g, source, positions]
  aliases = {}
  attended = len(out_shape)
  if new is not None:  # the caches, written in place
    leaves = [a is not None for a in args]
    aliases = {sum(leaves[:1]): attended, sum(leaves[:2]): attended + 1}
    out_shape = [*out_shape, jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
  if poison:  # the attention's outputs start as NaN (the caches keep their values)
    kernel, args, poisoned = common.poisoned_outputs(kernel, args, out_shape[:attended])
    aliases.update(poisoned)

  call = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(b * kv_heads, splits),
      input_output_aliases=aliases, interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=num_stages),
      name=name)
  outs = jax.jit(call)(*args)  # a jit boundary: dead-code elimination drops unused calls
  if final:
    out = outs[0]
  else:
    out = combine_splits(*outs[:3], sinks_g).astype(q.dtype)
  out = out.reshape(b, heads, d)
  return out if new is None else (out, *outs[-2:])


def decode_attention(q, k_cache, v_cache, mask, layer, sinks, *, scale: float,
                     interpret: bool = False, config: AttentionConfig | None = None,
                     poison: bool = False) -> jax.Array:
  """:func:`qjax.decode_attention` on its normalized arguments (see
  ``qjax._src.attention.AttentionBackend``): q ``[b, heads, d]``, caches ``[layers, b,
  slots, kv_heads, d]``, mask ``[b, slots]`` bool, layer ``[1]`` int32, sinks None or
  ``[heads]`` float32 -> ``[b, heads, d]`` in q's dtype.

  Args:
    config: block and split sizes, warps, stages; None: :class:`AttentionConfig`'s
      defaults.
    poison: for tests: the outputs start as NaN, so an unwritten element shows.

  Raises:
    NotImplementedError: a head_dim above 256 (the program's registers).
  """
  return _attend(q, k_cache, v_cache, mask, layer, sinks, None, heads=q.shape[1], scale=scale,
                 interpret=interpret, config=config, poison=poison,
                 name="qjax_decode_attention")


def write_and_decode_attention(q, k, v, k_cache, v_cache, positions, mask, layer, sinks, *,
                               scale: float, interpret: bool = False,
                               config: AttentionConfig | None = None, poison: bool = False):
  """:func:`qjax.write_and_decode_attention` on its normalized arguments
  (``qjax._src.decode_write.write_and_decode_attention_xla``): q ``[b, heads, d]``, k / v
  ``[b, kv_heads, d]`` in the caches' dtype, caches ``[layers, b, slots, kv_heads, d]``,
  positions ``[b]`` int32, mask ``[b, slots]`` bool, layer ``[1]`` int32, sinks None or
  ``[heads]`` float32 -> ``(out [b, heads, d] in q's dtype, k_cache, v_cache)``.

  One launch writes the new keys and values and attends (split 0 of each sequence and KV
  head writes its row and starts its softmax with it; no program reads that slot from the
  cache). Where the caches share q's dtype, q, k and v travel as one ``[b, heads + 2 *
  kv_heads, d]`` operand, so XLA computes all three (RoPE included) in one fusion.

  Args:
    config, poison: as :func:`decode_attention` (the caches are not poisoned).

  Raises:
    NotImplementedError: a head_dim above 256.
  """
  heads = q.shape[1]
  if k_cache.dtype == q.dtype:  # the new rows after the queries
    q, new = jnp.concatenate([q, k, v], axis=1), (None, heads, positions)
  else:
    new = (jnp.concatenate([k, v], axis=1), 0, positions)
  return _attend(q, k_cache, v_cache, mask, layer, sinks, new, heads=heads, scale=scale,
                 interpret=interpret, config=config, poison=poison,
                 name="qjax_decode_attention_write")
