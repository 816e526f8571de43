"""Transformer language models (GPT and Llama families) built from tensor-parallel layers.

The model is a sequence of layers (embedding, blocks, head) so pipeline stages build only their own:
see `layer_builders`. `CausalLM` is the whole model for pp=1. `megazero.models.hf` converts
Hugging Face GPT-2 and Llama weights.
"""
from megazero.models.attention import SelfAttention, alibi_slopes
from megazero.models.rope import RopeTables, apply_rope, rope_cos_sin
from megazero.models.block import MLP, TransformerBlock
from megazero.models.common import LayerContext, Norm
from megazero.models.embedding import TIED_EMBEDDING, EmbeddingLayer, HeadLayer
from megazero.models.lm import CausalLM, LayerBuilder, causal_lm_loss, count_params, layer_builders

__all__ = [
    "CausalLM", "LayerBuilder", "layer_builders", "causal_lm_loss", "count_params", "EmbeddingLayer", "HeadLayer",
    "TransformerBlock", "MLP", "SelfAttention", "Norm", "LayerContext", "TIED_EMBEDDING",
    "alibi_slopes", "apply_rope", "rope_cos_sin", "RopeTables",
]
