"""Quantized weights across devices with ``jax.sharding``: placement, shard_map, psum.

Two ways to run a split weight (the split rules are in :mod:`qjax._src.split_rules`):

* Plain ``jax.jit`` over a weight whose arrays carry NamedShardings
  (:func:`shard_weight`): XLA partitions the XLA path (GSPMD). Nothing to change in the
  caller, but a Pallas kernel is one opaque call that XLA does not partition. On a mesh
  of explicit axes (``jax.make_mesh``'s default) the XLA path runs under
  ``jax.sharding.auto_axes`` (:func:`explicit_output_sharding`), and
  ``implementation=None`` picks it over the kernels.
* ``shard_map`` over a :class:`ShardedWeight`: each device runs :func:`qjax.matmul` (its
  Pallas kernel on a GPU) on its own slices; row-parallel partial outputs are summed with
  ``psum`` in float32. :func:`sharded_matmul` and :func:`sharded_moe_matmul` do this for
  one product; inside any shard_map body, ``qjax.matmul(x, sharded_weight)`` does the
  right local product and reduction by itself.

Why a wrapper: a weight's logical shape is static pytree metadata, so inside shard_map a
weight class rebuilt from per-device slices would carry the global shape and fail its own
shape check. :class:`ShardedWeight` carries the arrays and the global metadata and builds
the per-device weight (local logical shape) on demand.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qjax._src import autodiff
from qjax._src import dispatch
from qjax._src import formats
from qjax._src import moe
from qjax._src import split_rules as rules


def _axes(axis: Any) -> tuple[Any, ...]:
  """``axis`` as a tuple of mesh axis names."""
  return axis if isinstance(axis, tuple) else (axis,)


def mesh_axis_size(mesh: jax.sharding.Mesh, axis: Any) -> int:
  """Devices along ``axis`` (a mesh axis name or a tuple of names)."""
  names = _axes(axis)
  for a in names:
    if a not in mesh.shape:
      raise ValueError(f"mesh axis {a!r} is not in the mesh {dict(mesh.shape)}")
  return int(np.prod([mesh.shape[a] for a in names]))


def shard_map(f, mesh, in_specs, out_specs):
  """``jax.shard_map`` (jax >= 0.7) or ``jax.experimental.shard_map.shard_map``, with the
  replication check off (Pallas calls carry no replication rule)."""
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
  from jax.experimental.shard_map import shard_map as _sm  # pylint: disable=g-import-not-at-top
  return _sm(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _is_host_source(a: Any) -> bool:
  """A host array (numpy, memory map, or a lazy view with shape / dtype / __getitem__)."""
  return not isinstance(a, jax.Array) and hasattr(a, "shape") and hasattr(a, "__getitem__")


def place(a: Any, sharding: NamedSharding) -> jax.Array:
  """``a`` placed with ``sharding``. A host array goes through
  ``jax.make_array_from_callback``: each device receives only its slice, read from the
  host array (or lazy view) by index, and no device ever holds the whole array."""
  if _is_host_source(a):
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(a.dtype))  # float64 -> float32 without x64
    return jax.make_array_from_callback(
        tuple(a.shape), sharding, lambda idx: np.asarray(a[idx], dtype), dtype=dtype)
  return jax.device_put(a, sharding)


def shard_weight(w: Any, mesh: jax.sharding.Mesh, axis: Any, mode: str = "column") -> Any:
  """``w`` (same class) with every array placed by a NamedSharding of ``mode``.

  Args:
    w: a quantized weight of logical shape ``[K, N]`` (leading stacked-layer or expert
      axes allowed); host (numpy) arrays are sliced per device without a full device copy.
    mesh: the device mesh.
    axis: the mesh axis (or tuple of axes) to split along.
    mode: "column" (N), "row" (K) or "expert" (the leading expert axis).

  Returns:
    The weight with global arrays placed across the devices: usable under plain
    ``jax.jit`` (the XLA path is partitioned by XLA), or wrapped for shard_map with
    :meth:`ShardedWeight.of`.

  Raises:
    ValueError: the split would cut a group, a packed word or tile, or is uneven; the
      message names the sizes and the nearest valid device counts.
  """
  n = mesh_axis_size(mesh, axis)
  rules.check_split(w, mode, n)
  specs = rules.field_specs(w, mode, axis)
  arrays = {f: None if s is None else place(getattr(w, f), NamedSharding(mesh, s))
            for f, s in specs.items()}
  return type(w)(**arrays, **rules.static_of(w))


def _spec_names(entry: Any) -> tuple[Any, ...]:
  """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _typed_spec(a: Any) -> tuple[Any, tuple[Any, ...]] | None:
  """``(abstract mesh, spec padded to a.ndim)`` of ``a``'s type where an explicit mesh
  axis shards it (``jax.make_mesh``'s default axis type), else None. Arrays placed on
  meshes of ``Auto`` axes carry no axes in their type: GSPMD partitions them freely."""
  typeof = getattr(jax, "typeof", None)
  if typeof is None or not hasattr(a, "ndim"):
    return None
  sharding = getattr(typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or not any(_spec_names(e) for e in spec):
    return None
  return sharding.mesh, tuple(spec) + (None,) * (a.ndim - len(spec))


def has_explicit_axes(*trees: Any) -> bool:
  """Whether an explicit mesh axis shards any array of ``trees`` (see
  :func:`explicit_output_sharding`)."""
  return any(_typed_spec(a) is not None for a in jax.tree.leaves(trees))


def explicit_output_sharding(x2: jax.Array, w: Any) -> NamedSharding | None:
  """The sharding of ``x2 @ W`` (``[M, N]``) where explicit mesh axes shard ``x2``
  (``[M, K]``) or ``w``'s arrays, else None.

  Under explicit sharding every op needs an unambiguous output sharding, which the XLA
  paths' reshapes and gathers of a split weight do not have, so :func:`qjax.matmul` runs
  them under ``jax.sharding.auto_axes`` (GSPMD, as for meshes of ``Auto`` axes) and gives
  y this sharding: M as x's rows, N as the weight's N axis (column-parallel: split like
  the weight's columns; row-parallel: whole, the partial products summed by XLA). A
  format without a split rule keeps N whole.
  """
  x_typed = _typed_spec(x2)
  mesh = x_typed[0] if x_typed is not None else next(
      (t[0] for a in jax.tree.leaves(w) if (t := _typed_spec(a)) is not None), None)
  if mesh is None:
    return None
  m_entry = x_typed[1][0] if x_typed is not None else None
  n_entry = None
  try:
    fields = rules.rule_of(w).fields
  except TypeError:  # no split rule: nothing says which array axis is N
    fields = ()
  for name, fa in fields:
    a = getattr(w, name, None)
    t = _typed_spec(a) if a is not None and fa.n is not None else None
    if t is not None and t[1][a.ndim + fa.n] is not None:
      n_entry = t[1][a.ndim + fa.n]
      break
  if set(_spec_names(n_entry)) & set(_spec_names(m_entry)):
    n_entry = None  # a mesh axis shards one dimension only; x's rows keep it
  return NamedSharding(mesh, P(m_entry, n_entry))


def under_explicit_axes(fn: Callable[..., jax.Array], rows: jax.Array,
                        w: Any) -> Callable[..., jax.Array]:
  """``fn`` (an XLA path computing ``rows @ W``-shaped ``[M, N]`` output) as it must run
  where explicit mesh axes shard ``rows`` or ``w``: under ``jax.sharding.auto_axes`` with
  :func:`explicit_output_sharding`'s output sharding; ``fn`` itself elsewhere."""
  out_sharding = explicit_output_sharding(rows, w)
  if out_sharding is None:
    return fn
  return jax.sharding.auto_axes(fn, out_sharding=out_sharding)


def explicit_axes_decline_kernels(x: Any, w: Any, implementation: str | None) -> bool:
  """Whether ``implementation=None`` takes the XLA path because explicit mesh axes shard
  ``x`` or ``w`` (not a :class:`ShardedWeight`): a kernel is one call XLA does not
  partition. Inside ``shard_map`` a ShardedWeight still runs the kernels."""
  return (implementation is None and not isinstance(w, ShardedWeight)
          and has_explicit_axes(x, w))


@dataclasses.dataclass(frozen=True)
class ShardedWeight:
  """A quantized weight split along one mesh axis, as it crosses a shard_map boundary.

  Outside shard_map its arrays are the global ones (placed with NamedShardings);
  inside, each device sees its own slices, and :meth:`local` builds the per-device weight
  of local logical shape (``[K, N // n]`` column-wise, ``[K // n, N]`` row-wise, E // n
  experts expert-wise). :func:`qjax.matmul` and :func:`qjax.moe_matmul` accept it in
  both places: inside shard_map they multiply by the local weight and reduce row-parallel
  partial outputs with ``psum`` in float32; outside they use the global weight.

  Attributes:
    arrays: ``{field: array or None}``, the weight's array fields (e.g. codes
      ``[Kp // 8, N]`` uint32 globally, ``[Kp // 8, N // n]`` inside a column shard).
    format_cls: the weight's class.
    static: ``((field, value), ...)``, the global static metadata.
    mode: "column", "row" or "expert".
    axis: the mesh axis name (or tuple of names).
    num_shards: devices along ``axis``.
    split_sizes: ``(field, axis from the end, global size)`` of the cut arrays; tells a
      global array from a per-device slice.

  >>> import jax, jax.numpy as jnp, numpy as np, qjax
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  >>> sw = qjax.ShardedWeight.of(w, mesh, "tp", "row")
  >>> sw.shape, sw.partition_specs().arrays["codes"] == jax.sharding.PartitionSpec("tp", None)
  ((256, 64), True)
  """
  arrays: dict[str, Any]
  format_cls: type = dataclasses.field(metadata={"static": True})
  static: tuple[tuple[str, Any], ...] = dataclasses.field(metadata={"static": True})
  mode: str = dataclasses.field(metadata={"static": True})
  axis: Any = dataclasses.field(metadata={"static": True})
  num_shards: int = dataclasses.field(metadata={"static": True})
  split_sizes: tuple[tuple[str, int, int], ...] = dataclasses.field(
      metadata={"static": True})

  @classmethod
  def wrap(cls, w: Any, axis: Any, mode: str, num_shards: int) -> "ShardedWeight":
    """Wraps a global weight (its arrays left where they are) after checking the split."""
    if isinstance(w, ShardedWeight):
      raise TypeError("the weight is already a ShardedWeight")
    rules.check_split(w, mode, num_shards)
    arrays = {f: getattr(w, f) for f in formats.array_field_names(type(w))}
    return cls(arrays=arrays, format_cls=type(w),
               static=tuple(sorted(rules.static_of(w).items())), mode=mode, axis=axis,
               num_shards=num_shards, split_sizes=rules.split_sizes(w, mode))

  @classmethod
  def of(cls, w: Any, mesh: jax.sharding.Mesh, axis: Any, mode: str = "column"
         ) -> "ShardedWeight":
    """``w`` placed across ``mesh`` (:func:`shard_weight`) and wrapped for shard_map."""
    if isinstance(w, ShardedWeight):
      raise TypeError("the weight is already a ShardedWeight")
    return cls.wrap(shard_weight(w, mesh, axis, mode), axis, mode, mesh_axis_size(mesh, axis))

  # -- views --------------------------------------------------------------------------

  @property
  def is_local(self) -> bool:
    """True inside shard_map (the arrays are per-device slices); with one shard, local
    and global coincide and this is False."""
    for name, ax, size in self.split_sizes:
      a = self.arrays[name]
      if a is not None and hasattr(a, "shape") and len(a.shape) >= -ax:
        return int(a.shape[ax]) != size
    return False

  @property
  def global_shape(self) -> tuple[int, int]:
    """The whole weight's logical ``(K, N)``, on every device and outside shard_map."""
    return dict(self.static)["shape"]

  @property
  def shape(self) -> tuple[int, int]:
    """The logical ``(K, N)`` of what the arrays hold now: local inside shard_map."""
    if self.is_local:
      return rules.local_static(dict(self.static), self.mode, self.num_shards)["shape"]
    return self.global_shape

  def weight(self) -> Any:
    """The global weight (outside shard_map)."""
    return self.format_cls(**self.arrays, **dict(self.static))

  def local(self) -> Any:
    """The per-device weight of local logical shape (inside shard_map)."""
    static = rules.local_static(dict(self.static), self.mode, self.num_shards)
    return self.format_cls(**self.arrays, **static)

  def as_weight(self) -> Any:
    """:meth:`local` inside shard_map, :meth:`weight` outside."""
    return self.local() if self.is_local else self.weight()

  def partition_specs(self) -> "ShardedWeight":
    """This pytree with a PartitionSpec in place of every array (shard_map in_specs)."""
    specs = rules.field_specs(self.parts(), self.mode, self.axis)
    return dataclasses.replace(self, arrays=specs)

  def parts(self) -> rules.Parts:
    """The global weight's parts, not built (no shape checks)."""
    return rules.Parts(self.format_cls, dict(self.static), dict(self.arrays))

  def map_local(self, fn: Any, mesh: jax.sharding.Mesh) -> "ShardedWeight":
    """``fn`` applied to each device's local weight inside shard_map, with no
    communication: e.g. a lossless layout conversion per shard (``lambda w:
    qjax.GGUFTiledWeight.from_gguf(w)``, ``lambda w: w.to_int4()``).

    ``fn`` must give a weight whose shards form a valid split of the same mode (for a
    row split, whole tiles of the new layout per device); the result says otherwise.
    """
    n = self.num_shards
    local_abstract = self.format_cls(
        **{f: None if a is None else _shard_struct(a, self.parts(), f, self.mode, n)
           for f, a in self.arrays.items()},
        **rules.local_static(dict(self.static), self.mode, n))
    out = jax.eval_shape(fn, local_abstract)
    p = rules.parts_of(out)
    whole = rules.Parts(p.cls, rules.global_static(p.static, self.mode, n),
                        {f: None if a is None else _whole_struct(a, p, f, self.mode, n)
                         for f, a in p.arrays.items()})
    rules.check_split(whole, self.mode, n)
    specs = rules.field_specs(whole, self.mode, self.axis)

    def body(sw):
      return rules.parts_of(fn(sw.local())).arrays

    arrays = jax.jit(shard_map(body, mesh, in_specs=(self.partition_specs(),),
                               out_specs=specs))(self)
    return ShardedWeight(arrays=arrays, format_cls=p.cls,
                         static=tuple(sorted(whole.static.items())), mode=self.mode,
                         axis=self.axis, num_shards=n,
                         split_sizes=rules.split_sizes(whole, self.mode))

  # -- products -----------------------------------------------------------------------

  def matmul(self, x: jax.Array, *, implementation: str | None = None) -> jax.Array:
    """``x @ W`` (see :func:`qjax.matmul`). Inside shard_map: column-wise, x ``[..., K]``
    -> this device's columns ``[..., N // n]``; row-wise, x ``[..., K // n]`` (this
    device's slice of K) -> the full ``[..., N]``: each device's partial product (in x's
    dtype, as its kernel returns it, accumulated in float32) is summed over the axis in
    float32 and rounded to x's dtype once."""
    if self.mode == "expert":
      raise ValueError("an expert-parallel weight multiplies through qjax.moe_matmul")
    if not self.is_local:
      return dispatch.matmul(x, self.weight(), implementation=implementation)
    y = dispatch.matmul(x, self.local(), implementation=implementation)
    if self.mode == "row":
      y = jax.lax.psum(y.astype(jnp.float32), self.axis).astype(x.dtype)
    return y

  def moe_matmul(self, x: jax.Array, expert_ids: jax.Array, *,
                 implementation: str | None = None) -> jax.Array:
    """:func:`qjax.moe_matmul` over stacked experts. Inside shard_map, expert-wise: the
    pairs routed to this device's experts are computed (the others run against local
    expert 0 and are zeroed) and the float32 sum over devices (exactly one non-zero term
    per pair) gives ``[T, top_k, N]``; column- and row-wise as :meth:`matmul`."""
    if not self.is_local:
      return moe.moe_matmul(x, self.weight(), expert_ids, implementation=implementation)
    w = self.local()
    if self.mode == "expert":
      e_local = rules.num_experts(w)
      rel = expert_ids - jax.lax.axis_index(self.axis) * e_local
      mine = (rel >= 0) & (rel < e_local)
      y = moe.moe_matmul(x, w, jnp.where(mine, rel, 0).astype(expert_ids.dtype),
                         implementation=implementation)
      y = jnp.where(mine[..., None], y.astype(jnp.float32), 0.0)
      y = jax.lax.psum(y, self.axis).astype(x.dtype)
      # An id outside every device's experts: a NaN row, as unsharded.
      _, valid = moe.checked_experts(expert_ids.reshape(-1),
                                     e_local * jax.lax.psum(1, self.axis))
      return moe.nan_rows(y.reshape(-1, y.shape[-1]), valid).reshape(y.shape)
    y = moe.moe_matmul(x, w, expert_ids, implementation=implementation)
    if self.mode == "row":
      y = jax.lax.psum(y.astype(jnp.float32), self.axis).astype(x.dtype)
    return y


def _resized(a: Any, p: rules.Parts, field: str, mode: str, scale) -> jax.ShapeDtypeStruct:
  fa = rules.rule_of(p).axes(field)
  shape = list(a.shape)
  ax = rules.split_axis(fa, len(shape), mode)
  if ax is not None:
    shape[ax] = scale(shape[ax])
  return jax.ShapeDtypeStruct(tuple(shape), a.dtype)


def _shard_struct(a, p, field, mode, n):
  return _resized(a, p, field, mode, lambda d: d // n)


def _whole_struct(a, p, field, mode, n):
  return _resized(a, p, field, mode, lambda d: d * n)


jax.tree_util.register_dataclass(
    ShardedWeight, data_fields=["arrays"],
    meta_fields=["format_cls", "static", "mode", "axis", "num_shards", "split_sizes"])


def _lead_spec(ndim: int, last: Any) -> P:
  return P(*([None] * (ndim - 1)), last)


def check_mesh(sw: ShardedWeight, mesh: jax.sharding.Mesh, axis: Any) -> None:
  """Raises ValueError unless ``sw`` was split along ``axis`` over as many devices as
  ``mesh[axis]`` has (a weight wrapped for another mesh would fail deep in shard_map or
  in the format's shape check, naming per-device sizes)."""
  if _axes(axis) != _axes(sw.axis):
    raise ValueError(f"the ShardedWeight is split along mesh axis {sw.axis!r}, not "
                     f"{axis=}; pass axis={sw.axis!r} or wrap the weight along {axis!r}")
  n = mesh_axis_size(mesh, sw.axis)
  if n != sw.num_shards:
    raise ValueError(
        f"the ShardedWeight is split over {sw.num_shards} devices along {sw.axis!r}, but "
        f"the mesh has {n} along it ({dict(mesh.shape)}); wrap the weight for this mesh "
        "with qjax.ShardedWeight.of(w, mesh, axis, mode)")


def _check_k(x: jax.Array, sw: ShardedWeight) -> None:
  k = sw.global_shape[0]
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"x.shape={tuple(x.shape)}: the last dim must equal K={k} of the "
                     f"weight of shape {sw.global_shape} (pass the whole x; a row-parallel "
                     "product splits it along K itself)")


def sharded_matmul(x: jax.Array, w: Any, mesh: jax.sharding.Mesh, axis: Any,
                   mode: str = "column", *, implementation: str | None = None) -> jax.Array:
  """``y = x @ W`` with W split over ``mesh[axis]``, one :func:`qjax.matmul` per device.

  Args:
    x: ``[..., K]`` (global; column-wise replicated on every device, row-wise split
      along K to match W's rows).
    w: a quantized weight ``[K, N]`` (placed here) or a :class:`ShardedWeight`.
    mesh, axis: the devices and the mesh axis (or tuple of axes) to split over; a
      ShardedWeight must have been split along ``axis`` over as many devices.
    mode: "column" or "row" (ignored when ``w`` is a ShardedWeight).
    implementation: passed to each device's :func:`qjax.matmul` (None: the Pallas kernel
      on NVIDIA GPUs, XLA elsewhere).

  Returns:
    ``[..., N]`` in x's dtype: column-wise split along N across the devices, row-wise the
    float32 sum of the partial products, replicated.

  Raises:
    ValueError: x's last dim is not K, W cannot split over ``mesh[axis]``, or a
      ShardedWeight was split along another axis or over another number of devices.

  >>> import jax, jax.numpy as jnp, numpy as np, qjax
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  >>> x = jnp.ones((2, 256), jnp.float32)
  >>> qjax.sharded_matmul(x, w, mesh, "tp", "row").shape
  (2, 64)
  """
  sw = w if isinstance(w, ShardedWeight) else ShardedWeight.of(w, mesh, axis, mode)
  if sw.mode == "expert":
    raise ValueError("expert-parallel weights multiply through qjax.sharded_moe_matmul")
  check_mesh(sw, mesh, axis)
  _check_k(x, sw)
  return _sharded_matmul(x, sw, mesh=mesh, implementation=implementation)


@autodiff.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("mesh", "implementation"))
def _sharded_matmul(x, sw, *, mesh, implementation):
  if sw.mode == "column":
    x_spec, y_spec = P(), _lead_spec(x.ndim, sw.axis)
  else:
    x_spec, y_spec = _lead_spec(x.ndim, sw.axis), P()
  fn = shard_map(lambda x_, w_: w_.matmul(x_, implementation=implementation), mesh,
                 in_specs=(x_spec, sw.partition_specs()), out_specs=y_spec)
  return fn(place(x, NamedSharding(mesh, x_spec)), sw)


def sharded_moe_matmul(x: jax.Array, w: Any, expert_ids: jax.Array,
                       mesh: jax.sharding.Mesh, axis: Any, mode: str = "expert", *,
                       implementation: str | None = None) -> jax.Array:
  """:func:`qjax.moe_matmul` with the stacked experts split over ``mesh[axis]``.

  Args:
    x: ``[T, K]`` or ``[T, top_k, K]`` (replicated; row-wise split along K).
    w: an expert stack :func:`qjax.moe_matmul` takes (e.g. :class:`qjax.MXFP4Weight` or
      :class:`qjax.Int4Weight` of E experts, codes ``[E, K // 8, N]``) or a
      :class:`ShardedWeight` of one.
    expert_ids: ``[T, top_k]`` integers in ``[0, E)`` (replicated).
    mesh, axis: as :func:`sharded_matmul`'s.
    mode: "expert" (E // n whole experts per device), "column" or "row" (ignored when
      ``w`` is a ShardedWeight).
    implementation: passed to each device's :func:`qjax.moe_matmul`.

  Returns:
    ``[T, top_k, N]`` in x's dtype (column-wise split along N; otherwise replicated).
  """
  sw = w if isinstance(w, ShardedWeight) else ShardedWeight.of(w, mesh, axis, mode)
  check_mesh(sw, mesh, axis)
  _check_k(x, sw)
  # Concrete ids out of range are refused, as qjax.moe_matmul refuses them (each device
  # saw only its experts and gave NaN rows).
  moe.check_ids_in_range(expert_ids, rules.num_experts(sw.weight()))
  return _sharded_moe_matmul(x, sw, expert_ids, mesh=mesh, implementation=implementation)


@autodiff.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("mesh", "implementation"))
def _sharded_moe_matmul(x, sw, expert_ids, *, mesh, implementation):
  x_spec, y_spec = P(), P()
  if sw.mode == "column":
    y_spec = P(None, None, sw.axis)
  elif sw.mode == "row":
    x_spec = _lead_spec(x.ndim, sw.axis)
  fn = shard_map(
      lambda x_, w_, ids: w_.moe_matmul(x_, ids, implementation=implementation), mesh,
      in_specs=(x_spec, sw.partition_specs(), P()), out_specs=y_spec)
  return fn(place(x, NamedSharding(mesh, x_spec)), sw,
            place(expert_ids, NamedSharding(mesh, P())))
