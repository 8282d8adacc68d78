"""Hugging Face Llama checkpoints (safetensors + config.json) in and out of the Flax Llama.

:func:`load_hf_llama` reads a single-file or sharded checkpoint of ``model_type`` llama,
mistral, qwen2 or qwen3 (:data:`flax_layers.llama.SUPPORTED_HF_MODEL_TYPES`), dense or
INT4 (GPTQ v1 / v2 with or without act-order, AWQ GEMM, compressed-tensors pack-quantized,
picked by ``config.json``'s ``quantization_config``), or of the mixtures of experts
gpt_oss, qwen3_moe and mixtral (below), into the params
:class:`flax_layers.llama.Llama` consumes (the tree
:func:`flax_layers.llama.params_from_gguf` builds). Projections stay in their checkpoint
layout (GPTQWeight, AWQWeight, CompressedTensorsWeight; dense ones as
GGUFDense ``[N, K]``), read one tensor at a time and never dequantized; ``convert`` can
turn them into :class:`qjax.Int4Weight` for the GPU kernel.

:func:`save_hf_llama` writes such params (Int4Weight or layout projections) as a
compressed-tensors pack-quantized or a GPTQ checkpoint that the loader (and the
producers' readers) read back bit for bit.

RoPE: HF Llama's q_proj / k_proj rows are laid out for ``rotate_half`` (dims ``i`` and
``i + head_dim / 2`` of a head form a pair), while :func:`flax_layers.llama.apply_rope`
rotates adjacent pairs ``(2i, 2i + 1)``, the layout llama.cpp's converter produces by
permuting those rows. The loader applies that same permutation to the output columns
(N) of q and k, exactly, on the stored integers (:func:`qjax._src.safetensors_io.
permute_output`); q . k is unchanged because both get it, and v / o are untouched. The
exporter undoes it.

Qwen2 / Qwen3: their config runs with ``rope_neox`` (pairs ``(i, i + head_dim / 2)``,
which is rotate_half), so q / k and their biases load as stored, unpermuted. Qwen2's
``self_attn.{q,k,v}_proj.bias`` (dense, any float dtype; also when the weight is
quantized) become each projection's ``bias`` param (``cfg.qkv_bias``), Qwen3's
``self_attn.{q,k}_norm.weight`` (``[head_dim]``) the ``attn/q_norm`` / ``attn/k_norm``
scales (``cfg.qk_norm``). :func:`save_hf_llama` writes Llama only and refuses them.

Mixtures of experts (each block's ``moe`` params, :class:`flax_layers.llama.MoE`; the
router ``[E, hidden]`` becomes float32 ``[hidden, E]``; every expert stack carries a
leading ``[E]`` axis, read one tensor at a time, never dequantized):

* gpt_oss (openai/gpt-oss-20b / 120b): q / k / v / o with biases, ``self_attn.sinks``
  ``[heads]``, ``mlp.router.{weight,bias}``, and the experts' MXFP4
  ``mlp.experts.gate_up_proj_blocks [E, 2F, hidden / 32, 16]`` / ``_scales [E, 2F,
  hidden / 32]`` (uint8; ``quant_method`` "mxfp4") with ``gate_up_proj_bias [E, 2F]``,
  and ``down_proj_blocks / _scales / _bias``. gate_up interleaves its output rows (gate
  the even ones, up the odd: transformers' ``gate_up[..., ::2]`` / ``[..., 1::2]``); the
  loader splits the rows' blocks and scales as stored (``GptOssMXFP4Weight.output_rows``)
  and converts each half losslessly into the stacked :class:`qjax.MXFP4Weight` that
  ``qjax.moe_matmul`` and its MoE kernels read. A dequantized copy's bf16
  ``gate_up_proj [E, hidden, 2F]`` / ``down_proj [E, F, hidden]`` load as float stacks.
  Its config: ``layer_types`` / ``sliding_window`` and YaRN (``truncate``), see
  :meth:`flax_layers.llama.LlamaConfig.from_hf_config`. Q / k rotate as stored (NEOX).
* qwen3_moe (Qwen3-30B-A3B): Qwen3's attention, router ``mlp.gate.weight``, experts
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``; mixtral: Llama's attention (q / k
  permuted as above), router ``block_sparse_moe.gate.weight``, experts
  ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` (gate / up / down). Float experts become
  one :class:`GGUFDense` stack per projection (data ``[E, N, K]`` in the stored dtype);
  GPTQ / AWQ / compressed-tensors ones (``{prefix}.qweight`` ... per expert, as
  GPTQModel / AutoAWQ write them; the attention may be quantized too, the router is read
  dense) one :class:`qjax.Int4Weight` stack ``[E, ...]`` per projection, each expert's
  lossless ``to_int4``. Refused, naming the tensor: GPTQ act-order experts (a ``g_idx``
  other than ``k // G``: each expert would permute x its own way), zero points outside
  INT4's [0, 15] (a v1 ``qzeros`` nibble 15 reads as 16), a float expert among quantized
  ones.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from flax_layers.llama import check_not_fused
from flax_layers.llama import LlamaConfig
from flax_layers.llama import hf_rope_freqs
from qjax._src import checkpoint_layouts as layouts
from qjax._src import formats
from qjax._src import fp4
from qjax._src import gguf_formats
from qjax._src import gpt_oss_layout
from qjax._src import int4
from qjax._src import kernel_layouts
from qjax._src import moe as moe_lib
from qjax._src import safetensors_io as sio

# HF module under model.layers.{i} -> path of its kernel in the block params.
LINEARS = {
    "self_attn.q_proj": ("attn", "q", "kernel"),
    "self_attn.k_proj": ("attn", "k", "kernel"),
    "self_attn.v_proj": ("attn", "v", "kernel"),
    "self_attn.o_proj": ("attn", "o", "kernel"),
    "mlp.gate_proj": ("mlp", "gate", "kernel"),
    "mlp.up_proj": ("mlp", "up", "kernel"),
    "mlp.down_proj": ("mlp", "down", "kernel"),
}
NORMS = {
    "input_layernorm.weight": ("attn_norm", "scale"),
    "post_attention_layernorm.weight": ("ffn_norm", "scale"),
}
# Qwen2's attention biases (LlamaConfig.qkv_bias): HF module -> path of its bias param.
QKV_BIASES = {
    "self_attn.q_proj": ("attn", "q", "bias"),
    "self_attn.k_proj": ("attn", "k", "bias"),
    "self_attn.v_proj": ("attn", "v", "bias"),
}
# Qwen3's per-head q / k RMSNorms (LlamaConfig.qk_norm), each [head_dim].
QK_NORMS = {
    "self_attn.q_norm.weight": ("attn", "q_norm", "scale"),
    "self_attn.k_norm.weight": ("attn", "k_norm", "scale"),
}
EXPORT_LAYOUTS = ("compressed-tensors", "gptq")
# GPT-OSS (cfg.o_bias, cfg.attn_sinks): o_proj's bias and each head's sink logit.
O_BIAS = {"self_attn.o_proj": ("attn", "o", "bias")}
SINKS = ("self_attn.sinks", ("attn", "sinks"))
# The routed experts of an MoE model_type: the module holding them under
# model.layers.{i}, the router's name in it, and each expert's HF projection for the
# params' gate / up / down stacks (mixtral: w1 / w3 / w2).
MOE_MODULES = {
    "qwen3_moe": ("mlp", "gate", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", "gate", {"gate": "w1", "up": "w3", "down": "w2"}),
}
# GPT-OSS: mlp.router and the experts' stacked tensors, gate_up interleaved (gate the even
# output rows, up the odd: transformers' GptOssExperts, ``gate_up[..., ::2]``).
GATE_ROWS, UP_ROWS = slice(0, None, 2), slice(1, None, 2)


def linear_shape(cfg: LlamaConfig, module: str) -> tuple[int, int]:
  """The logical ``(K, N)`` of a block's linear ``module`` (a key of :data:`LINEARS`)."""
  h, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
  return {"self_attn.q_proj": (h, cfg.num_heads * hd),
          "self_attn.k_proj": (h, cfg.num_kv_heads * hd),
          "self_attn.v_proj": (h, cfg.num_kv_heads * hd),
          "self_attn.o_proj": (cfg.num_heads * hd, h),
          "mlp.gate_proj": (h, ffn), "mlp.up_proj": (h, ffn),
          "mlp.down_proj": (ffn, h)}[module]


def rope_permutation(num_heads: int, head_dim: int) -> np.ndarray:
  """``[num_heads * head_dim]`` int: column ``perm[c]`` of an HF q / k projection becomes
  column ``c``, so pair ``(i, i + head_dim / 2)`` of each head lands on ``(2i, 2i + 1)``
  (llama.cpp's ``permute``: ``reshape(heads, 2, head_dim / 2).swapaxes(1, 2)``)."""
  n = num_heads * head_dim
  return np.arange(n).reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(n)


def _rope_heads(cfg: LlamaConfig, module: str) -> int | None:
  """The heads whose rows the loader permutes for adjacent-pair RoPE in ``module`` (q / k
  of a Llama); None for the others and for a ``rope_neox`` model (Qwen2 / Qwen3), which
  rotates HF's rotate_half pairs as stored."""
  if cfg.rope_neox:
    return None
  return {"self_attn.q_proj": cfg.num_heads,
          "self_attn.k_proj": cfg.num_kv_heads}.get(module)


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _stack(layers: list[Any], what: str) -> Any:
  """Stacks one parameter of every layer along a new leading axis."""
  if all(isinstance(w, layouts.GPTQWeight) for w in layers) and (
      len({w.g_idx is None for w in layers}) > 1):
    # Some layers have act-order, some a trivial g_idx (dropped at load): give them all one.
    layers = [w if w.g_idx is not None else dataclasses.replace(
        w, g_idx=jnp.arange(w.shape[0], dtype=jnp.int32) // w.group_size) for w in layers]
  try:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  except ValueError as e:
    raise ValueError(f"{what}: the layers cannot be stacked for the scan ({e}); load with "
                     "scan_layers=False, or convert the projections to Int4Weight") from None


def _progress(ckpt_names: int, enabled: bool, desc: str):
  if not enabled:
    return None
  try:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tqdm(total=ckpt_names, desc=desc, unit="tensor")


def parse_quantization(config: dict[str, Any]) -> sio.Quantization | None:
  """The INT4 scheme of a ``config.json`` (:func:`qjax._src.safetensors_io.
  parse_quantization`); None for a dense checkpoint and for GPT-OSS's ``quant_method``
  "mxfp4", whose only quantized tensors are the experts' ``*_blocks`` / ``*_scales``
  (read as such by :func:`load_hf_llama`; its other projections are dense)."""
  qc = config.get("quantization_config")
  if config.get("model_type") == "gpt_oss" and qc:
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method != "mxfp4":
      raise ValueError(f"quantization_config quant_method={method!r} is not supported for "
                       "gpt_oss; qjax reads its MXFP4 experts ('mxfp4') or a float copy")
    return None
  return sio.parse_quantization(config)


def load_hf_llama(path: str | os.PathLike[str], *,
                  convert: Callable[[str, Any], Any] | None = None,
                  scan_layers: bool = True, progress: bool = True,
                  **options: Any) -> tuple[LlamaConfig, dict]:
  """The config and Flax params of a Hugging Face Llama checkpoint folder.

  Args:
    path: a folder with ``config.json`` and ``model.safetensors`` or
      ``model.safetensors.index.json`` with its shards.
    convert: optional ``fn(tensor_prefix, weight) -> weight`` applied to each
      projection (after the RoPE permutation; not to biases or norms), e.g.
      ``lambda n, w: w.to_int4()`` for the GPU kernel. (GPTQ act-order weights give
      ``(Int4Weight, perm)`` there: keep them as GPTQWeight.)
    scan_layers: stacked ``blocks`` (True) or per-layer ``layers_{i}``; also set on the
      returned config.
    progress: a tqdm bar over the tensors read, when tqdm is installed.
    **options: further :class:`LlamaConfig` run options (dtype, implementation).

  Returns:
    ``(cfg, {"params": {"embed", "blocks" | "layers_{i}", "final_norm", ["lm_head"]}})``:
    ``embed`` a GGUFDense ``[K=hidden, N=vocab]``, projections as stored (dense ones as
    GGUFDense), norms and Qwen2's q / k / v biases as arrays. ``lm_head`` is absent when
    ``tie_word_embeddings``; ``rope_freqs`` (``[head_dim // 2]`` float32) is there under
    llama3 rope_scaling (:func:`flax_layers.llama.hf_rope_freqs`).

  Raises:
    ValueError: one message naming the tensor that is missing (a qwen2 bias, a qwen3
      q / k norm among them), has a shape or dtype that disagrees with config.json, or
      whose K the group size does not divide, or a bias the model does not add; or
      naming the config key qjax cannot run.
  """
  path = pathlib.Path(path)
  config = sio.read_config(path)
  cfg = LlamaConfig.from_hf_config(config, scan_layers=scan_layers, **options)
  quant = parse_quantization(config)
  try:
    params = _read_params(path, config, cfg, quant, convert, progress)
  except ValueError as e:
    msg = str(e)
    raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
  return cfg, {"params": params}


def _read_params(path, config, cfg, quant, convert, progress) -> dict:
  ckpt = sio.Checkpoint(path)
  bar = _progress(len(ckpt.names()), progress, f"loading {path.name}")
  if bar is not None:
    ckpt.on_read = lambda name: bar.update(1)
  try:
    return _read_params_from(ckpt, config, cfg, quant, convert)
  finally:
    if bar is not None:
      bar.close()


def _vector(ckpt: sio.Checkpoint, name: str, size: int,
            why: str = "norm weight of hidden_size={size}") -> jax.Array:
  a = ckpt.get(name)
  sio._check(name, a, (size,), sio.DENSE_DTYPES, why.format(size=size))
  return jnp.asarray(a)


def _read_params_from(ckpt, config, cfg, quant, convert) -> dict:
  model_type = config.get("model_type")

  def need(name):
    if name not in ckpt:
      raise ValueError(f"tensor {name!r} is missing from the checkpoint (every layer "
                       f"of a {model_type} model has one)")
    return name

  def linear(prefix, k, n, heads=None, bias=False):
    if not bias and f"{prefix}.bias" in ckpt:
      raise ValueError(f"tensor {prefix + '.bias'!r}: qjax's {model_type} model has no "
                       "bias on this projection (projection biases are not supported)")
    w = sio.read_linear(ckpt, prefix, k, n, quant)
    if heads is not None:
      w = sio.permute_output(w, rope_permutation(heads, cfg.head_dim))
    w = sio.to_device(w)
    return w if convert is None else convert(prefix, w)

  biases = {**(QKV_BIASES if cfg.qkv_bias else {}), **(O_BIAS if cfg.o_bias else {})}
  # An MoE's blocks have experts (layer["moe"]) in place of the dense MLP.
  linears = {m: p for m, p in LINEARS.items() if not (cfg.moe and p[0] == "mlp")}
  layers = []
  for i in range(cfg.num_layers):
    layer: dict = {}
    for module, kpath in linears.items():
      k, n = linear_shape(cfg, module)
      prefix = f"model.layers.{i}.{module}"
      _set(layer, kpath, linear(prefix, k, n, _rope_heads(cfg, module),
                                bias=module in biases))
      if module in biases:  # as stored: a rope_neox model's q / k rows are not permuted
        _set(layer, biases[module], _vector(ckpt, need(f"{prefix}.bias"), n,
                                            f"{module} bias of N={{size}} from config.json"))
    for name, npath in NORMS.items():
      _set(layer, npath, _vector(ckpt, f"model.layers.{i}.{name}", cfg.hidden_size))
    if cfg.qk_norm:
      for name, npath in QK_NORMS.items():
        _set(layer, npath, _vector(ckpt, need(f"model.layers.{i}.{name}"), cfg.head_dim,
                                   "per-head norm weight of head_dim={size} from "
                                   "config.json"))
    if cfg.attn_sinks:
      _set(layer, SINKS[1], _vector(ckpt, need(f"model.layers.{i}.{SINKS[0]}"),
                                    cfg.num_heads, "one sink logit per head of "
                                    "num_attention_heads={size} from config.json"))
    if cfg.moe:
      layer["moe"] = _read_experts(ckpt, i, cfg, model_type, quant, need)
    layers.append(layer)

  params: dict = {}
  emb_name = "model.embed_tokens.weight"
  emb = ckpt.get(emb_name)
  sio._check(emb_name, emb, (cfg.vocab_size, cfg.hidden_size), sio.DENSE_DTYPES,
             "dense [vocab_size, hidden_size] from config.json")
  params["embed"] = gguf_formats.GGUFDense(data=jnp.asarray(emb),
                                           shape=(cfg.hidden_size, cfg.vocab_size))
  if cfg.scan_layers:
    flat = [jax.tree_util.tree_flatten_with_path(
        layer, is_leaf=formats.is_quantized)[0] for layer in layers]
    blocks: dict = {}
    for j, (kp, _) in enumerate(flat[0]):
      keys = tuple(p.key for p in kp)
      _set(blocks, keys, _stack([f[j][1] for f in flat], "model.layers.*." + ".".join(keys)))
    params["blocks"] = blocks
  else:
    for i, layer in enumerate(layers):
      params[f"layers_{i}"] = layer
  del layers
  params["final_norm"] = {"scale": _vector(ckpt, "model.norm.weight", cfg.hidden_size)}
  if not config.get("tie_word_embeddings", False):
    if "lm_head.weight" not in ckpt and not any(
        f"lm_head.{s}" in ckpt for s in sio.quantized_suffixes(quant)):
      raise ValueError("tensor 'lm_head.weight' is missing from the checkpoint "
                       "(config.json has tie_word_embeddings=false)")
    params["lm_head"] = linear("lm_head", cfg.hidden_size, cfg.vocab_size)
  rope_freqs = hf_rope_freqs(config, cfg)  # Llama 3.1 / 3.2's llama3 rope scaling
  if rope_freqs is not None:
    params["rope_freqs"] = jnp.asarray(rope_freqs)
  return params


# -------------------------------------------------------------------------------- experts


def _float32(ckpt: sio.Checkpoint, name: str, shape: tuple[int, ...], why: str) -> jax.Array:
  """A dense tensor of ``shape`` (a router, an expert bias) as float32."""
  a = ckpt.get(name)
  sio._check(name, a, shape, sio.DENSE_DTYPES, why)
  return jnp.asarray(np.asarray(a, np.float32))


def _router(ckpt: sio.Checkpoint, name: str, cfg: LlamaConfig) -> jax.Array:
  """The router ``[E, hidden]`` (torch Linear) as the params' float32 ``[hidden, E]``."""
  e, d = cfg.num_experts, cfg.hidden_size
  return _float32(ckpt, name, (e, d), f"dense [experts={e}, hidden_size={d}] from "
                  "config.json").T


def _expert_stack(ckpt: sio.Checkpoint, prefixes: list[str], k: int, n: int,
                  quant: sio.Quantization | None) -> Any:
  """The experts ``prefixes`` (one torch Linear each, logical ``[K, N]``) as one stack
  that :func:`qjax.moe_matmul` takes: float ones as a :class:`GGUFDense` of data ``[E, N,
  K]`` in their stored dtype, read one at a time into the stack; GPTQ / AWQ /
  compressed-tensors ones as an :class:`qjax.Int4Weight` stack (:func:`_int4_stack`)."""
  first = sio.read_linear(ckpt, prefixes[0], k, n, quant)
  if not isinstance(first, gguf_formats.GGUFDense):
    return _int4_stack([first, *(sio.read_linear(ckpt, p, k, n, quant)
                                 for p in prefixes[1:])], prefixes)
  data = np.empty((len(prefixes), n, k), first.data.dtype)
  data[0] = first.data
  for e, prefix in enumerate(prefixes[1:], 1):
    w = sio.read_linear(ckpt, prefix, k, n, quant)
    if not isinstance(w, gguf_formats.GGUFDense) or w.data.dtype != data.dtype:
      got = (np.dtype(w.data.dtype).name if isinstance(w, gguf_formats.GGUFDense)
             else type(w).__name__)
      raise ValueError(f"expert {prefix!r} is stored as {got} and expert {prefixes[0]!r} as "
                       f"{data.dtype.name}; the experts of a projection stack into one "
                       "array, which needs one dtype")
    data[e] = w.data
  return gguf_formats.GGUFDense(data=jnp.asarray(data), shape=(k, n))


def _int4_stack(ws: list[Any], prefixes: list[str]) -> Any:
  """Quantized experts as one :class:`qjax.Int4Weight` stack (each expert's lossless
  conversion, ``kernel_layouts.convert_to``), where :func:`qjax.moe_matmul` takes one."""
  if int4.Int4Weight not in moe_lib.MOE_FORMATS:
    raise ValueError(f"expert {prefixes[0]!r} is quantized ({type(ws[0]).__name__}); "
                     "qjax.moe_matmul takes no INT4 expert stack in this version, so "
                     "quantized mixture-of-experts checkpoints are not supported: use the "
                     "float (bf16 / fp16) checkpoint, or a GGUF file of the model")
  out = [_expert_int4(w, p, prefixes[0], type(ws[0]).__name__) for w, p in zip(ws, prefixes)]
  try:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *out)
  except ValueError as e:
    raise ValueError(f"experts {prefixes[0]!r} ...: their INT4 forms do not stack ({e}); "
                     "the experts of a projection need one group size and zero-point "
                     "scheme") from None


# The tensor holding a layout's zero points (named where they do not fit INT4).
_ZEROS_TENSOR = {layouts.GPTQWeight: "qzeros", layouts.AWQWeight: "qzeros",
                 layouts.CompressedTensorsWeight: "weight_zero_point"}


def _expert_int4(w: Any, prefix: str, first: str, first_kind: str) -> int4.Int4Weight:
  """Expert ``prefix``'s lossless :class:`qjax.Int4Weight`, or the ValueError that names
  the tensor keeping it from one and says what to do."""
  if isinstance(w, gguf_formats.GGUFDense):
    raise ValueError(f"tensor {prefix + '.weight'!r} is a float expert beside quantized "
                     f"ones ({first!r} is {first_kind}); the experts of a projection stack "
                     "into one INT4 array: quantize every expert, or load the float "
                     "checkpoint")
  if isinstance(w, layouts.GPTQWeight) and w.g_idx is not None:  # read_linear drops k // G
    raise ValueError(f"tensor {prefix + '.g_idx'!r} orders the rows by activation (GPTQ "
                     "desc_act / act-order): each expert would need its own permutation "
                     "of x, which qjax's INT4 expert stacks do not apply; use a checkpoint "
                     "quantized with desc_act=false (or static_groups=true), or the float "
                     "checkpoint")
  try:
    w4 = kernel_layouts.convert_to(w, int4.Int4Weight)
  except ValueError as e:  # zero points INT4 cannot hold
    name = f"{prefix}.{_ZEROS_TENSOR.get(type(w), 'qzeros')}"
    raise ValueError(f"tensor {name!r}: {e}. qjax's INT4 expert stacks need zero points "
                     "in [0, 15] (all 8 where quantization_config has sym=true): "
                     "re-quantize (GPTQModel's checkpoint_format gptq_v2 stores a zero "
                     "point of 0 as is), or load the float checkpoint") from None
  if not isinstance(w4, int4.Int4Weight):
    raise ValueError(f"expert {prefix!r} ({type(w).__name__}) has no Int4Weight form, "
                     "which an INT4 expert stack needs; load the float checkpoint")
  return w4


def _read_experts(ckpt: sio.Checkpoint, i: int, cfg: LlamaConfig, model_type: str,
                  quant: sio.Quantization | None, need: Callable[[str], str]) -> dict:
  """Layer ``i``'s ``moe`` params (:class:`flax_layers.llama.MoE`): ``router`` float32
  ``[hidden, E]``, the ``gate`` / ``up`` stacks of logical ``(hidden, F)`` and ``down`` of
  ``(F, hidden)``, each with a leading ``[E]`` axis (and GPT-OSS's biases)."""
  if model_type == "gpt_oss":
    return _gpt_oss_experts(ckpt, f"model.layers.{i}.mlp", cfg, need)
  module, router, names = MOE_MODULES[model_type]
  prefix = f"model.layers.{i}.{module}"
  if f"{prefix}.{router}.bias" in ckpt:
    raise ValueError(f"tensor {prefix + '.' + router + '.bias'!r}: qjax's {model_type} "
                     "router has no bias")
  dense = [n for n in (f"model.layers.{i}.mlp.{m}.weight" for m in
                       ("gate_proj", "up_proj", "down_proj")) if n in ckpt]
  if dense:
    raise ValueError(f"tensor {dense[0]!r} is a dense MLP weight in a {model_type} model "
                     f"of {cfg.num_experts} experts; qjax runs experts in every layer")
  out = {"router": _router(ckpt, need(f"{prefix}.{router}.weight"), cfg)}
  d, f = cfg.hidden_size, cfg.expert_ffn_size
  for param, hf_name in names.items():
    k, n = (f, d) if param == "down" else (d, f)
    out[param] = _expert_stack(ckpt, [f"{prefix}.experts.{e}.{hf_name}"
                                      for e in range(cfg.num_experts)], k, n, quant)
  return out


# GptOssMXFP4Weight -> the stacked MXFP4Weight the MoE kernels read (lossless), compiled
# once per shape: eagerly, the unpacked codes' uint32 planes of a GPT-OSS-20B layer would
# be materialized one op at a time.
_TO_MXFP4 = jax.jit(functools.partial(kernel_layouts.convert_to, target=fp4.MXFP4Weight))


def _gpt_oss_weight(ckpt: sio.Checkpoint, name: str, k: int, n: int, e: int) -> Any:
  """GPT-OSS's experts ``name`` of logical ``[K, N]`` each: MXFP4 ``{name}_blocks`` ``[E,
  N, K / 32, 16]`` / ``{name}_scales`` ``[E, N, K / 32]`` (uint8) as a
  :class:`qjax.GptOssMXFP4Weight` as stored, or the dequantized ``{name}`` ``[E, K, N]``
  (transformers' ``x @ W``; bf16 copies of GPT-OSS) as a :class:`GGUFDense` ``[E, N, K]``."""
  parts = [f"{name}_blocks", f"{name}_scales"]
  if any(p in ckpt for p in parts):
    missing = [p for p in parts if p not in ckpt]
    if missing:
      raise ValueError(f"tensor {missing[0]!r} is missing from the checkpoint (the MXFP4 "
                       f"experts {name!r} need their _blocks and _scales)")
    if k % 32:
      raise ValueError(f"{name}: MXFP4 experts need K={k} (from config.json) a multiple of 32")
    why = f"MXFP4 experts of {e} x (K={k}, N={n}) from config.json"
    for part, shape in zip(parts, [(e, n, k // 32, 16), (e, n, k // 32)]):
      if ckpt.shape(part) != shape:  # from the header, before the data is read
        raise ValueError(f"tensor {part!r} has shape {ckpt.shape(part)}, want {shape} "
                         f"({why})")
    w = gpt_oss_layout.read_gpt_oss_mxfp4(ckpt, name)
    sio._check(parts[0], np.asarray(w.blocks), (e, n, k // 32, 16), [np.uint8], why)
    sio._check(parts[1], np.asarray(w.scales), (e, n, k // 32), [np.uint8], why)
    return w
  if name not in ckpt:
    raise ValueError(f"tensors {parts[0]!r} / {parts[1]!r} (MXFP4) or {name!r} (float) are "
                     "missing from the checkpoint (every layer of a gpt_oss model has them)")
  a = ckpt.get(name)
  sio._check(name, a, (e, k, n), sio.DENSE_DTYPES,
             f"dense [experts={e}, K={k}, N={n}] (x @ W) from config.json")
  return gguf_formats.GGUFDense(data=np.ascontiguousarray(np.swapaxes(a, -1, -2)),
                                shape=(k, n))


def _gpt_oss_rows(w: Any, rows: slice) -> Any:
  """The output rows ``rows`` of a :func:`_gpt_oss_weight` (lossless), MXFP4 ones as the
  stacked :class:`qjax.MXFP4Weight` of :func:`qjax.moe_matmul` and its kernels."""
  if isinstance(w, gpt_oss_layout.GptOssMXFP4Weight):
    return _TO_MXFP4(w.output_rows(rows))
  data = np.ascontiguousarray(w.data[..., rows, :])
  return gguf_formats.GGUFDense(data=jnp.asarray(data), shape=(w.shape[0], data.shape[-2]))


def _gpt_oss_experts(ckpt: sio.Checkpoint, prefix: str, cfg: LlamaConfig,
                     need: Callable[[str], str]) -> dict:
  """A GPT-OSS layer's ``moe`` params from ``{prefix}.router.{weight,bias}`` and
  ``{prefix}.experts.*``: ``gate_up_proj`` (its blocks, scales and bias) split into the
  gate (even output rows) and up (odd) stacks, as llama.cpp's converter does; the
  biases float32 (``router_bias [E]``, ``gate_bias`` / ``up_bias [E, F]``, ``down_bias
  [E, hidden]``)."""
  d, f, e = cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts
  experts = f"{prefix}.experts"
  out = {"router": _router(ckpt, need(f"{prefix}.router.weight"), cfg),
         "router_bias": _float32(ckpt, need(f"{prefix}.router.bias"), (e,),
                                 f"[experts={e}] from config.json")}
  gate_up = _gpt_oss_weight(ckpt, f"{experts}.gate_up_proj", d, 2 * f, e)
  out["gate"], out["up"] = _gpt_oss_rows(gate_up, GATE_ROWS), _gpt_oss_rows(gate_up, UP_ROWS)
  del gate_up
  out["down"] = _gpt_oss_rows(_gpt_oss_weight(ckpt, f"{experts}.down_proj", f, d, e),
                              slice(None))
  bias = _float32(ckpt, need(f"{experts}.gate_up_proj_bias"), (e, 2 * f),
                  f"[experts={e}, 2 x intermediate_size={f}] from config.json")
  out["gate_bias"], out["up_bias"] = bias[:, GATE_ROWS], bias[:, UP_ROWS]
  out["down_bias"] = _float32(ckpt, need(f"{experts}.down_proj_bias"), (e, d),
                              f"[experts={e}, hidden_size={d}] from config.json")
  return out


# ------------------------------------------------------------------------------- export


def _layers_of(params: dict, cfg: LlamaConfig) -> list[dict]:
  if "blocks" in params:
    blocks = params["blocks"]
    return [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(cfg.num_layers)]
  return [params[f"layers_{i}"] for i in range(cfg.num_layers)]


def _get(tree: dict, path: tuple[str, ...]) -> Any:
  for p in path:
    tree = tree[p]
  return tree


def _is_dense(w: Any) -> bool:
  return isinstance(w, gguf_formats.GGUFDense) or not formats.is_quantized(w)


def _exportable(w: Any, name: str) -> Any:
  """``w`` as a weight the export writes: dense, Int4Weight or a GPTQ / AWQ /
  compressed-tensors layout. Others go through their lossless ``to_int4()`` (GGUF Q4_0,
  Q4_1); a format without one raises the ValueError naming ``name``."""
  if _is_dense(w) or isinstance(w, (int4.Int4Weight, layouts.GPTQWeight, layouts.AWQWeight,
                                    layouts.CompressedTensorsWeight)):
    return w
  if hasattr(w, "to_int4"):
    return w.to_int4()
  sio.Int4Parts.of(w, name)  # raises the ValueError: no INT4 form
  return w


def _symmetric(w: Any) -> bool:
  if isinstance(w, layouts.AWQWeight):
    return False
  if isinstance(w, layouts.GPTQWeight):
    return w.symmetric
  if isinstance(w, layouts.CompressedTensorsWeight):
    return w.weight_zero_point is None
  return getattr(w, "zeros", None) is None


def _check_hf_llama(cfg: LlamaConfig) -> None:
  """A ValueError where ``cfg`` is no HF Llama model."""
  if cfg.rope_dim != cfg.head_dim:
    raise ValueError(f"rope_dim={cfg.rope_dim} != head_dim={cfg.head_dim}: HF Llama rotates "
                     "whole heads, so this model has no HF config")
  if cfg.moe:  # a Mixtral / Qwen3-MoE GGUF's params: expert stacks, no mlp
    raise ValueError(f"num_experts={cfg.num_experts}: a mixture-of-experts model; the HF "
                     "Llama export writes dense llama models only")
  other = [k for k in ("rope_neox", "qkv_bias", "qk_norm") if getattr(cfg, k)]
  if other:  # a Qwen2 / Qwen3 GGUF's params: unpermuted q / k, biases or q / k norms
    raise ValueError(f"{', '.join(f'{k}=True' for k in other)}: not a Llama model (e.g. "
                     "Qwen2 / Qwen3); the HF Llama export writes llama models only")
  # GPT-OSS's attention options: a Llama config.json has no place for them, and a model
  # saved without them would load as another model.
  extra = [f"{k}=True" for k in ("o_bias", "attn_sinks") if getattr(cfg, k)]
  extra += [f"sliding_window={cfg.sliding_window}"] if cfg.sliding_window else []
  extra += ["yarn (RoPE scaling)"] if cfg.yarn is not None else []
  if extra:
    raise ValueError(f"{', '.join(extra)}: the HF Llama config has no place for these "
                     "(GPT-OSS's attention options), so the saved model would lose them; "
                     "the HF Llama export writes plain llama models only")


def hf_config(cfg: LlamaConfig, *, tie_word_embeddings: bool, torch_dtype: str
              ) -> dict[str, Any]:
  """The architecture part of ``config.json`` for ``cfg``."""
  _check_hf_llama(cfg)
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_eps,
      "rope_theta": cfg.rope_base, "rope_scaling": None,
      "max_position_embeddings": cfg.context_length, "hidden_act": "silu",
      "attention_bias": False, "mlp_bias": False,
      "tie_word_embeddings": tie_word_embeddings, "torch_dtype": torch_dtype,
  }


def save_hf_llama(path: str | os.PathLike[str], params: dict, cfg: LlamaConfig, *,
                  layout: str = "compressed-tensors", zero_point_version: int = 1,
                  max_shard_bytes: int | None = None) -> list[str]:
  """Writes Llama params as a Hugging Face INT4 checkpoint folder.

  Projections (and a quantized ``lm_head``) that are Int4Weight, GPTQWeight, AWQWeight,
  CompressedTensorsWeight (or have a ``to_int4()``, e.g. GGUF Q4_0) are written in
  ``layout``; dense ones (GGUFDense) as ``.weight`` and, for compressed-tensors, listed in
  ``ignore``. The embedding is written dense (a quantized one is dequantized to the
  scales' dtype). q / k columns are permuted back to HF's rotate_half order.

  Args:
    path: the folder to write (``config.json``, safetensors file(s), index).
    params: ``{"params": ...}`` as :func:`load_hf_llama` or
      :func:`flax_layers.llama.params_from_gguf` return (either layer layout).
    cfg: the model's config.
    layout: "compressed-tensors" (pack-quantized) or "gptq".
    zero_point_version: GPTQ only: 1 (``checkpoint_format`` "gptq", what most readers
      expect; stores ``z - 1``, so a zero point of 0 does not fit) or 2 ("gptq_v2").
    max_shard_bytes: split into shards with an index above this size.

  Returns:
    The safetensors file names written.

  Raises:
    ValueError: naming the parameter that cannot be stored (float biases, act-order
      into compressed-tensors, a zero point outside the format's range) or the group
      sizes that differ between layers.
  """
  if layout not in EXPORT_LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {EXPORT_LAYOUTS}")
  if zero_point_version not in (1, 2):
    raise ValueError(f"zero_point_version={zero_point_version!r} must be 1 or 2")
  _check_hf_llama(cfg)
  p = params.get("params", params)
  if "rope_freqs" in p:
    raise ValueError("the params hold rope_freqs (llama3 rope scaling), which config.json "
                     "keeps as rope_scaling's four numbers, not as factors; save_hf_llama "
                     "writes unscaled models only")
  check_not_fused(p, "save the params as loaded (before fuse_projections): HF "
                  "Llama stores q / k / v and gate / up apart")  # was KeyError 'q'
  linears: dict[str, tuple[Any, int | None]] = {}  # HF prefix -> (weight, rope heads)
  norms: dict[str, Any] = {}
  for i, layer in enumerate(_layers_of(p, cfg)):
    for module, kpath in LINEARS.items():
      linears[f"model.layers.{i}.{module}"] = (_get(layer, kpath), _rope_heads(cfg, module))
    for name, npath in NORMS.items():
      norms[f"model.layers.{i}.{name}"] = _get(layer, npath)
  if "lm_head" in p:
    linears["lm_head"] = (p["lm_head"], None)

  linears = {n: (_exportable(w, n), heads) for n, (w, heads) in linears.items()}
  quantized = {n: w for n, (w, _) in linears.items() if not _is_dense(w)}
  if not quantized:
    raise ValueError("no quantized projection in params; nothing to export as INT4")
  group_sizes = {n: (-1 if w.group_size == w.shape[0] else w.group_size)
                 for n, w in quantized.items()}
  if len(set(group_sizes.values())) > 1:
    raise ValueError(f"group sizes differ between projections "
                     f"({sorted(set(group_sizes.items()), key=lambda t: t[1])[:2]}); the "
                     "checkpoint's quantization_config holds one group_size")
  group_size = next(iter(group_sizes.values()))
  symmetric = all(_symmetric(w) for w in quantized.values())
  first = next(iter(quantized.values()))
  scale_dtype = np.dtype(getattr(first, "scales", getattr(first, "weight_scale", None)).dtype)

  tensors: dict[str, np.ndarray] = {}
  emb = p["embed"]
  tensors["model.embed_tokens.weight"] = sio.dense_array(emb, scale_dtype)
  desc_act = False
  for prefix, (w, heads) in linears.items():
    inv = None if heads is None else np.argsort(rope_permutation(heads, cfg.head_dim))
    if _is_dense(w):
      a = sio.dense_array(w, scale_dtype)  # [N, K]
      tensors[f"{prefix}.weight"] = a if inv is None else np.ascontiguousarray(a[inv])
      continue
    parts = sio.Int4Parts.of(w, prefix)
    if inv is not None:
      parts = parts.permute_output(inv)
    if layout == "gptq":
      desc_act |= parts.g_idx is not None
      tensors.update(sio.gptq_tensors(parts, prefix, zero_point_version))
    else:
      tensors.update(sio.compressed_tensors_tensors(parts, prefix, symmetric))
  for name, v in norms.items():
    tensors[name] = np.asarray(v)
  tensors["model.norm.weight"] = np.asarray(p["final_norm"]["scale"])

  config = hf_config(cfg, tie_word_embeddings="lm_head" not in p,
                     torch_dtype={"float16": "float16", "bfloat16": "bfloat16"}.get(
                         scale_dtype.name, "float32"))
  dense = sorted(n[:-len(".weight")] for n in tensors
                 if n.endswith(".weight") and n[:-len(".weight")] in linears)
  if layout == "gptq":
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size,
        "desc_act": desc_act, "sym": symmetric, "lm_head": "lm_head" in quantized,
        "true_sequential": True,
        "checkpoint_format": "gptq" if zero_point_version == 1 else "gptq_v2"}
  else:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric,
               "group_size": None if group_size == -1 else group_size,
               "strategy": "channel" if group_size == -1 else "group",
               "dynamic": False, "actorder": None, "observer": "minmax",
               "block_structure": None, "observer_kwargs": {}}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None,
                                      "output_activations": None,
                                      "format": "pack-quantized"}},
        # lm_head is a Linear in torch even when tied: keep it out unless quantized.
        "ignore": sorted(set(dense) | ({"lm_head"} - set(quantized)))}
  return sio.write_checkpoint(path, tensors, config, max_shard_bytes=max_shard_bytes)
