"""Model-wide quantization of Flax parameters by rules on parameter paths.

A rule set is an ordered list of :class:`QuantRule` (a regular expression searched in the
``'/'``-joined parameter path, e.g. ``"block_0/mlp_up/kernel"`` or ``"layers/3/kernel"``,
and how to quantize what it matches) plus a skip list of regular expressions. For every
parameter: a skip pattern that matches leaves it as it is; otherwise the first rule that
matches quantizes it; otherwise it is left as it is. The :class:`QuantizationReport`
says which path got which rule, what was skipped (by which pattern), and which rules and
skip patterns matched nothing (also logged as a warning: a skip list that silently does
nothing is a classic bug).

Works on linen params (``dict`` or ``FrozenDict``, with or without the ``"params"``
collection level) and on NNX state (``nnx.state(model)`` / ``nnx.split``).
A quantized kernel ``[K, N]`` becomes a :class:`qjax.Int4Weight` (or, by the rule's
``format``, a :class:`qjax.MXFP4Weight` / :class:`qjax.NVFP4Weight`) of logical shape
``[K, N]``, which :class:`~flax_layers.Int4Dense` (linen), :class:`~flax_layers.Int4Linear`
(NNX) and ``qjax.matmul`` consume (the layers take any quantized weight);
:func:`quantize_nnx_model` also swaps the quantized ``nnx.Linear`` modules for
``Int4Linear``.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from flax_layers import Int4Dense, QuantRule, quantize_model
>>> class Mlp(nn.Module):
...   quantized: bool = False
...   @nn.compact
...   def __call__(self, x):
...     dense = Int4Dense if self.quantized else nn.Dense
...     h = jax.nn.relu(dense(256, name="up")(x))
...     return dense(64, name="head")(h)
>>> x = jnp.ones((2, 128))
>>> params = Mlp().init(jax.random.key(0), x)["params"]
>>> qparams, report = quantize_model(
...     params, [QuantRule(r"up/kernel$", group_size=64), QuantRule(r"attn", group_size=32)],
...     skip=[r"^head/"])
>>> qparams["up"]["kernel"].shape, qparams["up"]["kernel"].group_size
((128, 256), 64)
>>> sorted(report.quantized), sorted(report.skipped)
(['up/kernel'], ['head/bias', 'head/kernel'])
>>> [r.pattern for r in report.unused_rules]
['attn']
>>> Mlp(quantized=True).apply({"params": qparams}, x).shape
(2, 64)
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qjax
from flax_layers.dense import Int4Linear, _value
from qjax._src.int4 import GROUP_SIZES
from qjax._src.int4 import SCALE_DTYPES

log = logging.getLogger("flax_layers")

FORMATS = ("int4", "mxfp4", "nvfp4")
METHODS = ("minmax", "mse")
# The FP4 formats' quantizers and blocks (rows of K per scale): their scales are fixed by
# the format, so a rule of theirs takes none of INT4's options.
_FP4 = {"mxfp4": (qjax.quantize_mxfp4, 32), "nvfp4": (qjax.quantize_nvfp4, 16)}
_INT4_OPTIONS = {"group_size": 128, "symmetric": True, "method": "minmax",
                 "scale_dtype": jnp.bfloat16}


def _compile(pattern: str, what: str) -> re.Pattern:
  try:
    return re.compile(pattern)
  except (re.error, TypeError) as e:
    raise ValueError(f"{what}={pattern!r} is not a valid regular expression ({e}); fix "
                     "the pattern (escape literal characters with re.escape)") from None


@dataclasses.dataclass(frozen=True)
class QuantRule:
  """How to quantize the parameters whose path matches ``pattern``.

  Attributes:
    pattern: regular expression searched (``re.search``) in the ``'/'``-joined path of
      each parameter, e.g. ``r"mlp_.*/kernel$"``. It should select 2-D ``[K, N]``
      kernels (``y = x @ W``) only: any other match is an error.
    format: "int4" (group-wise affine 4-bit, :class:`qjax.Int4Weight`), "mxfp4" (E2M1
      with an E8M0 scale per 32 rows, :func:`qjax.quantize_mxfp4`) or "nvfp4" (E2M1
      with an e4m3 scale per 16 rows and a float32 scale per matrix,
      :func:`qjax.quantize_nvfp4`). The FP4 formats fix their scales: their rules take
      none of the four options below.
    group_size: (int4) rows of K sharing a scale (32, 64, 128, 256) or None
      (per-channel).
    symmetric: (int4) signed int4 with ``scale = absmax / 7`` (True) or a zero point
      (False).
    method: (int4) "minmax" (round to nearest over the full range) or "mse" (best of 20
      shrunken ranges per group).
    scale_dtype: (int4) dtype of the scales (bf16, f16, f32).
    stacked_axes: leading axes of the matched kernels that stack layers (``nn.scan``
      with ``variable_axes={"params": 0}``) or experts, e.g. 1 for ``[layers, K, N]``.
      Each ``[K, N]`` slice is quantized on its own and the :class:`qjax.Int4Weight`'s
      arrays get these leading axes (``codes: [*stack, K // 8, N]``, ``scales: [*stack,
      groups, N]``), as ``jax.tree.map(jnp.stack, ...)`` of the slices would: what
      ``nn.scan`` slices for ``Int4Dense``, and what :func:`qjax.layer_of`,
      :func:`flax_layers.scan_layers` and ``qjax.moe_matmul`` (one axis of experts)
      take. Where one slice needs float32 scales (:class:`qjax.ScaleRangeWarning`),
      every slice keeps float32 scales (exact). NVFP4 gets a tensor scale per slice.
      0 (default): the kernels must be 2-D.
  """
  pattern: str
  _: dataclasses.KW_ONLY
  format: str = "int4"
  group_size: int | None = 128
  symmetric: bool = True
  method: str = "minmax"
  scale_dtype: Any = jnp.bfloat16
  stacked_axes: int = 0

  def __post_init__(self):
    _compile(self.pattern, "QuantRule.pattern")
    if self.format not in FORMATS:
      raise ValueError(f"QuantRule.format={self.format!r} is not supported; use one of "
                       f"{FORMATS}")
    if not isinstance(self.symmetric, bool):
      raise ValueError(f"QuantRule.symmetric={self.symmetric!r} must be True (signed int4, "
                       "no zero point) or False (a zero point per group)")
    if self.method not in METHODS:
      raise ValueError(f"QuantRule.method={self.method!r} must be one of {METHODS}")
    gs = self.group_size
    if gs is not None and (isinstance(gs, bool) or not isinstance(gs, (int, np.integer))
                           or gs not in GROUP_SIZES):
      raise ValueError(f"QuantRule.group_size={gs!r} must be one of {GROUP_SIZES} (an int) "
                       "or None (per-channel)")
    try:
      scale_ok = jnp.dtype(self.scale_dtype) in [jnp.dtype(d) for d in SCALE_DTYPES]
    except TypeError:
      scale_ok = False
    if not scale_ok:
      raise ValueError(f"QuantRule.scale_dtype={self.scale_dtype!r} must be bfloat16, "
                       "float16 or float32")
    if self.format in _FP4:
      given = [name for name, default in _INT4_OPTIONS.items()
               if not _same_option(getattr(self, name), default)]
      if given:
        block = _FP4[self.format][1]
        raise ValueError(f"QuantRule(format={self.format!r}) takes no {', '.join(given)}: "
                         f"{self.format.upper()} fixes its scales (one per {block} rows of "
                         "K); drop them or use format='int4'")
    axes = self.stacked_axes
    if isinstance(axes, bool) or not isinstance(axes, (int, np.integer)) or axes < 0:
      raise ValueError(f"QuantRule.stacked_axes={axes!r} must be an int >= 0: the leading "
                       "axes that stack layers or experts (1 for [layers, K, N]), 0 for "
                       "2-D kernels")

  @property
  def regex(self) -> re.Pattern:
    """``pattern`` compiled (a ValueError naming it if it is not a valid regex)."""
    return _compile(self.pattern, "QuantRule.pattern")


@dataclasses.dataclass(frozen=True)
class QuantizationReport:
  """What :func:`quantize_model` did.

  Attributes:
    quantized: path -> the rule that quantized it, in parameter order.
    skipped: path -> the skip pattern that matched it.
    unused_rules: rules that quantized nothing (matched no path, or only skipped ones).
    unused_skips: skip patterns that matched no path.
  """
  quantized: dict[str, QuantRule]
  skipped: dict[str, str]
  unused_rules: tuple[QuantRule, ...]
  unused_skips: tuple[str, ...]

  def __str__(self) -> str:
    lines = [f"quantized {len(self.quantized)} parameters:"]
    lines += [f"  {p}: {r.format}"
              + (f" group_size={r.group_size} symmetric={r.symmetric}"
                 if r.format == "int4" else "") + f" (rule {r.pattern!r})"
              for p, r in self.quantized.items()]
    lines.append(f"skipped {len(self.skipped)}:")
    lines += [f"  {p} (skip {s!r})" for p, s in self.skipped.items()]
    if self.unused_rules:
      lines.append("rules that matched nothing: "
                   + ", ".join(repr(r.pattern) for r in self.unused_rules))
    if self.unused_skips:
      lines.append("skip patterns that matched nothing: "
                   + ", ".join(repr(s) for s in self.unused_skips))
    return "\n".join(lines)


def _same_option(value: Any, default: Any) -> bool:
  if default is jnp.bfloat16:
    return jnp.dtype(value) == jnp.dtype(default)
  return type(value) is type(default) and value == default


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _quantize_leaf(path: str, value: Any, rule: QuantRule) -> Any:
  shape = tuple(getattr(value, "shape", ()))
  if qjax.is_quantized(value):
    raise ValueError(f"rule {rule.pattern!r} matched {path!r}, which is already quantized "
                     f"({type(value).__name__}); add it to skip or narrow the pattern")
  stack = rule.stacked_axes
  if len(shape) != stack + 2:
    if stack == 0 and len(shape) > 2 and path.endswith("kernel"):
      raise ValueError(
          f"rule {rule.pattern!r} matched {path!r} of shape {shape}: a kernel with "
          f"leading axes {shape[:-2]} (layers stacked by nn.scan, or experts); set "
          f"QuantRule(..., stacked_axes={len(shape) - 2}) to quantize each [K, N] slice "
          "and stack the results, or add the path to skip")
    want = "[K, N]" if stack == 0 else f"[{', '.join(['stack'] * stack)}, K, N]"
    raise ValueError(
        f"rule {rule.pattern!r} (stacked_axes={stack}) matched {path!r} of shape {shape}; "
        f"only {stack + 2}-D {want} kernels can be quantized by it: narrow the pattern "
        "(e.g. end it with '/kernel$'), fix stacked_axes, or add the path to skip")
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise ValueError(f"rule {rule.pattern!r} matched {path!r} of dtype {value.dtype}; only "
                     "floating-point kernels can be quantized")
  k = shape[-2]
  if rule.format in _FP4:
    quantize_fp4, block = _FP4[rule.format]
    if k % block:
      raise ValueError(
          f"rule {rule.pattern!r}: {path!r} has K={k} rows, not a multiple of "
          f"{rule.format.upper()}'s block of {block}; pad K with zero rows, or use a "
          "separate rule for this path")
    # The FP4 quantizers take stacks as they are, each [K, N] slice on its own.
    return quantize_fp4(value, name=path)
  if rule.group_size is not None and k % rule.group_size:
    raise ValueError(
        f"rule {rule.pattern!r}: {path!r} has K={k} rows, not a multiple of "
        f"group_size={rule.group_size}; use a group size that divides {k}, None "
        "(per-channel), or a separate rule for this path")
  quantize = lambda w, name: qjax.quantize(
      w, group_size=rule.group_size, symmetric=rule.symmetric,
      scale_dtype=rule.scale_dtype, method=rule.method, name=name)
  if stack == 0:
    return quantize(value, path)
  return _quantize_stacked(path, value, quantize)


def _quantize_stacked(path: str, value: Any, quantize) -> qjax.Int4Weight:
  """``value [*stack, K, N]`` quantized slice by slice; every array of the result has the
  leading ``stack`` axes (scales in their widest dtype where slices differ: exact)."""
  lead = value.shape[:-2]
  if 0 in lead:
    raise ValueError(f"{path!r} of shape {tuple(value.shape)} stacks no [K, N] slice; add "
                     "it to skip")
  flat = jnp.reshape(value, (-1,) + tuple(value.shape[-2:]))
  slices = []
  for i, index in enumerate(np.ndindex(*lead)):
    slices.append(quantize(flat[i], f"{path}[{', '.join(map(str, index))}]"))
  scale_dtype = jnp.result_type(*(w.scales.dtype for w in slices))
  slices = [dataclasses.replace(w, scales=w.scales.astype(scale_dtype)) for w in slices]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *slices)
  return jax.tree.map(lambda a: jnp.reshape(a, lead + a.shape[1:]), stacked)


def quantize_model(params_or_state: Any, rules: Sequence[QuantRule], *,
                   skip: Iterable[str] = (), warn_unused: bool = True
                   ) -> tuple[Any, QuantizationReport]:
  """Quantizes the parameters of a Flax model by rules on their paths.

  Args:
    params_or_state: linen params (``dict`` / ``FrozenDict``; the ``"params"``
      collection level, if present, is part of the paths) or an ``nnx.State``. Kernels
      are ``[K, N]`` (``y = x @ W``), as ``nn.Dense`` and ``nnx.Linear`` store them.
    rules: ordered rules; the first whose pattern is found in a path applies.
    skip: regular expressions; a path in which one is found is never quantized.
    warn_unused: log a warning naming the rules and skip patterns that matched nothing.

  Returns:
    ``(new_params, report)``: the same tree type and structure with every quantized
    kernel ``[K, N]`` replaced by a :class:`qjax.Int4Weight` (``format="int4"``),
    :class:`qjax.MXFP4Weight` or :class:`qjax.NVFP4Weight` of logical shape ``[K, N]``
    (inside its ``nnx.Param`` for NNX state; with the rule's ``stacked_axes`` leading
    every array), and a :class:`QuantizationReport`.

  Raises:
    ValueError: a bad regular expression, a rule matching a parameter that is not a
      float kernel of ``2 + stacked_axes`` axes, or a group size (FP4: block) that does
      not divide K (each naming the path).
  """
  if isinstance(rules, QuantRule):
    raise TypeError(f"rules={rules!r} must be a sequence of QuantRule objects, not one "
                    "rule: pass [rule]")
  rules = tuple(rules)
  for r in rules:
    if not isinstance(r, QuantRule):
      raise TypeError(f"rules must be QuantRule objects, got {type(r).__name__}: {r!r}")
  if isinstance(skip, str):
    raise TypeError(f"skip={skip!r} must be a sequence of patterns, not one string")
  skip = tuple(skip)
  skip_regexes = [_compile(s, "skip pattern") for s in skip]
  rule_regexes = [r.regex for r in rules]

  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      params_or_state, is_leaf=lambda x: _is_variable(x) or qjax.is_quantized(x))
  quantized: dict[str, QuantRule] = {}
  skipped: dict[str, str] = {}
  new_leaves = []
  for key_path, leaf in leaves:
    path = "/".join(_key_name(k) for k in key_path)
    value = _value(leaf) if _is_variable(leaf) else leaf
    hit_skip = next((s for s, rx in zip(skip, skip_regexes) if rx.search(path)), None)
    rule = None
    if hit_skip is not None:
      skipped[path] = hit_skip
    else:
      rule = next((r for r, rx in zip(rules, rule_regexes) if rx.search(path)), None)
    if rule is None:
      new_leaves.append(leaf)
      continue
    q = _quantize_leaf(path, value, rule)
    quantized[path] = rule
    new_leaves.append(leaf.replace(q) if _is_variable(leaf) else q)

  used = {id(r) for r in quantized.values()}
  report = QuantizationReport(
      quantized=quantized, skipped=skipped,
      unused_rules=tuple(r for r in rules if id(r) not in used),
      unused_skips=tuple(s for s in skip if s not in set(skipped.values())))
  if warn_unused and (report.unused_rules or report.unused_skips):
    log.warning("quantize_model: rules that matched nothing: %s; skip patterns that "
                "matched nothing: %s", [r.pattern for r in report.unused_rules],
                list(report.unused_skips))
  return jax.tree_util.tree_unflatten(treedef, new_leaves), report


def quantize_nnx_model(model: nnx.Module, rules: Sequence[QuantRule], *,
                       skip: Iterable[str] = (), implementation: str | None = None,
                       warn_unused: bool = True) -> tuple[nnx.Module, QuantizationReport]:
  """Quantizes an NNX model: a new model whose quantized ``nnx.Linear`` are ``Int4Linear``.

  Paths are those of ``nnx.state(model)`` (e.g. ``"layers/0/kernel"``). The input model
  is left unchanged. Kernels of modules other than ``nnx.Linear`` are quantized in the
  state (an ``Int4Weight`` in their ``nnx.Param``) but the module is not swapped; such a
  module must read its kernel through ``qjax.matmul``.

  Returns:
    ``(new_model, report)``; see :func:`quantize_model`.
  """
  graphdef, state = nnx.split(model)
  qstate, report = quantize_model(state, rules, skip=skip, warn_unused=warn_unused)
  new_model = nnx.merge(graphdef, qstate)
  swaps = []
  for path, module in nnx.iter_modules(new_model):
    if isinstance(module, nnx.Linear) and qjax.is_quantized(_value(module.kernel)):
      swaps.append((path, module))
  for path, linear in swaps:
    kernel = _value(linear.kernel)
    layer = Int4Linear(linear.in_features, linear.out_features,
                       use_bias=linear.bias is not None, dtype=linear.dtype,
                       implementation=implementation, kernel=kernel)
    if linear.bias is not None:
      layer.bias = nnx.Param(_value(linear.bias))
    if not path:
      new_model = layer
      continue
    parent = new_model
    for name in path[:-1]:
      parent = parent[name] if isinstance(name, int) else getattr(parent, name)
    if isinstance(path[-1], int):
      parent[path[-1]] = layer
    else:
      setattr(parent, path[-1], layer)
  return new_model, report
