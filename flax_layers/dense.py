"""Dense layers on quantized weights: ``Int4Dense`` (linen) and ``Int4Linear`` (NNX).

Both take the keyword-only options of ``flax.linen.Dense`` / ``flax.nnx.Linear``, and
are differentiable through ``qjax.matmul`` with respect to x, the bias and the weight's
float arrays (no custom_vjp here: the quantized codes are not trained). The kernel param is
a quantized-weight pytree of logical shape ``[in_features, out_features]`` and every
call goes through ``qjax.matmul`` (the Pallas kernel on NVIDIA GPUs, XLA elsewhere).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qjax
from qjax._src import dispatch

Array = jax.Array
default_kernel_init = nn.initializers.lecun_normal()


def _value(variable: nnx.Variable) -> Any:
  """A variable's value across flax versions (``.value`` is deprecated in newer ones)."""
  get = getattr(variable, "get_value", None)
  return get() if get is not None else variable.value


def compute_dtype(dtype: Any, x: Array) -> Any:
  """The layer's computation dtype: ``dtype``, or x's where ``dtype`` is None; a
  ValueError naming which of the two is not one of ``qjax.matmul``'s activation dtypes
  (bfloat16, float16, float32)."""
  allowed = [jnp.dtype(d) for d in dispatch.ACTIVATION_DTYPES]
  if dtype is None:
    if jnp.dtype(x.dtype) not in allowed:
      raise ValueError(f"x of dtype {jnp.dtype(x.dtype).name} with dtype=None (the layer "
                       "computes in x's dtype) must be bfloat16, float16 or float32; cast "
                       "x or set the layer's dtype=")
    return x.dtype
  if jnp.dtype(dtype) not in allowed:
    raise ValueError(f"dtype={jnp.dtype(dtype).name} must be bfloat16, float16 or float32")
  return dtype


def _is_weight(kernel: Any) -> bool:
  """Whether ``kernel`` multiplies through ``qjax.matmul``: a quantized weight, one layer
  of a stack (``qjax.layer_of``) or a split one (``qjax.ShardedWeight``, for shard_map)."""
  return qjax.is_quantized(kernel) or isinstance(kernel, (qjax.LayerOf, qjax.ShardedWeight))


def _apply(x: Array, kernel: Any, bias: Array | None, dtype: Any, implementation: str | None,
           precision: Any = None) -> Array:
  dtype = compute_dtype(dtype, x)
  x = jnp.asarray(x, dtype)
  if _is_weight(kernel):
    y = qjax.matmul(x, kernel, implementation=implementation)
  else:  # a float kernel (e.g. a layer left unquantized by a skip rule), as nn.Dense
    y = jnp.dot(x, kernel.astype(dtype), preferred_element_type=jnp.float32,
                precision=precision).astype(dtype)
  if bias is not None:
    y = y + bias.astype(dtype)
  return y


def check_sizes(owner: str, **sizes: Any) -> None:
  """A ValueError naming ``owner`` and each of ``sizes`` that is not a positive int (a
  zero or negative width failed inside the initializers: ZeroDivisionError, broadcasting
  errors)."""
  bad = {k: v for k, v in sizes.items()
         if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1}
  if bad:
    raise ValueError(f"{owner}: {', '.join(f'{k}={v!r}' for k, v in bad.items())} must be "
                     "a positive int")


def _quantized_dense(module: nn.Module, x: Array, quantize: Callable[[Array], Any],
                     how_to_quantize: str) -> Array:
  """The body of the linen quantized Dense layers: the kernel (quantized from
  ``module.kernel_init`` at init, read as it is otherwise), its shape check, the bias and
  the matmul. ``how_to_quantize`` ends the error for params without a kernel."""
  check_sizes(module.name or type(module).__name__, features=module.features)
  if jnp.ndim(x) < 1:
    raise ValueError(f"{module.name or type(module).__name__}: x of shape "
                     f"{jnp.shape(x)} has no feature axis; give x of shape [..., K]")
  k = x.shape[-1]
  if module.is_initializing():
    kernel = module.param("kernel", lambda rng: quantize(
        module.kernel_init(rng, (k, module.features), module.param_dtype)))
  else:
    # Read the existing pytree as it is: its group size or format may differ from this
    # module's defaults (pre-quantized params), which flax's init-shape check rejects.
    kernel = module.get_variable("params", "kernel")
    if kernel is None:
      raise ValueError(f"{module.name or type(module).__name__}: params have no 'kernel'; "
                       f"{how_to_quantize}")
  if tuple(kernel.shape) != (k, module.features):
    raise ValueError(f"kernel of logical shape {kernel.shape} does not fit x with "
                     f"{k} features and features={module.features}")
  bias = None
  if module.use_bias:
    bias = module.param("bias", module.bias_init, (module.features,), module.param_dtype)
  return _apply(x, kernel, bias, module.dtype, module.implementation, module.precision)


def _set_linear_params(module: nnx.Module, kernel: Any, in_features: int, out_features: int,
                       use_bias: bool, bias_init: Callable[..., Array], param_dtype: Any,
                       rngs: nnx.Rngs | None) -> None:
  """Sets ``module.kernel`` (a quantized weight of logical shape ``[in, out]``, checked)
  and ``module.bias`` (``[out]`` from ``bias_init``, zeros without rngs, or None)."""
  if tuple(kernel.shape) != (in_features, out_features):
    raise ValueError(f"kernel of logical shape {tuple(kernel.shape)} is not "
                     f"({in_features}, {out_features})")
  module.kernel = nnx.Param(kernel)
  if use_bias:
    bias = (bias_init(rngs.params(), (out_features,), param_dtype) if rngs is not None
            else jnp.zeros((out_features,), param_dtype))
    module.bias = nnx.Param(bias)
  else:
    module.bias = None


def quantize_dense_params(params: dict[str, Any], *, group_size: int | None = 128,
                          symmetric: bool = True, scale_dtype: Any = jnp.bfloat16,
                          method: str = "minmax") -> dict[str, Any]:
  """``nn.Dense`` params -> :class:`Int4Dense` params: the kernel quantized by
  :func:`qjax.quantize`, the bias kept.

  Args:
    params: ``{"kernel": [K, N] float, "bias": [N]}`` (the bias optional).
    group_size, symmetric, scale_dtype, method: as :func:`qjax.quantize` takes them.

  Returns:
    ``{"kernel": Int4Weight of logical shape [K, N], "bias": [N]}``.

  Raises:
    ValueError: no ``kernel``, keys other than ``kernel`` and ``bias``, a bias that is
      not ``[N]``, or what :func:`qjax.quantize` refuses (a kernel that is not a float
      ``[K, N]`` matrix, non-finite values, a group size that does not divide K).
  """
  if "kernel" not in params:
    raise ValueError(f"expected nn.Dense params with a 'kernel', got keys {sorted(params)}")
  extra = sorted(set(params) - {"kernel", "bias"})
  if extra:
    raise ValueError(f"params hold {extra} besides 'kernel' and 'bias'; pass one "
                     "nn.Dense's params (quantize_model quantizes a whole model)")
  n = jnp.shape(params["kernel"])[-1] if jnp.ndim(params["kernel"]) else None
  if "bias" in params and jnp.shape(params["bias"]) != (n,):
    raise ValueError(f"bias of shape {jnp.shape(params['bias'])} does not match the "
                     f"kernel of shape {jnp.shape(params['kernel'])}: it must be [N] = [{n}]")
  out = dict(params)
  out["kernel"] = qjax.quantize(params["kernel"], group_size=group_size, symmetric=symmetric,
                                scale_dtype=scale_dtype, method=method, name="kernel")
  return out


class Int4Dense(nn.Module):
  """A linen Dense layer whose kernel is an int4 :class:`qjax.Int4Weight`.

  Initialized from ``kernel_init`` (then quantized), or applied to params made by
  :func:`quantize_dense_params` from an existing ``nn.Dense``, or holding any
  pre-quantized pytree (GGUF, other layouts) under ``"kernel"``, a ``qjax.layer_of`` view
  (:func:`flax_layers.scan_layers`) or a :class:`qjax.ShardedWeight` (inside ``shard_map``
  ``features`` and the bias are the device's: ``N // n`` column-wise, ``N`` row-wise).

  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from flax_layers import Int4Dense, quantize_dense_params
  >>> x = jnp.ones((2, 256))
  >>> dense_params = nn.Dense(64).init(jax.random.key(0), x)["params"]
  >>> params = quantize_dense_params(dense_params, group_size=128)
  >>> jax.tree.map(jnp.shape, params)
  {'bias': (64,), 'kernel': Int4Weight(codes=(32, 64), scales=(2, 64), zeros=None, shape=(256, 64), group_size=128, tile_k=128, biases=None)}
  >>> Int4Dense(64).apply({"params": params}, x).shape
  (2, 64)

  Attributes:
    features: output features N.
    use_bias: add a float bias.
    dtype: computation dtype (bf16, f16, f32); None: x's dtype.
    param_dtype: dtype of the float params before quantization (kernel init, bias).
    precision: the dot's precision where the kernel is a float array (a layer left
      unquantized), as nn.Dense's (None: jax's default, one TF32 product for float32 on
      the GPU). A quantized kernel accumulates in float32 and ignores it: float32 x
      takes qjax.matmul's XLA path at ``Precision.HIGHEST``, and the Pallas kernels follow
      ``jax.default_matmul_precision``.
    group_size, symmetric, scale_dtype: quantization of the initialized kernel.
    implementation: qjax.matmul implementation (None: best available).
  """
  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable[..., Array] = default_kernel_init
  bias_init: Callable[..., Array] = nn.initializers.zeros_init()
  group_size: int | None = 128
  symmetric: bool = True
  scale_dtype: Any = jnp.bfloat16
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return _quantized_dense(
        self, x, lambda w: qjax.quantize(w, group_size=self.group_size,
                                         symmetric=self.symmetric,
                                         scale_dtype=self.scale_dtype),
        "quantize an nn.Dense's params with quantize_dense_params or call init")


class Int4Linear(nnx.Module):
  """The NNX twin of :class:`Int4Dense` (options as ``nnx.Linear``).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from flax_layers import Int4Linear
  >>> layer = Int4Linear(256, 64, rngs=nnx.Rngs(0))
  >>> layer.kernel.codes.shape, layer.bias.shape
  ((32, 64), (64,))
  >>> layer(jnp.ones((2, 256))).shape
  (2, 64)
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None,
               kernel_init: Callable[..., Array] = default_kernel_init,
               bias_init: Callable[..., Array] = nn.initializers.zeros_init(),
               group_size: int | None = 128, symmetric: bool = True,
               scale_dtype: Any = jnp.bfloat16, implementation: str | None = None,
               kernel: Any = None, rngs: nnx.Rngs | None = None):
    check_sizes("Int4Linear", in_features=in_features, out_features=out_features)
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.precision = precision
    self.implementation = implementation
    if kernel is None:
      if rngs is None:
        raise ValueError("Int4Linear needs rngs=nnx.Rngs(...) or a pre-quantized kernel=")
      w = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
      kernel = qjax.quantize(w, group_size=group_size, symmetric=symmetric,
                             scale_dtype=scale_dtype)
    _set_linear_params(self, kernel, in_features, out_features, use_bias, bias_init,
                       param_dtype, rngs)

  @classmethod
  def from_linear(cls, linear: nnx.Linear, *, group_size: int | None = 128,
                  symmetric: bool = True, scale_dtype: Any = jnp.bfloat16,
                  method: str = "minmax", implementation: str | None = None) -> "Int4Linear":
    """An ``Int4Linear`` with ``linear``'s kernel quantized and its bias kept.

    Args:
      linear: the ``nnx.Linear`` (kernel ``[in_features, out_features]``); left unchanged.
      group_size, symmetric, scale_dtype, method: as :func:`qjax.quantize` takes them.
      implementation: the layer's matmul implementation (None: the dispatcher's choice).

    Returns:
      The new layer, computing in ``linear.dtype``.

    Raises:
      ValueError: what :func:`qjax.quantize` refuses (e.g. a group size that does not
        divide ``in_features``, non-finite weights).
    """
    kernel = qjax.quantize(_value(linear.kernel), group_size=group_size, symmetric=symmetric,
                           scale_dtype=scale_dtype, method=method, name="kernel")
    layer = cls(linear.in_features, linear.out_features, use_bias=linear.bias is not None,
                dtype=linear.dtype, implementation=implementation, kernel=kernel)
    if linear.bias is not None:
      layer.bias = nnx.Param(_value(linear.bias))
    return layer

  def __call__(self, x: Array) -> Array:
    bias = None if self.bias is None else _value(self.bias)
    return _apply(x, _value(self.kernel), bias, self.dtype, self.implementation,
                  self.precision)
