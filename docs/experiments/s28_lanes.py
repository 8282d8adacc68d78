"""Session 28: k_lanes=2 (four compute warpgroups, lanes taking alternate K steps) against
the default config, M = 1; dense int4nk / mxfp4nk and the MoE at 1 token.
Usage: python s28_lanes.py [smoke]"""
import dataclasses, sys, time
import jax, jax.numpy as jnp, numpy as np
from qjax._src import bench, devtime
from pallas_kernels import int4_wgmma as kw

smoke = "smoke" in sys.argv
def weights(fmt, k, n, copies):
  ws = [bench.random_weight(fmt, k, n, jax.random.key(i)) for i in range(copies)]
  return ws

def fit(cfg, scale):
  xchg = cfg.consumers * cfg.tile_n * cfg.tile_m * 4
  while cfg.stages > 2 and (cfg.stages * cfg.stage_bytes(*scale) + cfg.epilogue_bytes() + xchg
                            > 226 * 1024):
    cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
  return cfg

def variants(base):
  v = {"default": base}
  v["lanes2"] = dataclasses.replace(base, k_lanes=2)
  if base.tile_k == 512:
    v["lanes2_k256"] = dataclasses.replace(base, k_lanes=2, tile_k=256,
                                           stages=base.stages * 2, chain_tiles=base.chain_tiles)
  v["lanes2_st+1"] = dataclasses.replace(base, k_lanes=2, stages=base.stages + 1,
                                         chain_tiles=False)
  return v

import os
shapes = [(1024, 512)] if smoke else [(4096, 14336), (14336, 4096), (8192, 28672)]
fmts = ["int4nk"] if smoke else ["int4nk", "mxfp4nk"]
ms = [int(v) for v in os.environ.get("MS", "16,64").split(",")]
for fmt, m in [(f, m) for m in ms for f in fmts]:
  for k, n in shapes:
    copies = max(2, min(8, int(300e6 // (k * n // 2))))
    ws = weights(fmt, k, n, copies)
    x = jax.random.normal(jax.random.key(99), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(x, np.float64) @ np.asarray(ws[0].dequantize(), np.float64)
    base = kw.default_config(m, ws[0], 132)
    f = kw.fp4_nk_matmul if fmt != "int4nk" else kw.int4_nk_matmul
    scale = (128, 2) if fmt == "int4nk" else (32, 1)
    for name, cfg in variants(base).items():
      try:
        cfg = fit(cfg, scale)
        if cfg.chain_tiles and (k // cfg.split_k // cfg.tile_k) % cfg.stages:
          cfg = dataclasses.replace(cfg, chain_tiles=False)
        fn = jax.jit(lambda a, b, c=cfg: f(a, b, config=c))
        t0 = time.time()
        y = np.asarray(fn(x, ws[0]).astype(jnp.float32), np.float64)
        err = float(np.abs(y - ref).max() / np.abs(ref).max())
        t = devtime.device_time(fn, [(x, w) for w in ws], calls=40)
        print(f"M={m:<3d} {fmt:8s} {k:5d}x{n:<5d} {name:12s} {t.us:7.2f} us  rel.err {err:.1e} "
              f"(first {time.time()-t0:.0f}s) k{cfg.tile_k} s{cfg.stages} sk{cfg.split_k} "
              f"ch{int(cfg.chain_tiles)}", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        print(f"M={m:<3d} {fmt:8s} {k:5d}x{n:<5d} {name:12s} failed: {type(e).__name__}: {str(e)[:300]}",
              flush=True)
