"""Pass 2 of codebook weights in pinned host memory, prefetched layer by layer.

A two-pass :class:`~qjax._src.codebook.CodebookWeight` can keep its residual pass in pinned
host memory (memory kind ``"pinned_host"``), which halves the device memory of its codes.
A single matmul copies pass 2 to the device on every call. A stack of layers does better
with :func:`make_stacked_forward`: a ``lax.scan`` over the layers whose step ``i`` issues
the copy of layer ``i + 1``'s pass 2 (``jax.device_put`` to the device memory space, which
XLA turns into an asynchronous host-to-device copy) before computing layer ``i`` with the
pass 2 that the previous step fetched: double buffering, scheduled by XLA. The copy does
not depend on the layer's compute, so XLA's latency-hiding scheduler can run them side by
side (``--xla_gpu_enable_latency_hiding_scheduler=true``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from qjax._src import dispatch
from qjax._src.codebook import CodebookWeight

MEMORY_KINDS = ("pinned_host", "device")


def _check_memory_kind(memory_kind: str) -> None:
  if memory_kind not in MEMORY_KINDS:
    raise ValueError(f"{memory_kind=} must be one of {MEMORY_KINDS}")
  kinds = [m.kind for m in jax.devices()[0].addressable_memories()]
  if memory_kind not in kinds:
    raise ValueError(f"memory kind {memory_kind!r} is not available on "
                     f"{jax.devices()[0].device_kind!r} (it has {kinds}); keep pass 2 on "
                     "the device")


def _put(a: jax.Array, memory_kind: str) -> jax.Array:
  if isinstance(a, jax.core.Tracer):
    space = jax.memory.Space.Host if memory_kind == "pinned_host" else jax.memory.Space.Device
    return jax.device_put(a, space)
  sharding = getattr(a, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.device_put(a, sharding.with_memory_kind(memory_kind))


def place_pass2(tree: Any, memory_kind: str = "pinned_host") -> Any:
  """Every two-pass :class:`CodebookWeight` in ``tree`` with pass 2's arrays (codes2,
  norms2, codebook2) moved to ``memory_kind`` ("pinned_host" or "device"); pass 1 and all
  other leaves are left where they are. Use at load time on a loaded params tree."""
  _check_memory_kind(memory_kind)

  def move(w):
    if not isinstance(w, CodebookWeight) or w.codes2 is None:
      return w
    return dataclasses.replace(w, codes2=_put(w.codes2, memory_kind),
                               norms2=_put(w.norms2, memory_kind),
                               codebook2=_put(w.codebook2, memory_kind))

  return jax.tree.map(move, tree, is_leaf=lambda v: isinstance(v, CodebookWeight))


def _to_device(w: CodebookWeight) -> CodebookWeight:
  return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), w)


@dataclasses.dataclass(frozen=True)
class LayerStack:
  """``L >= 2`` two-pass codebook layers of one shape, arranged for the prefetching scan.

  Attributes:
    first_body: pass 1 of layers ``0 .. L-2``; arrays ``[L-1, ...]``.
    first_last: pass 1 of layer ``L-1``.
    second_head: pass 2 of layer 0 (a one-pass weight with the pass-2 seed).
    second_rest: pass 2 of layers ``1 .. L-1``; arrays ``[L-1, ...]``. Step ``i`` of the
      scan prefetches ``second_rest[i]`` (layer ``i + 1``) while computing layer ``i``.
  """
  first_body: CodebookWeight
  first_last: CodebookWeight
  second_head: CodebookWeight
  second_rest: CodebookWeight

  @property
  def num_layers(self) -> int:
    return self.first_body.codes.shape[0] + 1

  def pass2_bytes(self) -> int:
    return self.second_head.nbytes + self.second_rest.nbytes

  def device_bytes(self) -> int:
    """Bytes of the arrays that live in device memory."""
    leaves = jax.tree_util.tree_leaves(self)
    return sum(a.nbytes for a in leaves
               if getattr(a.sharding, "memory_kind", "device") in (None, "device"))


jax.tree_util.register_dataclass(
    LayerStack, data_fields=["first_body", "first_last", "second_head", "second_rest"],
    meta_fields=[])


def _stack(ws: Sequence[CodebookWeight]) -> CodebookWeight:
  return jax.tree.map(lambda *a: jnp.stack(a), *ws)


def stack_layers(layers: Sequence[CodebookWeight], *, offload_pass2: bool = True
                 ) -> LayerStack:
  """Arranges two-pass layers for :func:`make_stacked_forward`, pass 2 in pinned host
  memory (``offload_pass2=True``) or on the device (for comparison)."""
  if len(layers) < 2:
    raise ValueError(f"stack_layers needs at least 2 layers, got {len(layers)}")
  for i, w in enumerate(layers):
    if not isinstance(w, CodebookWeight) or w.passes != 2:
      raise ValueError(f"layer {i} must be a two-pass CodebookWeight (quantize_codebook("
                       f"..., passes=2)), got {type(w).__name__}")
  static = lambda w: (w.shape, w.group_size, w.rotation, w.seed)
  for i, w in enumerate(layers):
    if static(w) != static(layers[0]):
      raise ValueError(
          f"layer {i} has (shape, group_size, rotation, seed)={static(w)} but layer 0 has "
          f"{static(layers[0])}: stacked layers share them (quantize every layer with the "
          f"same seed=...)")
  firsts = [w.first_pass() for w in layers]
  seconds = [_to_device(w.second_pass()) for w in layers]
  stack = LayerStack(first_body=_stack(firsts[:-1]), first_last=firsts[-1],
                     second_head=seconds[0], second_rest=_stack(seconds[1:]))
  kind = "pinned_host" if offload_pass2 else "device"
  _check_memory_kind(kind)
  put = lambda w: jax.tree.map(lambda a: _put(a, kind), w)
  return dataclasses.replace(stack, second_head=put(stack.second_head),
                             second_rest=put(stack.second_rest))


def rms_normalize(h: jax.Array, y: jax.Array) -> jax.Array:
  """The default layer step: ``y`` scaled to unit RMS per row, in h's dtype."""
  y = y.astype(jnp.float32)
  y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
  return y.astype(h.dtype)


def make_stacked_forward(layer_fn: Callable[[jax.Array, jax.Array], jax.Array] = rms_normalize,
                         *, implementation: str | None = None) -> Callable[..., jax.Array]:
  """A jitted ``forward(stack: LayerStack, x [M, K]) -> [M, N]``: for each layer,
  ``h = layer_fn(h, qjax.matmul(h, W_i))`` with pass 2 prefetched one layer ahead."""

  def forward(stack: LayerStack, x: jax.Array) -> jax.Array:
    current = _to_device(stack.second_head)

    def step(carry, layer):
      h, second = carry
      first, second_next_host = layer
      # Issued before this layer's matmul and independent of it: the copy can overlap.
      second_next = _to_device(second_next_host)
      y = dispatch.matmul(h, first.with_second_pass(second), implementation=implementation)
      return (layer_fn(h, y), second_next), None

    (h, current), _ = jax.lax.scan(step, (x, current),
                                   (stack.first_body, stack.second_rest))
    y = dispatch.matmul(h, stack.first_last.with_second_pass(current),
                        implementation=implementation)
    return layer_fn(h, y)

  return jax.jit(forward)
