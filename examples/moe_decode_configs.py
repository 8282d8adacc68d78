"""Hopper's wgmma MoE kernel at decode sizes: device time of the default configuration
(``int4_wgmma.moe_config_for``) against a few others, each output compared with the
default's, and the kernels each call runs (BENCHMARKS.md, session 25: one token was two
kernels, the second a broadcast of its all-zero row table). GPU only (Hopper).

  python examples/moe_decode_configs.py [--tokens 1,4] [--experts 128] [--default-only]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels  # pylint: disable=unused-import  (registers the kernels)
from pallas_kernels import int4_wgmma as kw
from qjax._src import bench
from qjax._src import devtime
from qjax._src import fp4_nk
from qjax._src import moe

# (tile_k, stages) tried besides the default, unchained; then K splits, and wgmma for mma.sync.
_STEPS = ((192, 3), (320, 2), (320, 4), (576, 2), (192, 4))


def _variants(base: kw.WgmmaConfig) -> dict[str, kw.WgmmaConfig]:
  out = {"default": base}
  for tk, st in _STEPS:
    out[f"k{tk}s{st}"] = dataclasses.replace(base, tile_k=tk, stages=st, chain_tiles=False)
  out["split3"] = dataclasses.replace(base, split_k=3, tile_k=320, stages=3, chain_tiles=True)
  out["split5"] = dataclasses.replace(base, split_k=5, tile_k=192, stages=3, chain_tiles=True)
  out["wgmma"] = dataclasses.replace(base, mma_sync=False)
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", default="1,4", help="comma-separated token counts (default 1,4)")
  p.add_argument("--experts", type=int, default=128, help="MXFP4 experts (default 128)")
  p.add_argument("--k", type=int, default=2880, help="expert K (default 2880, GPT-OSS)")
  p.add_argument("--n", type=int, default=2880, help="expert N (default 2880)")
  p.add_argument("--top-k", type=int, default=4, help="experts per token (default 4)")
  p.add_argument("--calls", type=int, default=24,
                 help="timed calls, one routing each (default %(default)s)")
  p.add_argument("--default-only", action="store_true", help="time the default config only")
  args = p.parse_args()
  if not kw.supported(jax.devices()[0]):
    p.error(f"needs an NVIDIA Hopper GPU (sm_90); this is {jax.devices()[0].device_kind}")

  w = bench.random_experts(args.experts, args.k, args.n, jax.random.key(0))
  wn = jax.jit(fp4_nk.to_mxfp4_nk)(w)
  for tokens in map(int, args.tokens.split(",")):
    x = jax.random.normal(jax.random.key(1), (tokens, args.k), jnp.float32).astype(jnp.bfloat16)
    id_sets = [bench._distinct_ids(jax.random.key(10 + i), tokens, args.experts, args.top_k)  # pylint: disable=protected-access
               for i in range(args.calls)]
    pairs = tokens * args.top_k
    base = kw.moe_config_for(pairs, args.experts, args.k, args.n, "mxfp4")
    print(f"tokens {tokens}: default {base}", flush=True)

    def run(cfg):
      def f(x_, w_, ids):  # the pairs' rows as moe_matmul passes them
        pair_rows = moe._pair_rows(tokens, args.top_k, shared_row=True)  # pylint: disable=protected-access
        return kw.fp4_nk_moe_matmul(x_, w_, pair_rows, ids.reshape(-1), config=cfg)
      return jax.jit(f)

    ref = np.asarray(run(base)(x, wn, id_sets[0]).astype(jnp.float32))
    variants = {"default": base} if args.default_only else _variants(base)
    for name, cfg in variants.items():
      try:
        fn = run(cfg)
        y = np.asarray(fn(x, wn, id_sets[0]).astype(jnp.float32))
        t = devtime.device_time(fn, [(x, wn, ids) for ids in id_sets], calls=args.calls)
      except (NotImplementedError, ValueError) as e:  # a config the kernel declines
        print(f"  {name:8s} declined: {e}", flush=True)
        continue
      diff = float(np.abs(y - ref).max() / np.abs(ref).max())
      print(f"  {name:8s} {t.us:7.2f} us  max|y - default| / max|default| {diff:.1e}  "
            f"kernels: {', '.join(t.kernels)}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
