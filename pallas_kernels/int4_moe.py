"""Fused INT4 mixture-of-experts matmul: one grouped-GEMM launch over all selected experts.

Contract (qjax's ``moe_matmul_xla`` is the reference): pair ``p`` multiplies row
``pair_rows[p]`` of the activations by expert ``pair_experts[p]``'s :class:`qjax.Int4Weight`
(``W[k, n] = (q - z[g, n]) * s[g, n]`` with integer zero points, 8 when symmetric, or
``q * s[g, n] + b[g, n]`` with float biases; ``g = k // G``), float32 accumulation,
output in the activations' dtype.

How: as the MXFP4 MoE kernel (:mod:`pallas_kernels.fp4_moe`), whose grid and routing it
shares (:mod:`pallas_kernels.moe_common`): the pairs sorted by expert, their rows gathered
in that order, and a grid of ``(column block, row tile, K split)`` programs, row tile
``i`` reading its expert and its sorted rows from the tile table. Each program reads only
its expert's codes, scales and zero points or biases, and dequantizes them in registers
exactly as the dense INT4 kernel does (:func:`pallas_kernels.int4_matmul.accumulate_k_step`:
``C + q`` by a magic-number bit trick, two weights per PRMT + LOP3 in inline PTX, the group
parameters applied to the f32 partial products after the dots), so unselected experts'
weights are never read and no dequantized expert is written to memory.

Not measured on a GPU yet: the tiling is the MXFP4 MoE kernel's heuristic with row blocks
of at most 32 (the dense INT4 kernel's measured choice for 16 < M <= 64:
:func:`pallas_kernels.int4_matmul.int4_heuristic_config`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl

from qjax import Int4Weight
from qjax import KernelConfig
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import int4_matmul
from pallas_kernels import moe_common

_SLAB = packing.NATIVE_TILE_K // 8


def _moe_kernel(tile_expert_ref, tile_start_ref, tile_end_ref, x_ref, w_ref, s_ref, z_ref,
                b_ref, o_ref, *, k, group_size, tile_k, block_m, block_n, block_k,
                steps_per_split, split_k, paired, by_dot, precision):
  """One ``[block_m, block_n]`` tile of one expert's rows over ``steps_per_split`` K steps.

  Refs (whole arrays):
    tile_expert_ref, tile_start_ref, tile_end_ref: ``[num_tiles]`` int32 tile table.
    x_ref: ``[R + block_m, K]`` activation rows in expert order (``block_m`` padding rows).
    w_ref: ``[E, Kp // 8, N]`` uint32 codes in tile order ``tile_k``.
    s_ref: ``[E, K // G, N]`` scales.
    z_ref: ``[E, K // G, N]`` uint8 zero points, or None.
    b_ref: ``[E, K // G, N]`` float biases, or None (both None: symmetric, z = 8).
    o_ref: ``[R + block_m, N]`` in x's dtype (split_k == 1) or ``[split_k, R + block_m, N]``
      float32.
  """
  tile = moe_common.GroupedTile(tile_expert_ref, tile_start_ref, tile_end_ref,
                                n=w_ref.shape[2], k=k, tile_k=tile_k, block_m=block_m,
                                block_n=block_n)
  expert, n0 = tile.expert, tile.n0
  num_groups = s_ref.shape[1]
  slab = tile_k // 8

  def load_group(g):
    return [common.load(r.at[expert, pl.ds(g, 1), pl.ds(n0, block_n)],
                        tile.group_mask(g, num_groups))
            for r in (s_ref, z_ref, b_ref) if r is not None]

  def load_words(k_tile):
    return common.load(w_ref.at[expert, pl.ds(k_tile // 8, slab), pl.ds(n0, block_n)],
                       mask=tile.n_mask[None, :] if tile.n_ragged else None)

  def step(i, acc):
    return int4_matmul.accumulate_k_step(
        acc, (tile.pid_k * steps_per_split + i) * block_k, load_words,
        lambda k0: tile.load_x(x_ref, k0), load_group, k=k, group_size=group_size,
        tile_k=tile_k, block_m=block_m, block_n=block_n, block_k=block_k,
        dtype=x_ref.dtype, has_zeros=z_ref is not None, has_biases=b_ref is not None,
        paired=paired, by_dot=by_dot, precision=precision)

  tile.run(o_ref, step, steps=steps_per_split, split_k=split_k)


def heuristic_config(num_pairs: int, num_experts: int, k: int, n: int) -> KernelConfig:
  """The grouped MoE tiling (:func:`moe_common.grouped_heuristic_config`) with row blocks
  of at most 32, where the x sums run on the tensor cores
  (:data:`int4_matmul.SUM_BY_DOT_MAX_BLOCK_M`)."""
  config = moe_common.grouped_heuristic_config(num_pairs, num_experts, k, n)
  if config.block_m > int4_matmul.SUM_BY_DOT_MAX_BLOCK_M:
    config = dataclasses.replace(config, block_m=int4_matmul.SUM_BY_DOT_MAX_BLOCK_M)
  return config


def declines(w: Int4Weight, dtype=None) -> str | None:
  """Why the kernel cannot run the expert stack ``w``, or None (``qjax.Backend.declines``):
  groups must be whole 16-row slabs (or one group per column)."""
  del dtype  # every activation dtype runs
  if w.group_size < w.shape[0] and w.group_size % _SLAB:
    return (f"group_size={w.group_size} must be a multiple of {_SLAB} (or K, one group per "
            "column) for the INT4 MoE kernels")
  return None


def int4_moe_matmul(rows: jax.Array, w: Int4Weight, pair_rows: jax.Array,
                    pair_experts: jax.Array, *, interpret: bool = False,
                    config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """``y[p] = rows[pair_rows[p]] @ W[pair_experts[p]]`` -> ``[P, N]`` in rows' dtype.

  Args:
    rows: ``[R, K]`` bf16 / f16 / f32 activations.
    w: INT4 experts: codes ``[E, Kp // 8, N]`` uint32, scales (and zeros or biases)
      ``[E, K // G, N]``; codes in another tile order than 128 are repacked first (per
      call: store experts in the native order).
    pair_rows, pair_experts: ``[P]`` int32; experts in ``[0, E)`` (a pair out of range
      gives a NaN row, :func:`qjax._src.moe.checked_experts`).
    config: tiling (``block_m`` rows per tile); None: :func:`heuristic_config`.
    poison: for tests: the output buffer starts as NaN (aliased into the kernel), so a
      row the kernel fails to write shows up as NaN.

  Raises:
    NotImplementedError: ``w`` is not an Int4Weight with one expert axis, or its groups
      are not whole 16-row slabs (:func:`declines`).
  """
  if not isinstance(w, Int4Weight) or w.codes.ndim != 3:
    raise NotImplementedError(
        f"the INT4 MoE kernel takes an Int4Weight with one leading expert axis, got "
        f"{type(w).__name__} with codes of shape {tuple(w.codes.shape)}")
  reason = declines(w)
  if reason:
    raise NotImplementedError(reason)
  if w.tile_k != packing.NATIVE_TILE_K:
    w = w.repack(packing.NATIVE_TILE_K)
  num_experts, k, n = w.codes.shape[0], w.shape[0], w.shape[1]
  if config is None:
    config = heuristic_config(pair_experts.shape[0], num_experts, k, n)
  config = int4_matmul.legalize(config, k, w.tile_k)
  split_k = config.split_k
  steps = w.codes.shape[1] * 8 // config.block_k
  kernel = functools.partial(
      _moe_kernel, k=k, group_size=w.group_size, tile_k=w.tile_k, block_m=config.block_m,
      block_n=config.block_n, block_k=config.block_k, steps_per_split=steps // split_k,
      split_k=split_k,
      paired=int4_matmul.paired_decode(config.block_n, config.num_warps, interpret),
      by_dot=int4_matmul.sum_by_dot(rows.dtype, config.block_m),
      precision=common.dot_precision(rows.dtype, interpret))
  return moe_common.grouped_launch(
      kernel, rows, pair_rows, pair_experts, [w.codes, w.scales, w.zeros, w.biases],
      num_experts=num_experts, n=n, config=config, interpret=interpret, poison=poison,
      name="qjax_int4_moe_matmul")
