"""Pass 2 of codebook weights in pinned host memory, prefetched layer by layer.

A two-pass :class:`~qjax._src.codebook.CodebookWeight` can keep its residual pass in pinned
host memory (memory kind ``"pinned_host"``), which halves the device memory of its codes.
A single matmul copies pass 2 to the device on every call. A stack of layers does better
with :func:`make_stacked_forward`: a ``lax.scan`` over groups of layers whose steps copy
pass 2 of the coming layers (``jax.device_put`` to the device memory space, which XLA
turns into asynchronous host-to-device copies on their own streams) while the current
layers compute: prefetch into separate buffers, scheduled by XLA (:class:`LayerStack`
says how the buffers are arranged so that no copy waits for a layer to finish reading),
each layer's pass 2 packed into one buffer (:class:`PackedPass2`) so that it moves with
one copy.
The forward is compiled without command buffers and with the latency-hiding scheduler on
a GPU (:data:`GPU_COMPILER_OPTIONS`), under which the copies overlap the kernels.
"""

from __future__ import annotations

import dataclasses
import math
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
  other leaves are left where they are. Use at load time on a loaded params tree.

  A codebook weight split over devices (:class:`qjax.ShardedWeight`, column-wise) has its
  pass 2 moved too, each array keeping its sharding: every device's slices go to that
  device's ``memory_kind``."""
  _check_memory_kind(memory_kind)
  sharded = dispatch.sharded_weight_class()

  def move(w):
    if isinstance(w, sharded) and issubclass(w.format_cls, CodebookWeight):
      if w.arrays.get("codes2") is None:
        return w
      return dataclasses.replace(w, arrays={
          f: _put(a, memory_kind) if f in _PASS2_FIELDS else a for f, a in w.arrays.items()})
    if not isinstance(w, CodebookWeight) or w.codes2 is None:
      return w
    return dataclasses.replace(
        w, **{f: _put(getattr(w, f), memory_kind) for f in _PASS2_FIELDS})

  return jax.tree.map(move, tree, is_leaf=lambda v: isinstance(v, (CodebookWeight, sharded)))


def _to_device(tree: Any) -> Any:
  return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


_PASS2_FIELDS = ("codes2", "norms2", "codebook2")


def _as_words(a: jax.Array) -> jax.Array:
  """``a``'s bytes, flattened, as ``[ceil(bytes / 4)]`` uint32 (zero-padded)."""
  b = a if a.dtype.itemsize == 1 else jax.lax.bitcast_convert_type(a, jnp.uint8)
  b = b.reshape(-1)
  b = jnp.pad(b, (0, -b.size % 4))
  return jax.lax.bitcast_convert_type(b.reshape(-1, 4), jnp.uint32)


def _from_words(words: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """Inverse of :func:`_as_words` for one array (no leading axes)."""
  dtype = jnp.dtype(dtype)
  size = math.prod(shape) * dtype.itemsize
  b = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:size]
  if dtype.itemsize > 1:
    b = b.reshape(-1, dtype.itemsize)
  return jax.lax.bitcast_convert_type(b, dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class PackedPass2:
  """Pass 2 of one layer (``codes2``, ``norms2``, ``codebook2``) in one uint32 buffer.

  The prefetch moves each layer's pass 2 with one host-to-device copy instead of three: on
  the H100 each copy on the copy stream is followed by a few microseconds of idle time, and
  the two small copies (norms, codebook) per layer added up to about 10 % of the copy time.

  Attributes:
    words: ``[*lead, W]`` uint32: codes2's words, then norms2's bytes, then codebook2's,
      each zero-padded to whole words; ``lead`` are stacking axes (scan steps).
    parts: static ``((shape, dtype name), ...)`` of codes2, norms2, codebook2 of one layer.
  """
  words: jax.Array
  parts: tuple[tuple[tuple[int, ...], str], ...]

  @classmethod
  def pack(cls, w: CodebookWeight) -> "PackedPass2":
    """Pass 2 of the two-pass weight ``w`` (no leading axes), bit for bit."""
    if w.codes2 is None or w.codes2.ndim != 2:
      raise ValueError(
          "PackedPass2.pack needs one two-pass weight without leading axes, got codes2 "
          f"{None if w.codes2 is None else w.codes2.shape}; quantize with passes=2 and pack "
          "each layer separately")
    arrays = [getattr(w, f) for f in _PASS2_FIELDS]
    return cls(words=jnp.concatenate([_as_words(a) for a in arrays]),
               parts=tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in arrays))

  def attach(self, first: CodebookWeight) -> CodebookWeight:
    """``first`` (pass 1 of one layer) with this pass 2 as its residual pass; ``words``
    must have no leading axes."""
    arrays, offset = {}, 0
    for field, (shape, dtype) in zip(_PASS2_FIELDS, self.parts):
      n = -(-math.prod(shape) * jnp.dtype(dtype).itemsize // 4)
      arrays[field] = _from_words(self.words[offset:offset + n], shape, dtype)
      offset += n
    return dataclasses.replace(first, **arrays)

  @property
  def nbytes(self) -> int:
    """Bytes of the packed words."""
    return self.words.nbytes


jax.tree_util.register_dataclass(PackedPass2, data_fields=["words"], meta_fields=["parts"])


# Layers per scan step, and how many of them are prefetched by the previous step
# (LayerStack): double buffering by pairs, the fastest of the layouts measured.
DEFAULT_GROUP = 2

# Compiler options of the stacked forward on the GPU, measured on the H100 (32 layers of
# 4096x4096, BENCHMARKS.md): with XLA's command buffers (CUDA graphs) the while loop's
# host-to-device copies ran between the kernels, not beside them (offloaded time = device
# + copy); without them the copies run on their own streams and overlap the compute.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "",
                        "xla_gpu_enable_latency_hiding_scheduler": True}


@dataclasses.dataclass(frozen=True)
class LayerStack:
  """``L >= 2`` two-pass codebook layers of one shape, arranged for the prefetching scan.

  The layers are cut into groups of ``G`` (``group``); each step of the scan computes one
  group. Pass 2 of a group's first ``C`` layers (``carried``, ``1 <= C <= G``) is
  loop-carried: the previous step copied it. At the start of a step the copies of the
  group's other ``G - C`` layers begin, each into its own buffer, while the first ``C``
  layers compute; the copies of the next group's first ``C`` layers begin then too, into
  new buffers that become the next step's carried ones. So a copy never waits for a layer
  to finish reading its buffer, and the step's compute runs while the next step's pass 2
  is in flight. The default, ``C = G = 2``, is plain double buffering by pairs of layers:
  each step computes two layers from carried buffers while the next two are copied.
  The last ``T`` layers (the tail, ``C <= T < C + G``) run after the scan; its first
  ``C`` layers' pass 2 arrives with the last step's carried copies, the other ``T - C``
  are copied in the tail. With ``(L - C) % G == 0`` the tail is just the carried layers
  and copies nothing itself.

  What the choices gave on the H100 (32 layers of 4096x4096, M = 1, offloaded forward over
  the copy time; BENCHMARKS.md): ``G, C = 2, 2``: 1.109; ``4, 4``: 1.131; ``1, 1``: 1.136;
  ``8, 4``: 1.150; ``6, 2``: 1.146; ``10, 2``: 1.180. With ``C < G`` XLA issues all of a
  step's copies at its start and the host-to-device engine serves them in an order that
  makes the step's later layers wait for the next step's copies; with more layers per step
  the tail drains longer after the last copy.

  Attributes, with ``S = (L - C) // G`` scanned groups and ``T = L - S * G`` tail layers:
    first_body: pass 1 of the scanned groups; arrays ``[S, G, ...]``, or None if S = 0.
    second_rest: ``G - C`` :class:`PackedPass2`, pass 2 of layers ``C .. G-1`` of each
      scanned group; words ``[S, W]``.
    second_next: ``C`` :class:`PackedPass2`, pass 2 of the first ``C`` layers of the group
      after each scanned group (the tail's first ``C`` after the last); words ``[S, W]``.
    second_head: ``C`` :class:`PackedPass2`, pass 2 of layers ``0 .. C-1``.
    first_tail: ``T`` weights, pass 1 of the tail layers.
    second_tail: ``T - C`` :class:`PackedPass2`, pass 2 of the tail's layers after its
      first ``C``.
    group: ``G``; ``carried``: ``C``.
  All ``second_*`` words live in pinned host memory when pass 2 is offloaded; at most
  ``G + C`` layers' pass 2 are on the device at once, as prefetch buffers.
  """
  first_body: CodebookWeight | None
  second_rest: tuple[PackedPass2, ...]
  second_next: tuple[PackedPass2, ...]
  second_head: tuple[PackedPass2, ...]
  first_tail: tuple[CodebookWeight, ...]
  second_tail: tuple[PackedPass2, ...]
  group: int

  @property
  def carried(self) -> int:
    """Layers whose pass 2 the scan carries on the device at the start (``C``)."""
    return len(self.second_head)

  @property
  def scanned_groups(self) -> int:
    """Groups of ``group`` layers the scan runs (0 without a scanned body)."""
    return 0 if self.first_body is None else self.first_body.codes.shape[0]

  @property
  def num_layers(self) -> int:
    """Layers in the stack: the scanned groups' and the tail's."""
    return self.scanned_groups * self.group + len(self.first_tail)

  def _seconds(self) -> list[PackedPass2]:
    return [*self.second_head, *self.second_next, *self.second_rest, *self.second_tail]

  def pass2_bytes(self) -> int:
    """Bytes of every layer's pass 2, wherever it lives (host or device)."""
    return sum(w.nbytes for w in self._seconds())

  def prefetch_buffer_bytes(self) -> int:
    """Most bytes of pass 2 on the device at once during the forward (``G + C`` layers'),
    on top of :meth:`device_bytes`."""
    one = self.second_head[0].nbytes
    return min(self.group + self.carried, self.num_layers) * one

  def device_bytes(self) -> int:
    """Bytes of the arrays that live in device memory."""
    leaves = jax.tree_util.tree_leaves(self)
    return sum(a.nbytes for a in leaves
               if getattr(a.sharding, "memory_kind", "device") in (None, "device"))


jax.tree_util.register_dataclass(
    LayerStack, data_fields=["first_body", "second_rest", "second_next", "second_head",
                             "first_tail", "second_tail"],
    meta_fields=["group"])


def _stack(ws: Sequence[CodebookWeight]) -> CodebookWeight:
  return jax.tree.map(lambda *a: jnp.stack(a), *ws)


def stack_layers(layers: Sequence[CodebookWeight], *, offload_pass2: bool = True,
                 group: int = DEFAULT_GROUP, carried: int | None = None) -> LayerStack:
  """Arranges two-pass layers for :func:`make_stacked_forward`, pass 2 in pinned host
  memory (``offload_pass2=True``) or on the device (for comparison).

  ``group``: layers per scan step; ``carried``: how many of a step's layers get their
  pass 2 from the previous step (default ``group``: all of them); see
  :class:`LayerStack`. Up to ``group + carried`` layers' pass 2 are on the device at once
  as prefetch buffers. BENCHMARKS.md has what the choices gave on the H100.

  Args:
    layers: ``L >= 2`` two-pass :class:`CodebookWeight` (``quantize_codebook(...,
      passes=2)``) of one square shape ``[D, D]`` (each layer's output feeds the next),
      with the same ``group_size``, ``rotation``, ``seed`` and norm dtypes.
    offload_pass2: keep pass 2 in ``pinned_host`` memory (True) or on the device.
    group: ``G``, layers per scan step, a positive int (capped at ``L``).
    carried: ``C`` in ``[1, min(G, L)]``, layers per step whose pass 2 the previous step
      copied; None for ``C = G``.

  Returns:
    A :class:`LayerStack` of ``S = (L - C) // G`` scanned groups and ``L - S * G`` tail
    layers, pass 1 on the device and pass 2 packed (:class:`PackedPass2`) in the chosen
    memory; :attr:`LayerStack.prefetch_buffer_bytes` is the device memory its prefetch
    buffers take.

  Raises:
    ValueError: naming the bad value, for fewer than 2 layers, a layer that is not a
      two-pass CodebookWeight, layers that differ in shape, group size, rotation, seed or
      norm dtypes, a non-square shape, a ``group`` or ``carried`` out of range, or a
      memory kind this device does not have (e.g. ``pinned_host`` where it is missing:
      pass ``offload_pass2=False``).
  """
  if len(layers) < 2:
    raise ValueError(f"stack_layers needs at least 2 layers, got {len(layers)}")
  if not isinstance(group, int) or group < 1:
    raise ValueError(f"group={group!r} must be a positive int (layers per scan step)")
  for i, w in enumerate(layers):
    if not isinstance(w, CodebookWeight) or w.passes != 2:
      raise ValueError(f"layer {i} must be a two-pass CodebookWeight (quantize_codebook("
                       f"..., passes=2)), got {type(w).__name__}")
  static = lambda w: (w.shape, w.group_size, w.rotation, w.seed)
  norm_dtypes = lambda w: (jnp.dtype(w.norms.dtype).name, jnp.dtype(w.norms2.dtype).name)
  for i, w in enumerate(layers):
    if static(w) != static(layers[0]):
      raise ValueError(
          f"layer {i} has (shape, group_size, rotation, seed)={static(w)} but layer 0 has "
          f"{static(layers[0])}: stacked layers share them (quantize every layer with the "
          f"same seed=...)")
    if norm_dtypes(w) != norm_dtypes(layers[0]):
      raise ValueError(
          f"layer {i} has norms / norms2 of dtypes {norm_dtypes(w)} but layer 0 has "
          f"{norm_dtypes(layers[0])}: stacked layers share them (quantize every layer "
          "with the same norm_dtype=...)")
  kind = "pinned_host" if offload_pass2 else "device"
  _check_memory_kind(kind)
  put = lambda w: jax.tree.map(lambda a: _put(a, kind), w)
  num, g = len(layers), min(group, len(layers))
  c = g if carried is None else carried
  if not isinstance(c, int) or not 1 <= c <= g:
    raise ValueError(f"carried={carried!r} must be an int in [1, {g}] (the group of {g} "
                     "layers per scan step); leave it None to carry the whole group")
  k, n = layers[0].shape
  if k != n:  # each layer's output is the next one's input
    raise ValueError(f"layer 0 has shape ({k}, {n}); a stack of layers needs square [D, D] "
                     "weights (each layer's output feeds the next)")
  scanned = (num - c) // g  # >= 0: c <= g <= num
  firsts = [w.first_pass() for w in layers]
  seconds = [PackedPass2.pack(_to_device(w)) for w in layers]
  steps = range(scanned)
  by_step = lambda j: put(_stack([seconds[s * g + j] for s in steps]))
  tail = range(scanned * g, num)
  return LayerStack(
      first_body=_stack([_stack(firsts[s * g:(s + 1) * g]) for s in steps]) if scanned else None,
      second_rest=tuple(by_step(j) for j in range(c, g)) if scanned else (),
      second_next=tuple(by_step(g + j) for j in range(c)) if scanned else (),
      second_head=tuple(put(seconds[j]) for j in range(c)),
      first_tail=tuple(firsts[i] for i in tail),
      second_tail=tuple(put(seconds[i]) for i in tail[c:]),
      group=g)


def rms_normalize(h: jax.Array, y: jax.Array) -> jax.Array:
  """The default layer step: ``y`` scaled to unit RMS per row, in h's dtype."""
  y = y.astype(jnp.float32)
  y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
  return y.astype(h.dtype)


def _take(w: CodebookWeight, i: int) -> CodebookWeight:
  return jax.tree.map(lambda a: a[i], w)


def make_stacked_forward(layer_fn: Callable[[jax.Array, jax.Array], jax.Array] = rms_normalize,
                         *, implementation: str | None = None,
                         compiler_options: dict[str, Any] | None = None
                         ) -> Callable[..., jax.Array]:
  """A jitted ``forward(stack: LayerStack, x [M, K]) -> [M, N]``: for each layer,
  ``h = layer_fn(h, qjax.matmul(h, W_i))``, with pass 2 copied to the device ahead of its
  layer (see :class:`LayerStack` for the schedule).

  ``implementation``: each layer's :func:`qjax.matmul` implementation (None: the best
  available). ``compiler_options``: XLA options of the jitted forward; the default on a
  GPU is :data:`GPU_COMPILER_OPTIONS` (no command buffers, the latency-hiding
  scheduler), under which the copies overlap the compute; none elsewhere.
  """

  def layer(h, first, second):
    y = dispatch.matmul(h, second.attach(first), implementation=implementation)
    return layer_fn(h, y)

  def forward(stack: LayerStack, x: jax.Array) -> jax.Array:
    carried = [_to_device(w) for w in stack.second_head]
    h = x
    if stack.scanned_groups:
      def step(carry, xs):
        h, carried = carry
        firsts, rest_host, next_host = xs
        rest = [_to_device(w) for w in rest_host]  # own buffers: copied while h computes
        for j, second in enumerate(carried):
          h = layer(h, _take(firsts, j), second)
        carried_next = [_to_device(w) for w in next_host]  # the next step's carried buffers
        for j, second in enumerate(rest, start=len(carried)):
          h = layer(h, _take(firsts, j), second)
        # Ties the carried copies to the step's last layer, so that moving them into the
        # loop-carried buffers is not scheduled ahead of the layers (M = 1 on the H100:
        # 5971 -> 5810 us for 32 layers of 4096x4096).
        h, carried_next = jax.lax.optimization_barrier((h, carried_next))
        return (h, carried_next), None

      (h, carried), _ = jax.lax.scan(
          step, (h, carried), (stack.first_body, stack.second_rest, stack.second_next))
    rest = [_to_device(w) for w in stack.second_tail]
    for first, second in zip(stack.first_tail, [*carried, *rest]):
      h = layer(h, first, second)
    return h

  if compiler_options is None:
    compiler_options = default_compiler_options()
  return jax.jit(forward, compiler_options=compiler_options)


def default_compiler_options() -> dict[str, Any]:
  """The stacked forward's XLA options on this machine: :data:`GPU_COMPILER_OPTIONS` on a
  GPU, none elsewhere."""
  return dict(GPU_COMPILER_OPTIONS) if jax.devices()[0].platform == "gpu" else {}
