"""``qjax generate --model FOLDER`` on Hugging Face Llama checkpoint folders.

The folders are test_hf_checkpoint's tiny Llama (two layers, GQA) written as GPTQ (tied
head) and as compressed-tensors (asymmetric, quantized untied head), sharded, with a
``tokenizer.json`` (a word-level vocabulary whose post-processor adds BOS),
``tokenizer_config.json`` (BOS / EOS, a chat template) and ``generation_config.json``.
The greedy tokens must be those of test_hf_checkpoint's independent float64 forward pass in
Hugging Face's conventions (``rotate_half`` RoPE, ``[out, in]`` weights) on the dequantized
weights, each step's top token ahead of the next by a clear margin.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import test_hf_checkpoint as hfc  # noqa: E402  (the tiny Llama's writers and reference)
from conftest import needs_gpu  # noqa: E402
from conftest import run_cli  # noqa: E402

PROMPT = "t3 t17 t42 t5 t88 t60 t9"
NEW_TOKENS = 6
TEMPLATE = ("{{ bos_token }}{% for m in messages %}t4 {{ m['content'] }} t6 {% endfor %}"
            "{% if add_generation_prompt %}t7{% endif %}")


def _word_id(word: str) -> int:
  return {"<unk>": 0, "<s>": 1, "</s>": 2}.get(word) or int(word[1:])


def _add_tokenizer(folder, stop_word: str | None = None) -> None:
  """A word-level ``tokenizer.json`` of the model's vocabulary: ids 0-2 ``<unk> <s> </s>``,
  then ``t3 ... t95``; BOS added by the post-processor; ``stop_word`` an extra end id."""
  import tokenizers as tk  # pylint: disable=g-import-not-at-top
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, hfc.VOCAB)}}
  tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([tk.AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
  tok.post_processor = tk.processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
      "chat_template": TEMPLATE}))
  ends = [2] + ([_word_id(stop_word)] if stop_word else [])
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))


def _greedy_reference(deq: dict, prompt_ids: list[int], tie: bool, steps: int,
                      stop: frozenset[int] = frozenset({2}), **reference) -> list[int] | None:
  """Greedy tokens of the float64 HF-convention forward pass, recomputed per step; None
  where a step's top logit leads the second by less than 1e-3 of the logits' spread (a
  near tie that float32 could break the other way). ``reference``: the model options of
  ``test_hf_checkpoint._hf_reference_logits`` (shapes, biases, q / k norms)."""
  ids = list(prompt_ids)
  out = []
  for _ in range(steps):
    logits = hfc._hf_reference_logits(deq, np.array([ids]), tie, **reference)[0, -1]
    top2 = np.sort(logits)[-2:]
    if top2[1] - top2[0] <= 1e-3 * np.ptp(logits):
      return None
    out.append(int(np.argmax(logits)))
    ids.append(out[-1])
    if out[-1] in stop:
      break
  return out


PROMPT_IDS = [1] + [_word_id(w) for w in PROMPT.split()]
# The chat template's ids: its text starts with the BOS token, so no second BOS.
CHAT_IDS = [1, 4, *PROMPT_IDS[1:], 6, 7]


def _write(tmp_path, case: str):
  """``(folder, deq, tie, greedy tokens of PROMPT, of the chat prompt)`` for the first
  weights' seed from 0 whose references have clear leads at every step and, with an
  untied head, more than one distinct token (a tied head repeats the last token)."""
  tie = hfc.CASES[case][0] == "gptq"
  for seed in range(20):
    folder, _, deq = hfc._write_case(tmp_path / str(seed), np.random.default_rng(seed), case)
    plain = _greedy_reference(deq, PROMPT_IDS, tie, NEW_TOKENS)
    chat = _greedy_reference(deq, CHAT_IDS, tie, NEW_TOKENS)
    if plain and chat and (tie or len(set(plain)) > 1):
      _add_tokenizer(folder)
      return folder, deq, tie, plain, chat
  raise AssertionError(f"no seed of 20 gives {case} clear greedy references")


@pytest.fixture(scope="module",
                params=["gptq_v1_sym", "ct_asym", "awq", "gptq_v2_sym_actorder"])
def checkpoint(request, tmp_path_factory):
  """:func:`_write`'s folder of the case: its weights are read, not changed, by the tests."""
  return _write(tmp_path_factory.mktemp(request.param), request.param)


_cli = run_cli


def _generate(folder, *extra: str) -> tuple[int, str, str]:
  return _cli(["generate", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens",
               str(NEW_TOKENS), "--temperature", "0", "--dtype", "float32", *extra])


def test_greedy_tokens_match_the_float64_reference(checkpoint):
  folder, _, _, want, _ = checkpoint
  rc, out, err = _generate(folder, "--json")
  assert rc == 0, err
  got = json.loads(out)
  assert got["prompt_ids"] == PROMPT_IDS  # one BOS, from the tokenizer's post-processor
  assert got["generated_ids"] == want
  assert got["text"] == " ".join(f"t{i}" for i in want if i > 2)


def test_kernels_in_interpret_mode(checkpoint):
  """The kernels' route (``qjax.kernel_layouts`` at load, then the Pallas programs, here
  interpreted) gives the same tokens."""
  folder, _, _, want, _ = checkpoint
  rc, out, err = _generate(folder, "--json", "--implementation", "interpret")
  assert rc == 0, err
  assert json.loads(out)["generated_ids"] == want
  assert "matmul implementation: pallas" in err


@needs_gpu
@pytest.mark.parametrize("implementation", ["pallas", "auto"])
def test_compiled_kernels(checkpoint, implementation):
  """On the GPU: the projections converted by ``qjax.kernel_layouts`` at load run the
  compiled kernels (float32 x at highest precision), with the reference's tokens."""
  folder, _, _, want, _ = checkpoint
  rc, out, err = _generate(folder, "--json", "--implementation", implementation)
  assert rc == 0, err
  assert json.loads(out)["generated_ids"] == want
  if implementation == "pallas":
    assert "matmul implementation: pallas" in err, err


def test_printed_text_and_summary(checkpoint):
  folder, _, _, want, _ = checkpoint
  rc, out, err = _generate(folder, "--stats")
  assert rc == 0, err
  assert out == " ".join(f"t{i}" for i in want if i > 2) + "\n"
  assert f"generated {len(want)} tokens" in err
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  tensor_bytes = sum(a.nbytes for f in folder.glob("*.safetensors")
                     for a in load_file(str(f)).values())
  assert f"file tensor bytes: {tensor_bytes:,};" in err


def test_generation_config_end_ids_stop(checkpoint):
  """generation_config.json's eos_token_id list ends the generation (Llama 3 Instruct's
  ``<|eot_id|>``): the reference's second token is made an end id, so the generation
  ends at its first occurrence."""
  folder, _, _, want, _ = checkpoint
  try:
    _add_tokenizer(folder, stop_word=f"t{want[1]}")
    rc, out, err = _generate(folder, "--json")
  finally:
    _add_tokenizer(folder)
  assert rc == 0, err
  assert json.loads(out)["generated_ids"] == want[:want.index(want[1]) + 1]


def test_chat_template(checkpoint):
  folder, _, _, _, want = checkpoint
  rc, out, err = _generate(folder, "--json", "--chat")
  assert rc == 0, err
  got = json.loads(out)
  assert got["prompt_ids"] == CHAT_IDS
  assert got["generated_ids"] == want


def test_folder_errors(tmp_path):
  folder = _write(tmp_path, "ct_sym")[0]
  # A folder without config.json is neither a checkpoint nor a GGUF file.
  rc, _, err = _cli(["generate", "--model", str(tmp_path), "--prompt", "t3"])
  assert rc == 2 and "is a folder without config.json" in err, err
  # No tokenizer.json: named before any tensor is read.
  (folder / "tokenizer.json").rename(folder / "moved.json")
  rc, _, err = _generate(folder)
  assert rc == 2 and "has no tokenizer.json" in err, err
  (folder / "moved.json").rename(folder / "tokenizer.json")
  # An unsupported model type names the config key.
  config = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
  rc, _, err = _generate(folder)
  assert rc == 2 and "model_type" in err, err
  (folder / "config.json").write_text(json.dumps(config))
  # A prompt longer than the context (max_position_embeddings = 128).
  rc, _, err = _cli(["generate", "--model", str(folder), "--prompt", "t3 " * 200])
  assert rc == 2 and "exceeds the context length 128" in err, err


def test_checkpoint_layouts_load_as_int4(tmp_path):
  """generate reads GPTQ / AWQ / compressed-tensors projections as their lossless
  Int4Weight (whose XLA path multiplies one row on the packed words instead of
  dequantizing W every call); GPTQ act-order stays as it is."""
  from qjax._src import checkpoint_layouts as cl  # pylint: disable=g-import-not-at-top
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  from qjax._src import int4  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  w4 = hfc._random_int4(rng, 64, 96, 32, symmetric=False)
  layouts = {"gptq": cl.GPTQWeight.from_int4(w4, zero_point_version=2),
             "awq": cl.AWQWeight.from_int4(w4),
             "ct": cl.CompressedTensorsWeight.from_int4(w4)}
  for name, w in layouts.items():
    got = generate._as_int4(w)
    assert isinstance(got, int4.Int4Weight), name
    np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(w.dequantize()))
  act_order = cl.GPTQWeight.from_int4(w4, zero_point_version=2,
                                      g_idx=np.asarray(rng.permutation(np.arange(64) // 32),
                                                       np.int32))
  assert generate._as_int4(act_order) is act_order
  assert generate._as_int4(w4) is w4


def test_act_order_with_some_trivial_g_idx_still_stacks(tmp_path):
  """An act-order checkpoint where layer 0's g_idx happen to be the trivial k // G (whose
  GPTQWeight alone would have an Int4Weight): the layers still stack for the scan, and
  generate runs (the weights, changed, have no reference here)."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  folder, _, _ = hfc._write_case(tmp_path, np.random.default_rng(1), "gptq_v2_sym_actorder")
  _add_tokenizer(folder)
  tensors = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
  layer0 = [k for k in tensors if k.startswith("model.layers.0.") and k.endswith(".g_idx")]
  assert layer0
  for k in layer0:
    tensors[k] = (np.arange(tensors[k].size) // hfc.GROUP).astype(np.int32)
  hfc._rewrite(folder, tensors=tensors)
  rc, out, err = _generate(folder, "--json")
  assert rc == 0, err
  assert len(json.loads(out)["generated_ids"]) >= 1
