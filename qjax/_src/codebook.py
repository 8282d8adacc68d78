"""Codebook weights with per-group rotation and an optional residual second pass.

Each group of ``d`` rows of K (64 or 128) is rotated by a seeded orthogonal matrix
``Pi_g`` (:mod:`qjax._src.rotation`), which makes its coordinates nearly Gaussian; every
rotated column group is then coded as 16-level codebook indices times one scale per
(group, column). A second, optional pass codes the residual ``W - dequantize(pass 1)``
the same way with the rotation seed ``seed + 1``. At inference the activations are rotated
instead of the weight::

  y = sum_g ((x_g @ Pi_g^T) @ codebook[idx_g]) * norms_g / sqrt(d)  (+ the same for pass 2)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import codebook_tables
from qjax._src import formats
from qjax._src import int4
from qjax._src import packing
from qjax._src import rotation as rotation_lib

NORM_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
SEED_BITS = 32  # a pass's rotation is rebuilt from one stored int32 seed
_REFINE_STEPS = 4  # alternations of index assignment and least-squares scale


@formats.register_format
@dataclasses.dataclass(frozen=True, kw_only=True)
class CodebookWeight(formats.QuantizedWeight):
  """Rotated codebook weight of logical shape ``[K, N]``, used as ``y = x @ W``.

  Invariant, with ``d = group_size``, ``g = k // d`` and ``Pi_g`` the rotation of
  ``(rotation, seed)`` (pass 2: ``seed + 1``)::

    W[g*d:(g+1)*d, n] = Pi_g^T @ (codebook[idx[g*d:(g+1)*d, n]] * norms[g, n] / sqrt(d))
                        (+ the same with codes2, norms2, codebook2 and seed + 1)

  Attributes:
    codes: ``[Kp // 8, N]`` uint32, the 4-bit indices of pass 1 packed along K in tile
      order 128 (:mod:`qjax._src.packing`), as the INT4 kernel reads them.
    norms: ``[K // d, N]`` bf16 / f16 / f32 per-(group, column) scales (the rotated
      group's norm, refined by least squares).
    codebook: ``[16]`` float32 levels, ascending.
    codes2, norms2, codebook2: the same for the residual pass, or all None.
    shape: the logical ``(K, N)``.
    group_size: ``d``, 64 or 128.
    rotation: "hadamard" or "orthogonal".
    seed: rotation seed of pass 1.
    codebook_name: which table the codebooks came from ("lloyd", "nf4", "iq4_nl").
  Leading batch axes (stacked layers, experts) are allowed on every array.
  """

  format_name = "codebook"

  codes: jax.Array
  norms: jax.Array
  codebook: jax.Array
  codes2: jax.Array | None = None
  norms2: jax.Array | None = None
  codebook2: jax.Array | None = None
  shape: tuple[int, int] = formats.static_field()
  group_size: int = formats.static_field(default=128)
  rotation: str = formats.static_field(default="hadamard")
  seed: int = formats.static_field(default=0)
  codebook_name: str = formats.static_field(default="lloyd")

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    rotation_lib.check(self.rotation, self.group_size, self.seed)
    if k % self.group_size:
      raise ValueError(f"K={k} must be a multiple of group_size={self.group_size}; pad K "
                       "or choose a group size that divides it")
    second = (self.codes2, self.norms2, self.codebook2)
    if any(a is None for a in second) and any(a is not None for a in second):
      raise ValueError("CodebookWeight takes all of codes2, norms2, codebook2 or none")
    if not self._leaves_concrete_2d():
      return
    want = {"codes": ((packing.padded_rows(k, packing.NATIVE_TILE_K) // 8, n), (jnp.uint32,)),
            "norms": ((k // self.group_size, n), NORM_DTYPES),
            "codebook": ((16,), (jnp.float32,))}
    for name, (shape, dtypes) in list(want.items()):
      if self.codes2 is not None:
        want[name + "2"] = (shape, dtypes)
    for name, (shape, dtypes) in want.items():
      a = getattr(self, name)
      if (tuple(a.shape[a.ndim - len(shape):]) != shape
          or jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in dtypes]):
        raise ValueError(
            f"CodebookWeight.{name} must be {shape} of dtype "
            f"{[jnp.dtype(d).name for d in dtypes]}, got {tuple(a.shape)} "
            f"{jnp.dtype(a.dtype).name} (shape={self.shape}, group_size={self.group_size})")

  @property
  def passes(self) -> int:
    """1, or 2 with the residual pass (``codes2``)."""
    return 1 if self.codes2 is None else 2

  @property
  def num_groups(self) -> int:
    """Rotated groups along K: ``K // group_size``."""
    return self.shape[0] // self.group_size

  def first_pass(self) -> "CodebookWeight":
    """Pass 1 alone (a one-pass weight)."""
    return dataclasses.replace(self, codes2=None, norms2=None, codebook2=None)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[K, N]`` in ``dtype`` (computed in float32)."""
    if self.codes.ndim != 2:
      raise NotImplementedError(f"codes of shape {self.codes.shape}: dequantize one "
                                "[K, N] weight at a time (vmap over leading axes)")
    w = _dequantize_pass(self.codes, self.norms, self.codebook, self.shape, self.group_size,
                         self.rotation, self.seed)
    if self.codes2 is not None:
      w = w + _dequantize_pass(self.codes2, self.norms2, self.codebook2, self.shape,
                               self.group_size, self.rotation, self.seed + 1)
    return w.astype(dtype)

  def bits_per_weight(self) -> float:
    """Stored bits per logical weight: packed codes (padding included), norms, the
    codebooks and one 32-bit rotation seed per pass."""
    leaves = [a for a in (self.codes, self.norms, self.codebook, self.codes2, self.norms2,
                          self.codebook2) if a is not None]
    bits = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize * 8 for a in leaves)
    batch = int(np.prod(self.codes.shape[:-2]))
    bits += SEED_BITS * self.passes * batch
    return bits / (self.shape[0] * self.shape[1] * batch)


def _dequantize_pass(codes, norms, codebook, shape, group_size, rotation, seed):
  k, n = shape
  idx = packing.unpack_codes(codes, k, packing.NATIVE_TILE_K)
  scale = norms.astype(jnp.float32) / math.sqrt(group_size)
  rot = codebook[idx.astype(jnp.int32)].reshape(k // group_size, group_size, n)
  return rotation_lib.unrotate_weight(rot * scale[:, None, :], rotation, seed)


def _pow2(e: jax.Array) -> jax.Array:
  """float32 ``2 ** e`` for integer ``e`` in ``[-126, 127]``, built from its bits."""
  return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


@functools.partial(jax.jit, static_argnames=("codebook", "group_size", "rotation", "seed"))
def _fit_pass(w, *, codebook, group_size, rotation, seed):
  """One pass: ``w [K, N]`` -> (codes ``[K, N]`` uint8, float32 norms ``[K // d, N]``).

  Each (group, column) is fitted divided by a power of two near its largest magnitude
  (an exact division), so the sums of squares neither overflow (weights above 1e18)
  nor underflow (below 1e-19) float32; the norms are multiplied back at the end.
  """
  k, n = w.shape
  table = jnp.asarray(codebook_tables.table(codebook))
  mids = (table[1:] + table[:-1]) / 2
  wg = w.reshape(k // group_size, group_size, n)
  amax = jnp.max(jnp.abs(wg), axis=1)  # [G, N]
  _, e = jnp.frexp(amax)  # amax = f * 2**e, f in [0.5, 1)
  # |w * 2**-e| < 4, with 2**e and 2**-e both normal floats (a division by 2**127 may
  # run as a multiplication by its reciprocal, which XLA flushes to zero).
  e = jnp.where(amax > 0, jnp.clip(e - 1, -126, 126), 0)
  inv_rows = jnp.repeat(_pow2(-e), group_size, axis=0)
  v = rotation_lib.rotate_weight(w * inv_rows, rotation, group_size, seed)  # [G, d, N]
  rms = jnp.sqrt(jnp.mean(v * v, axis=1))  # [G, N]
  scale0 = rms * codebook_tables.initial_scale_factor(codebook_tables.table(codebook))

  def assign(scale):
    safe = jnp.where(scale != 0, scale, 1.0)
    idx = jnp.searchsorted(mids, (v / safe[:, None, :]).reshape(-1)).reshape(v.shape)
    return jnp.clip(idx, 0, 15)

  def sq_err(idx, scale):
    return jnp.sum((v - table[idx] * scale[:, None, :]) ** 2, axis=1)

  def refine(carry, _):
    best_idx, best_scale, best_err = carry
    c = table[best_idx]
    cc = jnp.sum(c * c, axis=1)
    scale = jnp.where(cc > 0, jnp.sum(v * c, axis=1) / jnp.where(cc > 0, cc, 1.0), 0.0)
    idx = assign(scale)
    err = sq_err(idx, scale)
    better = err < best_err
    return (jnp.where(better[:, None, :], idx, best_idx), jnp.where(better, scale, best_scale),
            jnp.where(better, err, best_err)), None

  idx0 = assign(scale0)
  init = (idx0, scale0, sq_err(idx0, scale0))
  (idx, scale, _), _ = jax.lax.scan(refine, init, None, length=_REFINE_STEPS)
  return idx.reshape(k, n).astype(jnp.uint8), scale * math.sqrt(group_size) * _pow2(e)


def _norms_in(norms, norm_dtype, name: str):
  """float32 ``norms`` in ``norm_dtype``, or float32 (with an :class:`int4.ScaleRangeWarning`)
  where a concrete norm overflows ``norm_dtype``, rounds to zero or loses over 1% in it
  (float16 holds norms from 6.1e-5 to 65504: weights of about 6000 and above with
  d = 128 overflow it). A norm that is not finite even in float32 raises ValueError."""
  if isinstance(norms, jax.core.Tracer):
    return norms.astype(norm_dtype)
  int4.check_finite(norms, f"norms of {name} in float32")
  if jnp.dtype(norm_dtype) == jnp.dtype(jnp.float32):
    return norms
  return norms.astype(int4.dtype_that_fits(norms, norm_dtype, name, what="norms",
                                           option="norm_dtype"))


def _check_weight(w, name):
  formats.check_not_quantized(w, name)
  if getattr(w, "ndim", None) != 2:
    raise ValueError(f"{name} must be a [K, N] matrix, got shape {getattr(w, 'shape', None)}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got dtype {w.dtype}")
  int4.check_finite(w, name)


def quantize_codebook(
    w: jax.Array,
    *,
    group: int = 128,
    passes: int = 1,
    codebook: str = "lloyd",
    rotation: str = "hadamard",
    seed: int = 0,
    norm_dtype=jnp.bfloat16,
    offload_pass2: bool = False,
    name: str = "w",
) -> CodebookWeight:
  """Rotated 4-bit codebook quantization of a ``[K, N]`` weight used as ``y = x @ W``.

  Args:
    w: ``[K, N]`` float weight.
    group: ``d``, rows of K per rotation group and per norm: 64 or 128.
    passes: 1, or 2 to also code the residual ``W - dequantize(pass 1)``.
    codebook: "lloyd" (Lloyd-Max for N(0, 1), the default), "nf4" or "iq4_nl".
    rotation: "hadamard" (randomized Hadamard, the default) or "orthogonal".
    seed: rotation seed of pass 1 (pass 2 uses seed + 1), in [0, 2**31 - 2].
    norm_dtype: dtype of the stored norms (bf16, f16, f32).
    offload_pass2: place pass 2's arrays in pinned host memory (see
      :func:`qjax.place_pass2`); matmul copies them to the device per call.
    name: the weight's name, for error and warning messages.

  Raises:
    ValueError: naming ``name``, when ``w`` is not a float ``[K, N]`` matrix (or is
      already quantized), holds NaN or Inf or (float64) values beyond float32's range, or
      a norm is not finite even in float32 (weights near the float32 maximum); naming the
      argument, for a ``group``, ``passes``, ``codebook``, ``rotation``, ``seed`` or
      ``norm_dtype`` not listed above, K not a multiple of ``group``, or
      ``offload_pass2`` with one pass.

  Guards: for a concrete ``w`` (not a tracer under ``jax.jit``, where values are
  unknown), non-finite weights raise, and norms that overflow ``norm_dtype``, round to
  zero in it or lose over 1% (float16 subnormals) are stored in float32 with a
  :class:`qjax._src.int4.ScaleRangeWarning`. Under ``jit`` neither check runs. The fit is
  scale-invariant: a weight times a power of two gives the same codes and its norms
  times that power.

  >>> import jax, qjax
  >>> w = jax.random.normal(jax.random.key(0), (256, 64))
  >>> qw = qjax.quantize_codebook(w, group=128, passes=2)
  >>> qw.codes.shape, qw.norms.shape, qw.passes, round(qw.bits_per_weight(), 3)
  ((32, 64), (2, 64), 2, 8.316)
  """
  _check_weight(w, name)
  rotation_lib.check(rotation, group, seed, group_name="group")
  if passes not in (1, 2):
    raise ValueError(f"{passes=} must be 1 or 2")
  codebook_tables.table(codebook)  # validates the name
  if jnp.dtype(norm_dtype) not in [jnp.dtype(d) for d in NORM_DTYPES]:
    raise ValueError(f"{norm_dtype=} must be one of bfloat16, float16, float32")
  k, n = w.shape
  if k % group:
    raise ValueError(f"K={k} must be a multiple of {group=}; pad K or choose a group size "
                     "that divides it")
  w32 = jnp.asarray(w, jnp.float32)
  table = jnp.asarray(codebook_tables.table(codebook))
  fit = functools.partial(_fit_pass, codebook=codebook, group_size=group, rotation=rotation)
  idx, norms = fit(w32, seed=seed)
  norms = _norms_in(norms, norm_dtype, name)
  out = CodebookWeight(codes=packing.pack_codes(idx, packing.NATIVE_TILE_K), norms=norms,
                       codebook=table, shape=(k, n), group_size=group, rotation=rotation,
                       seed=seed, codebook_name=codebook)
  if passes == 2:
    idx2, norms2 = fit(w32 - out.dequantize(), seed=seed + 1)
    norms2 = _norms_in(norms2, norm_dtype, f"{name} (pass 2)")
    out = dataclasses.replace(out, codes2=packing.pack_codes(idx2, packing.NATIVE_TILE_K),
                              norms2=norms2, codebook2=table)
    if offload_pass2:
      from qjax._src import offload  # pylint: disable=g-import-not-at-top
      out = offload.place_pass2(out, "pinned_host")
  elif offload_pass2:
    raise ValueError("offload_pass2=True needs passes=2 (there is no pass 2 to offload)")
  return out


def second_pass_on_device(w: CodebookWeight) -> CodebookWeight:
  """``w`` with pass 2's arrays copied to device memory (a no-op where they are already
  there; inside jit, XLA schedules the copy from pinned host memory)."""
  if w.codes2 is None:
    return w
  moved = jax.device_put((w.codes2, w.norms2, w.codebook2), jax.memory.Space.Device)
  return dataclasses.replace(w, codes2=moved[0], norms2=moved[1], codebook2=moved[2])


def _pass_matmul(x_rot, codes, norms, codebook, k, n, group_size):
  """``sum_g (x_rot_g @ codebook[idx_g]) * norms_g / sqrt(d)``: ``[M, N]`` float32."""
  m = x_rot.shape[0]
  g = k // group_size
  idx = packing.unpack_codes(codes, k, packing.NATIVE_TILE_K).astype(jnp.int32)
  levels = codebook[idx].reshape(g, group_size, n)
  parts = jnp.einsum("mgd,gdn->mgn", x_rot.reshape(m, g, group_size), levels,
                     precision=jax.lax.Precision.HIGHEST)
  scale = norms.astype(jnp.float32) / math.sqrt(group_size)
  return jnp.sum(parts * scale[None], axis=1)


def matmul_xla(x: jax.Array, w: CodebookWeight) -> jax.Array:
  """Reference ``x [M, K] @ W [K, N] -> [M, N]`` in x's dtype: x rotated per group once
  per pass, float32 throughout."""
  w = second_pass_on_device(w)
  k, n = w.shape
  x_rot = rotation_lib.rotate_activations(x, w.rotation, w.group_size, w.seed)
  y = _pass_matmul(x_rot, w.codes, w.norms, w.codebook, k, n, w.group_size)
  if w.codes2 is not None:
    x_rot2 = rotation_lib.rotate_activations(x, w.rotation, w.group_size, w.seed + 1)
    y = y + _pass_matmul(x_rot2, w.codes2, w.norms2, w.codebook2, k, n, w.group_size)
  return y.astype(x.dtype)
