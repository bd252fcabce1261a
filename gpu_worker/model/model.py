"""The Bamba module tree, with parameter names identical to the Hugging Face checkpoint.

`BambaForCausalLM.forward` runs the packed batch through every layer and returns final hidden states;
the runner applies `lm_head` only to the rows it needs (last token per sequence, or all in tests)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.config import BambaConfig
from gpu_worker.model.context import ForwardContext
from gpu_worker.model.layers import RMSNorm, SwiGLU, rope_cos_sin
from gpu_worker.model.mamba2 import Mamba2Mixer

# Pool tensors handed to the model per forward, indexed by the layer's ordinal within its kind:
# kv_caches[i] = (k, v) of the i-th attention layer; states[j] = (conv, ssm) of the j-th Mamba layer.
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
StateTensors = list[tuple[torch.Tensor, torch.Tensor]]


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is attention or Mamba2."""

    def __init__(self, config: BambaConfig, is_attention: bool) -> None:
        super().__init__()
        self.is_attention = is_attention
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias)
        if is_attention:
            self.self_attn = PagedAttention(config)
        else:
            self.mamba = Mamba2Mixer(config)


class BambaBackbone(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: BambaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, a) for a in config.is_attention_layer)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class BambaForCausalLM(nn.Module):
    """The whole model. Weights are loaded by `gpu_worker.model.loader`; `lm_head` may be tied."""

    def __init__(self, config: BambaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = BambaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rd = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, kv_caches: KVCaches, states: StateTensors
    ) -> torch.Tensor:
        """input_ids [T] (packed, in context order) -> final hidden states [T, hidden]."""
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = rope_cos_sin(ctx.positions, self.inv_freq, hidden.dtype)  # [T, rotary_dim]
        attn_i = mamba_i = 0
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            h = layer.input_layernorm(hidden)
            if layer.is_attention:
                k_cache, v_cache = kv_caches[attn_i]
                h = layer.self_attn(h, ctx, cos, sin, k_cache, v_cache)
                attn_i += 1
            else:
                conv, ssm = states[mamba_i]
                h = layer.mamba(h, ctx, conv, ssm)
                mamba_i += 1
            hidden = hidden + h
            hidden = hidden + layer.feed_forward(layer.pre_ff_layernorm(hidden))
        out: torch.Tensor = self.model.final_layernorm(hidden)
        return out
