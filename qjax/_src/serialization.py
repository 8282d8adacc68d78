"""Saving and loading quantized weights: one safetensors file with a JSON description.

The file is a plain safetensors file (any safetensors reader opens it); its header's
``__metadata__["qjax"]`` entry is a JSON description::

  {"version": 1, "sha256": "<digest of the tensor data>",
   "tensors": {"layer0/kernel": {"format": "int4", "arrays": {"codes": "layer0/kernel.codes",
                                  ...}, "static": {"shape": [256, 128], ...}},
               "layer0/bias": {"format": "array", "arrays": {"value": "layer0/bias"}}}}

Writes are atomic (temporary file in the same folder, fsync, rename), nothing is ever
unpickled, and loading checks the digest and every array's shape and dtype.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Any, Mapping

import jax
import numpy as np

from qjax._src import formats

VERSION = 1


# dtypes that safetensors' numpy API reads and writes natively.
_NATIVE = {np.dtype(t) for t in (np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.float16,
                                 np.uint32, np.int32, np.float32, np.uint64, np.int64,
                                 np.float64)}


def _to_numpy(a: Any) -> np.ndarray:
  a = np.asarray(jax.device_get(a))
  return np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes 0-d arrays 1-d


def _storable(a: np.ndarray) -> tuple[np.ndarray, str | None]:
  """``a`` or, for ml_dtypes types (bf16, fp8, ...), its bits as an unsigned view."""
  if a.dtype in _NATIVE:
    return a, None
  return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}")), a.dtype.name


def _restore(a: np.ndarray, dtype_name: str | None) -> np.ndarray:
  if dtype_name is None:
    return a
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  return a.view(np.dtype(getattr(ml_dtypes, dtype_name)))


def _digest(arrays: Mapping[str, np.ndarray]) -> str:
  h = hashlib.sha256()
  for name in sorted(arrays):
    a = arrays[name]
    h.update(name.encode())
    h.update(str(a.dtype).encode())
    h.update(str(a.shape).encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _jsonable(v: Any) -> Any:
  if isinstance(v, tuple):
    return [_jsonable(e) for e in v]
  if isinstance(v, (np.dtype, type)) or hasattr(v, "dtype") and not hasattr(v, "shape"):
    return np.dtype(v).name
  return v


def save(path: str | os.PathLike, tensors: Mapping[str, Any]) -> None:
  """Saves a flat mapping of names to quantized weights or plain arrays, atomically.

  Args:
    path: the ``.safetensors`` file to write (replaced atomically if it exists).
    tensors: ``{name: QuantizedWeight | array}``.
  """
  from safetensors.numpy import save as st_save  # pylint: disable=g-import-not-at-top
  arrays: dict[str, np.ndarray] = {}
  desc: dict[str, Any] = {}
  for name, value in tensors.items():
    if isinstance(value, formats.QuantizedWeight):
      cls = type(value)
      entry = {"format": cls.format_name, "arrays": {}, "static": {}}
      for field in formats.array_field_names(cls):
        a = getattr(value, field)
        if a is None:
          continue
        key = f"{name}.{field}"
        arrays[key] = _to_numpy(a)
        entry["arrays"][field] = key
      for field in formats.static_field_names(cls):
        entry["static"][field] = _jsonable(getattr(value, field))
    else:
      arrays[name] = _to_numpy(value)
      entry = {"format": "array", "arrays": {"value": name}}
    desc[name] = entry
  stored, views = {}, {}
  for key, a in arrays.items():
    stored[key], dtype_name = _storable(a)
    if dtype_name:
      views[key] = dtype_name
  header = {"version": VERSION, "sha256": _digest(arrays), "tensors": desc, "views": views}
  data = st_save(stored, metadata={"qjax": json.dumps(header)})
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  dir_fd = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(dir_fd)
  finally:
    os.close(dir_fd)


def load(path: str | os.PathLike, *, offload_pass2: bool = False) -> dict[str, Any]:
  """Loads what :func:`save` wrote: ``{name: QuantizedWeight | np.ndarray}``.

  Args:
    offload_pass2: place pass 2 of two-pass codebook weights in pinned host memory
      (``qjax.place_pass2``); the other arrays load as usual.

  Raises:
    ValueError: the file is not a qjax file, its digest does not match, or an array
      does not fit its format's description.
  """
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load as st_load  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(path)
  raw = path.read_bytes()
  try:
    arrays = st_load(raw)
  except SafetensorError as e:
    raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
  header_len = int.from_bytes(raw[:8], "little")
  meta = json.loads(raw[8:8 + header_len]).get("__metadata__") or {}
  if "qjax" not in meta:
    raise ValueError(f"{path}: safetensors file without a qjax description; "
                     "use safetensors to read plain files")
  header = json.loads(meta["qjax"])
  if header.get("version") != VERSION:
    raise ValueError(f"{path}: qjax file version {header.get('version')} is not {VERSION}")
  arrays = {k: _restore(a, header.get("views", {}).get(k)) for k, a in arrays.items()}
  if _digest(arrays) != header["sha256"]:
    raise ValueError(f"{path}: sha256 of the tensor data does not match the header; "
                     "the file is corrupt")
  out: dict[str, Any] = {}
  for name, entry in header["tensors"].items():
    if entry["format"] == "array":
      out[name] = arrays[entry["arrays"]["value"]]
      continue
    cls = formats.format_class(entry["format"])
    kwargs = {f: None for f in formats.array_field_names(cls)}
    kwargs.update({f: arrays[key] for f, key in entry["arrays"].items()})
    static = {}
    for f in dataclasses.fields(cls):
      if f.name in entry["static"]:
        v = entry["static"][f.name]
        static[f.name] = tuple(v) if isinstance(v, list) else v
    out[name] = cls(**kwargs, **static)
  if offload_pass2:
    from qjax._src import offload  # pylint: disable=g-import-not-at-top
    out = offload.place_pass2(out, "pinned_host")
  return out
