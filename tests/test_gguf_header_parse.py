"""qjax's GGUF header parse (``gguf_header.parse_gguf_file``, behind every GGUF loader)
against ``gguf.GGUFReader``, the library's own reader, on the same files.

``gguf_io._open`` replaced ``GGUFReader`` (whose per-element parse took 4.3 s of the 98
MB SmolLM2 file's load on a 2-core CPU): each value and tensor view must be what the
reader gives, decoded as ``GGUFFile.metadata`` documents: every scalar type, strings with
non-ASCII text, arrays of every numeric type and of strings, empty and nested arrays,
tensors of plain and block types, in little- and big-endian files.
"""

from __future__ import annotations

import os
import struct

import ml_dtypes
import numpy as np
import pytest

from qjax._src import generate
from qjax._src import gguf_header
from qjax._src import gguf_io

gguf = pytest.importorskip("gguf")


def reader_metadata(reader) -> dict:
  """The reference: ``gguf.GGUFReader``'s fields decoded as GGUFFile.metadata says (the
  loader's code before this parse, which read every value through the reader)."""
  vt = gguf.GGUFValueType
  out = {}
  for name, field in reader.fields.items():
    types = list(field.types)
    decode = lambda a: bytes(a).decode("utf-8", errors="replace")  # noqa: E731
    if types[0] == vt.STRING:
      value = decode(field.parts[-1])
    elif types[0] != vt.ARRAY:
      value = field.parts[-1].tolist()[0]
    elif len(types) == 1:
      value = []
    elif types[-1] == vt.STRING:
      value = [decode(field.parts[i]) for i in field.data]
    elif len(types) > 2:
      value = field.contents()
    else:
      parts = [field.parts[i] for i in field.data]
      value = np.concatenate(parts).astype(parts[0].dtype.newbyteorder("="))
    out[name] = value
  return out


def assert_same_value(key, want, got):
  assert type(got) is type(want), (key, type(want), type(got))
  if isinstance(want, np.ndarray):
    assert got.dtype == want.dtype and got.shape == want.shape, key
    np.testing.assert_array_equal(got, want, err_msg=key)
    assert got.dtype.isnative, key
  else:
    assert got == want, key


def assert_same_as_reader(path):
  reader = gguf.GGUFReader(str(path), "r")
  opened = gguf_io._open(path)  # pylint: disable=protected-access
  want = reader_metadata(reader)
  assert list(opened.metadata) == list(want)  # same keys, same order
  for key, value in want.items():
    assert_same_value(key, value, opened.metadata[key])
  assert [t.name for t in opened.tensors] == [t.name for t in reader.tensors]
  for ours, theirs in zip(opened.tensors, reader.tensors):
    assert ours.tensor_type == theirs.tensor_type, ours.name
    assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
    assert ours.n_bytes == int(theirs.n_bytes), ours.name
    assert ours.data_offset == int(theirs.data_offset), ours.name
    assert ours.data.dtype == theirs.data.dtype, (ours.name, ours.data.dtype)
    assert ours.data.shape == theirs.data.shape, ours.name
    assert bytes(np.ascontiguousarray(ours.data).view(np.uint8)) == bytes(
        np.ascontiguousarray(theirs.data).view(np.uint8)), ours.name
  return opened


def write_every_kind(path, endian) -> None:
  """A file with every metadata value type and tensors of plain and block types."""
  rng = np.random.default_rng(3)
  w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
  w.add_uint8("t.u8", 200)
  w.add_int8("t.i8", -100)
  w.add_uint16("t.u16", 60000)
  w.add_int16("t.i16", -30000)
  w.add_uint32("t.u32", 4_000_000_000)
  w.add_int32("t.i32", -2_000_000_000)
  w.add_float32("t.f32", 0.1)
  w.add_uint64("t.u64", 2**63 + 5)
  w.add_int64("t.i64", -(2**62))
  w.add_float64("t.f64", 1 / 3)
  w.add_bool("t.true", True)
  w.add_bool("t.false", False)
  w.add_string("t.text", "\u00e9t\u00e9 \u2603 \U0001F600 plain")
  w.add_key_value("t.bad_utf8", b"ab\xffcd", gguf.GGUFValueType.STRING)
  w.add_key_value("t.bad_tokens", [b"\xfe", "ok"], gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.STRING)
  w.add_array("t.tokens", ["a", "", "\u00e9t\u00e9", "<|im_end|>", " Paris"])
  w.add_array("t.ints", [1, -2, 3, 2**30])
  w.add_array("t.floats", [0.5, -1.0, 0.25, 1e-30])
  w.add_array("t.bools", [True, False, True])
  w.add_array("t.nested_ints", [[1, 2, 3], [4, 5]])
  w.add_array("t.nested_strings", [["x", "yz"], ["\u00e9"]])
  w.add_key_value("t.u8s", [0, 7, 255], gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.UINT8)
  w.add_key_value("t.f64s", [0.1, -2.5], gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.FLOAT64)
  w.add_key_value("t.i64s", [-(2**40), 7], gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.INT64)
  for name, dtype in (("f32", np.float32), ("f16", np.float16)):
    w.add_tensor(f"{name}.weight", (rng.standard_normal((3, 32)) * 50).astype(dtype))
  for name, dtype in (("f64", np.float64), ("i8", np.int8), ("i16", np.int16),
                      ("i32", np.int32)):  # 1-D: qjax loads no 2-D tensor of these
    w.add_tensor(f"{name}.bias", (rng.standard_normal(40) * 50).astype(dtype))
  w.add_tensor("norm.weight", rng.standard_normal(48).astype(np.float32))
  bf16 = rng.standard_normal((2, 8)).astype(ml_dtypes.bfloat16)
  w.add_tensor("bf16.weight", bf16.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)
  for qname, rows, cols in (("Q4_0", 3, 64), ("Q8_0", 2, 96), ("Q4_K", 2, 512),
                            ("Q6_K", 1, 256), ("MXFP4", 3, 64)):
    qtype = gguf.GGMLQuantizationType[qname]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block * block_bytes), dtype=np.uint8)
    w.add_tensor(f"{qname.lower()}.weight", raw, raw_dtype=qtype)
  experts = rng.integers(0, 256, (4, 3, 2 * 18), dtype=np.uint8)  # [E, N, K / 32 * 18]
  w.add_tensor("experts.weight", experts, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_every_kind_of_value_and_tensor_as_the_reader_reads_it(tmp_path, endian):
  path = tmp_path / f"{endian}.gguf"
  write_every_kind(path, gguf.GGUFEndian[endian])
  opened = assert_same_as_reader(path)
  meta = opened.metadata
  # and the values themselves, as written
  assert meta["t.u64"] == 2**63 + 5 and meta["t.i8"] == -100 and meta["t.true"] is True
  assert meta["t.f32"] == float(np.float32(0.1)) and meta["t.f64"] == 1 / 3
  assert meta["t.text"] == "\u00e9t\u00e9 \u2603 \U0001F600 plain"
  assert meta["t.tokens"] == ["a", "", "\u00e9t\u00e9", "<|im_end|>", " Paris"]
  np.testing.assert_array_equal(meta["t.ints"], [1, -2, 3, 2**30])
  assert meta["t.bools"].dtype == np.bool_ and meta["t.bools"].tolist() == [True, False, True]
  assert meta["t.nested_ints"] == [1, 2, 3, 4, 5] and meta["t.bad_utf8"] == "ab\ufffdcd"
  assert meta["t.nested_strings"] == ["x", "yz", "\u00e9"]
  f32 = next(t for t in opened.tensors if t.name == "f32.weight")
  assert f32.data.shape == (3, 32) and f32.data.dtype == np.dtype(np.float32).newbyteorder(
      "<" if endian == "LITTLE" else ">")
  # the whole load agrees too (native arrays, the block formats' fields)
  loaded = gguf_io.load_gguf(path, progress=False)
  for name in ("norm.weight", "i16.bias"):  # (jax holds F64 as float32 without x64)
    want = np.asarray(next(t for t in opened.tensors if t.name == name).data)
    got = np.asarray(loaded.tensors[name])
    assert got.dtype == want.dtype.newbyteorder("="), name
    np.testing.assert_array_equal(got, want, err_msg=name)


def test_the_embedded_smollm2_file_as_the_reader_reads_it():
  try:
    path = generate.default_model_path()
  except generate.UsageError as e:
    pytest.skip(f"the embedded SmolLM2 file is not installed ({e})")
  opened = assert_same_as_reader(path)
  assert len(opened.metadata["tokenizer.ggml.tokens"]) == 49152
  assert len(opened.tensors) == 272


def test_nested_arrays_of_different_element_types_are_refused(tmp_path):
  path = tmp_path / "mixed.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_array("t.mixed", [[1, 2], ["a"]])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match=r"'t.mixed' nests arrays of different element types"):
    gguf_io.read_metadata(path)
  gguf_header.check_gguf_file(path)  # well-formed: only qjax's reading of it is refused


def test_parse_without_tensors(tmp_path):
  path = tmp_path / "meta_only.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_uint32("llama.block_count", 2)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  parsed = gguf_header.parse_gguf_file(path)
  assert parsed.tensors == [] and parsed.metadata["llama.block_count"] == 2
  assert parsed.metadata["GGUF.tensor_count"] == 0 and parsed.byte_order == "<"
  assert gguf_io.describe_gguf(path) == [] and os.path.getsize(path) >= parsed.data_start


def test_empty_arrays_as_the_reader_reads_them(tmp_path):
  """GGUFWriter refuses empty arrays; the file is built by hand (GGUF v3, no tensors)."""
  def kv(key, vtype, payload):
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload
  kvs = [kv("t.empty_u32", 9, struct.pack("<IQ", 4, 0)),
         kv("t.empty_strings", 9, struct.pack("<IQ", 8, 0)),
         kv("t.after", 4, struct.pack("<I", 7))]
  path = tmp_path / "empty.gguf"
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
  opened = assert_same_as_reader(path)
  assert opened.metadata["t.empty_u32"] == [] and opened.metadata["t.empty_strings"] == []
  assert opened.metadata["t.after"] == 7
