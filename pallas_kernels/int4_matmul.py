"""Fused INT4 dequantize + matmul in Pallas, lowered to Triton on NVIDIA GPUs.

Contract (qjax's XLA path is the reference): ``y = x @ W`` with
``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``, float32 accumulation, output in
x's dtype.

How the kernel reads the weight. Codes arrive in the kernel-native tile order
(``qjax._src.packing``): within a K-tile of ``tile_k`` rows, nibble ``j`` of the
``tile_k // 8`` words of a column holds the contiguous row slab ``j``. One load of
``[tile_k // 8, block_n]`` uint32 therefore yields 8 slabs with a shift and a mask each,
and each slab is multiplied against a ``[block_m, tile_k // 8]`` slice of x loaded
straight from the ref: no interleave, no value slice.

Dequantization in registers, without a lookup table and without a multiply per weight:
``bitcast((q | 0x4300) as u16, bf16) == 128 + q`` exactly (``0x6400`` and 1024 for f16),
so each slab costs a shift and a mask-or. The offset ``128 + z`` and the group scale are
applied to the f32 partial products after the dot, once per group and column:
``acc += (x_g @ (C + q_g) - (C + z_g) * sum(x_g)) * s_g``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import KernelConfig
from qjax import Int4Weight

# bf16 / f16 bit patterns whose low mantissa bits take a 4-bit code: value = C + code.
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}


def _codes_to_float(q: jax.Array, dtype) -> tuple[jax.Array, float]:
  """uint32 codes in [0, 15] -> (C + q in ``dtype``, C), exactly."""
  dtype = jnp.dtype(dtype)
  if dtype in _MAGIC:
    bits, offset = _MAGIC[dtype]
    return lax.bitcast_convert_type((q | bits).astype(jnp.uint16), dtype), offset
  return q.astype(jnp.int32).astype(dtype), 0.0


def _int4_kernel(x_ref, w_ref, s_ref, z_ref, o_ref, *, m, k, group_size, tile_k, block_m,
                 block_n, block_k, steps_per_split, split_k):
  """One ``[block_m, block_n]`` output tile over ``steps_per_split`` K steps.

  Refs (whole arrays):
    x_ref: ``[M, K]`` bf16 / f16 / f32.
    w_ref: ``[Kp // 8, N]`` uint32 codes in tile order ``tile_k``.
    s_ref: ``[K // G, N]`` scales.
    z_ref: ``[K // G, N]`` uint8 zero points, or None (symmetric: z = 8).
    o_ref: ``[M, N]`` (split_k == 1) or ``[split_k, M, N]`` float32.
  """
  pid_n, pid_m, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n = w_ref.shape[1]
  num_groups = s_ref.shape[0]
  m0 = pid_m * block_m
  n0 = pid_n * block_n
  m_mask = (m0 + jnp.arange(block_m)) < m
  n_mask = (n0 + jnp.arange(block_n)) < n
  slab = tile_k // 8
  # Rows of one step that share a scale row (all of them for one group per column).
  chunk = block_k if group_size >= k else min(group_size, block_k)
  compute_dtype = x_ref.dtype
  k_ragged = k % tile_k != 0

  def step(i, acc):
    k_step = (pid_k * steps_per_split + i) * block_k
    words = {}
    for c in range(block_k // chunk):
      k_chunk = k_step + c * chunk
      part = jnp.zeros((block_m, block_n), jnp.float32)
      xsum = jnp.zeros((block_m, 1), jnp.float32)
      offset = 0.0
      for p in range(chunk // slab):
        row = c * chunk + p * slab  # row of the step at which this slab starts
        t, j = divmod(row, tile_k)[0], (row % tile_k) // slab
        if t not in words:
          words[t] = plgpu.load(
              w_ref.at[pl.ds((k_step + t * tile_k) // 8, slab), pl.ds(n0, block_n)],
              mask=n_mask[None, :], other=0)
        q = (words[t] >> (4 * j)) & 0xF if j else words[t] & 0xF
        wq, offset = _codes_to_float(q, compute_dtype)
        x_mask = m_mask[:, None]
        if k_ragged:
          x_mask = x_mask & ((k_chunk + p * slab + jnp.arange(slab)) < k)[None, :]
        xs = plgpu.load(x_ref.at[pl.ds(m0, block_m), pl.ds(k_chunk + p * slab, slab)],
                        mask=x_mask, other=0)
        part += plgpu.dot(xs, wq)
        xsum += jnp.sum(xs.astype(jnp.float32), axis=1, keepdims=True)
      g = k_chunk // group_size
      g_mask = n_mask[None, :] & (g < num_groups)
      s = plgpu.load(s_ref.at[pl.ds(g, 1), pl.ds(n0, block_n)], mask=g_mask, other=0)
      if z_ref is None:
        z = jnp.float32(8.0 + offset)
      else:
        z = plgpu.load(z_ref.at[pl.ds(g, 1), pl.ds(n0, block_n)], mask=g_mask, other=0)
        z = z.astype(jnp.float32) + offset
      acc += (part - xsum * z) * s.astype(jnp.float32)
    return acc

  acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
  out_mask = m_mask[:, None] & n_mask[None, :]
  if split_k == 1:
    plgpu.store(o_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                mask=out_mask)
  else:
    plgpu.store(o_ref.at[pid_k, pl.ds(m0, block_m), pl.ds(n0, block_n)], acc, mask=out_mask)


def _next_pow2(v: int) -> int:
  return 1 << max(0, (v - 1).bit_length())


def heuristic_config(m: int, k: int, n: int, group_size: int, tile_k: int) -> KernelConfig:
  """A config for shapes missing from the tuning table."""
  block_m = min(64, max(16, _next_pow2(m)))
  if m > 64:
    return KernelConfig(block_m=128 if m >= 128 else 64, block_n=128, block_k=tile_k,
                        num_warps=8, num_stages=3)
  return KernelConfig(block_m=block_m, block_n=64 if n <= 8192 else 128, block_k=2 * tile_k,
                      num_warps=4, num_stages=4)


def legalize(config: KernelConfig, m: int, k: int, n: int, tile_k: int) -> KernelConfig:
  """Fits a config to the shape: block_k a power-of-two multiple of tile_k that divides
  Kp, split_k dividing the number of K steps."""
  del m, n
  kp = -(-k // tile_k) * tile_k
  block_k = max(config.block_k, tile_k)
  while kp % block_k:  # ends at tile_k, which divides Kp
    block_k //= 2
  steps = kp // block_k
  split_k = max(1, min(config.split_k, steps))
  while steps % split_k:
    split_k -= 1
  return KernelConfig(block_m=config.block_m, block_n=config.block_n, block_k=block_k,
                      split_k=split_k, num_warps=config.num_warps,
                      num_stages=config.num_stages)


def int4_matmul(x: jax.Array, w: Int4Weight, *, interpret: bool = False,
                config: KernelConfig | None = None) -> jax.Array:
  """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype with the fused kernel.

  Codes in another tile order than the kernel-native one are repacked first (lossless;
  store weights in the native order to avoid that per call).
  """
  if w.codes.ndim != 2:
    raise NotImplementedError(
        f"codes of shape {w.codes.shape}: the kernel takes one [K, N] weight; vmap over "
        "leading axes")
  from qjax._src import packing  # pylint: disable=g-import-not-at-top
  if w.tile_k != packing.NATIVE_TILE_K:
    w = w.repack(packing.NATIVE_TILE_K)
  m, k = x.shape
  n = w.shape[1]
  group_size = w.group_size
  if group_size % (w.tile_k // 8):
    raise NotImplementedError(f"group_size={group_size} must be a multiple of {w.tile_k // 8}")
  if config is None:
    config = _lookup_config(m, k, n)
  if config is None:
    config = heuristic_config(m, k, n, group_size, w.tile_k)
  config = legalize(config, m, k, n, w.tile_k)
  kp = w.codes.shape[0] * 8
  steps = kp // config.block_k
  split_k = config.split_k
  kernel = functools.partial(
      _int4_kernel, m=m, k=k, group_size=group_size, tile_k=w.tile_k,
      block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
      steps_per_split=steps // split_k, split_k=split_k)
  if split_k == 1:
    out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
  else:
    out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
  grid = (pl.cdiv(n, config.block_n), pl.cdiv(m, config.block_m), split_k)
  args = (x, w.codes, w.scales, w.zeros)
  out = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      name="qjax_int4_matmul",
  )(*args)
  if split_k > 1:
    out = out.sum(axis=0).astype(x.dtype)
  return out


def _lookup_config(m: int, k: int, n: int) -> KernelConfig | None:
  from qjax._src import tuning  # pylint: disable=g-import-not-at-top
  try:
    kind = jax.devices()[0].device_kind
  except RuntimeError:
    return None
  return tuning.lookup(kind, "int4", m, k, n)


def candidate_configs(m: int, k: int, n: int) -> list[KernelConfig]:
  """The tuner's search space for one shape."""
  del k
  out = []
  if m <= 64:
    bms = [max(16, _next_pow2(m))]
    for bn in (32, 64, 128, 256):
      if bn > 2 * _next_pow2(n):
        continue
      for bk in (128, 256, 512):
        for split in (1, 2, 4):
          for warps in (2, 4, 8):
            for stages in (3, 4, 5):
              out.append(KernelConfig(block_m=bms[0], block_n=bn, block_k=bk, split_k=split,
                                      num_warps=warps, num_stages=stages))
  else:
    for bm in (64, 128):
      for bn in (64, 128, 256):
        for bk in (128, 256):
          for warps in (4, 8):
            for stages in (2, 3, 4):
              out.append(KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                      num_stages=stages))
  return out
