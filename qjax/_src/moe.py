"""``qjax.moe_matmul``: every (token, selected expert) product of a mixture of experts.

Contract: ``x`` holds T tokens, ``w`` E experts of logical shape ``[K, N]`` (a quantized
pytree with a leading expert axis), ``expert_ids [T, top_k]`` the experts each token is
routed to; ``y[t, j] = x[t] @ W[expert_ids[t, j]]`` (``x[t, j]`` when x carries one row per
selected expert, as the down projection of an MoE MLP does), float32 accumulation, output
in x's dtype.

Implementations share the canonical form ``fn(rows [R, K], w, pair_rows [P], pair_experts
[P]) -> [P, N]``: pair ``p`` multiplies row ``pair_rows[p]`` of ``rows`` by expert
``pair_experts[p]``. The XLA reference lives here; the fused Pallas kernel (grouped GEMM over
the pairs sorted by expert, reading only the selected experts' weights) registers itself
from ``pallas_kernels`` with :func:`register_moe_kernel`. Implementation names are those of
:func:`qjax.matmul`: None (best available), "xla", "pallas", "interpret"; and, for a
registered kernel by name, "pallas:NAME" / "interpret:NAME". A kernel may register a rule
for when it is the default (``auto_when``): the per-pair GEMV kernel serves decode-sized
calls, the grouped kernel the rest.

:func:`group_by_expert` is the routing metadata both share: the pairs sorted by expert, each
expert's group of rows, and a table of row tiles that a grouped-GEMM grid walks.
:func:`tile_slots` gives the same tiles per pair and per row slot (by comparisons of the
pairs for decode sizes, without sorting; from the sort above).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import autodiff
from qjax._src import dispatch
from qjax._src import fp4
from qjax._src import fp4_nk
from qjax._src import int4
from qjax._src import int4_nk
from qjax._src import stacked

# The formats moe_matmul takes (with a leading expert axis). The NK formats run Hopper's
# wgmma kernel (pallas_kernels.int4_wgmma.fp4_nk_moe_matmul / int4_nk_moe_matmul);
# Int4Weight (GPTQ / AWQ experts, GGUF Q4_0 / Q4_1 stacks after their lossless to_int4)
# the INT4 MoE kernels.
MOE_FORMATS = (fp4.MXFP4Weight, fp4_nk.MXFP4NKWeight, fp4_nk.NVFP4NKWeight, int4.Int4Weight,
               int4_nk.Int4NKWeight)

_MOE_XLA: dict[type, Callable[..., jax.Array]] = {}
_MOE_KERNELS: dict[type, list[dispatch.Backend]] = {}
# (format, backend name) -> auto_when(num_pairs, w): picked by default only where it holds
_AUTO_WHEN: dict[tuple[type, str], Callable[[int, Any], bool]] = {}


def register_moe_xla(format_cls: type, fn: Callable[..., jax.Array]) -> None:
  """Registers the XLA (reference) implementation of :func:`moe_matmul` for a format.

  Args:
    format_cls: the class of the stacked expert weight (``[E, ...]`` leading axis).
    fn: ``fn(rows [R, K], w, pair_rows [P] int32, pair_experts [P] int32) -> [P, N]``:
      row ``p`` of the result is ``rows[pair_rows[p]] @ W[pair_experts[p]]`` in rows'
      dtype, float32 accumulation, traceable. Also the backward pass of the kernels. A
      later registration replaces the earlier one.

  Returns:
    None. Registering invalidates cached traces that chose an implementation.
  """
  _MOE_XLA[format_cls] = fn
  autodiff.registry_changed()


def register_moe_kernel(format_cls: type, backend: dispatch.Backend, *,
                        auto_when: Callable[[int, Any], bool] | None = None) -> None:
  """Registers a kernel implementation of :func:`moe_matmul` for a format.

  ``backend.fn(rows [R, K], w, pair_rows [P], pair_experts [P], *, interpret,
  config=None) -> [P, N]`` computes what :func:`register_moe_xla`'s ``fn`` does. The first
  registered is the default; a later registration of a name replaces that backend in its
  place (and its ``auto_when`` rule: passing None removes an earlier rule).

  Args:
    format_cls: the class of the stacked expert weight.
    backend: a :class:`~qjax.Backend`.
    auto_when: see below; None for a kernel picked by registration order.

  Returns:
    None. Registering invalidates cached traces that chose an implementation.

  ``auto_when(num_pairs, w)``: for a kernel that is the fast path only for some calls
  (e.g. decode, a few (token, expert) pairs): None / "pallas" / "interpret" pick it, ahead
  of the kernels registered without a rule, exactly when it returns True. A rule that
  always returns False leaves the kernel to be asked for by name
  (``implementation="pallas:NAME"`` or ``"interpret:NAME"``), e.g. while it is measured.
  """
  _MOE_KERNELS[format_cls] = dispatch.replaced_in_place(_MOE_KERNELS.get(format_cls, []),
                                                         backend)
  key = (format_cls, backend.name)
  _AUTO_WHEN.pop(key, None)
  if auto_when is not None:
    _AUTO_WHEN[key] = auto_when
  autodiff.registry_changed()


def moe_kernels_for_format(format_cls: type) -> list[dispatch.Backend]:
  dispatch.load_plugins()
  return list(_MOE_KERNELS.get(format_cls, []))


# ---------------------------------------------------------------------------- routing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertGroups:
  """The (row, expert) pairs sorted by expert, and the row tiles of a grouped GEMM.

  Sorted position ``r`` holds pair ``order[r]``; expert ``e``'s pairs occupy sorted
  positions ``[group_starts[e], group_starts[e] + group_sizes[e])``. A grouped GEMM with
  row blocks of ``block_m`` covers each non-empty group with ``ceil(size / block_m)``
  tiles; tile ``i`` multiplies sorted positions ``[tile_starts[i], tile_ends[i])`` (at most
  ``block_m`` of them, all of one expert) by expert ``tile_experts[i]``. The table has a
  static length (:func:`max_row_tiles`); tiles past the active ones are empty
  (``tile_ends == tile_starts``) and name an expert that some pair selected, so a kernel
  that skipped the emptiness check would still read no unselected expert.

  Attributes:
    order: ``[P]`` int32, pair index of each sorted position.
    group_sizes: ``[E]`` int32 pairs per expert.
    group_starts: ``[E]`` int32 first sorted position of each expert's group.
    tile_experts, tile_starts, tile_ends: ``[num_tiles]`` int32.
  """
  order: jax.Array
  group_sizes: jax.Array
  group_starts: jax.Array
  tile_experts: jax.Array
  tile_starts: jax.Array
  tile_ends: jax.Array


def checked_experts(pair_experts: jax.Array, num_experts: int
                    ) -> tuple[jax.Array, jax.Array]:
  """``(experts [P] int32, valid [P] bool)``: ``pair_experts`` clamped into ``[0, E)``,
  and whether each id was in range.

  What every built-in implementation does with an id outside ``[0, E)``, which
  :func:`moe_matmul` can refuse only when the ids are concrete: it addresses the clamped
  expert, so no read leaves the stack and no other pair's grouping changes, and writes
  NaN over that pair's output row (:func:`nan_rows`), so the misuse shows.
  """
  e = pair_experts.astype(jnp.int32)
  return jnp.clip(e, 0, num_experts - 1), (e >= 0) & (e < num_experts)


def nan_rows(y: jax.Array, valid: jax.Array) -> jax.Array:
  """``y [P, N]`` with NaN in the rows where ``valid [P]`` is False."""
  return jnp.where(valid[:, None], y, jnp.asarray(jnp.nan, y.dtype))


def max_row_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
  """Row tiles a grouped GEMM needs at most: ``sum_e ceil(g_e / block_m)`` over groups
  ``g_e`` summing to P, at most ``min(E, P)`` of them non-empty."""
  active = min(num_experts, num_pairs)
  return max(1, (num_pairs + active * (block_m - 1)) // block_m)


def expected_distinct_experts(num_pairs: int, num_experts: int) -> float:
  """The distinct experts ``num_pairs`` pairs select on average under uniform routing,
  ``E (1 - (1 - 1/E)^P)``: what the kernels' per-pair routing rules weigh the pairs
  against (an expert repeated by several pairs is read once per pair on those routes)."""
  return num_experts * (1 - (1 - 1 / num_experts) ** num_pairs)


def group_by_expert(pair_experts: jax.Array, num_experts: int, block_m: int) -> ExpertGroups:
  """Routing metadata of ``pair_experts [P]`` (ints in ``[0, E)``); jittable, static
  shapes."""
  p = pair_experts.shape[0]
  pair_experts = pair_experts.astype(jnp.int32)
  order = jnp.argsort(pair_experts, stable=True).astype(jnp.int32)
  sizes = jnp.zeros((num_experts,), jnp.int32).at[pair_experts].add(1)
  starts = jnp.cumsum(sizes) - sizes
  tiles_per_expert = (sizes + block_m - 1) // block_m
  tiles_end = jnp.cumsum(tiles_per_expert)                     # [E] inclusive
  num_tiles = max_row_tiles(p, num_experts, block_m)
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  # compare_all: one fused comparison; the default scan is a loop of tiny kernels that took
  # tens of microseconds of device time per call on the H100.
  expert = jnp.searchsorted(tiles_end, tile, side="right",
                            method="compare_all").astype(jnp.int32)
  active = expert < num_experts
  # Empty tiles name the expert of the last sorted pair (a selected one).
  expert = jnp.where(active, expert, pair_experts[order[p - 1]])
  local = tile - (tiles_end[expert] - tiles_per_expert[expert])
  tile_starts = starts[expert] + local * block_m
  group_end = starts[expert] + sizes[expert]
  tile_starts = jnp.where(active, tile_starts, group_end)
  tile_ends = jnp.where(active, jnp.minimum(tile_starts + block_m, group_end), group_end)
  return ExpertGroups(order=order, group_sizes=sizes, group_starts=starts,
                      tile_experts=expert, tile_starts=tile_starts.astype(jnp.int32),
                      tile_ends=tile_ends.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileSlots:
  """Where each (row, expert) pair goes in a grouped GEMM's row tiles, per pair and slot.

  The tiles of :class:`ExpertGroups` (expert by expert, ``tile_m`` rows each, a pair's
  rank among its expert's pairs deciding its row), given per pair and per row slot instead
  of by sorted position. For up to a few hundred pairs :func:`tile_slots` computes them
  with a few comparisons of all pairs against each other, no sort and no scatter (a
  handful of small XLA fusions, cheaper than ``argsort`` and the index arithmetic around
  it); above, from :func:`group_by_expert`'s sort.

  Attributes:
    slot: ``[P]`` int32, the row ``tile * tile_m + r`` of pair ``p``'s product.
    source: ``[tiles * tile_m]`` int32, the pair in each row slot, or ``P`` for none.
    tile_experts: ``[tiles]`` int32; tiles past the active ones name the first pair's
      expert (a selected one).
    tile_rows: ``[tiles]`` int32 pairs in each tile, 0 past the active ones.
    active: ``[]`` int32 non-empty tiles (they come first).
  """
  slot: jax.Array
  source: jax.Array
  tile_experts: jax.Array
  tile_rows: jax.Array
  active: jax.Array


# tile_slots compares every pair with every row slot up to this many comparisons, and
# sorts (group_by_expert) above.
TILE_SLOTS_MAX_COMPARISONS = 1 << 22


def tile_slots_comparisons(num_pairs: int, num_experts: int, tile_m: int) -> int:
  """The size of :func:`tile_slots`' largest comparison: row slots times pairs."""
  return max_row_tiles(num_pairs, num_experts, tile_m) * tile_m * num_pairs


def tile_slots(pair_experts: jax.Array, num_experts: int, tile_m: int) -> TileSlots:
  """The row tiles of ``pair_experts [P]`` (ints in ``[0, E)``) in :class:`TileSlots`
  form: expert ``e``'s ``ceil(g_e / tile_m)`` tiles follow those of the experts before it,
  and its pairs fill them in pair order. Jittable, static shapes (``max_row_tiles``
  tiles). Up to :data:`TILE_SLOTS_MAX_COMPARISONS` (:func:`tile_slots_comparisons`) by
  comparisons, work ``O(P * (P + E) + tiles * (E + tile_m * P))``; above, by a sort."""
  if tile_slots_comparisons(pair_experts.shape[0], num_experts,
                            tile_m) <= TILE_SLOTS_MAX_COMPARISONS:
    return _tile_slots_by_comparison(pair_experts, num_experts, tile_m)
  return _tile_slots_by_sort(pair_experts, num_experts, tile_m)


def _tile_slots_by_sort(pair_experts: jax.Array, num_experts: int, tile_m: int
                        ) -> TileSlots:
  """:func:`tile_slots` from :func:`group_by_expert`: each tile's sorted positions name
  its slots' pairs, and one scatter inverts that."""
  p = pair_experts.shape[0]
  g = group_by_expert(pair_experts, num_experts, tile_m)
  position = g.tile_starts[:, None] + jnp.arange(tile_m, dtype=jnp.int32)   # [T, tm]
  source = jnp.where(position < g.tile_ends[:, None],
                     g.order[jnp.minimum(position, p - 1)], p).reshape(-1)
  slot = jnp.zeros((p,), jnp.int32).at[source].set(
      jnp.arange(source.shape[0], dtype=jnp.int32), mode="drop")  # source P: no pair
  rows = g.tile_ends - g.tile_starts
  first_expert = pair_experts[0].astype(jnp.int32)
  return TileSlots(slot=slot, source=source,
                   tile_experts=jnp.where(rows > 0, g.tile_experts, first_expert),
                   tile_rows=rows, active=jnp.sum(rows > 0, dtype=jnp.int32))


def _tile_slots_by_comparison(pair_experts: jax.Array, num_experts: int, tile_m: int
                              ) -> TileSlots:
  """:func:`tile_slots` by comparisons of the pairs, for decode sizes."""
  p = pair_experts.shape[0]
  e = pair_experts.astype(jnp.int32)
  pair = jnp.arange(p, dtype=jnp.int32)
  same = e[:, None] == e[None, :]                                          # [P, P]
  local = jnp.sum(same & (pair[None, :] < pair[:, None]), axis=1, dtype=jnp.int32)
  expert = jnp.arange(num_experts, dtype=jnp.int32)
  sizes = jnp.sum(e[None, :] == expert[:, None], axis=1, dtype=jnp.int32)  # [E]
  tiles_per_expert = (sizes + tile_m - 1) // tile_m
  first_tile = jnp.sum(jnp.where(expert[None, :] < expert[:, None],
                                 tiles_per_expert[None, :], 0), axis=1, dtype=jnp.int32)
  slot = (first_tile[e] + local // tile_m) * tile_m + local % tile_m
  num_tiles = max_row_tiles(p, num_experts, tile_m)
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  # Tile t belongs to the first expert whose tiles end after t.
  ends = first_tile + tiles_per_expert
  tile_expert = jnp.sum(ends[None, :] <= tile[:, None], axis=1, dtype=jnp.int32)
  in_use = tile_expert < num_experts
  tile_expert = jnp.where(in_use, tile_expert, e[0])
  rows = jnp.clip(sizes[tile_expert] - (tile - first_tile[tile_expert]) * tile_m, 0, tile_m)
  rows = jnp.where(in_use, rows, 0)
  position = jnp.arange(num_tiles * tile_m, dtype=jnp.int32)
  # The pair in each slot, P where none: one min over the pairs.
  source = jnp.min(jnp.where(slot[None, :] == position[:, None], pair[None, :], p), axis=1)
  return TileSlots(slot=slot, source=source, tile_experts=tile_expert, tile_rows=rows,
                   active=ends[-1])


def inverse_permutation(order: jax.Array) -> jax.Array:
  """``inv`` with ``inv[order[r]] == r``."""
  return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


# -------------------------------------------------------------------------------- XLA


# Up to this many pairs the pairs' rows are a constant of the program; above, an iota.
_CONSTANT_PAIR_ROWS_MAX = 1 << 14


def _pair_rows(tokens: int, top_k: int, *, shared_row: bool) -> jax.Array:
  """``[tokens * top_k]`` int32: the row of ``rows`` each (token, expert) pair multiplies,
  ``p // top_k`` where a token's experts share its row, else ``p``. Small counts are a
  constant of the program, computed in numpy: computed by XLA, the iota and division were
  a kernel of their own (0.9 us on the H100, as much as a tenth of a one-token MoE layer;
  session 24, recorded in BENCHMARKS.md's session 25)."""
  pairs = tokens * top_k
  if pairs > _CONSTANT_PAIR_ROWS_MAX:
    index = jnp.arange(pairs, dtype=jnp.int32)
    return index // top_k if shared_row else index
  index = np.arange(pairs, dtype=np.int32)
  # A concrete array even under jit (jnp.asarray alone would stage it as a traced
  # constant), so that a kernel can see its values: one token's rows are all zero, which
  # the GEMV kernel then does not take as an operand (session 26).
  with jax.ensure_compile_time_eval():
    return jnp.asarray(index // top_k if shared_row else index, dtype=jnp.int32)


def moe_matmul_xla(rows: jax.Array, w: Any, pair_rows: jax.Array, pair_experts: jax.Array,
                   *, gathered_sum: bool = False) -> jax.Array:
  """Reference of the canonical form: weights dequantized in the rows' dtype, f32
  accumulation.

  Fewer pairs than experts (decode): the selected experts' weights are gathered and
  dequantized (``[P, K, N]``). Otherwise every expert is dequantized once and the pairs,
  sorted by expert, go through ``jax.lax.ragged_dot``. Both compute the same products.

  ``gathered_sum`` (the GGUF stacks' registration): the decode route as one XLA reduction
  instead, the dequantization, the float32 products and the sum over K fused, so that
  only the selected experts' stored bytes are read (H100, 128 experts of 2048 x 768,
  top-8, one token: Q4_0 14.7 -> 11.3 us, Q8_0 10.3 -> 9.2, Q4_K 14.5 -> 13.4, Q6_K 19.8
  -> 19.4; BENCHMARKS.md, session 34).
  """
  num_experts = jax.tree.leaves(w)[0].shape[0]  # every field's leading axis (_check)
  pair_experts, valid = checked_experts(pair_experts, num_experts)
  x = rows[pair_rows]                                           # [P, K]
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  if pair_experts.shape[0] < num_experts:
    selected = jax.tree.map(lambda a: a[pair_experts], w)
    if gathered_sum:
      wf = selected.dequantize(jnp.float32)                     # [P, K, N], fused
      y = jnp.sum(x.astype(jnp.float32)[:, :, None] * wf, axis=1)
      return nan_rows(y.astype(x.dtype), valid)
    # Element by element (float32, then x's dtype in the same fusion): the two-columns-
    # per-word form of dequantize(x.dtype) made this gathered path slower on the H100
    # (T = 1, 128 experts of 2880 x 2880, top-4: 54 -> 94 us).
    wd = selected.dequantize(jnp.float32).astype(x.dtype)      # [P, K, N]
    y = jnp.einsum("pk,pkn->pn", x, wd, preferred_element_type=jnp.float32,
                   precision=precision)
    return nan_rows(y.astype(x.dtype), valid)
  groups = group_by_expert(pair_experts, num_experts, 1)
  wd = w.dequantize(x.dtype)                                    # [E, K, N]
  y = jax.lax.ragged_dot(x[groups.order], wd, groups.group_sizes, precision=precision,
                         preferred_element_type=jnp.float32)
  return nan_rows(y[inverse_permutation(groups.order)].astype(x.dtype), valid)


# -------------------------------------------------------------------------- the front


def takes_format(w: Any) -> bool:
  """Whether ``moe_matmul`` takes weights of ``w``'s class: the built-in
  :data:`MOE_FORMATS` and any format with a registered MoE path (:func:`register_moe_xla`
  or :func:`register_moe_kernel`)."""
  return isinstance(w, MOE_FORMATS) or type(w) in _MOE_XLA or type(w) in _MOE_KERNELS


# What to convert a stack of these formats to, for moe_matmul's error.
_CONVERSION_HINTS = {
    "NVFP4Weight": "convert an NVFP4Weight stack with qjax.to_nvfp4_nk(w) (lossless)",
}


def _check(x: jax.Array, w: Any, expert_ids: jax.Array) -> None:
  if not takes_format(w):
    registered = {**_MOE_XLA, **_MOE_KERNELS}
    raise NotImplementedError(
        f"moe_matmul takes an MXFP4Weight, MXFP4NKWeight, NVFP4NKWeight, Int4Weight or GGUF "
        f"block weight with a leading expert axis, or a format with a registered MoE path, got "
        f"{type(w).__name__}"
        f"{dispatch.not_inherited(type(w), registered, 'register_moe_xla')}; "
        + _CONVERSION_HINTS.get(type(w).__name__,
                                "convert GPT-OSS checkpoints with .to_mxfp4()"))
  if isinstance(w, MOE_FORMATS) and w.codes.ndim != 3:
    raise ValueError(
        f"w.codes has shape {tuple(w.codes.shape)}: moe_matmul needs exactly one leading "
        "expert axis ([E, Kp // 8, N], or [E, N, K // 8] for the NK formats); stack the "
        "experts' weights")
  lead = getattr(w, "leading_axes", None)  # GGUF blocks: the axes before each field's own
  if lead is not None and len(lead) != 1:
    raise ValueError(
        f"{type(w).__name__} with leading axes {tuple(lead)}: moe_matmul needs exactly one "
        "leading expert axis ([E, ...] on every field); stack the experts' weights")
  experts = {int(a.shape[0]) if a.ndim else None for a in jax.tree.leaves(w)}
  if len(experts) != 1 or None in experts:
    raise ValueError(f"the arrays of {type(w).__name__} must share one leading expert axis; "
                     f"their leading sizes are {sorted(map(str, experts))}")
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dispatch.ACTIVATION_DTYPES]:
    raise ValueError(f"x.dtype={jnp.dtype(x.dtype).name} must be bfloat16, float16 or float32")
  if expert_ids.ndim != 2 or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"expert_ids must be [T, top_k] integers, got shape "
                     f"{tuple(expert_ids.shape)} dtype {jnp.dtype(expert_ids.dtype).name}")
  t, top_k = expert_ids.shape
  if t < 1 or top_k < 1:
    raise ValueError(f"expert_ids of shape {(t, top_k)}: needs at least one token and one "
                     "selected expert per token")
  k = w.shape[0]
  if x.shape not in ((t, k), (t, top_k, k)):
    raise ValueError(
        f"x.shape={tuple(x.shape)} must be [T, K] = {(t, k)} or [T, top_k, K] = "
        f"{(t, top_k, k)} for expert_ids of shape {(t, top_k)} and weights of K={k}")
  (e,) = experts
  check_ids_in_range(expert_ids, e)


def _check_arrays(x: Any, expert_ids: Any) -> None:
  """x and expert_ids must be arrays: a list or a Python int has no shape to check."""
  for name, a in (("x", x), ("expert_ids", expert_ids)):
    if not (hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim")):
      raise TypeError(f"moe_matmul's {name} must be a jax or numpy array, got "
                      f"{type(a).__name__}; wrap it in jnp.asarray(...)")


def check_ids_in_range(expert_ids: Any, num_experts: int) -> None:
  """Refuses concrete ids outside ``[0, E)`` (traced ones get NaN rows instead)."""
  if isinstance(expert_ids, jax.core.Tracer):
    return
  ids = np.asarray(expert_ids)
  if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
    raise ValueError(f"expert_ids range over [{ids.min()}, {ids.max()}]; they must lie in "
                     f"[0, {num_experts}) for weights of {num_experts} experts")


def _split_implementation(implementation: str | None) -> tuple[str | None, str | None]:
  """``(mode, backend name)``: "pallas:NAME" -> ("pallas", "NAME"), "interpret:NAME" ->
  ("interpret", "NAME"), anything else -> (implementation, None)."""
  if implementation is not None and ":" in implementation:
    mode, _, name = implementation.partition(":")
    if mode in ("pallas", "interpret") and name:
      return mode, name
    raise ValueError(f"{implementation=}: a kernel chosen by name is 'pallas:NAME' or "
                     "'interpret:NAME'")
  if implementation not in (None, *dispatch.IMPLEMENTATIONS):
    raise ValueError(f"{implementation=} must be None, one of {dispatch.IMPLEMENTATIONS}, "
                     "or 'pallas:NAME' / 'interpret:NAME' for a registered MoE kernel")
  return implementation, None


def resolve_moe(w: Any, implementation: str | None, num_pairs: int | None = None
                ) -> tuple[str, Callable[..., jax.Array]]:
  """The implementation name and canonical ``fn(rows, w, pair_rows, pair_experts)``.

  ``implementation``: None (the first registered kernel that runs here, else XLA), "xla",
  "pallas" / "interpret" (the first registered kernel), or "pallas:NAME" /
  "interpret:NAME" (the registered kernel of that name, whatever its rule). Without a
  name, kernels registered with ``auto_when`` come first and count only where
  ``auto_when(num_pairs, w)`` holds (never when ``num_pairs`` is None).
  """
  mode, name = _split_implementation(implementation)
  fmt = type(w)
  xla = _MOE_XLA.get(fmt)
  kernels = moe_kernels_for_format(fmt) if mode != "xla" else []
  if name is not None:
    kernels = [b for b in kernels if b.name == name]
    if not kernels:
      known = [b.name for b in moe_kernels_for_format(fmt)]
      raise NotImplementedError(f"no MoE kernel named {name!r} is registered for "
                                f"{fmt.__name__}; registered: {known}")
  else:
    ruled = [b for b in kernels if (fmt, b.name) in _AUTO_WHEN]
    chosen = [b for b in ruled
              if num_pairs is not None and _AUTO_WHEN[fmt, b.name](num_pairs, w)]
    kernels = chosen + [b for b in kernels if b not in ruled]
  if mode in ("pallas", "interpret"):
    name, backend, interpret = dispatch.explicit_kernel(
        kernels, mode, "MoE kernel",
        f"no Pallas MoE kernel is registered for {fmt.__name__}"
        f"{dispatch.not_inherited(fmt, _MOE_KERNELS, 'register_moe_kernel')}; use "
        "implementation='xla'"
        + ("" if fmt.__name__.startswith("GGUF") else
           " (is the pallas_kernels package installed?)"))
    return name, lambda *a: backend.fn(*a, interpret=interpret)
  if mode is None:
    for backend in kernels:
      if backend.supported_on(dispatch.default_device()):
        return backend.name, lambda *a, b=backend: b.fn(*a, interpret=False)
  if xla is None:
    raise NotImplementedError(f"no XLA MoE implementation is registered for {fmt.__name__}"
                              f"{dispatch.not_inherited(fmt, _MOE_XLA, 'register_moe_xla')}")
  return "xla", xla


def moe_matmul(x: jax.Array, w: Any, expert_ids: jax.Array, *,
               implementation: str | None = None) -> jax.Array:
  """``y[t, j] = x[t] @ W[expert_ids[t, j]]`` for every token and selected expert.

  Args:
    x: ``[T, K]`` (every selected expert of a token multiplies the same row) or
      ``[T, top_k, K]`` (one row per selected expert), bfloat16, float16 or float32.
    w: :class:`qjax.MXFP4Weight` of E experts: codes ``[E, Kp // 8, N]``, scales
      ``[E, K // 32, N]``, logical shape ``(K, N)``. Or, for Hopper's wgmma kernel,
      :class:`qjax.MXFP4NKWeight` / :class:`qjax.NVFP4NKWeight` of E experts (codes
      ``[E, N, K // 8]``; ``qjax.to_mxfp4_nk(w)`` converts an MXFP4Weight exactly). Or
      :class:`qjax.Int4Weight` of E experts: codes ``[E, Kp // 8, N]``, scales (and zeros
      or biases) ``[E, K // G, N]`` (GPTQ / AWQ experts; a GGUF Q4_0 / Q4_1 stack's
      ``to_int4()``), or their :class:`qjax.Int4NKWeight` form for Hopper's wgmma kernel
      (codes ``[E, N, K // 8]``; ``qjax.to_int4_nk(w)``, symmetric or with zero points).
      Or a GGUF expert stack as :func:`qjax.load_gguf` reads a ``[K, N, E]`` tensor (e.g.
      a :class:`qjax.GGUFQ4_K` whose fields carry a leading ``[E]`` axis): XLA path only.
    expert_ids: ``[T, top_k]`` integers in ``[0, E)``; an expert may appear for any
      number of tokens, or none. Concrete ids out of range raise ValueError; traced ones
      (under ``jax.jit``) cannot be checked, and each such pair's output row is NaN
      instead, on every implementation, the other pairs unaffected
      (:func:`qjax._src.moe.checked_experts`).
    implementation: None (best available), "xla", "pallas" or "interpret"; or
      "pallas:NAME" / "interpret:NAME" for the registered MoE kernel of that name
      ("pallas:pallas_triton", the grouped kernel; "pallas:pallas_triton_gemv", the
      per-pair GEMV kernel, which None / "pallas" pick for decode-sized calls).

  Returns:
    ``[T, top_k, N]`` in x's dtype, accumulated in float32.

  Raises:
    ValueError: concrete ids out of range, x or the ids of the wrong shape or dtype, no
      tokens (T = 0) or no selected experts (top_k = 0): skip the call for an empty
      batch; K of x not the weight's.
    NotImplementedError: a format without an MoE path (the message names the
      conversion where one exists), or "pallas" where no MoE kernel runs here.

  >>> import jax, jax.numpy as jnp, qjax
  >>> w = qjax.quantize_mxfp4(jax.random.normal(jax.random.key(0), (4, 64, 32)))
  >>> x = jnp.ones((3, 64), jnp.bfloat16)
  >>> ids = jnp.array([[0, 2], [2, 3], [1, 0]])
  >>> qjax.moe_matmul(x, w, ids, implementation="xla").shape
  (3, 2, 32)

  ``w`` may also be a :class:`qjax.ShardedWeight` (expert-, column- or row-parallel):
  inside ``shard_map`` each device computes its share and the float32 sum over the mesh
  axis completes it (see :func:`qjax.sharded_moe_matmul`). Or a :class:`qjax.LayerOf`:
  one layer of a stack of expert weights (``[layers, E, ...]`` arrays), which the kernels
  read in place (:func:`qjax.layer_of`).

  Differentiable in reverse mode with respect to x and the experts' float arrays, as
  :func:`qjax.matmul` (a kernel's backward pass is the XLA path's).

  ``jax.vmap`` over x or the ids fails inside ``jax.lax.ragged_dot`` ("vmap over any dim
  but 0 - NYI") once the pairs are at least E: fold leading axes into T instead, as
  ``flax_layers.MXFP4MoE`` does.
  """
  _check_arrays(x, expert_ids)
  if not autodiff.inside_kernel_call() and _runs_a_kernel(x, w, expert_ids, implementation):
    # The kernel call is jitted, its ids traced: concrete ids are checked here.
    if takes_format(w):
      _check(x, w, expert_ids)
    elif isinstance(w, stacked.LayerOf) and takes_format(w.stack):
      check_ids_in_range(expert_ids, jax.tree.leaves(w.stack)[0].shape[1])
    return _kernel_moe_matmul(x, w, expert_ids, implementation=implementation)
  sharded = dispatch.sharded_weight_class()
  if isinstance(w, sharded):
    return w.moe_matmul(x, expert_ids, implementation=implementation)
  if isinstance(w, stacked.LayerOf):
    with stacked.reads_in_place(w) as layer:
      return moe_matmul(x, layer, expert_ids, implementation=implementation)
  _check(x, w, expert_ids)
  t, top_k = expert_ids.shape
  _, fn = resolve_moe(w, implementation, t * top_k)
  pair_experts = expert_ids.reshape(-1).astype(jnp.int32)
  rows = x if x.ndim == 2 else x.reshape(t * top_k, -1)
  fn = dispatch.sharding_module().under_explicit_axes(fn, rows, w)
  y = fn(rows, w, _pair_rows(t, top_k, shared_row=x.ndim == 2), pair_experts)
  return y.reshape(t, top_k, w.shape[1])


@autodiff.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("implementation",))
def _kernel_moe_matmul(x: jax.Array, w: Any, expert_ids: jax.Array, *,
                       implementation: str | None) -> jax.Array:
  """``moe_matmul`` through a kernel, its backward pass the XLA path's; under ``jax.jit``
  so that an unused call is dead code, retraced after a registration (as
  ``dispatch._kernel_matmul``)."""
  return autodiff.kernel_call(
      lambda x_, w_, ids: moe_matmul(x_, w_, ids, implementation=implementation),
      lambda x_, w_, ids: moe_matmul(x_, w_, ids, implementation="xla"), x, w, expert_ids)


def _runs_a_kernel(x: Any, w: Any, expert_ids: Any, implementation: str | None) -> bool:
  """Whether ``moe_matmul`` would run a kernel for these arguments; those it cannot
  judge count as XLA (the call itself then raises its error)."""
  if implementation == "xla" or jnp.ndim(expert_ids) != 2:
    return False
  if not takes_format(dispatch.resolvable_weight(w)):
    return False
  if dispatch.sharding_module().explicit_axes_decline_kernels(x, w, implementation):
    return False
  return autodiff.picks_a_kernel(lambda: moe_implementation_name(
      w, implementation, int(np.prod(jnp.shape(expert_ids)))))


def moe_implementation_name(w: Any, implementation: str | None = None,
                            num_pairs: int | None = None) -> str:
  """The implementation ``moe_matmul`` would run for ``w`` on this machine, for a call
  with ``num_pairs`` = tokens x top_k (None: a call no decode rule applies to)."""
  return resolve_moe(dispatch.resolvable_weight(w), implementation, num_pairs)[0]
