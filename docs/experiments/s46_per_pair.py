"""Session 46: where Hopper's wgmma MoE kernel should stop giving each (token, expert) pair a
row tile of its own and group the pairs by expert (``int4_wgmma.per_pair_route``'s rule).

The per-pair route reads an expert once per pair that selects it but runs no routing; the
grouped one reads each selected expert once, after XLA's routing kernels (tile slots, row
gathers). Per expert shape and token count: device time of both routes through
``qjax.moe_matmul`` (profiler trace, rotated routings), the floor of the distinct selected
experts' bytes. Run on a Hopper GPU:

  python docs/experiments/s46_per_pair.py [--calls 10]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels  # noqa: F401  pylint: disable=unused-import  (registers the kernels)
import qjax
from pallas_kernels import int4_wgmma as kw
from qjax._src import bench
from qjax._src import devtime

# (format, experts, K, N, top-k, token counts)
CASES = [
    ("mxfp4", 128, 2880, 2880, 4, (4, 8, 16, 32)),   # GPT-OSS-120B's experts
    ("mxfp4", 32, 2880, 2880, 4, (4, 8, 16)),        # GPT-OSS-20B's
    ("int4", 128, 2048, 768, 8, (4, 8, 16, 32, 64)),  # Qwen3-30B-A3B's gate / up
    ("int4", 128, 768, 2048, 8, (8, 16, 32)),         # ... and down
    ("int4", 8, 4096, 14336, 2, (4, 8, 16)),          # Mixtral-8x7B's
]


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", type=int, default=10)
  args = p.parse_args()
  bw = bench.measure_copy_bandwidth()
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {bw / 1e12:.3f} TB/s")
  print(f"{'fmt':>5} {'E':>4} {'K x N':>11} {'top':>3} {'T':>3} {'pairs':>5} {'sel':>6} |"
        f" {'per-pair':>8} {'grouped':>8} {'floor':>6} | {'pp/fl':>5} {'gr/fl':>5}")
  default_rule = kw.per_pair_route
  for fmt, e, k, n, top_k, tokens_list in CASES:
    w = bench.random_experts(e, k, n, jax.random.key(0), fmt)
    wn = jax.jit(qjax.to_mxfp4_nk if fmt == "mxfp4" else qjax.to_int4_nk)(w)
    per_expert = wn.nbytes // e
    for tokens in tokens_list:
      x = jax.random.normal(jax.random.key(tokens), (tokens, k), jnp.bfloat16)
      ids = [bench._distinct_ids(jax.random.key(100 + i), tokens, e, top_k)  # pylint: disable=protected-access
             for i in range(max(args.calls, 12))]
      sel = np.mean([len(set(np.asarray(i).reshape(-1).tolist())) for i in ids])
      floor = (sel * per_expert + x.nbytes + tokens * top_k * n * 2) / bw * 1e6
      t = {}
      for route in ("per-pair", "grouped"):
        kw.per_pair_route = lambda pairs, w, route=route: route == "per-pair"
        jax.clear_caches()  # moe_matmul's kernel call is jitted: trace the route anew
        fn = jax.jit(lambda a, b, c: qjax.moe_matmul(a, b, c,
                                                     implementation="pallas:mosaic_gpu_wgmma"))
        t[route] = devtime.device_time(fn, [(x, wn, i) for i in ids], calls=args.calls).us
      kw.per_pair_route = default_rule
      print(f"{fmt:>5} {e:4d} {f'{k}x{n}':>11} {top_k:3d} {tokens:3d} {tokens * top_k:5d} "
            f"{sel:6.1f} | {t['per-pair']:8.1f} {t['grouped']:8.1f} {floor:6.1f} | "
            f"{t['per-pair'] / floor:5.2f} {t['grouped'] / floor:5.2f}", flush=True)


if __name__ == "__main__":
  main()
