"""Hugging Face Llama checkpoints (safetensors + config.json) in and out of the Flax Llama.

:func:`load_hf_llama` reads a single-file or sharded checkpoint of ``model_type`` llama,
mistral, qwen2 or qwen3 (:data:`flax_layers.llama.SUPPORTED_HF_MODEL_TYPES`), dense or
INT4 (GPTQ v1 / v2 with or without act-order, AWQ GEMM, compressed-tensors pack-quantized,
picked by ``config.json``'s ``quantization_config``), into the params
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
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from flax_layers.llama import LlamaConfig
from flax_layers.llama import hf_rope_freqs
from qjax._src import checkpoint_layouts as layouts
from qjax._src import formats
from qjax._src import gguf_formats
from qjax._src import int4
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
  quant = sio.parse_quantization(config)
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

  biases = QKV_BIASES if cfg.qkv_bias else {}
  layers = []
  for i in range(cfg.num_layers):
    layer: dict = {}
    for module, kpath in LINEARS.items():
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
