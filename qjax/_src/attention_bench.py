"""``qjax bench --attention``: :func:`qjax.decode_attention` (one query per sequence over a
KV cache) per implementation, against the bandwidth floor of the attended keys and values;
with ``--prefill``, :func:`qjax.causal_attention` (a prompt over its own keys) in TFLOP/s.

For each (batch, cache slots, attended fraction): the device time per call (profiler trace,
every kernel of the call summed, a KV combine included) of one layer's attention over a
stacked bfloat16 cache of ``LAYERS`` layers, a different layer each call so the cache is not
served from L2. The floor is the bytes the attention must read (the attended slots' keys
and values, q) and write, over the copy bandwidth measured in the same run. On the CPU:
small shapes, XLA and interpret mode, wall-clock medians (a smoke test).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import jax
import jax.numpy as jnp

from qjax._src import attention
from qjax._src import bench
from qjax._src import causal_attention
from qjax._src import devtime

GPU_BATCH, CPU_BATCH = (1, 8), (1, 2)
GPU_SLOTS, CPU_SLOTS = (256, 1024, 4096, 16384), (64, 256)
GPU_HEADS, CPU_HEADS = (32, 8, 128), (8, 2, 64)  # query heads, KV heads, head_dim
FILLS = (0.5, 1.0)
LAYERS = 16
GPU_PROMPTS, CPU_PROMPTS = (1024, 4096, 8192), (64, 128)


@dataclasses.dataclass
class AttentionRow:
  """One measurement: times in us per call by implementation name."""
  batch: int
  slots: int
  filled: float
  heads: int
  kv_heads: int
  head_dim: int
  floor_us: float
  times_us: dict[str, float]

  def fraction_of_floor(self, impl: str) -> float:
    """The floor over ``impl``'s time."""
    return bench._ratio(self.floor_us, self.times_us.get(impl))  # pylint: disable=protected-access

  def speedup(self, impl: str) -> float:
    """The XLA path's time over ``impl``'s."""
    xla = self.times_us.get("xla")
    return bench._ratio(xla, self.times_us.get(impl))  # pylint: disable=protected-access


def attended_bytes(batch: int, slots: int, filled: float, heads: int, kv_heads: int,
                   head_dim: int, itemsize: int = 2) -> int:
  """The bytes one call must move: the attended slots' keys and values, q and the output."""
  attended = max(1, int(slots * filled))
  return itemsize * (2 * batch * attended * kv_heads * head_dim + 2 * batch * heads * head_dim)


def bench_attention(batch: int, slots: int, filled: float, *, heads: Sequence[int],
                    impls: Sequence[str], bandwidth: float, calls: int,
                    layers: int = LAYERS) -> AttentionRow:
  """Times :func:`qjax.decode_attention` for each of ``impls`` on one cache shape."""
  h, kvh, d = heads
  keys = jax.random.split(jax.random.key(batch * 100003 + slots), 3)
  shape = (layers, batch, slots, kvh, d)
  k = jax.random.normal(keys[0], shape, jnp.bfloat16)  # made on the device: GBs at 16384
  v = jax.random.normal(keys[1], shape, jnp.bfloat16)
  q = jax.random.normal(keys[2], (batch, h, d), jnp.bfloat16)
  mask = jnp.broadcast_to(jnp.arange(slots)[None] < max(1, int(slots * filled)),
                          (batch, slots))
  arg_sets = [(q, k, v, mask, jnp.int32(i)) for i in range(layers)]
  times = {}
  for impl in impls:
    fn = jax.jit(lambda q, k, v, m, i, impl=impl: attention.decode_attention(
        q, k, v, m, layer=i, implementation=impl))
    times[impl] = devtime.device_time(fn, arg_sets, calls=calls).us
  floor = attended_bytes(batch, slots, filled, h, kvh, d) / bandwidth * 1e6
  return AttentionRow(batch=batch, slots=slots, filled=filled, heads=h, kv_heads=kvh,
                      head_dim=d, floor_us=floor, times_us=times)


def format_table(rows: Sequence[AttentionRow], impls: Sequence[str]) -> str:
  kernels = [i for i in impls if i != "xla"]
  head = (f"{'batch':>5} {'slots':>6} {'filled':>6} |" + "".join(f" {i:>10}" for i in impls)
          + f" {'floor':>7} |" + "".join(f" {i + '%fl':>13}" for i in impls)
          + "".join(f" {i + ' xXLA':>14}" for i in kernels))
  lines = [head, "-" * len(head)]
  for r in rows:
    s = f"{r.batch:>5} {r.slots:>6} {r.filled:>6.0%} |"
    s += "".join(f" {r.times_us[i]:>10.1f}" for i in impls) + f" {r.floor_us:>7.2f} |"
    s += "".join(f" {r.fraction_of_floor(i):>12.0%}" for i in impls)
    s += "".join(f" {r.speedup(i):>13.2f}x" for i in kernels)
    lines.append(s)
  return "\n".join(lines)


@dataclasses.dataclass
class PrefillRow:
  """One prompt shape: times in us per call by implementation name."""
  batch: int
  tokens: int
  heads: int
  kv_heads: int
  head_dim: int
  flops: float
  times_us: dict[str, float]

  def tflops(self, impl: str) -> float:
    """``impl``'s rate in TFLOP/s of the causal half of the two products."""
    us = self.times_us.get(impl)
    return float("nan") if not us else self.flops / us / 1e6

  def speedup(self, impl: str) -> float:
    """The XLA path's time over ``impl``'s."""
    return bench._ratio(self.times_us.get("xla"), self.times_us.get(impl))  # pylint: disable=protected-access


def causal_flops(batch: int, tokens: int, heads: int, head_dim: int) -> float:
  """The multiply-adds of causal attention, x2: ``q k^T`` and ``p v`` over the ``t (t +
  1) / 2`` seen (query, key) pairs of each head."""
  return 2.0 * 2 * batch * heads * head_dim * tokens * (tokens + 1) / 2


def bench_prefill(batch: int, tokens: int, *, heads: Sequence[int], impls: Sequence[str],
                  calls: int) -> PrefillRow:
  """Times :func:`qjax.causal_attention` for each of ``impls`` on one prompt shape, over
  four rotated sets of bfloat16 q / k / v."""
  h, kvh, d = heads
  arg_sets = []
  for i in range(4):
    keys = jax.random.split(jax.random.key(tokens * 131 + batch * 7 + i), 3)
    arg_sets.append(tuple(jax.random.normal(key, (batch, tokens, n, d), jnp.bfloat16)
                          for key, n in zip(keys, (h, kvh, kvh))))
  times = {}
  for impl in impls:
    fn = jax.jit(lambda q, k, v, impl=impl: causal_attention.causal_attention(
        q, k, v, implementation=impl))
    times[impl] = devtime.device_time(fn, arg_sets, calls=calls).us
  return PrefillRow(batch=batch, tokens=tokens, heads=h, kv_heads=kvh, head_dim=d,
                    flops=causal_flops(batch, tokens, h, d), times_us=times)


def format_prefill_table(rows: Sequence[PrefillRow], impls: Sequence[str]) -> str:
  kernels = [i for i in impls if i != "xla"]
  head = (f"{'batch':>5} {'tokens':>6} |" + "".join(f" {i:>10}" for i in impls) + " |"
          + "".join(f" {i + ' TF/s':>14}" for i in impls)
          + "".join(f" {i + ' xXLA':>14}" for i in kernels))
  lines = [head, "-" * len(head)]
  for r in rows:
    s = f"{r.batch:>5} {r.tokens:>6} |" + "".join(f" {r.times_us[i]:>10.1f}" for i in impls)
    s += " |" + "".join(f" {r.tflops(i):>14.1f}" for i in impls)
    s += "".join(f" {r.speedup(i):>13.2f}x" for i in kernels)
    lines.append(s)
  return "\n".join(lines)


def run_prefill(args, env: dict[str, str], on_gpu: bool, heads, impls) -> int:
  """``qjax bench --attention --prefill``."""
  batches = [int(v) for v in args.m.split(",")] if args.m else [1]
  prompts = ([int(v) for v in args.attention_slots.split(",")] if args.attention_slots
             else list(GPU_PROMPTS if on_gpu else CPU_PROMPTS))
  print(f"# qjax.causal_attention, {heads[0]} query heads on {heads[1]} KV heads of "
        f"{heads[2]}, bf16, a prompt over its own keys; times in us per call; TF/s = the "
        "causal half of q k^T and p v (2 * batch * heads * head_dim * t (t + 1) FLOP) per "
        "second; xXLA = speedup over the XLA path (which materializes the scores)"
        + ("" if on_gpu else "; CPU: wall-clock medians, a smoke test"))
  rows = []
  for t in prompts:
    for b in batches:
      rows.append(bench_prefill(b, t, heads=heads, impls=impls, calls=args.calls))
      print(format_prefill_table(rows[-1:], impls).splitlines()[-1], flush=True)
  print()
  print(format_prefill_table(rows, impls))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"environment": env,
                 "prefill_rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
  return 0


def run(args, env: dict[str, str], on_gpu: bool) -> int:
  """``qjax bench --attention`` (``args`` from cli.py: ``m`` the batch sizes,
  ``attention_slots``, ``attention_heads`` "H/KV/D", ``impl``, ``calls``, ``json``,
  ``prefill``)."""
  batches = ([int(v) for v in args.m.split(",")] if args.m
             else list(GPU_BATCH if on_gpu else CPU_BATCH))
  slots = ([int(v) for v in args.attention_slots.split(",")] if args.attention_slots
           else list(GPU_SLOTS if on_gpu else CPU_SLOTS))
  heads = (tuple(int(v) for v in args.attention_heads.split("/")) if args.attention_heads
           else (GPU_HEADS if on_gpu else CPU_HEADS))
  impls = (args.impl.split(",") if args.impl
           else ["xla", "pallas" if on_gpu else "interpret"])
  if getattr(args, "prefill", False):
    return run_prefill(args, env, on_gpu, heads, impls)
  bandwidth = bench.measure_copy_bandwidth(2**30 if on_gpu else 2**26)
  print(f"# measured copy bandwidth: {bandwidth / 1e12:.3f} TB/s (read + write)")
  print(f"# qjax.decode_attention, {heads[0]} query heads on {heads[1]} KV heads of "
        f"{heads[2]}, bf16, one layer of a {LAYERS}-layer cache per call; times in us per "
        "call; filled = attended slots (a causal prefix); floor = the attended keys and "
        "values + q + output at the copy bandwidth; xXLA = speedup over the XLA path")
  rows = []
  for s in slots:
    for b in batches:
      for filled in FILLS:
        rows.append(bench_attention(b, s, filled, heads=heads, impls=impls,
                                    bandwidth=bandwidth, calls=args.calls))
        print(format_table(rows[-1:], impls).splitlines()[-1], flush=True)
  print()
  print(format_table(rows, impls))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"environment": env, "bandwidth_bytes_per_s": bandwidth,
                 "attention_rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
  return 0
