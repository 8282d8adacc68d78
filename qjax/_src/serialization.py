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
from collections.abc import Mapping
from typing import Any

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
  if not a.dtype.isnative:  # big-endian numpy data: the same values, in the file's order
    a = a.astype(a.dtype.newbyteorder("="))
  return np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes 0-d arrays 1-d


def _storable(key: str, a: np.ndarray) -> tuple[np.ndarray, str | None]:
  """``a`` or, for ml_dtypes types (bf16, fp8, ...), its bits as an unsigned view.

  Raises:
    TypeError: ``a``'s dtype is neither safetensors' nor an ml_dtypes type (complex,
      strings, datetimes, ...), which :func:`load` could not rebuild.
  """
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  if a.dtype in _NATIVE:
    return a, None
  ml_type = getattr(ml_dtypes, a.dtype.name, None)
  if not isinstance(ml_type, type) or np.dtype(ml_type) != a.dtype:
    raise TypeError(
        f"save: {key!r} has dtype {a.dtype}, which a qjax file cannot hold; convert it to "
        "bool, (u)int8-64, float16/32/64 or an ml_dtypes type (bfloat16, float8_*, int4, "
        "...), e.g. split complex arrays into their real and imaginary parts")
  return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}")), a.dtype.name


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
  if isinstance(v, np.generic):  # a numpy scalar, np.int64(128): the Python 128
    return v.item()
  if isinstance(v, tuple):
    return [_jsonable(e) for e in v]
  if isinstance(v, (np.dtype, type)) or hasattr(v, "dtype") and not hasattr(v, "shape"):
    return np.dtype(v).name
  return v


def save(path: str | os.PathLike, tensors: Mapping[str, Any]) -> None:
  """Saves a flat mapping of names to quantized weights or plain arrays, atomically.

  A quantized weight ``name`` is stored as one tensor per array field, ``name.FIELD``
  (e.g. ``w.codes``, ``w.scales``), in the file's one namespace of tensor names.

  Args:
    path: the ``.safetensors`` file to write (replaced atomically if it exists).
    tensors: ``{name: QuantizedWeight | array}``, names are strings.

  Raises:
    TypeError: ``tensors`` is not a flat mapping of strings to weights or arrays, or an
      array's dtype is neither safetensors' nor an ml_dtypes type (complex, strings, ...).
      Big-endian arrays are stored (and load) in native byte order.
    ValueError: two entries would be stored under one tensor name (a plain array named
      ``w.scales`` beside a quantized weight ``w``).
  """
  from safetensors.numpy import save as st_save  # pylint: disable=g-import-not-at-top
  if not isinstance(tensors, Mapping):
    raise TypeError(f"save takes a flat mapping {{name: QuantizedWeight | array}}, got "
                    f"{type(tensors).__name__}")
  arrays: dict[str, np.ndarray] = {}
  owner: dict[str, str] = {}  # tensor name -> the entry it belongs to
  desc: dict[str, Any] = {}

  def put(key: str, a: Any, name: str) -> None:
    if key == "__metadata__":
      raise ValueError("save: '__metadata__' is the safetensors header's own key; rename it")
    if key in owner:
      raise ValueError(
          f"save: {name!r} and {owner[key]!r} would both be stored as the tensor {key!r} "
          "(a quantized weight 'w' stores 'w.codes', 'w.scales', ...); rename one")
    owner[key] = name
    arrays[key] = _to_numpy(a)

  for name, value in tensors.items():
    if not isinstance(name, str):
      raise TypeError(f"save: tensor names must be strings, got {name!r} "
                      f"({type(name).__name__})")
    if isinstance(value, formats.QuantizedWeight):
      cls = type(value)
      entry = {"format": cls.format_name, "arrays": {}, "static": {}}
      for field in formats.array_field_names(cls):
        a = getattr(value, field)
        if a is None:
          continue
        key = f"{name}.{field}"
        put(key, a, name)
        entry["arrays"][field] = key
      for field in formats.static_field_names(cls):
        entry["static"][field] = _jsonable(getattr(value, field))
    else:
      views = {"ShardedWeight": "save its global weight, value.weight()",
               "LayerOf": "save the stack, value.stack, or one layer, value.layer()"}
      if type(value).__name__ in views:
        raise TypeError(f"save: {name!r} is a {type(value).__name__}, a view of a weight; "
                        f"{views[type(value).__name__]}")
      # A nested mapping (a flax FrozenDict too, which numpy turned into its keys' strings)
      a = None if isinstance(value, Mapping) else _to_numpy(value)
      if a is None or a.dtype == object:
        raise TypeError(
            f"save: {name!r} is a {type(value).__name__}, not an array or a quantized "
            "weight; save takes a flat mapping {name: QuantizedWeight | array} (flatten "
            "nested dicts into dotted names)")
      put(name, a, name)
      entry = {"format": "array", "arrays": {"value": name}}
    desc[name] = entry
  stored, views = {}, {}
  for key, a in arrays.items():
    stored[key], dtype_name = _storable(key, a)
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


MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own bound on its JSON header


def _read_checked(path: pathlib.Path) -> bytes:
  """The file's bytes, after checking that its header length fits in the file (so a
  header claiming terabytes is refused before anything is allocated for it)."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{path}: {size} bytes is too short for a safetensors file (8-byte "
                       "header length first); the file is truncated or not safetensors")
    header_len = int.from_bytes(head, "little")
    if header_len > min(MAX_HEADER_BYTES, size - 8):
      raise ValueError(f"{path}: header length {header_len} exceeds the file "
                       f"({size} bytes) or the {MAX_HEADER_BYTES}-byte limit; the file is "
                       "truncated or not safetensors")
    f.seek(0)
    return f.read()


def _fail(path, what: str) -> ValueError:
  return ValueError(f"{path}: malformed qjax description: {what}; the file is corrupt or "
                    "was not written by qjax.save")


def _description(path, raw: bytes) -> dict[str, Any]:
  """The ``qjax`` JSON description in the safetensors header, its structure checked."""
  header_len = int.from_bytes(raw[:8], "little")
  try:
    meta = json.loads(raw[8:8 + header_len]).get("__metadata__") or {}
    if "qjax" not in meta:
      raise ValueError(f"{path}: safetensors file without a qjax description; "
                       "use safetensors to read plain files")
    header = json.loads(meta["qjax"])
  except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError,
          RecursionError) as e:  # RecursionError: JSON nested beyond Python's stack
    raise _fail(path, f"the header is not the JSON qjax writes ({e})") from None
  if not isinstance(header, dict):
    raise _fail(path, f"a {type(header).__name__}, not an object")
  if header.get("version") != VERSION:
    raise ValueError(f"{path}: qjax file version {header.get('version')!r}; this qjax reads "
                     f"version {VERSION} only (a newer qjax wrote it? upgrade qjax to load it)")
  if not isinstance(header.get("sha256"), str):
    raise _fail(path, "no sha256 string")
  if not isinstance(header.get("tensors"), dict):
    raise _fail(path, "no tensors object")
  views = header.setdefault("views", {})
  if not isinstance(views, dict) or not all(isinstance(v, str) for v in views.values()):
    raise _fail(path, "views must map array names to dtype names")
  for name, entry in header["tensors"].items():
    if (not isinstance(entry, dict) or not isinstance(entry.get("format"), str)
        or not isinstance(entry.get("arrays"), dict)
        or not isinstance(entry.get("static", {}), dict)):
      raise _fail(path, f"entry {name!r} needs a format string, an arrays object and a "
                  "static object")
  return header


def _restore_view(path, key: str, a: np.ndarray, dtype_name: str | None) -> np.ndarray:
  if dtype_name is None:
    return a
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  dtype = getattr(ml_dtypes, dtype_name, None)
  if not isinstance(dtype, type) or np.dtype(dtype).itemsize != a.dtype.itemsize:
    raise _fail(path, f"array {key!r} names the view dtype {dtype_name!r}, which is not an "
                f"ml_dtypes type of {a.dtype.itemsize} bytes")
  return a.view(np.dtype(dtype))


def _build(path, name: str, entry: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
           ) -> Any:
  missing = [k for k in entry["arrays"].values() if not isinstance(k, str) or k not in arrays]
  if missing:
    raise _fail(path, f"entry {name!r} names arrays {missing} that the file does not hold")
  if entry["format"] == "array":
    if "value" not in entry["arrays"]:
      raise _fail(path, f"array entry {name!r} has no 'value'")
    return arrays[entry["arrays"]["value"]]
  try:
    cls = formats.format_class(entry["format"])
  except ValueError as e:  # names the known formats
    raise ValueError(f"{path}: tensor {name!r}: {e}") from None
  fields = set(formats.array_field_names(cls))
  unknown = set(entry["arrays"]) - fields
  if unknown:
    raise _fail(path, f"entry {name!r} has arrays {sorted(unknown)} that "
                f"{cls.__name__} does not have")
  kwargs = {f: None for f in fields}
  kwargs.update({f: arrays[key] for f, key in entry["arrays"].items()})
  static = {}
  for f in dataclasses.fields(cls):
    if f.name in entry.get("static", {}):
      v = entry["static"][f.name]
      static[f.name] = tuple(v) if isinstance(v, list) else v
  try:
    return cls(**kwargs, **static)
  except ValueError as e:
    raise ValueError(f"{path}: tensor {name!r}: {e}") from None
  except (TypeError, KeyError, IndexError, ArithmeticError) as e:
    raise _fail(path, f"{cls.__name__} cannot be built from entry {name!r} ({e})") from None


def load(path: str | os.PathLike, *, offload_pass2: bool = False) -> dict[str, Any]:
  """Loads what :func:`save` wrote: ``{name: QuantizedWeight | np.ndarray}``.

  Nothing is unpickled or executed. The header length is checked against the file size
  before anything else is read; the safetensors library checks every array's dtype,
  shape and byte range; the sha256 of the tensor data (names, dtypes, shapes and bytes)
  must match the one in the description; each quantized weight's class checks its
  arrays' shapes and dtypes.

  Args:
    offload_pass2: place pass 2 of two-pass codebook weights in pinned host memory
      (``qjax.place_pass2``); the other arrays load as usual.

  Raises:
    ValueError: the file is not a qjax file, is truncated or corrupt, its digest does not
      match, or an array does not fit its format's description. No other exception type
      is raised for a bad file (FileNotFoundError for a missing one).
  """
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load as st_load  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(path)
  raw = _read_checked(path)
  try:
    arrays = st_load(raw)
  except (SafetensorError, KeyError, TypeError, AttributeError) as e:  # a dtype numpy lacks
    raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
  header = _description(path, raw)
  del raw
  views = header["views"]
  arrays = {k: _restore_view(path, k, a, views.get(k)) for k, a in arrays.items()}
  if _digest(arrays) != header["sha256"]:
    raise ValueError(f"{path}: sha256 of the tensor data does not match the header; "
                     "the file is corrupt")
  out = {name: _build(path, name, entry, arrays)
         for name, entry in header["tensors"].items()}
  if offload_pass2:
    from qjax._src import offload  # pylint: disable=g-import-not-at-top
    out = offload.place_pass2(out, "pinned_host")
  return out
