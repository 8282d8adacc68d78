"""qjax: 4-bit weights in JAX.

Quantized-weight pytrees (logical shape ``[K, N]`` for ``y = x @ W``), quantizers, the
dispatcher ``matmul`` with its XLA reference path, and checkpoint I/O. Kernels live in
``pallas_kernels`` and register themselves here; Flax layers live in ``flax_layers``.
"""

from qjax._src.dispatch import Backend as Backend
from qjax._src.dispatch import implementation_name as implementation_name
from qjax._src.dispatch import matmul as matmul
from qjax._src.dispatch import register_kernel as register_kernel
from qjax._src.dispatch import register_repack as register_repack
from qjax._src.dispatch import register_xla as register_xla
from qjax._src.formats import QuantizedWeight as QuantizedWeight
from qjax._src.formats import is_quantized as is_quantized
from qjax._src.formats import register_format as register_format
from qjax._src.formats import static_field as static_field
from qjax._src.autodiff import retraced_on_registration as retraced_on_registration
from qjax._src.int4 import Int4Weight as Int4Weight
from qjax._src.int4 import dequantize as dequantize
from qjax._src.int4 import quantize as quantize
from qjax._src.int4 import ScaleRangeWarning as ScaleRangeWarning
from qjax._src.int4_nk import Int4NKWeight as Int4NKWeight
from qjax._src.int4_nk import to_int4_nk as to_int4_nk
from qjax._src.kernel_layouts import LayoutChoice as LayoutChoice
from qjax._src.kernel_layouts import LayoutConversion as LayoutConversion
from qjax._src.kernel_layouts import kernel_layouts as kernel_layouts
from qjax._src.kernel_layouts import register_layout_conversion as register_layout_conversion
from qjax._src.fp4_nk import MXFP4NKWeight as MXFP4NKWeight
from qjax._src.fp4_nk import NVFP4NKWeight as NVFP4NKWeight
from qjax._src.fp4_nk import to_mxfp4_nk as to_mxfp4_nk
from qjax._src.fp4_nk import to_nvfp4_nk as to_nvfp4_nk
from qjax._src.packing import NATIVE_TILE_K as NATIVE_TILE_K
from qjax._src.packing import PLAIN_TILE_K as PLAIN_TILE_K
from qjax._src.serialization import load as load
from qjax._src.serialization import save as save
from qjax._src.stacked import LayerOf as LayerOf
from qjax._src.stacked import layer_of as layer_of
from qjax._src.tuning import KernelConfig as KernelConfig
# GGUF
from qjax._src.gguf_formats import GGUFBlockWeight as GGUFBlockWeight
from qjax._src.gguf_formats import GGUFDense as GGUFDense
from qjax._src.gguf_formats import GGUFMXFP4 as GGUFMXFP4
from qjax._src.gguf_formats import GGUFQ4_0 as GGUFQ4_0
from qjax._src.gguf_formats import GGUFQ4_1 as GGUFQ4_1
from qjax._src.gguf_formats import GGUFQ4_K as GGUFQ4_K
from qjax._src.gguf_formats import GGUFQ5_K as GGUFQ5_K
from qjax._src.gguf_formats import GGUFQ6_K as GGUFQ6_K
from qjax._src.gguf_formats import GGUFQ8_0 as GGUFQ8_0
from qjax._src.gguf_formats import embedding_rows as embedding_rows
from qjax._src.gguf_tiled import GGUFTiledWeight as GGUFTiledWeight
from qjax._src.gguf_io import GGUFFile as GGUFFile
from qjax._src.gguf_io import describe_gguf as describe_gguf
from qjax._src.gguf_io import load_gguf as load_gguf
from qjax._src import checkpoint_layouts as _checkpoint_layouts  # registers formats
from qjax._src.checkpoint_layouts import AWQWeight as AWQWeight
from qjax._src.checkpoint_layouts import CompressedTensorsWeight as CompressedTensorsWeight
from qjax._src.checkpoint_layouts import GPTQWeight as GPTQWeight
from qjax._src import marlin_layout as _marlin_layout  # registers the format
from qjax._src.marlin_layout import MarlinWeight as MarlinWeight
# FP4
from qjax._src.fp4 import MXFP4Weight as MXFP4Weight
from qjax._src.fp4 import NVFP4Weight as NVFP4Weight
from qjax._src.fp4 import quantize_mxfp4 as quantize_mxfp4
from qjax._src.fp4 import quantize_nvfp4 as quantize_nvfp4
from qjax._src.gpt_oss_layout import GptOssMXFP4Weight as GptOssMXFP4Weight
from qjax._src.gpt_oss_layout import read_gpt_oss_mxfp4 as read_gpt_oss_mxfp4
# Mixture of experts
from qjax._src.moe import moe_implementation_name as moe_implementation_name
from qjax._src.moe import moe_matmul as moe_matmul
from qjax._src.moe import register_moe_kernel as register_moe_kernel
from qjax._src.moe import register_moe_xla as register_moe_xla

# Attention over a KV cache at decode ...
from qjax._src.attention import AttentionBackend as AttentionBackend
from qjax._src.attention import decode_attention as decode_attention
from qjax._src.attention import (decode_attention_implementation_name as
                                 decode_attention_implementation_name)
from qjax._src.attention import (register_decode_attention_kernel as
                                 register_decode_attention_kernel)
# ... and of a prompt over its own keys (prefill)
from qjax._src.causal_attention import causal_attention as causal_attention
from qjax._src.causal_attention import (causal_attention_implementation_name as
                                        causal_attention_implementation_name)
from qjax._src.causal_attention import (register_causal_attention_kernel as
                                        register_causal_attention_kernel)
# ... and new keys and values written into a KV cache
from qjax._src.kv_cache import (kv_cache_write_implementation_name as
                                kv_cache_write_implementation_name)
from qjax._src.kv_cache import register_kv_cache_write_kernel as register_kv_cache_write_kernel
from qjax._src.kv_cache import write_kv_cache as write_kv_cache
# ... and both at one decode step, in one launch
from qjax._src.decode_write import (register_write_and_decode_attention_kernel as
                                    register_write_and_decode_attention_kernel)
from qjax._src.decode_write import write_and_decode_attention as write_and_decode_attention
from qjax._src.decode_write import (write_and_decode_attention_implementation_name as
                                    write_and_decode_attention_implementation_name)

# Codebook (rotated, two-pass residual, host offload of pass 2)
from qjax._src.codebook import CodebookWeight as CodebookWeight
from qjax._src.codebook import quantize_codebook as quantize_codebook
from qjax._src.offload import LayerStack as LayerStack
from qjax._src.offload import PackedPass2 as PackedPass2
from qjax._src.offload import make_stacked_forward as make_stacked_forward
from qjax._src.offload import place_pass2 as place_pass2
from qjax._src.offload import stack_layers as stack_layers

# Several devices (jax.sharding): column-, row- and expert-parallel weights
from qjax._src.sharding import ShardedWeight as ShardedWeight
from qjax._src.sharding import shard_weight as shard_weight
from qjax._src.sharding import sharded_matmul as sharded_matmul
from qjax._src.sharding import sharded_moe_matmul as sharded_moe_matmul
from qjax._src.sharded_load import load_gguf_sharded as load_gguf_sharded
from qjax._src.sharded_load import load_sharded as load_sharded
from qjax._src.split_rules import check_split as check_split
from qjax._src.split_rules import concat_columns as concat_columns
from qjax._src.split_rules import partition_specs as partition_specs
from qjax._src.split_rules import register_split_rule as register_split_rule

import functools as _functools

from qjax._src import codebook as _codebook
from qjax._src import fp4 as _fp4
from qjax._src import gguf_formats as _gguf_formats
from qjax._src import int4 as _int4
from qjax._src import moe as _moe

register_xla(Int4Weight, _int4.matmul_xla)
register_xla(MXFP4Weight, _fp4.matmul_xla)
register_xla(NVFP4Weight, _fp4.matmul_xla)
for _moe_format in _moe.MOE_FORMATS:
  _moe.register_moe_xla(_moe_format, _moe.moe_matmul_xla)
# GGUF expert stacks (MoE GGUF files' [K, N, E] tensors): the same path, its decode route
# one fused reduction.
for _moe_format in (*_gguf_formats.BLOCK_FORMATS.values(), _gguf_formats.GGUFDense):
  _moe.register_moe_xla(_moe_format, _functools.partial(_moe.moe_matmul_xla,
                                                        gathered_sum=True))
del _moe_format
register_xla(CodebookWeight, _codebook.matmul_xla)
del _int4, _fp4, _moe, _codebook, _gguf_formats, _functools

__version__ = "0.1.0"
