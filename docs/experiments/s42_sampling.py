"""Session 42: what nucleus sampling costs on the GPU, one token at a time, as the decode
loop samples: a ``lax.fori_loop`` of 16 draws from ``[1, vocab]`` float32 logits (each
step's logits shifted by the last token, so no draw can be hoisted), wall time per draw.

  python docs/experiments/s42_sampling.py [--vocab N]

Rows: greedy (argmax), ``llama.sample`` at top-p 0.9 (a full argsort of the vocabulary),
``lax.top_k`` for several k alone, and a categorical draw over the whole vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from flax_layers import llama


def timed(draw, logits, key, rounds: int = 30) -> float:
  """Median us per draw of 16 draws in one jitted loop."""

  @jax.jit
  def run(logits, key):
    def body(i, carry):
      tok, key = carry
      key, sub = jax.random.split(key)
      return draw(logits + tok.astype(jnp.float32)[:, None] * 1e-3, sub), key
    return jax.lax.fori_loop(0, 16, body, (jnp.zeros((1,), jnp.int32), key))[0]

  jax.block_until_ready(run(logits, key))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(run(logits, key))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e6 / 16


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--vocab", type=int, default=49152)
  args = parser.parse_args()
  logits = jax.random.normal(jax.random.key(1), (1, args.vocab), jnp.float32) * 3
  key = jax.random.key(2)
  rows = {
      "greedy": lambda l, k: jnp.argmax(l, -1).astype(jnp.int32),
      "llama.sample T=0.7 top_p=0.9": lambda l, k: llama.sample(l, k, temperature=0.7,
                                                                 top_p=0.9),
      "categorical (no top-p)": lambda l, k: jax.random.categorical(k, l).astype(jnp.int32),
      "argsort alone": lambda l, k: jnp.argsort(-l, axis=-1)[:, 0].astype(jnp.int32),
  }
  for top in (1, 8, 16, 64, 256, 1024):
    rows[f"lax.top_k k={top}"] = (
        lambda l, k, top=top: jax.lax.top_k(l, top)[1][:, -1].astype(jnp.int32))
  for name, draw in rows.items():
    print(f"{name:34s} {timed(draw, logits, key):8.1f} us / draw")
  return 0


if __name__ == "__main__":
  sys.exit(main())
