"""Fused FP4 (E2M1) dequantize + matmul in Pallas, for MXFP4 and NVFP4, lowered to Triton.

Contract (qjax's XLA path is the reference): ``y = x @ W`` with ``W[k, n] = e2m1(q[k, n])
* scale[k // B, n]`` (MXFP4: ``B = 32``, ``scale = 2 ** (e - 127)``; NVFP4: ``B = 16``,
``scale = f32(e4m3) * global_scale``); float32 accumulation, output in x's dtype.

How the kernel reads the weight: as the INT4 kernel does. Codes arrive in the
kernel-native tile order (``tile_k = 128``): one load of ``[16, block_n]`` uint32 words
holds 8 row slabs of 16, slab ``j`` in nibble ``j``; each slab is multiplied against a
``[block_m, 16]`` slice of x loaded from the ref.

E2M1 to float in registers, without a table (the Marlin bit trick): shift the word so
that slab ``j``'s nibble ``s e1 e0 m`` sits in bits 12..15, then
``(v & 0x8000) | ((v & 0x7000) >> 3)`` is the float16 with sign ``s``, exponent field
``e1 e0`` and mantissa ``m``: exactly ``e2m1 * 2**-14`` (the code ``e = 0, m = 1`` becomes
the f16 subnormal ``2**-15``, so the subnormal needs no special case). bf16 and f32
activations take that f16 widened (exact: every such value is a normal bf16). The
``2**14`` and the block scale (and NVFP4's tensor scale) are one multiply per block and
column of the f32 partial product, after the dots:
``acc += (x_b @ (e2m1_b * 2**-14)) * (2**14 * scale_b)``.

On the GPU with bf16 / f16 x the same bits are placed two weights at a time in inline
PTX (:func:`_e2m1_pair_ptx`: a PRMT, two shifts, an and and a LOP3 per pair; bf16 reads
them as its exact subnormal ``e2m1 * 2**-126`` and one ``fma.rn.bf16x2`` by ``2**112``
brings it to the same ``2**-14``). H100, M = 4-64: from 1.40x faster to 1.03x slower
than the Pallas-op decode (BENCHMARKS.md, session 10).

Block scales are decoded from their bytes in the kernel (:mod:`pallas_kernels.fp4_codec`),
with Pallas ops or, where the config asks (``KernelConfig.ptx_scales``, chosen per shape
by the tuner), in inline PTX with the decoder's constant factor applied once per output.
H100, M = 16, tuned: MXFP4 4096x14336 38.2 -> 32.9 us, 8192x28672 134.8 -> 101.5 us; on
4096x4096 the Pallas-op decoder stays faster (BENCHMARKS.md, session 15).

One row of x (M = 1) goes to :mod:`pallas_kernels.fp4_gemv` instead: no tensor cores,
FMAs in registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import KernelConfig
from qjax import MXFP4Weight
from qjax import NVFP4Weight
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import fp4_codec
from pallas_kernels import fp4_gemv
from pallas_kernels import int4_gemv
from pallas_kernels import int4_matmul

_load = common.load

# Re-exported: the MoE kernel and older callers reach them here.
E2M1_TO_F16_SCALE = fp4_codec.E2M1_TO_F16_SCALE
E4M3_TO_F16_SCALE = fp4_codec.E4M3_TO_F16_SCALE
scale_decoder = fp4_codec.scale_decoder

heuristic_config = int4_matmul.heuristic_config
candidate_configs = int4_matmul.candidate_configs


# Where a 16-bit float keeps the sign and the lowest of the three E2M1 magnitude bits
# ``e1 e0 m`` so that the bits read as ``e2m1 * 2**-14`` (float16: exponent field ``e1 e0``,
# top mantissa bit ``m``) or ``e2m1 * 2**-126`` (bfloat16: the same bits at its exponent's
# two lowest bits and top mantissa bit; ``e = 0`` is a bf16 subnormal, exact).
_PAIR_MAGNITUDE_LSB = {jnp.dtype(jnp.float16): 9, jnp.dtype(jnp.bfloat16): 6}
# bf16x2 pair of 2**112 (exponent field 239) and of -0.0: the one exact fma that moves the
# bf16 decode from 2**-126 to the float16 decode's 2**-14 (so both share one factor).
_BF16_PAIR_2_112 = 0x77807780
_BF16_PAIR_NEG_ZERO = 0x80008000

# Set False to decode with Pallas ops on the GPU too (the A/B switch).
PAIRED_PTX = True


@functools.lru_cache(maxsize=None)
def _e2m1_pair_ptx(nibble: int, dtype_name: str) -> str:
  """PTX: two code words ``$1``, ``$2`` (adjacent elements) -> ``$0``, the two 16-bit floats
  ``e2m1 * 2**-14`` of their nibble ``nibble`` (low half from ``$1``).

  One PRMT copies the byte holding the nibble from each word into both bytes of its half;
  from the high copy, the nibble's sign goes to bit 15 (odd nibbles are there already,
  even ones take a shift by 4) and its magnitude bits to their place (one shift), and one
  and plus one LOP3 keep exactly those bits: 4-5 instructions per two weights; bf16 adds
  one exact ``fma.rn.bf16x2`` by ``2**112`` (its decode is a subnormal-aware
  ``e2m1 * 2**-126``).
  """
  dtype = jnp.dtype(dtype_name)
  byte = nibble // 2
  selector = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)
  high_copy = 8 + 4 * (nibble % 2)  # bit of the nibble's lowest bit in the high byte copy
  lsb = _PAIR_MAGNITUDE_LSB[dtype]
  magnitude_mask = (0x7 << lsb) | (0x7 << (16 + lsb))
  lines = ["{", ".reg .b32 t, s, v;", f"prmt.b32 t, $1, $2, {selector:#06x};"]
  lines.append("shl.b32 s, t, 4;" if nibble % 2 == 0 else "mov.b32 s, t;")
  shift = lsb - high_copy
  lines.append(f"shl.b32 v, t, {shift};" if shift > 0 else f"shr.u32 v, t, {-shift};")
  lines.append(f"and.b32 v, v, {magnitude_mask:#010x};")
  out = "$0" if dtype == jnp.float16 else "t"
  lines.append(f"lop3.b32 {out}, s, 0x80008000, v, {int4_gemv.LOP3_A_AND_B_OR_C:#04x};")
  if dtype == jnp.bfloat16:
    lines += [f"mov.b32 s, {_BF16_PAIR_2_112:#010x};", f"mov.b32 v, {_BF16_PAIR_NEG_ZERO:#010x};",
              "fma.rn.bf16x2 $0, t, s, v;"]
  lines.append("}")
  return "\n".join(lines)


def paired_decode(dtype, block_n: int, num_warps: int, interpret: bool) -> bool:
  """Whether slabs decode two weights per inline-PTX instance (:func:`_e2m1_pair_ptx`):
  compiled kernels with bf16 / f16 x, and an even share of each words tile per thread."""
  return (PAIRED_PTX and not interpret and jnp.dtype(dtype) in _PAIR_MAGNITUDE_LSB
          and int4_matmul.pairs_fit(packing.NATIVE_TILE_K // 8, block_n, num_warps))


def _e2m1_slab(words: jax.Array, j: int, dtype, paired: bool = False) -> jax.Array:
  """Slab ``j`` of ``[16, block_n]`` uint32 words -> E2M1 values * 2**-14 in ``dtype``."""
  if paired:
    [out] = plgpu.elementwise_inline_asm(
        _e2m1_pair_ptx(j, jnp.dtype(dtype).name), args=[words], constraints="=r,r,r",
        pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, dtype)])
    return out
  shift = 4 * j - 12  # moves nibble j to bits 12..15
  if shift > 0:
    v = words >> shift
  elif shift < 0:
    v = words << -shift
  else:
    v = words
  bits = (v & 0x8000) | ((v & 0x7000) >> 3)
  w16 = lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
  if jnp.dtype(dtype) == jnp.float16:
    return w16
  # Through f32: two plain widen / narrow conversions, both exact here.
  return w16.astype(jnp.float32).astype(dtype)


def accumulate_k_tile(acc, words, load_x, load_scale, *, k_tile, tile_k, block_size,
                      dtype, decode, factor=None, paired=False, precision=None):
  """``acc + x[:, k_tile : k_tile + tile_k] @ W[k_tile : k_tile + tile_k, cols]``.

  The dequantize-in-registers step every FP4 kernel shares: slab ``j`` of the packed
  words is turned into E2M1 values (times 2**-14) and multiplied against the matching
  ``[block_m, slab]`` slice of x; the block scale is applied to the f32 partial product
  of each block, after the dots, times ``factor`` (the decoder's constant) where one is
  given; else the caller applies it, once per output.

  Args:
    acc: ``[block_m, block_n]`` float32.
    words: ``[tile_k // 8, block_n]`` uint32 codes of one K-tile (tile order ``tile_k``).
    load_x: ``load_x(k0) -> [block_m, tile_k // 8]`` activations of rows ``k0 ..``,
      loaded from the ref (with the caller's masks).
    load_scale: ``load_scale(g) -> [1, block_n]`` uint8 scale bytes of block row ``g``.
    k_tile: first K row of the tile (traced or static).
    dtype: the activations' dtype (the dots run in it).
    decode, factor: from :func:`scale_decoder` (factor None: applied by the caller).
    paired: decode two weights per inline-PTX instance (:func:`paired_decode`).
    precision: the dots' (:func:`pallas_kernels.common.dot_precision`).
  """
  slab = tile_k // 8
  slabs_per_block = block_size // slab
  for b in range(tile_k // block_size):
    part = None
    for p in range(slabs_per_block):
      j = b * slabs_per_block + p
      d = plgpu.dot(load_x(k_tile + j * slab), _e2m1_slab(words, j, dtype, paired),
                    precision=precision)  # f32
      part = d if part is None else part + d
    scale = decode(load_scale(k_tile // block_size + b))
    acc += part * (scale if factor is None else scale * factor)
  return acc


def _fp4_kernel(x_ref, w_ref, s_ref, g_ref, o_ref, *, m, k, scale_format, block_size,
                tile_k, block_m, block_n, block_k, steps_per_split, split_k, paired,
                factor_at_end, ptx_scales, precision):
  """One ``[block_m, block_n]`` output tile over ``steps_per_split`` K steps.

  Refs (whole arrays):
    x_ref: ``[M, K]`` bf16 / f16 / f32.
    w_ref: ``[Kp // 8, N]`` uint32 E2M1 codes in tile order ``tile_k``.
    s_ref: ``[K // B, N]`` uint8 scale bytes (E8M0 or e4m3 bits, per ``scale_format``).
    g_ref: ``[1, 1]`` float32 tensor scale (NVFP4), or None.
    o_ref: ``[M, N]`` in x's dtype (split_k == 1) or ``[split_k, M, N]`` float32.

  ``factor_at_end``: the decoder's constant factor multiplies each output once instead of
  every block's partial product; ``ptx_scales``: decode the scale bytes in inline PTX.
  """
  pid_n, pid_m, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n = w_ref.shape[1]
  num_blocks = s_ref.shape[0]
  m0 = pid_m * block_m
  n0 = pid_n * block_n
  m_mask = (m0 + jnp.arange(block_m)) < m
  n_mask = (n0 + jnp.arange(block_n)) < n
  # Masks along the contiguous axis keep Triton from vectorizing: only where ragged.
  m_ragged, n_ragged, k_ragged = m % block_m != 0, n % block_n != 0, k % tile_k != 0
  slab = tile_k // 8
  decode, factor = scale_decoder(scale_format, None if g_ref is None else g_ref[...],
                                 use_ptx=ptx_scales)

  def load_x(k0):
    x_mask = m_mask[:, None] if m_ragged else None
    if k_ragged:
      kx = ((k0 + jnp.arange(slab)) < k)[None, :]
      x_mask = kx if x_mask is None else x_mask & kx
    return _load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, slab)], x_mask)

  def load_scale(g):
    s_mask = n_mask[None, :] & (g < num_blocks) if (n_ragged or k_ragged) else None
    return _load(s_ref.at[pl.ds(g, 1), pl.ds(n0, block_n)], s_mask)

  def step(i, acc):
    k_step = (pid_k * steps_per_split + i) * block_k
    for t in range(block_k // tile_k):
      k_tile = k_step + t * tile_k
      words = _load(w_ref.at[pl.ds(k_tile // 8, slab), pl.ds(n0, block_n)],
                    mask=n_mask[None, :] if n_ragged else None)
      acc = accumulate_k_tile(acc, words, load_x, load_scale, k_tile=k_tile, tile_k=tile_k,
                              block_size=block_size, dtype=x_ref.dtype, decode=decode,
                              factor=None if factor_at_end else factor, paired=paired,
                              precision=precision)
    return acc

  acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
  if factor_at_end:
    acc = acc * factor
  out_mask = m_mask[:, None] & n_mask[None, :] if (m_ragged or n_ragged) else None
  common.store_tile(o_ref, acc, m0=m0, n0=n0, block_m=block_m, block_n=block_n, pid_k=pid_k,
                    split_k=split_k, mask=out_mask)


def fp4_matmul(x: jax.Array, w: MXFP4Weight | NVFP4Weight, *, interpret: bool = False,
               config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype with the fused kernel.

  Codes in another tile order than the kernel-native one are repacked first (lossless;
  store weights in the native order to avoid that per call).

  Args:
    poison: for tests: the output buffer starts as NaN (aliased into the kernel), so an
      element the kernel fails to write shows up as NaN.

  At M = 1 the GEMV kernel runs instead (:mod:`pallas_kernels.fp4_gemv`), unless
  ``config`` asks for tiles of several rows (``block_m > 1``).

  Raises:
    NotImplementedError: batched codes (vmap instead).
  """
  if not isinstance(w, (MXFP4Weight, NVFP4Weight)):
    raise TypeError(f"fp4_matmul takes an MXFP4Weight or NVFP4Weight, got {type(w).__name__}")
  if w.codes.ndim != 2:
    raise NotImplementedError(
        f"codes of shape {w.codes.shape}: the kernel takes one [K, N] weight; vmap over "
        "leading axes")
  if w.tile_k != packing.NATIVE_TILE_K:
    w = w.repack(packing.NATIVE_TILE_K)
  m, k = x.shape
  n = w.shape[1]
  if config is None:
    config = _lookup_config(w.format_name, m, k, n)
  if fp4_gemv.supports(m, k, w.block_size) and (config is None or config.block_m == 1):
    # One row: the FMA kernel beats a 1/16-used tensor-core tile (see fp4_gemv).
    return fp4_gemv.fp4_gemv(x, w, config=config, interpret=interpret, poison=poison)
  if config is None or config.block_m == 1:
    config = heuristic_config(m, k, n)
  config = int4_matmul.legalize(config, k, w.tile_k)
  steps = w.codes.shape[0] * 8 // config.block_k
  split_k = config.split_k
  scale_format, scales, global_scale = fp4_codec.kernel_scales(w)
  kernel = functools.partial(
      _fp4_kernel, m=m, k=k, scale_format=scale_format, block_size=w.block_size,
      tile_k=w.tile_k, block_m=config.block_m, block_n=config.block_n,
      block_k=config.block_k, steps_per_split=steps // split_k, split_k=split_k,
      paired=paired_decode(x.dtype, config.block_n, config.num_warps, interpret),
      factor_at_end=config.ptx_scales,
      ptx_scales=config.ptx_scales and fp4_codec.use_ptx_scales(config.block_n, interpret),
      precision=common.dot_precision(x.dtype, interpret))
  return common.launch(kernel, [x, w.codes, scales, global_scale], m=m, n=n, dtype=x.dtype,
                       config=config, interpret=interpret, poison=poison,
                       name=f"qjax_{w.format_name}_matmul")


def _lookup_config(fmt: str, m: int, k: int, n: int) -> KernelConfig | None:
  from qjax._src import tuning  # pylint: disable=g-import-not-at-top
  return tuning.lookup(jax.devices()[0].device_kind, fmt, m, k, n)


def fp4_candidate_configs(m: int, k: int, n: int) -> list[KernelConfig]:
  """The FP4 backend's search space: the GEMV kernel's at M = 1, else the tiled one's,
  each with the block scales decoded by Pallas ops and (where the width fits) by inline
  PTX (``KernelConfig.ptx_scales``)."""
  if m == 1:
    return fp4_gemv.candidate_configs(k, n)
  out = []
  for cfg in candidate_configs(m, k, n):
    out.append(cfg)
    if fp4_codec.ptx_scales_fit(cfg.block_n):
      out.append(dataclasses.replace(cfg, ptx_scales=True))
  return out
