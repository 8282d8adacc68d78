"""MXFP4 mixture-of-experts matmul for decode (a few pairs): one GEMV per (row, expert) pair.

Contract: the canonical MoE form of :mod:`qjax._src.moe` (its ``moe_matmul_xla`` is the
reference): pair ``p`` multiplies row ``pair_rows[p]`` of ``rows [R, K]`` by expert
``pair_experts[p]``'s MXFP4 weight; float32 accumulation; ``[P, N]`` in rows' dtype.

Why a second MoE kernel. The grouped GEMM (:mod:`pallas_kernels.fp4_moe`) sorts the pairs
by expert, gathers their rows, builds a tile table in XLA and runs 16-row tensor-core tiles;
at one token (top-4 of 128 experts of 2880 x 2880) those fixed costs and the 1/16-used
tiles dominate (91 us on an H100 against a 6 us floor). Here nothing is sorted or gathered:

* The grid is ``(column block, pair, K split)``. Each program loads its pair's row index
  and expert id as scalars from the two ``[P]`` int32 arrays, then runs the M = 1 FP4
  kernel's K loop (:func:`pallas_kernels.fp4_gemv.accumulate`: E2M1 pairs decoded as
  f16x2, one FMA per weight, loads prefetched in registers; the same inline-PTX word step)
  over that expert's codes and scales only, indexed by the loaded expert id.
* Split-K partial sums go to a ``[split_k, P, N]`` float32 buffer summed in XLA
  (:func:`common.launch`), as the GEMV does. Unlike the GEMV, the splits need not divide
  the K-tiles: the last split's steps past the end are masked (no bytes read), so the
  heuristic can aim at ~900 programs for any P.
* A pair repeated, or an expert shared by several pairs, is read once per pair (no
  deduplication: at decode most selected experts serve one pair). Unselected experts'
  bytes are never read.

Out-of-range ids: the contract is ``pair_experts`` in ``[0, E)`` and ``pair_rows`` in
``[0, R)`` (``qjax.moe_matmul`` checks concrete ids; traced ids are not checkable). Here an
id outside its range never causes an out-of-bounds read: it is clamped for addressing and
the pair's whole output row is NaN, so the misuse shows, as in every built-in MoE
implementation (``qjax._src.moe.checked_experts``).

Variants: ``"ptx"`` and ``"plain"``, as in :mod:`pallas_kernels.fp4_gemv`; interpret mode
(CPU tests) runs the plain math.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qjax import KernelConfig
from qjax import MXFP4Weight
from qjax._src import packing
from pallas_kernels import fp4_codec
from pallas_kernels import fp4_gemv
from pallas_kernels import moe_common

_f32 = jnp.float32
_TILE_K = packing.NATIVE_TILE_K
_SLAB = _TILE_K // 8  # rows per nibble plane of a K-tile
# Pairs up to which the kernel is meant to be used (moe_common.GEMV_MAX_PAIRS).
MAX_PAIRS = moe_common.GEMV_MAX_PAIRS
# The loop shape and heuristic the per-pair GEMV kernels share (MXFP4 and INT4).
loop_shape = moe_common.gemv_loop_shape
heuristic_config = moe_common.gemv_heuristic_config

# The name qjax.moe_matmul selects it by: implementation="pallas:" + BACKEND_NAME.
BACKEND_NAME = "pallas_triton_gemv"
VARIANTS = fp4_gemv.VARIANTS
DEFAULT_VARIANT = fp4_gemv.DEFAULT_VARIANT


def supports(num_pairs: int, k: int, block_size: int = MXFP4Weight.block_size,
             num_experts: int | None = None) -> bool:
  """Whether this kernel is meant for the call: 1 to :data:`MAX_PAIRS` pairs (and, given
  ``num_experts``, few enough per expert: :func:`moe_common.gemv_meant_for`), MXFP4 blocks
  of 32 rows, and whole blocks in K. (It computes correct results for any P; past those
  bounds it re-reads shared experts too often to be the fast path.)"""
  meant = (1 <= num_pairs <= MAX_PAIRS if num_experts is None
           else moe_common.gemv_meant_for(num_pairs, num_experts))
  return (meant and block_size == MXFP4Weight.block_size
          and fp4_gemv.supports(1, k, block_size))


# ----------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Launch:
  """Static parameters of one launch beyond the GEMV loop's :class:`fp4_gemv.Plan`.

  Attributes:
    plan: the K loop (``split_k * steps * tiles_per_step`` may exceed ``tiles``).
    tiles: 128-row K-tiles of one expert (``Kp // 128``).
  """
  plan: fp4_gemv.Plan
  tiles: int

  @property
  def k_tail(self) -> bool:
    """Whether the last K split runs past the last K-tile (those steps are masked)."""
    p = self.plan
    return moe_common.has_k_tail(p.tiles_per_step, p.split_k, p.steps, self.tiles)


def _moe_gemv_kernel(pair_rows_ref, pair_experts_ref, x_ref, w_ref, s_ref, o_ref, *,
                     launch: _Launch):
  """Output columns ``[n0, n0 + block_n)`` of pair ``program_id(1)`` over one K split.

  Refs (whole arrays):
    pair_rows_ref, pair_experts_ref: ``[P]`` int32; pair_rows_ref None where every pair
      multiplies row 0 (:func:`moe_common.gemv_launch`).
    x_ref: ``[R, K]`` bf16 / f16 / f32 rows.
    w_ref: ``[E, Kp // 8, N]`` uint32 E2M1 codes in tile order 128.
    s_ref: ``[E, K // 32, N]`` uint8 E8M0 scale bytes.
    o_ref: ``[P, N]`` in x's dtype (split_k == 1) or ``[split_k, P, N]`` float32.
  """
  plan = launch.plan
  tile = moe_common.PairTile(pair_rows_ref, pair_experts_ref, x_ref, w_ref, k=plan.k,
                             block_n=plan.block_n, tiles=launch.tiles, k_tail=launch.k_tail)
  decode, factor = fp4_codec.scale_decoder("e8m0", use_ptx=plan.ptx_scales)

  def load_scale(g):
    """``[1, bn]`` f32 multiplier of block row ``g`` (finite past the last block)."""
    return decode(tile.load_row(s_ref, g))

  acc = fp4_gemv.accumulate(plan, tile.pid_k, tile.load_words, tile.load_x,
                            load_scale)
  tile.store(o_ref, jnp.sum(acc, axis=0, keepdims=True) * factor, split_k=plan.split_k)


# -------------------------------------------------------------------------------- API


def mxfp4_moe_gemv(rows: jax.Array, w: MXFP4Weight, pair_rows: jax.Array,
                   pair_experts: jax.Array, *, config: KernelConfig | None = None,
                   variant: str = DEFAULT_VARIANT, interpret: bool = False,
                   poison: bool = False) -> jax.Array:
  """``y[p] = rows[pair_rows[p]] @ W[pair_experts[p]]`` -> ``[P, N]`` in rows' dtype.

  Args:
    rows: ``[R, K]`` bfloat16, float16 or float32 activations.
    w: MXFP4 experts: codes ``[E, Kp // 8, N]`` uint32, scales ``[E, K // 32, N]`` uint8
      (E8M0); codes in another tile order than 128 are repacked first (per call).
    pair_rows, pair_experts: ``[P]`` integers (cast to int32), in ``[0, R)`` and
      ``[0, E)``; a pair with an id outside its range gets a NaN output row (module doc).
      Concrete all-zero ``pair_rows`` (one token's, from ``qjax.moe_matmul``) are not
      passed to the kernel, which then reads row 0 for every pair.
    config: ``block_n`` columns per program, ``block_k`` (a multiple of 128) K rows per
      loop step, ``split_k`` (at most; need not divide the K-tiles), ``num_warps``, and
      ``num_stages``: loop steps the loads run ahead. None: :func:`heuristic_config`.
    variant: "ptx" (inline-PTX decode and FMAs) or "plain" (the same in Pallas ops).
      Interpret mode runs the plain math either way.
    interpret: run in Pallas interpret mode (CPU).
    poison: for tests: the output starts as NaN, so an unwritten element shows.

  Raises:
    NotImplementedError: ``w`` is not an MXFP4Weight with one expert axis.
    ValueError: bad shapes or dtype of ``rows`` / the pair arrays, or an unknown variant.
  """
  moe_common.check_gemv_args("MoE GEMV kernel", rows, w, pair_rows, pair_experts,
                              MXFP4Weight)
  if variant not in VARIANTS:
    raise ValueError(f"{variant=} must be one of {VARIANTS}")
  if w.tile_k != _TILE_K:
    w = w.repack(_TILE_K)
  k, n = w.shape
  p = pair_rows.shape[0]
  config = config or heuristic_config(p, k, n)
  tiles = w.codes.shape[1] // _SLAB
  tps, split, steps = loop_shape(config, tiles)
  plan = fp4_gemv.Plan(k=k, block_size=w.block_size, scale_format="e8m0",
                       block_n=config.block_n, tiles_per_step=tps, steps=steps,
                       split_k=split, depth=min(max(1, config.num_stages), steps),
                       use_ptx=variant == "ptx" and not interpret,
                       ptx_scales=(variant == "ptx"
                                   and fp4_codec.use_ptx_scales(config.block_n, interpret)))
  # Triton's own pipeliner does nothing for these loads; the prefetch depth is ours.
  launch_config = KernelConfig(block_m=1, block_n=config.block_n, block_k=_TILE_K * tps,
                               split_k=split, num_warps=config.num_warps, num_stages=1)
  return moe_common.gemv_launch(
      functools.partial(_moe_gemv_kernel, launch=_Launch(plan=plan, tiles=tiles)), rows,
      pair_rows, pair_experts, [w.codes, w.scales], n=n, config=launch_config,
      interpret=interpret, poison=poison, name="qjax_mxfp4_moe_gemv")
