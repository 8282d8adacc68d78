"""Loading checkpoints straight into a sharding: each device receives only its slices.

Every array goes to the devices through ``jax.make_array_from_callback``: the callback
hands each device the slice its NamedSharding names, read from the host copy (a qjax
safetensors file, checked against its digest) or straight from the memory-mapped GGUF
file (only the bytes of the device's block rows are read), so no device ever holds a
whole split layer.

``modes`` says how each tensor splits: a mapping ``{name: mode}`` or a function
``modes(name, value) -> mode``, where a mode is "column", "row", "expert", None
(replicated on every device) or, for a plain array, a ``PartitionSpec``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qjax._src import formats
from qjax._src import gguf_formats as gf
from qjax._src import sharding
from qjax._src import split_rules as rules

Modes = Mapping[str, Any] | Callable[[str, Any], Any]


def _mode(modes: Modes, name: str, value: Any) -> Any:
  return modes(name, value) if callable(modes) else modes.get(name)


def _replicated(w: Any, mesh: jax.sharding.Mesh) -> Any:
  """``w`` (a weight or an array) placed whole on every device of ``mesh``."""
  everywhere = NamedSharding(mesh, P())
  if isinstance(w, formats.QuantizedWeight):
    p = rules.parts_of(w)
    arrays = {f: None if a is None else sharding.place(a, everywhere)
              for f, a in p.arrays.items()}
    return p.cls(**arrays, **p.static)
  return sharding.place(w, everywhere)


def place_tensor(name: str, value: Any, mesh: jax.sharding.Mesh, axis: Any, mode: Any,
                 *, wrap: bool = False) -> Any:
  """One loaded tensor (host arrays) placed by ``mode`` (see the module doc)."""
  if isinstance(value, formats.QuantizedWeight):
    if mode is None:
      return _replicated(value, mesh)
    if isinstance(mode, P):
      raise ValueError(f"{name}: a quantized weight takes a mode ('column', 'row', "
                       f"'expert'), not a PartitionSpec ({mode})")
    try:
      if wrap:
        return sharding.ShardedWeight.of(value, mesh, axis, mode)
      return sharding.shard_weight(value, mesh, axis, mode)
    except ValueError as e:
      raise ValueError(f"{name}: {e}") from None
  if mode is None:
    return _replicated(value, mesh)
  if not isinstance(mode, P):
    raise ValueError(f"{name}: a plain array of shape {tuple(np.shape(value))} takes a "
                     f"PartitionSpec or None, not {mode!r}")
  return sharding.place(value, NamedSharding(mesh, mode))


def load_sharded(path: str | os.PathLike, mesh: jax.sharding.Mesh, axis: Any,
                 modes: Modes, *, wrap: bool = False) -> dict[str, Any]:
  """What :func:`qjax.save` wrote, placed across ``mesh``.

  The file is read and checked on the host as :func:`qjax.load` does (digest, shapes,
  dtypes); each device then receives only its slices of each array.

  Args:
    path: a file written by :func:`qjax.save`.
    mesh, axis: the devices and the mesh axis (or tuple of axes) to split along.
    modes: ``{name: mode}`` or ``modes(name, value) -> mode`` (module doc); names it
      does not cover are replicated.
    wrap: return split weights as :class:`qjax.ShardedWeight` (for shard_map) instead
      of their own classes with placed arrays.

  Returns:
    ``{name: weight or jax.Array}``.
  """
  from qjax._src import serialization  # pylint: disable=g-import-not-at-top
  tensors = serialization.load(path)
  if not callable(modes):
    unknown = sorted(set(modes) - set(tensors))
    if unknown:  # a misspelled name left its weight whole on every device
      raise ValueError(f"modes names {unknown}, which {os.fspath(path)!r} does not hold; "
                       f"its names: {sorted(tensors)}")
  return {name: place_tensor(name, v, mesh, axis, _mode(modes, name, v), wrap=wrap)
          for name, v in tensors.items()}


class BlockFieldView:
  """One field of a GGUF block tensor, read lazily from the file's bytes.

  Indexing (with slices, as ``jax.make_array_from_callback`` does) returns a numpy array
  of only the indexed experts, block rows and blocks, so a device's slice is read from the
  memory map without reading the rest of the tensor.

  Attributes:
    shape: ``(*leading, N, K // block_size, *tail)``; dtype: the field's dtype.
  """

  def __init__(self, blocks: np.ndarray, field: Any):
    self._blocks = blocks  # [*leading, N, nb, type_size] uint8 (a memory-map view)
    self._field = field
    self._grid = blocks.ndim - 1  # leading axes + N + nb
    self.shape = (*blocks.shape[:-1], *field.tail)
    self.dtype = np.dtype(field.dtype)
    self.ndim = len(self.shape)

  def __getitem__(self, idx: Any) -> np.ndarray:
    idx = idx if isinstance(idx, tuple) else (idx,)
    idx = idx + (slice(None),) * (self.ndim - len(idx))
    if not all(isinstance(i, slice) for i in idx):
      raise TypeError(f"BlockFieldView takes slices only, got {idx}")
    f = self._field
    byte_range = slice(f.offset, f.offset + f.nbytes)
    part = np.ascontiguousarray(self._blocks[(*idx[:self._grid], byte_range)])
    out = part.view(self.dtype).reshape(*part.shape[:-1], *f.tail)
    return out[(*(slice(None),) * self._grid, *idx[self._grid:])]


def _lazy_block_weight(t: Any, qname: str, shape: tuple[int, int],
                       leading: tuple[int, ...] = ()) -> Any:
  """A block weight whose fields read ``t``'s bytes on indexing; ``leading``: expert axes
  in numpy order (GGUF dims ``[K, N, E]`` give ``(E,)``)."""
  cls = gf.BLOCK_FORMATS[qname]
  blocks = cls.block_grid(t.data, shape, leading)  # a view of the memory map
  fields = {f.name: BlockFieldView(blocks, f) for f in cls.block_fields}
  return cls(**fields, shape=tuple(int(d) for d in shape))


def load_gguf_sharded(path: str | os.PathLike, mesh: jax.sharding.Mesh, axis: Any,
                      modes: Modes, *, wrap: bool = False) -> Any:
  """A GGUF file's tensors placed across ``mesh``, read slice by slice from the file.

  Block-quantized 2-D tensors (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) stay in their
  block layout (:class:`qjax.GGUFQ4_K`, ...); each device's slice (whole block rows
  column-wise, whole blocks row-wise) is read straight from the memory-mapped file. So are
  block tensors of more than 2 dims (MoE experts, one stacked :class:`qjax.GGUFMXFP4`,
  :class:`qjax.GGUFQ4_K`, ...): split by "expert", each device reads only its experts. Other
  tensors are read as :func:`qjax.load_gguf` reads them and placed by their mode.

  Args:
    path: the ``.gguf`` file.
    mesh, axis, modes, wrap: as :func:`load_sharded`.

  Returns:
    A ``GGUFFile`` whose tensors are placed (e.g. convert to the kernel layout per device
    with ``ShardedWeight.map_local``, or to Int4 with ``.to_int4()`` under jit).
  """
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  reader = gguf_io._open(path)  # pylint: disable=protected-access
  metadata = reader.metadata
  tensors, types = {}, {}
  for t in reader.tensors:
    qname = t.tensor_type.name
    shape = gguf_io._logical_shape(t)  # pylint: disable=protected-access
    try:
      if len(shape) == 2 and qname in gf.BLOCK_FORMATS:
        value = _lazy_block_weight(t, qname, shape)
      elif len(shape) > 2 and qname in gf.BLOCK_FORMATS:
        # Stacked experts (GGUF dims [K, N, E]): an expert split reads only its experts.
        value = _lazy_block_weight(t, qname, shape[:2], tuple(reversed(shape[2:])))
      else:
        value = gguf_io._load_tensor(t, path, False)  # pylint: disable=protected-access
      tensors[t.name] = place_tensor(t.name, value, mesh, axis,
                                     _mode(modes, t.name, value), wrap=wrap)
    except ValueError as e:
      msg = str(e)
      raise ValueError(msg if msg.startswith(path) else f"{path}: tensor {t.name!r}: {msg}"
                       ) from None
    types[t.name] = qname
  return gguf_io.GGUFFile(path=path, tensors=tensors, metadata=metadata, tensor_types=types,
                          file_tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors))
