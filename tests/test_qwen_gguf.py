"""``qjax generate`` and :mod:`flax_layers.llama` on tiny GGUF files of the ``qwen2`` and
``qwen3`` architectures, against an independent float64 numpy forward pass.

The files are written in ``tmp_path`` with ``gguf.GGUFWriter`` the way llama.cpp's
``convert_hf_to_gguf.py`` leaves a Qwen2 / Qwen3 model (tensor names and metadata keys from
gguf-py's own constants): two layers, grouped-query attention, a byte-level BPE vocabulary
(pre-tokenizer ``qwen2``, ChatML special tokens, no BOS added) trained here by
``tokenizers``, and random weights in Q8_0, Q4_0, F16 and F32. Where the architectures
differ from ``llama`` (llama.cpp ``src/models/qwen2.cpp``, ``qwen3.cpp``,
``llama_model_rope_type``):

* qwen2: q / k / v add F32 biases ``blk.N.attn_{q,k,v}.bias``; the output head is tied to
  the embedding (no ``output.weight``, as Qwen2.5-0.5B's file);
* qwen3: each q and k head goes through an RMSNorm (``blk.N.attn_{q,k}_norm.weight``,
  ``[head_dim]``) before RoPE, and the head size (``qwen3.attention.key_length``) is not
  ``embedding_length / head_count``; the head is untied;
* both rotate RoPE's pairs ``(i, i + head_dim / 2)`` (``LLAMA_ROPE_TYPE_NEOX``): their q /
  k rows are not permuted by the converter, as llama's are for its adjacent pairs.

The reference (:func:`test_generation_audit._reference_logits` with its NEOX, bias and q/k
norm options) reads the weights as gguf-py's ``gguf.quants.dequantize`` gives them. By hand
(not kept as tests): with adjacent-pair RoPE, without the biases, or without the q / k
norms, that reference's logits differ from these by far more than the tolerance, and
greedy picks change.
"""

from __future__ import annotations

import dataclasses
import json
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

import test_generate_spm_gguf as spm_gguf  # noqa: E402
import test_generation_audit as audit  # noqa: E402
import test_sharding  # noqa: E402  (its _mesh skips where devices are fewer)
import test_tokenizer_spm as spm_helpers  # noqa: E402
from conftest import seed_from  # noqa: E402
from flax_layers import llama  # noqa: E402
from flax_layers import tensor_parallel as tp  # noqa: E402
from qjax._src import gguf_io  # noqa: E402
from qjax._src import tokenizer as tokenizer_lib  # noqa: E402

QT = gguf.GGMLQuantizationType
MT = gguf.MODEL_TENSOR
PROMPT = "The quick brown fox jumps over the lazy dog in Zürich"
NEW_TOKENS = 8
LAYERS, RMS_EPS, CONTEXT = 2, 1e-6, 4096
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclasses.dataclass(frozen=True)
class Arch:
  """A tiny model of one architecture: its shapes and each tensor's GGUF type."""
  name: str
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  rope_base: float
  types: dict  # MODEL_TENSOR -> GGUF type name ("weight"; biases are F32)
  key_length: bool  # write {arch}.attention.key_length (Qwen3's converter does)
  # rope_freqs.weight, one divisor per RoPE pair (llama3 scaling; test_llama3_rope).
  rope_freqs: tuple[float, ...] | None = None

  @property
  def reference_cfg(self):
    """The reference's config, from these constants (not read by qjax)."""
    return types.SimpleNamespace(num_layers=LAYERS, num_heads=self.heads,
                                 num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                 rope_base=self.rope_base, rope_dim=self.head_dim,
                                 rms_eps=RMS_EPS, rope_neox=self.name != "llama")


# Odd head counts and sizes; the projections split over 2 devices (row-parallel o / down
# are dense or have K / 2 a multiple of the 32-block).
ARCHS = {
    "qwen2": Arch("qwen2", hidden=96, heads=6, kv_heads=2, head_dim=16, ffn=160,
                  rope_base=10000.0, key_length=False, types={
                      MT.TOKEN_EMBD: "Q8_0", MT.ATTN_NORM: "F32", MT.ATTN_Q: "Q8_0",
                      MT.ATTN_K: "Q4_0", MT.ATTN_V: "Q8_0", MT.ATTN_OUT: "F16",
                      MT.FFN_NORM: "F32", MT.FFN_GATE: "Q4_0", MT.FFN_UP: "Q8_0",
                      MT.FFN_DOWN: "F32", MT.OUTPUT_NORM: "F32"}),
    # head_dim 24 with hidden 64 / 6 heads: key_length is not hidden / heads.
    "qwen3": Arch("qwen3", hidden=64, heads=6, kv_heads=2, head_dim=24, ffn=96,
                  rope_base=1e6, key_length=True, types={
                      MT.TOKEN_EMBD: "Q4_0", MT.ATTN_NORM: "F32", MT.ATTN_Q: "Q4_0",
                      MT.ATTN_Q_NORM: "F32", MT.ATTN_K: "Q8_0", MT.ATTN_K_NORM: "F16",
                      MT.ATTN_V: "Q4_0", MT.ATTN_OUT: "F32", MT.FFN_NORM: "F32",
                      MT.FFN_GATE: "Q8_0", MT.FFN_UP: "Q4_0", MT.FFN_DOWN: "F16",
                      MT.OUTPUT_NORM: "F32", MT.OUTPUT: "Q8_0"}),
}
BIASES = {"qwen2": (MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V), "qwen3": ()}

# GGUF tensor (base name without blk.N.) -> the key of _reference_logits' weights.
_REFERENCE_NAMES = {"attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
                    "attn_output": "o", "ffn_norm": "ffn_norm", "ffn_gate": "gate",
                    "ffn_up": "up", "ffn_down": "down", "attn_q_norm": "q_norm",
                    "attn_k_norm": "k_norm", "token_embd": "embed", "output": "lm_head",
                    "output_norm": "final_norm", "rope_freqs": "rope_freqs"}


def _byte_level_vocab(tmp_path) -> tuple[list[str], list[str], list[int], object]:
  """``(tokens, merges, token types, tokenizers.Tokenizer)`` of a byte-level BPE trained
  on :mod:`test_tokenizer_spm`'s text, the ChatML special tokens appended as control
  tokens (what ``_set_vocab_gpt2`` writes for a Qwen2 tokenizer)."""
  tk = tokenizers
  lines = spm_helpers._training_lines(random.Random(1234))
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(lines, trainer)
  model = json.loads(tok.to_str())["model"]
  vocab = model["vocab"]
  tokens = sorted(vocab, key=vocab.get)
  assert [vocab[t] for t in tokens] == list(range(len(tokens)))
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  tok.add_special_tokens(list(SPECIALS))
  tokens += SPECIALS
  kinds = [tokenizer_lib.NORMAL] * (len(tokens) - 3) + [tokenizer_lib.CONTROL] * 3
  return tokens, merges, kinds, tok


def _tensor_name(t: MT, i: int | None = None, suffix: str = "weight") -> str:
  return gguf.TENSOR_NAMES[t].format(bid=i) + "." + suffix


def _rows(rng, kind: str, n: int, k: int, std: float) -> tuple[np.ndarray, QT]:
  """Random weights ``[N, K]`` stored as ``kind`` (gguf-py quantizes Q4_0 / Q8_0)."""
  w = (rng.standard_normal((n, k)) * std).astype(np.float32)
  if kind in ("Q4_0", "Q8_0"):
    return gguf.quants.quantize(w, QT[kind]), QT[kind]
  return w.astype(np.float16 if kind == "F16" else np.float32), None


def _add_byte_level_vocab(w, vocab) -> None:
  """Writes :func:`_byte_level_vocab`'s tokenizer into the GGUFWriter ``w`` as
  ``_set_vocab_gpt2`` / ``gguf.SpecialVocab`` do for a Qwen2 tokenizer (ChatML template,
  no BOS added)."""
  tokens, merges, kinds, _ = vocab
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("qwen2")
  w.add_token_list(tokens)
  w.add_token_types(kinds)
  w.add_token_merges(merges)
  w.add_eos_token_id(tokens.index("<|im_end|>"))
  w.add_pad_token_id(tokens.index("<|endoftext|>"))
  w.add_bos_token_id(tokens.index("<|endoftext|>"))
  w.add_add_bos_token(False)
  w.add_chat_template(CHATML)


def _write_model(path, a: Arch, vocab, seed: int) -> None:
  """The Qwen2 / Qwen3-style GGUF file of ``a`` with random weights."""
  tokens = vocab[0]
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), a.name)
  # convert_hf_to_gguf.py's TextModel.set_gguf_parameters (no rope.dimension_count: the
  # head size is the default).
  w.add_name(f"tiny-{a.name}")
  w.add_context_length(CONTEXT)
  w.add_embedding_length(a.hidden)
  w.add_block_count(LAYERS)
  w.add_feed_forward_length(a.ffn)
  w.add_head_count(a.heads)
  w.add_head_count_kv(a.kv_heads)
  w.add_rope_freq_base(a.rope_base)
  w.add_layer_norm_rms_eps(RMS_EPS)
  if a.key_length:
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
  w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  _add_byte_level_vocab(w, vocab)

  kv, q = a.kv_heads * a.head_dim, a.heads * a.head_dim
  shapes = {MT.TOKEN_EMBD: (len(tokens), a.hidden), MT.OUTPUT: (len(tokens), a.hidden),
            MT.ATTN_Q: (q, a.hidden), MT.ATTN_K: (kv, a.hidden), MT.ATTN_V: (kv, a.hidden),
            MT.ATTN_OUT: (a.hidden, q), MT.FFN_GATE: (a.ffn, a.hidden),
            MT.FFN_UP: (a.ffn, a.hidden), MT.FFN_DOWN: (a.hidden, a.ffn),
            MT.ATTN_Q_NORM: (a.head_dim,), MT.ATTN_K_NORM: (a.head_dim,)}
  # Blocks whose outputs outweigh the embedding (a tied head would otherwise mostly
  # repeat the last token), a head that spreads the logits so greedy picks are far from
  # ties.
  gain = {MT.TOKEN_EMBD: np.sqrt(a.hidden) / 2, MT.ATTN_OUT: 10.0, MT.FFN_DOWN: 10.0,
          MT.OUTPUT: 5.0}
  for t, kind in a.types.items():
    for i in (range(LAYERS) if gguf.TENSOR_NAMES[t].startswith("blk.") else [None]):
      shape = shapes.get(t, (a.hidden,))
      if len(shape) == 1:  # norms around 1
        data = 1 + 0.2 * rng.standard_normal(shape)
        w.add_tensor(_tensor_name(t, i),
                     data.astype(np.float16 if kind == "F16" else np.float32))
        continue
      n, k = shape
      raw, qtype = _rows(rng, kind, n, k, gain.get(t, 1.0) / np.sqrt(k))
      w.add_tensor(_tensor_name(t, i), raw, raw_dtype=qtype)
      if t in BIASES.get(a.name, ()):  # Qwen2: q / k / v biases of order 1 (K's larger)
        scale = 2.0 if t == MT.ATTN_K else 0.5
        w.add_tensor(_tensor_name(t, i, "bias"),
                     (scale * rng.standard_normal(n)).astype(np.float32))
  if a.rope_freqs is not None:
    w.add_tensor("rope_freqs.weight", np.asarray(a.rope_freqs, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _float64_weights(path) -> dict[str, list[np.ndarray]]:
  """The file's weights as ``_reference_logits`` takes them (matrices ``[K, N]``), read by
  ``gguf.GGUFReader`` and dequantized by ``gguf.quants.dequantize``, not by qjax."""
  f64: dict[str, list] = {}
  for t in gguf.GGUFReader(str(path)).tensors:
    a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
    a = a.reshape(tuple(reversed([int(d) for d in t.shape]))).T  # [K, N] or [n]
    parts = t.name.split(".")
    if parts[0] == "blk":
      key = _REFERENCE_NAMES[parts[2]] + ("_bias" if parts[3] == "bias" else "")
      f64.setdefault(key, [None] * LAYERS)[int(parts[1])] = a
    else:
      f64[_REFERENCE_NAMES[parts[0]]] = [a]
  return f64


def _greedy_reference(a: Arch, f64, prompt_ids):
  """``(greedy ids, logits [T, vocab])`` of the float64 reference, or None where a step's
  top token leads the next by 0.05 or less (qjax's float32 logits are within ~1e-5) or
  the continuation has fewer than 4 distinct tokens (so that a wrong cache or RoPE shows)."""
  ids = list(prompt_ids)
  for _ in range(NEW_TOKENS):
    logits = audit._reference_logits(a.reference_cfg, f64, ids)[-1]
    top2 = np.sort(logits)[-2:]
    if top2[1] - top2[0] <= 0.05:
      return None
    ids.append(int(np.argmax(logits)))
  if len(set(ids[len(prompt_ids):])) < 4:  # a random model that repeats one token
    return None
  return ids[len(prompt_ids):], audit._reference_logits(a.reference_cfg, f64, ids)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return _byte_level_vocab(tmp_path_factory.mktemp("bbpe"))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request, vocab, tmp_path_factory):
  """``(Arch, path, float64 weights, prompt ids, greedy ids, reference logits)``; the
  weights' seed is the first whose greedy reference has clear top-1 leads."""
  a = ARCHS[request.param]
  tmp_path = tmp_path_factory.mktemp(a.name)
  # The prompt as the trained tokenizer itself encodes it (GPT-2's split and Qwen2's agree
  # on this text: words, spaces, no digits).
  prompt_ids = vocab[3].encode(PROMPT).ids
  for seed in range(seed_from(a.name) % 1000, seed_from(a.name) % 1000 + 16):
    path = tmp_path / f"tiny-{a.name}-{seed}.gguf"
    _write_model(path, a, vocab, seed)
    f64 = _float64_weights(path)
    ref = _greedy_reference(a, f64, prompt_ids)
    if ref is not None:
      return a, path, f64, prompt_ids, *ref
    path.unlink()
  pytest.fail(f"no seed gives a {a.name} greedy reference with clear top-1 leads")


def _load(path, scan_layers: bool):
  gfile = gguf_io.load_gguf(path, progress=False)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, scan_layers=scan_layers)
  return cfg, llama.params_from_gguf(gfile, scan_layers=scan_layers)


# --- The files. ----------------------------------------------------------------------------


def test_the_files_hold_what_the_tests_claim(model):
  """gguf-py's tensor list of each architecture; qwen2's biases and tied head, qwen3's
  q / k norms, untied head and key_length; several tensor types; a config that reads them."""
  a, path, *_ = model
  reader = gguf.GGUFReader(str(path))
  kinds = {t.name: t.tensor_type.name for t in reader.tensors}
  known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[a.name.upper()]]}
  for name in kinds:
    parts = name.split(".")[:-1]  # without .weight / .bias
    if parts[0] == "blk":
      parts[1] = "{bid}"
    assert ".".join(parts) in known, name
  assert {"Q4_0", "Q8_0", "F16", "F32"} <= set(kinds.values())
  cfg = llama.LlamaConfig.from_metadata(gguf_io.read_metadata(path))
  assert cfg.rope_neox and cfg.head_dim == a.head_dim and cfg.rope_dim == a.head_dim
  if a.name == "qwen2":
    assert cfg.qkv_bias and not cfg.qk_norm and "output.weight" not in kinds
    assert kinds["blk.1.attn_k.bias"] == "F32"
  else:
    assert cfg.qk_norm and not cfg.qkv_bias and "output.weight" in kinds
    assert a.hidden // a.heads != a.head_dim
    assert not any(n.endswith(".bias") for n in kinds)


def test_block_tensor_names_are_gguf_pys():
  """The names params_from_gguf reads are gguf-py's for the architecture."""
  for arch in ("qwen2", "qwen3"):
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]}
    cfg = dataclasses.replace(audit._config("gqa3x1"), **llama.ARCHITECTURE_OPTIONS[arch])
    for suffix in llama.block_tensors(cfg):
      assert "blk.{bid}." + suffix.rsplit(".", 1)[0] in known, (arch, suffix)


# --- The model against float64. ----------------------------------------------------------


@pytest.mark.parametrize("scan_layers", [True, False])
def test_model_logits_match_the_float64_reference(model, scan_layers):
  """qjax's loader and model: the logits of the prompt and the greedy continuation equal
  the reference's, stacked (lax.scan) and unrolled."""
  a, path, _, prompt_ids, generated, want = model
  cfg, params = _load(path, scan_layers)
  p = params["params"]
  assert ("lm_head" in p) == (a.name == "qwen3")
  blocks = p["blocks"] if scan_layers else p["layers_1"]
  if a.name == "qwen2":
    assert blocks["attn"]["k"]["bias"].shape == ((LAYERS,) if scan_layers else ()) + (
        a.kv_heads * a.head_dim,)
  else:
    assert blocks["attn"]["q_norm"]["scale"].shape[-1] == a.head_dim
  with jax.default_matmul_precision("highest"):
    got = llama.forward(params, np.asarray([prompt_ids + generated], np.int32), cfg=cfg)[0]
  audit._close(got, want)


def test_cached_decoding_matches_the_float64_reference(model):
  """Prefill of the prompt, then one decode step per generated token: each step's logits
  equal the reference's (the KV cache holds the biased, normed, rotated keys)."""
  a, path, _, prompt_ids, generated, want = model
  cfg, params = _load(path, True)
  n = len(prompt_ids)
  with jax.default_matmul_precision("highest"):
    logits, cache = llama.prefill(params, jnp.asarray([prompt_ids], jnp.int32),
                                  llama.init_cache(cfg, 1, n + NEW_TOKENS), cfg=cfg)
    got = [np.asarray(logits[0, -1])]
    for j, token in enumerate(generated[:-1]):
      step, cache = llama.decode_step(params, jnp.asarray([token], jnp.int32), n + j, cache,
                                      cfg=cfg)
      got.append(np.asarray(step[0]))
  audit._close(np.stack(got), want[n - 1:-1])


def _greedy_cli(path) -> tuple[dict, str]:
  """``qjax generate --temperature 0 --json`` of :data:`PROMPT` for :data:`NEW_TOKENS`
  tokens in float32, in process: (its JSON object, its stderr); asserts exit code 0."""
  rc, out, err = spm_gguf._cli(["generate", "--model", str(path), "--prompt", PROMPT,
                                "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0",
                                "--dtype", "float32", "--json"])
  assert rc == 0, err
  return json.loads(out), err


def test_greedy_generation_matches_the_float64_reference(model):
  """``qjax generate --temperature 0 --json``: the prompt is the trained tokenizer's
  encoding with no BOS (tokenizer.ggml.add_bos_token is false), the tokens are the
  reference's greedy ones."""
  a, path, _, prompt_ids, generated, _ = model
  got, _ = _greedy_cli(path)
  assert got["prompt_ids"] == prompt_ids
  assert got["generated_ids"] == generated


def test_tensor_parallel_matches_the_float64_reference(model):
  """Two devices (heads, biases and MLP split; q / k norms replicated), unrolled and
  stacked layers: the logits equal the reference's."""
  a, path, _, prompt_ids, generated, want = model
  mesh = test_sharding._mesh(2)
  tokens = jnp.asarray([prompt_ids + generated], jnp.int32)
  for scan_layers in (False, True):
    cfg, params = _load(path, scan_layers)
    sharded = tp.shard_llama_params(params, mesh, cfg)
    attn = sharded["params"]["blocks" if scan_layers else "layers_0"]["attn"]
    if a.name == "qwen2":
      bias = attn["q"]["bias"]
      assert {s.data.shape[-1] for s in bias.addressable_shards} == {a.heads * a.head_dim // 2}
    else:
      assert attn["k_norm"]["scale"].sharding.is_fully_replicated
    with jax.default_matmul_precision("highest"):
      got = tp.tp_forward(sharded, tokens, cfg=cfg, mesh=mesh)[0]
    audit._close(got, want)


def test_tensor_parallel_generate(model):
  """``qjax generate --devices 2``: the same greedy tokens."""
  a, path, _, prompt_ids, generated, _ = model
  if a.name != "qwen2":
    pytest.skip("one architecture is enough end to end")
  test_sharding._mesh(2)  # skips with fewer devices
  rc, out, err = spm_gguf._cli(["generate", "--model", str(path), "--prompt", PROMPT,
                                "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0",
                                "--dtype", "float32", "--json", "--devices", "2"])
  assert rc == 0, err
  assert json.loads(out)["generated_ids"] == generated


@pytest.mark.parametrize("rope_dim", [8, 16])
def test_apply_rope_neox_pairs_i_with_i_plus_half(rope_dim):
  """NEOX: pairs (i, i + rope_dim / 2), the dims past rope_dim untouched; not NORM's."""
  rng = np.random.default_rng(seed_from(f"neox{rope_dim}"))
  x = rng.standard_normal((2, 5, 3, 16))
  positions = np.asarray([[0, 1, 2, 7, 40], [600, 601, 3, 4, 5]], np.int32)
  got = np.asarray(llama.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions),
                                    10000.0, rope_dim, neox=True), np.float64)
  want = np.stack([audit._rope64(x[b], positions[b], 10000.0, rope_dim, neox=True)
                   for b in range(2)])
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  norm = np.stack([audit._rope64(x[b], positions[b], 10000.0, rope_dim) for b in range(2)])
  assert np.abs(norm - want).max() > 0.1
  assert (got[..., rope_dim:] == x.astype(np.float32)[..., rope_dim:]).all()


# --- What the model cannot run. ------------------------------------------------------------


QWEN2 = {"general.architecture": "qwen2", "qwen2.embedding_length": 896,
         "qwen2.attention.head_count": 14, "qwen2.attention.head_count_kv": 2,
         "qwen2.block_count": 24, "qwen2.feed_forward_length": 4864,
         "qwen2.attention.layer_norm_rms_epsilon": 1e-6, "qwen2.rope.freq_base": 1e6,
         "qwen2.context_length": 32768}


def test_from_metadata_of_qwen2_5_0_5b():
  """Qwen2.5-0.5B-Instruct's hyperparameters (its GGUF has no vocab_size key: the token
  list's length)."""
  cfg = llama.LlamaConfig.from_metadata({**QWEN2, "tokenizer.ggml.tokens": ["a"] * 151936})
  assert (cfg.vocab_size, cfg.head_dim, cfg.rope_dim, cfg.num_kv_heads) == (151936, 64, 64, 2)
  assert (cfg.rope_neox, cfg.qkv_bias, cfg.qk_norm) == (True, True, False)
  window = {**QWEN2, "qwen2.vocab_size": 10, "qwen2.attention.sliding_window": 32768}
  assert llama.LlamaConfig.from_metadata(window).context_length == 32768  # covers it all
  off = {**window, "qwen2.attention.sliding_window": 4096,
         "qwen2.attention.sliding_window_pattern": np.zeros(24, bool)}
  assert llama.LlamaConfig.from_metadata(off).rope_neox  # no layer slides


@pytest.mark.parametrize("extra,match", [
    ({"general.architecture": "phi3"}, r"general.architecture='phi3' is not supported; qjax "
     r"runs \('llama', 'qwen2', 'qwen3', 'qwen3moe', 'gpt-oss'\)"),
    ({"qwen2.attention.sliding_window": 4096}, r"qwen2.attention.sliding_window=4096 "
     r"\(shorter than the context 32768\) is not supported"),
    ({"qwen2.attention.sliding_window": 4096,
      "qwen2.attention.sliding_window_pattern": np.asarray([True] + [False] * 23)},
     r"qwen2.attention.sliding_window=4096"),
    ({"qwen2.attention.causal": False}, r"qwen2.attention.causal=False"),
    ({"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0},
     r"qwen2.rope.scaling.type='yarn' is not supported")])
def test_from_metadata_refuses_what_it_cannot_run(extra, match):
  with pytest.raises(ValueError, match=match):
    llama.LlamaConfig.from_metadata({**QWEN2, "qwen2.vocab_size": 10, **extra})


def _gfile(path, **tensors):
  f = gguf_io.load_gguf(path, progress=False)
  f.tensors.update(tensors)
  return f


class _TakeOrder(dict):
  """A tensor dict that records the names popped from it, in order."""

  def __init__(self, *args):
    super().__init__(*args)
    self.taken = []

  def pop(self, name, *default):
    self.taken.append(name)
    return super().pop(name, *default)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_needed_tensors_are_what_params_from_gguf_takes(model, scan_layers):
  """``llama.needed_tensors`` (which generate checks the header against) is the list
  params_from_gguf takes, in its order; a file lacking some is refused naming the first
  of them and how many."""
  a, path, *_ = model
  f = _gfile(path)
  cfg = llama.LlamaConfig.from_metadata(f.metadata)
  needed = llama.needed_tensors(cfg, scan_layers)
  assert len(needed) == len(set(needed)) == len(llama.block_tensors(cfg)) * LAYERS + 2
  f.tensors = _TakeOrder(f.tensors)
  llama.params_from_gguf(f, consume=True, scan_layers=scan_layers)
  optional = {"output.weight", "rope_freqs.weight"}
  assert [n for n in f.tensors.taken if n not in optional] == needed
  assert not f.tensors, sorted(f.tensors)  # everything in the file was taken
  f = _gfile(path)
  for name in (needed[-1], needed[3]):
    del f.tensors[name]
  with pytest.raises(ValueError, match=rf"the {a.name} model needs tensor '{needed[3]}', "
                     r"which the file lacks \(2 missing in all\)"):
    llama.params_from_gguf(f, scan_layers=scan_layers)


def test_params_from_gguf_names_what_the_file_lacks_or_has_too_many(model):
  """A missing bias or q / k norm, a bias this architecture does not add (llama.cpp's
  llama graph would add an attn_output bias; this model has none), and a q / k norm of
  the wrong size are ValueErrors naming the tensor, not a model that runs without it."""
  a, path, *_ = model
  f = _gfile(path)
  missing = "blk.1.attn_k.bias" if a.name == "qwen2" else "blk.1.attn_k_norm.weight"
  del f.tensors[missing]
  with pytest.raises(ValueError, match=rf"the {a.name} model needs tensor '{missing}'"):
    llama.params_from_gguf(f)
  extra = "blk.1.attn_output.bias" if a.name == "qwen2" else "blk.0.attn_q.bias"
  with pytest.raises(ValueError, match=rf"tensor '{extra}' is not supported: qjax's "
                     rf"{a.name} model has no such bias"):
    llama.params_from_gguf(_gfile(path, **{extra: jnp.zeros(8)}))
  wrong = "blk.0.attn_v.bias" if a.name == "qwen2" else "blk.0.attn_q_norm.weight"
  with pytest.raises(ValueError, match=rf"tensor '{wrong}' has shape \(7,\), want"):
    llama.params_from_gguf(_gfile(path, **{wrong: jnp.zeros(7)}), scan_layers=False)


def test_generate_refuses_an_unsupported_architecture(model, tmp_path):
  """A file of another architecture: one line on stderr naming it, exit code 2."""
  a, path, *_ = model
  if a.name != "qwen3":
    pytest.skip("one file is enough")
  reader = gguf.GGUFReader(str(path))
  w = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
  for t in reader.tensors:
    w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  rc, out, err = spm_gguf._cli(["generate", "--model", str(tmp_path / "phi3.gguf"),
                                "--max-new-tokens", "2"])
  assert rc == 2 and not out
  assert err.strip().splitlines()[-1] == (
      "qjax generate: error: general.architecture='phi3' is not supported; qjax runs "
      "('llama', 'qwen2', 'qwen3', 'qwen3moe', 'gpt-oss')")


def test_hf_llama_export_refuses_qwen_params(model, tmp_path):
  """save_hf_llama writes HF Llama (q / k permuted back for rotate_half, no biases, no q /
  k norms); a Qwen model's params are refused before any work, not written wrong."""
  from flax_layers import hf_checkpoint  # pylint: disable=g-import-not-at-top
  a, path, *_ = model
  cfg, params = _load(path, True)
  flags = {"qwen2": "rope_neox=True, qkv_bias=True", "qwen3": "rope_neox=True, qk_norm=True"}
  with pytest.raises(ValueError, match=f"{flags[a.name]}: not a Llama model"):
    hf_checkpoint.save_hf_llama(tmp_path / "out", params, cfg)
  assert not (tmp_path / "out").exists()
