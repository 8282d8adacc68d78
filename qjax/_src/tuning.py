"""Kernel tiling configurations and the tuning table that ships as data.

The table is JSON per device kind (``qjax/data/tuning/<device_kind>.json``)::

  {"device_kind": "NVIDIA H100 80GB HBM3",
   "entries": [{"format": "int4", "m_bucket": 16, "k": 4096, "n": 14336,
                "config": {"block_m": 16, "block_n": 128, ...}, "us": 11.2}, ...]}

``lookup`` returns the entry for the same format, M bucket, K and N, else None; kernels
then use their own heuristics. ``qjax bench --tune`` writes the table.

A table is read where a kernel first asks for a config on this device, inside a user's
``jax.jit``: an entry that does not parse (an unknown format, an M bucket the lookup never
asks for, a config field that ``KernelConfig`` lacks or a bad value) is skipped with a
warning that names the file and the entry, and a file that is not a table at all is
ignored with a warning. The kernels then use their heuristics for those shapes, which
are correct, only slower: a stale table must not stop every matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
import warnings
from typing import Any

DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "data" / "tuning"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# The format names the kernels look configs up by (pallas_kernels: int4_matmul,
# fp4_matmul with the weight's format_name, codebook_matmul).
FORMATS = ("int4", "mxfp4", "nvfp4", "codebook")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  """Tiling of a fused dequant-matmul kernel (hashable; round-trips JSON).

  ``ptx_scales``: the FP4 tiled kernel decodes its block scales in inline PTX and applies
  the decoder's constant factor once per output (the GEMV kernels decide that from
  ``block_n`` alone; other kernels ignore it). Measured per shape by the tuner: it wins on
  some shapes and loses on others.
  """
  block_m: int
  block_n: int
  block_k: int
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 3
  ptx_scales: bool = False

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.type in (bool, "bool"):
        if not isinstance(v, bool):
          raise ValueError(f"KernelConfig.{f.name}={v!r} must be True or False")
      elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"KernelConfig.{f.name}={v!r} must be a positive int")
    for name in ("block_m", "block_n", "block_k"):
      v = getattr(self, name)
      if v & (v - 1):
        raise ValueError(f"KernelConfig.{name}={v} must be a power of two (Triton needs it)")

  def to_json(self) -> dict[str, Any]:
    """The fields as a dict; ``ptx_scales`` only where set (older tables lack it)."""
    d = dataclasses.asdict(self)
    if not self.ptx_scales:
      del d["ptx_scales"]
    return d

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> "KernelConfig":
    """The config :meth:`to_json` wrote (``ptx_scales`` False where absent).

    Raises:
      ValueError: ``d`` is not a dict, has a field this class lacks, or a value of the
        wrong type (the values are taken as they are: ``"16"``, ``16.5`` or ``true`` for an
        int field, and ``"false"`` or ``0`` for ``ptx_scales``, are errors, not converted).
    """
    if not isinstance(d, dict):
      raise ValueError(f"a config must be a JSON object of KernelConfig fields, got {d!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in d if k not in known]
    if unknown:
      raise ValueError(f"unknown KernelConfig field(s) {', '.join(map(repr, unknown))}; "
                       f"known: {', '.join(known)}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in d and f.default is dataclasses.MISSING]
    if missing:
      raise ValueError(f"KernelConfig field(s) {', '.join(map(repr, missing))} missing")
    return cls(**d)


def m_bucket(m: int) -> int:
  """Smallest bucket >= m (the last bucket for anything larger)."""
  for b in M_BUCKETS:
    if m <= b:
      return b
  return M_BUCKETS[-1]


def device_file_name(device_kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") + ".json"


Key = tuple[str, int, int, int]  # (format, M bucket, K, N)


def parse_entry(e: Any) -> tuple[Key, KernelConfig]:
  """The lookup key and config of one table entry.

  Raises:
    ValueError: naming the field that is missing or wrong.
  """
  if not isinstance(e, dict):
    raise ValueError(f"an entry must be a JSON object, got {type(e).__name__}")
  missing = [f for f in ("format", "m_bucket", "k", "n", "config") if f not in e]
  if missing:
    raise ValueError(f"field(s) {', '.join(map(repr, missing))} missing")
  if e["format"] not in FORMATS:
    raise ValueError(f"format {e['format']!r} is not one the kernels look up "
                     f"({', '.join(FORMATS)})")
  for f in ("m_bucket", "k", "n"):
    if isinstance(e[f], bool) or not isinstance(e[f], int) or e[f] < 1:
      raise ValueError(f"{f}={e[f]!r} must be a positive int")
  if e["m_bucket"] not in M_BUCKETS:
    raise ValueError(f"m_bucket={e['m_bucket']} is not one of the buckets {M_BUCKETS}")
  return (e["format"], e["m_bucket"], e["k"], e["n"]), KernelConfig.from_json(e["config"])


def _entries(path: pathlib.Path) -> list[Any]:
  """The ``entries`` list of a table file; ValueError naming the file if it has none."""
  try:
    data = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise ValueError(f"tuning table {path}: cannot be read as JSON ({e})") from None
  if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
    raise ValueError(f"tuning table {path}: not a tuning table (a JSON object with an "
                     "\"entries\" list)")
  return data["entries"]


def read_table(path: pathlib.Path) -> dict[Key, KernelConfig]:
  """The configs of a table file by key. A file that is not a table is ignored, and an
  entry that does not parse skipped, each with a warning naming the file and the entry
  (the kernels use their heuristics there)."""
  try:
    entries = _entries(path)
  except ValueError as e:
    warnings.warn(f"{e}; ignored, the kernels use their heuristics on this device. Rewrite "
                  "it with qjax bench --tune, or delete it", stacklevel=2)
    return {}
  table = {}
  for i, e in enumerate(entries):
    try:
      key, cfg = parse_entry(e)
    except ValueError as err:
      warnings.warn(f"tuning table {path}: entry {i} ({json.dumps(e)[:160]}) ignored: {err}. "
                    "Fix or delete the entry (qjax bench --tune rewrites it)", stacklevel=2)
      continue
    table[key] = cfg
  return table


@functools.lru_cache(maxsize=None)
def _table(device_kind: str) -> dict[Key, KernelConfig]:
  path = DATA_DIR / device_file_name(device_kind)
  if not path.exists():
    return {}
  return read_table(path)


def lookup(device_kind: str, fmt: str, m: int, k: int, n: int) -> KernelConfig | None:
  """The tuned config of ``fmt`` for M's bucket, K and N on this device kind, else None
  (always None for a format outside :data:`FORMATS`, such as a registered subclass's own
  ``format_name``: no table holds one, and the kernel's heuristics serve it)."""
  return _table(device_kind).get((fmt, m_bucket(m), k, n))


def write_table(device_kind: str, entries: list[dict[str, Any]], path: pathlib.Path | None = None
                ) -> pathlib.Path:
  """Merges ``entries`` into the device's table file (atomically) and returns its path.

  Raises:
    ValueError: naming the file and the entry, where the file already there is not a
      table or one of its entries (or of ``entries``) does not parse: rewriting it would
      drop what the lookup cannot read, so it is left as it is, to fix or delete.
  """
  path = path or DATA_DIR / device_file_name(device_kind)
  old = _entries(path) if path.exists() else []
  merged = {}
  for where, batch in ((f"tuning table {path}", old), ("new", entries)):
    for i, e in enumerate(batch):
      try:
        merged[parse_entry(e)[0]] = e
      except ValueError as err:
        raise ValueError(f"{where} entry {i} ({json.dumps(e)[:160]}): {err}; fix or delete "
                         "it") from None
  body = {"device_kind": device_kind,
          "entries": [merged[k] for k in sorted(merged)]}
  tmp = path.with_suffix(".tmp")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp.write_text(json.dumps(body, indent=1) + "\n")
  tmp.replace(path)
  _table.cache_clear()
  return path
