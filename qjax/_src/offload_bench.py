"""``qjax bench --offload``: a stack of two-pass codebook layers, pass 2 on the device or
in pinned host memory, and how much of the host-to-device copy the prefetch hides.

For each M: the device-busy time of the stacked forward with both passes on the device
(``t_device``), with pass 2 offloaded (``t_offload``), and the copy term ``t_copy`` = pass-2
bytes / host-to-device bandwidth measured in the same run (the fastest of
``COPY_REPEATS`` measurements). The goal is
``t_offload <= 1.15 * max(t_device, t_copy)``; the overlap printed is
``(t_device + t_copy - t_offload) / min(t_device, t_copy)``: 1 when the smaller term is
fully hidden, 0 when the two run one after the other. GPU only (memory kinds and the
profiler's device events); the CPU runs a tiny smoke version.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qjax._src import codebook_tables
from qjax._src import devtime
from qjax._src import offload
from qjax._src import packing
from qjax._src.codebook import CodebookWeight

GPU_M = (1, 256, 4096)
COPY_REPEATS = 3
GPU_LAYERS, GPU_K = 32, 4096
CPU_M, CPU_LAYERS, CPU_K = (1, 8), 16, 256


def random_two_pass(key: jax.Array, k: int, n: int, group: int = 128) -> CodebookWeight:
  """A two-pass weight with random indices (no float matrix is quantized)."""
  keys = jax.random.split(key, 4)
  words = lambda kk: jax.random.bits(kk, (packing.padded_rows(k, 128) // 8, n), jnp.uint32)
  norms = lambda kk, s: (jax.random.uniform(kk, (k // group, n), jnp.float32, 0.5, 1.5)
                         * s).astype(jnp.bfloat16)
  table = jnp.asarray(codebook_tables.table("lloyd"))
  return CodebookWeight(codes=words(keys[0]), norms=norms(keys[1], 1.0), codebook=table,
                        codes2=words(keys[2]), norms2=norms(keys[3], 0.1), codebook2=table,
                        shape=(k, n), group_size=group)


def _copy_fn(stack: offload.LayerStack):
  """A jitted function that only copies the stack's pass 2 to the device."""

  @jax.jit
  def copy(s):
    moved = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device),
                         (s.second_head, s.second_next, s.second_rest, s.second_tail))
    # One element of each copy keeps it alive without returning the copies.
    return [a.reshape(-1)[:1] for a in jax.tree_util.tree_leaves(moved)]

  return copy


def run(args) -> int:
  on_gpu = jax.devices()[0].platform == "gpu"
  ms = [int(v) for v in args.m.split(",")] if args.m else list(GPU_M if on_gpu else CPU_M)
  layers, k = (GPU_LAYERS, GPU_K) if on_gpu else (CPU_LAYERS, CPU_K)
  calls = max(3, min(args.calls, 10))
  print(f"# qjax bench --offload on {jax.devices()[0].device_kind}, jax {jax.__version__}")
  forward = offload.make_stacked_forward()
  print(f"# {layers} layers of {k}x{k} two-pass codebook weights (group 128); forward "
        f"compiled with {offload.default_compiler_options()}")
  if not on_gpu:
    print("# CPU run: wall-clock smoke test of the code path, not offload figures")
  keys = jax.random.split(jax.random.key(0), layers)
  ws = [random_two_pass(kk, k, k) for kk in keys]
  # The CLI has checked the layout and filled in the default group.
  layout = dict(group=args.offload_group, carried=args.offload_carried)
  on_device = offload.stack_layers(ws, offload_pass2=False, **layout)
  offloaded = offload.stack_layers(ws, offload_pass2=True, **layout)
  del ws
  pass2_bytes = offloaded.pass2_bytes()
  # The host-to-device bandwidth varies from run to run (41-53 GB/s on the H100): the copy
  # term is the fastest of several measurements, so that the ratio is not flattered by a
  # slow copy measurement.
  copy_fn = _copy_fn(offloaded)
  copies = [devtime.device_busy_time(copy_fn, [(offloaded,)], calls=calls)
            for _ in range(COPY_REPEATS)]
  copy_t = min(copies, key=lambda t: t.us)
  bandwidth = pass2_bytes / (copy_t.us * 1e-6)
  print(f"# copy measurements: {', '.join(f'{t.us:.0f}' for t in copies)} us; fastest kept")
  print(f"# pass-2 bytes {pass2_bytes / 2**20:.1f} MiB; host-to-device {bandwidth / 1e9:.1f} "
        f"GB/s measured ({copy_t.us:.0f} us, {copy_t.source})")
  print(f"# weights in device memory: {on_device.device_bytes() / 2**20:.1f} MiB both passes, "
        f"{offloaded.device_bytes() / 2**20:.1f} MiB with pass 2 offloaded")
  print(f"# prefetch: {offloaded.group} layers per scan step, {offloaded.carried} carried "
        f"({offloaded.scanned_groups} steps, {len(offloaded.first_tail)} tail layers); "
        f"prefetch buffers up to {offloaded.prefetch_buffer_bytes() / 2**20:.1f} MiB")
  print(f"{'M':>6} | {'device us':>10} {'offload us':>10} {'copy us':>9} | "
        f"{'offload/max':>11} {'overlap':>8}")
  worst = 0.0
  for m in ms:
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    t_dev = devtime.device_busy_time(forward, [(on_device, x)], calls=calls).us
    t_off = devtime.device_busy_time(forward, [(offloaded, x)], calls=calls).us
    t_copy = copy_t.us
    ratio = t_off / max(t_dev, t_copy)
    overlap = (t_dev + t_copy - t_off) / min(t_dev, t_copy)
    worst = max(worst, ratio)
    print(f"{m:>6} | {t_dev:>10.0f} {t_off:>10.0f} {t_copy:>9.0f} | {ratio:>11.3f} "
          f"{overlap:>8.2f}")
  print(f"# worst offload/max(device, copy) = {worst:.3f} (goal <= 1.15)"
        + ("" if on_gpu else "; meaningless on the CPU"))
  return 0 if math.isfinite(worst) else 1
