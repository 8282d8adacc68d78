"""``qjax check``: every format and layout x every implementation x many shapes, against
a float64 reference.

The reference for a weight ``w`` is ``float64(x) @ float64(w.dequantize())``, with ``x``
already rounded to the activation dtype: it checks that each implementation computes
the format's own contract, whatever the layout (llama.cpp's test-backend-ops idea). A
case misses when its relative error ``||y - ref|| / ||ref||`` reaches the threshold
(1e-2), when ``y`` is not finite, or when the implementation raises anything but
NotImplementedError (a kernel declining a shape; reported as skipped).

Shapes: :data:`SHAPES` holds 56 ``(M, K, N)`` with M from 1 to 4096 (primes included)
and K, N at and off tile multiples; each format rounds K and N up to what it can hold
(block sizes, 8 columns per word, Marlin tiles), so a shape that is off-tile for one
format is on-tile for another. ``full=True`` runs every shape on XLA and the compiled
kernel (the GPU form); the reduced default runs a spread of the shapes whose
``M * K * N`` stays small on XLA, and a few small shapes on the interpreted kernel (one
Python step per program: slow), which keeps a CPU run within a few minutes. Interpret
mode runs the reduced shapes in both forms: the compiled kernel covers the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

THRESHOLD = 1e-2

# M from 1 to 4096, primes among them; (K, N) pairs at and off multiples of 128 / 64.
_MS = (1, 2, 3, 5, 7, 13, 16, 31, 64, 100, 127, 257, 1024, 4096)
_KNS = ((128, 64), (256, 256), (384, 70), (512, 33), (640, 130), (768, 512), (1024, 1000),
        (2048, 128), (4096, 4096), (4096, 1024), (96, 8), (256, 17), (1536, 384))
SHAPES = tuple((m, *_KNS[(4 * i + j) % len(_KNS)]) for i, m in enumerate(_MS)
               for j in range(4))
ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

REDUCED_XLA_MAX_WORK = 2**26       # M * K * N on the CPU's XLA path
REDUCED_XLA_SHAPES = 6             # per format, plus M = 4096
INTERPRET_SHAPES = ((1, 256, 64), (13, 512, 130))


# ------------------------------------------------------------------------------ formats


@dataclasses.dataclass(frozen=True)
class FormatCase:
  """One format or layout: how to build a ``[K, N]`` weight and which K, N it holds."""
  name: str
  build: Callable[[np.random.Generator, int, int], Any]
  k_multiple: int
  n_multiple: int = 1

  def fit(self, k: int, n: int) -> tuple[int, int]:
    """K and N rounded up to what this format holds."""
    return (-(-k // self.k_multiple) * self.k_multiple,
            -(-n // self.n_multiple) * self.n_multiple)


def _random_int4(rng, k, n, group_size, kind="sym", scale_dtype=jnp.bfloat16):
  """An Int4Weight with random codes (every code value), random positive scales of
  ``x @ W``'s natural size, and random zero points or float biases: quicker to build than
  quantizing (no compile per shape) and it covers every code."""
  import qjax  # pylint: disable=g-import-not-at-top
  from qjax._src import packing  # pylint: disable=g-import-not-at-top
  g = group_size or k
  codes = rng.integers(0, 16, (k, n), dtype=np.uint8)
  scales = rng.uniform(0.5, 1.5, (k // g, n)) / (4 * np.sqrt(k))
  zeros = biases = None
  if kind == "asym":
    zeros = jnp.asarray(rng.integers(0, 16, (k // g, n), dtype=np.uint8))
  elif kind == "bias":
    biases = jnp.asarray(rng.standard_normal((k // g, n)) * scales * 4, scale_dtype)
  return qjax.Int4Weight(codes=jnp.asarray(packing.pack_codes(codes, packing.NATIVE_TILE_K)),
                         scales=jnp.asarray(scales, scale_dtype), zeros=zeros, biases=biases,
                         shape=(k, n), group_size=g)


def _int4(group_size, kind, scale_dtype=jnp.bfloat16):
  return lambda rng, k, n: _random_int4(rng, k, n, group_size, kind, scale_dtype)


def gguf_blocks(rng, ggml_type: str, k: int, n: int) -> np.ndarray:
  """Random GGUF blocks ``[N, K // block * bytes]``: every code and sub-scale bit random,
  f16 scales small enough that ``x @ W`` stays well inside float16 (as a real weight's)."""
  from qjax._src import gguf_formats as gf  # pylint: disable=g-import-not-at-top
  cls = gf.BLOCK_FORMATS[ggml_type]
  nb = k // cls.block_size
  raw = rng.integers(0, 256, (n, nb, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.standard_normal((n, nb)) * 0.02 / np.sqrt(k)).astype(np.float16)
      raw[:, :, f.offset:f.offset + 2] = v.view(np.uint8).reshape(n, nb, 2)
  if ggml_type == "MXFP4":  # E8M0 block scales around 1 / sqrt(K), as _fp4's
    exponent = int(np.floor(np.log2(1 / (4 * np.sqrt(k))))) + 127
    raw[:, :, 0] = rng.integers(exponent - 2, exponent + 2, (n, nb), dtype=np.uint8)
  return raw.reshape(n, nb * cls.type_size)


def _gguf(ggml_type, tiled):
  def build(rng, k, n):
    from qjax._src import gguf_formats as gf  # pylint: disable=g-import-not-at-top
    from qjax._src import gguf_tiled  # pylint: disable=g-import-not-at-top
    w = gf.from_gguf_bytes(gguf_blocks(rng, ggml_type, k, n), ggml_type, (k, n))
    return gguf_tiled.kernel_layout(w) if tiled else w
  return build


def _layout(convert, group_size=128, kind="asym"):
  def build(rng, k, n):
    return convert(rng, _random_int4(rng, k, n, group_size, kind, jnp.float16))
  return build


def _gptq_act_order(rng, w):
  import qjax  # pylint: disable=g-import-not-at-top
  k = w.shape[0]
  g_idx = rng.permutation(np.arange(k) // w.group_size).astype(np.int32)
  return qjax.GPTQWeight.from_int4(w, zero_point_version=1, g_idx=g_idx)


def _fp4(kind):
  """Random E2M1 codes (every value) with random block scales around ``1 / sqrt(K)``."""
  def build(rng, k, n):
    import qjax  # pylint: disable=g-import-not-at-top
    from qjax._src import packing  # pylint: disable=g-import-not-at-top
    codes = jnp.asarray(packing.pack_codes(rng.integers(0, 16, (k, n), dtype=np.uint8),
                                           packing.NATIVE_TILE_K))
    if kind == "nvfp4":
      scales = rng.uniform(0.5, 1.5, (k // 16, n)) * 64
      return qjax.NVFP4Weight(codes=codes, scales=jnp.asarray(scales, jnp.float8_e4m3fn),
                              global_scale=jnp.float32(1 / (256 * np.sqrt(k))), shape=(k, n))
    exponent = int(np.floor(np.log2(1 / (4 * np.sqrt(k))))) + 127
    scales = jnp.asarray(rng.integers(exponent - 2, exponent + 2, (k // 32, n)), jnp.uint8)
    mx = qjax.MXFP4Weight(codes=codes, scales=scales, shape=(k, n))
    return qjax.GptOssMXFP4Weight.from_mxfp4(mx) if kind == "gpt_oss" else mx
  return build


def format_cases() -> list[FormatCase]:
  import qjax  # pylint: disable=g-import-not-at-top
  cases = [
      FormatCase("int4-sym-g32", _int4(32, "sym"), 32),
      FormatCase("int4-sym-g128", _int4(128, "sym"), 128),
      FormatCase("int4-sym-chan", _int4(None, "sym"), 32),
      FormatCase("int4-asym-g64-f16", _int4(64, "asym", jnp.float16), 64),
      FormatCase("int4-asym-g256-f32", _int4(256, "asym", jnp.float32), 256),
      FormatCase("int4-bias-g32-f16", _int4(32, "bias", jnp.float16), 32),
  ]
  for t in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
    block = 32 if t in ("Q4_0", "Q4_1", "Q8_0") else 256
    cases.append(FormatCase(f"gguf-{t}", _gguf(t, tiled=False), block))
    if t not in ("Q4_0", "Q4_1"):
      cases.append(FormatCase(f"gguf_tiled-{t}", _gguf(t, tiled=True), block))
  cases.append(FormatCase("gguf-MXFP4", _gguf("MXFP4", tiled=False), 32))
  cases += [
      FormatCase("gptq-v2-g128", _layout(lambda r, w: qjax.GPTQWeight.from_int4(w)), 128, 8),
      FormatCase("gptq-v1-actorder-g32", _layout(_gptq_act_order, 32, "sym"), 32, 8),
      FormatCase("awq-g128", _layout(lambda r, w: qjax.AWQWeight.from_int4(w)), 128, 8),
      FormatCase("compressed_tensors-sym-g64", _layout(
          lambda r, w: qjax.CompressedTensorsWeight.from_int4(w), 64, "sym"), 64),
      FormatCase("compressed_tensors-asym-g128", _layout(
          lambda r, w: qjax.CompressedTensorsWeight.from_int4(w)), 128),
      FormatCase("int4_nk-sym-g128", lambda r, k, n: qjax.to_int4_nk(
          _random_int4(r, k, n, 128, "sym", jnp.bfloat16)), 128, 128),
      FormatCase("int4_nk-asym-g64-f16", lambda r, k, n: qjax.to_int4_nk(
          _random_int4(r, k, n, 64, "asym", jnp.float16)), 64, 128),
      FormatCase("marlin-sym-g128", _layout(
          lambda r, w: qjax.MarlinWeight.from_int4(w), 128, "sym"), 128, 64),
      FormatCase("marlin-asym-g128", _layout(lambda r, w: qjax.MarlinWeight.from_int4(w)),
                 128, 64),
      FormatCase("mxfp4", _fp4("mxfp4"), 32),
      FormatCase("nvfp4", _fp4("nvfp4"), 16),
      FormatCase("gpt_oss-mxfp4", _fp4("gpt_oss"), 32),
      # [N, K // 8] fragment order of the wgmma kernel: K in runs of 32, N in its tiles.
      FormatCase("mxfp4_nk", lambda r, k, n: qjax.to_mxfp4_nk(_fp4("mxfp4")(r, k, n)),
                 32, 128),
      FormatCase("nvfp4_nk", lambda r, k, n: qjax.to_nvfp4_nk(_fp4("nvfp4")(r, k, n)),
                 32, 128),
  ]
  return cases


# ------------------------------------------------------------------------------- shapes


def shapes_for(fmt: FormatCase, implementation: str, full: bool, offset: int = 0
               ) -> list[tuple[int, int, int]]:
  """The fitted (M, K, N) this format runs on an implementation, deduplicated, in order.

  The reduced XLA set takes every few of the small shapes starting at ``offset`` (the
  format's index), so that the formats together cover most of :data:`SHAPES`.
  """
  if implementation == "interpret":
    base: Iterable[tuple[int, int, int]] = INTERPRET_SHAPES
  elif full:
    base = SHAPES
  else:
    small = [s for s in SHAPES if math.prod(s) <= REDUCED_XLA_MAX_WORK]
    step = max(1, len(small) // REDUCED_XLA_SHAPES)
    picked = [small[(offset + i * step) % len(small)] for i in range(REDUCED_XLA_SHAPES)]
    base = picked + [(4096, 128, 64)]  # the largest M too
  out = []
  for m, k, n in base:
    shape = (m, *fmt.fit(k, n))
    if shape not in out:
      out.append(shape)
  return out


def implementations(full: bool) -> list[str]:
  """What runs here: xla and interpret everywhere, the compiled kernel on a GPU."""
  from pallas_kernels import triton_supported  # pylint: disable=g-import-not-at-top
  out = ["xla", "interpret"]
  if triton_supported(jax.devices()[0]):
    out.append("pallas")
  return out


# ---------------------------------------------------------------------------------- run


@dataclasses.dataclass
class CaseResult:
  format: str
  implementation: str
  m: int
  k: int
  n: int
  dtype: str
  rel_err: float | None = None
  status: str = "ok"          # ok | miss | skipped
  detail: str = ""


def _reference(x: jax.Array, w: Any) -> np.ndarray:
  wd = np.asarray(jax.device_get(w.dequantize()), np.float64)
  return np.asarray(jax.device_get(x.astype(jnp.float32)), np.float64) @ wd


_JITTED: dict[str, Callable] = {}


def _matmul(implementation: str) -> Callable:
  if implementation not in _JITTED:
    import qjax  # pylint: disable=g-import-not-at-top
    _JITTED[implementation] = jax.jit(
        lambda x, w: qjax.matmul(x, w, implementation=implementation))
  return _JITTED[implementation]


def run_case(fmt: FormatCase, impl: str, w: Any, m: int, dtype, rng,
             reference_cache: dict | None = None) -> CaseResult:
  from qjax._src import dispatch  # pylint: disable=g-import-not-at-top
  k, n = w.shape
  res = CaseResult(fmt.name, impl, m, k, n, jnp.dtype(dtype).name)
  if impl != "xla" and not dispatch.kernels_for(w):
    res.status, res.detail = "skipped", f"no kernel is registered for {type(w).__name__}"
    return res
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  try:
    y = np.asarray(jax.device_get(_matmul(impl)(x, w)), np.float64)
  except NotImplementedError as e:
    res.status, res.detail = "skipped", str(e)[:200]
    return res
  except Exception as e:  # pylint: disable=broad-except
    res.status, res.detail = "miss", f"{type(e).__name__}: {e}"[:300]
    return res
  key = (m, k, n, res.dtype)
  if reference_cache is not None and key in reference_cache:
    ref = reference_cache[key]
  else:
    ref = _reference(x, w)
    if reference_cache is not None:
      reference_cache[key] = ref
  if y.shape != ref.shape or not np.isfinite(y).all():
    res.status, res.detail = "miss", f"shape {y.shape} or non-finite outputs"
    return res
  res.rel_err = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
  if res.rel_err >= THRESHOLD:
    res.status = "miss"
  return res


def run(*, full: bool = False, formats: Iterable[str] | None = None,
        impls: Iterable[str] | None = None, seed: int = 0, shard: tuple[int, int] = (0, 1),
        progress: Callable[[str], None] | None = None,
        on_format: Callable[[list[CaseResult]], None] | None = None) -> list[CaseResult]:
  """Runs the sweep; returns one result per (format, implementation, shape).

  ``on_format`` receives the results so far after each format (``qjax check --json``
  rewrites its file then, so a run cut off by a time limit keeps what it measured).

  ``shard=(i, n)`` runs every n-th format from the i-th, so n processes can share the
  sweep (on a GPU the compiles dominate and run on the host's cores).
  """
  cases = format_cases()
  if formats is not None:
    wanted = set(formats)
    unknown = wanted - {c.name for c in cases}
    if unknown:
      raise ValueError(f"unknown formats {sorted(unknown)}; known: {[c.name for c in cases]}")
    cases = [c for c in cases if c.name in wanted]
  index_of = {c.name: i for i, c in enumerate(format_cases())}
  i, n = shard
  if not 0 <= i < n:
    raise ValueError(f"shard={shard} must be (i, n) with 0 <= i < n")
  cases = cases[i::n]
  impls = list(impls) if impls is not None else implementations(full)
  results = []
  for fmt in cases:
    index = index_of[fmt.name]  # the shapes a format gets do not depend on the filter
    t0 = time.perf_counter()
    weights: dict[tuple[int, int], Any] = {}
    references: dict[tuple, np.ndarray] = {}  # the same x (seeded by shape) on every impl
    for impl in impls:
      for i, (m, k, n) in enumerate(shapes_for(fmt, impl, full, offset=index)):
        rng = np.random.default_rng([seed, m, k, n])
        if (k, n) not in weights:
          weights[(k, n)] = fmt.build(np.random.default_rng([seed, k, n]), k, n)
        dtype = ACTIVATION_DTYPES[i % len(ACTIVATION_DTYPES)]
        results.append(run_case(fmt, impl, weights[(k, n)], m, dtype, rng, references))
    if progress is not None:
      progress(f"{fmt.name}: {time.perf_counter() - t0:.1f} s")
    if on_format is not None:
      on_format(results)
  return results


# ------------------------------------------------------------------------------- report


def summarize(results: list[CaseResult]) -> list[dict[str, Any]]:
  """One row per (format, implementation): cases, misses, skips, worst error and shape."""
  rows: dict[tuple[str, str], dict[str, Any]] = {}
  for r in results:
    row = rows.setdefault((r.format, r.implementation), {
        "format": r.format, "implementation": r.implementation, "cases": 0, "misses": 0,
        "skipped": 0, "worst_rel_err": None, "worst_case": ""})
    row["cases"] += 1
    row["misses"] += r.status == "miss"
    row["skipped"] += r.status == "skipped"
    if r.status == "miss" and r.rel_err is None:
      row["worst_case"] = f"M{r.m} K{r.k} N{r.n} {r.dtype}: {r.detail}"
      row["worst_rel_err"] = float("inf")
    elif r.rel_err is not None and (row["worst_rel_err"] is None
                                    or r.rel_err > row["worst_rel_err"]):
      row["worst_rel_err"] = r.rel_err
      row["worst_case"] = f"M{r.m} K{r.k} N{r.n} {r.dtype}"
  return list(rows.values())


def table(rows: list[dict[str, Any]]) -> str:
  lines = [f"{'format':30s} {'impl':10s} {'cases':>5s} {'miss':>4s} {'skip':>4s} "
           f"{'worst rel err':>13s}  worst case"]
  for r in rows:
    err = "-" if r["worst_rel_err"] is None else f"{r['worst_rel_err']:.2e}"
    lines.append(f"{r['format']:30s} {r['implementation']:10s} {r['cases']:5d} "
                 f"{r['misses']:4d} {r['skipped']:4d} {err:>13s}  {r['worst_case']}")
  return "\n".join(lines)


def main(args) -> int:
  """The ``qjax check`` command."""
  formats = args.formats.split(",") if args.formats else None
  impls = args.impl.split(",") if args.impl else None
  say = (lambda s: print(s, file=sys.stderr)) if not args.quiet else None
  shard = (0, 1)
  if args.shard:
    try:
      shard = tuple(int(v) for v in args.shard.split("/"))
    except ValueError:
      raise SystemExit(f"--shard={args.shard!r} must be I/N, e.g. 0/4") from None

  def write_json(results: list[CaseResult]) -> None:
    if not args.json:
      return
    tmp = f"{args.json}.tmp"
    with open(tmp, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "full": args.full,
                 "threshold": THRESHOLD, "summary": summarize(results),
                 "cases": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    os.replace(tmp, args.json)

  results = run(full=args.full, formats=formats, impls=impls, seed=args.seed, shard=shard,
                progress=say, on_format=write_json)
  if not results and shard[1] > 1:
    # Exit 0 still: CI splits the sweep into more shards than some selections have formats.
    print(f"qjax check: shard {shard[0]}/{shard[1]} holds none of the "
          f"{len(formats) if formats else len(format_cases())} formats selected; "
          "nothing was checked", file=sys.stderr)
  rows = summarize(results)
  misses = [r for r in results if r.status == "miss"]
  print(table(rows))
  distinct = {(r.m, r.k, r.n) for r in results}
  print(f"{len(results)} cases, {len(distinct)} distinct shapes, {len(misses)} misses "
        f"(threshold {THRESHOLD:g}); device {jax.devices()[0].device_kind}")
  for r in misses[:20]:
    print(f"MISS {r.format} {r.implementation} M{r.m} K{r.k} N{r.n} {r.dtype}: "
          f"{r.rel_err if r.rel_err is not None else r.detail}")
  write_json(results)
  return 1 if misses else 0
