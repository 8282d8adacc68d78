"""float32 activations through the Triton kernels: the dots' precision.

By default a float32 ``plgpu.dot`` is one TF32 product on the GPU, as ``jnp.dot`` is (10
bits of x's mantissa). Under ``jax.default_matmul_precision("highest")`` (or
``"float32"``) the kernels take three TF32 products and are as accurate as the XLA
fallbacks, which multiply float32 at ``Precision.HIGHEST`` always
(``pallas_kernels.common.dot_precision``). On the CPU the choice is checked; on an NVIDIA
GPU every Triton matmul kernel is run both ways against float64, on fresh random inputs,
at tile configurations whose pipelines needed fewer stages for three products (MXFP4 at
M = 64 on 4096 x 4096 asked 233472 bytes of shared memory with 4 stages).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from conftest import needs_gpu, rel_err, seed_from
from pallas_kernels import common
from qjax import KernelConfig

X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def test_dot_precision_follows_the_default_matmul_precision():
  assert common.dot_precision(jnp.float32, interpret=False) is None  # Triton's TF32
  for asked in ("highest", "float32"):
    with jax.default_matmul_precision(asked):
      assert common.dot_precision(jnp.float32, interpret=False) == X3
      assert common.dot_precision(jnp.bfloat16, interpret=False) is None
      assert common.dot_precision(jnp.float16, interpret=False) is None
      assert common.dot_precision(jnp.float32, interpret=True) is None  # the CPU's exact dot
  for asked in ("bfloat16", "tensorfloat32"):
    with jax.default_matmul_precision(asked):
      assert common.dot_precision(jnp.float32, interpret=False) is None


def test_three_products_cap_the_stages():
  cfg = KernelConfig(block_m=64, block_n=64, block_k=256, split_k=4, num_warps=4,
                     num_stages=4)
  assert common.compiled_stages(cfg, jnp.float32, interpret=False) == 4
  with jax.default_matmul_precision("highest"):
    assert common.compiled_stages(cfg, jnp.float32, interpret=False) == common.X3_MAX_STAGES
    assert common.compiled_stages(cfg, jnp.bfloat16, interpret=False) == 4
    one = KernelConfig(block_m=1, block_n=64, block_k=256, num_stages=1)
    assert common.compiled_stages(one, jnp.float32, interpret=False) == 1


def _weight(fmt, k, n, seed):
  w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
  if fmt == "int4":
    return qjax.quantize(w, group_size=128)
  if fmt == "int4-asym":
    return qjax.quantize(w, group_size=128, symmetric=False)
  if fmt == "mxfp4":
    return qjax.quantize_mxfp4(w)
  if fmt == "nvfp4":
    return qjax.quantize_nvfp4(w)
  return qjax.quantize_codebook(w)


FORMATS = ("int4", "int4-asym", "mxfp4", "nvfp4", "codebook")


@needs_gpu
@pytest.mark.parametrize("m", (16, 64, 256))
@pytest.mark.parametrize("fmt", FORMATS)
def test_pallas_float32_matches_float64_at_each_precision(request, fmt, m):
  k = n = 4096
  seed = seed_from(request.node.nodeid)
  w = _weight(fmt, k, n, seed)
  x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((m, k)), jnp.float32)
  ref = np.asarray(x, np.float64) @ np.asarray(qjax.dequantize(w), np.float64)
  errors = {}
  for asked, bound in ((None, 2e-3), ("highest", 2e-6)):
    with jax.default_matmul_precision(asked):
      y = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="pallas"))(x, w)
    assert y.dtype == jnp.float32 and np.isfinite(np.asarray(y)).all()
    errors[asked] = rel_err(np.asarray(y, np.float64), ref)
    assert errors[asked] < bound, errors


@needs_gpu
@pytest.mark.parametrize("ggml_type", ("Q4_K", "Q8_0"))
def test_pallas_float32_gguf_at_highest(request, ggml_type):
  tgk = pytest.importorskip("test_gguf_kernels")
  w, wd = tgk._weight(ggml_type, 4096, 512, seed_from(request.node.nodeid) % 1000)  # pylint: disable=protected-access
  for m in (16, 64):
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 4096)), jnp.float32)
    with jax.default_matmul_precision("highest"):
      y = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="pallas"))(x, w)
    assert rel_err(np.asarray(y, np.float64), np.asarray(x, np.float64) @ wd) < 2e-6
