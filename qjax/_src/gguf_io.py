"""Reading GGUF files (llama.cpp) into qjax pytrees, with llama.cpp's ``gguf`` package.

The header is parsed by :mod:`qjax._src.gguf_header` (bounded, and ~15x faster than
``gguf.GGUFReader``'s own parse) and the file memory-mapped; each tensor is split into its
block fields (:mod:`qjax._src.gguf_formats`) and put on the default device, keeping GGUF's
storage order. A 2-D GGUF tensor of GGUF shape ``[ne0, ne1]`` (numpy ``[N=ne1, K=ne0]``,
rows of length K) has the logical shape ``(K, N)`` for ``y = x @ W``; this holds for the
token embedding too (``[K=hidden, N=vocab]``, so ``x @ W`` gives logits and
:func:`embedding_rows` looks tokens up).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qjax._src import gguf_formats
from qjax._src import gguf_header
from qjax._src.gguf_formats import embedding_rows as embedding_rows  # re-export

_INSTALL_HINT = 'reading GGUF files needs the gguf package: pip install "qjax[gguf]"'


def _import_gguf():
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"{_INSTALL_HINT} ({e})") from e
  return gguf


@dataclasses.dataclass
class GGUFFile:
  """The contents of a GGUF file.

  Attributes:
    path: the file read.
    tensors: name -> a GGUF format pytree (2-D tensors, logical ``(K, N)``) or a
      ``jax.Array`` (1-D tensors such as norms, in their stored dtype).
    metadata: key -> value: strings decoded, numbers as Python scalars, string arrays as
      lists of str, numeric arrays as numpy arrays (``tokenizer.ggml.tokens``,
      ``tokenizer.ggml.merges``, ``tokenizer.ggml.token_type``,
      ``tokenizer.chat_template``, ...).
    tensor_types: name -> GGUF type name ("Q4_K", "F32", ...).
    file_tensor_bytes: bytes of tensor data in the file.
  """
  path: str
  tensors: dict[str, Any]
  metadata: dict[str, Any]
  tensor_types: dict[str, str]
  file_tensor_bytes: int

  @property
  def architecture(self) -> str | None:
    """The file's ``general.architecture`` (e.g. "llama"), or None if absent."""
    return self.metadata.get("general.architecture")

  @property
  def device_bytes(self) -> int:
    """Bytes of all loaded arrays."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(self.tensors))


def _one_line(e: BaseException) -> str:
  msg = " ".join(str(e).split())
  return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


class GGUFTensor(NamedTuple):
  """One tensor of an opened GGUF file (the fields qjax reads of ``gguf``'s
  ``ReaderTensor``).

  Attributes:
    name: the tensor's name.
    tensor_type: its ``gguf.GGMLQuantizationType``.
    shape: GGUF's ``ne`` order (``(K, N)`` for a 2-D tensor).
    n_bytes: of its data.
    data_offset: of its data in the file.
    data: a read-only view of the memory-mapped file: the numpy dtype of a plain type
      (F16, F32, F64, I8 .. I64) in numpy's (reversed ``ne``) shape, else uint8 rows of
      blocks ``[..., ne1, ne0 / block * bytes per block]``.
  """
  name: str
  tensor_type: Any
  shape: tuple[int, ...]
  n_bytes: int
  data_offset: int
  data: np.ndarray


@dataclasses.dataclass
class _OpenedFile:
  """A GGUF file's parsed header and its tensors over the memory-mapped file."""
  metadata: dict[str, Any]
  tensors: list[GGUFTensor]


# The GGML types whose data numpy reads as it is (the rest are uint8 block rows).
_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _open(path: str | os.PathLike[str]) -> _OpenedFile:
  """``path``'s header (:func:`gguf_header.parse_gguf_file`) and its tensors as views of
  the memory-mapped file; ValueError if it is not a readable GGUF file."""
  gguf = _import_gguf()
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such GGUF file: {path}")
  header = gguf_header.parse_gguf_file(path)  # bounded: every read inside the file
  data = np.memmap(path, mode="r") if header.tensors else np.zeros((0,), np.uint8)
  tensors = []
  for info in header.tensors:
    qtype = gguf.GGMLQuantizationType(info.type_id)
    start = header.data_start + info.offset
    raw = data[start:start + info.n_bytes]
    np_shape = tuple(reversed(info.dims))
    plain = _PLAIN_TYPES.get(qtype.name)
    if plain is not None:
      view = raw.view(np.dtype(plain).newbyteorder(header.byte_order)).reshape(np_shape)
    else:
      block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
      view = raw.reshape(*np_shape[:-1], np_shape[-1] // block * block_bytes)
    tensors.append(GGUFTensor(info.name, qtype, info.dims, info.n_bytes, start, view))
  return _OpenedFile(metadata=header.metadata, tensors=tensors)


def _logical_shape(t: GGUFTensor) -> tuple[int, ...]:
  """GGUF's ``ne`` order: ``(K, N)`` for a 2-D tensor, ``(n,)`` for a 1-D one."""
  return tuple(t.shape)


def _load_tensor(t, path: str, dequantize_unsupported: bool) -> Any:
  gguf = _import_gguf()
  qname = t.tensor_type.name
  shape = _logical_shape(t)
  data = t.data
  if len(shape) >= 2 and qname in gguf_formats.SUPPORTED_TYPES:
    # More than 2 dims (MoE experts, GGUF dims [K, N, E]): one pytree, leading axes first.
    return gguf_formats.from_gguf_bytes(data, qname, shape[:2], tuple(reversed(shape[2:])))
  if len(shape) == 2:
    if dequantize_unsupported:
      try:
        rows = gguf.quants.dequantize(np.asarray(data), t.tensor_type)
      except NotImplementedError:
        rows = None
      if rows is not None:
        return gguf_formats.GGUFDense.from_bytes(np.asarray(rows, np.float32), shape, "F32")
    raise ValueError(
        f"{path}: tensor {t.name!r} has GGUF type {qname}, which qjax does not support "
        f"(supported: {', '.join(gguf_formats.SUPPORTED_TYPES)}); pass "
        "dequantize_unsupported=True to load it as float32")
  # 1-D (norms, biases) and other ranks: plain arrays in numpy (reversed ne) order.
  np_shape = tuple(reversed(shape))
  if qname == "BF16":
    return jnp.asarray(np.asarray(data).reshape(-1).view(ml_dtypes.bfloat16).reshape(np_shape))
  if data.dtype != np.uint8:  # F32, F16, I8 ... I64, F64
    a = np.asarray(data).reshape(np_shape)
    return jnp.asarray(a.astype(a.dtype.newbyteorder("="), copy=False))
  if len(shape) > 2:
    raise ValueError(
        f"{path}: tensor {t.name!r} is a {len(shape)}-D {qname} tensor of shape {shape}; "
        "qjax reads tensors of more than 2 dims only for types "
        f"{', '.join(gguf_formats.SUPPORTED_TYPES)} (as one pytree with leading axes)")
  try:
    return jnp.asarray(gguf.quants.dequantize(np.asarray(data), t.tensor_type).reshape(np_shape))
  except NotImplementedError:
    raise ValueError(f"{path}: tensor {t.name!r} has GGUF type {qname}, which gguf cannot "
                     "dequantize") from None


@dataclasses.dataclass
class GGUFHeader:
  """What a GGUF file says before its tensor data (:func:`read_header`).

  Attributes:
    path: the file read.
    metadata: key -> value, as :attr:`GGUFFile.metadata`.
    tensor_types: name -> GGUF type name ("Q4_K", "F32", ...), in the file's order.
    tensor_shapes: name -> logical shape (``(K, N)`` for a 2-D tensor, GGUF's ``ne``
      order), as :attr:`GGUFFile.tensors` will hold it.
    file_tensor_bytes: bytes of tensor data in the file.
  """
  path: str
  metadata: dict[str, Any]
  tensor_types: dict[str, str]
  tensor_shapes: dict[str, tuple[int, ...]]
  file_tensor_bytes: int
  _reader: Any = dataclasses.field(default=None, repr=False, compare=False)


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
  """The file's metadata and its tensors' names, types and shapes, without reading any
  tensor data (the file is checked and memory-mapped as :func:`load_gguf` does, so a bad
  file raises the same errors). Pass the result to :func:`load_gguf` to load the tensors
  without parsing the header again.

  Raises:
    ValueError: the file is not GGUF, or is truncated or malformed.
    ImportError: the ``gguf`` package is missing.
  """
  path = os.fspath(path)
  reader = _open(path)
  return GGUFHeader(
      path=path, metadata=reader.metadata,
      tensor_types={t.name: t.tensor_type.name for t in reader.tensors},
      tensor_shapes={t.name: _logical_shape(t) for t in reader.tensors},
      file_tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors), _reader=reader)


def load_gguf(path: str | os.PathLike[str] | GGUFHeader, *, progress: bool = True,
              dequantize_unsupported: bool = False) -> GGUFFile:
  """Reads a GGUF file into qjax pytrees (2-D) and arrays (1-D) on the default device.

  Tensors of more than 2 dims (MoE experts, GGUF dims ``[K, N, E]``) of the supported
  types load as one pytree with a leading expert axis on its fields (e.g. a
  :class:`~qjax._src.gguf_formats.GGUFQ4_K` of logical shape ``(K, N)`` whose
  ``dequantize()`` is ``[E, K, N]``), which :func:`qjax.moe_matmul` takes as it is
  (GPT-OSS's MXFP4 experts: ``.to_mxfp4()`` for the MoE kernels); other types of more than
  2 dims raise.

  Args:
    path: the ``.gguf`` file, or its :func:`read_header` (whose parse is reused).
    progress: show a tqdm progress bar over the tensors.
    dequantize_unsupported: load 2-D tensors of GGUF types without a qjax format (Q5_0,
      Q2_K, IQ*, ...) as float32 :class:`GGUFDense` instead of raising.

  Returns:
    A :class:`GGUFFile`.

  Raises:
    ValueError: the file is not GGUF, is truncated or malformed, or holds a tensor type
      qjax cannot load.
    ImportError: the ``gguf`` package is missing.
  """
  header = path if isinstance(path, GGUFHeader) else read_header(path)
  path, reader = header.path, header._reader  # pylint: disable=protected-access
  tensors: dict[str, Any] = {}
  types: dict[str, str] = {}
  items = reader.tensors
  if progress:
    try:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      items = tqdm(items, desc=f"loading {os.path.basename(path)}", unit="tensor")
    except ImportError:
      pass
  for t in items:
    try:
      tensors[t.name] = _load_tensor(t, path, dequantize_unsupported)
    except ValueError as e:
      msg = str(e)
      raise ValueError(msg if msg.startswith(path) else f"{path}: tensor {t.name!r}: {msg}"
                       ) from None
    except (TypeError, IndexError, KeyError, ArithmeticError, NotImplementedError) as e:
      # The header passed gguf_header's checks but the data cannot form this tensor.
      raise ValueError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape "
                       f"{_logical_shape(t)}) cannot be loaded ({_one_line(e)})") from e
    types[t.name] = t.tensor_type.name
  return GGUFFile(path=path, tensors=tensors, metadata=dict(header.metadata),
                  tensor_types=types, file_tensor_bytes=header.file_tensor_bytes)


def describe_gguf(path: str | os.PathLike[str]) -> list[tuple[str, str, tuple[int, ...], int]]:
  """``(name, GGUF type, logical shape, bytes)`` of every tensor, without loading any.

  Reads only the header (the data is memory-mapped, never read), so it is cheap on a
  file of any size and works for types qjax cannot load.

  Args:
    path: a GGUF file.

  Returns:
    One tuple per tensor, in file order: its name, its GGUF type name (e.g. ``"Q4_K"``,
    ``"F32"``), its logical shape in GGUF's ``ne`` order (``(K, N)`` for a 2-D weight,
    ``(K, N, E)`` for stacked experts, ``(n,)`` for a vector) and its size in bytes in
    the file.

  Raises:
    FileNotFoundError: when ``path`` is not a file.
    ValueError: when the file is not a readable GGUF file (bad magic, version or a
      header that points outside the file).
    ImportError: when the ``gguf`` package is missing (the message says how to install
      it).
  """
  reader = _open(path)
  return [(t.name, t.tensor_type.name, _logical_shape(t), int(t.n_bytes))
          for t in reader.tensors]


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
  """The file's key-value metadata (as :attr:`GGUFFile.metadata`), without its tensors."""
  return _open(path).metadata
