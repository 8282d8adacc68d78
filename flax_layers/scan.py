"""``scan_layers``: a linen module run once per layer over stacked params, with the
quantized weights read in place.

``nn.scan`` hands its body each layer's params as slices of the stacked arrays, and XLA
copies a slice out of its stack before every Pallas kernel (and every cuBLAS GEMM). Here
each quantized weight reaches the module as ``qjax.layer_of(stack, i)``, which the kernels
read at its offset; float params are sliced. See ``qjax.layer_of`` for the measurement.
"""

from __future__ import annotations

import collections
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import qjax


def _is_weight(p: Any) -> bool:
  return qjax.is_quantized(p) or isinstance(p, qjax.ShardedWeight)


def layer_params(stacked_params: Any, index: jax.Array) -> Any:
  """Layer ``index`` of ``stacked_params`` (every leaf with a leading ``[layers]`` axis):
  quantized weights, split ones (``qjax.ShardedWeight``, inside ``shard_map``) included,
  as ``qjax.layer_of(weight, index)``, other arrays sliced."""
  return jax.tree.map(lambda p: qjax.layer_of(p, index) if _is_weight(p) else p[index],
                      stacked_params, is_leaf=_is_weight)


def scan_layers(module: nn.Module, stacked_params: Any, carry: Any, xs: Any = None,
                *broadcast: Any, unroll: int = 1) -> tuple[Any, Any]:
  """``lax.scan`` of ``module`` over its stacked params, as ``nn.scan`` with
  ``variable_axes={"params": 0}`` would run it, without copying the quantized weights.

  Args:
    module: an unbound linen module (``parent=None`` inside another module) whose
      ``__call__(carry, x, *broadcast) -> (carry, y)``.
    stacked_params: the module's params with a leading ``[layers]`` axis on every array
      (as ``nn.scan`` stores them, or ``jax.tree.map(jnp.stack, ...)`` of per-layer params).
    carry: the initial carry.
    xs: per-layer inputs with a leading ``[layers]`` axis (or None).
    broadcast: the same for every layer.
    unroll: layers per iteration of the loop (``lax.scan``'s ``unroll``).

  Returns:
    ``(final carry, ys stacked over the layers)``.

  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from flax_layers import Int4Dense, scan_layers
  >>> class Layer(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, h, _):
  ...     return jnp.tanh(Int4Dense(256)(h)), None
  >>> x = jnp.ones((1, 256), jnp.bfloat16)
  >>> per_layer = [Layer().init(jax.random.key(i), x, None)["params"] for i in range(3)]
  >>> stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
  >>> scan_layers(Layer(), stacked, x)[0].shape
  (1, 256)
  """
  leaves = jax.tree_util.tree_leaves_with_path(stacked_params)
  if not leaves:
    raise ValueError("scan_layers needs params with a leading [layers] axis; got none")
  counts = collections.Counter(jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
                               for _, leaf in leaves)
  # The count most leaves share is the reference, so the odd leaf is the one named.
  layers = max(counts, key=lambda c: (c is not None, counts[c]))
  if layers is None:
    raise ValueError(f"scan_layers needs params with a leading [layers] axis; all "
                     f"{len(leaves)} of stacked_params' leaves are scalars")
  ref_path = next(path for path, leaf in leaves
                  if jnp.ndim(leaf) and jnp.shape(leaf)[0] == layers)
  for path, leaf in leaves:  # a shorter stack would be read clamped, a longer one cut
    if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != layers:
      raise ValueError(
          f"stacked_params{jax.tree_util.keystr(path)} of shape {jnp.shape(leaf)} does not "
          f"have the leading [layers] axis of stacked_params"
          f"{jax.tree_util.keystr(ref_path)} ({layers} layers, as {counts[layers]} of the "
          f"{len(leaves)} params have); stack every param over the same layers")

  def body(carry, inputs):
    i, x = inputs
    return module.apply({"params": layer_params(stacked_params, i)}, carry, x, *broadcast)

  return jax.lax.scan(body, carry, (jnp.arange(layers), xs), unroll=unroll)
