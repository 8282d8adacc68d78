"""Session 28 (timing only, wrong values): where in a tile's K steps the compute costs
time. QJAX_SKIP_STEPS=lo,hi skips the compute of steps lo..hi-1 (negative: from the end)."""
import os, subprocess, sys
if len(sys.argv) > 1:
  import jax, jax.numpy as jnp
  from qjax._src import bench, devtime
  from pallas_kernels import int4_wgmma as kw
  fmt, k, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
  ws = [bench.random_weight(fmt, k, n, jax.random.key(i)) for i in range(8)]
  x = jnp.ones((m, k), jnp.bfloat16)
  f = kw.int4_nk_matmul if fmt == "int4nk" else kw.fp4_nk_matmul
  fn = jax.jit(lambda a, b: f(a, b))
  r = devtime.device_time(fn, [(x, w) for w in ws], calls=40)
  cfg = kw.default_config(m, ws[0], 132)
  print(f"{fmt} M={m} {k}x{n} skip={os.environ.get('QJAX_SKIP_STEPS', '-'):8s} {r.us:6.2f} us "
        f"(steps {k // cfg.split_k // cfg.tile_k}, stages {cfg.stages})", flush=True)
  sys.exit()
for fmt, k, n, m in [("int4nk", 4096, 14336, 1), ("int4nk", 14336, 4096, 1), ("int4nk", 4096, 14336, 16),
                     ("mxfp4nk", 2880, 11520, 1)]:
  for skip in ["", "0,3", "3,5", "-3,99", "-1,99", "0,99"]:
    env = dict(os.environ)
    if skip:
      env["QJAX_SKIP_STEPS"] = skip
    subprocess.run([sys.executable, __file__, fmt, str(k), str(n), str(m)], env=env, timeout=120)
