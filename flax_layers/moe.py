"""A mixture-of-experts MLP on MXFP4 expert weights (linen): ``MXFP4MoE``.

Per token ``x [D]``: router logits ``x @ router_kernel [D, E]`` (float32, plus a bias when
``use_bias``); the top-k experts and their gate weights (:func:`route`); each selected
expert ``e`` computes a gated MLP ``down_e(act(x @ gate_up_e))`` with MXFP4 weights
``gate_up [E, D, 2F]`` and ``down [E, F, D]``; the output is the gate-weighted sum over
the selected experts. Both expert projections go through :func:`qjax.moe_matmul` (one
fused grouped-GEMM launch each on NVIDIA GPUs, reading only the selected experts).

On Hopper, params converted with :func:`qjax.to_mxfp4_nk` (``gate_up`` and ``down`` as
:class:`qjax.MXFP4NKWeight`, the same bits) run the wgmma MoE kernel instead: 1.2-1.4x
less time from 4 tokens on (BENCHMARKS.md, session 20).

Gating (``gating``):
  * ``"topk_softmax"`` (GPT-OSS, Mixtral): softmax over the k selected logits.
  * ``"softmax_topk"``: softmax over all E logits, the selected probabilities as they are
    (not renormalized).

Activation (``activation``), on ``h = x @ gate_up_e`` of ``2F`` columns:
  * ``"swiglu"``: ``silu(h[:F]) * h[F:]`` (gate columns first, then up).
  * ``"gpt_oss"``: GPT-OSS's clamped variant on interleaved columns (gate ``h[0::2]``,
    up ``h[1::2]``): ``g = min(gate, 7)``, ``u = clip(up, -7, 7)``,
    ``(u + 1) * g * sigmoid(1.702 g)``.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import qjax
from flax_layers.dense import check_sizes
from flax_layers.dense import compute_dtype
from qjax._src import moe

Array = jax.Array
GATINGS = ("topk_softmax", "softmax_topk")
ACTIVATIONS = ("swiglu", "gpt_oss")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def route(logits: Array, top_k: int, gating: str = "topk_softmax") -> tuple[Array, Array]:
  """The router's choice of ``top_k`` experts per token.

  Args:
    logits: ``[T, E]`` router logits.
    top_k: experts per token, an int in ``[1, E]``.
    gating: "topk_softmax" (softmax over the ``top_k`` selected logits: GPT-OSS,
      Mixtral) or "softmax_topk" (softmax over all E, the selected experts'
      probabilities as they are, not renormalized).

  Returns:
    (gate weights ``[T, top_k]`` float32, expert ids ``[T, top_k]`` int32), experts in
    decreasing logit order (ties: the lower id first).

  Raises:
    ValueError: an unknown ``gating``, or ``top_k`` not an int in ``[1, E]``.
  """
  if gating not in GATINGS:
    raise ValueError(f"{gating=} must be one of {GATINGS}")
  if (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
      or not 1 <= top_k <= logits.shape[-1]):
    raise ValueError(f"top_k={top_k!r} must be an int in [1, {logits.shape[-1]}] (the number "
                     "of experts)")
  logits = logits.astype(jnp.float32)
  top_logits, ids = jax.lax.top_k(logits, top_k)
  if gating == "topk_softmax":
    weights = jax.nn.softmax(top_logits, axis=-1)
  else:
    weights = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
  return weights, ids.astype(jnp.int32)


def gated_activation(h: Array, activation: str) -> Array:
  """``h [..., 2F]`` -> ``[..., F]`` (see the module docstring), computed in float32."""
  h = h.astype(jnp.float32)
  f = h.shape[-1] // 2
  if activation == "swiglu":
    return jax.nn.silu(h[..., :f]) * h[..., f:]
  if activation == "gpt_oss":
    pairs = h.reshape(*h.shape[:-1], f, 2)
    gate = jnp.minimum(pairs[..., 0], GPT_OSS_LIMIT)
    up = jnp.clip(pairs[..., 1], -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return (up + 1.0) * gate * jax.nn.sigmoid(GPT_OSS_ALPHA * gate)
  raise ValueError(f"{activation=} must be one of {ACTIVATIONS}")


class MXFP4MoE(nn.Module):
  """Top-k routed gated-MLP experts with MXFP4 weights (differentiable through
  ``qjax.moe_matmul`` as the dense layers are; the expert codes are not trained).

  Params: ``router_kernel [D, E]`` (float), ``gate_up`` and ``down``
  (:class:`qjax.MXFP4Weight` of logical shapes ``(D, 2F)`` and ``(F, D)`` with a leading
  axis of E experts), and with ``use_bias`` ``router_bias [E]``, ``gate_up_bias [E, 2F]``,
  ``down_bias [E, D]``. Pre-quantized expert weights (e.g. a GPT-OSS checkpoint converted
  with ``.to_mxfp4()``) can be given in the params as they are, or as
  :class:`qjax.ShardedWeight` (e.g. expert-parallel: ``qjax.ShardedWeight.of(w, mesh,
  "ep", "expert")``) for a layer applied inside ``shard_map``.

  >>> import jax, jax.numpy as jnp
  >>> from flax_layers import MXFP4MoE
  >>> layer = MXFP4MoE(num_experts=4, top_k=2, intermediate_size=64)
  >>> x = jnp.ones((3, 128))
  >>> params = layer.init(jax.random.key(0), x)["params"]
  >>> params["gate_up"].codes.shape, params["down"].codes.shape
  ((4, 16, 128), (4, 16, 128))
  >>> layer.apply({"params": params}, x).shape
  (3, 128)

  Attributes:
    num_experts: E.
    top_k: experts per token.
    intermediate_size: F, the width of each expert's hidden layer.
    gating: "topk_softmax" or "softmax_topk".
    activation: "swiglu" or "gpt_oss".
    use_bias: router and expert biases.
    dtype: computation dtype of the expert matmuls (bf16, f16, f32); None: x's dtype.
    param_dtype: dtype of the float params (router, biases, weights before quantizing).
    kernel_init: initializer of the float ``[E, in, out]`` expert weights (quantized after).
    router_init, bias_init: initializers of the router ``[D, E]`` and of the biases.
    implementation: ``qjax.moe_matmul`` implementation (None: best available).
  """
  num_experts: int
  top_k: int
  intermediate_size: int
  gating: str = "topk_softmax"
  activation: str = "swiglu"
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable[..., Array] = nn.initializers.lecun_normal(batch_axis=(0,))
  router_init: Callable[..., Array] = nn.initializers.lecun_normal()
  bias_init: Callable[..., Array] = nn.initializers.zeros_init()
  implementation: str | None = None

  def _expert_weight(self, name: str, shape: tuple[int, int, int]) -> Any:
    def init(rng):
      w = self.kernel_init(rng, shape, self.param_dtype)  # [E, in, out]
      return qjax.quantize_mxfp4(w, name=name)

    if self.is_initializing():
      return self.param(name, init)
    w = self.get_variable("params", name)
    if w is None:
      raise ValueError(f"{self.name or 'MXFP4MoE'}: params have no {name!r}; call init or "
                       "give MXFP4 expert weights")
    want = (shape[0], *shape[1:])
    split = w.stack if isinstance(w, qjax.LayerOf) else w  # a layer of a split stack too
    if isinstance(split, qjax.ShardedWeight):  # expert / tensor parallel, inside shard_map
      if split.global_shape != shape[1:]:
        raise ValueError(f"{name}: experts of logical shape {split.global_shape}; this "
                         f"layer needs {want}")
      return w
    if not moe.takes_format(split):
      hint = (" convert it once at load with .to_mxfp4()"
              if isinstance(split, qjax.GptOssMXFP4Weight) else
              " quantize float weights with qjax.quantize_mxfp4")
      raise TypeError(f"{name}: params hold a {type(split).__name__}; MXFP4MoE takes "
                      f"qjax.moe_matmul's expert stacks (MXFP4Weight, MXFP4NKWeight, "
                      f"NVFP4NKWeight, or a format registered for it) of logical shape "
                      f"{want[1:]} with {want[0]} experts;{hint}")
    # One layer of stacked experts (flax_layers.scan_layers): codes [layers, E, ...].
    experts = (w.stack.codes.shape[1] if isinstance(w, qjax.LayerOf) else
               w.codes.shape[0])
    if tuple(w.shape) != shape[1:] or experts != shape[0]:
      raise ValueError(f"{name}: experts of logical shape {tuple(w.shape)} with "
                       f"{experts} experts; this layer needs {want}")
    return w

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """``x [..., D]`` -> ``[..., D]`` in ``dtype`` (x's dtype by default)."""
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r} must be one of {ACTIVATIONS}")
    if jnp.ndim(x) < 1:
      raise ValueError(f"{self.name or 'MXFP4MoE'}: x of shape {jnp.shape(x)} has no "
                       "feature axis; give x of shape [..., D]")
    check_sizes(self.name or "MXFP4MoE", num_experts=self.num_experts,
                intermediate_size=self.intermediate_size, top_k=self.top_k)
    *lead, d = x.shape
    e, f = self.num_experts, self.intermediate_size
    dtype = compute_dtype(self.dtype, x)
    tokens = jnp.asarray(x, dtype).reshape(-1, d)                       # [T, D]
    router = self.param("router_kernel", self.router_init, (d, e), self.param_dtype)
    logits = jnp.dot(tokens.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)               # [T, E]
    if self.use_bias:
      logits = logits + self.param("router_bias", self.bias_init, (e,), self.param_dtype)
    weights, ids = route(logits, self.top_k, self.gating)               # [T, k]
    gate_up = self._expert_weight("gate_up", (e, d, 2 * f))
    down = self._expert_weight("down", (e, f, d))
    if tokens.shape[0] == 0:  # an empty batch: the params (in init's order), no products
      if self.use_bias:
        self.param("gate_up_bias", self.bias_init, (e, 2 * f), self.param_dtype)
        self.param("down_bias", self.bias_init, (e, d), self.param_dtype)
      return jnp.zeros((*lead, d), dtype)
    h = qjax.moe_matmul(tokens, gate_up, ids, implementation=self.implementation)
    if self.use_bias:
      h = h + self.param("gate_up_bias", self.bias_init, (e, 2 * f),
                         self.param_dtype)[ids].astype(dtype)
    a = gated_activation(h, self.activation).astype(dtype)              # [T, k, F]
    y = qjax.moe_matmul(a, down, ids, implementation=self.implementation)  # [T, k, D]
    if self.use_bias:
      y = y + self.param("down_bias", self.bias_init, (e, d), self.param_dtype)[ids].astype(
          dtype)
    out = jnp.einsum("tk,tkd->td", weights, y.astype(jnp.float32))
    return out.astype(dtype).reshape(*lead, d)
