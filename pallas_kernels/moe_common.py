"""What the MoE kernels share whatever the weight format (MXFP4, INT4): the grouped
GEMM's tiling heuristic, row tiles and launch; the per-pair GEMV's loop shape,
heuristic, pair ids, argument checks and launch.

Grouped GEMM (:mod:`pallas_kernels.fp4_moe`, :mod:`pallas_kernels.int4_moe`): the pairs
are sorted by expert in XLA (:func:`qjax._src.moe.group_by_expert`) and their activation
rows gathered into that order, plus ``block_m`` zero rows so that every tile's block stays
in bounds; one ``pallas_call`` runs a grid of ``(column block, row tile, K split)``
programs. Row tile ``i`` reads its expert, first and end sorted row from three ``[tiles]``
int32 tables (:class:`GroupedTile`); the products, in sorted order, are put back in pair
order by XLA, with NaN rows for out-of-range experts (:func:`grouped_launch`).

Per-pair GEMV (:mod:`pallas_kernels.fp4_moe_gemv`, :mod:`pallas_kernels.int4_moe_gemv`):
a grid of ``(column block, pair, K split)`` programs, each reading its pair's row index
and expert id as scalars (:class:`PairTile`); K splits need not divide the K-tiles, the
last split's steps past the end being masked (:func:`loop_shape`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np

from qjax import KernelConfig
from qjax._src import dispatch
from qjax._src import moe
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import int4_gemv

_TILE_K = packing.NATIVE_TILE_K

# ------------------------------------------------------------------------ grouped GEMM

# Programs a grouped launch aims for (about two per SM of an H100), as the dense heuristic.
GROUPED_TARGET_PROGRAMS = 256


def grouped_heuristic_config(num_pairs: int, num_experts: int, k: int, n: int
                             ) -> KernelConfig:
  """Tiling for ``num_pairs`` rows spread over up to ``num_experts`` experts.

  Row blocks fit the expected group size (16 for decode, up to 64 for prefill); narrow
  column blocks and split-K give small launches enough programs to keep the GPU busy.
  """
  active = min(num_experts, num_pairs)
  per_expert = -(-num_pairs // active)
  block_m = min(64, max(16, common.next_pow2(per_expert)))
  block_n = 64 if n >= 2048 else 32
  cols = -(-n // block_n)
  tiles = moe.max_row_tiles(num_pairs, num_experts, block_m)
  k_tiles = -(-k // _TILE_K)
  split_k = max(1, min(-(-GROUPED_TARGET_PROGRAMS // (cols * tiles)), k_tiles))
  block_k = 256 if k_tiles // split_k >= 2 else 128
  return KernelConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                      num_warps=4, num_stages=4 if block_m <= 16 else 3)


class GroupedTile:
  """Output tile ``[block_m, block_n]`` of a grouped MoE program: row tile
  ``program_id(1)`` (sorted rows ``[row0, row_end)`` of one ``expert``, from the tile
  table), column block ``program_id(0)``, K split ``program_id(2)``.

  Attributes:
    expert, row0, row_end: int32 scalars read from the tile table.
    m_mask: ``[block_m]`` the block's rows inside the tile (the rest belong to the next
      expert, or to the padding).
    n0, n_mask: first column, ``[block_n]`` columns inside N.
    pid_k: the K split.
    n_ragged, k_ragged: static: N off the column block, K off the 128-row tile (masks
      along the contiguous axis keep Triton from vectorizing: only where ragged).
  """

  def __init__(self, tile_expert_ref, tile_start_ref, tile_end_ref, *, n: int, k: int,
               tile_k: int, block_m: int, block_n: int):
    pid_t = pl.program_id(1)
    self.expert = tile_expert_ref[pid_t]
    self.row0, self.row_end = tile_start_ref[pid_t], tile_end_ref[pid_t]
    self.m_mask = (self.row0 + jnp.arange(block_m)) < self.row_end
    self.n0 = pl.program_id(0) * block_n
    self.pid_k = pl.program_id(2)  # read here: interpret mode has none inside pl.when
    self.n_mask = (self.n0 + jnp.arange(block_n)) < n
    self.n_ragged, self.k_ragged = n % block_n != 0, k % tile_k != 0
    self._k, self._slab, self._block = k, tile_k // 8, (block_m, block_n)

  def load_x(self, x_ref, k0):
    """``[block_m, tile_k // 8]`` activations of the tile's rows at K rows ``k0 ..``
    (0 outside the tile's rows and past K)."""
    mask = self.m_mask[:, None]
    if self.k_ragged:
      mask = mask & ((k0 + jnp.arange(self._slab)) < self._k)[None, :]
    return common.load(x_ref.at[pl.ds(self.row0, self._block[0]), pl.ds(k0, self._slab)],
                       mask)

  def group_mask(self, g, num_groups: int):
    """The mask of a ``[1, block_n]`` load of scale row ``g`` (of ``num_groups``): None
    where nothing is ragged."""
    if not (self.n_ragged or self.k_ragged):
      return None
    return self.n_mask[None, :] & (g < num_groups)

  def run(self, o_ref, step: Callable[[Any, jax.Array], jax.Array], *, steps: int,
          split_k: int, finish: Callable[[jax.Array], jax.Array] = lambda acc: acc) -> None:
    """Unless the tile is empty: ``acc = step(i, acc)`` for ``i < steps`` from zeros,
    then ``finish(acc)`` stored into the tile's rows and columns of ``o_ref``
    (:func:`common.store_tile`)."""
    block_m, block_n = self._block

    @pl.when(self.row_end > self.row0)
    def _():
      acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
      common.store_tile(o_ref, finish(acc), m0=self.row0, n0=self.n0, block_m=block_m,
                        block_n=block_n, pid_k=self.pid_k, split_k=split_k,
                        mask=self.m_mask[:, None] & self.n_mask[None, :])


def grouped_launch(kernel: Callable[..., None], rows: jax.Array, pair_rows: jax.Array,
                   pair_experts: jax.Array, weight_args: Sequence[Any], *, num_experts: int,
                   n: int, config: KernelConfig, interpret: bool, poison: bool,
                   name: str) -> jax.Array:
  """Runs ``kernel(tile_expert, tile_start, tile_end, x, *weight_args, o)`` over the row
  tiles of the pairs sorted by expert; ``[P, N]`` in rows' dtype, in pair order.

  Args:
    kernel: the kernel body, static parameters bound; ``x`` is ``[P + block_m, K]`` (the
      pairs' rows in expert order, then ``block_m`` zero rows) and ``o`` ``[P + block_m,
      N]`` (or ``[split_k, P + block_m, N]`` float32), as :func:`common.launch` gives it.
    rows, pair_rows, pair_experts: the canonical MoE form (``[R, K]``, ``[P]``, ``[P]``);
      experts outside ``[0, E)`` are clamped for addressing and their rows NaN
      (:func:`qjax._src.moe.checked_experts`).
    weight_args: the expert stack's arrays, each with a leading ``[E]`` axis (None for an
      absent optional field); passed as they are, so a ``qjax.layer_of`` layer is read in
      place.
    config: the legalized tiling; ``block_m`` rows per tile.
  """
  block_m = config.block_m
  p = pair_experts.shape[0]
  pair_experts, valid = moe.checked_experts(pair_experts, num_experts)
  groups = moe.group_by_expert(pair_experts, num_experts, block_m)
  # Rows in expert order, plus block_m zero rows so every tile's block stays in bounds.
  x = jnp.pad(rows[pair_rows[groups.order]], ((0, block_m), (0, 0)))
  args = [groups.tile_experts, groups.tile_starts, groups.tile_ends, x, *weight_args]
  out = common.launch(kernel, args, m=p + block_m, n=n, dtype=rows.dtype, config=config,
                      interpret=interpret, poison=poison, name=name,
                      grid_m=groups.tile_experts.shape[0])
  return moe.nan_rows(out[moe.inverse_permutation(groups.order)], valid)


# -------------------------------------------------------------------------- per-pair GEMV

# Pairs up to which the GEMV kernels are meant to be used: each pair reads its expert in
# full, so past decode sizes the grouped kernel, which reads each selected expert once,
# wins. H100, MXFP4, 128 experts of 2880x2880, top-4: 311 against 427 us at 128 pairs,
# 611 against 540 us at 256 (BENCHMARKS.md).
GEMV_MAX_PAIRS = 128
# ... and only while the pairs are at most this many times the distinct experts that
# uniform routing selects: few experts, each read again by the pairs repeating it, lose
# to reading each once. H200, 8 INT4 experts of 4096x14336 (Mixtral's), top-2, GEMV
# against grouped: 26.9 / 48.4, 88.4 / 107.4, 167.4 / 116.7, 322.0 / 127.1 us at 2 / 8 /
# 16 / 32 pairs (1.07 / 1.52 / 2.27 / 4.0 pairs per expected expert); 128 MXFP4 experts of
# 2880x2880 at 64 pairs (1.27) 143.5 / 180.0, 128 INT4 experts of 2048x768 at 128 (1.58)
# 40.3 / 74.6 (BENCHMARKS.md, session 46); H100, MXFP4, 128 pairs (1.58): 311 / 427.
GEMV_MAX_REPEATS = 2.0


def stack_experts(w: Any) -> int:
  """The experts of the expert stack ``w`` (the axis before its codes' last two); 1 for a
  single matrix, which ``qjax.moe_matmul`` refuses after asking the routing rules."""
  return w.codes.shape[-3] if w.codes.ndim >= 3 else 1


def gemv_meant_for(num_pairs: int, num_experts: int) -> bool:
  """Whether a per-pair GEMV kernel is meant for ``num_pairs`` pairs over ``num_experts``
  experts: 1 to :data:`GEMV_MAX_PAIRS` pairs, at most :data:`GEMV_MAX_REPEATS` per
  expected distinct expert (:func:`qjax._src.moe.expected_distinct_experts`)."""
  if not 1 <= num_pairs <= GEMV_MAX_PAIRS:
    return False
  return num_pairs <= GEMV_MAX_REPEATS * moe.expected_distinct_experts(num_pairs, num_experts)


def gemv_loop_shape(config: KernelConfig, tiles: int) -> tuple[int, int, int]:
  """``(tiles_per_step, split_k, steps)`` for ``tiles`` K-tiles.

  Tiles per step: ``block_k // 128`` halved until it divides ``tiles``. K splits: at most
  ``config.split_k``, each of ``steps = ceil(groups / split_k)`` loop steps; the last one
  may be partly past the end (masked: :func:`has_k_tail`), none wholly.
  """
  tps = max(1, config.block_k // _TILE_K)
  while tiles % tps:
    tps //= 2
  groups = tiles // tps
  split = max(1, min(config.split_k, groups))
  steps = -(-groups // split)
  return tps, -(-groups // steps), steps


def has_k_tail(tiles_per_step: int, split_k: int, steps: int, tiles: int) -> bool:
  """Whether the last K split runs past the last of ``tiles`` K-tiles (those steps are
  masked: no bytes read)."""
  return split_k * steps * tiles_per_step > tiles


def gemv_heuristic_config(num_pairs: int, k: int, n: int) -> KernelConfig:
  """64 columns per program, two K-tiles per step where they divide, loads one step
  ahead, 4 warps (the GEMV kernels' H100 choice), and K splits that bring
  ``P * column blocks * splits`` near :data:`int4_gemv.TARGET_PROGRAMS`.

  E.g. K = N = 2880 (23 K-tiles): P = 1 -> 23 splits (1035 programs), P = 4 -> 5
  splits (900), P = 16 -> 1 split (720). An H100 sweep of 48 configs at P = 4, 16, 64,
  128 (MXFP4, BENCHMARKS.md, session 14) found none faster.
  """
  tiles = -(-k // _TILE_K)
  tps = 2 if tiles % 2 == 0 else 1
  groups = tiles // tps
  cols = -(-n // 64)
  want = max(1, round(int4_gemv.TARGET_PROGRAMS / (max(1, num_pairs) * cols)))
  steps = max(1, min(groups, round(groups / want)))
  return KernelConfig(block_m=1, block_n=64, block_k=_TILE_K * tps,
                      split_k=-(-groups // steps), num_warps=4, num_stages=1)


def check_gemv_args(kernel: str, rows, w, pair_rows, pair_experts, format_cls: type) -> None:
  """Raises for a weight other than a ``format_cls`` stack of one expert axis
  (NotImplementedError), or rows / pair arrays of the wrong shape or dtype (ValueError);
  ``kernel`` names the kernel in the message."""
  if not isinstance(w, format_cls) or w.codes.ndim != 3:
    raise NotImplementedError(
        f"the {kernel} takes an {format_cls.__name__} with one leading expert axis, got "
        f"{type(w).__name__} with codes of shape {tuple(w.codes.shape)}")
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


class PairTile:
  """Output slice ``[1, block_n]`` of a per-pair GEMV program: pair ``program_id(1)``
  (its row of ``x_ref`` and its expert of ``w_ref``, read as scalars), column block
  ``program_id(0)``, K split ``program_id(2)``.

  The pair's row and expert are clamped into range for addressing (in-bounds reads
  whatever the ids); ``valid`` says whether both were in range (:meth:`store` writes NaN
  otherwise). ``pair_rows_ref`` None: every pair multiplies row 0 (:func:`gemv_launch`).

  Attributes:
    row, expert, valid: the pair's (traced scalars).
    pid_p, pid_k: the pair and the K split.
    n0, n_mask: first column, ``[block_n]`` columns inside N.
    n_ragged: static: N off the column block.
    masked_k: static: loads along K need masks (K off the 128-row tile, or the last K
      split running past the last K-tile: ``k_tail``).
  """

  def __init__(self, pair_rows_ref, pair_experts_ref, x_ref, w_ref, *, k: int,
               block_n: int, tiles: int, k_tail: bool):
    pid_p = pl.program_id(1)
    num_rows = x_ref.shape[0]
    num_experts, _, n = w_ref.shape
    expert = pair_experts_ref[pid_p]
    valid = (expert >= 0) & (expert < num_experts)
    if pair_rows_ref is None:
      row = jnp.int32(0)
    else:
      row = pair_rows_ref[pid_p]
      valid &= (row >= 0) & (row < num_rows)
      row = jnp.clip(row, 0, num_rows - 1)
    self.row, self.expert, self.valid = row, jnp.clip(expert, 0, num_experts - 1), valid
    self.pid_p, self.pid_k = pid_p, pl.program_id(2)
    self.n0 = pl.program_id(0) * block_n
    self.n_mask = (self.n0 + jnp.arange(block_n)) < n
    self.n_ragged = n % block_n != 0
    self.masked_k = k % _TILE_K != 0 or k_tail
    self._k, self._block_n, self._tiles, self._k_tail = k, block_n, tiles, k_tail
    self._x_ref, self._w_ref = x_ref, w_ref

  def load_words(self, t):
    """``[16, block_n]`` code words of K-tile ``t`` of the pair's expert (none read past
    the last tile; the K-tail mask is one scalar per tile, uniform along N)."""
    bn = self._block_n
    mask = self.n_mask[None, :] if self.n_ragged else None
    if self._k_tail:
      in_k = jnp.broadcast_to(t < self._tiles, (1, bn))
      mask = in_k if mask is None else mask & in_k
    slab = _TILE_K // 8
    return common.load(self._w_ref.at[self.expert, pl.ds(t * slab, slab),
                                      pl.ds(self.n0, bn)], mask)

  def load_x(self, k0):
    """``[16, 1]`` float32 values of the pair's row at ``k0 ..`` (0 past K)."""
    slab = _TILE_K // 8
    mask = ((k0 + jnp.arange(slab)) < self._k) if self.masked_k else None
    return common.load(self._x_ref.at[self.row, pl.ds(k0, slab)], mask).astype(
        jnp.float32)[:, None]

  def load_row(self, ref, g):
    """``[1, block_n]`` row ``g`` of the pair's expert in ``ref [E, G, N]`` (scales, zero
    points, biases; 0 past the last row)."""
    mask = None
    if self.n_ragged or self.masked_k:
      mask = self.n_mask[None, :] & (g < ref.shape[1])
    return common.load(ref.at[self.expert, pl.ds(g, 1), pl.ds(self.n0, self._block_n)],
                       mask)

  def store(self, o_ref, out, *, split_k: int) -> None:
    """Stores ``out [1, block_n]`` (NaN where the pair's ids were out of range)."""
    out = jnp.where(self.valid, out, jnp.nan)
    common.store_tile(o_ref, out, m0=self.pid_p, n0=self.n0, block_m=1,
                      block_n=self._block_n, pid_k=self.pid_k, split_k=split_k,
                      mask=self.n_mask[None, :] if self.n_ragged else None)


def gemv_launch(kernel: Callable[..., None], rows: jax.Array, pair_rows: jax.Array,
                pair_experts: jax.Array, weight_args: Sequence[Any], *, n: int,
                config: KernelConfig, interpret: bool, poison: bool, name: str) -> jax.Array:
  """Runs ``kernel(pair_rows, pair_experts, rows, *weight_args, o)`` over ``(column
  block, pair, K split)``; ``[P, N]`` in rows' dtype.

  Concrete all-zero ``pair_rows`` (one token's, from ``qjax.moe_matmul``) are not passed:
  the kernel gets None and reads row 0 (:func:`_constant_zeros`). ``config``: the launch's
  ``block_n``, ``split_k`` and ``num_warps`` (``num_stages`` 1: the kernels prefetch in
  registers themselves).
  """
  p = pair_rows.shape[0]
  args = [None if _constant_zeros(pair_rows) else jnp.asarray(pair_rows, jnp.int32),
          pair_experts.astype(jnp.int32), rows, *weight_args]
  return common.launch(kernel, args, m=p, n=n, dtype=rows.dtype, config=config,
                       interpret=interpret, poison=poison, name=name, grid_m=p)
