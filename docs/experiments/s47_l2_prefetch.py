"""Session 47: does prefetching the next matmul's weight bytes into L2 close the gaps of a
batch-1 decode step on Hopper?

At batch 1 each wgmma kernel of the Llama-3-8B-shaped stack spends a few microseconds on
launch, pipeline ramp and drain with the memory idle (BENCHMARKS.md sessions 28 and 45):
224 kernels a token take 1.74 ms of device time for 3.6 GB, half the copy bandwidth. Here
each kernel also issues TMA L2 prefetches (``cp.async.bulk.prefetch.tensor``) of the
weight the step multiplies next, either when its memory warpgroup has issued its last
loads ("end") or when it starts ("start"), optionally capped at some bytes. Device time
per step (profiler trace) and tokens/s from wall time, against the same stack without
prefetches; outputs must be bit-identical (the stack's random weights overflow to NaN
over 32 layers, so its "same" reads False; the chain's is the check). The prefetches
are not in the kernel as committed (they did not pay, BENCHMARKS.md session 47): apply
the patch beside this file first, then run on a Hopper GPU:

  git apply docs/experiments/s47-l2-prefetch.patch
  python docs/experiments/s47_l2_prefetch.py [--layers 32] [--calls 20]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels  # noqa: F401  pylint: disable=unused-import  (registers the kernels)
from pallas_kernels import int4_wgmma as kw
from qjax._src import bench
from qjax._src import devtime

HIDDEN, INTER, KV = 4096, 14336, 1024
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
          (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]


def mm(x, w, nxt, at, cap):
  """x @ w through the wgmma kernel, prefetching ``nxt``'s codes (or nothing)."""
  num_sms = jax.devices()[0].core_count
  cfg = kw.default_config(x.shape[0], w, num_sms)
  return kw._run_kernel(x, w, cfg, num_sms, prefetch=nxt, prefetch_at=at,  # pylint: disable=protected-access
                        prefetch_bytes=cap)


def step(h, weights, at, cap):
  """The bench's separate-projection stack; each matmul prefetches the next one's W."""
  order = [w for ws in weights for w in ws]
  nxt = {id(w): (order[i + 1] if at and i + 1 < len(order) else None)
         for i, w in enumerate(order)}
  f = lambda a, w: mm(a, w, nxt[id(w)], at, cap)
  for wq, wk, wv, wo, wg, wu, wd in weights:
    q, k_, v = f(h, wq), f(h, wk), f(h, wv)
    attn = q + jnp.tile(k_ + v, HIDDEN // KV)
    h = h + f(attn, wo)
    h = h + f(jax.nn.silu(f(h, wg)) * f(h, wu), wd)
  return h


def chain(h, ws, at, cap):
  """``len(ws)`` dependent matmuls of one shape (K = N), each prefetching the next W."""
  for i, w in enumerate(ws):
    h = mm(h, w, ws[i + 1] if at and i + 1 < len(ws) else None, at, cap)
  return h


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--variants", default="none,end,start,end:8,end:16,start:8")
  args = p.parse_args()
  bw = bench.measure_copy_bandwidth()
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {bw / 1e12:.3f} TB/s")
  variants = []
  for v in args.variants.split(","):
    at, _, mb = v.partition(":")
    variants.append((v, None if at == "none" else at, int(mb) << 20 if mb else None))

  # Chains of one square shape: 8 dependent 4096x4096 matmuls (8.4 MB each).
  key = jax.random.key(0)
  sq = [bench.random_weight("int4nk", HIDDEN, HIDDEN, jax.random.fold_in(key, i))
        for i in range(8)]
  x = jax.random.normal(key, (1, HIDDEN), jnp.bfloat16)
  floor = sum(w.nbytes for w in sq) / bw * 1e6
  ref = None
  print(f"chain of 8 x 4096x4096 int4nk (floor {floor:.1f} us)")
  for name, at, cap in variants:
    fn = jax.jit(lambda a, ws, at=at, cap=cap: chain(a, ws, at, cap))
    y = np.asarray(fn(x, sq).astype(jnp.float32))
    ref = y if ref is None else ref
    same = np.array_equal(y, ref)
    t = devtime.device_time(fn, [(x, sq)], calls=args.calls, warmup=2).us
    print(f"  {name:>8}: {t:7.1f} us  {floor / t:5.1%} of floor  same={same}")

  weights = []
  for layer in range(args.layers):
    lk = jax.random.fold_in(key, 100 + layer)
    weights.append([bench.random_weight("int4nk", k, n, jax.random.fold_in(lk, i))
                    for i, (k, n) in enumerate(SHAPES)])
  gb = sum(w.nbytes for ws in weights for w in ws) / 1e9
  floor_ms = gb * 1e9 / bw * 1e3
  print(f"stack of {args.layers} layers, {gb:.2f} GB (floor {floor_ms:.3f} ms a token)")
  h0 = jax.random.normal(key, (1, HIDDEN), jnp.float32).astype(jnp.bfloat16) * 0.01
  ref = None
  for name, at, cap in variants:
    fn = jax.jit(lambda a, ws, at=at, cap=cap: step(a, ws, at, cap))
    y = np.asarray(fn(h0, weights).astype(jnp.float32))
    ref = y if ref is None else ref
    same = np.array_equal(y, ref)
    h = h0
    t0 = time.perf_counter()
    for _ in range(args.calls):
      h = fn(h, weights)
    jax.block_until_ready(h)
    tok_s = args.calls / (time.perf_counter() - t0)
    dev = devtime.device_time(fn, [(h0, weights)], calls=5, warmup=1).us / 1e3
    print(f"  {name:>8}: {tok_s:7.1f} tok/s, device {dev:.3f} ms "
          f"({floor_ms / dev:5.1%} of floor)  same={same}")


if __name__ == "__main__":
  main()
