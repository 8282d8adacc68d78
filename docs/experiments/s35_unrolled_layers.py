"""Session 35: decode tokens/s of a Llama-3.2-1B-shaped GGUF model (16 layers, hidden 2048,
32 / 8 heads of 64, FFN 8192, vocabulary 128256, untied head), random blocks, as
``qjax generate`` loads it (``generate.gguf_params``), with its layers scanned
(``lax.scan`` over stacked weights) against unrolled (one set of weights per layer, the
layout of files whose layers mix types, such as llama.cpp's Q4_K_M), and a Q4_K_M-like file
(attn_v and ffn_down in Q6_K in llama.cpp's ``use_more_bits`` layers, Q4_K elsewhere).

  python docs/experiments/s35_unrolled_layers.py [--layers 16] [--steps 64] [--impl auto]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import moe_decode_bench as bench  # noqa: E402
from flax_layers import llama  # noqa: E402
from qjax._src import generate  # noqa: E402
from qjax._src import gguf_io  # noqa: E402


def use_more_bits(i: int, n: int) -> bool:
  """llama.cpp's rule for Q4_K_M's attn_v / ffn_down layers in Q6_K."""
  return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def model(layers: int, mixed: bool, tiny: bool) -> gguf_io.GGUFFile:
  rng = np.random.default_rng(0)
  d, h, kvh, hd, ffn, vocab = (256, 4, 2, 64, 512, 512) if tiny else (
      2048, 32, 8, 64, 8192, 128256)
  a = "llama"
  meta = {"general.architecture": a, f"{a}.vocab_size": vocab, f"{a}.embedding_length": d,
          f"{a}.block_count": layers, f"{a}.attention.head_count": h,
          f"{a}.attention.head_count_kv": kvh, f"{a}.context_length": 4096,
          f"{a}.rope.freq_base": 5e5, f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
          f"{a}.feed_forward_length": ffn, f"{a}.rope.dimension_count": hd}
  w = lambda t, k, n: bench.random_weight(t, k, n, (), rng)  # noqa: E731
  tensors = {"token_embd.weight": w("Q4_K", d, vocab), "output.weight": w("Q6_K", d, vocab),
             "output_norm.weight": jnp.ones((d,), jnp.float32)}
  types = {}
  for i in range(layers):
    p = f"blk.{i}."
    big = "Q6_K" if mixed and use_more_bits(i, layers) else "Q4_K"
    tensors.update({
        p + "attn_norm.weight": jnp.ones((d,), jnp.float32),
        p + "ffn_norm.weight": jnp.ones((d,), jnp.float32),
        p + "attn_q.weight": w("Q4_K", d, h * hd), p + "attn_k.weight": w("Q4_K", d, kvh * hd),
        p + "attn_v.weight": w(big, d, kvh * hd), p + "attn_output.weight": w("Q4_K", h * hd, d),
        p + "ffn_gate.weight": w("Q4_K", d, ffn), p + "ffn_up.weight": w("Q4_K", d, ffn),
        p + "ffn_down.weight": w(big, ffn, d)})
    types.update({p + "attn_v.weight": big, p + "ffn_down.weight": big})
  types = {n: types.get(n, "Q4_K" if hasattr(t, "dequantize") else "F32")
           for n, t in tensors.items()}
  return gguf_io.GGUFFile(path="<model>", tensors=tensors, metadata=meta, tensor_types=types,
                          file_tensor_bytes=0)


def profile(args) -> int:
  """Per-step device time of the scanned Q4_K model's decode, by kernel name."""
  import collections  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from qjax._src import devtime  # pylint: disable=g-import-not-at-top
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  implementation = None if args.impl == "auto" else args.impl
  gfile = model(args.layers, False, args.tiny)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype,
                                        implementation=implementation)
  params = generate.gguf_params(gfile, cfg, implementation)
  cache = llama.init_cache(cfg, 1, 4096)
  state = (jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), cache, jax.random.key(0))
  for _ in range(4):
    state = llama.decode_and_sample(params, *state, cfg=cfg)
  jax.block_until_ready(state[0])
  steps = 8
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    start = time.perf_counter()
    for _ in range(steps):
      state = llama.decode_and_sample(params, *state, cfg=cfg)
    jax.block_until_ready(state[0])
    wall = (time.perf_counter() - start) / steps * 1e6
    jax.profiler.stop_trace()
    trace = devtime._read_trace(d)  # pylint: disable=protected-access
  by_name = collections.defaultdict(lambda: [0.0, 0])
  spans = []
  for e in devtime._stream_events(trace):  # pylint: disable=protected-access
    name = e.get("name", "?")
    if any(s in name.lower() for s in devtime._SKIP):  # pylint: disable=protected-access
      continue
    by_name[name][0] += float(e["dur"]) / steps
    by_name[name][1] += 1
    spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
  busy = devtime._busy_union(spans) / steps  # pylint: disable=protected-access
  total = sum(v[0] for v in by_name.values())
  print(f"per step: wall {wall:.1f} us, device busy {busy:.1f} us, kernels {total:.1f} us, "
        f"{sum(v[1] for v in by_name.values()) / steps:.0f} launches")
  for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{us:9.1f} us {n / steps:6.1f}x  {name[:110]}")
  return 0


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--impl", default="auto")
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--profile", action="store_true", help="instead: the device kernels of 8 "
                 "decode steps of the scanned Q4_K model, summed by name, per step")
  args = p.parse_args()
  if args.profile:
    return profile(args)
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  implementation = None if args.impl == "auto" else args.impl
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  for name, mixed, scan in (("Q4_K scanned", False, True), ("Q4_K unrolled", False, False),
                            ("Q4_K_M-like unrolled", True, False)):
    gfile = model(args.layers, mixed, args.tiny)
    cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype,
                                          implementation=implementation)
    cfg = dataclasses.replace(cfg, scan_layers=scan)
    params = generate.gguf_params(gfile, cfg, implementation)
    rate = bench.decode_rate(params, cfg, args.steps)
    rate2 = bench.decode_rate(params, cfg, args.steps)
    print(f"| {name} | {args.impl} | {rate:.1f} / {rate2:.1f} |", flush=True)
    del params
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
