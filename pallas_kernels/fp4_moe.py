"""Fused MXFP4 mixture-of-experts matmul: one grouped-GEMM launch over all selected experts.

Contract (qjax's ``moe_matmul_xla`` is the reference): pair ``p`` multiplies row
``pair_rows[p]`` of the activations by expert ``pair_experts[p]``'s MXFP4 weight, float32
accumulation, output in the activations' dtype.

How: the pairs are sorted by expert in XLA (:func:`qjax._src.moe.group_by_expert`) and
their activation rows gathered into that order; one ``pallas_call`` then runs a grid of
``(column block, row tile, K split)`` programs (:mod:`pallas_kernels.moe_common`, shared
with the INT4 MoE kernel). Row tile ``i`` reads its expert, first and end sorted row from
three int32 tables (loaded as scalars by program id); its rows past the group's end are
masked on load and store, and empty tiles (the table has a static length) return at once. Each program reads only its expert's codes and scales and
dequantizes them in registers exactly as the dense FP4 kernel does
(:func:`pallas_kernels.fp4_matmul.accumulate_k_tile`), so unselected experts' weights are
never read and no dequantized expert is written to memory. The products, in sorted order,
are put back in pair order by XLA.

Block scales decode in inline PTX where compiled (:func:`fp4_codec.e8m0_to_f32_ptx`), and
the decoder's constant factor multiplies each output once. H100, 128 experts of 2880 x
2880, top-4: T = 32 / 64 took 298.5 / 377.0 us against 327.0 / 413.8 with the Pallas-op
decoder (BENCHMARKS.md, session 14). The dense tiled kernel, where the PTX decoder measured
mixed, lets the tuner choose per shape (``KernelConfig.ptx_scales``).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from qjax import KernelConfig
from qjax import MXFP4Weight
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import fp4_codec
from pallas_kernels import fp4_matmul
from pallas_kernels import int4_matmul
from pallas_kernels import moe_common

# The tiling the grouped MoE kernels share (MXFP4 and INT4).
heuristic_config = moe_common.grouped_heuristic_config


def _moe_kernel(tile_expert_ref, tile_start_ref, tile_end_ref, x_ref, w_ref, s_ref, o_ref,
                *, k, tile_k, block_m, block_n, block_k, steps_per_split, split_k, paired,
                ptx_scales, precision):
  """One ``[block_m, block_n]`` tile of one expert's rows over ``steps_per_split`` K steps.

  Refs (whole arrays):
    tile_expert_ref, tile_start_ref, tile_end_ref: ``[num_tiles]`` int32 tile table.
    x_ref: ``[R + block_m, K]`` activation rows in expert order (``block_m`` padding rows).
    w_ref: ``[E, Kp // 8, N]`` uint32 E2M1 codes in tile order ``tile_k``.
    s_ref: ``[E, K // 32, N]`` uint8 E8M0 scale bytes.
    o_ref: ``[R + block_m, N]`` in x's dtype (split_k == 1) or ``[split_k, R + block_m, N]``
      float32.
  """
  tile = moe_common.GroupedTile(tile_expert_ref, tile_start_ref, tile_end_ref,
                                n=w_ref.shape[2], k=k, tile_k=tile_k, block_m=block_m,
                                block_n=block_n)
  expert, n0 = tile.expert, tile.n0
  num_blocks = s_ref.shape[1]
  slab = tile_k // 8
  block_size = MXFP4Weight.block_size
  decode, factor = fp4_matmul.scale_decoder("e8m0", use_ptx=ptx_scales)

  def load_scale(g):
    return common.load(s_ref.at[expert, pl.ds(g, 1), pl.ds(n0, block_n)],
                       tile.group_mask(g, num_blocks))

  def step(i, acc):
    k_step = (tile.pid_k * steps_per_split + i) * block_k
    for t in range(block_k // tile_k):
      k_tile = k_step + t * tile_k
      words = common.load(
          w_ref.at[expert, pl.ds(k_tile // 8, slab), pl.ds(n0, block_n)],
          mask=tile.n_mask[None, :] if tile.n_ragged else None)
      acc = fp4_matmul.accumulate_k_tile(
          acc, words, lambda k0: tile.load_x(x_ref, k0), load_scale, k_tile=k_tile,
          tile_k=tile_k, block_size=block_size, dtype=x_ref.dtype, decode=decode,
          paired=paired, precision=precision)
    return acc

  # The decoder's constant factor, once per output.
  tile.run(o_ref, step, steps=steps_per_split, split_k=split_k, finish=lambda a: a * factor)


def mxfp4_moe_matmul(rows: jax.Array, w: MXFP4Weight, pair_rows: jax.Array,
                     pair_experts: jax.Array, *, interpret: bool = False,
                     config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """``y[p] = rows[pair_rows[p]] @ W[pair_experts[p]]`` -> ``[P, N]`` in rows' dtype.

  Args:
    rows: ``[R, K]`` bf16 / f16 / f32 activations.
    w: MXFP4 experts: codes ``[E, Kp // 8, N]``, scales ``[E, K // 32, N]``.
    pair_rows, pair_experts: ``[P]`` int32; experts in ``[0, E)`` (a pair out of range
      gives a NaN row, :func:`qjax._src.moe.checked_experts`).
    config: tiling (``block_m`` rows per tile); None: :func:`heuristic_config`.
    poison: for tests: the output buffer starts as NaN (aliased into the kernel), so a
      row the kernel fails to write shows up as NaN.
  """
  if not isinstance(w, MXFP4Weight) or w.codes.ndim != 3:
    raise NotImplementedError(
        f"the MoE kernel takes an MXFP4Weight with one leading expert axis, got "
        f"{type(w).__name__} with codes of shape {tuple(w.codes.shape)}")
  if w.tile_k != packing.NATIVE_TILE_K:
    w = w.repack(packing.NATIVE_TILE_K)
  num_experts, k, n = w.codes.shape[0], w.shape[0], w.shape[1]
  p = pair_experts.shape[0]
  if config is None:
    config = heuristic_config(p, num_experts, k, n)
  config = int4_matmul.legalize(config, k, w.tile_k)
  split_k = config.split_k
  steps = w.codes.shape[1] * 8 // config.block_k
  kernel = functools.partial(
      _moe_kernel, k=k, tile_k=w.tile_k, block_m=config.block_m, block_n=config.block_n,
      block_k=config.block_k, steps_per_split=steps // split_k, split_k=split_k,
      paired=fp4_matmul.paired_decode(rows.dtype, config.block_n, config.num_warps, interpret),
      ptx_scales=fp4_codec.use_ptx_scales(config.block_n, interpret),
      precision=common.dot_precision(rows.dtype, interpret))
  return moe_common.grouped_launch(
      kernel, rows, pair_rows, pair_experts, [w.codes, w.scales], num_experts=num_experts,
      n=n, config=config, interpret=interpret, poison=poison, name="qjax_mxfp4_moe_matmul")
