"""Fused codebook lookup + matmul in Pallas, lowered to Triton on NVIDIA GPUs.

Contract (qjax's XLA path for :class:`qjax.CodebookWeight` is the reference)::

  y = sum_g (x_rot_g @ codebook[idx_g]) * norms_g / sqrt(d)   (+ pass 2, own x_rot2)

with ``x_rot`` the activations rotated per group (``x_g @ Pi_g^T``), done in XLA before
the kernel (``M x K x d`` flops, cheap at small M), once per pass. The kernel reads the
packed indices like the INT4 kernel (tile order 128: one ``[16, block_n]`` uint32 load
gives 8 row slabs by shift and mask), turns each 4-bit index into its codebook level in
registers with a tree of 15 selects on the index bits (the 16 levels are scalars loaded
once from an input ref, not captured constants), dots it with the matching ``[block_m, 16]``
slab of ``x_rot`` loaded from the ref, and scales the f32 partial products by
``norms / sqrt(d)`` once per group and column. Pass 2 runs in the same loop.
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

from qjax import CodebookWeight
from qjax import KernelConfig
from qjax._src import codebook as codebook_lib
from qjax._src import packing
from qjax._src import rotation as rotation_lib
from pallas_kernels import common
from pallas_kernels.int4_matmul import heuristic_config
from pallas_kernels.int4_matmul import legalize

_load = common.load


def _lookup(q: jax.Array, levels: list[jax.Array]) -> jax.Array:
  """``q`` uint32 indices in [0, 15] -> ``levels[q]`` by a tree of selects on its bits."""
  for bit in range(4):
    b = ((q >> bit) & 1 if bit else q & 1) == 1
    levels = [jnp.where(b, levels[2 * i + 1], levels[2 * i]) for i in range(len(levels) // 2)]
  return levels[0]


def _codebook_kernel(x_ref, w_ref, n_ref, c_ref, x2_ref, w2_ref, n2_ref, c2_ref, o_ref, *,
                     m, k, group_size, block_m, block_n, block_k, steps_per_split, split_k,
                     precision):
  """One ``[block_m, block_n]`` output tile over ``steps_per_split`` K steps.

  Refs (whole arrays; the ``2`` refs are pass 2, or all None):
    x_ref: ``[M, K]`` rotated activations in the compute dtype (bf16 / f16 / f32).
    w_ref: ``[Kp // 8, N]`` uint32 indices in tile order 128.
    n_ref: ``[K // d, N]`` norms.
    c_ref: ``[16]`` float32 codebook.
    o_ref: ``[M, N]`` in x's dtype (split_k == 1) or ``[split_k, M, N]`` float32.
  """
  pid_n, pid_m, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  tile_k = packing.NATIVE_TILE_K
  n = w_ref.shape[1]
  num_groups = n_ref.shape[0]
  m0 = pid_m * block_m
  n0 = pid_n * block_n
  m_mask = (m0 + jnp.arange(block_m)) < m
  n_mask = (n0 + jnp.arange(block_n)) < n
  m_ragged, n_ragged, k_ragged = m % block_m != 0, n % block_n != 0, k % tile_k != 0
  slab = tile_k // 8
  chunk = min(group_size, block_k)
  inv_sqrt_d = 1.0 / math.sqrt(group_size)
  dtype = x_ref.dtype
  passes = [(x_ref, w_ref, n_ref, [c_ref[j].astype(dtype) for j in range(16)])]
  if w2_ref is not None:
    passes.append((x2_ref, w2_ref, n2_ref, [c2_ref[j].astype(dtype) for j in range(16)]))

  def row_mask(g):
    if not (n_ragged or k_ragged):
      return None
    return n_mask[None, :] & (g < num_groups)

  def step(i, acc):
    k_step = (pid_k * steps_per_split + i) * block_k
    for xr, wr, nr, levels in passes:
      words = {}
      for c in range(block_k // chunk):
        k_chunk = k_step + c * chunk
        part = jnp.zeros((block_m, block_n), jnp.float32)
        for p in range(chunk // slab):
          row = c * chunk + p * slab
          t, j = row // tile_k, (row % tile_k) // slab
          if t not in words:
            words[t] = _load(
                wr.at[pl.ds((k_step + t * tile_k) // 8, slab), pl.ds(n0, block_n)],
                mask=n_mask[None, :] if n_ragged else None)
          q = (words[t] >> (4 * j)) & 0xF if j else words[t] & 0xF
          wv = _lookup(q, levels)  # [slab, block_n] in the compute dtype
          x_mask = m_mask[:, None] if m_ragged else None
          if k_ragged:
            kx = ((k_chunk + p * slab + jnp.arange(slab)) < k)[None, :]
            x_mask = kx if x_mask is None else x_mask & kx
          xs = _load(xr.at[pl.ds(m0, block_m), pl.ds(k_chunk + p * slab, slab)], x_mask)
          part += plgpu.dot(xs, wv, precision=precision)
        g = k_chunk // group_size
        scale = _load(nr.at[pl.ds(g, 1), pl.ds(n0, block_n)], row_mask(g))
        acc += part * (scale.astype(jnp.float32) * inv_sqrt_d)
    return acc

  acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
  out_mask = m_mask[:, None] & n_mask[None, :] if (m_ragged or n_ragged) else None
  common.store_tile(o_ref, acc, m0=m0, n0=n0, block_m=block_m, block_n=block_n, pid_k=pid_k,
                    split_k=split_k, mask=out_mask)


# Shared memory Triton may use for the pipelined loads (the H100 has 227 KiB per block).
_SHARED_MEMORY_BUDGET = 200 * 1024


def _fit_shared_memory(config: KernelConfig, dtype, passes: int) -> KernelConfig:
  """Lowers num_stages until the loads of all stages fit in shared memory.

  Each stage holds, per pass, the rotated activations ``[block_m, block_k]`` and the
  packed indices ``[block_k // 8, block_n]`` uint32 (measured on the H100: two passes at
  block_m = 64, block_k = 256 and 4 stages asked for 306 KiB and failed to launch).
  """
  per_stage = passes * (config.block_m * config.block_k * jnp.dtype(dtype).itemsize
                        + config.block_k // 8 * config.block_n * 4)
  stages = max(1, min(config.num_stages, _SHARED_MEMORY_BUDGET // per_stage))
  return dataclasses.replace(config, num_stages=stages)


def rotated_activations(x: jax.Array, w: CodebookWeight) -> tuple[jax.Array, jax.Array | None]:
  """``x [M, K]`` -> (x rotated for pass 1, for pass 2 or None), in x's dtype."""
  x1 = rotation_lib.rotate_activations(x, w.rotation, w.group_size, w.seed).astype(x.dtype)
  if w.codes2 is None:
    return x1, None
  x2 = rotation_lib.rotate_activations(x, w.rotation, w.group_size, w.seed + 1)
  return x1, x2.astype(x.dtype)


def codebook_matmul(x: jax.Array, w: CodebookWeight, *, interpret: bool = False,
                    config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype with the fused kernel.

  Pass 2 held in pinned host memory is copied to the device first (inside jit, XLA
  schedules that copy).

  Args:
    poison: for tests: the output buffer starts as NaN (aliased into the kernel), so an
      element the kernel fails to write shows up as NaN.

  Raises:
    NotImplementedError: batched codes (vmap instead).
  """
  if w.codes.ndim != 2:
    raise NotImplementedError(
        f"codes of shape {w.codes.shape}: the kernel takes one [K, N] weight; vmap over "
        "leading axes")
  w = codebook_lib.second_pass_on_device(w)
  m, k = x.shape
  n = w.shape[1]
  if config is None:
    config = _lookup_config(m, k, n) or heuristic_config(m, k, n)
  config = _fit_shared_memory(legalize(config, k, packing.NATIVE_TILE_K), x.dtype,
                              passes=1 if w.codes2 is None else 2)
  steps = w.codes.shape[0] * 8 // config.block_k
  split_k = config.split_k
  kernel = functools.partial(
      _codebook_kernel, m=m, k=k, group_size=w.group_size, block_m=config.block_m,
      block_n=config.block_n, block_k=config.block_k, steps_per_split=steps // split_k,
      split_k=split_k, precision=common.dot_precision(x.dtype, interpret))
  x1, x2 = rotated_activations(x, w)
  args = [x1, w.codes, w.norms, w.codebook, x2, w.codes2, w.norms2, w.codebook2]
  return common.launch(kernel, args, m=m, n=n, dtype=x.dtype, config=config,
                       interpret=interpret, poison=poison, name="qjax_codebook_matmul")


def _lookup_config(m: int, k: int, n: int) -> KernelConfig | None:
  from qjax._src import tuning  # pylint: disable=g-import-not-at-top
  return tuning.lookup(jax.devices()[0].device_kind, "codebook", m, k, n)
