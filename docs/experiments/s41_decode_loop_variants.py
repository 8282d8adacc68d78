"""Session 41: SmolLM2's decode loop (``llama.decode_loop``, 16 steps a call, as
``qjax generate`` runs it) in several variants compiled in one process and timed
alternately (12 rounds of 4 calls each), so the comparison does not cross processes.

  python docs/experiments/s41_decode_loop_variants.py [DEFER:UNROLL ...]

Each variant is ``defer_norm`` (0 / 1, ``LlamaConfig.defer_norm``) and the layers'
``lax.scan`` unroll; default ``0:1 1:1``. Batch 1, 512 slots, from position 100,
temperature 0.7. Prints microseconds per token (median, p10, p90).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from flax_layers import llama
from flax_layers import scan
from qjax._src import generate
from qjax._src import gguf_io

STEPS = 16
_SCAN = scan.scan_layers


def variant(gfile, defer: bool, unroll: int):
  """A call that runs ``STEPS`` decode steps of this variant (compiled on return)."""
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype, defer_norm=defer)
  params = llama.fuse_projections(generate.gguf_params(gfile, cfg, None))

  def run(params, token, pos, cache, key, count, stop):
    decode = functools.partial(llama.decode_step, params, cfg=cfg)
    return llama.decode_loop(decode, token, pos, cache, key, count, stop, max_steps=STEPS,
                             temperature=0.7)

  fn = jax.jit(run, donate_argnums=(3,))  # its own jit: its own trace and compile
  state = [jnp.zeros((1,), jnp.int32), jnp.full((1,), 100, jnp.int32),
           llama.init_cache(cfg, 1, 512), jax.random.key(0)]
  stop = jnp.array([-5], jnp.int32)  # no stop token: every call runs STEPS steps

  def call():
    toks, _, token, _, cache, key = fn(params, *state, jnp.int32(STEPS), stop)
    state[:] = [token, jnp.full((1,), 100, jnp.int32), cache, key]
    return toks

  scan.scan_layers = functools.partial(_SCAN, unroll=unroll)
  try:
    jax.device_get(call())  # traced under this unroll
  finally:
    scan.scan_layers = _SCAN
  return call


def main() -> int:
  specs = [tuple(int(v) for v in s.split(":")) for s in sys.argv[1:]] or [(0, 1), (1, 1)]
  gfile = gguf_io.load_gguf(gguf_io.read_header(generate.default_model_path()),
                            progress=False)
  calls = {s: variant(gfile, bool(s[0]), s[1]) for s in specs}
  times = {s: [] for s in specs}
  for _ in range(12):
    for s, call in calls.items():
      for _ in range(4):
        t0 = time.perf_counter()
        jax.device_get(call())
        times[s].append(time.perf_counter() - t0)
  for s in specs:
    t = sorted(times[s])
    print(f"defer_norm={s[0]} unroll={s[1]}: us/token median "
          f"{statistics.median(t) * 1e6 / STEPS:.1f}, p10 {t[len(t) // 10] * 1e6 / STEPS:.1f}, "
          f"p90 {t[9 * len(t) // 10] * 1e6 / STEPS:.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
