"""Session 46: INT4 experts (GPTQ / AWQ form) on Hopper's grouped wgmma MoE kernel
(``int4_wgmma.int4_nk_moe_matmul``): the default configuration (``moe_default_config``)
and variants of it, against the route INT4 experts take otherwise (``Int4Weight``: the
per-pair GEMV / grouped Triton kernels that ``qjax.moe_matmul`` picks).

Per token count: device time from the profiler trace (``qjax._src.devtime``) over rotated
routings (a fresh one per call, so the experts are mostly not in L2), each variant's output
compared with the Int4Weight route's; floor = the distinct selected experts' bytes (codes,
scales, zero points), x and y over the measured copy bandwidth. Run on a Hopper GPU:

  python docs/experiments/s46_int4_moe.py [--shape 2048x768] [--experts 128] [--top-k 8]
      [--tokens 1,4,16,64] [--zero-points] [--variants] [--route per_pair]
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels  # noqa: F401  pylint: disable=unused-import  (registers the kernels)
import qjax
from pallas_kernels import int4_wgmma as kw
from qjax._src import bench
from qjax._src import devtime
from qjax._src import moe


def experts(e, k, n, key, zero_points):
  """``e`` random INT4 experts of group 128: bf16 scales, or f16 scales and uint8 zero
  points (AWQ's form)."""
  kc, ks, kz = jax.random.split(key, 3)
  codes = jax.random.bits(kc, (e, k // 8, n), jnp.uint32)
  scales = jax.random.uniform(ks, (e, k // 128, n), jnp.float32, 0.5, 1.5) / 64
  zeros = None
  if zero_points:
    zeros = jax.random.randint(kz, (e, k // 128, n), 0, 16).astype(jnp.uint8)
  return qjax.Int4Weight(codes=codes, zeros=zeros, shape=(k, n), group_size=128,
                         scales=scales.astype(jnp.float16 if zero_points else jnp.bfloat16))


def variants(base):
  """The default and a few neighbours: K steps and stages, K splits, chaining, wgmma in
  place of mma.sync."""
  out = {"default": base}
  for tk, st, sk in ((128, 4, base.split_k), (256, 4, base.split_k), (512, 3, base.split_k),
                     (256, 2, 1), (256, 4, 1), (512, 2, 1), (128, 4, 2), (256, 2, 2)):
    for chain in (False, True):
      out[f"k{tk}s{st}x{sk}{'c' if chain else ''}"] = dataclasses.replace(
          base, tile_k=tk, stages=st, split_k=sk, chain_tiles=chain)
  if base.mma_sync:
    out["wgmma"] = dataclasses.replace(base, mma_sync=False)
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="2048x768", help="expert K x N (default Qwen3-30B-A3B's)")
  p.add_argument("--experts", type=int, default=128)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--tokens", default="1,4,16,64")
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--zero-points", action="store_true", help="f16 scales and zero points")
  p.add_argument("--variants", action="store_true", help="time the variants too")
  p.add_argument("--route", choices=("auto", "per_pair", "grouped"), default="auto",
                 help="a row tile per pair, or pairs grouped by expert (default: "
                 "int4_wgmma.per_pair_route's rule)")
  args = p.parse_args()
  if args.route != "auto":
    kw.per_pair_route = lambda pairs, w: args.route == "per_pair"
  k, n = map(int, args.shape.split("x"))
  bw = bench.measure_copy_bandwidth()
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {bw / 1e12:.3f} "
        f"TB/s; {args.experts} experts of {k}x{n}, top-{args.top_k}, "
        f"{'zero points + f16' if args.zero_points else 'symmetric bf16'} scales")
  w = experts(args.experts, k, n, jax.random.key(0), args.zero_points)
  wn = jax.jit(qjax.to_int4_nk)(w)
  per_expert = wn.nbytes // args.experts
  for tokens in map(int, args.tokens.split(",")):
    x = jax.random.normal(jax.random.key(tokens), (tokens, k), jnp.bfloat16)
    ids = [bench._distinct_ids(jax.random.key(100 + i), tokens, args.experts, args.top_k)  # pylint: disable=protected-access
           for i in range(max(args.calls, 12))]
    distinct = np.mean([len(set(np.asarray(i).reshape(-1).tolist())) for i in ids])
    floor = (distinct * per_expert + x.nbytes + tokens * args.top_k * n * 2) / bw * 1e6
    old = jax.jit(qjax.moe_matmul)
    ref = np.asarray(old(x, w, ids[0]).astype(jnp.float32))
    t_old = devtime.device_time(old, [(x, w, i) for i in ids], calls=args.calls).us
    pairs = tokens * args.top_k
    base = kw.moe_default_config(pairs, wn)
    print(f"T={tokens}: floor {floor:.1f} us; Int4Weight route "
          f"({moe.moe_implementation_name(w, None, pairs)}) {t_old:.1f} us; default {base}")
    for name, cfg in (variants(base) if args.variants else {"default": base}).items():
      def fn(a, b, c, cfg=cfg):
        pair_rows = jnp.arange(pairs, dtype=jnp.int32) // args.top_k
        return kw.int4_nk_moe_matmul(a, b, pair_rows, c.reshape(-1), config=cfg).reshape(
            tokens, args.top_k, -1)
      try:
        f = jax.jit(fn)
        y = np.asarray(f(x, wn, ids[0]).astype(jnp.float32))
        t = devtime.device_time(f, [(x, wn, i) for i in ids], calls=args.calls).us
      except (NotImplementedError, ValueError) as e:
        print(f"  {name:12s} declined: {str(e)[:90]}")
        continue
      diff = float(np.abs(y - ref).max() / np.abs(ref).max())
      print(f"  {name:12s} {t:7.1f} us  {t / floor:5.2f}x floor  {t_old / t:5.2f}x faster "
            f"than Int4Weight  max|dy|/max|y| {diff:.1e}", flush=True)


if __name__ == "__main__":
  main()
