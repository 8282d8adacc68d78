"""What the int4 wgmma kernel's compute adds to its pipeline: device time of the kernel
as it is, with its compute step emptied, and with one group of each step's computed.

The emptied kernel keeps the TMA pipeline, its barriers, the epilogue's stores and the
split-K sum, so ``full - empty`` is the time the consumers' conversion and wgmma add on
top of moving the bytes (BENCHMARKS.md, session 19). GPU only (Hopper).

  python examples/wgmma_breakdown.py [--shapes 4096x14336,8192x28672] [--m 1,16,64]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels  # pylint: disable=unused-import  (registers the kernels)
from pallas_kernels import int4_wgmma as kw
from qjax._src import bench
from qjax._src import devtime


@contextlib.contextmanager
def _patched(**fns):
  """Replaces module functions of int4_wgmma for the duration (trace time only)."""
  saved = {name: getattr(kw, name) for name in fns}
  try:
    for name, fn in fns.items():
      setattr(kw, name, fn)
    yield
  finally:
    for name, fn in saved.items():
      setattr(kw, name, fn)


def _one_group(acc_ref, w_smem, s_smem, x_smem, group_size):
  """A step that converts and multiplies only its last group."""
  del s_smem
  *_, (_, w, x_t) = kw._step_groups(  # pylint: disable=protected-access
      w_smem, x_smem, min(w_smem.shape[1], group_size))
  kw.plgpu.wgmma(acc_ref, w, x_t)
  kw.plgpu.wgmma_wait(0)


VARIANTS = {
    "full": {},
    "empty body": dict(_multiply_then_scale=lambda acc, *a: acc,
                       _mma_sync_then_scale=lambda acc, *a: acc,
                       _convert_and_multiply=lambda *a: None),
    # One group per step takes the bf16-scale form at every M.
    "1 group/step": dict(_convert_and_multiply=_one_group,
                         _multiply_then_scale=lambda acc, *a: acc),
}


def time_variant(name: str, m: int, k: int, n: int, calls: int) -> float:
  key = jax.random.key(0)
  w0 = bench.random_weight("int4nk", k, n, key)
  ws = [w0] + [bench.random_weight("int4nk", k, n, jax.random.fold_in(key, i))
               for i in range(1, bench._rotation(w0.nbytes))]  # pylint: disable=protected-access
  x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
  cfg = kw.config_for(m, k, n, 128)
  if name == "1 group/step":
    cfg = dataclasses.replace(cfg, scale_accumulator=False, mma_sync=False)
  with _patched(**VARIANTS[name]):
    fn = jax.jit(lambda a, b: kw.int4_nk_matmul(a, b, config=cfg))
    return devtime.device_time(fn, [(x, w) for w in ws], calls=calls).us


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096,8192x28672",
                      help="comma-separated KxN (default %(default)s)")
  parser.add_argument("--m", default="1,16,64",
                      help="comma-separated rows of x (default %(default)s)")
  parser.add_argument("--calls", type=int, default=10,
                      help="timed calls per point (default %(default)s)")
  args = parser.parse_args(argv)
  if not kw.supported(jax.devices()[0]):
    parser.error("the wgmma kernel needs a Hopper GPU (sm_90)")
  ms = [int(v) for v in args.m.split(",")]
  print(f"{'shape':>12} {'variant':>13} | " + " ".join(f"{'M=' + str(m):>8}" for m in ms)
        + "   (us of device time)")
  for shape in args.shapes.split(","):
    k, n = (int(v) for v in shape.lower().split("x"))
    for name in VARIANTS:
      times = [time_variant(name, m, k, n, args.calls) for m in ms]
      print(f"{shape:>12} {name:>13} | " + " ".join(f"{t:8.1f}" for t in times), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
