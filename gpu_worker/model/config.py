"""The family-neutral model config: one layer stack of residual blocks, validated once at load.

Every supported architecture (see `gpu_worker.model.families`) parses its `config.json` into this one
shape. The model is a stack of residual blocks `x + residual_multiplier * block(rms_norm(x))`, each block
one of four kinds: a Mamba2 mixer, paged attention, a dense MLP, or a routed MoE (with an optional
shared expert). A Bamba or Granite decoder layer is two blocks (mixer, then MLP or MoE); a Nemotron-H
layer is one. Anything the forward pass cannot honour is rejected with a message naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

from hybridserve.errors import InvalidArgumentError

BlockKind = Literal["mamba", "attention", "mlp", "moe"]
BLOCK_KINDS: tuple[BlockKind, ...] = ("mamba", "attention", "mlp", "moe")
Activation = Literal["swiglu", "relu2"]  # swiglu: silu(gate) * up over a fused [gate; up]; relu2: relu(x)^2
RouterKind = Literal["softmax_topk", "sigmoid_grouped"]


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A routed mixture of experts. `softmax_topk` (Granite): top-k of the router logits, softmax over
    those k. `sigmoid_grouped` (Nemotron-H, DeepSeek-V3 style): sigmoid scores plus a correction bias
    choose the experts within the best `topk_group` of `n_group` groups; the weights are the chosen
    sigmoid scores, normalised when `norm_topk_prob`, times `routed_scaling_factor`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per-expert width (channels)
    activation: Activation
    router: RouterKind
    shared_intermediate_size: int  # 0 = no shared expert
    shared_activation: Activation
    shared_bias: bool = False  # the shared expert's projections have biases
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a hybrid checkpoint, whatever its family. Derived sizes are properties."""

    architecture: str  # config.json's architectures[0], e.g. "BambaForCausalLM"
    vocab_size: int  # number of token ids
    hidden_size: int  # model width (channels)
    blocks: tuple[BlockKind, ...]  # the residual blocks, in order
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # channels per attention head
    attention_scale: float  # softmax scale of q.k (head_dim^-0.5 unless the family says otherwise)
    rotary_dim: int  # leading dims of each head that RoPE rotates; 0 = no positional embedding
    rope_theta: float
    attention_bias: bool
    # Mamba2
    mamba_n_heads: int
    mamba_d_head: int  # channels per SSM head
    mamba_n_groups: int  # B/C groups (heads share B and C within a group)
    mamba_d_state: int  # SSM state size N
    mamba_d_conv: int  # causal conv kernel width (tokens)
    mamba_chunk_size: int  # SSD scan chunk length (tokens)
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_min: float  # dt clamp, lower bound
    time_step_max: float  # dt clamp, upper bound (may be inf)
    # dense MLP blocks
    intermediate_size: int  # MLP width (channels); 0 when the stack has no MLP block
    mlp_activation: Activation
    mlp_bias: bool
    moe: MoEConfig | None  # set when the stack has MoE blocks
    # scalars and norms
    rms_norm_eps: float
    tie_word_embeddings: bool
    embedding_multiplier: float = 1.0  # embeddings are scaled by this (Granite)
    residual_multiplier: float = 1.0  # each block's output is scaled by this before the residual add (Granite)
    logits_scaling: float = 1.0  # logits are divided by this (Granite)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # the longest sequence (tokens) the checkpoint says it serves; 0 = it names none. A serving limit, not a
    # shape: it is left out of the fingerprint (two checkpoints that differ only here compute the same)
    max_position_embeddings: int = 0
    # a multi-token-prediction head (Nemotron-H's `mtp.*`): its residual blocks, after a fusion of the next
    # token's embedding with the model's last hidden state (gpu_worker.model.model.MtpHead); () = none
    mtp_blocks: tuple[BlockKind, ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def d_inner(self) -> int:
        """Mamba inner width (channels): heads x head dim."""
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: x, B and C."""
        return self.d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def num_hidden_layers(self) -> int:
        """Residual blocks in the stack."""
        return len(self.blocks)

    @property
    def num_attention_layers(self) -> int:
        return self.blocks.count("attention")

    @property
    def num_mamba_layers(self) -> int:
        return self.blocks.count("mamba")

    @property
    def num_mtp_attention_layers(self) -> int:
        """Attention blocks of the multi-token-prediction head (their KV sits after the model's)."""
        return self.mtp_blocks.count("attention")

    def to_canonical_json(self) -> str:
        """A stable serialisation (sorted keys, inf spelled out) for fingerprints."""
        fields = asdict(self)
        del fields["max_position_embeddings"]
        if not self.mtp_blocks:  # a field added later: configs without it keep their fingerprint
            del fields["mtp_blocks"]
        return json.dumps(fields, sort_keys=True, default=str, allow_nan=True)


def _validate(c: ModelConfig) -> None:
    """Shape rules the forward pass relies on; each message names the field and the fix."""

    def bad(msg: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"config.json: {msg}")

    positive = ["vocab_size", "hidden_size"]
    if c.num_attention_layers or c.num_mtp_attention_layers:
        positive += ["num_attention_heads", "num_key_value_heads", "head_dim"]
    if c.num_mamba_layers:
        positive += ["mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                     "mamba_chunk_size"]  # fmt: skip
    if "mlp" in c.blocks:
        positive.append("intermediate_size")
    for name in positive:
        if getattr(c, name) <= 0:
            raise bad(f"{name} must be positive, got {getattr(c, name)}")
    if c.max_position_embeddings < 0:
        raise bad(f"max_position_embeddings must be >= 0, got {c.max_position_embeddings}")
    unknown = sorted(set(c.blocks) - set(BLOCK_KINDS))
    if unknown or not c.blocks:
        raise bad(f"layer types {unknown or 'empty'} are not supported (supported: {', '.join(BLOCK_KINDS)})")
    if (c.num_attention_layers or c.num_mtp_attention_layers) and c.num_attention_heads % c.num_key_value_heads:
        raise bad(
            f"num_attention_heads={c.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={c.num_key_value_heads}"
        )
    if c.rotary_dim % 2 or not 0 <= c.rotary_dim <= c.head_dim:
        raise bad(f"the rotary dim {c.rotary_dim} must be even and within [0, head_dim={c.head_dim}]")
    if c.num_mamba_layers and c.mamba_n_heads % c.mamba_n_groups:
        raise bad(f"mamba_n_heads={c.mamba_n_heads} is not divisible by mamba_n_groups={c.mamba_n_groups}")
    if not c.time_step_min <= c.time_step_max:
        raise bad(f"time_step_limit min {c.time_step_min} exceeds max {c.time_step_max}")
    if "moe" in c.blocks or "moe" in c.mtp_blocks:
        _validate_moe(c.moe, bad)
    if "mamba" in c.mtp_blocks:
        raise bad("mtp_hybrid_override_pattern: Mamba layers (M) in the multi-token-prediction head are not"
                  " supported; only * (attention), - (MLP) and E (MoE)")  # fmt: skip
    if "mlp" in c.mtp_blocks and c.intermediate_size <= 0:
        raise bad("intermediate_size must be positive for the MTP head's MLP layers")


def _validate_moe(m: MoEConfig | None, bad: Callable[[str], InvalidArgumentError]) -> None:
    if m is None:
        raise bad("the layer stack has MoE layers but no experts are configured")
    if m.num_experts <= 0 or not 0 < m.top_k <= m.num_experts:
        raise bad(f"num_experts_per_tok={m.top_k} must be in [1, number of experts={m.num_experts}]")
    if m.intermediate_size <= 0:
        raise bad(f"the expert intermediate size must be positive, got {m.intermediate_size}")
    if m.n_group <= 0 or m.num_experts % m.n_group or not 0 < m.topk_group <= m.n_group:
        raise bad(f"n_group={m.n_group} must divide the {m.num_experts} experts and topk_group={m.topk_group} "
                  f"must be in [1, n_group]")  # fmt: skip
    if m.router == "sigmoid_grouped" and m.n_group > 1 and m.num_experts // m.n_group < 2:
        raise bad(f"n_group={m.n_group} leaves fewer than 2 experts per group; grouped routing needs 2")
    if m.top_k > (m.num_experts // m.n_group) * m.topk_group:
        raise bad(f"num_experts_per_tok={m.top_k} exceeds the experts of the topk_group={m.topk_group} groups")


# The name this config had while Bamba was the only family; kept for code written against it.
BambaConfig = ModelConfig
