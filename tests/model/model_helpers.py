"""Shared helpers for the model tests: tiny random HF checkpoints of every family and a runner driver."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import BambaConfig as HFBambaConfig
from transformers import BambaForCausalLM as HFBamba
from transformers import (
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PreTrainedModel,
)

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny random checkpoint."""

    seed: int = 0
    vocab_size: int = 97
    hidden_size: int = 64
    intermediate_size: int = 96
    num_hidden_layers: int = 4
    attn_layer_indices: tuple[int, ...] = (1,)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mamba_n_heads: int = 4
    mamba_n_groups: int = 2
    mamba_d_state: int = 8
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 8
    tie_word_embeddings: bool = False
    family: str = "bamba"  # bamba | granitemoehybrid | nemotron_h
    num_experts: int = 0  # 0: dense
    top_k: int = 2
    n_group: int = 1  # Nemotron-H expert groups (routing picks the best topk_group of them)
    topk_group: int = 1
    rope: bool = False  # Granite: position_embedding_type "rope" (else none)
    router_scale: float = 4.0  # router weights are scaled up so top-k margins are clear


SPECS = {
    "gqa_groups2": TinySpec(),
    "mha_1group": TinySpec(
        seed=1, num_key_value_heads=4, mamba_n_groups=1, mamba_chunk_size=16, attn_layer_indices=(0, 3),
        mamba_d_state=16, hidden_size=32, mamba_n_heads=8, tie_word_embeddings=True,
    ),
    "conv2_chunk5": TinySpec(
        seed=2, num_hidden_layers=3, attn_layer_indices=(2,), num_attention_heads=2, num_key_value_heads=1,
        mamba_d_conv=2, mamba_chunk_size=5, mamba_n_groups=4, mamba_n_heads=4,
    ),
    "granite_dense": TinySpec(seed=3, family="granitemoehybrid", attn_layer_indices=(1,), rope=True),
    "granite_moe": TinySpec(
        seed=4, family="granitemoehybrid", num_hidden_layers=3, attn_layer_indices=(2,), num_experts=4,
        tie_word_embeddings=True, mamba_chunk_size=5,
    ),
    "nemotron_dense": TinySpec(seed=5, family="nemotron_h", num_hidden_layers=5, attn_layer_indices=(2,)),
    "nemotron_moe": TinySpec(
        seed=6, family="nemotron_h", num_hidden_layers=5, attn_layer_indices=(3,), num_experts=8, n_group=2,
        mamba_n_groups=1, mamba_chunk_size=16,
    ),
}  # fmt: skip
FAMILY_SPECS = ("gqa_groups2", "granite_dense", "granite_moe", "nemotron_dense", "nemotron_moe")  # one per family
MOE_SPECS = ("granite_moe", "nemotron_moe")


def _layer_kinds(spec: TinySpec) -> list[str]:
    """Nemotron-H: attention where asked, else Mamba2 and the MLP (or MoE) layer in turn."""
    ffn = "moe" if spec.num_experts else "mlp"
    return ["full_attention" if i in spec.attn_layer_indices else ("linear_attention" if i % 2 == 0 else ffn)
            for i in range(spec.num_hidden_layers)]  # fmt: skip


def hf_config(spec: TinySpec):
    """The transformers config of a spec, per family."""
    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=0.1,
    )  # fmt: skip
    d_head = 2 * spec.hidden_size // spec.mamba_n_heads
    if spec.family == "granitemoehybrid":
        return GraniteMoeHybridConfig(
            **common, num_hidden_layers=spec.num_hidden_layers, intermediate_size=spec.intermediate_size // 2,
            shared_intermediate_size=spec.intermediate_size,
            layer_types=["full_attention" if i in spec.attn_layer_indices else "linear_attention"
                         for i in range(spec.num_hidden_layers)],
            num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k, mamba_n_heads=spec.mamba_n_heads,
            mamba_d_head="auto", mamba_n_groups=spec.mamba_n_groups, mamba_d_state=spec.mamba_d_state,
            mamba_d_conv=spec.mamba_d_conv, mamba_expand=2, mamba_chunk_size=spec.mamba_chunk_size,
            position_embedding_type="rope" if spec.rope else None, embedding_multiplier=3.0,
            residual_multiplier=0.6, attention_multiplier=0.3, logits_scaling=1.7,
        )  # fmt: skip
    if spec.family == "nemotron_h":
        return NemotronHConfig(
            **common, layers_block_type=_layer_kinds(spec), head_dim=24, intermediate_size=spec.intermediate_size,
            mamba_num_heads=spec.mamba_n_heads, mamba_head_dim=d_head, ssm_state_size=spec.mamba_d_state,
            n_groups=spec.mamba_n_groups, conv_kernel=spec.mamba_d_conv, chunk_size=spec.mamba_chunk_size,
            n_routed_experts=max(spec.num_experts, 1), num_experts_per_tok=spec.top_k,
            moe_intermediate_size=spec.intermediate_size // 2, moe_shared_expert_intermediate_size=40,
            n_group=spec.n_group, topk_group=spec.topk_group, routed_scaling_factor=2.5,
            mlp_bias=spec.num_experts > 0,  # MLP and shared-expert biases in the MoE spec
        )  # fmt: skip
    return HFBambaConfig(
        **common, num_hidden_layers=spec.num_hidden_layers, intermediate_size=spec.intermediate_size,
        attn_layer_indices=list(spec.attn_layer_indices), mamba_n_heads=spec.mamba_n_heads, mamba_d_head=d_head,
        mamba_n_groups=spec.mamba_n_groups, mamba_d_state=spec.mamba_d_state, mamba_d_conv=spec.mamba_d_conv,
        mamba_expand=2, mamba_chunk_size=spec.mamba_chunk_size,
    )  # fmt: skip


def make_hf_model(spec: TinySpec) -> PreTrainedModel:
    """A float32 HF model with randomised dt_bias, A_log, D, conv bias and norm weights, and router
    weights scaled by `router_scale` (plus a random score correction) so top-k choices are clear."""
    torch.manual_seed(spec.seed)
    cls = {"bamba": HFBamba, "granitemoehybrid": GraniteMoeHybridForCausalLM, "nemotron_h": NemotronHForCausalLM}
    model = cls[spec.family](hf_config(spec)).eval()
    g = torch.Generator().manual_seed(spec.seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 1.0 - 1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 0.5))
            elif name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith(("router.weight", "gate.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 * spec.router_scale)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model


def save_hf_model(model: PreTrainedModel, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Reference logits at every position: [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def make_runner(path: Path, max_num_seqs: int = 8, page_size: int = 4, mtp_draft_tokens: int = 0) -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=page_size, max_num_seqs=max_num_seqs,
        num_checkpoint_slots=4, device="cpu", dtype="float32", mtp_draft_tokens=mtp_draft_tokens,
    )  # fmt: skip
    return ModelRunner.from_model_dir(path, cfg)


class Request:
    """Minimal per-request bookkeeping for driving a runner in tests (the engine's job in production)."""

    def __init__(self, runner: ModelRunner, token_ids: list[int]) -> None:
        self.runner = runner
        self.token_ids = list(token_ids)
        self.num_computed = 0
        self.slot = runner.state_pool.allocate_slot()
        self.page_ids: list[int] = []

    def chunk(self, num_tokens: int, save_checkpoint_id: int | None = None) -> SequenceChunk:
        """The next `num_tokens` tokens as a chunk, growing the page table to cover them."""
        end = self.num_computed + num_tokens
        need = self.runner.kv_pool.pages_for_tokens(end) - len(self.page_ids)
        if need > 0:
            self.page_ids += self.runner.kv_pool.allocate(need)
        chunk = SequenceChunk(
            token_ids=tuple(self.token_ids[self.num_computed : end]), start_pos=self.num_computed,
            page_ids=tuple(self.page_ids), state_slot=self.slot, save_checkpoint_id=save_checkpoint_id,
        )  # fmt: skip
        self.num_computed = end
        return chunk

    def release(self) -> None:
        self.runner.kv_pool.free(self.page_ids)
        self.runner.state_pool.free_slot(self.slot)


def run_schedule(runner: ModelRunner, token_ids: list[int], chunk_lens: list[int]) -> torch.Tensor:
    """Run one request through `chunk_lens` (summing to len(token_ids)); all-position logits [len, vocab]."""
    req = Request(runner, token_ids)
    outs = []
    for n in chunk_lens:
        out = runner.forward(Batch((req.chunk(n),), return_all_logits=True))
        assert out.all_logits is not None
        outs.append(out.all_logits[0])
    req.release()
    return torch.cat(outs)


MTP_SPECS = ("nemotron_dense", "nemotron_moe")  # the family whose checkpoints may carry an MTP head


def add_mtp_head(src: Path, dst: Path, train_steps: int = 0, seed: int = 0) -> Path:
    """A copy of the Nemotron-H checkpoint `src` in `dst` with a multi-token-prediction head
    (`num_nextn_predict_layers` 1, `mtp.layers.*`: attention, then the checkpoint's MLP or MoE kind), as
    `hybridserve init-model --mtp` writes one: seeded random, then trained `train_steps` steps on the
    model's own greedy continuations (hybridserve_cli.demo_model.mtp_head) so that its drafts are often
    accepted. transformers' Nemotron-H leaves the head's tensors unread."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from hybridserve_cli.demo_model.mtp_head import train_mtp_head
    from hybridserve_cli.init_model import random_weights

    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    kinds = raw.get("layers_block_type") or raw.get("layer_types") or list(raw.get("hybrid_override_pattern", ""))
    ffn = "E" if ("moe" in kinds or "E" in kinds) else "-"
    raw |= {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*" + ffn}
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(src / "model.safetensors"))
    head = {k: v for k, v in random_weights(raw, seed, 0.05).items() if k.startswith("mtp.")}
    save_file(tensors | head, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if train_steps:
        train_mtp_head(dst, train_steps, seed)
    return dst


SCAN_REL_TOL = 2e-6  # float32 rounding of another summation order of the SSD scan, relative to the largest value


def assert_scan_close(got: torch.Tensor, want: torch.Tensor, rel_tol: float = SCAN_REL_TOL) -> None:
    """Within `rel_tol` of the largest value of `want` (or absolutely, for values under 1)."""
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= rel_tol * scale


def scan_inputs(
    lengths: list[int], heads: int, groups: int, dt_scale: float, seed: int, p: int = 6, n: int = 5
) -> tuple[torch.Tensor, ...]:
    """Random SSD scan inputs of spans of `lengths` tokens: x [T, heads, p], dt [T, heads] in [0, dt_scale),
    A [heads] in (-8.5, -0.5], B/C [T, groups, n], D [heads], initial [spans, heads, p, n]."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(total, heads, p, generator=g)
    dt = torch.rand(total, heads, generator=g) * dt_scale
    A = -(torch.rand(heads, generator=g) * 8 + 0.5)
    B, C = torch.randn(total, groups, n, generator=g), torch.randn(total, groups, n, generator=g)
    D = torch.randn(heads, generator=g)
    initial = torch.randn(len(lengths), heads, p, n, generator=g)
    return x, dt, A, B, C, D, initial
