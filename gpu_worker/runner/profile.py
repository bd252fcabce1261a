"""The figures the pools are sized from (gpu_worker.runner.memory): the weights' bytes, the activation
budget, and the device's memory; and the bound that holds a step to the budget (`bound_step_memory`).

The activation budget is what the largest step the scheduler may plan needs beside the weights and the
pools: a chunk of `max_num_batched_tokens` prompt tokens at the end of the longest context
(`max_model_len`). Its parts:

    tokens      what grows with the step's tokens: the residual stream, the widest projection, the SSD
                scan's float32 chunk states (`step_token_bytes`)
    attention   the attention workspace: what one attention call's context-scaled temporaries (K/V
                gathers, scores) may hold. The attention layers keep to it: a chunk whose untiled
                attention would hold more runs in key tiles (gpu_worker.model.backends.cpu.tiled_attention).
                It is the untiled need at the longest context where that is smaller, else the tokens'
                part (at least MIN_ATTENTION_WORKSPACE_BYTES): the context never costs a step more than
                its tokens do (`attention_workspace_bytes`)
    index maps  what grows with the context outside attention: flat KV slots of a chunk's context, the
                decode rows' page tables and masks (`context_index_bytes`)
    logits      a full step's sequences' float32 logits [max_num_seqs, vocab] and the sampler's copy

On CUDA it is measured, as vLLM does: one dummy forward of that chunk (its context made of the same few
pages over and over: the pages' contents do not matter, their count would) over temporary pools, between
torch.cuda.reset_peak_memory_stats and max_memory_allocated; the peak above what was allocated before it,
with the logits, is the budget. Where it cannot be measured (CPU: no peak counter) it is estimated from
the shapes: ESTIMATE_SAFETY x the tokens' part, plus the workspace, the index maps and the logits.

After a step, memory it freed stays in the heap for the next (gpu_worker.runner.tuning.keep_freed_memory);
on CPU, once the heap holds more than the budget beyond what it held after the last such check, the rest
goes back to the OS (gpu_worker.runner.tuning.StepMemoryTrim)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.backends.cpu.tiled_attention import key_tile_tokens, untiled_bytes
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.context import ForwardContext
from gpu_worker.model.loader import LoadedModel
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.input_builder import build_inputs
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.memory import DeviceMemory, MemorySplit
from gpu_worker.runner.state_pool import MambaStatePool, state_shapes
from gpu_worker.runner.tuning import StepMemoryTrim
from hybridserve.errors import InvalidArgumentError

log = logging.getLogger("hybridserve.worker.memory")
FLOAT32_BYTES = 4
# The estimate's allowance for temporaries beside the tensors it counts (casts, norms' outputs, the
# allocator's rounding). A rule of thumb, not a measurement: where it matters (CUDA) the step is profiled.
ESTIMATE_SAFETY = 2
# The least attention workspace: a tile of a few thousand keys for a small model, so that its tiles do not
# run into Python's per-call cost.
MIN_ATTENTION_WORKSPACE_BYTES = 16 << 20


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (a tied tensor counted once)."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.numel():
            seen[tensor.data_ptr()] = max(seen.get(tensor.data_ptr(), 0), tensor.numel() * tensor.element_size())
    return sum(seen.values())


def logits_bytes(config: ModelConfig, max_num_seqs: int) -> int:
    """A full step's float32 logits and the sampler's working copy of them."""
    return 2 * max_num_seqs * config.vocab_size * FLOAT32_BYTES


def step_token_bytes(config: ModelConfig, num_tokens: int, dtype_bytes: int, scan_chunk_tokens: int = 0) -> int:
    """A step's activations that grow with its tokens, from the shapes. Per token, what one block holds at
    its peak: the residual stream and its normed copy, the widest projection output (Mamba in_proj, the MLP's
    fused gate and up, q/k/v, or the routed experts' rows), the SSD scan's float32 per-chunk state and decay
    rows (chunks of `scan_chunk_tokens`, 0 = the checkpoint's)."""
    c = config
    mamba_in = 2 * c.d_inner + 2 * c.mamba_n_groups * c.mamba_d_state + c.mamba_n_heads if c.num_mamba_layers else 0
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim if c.num_attention_layers else 0
    experts = 0
    if c.moe is not None:
        experts = c.moe.top_k * 2 * c.moe.intermediate_size + 2 * c.moe.shared_intermediate_size
    widest = max(mamba_in, qkv, 2 * c.intermediate_size, experts)
    scan = 0
    if c.num_mamba_layers:  # float32, per token: a chunk's state [heads, d_head, d_state] / chunk, decay [heads, chunk]
        chunk = scan_chunk_tokens or c.mamba_chunk_size
        scan = FLOAT32_BYTES * (c.d_inner * c.mamba_d_state // chunk + c.mamba_n_heads * chunk)
    return num_tokens * (dtype_bytes * (2 * c.hidden_size + widest) + scan)


def attention_workspace_bytes(
    config: ModelConfig, num_tokens: int, context_tokens: int, dtype_bytes: int, token_bytes: int
) -> int:
    """The attention workspace (module docstring): the untiled need of a `num_tokens` chunk at the end of a
    `context_tokens` context where that is smaller, else max(token_bytes, MIN_ATTENTION_WORKSPACE_BYTES)."""
    c = config
    if not c.num_attention_layers:
        return 0
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    need = untiled_bytes(num_tokens, max(context_tokens, num_tokens), heads, kv_heads, d, dtype_bytes)
    return min(need, max(token_bytes, MIN_ATTENTION_WORKSPACE_BYTES))


def context_index_bytes(context_tokens: int, max_num_seqs: int, page_size: int) -> int:
    """Index maps that grow with the context: a chunk's flat KV slots (int64 a token) and, for every decode
    row, its page table (int64 a page) and mask (a bool a token), padded to the longest context."""
    return 8 * context_tokens + max_num_seqs * (context_tokens + 8 * -(-context_tokens // page_size))


def estimate_activation_bytes(
    config: ModelConfig, num_tokens: int, max_num_seqs: int, dtype_bytes: int, context_tokens: int = 0,
    page_size: int = 16, scan_chunk_tokens: int = 0,
) -> int:  # fmt: skip
    """The budget from the shapes, where it cannot be measured (module docstring): ESTIMATE_SAFETY x the
    tokens' part (temporaries beside the tensors it counts), plus the attention workspace and the index maps
    of a `context_tokens` context (0 = the step's own tokens), plus the logits."""
    context = max(context_tokens, num_tokens)
    tokens = step_token_bytes(config, num_tokens, dtype_bytes, scan_chunk_tokens)
    workspace = attention_workspace_bytes(config, num_tokens, context, dtype_bytes, tokens)
    index = context_index_bytes(context, max_num_seqs, page_size)
    return ESTIMATE_SAFETY * tokens + workspace + index + logits_bytes(config, max_num_seqs)


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The device's memory now (after torch's cache is emptied), or None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total_bytes=int(total), free_bytes=int(free))


@dataclass(frozen=True, slots=True)
class ActivationBudget:
    """The activation budget of one runner (module docstring), fixed at start-up."""

    total_bytes: int  # what a worst-case step may hold beside the weights and the pools
    source: str  # how it was found: "profiled: ..." or "estimated from the shapes: ..."
    attention_workspace_bytes: int  # the part one attention call's context-scaled temporaries may hold
    key_tile_tokens: int  # keys per tile of a max_num_batched_tokens chunk's attention past the workspace
    context_tokens: int  # the longest context it was sized for

    def annotate(self, memory: MemorySplit) -> MemorySplit:
        """`memory` with this budget's figures (logged at start-up, reported by GetInfo)."""
        return replace(
            memory, activation_bytes=self.total_bytes, activation_source=self.source,
            attention_workspace_bytes=self.attention_workspace_bytes, attention_key_tile_tokens=self.key_tile_tokens,
            activation_context_tokens=self.context_tokens,
        )  # fmt: skip


def host_memory_bytes() -> int:
    """The memory this process's host gives it: MemTotal, or the cgroup's memory.max where lower; 0 where
    neither can be read."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


def activation_budget(
    loaded: LoadedModel, num_tokens: int, page_size: int, max_num_seqs: int, context_tokens: int = 0
) -> ActivationBudget:
    """The budget of a chunk of `num_tokens` at the end of `context_tokens` (0: the checkpoint's
    max_position_embeddings, else the chunk alone): profiled on CUDA, estimated elsewhere."""
    c = loaded.config
    context = max(num_tokens, context_tokens or c.max_position_embeddings)
    dtype_bytes = torch.empty(0, dtype=loaded.dtype).element_size()
    scan_chunk = scan_chunk_tokens(loaded)
    tokens = step_token_bytes(c, num_tokens, dtype_bytes, scan_chunk)
    workspace = attention_workspace_bytes(c, num_tokens, context, dtype_bytes, tokens)
    tile = 0
    if c.num_attention_layers:
        heads, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        tile = key_tile_tokens(workspace, num_tokens, heads, kvh, d, dtype_bytes)
    if loaded.device.type != "cuda":
        total = estimate_activation_bytes(c, num_tokens, max_num_seqs, dtype_bytes, context, page_size, scan_chunk)
        how = f"estimated from the shapes: a chunk of {num_tokens} tokens at the end of {context}"
        return ActivationBudget(total, how, workspace, tile, context)
    try:
        peak = profile_step_bytes(loaded, num_tokens, page_size, context)
    except torch.cuda.OutOfMemoryError:
        raise InvalidArgumentError(
            f"a step of {num_tokens} prompt tokens at the end of a {context}-token context does not fit in the"
            " device's memory beside the weights; lower --max-num-batched-tokens or --max-model-len"
        ) from None
    how = f"profiled: a chunk of {num_tokens} tokens at the end of {context}"
    return ActivationBudget(peak + logits_bytes(c, max_num_seqs), how, workspace, tile, context)


def activation_bytes(loaded: LoadedModel, num_tokens: int, page_size: int, max_num_seqs: int) -> tuple[int, str]:
    """(bytes, how they were found) of `activation_budget` for a step's own tokens."""
    budget = activation_budget(loaded, num_tokens, page_size, max_num_seqs)
    return budget.total_bytes, budget.source


def scan_chunk_tokens(loaded: LoadedModel) -> int:
    """The SSD scan's chunk length the runner uses (shorter on CPU: gpu_worker.runner.runner)."""
    from gpu_worker.runner.runner import CPU_SCAN_CHUNK_TOKENS  # runner imports this module

    chunk = loaded.config.mamba_chunk_size
    return min(chunk, CPU_SCAN_CHUNK_TOKENS) if loaded.device.type == "cpu" else chunk


def bound_step_memory(model: torch.nn.Module, memory: MemorySplit, device: torch.device) -> StepMemoryTrim | None:
    """Holds the model's steps to the budget: every attention layer keeps its context-scaled temporaries
    within the attention workspace; on CPU, after each step with prefill chunks, freed memory beyond the
    budget goes back to the OS (a forward hook; returned). Call once, when the runner is built."""
    if memory.attention_workspace_bytes > 0:
        for module in model.modules():
            if isinstance(module, PagedAttention):
                module.workspace_bytes = memory.attention_workspace_bytes
    if device.type != "cpu":
        return None
    trim = StepMemoryTrim(memory.activation_bytes)

    def after_forward(module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
        ctx = args[1]
        if isinstance(ctx, ForwardContext) and ctx.prefills:
            trim.after_step()

    model.register_forward_hook(after_forward)
    return trim


def profile_step_bytes(loaded: LoadedModel, num_tokens: int, page_size: int, context_tokens: int = 0) -> int:
    """The peak CUDA memory one forward of a `num_tokens`-token chunk at the end of a `context_tokens`
    context allocates beyond what was allocated before it (the weights and its temporary pools), with the
    last token's logits."""
    device = loaded.device
    with dummy_step(loaded, num_tokens, page_size, context_tokens) as run:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)


@contextlib.contextmanager
def dummy_step(
    loaded: LoadedModel, num_tokens: int, page_size: int, context_tokens: int = 0
) -> Iterator[Callable[[], torch.Tensor]]:
    """Temporary pools for one `num_tokens`-token chunk at the end of a `context_tokens` context (0 = a
    fresh prompt) and the forward of it (returning its last token's logits [1, vocab]), to be run inside
    the block; the pools go when it ends. The context's page table repeats the chunk's pages: the
    activations depend on how many keys there are, not on what they hold."""
    c, device = loaded.config, loaded.device
    start = max(0, context_tokens - num_tokens)
    num_pages = -(-num_tokens // page_size) + 1  # the chunk's pages, one more where it starts mid-page
    kv = KVPagePool(num_pages, page_size, c.num_attention_layers, c.num_key_value_heads, c.head_dim, loaded.dtype,
                    device)  # fmt: skip
    states = MambaStatePool(1, 0, c.num_mamba_layers, *state_shapes(c), loaded.dtype, device)
    tokens = tuple(i % c.vocab_size for i in range(num_tokens))
    table = tuple(i % num_pages for i in range(-(-(start + num_tokens) // page_size)))
    packed = build_inputs(Batch((SequenceChunk(tokens, start, table, 0),)), page_size, 1, device)
    held = [(kv, states, packed)]  # emptied at the end: `run` may outlive the block
    del kv, states, packed

    @torch.inference_mode()
    def run() -> torch.Tensor:
        pool, slots, inputs = held[0]
        hidden = loaded.model(inputs.input_ids, inputs.ctx, pool.layer_caches(), slots.layer_states())
        return loaded.model.compute_logits(hidden.index_select(0, inputs.last_index))

    try:
        yield run
    finally:
        held.clear()
