"""Hugging Face mixture-of-experts folders whose experts are GPTQ- or AWQ-quantized, in
``load_hf_llama``: Qwen3-MoE (``qwen3_moe``) and Mixtral (``mixtral``) against float64.

The folders are written here as GPTQModel / AutoGPTQ and AutoAWQ leave such checkpoints
(two shards with an index: test_hf_checkpoint's ``_write_sharded``): every expert
projection (``mlp.experts.{e}.{gate,up,down}_proj`` / ``block_sparse_moe.experts.{e}.w1 /
w3 / w2``) and the attention's q / k / v / o quantized with group size 32 by
test_hf_checkpoint's ``_layout_tensors`` (GPTQ ``qweight [K / 8, N]``, ``qzeros [K / 32, N
/ 8]`` int32, fp16 ``scales``, int32 ``g_idx``; AWQ GEMM ``qweight [K, N / 8]`` in
AutoAWQ's interleaved nibble order); the router, the norms, Qwen3's q / k norms, the
embedding and the untied head fp16, as the quantizers leave them; config.json
test_hf_moe's Qwen3-30B-A3B / Mixtral-8x7B ones at tiny shapes (hidden 64, two layers, 8
experts of 64 / 96, 2 per token; Qwen3's 4 heads of 32 make q 128 wide) with
test_hf_checkpoint's ``quantization_config``. Four folders: Qwen3-MoE GPTQ symmetric (v1
format, stored zeros 7), GPTQ asymmetric (v1, zero points stored ``z - 1``) and AWQ;
Mixtral GPTQ asymmetric in GPTQModel's v2 format (zero points as stored, 0 among them).
Codes (all 16), fp16 group scales (for test_moe_gguf's gains) and zero points are random.

The reference, :func:`test_generation_audit._reference_logits` with its MoE routing, is
fed the stored tensors as this file's numpy transcription of AutoGPTQ's / AutoAWQ's
dequantization reads them (float64 ``(q - z[g_idx]) * s``, a v1 zero point its nibble +
1; AWQ column ``8c + j`` in nibble ``[0, 4, 1, 5, 2, 6, 3, 7][j]``), which must give the
values drawn, and runs HF's rotate_half RoPE for both (Mixtral's q / k rows as stored: the
loader permutes them for qjax's adjacent pairs, the reference does not). Inputs: 20 fresh
random token ids per folder (12 of prompt), the weights' seed the first whose reference
keeps every router's 2nd and 3rd logits more than 1e-3 apart.

Measured on the CPU (float32): the experts load as ``qjax.Int4Weight`` ``[layers, E,
...]`` stacks (symmetric ones without zeros) equal bit for bit to the numpy
dequantization, the attention's GPTQ / AWQ layouts too; logits of the 20 tokens within
6.5e-7 / 9.3e-7 / 1.1e-6 / 1.6e-6 (GPTQ sym, GPTQ asym, AWQ, Mixtral) of the largest
reference logit scanned, 6.6e-7 / 8.6e-7 / 1.6e-6 unrolled (the tests allow 1e-5);
prefill then cached decode within 7.6e-7 / 9.3e-7 / 8.8e-7 / 9.4e-7. The file runs in
about 50 s in one process on 2 (shared) cores.

By hand (not kept as tests), how far the scanned logits move (relative to the largest
reference logit) and how many of the 20 tokens' top picks change when the loader is
broken on purpose: GPTQ v1 zero points read without their + 1 77% (11 of 20; the
symmetric folder is then refused: its zeros read 7, not 8); GPTQ ``qweight`` nibbles
read in reverse order 138% (20) and, Mixtral v2, 111% (19); AWQ read in plain nibble
order 125% (16), through AutoAWQ's packing order instead of its inverse 132% (19); the
experts' zero points dropped (read as 8) 88% (14); their group scales rolled by one group
100% (14); the experts stacked in reverse order 125% (17); gate and up swapped 93% (14)
and, Mixtral's w1 / w3, 92% (13); Mixtral's q / k left unpermuted 134% (17). Each also
fails the bit-exact test.
"""

from __future__ import annotations

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

import qjax  # noqa: E402
import test_generation_audit as audit  # noqa: E402
import test_hf_checkpoint as hc  # noqa: E402
import test_hf_moe as hm  # noqa: E402
import test_moe_gguf as moe_gguf  # noqa: E402
from conftest import seed_from  # noqa: E402
from qjax._src import checkpoint_layouts as cl  # noqa: E402
from qjax._src import int4  # noqa: E402
from qjax._src import packing  # noqa: E402

F16 = np.float16
GROUP = hc.GROUP  # 32
LAYERS, VOCAB, PROMPT_LEN, NEW = 2, 128, 12, moe_gguf.NEW_TOKENS
RMS_EPS, ROPE_BASE = 1e-6, 1e6
# AutoAWQ's reverse_awq_order: column 8c + j of a word c sits in nibble AWQ_NIBBLE[j].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclasses.dataclass(frozen=True)
class Arch:
  model_type: str
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  experts: int
  top_k: int
  expert_ffn: int

  @property
  def names(self):
    """``(module, router, {gate / up / down: HF projection})`` (test_hf_moe's spelling)."""
    return hm.HF_EXPERTS["qwen3moe" if self.model_type == "qwen3_moe" else "mixtral"]

  @property
  def reference_cfg(self):
    """HF's attention for both: rotate_half is the NEOX pairing of the stored rows (the
    loader permutes Mixtral's q / k into adjacent pairs; the reference does not)."""
    return types.SimpleNamespace(num_layers=LAYERS, num_heads=self.heads,
                                 num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                 rope_base=ROPE_BASE, rope_dim=self.head_dim,
                                 rms_eps=RMS_EPS, rope_neox=True,
                                 experts_per_token=self.top_k)

  def config(self, quantization_config: dict) -> dict:
    """config.json: test_hf_moe's Qwen3-30B-A3B / Mixtral-8x7B ones at the tiny shapes."""
    common = {"hidden_size": self.hidden, "num_hidden_layers": LAYERS,
              "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
              "head_dim": self.head_dim, "num_experts_per_tok": self.top_k,
              "vocab_size": VOCAB, "rope_theta": ROPE_BASE, "rms_norm_eps": RMS_EPS,
              "max_position_embeddings": 256, "torch_dtype": "float16",
              "tie_word_embeddings": False, "quantization_config": quantization_config}
    if self.model_type == "qwen3_moe":
      return {**hm.QWEN3_MOE, **common, "architectures": ["Qwen3MoeForCausalLM"],
              "moe_intermediate_size": self.expert_ffn, "num_experts": self.experts,
              "intermediate_size": 3 * self.expert_ffn}
    return {**hm.MIXTRAL, **common, "architectures": ["MixtralForCausalLM"],
            "intermediate_size": self.expert_ffn, "num_local_experts": self.experts}


ARCHS = {
    # q is heads x head_dim = 128 wide, not hidden (as Qwen3's).
    "qwen3_moe": Arch("qwen3_moe", hidden=64, heads=4, kv_heads=2, head_dim=32, experts=8,
                      top_k=2, expert_ffn=64),
    "mixtral": Arch("mixtral", hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8,
                    top_k=2, expert_ffn=96),
}
# (arch, method, test_hf_checkpoint's layout options)
CASES = {
    "qwen3_moe-gptq_sym": ("qwen3_moe", "gptq", dict(version=1, symmetric=True,
                                                     act_order=False)),
    "qwen3_moe-gptq_asym": ("qwen3_moe", "gptq", dict(version=1, symmetric=False,
                                                      act_order=False)),
    "qwen3_moe-awq": ("qwen3_moe", "awq", dict(symmetric=False)),
    "mixtral-gptq_v2_asym": ("mixtral", "gptq", dict(version=2, symmetric=False,
                                                     act_order=False)),
}


# --- numpy dequantization of the stored tensors (AutoGPTQ's and AutoAWQ's own reading) ---


def _nibbles(words: np.ndarray) -> np.ndarray:
  """``[..., W]`` int32 -> ``[..., W, 8]``: nibble ``i`` (bits ``4i .. 4i + 3``) at ``i``."""
  u = words.astype(np.int64) & 0xFFFFFFFF
  return (u[..., None] >> (4 * np.arange(8))) & 0xF


def _dequantize_gptq(t: dict, prefix: str, version: int) -> np.ndarray:
  """AutoGPTQ's dequantization, float64 ``[K, N]``: ``qweight [K / 8, N]`` row ``8r + i``
  in nibble ``i`` of word ``r``; ``qzeros [G, N / 8]`` column ``8c + i`` in nibble ``i``,
  plus 1 in the v1 format (``checkpoint_format`` "gptq"); ``scales [G, N]``; row ``k`` in
  group ``g_idx[k]``."""
  qweight, qzeros = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"]
  scales, g_idx = t[f"{prefix}.scales"].astype(np.float64), t[f"{prefix}.g_idx"]
  q = np.swapaxes(_nibbles(qweight), 1, 2).reshape(-1, qweight.shape[1])
  z = _nibbles(qzeros).reshape(qzeros.shape[0], -1) + (1 if version == 1 else 0)
  return (q - z[g_idx]) * scales[g_idx]


def _dequantize_awq(t: dict, prefix: str) -> np.ndarray:
  """AutoAWQ's ``unpack_awq`` / ``reverse_awq_order`` / ``(q - z) * s``, float64 ``[K,
  N]``: ``qweight [K, N / 8]`` and ``qzeros [G, N / 8]`` hold column ``8c + j`` in nibble
  ``AWQ_NIBBLE[j]`` of word ``c``; row ``k`` in group ``k // G``."""
  def unpack(words):
    return _nibbles(words)[..., list(AWQ_NIBBLE)].reshape(words.shape[0], -1)
  q, z = unpack(t[f"{prefix}.qweight"]), unpack(t[f"{prefix}.qzeros"])
  scales = t[f"{prefix}.scales"].astype(np.float64)
  g = np.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
  return (q - z[g]) * scales[g]


def _dequantize(t: dict, prefix: str, method: str, opts: dict) -> np.ndarray:
  if method == "awq":
    return _dequantize_awq(t, prefix)
  return _dequantize_gptq(t, prefix, opts["version"])


# --- The folders. -----------------------------------------------------------------------


def _int4(rng, k: int, n: int, opts: dict, gain: float):
  """``(Int4Weight, its values float64 [K, N])``: random codes (every one of 16), fp16
  group scales for values of standard deviation about ``gain / sqrt(K)``, zero points
  (asymmetric) in [0, 15], [1, 15] where GPTQ's v1 format stores ``z - 1``; as
  test_hf_checkpoint's ``_random_int4`` packs them (tile_k 8) for its ``_layout_tensors``."""
  codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
  scales = (rng.uniform(0.5, 1.5, (k // GROUP, n)) * gain / np.sqrt(k) / 4.6).astype(F16)
  zeros = None if opts["symmetric"] else rng.integers(
      1 if opts.get("version") == 1 else 0, 16, (k // GROUP, n)).astype(np.uint8)
  w4 = int4.Int4Weight(codes=packing.pack_codes(jnp.asarray(codes), 8),
                       scales=jnp.asarray(scales),
                       zeros=None if zeros is None else jnp.asarray(zeros),
                       shape=(k, n), group_size=GROUP, tile_k=8)
  g = np.arange(k) // GROUP
  z = 8 if zeros is None else zeros[g].astype(np.int64)
  values = (codes.astype(np.int64) - z) * scales[g].astype(np.float64)
  return w4, values


def _write_case(folder, case: str, seed: int):
  """Writes ``case``'s folder (attention and experts quantized, the rest fp16) and returns
  ``(stored tensors, float64 weights for _reference_logits)``."""
  arch, method, opts = CASES[case]
  a = ARCHS[arch]
  rng = np.random.default_rng(seed)
  module, router, names = a.names
  d, f, e = a.hidden, a.expert_ffn, a.experts

  def dense(shape, gain=1.0):
    return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(F16)

  def norm(size):
    return (1 + 0.2 * rng.standard_normal(size)).astype(F16)

  t = {"model.embed_tokens.weight": dense((VOCAB, d), np.sqrt(d) / 2),
       "lm_head.weight": dense((VOCAB, d), 5.0), "model.norm.weight": norm(d)}
  f64: dict = {}

  def put(key, i, value):
    f64.setdefault(key, [None] * LAYERS)[i] = value

  def quantized(prefix, k, n, gain):
    w4, values = _int4(rng, k, n, opts, gain)
    tensors, _ = hc._layout_tensors(prefix, w4, method, opts, rng)
    t.update(tensors)
    # The stored tensors as AutoGPTQ / AutoAWQ read them: the values drawn.
    got = _dequantize(t, prefix, method, opts)
    np.testing.assert_array_equal(got, values, err_msg=prefix)
    return got

  q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
  for i in range(LAYERS):
    p = f"model.layers.{i}"
    t[f"{p}.input_layernorm.weight"] = norm(d)
    t[f"{p}.post_attention_layernorm.weight"] = norm(d)
    for ref, (k, n), gain in (("q", (d, q), 1.0), ("k", (d, kv), 2.0), ("v", (d, kv), 1.0),
                              ("o", (q, d), 10.0)):
      put(ref, i, quantized(f"{p}.self_attn.{ref}_proj", k, n, gain))
    if a.model_type == "qwen3_moe":
      t[f"{p}.self_attn.q_norm.weight"] = norm(a.head_dim)
      t[f"{p}.self_attn.k_norm.weight"] = norm(a.head_dim)
    t[f"{p}.{module}.{router}.weight"] = dense((e, d), 2.0)
    for param, (k, n), gain in (("gate", (d, f), 1.0), ("up", (d, f), 1.0),
                                ("down", (f, d), 10.0)):
      put(f"{param}_exps", i, np.stack([
          quantized(f"{p}.{module}.experts.{x}.{names[param]}", k, n, gain)
          for x in range(e)]))
  for name, a64 in t.items():
    if not name.endswith(".weight"):  # the quantized projections' tensors
      continue
    a64 = a64.astype(np.float64)
    if name.startswith("model.layers."):
      i, rest = int(name.split(".")[2]), name.split(".", 3)[3]
      key = {"input_layernorm.weight": "attn_norm",
             "post_attention_layernorm.weight": "ffn_norm",
             "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
             f"{module}.{router}.weight": "router"}[rest]
      put(key, i, a64.T if key == "router" else a64)
    else:
      f64[{"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head",
           "model.norm.weight": "final_norm"}[name]] = [a64.T if a64.ndim == 2 else a64]
  qc = hc._quantization_config(method, opts)
  if method == "awq":  # as AutoAWQ's Mixtral / Qwen3-MoE configs: the router stays fp16
    qc["modules_to_not_convert"] = ["gate"]
  config = a.config(qc)
  hc._write_sharded(folder, t, config)
  return t, f64


_CASES: dict = {}  # name -> the case's fixture value, written once per process


def _case(name: str, tmp_path_factory):
  """``(name, folder, stored tensors, float64 weights, ids, reference logits)``: the
  first seed whose reference routes every token clearly (test_moe_gguf's margin: the
  k-th and (k+1)-th router logits more than 1e-3 apart), fresh random token ids."""
  if name in _CASES:
    return _CASES[name]
  a = ARCHS[CASES[name][0]]
  for seed in range(seed_from(name) % 1000, seed_from(name) % 1000 + 16):
    folder = tmp_path_factory.mktemp(f"{name}-{seed}")
    t, f64 = _write_case(folder, name, seed)
    ids = np.random.default_rng(seed + 1).integers(0, VOCAB, PROMPT_LEN + NEW).tolist()
    router: list = []
    want = audit._reference_logits(a.reference_cfg, f64, ids, router)
    top = np.sort(np.concatenate(router), axis=-1)[:, ::-1]
    if (top[:, a.top_k - 1] - top[:, a.top_k]).min() > moe_gguf.ROUTING_MARGIN:
      _CASES[name] = name, folder, t, f64, ids, want
      return _CASES[name]
  pytest.fail(f"no seed gives {name} clear routing")


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
  return _case(request.param, tmp_path_factory)


# The forwards compared with the reference: scanned for every case, unrolled (the
# attention's layouts not stacked) for one case of each layout and zero-point scheme
# (each compile costs seconds; the unrolled experts equal the scanned ones for every
# case, test_experts_load_as_int4_stacks_bit_exact).
FORWARDS = [(name, True) for name in CASES] + [
    ("qwen3_moe-gptq_sym", False), ("qwen3_moe-awq", False), ("mixtral-gptq_v2_asym", False)]


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Logits are compared with float64 at 1e-5: float32 dots at float32 accuracy on a GPU
  too (its default is one TF32 product)."""
  with jax.default_matmul_precision("highest"):
    yield


# --- The experts as stored. -----------------------------------------------------------


def _layer(w, i: int):
  return jax.tree.map(lambda x: x[i], w)


# Dequantization of a stack in one compiled call (eagerly, op by op, the attention's took
# seconds); the same arithmetic as each weight's dequantize().
_stack_values = jax.jit(lambda w: w.dequantize(jnp.float32))
_layer_values = jax.jit(jax.vmap(lambda w: w.dequantize(jnp.float32)))


def test_experts_load_as_int4_stacks_bit_exact(case):
  """Each projection's experts are one :class:`qjax.Int4Weight` ``[layers, E, ...]``
  (symmetric where the GPTQ config says sym) whose dequantized values equal the numpy
  dequantization of the stored tensors bit for bit, unrolled too; the attention stays in
  its checkpoint layout, its values the stored ones (Mixtral's q / k columns permuted for
  adjacent-pair RoPE: test_hf_moe's ``_hf_rows`` puts them back); the router float32."""
  name, folder, _, f64, *_ = case
  arch, method, opts = CASES[name]
  a = ARCHS[arch]
  cfg, params = hm._load(folder, True)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (
      a.experts, a.top_k, a.expert_ffn)
  blocks = params["params"]["blocks"]
  moe = blocks["moe"]
  _, unrolled = hm._load(folder, False)
  for param in ("gate", "up", "down"):
    w = moe[param]
    assert type(w) is qjax.Int4Weight and w.codes.shape[:2] == (LAYERS, a.experts), param
    assert (w.zeros is None) == (method == "gptq" and opts["symmetric"]), param
    got = np.asarray(_stack_values(w)).astype(np.float64)
    np.testing.assert_array_equal(got, np.stack(f64[f"{param}_exps"]), err_msg=param)
    for i in range(LAYERS):
      jax.tree.map(np.testing.assert_array_equal, unrolled["params"][f"layers_{i}"]["moe"][param],
                   _layer(w, i))
  np.testing.assert_array_equal(np.asarray(moe["router"]), np.stack(f64["router"]))
  layout = {"gptq": cl.GPTQWeight, "awq": cl.AWQWeight}[method]
  for proj, heads in (("q", a.heads), ("k", a.kv_heads), ("v", None), ("o", None)):
    w = blocks["attn"][proj]["kernel"]
    assert type(w) is layout, proj
    for i, got in enumerate(np.asarray(_layer_values(w)).astype(np.float64)):
      if a.model_type == "mixtral" and heads is not None:
        got = hm._hf_rows(got, heads).T
      np.testing.assert_array_equal(got, f64[proj][i], err_msg=f"{proj} of layer {i}")


# --- Against the float64 reference. ---------------------------------------------------


@pytest.mark.parametrize("case,scan_layers", FORWARDS, indirect=["case"],
                         ids=[f"{n}-{'scan' if s else 'unrolled'}" for n, s in FORWARDS])
def test_logits_match_the_float64_reference(case, scan_layers):
  """The prompt and its continuation in one forward, stacked and unrolled."""
  _, folder, _, _, ids, want = case
  cfg, params = hm._load(folder, scan_layers)
  audit._close(hm._forward(cfg, params, ids), want, rel=1e-5)


def test_cached_decoding_matches_the_reference(case):
  """Prefill of the prompt (24 (token, expert) pairs: every expert dequantized), then one
  cached decode step per continuation token (2 pairs: the selected experts gathered)."""
  _, folder, _, _, ids, want = case
  cfg, params = hm._load(folder, True)
  n = PROMPT_LEN
  got = moe_gguf._decoded_logits(cfg, params, ids[:n], ids[n:])
  audit._close(got, want[n - 1:-1], rel=1e-5)


# --- What is refused. -------------------------------------------------------------------


def _rewritten(tmp_path, t: dict, folder, change: dict, config_change=None):
  """``folder``'s tensors with ``change`` (name -> array, or None to drop it) written
  to ``tmp_path``, its config updated by ``config_change``."""
  tensors = {n: v for n, v in {**t, **change}.items() if v is not None}
  config = json.loads((folder / "config.json").read_text())
  for key, value in (config_change or {}).items():
    config[key] = {**config[key], **value} if isinstance(value, dict) else value
  hc._write_sharded(tmp_path / "changed", tensors, config)
  return tmp_path / "changed"


X = "model.layers.1.mlp.experts.5.up_proj"  # an expert of the second layer


REFUSALS = {
    "missing_qzeros": ("qwen3_moe-gptq_asym", lambda t: {f"{X}.qzeros": None},
                       None, rf"tensor '{X}.qzeros' is missing from the checkpoint"),
    "missing_expert": ("qwen3_moe-awq",
                       lambda t: {f"{X}.{s}": None for s in ("qweight", "qzeros", "scales")},
                       None, rf"tensor '{X}.weight' or {X}.qweight \(awq\) is missing"),
    "misshapen_scales": ("qwen3_moe-gptq_asym",
                         lambda t: {f"{X}.scales": t[f"{X}.scales"][1:]}, None,
                         rf"tensor '{X}.scales' has shape \(1, 64\), want \(2, 64\) "
                         r"\(gptq with K=64, N=64, group_size=32\)"),
    "misshapen_qweight": ("qwen3_moe-awq",
                          lambda t: {f"{X}.qweight": t[f"{X}.qweight"][:, :-1]},
                          None, rf"tensor '{X}.qweight' has shape \(64, 7\), want \(64, 8\)"),
    "act_order": ("qwen3_moe-gptq_asym",
                  lambda t: {f"{X}.g_idx": np.random.default_rng(5).permutation(
                      t[f"{X}.g_idx"]).astype(np.int32)},
                  {"quantization_config": {"desc_act": True}},
                  rf"tensor '{X}.g_idx' orders the rows by activation \(GPTQ desc_act"),
    "zero_16": ("qwen3_moe-gptq_asym",
                lambda t: {f"{X}.qzeros": t[f"{X}.qzeros"] | np.int32(0xF0)},
                None, rf"tensor '{X}.qzeros': GPTQWeight.to_int4 .*nibble 15 reads as 16.* "
                r"zero points outside \[0, 15\] \(first at group/column \(0, 1\): 16\)"),
    "float_expert": ("qwen3_moe-gptq_sym",
                     lambda t: {**{f"{X}.{s}": None for s in ("qweight", "qzeros", "scales",
                                                              "g_idx")},
                                f"{X}.weight": np.ones((64, 64), F16)},
                     None, rf"tensor '{X}.weight' is a float expert beside quantized ones"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_bad_expert_tensors_are_named(what, tmp_path, tmp_path_factory):
  """One expert of the second layer changed: a tensor missing (or all of the expert's),
  misshapen, an act-order ``g_idx`` (each expert would permute x its own way), a v1 zero
  point of 16 (INT4 holds [0, 15]), a float expert among GPTQ ones: one ValueError that
  names the tensor."""
  name, change, config_change, match = REFUSALS[what]
  _, folder, t, *_ = _case(name, tmp_path_factory)
  bad = _rewritten(tmp_path, t, folder, change(t), config_change)
  with pytest.raises(ValueError, match=match):
    hm._load(bad, True)
