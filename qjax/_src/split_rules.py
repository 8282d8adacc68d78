"""How each quantized format splits across devices: column-, row- and expert-parallel.

A weight of logical shape ``[K, N]`` (``y = x @ W``) splits three ways over ``n`` devices:

* ``"column"``: N cut into ``n`` equal runs of columns. Every array that has an N axis
  (codes, scales, zero points, biases, GGUF block rows) is cut along it; nothing else
  changes, so device ``d`` computes columns ``[d N / n, (d + 1) N / n)`` of ``y``.
* ``"row"``: K cut into ``n`` equal runs of rows; device ``d`` multiplies its slice of x's
  last axis and the partial outputs are summed (``psum``). A shard must hold whole groups
  (one scale row each), whole packed words and, for tile-ordered codes, whole tiles: codes
  ``[Kp // 8, N]`` in tile order 128 store 128 rows per 16 words, so a cut inside a tile
  would hand a device nibbles of rows it does not own.
* ``"expert"``: the leading expert axis ``E`` of a stacked weight (``[E, Kp // 8, N]``
  codes) cut into ``n`` runs of whole experts.

Each array field is described by :class:`FieldAxes` (where K and N lie, counted from its
last axis, so leading stacked-layer or expert axes are allowed), each format by a
:class:`SplitRule`. Arrays without the split axis (per-tensor scales, codebooks) are
replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from qjax._src import autodiff
from qjax._src import codebook
from qjax._src import fp4
from qjax._src import formats
from qjax._src import gguf_formats as gf
from qjax._src import gguf_tiled
from qjax._src import int4
from qjax._src import int4_nk

MODES = ("column", "row", "expert")


@dataclasses.dataclass(frozen=True)
class FieldAxes:
  """Where one array field keeps K and N.

  Attributes:
    ndim: the field's rank for one ``[K, N]`` weight (extra leading axes are stacked
      layers or experts).
    k: the axis along K (negative, from the last axis), or None if the field has none.
    n: the axis along N (negative), or None.
  """
  ndim: int
  k: int | None
  n: int | None


MATRIX = FieldAxes(ndim=2, k=-2, n=-1)   # [K-ish, N] planes: codes, scales, zeros, ...
SCALAR = FieldAxes(ndim=0, k=None, n=None)
VECTOR = FieldAxes(ndim=1, k=None, n=None)


@dataclasses.dataclass(frozen=True)
class SplitRule:
  """How one weight splits.

  Attributes:
    fields: ``(name, FieldAxes)`` of every array field.
    k_unit: rows of K that every row-parallel shard must hold a multiple of.
    k_unit_why: what those rows are, for error messages.
    row_unsupported: why the format cannot split along K at all, or None.
  """
  fields: tuple[tuple[str, FieldAxes], ...]
  k_unit: int
  k_unit_why: str
  row_unsupported: str | None = None

  def axes(self, name: str) -> FieldAxes:
    return dict(self.fields)[name]


_RULES: dict[type, Callable[[dict[str, Any]], SplitRule]] = {}


def register_split_rule(cls: type, rule: Callable[[dict[str, Any]], SplitRule]) -> None:
  """Registers ``rule(static) -> SplitRule`` for a format class; ``static`` holds the
  weight's static fields (``shape``, ``group_size``, ...)."""
  _RULES[cls] = rule
  autodiff.registry_changed()


def rule_for(cls: type, static: dict[str, Any]) -> SplitRule:
  for klass in cls.__mro__:
    if klass in _RULES:
      return _RULES[klass](static)
  convert = " (convert it first: .to_int4() or .to_mxfp4())" if hasattr(
      cls, "to_int4") or hasattr(cls, "to_mxfp4") else ""
  raise TypeError(f"{cls.__name__} has no sharding rule{convert}; shardable formats: "
                  f"{sorted(c.__name__ for c in _RULES)}")


def static_of(w: Any) -> dict[str, Any]:
  return {f: getattr(w, f) for f in formats.static_field_names(type(w))}


@dataclasses.dataclass(frozen=True)
class Parts:
  """A weight taken apart, not built (so not shape-checked): its class, static fields and
  array fields."""
  cls: type
  static: dict[str, Any]
  arrays: dict[str, Any]


def parts_of(w: Any) -> Parts:
  if isinstance(w, Parts):
    return w
  return Parts(type(w), static_of(w),
               {f: getattr(w, f) for f in formats.array_field_names(type(w))})


def rule_of(w: Any) -> SplitRule:
  """The split rule of a weight (or of its :class:`Parts`)."""
  p = parts_of(w)
  return rule_for(p.cls, p.static)


# ------------------------------------------------------------------------------ rules


def _int4_rule(s: dict[str, Any]) -> SplitRule:
  tile, g = s["tile_k"], s["group_size"]
  return SplitRule(
      fields=(("codes", MATRIX), ("scales", MATRIX), ("zeros", MATRIX), ("biases", MATRIX)),
      k_unit=math.lcm(tile, g),
      k_unit_why=f"whole {tile}-row packed tiles (tile_k={tile}) and whole groups "
                 f"(group_size={g})" + (
                     f"; w.repack(8) stores the same weight in 8-row tiles, losslessly, "
                     f"which needs multiples of {math.lcm(8, g)} rows "
                     f"(flax_layers.splittable_layouts(params, n) does it for a model's "
                     f"weights that need it)" if math.lcm(8, g) < math.lcm(tile, g) else ""))


def _int4_nk_rule(s: dict[str, Any]) -> SplitRule:
  g = s["group_size"]
  return SplitRule(
      fields=(("codes", FieldAxes(ndim=2, k=-1, n=-2)), ("scales", MATRIX),
              ("zeros", MATRIX)),
      k_unit=math.lcm(int4_nk.CHUNK, g),
      k_unit_why=f"whole groups (group_size={g}) of whole {int4_nk.CHUNK}-code runs (the "
                 "codes are permuted within each run)")


def _fp4_rule(block: int, extra: tuple[tuple[str, FieldAxes], ...]):
  def rule(s: dict[str, Any]) -> SplitRule:
    tile = s["tile_k"]
    return SplitRule(
        fields=(("codes", MATRIX), ("scales", MATRIX), *extra),
        k_unit=math.lcm(tile, block),
        k_unit_why=f"whole {tile}-row packed tiles (tile_k={tile}) and whole {block}-row "
                   "scale blocks")
  return rule


def _tiled_rule(s: dict[str, Any]) -> SplitRule:
  scale_rows = gguf_tiled._SPECS[s["ggml_type"]][1]  # pylint: disable=protected-access
  names = ("low", "high", "q8", "d", "dmin", "sc", "mn")
  return SplitRule(
      fields=tuple((n, MATRIX) for n in names),
      k_unit=math.lcm(gguf_tiled.TILE_K, scale_rows),
      k_unit_why=f"whole {gguf_tiled.TILE_K}-row tiles of the plane layout and whole "
                 f"{scale_rows}-row {s['ggml_type']} scale blocks")


def _block_rule(cls: type[gf.GGUFBlockWeight]):
  def rule(s: dict[str, Any]) -> SplitRule:
    del s
    fields = []
    for f in cls.block_fields:  # [N, K // block_size, *tail]
      t = len(f.tail)
      fields.append((f.name, FieldAxes(ndim=2 + t, k=-1 - t, n=-2 - t)))
    return SplitRule(fields=tuple(fields), k_unit=cls.block_size,
                     k_unit_why=f"whole {cls.block_size}-weight {cls.ggml_type} blocks")
  return rule


def _dense_rule(s: dict[str, Any]) -> SplitRule:
  del s
  return SplitRule(fields=(("data", FieldAxes(ndim=2, k=-1, n=-2)),), k_unit=1,
                   k_unit_why="whole rows")


def _codebook_rule(s: dict[str, Any]) -> SplitRule:
  g = s["group_size"]
  return SplitRule(
      fields=(("codes", MATRIX), ("norms", MATRIX), ("codebook", VECTOR),
              ("codes2", MATRIX), ("norms2", MATRIX), ("codebook2", VECTOR)),
      k_unit=math.lcm(128, g), k_unit_why=f"whole 128-row tiles and {g}-row groups",
      row_unsupported="each group's rotation is drawn from its index along K, which a "
                      "row shard does not know; split codebook weights by columns")


register_split_rule(int4.Int4Weight, _int4_rule)
register_split_rule(int4_nk.Int4NKWeight, _int4_nk_rule)
register_split_rule(fp4.MXFP4Weight, _fp4_rule(fp4.MXFP4_BLOCK, ()))
register_split_rule(fp4.NVFP4Weight, _fp4_rule(fp4.NVFP4_BLOCK, (("global_scale", SCALAR),)))
register_split_rule(gguf_tiled.GGUFTiledWeight, _tiled_rule)
for _cls in gf.BLOCK_FORMATS.values():
  register_split_rule(_cls, _block_rule(_cls))
register_split_rule(gf.GGUFDense, _dense_rule)
register_split_rule(codebook.CodebookWeight, _codebook_rule)
del _cls


# ------------------------------------------------------------------------ validation


def _divisors(m: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(m) + 1) if m % d == 0]
  return sorted(set(small + [m // d for d in small]))


def _valid_counts_text(units: int, n: int) -> str:
  """The device counts that divide ``units`` (up to about ``4 n``) and the nearest to n."""
  valid = _divisors(units) if units > 0 else [1]
  shown = [d for d in valid if d <= max(4 * n, 8)]
  below = max((d for d in valid if d < n), default=None)
  above = min((d for d in valid if d > n), default=None)
  nearest = ", ".join(str(d) for d in (below, above) if d is not None)
  more = ", ..." if len(shown) < len(valid) else ""
  return (f"valid device counts: {', '.join(map(str, shown))}{more} (nearest to {n}: "
          f"{nearest})")


def num_experts(w: Any) -> int:
  """E, the leading expert axis (the axis just before a field's own axes)."""
  p = parts_of(w)
  for name, fa in rule_of(p).fields:
    a = p.arrays[name]
    if a is not None and a.ndim > fa.ndim:
      return int(a.shape[a.ndim - fa.ndim - 1])
  raise ValueError(f"{p.cls.__name__} of shape {p.static['shape']} has no leading expert "
                   "axis; expert-parallel needs stacked experts (e.g. codes [E, Kp // 8, N])")


def check_split(w: Any, mode: str, n: int) -> None:
  """Raises ValueError when ``w`` cannot split ``mode``-wise over ``n`` devices, naming
  the sizes and the nearest valid device counts."""
  if mode not in MODES:
    raise ValueError(f"{mode=} must be one of {MODES}")
  if n < 1:
    raise ValueError(f"the mesh axis has {n} devices")
  p = parts_of(w)
  name = p.cls.__name__
  rule = rule_of(p)
  k, nn = p.static["shape"]
  if mode == "column":
    if nn % n:
      raise ValueError(
          f"column-parallel {name}: N={nn} columns do not split evenly over {n} devices; "
          f"{_valid_counts_text(nn, n)}")
    return
  if mode == "expert":
    e = num_experts(p)
    if e % n:
      raise ValueError(f"expert-parallel {name}: E={e} experts do not split evenly over "
                       f"{n} devices; {_valid_counts_text(e, n)}")
    return
  if n == 1:
    return
  if rule.row_unsupported:
    raise ValueError(f"row-parallel {name}: {rule.row_unsupported}")
  u = rule.k_unit
  units = k // u if k % u == 0 else 0
  if k % n or (k // n) % u:
    per = f"{k / n:g}" if k % n else str(k // n)
    hint = "" if units else (
        f"; K={k} is not a multiple of {u} itself, so no split of this layout is valid "
        f"(pad K to a multiple of {u}, or use column-parallel)")
    raise ValueError(
        f"row-parallel {name}: K={k} over {n} devices gives {per} rows per device, but "
        f"each device needs a multiple of {u} rows ({rule.k_unit_why})"
        + (f"; {_valid_counts_text(units, n)}" if units else hint))


def split_axis(fa: FieldAxes, ndim: int, mode: str) -> int | None:
  """The positive axis of an array of rank ``ndim`` that ``mode`` cuts, or None."""
  if mode == "column":
    return None if fa.n is None else ndim + fa.n
  if mode == "row":
    return None if fa.k is None else ndim + fa.k
  lead = ndim - fa.ndim
  return lead - 1 if lead >= 1 else None


def leaf_spec(a: Any, fa: FieldAxes, mode: str, axis: Any) -> P:
  """The PartitionSpec of one array (``axis``: a mesh axis name or a tuple of them)."""
  ax = split_axis(fa, a.ndim, mode)
  spec = [None] * a.ndim
  if ax is not None:
    spec[ax] = axis
  return P(*spec)


def field_specs(w: Any, mode: str, axis: Any) -> dict[str, P | None]:
  """``{field: PartitionSpec or None}`` of every array field of ``w`` (or its Parts)."""
  p = parts_of(w)
  return {name: None if p.arrays[name] is None else
          leaf_spec(p.arrays[name], fa, mode, axis) for name, fa in rule_of(p).fields}


def split_sizes(w: Any, mode: str) -> tuple[tuple[str, int, int], ...]:
  """``(field, axis from the end, global size)`` of every array that ``mode`` cuts."""
  p = parts_of(w)
  out = []
  for name, fa in rule_of(p).fields:
    a = p.arrays[name]
    if a is None:
      continue
    ax = split_axis(fa, a.ndim, mode)
    if ax is not None:
      out.append((name, ax - a.ndim, int(a.shape[ax])))
  return tuple(out)


def partition_specs(w: Any, mode: str, axis: Any) -> Any:
  """A pytree of PartitionSpecs matching ``w``'s leaves (``w``'s class, specs as leaves).

  Use it as shard_map ``in_specs`` or to build NamedShardings: ``jax.tree.map(lambda s:
  NamedSharding(mesh, s), partition_specs(w, "column", "tp"))``. Arrays without the split
  axis (NVFP4's tensor scale, codebooks) get ``P()`` along it (replicated).

  Args:
    w: a quantized weight of a shardable format (Int4Weight, MXFP4Weight, NVFP4Weight,
      ...; ``[E, ...]`` stacked experts for ``mode="expert"``). Only shapes are read.
    mode: "column" (split N), "row" (split K) or "expert" (split the leading expert
      axis).
    axis: the mesh axis name (or tuple of names) to put in the split dimension.

  Returns:
    An instance of ``type(w)`` with ``w``'s static fields and a
    ``jax.sharding.PartitionSpec`` (or None for a None field) in place of each array,
    e.g. ``codes: P("tp", None)`` for an Int4Weight split by rows. Divisibility by the
    mesh size is not checked here (:func:`qjax.shard_weight` checks it).

  Raises:
    ValueError: for a ``mode`` not in ``("column", "row", "expert")``, or
      ``mode="expert"`` for a weight without a leading expert axis.
    TypeError: naming the class, for a format without a sharding rule (with the
      conversion to use, where it has one).

  >>> import jax, qjax
  >>> w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  >>> qjax.partition_specs(w, "row", "tp").codes == jax.sharding.PartitionSpec("tp", None)
  True
  """
  if mode not in MODES:
    raise ValueError(f"{mode=} must be one of {MODES}")
  if mode == "expert":
    num_experts(w)  # a ValueError for a weight without a leading expert axis
  specs = field_specs(w, mode, axis)
  return type(w)(**specs, **static_of(w))


def local_static(static: dict[str, Any], mode: str, n: int) -> dict[str, Any]:
  """The static fields of one shard: the logical shape divided along the split."""
  k, nn = static["shape"]
  out = dict(static)
  if mode == "column":
    out["shape"] = (k, nn // n)
  elif mode == "row":
    out["shape"] = (k // n, nn)
  return out


def global_static(static: dict[str, Any], mode: str, n: int) -> dict[str, Any]:
  """Inverse of :func:`local_static`: the static fields of the whole from one shard's."""
  k, nn = static["shape"]
  out = dict(static)
  if mode == "column":
    out["shape"] = (k, nn * n)
  elif mode == "row":
    out["shape"] = (k * n, nn)
  return out


# ------------------------------------------------------------------------ joining


def concat_columns(weights: Sequence[Any]) -> Any:
  """One weight whose columns are those of ``weights`` side by side, each column's codes,
  scales and zero points as they were (lossless): ``x @ concat_columns([a, b])`` equals
  ``concatenate([x @ a, x @ b], -1)``, in one matmul instead of two. The inverse of a
  column split; what fuses a layer's q / k / v or gate / up projections into one launch.

  Args:
    weights: weights of one format with the same K and static fields (group size, tile
      order, GGUF type, ...), each ``[K, N_i]`` with the same leading (stacked-layer or
      expert) axes; or plain arrays ``[..., K, N_i]`` (joined along the last axis).

  Returns:
    The joined weight, ``[K, sum N_i]``. Arrays are joined with ``jnp.concatenate``, so
    fields of different dtypes promote (bf16 scales beside f16 ones become float32, the
    same values); give the weights one scale dtype to keep it.

  Raises:
    ValueError: no weights, formats or static fields that differ, a field without an N
      axis whose values differ (NVFP4's tensor scale, a codebook; called under
      ``jax.jit`` such a field cannot be compared: join outside jit), or a format without
      a column rule (``register_split_rule``).

  >>> import jax, numpy as np, qjax
  >>> a = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 64)))
  >>> b = qjax.quantize(jax.random.normal(jax.random.key(1), (256, 32)))
  >>> ab = qjax.concat_columns([a, b])
  >>> ab.shape, bool(np.array_equal(ab.dequantize()[:, 64:], b.dequantize()))
  ((256, 96), True)
  """
  weights = list(weights)
  if not weights:
    raise ValueError("concat_columns needs at least one weight; got none")
  if not formats.is_quantized(weights[0]):
    return _concat_arrays(weights)
  for i, w in enumerate(weights[1:], 1):
    if not formats.is_quantized(w):
      raise ValueError(f"concat_columns: weights[{i}] ({type(w).__name__}) does not join "
                       f"weights[0], a {type(weights[0]).__name__}; join weights of one "
                       "format")
  ps = [parts_of(w) for w in weights]
  cls = ps[0].cls
  for i, p in enumerate(ps[1:], 1):
    if p.cls is not cls:
      raise ValueError(f"concat_columns: weights[{i}] is a {p.cls.__name__}, weights[0] a "
                       f"{cls.__name__}; join weights of one format (convert them first)")
    mine = {f: v for f, v in p.static.items() if f != "shape"}
    first = {f: v for f, v in ps[0].static.items() if f != "shape"}
    if mine != first or p.static["shape"][0] != ps[0].static["shape"][0]:
      raise ValueError(f"concat_columns: weights[{i}] has static fields {p.static}, "
                       f"weights[0] {ps[0].static}; the joined weights must share K and "
                       "every static field but N")
  try:
    rule = rule_of(ps[0])
  except TypeError:  # rule_for's lookup found none
    raise ValueError(f"concat_columns: {cls.__name__} has no column rule (where its N axis "
                     "lies); register one with qjax.register_split_rule") from None
  arrays = {}
  for name, fa in rule.fields:
    values = [p.arrays[name] for p in ps]
    if all(v is None for v in values):
      arrays[name] = None
    elif any(v is None for v in values):
      raise ValueError(f"concat_columns: {cls.__name__}.{name} is None in some weights and "
                       "not in others; join weights of one layout")
    elif fa.n is None:
      for i, v in enumerate(values[1:], 1):
        if v.shape != values[0].shape or not np.array_equal(np.asarray(v),
                                                             np.asarray(values[0])):
          raise ValueError(f"concat_columns: {cls.__name__}.{name} (no N axis) of weights"
                           f"[{i}] differs from weights[0]'s; such weights cannot share "
                           "one matmul")
      arrays[name] = values[0]
    else:
      arrays[name] = _concat_arrays(values, axis=fa.n, what=f"{cls.__name__}.{name}")
  static = dict(ps[0].static)
  static["shape"] = (static["shape"][0], sum(p.static["shape"][1] for p in ps))
  return cls(**arrays, **static)


def _concat_arrays(values: list[Any], axis: int = -1, what: str = "the arrays") -> jax.Array:
  """``values`` joined along ``axis`` (negative), every other axis equal."""
  shapes = [tuple(np.shape(v)) for v in values]
  for i, shape in enumerate(shapes[1:], 1):
    if formats.is_quantized(values[i]) or len(shape) != len(shapes[0]) or len(shape) < -axis:
      raise ValueError(f"concat_columns: {what}: weights[{i}] ({type(values[i]).__name__} "
                       f"of shape {shape}) does not join weights[0] (shape {shapes[0]})")
    if [d for a, d in enumerate(shape) if a != len(shape) + axis] != [
        d for a, d in enumerate(shapes[0]) if a != len(shape) + axis]:
      raise ValueError(f"concat_columns: {what}: weights[{i}] of shape {shape} and "
                       f"weights[0] of shape {shapes[0]} differ on an axis other than N "
                       f"(axis {axis})")
  return jnp.concatenate(values, axis=axis)
