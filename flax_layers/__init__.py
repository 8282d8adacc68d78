"""Flax layers on qjax's quantized weights (linen and NNX)."""

from flax_layers.dense import Int4Dense as Int4Dense
from flax_layers.dense import Int4Linear as Int4Linear
from flax_layers.dense import quantize_dense_params as quantize_dense_params
