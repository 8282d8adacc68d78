"""Dense layers on rotated codebook weights: ``CodebookDense`` (linen) and
``CodebookLinear`` (NNX), with pass 2 optionally in pinned host memory.

The kernel is a :class:`qjax.CodebookWeight` of logical shape ``[in_features,
out_features]``; calls go through ``qjax.matmul`` (the fused Pallas kernel on NVIDIA GPUs,
XLA elsewhere), which copies an offloaded pass 2 to the device inside the jitted call. For
a stack of layers that prefetches pass 2 ahead of its layers, see ``qjax.make_stacked_forward``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import qjax
from flax_layers.dense import _apply
from flax_layers.dense import _quantized_dense
from flax_layers.dense import _set_linear_params
from flax_layers.dense import _value
from flax_layers.dense import check_sizes
from flax_layers.dense import default_kernel_init

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodebookOptions:
  """How a float kernel is quantized: these arguments of ``qjax.quantize_codebook``
  (its ``norm_dtype`` keeps the default, bfloat16)."""
  group: int = 128
  passes: int = 1
  codebook: str = "lloyd"
  rotation: str = "hadamard"
  seed: int = 0
  offload_pass2: bool = False

  def quantize(self, w: Array, name: str = "kernel") -> qjax.CodebookWeight:
    """``w`` (float ``[K, N]``) quantized with these options; ``name`` labels errors."""
    return qjax.quantize_codebook(w, group=self.group, passes=self.passes,
                                  codebook=self.codebook, rotation=self.rotation,
                                  seed=self.seed, offload_pass2=self.offload_pass2, name=name)


class CodebookDense(nn.Module):
  """A linen Dense layer whose kernel is a :class:`qjax.CodebookWeight`.

  >>> import jax, jax.numpy as jnp
  >>> from flax_layers import CodebookDense
  >>> layer = CodebookDense(64, passes=2)
  >>> params = layer.init(jax.random.key(0), jnp.ones((2, 256)))["params"]
  >>> params["kernel"].codes.shape, params["kernel"].codes2.shape
  ((32, 64), (32, 64))
  >>> layer.apply({"params": params}, jnp.ones((2, 256))).shape
  (2, 64)

  Attributes:
    features: output features N.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as ``nn.Dense``.
    group, passes, codebook, rotation, seed: quantization of the initialized kernel.
    offload_pass2: keep pass 2 of the initialized kernel in pinned host memory (params
      loaded otherwise can be moved with ``qjax.place_pass2``).
    implementation: qjax.matmul implementation (None: best available).
  """
  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable[..., Array] = default_kernel_init
  bias_init: Callable[..., Array] = nn.initializers.zeros_init()
  group: int = 128
  passes: int = 1
  codebook: str = "lloyd"
  rotation: str = "hadamard"
  seed: int = 0
  offload_pass2: bool = False
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    options = CodebookOptions(group=self.group, passes=self.passes, codebook=self.codebook,
                              rotation=self.rotation, seed=self.seed,
                              offload_pass2=self.offload_pass2)
    return _quantized_dense(self, x, options.quantize,
                            "call init or quantize a kernel with qjax.quantize_codebook")


class CodebookLinear(nnx.Module):
  """The NNX twin of :class:`CodebookDense` (options as ``nnx.Linear``).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from flax_layers import CodebookLinear
  >>> layer = CodebookLinear(256, 64, passes=2, rngs=nnx.Rngs(0))
  >>> layer.kernel.norms.shape, layer(jnp.ones((2, 256))).shape
  ((2, 64), (2, 64))
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None,
               kernel_init: Callable[..., Array] = default_kernel_init,
               bias_init: Callable[..., Array] = nn.initializers.zeros_init(),
               group: int = 128, passes: int = 1, codebook: str = "lloyd",
               rotation: str = "hadamard", seed: int = 0, offload_pass2: bool = False,
               implementation: str | None = None, kernel: Any = None,
               rngs: nnx.Rngs | None = None):
    check_sizes("CodebookLinear", in_features=in_features, out_features=out_features)
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.precision = precision
    self.implementation = implementation
    if kernel is None:
      if rngs is None:
        raise ValueError("CodebookLinear needs rngs=nnx.Rngs(...) or a quantized kernel=")
      options = CodebookOptions(group=group, passes=passes, codebook=codebook,
                                rotation=rotation, seed=seed, offload_pass2=offload_pass2)
      kernel = options.quantize(kernel_init(rngs.params(), (in_features, out_features),
                                            param_dtype))
    elif offload_pass2:
      if not isinstance(kernel, qjax.CodebookWeight) or kernel.codes2 is None:
        got = (f"passes={kernel.passes}" if isinstance(kernel, qjax.CodebookWeight)
               else type(kernel).__name__)
        raise ValueError(f"offload_pass2=True needs a two-pass CodebookWeight kernel, got "
                         f"{got} (no pass 2 to offload); quantize it with passes=2 or "
                         "leave offload_pass2 False")
      kernel = qjax.place_pass2(kernel, "pinned_host")
    _set_linear_params(self, kernel, in_features, out_features, use_bias, bias_init,
                       param_dtype, rngs)

  def __call__(self, x: Array) -> Array:
    bias = None if self.bias is None else _value(self.bias)
    return _apply(x, _value(self.kernel), bias, self.dtype, self.implementation,
                  self.precision)
