"""Session 37: the decode-attention kernel (pallas_kernels/decode_attention.py) against
``qjax.decode_attention``'s XLA path, alone and in a decode step.

Part 1 (default): device time per call (profiler trace, kernels summed, the XLA combine of
the splits included) of one layer's attention over a 16-layer stacked cache, a different
layer each call (128 MiB at 4096 slots: not served from L2), Llama-3.2-1B's heads (32 / 8
of 64), batch 1 and 8, the cache full or filled to half its slots; the floor is the bytes
of the attended keys and values over 3.0 TB/s.

Part 2 (``--model``): the Llama-3.2-1B-shaped Q4_K model of s36_kv_cache.py (projections
joined), one decode step's device busy time and tokens/s, attention by the kernel (auto)
and by XLA (the layers' ``attention_implementation`` patched), 256 and 4096 slots.

  python docs/experiments/s37_decode_attention.py [--slots 256,1024,4096,16384]
      [--configs] [--model] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import qjax
from flax_layers import llama
from pallas_kernels import decode_attention as kernel
from qjax._src import devtime

sys.path.insert(0, os.path.dirname(__file__))


def attention_times(slots: int, batch: int, fill: float, configs, layers: int = 16,
                    heads=(32, 8, 64)) -> list[tuple[str, float]]:
  """``[(implementation or config, us per call)]`` for one cache shape."""
  h, kvh, d = heads
  rng = np.random.default_rng(0)
  shape = (layers, batch, slots, kvh, d)
  k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((batch, h, d)), jnp.bfloat16)
  mask = jnp.arange(slots)[None] < max(1, int(slots * fill))
  mask = jnp.broadcast_to(mask, (batch, slots))
  arg_sets = [(q, k, v, mask, jnp.int32(i)) for i in range(layers)]
  rows = []
  gpu = jax.default_backend() == "gpu"
  runs = [("xla", "xla", None), ("kernel", "pallas" if gpu else "interpret", None)]
  runs += [(f"block_s {c.block_s} stages {c.num_stages} target {c.target_programs} splits "
            f"{c.splits}", None, c) for c in configs]
  for label, impl, config in runs:
    if config is None:
      fn = jax.jit(lambda q, k, v, m, i, impl=impl: qjax.decode_attention(
          q, k, v, m, layer=i, implementation=impl))
    else:
      fn = jax.jit(lambda q, k, v, m, i, config=config: kernel.decode_attention(
          q, k, v, m, jnp.reshape(i, (1,)), None, scale=d ** -0.5, config=config,
          interpret=not gpu))
    rows.append((label, devtime.device_time(fn, arg_sets, calls=48).us))
  return rows


def part1(args) -> None:
  configs = []
  if args.configs:
    for block_s in (64, 128):
      for stages in (2, 3, 4):
        for target in (264, 528, 1056):
          configs.append(kernel.AttentionConfig(block_s=block_s, num_stages=stages,
                                                target_programs=target))
    configs += [kernel.AttentionConfig(splits=1, num_stages=3),
                kernel.AttentionConfig(splits=1, block_s=128, num_stages=3)]
  table = []
  for slots in map(int, args.slots.split(",")):
    for batch in map(int, args.batches.split(",")):
      for fill in map(float, args.fills.split(",")):
        bytes_ = 2 * batch * int(slots * fill) * 8 * 64 * 2
        rows = attention_times(slots, batch, fill, configs, heads=(32, 8, 64))
        floor = bytes_ / 3.0e6
        print(f"slots {slots} batch {batch} fill {fill}: floor {floor:.1f} us", flush=True)
        for label, us in rows:
          print(f"  {us:8.1f} us  {label}")
        print(f"  best: {min(rows[1:], key=lambda r: r[1])}", flush=True)
        xla, kern = rows[0][1], rows[1][1]
        best = min(rows[1:], key=lambda r: r[1])
        table.append((slots, batch, fill, floor, xla, kern, best))
  print("| slots | batch | filled | floor us | XLA us | kernel us | kernel / XLA | best config |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for slots, batch, fill, floor, xla, kern, best in table:
    print(f"| {slots} | {batch} | {fill:.0%} | {floor:.1f} | {xla:.1f} | {kern:.1f} | "
          f"{kern / xla:.2f} | {best[1]:.1f} ({best[0]}) |")


def decode_rate(params, cfg, slots: int, steps: int = 64) -> float:
  """Tokens/s of ``decode_and_sample`` at batch 1 from position ``slots // 2`` of a cache
  of ``slots``, after 3 warm-up steps."""
  cache = llama.init_cache(cfg, 1, slots)
  state = (jnp.zeros((1,), jnp.int32), jnp.full((1,), slots // 2, jnp.int32), cache,
           jax.random.key(0))
  for i in range(3 + steps):
    if i == 3:
      jax.block_until_ready(state[0])
      start = time.perf_counter()
    state = llama.decode_and_sample(params, *state, cfg=cfg)
  jax.block_until_ready(state[0])
  return steps / (time.perf_counter() - start)


def part2(args) -> None:
  import s36_kv_cache as s36  # pylint: disable=g-import-not-at-top
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  gfile = s36.typed_model(16, "Q4_K", args.tiny)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype)
  params = llama.fuse_projections(generate.gguf_params(gfile, cfg, None))
  original = llama.attention_implementation
  rows = []
  for slots in (256, 4096):
    for label, patch in (("xla", lambda impl: "xla"), ("kernel", original)):
      llama.attention_implementation = patch
      jax.clear_caches()  # decode_and_sample's trace read the patched function
      busy, by_name = s36.step_kernels(params, cfg, slots)
      rate = decode_rate(params, cfg, slots)
      rows.append((slots, label, busy, rate))
      print(f"slots {slots} attention {label}: busy {busy:.1f} us/step, {rate:.0f} tokens/s",
            flush=True)
      for name, us in by_name.most_common(args.top):
        print(f"  {us:8.1f} us  {name[:100]}")
  llama.attention_implementation = original
  print("| cache slots | attention | busy us / step | tokens/s |")
  print("| --- | --- | --- | --- |")
  for slots, label, busy, rate in rows:
    print(f"| {slots} | {label} | {busy:.1f} | {rate:.0f} |")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--slots", default="256,1024,4096,16384")
  p.add_argument("--batches", default="1,8")
  p.add_argument("--fills", default="1.0,0.5", help="fractions of the slots attended")
  p.add_argument("--configs", action="store_true", help="also time a sweep of configs")
  p.add_argument("--model", action="store_true", help="part 2: the decode step")
  p.add_argument("--top", type=int, default=12)
  p.add_argument("--tiny", action="store_true", help="a 256-wide model (CPU smoke)")
  args = p.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  if args.model:
    part2(args)
  else:
    part1(args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
