"""Nemotron-H (`NemotronHForCausalLM`): every layer is one residual block whose mixer is Mamba2 (with a
grouped gated RMS norm), attention without positional embedding, a relu² MLP, or an MoE (sigmoid
group-limited routing with a correction bias, relu² experts, a relu² shared expert). Layer L is our
block L. A checkpoint with multi-token-prediction layers (`num_nextn_predict_layers` 1, `mtp.layers.i` for
each letter of `mtp_hybrid_override_pattern`) has them served as the MTP head (gpu_worker.model.model.MtpHead):
layer 0 also holds the fusion (`enorm`, `hnorm`, `eh_proj`), the last one `final_layernorm`; the embedding
and the LM head are the model's. With `num_nextn_predict_layers` 0 any `mtp.*` tensors are ignored."""

from __future__ import annotations

import math
from typing import Any

from gpu_worker.model.config import BlockKind, ModelConfig, MoEConfig
from gpu_worker.model.families.base import Family, Getter, Source, SpecLike, split_block_name
from hybridserve.errors import InvalidArgumentError

LAYER_TYPES: dict[str, BlockKind] = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp",
                                     "moe": "moe", "mamba": "mamba", "attention": "attention"}  # fmt: skip
PATTERN: dict[str, BlockKind] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern
TOP_LEVEL = {"embed.weight": "backbone.embeddings.weight", "final_norm.weight": "backbone.norm_f.weight",
             "lm_head.weight": "lm_head.weight"}  # fmt: skip
MOE_NAMES = {"router.weight": "gate.weight", "router.bias": "gate.e_score_correction_bias"}


def _blocks(get: Getter) -> tuple[BlockKind, ...]:
    types = get.raw.get("layers_block_type") or get.raw.get("layer_types")
    if types:
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise InvalidArgumentError(f"{get.source}: layers_block_type {unknown} are not supported "
                                       f"(supported: {', '.join(LAYER_TYPES)})")  # fmt: skip
        return tuple(LAYER_TYPES[t] for t in types)
    return _pattern(get, "hybrid_override_pattern", "needs layers_block_type (a list) or hybrid_override_pattern "
                    "(a string of M, *, -, E)", "M (Mamba2), * (attention), - (MLP), E (MoE)")  # fmt: skip


def _pattern(get: Getter, key: str, missing: str, supported: str) -> tuple[BlockKind, ...]:
    """The block kinds a pattern string (one letter a layer: PATTERN) names; `missing` and `supported`
    word the errors."""
    pattern = get.raw.get(key)
    if not isinstance(pattern, str) or not pattern:
        raise InvalidArgumentError(f"{get.source}: {missing}")
    unknown = sorted(set(pattern) - set(PATTERN))
    if unknown:
        raise InvalidArgumentError(f"{get.source}: {key} has {unknown}; supported: {supported}")
    return tuple(PATTERN[c] for c in pattern)


def _mtp_blocks(get: Getter) -> tuple[BlockKind, ...]:
    layers = get.integer("num_nextn_predict_layers", default=0)
    if layers == 0:
        return ()
    if layers != 1:
        raise InvalidArgumentError(f"{get.source}: num_nextn_predict_layers={layers} is not supported (0 or 1)")
    return _pattern(get, "mtp_hybrid_override_pattern", "num_nextn_predict_layers 1 needs "
                    "mtp_hybrid_override_pattern (a string of *, -, E)", "* (attention), - (MLP), E (MoE)")  # fmt: skip


def _moe(get: Getter) -> MoEConfig:
    if get.raw.get("moe_latent_size") is not None:
        raise InvalidArgumentError(f"{get.source}: moe_latent_size={get.raw['moe_latent_size']} (latent MoE "
                                   f"projections) is not supported; only moe_latent_size null")  # fmt: skip
    return MoEConfig(
        num_experts=get.integer("n_routed_experts", "num_local_experts", default=8),
        top_k=get.integer("num_experts_per_tok", default=2),
        intermediate_size=get.integer("moe_intermediate_size", default=7688),
        activation="relu2",
        router="sigmoid_grouped",
        shared_intermediate_size=get.integer("moe_shared_expert_intermediate_size", default=7688),
        shared_activation="relu2",
        shared_bias=get.flag("mlp_bias", default=False),
        n_group=get.integer("n_group", default=1),
        topk_group=get.integer("topk_group", default=1),
        norm_topk_prob=get.flag("norm_topk_prob", default=True),
        routed_scaling_factor=get.number("routed_scaling_factor", default=1.0),
    )


def parse(raw: dict[str, Any], source: str) -> ModelConfig:
    get = Getter(raw, source)
    get.require("mlp_hidden_act", ("relu2",), "relu2")
    get.require("mamba_hidden_act", ("silu",), "silu")
    blocks = _blocks(get)
    mtp = _mtp_blocks(get)
    n_heads = get.integer("num_attention_heads", default=32)
    head_dim = get.integer("head_dim", "attention_head_dim", default=128)
    return ModelConfig(
        architecture="NemotronHForCausalLM",
        vocab_size=get.integer("vocab_size"),
        hidden_size=get.integer("hidden_size"),
        blocks=blocks,
        num_attention_heads=n_heads,
        num_key_value_heads=get.integer("num_key_value_heads", default=n_heads),
        head_dim=head_dim,
        attention_scale=head_dim**-0.5,
        rotary_dim=0,
        rope_theta=10000.0,
        attention_bias=False,
        mamba_n_heads=get.integer("mamba_num_heads", default=128),
        mamba_d_head=get.integer("mamba_head_dim", default=64),
        mamba_n_groups=get.integer("n_groups", "mamba_n_groups", default=8),
        mamba_d_state=get.integer("ssm_state_size", default=128),
        mamba_d_conv=get.integer("conv_kernel", "mamba_d_conv", default=4),
        mamba_chunk_size=get.integer("chunk_size", "mamba_chunk_size", default=128),
        mamba_conv_bias=get.flag("use_conv_bias", "mamba_conv_bias", default=True),
        mamba_proj_bias=get.flag("use_bias", default=False),
        # The mixer clamps dt to [time_step_min, inf); time_step_limit itself is not read by the reference.
        time_step_min=get.number("time_step_min", "mamba_dt_min", default=0.001),
        time_step_max=math.inf,
        intermediate_size=get.integer("intermediate_size", default=21504) if "mlp" in blocks + mtp else 0,
        mlp_activation="relu2",
        mlp_bias=get.flag("mlp_bias", default=False),
        moe=_moe(get) if "moe" in blocks + mtp else None,
        rms_norm_eps=get.number("layer_norm_epsilon", "rms_norm_eps", default=1e-5),
        tie_word_embeddings=get.flag("tie_word_embeddings", default=False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=get.eos_ids(),
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=get.integer("max_position_embeddings", default=0),
        mtp_blocks=mtp,
    )


MTP_FUSION = {"mtp.enorm.weight": "enorm.weight", "mtp.hnorm.weight": "hnorm.weight",
              "mtp.eh_proj.weight": "eh_proj.weight"}  # fmt: skip


def source_of(name: str, config: ModelConfig) -> Source:
    if name in TOP_LEVEL:
        return Source((TOP_LEVEL[name],))
    if name in MTP_FUSION:
        return Source(("mtp.layers.0." + MTP_FUSION[name],))
    if name == "mtp.final_norm.weight":
        return Source((f"mtp.layers.{len(config.mtp_blocks) - 1}.final_layernorm.weight",))
    if name.startswith("mtp."):
        block, rest = split_block_name(name.removeprefix("mtp."))
        return _block_source(f"mtp.layers.{block}.", config.mtp_blocks[block], rest, config)
    block, rest = split_block_name(name)
    return _block_source(f"backbone.layers.{block}.", config.blocks[block], rest, config)


def _block_source(layer: str, kind: BlockKind, rest: str, config: ModelConfig) -> Source:
    if rest == "norm.weight":
        return Source((layer + "norm.weight",))
    rest = rest.removeprefix("mixer.")
    if kind == "moe":
        if rest in ("experts_up", "experts_down"):
            assert config.moe is not None
            proj = "up_proj" if rest == "experts_up" else "down_proj"
            return Source(
                tuple(f"{layer}mixer.experts.{e}.{proj}.weight" for e in range(config.moe.num_experts)), "stack"
            )
        if rest.startswith("shared."):
            return Source((layer + "mixer.shared_experts." + rest.removeprefix("shared."),))
        return Source((layer + "mixer." + MOE_NAMES[rest],))
    return Source((layer + "mixer." + rest,))


def tiny_hf_config(spec: SpecLike) -> dict[str, Any]:
    """A small Nemotron-H config.json: a Mamba2 layer, then attention or the MLP/MoE layer, repeating."""
    ffn = "E" if spec.moe else "-"
    pattern = "".join("*" if i in spec.attn_layer_indices else ("M" if i % 2 == 0 else ffn)
                      for i in range(spec.num_hidden_layers))  # fmt: skip
    head_dim = spec.hidden_size // spec.num_attention_heads
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "hybrid_override_pattern": pattern,
        "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "head_dim": head_dim,
        "intermediate_size": spec.intermediate_size, "mlp_hidden_act": "relu2", "mlp_bias": False,
        "mamba_num_heads": spec.mamba_n_heads,
        "mamba_head_dim": spec.mamba_expand * spec.hidden_size // spec.mamba_n_heads, "mamba_hidden_act": "silu",
        "ssm_state_size": spec.mamba_d_state, "n_groups": spec.mamba_n_groups, "conv_kernel": spec.mamba_d_conv,
        "expand": spec.mamba_expand, "chunk_size": spec.mamba_chunk_size, "use_conv_bias": True, "use_bias": False,
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "n_routed_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.intermediate_size // 2,
        "moe_shared_expert_intermediate_size": spec.intermediate_size,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 8192,
        "num_nextn_predict_layers": 1 if spec.mtp else 0,
    } | ({"mtp_hybrid_override_pattern": "*" + ffn} if spec.mtp else {})  # fmt: skip


FAMILY = Family(
    name="nemotron_h", architecture="NemotronHForCausalLM", model_type="nemotron_h", parse=parse,
    source_of=source_of, tiny_hf_config=tiny_hf_config,
    ignored=(r"rotary_emb\.inv_freq$",), head_prefix="mtp.",
    renames=((r"^model\.", "backbone."),),  # transformers' in-memory prefix
)  # fmt: skip
