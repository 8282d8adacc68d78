"""The README's code runs as written (on small shapes) and its API claims hold on a CPU.

Every ```python block of README.md is executed with its 4096-sized dimensions shrunk to
256; the other tests run the inline API calls the README names, with the return values
it describes. A failure here means README.md (or the API it documents) has to change.
"""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_layers
import qjax

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_python_blocks():
  assert _python_blocks(), "README.md has no ```python block: update tests/test_docs.py"


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # the block saves files to the working directory
  code = _python_blocks()[index].replace("4096", "256")
  ns: dict = {}
  exec(compile(code, f"README.md python block {index}", "exec"), ns)  # pylint: disable=exec-used
  if index == 0:  # the "Use" block: what its comments say
    assert isinstance(ns["qw"], qjax.Int4Weight)
    assert ns["y"].shape == (8, 256) and ns["y"].dtype == jnp.bfloat16
    name = qjax.implementation_name(ns["qw"])
    assert name in ("pallas_triton", "xla")
    if jax.devices()[0].platform == "cpu":
      assert name == "xla"
    back = qjax.load("layer.safetensors")["w"]
    np.testing.assert_array_equal(back.dequantize(), ns["qw"].dequantize())


def _weight(k=256, n=256, seed=0):
  return jax.random.normal(jax.random.key(seed), (k, n)) / 16


def test_matmul_implementations_and_float32_route():
  qw = qjax.quantize(_weight(), group_size=128)
  x = jnp.ones((2, 256), jnp.bfloat16)
  ref = qjax.matmul(x, qw, implementation="xla")
  for impl in (None, "interpret"):
    np.testing.assert_allclose(np.asarray(qjax.matmul(x, qw, implementation=impl), np.float32),
                               np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)
  # "float32 x always takes the XLA path"
  assert qjax.implementation_name(qw, m=16, dtype=jnp.float32) == "xla"


def test_gradients_as_documented():
  qw = qjax.quantize(_weight(), group_size=128)
  x = jnp.ones((2, 256), jnp.float32)
  assert jax.grad(lambda x: qjax.matmul(x, qw).sum())(x).shape == x.shape
  g = jax.grad(lambda s: qjax.matmul(x, dataclasses.replace(qw, scales=s)).sum())(qw.scales)
  assert g.shape == qw.scales.shape
  with pytest.raises(TypeError):  # a whole weight pytree needs allow_int=True
    jax.grad(lambda w: qjax.matmul(x, w).sum())(qw)
  gw = jax.grad(lambda w: qjax.matmul(x, w).sum(), allow_int=True)(qw)
  assert gw.codes.dtype == jax.dtypes.float0
  jax.jvp(lambda x: qjax.matmul(x, qw, implementation="xla"), (x,), (x,))


def test_int4_nk_and_kernel_layouts():
  qw = qjax.quantize(_weight(), group_size=128)
  nk = qjax.to_int4_nk(qw)
  assert isinstance(nk, qjax.Int4NKWeight) and nk.codes.shape == (256, 256 // 8)
  np.testing.assert_array_equal(nk.dequantize(), qw.dequantize())
  np.testing.assert_array_equal(nk.to_int4().codes, qw.codes)
  params = {"layer": {"kernel": qw, "bias": jnp.zeros(256)}}
  out, choices = qjax.kernel_layouts(params, dtype=jnp.bfloat16, with_report=True)
  assert [type(c) for c in choices] == [qjax.LayoutChoice]
  if jax.devices()[0].platform == "cpu":  # "On a CPU nothing changes"
    assert type(qjax.kernel_layouts(params)["layer"]["kernel"]) is qjax.Int4Weight
    assert type(out["layer"]["kernel"]) is qjax.Int4Weight


def test_quantize_model_returns_params_and_report():
  params = {"params": {"mlp": {"up": {"kernel": _weight(), "bias": jnp.zeros(256)}},
                       "lm_head": {"kernel": _weight(256, 128)}}}
  new, report = flax_layers.quantize_model(
      params, [flax_layers.QuantRule(r"mlp/.*/kernel$", group_size=128)], skip=[r"lm_head"])
  assert isinstance(new["params"]["mlp"]["up"]["kernel"], qjax.Int4Weight)
  assert not qjax.is_quantized(new["params"]["lm_head"]["kernel"])
  assert "lm_head" in str(report)


def test_fp4_block_sizes_and_nk_forms():
  w = _weight(128, 128)
  mx, nv = qjax.quantize_mxfp4(w), qjax.quantize_nvfp4(w)
  assert mx.scales.shape == (128 // 32, 128)  # E8M0 scale per 32
  assert nv.scales.shape == (128 // 16, 128) and nv.scales.dtype == jnp.float8_e4m3fn
  mnk, nnk = qjax.to_mxfp4_nk(mx), qjax.to_nvfp4_nk(nv)
  assert (mnk.format_name, nnk.format_name) == ("mxfp4_nk.v2", "nvfp4_nk.v2")
  np.testing.assert_array_equal(mnk.to_mxfp4().dequantize(), mx.dequantize())
  np.testing.assert_array_equal(nnk.to_nvfp4().dequantize(), nv.dequantize())


def test_check_split_names_valid_device_counts():
  qw = qjax.quantize(_weight(512, 256), group_size=128)
  with pytest.raises(ValueError, match="valid device counts"):
    qjax.check_split(qw, "row", 3)


def test_load_gguf_returns_file_with_tensors(tmp_path):
  gguf = pytest.importorskip("gguf")
  rows = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)  # [N, K]
  raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
  writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  writer.add_uint32("llama.block_count", 1)
  writer.add_tensor("w", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  writer.add_tensor("norm", np.ones(64, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  f = qjax.load_gguf(tmp_path / "t.gguf", progress=False)
  assert isinstance(f, qjax.GGUFFile) and f.metadata["llama.block_count"] == 1
  w = f.tensors["w"]
  assert qjax.is_quantized(w) and w.shape == (64, 3)  # logical [K, N]
  ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)  # [N, K]
  np.testing.assert_array_equal(np.asarray(qjax.dequantize(w)), ref.T)  # bit for bit
  assert f.tensors["norm"].shape == (64,) and not qjax.is_quantized(f.tensors["norm"])
