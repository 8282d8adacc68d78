"""The MXFP4 layout of GPT-OSS checkpoints, kept as stored, and its lossless conversion.

GPT-OSS (Hugging Face ``transformers`` naming) stores each expert weight as two uint8
tensors, for experts of logical shape ``[K, N]`` (``y = x @ W``; the checkpoint's
``[out, in]`` is ``[N, K]``):

* ``*_blocks``: ``[E, N, K // 32, 16]``; byte ``b`` of block ``j`` of row ``n`` holds the
  E2M1 codes of ``k = 32 j + 2 b`` (low nibble) and ``k = 32 j + 2 b + 1`` (high nibble).
* ``*_scales``: ``[E, N, K // 32]`` E8M0 biased exponents (``2 ** (e - 127)``).

:class:`GptOssMXFP4Weight` holds those arrays as they are (its ``dequantize`` and XLA
matmul read them directly); ``to_mxfp4`` converts to the kernel-native
:class:`~qjax._src.fp4.MXFP4Weight` and ``from_mxfp4`` back, bit for bit, inside jit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import dispatch
from qjax._src import formats
from qjax._src import fp4
from qjax._src import packing

BYTES_PER_BLOCK = fp4.MXFP4_BLOCK // 2


@formats.register_format
@dataclasses.dataclass(frozen=True)
class GptOssMXFP4Weight(formats.QuantizedWeight):
  """GPT-OSS MXFP4 weight of logical shape ``[K, N]`` in the checkpoint's layout.

  ``W[k, n] = e2m1(nibble(blocks[n, k // 32, (k % 32) // 2], k % 2)) *
  2 ** (scales[n, k // 32] - 127)``, low nibble for even ``k``.

  Attributes:
    blocks: ``[N, K // 32, 16]`` uint8, two E2M1 codes per byte, low nibble first.
    scales: ``[N, K // 32]`` uint8 E8M0 biased exponents.
    shape: the logical ``(K, N)``.

  Leading expert axes may precede both arrays (``[E, N, K // 32, 16]``).
  """

  format_name = "gpt_oss_mxfp4"

  blocks: jax.Array
  scales: jax.Array
  shape: tuple[int, int] = formats.static_field()

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    k, n = self.shape
    if k <= 0 or n <= 0 or k % fp4.MXFP4_BLOCK:
      raise ValueError(
          f"GptOssMXFP4Weight: shape (K={k}, N={n}) needs positive dims and K a multiple of "
          f"{fp4.MXFP4_BLOCK}")
    if not self._leaves_concrete_2d():
      return
    nb = k // fp4.MXFP4_BLOCK
    for field, shape in (("blocks", (n, nb, BYTES_PER_BLOCK)), ("scales", (n, nb))):
      a = getattr(self, field)
      if tuple(a.shape[a.ndim - len(shape):]) != shape or jnp.dtype(a.dtype) != jnp.uint8:
        raise ValueError(
            f"GptOssMXFP4Weight.{field} must be {shape} uint8 (after any leading expert "
            f"axes), got {tuple(a.shape)} {jnp.dtype(a.dtype).name} (shape={self.shape})")
    lead_blocks, lead_scales = tuple(self.blocks.shape[:-3]), tuple(self.scales.shape[:-2])
    if lead_blocks != lead_scales:  # dequantize would broadcast one expert's scales
      raise ValueError(
          f"GptOssMXFP4Weight: blocks {tuple(self.blocks.shape)} and scales "
          f"{tuple(self.scales.shape)} must share their leading expert axes, got "
          f"{lead_blocks} and {lead_scales}")

  def unpacked_codes(self) -> jax.Array:
    """``[..., K, N]`` uint8 E2M1 codes."""
    b = jnp.asarray(self.blocks)
    pairs = jnp.stack([b & 0xF, b >> 4], axis=-1)          # [..., N, K // 32, 16, 2]
    codes_nk = pairs.reshape(*b.shape[:-3], self.shape[1], self.shape[0])
    return jnp.swapaxes(codes_nk, -1, -2)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[..., K, N]``: the same arithmetic as :meth:`MXFP4Weight.dequantize`."""
    values = fp4.decode_e2m1(self.unpacked_codes())
    scales = jnp.swapaxes(fp4.decode_e8m0(self.scales), -1, -2)
    return (values * jnp.repeat(scales, fp4.MXFP4_BLOCK, axis=-2)).astype(dtype)

  def to_mxfp4(self, tile_k: int = packing.NATIVE_TILE_K) -> fp4.MXFP4Weight:
    """The kernel-native :class:`MXFP4Weight` (lossless, jittable)."""
    return fp4.MXFP4Weight(codes=packing.pack_codes(self.unpacked_codes(), tile_k),
                           scales=jnp.swapaxes(jnp.asarray(self.scales), -1, -2),
                           shape=self.shape, tile_k=tile_k)

  def output_rows(self, index: slice) -> "GptOssMXFP4Weight":
    """The weight of the output rows (columns ``n`` of ``W``) that ``index`` selects, e.g.
    ``slice(0, None, 2)`` for the gate half of GPT-OSS's interleaved ``gate_up_proj``
    (lossless: the rows' blocks and scales as stored)."""
    blocks = self.blocks[..., index, :, :]
    return GptOssMXFP4Weight(blocks=blocks, scales=self.scales[..., index, :],
                             shape=(self.shape[0], blocks.shape[-3]))

  @classmethod
  def from_mxfp4(cls, w: fp4.MXFP4Weight) -> "GptOssMXFP4Weight":
    """The inverse of :meth:`to_mxfp4` (for writing checkpoints and for tests)."""
    if not isinstance(w, fp4.MXFP4Weight):
      raise TypeError(f"from_mxfp4 expects an MXFP4Weight, got {type(w).__name__}")
    k, n = w.shape
    codes_nk = jnp.swapaxes(w.unpacked_codes(), -1, -2)    # [..., N, K]
    pairs = codes_nk.reshape(*codes_nk.shape[:-1], k // 2, 2)
    bytes_ = pairs[..., 0] | (pairs[..., 1] << 4)
    blocks = bytes_.reshape(*codes_nk.shape[:-1], k // fp4.MXFP4_BLOCK, BYTES_PER_BLOCK)
    return cls(blocks=blocks.astype(jnp.uint8), scales=jnp.swapaxes(w.scales, -1, -2),
               shape=w.shape)


def read_gpt_oss_mxfp4(path: Any, name: str) -> GptOssMXFP4Weight:
  """Reads ``{name}_blocks`` and ``{name}_scales`` from a safetensors checkpoint as stored.

  Args:
    path: a ``.safetensors`` file, or a checkpoint folder (``model.safetensors``, or the
      shards named by ``model.safetensors.index.json``, as GPT-OSS ships them; the two
      tensors may lie in different shards), or an open
      :class:`qjax._src.safetensors_io.Checkpoint` of one.
    name: the tensor name without the suffix, e.g.
      ``model.layers.0.mlp.experts.down_proj``.

  Returns:
    A :class:`GptOssMXFP4Weight` with the file's leading expert axis, numpy-backed (no
    float copy is made).

  Raises:
    KeyError: a tensor is missing (the message lists the MXFP4 tensors present).
    ValueError: a bad file, index or shape, naming it.
  """
  from qjax._src import safetensors_io as sio  # pylint: disable=g-import-not-at-top
  ckpt = path if isinstance(path, sio.Checkpoint) else sio.Checkpoint(path)
  where = os.fspath(ckpt.folder if isinstance(path, sio.Checkpoint) else path)
  missing = [s for s in (f"{name}_blocks", f"{name}_scales") if s not in ckpt]
  if missing:
    near = sorted(k for k in ckpt.names() if k.endswith(("_blocks", "_scales")))[:8]
    raise KeyError(f"{where} has no tensor {missing[0]!r}; MXFP4 tensors in it: {near}")
  blocks = np.asarray(ckpt.get(f"{name}_blocks"))
  scales = np.asarray(ckpt.get(f"{name}_scales"))
  if blocks.ndim < 3 or blocks.shape[-1] != BYTES_PER_BLOCK:
    raise ValueError(f"{name}_blocks has shape {blocks.shape}; expected [..., N, K // 32, 16]")
  k = blocks.shape[-2] * fp4.MXFP4_BLOCK
  return GptOssMXFP4Weight(blocks=blocks, scales=scales, shape=(k, blocks.shape[-3]))


def matmul_xla(x: jax.Array, w: GptOssMXFP4Weight) -> jax.Array:
  """Reference ``x [M, K] @ W [K, N]`` straight from the checkpoint layout."""
  if w.blocks.ndim != 3:
    raise NotImplementedError(
        f"blocks of shape {w.blocks.shape}: matmul takes one expert; vmap over leading axes")
  return formats.dense_dot(x, w.dequantize(x.dtype))


dispatch.register_xla(GptOssMXFP4Weight, matmul_xla)
