"""INT4 matrix-vector product (M = 1) without tensor cores: dequantize and FMA in PTX.

Contract: the same as :mod:`pallas_kernels.int4_matmul` (``y = x @ W``, per group ``g``
``W[k, n] = (q - z[g, n]) * s[g, n]`` or ``q * s[g, n] + b[g, n]``; float32
accumulation; output in x's dtype), for one row of x.

Why a separate kernel. At M = 1 a tensor-core tile is 1/16 useful, and moving each
dequantized weight into the tensor-core operand layout costs more than the multiply.
Here every weight costs about three instructions, all in registers:

* Codes arrive in the kernel-native tile order (``qjax._src.packing``, tile_k = 128):
  nibble ``j`` of word ``r`` of a K-tile is row ``16 j + r``. A thread holds whole words.
* Four shifts per word put nibbles ``2i`` and ``2i + 1`` at mantissa bits 15 and 19;
  one LOP3 per nibble, ``(a & mask) | bits``, then builds ``v = 256 + q`` (even nibbles)
  or ``v = 16 + q`` (odd) exactly as a float32, and one FFMA per nibble accumulates
  ``x * v`` (exact products; the sum keeps ``x * q`` to about 16 bits).
* The sum starts from ``-c``, ``c = sum_j (W_j + z) x_j`` (``W_j`` = 256 or 16; ``z``
  the zero point, 8 when symmetric), computed once per row of x and step by an FMA
  chain, so the word's tail is one FFMA: ``acc += (sum_j x_j v_j - c) * s``. The word's
  whole recipe is one inline-PTX block: the compiler can neither split the FMAs (Triton
  through XLA emits ``mul.rn`` / ``add.rn`` for ``a * b + c``) nor leave the and / or
  unfused (ptxas did, 2026-11-23 ncu source counters: 2 LOP3 per weight, 5.8
  instructions per weight in all, 4.4 after the LOP3 and the folded ``W``).
* Loads run ``num_stages`` loop steps ahead, carried in registers (Triton does not
  software-pipeline loads that feed no dot). Split-K gives enough programs to fill the GPU.

Interpret mode (CPU tests) evaluates the same formulas with JAX ops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import Int4Weight
from qjax import KernelConfig
from qjax._src import packing
from pallas_kernels import common

_f32 = jnp.float32
_TILE_K = packing.NATIVE_TILE_K
_SLAB = _TILE_K // 8  # rows per nibble plane of a K-tile
# Word shifts that put nibbles 2i and 2i + 1 at mantissa bits 15 and 19.
_SHIFTS = {0: ("shl.b32", 15), 1: ("shl.b32", 7), 2: ("shr.u32", 1), 3: ("shr.u32", 9)}
_MASKS = (0x00078000, 0x00780000)  # bits 15..18 (even nibbles), 19..22 (odd nibbles)
# With these exponents the nibble's float is ``W + q`` exactly: 256 + q (even), 16 + q (odd).
_BASES = (0x43800000, 0x41800000)  # 256.0f, 16.0f
_WEIGHT = (256.0, 16.0)  # W: the value of a nibble's float with q = 0, even / odd
LOP3_A_AND_B_OR_C = 0xEA  # LOP3 truth table of (a & b) | c (a = 0xF0, b = 0xCC, c = 0xAA)


def supports(m: int, k: int, group_size: int) -> bool:
  """Whether the GEMV kernel takes this shape (groups must not straddle K-tiles unevenly)."""
  if m != 1:
    return False
  if group_size >= k:
    return True
  return group_size % _SLAB == 0 and (_TILE_K % group_size == 0 or group_size % _TILE_K == 0)


def _f32_hex(value: float) -> str:
  """A float32 immediate in PTX's exact hex form (``0f43800000`` is 256)."""
  return f"0f{np.float32(value).view(np.uint32):08X}"


@functools.lru_cache(maxsize=None)
def _chunk_ptx(planes: tuple[int, ...]) -> str:
  """PTX: ``$0 = (sum_j x_j v_j - c) * s + acc`` for one word ``$1``.

  Operands: ``$2 ..`` the x values of ``planes``, then ``c``, ``s``, ``acc``. ``v_j`` is
  built by one LOP3 (``(a & mask) | bits of W``; ptxas does not fuse a separate ``and``
  and ``or``) and the sum starts from ``-c``, so each nibble costs one LOP3 and one FFMA
  and the word's tail one FFMA.
  """
  lines = ["{", ".reg .b32 a0, a1, a2, a3, t;", ".reg .f32 p;"]
  for i in sorted({j // 2 for j in planes}):
    op, amount = _SHIFTS[i]
    lines.append(f"{op} a{i}, $1, {amount};")
  c, s, a = (f"${2 + len(planes) + i}" for i in range(3))
  lines.append(f"neg.f32 p, {c};")
  for idx, j in enumerate(planes):
    lines.append(f"lop3.b32 t, a{j // 2}, {_MASKS[j % 2]:#010x}, {_BASES[j % 2]:#010x}, "
                 f"{LOP3_A_AND_B_OR_C:#04x};")
    lines.append(f"fma.rn.f32 p, ${2 + idx}, t, p;")
  lines += [f"fma.rn.f32 $0, p, {s}, {a};", "}"]
  return "\n".join(lines)


def _nibble_values(words, j):
  """``W_j + q_j`` as float32, from the bits as the PTX builds them (interpret mode)."""
  op, amount = _SHIFTS[j // 2]
  a = (words << amount) if op.startswith("shl") else (words >> amount)
  return lax.bitcast_convert_type((a & jnp.uint32(_MASKS[j % 2])) | jnp.uint32(_BASES[j % 2]),
                                  _f32)


def _chunk(words, xs, planes, c, s, acc, interpret):
  """``acc + (sum_j x_j v_j - c) * s`` over the planes ``j`` of one group chunk, ``v_j =
  W_j + q_j`` exactly (``W_j`` = 256 or 16): the caller's ``c`` removes ``sum_j W_j x_j``
  and the zero point.

  Shapes: words ``[16, bn]`` uint32; xs ``[16, 1]`` float32 each; c ``[16, 1]`` or
  ``[16, bn]``; s ``[1, bn]``; acc ``[16, bn]`` float32.
  """
  if interpret:
    total = -c
    for x, j in zip(xs, planes):
      total = total + x * _nibble_values(words, j)
    return total * s + acc
  shape = words.shape
  args = ([words] + [jnp.broadcast_to(x, shape) for x in xs]
          + [jnp.broadcast_to(c, shape), jnp.broadcast_to(s, shape), acc])
  constraints = "=f,r," + ",".join(["f"] * (len(xs) + 3))
  [out] = plgpu.elementwise_inline_asm(
      _chunk_ptx(tuple(planes)), args=args, constraints=constraints, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, _f32)])
  return out


@functools.lru_cache(maxsize=None)
def _weighted_sum_ptx(weights: tuple[float, ...]) -> str:
  """PTX: ``$0 = sum_i $(i + 1) * weights[i]``, one FMA per term."""
  lines = ["{", ".reg .f32 p;", f"mul.rn.f32 p, $1, {_f32_hex(weights[0])};"]
  lines += [f"fma.rn.f32 p, ${i + 1}, {_f32_hex(w)}, p;" for i, w in enumerate(weights) if i]
  lines += ["mov.f32 $0, p;", "}"]
  return "\n".join(lines)


def _weighted_sum(xs, weights, interpret):
  """``sum_i xs[i] * weights[i]`` (constant weights) over same-shaped float32 arrays: one
  FMA chain in PTX on the GPU (Triton would emit a multiply and an add per term)."""
  if interpret:
    return functools.reduce(lambda a, v: a + v, [x * w for x, w in zip(xs, weights)])
  [out] = plgpu.elementwise_inline_asm(
      _weighted_sum_ptx(tuple(weights)), args=list(xs),
      constraints="=f," + ",".join(["f"] * len(xs)), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(xs[0].shape, _f32)])
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static parameters of one GEMV launch's K loop.

  Attributes:
    k: logical K.
    group_size: rows per scale group (K for one group per column).
    block_n: output columns per program.
    tiles_per_step: 128-row K-tiles per loop step.
    steps: loop steps per program (one K split).
    depth: loop steps the loads run ahead (0: none).
    interpret: the JAX-op formulas instead of inline PTX.
  """
  k: int
  group_size: int
  block_n: int
  tiles_per_step: int
  steps: int
  depth: int
  interpret: bool

  @property
  def chunks(self) -> list[tuple[int, ...]]:
    """The nibble planes of a word that share a group row."""
    per_group = 8 if self.group_size >= self.k else min(8, self.group_size // _SLAB)
    return [tuple(range(c, c + per_group)) for c in range(0, 8, per_group)]


def accumulate(plan: Plan, pid_k, load_words, load_x, load_group) -> jax.Array:
  """The K loop of one program: ``[16, block_n]`` float32 partial sums over K split
  ``pid_k`` (``steps * tiles_per_step`` K-tiles), loads running ``depth`` steps ahead.

  The loaders give one K-tile's operands (masked as the caller needs):
    load_words(t): ``[16, block_n]`` uint32 code words of K-tile ``t``.
    load_x(row): ``[16, 1]`` float32 x values of rows ``row .. row + 15`` (0 past K).
    load_group(g): ``(scales, zeros, biases)`` of group row ``g``, each ``[1, block_n]``
      float32 or None where the weight has no such field (finite past the last group).

  Summing the result over its first axis gives the program's ``[1, block_n]`` output.
  """
  steps, interpret = plan.steps, plan.interpret
  chunks = plan.chunks

  def fetch(i):
    """Words, x planes and group rows of loop step ``i`` (clamped: the prefetch past the
    last step re-reads it)."""
    i = jnp.minimum(i, steps - 1)
    data = []
    for u in range(plan.tiles_per_step):
      t = (pid_k * steps + i) * plan.tiles_per_step + u
      words = load_words(t)
      xs = tuple(load_x(t * _TILE_K + j * _SLAB) for j in range(8))
      rows = tuple(load_group((t * _TILE_K + planes[0] * _SLAB) // plan.group_size)
                   for planes in chunks)
      data.append((words, xs, rows))
    return tuple(data)

  def compute(data, acc):
    for words, xs, rows in data:
      for planes, (s, z, b) in zip(chunks, rows):
        px = [xs[j] for j in planes]
        weights = [_WEIGHT[j % 2] for j in planes]
        if z is None and b is None:  # symmetric: q - 8
          c = _weighted_sum(px, [w + 8.0 for w in weights], interpret)
        else:
          c = _weighted_sum(px, weights, interpret)
          xsum = functools.reduce(lambda a, v: a + v, px)
          if z is not None:
            c = c + xsum * z
        acc = _chunk(words, px, planes, c, s, acc, interpret)
        if b is not None:
          acc = acc + xsum * b
    return acc

  return prefetched_loop(steps, plan.depth, fetch, compute,
                         jnp.zeros((_SLAB, plan.block_n), _f32))


def prefetched_loop(steps: int, depth: int, fetch, compute, acc):
  """``acc = compute(fetch(i), acc)`` for ``i < steps``, each step's loads issued
  ``depth`` steps ahead and carried in registers (Triton does not software-pipeline loads
  that feed no dot; 0: no prefetch). ``fetch`` must clamp the steps past the last."""
  if not depth:
    return lax.fori_loop(0, steps, lambda i, a: compute(fetch(i), a), acc)

  def step(i, carry):
    ahead, acc = carry
    return ahead[1:] + (fetch(i + depth),), compute(ahead[0], acc)
  _, acc = lax.fori_loop(0, steps, step, (tuple(fetch(d) for d in range(depth)), acc))
  return acc


def _gemv_kernel(xt_ref, w_ref, s_ref, z_ref, b_ref, o_ref, *, plan: Plan, split_k: int):
  """One ``[1, block_n]`` output slice over ``steps * tiles_per_step`` K-tiles.

  Refs: xt ``[K, 1]``; w ``[Kp // 8, N]`` uint32 (tile order 128); s / z / b
  ``[num_groups, N]`` (z, b may be None); o ``[1, N]`` or ``[split_k, 1, N]`` float32.
  """
  pid_n, pid_k = pl.program_id(0), pl.program_id(2)
  n = w_ref.shape[1]
  num_groups = s_ref.shape[0]
  block_n = plan.block_n
  n0 = pid_n * block_n
  n_mask = (n0 + jnp.arange(block_n)) < n
  n_ragged, k_ragged = n % block_n != 0, plan.k % _TILE_K != 0

  def group_row(ref, g):
    mask = (n_mask[None, :] & (g < num_groups)) if (n_ragged or k_ragged) else None
    return common.load(ref.at[pl.ds(g, 1), pl.ds(n0, block_n)], mask).astype(_f32)

  def load_words(t):
    return common.load(w_ref.at[pl.ds(t * _SLAB, _SLAB), pl.ds(n0, block_n)],
                       n_mask[None, :] if n_ragged else None)

  def load_x(row):
    mask = ((row + jnp.arange(_SLAB)) < plan.k)[:, None] if k_ragged else None
    return common.load(xt_ref.at[pl.ds(row, _SLAB), pl.ds(0, 1)], mask).astype(_f32)

  def load_group(g):
    return tuple(group_row(r, g) if r is not None else None for r in (s_ref, z_ref, b_ref))

  acc = accumulate(plan, pid_k, load_words, load_x, load_group)
  out = jnp.sum(acc, axis=0, keepdims=True)  # [1, bn]
  common.store_tile(o_ref, out, m0=0, n0=n0, block_m=1, block_n=block_n, pid_k=pid_k,
                    split_k=split_k, mask=n_mask[None, :] if n_ragged else None)


# Below this many weights (K * N) one row of x runs faster through the XLA path.
XLA_FASTER_BELOW_WEIGHTS = 2**21


def xla_is_faster(m: int, w: Int4Weight) -> bool:
  """Whether qjax.matmul's XLA path beats this kernel (with its split-K sum) for ``m``
  rows of x: one row, fewer than :data:`XLA_FASTER_BELOW_WEIGHTS` weights, symmetric, groups
  of 128 or more (where it was measured).

  H100, device time in us, kernel vs XLA (2026-11-24). int4 group 128, symmetric
  (`qjax bench --m 1 --shapes ...`): 512x512 4.3 vs 3.1, 512x1536 4.6 vs 3.5, 1536x512
  4.5 vs 3.5, 1024x1024 4.6 vs 3.7; 2048x2048 5.1 vs 5.0 and 4096x1024 4.4 vs 5.4 (4M
  weights: even or the kernel); 2048x8192 6.9 vs 10.1. At this size both are launch
  latency, and the kernel's split-K partial sums take a second kernel. GGUF Q4_1 converted
  to Int4Weight (group 32, float biases, K 576 padded to 640) was mixed: 576x576 3.0 vs
  3.1, 576x1536 3.0 vs 3.7, 1536x576 4.6 vs 3.8, so the kernel keeps those. At M = 16 the
  kernel won on every shape above.
  """
  k, n = w.shape
  return m == 1 and k * n < XLA_FASTER_BELOW_WEIGHTS and w.symmetric and w.group_size >= 128


# Programs a launch aims for: about 7 per SM of an H100 (H100 sweep, 2026-11-23).
TARGET_PROGRAMS = 896
# Programs a launch keeps at least where it can: two per SM of an H100 (132 SMs).
MIN_PROGRAMS = 264


def divisor_near(count: int, target: float) -> int:
  """The divisor of ``count`` closest to ``target``."""
  return min((d for d in range(1, count + 1) if count % d == 0), key=lambda d: abs(d - target))


def loop_shape(config: KernelConfig, tiles: int) -> tuple[int, int, int]:
  """``(tiles_per_step, split_k, steps)`` fitted to ``tiles`` K-tiles: tiles per step
  from ``block_k`` halved until it divides, split_k lowered until it divides."""
  tps = max(1, config.block_k // _TILE_K)
  while tiles % tps:
    tps //= 2
  split = max(1, min(config.split_k, tiles // tps))
  while (tiles // tps) % split:
    split -= 1
  return tps, split, tiles // tps // split


def heuristic_config(k: int, n: int, *, single_tile_steps: bool = True) -> KernelConfig:
  """64 columns, loads one step ahead, 4 warps, split-K to about ``TARGET_PROGRAMS``
  programs. One K-tile per loop step (H100 sweep of 2026-11-23 17:38 UTC: 49.8 against
  53.5 us at 8192x28672), except where that leaves a program two steps or fewer and the
  two-tile steps still leave :data:`MIN_PROGRAMS` programs: then its whole share loads at
  once, as one step of two tiles (4096x4096: 6.6 against 7.3 us). With few columns the
  halved split would idle most SMs (1536x576, SmolLM2's FFN down: 54 programs of two
  tiles 4.09 us, 108 of one 2.96 us; H200, 2026-11-28). ``single_tile_steps=False``
  keeps two tiles per step throughout (the FP4 kernel's measured setting)."""
  tiles = -(-k // _TILE_K)
  cols = -(-n // 64)
  tps, split = 1, divisor_near(tiles, TARGET_PROGRAMS / cols)
  if tiles % 2 == 0:
    split2 = divisor_near(tiles // 2, TARGET_PROGRAMS / cols)
    if not single_tile_steps or (tiles // split <= 2 and cols * split2 >= MIN_PROGRAMS):
      tps, split = 2, split2
  return KernelConfig(block_m=1, block_n=64, block_k=_TILE_K * tps, split_k=split,
                      num_warps=4, num_stages=1)


def candidate_configs(k: int, n: int) -> list[KernelConfig]:
  """The tuner's search space at M = 1."""
  tiles = -(-k // _TILE_K)
  out = []
  for bn, tps, depth, warps in ((64, 1, 1, 4), (64, 2, 1, 4), (64, 2, 2, 4), (128, 2, 1, 8),
                                (128, 1, 1, 8), (32, 2, 1, 4), (32, 1, 1, 4), (64, 1, 2, 4),
                                (64, 4, 1, 4), (128, 2, 2, 8)):
    if tiles % tps:
      continue
    cols = -(-n // bn)
    for target in (448, 896, 1792):
      split = divisor_near(tiles // tps, target / cols)
      cfg = KernelConfig(block_m=1, block_n=bn, block_k=_TILE_K * tps, split_k=split,
                         num_warps=warps, num_stages=depth)
      if cfg not in out:
        out.append(cfg)
  return out


def int4_gemv(x: jax.Array, w: Int4Weight, *, config: KernelConfig | None = None,
              interpret: bool = False, poison: bool = False) -> jax.Array:
  """``x [1, K] @ w [K, N] -> [1, N]`` in x's dtype.

  Args:
    config: ``block_n`` columns per program, ``block_k`` (a multiple of 128) K rows per
      loop step, ``split_k`` K splits, ``num_warps``, and ``num_stages``: how many loop
      steps ahead the loads run (0: none). None: :func:`heuristic_config`.
    poison: for tests: the output starts as NaN, so an unwritten element shows.
  """
  m, k = x.shape
  n = w.shape[1]
  if not supports(m, k, w.group_size) or w.codes.ndim != 2:
    raise ValueError(f"int4_gemv takes M=1 and group sizes dividing or multiple of 128; got "
                     f"x {x.shape}, group_size {w.group_size}, codes {w.codes.shape}")
  if w.tile_k != _TILE_K:
    w = w.repack(_TILE_K)
  config = config or heuristic_config(k, n)
  tps, split, steps = loop_shape(config, w.codes.shape[0] // _SLAB)
  config = KernelConfig(block_m=1, block_n=config.block_n, block_k=_TILE_K * tps,
                        split_k=split, num_warps=config.num_warps,
                        num_stages=max(1, config.num_stages))
  plan = Plan(k=k, group_size=w.group_size, block_n=config.block_n, tiles_per_step=tps,
              steps=steps, depth=min(config.num_stages, steps), interpret=interpret)
  kernel = functools.partial(_gemv_kernel, plan=plan, split_k=split)
  # Triton's own pipeliner does nothing for these loads; the prefetch depth is ours.
  launch_config = KernelConfig(block_m=1, block_n=config.block_n, block_k=config.block_k,
                               split_k=split, num_warps=config.num_warps, num_stages=1)
  return common.launch(kernel, [x.reshape(k, 1), w.codes, w.scales, w.zeros, w.biases],
                       m=1, n=n, dtype=x.dtype, config=launch_config, interpret=interpret,
                       poison=poison, name="qjax_int4_gemv", grid_m=1)
