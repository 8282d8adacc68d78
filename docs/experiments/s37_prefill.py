"""Session 37: prefill attending to the prompt alone (``llama.Llama(cfg, fresh_prompt=True)``,
what ``llama.prefill`` runs now) against attending to the layer's whole cache (before).

The Llama-3.2-1B-shaped Q4_K model of s36_kv_cache.py (projections joined), one prompt of
``T`` tokens at positions 0 .. T - 1 into a cache of ``T + 1024`` slots (what ``qjax
generate --max-new-tokens 1024`` sizes): device time per call from the profiler trace
(wall time on the CPU).

  python docs/experiments/s37_prefill.py [--lengths 128,1024,4096] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from flax_layers import llama
from qjax._src import devtime
from qjax._src import generate

sys.path.insert(0, os.path.dirname(__file__))


def main() -> int:
  import s36_kv_cache as s36  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--lengths", default="128,1024,4096")
  p.add_argument("--tiny", action="store_true", help="a 256-wide model (CPU smoke)")
  args = p.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  gfile = s36.typed_model(16, "Q4_K", args.tiny)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype)
  params = llama.fuse_projections(generate.gguf_params(gfile, cfg, None))
  rows = []
  for t in map(int, args.lengths.split(",")):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (1, t)), jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    cache = llama.init_cache(cfg, 1, t + 1024)
    times = {}
    for fresh in (False, True):
      run = jax.jit(lambda p_, x, c, fresh=fresh: llama.Llama(cfg, fresh_prompt=fresh).apply(
          p_, x, positions, c)[0][:, -1])
      times[fresh] = devtime.device_time(run, [(params, tokens, cache)], calls=5,
                                         warmup=2).us
    rows.append((t, times[False], times[True]))
    print(f"prompt {t}: whole cache {times[False]:.0f} us, prompt alone {times[True]:.0f} us",
          flush=True)
  print("| prompt tokens | cache slots | whole cache us | prompt alone us | ratio |")
  print("| --- | --- | --- | --- | --- |")
  for t, before, after in rows:
    print(f"| {t} | {t + 1024} | {before:.0f} | {after:.0f} | {before / after:.2f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
