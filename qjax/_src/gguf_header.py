"""A bounded check of a GGUF file's header, run before the ``gguf`` package parses it.

``gguf.GGUFReader`` trusts the counts in a file: an array that claims 10**12 elements
past the end of the file makes it loop (and grow lists) once per claimed element, since
its reads past the end return empty arrays instead of failing. This walker reads the
same structure with every count and length checked against the bytes left, so a hostile
file costs at most one pass over its header and raises one ``ValueError`` that says
what is wrong and where. Files that pass are safe to hand to the ``gguf`` reader: every
read it will make lies inside the file.

Checked: the magic and version; key-value and tensor counts against the header bytes;
string lengths, value types, array lengths and nesting; UTF-8 keys and tensor names;
duplicate keys and names; ``general.alignment``; tensor dims (1 to 4 dims, each positive,
element counts that fit in 63 bits, the first dim a multiple of the type's block); known
GGML types; tensor offsets aligned, inside the file, and not overlapping.
"""

from __future__ import annotations

import mmap
import os
import struct

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4            # GGML_MAX_DIMS
MAX_NESTING = 8         # arrays of arrays of ... in metadata
DEFAULT_ALIGNMENT = 32
MAX_ELEMENTS = 2**62    # per tensor, so byte counts stay far from int64 overflow

# GGUF metadata value types: id -> (name, size in bytes of a scalar; None: variable).
_VALUE_TYPES = {0: ("UINT8", 1), 1: ("INT8", 1), 2: ("UINT16", 2), 3: ("INT16", 2),
                4: ("UINT32", 4), 5: ("INT32", 4), 6: ("FLOAT32", 4), 7: ("BOOL", 1),
                8: ("STRING", None), 9: ("ARRAY", None), 10: ("UINT64", 8),
                11: ("INT64", 8), 12: ("FLOAT64", 8)}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
  """GGML type id -> (name, block size, bytes per block), from the gguf package."""
  import gguf  # pylint: disable=g-import-not-at-top
  return {int(t): (t.name, int(b), int(s)) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}


class _Cursor:
  """Reads little- or big-endian integers from a buffer, never past its end."""

  def __init__(self, buf, path: str, order: str):
    self.buf, self.path, self.order, self.pos = buf, path, order, 0
    self.integers: list[tuple[int, int]] | None = None  # (offset, size) of each read

  def left(self) -> int:
    return len(self.buf) - self.pos

  def fail(self, what: str) -> ValueError:
    return ValueError(f"{self.path} is not a valid GGUF file: {what}")

  def need(self, n: int, what: str) -> None:
    if n > self.left():
      raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, but the file has "
                      f"{self.left()} left (truncated or corrupt)")

  def skip(self, n: int, what: str) -> None:
    self.need(n, what)
    self.pos += n

  def uint(self, size: int, what: str) -> int:
    self.need(size, what)
    fmt = {4: "I", 8: "Q"}[size]
    (v,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
    if self.integers is not None:
      self.integers.append((self.pos, size))
    self.pos += size
    return v

  def string(self, what: str, max_len: int | None = None) -> bytes:
    n = self.uint(8, f"length of {what}")
    if max_len is not None and n > max_len:
      raise self.fail(f"{what} at offset {self.pos - 8} claims {n} bytes (at most {max_len})")
    self.need(n, f"{what} ({n} bytes)")
    s = bytes(self.buf[self.pos:self.pos + n])
    self.pos += n
    return s

  def text(self, what: str, max_len: int | None = None) -> str:
    raw = self.string(what, max_len)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError:
      raise self.fail(f"{what} {raw[:40]!r} is not UTF-8") from None


def _skip_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> None:
  if vtype not in _VALUE_TYPES:
    raise cur.fail(f"metadata {key!r} has unknown value type {vtype} (known: 0..12)")
  name, size = _VALUE_TYPES[vtype]
  if size is not None:
    cur.skip(size, f"metadata {key!r} ({name})")
  elif vtype == _STRING:
    cur.string(f"string value of {key!r}")
  else:
    if depth >= MAX_NESTING:
      raise cur.fail(f"metadata {key!r} nests arrays deeper than {MAX_NESTING}")
    itype = cur.uint(4, f"element type of array {key!r}")
    count = cur.uint(8, f"length of array {key!r}")
    if itype not in _VALUE_TYPES:
      raise cur.fail(f"array {key!r} has unknown element type {itype} (known: 0..12)")
    isize = _VALUE_TYPES[itype][1]
    min_size = isize if isize is not None else (8 if itype == _STRING else 12)
    if count * min_size > cur.left():
      raise cur.fail(f"array {key!r} claims {count} {_VALUE_TYPES[itype][0]} elements "
                     f"({count * min_size} bytes at least), but the file has {cur.left()} "
                     f"bytes left at offset {cur.pos}")
    if isize is not None:
      cur.skip(count * isize, f"array {key!r}")
    else:
      for _ in range(count):
        _skip_value(cur, itype, key, depth + 1)


def check_gguf_file(path: str | os.PathLike[str]) -> None:
  """Raises one ValueError if ``path`` is not a well-formed GGUF file (see the module doc).

  Memory: the file is memory-mapped and read once up to the end of its tensor infos;
  nothing is allocated in proportion to a count the file claims.
  """
  path = os.fspath(path)
  size = os.path.getsize(path)
  if size < 24:
    _check(b"", path, size)  # raises its error for a short file (mmap refuses 0 bytes)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    _check(buf, path, size)


def integer_fields(data: bytes) -> list[tuple[int, int]]:
  """``(offset, size)`` of every count, length, type, dim and offset in a valid GGUF
  header (for the fuzzer's structure-aware mutations)."""
  fields: list[tuple[int, int]] = [(4, 4)]  # the version
  _check(data, "<bytes>", len(data), fields)
  return fields


def _check(buf, path: str, size: int, integers: list | None = None) -> None:
  if size < 24:
    raise ValueError(f"{path} is not a valid GGUF file: {size} bytes is shorter than the "
                     "24-byte GGUF header")
  if bytes(buf[:4]) != MAGIC:
    raise ValueError(f"{path} is not a GGUF file: magic {bytes(buf[:4])!r}, want {MAGIC!r}")
  (version,) = struct.unpack_from("<I", buf, 4)
  order = "<"
  if version & 0xFFFF == 0:  # written on a big-endian machine
    (version,) = struct.unpack_from(">I", buf, 4)
    order = ">"
  cur = _Cursor(buf, path, order)
  cur.integers = integers
  if version not in SUPPORTED_VERSIONS:
    raise cur.fail(f"version {version}; qjax reads GGUF versions {SUPPORTED_VERSIONS}")
  cur.pos = 8
  n_tensors = cur.uint(8, "tensor count")
  n_kv = cur.uint(8, "key-value count")
  # Smallest entries: a key-value is a key length, a type and a 1-byte value (13 bytes);
  # a tensor info is a name length, n_dims, one dim, a type and an offset (32 bytes).
  if n_kv * 13 > cur.left():
    raise cur.fail(f"{n_kv} key-value pairs cannot fit in the {cur.left()} bytes left")
  if n_tensors * 32 > cur.left():
    raise cur.fail(f"{n_tensors} tensors cannot fit in the {cur.left()} bytes left")

  alignment = DEFAULT_ALIGNMENT
  keys = set()
  for i in range(n_kv):
    key = cur.text(f"key of metadata entry {i}", max_len=65535)
    if key in keys:
      raise cur.fail(f"metadata key {key!r} appears twice")
    keys.add(key)
    vtype = cur.uint(4, f"value type of {key!r}")
    start = cur.pos
    _skip_value(cur, vtype, key)
    if key == "general.alignment":
      if vtype != _UINT32:
        raise cur.fail(f"general.alignment has value type {vtype}, want UINT32 ({_UINT32})")
      (alignment,) = struct.unpack_from(order + "I", buf, start)
      if alignment == 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment={alignment} must be a power of two")

  types = _quant_sizes()
  infos = []
  names = set()
  for i in range(n_tensors):
    name = cur.text(f"name of tensor {i}", max_len=65535)
    if name in names:
      raise cur.fail(f"tensor name {name!r} appears twice")
    names.add(name)
    n_dims = cur.uint(4, f"dim count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
      raise cur.fail(f"tensor {name!r} has {n_dims} dims; GGUF tensors have 1 to {MAX_DIMS}")
    dims = [cur.uint(8, f"dim {d} of tensor {name!r}") for d in range(n_dims)]
    elements = 1
    for d in dims:
      if d < 1:
        raise cur.fail(f"tensor {name!r} has dims {dims}; every dim must be positive")
      elements *= d
      if elements > MAX_ELEMENTS:
        raise cur.fail(f"tensor {name!r} has dims {dims}: over {MAX_ELEMENTS} elements")
    type_id = cur.uint(4, f"type of tensor {name!r}")
    if type_id not in types:
      raise cur.fail(f"tensor {name!r} has unknown GGML type {type_id}")
    type_name, block, block_bytes = types[type_id]
    if dims[0] % block:
      raise cur.fail(f"tensor {name!r} ({type_name}) has dims {dims}: the first dim must be "
                     f"a multiple of the block size {block}")
    offset = cur.uint(8, f"data offset of tensor {name!r}")
    if offset % alignment:
      raise cur.fail(f"tensor {name!r} has data offset {offset}, not a multiple of the "
                     f"alignment {alignment}")
    infos.append((offset, elements // block * block_bytes, name))

  data_start = -(-cur.pos // alignment) * alignment
  end_of_previous, previous = 0, None
  for offset, nbytes, name in sorted(infos):
    if data_start + offset + nbytes > size:
      raise cur.fail(f"tensor {name!r} needs {nbytes} bytes at offset {data_start + offset}, "
                     f"past the end of the {size}-byte file (truncated or corrupt)")
    if offset < end_of_previous:
      raise cur.fail(f"tensors {previous!r} and {name!r} overlap in the data section")
    end_of_previous, previous = offset + nbytes, name
