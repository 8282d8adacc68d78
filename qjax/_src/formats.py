"""The base of every quantized-weight pytree, and the registry of format classes by name.

A format class is a frozen dataclass registered with ``jax.tree_util.register_dataclass``:
its arrays are data fields, everything else (logical shape, group size, layout, dtypes)
is static metadata. Every format has the logical shape ``[K, N]`` of a weight used as
``y = x @ W`` and a ``dequantize()`` that returns that matrix in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

_FORMATS: dict[str, type["QuantizedWeight"]] = {}

T = TypeVar("T", bound=type)


def register_format(cls: T) -> T:
  """Class decorator: registers a frozen dataclass as a pytree and a named format.

  Fields whose ``metadata`` has ``static=True`` (:func:`static_field`) become pytree
  metadata; the others are array leaves (or ``None``). ``cls.format_name`` keys the format
  in saved files (:func:`qjax.save` / :func:`qjax.load`).

  Args:
    cls: a ``@dataclasses.dataclass(frozen=True)`` subclass of :class:`QuantizedWeight`
      with a class attribute ``format_name`` (apply this decorator above the dataclass
      one).

  Returns:
    ``cls`` itself, now a pytree and looked up by ``format_name``.

  Raises:
    ValueError: when another class already registered ``cls.format_name`` (pick a new
      name; re-registering the same class is allowed).
    AttributeError: when ``cls`` has no ``format_name``.
  """
  fields = dataclasses.fields(cls)
  meta = [f.name for f in fields if f.metadata.get("static", False)]
  data = [f.name for f in fields if not f.metadata.get("static", False)]
  jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
  name = cls.format_name
  if name in _FORMATS and _FORMATS[name] is not cls:
    raise ValueError(f"format name {name!r} is already registered by {_FORMATS[name]}")
  _FORMATS[name] = cls
  return cls


def static_field(**kwargs: Any) -> Any:
  """A dataclass field that is pytree metadata (hashable, not traced).

  Args:
    **kwargs: passed to ``dataclasses.field`` (e.g. ``default=128``); not ``metadata``.

  Returns:
    A ``dataclasses.field`` with ``metadata={"static": True}``: :func:`register_format`
    makes it part of the treedef, so ``jax.jit`` retraces when it changes and
    ``jax.tree.map`` leaves it alone. Use it for shapes, group sizes and layouts.
  """
  return dataclasses.field(metadata={"static": True}, **kwargs)


# Format names that files may hold but whose layout changed: what to do instead.
RETIRED_FORMATS = {
    "int4_nk": "Int4NKWeight's codes of session 16 (plain K order); session 17 stores them "
               "in wgmma fragment order (format 'int4_nk.v2'): save the Int4Weight and "
               "convert it again with qjax.to_int4_nk",
    **{f"{fmt}_nk": f"{fmt.upper()}NKWeight's codes of sessions 19-20 (nibbles in order); "
                    f"session 21 stores their bits for the wgmma kernel (format '{fmt}_nk.v2'): "
                    f"save the {fmt.upper()}Weight and convert it again with qjax.to_{fmt}_nk"
       for fmt in ("mxfp4", "nvfp4")},
}


def format_class(name: str) -> type["QuantizedWeight"]:
  try:
    return _FORMATS[name]
  except KeyError:
    if name in RETIRED_FORMATS:
      raise ValueError(f"quantized format {name!r} is retired: {RETIRED_FORMATS[name]}"
                       ) from None
    raise ValueError(
        f"unknown quantized format {name!r}; known formats: {sorted(_FORMATS)}"
    ) from None


def array_field_names(cls: type) -> list[str]:
  return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static", False)]


def static_field_names(cls: type) -> list[str]:
  return [f.name for f in dataclasses.fields(cls) if f.metadata.get("static", False)]


class QuantizedWeight:
  """Base of the quantized-weight pytrees of logical shape ``[K, N]`` (``y = x @ W``).

  A format subclasses it as a frozen dataclass decorated with :func:`register_format`,
  sets ``format_name``, declares its arrays as fields and its static metadata with
  :func:`static_field` (``shape`` at least), and implements :meth:`dequantize`.
  :func:`qjax.matmul` dispatches on the class (:func:`qjax.register_xla`,
  :func:`qjax.register_kernel`), and :func:`qjax.is_quantized` tests for it.

  Attributes:
    format_name: the class's key in saved files (a ClassVar).
    shape: the logical ``(K, N)``, whatever the storage layout; arrays may carry leading
      stack axes (layers, experts) before their own.

  Formats validate shapes and dtypes at construction where the leaves are concrete
  arrays; none checks values (NaN or Inf scales are taken as they are).
  """

  format_name: ClassVar[str]
  shape: tuple[int, int]

  @property
  def k(self) -> int:
    """K: the rows of the logical ``[K, N]`` weight (``y = x @ W``)."""
    return self.shape[0]

  @property
  def n(self) -> int:
    """N: the columns of the logical ``[K, N]`` weight (the output width)."""
    return self.shape[1]

  @property
  def ndim(self) -> int:
    """2: the logical weight is ``[K, N]`` whatever the storage layout."""
    return 2

  @property
  def nbytes(self) -> int:
    """Bytes held by the arrays of this weight (all leading batch dims included)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(self))

  def dequantize(self, dtype=jnp.float32) -> jax.Array:  # pragma: no cover - abstract
    """The ``[K, N]`` weight the stored values stand for, in ``dtype`` (float32 by
    default; each format documents its rounding); the XLA path multiplies by it."""
    raise NotImplementedError

  def _leaves_concrete_2d(self) -> bool:
    """True when every leaf is an array whose shapes can be validated: not, e.g., the
    ``ArgInfo`` stand-ins that ``jax.jit(f).lower(...)`` rebuilds a weight from, nor a
    cotangent of a weight (``jax.grad`` / ``jax.vjp``), whose integer fields are
    ``float0``."""
    leaves = jax.tree_util.tree_leaves(self)
    return bool(leaves) and all(
        hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim")
        and a.dtype != jax.dtypes.float0 for a in leaves)


def check_trailing_fields(w: Any, want: dict[str, tuple[tuple[int, ...], Sequence[Any]]],
                          context: str) -> None:
  """Raises ValueError for the first array field of ``w`` whose last dims or dtype differ
  from ``want[name] = (shape, dtypes)`` (leading batch axes, e.g. stacked layers, are
  free). The message names the field, what it must be and what it is, then ``context``
  (the weight's static fields)."""
  for name, (shape, dtypes) in want.items():
    a = getattr(w, name)
    allowed = [jnp.dtype(d) for d in dtypes]
    if tuple(a.shape[-len(shape):]) != tuple(shape) or jnp.dtype(a.dtype) not in allowed:
      raise ValueError(
          f"{type(w).__name__}.{name} must be {shape} of dtype {[d.name for d in allowed]}"
          f", got {tuple(a.shape)} {jnp.dtype(a.dtype).name} ({context})")


def column_pairs(columns: Callable[..., jax.Array], arrays: Sequence[jax.Array | None],
                 dtype) -> jax.Array:
  """``columns(*arrays)`` in a 16-bit ``dtype``, computed two columns per 32-bit word.

  ``columns`` maps arrays whose last axis is N (or None, passed through) to an
  ``[..., N]`` result in ``dtype`` whose column ``j`` depends only on column ``j`` of
  each input, as a weight's dequantization does. Here it runs once on the even and once
  on the odd columns; each result's bits become one half of a uint32 ``[..., N // 2]``,
  which is then viewed as ``[..., N]`` in ``dtype`` again: the same values, bit for bit.

  Why: XLA's GPU loop fusion writes a 16-bit result an element at a time, far below the
  memory bandwidth; written as uint32 words it is not (H100, dequantizing a 4096 x 14336
  INT4 weight to bf16: 71.5 -> 51.5 us; 8192 x 28672: 287 -> 207 us, where the naive
  program's transposed dequantization takes 54 and 229 us).

  Other dtypes (float32) and an odd N run ``columns(*arrays)`` as it is (cast to
  ``dtype``).
  """
  n = next(a for a in arrays if a is not None).shape[-1]
  if jnp.dtype(dtype).itemsize != 2 or n % 2:
    return columns(*arrays).astype(dtype)

  def half(i):
    part = [None if a is None else a.reshape(*a.shape[:-1], n // 2, 2)[..., i]
            for a in arrays]
    bits = jax.lax.bitcast_convert_type(columns(*part).astype(dtype), jnp.uint16)
    return bits.astype(jnp.uint32)

  words = half(0) | (half(1) << 16)  # little-endian: the even column is the low half
  return jax.lax.bitcast_convert_type(words, dtype).reshape(*words.shape[:-1], n)


def dense_dot(x: jax.Array, wd: jax.Array) -> jax.Array:
  """``x [M, K] @ wd [K, N] -> [M, N]`` in x's dtype with float32 accumulation: the XLA
  fallbacks' dot on a dequantized W (cast to x's dtype here if it is not in it).

  float32 x runs at ``Precision.HIGHEST``. For bf16 / f16 x the dot writes x's dtype
  itself: XLA's GPU GEMMs and its CPU dot accumulate those in float32 and round once,
  which is what a float32 result cast afterwards gives, without writing that float32
  ``[M, N]`` and converting it in a second kernel (H100, M = 2048, K x N = 4096 x 14336:
  439 -> 370 us).
  """
  if x.dtype == jnp.float32:
    return jnp.dot(x, wd.astype(x.dtype), preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
  return jnp.dot(x, wd.astype(x.dtype))


def check_not_quantized(w: Any, name: str) -> None:
  """A ValueError naming ``name`` where ``w``, given to a quantizer, is already a
  quantized weight (its ``ndim`` of 2 passed the quantizers' shape checks, and their
  dtype checks failed with an AttributeError)."""
  if isinstance(w, QuantizedWeight):
    raise ValueError(f"{name} is already quantized ({type(w).__name__} of shape "
                     f"{tuple(w.shape)}); quantize the float weight, or use this one as it "
                     "is (w.dequantize() gives its float values)")


def is_quantized(x: Any) -> bool:
  """Whether ``x`` is a quantized weight (any :class:`QuantizedWeight` format), e.g. as
  the ``is_leaf`` of a ``jax.tree.map`` over a model's params."""
  return isinstance(x, QuantizedWeight)
