"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`): each decoder layer is a mixer (Mamba2, or attention
scaled by `attention_multiplier`, with full RoPE or none) then a SwiGLU `shared_mlp`, plus a top-k
softmax-routed MoE when `num_local_experts > 0`. Layer L is our blocks 2L and 2L+1. Granite's scalars:
embeddings times `embedding_multiplier`, every residual branch times `residual_multiplier`, logits
divided by `logits_scaling`."""

from __future__ import annotations

from typing import Any

from gpu_worker.model.config import BlockKind, ModelConfig, MoEConfig
from gpu_worker.model.families.base import (
    Family,
    Getter,
    Source,
    SpecLike,
    auto_head_dim,
    check_inner_width,
    rope_fields,
    split_block_name,
)
from hybridserve.errors import InvalidArgumentError

MIXER_TYPES: dict[str, BlockKind] = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
}  # the second name of each kind: older configs
TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}  # fmt: skip
MOE_NAMES = {
    "router.weight": "block_sparse_moe.router.layer.weight",
    "experts_up": "block_sparse_moe.input_linear.weight",
    "experts_down": "block_sparse_moe.output_linear.weight",
}
MLP_NAMES = {"up_proj.weight": "shared_mlp.input_linear.weight", "down_proj.weight": "shared_mlp.output_linear.weight"}


def _mixers(get: Getter, n_layers: int) -> list[BlockKind]:
    types = get.raw.get("layer_types") or get.raw.get("layers_block_type") or ["linear_attention"] * n_layers
    unknown = sorted({t for t in types if t not in MIXER_TYPES})
    if unknown:
        raise InvalidArgumentError(f"{get.source}: layer_types {unknown} are not supported "
                                   f"(supported: {', '.join(MIXER_TYPES)})")  # fmt: skip
    if len(types) != n_layers:
        raise InvalidArgumentError(
            f"{get.source}: layer_types has {len(types)} entries but num_hidden_layers={n_layers}"
        )
    return [MIXER_TYPES[t] for t in types]


def parse(raw: dict[str, Any], source: str) -> ModelConfig:
    get = Getter(raw, source)
    get.require("hidden_act", ("silu",), "silu")
    hidden, n_heads, n_layers = (
        get.integer("hidden_size"),
        get.integer("num_attention_heads"),
        get.integer("num_hidden_layers"),
    )
    expand, m_heads = get.integer("mamba_expand", default=2), get.integer("mamba_n_heads", default=128)
    d_head = auto_head_dim(get, "mamba_d_head", m_heads, expand, hidden)
    check_inner_width(source, m_heads, d_head, expand, hidden)
    if hidden % n_heads:
        raise InvalidArgumentError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={n_heads}")
    head_dim = get.integer("head_dim", default=hidden // n_heads)
    use_rope = get.require("position_embedding_type", (None, "nope", "rope"), None) == "rope"
    theta = rope_fields(get, head_dim, 1.0)[1] if use_rope else 10000.0
    rotary_dim = head_dim if use_rope else 0  # Granite's RoPE rotates whole heads whatever the partial factor
    shared_width = get.integer("shared_intermediate_size", default=1024)
    num_experts = get.integer("num_local_experts", default=8)
    moe = None
    if num_experts > 0:
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=get.integer("num_experts_per_tok", default=2),
            intermediate_size=get.integer("intermediate_size"),
            activation="swiglu",
            router="softmax_topk",
            shared_intermediate_size=shared_width,
            shared_activation="swiglu",
        )
    blocks: list[BlockKind] = []
    for mixer in _mixers(get, n_layers):
        blocks += [mixer, "moe" if moe else "mlp"]
    t_min, t_max = get.time_step_limit("time_step_limit")
    return ModelConfig(
        architecture="GraniteMoeHybridForCausalLM",
        vocab_size=get.integer("vocab_size"),
        hidden_size=hidden,
        blocks=tuple(blocks),
        num_attention_heads=n_heads,
        num_key_value_heads=get.integer("num_key_value_heads", default=n_heads),
        head_dim=head_dim,
        attention_scale=get.number("attention_multiplier", default=1.0),
        rotary_dim=rotary_dim,
        rope_theta=theta,
        attention_bias=get.flag("attention_bias", default=False),
        mamba_n_heads=m_heads,
        mamba_d_head=d_head,
        mamba_n_groups=get.integer("mamba_n_groups", default=1),
        mamba_d_state=get.integer("mamba_d_state", default=256),
        mamba_d_conv=get.integer("mamba_d_conv", default=4),
        mamba_chunk_size=get.integer("mamba_chunk_size", default=256),
        mamba_conv_bias=get.flag("mamba_conv_bias", default=True),
        mamba_proj_bias=get.flag("mamba_proj_bias", default=False),
        time_step_min=t_min,
        time_step_max=t_max,
        intermediate_size=0 if moe else shared_width,
        mlp_activation="swiglu",
        mlp_bias=False,
        moe=moe,
        rms_norm_eps=get.number("rms_norm_eps", default=1e-6),
        tie_word_embeddings=get.flag("tie_word_embeddings", default=False),
        embedding_multiplier=get.number("embedding_multiplier", default=1.0),
        residual_multiplier=get.number("residual_multiplier", default=1.0),
        logits_scaling=get.number("logits_scaling", default=1.0),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=get.eos_ids(),
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=get.integer("max_position_embeddings", default=0),
    )


def source_of(name: str, config: ModelConfig) -> Source:
    if name in TOP_LEVEL:
        return Source((TOP_LEVEL[name],))
    block, rest = split_block_name(name)
    layer = f"model.layers.{block // 2}."
    if rest == "norm.weight":
        return Source((layer + ("input_layernorm.weight" if block % 2 == 0 else "post_attention_layernorm.weight"),))
    rest = rest.removeprefix("mixer.")
    kind = config.blocks[block]
    if kind == "moe":
        return Source((layer + (MOE_NAMES.get(rest) or MLP_NAMES[rest.removeprefix("shared.")]),))
    if kind == "mlp":
        return Source((layer + MLP_NAMES[rest],))
    return Source((layer + ("mamba." if kind == "mamba" else "self_attn.") + rest,))


def tiny_hf_config(spec: SpecLike) -> dict[str, Any]:
    """A small Granite-4.0-H config.json (dense, or MoE with spec.num_experts experts)."""
    attn = set(spec.attn_layer_indices)
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "shared_intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
        "layer_types": ["full_attention" if i in attn else "linear_attention" for i in range(spec.num_hidden_layers)],
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
        "num_local_experts": spec.num_experts if spec.moe else 0, "num_experts_per_tok": spec.num_experts_per_tok,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "position_embedding_type": "nope",
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
        "logits_scaling": 2.0, "max_position_embeddings": 131072, "mamba_n_heads": spec.mamba_n_heads,
        "mamba_d_head": "auto", "mamba_n_groups": spec.mamba_n_groups, "mamba_d_state": spec.mamba_d_state,
        "mamba_d_conv": spec.mamba_d_conv, "mamba_expand": spec.mamba_expand,
        "mamba_chunk_size": spec.mamba_chunk_size, "mamba_conv_bias": True, "mamba_proj_bias": False,
        "time_step_limit": [0.0, {"__float__": "Infinity"}], "attention_bias": False, "tie_word_embeddings": True,
    }  # fmt: skip


FAMILY = Family(
    name="granitemoehybrid", architecture="GraniteMoeHybridForCausalLM", model_type="granitemoehybrid",
    parse=parse, source_of=source_of, tiny_hf_config=tiny_hf_config, ignored=(r"rotary_emb\.inv_freq$",),
    renames=(  # the names transformers uses in memory, for checkpoints saved from them
        (r"block_sparse_moe\.experts\.gate_up_proj$", "block_sparse_moe.input_linear.weight"),
        (r"block_sparse_moe\.experts\.down_proj$", "block_sparse_moe.output_linear.weight"),
        (r"block_sparse_moe\.router\.weight$", "block_sparse_moe.router.layer.weight"),
    ),
)  # fmt: skip
