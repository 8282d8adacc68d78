"""Session 42: SmolLM2's decode loop (``llama.decode_loop``, 16 steps a call, as ``qjax
generate`` runs it) with the decode step's cache write and attention joined in one kernel
(``qjax.write_and_decode_attention``) against the two apart (``qjax.write_kv_cache`` then
``qjax.decode_attention``, as before), compiled in one process and timed alternately
(12 rounds of 4 calls each), so the comparison does not cross processes.

  python docs/experiments/s42_decode_write.py [--slots N] [--samplers T:P,..]
      [--steps N,..] [VARIANT ...]

Variants: ``joined`` (the library as it is), ``apart`` (the two operations), ``joinedS``
for a number S (the joined kernel with S splits of the slots a sequence and KV head; 1:
no combine), ``sorted`` (the library with session 41's sampler, which sorted the whole
vocabulary for every sampled token). Default: ``joined apart``. Batch 1, from position
100; ``--samplers``: the temperatures and top-p masses each variant samples with
(default 0.7:1.0).
Prints microseconds per token (median, p10, p90).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import qjax
from flax_layers import llama
from pallas_kernels import decode_attention as kernel
from qjax._src import generate
from qjax._src import gguf_io

STEPS = 16


def _apart(q, k, v, k_cache, v_cache, positions, mask, *, layer=None, sinks=None,
           scale=None, implementation=None):
  """The two operations apart, as the layers called them before."""
  k_cache, v_cache = qjax.write_kv_cache(k_cache, v_cache, k[:, None], v[:, None],
                                         positions[:, None], layer=layer,
                                         implementation=implementation)
  out = qjax.decode_attention(q, k_cache, v_cache, mask, layer=layer, sinks=sinks,
                              scale=scale, implementation=implementation)
  return out, k_cache, v_cache


@jax.jit
def _sorted_sampler(logits, key, temperature, top_p):
  """Session 41's ``llama._sample_top_p``: the vocabulary sorted for every draw."""
  logits = logits.astype(jnp.float32) / temperature
  order = jnp.argsort(-logits, axis=-1)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
  choice = jax.random.categorical(key, sorted_logits, axis=-1)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@contextlib.contextmanager
def _patched(name: str):
  """The variant's code while its loop traces."""
  saved = (qjax.write_and_decode_attention, kernel._launch_shape, llama._sample_top_p)
  if name == "apart":
    qjax.write_and_decode_attention = _apart
  elif name == "sorted":
    llama._sample_top_p = _sorted_sampler
  elif name != "joined":
    splits = int(name.removeprefix("joined"))
    kernel._launch_shape = lambda q, kc, config: saved[1](
        q, kc, config or kernel.AttentionConfig(splits=splits))
  try:
    yield
  finally:
    qjax.write_and_decode_attention, kernel._launch_shape, llama._sample_top_p = saved


def variant(gfile, name: str, slots: int, temperature: float = 0.7, top_p: float = 1.0,
            steps: int = STEPS):
  """A call that runs ``steps`` decode steps of this variant (compiled on return)."""
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype)
  params = llama.fuse_projections(generate.gguf_params(gfile, cfg, None))

  def run(params, token, pos, cache, key, count, stop):
    decode = functools.partial(llama.decode_step, params, cfg=cfg)
    return llama.decode_loop(decode, token, pos, cache, key, count, stop, max_steps=steps,
                             temperature=temperature, top_p=top_p)

  fn = jax.jit(run, donate_argnums=(3,))  # its own jit: its own trace and compile
  state = [jnp.zeros((1,), jnp.int32), jnp.full((1,), 100, jnp.int32),
           llama.init_cache(cfg, 1, slots), jax.random.key(0)]
  stop = jnp.array([-5], jnp.int32)  # no stop token: every call runs `steps` steps

  def call():
    toks, _, token, _, cache, key = fn(params, *state, jnp.int32(steps), stop)
    state[:] = [token, jnp.full((1,), 100, jnp.int32), cache, key]
    return toks

  with _patched(name):
    jax.device_get(call())  # traced under this variant
  return call


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--slots", type=int, default=512, help="the KV cache's slots")
  parser.add_argument("--samplers", default="0.7:1.0",
                      help="TEMPERATURE:TOP_P pairs, comma-separated (each variant runs each)")
  parser.add_argument("--steps", default=str(STEPS),
                      help="decode steps a call, comma-separated (each variant runs each)")
  parser.add_argument("variants", nargs="*", default=["joined", "apart"])
  args = parser.parse_args()
  gfile = gguf_io.load_gguf(gguf_io.read_header(generate.default_model_path()),
                            progress=False)
  samplers = [tuple(float(v) for v in s.split(":")) for s in args.samplers.split(",")]
  counts = [int(v) for v in args.steps.split(",")]
  calls = {(f"{s} T={t} top_p={p} steps={n}", n): variant(gfile, s, args.slots, t, p, n)
           for s in args.variants for t, p in samplers for n in counts}
  times = {s: [] for s in calls}
  for _ in range(12):
    for s, call in calls.items():
      for _ in range(4):
        t0 = time.perf_counter()
        jax.device_get(call())
        times[s].append(time.perf_counter() - t0)
  for (s, n), t in times.items():
    t = sorted(t)
    print(f"{s} ({args.slots} slots): us/token median "
          f"{statistics.median(t) * 1e6 / n:.1f}, p10 {t[len(t) // 10] * 1e6 / n:.1f}, "
          f"p90 {t[9 * len(t) // 10] * 1e6 / n:.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
