"""Reverse-mode derivatives for calls that run a Pallas kernel.

A Pallas kernel has no differentiation rule: ``jax.grad`` through a call that runs one
failed inside Pallas with a bare ``AssertionError`` (interpret mode) or a lowering error.
Every format's XLA path computes the same contract in plain JAX, which JAX
differentiates. :func:`kernel_call` runs the kernel forward and takes the backward pass
from the XLA path: ``jax.vjp`` of the XLA call at the same arguments. So a gradient
through a kernel (with respect to x, or to a weight's float arrays such as its group
scales) is exactly the XLA path's gradient, and the kernel's output stays what it was.

What is saved for the backward pass is the call's arguments: x and the quantized weight,
no dequantized copy. The backward pass dequantizes as the XLA path does (for more than
one row of x, a ``[K, N]`` copy of W in x's dtype while it runs).

Forward mode (``jax.jvp``, ``jax.jacfwd``) is not defined for such a call, since it is a
``jax.custom_vjp``; JAX says so when asked. ``implementation="xla"`` runs the XLA path
itself, which takes both modes.

The XLA paths compute some weights' dequantization with bit operations (two 16-bit
columns per 32-bit word, :func:`qjax._src.formats.column_pairs`; E2M1 from float32 bits),
through which JAX's derivative with respect to the weight's float arrays is zero or
garbage. :func:`weight_derivative_from_dequantize` gives a format's XLA path the
derivative of ``x @ w.dequantize()`` in the weight instead; its derivative in x stays
JAX's own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

_state = threading.local()
_RETRACED: list[Any] = []


def retraced_on_registration(jitted: Any) -> Any:
  """Decorator for a module-level ``jax.jit`` function whose trace runs the dispatcher.

  jit keeps a trace, and with it the implementation the registries named when it was
  made: a ``qjax.register_*`` call after the first call would not reach it. Every
  registration (:func:`registry_changed`) clears the cache of each function marked here,
  so its next call traces again. qjax marks its own (``dispatch._kernel_matmul``,
  ``moe._kernel_moe_matmul``, the sharded calls, ``flax_layers``' ``prefill`` /
  ``decode_step`` / ``decode_and_sample`` and their tensor-parallel ``tp_prefill`` /
  ``tp_decode_step``); mark a program of yours the same way::

    @qjax.retraced_on_registration
    @jax.jit
    def step(params, x): ...

  Args:
    jitted: the result of ``jax.jit`` (anything with ``clear_cache()``).

  Returns:
    ``jitted`` itself.
  """
  if not callable(getattr(jitted, "clear_cache", None)):
    raise TypeError(f"retraced_on_registration takes a jax.jit function (with clear_cache), "
                    f"got {type(jitted).__name__}; put it above @jax.jit")
  _RETRACED.append(jitted)
  return jitted


def registry_changed() -> None:
  """Called by every ``register_*`` of the dispatcher, MoE and sharding registries: the
  :func:`retraced_on_registration` functions trace again on their next call."""
  for jitted in _RETRACED:
    jitted.clear_cache()


def inside_kernel_call() -> bool:
  """Whether a :func:`kernel_call` is being traced on this thread: the qjax calls it
  makes (a ShardedWeight's per-device call, a LayerOf's layer) run unwrapped."""
  return getattr(_state, "depth", 0) > 0


def picks_a_kernel(implementation_name: Callable[[], str]) -> bool:
  """Whether ``implementation_name()`` (the dispatcher's choice for a call) names a kernel
  rather than "xla". A call it cannot judge (NotImplementedError, ValueError, TypeError)
  counts as XLA, so that the call itself, unwrapped, raises its own error."""
  try:
    return implementation_name() != "xla"
  except (NotImplementedError, ValueError, TypeError):
    return False


@contextlib.contextmanager
def _inside() -> Iterator[None]:
  _state.depth = getattr(_state, "depth", 0) + 1
  try:
    yield
  finally:
    _state.depth -= 1


def kernel_call(run: Callable[..., jax.Array], run_xla: Callable[..., jax.Array],
                *args: Any) -> jax.Array:
  """``run(*args)``, differentiated in reverse mode as ``run_xla(*args)``.

  Args:
    run: the call that runs a kernel; ``run(*args) -> y``.
    run_xla: the same contract on the XLA path (same arguments, same output shape and
      dtype), which JAX can differentiate.
    *args: pytrees of arrays (x, the quantized weight, expert ids, ...). Integer arrays
      get ``float0`` cotangents, as ``jax.vjp`` gives them.

  Returns:
    ``run(*args)``.
  """

  def primal(*a):
    with _inside():
      return run(*a)

  def forward(*a):
    return primal(*a), a

  def backward(saved, dy):
    _, pullback = jax.vjp(run_xla, *saved)
    return pullback(dy)

  call = jax.custom_vjp(primal)
  call.defvjp(forward, backward)
  return call(*args)


def _is_zero(t: Any) -> bool:
  return isinstance(t, SymbolicZero)


def _zeros(t: SymbolicZero) -> Any:
  """The zeros a symbolic zero tangent stands for (``float0`` for an integer array)."""
  if t.dtype == jax.dtypes.float0:
    return np.zeros(t.shape, jax.dtypes.float0)
  return jnp.zeros(t.shape, t.dtype)


def weight_derivative_from_dequantize(
    fn: Callable[[jax.Array, Any], jax.Array]) -> Callable[[jax.Array, Any], jax.Array]:
  """A format's XLA path ``fn(x2 [M, K], w) -> [M, N]`` whose derivative in ``w`` is that
  of ``x2 @ w.dequantize()`` (float32 products at ``Precision.HIGHEST``, cast to the
  output's dtype), both modes. Its derivative in x is JAX's derivative of ``fn`` (linear
  in x). Neither is computed where its tangent is a symbolic zero, so a gradient with
  respect to x alone costs what it did."""

  def tangent_of(x2, w, x_dot, w_dot):
    y_dot = None if _is_zero(x_dot) else fn(x_dot, w)
    leaves = jax.tree.leaves(w_dot, is_leaf=_is_zero)
    if not all(_is_zero(t) for t in leaves):
      w_dot = jax.tree.map(lambda t: _zeros(t) if _is_zero(t) else t, w_dot,
                           is_leaf=_is_zero)
      _, wd_dot = jax.jvp(lambda w_: w_.dequantize().astype(jnp.float32), (w,), (w_dot,))
      part = jnp.dot(x2.astype(jnp.float32), wd_dot, precision=jax.lax.Precision.HIGHEST)
      y_dot = part if y_dot is None else y_dot.astype(jnp.float32) + part
    return y_dot

  def rule(primals, tangents):
    x2, w = primals
    y = fn(x2, w)
    y_dot = tangent_of(x2, w, *tangents)
    return y, (jnp.zeros_like(y) if y_dot is None else y_dot.astype(y.dtype))

  call = jax.custom_jvp(lambda x2, w: fn(x2, w))  # (some paths take optional args)
  call.defjvp(rule, symbolic_zeros=True)
  return call
