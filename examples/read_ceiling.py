"""How much of the bandwidth floor can any kernel reach? Device time of pure reads.

``qjax bench`` divides a matmul's bytes by the copy bandwidth of a 1 GiB pass. At the
sizes of one layer's weights (8-120 MB) a pass pays a fixed start and drain on top, so
even a kernel that only reads the bytes stays below that floor. This example measures
three such reads at the byte count of each shape's floor at M = 1 (int4, group 128):

- ``tma``: a Mosaic GPU kernel whose TMA pipeline copies ``[rows, 256]`` uint32 blocks
  into shared memory and does nothing with them (one CTA per SM by default);
- ``triton``: a Pallas Triton kernel whose programs XOR their blocks together;
- ``xla``: ``qjax bench``'s read column (:func:`qjax._src.bench.measure_read_time`).

Every variant swept is listed best first with its share of the floor. GPU only (H100:
Mosaic GPU needs sm_90).

  python examples/read_ceiling.py [--shapes 4096x4096,8192x28672] [--calls 20]
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qjax._src import bench
from qjax._src import devtime

ROW_BYTES = 1024  # one row of [rows, 256] uint32
ROW_UNIT = 132 * 16  # rows are a multiple of this, so each sweep's grid divides them


def floor_bytes(k: int, n: int, m: int = 1, group: int = 128) -> int:
  """Bytes of an int4 ``[K, N]`` matmul's floor: codes, bf16 scales, x and output."""
  return k * n // 2 + (k // group) * n * 2 + m * k * 2 + m * n * 2


def read_rows(nbytes: int) -> int:
  """Rows of 1 KiB read for ``nbytes``: the nearest multiple of :data:`ROW_UNIT`."""
  return max(1, round(nbytes / ROW_BYTES / ROW_UNIT)) * ROW_UNIT


def tma_read(rows: int, block_rows: int, stages: int, ctas: int):
  """A Mosaic GPU kernel that only streams ``[rows, 256]`` uint32 into shared memory."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  steps = rows // ctas // block_rows

  def kernel(a_gmem, o_gmem):
    del o_gmem
    cta = jax.lax.axis_index("cta")
    plgpu.emit_pipeline(
        lambda idx, a_smem: None, grid=(steps,),
        in_specs=[plgpu.BlockSpec((block_rows, 256), lambda s: (cta * steps + s, 0))],
        max_concurrent_steps=stages)(a_gmem)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((ctas, 128), jnp.float32),
                      grid=(ctas,), grid_names=("cta",))


def triton_read(rows: int, block_rows: int, warps: int, programs: int):
  """A Pallas Triton kernel whose programs XOR their ``[block_rows, 256]`` blocks."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  per = rows // programs
  steps = per // block_rows

  def kernel(a_ref, o_ref):
    p = pl.program_id(0)
    acc = jax.lax.fori_loop(
        0, steps, lambda i, acc: acc ^ a_ref[pl.ds(p * per + i * block_rows, block_rows), :],
        jnp.zeros((block_rows, 256), jnp.uint32))
    o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)[None]

  return pl.pallas_call(
      kernel, grid=(programs,), in_specs=[pl.BlockSpec((rows, 256), lambda p: (0, 0))],
      out_specs=pl.BlockSpec((1, 1, 256), lambda p: (p, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((programs, 1, 256), jnp.uint32),
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1))


def sweep(rows: int, calls: int) -> list[tuple[float, str]]:
  """(device us, label) of every variant that runs, fastest first."""
  nbytes = rows * ROW_BYTES
  arrays = [(jax.random.bits(jax.random.key(i), (rows, 256), jnp.uint32),)
            for i in range(bench._rotation(nbytes))]  # pylint: disable=protected-access
  results = [(bench.measure_read_time(nbytes, calls=calls), "xla (qjax bench's read)")]
  variants = [(f"tma block {b} stages {s} ctas {g}", tma_read(rows, b, s, g), g * b)
              for b, s, g in itertools.product((16, 32, 64), (2, 4), (132, 264))]
  variants += [(f"triton block {b} warps {w} programs {g}", triton_read(rows, b, w, g), g * b)
               for b, w, g in itertools.product((16, 32), (4, 8), (132, 264))]
  for label, fn, unit in variants:
    if rows % unit:
      continue
    try:
      results.append((devtime.device_time(jax.jit(fn), arrays, calls=calls).us, label))
    except Exception as e:  # pylint: disable=broad-except
      print(f"  {label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
  return sorted(results)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="4096x4096,4096x14336,8192x28672",
                      help="KxN list; bytes are those of the int4 floor at M = 1 (default "
                      "%(default)s)")
  parser.add_argument("--calls", type=int, default=20,
                      help="timed calls per variant (default %(default)s)")
  parser.add_argument("--top", type=int, default=4,
                      help="variants listed per shape (default %(default)s)")
  args = parser.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    parser.error("these reads are GPU kernels; run on a GPU (H100)")
  bandwidth = bench.measure_copy_bandwidth(2**30)
  print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s; {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}")
  for shape in args.shapes.split(","):
    k, n = (int(v) for v in shape.lower().split("x"))
    rows = read_rows(floor_bytes(k, n))
    floor = rows * ROW_BYTES / bandwidth * 1e6
    results = sweep(rows, args.calls)
    print(f"{shape}: {rows * ROW_BYTES / 1e6:.2f} MB read, floor {floor:.2f} us")
    shown = results[:args.top] + [r for r in results[args.top:] if r[1].startswith("xla")]
    for t, label in shown:
      print(f"  {t:7.2f} us  {100 * floor / t:5.1f} % of the floor  {label}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
