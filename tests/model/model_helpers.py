"""Shared helpers for the model tests: tiny random HF Bamba checkpoints and a runner driver."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import BambaConfig as HFBambaConfig
from transformers import BambaForCausalLM as HFBamba

from gpu_worker.batch import Batch, SequenceChunk
from gpu_worker.runner import ModelRunner, RunnerConfig


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
}  # fmt: skip


def make_hf_model(spec: TinySpec) -> HFBamba:
    """A float32 HF Bamba with randomised dt_bias, A_log, D, conv bias and norm weights."""
    torch.manual_seed(spec.seed)
    cfg = HFBambaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, attn_layer_indices=list(spec.attn_layer_indices),
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        mamba_n_heads=spec.mamba_n_heads, mamba_d_head=2 * spec.hidden_size // spec.mamba_n_heads,
        mamba_n_groups=spec.mamba_n_groups, mamba_d_state=spec.mamba_d_state, mamba_d_conv=spec.mamba_d_conv,
        mamba_expand=2, mamba_chunk_size=spec.mamba_chunk_size, tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=0.1,
    )  # fmt: skip
    model = HFBamba(cfg).eval()
    g = torch.Generator().manual_seed(spec.seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mamba.dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 1.0 - 1.0)
            elif name.endswith("mamba.A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 0.5))
            elif name.endswith("mamba.D"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def save_hf_model(model: HFBamba, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(model: HFBamba, token_ids: list[int]) -> torch.Tensor:
    """Reference logits at every position: [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def make_runner(path: Path, max_num_seqs: int = 8, page_size: int = 4) -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=page_size, max_num_seqs=max_num_seqs,
        num_checkpoint_slots=4, device="cpu", dtype="float32",
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
