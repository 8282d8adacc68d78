"""Fused dequantize + matmul for GGUF Q8_0, Q4_K, Q5_K and Q6_K (Pallas, Triton).

Reads :class:`qjax._src.gguf_tiled.GGUFTiledWeight`, the lossless plane layout of those
types, whose contract is ``W[k, n] = s[g, n] * q[k, n] + b[g, n]`` per group
``g = k // G`` (G = 32, or 16 for Q6_K). The kernel follows the INT4 kernel
(:mod:`pallas_kernels.int4_matmul`): per 16-row slab one shift and mask of the loaded
low-nibble words (plus the high bits of Q5_K / Q6_K from one byte load per 128 / 64
rows), a magic-number conversion to the activation dtype (``C + q``, exact for codes
below 128), one ``[block_m, 16] @ [16, block_n]`` dot, and per group, after the dots::

    acc += (x_g @ (C + q_g)) * s_g + sum(x_g) * (b_g - C * s_g)

where ``s`` and ``b`` are computed in float32 in the kernel from the stored f16 super
scales and the 6/8-bit sub-block scales (exact products), so the scales stay at their
stored width in HBM. Q8_0 converts its int8 codes directly (``C = 0``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels import gguf_gemv
from pallas_kernels import int4_matmul
from qjax import KernelConfig
from qjax._src import gguf_tiled

_load = common.load
_codes_to_float = int4_matmul._codes_to_float  # pylint: disable=protected-access


# Row blocks up to which this kernel sums x by a dot (:func:`int4_matmul.x_sum_add`):
# the compiled GGUF kernels matched float64 on the H100 with it at 16-row blocks
# (2026-11-24); 32-row blocks, where the INT4 kernel also uses it, were not run there.
SUM_BY_DOT_MAX_BLOCK_M = 16


def _gguf_kernel(x_ref, low_ref, high_ref, q8_ref, d_ref, dmin_ref, sc_ref, mn_ref, o_ref, *,
                 ggml_type, m, k, block_m, block_n, block_k, steps_per_split, split_k,
                 by_dot, precision):
  """One ``[block_m, block_n]`` output tile over ``steps_per_split`` K steps.

  Refs (whole arrays; the GGUFTiledWeight fields, None where the type has none):
    x_ref: ``[M, K]``; low_ref ``[Kp // 8, N]`` uint32; high_ref ``[Kp // T * 16, N]``
    uint8; q8_ref ``[Kp, N]`` int8; d_ref ``[K // R, N]`` f16; dmin_ref ``[K // 256, N]``
    f16; sc_ref ``[K // G, N]``; mn_ref ``[K // 32, N]`` uint8;
    o_ref: ``[M, N]`` (split_k == 1) or ``[split_k, M, N]`` float32.
  """
  group, scale_rows, high_bits = gguf_tiled._SPECS[ggml_type]  # pylint: disable=protected-access
  slab = gguf_tiled.SLAB
  tile_k = gguf_tiled.TILE_K
  high_rows = gguf_tiled.high_tile_rows(high_bits) if high_bits else None
  pid_n, pid_m, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n = d_ref.shape[1]
  num_groups = k // group
  m0, n0 = pid_m * block_m, pid_n * block_n
  m_mask = (m0 + jnp.arange(block_m)) < m
  n_mask = (n0 + jnp.arange(block_n)) < n
  m_ragged, n_ragged, k_ragged = m % block_m != 0, n % block_n != 0, k % tile_k != 0
  col_mask = n_mask[None, :] if n_ragged else None

  def group_row(ref, row, valid):
    mask = None
    if n_ragged or k_ragged:
      mask = n_mask[None, :] & valid
    return _load(ref.at[pl.ds(row, 1), pl.ds(n0, block_n)], mask).astype(jnp.float32)

  def step(i, acc):
    k_step = (pid_k * steps_per_split + i) * block_k
    loaded = {}

    def cached(key, fn):
      if key not in loaded:
        loaded[key] = fn()
      return loaded[key]

    def slab_codes(row):
      """The codes of rows ``[k_step + row, +16)`` as ``[16, block_n]`` floats, and C."""
      if q8_ref is not None:
        q = _load(q8_ref.at[pl.ds(k_step + row, slab), pl.ds(n0, block_n)], col_mask)
        return q.astype(x_ref.dtype), 0.0
      t, j = row // tile_k, (row % tile_k) // slab
      words = cached(("low", t), lambda: _load(
          low_ref.at[pl.ds((k_step + t * tile_k) // 8, slab), pl.ds(n0, block_n)], col_mask))
      q = (words >> (4 * j)) & 0xF if j else words & 0xF
      if high_ref is not None:
        th, jh = row // high_rows, (row % high_rows) // slab
        hb = cached(("high", th), lambda: _load(
            high_ref.at[pl.ds((k_step // high_rows + th) * slab, slab),
                        pl.ds(n0, block_n)], col_mask))
        h = (hb >> (high_bits * jh)) & ((1 << high_bits) - 1) if jh else (
            hb & ((1 << high_bits) - 1))
        q = q | (h.astype(jnp.uint32) << 4)
      return _codes_to_float(q, x_ref.dtype)

    for c in range(block_k // group):
      k_group = k_step + c * group
      part = jnp.zeros((block_m, block_n), jnp.float32)
      xpart = int4_matmul.x_sum_start(block_m, block_n, slab, by_dot)
      offset = 0.0
      for p in range(group // slab):
        row = c * group + p * slab
        wq, offset = slab_codes(row)
        x_mask = m_mask[:, None] if m_ragged else None
        if k_ragged:
          kx = ((k_group + p * slab + jnp.arange(slab)) < k)[None, :]
          x_mask = kx if x_mask is None else x_mask & kx
        xs = _load(x_ref.at[pl.ds(m0, block_m), pl.ds(k_group + p * slab, slab)], x_mask)
        part += plgpu.dot(xs, wq, precision=precision)
        if sc_ref is not None:  # Q8_0 has no offset and needs no x sum
          xpart = int4_matmul.x_sum_add(xpart, xs, by_dot)
      xsum = int4_matmul.x_sum_total(xpart, by_dot)
      g = k_group // group
      valid = g < num_groups
      gd = k_group // scale_rows
      d = cached(("d", c * group // scale_rows), lambda: group_row(d_ref, gd, valid))
      if sc_ref is None:  # Q8_0: s = d, b = 0
        acc += part * d
        continue
      s = d * group_row(sc_ref, g, valid)
      if mn_ref is None:  # Q6_K: b = -32 s
        b = -32.0 * s
      else:
        dmin = cached(("dmin", c * group // scale_rows), lambda: group_row(dmin_ref, gd, valid))
        b = -dmin * group_row(mn_ref, g, valid)
      acc += part * s + xsum * (b - offset * s)
    return acc

  acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
  out_mask = m_mask[:, None] & n_mask[None, :] if (m_ragged or n_ragged) else None
  common.store_tile(o_ref, acc, m0=m0, n0=n0, block_m=block_m, block_n=block_n, pid_k=pid_k,
                    split_k=split_k, mask=out_mask)


_FIELDS = ("low", "high", "q8", "d", "dmin", "sc", "mn")


def gguf_matmul(x: jax.Array, w, *, interpret: bool = False,
                config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype.

  Args:
    w: a :class:`GGUFTiledWeight`, or a GGUF Q8_0 / Q4_K / Q5_K / Q6_K block weight
      (converted per call, losslessly; convert once at load with ``kernel_layout``).
    config: None or ``block_m == 1``: one row of x runs :func:`gguf_gemv.gguf_gemv` (its
      config); ``block_m >= 16`` the tiled kernel at any M.
    poison: for tests: the output starts as NaN, so unwritten elements show.

  Raises:
    NotImplementedError: batched weights (vmap instead).
  """
  w = gguf_gemv.tiled_matrix(w)
  m, k = x.shape
  n = w.shape[1]
  if gguf_gemv.supports(m, k, n, w.ggml_type) and (config is None or config.block_m == 1):
    # One row: the FMA kernel beats a 1/16-used tensor-core tile (see gguf_gemv); a config
    # with block_m >= 16 keeps the tiled kernel.
    return gguf_gemv.gguf_gemv(x, w, config=config, interpret=interpret, poison=poison)
  if config is None:
    config = int4_matmul.heuristic_config(m, k, n)
  config = int4_matmul.legalize(config, k, gguf_tiled.TILE_K)
  steps = w.padded_k // config.block_k
  split_k = config.split_k
  kernel = functools.partial(
      _gguf_kernel, ggml_type=w.ggml_type, m=m, k=k, block_m=config.block_m,
      block_n=config.block_n, block_k=config.block_k, steps_per_split=steps // split_k,
      split_k=split_k, by_dot=int4_matmul.sum_by_dot(x.dtype, config.block_m,
                                                     max_block_m=SUM_BY_DOT_MAX_BLOCK_M),
      precision=common.dot_precision(x.dtype, interpret))
  return common.launch(kernel, [x] + [getattr(w, f) for f in _FIELDS], m=m, n=n,
                       dtype=x.dtype, config=config, interpret=interpret, poison=poison,
                       name=f"qjax_gguf_{w.ggml_type.lower()}_matmul")


def int4_via_layout(x: jax.Array, w, *, interpret: bool = False,
                    config: KernelConfig | None = None, poison: bool = False) -> jax.Array:
  """Q4_0 / Q4_1 through the INT4 kernel after their lossless ``to_int4`` (per call)."""
  return int4_matmul.int4_matmul(x, w.to_int4(), interpret=interpret, config=config,
                                 poison=poison)
