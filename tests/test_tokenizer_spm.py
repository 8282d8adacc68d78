"""The GGUF "llama" (SentencePiece BPE) tokenizer against the ``sentencepiece`` library.

Each test module run trains tiny SentencePiece BPE models with byte fallback in a temporary
folder, writes their pieces, scores and token types into a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` does (``_create_vocab_sentencepiece``), reads the file back with
qjax's own reader and compares :func:`tokenizer_from_gguf`'s encoding with SentencePiece's
on several hundred strings, many with characters the models never saw (byte fallback).

The models are trained with ``normalization_rule_name="identity"`` and
``remove_extra_whitespaces=False``, as Llama 2's tokenizer is: SentencePiece's default
NFKC normalization and whitespace folding live in the model file, which GGUF does not keep,
and llama.cpp does not apply them, so qjax follows llama.cpp there (a file converted from a
model that normalizes would differ from SentencePiece on such text in llama.cpp too). The
comparison is therefore about the tokenizer itself. Where llama.cpp and SentencePiece do
differ on purpose (control tokens written in the text, which llama.cpp parses and
SentencePiece does not), the tests check llama.cpp's behaviour.
"""

from __future__ import annotations

import random

import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from qjax._src import gguf_io  # noqa: E402
from qjax._src import tokenizer as tokenizer_lib  # noqa: E402

_WORDS = (
    "the quick brown fox jumps over lazy dog language model tokenizer weights quantized "
    "matrix kernel memory bandwidth device generate prompt token decode encode sentence "
    "piece byte fallback merge score vocabulary normal control unknown written reading "
    "running jumped jumping faster fastest international internationalization the the of "
    "and to in is that it for on with as was at by an be this which or from but not are"
).split()
_ACCENTED = ("café naïve résumé über straße señor façade jalapeño São Paulo Zürich "
             "Kraków").split()
_CJK = ["日本語", "東京", "中文", "汉字", "한국어", "서울", "こんにちは", "ありがとう"]
_EMOJI = ["🙂", "👍", "🚀", "🎉"]
_PUNCT = list(".,;:!?-()[]{}'\"/@#$%&*+=<>")

# Characters the training text never has: SentencePiece (and qjax) fall back to bytes.
_UNSEEN = ("ΩжщЖЯ中国人の字ก🌍🧪😀ñçøå∑∂√≈€£¥§©®™ⁿ½ǅ"
           "\u200b\u00a0\u3000\u2581")

# Text written so as to exercise the corners: spaces, empty, newlines, unseen characters.
EDGE_STRINGS = [
    "", " ", "  ", "   ", "\n", "\t", "\n\n", " \n ", "a", " a", "a ", "  a  ", "a  b   c",
    "Hello, world!", "The capital of France is", "  leading two", "trailing two  ",
    "line one\nline two\n\n\tindented\r\nwindows", "tabs\tand\t\tmore\ttabs",
    "digits 1234567890 and 3.14159, 1e-5, 2024-06-01", "naïve café résumé Zürich",
    "日本語のテキスト、東京へようこそ。", "한국어 문장입니다", "emoji 🙂👍🏽🚀 mixed 🎉!",
    "unseen: Ωмега, жизнь, 中国人, ภาษาไทย, 🌍🧪😀", "math ∑∂√≈ money €£¥ legal §©®™",
    "zero\u200bwidth and no\u00a0break and ideographic\u3000space", "a literal ▁ piece ▁▁",
    "<0x41> is text, not a byte token", "x" * 200, " " * 17, "ab" * 50 + " " + "ba" * 50,
    "The the THE tHe", "don't can't won't it's", "code: def f(x):\n    return x**2  # sq\n",
]


def _training_lines(rng: random.Random, n: int = 400) -> list[str]:
  pools = [_WORDS] * 6 + [_ACCENTED, _CJK, _EMOJI]
  lines = []
  for _ in range(n):
    parts = []
    for _ in range(rng.randint(3, 14)):
      r = rng.random()
      if r < 0.08:
        parts.append(str(rng.randint(0, 99999)))
      elif r < 0.15:
        parts.append(rng.choice(_PUNCT))
      else:
        parts.append(rng.choice(rng.choice(pools)))
    seps = [rng.choice([" ", " ", " ", " ", "  ", "\t", "   "]) for _ in parts]
    line = "".join(p + s for p, s in zip(parts, seps)).rstrip()
    lines.append(line.capitalize() if rng.random() < 0.3 else line)
  return lines


def _random_strings(rng: random.Random, n: int) -> list[str]:
  pools = [_WORDS, _WORDS, _ACCENTED, _CJK, _EMOJI, _PUNCT, list(_UNSEEN),
           [" ", "  ", "\n", "\t", " \n", "\r\n"]]
  out = []
  for _ in range(n):
    parts = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 12))]
    if rng.random() < 0.3:
      parts.append(str(rng.randint(0, 10**6)))
    out.append("".join(p + rng.choice(["", " ", " ", "  "]) for p in parts))
  return out


# Two models: one configured like Llama 2's tokenizer (space prefix, whitespace-only pieces,
# digits split), one with no space prefix (``tokenizer.ggml.add_space_prefix = false``).
CONFIGS = {
    "llama2_like": dict(add_dummy_prefix=True, allow_whitespace_only_pieces=True,
                        split_digits=True),
    "no_space_prefix": dict(add_dummy_prefix=False),
}


def _train(tmp_path, name: str, **options):
  rng = random.Random(1234)
  (tmp_path / "train.txt").write_text("\n".join(_training_lines(rng)), encoding="utf-8")
  prefix = str(tmp_path / name)
  spm.SentencePieceTrainer.train(
      input=str(tmp_path / "train.txt"), model_prefix=prefix, model_type="bpe",
      vocab_size=700, byte_fallback=True, normalization_rule_name="identity",
      remove_extra_whitespaces=False, character_coverage=1.0, hard_vocab_limit=False,
      minloglevel=2, num_threads=1, **options)
  return spm.SentencePieceProcessor(model_file=prefix + ".model")


def _gguf_types(sp) -> list[int]:
  """llama.cpp's token type of each piece, as ``_create_vocab_sentencepiece`` sets them."""
  types = []
  for i in range(sp.get_piece_size()):
    if sp.is_unknown(i):
      types.append(tokenizer_lib.UNKNOWN)
    elif sp.is_control(i):
      types.append(tokenizer_lib.CONTROL)
    elif sp.is_unused(i):
      types.append(tokenizer_lib.UNUSED)
    elif sp.is_byte(i):
      types.append(tokenizer_lib.BYTE)
    else:
      types.append(tokenizer_lib.NORMAL)
  return types


def add_vocab(w, sp, *, add_space_prefix: bool, add_bos: bool = True,
              add_eos: bool = False) -> None:
  """Writes ``sp``'s vocabulary into the GGUFWriter ``w`` as llama.cpp's converter does
  (``_set_vocab_sentencepiece``): pieces, scores, types, special ids and flags."""
  w.add_tokenizer_model("llama")
  w.add_tokenizer_pre("default")
  w.add_token_list([sp.id_to_piece(i).encode("utf-8") for i in range(sp.get_piece_size())])
  w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
  w.add_token_types(_gguf_types(sp))
  w.add_bos_token_id(sp.bos_id())
  w.add_eos_token_id(sp.eos_id())
  w.add_unk_token_id(sp.unk_id())
  w.add_add_bos_token(add_bos)
  w.add_add_eos_token(add_eos)
  w.add_add_space_prefix(add_space_prefix)


def _write_gguf(path, sp, *, add_space_prefix: bool, add_bos: bool = True,
                add_eos: bool = False):
  w = gguf.GGUFWriter(str(path), "llama")
  add_vocab(w, sp, add_space_prefix=add_space_prefix, add_bos=add_bos, add_eos=add_eos)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
  """``(sentencepiece processor, GGUF metadata read back by qjax, qjax tokenizer)``."""
  name = request.param
  tmp_path = tmp_path_factory.mktemp(name)
  sp = _train(tmp_path, name, **CONFIGS[name])
  path = tmp_path / f"{name}.gguf"
  _write_gguf(path, sp, add_space_prefix=CONFIGS[name]["add_dummy_prefix"])
  metadata = gguf_io.read_metadata(path)
  return sp, metadata, tokenizer_lib.tokenizer_from_gguf(metadata)


def comparison_strings() -> list[str]:
  rng = random.Random(99)
  return (EDGE_STRINGS + _training_lines(random.Random(1234))[:60]
          + _random_strings(rng, 405))


def test_the_models_exercise_byte_fallback(model):
  sp, metadata, tok = model
  assert tok.model == "llama"
  assert metadata["tokenizer.ggml.model"] == "llama"
  assert sum(sp.is_byte(i) for i in range(sp.get_piece_size())) == 256
  # Unseen characters are encoded as bytes by SentencePiece itself (so the comparison
  # below covers byte fallback), and the vocabulary has merged pieces.
  assert all(sp.is_byte(i) for i in sp.encode("Ω", add_bos=False)[-2:])
  assert any(len(sp.id_to_piece(i)) > 3 for i in range(sp.get_piece_size()))


def test_encode_matches_sentencepiece(model):
  sp, _, tok = model
  strings = comparison_strings()
  assert len(strings) == 500
  bad = []
  for s in strings:
    want = sp.encode(s)
    got = tok.encode(s, add_bos=False)
    if got != want:
      bad.append((s, want, got))
  assert not bad, (f"{len(bad)} of {len(strings)} strings differ; first: {bad[0][0]!r}\n"
                   f"sentencepiece {[sp.id_to_piece(i) for i in bad[0][1]]}\n"
                   f"qjax          {[sp.id_to_piece(i) for i in bad[0][2]]}")


def test_decode_matches_sentencepiece(model):
  sp, _, tok = model
  for s in comparison_strings():
    ids = sp.encode(s)
    want = sp.decode(ids)
    assert tok.decode(ids) == want, s
    assert tok.decode([sp.bos_id(), *ids, sp.eos_id()], skip_special=True) == want, s
    if want == s:
      assert tok.decode(tok.encode(s), skip_special=True) == s


def test_round_trip_without_bos(model):
  sp, _, tok = model
  n = 0
  for s in comparison_strings():
    if sp.decode(sp.encode(s)) == s:
      assert tok.decode(tok.encode(s, add_bos=False)) == s
      n += 1
  assert n > 400  # identity normalization: almost every string round-trips


def test_bytes_of_one_character_split_over_tokens(model):
  sp, _, tok = model
  for ch in "Ωж🌍😀€ก":
    ids = tok.encode(ch, add_bos=False)
    assert ids == sp.encode(ch)
    byte_ids = [i for i in ids if sp.is_byte(i)]
    assert len(byte_ids) == len(ch.encode("utf-8"))
    assert tok.decode(ids) == sp.decode(ids) == ch
    # An unfinished character decodes to U+FFFD, as generate's streaming expects.
    assert tok.decode(ids[:-1]).endswith("\ufffd")


def test_special_tokens(model):
  sp, metadata, tok = model
  assert tok.bos_id == sp.bos_id() and tok.eos_id == sp.eos_id()
  assert tok.add_bos is True and tok.add_eos is False  # from the metadata
  assert tok.stop_ids == {sp.eos_id()}
  assert tok.special_ids == {sp.bos_id(), sp.eos_id(), sp.unk_id()}
  text = "Hello, world!"
  assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)]
  assert tok.encode(text) == sp.encode(text, add_bos=True)
  assert tok.encode(text, add_bos=False, add_eos=True) == sp.encode(text, add_eos=True)
  assert tok.encode("") == [sp.bos_id()]
  assert tok.encode("", add_bos=False) == []
  ids = tok.encode(text, add_eos=True)
  assert tok.decode(ids, skip_special=True) == text
  # Kept control tokens are written out; the space prefix is then not the leading space.
  space = " " if metadata["tokenizer.ggml.add_space_prefix"] else ""
  assert tok.decode(ids) == f"<s>{space}{text}</s>"


def test_control_tokens_in_text_follow_llama_cpp(model):
  """llama.cpp (parse_special) turns ``<s>`` / ``</s>`` written in the text into the control
  token, and gives the text after a control token the space prefix again; SentencePiece
  reads them as plain characters."""
  sp, metadata, tok = model
  got = tok.encode("</s>Hi there<s>again", add_bos=False)
  assert got == [sp.eos_id(), *sp.encode("Hi there"), sp.bos_id(), *sp.encode("again")]
  assert sp.encode("</s>") != [sp.eos_id()]  # what the library does instead


def test_add_bos_and_add_eos_follow_the_metadata(model, tmp_path):
  sp, metadata, _ = model
  tok = tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.ggml.add_bos_token": False,
                                           "tokenizer.ggml.add_eos_token": True})
  assert tok.encode("a b") == sp.encode("a b", add_eos=True)
  no_bos = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.add_bos_token"}
  assert tokenizer_lib.tokenizer_from_gguf(no_bos).add_bos is False
  no_prefix_key = {k: v for k, v in metadata.items()
                   if k != "tokenizer.ggml.add_space_prefix"}  # llama.cpp's default: true
  tok = tokenizer_lib.tokenizer_from_gguf(no_prefix_key)
  ids = tok.encode("hello world", add_bos=False)
  assert sp.id_to_piece(ids[0]).startswith("\u2581")
  assert ids == sp.encode(" hello world" if not metadata["tokenizer.ggml.add_space_prefix"]
                          else "hello world")
  assert tok.decode(ids) == "hello world"


def test_chat_template_absent_and_generate_prompt(model):
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  sp, _, tok = model
  assert tok.chat_template is None
  with pytest.raises(ValueError, match="no tokenizer.chat_template"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert generate.prompt_token_ids(tok, "The capital", chat=False) == (
      sp.encode("The capital", add_bos=True))
  # A file that asks for EOS after encoded text: a prompt to continue still ends without it.
  eos_tok = tokenizer_lib.tokenizer_from_gguf({**model[1], "tokenizer.ggml.add_eos_token": True})
  assert eos_tok.encode("The capital")[-1] == sp.eos_id()
  assert generate.prompt_token_ids(eos_tok, "The capital", chat=False) == (
      sp.encode("The capital", add_bos=True))


def test_chat_template_that_starts_with_bos(model):
  """A Llama 2 style template writes ``<s>`` itself: generate then adds no second BOS, and
  the text after it gets the space prefix (llama.cpp parses the control token, then
  tokenizes the rest as a new fragment)."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  sp, metadata, _ = model
  template = ("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]"
              "{% endfor %}")
  tok = tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.chat_template": template})
  ids = generate.prompt_token_ids(tok, "Hi there", chat=True)
  assert ids == [sp.bos_id(), *sp.encode("[INST] Hi there [/INST]")]
  assert tok.decode(ids, skip_special=True) == "[INST] Hi there [/INST]"


def test_streamed_decoding_as_generate_does(model):
  """generate prints ``decode(generated)`` growing token by token, holding back text that
  ends in U+FFFD (an unfinished character); the printed text must come out whole."""
  sp, _, tok = model
  for s in ["Hello 🌍 world", "Ωж€ and more", "  two spaces, then 😀😀", "ก\nnew line"]:
    ids, printed = sp.encode(s), ""
    for k in range(1, len(ids) + 1):
      out = tok.decode(ids[:k], skip_special=True)
      if out.endswith("\ufffd"):
        continue
      assert out.startswith(printed), (s, k)
      printed = out
    assert printed == sp.decode(ids) == s


def test_merges_follow_the_scores():
  # "abc" can be made as "ab" + "c" or "a" + "bc"; "bc" scores higher than "ab", so from
  # "a b c" SentencePiece merges "b c" first, then "a bc".
  tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "abc", "\u2581"]
  scores = [0, 0, 0, -10, -11, -12, -2, -1, -3, -9]
  types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1]
  merges = tokenizer_lib.sentencepiece_merges(tokens, scores, types)
  assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
  meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.unknown_token_id": 0}
  tok = tokenizer_lib.tokenizer_from_gguf(meta)
  assert tok.encode("abc") == [8]
  assert tok.encode("abcab") == [8, 6]
  # No byte pieces in this vocabulary: an unknown character becomes <unk>, runs fused.
  assert tok.encode("xyab") == [0, 6]
  assert tok.special_ids == {0, 1, 2}


def test_errors(model):
  _, metadata, tok = model
  n = len(metadata["tokenizer.ggml.tokens"])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([n])
  with pytest.raises(ValueError, match=r"tokenizer.ggml.scores.*one score per token"):
    tokenizer_lib.tokenizer_from_gguf(
        {k: v for k, v in metadata.items() if k != "tokenizer.ggml.scores"})
  with pytest.raises(ValueError, match=rf"tokenizer.ggml.scores has {n - 1} entries for {n} "):
    tokenizer_lib.tokenizer_from_gguf(
        {**metadata, "tokenizer.ggml.scores": metadata["tokenizer.ggml.scores"][:-1]})
  scores = list(metadata["tokenizer.ggml.scores"])
  scores[5] = float("nan")
  with pytest.raises(ValueError, match=r"tokenizer.ggml.scores has non-finite values"):
    tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.ggml.scores": scores})
  with pytest.raises(ValueError, match=r"tokenizer.ggml.token_type, one type per token"):
    tokenizer_lib.tokenizer_from_gguf(
        {k: v for k, v in metadata.items() if k != "tokenizer.ggml.token_type"})
  with pytest.raises(ValueError,
                     match=rf"tokenizer.ggml.token_type has {n + 1} entries for {n} tokens"):
    tokenizer_lib.tokenizer_from_gguf(
        {**metadata, "tokenizer.ggml.token_type": [*metadata["tokenizer.ggml.token_type"], 1]})
  with pytest.warns(UserWarning, match=rf"tokenizer.ggml.bos_token_id={n} is outside"):
    no_bos = tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.ggml.bos_token_id": n})
  assert no_bos.bos_id is None  # ignored, as llama.cpp does
  with pytest.raises(ValueError, match="add_bos=True but the GGUF file has no"):
    no_bos.encode("a")
  with pytest.raises(ValueError, match=r"tokenizer.ggml.model='bert'.*'gpt2'.*'llama'"):
    tokenizer_lib.tokenizer_from_gguf({**metadata, "tokenizer.ggml.model": "bert"})
  with pytest.raises(ValueError, match="add_eos=True but the GGUF file has no"):
    tokenizer_lib.tokenizer_from_gguf(
        {k: v for k, v in metadata.items() if k != "tokenizer.ggml.eos_token_id"}).encode(
            "a", add_eos=True)
