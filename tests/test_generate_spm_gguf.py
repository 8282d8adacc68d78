"""``qjax generate`` end to end on a tiny Llama-2-style GGUF file with a SentencePiece vocabulary.

The file is written in ``tmp_path`` with ``gguf.GGUFWriter`` the way llama.cpp's
``convert_hf_to_gguf.py`` (``LlamaModel``, ``_set_vocab_sentencepiece``) and
``llama-quantize`` leave a Llama 2 model: architecture ``llama``, two layers, grouped-query
attention, an untied ``output.weight``, no chat template, and the vocabulary of a tiny
SentencePiece BPE model trained by :mod:`test_tokenizer_spm`'s helper. The random weights
are stored in the types such files hold: Q4_K and Q6_K as Q4_K_M gives them (``attn_v``
and ``ffn_down`` are Q6_K in layer 0 and Q4_K in layer 1, llama.cpp's ``use_more_bits``
for two layers), Q4_0, Q8_0, a Q6_K head, F32 and F16 norms.

It proves that ``qjax generate --temperature 0`` on that file

* tokenizes the prompt as the ``sentencepiece`` library does, with exactly one BOS;
* generates the greedy tokens of an independent float64 numpy forward pass
  (:func:`test_generation_audit._reference_logits`: RMSNorm, llama.cpp's adjacent-pair
  RoPE, GQA, SwiGLU) on the weights dequantized by gguf-py's own ``gguf.quants.dequantize``,
  and the model's logits equal that reference's;
* prints the SentencePiece decode of those tokens;
* refuses ``--chat`` for a file without a chat template, with one line on stderr, code 2;
* runs a file whose layers store a tensor in different types, as every Q4_K_M file does
  (before: ``params_from_gguf`` stacked the layers for ``lax.scan`` and failed with a pytree
  structure error; now generate runs such a file's layers unrolled).
"""

from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")
pytest.importorskip("tokenizers")

import test_generation_audit as audit  # noqa: E402
import test_tokenizer_spm as spm_helpers  # noqa: E402
from conftest import run_cli  # noqa: E402
from qjax._src import check  # noqa: E402
from qjax._src import gguf_formats  # noqa: E402
from qjax._src import tokenizer as tokenizer_lib  # noqa: E402

QT = gguf.GGMLQuantizationType

# Llama 2's layout at toy size: K of every matrix is a multiple of 256 (the K-quant block).
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS
# RoPE base: Code Llama's (a Llama 2 model), not the default 10000, so that reading
# llama.rope.freq_base counts in the comparison.
ROPE_BASE, RMS_EPS, CONTEXT = 1e6, 1e-5, 4096
PROMPT = "The quick brown fox jumps over the lazy dog in Zürich 🌍"
NEW_TOKENS = 8

# GGUF tensor name (``{i}``: the layer) -> its type in layer 0 and layer 1.
TENSOR_TYPES = {
    "token_embd.weight": ("Q4_K",),
    "blk.{i}.attn_norm.weight": ("F32", "F32"),
    "blk.{i}.attn_q.weight": ("Q4_K", "Q4_K"),
    "blk.{i}.attn_k.weight": ("Q4_0", "Q4_0"),
    "blk.{i}.attn_v.weight": ("Q6_K", "Q4_K"),
    "blk.{i}.attn_output.weight": ("Q8_0", "Q8_0"),
    "blk.{i}.ffn_norm.weight": ("F16", "F16"),
    "blk.{i}.ffn_gate.weight": ("Q4_0", "Q4_0"),
    "blk.{i}.ffn_up.weight": ("Q4_K", "Q4_K"),
    "blk.{i}.ffn_down.weight": ("Q6_K", "Q4_K"),
    "output_norm.weight": ("F32",),
    "output.weight": ("Q6_K",),
}


def _shape(name: str, vocab: int) -> tuple[int, ...]:
  """numpy shape ``[N, K]`` (rows of length K, as GGUF stores them) or ``[n]`` for a norm."""
  kv = KV_HEADS * HEAD_DIM
  part = name.split(".")[-2]
  return {"token_embd": (vocab, HIDDEN), "output": (vocab, HIDDEN), "attn_q": (HIDDEN, HIDDEN),
          "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN)}.get(part, (HIDDEN,))


def _quantized(rng, ggml_type: str, n: int, k: int, std: float) -> np.ndarray:
  """Random GGUF bytes ``[N, row bytes]`` whose weights have about ``std``. gguf-py
  quantizes Q4_0 and Q8_0 from floats; it has no K-quant quantizer, so Q4_K / Q6_K are
  random blocks (:func:`qjax._src.check.gguf_blocks`) with their f16 scales rescaled."""
  if ggml_type in ("Q4_0", "Q8_0"):
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * std,
                                QT[ggml_type])
  raw = check.gguf_blocks(rng, ggml_type, k, n)
  cls = gguf_formats.BLOCK_FORMATS[ggml_type]
  factor = std / gguf.quants.dequantize(raw, QT[ggml_type]).std()
  blocks = raw.reshape(n, k // cls.block_size, cls.type_size)
  for f in cls.block_fields:
    if f.dtype == np.float16:  # d (and dmin): the weights scale with them
      scale = blocks[:, :, f.offset:f.offset + 2].copy().view(np.float16) * factor
      blocks[:, :, f.offset:f.offset + 2] = scale.astype(np.float16).view(np.uint8)
  return blocks.reshape(n, -1)


def _write_model(path, sp, seed: int) -> None:
  """The Llama-2-style GGUF file of ``sp``'s vocabulary and random weights."""
  rng = np.random.default_rng(seed)
  vocab = sp.get_piece_size()
  token_types = spm_helpers._gguf_types(sp)
  w = gguf.GGUFWriter(str(path), "llama")
  # convert_hf_to_gguf.py's TextModel / LlamaModel.set_gguf_parameters.
  w.add_name("tiny-llama-2")
  w.add_context_length(CONTEXT)
  w.add_embedding_length(HIDDEN)
  w.add_block_count(LAYERS)
  w.add_feed_forward_length(FFN)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV_HEADS)
  w.add_rope_freq_base(ROPE_BASE)
  w.add_layer_norm_rms_eps(RMS_EPS)
  w.add_vocab_size(vocab)
  w.add_rope_dimension_count(HEAD_DIM)
  w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  # _set_vocab_sentencepiece and gguf.SpecialVocab: no chat template (a base model).
  spm_helpers.add_vocab(w, sp, add_space_prefix=True, add_bos=True, add_eos=False)
  for pattern, kinds in TENSOR_TYPES.items():
    for i, kind in enumerate(kinds):
      name = pattern.format(i=i)
      shape = _shape(name, vocab)
      if len(shape) == 1:  # norms around 1
        data = (1 + 0.2 * rng.standard_normal(shape)).astype(
            np.float16 if kind == "F16" else np.float32)
        w.add_tensor(name, data)
        continue
      n, k = shape
      # Embedding rows of unit size; projections that keep the activations of order 1, the
      # blocks' outputs larger so that the context, not only the last token, sets the next
      # one; a head that spreads the logits (std about 4) so greedy picks are far from ties.
      gain = {"token_embd": np.sqrt(k), "attn_output": 3.0, "ffn_down": 3.0, "output": 5.0}
      std = gain.get(name.split(".")[-2], 1.0) / np.sqrt(k)
      raw = _quantized(rng, kind, n, k, std)
      if name == "output.weight":
        # Byte, control and unknown pieces get zero logits, below the top of ~440 normal
        # pieces, so the model writes words (an invalid byte run would decode to U+FFFD,
        # where tokenizers and sentencepiece differ as documented) and never stops early.
        raw[[i for i, t in enumerate(token_types) if t != tokenizer_lib.NORMAL]] = 0
      w.add_tensor(name, raw, raw_dtype=QT[kind])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


# GGUF block tensor -> the key of test_generation_audit._reference_logits' weights.
_REFERENCE_NAMES = {"attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
                    "attn_output": "o", "ffn_norm": "ffn_norm", "ffn_gate": "gate",
                    "ffn_up": "up", "ffn_down": "down"}

# The reference's config, from the constants the file was written with (not read by qjax).
REFERENCE_CFG = types.SimpleNamespace(num_layers=LAYERS, num_heads=HEADS,
                                      num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      rope_base=ROPE_BASE, rope_dim=HEAD_DIM, rms_eps=RMS_EPS)


def _float64_weights(path) -> dict[str, list[np.ndarray]]:
  """The file's weights as ``_reference_logits`` takes them (matrices ``[K, N]``), read by
  ``gguf.GGUFReader`` and dequantized by ``gguf.quants.dequantize``, not by qjax."""
  f64: dict[str, list[np.ndarray]] = {}
  for t in gguf.GGUFReader(str(path)).tensors:
    a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
    a = a.reshape(tuple(reversed([int(d) for d in t.shape]))).T  # [K, N] or [n]
    parts = t.name.split(".")
    key = (_REFERENCE_NAMES[parts[2]] if parts[0] == "blk" else
           {"token_embd": "embed", "output": "lm_head", "output_norm": "final_norm"}[parts[0]])
    if parts[0] == "blk":
      f64.setdefault(key, [None] * LAYERS)[int(parts[1])] = a
    else:
      f64[key] = [a]
  return f64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """``(path, sentencepiece processor, float64 weights)`` of the tiny Llama 2 file.

  The vocabulary sentencepiece trains can differ between its versions (0.2.0 and 0.2.3
  gave different ones), so the weights' seed is the first from 4 whose greedy reference
  is one the tests can compare (:func:`_greedy_reference`); with 0.2.3 that is seed 4."""
  tmp_path = tmp_path_factory.mktemp("llama2_spm")
  sp = spm_helpers._train(tmp_path, "llama2_like", **spm_helpers.CONFIGS["llama2_like"])
  for seed in range(4, 20):
    path = tmp_path / f"tiny-llama-2-{seed}.Q4_K_M.gguf"
    _write_model(path, sp, seed=seed)
    f64 = _float64_weights(path)
    if _greedy_reference(sp, f64) is not None:
      return path, sp, f64
    path.unlink()
  pytest.fail("no seed in 4..19 gives a greedy reference with clear top-1 leads and a space")


def _greedy_reference(sp, f64) -> tuple[list[int], list[int], np.ndarray] | None:
  """``(prompt ids, greedy ids, logits [T, vocab])`` of the float64 reference: the prompt
  tokenized by sentencepiece itself, then NEW_TOKENS argmax steps; None where a step's
  top token leads the next by 0.05 or less, or the continuation has no space.

  qjax runs float32 (its dequantized weights are the same numbers): its logits are within
  about 1e-5 of these, so a greedy pick is only compared where the reference's top token
  leads by far more than that (at seed 4 with sentencepiece 0.2.3 the smallest lead is
  0.19). The space is for the printed-text test ("jumps# not brown bandwidth서 brown
  bandwidth" there), where random models often repeat one token.
  """
  prompt_ids = sp.encode(PROMPT, add_bos=True)
  ids = list(prompt_ids)
  for _ in range(NEW_TOKENS):
    logits = audit._reference_logits(REFERENCE_CFG, f64, ids)[-1]
    top2 = np.sort(logits)[-2:]
    if top2[1] - top2[0] <= 0.05:
      return None
    ids.append(int(np.argmax(logits)))
  if " " not in sp.decode(ids[len(prompt_ids):]):
    return None
  return prompt_ids, ids[len(prompt_ids):], audit._reference_logits(REFERENCE_CFG, f64, ids)


@pytest.fixture(scope="module")
def reference(model):
  """:func:`_greedy_reference` of the model's file."""
  _, sp, f64 = model
  return _greedy_reference(sp, f64)


_cli = run_cli


def _generate(path, *extra: str) -> tuple[int, str, str]:
  """``qjax generate`` greedy on ``path``; ``--dtype float32`` (the CPU's default) so that a
  GPU, whose default is bfloat16, is compared with the float64 reference at float32 too."""
  return _cli(["generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens",
               str(NEW_TOKENS), "--temperature", "0", "--dtype", "float32", *extra])


def test_the_file_is_llama_2_like(model):
  """The file holds what the tests claim: SentencePiece vocabulary with byte pieces, GQA,
  an untied head, per-layer types that differ, and the prompt has byte-fallback tokens."""
  path, sp, _ = model
  reader = gguf.GGUFReader(str(path))
  kinds = {t.name: t.tensor_type.name for t in reader.tensors}
  assert kinds["blk.0.attn_v.weight"] == "Q6_K" and kinds["blk.1.attn_v.weight"] == "Q4_K"
  assert {"Q4_0", "Q4_K", "Q6_K", "Q8_0", "F16", "F32"} == set(kinds.values())
  assert "output.weight" in kinds and "tokenizer.chat_template" not in reader.fields
  assert any(sp.is_byte(i) for i in sp.encode(PROMPT))  # "🌍" is not in the vocabulary


def test_greedy_generation_matches_the_float64_reference(model, reference):
  """``--json``: the prompt is sentencepiece's encoding with one BOS, and the greedy tokens
  are the reference's."""
  path, sp, _ = model
  prompt_ids, want, _ = reference
  rc, out, err = _generate(path, "--json")
  assert rc == 0, err
  got = json.loads(out)
  assert got["prompt_ids"] == prompt_ids
  assert got["prompt_ids"].count(sp.bos_id()) == 1 and got["prompt_ids"][0] == sp.bos_id()
  assert got["generated_ids"] == want
  assert got["text"] == sp.decode(want)


def test_printed_text_is_the_sentencepiece_decode(model, reference):
  """The streamed text is the generated tokens' SentencePiece decode: "▁" back to spaces
  between words, and no space before the first word (the space prefix is undone once)."""
  path, sp, _ = model
  _, want, _ = reference
  rc, out, err = _generate(path)
  assert rc == 0, err
  text = sp.decode(want)
  assert " " in text and not text.startswith(" ") and "\u2581" not in text
  assert out == text + "\n"
  assert f"generated {NEW_TOKENS} tokens" in err


def test_model_logits_match_the_float64_reference(model, reference):
  """qjax's own loader and model on the same file: the logits of the whole sequence (prompt
  and generated tokens) equal the reference's, so RoPE's base, GQA, the untied head and
  every block type are read as llama.cpp reads them, not only the argmax."""
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  path, _, _ = model
  prompt_ids, generated, want = reference
  gfile = gguf_io.load_gguf(path, progress=False)
  assert not llama.stackable_layers(gfile.tensor_types)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, scan_layers=False)
  params = llama.params_from_gguf(gfile, scan_layers=False)
  assert "lm_head" in params["params"]
  with jax.default_matmul_precision("highest"):
    got = llama.forward(params, np.asarray([prompt_ids + generated], np.int32), cfg=cfg)[0]
  audit._close(got, want)


def test_stacking_layers_of_different_types_names_the_tensor(model):
  """Before: ``params_from_gguf`` (and so ``qjax generate``) failed on every Q4_K_M file with
  a pytree structure error from ``jax.tree.map``; generate now runs such a file unrolled."""
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  path, _, _ = model
  gfile = gguf_io.load_gguf(path, progress=False)
  with pytest.raises(ValueError, match=r"blk\.\*\.attn_v\.weight is stored as GGUFQ4_K, "
                     r"GGUFQ6_K in different layers.*scan_layers=False"):
    llama.params_from_gguf(gfile, scan_layers=True)


def test_chat_without_a_chat_template_is_refused(model):
  """``--chat`` needs the file's chat template; a Llama 2 base model has none: one error
  line on stderr (after the loading progress bar), exit code 2, nothing on stdout."""
  path, _, _ = model
  rc, out, err = _generate(path, "--chat")
  assert rc == 2 and not out
  assert err.strip().splitlines()[-1] == (
      "qjax generate: error: the GGUF file has no tokenizer.chat_template; pass a plain prompt")
