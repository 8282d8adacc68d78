"""Session 39: ``qjax.causal_attention`` from an offset over a longer cache (what
``llama.extend`` runs per layer: a next turn, a prompt in chunks), XLA against the kernel.

Queries at positions ``s - t .. s - 1`` over ``s`` keys (heads 32 / 8 of 128, batch 1,
bf16); device time per call from the profiler trace, and the largest difference of the
kernel's output from the XLA path's, relative to the largest output.

  python docs/experiments/s39_extend_attention.py [--cases 128x4096,512x4096,...]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import qjax
from qjax._src import devtime


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cases", default="128x4096,512x4096,1024x8192,2048x16384",
                 help="comma-separated QUERIESxKEYS")
  p.add_argument("--heads", default="32,8,128", help="HEADS,KV_HEADS,HEAD_DIM")
  args = p.parse_args()
  h, kvh, d = (int(x) for x in args.heads.split(","))
  gpu = jax.default_backend() == "gpu"
  impls = ("xla", "pallas") if gpu else ("xla", "interpret")
  print("| queries | keys | offset | xla us | kernel us | xla / kernel | max diff |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for case in args.cases.split(","):
    t, s = (int(x) for x in case.split("x"))
    sets = []
    for i in range(3):
      kq, kk, kv = jax.random.split(jax.random.key(i), 3)
      sets.append((jax.random.normal(kq, (1, t, h, d), jnp.bfloat16),
                   jax.random.normal(kk, (1, s, kvh, d), jnp.bfloat16),
                   jax.random.normal(kv, (1, s, kvh, d), jnp.bfloat16)))
    us, outs = {}, {}
    for impl in impls:
      fn = jax.jit(lambda q, k, v, impl=impl: qjax.causal_attention(
          q, k, v, offset=s - t, implementation=impl))
      outs[impl] = np.asarray(fn(*sets[0]), np.float32)
      us[impl] = devtime.device_time(fn, sets, calls=10).us
    diff = np.abs(outs[impls[1]] - outs["xla"]).max() / np.abs(outs["xla"]).max()
    print(f"| {t} | {s} | {s - t} | {us['xla']:.1f} | {us[impls[1]]:.1f} | "
          f"{us['xla'] / us[impls[1]]:.1f}x | {diff:.1e} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
