"""A Hugging Face folder's tokenizer (:mod:`qjax._src.hf_tokenizer`) against ``transformers``.

Two folders are written per module run, as real checkpoints ship them:

* ``llama2``: a SentencePiece BPE model (trained here, byte fallback) converted by
  ``transformers`` itself (``AutoTokenizer.from_pretrained`` on ``tokenizer.model``, then
  ``save_pretrained``): ``tokenizer.json`` with a Metaspace pre-tokenizer and a BOS
  post-processor, as Llama 2 / Mistral folders have.
* ``llama3``: a byte-level BPE trained with ``tokenizers``, special tokens, a BOS
  ``TemplateProcessing``, ``tokenizer_config.json`` with a chat template and
  ``generation_config.json`` with two end ids, as Llama 3 Instruct folders have.

``transformers.AutoTokenizer`` on the same folder is the reference for the ids, the text of
the decoded ids and the rendered chat template.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from qjax._src import hf_tokenizer  # noqa: E402

import test_tokenizer_spm as spm_tests  # noqa: E402  (its training text and strings)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]


def _llama2_folder(tmp_path):
  """transformers' own conversion of a trained SentencePiece BPE model."""
  sp = spm_tests._train(tmp_path, "m", **spm_tests.CONFIGS["llama2_like"])
  slow = tmp_path / "slow"
  slow.mkdir()
  shutil.copy(tmp_path / "m.model", slow / "tokenizer.model")
  (slow / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
      "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}))
  folder = tmp_path / "llama2"
  transformers.AutoTokenizer.from_pretrained(slow).save_pretrained(folder)
  return sp, folder


def _llama3_folder(tmp_path):
  """A byte-level BPE with Llama 3's special tokens, post-processor and configs."""
  import tokenizers as tk  # pylint: disable=g-import-not-at-top
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(vocab_size=600, special_tokens=LLAMA3_SPECIAL,
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                   show_progress=False)
  tok.train_from_iterator(spm_tests._training_lines(random.Random(1234)), trainer)
  bos = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = tk.processors.Sequence([
      tk.processors.ByteLevel(trim_offsets=False),
      tk.processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                       pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                       special_tokens=[("<|begin_of_text|>", bos)])])
  folder = tmp_path / "llama3"
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
      "eos_token": {"__type": "AddedToken", "content": "<|end_of_text|>", "lstrip": False,
                    "normalized": False, "rstrip": False, "single_word": False,
                    "special": True},
      "chat_template": LLAMA3_TEMPLATE}))
  (folder / "generation_config.json").write_text(json.dumps({
      "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}))
  return folder


@pytest.fixture(scope="module", params=["llama2", "llama3"])
def folder(request, tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp(request.param)
  if request.param == "llama2":
    return _llama2_folder(tmp_path)[1]
  return _llama3_folder(tmp_path)


def test_encode_matches_transformers(folder):
  ours = hf_tokenizer.tokenizer_from_hf(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  strings = spm_tests.comparison_strings()
  diffs = [(s, ours.encode(s), ref(s)["input_ids"]) for s in strings
           if ours.encode(s) != ref(s)["input_ids"]]
  assert not diffs, f"{len(diffs)} of {len(strings)} differ, e.g. {diffs[0]}"
  # The BOS is the post-processor's (both folders' tokenizers add it).
  assert ours.add_bos and ours.encode("a")[0] == ref.bos_token_id


def test_decode_matches_transformers(folder):
  ours = hf_tokenizer.tokenizer_from_hf(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  for s in spm_tests.comparison_strings()[:200]:
    ids = ref(s)["input_ids"]
    for skip in (False, True):
      assert ours.decode(ids, skip_special=skip) == ref.decode(ids, skip_special_tokens=skip), s


def test_special_ids_and_stop_ids(tmp_path):
  folder = _llama3_folder(tmp_path)
  ours = hf_tokenizer.tokenizer_from_hf(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  ids = {t: ref.convert_tokens_to_ids(t) for t in LLAMA3_SPECIAL}
  assert ours.bos_id == ids["<|begin_of_text|>"] == ref.bos_token_id
  assert ours.eos_id == ids["<|end_of_text|>"] == ref.eos_token_id
  assert ours.stop_ids == {ids["<|end_of_text|>"], ids["<|eot_id|>"]}
  assert ours.special_ids == set(ids.values())
  # Control tokens written in the text are parsed as their ids, as transformers does.
  text = "<|start_header_id|>user<|end_header_id|>"
  assert ours.encode(text, add_bos=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_chat_template_matches_transformers(tmp_path):
  folder = _llama3_folder(tmp_path)
  ours = hf_tokenizer.tokenizer_from_hf(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  messages = [{"role": "system", "content": "Be brief. "},
              {"role": "user", "content": "The capital of France is?"}]
  for gen in (True, False):
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == (
        ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False))


def test_chat_template_sources(tmp_path):
  folder = _llama3_folder(tmp_path)
  config = json.loads((folder / "tokenizer_config.json").read_text())
  # A list of named templates: "default" is used.
  config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                             {"name": "default", "template": "DEFAULT {{ messages[0].content }}"}]
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  msg = [{"role": "user", "content": "x"}]
  assert hf_tokenizer.tokenizer_from_hf(folder).apply_chat_template(msg) == "DEFAULT x"
  # None in the config: chat_template.jinja beside it.
  del config["chat_template"]
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  (folder / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
  assert hf_tokenizer.tokenizer_from_hf(folder).apply_chat_template(msg) == "JINJA x"
  # Neither: the error names the folder and both places.
  (folder / "chat_template.jinja").unlink()
  with pytest.raises(ValueError, match=r"has no chat_template \(in tokenizer_config.json "
                     r"or chat_template.jinja\); pass a plain prompt"):
    hf_tokenizer.tokenizer_from_hf(folder).apply_chat_template(msg)


def test_no_post_processor_bos(tmp_path):
  """A tokenizer whose post-processor adds nothing (Qwen 2's): no BOS is added, and
  tokenizer_config.json's add_bos_token, where set, decides as in LlamaTokenizer."""
  import tokenizers as tk  # pylint: disable=g-import-not-at-top
  folder = _llama3_folder(tmp_path)
  tok = tk.Tokenizer.from_file(str(folder / "tokenizer.json"))
  tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
  tok.save(str(folder / "tokenizer.json"))
  ours = hf_tokenizer.tokenizer_from_hf(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  assert not ours.add_bos
  assert ours.encode("the fox") == ref("the fox")["input_ids"]
  assert ours.encode("the fox")[0] != ours.bos_id


def test_errors(tmp_path):
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    hf_tokenizer.tokenizer_from_hf(tmp_path)
  (tmp_path / "tokenizer.model").write_bytes(b"x")
  with pytest.raises(ValueError, match="save_pretrained"):
    hf_tokenizer.tokenizer_from_hf(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a tokenizers file"):
    hf_tokenizer.tokenizer_from_hf(tmp_path)

  (tmp_path / "f").mkdir()
  folder = _llama3_folder(tmp_path / "f")
  config_path = folder / "tokenizer_config.json"
  config = json.loads(config_path.read_text())
  config_path.write_text("[1, 2]")
  with pytest.raises(ValueError, match="must hold a JSON object, not list"):
    hf_tokenizer.tokenizer_from_hf(folder)
  config_path.write_text(json.dumps({**config, "bos_token": "<|nope|>"}))
  with pytest.raises(ValueError, match=r"bos_token='<\|nope\|>' is not a token of"):
    hf_tokenizer.tokenizer_from_hf(folder)
  config_path.write_text(json.dumps({**config, "eos_token": 7}))
  with pytest.raises(ValueError, match="eos_token=7 must be a token string"):
    hf_tokenizer.tokenizer_from_hf(folder)
  config_path.write_text(json.dumps(config))
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 10**6]}))
  with pytest.raises(ValueError, match=r"eos_token_id 1000000 is not a token id"):
    hf_tokenizer.tokenizer_from_hf(folder)
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
  assert hf_tokenizer.tokenizer_from_hf(folder).stop_ids >= {3}

  # A folder without BOS / EOS tokens: asking for them names the folder's config.
  config_path.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
  (folder / "generation_config.json").unlink()
  ours = hf_tokenizer.tokenizer_from_hf(folder)
  assert ours.bos_id is None and ours.eos_id is None and not ours.stop_ids
  with pytest.raises(ValueError, match=r"add_bos=True but .* has no bos_token in "
                     r"tokenizer_config.json"):
    ours.encode("a", add_bos=True)


def test_is_hf_folder(tmp_path):
  assert not hf_tokenizer.is_hf_folder(tmp_path)
  (tmp_path / "config.json").write_text("{}")
  assert hf_tokenizer.is_hf_folder(tmp_path)
  assert not hf_tokenizer.is_hf_folder(tmp_path / "config.json")


FEATURE_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{{ bos_token }}Date: {{ strftime_now('%Y') }}\n"
    "{%- for m in messages %}"
    "{%- if loop.index > 3 %}{% break %}{% endif %}"
    "{%- if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{%- set ns.n = ns.n + 1 %}"
    "\n{{ m['role'] }}#{{ ns.n }}: {{ m['content'] | trim }} {{ m | tojson }}"
    " {{ m | tojson(indent=2, sort_keys=true) }}"
    "{%- endfor %}"
    "{%- if tools %}TOOLS{% endif %}"
    "{%- if add_generation_prompt %}\nassistant:{% endif %}")


def test_template_features_render_as_transformers_does(tmp_path):
  """transformers' template environment: tojson without HTML escaping (and its indent /
  sort_keys), {% break %} / {% continue %}, namespace, strftime_now, undefined tools."""
  folder = _llama3_folder(tmp_path)
  config = json.loads((folder / "tokenizer_config.json").read_text())
  config["chat_template"] = FEATURE_TEMPLATE
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  ours = hf_tokenizer.tokenizer_from_hf(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  messages = [{"role": "system", "content": "skip me"},
              {"role": "user", "content": " <b>café</b> & \"quotes\" "},
              {"role": "assistant", "content": "日本語"},
              {"role": "user", "content": "past the break"}]
  for gen in (True, False):
    got = ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert got == ref.apply_chat_template(messages, add_generation_prompt=gen,
                                          tokenize=False)
  assert "<b>café</b>" in got and "past the break" not in got and "skip me" not in got
