"""FP4 (MXFP4, NVFP4) matrix-vector product (M = 1) without tensor cores: decode and FMA
in registers.

Contract: the same as :mod:`pallas_kernels.fp4_matmul` (``y = x @ W``,
``W[k, n] = e2m1(q[k, n]) * scale[k // B, n]``; MXFP4: ``B = 32``,
``scale = 2 ** (e - 127)``; NVFP4: ``B = 16``, ``scale = f32(e4m3) * global_scale``;
float32 accumulation; output in x's dtype), for one row of x.

Why a separate kernel: as :mod:`pallas_kernels.int4_gemv`. At M = 1 a tensor-core tile is
1/16 useful; here each weight costs a few instructions, all in registers:

* Codes arrive in the kernel-native tile order (``qjax._src.packing``, tile_k = 128):
  nibble ``j`` of word ``r`` of a K-tile is row ``16 j + r``, so slab ``j`` (16 rows)
  lies in nibble ``j``. A thread holds whole words; a block of B rows is ``B / 16``
  consecutive nibbles of a word (MXFP4: 4 blocks per word, NVFP4: 8).
* Nibbles ``i`` and ``i + 4`` decode together, as an f16x2 pair, without a table: one
  shift puts both 3-bit magnitudes ``e1 e0 m`` at bits 9..11 and 25..27, another both
  signs at bits 15 and 31, and an and plus one LOP3 keep exactly those bits. Each half
  is then the float16 with exponent field ``e1 e0`` and top mantissa bit ``m``: exactly
  ``e2m1 * 2**-14`` (the code ``e = 0, m = 1`` is the f16 subnormal ``2**-15``, so the
  E2M1 subnormal needs no special case).
* ``cvt.f32.f16`` widens each half exactly; one FMA per weight accumulates ``x * v``
  into the partial sum ``p_b`` of its block, and one FMA per block and word applies the
  block's decoded scale: ``acc += p_b * s_b``. The decoders' constant factor (``2**14``,
  NVFP4's tensor scale; see :mod:`pallas_kernels.fp4_codec`) multiplies each output
  once, at the end. In the ``"ptx"`` variant the scales decode in inline PTX too, four
  bytes per instance: E8M0 by byte-parallel bit operations and one PRMT per value, e4m3 by
  the hardware conversion (``cvt.rn.f16x2.e4m3x2``). Decode and
  arithmetic of a word are one inline PTX block, so the compiler cannot split the fused
  multiply-adds (Triton through XLA emits ``mul.rn`` / ``add.rn`` for ``a * b + c``).
* Loads run ``num_stages`` loop steps ahead, carried in registers (Triton does not
  software-pipeline loads that feed no dot). Split-K gives enough programs to fill the
  GPU; the splits' f32 partial sums are added in XLA (:func:`common.launch`).

Variants (``variant=``): ``"ptx"`` (the above) and ``"plain"``, the same bit operations
and arithmetic in Pallas ops (no inline assembly; the compiler may split the FMAs), to
compare with and fall back to. Interpret mode (CPU tests) always runs the plain math.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qjax import KernelConfig
from qjax import MXFP4Weight
from qjax import NVFP4Weight
from qjax._src import packing
from pallas_kernels import common
from pallas_kernels import fp4_codec
from pallas_kernels import int4_gemv

_f32 = jnp.float32
_TILE_K = packing.NATIVE_TILE_K
_SLAB = _TILE_K // 8  # rows per nibble plane of a K-tile
# Pair i decodes nibbles i and i + 4. Left shifts (negative: right) that put the pair's
# magnitude bits at 9..11 / 25..27 and its sign bits at 15 / 31 (nibble i sits at 4i).
_PAIR_SHIFTS = tuple((9 - 4 * i, 12 - 4 * i) for i in range(4))
_MAGNITUDE_MASK = 0x0E000E00
_SIGN_MASK = 0x80008000
_LOP3_A_OR_B_AND_C = 0xF8  # LOP3 truth table of a | (b & c) (a = 0xF0, b = 0xCC, c = 0xAA)

VARIANTS = ("ptx", "plain")
DEFAULT_VARIANT = "ptx"


def supports(m: int, k: int, block_size: int) -> bool:
  """Whether the GEMV kernel takes this shape: one row, and scale blocks of whole
  16-row slabs that tile the 128-row K-tile (MXFP4's 32 and NVFP4's 16 do)."""
  return (m == 1 and block_size % _SLAB == 0 and _TILE_K % block_size == 0
          and k % block_size == 0)


# ------------------------------------------------------------------------ one word


def _ptx_multiply_add(acc: str, a: str, b: str, started: set[str]) -> str:
  """The PTX line ``acc = a * b`` the first time ``acc`` is written (recorded in
  ``started``), ``acc = a * b + acc`` (one FMA) after that."""
  if acc in started:
    return f"fma.rn.f32 {acc}, {a}, {b}, {acc};"
  started.add(acc)
  return f"mul.rn.f32 {acc}, {a}, {b};"


def _shift_ptx(dst: str, src: str, amount: int) -> str:
  if amount > 0:
    return f"shl.b32 {dst}, {src}, {amount};"
  if amount < 0:
    return f"shr.u32 {dst}, {src}, {-amount};"
  return f"mov.b32 {dst}, {src};"


@functools.lru_cache(maxsize=None)
def _word_ptx(block_slabs: int) -> str:
  """PTX: ``$0 = acc + sum_b s_b * sum_{j in block b} x_j * e2m1_j * 2**-14`` for one
  code word ``$1``; blocks of ``block_slabs`` consecutive nibbles.

  Operands: ``$1`` the word (b32), ``$2 .. $9`` the x value of each nibble's slab,
  ``$10 ..`` the f32 multiplier of each block, then ``acc`` (all f32).
  """
  blocks = 8 // block_slabs
  first_scale, acc = 10, f"${10 + blocks}"
  parts = ", ".join(f"fp{b}" for b in range(blocks))
  lines = ["{", ".reg .b32 wa, wb, wt;", ".reg .b16 h0, h1;", f".reg .f32 fv, fr, {parts};"]
  started = set()
  for i, (magnitude_shift, sign_shift) in enumerate(_PAIR_SHIFTS):
    lines += [_shift_ptx("wa", "$1", magnitude_shift), _shift_ptx("wb", "$1", sign_shift),
              f"and.b32 wt, wa, {_MAGNITUDE_MASK:#010x};",
              f"lop3.b32 wt, wt, wb, {_SIGN_MASK:#010x}, {_LOP3_A_OR_B_AND_C:#04x};",
              "mov.b32 {h0, h1}, wt;"]
    for half, j in (("h0", i), ("h1", i + 4)):
      p = f"fp{j // block_slabs}"
      lines.append(f"cvt.f32.f16 fv, {half};")
      lines.append(_ptx_multiply_add(p, f"${2 + j}", "fv", started))
  previous = acc
  for b in range(blocks):
    dst = "$0" if b == blocks - 1 else "fr"  # $0 may share a register with an input
    lines.append(f"fma.rn.f32 {dst}, fp{b}, ${first_scale + b}, {previous};")
    previous = "fr"
  lines.append("}")
  return "\n".join(lines)


def _shift(words: jax.Array, amount: int) -> jax.Array:
  if amount > 0:
    return words << amount
  if amount < 0:
    return words >> -amount
  return words


def _half_to_f32(bits: jax.Array) -> jax.Array:
  """uint32 holding f16 bits in its low half -> float32 (exact)."""
  return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(_f32)


def _word_plain(words, xs, scales, acc, block_slabs):
  """:func:`_word_ptx`'s bit operations and arithmetic in JAX ops (interpret mode and the
  ``"plain"`` variant); the same values up to FMA rounding."""
  parts = [None] * len(scales)
  for i, (magnitude_shift, sign_shift) in enumerate(_PAIR_SHIFTS):
    pair = ((_shift(words, magnitude_shift) & jnp.uint32(_MAGNITUDE_MASK))
            | (_shift(words, sign_shift) & jnp.uint32(_SIGN_MASK)))
    for half, j in ((pair & jnp.uint32(0xFFFF), i), (pair >> 16, i + 4)):
      term = xs[j] * _half_to_f32(half)
      b = j // block_slabs
      parts[b] = term if parts[b] is None else parts[b] + term
  for part, s in zip(parts, scales):
    acc = acc + part * s
  return acc


def word_step(words, xs, scales, acc, *, block_slabs: int, use_ptx: bool):
  """``acc + sum_b s_b * sum_{j in b} x_j * (e2m1_j * 2**-14)`` per code word.

  Shapes: words ``[16, bn]`` uint32; xs 8 x ``[16, 1]`` float32 (slab ``j``'s x values);
  scales ``8 / block_slabs`` x ``[1, bn]`` float32 (block multipliers with 2**14
  folded in); acc ``[16, bn]`` float32.
  """
  if not use_ptx:
    return _word_plain(words, xs, scales, acc, block_slabs)
  shape = words.shape
  args = ([words] + [jnp.broadcast_to(x, shape) for x in xs]
          + [jnp.broadcast_to(s, shape) for s in scales] + [acc])
  constraints = "=f,r," + ",".join(["f"] * (len(xs) + len(scales) + 1))
  [out] = plgpu.elementwise_inline_asm(
      _word_ptx(block_slabs), args=args, constraints=constraints, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, _f32)])
  return out


# ---------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static parameters of one launch.

  Attributes:
    k: logical K (a multiple of ``block_size``).
    block_size: rows per scale (32 MXFP4, 16 NVFP4).
    scale_format: "e8m0" or "e4m3" (:func:`fp4_codec.scale_decoder`).
    block_n: output columns per program.
    tiles_per_step: 128-row K-tiles per loop step.
    steps: loop steps per program (one K split).
    split_k: K splits (grid axis 2).
    depth: loop steps the loads run ahead (at least 1).
    use_ptx: the inline-PTX word step, else the plain one.
    ptx_scales: block scales decoded by inline PTX (:func:`fp4_codec.e8m0_to_f32_ptx`,
      :func:`fp4_codec.e4m3_to_f32_ptx`), else by Pallas ops.
  """
  k: int
  block_size: int
  scale_format: str
  block_n: int
  tiles_per_step: int
  steps: int
  split_k: int
  depth: int
  use_ptx: bool
  ptx_scales: bool = False

  @property
  def block_slabs(self) -> int:
    """Slabs of ``_SLAB`` K rows in one scale block."""
    return self.block_size // _SLAB

  @property
  def blocks_per_tile(self) -> int:
    """Scale blocks in one K tile of ``_TILE_K``."""
    return _TILE_K // self.block_size


def accumulate(plan: Plan, pid_k, load_words, load_x, load_scale) -> jax.Array:
  """The K loop of one program: ``[16, block_n]`` float32 partial sums over K split
  ``pid_k`` (``steps * tiles_per_step`` K-tiles), loads running ``depth`` steps ahead.

  The loaders give one K-tile's operands (masked as the caller needs):
    load_words(t): ``[16, block_n]`` uint32 code words of K-tile ``t``.
    load_x(row): ``[16, 1]`` float32 x values of rows ``row .. row + 15``.
    load_scale(g): ``[1, block_n]`` float32 decoded scales of block row ``g``
      (:func:`fp4_codec.scale_decoder`'s ``decode``).

  Summing the result over its first axis and multiplying by the decoder's ``factor``
  gives the program's ``[1, block_n]`` output.
  """

  def fetch(i):
    """Words, x slabs and block multipliers of loop step ``i`` (clamped: the prefetch past
    the last step re-reads it)."""
    i = jnp.minimum(i, plan.steps - 1)
    data = []
    for u in range(plan.tiles_per_step):
      t = (pid_k * plan.steps + i) * plan.tiles_per_step + u
      words = load_words(t)
      xs = tuple(load_x(t * _TILE_K + j * _SLAB) for j in range(8))
      scales = tuple(load_scale(t * plan.blocks_per_tile + b)
                     for b in range(plan.blocks_per_tile))
      data.append((words, xs, scales))
    return tuple(data)

  def compute(data, acc):
    for words, xs, scales in data:
      acc = word_step(words, xs, scales, acc, block_slabs=plan.block_slabs,
                  use_ptx=plan.use_ptx)
    return acc

  return int4_gemv.prefetched_loop(plan.steps, plan.depth, fetch, compute,
                                   jnp.zeros((_SLAB, plan.block_n), _f32))


def _gemv_kernel(xt_ref, w_ref, s_ref, g_ref, o_ref, *, plan: Plan):
  """One ``[1, block_n]`` output slice over ``steps * tiles_per_step`` K-tiles.

  Refs: xt ``[K, 1]`` bf16 / f16 / f32; w ``[Kp // 8, N]`` uint32 (tile order 128);
  s ``[K // B, N]`` uint8 scale bytes; g ``[1, 1]`` float32 (NVFP4) or None; o ``[1, N]``
  in x's dtype or ``[split_k, 1, N]`` float32.
  """
  pid_n, pid_k = pl.program_id(0), pl.program_id(2)
  n = w_ref.shape[1]
  num_blocks = s_ref.shape[0]
  bn = plan.block_n
  n0 = pid_n * bn
  n_mask = (n0 + jnp.arange(bn)) < n
  # Masks along the contiguous axis keep Triton from vectorizing: only where ragged.
  n_ragged, k_ragged = n % bn != 0, plan.k % _TILE_K != 0
  decode, factor = fp4_codec.scale_decoder(plan.scale_format,
                                           None if g_ref is None else g_ref[...],
                                           use_ptx=plan.ptx_scales)

  def load_words(t):
    return common.load(w_ref.at[pl.ds(t * _SLAB, _SLAB), pl.ds(n0, bn)],
                       n_mask[None, :] if n_ragged else None)

  def load_x(row):
    """``[16, 1]`` f32 x values of rows ``row ..`` (0 past K)."""
    mask = ((row + jnp.arange(_SLAB)) < plan.k)[:, None] if k_ragged else None
    return common.load(xt_ref.at[pl.ds(row, _SLAB), pl.ds(0, 1)], mask).astype(_f32)

  def load_scale(g):
    """``[1, bn]`` f32 multiplier of block row ``g`` (finite past the last block)."""
    mask = (n_mask[None, :] & (g < num_blocks)) if (n_ragged or k_ragged) else None
    return decode(common.load(s_ref.at[pl.ds(g, 1), pl.ds(n0, bn)], mask))

  acc = accumulate(plan, pid_k, load_words, load_x, load_scale)
  # The decoders' constant factor (2**14, NVFP4's tensor scale) once per output column.
  out = jnp.sum(acc, axis=0, keepdims=True) * factor  # [1, bn]
  common.store_tile(o_ref, out, m0=0, n0=n0, block_m=1, block_n=bn, pid_k=pid_k,
                    split_k=plan.split_k, mask=n_mask[None, :] if n_ragged else None)


# --------------------------------------------------------------------------- configs


def heuristic_config(k: int, n: int) -> KernelConfig:
  """The INT4 GEMV kernel's heuristic (:func:`int4_gemv.heuristic_config`): the codes
  have the same layout and bytes per weight. No FP4 sweep has been run yet."""
  return int4_gemv.heuristic_config(k, n, single_tile_steps=False)


def candidate_configs(k: int, n: int) -> list[KernelConfig]:
  """The tuner's search space at M = 1: the INT4 GEMV kernel's, plus more warps and
  deeper prefetch (the FP4 word step costs more instructions than the INT4 one)."""
  out = int4_gemv.candidate_configs(k, n)
  tiles = -(-k // _TILE_K)
  # 256 columns: a thread's loads cover two 4-column groups, so each block scale it decodes
  # and each x row it loads serve more weights (H100, M = 1: NVFP4 10 % faster on three
  # shapes; INT4 and MXFP4 slower).
  for bn, tps, depth, warps in ((64, 2, 1, 8), (64, 2, 3, 4), (128, 2, 1, 4), (256, 2, 1, 8),
                                (256, 1, 1, 4)):
    if tiles % tps:
      continue
    split = int4_gemv.divisor_near(tiles // tps, int4_gemv.TARGET_PROGRAMS / -(-n // bn))
    cfg = KernelConfig(block_m=1, block_n=bn, block_k=_TILE_K * tps, split_k=split,
                       num_warps=warps, num_stages=depth)
    if cfg not in out:
      out.append(cfg)
  return out


# ------------------------------------------------------------------------------- API


def fp4_gemv(x: jax.Array, w: MXFP4Weight | NVFP4Weight, *,
             config: KernelConfig | None = None, variant: str = DEFAULT_VARIANT,
             interpret: bool = False, poison: bool = False) -> jax.Array:
  """``x [1, K] @ w [K, N] -> [1, N]`` in x's dtype.

  Codes in another tile order than 128 are repacked first (lossless, per call).

  Args:
    x: ``[1, K]`` bfloat16, float16 or float32.
    w: one (2-D) MXFP4 or NVFP4 weight.
    config: ``block_n`` columns per program, ``block_k`` (a multiple of 128) K rows per
      loop step, ``split_k`` K splits, ``num_warps``, and ``num_stages``: how many loop
      steps ahead the loads run. None: :func:`heuristic_config`.
    variant: "ptx" (inline-PTX decode and FMAs) or "plain" (the same in Pallas ops).
      Interpret mode runs the plain math either way.
    poison: for tests: the output starts as NaN, so an unwritten element shows.

  Raises:
    TypeError: ``w`` is not an FP4 weight.
    ValueError: x is not one row of K, batched codes, or an unknown ``variant``.
  """
  if not isinstance(w, (MXFP4Weight, NVFP4Weight)):
    raise TypeError(f"fp4_gemv takes an MXFP4Weight or NVFP4Weight, got {type(w).__name__}")
  if variant not in VARIANTS:
    raise ValueError(f"{variant=} must be one of {VARIANTS}")
  k, n = w.shape
  if (x.ndim != 2 or x.shape[1] != k or not supports(x.shape[0], k, w.block_size)
      or w.codes.ndim != 2):
    raise ValueError(f"fp4_gemv takes x [1, K={k}] and one [K, N] weight with blocks of 16 "
                     f"or 32 rows; got x {x.shape}, codes {w.codes.shape}, block_size "
                     f"{w.block_size}")
  if w.tile_k != _TILE_K:
    w = w.repack(_TILE_K)
  config = config or heuristic_config(k, n)
  tps, split, steps = int4_gemv.loop_shape(config, w.codes.shape[0] // _SLAB)
  scale_format, scales, global_scale = fp4_codec.kernel_scales(w)
  plan = Plan(k=k, block_size=w.block_size, scale_format=scale_format,
               block_n=config.block_n, tiles_per_step=tps, steps=steps, split_k=split,
               depth=min(max(1, config.num_stages), steps),
               use_ptx=variant == "ptx" and not interpret,
               ptx_scales=(variant == "ptx"
                           and fp4_codec.use_ptx_scales(config.block_n, interpret)))
  # Triton's own pipeliner does nothing for these loads; the prefetch depth is ours.
  launch_config = KernelConfig(block_m=1, block_n=config.block_n, block_k=_TILE_K * tps,
                               split_k=split, num_warps=config.num_warps, num_stages=1)
  return common.launch(functools.partial(_gemv_kernel, plan=plan),
                       [x.reshape(k, 1), w.codes, scales, global_scale], m=1, n=n,
                       dtype=x.dtype, config=launch_config, interpret=interpret,
                       poison=poison, name=f"qjax_{w.format_name}_gemv", grid_m=1)
