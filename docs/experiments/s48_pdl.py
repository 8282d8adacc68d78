"""Session 48: programmatic dependent launch (PDL) for the Hopper wgmma kernel.

Each of the 128-224 Mosaic GPU kernels of a batch-1 decode token spends microseconds on
launch, prologue and the first loads' latency. With PDL (Hopper's ``griddepcontrol``)
a kernel may launch before the one it follows has finished: it runs its prologue, waits
(``griddepcontrol.wait``) before touching anything the earlier kernel writes, and, where
that kernel allows it (``griddepcontrol.launch_dependents``), overlaps its tail. jax 0.11
launches a Pallas Mosaic GPU kernel with the PDL attribute when it calls
``plgpu.griddepcontrol_wait``; XLA's own fusions take PDL under ``--xla_gpu_enable_pdl``.

The kernel's experimental hook is ``docs/experiments/s48-pdl.patch`` (``git apply`` to
pallas_kernels/int4_wgmma.py as of f74ace1). It adds ``_PDL_MODE``, read from the
environment variable QJAX_PDL at import, a comma list of:
- "wait": wait first thing in every warpgroup;
- "trigger": then allow the next kernel to launch;
- "prefetch": before the wait, the memory warpgroup prefetches into L2 the weight bytes
  of the CTA's first pipeline stages, which no earlier kernel writes.

Each mode runs in its own process (XLA reads its flags once): the Llama-3-8B-shaped
stack of ``qjax bench --model`` (fused q/k/v and gate/up, weights in the Hopper layout by
``qjax.kernel_layouts``), tokens/s as the median of blocks of calls by wall time, device
time a token, and a hash of one step's output (PDL must not change a bit).

  git apply docs/experiments/s48-pdl.patch
  python docs/experiments/s48_pdl.py [--layers 32] [--calls 50] [--modes ...]

Result (H200, BENCHMARKS.md session 48): no mode helps; "prefetch" and PDL without
command buffers are slower. The hash check is weak here: the random stack's output
overflows to inf after 16 layers (the same positions in every mode).
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

HIDDEN, INTER, KV = 4096, 14336, 1024
MARK = "S48_RESULT "

# (name, QJAX_PDL, extra XLA flags)
MODES = {
    "base": ("", ""),
    "wait": ("wait", ""),
    "wait+trigger": ("wait,trigger", ""),
    "prefetch+wait+trigger": ("prefetch,wait,trigger", ""),
    "xla-pdl-off": ("", "--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false"),
    "xla-pdl-off+wait+trigger": ("wait,trigger",
                                 "--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false"),
    "xla-pdl-on": ("", "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"),
    "xla-pdl-on+wait+trigger": ("wait,trigger",
                                "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"),
    "nocb": ("", "--xla_gpu_enable_command_buffer= --xla_gpu_enable_pdl=false "
                 "--xla_gpu_enable_pdl_launch=false"),
    "nocb+xla-pdl": ("", "--xla_gpu_enable_command_buffer= --xla_gpu_enable_pdl=true "
                         "--xla_gpu_enable_pdl_launch=true"),
    "nocb+xla-pdl+wait+trigger": ("wait,trigger", "--xla_gpu_enable_command_buffer= "
                                  "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"),
}


def child(layers: int, calls: int, bf16: bool, fused: bool) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import pallas_kernels  # noqa: F401  pylint: disable=unused-import,g-import-not-at-top
  import qjax  # pylint: disable=g-import-not-at-top
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  from qjax._src import devtime  # pylint: disable=g-import-not-at-top

  if fused:
    shapes = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]
  else:
    shapes = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
              (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]

  def step(h, weights, mm):
    for w in weights:
      if fused:
        wqkv, wo, wgu, wd = w
        q, k_, v = jnp.split(mm(h, wqkv), [HIDDEN, HIDDEN + KV], axis=-1)
      else:
        wq, wk, wv, wo, wg, wu, wd = w
        q, k_, v = mm(h, wq), mm(h, wk), mm(h, wv)
      h = h + mm(q + jnp.tile(k_ + v, HIDDEN // KV), wo)
      if fused:
        gate, up = jnp.split(mm(h, wgu), 2, axis=-1)
      else:
        gate, up = mm(h, wg), mm(h, wu)
      h = h + mm(jax.nn.silu(gate) * up, wd)
    return h

  key = jax.random.key(2)
  h0 = jax.random.normal(key, (1, HIDDEN), jnp.float32).astype(jnp.bfloat16) * 0.01
  out = {}
  if bf16:
    bws = [[(jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, 1000 + l), i),
                               (k, n), jnp.float32) / 64).astype(jnp.bfloat16)
            for i, (k, n) in enumerate(shapes)] for l in range(layers)]
    fn = jax.jit(lambda h, w: step(h, w, jnp.dot))
    rates = bench.wall_rates(fn, h0, bws, calls=calls)
    out["bf16_tok_s"] = float(np.median(rates))
    out["bf16_runs"] = [round(r, 1) for r in rates]
    out["bf16_device_ms"] = devtime.device_time(fn, [(h0, bws)], calls=5, warmup=1).us / 1e3
    del bws
  qws = [[bench.random_weight("int4", k, n, jax.random.fold_in(jax.random.fold_in(key, l), i))
          for i, (k, n) in enumerate(shapes)] for l in range(layers)]
  qws = qjax.kernel_layouts(qws)
  fn = jax.jit(lambda h, w: step(h, w, qjax.matmul))
  y = np.asarray(fn(h0, qws).astype(jnp.float32))
  out["hash"] = hashlib.sha1(y.tobytes()).hexdigest()[:12]
  out["finite"] = bool(np.isfinite(y).all())
  rates = bench.wall_rates(fn, h0, qws, calls=calls)
  out["int4_tok_s"] = float(np.median(rates))
  out["int4_runs"] = [round(r, 1) for r in rates]
  out["int4_device_ms"] = devtime.device_time(fn, [(h0, qws)], calls=5, warmup=1).us / 1e3
  print(MARK + json.dumps(out), flush=True)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--calls", type=int, default=50)
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--separate", action="store_true", help="the separate q/k/v stack")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    child(args.layers, args.calls, args.bf16, not args.separate)
    return
  rows = []
  for name in args.modes.split(","):
    pdl, flags = MODES[name]
    env = dict(os.environ, QJAX_PDL=pdl,
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    cmd = [sys.executable, __file__, "--child", "--layers", str(args.layers),
           "--calls", str(args.calls), "--bf16"] + (["--separate"] if args.separate else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if proc.returncode or not lines:
      print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
      continue
    r = json.loads(lines[-1][len(MARK):])
    rows.append((name, r))
    print(f"{name:>26}: int4 {r['int4_tok_s']:7.1f} tok/s {r['int4_runs']} device "
          f"{r['int4_device_ms']:.3f} ms | bf16 {r['bf16_tok_s']:6.1f} {r['bf16_runs']} "
          f"device {r['bf16_device_ms']:.3f} | x bf16 {r['int4_tok_s'] / r['bf16_tok_s']:.2f}"
          f" | hash {r['hash']} finite {r['finite']}", flush=True)


if __name__ == "__main__":
  main()
