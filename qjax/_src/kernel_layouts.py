"""``qjax.kernel_layouts``: a params tree's quantized weights in the layouts that the
fastest kernels registered for a device read.

A format may have a lossless conversion to another whose kernel is faster on some
devices: on Hopper, an :class:`~qjax.Int4Weight` (symmetric or with integer zero points,
bf16 or f16 scales) to :class:`~qjax.Int4NKWeight` (the wgmma kernel: at M = 1 / 16,
68-92 % of the bandwidth floor on three of the four Llama shapes where the Int4Weight
GEMV / Triton kernels reach 65-81 %; from M = 256, 0.82-1.03x bf16's time, where
Int4Weight's XLA path takes 1.2-2.2x; BENCHMARKS.md),
MXFP4 / NVFP4 to their ``[N, K / 8]`` forms likewise; on any GPU with the Triton
kernels, GGUF blocks to the layouts their kernels read (else converted on every call) and
GPTQ / AWQ / compressed-tensors to Int4Weight (else repacked on every call).

:func:`kernel_layouts` applies such a conversion to a weight only where the target
format's kernel runs on the device and accepts the converted weight (its shape, group
size, scale dtype and the activations' dtype). A weight no kernel would run better is
left as it is: the converted layouts' XLA paths are slower than the originals' (the NK
formats' by 3-10x), so converting on a CPU would only cost time. Every conversion is
bit-exact (``dequantize()`` is unchanged).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import checkpoint_layouts
from qjax._src import dispatch
from qjax._src import formats
from qjax._src import fp4
from qjax._src import fp4_nk
from qjax._src import gguf_formats
from qjax._src import gguf_tiled
from qjax._src import gpt_oss_layout
from qjax._src import int4
from qjax._src import int4_nk
from qjax._src import marlin_layout
from qjax._src import moe


@dataclasses.dataclass(frozen=True)
class LayoutConversion:
  """A lossless conversion of one weight format into another.

  Attributes:
    target: the format class ``convert`` returns.
    convert: ``w -> w'`` with ``w'.dequantize() == w.dequantize()`` bit for bit.
    refuses: ``w -> None`` where ``convert`` applies to ``w``, else the reason it does not
      (e.g. an Int4Weight with float biases has no Int4NKWeight form).
  """
  target: type
  convert: Callable[[Any], Any]
  refuses: Callable[[Any], str | None] = lambda w: None


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
  """What :func:`kernel_layouts` did with one quantized weight.

  Attributes:
    path: the weight's path in the tree, keys joined by "/".
    source: its format's class name.
    target: the class name of the format it was converted to, or None (kept).
    reason: why it was converted or kept.
  """
  path: str
  source: str
  target: str | None
  reason: str

  def __str__(self) -> str:
    if self.target is None:
      return f"{self.path}: {self.source} kept ({self.reason})"
    return f"{self.path}: {self.source} -> {self.target} ({self.reason})"


_CONVERSIONS: dict[type, list[LayoutConversion]] = {}


def register_layout_conversion(source: type, conversion: LayoutConversion) -> None:
  """Registers a lossless conversion of ``source`` weights that :func:`kernel_layouts`
  applies where ``conversion.target``'s kernel runs on the device and accepts the result.
  Conversions of one source are tried in the order registered."""
  _CONVERSIONS[source] = [*_CONVERSIONS.get(source, []), conversion]


def _int4_nk_refuses(w: int4.Int4Weight) -> str | None:
  if w.biases is not None:
    return ("float biases (W = q * s + b): the [N, K / 8] layout holds symmetric INT4 or "
            "integer zero points only")
  k = w.shape[0]
  if k % int4_nk.CHUNK or w.group_size % int4_nk.CHUNK:
    return (f"K={k} and group_size={w.group_size} must be multiples of {int4_nk.CHUNK} for "
            "the [N, K / 8] layout")
  return None


def _fp4_nk_refuses(w: Any) -> str | None:
  k = w.shape[0]
  if k % int4_nk.CHUNK:
    return f"K={k} must be a multiple of {int4_nk.CHUNK} for the [N, K / 8] layout"
  return None


def _act_order_refuses(w: checkpoint_layouts.GPTQWeight) -> str | None:
  """GPTQ act-order (a ``g_idx`` other than ``k // G``) has an Int4Weight only with x's
  columns permuted on each call, which a weight cannot carry."""
  if w.g_idx is None:
    return None
  k, g = w.shape[0], w.group_size
  if (not checkpoint_layouts._is_concrete(w.g_idx)  # pylint: disable=protected-access
      or not np.array_equal(np.asarray(w.g_idx), np.arange(k) // g)):
    return ("act-order g_idx: its Int4Weight needs x's columns permuted, so it is repacked "
            "on each call instead")
  return None


register_layout_conversion(int4.Int4Weight, LayoutConversion(
    int4_nk.Int4NKWeight, int4_nk.to_int4_nk, _int4_nk_refuses))
register_layout_conversion(fp4.MXFP4Weight, LayoutConversion(
    fp4_nk.MXFP4NKWeight, fp4_nk.to_mxfp4_nk, _fp4_nk_refuses))
register_layout_conversion(fp4.NVFP4Weight, LayoutConversion(
    fp4_nk.NVFP4NKWeight, fp4_nk.to_nvfp4_nk, _fp4_nk_refuses))
def _gguf_stack_refuses(w: gguf_formats.GGUFBlockWeight) -> str | None:
  if w.leading_axes:
    return (f"a stack of {w.leading_axes} matrices (MoE experts): the layout's kernel reads "
            "one matrix, and no MoE kernel reads it")
  return None


# GGUF blocks: the layout each type's kernel reads, as gguf_tiled.kernel_layout gives it.
# MXFP4, Q4_0 and Q4_1 stacks too: the MoE kernels read their MXFP4Weight / Int4Weight
# stacks (the dense kernels decline a stack: Backend.declines).
register_layout_conversion(gguf_formats.GGUFMXFP4, LayoutConversion(
    fp4.MXFP4Weight, gguf_tiled.kernel_layout))
for _cls in (gguf_formats.GGUFQ4_0, gguf_formats.GGUFQ4_1):
  register_layout_conversion(_cls, LayoutConversion(int4.Int4Weight, gguf_tiled.kernel_layout))
for _cls, _target in ((gguf_formats.GGUFQ8_0, gguf_tiled.GGUFTiledWeight),
                      (gguf_formats.GGUFQ4_K, gguf_tiled.GGUFTiledWeight),
                      (gguf_formats.GGUFQ5_K, gguf_tiled.GGUFTiledWeight),
                      (gguf_formats.GGUFQ6_K, gguf_tiled.GGUFTiledWeight)):
  register_layout_conversion(_cls, LayoutConversion(_target, gguf_tiled.kernel_layout,
                                                    _gguf_stack_refuses))
register_layout_conversion(gpt_oss_layout.GptOssMXFP4Weight,
                           LayoutConversion(fp4.MXFP4Weight, lambda w: w.to_mxfp4()))
register_layout_conversion(checkpoint_layouts.GPTQWeight, LayoutConversion(
    int4.Int4Weight, lambda w: w.to_int4(), _act_order_refuses))
for _cls in (checkpoint_layouts.AWQWeight, checkpoint_layouts.CompressedTensorsWeight,
             marlin_layout.MarlinWeight):
  register_layout_conversion(_cls, LayoutConversion(int4.Int4Weight, lambda w: w.to_int4()))
del _cls, _target


def convert_to(w: Any, target: type) -> Any:
  """``w`` in format ``target`` by its registered lossless conversion, on any device
  (no kernel check, unlike :func:`kernel_layouts`), or ``w`` as it is where its format has
  no conversion to ``target`` or the conversion refuses it (e.g. GPTQ act-order to
  :class:`~qjax.Int4Weight`)."""
  for conv in _CONVERSIONS.get(type(w), []):
    if conv.target is target and conv.refuses(w) is None:
      return conv.convert(w)
  return w


def _kernel_on(backends: list[dispatch.Backend], device: Any) -> dispatch.Backend | None:
  """The first of ``backends`` that compiles for ``device`` (the one ``qjax.matmul`` runs)."""
  return next((b for b in backends if b.supported_on(device)), None)


def _converted(w: Any, device: Any, dtype: Any, expert_stack: bool) -> tuple[Any, list[str]]:
  """``w`` after every conversion whose target's kernel runs it (the MoE kernel for an
  expert stack, else the dense one), and the reasons of each conversion made or refused,
  in order."""
  notes = []
  for _ in range(4):  # a chain: e.g. GGUF Q4_0 -> Int4Weight -> Int4NKWeight
    for conv in _CONVERSIONS.get(type(w), []):
      kernel = _kernel_on(moe.moe_kernels_for_format(conv.target) if expert_stack
                          else dispatch.kernels_for_format(conv.target), device)
      if kernel is None:
        why_not = f"no kernel for {conv.target.__name__} runs on {device.device_kind}"
      else:
        why_not = conv.refuses(w)
        if why_not is None:
          new = conv.convert(w)
          why_not = kernel.declines(new, dtype) if kernel.declines else None
      if why_not is None:
        notes.append(f"{conv.target.__name__}'s kernel runs it")
        w = new
        break
      notes.append(f"not {conv.target.__name__}: {why_not}")
    else:
      return w, notes
  return w, notes


def kernel_layouts(tree: Any, *, device: Any = None, dtype: Any = jnp.bfloat16,
                   experts: Callable[[str], bool] | None = None,
                   with_report: bool = False) -> Any:
  """``tree`` with each quantized weight in the layout the fastest kernel for ``device``
  reads: lossless conversions (``dequantize()`` bit-identical), applied where the target
  format's registered kernel runs on ``device`` and accepts the converted weight for
  activations of ``dtype`` at every M; other weights are kept as they are.

  On an H100: Int4Weight (no float biases) -> Int4NKWeight, MXFP4Weight -> MXFP4NKWeight,
  NVFP4Weight -> NVFP4NKWeight (bf16 activations; N a multiple of 128, INT4 with bf16 or
  f16 scales and groups of a multiple of 64); GGUF Q4_0 / Q4_1 -> Int4Weight, GGUF MXFP4 ->
  MXFP4Weight (-> MXFP4NKWeight), Q8_0 / K-quants -> GGUFTiledWeight (expert stacks:
  Q4_0 / Q4_1 -> Int4Weight and MXFP4 -> MXFP4Weight where ``experts`` names them, for
  the MoE kernels; the others are kept); GPT-OSS's
  ``*_blocks`` / ``*_scales`` -> MXFP4Weight (-> MXFP4NKWeight); GPTQ (without act-order),
  AWQ, compressed-tensors, Marlin -> Int4Weight. On a CPU nothing changes.

  Convert once after loading and before ``jax.jit``: each conversion is a pass over the
  weight. The target kernels take less device time; wall time at batch-1 decode is
  another matter (H100, BENCHMARKS.md session 30): a Llama-3-8B-shaped stack of 32 layers
  took 7 % less device time per token as Int4NKWeight, but the Mosaic GPU kernel's
  launches stay outside XLA's command buffers, so an unrolled decode step ran 7 % slower
  in wall time (436 against 469 tokens/s) and a ``lax.scan`` one 2 % faster (450 against
  440). In prefill Int4NKWeight is 1.8-2.4x faster than Int4Weight's XLA path at M = 256
  and about 1.15x at M = 2048 on the four Llama shapes (sessions 12, 19). At one row on
  4096x4096 the Int4Weight GEMV kernel is about 1 us faster (session 19).

  Args:
    tree: any pytree (Flax params, a dict of weights); non-quantized leaves are kept.
    device: the device the weights will run on; default ``jax.devices()[0]``.
    dtype: the activations' dtype (bf16, f16 or f32). float32 activations take the XLA
      path whatever the layout (``qjax.matmul``), so nothing is converted for them.
    experts: ``path -> bool``, true for the expert stacks that ``qjax.moe_matmul``
      multiplies (paths are keys joined by "/", e.g. ``"block_3/moe/down"``): these are
      checked against the format's MoE kernel, which takes N that the dense kernel does
      not (e.g. GPT-OSS's 2880; ``flax_layers.MXFP4MoE`` names them ``gate_up`` and
      ``down``). Every other weight, stacks under ``qjax.layer_of`` included, is checked
      against the dense kernel of ``qjax.matmul``. Default: no expert stacks.
    with_report: also return a list of :class:`LayoutChoice`, one per quantized weight.

  Returns:
    The converted tree, or ``(tree, report)`` with ``with_report``.

  >>> import jax, qjax
  >>> params = {"w": qjax.quantize(jax.random.normal(jax.random.key(0), (256, 128)))}
  >>> new, report = qjax.kernel_layouts(params, device=jax.devices("cpu")[0],
  ...                                   with_report=True)
  >>> type(new["w"]).__name__, report[0].target
  ('Int4Weight', None)
  """
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in dispatch.ACTIVATION_DTYPES]:
    raise ValueError(f"dtype={dtype!r} must be one of bfloat16, float16, float32 (the "
                     "activations' dtype)")
  device = dispatch.default_device() if device is None else device
  report = []

  def convert(path, leaf):
    if not formats.is_quantized(leaf):
      return leaf
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if dispatch.runs_xla_for_dtype(dtype):
      new, notes = leaf, ["float32 activations take the XLA path in every layout"]
    else:
      new, notes = _converted(leaf, device, dtype, experts is not None and experts(name))
    target = None if new is leaf else type(new).__name__
    report.append(LayoutChoice(name, type(leaf).__name__, target,
                               "; ".join(notes) or "no conversion for this format"))
    return new

  out = jax.tree_util.tree_map_with_path(convert, tree, is_leaf=formats.is_quantized)
  return (out, report) if with_report else out
