"""Hugging Face Qwen2 / Qwen3 checkpoint folders through ``load_hf_llama`` and ``qjax
generate --model FOLDER``, against test_hf_checkpoint's float64 HF-convention reference.

The folders are written here with test_hf_checkpoint's writers (random INT4 weights packed
by the layout pytrees and compressed-tensors' packer, two shards with an index), shaped
and named as transformers' Qwen2ForCausalLM / Qwen3ForCausalLM (``modeling_qwen2.py``,
``modeling_qwen3.py``) store them:

* qwen2: ``self_attn.{q,k,v}_proj.bias`` (dense, here bfloat16 next to quantized
  weights), no o_proj bias; head size hidden / heads (no ``head_dim`` key); a tied head
  (as Qwen2.5-0.5B); ``use_sliding_window: false`` with a ``sliding_window`` shorter than
  the context, as Qwen2.5's configs have;
* qwen3: ``self_attn.{q,k}_norm.weight`` ``[head_dim]``, an RMSNorm of each q / k head
  before RoPE; ``head_dim`` 32 with hidden 64 / 4 heads; no biases
  (``attention_bias: false``); an untied head.

Both use HF's rotate_half RoPE, which qjax's ``rope_neox`` is: their q / k rows (and
biases) must load unpermuted, where a Llama's are permuted for adjacent pairs. By hand
(not kept as tests): permuting Qwen's q / k rows as a Llama's (``_rope_heads`` ignoring
``rope_neox``), permuting the biases, or dropping the biases or the q / k norms each
makes the logits differ from the reference by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")

import ml_dtypes  # noqa: E402

import test_generate_hf as tg  # noqa: E402  (tokenizer writer, greedy reference, CLI)
import test_hf_checkpoint as hfc  # noqa: E402  (layout writers, float64 HF reference)
from flax_layers import hf_checkpoint as hf  # noqa: E402
from flax_layers import llama  # noqa: E402
from qjax._src import checkpoint_layouts as cl  # noqa: E402
from qjax._src import safetensors_io as sio  # noqa: E402

LAYERS, VOCAB, CONTEXT, RMS_EPS, THETA = 2, hfc.VOCAB, 128, 1e-6, 1e6


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """float32 dots on a GPU too (its default is one TF32 product), as the reference's
  1e-4 tolerance expects (see test_hf_checkpoint)."""
  with jax.default_matmul_precision("highest"):
    yield


@dataclasses.dataclass(frozen=True)
class Arch:
  name: str
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  tie: bool
  qkv_bias: bool
  qk_norm: bool
  cases: tuple[str, ...]  # test_hf_checkpoint.CASES written quantized

  @property
  def cfg(self) -> llama.LlamaConfig:
    """The shapes (for hf.linear_shape); not what the loader reads."""
    return llama.LlamaConfig(vocab_size=VOCAB, hidden_size=self.hidden, num_layers=LAYERS,
                             num_heads=self.heads, num_kv_heads=self.kv_heads,
                             head_dim=self.head_dim, ffn_size=self.ffn)

  @property
  def reference(self) -> dict:
    """``_hf_reference_logits``' options, from these constants."""
    return dict(layers=LAYERS, heads=self.heads, kv_heads=self.kv_heads,
                head_dim=self.head_dim, rope_theta=THETA, eps=RMS_EPS,
                qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)

  def config(self, quantization_config=None) -> dict:
    c = {"architectures": [f"{self.name.capitalize()}ForCausalLM"], "model_type": self.name,
         "hidden_size": self.hidden, "intermediate_size": self.ffn,
         "num_hidden_layers": LAYERS, "num_attention_heads": self.heads,
         "num_key_value_heads": self.kv_heads, "vocab_size": VOCAB,
         "rms_norm_eps": RMS_EPS, "rope_theta": THETA, "rope_scaling": None,
         "max_position_embeddings": CONTEXT, "hidden_act": "silu",
         "tie_word_embeddings": self.tie, "torch_dtype": "bfloat16",
         "use_sliding_window": False, "sliding_window": 32, "max_window_layers": 1,
         "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2}
    if self.name == "qwen3":
      c.update(head_dim=self.head_dim, attention_bias=False)
    if quantization_config:
      c["quantization_config"] = quantization_config
    return c


ARCHS = {
    "qwen2": Arch("qwen2", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, tie=True,
                  qkv_bias=True, qk_norm=False, cases=("gptq_v1_asym_actorder", "awq")),
    "qwen3": Arch("qwen3", hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, tie=False,
                  qkv_bias=False, qk_norm=True, cases=("ct_asym", "gptq_v2_sym_actorder")),
}
ARCH_CASES = [(a, c) for a in ARCHS for c in ARCHS[a].cases]


def _write(tmp_path, rng, a: Arch, case: str):
  """The ``case`` checkpoint of ``a`` and the same weights dense.

  Returns (quantized folder, dense folder, {name: [out, in] weight, bias or norm})."""
  method, opts = hfc.CASES[case]
  dense = {"model.embed_tokens.weight":
           (rng.standard_normal((VOCAB, a.hidden)) * 0.5).astype(np.float16),
           "model.norm.weight": rng.uniform(0.8, 1.2, a.hidden).astype(np.float32)}
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    for n in hf.NORMS:
      dense[p + n] = rng.uniform(0.8, 1.2, a.hidden).astype(np.float32)
    if a.qkv_bias:  # as large as the projections' outputs, so that they matter
      for m in hf.QKV_BIASES:
        n = hf.linear_shape(a.cfg, m)[1]
        dense[f"{p}{m}.bias"] = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    if a.qk_norm:
      for n in hf.QK_NORMS:
        dense[p + n] = rng.uniform(0.5, 1.5, a.head_dim).astype(ml_dtypes.bfloat16)
  linears = {f"model.layers.{i}.{m}": hf.linear_shape(a.cfg, m)
             for i in range(LAYERS) for m in hf.LINEARS}
  if not a.tie:
    linears["lm_head"] = (a.hidden, VOCAB)
  quant, deq = dict(dense), dict(dense)
  for prefix, (k, n) in linears.items():
    g = opts.get("group_size", hfc.GROUP)
    w4 = hfc._random_int4(rng, k, n, k if g == -1 else g, opts["symmetric"])
    tensors, lay = hfc._layout_tensors(prefix, w4, method, opts, rng)
    quant.update(tensors)
    deq[f"{prefix}.weight"] = np.asarray(lay.dequantize()).T.copy()  # [N, K] f32
  qdir, ddir = tmp_path / f"{a.name}_{case}", tmp_path / f"{a.name}_{case}_dense"
  hfc._write_sharded(qdir, quant, a.config(hfc._quantization_config(method, opts)))
  hfc._write_sharded(ddir, deq, a.config())
  return qdir, ddir, deq


def _logits(cfg, params, tokens=hfc.TOKENS):
  return np.asarray(llama.forward(params, jnp.asarray(tokens), cfg=cfg))


# ------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("arch", list(ARCHS))
def test_dense_checkpoint_matches_hf_reference(tmp_path, rng, arch):
  a = ARCHS[arch]
  _, ddir, deq = _write(tmp_path, rng, a, a.cases[0])
  want = hfc._hf_reference_logits(deq, hfc.TOKENS, a.tie, **a.reference)
  for scan in (True, False):
    cfg, params = hf.load_hf_llama(ddir, scan_layers=scan, progress=False)
    assert (cfg.rope_neox, cfg.qkv_bias, cfg.qk_norm) == (True, a.qkv_bias, a.qk_norm)
    assert (cfg.head_dim, cfg.rope_dim, cfg.num_kv_heads) == (a.head_dim, a.head_dim,
                                                              a.kv_heads)
    assert (cfg.rope_base, cfg.rms_eps, cfg.context_length) == (THETA, RMS_EPS, CONTEXT)
    p = params["params"]
    assert ("lm_head" in p) == (not a.tie)
    layer = jax.tree.map(lambda x: x[1], p["blocks"]) if scan else p["layers_1"]
    attn = layer["attn"]
    # As stored: q / k rows and biases are not permuted (rope_neox is rotate_half).
    for m, name in (("q", "q_proj"), ("k", "k_proj")):
      np.testing.assert_array_equal(np.asarray(attn[m]["kernel"].data),
                                    deq[f"model.layers.1.self_attn.{name}.weight"])
    for m in ("q", "k", "v"):
      if a.qkv_bias:
        b = deq[f"model.layers.1.self_attn.{m}_proj.bias"]
        assert attn[m]["bias"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(attn[m]["bias"]), b)
      else:
        assert "bias" not in attn[m]
    if a.qk_norm:
      np.testing.assert_array_equal(np.asarray(attn["k_norm"]["scale"]),
                                    deq["model.layers.1.self_attn.k_norm.weight"])
    else:
      assert "q_norm" not in attn and "k_norm" not in attn
    np.testing.assert_allclose(_logits(cfg, params), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,case", ARCH_CASES)
def test_quantized_checkpoint_matches_hf_reference(tmp_path, rng, arch, case):
  a = ARCHS[arch]
  qdir, ddir, deq = _write(tmp_path, rng, a, case)
  method = hfc.CASES[case][0]
  want_cls = {"gptq": cl.GPTQWeight, "awq": cl.AWQWeight,
              "compressed-tensors": cl.CompressedTensorsWeight}[method]
  want = hfc._hf_reference_logits(deq, hfc.TOKENS, a.tie, **a.reference)
  _, dparams = hf.load_hf_llama(ddir, scan_layers=False, progress=False)
  cfg, params = hf.load_hf_llama(qdir, scan_layers=False, progress=False)
  p, dp = params["params"], dparams["params"]
  for i in range(LAYERS):
    for m in ("q", "k", "v", "o"):
      w, wd = p[f"layers_{i}"]["attn"][m]["kernel"], dp[f"layers_{i}"]["attn"][m]["kernel"]
      assert isinstance(w, want_cls)
      np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(wd.dequantize()),
                                    err_msg=f"layer {i} {m}")
  np.testing.assert_allclose(_logits(cfg, params), want, rtol=1e-4, atol=1e-4)
  try:  # stacked layout pytrees: see test_hf_checkpoint.test_scan_layers_with_layouts
    scfg, sparams = hf.load_hf_llama(qdir, scan_layers=True, progress=False)
  except ValueError as e:
    assert "scan_layers=False" in str(e)
    scfg, sparams = hf.load_hf_llama(qdir, scan_layers=True, progress=False,
                                     convert=lambda n, w: w.to_int4())
  np.testing.assert_allclose(_logits(scfg, sparams), want, rtol=1e-4, atol=1e-4)


def test_convert_applies_to_projections_only(tmp_path, rng):
  """``convert`` sees the projections (after no permutation) and not the biases."""
  a = ARCHS["qwen2"]
  qdir, _, deq = _write(tmp_path, rng, a, "awq")
  seen = []
  cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=True,
                                 convert=lambda n, w: seen.append(n) or w.to_int4())
  assert "model.layers.0.self_attn.q_proj" in seen and not any("bias" in n for n in seen)
  np.testing.assert_allclose(_logits(cfg, params),
                             hfc._hf_reference_logits(deq, hfc.TOKENS, a.tie, **a.reference),
                             rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------- qjax generate


@pytest.mark.parametrize("arch,case", [("qwen2", "gptq_v1_asym_actorder"),
                                       ("qwen3", "ct_asym")])
def test_generate_greedy_tokens_match_the_reference(tmp_path, arch, case):
  a = ARCHS[arch]
  for seed in range(20):
    qdir, _, deq = _write(tmp_path / str(seed), np.random.default_rng(seed), a, case)
    want = tg._greedy_reference(deq, tg.PROMPT_IDS, a.tie, tg.NEW_TOKENS, **a.reference)
    if want and (a.tie or len(set(want)) > 1):
      break
  else:
    raise AssertionError(f"no seed of 20 gives {arch} {case} clear greedy references")
  tg._add_tokenizer(qdir)
  rc, out, err = tg._generate(qdir, "--json")
  assert rc == 0, err
  got = json.loads(out)
  assert got["prompt_ids"] == tg.PROMPT_IDS
  assert got["generated_ids"] == want


# ------------------------------------------------------------------------------ errors


def _config_error(a: Arch, **change) -> str:
  with pytest.raises(ValueError) as e:
    llama.LlamaConfig.from_hf_config({**a.config(), **change})
  return str(e.value)


def test_sliding_window_as_transformers_reads_it():
  """Qwen2Config / Qwen3Config: the window is used only with use_sliding_window, on the
  layers from max_window_layers on (or those layer_types marks); a window as long as
  the context changes nothing."""
  for a in ARCHS.values():
    msg = _config_error(a, use_sliding_window=True)
    assert "use_sliding_window=true with sliding_window=32" in msg, msg
    assert "max_window_layers=1 of num_hidden_layers=2 slides layer(s) 1; qjax runs" in msg, msg
  a = ARCHS["qwen2"]
  ok = [dict(), dict(use_sliding_window=True, max_window_layers=2),
        dict(use_sliding_window=True, max_window_layers=None),  # default 28 >= 2 layers
        dict(use_sliding_window=True, sliding_window=CONTEXT),
        dict(use_sliding_window=True, sliding_window=None),
        dict(use_sliding_window=True, layer_types=["full_attention"] * 2),
        dict(use_sliding_window=False, layer_types=["sliding_attention"] * 2)]
  for change in ok:
    cfg = llama.LlamaConfig.from_hf_config({**a.config(), **change})
    assert cfg.num_layers == LAYERS, change
  msg = _config_error(a, use_sliding_window=True,
                      layer_types=["full_attention", "sliding_attention"])
  assert "layer_types marks layer(s) 1;" in msg, msg


def test_sliding_window_refused_by_generate_and_load(tmp_path, rng):
  a = ARCHS["qwen2"]
  qdir, _, _ = _write(tmp_path, rng, a, "awq")
  tg._add_tokenizer(qdir)
  hfc._rewrite(qdir, config={**a.config(), "use_sliding_window": True})
  assert "use_sliding_window=true with sliding_window=32" in hfc._load_error(qdir)
  rc, _, err = tg._generate(qdir)
  assert rc == 2 and "use_sliding_window=true" in err, err


def test_unsupported_configs():
  q2, q3 = ARCHS["qwen2"], ARCHS["qwen3"]
  assert "attention_bias=true" in _config_error(q3, attention_bias=True)
  assert "rope_scaling of rope_type 'yarn'" in _config_error(
      q2, rope_scaling={"type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 32768})
  assert "hidden_act='gelu'" in _config_error(q3, hidden_act="gelu")
  # transformers ignores these for Qwen2 (biases on q / k / v always, none in the MLP).
  cfg = llama.LlamaConfig.from_hf_config({**q2.config(), "attention_bias": False,
                                          "mlp_bias": True})
  assert cfg.qkv_bias and not cfg.qk_norm
  # Qwen3Config's head_dim default is 128, not hidden / heads.
  cfg = llama.LlamaConfig.from_hf_config({k: v for k, v in q3.config().items()
                                          if k != "head_dim"})
  assert cfg.head_dim == 128


def test_missing_and_misshapen_tensors(tmp_path, rng):
  a = ARCHS["qwen2"]
  qdir, ddir, _ = _write(tmp_path / "q2", rng, a, "gptq_v1_asym_actorder")
  for folder in (qdir, ddir):
    t = hfc._file_tensors(folder)
    del t["model.layers.1.self_attn.k_proj.bias"]
    hfc._rewrite(folder, tensors=t)
    msg = hfc._load_error(folder)
    assert "tensor 'model.layers.1.self_attn.k_proj.bias' is missing" in msg, msg
    assert str(folder) in msg
  t = hfc._file_tensors(qdir)
  t["model.layers.1.self_attn.k_proj.bias"] = np.zeros(48, np.float32)
  t["model.layers.0.self_attn.v_proj.bias"] = np.zeros(32, np.int32)
  hfc._rewrite(qdir, tensors=t)
  msg = hfc._load_error(qdir)
  assert "'model.layers.0.self_attn.v_proj.bias' has dtype int32" in msg, msg
  t["model.layers.0.self_attn.v_proj.bias"] = np.zeros(32, np.float16)
  hfc._rewrite(qdir, tensors=t)
  msg = hfc._load_error(qdir)
  assert "'model.layers.1.self_attn.k_proj.bias' has shape (48,), want (32,)" in msg, msg
  t["model.layers.1.self_attn.k_proj.bias"] = np.zeros(32, np.float16)
  t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(a.hidden, np.float16)
  hfc._rewrite(qdir, tensors=t)
  msg = hfc._load_error(qdir)
  assert "'model.layers.0.self_attn.o_proj.bias': qjax's qwen2 model has no bias" in msg

  a = ARCHS["qwen3"]
  qdir, ddir, _ = _write(tmp_path / "q3", rng, a, "ct_asym")
  t = hfc._file_tensors(qdir)
  t["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
  hfc._rewrite(qdir, tensors=t)
  msg = hfc._load_error(qdir)
  assert ("'model.layers.0.self_attn.q_norm.weight' has shape (16,), want (32,) "
          "(per-head norm weight of head_dim=32") in msg, msg
  t = hfc._file_tensors(ddir)
  del t["model.layers.1.self_attn.k_norm.weight"]
  t2 = dict(t)
  hfc._rewrite(ddir, tensors=t)
  assert "'model.layers.1.self_attn.k_norm.weight' is missing" in hfc._load_error(ddir)
  t2["model.layers.1.self_attn.k_norm.weight"] = np.ones(32, np.float32)
  t2["model.layers.1.self_attn.q_proj.bias"] = np.ones(128, np.float32)
  hfc._rewrite(ddir, tensors=t2)
  msg = hfc._load_error(ddir)
  assert "'model.layers.1.self_attn.q_proj.bias': qjax's qwen3 model has no bias" in msg


def test_export_refuses_hf_qwen(tmp_path, rng):
  """save_hf_llama writes HF Llama only (q / k permuted back for adjacent pairs, no
  biases, no q / k norms): a loaded Qwen folder is refused before any file is written."""
  for a in ARCHS.values():
    qdir, _, _ = _write(tmp_path, rng, a, a.cases[0])
    cfg, params = hf.load_hf_llama(qdir, progress=False, scan_layers=False)
    with pytest.raises(ValueError, match="rope_neox=True.*: not a Llama model"):
      hf.save_hf_llama(tmp_path / f"out_{a.name}", params, cfg, layout="gptq")
    assert not (tmp_path / f"out_{a.name}").exists()
    assert sio.CONFIG_FILE in {f.name for f in qdir.iterdir()}
