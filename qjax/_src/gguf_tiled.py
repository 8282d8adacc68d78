"""A kernel-native layout of GGUF's Q8_0, Q4_K, Q5_K and Q6_K, converted losslessly.

GGUF keeps each weight as ``N`` rows of blocks whose bytes mix scales and codes, which a
Pallas/Triton kernel cannot unpack without interleaves and value slices. At load, the
blocks are split into planes that a kernel reads like the INT4 kernel reads its codes
(:mod:`qjax._src.packing`'s slab order: one load, then a shift and a mask per 16-row
slab), with the scales kept at their own width: nothing is widened, so the layout takes
1.00-1.03x the file's bytes (plus padding of K to a multiple of 128 for Q8_0).

Every type becomes one affine rule per group ``g = k // group_size``::

    W[k, n] = s[g, n] * q[k, n] + b[g, n]

=======  =====  ====================  ==========================  ===================
type     group  q                     s                           b
=======  =====  ====================  ==========================  ===================
Q8_0     32     int8 (``q8``)          ``d[g]``                    0
Q4_K     32     low nibble             ``d[k // 256] * sc[g]``     ``-dmin[k//256] * mn[g]``
Q5_K     32     low | high bit << 4    as Q4_K                     as Q4_K
Q6_K     16     low | 2 high << 4      ``d[k // 256] * sc[g]``     ``-32 * s``
=======  =====  ====================  ==========================  ===================

In float32 both products are exact (an f16 times an integer of at most 8 bits, times a
code of at most 6 bits), so ``s * q + b`` is rounded once and equals gguf's own
dequantization bit for bit (``d * sc * (q - 32)`` for Q6_K included).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qjax._src import dispatch
from qjax._src import formats
from qjax._src import gguf_formats as gf
from qjax._src import packing

TILE_K = packing.NATIVE_TILE_K
SLAB = 16  # rows of one slab: the kernel's unit of work along K
QK_K = gf.QK_K

# ggml type -> (group_size, rows per d/dmin entry, high bits per code)
_SPECS = {"Q8_0": (32, 32, 0), "Q4_K": (32, QK_K, 0), "Q5_K": (32, QK_K, 1),
          "Q6_K": (16, QK_K, 2)}
TYPES = tuple(_SPECS)


def high_tile_rows(bits: int) -> int:
  """Rows covered by one ``[16, N]`` uint8 load of a plane of ``bits``-bit values."""
  return SLAB * (8 // bits)


def pack_high(values: jax.Array, bits: int) -> jax.Array:
  """Packs ``bits``-bit values (1 or 2) into bytes in slab order.

  Field ``j`` (bits ``bits * j ...``) of byte ``r`` of tile ``t`` holds row
  ``t * T + 16 * j + r`` with ``T = high_tile_rows(bits)`` (128 for 1 bit, 64 for 2).

  Args:
    values: ``[Kp, N]`` integers in ``[0, 2**bits)``; ``Kp`` a multiple of 128.

  Returns:
    ``[Kp // T * 16, N]`` uint8.
  """
  kp, n = values.shape
  per_byte = 8 // bits
  planes = values.astype(jnp.uint8).reshape(kp // (SLAB * per_byte), per_byte, SLAB, n)
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).reshape(per_byte, 1, 1)
  return (planes << shifts).sum(axis=1, dtype=jnp.uint8).reshape(-1, n)


def unpack_high(packed: jax.Array, bits: int) -> jax.Array:
  """Inverse of :func:`pack_high`: ``[Kp // T * 16, N]`` uint8 -> ``[Kp, N]`` uint8."""
  rows, n = packed.shape
  per_byte = 8 // bits
  tiles = packed.reshape(rows // SLAB, 1, SLAB, n)
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).reshape(per_byte, 1, 1)
  values = (tiles >> shifts) & jnp.uint8((1 << bits) - 1)
  return values.reshape(rows * per_byte, n)


def _columns(a: jax.Array) -> jax.Array:
  """GGUF's ``[N, nb, ...]`` per-block values -> ``[nb * ..., N]`` along logical K."""
  return a.reshape(a.shape[0], -1).T


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
  return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GGUFTiledWeight(formats.QuantizedWeight):
  """GGUF Q8_0 / Q4_K / Q5_K / Q6_K weight ``[K, N]`` in the kernel's plane layout.

  ``Kp`` is K rounded up to a multiple of 128 (padding rows hold code 0).

  Attributes:
    low: ``[Kp // 8, N]`` uint32, the low 4 bits of the codes in slab order (nibble
      ``j`` of word ``r`` of 128-row tile ``t`` is row ``128 t + 16 j + r``); None
      for Q8_0.
    high: the codes' bits above the fourth (:func:`pack_high`): ``[Kp // 8, N]`` uint8
      for Q5_K (1 bit), ``[Kp // 4, N]`` uint8 for Q6_K (2 bits); None otherwise.
    q8: ``[Kp, N]`` int8 codes of Q8_0; None otherwise.
    d: ``[K // 32, N]`` (Q8_0) or ``[K // 256, N]`` float16 scales.
    dmin: ``[K // 256, N]`` float16 min scales (Q4_K, Q5_K); None otherwise.
    sc: ``[K // group_size, N]`` sub-block scales: uint8 in [0, 63] (Q4_K, Q5_K) or int8
      (Q6_K); None for Q8_0.
    mn: ``[K // 32, N]`` uint8 sub-block mins in [0, 63] (Q4_K, Q5_K); None otherwise.
    shape: the logical ``(K, N)``.
    ggml_type: "Q8_0", "Q4_K", "Q5_K" or "Q6_K".
  """

  format_name = "gguf_tiled"

  low: jax.Array | None
  high: jax.Array | None
  q8: jax.Array | None
  d: jax.Array
  dmin: jax.Array | None
  sc: jax.Array | None
  mn: jax.Array | None
  shape: tuple[int, int] = formats.static_field()
  ggml_type: str = formats.static_field()

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(v) for v in self.shape))
    if self.ggml_type not in _SPECS:
      raise ValueError(f"GGUFTiledWeight: ggml_type={self.ggml_type!r} must be one of "
                       f"{list(_SPECS)}")
    k, n = self.shape
    if k % self.scale_rows:
      raise ValueError(f"GGUFTiledWeight {self.ggml_type}: K={k} must be a multiple of "
                       f"{self.scale_rows}")
    if not self._leaves_concrete_2d():
      return
    for name, want in self._expected().items():
      a = getattr(self, name)
      if want is None:
        if a is not None:
          raise ValueError(f"GGUFTiledWeight {self.ggml_type}: {name} must be None")
        continue
      shape, dtype = want
      if a is None or tuple(a.shape[-2:]) != shape or jnp.dtype(a.dtype) != jnp.dtype(dtype):
        got = None if a is None else (tuple(a.shape), jnp.dtype(a.dtype).name)
        raise ValueError(f"GGUFTiledWeight {self.ggml_type}.{name} must be {shape} "
                         f"{jnp.dtype(dtype).name}, got {got} (shape={self.shape})")

  @property
  def group_size(self) -> int:
    """Rows that share one ``s`` and ``b``."""
    return _SPECS[self.ggml_type][0]

  @property
  def scale_rows(self) -> int:
    """Rows that share one ``d`` (and ``dmin``)."""
    return _SPECS[self.ggml_type][1]

  @property
  def high_bits(self) -> int:
    """Code bits stored in ``high`` (0: none)."""
    return _SPECS[self.ggml_type][2]

  @property
  def padded_k(self) -> int:
    """K rounded up to whole ``TILE_K`` tiles: the rows the planes hold."""
    return packing.padded_rows(self.shape[0], TILE_K)

  def _expected(self) -> dict[str, tuple[tuple[int, int], Any] | None]:
    k, n = self.shape
    kp, g = self.padded_k, self.group_size
    t = self.ggml_type
    kquant = t in ("Q4_K", "Q5_K")
    return {
        "low": None if t == "Q8_0" else ((kp // 8, n), jnp.uint32),
        "high": (((kp // high_tile_rows(self.high_bits) * SLAB, n), jnp.uint8)
                 if self.high_bits else None),
        "q8": ((kp, n), jnp.int8) if t == "Q8_0" else None,
        "d": ((k // self.scale_rows, n), jnp.float16),
        "dmin": ((k // QK_K, n), jnp.float16) if kquant else None,
        "sc": None if t == "Q8_0" else ((k // g, n), jnp.int8 if t == "Q6_K" else jnp.uint8),
        "mn": ((k // 32, n), jnp.uint8) if kquant else None,
    }

  # -- conversion ------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, w: gf.GGUFBlockWeight) -> "GGUFTiledWeight":
    """The layout of a GGUF block weight (Q8_0, Q4_K, Q5_K or Q6_K); lossless, jittable."""
    t = w.ggml_type
    if t not in _SPECS:
      raise ValueError(f"GGUFTiledWeight.from_gguf: {type(w).__name__} ({t}) is not one of "
                       f"{list(_SPECS)}; Q4_0 and Q4_1 convert to Int4Weight (to_int4), MXFP4 to "
                       "MXFP4Weight (to_mxfp4)")
    w._single_matrix("from_gguf")  # pylint: disable=protected-access
    k, n = w.shape
    kp = packing.padded_rows(k, TILE_K)
    d = w.d.T if t == "Q8_0" else _columns(w.d)
    if t == "Q8_0":
      q8 = _pad_rows(w.qs.reshape(n, k).T, kp)
      return cls(low=None, high=None, q8=q8, d=d, dmin=None, sc=None, mn=None,
                 shape=(k, n), ggml_type=t)
    codes = _pad_rows(w.codes().reshape(n, k).T, kp)  # [Kp, N] uint8
    low = packing.pack_codes(codes & 0xF, TILE_K)
    bits = _SPECS[t][2]
    high = pack_high(codes >> 4, bits) if bits else None
    if t == "Q6_K":
      return cls(low=low, high=high, q8=None, d=d, dmin=None, sc=_columns(w.scales),
                 mn=None, shape=(k, n), ggml_type=t)
    sc, mn = gf._q4k_scale_min(w.scales)  # pylint: disable=protected-access
    return cls(low=low, high=high, q8=None, d=d, dmin=_columns(w.dmin), sc=_columns(sc),
               mn=_columns(mn), shape=(k, n), ggml_type=t)

  def codes(self) -> jax.Array:
    """``[K, N]`` codes: int8 for Q8_0, uint8 in ``[0, 2**(4 + high_bits))`` otherwise."""
    k = self.shape[0]
    if self.q8 is not None:
      return self.q8[:k]
    q = packing.unpack_codes(self.low, k, TILE_K)
    if self.high is not None:
      q = q | (unpack_high(self.high, self.high_bits)[:k] << 4)
    return q

  def group_affine(self) -> tuple[jax.Array, jax.Array]:
    """``(s, b)``: ``[K // group_size, N]`` float32 each, exact (see the module doc)."""
    per = self.scale_rows // self.group_size
    d = jnp.repeat(self.d.astype(jnp.float32), per, axis=0)
    if self.ggml_type == "Q8_0":
      return d, jnp.zeros_like(d)
    s = d * self.sc.astype(jnp.float32)
    if self.ggml_type == "Q6_K":
      return s, -32.0 * s
    b = -(jnp.repeat(self.dmin.astype(jnp.float32), per, axis=0) * self.mn.astype(jnp.float32))
    return s, b

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[K, N]`` in ``dtype``; in float32 (the default) bit-identical to the GGUF
    weight's ``dequantize()``."""
    s, b = self.group_affine()
    g = self.group_size
    k, n = self.shape
    q = self.codes().astype(jnp.float32).reshape(k // g, g, n)
    s = s[:, None, :]
    # The same operations as gguf (down to the sign of zero): d * q for Q8_0,
    # d * sc * (q - 32) for Q6_K, d * sc * q - dmin * m for Q4_K / Q5_K.
    if self.ggml_type == "Q8_0":
      w = s * q
    elif self.ggml_type == "Q6_K":
      w = s * (q - 32.0)
    else:
      w = s * q + b[:, None, :]
    return w.reshape(k, n).astype(dtype)

  def take_rows(self, ids: jax.Array) -> jax.Array:
    """Columns ``ids`` of W as rows: ``[*ids.shape, K]`` float32 (embedding lookup).

    Only the gathered columns are dequantized.
    """
    ids = jnp.asarray(ids)
    flat = ids.reshape(-1)
    fields = {f: None if getattr(self, f) is None else jnp.take(getattr(self, f), flat, axis=-1)
              for f in formats.array_field_names(type(self))}
    cols = GGUFTiledWeight(**fields, shape=(self.shape[0], flat.shape[0]),
                           ggml_type=self.ggml_type)
    return cols.dequantize().T.reshape(*ids.shape, self.shape[0])


def converts(w: Any) -> bool:
  """Whether :func:`kernel_layout` gives ``w`` another layout (False: ``w`` itself)."""
  if isinstance(w, (gf.GGUFQ4_0, gf.GGUFQ4_1, gf.GGUFMXFP4)):
    return True
  return (isinstance(w, gf.GGUFBlockWeight) and w.ggml_type in _SPECS
          and not getattr(w, "leading_axes", ()))


def kernel_layout(w: Any) -> Any:
  """The layout a GGUF weight's kernel reads: Int4Weight for Q4_0 / Q4_1, MXFP4Weight
  for MXFP4, the tiled layout for Q8_0 / Q4_K / Q5_K / Q6_K, anything else unchanged
  (:func:`converts`). Expert stacks (leading axes) stay as they are, but Q4_0 / Q4_1 /
  MXFP4 ones, whose ``to_int4()`` / ``to_mxfp4()`` is the stack the MoE kernels read: no
  MoE kernel reads the other GGUF types. Lossless, jittable; called eagerly, one compiled
  program per weight type and shape (Q4_K 2048 x 8192 on a 2-core CPU: ~10 ms, where the
  eager ops took ~135 ms; Q8_0 14 -> 28 ms, the one type slower so)."""
  if not converts(w):
    return w  # as it is (a jitted identity would copy it)
  return _converted_layout(w)


@jax.jit
def _converted_layout(w: Any) -> Any:
  """:func:`kernel_layout` of a weight it converts, as one compiled program."""
  if isinstance(w, (gf.GGUFQ4_0, gf.GGUFQ4_1)):
    return w.to_int4()
  if isinstance(w, gf.GGUFMXFP4):
    return w.to_mxfp4()
  return GGUFTiledWeight.from_gguf(w)


dispatch.register_xla(GGUFTiledWeight, gf.matmul_xla)
