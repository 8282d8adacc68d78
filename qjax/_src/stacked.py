"""One layer of a stack of quantized weights, which the kernels read in place.

A model that runs its layers with ``lax.scan`` keeps each weight as one stacked pytree
(every array with a leading ``[layers]`` axis) and hands ``matmul`` a slice of it per
layer. XLA cannot pass a slice of a buffer to a custom call, so before each Pallas kernel
it copies the layer's arrays out of the stack: on an H100, 8 Llama-8B-shaped layers at
batch 1 took 1.41 ms per step scanned (0.65 ms of it those copies) against 0.55 ms with a
separate array per layer (2026-11-24).

``LayerOf(stack, index)`` names the layer instead of slicing it. ``matmul`` slices it for
the XLA path (XLA fuses or copies that slice as it chooses), and while a kernel is launched the
slices it receives are traced back to their stacked arrays
(:func:`in_place_source`): ``pallas_kernels.common.launch`` passes the stacked arrays and
the index, and the kernel reads layer ``index`` at its offset. An array the kernel's
wrapper derives from a slice (a repack, a cast) is not in the table and is passed as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax import lax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerOf:
  """Layer ``index`` of ``stack``, a quantized-weight pytree whose every array has a
  leading ``[layers]`` axis (as ``jax.tree.map(jnp.stack, ...)`` or a scan's stacked
  params make it), or a :class:`qjax.ShardedWeight` of such a stack (tensor-parallel
  layers, inside ``shard_map``).

  Build it with :func:`layer_of`, which checks the arguments.

  Attributes:
    stack: the stacked weight; its static fields (``shape``, group size, ...) are one
      layer's.
    index: int32 scalar, the layer (may be traced, e.g. a ``lax.scan`` counter).
  """
  stack: Any
  index: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """One layer's logical shape ``[K, N]``."""
    return tuple(self.stack.shape)

  @property
  def num_layers(self) -> int:
    """Layers in the stack: the leading axis of its arrays."""
    return jax.tree.leaves(self.stack)[0].shape[0]

  @property
  def format_cls(self) -> type:
    """The class of one layer's weight (a ShardedWeight's ``format_cls`` through it)."""
    return getattr(self.stack, "format_cls", type(self.stack))

  def layer(self) -> Any:
    """The layer as a weight of the stack's format (each array sliced at ``index``)."""
    index = jnp.asarray(self.index, jnp.int32)
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False),
                        self.stack)


def layer_of(stack: Any, index: Any) -> LayerOf:
  """Layer ``index`` of the stacked quantized weight ``stack``, for ``qjax.matmul``.

  >>> import jax, jax.numpy as jnp, qjax
  >>> ws = [qjax.quantize(jax.random.normal(jax.random.key(i), (256, 64))) for i in range(3)]
  >>> stack = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  >>> x = jnp.ones((1, 256), jnp.bfloat16)
  >>> def body(h, i):
  ...   return h, qjax.matmul(x, qjax.layer_of(stack, i), implementation="xla")
  >>> jax.lax.scan(body, 0, jnp.arange(3))[1].shape
  (3, 1, 64)

  As in ``lax.dynamic_index_in_dim``, a negative ``index`` counts from the end and one
  still outside ``[0, layers)`` is clamped into it, on every implementation.

  ``stack`` may also be a :class:`qjax.ShardedWeight` whose arrays carry the leading
  ``[layers]`` axis (tensor-parallel layers inside ``shard_map``): each device's kernels
  then read its slice of the stack in place.

  Raises:
    TypeError: ``stack`` is not a quantized weight, or ``index`` not an integer scalar.
    ValueError: the arrays of ``stack`` do not share one leading ``[layers]`` axis.
  """
  from qjax._src import formats  # pylint: disable=g-import-not-at-top
  from qjax._src import sharding  # pylint: disable=g-import-not-at-top
  if not (formats.is_quantized(stack) or isinstance(stack, sharding.ShardedWeight)):
    raise TypeError(f"layer_of needs a stacked quantized weight (a qjax.QuantizedWeight or "
                    f"a qjax.ShardedWeight of one); got {type(stack).__name__}")
  if jnp.ndim(index) != 0 or not jnp.issubdtype(jnp.result_type(index), jnp.integer):
    raise TypeError(f"layer_of index must be an integer scalar; got {index!r}")
  leading = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in jax.tree.leaves(stack)}
  if None in leading or len(leading) != 1:
    raise ValueError(f"every array of the stacked {type(stack).__name__} needs the same "
                     f"leading [layers] axis; got leading sizes {sorted(leading, key=str)}")
  return LayerOf(stack, jnp.asarray(index, jnp.int32))


_sources = threading.local()


@contextlib.contextmanager
def reads_in_place(view: LayerOf) -> Iterator[Any]:
  """Yields ``view.layer()`` and, until the block ends, records each of its arrays as a
  slice of the stacked array, for :func:`in_place_source`."""
  layer = view.layer()
  index = jnp.asarray(view.index, jnp.int32)
  table = getattr(_sources, "table", None)
  if table is None:
    table = _sources.table = {}
  added = []
  for sliced, stacked in zip(jax.tree.leaves(layer), jax.tree.leaves(view.stack)):
    # The slice itself is kept in the entry so that its id is not reused meanwhile.
    table[id(sliced)] = (sliced, stacked, index)
    added.append(id(sliced))
  try:
    yield layer
  finally:
    for key in added:
      table.pop(key, None)


def read_in_place(args: list) -> tuple[list, tuple[bool, ...], Any]:
  """Swaps each of a kernel's args that is a layer slice of a stacked weight (made by an
  active :func:`reads_in_place`) for its stacked array; returns the args, which of them
  are stacked, and the layer index (None when none is). Args of another layer index, and
  None entries, stay as they are."""
  swapped, marks, index = [], [], None
  for a in args:
    source = None if a is None else in_place_source(a)
    if source is not None and (index is None or source[1] is index):
      swapped.append(source[0])
      marks.append(True)
      index = source[1]
    else:
      swapped.append(a)
      marks.append(False)
  return swapped, tuple(marks), index


def normalized_index(index: Any, num_layers: int) -> Any:
  """The layer ``lax.dynamic_index_in_dim`` (the XLA path's slice) reads for ``index``: a
  negative one counts from the end, then it is clamped into ``[0, num_layers)``. Kernels
  reading in place call it on the index inside the kernel (scalar compares and selects
  only, which every Pallas backend lowers), so that they never read outside the stack and
  no extra XLA op runs per layer."""
  index = jnp.where(index < 0, index + num_layers, index)
  index = jnp.where(index < 0, 0, index)
  return jnp.where(index > num_layers - 1, num_layers - 1, index)


def in_place_source(array: Any) -> tuple[jax.Array, jax.Array] | None:
  """``(stacked array, layer index)`` when ``array`` is a layer slice made by an active
  :func:`reads_in_place`, else None."""
  table = getattr(_sources, "table", None)
  entry = table.get(id(array)) if table else None
  if entry is None or entry[0] is not array:
    return None
  return entry[1], entry[2]
