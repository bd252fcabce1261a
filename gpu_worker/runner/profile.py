"""The figures the pools are sized from (gpu_worker.runner.memory): the weights' bytes, the activation
budget, and the device's memory.

The activation budget is what the largest step the scheduler may plan (`max_num_batched_tokens` prefill
tokens) needs beside the weights and the pools. On CUDA it is measured, as vLLM does: one dummy forward of
that many prompt tokens over temporary pools, between torch.cuda.reset_peak_memory_stats and
max_memory_allocated; the peak above what was allocated before it is the budget. Where it cannot be
measured (CPU: no peak counter) it is estimated from the shapes (`estimate_activation_bytes`). The logits
of a full step's sequences (float32, [max_num_seqs, vocab], plus the sampler's copy) are added to either:
the profiled step has one sequence, the longest context for attention and the scan."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.loader import LoadedModel
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.input_builder import build_inputs
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.memory import DeviceMemory
from gpu_worker.runner.state_pool import MambaStatePool, state_shapes
from hybridserve.errors import InvalidArgumentError

log = logging.getLogger("hybridserve.worker.memory")
FLOAT32_BYTES = 4
# The estimate's allowance for temporaries beside the tensors it counts (casts, norms' outputs, the
# allocator's rounding). A rule of thumb, not a measurement: where it matters (CUDA) the step is profiled.
ESTIMATE_SAFETY = 2


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


def estimate_activation_bytes(config: ModelConfig, num_tokens: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """A step's activations from the shapes, where they cannot be measured. Per token, what one block holds at
    its peak: the residual stream and its normed copy, the widest projection output (Mamba in_proj, the MLP's
    fused gate and up, q/k/v, or the routed experts' rows), the SSD scan's float32 per-chunk state and decay
    rows; times ESTIMATE_SAFETY for temporaries, plus the logits."""
    c = config
    mamba_in = 2 * c.d_inner + 2 * c.mamba_n_groups * c.mamba_d_state + c.mamba_n_heads if c.num_mamba_layers else 0
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim if c.num_attention_layers else 0
    experts = 0
    if c.moe is not None:
        experts = c.moe.top_k * 2 * c.moe.intermediate_size + 2 * c.moe.shared_intermediate_size
    widest = max(mamba_in, qkv, 2 * c.intermediate_size, experts)
    scan = 0
    if c.num_mamba_layers:  # float32, per token: a chunk's state [heads, d_head, d_state] / chunk, decay [heads, chunk]
        chunk = c.mamba_chunk_size
        scan = FLOAT32_BYTES * (c.d_inner * c.mamba_d_state // chunk + c.mamba_n_heads * chunk)
    per_token = dtype_bytes * (2 * c.hidden_size + widest) + scan
    return ESTIMATE_SAFETY * num_tokens * per_token + logits_bytes(c, max_num_seqs)


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The device's memory now (after torch's cache is emptied), or None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total_bytes=int(total), free_bytes=int(free))


def activation_bytes(loaded: LoadedModel, num_tokens: int, page_size: int, max_num_seqs: int) -> tuple[int, str]:
    """(bytes, how they were found): profiled on CUDA, estimated elsewhere."""
    c = loaded.config
    if loaded.device.type != "cuda":
        dtype_bytes = torch.empty(0, dtype=loaded.dtype).element_size()
        return estimate_activation_bytes(c, num_tokens, max_num_seqs, dtype_bytes), "estimated from the shapes"
    try:
        peak = profile_step_bytes(loaded, num_tokens, page_size)
    except torch.cuda.OutOfMemoryError:
        raise InvalidArgumentError(
            f"a step of {num_tokens} prompt tokens does not fit in the device's memory beside the weights; lower"
            " --max-num-batched-tokens"
        ) from None
    return peak + logits_bytes(c, max_num_seqs), f"profiled: a step of {num_tokens} prompt tokens"


def profile_step_bytes(loaded: LoadedModel, num_tokens: int, page_size: int) -> int:
    """The peak CUDA memory one forward of a `num_tokens`-token prompt allocates beyond what was allocated
    before it (the weights and its temporary pools), with the last token's logits."""
    device = loaded.device
    with dummy_step(loaded, num_tokens, page_size) as run:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)


@contextlib.contextmanager
def dummy_step(loaded: LoadedModel, num_tokens: int, page_size: int) -> Iterator[Callable[[], torch.Tensor]]:
    """Temporary pools for one `num_tokens`-token prompt and the forward of it (returning its last token's
    logits [1, vocab]), to be run inside the block; the pools go when it ends."""
    c, device = loaded.config, loaded.device
    num_pages = -(-num_tokens // page_size)
    kv = KVPagePool(num_pages, page_size, c.num_attention_layers, c.num_key_value_heads, c.head_dim, loaded.dtype,
                    device)  # fmt: skip
    states = MambaStatePool(1, 0, c.num_mamba_layers, *state_shapes(c), loaded.dtype, device)
    tokens = tuple(i % c.vocab_size for i in range(num_tokens))
    packed = build_inputs(Batch((SequenceChunk(tokens, 0, tuple(range(num_pages)), 0),)), page_size, 1, device)
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
