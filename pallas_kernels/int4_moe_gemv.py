"""INT4 mixture-of-experts matmul for decode (a few pairs): one GEMV per (row, expert) pair.

Contract: the canonical MoE form of :mod:`qjax._src.moe` (its ``moe_matmul_xla`` is the
reference): pair ``p`` multiplies row ``pair_rows[p]`` of ``rows [R, K]`` by expert
``pair_experts[p]``'s :class:`qjax.Int4Weight`; float32 accumulation; ``[P, N]`` in rows'
dtype.

How: as the MXFP4 MoE GEMV (:mod:`pallas_kernels.fp4_moe_gemv`), whose grid, loop shape
and pair handling it shares (:mod:`pallas_kernels.moe_common`): a grid of ``(column
block, pair, K split)`` programs; each loads its pair's row index and expert id as
scalars, then runs the M = 1 INT4 kernel's K loop (:func:`pallas_kernels.int4_gemv.accumulate`:
each word's nibbles built as floats by one LOP3 and accumulated by one FMA each in inline
PTX, loads prefetched in registers) over that expert's codes and group parameters only.
Split-K partial sums go to a ``[split_k, P, N]`` float32 buffer summed in XLA; the splits
need not divide the K-tiles (the last split's steps past the end are masked: no bytes
read). Unselected experts' bytes are never read.

Out-of-range ids never cause an out-of-bounds read: they are clamped for addressing and
the pair's whole output row is NaN, as in every built-in MoE implementation.

Not measured on a GPU yet: the configuration is the MXFP4 MoE GEMV's heuristic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qjax import Int4Weight
from qjax import KernelConfig
from qjax._src import packing
from pallas_kernels import int4_gemv
from pallas_kernels import moe_common

_f32 = jnp.float32
_TILE_K = packing.NATIVE_TILE_K
_SLAB = _TILE_K // 8  # rows per nibble plane of a K-tile

# The name qjax.moe_matmul selects it by: implementation="pallas:" + BACKEND_NAME (the
# MXFP4 GEMV's name: one name per role, whatever the format).
BACKEND_NAME = "pallas_triton_gemv"
MAX_PAIRS = moe_common.GEMV_MAX_PAIRS


def supports(num_pairs: int, k: int, group_size: int, num_experts: int | None = None
             ) -> bool:
  """Whether this kernel is meant for the call: 1 to :data:`MAX_PAIRS` pairs (and, given
  ``num_experts``, few enough per expert: :func:`moe_common.gemv_meant_for`) and groups
  the INT4 GEMV loop takes (whole 16-row slabs that divide or are a multiple of the
  128-row K-tile, or one group per column: :func:`int4_gemv.supports`)."""
  meant = (1 <= num_pairs <= MAX_PAIRS if num_experts is None
           else moe_common.gemv_meant_for(num_pairs, num_experts))
  return meant and int4_gemv.supports(1, k, group_size)


def declines(w: Int4Weight, dtype=None) -> str | None:
  """Why the kernel cannot run the expert stack ``w``, or None (``qjax.Backend.declines``)."""
  del dtype  # every activation dtype runs
  k = w.shape[0]
  if not int4_gemv.supports(1, k, w.group_size):
    return (f"group_size={w.group_size} (K={k}): the INT4 MoE GEMV kernel takes groups of a "
            "multiple of 16 rows that divide or are a multiple of 128, or one group per "
            "column; use implementation='pallas:pallas_triton' (the grouped kernel)")
  return None


def _moe_gemv_kernel(pair_rows_ref, pair_experts_ref, x_ref, w_ref, s_ref, z_ref, b_ref,
                     o_ref, *, plan: int4_gemv.Plan, tiles: int, split_k: int):
  """Output columns ``[n0, n0 + block_n)`` of pair ``program_id(1)`` over one K split.

  Refs (whole arrays):
    pair_rows_ref, pair_experts_ref: ``[P]`` int32; pair_rows_ref None where every pair
      multiplies row 0 (:func:`moe_common.gemv_launch`).
    x_ref: ``[R, K]`` bf16 / f16 / f32 rows.
    w_ref: ``[E, Kp // 8, N]`` uint32 codes in tile order 128.
    s_ref, z_ref, b_ref: ``[E, K // G, N]`` scales, uint8 zero points or None, float
      biases or None.
    o_ref: ``[P, N]`` in x's dtype (split_k == 1) or ``[split_k, P, N]`` float32.
  """
  tile = moe_common.PairTile(pair_rows_ref, pair_experts_ref, x_ref, w_ref, k=plan.k,
                             block_n=plan.block_n, tiles=tiles,
                             k_tail=moe_common.has_k_tail(plan.tiles_per_step, split_k,
                                                          plan.steps, tiles))

  def load_group(g):
    """``(scales, zeros, biases)`` ``[1, bn]`` f32 rows of group ``g`` (0 past the last
    group), None for an absent field."""
    return tuple(None if r is None else tile.load_row(r, g).astype(_f32)
                 for r in (s_ref, z_ref, b_ref))

  acc = int4_gemv.accumulate(plan, tile.pid_k, tile.load_words, tile.load_x,
                             load_group)
  tile.store(o_ref, jnp.sum(acc, axis=0, keepdims=True), split_k=split_k)  # [1, bn]


def int4_moe_gemv(rows: jax.Array, w: Int4Weight, pair_rows: jax.Array,
                  pair_experts: jax.Array, *, config: KernelConfig | None = None,
                  interpret: bool = False, poison: bool = False) -> jax.Array:
  """``y[p] = rows[pair_rows[p]] @ W[pair_experts[p]]`` -> ``[P, N]`` in rows' dtype.

  Args:
    rows: ``[R, K]`` bfloat16, float16 or float32 activations.
    w: INT4 experts: codes ``[E, Kp // 8, N]`` uint32, scales (and zeros or biases)
      ``[E, K // G, N]``; codes in another tile order than 128 are repacked first (per
      call).
    pair_rows, pair_experts: ``[P]`` integers (cast to int32), in ``[0, R)`` and
      ``[0, E)``; a pair with an id outside its range gets a NaN output row (module doc).
      Concrete all-zero ``pair_rows`` (one token's, from ``qjax.moe_matmul``) are not
      passed to the kernel, which then reads row 0 for every pair.
    config: ``block_n`` columns per program, ``block_k`` (a multiple of 128) K rows per
      loop step, ``split_k`` (at most; need not divide the K-tiles), ``num_warps``, and
      ``num_stages``: loop steps the loads run ahead. None:
      :func:`moe_common.gemv_heuristic_config`.
    interpret: run in Pallas interpret mode (CPU).
    poison: for tests: the output starts as NaN, so an unwritten element shows.

  Raises:
    NotImplementedError: ``w`` is not an Int4Weight with one expert axis, or its groups
      are not ones the INT4 GEMV loop takes (:func:`supports`).
    ValueError: bad shapes or dtype of ``rows`` / the pair arrays.
  """
  moe_common.check_gemv_args("INT4 MoE GEMV kernel", rows, w, pair_rows, pair_experts,
                             Int4Weight)
  reason = declines(w)
  if reason:
    raise NotImplementedError(reason)
  k, n = w.shape
  if w.tile_k != _TILE_K:
    w = w.repack(_TILE_K)
  p = pair_rows.shape[0]
  config = config or moe_common.gemv_heuristic_config(p, k, n)
  tiles = w.codes.shape[1] // _SLAB
  tps, split, steps = moe_common.gemv_loop_shape(config, tiles)
  plan = int4_gemv.Plan(k=k, group_size=w.group_size, block_n=config.block_n,
                        tiles_per_step=tps, steps=steps,
                        depth=min(max(1, config.num_stages), steps), interpret=interpret)
  # Triton's own pipeliner does nothing for these loads; the prefetch depth is ours.
  launch_config = KernelConfig(block_m=1, block_n=config.block_n, block_k=_TILE_K * tps,
                               split_k=split, num_warps=config.num_warps, num_stages=1)
  return moe_common.gemv_launch(
      functools.partial(_moe_gemv_kernel, plan=plan, tiles=tiles, split_k=split), rows,
      pair_rows, pair_experts, [w.codes, w.scales, w.zeros, w.biases], n=n,
      config=launch_config, interpret=interpret, poison=poison, name="qjax_int4_moe_gemv")
