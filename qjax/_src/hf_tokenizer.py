"""The tokenizer of a Hugging Face checkpoint folder, as the :class:`GGUFTokenizer` that
``qjax generate`` uses for GGUF files.

What ``transformers.AutoTokenizer.from_pretrained(folder)`` reads, without transformers:

* ``tokenizer.json``: the ``tokenizers.Tokenizer`` itself (model, normalizer,
  pre-tokenizer, decoder, added tokens).
* ``tokenizer_config.json``: ``bos_token`` / ``eos_token`` (a string or an ``AddedToken``
  dict), ``add_bos_token`` / ``add_eos_token`` where given (``LlamaTokenizerFast``'s;
  otherwise whether the tokenizer's post-processor adds them), and ``chat_template`` (a
  string, or a list of named templates of which ``"default"`` is used), else the
  ``chat_template.jinja`` file beside it.
* ``generation_config.json``: ``eos_token_id`` (an id or a list, e.g. Llama 3 Instruct's
  ``<|eot_id|>`` besides its EOS), the ids that end a generation.

Only the slow SentencePiece files (``tokenizer.model`` without ``tokenizer.json``) are not
read: convert them with ``transformers`` (``AutoTokenizer.from_pretrained(folder)
.save_pretrained(folder)`` writes ``tokenizer.json``).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from qjax._src import tokenizer as tokenizer_lib


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
  """Whether ``path`` is a folder with a Hugging Face ``config.json``."""
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  """A JSON object file, ``{}`` when absent; ValueError naming the file when it is not one."""
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, ValueError) as e:
    raise ValueError(f"{path}: not a JSON file ({e})") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path}: must hold a JSON object, not {type(data).__name__}")
  return data


def _token_text(value: Any, key: str, path: pathlib.Path) -> str | None:
  """The text of a special-token entry: a string or ``{"content": ...}``; None if null."""
  if value is None:
    return None
  if isinstance(value, dict):
    value = value.get("content")
  if not isinstance(value, str):
    raise ValueError(f"{path}: {key}={value!r} must be a token string or an AddedToken "
                     "object with a 'content' string")
  return value


def _chat_template(config: dict[str, Any], folder: pathlib.Path) -> str | None:
  """``chat_template`` of tokenizer_config.json (a string, or the ``"default"`` of a list of
  ``{"name", "template"}``), else the text of ``chat_template.jinja``, else None."""
  template = config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  if isinstance(template, str) and template:
    return template
  jinja = folder / "chat_template.jinja"
  return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


def _stop_ids(generation: dict[str, Any], path: pathlib.Path, vocab_size: int) -> list[int]:
  """``eos_token_id`` of generation_config.json as a list of ids."""
  ids = generation.get("eos_token_id")
  if ids is None:
    return []
  ids = ids if isinstance(ids, list) else [ids]
  bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
         or not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"{path}: eos_token_id {bad[0]!r} is not a token id of the vocabulary "
                     f"[0, {vocab_size})")
  return ids


def tokenizer_from_hf(folder: str | os.PathLike[str]) -> tokenizer_lib.GGUFTokenizer:
  """The tokenizer of a Hugging Face checkpoint folder.

  Args:
    folder: a folder with ``tokenizer.json`` (and usually ``tokenizer_config.json`` and
      ``generation_config.json``).

  Returns:
    A :class:`qjax._src.tokenizer.GGUFTokenizer` whose ``encode(text)`` gives the ids of
    ``transformers``' ``tokenizer(text)["input_ids"]`` (BOS / EOS as the tokenizer adds
    them), whose ``stop_ids`` are EOS and generation_config.json's ``eos_token_id``, and
    whose ``chat_template`` is the folder's.

  Raises:
    ValueError: naming the file that is missing or malformed, or the token that is not in
      the vocabulary.
    ImportError: ``tokenizers`` is missing.
  """
  folder = pathlib.Path(folder)
  path = folder / "tokenizer.json"
  if not path.is_file():
    hint = (" (it has the slow tokenizer.model: write tokenizer.json with transformers' "
            "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
            if (folder / "tokenizer.model").is_file() else "")
    raise ValueError(f"{folder} has no tokenizer.json, which qjax reads the tokenizer "
                     f"from{hint}")
  tk = tokenizer_lib.import_tokenizers()
  try:
    tok = tk.Tokenizer.from_file(str(path))
  except Exception as e:  # pylint: disable=broad-except  # tokenizers raises Exception
    raise ValueError(f"{path}: not a tokenizers file ({e})") from None
  config_path = folder / "tokenizer_config.json"
  config = _read_json(config_path)
  generation_path = folder / "generation_config.json"
  generation = _read_json(generation_path)
  vocab_size = tok.get_vocab_size(with_added_tokens=True)

  def token_id(key: str) -> int | None:
    text = _token_text(config.get(key), key, config_path)
    if text is None:
      return None
    i = tok.token_to_id(text)
    if i is None:
      raise ValueError(f"{config_path}: {key}={text!r} is not a token of {path}")
    return i

  bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
  # What the post-processor adds around a text (tokenizer.json's TemplateProcessing).
  probe = tok.encode("a", add_special_tokens=True).ids
  plain = tok.encode("a", add_special_tokens=False).ids
  added_bos = bos_id is not None and probe[:1] == [bos_id] and plain[:1] != [bos_id]
  added_eos = eos_id is not None and probe[-1:] == [eos_id] and plain[-1:] != [eos_id]
  special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
  return tokenizer_lib.GGUFTokenizer(
      tok, bos_id=bos_id, eos_id=eos_id,
      add_bos=bool(config.get("add_bos_token", added_bos)),
      add_eos=bool(config.get("add_eos_token", added_eos)),
      chat_template=_chat_template(config, folder), special_ids=special,
      vocab_size=vocab_size, stop_ids=_stop_ids(generation, generation_path, vocab_size),
      model="hf", source=tokenizer_lib.TokenizerSource(
          name=str(folder), bos_key=f"bos_token in {config_path.name}",
          eos_key=f"eos_token in {config_path.name}",
          chat_key=f"chat_template (in {config_path.name} or chat_template.jinja)"))
