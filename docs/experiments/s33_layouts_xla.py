"""Device time of qjax.matmul's XLA path at M = 1 / 16: GPTQ / AWQ / CT as stored (dequantize
W then dot) against the same weight as Int4Weight, and through repack_for_int4_kernel."""
import functools

import jax
import jax.numpy as jnp

import qjax
from qjax._src import checkpoint_layouts as cl
from qjax._src import devtime

for k, n in ((4096, 4096), (4096, 14336), (14336, 4096)):
  w = jax.random.normal(jax.random.key(0), (k, n)) / 64
  w4 = qjax.quantize(w, group_size=128, symmetric=True, scale_dtype=jnp.float16)
  lays = {"int4": w4, "gptq": cl.GPTQWeight.from_int4(w4, zero_point_version=2),
          "awq": cl.AWQWeight.from_int4(qjax.quantize(w, group_size=128, symmetric=False, scale_dtype=jnp.float16)),
          "ct": cl.CompressedTensorsWeight.from_int4(w4)}
  for m in (1, 16):
    x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
    row = []
    for name, lw in lays.items():
      f = jax.jit(functools.partial(qjax.matmul, implementation="xla"))
      t = devtime.device_time(f, [(x, lw)], calls=20).us
      row.append(f"{name} {t:.1f}")
      if name != "int4":
        def via(x_, w_):
          x2, w4_ = cl.repack_for_int4_kernel(x_, w_)
          return qjax.matmul(x2, w4_, implementation="xla")
        t2 = devtime.device_time(jax.jit(via), [(x, lw)], calls=20).us
        row.append(f"{name}->int4 {t2:.1f}")
    print(k, n, m, " | ".join(row), flush=True)
