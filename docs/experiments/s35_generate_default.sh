#!/usr/bin/env bash
# Session 35 (BENCHMARKS.md): generate's default (auto vs xla) on SmolLM2; GPT-OSS-shaped MXFP4 on xla with
# the dense MXFP4 weights converted once at load.
# Run on the GPU machine from the repo root, with .whl/ (gguf) and the SmolLM2 file split
# into .model/part + .model2/part (carried over two calls: one call carries 64 MiB at most).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 -c "import jax, flax, triton; print(jax.__version__, flax.__version__, triton.__version__, jax.devices()[0].device_kind)"
cat .model/part .model2/part > /tmp/smol.gguf
for rep in 1 2; do
for impl in xla auto; do
  echo "== smollm2 $impl (rep $rep)"
  python3 -m qjax._src.cli generate --model /tmp/smol.gguf --max-new-tokens 96 --temperature 0 --implementation $impl --prompt "The capital of France is" 2>&1 | grep -v "^[WI]0000" | tail -2
done
done
echo "== default (no --implementation)"
python3 -m qjax._src.cli generate --model /tmp/smol.gguf --max-new-tokens 96 --temperature 0 --prompt "The capital of France is" 2>&1 | grep -v "^[WI]0000" | tail -2
python3 examples/moe_decode_bench.py --arch gpt-oss --types MXFP4 --implementations xla,auto 2>&1 | grep -v "^[WI]0000" | tail -12
