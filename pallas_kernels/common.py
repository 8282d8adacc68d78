"""What every fused dequantize-matmul kernel here shares: masked loads, the output tile's
store, and the launch (grid, split-K, poisoned outputs for tests).

The kernels' contract: a grid of ``(N blocks, M blocks, split_k)`` programs, each owning a
``[block_m, block_n]`` output tile over ``1 / split_k`` of K. With ``split_k > 1`` every
split writes its own float32 slice of a ``[split_k, M, N]`` output, added in XLA
afterwards in split order (:func:`sum_splits`; deterministic, unlike atomics). Inputs
that are layer slices of a stacked weight (``qjax.layer_of``) arrive as the stacked
arrays plus the layer index, and the kernel sees them through :class:`LayerRef` at that
layer: no copy of the layer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import KernelConfig
from qjax._src import stacked as stacked_lib


# Values of ``jax_default_matmul_precision`` that ask float32 dots for float32 accuracy.
_FULL_F32_PRECISIONS = ("highest", "float32", "F32_F32_F32", "TF32_TF32_F32_X3")
# Pipeline stages at most where a kernel's dots take three TF32 products: they need more
# shared memory than one (H100, MXFP4 M = 64 at 4096 x 4096, 4 stages: 233472 bytes asked,
# 232448 available; session 26).
X3_MAX_STAGES = 2


def dot_precision(dtype, interpret: bool):
  """The ``precision`` of a kernel's ``plgpu.dot`` for activations of ``dtype``.

  float32 activations take Triton's default, one TF32 product, as ``jnp.dot`` does on the
  GPU: it keeps 10 bits of x's mantissa (H100, K = 4096: 2e-4 to 8e-4 relative error
  against float64; session 26). Where jax's default matmul precision asks for float32
  (``jax.default_matmul_precision("highest")`` or ``"float32"``, read when the call is
  traced), they take three (Triton's "tf32x3": 1e-7 to 4e-7, 1.3-2.8x the device time), as
  accurate as the XLA fallbacks, which always multiply float32 at ``Precision.HIGHEST``.
  None (the inputs' precision) for 16-bit activations and in interpret mode, whose CPU
  dot multiplies float32 exactly.
  """
  if interpret or jnp.dtype(dtype) != jnp.float32:
    return None
  if str(jax.config.jax_default_matmul_precision) in _FULL_F32_PRECISIONS:
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return None


def next_pow2(v: int) -> int:
  """The least power of two >= ``v`` (1 for ``v <= 1``): Triton's block shapes."""
  return 1 << max(0, (v - 1).bit_length())


def load(ref, mask=None, other=0):
  """Masked load where a mask is given, plain (vectorizable) load otherwise."""
  if isinstance(ref, LayerRef):
    ref = ref.at[...]
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


class LayerRef:
  """Layer ``layer`` of a stacked ref ``[layers, ...]``, seen as a ref of one layer's shape:
  ``.at[idx]`` and ``[idx]`` index the stacked ref at ``(layer, *idx)`` in one indexer
  (Pallas-Triton lowers a single indexer per load), ``shape`` / ``dtype`` are one layer's."""

  def __init__(self, ref, layer):
    self._ref, self._layer = ref, layer

  @property
  def shape(self) -> tuple[int, ...]:
    """One layer's shape: the stacked ref's without its leading axis."""
    return tuple(self._ref.shape[1:])

  @property
  def ndim(self) -> int:
    """One layer's rank."""
    return len(self.shape)

  @property
  def dtype(self):
    """The stacked ref's dtype."""
    return self._ref.dtype

  def _index(self, idx) -> tuple:
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):
      at = next(p for p, i in enumerate(idx) if i is Ellipsis)
      fill = (slice(None),) * (self.ndim - len(idx) + 1)
      idx = idx[:at] + fill + idx[at + 1:]
    return (self._layer, *idx)

  @property
  def at(self):
    """``.at[idx]``: the stacked ref at ``(layer, *idx)``."""
    return _LayerAt(self)

  def __getitem__(self, idx):
    return self._ref[self._index(idx)]


class _LayerAt:
  def __init__(self, layer_ref: LayerRef):
    self._layer_ref = layer_ref

  def __getitem__(self, idx):
    return self._layer_ref._ref.at[self._layer_ref._index(idx)]  # pylint: disable=protected-access


def _in_layer(kernel, stacked: tuple[bool, ...], *refs):
  """Calls ``kernel`` with the stacked input refs seen at the layer in ``refs[-2]``
  (``[1]`` int32); ``stacked`` marks them among the inputs (None inputs included)."""
  *inputs, layer_ref, o_ref = refs
  num_layers = next(r.shape[0] for r, s in zip(inputs, stacked) if s)
  layer = stacked_lib.normalized_index(layer_ref[0], num_layers)
  inputs = [LayerRef(r, layer) if s else r for r, s in zip(inputs, stacked)]
  return kernel(*inputs, o_ref)


def _drop_aliased_input(kernel, *refs):
  """Calls ``kernel`` without the poisoned buffer's input ref (it is the output ref)."""
  return kernel(*refs[:-2], refs[-1])


def poisoned_outputs(kernel: Callable[..., None], args: list[Any], out_shape: Sequence[Any]
                     ) -> tuple[Callable[..., None], list[Any], dict[int, int]]:
  """For tests: ``(kernel, args, input_output_aliases)`` where every output of
  ``out_shape`` (a list of ShapeDtypeStructs: the call's first outputs, or all of them)
  starts as a NaN buffer aliased into the call, so an element the kernel fails to write
  shows up as NaN. ``kernel(*input refs, *output refs)`` is called without the aliased
  buffers' input refs (they are the output refs); None entries of ``args`` are not refs."""
  first, given, outs = sum(a is not None for a in args), len(args), len(out_shape)
  aliases = {first + i: i for i in range(outs)}
  args = [*args, *(jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape)]

  def body(*refs):
    return kernel(*refs[:given], *refs[given + outs:])

  return body, args, aliases


def sum_splits(partials: jax.Array) -> jax.Array:
  """``partials[0] + partials[1] + ...`` in that order: ``[S, ...]`` -> ``[...]``.

  The kernels' split-K partial sums, added as a chain of elementwise adds instead of a
  reduce over the split axis. XLA keeps the order of float adds it is given, but a reduce
  leaves the order to the emitter, and XLA's fusion autotuner picks the emitter by timing
  at compile time: a native loop fusion or a Triton block-level fusion, which add in other
  orders. Two compiles of one program then rounded one element in a few thousand one
  bf16 unit apart, depending on what else ran on the GPU (H100, session 31: the flaky
  ``test_wgmma_layer_of_equals_each_layer[nvfp4]``, a scanned stack against each layer's
  own call).
  """
  total = partials[0]
  for i in range(1, partials.shape[0]):
    total = total + partials[i]
  return total


def compiled_stages(config: KernelConfig, dtype, interpret: bool) -> int:
  """Triton's ``num_stages`` for a launch: ``config.num_stages``, at most
  :data:`X3_MAX_STAGES` where the dots take three TF32 products (:func:`dot_precision`)."""
  if dot_precision(dtype, interpret) is None:
    return config.num_stages
  return min(config.num_stages, X3_MAX_STAGES)


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
  args, stacked_args, layer = stacked_lib.read_in_place(list(args))
  if layer is not None:
    # The kernel reads one layer of the stacked arrays at its offset: no copy of the layer.
    args.append(jnp.reshape(layer, (1,)).astype(jnp.int32))
    kernel = functools.partial(_in_layer, kernel, stacked_args)
  aliases = {}
  if poison:
    num_inputs = sum(a is not None for a in args)
    args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
    aliases = {num_inputs: 0}
    kernel = functools.partial(_drop_aliased_input, kernel)
  call = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(pl.cdiv(n, config.block_n),
            pl.cdiv(m, config.block_m) if grid_m is None else grid_m, split_k),
      input_output_aliases=aliases,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=compiled_stages(config, dtype,
                                                                      interpret)),
      name=name,
  )
  # jax's dead-code elimination never removes a bare pallas_call (a kernel may write
  # through aliased refs), and flax's nn.scan (0.12.9 and later) refuses a body whose
  # loop-invariant part keeps one: "broadcasted variable has a data dependency on the
  # scan body". These kernels only return their output, so a jit boundary, which DCE
  # drops whole when its outputs are unused, keeps that truth visible.
  out = jax.jit(call)(*args)
  if split_k > 1:
    out = sum_splits(out).astype(dtype)
  return out
