"""Fused INT4 dequantize + matmul in Pallas, lowered to Triton on NVIDIA GPUs.

Contract (qjax's XLA path is the reference): ``y = x @ W`` with, per group
``g = k // G``, ``W[k, n] = (q - z[g, n]) * s[g, n]`` (integer zero points; 8 when
symmetric) or ``W[k, n] = q * s[g, n] + b[g, n]`` (float biases); float32 accumulation,
output in x's dtype.

How the kernel reads the weight. Codes arrive in the kernel-native tile order
(``qjax._src.packing``, ``tile_k = 128``): within a K-tile, nibble ``j`` of the 16 words
of a column holds the contiguous row slab ``j``. One load of ``[16, block_n]`` uint32
yields 8 slabs with a shift and a mask each, and each slab is multiplied against a
``[block_m, 16]`` slice of x loaded straight from the ref: no interleave, no value slice.

Dequantization in registers, without a lookup table and without a multiply per weight:
``bitcast((q | 0x4300) as u16, bf16) == 128 + q`` exactly (``0x6400`` and 1024 for
f16). On the GPU two weights at a time, in inline PTX: one PRMT gathers the byte holding
the nibble from two adjacent words, one LOP3 masks it and ors in the magic of both
halves (:func:`_pair_ptx`; H100, M = 16, 8192x28672: 75.2 us against 98.1 with the
shift / and / or / narrowing of Pallas ops). The constant ``C``, the zero point or bias
and the group scale are applied to the f32 partial products after the dots, once per
group and column:
``acc += (x_g @ (C + q_g) - (C + z_g) * sum(x_g)) * s_g``, or with biases
``acc += (x_g @ (C + q_g)) * s_g + (b_g - C * s_g) * sum(x_g)``.
For 16-bit x in row blocks of up to 32, ``sum(x_g)`` is itself a dot, against a tile of
ones (:func:`x_sum_add`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import Int4Weight
from qjax import KernelConfig
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import int4_gemv

_load = common.load


# bf16 / f16 bit patterns whose low mantissa bits take a 4-bit code: value = C + code.
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}


# The same magic in both halves of a 32-bit register (two bf16 / f16 values).
_MAGIC_PAIR = {d: (bits << 16) | bits for d, (bits, _) in _MAGIC.items()}

# Set False to dequantize with Pallas ops on the GPU too (the A/B switch of the sweeps).
PAIRED_PTX = True
# Set False to sum x per slab with vector adds instead of a dot against ones (A/B switch).
SUM_BY_DOT = True


@functools.lru_cache(maxsize=None)
def _pair_ptx(nibble: int, magic_pair: int) -> str:
  """PTX: two code words ``$1``, ``$2`` (adjacent elements) -> ``$0``, the two 16-bit
  floats ``C + q`` of their nibble ``nibble`` (low half from ``$1``). One PRMT gathers the
  byte holding the nibble from each word into bytes 0 and 2, a shift (odd nibbles) aligns
  them, and one LOP3 masks them and ors in the magic: 2-3 instructions per two weights."""
  byte = nibble // 2
  selector = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)
  lines = ["{", ".reg .b32 t;", f"prmt.b32 t, $1, $2, {selector:#06x};"]
  if nibble % 2:
    lines.append("shr.u32 t, t, 4;")
  lines += [f"lop3.b32 $0, t, 0x000f000f, {magic_pair:#010x}, "
            f"{int4_gemv.LOP3_A_AND_B_OR_C:#04x};", "}"]
  return "\n".join(lines)


def pairs_fit(slab: int, block_n: int, num_warps: int) -> bool:
  """Whether every thread holds an even number of a ``[slab, block_n]`` tile's words, as
  the paired PTX (two elements per instance) needs: ``slab * block_n`` a multiple of
  ``2 * 32 * num_warps``."""
  return (slab * block_n) % (64 * num_warps) == 0


def paired_decode(block_n: int, num_warps: int, interpret: bool) -> bool:
  """Whether slabs of kernel-native words decode two weights per inline-PTX instance
  (:func:`_pair_ptx`; bf16 / f16 x only, :func:`_slab_to_float`): compiled kernels whose
  threads each hold an even share of a ``[16, block_n]`` words tile."""
  return (PAIRED_PTX and not interpret
          and pairs_fit(packing.NATIVE_TILE_K // 8, block_n, num_warps))


def _slab_to_float(words: jax.Array, nibble: int, dtype,
                   paired: bool) -> tuple[jax.Array, float]:
  """Nibble ``nibble`` of every word ``[R, C]`` uint32 -> (C + q in ``dtype``, C), exactly;
  with ``paired`` (GPU, bf16 / f16) two weights per PRMT + LOP3 in inline PTX."""
  dtype = jnp.dtype(dtype)
  if paired and dtype in _MAGIC:
    [out] = plgpu.elementwise_inline_asm(
        _pair_ptx(nibble, _MAGIC_PAIR[dtype]), args=[words], constraints="=r,r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, dtype)])
    return out, _MAGIC[dtype][1]
  q = (words >> (4 * nibble)) & 0xF if nibble else words & 0xF
  return _codes_to_float(q, dtype)


def _codes_to_float(q: jax.Array, dtype) -> tuple[jax.Array, float]:
  """uint32 codes in [0, 15] -> (C + q in ``dtype``, C), exactly."""
  dtype = jnp.dtype(dtype)
  if dtype in _MAGIC:
    bits, offset = _MAGIC[dtype]
    return lax.bitcast_convert_type((q | bits).astype(jnp.uint16), dtype), offset
  return q.astype(jnp.int32).astype(dtype), 0.0


# Row blocks up to which x is summed by a dot. H100, device time of the dot against the
# vector sum (2026-11-24): M = 4 and 16 (16-row blocks) 1.01-1.20x faster; 32-row blocks
# (M = 32 and 64) 1.03-1.19x faster; 64-row blocks 1.3-1.9x slower (a second
# [64, block_n] f32 accumulator).
SUM_BY_DOT_MAX_BLOCK_M = 32


def sum_by_dot(dtype, block_m: int, max_block_m: int = SUM_BY_DOT_MAX_BLOCK_M) -> bool:
  """Whether a kernel sums x with the tensor cores (:func:`x_sum_add`): 16-bit x only,
  whose products with 1 are exact (the sum is the f32 sum of the vector path), and row
  blocks up to ``max_block_m`` (a kernel may bound it tighter than the INT4 kernel's)."""
  return SUM_BY_DOT and jnp.dtype(dtype) in _MAGIC and block_m <= max_block_m


def x_sum_start(block_m: int, block_n: int, slab: int, by_dot: bool) -> jax.Array:
  """The zero running sum of x over a group's slabs: ``[block_m, block_n]`` when summed
  by a dot, ``[block_m, slab]`` (reduced at the end) otherwise."""
  return jnp.zeros((block_m, block_n if by_dot else slab), jnp.float32)


def x_sum_add(xpart: jax.Array, xs: jax.Array, by_dot: bool) -> jax.Array:
  """Adds the slab ``xs [block_m, slab]`` to the running sum of x.

  By dot: ``xs @ ones [slab, block_n]`` on the tensor cores, which leaves every row's sum
  already broadcast over the columns, as the epilogue needs it (sm_90 SASS of the M = 16
  loop, triton 3.6: 561 -> 364 instructions; the vector path widened and added the
  warp-replicated x tile, about 1 instruction per weight). Otherwise in f32 vector adds.
  """
  if by_dot:
    return xpart + plgpu.dot(xs, jnp.ones((xs.shape[1], xpart.shape[1]), xs.dtype))
  return xpart + xs.astype(jnp.float32)


def x_sum_total(xpart: jax.Array, by_dot: bool) -> jax.Array:
  """The group's x sum, ``[block_m, block_n]`` or ``[block_m, 1]`` (one row reduction per
  group, not per slab: it costs cross-lane shuffles)."""
  return xpart if by_dot else jnp.sum(xpart, axis=1, keepdims=True)


def accumulate_k_step(acc, k_step, load_words, load_x, load_group, *, k, group_size,
                      tile_k, block_m, block_n, block_k, dtype, has_zeros, has_biases,
                      paired, by_dot, precision):
  """``acc + x[:, k_step : k_step + block_k] @ W[k_step : k_step + block_k, cols]``.

  The dequantize-in-registers step every tiled INT4 kernel shares (the dense one here, the
  grouped MoE kernel): each slab of the packed words becomes ``C + q`` in x's dtype
  (:func:`_slab_to_float`) and is multiplied against its ``[block_m, slab]`` slice of x;
  the constant, the zero point or bias and the group scale are applied to each chunk's f32
  partial product after the dots (module doc).

  Args:
    acc: ``[block_m, block_n]`` float32.
    k_step: first K row of the step (traced).
    load_words: ``load_words(k_tile) -> [tile_k // 8, block_n]`` uint32 code words of the
      K-tile starting at row ``k_tile`` (tile order ``tile_k``).
    load_x: ``load_x(k0) -> [block_m, tile_k // 8]`` activations of rows ``k0 ..``,
      loaded from the ref (with the caller's masks: 0 past K).
    load_group: ``load_group(g) -> [scales, zeros or biases]``, ``[1, block_n]`` rows of
      group ``g`` (only the scales when symmetric; finite past the last group).
    has_zeros, has_biases: the weight's form (neither: symmetric, ``z = 8``).
    dtype: the activations' dtype (the dots run in it).
    paired, by_dot, precision: see :func:`pairs_fit`, :func:`sum_by_dot`,
      :func:`pallas_kernels.common.dot_precision`.
  """
  slab = tile_k // 8
  # Rows of one step that share a scale row (all of them for one group per column): a
  # common divisor of group and step, so that no chunk straddles two groups (48-row groups
  # in 128-row steps give 16-row chunks).
  chunk = block_k if group_size >= k else math.gcd(group_size, block_k)
  # The step's scale rows are loaded first, so that their latency overlaps the slabs.
  tables = [load_group((k_step + c * chunk) // group_size) for c in range(block_k // chunk)]
  words = {}
  for c in range(block_k // chunk):
    k_chunk = k_step + c * chunk
    part = jnp.zeros((block_m, block_n), jnp.float32)
    xpart = x_sum_start(block_m, block_n, slab, by_dot)
    offset = 0.0
    for p in range(chunk // slab):
      row = c * chunk + p * slab  # row of the step at which this slab starts
      t, j = row // tile_k, (row % tile_k) // slab
      if t not in words:
        words[t] = load_words(k_step + t * tile_k)
      wq, offset = _slab_to_float(words[t], j, dtype, paired)
      xs = load_x(k_chunk + p * slab)
      part += plgpu.dot(xs, wq, precision=precision)  # = x_slab @ (C + q_slab), f32
      xpart = x_sum_add(xpart, xs, by_dot)
    xsum = x_sum_total(xpart, by_dot)
    s = tables[c][0].astype(jnp.float32)
    if has_biases:
      acc += part * s + xsum * (tables[c][1].astype(jnp.float32) - offset * s)
      continue
    if not has_zeros:
      z = jnp.float32(8.0 + offset)
    else:
      z = tables[c][1].astype(jnp.float32) + offset
    acc += (part - xsum * z) * s
  return acc


def _int4_kernel(x_ref, w_ref, s_ref, z_ref, b_ref, o_ref, *, m, k, group_size, tile_k,
                 block_m, block_n, block_k, steps_per_split, split_k, paired,
                 by_dot, precision):
  """One ``[block_m, block_n]`` output tile over ``steps_per_split`` K steps.

  Refs (whole arrays):
    x_ref: ``[M, K]`` bf16 / f16 / f32.
    w_ref: ``[Kp // 8, N]`` uint32 codes in tile order ``tile_k``.
    s_ref: ``[K // G, N]`` scales.
    z_ref: ``[K // G, N]`` uint8 zero points, or None.
    b_ref: ``[K // G, N]`` float biases, or None (both None: symmetric, z = 8).
    o_ref: ``[M, N]`` in x's dtype (split_k == 1) or ``[split_k, M, N]`` float32.
  """
  pid_n, pid_m, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n = w_ref.shape[1]
  num_groups = s_ref.shape[0]
  m0 = pid_m * block_m
  n0 = pid_n * block_n
  m_mask = (m0 + jnp.arange(block_m)) < m
  n_mask = (n0 + jnp.arange(block_n)) < n
  # Masks along the contiguous axis keep Triton from vectorizing: only where ragged.
  m_ragged, n_ragged, k_ragged = m % block_m != 0, n % block_n != 0, k % tile_k != 0
  slab = tile_k // 8

  def row_mask(g):
    if not (n_ragged or k_ragged):
      return None
    return n_mask[None, :] & (g < num_groups)

  def load_group(g):
    return [_load(r.at[pl.ds(g, 1), pl.ds(n0, block_n)], row_mask(g))
            for r in (s_ref, z_ref, b_ref) if r is not None]

  def load_words(k_tile):
    return _load(w_ref.at[pl.ds(k_tile // 8, slab), pl.ds(n0, block_n)],
                 mask=n_mask[None, :] if n_ragged else None)

  def load_x(k0):
    x_mask = m_mask[:, None] if m_ragged else None
    if k_ragged:
      kx = ((k0 + jnp.arange(slab)) < k)[None, :]
      x_mask = kx if x_mask is None else x_mask & kx
    return _load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, slab)], x_mask)

  def step(i, acc):
    k_step = (pid_k * steps_per_split + i) * block_k
    return accumulate_k_step(
        acc, k_step, load_words, load_x, load_group, k=k, group_size=group_size,
        tile_k=tile_k, block_m=block_m, block_n=block_n, block_k=block_k,
        dtype=x_ref.dtype, has_zeros=z_ref is not None, has_biases=b_ref is not None,
        paired=paired, by_dot=by_dot, precision=precision)

  acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
  out_mask = m_mask[:, None] & n_mask[None, :] if (m_ragged or n_ragged) else None
  common.store_tile(o_ref, acc, m0=m0, n0=n0, block_m=block_m, block_n=block_n, pid_k=pid_k,
                    split_k=split_k, mask=out_mask)


# Programs a small-M launch aims for: about two per SM of an H100 (132 SMs).
_TARGET_PROGRAMS = 256


def heuristic_config(m: int, k: int, n: int) -> KernelConfig:
  """A config for shapes missing from the tuning table.

  Large M: the best tile of the H100 sweeps. Small M (memory-bound): enough programs to
  keep every SM reading, from narrower column blocks and split-K when N is small (a
  576 x 576 projection gets 18 column blocks x 5 K splits instead of 9 programs);
  reproduces the tuned configs of the 4096-class shapes.
  """
  if m > 64:
    return KernelConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
  tiles = -(-k // packing.NATIVE_TILE_K)
  if n > 8192:
    block_n, stages = 128, 3
  else:
    block_n, stages = (64 if n >= 2048 else 32), 4
  cols = -(-n // block_n)
  split_k = max(1, min(-(-_TARGET_PROGRAMS // cols), tiles))
  block_k = 256 if tiles // split_k >= 2 else 128
  return KernelConfig(block_m=max(16, common.next_pow2(m)), block_n=block_n, block_k=block_k,
                      split_k=split_k, num_warps=4, num_stages=stages)


def int4_heuristic_config(m: int, k: int, n: int) -> KernelConfig:
  """:func:`heuristic_config` for the INT4 kernel: 32-row blocks for 16 < M <= 64, where
  the x sum runs on the tensor cores (H100, M = 64: 14336x4096 88.0 -> 43.7 us,
  4096x4096 20.4 -> 17.2; the 8192x28672 best was within 2 % of the 64-row block)."""
  config = heuristic_config(m, k, n)
  if 16 < m <= 64:
    config = dataclasses.replace(config, block_m=32)
  return config


def legalize(config: KernelConfig, k: int, tile_k: int) -> KernelConfig:
  """Fits a config to the shape: block_k a power-of-two multiple of tile_k that divides
  Kp, and split_k dividing the number of K steps."""
  kp = -(-k // tile_k) * tile_k
  block_k = max(config.block_k, tile_k)
  while kp % block_k:  # ends at tile_k, which divides Kp
    block_k //= 2
  steps = kp // block_k
  split_k = max(1, min(config.split_k, steps))
  while steps % split_k:
    split_k -= 1
  return dataclasses.replace(config, block_k=block_k, split_k=split_k)


def declines(w: Int4Weight, dtype=None) -> str | None:
  """Why the kernel cannot run ``w``, or None (``qjax.Backend.declines``, which
  ``qjax.kernel_layouts`` asks): it reads one ``[K, N]`` matrix, not a stack."""
  del dtype  # every activation dtype runs
  if w.codes.ndim != 2:
    return (f"codes of shape {tuple(w.codes.shape)}: the dense INT4 kernel reads one [K, N] "
            "matrix (an expert stack is qjax.moe_matmul's, whose INT4 kernels read it)")
  return None


def int4_matmul(x: jax.Array, w: Int4Weight, *, interpret: bool = False,
                config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype with the fused kernel.

  Codes in another tile order than the kernel-native one are repacked first (lossless;
  store weights in the native order to avoid that per call).

  Args:
    poison: for tests: the output buffer starts as NaN (aliased into the kernel), so an
      element the kernel fails to write shows up as NaN.

  Raises:
    NotImplementedError: batched codes (vmap instead), or a group size that is not a
      multiple of 16 (the slab height).
  """
  if w.codes.ndim != 2:
    raise NotImplementedError(
        f"codes of shape {w.codes.shape}: the kernel takes one [K, N] weight; vmap over "
        "leading axes")
  if w.tile_k != packing.NATIVE_TILE_K:
    w = w.repack(packing.NATIVE_TILE_K)
  slab = w.tile_k // 8
  if w.group_size < w.shape[0] and w.group_size % slab:
    raise NotImplementedError(f"group_size={w.group_size} must be a multiple of {slab}")
  m, k = x.shape
  n = w.shape[1]
  if config is None:
    config = _lookup_config(m, k, n)
  if int4_gemv.supports(m, k, w.group_size) and (config is None or config.block_m == 1):
    # One row: the FMA kernel beats a 1/16-used tensor-core tile (see int4_gemv).
    return int4_gemv.int4_gemv(x, w, config=config, interpret=interpret, poison=poison)
  if config is None or config.block_m == 1:
    config = int4_heuristic_config(m, k, n)
  config = legalize(config, k, w.tile_k)
  steps = w.codes.shape[0] * 8 // config.block_k
  split_k = config.split_k
  kernel = functools.partial(
      _int4_kernel, m=m, k=k, group_size=w.group_size, tile_k=w.tile_k,
      block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
      steps_per_split=steps // split_k, split_k=split_k,
      paired=paired_decode(config.block_n, config.num_warps, interpret),
      by_dot=sum_by_dot(x.dtype, config.block_m),
      precision=common.dot_precision(x.dtype, interpret))
  return common.launch(kernel, [x, w.codes, w.scales, w.zeros, w.biases], m=m, n=n,
                       dtype=x.dtype, config=config, interpret=interpret, poison=poison,
                       name="qjax_int4_matmul")


def _lookup_config(m: int, k: int, n: int) -> KernelConfig | None:
  from qjax._src import tuning  # pylint: disable=g-import-not-at-top
  return tuning.lookup(jax.devices()[0].device_kind, "int4", m, k, n)


def int4_candidate_configs(m: int, k: int, n: int) -> list[KernelConfig]:
  """The INT4 backend's search space: the GEMV kernel's at M = 1, else the tiled one's,
  with 32-row blocks added for 32 < M <= 64 (see :func:`int4_heuristic_config`)."""
  if m == 1:
    return int4_gemv.candidate_configs(k, n)
  configs = candidate_configs(m, k, n)
  if 32 < m <= 64:
    configs += [dataclasses.replace(c, block_m=32) for c in configs]
  return configs


def candidate_configs(m: int, k: int, n: int) -> list[KernelConfig]:
  """The tiled kernel's search space for one shape (the region the H100 sweeps found best;
  the FP4 and codebook kernels share it)."""
  del k, n
  if m > 64:
    return [KernelConfig(block_m=bm, block_n=bn, block_k=128, num_warps=w, num_stages=3)
            for bm, bn, w in ((64, 128, 4), (128, 128, 8), (64, 64, 4))]
  bm = max(16, common.next_pow2(m))
  return [KernelConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=4,
                       num_stages=stages)
          for bn, bk, split, stages in ((64, 256, 1, 4), (64, 256, 2, 4), (128, 256, 2, 3),
                                        (64, 512, 2, 3), (128, 256, 4, 3), (64, 256, 4, 4),
                                        (32, 256, 2, 4), (128, 512, 2, 3))]
