"""What every fused dequantize-matmul kernel here shares: masked loads, the output tile's
store, and the launch (grid, split-K, poisoned outputs for tests).

The kernels' contract: a grid of ``(N blocks, M blocks, split_k)`` programs, each owning a
``[block_m, block_n]`` output tile over ``1 / split_k`` of K. With ``split_k > 1`` every
split writes its own float32 slice of a ``[split_k, M, N]`` output, summed in XLA
afterwards (deterministic, unlike atomics).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import KernelConfig


def load(ref, mask=None, other=0):
  """Masked load where a mask is given, plain (vectorizable) load otherwise."""
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=mask, other=other)


def store_tile(o_ref, acc: jax.Array, *, m0, n0, block_m: int, block_n: int, pid_k,
               split_k: int, mask) -> None:
  """Stores the f32 accumulator ``[block_m, block_n]``: cast to the output dtype into
  ``o_ref [M, N]``, or as is into split ``pid_k`` of ``o_ref [split_k, M, N]``."""
  if split_k == 1:
    plgpu.store(o_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                mask=mask)
  else:
    plgpu.store(o_ref.at[pid_k, pl.ds(m0, block_m), pl.ds(n0, block_n)], acc, mask=mask)


def _drop_aliased_input(kernel, *refs):
  """Calls ``kernel`` without the poisoned buffer's input ref (it is the output ref)."""
  return kernel(*refs[:-2], refs[-1])


def launch(kernel: Callable[..., None], args: Sequence[Any], *, m: int, n: int,
           dtype: Any, config: KernelConfig, interpret: bool, poison: bool,
           name: str, grid_m: int | None = None) -> jax.Array:
  """Runs ``kernel(*arg_refs, o_ref)`` over the grid and returns ``[M, N]`` in ``dtype``.

  Args:
    kernel: the kernel body with its static parameters bound.
    args: its inputs; None entries reach the kernel as None (absent optional fields).
    config: block shapes, split_k (already legalized), warps and stages.
    poison: for tests: the output buffer starts as NaN (aliased into the kernel), so an
      element the kernel fails to write shows up as NaN.
    grid_m: programs along M when they do not map to ``cdiv(M, block_m)`` row blocks
      (the grouped MoE kernel's table of row tiles).
  """
  split_k = config.split_k
  if split_k == 1:
    out_shape = jax.ShapeDtypeStruct((m, n), dtype)
  else:
    out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
  args = list(args)
  aliases = {}
  if poison:
    num_inputs = sum(a is not None for a in args)
    args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
    aliases = {num_inputs: 0}
    kernel = functools.partial(_drop_aliased_input, kernel)
  out = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(pl.cdiv(n, config.block_n),
            pl.cdiv(m, config.block_m) if grid_m is None else grid_m, split_k),
      input_output_aliases=aliases,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      name=name,
  )(*args)
  if split_k > 1:
    out = out.sum(axis=0).astype(dtype)
  return out
