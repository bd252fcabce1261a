"""How much memory the pools get, and how it is split among KV pages, Mamba state slots and checkpoints.

Pure arithmetic on byte counts (no torch): the runner measures the figures (gpu_worker.runner.profile)
and hands them in; tests hand in a stand-in device's.

The budget, one of two ways:
    explicit   `--memory-budget-mb` (the CPU default, and an override anywhere): the pools get that.
    device     on CUDA, as vLLM sizes its KV cache: the process may use `utilization` of the device's
               total memory; the weights, the activation budget (the peak of a profiled worst-case step)
               and what else the device holds (the CUDA context, other processes: total - free - weights
               when the pools are sized) come off it, and the rest goes to the pools:
                   budget = total * utilization - weights - activations - other
               The part of the device not utilised, (1 - utilization) * total, is headroom for what is
               not profiled (CUDA graphs, allocator fragmentation).

The split of a budget: `max_num_seqs` live state slots (and speculation's draft rows), then the
checkpoints (`num_checkpoint_slots`, or as many as fit in `checkpoint_memory_bytes`), then whole KV
pages of what is left. A model without
attention layers gets PAGES_WITHOUT_ATTENTION pages of 0 bytes (page ids still count tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.errors import InvalidArgumentError

PAGES_WITHOUT_ATTENTION = 1 << 16
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """An accelerator's memory, as torch.cuda.mem_get_info reports it."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free when the pools are sized: after the weights are loaded and the profile ran


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What one unit of each pool costs, and how many of the fixed ones are asked for."""

    kv_bytes_per_token: int  # every attention layer's K and V of one token; 0 = no attention layers
    kv_page_size_tokens: int  # tokens per KV page
    state_bytes_per_slot: int  # every Mamba layer's conv and SSM state of one sequence
    max_num_seqs: int  # live state slots
    num_checkpoint_slots: int  # checkpoints, unless checkpoint_memory_bytes is set
    checkpoint_memory_bytes: int = 0  # when > 0: as many checkpoints as fit in it
    num_draft_rows: int = 0  # state rows speculation keeps its per-position states in (RunnerConfig.num_draft_rows)


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """The pools' sizes and where their memory came from (logged at start-up, reported by GetInfo)."""

    budget_bytes: int  # for the three pools together
    source: str  # how the budget was set, e.g. "gpu-memory-utilization 0.90 of 139.8 GiB"
    weights_bytes: int  # the model's parameters and buffers
    activation_bytes: int  # the activation budget: a worst-case step's peak (profiled or estimated)
    num_kv_pages: int
    kv_pool_bytes: int
    num_state_slots: int  # live slots (max_num_seqs)
    state_pool_bytes: int
    num_checkpoint_slots: int
    checkpoint_pool_bytes: int
    device_total_bytes: int = 0  # the device's memory when sized from it; 0 for an explicit budget
    activation_source: str = ""  # how the activation budget was found ("profiled: ...", "estimated ...")
    attention_workspace_bytes: int = 0  # the part of it one attention call's context-scaled temporaries may hold
    attention_key_tile_tokens: int = 0  # keys per tile of a longest chunk's attention past the workspace
    activation_context_tokens: int = 0  # the longest context the activation budget was sized for
    num_draft_rows: int = 0  # speculation's state rows, counted in state_pool_bytes

    def describe(self) -> str:
        """One log line: the source, then each pool's count and size."""
        how = f", {self.activation_source}" if self.activation_source else ""
        if self.attention_workspace_bytes:
            how += (
                f"; attention workspace {size_text(self.attention_workspace_bytes)}, key tiles of"
                f" {self.attention_key_tile_tokens} tokens past it"
            )
        return (
            f"memory {size_text(self.budget_bytes)} for the pools ({self.source}; weights"
            f" {size_text(self.weights_bytes)}, activations {size_text(self.activation_bytes)}{how}):"
            f" KV {self.num_kv_pages} pages {size_text(self.kv_pool_bytes)}, state {self.num_state_slots} slots"
            f" {size_text(self.state_pool_bytes)}, checkpoints {self.num_checkpoint_slots}"
            f" {size_text(self.checkpoint_pool_bytes)}"
        )

    def activation_info(self) -> dict[str, Any]:
        """The activation budget's GetInfo fields (GetInfoResponse, generation.proto): ints and a string."""
        return {
            "activation_budget_source": self.activation_source,
            "attention_workspace_bytes": self.attention_workspace_bytes,
            "attention_key_tile_tokens": self.attention_key_tile_tokens,
            "activation_context_tokens": self.activation_context_tokens,
        }


def check_host_memory(memory: MemorySplit, num_model_processes: int, host_bytes: int) -> None:
    """Refuses (InvalidArgumentError, with the figures) a CPU worker whose weights, pools and activation
    budgets (one per model process: each runs its own steps; the weights and pools are shared) exceed the
    host's memory `host_bytes` (0 = unknown: no check). The activation budget holds a chunk at the end of
    the longest context, so a --max-model-len the memory cannot serve ends here."""
    if host_bytes <= 0:
        return
    activations = max(1, num_model_processes) * memory.activation_bytes
    need = memory.weights_bytes + memory.budget_bytes + activations
    if need > host_bytes:
        raise InvalidArgumentError(
            f"this worker needs {size_text(need)} and the host has {size_text(host_bytes)}: weights"
            f" {size_text(memory.weights_bytes)}, pools {size_text(memory.budget_bytes)} ({memory.source}),"
            f" activations {size_text(activations)} ({max(1, num_model_processes)} x"
            f" {size_text(memory.activation_bytes)}, {memory.activation_source}); lower --memory-budget-mb,"
            " --max-num-batched-tokens or --max-model-len, or run fewer --model-processes"
        )


def size_text(num_bytes: int) -> str:
    """A size for people: GiB from 1 GiB, MiB below."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def device_budget(
    device: DeviceMemory, utilization: float, weights_bytes: int, activation_bytes: int
) -> tuple[int, str]:
    """(budget bytes, source) for the pools from a device's memory (see the module docstring). Raises
    InvalidArgumentError, with the figures, when nothing is left for them."""
    if not 0.0 < utilization <= 1.0:
        raise InvalidArgumentError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    usable = int(device.total_bytes * utilization)
    source = f"gpu-memory-utilization {utilization:.2f} of {device.total_bytes / GIB:.1f} GiB"
    if weights_bytes + activation_bytes > usable:
        raise InvalidArgumentError(
            f"the weights ({weights_bytes / GIB:.2f} GiB) plus the activation budget ({activation_bytes / GIB:.2f}"
            f" GiB) exceed {source} ({usable / GIB:.2f} GiB); raise --gpu-memory-utilization, lower"
            " --max-num-batched-tokens or --max-model-len, or use a device with more memory"
        )
    other = max(0, device.total_bytes - device.free_bytes - weights_bytes)
    budget = usable - weights_bytes - activation_bytes - other
    if budget <= 0:
        raise InvalidArgumentError(
            f"nothing is left for the KV and state pools: {source} is {usable / GIB:.2f} GiB, of which the weights"
            f" take {weights_bytes / GIB:.2f}, the activations {activation_bytes / GIB:.2f} and other memory on the"
            f" device (its context, other processes) {other / GIB:.2f} GiB; free the device or raise"
            " --gpu-memory-utilization"
        )
    return budget, source


def split_budget(
    budget_bytes: int, shape: PoolShape, source: str, weights_bytes: int = 0, activation_bytes: int = 0,
    device_total_bytes: int = 0,
) -> MemorySplit:  # fmt: skip
    """The pools' sizes within `budget_bytes`: live state slots, checkpoints, then KV pages. Raises
    InvalidArgumentError when the state slots and checkpoints leave no room for one KV page."""
    state = shape.state_bytes_per_slot
    checkpoints = shape.num_checkpoint_slots
    if shape.checkpoint_memory_bytes > 0 and state > 0:  # an MB budget, LRU within it
        checkpoints = shape.checkpoint_memory_bytes // state
    state_bytes = state * (shape.max_num_seqs + shape.num_draft_rows)
    checkpoint_bytes = state * checkpoints
    page_bytes = shape.kv_bytes_per_token * shape.kv_page_size_tokens
    if page_bytes == 0:
        num_pages = PAGES_WITHOUT_ATTENTION
    else:
        num_pages = (budget_bytes - state_bytes - checkpoint_bytes) // page_bytes
        if num_pages < 1:
            raise InvalidArgumentError(
                f"the pools' memory (memory_budget_bytes={budget_bytes}, {source}) is too small: Mamba state for"
                f" {shape.max_num_seqs} slots + {shape.num_draft_rows} draft rows + {checkpoints} checkpoints needs"
                f" {state_bytes + checkpoint_bytes} bytes and one KV page {page_bytes}; raise the budget or lower"
                " max_num_seqs / num_checkpoint_slots"
            )
    return MemorySplit(
        budget_bytes=budget_bytes, source=source, weights_bytes=weights_bytes, activation_bytes=activation_bytes,
        num_kv_pages=num_pages, kv_pool_bytes=num_pages * page_bytes, num_state_slots=shape.max_num_seqs,
        state_pool_bytes=state_bytes, num_checkpoint_slots=checkpoints, checkpoint_pool_bytes=checkpoint_bytes,
        device_total_bytes=device_total_bytes, num_draft_rows=shape.num_draft_rows,
    )  # fmt: skip


def size_pools(
    shape: PoolShape,
    *,
    weights_bytes: int,
    activation_bytes: int,
    device: DeviceMemory | None = None,
    utilization: float = 0.9,
    budget_bytes: int = 0,
    budget_source: str = "--memory-budget-mb",
) -> MemorySplit:
    """The split for one worker. `budget_bytes` > 0 (`--memory-budget-mb`, or the CPU default, named by
    `budget_source`) wins; otherwise the budget comes from `device` at `utilization`. One must be given."""
    if budget_bytes > 0:
        return split_budget(budget_bytes, shape, budget_source, weights_bytes, activation_bytes)
    if device is None:
        raise InvalidArgumentError("no memory budget: give --memory-budget-mb (the pools' memory, MiB)")
    budget, source = device_budget(device, utilization, weights_bytes, activation_bytes)
    return split_budget(budget, shape, source, weights_bytes, activation_bytes, device.total_bytes)
