"""The tokenizer stored in a GGUF file's metadata, as a Hugging Face ``tokenizers.Tokenizer``.

Two of llama.cpp's tokenizer models are supported (``tokenizer.ggml.model``):

* ``"gpt2"``, byte-level BPE (SmolLM, Llama 3, Qwen 2): its vocabulary
  (``tokenizer.ggml.tokens``, byte-level strings such as ``"Ġthe"``), its merges
  (``tokenizer.ggml.merges``, ``"Ġ t"``), the token types (3 = control, added as special
  tokens) and the name of its pre-tokenizer (``tokenizer.ggml.pre``), whose regexes are the
  ones llama.cpp uses (``llama-vocab.cpp``).
* ``"llama"``, SentencePiece BPE with byte fallback (Llama 2, TinyLlama, Mistral 7B v0.1):
  pieces such as ``"▁the"`` and ``"<0x0A>"`` (``tokenizer.ggml.tokens``), one score per
  piece (``tokenizer.ggml.scores``) and the token types (``tokenizer.ggml.token_type``:
  1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte). Like llama.cpp's
  ``llm_tokenizer_spm`` it repeatedly merges the adjacent pair whose concatenation is the
  highest-scoring normal piece, which is a BPE whose merges are ranked by those scores
  (derived here; ``tokenizer.ggml.merges``, if present, is ignored, as llama.cpp does).
  Spaces become ``"▁"``, ``"▁"`` is prepended when ``tokenizer.ggml.add_space_prefix``
  (default true), characters outside the vocabulary become their UTF-8 byte pieces, and
  decoding undoes all three.

The chat template is rendered with jinja2.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import warnings
from typing import Any, Sequence

_INSTALL_HINT = 'the GGUF tokenizer needs tokenizers and jinja2: pip install "qjax[gguf]"'


@dataclasses.dataclass(frozen=True)
class TokenizerSource:
  """Where a tokenizer was read from, for error messages: ``f"{name} has no {key}"``.

  Attributes:
    name: the file or folder, e.g. "the GGUF file".
    bos_key, eos_key, chat_key: where that file keeps the BOS id, the EOS id and the chat
      template.
  """
  name: str = "the GGUF file"
  bos_key: str = "tokenizer.ggml.bos_token_id"
  eos_key: str = "tokenizer.ggml.eos_token_id"
  chat_key: str = "tokenizer.chat_template"


# GPT-2's pre-tokenizer regex (also what ByteLevel(use_regex=True) applies).
GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
                 r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# o200k (GPT-4o, GPT-OSS: tokenizer.ggml.pre "gpt-4o"): the regex of its tokenizer.json,
# which llama-vocab.cpp (LLAMA_VOCAB_PRE_TYPE_GPT4O) quotes as the original and runs in an
# std::regex form without the Unicode case classes ("[^a-z]" / "[^A-Z]" among letters);
# the two split alike except at non-ASCII capitals and combining marks, where this one is
# what the model's own tokenizer does.
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

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
    "gpt-4o": (_GPT4O_REGEX,),
}
"""``tokenizer.ggml.pre`` -> the regexes llama.cpp splits text with, applied in order."""

# llama.cpp's token types (LLAMA_TOKEN_TYPE_*, as ``tokenizer.ggml.token_type`` stores them).
NORMAL = 1
UNKNOWN = 2
CONTROL = 3
USER_DEFINED = 4
UNUSED = 5
BYTE = 6

SUPPORTED_MODELS = ("gpt2", "llama")
"""The ``tokenizer.ggml.model`` values :func:`tokenizer_from_gguf` reads."""

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space


def import_tokenizers():
  """The ``tokenizers`` package, or an ImportError that says how to install it."""
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"{_INSTALL_HINT} ({e})") from e
  return tokenizers


class GGUFTokenizer:
  """A GGUF tokenizer: byte-level BPE (``"gpt2"``) or SentencePiece BPE (``"llama"``); also
  a Hugging Face folder's ``tokenizer.json`` (``"hf"``, :mod:`qjax._src.hf_tokenizer`).

  Attributes:
    tokenizer: the ``tokenizers.Tokenizer``.
    model: ``tokenizer.ggml.model``, ``"gpt2"`` or ``"llama"``; ``"hf"`` for a folder's.
    source: where it was read from (:class:`TokenizerSource`), named by the errors.
    bos_id, eos_id: the BOS / EOS token ids (None when the file has none).
    add_bos: whether the model expects BOS at the start (``tokenizer.ggml.add_bos_token``).
    add_eos: whether ``encode`` appends EOS (``tokenizer.ggml.add_eos_token``, default false).
    chat_template: the jinja2 chat template, or None.
    special_ids: ids of the control tokens, and of the unknown token of a ``"llama"``
      vocabulary (skipped by ``decode(skip_special=True)``).
    stop_ids: the ids that end a generation: EOS and, where the file names them,
      end-of-turn and end-of-message (``tokenizer.ggml.eot_token_id`` /
      ``eom_token_id``, e.g. Llama 3's ``<|eot_id|>``, which is not its EOS).
  """

  def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_id: int | None,
               add_bos: bool, chat_template: str | None, special_ids: Sequence[int],
               vocab_size: int, stop_ids: Sequence[int] = (), add_eos: bool = False,
               model: str = "gpt2", source: TokenizerSource = TokenizerSource()):
    self.tokenizer = tokenizer
    self.source = source
    self.model = model
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.stop_ids = frozenset(int(i) for i in stop_ids) | (
        frozenset() if eos_id is None else {eos_id})
    self.add_bos = add_bos
    self.add_eos = add_eos
    self.chat_template = chat_template
    self.special_ids = frozenset(int(i) for i in special_ids)
    self.vocab_size = vocab_size

  def encode(self, text: str, add_bos: bool | None = None,
             add_eos: bool | None = None) -> list[int]:
    """Token ids of ``text``; control tokens written in the text (``<|im_start|>``) are parsed.

    Args:
      text: the text.
      add_bos: prepend BOS; None follows the file's ``tokenizer.ggml.add_bos_token``.
      add_eos: append EOS; None follows the file's ``tokenizer.ggml.add_eos_token``.

    Returns:
      The token ids, ``list[int]`` of length ``[n_tokens]``.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos is None:
      add_bos = self.add_bos
    if add_bos:
      if self.bos_id is None:
        raise ValueError(f"add_bos=True but {self.source.name} has no {self.source.bos_key}")
      ids = [self.bos_id, *ids]
    if add_eos is None:
      add_eos = self.add_eos
    if add_eos:
      if self.eos_id is None:
        raise ValueError(f"add_eos=True but {self.source.name} has no {self.source.eos_key}")
      ids = [*ids, self.eos_id]
    return list(ids)

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """The text of ``ids`` (bytes that are not yet a whole UTF-8 character become U+FFFD).

    Args:
      ids: token ids, ``Sequence[int]`` of length ``[n_tokens]``.
      skip_special: leave out the tokens of ``special_ids`` (BOS, EOS, ...).

    Returns:
      The text. For ``"llama"`` the space prefix ``encode`` added is removed again (one
      leading space), as SentencePiece and llama.cpp do. Byte tokens that make whole UTF-8
      characters decode to them; a run of byte tokens that is not valid UTF-8 becomes one
      U+FFFD per token (``tokenizers``' ByteFallback), where SentencePiece would keep the
      valid bytes among them, and the unknown token decodes as its piece (``"<unk>"``,
      SentencePiece writes ``" ⁇ "``) unless ``skip_special``.
    """
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
      raise ValueError(f"{self.source.name} has no {self.source.chat_key}; pass a plain prompt")
    try:
      import jinja2  # pylint: disable=g-import-not-at-top
      from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(f"{_INSTALL_HINT} ({e})") from e

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      # As transformers' chat templates: json.dumps, not jinja2's HTML-escaping filter.
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    # The environment transformers renders chat templates in (Llama 3.x's reads the date
    # with strftime_now; tool templates use tojson and loop controls).
    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    tmpl = env.from_string(self.chat_template)
    tok = self.tokenizer
    bos = tok.id_to_token(self.bos_id) if self.bos_id is not None else ""
    eos = tok.id_to_token(self.eos_id) if self.eos_id is not None else ""
    return tmpl.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                       bos_token=bos, eos_token=eos)


def _opt_id(metadata: dict[str, Any], key: str, n_tokens: int) -> int | None:
  """The token id stored under ``key``, or None where absent or outside the vocabulary
  (with a warning; llama.cpp likewise ignores such an id)."""
  v = metadata.get(key)
  if v is None:
    return None
  if not 0 <= int(v) < n_tokens:
    warnings.warn(f"GGUF tokenizer: {key}={int(v)} is outside the vocabulary of {n_tokens} "
                  "tokens; ignored", stacklevel=3)
    return None
  return int(v)


def _per_token(metadata: dict[str, Any], key: str, n_tokens: int, kind: type,
               model: str) -> list | None:
  """``metadata[key]`` as one ``kind`` per token, None when absent; a ValueError naming the
  key when its length is not the number of tokens or a value is not a finite number."""
  values = metadata.get(key)
  if values is None:
    return None
  try:
    values = [kind(v) for v in values]
  except (TypeError, ValueError) as e:
    raise ValueError(f"{key} must hold one number per token ({e})") from e
  if len(values) != n_tokens:
    raise ValueError(f"{key} has {len(values)} entries for {n_tokens} tokens "
                     f"(tokenizer.ggml.tokens); tokenizer.ggml.model={model!r} needs one per "
                     "token")
  if kind is float:
    bad = [i for i, v in enumerate(values) if v != v or v in (float("inf"), float("-inf"))]
    if bad:
      raise ValueError(f"{key} has non-finite values (e.g. token {bad[0]}: "
                       f"{values[bad[0]]}); the scores rank the merges and must be finite")
  return values


def _byte_level_bpe(tk, metadata: dict[str, Any], tokens: list[str]) -> Any:
  """The ``tokenizers.Tokenizer`` of a ``"gpt2"`` vocabulary (no added tokens yet)."""
  pre = metadata.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZER_REGEXES:
    raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported; known: "
                     f"{sorted(PRE_TOKENIZER_REGEXES)}")
  merges = metadata.get("tokenizer.ggml.merges") or []
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
  return tokenizer


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float],
                         types: Sequence[int]) -> list[tuple[str, str]]:
  """The BPE merges that reproduce SentencePiece's (and llama.cpp's) score-driven merging.

  SentencePiece BPE merges, over and over, the adjacent pair whose concatenation is the
  normal piece with the highest score (the leftmost such pair on a tie). Every split of a
  normal piece into two pieces of the vocabulary is therefore a merge, ranked by the score
  of the piece it makes (higher first; then by the piece's id, then by the left part's
  length). Control, byte, unknown, user-defined and unused pieces are never made by merging.

  Args:
    tokens: the pieces, ``[n_tokens]`` (``tokenizer.ggml.tokens``).
    scores: their scores, ``[n_tokens]`` (``tokenizer.ggml.scores``).
    types: their llama.cpp token types, ``[n_tokens]`` (``tokenizer.ggml.token_type``).

  Returns:
    ``(left, right)`` pairs, highest priority first.

  >>> sentencepiece_merges(["a", "b", "ab", "abb"], [0, 0, -1, -2], [1, 1, 1, 1])
  [('a', 'b'), ('ab', 'b')]
  """
  vocab = {t: i for i, t in enumerate(tokens)}
  ranked = []
  for i, (piece, score, ty) in enumerate(zip(tokens, scores, types)):
    if ty != NORMAL or len(piece) < 2:
      continue
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in vocab and right in vocab:
        ranked.append((-score, i, cut, left, right))
  ranked.sort(key=lambda r: r[:3])
  return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(tk, metadata: dict[str, Any], tokens: list[str],
                       types: list[int]) -> Any:
  """The ``tokenizers.Tokenizer`` of a ``"llama"`` vocabulary (no added tokens yet)."""
  scores = _per_token(metadata, "tokenizer.ggml.scores", len(tokens), float, "llama")
  if scores is None:
    raise ValueError("tokenizer.ggml.model='llama' (SentencePiece BPE) needs "
                     "tokenizer.ggml.scores, one score per token, to rank its merges; the GGUF "
                     "file has none")
  unk_id = _opt_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
  if unk_id is None and UNKNOWN in types:
    unk_id = types.index(UNKNOWN)
  vocab = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t, i)  # a duplicated piece (rare) encodes as its first id
  bpe = tk.models.BPE(vocab, sentencepiece_merges(tokens, scores, types),
                      unk_token=None if unk_id is None else tokens[unk_id], fuse_unk=True,
                      byte_fallback=True)
  tokenizer = tk.Tokenizer(bpe)
  add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
  normalizers = [tk.normalizers.Replace(" ", SPIECE_SPACE)]
  if add_space_prefix:  # an empty text stays empty: Prepend leaves it alone
    normalizers.insert(0, tk.normalizers.Prepend(SPIECE_SPACE))
  tokenizer.normalizer = tk.normalizers.Sequence(normalizers)
  decoders = [tk.decoders.Replace(SPIECE_SPACE, " "), tk.decoders.ByteFallback(),
              tk.decoders.Fuse()]
  if add_space_prefix:  # after Fuse: one leading space of the whole text, not of each token
    decoders.append(tk.decoders.Strip(content=" ", left=1, right=0))
  tokenizer.decoder = tk.decoders.Sequence(decoders)
  return tokenizer


def tokenizer_from_gguf(metadata: dict[str, Any]) -> GGUFTokenizer:
  """The tokenizer of a GGUF file, from its metadata (``GGUFFile.metadata``).

  Args:
    metadata: the file's key-value metadata (:func:`qjax._src.gguf_io.read_metadata`).

  Returns:
    A :class:`GGUFTokenizer` for ``tokenizer.ggml.model`` ``"gpt2"`` (byte-level BPE) or
    ``"llama"`` (SentencePiece BPE with byte fallback).

  Raises:
    ValueError: the file has no tokenizer, or a model other than those of
      ``SUPPORTED_MODELS``, a pre-tokenizer llama.cpp names that this module does not know,
      or per-token arrays (``tokenizer.ggml.token_type``, ``tokenizer.ggml.scores``) missing
      where needed or of the wrong length.
    ImportError: ``tokenizers`` is missing.
  """
  model = metadata.get("tokenizer.ggml.model")
  if model is None:
    raise ValueError("the GGUF file has no tokenizer (no tokenizer.ggml.model key)")
  if model not in SUPPORTED_MODELS:
    raise ValueError(f"tokenizer.ggml.model={model!r} is not supported; qjax reads "
                     "byte-level BPE ('gpt2') and SentencePiece BPE ('llama') tokenizers")
  tokens = metadata.get("tokenizer.ggml.tokens")
  if tokens is None or not len(tokens):
    raise ValueError(f"the GGUF file's {model!r} tokenizer has no tokenizer.ggml.tokens")
  tokens = list(tokens)
  types = _per_token(metadata, "tokenizer.ggml.token_type", len(tokens), int, model)
  if types is None:
    if model == "llama":
      raise ValueError("tokenizer.ggml.model='llama' (SentencePiece BPE) needs "
                       "tokenizer.ggml.token_type, one type per token (6 = byte, 3 = control); "
                       "the GGUF file has none")
    types = [NORMAL] * len(tokens)

  tk = import_tokenizers()
  if model == "gpt2":
    tokenizer = _byte_level_bpe(tk, metadata, tokens)
    special = [i for i, t in enumerate(types) if t == CONTROL]
  else:
    tokenizer = _sentencepiece_bpe(tk, metadata, tokens, types)
    special = [i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)]
  tokenizer.add_special_tokens(
      [tk.AddedToken(tokens[i], special=True, normalized=False) for i in special])
  user = [i for i, t in enumerate(types) if t == USER_DEFINED]
  if user:
    tokenizer.add_tokens([tk.AddedToken(tokens[i], normalized=False) for i in user])

  def opt_id(key):
    return _opt_id(metadata, key, len(tokens))

  return GGUFTokenizer(
      tokenizer, bos_id=opt_id("tokenizer.ggml.bos_token_id"),
      eos_id=opt_id("tokenizer.ggml.eos_token_id"),
      add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
      add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
      chat_template=metadata.get("tokenizer.chat_template"), special_ids=special,
      vocab_size=len(tokens), model=model,
      stop_ids=[i for i in map(opt_id, ("tokenizer.ggml.eot_token_id",
                                        "tokenizer.ggml.eom_token_id")) if i is not None])
