"""llama3 RoPE scaling (Llama 3.1 / 3.2): GGUF's ``rope_freqs.weight``, against float64.

llama.cpp's converter writes Llama 3.1 / 3.2's ``rope_scaling`` (``rope_type: "llama3"``)
as a tensor, one divisor per RoPE pair (``rope_freqs.weight``), which llama.cpp applies as
``theta_i = pos * base ** (-2i / d) / factor_i``. A tiny llama file (test_qwen_gguf's
writer and vocabulary, adjacent-pair RoPE) carries factors of all three kinds (1, the
scale factor, and the blend between), computed here the way the converter's loop does;
qjax's logits and ``qjax generate``'s greedy tokens must be those of
test_generation_audit's float64 reference with the same factors. By hand (not kept as a
test): the reference without the factors differs from these logits by far more than the
tolerance.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import test_generate_spm_gguf as spm_gguf  # noqa: E402
import test_generation_audit as audit  # noqa: E402
import test_qwen_gguf as qwen  # noqa: E402  (the writer, vocabulary and reference glue)
from conftest import seed_from  # noqa: E402
from flax_layers import llama  # noqa: E402
from qjax._src import gguf_io  # noqa: E402

# Llama 3.1's scaling constants over a context short enough for the tiny head size:
# wavelengths of head_dim 16 (base 10000) run from 6.3 to 2e4, across 64 / 4 and 64 / 1.
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64)
HEAD_DIM, BASE = 16, 10000.0


def _converter_factors(base, dim, factor, low_freq_factor, high_freq_factor,
                       original_context):
  """convert_hf_to_gguf.py's LlamaModel loop over the frequencies (one factor each)."""
  out = []
  for i in range(0, dim, 2):
    wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
    if wavelen < original_context / high_freq_factor:
      out.append(1.0)
    elif wavelen > original_context / low_freq_factor:
      out.append(factor)
    else:
      smooth = ((original_context / wavelen - low_freq_factor)
                / (high_freq_factor - low_freq_factor))
      out.append(1 / ((1 - smooth) / factor + smooth))
  return tuple(out)


FACTORS = _converter_factors(BASE, HEAD_DIM, **SCALING)
ARCH = qwen.Arch("llama", hidden=96, heads=6, kv_heads=2, head_dim=HEAD_DIM, ffn=160,
                 rope_base=BASE, key_length=False, rope_freqs=FACTORS, types={
                     qwen.MT.TOKEN_EMBD: "Q8_0", qwen.MT.ATTN_NORM: "F32",
                     qwen.MT.ATTN_Q: "Q4_0", qwen.MT.ATTN_K: "Q8_0", qwen.MT.ATTN_V: "F16",
                     qwen.MT.ATTN_OUT: "F16", qwen.MT.FFN_NORM: "F32",
                     qwen.MT.FFN_GATE: "Q8_0", qwen.MT.FFN_UP: "Q4_0",
                     qwen.MT.FFN_DOWN: "F32", qwen.MT.OUTPUT_NORM: "F32",
                     qwen.MT.OUTPUT: "Q8_0"})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """``(path, float64 weights, prompt ids, greedy ids, reference logits)`` of the first
  weights' seed whose greedy reference has clear leads (test_qwen_gguf's rule)."""
  tmp_path = tmp_path_factory.mktemp("llama3")
  vocab = qwen._byte_level_vocab(tmp_path)
  prompt_ids = vocab[3].encode(qwen.PROMPT).ids
  start = seed_from("llama3_rope") % 1000
  for seed in range(start, start + 16):
    path = tmp_path / f"tiny-llama3-{seed}.gguf"
    qwen._write_model(path, ARCH, vocab, seed)
    f64 = qwen._float64_weights(path)
    ref = qwen._greedy_reference(ARCH, f64, prompt_ids)
    if ref is not None:
      return path, f64, prompt_ids, *ref
  pytest.fail("no seed gives a greedy reference with clear top-1 leads")


def test_the_factors_are_of_all_three_kinds():
  assert FACTORS[0] == 1.0 and FACTORS[-1] == SCALING["factor"]
  assert any(1.0 < f < SCALING["factor"] for f in FACTORS)


def test_llama3_rope_factors_equal_the_converters():
  """qjax's vectorized formula (also what a Hugging Face config's rope_scaling gives) equals
  the converter's loop."""
  got = llama.llama3_rope_factors(BASE, HEAD_DIM, **SCALING)
  np.testing.assert_allclose(got, np.asarray(FACTORS, np.float32), rtol=1e-6)
  llama31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_context=8192)
  np.testing.assert_allclose(llama.llama3_rope_factors(500000.0, 128, **llama31),
                             np.asarray(_converter_factors(500000.0, 128, **llama31),
                                        np.float32), rtol=1e-6)
  with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
    llama.llama3_rope_factors(BASE, HEAD_DIM, **{**SCALING, "high_freq_factor": 1.0})


@pytest.mark.parametrize("neox", [False, True])
def test_apply_rope_divides_each_frequency(neox):
  rng = np.random.default_rng(seed_from(f"llama3{neox}"))
  x = rng.standard_normal((2, 5, 3, HEAD_DIM))
  positions = np.asarray([[0, 1, 2, 7, 40], [600, 601, 3, 4, 5]], np.int32)
  got = np.asarray(llama.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions), BASE,
                                    HEAD_DIM, neox=neox,
                                    freq_factors=jnp.asarray(FACTORS, jnp.float32)),
                   np.float64)
  want = np.stack([audit._rope64(x[b], positions[b], BASE, HEAD_DIM, neox, FACTORS)
                   for b in range(2)])
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
  plain = np.stack([audit._rope64(x[b], positions[b], BASE, HEAD_DIM, neox)
                    for b in range(2)])
  assert np.abs(plain - want).max() > 0.1


@pytest.mark.parametrize("scan_layers", [True, False])
def test_model_logits_match_the_float64_reference(model, scan_layers):
  path, _, prompt_ids, generated, want = model
  gfile = gguf_io.load_gguf(path, progress=False)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata, scan_layers=scan_layers)
  params = llama.params_from_gguf(gfile, scan_layers=scan_layers)
  np.testing.assert_array_equal(params["params"]["rope_freqs"], np.float32(FACTORS))
  with jax.default_matmul_precision("highest"):
    got = llama.forward(params, jnp.asarray([prompt_ids + generated], jnp.int32), cfg=cfg)[0]
  audit._close(got, want)


def test_greedy_generation_matches_the_float64_reference(model):
  path, _, prompt_ids, generated, _ = model
  rc, out, err = spm_gguf._cli(["generate", "--model", str(path), "--prompt", qwen.PROMPT,
                                "--max-new-tokens", str(qwen.NEW_TOKENS), "--temperature",
                                "0", "--dtype", "float32", "--json"])
  assert rc == 0, err
  got = json.loads(out)
  assert got["prompt_ids"] == prompt_ids and got["generated_ids"] == generated


def test_bad_factors_are_refused(model):
  path, _, _, _, _ = model
  gfile = gguf_io.load_gguf(path, progress=False)
  good = gfile.tensors["rope_freqs.weight"]
  gfile.tensors["rope_freqs.weight"] = jnp.ones(HEAD_DIM, jnp.float32)
  with pytest.raises(ValueError, match=r"'rope_freqs.weight' has shape \(16,\), want \(8,\)"):
    llama.params_from_gguf(gfile)
  gfile.tensors["rope_freqs.weight"] = jnp.asarray(good).at[2].set(0.0)
  with pytest.raises(ValueError, match="not finite and positive"):
    llama.params_from_gguf(gfile)


def test_tensor_parallel_matches_the_float64_reference(model):
  """Two devices: the factors are replicated with the other non-projection params."""
  import test_sharding  # pylint: disable=g-import-not-at-top
  from flax_layers import tensor_parallel as tp  # pylint: disable=g-import-not-at-top
  mesh = test_sharding._mesh(2)
  path, _, prompt_ids, generated, want = model
  gfile = gguf_io.load_gguf(path, progress=False)
  cfg = llama.LlamaConfig.from_metadata(gfile.metadata)
  sharded = tp.shard_llama_params(llama.params_from_gguf(gfile), mesh, cfg)
  assert sharded["params"]["rope_freqs"].sharding.is_fully_replicated
  with jax.default_matmul_precision("highest"):
    got = tp.tp_forward(sharded, jnp.asarray([prompt_ids + generated], jnp.int32), cfg=cfg,
                        mesh=mesh)[0]
  audit._close(got, want)


# --- Hugging Face config.json's rope_scaling. ----------------------------------------------


def _hf_llama3_inv_freq(base, dim, factor, low_freq_factor, high_freq_factor,
                        original_max_position_embeddings):
  """transformers' ``_compute_llama3_parameters`` (rope_utils), in numpy."""
  inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  old = original_max_position_embeddings
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old / low_freq_factor, inv_freq / factor, inv_freq)
  smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old / high_freq_factor) & ~(wavelen > old / low_freq_factor)
  return np.where(medium, smoothed, scaled)


HF_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_hf_checkpoint_with_llama3_rope_scaling(tmp_path, rng, key):
  """A Llama 3.1-style config.json (``rope_scaling``, or transformers 5's
  ``rope_parameters`` with rope_theta inside) loads with the factors of its scaling, and
  the logits are those of the float64 HF-convention forward with transformers' scaled
  inverse frequencies."""
  import test_hf_checkpoint as hfc  # pylint: disable=g-import-not-at-top
  from flax_layers import hf_checkpoint  # pylint: disable=g-import-not-at-top
  _, folder, deq = hfc._write_case(tmp_path, rng, "ct_sym")
  config = json.loads((folder / "config.json").read_text())
  if key == "rope_parameters":
    config[key] = {**HF_SCALING, "rope_theta": config.pop("rope_theta")}
  else:
    config[key] = HF_SCALING
  (folder / "config.json").write_text(json.dumps(config))
  inv = _hf_llama3_inv_freq(10000.0, hfc.HEAD_DIM, **{k: v for k, v in HF_SCALING.items()
                                                        if k != "rope_type"})
  plain = 10000.0 ** (-np.arange(0, hfc.HEAD_DIM, 2) / hfc.HEAD_DIM)
  assert (inv == plain).any() and (inv < plain).sum() >= 2  # all three kinds of pairs
  cfg, params = hf_checkpoint.load_hf_llama(folder, progress=False)
  np.testing.assert_allclose(params["params"]["rope_freqs"], plain / inv, rtol=1e-6)
  with jax.default_matmul_precision("highest"):
    got = np.asarray(llama.forward(params, jnp.asarray(hfc.TOKENS), cfg=cfg))
  want = hfc._hf_reference_logits(deq, hfc.TOKENS, tie=False, inv_freq=inv)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  unscaled = hfc._hf_reference_logits(deq, hfc.TOKENS, tie=False)
  assert np.abs(unscaled - want).max() > 1e-2  # the scaling shows in the logits
  with pytest.raises(ValueError, match="params hold rope_freqs"):
    hf_checkpoint.save_hf_llama(tmp_path / "out", params, cfg)
