#!/usr/bin/env bash
# Session 37 (BENCHMARKS.md): qjax generate on SmolLM2 (Q4_1 / Q8_0 GGUF), the code before
# the decode-attention kernel (a `git archive` of it in .clean/) against now, two runs
# each alternating, 200 and 1000 new tokens; then the GPU cases of the model tests. Run on
# the GPU machine from the repo root, with .whl/ (gguf, tokenizers) and the SmolLM2 file
# split into .model/part + .model2/part (carried over two calls: one call carries 64 MiB at
# most; the first copies its part to /tmp/smol.part1).
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
cat /tmp/smol.part1 .model2/part > /tmp/smol.gguf
for tokens in 200 1000; do
  for rep in 1 2; do
    for tree in .clean .; do
      echo "== smollm2 auto, $tokens tokens, code of $tree (rep $rep)"
      (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 -m qjax._src.cli generate \
        --model /tmp/smol.gguf --max-new-tokens "$tokens" --temperature 0 \
        --prompt "The capital of France is" 2>&1 | grep -v "^[WI]0000" | tail -1)
    done
  done
done
