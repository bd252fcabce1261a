"""The pools' plan and the facts a runner exposes, shared by the in-process runner (gpu_worker.runner.runner)
and the model processes' (gpu_worker.runner.model_process).

Pool sizing (gpu_worker.runner.memory): the pools' memory is `memory_budget_bytes` when given (and on CPU,
CPU_MEMORY_BUDGET_BYTES by default), else on CUDA `gpu_memory_utilization` of the device less the weights
and the profiled activation budget (gpu_worker.runner.profile). The state pool gets `max_num_seqs` live
slots plus `num_checkpoint_slots` checkpoints; the rest becomes KV pages."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.loader import LoadedModel
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.memory import MemorySplit, PoolShape, size_pools
from gpu_worker.runner.profile import activation_budget, device_memory, weights_bytes
from gpu_worker.runner.protocol import PoolSet
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.shared_memory import Allocator
from gpu_worker.runner.state_pool import MambaStatePool, state_shapes
from hybridserve.errors import InvalidArgumentError

CPU_MEMORY_BUDGET_BYTES = 256 << 20  # the pools' memory on CPU unless --memory-budget-mb says otherwise


def kv_layers(model: ModelConfig, config: RunnerConfig) -> int:
    """Layers of the KV pool: the model's attention layers, and the MTP head's when it runs (their KV in
    the same pages, after the model's)."""
    return model.num_attention_layers + (model.num_mtp_attention_layers if config.mtp_draft_tokens else 0)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """The pools' sizes for a model and a config (the worker and its model process compute the same)."""

    loaded: LoadedModel
    config: RunnerConfig  # with num_checkpoint_slots resolved from the memory split
    kv_bytes_per_token: int
    state_bytes_per_request: int
    memory: MemorySplit

    @property
    def num_pages(self) -> int:
        return self.memory.num_kv_pages

    @property
    def num_kv_layers(self) -> int:
        return kv_layers(self.loaded.config, self.config)

    @classmethod
    def of(cls, loaded: LoadedModel, config: RunnerConfig) -> PoolPlan:
        """Sizes the pools (see gpu_worker.runner.memory); on CUDA this profiles a worst-case step first."""
        c = loaded.config
        if config.mtp_draft_tokens and loaded.model.mtp is None:
            raise InvalidArgumentError(
                f"--speculative-method mtp: {loaded.model_dir} has no multi-token-prediction layers "
                "(config.json num_nextn_predict_layers is 0); use --speculative-method ngram"
            )
        kv_bytes = KVPagePool.bytes_per_token(kv_layers(c, config), c.num_key_value_heads, c.head_dim, loaded.dtype)
        state_bytes = MambaStatePool.bytes_per_slot(c.num_mamba_layers, *state_shapes(c), loaded.dtype)
        shape = PoolShape(
            kv_bytes, config.kv_page_size_tokens, state_bytes, config.max_num_seqs, config.num_checkpoint_slots,
            config.checkpoint_memory_bytes, config.num_draft_rows,
        )  # fmt: skip
        activations = activation_budget(
            loaded, config.max_num_batched_tokens, config.kv_page_size_tokens, config.max_num_seqs, config.max_model_len
        )
        budget, source = config.memory_budget_bytes, "--memory-budget-mb"
        if not budget and loaded.device.type != "cuda":
            budget, source = CPU_MEMORY_BUDGET_BYTES, f"the CPU default {CPU_MEMORY_BUDGET_BYTES >> 20} MiB"
        memory = size_pools(
            shape, weights_bytes=weights_bytes(loaded.model), activation_bytes=activations.total_bytes,
            device=device_memory(loaded.device), utilization=config.gpu_memory_utilization, budget_bytes=budget,
            budget_source=source,
        )  # fmt: skip
        memory = activations.annotate(memory)
        config = replace(config, num_checkpoint_slots=memory.num_checkpoint_slots)
        return cls(loaded, config, kv_bytes, state_bytes, memory)

    def build(self, alloc: Allocator | None = None) -> tuple[KVPagePool, MambaStatePool]:
        c, cfg, loaded = self.loaded.config, self.config, self.loaded
        kv_pool = KVPagePool(
            self.num_pages, cfg.kv_page_size_tokens, self.num_kv_layers, c.num_key_value_heads, c.head_dim,
            loaded.dtype, loaded.device, alloc,
        )  # fmt: skip
        state_pool = MambaStatePool(
            cfg.max_num_seqs, cfg.num_checkpoint_slots, c.num_mamba_layers, *state_shapes(c), loaded.dtype,
            loaded.device, alloc, cfg.num_draft_rows,
        )  # fmt: skip
        return kv_pool, state_pool


class RunnerFacts:
    """What the engine, the service and the prefix cache read of a runner (gpu_worker.runner.protocol.Runner),
    from its loaded model, its config and its pools; shared by the in-process runner and the model
    process's (gpu_worker.runner.model_process)."""

    loaded: LoadedModel
    device: torch.device
    runner_config: RunnerConfig
    memory: MemorySplit  # the pools' memory and where it came from
    pools: PoolSet

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.loaded.eos_token_ids

    @property
    def kv_page_size_tokens(self) -> int:
        return self.runner_config.kv_page_size_tokens

    @property
    def kv_pool(self) -> KVPagePool:
        return self.pools.kv_pool

    @property
    def state_pool(self) -> MambaStatePool:
        return self.pools.state_pool

    @property
    def kv_bytes_per_token(self) -> int:
        return self.pools.kv_bytes_per_token

    @property
    def state_bytes_per_request(self) -> int:
        return self.pools.state_bytes_per_request

    def _set_plan(self, plan: PoolPlan, pools: tuple[KVPagePool, MambaStatePool]) -> None:
        self.runner_config = plan.config
        self.memory = plan.memory
        self.pools = PoolSet(*pools, plan.kv_bytes_per_token, plan.state_bytes_per_request, self.device)
