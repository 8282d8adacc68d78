"""INT4 x bf16 GEMM for Hopper (sm_90) in Pallas Mosaic GPU: TMA pipeline, wgmma with the
weight as the register operand.

Computes ``y [M, N] = x [M, K] @ W`` for a :class:`qjax.Int4NKWeight` (symmetric or with
integer zero points; codes ``[N, K // 8]``: int4 ``W^T`` with K permuted in runs of 32 into
wgmma's register fragment order) as ``y^T = W^T x^T``, so that the dequantized weight never
goes through shared memory:

* A persistent grid, one program (CTA) per SM, walks the output tiles. A CTA has
  ``consumers + 1`` warpgroups: one issues the TMA copies of a ``stages``-deep pipeline
  over K (x ``[tile_m, tile_k]`` bf16, W^T ``[consumers * tile_n, tile_k]`` int4, the
  step's scale rows ``[groups, consumers * tile_n]``), the others compute. At small M a
  step spans 256 or 512 of K (rows of 128 or 256 bytes of W^T per copy: 16-21 % less
  time than 64-byte rows on 8192x28672, BENCHMARKS.md session 18).
* Each compute warpgroup loads its ``[tile_n, tile_k]`` slice of W^T from shared memory
  into registers, a 32-bit word per thread and row of each 32-code run: thanks to the
  format's permuted order each word holds four of the thread's wgmma operand pairs, which
  :func:`_to_bf16_fragments` converts to bf16 in place (a shift, a LOP3 and a bf16
  subtraction per pair; with zero points the subtrahend is ``128 + z`` of the row's group,
  from a uint8 row the pipeline copies with the scales, instead of 136). Per group of the
  step it multiplies each row by its group scale and issues ``wgmma`` with that register
  operand against the x tile in shared memory (transposed view), accumulating ``[tile_n,
  tile_m]`` in float32; the next group's conversion overlaps the previous wgmma.
* Where x is one tile of 8 rows (``mma_sync``, :func:`config_for`'s choice at M <= 8)
  each warp multiplies its 16 rows with ``mma.sync.m16n8k16`` instead: wgmma's register
  layout is, per warp, mma.sync's A fragments, and x's B fragments come from the
  swizzled x tile by ``ldmatrix`` (:func:`_mma_sync_product`); no warpgroup fences.
* The epilogue relays the accumulator to the transposed wgmma layout and stores it into
  a transposed shared-memory view, so the TMA store writes ``y`` (not ``y^T``) tiles.
* Where a CTA runs two or more tiles, they form one chained pipeline (``chain_tiles``):
  the next tile's loads start while the last steps of the current one compute.
* Below 8 rows x is not padded: the TMA load zero-fills the tile's missing rows and the
  store drops them (:func:`padded_rows`).
* ``split_k > 1`` (for grids with fewer tiles than SMs: small M and N) gives each split
  its own float32 ``[M, N]`` slice of the output, summed by XLA afterwards.
* Under ``qjax.layer_of`` the kernel gets the stacked codes and scales and the layer
  index, and its TMA copies read the layer where it lies (no copy of the layer first).
* :class:`qjax.MXFP4NKWeight` and :class:`qjax.NVFP4NKWeight` (:func:`fp4_nk_matmul`)
  run the same pipeline with E2M1 codes in the same fragment order: each pair becomes
  bf16 by bit placement and exact multiplies by E2M1's exponent bias and the block scale
  (:func:`_e2m1_to_bf16_fragments`), one wgmma per 128 of K; NVFP4's tensor scale
  multiplies the float32 sums in the epilogue.

The weight is rounded to bf16 once per element (``bf16(c) * bf16(s)``, exact inputs, one
rounding), as the XLA path's dequantization does; products accumulate in float32. With
``scale_accumulator`` (small M) the codes multiply x exactly and each group's float32
partial product is multiplied by its scale instead: no rounding of the weight at all.
f16 scales (GPTQ's, AWQ's) multiply the codes in float32 (exact), rounded once to bf16.

Jax's Pallas Triton backend is deprecated in favour of Mosaic GPU (JAX 0.11); this is the
project's first Mosaic GPU kernel and registers with the dispatcher like the others.
Mosaic GPU has no interpret mode that runs this kernel on the CPU (its GPU interpreter
lacks layout casts and stalls on the warp-specialized pipeline), so CPU tests lower it for
CUDA without running it, and tests/test_int4_nk.py runs it on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common
from qjax._src import fp4_nk
from qjax._src import int4_nk
from qjax._src import moe
from qjax._src import stacked as stacked_lib
from qjax._src import tuning

_CHAIN = plgpu.PipelinePipeline  # pipeline_state values of chained tiles

# Shared memory for the pipeline and the epilogue's buffers (the H100 allows 227 KiB per
# block; the rest is barriers). Stage counts of K steps up to 128 wide were measured with
# _SMEM_BUDGET; the wide steps of small M (two stages of 512 at 64 rows of x take 225 KiB)
# may use up to _SMEM_MAX.
_SMEM_BUDGET = 220 * 1024
_SMEM_MAX = 226 * 1024

# Row tiles up to this many rows of x take K steps of 256 or 512 (config_for).
_WIDE_K_MAX_TILE_M = 64
# ... and up to this many apply the group scales to float32 partial products.
_SCALE_ACC_MAX_TILE_M = 32
# Row tiles of this many rows multiply with mma.sync instead of wgmma (config_for).
_MMA_SYNC_TILE_M = 8
# K a CTA with one tile keeps in flight at most (wide steps; config_for).
_UNCHAINED_K_IN_FLIGHT = 1536
# config_for's K splits for FP4 whose K is not a multiple of 128: (splits, K step), the
# most splits first; a split must be a multiple of its step.
_ODD_FP4_SPLITS = ((5, 192), (3, 320))

# The FP4 formats the kernel takes, by the name config_for and _kernel_call know them.
_FP4_FORMATS = {"mxfp4": fp4_nk.MXFP4NKWeight, "nvfp4": fp4_nk.NVFP4NKWeight}


# K per pipeline step (:class:`WgmmaConfig`, defined with the tuning table that stores it).
_TILE_K = tuning.WGMMA_TILE_K
WgmmaConfig = tuning.WgmmaConfig


def supported(device: jax.Device) -> bool:
  """wgmma is an sm_90a instruction: NVIDIA Hopper (H100, H200) only."""
  if device.platform != "gpu":
    return False
  cc = getattr(device, "compute_capability", None)
  try:
    return cc is not None and float(cc) == 9.0
  except (TypeError, ValueError):
    return False


def _round_up(a: int, b: int) -> int:
  return -(-a // b) * b


def _groups_per_step(tile_k: int, group_size: int) -> int:
  """Scale rows a pipeline step reads: tile_k // group_size, at least 1."""
  return max(1, tile_k // group_size)


def _k_steps(k: int, cfg: WgmmaConfig) -> int:
  """Pipeline steps of one output tile: its split of K in ``tile_k`` slices."""
  return k // cfg.split_k // cfg.tile_k


def config_for(m: int, k: int, n: int, group_size: int, num_sms: int = 132, *,
               fp4: str | None = None, group_bytes: int = 2) -> WgmmaConfig:
  """The configuration for an ``[m, k] x [k, n]`` problem: from the H100 sweeps recorded
  in BENCHMARKS.md (sessions 16-18); shapes not measured get the nearest rule.

  ``fp4``: "mxfp4" or "nvfp4" for an :class:`qjax.MXFP4NKWeight` or
  :class:`qjax.NVFP4NKWeight` (``group_size`` is ignored): tiled as INT4 with groups of
  128, since their one-byte block scales (per 32 or 16 of K) are multiplied into the
  weights as they are converted, one wgmma per 128 of K. ``group_bytes``: INT4's bytes
  per group and column in a pipeline stage (:func:`_scale_args`: 2 for bf16 or f16 scales,
  one more with zero points).
  """
  scale_args = (_FP4_FORMATS[fp4].block_size, 1) if fp4 else (group_size, group_bytes)
  if fp4:  # steps of 128 where they divide K, else of 64 (GPT-OSS: K = 2880)
    group_size = 128 if k % 128 == 0 else 64
  tile_k = 128 if group_size % 128 == 0 else 64
  if m > 128:
    tiles_256 = -(-m // 256) * (n // 128)
    tile_m = 256 if m >= 512 or tiles_256 >= num_sms // 2 else 128
    if tile_m == 256:
      tile_k = 64
  else:
    tile_m = min(128, _round_up(max(m, 8), 8))
  epi_m = 64 if tile_m % 64 == 0 else tile_m
  cfg = WgmmaConfig(tile_n=64, tile_m=tile_m, tile_k=tile_k, stages=2, epi_m=epi_m)
  tiles = -(-m // tile_m) * (n // (cfg.consumers * cfg.tile_n))
  split_k = 1
  odd_fp4 = fp4 is not None and group_size == 64 and tile_m <= _WIDE_K_MAX_TILE_M
  if odd_fp4:
    # FP4 with K not a multiple of 128 (GPT-OSS: 2880) in splits of 5 (3 steps of 192) or
    # 3 (3 of 320) where the tiles are few (session 24, H100, MXFP4 M = 1 / 16, us):
    # 2880x1024 9.6 / 10.7 unsplit, 6.1 / 6.7 in 3, 5.3 / 5.8 in 5; 2880x2944 9.9 / 11.0,
    # 6.6 / 7.2, 5.9 / 6.6; 2880x5120 (200 CTAs in 5) 10.0 / 11.3, 7.5 / 8.3, 8.9 / 10.2.
    split_k = next((s for s, step in _ODD_FP4_SPLITS
                    if tiles * s <= num_sms and k % (s * step) == 0), 1)
  while (not odd_fp4 and tiles * split_k * 2 <= num_sms
         and k % (split_k * 2 * group_size) == 0 and k // (split_k * 2) // tile_k >= 4):
    split_k *= 2
  cfg = dataclasses.replace(cfg, split_k=split_k)
  budget = _SMEM_BUDGET
  if tile_m <= _WIDE_K_MAX_TILE_M:
    # Wider K steps read longer rows of W^T per TMA copy (tile_k / 2 bytes): session 18's
    # sweep at M <= 64 took 512 or 256 (4-21 % less time than 128). 512 where three
    # stages fit (session 21: at M = 64, where only two do, four of 256 took 5-6 % less).
    wides = ((512, 3), (256, 2))
    if odd_fp4:
      # Steps of 320 (160-byte rows) where they divide the split, else of 192 (session
      # 24, H100, MXFP4 2880x5120 / 2880x11520 unsplit, M = 1, 16, 64: 9.9 / 10.8, 11.2 /
      # 12.1, 14.2 / 15.3 us against 13.7 / 14.2, 14.1 / 14.6, 16.9 / 17.7 with steps of
      # 64; 192 and 576 were within -5..+6 % of 320).
      wides = ((320, 2), (192, 2))
    for wide, min_stages in wides:
      wide_cfg = dataclasses.replace(cfg, tile_k=wide)
      if (k // split_k % wide == 0 and group_size % 64 == 0
          and (wide % group_size == 0 or group_size % wide == 0)
          and min_stages * wide_cfg.stage_bytes(*scale_args) + cfg.epilogue_bytes()
          <= _SMEM_MAX):
        cfg, budget = wide_cfg, _SMEM_MAX
        break
  stages = (budget - cfg.epilogue_bytes()) // cfg.stage_bytes(*scale_args)
  stages = max(2, min(4 if tile_m == 256 else 8, stages))
  steps = _k_steps(k, cfg)
  if tiles * split_k <= num_sms and cfg.tile_k > 128:
    # One tile per CTA: the loads in flight at the end arrive together and their compute
    # follows the last byte, so a CTA keeps 1024-1536 of K in flight (session 21, H100,
    # M = 1 / 16 on the three smaller shapes: 3 stages of 512 or 4 of 256 took 5-10 % less
    # time than 4 of 512; the chained tiles of 8192x28672 keep 4 of 512).
    stages = min(stages, _UNCHAINED_K_IN_FLIGHT // cfg.tile_k)
    if odd_fp4:  # three stages (session 24: 4 of 320 were 1-5 % slower at N = 11520)
      stages = min(stages, 3)
  if tiles * split_k > num_sms and cfg.tile_k > 128:
    # Wide steps drop to the deepest pipeline that divides the K steps, so that the tiles
    # chain (session 18, M = 1 / 32 on 8192x28672: 4 stages chained 45.5 / 51.8 us against
    # 5 / 3 unchained 49.9 / 53.5).
    divisors = [d for d in range(stages, 1, -1) if steps % d == 0]
    stages = divisors[0] if divisors else stages
  # Chain the tiles of a CTA where some CTA has two or more and the stages divide the K
  # steps (session 17 A/B: 2-6.5 % faster there; forcing it elsewhere, with fewer stages
  # or one tile per CTA, was up to 8 % slower).
  chain = _chains(tiles, split_k, steps, stages, num_sms)
  # Scales on the float32 side where the accumulator is small (session 18: 1-5 % less time
  # at M <= 32 on all four shapes, 4-26 % more at M = 64).
  scale_acc = tile_m <= _SCALE_ACC_MAX_TILE_M and not fp4
  # mma.sync in place of wgmma where x is one tile of 8 rows (session 23, H100, M = 1 on
  # the four shapes: 0.6-4.9 % less time for INT4, 2.2-7.1 % for MXFP4 and NVFP4; at M =
  # 16 0.6-1.1 % more, at M = 32 9 % more).
  mma_sync = tile_m == _MMA_SYNC_TILE_M
  return dataclasses.replace(cfg, stages=stages, chain_tiles=chain, scale_accumulator=scale_acc,
                             mma_sync=mma_sync)


def _scale_args(w: Any) -> tuple[int, int]:
  """:meth:`WgmmaConfig.stage_bytes`'s ``(group_size, scale_bytes)`` for the weight ``w``:
  FP4's one-byte block scales, or INT4's 16-bit scales and, where it has them, its
  one-byte zero points."""
  if _fp4_name(w):
    return w.block_size, 1
  return w.group_size, jnp.dtype(w.scales.dtype).itemsize + (w.zeros is not None)


def _chains(tiles: int, split_k: int, steps: int, stages: int, num_sms: int) -> bool:
  """config_for's ``chain_tiles``: where some CTA runs two or more of the ``tiles`` (times
  the K splits) and the ``stages`` divide a tile's K ``steps``."""
  return tiles * split_k > num_sms and steps % stages == 0


# The tuner's search space (:func:`candidate_configs`): K kept in flight per CTA (stages
# times tile_k; config_for keeps 768-2048), K splits, and the stage counts tried.
_CANDIDATE_K_IN_FLIGHT = (768, 1024, 1536, 2048)
_CANDIDATE_SPLITS = (1, 2, 4, 8)
_CANDIDATE_STAGES = (2, 3, 4, 6, 8)


def abstract_weight(k: int, n: int, *, group_size: int = 128, fp4: str | None = None,
                    zero_points: bool = False, scale_dtype: Any = jnp.bfloat16) -> Any:
  """An abstract ``[k, n]`` Int4NKWeight (``scale_dtype`` scales per ``group_size``; uint8
  zero points with ``zero_points``), or MXFP4NKWeight / NVFP4NKWeight for ``fp4``: arrays
  as ``jax.ShapeDtypeStruct``, for checking configurations without a weight."""
  codes = jax.ShapeDtypeStruct((n, k // 8), jnp.uint32)
  if fp4 is None:
    groups = (k // group_size, n)
    return int4_nk.Int4NKWeight(
        codes=codes, scales=jax.ShapeDtypeStruct(groups, scale_dtype), shape=(k, n),
        group_size=group_size,
        zeros=jax.ShapeDtypeStruct(groups, jnp.uint8) if zero_points else None)
  cls = _FP4_FORMATS[fp4]
  extra = {"global_scale": jax.ShapeDtypeStruct((), jnp.float32)} if fp4 == "nvfp4" else {}
  return cls(codes=codes, scales=jax.ShapeDtypeStruct((k // cls.block_size, n),
                                                      cls.scale_dtype),
             shape=(k, n), **extra)


def config_error(m: int, w: Any, cfg: WgmmaConfig) -> str | None:
  """Why ``cfg`` cannot run ``m`` rows of bf16 x times ``w`` (one weight; arrays may be
  abstract): what :func:`int4_nk_matmul` / :func:`fp4_nk_matmul` would raise, or shared
  memory past the block's limit; None where it runs."""
  try:
    _check(jax.ShapeDtypeStruct((m, w.shape[0]), jnp.bfloat16), w, cfg)
  except NotImplementedError as e:
    return str(e)
  scale_args = _scale_args(w)
  smem = cfg.stages * cfg.stage_bytes(*scale_args) + cfg.epilogue_bytes()
  if smem > _SMEM_MAX:
    return (f"{cfg.stages} stages of {cfg.stage_bytes(*scale_args)} bytes and an epilogue "
            f"of {cfg.epilogue_bytes()} take {smem} bytes of shared memory, more than "
            f"{_SMEM_MAX}")
  return None


def candidate_configs(m: int, w: Any, num_sms: int = 132) -> list[WgmmaConfig]:
  """The configurations ``qjax bench --tune`` times for ``m`` rows of x times ``w`` (one
  weight; arrays may be abstract): :func:`config_for`'s choice first, then its row
  tile with each column tile (64, 128 rows of W^T per warpgroup), K step, K split and
  stage count that runs (:func:`config_error`) and keeps 768-2048 of K in flight per
  CTA, each with the tile chaining, scale placement and mma.sync choice of
  :func:`config_for`'s rules."""
  k, n = w.shape
  fp4 = _fp4_name(w)
  base = default_config(m, w, num_sms, table=False)
  odd_fp4 = fp4 is not None and k % 128
  tile_ks = (192, 320) if odd_fp4 else (128, 256, 512)
  out = [base]
  for tile_n in (64, 128):
    if n % (base.consumers * tile_n):
      continue
    tiles = -(-m // base.tile_m) * (n // (base.consumers * tile_n))
    for tile_k in tile_ks:
      for split_k in _CANDIDATE_SPLITS:
        if split_k > 1 and tiles * split_k > 2 * num_sms:
          continue
        for stages in _CANDIDATE_STAGES:
          if stages * tile_k not in _CANDIDATE_K_IN_FLIGHT:
            continue
          steps = k // split_k // tile_k
          if steps < 2:
            continue
          cfg = dataclasses.replace(
              base, tile_n=tile_n, tile_k=tile_k, split_k=split_k, stages=stages,
              chain_tiles=_chains(tiles, split_k, steps, stages, num_sms))
          if cfg not in out and config_error(m, w, cfg) is None:
            out.append(cfg)
  return out


def abstract_table_weight(fmt: str, k: int, n: int) -> Any:
  """:func:`abstract_weight` of the tuning table's format ``fmt`` (a :data:`TABLE_FORMATS`
  name; INT4 with groups of 128, as ``qjax bench`` builds them)."""
  cls = next(c for c, name in TABLE_FORMATS.items() if name == fmt)
  return abstract_weight(k, n, fp4=next(
      (name for name, c in _FP4_FORMATS.items() if c is cls), None))


def tuner_candidates(fmt: str) -> Callable[[int, int, int], list[WgmmaConfig]]:
  """``Backend.candidate_configs`` of the ``fmt`` layout (a :data:`TABLE_FORMATS` name):
  ``(m, k, n) ->`` :func:`candidate_configs` of :func:`abstract_table_weight` on this
  device's SMs."""
  def candidates(m: int, k: int, n: int) -> list[WgmmaConfig]:
    return candidate_configs(m, abstract_table_weight(fmt, k, n), _grid_sms(False, None))

  return candidates


def _fp4_name(w: Any) -> str | None:
  """"mxfp4" or "nvfp4" for the FP4 formats (:data:`_FP4_FORMATS`), else None."""
  return next((name for name, cls in _FP4_FORMATS.items() if isinstance(w, cls)), None)


# The tuning table's format name of each weight class the kernel takes (the exact class:
# a registered subclass gets config_for's heuristics, as the Triton kernels' subclasses do).
TABLE_FORMATS = {int4_nk.Int4NKWeight: "int4nk", fp4_nk.MXFP4NKWeight: "mxfp4nk",
                 fp4_nk.NVFP4NKWeight: "nvfp4nk"}


def default_config(m: int, w: Any, num_sms: int = 132, *, table: bool = True
                   ) -> WgmmaConfig:
  """The configuration the kernel runs ``m`` rows of x times the weight ``w`` (an
  Int4NKWeight, MXFP4NKWeight or NVFP4NKWeight) with when none is given: the tuning
  table's entry for this device kind, format (:data:`TABLE_FORMATS`), M's bucket, K and N
  (``qjax bench --tune``), where ``table`` is set, ``num_sms`` is the device's SM count
  (the grid the entry was timed on) and the entry runs this weight (:func:`config_error`:
  an entry tuned on groups of 128 may not fit other group sizes); else
  :func:`config_for`."""
  if table:
    tuned = _table_config(m, w, num_sms)
    if tuned is not None:
      return tuned
  k, n = w.shape
  fp4 = _fp4_name(w)
  group_size, group_bytes = _scale_args(w)
  return config_for(m, k, n, group_size, num_sms, fp4=fp4, group_bytes=group_bytes)


def _table_device() -> Any:
  """The device whose kind and SM count key the tuning table (the first, as the Triton
  kernels' lookups take)."""
  return jax.devices()[0]


def _table_config(m: int, w: Any, num_sms: int) -> WgmmaConfig | None:
  """The table entry :func:`default_config` runs, or None."""
  fmt = TABLE_FORMATS.get(type(w))
  device = _table_device()
  if fmt is None or getattr(device, "core_count", None) != num_sms:
    return None
  cfg = tuning.lookup(device.device_kind, fmt, m, *w.shape)
  if cfg is None or config_error(m, w, cfg) is not None:
    return None
  return cfg


def _check(x: jax.Array, w: Any, cfg: WgmmaConfig) -> None:
  """NotImplementedError (the dispatcher falls back to XLA) for what the kernel lacks."""
  if not isinstance(w, (int4_nk.Int4NKWeight, *_FP4_FORMATS.values())):
    raise NotImplementedError(
        "the wgmma kernel takes an Int4NKWeight, MXFP4NKWeight or NVFP4NKWeight, got "
        f"{type(w).__name__}")
  if w.codes.ndim != 2:
    raise NotImplementedError(
        "the wgmma kernel takes one weight, not a stack (qjax.layer_of names one layer of "
        "it)")
  if x.dtype != jnp.bfloat16:
    raise NotImplementedError(
        f"x.dtype={jnp.dtype(x.dtype).name}: the wgmma kernel converts 4-bit codes to bf16 "
        "and takes bf16 activations")
  _check_steps(w, cfg)
  _check_n(w.shape[1], cfg)


def _check_steps(w: Any, cfg: WgmmaConfig) -> None:
  """NotImplementedError where ``cfg``'s K steps, splits and scale handling do not fit one
  weight ``w`` (the dense kernel and, per expert, the MoE kernel; N is checked apart)."""
  k = w.shape[0]
  if _fp4_name(w):
    _check_fp4_steps(k, cfg)
    return
  if cfg.tile_k & (cfg.tile_k - 1):
    raise NotImplementedError(f"tile_k={cfg.tile_k}: INT4 steps are powers of two")
  if cfg.mma_sync and not cfg.scale_accumulator:
    raise NotImplementedError("mma_sync with INT4 needs scale_accumulator=True (each "
                              "group's mma.sync product is scaled in float32)")
  if w.scales.dtype not in _SCALE_DTYPES:
    raise NotImplementedError(
        f"scales of dtype {jnp.dtype(w.scales.dtype).name}: the kernel takes bf16 or f16 "
        "scales")
  if w.group_size % 64:
    raise NotImplementedError(
        f"group_size={w.group_size}: the kernel's wgmma steps take groups of 64 or a "
        "multiple of 64")
  if w.group_size % cfg.tile_k and cfg.tile_k % w.group_size:
    raise NotImplementedError(
        f"group_size={w.group_size} is neither a multiple nor a divisor of "
        f"tile_k={cfg.tile_k}")
  if (k // cfg.split_k) % cfg.tile_k:
    raise NotImplementedError(
        f"K={k} split {cfg.split_k} ways is not a multiple of tile_k={cfg.tile_k}")
  if k % (cfg.split_k * w.group_size):
    raise NotImplementedError(f"K={k} is not a multiple of split_k * group_size = "
                              f"{cfg.split_k * w.group_size}")
  _check_chain(k, cfg)


# INT4 scale dtypes the kernel takes: bf16 multiplies the bf16 codes; f16 (GPTQ's and AWQ's)
# multiplies in float32 (exact: a code of 4 bits times 11), then rounds once to bf16, as
# the XLA path's dequantization does; on the float32 side (scale_accumulator) either is exact.
_SCALE_DTYPES = (jnp.bfloat16, jnp.float16)


def _check_chain(k: int, cfg: WgmmaConfig) -> None:
  if cfg.chain_tiles and _k_steps(k, cfg) % cfg.stages:
    raise NotImplementedError(
        f"chain_tiles needs stages={cfg.stages} to divide the {_k_steps(k, cfg)} K steps "
        "of a tile")


def _check_fp4_steps(k: int, cfg: WgmmaConfig) -> None:
  """NotImplementedError where ``cfg``'s K steps do not fit an FP4 weight of K rows."""
  if cfg.scale_accumulator:
    raise NotImplementedError("scale_accumulator: FP4 block scales are applied to the "
                              "weights as they are converted; use scale_accumulator=False")
  if (k // cfg.split_k) % cfg.tile_k or k % cfg.split_k:
    raise NotImplementedError(
        f"K={k} split {cfg.split_k} ways is not a multiple of tile_k={cfg.tile_k}")
  _check_chain(k, cfg)


def _check_n(n: int, cfg: WgmmaConfig) -> None:
  if n % (cfg.consumers * cfg.tile_n):
    raise NotImplementedError(f"N={n} is not a multiple of consumers * tile_n = "
                              f"{cfg.consumers * cfg.tile_n}")


# Rows of x at which :func:`declines` checks the default configurations: one or more per
# rule of config_for (mma.sync, wide K steps, scales on the accumulator, K splits, tiles
# of 128 and 256 rows).
_DECLINES_CHECK_M = (1, 8, 16, 32, 64, 128, 256, 512, 2048)


def _one_layer(w: Any) -> Any:
  """``w`` with its leading (layer or expert) axes dropped, as abstract arrays."""
  lead = w.codes.ndim - 2
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype), w)


def _declines_dtype(dtype: Any) -> str | None:
  if jnp.dtype(dtype) != jnp.bfloat16:
    return (f"x.dtype={jnp.dtype(dtype).name}: the wgmma kernel converts 4-bit codes to "
            "bf16 and takes bf16 activations")
  return None


def declines(w: Any, dtype: Any) -> str | None:
  """Why :func:`int4_nk_matmul` / :func:`fp4_nk_matmul` would raise NotImplementedError
  for ``w`` (one weight, or a stack under ``qjax.layer_of``; arrays may be abstract) and
  x of ``dtype`` at some M of its default configurations; None where it runs every M
  (``qjax.Backend.declines``)."""
  reason = _declines_dtype(dtype)
  if reason is not None:
    return reason
  layer = _one_layer(w)
  num_sms = _grid_sms(False, None)
  for m in _DECLINES_CHECK_M:
    try:
      _check(jax.ShapeDtypeStruct((m, w.shape[0]), jnp.bfloat16), layer,
             default_config(m, layer, num_sms))
    except NotImplementedError as e:
      return f"M={m}: {e}"
  return None


# bf16 136.0 in both halves: 0x4300 (128.0) with the code's nibble (two's complement,
# bit 3 flipped, i.e. q + 8) in the low mantissa bits is 136 + q.
_BF16X2_136 = 0x43084308
_LOP3_AND_XOR = 0x6A  # LOP3 truth table of (a & b) ^ c (a = 0xF0, b = 0xCC, c = 0xAA)


def _to_bf16_fragments(w, first_run: int = 0, runs: int | None = None, zeros=None):
  """``w``: int4 ``[tile_n, tile_k]`` loaded in the WGMMA_UPCAST_4X layout (thread ``c``
  of each four-thread row group holds word ``c`` of every 32-code run of its two rows)
  -> bf16 codes ``[tile_n, 32 * runs]`` of the 32-code runs ``first_run ..
  first_run + runs - 1`` (default: all) in wgmma's register operand layout: ``c = q - 8``,
  or ``q - z`` with ``zeros`` (uint8 ``[tile_n]`` zero points ``z`` of the runs' group, in
  the WGMMA row layout).

  The format stores each run so that nibbles ``i`` and ``i + 4`` of a word are the
  thread's K pair of the run's 8-column tile ``i`` (``int4_nk.SLOT_TO_K``): a shift by
  ``4i`` and one LOP3 (mask both nibbles, flip their sign bits, or in bf16 128.0) make
  ``136 + q`` in both halves of a register, and one ``sub.bf16x2`` makes ``q``: per pair
  two integer instructions (one for ``i = 0``) and one bf16 one, where Mosaic's own
  conversion after its relayout from the plain order took a lane shuffle and four integer
  instructions (session 17 profile, BENCHMARKS.md). With zero points the subtrahend is
  ``128 + z`` (bf16, both halves, made once per row and group by
  :data:`_ZERO_TO_BF16X2`) instead of 136: the same instructions per pair.
  """
  if runs is None:
    runs = w.shape[1] // int4_nk.CHUNK - first_run
  shape = (w.shape[0], runs * int4_nk.CHUNK)
  rows = () if zeros is None else (plgpu.Layout.WGMMA.reduce(1),)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, *rows),
      return_type=plgpu.ShapeDtypeStruct(shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA))
  def convert(ctx, w4, *zero_rows):
    del ctx
    from jax._src.lib.mlir.dialects import llvm  # pylint: disable=g-import-not-at-top
    zero2 = _row_bf16x2(zero_rows[0], _ZERO_TO_BF16X2) if zero_rows else {}

    def pair(word, i32, idx, i):
      shift = f"shr.u32 t, $1, {4 * i};" if i else "mov.b32 t, $1;"
      head = (f"{{ .reg .b32 t, u, b; {shift} "
              f"lop3.b32 u, t, 0x000F000F, {_BF16X2_136:#010x}, {_LOP3_AND_XOR:#04x}; ")
      if not zero2:
        return llvm.inline_asm(
            i32, [word],
            head + f"mov.b32 b, {_BF16X2_136:#010x}; sub.bf16x2 $0, u, b; }}", "=r,r")
      return llvm.inline_asm(i32, [word, zero2[(idx[0], idx[4])]],
                             head + "sub.bf16x2 $0, u, $2; }", "=r,r,r")

    return _pairs_to_fragments(w4, shape, first_run, runs, pair)

  return convert(w, *(() if zeros is None else (zeros,)))


def _row_bf16x2(row, ptx: str) -> dict:
  """Inside ``plgpu.inline_mgpu``: each register of ``row`` (uint8 ``[tile_n]`` in the
  WGMMA row layout: a zero-point or block-scale row) zero-extended to i32 and turned by
  the inline PTX ``ptx`` (``$1`` -> ``$0``) into an i32 of two bf16, keyed by (row tile,
  row half): entries 0 and 4 of a WGMMA_UPCAST_4X register index (row tile, run, 1, 1,
  row half), as a row's registers are (row tile, 1, row half, ...)."""
  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax._src.lib.mlir.dialects import llvm
  from jax._src.lib.mlir.dialects import vector
  i32 = ir.IntegerType.get_signless(32)
  return {(idx[0], idx[2]): llvm.inline_asm(
              i32, [arith.extui(i32, vector.extract(reg, [], [0]))], ptx, "=r,r")
          for idx, reg in np.ndenumerate(row.registers)}


# PTX of one zero point byte (``$1``, zero-extended) -> bf16 ``128 + z`` in both halves
# (0x4300 is 128.0, whose last mantissa bit is worth 1).
_ZERO_TO_BF16X2 = ("{ .reg .b32 a, b; or.b32 a, $1, 0x4300; shl.b32 b, a, 16; "
                   "or.b32 $0, a, b; }")


def _pairs_to_fragments(w4, shape, first_run: int, runs: int, pair):
  """Inside ``plgpu.inline_mgpu``: the WGMMA-layout bf16 array ``shape`` whose register
  for K pair ``i`` (0..3) of each 32-code run ``first_run ..`` is ``pair(word, i32, idx,
  i)``, an i32 of two bf16 made from the run's 32-bit register ``word`` of ``w4`` (the
  WGMMA_UPCAST_4X codes; ``idx`` its register index: row tile, run, 1, 1, row half)."""
  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic import gpu as mgpu
  from jax._src.lib.mlir import ir
  fa = mgpu.fragmented_array
  i32 = ir.IntegerType.get_signless(32)
  bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
  regs = np.empty(fa.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
  for idx, reg in np.ndenumerate(w4.registers):  # idx[1]: the 32-code run
    run = idx[1] - first_run
    if not 0 <= run < runs:
      continue
    word = mgpu.utils.bitcast(reg, i32)
    for i in range(4):
      regs[(idx[0], run * 4 + i, *idx[2:])] = mgpu.utils.bitcast(pair(word, i32, idx, i),
                                                                 bf16x2)
  return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


# E2M1 -> bf16 (see _e2m1_to_bf16_fragments): the bf16 bits of a code's exponent and
# mantissa (8, 7, 6) and sign (15), in both halves; those of pair 3's codes that the stored
# word holds in place (8, 7, 15), and its mantissa's (6); 2**126 in bf16, both halves.
_E2M1_BITS = 0x81C081C0
_E2M1_PAIR3_IN_PLACE = 0x81808180
_E2M1_PAIR3_MANTISSA = 0x00400040
_BF16X2_2_126 = 0x7E807E80
_LOP3_AND_OR_C = 0xEA  # LOP3 truth table of (a & b) | c (a = 0xF0, b = 0xCC, c = 0xAA)


# PTX of one block scale byte (``$1``, zero-extended) -> the bf16 factor of its weights,
# in both halves.
_SCALE_TO_BF16X2 = {
    # E8M0: the byte is bf16's exponent field, 2 ** (e - 127).
    "mxfp4": "{ .reg .b32 a, b; shl.b32 a, $1, 7; shl.b32 b, $1, 23; or.b32 $0, a, b; }",
    # float8_e4m3fn: Hopper's converter to f16 (exact), then f32, times 2 ** 118 (E2M1's
    # bias 2 ** 126 less the 2 ** 8 the epilogue restores: every finite scale, 2 ** -9 ..
    # 448, stays a normal bf16, and so do the weights, 2 ** -18 .. 10.5), then bf16
    # (exact: 3 bits of mantissa).
    "nvfp4": ("{ .reg .b16 e, lo, hi, b; .reg .b32 h; .reg .f32 f; cvt.u16.u32 e, $1; "
              "cvt.rn.f16x2.e4m3x2 h, e; mov.b32 {lo, hi}, h; cvt.f32.f16 f, lo; "
              "mul.rn.f32 f, f, 0f7A800000; cvt.rn.bf16.f32 b, f; mov.b32 $0, {b, b}; }"),
}
# Formats whose scale factor above carries E2M1's bias (no separate multiply by 2 ** 126),
# and the power of two their weights are short of, restored on the float32 sums.
_FOLDED_BIAS_SHIFT = {"nvfp4": 8}


def _e2m1_pair_ptx(i: int, fp4: str) -> str:
  """PTX of pair ``i`` (0..3) of a stored FP4 NK word (``$1``; :data:`qjax._src.fp4_nk.
  STORED_BIT`) times the scale factor ``$2`` (bf16x2, :data:`_SCALE_TO_BF16X2`) -> ``$0``,
  the pair's two bf16 weights (see :func:`_e2m1_to_bf16_fragments`)."""
  if i < 3:  # one rotation places all eight bits
    bits = (f"shf.l.wrap.b32 b, $1, $1, {fp4_nk.PAIR_ROTATION[i]}; "
            f"and.b32 b, b, {_E2M1_BITS:#010x}; ")
  else:  # six bits in place, the mantissas 8 above theirs
    bits = (f"shr.u32 u, $1, 8; and.b32 u, u, {_E2M1_PAIR3_MANTISSA:#010x}; "
            f"lop3.b32 b, $1, {_E2M1_PAIR3_IN_PLACE:#010x}, u, {_LOP3_AND_OR_C:#04x}; ")
  bias = ("" if fp4 in _FOLDED_BIAS_SHIFT
          else f"mov.b32 c, {_BF16X2_2_126:#010x}; mul.rn.bf16x2 b, b, c; ")
  return f"{{ .reg .b32 u, b, c; {bits}{bias}mul.rn.bf16x2 $0, b, $2; }}"


def _e2m1_to_bf16_fragments(w, scales, first_run: int, runs: int, fp4: str):
  """``w``: E2M1 codes ``[tile_n, tile_k]`` (as int4 bits) in the WGMMA_UPCAST_4X layout,
  in :class:`qjax.MXFP4NKWeight`'s fragment order; ``scales``: the block scale rows
  ``[tile_n]`` (uint8 bits) of the runs in the WGMMA row layout, one per 32-code run for
  MXFP4 (E8M0), two for NVFP4 (float8_e4m3fn; pairs 0, 1 of a register take the first)
  -> bf16 weights ``[tile_n, 32 * runs]`` of the runs ``first_run ..`` in wgmma's
  register operand layout, each ``e2m1(q) * scale``, exact.

  Per pair of codes (nibbles ``i`` and ``i + 4`` of a fragment-order word, as for INT4,
  whose bits the format stores where :data:`qjax._src.fp4_nk.STORED_BIT` says): for pairs 0
  to 2 a rotation and an AND put both codes' exponent and mantissa bits at bf16 bits 8..6
  and their signs at bit 15; for pair 3 a shift, an AND and a LOP3 (the mantissas move,
  the rest is in place). That is E2M1 times 2 ** -126 (exponent bias 1 against bf16's
  127; E2M1's subnormal 0.5 is bf16's subnormal 2 ** -127), and exact multiplies follow.
  MXFP4: by ``2 ** 126``, then by the scale ``e << 7``, bf16 ``2 ** (e - 127)`` (``e =
  0`` gives 0 instead of ``2 ** -127``, ``e = 255`` infinity instead of NaN). NVFP4: one
  multiply by the scale times ``2 ** 118`` (:data:`_SCALE_TO_BF16X2`, NaN stays NaN), so
  its weights come out ``2 ** -8`` of their value (:data:`_FOLDED_BIAS_SHIFT`; the
  epilogue multiplies the sums back with the tensor scale).
  """
  per_run = len(scales) // runs
  shape = (w.shape[0], runs * int4_nk.CHUNK)
  row = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,) + (row,) * len(scales),
      return_type=plgpu.ShapeDtypeStruct(shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA))
  def convert(ctx, w4, *scale_rows):
    del ctx
    from jax._src.lib.mlir.dialects import llvm  # pylint: disable=g-import-not-at-top
    scale2 = [_row_bf16x2(rows, _SCALE_TO_BF16X2[fp4]) for rows in scale_rows]

    def pair(word, i32, idx, i):
      s2 = scale2[(idx[1] - first_run) * per_run + i * per_run // 4][(idx[0], idx[4])]
      return llvm.inline_asm(i32, [word, s2], _e2m1_pair_ptx(i, fp4), "=r,r,r")

    return _pairs_to_fragments(w4, shape, first_run, runs, pair)

  return convert(w, *scales)


def _step_groups(w_smem, x_smem, sub: int, convert=None):
  """Yields, per ``sub`` of K of a pipeline step (a scale group of INT4), its index, its
  codes as bf16 wgmma fragments ``[tile_n, sub]`` and its x columns transposed for
  wgmma's B operand. ``convert(w4, j, first_run, runs)`` makes the fragments (default:
  INT4's :func:`_to_bf16_fragments`). The W tile is loaded from shared memory once, before
  the first."""
  tile_k = w_smem.shape[1]
  with jax.named_scope("smem_load"):
    w4 = plgpu.layout_cast(w_smem[...], plgpu.Layout.WGMMA_UPCAST_4X)
  runs = sub // int4_nk.CHUNK
  for j in range(tile_k // sub):
    with jax.named_scope("convert"):
      if convert is None:
        w = _to_bf16_fragments(w4, j * runs, runs)
      else:
        w = convert(w4, j, j * runs, runs)
    x = x_smem if sub == tile_k else x_smem.at[:, pl.ds(j * sub, sub)]
    yield j, w, x.transpose((1, 0))


def _zero_point_converter(z_smem):
  """The ``convert`` of :func:`_step_groups` for an INT4 step with zero points ``z_smem``
  (uint8 ``[groups, tile_n]``, one row per group of the step; None: symmetric, the
  default conversion)."""
  if z_smem is None:
    return None

  def convert(w4, j, first_run, runs):
    z = plgpu.layout_cast(z_smem.at[j][...], plgpu.Layout.WGMMA.reduce(1))
    return _to_bf16_fragments(w4, first_run, runs, z)

  return convert


def _fp4_converter(s_smem, fp4: str):
  """The ``convert`` of :func:`_step_groups` for an FP4 step whose block scale bits are
  ``s_smem`` (uint8 ``[tile_k // B, tile_n]``): :func:`_e2m1_to_bf16_fragments` with the
  runs' scale rows."""
  per_run = int4_nk.CHUNK // _FP4_FORMATS[fp4].block_size

  def convert(w4, j, first_run, runs):
    del j
    scales = [plgpu.layout_cast(s_smem.at[first_run * per_run + r][...],
                                plgpu.Layout.WGMMA.reduce(1)) for r in range(runs * per_run)]
    return _e2m1_to_bf16_fragments(w4, scales, first_run, runs, fp4)

  return convert


def _fp4_step(acc_ref, w_smem, s_smem, x_smem, fp4: str) -> None:
  """One pipeline step of a compute warpgroup for MXFP4 or NVFP4 (``fp4``): ``acc +=
  W^T x^T`` without the NVFP4 tensor scale, a wgmma per 128 of K (per 64 where 128 does
  not divide tile_k).

  w_smem: ``[tile_n, tile_k]`` E2M1 codes (int4 bits) in fragment order; s_smem:
  ``[tile_k // B, tile_n]`` uint8 block scale bits (B = 32 or 16); x_smem:
  ``[tile_m, tile_k]`` bf16; acc_ref: ``[tile_n, tile_m]`` float32.
  """
  sub = 128 if w_smem.shape[1] % 128 == 0 else 64
  for _, w, x_t in _step_groups(w_smem, x_smem, sub, _fp4_converter(s_smem, fp4)):
    with jax.named_scope("wgmma"):
      plgpu.wgmma(acc_ref, w, x_t)
  with jax.named_scope("wgmma_wait"):
    plgpu.wgmma_wait(0)


def _fp4_mma_sync_step(acc, w_smem, s_smem, x_smem, fp4: str, x_transforms):
  """:func:`_fp4_step` with :func:`_mma_sync_product` in place of wgmma: returns ``acc +
  W^T x^T`` (acc float32 ``[tile_n, tile_m]``, a value), one product per 128 of K."""
  sub = 128 if w_smem.shape[1] % 128 == 0 else 64
  for j, w, _ in _step_groups(w_smem, x_smem, sub, _fp4_converter(s_smem, fp4)):
    with jax.named_scope("mma"):
      acc = acc + _mma_sync_product(w, x_smem, j * sub, x_transforms)
  return acc


def _convert_and_multiply(acc_ref, w_smem, s_smem, x_smem, group_size: int,
                          z_smem=None) -> None:
  """One pipeline step of a compute warpgroup: ``acc += (W^T * s) x^T``.

  w_smem: ``[tile_n, tile_k]`` int4 in fragment order; s_smem: ``[groups, tile_n]`` bf16
  or f16 (the step's group scales, one row per ``group_size`` of K when tile_k spans
  several); x_smem: ``[tile_m, tile_k]`` bf16; acc_ref: ``[tile_n, tile_m]`` float32;
  z_smem: the step's zero points (uint8 ``[groups, tile_n]``) or None. With several
  groups per step each gets its own wgmma, issued before the next group's conversion so
  that the two overlap; one wait ends the step. The named scopes show in Mosaic GPU's
  profiler (``CompilerParams.profile_dir``; examples/wgmma_profile.py).
  """
  for j, w, x_t in _step_groups(w_smem, x_smem, min(w_smem.shape[1], group_size),
                                _zero_point_converter(z_smem)):
    with jax.named_scope("scale"):
      s = plgpu.layout_cast(s_smem.at[j][...], plgpu.Layout.WGMMA.reduce(1))
      if s.dtype == jnp.bfloat16:
        w = w * lax.broadcast_in_dim(s, w.shape, [0])
      else:  # f16: the exact product in float32, rounded once
        s = lax.broadcast_in_dim(s.astype(jnp.float32), w.shape, [0])
        w = (w.astype(jnp.float32) * s).astype(jnp.bfloat16)
    with jax.named_scope("wgmma"):
      plgpu.wgmma(acc_ref, w, x_t)
  with jax.named_scope("wgmma_wait"):
    plgpu.wgmma_wait(0)


def _multiply_then_scale(acc, w_smem, s_smem, x_smem, group_size: int, z_smem=None):
  """:func:`_convert_and_multiply` with the scales on the float32 side: returns
  ``acc + sum_g s_g * (W_g^T x_g^T)`` (acc ``[tile_n, tile_m]`` float32, a value), each
  group's product in its own zero-initialized accumulator."""
  groups = w_smem.shape[1] // min(w_smem.shape[1], group_size)

  def issue(*parts):
    groups_of_step = _step_groups(w_smem, x_smem, min(w_smem.shape[1], group_size),
                                  _zero_point_converter(z_smem))
    for (_, w, x_t), part in zip(groups_of_step, parts):
      with jax.named_scope("wgmma"):
        plgpu.wgmma(part, w, x_t)
    with jax.named_scope("wgmma_wait"):
      return tuple(part[...] for part in parts)

  parts = pl.run_scoped(issue, *[plgpu.ACC(acc.shape, jnp.float32) for _ in range(groups)])
  with jax.named_scope("scale"):
    for j, part in enumerate(parts):
      acc = _plus_scaled(acc, part, s_smem.at[j])
  return acc


def _plus_scaled(acc, part, scale_row):
  """``acc + part * s``: float32 ``[tile_n, tile_m]`` values, each row of ``part``
  times its group scale in ``scale_row`` (bf16 or f16 ``[tile_n]`` in shared memory)."""
  s = plgpu.layout_cast(scale_row[...], plgpu.Layout.WGMMA.reduce(1))
  return acc + part * lax.broadcast_in_dim(s.astype(jnp.float32), acc.shape, [0])


# PTX of one m16n8k16 bf16 product accumulated in float32: $0..$3 = D, $4..$7 = A (the
# weight's fragment), $8, $9 = B (x's), $10..$13 = C.
_MMA_M16N8K16 = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
_LDMATRIX_X4 = "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];"


def _mma_sync_product(w, x_smem, k_offset: int, x_transforms):
  """``w`` bf16 ``[tile_n, sub]`` (wgmma's register layout, :func:`_to_bf16_fragments`)
  times ``x[:, k_offset : k_offset + sub]^T`` -> float32 ``[tile_n, tile_m]`` in the
  WGMMA layout, by ``mma.sync.m16n8k16`` per warp.

  x_smem: ``[tile_m, tile_k]`` bf16 in tiles of 8 x 64 with the 128-byte swizzle (TMA's
  layout of the pipeline's x stage). Per warp, wgmma's register layout of a 64-row tile
  is four m16n8k16 A fragments (rows ``16 * warp ..``), and its float32 layout the C
  fragments of the same rows: only x's B fragments are loaded, by ``ldmatrix.x4`` (thread
  ``t`` points at row ``t % 8`` of the 8 x 8 matrix ``t // 8``; x's rows are mma's N).
  """
  tile_n, sub = w.shape
  tile_m, tile_k = x_smem.shape
  swizzle = x_transforms[1].swizzle
  if tile_k % 64 or sub % 32 or k_offset % 32 or swizzle != 128:
    raise NotImplementedError(f"mma_sync: tile_k={tile_k}, sub={sub}, k_offset={k_offset}, "
                              f"x swizzle {swizzle} (takes 128-byte swizzled rows)")

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(x_transforms)),
      return_type=plgpu.ShapeDtypeStruct((tile_n, tile_m), jnp.float32,
                                         layout=plgpu.Layout.WGMMA))
  def product(ctx, wf, x_ref):
    del ctx
    # pylint: disable=g-import-not-at-top
    from jax.experimental.mosaic import gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax._src.lib.mlir.dialects import gpu as gpu_dialect
    from jax._src.lib.mlir.dialects import llvm
    from jax._src.lib.mlir.dialects import vector
    fa = mgpu.fragmented_array
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    c = lambda v: arith.constant(i32, v)
    base = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(x_ref))
    lane = arith.remui(arith.index_cast(i32, gpu_dialect.thread_id(gpu_dialect.Dimension.x)),
                       c(32))
    r, q = arith.andi(lane, c(7)), arith.shrui(lane, c(3))
    # Byte offset of row r, 16-byte chunk (first + q) of a 1 KiB tile, swizzled (chunk ^ r).
    chunk_offset = {
        first: arith.addi(arith.shli(r, c(7)),
                          arith.shli(arith.xori(arith.addi(q, c(first)), r), c(4)))
        for first in (0, 4)}
    quad = llvm.StructType.get_literal([i32] * 4)
    b_frags = {}  # (n tile, k16 step of the group) -> (b0b1, b2b3)
    for nt in range(tile_m // 8):
      for k32 in range(sub // 32):
        k0 = k_offset + 32 * k32
        tile_offset = (nt * (tile_k // 64) + k0 // 64) * 1024
        addr = arith.addi(arith.addi(base, c(tile_offset)), chunk_offset[k0 % 64 // 8])
        regs = llvm.inline_asm(quad, [addr], _LDMATRIX_X4, "=r,=r,=r,=r,r",
                               has_side_effects=True)
        got = [llvm.extractvalue(i32, regs, [i]) for i in range(4)]
        b_frags[(nt, 2 * k32)] = got[0:2]
        b_frags[(nt, 2 * k32 + 1)] = got[2:4]
    a_reg = lambda idx: mgpu.utils.bitcast(wf.registers[idx], i32)
    out_shape = fa.WGMMA_LAYOUT.registers_shape((tile_n, tile_m))
    out = np.empty(out_shape, dtype=object)
    zero = arith.constant(f32, 0.0)
    f32x4 = llvm.StructType.get_literal([f32] * 4)
    vec2 = ir.VectorType.get((2,), f32)
    for rt in range(tile_n // 64):
      frag = lambda ct, h: a_reg((rt, ct, 0, 0, h, 0, 0, 0, 0))
      for nt in range(tile_m // 8):
        d = [zero] * 4
        for s in range(sub // 16):
          a = [frag(2 * s, 0), frag(2 * s, 1), frag(2 * s + 1, 0), frag(2 * s + 1, 1)]
          res = llvm.inline_asm(f32x4, [*a, *b_frags[(nt, s)], *d], _MMA_M16N8K16,
                                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
          d = [llvm.extractvalue(f32, res, [i]) for i in range(4)]
        out[(rt, nt, 0, 0, 0, 0, 0, 0, 0)] = vector.from_elements(vec2, d[0:2])
        out[(rt, nt, 0, 0, 1, 0, 0, 0, 0)] = vector.from_elements(vec2, d[2:4])
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return product(w, x_smem)


def _mma_sync_then_scale(acc, w_smem, s_smem, x_smem, group_size: int, x_transforms,
                         z_smem=None):
  """:func:`_multiply_then_scale` with :func:`_mma_sync_product` in place of wgmma."""
  sub = min(w_smem.shape[1], group_size)
  for j, w, _ in _step_groups(w_smem, x_smem, sub, _zero_point_converter(z_smem)):
    with jax.named_scope("mma"):
      part = _mma_sync_product(w, x_smem, j * sub, x_transforms)
    with jax.named_scope("scale"):
      acc = _plus_scaled(acc, part, s_smem.at[j])
  return acc


def _kernel_call(x: jax.Array, wt: jax.Array, scales: jax.Array, layer: jax.Array | None,
                 cfg: WgmmaConfig, group_size: int, num_sms: int, out_dtype,
                 fp4: str | None = None, global_scale: jax.Array | None = None,
                 tile_table: tuple[jax.Array, ...] | None = None,
                 zeros: jax.Array | None = None) -> jax.Array:
  """``[split_k, M, N]`` (``out_dtype``) partial products; M below 8 or a multiple of
  tile_m (:func:`padded_rows`).

  x: ``[M, K]`` bf16; wt: ``[N, K]`` int4; scales: ``[K // G, N]`` bf16. ``fp4``
  ("mxfp4" or "nvfp4"): wt holds E2M1 codes, scales ``[K // G, N]`` are the block
  scales' bits as uint8 (``group_size`` G = 32 or 16), and NVFP4's ``global_scale``
  (float32 ``[]``) multiplies the float32 products. Or, with ``layer`` (an int32 scalar),
  wt ``[L, N, K]``, scales ``[L, K // G, N]`` and global_scale ``[L]``: stacks of which the
  kernel reads layer ``layer``. ``zeros``: INT4's uint8 zero points ``[K // G, N]`` (a
  stack like the scales with ``layer``), or None (symmetric).

  ``tile_table`` (a grouped GEMM over experts, :func:`_moe_matmul`): int32
  ``(experts [T], rows [T], active [])``: row tile ``t``, x ``[T, tile_m, K]``, multiplies
  expert ``experts[t]`` of wt ``[E, N, K]`` (after ``layer``'s axis, if any; scales, zeros
  and global_scale likewise have an expert axis); the first ``active`` tiles have ``rows[t] >
  0``, the others are skipped. (A row offset read from memory, to take the tiles' rows
  from one ``[R, K]`` array, failed Mosaic GPU's layout inference.)
  Returns ``[split_k, T, tile_m, N]``, garbage in the skipped tiles. Or ``(experts [T],
  x_rows [T])``, experts straight from the caller (one out of ``[0, E)`` is clamped for
  addressing and its tile's output is NaN): every tile is active and one row: x
  ``[R, 1, K]``, tile ``t`` multiplies
  row ``x_rows[t]`` (TMA fills the tile's other rows with zeros; an index on the leading
  axis, unlike a row offset, lowers) and the result is ``[split_k, T, 1, N]`` (the store
  drops the other rows). Or ``(experts [T],)``: the same with x ``[1, 1, K]``, every tile
  multiplying its one row.

  N need not be a multiple of ``consumers * tile_n``: the last column tile then overlaps
  the one before it, both writing the same values.
  """
  grouped = tile_table is not None
  row_per_tile = grouped and len(tile_table) in (1, 2)
  num_experts = wt.shape[-3] if grouped else None
  if grouped:
    num_row_tiles, k = tile_table[0].shape[0], x.shape[-1]
    m = num_row_tiles * cfg.tile_m
  else:
    m, k = x.shape
  n = wt.shape[-2]
  tn, tm, tk, splits = cfg.tile_n, cfg.tile_m, cfg.tile_k, cfg.split_k
  wgs = cfg.consumers
  if not grouped and m != padded_rows(m, cfg):
    raise ValueError(f"{m} rows: pad x to padded_rows(m, cfg) = {padded_rows(m, cfg)}")
  cta_n = wgs * tn
  m_iters, n_iters = -(-m // tm), -(-n // cta_n)
  k_per_split = k // splits
  k_iters = k_per_split // tk
  steps_per_group = max(1, group_size // tk)
  groups_per_step = _groups_per_step(tk, group_size)
  out_bits = jnp.dtype(out_dtype).itemsize * 8
  zeros_in = zeros is not None

  x_swizzle = plgpu.find_swizzle(tk * 16, "lhs")
  w_swizzle = plgpu.find_swizzle(tk * 4, "rhs")
  o_swizzle = plgpu.find_swizzle(tn * out_bits, "out")
  x_transforms = (plgpu.TilingTransform((8, x_swizzle * 8 // 16)),
                  plgpu.SwizzleTransform(x_swizzle))
  w_transforms = (plgpu.TilingTransform((8, w_swizzle * 8 // 4)),
                  plgpu.SwizzleTransform(w_swizzle))
  o_transforms = (plgpu.TilingTransform((8, o_swizzle * 8 // out_bits)),
                  plgpu.SwizzleTransform(o_swizzle))
  tiles = m_iters * n_iters * splits
  grid = min(num_sms, tiles)

  def kernel(x_gmem, w_gmem, s_gmem, *refs, out_smem):
    *refs, out_gmem = refs
    z_gmem = refs.pop(0) if zeros_in else None
    g_gmem = refs.pop(0) if global_scale is not None else None
    if layer is not None:
      index = stacked_lib.normalized_index(refs.pop(0)[...], w_gmem.shape[0])
      w_gmem, s_gmem = w_gmem.at[index], s_gmem.at[index]
      if z_gmem is not None:
        z_gmem = z_gmem.at[index]
      if g_gmem is not None:
        g_gmem = g_gmem.at[index]
    if row_per_tile:
      experts_gmem, *x_rows_gmem = refs
    elif grouped:
      experts_gmem, rows_gmem, active_gmem = refs

    def pipeline(body, context, state=None):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_iters,), memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=x_transforms),
              plgpu.BlockSpec((cta_n, tk), lambda kk: (0, kk), transforms=w_transforms),
              *[plgpu.BlockSpec((groups_per_step, cta_n),
                                lambda kk: (kk // steps_per_group, 0))] * (2 if zeros_in else 1),
          ],
          wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=cfg.stages,
          compute_context=context, pipeline_state=state)

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(
            x_gmem, w_gmem, s_gmem, *([] if z_gmem is None else [z_gmem])),
        collective_axes="wg")
    def _scope(allocations):
      wg = lax.axis_index("wg")
      wg_rows = pl.ds(wg * tn, tn)

      @plgpu.nd_loop((tiles,), collective_axes="sm")
      def _tile(info):
        (lin,) = info.index
        si, rest = lin // (m_iters * n_iters), lin % (m_iters * n_iters)
        if grouped:  # row tile major: the skipped tiles come last, as the table's do
          mi, rest = lin // (splits * n_iters), lin % (splits * n_iters)
          si, ni = rest // n_iters, rest % n_iters
        elif cfg.snake_width:
          mi, ni = plgpu.planar_snake(rest, (m_iters, n_iters), 0 if cfg.m_minor else 1,
                                      cfg.snake_width)
        elif cfg.m_minor:
          mi, ni = rest % m_iters, rest // m_iters
        else:
          mi, ni = rest // n_iters, rest % n_iters
        m0, n0 = mi * tm, ni * cta_n
        if n % cta_n:  # the last column tile overlaps the one before it
          n0 = jnp.minimum(n0, n - cta_n)
        k0 = si * k_per_split
        x_tile, w_tile, s_tile, z_tile, g_tile = x_gmem, w_gmem, s_gmem, z_gmem, g_gmem
        out_tile = out_gmem.at[si]
        row_factor = None
        if grouped:
          expert = experts_gmem.at[mi][...]
          if row_per_tile:  # the caller's ids: clamped for the TMA, NaN rows if out of range
            row_factor = jnp.where((expert < 0) | (expert > num_experts - 1),
                                   jnp.float32(jnp.nan), jnp.float32(1))
            expert = jnp.where(expert < 0, 0, jnp.where(expert > num_experts - 1,
                                                        num_experts - 1, expert))
          x_tile, out_tile, m0 = x_gmem.at[mi], out_tile.at[mi], 0
          if row_per_tile:  # x [R, 1, K]: the tile's row, the rest zero-filled by TMA
            x_tile = x_gmem.at[x_rows_gmem[0].at[mi][...] if x_rows_gmem else 0]
          w_tile, s_tile = w_gmem.at[expert], s_gmem.at[expert]
          if z_gmem is not None:
            z_tile = z_gmem.at[expert]
          if g_gmem is not None:
            g_tile = g_gmem.at[expert]

        def epilogue(acc):
          if g_tile is not None:  # NVFP4's tensor scale, and the bias power left out
            acc = acc * (g_tile[...] * float(2 ** _FOLDED_BIAS_SHIFT[fp4]))
          if row_factor is not None:  # 1, or NaN for an expert id out of range
            acc = acc * row_factor
          acc = plgpu.layout_cast(acc.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for e in range(tm // cfg.epi_m):
            rows = slice(e * cfg.epi_m, (e + 1) * cfg.epi_m)
            slot = e % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem.at[wg, slot].transpose((1, 0))[...] = acc[:, rows]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                out_tile.at[pl.ds(m0 + e * cfg.epi_m, cfg.epi_m), pl.ds(n0 + wg * tn, tn)])

        def context(run):
          if cfg.scale_accumulator or cfg.mma_sync:
            zeros = jnp.zeros((tn, tm), jnp.float32)
            epilogue(run(plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)))
            return

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tn, tm), jnp.float32))
          def _acc(acc_ref):
            run(acc_ref)
            epilogue(acc_ref[...])

        def body(_, x_smem, w_smem, s_smem, *z_and_acc):
          *z_smem, acc = z_and_acc
          w_smem, s_smem = w_smem.at[wg_rows], s_smem.at[:, wg_rows]
          z_smem = z_smem[0].at[:, wg_rows] if z_smem else None
          if fp4 and cfg.mma_sync:
            return _fp4_mma_sync_step(acc, w_smem, s_smem, x_smem, fp4, x_transforms)
          if fp4:
            _fp4_step(acc, w_smem, s_smem, x_smem, fp4)
            return acc
          if cfg.mma_sync:
            return _mma_sync_then_scale(acc, w_smem, s_smem, x_smem, group_size,
                                        x_transforms, z_smem)
          if cfg.scale_accumulator:
            return _multiply_then_scale(acc, w_smem, s_smem, x_smem, group_size, z_smem)
          _convert_and_multiply(acc, w_smem, s_smem, x_smem, group_size, z_smem)
          return acc

        state = None
        if cfg.chain_tiles:
          first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
          if grouped and not row_per_tile:  # last tile not skipped: tile sm + j * grid
            active_lins = active_gmem[...] * (splits * n_iters)
            last = info.local_index == (active_lins - 1 - lax.axis_index("sm")) // grid
          # A CTA with one tile starts it and skips the final quiesce (it has no next).
          state = jnp.where(first, int(_CHAIN.START),
                            jnp.where(last, int(_CHAIN.STOP), int(_CHAIN.STEADY)))
        def run_tile():
          group_cols = (pl.ds(k0 // group_size, k_per_split // group_size), pl.ds(n0, cta_n))
          pipeline(body, context, state)(
              x_tile.at[pl.ds(m0, tm), pl.ds(k0, k_per_split)],
              w_tile.at[pl.ds(n0, cta_n), pl.ds(k0, k_per_split)],
              s_tile.at[group_cols],
              *([] if z_tile is None else [z_tile.at[group_cols]]),
              allocations=allocations)

        if grouped and not row_per_tile:
          pl.when(rows_gmem.at[mi][...] > 0)(run_tile)
        else:
          run_tile()

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_shape = ((splits, num_row_tiles, 1 if row_per_tile else tm, n) if grouped
               else (splits, m, n))
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(grid,), grid_names=("sm",), num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(out_smem=plgpu.SMEM((wgs, 2, cfg.epi_m, tn), out_dtype,
                                             transforms=o_transforms)))
  extra = [a for a in (zeros, global_scale, layer) if a is not None]
  return call(x, wt, scales, *extra, *(tile_table or ()))


def padded_rows(m: int, cfg: WgmmaConfig) -> int:
  """Rows of x (and y) the kernel is called with: ``m`` itself below 8 (TMA fills the
  rows of a tile past ``m`` with zeros and drops them on the store, so no pad and no
  slice run: 1.1-3.7 us less at M = 1 on the H100, BENCHMARKS.md session 17); else ``m``
  rounded up to ``tile_m`` (Mosaic GPU takes a tiled dimension only if it is below or a
  multiple of its tiling of 8 rows)."""
  return m if m < 8 else _round_up(m, cfg.tile_m)


def int4_nk_matmul(x: jax.Array, w: int4_nk.Int4NKWeight, *, interpret: bool = False,
                   config: WgmmaConfig | None = None, num_sms: int | None = None
                   ) -> jax.Array:
  """``x [M, K] @ W -> [M, N]`` in bf16 for an :class:`qjax.Int4NKWeight` on Hopper.

  Args:
    x: ``[M, K]`` bf16; any M (from 8 rows up, padded to the tile internally).
    w: INT4 with bf16 or f16 scales (symmetric, or with uint8 zero points: the conversion
      subtracts ``128 + z`` in place of 136, same instructions), codes ``[N, K // 8]`` in
      fragment order; N a multiple of 128 and the group size a multiple of 64.
    interpret: must be False (raises NotImplementedError: no CPU interpret mode).
    config: tiles; default :func:`config_for`.
    num_sms: CTAs of the persistent grid; default the device's SM count.

  Raises:
    NotImplementedError: an argument the kernel does not handle (the dispatcher's
      default route then runs the XLA path).
  """
  return _matmul(x, w, interpret=interpret, config=config, num_sms=num_sms)


def fp4_nk_matmul(x: jax.Array, w: fp4_nk.MXFP4NKWeight | fp4_nk.NVFP4NKWeight, *,
                  interpret: bool = False, config: WgmmaConfig | None = None,
                  num_sms: int | None = None) -> jax.Array:
  """``x [M, K] @ W -> [M, N]`` in bf16 for an :class:`qjax.MXFP4NKWeight` or
  :class:`qjax.NVFP4NKWeight` on Hopper: the pipeline of :func:`int4_nk_matmul`, with
  E2M1 codes converted to bf16 and scaled by their blocks' scales in registers
  (:func:`_e2m1_to_bf16_fragments`); NVFP4's tensor scale multiplies the float32 sums.

  Args:
    x: ``[M, K]`` bf16; any M.
    w: codes ``[N, K // 8]`` in fragment order, block scales ``[K // 32, N]`` (E8M0) or
      ``[K // 16, N]`` (float8_e4m3fn); N a multiple of 128 and K of the config's
      ``tile_k * split_k``.
    interpret, config, num_sms: as :func:`int4_nk_matmul` (config default
      ``config_for(..., fp4="mxfp4")`` or ``"nvfp4"``).

  Raises:
    NotImplementedError: an argument the kernel does not handle.
  """
  return _matmul(x, w, interpret=interpret, config=config, num_sms=num_sms)


def _matmul(x: jax.Array, w: Any, *, interpret: bool, config: WgmmaConfig | None,
            num_sms: int | None) -> jax.Array:
  """The body of :func:`int4_nk_matmul` and :func:`fp4_nk_matmul`."""
  num_sms = _grid_sms(interpret, num_sms)
  m = x.shape[0]
  n = w.shape[1]
  cfg = config or default_config(m, w, num_sms)
  _check(x, w, cfg)
  if m == 0:
    return jnp.zeros((0, n), jnp.bfloat16)
  mp = padded_rows(m, cfg)
  xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
  y = _run_kernel(xp, w, cfg, num_sms)
  return y[:m] if mp != m else y


def _grid_sms(interpret: bool, num_sms: int | None) -> int:
  """The persistent grid's CTAs (default: the device's SM count); NotImplementedError
  for interpret mode, which this kernel does not have."""
  if interpret:
    raise NotImplementedError(
        "the Mosaic GPU wgmma kernel has no interpret mode; use implementation='xla' on "
        "the CPU")
  if num_sms is None:
    num_sms = getattr(jax.devices()[0], "core_count", None) or 132
  return num_sms


def _run_kernel(x: jax.Array, w: Any, cfg: WgmmaConfig, num_sms: int,
                tile_table: tuple[jax.Array, ...] | None = None) -> jax.Array:
  """:func:`_kernel_call` on ``w``'s arrays, its K splits summed -> bf16 ``[M, N]`` (or
  ``[T, tile_m, N]`` with ``tile_table``). Under ``qjax.layer_of`` the kernel gets the
  stacked codes and scales and the layer index, and reads the layer in place."""
  k = w.shape[0]
  fp4 = _fp4_name(w)
  zeros = None if fp4 else w.zeros
  arrays = ([w.codes, w.scales] + ([w.global_scale] if fp4 == "nvfp4" else [])
            + ([] if zeros is None else [zeros]))
  stacks, in_stack, layer = stacked_lib.read_in_place(arrays)
  if not all(in_stack):
    stacks, layer = arrays, None
  if zeros is not None:
    *stacks, zeros = stacks
  codes, scales, *global_scale = stacks
  if fp4:  # the block scales' bits
    scales = lax.bitcast_convert_type(scales, jnp.uint8)
  wt = lax.bitcast_convert_type(codes, jnp.int4).reshape(*codes.shape[:-1], k)
  out_dtype = jnp.float32 if cfg.split_k > 1 else jnp.bfloat16
  y = _kernel_call(x, wt, scales, layer, cfg, _scale_args(w)[0], num_sms, out_dtype, fp4,
                   global_scale[0] if global_scale else None, tile_table=tile_table,
                   zeros=zeros)
  return y[0] if cfg.split_k == 1 else common.sum_splits(y).astype(jnp.bfloat16)


# ------------------------------------------------------------------ mixture of experts

# The MoE kernel's two routes: a row tile per (token, expert) pair, read and written in
# place (no routing kernels; an expert that k pairs select is read k times, the repeats
# mostly from L2), or the pairs grouped by expert (each selected expert read once, after
# XLA's routing: tile slots, row gathers). H200 (docs/experiments/s46_per_pair.py,
# BENCHMARKS.md session 46), device time per-pair / grouped, us: 128 MXFP4 experts of
# 2880x2880, top-4, at 16 / 32 / 64 / 128 pairs 27.1 / 40.1, 50.5 / 63.7, 96.8 / 96.4,
# 181.6 / 143.5; 32 such experts at 16 / 32 / 64, 27.0 / 39.4, 49.6 / 50.0, 95.6 / 59.6;
# 128 INT4 experts of 2048x768, top-8, at 32 / 64 / 128 / 256 / 512, 11.6 / 22.6,
# 15.4 / 27.6, 26.1 / 37.9, 47.2 / 46.3, 90.2 / 51.2 (768x2048: 17.6 / 28.4, 32.0 / 39.5,
# 60.2 / 45.7 at 64 / 128 / 256); 8 INT4 experts of 4096x14336 (Mixtral's), top-2, at 8 /
# 16 / 32, 59.3 / 61.2, 115.0 / 68.6, 224.2 / 74.8. The grouped route's routing costs
# about 6-11 us more, and its streams run about 1.2x slower per byte: per pair while
# ``expert bytes * (5/6 pairs - expected distinct experts)`` is at most this many bytes
# (every case above on its faster route, or within 3 % of it).
_PER_PAIR_SLACK_BYTES = 20 << 20


def per_pair_route(num_pairs: int, w: Any) -> bool:
  """Whether the MoE kernel gives each of ``num_pairs`` pairs a row tile of its own for the
  expert stack ``w`` (arrays may be abstract), by :data:`_PER_PAIR_SLACK_BYTES`'s rule:
  the expected distinct experts of uniform routing
  (:func:`qjax._src.moe.expected_distinct_experts`) against the pairs, weighed by one
  expert's bytes (codes, scales, zero points)."""
  distinct = moe.expected_distinct_experts(num_pairs, w.codes.shape[-3])
  expert_bytes = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                     for a in jax.tree.leaves(_one_layer(w)))
  return expert_bytes * (5 * num_pairs / 6 - distinct) <= _PER_PAIR_SLACK_BYTES


def moe_config_for(num_pairs: int, num_experts: int, k: int, n: int, fp4: str | None,
                   num_sms: int = 132, *, group_size: int = 128, group_bytes: int = 2
                   ) -> WgmmaConfig:
  """The configuration of the MoE kernel (:func:`fp4_nk_moe_matmul`,
  :func:`int4_nk_moe_matmul`) for ``num_pairs`` (token, expert) pairs over ``num_experts``
  experts of ``[k, n]``: ``fp4`` "mxfp4" / "nvfp4", or None for INT4 with scales per
  ``group_size`` (``group_bytes`` per group and column in a stage, :func:`_scale_args`).

  Row tiles and K splits are :func:`config_for`'s for the dense problem the grouped one
  resembles (the rows per selected expert, N times the experts selected at once). K
  steps are the widest up to 512 that divide a split of K in two or more (and, for INT4,
  that the kernel takes with the group size: :func:`_check_steps`), and the tiles of a
  CTA are chained, with the deepest pipeline (up to 8 stages, in shared memory) that
  divides the steps. H100, 128 experts of 2880x2880, top-4 (BENCHMARKS.md, session 20):
  steps of 320 in 3 chained stages took 30.9 / 55.4 / 120.5 / 245.7 us at 1 / 4 / 16 /
  64 tokens; unchained, 4 stages, 30.7 / 60.5 / 133.7 / 269.7; steps of 64, 36-42 % more.
  """
  active = min(num_experts, num_pairs)
  rows = -(-num_pairs // active)
  cfg = config_for(rows, k, n * active, group_size, num_sms, fp4=fp4, group_bytes=group_bytes)
  expert = abstract_weight(k, n, group_size=group_size, fp4=fp4)
  scale_args = (_FP4_FORMATS[fp4].block_size, 1) if fp4 else (group_size, group_bytes)
  k_split = k // cfg.split_k
  for wide in sorted((t for t in _TILE_K if t <= 512), reverse=True):
    wide_cfg = dataclasses.replace(cfg, tile_k=wide, chain_tiles=False)
    steps = k_split // wide
    if k_split % wide or steps < 2 or _steps_error(expert, wide_cfg):
      continue
    fit = (_SMEM_MAX - cfg.epilogue_bytes()) // wide_cfg.stage_bytes(*scale_args)
    divisors = [d for d in range(min(8, fit, steps), 1, -1) if steps % d == 0]
    if divisors:
      return dataclasses.replace(wide_cfg, stages=divisors[0], chain_tiles=True)
    if fit >= 2:
      return dataclasses.replace(wide_cfg, stages=min(8, fit))
  return dataclasses.replace(cfg, chain_tiles=False)


def moe_default_config(num_pairs: int, w: Any, num_sms: int = 132) -> WgmmaConfig:
  """:func:`moe_config_for` of the expert stack ``w`` (its format, group size and scale
  bytes; arrays may be abstract) at ``num_pairs`` pairs."""
  group_size, group_bytes = _scale_args(w)
  k, n = w.shape
  return moe_config_for(num_pairs, w.codes.shape[-3], k, n, _fp4_name(w), num_sms,
                        group_size=group_size, group_bytes=group_bytes)


def _steps_error(w: Any, cfg: WgmmaConfig) -> str | None:
  """:func:`_check_steps`' message for one weight ``w`` and ``cfg``, or None."""
  try:
    _check_steps(w, cfg)
  except NotImplementedError as e:
    return str(e)
  return None


def fp4_nk_moe_matmul(rows: jax.Array, w: fp4_nk.MXFP4NKWeight | fp4_nk.NVFP4NKWeight,
                      pair_rows: jax.Array, pair_experts: jax.Array, *,
                      interpret: bool = False, config: WgmmaConfig | None = None,
                      num_sms: int | None = None) -> jax.Array:
  """``y[p] = rows[pair_rows[p]] @ W[pair_experts[p]]`` -> ``[P, N]`` bf16 on Hopper: the
  pipeline of :func:`fp4_nk_matmul` as a grouped GEMM (``qjax.moe_matmul``'s canonical
  form).

  The pairs' rows are gathered into row tiles of ``tile_m``, each of one expert
  (:func:`qjax._src.moe.tile_slots`: by comparisons of the pairs up to a few hundred, else
  by a sort); the persistent grid walks (row tile, K split, column tile) and each CTA's
  TMA copies read the codes and scales of its tile's expert where they lie in the stack,
  so no unselected expert is read and no expert is dequantized in memory. Tiles of the
  table past the active ones are skipped. Where few pairs share an expert (decode:
  :func:`per_pair_route`), each pair is a row tile of its own instead, read and written in
  place.

  Args:
    rows: ``[R, K]`` bf16.
    w: :class:`qjax.MXFP4NKWeight` / :class:`qjax.NVFP4NKWeight` of E experts: codes
      ``[E, N, K // 8]``, scales ``[E, K // B, N]`` (and NVFP4's tensor scales ``[E]``);
      N a multiple of 16, at least 128.
    pair_rows, pair_experts: ``[P]`` int32; experts in ``[0, E)`` (a pair out of range
      gives a NaN row, :func:`qjax._src.moe.checked_experts`).
    interpret: must be False (no CPU interpret mode; NotImplementedError).
    config: tiles; default :func:`moe_config_for`.
    num_sms: CTAs of the persistent grid; default the device's SM count.

  Raises:
    NotImplementedError: an argument the kernel does not handle.
  """
  if _fp4_name(w) is None:
    raise NotImplementedError(
        "fp4_nk_moe_matmul takes an MXFP4NKWeight or NVFP4NKWeight expert stack, got "
        f"{type(w).__name__} (int4_nk_moe_matmul takes Int4NKWeight stacks)")
  return _moe_matmul(rows, w, pair_rows, pair_experts, interpret=interpret, config=config,
                     num_sms=num_sms)


def int4_nk_moe_matmul(rows: jax.Array, w: int4_nk.Int4NKWeight, pair_rows: jax.Array,
                       pair_experts: jax.Array, *, interpret: bool = False,
                       config: WgmmaConfig | None = None, num_sms: int | None = None
                       ) -> jax.Array:
  """``y[p] = rows[pair_rows[p]] @ W[pair_experts[p]]`` -> ``[P, N]`` bf16 on Hopper for
  an :class:`qjax.Int4NKWeight` expert stack (GPTQ / AWQ / compressed-tensors experts after
  ``qjax.to_int4_nk``): :func:`fp4_nk_moe_matmul`'s grouped GEMM with
  :func:`int4_nk_matmul`'s conversion (zero points and f16 scales included).

  Args:
    rows: ``[R, K]`` bf16.
    w: codes ``[E, N, K // 8]``, scales ``[E, K // G, N]`` bf16 or f16, zeros ``[E, K //
      G, N]`` uint8 or None; G a multiple of 64; N a multiple of 16, at least 128.
    pair_rows, pair_experts, interpret, config, num_sms: as :func:`fp4_nk_moe_matmul`.

  Raises:
    NotImplementedError: an argument the kernel does not handle.
  """
  if not isinstance(w, int4_nk.Int4NKWeight):
    raise NotImplementedError(
        f"int4_nk_moe_matmul takes an Int4NKWeight expert stack, got {type(w).__name__}")
  return _moe_matmul(rows, w, pair_rows, pair_experts, interpret=interpret, config=config,
                     num_sms=num_sms)


def _moe_matmul(rows: jax.Array, w: Any, pair_rows: jax.Array, pair_experts: jax.Array, *,
                interpret: bool, config: WgmmaConfig | None, num_sms: int | None
                ) -> jax.Array:
  """The body of :func:`fp4_nk_moe_matmul` and :func:`int4_nk_moe_matmul`."""
  num_sms = _grid_sms(interpret, num_sms)
  reason = _moe_weight_error(w) or _declines_dtype(rows.dtype)
  if reason is not None:
    raise NotImplementedError(reason)
  p = pair_experts.shape[0]
  cfg = config or moe_default_config(p, w, num_sms)
  _check_steps(_one_layer(w), cfg)  # (any N >= 128 is tiled: no _check_n)
  if per_pair_route(p, w):
    return _per_pair(rows, w, pair_rows, pair_experts, cfg, num_sms)
  return _grouped(rows, w, pair_rows, pair_experts, cfg, num_sms)


def _moe_weight_error(w: Any, layer_axes: bool = False) -> str | None:
  """Why the MoE kernel does not take ``w`` whatever the call (format, axes, N), or None;
  ``layer_axes``: axes before the expert axis allowed (stacks that ``qjax.layer_of``
  reads one expert stack of)."""
  ndim_ok = w.codes.ndim >= 3 if layer_axes else w.codes.ndim == 3
  if not isinstance(w, (int4_nk.Int4NKWeight, *_FP4_FORMATS.values())) or not ndim_ok:
    return (f"{type(w).__name__} with codes of shape {tuple(w.codes.shape)}: the wgmma MoE "
            "kernel takes an Int4NKWeight, MXFP4NKWeight or NVFP4NKWeight with one leading "
            "expert axis")
  n = w.shape[1]
  if n % 16 or n < 128:
    return f"N={n}: the wgmma MoE kernel needs N >= 128, a multiple of 16"
  return None


# Pairs at which :func:`moe_declines` checks moe_config_for: one or more per rule of
# config_for (mma.sync, scales on the accumulator, wide K steps, tiles of 128 and 256 rows).
_MOE_DECLINES_CHECK_PAIRS = (1, 4, 32, 33, 256, 8192)


def moe_declines(w: Any, dtype: Any) -> str | None:
  """Why :func:`fp4_nk_moe_matmul` / :func:`int4_nk_moe_matmul` would raise
  NotImplementedError for the expert stack ``w`` (arrays may be abstract; a stack of them
  under layer axes, as ``qjax.layer_of`` reads one, is checked as one) and rows of
  ``dtype`` at some number of pairs; None where it runs them all
  (``qjax.Backend.declines``)."""
  reason = _declines_dtype(dtype) or _moe_weight_error(w, layer_axes=True)
  if reason is not None:
    return reason
  num_sms = _grid_sms(False, None)
  expert = _one_layer(w)
  for p in _MOE_DECLINES_CHECK_PAIRS:
    reason = _steps_error(expert, moe_default_config(p, w, num_sms))
    if reason is not None:
      return f"{p} pairs: {reason}"
  return None


def _grouped(rows: jax.Array, w: Any, pair_rows: jax.Array, pair_experts: jax.Array,
             cfg: WgmmaConfig, num_sms: int) -> jax.Array:
  """:func:`_moe_matmul` over row tiles of one expert each
  (:func:`qjax._src.moe.tile_slots`): x gathered into ``[T, tile_m, K]``, then each
  pair's row of the result by one gather of whole rows (H100, T = 64: 12.7 us less than
  gathering by tile and row, then by pair)."""
  k, tm = w.shape[0], cfg.tile_m
  pair_experts, valid = moe.checked_experts(pair_experts, w.codes.shape[0])
  slots = moe.tile_slots(pair_experts, w.codes.shape[0], tm)
  p = pair_rows.shape[0]
  filled = (slots.source < p)[:, None]  # slots without a pair multiply a zero row
  x_tiles = jnp.where(filled, rows[pair_rows[jnp.minimum(slots.source, p - 1)]], 0)
  table = (slots.tile_experts, slots.tile_rows, slots.active)
  y = _run_kernel(x_tiles.reshape(-1, tm, k), w, cfg, num_sms, table)  # [T, tm, N]
  return moe.nan_rows(y.reshape(-1, w.shape[1])[slots.slot], valid)


def _per_pair(rows: jax.Array, w: Any, pair_rows: jax.Array, pair_experts: jax.Array,
              cfg: WgmmaConfig, num_sms: int) -> jax.Array:
  """:func:`_moe_matmul` with one row tile per pair: the kernel reads the pair's row
  of ``rows`` and writes its row of the result in place (no gather, no slice). Every tile
  is active, so no table of rows per tile is passed: its array of ones was an XLA kernel
  of 0.9 us (H100, session 24). Nor, for one row, the pairs' rows: all zero, XLA makes
  them a broadcast, a kernel of its own before the call (BENCHMARKS.md, session 25)."""
  p, (r, k) = pair_experts.shape[0], rows.shape
  table = (pair_experts.astype(jnp.int32),)
  if r > 1:
    table += (pair_rows.astype(jnp.int32),)
  return _run_kernel(rows.reshape(r, 1, k), w, cfg, num_sms, table).reshape(p, -1)
