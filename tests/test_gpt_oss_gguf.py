"""``qjax generate`` and :mod:`flax_layers.llama` on a tiny GPT-OSS GGUF file
(``general.architecture = "gpt-oss"``, llama.cpp's LLM_ARCH_OPENAI_MOE), against an
independent float64 numpy forward pass.

The file is written in ``tmp_path`` with ``gguf.GGUFWriter`` as llama.cpp's
``convert_hf_to_gguf.py`` (GptOssModel) leaves a GPT-OSS model: tensor names and metadata
keys from gguf-py's constants (MODEL_ARCH.GPT_OSS); three layers of which layers 0 and 2
slide (llama.cpp's default ``set_swa_pattern(2)``) over a window of 8 positions, shorter
than the prompt and its continuation; 8 heads of 64 (GQA over 2 KV heads, q / k / v /
output biases, per-head ``attn_sinks``); NEOX RoPE with YaRN (factor 32 over an original
context of 4096, base 150000, as GPT-OSS-20B); ``post_attention_norm`` before the MoE; 8
experts of which each token takes 4, gate and up in MXFP4 (``gguf.quants.quantize``) and
down in Q8_0, each with its ``[E, F]`` / ``[E, hidden]`` bias, a float router with its bias;
an untied Q8_0 head; :mod:`test_qwen_gguf`'s byte-level BPE vocabulary under the o200k
pre-tokenizer (``tokenizer.ggml.pre = "gpt-4o"``) with Harmony's special tokens and a short
Harmony-style chat template.

The reference (:func:`_reference_logits`, float64, written from llama.cpp's graph
``llm_build_openai_moe_iswa`` and ggml's ops, not from qjax) reads the weights as
``gguf.quants.dequantize`` gives them: the sink joins each head's softmax as one more logit;
a sliding layer's query at ``p`` sees keys ``p - 8 < s <= p`` (``is_masked_swa``); RoPE's
pairs blend ``theta / 32`` and ``theta`` over ggml's correction dims and cos / sin are
scaled by ``1 + 0.1 ln 32``; routing takes the top 4 of the biased logits and a softmax over
them; the experts run llama.cpp's ``swiglu_oai`` (``x = min(gate, 7)``, ``y = clip(up, -7,
7)``, ``x sigmoid(1.702 x) (y + 1)``) on biased products. The seed is chosen so that every
router's 4th and 5th logits differ by more than 1e-3 and every greedy pick leads by 0.05.

Measured on the CPU (float32): logits of the prompt (15 tokens) and continuation (8),
scanned and unrolled, within 3.3e-6 of the largest reference logit; prefill then cached
decode within 2.4e-6 (scanned) and 2.7e-6 (unrolled) (the tests allow 1e-5).

By hand (not kept as tests), on the chosen file (seed 114), how far the reference's logits
move (max difference over the prompt and continuation, relative to the largest logit) and
how many of the 8 greedy picks change: without the sinks 88% (7 of 8); without the window
(full attention in every layer) 110% (8 of 8); without YaRN (plain RoPE, no magnitude
factor) 71% (8 of 8); with YaRN's frequency blend but cos / sin unscaled 71%.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

import test_generate_spm_gguf as spm_gguf  # noqa: E402
import test_generation_audit as audit  # noqa: E402
import test_moe_gguf as moe_gguf  # noqa: E402
import test_qwen_gguf as qwen  # noqa: E402
from conftest import seed_from  # noqa: E402
from flax_layers import llama  # noqa: E402
from qjax._src import gguf_io  # noqa: E402
from qjax._src import tokenizer as tokenizer_lib  # noqa: E402

QT = gguf.GGMLQuantizationType
MT = gguf.MODEL_TENSOR
ARCH = "gpt-oss"
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 3, 256, 8, 2, 64
EXPERTS, TOP_K, EXPERT_FFN = 8, 4, 256
WINDOW, ROPE_BASE, YARN_FACTOR, YARN_ORIGINAL = 8, 150000.0, 32.0, 4096
CONTEXT, RMS_EPS = 131072, 1e-5
PROMPT, NEW_TOKENS = qwen.PROMPT, 8
ROUTING_MARGIN = 1e-3
HARMONY_SPECIALS = ("<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>")
# A short Harmony-style template: what GPT-OSS's uses of the renderer (a namespace, a
# macro, ``is defined`` defaults, strftime_now, tojson, loop.last).
HARMONY = (
    "{%- macro header(role) -%}<|start|>{{ role }}{%- endmacro -%}"
    "{%- if not reasoning_effort is defined -%}{%- set reasoning_effort = 'medium' -%}"
    "{%- endif -%}"
    "{%- set ns = namespace(n=0) -%}"
    "{{ header('system') }}<|message|>Knowledge cutoff: 2024-06\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}\n"
    "Reasoning: {{ reasoning_effort }}<|end|>"
    "{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}"
    "{{ header(m['role']) }}<|message|>{{ m['content'] }}<|end|>"
    "{%- if loop.last and m['role'] == 'user' -%}{{ '' if (m | tojson) else '' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
# GGUF type of each tensor: llama.cpp's MXFP4_MOE leaves the experts in MXFP4; here down is
# Q8_0 so that two types of expert stacks run.
TYPES = {MT.TOKEN_EMBD: "Q8_0", MT.ATTN_NORM: "F32", MT.ATTN_Q: "Q8_0", MT.ATTN_K: "Q4_0",
         MT.ATTN_V: "F16", MT.ATTN_OUT: "Q8_0", MT.ATTN_SINKS: "F32",
         MT.ATTN_POST_NORM: "F32", MT.FFN_GATE_INP: "F32", MT.FFN_GATE_EXP: "MXFP4",
         MT.FFN_UP_EXP: "MXFP4", MT.FFN_DOWN_EXP: "Q8_0", MT.OUTPUT_NORM: "F32",
         MT.OUTPUT: "Q8_0"}
BIASED = (MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.FFN_GATE_INP, MT.FFN_GATE_EXP,
          MT.FFN_UP_EXP, MT.FFN_DOWN_EXP)


def _add_vocab(w, vocab) -> None:
  """The byte-level vocabulary with Harmony's specials, as ``_set_vocab_gpt2`` writes an
  o200k tokenizer (pre "gpt-4o"; EOS ``<|return|>``)."""
  tokens, merges, kinds, _ = vocab
  tokens = [*tokens, *HARMONY_SPECIALS]
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt-4o")
  w.add_token_list(tokens)
  w.add_token_types([*kinds, *[tokenizer_lib.CONTROL] * len(HARMONY_SPECIALS)])
  w.add_token_merges(merges)
  w.add_eos_token_id(tokens.index("<|return|>"))
  w.add_pad_token_id(tokens.index("<|endoftext|>"))
  w.add_bos_token_id(tokens.index("<|endoftext|>"))
  w.add_add_bos_token(False)
  w.add_chat_template(HARMONY)


def _write_model(path, vocab, seed: int) -> None:
  """The tiny GPT-OSS GGUF file with random weights."""
  rng = np.random.default_rng(seed)
  n_vocab = len(vocab[0]) + len(HARMONY_SPECIALS)
  w = gguf.GGUFWriter(str(path), ARCH)
  # convert_hf_to_gguf.py: TextModel.set_gguf_parameters, then GptOssModel's sliding
  # window, expert width and YaRN (type, factor, original context).
  w.add_name("tiny-gpt-oss")
  w.add_context_length(CONTEXT)
  w.add_embedding_length(HIDDEN)
  w.add_block_count(LAYERS)
  w.add_feed_forward_length(EXPERT_FFN)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV_HEADS)
  w.add_rope_freq_base(ROPE_BASE)
  w.add_layer_norm_rms_eps(RMS_EPS)
  w.add_key_length(HEAD_DIM)
  w.add_value_length(HEAD_DIM)
  w.add_expert_count(EXPERTS)
  w.add_expert_used_count(TOP_K)
  w.add_sliding_window(WINDOW)
  w.add_expert_feed_forward_length(EXPERT_FFN)
  w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
  w.add_rope_scaling_factor(YARN_FACTOR)
  w.add_rope_scaling_orig_ctx_len(YARN_ORIGINAL)
  w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  _add_vocab(w, vocab)

  q, kv, f = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, EXPERT_FFN
  shapes = {MT.TOKEN_EMBD: (n_vocab, HIDDEN), MT.OUTPUT: (n_vocab, HIDDEN),
            MT.ATTN_Q: (q, HIDDEN), MT.ATTN_K: (kv, HIDDEN), MT.ATTN_V: (kv, HIDDEN),
            MT.ATTN_OUT: (HIDDEN, q), MT.FFN_GATE_INP: (EXPERTS, HIDDEN),
            MT.FFN_GATE_EXP: (EXPERTS, f, HIDDEN), MT.FFN_UP_EXP: (EXPERTS, f, HIDDEN),
            MT.FFN_DOWN_EXP: (EXPERTS, HIDDEN, f), MT.ATTN_SINKS: (HEADS,)}
  gain = {MT.TOKEN_EMBD: np.sqrt(HIDDEN) / 2, MT.ATTN_OUT: 10.0, MT.FFN_DOWN_EXP: 10.0,
          MT.OUTPUT: 5.0, MT.FFN_GATE_INP: 2.0, MT.ATTN_K: 2.0, MT.FFN_GATE_EXP: 3.0,
          MT.FFN_UP_EXP: 3.0}
  for t, kind in TYPES.items():
    for i in (range(LAYERS) if gguf.TENSOR_NAMES[t].startswith("blk.") else [None]):
      shape = shapes.get(t, (HIDDEN,))
      name = qwen._tensor_name(t, i)
      if t == MT.ATTN_SINKS:  # sinks of order 1: comparable to the scores
        w.add_tensor(name, (1.5 * rng.standard_normal(shape)).astype(np.float32))
        continue
      if len(shape) == 1:  # norms around 1
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32))
        continue
      raw, qtype = moe_gguf._weights(rng, kind, shape, gain.get(t, 1.0) / np.sqrt(shape[-1]))
      w.add_tensor(name, raw, raw_dtype=qtype)
      if t in BIASED:  # [N] or, for expert stacks, [E, N]; of order 0.5
        w.add_tensor(qwen._tensor_name(t, i, "bias"),
                     (0.5 * rng.standard_normal(shape[:-1])).astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _float64_weights(path) -> dict[str, list[np.ndarray]]:
  """``"blk-suffix" -> [per-layer array]`` (and ``"token_embd.weight"`` etc. -> [array]),
  read by ``gguf.GGUFReader`` and dequantized by ``gguf.quants.dequantize``: matrices as
  ``[K, N]``, expert stacks ``[E, K, N]``, biases and vectors as stored (``[N]``, ``[E,
  N]``)."""
  f64: dict[str, list] = {}
  for t in gguf.GGUFReader(str(path)).tensors:
    a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
    a = a.reshape(tuple(reversed([int(d) for d in t.shape])))
    if t.name.endswith(".weight") and a.ndim >= 2:
      a = np.swapaxes(a, -1, -2)
    parts = t.name.split(".")
    if parts[0] == "blk":
      f64.setdefault(".".join(parts[2:]), [None] * LAYERS)[int(parts[1])] = a
    else:
      f64[t.name] = [a]
  return f64


def _yarn64(rope_dim=HEAD_DIM, base=ROPE_BASE, factor=YARN_FACTOR, orig=YARN_ORIGINAL,
            beta_fast=32.0, beta_slow=1.0):
  """``(divisor of each pair's frequency [rope_dim // 2], magnitude)``: ggml's rope_yarn
  with ext_factor 1 (ggml_rope_yarn_corr_dims, rope_yarn_ramp), in float64."""
  def corr(beta):
    return rope_dim * np.log(orig / (beta * 2 * np.pi)) / (2 * np.log(base))
  low, high = max(0.0, np.floor(corr(beta_fast))), min(rope_dim - 1.0, np.ceil(corr(beta_slow)))
  i = np.arange(rope_dim // 2)
  mix = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)
  theta_scale = (1 - mix) / factor + mix  # theta = theta_extrap * this
  return 1 / theta_scale, 1 + 0.1 * np.log(factor)


def _reference_logits(f64, ids, *, sinks=True, window=True, yarn=True,
                      router_logits: list | None = None) -> np.ndarray:
  """Logits ``[T, vocab]`` float64 of ``ids`` from position 0 (llama.cpp's
  llm_build_openai_moe_iswa); ``sinks`` / ``window`` / ``yarn`` False leave that part out
  (for the by-hand measurements). Each layer's router logits ``[T, E]`` are appended to
  ``router_logits`` where given."""
  t, d, g = len(ids), HEAD_DIM, HEADS // KV_HEADS
  factors, magnitude = _yarn64() if yarn else (None, 1.0)

  def rope(x):
    return audit._rope64(x, np.arange(t), ROPE_BASE, HEAD_DIM, neox=True,
                         factors=factors) * magnitude

  def norm(x, s):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * s

  pos = np.arange(t)
  causal = pos[None, :] <= pos[:, None]  # [query, key]
  in_window = pos[:, None] - pos[None, :] < WINDOW
  x = f64["token_embd.weight"][0][:, ids].T  # [T, hidden]
  for i in range(LAYERS):
    w = {k: v[i] for k, v in f64.items() if len(v) == LAYERS}
    h = norm(x, w["attn_norm.weight"])

    def project(name, heads):
      return (h @ w[f"{name}.weight"] + w[f"{name}.bias"]).reshape(t, heads, d)

    q, k, v = rope(project("attn_q", HEADS)), rope(project("attn_k", KV_HEADS)), project(
        "attn_v", KV_HEADS)
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    visible = causal & in_window if window and i % 2 == 0 else causal
    s = np.where(visible[None], s, -np.inf)
    sink = (w["attn_sinks.weight"] if sinks else np.full(HEADS, -np.inf))[:, None, None]
    m = np.maximum(s.max(-1, keepdims=True), sink)
    p = np.exp(s - m)
    p /= p.sum(-1, keepdims=True) + np.exp(sink - m)
    attn = np.einsum("hts,shd->thd", p, v).reshape(t, -1)
    x = x + attn @ w["attn_output.weight"] + w["attn_output.bias"]
    h = norm(x, w["post_attention_norm.weight"])
    logits = h @ w["ffn_gate_inp.weight"] + w["ffn_gate_inp.bias"]
    if router_logits is not None:
      router_logits.append(logits)
    out = np.zeros_like(h)
    for j in range(t):
      chosen = np.argsort(-logits[j], kind="stable")[:TOP_K]
      weights = np.exp(logits[j, chosen] - logits[j, chosen].max())
      weights /= weights.sum()
      for e, we in zip(chosen, weights):
        gate = h[j] @ w["ffn_gate_exps.weight"][e] + w["ffn_gate_exps.bias"][e]
        up = h[j] @ w["ffn_up_exps.weight"][e] + w["ffn_up_exps.bias"][e]
        gx, uy = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
        a = gx / (1 + np.exp(-1.702 * gx)) * (uy + 1)
        out[j] += we * (a @ w["ffn_down_exps.weight"][e] + w["ffn_down_exps.bias"][e])
    x = x + out
  return norm(x, f64["output_norm.weight"][0]) @ f64["output.weight"][0]


def _greedy_reference(f64, prompt_ids):
  """``(greedy ids, logits [T, vocab])``, or None where a pick leads by 0.05 or less, the
  continuation repeats (fewer than 4 distinct tokens) or a router's k-th and (k+1)-th
  logits are within :data:`ROUTING_MARGIN`."""
  ids = list(prompt_ids)
  for _ in range(NEW_TOKENS):
    logits = _reference_logits(f64, ids)[-1]
    top2 = np.sort(logits)[-2:]
    if top2[1] - top2[0] <= 0.05:
      return None
    ids.append(int(np.argmax(logits)))
  if len(set(ids[len(prompt_ids):])) < 4:
    return None
  routers: list = []
  want = _reference_logits(f64, ids, router_logits=routers)
  top = np.sort(np.concatenate(routers), axis=-1)[:, ::-1]
  if (top[:, TOP_K - 1] - top[:, TOP_K]).min() <= ROUTING_MARGIN:
    return None
  return ids[len(prompt_ids):], want


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return qwen._byte_level_vocab(tmp_path_factory.mktemp("bbpe"))


@pytest.fixture(scope="module")
def model(vocab, tmp_path_factory):
  """``(path, float64 weights, prompt ids, greedy ids, reference logits)``; the seed is
  the first whose greedy reference has clear leads and clear routing."""
  tmp_path = tmp_path_factory.mktemp(ARCH)
  for seed in range(seed_from(ARCH) % 1000, seed_from(ARCH) % 1000 + 24):
    path = tmp_path / f"tiny-gpt-oss-{seed}.gguf"
    _write_model(path, vocab, seed)
    prompt_ids = tokenizer_lib.tokenizer_from_gguf(gguf_io.read_metadata(path)).encode(
        PROMPT, add_bos=False)
    f64 = _float64_weights(path)
    ref = _greedy_reference(f64, prompt_ids)
    if ref is not None:
      return path, f64, prompt_ids, *ref
    path.unlink()
  pytest.fail("no seed gives a gpt-oss greedy reference with clear leads and routing")


def _load(path, scan_layers: bool, **options):
  gfile = gguf_io.load_gguf(path, progress=False)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, scan_layers=scan_layers, **options)
  return cfg, llama.params_from_gguf(gfile, scan_layers=scan_layers)


# --- The file. -------------------------------------------------------------------------------


def test_the_file_holds_what_the_tests_claim(model):
  """gguf-py's GPT_OSS tensors (and their biases), MXFP4 and Q8_0 expert stacks; a
  prompt and continuation longer than the window; the config qjax reads from it."""
  path, _, prompt_ids, generated, _ = model
  reader = gguf.GGUFReader(str(path))
  kinds = {t.name: t.tensor_type.name for t in reader.tensors}
  known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GPT_OSS]}
  for name in kinds:
    parts = name.split(".")[:-1]
    if parts[0] == "blk":
      parts[1] = "{bid}"
    assert ".".join(parts) in known, name
  assert {kinds[f"blk.1.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {
      "MXFP4", "Q8_0"}
  assert "blk.2.ffn_down_exps.bias" in kinds and "blk.0.attn_sinks.weight" in kinds
  assert len(prompt_ids) + len(generated) > 2 * WINDOW
  cfg = llama.LlamaConfig.from_metadata(gguf_io.read_metadata(path))
  assert (cfg.sliding_window, cfg.sliding_layers) == (WINDOW, (True, False, True))
  assert cfg.yarn == llama.YarnScaling(factor=YARN_FACTOR, original_context=YARN_ORIGINAL)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (
      EXPERTS, TOP_K, EXPERT_FFN)
  assert cfg.rope_neox and cfg.qkv_bias and cfg.o_bias and cfg.attn_sinks and cfg.moe_bias
  assert cfg.expert_activation == "gpt_oss" and not cfg.qk_norm


def test_yarn_is_ggmls_for_gpt_oss_20b():
  """GPT-OSS-20B's YaRN (head 64, base 150000, factor 32, original context 4096):
  ggml_rope_yarn_corr_dims gives (8, 18) (by hand: 8.09 floored, 17.40 ceiled); pairs below
  8 keep their frequency, from 18 on divide it by 32; cos and sin scale by 1 + 0.1 ln 32."""
  yarn = llama.YarnScaling(factor=32.0, original_context=4096)
  assert yarn.corr_dims(150000.0, 64) == (8.0, 18.0)
  got = yarn.freq_factors(150000.0, 64)
  want, magnitude = _yarn64()
  np.testing.assert_allclose(got, want, rtol=1e-12)
  assert got[:8].tolist() == [1.0] * 8 and got[18:].tolist() == [32.0] * 14
  assert yarn.magnitude() == pytest.approx(magnitude) == pytest.approx(1.34657, abs=1e-5)


# --- The model against float64. ----------------------------------------------------------


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_model_logits_match_the_float64_reference(model, scan_layers):
  """qjax's loader and model, float32: the logits of the prompt and the greedy
  continuation equal the reference's, stacked (the per-layer window flag scanned with
  the cache) and unrolled (measured: within 1.1e-6 of the largest logit)."""
  path, _, prompt_ids, generated, want = model
  cfg, params = _load(path, scan_layers)
  p = params["params"]
  block = p["blocks"] if scan_layers else p["layers_1"]
  lead = (LAYERS,) if scan_layers else ()
  assert block["attn"]["sinks"].shape == (*lead, HEADS)
  assert block["moe"]["gate_bias"].shape == (*lead, EXPERTS, EXPERT_FFN)
  assert block["moe"]["down_bias"].shape == (*lead, EXPERTS, HIDDEN)
  tokens = np.asarray([prompt_ids + generated], np.int32)
  with jax.default_matmul_precision("highest"):
    got = llama.forward(params, tokens, cfg=cfg)[0]
  audit._close(got, want, rel=1e-5)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_cached_decoding_matches_the_full_forward_and_the_reference(model, scan_layers):
  """Prefill of the prompt, then one cached decode step per generated token, past the
  window: each step's logits equal the full forward's and the reference's."""
  path, _, prompt_ids, generated, want = model
  cfg, params = _load(path, scan_layers)
  n = len(prompt_ids)
  with jax.default_matmul_precision("highest"):
    got = moe_gguf._decoded_logits(cfg, params, prompt_ids, generated)
    full = llama.forward(params, np.asarray([prompt_ids + generated], np.int32), cfg=cfg)[0]
  audit._close(got, want[n - 1:-1], rel=1e-5)
  audit._close(got, np.asarray(full)[n - 1:-1], rel=1e-5)


def test_prefill_equals_attending_to_the_whole_cache(model):
  """``llama.prefill`` attends to the prompt's own keys (``fresh_prompt``); the whole
  cache (twice the prompt's slots, masked past it) gives the same logits and cache up to
  float32 rounding, with the sink logits and the sliding window of this model."""
  path, _, prompt_ids, generated, _ = model
  cfg, params = _load(path, True)
  tokens = jnp.asarray([prompt_ids + generated], jnp.int32)
  t = tokens.shape[1]
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  with jax.default_matmul_precision("highest"):
    whole, whole_cache = llama.Llama(cfg).apply(params, tokens, positions,
                                                llama.init_cache(cfg, 1, 2 * t))
    got, cache = llama.prefill(params, tokens, llama.init_cache(cfg, 1, 2 * t), cfg=cfg)
  # Float32 sums over another number of slots round differently: the first layer's keys
  # (before any attention) are equal on the CPU (on a GPU, XLA may compile the projection
  # differently in the two programs: 9e-7 apart on the H200), the rest and the logits
  # within 1e-5 of the largest.
  audit._close(got, whole, rel=1e-5)
  for name in ("k", "v"):
    if jax.default_backend() == "cpu":
      np.testing.assert_array_equal(np.asarray(cache[name][0]),
                                    np.asarray(whole_cache[name][0]))
    audit._close(cache[name], whole_cache[name], rel=1e-5)


def test_greedy_generation_matches_the_float64_reference(model):
  """``qjax generate --temperature 0 --json``: the reference's greedy tokens."""
  path, _, prompt_ids, generated, _ = model
  got, _ = qwen._greedy_cli(path)
  assert got["prompt_ids"] == prompt_ids
  assert got["generated_ids"] == generated


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernels need an "
                    "NVIDIA GPU")
def test_pallas_prefill_matches_the_reference_on_gpu(model):
  """On a GPU, ``--implementation pallas`` runs the file (generate's MXFP4 expert stacks
  on the MoE kernels) and its float32 prefill logits are within 2e-2 of the largest
  reference logit (the kernels' TF32 products)."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  path, _, prompt_ids, _, want = model
  rc, _, err = spm_gguf._cli(["generate", "--model", str(path), "--prompt", PROMPT,
                              "--max-new-tokens", "2", "--implementation", "pallas"])
  assert rc == 0, err
  cfg, params = _load(path, True, implementation="pallas", dtype=jnp.float32)
  params = generate.expert_kernel_layouts(params)
  logits, _ = llama.prefill(params, jnp.asarray([prompt_ids], jnp.int32),
                            llama.init_cache(cfg, 1, 64), cfg=cfg)
  audit._close(logits[0], want[:len(prompt_ids)], rel=2e-2)


def test_xla_runs_take_dense_mxfp4_weights_as_mxfp4weight_once(tmp_path):
  """Without kernels (``--implementation xla``, or auto on a CPU), generate's load gives a
  dense GGUF MXFP4 projection its lossless MXFP4Weight once (GGUF MXFP4's own XLA route
  would repack it on every call), and on a CPU a dense Q4_0 one its lossless Int4Weight
  in plain order (faster there); expert stacks and the other block types stay as the file has them."""
  import qjax  # pylint: disable=g-import-not-at-top
  import test_gguf_formats  # pylint: disable=g-import-not-at-top
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed_from("xla layouts"))
  n, k = 40, 96
  dense = (rng.standard_normal((n, k)) * rng.uniform(1e-2, 4.0, (n, 1))).astype(np.float32)
  stack = rng.standard_normal((3, n, k)).astype(np.float32)
  path = tmp_path / "layouts.gguf"
  test_gguf_formats._write_gguf(path, {
      "mxfp4": (gguf.quants.quantize(dense, QT.MXFP4), "MXFP4"),
      "stack": (gguf.quants.quantize(stack, QT.MXFP4), "MXFP4"),
      "q4_0": (gguf.quants.quantize(dense, QT.Q4_0), "Q4_0"),
      "q4_0_stack": (gguf.quants.quantize(stack, QT.Q4_0), "Q4_0"),
      "q8_0": (gguf.quants.quantize(dense, QT.Q8_0), "Q8_0")}, metadata=False)
  tensors = gguf_io.load_gguf(path, progress=False).tensors
  got = {name: generate._xla_layouts(name, w) for name, w in tensors.items()}
  assert type(got["mxfp4"]) is qjax.MXFP4Weight
  np.testing.assert_array_equal(np.asarray(got["mxfp4"].dequantize(jnp.float32)),
                                np.asarray(tensors["mxfp4"].dequantize(jnp.float32)))
  assert got["stack"] is tensors["stack"] and got["q4_0_stack"] is tensors["q4_0_stack"]
  assert got["q8_0"] is tensors["q8_0"]
  if jax.default_backend() == "cpu":
    assert type(got["q4_0"]) is qjax.Int4Weight and got["q4_0"].tile_k == 8
    np.testing.assert_array_equal(np.asarray(got["q4_0"].dequantize(jnp.float32)),
                                  np.asarray(tensors["q4_0"].dequantize(jnp.float32)))
  else:
    assert got["q4_0"] is tensors["q4_0"]
  x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)
  y_gguf = qjax.matmul(x, tensors["mxfp4"], implementation="xla")
  y_once = qjax.matmul(x, got["mxfp4"], implementation="xla")
  np.testing.assert_array_equal(np.asarray(y_once), np.asarray(y_gguf))


# --- The config of GPT-OSS files, and what is refused. ------------------------------------


# GPT-OSS-20B's hyperparameters as its GGUF states them.
GPT_OSS_20B = {"general.architecture": "gpt-oss", "gpt-oss.block_count": 24,
               "gpt-oss.context_length": 131072, "gpt-oss.embedding_length": 2880,
               "gpt-oss.feed_forward_length": 2880, "gpt-oss.attention.head_count": 64,
               "gpt-oss.attention.head_count_kv": 8, "gpt-oss.rope.freq_base": 150000.0,
               "gpt-oss.attention.layer_norm_rms_epsilon": 1e-5, "gpt-oss.expert_count": 32,
               "gpt-oss.expert_used_count": 4, "gpt-oss.attention.key_length": 64,
               "gpt-oss.attention.value_length": 64, "gpt-oss.attention.sliding_window": 128,
               "gpt-oss.expert_feed_forward_length": 2880, "gpt-oss.rope.scaling.type": "yarn",
               "gpt-oss.rope.scaling.factor": 32.0,
               "gpt-oss.rope.scaling.original_context_length": 4096,
               "gpt-oss.vocab_size": 201088}


def test_from_metadata_of_gpt_oss_20b():
  cfg = llama.LlamaConfig.from_metadata(GPT_OSS_20B)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim) == (64, 8, 64, 64)
  assert cfg.sliding_window == 128
  assert cfg.sliding_layers == tuple(i % 2 == 0 for i in range(24))
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (32, 4, 2880)
  assert cfg.yarn.factor == 32.0 and cfg.yarn.original_context == 4096
  assert llama.block_tensors(cfg)["post_attention_norm.weight"] == ("ffn_norm", "scale")
  # llama.cpp: the pattern may be a period (3: two sliding layers, then a full one) or one
  # bool per layer; SOFTMAX_WEIGHT gating (3), unset scale (0) and either norm run alike.
  cfg = llama.LlamaConfig.from_metadata({
      **GPT_OSS_20B, "gpt-oss.attention.sliding_window_pattern": 3,
      "gpt-oss.expert_gating_func": 3, "gpt-oss.expert_weights_scale": 0.0,
      "gpt-oss.expert_weights_norm": False})
  assert cfg.sliding_layers[:6] == (True, True, False, True, True, False)
  pattern = np.asarray([i < 2 for i in range(24)])
  cfg = llama.LlamaConfig.from_metadata({
      **GPT_OSS_20B, "gpt-oss.attention.sliding_window_pattern": pattern})
  assert cfg.sliding_layers == tuple(pattern.tolist())


@pytest.mark.parametrize("extra,match", [
    ({"gpt-oss.rope.scaling.yarn_beta_fast": 16.0}, r"^gpt-oss.rope.scaling.yarn_beta_fast="
     r"16.0 is not supported; qjax runs llama.cpp's YaRN default 32.0"),
    ({"gpt-oss.rope.scaling.factor": 0.0}, r"^gpt-oss.rope.scaling.type='yarn' needs "
     r"gpt-oss.rope.scaling.factor > 0"),
    ({"gpt-oss.rope.scaling.type": "linear"}, r"^gpt-oss.rope.scaling.type='linear' is not "
     r"supported"),
    ({"gpt-oss.rope.freq_base_swa": 10000.0}, r"^gpt-oss.rope.freq_base_swa=10000.0 differs"),
    ({"gpt-oss.rope.dimension_count": 32}, r"^gpt-oss.rope.dimension_count=32 differs from "
     r"the head size 64"),
    ({"gpt-oss.attention.sliding_window_pattern": np.ones(5, bool)},
     r"^gpt-oss.attention.sliding_window_pattern has 5 entries; the model has "
     r"gpt-oss.block_count=24 layers"),
    ({"gpt-oss.attention.sliding_window": 0}, r"^gpt-oss.attention.sliding_window=0"),
    ({"gpt-oss.expert_gating_func": 1}, r"^gpt-oss.expert_gating_func=1 \(softmax\) is not "
     r"supported; qjax's gpt-oss MoE routes with softmax_weight \(3\)$"),
    ({"gpt-oss.expert_weights_scale": 2.0}, r"^gpt-oss.expert_weights_scale=2.0"),
    ({"gpt-oss.expert_feed_forward_length": None}, r"lacks gpt-oss.expert_feed_forward_length"),
], ids=["beta_fast", "factor", "linear", "swa_base", "partial_rope", "pattern", "no_window",
        "gating", "scale", "no_expert_width"])
def test_from_metadata_refuses_what_it_cannot_run(extra, match):
  meta = {k: v for k, v in {**GPT_OSS_20B, **extra}.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    llama.LlamaConfig.from_metadata(meta)


def test_yarn_stays_refused_elsewhere():
  meta = {**qwen.QWEN2, "qwen2.vocab_size": 10, "qwen2.rope.scaling.type": "yarn",
          "qwen2.rope.scaling.factor": 4.0}
  with pytest.raises(ValueError, match=r"qwen2.rope.scaling.type='yarn' is not supported "
                     r"\('yarn' on gpt-oss\)"):
    llama.LlamaConfig.from_metadata(meta)


def test_params_from_gguf_names_a_missing_sink_or_expert_bias(model):
  path, *_ = model
  for name in ("blk.1.attn_sinks.weight", "blk.2.ffn_up_exps.bias"):
    f = qwen._gfile(path)
    del f.tensors[name]
    with pytest.raises(ValueError, match=rf"the gpt-oss model needs tensor '{name}'"):
      llama.params_from_gguf(f, scan_layers=False)
  assert "blk.0.ffn_gate_exps.bias" in llama.needed_tensors(
      llama.LlamaConfig.from_metadata(gguf_io.read_metadata(path)))


# --- The tokenizer and the chat template. ----------------------------------------------------


# llama-vocab.cpp's std::regex form of the o200k regex (LLAMA_VOCAB_PRE_TYPE_GPT4O).
_LLAMA_CPP_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]"
    r"|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])"
    r"([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?"
    r"[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PIECES = [*"abcXYZ qQ  \n\r\t'sStTdDmM.,!?/-_0123456789", "'re", "'LL", "'Ve", "中文", "😀",
           "\n\n", "  ", "Zürich", "naïve", "١٢٣"]


def _split(regex: str, text: str) -> list[str]:
  split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated")
  return [piece for piece, _ in split.pre_tokenize_str(text)]


def test_gpt4o_pre_tokenizer_is_o200ks_and_llama_cpps(model):
  """``tokenizer.ggml.pre = "gpt-4o"``: on 300 random strings (ASCII of both cases,
  contractions, digit runs, newlines, accented lower-case letters, CJK, emoji) qjax's
  GGUF tokenizer encodes as a ``tokenizers`` tokenizer built the way o200k's
  tokenizer.json is (its Split regex, then byte-level), and the regex splits as
  llama.cpp's std::regex form (they differ only at non-ASCII capitals and combining
  marks, which these strings lack)."""
  path, *_ = model
  metadata = gguf_io.read_metadata(path)
  tok = tokenizer_lib.tokenizer_from_gguf(metadata)
  ref = tokenizers.Tokenizer.from_str(tok.tokenizer.to_str())
  ref.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(tokenizer_lib._GPT4O_REGEX),
                                      behavior="isolated", invert=False),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  rng = random.Random(seed_from("gpt-4o strings"))
  for _ in range(300):
    text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 24)))
    assert tok.encode(text, add_bos=False) == ref.encode(
        text, add_special_tokens=False).ids, repr(text)
    assert _split(tokenizer_lib._GPT4O_REGEX, text) == _split(_LLAMA_CPP_GPT4O, text), repr(text)
  assert _split(tokenizer_lib._GPT4O_REGEX, "Hello WORLD's 12345 CamelCase\n\n x") == [
      "Hello", " WORLD's", " ", "123", "45", " Camel", "Case", "\n\n", " x"]


def test_harmony_chat_template_renders(model):
  """The file's Harmony-style template renders with the GGUF tokenizer's renderer, and its
  special tokens encode as single ids."""
  path, *_ = model
  tok = tokenizer_lib.tokenizer_from_gguf(gguf_io.read_metadata(path))
  text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
  assert text.startswith("<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: ")
  assert text.endswith("Reasoning: medium<|end|><|start|>user<|message|>Hi there<|end|>"
                       "<|start|>assistant")
  ids = tok.encode(text, add_bos=False)
  specials = {tok.tokenizer.token_to_id(s) for s in HARMONY_SPECIALS}
  assert sum(i in specials for i in ids) == 7
