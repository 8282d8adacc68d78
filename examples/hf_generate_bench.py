"""Decode tokens/s of ``qjax generate --model FOLDER`` on a random Llama-3.2-1B-shaped
Hugging Face checkpoint: GPTQ (INT4, group 128) through each implementation, against the
same model stored dense in float16.

Writes both folders (GPTQ with ``flax_layers.save_hf_llama``; float16 as safetensors with
HF names; a word-level ``tokenizer.json``), runs ``qjax generate --stats --json`` on each
in a fresh process and prints a Markdown table last: the decode rate (wall time of the
decode steps after the first, as generate reports it), the implementation that ran, and
the device memory of the loaded weights. Random weights: the text is meaningless, the
timing is not.

  python examples/hf_generate_bench.py            # on a GPU: xla, auto, pallas vs float16
  python examples/hf_generate_bench.py --tiny     # a 2-layer model, any device
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden 256 (CPU "
                 "tests) instead of Llama-3.2-1B's shapes with a 32k vocabulary")
  p.add_argument("--tokens", type=int, default=None, help="tokens to generate (default 96, "
                 "8 with --tiny)")
  p.add_argument("--implementations", default=None, help="comma-separated qjax generate "
                 "--implementation values for the GPTQ model (default xla,auto,pallas on "
                 "a GPU, xla,auto elsewhere)")
  p.add_argument("--zero-points", action="store_true", help="write the GPTQ model with "
                 "integer zero points (asymmetric, as AWQ and GPTQ sym=False store them) "
                 "instead of symmetric codes")
  p.add_argument("--out", default=None, help="folder for the checkpoints (default: a "
                 "temporary one, removed after)")
  args = p.parse_args(argv)
  if args.tokens is None:
    args.tokens = 8 if args.tiny else 96
  if args.tokens < 1:
    p.error(f"--tokens={args.tokens} must be >= 1")
  return args


def _config(tiny: bool):
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  if tiny:
    return llama.LlamaConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=64, ffn_size=512, rope_base=500000.0,
                             context_length=512, scan_layers=False)
  return llama.LlamaConfig(vocab_size=32768, hidden_size=2048, num_layers=16, num_heads=32,
                           num_kv_heads=8, head_dim=64, ffn_size=8192, rope_base=500000.0,
                           context_length=2048, scan_layers=False)


def _shapes(cfg) -> dict[str, tuple[int, int]]:
  """HF module -> logical ``[K, N]``."""
  from flax_layers import hf_checkpoint  # pylint: disable=g-import-not-at-top
  return {m: hf_checkpoint.linear_shape(cfg, m) for m in hf_checkpoint.LINEARS}


def _random(shape, index: int):
  """``[K, N]`` float32 normal / sqrt(K), the same for both folders."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  key = jax.random.fold_in(jax.random.key(0), index)
  return jax.random.normal(key, shape, jax.numpy.float32) / np.sqrt(shape[0])


def write_gptq(folder: pathlib.Path, cfg, zero_points: bool = False) -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import qjax  # pylint: disable=g-import-not-at-top
  from flax_layers import hf_checkpoint  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_formats  # pylint: disable=g-import-not-at-top
  params = {"embed": gguf_formats.GGUFDense(
                data=_random((cfg.vocab_size, cfg.hidden_size), 1).astype(jnp.float16),
                shape=(cfg.hidden_size, cfg.vocab_size)),
            "final_norm": {"scale": jnp.ones(cfg.hidden_size)}}
  for i in range(cfg.num_layers):
    layer: dict = {"attn_norm": {"scale": jnp.ones(cfg.hidden_size)},
                   "ffn_norm": {"scale": jnp.ones(cfg.hidden_size)}}
    for j, (module, shape) in enumerate(_shapes(cfg).items()):
      group, name, _ = hf_checkpoint.LINEARS[module]
      layer.setdefault(group, {})[name] = {"kernel": qjax.quantize(
          _random(shape, 100 * i + j + 7), group_size=128, scale_dtype=jnp.float16,
          symmetric=not zero_points)}
    params[f"layers_{i}"] = layer
  hf_checkpoint.save_hf_llama(folder, {"params": params}, cfg, layout="gptq",
                              zero_point_version=2)


def write_float16(folder: pathlib.Path, cfg) -> None:
  """The same weights dense, float16 ``[out, in]`` (q / k left unpermuted: timing only)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from flax_layers import hf_checkpoint  # pylint: disable=g-import-not-at-top
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {"model.embed_tokens.weight": np.asarray(
                 _random((cfg.vocab_size, cfg.hidden_size), 1), np.float16),
             "model.norm.weight": np.ones(cfg.hidden_size, np.float16)}
  for i in range(cfg.num_layers):
    for name in hf_checkpoint.NORMS:
      tensors[f"model.layers.{i}.{name}"] = np.ones(cfg.hidden_size, np.float16)
    for j, (module, shape) in enumerate(_shapes(cfg).items()):
      tensors[f"model.layers.{i}.{module}.weight"] = np.asarray(
          _random(shape, 100 * i + j + 7).T, np.float16)
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(hf_checkpoint.hf_config(
      cfg, tie_word_embeddings=True, torch_dtype="float16")))


def write_tokenizer(folder: pathlib.Path, vocab_size: int) -> None:
  """A word-level ``tokenizer.json``: ``<s>``, ``</s>``, then ``t2 ... t{vocab - 1}``."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                            "eos_token": "</s>"}))


def generate(folder: pathlib.Path, implementation: str, tokens: int) -> tuple[str, str]:
  """``(decode rate line, memory line)`` of one ``qjax generate`` run, or the error."""
  proc = subprocess.run(
      [sys.executable, "-m", "qjax._src.cli", "generate", "--model", str(folder),
       "--prompt", "t5 t6 t7 t8", "--max-new-tokens", str(tokens), "--implementation",
       implementation, "--stats", "--json"], capture_output=True, text=True)
  lines = proc.stderr.splitlines()
  rate = [ln for ln in lines if ln.startswith("prompt ") or "error" in ln]
  memory = [ln for ln in lines if "device memory" in ln]
  return (rate[-1] if rate else proc.stderr.strip()[-300:]), (memory[-1] if memory else "")


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  gpu = jax.devices()[0].platform == "gpu"
  impls = (args.implementations.split(",") if args.implementations else
           ["xla", "auto", "pallas"] if gpu else ["xla", "auto"])
  cfg = _config(args.tiny)
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(args.out or tmp)
    rows = []
    gptq = "gptq-asym" if args.zero_points else "gptq"
    for name, write, runs in (
        (gptq, lambda f, c: write_gptq(f, c, args.zero_points), impls),
        ("float16", write_float16, ["xla"])):
      folder = out / name
      t0 = time.time()
      write(folder, cfg)
      write_tokenizer(folder, cfg.vocab_size)
      print(f"# {name} written in {time.time() - t0:.1f} s", flush=True)
      for impl in runs:
        rows.append((name, impl, *generate(folder, impl, args.tokens)))
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{'tiny' if args.tiny else 'Llama-3.2-1B-shaped'}, {args.tokens} tokens\n")
  print("| weights | implementation | generate's timing line | memory |\n| --- | --- | --- | --- |")
  for row in rows:
    print("| " + " | ".join(row) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
