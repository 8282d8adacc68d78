"""Session 45: INT4 with integer zero points and f16 scales (AWQ's / GPTQ's form) on the
Hopper wgmma kernel, against the route such weights took before (Int4Weight: GEMV at one
row, Triton tiles above) and against symmetric bf16-scale Int4NKWeight and bf16.

Device time from the profiler trace (qjax._src.devtime), weights rotated past the L2, floor
= the call's bytes (codes, scales, zero points, x, y) over the measured copy bandwidth.
Run on a Hopper GPU: ``python docs/experiments/s45_zero_points.py [--m 1,16,256]``.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import qjax
from qjax._src import bench
from qjax._src import devtime

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))


def awq_like(k, n, key, group=128):
  """A random Int4Weight with uint8 zero points and f16 scales (AWQ's form)."""
  kc, ks, kz = jax.random.split(key, 3)
  codes = jax.random.bits(kc, (k // 8, n), jnp.uint32)
  scales = (jax.random.uniform(ks, (k // group, n), jnp.float32, 0.5, 1.5) / 64).astype(
      jnp.float16)
  zeros = jax.random.randint(kz, (k // group, n), 0, 16).astype(jnp.uint8)
  return qjax.Int4Weight(codes=codes, scales=scales, zeros=zeros, shape=(k, n),
                         group_size=group)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--m", default="1,16,256", help="comma-separated rows of x")
  p.add_argument("--calls", type=int, default=20)
  args = p.parse_args()
  ms = [int(v) for v in args.m.split(",")]
  bw = bench.measure_copy_bandwidth()
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {bw / 1e12:.3f} TB/s")
  head = (f"{'M':>5} {'K x N':>12} | {'awq Int4W':>9} {'awq NK':>8} {'sym NK':>8} {'bf16':>8}"
          f" | {'floor':>6} {'NK %fl':>6} {'NK/Int4W':>8} {'NK x bf16':>9}")
  print(head)
  print("-" * len(head))
  mm = jax.jit(qjax.matmul)
  for k, n in SHAPES:
    sets = max(3, int(np.ceil(4 * bench.L2_BYTES / (k * n // 2))))
    keys = jax.random.split(jax.random.key(k + n), sets)
    awq = [awq_like(k, n, kk) for kk in keys]
    awq_nk = [qjax.to_int4_nk(w) for w in awq]
    sym_nk = [bench.random_weight("int4nk", k, n, kk) for kk in keys]
    dense = [jax.random.normal(kk, (k, n), jnp.bfloat16) for kk in keys[:max(3, sets // 4)]]
    for m in ms:
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      t = {}
      for name, ws, fn in (("awq", awq, mm), ("awq_nk", awq_nk, mm), ("sym_nk", sym_nk, mm),
                           ("bf16", dense, jax.jit(jnp.dot))):
        t[name] = devtime.device_time(fn, [(x, w) for w in ws], calls=args.calls).us
      # the NK kernel's output must match the Int4Weight route's (same weight)
      y0 = np.asarray(mm(x, awq[0]).astype(jnp.float32))
      y1 = np.asarray(mm(x, awq_nk[0]).astype(jnp.float32))
      err = np.abs(y1 - y0).max() / np.sqrt(np.mean(y0 ** 2))
      floor_b = awq_nk[0].nbytes + x.nbytes + m * n * 2
      floor = floor_b / bw * 1e6
      print(f"{m:5d} {k:>5}x{n:<6} | {t['awq']:9.1f} {t['awq_nk']:8.1f} {t['sym_nk']:8.1f} "
            f"{t['bf16']:8.1f} | {floor:6.1f} {100 * floor / t['awq_nk']:5.0f}% "
            f"{t['awq'] / t['awq_nk']:7.2f}x {t['bf16'] / t['awq_nk']:8.2f}x"
            f"  (max |NK - Int4W| / rms {err:.1e}; {qjax.implementation_name(awq_nk[0])})")


if __name__ == "__main__":
  main()
