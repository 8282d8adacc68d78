"""Session 35: device time of the GGUF GEMV kernel (pallas_kernels/gguf_gemv.py) against
the tiled kernel at M = 1, on Llama-3.2-1B's shapes (and its Q6_K head).

For each type and shape: the tiled kernel (``gguf_matmul`` with its own block_m = 16
config), the GEMV with :func:`gguf_gemv.heuristic_config`, the same without inline PTX,
and each of :func:`gguf_gemv.alternative_configs`; device time from a profiler trace
(``qjax._src.devtime.device_time``) over rotated weights (enough copies to exceed 4x the
L2, as ``qjax bench`` does), the bandwidth floor at 3.0 TB/s, and each output's relative
error against ``x @ dequantize()`` at HIGHEST precision (a sanity check, not the test).

    python docs/experiments/s35_gguf_gemv.py                 # all types and shapes
    python docs/experiments/s35_gguf_gemv.py --types Q4_K Q6_K --calls 20
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gguf_gemv
from pallas_kernels import gguf_matmul
from pallas_kernels import int4_matmul
from qjax._src import devtime
from qjax._src import gguf_formats as gf
from qjax._src import gguf_tiled

BANDWIDTH = 3.0e12  # bytes / s
L2_BYTES = 50 * 2**20  # H100
SHAPES = ((2048, 8192), (8192, 2048), (2048, 2048), (2048, 512))
HEAD = (2048, 128256)  # Q6_K only


def random_weight(ggml_type: str, k: int, n: int, seed: int) -> gguf_tiled.GGUFTiledWeight:
  """Random blocks with small f16 scales (as tests/test_gguf_kernels.py builds them)."""
  rng = np.random.default_rng(seed)
  cls = gf.BLOCK_FORMATS[ggml_type]
  nb = k // cls.block_size
  raw = rng.integers(0, 256, (n, nb, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.standard_normal((n, nb)) * 0.02 / np.sqrt(k)).astype(np.float16)
      raw[:, :, f.offset:f.offset + 2] = v.view(np.uint8).reshape(n, nb, 2)
  w = gf.from_gguf_bytes(raw.reshape(n, -1), ggml_type, (k, n))
  return jax.block_until_ready(jax.jit(gguf_tiled.GGUFTiledWeight.from_gguf)(w))


def weight_bytes(w) -> int:
  return sum(a.nbytes for a in jax.tree.leaves(w))


def _cfg_str(c) -> str:
  return f"bn{c.block_n} bk{c.block_k} sk{c.split_k} w{c.num_warps} st{c.num_stages}"


def variants(k: int, n: int):
  """``(label, fn(x, w))`` to time."""
  tiled_cfg = int4_matmul.heuristic_config(1, k, n)
  out = [(f"tiled ({_cfg_str(tiled_cfg)})",
          lambda x, w: gguf_matmul.gguf_matmul(x, w, config=tiled_cfg))]
  base = gguf_gemv.heuristic_config(1, k, n)
  out.append((f"gemv heuristic ({_cfg_str(base)})",
              lambda x, w: gguf_gemv.gguf_gemv(x, w, config=base)))
  out.append(("gemv heuristic, no PTX", "noptx"))
  for cfg in gguf_gemv.alternative_configs(1, k, n):
    out.append((f"gemv alt ({_cfg_str(cfg)})",
                lambda x, w, cfg=cfg: gguf_gemv.gguf_gemv(x, w, config=cfg)))
  return out


def time_shape(ggml_type: str, k: int, n: int, calls: int) -> list[tuple[str, float, float]]:
  w0 = random_weight(ggml_type, k, n, 0)
  nbytes = weight_bytes(w0)
  sets = int(min(32, max(2, math.ceil(4 * L2_BYTES / nbytes))))
  ws = [w0] + [random_weight(ggml_type, k, n, i) for i in range(1, sets)]
  x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32).astype(jnp.bfloat16)
  ref = np.asarray(jnp.dot(x.astype(jnp.float32), w0.dequantize(),
                           precision=jax.lax.Precision.HIGHEST), np.float64)
  floor_us = (nbytes + x.nbytes + n * 2) / BANDWIDTH * 1e6
  print(f"\n{ggml_type} {k}x{n}: {nbytes / 1e6:.1f} MB, floor {floor_us:.1f} us, "
        f"{sets} weight sets", flush=True)
  rows = []
  for label, fn in variants(k, n):
    try:
      if fn == "noptx":
        gguf_gemv.USE_PTX = False
        base = gguf_gemv.heuristic_config(1, k, n)
        f = jax.jit(lambda x_, w_: gguf_gemv.gguf_gemv(x_, w_, config=base))
        jax.block_until_ready(f(x, w0))  # traced without PTX
        gguf_gemv.USE_PTX = True
      else:
        f = jax.jit(fn)
      y = np.asarray(f(x, w0), np.float64)
      err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
      us = devtime.device_time(f, [(x, w) for w in ws], calls=calls).us
    except Exception as e:  # pylint: disable=broad-except
      gguf_gemv.USE_PTX = True
      print(f"  {label:48s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
      rows.append((label, float("nan"), float("nan")))
      continue
    print(f"  {label:48s} {us:8.1f} us  {100 * floor_us / us:5.1f} % of floor  "
          f"rel err {err:.1e}", flush=True)
    rows.append((label, us, err))
  del ws
  return [(ggml_type, k, n, floor_us, rows)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--types", nargs="+", default=list(gguf_tiled.TYPES))
  parser.add_argument("--calls", type=int, default=40)
  parser.add_argument("--no-head", action="store_true", help="skip the 2048x128256 Q6_K head")
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  results = []
  for t in args.types:
    shapes = SHAPES + ((HEAD,) if t == "Q6_K" and not args.no_head else ())
    for k, n in shapes:
      results += time_shape(t, k, n, args.calls)
  print("\n| type | K x N | floor us | tiled us | gemv us (% floor) | best alt us (config) |")
  print("|---|---|---|---|---|---|")
  for t, k, n, floor_us, rows in results:
    tiled, gemv = rows[0][1], rows[1][1]
    alts = [r for r in rows[2:] if not math.isnan(r[1])]
    best = min(alts, key=lambda r: r[1]) if alts else ("-", float("nan"), 0)
    print(f"| {t} | {k}x{n} | {floor_us:.1f} | {tiled:.1f} | {gemv:.1f} "
          f"({100 * floor_us / gemv:.0f} %) | {best[1]:.1f} ({best[0]}) |")


if __name__ == "__main__":
  main()
