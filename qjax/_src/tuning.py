"""Kernel tiling configurations and the tuning table that ships as data.

The table is JSON per device kind (``qjax/data/tuning/<device_kind>.json``)::

  {"device_kind": "NVIDIA H100 80GB HBM3",
   "entries": [{"format": "int4", "m_bucket": 16, "k": 4096, "n": 14336,
                "config": {"block_m": 16, "block_n": 128, ...}, "us": 11.2}, ...]}

``lookup`` returns the entry for the same format, M bucket, K and N, else None; kernels
then use their own heuristics. ``qjax bench --tune`` writes the table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from typing import Any

DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "data" / "tuning"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


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
    """The config :meth:`to_json` wrote (``ptx_scales`` False where absent)."""
    return cls(**{k: (bool(v) if k == "ptx_scales" else int(v)) for k, v in d.items()})


def m_bucket(m: int) -> int:
  """Smallest bucket >= m (the last bucket for anything larger)."""
  for b in M_BUCKETS:
    if m <= b:
      return b
  return M_BUCKETS[-1]


def device_file_name(device_kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") + ".json"


@functools.lru_cache(maxsize=None)
def _table(device_kind: str) -> dict[tuple[str, int, int, int], KernelConfig]:
  path = DATA_DIR / device_file_name(device_kind)
  if not path.exists():
    return {}
  data = json.loads(path.read_text())
  return {(e["format"], int(e["m_bucket"]), int(e["k"]), int(e["n"])):
          KernelConfig.from_json(e["config"]) for e in data["entries"]}


def lookup(device_kind: str, fmt: str, m: int, k: int, n: int) -> KernelConfig | None:
  return _table(device_kind).get((fmt, m_bucket(m), k, n))


def write_table(device_kind: str, entries: list[dict[str, Any]], path: pathlib.Path | None = None
                ) -> pathlib.Path:
  """Merges ``entries`` into the device's table file (atomically) and returns its path."""
  path = path or DATA_DIR / device_file_name(device_kind)
  old = json.loads(path.read_text())["entries"] if path.exists() else []
  key = lambda e: (e["format"], int(e["m_bucket"]), int(e["k"]), int(e["n"]))
  merged = {key(e): e for e in old}
  merged.update({key(e): e for e in entries})
  body = {"device_kind": device_kind,
          "entries": [merged[k] for k in sorted(merged)]}
  tmp = path.with_suffix(".tmp")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp.write_text(json.dumps(body, indent=1) + "\n")
  tmp.replace(path)
  _table.cache_clear()
  return path
