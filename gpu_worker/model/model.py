"""The model: embeddings, a stack of residual blocks, final norm, LM head — the same module tree for
every family (the family adapters in `gpu_worker.model.families` map checkpoint names onto it).

Block i computes `x + residual_multiplier * mixer(norm(x))`, the mixer being a Mamba2 mixer, paged
attention, a dense MLP or an MoE (`ModelConfig.blocks`). `forward` runs the packed batch and returns
final hidden states; the runner applies `compute_logits` only to the rows it needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.config import BlockKind, ModelConfig
from gpu_worker.model.context import ForwardContext
from gpu_worker.model.layers import MLP, RMSNorm, rope_cos_sin
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.model.moe import MoE

# Pool tensors handed to the model per forward, indexed by the block's ordinal within its kind:
# kv_caches[i] = (k, v) of the i-th attention block; states[j] = (conv, ssm) of the j-th Mamba block.
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
StateTensors = list[tuple[torch.Tensor, torch.Tensor]]


class Block(nn.Module):
    """One residual block: an RMS norm and a mixer of one kind."""

    def __init__(self, config: ModelConfig, kind: BlockKind) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = Mamba2Mixer(config)
        elif kind == "attention":
            self.mixer = PagedAttention(config)
        elif kind == "mlp":
            self.mixer = MLP(config.hidden_size, config.intermediate_size, config.mlp_activation, config.mlp_bias)
        else:
            assert config.moe is not None  # ModelConfig validation guarantees it
            self.mixer = MoE(config.hidden_size, config.moe)


class MtpHead(nn.Module):
    """A multi-token-prediction head (Nemotron-H's `mtp.*`): from the model's last hidden state h_i at
    position i (after the final norm) and the embedding of token i + 1, it predicts token i + 2:
    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), then its residual blocks (attention over KV of its
    own, at the same positions and pages as the model's), then `final_norm`; the logits are the model's
    LM head over that. Run again on its own output it predicts further (gpu_worker.runner.mtp)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.mtp_blocks)
        self.final_norm = RMSNorm(h, config.rms_norm_eps)


class HybridForCausalLM(nn.Module):
    """The whole model. Weights are placed by `gpu_worker.model.loader`; `lm_head` may be tied."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.blocks)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MtpHead(config) if config.mtp_blocks else None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(config, torch.device("cpu")), persistent=False)
        # called before each block (a model process among several: take idle cores, runner.tuning.StepThreads)
        self.between_blocks: Callable[[], None] | None = None

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, kv_caches: KVCaches, states: StateTensors
    ) -> torch.Tensor:
        """input_ids [T] (packed, in context order) -> final hidden states [T, hidden]."""
        c = self.config
        hidden = self.embed(input_ids)  # [T, hidden]
        if c.embedding_multiplier != 1.0:
            hidden = hidden * c.embedding_multiplier
        hidden = self._blocks(self.blocks, hidden, ctx, kv_caches, states, self.between_blocks)
        out: torch.Tensor = self.final_norm(hidden)
        return out

    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, kv_caches: KVCaches
    ) -> torch.Tensor:
        """The MTP head (`MtpHead`): next tokens [T] and the hidden states [T, hidden] at the positions
        before them (the model's, or the head's own output) -> the head's output [T, hidden]; `kv_caches`
        are its attention blocks' (k, v)."""
        head = self.mtp
        if head is None:
            raise RuntimeError(f"{self.config.architecture}: this checkpoint has no multi-token-prediction layers")
        embedded = self.embed(input_ids)
        if self.config.embedding_multiplier != 1.0:
            embedded = embedded * self.config.embedding_multiplier
        x = head.eh_proj(torch.cat([head.enorm(embedded), head.hnorm(hidden)], dim=-1))
        out: torch.Tensor = head.final_norm(self._blocks(head.blocks, x, ctx, kv_caches, [], None))
        return out

    def _blocks(
        self, blocks: nn.ModuleList, hidden: torch.Tensor, ctx: ForwardContext, kv_caches: KVCaches,
        states: StateTensors, between: Callable[[], None] | None,
    ) -> torch.Tensor:  # fmt: skip
        c = self.config
        cos = sin = None
        if c.rotary_dim:
            cos, sin = rope_cos_sin(ctx.positions, self.inv_freq, hidden.dtype)  # [T, rotary_dim]
        attn_i = mamba_i = 0
        for module in blocks:
            if between is not None:
                between()
            block = cast(Block, module)
            h = block.norm(hidden)
            if block.kind == "mamba":
                conv, ssm = states[mamba_i]
                h = block.mixer(h, ctx, conv, ssm)
                mamba_i += 1
            elif block.kind == "attention":
                k_cache, v_cache = kv_caches[attn_i]
                h = block.mixer(h, ctx, cos, sin, k_cache, v_cache)
                attn_i += 1
            else:
                h = block.mixer(h)
            hidden = hidden + (h if c.residual_multiplier == 1.0 else h * c.residual_multiplier)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] -> logits [n, vocab] (float32), divided by `logits_scaling`."""
        logits: torch.Tensor = self.lm_head(hidden).float()
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling


def rope_inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """RoPE inverse frequencies over the rotary dims ([rotary_dim / 2]; empty without RoPE)."""
    rd = config.rotary_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
