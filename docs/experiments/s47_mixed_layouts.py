"""Session 47: which layout per shape makes the batch-1 decode stack fastest by wall time?

``qjax.kernel_layouts`` moves every INT4 weight to the Hopper wgmma kernel's layout
(Int4NKWeight) by device time; its Mosaic GPU launches stay outside XLA's command buffers
(session 30), where the Triton GEMV's (Int4Weight at M = 1) are captured. At batch 1 the
GEMV is about as fast on the small matrices (H200, session 44: 4096x4096 6.2 against 6.3
us). Here the Llama-3-8B-shaped stack of ``qjax bench --model`` with each weight left as
Int4Weight or converted depending on its size: tokens/s from wall time and device time
per token, against bf16. Run on a Hopper GPU:

  python docs/experiments/s47_mixed_layouts.py [--layers 32] [--calls 50]
"""

import argparse
import time

import jax
import jax.numpy as jnp

import pallas_kernels  # noqa: F401  pylint: disable=unused-import  (registers the kernels)
import qjax
from qjax._src import bench
from qjax._src import devtime

HIDDEN, INTER, KV = 4096, 14336, 1024


def shapes(fused):
  if fused:
    return [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]
  return [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
          (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]


def step(h, weights, fused, mm):
  """The bench's stack (``bench.llama_stack_tokens_per_s``), unrolled."""
  for w in weights:
    if fused:
      wqkv, wo, wgu, wd = w
      q, k_, v = jnp.split(mm(h, wqkv), [HIDDEN, HIDDEN + KV], axis=-1)
    else:
      wq, wk, wv, wo, wg, wu, wd = w
      q, k_, v = mm(h, wq), mm(h, wk), mm(h, wv)
    h = h + mm(q + jnp.tile(k_ + v, HIDDEN // KV), wo)
    if fused:
      gate, up = jnp.split(mm(h, wgu), 2, axis=-1)
    else:
      gate, up = mm(h, wg), mm(h, wu)
    h = h + mm(jax.nn.silu(gate) * up, wd)
  return h


def rate(fn, h0, ws, calls):
  """(tokens/s from wall time, device ms a token)."""
  jax.block_until_ready(fn(h0, ws))
  h = h0
  t0 = time.perf_counter()
  for _ in range(calls):
    h = fn(h, ws)
  jax.block_until_ready(h)
  tok_s = calls / (time.perf_counter() - t0)
  return tok_s, devtime.device_time(fn, [(h0, ws)], calls=5, warmup=1).us / 1e3


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--calls", type=int, default=50)
  p.add_argument("--min-nk", default="0,16777216,100000000",
                 help="K*N from which a weight is converted (one variant each)")
  args = p.parse_args()
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
  key = jax.random.key(2)
  h0 = jax.random.normal(key, (1, HIDDEN), jnp.float32).astype(jnp.bfloat16) * 0.01
  for fused in (False, True):
    ss = shapes(fused)
    qws = [[bench.random_weight("int4", k, n, jax.random.fold_in(jax.random.fold_in(key, l), i))
            for i, (k, n) in enumerate(ss)] for l in range(args.layers)]
    bws = [[(jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, 1000 + l), i),
                               (k, n), jnp.float32) / 64).astype(jnp.bfloat16)
            for i, (k, n) in enumerate(ss)] for l in range(args.layers)]
    name = "fused" if fused else "separate"
    bf = rate(jax.jit(lambda h, w: step(h, w, fused, jnp.dot)), h0, bws, args.calls)
    print(f"{name:>8} bf16: {bf[0]:7.1f} tok/s, device {bf[1]:.3f} ms")
    del bws
    for min_nk in [int(v) for v in args.min_nk.split(",")]:
      ws = [[qjax.kernel_layouts(w) if w.shape[0] * w.shape[1] >= min_nk else w for w in lw]
            for lw in qws]
      kinds = sorted({f"{type(w).__name__}:{w.shape[0]}x{w.shape[1]}" for w in ws[0]})
      r = rate(jax.jit(lambda h, w: step(h, w, fused, qjax.matmul)), h0, ws, args.calls)
      print(f"{name:>8} int4, NK from K*N >= {min_nk}: {r[0]:7.1f} tok/s ({r[0] / bf[0]:.2f}x"
            f" bf16), device {r[1]:.3f} ms ({bf[1] / r[1]:.2f}x)  {' '.join(kinds)}")
      del ws


if __name__ == "__main__":
  main()
