"""Kernel tiling configurations and the tuning table that ships as data.

The table is JSON per device kind (``qjax/data/tuning/<device_kind>.json``)::

  {"device_kind": "NVIDIA H100 80GB HBM3",
   "entries": [{"format": "int4", "m_bucket": 16, "k": 4096, "n": 14336,
                "config": {"block_m": 16, "block_n": 128, ...}, "us": 11.2}, ...]}

Entries of the Triton kernels' formats (``int4``, ``mxfp4``, ``nvfp4``, ``codebook``) hold a
:class:`KernelConfig`; those of the Hopper wgmma kernel's layouts (``int4nk``, ``mxfp4nk``,
``nvfp4nk``) a :class:`WgmmaConfig`. ``lookup`` returns the entry for the same format, M
bucket, K and N, else None; kernels then use their own heuristics. ``qjax bench --tune``
writes the table.

A table is read where a kernel first asks for a config on this device, inside a user's
``jax.jit``: an entry that does not parse (an unknown format, an M bucket the lookup never
asks for, a config field that its config class lacks or a bad value) is skipped with a
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
# fp4_matmul with the weight's format_name, codebook_matmul; the Hopper wgmma kernel
# int4_wgmma for Int4NKWeight, MXFP4NKWeight and NVFP4NKWeight), and the config class each
# format's entries hold (CONFIG_TYPES, filled in below the classes).
FORMATS = ("int4", "mxfp4", "nvfp4", "codebook", "int4nk", "mxfp4nk", "nvfp4nk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  """Tiling of a fused dequant-matmul kernel (hashable; round-trips JSON).

  ``block_m``, ``block_n``, ``block_k``: the tile of x's rows, W's columns and the K step
  (powers of two); ``split_k``: K split over this many programs, their partial sums
  added afterwards; ``num_warps``, ``num_stages``: Triton's warps per program and
  software-pipeline depth. ``ptx_scales``: the FP4 tiled kernel decodes its block
  scales in inline PTX and applies the decoder's constant factor once per output (the
  GEMV kernels decide that from ``block_n`` alone; other kernels ignore it). Measured
  per shape by the tuner: it wins on some shapes and loses on others.
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
    return _config_from_json(cls, d)


def _config_from_json(cls: type, d: Any) -> Any:
  """``cls(**d)`` for a config dataclass, with errors that name the class and fields."""
  name = cls.__name__
  if not isinstance(d, dict):
    raise ValueError(f"a config must be a JSON object of {name} fields, got {d!r}")
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = [k for k in d if k not in known]
  if unknown:
    raise ValueError(f"unknown {name} field(s) {', '.join(map(repr, unknown))}; "
                     f"known: {', '.join(known)}")
  missing = [f.name for f in dataclasses.fields(cls)
             if f.name not in d and f.default is dataclasses.MISSING]
  if missing:
    raise ValueError(f"{name} field(s) {', '.join(map(repr, missing))} missing")
  return cls(**d)


# K per pipeline step of the Hopper wgmma kernel (pallas_kernels.int4_wgmma): powers of
# two, and for K = 2880 (GPT-OSS) multiples of 64 that divide it; those take FP4 weights
# only (INT4 steps must divide or span whole groups).
WGMMA_TILE_K = (64, 128, 192, 256, 320, 512, 576)


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
  """Static tile configuration of the Hopper wgmma kernel
  (``pallas_kernels.int4_wgmma.int4_nk_matmul`` / ``fp4_nk_matmul``; hashable,
  round-trips JSON for the tuning table's ``int4nk`` / ``mxfp4nk`` / ``nvfp4nk`` entries).

  Attributes:
    tile_n: rows of W^T (columns of y) per compute warpgroup; wgmma's M: 64 or 128.
    tile_m: rows of x per CTA; wgmma's N: a multiple of 8, at most 256.
    tile_k: K per pipeline step: 64, 128, 256 or 512, dividing the group size or a
      multiple of it (512 with groups of 128: four scale rows and four wgmmas per step,
      and 256-byte rows of int4 per TMA copy instead of 64); FP4 also 192, 320 or 576
      (for K = 2880).
    stages: pipeline depth (TMA copies in flight).
    epi_m: rows of y per epilogue store; divides tile_m.
    split_k: K splits (float32 partial outputs summed by XLA when > 1).
    m_minor: walk output tiles with M fastest (each W^T tile read once from memory, x
      tiles from L2) instead of N fastest.
    consumers: compute warpgroups per CTA, each owning tile_n rows of W^T: 2 (3 and 4
      compiled but hung on the H100; 4 compute warpgroups run with a register count
      that fits, but were slower: BENCHMARKS.md session 28).
    snake_width: 0, or walk the tiles along a snake of this many rows (columns with
      m_minor) for locality in L2 (``plgpu.planar_snake``).
    chain_tiles: run a CTA's tiles as one chained pipeline (Pallas' ``pipeline_state``
      START / STEADY / STOP): the memory warpgroup loads the next tile's first steps
      while the compute warpgroups finish the last ones and store, instead of refilling an
      empty pipeline per tile. Needs ``stages`` to divide the K steps of a tile.
    scale_accumulator: multiply the group scales into float32 partial products (one
      wgmma per group into its own accumulator, then ``acc += part * s``) instead of into
      the bf16 weights: fewer multiplies where the accumulator is small (small tile_m).
    mma_sync: multiply each group (INT4, with ``scale_accumulator``) or 128 of K (FP4)
      with per-warp ``mma.sync.m16n8k16`` (x's fragments by ``ldmatrix`` from the
      swizzled tile) into a float32 value of its own, added to the accumulator, instead
      of a warpgroup-wide wgmma: no wgmma fences or waits in the step.
  """
  tile_n: int = 64
  tile_m: int = 256
  tile_k: int = 64
  stages: int = 4
  epi_m: int = 64
  split_k: int = 1
  m_minor: bool = False
  consumers: int = 2
  snake_width: int = 0
  chain_tiles: bool = False
  scale_accumulator: bool = False
  mma_sync: bool = False

  def __post_init__(self):
    if (isinstance(self.snake_width, bool) or not isinstance(self.snake_width, int)
        or self.snake_width < 0):
      raise ValueError(f"WgmmaConfig.snake_width={self.snake_width!r} must be an int >= 0")
    for name in ("m_minor", "chain_tiles", "scale_accumulator", "mma_sync"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"WgmmaConfig.{name}={getattr(self, name)!r} must be a bool")
    if self.consumers != 2:
      # 3 and 4 lowered but hung on the H100 (session 16). With 4, Pallas' pipeline asks
      # setmaxnreg for 112 registers per compute thread, more than a block of 640 threads
      # holds (96 each): a count that fits runs them, correct and 3-25 % slower than 2
      # (session 28, BENCHMARKS.md). The pipeline is only run with 2.
      raise ValueError(f"WgmmaConfig.consumers={self.consumers!r} must be 2")
    for name in ("tile_n", "tile_m", "tile_k", "stages", "epi_m", "split_k"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"WgmmaConfig.{name}={v!r} must be a positive int")
    if self.tile_n not in (64, 128):
      raise ValueError(f"WgmmaConfig.tile_n={self.tile_n} must be 64 or 128 (wgmma M)")
    if self.tile_m % 8 or self.tile_m > 256:
      raise ValueError(f"WgmmaConfig.tile_m={self.tile_m} must be a multiple of 8 up to 256")
    if self.tile_k not in WGMMA_TILE_K:
      raise ValueError(f"WgmmaConfig.tile_k={self.tile_k} must be one of {WGMMA_TILE_K}")
    if self.tile_m % self.epi_m or self.epi_m % 8:
      raise ValueError(
          f"WgmmaConfig.epi_m={self.epi_m} must be a multiple of 8 dividing tile_m="
          f"{self.tile_m}")

  def epilogue_bytes(self) -> int:
    """Shared memory of the epilogue: two buffers per compute warpgroup."""
    return self.consumers * 2 * self.epi_m * self.tile_n * (4 if self.split_k > 1 else 2)

  def stage_bytes(self, group_size: int = 128, scale_bytes: int = 2) -> int:
    """Shared memory of one pipeline stage: x tile, W^T tile (4-bit), scale rows (one per
    ``group_size`` of K, ``scale_bytes`` per element: 2 for bf16, 1 for FP4's E8M0 or
    float8_e4m3fn)."""
    c = self.consumers
    return (self.tile_m * self.tile_k * 2 + c * self.tile_n * self.tile_k // 2
            + c * self.tile_n * scale_bytes * max(1, self.tile_k // group_size))

  def to_json(self) -> dict[str, Any]:
    """The fields as a dict."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> "WgmmaConfig":
    """The config :meth:`to_json` wrote (fields left out take their defaults).

    Raises:
      ValueError: as :meth:`KernelConfig.from_json`.
    """
    return _config_from_json(cls, d)


def m_bucket(m: int) -> int:
  """Smallest bucket >= m (the last bucket for anything larger)."""
  for b in M_BUCKETS:
    if m <= b:
      return b
  return M_BUCKETS[-1]


def device_file_name(device_kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") + ".json"


Config = KernelConfig | WgmmaConfig
CONFIG_TYPES: dict[str, type] = {
    fmt: WgmmaConfig if fmt.endswith("nk") else KernelConfig for fmt in FORMATS}

Key = tuple[str, int, int, int]  # (format, M bucket, K, N)


def parse_entry(e: Any) -> tuple[Key, Config]:
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
  cls = CONFIG_TYPES[e["format"]]
  return (e["format"], e["m_bucket"], e["k"], e["n"]), cls.from_json(e["config"])


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


def read_table(path: pathlib.Path) -> dict[Key, Config]:
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
def _table(device_kind: str) -> dict[Key, Config]:
  path = DATA_DIR / device_file_name(device_kind)
  if not path.exists():
    return {}
  return read_table(path)


def lookup(device_kind: str, fmt: str, m: int, k: int, n: int) -> Config | None:
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
