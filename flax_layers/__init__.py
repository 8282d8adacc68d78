"""Flax layers on qjax's quantized weights (linen and NNX)."""

from flax_layers.codebook_dense import CodebookDense as CodebookDense
from flax_layers.codebook_dense import CodebookLinear as CodebookLinear
from flax_layers.codebook_dense import CodebookOptions as CodebookOptions
from flax_layers.dense import Int4Dense as Int4Dense
from flax_layers.dense import Int4Linear as Int4Linear
from flax_layers.dense import quantize_dense_params as quantize_dense_params
from flax_layers.quantize_model import QuantizationReport as QuantizationReport
from flax_layers.quantize_model import QuantRule as QuantRule
from flax_layers.quantize_model import quantize_model as quantize_model
from flax_layers.quantize_model import quantize_nnx_model as quantize_nnx_model
from flax_layers.llama import Llama as Llama
from flax_layers.llama import LlamaConfig as LlamaConfig
from flax_layers.llama import QuantizedDense as QuantizedDense
from flax_layers.llama import RMSNorm as RMSNorm
from flax_layers.llama import apply_rope as apply_rope
from flax_layers.llama import decode_step as decode_step
from flax_layers.llama import extend as extend
from flax_layers.llama import forward as forward
from flax_layers.llama import fuse_projections as fuse_projections
from flax_layers.llama import init_cache as init_cache
from flax_layers.llama import params_from_gguf as params_from_gguf
from flax_layers.llama import prefill as prefill
from flax_layers.llama import sample as sample
from flax_layers.scan import layer_params as layer_params
from flax_layers.scan import scan_layers as scan_layers
from flax_layers.hf_checkpoint import load_hf_llama as load_hf_llama
from flax_layers.hf_checkpoint import save_hf_llama as save_hf_llama
from flax_layers.moe import MXFP4MoE as MXFP4MoE
from flax_layers.moe import route as route
from flax_layers.tensor_parallel import init_tp_cache as init_tp_cache
from flax_layers.tensor_parallel import shard_llama_params as shard_llama_params
from flax_layers.tensor_parallel import splittable_layouts as splittable_layouts
from flax_layers.tensor_parallel import tp_decode_step as tp_decode_step
from flax_layers.tensor_parallel import tp_extend as tp_extend
from flax_layers.tensor_parallel import tp_forward as tp_forward
from flax_layers.tensor_parallel import tp_prefill as tp_prefill

__all__ = [  # the public names (pyflakes reads the re-exports from it)
    "CodebookDense",
    "CodebookLinear",
    "CodebookOptions",
    "Int4Dense",
    "Int4Linear",
    "quantize_dense_params",
    "QuantizationReport",
    "QuantRule",
    "quantize_model",
    "quantize_nnx_model",
    "Llama",
    "LlamaConfig",
    "QuantizedDense",
    "RMSNorm",
    "apply_rope",
    "decode_step",
    "extend",
    "forward",
    "fuse_projections",
    "init_cache",
    "params_from_gguf",
    "prefill",
    "sample",
    "layer_params",
    "scan_layers",
    "load_hf_llama",
    "save_hf_llama",
    "MXFP4MoE",
    "route",
    "init_tp_cache",
    "shard_llama_params",
    "splittable_layouts",
    "tp_decode_step",
    "tp_extend",
    "tp_forward",
    "tp_prefill",
]
