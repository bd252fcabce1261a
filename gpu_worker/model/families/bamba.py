"""Bamba (`BambaForCausalLM`): each decoder layer is a mixer (Mamba2, or attention with partial RoPE)
then a SwiGLU MLP, so layer L is our blocks 2L and 2L+1."""

from __future__ import annotations

from typing import Any

from gpu_worker.model.config import BlockKind, ModelConfig
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

TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.final_layernorm.weight",
             "lm_head.weight": "lm_head.weight"}  # fmt: skip


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
    attn = [int(i) for i in (raw.get("attn_layer_indices") or ())]
    outside = [i for i in attn if not 0 <= i < n_layers]
    if outside:
        raise InvalidArgumentError(
            f"{source}: attn_layer_indices {outside} are outside [0, num_hidden_layers={n_layers})"
        )
    blocks: list[BlockKind] = []
    for i in range(n_layers):
        blocks += ["attention" if i in attn else "mamba", "mlp"]
    head_dim = hidden // n_heads if hidden % n_heads == 0 else 0
    if not head_dim:
        raise InvalidArgumentError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={n_heads}")
    rotary_dim, theta = rope_fields(get, head_dim, 0.5)
    t_min, t_max = get.time_step_limit("time_step_limit")
    return ModelConfig(
        architecture="BambaForCausalLM",
        vocab_size=get.integer("vocab_size"),
        hidden_size=hidden,
        blocks=tuple(blocks),
        num_attention_heads=n_heads,
        num_key_value_heads=get.integer("num_key_value_heads", default=n_heads),
        head_dim=head_dim,
        attention_scale=head_dim**-0.5,
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
        intermediate_size=get.integer("intermediate_size"),
        mlp_activation="swiglu",
        mlp_bias=get.flag("mlp_bias", default=False),
        moe=None,
        rms_norm_eps=get.number("rms_norm_eps", default=1e-5),
        tie_word_embeddings=get.flag("tie_word_embeddings", default=False),
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
        return Source((layer + ("input_layernorm.weight" if block % 2 == 0 else "pre_ff_layernorm.weight"),))
    rest = rest.removeprefix("mixer.")
    kind = config.blocks[block]
    if kind == "mlp":
        if rest.startswith("up_proj."):  # our fused [gate; up] is two checkpoint tensors
            suffix = rest.removeprefix("up_proj.")
            return Source((f"{layer}feed_forward.gate_proj.{suffix}", f"{layer}feed_forward.up_proj.{suffix}"), "cat")
        return Source((f"{layer}feed_forward.{rest}",))
    return Source((layer + ("mamba." if kind == "mamba" else "self_attn.") + rest,))


def tiny_hf_config(spec: SpecLike) -> dict[str, Any]:
    """config.json contents, in the layout transformers 5.x writes."""
    return {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers, "attn_layer_indices": list(spec.attn_layer_indices),
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
        "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "max_position_embeddings": 262144, "mamba_n_heads": spec.mamba_n_heads,
        "mamba_d_head": spec.mamba_expand * spec.hidden_size // spec.mamba_n_heads,
        "mamba_n_groups": spec.mamba_n_groups, "mamba_d_state": spec.mamba_d_state, "mamba_d_conv": spec.mamba_d_conv,
        "mamba_expand": spec.mamba_expand, "mamba_chunk_size": spec.mamba_chunk_size, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "time_step_limit": [0.0, {"__float__": "Infinity"}], "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False,
    }  # fmt: skip


FAMILY = Family(
    name="bamba", architecture="BambaForCausalLM", model_type="bamba", parse=parse, source_of=source_of,
    tiny_hf_config=tiny_hf_config, ignored=(r"rotary_emb\.inv_freq$",),
)  # fmt: skip
