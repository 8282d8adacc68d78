"""Hugging Face safetensors checkpoints: reading and writing the tensors of one linear layer.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards named
by ``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). Its
``quantization_config`` picks the layout of the quantized linears (:class:`Quantization`);
each linear ``PREFIX`` (e.g. ``model.layers.0.self_attn.q_proj``) is stored as:

* dense: ``PREFIX.weight [N, K]`` f32 / f16 / bf16 (torch ``Linear.weight``);
* ``gptq`` (AutoGPTQ / GPTQModel): ``PREFIX.qweight [K // 8, N]`` int32, ``PREFIX.qzeros
  [K // G, N // 8]`` int32, ``PREFIX.scales [K // G, N]`` f16, ``PREFIX.g_idx [K]`` int32
  (written by every producer, trivial ``k // G`` without act-order);
* ``awq`` (AutoAWQ GEMM): ``PREFIX.qweight [K, N // 8]`` int32, ``PREFIX.qzeros
  [K // G, N // 8]`` int32, ``PREFIX.scales [K // G, N]`` f16;
* ``compressed-tensors`` pack-quantized: ``PREFIX.weight_packed [N, K // 8]`` int32,
  ``PREFIX.weight_scale [N, K // G]``, ``PREFIX.weight_shape [2]`` int (``(N, K)``) and,
  when asymmetric, ``PREFIX.weight_zero_point [ceil(N / 8), K // G]`` int32: the signed
  zero points ``+ 8``, packed along N (nibble ``i`` of word ``r`` holds row ``8r + i``;
  ``pack_to_int32(zero_point, 4, packed_dim=0)`` in compressed-tensors'
  ``pack_quantized.py``), or, as versions before that packing (April 2025) wrote them,
  the signed zero points as int8 ``[N, K // G]``.

Tensors are read one at a time with ``safetensors.safe_open(framework="numpy")``, kept in
their stored integer / float dtypes (no float copy of a quantized layer) and wrapped in
the qjax layout pytrees (:mod:`qjax._src.checkpoint_layouts`) or, for dense weights,
:class:`~qjax._src.gguf_formats.GGUFDense` (which stores ``[N, K]`` as the file does).
Every bad tensor (missing, wrong shape or dtype, group size not dividing K) raises one
ValueError naming it. ``safetensors`` is imported only when a file is opened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import tempfile
import warnings
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qjax._src import checkpoint_layouts as layouts
from qjax._src import formats
from qjax._src import gguf_formats
from qjax._src import int4

CONFIG_FILE = "config.json"
# Where older AutoGPTQ / AutoAWQ checkpoints keep their scheme, with no quantization_config
# in config.json (file -> the quant_method it implies where it names none).
LEGACY_QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

METHODS = ("gptq", "awq", "compressed-tensors")
DENSE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
SCALE_DTYPES = DENSE_DTYPES
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# ------------------------------------------------------------------------- quantization


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantization:
  """The INT4 scheme a checkpoint's ``quantization_config`` names.

  Attributes:
    method: "gptq", "awq" or "compressed-tensors".
    group_size: G, or -1 for one group per output column (per-channel: G = K).
    symmetric: GPTQ ``sym`` / compressed-tensors ``symmetric`` (AWQ: False).
    desc_act: GPTQ act-order (``g_idx`` may be any grouping of the rows).
    zero_point_version: GPTQ only: 1 (``checkpoint_format`` "gptq", stored ``z - 1``) or
      2 ("gptq_v2", stored ``z``).
    dynamic: GPTQ only (GPTQModel's ``dynamic``): ``((pattern, overrides), ...)`` in the
      config's order; the first pattern that ``re.match``-es a module's name applies:
      ``"-:PATTERN"`` leaves the module unquantized, ``"+:PATTERN"`` or ``"PATTERN"``
      overrides its ``bits`` / ``group_size`` / ``sym`` / ``desc_act``
      (:meth:`for_module`).
  """
  method: str
  group_size: int
  symmetric: bool = False
  desc_act: bool = False
  zero_point_version: int = 1
  dynamic: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

  def group_size_for(self, k: int) -> int:
    return k if self.group_size == -1 else self.group_size

  def for_module(self, prefix: str) -> "Quantization | None":
    """The scheme of module ``prefix`` after the ``dynamic`` overrides; None when a
    ``-:`` pattern leaves it unquantized."""
    for pattern, overrides in self.dynamic:
      if pattern.startswith("-:"):
        if re.match(pattern[2:], prefix):
          return None
        continue
      if not re.match(pattern[2:] if pattern.startswith("+:") else pattern, prefix):
        continue
      o = dict(overrides)
      where = f"dynamic[{pattern!r}]"
      _need_bits4(o.get("bits", 4), where + ".bits")
      return dataclasses.replace(
          self, dynamic=(),
          group_size=_group_size(o.get("group_size", self.group_size),
                                 where + ".group_size"),
          symmetric=bool(o.get("sym", self.symmetric)),
          desc_act=bool(o.get("desc_act", self.desc_act)))
    return dataclasses.replace(self, dynamic=()) if self.dynamic else self


def _need_bits4(bits: Any, where: str) -> None:
  if bits != 4:
    raise ValueError(f"quantization_config {where}={bits!r}: qjax reads 4-bit checkpoints "
                     "only")


def _group_size(v: Any, where: str) -> int:
  if v is None:
    return -1
  g = int(v)
  if g != -1 and g <= 0:
    raise ValueError(f"quantization_config {where}={v!r} must be positive or -1 "
                     "(per-channel)")
  return g


def _gptq_dynamic(dynamic: Any) -> tuple:
  """GPTQModel's ``dynamic`` ``{pattern: {key: value}}`` as :attr:`Quantization.dynamic`."""
  if not dynamic:
    return ()
  if not isinstance(dynamic, Mapping) or not all(
      isinstance(k, str) and isinstance(v, Mapping) for k, v in dynamic.items()):
    raise ValueError(f"quantization_config dynamic={dynamic!r:.80} must map module-name "
                     "patterns to objects of overrides (GPTQModel's per-module config)")
  out = []
  for pattern, overrides in dynamic.items():
    try:
      re.compile(pattern[2:] if pattern.startswith(("+:", "-:")) else pattern)
    except re.error as e:
      raise ValueError(f"quantization_config dynamic pattern {pattern!r} is not a regular "
                       f"expression ({e})") from None
    out.append((pattern, tuple(sorted((str(k), v) for k, v in overrides.items()
                                      if isinstance(v, (bool, int, float, str))))))
  return tuple(out)


def parse_quantization(config: Mapping[str, Any]) -> Quantization | None:
  """The :class:`Quantization` of a ``config.json`` dict; None for a dense checkpoint.

  Raises:
    ValueError: an unsupported ``quant_method``, bit width, GPTQ ``checkpoint_format`` /
      ``is_marlin_format`` / ``pack_dtype``, AWQ ``version``, compressed-tensors
      ``format``, scheme, act-order, dynamic weight scales, sparsity format or
      ``quantization_status``, naming the key.

  Warns:
    UserWarning: compressed-tensors activation or KV-cache quantization, which qjax does
      not apply (weight-only: activations stay in their float dtype).
  """
  qc = config.get("quantization_config")
  if not qc:
    return None
  if not isinstance(qc, Mapping):
    raise ValueError(f"quantization_config is a {type(qc).__name__} ({qc!r:.60}), not an "
                     "object; config.json names the scheme as {\"quant_method\": ..., ...}")
  method = qc.get("quant_method")
  if method == "gptq":
    _need_bits4(qc.get("bits"), "bits")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    versions = {"gptq": 1, "gptq_v2": 2}
    if fmt not in versions:
      raise ValueError(f"quantization_config checkpoint_format={fmt!r} is not supported; "
                       f"qjax reads {sorted(versions)} (repack Marlin / BitBLAS checkpoints "
                       "to gptq first)")
    if qc.get("is_marlin_format"):
      raise ValueError(f"quantization_config is_marlin_format={qc['is_marlin_format']!r} is "
                       "not supported; qjax reads AutoGPTQ's own packing (repack to gptq "
                       "first)")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
      raise ValueError(f"quantization_config pack_dtype={qc['pack_dtype']!r} is not "
                       "supported; qjax reads qweight / qzeros packed in int32")
    return Quantization(method="gptq", group_size=_group_size(qc.get("group_size"),
                                                              "group_size"),
                        symmetric=bool(qc.get("sym", True)),
                        desc_act=bool(qc.get("desc_act", False)),
                        zero_point_version=versions[fmt],
                        dynamic=_gptq_dynamic(qc.get("dynamic")))
  if method == "awq":
    _need_bits4(qc.get("bits", qc.get("w_bit")), "bits")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
      raise ValueError(f"quantization_config version={qc.get('version')!r} is not "
                       "supported; qjax reads AutoAWQ 'gemm' checkpoints")
    if qc.get("zero_point") is False:
      raise ValueError("quantization_config zero_point=false is not supported; qjax reads "
                       "AWQ checkpoints with zero points")
    g = qc.get("group_size", qc.get("q_group_size"))
    return Quantization(method="awq", group_size=_group_size(g, "group_size"))
  if method == "compressed-tensors":
    return _parse_compressed_tensors(qc)
  raise ValueError(f"quantization_config quant_method={method!r} is not supported; qjax "
                   f"reads {METHODS} (or no quantization_config for a dense checkpoint)")


def _parse_compressed_tensors(qc: Mapping[str, Any]) -> Quantization:
  groups = qc.get("config_groups") or {}
  if not groups:
    raise ValueError("quantization_config (compressed-tensors) has no config_groups")
  status = qc.get("quantization_status")
  if status not in (None, "compressed"):
    raise ValueError(f"quantization_config quantization_status={status!r} is not supported; "
                     "qjax reads 'compressed' checkpoints (packed weights)")
  sparsity = qc.get("sparsity_config") or {}
  if sparsity and sparsity.get("format", "dense") != "dense":
    raise ValueError(f"quantization_config sparsity_config.format="
                     f"{sparsity.get('format')!r} is not supported; qjax reads dense "
                     "(not sparsity-compressed) weights")
  if qc.get("kv_cache_scheme"):
    warnings.warn("quantization_config kv_cache_scheme is ignored: qjax keeps the KV cache "
                  "in the activation dtype", UserWarning, stacklevel=3)
  schemes = set()
  for name, group in groups.items():
    fmt = group.get("format") or qc.get("format")
    if fmt != "pack-quantized":
      raise ValueError(f"quantization_config config_groups.{name} format={fmt!r} is not "
                       "supported; qjax reads 'pack-quantized'")
    w = group.get("weights") or {}
    _need_bits4(w.get("num_bits"), f"config_groups.{name}.weights.num_bits")
    if w.get("type", "int") != "int":
      raise ValueError(f"quantization_config config_groups.{name}.weights.type="
                       f"{w.get('type')!r} is not supported (int only)")
    if w.get("actorder") in ("group", True):  # compressed-tensors reads True as "group"
      raise ValueError(f"quantization_config config_groups.{name}.weights.actorder="
                       f"{w.get('actorder')!r} (weight_g_idx) is not supported")
    if w.get("dynamic"):
      raise ValueError(f"quantization_config config_groups.{name}.weights.dynamic="
                       f"{w.get('dynamic')!r} is not supported; qjax reads stored weight "
                       "scales")
    for act in ("input_activations", "output_activations"):
      if group.get(act):
        warnings.warn(f"quantization_config config_groups.{name}.{act} is ignored: qjax "
                      "runs weight-only quantization, the activations in their float dtype "
                      "(outputs differ from a run that quantizes them)", UserWarning,
                      stacklevel=3)
    strategy = w.get("strategy", "group")
    if strategy not in ("group", "channel"):
      raise ValueError(f"quantization_config config_groups.{name}.weights.strategy="
                       f"{strategy!r} is not supported ('group' or 'channel')")
    g = -1 if strategy == "channel" else _group_size(
        w.get("group_size"), f"config_groups.{name}.weights.group_size")
    schemes.add((g, bool(w.get("symmetric", True))))
  if len(schemes) != 1:
    raise ValueError(f"quantization_config config_groups differ in (group_size, symmetric) "
                     f"{sorted(schemes)}; qjax reads one weight scheme per checkpoint")
  (g, sym), = schemes
  return Quantization(method="compressed-tensors", group_size=g, symmetric=sym)


# ------------------------------------------------------------------------------ reading


def _safetensors_call(file: pathlib.Path, what: str, fn):
  """``fn()``, with the safetensors library's errors on a bad file as one ValueError."""
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  try:
    return fn()
  except SafetensorError as e:
    raise ValueError(f"{file}: cannot {what}: not a valid safetensors file ({e})") from None
  except (TypeError, KeyError, AttributeError, OverflowError) as e:
    # safetensors' numpy API maps some dtypes (F8_E4M3, ...) to numpy names that do not
    # exist: the file is well formed but holds a dtype numpy cannot represent.
    raise ValueError(f"{file}: cannot {what}: a dtype numpy has no type for, or a "
                     f"malformed entry ({type(e).__name__}: {e})") from None


class Checkpoint:
  """The tensors of a single-file or sharded safetensors checkpoint, read on demand.

  Args:
    path: the checkpoint folder, or one ``.safetensors`` file.
    on_read: optional ``fn(name)`` called after each tensor is read (progress bars);
      also settable as the attribute ``on_read``.
  """

  def __init__(self, path: str | os.PathLike[str], on_read=None):
    path = pathlib.Path(path)
    self.folder = path if path.is_dir() else path.parent
    if path.is_dir():
      index = path / INDEX_FILE
      if index.exists():
        try:
          index_json = json.loads(index.read_text())
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, deep nesting
          raise ValueError(f"{index}: not JSON ({e})") from None
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v and "/" not in v and "\\" not in v
            for v in weight_map.values()):
          raise ValueError(f"{index}: no weight_map object (tensor name -> shard file name "
                           "in this folder)")
        self._where = {name: path / shard for name, shard in weight_map.items()}
      elif (path / SINGLE_FILE).exists():
        self._where = None
        self._single = path / SINGLE_FILE
      else:
        raise ValueError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}; not a safetensors "
                         "checkpoint folder")
    else:
      self._where = None
      self._single = path
    self._handles: dict[pathlib.Path, Any] = {}
    self._keys: dict[pathlib.Path, set[str]] = {}
    self.on_read = on_read
    if self._where is None:
      self._where = {n: self._single for n in self._open(self._single).keys()}
    for shard in sorted(set(self._where.values())):
      if not shard.exists():
        raise ValueError(f"{shard}: shard named by {INDEX_FILE} does not exist")

  def _open(self, file: pathlib.Path):
    if file not in self._handles:
      from safetensors import safe_open  # pylint: disable=g-import-not-at-top
      # The safetensors library bounds the header (100 MB), checks dtypes, shapes and
      # that the byte ranges tile the data section; its errors become one ValueError.
      self._handles[file] = _safetensors_call(file, "open", lambda: safe_open(
          str(file), framework="numpy"))
    return self._handles[file]

  def _file_of(self, name: str) -> pathlib.Path:
    """The file holding ``name``; ValueError when the index names a shard without it."""
    file = self._where[name]
    if file not in self._keys:
      self._keys[file] = set(_safetensors_call(file, "list its tensors",
                                               lambda: self._open(file).keys()))
    if name not in self._keys[file]:
      raise ValueError(
          f"{self.folder / INDEX_FILE}: weight_map puts tensor {name!r} in {file.name}, "
          f"which does not hold it; the index and the shards disagree (an interrupted "
          "download or shards of another revision): re-download the checkpoint")
    return file

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> list[str]:
    return list(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    """The stored shape, without reading the data."""
    file = self._file_of(name)
    return tuple(_safetensors_call(file, f"read the shape of {name!r}",
                                   lambda: self._open(file).get_slice(name).get_shape()))

  def get(self, name: str) -> np.ndarray:
    """The stored array; ValueError naming ``name`` when it is missing."""
    if name not in self._where:
      raise ValueError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
    file = self._file_of(name)
    a = _safetensors_call(file, f"read tensor {name!r}",
                          lambda: self._open(file).get_tensor(name))
    if self.on_read is not None:
      self.on_read(name)
    return a


def read_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
  """``config.json`` of a checkpoint folder as a dict; where it has no
  ``quantization_config``, an older AutoGPTQ ``quantize_config.json`` (or AutoAWQ
  ``quant_config.json``) beside it becomes that, its ``quant_method`` gptq (awq) unless it
  names one.

  Raises:
    ValueError: naming the file when it is missing, not JSON or not a JSON object.
  """
  path = pathlib.Path(folder) / CONFIG_FILE
  if not path.exists():
    raise ValueError(f"{path} does not exist; a Hugging Face checkpoint folder holds its "
                     "architecture in config.json")
  try:
    config = json.loads(path.read_text())
  except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, deep nesting
    raise ValueError(f"{path}: not JSON ({e}); re-download or repair the checkpoint's "
                     "config.json") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path}: holds a JSON {type(config).__name__}, not the object of a "
                     "model config; re-download or repair the checkpoint's config.json")
  for name, method in LEGACY_QUANT_FILES.items():
    legacy = pathlib.Path(folder) / name
    if config.get("quantization_config") or not legacy.exists():
      continue
    try:
      qc = json.loads(legacy.read_text())
    except (ValueError, RecursionError) as e:
      raise ValueError(f"{legacy}: not JSON ({e}); re-download or repair it") from None
    if not isinstance(qc, dict):
      raise ValueError(f"{legacy}: holds a JSON {type(qc).__name__}, not the object of a "
                       "quantization config; re-download or repair it")
    config = {**config, "quantization_config": {"quant_method": method, **qc}}
  return config


def _check(name: str, a: np.ndarray, shape: tuple[int, ...], dtypes: Iterable[Any],
           why: str) -> None:
  dts = [np.dtype(d) for d in dtypes]
  if tuple(a.shape) != tuple(shape):
    raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, want {tuple(shape)} "
                     f"({why})")
  if a.dtype not in dts:
    raise ValueError(f"tensor {name!r} has dtype {a.dtype.name}, want one of "
                     f"{[d.name for d in dts]} ({why})")


def quantized_suffixes(q: Quantization | None) -> tuple[str, ...]:
  """The tensor suffixes of a quantized linear whose presence marks it quantized."""
  if q is None:
    return ()
  if q.method == "compressed-tensors":
    return ("weight_packed", "weight_scale")
  return ("qweight", "qzeros", "scales")


def read_linear(ckpt: Checkpoint, prefix: str, k: int, n: int, q: Quantization | None,
                ) -> Any:
  """The weight of linear ``prefix`` of logical shape ``[K, N]`` (``y = x @ W``).

  A linear is quantized when any tensor of ``q``'s layout is stored under ``prefix``
  (modules the producer left dense, e.g. ``lm_head``, are read as dense). GPTQ's
  per-module ``dynamic`` overrides apply (:meth:`Quantization.for_module`).

  Returns:
    A :class:`GPTQWeight` (trivial ``g_idx`` dropped), :class:`AWQWeight`,
    :class:`CompressedTensorsWeight` or :class:`GGUFDense` of numpy arrays, as stored.

  Raises:
    ValueError: naming the tensor that is missing or has the wrong shape or dtype, or
      whose K the group size does not divide; GPTQ act-order (desc_act) without g_idx;
      compressed-tensors zero points that are not zero under symmetric=true.
  """
  if q is not None:
    q = q.for_module(prefix)  # GPTQModel's per-module overrides
  quantized = any(f"{prefix}.{s}" in ckpt for s in quantized_suffixes(q))
  if not quantized:
    name = f"{prefix}.weight"
    if name not in ckpt:
      alt = (f" or {prefix}.{quantized_suffixes(q)[0]} ({q.method})" if q else "")
      raise ValueError(f"{ckpt.folder}: tensor {name!r}{alt} is missing from the checkpoint")
    w = ckpt.get(name)
    _check(name, w, (n, k), DENSE_DTYPES, f"dense [N, K] with K={k}, N={n} from config.json")
    return gguf_formats.GGUFDense(data=w, shape=(k, n))
  g = q.group_size_for(k)
  if k % g:
    raise ValueError(f"tensor {prefix}.*: group_size={g} from quantization_config does not "
                     f"divide K={k}; the checkpoint does not fit its config")
  if k % 8:
    raise ValueError(f"tensor {prefix}.*: K={k} must be a multiple of 8 (int4 packs 8 "
                     "values of K per int32)")
  if n % 8 and q.method in ("gptq", "awq"):
    raise ValueError(f"tensor {prefix}.*: N={n} must be a multiple of 8 ({q.method} packs "
                     "8 columns per int32 of qzeros)")
  why = f"{q.method} with K={k}, N={n}, group_size={g}"
  get = lambda s: ckpt.get(f"{prefix}.{s}")
  if q.method == "gptq":
    qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
    _check(f"{prefix}.qweight", qweight, (k // 8, n), (np.int32,), why)
    _check(f"{prefix}.qzeros", qzeros, (k // g, n // 8), (np.int32,), why)
    _check(f"{prefix}.scales", scales, (k // g, n), SCALE_DTYPES, why)
    g_idx = None
    if q.desc_act and f"{prefix}.g_idx" not in ckpt:
      raise ValueError(f"tensor {prefix}.g_idx is missing, but quantization_config has "
                       "desc_act=true (act-order: each row's group is in g_idx); the "
                       "checkpoint does not fit its config")
    if f"{prefix}.g_idx" in ckpt:
      gi = get("g_idx")
      _check(f"{prefix}.g_idx", gi, (k,), (np.int32, np.int64), why)
      if gi.size and (gi.min() < 0 or gi.max() >= k // g):
        raise ValueError(f"tensor {prefix}.g_idx holds groups outside [0, {k // g}) ({why})")
      if not np.array_equal(gi, np.arange(k) // g):
        g_idx = gi.astype(np.int32)
    return layouts.GPTQWeight(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx,
                              shape=(k, n), group_size=g,
                              zero_point_version=q.zero_point_version,
                              symmetric=q.symmetric)
  if q.method == "awq":
    qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
    _check(f"{prefix}.qweight", qweight, (k, n // 8), (np.int32,), why)
    _check(f"{prefix}.qzeros", qzeros, (k // g, n // 8), (np.int32,), why)
    _check(f"{prefix}.scales", scales, (k // g, n), SCALE_DTYPES, why)
    return layouts.AWQWeight(qweight=qweight, qzeros=qzeros, scales=scales, shape=(k, n),
                             group_size=g)
  # compressed-tensors pack-quantized
  packed, scale = get("weight_packed"), get("weight_scale")
  _check(f"{prefix}.weight_packed", packed, (n, k // 8), (np.int32,), why)
  _check(f"{prefix}.weight_scale", scale, (n, k // g), SCALE_DTYPES, why)
  if f"{prefix}.weight_shape" in ckpt:
    ws = get("weight_shape")
    if tuple(int(d) for d in np.ravel(ws)) != (n, k):
      raise ValueError(f"tensor {prefix}.weight_shape holds {np.ravel(ws).tolist()}, want "
                       f"[{n}, {k}] ({why})")
  zp = None
  name = f"{prefix}.weight_zero_point"
  if not q.symmetric:
    zp = _ct_zero_points(name, get("weight_zero_point"), n, k // g, why)
  elif name in ckpt:  # compressed-tensors leaves symmetric ones out: they must be zero
    stored = _ct_zero_points(name, get("weight_zero_point"), n, k // g, why)
    if stored.any():
      raise ValueError(f"tensor {name!r} holds non-zero zero points (e.g. "
                       f"{int(stored[np.nonzero(stored)][0])}), but quantization_config "
                       "says symmetric=true; the checkpoint does not fit its config")
  if f"{prefix}.weight_g_idx" in ckpt:
    raise ValueError(f"tensor {prefix}.weight_g_idx: compressed-tensors act-order groups "
                     "are not supported")
  return layouts.CompressedTensorsWeight(weight_packed=packed, weight_scale=scale,
                                         weight_zero_point=zp, weight_shape=(n, k),
                                         group_size=g)


def _ct_zero_points(name: str, stored: np.ndarray, n: int, groups: int, why: str
                    ) -> np.ndarray:
  """compressed-tensors' stored zero points as int8 ``[N, K // G]`` in [-8, 7]: packed
  along N (int32 ``[ceil(N / 8), K // G]``, nibble ``z + 8``), or (before its zero-point
  packing, PR #296, April 2025) the int8 ``[N, K // G]`` parameter as is."""
  if stored.dtype == np.int8 and tuple(stored.shape) == (n, groups):
    if stored.min() < -8 or stored.max() > 7:
      raise ValueError(f"tensor {name!r} holds zero points in [{int(stored.min())}, "
                       f"{int(stored.max())}], outside signed int4 [-8, 7] ({why})")
    return stored
  _check(name, stored, (-(-n // 8), groups), (np.int32,),
         why + f"; packed along N, or int8 ({n}, {groups}) unpacked")
  return (unpack_nibbles(stored.T)[:, :n].T.astype(np.int16) - 8).astype(np.int8)


# --------------------------------------------------------------------- nibble packing


def unpack_nibbles(words: np.ndarray) -> np.ndarray:
  """``[R, W]`` int32 -> ``[R, 8W]`` uint8: value ``8c + i`` from nibble ``i`` of word c."""
  w = np.ascontiguousarray(words).view(np.uint32)
  return ((w[..., None] >> _SHIFTS) & 0xF).astype(np.uint8).reshape(*w.shape[:-1], -1)


def pack_nibbles(values: np.ndarray) -> np.ndarray:
  """Inverse of :func:`unpack_nibbles`: ``[R, 8W]`` in ``[0, 15]`` -> ``[R, W]`` int32."""
  r, c = values.shape
  v = values.astype(np.uint32).reshape(r, c // 8, 8) << _SHIFTS
  return np.bitwise_or.reduce(v, axis=-1).astype(np.uint32).view(np.int32)


_AWQ_ORDER = np.asarray(layouts.AWQ_ORDER)
_AWQ_REVERSE = np.asarray(layouts.AWQ_REVERSE_ORDER)


def _unpack_awq(words: np.ndarray) -> np.ndarray:
  r, nw = words.shape
  return unpack_nibbles(words).reshape(r, nw, 8)[..., _AWQ_REVERSE].reshape(r, nw * 8)


def _pack_awq(values: np.ndarray) -> np.ndarray:
  r, n = values.shape
  return pack_nibbles(values.reshape(r, n // 8, 8)[..., _AWQ_ORDER].reshape(r, n))


# ---------------------------------------------------------------- output permutation


def permute_output(w: Any, perm: np.ndarray) -> Any:
  """The weight ``W[:, perm]`` (output columns reordered), exactly, in w's own layout.

  Works on the stored integers: GPTQ ``qweight`` / ``scales`` columns and
  compressed-tensors rows are gathered as they are; packed-along-N words (GPTQ
  ``qzeros``, AWQ ``qweight`` / ``qzeros``) are unpacked to 4-bit codes, gathered and
  repacked. Numpy arrays in, numpy arrays out.

  Args:
    w: GGUFDense, GPTQWeight, AWQWeight or CompressedTensorsWeight of shape ``[K, N]``.
    perm: ``[N]`` int, a permutation of ``range(N)``.
  """
  perm = np.asarray(perm)
  a = np.asarray
  if isinstance(w, gguf_formats.GGUFDense):
    return dataclasses.replace(w, data=a(w.data)[perm])
  if isinstance(w, layouts.GPTQWeight):
    qzeros = pack_nibbles(unpack_nibbles(a(w.qzeros))[:, perm])
    return dataclasses.replace(w, qweight=a(w.qweight)[:, perm], qzeros=qzeros,
                               scales=a(w.scales)[:, perm])
  if isinstance(w, layouts.AWQWeight):
    return dataclasses.replace(w, qweight=_pack_awq(_unpack_awq(a(w.qweight))[:, perm]),
                               qzeros=_pack_awq(_unpack_awq(a(w.qzeros))[:, perm]),
                               scales=a(w.scales)[:, perm])
  if isinstance(w, layouts.CompressedTensorsWeight):
    zp = w.weight_zero_point
    if zp is not None and w.zero_point_packed:  # to int8 [N, K // G] zp, then gather
      zp = (a(w.unpack()[2]).T.astype(np.int16) - 8).astype(np.int8)
    zp = None if zp is None else a(zp)[perm]
    return dataclasses.replace(w, weight_packed=a(w.weight_packed)[perm],
                               weight_scale=a(w.weight_scale)[perm], weight_zero_point=zp)
  raise TypeError(f"permute_output: unsupported weight type {type(w).__name__}")


# ------------------------------------------------------------------------------ writing


@dataclasses.dataclass(frozen=True)
class Int4Parts:
  """A 4-bit weight of shape ``[K, N]`` as plain numpy parts, layout-independent.

  ``W[k, n] = (codes[k, n] - zeros[g, n]) * scales[g, n]``, ``g = g_idx[k]`` (``k // G``
  when None), ``zeros = 8`` when None.

  Attributes:
    codes: ``[K, N]`` uint8 in ``[0, 15]``.
    scales: ``[K // G, N]`` float.
    zeros: ``[K // G, N]`` uint8 effective zero points, or None (symmetric).
    g_idx: ``[K]`` int32, or None.
    group_size: G.
  """
  codes: np.ndarray
  scales: np.ndarray
  zeros: np.ndarray | None
  g_idx: np.ndarray | None
  group_size: int

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.codes.shape)

  @classmethod
  def of(cls, w: Any, name: str) -> "Int4Parts":
    """The parts of an Int4Weight or a GPTQ / AWQ / compressed-tensors weight (or of a
    weight whose ``to_int4()`` gives an Int4Weight, e.g. GGUF Q4_0)."""
    if isinstance(w, (layouts.GPTQWeight, layouts.AWQWeight,
                      layouts.CompressedTensorsWeight)):
      codes, scales, zeros, g_idx = (None if v is None else np.asarray(v) for v in w.unpack())
      if zeros is not None and getattr(w, "symmetric", False) and (zeros == 8).all():
        zeros = None
      return cls(codes, scales, zeros, g_idx, w.group_size)
    if not isinstance(w, int4.Int4Weight) and hasattr(w, "to_int4"):
      w = w.to_int4()
    if not isinstance(w, int4.Int4Weight):
      raise ValueError(f"{name}: a {type(w).__name__} cannot be stored as INT4 with integer "
                       "zero points; quantize it with qjax.quantize (or load it as "
                       "Int4Weight) first")
    if w.biases is not None:
      raise ValueError(f"{name}: Int4Weight with float biases (W = q * s + b, e.g. GGUF "
                       "Q4_1) has no integer zero point; requantize it with qjax.quantize "
                       "(symmetric=False) to export it")
    return cls(np.asarray(w.unpacked_codes()), np.asarray(w.scales),
               None if w.zeros is None else np.asarray(w.zeros), None, w.group_size)

  def permute_output(self, perm: np.ndarray) -> "Int4Parts":
    """``W[:, perm]``."""
    return dataclasses.replace(
        self, codes=self.codes[:, perm], scales=self.scales[:, perm],
        zeros=None if self.zeros is None else self.zeros[:, perm])


def gptq_tensors(p: Int4Parts, prefix: str, zero_point_version: int) -> dict[str, np.ndarray]:
  """``{prefix.qweight, .qzeros, .scales, .g_idx}`` as AutoGPTQ / GPTQModel write them."""
  k, n = p.shape
  g = p.group_size
  z = np.full((k // g, n), 8, np.int16) if p.zeros is None else p.zeros.astype(np.int16)
  lo, hi = (1, 16) if zero_point_version == 1 else (0, 15)
  if z.min() < lo or z.max() > hi:
    raise ValueError(f"{prefix}: zero points in [{int(z.min())}, {int(z.max())}] do not fit "
                     f"GPTQ checkpoint_format {'gptq' if zero_point_version == 1 else 'gptq_v2'}"
                     f" ([{lo}, {hi}]); export with zero_point_version="
                     f"{2 if zero_point_version == 1 else 1}")
  if zero_point_version == 1:
    z = z - 1
  g_idx = np.arange(k, dtype=np.int32) // g if p.g_idx is None else p.g_idx
  return {f"{prefix}.qweight": pack_nibbles(p.codes.T).T.copy(),
          f"{prefix}.qzeros": pack_nibbles(z.astype(np.uint8)),
          f"{prefix}.scales": np.ascontiguousarray(p.scales),
          f"{prefix}.g_idx": np.ascontiguousarray(g_idx, np.int32)}


def compressed_tensors_tensors(p: Int4Parts, prefix: str, symmetric: bool
                               ) -> dict[str, np.ndarray]:
  """``{prefix.weight_packed, .weight_scale, .weight_shape[, .weight_zero_point]}`` as
  compressed-tensors' pack-quantized compressor writes them (zero points packed along N
  only when ``symmetric`` is False; a symmetric weight then gets zero points 0)."""
  k, n = p.shape
  if p.g_idx is not None and not np.array_equal(p.g_idx, np.arange(k) // p.group_size):
    raise ValueError(f"{prefix}: act-order g_idx cannot be stored as compressed-tensors "
                     "pack-quantized; export it as GPTQ")
  out = {f"{prefix}.weight_packed": pack_nibbles(np.ascontiguousarray(p.codes.T)),
         f"{prefix}.weight_scale": np.ascontiguousarray(p.scales.T),
         f"{prefix}.weight_shape": np.asarray([n, k], np.int64)}
  if symmetric:
    if p.zeros is not None:
      raise ValueError(f"{prefix}: asymmetric weight in a symmetric export")
    return out
  z = np.full((k // p.group_size, n), 8, np.uint8) if p.zeros is None else p.zeros
  if z.max() > 15:
    raise ValueError(f"{prefix}: zero point {int(z.max())} does not fit signed int4")
  zt = z.T  # [N, K // G], stored value zp + 8 = z
  pad = -n % 8
  zt = np.concatenate([zt, np.zeros((pad, zt.shape[1]), np.uint8)]) if pad else zt
  out[f"{prefix}.weight_zero_point"] = pack_nibbles(np.ascontiguousarray(zt.T)).T.copy()
  return out


def dense_array(w: Any, dtype: Any) -> np.ndarray:
  """A weight of shape ``[K, N]`` as the torch ``[N, K]`` matrix: GGUFDense as stored,
  any other quantized weight dequantized and cast to ``dtype``."""
  if isinstance(w, gguf_formats.GGUFDense):
    return np.asarray(w.data)
  if isinstance(w, formats.QuantizedWeight):
    return np.ascontiguousarray(np.asarray(w.dequantize()).T.astype(dtype))
  return np.asarray(w)


def write_checkpoint(folder: str | os.PathLike[str], tensors: Mapping[str, np.ndarray],
                     config: Mapping[str, Any], *, max_shard_bytes: int | None = None
                     ) -> list[str]:
  """Writes ``config.json`` and the tensors as ``model.safetensors`` or, when they exceed
  ``max_shard_bytes``, as ``model-0000i-of-0000n.safetensors`` shards with
  ``model.safetensors.index.json``. Each file is written to a temporary name and renamed.
  What an earlier save into ``folder`` left of the other form is then removed (the index
  and shards after a single-file save, ``model.safetensors`` and shards of another count
  after a sharded one), as ``transformers``' ``save_pretrained`` does: readers would
  otherwise load the earlier weights (qjax and others prefer the index, ``transformers``
  the single file).

  Returns:
    The safetensors file names written.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, a in tensors.items():
    if max_shard_bytes is not None and shards[-1] and size + a.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = np.ascontiguousarray(a)
    size += a.nbytes
  files = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

  def atomic(path: pathlib.Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
      write(tmp)
      os.replace(tmp, path)
    except BaseException:
      if os.path.exists(tmp):
        os.unlink(tmp)
      raise

  for file, shard in zip(files, shards):
    atomic(folder / file, lambda tmp, s=shard: save_file(s, tmp, metadata={"format": "pt"}))
  if len(shards) > 1:
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": {n: f for f, s in zip(files, shards) for n in s}}
    atomic(folder / INDEX_FILE,
           lambda tmp: pathlib.Path(tmp).write_text(json.dumps(index, indent=2)))
  stale = [] if len(shards) > 1 else [folder / INDEX_FILE]  # the index first: it wins
  stale += sorted(f for f in folder.glob("model-*-of-*.safetensors")
                  if _SHARD_NAME.fullmatch(f.name) and f.name not in files)
  stale += [folder / SINGLE_FILE] if len(shards) > 1 else []
  for f in stale:
    if f.is_file():
      f.unlink()
  atomic(folder / CONFIG_FILE,
         lambda tmp: pathlib.Path(tmp).write_text(json.dumps(config, indent=2)))
  return files


def to_device(w: Any) -> Any:
  """The pytree with numpy leaves moved to the default device (as jax arrays)."""
  return jax.tree.map(jnp.asarray, w)
