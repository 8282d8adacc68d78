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
from jax.experimental import pallas as pl
import numpy as np

from qjax import KernelConfig
from qjax import MXFP4Weight
from qjax._src import dispatch
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import fp4_codec
from pallas_kernels import fp4_gemv
from pallas_kernels import int4_gemv

_f32 = jnp.float32
_TILE_K = packing.NATIVE_TILE_K
_SLAB = _TILE_K // 8  # rows per nibble plane of a K-tile
# Programs a launch aims for: about 7 per SM of an H100, as the GEMV kernels.
_TARGET_PROGRAMS = int4_gemv.TARGET_PROGRAMS
# Pairs up to which the kernel is meant to be used: each pair reads its expert in full,
# so past decode sizes the grouped kernel, which reads each selected expert once, wins.
# H100, 128 experts of 2880x2880, top-4: 311 against 427 us at 128 pairs, 611 against
# 540 us at 256 (BENCHMARKS.md).
MAX_PAIRS = 128

# The name qjax.moe_matmul selects it by: implementation="pallas:" + BACKEND_NAME.
BACKEND_NAME = "pallas_triton_gemv"
VARIANTS = fp4_gemv.VARIANTS
DEFAULT_VARIANT = fp4_gemv.DEFAULT_VARIANT


def supports(num_pairs: int, k: int, block_size: int = MXFP4Weight.block_size) -> bool:
  """Whether this kernel is meant for the call: 1 to :data:`MAX_PAIRS` pairs, MXFP4 blocks
  of 32 rows, and whole blocks in K. (It computes correct results for any P; past
  ``MAX_PAIRS`` it re-reads shared experts too often to be the fast path.)"""
  return (1 <= num_pairs <= MAX_PAIRS and block_size == MXFP4Weight.block_size
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
    return p.split_k * p.steps * p.tiles_per_step > self.tiles


def _moe_gemv_kernel(pair_rows_ref, pair_experts_ref, x_ref, w_ref, s_ref, o_ref, *,
                     launch: _Launch):
  """Output columns ``[n0, n0 + block_n)`` of pair ``program_id(1)`` over one K split.

  Refs (whole arrays):
    pair_rows_ref, pair_experts_ref: ``[P]`` int32; pair_rows_ref None where every pair
      multiplies row 0 (:func:`_constant_zeros`).
    x_ref: ``[R, K]`` bf16 / f16 / f32 rows.
    w_ref: ``[E, Kp // 8, N]`` uint32 E2M1 codes in tile order 128.
    s_ref: ``[E, K // 32, N]`` uint8 E8M0 scale bytes.
    o_ref: ``[P, N]`` in x's dtype (split_k == 1) or ``[split_k, P, N]`` float32.
  """
  plan = launch.plan
  pid_n, pid_p, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  num_experts, _, n = w_ref.shape
  num_rows = x_ref.shape[0]
  num_blocks = s_ref.shape[1]
  expert = pair_experts_ref[pid_p]
  valid = (expert >= 0) & (expert < num_experts)
  if pair_rows_ref is None:
    row = jnp.int32(0)
  else:
    row = pair_rows_ref[pid_p]
    valid &= (row >= 0) & (row < num_rows)
    row = jnp.clip(row, 0, num_rows - 1)         # in-bounds addresses whatever the ids
  expert = jnp.clip(expert, 0, num_experts - 1)
  bn = plan.block_n
  n0 = pid_n * bn
  n_mask = (n0 + jnp.arange(bn)) < n
  # Masks along the contiguous axis keep Triton from vectorizing: only where ragged. The
  # K-tail mask is one scalar per tile (uniform along N).
  n_ragged, k_ragged, k_tail = n % bn != 0, plan.k % _TILE_K != 0, launch.k_tail
  decode, factor = fp4_codec.scale_decoder("e8m0", use_ptx=plan.ptx_scales)

  def load_words(t):
    """``[16, bn]`` code words of K-tile ``t`` of the pair's expert (none past the end)."""
    mask = n_mask[None, :] if n_ragged else None
    if k_tail:
      in_k = jnp.broadcast_to(t < launch.tiles, (1, bn))
      mask = in_k if mask is None else mask & in_k
    return common.load(w_ref.at[expert, pl.ds(t * _SLAB, _SLAB), pl.ds(n0, bn)], mask)

  def load_x(k0):
    """``[16, 1]`` f32 values of the pair's row at ``k0 ..`` (0 past K)."""
    mask = ((k0 + jnp.arange(_SLAB)) < plan.k) if (k_ragged or k_tail) else None
    return common.load(x_ref.at[row, pl.ds(k0, _SLAB)], mask).astype(_f32)[:, None]

  def load_scale(g):
    """``[1, bn]`` f32 multiplier of block row ``g`` (finite past the last block)."""
    mask = None
    if n_ragged or k_ragged or k_tail:
      mask = n_mask[None, :] & (g < num_blocks)
    return decode(common.load(s_ref.at[expert, pl.ds(g, 1), pl.ds(n0, bn)], mask))

  acc = fp4_gemv.accumulate(plan, pid_k, load_words, load_x, load_scale)
  out = jnp.sum(acc, axis=0, keepdims=True) * factor  # [1, bn]
  out = jnp.where(valid, out, jnp.nan)
  common.store_tile(o_ref, out, m0=pid_p, n0=n0, block_m=1, block_n=bn, pid_k=pid_k,
                    split_k=plan.split_k, mask=n_mask[None, :] if n_ragged else None)


# ---------------------------------------------------------------------------- configs


def loop_shape(config: KernelConfig, tiles: int) -> tuple[int, int, int]:
  """``(tiles_per_step, split_k, steps)`` for ``tiles`` K-tiles.

  Tiles per step: ``block_k // 128`` halved until it divides ``tiles``. K splits: at most
  ``config.split_k``, each of ``steps = ceil(groups / split_k)`` loop steps; the last one
  may be partly past the end (masked), none wholly.
  """
  tps = max(1, config.block_k // _TILE_K)
  while tiles % tps:
    tps //= 2
  groups = tiles // tps
  split = max(1, min(config.split_k, groups))
  steps = -(-groups // split)
  return tps, -(-groups // steps), steps


def heuristic_config(num_pairs: int, k: int, n: int) -> KernelConfig:
  """64 columns per program, two K-tiles per step where they divide, loads one step
  ahead, 4 warps (the GEMV kernels' H100 choice), and K splits that bring
  ``P * column blocks * splits`` near ``_TARGET_PROGRAMS``.

  E.g. K = N = 2880 (23 K-tiles): P = 1 -> 23 splits (1035 programs), P = 4 -> 5
  splits (900), P = 16 -> 1 split (720). An H100 sweep of 48 configs at P = 4, 16, 64,
  128 (BENCHMARKS.md, session 14) found none faster.
  """
  tiles = -(-k // _TILE_K)
  tps = 2 if tiles % 2 == 0 else 1
  groups = tiles // tps
  cols = -(-n // 64)
  want = max(1, round(_TARGET_PROGRAMS / (max(1, num_pairs) * cols)))
  steps = max(1, min(groups, round(groups / want)))
  return KernelConfig(block_m=1, block_n=64, block_k=_TILE_K * tps,
                      split_k=-(-groups // steps), num_warps=4, num_stages=1)


# -------------------------------------------------------------------------------- API


def _check(rows, w, pair_rows, pair_experts, variant) -> None:
  if not isinstance(w, MXFP4Weight) or w.codes.ndim != 3:
    raise NotImplementedError(
        f"the MoE GEMV kernel takes an MXFP4Weight with one leading expert axis, got "
        f"{type(w).__name__} with codes of shape {tuple(w.codes.shape)}")
  if variant not in VARIANTS:
    raise ValueError(f"{variant=} must be one of {VARIANTS}")
  k = w.shape[0]
  if rows.ndim != 2 or rows.shape[1] != k or rows.shape[0] < 1:
    raise ValueError(f"rows must be [R >= 1, K={k}], got shape {tuple(rows.shape)}")
  if jnp.dtype(rows.dtype) not in [jnp.dtype(d) for d in dispatch.ACTIVATION_DTYPES]:
    raise ValueError(f"rows.dtype={jnp.dtype(rows.dtype).name} must be bfloat16, float16 "
                     "or float32")
  if (pair_rows.ndim != 1 or pair_rows.shape != pair_experts.shape
      or pair_rows.shape[0] < 1):
    raise ValueError(f"pair_rows and pair_experts must both be [P >= 1], got shapes "
                     f"{tuple(pair_rows.shape)} and {tuple(pair_experts.shape)}")


def _constant_zeros(a) -> bool:
  """Whether ``a`` is a concrete array (not traced) of zeros only. ``qjax.moe_matmul``
  passes its pair rows as a constant, all zero for one token; a custom call's operand
  must be in memory, and XLA writes an all-equal constant by a broadcast kernel of its own
  before the call (0.9-1 us on the H100, BENCHMARKS.md session 25). The kernel is then
  handed no pair rows and reads row 0."""
  try:
    return not np.asarray(a).any()
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return False


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
  _check(rows, w, pair_rows, pair_experts, variant)
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
  shared_row_0 = _constant_zeros(pair_rows)
  args = [None if shared_row_0 else jnp.asarray(pair_rows, jnp.int32),
          pair_experts.astype(jnp.int32), rows, w.codes, w.scales]
  return common.launch(
      functools.partial(_moe_gemv_kernel, launch=_Launch(plan=plan, tiles=tiles)), args,
      m=p, n=n, dtype=rows.dtype, config=launch_config, interpret=interpret, poison=poison,
      name="qjax_mxfp4_moe_gemv", grid_m=p)
