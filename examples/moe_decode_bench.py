"""Decode tokens/s of a Qwen3-30B-A3B-shaped mixture-of-experts model (``qwen3moe``: 128
experts of width 768, 8 per token, hidden 2048, 32 query / 4 KV heads of 128) or, with
``--arch gpt-oss``, a GPT-OSS-20B-shaped one (32 experts of width 2880, 4 per token, hidden
2880, 64 / 8 heads of 64, attention sinks, biases, alternating 128-token sliding window,
YaRN), built in memory as ``flax_layers.llama.params_from_gguf`` reads a GGUF file, with
its weights in a GGUF block type against the same model in bf16.

Random blocks (finite f16 scales), so the tokens are meaningless and the timing is not.
Every 2-D block weight and expert stack is of one of ``--types``; norms are float32, the
router float32 (as the loader keeps it). Each row times ``llama.decode_and_sample`` (one
jitted program per token; ``qjax generate`` runs up to 64 steps a call,
``llama.decode_tokens``) for ``--steps`` tokens after a warm-up, at batch 1, and the
model's weight bytes on the device. The bf16 model is the same tensors
stored as GGUF BF16 (``GGUFDense``). Prints a Markdown table last.

  python examples/moe_decode_bench.py           # GPU: 8 layers, Q4_0, Q4_K, MXFP4 vs bf16
  python examples/moe_decode_bench.py --arch gpt-oss   # GPU: MXFP4 and Q8_0 vs bf16
  python examples/moe_decode_bench.py --tiny          # a 2-layer small model, any device
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import qjax
from flax_layers import llama
from qjax._src import generate
from qjax._src import gguf_formats as gf
from qjax._src import gguf_io

SHAPES = {  # (arch, tiny) -> sizes
    ("qwen3moe", False): dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
                              top_k=8, expert_ffn=768, vocab=151936),
    ("gpt-oss", False): dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32,
                             top_k=4, expert_ffn=2880, vocab=201088),
    ("qwen3moe", True): dict(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8,
                             top_k=2, expert_ffn=256, vocab=512),
    ("gpt-oss", True): dict(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8,
                            top_k=2, expert_ffn=256, vocab=512),
}
DEFAULT_TYPES = {"qwen3moe": "Q4_0,Q4_K,MXFP4", "gpt-oss": "MXFP4,Q8_0"}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden 256 with 8 "
                 "experts (CPU tests) instead of Qwen3-30B-A3B's shapes")
  p.add_argument("--layers", type=int, default=None, help="decoder blocks (default 8, 2 "
                 "with --tiny; the real model has 48)")
  p.add_argument("--arch", choices=("qwen3moe", "gpt-oss"), default="qwen3moe",
                 help="the model's shape and architecture (default qwen3moe)")
  p.add_argument("--types", default=None, help="comma-separated GGUF block types of the "
                 f"weights, of {list(gf.BLOCK_FORMATS)} (default Q4_0,Q4_K,MXFP4 for "
                 "qwen3moe, MXFP4,Q8_0 for gpt-oss, whose rows of 2880 no K-quant divides; "
                 "MXFP4 experts run the MoE kernels where kernels run)")
  p.add_argument("--implementations", default=None, help="comma-separated LlamaConfig "
                 "implementations for the quantized models (default xla,auto; auto is "
                 "the kernels for the dense projections where a GPU has them)")
  p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 64, "
                 "4 with --tiny)")
  p.add_argument("--int4-experts", action="store_true", help="give each model random INT4 "
                 "experts of group 128 with f16 scales (qjax.Int4Weight stacks, as a GPTQ "
                 "Hugging Face folder loads) in place of its GGUF ones; where kernels run, "
                 "each implementation times them both as qjax generate puts them "
                 "(generate.moe_kernel_layouts: Int4NKWeight on Hopper) and as loaded")
  args = p.parse_args(argv)
  for name in ("layers", "steps"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f"--{name}={getattr(args, name)} must be at least 1")
  args.shape = SHAPES[args.arch, args.tiny]
  args.layers = args.layers or (2 if args.tiny else 8)
  args.steps = args.steps or (4 if args.tiny else 64)
  args.types = [t for t in (args.types or DEFAULT_TYPES[args.arch]).split(",") if t]
  for t in args.types:
    if t not in gf.BLOCK_FORMATS:
      p.error(f"--types: {t!r} is not one of {list(gf.BLOCK_FORMATS)}")
    block = gf.BLOCK_FORMATS[t].block_size
    rows = {"hidden": args.shape["hidden"], "expert_ffn": args.shape["expert_ffn"],
            "heads x head_dim": args.shape["heads"] * args.shape["head_dim"]}
    for dim, size in rows.items():  # the row lengths (K) of the weights
      if size % block:
        p.error(f"--types: {t} blocks of {block} do not divide the {args.arch} model's "
                f"{dim}={size}")
  args.implementations = (args.implementations or "xla,auto").split(",")
  for impl in args.implementations:
    if impl not in ("xla", "auto", "pallas", "interpret"):
      p.error(f"--implementations: {impl!r} is not one of xla, auto, pallas, interpret")
  return args


def metadata(s: dict, layers: int, a: str = "qwen3moe") -> dict:
  """The GGUF metadata of architecture ``a`` and shape ``s``."""
  extra = {}
  if a == "gpt-oss":  # as llama.cpp's converter writes GPT-OSS
    extra = {f"{a}.attention.sliding_window": 128, f"{a}.rope.scaling.type": "yarn",
             f"{a}.rope.scaling.factor": 32.0,
             f"{a}.rope.scaling.original_context_length": 4096}
  return {**extra, "general.architecture": a, f"{a}.vocab_size": s["vocab"],
          f"{a}.embedding_length": s["hidden"], f"{a}.block_count": layers,
          f"{a}.attention.head_count": s["heads"],
          f"{a}.attention.head_count_kv": s["kv_heads"],
          f"{a}.attention.key_length": s["head_dim"],
          f"{a}.attention.value_length": s["head_dim"], f"{a}.context_length": 4096,
          f"{a}.rope.freq_base": 1e6, f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
          f"{a}.expert_count": s["experts"], f"{a}.expert_used_count": s["top_k"],
          f"{a}.expert_feed_forward_length": s["expert_ffn"],
          f"{a}.feed_forward_length": 6144}


def random_weight(ggml_type: str, k: int, n: int, lead: tuple[int, ...], rng) -> object:
  """A GGUF weight of logical ``(k, n)`` (with leading axes ``lead``) of random blocks
  whose f16 fields are small finite values; "BF16" gives a GGUFDense."""
  if ggml_type == "BF16":  # drawn on the device: billions of values
    key = jax.random.key(int(rng.integers(1 << 31)))
    return gf.GGUFDense(data=jax.random.normal(key, (*lead, n, k), jnp.bfloat16) * 0.02,
                        shape=(k, n))
  cls = gf.BLOCK_FORMATS[ggml_type]
  nb = k // cls.block_size
  raw = rng.integers(0, 256, (*lead, n, nb, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.standard_normal((*lead, n, nb)) * 1e-3).astype(np.float16)
      raw[..., f.offset:f.offset + 2] = v.view(np.uint8).reshape(*lead, n, nb, 2)
  if ggml_type == "MXFP4":
    raw[..., 0] = 118  # E8M0 scale 2**-9
  return cls.from_bytes(raw.reshape(*lead, n, -1), (k, n), lead)


def model_file(s: dict, layers: int, ggml_type: str, seed: int = 0,
               arch: str = "qwen3moe") -> gguf_io.GGUFFile:
  """An in-memory GGUFFile of the model, every weight of ``ggml_type``; as
  ``gguf_io.load_gguf`` gives them, gpt-oss's ``[E, N]`` expert biases are 2-D F32
  weights (``GGUFDense``)."""
  rng = np.random.default_rng(seed)
  d, hd, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
  q, kv = s["heads"] * hd, s["kv_heads"] * hd
  tensors = {"token_embd.weight": random_weight(ggml_type, d, s["vocab"], (), rng),
             "output.weight": random_weight(ggml_type, d, s["vocab"], (), rng),
             "output_norm.weight": jnp.ones((d,), jnp.float32)}
  for i in range(layers):
    p = f"blk.{i}."
    tensors.update({
        p + "attn_norm.weight": jnp.ones((d,), jnp.float32),
        p + "ffn_norm.weight": jnp.ones((d,), jnp.float32),
        p + "attn_q_norm.weight": jnp.ones((hd,), jnp.float32),
        p + "attn_k_norm.weight": jnp.ones((hd,), jnp.float32),
        p + "attn_q.weight": random_weight(ggml_type, d, q, (), rng),
        p + "attn_k.weight": random_weight(ggml_type, d, kv, (), rng),
        p + "attn_v.weight": random_weight(ggml_type, d, kv, (), rng),
        p + "attn_output.weight": random_weight(ggml_type, q, d, (), rng),
        p + "ffn_gate_inp.weight": jnp.asarray(rng.standard_normal((e, d), np.float32)).T,
        p + "ffn_gate_exps.weight": random_weight(ggml_type, d, f, (e,), rng),
        p + "ffn_up_exps.weight": random_weight(ggml_type, d, f, (e,), rng),
        p + "ffn_down_exps.weight": random_weight(ggml_type, f, d, (e,), rng),
    })
    if arch == "gpt-oss":
      def small(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.01)
      tensors[p + "post_attention_norm.weight"] = tensors.pop(p + "ffn_norm.weight")
      del tensors[p + "attn_q_norm.weight"], tensors[p + "attn_k_norm.weight"]
      tensors.update({
          p + "attn_q.bias": small(q), p + "attn_k.bias": small(kv), p + "attn_v.bias": small(kv),
          p + "attn_output.bias": small(d), p + "attn_sinks.weight": small(s["heads"]),
          p + "ffn_gate_inp.bias": small(e),
          p + "ffn_gate_exps.bias": gf.GGUFDense(data=small(e, f), shape=(f, e)),
          p + "ffn_up_exps.bias": gf.GGUFDense(data=small(e, f), shape=(f, e)),
          p + "ffn_down_exps.bias": gf.GGUFDense(data=small(e, d), shape=(d, e)),
      })
  types = {n: ggml_type if hasattr(w, "dequantize") else "F32" for n, w in tensors.items()}
  return gguf_io.GGUFFile(path=f"<{ggml_type} model>", tensors=tensors,
                          metadata=metadata(s, layers, arch), tensor_types=types,
                          file_tensor_bytes=0)


def int4_experts(params: dict, s: dict, seed: int = 0) -> dict:
  """``params`` with random symmetric INT4 expert stacks (group 128, f16 scales: a GPTQ
  folder's ``Int4Weight [layers, E, ...]``) in place of ``blocks/moe``'s gate, up and
  down."""
  moe = params["params"]["blocks"]["moe"]
  d, f, e = s["hidden"], s["expert_ffn"], s["experts"]
  key = jax.random.key(seed)
  for i, (name, (k, n)) in enumerate((("gate", (d, f)), ("up", (d, f)), ("down", (f, d)))):
    layers = jax.tree.leaves(moe[name])[0].shape[0]  # the GGUF stack's [layers, E, ...]
    kc, ks = jax.random.split(jax.random.fold_in(key, i))
    moe[name] = qjax.Int4Weight(
        codes=jax.random.bits(kc, (layers, e, k // 8, n), jnp.uint32),
        scales=(jax.random.uniform(ks, (layers, e, k // 128, n), jnp.float32, 0.5, 1.5)
                / (8 * np.sqrt(k))).astype(jnp.float16),
        zeros=None, shape=(k, n), group_size=128)
  return params


def weight_bytes(params) -> int:
  return sum(a.nbytes for a in jax.tree.leaves(params))


def decode_rate(params, cfg, steps: int) -> float:
  """Tokens/s of ``decode_and_sample`` at batch 1 over ``steps`` tokens after 3 warm-up."""
  cache = llama.init_cache(cfg, 1, 4096)
  token, pos, key = jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), jax.random.key(0)
  for i in range(3 + steps):
    if i == 3:
      jax.block_until_ready(token)
      start = time.perf_counter()
    token, pos, cache, key = llama.decode_and_sample(params, token, pos, cache, key, cfg=cfg)
  jax.block_until_ready(token)
  return steps / (time.perf_counter() - start)


def main(argv=None) -> int:
  args = parse_args(argv)
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.arch}, "
        f"{args.layers} layers, dtype {jnp.dtype(dtype).name}", flush=True)
  rows = []
  for ggml_type in [*args.types, "BF16"]:
    gfile = model_file(args.shape, args.layers, ggml_type, arch=args.arch)
    impls = args.implementations if ggml_type != "BF16" else ["xla"]
    for impl in impls:
      implementation = None if impl == "auto" else impl
      cfg = llama.LlamaConfig.from_metadata(gfile.metadata, dtype=dtype,
                                            implementation=implementation)
      params = generate.gguf_params(  # as qjax generate loads a file
          gguf_io.GGUFFile(**{**vars(gfile), "tensors": dict(gfile.tensors)}), cfg,
          implementation)
      variants = [(ggml_type, impl, params)]
      if args.int4_experts and ggml_type != "BF16":
        params = int4_experts(params, args.shape)
        label = f"{ggml_type}, INT4 experts"
        variants = [(label, impl, params)]
        if generate._kernel_layouts(implementation) is not None:  # pylint: disable=protected-access
          kept = jax.tree.map(lambda a: a, params)
          variants = [(label, impl, generate.moe_kernel_layouts(params, cfg.dtype)),
                      (label, f"{impl}, experts kept", kept)]
      for label, name, weights in variants:
        rate = decode_rate(weights, cfg, args.steps)
        rows.append((label, name, rate, weight_bytes(weights) / 2**30))
        print(f"{label} {name}: {rate:.1f} tokens/s", flush=True)
      del params, variants
  base = rows[-1][2]
  print("\n| weights | implementation | tokens/s | vs bf16 | weights on device (GiB) |")
  print("| --- | --- | --- | --- | --- |")
  for ggml_type, impl, rate, gib in rows:
    print(f"| {ggml_type} | {impl} | {rate:.1f} | {rate / base:.2f}x | {gib:.3f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
