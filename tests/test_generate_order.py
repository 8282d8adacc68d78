"""``qjax generate`` refuses what a GGUF file's header shows before it reads the tensor data.

Reading the tensors of an 8B model takes minutes; a mistake that the metadata or the tensor
names and types already show (``--chat`` on a file without a chat template, a tokenizer or
architecture qjax does not run, RoPE scaling, an empty or over-long prompt, a missing
tensor, a --devices count that does not divide the heads) was reported only after that
load. Each file here is :mod:`test_generate_spm_gguf`'s tiny Llama 2 file with one tensor,
``blk.0.attn_k.weight``, relabelled from Q4_0 to IQ4_NL (the same 18-byte blocks of 32, so
the header stays valid): loading its data fails with its own error
(:func:`test_load_error_marks_a_load`), so a test that gets another error proves that
error came before the load. On the code before, each gave the load's error.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")
pytest.importorskip("tokenizers")

import test_generate_spm_gguf as tiny  # noqa: E402
import test_tokenizer_spm as spm_helpers  # noqa: E402

QT = gguf.GGMLQuantizationType
UNLOADABLE = "blk.0.attn_k.weight"  # Q4_0 in the file; IQ4_NL has no qjax format
LOAD_ERROR = (f"tensor {UNLOADABLE!r} has GGUF type IQ4_NL, which qjax does not support")


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
  """The SentencePiece vocabulary of :mod:`test_generate_spm_gguf`'s file."""
  return spm_helpers._train(tmp_path_factory.mktemp("order_spm"), "llama2_like",
                            **spm_helpers.CONFIGS["llama2_like"])


def _value(v) -> gguf.GGUFValue:
  kind = {str: "STRING", bool: "BOOL", int: "UINT32", float: "FLOAT32"}[type(v)]
  return gguf.GGUFValue(value=v, type=gguf.GGUFValueType[kind])


def _write(path, sp, metadata=None, drop=()) -> str:
  """The tiny Llama 2 file (``test_generate_spm_gguf._write_model``) with UNLOADABLE
  relabelled IQ4_NL, ``metadata`` keys set, and the tensors ``drop`` left out."""
  write_header = gguf.GGUFWriter.write_header_to_file

  def edited(self, *args, **kwargs):
    self.kv_data[0].update({k: _value(v) for k, v in (metadata or {}).items()})
    tensors = self.tensors[0]
    tensors[UNLOADABLE] = dataclasses.replace(tensors[UNLOADABLE], dtype=QT.IQ4_NL)
    for name in drop:
      del tensors[name]
    return write_header(self, *args, **kwargs)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(gguf.GGUFWriter, "write_header_to_file", edited)
    tiny._write_model(path, sp, seed=4)
  return str(path)


def _error(path, *extra: str) -> str:
  """The one error line of ``qjax generate`` on ``path``, which must exit with code 2."""
  rc, out, err = tiny._cli(["generate", "--model", path, "--max-new-tokens", "2",
                            "--temperature", "0", *extra])
  assert rc == 2 and not out, (rc, out, err)
  last = err.strip().splitlines()[-1]
  assert last.startswith("qjax generate: error: "), err
  return last


def test_load_error_marks_a_load(tmp_path, sp):
  """The file's header passes, its data does not load: the error names the tensor, after
  the loading progress bar (which the header checks do not hide)."""
  path = _write(tmp_path / "m.gguf", sp)
  rc, out, err = tiny._cli(["generate", "--model", path, "--max-new-tokens", "2"])
  assert rc == 2 and not out
  assert "loading m.gguf" in err  # tqdm's bar over the tensors
  assert err.strip().splitlines()[-1] == f"qjax generate: error: {path}: {LOAD_ERROR} " \
      f"(supported: {', '.join(tiny.gguf_formats.SUPPORTED_TYPES)}); pass " \
      "dequantize_unsupported=True to load it as float32"


def test_chat_without_a_template_is_refused_before_the_load(tmp_path, sp):
  path = _write(tmp_path / "m.gguf", sp)
  last = _error(path, "--chat")
  assert last == ("qjax generate: error: the GGUF file has no tokenizer.chat_template; "
                  "pass a plain prompt")


def test_empty_prompt_is_refused_before_the_load(tmp_path, sp):
  """Without a BOS to add, an empty prompt has no tokens."""
  path = _write(tmp_path / "m.gguf", sp, {"tokenizer.ggml.add_bos_token": False})
  assert _error(path, "--prompt", "") == (
      "qjax generate: error: the prompt is empty; pass --prompt TEXT")


def test_prompt_beyond_the_context_is_refused_before_the_load(tmp_path, sp):
  path = _write(tmp_path / "m.gguf", sp)
  last = _error(path, "--max-new-tokens", str(tiny.CONTEXT))
  assert last.startswith("qjax generate: error: prompt (") and last.endswith(
      f" tokens) + --max-new-tokens={tiny.CONTEXT} exceeds the context length "
      f"{tiny.CONTEXT}")


@pytest.mark.parametrize("metadata,message", [
    ({"general.architecture": "mamba"}, "general.architecture='mamba' is not supported"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
     "llama.rope.scaling.type='linear' is not supported (only 'none')"),
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model='bert' is not supported"),
], ids=["architecture", "rope-scaling", "tokenizer"])
def test_what_the_metadata_rules_out_is_refused_before_the_load(tmp_path, sp, metadata,
                                                                 message):
  path = _write(tmp_path / "m.gguf", sp, metadata)
  last = _error(path)
  assert message in last and LOAD_ERROR not in last, last


def test_missing_tensor_is_refused_before_the_load(tmp_path, sp):
  path = _write(tmp_path / "m.gguf", sp, drop=["blk.1.ffn_up.weight"])
  assert _error(path) == (f"qjax generate: error: {path}: the llama model needs tensor "
                          "'blk.1.ffn_up.weight', which the file lacks (1 missing in all)")


@pytest.mark.skipif(jax.device_count() < 3, reason="needs 3 devices")
def test_devices_that_do_not_divide_the_heads_are_refused_before_the_load(tmp_path, sp):
  path = _write(tmp_path / "m.gguf", sp)
  last = _error(path, "--devices", "3")
  assert last == (f"qjax generate: error: tensor parallel over 3 devices needs num_heads, "
                  f"num_kv_heads and ffn_size divisible by 3; num_heads={tiny.HEADS}, "
                  f"num_kv_heads={tiny.KV_HEADS}, ffn_size={tiny.FFN} is not; valid device "
                  "counts: [1, 2]")


def test_read_header_is_what_the_load_reads_and_is_parsed_once(tmp_path, sp, monkeypatch):
  """``gguf_io.read_header``: the names, types, shapes and metadata that ``load_gguf``
  gives, with no tensor loaded; ``load_gguf(header)`` reuses its parse (SmolLM2's header
  took about 3 s through gguf.GGUFReader, 0.15 s through gguf_header's walk on a 2-core
  CPU), and so does generate."""
  from qjax._src import gguf_header  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  path = _write(tmp_path / "m.gguf", sp)
  opened = []
  parse = gguf_header.parse_gguf_file

  def counted_parse(p):
    opened.append(p)
    return parse(p)

  def no_load(*args, **kwargs):
    raise AssertionError("read_header loaded a tensor")

  monkeypatch.setattr(gguf_header, "parse_gguf_file", counted_parse)
  with monkeypatch.context() as mp:
    mp.setattr(gguf_io, "_load_tensor", no_load)
    header = gguf_io.read_header(path)
  assert header.tensor_types[UNLOADABLE] == "IQ4_NL" and len(header.tensor_types) == 21
  assert header.tensor_shapes["blk.0.ffn_down.weight"] == (tiny.FFN, tiny.HIDDEN)
  assert header.metadata["llama.context_length"] == tiny.CONTEXT
  f = gguf_io.load_gguf(header, progress=False, dequantize_unsupported=True)
  assert len(opened) == 1
  assert f.tensor_types == header.tensor_types and f.path == path
  assert {k: tuple(v.shape) for k, v in f.tensors.items()} == header.tensor_shapes
  assert f.metadata.keys() == header.metadata.keys()
  assert f.file_tensor_bytes == header.file_tensor_bytes
  assert f.file_tensor_bytes == gguf_io.load_gguf(path, progress=False,
                                                  dequantize_unsupported=True).file_tensor_bytes
  opened.clear()
  assert LOAD_ERROR in _error(path, "--json")
  assert len(opened) == 1
