"""Every built-in format keeps the contract of ``qjax.QuantizedWeight``: ``dequantize()``
is the float32 ``[K, N]`` and ``dequantize(dtype)`` the same values rounded once to
``dtype`` (before session 29 half the formats took no dtype). Each format of
``qjax check``'s list is built on fresh random values (codebook weights quantized from a
Gaussian, GGUF's dense F16 / BF16 tensors); every format class registered by qjax appears
among them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import check, formats
from conftest import seed_from

CASES = {c.name: c for c in check.format_cases()}


EXTRA = ("codebook", "gguf-F16", "gguf-BF16")  # formats qjax check does not list


def _build(name):
  rng = np.random.default_rng(seed_from(name))
  if name == "codebook":
    return qjax.quantize_codebook(jnp.asarray(rng.standard_normal((256, 64)), jnp.float32))
  if name.startswith("gguf-") and name[5:] in ("F16", "BF16"):  # GGUF's dense tensors
    data = jnp.asarray(rng.standard_normal((64, 96)), {"F16": jnp.float16,
                                                       "BF16": jnp.bfloat16}[name[5:]])
    return qjax.GGUFDense(data=data, shape=(96, 64))
  case = CASES[name]
  return case.build(rng, *case.fit(256, 128))


@pytest.mark.parametrize("name", [*CASES, *EXTRA])
def test_dequantize_takes_a_dtype(name):
  w = _build(name)
  base = np.asarray(w.dequantize())
  assert base.dtype == np.float32 and base.shape == tuple(w.shape)
  assert np.isfinite(base).all() and np.any(base != 0)
  np.testing.assert_array_equal(np.asarray(w.dequantize(jnp.float32)), base)
  for dtype in (jnp.bfloat16, jnp.float16):
    got = w.dequantize(dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(jnp.asarray(base).astype(dtype)).view(np.uint16))


def test_every_registered_format_is_covered():
  """The cases above reach every format class qjax registers (a new format must join
  check.format_cases, or this list of exceptions, to be tested here)."""
  built = {type(w) if not isinstance(w, tuple) else type(w[0])
           for w in (_build(n) for n in [*CASES, *EXTRA])}
  registered = {cls for cls in formats._FORMATS.values()  # pylint: disable=protected-access
                if cls.__module__.startswith("qjax.")}
  assert registered - built == set(), sorted(c.__name__ for c in registered - built)
