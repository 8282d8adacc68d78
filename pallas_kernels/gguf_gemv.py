"""GGUF Q8_0 / Q4_K / Q5_K / Q6_K matrix-vector product (M = 1) without tensor cores.

Contract: the same as :func:`pallas_kernels.gguf_matmul.gguf_matmul` (``y = x @ W`` on a
:class:`qjax._src.gguf_tiled.GGUFTiledWeight`, per group ``g``
``W[k, n] = s[g, n] * q[k, n] + b[g, n]``; float32 accumulation; output in x's dtype), for
one row of x. Designed as :mod:`pallas_kernels.int4_gemv`: at M = 1 a tensor-core tile is
1/16 useful, so every weight is dequantized and multiplied in registers.

Per 128-row K-tile a program loads the ``[16, block_n]`` low-nibble words (plus one or
two ``[16, block_n]`` uint8 slabs of high bits for Q5_K / Q6_K, or eight ``[16, block_n]``
int8 slabs for Q8_0). Per 16-row plane ``j`` a shift and a mask put the ``B``-bit code
``u`` (``u = q``, or ``q + 128`` for Q8_0's int8) at the top of a float32 mantissa whose
exponent is that of 1.0, so the float is ``v = 1 + u / 2**B`` exactly, with no int-to-float
conversion. Per group, with ``xs = sum_k x_k`` over the group's rows (both ``[16, ...]``:
the sum over the 16 rows of a slab waits until the end)::

    part = sum_k x_k v_k - (1 + o) xs         (o = 0.5 for Q6_K, Q8_0; else 0)
    acc += (2**B s) * part  [+ b * xs for Q4_K / Q5_K]

which is ``s * sum_k x_k q_k + b * xs`` (Q6_K: ``b = -32 s``; Q8_0: ``b = 0``, ``q = u -
128``). ``s`` and ``b`` are computed in float32 from the stored f16 ``d`` / ``dmin`` and
the 6/8-bit sub-block scales (exact products, as in the tiled kernel).

Split-K over enough programs to fill the GPU; partial sums combined as the other kernels do
(:func:`common.store_tile`, :func:`common.sum_splits`). Loads run ``num_stages`` loop steps
ahead, carried in registers (Triton does not pipeline loads that feed no dot).

On the GPU the multiply-adds and the mask-and-or are one-instruction inline PTX (``fma`` and
``lop3``) when :data:`USE_PTX` is set: Triton through XLA emits a separate multiply and add
for ``a * b + c`` and ptxas left ``(a & m) | c`` as two instructions (int4_gemv's notes).
Interpret mode (CPU tests) evaluates the same formulas with JAX ops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels import int4_gemv
from qjax import KernelConfig
from qjax._src import gguf_formats
from qjax._src import gguf_tiled

_f32 = jnp.float32
_TILE_K = gguf_tiled.TILE_K
_SLAB = gguf_tiled.SLAB
_PLANES = _TILE_K // _SLAB  # 16-row planes per K-tile
_ONE_BITS = 0x3F800000  # 1.0f
_LOP3_A_AND_B_OR_C = 0xEA  # (a & b) | c
# ggml type -> B, the code bits in v = 1 + u / 2**B (u = q, or q + 128 for Q8_0's int8).
_CODE_BITS = {"Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
# ggml type -> o in part = sum x v - (1 + o) xs (see the module docstring).
_EXTRA_OFFSET = {"Q8_0": 0.5, "Q4_K": 0.0, "Q5_K": 0.0, "Q6_K": 0.5}

# Inline PTX for the FMAs and the mask-and-or on the GPU (False: plain Triton ops).
USE_PTX = True
# Programs a launch aims for: about 7 per SM of an H100 (int4_gemv's sweep).
TARGET_PROGRAMS = 896
# Programs a launch keeps at least where it can (int4_gemv's).
MIN_PROGRAMS = int4_gemv.MIN_PROGRAMS


def supports(m: int, k: int, n: int, ggml_type: str) -> bool:
  """Whether the GEMV kernel takes this call: one row of x, a GGUFTiledWeight type."""
  del k, n
  return m == 1 and ggml_type in _CODE_BITS


# -- elementwise helpers ------------------------------------------------------------------


def _asm(ptx: str, args, constraints: str, dtype) -> jax.Array:
  """The one ``dtype`` result of ``ptx`` over ``args`` broadcast to one shape."""
  shape = jnp.broadcast_shapes(*(a.shape for a in args))
  args = [jnp.broadcast_to(a, shape) for a in args]
  [out] = plgpu.elementwise_inline_asm(
      ptx, args=args, constraints=constraints, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)])
  return out


FMA_PTX = "fma.rn.f32 $0, $1, $2, $3;"


def and_or_ptx(mask: int, c: int | None) -> str:
  """PTX: ``$0 = ($1 & mask) | c`` (``c`` an immediate, or None: register ``$2``)."""
  operand = "$2" if c is None else f"{c:#010x}"
  return f"lop3.b32 $0, $1, {mask:#010x}, {operand}, {_LOP3_A_AND_B_OR_C:#04x};"


def _fma(a, b, c, ptx: bool) -> jax.Array:
  """``a * b + c`` in float32, one rounding on the GPU (broadcasting)."""
  if not ptx:
    return a * b + c
  return _asm(FMA_PTX, [a, b, c], "=f,f,f,f", _f32)


def _and_or(a, mask: int, c, ptx: bool) -> jax.Array:
  """``(a & mask) | c`` on uint32 (``c`` an int or an array): one LOP3 on the GPU."""
  if not ptx:
    return (a & jnp.uint32(mask)) | (jnp.uint32(c) if isinstance(c, int) else c)
  # Triton's inline asm takes signed integers only (uint32 tensors fail to parse on the
  # H100, triton 3.6): the words go through as int32 bit patterns.
  as_i32 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.int32)
  if isinstance(c, int):
    out = _asm(and_or_ptx(mask, c), [as_i32(a)], "=r,r", jnp.int32)
  else:
    out = _asm(and_or_ptx(mask, None), [as_i32(a), as_i32(c)], "=r,r,r", jnp.int32)
  return lax.bitcast_convert_type(out, jnp.uint32)


def _shift(a: jax.Array, amount: int) -> jax.Array:
  """``a << amount`` (``a >> -amount`` for negative amounts) on uint32."""
  if amount >= 0:
    return a << jnp.uint32(amount) if amount else a
  return a >> jnp.uint32(-amount)


# -- the kernel ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static parameters of one launch.

  Attributes:
    ggml_type: "Q8_0", "Q4_K", "Q5_K" or "Q6_K".
    k: logical K (x is padded to whole K-tiles).
    block_n: output columns per program.
    tiles_per_step: 128-row K-tiles per loop step.
    steps: loop steps per program (one K split).
    depth: loop steps the loads run ahead (0: none).
    n_ragged: N is not a multiple of block_n (column masks).
    ptx: inline PTX (GPU) instead of JAX ops.
  """
  ggml_type: str
  k: int
  block_n: int
  tiles_per_step: int
  steps: int
  depth: int
  n_ragged: bool
  ptx: bool

  @property
  def group(self) -> int:
    return gguf_tiled._SPECS[self.ggml_type][0]  # pylint: disable=protected-access

  @property
  def scale_rows(self) -> int:
    return gguf_tiled._SPECS[self.ggml_type][1]  # pylint: disable=protected-access

  @property
  def high_bits(self) -> int:
    return gguf_tiled._SPECS[self.ggml_type][2]  # pylint: disable=protected-access

  @property
  def k_ragged(self) -> bool:
    """Whether the last K-tile holds padding rows past K (Q8_0 only)."""
    return self.k % _TILE_K != 0


def _plane_values(plan: Plan, data, j: int) -> jax.Array:
  """``v = 1 + u / 2**B`` of plane ``j`` of a K-tile: ``[16, block_n]`` float32, exact."""
  bits = _CODE_BITS[plan.ggml_type]
  top = 23 - bits  # the code's lowest bit in the mantissa
  if plan.ggml_type == "Q8_0":
    # int8 q << top plus (1.0's bits + 128 << top): the bits of 1 + (q + 128) / 256.
    q = data["q8"][j].astype(jnp.int32)
    u = (q << top) + jnp.int32(_ONE_BITS + (128 << top))
    return lax.bitcast_convert_type(u, _f32)
  low = _shift(data["low"], top - 4 * j)
  u = _and_or(low, 0xF << top, _ONE_BITS, plan.ptx)
  if plan.high_bits:
    per_byte = 8 // plan.high_bits
    high = data["high"][j // per_byte]
    field = plan.high_bits * (j % per_byte)
    mask = ((1 << plan.high_bits) - 1) << (top + 4)
    u = _and_or(_shift(high, top + 4 - field), mask, u, plan.ptx)
  return lax.bitcast_convert_type(u, _f32)


def _group_terms(plan: Plan, data, d2, c: int):
  """``(s2, b)`` of group ``c`` of a K-tile: ``2**B s`` and, for Q4_K / Q5_K, ``b``
  (else None); ``[1, block_n]`` float32. ``d2``: ``2**B d`` of the tile's K-quant
  super-block, ``-dmin``; unused for Q8_0."""
  if plan.ggml_type == "Q8_0":
    return data["d"][c] * float(2 ** _CODE_BITS["Q8_0"]), None
  s2 = d2[0] * data["sc"][c]
  if plan.ggml_type == "Q6_K":
    return s2, None
  return s2, d2[1] * data["mn"][c]


def _tile_sum(plan: Plan, data, acc: jax.Array) -> jax.Array:
  """``acc`` plus one K-tile's ``[16, block_n]`` products (see the module docstring)."""
  per_group = plan.group // _SLAB
  offset = 1.0 + _EXTRA_OFFSET[plan.ggml_type]
  d2 = None
  if plan.ggml_type != "Q8_0":  # one d (and dmin) per 256 rows: per tile
    d2 = (data["d"][0] * float(2 ** _CODE_BITS[plan.ggml_type]),
          -data["dmin"] if "dmin" in data else None)
  for c in range(_PLANES // per_group):
    planes = range(c * per_group, (c + 1) * per_group)
    xs = functools.reduce(lambda a, b: a + b, [data["x"][j] for j in planes])  # [16, 1]
    part = xs * -offset
    for j in planes:
      part = _fma(data["x"][j], _plane_values(plan, data, j), part, plan.ptx)
    s2, b = _group_terms(plan, data, d2, c)
    acc = _fma(part, s2, acc, plan.ptx)
    if b is not None:
      acc = _fma(xs, b, acc, plan.ptx)
  return acc


def _gemv_kernel(xt_ref, low_ref, high_ref, q8_ref, d_ref, dmin_ref, sc_ref, mn_ref, o_ref, *,
                 plan: Plan, split_k: int):
  """One ``[1, block_n]`` output slice over ``steps * tiles_per_step`` K-tiles.

  Refs (the GGUFTiledWeight fields, None where the type has none): xt ``[Kp, 1]`` (zero
  past K); low ``[Kp // 8, N]`` uint32; high ``[Kp // T * 16, N]`` uint8; q8 ``[Kp, N]``
  int8; d ``[K // R, N]`` f16; dmin ``[K // 256, N]`` f16; sc ``[K // G, N]``; mn
  ``[K // 32, N]`` uint8; o ``[1, N]`` or ``[split_k, 1, N]`` float32.
  """
  pid_n, pid_k = pl.program_id(0), pl.program_id(2)
  bn = plan.block_n
  n0 = pid_n * bn
  n = d_ref.shape[1]
  n_mask = (n0 + jnp.arange(bn)) < n
  col = n_mask[None, :] if plan.n_ragged else None
  group, scale_rows = plan.group, plan.scale_rows
  num_groups = plan.k // group

  def slab(ref, row):
    return common.load(ref.at[pl.ds(row, _SLAB), pl.ds(n0, bn)], col)

  def scale_row(ref, row, rows):
    """Row ``row`` of a ``[rows, N]`` scale field as ``[1, bn]`` float32 (0 past it)."""
    mask = col
    if plan.k_ragged:
      mask = n_mask[None, :] & (row < rows)
    return common.load(ref.at[pl.ds(row, 1), pl.ds(n0, bn)], mask).astype(_f32)

  def fetch_tile(t):
    r0 = t * _TILE_K
    data = {"x": tuple(common.load(xt_ref.at[pl.ds(r0 + j * _SLAB, _SLAB), pl.ds(0, 1)])
                       .astype(_f32) for j in range(_PLANES))}
    groups = [(r0 + c * group) // group for c in range(_TILE_K // group)]
    if q8_ref is not None:
      data["q8"] = tuple(slab(q8_ref, r0 + j * _SLAB) for j in range(_PLANES))
      data["d"] = tuple(scale_row(d_ref, g, num_groups) for g in groups)
      return data
    data["low"] = slab(low_ref, t * _SLAB)
    if high_ref is not None:
      high_rows = gguf_tiled.high_tile_rows(plan.high_bits)
      data["high"] = tuple(
          slab(high_ref, (r0 // high_rows + i) * _SLAB).astype(jnp.uint32)
          for i in range(_TILE_K // high_rows))
    data["d"] = (scale_row(d_ref, r0 // scale_rows, d_ref.shape[0]),)
    data["sc"] = tuple(scale_row(sc_ref, g, num_groups) for g in groups)
    if mn_ref is not None:
      data["dmin"] = scale_row(dmin_ref, r0 // scale_rows, d_ref.shape[0])
      data["mn"] = tuple(scale_row(mn_ref, g, num_groups) for g in groups)
    return data

  def fetch(i):
    """The operands of loop step ``i`` (clamped: a prefetch past the last step re-reads
    it)."""
    i = jnp.minimum(i, plan.steps - 1)
    first = (pid_k * plan.steps + i) * plan.tiles_per_step
    return tuple(fetch_tile(first + u) for u in range(plan.tiles_per_step))

  def compute(step_data, acc):
    for data in step_data:
      acc = _tile_sum(plan, data, acc)
    return acc

  acc = int4_gemv.prefetched_loop(plan.steps, plan.depth, fetch, compute,
                                  jnp.zeros((_SLAB, bn), _f32))
  out = jnp.sum(acc, axis=0, keepdims=True)  # [1, bn]
  common.store_tile(o_ref, out, m0=0, n0=n0, block_m=1, block_n=bn, pid_k=pid_k,
                    split_k=split_k, mask=col)


# -- configs ------------------------------------------------------------------------------


# The K loop's fitting (tiles per step, split, steps): the INT4 GEMV's, same 128-row tiles.
loop_shape = int4_gemv.loop_shape


def heuristic_config(m: int, k: int, n: int, *, block_n: int | None = None, num_warps: int = 4,
                     target_programs: int = TARGET_PROGRAMS,
                     two_tile_steps: bool | None = None) -> KernelConfig:
  """``block_n`` columns, 4 warps, loads one step ahead, split-K to about
  ``target_programs`` programs (int4_gemv's rule). One K-tile per loop step, except where
  a program would have two tiles or fewer and two-tile steps still leave
  :data:`MIN_PROGRAMS` programs: then both load at once, as one step.
  ``two_tile_steps`` forces either (where K has an even number of tiles). ``block_n``
  None: 64, or 32 where 64-column programs of one K-tile each are fewer than
  :data:`MIN_PROGRAMS` (2048 x 512)."""
  del m
  tiles = -(-k // _TILE_K)
  if block_n is None:
    block_n = 64 if -(-n // 64) * tiles >= MIN_PROGRAMS else 32
  cols = -(-n // block_n)
  config = KernelConfig(block_m=1, block_n=block_n, block_k=_TILE_K,
                        split_k=int4_gemv.divisor_near(tiles, target_programs / cols),
                        num_warps=num_warps, num_stages=1)
  if tiles % 2:
    return config
  split2 = int4_gemv.divisor_near(tiles // 2, target_programs / cols)
  if two_tile_steps is None:
    two_tile_steps = tiles // config.split_k <= 2 and cols * split2 >= MIN_PROGRAMS
  if two_tile_steps:
    config = dataclasses.replace(config, block_k=2 * _TILE_K, split_k=split2)
  return config


def alternative_configs(m: int, k: int, n: int) -> list[KernelConfig]:
  """Up to four configs worth timing against :func:`heuristic_config` on the GPU: 2 warps
  (twice the rows per thread: less per-column scale work per weight), the other choice
  of one or two K-tiles per step, 128 columns, twice the programs."""
  base = heuristic_config(m, k, n)
  out = []
  for cfg in (heuristic_config(m, k, n, num_warps=2),
              heuristic_config(m, k, n, two_tile_steps=base.block_k == _TILE_K),
              heuristic_config(m, k, n, block_n=128, num_warps=4),
              heuristic_config(m, k, n, target_programs=TARGET_PROGRAMS * 2),
              dataclasses.replace(base, num_stages=2)):
    if cfg != base and cfg not in out:
      out.append(cfg)
  return out[:4]


# -- the entry point ----------------------------------------------------------------------


def tiled_matrix(w) -> gguf_tiled.GGUFTiledWeight:
  """``w`` as one ``[K, N]`` :class:`GGUFTiledWeight` (a GGUF block weight converted,
  losslessly, per call); the GGUF kernels' check of their weight operand.

  Raises:
    NotImplementedError: batched weights (vmap instead).
  """
  if isinstance(w, gguf_formats.GGUFBlockWeight):
    w = gguf_tiled.GGUFTiledWeight.from_gguf(w)
  if w.d.ndim != 2:
    raise NotImplementedError(f"d of shape {w.d.shape}: the kernel takes one [K, N] weight; "
                              "vmap over leading axes")
  return w


def gguf_gemv(x: jax.Array, w, *, interpret: bool = False, config: KernelConfig | None = None,
              poison: bool = False) -> jax.Array:
  """``x [1, K] @ w [K, N] -> [1, N]`` in x's dtype.

  Args:
    w: a :class:`GGUFTiledWeight` (Q8_0, Q4_K, Q5_K, Q6_K), or such a GGUF block weight
      (converted per call, losslessly).
    config: ``block_n`` columns per program, ``block_k`` (a multiple of 128) K rows per
      loop step, ``split_k`` K splits, ``num_warps``, and ``num_stages``: how many loop
      steps ahead the loads run. None: :func:`heuristic_config`.
    poison: for tests: the output starts as NaN, so an unwritten element shows.

  Raises:
    ValueError: more than one row of x, or another weight type.
    NotImplementedError: batched weights (vmap instead).
  """
  w = tiled_matrix(w)
  m, k = x.shape
  n = w.shape[1]
  if not supports(m, k, n, w.ggml_type) or k != w.shape[0]:
    raise ValueError(f"gguf_gemv takes x [1, K] and a {list(_CODE_BITS)} weight [K, N]; got "
                     f"x {x.shape}, w {w.ggml_type} {w.shape}")
  kp = w.padded_k
  config = config or heuristic_config(m, k, n)
  tps, split, steps = loop_shape(config, kp // _TILE_K)
  plan = Plan(ggml_type=w.ggml_type, k=k, block_n=config.block_n, tiles_per_step=tps,
              steps=steps, depth=min(max(1, config.num_stages), steps),
              n_ragged=n % config.block_n != 0, ptx=USE_PTX and not interpret)
  xt = x.reshape(k, 1)
  if kp != k:
    xt = jnp.pad(xt, ((0, kp - k), (0, 0)))
  kernel = functools.partial(_gemv_kernel, plan=plan, split_k=split)
  # Triton's own pipeliner does nothing for these loads; the prefetch depth is ours.
  launch_config = KernelConfig(block_m=1, block_n=config.block_n, block_k=_TILE_K * tps,
                               split_k=split, num_warps=config.num_warps, num_stages=1)
  fields = [getattr(w, f) for f in ("low", "high", "q8", "d", "dmin", "sc", "mn")]
  return common.launch(kernel, [xt] + fields, m=1, n=n, dtype=x.dtype, config=launch_config,
                       interpret=interpret, poison=poison,
                       name=f"qjax_gguf_{w.ggml_type.lower()}_gemv", grid_m=1)
