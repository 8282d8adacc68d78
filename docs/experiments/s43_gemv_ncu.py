"""Session 43: a driver for Nsight Compute: three calls each of the GGUF GEMV (Q4_K, Q6_K,
Q8_0 on 2048x8192) and of the INT4 GEMV (2048x8192 and 4096x14336, group 128), heuristic
configs, so that ``ncu`` can count what each kernel executes. Run on the GPU machine::

    ncu --clock-control none -k regex:gemv --launch-count 16 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section LaunchStats --section Occupancy --section InstructionStats \\
        python3 docs/experiments/s43_gemv_ncu.py
    ncu --clock-control none -k regex:gemv --launch-count 8 --metrics \\
        smsp__inst_executed.sum,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum,... \\
        python3 docs/experiments/s43_gemv_ncu.py Q4_K Q8_0 int4

(BENCHMARKS.md session 43 lists the metrics and what they showed.)
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import s35_gguf_gemv  # pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels import gguf_gemv, int4_gemv  # pylint: disable=wrong-import-position
from qjax._src import int4  # pylint: disable=wrong-import-position


def main(which: list[str]) -> None:
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2048)), jnp.bfloat16)
  for t in which:
    if t == "int4":
      for k, n in ((2048, 8192), (4096, 14336)):
        w = int4.quantize(jax.random.normal(jax.random.key(1), (k, n)) * 0.02, group_size=128)
        xk = jnp.full((1, k), 0.1, jnp.bfloat16)
        f = jax.jit(int4_gemv.int4_gemv)
        for _ in range(3):
          jax.block_until_ready(f(xk, w))
      continue
    w = s35_gguf_gemv.random_weight(t, 2048, 8192, 0)
    f = jax.jit(gguf_gemv.gguf_gemv)
    print(t, gguf_gemv.heuristic_config(1, 2048, 8192))
    for _ in range(3):
      jax.block_until_ready(f(x, w))
  print("done")


if __name__ == "__main__":
  main(sys.argv[1:] or ["Q4_K", "Q6_K", "Q8_0", "int4"])
