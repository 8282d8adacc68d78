"""Fused dequantize + matmul kernels in Pallas, lowered to Triton on NVIDIA GPUs (and one
in Pallas Mosaic GPU for Hopper: ``int4_wgmma``).

Importing this package registers each kernel with qjax's dispatcher as the GPU backend of
the formats it serves (qjax finds it through the ``qjax.backends`` entry point).
"""

import jax

import qjax
from pallas_kernels import codebook_matmul as codebook_matmul
from pallas_kernels import decode_attention as decode_attention
from pallas_kernels import gguf_matmul as gguf_matmul
from pallas_kernels import fp4_matmul as fp4_matmul
from pallas_kernels import fp4_moe as fp4_moe
from pallas_kernels import fp4_moe_gemv as fp4_moe_gemv
from pallas_kernels import int4_gemv as int4_gemv
from pallas_kernels import int4_matmul as int4_matmul
from pallas_kernels import int4_moe as int4_moe
from pallas_kernels import int4_moe_gemv as int4_moe_gemv
from pallas_kernels import int4_wgmma as int4_wgmma
from pallas_kernels import kv_cache_write as kv_cache_write
from pallas_kernels import moe_common as moe_common
from pallas_kernels import prefill_attention as prefill_attention
from qjax._src import gguf_formats as _gguf_formats
from qjax._src import gguf_tiled as _gguf_tiled


def triton_supported(device: jax.Device) -> bool:
  """Pallas lowers to Triton on NVIDIA GPUs of compute capability 8.0 and newer."""
  if device.platform != "gpu" or "nvidia" not in device.device_kind.lower() and not hasattr(
      device, "compute_capability"):
    return False
  cc = getattr(device, "compute_capability", None)
  try:
    return cc is None or float(cc) >= 8.0
  except (TypeError, ValueError):
    return True


qjax.register_kernel(
    qjax.Int4Weight,
    qjax.Backend(name="pallas_triton", fn=int4_matmul.int4_matmul,
                 supported_on=triton_supported,
                 candidate_configs=int4_matmul.int4_candidate_configs,
                 # H100 sweeps: the kernel beats XLA up to M = 64 (40.7 vs ~112 us at
                 # 4096x14336) and loses from M = 256 (133 vs ~121 us), and at M = 1 on
                 # weights under 2M elements (int4_gemv.xla_is_faster).
                 auto_max_m=64, auto_prefers_xla=int4_gemv.xla_is_faster,
                 # One [K, N] matrix: an expert stack is qjax.moe_matmul's (below).
                 declines=int4_matmul.declines))

# GGUF: Q4_0 / Q4_1 run the INT4 kernel after their lossless to_int4; Q8_0 / Q4_K / Q5_K /
# Q6_K run the plane kernel on GGUFTiledWeight (MXFP4 reaches the FP4 kernel below through
# the repack qjax registers: its lossless to_mxfp4). Block weights given as they are loaded are
# converted per call (exact, but an extra pass over the weight): convert once at load with
# qjax._src.gguf_tiled.kernel_layout, as `qjax generate` does.
for _cls in (_gguf_formats.GGUFQ4_0, _gguf_formats.GGUFQ4_1):
  qjax.register_kernel(_cls, qjax.Backend(
      name="pallas_triton", fn=gguf_matmul.int4_via_layout, supported_on=triton_supported,
      auto_max_m=64))
for _cls in (_gguf_tiled.GGUFTiledWeight, _gguf_formats.GGUFQ8_0, _gguf_formats.GGUFQ4_K,
             _gguf_formats.GGUFQ5_K, _gguf_formats.GGUFQ6_K):
  qjax.register_kernel(_cls, qjax.Backend(
      name="pallas_triton", fn=gguf_matmul.gguf_matmul, supported_on=triton_supported,
      auto_max_m=64))
del _cls

for _fp4_format in (qjax.MXFP4Weight, qjax.NVFP4Weight):
  qjax.register_kernel(
      _fp4_format,
      qjax.Backend(name="pallas_triton", fn=fp4_matmul.fp4_matmul,
                   supported_on=triton_supported,
                   candidate_configs=fp4_matmul.fp4_candidate_configs,
                   # Same bound as INT4 until the FP4 kernel has its own H100 sweeps.
                   auto_max_m=64))
del _fp4_format

# Mixture of experts: the grouped MXFP4 kernel serves qjax.moe_matmul.
qjax.register_moe_kernel(
    qjax.MXFP4Weight,
    qjax.Backend(name="pallas_triton", fn=fp4_moe.mxfp4_moe_matmul,
                 supported_on=triton_supported))
# The per-pair GEMV MoE kernel serves decode-sized calls (up to fp4_moe_gemv.MAX_PAIRS
# (token, expert) pairs, while they repeat few experts: moe_common.gemv_meant_for): on the
# H100, 128 experts of 2880x2880, top-4, it took 16.5 / 50 / 161 / 311 us at 1 / 4 / 16 /
# 32 tokens against the grouped kernel's 91 / 141 / 291 / 427 us, and lost at 64 tokens
# (611 against 540 us); BENCHMARKS.md.
qjax.register_moe_kernel(
    qjax.MXFP4Weight,
    qjax.Backend(name=fp4_moe_gemv.BACKEND_NAME, fn=fp4_moe_gemv.mxfp4_moe_gemv,
                 supported_on=triton_supported),
    auto_when=lambda num_pairs, w: fp4_moe_gemv.supports(num_pairs, w.shape[0], w.block_size,
                                                         moe_common.stack_experts(w)))
# INT4 expert stacks (GPTQ / AWQ experts, GGUF Q4_0 / Q4_1 stacks after to_int4): the
# same two roles, the same names and the same rule as MXFP4's (session 46 measured it for
# INT4 on the H200).
qjax.register_moe_kernel(
    qjax.Int4Weight,
    qjax.Backend(name="pallas_triton", fn=int4_moe.int4_moe_matmul,
                 supported_on=triton_supported, declines=int4_moe.declines))
qjax.register_moe_kernel(
    qjax.Int4Weight,
    qjax.Backend(name=int4_moe_gemv.BACKEND_NAME, fn=int4_moe_gemv.int4_moe_gemv,
                 supported_on=triton_supported, declines=int4_moe_gemv.declines),
    auto_when=lambda num_pairs, w: int4_moe_gemv.supports(num_pairs, w.shape[0],
                                                          w.group_size,
                                                          moe_common.stack_experts(w)))
qjax.register_kernel(
    qjax.CodebookWeight,
    qjax.Backend(name="pallas_triton", fn=codebook_matmul.codebook_matmul,
                 supported_on=triton_supported,
                 # Same bound as INT4 until the codebook kernel has its own H100 sweeps.
                 auto_max_m=64))

# Int4NKWeight (codes [N, K // 8]): the Mosaic GPU wgmma kernel, Hopper only. At M = 2048
# on the H100 it took 1.04-1.12x the bf16 GEMM's time (two runs), where dequantize-then-GEMM
# takes 1.17x (BENCHMARKS.md, session 16).
qjax.register_kernel(
    qjax.Int4NKWeight,
    qjax.Backend(name="mosaic_gpu_wgmma", fn=int4_wgmma.int4_nk_matmul,
                 supported_on=int4_wgmma.supported, declines=int4_wgmma.declines,
                 candidate_configs=int4_wgmma.tuner_candidates("int4nk"), interprets=False))
# ... and qjax.moe_matmul of its expert stacks (GPTQ / AWQ experts after qjax.to_int4_nk).
qjax.register_moe_kernel(
    qjax.Int4NKWeight,
    qjax.Backend(name="mosaic_gpu_wgmma", fn=int4_wgmma.int4_nk_moe_matmul,
                 supported_on=int4_wgmma.supported, declines=int4_wgmma.moe_declines,
                 interprets=False))
# MXFP4NKWeight, NVFP4NKWeight: the same kernel with E2M1 codes and their block scales.
for _fp4_nk_format in (qjax.MXFP4NKWeight, qjax.NVFP4NKWeight):
  qjax.register_kernel(
      _fp4_nk_format,
      qjax.Backend(name="mosaic_gpu_wgmma", fn=int4_wgmma.fp4_nk_matmul,
                   supported_on=int4_wgmma.supported, declines=int4_wgmma.declines,
                   candidate_configs=int4_wgmma.tuner_candidates(
                       int4_wgmma.TABLE_FORMATS[_fp4_nk_format]), interprets=False))
  # ... and qjax.moe_matmul of their expert stacks: a grouped GEMM over the selected
  # experts.
  qjax.register_moe_kernel(
      _fp4_nk_format,
      qjax.Backend(name="mosaic_gpu_wgmma", fn=int4_wgmma.fp4_nk_moe_matmul,
                   supported_on=int4_wgmma.supported, declines=int4_wgmma.moe_declines,
                   interprets=False))
del _fp4_nk_format

# Attention of one query per sequence over a KV cache (qjax.decode_attention).
qjax.register_decode_attention_kernel(
    qjax.AttentionBackend(name="pallas_triton", fn=decode_attention.decode_attention,
                          supported_on=triton_supported))
# Causal attention of a prompt over its own keys (qjax.causal_attention): flash attention.
qjax.register_causal_attention_kernel(
    qjax.AttentionBackend(name="pallas_triton", fn=prefill_attention.causal_attention,
                          supported_on=triton_supported))
# New keys and values into a KV cache (qjax.write_kv_cache): both in one launch, in place.
qjax.register_kv_cache_write_kernel(
    qjax.AttentionBackend(name="pallas_triton", fn=kv_cache_write.write_kv_cache,
                          supported_on=triton_supported))
# Both at a decode step (qjax.write_and_decode_attention): the new row written and the
# cache attended in one launch.
qjax.register_write_and_decode_attention_kernel(
    qjax.AttentionBackend(name="pallas_triton",
                          fn=decode_attention.write_and_decode_attention,
                          supported_on=triton_supported))
