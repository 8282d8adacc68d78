"""Where the Hopper wgmma kernel's step time goes: Mosaic GPU's in-kernel profiler.

  python examples/wgmma_profile.py --m 16 --shape 8192x28672

Runs ``pallas_kernels.int4_wgmma`` once with ``CompilerParams(profile_space=...,
profile_dir=...)`` and summarises the trace: for each named scope of a compute step
(``smem_load``, ``convert``, ``scale``, ``wgmma``, ``wgmma_wait``; see
``int4_wgmma._convert_and_multiply``) the mean duration in SM clock cycles and its share of
the warpgroups' traced time. The rest of that time is spent waiting for the pipeline's
barriers (data not yet in shared memory) and in the epilogue. Needs an H100 / H200; the
profiler's buffer takes shared memory, so each warpgroup keeps its first ``--events``
events only (enough for averages), and where it does not fit beside the pipeline (M = 64
takes 225 KiB) the example profiles the configuration with one stage fewer, or half the K
step, and says so. Session 17 used it to find that the int4 -> bf16
conversion, not the tensor cores, bounded the kernel at small M (BENCHMARKS.md).
"""

import argparse
import collections
import dataclasses
import functools
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu

from qjax._src import bench
from pallas_kernels import int4_wgmma


def summarise(trace_events):
  """``{scope: (count, mean cycles, share of the traced time)}`` and the mean traced span
  per warpgroup, from the profiler's trace events (B / E pairs per warpgroup)."""
  per_wg = collections.defaultdict(list)
  for e in trace_events:
    per_wg[e["tid"]].append(e)
  total, count, span = collections.Counter(), collections.Counter(), 0.0
  for events in per_wg.values():
    stack = []
    span += events[-1]["ts"] - events[0]["ts"]
    for e in events:
      if e["ph"] == "B":
        stack.append(e)
      else:
        begin = stack.pop()
        total[begin["name"]] += e["ts"] - begin["ts"]
        count[begin["name"]] += 1
  # The profiler stores cycles / 1000 in "ts".
  return ({name: (count[name], total[name] / count[name] * 1e3, total[name] / span)
           for name in total}, span / max(len(per_wg), 1) * 1e3)


def room_for_profiler(cfg: int4_wgmma.WgmmaConfig, k: int) -> int4_wgmma.WgmmaConfig | None:
  """A configuration with less shared memory than ``cfg`` (one stage fewer, else half the
  K step), for when the profiler's buffer does not fit beside ``cfg``'s pipeline; None if
  ``cfg`` is already the smallest. Tiles stay chained only where the stages still divide
  the K steps."""
  if cfg.stages > 2:
    smaller = dataclasses.replace(cfg, stages=cfg.stages - 1)
  elif cfg.tile_k > 128:
    smaller = dataclasses.replace(cfg, tile_k=cfg.tile_k // 2)
  else:
    return None
  steps = k // smaller.split_k // smaller.tile_k
  return dataclasses.replace(smaller, chain_tiles=cfg.chain_tiles and steps % smaller.stages == 0)


def _profile(cfg, x, w, events: int) -> str:
  """Runs the kernel once under the profiler; returns the directory of its trace."""
  out_dir = tempfile.mkdtemp()
  plain = plgpu.CompilerParams
  int4_wgmma.plgpu.CompilerParams = functools.partial(
      plain, profile_space=events, profile_dir=out_dir, profile_bounds_check=True)
  try:
    jax.block_until_ready(
        jax.jit(lambda a, b: int4_wgmma.int4_nk_matmul(a, b, config=cfg))(x, w))
  finally:
    int4_wgmma.plgpu.CompilerParams = plain
  return out_dir


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--m", type=int, default=16, help="rows of x (default 16)")
  parser.add_argument("--shape", default="8192x28672", help="KxN of the weight")
  parser.add_argument("--events", type=int, default=256,
                      help="profiler events kept per warpgroup (default 256)")
  args = parser.parse_args()
  if not int4_wgmma.supported(jax.devices()[0]):
    raise SystemExit("the wgmma kernel needs an NVIDIA Hopper GPU (sm_90)")
  try:
    k, n = (int(v) for v in args.shape.lower().split("x"))
  except ValueError:
    parser.error(f"--shape {args.shape!r} is not KxN")
  w = bench.random_weight("int4nk", k, n, jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (args.m, k), jnp.bfloat16)
  cfg = int4_wgmma.config_for(args.m, k, n, w.group_size, jax.devices()[0].core_count)
  while True:
    try:
      out_dir = _profile(cfg, x, w, args.events)
      break
    except ValueError as e:
      smaller = room_for_profiler(cfg, k)
      if "shared memory" not in str(e) or smaller is None:
        raise
      print(f"the profiler's buffer does not fit beside {cfg}; profiling {smaller} instead "
            "(config_for's choice has more stages or a wider K step)")
      cfg = smaller
  files = sorted(glob.glob(os.path.join(out_dir, "*.json")), key=os.path.getmtime)
  if not files:
    raise SystemExit(f"the profiler wrote no trace to {out_dir}")
  with open(files[-1]) as f:
    scopes, span = summarise(json.load(f)["traceEvents"])
  print(f"M={args.m} K={k} N={n} {cfg}")
  print(f"mean traced span per warpgroup: {span:.0f} cycles ({files[-1]})")
  print(f"{'scope':12s} {'count':>8s} {'mean cycles':>12s} {'share':>7s}")
  for name, (c, mean, share) in scopes.items():
    print(f"{name:12s} {c:8d} {mean:12.1f} {share * 100:6.1f}%")


if __name__ == "__main__":
  main()
