"""The sum of a kernel's K-split partial products, in one fixed order.

Kernels that split K over CTAs (``split_k > 1``) write float32 partials ``[S, ...]`` and
leave their sum to XLA. A reduce over S leaves the order of the additions to XLA's
emitter, which picks it per program (and per compile where fusions are autotuned): the
same partials summed by the scanned stack (``qjax.layer_of``) and by one layer's own call
then came out one bf16 unit apart in a few elements (H100, sessions 21-22). Elementwise
adds in a fixed order give the same bits in every program: XLA does not reassociate
floating-point adds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_splits(parts: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """``((parts[0] + parts[1]) + parts[2]) + ...`` cast to ``dtype``.

  Args:
    parts: ``[S, ...]`` float32 partial products of S K splits (S >= 1).
    dtype: the result's dtype (the kernel's output dtype, e.g. bf16).

  Returns:
    ``[...]`` of ``dtype``: the partials summed left to right in float32, then cast.
  """
  if parts.ndim < 1 or parts.shape[0] < 1:
    raise ValueError(f"parts.shape={parts.shape}: expected [splits, ...] with splits >= 1")
  total = parts[0]
  for i in range(1, parts.shape[0]):
    total = total + parts[i]
  return total.astype(dtype)
