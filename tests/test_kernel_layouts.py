"""``qjax.kernel_layouts``: every conversion is bit-exact, is made only where the target
format's kernel runs on the device (a stand-in Hopper device on the CPU, the real one on
the H100), and the wgmma kernel's ``declines`` agrees with what the kernel does.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax._src import check
from qjax._src import kernel_layouts as kl
from conftest import needs_gpu, seed_from

import pallas_kernels  # noqa: F401  (registers the kernels whose support is checked)
from pallas_kernels import int4_wgmma as kw


@dataclasses.dataclass(frozen=True)
class StandInHopper:
  """What the kernels' ``supported_on`` read of an H100: a device with no arrays."""
  platform: str = "gpu"
  device_kind: str = "NVIDIA H100 80GB HBM3"
  compute_capability: str = "9.0"
  core_count: int = 132


HOPPER = StandInHopper()
CASES = {c.name: c for c in check.format_cases()}


def build(name, k=256, n=128):
  case = CASES[name]
  return case.build(np.random.default_rng(seed_from(name)), *case.fit(k, n))


def assert_same_values(new, old):
  np.testing.assert_array_equal(np.asarray(new.dequantize()), np.asarray(old.dequantize()))


def one(w, **kw_args):
  """``(converted weight, its LayoutChoice)`` of a tree holding only ``w``."""
  tree, report = qjax.kernel_layouts({"w": w}, with_report=True, **kw_args)
  assert len(report) == 1 and report[0].path == "w"
  return tree["w"], report[0]


# What each of check's formats becomes on an H100 with bf16 activations (256x128).
ON_HOPPER = {
    "int4-sym-g32": "Int4Weight",  # the wgmma kernel takes groups of 64 and up
    "int4-sym-g128": "Int4NKWeight",
    "int4-asym-g64-f16": "Int4NKWeight",  # zero points and f16 scales: the kernel takes both
    "int4-bias-g32-f16": "Int4Weight",
    "gguf-Q4_0": "Int4Weight",  # blocks of 32: groups of 32
    "gguf-Q4_1": "Int4Weight",
    "gguf-Q8_0": "GGUFTiledWeight",
    "gguf-Q4_K": "GGUFTiledWeight",
    "gguf-Q5_K": "GGUFTiledWeight",
    "gguf-Q6_K": "GGUFTiledWeight",
    "gguf_tiled-Q8_0": "GGUFTiledWeight",
    "gguf-MXFP4": "MXFP4NKWeight",
    "gptq-v2-g128": "Int4NKWeight",  # GPTQ -> Int4Weight -> Int4NKWeight
    "gptq-v1-actorder-g32": "GPTQWeight",  # needs x permuted: repacked per call
    "awq-g128": "Int4NKWeight",
    "compressed_tensors-asym-g128": "Int4NKWeight",
    "marlin-asym-g128": "Int4NKWeight",
    "mxfp4": "MXFP4NKWeight",
    "nvfp4": "NVFP4NKWeight",
    "gpt_oss-mxfp4": "MXFP4NKWeight",
    "int4_nk-sym-g128": "Int4NKWeight",
    "int4_nk-asym-g64-f16": "Int4NKWeight",
    "mxfp4_nk": "MXFP4NKWeight",
}


@pytest.mark.parametrize("name", sorted(ON_HOPPER))
def test_hopper_layouts_are_bit_exact(name):
  w = build(name)
  w = w[0] if isinstance(w, tuple) else w
  new, choice = one(w, device=HOPPER)
  assert type(new).__name__ == ON_HOPPER[name], str(choice)
  assert choice.source == type(w).__name__
  assert choice.target == (None if new is w else ON_HOPPER[name])
  assert_same_values(new, w)


@pytest.mark.parametrize("name", sorted(CASES))
def test_nothing_changes_on_the_cpu(name):
  w = build(name)
  w = w[0] if isinstance(w, tuple) else w
  new, choice = one(w, device=jax.devices("cpu")[0])
  assert new is w and choice.target is None
  assert "runs on cpu" in choice.reason or "no conversion" in choice.reason, choice.reason


def test_every_conversion_source_has_a_case():
  """Each format with a registered conversion is among the cases above."""
  covered = set()
  for name in ON_HOPPER:
    w = build(name)
    covered.add(type(w[0] if isinstance(w, tuple) else w))
  assert set(kl._CONVERSIONS) - covered == set()  # pylint: disable=protected-access


def test_reasons_name_what_the_kernel_lacks():
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
  narrow = qjax.quantize(w, group_size=128, symmetric=True, scale_dtype=jnp.bfloat16)
  new, choice = one(narrow, device=HOPPER)
  assert new is narrow and "N=64" in choice.reason, choice.reason
  wide = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
  f32 = qjax.quantize(wide, group_size=128, symmetric=True, scale_dtype=jnp.float32)
  new, choice = one(f32, device=HOPPER)
  assert new is f32 and "float32" in choice.reason, choice.reason
  sym = qjax.quantize(wide, group_size=128)
  biased = qjax.Int4Weight(codes=sym.codes, scales=sym.scales, zeros=None, biases=sym.scales,
                           shape=sym.shape, group_size=128)
  new, choice = one(biased, device=HOPPER)
  assert new is biased and "float biases" in choice.reason, choice.reason
  gptq = build("gptq-v1-actorder-g32")
  gptq = gptq[0] if isinstance(gptq, tuple) else gptq
  new, choice = one(gptq, device=HOPPER)
  assert new is gptq and "act-order" in choice.reason, choice.reason


def test_activation_dtypes():
  w = build("int4-sym-g128")
  new, choice = one(w, device=HOPPER, dtype=jnp.float16)
  assert new is w and "float16" in choice.reason  # the wgmma kernel takes bf16 only
  q8 = build("gguf-Q8_0")
  new, _ = one(q8, device=HOPPER, dtype=jnp.float16)  # the Triton kernels take f16
  assert type(new).__name__ == "GGUFTiledWeight"
  new, choice = one(q8, device=HOPPER, dtype=jnp.float32)
  assert new is q8 and "XLA path" in choice.reason
  with pytest.raises(ValueError, match="int8"):
    qjax.kernel_layouts({"w": w}, device=HOPPER, dtype=jnp.int8)


def test_stacks_and_expert_stacks():
  """A layer stack is checked against the dense kernel (N a multiple of 128); an expert
  stack named by ``experts`` against the MoE kernel, which takes N = 144."""
  rng = np.random.default_rng(4)
  layers = qjax.quantize_nvfp4(jnp.asarray(rng.standard_normal((3, 256, 256)), jnp.float32))
  experts = qjax.quantize_mxfp4(jnp.asarray(rng.standard_normal((4, 256, 144)), jnp.float32))
  tree = {"blocks": {"mlp": {"down": layers}}, "moe": {"down": experts}, "norm": jnp.ones(3)}
  new, report = qjax.kernel_layouts(tree, device=HOPPER, with_report=True)
  assert [c.path for c in report] == ["blocks/mlp/down", "moe/down"]
  assert type(new["blocks"]["mlp"]["down"]).__name__ == "NVFP4NKWeight"
  assert new["moe"]["down"] is experts and "N=144" in report[1].reason
  assert new["norm"] is tree["norm"]
  new = qjax.kernel_layouts(tree, device=HOPPER, experts=lambda p: p.startswith("moe/"))
  assert type(new["moe"]["down"]).__name__ == "MXFP4NKWeight"
  assert_same_values(new["moe"]["down"], experts)
  assert_same_values(new["blocks"]["mlp"]["down"], layers)


def test_report_lines():
  w = build("int4-sym-g128")
  _, choice = one(w, device=HOPPER)
  assert str(choice) == "w: Int4Weight -> Int4NKWeight (Int4NKWeight's kernel runs it)"
  _, choice = one(w, device=jax.devices("cpu")[0])
  assert str(choice).startswith("w: Int4Weight kept (not Int4NKWeight: no kernel")


def test_declines_checks_abstract_stacks():
  """``declines`` reads shapes and dtypes only: abstract arrays and stacks give the same
  answer as the weight itself."""
  rng = np.random.default_rng(5)
  for k, n, g in ((256, 256, 128), (512, 384, 64), (256, 64, 128), (192, 256, 64)):
    layers = [qjax.to_int4_nk(qjax.quantize(
        jnp.asarray(rng.standard_normal((k, n)), jnp.float32), group_size=g, symmetric=True,
        scale_dtype=jnp.bfloat16)) for _ in range(2)]
    w = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    layer = jax.tree.map(lambda a: a[0], w)
    assert kw.declines(abstract, jnp.bfloat16) == kw.declines(w, jnp.bfloat16) == kw.declines(
        layer, jnp.bfloat16), (k, n, g)


@needs_gpu
@pytest.mark.skipif(not kw.supported(jax.devices()[0]),
                    reason="the wgmma kernel needs an NVIDIA Hopper GPU (sm_90)")
@pytest.mark.parametrize("k,n,g", [(256, 256, 128), (512, 384, 64), (256, 64, 128),
                                   (768, 128, 256), (1024, 256, None), (320, 256, 64),
                                   (256, 200, 128), (2880, 256, 64), (192, 256, 64)])
def test_declines_agrees_with_the_kernel(k, n, g):
  """Where ``declines`` says the kernel runs a weight it runs at every M and matches
  float64; where it names a reason the kernel raises NotImplementedError at some M."""
  rng = np.random.default_rng(seed_from(f"declines-{k}-{n}-{g}"))
  w = qjax.to_int4_nk(qjax.quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32),
                                    group_size=g, symmetric=True, scale_dtype=jnp.bfloat16))
  reason = kw.declines(w, jnp.bfloat16)
  ref_w = np.asarray(w.dequantize(), np.float64)
  raised = []
  for m in (1, 8, 16, 64, 256, 2048):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    try:
      y = jax.block_until_ready(kw.int4_nk_matmul(x, w))
    except NotImplementedError as e:
      raised.append((m, str(e)))
      continue
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ ref_w
    err = np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.sqrt(np.mean(ref ** 2))
    assert err < 2e-2, (m, err)
  assert (reason is None) == (not raised), (reason, raised)


@needs_gpu
@pytest.mark.skipif(not kw.supported(jax.devices()[0]),
                    reason="the wgmma kernel needs an NVIDIA Hopper GPU (sm_90)")
@pytest.mark.parametrize("name", sorted(ON_HOPPER))
def test_converted_weights_run_their_kernels(name):
  """On the H100 itself: the same choices as on the stand-in device, and each converted
  weight's auto call runs a kernel (not the XLA path) and matches float64."""
  w = build(name, 512, 256)
  w = w[0] if isinstance(w, tuple) else w
  new, choice = one(w)
  assert type(new).__name__ == ON_HOPPER[name], str(choice)
  rng = np.random.default_rng(seed_from(name))
  x = jnp.asarray(rng.standard_normal((16, w.shape[0])), jnp.bfloat16)
  if choice.target is not None:
    assert qjax.implementation_name(new, m=16) != "xla"
  y = jax.jit(qjax.matmul)(x, new)
  ref = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.dequantize(), np.float64)
  err = np.max(np.abs(np.asarray(y.astype(jnp.float32), np.float64) - ref)) / np.sqrt(
      np.mean(ref ** 2))
  assert err < 2e-2, err


def test_bench_stack_in_kernel_layouts_runs():
  """``qjax bench --model``'s kernel-layouts row: the same weights (on the CPU nothing is
  converted, so the same bytes) through the converted stack."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  size = dict(layers=1, hidden=256, inter=512, kv=128, calls=1)
  plain = bench.llama_stack_tokens_per_s(**size)
  converted = bench.llama_stack_tokens_per_s(**size, layouts=True)
  assert converted["int4_weight_gb"] == plain["int4_weight_gb"]
  assert 0 < converted["int4_tokens_per_s"] < float("inf")


def test_gptq_with_the_trivial_g_idx_converts():
  """A g_idx of ``k // G`` (no act-order) needs no permutation of x: it converts."""
  rng = np.random.default_rng(6)
  w4 = qjax.quantize(jnp.asarray(rng.standard_normal((256, 128)), jnp.float32),
                     group_size=64, symmetric=False)
  gptq = qjax.GPTQWeight.from_int4(w4, g_idx=jnp.arange(256, dtype=jnp.int32) // 64)
  new, choice = one(gptq, device=HOPPER)
  assert type(new).__name__ == "Int4NKWeight", str(choice)  # via Int4Weight
  assert_same_values(new, gptq)
  shuffled = qjax.GPTQWeight.from_int4(
      w4, g_idx=jnp.asarray(rng.permutation(np.arange(256) // 64), jnp.int32))
  new, choice = one(shuffled, device=HOPPER)
  assert new is shuffled and "act-order" in choice.reason


@pytest.mark.parametrize("name", sorted(ON_HOPPER))
def test_convert_to_applies_the_registered_conversion_on_any_device(name):
  """``convert_to(w, target)`` is each registered conversion without the kernel check
  (generate's GPTQ / AWQ / compressed-tensors -> Int4Weight on the CPU too), bit-exact,
  and ``w`` itself for a target it has no conversion to or one that refuses it."""
  w = build(name)
  w = w[0] if isinstance(w, tuple) else w
  convs = kl._CONVERSIONS.get(type(w), [])  # pylint: disable=protected-access
  for conv in convs:
    new = kl.convert_to(w, conv.target)
    if conv.refuses(w) is None:
      assert type(new) is conv.target
      assert_same_values(new, w)
    else:
      assert new is w, name
  assert kl.convert_to(w, StandInHopper) is w  # not a format: nothing registered
  if name == "gptq-v1-actorder-g32":
    assert kl.convert_to(w, qjax.Int4Weight) is w
  elif name.startswith(("gptq", "awq", "compressed", "marlin")):
    assert type(kl.convert_to(w, qjax.Int4Weight)) is qjax.Int4Weight
