"""The tokenizer stored in a GGUF file's metadata, as a Hugging Face ``tokenizers.Tokenizer``.

GGUF keeps a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as its vocabulary
(``tokenizer.ggml.tokens``, byte-level strings such as ``"Ġthe"``), its merges
(``tokenizer.ggml.merges``, ``"Ġ t"``), the token types (3 = control, added as special
tokens) and the name of its pre-tokenizer (``tokenizer.ggml.pre``), whose regexes are the
ones llama.cpp uses (``llama-vocab.cpp``). The chat template is rendered with jinja2.
"""

from __future__ import annotations

from typing import Any, Sequence

_INSTALL_HINT = 'the GGUF tokenizer needs tokenizers and jinja2: pip install "qjax[gguf]"'

# GPT-2's pre-tokenizer regex (also what ByteLevel(use_regex=True) applies).
GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
                 r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
                r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (GPT2_REGEX,),
    "gpt-2": (GPT2_REGEX,),
    # StarCoder-style: every digit alone, then GPT-2's regex (SmolLM, SmolLM2).
    "smollm": (r"\p{N}", GPT2_REGEX),
    "starcoder": (r"\p{N}", GPT2_REGEX),
    "refact": (r"\p{N}", GPT2_REGEX),
    "llama3": (_LLAMA3_REGEX,),
    "llama-bpe": (_LLAMA3_REGEX,),
    "qwen2": (_QWEN2_REGEX,),
}
"""``tokenizer.ggml.pre`` -> the regexes llama.cpp splits text with, applied in order."""

CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
USER_DEFINED = 4


def _import_tokenizers():
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"{_INSTALL_HINT} ({e})") from e
  return tokenizers


class GGUFTokenizer:
  """A GGUF byte-level BPE tokenizer.

  Attributes:
    tokenizer: the ``tokenizers.Tokenizer``.
    bos_id, eos_id: the BOS / EOS token ids (None when the file has none).
    add_bos: whether the model expects BOS at the start (``tokenizer.ggml.add_bos_token``).
    chat_template: the jinja2 chat template, or None.
    special_ids: ids of the control tokens (skipped by ``decode(skip_special=True)``).
    stop_ids: the ids that end a generation: EOS and, where the file names them,
      end-of-turn and end-of-message (``tokenizer.ggml.eot_token_id`` /
      ``eom_token_id``, e.g. Llama 3's ``<|eot_id|>``, which is not its EOS).
  """

  def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_id: int | None,
               add_bos: bool, chat_template: str | None, special_ids: Sequence[int],
               vocab_size: int, stop_ids: Sequence[int] = ()):
    self.tokenizer = tokenizer
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.stop_ids = frozenset(int(i) for i in stop_ids) | (
        frozenset() if eos_id is None else {eos_id})
    self.add_bos = add_bos
    self.chat_template = chat_template
    self.special_ids = frozenset(int(i) for i in special_ids)
    self.vocab_size = vocab_size

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of ``text``; control tokens written in the text (``<|im_start|>``) are parsed.

    Args:
      text: the text.
      add_bos: prepend BOS; None follows the file's ``tokenizer.ggml.add_bos_token``.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos is None:
      add_bos = self.add_bos
    if add_bos:
      if self.bos_id is None:
        raise ValueError("add_bos=True but the GGUF file has no tokenizer.ggml.bos_token_id")
      ids = [self.bos_id, *ids]
    return list(ids)

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """The text of ``ids`` (bytes that are not yet a whole UTF-8 character become U+FFFD)."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

  def apply_chat_template(self, messages: Sequence[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation, rendered with the file's chat template.

    Args:
      messages: ``[{"role": "user", "content": "..."}, ...]``.
      add_generation_prompt: end with the header of the assistant's turn.
    """
    if not self.chat_template:
      raise ValueError("the GGUF file has no tokenizer.chat_template; pass a plain prompt")
    try:
      import jinja2  # pylint: disable=g-import-not-at-top
      from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(f"{_INSTALL_HINT} ({e})") from e

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string(self.chat_template)
    tok = self.tokenizer
    bos = tok.id_to_token(self.bos_id) if self.bos_id is not None else ""
    eos = tok.id_to_token(self.eos_id) if self.eos_id is not None else ""
    return tmpl.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                       bos_token=bos, eos_token=eos)


def tokenizer_from_gguf(metadata: dict[str, Any]) -> GGUFTokenizer:
  """The tokenizer of a GGUF file, from its metadata (``GGUFFile.metadata``).

  Raises:
    ValueError: the file has no tokenizer, or one that is not byte-level BPE ("gpt2"), or
      a pre-tokenizer llama.cpp names that this module does not know.
    ImportError: ``tokenizers`` is missing.
  """
  model = metadata.get("tokenizer.ggml.model")
  if model is None:
    raise ValueError("the GGUF file has no tokenizer (no tokenizer.ggml.model key)")
  if model != "gpt2":
    raise ValueError(f"tokenizer.ggml.model={model!r} is not supported; qjax reads byte-level "
                     "BPE tokenizers ('gpt2') only")
  pre = metadata.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZER_REGEXES:
    raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported; known: "
                     f"{sorted(PRE_TOKENIZER_REGEXES)}")
  tokens = list(metadata["tokenizer.ggml.tokens"])
  merges = metadata.get("tokenizer.ggml.merges") or []
  types = metadata.get("tokenizer.ggml.token_type")
  types = [1] * len(tokens) if types is None else [int(t) for t in types]
  if len(types) != len(tokens):
    raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                     f"{len(tokens)} tokens")

  tk = _import_tokenizers()
  vocab = {t: i for i, t in enumerate(tokens)}
  merge_pairs = []
  for m in merges:
    a, sep, b = m.partition(" ")
    if not sep:
      raise ValueError(f"malformed merge {m!r} in tokenizer.ggml.merges (want 'left right')")
    merge_pairs.append((a, b))
  bpe = tk.models.BPE(vocab, merge_pairs, fuse_unk=False, byte_fallback=False)
  tokenizer = tk.Tokenizer(bpe)
  splits = [tk.pre_tokenizers.Split(tk.Regex(r), behavior="isolated", invert=False)
            for r in PRE_TOKENIZER_REGEXES[pre]]
  tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence(
      [*splits, tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = tk.decoders.ByteLevel()
  special = [i for i, t in enumerate(types) if t == CONTROL]
  tokenizer.add_special_tokens(
      [tk.AddedToken(tokens[i], special=True, normalized=False) for i in special])
  user = [i for i, t in enumerate(types) if t == USER_DEFINED]
  if user:
    tokenizer.add_tokens([tk.AddedToken(tokens[i], normalized=False) for i in user])

  def opt_id(key):
    v = metadata.get(key)
    return None if v is None else int(v)

  return GGUFTokenizer(
      tokenizer, bos_id=opt_id("tokenizer.ggml.bos_token_id"),
      eos_id=opt_id("tokenizer.ggml.eos_token_id"),
      add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
      chat_template=metadata.get("tokenizer.chat_template"), special_ids=special,
      vocab_size=len(tokens),
      stop_ids=[i for i in map(opt_id, ("tokenizer.ggml.eot_token_id",
                                        "tokenizer.ggml.eom_token_id")) if i is not None])
