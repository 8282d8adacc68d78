"""Tensor-parallel decode through a Llama-shaped stack of quantized linear layers.

Each layer: RMSNorm, q / k / v (column-parallel), a stand-in for attention that pairs
each query head with its KV head (no KV cache: attention is not a weight matmul), o
(row-parallel), RMSNorm, the SwiGLU MLP with gate / up (column-parallel) and down
(row-parallel), residuals. The layers are stacked and run with ``lax.scan`` inside one
``shard_map``; every projection is :func:`qjax.matmul` on a :class:`qjax.ShardedWeight`,
so each GPU runs the Pallas kernel on its slices and the row-parallel outputs are summed
with one float32 ``psum`` each (two per layer). Tokens/s come from the wall time of
repeated jitted steps after warm-up (``block_until_ready`` once at the end), for each
device count against one device, whose output the others must match.

  python examples/tp_llama_bench.py                     # Llama-3-8B shapes, all GPUs vs 1
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
      python examples/tp_llama_bench.py --tiny          # CPU check, 1, 2, 4, 8 devices
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import qjax
from qjax._src import sharding as sharding_lib

COLUMN = ("q", "k", "v", "gate", "up")
ROW = ("o", "down")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=16, help="decoder layers (default %(default)s)")
  p.add_argument("--hidden", type=int, default=4096, help="hidden size (default %(default)s)")
  p.add_argument("--ffn", type=int, default=14336,
                 help="the MLP's hidden width (default %(default)s)")
  p.add_argument("--heads", type=int, default=32, help="query heads (default %(default)s)")
  p.add_argument("--kv-heads", type=int, default=8, help="key / value heads (default "
                 "%(default)s)")
  p.add_argument("--head-dim", type=int, default=128, help="head width (default %(default)s)")
  p.add_argument("--batch", default="1,16", help="comma-separated decode batch sizes "
                 "(default %(default)s)")
  p.add_argument("--devices", default=None,
                 help="comma-separated device counts (default: 1, 2, 4, ... up to all); "
                 "1, the baseline, always runs")
  p.add_argument("--format", default="int4", choices=("int4", "mxfp4", "nvfp4"),
                 help="the projections' format (default %(default)s)")
  p.add_argument("--group-size", type=int, default=128,
                 help="INT4 rows of K per scale (default %(default)s)")
  p.add_argument("--tile-k", type=int, default=qjax.NATIVE_TILE_K,
                 help="packing order of the codes (default %(default)s, the kernels')")
  p.add_argument("--implementation", default=None,
                 help="qjax.matmul implementation (default: best available)")
  p.add_argument("--steps", type=int, default=50, help="timed decode steps per point "
                 "(default %(default)s)")
  p.add_argument("--warmup", type=int, default=3,
                 help="untimed decode steps first (default %(default)s)")
  p.add_argument("--tiny", action="store_true",
                 help="tiny shapes for a CPU check (2 layers, hidden 256, tile_k 8); the "
                 "options given beside it still apply")
  p.add_argument("--json", default=None, help="write the results to this file")
  if p.parse_args(argv).tiny:  # the tiny sizes as defaults, so that given options win
    p.set_defaults(layers=2, hidden=256, ffn=512, heads=8, kv_heads=8, head_dim=32,
                   group_size=32, tile_k=8, steps=10)
  return p.parse_args(argv)


def _quantize(fmt: str, w: jax.Array, group_size: int, tile_k: int):
  if fmt == "int4":
    return qjax.quantize(w, group_size=group_size, tile_k=tile_k)
  if fmt == "mxfp4":
    return qjax.quantize_mxfp4(w, tile_k=tile_k)
  return qjax.quantize_nvfp4(w, tile_k=tile_k)


def build_weights(args) -> dict:
  """``{name: weight}`` stacked over layers (every array has a leading ``[layers]``)."""
  h, f = args.hidden, args.ffn
  shapes = {"q": (h, args.heads * args.head_dim), "k": (h, args.kv_heads * args.head_dim),
            "v": (h, args.kv_heads * args.head_dim), "o": (args.heads * args.head_dim, h),
            "gate": (h, f), "up": (h, f), "down": (f, h)}
  quantize = jax.jit(functools.partial(_quantize, args.format, group_size=args.group_size,
                                       tile_k=args.tile_k))
  out = {}
  for i, (name, (k, n)) in enumerate(shapes.items()):
    layers = []
    for layer in range(args.layers):
      key = jax.random.fold_in(jax.random.key(i), layer)
      layers.append(quantize(jax.random.normal(key, (k, n), jnp.float32) / np.sqrt(k)))
    out[name] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    del layers
  return out


def _rms(x):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


def layer_step(x, w, *, head_dim: int, implementation):
  """One layer on this device's heads and hidden units; x ``[batch, hidden]``."""
  mm = functools.partial(qjax.matmul, implementation=implementation)
  b = x.shape[0]
  h = _rms(x)
  q, k, v = mm(h, w["q"]), mm(h, w["k"]), mm(h, w["v"])
  heads, kv_heads = q.shape[-1] // head_dim, k.shape[-1] // head_dim
  kv = jnp.repeat((k + v).reshape(b, kv_heads, head_dim), heads // kv_heads, axis=1)
  attn = (q.reshape(b, heads, head_dim) * jax.nn.sigmoid(kv)).reshape(b, -1)
  x = x + mm(attn, w["o"])
  h = _rms(x)
  return x + mm(jax.nn.silu(mm(h, w["gate"])) * mm(h, w["up"]), w["down"])


def make_step(weights: dict, mesh: Mesh, args):
  """A jitted ``step(x [batch, hidden]) -> x`` over every layer, split over ``mesh``."""
  sharded = {name: qjax.ShardedWeight.of(w, mesh, "tp", "column" if name in COLUMN else "row")
             for name, w in weights.items()}
  specs = {name: w.partition_specs() for name, w in sharded.items()}

  def body(x, ws):
    def one(x, w):
      return layer_step(x, w, head_dim=args.head_dim,
                        implementation=args.implementation), None
    return jax.lax.scan(one, x, ws)[0]

  fn = jax.jit(sharding_lib.shard_map(body, mesh, in_specs=(P(), specs), out_specs=P()))
  return lambda x: fn(x, sharded), sharded


def time_steps(step, x, *, steps: int, warmup: int) -> float:
  """Seconds per step: wall time of ``steps`` chained calls after ``warmup`` calls."""
  for _ in range(warmup):
    x = step(x)
  jax.block_until_ready(x)
  t0 = time.perf_counter()
  for _ in range(steps):
    x = step(x)
  jax.block_until_ready(x)
  return (time.perf_counter() - t0) / steps


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  devices = jax.devices()
  if args.devices:
    counts = [int(c) for c in args.devices.split(",")]
    if not all(0 < c <= len(devices) for c in counts):
      raise SystemExit(f"--devices {args.devices}: counts from 1 to the {len(devices)} "
                       f"device(s) here (on a CPU, XLA_FLAGS="
                       f"--xla_force_host_platform_device_count=N gives N)")
  else:
    counts = [c for c in (1, 2, 4, 8, 16) if c < len(devices)] + [len(devices)]
  counts = sorted(set(counts) | {1})  # one device: the baseline of speed and output
  batches = [int(b) for b in args.batch.split(",")]
  dtype = jnp.float32 if devices[0].platform == "cpu" else jnp.bfloat16
  weights = build_weights(args)
  first = jax.tree.map(lambda a: a[0], weights["gate"])
  print(f"# {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, heads "
        f"{args.heads}/{args.kv_heads}x{args.head_dim}, {args.format} (group "
        f"{args.group_size}, tile_k {args.tile_k}); {len(devices)} x "
        f"{devices[0].device_kind}; jax {jax.__version__}")
  print(f"# weights {sum(w.nbytes for w in weights.values()) / 1e9:.3f} GB; matmul "
        f"implementation at batch {batches[0]}: "
        f"{qjax.implementation_name(first, args.implementation, m=batches[0])}")
  print(f"{'devices':>7} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'vs 1':>6} "
        f"{'max rel diff':>12}")
  results, base, ref = [], {}, {}
  for n in counts:
    mesh = Mesh(np.array(devices[:n]), ("tp",))
    step, sharded = make_step(weights, mesh, args)
    for b in batches:
      x = jax.random.normal(jax.random.key(100 + b), (b, args.hidden), jnp.float32).astype(dtype)
      y = np.asarray(step(x), np.float64)
      ref.setdefault(b, y)
      diff = float(np.max(np.abs(y - ref[b])) / max(np.max(np.abs(ref[b])), 1e-30))
      sec = time_steps(step, x, steps=args.steps, warmup=args.warmup)
      tps = b / sec
      base.setdefault(b, tps)
      row = {"devices": n, "batch": b, "ms_per_step": sec * 1e3, "tokens_per_s": tps,
             "speedup": tps / base[b], "max_rel_diff": diff}
      results.append(row)
      print(f"{n:>7} {b:>5} {sec * 1e3:>9.3f} {tps:>10.1f} {tps / base[b]:>5.2f}x "
            f"{diff:>12.2e}", flush=True)
    del step, sharded
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "device": devices[0].device_kind,
                 "jax": jax.__version__, "results": results}, f, indent=2)
  return results


if __name__ == "__main__":
  main()
