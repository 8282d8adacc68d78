"""qjax.save then qjax.load, for every quantized format, stacks of them and plain arrays:
the same class, the same static fields (values and types) and bit-identical arrays (same
dtype, shape and bytes); what a file cannot hold is refused when saving, not loading."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util

import qjax
from qjax._src import check
from qjax._src import formats
from qjax._src import gguf_formats


def _bits(a) -> tuple:
  a = np.asarray(a)
  return a.dtype, a.shape, a.tobytes()


def assert_same(saved, loaded, where: str) -> None:
  """``loaded`` is ``saved`` bit for bit: class, static fields and every array."""
  if not isinstance(saved, formats.QuantizedWeight):
    assert _bits(loaded) == _bits(saved), where
    return
  assert type(loaded) is type(saved), where
  for f in dataclasses.fields(saved):
    a, b = getattr(saved, f.name), getattr(loaded, f.name)
    if f.metadata.get("static", False):
      assert b == a and type(b) is type(a), (where, f.name, a, b)
    elif a is None or b is None:
      assert a is None and b is None, (where, f.name)
    else:
      assert _bits(b) == _bits(a), (where, f.name)


def _round_trip(tmp_path, tensors: dict) -> dict:
  path = tmp_path / "t.safetensors"
  qjax.save(path, tensors)
  out = qjax.load(path)
  assert set(out) == set(tensors)
  for name, value in tensors.items():
    assert_same(value, out[name], name)
  return out


@pytest.fixture(scope="module", name="one_of_each")
def _one_of_each() -> dict:
  rng = np.random.default_rng(0)
  out = {c.name: c.build(rng, *c.fit(32, 8)) for c in check.format_cases()}
  w = jax.random.normal(jax.random.key(0), (256, 128)) / 16
  out["codebook-1pass"] = qjax.quantize_codebook(w, group=128, passes=1)
  out["codebook-2pass"] = qjax.quantize_codebook(w, group=128, passes=2)
  out["codebook-nf4"] = qjax.quantize_codebook(w, group=128, codebook="nf4")
  out["codebook-iq4_nl-orthogonal"] = qjax.quantize_codebook(
      w, group=128, codebook="iq4_nl", rotation="orthogonal")
  out["int4-tile_k8"] = qjax.quantize(w, group_size=32, tile_k=8)
  out["mxfp4-tile_k32"] = qjax.quantize_mxfp4(w, tile_k=32)
  out["nvfp4-tile_k32"] = qjax.quantize_nvfp4(w, tile_k=32)
  out["int4_nk-from-quantize"] = qjax.to_int4_nk(qjax.quantize(w, group_size=128,
                                                               symmetric=True))
  out["mxfp4_nk-from-quantize"] = qjax.to_mxfp4_nk(qjax.quantize_mxfp4(w))
  out["nvfp4_nk-from-quantize"] = qjax.to_nvfp4_nk(qjax.quantize_nvfp4(w))
  out["gguf_dense-bf16"] = gguf_formats.GGUFDense(
      data=rng.standard_normal((8, 32)).astype(ml_dtypes.bfloat16), shape=(32, 8))
  return out


def test_every_registered_format_is_in_the_audit(one_of_each):
  names = {type(w).format_name for w in one_of_each.values()}
  assert names == set(formats._FORMATS), set(formats._FORMATS) - names  # pylint: disable=protected-access


def test_every_format_round_trips_bit_for_bit(tmp_path, one_of_each):
  _round_trip(tmp_path, one_of_each)


@pytest.mark.parametrize("lead", [(3,), (2, 3)])
def test_stacked_weights_round_trip(tmp_path, lead):
  """Every array of each weight with leading ``[layers]`` (or ``[experts, layers]``) axes."""
  rng = np.random.default_rng(1)
  stacks = {}
  for c in check.format_cases():
    ws = [c.build(rng, *c.fit(32, 8)) for _ in range(int(np.prod(lead)))]
    stacks[c.name] = jax.tree.map(lambda *a: jnp.stack(a).reshape(*lead, *a[0].shape), *ws)
  w = jax.random.normal(jax.random.key(2), (256, 128)) / 16
  cbs = [qjax.quantize_codebook(w * (i + 1), group=128, passes=2)
         for i in range(int(np.prod(lead)))]
  stacks["codebook-2pass"] = jax.tree.map(
      lambda *a: jnp.stack(a).reshape(*lead, *a[0].shape), *cbs)
  _round_trip(tmp_path, stacks)


def test_plain_arrays_round_trip(tmp_path):
  key = jax.random.key(3)
  tensors = {f"x_{d.__name__}": jax.random.normal(key, (3, 5)).astype(d)
             for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn,
                       jnp.float8_e5m2)}
  tensors |= {"scalar_bf16": jnp.asarray(1.5, jnp.bfloat16), "empty": np.zeros((0, 4)),
              "int4": jnp.arange(-8, 8, dtype=jnp.int4), "bool": np.array([True, False]),
              "e8m0": np.asarray([1, 2, 0.5], ml_dtypes.float8_e8m0fnu),
              "int64": np.arange(3, dtype=np.int64)}
  _round_trip(tmp_path, tensors)


def test_flax_params_tree_round_trips_through_flattened_names(tmp_path):
  """save takes a flat mapping; a nested params tree goes through flax's flatten_dict."""
  w = jax.random.normal(jax.random.key(4), (128, 64))
  params = {"params": {"Dense_0": {"kernel": qjax.quantize(w, group_size=32),
                                   "bias": jnp.zeros((64,), jnp.bfloat16)},
                       "Dense_1": {"kernel": qjax.quantize_mxfp4(w)}}}
  flat = traverse_util.flatten_dict(params, sep="/")
  back = traverse_util.unflatten_dict(_round_trip(tmp_path, flat), sep="/")
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
    assert _bits(a) == _bits(b)


def test_offloaded_pass2_loads_the_same_bits(tmp_path):
  w = jax.random.normal(jax.random.key(5), (256, 128))
  cb = qjax.quantize_codebook(w, group=128, passes=2)
  qjax.save(tmp_path / "cb.safetensors", {"cb": cb})
  loaded = qjax.load(tmp_path / "cb.safetensors", offload_pass2=True)["cb"]
  assert loaded.codes2.sharding.memory_kind == "pinned_host"
  assert_same(cb, loaded, "cb")


# ----------------------------------------------------- defects found by the audit


def test_big_endian_arrays_load_back(tmp_path):
  """Before: save stored big-endian data as a 'float32' view that load refused."""
  tensors = {"f": np.arange(6, dtype=">f4").reshape(2, 3), "i": np.arange(4, dtype=">i2")}
  qjax.save(tmp_path / "be.safetensors", tensors)
  out = qjax.load(tmp_path / "be.safetensors")
  for name, a in tensors.items():
    assert out[name].dtype == a.dtype.newbyteorder("=") and out[name].dtype.isnative
    np.testing.assert_array_equal(out[name], a)


@pytest.mark.parametrize("value", [np.arange(3, dtype=np.complex64),
                                   np.arange(3, dtype=np.complex128),
                                   np.array(["ab", "c"]),
                                   np.array(["2020-01-01"], dtype="datetime64[D]")],
                         ids=lambda v: str(v.dtype))
def test_dtypes_a_file_cannot_hold_are_refused_when_saving(tmp_path, value):
  """Before: save wrote these (or crashed on 'uint128') and load called the file corrupt."""
  path = tmp_path / "bad.safetensors"
  match = rf"'bad' has dtype {re.escape(str(value.dtype))}, .* convert it"
  with pytest.raises(TypeError, match=match):
    qjax.save(path, {"ok": np.ones(2, np.float32), "bad": value})
  assert not path.exists() and not list(tmp_path.iterdir())


def test_numpy_scalar_static_fields_save(tmp_path):
  """Before: group_size=np.int64(32) saved as 'Object of type int64 is not JSON
  serializable'; now it loads as the Python int."""
  w = jax.random.normal(jax.random.key(6), (128, 64))
  q = qjax.quantize(w, group_size=np.int64(32))
  assert isinstance(q.group_size, np.integer)
  qjax.save(tmp_path / "q.safetensors", {"q": q})
  loaded = qjax.load(tmp_path / "q.safetensors")["q"]
  assert loaded.group_size == 32 and type(loaded.group_size) is int
  for f in formats.array_field_names(type(q)):
    if getattr(q, f) is not None:
      assert _bits(getattr(loaded, f)) == _bits(getattr(q, f)), f


def _with_version(raw: bytes, version) -> bytes:
  n = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + n])
  desc = json.loads(header["__metadata__"]["qjax"])
  desc["version"] = version
  header["__metadata__"]["qjax"] = json.dumps(desc)
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def test_a_newer_file_version_says_to_upgrade(tmp_path):
  """Before: "qjax file version 2 is not 1", nothing on what to do."""
  path = tmp_path / "v.safetensors"
  qjax.save(path, {"b": np.ones(3, np.float32)})
  path.write_bytes(_with_version(path.read_bytes(), 2))
  with pytest.raises(ValueError, match=r"file version 2; this qjax reads version 1 .*"
                                       r"upgrade qjax"):
    qjax.load(path)


def test_truncated_and_corrupted_files_raise_value_error(tmp_path):
  w = qjax.quantize(jax.random.normal(jax.random.key(7), (64, 16)), group_size=32)
  good = tmp_path / "good.safetensors"
  qjax.save(good, {"w": w, "b": np.ones(3, np.float32)})
  raw = good.read_bytes()
  bad = tmp_path / "bad.safetensors"
  cuts = sorted(set(range(0, len(raw), 7)) | {len(raw) - 1, len(raw) - 8})
  for cut in cuts:
    bad.write_bytes(raw[:cut])
    with pytest.raises(ValueError, match="truncated|not a readable|too short"):
      qjax.load(bad)
  for at in range(len(raw) - 64, len(raw)):  # tensor data: the digest catches each flip
    bad.write_bytes(raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1:])
    with pytest.raises(ValueError, match="sha256"):
      qjax.load(bad)
