"""Device time of each XLA formulation of the int4 matmul (qjax._src.int4_xla_variants).

For every (K, N) and M: each variant (``materialize`` is today's ``matmul_xla``), the
naive user program (a native ``jnp.int4`` ``[K, N]`` array, ``w.astype(bf16) * scales``
repeated over the groups, ``jnp.dot``, under one jit: the xla-int4 column of
docs/peers-h100.md) and bf16 ``jnp.dot``. Weights are ``qjax bench``'s random
int4 (group 128, symmetric, bf16 scales), rotated so that repeated calls do not read
them from L2; x is bf16. Every output (the naive one too) is checked against a float64
reference on its first 256 columns: the table's last column holds the largest relative
error of the row. ``-`` marks a variant left out at that M (``--all`` times them
anyway): ``reduce`` above M = 16, ``grouped``/``folded*`` where their float32 partial
sums would pass 256 MiB; ``fail`` one that did not compile or run (the reason is
printed). The run exits 1 if an error reaches
1e-2 or a variant failed. Progress goes to stderr, one line per (K, N, M); the table
comes last on stdout. The default is 83 timings (each one compiles); ``--ms``,
``--shapes`` and ``--variants`` cut it down.

  python examples/xla_fallback_bench.py                 # H100 shapes, M = 1, 16, 256
  JAX_PLATFORMS=cpu python examples/xla_fallback_bench.py --tiny  # a CPU check (wall time)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import bench
from qjax._src import cli
from qjax._src import devtime
from qjax._src import int4_xla_variants as variants
from qjax._src import packing

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))
MS = (1, 16, 256)
TINY_SHAPES = ((256, 512), (512, 256))
TINY_MS = (1, 16)
CHECK_COLUMNS = 256
MAX_ERR = 1e-2


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default=None, type=cli._shapes,  # pylint: disable=protected-access
                 help="comma-separated KxN, K a multiple of 128 (default: 4 LLM shapes)")
  ms_type = cli._positive_ints("1,16")  # pylint: disable=protected-access
  p.add_argument("--ms", default=None, type=ms_type,
                 help="comma-separated M (default: 1,16,256)")
  p.add_argument("--variants", default=",".join(variants.VARIANTS),
                 help="comma-separated variant names (default: all)")
  p.add_argument("--calls", type=int, default=10,
                 help="timed calls per measurement (default %(default)s)")
  p.add_argument("--all", action="store_true", help="time every variant at every M")
  p.add_argument("--tiny", action="store_true", help="small shapes, for a CPU check")
  p.add_argument("--json", default=None, help="also write the rows to this file")
  args = p.parse_args(argv)
  shapes = TINY_SHAPES if args.tiny else SHAPES
  if args.shapes:
    shapes = tuple(tuple(int(d) for d in s.lower().split("x")) for s in args.shapes.split(","))
    for k, _ in shapes:
      if k % 128:
        p.error(f"--shapes {args.shapes}: K={k} is not a multiple of 128 (int4 group 128)")
  args.shapes = shapes
  args.ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else (
      TINY_MS if args.tiny else MS)
  args.variants = tuple(args.variants.split(","))
  for v in args.variants:
    if v not in variants.VARIANTS:
      p.error(f"unknown variant {v!r}; known: {', '.join(variants.VARIANTS)}")
  return args


def left_out(name: str, m: int, w) -> bool:
  """Variants whose cost at this M is known to be out of the running (see the doc)."""
  kg, n = w.num_groups, w.shape[1]
  if name == "reduce":
    return m > 16
  if name in ("grouped", "folded", "folded_fused"):
    return kg * m * n * 4 > 256 * 2**20
  return False


def naive_arrays(w):
  """What a user would hold: the signed int4 ``[K, N]`` array and the group scales."""
  q = jax.jit(lambda c: (c.astype(jnp.int8) - 8).astype(jnp.int4))(w.unpacked_codes())
  return q, w.scales


@jax.jit
def naive(x, q, scales):
  g = q.shape[0] // scales.shape[0]
  return jnp.dot(x, q.astype(x.dtype) * jnp.repeat(scales, g, axis=0).astype(x.dtype))


@jax.jit
def dot_bf16(x, wb):
  return jnp.dot(x, wb)


def reference(x, w, columns: int) -> np.ndarray:
  """float64 ``x @ W[:, :columns]``, W rebuilt in numpy from the words."""
  k, _ = w.shape
  q = packing.unpack_codes(np.asarray(w.codes[:, :columns]), k, w.tile_k).astype(np.float64)
  s = np.repeat(np.asarray(w.scales[:, :columns], np.float64), w.group_size, axis=0)
  return np.asarray(x, np.float64) @ ((q - 8.0) * s)


def rel_err(y, ref) -> float:
  y = np.asarray(y[:, :ref.shape[1]], np.float64)
  return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def bench_shape(k: int, n: int, ms, names, *, calls: int, every: bool, bandwidth: float,
                t0: float):
  key = jax.random.key(0)
  kx, kw, kb = jax.random.split(key, 3)
  rotation = bench._rotation  # pylint: disable=protected-access
  ws = [bench.random_weight("int4", k, n, kw)]
  ws += [bench.random_weight("int4", k, n, jax.random.fold_in(kw, i))
         for i in range(1, rotation(ws[0].nbytes))]
  naive_ws = [naive_arrays(w) for w in ws]
  wb = (jax.random.normal(kb, (k, n), jnp.float32) / 64).astype(jnp.bfloat16)
  wbs = [wb] + [wb * (1 + i / 1024) for i in range(1, rotation(k * n * 2))]
  columns = min(n, CHECK_COLUMNS)
  rows = []
  for m in ms:
    x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = reference(x, ws[0], columns)
    times, errs, failed = {}, {}, {}
    for name in names:
      if left_out(name, m, ws[0]) and not every:
        continue
      f = jax.jit(functools.partial(variants.matmul, variant=name))
      try:  # A variant XLA fails to compile on this device must not end the run.
        errs[name] = rel_err(f(x, ws[0]), ref)
        times[name] = devtime.device_time(f, [(x, w) for w in ws], calls=calls, warmup=2).us
      except Exception as e:  # pylint: disable=broad-except
        failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        errs.pop(name, None)
    errs["naive"] = rel_err(naive(x, *naive_ws[0]), ref)
    times["naive"] = devtime.device_time(naive, [(x, *a) for a in naive_ws], calls=calls,
                                         warmup=2).us
    times["bf16"] = devtime.device_time(dot_bf16, [(x, b) for b in wbs], calls=calls,
                                        warmup=2).us
    floor_bytes = ws[0].nbytes + x.nbytes + m * n * 2
    rows.append(dict(k=k, n=n, m=m, times_us=times, rel_err=errs, failed=failed,
                     floor_us=floor_bytes / bandwidth * 1e6))
    print(f"[{time.perf_counter() - t0:.0f} s] K={k} N={n} M={m}: "
          + ", ".join(f"{a} {t:.1f}" for a, t in times.items())
          + "".join(f"; {a} FAILED {e}" for a, e in failed.items()), file=sys.stderr, flush=True)
  return rows


def format_table(rows, names) -> str:
  cols = list(names) + ["naive", "bf16"]
  width = {c: max(8, len(c) + 1) for c in cols}
  head = f"{'K':>5} {'N':>5} {'M':>3} |" + "".join(f"{c:>{width[c]}}" for c in cols)
  head += f" {'floor':>6} | {'best':>12} {'/naive':>6} {'max err':>7}"
  lines = [head, "-" * len(head)]
  for r in rows:
    t = r["times_us"]
    s = f"{r['k']:>5} {r['n']:>5} {r['m']:>3} |"
    s += "".join(f"{t[c]:>{width[c]}.1f}" if c in t else
                 f"{'fail' if c in r['failed'] else '-':>{width[c]}}" for c in cols)
    timed = [c for c in names if c in t]
    best = min(timed, key=t.get) if timed else "-"
    ratio = t[best] / t["naive"] if timed else float("nan")
    s += f" {r['floor_us']:>6.1f} | {best:>12} {ratio:>5.2f}x {max(r['rel_err'].values()):>7.1e}"
    lines.append(s)
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  t0 = time.perf_counter()
  dev = jax.devices()[0]
  bandwidth = bench.measure_copy_bandwidth(2**24 if args.tiny else 2**30)
  rows = []
  for k, n in args.shapes:
    rows += bench_shape(k, n, args.ms, args.variants, calls=args.calls, every=args.all,
                        bandwidth=bandwidth, t0=t0)
  bad = [(r["k"], r["n"], r["m"], a, f"rel err {e:.2e} >= {MAX_ERR}") for r in rows
         for a, e in r["rel_err"].items() if not e < MAX_ERR]
  bad += [(r["k"], r["n"], r["m"], a, e) for r in rows for a, e in r["failed"].items()]
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=dev.device_kind, jax=jax.__version__, rows=rows), f, indent=1)
  print(f"\n{dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"{'device time' if dev.platform != 'cpu' else 'wall time'} in us per call, "
        f"{args.calls} calls, bf16 x, int4 group 128; {time.perf_counter() - t0:.0f} s")
  print("best: fastest variant; /naive: its time over the naive program's (<= 1: no slower)")
  for kk, nn, m, a, e in bad:
    print(f"FAIL: {a} at K={kk} N={nn} M={m}: {e}")
  print(format_table(rows, args.variants))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
