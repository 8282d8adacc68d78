"""Audit of loading the checkpoints users have: each test is a defect that was found.

Fixtures are written here with ``safetensors.numpy`` from the formats' published
definitions, and decoded weights are compared bit for bit with a float64 numpy decode.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

import qjax  # noqa: E402
from flax_layers import hf_checkpoint as hf  # noqa: E402
from qjax._src import safetensors_io as sio  # noqa: E402
from test_checkpoint_layouts import ref_ct  # noqa: E402
from test_checkpoint_layouts import ref_ct_pack_zero_point  # noqa: E402

# E2M1 code -> value (OCP MX spec; GPT-OSS's FP4_VALUES).
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _save(path: pathlib.Path, tensors: dict) -> None:
  safetensors_numpy.save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()},
                              str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("text", ["{\"model_type\": \"llama\",", "[1, 2]", "\"llama\""])
def test_config_json_that_is_no_object_is_named(tmp_path, text):
  """A truncated or non-object config.json was a JSONDecodeError without the file's name,
  or an AttributeError ('list' object has no attribute 'get')."""
  (tmp_path / sio.CONFIG_FILE).write_text(text)
  _save(tmp_path / sio.SINGLE_FILE, {"a": np.ones(3, np.float32)})
  with pytest.raises(ValueError, match=r"config\.json: .*re-download or repair"):
    hf.load_hf_llama(tmp_path, progress=False)


@pytest.mark.parametrize("qc", ["gptq", ["gptq"]])
def test_quantization_config_that_is_no_object_is_named(qc):
  """Was an AttributeError ('str' object has no attribute 'get')."""
  with pytest.raises(ValueError, match="quantization_config is a (str|list)"):
    sio.parse_quantization({"model_type": "llama", "quantization_config": qc})


# ------------------------------------------------------------------------- sharded index


def test_index_naming_a_shard_without_the_tensor(tmp_path, rng):
  """A stale index (shards of another revision) was reported as 'not a valid
  safetensors file' of a shard that is perfectly valid."""
  _save(tmp_path / "model-00001-of-00002.safetensors",
        {"a": rng.standard_normal(4).astype(np.float32)})
  _save(tmp_path / "model-00002-of-00002.safetensors",
        {"b": rng.standard_normal(4).astype(np.float32)})
  (tmp_path / sio.INDEX_FILE).write_text(json.dumps({"weight_map": {
      "a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
  ckpt = sio.Checkpoint(tmp_path)
  want = (r"model\.safetensors\.index\.json: weight_map puts tensor 'a' in "
          r"model-00002-of-00002\.safetensors, which does not hold it.*re-download")
  for read in (ckpt.get, ckpt.shape):
    with pytest.raises(ValueError, match=want):
      read("a")
  np.testing.assert_array_equal(ckpt.get("b").shape, (4,))


# --------------------------------------------------------- compressed-tensors zero points


def test_compressed_tensors_unpacked_int8_zero_points_load(tmp_path, rng):
  """compressed-tensors before its zero-point packing (April 2025) saved asymmetric
  zero points as the int8 ``[N, K // G]`` parameter; such checkpoints were refused with
  "has shape (16, 2), want (2, 2)"."""
  n, k, g = 24, 64, 32
  packed = rng.integers(-2**31, 2**31, (n, k // 8), dtype=np.int64).astype(np.int32)
  scale = (rng.uniform(0.5, 1.5, (n, k // g)) * 0.02).astype(np.float16)
  zp = rng.integers(-8, 8, (n, k // g)).astype(np.int8)
  _save(tmp_path / sio.SINGLE_FILE,
        {"l.weight_packed": packed, "l.weight_scale": scale, "l.weight_zero_point": zp,
         "l.weight_shape": np.array([n, k], np.int64)})
  q = sio.Quantization(method="compressed-tensors", group_size=g, symmetric=False)
  w = sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)
  want = ref_ct(packed, scale, zp, g)  # int8 [N, K // G] zero points as stored
  np.testing.assert_array_equal(np.asarray(w.dequantize()).astype(np.float64), want)
  np.testing.assert_array_equal(np.asarray(w.to_int4().dequantize()).astype(np.float64),
                                want)
  # Out of signed int4: named.
  _save(tmp_path / sio.SINGLE_FILE,
        {"l.weight_packed": packed, "l.weight_scale": scale,
         "l.weight_zero_point": np.full((n, k // g), 9, np.int8)})
  with pytest.raises(ValueError, match=r"'l\.weight_zero_point' holds zero points in "
                     r"\[9, 9\], outside signed int4"):
    sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)


@pytest.mark.parametrize("n,symmetric", [(12, False), (20, True), (5, False)])
def test_compressed_tensors_with_n_not_a_multiple_of_8_loads(tmp_path, rng, n, symmetric):
  """compressed-tensors packs the codes along K and pads its packed zero points along N,
  so any N fits; the loader refused N not a multiple of 8 ("must be multiples of 8"),
  the rule of GPTQ's and AWQ's qzeros, which stays."""
  k, g = 64, 32
  packed = rng.integers(-2**31, 2**31, (n, k // 8), dtype=np.int64).astype(np.int32)
  scale = (rng.uniform(0.5, 1.5, (n, k // g)) * 0.02).astype(np.float16)
  tensors = {"l.weight_packed": packed, "l.weight_scale": scale}
  zp = None
  if not symmetric:
    zp = ref_ct_pack_zero_point(rng.integers(-8, 8, (n, k // g)).astype(np.int8))
    tensors["l.weight_zero_point"] = zp
  _save(tmp_path / sio.SINGLE_FILE, tensors)
  q = sio.Quantization(method="compressed-tensors", group_size=g, symmetric=symmetric)
  w = sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)
  want = ref_ct(packed, scale, zp, g)
  assert want.shape == (k, n)
  np.testing.assert_array_equal(np.asarray(w.dequantize()).astype(np.float64), want)
  w4 = sio.to_device(w).to_int4()
  np.testing.assert_array_equal(np.asarray(w4.dequantize()).astype(np.float64), want)
  x = rng.standard_normal((3, k)).astype(np.float32)
  y = np.asarray(qjax.matmul(jax.numpy.asarray(x), w4, implementation="xla"), np.float64)
  np.testing.assert_allclose(y, x.astype(np.float64) @ want, rtol=1e-5, atol=1e-6)
  other = tmp_path / "gptq"
  other.mkdir()
  _save(other / sio.SINGLE_FILE, {"l.qweight": np.ones((k // 8, n), np.int32)})
  for method in ("gptq", "awq"):  # their qzeros pack 8 columns a word
    with pytest.raises(ValueError, match=f"N={n} must be a multiple of 8 \\({method} packs"):
      sio.read_linear(sio.Checkpoint(other), "l", k, n,
                      sio.Quantization(method=method, group_size=g))


# ------------------------------------------------------------------------------ GPT-OSS


def test_read_gpt_oss_from_a_sharded_folder(tmp_path, rng):
  """GPT-OSS ships as shards with an index; naming the folder was an OSError ("No such
  device"), and blocks and scales in different shards could not be read at all."""
  e, n, nb = 2, 24, 3
  blocks = rng.integers(0, 256, (e, n, nb, 16), dtype=np.uint8)
  scales = rng.integers(110, 140, (e, n, nb), dtype=np.uint8)
  name = "model.layers.0.mlp.experts.gate_up_proj"
  _save(tmp_path / "model-00000-of-00001.safetensors", {f"{name}_blocks": blocks})
  _save(tmp_path / "model-00001-of-00001.safetensors", {f"{name}_scales": scales})
  (tmp_path / sio.INDEX_FILE).write_text(json.dumps({"weight_map": {
      f"{name}_blocks": "model-00000-of-00001.safetensors",
      f"{name}_scales": "model-00001-of-00001.safetensors"}}))
  w = qjax.read_gpt_oss_mxfp4(tmp_path, name)
  # float64 decode: byte b of block j of row n holds k = 32j + 2b (low), 32j + 2b + 1.
  codes = np.stack([blocks & 0xF, blocks >> 4], -1).reshape(e, n, nb * 32)
  want = E2M1[codes] * np.exp2(np.repeat(scales.astype(np.float64) - 127, 32, axis=-1))
  assert w.shape == (nb * 32, n)
  np.testing.assert_array_equal(np.asarray(w.dequantize()).astype(np.float64),
                                want.transpose(0, 2, 1))
  with pytest.raises(KeyError, match="has no tensor 'x_blocks'"):
    qjax.read_gpt_oss_mxfp4(tmp_path, "x")


# ------------------------------------------------------------------- saving into a folder


def test_saving_again_into_a_folder_removes_the_other_form(tmp_path, rng):
  """A single-file save into a folder that held a sharded save left the index, so the
  loader read the earlier shards: the new weights were silently not the ones loaded.
  (A sharded save over a single file left model.safetensors, which transformers loads.)"""
  def tensors():
    return {f"t{i}": rng.standard_normal(100).astype(np.float32) for i in range(4)}

  first, second, third = tensors(), tensors(), tensors()
  assert len(sio.write_checkpoint(tmp_path, first, {}, max_shard_bytes=800)) == 2
  assert sio.write_checkpoint(tmp_path, second, {}) == [sio.SINGLE_FILE]
  assert sorted(p.name for p in tmp_path.iterdir()) == [sio.CONFIG_FILE, sio.SINGLE_FILE]
  for name, a in second.items():
    np.testing.assert_array_equal(sio.Checkpoint(tmp_path).get(name), a)
  files = sio.write_checkpoint(tmp_path, third, {}, max_shard_bytes=1200)
  assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      [sio.CONFIG_FILE, sio.INDEX_FILE, *files])
  for name, a in third.items():
    np.testing.assert_array_equal(sio.Checkpoint(tmp_path).get(name), a)
  # Shards of another count go too; other files stay.
  (tmp_path / "README.md").write_text("mine")
  files = sio.write_checkpoint(tmp_path, first, {}, max_shard_bytes=400)
  assert len(files) == 4 and sorted(p.name for p in tmp_path.iterdir()) == sorted(
      [sio.CONFIG_FILE, sio.INDEX_FILE, "README.md", *files])


# ------------------------------------------------------------------ GPTQModel's dynamic


def _pack_rows(q: np.ndarray) -> np.ndarray:
  """AutoGPTQ: ``qweight[r] |= q[8r + i] << 4i``."""
  out = np.zeros((q.shape[0] // 8, q.shape[1]), np.uint32)
  for i in range(8):
    out |= q[i::8].astype(np.uint32) << np.uint32(4 * i)
  return out.view(np.int32)


def _pack_cols(z: np.ndarray) -> np.ndarray:
  """AutoGPTQ: ``qzeros[:, c] |= z[:, 8c + i] << 4i``."""
  out = np.zeros((z.shape[0], z.shape[1] // 8), np.uint32)
  for i in range(8):
    out |= z[:, i::8].astype(np.uint32) << np.uint32(4 * i)
  return out.view(np.int32)


def test_gptq_dynamic_per_module_overrides(tmp_path, rng):
  """GPTQModel's ``dynamic`` (per-module group_size / sym / skip) was ignored: a module of
  another group size was refused with a shape error naming the global group_size, an
  asymmetric override loaded as symmetric (to_int4 then refused it)."""
  k, n = 128, 32
  tensors, want = {}, {}
  for prefix, g, sym in (("model.layers.0.mlp.up_proj", 64, True),
                         ("model.layers.0.mlp.down_proj", 32, False),
                         ("model.layers.1.mlp.down_proj", 64, True)):
    q = rng.integers(0, 16, (k, n))
    z = np.full((k // g, n), 8) if sym else rng.integers(1, 16, (k // g, n))
    s = (rng.uniform(0.5, 1.5, (k // g, n)) * 0.02).astype(np.float16)
    tensors.update({f"{prefix}.qweight": _pack_rows(q), f"{prefix}.qzeros": _pack_cols(z - 1),
                    f"{prefix}.scales": s,
                    f"{prefix}.g_idx": (np.arange(k) // g).astype(np.int32)})
    gi = np.arange(k) // g
    want[prefix] = (q - z[gi]) * s.astype(np.float64)[gi]
  dense = rng.standard_normal((n, k)).astype(np.float16)
  tensors["model.layers.0.self_attn.o_proj.weight"] = dense
  _save(tmp_path / sio.SINGLE_FILE, tensors)
  qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq",
        "dynamic": {r"-:.*self_attn\.o_proj": {},
                    r"+:model\.layers\.0\.mlp\.down_proj": {"group_size": 32, "sym": False}}}
  q = sio.parse_quantization({"quantization_config": qc})
  ckpt = sio.Checkpoint(tmp_path)
  for prefix, ref in want.items():
    w = sio.read_linear(ckpt, prefix, k, n, q)
    np.testing.assert_array_equal(np.asarray(w.dequantize()).astype(np.float64), ref)
    assert w.symmetric == (prefix != "model.layers.0.mlp.down_proj")
    np.testing.assert_array_equal(np.asarray(w.to_int4().dequantize()).astype(np.float64),
                                  ref)
  w = sio.read_linear(ckpt, "model.layers.0.self_attn.o_proj", k, n, q)
  np.testing.assert_array_equal(np.asarray(w.data), dense)
  # A module of another bit width is named.
  qc["dynamic"] = {r"model\.layers\.1\.": {"bits": 8}}
  q = sio.parse_quantization({"quantization_config": qc})
  with pytest.raises(ValueError, match=r"dynamic\['model\\\\.layers\\\\.1\\\\.'\]\.bits=8"):
    sio.read_linear(ckpt, "model.layers.1.mlp.down_proj", k, n, q)


# ------------------------------------------- session 47: configs that disagree with tensors


def _ct_config(**weights) -> dict:
  """A compressed-tensors pack-quantized quantization_config, weights' keys overridden."""
  w = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
       "strategy": "group", **weights}
  return {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}


def _gptq_tensors(rng, k, n, g, z):
  """One GPTQ v1 linear ``l`` with effective zero points ``z`` [K // G, N]."""
  q = rng.integers(0, 16, (k, n))
  s = (rng.uniform(0.5, 1.5, (k // g, n)) * 0.02).astype(np.float16)
  return {"l.qweight": _pack_rows(q), "l.qzeros": _pack_cols(z - 1), "l.scales": s}


def test_gptq_sym_flag_that_disagrees_with_the_stored_zeros_is_refused(tmp_path, rng):
  """A config.json without "sym" (GPTQ's default: true) over asymmetric zero points
  loaded; the kernels' route then dropped the zeros under jit (relative error ~3), while
  the XLA route read them. Now the weight is refused where it is built from the arrays,
  naming the flag; symmetric zeros (all 8) load and both routes agree."""
  k, n, g = 64, 16, 32
  qc = {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False}
  q = sio.parse_quantization({"quantization_config": qc})
  assert q.symmetric
  _save(tmp_path / sio.SINGLE_FILE, _gptq_tensors(rng, k, n, g, rng.integers(1, 16, (2, n))))
  with pytest.raises(ValueError, match=r"GPTQWeight: symmetric=True but the effective zero "
                     r"point at group/column \(\d+, \d+\) is \d+, not 8 .*\"sym\": false"):
    sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)
  _save(tmp_path / sio.SINGLE_FILE, _gptq_tensors(rng, k, n, g, np.full((2, n), 8)))
  w = sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)
  x = rng.standard_normal((3, k)).astype(np.float32)
  ref = x.astype(np.float64) @ np.asarray(w.dequantize(), np.float64)
  for impl in ("xla", "interpret"):
    y = np.asarray(jax.jit(lambda a, b, impl=impl: qjax.matmul(a, b, implementation=impl))(
        x, w), np.float64)
    assert np.abs(y - ref).max() < 1e-4 * np.abs(ref).max(), impl


def test_gptq_act_order_without_g_idx_is_refused(tmp_path, rng):
  """desc_act=true without a g_idx tensor loaded with contiguous groups."""
  k, n, g = 64, 16, 32
  _save(tmp_path / sio.SINGLE_FILE, _gptq_tensors(rng, k, n, g, np.full((2, n), 8)))
  q = sio.parse_quantization({"quantization_config": {
      "quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": True, "sym": True}})
  with pytest.raises(ValueError, match=r"tensor l\.g_idx is missing, but quantization_config "
                     r"has desc_act=true"):
    sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)


@pytest.mark.parametrize("extra,match", [
    ({"is_marlin_format": True}, "is_marlin_format=True is not supported"),
    ({"pack_dtype": "int16"}, "pack_dtype='int16' is not supported"),
])
def test_gptq_packings_qjax_does_not_read_are_named(extra, match):
  """Were refused later by a tensor's shape or a missing qzeros, not by the key."""
  qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, **extra}
  with pytest.raises(ValueError, match=match):
    sio.parse_quantization({"quantization_config": qc})
  qc["pack_dtype"] = "torch.int32"
  if "is_marlin_format" not in extra:
    assert sio.parse_quantization({"quantization_config": qc}).method == "gptq"


def test_compressed_tensors_symmetric_with_stored_zero_points(tmp_path, rng):
  """symmetric=true ignored a stored weight_zero_point; compressed-tensors leaves zero
  ones out, so a non-zero one means config and tensors disagree: refused. All-zero ones
  (packed, nibble 8) load as symmetric."""
  n, k, g = 16, 64, 32
  packed = rng.integers(-2**31, 2**31, (n, k // 8), dtype=np.int64).astype(np.int32)
  scale = (rng.uniform(0.5, 1.5, (n, k // g)) * 0.02).astype(np.float16)
  q = sio.parse_quantization({"quantization_config": _ct_config()})
  zp = np.zeros((n, k // g), np.int8)
  zp[3, 1] = -2
  _save(tmp_path / sio.SINGLE_FILE, {"l.weight_packed": packed, "l.weight_scale": scale,
                                     "l.weight_zero_point": zp})
  with pytest.raises(ValueError, match=r"'l\.weight_zero_point' holds non-zero zero points "
                     r"\(e\.g\. -2\), but quantization_config says symmetric=true"):
    sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)
  zeros_packed = ref_ct_pack_zero_point(np.zeros((n, k // g), np.int8))
  _save(tmp_path / sio.SINGLE_FILE, {"l.weight_packed": packed, "l.weight_scale": scale,
                                     "l.weight_zero_point": zeros_packed})
  w = sio.read_linear(sio.Checkpoint(tmp_path), "l", k, n, q)
  np.testing.assert_array_equal(np.asarray(w.dequantize()).astype(np.float64),
                                ref_ct(packed, scale, None, g))


@pytest.mark.parametrize("qc,match", [
    (_ct_config(actorder=True), r"weights\.actorder=True \(weight_g_idx\) is not supported"),
    (_ct_config(dynamic=True), r"weights\.dynamic=True is not supported"),
    ({**_ct_config(), "sparsity_config": {"format": "sparse-24-bitmask"}},
     r"sparsity_config\.format='sparse-24-bitmask' is not supported"),
    ({**_ct_config(), "quantization_status": "frozen"},
     r"quantization_status='frozen' is not supported"),
])
def test_compressed_tensors_schemes_qjax_does_not_read_are_named(qc, match):
  """Were accepted, then failed on a tensor (or loaded something else)."""
  with pytest.raises(ValueError, match=match):
    sio.parse_quantization({"quantization_config": qc})


def test_compressed_tensors_activation_quantization_is_warned_about():
  """W4A8 / KV-cache schemes were ignored in silence: qjax runs the weights only."""
  qc = _ct_config()
  qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "dynamic": True}
  qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
  qc["sparsity_config"] = {"format": "dense"}
  qc["quantization_status"] = "compressed"
  with pytest.warns(UserWarning) as record:
    q = sio.parse_quantization({"quantization_config": qc})
  text = " ".join(str(r.message) for r in record)
  assert "config_groups.group_0.input_activations is ignored" in text
  assert "kv_cache_scheme is ignored" in text
  assert (q.method, q.group_size, q.symmetric) == ("compressed-tensors", 32, True)


@pytest.mark.parametrize("name,qc,method", [
    ("quantize_config.json", {"bits": 4, "group_size": 64, "sym": False, "desc_act": False},
     "gptq"),
    ("quant_config.json", {"w_bit": 4, "q_group_size": 64, "zero_point": True,
                           "version": "GEMM"}, "awq"),
])
def test_legacy_quantization_files_beside_config_json(tmp_path, name, qc, method):
  """Older AutoGPTQ / AutoAWQ checkpoints keep their scheme in quantize_config.json /
  quant_config.json only; they were read as dense ("tensor ...weight missing")."""
  (tmp_path / sio.CONFIG_FILE).write_text(json.dumps({"model_type": "llama"}))
  (tmp_path / name).write_text(json.dumps(qc))
  config = sio.read_config(tmp_path)
  assert config["quantization_config"]["quant_method"] == method
  q = sio.parse_quantization(config)
  assert (q.method, q.group_size) == (method, 64)
  # config.json's own quantization_config wins; a bad legacy file is named.
  (tmp_path / sio.CONFIG_FILE).write_text(json.dumps(
      {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                      "group_size": 32}}))
  assert sio.parse_quantization(sio.read_config(tmp_path)).group_size == 32
  (tmp_path / sio.CONFIG_FILE).write_text(json.dumps({"model_type": "llama"}))
  (tmp_path / name).write_text("[4]")
  with pytest.raises(ValueError, match=rf"{name}: holds a JSON list"):
    sio.read_config(tmp_path)
