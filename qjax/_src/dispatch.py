"""The dispatcher: ``qjax.matmul`` and the registry of implementations per format.

qjax defines each format's contract and its XLA implementation. Faster implementations
(Pallas kernels) register themselves from other packages; qjax finds them through the
``qjax.backends`` entry-point group (or by importing ``pallas_kernels`` when it is on the
path but not installed), so qjax never imports them at module level.

Implementation names:
  * ``None``: the best available. A registered kernel whose ``supported_on`` accepts the
    default device is tried first; ``NotImplementedError`` from it (an argument it cannot
    handle) falls through to the XLA path. Always works.
  * ``"xla"``: the pure-JAX reference, on any device.
  * ``"pallas"``: the registered kernel, compiled; raises if it cannot run here.
  * ``"interpret"``: the registered kernel in Pallas interpret mode (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import logging
import math
import threading
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from qjax._src import autodiff
from qjax._src import formats
from qjax._src import stacked

log = logging.getLogger("qjax")

ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
IMPLEMENTATIONS = ("xla", "pallas", "interpret")


class KernelFn(Protocol):

  def __call__(self, x: jax.Array, w: Any, *, interpret: bool, config: Any = None
               ) -> jax.Array:
    ...


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered kernel implementation of ``matmul`` for one format class.

  Attributes:
    name: e.g. "pallas_triton".
    fn: ``fn(x2d [M, K], w, *, interpret) -> [M, N]`` in x's dtype. Raises
      NotImplementedError naming the argument it cannot handle.
    supported_on: whether it compiles for a device (interpret mode runs anywhere).
    candidate_configs: ``(m, k, n) -> [config]``, the tuner's search space (configs the
      ``config=`` argument of ``fn`` takes: a ``KernelConfig`` for the Triton kernels, a
      ``WgmmaConfig`` for the Hopper wgmma kernel).
    auto_max_m: with ``implementation=None``, rows of x above which the XLA path is
      used instead (where the kernel was measured slower than XLA); None: no limit.
    auto_prefers_xla: with ``implementation=None``, ``(m, w) -> True`` for the other
      cases where the XLA path was measured faster than the kernel (x ``[m, K]``, ``w``
      the weight); None: none.
    declines: ``(w, dtype) -> None`` where ``fn`` runs the weight ``w`` (whose arrays may
      be abstract, e.g. ``jax.ShapeDtypeStruct``) for x of ``dtype`` at every M, else the
      reason it would raise NotImplementedError for some M; None: every weight of the
      format runs. Read by :func:`qjax.kernel_layouts`, which converts a weight to this
      format only where the kernel runs it.
    interprets: whether ``fn`` runs in Pallas interpret mode (on any device); False for
      kernels without one (Mosaic GPU's), so errors do not suggest it.
  """
  name: str
  fn: KernelFn
  supported_on: Callable[[jax.Device], bool]
  candidate_configs: Callable[[int, int, int], list[Any]] | None = None
  auto_max_m: int | None = None
  auto_prefers_xla: Callable[[int, Any], bool] | None = None
  declines: Callable[[Any, Any], str | None] | None = None
  interprets: bool = True

  def auto_runs_xla(self, m: int, w: Any, dtype) -> bool:
    """Whether ``implementation=None`` runs the XLA path instead of this kernel for ``m``
    rows of x of ``dtype`` and the weight ``w`` (:func:`runs_xla_for_dtype`,
    :attr:`auto_max_m`, :attr:`auto_prefers_xla`)."""
    if runs_xla_for_dtype(dtype):
      return True
    if self.auto_max_m is not None and m > self.auto_max_m:
      return True
    return self.auto_prefers_xla is not None and bool(self.auto_prefers_xla(m, w))


_XLA: dict[type, Callable[[jax.Array, Any], jax.Array]] = {}
_KERNELS: dict[type, list[Backend]] = {}
_REPACKS: dict[type, tuple[type, Callable[[jax.Array, Any], tuple[jax.Array, Any]]]] = {}
_plugins_loaded = False
_plugins_lock = threading.Lock()


def register_xla(format_cls: type, fn: Callable[[jax.Array, Any], jax.Array]) -> None:
  """Registers the XLA (reference) implementation of :func:`matmul` for a format.

  Args:
    format_cls: the weight's class (a :func:`~qjax.register_format` class); an exact
      class match, not its subclasses.
    fn: ``fn(x2d [M, K], w) -> [M, N]`` in x2d's dtype, float32 accumulation, traceable
      under ``jax.jit``; run by ``implementation="xla"`` and wherever no kernel is
      chosen, and the backward pass of every implementation (:mod:`qjax._src.autodiff`).
      A later registration replaces the earlier one.

  Returns:
    None. Registering invalidates cached traces that chose an implementation
    (:func:`qjax.retraced_on_registration`).
  """
  _XLA[format_cls] = fn
  autodiff.registry_changed()


def register_kernel(format_cls: type, backend: Backend) -> None:
  """Registers a kernel implementation of :func:`matmul` for a format.

  The first backend registered for ``format_cls`` is the one "pallas" / "interpret"
  run; ``implementation=None`` runs the first whose ``supported_on`` accepts the device,
  unless :meth:`Backend.auto_runs_xla` picks XLA. A later registration of a name
  replaces that backend in its place (the order is kept), otherwise it is appended.

  Args:
    format_cls: the weight's class (an exact class match).
    backend: a :class:`Backend`; ``backend.fn(x2d [M, K], w, *, interpret, config=None)
      -> [M, N]``.

  Returns:
    None. Registering invalidates cached traces that chose an implementation.
  """
  _KERNELS[format_cls] = replaced_in_place(_KERNELS.get(format_cls, []), backend)
  autodiff.registry_changed()


def replaced_in_place(backends: list[Backend], backend: Backend) -> list[Backend]:
  """``backends`` with the one named ``backend.name`` replaced where it stands, or with
  ``backend`` appended."""
  names = [b.name for b in backends]
  if backend.name in names:
    return [backend if b.name == backend.name else b for b in backends]
  return [*backends, backend]


def register_repack(format_cls: type, target_cls: type,
                    repack: Callable[[jax.Array, Any], tuple[jax.Array, Any]]) -> None:
  """Routes a format without kernels of its own to the kernels of ``target_cls``.

  ``repack(x2d [M, K], w) -> (x2d', w')`` converts the weight losslessly to
  ``target_cls`` inside the traced call (and permutes x's columns where the conversion
  permutes K, e.g. GPTQ act-order), so that ``kernel(x2d', w') == x2d @ W``. The repack
  runs on every call: convert once at load (``w.to_int4()``) where speed matters.
  Kernels registered directly for ``format_cls`` take precedence.
  """
  _REPACKS[format_cls] = (target_cls, repack)
  autodiff.registry_changed()


def _via_repack(backend: Backend, repack: Callable[..., tuple[jax.Array, Any]]) -> Backend:
  def fn(x2, w, *, interpret, config=None):
    x2, w = repack(x2, w)
    return backend.fn(x2, w, interpret=interpret, config=config)
  # auto_prefers_xla compares the kernel with the target format's XLA path, not this one's;
  # declines reads the target format's weights, not this one's.
  return dataclasses.replace(backend, fn=fn, auto_prefers_xla=None, declines=None)


def load_plugins() -> None:
  """Imports the kernel packages that register backends (once)."""
  global _plugins_loaded
  if _plugins_loaded:
    return
  with _plugins_lock:
    if _plugins_loaded:
      return
    modules = {ep.value for ep in importlib.metadata.entry_points(group="qjax.backends")}
    modules.add("pallas_kernels")  # also found when run from a source tree
    for module in sorted(modules):
      try:
        importlib.import_module(module)
      except ImportError as e:
        log.debug("qjax backend %s not available: %s", module, e)
    _plugins_loaded = True


def not_inherited(fmt: type, registry: Any, register: str) -> str:
  """The end of a "nothing registered for ``fmt``" message: when a base class of ``fmt``
  has an entry in ``registry``, a note that registrations are per class (a subclass may
  change the layout its base's kernels read) and which call registers ``fmt`` itself."""
  base = next((c for c in fmt.__mro__[1:] if c in registry), None)
  if base is None:
    return ""
  return (f" ({base.__name__}, a base class, has one, but registrations are per class "
          f"and are not inherited: call qjax.{register}({fmt.__name__}, ...) for it)")


def kernels_for_format(format_cls: type) -> list[Backend]:
  """The kernels registered for a format class (plugins loaded first)."""
  load_plugins()
  direct = _KERNELS.get(format_cls, [])
  if direct or format_cls not in _REPACKS:
    return list(direct)
  target_cls, repack = _REPACKS[format_cls]
  return [_via_repack(b, repack) for b in kernels_for_format(target_cls)]


def explicit_kernel(backends: list[Any], implementation: str, what: str, missing: str
                    ) -> tuple[str, Any, bool]:
  """For ``implementation`` "pallas" or "interpret": ``(name, backend, interpret)`` of the
  first of ``backends`` (any registry's entries with ``name`` and ``supported_on``).

  Raises:
    NotImplementedError: ``missing`` where none is registered; where the compiled kernel
      does not run on the default device, a message naming ``what`` (e.g. "MoE kernel")
      and that device.
  """
  if not backends:
    raise NotImplementedError(missing)
  backend = backends[0]
  interpret = implementation == "interpret"
  if not interpret and not backend.supported_on(default_device()):
    instead = ("implementation='interpret' or 'xla'" if getattr(backend, "interprets", True)
               else "implementation='xla' (it has no interpret mode)")
    raise NotImplementedError(
        f"the {backend.name} {what} does not run on {default_device().device_kind!r}; use "
        f"{instead}")
  return f"{backend.name}{'-interpret' if interpret else ''}", backend, interpret


def kernels_for(w: Any) -> list[Backend]:
  return kernels_for_format(type(w))


def default_device() -> jax.Device:
  return jax.devices()[0]


def _check_args(x: jax.Array, w: Any) -> None:
  if not isinstance(w, formats.QuantizedWeight):
    raise TypeError(f"w must be a quantized weight pytree, got {type(w).__name__}")
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in ACTIVATION_DTYPES]:
    raise ValueError(
        f"x.dtype={jnp.dtype(x.dtype).name} is not supported; cast x to bfloat16, float16 "
        "or float32")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(
        f"x.shape={tuple(x.shape)}: the last dim must equal K={w.shape[0]} of the weight "
        f"of shape {w.shape}")
  got = _dequantized_shape(*jax.tree_util.tree_flatten(w)[::-1])
  if got is not None and got != tuple(w.shape):
    raise ValueError(
        f"{type(w).__name__} of shape {tuple(w.shape)} holds arrays that dequantize to "
        f"{got}: a stack of weights (e.g. layers stacked by nn.scan, or experts)? "
        "qjax.matmul takes one weight: pass qjax.layer_of(stack, i) for layer i, or use "
        "qjax.moe_matmul for experts")


@functools.lru_cache(maxsize=512)
def _abstract_dequantized_shape(treedef: Any, avals: tuple) -> tuple[int, ...] | None:
  """:func:`_dequantized_shape` of a weight's structure and leaf shapes / dtypes."""
  dequantize = lambda w_: w_.dequantize()
  try:
    w = jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(*a) for a in avals])
  except Exception:  # pylint: disable=broad-except  (its own error shows when it runs)
    return None
  # Whole, then one weight per index of the arrays' leading axis (a stack of a format
  # whose dequantize takes one weight only).
  for fn in (dequantize, jax.vmap(dequantize)):
    try:
      return tuple(jax.eval_shape(fn, w).shape)
    except Exception:  # pylint: disable=broad-except  (its own error shows when it runs)
      continue
  return None


def _dequantized_shape(treedef: Any, leaves: list) -> tuple[int, ...] | None:
  """The shape ``w.dequantize()`` returns for the weight of ``treedef`` and ``leaves``
  (traced once per structure, leaf shapes and dtypes), or None where that fails here; a
  weight of stacked arrays gives ``[L, K, N]`` (dequantized whole, or one layer at a
  time where the format's dequantize takes one weight only)."""
  try:
    avals = tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in leaves)
    return _abstract_dequantized_shape(treedef, avals)
  except (AttributeError, TypeError):  # leaves without shapes, an unhashable structure
    return None


def resolve(w: Any, implementation: str | None) -> tuple[str, Callable[..., jax.Array]]:
  """Picks the implementation; returns its name and ``fn(x2d, w) -> y2d``."""
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(f"{implementation=} must be None or one of {IMPLEMENTATIONS}")
  fmt = type(w)
  if implementation == "xla" or (implementation is None and not kernels_for(w)):
    return "xla", _xla_fn(fmt)
  if implementation in ("pallas", "interpret"):
    name, backend, interpret = explicit_kernel(
        kernels_for(w), implementation, f"kernel for {fmt.__name__}",
        f"no Pallas kernel is registered for {fmt.__name__}"
        f"{not_inherited(fmt, _KERNELS, 'register_kernel')}; use implementation='xla' "
        "(is the pallas_kernels package installed?)")
    return name, lambda x2, w_: backend.fn(x2, w_, interpret=interpret)
  # Auto: first kernel that supports this device, else XLA.
  for backend in kernels_for(w):
    if backend.supported_on(default_device()):
      xla = _xla_fn(fmt)

      def auto(x2, w_, backend=backend, xla=xla):
        if backend.auto_runs_xla(x2.shape[0], w_, x2.dtype):
          return xla(x2, w_)
        try:
          return backend.fn(x2, w_, interpret=False)
        except NotImplementedError as e:
          log.info("%s fell back to XLA: %s", backend.name, e)
          return xla(x2, w_)

      return backend.name, auto
  return "xla", _xla_fn(fmt)


def _xla_fn(fmt: type) -> Callable[[jax.Array, Any], jax.Array]:
  """The registered XLA path of ``fmt``, differentiable in the weight as ``x @
  w.dequantize()`` (:func:`qjax._src.autodiff.weight_derivative_from_dequantize`)."""
  try:
    fn = _XLA[fmt]
  except KeyError:
    raise NotImplementedError(f"no XLA implementation is registered for {fmt.__name__}"
                              f"{not_inherited(fmt, _XLA, 'register_xla')}") from None
  return autodiff.weight_derivative_from_dequantize(fn)


def matmul(x: jax.Array, w: Any, *, implementation: str | None = None) -> jax.Array:
  """``y = x @ W`` for a quantized weight ``W`` of logical shape ``[K, N]``.

  Args:
    x: ``[..., K]`` in bfloat16, float16 or float32.
    w: any quantized-weight pytree of logical shape ``[K, N]``.
    implementation: None (best available: a registered kernel where it was measured
      faster and x is 16-bit, else XLA), "xla", "pallas" or "interpret".

  Returns:
    ``[..., N]`` in x's dtype, accumulated in float32.

  Raises:
    TypeError: ``w`` is no quantized weight (e.g. a plain array).
    ValueError: x's last dim is not K, x's dtype is not one of the three above,
      ``implementation`` is not one of these names, or ``w`` holds a stack of weights
      (use :func:`qjax.layer_of`).
    NotImplementedError: "pallas" or "interpret" where no kernel for ``w``'s format is
      registered or runs on this device.

  >>> import jax, jax.numpy as jnp, qjax
  >>> w = qjax.quantize(jax.random.normal(jax.random.key(0), (256, 128)))
  >>> x = jnp.ones((2, 256), jnp.bfloat16)
  >>> qjax.matmul(x, w, implementation="xla").shape
  (2, 128)

  ``w`` may also be a :class:`qjax.ShardedWeight`: inside ``shard_map`` this multiplies by
  the device's slice of W (row-parallel: ``x`` holds this device's slice of K and the
  partial products are summed over the mesh axis in float32); outside it, by the whole W,
  with the whole x (as :func:`qjax.sharded_matmul` takes it). Or a :class:`qjax.LayerOf`
  (:func:`qjax.layer_of`): one layer of a stacked weight, which the kernels read in place
  instead of from a copy (for layers run by ``lax.scan``).

  No value of ``w`` is checked (that would need a device sync): a NaN or Inf scale, zero
  point or E8M0 scale byte 255 gives NaN (or Inf) in every output row of the columns
  its group or block covers, and NaN in x spreads along its row. The quantizers
  (:func:`qjax.quantize`, :func:`qjax.quantize_mxfp4`, :func:`qjax.quantize_nvfp4`)
  refuse non-finite concrete weights; weights built from their arrays directly or loaded
  from a file are taken as they are.

  Differentiable in reverse mode (``jax.grad``, ``jax.vjp``) with respect to x and to the
  weight's float arrays on every implementation. Where a kernel runs, the backward pass
  is the XLA path's (:mod:`qjax._src.autodiff`); forward mode (``jax.jvp``) needs
  ``implementation="xla"`` there.
  """
  if not autodiff.inside_kernel_call() and _runs_a_kernel(x, w, implementation):
    return _kernel_matmul(x, w, implementation=implementation)
  sharded = sharded_weight_class()
  if isinstance(w, sharded):
    return w.matmul(x, implementation=implementation)
  if isinstance(w, stacked.LayerOf):
    with stacked.reads_in_place(w) as layer:
      return matmul(x, layer, implementation=implementation)
  _check_args(x, w)
  _, fn = resolve(w, implementation)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  y = sharding_module().under_explicit_axes(fn, x2, w)(x2, w)
  return y.reshape(*lead, w.shape[1])


def sharding_module():
  """:mod:`qjax._src.sharding` (imported on demand: it imports this module)."""
  from qjax._src import sharding  # pylint: disable=g-import-not-at-top
  return sharding


@autodiff.retraced_on_registration
@functools.partial(jax.jit, static_argnames=("implementation",))
def _kernel_matmul(x: jax.Array, w: Any, *, implementation: str | None) -> jax.Array:
  """``matmul`` through a kernel, its backward pass the XLA path's. Under ``jax.jit`` so
  that dead-code elimination drops the whole call when its output is unused (flax's
  ``nn.scan`` checks its loop-invariant part that way; tests/test_kernel_dead_code.py),
  which it does not for a bare ``custom_vjp`` call. Traced again after a registration
  (:func:`autodiff.retraced_on_registration`)."""
  return autodiff.kernel_call(
      lambda x_, w_: matmul(x_, w_, implementation=implementation),
      lambda x_, w_: matmul(x_, w_, implementation="xla"), x, w)


def _runs_a_kernel(x: Any, w: Any, implementation: str | None) -> bool:
  """Whether ``matmul(x, w, implementation=implementation)`` would run a kernel rather
  than the XLA path. Arguments it cannot judge count as XLA: the call itself then
  raises its error."""
  if implementation == "xla" or jnp.ndim(x) < 1:
    return False
  if sharding_module().explicit_axes_decline_kernels(x, w, implementation):
    return False
  base = resolvable_weight(w)
  if not isinstance(base, formats.QuantizedWeight):
    return False
  return autodiff.picks_a_kernel(lambda: implementation_name(
      w, implementation, m=math.prod(jnp.shape(x)[:-1]), dtype=jnp.result_type(x)))


def resolvable_weight(w: Any) -> Any:
  """The weight whose format and static fields pick an implementation for ``w``: a
  :class:`qjax.LayerOf`'s stack (its static fields are one layer's; only they are read),
  then a :class:`qjax.ShardedWeight`'s weight (the local one inside shard_map)."""
  if isinstance(w, stacked.LayerOf):
    w = w.stack
  if isinstance(w, sharded_weight_class()):
    w = w.as_weight()
  return w


def sharded_weight_class() -> type:
  """:class:`qjax.ShardedWeight` (its module imports this one, see :func:`sharding_module`)."""
  return sharding_module().ShardedWeight


def runs_xla_for_dtype(dtype) -> bool:
  """Whether ``implementation=None`` runs the XLA path for x of this dtype whatever the
  kernels: float32. The compiled kernels' dots round float32 operands to TF32 on NVIDIA
  GPUs (relative error about 3e-4 on the H100), where the XLA path computes float32 at
  ``Precision.HIGHEST`` (about 1e-7); ``implementation="pallas"`` still runs them."""
  return jnp.dtype(dtype) == jnp.dtype(jnp.float32)


def implementation_name(w: Any, implementation: str | None = None, *, m: int = 1,
                        dtype=jnp.bfloat16) -> str:
  """The name of the implementation ``matmul`` would run for ``w`` and ``m`` rows of x of
  ``dtype`` on this machine."""
  w = resolvable_weight(w)
  name, _ = resolve(w, implementation)
  if implementation is None and name != "xla":
    backend = next(b for b in kernels_for(w) if b.name == name)
    if backend.auto_runs_xla(m, w, dtype):
      return "xla"
  return name
