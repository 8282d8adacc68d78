"""A/B of the GGUF stacks' decode route in a whole model: examples/moe_decode_bench.py with
moe_matmul_xla's gathered_sum off, then on, twice each (H100 wall-time noise)."""
import functools
import runpy
import sys

from qjax._src import gguf_formats as gf
from qjax._src import moe

sys.path.insert(0, "examples")
bench = runpy.run_path("examples/moe_decode_bench.py")
for flag in (False, True, False, True):
  for cls in (*gf.BLOCK_FORMATS.values(), gf.GGUFDense):
    moe.register_moe_xla(cls, functools.partial(moe.moe_matmul_xla, gathered_sum=flag))
  print(f"--- gathered_sum={flag}", flush=True)
  bench["main"](["--types", "Q4_0,Q4_K", "--implementations", "xla,auto", "--steps", "128"])
