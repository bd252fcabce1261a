"""A checkpoint's multi-token-prediction head trained on the model's own greedy continuations
(`hybridserve init-model --mtp --mtp-train-steps N`), so that a tiny model's MTP drafts are accepted
often enough to show what speculation with the head does (tests, bench/bench_spec.py --method mtp).

The model generates greedy continuations of random prompts through the serving runner; its final
hidden states at every position come from one forward of each sequence; the head (and only the head:
the embedding and the LM head it shares stay fixed) learns to predict the token two ahead from the hidden
state at a position and the token after it, with Adam, through `dense_mtp_head`, the head computed
densely over a whole sequence (what gpu_worker.runner.mtp computes over pages)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.loader import checkpoint_tensors
from gpu_worker.model.model import Block, HybridForCausalLM
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import StepSampling
from gpu_worker.runner.settings import RunnerConfig


def dense_mtp_head(model: HybridForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP head (gpu_worker.model.model.MtpHead) over positions 0..n-1 at once, causal attention by
    hand: tokens [n] (each position's next token) and hidden [n, hidden] (the model's final hidden states
    there, or the head's own output) -> the head's output [n, hidden]."""
    head = model.mtp
    if head is None:
        raise ValueError("the model has no MTP head")
    x = head.eh_proj(torch.cat([head.enorm(model.embed(tokens)), head.hnorm(hidden)], dim=-1))
    n = len(tokens)
    causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).triu(1)
    for module in head.blocks:
        block = cast(Block, module)
        h = block.norm(x)
        if block.kind == "attention":
            att = cast(PagedAttention, block.mixer)
            q = att.q_proj(h).view(n, att.num_heads, att.head_dim).transpose(0, 1)
            k = att.k_proj(h).view(n, att.num_kv_heads, att.head_dim).transpose(0, 1)
            v = att.v_proj(h).view(n, att.num_kv_heads, att.head_dim).transpose(0, 1)
            k, v = k.repeat_interleave(att.group, 0), v.repeat_interleave(att.group, 0)
            scores = ((q @ k.transpose(1, 2)) * att.scale).masked_fill(causal, float("-inf"))
            h = att.o_proj((F.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, -1))
        else:
            h = block.mixer(h)
        x = x + h
    out: torch.Tensor = head.final_norm(x)
    return out


def _greedy(runner: ModelRunner, prompt: list[int], new_tokens: int) -> list[int]:
    """The prompt and the model's greedy continuation of it, through the runner."""
    pool, states = runner.kv_pool, runner.state_pool
    pages, slot = tuple(pool.allocate(pool.pages_for_tokens(len(prompt) + new_tokens))), states.allocate_slot()
    try:
        ids = list(prompt)
        chunk = SequenceChunk(tuple(prompt), 0, pages, slot)
        while len(ids) < len(prompt) + new_tokens:
            ids.append(runner.execute(Batch((chunk,)), StepSampling((0,))).token_ids[0])
            chunk = SequenceChunk((ids[-1],), len(ids) - 1, pages, slot)
        return ids
    finally:
        pool.free(list(pages))
        states.free_slot(slot)


def _hidden(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The model's final hidden states at every position of `ids`, from one forward."""
    pool, states = runner.kv_pool, runner.state_pool
    pages, slot = tuple(pool.allocate(pool.pages_for_tokens(len(ids)))), states.allocate_slot()
    try:
        out = runner.forward(Batch((SequenceChunk(tuple(ids), 0, pages, slot, mtp_drafts=0),)))
        assert out.hidden is not None
        return out.hidden.detach().clone()
    finally:
        pool.free(list(pages))
        states.free_slot(slot)


def train_mtp_head(
    root: Path, steps: int, seed: int = 0, sequences: int = 12, prompt_len: int = 12, new_tokens: int = 36,
    lr: float = 3e-3,
) -> float:  # fmt: skip
    """Trains the MTP head of the checkpoint in `root` in place (module docstring); returns the last
    training loss."""
    config = RunnerConfig(memory_budget_bytes=64 << 20, kv_page_size_tokens=16, max_num_seqs=2, device="cpu",
                          dtype="float32", mtp_draft_tokens=1, num_checkpoint_slots=0)  # fmt: skip
    runner = ModelRunner.from_model_dir(root, config)
    model = runner.model
    if model.mtp is None:
        raise ValueError(f"{root} has no MTP head (init-model --mtp writes one)")
    g = torch.Generator().manual_seed(seed)
    data: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(sequences):
        prompt = torch.randint(3, runner.config.vocab_size, (prompt_len,), generator=g).tolist()
        sequence = _greedy(runner, prompt, new_tokens)
        data.append((torch.tensor(sequence), _hidden(runner, sequence)))
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    loss = torch.zeros(())
    with torch.enable_grad():
        for step in range(steps):
            ids, hidden = data[step % len(data)]
            y = dense_mtp_head(model, ids[1:-1], hidden[:-2])  # position i: h_i and t_{i+1} -> t_{i+2}
            loss = F.cross_entropy(model.compute_logits(y), ids[2:])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    for p in params:
        p.requires_grad_(False)
    runner.close()
    head = {k: v.detach().clone().contiguous() for k, v in checkpoint_tensors(runner.loaded.family, runner.config,
            model).items() if k.startswith("mtp.")}  # fmt: skip
    path = root / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(path)).items()}  # off the file's map before it is rewritten
    save_file(tensors | head, str(path), metadata={"format": "pt"})
    return float(loss.detach())
