"""Hugging Face mixture-of-experts checkpoint folders in ``load_hf_llama`` and ``qjax generate
--model FOLDER``: GPT-OSS (``gpt_oss``, MXFP4 experts), Qwen3-MoE (``qwen3_moe``) and
Mixtral (``mixtral``) with float experts, against independent float64 references.

GPT-OSS: a tiny model of :mod:`test_gpt_oss_gguf`'s shapes (three layers, 0 and 2 sliding
over a window of 8; 8 heads of 64 over 2 KV heads; 8 experts of 256, 4 per token; YaRN
factor 32 over 4096, base 150000) written with ``safetensors.numpy.save_file`` exactly as
openai/gpt-oss-20b lays it out: bf16 attention with q / k / v / o biases,
``self_attn.sinks [heads]``, ``mlp.router.{weight,bias}``, the experts as uint8 MXFP4
``mlp.experts.gate_up_proj_blocks [E, 2F, hidden / 32, 16]`` / ``_scales [E, 2F, hidden /
32]`` with gate and up INTERLEAVED along 2F (gate the even rows, up the odd:
transformers' ``gate_up[..., ::2]``), ``gate_up_proj_bias [E, 2F]`` likewise, and
``down_proj_blocks / _scales / _bias``; config.json as GPT-OSS-20B's (``quant_method``
"mxfp4", ``layer_types``, ``sliding_window``, YaRN ``rope_scaling`` with ``truncate:
false``, ``swiglu_limit`` 7); an o200k-style ``tokenizer.json`` with Harmony's special
tokens and a ``chat_template.jinja``. The MXFP4 blocks are gguf-py's
``gguf.quants.quantize(..., MXFP4)`` re-laid-out (llama.cpp's converter does the inverse:
ggml keeps the low nibbles of a block for its first 16 values, GPT-OSS for the even
ones). The reference is :func:`test_gpt_oss_gguf._reference_logits` (float64, llama.cpp's
graph) fed the folder's weights as this file's own numpy transcription of transformers'
``convert_moe_packed_tensors`` dequantizes them, its YaRN's correction dims left
fractional as transformers' ``truncate: false`` (``_hf_yarn64``). The same weights are
also written as a GGUF file (F32, MXFP4 experts split into gate and up) whose logits the
folder's must equal, with ``truncate: true`` (ggml rounds the correction dims).

Qwen3-MoE and Mixtral: :mod:`test_moe_gguf`'s tiny models (two layers, 8 experts, 2 per
token) written as HF folders of their float32 dequantized weights (per-expert
``mlp.experts.{e}.{gate,up,down}_proj`` / ``block_sparse_moe.experts.{e}.w1 / w3 / w2``,
Mixtral's q / k rows put back in HF's rotate_half order by the inverse of llama.cpp's
``permute``), against :func:`test_generation_audit._reference_logits` with its MoE option.

Measured on the CPU (float32): GPT-OSS logits of the prompt (15 tokens) and its
continuation (8) within 3.2e-6 of the largest reference logit, scanned and unrolled;
prefill then cached decode within 1.7e-6; the GGUF file's and the folder's logits equal
bit for bit (the test allows 1e-6), both 3.8e-6 from the reference; Qwen3-MoE and
Mixtral within 1.4e-6 and 1.2e-6 (prefill then cached decode 1.4e-6 and 1.1e-6).

By hand (not kept as tests), how far the folder's logits move from the reference (max
over the prompt and continuation, relative to the largest logit; the tests allow 1e-5)
and how many of the 8 greedy picks change, when the loader is broken on purpose: gate
and up de-interleaved the wrong way round 104% (8 of 8); the sinks dropped (-inf) 77% (2
of 8); YaRN's correction dims rounded as ggml's (``truncate: false`` ignored) 2.0e-3 (0
of 8). Mixtral's q / k rows left unpermuted 102% (8 of 8); its w1 / w3 taken as up /
gate 91% (7 of 8).
"""

from __future__ import annotations

import contextlib
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytest.importorskip("jinja2")

import qjax  # noqa: E402
import test_generate_spm_gguf as spm_gguf  # noqa: E402
import test_generation_audit as audit  # noqa: E402
import test_gpt_oss_gguf as gg  # noqa: E402
import test_moe_gguf as moe_gguf  # noqa: E402
import test_qwen_gguf as qwen  # noqa: E402
from conftest import seed_from  # noqa: E402
from flax_layers import hf_checkpoint as hf  # noqa: E402
from flax_layers import llama  # noqa: E402
from qjax._src import tokenizer as tokenizer_lib  # noqa: E402

QT = gguf.GGMLQuantizationType
MT = gguf.MODEL_TENSOR
BF16 = ml_dtypes.bfloat16
E, K_TOP, F, D = gg.EXPERTS, gg.TOP_K, gg.EXPERT_FFN, gg.HIDDEN
PROMPT = gg.PROMPT
# transformers' FP4_VALUES (integrations/mxfp4.py): E2M1 code -> value.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
END_IDS = ("<|return|>", "<|endoftext|>")


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Logits are compared with float64 at 1e-5: float32 dots at float32 accuracy on a GPU
  too (its default is one TF32 product)."""
  with jax.default_matmul_precision("highest"):
    yield


# --- MXFP4: gguf-py's blocks in GPT-OSS's layout, and transformers' dequantization. -----


def _gguf_to_hf_mxfp4(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  """gguf-py's MXFP4 rows ``[..., N, K / 32 * 17]`` (per block: the E8M0 byte, then 16
  bytes whose low nibbles hold values 0-15 and high nibbles 16-31) as GPT-OSS's
  ``(blocks [..., N, K / 32, 16], scales [..., N, K / 32])`` (byte ``b``: value ``2b`` low,
  ``2b + 1`` high)."""
  lead = raw.shape[:-2]
  b = raw.reshape(*lead, n, k // 32, 17)
  scales, qs = b[..., 0], b[..., 1:]
  codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [..., 32] in value order
  blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
  return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)


def _dequantize_hf_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """transformers' ``_convert_moe_packed_tensors`` in numpy, float64: ``[..., N, K]``
  (before its final transpose): low nibble first, ``ldexp(FP4_VALUES[code], scale -
  127)``."""
  values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
  values = values.reshape(*blocks.shape[:-1], 32)
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return values.reshape(*blocks.shape[:-2], -1)


# --- The tiny GPT-OSS: one set of weights, written as an HF folder and as a GGUF file. ---


def _gpt_oss_weights(rng) -> dict:
  """Random GPT-OSS weights: ``"hf"`` the folder's tensors (name -> array as stored),
  ``"gguf"`` the GGUF file's (name -> (array, raw dtype or None)) of the same values."""
  n_vocab = len(VOCAB_TOKENS)
  q, kv = gg.HEADS * gg.HEAD_DIM, gg.KV_HEADS * gg.HEAD_DIM

  def dense(shape, gain=1.0):
    w = rng.standard_normal(shape) * gain / np.sqrt(shape[-1])
    return w.astype(BF16)

  def vec(shape, mean=0.0, std=0.5):
    return (mean + std * rng.standard_normal(shape)).astype(BF16)

  def mxfp4(shape, gain):
    w = (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)
    return gguf.quants.quantize(w.reshape(-1, shape[-1]), QT.MXFP4).reshape(*shape[:-1], -1)

  hf_t: dict = {"model.embed_tokens.weight": dense((n_vocab, D), np.sqrt(D) / 2),
                "lm_head.weight": dense((n_vocab, D), 5.0),
                "model.norm.weight": vec((D,), 1.0, 0.2)}
  gguf_t: dict = {}
  for i in range(gg.LAYERS):
    p = f"model.layers.{i}"
    for name, shape, gain in (("q_proj", (q, D), 1.0), ("k_proj", (kv, D), 2.0),
                              ("v_proj", (kv, D), 1.0), ("o_proj", (D, q), 10.0)):
      hf_t[f"{p}.self_attn.{name}.weight"] = dense(shape, gain)
      hf_t[f"{p}.self_attn.{name}.bias"] = vec(shape[:1])
    hf_t[f"{p}.self_attn.sinks"] = vec((gg.HEADS,), 0.0, 1.5)
    hf_t[f"{p}.input_layernorm.weight"] = vec((D,), 1.0, 0.2)
    hf_t[f"{p}.post_attention_layernorm.weight"] = vec((D,), 1.0, 0.2)
    hf_t[f"{p}.mlp.router.weight"] = dense((E, D), 2.0)
    hf_t[f"{p}.mlp.router.bias"] = vec((E,))
    gate, up = mxfp4((E, F, D), 3.0), mxfp4((E, F, D), 3.0)
    down = mxfp4((E, D, F), 10.0)
    gate_up = np.stack([gate, up], axis=2).reshape(E, 2 * F, -1)  # rows gate0, up0, ...
    x = f"{p}.mlp.experts"
    hf_t[f"{x}.gate_up_proj_blocks"], hf_t[f"{x}.gate_up_proj_scales"] = (
        _gguf_to_hf_mxfp4(gate_up, 2 * F, D))
    hf_t[f"{x}.down_proj_blocks"], hf_t[f"{x}.down_proj_scales"] = _gguf_to_hf_mxfp4(
        down, D, F)
    hf_t[f"{x}.gate_up_proj_bias"] = vec((E, 2 * F))
    hf_t[f"{x}.down_proj_bias"] = vec((E, D))
    gguf_t[f"blk.{i}.ffn_gate_exps.weight"] = (gate, QT.MXFP4)
    gguf_t[f"blk.{i}.ffn_up_exps.weight"] = (up, QT.MXFP4)
    gguf_t[f"blk.{i}.ffn_down_exps.weight"] = (down, QT.MXFP4)
  f32 = {n: np.asarray(a, np.float32) for n, a in hf_t.items() if a.dtype == BF16}
  gguf_t.update(_gguf_names(f32))
  return {"hf": hf_t, "gguf": gguf_t}


def _gguf_names(f32: dict) -> dict:
  """The float tensors of the folder under llama.cpp's GPT-OSS names, as its converter
  writes them (gate_up's bias split into the even and odd entries), F32."""
  out = {"token_embd.weight": f32["model.embed_tokens.weight"],
         "output.weight": f32["lm_head.weight"], "output_norm.weight": f32["model.norm.weight"]}
  names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.router": "ffn_gate_inp"}
  for i in range(gg.LAYERS):
    p = f"model.layers.{i}"
    for hf_name, g in names.items():
      out[f"blk.{i}.{g}.weight"] = f32[f"{p}.{hf_name}.weight"]
      out[f"blk.{i}.{g}.bias"] = f32[f"{p}.{hf_name}.bias"]
    out[f"blk.{i}.attn_sinks.weight"] = f32[f"{p}.self_attn.sinks"]
    out[f"blk.{i}.attn_norm.weight"] = f32[f"{p}.input_layernorm.weight"]
    out[f"blk.{i}.post_attention_norm.weight"] = f32[f"{p}.post_attention_layernorm.weight"]
    bias = f32[f"{p}.mlp.experts.gate_up_proj_bias"]
    out[f"blk.{i}.ffn_gate_exps.bias"] = np.ascontiguousarray(bias[:, 0::2])
    out[f"blk.{i}.ffn_up_exps.bias"] = np.ascontiguousarray(bias[:, 1::2])
    out[f"blk.{i}.ffn_down_exps.bias"] = f32[f"{p}.mlp.experts.down_proj_bias"]
  return {n: (a, None) for n, a in out.items()}


def _gpt_oss_config(truncate: bool = False, **change) -> dict:
  """GPT-OSS-20B's config.json, at the tiny model's shapes (the vocabulary's, once the
  vocab fixture has made it)."""
  config = {
      "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
      "attention_bias": True, "attention_dropout": 0.0, "experts_per_token": K_TOP,
      "head_dim": gg.HEAD_DIM, "hidden_act": "silu", "hidden_size": D,
      "initial_context_length": gg.YARN_ORIGINAL, "intermediate_size": F,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
      "max_position_embeddings": gg.CONTEXT, "num_attention_heads": gg.HEADS,
      "num_experts_per_tok": K_TOP, "num_hidden_layers": gg.LAYERS,
      "num_key_value_heads": gg.KV_HEADS, "num_local_experts": E,
      "output_router_logits": False, "rms_norm_eps": gg.RMS_EPS,
      "quantization_config": {"modules_to_not_convert": [
          "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
          "lm_head"], "quant_method": "mxfp4"},
      "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": gg.YARN_FACTOR,
                       "original_max_position_embeddings": gg.YARN_ORIGINAL,
                       "rope_type": "yarn", "truncate": truncate},
      "rope_theta": gg.ROPE_BASE, "router_aux_loss_coef": 0.9,
      "sliding_window": gg.WINDOW, "swiglu_limit": 7.0, "tie_word_embeddings": False,
      "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": len(VOCAB_TOKENS) or 700}
  return {**config, **change}


VOCAB_TOKENS: list[str] = []  # set by the vocab fixture: the BPE tokens, ChatML, Harmony


def _add_tokenizer(folder, vocab) -> None:
  """``tokenizer.json`` as o200k's is built (the o200k Split regex, then byte-level) over
  :func:`test_qwen_gguf._byte_level_vocab`'s BPE with Harmony's special tokens, GPT-OSS's
  ``tokenizer_config.json`` (no chat_template: it is ``chat_template.jinja``) and
  ``generation_config.json`` (its end ids)."""
  tok = tokenizers.Tokenizer.from_str(vocab[3].to_str())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(tokenizer_lib._GPT4O_REGEX),
                                      behavior="isolated", invert=False),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True)
                          for t in gg.HARMONY_SPECIALS])
  assert tok.get_vocab_size(with_added_tokens=True) == len(VOCAB_TOKENS)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>",
      "pad_token": "<|endoftext|>", "model_max_length": gg.CONTEXT}))
  (folder / "chat_template.jinja").write_text(gg.HARMONY)
  (folder / "generation_config.json").write_text(json.dumps({
      "eos_token_id": [VOCAB_TOKENS.index(t) for t in END_IDS]}))


def _write_folder(folder, tensors: dict, config: dict, vocab, shards: int = 2) -> None:
  """``tensors`` as ``shards`` safetensors files with an index (GPT-OSS ships three), the
  config and the tokenizer."""
  folder.mkdir(parents=True, exist_ok=True)
  names = list(tensors)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = names[s::shards]
    safetensors_numpy.save_file({n: np.ascontiguousarray(tensors[n]) for n in part},
                                str(folder / file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(part, file))
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": weight_map}))
  (folder / "config.json").write_text(json.dumps(config))
  _add_tokenizer(folder, vocab)


def _write_gguf(path, tensors: dict, vocab) -> None:
  """The GGUF file of the same model (metadata as test_gpt_oss_gguf's)."""
  w = gguf.GGUFWriter(str(path), gg.ARCH)
  w.add_name("tiny-gpt-oss-hf")
  w.add_context_length(gg.CONTEXT)
  w.add_embedding_length(D)
  w.add_block_count(gg.LAYERS)
  w.add_feed_forward_length(F)
  w.add_head_count(gg.HEADS)
  w.add_head_count_kv(gg.KV_HEADS)
  w.add_rope_freq_base(gg.ROPE_BASE)
  w.add_layer_norm_rms_eps(gg.RMS_EPS)
  w.add_key_length(gg.HEAD_DIM)
  w.add_value_length(gg.HEAD_DIM)
  w.add_expert_count(E)
  w.add_expert_used_count(K_TOP)
  w.add_sliding_window(gg.WINDOW)
  w.add_expert_feed_forward_length(F)
  w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
  w.add_rope_scaling_factor(gg.YARN_FACTOR)
  w.add_rope_scaling_orig_ctx_len(gg.YARN_ORIGINAL)
  w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  gg._add_vocab(w, vocab)
  for name, (a, raw_dtype) in tensors.items():
    w.add_tensor(name, a, raw_dtype=raw_dtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _float64(hf_t: dict) -> dict[str, list]:
  """The folder's weights as ``test_gpt_oss_gguf._reference_logits`` takes them (its
  llama.cpp names; matrices ``[K, N]``, expert stacks ``[E, K, N]``), from the stored
  arrays: bf16 as float64, the experts by :func:`_dequantize_hf_mxfp4`, gate_up split as
  transformers' ``gate_up[..., ::2]`` / ``[..., 1::2]``."""
  f = {n: np.asarray(a, np.float64) for n, a in hf_t.items() if a.dtype == BF16}
  out: dict[str, list] = {"token_embd.weight": [f["model.embed_tokens.weight"].T],
                          "output.weight": [f["lm_head.weight"].T],
                          "output_norm.weight": [f["model.norm.weight"]]}

  def put(key, i, a):
    out.setdefault(key, [None] * gg.LAYERS)[i] = a

  for i in range(gg.LAYERS):
    p = f"model.layers.{i}"
    for hf_name, g in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                       ("o_proj", "attn_output")):
      put(f"{g}.weight", i, f[f"{p}.self_attn.{hf_name}.weight"].T)
      put(f"{g}.bias", i, f[f"{p}.self_attn.{hf_name}.bias"])
    put("attn_sinks.weight", i, f[f"{p}.self_attn.sinks"])
    put("attn_norm.weight", i, f[f"{p}.input_layernorm.weight"])
    put("post_attention_norm.weight", i, f[f"{p}.post_attention_layernorm.weight"])
    put("ffn_gate_inp.weight", i, f[f"{p}.mlp.router.weight"].T)
    put("ffn_gate_inp.bias", i, f[f"{p}.mlp.router.bias"])
    x = f"{p}.mlp.experts"
    gate_up = np.swapaxes(_dequantize_hf_mxfp4(hf_t[f"{x}.gate_up_proj_blocks"],
                                               hf_t[f"{x}.gate_up_proj_scales"]), -1, -2)
    put("ffn_gate_exps.weight", i, gate_up[..., ::2])   # [E, hidden, F]
    put("ffn_up_exps.weight", i, gate_up[..., 1::2])
    put("ffn_down_exps.weight", i, np.swapaxes(_dequantize_hf_mxfp4(
        hf_t[f"{x}.down_proj_blocks"], hf_t[f"{x}.down_proj_scales"]), -1, -2))
    put("ffn_gate_exps.bias", i, f[f"{x}.gate_up_proj_bias"][:, ::2])
    put("ffn_up_exps.bias", i, f[f"{x}.gate_up_proj_bias"][:, 1::2])
    put("ffn_down_exps.bias", i, f[f"{x}.down_proj_bias"])
  return out


def _hf_yarn64(rope_dim=gg.HEAD_DIM, base=gg.ROPE_BASE, factor=gg.YARN_FACTOR,
               orig=gg.YARN_ORIGINAL, beta_fast=32.0, beta_slow=1.0):
  """``(divisor of each pair's frequency, magnitude)`` of transformers'
  ``_compute_yarn_parameters`` with ``truncate: false``, float64: the correction dims
  ``dim * ln(orig / (2 pi beta)) / (2 ln base)`` not rounded, clipped to ``[0, dim -
  1]``; ``inv_freq = inv_extrapolation * (1 - ramp) + inv_interpolation * ramp`` where
  ``ramp = clip((i - low) / (high - low), 0, 1)``; cos / sin scaled by ``0.1 ln factor +
  1``."""
  def corr(beta):
    return rope_dim * np.log(orig / (beta * 2 * np.pi)) / (2 * np.log(base))
  low, high = max(corr(beta_fast), 0.0), min(corr(beta_slow), rope_dim - 1.0)
  ramp = np.clip((np.arange(rope_dim // 2) - low) / (high - low), 0, 1)
  inv_scale = (1 - ramp) + ramp / factor  # inv_freq / inv_extrapolation
  return 1 / inv_scale, 0.1 * np.log(factor) + 1


@contextlib.contextmanager
def _yarn_of(truncate: bool):
  """``test_gpt_oss_gguf``'s reference with transformers' YaRN (``truncate`` False) or
  ggml's (True, its own)."""
  saved = gg._yarn64
  if not truncate:
    gg._yarn64 = _hf_yarn64
  try:
    yield
  finally:
    gg._yarn64 = saved


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  v = qwen._byte_level_vocab(tmp_path_factory.mktemp("bbpe"))
  VOCAB_TOKENS[:] = [*v[0], *gg.HARMONY_SPECIALS]
  return v


@pytest.fixture(scope="module")
def gpt_oss(vocab, tmp_path_factory):
  """``(folder, weights, float64 weights, prompt ids, greedy ids, reference logits)``:
  the folder of the first seed whose reference (transformers' YaRN) has clear greedy
  leads and clear routing."""
  tmp = tmp_path_factory.mktemp("gpt_oss_hf")
  for seed in range(seed_from("hf gpt_oss") % 1000, seed_from("hf gpt_oss") % 1000 + 24):
    weights = _gpt_oss_weights(np.random.default_rng(seed))
    folder = tmp / f"gpt-oss-{seed}"
    _write_folder(folder, weights["hf"], _gpt_oss_config(), vocab)
    from qjax._src import hf_tokenizer  # pylint: disable=g-import-not-at-top
    prompt_ids = hf_tokenizer.tokenizer_from_hf(folder).encode(PROMPT, add_bos=False)
    f64 = _float64(weights["hf"])
    with _yarn_of(truncate=False):
      ref = gg._greedy_reference(f64, prompt_ids)
    if ref is not None:
      return folder, weights, f64, prompt_ids, *ref
  pytest.fail("no seed gives a gpt_oss greedy reference with clear leads and routing")


def _load(folder, scan_layers: bool, **options):
  return hf.load_hf_llama(folder, scan_layers=scan_layers, progress=False, **options)


def _forward(cfg, params, ids) -> np.ndarray:
  return np.asarray(llama.forward(params, np.asarray([ids], np.int32), cfg=cfg)[0])


# --- GPT-OSS: the folder. -----------------------------------------------------------------


def test_the_folder_is_laid_out_as_gpt_oss_20b(gpt_oss):
  """The tensors' names, dtypes and shapes of openai/gpt-oss-20b (at the tiny sizes); the
  re-laid-out blocks dequantize (transformers' way) to what gguf-py's dequantize gives
  for its own blocks, gate and up interleaved along 2F."""
  folder, weights, *_ = gpt_oss
  t = weights["hf"]
  x = "model.layers.1.mlp.experts"
  assert t[f"{x}.gate_up_proj_blocks"].shape == (E, 2 * F, D // 32, 16)
  assert t[f"{x}.gate_up_proj_scales"].shape == (E, 2 * F, D // 32)
  assert t[f"{x}.down_proj_blocks"].shape == (E, D, F // 32, 16)
  assert t[f"{x}.gate_up_proj_blocks"].dtype == np.uint8
  assert t[f"{x}.gate_up_proj_bias"].shape == (E, 2 * F) and t[f"{x}.gate_up_proj_bias"].dtype == BF16
  assert t["model.layers.0.self_attn.sinks"].shape == (gg.HEADS,)
  assert t["model.layers.2.mlp.router.weight"].shape == (E, D)
  gate = gguf.quants.dequantize(weights["gguf"]["blk.1.ffn_gate_exps.weight"][0], QT.MXFP4)
  up = gguf.quants.dequantize(weights["gguf"]["blk.1.ffn_up_exps.weight"][0], QT.MXFP4)
  got = _dequantize_hf_mxfp4(t[f"{x}.gate_up_proj_blocks"], t[f"{x}.gate_up_proj_scales"])
  np.testing.assert_array_equal(got[:, 0::2], gate.reshape(E, F, D))
  np.testing.assert_array_equal(got[:, 1::2], up.reshape(E, F, D))
  index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
  assert len(set(index.values())) == 2


def test_config_of_the_folder():
  """from_hf_config of GPT-OSS-20B's config.json (at the tiny shapes): the alternating
  window, transformers' YaRN with fractional correction dims (8.09, 17.40 at head 64),
  the experts, GPT-OSS's options."""
  cfg = llama.LlamaConfig.from_hf_config(_gpt_oss_config())
  assert (cfg.sliding_window, cfg.sliding_layers) == (gg.WINDOW, (True, False, True))
  assert cfg.yarn == llama.YarnScaling(factor=32.0, original_context=4096, truncate=False)
  low, high = cfg.yarn.corr_dims(gg.ROPE_BASE, gg.HEAD_DIM)
  assert (round(low, 2), round(high, 2)) == (8.09, 17.4)
  np.testing.assert_allclose(cfg.yarn.freq_factors(gg.ROPE_BASE, gg.HEAD_DIM),
                             _hf_yarn64()[0], rtol=1e-12)
  assert cfg.yarn.magnitude() == pytest.approx(_hf_yarn64()[1])
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (E, K_TOP, F)
  assert cfg.rope_neox and cfg.qkv_bias and cfg.o_bias and cfg.attn_sinks and cfg.moe_bias
  assert cfg.expert_activation == "gpt_oss" and cfg.rope_base == gg.ROPE_BASE
  truncated = llama.LlamaConfig.from_hf_config(_gpt_oss_config(truncate=True))
  assert truncated.yarn.corr_dims(gg.ROPE_BASE, gg.HEAD_DIM) == (8.0, 18.0)


def test_experts_load_as_mxfp4_stacks_bit_exact(gpt_oss):
  """The experts are stacked :class:`qjax.MXFP4Weight` (never dequantized at load) whose
  values are the folder's gate (even rows) / up (odd rows) / down, bit for bit; the
  biases split alike."""
  folder, weights, f64, *_ = gpt_oss
  cfg, params = _load(folder, scan_layers=True)
  moe = params["params"]["blocks"]["moe"]
  for name in ("gate", "up", "down"):
    w = moe[name]
    assert type(w) is qjax.MXFP4Weight and w.codes.shape[:2] == (gg.LAYERS, E), name
    got = np.asarray(w.dequantize(jnp.float32))  # [L, E, K, N]
    want = np.stack(f64[f"ffn_{name}_exps.weight"])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(moe[f"{name}_bias"]),
                                  np.stack(f64[f"ffn_{name}_exps.bias"]))
  assert moe["router"].shape == (gg.LAYERS, D, E) and moe["router"].dtype == jnp.float32
  assert params["params"]["blocks"]["attn"]["sinks"].shape == (gg.LAYERS, gg.HEADS)


# --- GPT-OSS against float64. -------------------------------------------------------------


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_logits_match_the_float64_reference(gpt_oss, scan_layers):
  """The prompt and its greedy continuation (past the window) in one forward: the
  reference's logits, stacked and unrolled."""
  folder, _, _, prompt_ids, generated, want = gpt_oss
  cfg, params = _load(folder, scan_layers)
  audit._close(_forward(cfg, params, prompt_ids + generated), want, rel=1e-5)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_cached_decoding_matches_the_reference(gpt_oss, scan_layers):
  folder, _, _, prompt_ids, generated, want = gpt_oss
  cfg, params = _load(folder, scan_layers)
  n = len(prompt_ids)
  got = moe_gguf._decoded_logits(cfg, params, prompt_ids, generated)
  audit._close(got, want[n - 1:-1], rel=1e-5)


def test_greedy_generation_matches_the_reference(gpt_oss):
  """``qjax generate --model FOLDER --temperature 0 --json``: the reference's tokens; the
  summary names what the experts run."""
  folder, _, _, prompt_ids, generated, _ = gpt_oss
  got, err = qwen._greedy_cli(folder)
  assert got["prompt_ids"] == prompt_ids
  assert got["generated_ids"] == generated
  assert "; experts: xla" in err, err


def test_the_gguf_file_of_the_same_weights_gives_the_same_logits(gpt_oss, vocab, tmp_path):
  """With ``truncate: true`` (ggml's rounded correction dims, what llama.cpp runs), the
  folder and the GGUF file llama.cpp's converter would make of it (gate / up split, F32
  elsewhere) give the same logits, and both the reference's."""
  _, weights, f64, prompt_ids, generated, _ = gpt_oss
  folder = tmp_path / "truncated"
  _write_folder(folder, weights["hf"], _gpt_oss_config(truncate=True), vocab)
  path = tmp_path / "same.gguf"
  _write_gguf(path, weights["gguf"], vocab)
  ids = prompt_ids + generated
  with _yarn_of(truncate=True):
    want = gg._reference_logits(f64, ids)
  cfg, params = _load(folder, True)
  from_folder = _forward(cfg, params, ids)
  gcfg, gparams = gg._load(path, True)
  from_file = _forward(gcfg, gparams, ids)
  audit._close(from_folder, from_file, rel=1e-6)
  audit._close(from_folder, want, rel=1e-5)


def test_bf16_experts_of_a_dequantized_copy_give_the_same_logits(gpt_oss, vocab, tmp_path):
  """A dequantized copy (``gate_up_proj [E, hidden, 2F]`` / ``down_proj [E, F, hidden]``
  bf16, what transformers' dequantize=True saves; MXFP4's values are exact in bf16) gives
  the MXFP4 folder's logits."""
  folder, weights, f64, prompt_ids, generated, _ = gpt_oss
  t = {n: a for n, a in weights["hf"].items() if not n.endswith(("_blocks", "_scales"))}
  for i in range(gg.LAYERS):
    x = f"model.layers.{i}.mlp.experts"
    for name in ("gate_up_proj", "down_proj"):
      w = _dequantize_hf_mxfp4(weights["hf"][f"{x}.{name}_blocks"],
                               weights["hf"][f"{x}.{name}_scales"])
      t[f"{x}.{name}"] = np.swapaxes(w, -1, -2).astype(BF16)
  config = {k: v for k, v in _gpt_oss_config().items() if k != "quantization_config"}
  _write_folder(tmp_path / "bf16", t, config, vocab)
  ids = prompt_ids + generated
  cfg, params = _load(tmp_path / "bf16", True)
  assert params["params"]["blocks"]["moe"]["gate"].data.dtype == jnp.bfloat16
  mcfg, mparams = _load(folder, True)
  audit._close(_forward(cfg, params, ids), _forward(mcfg, mparams, ids), rel=1e-6)


def test_interpret_runs_the_float_attention_on_xla(gpt_oss):
  """``--implementation interpret`` (as pallas on a GPU) runs the folder: its bf16
  attention weights have no kernel and run XLA, as ``llama.matmul`` runs them (generate's
  summary line asked the dispatcher for their kernel and failed, found on the H100)."""
  folder = gpt_oss[0]
  rc, _, err = spm_gguf._cli(["generate", "--model", str(folder), "--prompt", PROMPT,
                              "--max-new-tokens", "1", "--implementation", "interpret"])
  assert rc == 0, err
  assert "matmul implementation: xla; experts: " in err and "experts: xla" not in err, err


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernels need an "
                    "NVIDIA GPU")
def test_pallas_on_gpu(gpt_oss):
  """On a GPU, ``--implementation pallas`` runs the folder (MXFP4 stacks on the MoE
  kernels) and its float32 prefill logits are within 2e-2 of the largest reference logit
  (TF32 products)."""
  folder, _, _, prompt_ids, _, want = gpt_oss
  rc, _, err = spm_gguf._cli(["generate", "--model", str(folder), "--prompt", PROMPT,
                              "--max-new-tokens", "2", "--implementation", "pallas"])
  assert rc == 0, err
  assert "; experts: " in err and "; experts: xla" not in err, err
  cfg, params = _load(folder, True, implementation="pallas", dtype=jnp.float32)
  logits, _ = llama.prefill(params, jnp.asarray([prompt_ids], jnp.int32),
                            llama.init_cache(cfg, 1, 64), cfg=cfg)
  audit._close(logits[0], want[:len(prompt_ids)], rel=2e-2)


def test_chat_template_of_the_folder_renders(gpt_oss):
  """``chat_template.jinja`` (no chat_template in tokenizer_config.json, as GPT-OSS ships
  it) renders, its Harmony tokens single ids; generation_config.json's end ids stop."""
  from qjax._src import hf_tokenizer  # pylint: disable=g-import-not-at-top
  folder, *_ = gpt_oss
  tok = hf_tokenizer.tokenizer_from_hf(folder)
  text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                 add_generation_prompt=True)
  assert text.endswith("<|start|>user<|message|>Hi there<|end|><|start|>assistant")
  ids = tok.encode(text, add_bos=False)
  specials = {tok.tokenizer.token_to_id(s) for s in gg.HARMONY_SPECIALS}
  assert sum(i in specials for i in ids) == 7
  assert set(tok.stop_ids) >= {VOCAB_TOKENS.index(t) for t in END_IDS}
  assert tok.encode(PROMPT, add_bos=None) == tok.encode(PROMPT, add_bos=False)  # no BOS


# --- GPT-OSS: what is refused. ------------------------------------------------------------


def _drop(weights: dict, name: str) -> dict:
  return {n: a for n, a in weights["hf"].items() if n != name}


@pytest.mark.parametrize("name", [
    "model.layers.1.mlp.experts.gate_up_proj_scales", "model.layers.2.self_attn.sinks",
    "model.layers.0.mlp.experts.down_proj_bias", "model.layers.1.mlp.router.bias"])
def test_a_missing_tensor_is_named(gpt_oss, vocab, tmp_path, name):
  """By load_hf_llama, and by generate as one line (exit code 2) after the tokenizer
  and prompt checks."""
  _, weights, *_ = gpt_oss
  _write_folder(tmp_path, _drop(weights, name), _gpt_oss_config(), vocab)
  with pytest.raises(ValueError, match=rf"tensor '{name}' is missing from the checkpoint"):
    _load(tmp_path, True)
  rc, _, err = spm_gguf._cli(["generate", "--model", str(tmp_path), "--prompt", PROMPT,
                              "--json"])  # --json: no progress bar on stderr
  assert rc == 2 and err.startswith("qjax generate: error: ") and f"'{name}' is missing" in err
  assert len(err.strip().splitlines()) == 1, err


def test_misshapen_blocks_are_named(gpt_oss, vocab, tmp_path):
  _, weights, *_ = gpt_oss
  t = dict(weights["hf"])
  name = "model.layers.0.mlp.experts.down_proj_blocks"
  t[name] = t[name][:, :-1]
  _write_folder(tmp_path, t, _gpt_oss_config(), vocab)
  with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \(8, 255, 8, 16\), want "
                     r"\(8, 256, 8, 16\) \(MXFP4 experts of 8 x \(K=256, N=256\)"):
    _load(tmp_path, True)


@pytest.mark.parametrize("change,match", [
    ({"swiglu_limit": 8.0}, r"swiglu_limit=8.0 is not supported; qjax's GPT-OSS experts run "
     r"the clamped SwiGLU of limit 7.0"),
    ({"swiglu_alpha": 1.5}, r"swiglu_alpha=1.5 is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"layer_types holds 'chunked_attention'"),
    ({"layer_types": ["full_attention"]}, r"layer_types must list one type per layer"),
    ({"attention_bias": False}, r"attention_bias=false is not supported for gpt_oss"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "attention_factor": 1.2,
                       "original_max_position_embeddings": 4096}},
     r"rope_scaling.attention_factor=1.2 is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_scaling of rope_type 'llama3' is not supported for model_type 'gpt_oss'"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, "
     r"num_local_experts=8\]"),
    ({"num_local_experts": None}, r"lacks 'num_local_experts'"),
], ids=["limit", "alpha", "layer_type", "layer_count", "no_bias", "attention_factor",
        "llama3", "top_k", "no_experts"])
def test_unsupported_config_keys_are_named(change, match):
  config = {k: v for k, v in _gpt_oss_config(**change).items() if v is not None}
  with pytest.raises(ValueError, match=match):
    llama.LlamaConfig.from_hf_config(config)


def test_quantization_other_than_mxfp4_is_refused(gpt_oss, vocab, tmp_path):
  _, weights, *_ = gpt_oss
  config = _gpt_oss_config(quantization_config={"quant_method": "gptq", "bits": 4})
  _write_folder(tmp_path, weights["hf"], config, vocab)
  with pytest.raises(ValueError, match=r"quant_method='gptq' is not supported for gpt_oss"):
    _load(tmp_path, True)


def test_export_refuses_moe_params(gpt_oss, tmp_path):
  """save_hf_llama writes dense Llama models only."""
  folder, *_ = gpt_oss
  cfg, params = _load(folder, True)
  with pytest.raises(ValueError, match=r"num_experts=8: a mixture-of-experts model"):
    hf.save_hf_llama(tmp_path / "out", params, cfg)


# --- Qwen3-MoE and Mixtral: test_moe_gguf's models as HF folders of float experts. --------


FLOAT_ARCHS = ("qwen3moe", "mixtral")
# transformers' checkpoint names (spelled out here, not taken from the loader): the module
# under model.layers.{i}, its router, each expert's projection for gate / up / down
# (MixtralBlockSparseTop2MLP: w1 gate, w3 up, w2 down).
HF_EXPERTS = {"qwen3moe": ("mlp", "gate", {"gate": "gate_proj", "up": "up_proj",
                                           "down": "down_proj"}),
              "mixtral": ("block_sparse_moe", "gate", {"gate": "w1", "up": "w3", "down": "w2"})}


def _hf_rows(w_kn: np.ndarray, heads: int | None) -> np.ndarray:
  """A reference matrix ``[K, N]`` as torch's ``Linear.weight [N, K]``; for a Mixtral q /
  k (``heads`` given) the rows put back in HF's rotate_half order: the inverse of
  llama.cpp's ``permute`` (``reshape(heads, 2, N / heads / 2, K).swapaxes(1, 2)``)."""
  w = w_kn.T
  if heads is None:
    return np.ascontiguousarray(w)
  n, k = w.shape
  return np.ascontiguousarray(w.reshape(heads, n // heads // 2, 2, k).swapaxes(1, 2)
                              .reshape(n, k))


def _float_moe_folder(folder, a, f64, vocab) -> None:
  """The model of ``f64`` (test_moe_gguf's reference weights, exact in float32) as a
  transformers folder of ``a``'s model_type: per-expert torch Linears, float32."""
  mixtral = a.arch == "llama"
  module, router, names = HF_EXPERTS[a.name]
  f32 = np.float32
  t = {"model.embed_tokens.weight": f64["embed"][0].T.astype(f32),
       "model.norm.weight": f64["final_norm"][0].astype(f32)}
  if "lm_head" in f64:
    t["lm_head.weight"] = f64["lm_head"][0].T.astype(f32)
  for i in range(moe_gguf.LAYERS):
    p = f"model.layers.{i}"
    w = {key: v[i] for key, v in f64.items() if len(v) == moe_gguf.LAYERS}
    t[f"{p}.input_layernorm.weight"] = w["attn_norm"].astype(f32)
    t[f"{p}.post_attention_layernorm.weight"] = w["ffn_norm"].astype(f32)
    for ref, hf_name, heads in (("q", "q_proj", a.heads), ("k", "k_proj", a.kv_heads),
                                ("v", "v_proj", None), ("o", "o_proj", None)):
      t[f"{p}.self_attn.{hf_name}.weight"] = _hf_rows(
          w[ref], heads if mixtral else None).astype(f32)
    if not mixtral:
      t[f"{p}.self_attn.q_norm.weight"] = w["q_norm"].astype(f32)
      t[f"{p}.self_attn.k_norm.weight"] = w["k_norm"].astype(f32)
    t[f"{p}.{module}.{router}.weight"] = w["router"].T.astype(f32)
    for e in range(a.experts):
      for param, hf_name in names.items():
        t[f"{p}.{module}.experts.{e}.{hf_name}.weight"] = np.ascontiguousarray(
            w[f"{param}_exps"][e].T).astype(f32)
  common = {"hidden_size": a.hidden, "num_hidden_layers": moe_gguf.LAYERS,
            "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim, "rms_norm_eps": moe_gguf.RMS_EPS,
            "rope_theta": a.rope_base, "max_position_embeddings": moe_gguf.CONTEXT,
            "vocab_size": len(vocab[0]), "hidden_act": "silu", "torch_dtype": "float32",
            "num_experts_per_tok": a.top_k, "tie_word_embeddings": "lm_head" not in f64}
  if mixtral:
    config = {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
              "intermediate_size": a.expert_ffn, "num_local_experts": a.experts,
              "sliding_window": None, "router_jitter_noise": 0.0}
  else:
    config = {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "intermediate_size": a.ffn, "moe_intermediate_size": a.expert_ffn,
              "num_experts": a.experts, "norm_topk_prob": True, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
              "attention_bias": False}
  folder.mkdir(parents=True)
  safetensors_numpy.save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(config))
  vocab[3].save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": qwen.CHATML}))


@pytest.fixture(scope="module", params=FLOAT_ARCHS)
def float_moe(request, vocab, tmp_path_factory):
  """``(MoEArch, folder, float64 weights, prompt ids, greedy ids, reference logits)``: the
  first seed whose reference has clear greedy leads and routing, as test_moe_gguf's."""
  a = moe_gguf.ARCHS[request.param]
  tmp = tmp_path_factory.mktemp(f"hf_{a.name}")
  prompt_ids = vocab[3].encode(PROMPT).ids
  for seed in range(seed_from(a.name) % 1000, seed_from(a.name) % 1000 + 16):
    path = tmp / f"tiny-{a.name}-{seed}.gguf"
    moe_gguf._write_model(path, a, vocab, seed)
    f64 = moe_gguf._float64_weights(path)
    ref = qwen._greedy_reference(a, f64, prompt_ids)
    if ref is not None and moe_gguf._routing_margin(
        a, f64, prompt_ids + ref[0]) > moe_gguf.ROUTING_MARGIN:
      folder = tmp / f"folder-{seed}"
      _float_moe_folder(folder, a, f64, vocab)
      return a, folder, f64, prompt_ids, *ref
  pytest.fail(f"no seed gives a {a.name} greedy reference with clear leads and routing")


def test_float_experts_load_as_stacks_of_the_stored_values(float_moe):
  """Each projection's experts are one GGUFDense stack ``[layers, E, N, K]`` of the
  stored float32 values (no conversion); the router float32 ``[hidden, E]``."""
  a, folder, f64, *_ = float_moe
  cfg, params = _load(folder, True)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (
      a.experts, a.top_k, a.expert_ffn)
  moe = params["params"]["blocks"]["moe"]
  for name in ("gate", "up", "down"):
    w = moe[name]
    assert type(w).__name__ == "GGUFDense" and w.data.shape[:2] == (moe_gguf.LAYERS, a.experts)
    np.testing.assert_array_equal(np.asarray(w.dequantize(jnp.float32)),
                                  np.stack(f64[f"{name}_exps"]).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(moe["router"]), np.stack(f64["router"]))
  assert "mlp" not in params["params"]["blocks"]


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_float_moe_logits_match_the_float64_reference(float_moe, scan_layers):
  """The prompt and continuation in one forward, then prefill and cached decode."""
  a, folder, _, prompt_ids, generated, want = float_moe
  cfg, params = _load(folder, scan_layers)
  audit._close(_forward(cfg, params, prompt_ids + generated), want, rel=1e-5)
  n = len(prompt_ids)
  got = moe_gguf._decoded_logits(cfg, params, prompt_ids, generated)
  audit._close(got, want[n - 1:-1], rel=1e-5)


def test_float_moe_greedy_generation_matches_the_reference(float_moe):
  a, folder, _, prompt_ids, generated, _ = float_moe
  got, err = qwen._greedy_cli(folder)
  assert got["prompt_ids"] == prompt_ids
  assert got["generated_ids"] == generated
  assert "; experts: xla" in err, err


def test_float_moe_refusals(float_moe, tmp_path):
  """A missing expert is named (load and generate); a dense MLP tensor beside the experts
  and a router bias are refused; a quantized config whose experts are dense stays a
  float model (read_linear reads what the folder holds)."""
  a, folder, *_ = float_moe
  module, _, names = HF_EXPERTS[a.name]
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  t = load_file(str(folder / "model.safetensors"))
  config = json.loads((folder / "config.json").read_text())

  def write(tensors, name):
    out = tmp_path / name
    out.mkdir()
    safetensors_numpy.save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
      (out / f).write_text((folder / f).read_text())
    return out

  gone = f"model.layers.1.{module}.experts.5.{names['up']}.weight"
  out = write({n: v for n, v in t.items() if n != gone}, "missing")
  with pytest.raises(ValueError, match=rf"tensor '{gone}' is missing from the checkpoint"):
    _load(out, True)
  rc, _, err = spm_gguf._cli(["generate", "--model", str(out), "--prompt", PROMPT, "--json"])
  assert rc == 2 and f"'{gone}' is missing" in err, err
  dense = "model.layers.0.mlp.gate_proj.weight"
  out = write({**t, dense: np.zeros((a.expert_ffn, a.hidden), np.float32)}, "dense")
  with pytest.raises(ValueError, match=rf"tensor '{dense}' is a dense MLP weight in a"):
    _load(out, True)
  bias = f"model.layers.1.{module}.gate.bias"
  out = write({**t, bias: np.zeros(a.experts, np.float32)}, "router_bias")
  with pytest.raises(ValueError, match=rf"tensor '{bias}': qjax's .* router has no bias"):
    _load(out, True)


QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
             "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1e6,
             "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
             "use_sliding_window": False, "sliding_window": None, "attention_bias": False}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
           "rope_theta": 1e6, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
           "sliding_window": None}


def test_configs_of_qwen3_30b_a3b_and_mixtral_8x7b():
  cfg = llama.LlamaConfig.from_hf_config(QWEN3_MOE)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (128, 8, 768)
  assert cfg.qk_norm and cfg.rope_neox and cfg.head_dim == 128 and not cfg.qkv_bias
  cfg = llama.LlamaConfig.from_hf_config(MIXTRAL)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (8, 2, 14336)
  assert not cfg.rope_neox and not cfg.qk_norm and cfg.head_dim == 128


@pytest.mark.parametrize("base,change,match", [
    (QWEN3_MOE, {"norm_topk_prob": False}, r"norm_topk_prob=false is not supported"),
    (QWEN3_MOE, {"mlp_only_layers": [0, 47]}, r"mlp_only_layers=\[0, 47\] / "
     r"decoder_sparse_step=1 make layer\(s\) 0, 47 dense"),
    (QWEN3_MOE, {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 make layer\(s\) 0, 2, 4, "
     r"6, \.\.\. dense"),
    (QWEN3_MOE, {"num_experts": None}, r"lacks 'num_experts'"),
    (QWEN3_MOE, {"moe_intermediate_size": None}, r"lacks 'moe_intermediate_size'"),
    (QWEN3_MOE, {"attention_bias": True}, r"attention_bias=true is not supported"),
    (QWEN3_MOE, {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0},
     r"use_sliding_window=true with sliding_window=4096"),
    (QWEN3_MOE, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_type 'yarn' is not supported for model_type 'qwen3_moe'"),
    (MIXTRAL, {"sliding_window": 4096}, r"sliding_window=4096 is not supported"),
    (MIXTRAL, {"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be in \[1, "
     r"num_local_experts=8\]"),
    (MIXTRAL, {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
], ids=["norm_topk", "mlp_only", "sparse_step", "no_experts", "no_width", "bias", "window",
        "yarn", "mixtral_window", "mixtral_top_k", "mixtral_act"])
def test_float_moe_configs_refused(base, change, match):
  config = {k: v for k, v in {**base, **change}.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    llama.LlamaConfig.from_hf_config(config)
