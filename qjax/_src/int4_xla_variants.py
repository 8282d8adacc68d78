"""XLA formulations of the Int4Weight matmul that move fewer bytes than ``materialize``.

``matmul_xla``'s default, ``"materialize"``, dequantizes all of W ``[K, N]`` into x's
dtype in one XLA fusion (it reads 0.5 byte per weight and writes 2) that ``jnp.dot``
then reads again (2): about 4.5 bytes per weight, where the packed codes are 0.5. The
variants below keep what lies between the codes and the dot narrow, or skip the dot:

* ``grouped``: ``q - z`` as int8 ``[K // G, G, N]`` (1 byte written, 1 read), one dot
  per group, ``einsum('mgk,gkn->gmn')`` with the int8 -> x dtype convert in the dot's
  operand (which XLA's GEMM fusion on GPU can fuse), float32 partial sums
  ``[K // G, M, N]``, then the scales and a sum over the groups.
* ``folded``: the zero point (or float bias) folded out of the dot,
  ``sum_k x_k (q_k - z) s = s (x_g . (q_g - 8)) + (8 - z) s sum(x_g)`` (nothing to add
  for a symmetric weight), so the dot takes ``q - 8`` as a native int4 array (0.5 byte
  written, 0.5 read on GPU, where XLA packs 4-bit arrays two per byte; signed, the
  4-bit type XLA's GEMM fusion converts in the operand).
* ``folded_fused``: ``folded`` with no storage boundary: XLA alone decides where the
  unpacking of the words goes (into the dot's operand if its GEMM fusion takes it).
* ``int4``: the codes as a native int4 ``[K, N]`` array ``q - 8``, then the program a
  user holding such an array writes: ``q.astype(x.dtype) * s`` (scales repeated over
  their groups) and ``jnp.dot``, the convert and scale left for XLA to fuse into the dot
  or not. W is bit for bit ``materialize``'s.
* ``reduce``: no dot: ``y[m, n] = sum_k x[m, k] W[k, n]`` as one fused float32
  multiply-and-sum that reads each packed word once (0.5 byte per weight, M times the
  arithmetic of one row); for small M.

A ``blockdiag`` variant (``folded``'s partial sums from one dot of a block-diagonal x
with the int4 codes) was removed on 2026-11-24: it was never the fastest, and on the
H100 (jax 0.11.2) XLA computed it wrong for float32 x at an odd N (relative error 0.72
at M = 1, K = 96, N = 33, groups of 32; right on the CPU).

The narrow code arrays go through ``optimization_barrier``, so that XLA materializes
them as written rather than fusing the unpacking and the convert into a copy in x's
dtype. Partial sums accumulate in float32 (x float32: ``Precision.HIGHEST``), and the
results differ from ``materialize``'s only by float rounding (``int4``'s only by the
dot's summation order).

Choose one with ``matmul(x, w, variant)``, ``int4.matmul_xla(x, w, variant=...)`` or
the module switch ``qjax._src.int4.XLA_VARIANT``; ``"auto"`` asks :func:`select`.
``examples/xla_fallback_bench.py`` times them all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qjax._src import int4
from qjax._src import packing
from qjax._src.int4 import Int4Weight

F32 = jnp.float32


def _precision(x):
  return jax.lax.Precision.HIGHEST if x.dtype == F32 else None


def _fence(a: jax.Array) -> jax.Array:
  """``a``, materialized as it is: XLA's GPU compiler removes the barrier only after
  fusion, so nothing fuses across it there (the CPU compiler removes it before)."""
  return jax.lax.optimization_barrier(a)


def _expand(a: jax.Array, w: Int4Weight) -> jax.Array:
  """``[K // G, N]`` -> ``[K, N]``, each group's row repeated G times."""
  return jnp.repeat(a, w.group_size, axis=0)


def _signed_codes(w: Int4Weight) -> jax.Array:
  """``[K, N]`` int4 ``q - 8``: the codes as the signed 4-bit type, the one XLA's GEMM
  fusion converts in the dot's operand."""
  return (w.unpacked_codes().astype(jnp.int8) - 8).astype(jnp.int4)


def _offset(w: Int4Weight) -> jax.Array | None:
  """``[K // G, N]`` float32 ``o`` with ``W = (q - 8) * s + o`` in each group (None for
  a symmetric weight, where it is 0)."""
  s = w.scales.astype(F32)
  if w.biases is not None:
    return w.biases.astype(F32) + 8 * s
  if w.zeros is not None:
    return (8 - w.zeros.astype(F32)) * s
  return None


def _group_sums(x: jax.Array, w: Int4Weight) -> jax.Array:
  """``[K // G, M, 1]`` float32 sums of x over each group."""
  xs = x.astype(F32).reshape(x.shape[0], w.num_groups, w.group_size).sum(-1)
  return xs.T[:, :, None]


def _combine(p: jax.Array, w: Int4Weight, x: jax.Array, offset: jax.Array | None
             ) -> jax.Array:
  """``sum_g s_g p_g + o_g sum(x_g)`` in x's dtype, for float32 partial sums
  ``p [K // G, M, N]`` and offsets ``o [K // G, N]`` (or None)."""
  t = p * w.scales.astype(F32)[:, None, :]
  if offset is not None:
    t = t + _group_sums(x, w) * offset[:, None, :]
  return t.sum(0).astype(x.dtype)


def _grouped_dot(x: jax.Array, w: Int4Weight, q: jax.Array) -> jax.Array:
  """``[K // G, M, N]`` float32 ``x_g . q_g`` for integer codes ``q [K, N]``."""
  xg = x.reshape(x.shape[0], w.num_groups, w.group_size)
  qg = q.reshape(w.num_groups, w.group_size, -1).astype(x.dtype)
  return jnp.einsum("mgk,gkn->gmn", xg, qg, preferred_element_type=F32,
                    precision=_precision(x))


def matmul_grouped(x: jax.Array, w: Int4Weight) -> jax.Array:
  """(a) Per-group dots on int8 ``q - z`` (on the raw codes ``q`` when there are float
  biases, whose term ``b_g sum(x_g)`` is added after), then scales and a sum over groups."""
  q = w.unpacked_codes().astype(jnp.int8)
  if w.biases is None:
    q = q - (jnp.int8(8) if w.zeros is None else _expand(w.zeros.astype(jnp.int8), w))
  p = _grouped_dot(x, w, _fence(q))
  return _combine(p, w, x, None if w.biases is None else w.biases.astype(F32))


def matmul_folded(x: jax.Array, w: Int4Weight, *, fence: bool = True) -> jax.Array:
  """(b) Per-group dots on int4 ``q - 8``, the zero point or bias folded out:
  ``sum_g s_g (x_g . (q_g - 8)) + o_g sum(x_g)`` with ``o = (8 - z) s`` or ``b + 8 s``
  (no such term for a symmetric weight). ``fence``: materialize the int4 codes (else
  XLA alone chooses what to fuse)."""
  q = _signed_codes(w)
  p = _grouped_dot(x, w, _fence(q) if fence else q)
  return _combine(p, w, x, _offset(w))


def matmul_int4(x: jax.Array, w: Int4Weight) -> jax.Array:
  """(c) Native int4 codes ``q - 8`` ``[K, N]``, then dequantize-and-dot as a user
  holding such an array writes it; W is rounded as ``materialize`` rounds it (in x's
  dtype when the scales are in it and there are no biases, else via float32)."""
  q = _fence(_signed_codes(w))
  e = functools.partial(_expand, w=w)
  ct = x.dtype if (w.biases is None and w.scales.dtype == x.dtype != F32) else F32
  qd = q.astype(ct)  # q - 8, exact
  if w.biases is not None:
    wd = (qd + 8) * e(w.scales.astype(ct)) + e(w.biases.astype(ct))
  elif w.zeros is not None:
    wd = (qd - (e(w.zeros.astype(ct)) - 8)) * e(w.scales.astype(ct))
  else:
    wd = qd * e(w.scales.astype(ct))
  y = jnp.dot(x, wd.astype(x.dtype), preferred_element_type=F32, precision=_precision(x))
  return y.astype(x.dtype)


def matmul_reduce(x: jax.Array, w: Int4Weight) -> jax.Array:
  """No dot: ``y[m, n] = sum_k x[m, k] W[k, n]`` in float32 as one multiply-and-sum over
  the words (:func:`packing.word_plane_sum`): each word's 8 nibbles, dequantized and
  multiplied by their 8 elements of x, are summed in one term, so XLA's reduction reads
  every word once."""
  kp = w.codes.shape[0] * 8

  def rows(a):  # [K // G, N] -> [tiles, 8, slab, N] per row, 0 on the padding rows
    return packing.rows_by_plane(_expand(a.astype(F32), w), kp, w.tile_k)

  s = rows(w.scales)
  o = rows(w.biases) if w.biases is not None else (
      None if w.zeros is None else rows(w.zeros))

  def plane_values(j, q):
    q = q.astype(F32)  # [tiles, slab, N]
    if w.biases is not None:
      return q * s[:, j] + o[:, j]
    return (q - (8 if o is None else o[:, j])) * s[:, j]

  return packing.word_plane_sum(x, w.codes, x.shape[1], w.tile_k, plane_values).astype(x.dtype)


VARIANTS = {
    "materialize": int4.matmul_xla_materialize,
    "grouped": matmul_grouped,
    "folded": matmul_folded,
    "folded_fused": functools.partial(matmul_folded, fence=False),
    "int4": matmul_int4,
    "reduce": matmul_reduce,
}

# select()'s rule on a GPU: (largest M, variant) in order, the last for any M. From
# examples/xla_fallback_bench.py on the H100 (2026-11-24, 4 Llama shapes, M = 1 to
# 2048): at M = 1 "reduce" takes 0.32-0.43x the naive int4 program's time (10.3 vs 25.2
# us at 4096x4096, 32.7 vs 101.8 at 4096x14336) and is 3x slower than "materialize"
# from M = 2 on. "materialize", since it writes W two columns per word
# (formats.column_pairs), takes 0.92-1.04x the naive program's time at every M from 2
# to 2048, the top of that on 4096x4096 (M = 16: 26.5 vs 27.5 us at 4096x4096, 101.3
# vs 104.1 at 4096x14336, 373.9 vs 398.8 at 8192x28672); "folded", the best at M = 16
# before that, is now 1.1-1.2x "materialize" there. On a GPU the fallback runs above
# M = 64 and for small one-row weights (Backend.auto_prefers_xla); the rest serves
# implementation="xla".
AUTO_RULES: tuple[tuple[int | None, str], ...] = ((1, "reduce"), (None, "materialize"))
# Platforms the rule was measured on; elsewhere (the CPU) "auto" materializes W, the
# formulation every test's numbers were first taken with.
AUTO_PLATFORMS = ("gpu",)


def select(m: int, w: Int4Weight) -> str:
  """The variant ``"auto"`` uses for ``M = m`` rows of x (see :data:`AUTO_RULES`)."""
  del w  # The rule may come to depend on the shape and group size.
  if jax.devices()[0].platform not in AUTO_PLATFORMS:
    return "materialize"
  for max_m, name in AUTO_RULES:
    if max_m is None or m <= max_m:
      return name
  return "materialize"


def matmul(x: jax.Array, w: Int4Weight, variant: str = "auto") -> jax.Array:
  """``x [M, K] @ W -> [M, N]`` in x's dtype by the named variant (or ``"auto"``)."""
  if variant == "auto":
    variant = select(x.shape[0], w)
  if variant not in VARIANTS:
    raise ValueError(f"unknown int4 XLA variant {variant!r}; known: auto, "
                     f"{', '.join(VARIANTS)}")
  return VARIANTS[variant](x, w)
