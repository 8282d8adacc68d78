"""Session 36: what the KV cache costs a decode step, by cache length; and (``--fuse``)
what joining q / k / v and gate / up into one matmul each saves.

A Llama-3.2-1B-shaped Q4_K model (16 layers, hidden 2048, 32 / 8 heads of 64, random
blocks; :mod:`s35_unrolled_layers`' model) decodes at batch 1 with ``decode_and_sample``;
for each cache length the steps run under the profiler and the device kernels are summed
by name, per step. The attention itself must read the whole cache (masked slots
included): ``2 * layers * max_len * kv_heads * head_dim * 2`` bytes, 8 MiB a layer at
4096 slots; anything above that is copying.

  python docs/experiments/s36_kv_cache.py [--lengths 256,1024,4096] [--layers 16]
      [--scan both|scan|unrolled] [--top 8] [--tiny]
  python docs/experiments/s36_kv_cache.py --fuse [--types Q4_K,Q4_0,Q8_0] [--tiny]

``--fuse``: the same model with every weight of each type (Q4_0 as the Int4Weight its
kernels read), scanned, cache 256, per-step device time with the projections apart and
joined (``llama.fuse_projections``), and tokens/s of 64 steps.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import s35_unrolled_layers as s35  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import moe_decode_bench as bench  # noqa: E402
from qjax._src import gguf_io  # noqa: E402
from flax_layers import llama  # noqa: E402
from qjax._src import devtime  # noqa: E402
from qjax._src import generate  # noqa: E402


def step_kernels(params, cfg, max_len: int, steps: int = 8):
  """(device busy us per step, {kernel name: us per step}) of ``steps`` decode steps at
  position ``max_len // 2`` of a cache of ``max_len`` slots."""
  cache = llama.init_cache(cfg, 1, max_len)
  pos = jnp.full((1,), max_len // 2, jnp.int32)
  state = (jnp.zeros((1,), jnp.int32), pos, cache, jax.random.key(0))
  for _ in range(3):
    state = llama.decode_and_sample(params, *state, cfg=cfg)
  jax.block_until_ready(state[0])
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(steps):
      state = llama.decode_and_sample(params, *state, cfg=cfg)
    jax.block_until_ready(state[0])
    jax.profiler.stop_trace()
    trace = devtime._read_trace(d)  # pylint: disable=protected-access
  by_name, spans = collections.Counter(), []
  for e in devtime._stream_events(trace):  # pylint: disable=protected-access
    name = e.get("name", "?")
    if any(s in name.lower() for s in devtime._SKIP):  # pylint: disable=protected-access
      continue
    by_name[name] += float(e["dur"]) / steps
    spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
  return devtime._busy_union(spans) / steps, by_name  # pylint: disable=protected-access


def typed_model(layers: int, ggml_type: str, tiny: bool) -> gguf_io.GGUFFile:
  """:mod:`s35_unrolled_layers`' model with every quantized weight of ``ggml_type``."""
  gfile = s35.model(layers, False, tiny)
  rng = np.random.default_rng(1)
  tensors, types = dict(gfile.tensors), dict(gfile.tensor_types)
  for name, w in gfile.tensors.items():
    if name.startswith("blk.") and hasattr(w, "dequantize"):
      tensors[name] = bench.random_weight(ggml_type, *w.shape, (), rng)
      types[name] = ggml_type
  return gguf_io.GGUFFile(path="<model>", tensors=tensors, metadata=gfile.metadata,
                          tensor_types=types, file_tensor_bytes=0)


def fuse(args, dtype) -> int:
  rows = []
  for ggml_type in args.types.split(","):
    gfile = typed_model(args.layers, ggml_type, args.tiny)
    cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype)
    params = generate.gguf_params(gfile, cfg, None)
    for fused in (False, True):
      p = llama.fuse_projections(params) if fused else params
      busy, by_name = step_kernels(p, cfg, 256)
      rate = bench.decode_rate(p, cfg, 64)
      rows.append((ggml_type, fused, busy, len(by_name), rate))
      print(f"{ggml_type} {'fused' if fused else 'apart'}: busy {busy:.1f} us/step, "
            f"{rate:.0f} tokens/s", flush=True)
      for name, us in by_name.most_common(args.top):
        print(f"  {us:8.1f} us  {name[:100]}")
      del p
    del params
  print("| type | projections | busy us/step | kernels | tokens/s |")
  for ggml_type, fused, busy, kernels, rate in rows:
    print(f"| {ggml_type} | {'joined' if fused else 'apart'} | {busy:.1f} | {kernels} | "
          f"{rate:.0f} |")
  return 0


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--lengths", default="256,1024,4096")
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--scan", choices=("both", "scan", "unrolled"), default="both")
  p.add_argument("--top", type=int, default=8, help="kernels listed per run")
  p.add_argument("--tiny", action="store_true", help="a 256-wide model (CPU smoke)")
  p.add_argument("--fuse", action="store_true", help="instead: projections apart and joined")
  p.add_argument("--types", default="Q4_K,Q4_0,Q8_0", help="--fuse's weight types")
  args = p.parse_args()
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  if args.fuse:
    return fuse(args, dtype)
  gfile = s35.model(args.layers, False, args.tiny)
  rows = []
  for scan in {"both": (True, False), "scan": (True,), "unrolled": (False,)}[args.scan]:
    cfg = dataclasses.replace(llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype),
                              scan_layers=scan)
    params = generate.gguf_params(gfile, cfg, None)
    for max_len in map(int, args.lengths.split(",")):
      busy, by_name = step_kernels(params, cfg, max_len)
      floor = (2 * cfg.num_layers * max_len * cfg.num_kv_heads * cfg.head_dim
               * jnp.dtype(dtype).itemsize)
      rows.append((scan, max_len, busy, floor / 3.35e6))
      print(f"{'scan' if scan else 'unrolled'} max_len {max_len}: busy {busy:.1f} us/step, "
            f"{len(by_name)} kernels; the cache read alone {floor / 2**20:.1f} MiB "
            f"({floor / 3.35e6:.1f} us at 3.35 TB/s)", flush=True)
      for name, us in by_name.most_common(args.top):
        print(f"  {us:8.1f} us  {name[:100]}")
    del params
  print("| layers | max_len | busy us/step | cache-read floor us |")
  for scan, max_len, busy, floor_us in rows:
    print(f"| {'scan' if scan else 'unrolled'} | {max_len} | {busy:.1f} | {floor_us:.1f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
