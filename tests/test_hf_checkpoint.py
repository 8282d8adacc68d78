"""Hugging Face safetensors checkpoints of a tiny Llama: load in every layout, export, errors.

The fixtures are written by the tests themselves: projections packed with the layout
pytrees' ``from_int4`` packers (GPTQ / AWQ) and, for compressed-tensors, a numpy
transcription of ``pack_to_int32`` (compressed-tensors
``compressors/quantized_compressors/pack_quantized.py``), saved as two shards with an
index. Each quantized checkpoint must give the logits of the same weights written dense,
and the dense one those of an independent numpy forward pass in Hugging Face's own
conventions (``rotate_half`` RoPE, ``[out, in]`` weights), which checks the RoPE
permutation done at load.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from flax_layers import hf_checkpoint as hf  # noqa: E402
from flax_layers import llama  # noqa: E402
from qjax._src import checkpoint_layouts as cl  # noqa: E402
from qjax._src import gguf_formats  # noqa: E402
from qjax._src import int4  # noqa: E402
from qjax._src import packing  # noqa: E402
from qjax._src import safetensors_io as sio  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Logits are compared with float64 at 1e-4, so float32 dots (the attention's einsums
  among them) run at float32 accuracy on the GPU too, whose default is one TF32 product:
  up to 9.6e-4 off on the H100 (session 26). The CPU multiplies float32 exactly either
  way."""
  with jax.default_matmul_precision("highest"):
    yield


HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 16, 128, 96
GROUP = 32
TOKENS = np.array([[3, 17, 42, 5, 88, 1, 60, 9]], np.int32)

# (name, method, options): the checkpoints each test writes.
CASES = {
    "gptq_v1_sym": ("gptq", dict(version=1, symmetric=True, act_order=False)),
    "gptq_v1_asym_actorder": ("gptq", dict(version=1, symmetric=False, act_order=True)),
    "gptq_v2_sym_actorder": ("gptq", dict(version=2, symmetric=True, act_order=True)),
    "gptq_v2_asym_per_channel": ("gptq", dict(version=2, symmetric=False, act_order=False,
                                              group_size=-1)),
    "awq": ("awq", dict(symmetric=False)),
    "ct_sym": ("compressed-tensors", dict(symmetric=True)),
    "ct_asym": ("compressed-tensors", dict(symmetric=False)),
}


def _hf_config(quantization_config=None, tie=False) -> dict:
  cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
         "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
         "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "max_position_embeddings": 128, "hidden_act": "silu",
         "tie_word_embeddings": tie, "torch_dtype": "float16"}
  if quantization_config:
    cfg["quantization_config"] = quantization_config
  return cfg


def _linear_names(tie: bool) -> dict[str, tuple[int, int]]:
  """HF prefix -> logical (K, N)."""
  c = llama.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                        ffn_size=FFN)
  out = {f"model.layers.{i}.{m}": hf.linear_shape(c, m)
         for i in range(LAYERS) for m in hf.LINEARS}
  if not tie:
    out["lm_head"] = (HIDDEN, VOCAB)
  return out


def _random_int4(rng, k, n, g, symmetric) -> int4.Int4Weight:
  codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
  scales = (rng.uniform(0.5, 1.5, (k // g, n)) * 0.02).astype(np.float16)
  zeros = None if symmetric else rng.integers(1, 16, (k // g, n)).astype(np.uint8)
  return int4.Int4Weight(codes=packing.pack_codes(jnp.asarray(codes), 8),
                         scales=jnp.asarray(scales),
                         zeros=None if zeros is None else jnp.asarray(zeros),
                         shape=(k, n), group_size=g, tile_k=8)


def _ct_pack_to_int32(value: np.ndarray, packed_dim: int) -> np.ndarray:
  """compressed-tensors ``pack_to_int32(value, 4, packed_dim)`` for int8 ``value``."""
  v = (value.astype(np.int16) + 8).astype(np.uint32)
  if packed_dim == 0:
    v = v.T
  pad = -v.shape[1] % 8
  v = np.pad(v, [(0, 0), (0, pad)])
  packed = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
  for i in range(8):
    packed |= v[:, i::8] << (4 * i)
  packed = packed.view(np.int32)
  return np.ascontiguousarray(packed.T if packed_dim == 0 else packed)


def _layout_tensors(prefix, w4, method, opts, rng):
  """(file tensors of the linear, the layout pytree) as the producer writes them."""
  if method == "gptq":
    k = w4.shape[0]
    g_idx = np.arange(k, dtype=np.int32) // w4.group_size
    if opts["act_order"]:
      g_idx = rng.permutation(g_idx).astype(np.int32)
    lay = cl.GPTQWeight.from_int4(w4, zero_point_version=opts["version"],
                                  g_idx=jnp.asarray(g_idx))
    t = {"qweight": lay.qweight, "qzeros": lay.qzeros, "scales": lay.scales, "g_idx": g_idx}
  elif method == "awq":
    lay = cl.AWQWeight.from_int4(w4)
    t = {"qweight": lay.qweight, "qzeros": lay.qzeros, "scales": lay.scales}
  else:
    # Unpacked int8 zero points here: the test's own transcription packs them below.
    lay = cl.CompressedTensorsWeight.from_int4(w4, pack_zero_point=False)
    k, n = w4.shape
    codes = np.asarray(w4.unpacked_codes()).T.astype(np.int16) - 8  # [N, K] signed
    t = {"weight_packed": _ct_pack_to_int32(codes.astype(np.int8), 1),
         "weight_scale": lay.weight_scale, "weight_shape": np.array([n, k], np.int64)}
    np.testing.assert_array_equal(t["weight_packed"], np.asarray(lay.weight_packed))
    if lay.weight_zero_point is not None:
      t["weight_zero_point"] = _ct_pack_to_int32(np.asarray(lay.weight_zero_point), 0)
  return {f"{prefix}.{s}": np.asarray(a) for s, a in t.items()}, lay


def _quantization_config(method, opts) -> dict:
  g = opts.get("group_size", GROUP)
  if method == "gptq":
    return {"quant_method": "gptq", "bits": 4, "group_size": g, "sym": opts["symmetric"],
            "desc_act": opts["act_order"],
            "checkpoint_format": "gptq" if opts["version"] == 1 else "gptq_v2"}
  if method == "awq":
    return {"quant_method": "awq", "bits": 4, "group_size": g, "version": "gemm",
            "zero_point": True}
  return {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": opts["symmetric"],
              "group_size": g, "strategy": "group"}}}, "ignore": []}


def _write_sharded(folder: pathlib.Path, tensors: dict, config: dict) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  names = list(tensors)
  half = len(names) // 2
  files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  weight_map = {}
  for f, part in zip(files, (names[:half], names[half:])):
    safetensors_numpy.save_file({n: np.ascontiguousarray(tensors[n]) for n in part},
                                str(folder / f), metadata={"format": "pt"})
    weight_map.update({n: f for n in part})
  (folder / sio.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  (folder / sio.CONFIG_FILE).write_text(json.dumps(config))


def _write_case(tmp_path, rng, case):
  """Writes the quantized checkpoint of ``case`` and the same weights dense.

  Returns (quantized folder, dense folder, {name: float32 [out, in] weight}).
  """
  method, opts = CASES[case]
  tie = method == "gptq"  # GPTQ cases tie the head; the others quantize lm_head
  dense = {"model.embed_tokens.weight":
           (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float16),
           "model.norm.weight": rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32)}
  for i in range(LAYERS):
    for n in hf.NORMS:
      dense[f"model.layers.{i}.{n}"] = rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32)
  quant, deq = dict(dense), dict(dense)
  for prefix, (k, n) in _linear_names(tie).items():
    g = opts.get("group_size", GROUP)
    g = k if g == -1 else g
    w4 = _random_int4(rng, k, n, g, opts["symmetric"])
    tensors, lay = _layout_tensors(prefix, w4, method, opts, rng)
    quant.update(tensors)
    deq[f"{prefix}.weight"] = np.asarray(lay.dequantize()).T.copy()  # [N, K] f32
  qdir, ddir = tmp_path / case, tmp_path / f"{case}_dense"
  _write_sharded(qdir, quant, _hf_config(_quantization_config(method, opts), tie))
  _write_sharded(ddir, deq, _hf_config(None, tie))
  return qdir, ddir, deq


# ------------------------------------------------------- the independent HF reference


def _hf_reference_logits(w: dict, tokens: np.ndarray, tie: bool, *, layers: int = LAYERS,
                         heads: int = HEADS, kv_heads: int = KV_HEADS,
                         head_dim: int = HEAD_DIM, rope_theta: float = 10000.0,
                         eps: float = 1e-5, qkv_bias: bool = False,
                         qk_norm: bool = False,
                         inv_freq: np.ndarray | None = None) -> np.ndarray:
  """Float64 Llama forward in Hugging Face conventions: ``y = x @ W.T``, rotate_half.

  The keyword options default to the tiny Llama's; Qwen2 adds ``{q,k,v}_proj.bias``
  (``qkv_bias``), Qwen3 normalizes each q and k head with ``q_norm.weight`` /
  ``k_norm.weight`` before RoPE (``qk_norm``; transformers' Qwen3Attention), with a
  ``head_dim`` that need not be hidden / heads. ``inv_freq`` ``[head_dim // 2]``, where
  given, replaces RoPE's ``rope_theta ** (-2i / head_dim)`` (scaled RoPE)."""
  f = lambda n: np.asarray(w[n], np.float64)
  x = f("model.embed_tokens.weight")[tokens[0]]
  t = x.shape[0]
  inv = (rope_theta ** (-np.arange(0, head_dim, 2) / head_dim) if inv_freq is None
         else np.asarray(inv_freq, np.float64))
  ang = np.arange(t)[:, None] * inv[None]
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

  def rope(v):  # [T, H, D]
    half = head_dim // 2
    rot = np.concatenate([-v[..., half:], v[..., :half]], -1)
    return v * cos[:, None] + rot * sin[:, None]

  def norm(v, g):
    return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps) * g

  def proj(h, name):
    y = h @ f(name + ".weight").T
    return y + f(name + ".bias") if qkv_bias else y

  causal = np.tril(np.ones((t, t), bool))
  for i in range(layers):
    p = f"model.layers.{i}."
    h = norm(x, f(p + "input_layernorm.weight"))
    q = proj(h, p + "self_attn.q_proj").reshape(t, heads, head_dim)
    k = proj(h, p + "self_attn.k_proj").reshape(t, kv_heads, head_dim)
    v = proj(h, p + "self_attn.v_proj").reshape(t, kv_heads, head_dim)
    if qk_norm:
      q = norm(q, f(p + "self_attn.q_norm.weight"))
      k = norm(k, f(p + "self_attn.k_norm.weight"))
    q, k = rope(q), rope(k)
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim)
    s = np.where(causal[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", s, v).reshape(t, heads * head_dim)
    x = x + o @ f(p + "self_attn.o_proj.weight").T
    h = norm(x, f(p + "post_attention_layernorm.weight"))
    gate = h @ f(p + "mlp.gate_proj.weight").T
    up = h @ f(p + "mlp.up_proj.weight").T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ f(p + "mlp.down_proj.weight").T
  x = norm(x, f("model.norm.weight"))
  head = f("model.embed_tokens.weight") if tie else f("lm_head.weight")
  return (x @ head.T)[None]


def _logits(cfg, params):
  return np.asarray(llama.forward(params, jnp.asarray(TOKENS), cfg=cfg))


# -------------------------------------------------------------------------------- tests


def test_dense_checkpoint_matches_hf_reference(tmp_path, rng):
  _, ddir, deq = _write_case(tmp_path, rng, "ct_sym")
  for scan in (True, False):
    cfg, params = hf.load_hf_llama(ddir, scan_layers=scan, progress=False)
    assert cfg.scan_layers == scan and cfg.num_kv_heads == KV_HEADS
    assert isinstance(params["params"]["embed"], gguf_formats.GGUFDense)
    got = _logits(cfg, params)
    want = _hf_reference_logits(deq, TOKENS, tie=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_gives_dense_logits(tmp_path, rng, case):
  qdir, ddir, _ = _write_case(tmp_path, rng, case)
  method, opts = CASES[case]
  cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=False)
  dcfg, dparams = hf.load_hf_llama(ddir, progress=False, scan_layers=False)
  assert cfg == dcfg
  want_cls = {"gptq": cl.GPTQWeight, "awq": cl.AWQWeight,
              "compressed-tensors": cl.CompressedTensorsWeight}[method]
  p, dp = params["params"], dparams["params"]
  assert ("lm_head" in p) == (method != "gptq")
  for i in range(LAYERS):
    q = p[f"layers_{i}"]["attn"]["q"]["kernel"]
    assert isinstance(q, want_cls) and q.shape == (HIDDEN, HEADS * HEAD_DIM)
    if method == "gptq":
      assert (q.g_idx is not None) == opts["act_order"]  # trivial g_idx dropped at load
    # Every projection dequantizes to the dense checkpoint's weight, bit for bit.
    for a, b in [("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"),
                 ("mlp", "gate"), ("mlp", "up"), ("mlp", "down")]:
      wq, wd = p[f"layers_{i}"][a][b]["kernel"], dp[f"layers_{i}"][a][b]["kernel"]
      np.testing.assert_array_equal(np.asarray(wq.dequantize()), np.asarray(wd.dequantize()),
                                    err_msg=f"layer {i} {a}.{b}")
  np.testing.assert_allclose(_logits(cfg, params), _logits(dcfg, dparams), rtol=1e-5,
                             atol=1e-5)


def test_scan_layers_with_layouts(tmp_path, rng):
  """Stacked layout pytrees need checkpoint_layouts to accept a leading [layers] axis;
  until it does, the loader says what to do instead."""
  qdir, ddir, _ = _write_case(tmp_path, rng, "gptq_v1_asym_actorder")
  try:
    cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=True)
  except ValueError as e:
    assert "model.layers.*.attn." in str(e) and "scan_layers=False" in str(e)
    return
  dcfg, dparams = hf.load_hf_llama(ddir, progress=False, scan_layers=True)
  np.testing.assert_allclose(_logits(cfg, params), _logits(dcfg, dparams), rtol=1e-5,
                             atol=1e-5)


def test_convert_to_int4(tmp_path, rng):
  qdir, ddir, _ = _write_case(tmp_path, rng, "awq")
  cfg, params = hf.load_hf_llama(qdir, progress=False, convert=lambda n, w: w.to_int4())
  up = params["params"]["blocks"]["mlp"]["up"]["kernel"]  # stacked: [layers] leading axis
  assert isinstance(up, int4.Int4Weight) and up.scales.shape == (LAYERS, HIDDEN // GROUP, FFN)
  _, dparams = hf.load_hf_llama(ddir, progress=False)
  np.testing.assert_allclose(_logits(cfg, params), _logits(cfg, dparams), rtol=1e-5,
                             atol=1e-5)


def _file_tensors(folder: pathlib.Path) -> dict[str, np.ndarray]:
  out = {}
  for f in sorted(folder.glob("*.safetensors")):
    out.update(safetensors_numpy.load_file(str(f)))
  return out


@pytest.mark.parametrize("case,layout,version", [
    ("gptq_v1_asym_actorder", "gptq", 1), ("gptq_v1_sym", "gptq", 1),
    ("gptq_v2_asym_per_channel", "gptq", 2), ("ct_asym", "compressed-tensors", None),
    ("ct_sym", "compressed-tensors", None)])
def test_export_reproduces_the_producer_files(tmp_path, rng, case, layout, version):
  """load -> save in the same layout writes the same tensors, bit for bit."""
  qdir, _, _ = _write_case(tmp_path, rng, case)
  cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=False)
  out = tmp_path / "export"
  files = hf.save_hf_llama(out, params, cfg, layout=layout,
                           zero_point_version=version or 1, max_shard_bytes=40_000)
  assert len(files) > 1 and (out / sio.INDEX_FILE).exists()
  src, got = _file_tensors(qdir), _file_tensors(out)
  assert sorted(src) == sorted(got)
  for name, a in src.items():
    assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
    np.testing.assert_array_equal(got[name], a, err_msg=name)
  qc_src = json.loads((qdir / sio.CONFIG_FILE).read_text())["quantization_config"]
  qc_got = json.loads((out / sio.CONFIG_FILE).read_text())["quantization_config"]
  assert sio.parse_quantization({"quantization_config": qc_got}) == sio.parse_quantization(
      {"quantization_config": qc_src})


@pytest.mark.parametrize("layout,version", [("gptq", 1), ("gptq", 2),
                                            ("compressed-tensors", None)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_export_int4_round_trip(tmp_path, rng, layout, version, symmetric):
  """Int4Weight params (e.g. from qjax.quantize) -> checkpoint -> load: bit exact."""
  case = "ct_sym" if symmetric else "ct_asym"
  qdir, _, _ = _write_case(tmp_path, rng, case)
  cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=False,
                                 convert=lambda n, w: w.to_int4())
  out = tmp_path / "export"
  hf.save_hf_llama(out, params, cfg, layout=layout, zero_point_version=version or 1)
  t = _file_tensors(out)
  k, n = HIDDEN, HEADS * HEAD_DIM
  if layout == "gptq":
    want = {"qweight": ((k // 8, n), np.int32), "qzeros": ((k // GROUP, n // 8), np.int32),
            "scales": ((k // GROUP, n), np.float16), "g_idx": ((k,), np.int32)}
  else:
    want = {"weight_packed": ((n, k // 8), np.int32),
            "weight_scale": ((n, k // GROUP), np.float16), "weight_shape": ((2,), np.int64)}
    if not symmetric:
      want["weight_zero_point"] = ((n // 8, k // GROUP), np.int32)
  got = {s: (t[f"model.layers.1.self_attn.q_proj.{s}"].shape,
             t[f"model.layers.1.self_attn.q_proj.{s}"].dtype) for s in want}
  assert got == {s: (sh, np.dtype(dt)) for s, (sh, dt) in want.items()}
  assert not any(name.endswith("q_proj.weight") for name in t)
  cfg2, back = hf.load_hf_llama(out, progress=False, scan_layers=False)
  assert cfg2 == cfg
  for i in range(LAYERS):
    for a, b in [("attn", "q"), ("attn", "k"), ("attn", "v"), ("mlp", "down")]:
      w0 = params["params"][f"layers_{i}"][a][b]["kernel"]
      w1 = back["params"][f"layers_{i}"][a][b]["kernel"]
      np.testing.assert_array_equal(np.asarray(w1.dequantize()).view(np.uint32),
                                    np.asarray(w0.dequantize()).view(np.uint32))
  w0, w1 = params["params"]["lm_head"], back["params"]["lm_head"]
  np.testing.assert_array_equal(np.asarray(w1.dequantize()), np.asarray(w0.dequantize()))
  np.testing.assert_array_equal(_logits(cfg, back), _logits(cfg, params))


@pytest.mark.parametrize("layout,version", [("gptq", 1), ("gptq", 2),
                                            ("compressed-tensors", None)])
def test_export_awq_layout_round_trip(tmp_path, rng, layout, version):
  """AWQ projections (another layout, packed along N) export to GPTQ / compressed-tensors
  and load back with identical dequantized weights."""
  qdir, _, _ = _write_case(tmp_path, rng, "awq")
  cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=False)
  out = tmp_path / "export"
  hf.save_hf_llama(out, params, cfg, layout=layout, zero_point_version=version or 1)
  _, back = hf.load_hf_llama(out, progress=True, scan_layers=False)
  for i in range(LAYERS):
    for a, b in [("attn", "q"), ("attn", "k"), ("mlp", "gate"), ("mlp", "down")]:
      w0 = params["params"][f"layers_{i}"][a][b]["kernel"]
      w1 = back["params"][f"layers_{i}"][a][b]["kernel"]
      assert not isinstance(w1, cl.AWQWeight)
      np.testing.assert_array_equal(np.asarray(w1.dequantize()), np.asarray(w0.dequantize()))
  np.testing.assert_array_equal(_logits(cfg, back), _logits(cfg, params))


# --------------------------------------------------------------------------- errors


def _rewrite(folder: pathlib.Path, tensors=None, config=None) -> None:
  """Rewrites a fixture folder as one file (dropping the shards) and/or its config."""
  if tensors is not None:
    for f in folder.glob("*.safetensors*"):
      f.unlink()
    (folder / sio.INDEX_FILE).unlink(missing_ok=True)
    safetensors_numpy.save_file(tensors, str(folder / sio.SINGLE_FILE))
  if config is not None:
    (folder / sio.CONFIG_FILE).write_text(json.dumps(config))


def _load_error(folder) -> str:
  with pytest.raises(ValueError) as e:
    hf.load_hf_llama(folder, progress=False, scan_layers=False)
  return str(e.value)


def test_missing_tensor(tmp_path, rng):
  qdir, ddir, _ = _write_case(tmp_path, rng, "gptq_v1_sym")
  t = _file_tensors(qdir)
  del t["model.layers.1.mlp.up_proj.qzeros"]
  _rewrite(qdir, tensors=t)
  msg = _load_error(qdir)
  assert "'model.layers.1.mlp.up_proj.qzeros' is missing" in msg and str(qdir) in msg
  t = _file_tensors(ddir)
  del t["model.layers.0.self_attn.v_proj.weight"]
  _rewrite(ddir, tensors=t)
  assert "'model.layers.0.self_attn.v_proj.weight'" in _load_error(ddir)


def test_missing_lm_head(tmp_path, rng):
  _, ddir, _ = _write_case(tmp_path, rng, "ct_sym")
  t = _file_tensors(ddir)
  del t["lm_head.weight"]
  _rewrite(ddir, tensors=t)
  assert "'lm_head.weight' is missing" in _load_error(ddir)


def test_shape_disagrees_with_config(tmp_path, rng):
  qdir, _, _ = _write_case(tmp_path, rng, "ct_asym")
  cfg = json.loads((qdir / sio.CONFIG_FILE).read_text())
  _rewrite(qdir, config={**cfg, "intermediate_size": 96})
  msg = _load_error(qdir)
  assert "model.layers.0.mlp.gate_proj.weight_packed" in msg and "(96, 8)" in msg
  qdir, _, _ = _write_case(tmp_path / "b", rng, "awq")
  t = _file_tensors(qdir)
  t["model.layers.1.self_attn.k_proj.scales"] = t["model.layers.1.self_attn.k_proj.scales"][1:]
  _rewrite(qdir, tensors=t)
  msg = _load_error(qdir)
  assert "'model.layers.1.self_attn.k_proj.scales' has shape (1, 32), want (2, 32)" in msg


def test_group_size_not_dividing_k(tmp_path, rng):
  qdir, _, _ = _write_case(tmp_path, rng, "gptq_v2_sym_actorder")
  cfg = json.loads((qdir / sio.CONFIG_FILE).read_text())
  cfg["quantization_config"]["group_size"] = 48
  _rewrite(qdir, config=cfg)
  msg = _load_error(qdir)
  assert "model.layers.0.self_attn.q_proj" in msg and "group_size=48" in msg
  assert "does not divide K=64" in msg


def test_unsupported_configs(tmp_path, rng):
  qdir, _, _ = _write_case(tmp_path, rng, "gptq_v1_sym")
  cfg = json.loads((qdir / sio.CONFIG_FILE).read_text())
  bad = [({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
          "rope_scaling of rope_type 'llama3'"),
         ({"model_type": "gpt2"}, "model_type='gpt2'"),
         ({"quantization_config": {**cfg["quantization_config"], "bits": 3}}, "bits=3"),
         ({"quantization_config": {**cfg["quantization_config"],
                                   "checkpoint_format": "marlin"}}, "'marlin'"),
         ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                   "version": "gemv"}}, "'gemv'")]
  for change, what in bad:
    _rewrite(qdir, config={**cfg, **change})
    assert what in _load_error(qdir), change


def test_export_errors(tmp_path, rng):
  qdir, _, _ = _write_case(tmp_path, rng, "gptq_v1_asym_actorder")
  cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=False)
  with pytest.raises(ValueError, match=r"self_attn.q_proj: act-order g_idx cannot be stored "
                     r"as compressed-tensors"):
    hf.save_hf_llama(tmp_path / "x", params, cfg, layout="compressed-tensors")
  adir, _, _ = _write_case(tmp_path / "awq", rng, "awq")
  cfg, params = hf.load_hf_llama(adir, progress=False, scan_layers=False)
  w = params["params"]["layers_0"]["attn"]["v"]["kernel"]
  params["params"]["layers_0"]["attn"]["v"]["kernel"] = w.__class__(
      qweight=w.qweight, qzeros=jnp.zeros_like(w.qzeros), scales=w.scales, shape=w.shape,
      group_size=w.group_size)
  with pytest.raises(ValueError, match=r"model.layers.0.self_attn.v_proj: zero points in "
                     r"\[0, 0\] do not fit GPTQ checkpoint_format gptq"):
    hf.save_hf_llama(tmp_path / "y", params, cfg, layout="gptq", zero_point_version=1)


def test_export_gguf_q4_params(tmp_path, rng):
  """GGUF Q4_0 projections (as params_from_gguf holds them) are written through their
  lossless to_int4(): the checkpoint loads back to the same weights bit for bit. Q4_1's
  float biases have no INT4 zero point: the documented ValueError names the projection."""
  qdir, _, _ = _write_case(tmp_path, rng, "ct_sym")
  cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=False,
                                 convert=lambda n, w: w.to_int4())

  def q4_0(w):  # a random Q4_0 weight of w's shape (all 16 codes, f16 block scales)
    k, n = w.shape
    d = (rng.uniform(0.5, 1.5, (n, k // 32)) / 64).astype(np.float16)
    qs = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    return gguf_formats.GGUFQ4_0(d=jnp.asarray(d), qs=jnp.asarray(qs), shape=(k, n))

  is_int4 = lambda a: isinstance(a, int4.Int4Weight)  # noqa: E731
  gparams = jax.tree.map(lambda a: q4_0(a) if is_int4(a) else a, params, is_leaf=is_int4)
  hf.save_hf_llama(tmp_path / "out", gparams, cfg)
  _, back = hf.load_hf_llama(tmp_path / "out", progress=False, scan_layers=False)
  pairs = [(gparams["params"]["lm_head"], back["params"]["lm_head"])]
  for i in range(LAYERS):
    for a, b in [("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"),
                 ("mlp", "gate"), ("mlp", "up"), ("mlp", "down")]:
      pairs.append((gparams["params"][f"layers_{i}"][a][b]["kernel"],
                    back["params"][f"layers_{i}"][a][b]["kernel"]))
  for w0, w1 in pairs:
    assert isinstance(w0, gguf_formats.GGUFQ4_0)
    np.testing.assert_array_equal(np.asarray(w1.dequantize(), np.float32),
                                  np.asarray(w0.dequantize(), np.float32))
  v = gparams["params"]["layers_0"]["attn"]["v"]["kernel"]
  gparams["params"]["layers_0"]["attn"]["v"]["kernel"] = gguf_formats.GGUFQ4_1(
      d=v.d, m=v.d, qs=v.qs, shape=v.shape)
  with pytest.raises(ValueError, match=r"model.layers.0.self_attn.v_proj: Int4Weight with "
                     r"float biases"):
    hf.save_hf_llama(tmp_path / "out2", gparams, cfg)
