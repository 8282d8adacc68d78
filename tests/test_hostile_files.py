"""Readers that survive hostile files: one ValueError each, in bounded time and memory.

GGUF files are built byte by byte here (so every field can lie), safetensors files by
editing a valid file's JSON header. Each reader must raise ValueError with a message
that names the problem; no other exception type may escape. A seeded mutation fuzz run
of a few hundred files per reader closes the suite (``qjax fuzz-readers`` runs the long
form).
"""

from __future__ import annotations

import json
import re
import struct
import time

import numpy as np
import pytest

import qjax
from qjax._src import gguf_io
from qjax._src import reader_fuzz
from qjax._src import safetensors_io

gguf = pytest.importorskip("gguf")

# ------------------------------------------------------------------- a raw GGUF writer


def _str(s: bytes | str) -> bytes:
  s = s.encode() if isinstance(s, str) else s
  return struct.pack("<Q", len(s)) + s


def _kv_u32(key: str, v: int) -> bytes:
  return _str(key) + struct.pack("<II", 4, v)


def _tensor_info(name: str, dims, type_id: int, offset: int) -> bytes:
  return (_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d)
                                                                for d in dims)
          + struct.pack("<IQ", type_id, offset))


F32, Q4_0 = 0, 2


def raw_gguf(kvs=(), tensors=(), data=b"", *, n_kv=None, n_tensors=None, version=3,
             magic=b"GGUF", alignment=32) -> bytes:
  """A GGUF file from raw parts; counts default to the parts given."""
  head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                             len(kvs) if n_kv is None else n_kv)
  body = head + b"".join(kvs) + b"".join(tensors)
  body += b"\0" * (-len(body) % alignment)
  return body + data


def valid_gguf() -> bytes:
  norm = np.arange(8, dtype=np.float32).tobytes()
  return raw_gguf([_kv_u32("llama.block_count", 1)],
                  [_tensor_info("norm.weight", [8], F32, 0),
                   _tensor_info("w", [32, 2], Q4_0, 32)],
                  norm + bytes(36))


GGUF_READERS = {
    "load_gguf": lambda p: gguf_io.load_gguf(p, progress=False),
    "describe_gguf": qjax.describe_gguf,
    "read_metadata": gguf_io.read_metadata,
}


def _expect_value_error(fn, path, match: str, budget_s: float = 5.0):
  t0 = time.perf_counter()
  with pytest.raises(ValueError, match=match) as e:
    fn(str(path))
  assert time.perf_counter() - t0 < budget_s, "a bad file must fail fast"
  assert str(path) in str(e.value), "the error must name the file"
  assert "\n" not in str(e.value), "one line"


def test_valid_raw_gguf_loads(tmp_path):
  path = tmp_path / "ok.gguf"
  path.write_bytes(valid_gguf())
  f = gguf_io.load_gguf(path, progress=False)
  np.testing.assert_array_equal(np.asarray(f.tensors["norm.weight"]), np.arange(8))
  assert f.tensors["w"].shape == (32, 2) and f.metadata["llama.block_count"] == 1


HOSTILE_GGUF = {
    "empty": (b"", "shorter than the 24-byte"),
    "wrong_magic": (b"GGML" + valid_gguf()[4:], "magic"),
    "version_1": (raw_gguf(version=1), "version 1"),
    "version_huge": (raw_gguf(version=0x7FFF_FFFF), "version"),
    "tensor_count_2^63": (raw_gguf(n_tensors=2**63), "tensors cannot fit"),
    "kv_count_2^64-1": (raw_gguf(n_kv=2**64 - 1), "key-value pairs cannot fit"),
    "key_length_1TB": (raw_gguf([struct.pack("<Q", 2**40) + b"k"], n_kv=1) + bytes(64),
                       "claims 1099511627776 bytes"),
    "string_value_1TB": (raw_gguf([_str("k") + struct.pack("<IQ", 8, 2**40)]),
                         "string value of 'k'"),
    # gguf's own reader loops once per claimed element here (its reads past the end
    # return empty arrays): 2**40 iterations without the header check.
    "array_2^40_elements": (raw_gguf([_str("k") + struct.pack("<IIQ", 9, 0, 2**40)]),
                            "claims 1099511627776 UINT8 elements"),
    "array_of_strings_2^60": (raw_gguf([_str("k") + struct.pack("<IIQ", 9, 8, 2**60)]),
                              "STRING elements"),
    "unknown_value_type": (raw_gguf([_str("k") + struct.pack("<IB", 77, 0)]),
                           "unknown value type 77"),
    "deep_nesting": (raw_gguf([_str("k") + struct.pack("<I", 9)
                               + struct.pack("<IQ", 9, 1) * 20 + struct.pack("<IQ", 0, 0)]),
                     "nests arrays deeper"),
    "duplicate_key": (raw_gguf([_kv_u32("a", 1), _kv_u32("a", 2)]), "appears twice"),
    "bad_alignment": (raw_gguf([_kv_u32("general.alignment", 24)]), "power of two"),
    "non_utf8_key": (raw_gguf([_str(b"\xff\xfe") + struct.pack("<II", 4, 1)]), "not UTF-8"),
    "zero_dims": (raw_gguf([], [_tensor_info("t", [], F32, 0)]), "has 0 dims"),
    "five_dims": (raw_gguf([], [_tensor_info("t", [1] * 5, F32, 0)], bytes(64)), "5 dims"),
    "zero_dim": (raw_gguf([], [_tensor_info("t", [8, 0], F32, 0)], bytes(64)),
                 "every dim must be positive"),
    "absurd_dims": (raw_gguf([], [_tensor_info("t", [2**32, 2**32], F32, 0)], bytes(64)),
                    "elements"),
    "dims_claim_terabytes": (raw_gguf([], [_tensor_info("t", [2**20, 2**20], F32, 0)],
                                      bytes(64)), "past the end"),
    "unknown_ggml_type": (raw_gguf([], [_tensor_info("t", [8], 99, 0)], bytes(64)),
                          "unknown GGML type 99"),
    "ragged_block": (raw_gguf([], [_tensor_info("t", [33, 2], Q4_0, 0)], bytes(128)),
                     "multiple of the block size 32"),
    "offset_past_end": (raw_gguf([], [_tensor_info("t", [8], F32, 2**40)], bytes(32)),
                        "past the end"),
    "offset_unaligned": (raw_gguf([], [_tensor_info("t", [8], F32, 3)], bytes(64)),
                         "not a multiple of the alignment"),
    "overlapping_tensors": (raw_gguf([], [_tensor_info("a", [16], F32, 0),
                                          _tensor_info("b", [16], F32, 32)], bytes(128)),
                            "overlap"),
    "duplicate_tensor_name": (raw_gguf([], [_tensor_info("a", [8], F32, 0),
                                            _tensor_info("a", [8], F32, 32)], bytes(64)),
                              "appears twice"),
    "truncated_data": (valid_gguf()[:-10], "past the end"),
    "truncated_header": (valid_gguf()[:60], "truncated or corrupt|cannot fit"),
}


@pytest.mark.parametrize("reader", sorted(GGUF_READERS))
@pytest.mark.parametrize("case", sorted(HOSTILE_GGUF))
def test_hostile_gguf(tmp_path, case, reader):
  data, match = HOSTILE_GGUF[case]
  path = tmp_path / f"{case}.gguf"
  path.write_bytes(data)
  _expect_value_error(GGUF_READERS[reader], path, match)


def test_every_truncation_of_a_gguf_file(tmp_path):
  data = valid_gguf()
  path = tmp_path / "t.gguf"
  for n in range(len(data)):
    path.write_bytes(data[:n])
    with pytest.raises(ValueError):
      gguf_io.load_gguf(path, progress=False)


# ---------------------------------------------------------------------- safetensors


def _saved(tmp_path) -> bytes:
  path = tmp_path / "ok.safetensors"
  w = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
  qjax.save(path, {"k": qjax.quantize(w, group_size=32), "b": np.ones(8, np.float32)})
  return path.read_bytes()


def _edit_header(data: bytes, edit) -> bytes:
  n = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + n])
  edit(header)
  text = json.dumps(header).encode()
  return len(text).to_bytes(8, "little") + text + data[8 + n:]


def _edit_qjax(edit):
  def on_header(h):
    desc = json.loads(h["__metadata__"]["qjax"])
    edit(desc)
    h["__metadata__"]["qjax"] = json.dumps(desc)
  return lambda d: _edit_header(d, on_header)


def _set(key, field, value):
  def edit(h):
    h[key][field] = value
  return lambda d: _edit_header(d, edit)


def _overlap(data: bytes) -> bytes:
  """The last tensor's bytes moved onto the first tensor's (same length)."""
  def edit(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])
    first, last = h[names[0]], h[names[-1]]
    size = last["data_offsets"][1] - last["data_offsets"][0]
    last["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + size]
  return _edit_header(data, edit)


HOSTILE_SAFETENSORS = {  # name -> (bytes -> bytes, message for qjax.load)
    "empty": (lambda d: b"", "too short"),
    "header_claims_1TB": (lambda d: (2**40).to_bytes(8, "little") + d[8:], "header length"),
    "header_past_end": (lambda d: (len(d)).to_bytes(8, "little") + d[8:], "header length"),
    "header_not_json": (lambda d: d[:8] + b"!" + d[9:], "not a readable safetensors"),
    "truncated_data": (lambda d: d[:-7], "not a readable safetensors"),
    "offsets_past_end": (_set("b", "data_offsets", [0, 2**40]), "not a readable"),
    "overlapping_offsets": (_overlap, "not a readable"),
    "absurd_shape": (_set("b", "shape", [2**31, 2**31]), "not a readable"),
    "negative_shape": (_set("b", "shape", [-8]), "not a readable"),
    "unknown_dtype": (_set("b", "dtype", "Q4"), "not a readable"),
    "description_not_json": (lambda d: _edit_header(d, lambda h: h["__metadata__"].update(
        qjax="{nope")), "malformed qjax description"),
    "description_nested_100k_deep": (lambda d: _edit_header(d, lambda h: h[
        "__metadata__"].update(qjax="[" * 100_000 + "]" * 100_000)),
        "malformed qjax description"),
    "description_a_list": (lambda d: _edit_header(d, lambda h: h["__metadata__"].update(
        qjax="[1]")), "malformed qjax description"),
    "no_description": (lambda d: _edit_header(d, lambda h: h.pop("__metadata__")),
                       "without a qjax description"),
    "wrong_version": (_edit_qjax(lambda q: q.update(version=99)), "version 99"),
    "unknown_format": (_edit_qjax(lambda q: q["tensors"]["k"].update(format="int3")),
                       "unknown quantized format 'int3'"),
    "missing_array": (_edit_qjax(lambda q: q["tensors"]["k"]["arrays"].update(
        codes="nothere")), "does not hold"),
    "foreign_field": (_edit_qjax(lambda q: q["tensors"]["k"]["arrays"].update(evil="b")),
                      "does not have"),
    "wrong_static": (_edit_qjax(lambda q: q["tensors"]["k"]["static"].update(
        group_size=[1, 2])), "malformed qjax description"),
    "shape_lies": (_edit_qjax(lambda q: q["tensors"]["k"]["static"].update(
        shape=[64, 16])), "must be"),
    "bad_view_dtype": (_edit_qjax(lambda q: q["views"].update(b="os.system")),
                       "view dtype"),
    "data_changed": (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "sha256"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SAFETENSORS))
def test_hostile_safetensors_qjax_load(tmp_path, case):
  edit, match = HOSTILE_SAFETENSORS[case]
  path = tmp_path / f"{case}.safetensors"
  path.write_bytes(edit(_saved(tmp_path)))
  _expect_value_error(qjax.load, path, match)


def _read_all(path):
  ckpt = safetensors_io.Checkpoint(path)
  return {name: (ckpt.shape(name), ckpt.get(name)) for name in ckpt.names()}


@pytest.mark.parametrize("case", [c for c in sorted(HOSTILE_SAFETENSORS) if
                                  HOSTILE_SAFETENSORS[c][1].startswith(("not a readable",
                                                                        "header length",
                                                                        "too short"))])
def test_hostile_safetensors_checkpoint(tmp_path, case):
  edit, _ = HOSTILE_SAFETENSORS[case]
  path = tmp_path / f"{case}.safetensors"
  path.write_bytes(edit(_saved(tmp_path)))
  _expect_value_error(_read_all, path, "safetensors")


def test_valid_safetensors_reads_back(tmp_path):
  path = tmp_path / "ok.safetensors"
  path.write_bytes(_saved(tmp_path))
  assert set(qjax.load(path)) == {"k", "b"}
  assert _read_all(path)["b"][0] == (8,)


# ----------------------------------------------------------------------------- fuzz

FUZZ_CASES = 300  # per reader kind; `qjax fuzz-readers --cases 10000` is the long run


@pytest.mark.parametrize("kind", reader_fuzz.READER_KINDS)
def test_fuzzed_files_raise_only_value_error(kind, tmp_path):
  report = reader_fuzz.run(kind, FUZZ_CASES, seed=1, case_timeout_s=10.0,
                           failures_dir=tmp_path)
  assert report.cases == FUZZ_CASES
  assert report.ok, (report.summary(), report.failures[:3])
  # Both outcomes occur, or the mutations are not reaching the readers' checks.
  assert report.rejected > FUZZ_CASES // 4, report.summary()
  assert report.rss_growth_mib < 256, report.summary()
  # Times: the cases' own, with the setup (seed files, first reads) apart.
  assert report.setup_seconds > 0 and 0 < report.slowest_case_s <= report.seconds
  assert re.search(r"[\d.]+ s for the cases \(slowest [\d.]+ s; [\d.]+ s of setup\)",
                   report.summary()), report.summary()


def test_fuzz_mutations_are_reproducible():
  seeds = [b"GGUF" + bytes(range(200))]
  a = reader_fuzz.mutate(np.random.default_rng([3, 7]), seeds[0], seeds, "gguf")
  b = reader_fuzz.mutate(np.random.default_rng([3, 7]), seeds[0], seeds, "gguf")
  assert a == b and a != seeds[0]


@pytest.mark.parametrize("index", ["[1, 2]", "{nope", "[" * 100_000, '{"weight_map": {"a": 3}}',
                                   '{"weight_map": {"a": "../../etc/passwd"}}',
                                   '{"weight_map": []}'])
def test_hostile_sharded_index(tmp_path, index):
  (tmp_path / safetensors_io.INDEX_FILE).write_text(index)
  with pytest.raises(ValueError, match=safetensors_io.INDEX_FILE):
    safetensors_io.Checkpoint(tmp_path)


def test_fuzz_cli_reports_and_exits_0(tmp_path, capsys):
  from qjax._src import cli
  out = tmp_path / "fuzz.json"
  assert cli.main(["fuzz-readers", "--reader", "gguf", "--cases", "20", "--json",
                   str(out)]) == 0
  assert "gguf: 20 files" in capsys.readouterr().out
  (report,) = json.loads(out.read_text())
  assert report["ok"] and report["cases"] == 20 and report["failures"] == []


def test_fuzz_cli_catches_a_reader_that_crashes(tmp_path, monkeypatch, capsys):
  from qjax._src import cli

  def crash(path):
    raise TypeError("reader fell over")
  monkeypatch.setitem(reader_fuzz.READERS, "gguf", (crash,))
  keep = tmp_path / "failures"
  assert cli.main(["fuzz-readers", "--reader", "gguf", "--cases", "5", "--keep-failures",
                   str(keep)]) == 1
  assert "TypeError: reader fell over" in capsys.readouterr().out
  assert len(list(keep.iterdir())) == 5


def test_fuzz_counts_a_slow_reader_as_a_hang(monkeypatch):
  def slow(path):
    time.sleep(5)
  monkeypatch.setitem(reader_fuzz.READERS, "gguf", (slow,))
  report = reader_fuzz.run("gguf", 2, case_timeout_s=0.2)
  assert report.hangs == len(report.failures) == 2 + 2 and not report.ok  # 2 seeds, 2 cases
  assert all(f["error"].startswith("hang") for f in report.failures)


def test_gguf_integer_fields_of_any_prefix_raise_only_value_error():
  """The fuzzer's structure-aware mutation reads mutated files too."""
  from qjax._src import gguf_header
  data = valid_gguf()
  assert (8, 8) in gguf_header.integer_fields(data)  # the tensor count
  for n in range(len(data)):
    try:
      gguf_header.integer_fields(data[:n])
    except ValueError:
      pass
