"""``qjax generate`` and :mod:`flax_layers.llama` on tiny mixture-of-experts GGUF files
(``qwen3moe``, and Mixtral's ``llama`` with ``llama.expert_count``), against an
independent float64 numpy forward pass.

The files are written in ``tmp_path`` with ``gguf.GGUFWriter`` the way llama.cpp's
``convert_hf_to_gguf.py`` leaves a Qwen3-MoE and a Mixtral model (tensor names and metadata
keys from gguf-py's constants): two layers, 8 experts of which each token takes 2, the
experts stacked in one 3-D tensor per projection (``blk.N.ffn_{gate,up,down}_exps``, numpy
``[E, F, hidden]`` / ``[E, hidden, F]``), the router ``blk.N.ffn_gate_inp`` (``[E,
hidden]``, float) and no dense FFN; :mod:`test_qwen_gguf`'s byte-level BPE vocabulary.
Weights are random, in F32, F16, Q8_0 and Q4_0 (quantized by gguf-py) and Q4_K, Q5_K and
Q6_K (random blocks whose f16 scales are set for a chosen spread: gguf-py cannot quantize
K-quants). Qwen3-MoE: Qwen3's attention (q / k norms, NEOX RoPE, a key_length that is not
hidden / heads), experts 256 wide, untied head. Mixtral: Llama's attention (adjacent-pair
RoPE), experts of ``feed_forward_length`` (512), tied head.

The reference (:func:`test_generation_audit._reference_logits` with its MoE option,
``_moe_ffn64``) reads the weights as ``gguf.quants.dequantize`` gives them and routes as
llama.cpp's ``build_moe_ffn`` does for these two: softmax over all experts, the top 2,
their probabilities divided by their sum. The seeds are chosen so that every router's 2nd
and 3rd logits differ by more than 1e-3 (float32 rounding cannot swap an expert).
Measured on the CPU (float32, scanned and unrolled, prefill and cached decode): logits
within 1.43e-6 (qwen3moe) and 1.24e-6 (mixtral) of the largest reference logit (the tests
allow 1e-5); the MoE block in bfloat16 within 0.53% (allowed 2%); the block on MXFP4 expert
stacks (:func:`qjax.quantize_mxfp4`, another format ``qjax.moe_matmul`` takes) within 4.2e-7.

By hand (not kept as tests), on the chosen files: the same reference without
renormalizing the top-2 weights (llama.cpp's ``norm_w`` false) moves the logits by 51%
(qwen3moe) and 40% (mixtral) of the largest one and changes 26% and 39% of the greedy
picks; routing to the top 1 moves them by 92% and 79%, to the top 3 by 30% and 45%.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

import qjax  # noqa: E402
import test_generate_spm_gguf as spm_gguf  # noqa: E402
import test_generation_audit as audit  # noqa: E402
import test_qwen_gguf as qwen  # noqa: E402
import test_sharding  # noqa: E402  (its _mesh skips where devices are fewer)
from conftest import seed_from  # noqa: E402
from flax_layers import llama  # noqa: E402
from flax_layers import scan  # noqa: E402
from flax_layers import tensor_parallel as tp  # noqa: E402
from qjax._src import gguf_io  # noqa: E402

QT = gguf.GGMLQuantizationType
MT = gguf.MODEL_TENSOR
LAYERS, RMS_EPS, CONTEXT = qwen.LAYERS, qwen.RMS_EPS, qwen.CONTEXT
PROMPT, NEW_TOKENS = qwen.PROMPT, qwen.NEW_TOKENS
ROUTING_MARGIN = 1e-3
EXPERT_TENSORS = (MT.FFN_GATE_EXP, MT.FFN_UP_EXP, MT.FFN_DOWN_EXP)


@dataclasses.dataclass(frozen=True)
class MoEArch:
  """A tiny MoE model: its shapes and each tensor's GGUF type."""
  name: str  # the test's name
  arch: str  # general.architecture
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  experts: int
  top_k: int
  expert_ffn: int
  ffn: int  # {arch}.feed_forward_length (qwen3moe: the unused dense width)
  rope_base: float
  types: dict  # MODEL_TENSOR -> GGUF type name

  @property
  def reference_cfg(self):
    """The reference's config, from these constants (not read by qjax)."""
    return types.SimpleNamespace(num_layers=LAYERS, num_heads=self.heads,
                                 num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                 rope_base=self.rope_base, rope_dim=self.head_dim,
                                 rms_eps=RMS_EPS, rope_neox=self.arch != "llama",
                                 experts_per_token=self.top_k)


# Sizes multiples of 256 where a K-quant's rows run along them (its 256-blocks).
ARCHS = {
    # head_dim 48 with hidden 256 / 4 heads: key_length is not hidden / heads.
    "qwen3moe": MoEArch("qwen3moe", "qwen3moe", hidden=256, heads=4, kv_heads=2, head_dim=48,
                        experts=8, top_k=2, expert_ffn=256, ffn=768, rope_base=1e6, types={
                            MT.TOKEN_EMBD: "Q8_0", MT.ATTN_NORM: "F32", MT.ATTN_Q: "Q4_0",
                            MT.ATTN_Q_NORM: "F32", MT.ATTN_K: "Q8_0", MT.ATTN_K_NORM: "F32",
                            MT.ATTN_V: "F16", MT.ATTN_OUT: "Q8_0", MT.FFN_NORM: "F32",
                            MT.FFN_GATE_INP: "F32", MT.FFN_GATE_EXP: "Q4_K",
                            MT.FFN_UP_EXP: "Q8_0", MT.FFN_DOWN_EXP: "Q6_K",
                            MT.OUTPUT_NORM: "F32", MT.OUTPUT: "Q6_K"}),
    "mixtral": MoEArch("mixtral", "llama", hidden=256, heads=8, kv_heads=2, head_dim=32,
                       experts=8, top_k=2, expert_ffn=512, ffn=512, rope_base=1e6, types={
                           MT.TOKEN_EMBD: "Q4_0", MT.ATTN_NORM: "F32", MT.ATTN_Q: "Q8_0",
                           MT.ATTN_K: "Q4_0", MT.ATTN_V: "Q8_0", MT.ATTN_OUT: "F16",
                           MT.FFN_NORM: "F32", MT.FFN_GATE_INP: "F16",
                           MT.FFN_GATE_EXP: "Q4_0", MT.FFN_UP_EXP: "F32",
                           MT.FFN_DOWN_EXP: "Q5_K", MT.OUTPUT_NORM: "F32"}),
    # llama.cpp's MXFP4_MOE file type: the experts in MXFP4, the rest Q8_0.
    "qwen3moe-mxfp4": MoEArch("qwen3moe-mxfp4", "qwen3moe", hidden=256, heads=4, kv_heads=2,
                              head_dim=64, experts=8, top_k=2, expert_ffn=256, ffn=768,
                              rope_base=1e6, types={
                                  MT.TOKEN_EMBD: "Q8_0", MT.ATTN_NORM: "F32",
                                  MT.ATTN_Q: "Q8_0", MT.ATTN_Q_NORM: "F32",
                                  MT.ATTN_K: "Q8_0", MT.ATTN_K_NORM: "F32",
                                  MT.ATTN_V: "Q8_0", MT.ATTN_OUT: "Q8_0",
                                  MT.FFN_NORM: "F32", MT.FFN_GATE_INP: "F32",
                                  MT.FFN_GATE_EXP: "MXFP4", MT.FFN_UP_EXP: "MXFP4",
                                  MT.FFN_DOWN_EXP: "MXFP4", MT.OUTPUT_NORM: "F32",
                                  MT.OUTPUT: "Q8_0"}),
}

# GGUF tensor base name -> the key of _reference_logits' weights.
_REFERENCE_NAMES = {**qwen._REFERENCE_NAMES, "ffn_gate_inp": "router",
                    "ffn_gate_exps": "gate_exps", "ffn_up_exps": "up_exps",
                    "ffn_down_exps": "down_exps"}

# K-quant block layouts (ggml-common.h): bytes per 256 values, the byte offsets of the
# f16 super-block scale d and of dmin (None: Q6_K's codes are signed, no min).
_KQUANTS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, None)}


def _kquant_blocks(rng, kind: str, shape: tuple[int, ...], std: float) -> np.ndarray:
  """``[*shape[:-1], row_bytes]`` uint8: random K-quant blocks (codes, 6-bit scales) with
  the f16 ``d`` (and ``dmin``, in the ratio that centres the values on 0) set so that
  the values' standard deviation is about ``std``, each block's scaled by a factor in
  [0.5, 1.5)."""
  size, d_at, dmin_at = _KQUANTS[kind]
  *lead, k = shape
  raw = rng.integers(0, 256, (*lead, k // 256, size), dtype=np.uint8)

  def put(at, v):
    v = np.broadcast_to(np.asarray(v, np.float16), raw.shape[:-1])
    raw[..., at:at + 2] = np.ascontiguousarray(v).view(np.uint8).reshape(*raw.shape[:-1], 2)

  def values():
    return gguf.quants.dequantize(raw.reshape(-1, raw.shape[-2] * size), QT[kind])

  ratio = 0.0
  if dmin_at is not None:
    put(d_at, 1.0), put(dmin_at, 0.0)
    plus = values().mean()
    put(d_at, 0.0), put(dmin_at, 1.0)
    ratio = -plus / values().mean()
  put(d_at, 1.0)
  if dmin_at is not None:
    put(dmin_at, ratio)
  unit = std / values().std()
  factor = rng.uniform(0.5, 1.5, raw.shape[:-1])
  put(d_at, unit * factor)
  if dmin_at is not None:
    put(dmin_at, ratio * unit * factor)
  return raw.reshape(*lead, -1)


def _weights(rng, kind: str, shape: tuple[int, ...], std: float):
  """``(stored data, raw_dtype)`` of random weights of numpy shape ``[..., N, K]``."""
  if kind in _KQUANTS:
    return _kquant_blocks(rng, kind, shape, std), QT[kind]
  w = (rng.standard_normal(shape) * std).astype(np.float32)
  if kind in ("Q4_0", "Q8_0", "MXFP4"):
    rows = gguf.quants.quantize(w.reshape(-1, shape[-1]), QT[kind])
    return rows.reshape(*shape[:-1], -1), QT[kind]
  return w.astype(np.float16 if kind == "F16" else np.float32), None


def _write_model(path, a: MoEArch, vocab, seed: int, *, old_layout: bool = False) -> None:
  """The Qwen3-MoE / Mixtral-style GGUF file of ``a`` with random weights; with
  ``old_layout``, the experts as one 2-D tensor each (``blk.N.ffn_gate.E.weight``, what
  llama.cpp's converter wrote for Mixtral before the stacked ``_exps`` tensors)."""
  tokens = vocab[0]
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), a.arch)
  # convert_hf_to_gguf.py: TextModel.set_gguf_parameters (experts: num_local_experts /
  # num_experts, num_experts_per_tok), Qwen2MoeModel's expert_feed_forward_length
  # (moe_intermediate_size), Qwen3's key / value length, LlamaModel's vocab size and RoPE
  # dimension count.
  w.add_name(f"tiny-{a.name}")
  w.add_context_length(CONTEXT)
  w.add_embedding_length(a.hidden)
  w.add_block_count(LAYERS)
  w.add_feed_forward_length(a.ffn)
  w.add_head_count(a.heads)
  w.add_head_count_kv(a.kv_heads)
  w.add_rope_freq_base(a.rope_base)
  w.add_layer_norm_rms_eps(RMS_EPS)
  w.add_expert_count(a.experts)
  w.add_expert_used_count(a.top_k)
  if a.arch == "qwen3moe":
    w.add_expert_feed_forward_length(a.expert_ffn)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
  else:
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(a.head_dim)
  w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  qwen._add_byte_level_vocab(w, vocab)

  q, kv, f = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.expert_ffn
  shapes = {MT.TOKEN_EMBD: (len(tokens), a.hidden), MT.OUTPUT: (len(tokens), a.hidden),
            MT.ATTN_Q: (q, a.hidden), MT.ATTN_K: (kv, a.hidden), MT.ATTN_V: (kv, a.hidden),
            MT.ATTN_OUT: (a.hidden, q), MT.FFN_GATE_INP: (a.experts, a.hidden),
            MT.FFN_GATE_EXP: (a.experts, f, a.hidden), MT.FFN_UP_EXP: (a.experts, f, a.hidden),
            MT.FFN_DOWN_EXP: (a.experts, a.hidden, f), MT.ATTN_Q_NORM: (a.head_dim,),
            MT.ATTN_K_NORM: (a.head_dim,)}
  # As test_qwen_gguf's: blocks that outweigh the embedding, a head that spreads the
  # logits; a router whose logits spread over a few units (decisive, not one-hot).
  gain = {MT.TOKEN_EMBD: np.sqrt(a.hidden) / 2, MT.ATTN_OUT: 10.0, MT.FFN_DOWN_EXP: 10.0,
          MT.OUTPUT: 5.0, MT.FFN_GATE_INP: 2.0}
  for t, kind in a.types.items():
    for i in (range(LAYERS) if gguf.TENSOR_NAMES[t].startswith("blk.") else [None]):
      shape = shapes.get(t, (a.hidden,))
      name = qwen._tensor_name(t, i)
      if len(shape) == 1:  # norms around 1
        data = 1 + 0.2 * rng.standard_normal(shape)
        w.add_tensor(name, data.astype(np.float16 if kind == "F16" else np.float32))
        continue
      raw, qtype = _weights(rng, kind, shape, gain.get(t, 1.0) / np.sqrt(shape[-1]))
      if old_layout and t in EXPERT_TENSORS:
        dense = {MT.FFN_GATE_EXP: MT.FFN_GATE, MT.FFN_UP_EXP: MT.FFN_UP,
                 MT.FFN_DOWN_EXP: MT.FFN_DOWN}[t]
        for e in range(a.experts):
          w.add_tensor(qwen._tensor_name(dense, i, f"{e}.weight"), raw[e], raw_dtype=qtype)
        continue
      w.add_tensor(name, raw, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _float64_weights(path) -> dict[str, list[np.ndarray]]:
  """The file's weights as ``_reference_logits`` takes them (matrices ``[K, N]``, expert
  stacks ``[E, K, N]``), read by ``gguf.GGUFReader`` and dequantized by
  ``gguf.quants.dequantize``, not by qjax."""
  f64: dict[str, list] = {}
  for t in gguf.GGUFReader(str(path)).tensors:
    a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
    a = a.reshape(tuple(reversed([int(d) for d in t.shape])))
    a = np.swapaxes(a, -1, -2) if a.ndim >= 2 else a
    parts = t.name.split(".")
    if parts[0] == "blk":
      f64.setdefault(_REFERENCE_NAMES[parts[2]], [None] * LAYERS)[int(parts[1])] = a
    else:
      f64[_REFERENCE_NAMES[parts[0]]] = [a]
  return f64


def _routing_margin(a: MoEArch, f64, ids) -> float:
  """The smallest gap, over the layers and tokens of ``ids``, between the k-th and the
  (k+1)-th router logit of the reference."""
  logits: list = []
  audit._reference_logits(a.reference_cfg, f64, ids, logits)
  top = np.sort(np.concatenate(logits), axis=-1)[:, ::-1]
  return float((top[:, a.top_k - 1] - top[:, a.top_k]).min())


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return qwen._byte_level_vocab(tmp_path_factory.mktemp("bbpe"))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request, vocab, tmp_path_factory):
  """``(MoEArch, path, float64 weights, prompt ids, greedy ids, reference logits)``; the
  weights' seed is the first whose greedy reference has clear top-1 leads and clear
  routing (:data:`ROUTING_MARGIN`)."""
  a = ARCHS[request.param]
  tmp_path = tmp_path_factory.mktemp(a.name)
  prompt_ids = vocab[3].encode(PROMPT).ids
  for seed in range(seed_from(a.name) % 1000, seed_from(a.name) % 1000 + 16):
    path = tmp_path / f"tiny-{a.name}-{seed}.gguf"
    _write_model(path, a, vocab, seed)
    f64 = _float64_weights(path)
    ref = qwen._greedy_reference(a, f64, prompt_ids)
    if ref is not None and _routing_margin(a, f64, prompt_ids + ref[0]) > ROUTING_MARGIN:
      return a, path, f64, prompt_ids, *ref
    path.unlink()
  pytest.fail(f"no seed gives a {a.name} greedy reference with clear leads and routing")


def _load(path, scan_layers: bool, **options):
  gfile = gguf_io.load_gguf(path, progress=False)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, scan_layers=scan_layers, **options)
  return cfg, llama.params_from_gguf(gfile, scan_layers=scan_layers)


def _decoded_logits(cfg, params, prompt_ids, generated) -> np.ndarray:
  """``[len(generated), vocab]``: the prompt's last logits from ``llama.prefill``, then
  those of each cached ``llama.decode_step`` on ``generated[:-1]``."""
  n = len(prompt_ids)
  logits, cache = llama.prefill(params, jnp.asarray([prompt_ids], jnp.int32),
                                llama.init_cache(cfg, 1, n + NEW_TOKENS), cfg=cfg)
  got = [np.asarray(logits[0, -1])]
  for j, token in enumerate(generated[:-1]):
    step, cache = llama.decode_step(params, jnp.asarray([token], jnp.int32), n + j, cache,
                                    cfg=cfg)
    got.append(np.asarray(step[0]))
  return np.stack(got)


# --- The files. ----------------------------------------------------------------------------


def test_the_files_hold_what_the_tests_claim(model):
  """gguf-py's tensor list of each architecture, 3-D expert tensors of several types (or
  all MXFP4: llama.cpp's MXFP4_MOE), no dense FFN; a config that reads the experts."""
  a, path, *_ = model
  reader = gguf.GGUFReader(str(path))
  kinds = {t.name: t.tensor_type.name for t in reader.tensors}
  dims = {t.name: len(t.shape) for t in reader.tensors}
  known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[a.arch.upper()]]}
  for name in kinds:
    parts = name.split(".")[:-1]
    if parts[0] == "blk":
      parts[1] = "{bid}"
    assert ".".join(parts) in known, name
  assert not any(".ffn_gate.weight" in n or ".ffn_up.weight" in n for n in kinds)
  for t in EXPERT_TENSORS:
    assert dims[qwen._tensor_name(t, 1)] == 3
  expert_kinds = {kinds[qwen._tensor_name(t, 0)] for t in EXPERT_TENSORS}
  if a.name.endswith("mxfp4"):
    assert expert_kinds == {"MXFP4"}
  else:
    assert len(expert_kinds) == 3 and expert_kinds & {"Q4_K", "Q5_K", "Q6_K"}
  cfg = llama.LlamaConfig.from_metadata(gguf_io.read_metadata(path))
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (
      a.experts, a.top_k, a.expert_ffn)
  assert cfg.head_dim == a.head_dim and cfg.rope_neox == (a.arch == "qwen3moe")
  assert cfg.qk_norm == (a.arch == "qwen3moe")
  assert ("output.weight" in kinds) == (a.arch == "qwen3moe")


def test_block_tensor_names_are_gguf_pys():
  """The names params_from_gguf reads are gguf-py's for the architecture; the MoE tensors
  replace the dense FFN's."""
  for name, a in ARCHS.items():
    known = {gguf.TENSOR_NAMES[t]
             for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[a.arch.upper()]]}
    cfg = dataclasses.replace(audit._config("gqa3x1"), **llama.ARCHITECTURE_OPTIONS[a.arch],
                              num_experts=a.experts, experts_per_token=a.top_k)
    suffixes = llama.block_tensors(cfg)
    assert {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
            "ffn_down_exps.weight"} <= set(suffixes)
    assert "ffn_gate.weight" not in suffixes
    for suffix in suffixes:
      assert "blk.{bid}." + suffix.rsplit(".", 1)[0] in known, (name, suffix)


# --- The model against float64. ----------------------------------------------------------


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_model_logits_match_the_float64_reference(model, scan_layers):
  """qjax's loader and model, float32: the logits of the prompt and the greedy
  continuation equal the reference's, stacked (lax.scan, experts read with
  qjax.layer_of) and unrolled; the experts stay GGUF stacks, the router float32."""
  a, path, _, prompt_ids, generated, want = model
  cfg, params = _load(path, scan_layers)
  p = params["params"]
  moe = (p["blocks"] if scan_layers else p["layers_1"])["moe"]
  lead = (LAYERS,) if scan_layers else ()
  assert moe["router"].dtype == jnp.float32
  assert moe["router"].shape == (*lead, a.hidden, a.experts)
  for name, shape in (("gate", (a.hidden, a.expert_ffn)), ("down", (a.expert_ffn, a.hidden))):
    assert tuple(moe[name].shape) == shape
    assert moe[name].leading_axes == (*lead, a.experts)
  tokens = np.asarray([prompt_ids + generated], np.int32)
  with jax.default_matmul_precision("highest"):
    got = llama.forward(params, tokens, cfg=cfg)[0]
  audit._close(got, want, rel=1e-5)


def test_cached_decoding_matches_the_float64_reference(model):
  """Prefill of the prompt (more (token, expert) pairs than experts: every expert
  dequantized, ragged_dot), then one decode step per generated token (2 pairs: the
  selected experts gathered): each step's logits equal the reference's."""
  a, path, _, prompt_ids, generated, want = model
  cfg, params = _load(path, True)
  n = len(prompt_ids)
  assert n * a.top_k > a.experts > a.top_k
  with jax.default_matmul_precision("highest"):
    got = _decoded_logits(cfg, params, prompt_ids, generated)
  audit._close(got, want[n - 1:-1], rel=1e-5)


def test_bfloat16_model_runs_near_the_float64_reference(model):
  """bfloat16 activations (the GPU default), prefill and decode: finite logits whose
  greedy picks are mostly the reference's. Not closer: rounding the router's input to
  bfloat16 (2**-9 relative) swaps a selected expert wherever the k-th and (k+1)-th router
  logits are that close, and a swapped expert changes that token's FFN output wholesale
  (measured: logits within 1-2% of the largest where no expert swaps, up to 50% where
  one does; greedy agreement 91-100%). The expert products themselves are checked in
  bfloat16 by :func:`test_moe_block_in_bfloat16`."""
  a, path, _, prompt_ids, generated, want = model
  cfg, params = _load(path, True, dtype=jnp.bfloat16)
  n = len(prompt_ids)
  got = _decoded_logits(cfg, params, prompt_ids, generated).astype(np.float64)
  ref = want[n - 1:-1]
  assert np.isfinite(got).all()
  assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.75


@pytest.mark.parametrize("tokens", [1, 24], ids=["decode", "prefill"])
def test_moe_block_in_bfloat16(model, tokens):
  """:class:`llama.MoE` of layer 1 on the file's GGUF expert stacks (``qjax.layer_of`` of
  the stacked params, as the scan reads them), bfloat16 tokens: within 2% of the largest
  output of the float64 FFN of the same bfloat16 tokens (measured: under 1%), their
  routing clear (the router runs in float32 on both sides)."""
  a, path, f64, *_ = model
  cfg, params = _load(path, True, dtype=jnp.bfloat16)
  layer = scan.layer_params(params["params"]["blocks"]["moe"], jnp.int32(1))
  assert isinstance(layer["gate"], qjax.LayerOf)
  w = {k: f64[k][1] for k in ("router", "gate_exps", "up_exps", "down_exps")}
  rng = np.random.default_rng(seed_from(f"{a.name}-bf16-{tokens}"))
  pool = np.asarray(jnp.asarray(rng.standard_normal((64, a.hidden)), jnp.bfloat16)
                    .astype(jnp.float32), np.float64)
  top = np.sort(pool @ w["router"], axis=-1)[:, ::-1]
  x = pool[top[:, a.top_k - 1] - top[:, a.top_k] > ROUTING_MARGIN][:tokens]
  assert len(x) == tokens
  got = jax.jit(lambda p, x: llama.MoE(cfg).apply({"params": p}, x))(
      layer, jnp.asarray(x[None], jnp.bfloat16))
  assert got.dtype == jnp.bfloat16
  want = audit._moe_ffn64(x, w, a.top_k)
  audit._close(got[0], want, rel=2e-2)


def test_greedy_generation_matches_the_float64_reference(model):
  """``qjax generate --temperature 0 --json``: the reference's greedy tokens."""
  a, path, _, prompt_ids, generated, _ = model
  got, err = qwen._greedy_cli(path)
  assert got["prompt_ids"] == prompt_ids
  assert got["generated_ids"] == generated
  if jax.default_backend() == "cpu":  # on a GPU the kernels' names (auto)
    assert ("matmul implementation: xla; experts: xla; decode attention: xla; prefill "
            "attention: xla,") in err, err


def test_gguf_expert_stacks_run_xla_under_the_kernel_implementations(model):
  """``implementation="interpret"`` (or "pallas"): the GGUF expert stacks have no MoE
  kernel, so :class:`llama.MoE` runs them on XLA (as ``llama.matmul`` does for a dense
  weight without a kernel) instead of failing; the same values."""
  a, path, *_ = model
  cfg, params = _load(path, False, implementation="interpret")
  moe = params["params"]["layers_0"]["moe"]
  assert llama.moe_implementation(moe["gate"], "interpret") == "xla"
  assert llama.moe_implementation(moe["gate"], "pallas") == "xla"
  assert llama.moe_implementation(moe["gate"], None) is None
  x = jnp.asarray(np.random.default_rng(seed_from(a.name + "interpret")).standard_normal(
      (1, 3, a.hidden)), jnp.float32)
  got = llama.MoE(cfg).apply({"params": moe}, x)
  want = llama.MoE(dataclasses.replace(cfg, implementation="xla")).apply({"params": moe}, x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _moe64(x, router, gate, up, down, top_k):
  """The MoE FFN of ``x [T, D]`` in float64 (audit._moe_ffn64)."""
  w = {"router": router, "gate_exps": gate, "up_exps": up, "down_exps": down}
  return audit._moe_ffn64(np.asarray(x, np.float64), w, top_k)


@pytest.mark.parametrize("tokens", [1, 12], ids=["decode", "prefill"])
@pytest.mark.parametrize("layered", [False, True], ids=["one_layer", "layer_of"])
def test_moe_block_on_mxfp4_expert_stacks(tokens, layered):
  """:class:`llama.MoE` on other expert stacks that qjax.moe_matmul takes (MXFP4,
  :func:`qjax.quantize_mxfp4`), one layer's or layer 1 of a ``[layers, E, ...]`` stack
  through qjax.layer_of: equal to the float64 MoE FFN of the dequantized weights."""
  d, f, e, k = 64, 96, 6, 2
  cfg = llama.LlamaConfig(vocab_size=10, hidden_size=d, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=32, ffn_size=128, num_experts=e,
                          experts_per_token=k, expert_ffn_size=f)
  rng = np.random.default_rng(seed_from(f"mxfp4-moe{tokens}{layered}"))
  layers = []
  for _ in range(2):
    router = rng.standard_normal((d, e)) * 2 / np.sqrt(d)
    stacks = {name: qjax.quantize_mxfp4(jnp.asarray(rng.standard_normal((e, kk, nn))
                                                    / np.sqrt(kk), jnp.float32))
              for name, (kk, nn) in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d)))}
    layers.append({"router": jnp.asarray(router, jnp.float32), **stacks})
  x = rng.standard_normal((1, tokens, d))
  if layered:
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    params = {"router": stacked["router"][1],
              **{n: qjax.layer_of(stacked[n], 1) for n in ("gate", "up", "down")}}
  else:
    params = layers[1]
  got = jax.jit(lambda p, x: llama.MoE(cfg).apply({"params": p}, x))(
      params, jnp.asarray(x, jnp.float32))
  w = {n: np.asarray(layers[1][n].dequantize(), np.float64) for n in ("gate", "up", "down")}
  want = _moe64(x[0], np.asarray(layers[1]["router"], np.float64), w["gate"], w["up"],
                w["down"], k)
  audit._close(got[0], want, rel=1e-5)


def test_moe_block_names_experts_that_disagree_with_the_config():
  """Params whose expert count or shape is not the config's: a ValueError naming both."""
  cfg = llama.LlamaConfig(vocab_size=10, hidden_size=64, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=32, ffn_size=96, num_experts=6,
                          experts_per_token=2)
  stack = qjax.quantize_mxfp4(jnp.ones((4, 64, 96), jnp.float32))
  params = {"router": jnp.ones((64, 6)), "gate": stack, "up": stack,
            "down": qjax.quantize_mxfp4(jnp.ones((6, 96, 64), jnp.float32))}
  with pytest.raises(ValueError, match=r"^MoE: gate holds 4 experts of logical shape \(64, 96\); "
                     r"the config needs 6 experts of \(64, 96\)"):
    llama.MoE(cfg).apply({"params": params}, jnp.ones((1, 2, 64)))


# --- Loading: the tensors generate checks, the ones the model takes. ----------------------


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_needed_tensors_are_what_params_from_gguf_takes(model, scan_layers):
  """``llama.needed_tensors`` (which generate checks the header against) is the list
  params_from_gguf takes, in its order, router and expert stacks included; a file lacking
  an expert stack is refused naming it."""
  a, path, *_ = model
  f = qwen._gfile(path)
  cfg = llama.LlamaConfig.from_metadata(f.metadata)
  needed = llama.needed_tensors(cfg, scan_layers)
  assert len(needed) == len(set(needed)) == len(llama.block_tensors(cfg)) * LAYERS + 2
  assert "blk.1.ffn_down_exps.weight" in needed and "blk.1.ffn_down.weight" not in needed
  f.tensors = qwen._TakeOrder(f.tensors)
  llama.params_from_gguf(f, consume=True, scan_layers=scan_layers)
  assert [n for n in f.tensors.taken if n != "output.weight"] == needed
  assert not f.tensors, sorted(f.tensors)
  f = qwen._gfile(path)
  del f.tensors["blk.1.ffn_up_exps.weight"]
  with pytest.raises(ValueError, match=rf"the {a.arch} model needs tensor "
                     r"'blk.1.ffn_up_exps.weight', which the file lacks \(1 missing in all\)"):
    llama.params_from_gguf(f, scan_layers=scan_layers)


def test_params_from_gguf_checks_the_expert_shapes(model):
  """An expert stack or router that disagrees with the metadata (width, expert count, no
  expert axis) is a ValueError naming the tensor and both shapes."""
  a, path, *_ = model
  f, wide = a.expert_ffn, a.expert_ffn != a.hidden
  gfile = qwen._gfile(path)
  up = gfile.tensors["blk.0.ffn_up_exps.weight"]
  cases = {
      "blk.0.ffn_down_exps.weight": (jax.tree.map(lambda x: x[:4], gfile.tensors[
          "blk.0.ffn_down_exps.weight"]), rf"holds 4 experts of logical shape \({f}, 256\)"),
      "blk.1.ffn_gate_exps.weight": (jax.tree.map(lambda x: x[0], up),
                                     rf"holds a single matrix \(no expert axis\) of logical "
                                     rf"shape \(256, {f}\)"),
      "blk.1.ffn_gate_inp.weight": (jnp.zeros((a.hidden, 4)),
                                    r"holds a router of logical shape \(256, 4\)")}
  if wide:
    cases["blk.0.ffn_down_exps.weight"] = (up, rf"holds 8 experts of logical shape "
                                           rf"\(256, {f}\)")
  want = {"blk.0.ffn_down_exps.weight": rf"\(8, {f}, 256\)",
          "blk.1.ffn_gate_exps.weight": rf"\(8, 256, {f}\)",
          "blk.1.ffn_gate_inp.weight": r"\(256, 8\)"}
  for name, (w, match) in cases.items():
    gfile = qwen._gfile(path, **{name: w})
    with pytest.raises(ValueError, match=rf"tensor '{name}' {match}; the metadata \(hidden "
                       rf"256, 8 experts of width {f}\) needs {want[name]}$"):
      llama.params_from_gguf(gfile, scan_layers=False)


# --- What the model cannot run. ------------------------------------------------------------


# Qwen3-30B-A3B's hyperparameters as its GGUF states them.
QWEN3MOE = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 2048,
            "qwen3moe.attention.head_count": 32, "qwen3moe.attention.head_count_kv": 4,
            "qwen3moe.attention.key_length": 128, "qwen3moe.attention.value_length": 128,
            "qwen3moe.block_count": 48, "qwen3moe.feed_forward_length": 6144,
            "qwen3moe.expert_feed_forward_length": 768, "qwen3moe.expert_count": 128,
            "qwen3moe.expert_used_count": 8, "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen3moe.rope.freq_base": 1e6, "qwen3moe.context_length": 40960,
            "qwen3moe.vocab_size": 151936}
# Mixtral-8x7B's.
MIXTRAL = {"general.architecture": "llama", "llama.embedding_length": 4096,
           "llama.attention.head_count": 32, "llama.attention.head_count_kv": 8,
           "llama.block_count": 32, "llama.feed_forward_length": 14336,
           "llama.expert_count": 8, "llama.expert_used_count": 2,
           "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 1e6,
           "llama.context_length": 32768, "llama.vocab_size": 32000}


def test_from_metadata_of_qwen3_30b_a3b_and_mixtral_8x7b():
  cfg = llama.LlamaConfig.from_metadata(QWEN3MOE)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size, cfg.head_dim) == (
      128, 8, 768, 128)
  assert cfg.rope_neox and cfg.qk_norm and cfg.moe
  cfg = llama.LlamaConfig.from_metadata(MIXTRAL)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (8, 2, 14336)
  assert not (cfg.rope_neox or cfg.qk_norm)
  # llama.cpp's qwen3moe without expert_feed_forward_length: n_ff / n_expert_used.
  legacy = {k: v for k, v in QWEN3MOE.items() if "expert_feed" not in k}
  assert llama.LlamaConfig.from_metadata(legacy).expert_ffn_size == 6144 // 8
  dense = {k: v for k, v in MIXTRAL.items() if "expert" not in k}
  assert not llama.LlamaConfig.from_metadata(dense).moe
  assert not llama.LlamaConfig.from_metadata({**dense, "llama.expert_count": 0}).moe


@pytest.mark.parametrize("base,extra,match", [
    (QWEN3MOE, {"qwen3moe.expert_shared_count": 1}, r"^qwen3moe.expert_shared_count=1 is "
     r"not supported: qjax's MoE blocks have routed experts only, no shared expert$"),
    (QWEN3MOE, {"qwen3moe.expert_gating_func": 2}, r"^qwen3moe.expert_gating_func=2 "
     r"\(sigmoid\) is not supported; qjax's MoE routes with softmax \(1\)$"),
    (MIXTRAL, {"llama.expert_weights_scale": 2.5}, r"^llama.expert_weights_scale=2.5 is not "
     r"supported; qjax's MoE weighs the selected experts by their renormalized "
     r"probabilities \(scale 1\)$"),
    (QWEN3MOE, {"qwen3moe.expert_weights_norm": False}, r"^qwen3moe.expert_weights_norm="
     r"False is not supported; qjax's MoE renormalizes the selected experts' weights"),
    (MIXTRAL, {"llama.leading_dense_block_count": 1}, r"^llama.leading_dense_block_count=1 "
     r"is not supported; qjax's MoE models have experts in every block$"),
    (QWEN3MOE, {"qwen3moe.expert_count": 0}, r"^qwen3moe.expert_count=0: a qwen3moe model "
     r"has experts"),
    (MIXTRAL, {"llama.expert_used_count": 9}, r"^llama.expert_used_count=9 must be in "
     r"\[1, llama.expert_count=8\]"),
], ids=["shared", "sigmoid", "scale", "no_norm", "leading_dense", "no_experts", "used"])
def test_from_metadata_refuses_moe_it_does_not_implement(base, extra, match):
  with pytest.raises(ValueError, match=match):
    llama.LlamaConfig.from_metadata({**base, **extra})


def test_softmax_gating_and_unit_scale_are_accepted():
  """The keys a converter may write with the values llama.cpp runs for these models."""
  cfg = llama.LlamaConfig.from_metadata({
      **QWEN3MOE, "qwen3moe.expert_gating_func": 1, "qwen3moe.expert_weights_scale": 1.0,
      "qwen3moe.expert_weights_norm": True, "qwen3moe.expert_shared_count": 0,
      "qwen3moe.leading_dense_block_count": 0})
  assert cfg.num_experts == 128


@pytest.mark.parametrize("moe,name,match", [
    (True, "blk.3.ffn_gate.5.weight", r"tensor 'blk.3.ffn_gate.5.weight' is one expert of "
     r"the old Mixtral layout \(a 2-D tensor per expert\), which qjax does not read; convert "
     r"the model again"),
    (True, "blk.0.ffn_up_shexp.weight", r"tensor 'blk.0.ffn_up_shexp.weight' is a shared "
     r"expert"),
    (True, "blk.0.ffn_gate_inp_shexp.weight", r"tensor 'blk.0.ffn_gate_inp_shexp.weight' is "
     r"a shared expert"),
    (True, "blk.0.ffn_down.weight", r"tensor 'blk.0.ffn_down.weight' is a dense FFN weight "
     r"in an MoE model \(8 experts\)"),
    (False, "blk.1.ffn_gate_exps.weight", r"tensor 'blk.1.ffn_gate_exps.weight' belongs to a "
     r"mixture of experts, but the metadata's expert_count is 0 or absent"),
], ids=["old_mixtral", "shared_up", "shared_router", "dense_in_moe", "experts_in_dense"])
def test_check_tensor_names_refuses_ffn_tensors_it_would_not_run(moe, name, match):
  meta = MIXTRAL if moe else {k: v for k, v in MIXTRAL.items() if "expert" not in k}
  cfg = llama.LlamaConfig.from_metadata(meta)
  llama.check_tensor_names(cfg, llama.needed_tensors(cfg))  # its own tensors pass
  with pytest.raises(ValueError, match=r"^x.gguf: " + match):
    llama.check_tensor_names(cfg, [*llama.needed_tensors(cfg), name], "x.gguf")


def test_generate_refuses_the_old_mixtral_layout(vocab, tmp_path):
  """A Mixtral file with one 2-D tensor per expert: one line on stderr naming the first
  such tensor, exit code 2, before any tensor data is read (the header's names)."""
  path = tmp_path / "old-mixtral.gguf"
  _write_model(path, ARCHS["mixtral"], vocab, 0, old_layout=True)
  assert "blk.0.ffn_gate.0.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
  rc, out, err = spm_gguf._cli(["generate", "--model", str(path), "--prompt", PROMPT,
                                "--max-new-tokens", "2"])
  assert rc == 2 and not out
  assert err.strip().splitlines()[-1].startswith(
      f"qjax generate: error: {path}: tensor 'blk.0.ffn_gate.0.weight' is one expert of the "
      "old Mixtral layout")


def test_tensor_parallel_refuses_moe(model):
  """``--devices 2`` of an MoE file: refused before the load, naming the experts;
  ``tensor_parallel.local_config`` likewise."""
  a, path, *_ = model
  cfg = llama.LlamaConfig.from_metadata(gguf_io.read_metadata(path))
  with pytest.raises(ValueError, match=r"tensor parallel over 2 devices does not run "
                     r"mixture-of-experts models \(8 experts, 2 per token\) yet; run it on "
                     r"one device \(--devices 1\)"):
    tp.local_config(cfg, 2)
  if a.arch != "qwen3moe":
    return  # one file is enough end to end
  test_sharding._mesh(2)  # skips with fewer devices
  rc, out, err = spm_gguf._cli(["generate", "--model", str(path), "--prompt", PROMPT,
                                "--max-new-tokens", "2", "--devices", "2"])
  assert rc == 2 and not out
  assert "does not run mixture-of-experts models" in err.strip().splitlines()[-1]


def test_config_checks_the_expert_fields():
  base = dict(vocab_size=10, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
              head_dim=32, ffn_size=128)
  assert llama.LlamaConfig(**base, num_experts=4, experts_per_token=2).expert_ffn_size == 128
  with pytest.raises(ValueError, match=r"experts_per_token=5 must be an int in "
                     r"\[1, num_experts=4\]"):
    llama.LlamaConfig(**base, num_experts=4, experts_per_token=5)
  with pytest.raises(ValueError, match=r"experts_per_token=2, expert_ffn_size=None without "
                     r"experts"):
    llama.LlamaConfig(**base, experts_per_token=2)


def _mxfp4_model(model):
  if not model[0].name.endswith("mxfp4"):
    pytest.skip("the MXFP4-expert file's case")
  return model


def test_expert_stacks_take_the_moe_kernels_layout(model):
  """Where kernels run, generate gives the GGUF expert stacks an MoE kernel reads that
  kernel's layout (``expert_kernel_layouts``, lossless): MXFP4 (llama.cpp's MXFP4_MOE) as
  the stacked MXFP4Weight, Q4_0 as the stacked Int4Weight; the other types' stacks are
  kept; the MoE block through the interpreted MoE kernels on them equals the XLA path on
  the GGUF stacks."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  a, path, *_ = model
  cfg, params = _load(path, True)
  converted = generate.expert_kernel_layouts(params)
  before, after = params["params"]["blocks"]["moe"], converted["params"]["blocks"]["moe"]
  kernel_layouts = {qjax.GGUFMXFP4: qjax.MXFP4Weight, qjax.GGUFQ4_0: qjax.Int4Weight}
  converted_any = False
  for name in ("gate", "up", "down"):
    want = kernel_layouts.get(type(before[name]))
    if want is None:  # kept: the same class over the same arrays
      assert type(after[name]) is type(before[name]), name
      assert all(a is b for a, b in zip(jax.tree.leaves(after[name]),
                                        jax.tree.leaves(before[name]))), name
      continue
    converted_any = True
    assert isinstance(after[name], want), name
    np.testing.assert_array_equal(np.asarray(after[name].dequantize()),
                                  np.asarray(before[name].dequantize()))
    assert qjax.moe_implementation_name(after[name], "interpret", 2) != "xla"
  assert converted_any == (a.name != "qwen3moe"), a.name  # its stacks: Q4_K, Q8_0, Q6_K
  assert after["router"] is before["router"]
  x = jnp.asarray(np.random.default_rng(seed_from("mxfp4 layouts")).standard_normal(
      (1, 3, a.hidden)), jnp.float32)

  def block(moe, implementation):
    layer = jax.tree.map(lambda w: qjax.layer_of(w, 1) if qjax.is_quantized(w) else w[1], moe,
                         is_leaf=qjax.is_quantized)
    c = dataclasses.replace(cfg, implementation=implementation)
    return np.asarray(llama.MoE(c).apply({"params": layer}, x), np.float64)

  want, got = block(before, "xla"), block(after, "interpret")
  assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))


def test_expert_stacks_take_the_wgmma_layout_on_hopper(model):
  """``moe_kernel_layouts`` (what generate runs after ``expert_kernel_layouts`` where
  kernels run): on a stand-in Hopper device the MXFP4 expert stacks become the wgmma MoE
  kernel's MXFP4NKWeight, bit-exact; Q4_0's Int4Weight stacks (groups of 32, which that
  kernel declines) and the other types' stacks stay, as does every weight outside ``moe``;
  on a device without the wgmma kernel nothing changes. The MoE block on the converted
  stacks equals the block on the GGUF stacks (XLA path)."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_wgmma  # pylint: disable=g-import-not-at-top
  from tests.test_kernel_layouts import HOPPER  # pylint: disable=g-import-not-at-top
  a, path, *_ = model
  cfg, params = _load(path, True)
  gguf_moe = dict(params["params"]["blocks"]["moe"])
  params = generate.expert_kernel_layouts(params)
  before = dict(params["params"]["blocks"]["moe"])
  outside = [leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)
             if "moe" not in jax.tree_util.keystr(p)]
  assert generate.moe_kernel_layouts(params, jnp.bfloat16) is params
  if not int4_wgmma.supported(jax.devices()[0]):  # no MoE kernel's layout changes here
    assert all(params["params"]["blocks"]["moe"][k] is v for k, v in before.items())
  generate.moe_kernel_layouts(params, jnp.bfloat16, device=HOPPER)
  after = params["params"]["blocks"]["moe"]
  for name, w in before.items():
    if isinstance(w, qjax.MXFP4Weight):
      assert type(after[name]) is qjax.MXFP4NKWeight, name
      np.testing.assert_array_equal(np.asarray(after[name].dequantize()),
                                    np.asarray(w.dequantize()))
    else:
      assert after[name] is w, name
  assert (type(after["gate"]) is qjax.MXFP4NKWeight) == (a.name == "qwen3moe-mxfp4"), a.name
  assert [leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)
          if "moe" not in jax.tree_util.keystr(p)] == outside
  x = jnp.asarray(np.random.default_rng(seed_from("wgmma layouts")).standard_normal(
      (1, 3, a.hidden)), jnp.float32)

  def block(moe):
    layer = jax.tree.map(lambda w: qjax.layer_of(w, 1) if qjax.is_quantized(w) else w[1], moe,
                         is_leaf=qjax.is_quantized)
    c = dataclasses.replace(cfg, implementation="xla")
    return np.asarray(llama.MoE(c).apply({"params": layer}, x), np.float64)

  want, got = block(gguf_moe), block(after)
  assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled MoE kernels need "
                    "an NVIDIA GPU")
def test_generate_runs_mxfp4_experts_on_the_moe_kernels(model):
  """On a GPU, ``--implementation pallas`` runs an MXFP4_MOE file's experts on the MoE
  kernels (named on generate's stderr line: on Hopper the wgmma MoE kernel, its experts
  converted by ``moe_kernel_layouts``), and its prefill logits match the float64
  reference (float32 activations: the kernels' TF32 products; bf16 on Hopper's layout
  within 5e-2, as bf16 outputs round)."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_wgmma  # pylint: disable=g-import-not-at-top
  a, path, _, prompt_ids, _, ref_logits = _mxfp4_model(model)
  rc, _, err = spm_gguf._cli(["generate", "--model", str(path), "--prompt", PROMPT,
                              "--max-new-tokens", "2", "--implementation", "pallas"])
  assert rc == 0, err
  hopper = int4_wgmma.supported(jax.devices()[0])
  assert f"experts: {'mosaic_gpu_wgmma' if hopper else 'pallas_triton'}" in err, err
  tokens = jnp.asarray([prompt_ids], jnp.int32)
  ref = np.asarray(ref_logits)[:len(prompt_ids)]
  for dtype, tol in [(jnp.float32, 2e-2)] + ([(jnp.bfloat16, 5e-2)] if hopper else []):
    cfg, params = _load(path, True, implementation="pallas", dtype=dtype)
    params = generate.moe_kernel_layouts(generate.expert_kernel_layouts(params), dtype)
    want = qjax.MXFP4NKWeight if dtype == jnp.bfloat16 else qjax.MXFP4Weight
    assert type(params["params"]["blocks"]["moe"]["gate"]) is want
    logits, _ = llama.prefill(params, tokens, llama.init_cache(cfg, 1, 64), cfg=cfg)
    err = np.max(np.abs(np.asarray(logits[0], np.float64) - ref)) / np.max(np.abs(ref))
    assert err < tol, (dtype, err)
