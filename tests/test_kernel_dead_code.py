"""A kernel call whose output is unused is dead code, so flax's ``nn.scan`` takes kernels.

jax never removes a bare ``pallas_call`` in dead-code elimination, and flax's ``nn.scan``
(0.12.9 and later) checks its body's loop-invariant part by eliminating dead code and
raises "broadcasted variable has a data dependency on the scan body" if anything reads
the scanned inputs. ``pallas_kernels.common.launch`` wraps the call in ``jax.jit``, which
DCE drops whole. The flax version on the CPU may predate that check, so the DCE property
itself is tested here, and the scanned model against the unrolled one.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr has no public name

import qjax
from conftest import on_gpu, rel_err
from flax_layers import Int4Dense
from qjax._src import bench


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4", "codebook"])
@pytest.mark.parametrize("m", [1, 5])
def test_unused_kernel_output_is_dead_code(fmt, m):
  w = bench.random_weight(fmt, 256, 96, jax.random.key(m))
  x = jax.random.normal(jax.random.key(1), (m, 256), jnp.bfloat16)

  def used_and_unused(x, w):
    y = qjax.matmul(x, w, implementation="interpret")
    return y, x * 2

  closed = jax.make_jaxpr(used_and_unused)(x, w)
  names = lambda jaxpr: {e.primitive.name for e in jaxpr.eqns}
  assert "pjit" in names(closed.jaxpr) or "jit" in names(closed.jaxpr)
  kept, used_inputs = pe.dce_jaxpr(closed.jaxpr, [True, True])
  assert len(kept.eqns) == len(closed.jaxpr.eqns)  # the output is used: the call stays
  dropped, used_inputs = pe.dce_jaxpr(closed.jaxpr, [False, True])
  assert names(dropped) == {"mul"}, names(dropped)
  assert used_inputs[0] and not any(used_inputs[1:]), used_inputs  # only x is read


class _Layer(nn.Module):
  implementation: str | None

  @nn.compact
  def __call__(self, x, _):
    h = Int4Dense(x.shape[-1], implementation=self.implementation, name="dense")(x)
    return jnp.tanh(h) + x, None


class _Scanned(nn.Module):
  implementation: str | None
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=self.layers)
    return stack(self.implementation, name="layers")(x, None)[0]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_kernel_inside_nn_scan_matches_unrolled_layers(dtype):
  x = jax.random.normal(jax.random.key(0), (3, 256), dtype)
  params = _Scanned("xla").init(jax.random.key(1), x)
  got = jax.jit(_Scanned("interpret").apply)(params, x)
  # The same layers one by one through XLA, in float32, from the scanned params.
  want = x.astype(jnp.float32)
  for i in range(3):
    layer = jax.tree.map(lambda a: a[i], params["params"]["layers"]["dense"])
    h = qjax.matmul(want, layer["kernel"], implementation="xla") + layer["bias"]
    want = jnp.tanh(h) + want
  assert got.dtype == dtype
  # float32: on a GPU the interpreted kernel's dots run through XLA as TF32 (~3e-4).
  tol = 2e-2 if dtype == jnp.bfloat16 else (2e-3 if on_gpu() else 1e-5)
  assert rel_err(np.asarray(got, np.float64), np.asarray(want, np.float64)) < tol
