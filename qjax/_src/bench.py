"""``qjax bench``: device time of qjax.matmul per implementation against bf16 ``jnp.dot``.

For each (M, K, N, format) the table gives the device time of every available
implementation, the bandwidth floor (bytes of packed weights + scales + activations +
output over the copy bandwidth measured on this device in the same run), the fraction of
the floor reached and the speedup over bf16. The ``read`` column is the device time of the
fastest pass XLA makes over the floor's bytes (:func:`measure_read_time`) and ``ceil%``
the floor over it: the share of the floor that reading the bytes reaches at this size,
so what a matmul kernel can reach at most (small sizes pay a fixed start and drain that
the 1 GiB copy of the bandwidth measurement hides). Codebook formats (``codebook``: one pass,
``codebook2``: two) also count the per-group rotation matrices that the activation
rotation reads (:func:`floor_weight_bytes`). ``--tune`` sweeps kernel configs and writes
the best per (format, M bucket, K, N) to the tuning table that the dispatcher reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import codebook_tables
from qjax._src import devtime
from qjax._src import dispatch
from qjax._src import kernel_layouts
from qjax._src import rotation as rotation_lib
from qjax._src import stacked
from qjax._src import tuning
from qjax._src.codebook import CodebookWeight
from qjax._src.fp4 import MXFP4Weight
from qjax._src.fp4 import NVFP4Weight
from qjax._src.fp4_nk import to_mxfp4_nk
from qjax._src.fp4_nk import to_nvfp4_nk
from qjax._src.int4_nk import to_int4_nk
from qjax._src.int4 import Int4Weight

GPU_M = (1, 16, 64, 256, 2048)
GPU_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))
CPU_M = (1, 16)
CPU_SHAPES = ((512, 512), (1024, 768))
BENCH_FORMATS = ("int4", "int4nk", "mxfp4", "mxfp4nk", "nvfp4", "nvfp4nk", "codebook",
                 "codebook2")
# The formats whose kernel has candidate configs for --tune (Backend.candidate_configs).
TUNABLE_FORMATS = ("int4", "int4nk", "mxfp4", "mxfp4nk", "nvfp4", "nvfp4nk")
L2_BYTES = 50 * 2**20  # H100; rotation targets several times this


@dataclasses.dataclass
class Row:
  m: int
  k: int
  n: int
  fmt: str
  times_us: dict[str, float]
  bf16_us: float
  floor_us: float
  floor_bytes: int
  source: str
  notes: str = ""
  # The implementation qjax.matmul runs with none named ("pallas" or "xla", as timed).
  default_impl: str = ""
  # Device time of XLA's fastest pass over floor_bytes (measure_read_time); nan if unmeasured.
  read_us: float = float("nan")
  # impl -> why its time is nan (times_us holds nan for it), as MoERow.nan_reasons.
  nan_reasons: dict[str, str] = dataclasses.field(default_factory=dict)

  def read_ceiling(self) -> float:
    """The floor over the pure read's time: the largest fraction of the floor that a
    kernel reading these bytes can expect to reach."""
    return _ratio(self.floor_us, self.read_us)

  def fraction_of_floor(self, impl: str) -> float:
    return _ratio(self.floor_us, self.times_us.get(impl))

  def speedup(self, impl: str) -> float:
    return _ratio(self.bf16_us, self.times_us.get(impl))


def _ratio(a: float, b: float | None) -> float:
  """``a / b``; nan where ``b`` is missing, nan or 0 (a column that was not measured, or
  a time below the clock's resolution), never a ZeroDivisionError that loses the run."""
  return a / b if b and not math.isnan(b) else float("nan")


def random_weight(fmt: str, k: int, n: int, key: jax.Array) -> Any:
  """A random weight of the format, built directly (no float matrix)."""
  if fmt == "int4":
    kc, ks = jax.random.split(key)
    group = 128
    codes = jax.random.bits(kc, (-(-k // 128) * 16, n), jnp.uint32)
    scales = (jax.random.uniform(ks, (k // group, n), jnp.float32, 0.5, 1.5) / 64).astype(
        jnp.bfloat16)
    return Int4Weight(codes=codes, scales=scales, zeros=None, shape=(k, n), group_size=group)
  if fmt == "int4nk":
    # The int4 weight of the same key in the [N, K // 8] layout of the Hopper wgmma kernel.
    return to_int4_nk(random_weight("int4", k, n, key))
  if fmt in ("mxfp4nk", "nvfp4nk"):
    # The FP4 weight of the same key in the [N, K // 8] layout of the wgmma kernel.
    to_nk = to_mxfp4_nk if fmt == "mxfp4nk" else to_nvfp4_nk
    return to_nk(random_weight(fmt[:-2], k, n, key))
  if fmt in ("mxfp4", "nvfp4"):
    kc, ks = jax.random.split(key)
    codes = jax.random.bits(kc, (-(-k // 128) * 16, n), jnp.uint32)
    if fmt == "mxfp4":
      # E8M0 exponents 2**-7 .. 2**-5: weights of about the size of a trained layer's.
      scales = jax.random.randint(ks, (k // 32, n), 120, 123).astype(jnp.uint8)
      return MXFP4Weight(codes=codes, scales=scales, shape=(k, n))
    scales = jax.random.uniform(ks, (k // 16, n), jnp.float32, 1.0, 448.0).astype(
        jnp.float8_e4m3fn)
    return NVFP4Weight(codes=codes, scales=scales, global_scale=jnp.float32(1 / 2688),
                       shape=(k, n))
  if fmt in ("codebook", "codebook2"):
    # Group 128, Hadamard rotation of seed 0 (every rotated copy shares it, so one compile),
    # Lloyd levels; norms put the weights at about 1/64, pass 2 at a tenth of that.
    group = 128
    keys = jax.random.split(key, 4)
    codes = [jax.random.bits(kc, (-(-k // 128) * 16, n), jnp.uint32) for kc in keys[:2]]
    norms = [(jax.random.uniform(kn, (k // group, n), jnp.float32, 0.5, 1.5) * scale
              * math.sqrt(group) / 64).astype(jnp.bfloat16)
             for kn, scale in zip(keys[2:], (1.0, 0.1))]
    table = jnp.asarray(codebook_tables.table("lloyd"))
    second = dict(codes2=codes[1], norms2=norms[1], codebook2=table) if fmt == "codebook2" \
        else {}
    return CodebookWeight(codes=codes[0], norms=norms[0], codebook=table, **second,
                          shape=(k, n), group_size=group, rotation="hadamard", seed=0)
  raise ValueError(f"unknown bench format {fmt!r}; known: {', '.join(BENCH_FORMATS)}")


def floor_weight_bytes(w: Any) -> int:
  """Bytes of the weight that a matmul must read: its arrays (``w.nbytes``, the sum over
  ``jax.tree.leaves(w)``) and, for a :class:`CodebookWeight`, the ``[K // d, d, d]``
  float32 rotation matrices of each pass, which ``rotate_activations`` reads (they are
  rebuilt from the seed, not stored).

  The arrays count as stored, padding included: the ``[K, N]`` layouts (int4, mxfp4,
  nvfp4, codebook) pack K in tiles of 128 rows, ``K // 8`` words padded to a multiple of
  16 per column, and every word of the last tile holds real rows (nibble ``j`` of word
  ``r`` is row ``16 j + r``, :mod:`qjax._src.packing`), so the padding is read too. The
  ``[N, K // 8]`` layouts hold no padding.
  """
  nbytes = w.nbytes
  if isinstance(w, CodebookWeight):
    k = w.shape[0]
    for seed in range(w.seed, w.seed + w.passes):
      nbytes += rotation_lib.matrices(w.rotation, w.group_size, k // w.group_size,
                                      seed).nbytes
  return nbytes


def measure_copy_bandwidth(nbytes: int = 2**30) -> float:
  """Bytes per second of an elementwise pass (bytes read plus written) on this device."""
  a = jnp.ones((nbytes // 4,), jnp.float32)
  b = jnp.ones((nbytes // 4,), jnp.float32) * 2
  f = jax.jit(lambda v: v * 1.0001 + 1.0)
  t = devtime.device_time(f, [(a,), (b,)], calls=10, warmup=2)
  return 2 * nbytes / (t.us * 1e-6)


_READ_US: dict[tuple[str, int], float] = {}


def measure_read_time(nbytes: int, *, calls: int = 20) -> float:
  """Microseconds of device time of the fastest pass XLA makes over ``nbytes`` of
  device memory: an elementwise pass reading ``nbytes / 2`` and writing as much, or a
  row sum that reads ``nbytes`` of uint32 into ``nbytes / 1024`` sums.

  At the byte count of a matmul's floor, this is about the least device time any kernel
  moving those bytes takes: on the H100 a TMA pipeline that only reads them
  (examples/read_ceiling.py) was 1-4 % faster, a Triton loop of loads slower. Inputs
  rotate as the matmul's weights do, so they are not served from L2. Cached per device
  and size.
  """
  key = (jax.devices()[0].device_kind, int(nbytes))
  if key in _READ_US:
    return _READ_US[key]
  rows = max(1, nbytes // 1024)
  sets = _rotation(nbytes)
  keys = jax.random.split(jax.random.key(7), sets)
  halves = [(jax.random.normal(k, (rows * 128,), jnp.float32),) for k in keys]
  words = [(jax.random.bits(k, (rows, 256), jnp.uint32),) for k in keys]
  elementwise = devtime.device_time(jax.jit(lambda v: v * 1.0001 + 1.0), halves,
                                    calls=calls)
  row_sum = devtime.device_time(jax.jit(lambda a: jnp.sum(a, axis=1)), words, calls=calls)
  _READ_US[key] = min(elementwise.us, row_sum.us)
  return _READ_US[key]


def _rotation(bytes_per_set: int) -> int:
  return int(min(32, max(2, math.ceil(4 * L2_BYTES / max(bytes_per_set, 1)))))


def _timed_impls(on_gpu: bool) -> list[str]:
  return ["pallas", "xla"] if on_gpu else ["xla", "interpret"]


def bench_shape(m: int, k: int, n: int, fmt: str, *, bandwidth: float, impls: Sequence[str],
                calls: int, seed: int = 0) -> Row:
  key = jax.random.key(seed)
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w0 = random_weight(fmt, k, n, kw)
  reps = _rotation(w0.nbytes)
  ws = [w0] + [random_weight(fmt, k, n, jax.random.fold_in(kw, i)) for i in range(1, reps)]
  times, notes, nan_reasons = {}, [], {}
  for impl in impls:
    f = jax.jit(lambda x_, w_, impl=impl: dispatch.matmul(x_, w_, implementation=impl))
    try:
      t = devtime.device_time(f, [(x, w) for w in ws], calls=calls)
    except NotImplementedError as e:  # e.g. a kernel without interpret mode: nan in the table
      notes.append(f"{impl}: {e}")
      times[impl], nan_reasons[impl] = float("nan"), " ".join(str(e).split())
      continue
    times[impl] = t.us
  del ws
  wb = (jax.random.normal(kw, (k, n), jnp.float32) / 64).astype(jnp.bfloat16)
  reps_b = _rotation(k * n * 2)
  wbs = [wb] + [wb * (1 + i / 1024) for i in range(1, reps_b)]
  # The program a bf16 user runs: the dot writes bf16 itself (accumulating in float32).
  fb = jax.jit(lambda x_, w_: jnp.dot(x_, w_))
  bf16_t = devtime.device_time(fb, [(x, w) for w in wbs], calls=calls)
  bf16, source = bf16_t.us, bf16_t.source  # every timing of the run has the same source
  floor_bytes = floor_weight_bytes(w0) + x.nbytes + m * n * 2
  default = "xla" if dispatch.implementation_name(w0, m=m) == "xla" else "pallas"
  return Row(m=m, k=k, n=n, fmt=fmt, times_us=times, bf16_us=bf16,
             floor_us=floor_bytes / bandwidth * 1e6, floor_bytes=floor_bytes, source=source,
             notes="; ".join(notes), default_impl=default,
             read_us=measure_read_time(floor_bytes, calls=calls), nan_reasons=nan_reasons)


def format_table(rows: Sequence[Row], impls: Sequence[str]) -> str:
  fw = max([5] + [len(r.fmt) for r in rows])  # "codebook2" is wider than "int4"
  head = f"{'fmt':>{fw}} {'M':>5} {'K':>6} {'N':>6} |" + "".join(f" {i:>10}" for i in impls)
  head += f" {'bf16':>9} {'floor':>8} {'read':>8} {'ceil%':>6} |"
  head += "".join(f" {i[:6] + '%fl':>9}" for i in impls)
  head += "".join(f" {i[:6] + ' xbf':>10}" for i in impls)
  head += f" {'default':>8}"
  lines = [head, "-" * len(head)]
  for r in rows:
    s = f"{r.fmt:>{fw}} {r.m:>5} {r.k:>6} {r.n:>6} |"
    s += "".join(f" {r.times_us.get(i, float('nan')):>10.1f}" for i in impls)
    s += f" {r.bf16_us:>9.1f} {r.floor_us:>8.1f} {r.read_us:>8.1f}"
    s += f" {100 * r.read_ceiling():>5.0f}% |"
    s += "".join(f" {100 * r.fraction_of_floor(i):>8.0f}%" for i in impls)
    s += "".join(f" {r.speedup(i):>9.2f}x" for i in impls)
    s += f" {r.default_impl or '-':>8}"
    lines.append(s)
  return "\n".join(lines)


def nan_notes(rows: Sequence[Row], impls: Sequence[str]) -> list[str]:
  """Why cells of the table are nan, once per (implementation, reason): "nan: <impl>
  <formats>: <reason>", from the rows' ``nan_reasons`` (of ``impls``, in their order)."""
  fmts: dict[tuple[str, str], list[str]] = {}
  for r in rows:
    for impl in impls:
      if impl in r.nan_reasons:
        seen = fmts.setdefault((impl, r.nan_reasons[impl]), [])
        if r.fmt not in seen:
          seen.append(r.fmt)
  # The reasons are the API's errors; the command line names the option instead.
  cli = lambda reason: re.sub(r"implementation='(\w+)'", r"--impl \1", reason)
  return [f"nan: {impl} {','.join(f)}: {cli(reason)}" for (impl, reason), f in fmts.items()]


def plot(rows: Sequence[Row], impls: Sequence[str], path: str, title: str) -> Any:
  """% of the floor against M: one panel per (format, shape), a row of panels per format
  (each format has its own floor). Returns the matplotlib figure, saved to ``path``."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fmts = list(dict.fromkeys(r.fmt for r in rows))
  shapes = sorted({(r.k, r.n) for r in rows})
  fig, axes = plt.subplots(len(fmts), len(shapes),
                           figsize=(4.2 * len(shapes), 3.8 * len(fmts)), squeeze=False)
  for axes_row, fmt in zip(axes, fmts):
    for ax, (k, n) in zip(axes_row, shapes):
      rs = sorted([r for r in rows if (r.fmt, r.k, r.n) == (fmt, k, n)], key=lambda r: r.m)
      ms = [r.m for r in rs]
      for impl in impls:
        ax.plot(ms, [100 * r.fraction_of_floor(impl) for r in rs], marker="o", label=impl)
      ax.plot(ms, [100 * _ratio(r.floor_us, r.bf16_us) for r in rs], marker="s", ls="--",
              label="bf16 jnp.dot")
      ax.plot(ms, [100 * r.read_ceiling() for r in rs], color="black", lw=0.8, ls="--",
              label="reading the bytes (XLA)")
      ax.axhline(85, color="grey", lw=0.8, ls=":")
      ax.set_xscale("log", base=2)
      ax.set_xlabel("M (tokens)")
      ax.set_title(f"{fmt} K={k} N={n}")
      ax.set_ylim(0, 110)
    axes_row[0].set_ylabel("% of bandwidth floor (higher is better)")
  axes[0][-1].legend(loc="upper right", fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return fig


def tune(shapes: Sequence[tuple[int, int]], ms: Sequence[int], fmt: str, *, calls: int,
         missing_only: bool = False, log: Callable[[str], None] = print
         ) -> list[dict[str, Any]]:
  """Sweeps the kernel's candidate configs for each shape and M; returns the
  tuning-table entries (each also merged into this device's table as it is measured).
  ``missing_only``: skips the (format, M bucket, K, N) the table already holds."""
  key = jax.random.key(1)
  device_kind = jax.devices()[0].device_kind
  entries = []
  for k, n in shapes:
    ws = None
    for m in ms:
      if missing_only and tuning.lookup(device_kind, fmt, m, k, n) is not None:
        log(f"kept {fmt} M={m} K={k} N={n}: in the table (--tune-missing)")
        continue
      w0 = random_weight(fmt, k, n, key)
      if ws is None:
        ws = [w0] + [random_weight(fmt, k, n, jax.random.fold_in(key, i))
                     for i in range(1, _rotation(w0.nbytes))]
      backend = dispatch.kernels_for(w0)[0]
      if backend.candidate_configs is None:
        raise ValueError(f"--tune: the {backend.name} kernel for --format {fmt} has no "
                         "candidate configs to sweep (its heuristic is used as is); tune "
                         f"{', '.join(TUNABLE_FORMATS[:-1])} or {TUNABLE_FORMATS[-1]}")
      x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
      timed = []
      candidates = backend.candidate_configs(m, k, n)
      log(f"tuning {fmt} M={m} K={k} N={n}: {len(candidates)} configs (each compiled "
          "and timed)...")
      start = time.perf_counter()
      for cfg in candidates:
        f = jax.jit(lambda x_, w_, cfg=cfg: backend.fn(x_, w_, interpret=False, config=cfg))
        try:
          t = devtime.device_time(f, [(x, w) for w in ws], calls=max(5, calls // 2)).us
        except Exception as e:  # pylint: disable=broad-except
          log(f"  skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
          continue
        timed.append((t, cfg))
      best = _fastest_correct(sorted(timed, key=lambda tc: tc[0]), backend, x, w0, log)
      if best:
        log(f"tuned {fmt} M={m} K={k} N={n}: {best[0]:.1f} us {best[1]} (swept in "
            f"{time.perf_counter() - start:.0f} s)")
        entry = {"format": fmt, "m_bucket": tuning.m_bucket(m), "k": k, "n": n,
                 "config": best[1].to_json(), "us": round(best[0], 2)}
        entries.append(entry)
        # Written as it goes, so a run cut off by a time limit keeps what it measured.
        tuning.write_table(device_kind, [entry])
    del ws
  return entries


# The tuner's check of a winner against the XLA path: relative error of the outputs (bf16
# rounding of the weight and of y leaves ~3e-3).
_TUNE_MAX_REL_ERR = 1e-2


def _fastest_correct(timed: Sequence[tuple[float, Any]], backend: dispatch.Backend,
                     x: jax.Array, w: Any, log: Callable[[str], None]
                     ) -> tuple[float, Any] | None:
  """The first ``(us, config)`` of ``timed`` (fastest first) whose output on ``x @ w``
  matches the XLA path's (relative error below :data:`_TUNE_MAX_REL_ERR`), so that no
  config that computes something else enters the table; each one passed over is logged."""
  ref = np.asarray(dispatch.matmul(x, w, implementation="xla").astype(jnp.float32),
                   np.float64)
  interpret = jax.devices()[0].platform == "cpu"
  for t, cfg in timed:
    y = np.asarray(backend.fn(x, w, interpret=interpret, config=cfg).astype(jnp.float32),
                   np.float64)
    err = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
    if err < _TUNE_MAX_REL_ERR:
      return t, cfg
    log(f"  passed over {cfg} ({t:.1f} us): relative error {err:.2e} against the XLA "
        "path")
  return None


# Blocks of timed calls per stack: tokens/s is their median. One block's rate of the
# Hopper layout's stack varied 252-501 tokens/s between blocks of 50 calls in one process
# (H200, BENCHMARKS.md session 47: its 224 Mosaic GPU launches a token are issued by the
# host one by one, outside XLA's command buffers), the Triton stack's by 1 %.
STACK_REPEATS = 5


def wall_rates(fn: Callable[..., Any], h0: Any, ws: Any, *, calls: int,
               repeats: int = STACK_REPEATS) -> list[float]:
  """Calls per second of ``h = fn(h, ws)`` from ``h0``, one rate per block of ``calls``
  chained calls (each block timed from its first dispatch to its last result), after
  one untimed call that compiles."""
  if calls < 1 or repeats < 1:
    raise ValueError(f"calls={calls} and repeats={repeats} must be positive")
  jax.block_until_ready(fn(h0, ws))
  rates = []
  for _ in range(repeats):
    h = h0
    t0 = time.perf_counter()
    for _ in range(calls):
      h = fn(h, ws)
    jax.block_until_ready(h)
    rates.append(calls / (time.perf_counter() - t0))
  return rates


def llama_stack_tokens_per_s(*, layers: int, hidden: int, inter: int, kv: int, calls: int,
                             fused: bool = False, scanned: bool = False,
                             layouts: bool = False, repeats: int = STACK_REPEATS
                             ) -> dict[str, Any]:
  """Decode at batch 1 through a Llama-shaped stack of linear layers under one jit.

  Each layer: q, k, v, o projections and the SwiGLU MLP (gate, up, down), with a
  residual; attention itself is left out (it is not a weight matmul). ``fused``: q, k and
  v as one ``[hidden, hidden + 2 kv]`` matrix and gate and up as one ``[hidden, 2 inter]``,
  as serving engines store them (the same in both stacks). ``scanned``: each weight
  stacked over the layers and the layers run by ``lax.scan``, the int4 weights passed as
  ``qjax.layer_of(stack, i)`` and the bf16 ones sliced (else an unrolled loop over
  per-layer arrays). ``layouts``: the int4 weights converted by
  :func:`qjax.kernel_layouts` for this device (on Hopper, Int4NKWeight). Returns tokens/s
  of the int4 stack (auto implementation) and of the same stack in bf16 (``*_tokens_per_s``:
  the median of ``repeats`` blocks of ``calls`` jitted steps by wall time,
  :func:`wall_rates`; ``*_tokens_per_s_runs``: each block's), and the device time per step.
  """
  if fused:
    shapes = [(hidden, hidden + 2 * kv), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]
  else:
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]
  key = jax.random.key(2)
  qws, bws = [], []
  for layer in range(layers):
    lk = jax.random.fold_in(key, layer)
    qws.append([random_weight("int4", k, n, jax.random.fold_in(lk, i))
                for i, (k, n) in enumerate(shapes)])
  if layouts:
    qws = kernel_layouts.kernel_layouts(qws)
  for layer in range(layers):
    lk = jax.random.fold_in(key, 1000 + layer)
    bws.append([(jax.random.normal(jax.random.fold_in(lk, i), (k, n), jnp.float32) / 64
                 ).astype(jnp.bfloat16) for i, (k, n) in enumerate(shapes)])

  def projections(h, w, mm):
    """q, k, v, o's weight, ``gate_up(a) -> (gate, up)`` and down's weight of a layer."""
    if fused:
      wqkv, wo, wgu, wd = w
      q, k_, v = jnp.split(mm(h, wqkv), [hidden, hidden + kv], axis=-1)
      return q, k_, v, wo, lambda a: jnp.split(mm(a, wgu), 2, axis=-1), wd
    wq, wk, wv, wo, wg, wu, wd = w
    return mm(h, wq), mm(h, wk), mm(h, wv), wo, lambda a: (mm(a, wg), mm(a, wu)), wd

  def step(h, weights, mm):
    for w in weights:
      q, k_, v, wo, gate_up, wd = projections(h, w, mm)
      attn = q + jnp.tile(k_ + v, hidden // kv)  # stands in for attention
      h = h + mm(attn, wo)
      gate, up = gate_up(h)
      h = h + mm(jax.nn.silu(gate) * up, wd)
    return h

  int4_gb = sum(w.nbytes for ws in qws for w in ws) / 1e9
  bf16_gb = sum(w.nbytes for ws in bws for w in ws) / 1e9
  if not scanned:
    int4_step = jax.jit(lambda h, w: step(h, w, dispatch.matmul))
    bf16_step = jax.jit(lambda h, w: step(h, w, jnp.dot))
  else:
    def scan_step(h, stacks, mm, layer):
      body = lambda h, i: (step(h, [[layer(s, i) for s in stacks]], mm), None)
      return jax.lax.scan(body, h, jnp.arange(layers))[0]

    def stack(weights):
      return [jax.tree.map(lambda *a: jnp.stack(a), *[ws[j] for ws in weights])
              for j in range(len(shapes))]

    qws, bws = stack(qws), stack(bws)
    int4_step = jax.jit(lambda h, w: scan_step(h, w, dispatch.matmul, stacked.layer_of))
    bf16_step = jax.jit(lambda h, w: scan_step(h, w, jnp.dot, lambda s, i: s[i]))
  h0 = jax.random.normal(key, (1, hidden), jnp.float32).astype(jnp.bfloat16) * 0.01
  out = {}
  for name, fn, ws in (("int4", int4_step, qws), ("bf16", bf16_step, bws)):
    rates = wall_rates(fn, h0, ws, calls=calls, repeats=repeats)
    out[f"{name}_tokens_per_s"] = float(np.median(rates))
    out[f"{name}_tokens_per_s_runs"] = rates
    out[f"{name}_device_ms"] = devtime.device_time(fn, [(h0, ws)], calls=5, warmup=1).us / 1e3
  out["speedup"] = out["int4_tokens_per_s"] / out["bf16_tokens_per_s"]
  out["int4_weight_gb"], out["bf16_weight_gb"] = int4_gb, bf16_gb
  return out


# XLA runs a jitted step's kernels as a command buffer (a CUDA graph). By default each
# kernel waits for the one before it; in this scheduling mode a kernel waits only for the
# kernels whose outputs it reads. At batch 1 the q, k and v GEMVs (and gate and up) each
# take a few microseconds and leave most of the H100 idle while their loads are in flight:
# run together, they overlap. XLA reads the flag once, when its backend starts.
_SCHEDULE_OPTION = "--xla_gpu_command_buffer_scheduling_mode"
CONCURRENT_FLAG = _SCHEDULE_OPTION + "=CONCURRENT"
STACK_SCHEDULES = ("in order", "concurrent")
_STACK_MARK = "QJAX_STACK_RESULT "


def scheduling(xla_flags: str | None = None) -> str:
  """"concurrent" when ``xla_flags`` (default: this process's ``XLA_FLAGS``) ask for
  :data:`CONCURRENT_FLAG`'s scheduling, else "in order"."""
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  asked = [f for f in flags.split() if f.startswith(_SCHEDULE_OPTION + "=")]
  return "concurrent" if asked and asked[-1] == CONCURRENT_FLAG else "in order"


def stack_in_subprocess(size: dict[str, Any], *, fused: bool, schedule: str,
                        timeout_s: float = 900) -> dict[str, float]:
  """:func:`llama_stack_tokens_per_s` in a fresh Python process whose ``XLA_FLAGS`` ask
  for ``schedule`` ("in order" or "concurrent"; :data:`STACK_SCHEDULES`).

  Both stacks (int4 and bf16) run under the same flags. Raises RuntimeError with the
  child's error output when it fails.
  """
  if schedule not in STACK_SCHEDULES:
    raise ValueError(f"schedule {schedule!r} must be one of {STACK_SCHEDULES}")
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith(_SCHEDULE_OPTION + "="))
  if schedule == "concurrent":
    flags = f"{flags} {CONCURRENT_FLAG}".strip()
  env = dict(os.environ, XLA_FLAGS=flags)
  code = ("import json, sys\n"
          "from qjax._src import bench\n"
          "r = bench.llama_stack_tokens_per_s(**json.loads(sys.argv[1]))\n"
          f"print({_STACK_MARK!r} + json.dumps(r), flush=True)\n")
  proc = subprocess.run([sys.executable, "-c", code, json.dumps(dict(size, fused=fused))],
                        env=env, capture_output=True, text=True, timeout=timeout_s,
                        check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(_STACK_MARK)]
  if proc.returncode or not lines:
    raise RuntimeError(f"the {schedule} stack run failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")
  return json.loads(lines[-1][len(_STACK_MARK):])


def best_of_schedules(runs: dict[str, dict[str, float]]) -> dict[str, Any]:
  """The fastest schedule of each stack, and int4's best tokens/s over bf16's best.

  ``runs``: schedule name -> :func:`llama_stack_tokens_per_s` result.
  """
  int4 = max(runs, key=lambda s: runs[s]["int4_tokens_per_s"])
  bf16 = max(runs, key=lambda s: runs[s]["bf16_tokens_per_s"])
  return {"int4_schedule": int4, "int4_tokens_per_s": runs[int4]["int4_tokens_per_s"],
          "bf16_schedule": bf16, "bf16_tokens_per_s": runs[bf16]["bf16_tokens_per_s"],
          "speedup": runs[int4]["int4_tokens_per_s"] / runs[bf16]["bf16_tokens_per_s"]}


def run_model(on_gpu: bool, result: dict[str, Any]) -> None:
  """``--model``: both stacks (separate and fused projections), each under both
  schedules on a GPU (the other schedule in a subprocess), into ``result``."""
  size = (dict(layers=32, hidden=4096, inter=14336, kv=1024, calls=50) if on_gpu else
          dict(layers=2, hidden=512, inter=1024, kv=128, calls=3))
  here = scheduling()
  print("\nLlama-3-8B-shaped linear stack, batch-1 decode under one jit"
        f"{' (CPU: 2 small layers, labels only)' if not on_gpu else ''}. tok/s: the median "
        f"of {STACK_REPEATS} blocks of {size['calls']} steps by wall time; device ms = "
        "summed kernel time per step (overlapping kernels each count whole). 'concurrent': "
        f"XLA_FLAGS={CONCURRENT_FLAG} (GPU only).")
  for fused in (False, True):
    label = "fused qkv, gate+up" if fused else "separate q,k,v,gate,up"
    name = "llama_stack_fused" if fused else "llama_stack"
    runs = {here: llama_stack_tokens_per_s(**size, fused=fused)}
    if on_gpu:
      other = STACK_SCHEDULES[1 - STACK_SCHEDULES.index(here)]
      runs[other] = stack_in_subprocess(size, fused=fused, schedule=other)
    for schedule in STACK_SCHEDULES:
      if schedule not in runs:
        continue
      stack = runs[schedule]
      print(f"  {label:<23} {schedule:<10} int4 {stack['int4_tokens_per_s']:.1f} tok/s "
            f"({stack['int4_device_ms']:.2f} ms device/step, {stack['int4_weight_gb']:.2f} GB)"
            f"   bf16 {stack['bf16_tokens_per_s']:.1f} tok/s ({stack['bf16_device_ms']:.2f} ms, "
            f"{stack['bf16_weight_gb']:.2f} GB)   speedup {stack['speedup']:.2f}x", flush=True)
    result[name] = runs["in order"] if "in order" in runs else runs[here]
    result[name + "_by_schedule"] = runs
    best = best_of_schedules(runs)
    result[name + "_best"] = best
    print(f"  {label:<23} best of each: int4 {best['int4_tokens_per_s']:.1f} tok/s "
          f"({best['int4_schedule']}) / bf16 {best['bf16_tokens_per_s']:.1f} tok/s "
          f"({best['bf16_schedule']}) = {best['speedup']:.2f}x", flush=True)
  # The separate stack once more with its layers in a lax.scan (this schedule only). The
  # bf16 weights are slices there, which XLA copies out of the stack before each GEMM.
  stack = llama_stack_tokens_per_s(**size, scanned=True)
  result["llama_stack_scanned"] = stack
  unrolled = result["llama_stack_by_schedule"][here]["int4_tokens_per_s"]
  print(f"  {'separate, lax.scan':<23} {here:<10} int4 {stack['int4_tokens_per_s']:.1f} tok/s "
        f"({stack['int4_device_ms']:.2f} ms device/step; qjax.layer_of) = "
        f"{stack['int4_tokens_per_s'] / unrolled:.2f}x the unrolled int4 stack   bf16 sliced "
        f"(copied per layer) {stack['bf16_tokens_per_s']:.1f} tok/s "
        f"({stack['bf16_device_ms']:.2f} ms)", flush=True)
  # Both stacks, unrolled, with their weights in qjax.kernel_layouts' layouts (on Hopper
  # the Int4NKWeight kernel at one row instead of Int4Weight's GEMV).
  for fused in (False, True):
    name = "llama_stack_fused_kernel_layouts" if fused else "llama_stack_kernel_layouts"
    label = "fused, kernel_layouts" if fused else "separate, kernel_layouts"
    by_schedule = result[("llama_stack_fused" if fused else "llama_stack") + "_by_schedule"]
    plain = by_schedule[here]["int4_tokens_per_s"]
    stack = llama_stack_tokens_per_s(**size, fused=fused, layouts=True)
    result[name] = stack
    print(f"  {label:<23} {here:<10} int4 {stack['int4_tokens_per_s']:.1f} tok/s "
          f"({stack['int4_device_ms']:.2f} ms device/step) = "
          f"{stack['int4_tokens_per_s'] / plain:.2f}x the same int4 stack as loaded; "
          f"{stack['speedup']:.2f}x bf16 in the same run", flush=True)


# ---------------------------------------------------------------------------- --moe

GPU_MOE = dict(experts=128, k=2880, n=2880, top_k=4, tokens=(1, 4, 16, 64))
# INT4 experts (group 128, which GPT-OSS's K = 2880 is not a multiple of): Qwen3-30B-A3B's.
GPU_MOE_INT4 = dict(GPU_MOE, k=2048, n=768, top_k=8)


def moe_defaults(fmt: str, on_gpu: bool) -> dict:
  """The experts, shape, top-k and token counts ``--moe`` times by default in ``fmt``."""
  return dict((GPU_MOE_INT4 if fmt == "int4" else GPU_MOE) if on_gpu else CPU_MOE)

CPU_MOE = dict(experts=8, k=256, n=256, top_k=2, tokens=(1, 8))
# The expert formats of --moe (--format): MXFP4 (the default), or symmetric INT4 of group
# 128 (random_weight's "int4"; the wgmma column converts them to Int4NKWeight).
MOE_BENCH_FORMATS = ("mxfp4", "int4")
MOE_IMPLS = ("default", "grouped", "gemv", "wgmma", "xla", "dequant_all")
# The MoE kernels, by their registered names: two for MXFP4Weight (and for Int4Weight), and
# Hopper's wgmma kernel for the same experts converted to MXFP4NKWeight (Int4NKWeight).
MOE_GROUPED_BACKEND = "pallas_triton"
MOE_GEMV_BACKEND = "pallas_triton_gemv"
MOE_WGMMA_BACKEND = "mosaic_gpu_wgmma"


@dataclasses.dataclass
class MoERow:
  """One token count of ``qjax bench --moe``: device time per implementation and the
  floor of the bytes of the selected experts only."""
  tokens: int
  experts: int
  k: int
  n: int
  top_k: int
  times_us: dict[str, float]
  floor_us: float
  floor_bytes: float  # averaged over the rotated routings
  selected_experts: float  # distinct experts per call, averaged
  source: str
  nan_reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # impl -> why NaN
  format: str = "mxfp4"  # the experts' (MOE_BENCH_FORMATS)

  def over_floor(self, impl: str) -> float:
    t = self.times_us.get(impl)
    return _ratio(t, self.floor_us) if t else float("nan")


def random_experts(experts: int, k: int, n: int, key: jax.Array, fmt: str = "mxfp4") -> Any:
  """A stack of ``experts`` random experts of ``[k, n]`` in ``fmt`` (MXFP4, or INT4 of
  group 128: codes ``[E, Kp // 8, N]`` uint32), each expert's codes drawn apart, the
  scales shared."""
  if fmt not in MOE_BENCH_FORMATS:
    raise ValueError(f"{fmt=}: --moe times experts of {', '.join(MOE_BENCH_FORMATS)}")
  w0 = random_weight(fmt, k, n, key)
  w = jax.tree.map(lambda a: jnp.broadcast_to(a, (experts, *a.shape)) + 0, w0)
  return dataclasses.replace(w, codes=w.codes ^ jax.random.bits(key, w.codes.shape,
                                                                 jnp.uint32))


def _distinct_ids(key: jax.Array, tokens: int, experts: int, top_k: int) -> jax.Array:
  """``[T, top_k]`` int32, distinct experts per token (as a router's top-k gives)."""
  scores = jax.random.uniform(key, (tokens, experts))
  return jax.lax.top_k(scores, top_k)[1].astype(jnp.int32)


def bench_moe(tokens: int, *, experts: int, k: int, n: int, top_k: int, bandwidth: float,
              on_gpu: bool, calls: int, seed: int = 0, fmt: str = "mxfp4") -> MoERow:
  """Times ``y[t, j] = x[t] @ W[ids[t, j]]`` over ``experts`` experts of ``[k, n]`` in
  ``fmt`` (:data:`MOE_BENCH_FORMATS`: MXFP4, or symmetric INT4 of group 128, whose
  grouped and GEMV kernels go by the same names).

  * default: ``qjax.moe_matmul`` with the kernel it picks for this call (the GEMV kernel
    up to its pair limit, else the grouped one; interpret mode on a CPU).
  * grouped: the grouped-GEMM kernel (``implementation="pallas:pallas_triton"``), routing
    and gathers included.
  * gemv: the per-pair GEMV kernel (``implementation="pallas:pallas_triton_gemv"``).
  * wgmma: the same experts converted to :class:`qjax.MXFP4NKWeight` (INT4:
    :class:`qjax.Int4NKWeight`; once, outside the timing) through Hopper's grouped wgmma
    kernel (``"pallas:mosaic_gpu_wgmma"``); NaN where it does not run (not a Hopper GPU,
    or N below 128; any kernel that declines the shape is NaN, its reason printed to
    stderr).
  * xla: its XLA reference (gathered experts, or every expert and ragged_dot).
  * dequant_all: every expert dequantized to bf16 first (materialized: an optimization
    barrier stops XLA from dequantizing only the gathered ones), then the selected ones'
    dense matmuls.

  The floor counts the packed codes and scales of the distinct selected experts, x and
  the output, over the copy bandwidth. Routings rotate (a new random one per call) so
  that one call's experts are mostly not in L2 from the last.
  """
  key = jax.random.key(seed)
  kx, kw, ki = jax.random.split(key, 3)
  x = jax.random.normal(kx, (tokens, k), jnp.float32).astype(jnp.bfloat16)
  w = random_experts(experts, k, n, kw, fmt)
  per_expert = w.nbytes // experts
  reps = _rotation(per_expert * tokens * top_k)
  id_sets = [_distinct_ids(jax.random.fold_in(ki, i), tokens, experts, top_k)
             for i in range(reps)]
  distinct = sum(len(set(map(int, ids.reshape(-1)))) for ids in id_sets) / reps
  mode = "pallas" if on_gpu else "interpret"
  w_nk = None
  if on_gpu and _wgmma_moe_runs():
    from qjax._src import fp4_nk, int4_nk  # pylint: disable=g-import-not-at-top
    w_nk = jax.jit(fp4_nk.to_mxfp4_nk if fmt == "mxfp4" else int4_nk.to_int4_nk)(w)
  fns = {
      "default": lambda x_, w_, i_: dispatch_moe(x_, w_, i_, mode),
      "grouped": lambda x_, w_, i_: dispatch_moe(x_, w_, i_, f"{mode}:{MOE_GROUPED_BACKEND}"),
      "gemv": lambda x_, w_, i_: dispatch_moe(x_, w_, i_, f"{mode}:{MOE_GEMV_BACKEND}"),
      "wgmma": lambda x_, w_, i_: dispatch_moe(x_, w_, i_, f"pallas:{MOE_WGMMA_BACKEND}"),
      "xla": lambda x_, w_, i_: dispatch_moe(x_, w_, i_, "xla"),
      # The barrier keeps XLA from fusing the gather into the dequantization (which would
      # dequantize only the selected experts): this is the "dequantize every expert, then
      # multiply" program the MoE kernels replace.
      "dequant_all": lambda x_, w_, i_: jnp.einsum(
          "tk,tjkn->tjn", x_, jax.lax.optimization_barrier(w_.dequantize(x_.dtype))[i_]),
  }
  times, source, nan_reasons = {}, "trace", {}
  for name, fn in fns.items():
    weight = w_nk if name == "wgmma" else w
    if weight is None:
      times[name] = float("nan")
      nan_reasons[name] = (f"Hopper's wgmma MoE kernel does not run on "
                           f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform})")
      continue
    try:
      t = devtime.device_time(jax.jit(fn), [(x, weight, ids) for ids in id_sets],
                              calls=calls)
    except NotImplementedError as e:  # a kernel that declines this shape (wgmma: N < 128)
      print(f"# --moe: {name} not timed: {e}", file=sys.stderr)
      times[name] = float("nan")
      nan_reasons[name] = str(e)
      continue
    times[name], source = t.us, t.source
  floor_bytes = distinct * per_expert + x.nbytes + tokens * top_k * n * 2
  return MoERow(tokens=tokens, experts=experts, k=k, n=n, top_k=top_k, times_us=times,
                floor_us=floor_bytes / bandwidth * 1e6, floor_bytes=floor_bytes,
                selected_experts=distinct, source=source, nan_reasons=nan_reasons, format=fmt)


def _wgmma_moe_runs() -> bool:
  """Whether Hopper's wgmma MoE kernel (registered for MXFP4NKWeight) runs here."""
  from qjax._src import fp4_nk, moe  # pylint: disable=g-import-not-at-top
  return any(b.name == MOE_WGMMA_BACKEND and b.supported_on(jax.devices()[0])
             for b in moe.moe_kernels_for_format(fp4_nk.MXFP4NKWeight))


def dispatch_moe(x, w, ids, implementation):
  from qjax._src import moe  # pylint: disable=g-import-not-at-top
  return moe.moe_matmul(x, w, ids, implementation=implementation)


def format_moe_table(rows: Sequence[MoERow]) -> str:
  head = (f"{'T':>4} {'E':>4} {'K':>5} {'N':>5} {'top':>3} {'sel':>5} |"
          + "".join(f" {i:>11}" for i in MOE_IMPLS) + f" {'floor':>8} |"
          + f" {'default/floor':>13} {'grouped/floor':>13} {'gemv/floor':>10}"
          + f" {'wgmma/floor':>11}"
          + f" {'dq_all/default':>14}")
  lines = [head, "-" * len(head)]
  for r in rows:
    s = f"{r.tokens:>4} {r.experts:>4} {r.k:>5} {r.n:>5} {r.top_k:>3} {r.selected_experts:>5.1f} |"
    s += "".join(f" {r.times_us[i]:>11.1f}" for i in MOE_IMPLS) + f" {r.floor_us:>8.1f} |"
    s += f" {r.over_floor('default'):>12.2f}x {r.over_floor('grouped'):>12.2f}x"
    s += f" {r.over_floor('gemv'):>9.2f}x {r.over_floor('wgmma'):>10.2f}x"
    s += f" {_ratio(r.times_us['dequant_all'], r.times_us['default']):>13.1f}x"
    lines.append(s)
  return "\n".join(lines)


def run_moe(args, env: dict[str, str], on_gpu: bool) -> int:
  """``qjax bench --moe``: the MoE matmul of GPT-OSS-like experts, per token count, in
  the format ``--format`` names (MXFP4 by default, or INT4)."""
  fmt = getattr(args, "format", None) or "mxfp4"
  if fmt not in MOE_BENCH_FORMATS:
    raise ValueError(f"--moe --format {fmt}: --moe times experts of "
                     f"{', '.join(MOE_BENCH_FORMATS)}")
  cfg = moe_defaults(fmt, on_gpu)
  if args.shapes:
    cfg["k"], cfg["n"] = (int(v) for v in args.shapes.split(",")[0].lower().split("x"))
  if args.m:
    cfg["tokens"] = tuple(int(v) for v in args.m.split(","))
  if args.moe_experts:
    cfg["experts"] = args.moe_experts
  if args.moe_top_k:
    cfg["top_k"] = args.moe_top_k
  bandwidth = measure_copy_bandwidth(2**30 if on_gpu else 2**26)
  print(f"# measured copy bandwidth: {bandwidth / 1e12:.3f} TB/s (read + write)")
  what = "MXFP4" if fmt == "mxfp4" else "INT4 (symmetric, group 128)"
  print(f"# MoE: {cfg['experts']} {what} experts of {cfg['k']}x{cfg['n']}, top-{cfg['top_k']}; "
        "times in us of device time per call; sel = distinct experts per call; floor = "
        "their packed bytes + x + output at the copy bandwidth")
  rows = []
  for t in cfg["tokens"]:
    rows.append(bench_moe(t, experts=cfg["experts"], k=cfg["k"], n=cfg["n"],
                          top_k=cfg["top_k"], bandwidth=bandwidth, on_gpu=on_gpu,
                          calls=args.calls, fmt=fmt))
    print(format_moe_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
  print()
  print(format_moe_table(rows))
  reasons = {(i, why): None for r in rows for i, why in r.nan_reasons.items()}
  for impl, why in reasons:  # once per (implementation, reason), in the rows' order
    print(f"# nan {impl}: {why}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"environment": env, "bandwidth_bytes_per_s": bandwidth,
                 "moe_rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
  return 0


def source_commit() -> str:
  """The commit the benchmark ran: ``$QJAX_COMMIT`` when set (for copies of the tree whose
  ``.git`` is absent or stale), else git's short hash of the source tree, with "-dirty"
  when files differ from it; "unknown" outside a git checkout."""
  if os.environ.get("QJAX_COMMIT"):
    return os.environ["QJAX_COMMIT"]
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", root, *argv], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()

  try:
    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return commit + ("-dirty" if dirty else "")


def environment() -> dict[str, str]:
  d = jax.devices()[0]
  return {"device": d.device_kind, "platform": d.platform, "jax": jax.__version__,
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "commit": source_commit()}


def run(args) -> int:
  """Entry point of ``qjax bench`` (``args`` from cli.py)."""
  env = environment()
  on_gpu = env["platform"] == "gpu"
  ms = [int(v) for v in args.m.split(",")] if args.m else list(GPU_M if on_gpu else CPU_M)
  if args.shapes:
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
  else:
    shapes = list(GPU_SHAPES if on_gpu else CPU_SHAPES)
  fmts = (args.format or "int4").split(",")
  unknown = [f for f in fmts if f not in BENCH_FORMATS]
  if unknown:
    raise ValueError(f"--format {','.join(fmts)!r}: unknown {unknown}; known formats: "
                     f"{','.join(BENCH_FORMATS)}")
  print(f"# qjax bench on {env['device']} ({env['platform']}), jax {env['jax']}, {env['date']}, "
        f"commit {env['commit']}")
  if not on_gpu:
    print("# CPU run: XLA and Pallas interpret mode only, wall-clock medians, small shapes. "
          "Not kernel figures.")
  if getattr(args, "moe", False):
    return run_moe(args, env, on_gpu)
  if getattr(args, "attention", False):
    from qjax._src import attention_bench  # pylint: disable=g-import-not-at-top
    return attention_bench.run(args, env, on_gpu)
  impls = args.impl.split(",") if args.impl else _timed_impls(on_gpu)
  if args.tune:
    if not on_gpu:
      print("--tune needs a GPU; nothing tuned")
      return 2
    entries = []
    for fmt in fmts:
      entries += tune(shapes, ms, fmt, calls=args.calls,
                      missing_only=getattr(args, "tune_missing", False))
    path = tuning.DATA_DIR / tuning.device_file_name(env["device"])
    print(f"wrote {len(entries)} entries to {path}")
  bandwidth = measure_copy_bandwidth(2**30 if on_gpu else 2**26)
  print(f"# measured copy bandwidth: {bandwidth / 1e12:.3f} TB/s (read + write)")
  print("# times in us per call; floor = weight + x + output bytes at that "
        "bandwidth; read = XLA's fastest pass over those bytes; ceil% = floor / read, the "
        "most of the floor reading them reaches")
  rows = []
  for fmt in fmts:
    for k, n in shapes:
      for m in ms:
        rows.append(bench_shape(m, k, n, fmt, bandwidth=bandwidth, impls=impls,
                                calls=args.calls))
        # Progress on stderr: stdout holds the table once (qjax bench > file).
        print(format_table(rows[-1:], impls).splitlines()[-1], file=sys.stderr, flush=True)
  print()
  print(format_table(rows, impls))
  for note in nan_notes(rows, impls):
    print(note)
  if any(r.read_ceiling() > 1.01 for r in rows):
    print("# ceil% above 100 %: reading those bytes beat the floor, as bytes served from a "
          "cache do (the bandwidth copy is larger than the caches); the floor is not a "
          "bound at that size on this device")
  result = {"environment": env, "bandwidth_bytes_per_s": bandwidth,
            "rows": [dataclasses.asdict(r) for r in rows]}
  if args.model:
    run_model(on_gpu, result)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  if args.plot:
    plot(rows, impls, args.plot, f"qjax bench, {env['device']}, jax {env['jax']}, {env['date']}")
    print(f"plot written to {args.plot}")
  return 0
