"""A Llama model in Flax linen on quantized weights (GGUF files), with a KV cache.

Every projection goes through :func:`qjax.matmul`, so any quantized-weight pytree of
logical shape ``[K, N]`` works (GGUF block formats, :class:`qjax.Int4Weight`, ...). The
token embedding ``[K=hidden, N=vocab]`` is looked up by dequantizing only the gathered rows
and, when the file has no ``output.weight``, is also the output head (tied: ``x @ W``).

By default the layers are stacked along a leading axis and run with ``lax.scan`` (each
quantized weight as ``qjax.layer_of(stack, i)``, read in place by the kernels), so one
layer is compiled once; with ``LlamaConfig(scan_layers=False)`` they are separate submodules
``layers_0 ... layers_{n-1}`` run in an unrolled Python loop (no scan), with per-layer
params. Weights come from :func:`params_from_gguf`; there is no random init.

Architectures (``general.architecture``): ``llama``, and the Llama-style ``qwen2`` (Qwen2,
Qwen2.5: biases on q / k / v) and ``qwen3`` (Qwen3: RMSNorm of each q and k head before
RoPE, a head size that need not be ``hidden / heads``); :class:`LlamaConfig` holds what
differs (``rope_neox``, ``qkv_bias``, ``qk_norm``).

Mixtures of experts: ``qwen3moe`` (Qwen3-30B-A3B style: Qwen3's attention, an MoE FFN in
every block) and ``llama`` files with ``llama.expert_count`` > 0 (Mixtral). Each block's
FFN is then :class:`MoE`, llama.cpp's ``build_moe_ffn`` for these two: router logits
``x @ ffn_gate_inp`` in float32, the top ``experts_per_token`` of a softmax over all
experts with their weights renormalized to sum 1 (a softmax over the k selected logits),
each selected expert's SwiGLU ``down_e(silu(x @ gate_e) * (x @ up_e))``, the weighted sum.
The experts are GGUF expert stacks (``blk.N.ffn_{gate,up,down}_exps.weight``, one pytree
with a leading ``[E]`` axis each) multiplied by :func:`qjax.moe_matmul`. Shared experts,
other gating functions, scaled expert weights, leading dense layers and the old Mixtral
layout (one 2-D tensor per expert) are refused (:meth:`LlamaConfig.from_metadata`,
:func:`check_tensor_names`).

GPT-OSS: ``gpt-oss`` (llama.cpp's LLM_ARCH_OPENAI_MOE) adds to that MoE q / k / v / output
biases, per-head attention sinks (an extra logit in each head's softmax), an alternating
sliding window (layers 0, 2, 4, ... attend to the last ``sliding_window`` positions), YaRN
RoPE (:class:`YarnScaling`), router and expert biases, the clamped SwiGLU
(``flax_layers.moe.gated_activation(..., "gpt_oss")``) and a top-k-then-softmax routing;
its FFN pre-norm is GGUF's ``post_attention_norm``.

Layout notes: llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of a
``llama`` model so that RoPE rotates adjacent pairs ``(x[2i], x[2i+1])`` of each head
(``LLAMA_ROPE_TYPE_NORM``); Qwen2 / Qwen3 files are not permuted and rotate the pairs
``(x[i], x[i + rope_dim / 2])`` (``LLAMA_ROPE_TYPE_NEOX``, HF's ``rotate_half``).
:func:`apply_rope` does either, with frequency ``base ** (-2i / rope_dim)`` for pair ``i``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import qjax
from qjax._src import attention
from qjax._src import dispatch
from qjax._src import moe as moe_lib
from qjax._src.gguf_formats import embedding_rows
from flax_layers import moe as moe_layers
from flax_layers import scan
from flax_layers.dense import check_sizes

# general.architecture -> the LlamaConfig fields it sets (llama.cpp: LLM_ARCH_LLAMA uses
# LLAMA_ROPE_TYPE_NORM, LLM_ARCH_QWEN2 / QWEN3 LLAMA_ROPE_TYPE_NEOX; llm_build_qwen2 adds
# bq / bk / bv, llm_build_qwen3 normalizes Qcur / Kcur with attn_q_norm / attn_k_norm).
ARCHITECTURE_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_neox=False, qkv_bias=False, qk_norm=False),
    "qwen2": dict(rope_neox=True, qkv_bias=True, qk_norm=False),
    "qwen3": dict(rope_neox=True, qkv_bias=False, qk_norm=True),
    # llm_build_qwen3moe: Qwen3's attention, an MoE FFN (LlamaConfig.num_experts > 0).
    "qwen3moe": dict(rope_neox=True, qkv_bias=False, qk_norm=True),
    # llama.cpp's LLM_ARCH_OPENAI_MOE (GPT-OSS): NEOX RoPE; q / k / v / output biases;
    # per-head attention sinks; router and expert biases; the clamped SwiGLU
    # (LLM_FFN_SWIGLU_OAI_MOE); top-k, then a softmax over the k logits (SOFTMAX_WEIGHT).
    "gpt-oss": dict(rope_neox=True, qkv_bias=True, qk_norm=False, o_bias=True,
                    attn_sinks=True, moe_bias=True, expert_activation="gpt_oss",
                    ffn_norm_name="post_attention_norm"),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_OPTIONS)
# Hugging Face config.json model_type -> the architecture (ARCHITECTURE_OPTIONS) it runs as.
# Mixture-of-experts ones: mixtral (Llama's attention), qwen3_moe, gpt_oss.
HF_MODEL_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                          "qwen3": "qwen3", "mixtral": "llama", "qwen3_moe": "qwen3moe",
                          "gpt_oss": "gpt-oss"}
SUPPORTED_HF_MODEL_TYPES = tuple(HF_MODEL_ARCHITECTURES)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN RoPE scaling (``{arch}.rope.scaling.type = "yarn"``) as llama.cpp runs it.

  ggml's ``rope_yarn``: pair ``i``'s angle blends the interpolated ``theta / factor`` and
  the original ``theta`` by ``mix_i = ext_factor * (1 - clip((i - low) / max(0.001, high -
  low), 0, 1))``, where ``ggml_rope_yarn_corr_dims`` gives ``low = max(0, floor(c(beta_fast)))``
  and ``high = min(rope_dim - 1, ceil(c(beta_slow)))`` with ``c(b) = rope_dim *
  ln(original_context / (2 pi b)) / (2 ln base)``; cos and sin are scaled by
  :meth:`magnitude` (llama.cpp's net ``attn_factor * mscale``: ``1 + 0.1 ln factor``).

  Attributes:
    factor: ``rope.scaling.factor`` (> 0; llama.cpp's ``freq_scale = 1 / factor``).
    original_context: ``rope.scaling.original_context_length`` (llama.cpp's
      ``n_ctx_orig_yarn``; the training context where the file lacks it).
    beta_fast, beta_slow: the ramp's ends in rotations (llama.cpp's defaults 32 and 1).
    ext_factor: the blend's weight (llama.cpp: 1 under YaRN unless set; 0 is linear
      interpolation with no magnitude scaling).
    attn_factor: ``rope.scaling.attn_factor`` (llama.cpp's ``rope_attn_factor``), a
      further factor on cos and sin.
    truncate: the correction dims rounded outwards (ggml's floor / ceil, transformers'
      ``truncate: true``, both defaults); False keeps them fractional (transformers'
      ``truncate: false``, GPT-OSS's config.json, as OpenAI's reference implementation).
  """
  factor: float
  original_context: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  ext_factor: float = 1.0
  attn_factor: float = 1.0
  truncate: bool = True

  def __post_init__(self):
    if not (self.factor > 0 and self.original_context > 0):
      raise ValueError(f"YaRN factor={self.factor} and original_context="
                       f"{self.original_context} must be positive")

  def corr_dims(self, base: float, rope_dim: int) -> tuple[float, float]:
    """``(low, high)``: ggml_rope_yarn_corr_dims (in float32, as ggml); without
    ``truncate``, transformers' ``find_correction_range(..., truncate=False)`` (float64,
    not rounded)."""
    if not self.truncate:
      def exact(beta):
        return rope_dim * np.log(self.original_context / (beta * 2 * np.pi)) / (
            2 * np.log(base))
      return (max(0.0, float(exact(self.beta_fast))),
              min(float(rope_dim - 1), float(exact(self.beta_slow))))

    def dim(beta):
      f32 = np.float32
      return f32(rope_dim) * np.log(f32(self.original_context) / (f32(beta) * f32(2 * np.pi))
                                    ) / (f32(2) * np.log(f32(base)))
    low = max(0.0, float(np.floor(dim(self.beta_fast))))
    high = min(float(rope_dim - 1), float(np.ceil(dim(self.beta_slow))))
    return low, high

  def freq_factors(self, base: float, rope_dim: int) -> np.ndarray:
    """``[rope_dim // 2]`` float64: the divisor of each pair's frequency that gives
    ``rope_yarn``'s blended angle ``theta * ((1 - mix_i) / factor + mix_i)``."""
    low, high = self.corr_dims(base, rope_dim)
    i = np.arange(rope_dim // 2, dtype=np.float64)
    ramp = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)
    mix = ramp * self.ext_factor
    return 1 / ((1 - mix) / self.factor + mix)

  def magnitude(self) -> float:
    """The factor on cos and sin: llama.cpp's ``attn_factor`` times ``rope_yarn``'s
    ``mscale`` (``get_mscale(factor) = 1 + 0.1 ln factor`` above factor 1, else 1, where
    ext_factor != 0; since llama.cpp PR 17945 the context's attn_factor cancels
    rope_yarn's own ``1 + 0.1 ln(1 / freq_scale)``, with the same product)."""
    if self.ext_factor == 0:
      return self.attn_factor
    return (1 + 0.1 * np.log(self.factor) if self.factor > 1 else 1.0) * self.attn_factor


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyperparameters (from GGUF metadata) and run options.

  Attributes:
    vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ffn_size:
      the model's shapes.
    rope_base: RoPE frequency base (``llama.rope.freq_base``).
    rope_dim: leading dims of each head RoPE rotates (``llama.rope.dimension_count``).
    rms_eps: RMSNorm epsilon.
    context_length: the longest sequence the model was trained for.
    dtype: activation and KV-cache dtype (float32 on CPU, bfloat16 on GPU).
    implementation: the ``qjax.matmul`` implementation (None: best available; "pallas"
      and "interpret" apply to the weights whose format has a kernel, the rest run XLA).
    scan_layers: run the blocks with ``lax.scan`` over stacked params (True), or as an
      unrolled loop over per-layer submodules ``layers_{i}`` (False; longer compile, but
      no scan). The params layout must match (see :func:`params_from_gguf`).
    rope_neox: RoPE pairs ``(i, i + rope_dim / 2)`` of each head (llama.cpp's NEOX type,
      Qwen2 / Qwen3) instead of adjacent pairs ``(2i, 2i + 1)`` (NORM type, llama).
    qkv_bias: q, k and v add a bias (param "bias" ``[features]`` next to "kernel";
      Qwen2), in float32 after the matmul.
    qk_norm: each head of q and k goes through an RMSNorm (params ``attn/q_norm`` and
      ``attn/k_norm``, scale ``[head_dim]``, epsilon ``rms_eps``) before RoPE (Qwen3).
    num_experts: E, the experts of each block's MoE FFN (``{arch}.expert_count``); 0 (the
      default) for a dense model, whose blocks run :class:`MLP`. With experts every block
      runs :class:`MoE` instead (params ``moe/router`` float32 ``[hidden, E]``, ``moe/gate``
      and ``moe/up`` expert stacks of per-expert shape ``(hidden, expert_ffn_size)``,
      ``moe/down`` of ``(expert_ffn_size, hidden)``) and ``ffn_size`` is not used.
    experts_per_token: k, the experts each token is routed to (``{arch}.expert_used_count``),
      in ``[1, num_experts]``; 0 without experts.
    expert_ffn_size: F, each expert's hidden width (Qwen3-MoE:
      ``{arch}.expert_feed_forward_length``; Mixtral's experts are ``feed_forward_length``
      wide); None (the default) is ``ffn_size``. None without experts.
    o_bias: the output projection adds a bias (param ``attn/o/bias`` ``[hidden]``; GPT-OSS).
    attn_sinks: each head's softmax has one more logit, ``attn/sinks[h]`` (``[num_heads]``
      float, GGUF ``attn_sinks``), in its denominator and no value (GPT-OSS; llama.cpp's
      ``ggml_soft_max_add_sinks``).
    sliding_window: W > 0: the layers ``sliding_layers`` marks attend to the keys of the
      last W positions only (query ``p`` sees key ``s`` where ``p - W < s <= p``;
      llama.cpp's LLAMA_SWA_TYPE_STANDARD); 0 (the default): full causal attention.
    sliding_layers: one bool per layer, True where the layer slides (with a window; empty
      otherwise).
    yarn: :class:`YarnScaling` of RoPE, or None (unscaled).
    moe_bias: the router adds a bias ``moe/router_bias [E]`` and the experts theirs
      (``moe/gate_bias``, ``moe/up_bias`` ``[E, F]``, ``moe/down_bias`` ``[E, hidden]``)
      after their products (GPT-OSS).
    expert_activation: "swiglu" (``silu(gate) * up``) or "gpt_oss" (GPT-OSS's clamped
      SwiGLU, :func:`flax_layers.moe.gated_activation`).
    ffn_norm_name: the GGUF name of the FFN's pre-norm (param ``ffn_norm``): "ffn_norm",
      or GPT-OSS's "post_attention_norm" (llama.cpp's ``attn_post_norm``, the norm after
      the attention's residual add, before the MoE).
    defer_norm: the RMSNorms before q / k / v, gate / up and the head hand their matmul
      ``x * scale`` and multiply its output rows by ``1 / rms(x)`` (the same product up to
      rounding, :class:`RMSNorm`'s ``deferred``): on a GPU XLA then computes the norm's
      two parts in one kernel with the residual add, where the normalized ``x`` took a
      kernel of its own before each matmul. Applies only where ``dtype`` is bfloat16 or
      float32 (float16's range could overflow on the unnormalized rows); False: the
      normalized ``x`` into the matmul, as llama.cpp orders it.
  """
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_size: int
  rope_base: float = 10000.0
  rope_dim: int | None = None
  rms_eps: float = 1e-5
  context_length: int = 2048
  dtype: Any = jnp.float32
  implementation: str | None = None
  scan_layers: bool = True
  rope_neox: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  num_experts: int = 0
  experts_per_token: int = 0
  expert_ffn_size: int | None = None
  o_bias: bool = False
  attn_sinks: bool = False
  sliding_window: int = 0
  sliding_layers: tuple[bool, ...] = ()
  yarn: YarnScaling | None = None
  moe_bias: bool = False
  expert_activation: str = "swiglu"
  ffn_norm_name: str = "ffn_norm"
  defer_norm: bool = True

  def __post_init__(self):
    sizes = {k: getattr(self, k) for k in ("vocab_size", "hidden_size", "num_layers",
                                           "num_heads", "num_kv_heads", "head_dim",
                                           "ffn_size")}
    bad = {k: v for k, v in sizes.items() if not (isinstance(v, (int, np.integer)) and v >= 1)}
    if bad:
      raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in bad.items())}: the model's "
                       "shapes must be positive ints")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    rd = self.head_dim if self.rope_dim is None else self.rope_dim
    if rd % 2 or rd > self.head_dim:
      raise ValueError(f"rope_dim={rd} must be even and at most head_dim={self.head_dim}")
    object.__setattr__(self, "rope_dim", rd)
    self._check_numbers()
    self._check_experts()
    self._check_window()

  def _check_numbers(self) -> None:
    """Validates rope_base, rms_eps, context_length and dtype (bad values gave NaN logits
    or an error about x's dtype deep in a matmul)."""
    base, eps, ctx = self.rope_base, self.rms_eps, self.context_length
    if not (isinstance(base, (int, float, np.number)) and 0 < base < float("inf")):
      raise ValueError(f"rope_base={base!r} must be a positive finite number (e.g. 10000.0)")
    if not (isinstance(eps, (int, float, np.number)) and 0 <= eps < float("inf")):
      raise ValueError(f"rms_eps={eps!r} must be a finite number >= 0 (e.g. 1e-5)")
    if not (isinstance(ctx, (int, np.integer)) and ctx >= 1):
      raise ValueError(f"context_length={ctx!r} must be a positive int")
    try:
      floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise ValueError(f"dtype={self.dtype!r} must be a float dtype (activations and KV "
                       "cache): float32, bfloat16 or float16")

  def _check_window(self) -> None:
    """Validates ``sliding_window`` / ``sliding_layers`` (stored as a tuple of bools)."""
    w, layers = self.sliding_window, tuple(bool(b) for b in self.sliding_layers)
    if not (isinstance(w, (int, np.integer)) and w >= 0):
      raise ValueError(f"sliding_window={w!r} must be an int >= 0 (0: no window)")
    if w and len(layers) != self.num_layers:
      raise ValueError(f"sliding_layers has {len(layers)} entries; a sliding_window={w} "
                       f"needs one bool per layer ({self.num_layers})")
    if not w and any(layers):
      raise ValueError("sliding_layers marks layers that slide, but sliding_window=0; set "
                       "the window")
    object.__setattr__(self, "sliding_layers", layers if w else ())

  def _check_experts(self) -> None:
    """Validates the MoE fields and resolves ``expert_ffn_size`` (None: ffn_size)."""
    e, k, f = self.num_experts, self.experts_per_token, self.expert_ffn_size
    if not (isinstance(e, (int, np.integer)) and e >= 0):
      raise ValueError(f"num_experts={e!r} must be an int >= 0 (0: a dense model)")
    if self.expert_activation not in moe_layers.ACTIVATIONS:
      raise ValueError(f"expert_activation={self.expert_activation!r} must be one of "
                       f"{moe_layers.ACTIVATIONS}")
    if e == 0 and (self.moe_bias or self.expert_activation != "swiglu"):
      raise ValueError(f"moe_bias={self.moe_bias}, expert_activation="
                       f"{self.expert_activation!r} without experts (num_experts=0); set "
                       "num_experts for an MoE model")
    if e == 0:
      if k or f is not None:
        raise ValueError(f"experts_per_token={k!r}, expert_ffn_size={f!r} without experts "
                         "(num_experts=0); set num_experts for an MoE model")
      return
    if not (isinstance(k, (int, np.integer)) and 1 <= k <= e):
      raise ValueError(f"experts_per_token={k!r} must be an int in [1, num_experts={e}]")
    f = self.ffn_size if f is None else f
    if not (isinstance(f, (int, np.integer)) and f >= 1):
      raise ValueError(f"expert_ffn_size={f!r} must be a positive int")
    object.__setattr__(self, "expert_ffn_size", int(f))

  @property
  def norm_deferred(self) -> bool:
    """Whether the pre-matmul RMSNorms run deferred (``defer_norm``, and ``dtype``
    bfloat16 or float32)."""
    return self.defer_norm and jnp.dtype(self.dtype) in (jnp.dtype(jnp.bfloat16),
                                                          jnp.dtype(jnp.float32))

  @property
  def moe(self) -> bool:
    """Whether the blocks' FFN is a mixture of experts (:class:`MoE`)."""
    return self.num_experts > 0

  @classmethod
  def from_metadata(cls, metadata: dict[str, Any], **options: Any) -> "LlamaConfig":
    """The config of a GGUF file's metadata (keys ``{arch}.*`` of ``general.architecture``,
    one of :data:`SUPPORTED_ARCHITECTURES`, whose :data:`ARCHITECTURE_OPTIONS` set
    rope_neox / qkv_bias / qk_norm); ``options`` sets dtype / implementation /
    scan_layers.

    Experts (:func:`_expert_options`): ``{arch}.expert_count`` (required > 0 for
    ``qwen3moe``; a ``llama`` file with it > 0 is Mixtral), ``{arch}.expert_used_count``
    and the experts' width (qwen3moe: ``expert_feed_forward_length``, else llama.cpp's
    ``feed_forward_length / expert_used_count``; llama: ``feed_forward_length``).

    ``gpt-oss`` (GPT-OSS, llama.cpp's LLM_ARCH_OPENAI_MOE) also reads YaRN RoPE scaling
    (:func:`_yarn_scaling`) and its alternating sliding window (:func:`_sliding_window`).

    Raises ValueError, naming the key, for what the model cannot run: another
    architecture, RoPE scaling (other than gpt-oss's YaRN), a value head size other than
    the key head size, a sliding window shorter than the context (other than gpt-oss's),
    non-causal attention; and of MoE models shared experts, a gating function other than
    the architecture's, expert weights that are scaled or (qwen3moe, Mixtral) not
    renormalized, leading dense layers."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"general.architecture={arch!r} is not supported; qjax runs "
                       f"{SUPPORTED_ARCHITECTURES}")

    def get(key, default=None):
      v = metadata.get(f"{arch}.{key}", default)
      if v is None:
        raise ValueError(f"the GGUF metadata lacks {arch}.{key}")
      return v

    yarn = _yarn_scaling(metadata, arch)
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    if f"{arch}.attention.key_length" not in metadata and heads and hidden % heads:
      raise ValueError(f"{arch}.embedding_length={hidden} is not a multiple of "
                       f"{arch}.attention.head_count={heads}, and the metadata lacks "
                       f"{arch}.attention.key_length to give the head size")
    vocab = metadata.get(f"{arch}.vocab_size")
    if vocab is None:
      vocab = len(metadata.get("tokenizer.ggml.tokens") or []) or None
    if vocab is None:
      raise ValueError(f"the GGUF metadata has neither {arch}.vocab_size nor tokenizer tokens")
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // max(heads, 1)))
    value_dim = int(metadata.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
      raise ValueError(f"{arch}.attention.value_length={value_dim} differs from the key "
                       f"length {head_dim}; qjax runs equal key and value head sizes")
    context = int(get("context_length", 2048))
    layers = int(get("block_count"))
    window = _sliding_window(metadata, arch, layers, context)
    if not metadata.get(f"{arch}.attention.causal", True):
      raise ValueError(f"{arch}.attention.causal=False (an embedding model) is not "
                       "supported; qjax runs causal attention")
    experts = _expert_options(metadata, arch)
    # An MoE file may lack the dense width, which its blocks do not use: the experts'.
    ffn = int(get("feed_forward_length", experts.get("expert_ffn_size")))
    rope_base = float(get("rope.freq_base", 10000.0))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if arch == "gpt-oss" and rope_dim != head_dim:  # its graph reshapes q / k by n_rot
      raise ValueError(f"{arch}.rope.dimension_count={rope_dim} differs from the head size "
                       f"{head_dim}; llama.cpp's gpt-oss graph rotates whole heads")
    swa_base = metadata.get(f"{arch}.rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != rope_base:
      raise ValueError(f"{arch}.rope.freq_base_swa={swa_base} differs from "
                       f"{arch}.rope.freq_base={rope_base}; qjax runs one RoPE base in all "
                       "layers")
    return cls(
        vocab_size=int(vocab), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim, ffn_size=ffn, rope_base=rope_base, rope_dim=rope_dim,
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        context_length=context, yarn=yarn, **window,
        **{**ARCHITECTURE_OPTIONS[arch], **experts, **options})

  @classmethod
  def from_hf_config(cls, config: dict[str, Any], **options: Any) -> "LlamaConfig":
    """The config of a Hugging Face ``config.json`` (a dict) of a Llama-family model
    (``model_type`` one of :data:`SUPPORTED_HF_MODEL_TYPES`, run with the
    :data:`ARCHITECTURE_OPTIONS` of :data:`HF_MODEL_ARCHITECTURES`' architecture);
    ``options`` sets dtype / implementation / scan_layers.

    Reads hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, intermediate_size, rope_theta (or rope_parameters.rope_theta),
    rms_norm_eps, vocab_size and max_position_embeddings. Where absent (or null):
    num_key_value_heads = num_attention_heads, head_dim = hidden_size //
    num_attention_heads (qwen3: 128, Qwen3Config's default), rope_theta 10000 (gpt_oss:
    150000), rms_norm_eps 1e-6, max_position_embeddings 2048 (qwen2 / qwen3 /
    qwen3_moe: 32768; mixtral, gpt_oss: 131072 as their configs); the others are
    required. RoPE rotates the whole head (no partial rotary).

    qwen2 (Qwen2, Qwen2.5) adds q / k / v biases (always, as transformers'
    Qwen2Attention; attention_bias / mlp_bias are not read); qwen3 normalizes each q / k
    head (q_norm / k_norm) and has no bias (attention_bias=true would add one to o_proj
    too: refused). Both rotate ``(i, i + head_dim / 2)`` (rotate_half: ``rope_neox``).
    Their sliding window applies only with use_sliding_window=true, to the layers from
    max_window_layers on (default 28) or those layer_types marks "sliding_attention".

    Mixtures of experts (:func:`_hf_expert_options`): mixtral (Llama's attention;
    num_local_experts of intermediate_size), qwen3_moe (Qwen3's attention;
    num_experts of moe_intermediate_size, routed in every layer), gpt_oss (GPT-OSS:
    :func:`_hf_gpt_oss_options` reads its layer_types / sliding_window and YaRN).

    Llama 3.1 / 3.2's llama3 rope_scaling is accepted; its factors are params
    (:func:`hf_rope_freqs`, which ``load_hf_llama`` puts in ``rope_freqs``).

    Raises ValueError, naming the key, for what the model cannot run: another
    model_type, rope scaling other than llama3 (gpt_oss: YaRN), attention or MLP biases
    qjax has no place for, an activation other than SiLU, a sliding window shorter than
    max_position_embeddings on some layer (but GPT-OSS's), an MoE it does not
    implement (:func:`_hf_expert_options`).
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_HF_MODEL_TYPES:
      raise ValueError(f"config.json model_type={model_type!r} is not supported; qjax runs "
                       f"{SUPPORTED_HF_MODEL_TYPES}")
    arch = HF_MODEL_ARCHITECTURES[model_type]

    def get(key, default=None):
      v = config.get(key, default)
      if v is None:
        raise ValueError(f"config.json lacks {key!r}, which a {model_type} model needs")
      return v

    def optional(key, default):  # absent or null: the default
      v = config.get(key)
      return default if v is None else v

    rope = config.get("rope_parameters") or {}
    _hf_rope_scaling(config, model_type)  # refuses what hf_rope_freqs cannot give
    _check_hf_biases(config, model_type, arch)
    act = config.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
    layers = int(get("num_hidden_layers"))
    context = int(optional("max_position_embeddings", _HF_DEFAULT_CONTEXT.get(
        model_type, 2048 if arch == "llama" else 32768)))
    extra: dict[str, Any] = {}
    if arch == "gpt-oss":
      extra = _hf_gpt_oss_options(config, layers, context)
    elif arch == "llama":
      if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        raise ValueError(f"config.json sliding_window={config['sliding_window']} is not "
                         "supported (full attention only)")
    else:
      _check_qwen_sliding_window(config, layers, context)
    experts = _hf_expert_options(config, model_type, layers)
    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    default_head_dim = 128 if arch == "qwen3" else None
    if not config.get("head_dim") and default_head_dim is None and heads and hidden % heads:
      raise ValueError(f"config.json hidden_size={hidden} is not a multiple of "
                       f"num_attention_heads={heads}, and it lacks 'head_dim'")
    head_dim = int(config.get("head_dim") or default_head_dim or hidden // max(heads, 1))
    theta = optional("rope_theta", rope.get("rope_theta") or (
        150000.0 if arch == "gpt-oss" else 10000.0))
    # An MoE config may lack the dense width, which its blocks do not use: the experts'.
    ffn = int(optional("intermediate_size", experts.get("expert_ffn_size")) or 0)
    if not ffn:
      get("intermediate_size")  # raises: a dense model needs it
    return cls(
        vocab_size=int(get("vocab_size")), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim, ffn_size=ffn, rope_base=float(theta),
        rope_dim=head_dim, rms_eps=float(optional("rms_norm_eps", 1e-6)),
        context_length=context, **extra,
        **{**ARCHITECTURE_OPTIONS[arch], **experts, **options})


# Architectures whose every block is an MoE FFN (``{arch}.expert_count`` required).
MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss")
# llama.cpp's YaRN defaults where the file does not set them (llama_hparams).
_YARN_DEFAULTS = {"rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
                  "rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_attn_factor": 1.0,
                  "rope.scaling.yarn_log_multiplier": 0.0}


def _yarn_scaling(metadata: dict[str, Any], arch: str) -> YarnScaling | None:
  """The :class:`YarnScaling` of a GGUF file's ``{arch}.rope.scaling.*`` keys; None for
  unscaled RoPE.

  YaRN is read for ``gpt-oss`` (what llama.cpp's converter writes for GPT-OSS: type
  "yarn", ``factor``, ``original_context_length``; ``attn_factor`` where present). Its
  llama.cpp defaults (beta_fast 32, beta_slow 1, ext_factor 1, no log multiplier) are what
  qjax runs: llama.cpp's gpt-oss loader reads no ``yarn_*`` key, so a file giving one
  another value is refused.

  Raises:
    ValueError: naming the key, for another scaling type (or YaRN on another
      architecture), a factor other than 1 without YaRN (llama.cpp scales the positions
      by it whatever the type), a ``yarn_*`` key off its default.
  """
  scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
  if scaling == "yarn" and arch == "gpt-oss":
    factor = float(metadata.get(f"{arch}.rope.scaling.factor") or 0.0)
    if factor <= 0:
      raise ValueError(f"{arch}.rope.scaling.type='yarn' needs {arch}.rope.scaling.factor > 0"
                       f"; the file gives {metadata.get(f'{arch}.rope.scaling.factor')!r}")
    for key, default in _YARN_DEFAULTS.items():
      v = metadata.get(f"{arch}.{key}")
      if v is not None and float(v) != default:
        raise ValueError(f"{arch}.{key}={v} is not supported; qjax runs llama.cpp's YaRN "
                         f"default {default} (its gpt-oss loader reads no such key)")
    orig = metadata.get(f"{arch}.rope.scaling.original_context_length")
    orig = metadata.get(f"{arch}.context_length") if orig in (None, 0) else orig
    return YarnScaling(factor=factor, original_context=int(orig),
                       attn_factor=float(metadata.get(f"{arch}.rope.scaling.attn_factor",
                                                      1.0)))
  if scaling not in ("none", None):
    only = "'yarn' on gpt-oss" if scaling == "yarn" else "only 'none'"
    raise ValueError(f"{arch}.rope.scaling.type={scaling!r} is not supported ({only})")
  # llama.cpp scales the positions by 1 / factor whatever the type (0 means unset).
  for key in ("rope.scaling.factor", "rope.scale_linear"):
    factor = metadata.get(f"{arch}.{key}")
    if factor is not None and float(factor) not in (0.0, 1.0):
      raise ValueError(f"{arch}.{key}={factor} is not supported (only unscaled RoPE)")
  return None


def _sliding_window(metadata: dict[str, Any], arch: str, layers: int,
                    context: int) -> dict[str, Any]:
  """The ``sliding_window`` / ``sliding_layers`` fields of :class:`LlamaConfig` of a GGUF
  file's ``{arch}.attention.sliding_window`` (W) and ``sliding_window_pattern``; ``{}``
  for full attention.

  gpt-oss (llama.cpp's ``load_arch_hparams`` of LLM_ARCH_OPENAI_MOE): W is required; the
  pattern is a period n (default 2: ``set_swa_pattern``, layer ``i`` slides where ``n ==
  0 or i % n < n - 1``, i.e. layers 0, 2, 4, ...) or one bool per layer. Other
  architectures: a window shorter than the context on some layer is refused.
  """
  window = metadata.get(f"{arch}.attention.sliding_window")
  pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
  if arch == "gpt-oss":
    if window is None or int(window) <= 0:
      raise ValueError(f"{arch}.attention.sliding_window={window!r}: a gpt-oss model's "
                       "sliding layers need a positive window")
    if pattern is None or np.ndim(pattern) == 0:
      n = 2 if pattern is None else int(pattern)
      slides = tuple(n == 0 or i % n < n - 1 for i in range(layers))
    else:
      slides = tuple(bool(b) for b in np.asarray(pattern).reshape(-1))
      if len(slides) != layers:
        raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(slides)} "
                         f"entries; the model has {arch}.block_count={layers} layers")
    if not any(slides):
      return {}
    return dict(sliding_window=int(window), sliding_layers=slides)
  # sliding_window_pattern: one bool per layer (True: that layer slides); none set is
  # full attention everywhere, as is a window that covers the whole context.
  no_layer = pattern is not None and np.ndim(pattern) == 1 and not np.any(pattern)
  if window is not None and 0 < int(window) < context and not no_layer:
    raise ValueError(f"{arch}.attention.sliding_window={window} (shorter than the context "
                     f"{context}) is not supported; qjax runs full causal attention")
  return {}
# llama.cpp's llama_expert_gating_func_type (``{arch}.expert_gating_func``).
_GATING_FUNCS = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def _expert_options(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
  """The MoE fields of :class:`LlamaConfig` (``num_experts``, ``experts_per_token``,
  ``expert_ffn_size``) of a GGUF file's metadata; ``{}`` for a dense model.

  What is read is what llama.cpp's ``build_moe_ffn`` runs for qwen3moe and llama
  (Mixtral): softmax over all experts, the top k, their weights renormalized, no scale;
  for gpt-oss: the top k logits, a softmax over them (``expert_gating_func`` 3), no scale.

  Raises:
    ValueError: naming the key and its value, for an MoE the model does not implement:
      shared experts (``expert_shared_count`` > 0), ``expert_gating_func`` other than
      softmax (1), ``expert_weights_scale`` other than 1, ``expert_weights_norm`` false,
      leading dense layers (``leading_dense_block_count`` > 0); a qwen3moe file without
      experts; ``expert_used_count`` missing or outside ``[1, expert_count]``.
  """
  def value(key):
    return metadata.get(f"{arch}.{key}")

  count = int(value("expert_count") or 0)
  if count <= 0:
    if arch in MOE_ARCHITECTURES:
      raise ValueError(f"{arch}.expert_count={value('expert_count')!r}: a {arch} model has "
                       "experts; the file's metadata does not say how many")
    return {}
  shared = value("expert_shared_count")
  if shared is not None and int(shared) > 0:
    raise ValueError(f"{arch}.expert_shared_count={shared} is not supported: qjax's MoE "
                     "blocks have routed experts only, no shared expert")
  # gpt-oss: llama.cpp's graph routes with SOFTMAX_WEIGHT (3: top k of the logits, a
  # softmax over those k), whose weights sum to 1 whether or not they are renormalized.
  want_gating = 3 if arch == "gpt-oss" else 1
  gating = value("expert_gating_func")
  if gating is not None and int(gating) != want_gating:
    raise ValueError(f"{arch}.expert_gating_func={gating} "
                     f"({_GATING_FUNCS.get(int(gating), 'unknown')}) is not supported; "
                     f"qjax's {'gpt-oss ' if arch == 'gpt-oss' else ''}MoE routes with "
                     f"{_GATING_FUNCS[want_gating]} "
                     f"({want_gating})")
  scale = value("expert_weights_scale")
  if scale is not None and float(scale) not in ((0.0, 1.0) if arch == "gpt-oss" else (1.0,)):
    raise ValueError(f"{arch}.expert_weights_scale={scale} is not supported; qjax's MoE "
                     "weighs the selected experts by their renormalized probabilities "
                     "(scale 1)")
  norm = value("expert_weights_norm")
  if norm is not None and not norm and arch != "gpt-oss":
    raise ValueError(f"{arch}.expert_weights_norm={norm} is not supported; qjax's MoE "
                     "renormalizes the selected experts' weights to sum 1")
  dense = value("leading_dense_block_count")
  if dense is not None and int(dense) > 0:
    raise ValueError(f"{arch}.leading_dense_block_count={dense} is not supported; qjax's "
                     "MoE models have experts in every block")
  used = value("expert_used_count")
  if used is None or not 1 <= int(used) <= count:
    raise ValueError(f"{arch}.expert_used_count={used!r} must be in [1, {arch}.expert_count="
                     f"{count}]: the experts each token is routed to")
  used = int(used)
  if arch == "llama":  # Mixtral: llama.cpp's n_ff_exp is n_ff
    width = value("feed_forward_length")
  else:  # llama.cpp's qwen3moe: n_ff_exp, else n_ff / n_expert_used; gpt-oss: n_ff_exp
    width = value("expert_feed_forward_length")
    if width is None and value("feed_forward_length") is not None and arch != "gpt-oss":
      width = int(value("feed_forward_length")) // used
  if width is None:
    raise ValueError(f"the GGUF metadata lacks {arch}."
                     f"{'feed_forward_length' if arch == 'llama' else 'expert_feed_forward_length'}"
                     ", the experts' hidden width")
  return dict(num_experts=count, experts_per_token=used, expert_ffn_size=int(width))


# max_position_embeddings where config.json lacks it: the transformers config's default.
_HF_DEFAULT_CONTEXT = {"mixtral": 131072, "gpt_oss": 131072}
# GPT-OSS's YaRN where config.json names none: GptOssConfig's default rope_parameters.
_GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
# GPT-OSS's clamped SwiGLU as flax_layers.moe.gated_activation runs it.
_GPT_OSS_SWIGLU = {"swiglu_limit": moe_layers.GPT_OSS_LIMIT,
                   "swiglu_alpha": moe_layers.GPT_OSS_ALPHA}


def _check_hf_biases(config: dict[str, Any], model_type: str, arch: str) -> None:
  """A ValueError naming the key where ``config.json`` asks for projection biases the
  model does not add, or (gpt_oss) leaves out the attention biases it always adds."""
  if arch == "gpt-oss":
    if not config.get("attention_bias", True):
      raise ValueError("config.json attention_bias=false is not supported for gpt_oss "
                       "(qjax's GPT-OSS adds q / k / v / o biases)")
    return
  if arch == "llama":
    bias_keys = ("attention_bias", "mlp_bias")
  else:  # transformers' Qwen2 / Qwen3 MLPs have no bias whatever mlp_bias says
    bias_keys = ("attention_bias",) if arch in ("qwen3", "qwen3moe") else ()
  for key in bias_keys:
    if config.get(key):
      extra = (f" ({model_type}'s attention_bias adds an o_proj bias, which qjax's model "
               "lacks)" if arch != "llama" else "")
      raise ValueError(f"config.json {key}=true is not supported (projections without "
                       f"bias only){extra}")


def _hf_yarn(config: dict[str, Any]) -> YarnScaling | None:
  """The :class:`YarnScaling` of a gpt_oss ``config.json``'s ``rope_scaling`` (or
  ``rope_parameters``) of rope_type "yarn" (GPT-OSS's default where it names none), as
  transformers' ``_compute_yarn_parameters`` runs it: ``factor`` (else
  max_position_embeddings / original_max_position_embeddings), ``beta_fast`` /
  ``beta_slow`` (32 / 1 where absent), ``truncate`` (default true); cos and sin scaled
  by ``1 + 0.1 ln factor``. None for rope_type "default".

  Raises:
    ValueError: naming the key, for ``attention_factor`` / ``mscale`` /
      ``mscale_all_dim`` (another magnitude), a missing original context, a factor <= 0.
  """
  scaling = config.get("rope_scaling") or config.get("rope_parameters") or _GPT_OSS_YARN
  if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
    return None
  key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
  for name in ("attention_factor", "mscale", "mscale_all_dim"):
    if scaling.get(name) is not None:
      raise ValueError(f"config.json {key}.{name}={scaling[name]!r} is not supported; "
                       "qjax's YaRN scales cos and sin by 1 + 0.1 ln factor")
  orig = scaling.get("original_max_position_embeddings")
  if orig is None:
    raise ValueError(f"config.json {key} of rope_type 'yarn' lacks "
                     "original_max_position_embeddings")
  factor = scaling.get("factor")
  if factor is None:
    factor = float(config.get("max_position_embeddings") or 0) / float(orig)
  if float(factor) <= 0:
    raise ValueError(f"config.json {key}.factor={factor!r} must be > 0")
  return YarnScaling(factor=float(factor), original_context=int(orig),
                     beta_fast=float(scaling.get("beta_fast") or 32.0),
                     beta_slow=float(scaling.get("beta_slow") or 1.0),
                     truncate=bool(scaling.get("truncate", True)))


def _hf_gpt_oss_options(config: dict[str, Any], layers: int, context: int
                        ) -> dict[str, Any]:
  """The :class:`LlamaConfig` fields of a gpt_oss ``config.json`` beyond the shapes:
  ``yarn`` (:func:`_hf_yarn`) and the sliding window: ``sliding_window`` W on the layers
  ``layer_types`` marks "sliding_attention" (absent: GptOssConfig's default, the even
  layers), query ``p`` seeing keys ``p - W < s <= p`` (transformers'
  ``sliding_window_overlay``).

  Raises:
    ValueError: naming the key, for layer_types of another length or with another
      type, a window that is not a positive int, a swiglu_limit / swiglu_alpha other
      than GPT-OSS's 7.0 / 1.702.
  """
  for key, want in _GPT_OSS_SWIGLU.items():
    v = config.get(key)
    if v is not None and float(v) != want:
      raise ValueError(f"config.json {key}={v!r} is not supported; qjax's GPT-OSS experts "
                       f"run the clamped SwiGLU of {key.split('_')[1]} {want}")
  layer_types = config.get("layer_types")
  if layer_types is None:
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                   for i in range(layers)]
  if not isinstance(layer_types, list) or len(layer_types) != layers:
    raise ValueError(f"config.json layer_types must list one type per layer "
                     f"(num_hidden_layers={layers}); it has {layer_types!r:.80}")
  bad = [t for t in layer_types if t not in ("sliding_attention", "full_attention")]
  if bad:
    raise ValueError(f"config.json layer_types holds {bad[0]!r}; qjax runs "
                     "'sliding_attention' and 'full_attention' layers")
  slides = tuple(t == "sliding_attention" for t in layer_types)
  window = config.get("sliding_window")
  out: dict[str, Any] = {"yarn": _hf_yarn(config)}
  if not any(slides) or (window is not None and int(window) >= context):
    return out
  if not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
    raise ValueError(f"config.json sliding_window={window!r}: the sliding_attention "
                     "layers of layer_types need a positive int window")
  return {**out, "sliding_window": window, "sliding_layers": slides}


def _hf_expert_options(config: dict[str, Any], model_type: str, layers: int
                       ) -> dict[str, Any]:
  """The MoE fields of :class:`LlamaConfig` (``num_experts``, ``experts_per_token``,
  ``expert_ffn_size``) of a ``config.json``; ``{}`` for a dense model_type.

  What transformers runs for these: mixtral (``num_local_experts`` of
  ``intermediate_size``; softmax over all experts, the top k, renormalized) and qwen3_moe
  (``num_experts`` of ``moe_intermediate_size``; the same with ``norm_topk_prob``) as
  :class:`MoE`'s routing; gpt_oss (``num_local_experts`` of ``intermediate_size``; a
  softmax over the top k logits, which the architecture's options give).

  Raises:
    ValueError: naming the key, for what :class:`MoE` does not run: qwen3_moe with
      norm_topk_prob false, or with dense layers (``mlp_only_layers``, or
      ``decoder_sparse_step`` > 1); a missing expert count; num_experts_per_tok outside
      ``[1, experts]``.
  """
  if model_type not in ("mixtral", "qwen3_moe", "gpt_oss"):
    return {}
  count_key = "num_experts" if model_type == "qwen3_moe" else "num_local_experts"
  width_key = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
  for key in (count_key, width_key):
    if config.get(key) is None:
      raise ValueError(f"config.json lacks {key!r}, which a {model_type} model needs")
  count, width = int(config[count_key]), int(config[width_key])
  used = config.get("num_experts_per_tok", config.get("experts_per_token"))
  if used is None or not (count >= 1 and 1 <= int(used) <= count):
    raise ValueError(f"config.json num_experts_per_tok={used!r} must be in [1, "
                     f"{count_key}={count}]: the experts each token is routed to")
  if model_type == "qwen3_moe":
    if not config.get("norm_topk_prob", False):
      raise ValueError("config.json norm_topk_prob=false is not supported; qjax's MoE "
                       "renormalizes the selected experts' weights to sum 1")
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    dense = [i for i in range(layers) if i in dense_only or (i + 1) % step]
    if dense:
      raise ValueError(f"config.json mlp_only_layers={sorted(dense_only)} / "
                       f"decoder_sparse_step={step} make layer(s) "
                       f"{', '.join(map(str, dense[:4]))}{', ...' if len(dense) > 4 else ''} "
                       "dense; qjax's MoE models have experts in every layer")
  return dict(num_experts=count, experts_per_token=int(used), expert_ffn_size=width)


def _hf_rope_scaling(config: dict[str, Any], model_type: str) -> dict[str, Any] | None:
  """The llama3 ``rope_scaling`` (or transformers 5's ``rope_parameters``) of a
  ``config.json``, None where RoPE is unscaled or (gpt_oss) YaRN (:func:`_hf_yarn`); a
  ValueError naming the key for another rope_type, llama3 on a model_type other than
  llama, or YaRN on one other than gpt_oss."""
  rope = config.get("rope_parameters") or {}
  scaling = config.get("rope_scaling") or {}
  rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type")
  key = "rope_scaling" if scaling else "rope_parameters"
  if rope_type in (None, "default") or (rope_type == "yarn" and model_type == "gpt_oss"):
    return None
  if rope_type != "llama3" or model_type != "llama":
    raise ValueError(f"config.json {key} of rope_type {rope_type!r} is not supported "
                     f"for model_type {model_type!r} (unscaled RoPE, llama3 for llama, yarn "
                     "for gpt_oss)")
  params = scaling or rope
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings") if params.get(k) is None]
  if missing:
    raise ValueError(f"config.json {key} of rope_type 'llama3' lacks {', '.join(missing)}")
  return params


def hf_rope_freqs(config: dict[str, Any], cfg: LlamaConfig) -> np.ndarray | None:
  """The RoPE frequency divisors of a Hugging Face ``config.json`` as the params'
  ``rope_freqs`` (:class:`Llama`): :func:`llama3_rope_factors` of its llama3
  ``rope_scaling`` (Llama 3.1 / 3.2), None where RoPE is unscaled.

  Returns:
    ``[rope_dim // 2]`` float32, or None.

  Raises:
    ValueError: naming the key, for a scaling other than llama3 or llama3's missing keys.
  """
  params = _hf_rope_scaling(config, config.get("model_type"))
  if params is None:
    return None
  return llama3_rope_factors(
      cfg.rope_base, cfg.rope_dim, factor=float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_context=int(params["original_max_position_embeddings"]))


def _check_qwen_sliding_window(config: dict[str, Any], layers: int, context: int) -> None:
  """A ValueError naming the keys where a Qwen2 / Qwen3 ``config.json`` slides the window
  of some layer over less than the context. As transformers' Qwen2Config / Qwen3Config:
  the window is ``sliding_window`` only with ``use_sliding_window`` (default false), on
  the layers ``layer_types`` marks "sliding_attention" or, without layer_types, on layers
  ``i >= max_window_layers`` (default 28)."""
  window = config.get("sliding_window")
  if not config.get("use_sliding_window", False) or window is None or int(window) >= context:
    return
  layer_types = config.get("layer_types")
  if layer_types is not None:
    sliding = [i for i, t in enumerate(layer_types[:layers]) if t == "sliding_attention"]
    where = "layer_types marks layer(s)"
  else:
    first = config.get("max_window_layers")
    first = 28 if first is None else int(first)
    sliding = list(range(max(first, 0), layers))
    where = f"max_window_layers={first} of num_hidden_layers={layers} slides layer(s)"
  if sliding:
    raise ValueError(f"config.json use_sliding_window=true with sliding_window={window} "
                     f"(shorter than max_position_embeddings={context}) is not supported; "
                     f"{where} {', '.join(map(str, sliding[:4]))}"
                     f"{', ...' if len(sliding) > 4 else ''}; qjax runs full causal attention")


def matmul(x: jax.Array, w: Any, implementation: str | None) -> jax.Array:
  """``qjax.matmul``; a weight whose format has no kernel runs XLA even when
  ``implementation`` is "pallas" or "interpret" (e.g. a Q8_0 embedding used as the head).
  ``w`` may be a :class:`qjax.ShardedWeight` (tensor parallel, inside shard_map), a
  :class:`qjax.LayerOf` or both (a layer of a split stack)."""
  fmt = w.format_cls if isinstance(w, (qjax.ShardedWeight, qjax.LayerOf)) else type(w)
  if implementation in ("pallas", "interpret") and not dispatch.kernels_for_format(fmt):
    implementation = "xla"
  return qjax.matmul(x, w, implementation=implementation)


def _pretrained(rng, *args):
  """Init of every parameter: none. Weights come from :func:`params_from_gguf`."""
  del rng, args
  return None


def _check_embed(embed: Any, cfg: "LlamaConfig") -> None:
  """A ValueError where the embedding table's shape does not fit ``cfg`` (a table of
  another vocabulary gave logits of its own width, or NaN rows past its end)."""
  plain = isinstance(embed, (jax.Array, np.ndarray))  # stored as GGUF does: [vocab, hidden]
  want = (cfg.vocab_size, cfg.hidden_size) if plain else (cfg.hidden_size, cfg.vocab_size)
  if tuple(embed.shape) != want:
    raise ValueError(f"param 'embed' has shape {tuple(embed.shape)}, want {want} "
                     f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size} of the "
                     "config): the params and the config are of different models")


def check_tokens(tokens: Any, ndim: int, name: str = "tokens") -> None:
  """A ValueError unless ``tokens`` has ``ndim`` axes and an integer dtype (float ids
  were truncated silently; 1-D prompts failed with an IndexError)."""
  shape, dtype = jnp.shape(tokens), jnp.result_type(tokens)
  want = "[batch, seq]" if ndim == 2 else "[batch]"
  if len(shape) != ndim:
    raise ValueError(f"{name} of shape {tuple(shape)} must be {want}; a single sequence "
                     "is a batch of one (e.g. tokens[None])" if ndim == 2 else
                     f"{name} of shape {tuple(shape)} must be {want}, one id per sequence")
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name} of dtype {jnp.dtype(dtype).name} must be integer token ids "
                     "(int32)")


def _loaded_param(module: nn.Module, name: str):
  """``module``'s param ``name``; a ValueError naming both where it was not loaded (these
  modules have no random init: ``Module.init`` leaves every param None)."""
  value = module.param(name, _pretrained)
  if value is None:
    raise ValueError(f"{module.name or type(module).__name__}: param {name!r} must come "
                     "from params_from_gguf (or a checkpoint loader); these modules have "
                     "no random init")
  return value


class QuantizedDense(nn.Module):
  """``y = x @ W (+ b)`` with ``W`` (param "kernel") any quantized pytree of shape
  ``[K, features]`` and, when ``use_bias``, ``b`` (param "bias") ``[features]``.

  Attributes:
    features: N.
    implementation: the ``qjax.matmul`` implementation (None: best available).
    use_bias: add the bias, in float32 to the matmul's result, rounded once to x's
      dtype (llama.cpp adds its float32 bias to a float32 product).
  """
  features: int
  implementation: str | None = None
  use_bias: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, row_scale: jax.Array | None = None) -> jax.Array:
    """x: ``[..., K]`` -> ``[..., features]`` in x's dtype.

    ``row_scale``: optional ``[..., 1]`` float32 factor of each output row, applied in
    float32 to the matmul's result before the bias (a deferred :class:`RMSNorm`'s
    ``1 / rms(x)``).
    """
    w = _loaded_param(self, "kernel")
    if w.shape[1] != self.features:
      raise ValueError(f"{self.name}: kernel of shape {w.shape} has N={w.shape[1]}, "
                       f"want features={self.features}")
    y = matmul(x, w, self.implementation)
    if not self.use_bias and row_scale is None:
      return y
    y = y.astype(jnp.float32)
    if row_scale is not None:
      y = y * row_scale
    if self.use_bias:
      b = _loaded_param(self, "bias")
      if tuple(b.shape) != (self.features,):
        raise ValueError(f"{self.name}: bias of shape {tuple(b.shape)}, want "
                         f"({self.features},)")
      y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


class RMSNorm(nn.Module):
  """``x / rms(x) * scale`` computed in float32 (param "scale": ``[hidden]``).

  With ``deferred`` it returns the two factors for a matmul to apply apart, ``(x *
  scale`` in x's dtype, ``1 / rms(x)`` ``[..., 1]`` float32``)``: ``(x * scale) @ W``
  with its rows times ``1 / rms(x)`` is the normalized product up to rounding. Both parts
  read only ``x``, so XLA computes them in one kernel (with the residual add that makes
  ``x``), and the row factor joins the kernel that reads the matmul's output: the
  normalized ``x`` no longer takes a kernel of its own.
  """
  eps: float
  deferred: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array | tuple[jax.Array, jax.Array]:
    scale = _loaded_param(self, "scale")
    xf = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.deferred:
      return (xf * scale.astype(jnp.float32)).astype(x.dtype), inv_rms
    return (xf * inv_rms * scale.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, base: float, rope_dim: int, *,
               neox: bool = False, freq_factors: jax.Array | None = None,
               magnitude: float = 1.0) -> jax.Array:
  """Rotates the pairs of each head's first ``rope_dim`` dims by ``pos * base**(-2i/rope_dim)``
  (divided by ``freq_factors[i]`` where given), scaled by ``magnitude``.

  Pair ``i`` is ``(x[..., 2i], x[..., 2i+1])`` (llama.cpp's NORM type, llama), or with
  ``neox`` ``(x[..., i], x[..., i + rope_dim/2])`` (NEOX type, Qwen2 / Qwen3, HF's
  ``rotate_half``).

  Args:
    x: ``[batch, seq, heads, head_dim]``.
    positions: ``[batch, seq]`` int32.
    base: the frequency base.
    rope_dim: leading dims of each head to rotate (the rest pass through).
    neox: the pairing (see above).
    freq_factors: optional ``[rope_dim // 2]`` float, each pair's frequency divisor:
      llama3 RoPE scaling (Llama 3.1 / 3.2), as llama.cpp applies ``rope_freqs.weight``
      (see :func:`llama3_rope_factors`), and YaRN's blend
      (:meth:`YarnScaling.freq_factors`).
    magnitude: the factor on cos and sin of the rotated dims (YaRN's
      :meth:`YarnScaling.magnitude`; ggml's ``rope_yarn`` scales them, the rest pass as
      they are).

  Returns:
    ``[batch, seq, heads, head_dim]`` in x's dtype.

  Raises:
    ValueError: x not 4-D; positions not integer ``[batch, seq]`` (a batch of 1
      broadcasts); ``rope_dim`` not an even int in ``[2, head_dim]``; ``freq_factors`` not
      ``[rope_dim // 2]``.
  """
  _check_rope_args(x, positions, rope_dim, freq_factors)
  inv_freq = jnp.asarray(base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim),
                         jnp.float32)
  if freq_factors is not None:
    inv_freq = inv_freq / jnp.asarray(freq_factors, jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angles)[:, :, None, :] * magnitude  # [B, T, 1, rope_dim // 2]
  sin = jnp.sin(angles)[:, :, None, :] * magnitude
  rot, rest = x[..., :rope_dim].astype(jnp.float32), x[..., rope_dim:]
  if neox:
    x0, x1 = rot[..., :rope_dim // 2], rot[..., rope_dim // 2:]
    out = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  else:
    pairs = rot.reshape(*rot.shape[:-1], rope_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(rot.shape)
  out = out.astype(x.dtype)
  return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def _check_rope_args(x: Any, positions: Any, rope_dim: Any, freq_factors: Any) -> None:
  """apply_rope's arguments' shapes and dtypes (static: nothing runs on the device)."""
  if jnp.ndim(x) != 4:
    raise ValueError(f"x of shape {jnp.shape(x)} must be [batch, seq, heads, head_dim]")
  batch, seq, _, head_dim = jnp.shape(x)
  if (isinstance(rope_dim, bool) or not isinstance(rope_dim, (int, np.integer))
      or rope_dim % 2 or not 2 <= rope_dim <= head_dim):
    raise ValueError(f"rope_dim={rope_dim!r} must be an even int in [2, {head_dim}] (x's "
                     "head_dim)")
  shape = jnp.shape(positions)
  if (len(shape) != 2 or shape[0] not in (1, batch) or shape[1] != seq
      or not jnp.issubdtype(jnp.result_type(positions), jnp.integer)):
    raise ValueError(f"positions of shape {shape} and dtype {jnp.result_type(positions)} "
                     f"must be integer [batch, seq] = [{batch}, {seq}] (x's first two axes; "
                     "a batch of 1 broadcasts)")
  if freq_factors is not None and jnp.shape(freq_factors) != (rope_dim // 2,):
    raise ValueError(f"freq_factors of shape {jnp.shape(freq_factors)} must be "
                     f"[rope_dim // 2] = [{rope_dim // 2}], one divisor per rotated pair")


def attention_implementation(implementation: str | None, op: str = "decode") -> str | None:
  """The implementation of the attention operation ``op`` ("decode":
  :func:`qjax.decode_attention`, "causal": :func:`qjax.causal_attention`, "write":
  :func:`qjax.write_kv_cache`, "write_decode": :func:`qjax.write_and_decode_attention`)
  for the layers' ``implementation``: "pallas" /
  "interpret" run XLA where no kernel of ``op`` is registered (as :func:`matmul` does for
  a format without one; for "write_decode", where neither it nor "write" nor "decode" has
  one: :func:`qjax.write_and_decode_attention` runs those two apart where it has no
  kernel of its own)."""
  ops = ("write_decode", "write", "decode") if op == "write_decode" else (op,)
  if implementation in ("pallas", "interpret") and not any(attention.kernels(o) for o in ops):
    return "xla"
  return implementation


class Attention(nn.Module):
  """Grouped-query attention with RoPE that writes its keys and values into a KV cache;
  with ``cfg.attn_sinks`` each head's softmax also holds its sink logit (param ``sinks``
  ``[num_heads]``), which weighs no value.

  Attributes:
    cfg: the model's config.
    fresh_prompt: the tokens sit at positions ``0 .. seq - 1`` of every sequence
      (:func:`prefill`), so the slots they attend to are the ones they write: several
      queries then attend to the new keys and values themselves (``seq`` slots) instead
      of the layer's whole cache (``max_len``), the same result for less work and memory.
    contiguous: the tokens of each sequence sit at consecutive positions from
      ``positions[:, 0]`` (:func:`extend`): several queries then attend to the layer's
      cache through :func:`qjax.causal_attention` with that offset (a kernel keeps the
      ``[seq, max_len]`` scores in registers) instead of through the mask.
  """
  cfg: LlamaConfig
  fresh_prompt: bool = False
  contiguous: bool = False

  @nn.compact
  def __call__(self, x, positions, mask, k_cache, v_cache, layer, rope_freqs=None,
               window=None, row_scale=None):
    """One layer's attention, on the whole model's cache.

    Args:
      x: ``[batch, seq, hidden]``.
      positions: ``[batch, seq]`` int32, where each token's key and value are written.
      mask: ``[batch, seq, max_len]`` bool, the cache slots each query attends to.
      k_cache, v_cache: ``[layers, batch, max_len, kv_heads, head_dim]``, every layer's
        cache: this layer writes its keys and values into ``[layer, b, positions[b]]`` and
        reads ``[layer]`` (XLA updates the buffer in place, inside a scan's loop too).
      layer: this layer's index, an int or a scalar int32 array (the scan's counter).
      rope_freqs: optional ``[rope_dim // 2]`` RoPE frequency divisors (llama3 scaling,
        YaRN).
      window: with ``fresh_prompt`` or ``contiguous``, this layer's sliding window (None:
        none; an int or a scalar int32 array, e.g. chosen inside the scan over layers),
        which ``mask`` holds too: a kernel of :func:`qjax.causal_attention` computes the
        mask itself.
      row_scale: optional ``[batch, seq, 1]`` float32 factor of q / k / v's rows (a
        deferred :class:`RMSNorm`'s ``1 / rms``), applied after their matmuls.

    Returns:
      ``([batch, seq, hidden], k_cache, v_cache)``.
    """
    c = self.cfg
    b, t, _ = x.shape
    dense = functools.partial(QuantizedDense, implementation=c.implementation)
    qkv = functools.partial(dense, use_bias=c.qkv_bias)
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if self.has_variable("params", FUSED["attn"][0]):  # fuse_projections' one weight
      q, k, v = jnp.split(qkv(nq + 2 * nkv, name=FUSED["attn"][0])(x, row_scale),
                          [nq, nq + nkv], -1)
    else:
      q, k, v = (qkv(nq, name="q")(x, row_scale), qkv(nkv, name="k")(x, row_scale),
                 qkv(nkv, name="v")(x, row_scale))
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:  # over each head's head_dim
      q = RMSNorm(c.rms_eps, name="q_norm")(q)
      k = RMSNorm(c.rms_eps, name="k_norm")(k)
    rope = functools.partial(apply_rope, base=c.rope_base, rope_dim=c.rope_dim,
                             neox=c.rope_neox, freq_factors=rope_freqs,
                             magnitude=1.0 if c.yarn is None else c.yarn.magnitude())
    q, k = rope(q, positions), rope(k, positions)
    sinks = None
    if c.attn_sinks:  # one more logit per head in the softmax's denominator
      sinks = _loaded_param(self, "sinks")
      if tuple(sinks.shape) != (c.num_heads,):
        raise ValueError(f"{self.name}: sinks of shape {tuple(sinks.shape)}, want "
                         f"(num_heads={c.num_heads},)")
    if t == 1:  # decode: one kernel writes the new row and reads the layer's cache in place
      out, k_cache, v_cache = qjax.write_and_decode_attention(
          q[:, 0], k[:, 0], v[:, 0], k_cache, v_cache, positions[:, 0], mask[:, 0],
          layer=layer, sinks=sinks,
          implementation=attention_implementation(c.implementation, "write_decode"))
    else:
      out, k_cache, v_cache = self._write_and_attend(q, k, v, positions, mask, k_cache,
                                                     v_cache, layer, window, sinks)
    out = out.reshape(b, t, c.num_heads * c.head_dim)
    return dense(c.hidden_size, use_bias=c.o_bias, name="o")(out), k_cache, v_cache

  def _write_and_attend(self, q, k, v, positions, mask, k_cache, v_cache, layer, window,
                        sinks):
    """Several tokens a sequence: their keys and values written into the cache, then
    their queries attended (see :meth:`__call__`) -> ``(out [b, t, heads, d], k_cache,
    v_cache)``."""
    c = self.cfg
    # Positions outside the cache write nothing (one kernel writes both on the GPU).
    k_cache, v_cache = qjax.write_kv_cache(
        k_cache, v_cache, k, v, positions, layer=layer,
        implementation=attention_implementation(c.implementation, "write"))
    if self.fresh_prompt:  # positions 0 .. t - 1: causal over the prompt's own keys
      out = qjax.causal_attention(
          q, k.astype(k_cache.dtype), v.astype(v_cache.dtype), window=window, sinks=sinks,
          implementation=attention_implementation(c.implementation, "causal"))
      return out, k_cache, v_cache
    keys = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False)
    values = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False)
    if self.contiguous:  # positions p0 .. p0 + t - 1: causal over the cache from p0
      out = qjax.causal_attention(
          q, keys, values, offset=positions[:, 0], window=window, sinks=sinks,
          implementation=attention_implementation(c.implementation, "causal"))
    else:
      out = attention.attend(q, keys, values, mask, sinks, 1.0 / np.sqrt(c.head_dim))
    return out, k_cache, v_cache


class MLP(nn.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, row_scale=None):
    """x: ``[batch, seq, hidden]`` -> ``[batch, seq, hidden]``; ``row_scale``: optional
    ``[batch, seq, 1]`` float32 factor of gate / up's rows (a deferred :class:`RMSNorm`'s
    ``1 / rms``)."""
    c = self.cfg
    dense = functools.partial(QuantizedDense, implementation=c.implementation)
    if self.has_variable("params", FUSED["mlp"][0]):  # fuse_projections' one weight
      gate, up = jnp.split(dense(2 * c.ffn_size, name=FUSED["mlp"][0])(x, row_scale), 2, -1)
    else:
      gate, up = (dense(c.ffn_size, name="gate")(x, row_scale),
                  dense(c.ffn_size, name="up")(x, row_scale))
    h = jax.nn.silu(gate) * up
    return dense(c.hidden_size, name="down")(h)


def moe_implementation(w: Any, implementation: str | None) -> str | None:
  """The ``qjax.moe_matmul`` implementation :class:`MoE` asks for with ``w``: "xla" for an
  expert stack whose format has no MoE kernel (the GGUF formats) where ``implementation``
  is "pallas" or "interpret" (as :func:`matmul` does for the dense weights), else
  ``implementation``. ``w`` may be a :class:`qjax.LayerOf` (a layer of stacked experts)."""
  fmt = w.format_cls if isinstance(w, (qjax.ShardedWeight, qjax.LayerOf)) else type(w)
  if implementation in ("pallas", "interpret") and not moe_lib.moe_kernels_for_format(fmt):
    return "xla"
  return implementation


def _moe_matmul(x: jax.Array, w: Any, ids: jax.Array, implementation: str | None
                ) -> jax.Array:
  """``qjax.moe_matmul`` with :func:`moe_implementation`."""
  return qjax.moe_matmul(x, w, ids, implementation=moe_implementation(w, implementation))


def _expert_count(w: Any) -> int | None:
  """The experts of an expert stack: its one leading axis (``leading_axes`` of a GGUF
  pytree; the axis before an MXFP4 stack's ``[Kp // 8, N]`` codes), past the ``[layers]``
  axis of a :class:`qjax.LayerOf`; None for a single matrix or more leading axes."""
  stack, skip = (w.stack, 1) if isinstance(w, qjax.LayerOf) else (w, 0)
  lead = getattr(stack, "leading_axes", None)
  if lead is None:
    codes = getattr(stack, "codes", None)
    lead = () if codes is None else tuple(codes.shape[:codes.ndim - 2])
  lead = tuple(lead)[skip:]
  return int(lead[0]) if len(lead) == 1 else None


class MoE(nn.Module):
  """Top-k routed SwiGLU experts: llama.cpp's ``build_moe_ffn`` for Qwen3-MoE and Mixtral.

  Per token ``x [hidden]``: router logits ``x @ router`` in float32 (``[E]``); the
  ``k = experts_per_token`` largest, weighted by a softmax over those k logits (the same as
  llama.cpp's softmax over all E, top k, weights divided by their sum); each selected
  expert's ``down_e(silu(x @ gate_e) * (x @ up_e))`` (the SwiGLU in float32, its product
  in x's dtype); the weighted sum, in float32, rounded once to x's dtype.

  Params: ``router`` float ``[hidden, E]`` (GGUF ``ffn_gate_inp``, dequantized to float32
  at load where the file stores it quantized); ``gate``, ``up`` expert stacks of logical
  shape ``(hidden, F)`` and ``down`` of ``(F, hidden)`` with a leading ``[E]`` axis on
  their arrays (GGUF ``ffn_{gate,up,down}_exps``; any format :func:`qjax.moe_matmul`
  takes, e.g. an MXFP4 stack), or a :class:`qjax.LayerOf` of a ``[layers, E, ...]`` stack.

  GPT-OSS (``cfg.moe_bias``, ``cfg.expert_activation == "gpt_oss"``; llama.cpp's
  build_moe_ffn with LLM_FFN_SWIGLU_OAI_MOE and SOFTMAX_WEIGHT): the router adds
  ``router_bias [E]`` before the top k, each selected expert's gate and up add their
  ``gate_bias`` / ``up_bias`` rows (``[E, F]``) and its down ``down_bias`` (``[E,
  hidden]``), all in float32, and the activation is the clamped SwiGLU
  (:func:`flax_layers.moe.gated_activation`, ``"gpt_oss"``: alpha 1.702, limit 7).
  """
  cfg: LlamaConfig

  def _bias(self, name: str, shape: tuple[int, int]) -> jax.Array:
    b = _loaded_param(self, name)
    if tuple(b.shape) != shape:
      raise ValueError(f"{self.name or 'MoE'}: {name} of shape {tuple(b.shape)}, want "
                       f"{shape}")
    return b.astype(jnp.float32)

  def _experts(self, name: str, shape: tuple[int, int]) -> Any:
    w = _loaded_param(self, name)
    e = _expert_count(w)
    if tuple(w.shape) != shape or e != self.cfg.num_experts:
      held = f"{e} experts" if e else "a single matrix (no expert axis)"
      raise ValueError(f"{self.name or 'MoE'}: {name} holds {held} of logical shape "
                       f"{tuple(w.shape)}; the config needs {self.cfg.num_experts} experts "
                       f"of {shape}")
    return w

  @nn.compact
  def __call__(self, x):
    """x: ``[batch, seq, hidden]`` -> ``[batch, seq, hidden]`` in x's dtype."""
    c = self.cfg
    b, t, d = x.shape
    e, f = c.num_experts, c.expert_ffn_size
    router = _loaded_param(self, "router")
    if tuple(router.shape) != (d, e):
      raise ValueError(f"{self.name or 'MoE'}: router of shape {tuple(router.shape)}, want "
                       f"(hidden={d}, experts={e})")
    tokens = x.reshape(b * t, d)                                        # [T, hidden]
    logits = jnp.dot(tokens.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)               # [T, E]
    if c.moe_bias:
      logits = logits + self._bias("router_bias", (e,))
    weights, ids = moe_layers.route(logits, c.experts_per_token, "topk_softmax")  # [T, k]
    run = functools.partial(_moe_matmul, ids=ids, implementation=c.implementation)
    gate = run(tokens, self._experts("gate", (d, f))).astype(jnp.float32)  # [T, k, F]
    up = run(tokens, self._experts("up", (d, f))).astype(jnp.float32)
    if c.moe_bias:
      gate = gate + self._bias("gate_bias", (e, f))[ids]
      up = up + self._bias("up_bias", (e, f))[ids]
    if c.expert_activation == "gpt_oss":  # gated_activation takes (gate, up) interleaved
      h = moe_layers.gated_activation(jnp.stack([gate, up], -1).reshape(*gate.shape[:-1], 2 * f),
                                      "gpt_oss")
    else:
      h = jax.nn.silu(gate) * up
    y = run(h.astype(x.dtype), self._experts("down", (f, d)))           # [T, k, hidden]
    y = y.astype(jnp.float32)
    if c.moe_bias:
      y = y + self._bias("down_bias", (e, d))[ids]
    out = jnp.einsum("tk,tkd->td", weights, y, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype).reshape(b, t, d)


def _pre_matmul_norm(cfg: LlamaConfig, name: str, x: jax.Array
                     ) -> tuple[jax.Array, jax.Array | None]:
  """The RMSNorm ``name`` (a submodule of the calling module) of x before a matmul:
  ``(its input, the factor of its output rows)``, deferred where ``cfg.norm_deferred``,
  else ``(the normalized x, None)``."""
  out = RMSNorm(cfg.rms_eps, cfg.norm_deferred, name=name)(x)
  return out if isinstance(out, tuple) else (out, None)


class Block(nn.Module):
  """A pre-norm decoder layer (the scan body over layers, or one unrolled layer); its FFN
  is :class:`MLP` (``mlp``), or :class:`MoE` (``moe``) where ``cfg.num_experts`` > 0;
  ``fresh_prompt`` and ``contiguous`` as :class:`Attention`'s."""
  cfg: LlamaConfig
  fresh_prompt: bool = False
  contiguous: bool = False

  @nn.compact
  def __call__(self, carry, per_layer, ctx):
    """carry: (x ``[batch, seq, hidden]``, the whole model's k and v caches ``[layers,
    batch, max_len, kv_heads, head_dim]``); per_layer: (this layer's index, an int or a
    scalar int32 array in the scan, and with a sliding window whether this layer slides,
    a bool or a scalar bool array); ctx: (positions ``[batch, seq]``, mask ``[batch, seq,
    max_len]``, RoPE frequency divisors ``[rope_dim // 2]`` or None, the sliding layers'
    mask ``[batch, seq, max_len]`` or None). Returns (the new carry, None): the caches are
    carried whole, so each layer writes its new keys in place instead of a copy of its
    slice going out as the scan's output."""
    x, k_cache, v_cache = carry
    positions, mask, rope_freqs, window_mask = ctx
    layer, *slides = per_layer
    window = None
    if slides and window_mask is not None:
      mask = jnp.where(slides[0], window_mask, mask)
      if isinstance(slides[0], (bool, np.bool_)):  # an unrolled layer
        window = self.cfg.sliding_window if slides[0] else None
      else:  # the scan's flag: no window is one as long as int32 allows
        window = jnp.where(slides[0], self.cfg.sliding_window, np.iinfo(np.int32).max)
    c = self.cfg
    normed, row_scale = _pre_matmul_norm(c, "attn_norm", x)
    h, k_cache, v_cache = Attention(c, self.fresh_prompt, self.contiguous, name="attn")(
        normed, positions, mask, k_cache, v_cache, layer, rope_freqs, window, row_scale)
    x = x + h
    if c.moe:  # the router and the experts read the normalized x
      x = x + MoE(c, name="moe")(RMSNorm(c.rms_eps, name="ffn_norm")(x))
    else:
      x = x + MLP(c, name="mlp")(*_pre_matmul_norm(c, "ffn_norm", x))
    return (x, k_cache, v_cache), None


class Llama(nn.Module):
  """The decoder: embedding, ``num_layers`` blocks, final norm, output head.

  Params: ``embed`` (quantized ``[hidden, vocab]``), the blocks, ``final_norm``,
  ``lm_head`` only when the output is not tied, and ``rope_freqs`` (``[rope_dim // 2]``
  float32, each RoPE pair's frequency divisor) only under llama3 rope scaling. The blocks
  are ``blocks`` (every leaf with a leading ``[layers]`` axis) when ``cfg.scan_layers``,
  else ``layers_0 ... layers_{n-1}`` (one layer's params each). ``fresh_prompt``,
  ``contiguous``: as :class:`Attention`'s (the caller vouches for the positions).
  """
  cfg: LlamaConfig
  fresh_prompt: bool = False
  contiguous: bool = False

  def _check_num_layers(self) -> None:
    """A ValueError where the params hold another number of layers than the config's
    (lax.scan failed with "different leading axis sizes"; unrolled, extra layers were
    ignored)."""
    c = self.cfg
    if c.scan_layers:
      leaves = jax.tree.leaves(self.get_variable("params", "blocks"))
      held = jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else None
    else:
      held = 0
      while self.has_variable("params", f"layers_{held}"):
        held += 1
    if held != c.num_layers:
      raise ValueError(f"the params hold {held} layers, the config num_layers="
                       f"{c.num_layers}: the params and the config are of different models")

  @nn.compact
  def __call__(self, tokens, positions, cache):
    """Runs ``tokens`` at ``positions``, writing their keys and values into ``cache``.

    Args:
      tokens: ``[batch, seq]`` int32; an id outside ``[0, vocab)`` has no embedding row:
        its logits are NaN, and so are those of the later positions of its sequence.
      positions: ``[batch, seq]`` int32; query ``(b, t)`` attends to cache slots
        ``<= positions[b, t]``. A position outside ``[0, max_len)`` has no slot: its
        logits are NaN (and :func:`sample` gives -1 for them), not those of a cache that
        wrapped or dropped the token.
      cache: {"k", "v"}: ``[layers, batch, max_len, kv_heads, head_dim]``.

    Returns:
      (logits ``[batch, seq, vocab]`` float32, the updated cache).
    """
    c = self.cfg
    embed = _loaded_param(self, "embed")
    max_len = cache["k"].shape[2]
    if tokens.shape[1] > max_len:
      raise ValueError(f"{tokens.shape[1]} tokens do not fit a KV cache of max_len={max_len}; "
                       "make the cache at least as long as the sequence (init_cache)")
    _check_embed(embed, c)
    # A token id outside [0, vocab) has no row: its logits are NaN (jnp.take would wrap a
    # negative id to another token's row), as a position without a cache slot.
    known = (tokens >= 0) & (tokens < c.vocab_size)
    x = embedding_rows(embed, jnp.where(known, tokens, 0)).astype(c.dtype)
    x = jnp.where(known[..., None], x, jnp.asarray(jnp.nan, c.dtype))
    slots = jnp.arange(max_len)[None, None, :]  # the cache slot of position p is p
    mask = slots <= positions[:, :, None]
    # Sliding layers: the keys of the last sliding_window positions (llama.cpp's
    # is_masked_swa, LLAMA_SWA_TYPE_STANDARD: masked where p - s >= W).
    window_mask = (mask & (positions[:, :, None] - slots < c.sliding_window)
                   if c.sliding_window else None)
    layout = "blocks" if c.scan_layers else "layers_0"
    if not self.has_variable("params", layout):
      raise ValueError(f"the params have no {layout!r} (scan_layers={c.scan_layers}); build "
                       f"them with params_from_gguf(..., scan_layers={c.scan_layers})")
    self._check_num_layers()
    # llama3 RoPE scaling: the params hold the frequency divisors (rope_freqs.weight);
    # YaRN's divisors (from the config) multiply them.
    rope_freqs = (self.param("rope_freqs", _pretrained)
                  if self.has_variable("params", "rope_freqs") else None)
    if c.yarn is not None:
      yarn = jnp.asarray(c.yarn.freq_factors(c.rope_base, c.rope_dim), jnp.float32)
      rope_freqs = yarn if rope_freqs is None else rope_freqs * yarn
    ctx = (positions, mask, rope_freqs, window_mask)
    k, v = cache["k"], cache["v"]
    if c.scan_layers:
      # lax.scan with each quantized weight as qjax.layer_of(stack, i): the kernels read
      # the layer in place, where nn.scan's slices would be copied before every kernel.
      # The caches are carried whole; each layer's index (and, with a window, its flag)
      # is scanned.
      per_layer = (jnp.arange(c.num_layers, dtype=jnp.int32),)
      if c.sliding_window:
        per_layer += (jnp.asarray(c.sliding_layers, bool),)
      (x, k, v), _ = scan.scan_layers(Block(c, self.fresh_prompt, self.contiguous,
                                            parent=None),
                                      self.param("blocks", _pretrained),
                                      (x, k, v), per_layer, ctx)
    else:
      for i in range(c.num_layers):
        slides = (c.sliding_layers[i],) if c.sliding_window else ()
        (x, k, v), _ = Block(c, self.fresh_prompt, self.contiguous,
                             name=f"layers_{i}")((x, k, v), (i, *slides), ctx)
    x, row_scale = _pre_matmul_norm(c, "final_norm", x)
    head = embed
    if self.has_variable("params", "lm_head"):
      head = self.param("lm_head", _pretrained)
    logits = matmul(x, head, c.implementation).astype(jnp.float32)
    if row_scale is not None:
      logits = logits * row_scale
    in_cache = (positions >= 0) & (positions < max_len)  # [batch, seq]
    logits = jnp.where(in_cache[..., None], logits, jnp.nan)
    return logits, {"k": k, "v": v}


# module -> (the fused projection's name, the projections it joins, in column order).
FUSED = {"attn": ("qkv", ("q", "k", "v")), "mlp": ("gate_up", ("gate", "up"))}


def check_not_fused(params: Any, what: str) -> None:
  """A ValueError naming the projections of ``params`` (Llama params, with or without the
  ``"params"`` level) that :func:`fuse_projections` joined (``.../attn/qkv``,
  ``.../mlp/gate_up``), followed by ``what`` (what to do instead); None where there are
  none, as in params as loaded."""
  joined = []

  def walk(tree: Any, path: tuple[str, ...]) -> None:
    if not isinstance(tree, Mapping):
      return
    for name, sub in tree.items():
      if name in FUSED and isinstance(sub, Mapping) and FUSED[name][0] in sub:
        joined.append("/".join(path + (name, FUSED[name][0])))
      walk(sub, path + (str(name),))

  walk(params.get("params", params) if isinstance(params, Mapping) else params, ())
  if joined:
    raise ValueError(f"{', '.join(joined)}: projections joined by "
                     f"flax_layers.fuse_projections; {what}")


def fuse_projections(params: dict) -> dict:
  """``params`` with each layer's q / k / v projections joined into one weight ``qkv``
  and its gate / up into ``gate_up`` (``qjax.concat_columns``: lossless, the columns side
  by side), so that a decode step runs one matmul where it ran three and two: fewer,
  larger launches (H100, Llama-3.2-1B-shaped Q4_K at batch 1: see BENCHMARKS.md, session
  36). :class:`Attention` and :class:`MLP` run either layout.

  A layer whose projections do not join (different formats, e.g. Q4_K_M's attn_v in Q6_K
  beside Q4_K q / k; an NVFP4 tensor scale that differs) keeps them apart; so do layers
  of a mixture of experts' FFN (only the attention joins there). Biases (``qkv_bias``)
  join with their weights. Call it on params of one device: tensor parallelism splits q,
  k and v by heads (flax_layers.tensor_parallel takes the separate projections). Joining
  copies: for a moment the joined projections are held twice.

  Args:
    params: ``{"params": ...}`` of :class:`Llama` (scanned ``blocks`` or unrolled
      ``layers_i``), e.g. from :func:`params_from_gguf`.

  Returns:
    The new params; ``params`` itself is not changed.
  """
  def join(module: dict, fused: str, parts: tuple[str, ...]) -> dict:
    if not all(p in module for p in parts):
      return module
    fields = {}
    for field in module[parts[0]]:
      try:
        fields[field] = qjax.concat_columns([module[p][field] for p in parts])
      except (ValueError, KeyError):
        return module
    if set(fields) != {f for p in parts for f in module[p]}:
      return module
    return {**{k: v for k, v in module.items() if k not in parts}, fused: fields}

  def fuse_layer(layer: dict) -> dict:
    return {name: join(sub, *FUSED[name]) if name in FUSED and isinstance(sub, dict) else sub
            for name, sub in layer.items()}

  tree = params["params"]
  out = {name: fuse_layer(sub) if (name == "blocks" or name.startswith("layers_")) else sub
         for name, sub in tree.items()}
  return {**params, "params": out}


def init_cache(cfg: LlamaConfig, batch: int, max_len: int) -> dict[str, jax.Array]:
  """A zero KV cache for :func:`prefill`, :func:`decode_step` and the other entry points.

  Args:
    cfg: the model's config (layers, KV heads, head size, dtype).
    batch: sequences, an int >= 1.
    max_len: positions per sequence, an int >= 1 (prompt plus generated tokens).

  Returns:
    ``{"k", "v"}``: each ``[layers, batch, max_len, kv_heads, head_dim]`` in cfg.dtype.

  Raises:
    ValueError: ``batch`` or ``max_len`` not a positive int.
  """
  check_sizes("init_cache", max_len=max_len, batch=batch)
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(params, tokens, cache, *, cfg: LlamaConfig):
  """Runs a prompt from position 0.

  Args:
    params: from :func:`params_from_gguf`.
    tokens: ``[batch, seq]`` int32, padded on the right to a bucket length (the padding's
      keys land in the cache past the prompt and are overwritten by decoding).
    cache: from :func:`init_cache` (donated), ``max_len >= seq`` (else a ValueError).
    cfg: the config (static).

  Returns:
    (logits ``[batch, seq, vocab]`` float32, cache).
  """
  check_tokens(tokens, 2)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # From position 0 the prompt's queries attend to its own keys, not the whole cache.
  return Llama(cfg, fresh_prompt=True).apply(params, tokens.astype(jnp.int32), positions,
                                             cache)


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def extend(params, tokens, start, cache, *, cfg: LlamaConfig):
  """Runs more tokens after what the cache holds: a conversation's next turn, or a long
  prompt in chunks (:func:`prefill` the first, ``extend`` the rest).

  Each sequence's tokens sit at positions ``start[b] .. start[b] + seq - 1``; its cache
  must hold positions ``0 .. start[b] - 1`` (from :func:`prefill`, :func:`decode_step` or
  an earlier ``extend``). Several queries attend to the cache through
  :func:`qjax.causal_attention` (on a GPU its flash kernel: the ``[seq, max_len]`` scores
  stay in registers); the logits equal those of one :func:`prefill` of the whole
  sequence, up to float rounding.

  Args:
    params: from :func:`params_from_gguf`.
    tokens: ``[batch, seq]`` int32 (a shorter sequence may be padded on the right: the
      padding's keys land past its text and are overwritten later).
    start: ``[batch]`` (or scalar) int32, the position of each sequence's first token.
      Tokens at positions past the cache get NaN logits.
    cache: the KV cache (donated).
    cfg: the config (static).

  Returns:
    (logits ``[batch, seq, vocab]`` float32, cache).

  >>> # logits, cache = prefill(params, turn1, cache, cfg=cfg)
  >>> # logits, cache = extend(params, turn2, jnp.asarray([turn1_len]), cache, cfg=cfg)
  """
  check_tokens(tokens, 2)
  b, t = tokens.shape
  start = jnp.broadcast_to(jnp.asarray(start, jnp.int32).reshape(-1), (b,))
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  return Llama(cfg, contiguous=True).apply(params, tokens.astype(jnp.int32), positions, cache)


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params, token, pos, cache, *, cfg: LlamaConfig):
  """One token per sequence.

  Args:
    params: from :func:`params_from_gguf`.
    token: ``[batch]`` int32.
    pos: ``[batch]`` (or scalar) int32, the position of ``token``, in ``[0, max_len)``
      (a row past the cache gets NaN logits).
    cache: the KV cache (donated).
    cfg: the config (static).

  Returns:
    (logits ``[batch, vocab]`` float32, cache).
  """
  check_tokens(token, 1, "token")
  b = token.shape[0]
  positions = jnp.broadcast_to(jnp.asarray(pos, jnp.int32).reshape(-1), (b,))[:, None]
  logits, cache = Llama(cfg).apply(params, token.astype(jnp.int32)[:, None], positions, cache)
  return logits[:, 0], cache


def next_token_step(decode, token, pos, cache, key, *, temperature: float = 0.0,
                    top_p: float = 1.0):
  """One decode step and its sampled next tokens, the loop body of generation.

  ``decode(token, pos, cache) -> (logits, cache)`` is :func:`decode_step` with its params
  and config bound (or the tensor-parallel one). The key is split as a caller of
  :func:`sample` would (``key, sub = split(key)``, ``sub`` draws), so the tokens equal
  ``sample(decode(...)[0], sub, ...)``.

  Returns:
    (next tokens ``[batch]`` int32, ``pos + 1``, cache, the new key).
  """
  logits, cache = decode(token, pos, cache)
  key, sub = jax.random.split(key)
  return sample(logits, sub, temperature=temperature, top_p=top_p), pos + 1, cache, key


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_p"),
                   donate_argnames=("cache",))
def decode_and_sample(params, token, pos, cache, key, *, cfg: LlamaConfig,
                      temperature: float = 0.0, top_p: float = 1.0):
  """:func:`decode_step` and :func:`sample` as one jitted program.

  A generation loop then dispatches one program per token and reads back one int: the
  next token and its position stay on the device as the next call's inputs. At batch 1
  each separate dispatch (the key split, the argmax, two host-to-device copies) costs
  host time comparable to the whole step on a GPU.

  Args:
    params, token, pos, cache, cfg: as :func:`decode_step` (``token`` ``[batch]`` int32,
      ``pos`` ``[batch]`` int32; the cache is donated).
    key: PRNG key, split once per call (also when greedy, so a sampled and a greedy run
      see the same key sequence).
    temperature, top_p: as :func:`sample` (static).

  Returns:
    (next tokens ``[batch]`` int32, ``pos + 1``, cache, the new key).
  """
  decode = functools.partial(decode_step, params, cfg=cfg)
  return next_token_step(decode, token, pos, cache, key, temperature=temperature,
                         top_p=top_p)


def decode_loop(decode, token, pos, cache, key, count, stop_ids, *, max_steps: int,
                temperature: float = 0.0, top_p: float = 1.0):
  """Up to ``count`` (<= ``max_steps``) :func:`next_token_step` calls in one XLA loop, which
  ends early where every sequence's new token is one of ``stop_ids`` or -1 (NaN logits).

  The same tokens, cache and key as calling :func:`next_token_step` once per token and
  stopping at those tokens, without a return to the host between tokens.

  Args:
    decode: as :func:`next_token_step`'s.
    token, pos, cache, key: the state of :func:`next_token_step`.
    count: a scalar int32 (traced), the steps to run at most.
    stop_ids: ``[S]`` int32, the tokens that end a sequence (S >= 1).
    max_steps: the static length of the returned tokens.

  Returns:
    (tokens ``[max_steps, batch]`` int32 (the first ``steps`` rows hold the new tokens,
    the rest -2), steps (scalar int32), and the state after them: token, pos, cache,
    key).
  """
  b = token.shape[0]

  def running(carry):
    i, token, *_ = carry
    ended = (token[:, None] == stop_ids[None, :]).any(axis=-1) | (token < 0)
    return (i < jnp.minimum(count, max_steps)) & ~((i > 0) & ended.all())

  def step(carry):
    i, token, pos, cache, key, tokens = carry
    token, pos, cache, key = next_token_step(decode, token, pos, cache, key,
                                             temperature=temperature, top_p=top_p)
    return i + 1, token, pos, cache, key, tokens.at[i].set(token)

  init = (jnp.int32(0), token, pos, cache, key, jnp.full((max_steps, b), -2, jnp.int32))
  steps, token, pos, cache, key, tokens = jax.lax.while_loop(running, step, init)
  return tokens, steps, token, pos, cache, key


@qjax.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("cfg", "max_steps", "temperature", "top_p"),
                   donate_argnames=("cache",))
def decode_tokens(params, token, pos, cache, key, count, stop_ids, *, cfg: LlamaConfig,
                  max_steps: int, temperature: float = 0.0, top_p: float = 1.0):
  """:func:`decode_loop` over :func:`decode_step` as one jitted program: up to ``count``
  tokens per call and one read back, where :func:`decode_and_sample` takes a call (and a
  read) per token. ``count`` and ``stop_ids`` are arrays, so one compile serves every
  count up to ``max_steps``; the cache is donated. Returns (tokens ``[max_steps,
  batch]``, steps, token, pos, cache, key) as :func:`decode_loop`.
  """
  decode = functools.partial(decode_step, params, cfg=cfg)
  return decode_loop(decode, token, pos, cache, key, count, stop_ids, max_steps=max_steps,
                     temperature=temperature, top_p=top_p)


def forward(params, tokens, *, cfg: LlamaConfig) -> jax.Array:
  """The model's logits for whole sequences, with no prior cache (a fresh one of ``seq``
  positions is made and dropped).

  Args:
    params: ``{"params": ...}`` of :class:`Llama` (e.g. from :func:`params_from_gguf` or
      :func:`flax_layers.load_hf_llama`).
    tokens: ``[batch, seq]`` integer ids. An id outside ``[0, vocab)`` has no embedding
      row: its logits are NaN, and so are those of the positions after it in its
      sequence, which attend to it.
    cfg: the model's config.

  Returns:
    ``[batch, seq, vocab]`` float32 logits.

  Raises:
    ValueError: tokens not a 2-D integer array, params of another vocabulary or layer
      count than ``cfg`` (see :func:`prefill`).
  """
  check_tokens(tokens, 2)
  cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
  return prefill(params, tokens, cache, cfg=cfg)[0]


@jax.jit
def _sample_top_p(logits, key, temperature, top_p):
  """Nucleus sampling as a Gumbel-max draw: ``argmax(logits / temperature + g)`` over the
  nucleus, ``g`` standard Gumbel noise of ``key`` for each token id.

  The argmax over the whole vocabulary needs no sort, and where it lands in the nucleus
  (its token's probability mass above it is below ``top_p``: a draw outside has the
  probability of the mass outside, at most ``1 - top_p``) it is also the nucleus's
  argmax. Only otherwise does the vocabulary get sorted to find the nucleus
  (:func:`_nucleus_argmax`; a ``lax.cond``, for the whole batch). H200, SmolLM2 (49152
  tokens), top-p 0.9, the decode loop: a sampled token took 1053 us with the sort for
  every draw, 1031 this way, a greedy one 965 (docs/experiments/s42_decode_write.py).
  """
  # Shifted so that each row's largest logit is 0: a tiny temperature sends the others to
  # -inf (greedy in the limit), where unshifted they overflowed to inf and the softmax to
  # NaN (temperature 1e-38 gave token 0).
  logits = logits.astype(jnp.float32)
  logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
  noisy = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
  first = jnp.argmax(noisy, axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  at = jnp.take_along_axis(logits, first[:, None], axis=-1)
  ids = jnp.arange(logits.shape[-1])
  # The tokens ranked above the draw (ties: the lower id first, as a stable sort ranks).
  above = (logits > at) | ((logits == at) & (ids < first[:, None]))
  inside = jnp.sum(jnp.where(above, probs, 0.0), axis=-1) < top_p
  tokens = jax.lax.cond(jnp.all(inside), lambda: first,
                        lambda: _nucleus_argmax(logits, probs, noisy, top_p))
  return tokens.astype(jnp.int32)


def _nucleus_argmax(logits, probs, noisy, top_p):
  """``argmax(noisy)`` over the nucleus of each row: the most likely tokens (a stable sort
  of ``logits``, ties to the lower id) as long as the mass above each is below ``top_p``.
  All ``[batch, vocab]`` float32 -> ``[batch]``."""
  order = jnp.argsort(-logits, axis=-1)
  ranked = jnp.take_along_axis(probs, order, axis=-1)
  keep_ranked = jnp.cumsum(ranked, axis=-1) - ranked < top_p
  rows = jnp.arange(logits.shape[0])[:, None]
  keep = jnp.zeros(logits.shape, bool).at[rows, order].set(keep_ranked)
  return jnp.argmax(jnp.where(keep, noisy, -jnp.inf), axis=-1)


def sample(logits: jax.Array, key: jax.Array | None = None, *, temperature: float = 0.0,
           top_p: float = 1.0) -> jax.Array:
  """Next tokens ``[batch]`` int32 from ``logits [batch, vocab]``.

  temperature 0 is greedy (argmax; ties go to the lowest id); otherwise nucleus sampling:
  the smallest set of most likely tokens whose probability reaches ``top_p``, at
  ``temperature``, drawn with ``key`` (the Gumbel-max draw over that set: each token id
  gets its own noise of ``key``; the whole vocabulary is sorted only where the
  vocabulary's own Gumbel argmax falls outside the set). A row of logits holding a NaN
  (e.g. a position past the KV cache, see :class:`Llama`), or only -inf (no token
  possible), gives -1, which is no token, greedy or sampled.

  Args:
    logits: ``[batch, vocab]`` float.
    key: a PRNG key; needed where ``temperature > 0``.
    temperature: 0 (greedy) or the softmax temperature, finite.
    top_p: the nucleus' probability mass, in (0, 1]; 1 draws from every token.

  Returns:
    ``[batch]`` int32 token ids (-1 for the rows above).

  Raises:
    ValueError: logits not 2-D, temperature negative or not finite, top_p outside (0, 1],
      or no key with ``temperature > 0``.
  """
  if not 0 <= temperature < np.inf:
    raise ValueError(f"temperature={temperature} must be finite and >= 0")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")
  if jnp.ndim(logits) != 2:
    hint = ("add a batch axis (logits[None])" if jnp.ndim(logits) == 1 else
            "for [batch, seq, vocab] pass the position to sample, e.g. logits[:, -1]")
    raise ValueError(f"logits of shape {jnp.shape(logits)} must be [batch, vocab]; {hint}")
  if temperature == 0:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  elif key is None:
    raise ValueError("sampling with temperature > 0 needs a PRNG key")
  else:
    # At least float32's smallest normal: XLA flushes subnormals to zero (a division by 0).
    temperature = max(float(temperature), float(np.finfo(np.float32).tiny))
    tokens = _sample_top_p(logits, key, jnp.float32(temperature), jnp.float32(top_p))
  no_token = jnp.isnan(logits).any(axis=-1) | ~(logits > -jnp.inf).any(axis=-1)
  return jnp.where(no_token, -1, tokens).astype(jnp.int32)


# GGUF tensor name (in block i) -> path in the block params.
_BLOCK_TENSORS = {
    "attn_norm.weight": ("attn_norm", "scale"),
    "attn_q.weight": ("attn", "q", "kernel"),
    "attn_k.weight": ("attn", "k", "kernel"),
    "attn_v.weight": ("attn", "v", "kernel"),
    "attn_output.weight": ("attn", "o", "kernel"),
    "ffn_norm.weight": ("ffn_norm", "scale"),
    "ffn_gate.weight": ("mlp", "gate", "kernel"),
    "ffn_up.weight": ("mlp", "up", "kernel"),
    "ffn_down.weight": ("mlp", "down", "kernel"),
}


# Qwen2's q / k / v biases (cfg.qkv_bias), 1-D.
_BIAS_TENSORS = {
    "attn_q.bias": ("attn", "q", "bias"),
    "attn_k.bias": ("attn", "k", "bias"),
    "attn_v.bias": ("attn", "v", "bias"),
}
# Qwen3's per-head q / k norms (cfg.qk_norm), 1-D ``[head_dim]``.
_QK_NORM_TENSORS = {
    "attn_q_norm.weight": ("attn", "q_norm", "scale"),
    "attn_k_norm.weight": ("attn", "k_norm", "scale"),
}
# The MoE FFN (cfg.num_experts > 0) in place of ffn_gate / ffn_up / ffn_down: the router
# (numpy [E, hidden], logical (hidden, E)) and the expert stacks (numpy [E, F, hidden] for
# gate / up, logical (hidden, F) per expert; [E, hidden, F] for down, (F, hidden)).
_DENSE_FFN_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_MOE_TENSORS = {
    "ffn_gate_inp.weight": ("moe", "router"),
    "ffn_gate_exps.weight": ("moe", "gate"),
    "ffn_up_exps.weight": ("moe", "up"),
    "ffn_down_exps.weight": ("moe", "down"),
}
# GPT-OSS's output bias and attention sinks (cfg.o_bias, cfg.attn_sinks), 1-D; its router
# and expert biases (cfg.moe_bias): the router's [E], the experts' [E, F] / [E, hidden].
_O_BIAS_TENSORS = {"attn_output.bias": ("attn", "o", "bias")}
_SINK_TENSORS = {"attn_sinks.weight": ("attn", "sinks")}
_MOE_BIAS_TENSORS = {
    "ffn_gate_inp.bias": ("moe", "router_bias"),
    "ffn_gate_exps.bias": ("moe", "gate_bias"),
    "ffn_up_exps.bias": ("moe", "up_bias"),
    "ffn_down_exps.bias": ("moe", "down_bias"),
}
_EXPERT_BIASES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
# Biases llama.cpp's llama graph would add where present (or other architectures have);
# this model has none of them, so a file holding one is refused, not run without it.
_UNUSED_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
                  "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias", "ffn_gate_inp.bias",
                  "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias",
                  "exp_probs_b.bias")


def block_tensors(cfg: LlamaConfig) -> dict[str, tuple[str, ...]]:
  """GGUF tensor name in block i (without ``blk.{i}.``) -> its path in the block params,
  for ``cfg``'s architecture options (and its experts: ``ffn_gate_inp``,
  ``ffn_{gate,up,down}_exps`` in place of ``ffn_{gate,up,down}``)."""
  base = dict(_BLOCK_TENSORS)
  if cfg.ffn_norm_name != "ffn_norm":  # GPT-OSS: post_attention_norm, in the same place
    base = {(f"{cfg.ffn_norm_name}.weight" if k == "ffn_norm.weight" else k): v
            for k, v in base.items()}
  if cfg.moe:
    for name in _DENSE_FFN_TENSORS:
      del base[name]
    base.update(_MOE_TENSORS)
  return {**base, **(_BIAS_TENSORS if cfg.qkv_bias else {}),
          **(_O_BIAS_TENSORS if cfg.o_bias else {}),
          **(_SINK_TENSORS if cfg.attn_sinks else {}),
          **(_MOE_BIAS_TENSORS if cfg.moe and cfg.moe_bias else {}),
          **(_QK_NORM_TENSORS if cfg.qk_norm else {})}


def check_tensor_names(cfg: LlamaConfig, names: Any, path: str = "the file") -> None:
  """Refuses a file's tensor ``names`` (an iterable, e.g. the header's) holding FFN tensors
  that ``cfg`` would not run, before any tensor data is read.

  Raises:
    ValueError: naming the first such tensor: one expert of the old Mixtral layout
      (``blk.N.ffn_gate.E.weight``, a 2-D tensor per expert), a shared expert
      (``ffn_*_shexp``), an expert tensor in a dense model (``{arch}.expert_count`` 0 or
      absent), or a dense FFN tensor in an MoE model (leading dense layers).
  """
  moe_names = {n.split(".")[0] for n in _MOE_TENSORS}
  dense_names = {n.split(".")[0] for n in _DENSE_FFN_TENSORS}
  for name in names:
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "blk":
      continue
    base = parts[2]
    if len(parts) == 5 and base in dense_names and parts[3].isdigit():
      raise ValueError(f"{path}: tensor {name!r} is one expert of the old Mixtral layout (a "
                       "2-D tensor per expert), which qjax does not read; convert the model "
                       "again with a current llama.cpp convert_hf_to_gguf.py (it writes "
                       "the experts stacked, ffn_gate_exps / ffn_up_exps / ffn_down_exps)")
    if "shexp" in base:
      raise ValueError(f"{path}: tensor {name!r} is a shared expert, which qjax's MoE "
                       "blocks do not have (routed experts only)")
    if not cfg.moe and base in moe_names:
      raise ValueError(f"{path}: tensor {name!r} belongs to a mixture of experts, but the "
                       "metadata's expert_count is 0 or absent (a dense model)")
    if cfg.moe and base in dense_names:
      raise ValueError(f"{path}: tensor {name!r} is a dense FFN weight in an MoE model "
                       f"({cfg.num_experts} experts); qjax runs experts in every block (no "
                       "dense layers)")


def needed_tensors(cfg: LlamaConfig, scan_layers: bool | None = None) -> list[str]:
  """The GGUF tensors :func:`params_from_gguf` takes for ``cfg`` (:func:`block_tensors` in
  every layer, then ``token_embd.weight`` and ``output_norm.weight``; not the optional
  ``output.weight`` and ``rope_freqs.weight``), in the order it takes them: per tensor
  name across the layers for stacked params, per layer otherwise. ``scan_layers``
  defaults to ``cfg.scan_layers``."""
  scan = cfg.scan_layers if scan_layers is None else scan_layers
  suffixes, layers = list(block_tensors(cfg)), range(cfg.num_layers)
  blocks = ([f"blk.{i}.{s}" for s in suffixes for i in layers] if scan else
            [f"blk.{i}.{s}" for i in layers for s in suffixes])
  return [*blocks, "token_embd.weight", "output_norm.weight"]


def _vector_sizes(cfg: LlamaConfig) -> dict[str, int]:
  """The length of each 1-D block tensor of ``cfg``."""
  kv = cfg.num_kv_heads * cfg.head_dim
  return {"attn_norm.weight": cfg.hidden_size, f"{cfg.ffn_norm_name}.weight": cfg.hidden_size,
          "attn_q.bias": cfg.num_heads * cfg.head_dim, "attn_k.bias": kv, "attn_v.bias": kv,
          "attn_q_norm.weight": cfg.head_dim, "attn_k_norm.weight": cfg.head_dim,
          "attn_output.bias": cfg.hidden_size, "attn_sinks.weight": cfg.num_heads,
          "ffn_gate_inp.bias": cfg.num_experts}


def _expert_bias(path: str, name: str, w: Any, cfg: LlamaConfig) -> jax.Array:
  """An expert bias of a GGUF file (``ffn_{gate,up}_exps.bias`` ``[E, F]``,
  ``ffn_down_exps.bias`` ``[E, hidden]``) as float32 ``[E, N]``: gguf_io loads a 2-D
  tensor as a weight of logical ``(N, E)`` (GGUF's ``ne`` order), whose dequantized
  ``[N, E]`` is transposed here."""
  n = cfg.hidden_size if "ffn_down_exps" in name else cfg.expert_ffn_size
  a = (jnp.asarray(w.dequantize(jnp.float32)).T if qjax.is_quantized(w) else
       jnp.asarray(w, jnp.float32))
  if tuple(a.shape) != (cfg.num_experts, n):
    raise ValueError(f"{path}: tensor {name!r} has shape {tuple(a.shape)}, want "
                     f"({cfg.num_experts}, {n}) from the metadata ({cfg.num_experts} experts "
                     f"of width {cfg.expert_ffn_size}, hidden {cfg.hidden_size})")
  return a.astype(jnp.float32)


def _expert_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
  """The logical ``(K, N)`` of each MoE tensor of ``cfg`` (per expert for the stacks)."""
  if not cfg.moe:
    return {}
  d, e, f = cfg.hidden_size, cfg.num_experts, cfg.expert_ffn_size
  return {"ffn_gate_inp.weight": (d, e), "ffn_gate_exps.weight": (d, f),
          "ffn_up_exps.weight": (d, f), "ffn_down_exps.weight": (f, d)}


def _expert_tensor(path: str, name: str, w: Any, cfg: LlamaConfig,
                   shape: tuple[int, int]) -> Any:
  """An MoE tensor of a GGUF file, checked against the config: the router
  (``ffn_gate_inp``) as float32 ``[hidden, E]`` (dequantized where the file stores it
  quantized: the routing stays float), an expert stack as it was loaded (a pytree with a
  leading ``[E]`` axis, which :func:`qjax.moe_matmul` takes)."""
  router = name.endswith("ffn_gate_inp.weight")
  lead = () if router else (cfg.num_experts,)
  got = tuple(w.shape)
  experts = None if router else _expert_count(w)
  if got != shape or (not router and experts != cfg.num_experts):
    what = ("a router" if router else f"{experts} experts" if experts else
            "a single matrix (no expert axis)")
    raise ValueError(f"{path}: tensor {name!r} holds {what} of logical shape {got}; the "
                     f"metadata (hidden {cfg.hidden_size}, {cfg.num_experts} experts of "
                     f"width {cfg.expert_ffn_size}) needs {(*lead, *shape)}")
  if router:
    return jnp.asarray(w.dequantize(jnp.float32) if qjax.is_quantized(w) else w, jnp.float32)
  return w


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def stackable_layers(tensor_types: dict[str, str]) -> bool:
  """Whether every block tensor ``blk.{i}.NAME`` has one GGUF type in all layers, as stacked
  params (``scan_layers=True``) need. llama.cpp's Q4_K_M, Q5_K_M and Q3_K_* files give
  ``attn_v`` and ``ffn_down`` a bigger type in some layers (``use_more_bits``), so such a
  file runs with ``scan_layers=False``.

  Args:
    tensor_types: GGUF tensor name -> GGUF type name (``GGUFFile.tensor_types``).
  """
  kinds: dict[str, set[str]] = {}
  for name, kind in tensor_types.items():
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk":
      kinds.setdefault(parts[2], set()).add(kind)
  return all(len(k) == 1 for k in kinds.values())


def _take_rope_freqs(gguf_file: Any, cfg: LlamaConfig, consume: bool = False) -> np.ndarray:
  """A GGUF file's ``rope_freqs.weight``: ``[rope_dim // 2]`` float32, the divisor of each
  RoPE pair's frequency (llama.cpp's per-frequency factors; its converter writes them for
  Llama 3.1 / 3.2's llama3 rope scaling, see :func:`llama3_rope_factors`).

  Raises:
    ValueError: naming the file, where the shape is not ``[rope_dim // 2]`` or a factor is
      not finite and positive.
  """
  get = gguf_file.tensors.pop if consume else gguf_file.tensors.__getitem__
  freqs = np.asarray(get("rope_freqs.weight"), np.float32)
  if freqs.shape != (cfg.rope_dim // 2,):
    raise ValueError(f"{gguf_file.path}: tensor 'rope_freqs.weight' has shape {freqs.shape}, "
                     f"want ({cfg.rope_dim // 2},): one factor per RoPE pair (rope_dim "
                     f"{cfg.rope_dim})")
  if not (np.isfinite(freqs).all() and (freqs > 0).all()):
    raise ValueError(f"{gguf_file.path}: tensor 'rope_freqs.weight' holds factors that are "
                     f"not finite and positive ({freqs[~(np.isfinite(freqs) & (freqs > 0))][:4]})")
  return freqs


def llama3_rope_factors(base: float, rope_dim: int, *, factor: float,
                        low_freq_factor: float, high_freq_factor: float,
                        original_context: int) -> np.ndarray:
  """The divisor of each RoPE pair's frequency under llama3 rope scaling (Llama 3.1 / 3.2;
  Hugging Face's ``rope_scaling`` of ``rope_type: "llama3"``), as llama.cpp's converter
  writes them into ``rope_freqs.weight``: 1 for wavelengths shorter than
  ``original_context / high_freq_factor``, ``factor`` for those longer than
  ``original_context / low_freq_factor``, and in between the inverse of a linear blend.

  Returns:
    ``[rope_dim // 2]`` float32.
  """
  if not 0 < low_freq_factor < high_freq_factor or factor <= 0 or original_context <= 0:
    raise ValueError(f"llama3 rope scaling needs factor > 0, 0 < low_freq_factor < "
                     f"high_freq_factor and original_max_position_embeddings > 0; got "
                     f"factor={factor}, low_freq_factor={low_freq_factor}, "
                     f"high_freq_factor={high_freq_factor}, "
                     f"original_max_position_embeddings={original_context}")
  wavelen = 2 * np.pi * base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
  smooth = ((original_context / wavelen - low_freq_factor)
            / (high_freq_factor - low_freq_factor))
  blended = 1 / ((1 - smooth) / factor + smooth)
  out = np.where(wavelen < original_context / high_freq_factor, 1.0,
                 np.where(wavelen > original_context / low_freq_factor, factor, blended))
  return out.astype(np.float32)


def params_from_gguf(gguf_file: Any, *, convert=None, consume: bool = False,
                     scan_layers: bool = True) -> dict:
  """The Flax params of :class:`Llama` from a loaded GGUF file.

  Args:
    gguf_file: a ``GGUFFile`` (``qjax._src.gguf_io.load_gguf``) of a model of
      :data:`SUPPORTED_ARCHITECTURES` (the block tensors :func:`block_tensors` names; a
      bias the architecture does not add is refused).
    convert: optional ``fn(name, weight) -> weight`` applied to each 2-D projection weight
      of the blocks (before stacking, if stacked) (e.g. ``lambda n, w: w.to_int4()`` for
      the GPU kernel); not to the MoE router and expert stacks, which are kept as loaded
      (the router as float32 ``[hidden, E]``).
    consume: remove the tensors from ``gguf_file.tensors`` as they are stacked, so the
      per-layer copies can be freed.
    scan_layers: the layout, which must equal the ``LlamaConfig.scan_layers`` the params
      run with: stacked ``blocks`` (True) or per-layer ``layers_{i}`` (False).

  Returns:
    ``{"params": {"embed", "blocks", "final_norm", ["lm_head"]}}`` with block leaves that
    carry a leading ``[layers]`` axis (scan_layers) or ``{"params": {"embed", "layers_0",
    ..., "layers_{n-1}", "final_norm", ["lm_head"]}}`` (not scan_layers); ``lm_head``
    only where the file has ``output.weight`` (else the head is the embedding, tied), and
    ``rope_freqs`` ``[rope_dim // 2]`` float32 where it has ``rope_freqs.weight`` (Llama
    3.1 / 3.2's llama3 rope scaling).
  """
  tensors = gguf_file.tensors
  cfg = LlamaConfig.from_metadata(gguf_file.metadata)
  arch = gguf_file.metadata["general.architecture"]
  rope_freqs = None
  if "rope_freqs.weight" in tensors:  # llama.cpp's llama3 RoPE scaling (Llama 3.1, 3.2)
    rope_freqs = _take_rope_freqs(gguf_file, cfg, consume)
  names = block_tensors(cfg)
  check_tensor_names(cfg, tensors, gguf_file.path)
  unused = [f"blk.{i}.{b}" for i in range(cfg.num_layers) for b in _UNUSED_BIASES
            if b not in names] + ["output.bias"]
  for name in unused:
    if name in tensors:
      raise ValueError(f"{gguf_file.path}: tensor {name!r} is not supported: qjax's "
                       f"{arch} model has no such bias")
  missing = [n for n in needed_tensors(cfg, scan_layers) if n not in tensors]
  if missing:
    raise ValueError(f"{gguf_file.path}: the {arch} model needs tensor {missing[0]!r}, "
                     f"which the file lacks ({len(missing)} missing in all)")
  sizes = _vector_sizes(cfg)
  take = tensors.pop if consume else tensors.__getitem__

  experts = _expert_shapes(cfg)

  def layer_weight(i, suffix, path):
    w = take(f"blk.{i}.{suffix}")
    if suffix in _EXPERT_BIASES:
      return _expert_bias(gguf_file.path, f"blk.{i}.{suffix}", w, cfg)
    if suffix in experts:
      return _expert_tensor(gguf_file.path, f"blk.{i}.{suffix}", w, cfg, experts[suffix])
    if convert is not None and path[-1] == "kernel":
      w = convert(f"blk.{i}.{suffix}", w)
    elif suffix in sizes and tuple(w.shape) != (sizes[suffix],):
      raise ValueError(f"{gguf_file.path}: tensor 'blk.{i}.{suffix}' has shape "
                       f"{tuple(w.shape)}, want ({sizes[suffix]},) from the metadata "
                       f"(heads {cfg.num_heads}, KV heads {cfg.num_kv_heads}, head size "
                       f"{cfg.head_dim}, hidden {cfg.hidden_size})")
    return w

  blocks: dict = {}
  if scan_layers:
    stacked_blocks: dict = {}
    for suffix, path in names.items():
      layers = [layer_weight(i, suffix, path) for i in range(cfg.num_layers)]
      kinds = sorted({type(w).__name__ for w in layers})
      if len(kinds) > 1:  # was a pytree structure error from tree.map
        raise ValueError(f"{gguf_file.path}: blk.*.{suffix} is stored as {', '.join(kinds)} "
                         "in different layers; stacked params (scan_layers=True) need one "
                         "type per tensor: load it with scan_layers=False (and "
                         "LlamaConfig(scan_layers=False))")
      stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
      del layers
      _set(stacked_blocks, path, stacked)
    blocks["blocks"] = stacked_blocks
  else:
    for i in range(cfg.num_layers):
      layer: dict = {}
      for suffix, path in names.items():
        _set(layer, path, layer_weight(i, suffix, path))
      blocks[f"layers_{i}"] = layer
  params = {"embed": take("token_embd.weight"), **blocks,
            "final_norm": {"scale": take("output_norm.weight")}}
  if "output.weight" in tensors:
    params["lm_head"] = take("output.weight")
  if rope_freqs is not None:
    params["rope_freqs"] = jnp.asarray(rope_freqs, jnp.float32)
  emb = params["embed"]
  if tuple(emb.shape) != (cfg.hidden_size, cfg.vocab_size):
    raise ValueError(f"token_embd.weight has logical shape {tuple(emb.shape)}, want "
                     f"(hidden={cfg.hidden_size}, vocab={cfg.vocab_size})")
  return {"params": params}
