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
from flax_layers.llama import forward as forward
from flax_layers.llama import init_cache as init_cache
from flax_layers.llama import params_from_gguf as params_from_gguf
from flax_layers.llama import prefill as prefill
from flax_layers.llama import sample as sample
from flax_layers.hf_checkpoint import load_hf_llama as load_hf_llama
from flax_layers.hf_checkpoint import save_hf_llama as save_hf_llama
from flax_layers.moe import MXFP4MoE as MXFP4MoE
from flax_layers.moe import route as route
