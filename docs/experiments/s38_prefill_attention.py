"""Session 38: the prefill-attention kernel (pallas_kernels/prefill_attention.py, flash
attention) against ``qjax.causal_attention``'s XLA path (the ``[b, heads, t, t]`` scores
materialized).

Part 1 (default): device time per call (profiler trace) of one layer's causal attention,
batch 1, Llama-3.2-1B's heads (32 / 8 of 64) and Llama-3-8B's (32 / 8 of 128), prompts of
``--lengths`` tokens, optionally a sliding window and a config sweep; the arithmetic floor
is the causal half of the two products (``2 b heads t^2 d`` FLOP) at the H100's dense bf16
peak, 989 TFLOP/s. Each row also checks the kernel against the XLA path (largest
difference over the largest value).

Part 2 (``--model``): the Llama-3.2-1B-shaped Q4_K model of s36_kv_cache.py (projections
joined): ``llama.prefill``'s device time with the kernel and with XLA's attention.

  python docs/experiments/s38_prefill_attention.py [--lengths 512,1024,4096,8192]
      [--window 128] [--configs] [--model] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import qjax
from flax_layers import llama
from pallas_kernels import prefill_attention as kernel
from qjax._src import causal_attention as causal
from qjax._src import devtime

sys.path.insert(0, os.path.dirname(__file__))
PEAK = 989e12


def layer_times(t: int, heads, window, configs) -> list[tuple[str, float, float]]:
  """``[(implementation or config, us per call, difference from XLA)]``."""
  h, kvh, d = heads
  rng = np.random.default_rng(0)
  sets = []
  for _ in range(4):  # rotated: a prompt's q / k / v are not served from L2 every call
    sets.append(tuple(jnp.asarray(rng.standard_normal((1, t, n, d)), jnp.bfloat16)
                      for n in (h, kvh, kvh)))
  gpu = jax.default_backend() == "gpu"
  runs = [("xla", "xla", None), ("kernel", "pallas" if gpu else "interpret", None)]
  runs += [(f"block_q {c.block_q} block_k {c.block_k} warps {c.num_warps} stages "
            f"{c.num_stages}", None, c) for c in configs]
  rows, ref = [], None
  for label, impl, config in runs:
    if config is None:
      fn = jax.jit(lambda q, k, v, impl=impl: qjax.causal_attention(
          q, k, v, window=window, implementation=impl))
    else:
      w = np.asarray([window or t], np.int32)
      fn = jax.jit(lambda q, k, v, config=config, w=w: kernel.causal_attention(
          q, k, v, np.zeros((q.shape[0],), np.int32), w, None, scale=d ** -0.5,
          config=config, interpret=not gpu))
    out = np.asarray(fn(*sets[0]), np.float32)
    if ref is None:
      ref = out
    diff = float(np.abs(out - ref).max() / np.abs(ref).max())
    try:
      us = devtime.device_time(fn, sets, calls=12 if t >= 4096 else 24).us
    except Exception as e:  # pylint: disable=broad-except
      print(f"  {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    rows.append((label, us, diff))
  return rows


def part1(args) -> None:
  configs = []
  if args.configs:
    for bq, bk, warps, stages in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2),
                                  (128, 64, 8, 2), (64, 128, 4, 2), (64, 128, 8, 2),
                                  (128, 128, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2)):
      configs.append(kernel.PrefillConfig(block_q=bq, block_k=bk, num_warps=warps,
                                          num_stages=stages))
  window = args.window or None
  table = []
  for heads in ((32, 8, 64), (32, 8, 128)):
    for t in map(int, args.lengths.split(",")):
      rows = layer_times(t, heads, window, configs)
      span = t if window is None else min(t, window)
      flops = 4 * heads[0] * heads[2] * (t * span - span * (span - 1) / 2)
      floor = flops / PEAK * 1e6
      print(f"heads {heads} t {t} window {window}: floor {floor:.1f} us", flush=True)
      for label, us, diff in rows:
        print(f"  {us:9.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  diff {diff:.1e}  {label}",
              flush=True)
      xla = next((r for r in rows if r[0] == "xla"), None)
      kern = next((r for r in rows if r[0] == "kernel"), None)
      best = min(rows[1:], key=lambda r: r[1]) if len(rows) > 1 else None
      table.append((heads, t, floor, flops, xla, kern, best))
  print("| heads / kv / dim | tokens | window | XLA us | kernel us | XLA / kernel | kernel "
        "TFLOP/s | kernel - XLA | best config |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for heads, t, floor, flops, xla, kern, best in table:
    if xla is None or kern is None:
      print(f"| {heads} | {t} | {window} | failed |")
      continue
    print(f"| {'/'.join(map(str, heads))} | {t} | {window} | {xla[1]:.1f} | {kern[1]:.1f} | "
          f"{xla[1] / kern[1]:.1f} | {flops / kern[1] / 1e6:.0f} | {kern[2]:.1e} | "
          f"{best[1]:.1f} ({best[0]}) |")


def part2(args) -> None:
  import dataclasses  # pylint: disable=g-import-not-at-top
  import s36_kv_cache as s36  # pylint: disable=g-import-not-at-top
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  gfile = s36.typed_model(16, "Q4_K", args.tiny)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype)
  params = llama.fuse_projections(generate.gguf_params(gfile, cfg, None))
  cfg32 = dataclasses.replace(cfg, dtype=jnp.float32)
  original = causal.resolve
  rows = []
  for t in map(int, args.lengths.split(",")):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, min(1000, cfg.vocab_size),
                                                           (1, t)), jnp.int32)
    times, logits = {}, {}
    with jax.default_matmul_precision("highest"):  # float32 XLA attention: the yardstick
      want = np.asarray(llama.prefill(params, tokens, llama.init_cache(cfg32, 1, t),
                                      cfg=cfg32)[0][0])
    for impl in ("xla", None):
      causal.resolve = (lambda dtype, implementation, impl=impl:
                        original(dtype, impl or implementation))
      llama.prefill.clear_cache()  # traced again with this attention
      run = lambda p_, x, impl=impl: llama.prefill(  # noqa: E731
          p_, x, llama.init_cache(cfg, 1, t + 1024), cfg=cfg)[0]
      logits[impl] = np.asarray(run(params, tokens)[0])
      times[impl] = devtime.device_time(run, [(params, tokens)], calls=5, warmup=2).us
    causal.resolve = original
    llama.prefill.clear_cache()
    err = {k: float(np.abs(v - want).max() / np.abs(want).max()) for k, v in logits.items()}
    rows.append((t, times["xla"], times[None], err["xla"], err[None]))
    print(f"prompt {t}: XLA attention {times['xla']:.0f} us, kernel {times[None]:.0f} us; "
          f"logits against float32: {err['xla']:.1e} / {err[None]:.1e}", flush=True)
  print("| prompt tokens | XLA attention us | kernel us | ratio | bf16 logits - float32 "
        "model, XLA / kernel |")
  print("| --- | --- | --- | --- | --- |")
  for t, before, after, e_xla, e_kernel in rows:
    print(f"| {t} | {before:.0f} | {after:.0f} | {before / after:.2f} | {e_xla:.1e} / "
          f"{e_kernel:.1e} |")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--lengths", default="512,1024,4096,8192")
  p.add_argument("--window", type=int, default=0, help="a sliding window (0: none)")
  p.add_argument("--configs", action="store_true", help="also time a sweep of configs")
  p.add_argument("--model", action="store_true", help="part 2: llama.prefill of a model")
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
