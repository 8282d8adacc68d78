"""Session 28: the fixed cost of the wgmma kernel: device time of tiny problems (one step
per CTA) against XLA's smallest kernels."""
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from qjax._src import bench, devtime
from pallas_kernels import int4_wgmma as kw

def t(fn, args, calls=60):
  return devtime.device_time(jax.jit(fn), args, calls=calls)

x1 = jnp.ones((1, 8), jnp.float32)
r = t(lambda a: a + 1, [(x1,)]); print(f"xla add [1,8]          {r.us:6.2f} us {r.kernels}")
big = jnp.ones((4096, 2048), jnp.uint32)
r = t(lambda a: jnp.sum(a, axis=0), [(big,)]); print(f"xla colsum 32MB        {r.us:6.2f} us")
for fmt, k, n, m in [("int4nk", 512, 128, 1), ("int4nk", 512, 128 * 132, 1),
                     ("int4nk", 4096, 128, 1), ("int4nk", 4096, 128 * 132, 1),
                     ("mxfp4nk", 2880, 128, 1), ("mxfp4nk", 2880, 11520, 1),
                     ("mxfp4nk", 2880, 11520, 16), ("int4nk", 4096, 14336, 1)]:
  ws = [bench.random_weight(fmt, k, n, jax.random.key(i)) for i in range(4)]
  x = jnp.ones((m, k), jnp.bfloat16)
  f = kw.int4_nk_matmul if fmt == "int4nk" else kw.fp4_nk_matmul
  cfg = kw.default_config(m, ws[0], 132)
  variants = {"default": cfg}
  if cfg.split_k > 1:
    variants["unsplit"] = dataclasses.replace(cfg, split_k=1, chain_tiles=False)
  for name, c in variants.items():
    try:
      r = t(lambda a, b, c=c: f(a, b, config=c), [(x, w) for w in ws])
      floor = (k * n // 2) / 3.0e6
      print(f"{fmt:7s} M={m:<2d} {k:5d}x{n:<6d} {name:8s} {r.us:6.2f} us (bytes/3TB/s {floor:5.2f}) "
            f"k{c.tile_k} s{c.stages} sk{c.split_k} kernels={len(r.kernels)}", flush=True)
    except Exception as e:
      print(fmt, k, n, name, "failed", type(e).__name__, str(e)[:200])
