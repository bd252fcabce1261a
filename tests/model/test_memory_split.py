"""How the pools are sized: a stand-in device's memory figures in, pool sizes out (the CUDA rule, tested
on CPU); and the max_model_len rule (the checkpoint's length, the pool, the flag)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from gpu_worker.engine.admission import model_len_limit
from gpu_worker.model.loader import load_model, parse_config
from gpu_worker.runner.memory import GIB, PAGES_WITHOUT_ATTENTION, DeviceMemory, PoolShape, size_pools
from gpu_worker.runner.profile import dummy_step, estimate_activation_bytes, weights_bytes
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

# Granite-4.0-H-Tiny-like costs in bfloat16: 4 attention layers x 4 KV heads x 128 (K and V), 36 Mamba layers
# (a 56 MiB state a sequence)
KV_PER_TOKEN = 2 * 4 * 4 * 128 * 2
STATE_PER_SLOT = 36 * (3 * 8192 * 2 + 48 * 64 * 128 * 4)
SHAPE = PoolShape(KV_PER_TOKEN, 16, STATE_PER_SLOT, max_num_seqs=32, num_checkpoint_slots=16)
CONTEXT = GIB // 2  # the CUDA context: on the device, not in torch's counters


def device(total_gib: float, weights: int) -> DeviceMemory:
    """A device that holds the weights and a CUDA context, nothing else."""
    total = int(total_gib * GIB)
    return DeviceMemory(total_bytes=total, free_bytes=total - weights - CONTEXT)


def test_an_h200_gives_the_pools_the_utilised_memory_less_weights_activations_and_context():
    weights, activations = 14 * GIB, 2 * GIB
    split = size_pools(SHAPE, weights_bytes=weights, activation_bytes=activations, device=device(139.8, weights))
    total = int(139.8 * GIB)
    assert split.budget_bytes == int(total * 0.9) - weights - activations - CONTEXT
    assert split.source == "gpu-memory-utilization 0.90 of 139.8 GiB"
    assert split.device_total_bytes == total
    assert split.state_pool_bytes == 32 * STATE_PER_SLOT and split.num_state_slots == 32
    assert split.checkpoint_pool_bytes == 16 * STATE_PER_SLOT and split.num_checkpoint_slots == 16
    page = KV_PER_TOKEN * 16
    assert split.kv_pool_bytes == split.num_kv_pages * page
    left = split.budget_bytes - split.kv_pool_bytes - split.state_pool_bytes - split.checkpoint_pool_bytes
    assert 0 <= left < page  # every byte of the budget but a page's remainder is used
    assert split.num_kv_pages * 16 > 3_000_000  # ~105 GiB of 32 KiB tokens


def test_a_24_gib_card_and_the_utilisation_fraction():
    weights, activations = 14 * GIB, GIB
    card = device(24, weights)
    at_09 = size_pools(SHAPE, weights_bytes=weights, activation_bytes=activations, device=card)
    assert at_09.budget_bytes == int(24 * GIB * 0.9) - weights - activations - CONTEXT
    assert 3 * GIB < at_09.kv_pool_bytes <= at_09.budget_bytes - at_09.state_pool_bytes - at_09.checkpoint_pool_bytes
    at_08 = size_pools(SHAPE, weights_bytes=weights, activation_bytes=activations, device=card, utilization=0.8)
    assert at_09.budget_bytes - at_08.budget_bytes == int(24 * GIB * 0.9) - int(24 * GIB * 0.8)
    assert at_08.num_kv_pages < at_09.num_kv_pages and at_08.source.startswith("gpu-memory-utilization 0.80 of 24.0")


def test_utilisation_half_against_nine_tenths_on_an_h200():
    weights, activations = 14 * GIB, 2 * GIB
    h200 = device(139.8, weights)
    half = size_pools(SHAPE, weights_bytes=weights, activation_bytes=activations, device=h200, utilization=0.5)
    most = size_pools(SHAPE, weights_bytes=weights, activation_bytes=activations, device=h200, utilization=0.9)
    total = h200.total_bytes
    assert most.budget_bytes - half.budget_bytes == int(total * 0.9) - int(total * 0.5)
    assert half.budget_bytes == int(total * 0.5) - weights - activations - CONTEXT


def test_weights_that_do_not_fit_are_refused_with_the_figures():
    with pytest.raises(InvalidArgumentError) as err:
        size_pools(SHAPE, weights_bytes=30 * GIB, activation_bytes=GIB, device=DeviceMemory(24 * GIB, 0))
    message = str(err.value)
    assert "weights (30.00 GiB) plus the activation budget (1.00 GiB) exceed" in message, message
    assert "gpu-memory-utilization 0.90 of 24.0 GiB (21.60 GiB)" in message and "\n" not in message


def test_memory_held_by_other_processes_leaves_nothing_and_is_refused():
    weights = 14 * GIB
    busy = DeviceMemory(total_bytes=24 * GIB, free_bytes=4 * GIB)  # another process holds ~6 GiB
    with pytest.raises(InvalidArgumentError, match=r"nothing is left .* other memory on the device"):
        size_pools(SHAPE, weights_bytes=weights, activation_bytes=2 * GIB, device=busy)


def test_memory_budget_mb_wins_over_the_device():
    weights = 14 * GIB
    split = size_pools(
        SHAPE, weights_bytes=weights, activation_bytes=GIB, device=device(139.8, weights), budget_bytes=4 * GIB
    )
    assert split.budget_bytes == 4 * GIB and split.source == "--memory-budget-mb" and split.device_total_bytes == 0
    assert split.num_kv_pages == (4 * GIB - 48 * STATE_PER_SLOT) // (KV_PER_TOKEN * 16)
    with pytest.raises(InvalidArgumentError, match="give --memory-budget-mb"):
        size_pools(SHAPE, weights_bytes=weights, activation_bytes=GIB)  # no device (CPU) and no budget


def test_checkpoint_memory_and_models_without_attention():
    split = size_pools(
        replace(SHAPE, checkpoint_memory_bytes=10 * STATE_PER_SLOT + 1), weights_bytes=0, activation_bytes=0,
        budget_bytes=4 * GIB,
    )  # fmt: skip
    assert split.num_checkpoint_slots == 10 and split.checkpoint_pool_bytes == 10 * STATE_PER_SLOT
    mamba_only = size_pools(replace(SHAPE, kv_bytes_per_token=0), weights_bytes=0, activation_bytes=0, budget_bytes=GIB)
    assert mamba_only.num_kv_pages == PAGES_WITHOUT_ATTENTION and mamba_only.kv_pool_bytes == 0
    with pytest.raises(InvalidArgumentError, match="too small"):
        size_pools(SHAPE, weights_bytes=0, activation_bytes=0, budget_bytes=48 * STATE_PER_SLOT)


def test_max_model_len_is_the_checkpoint_length_capped_by_the_pool():
    by_config = model_len_limit(0, 8192, 100_000)
    assert (by_config.tokens, by_config.source) == (8192, "max_position_embeddings (the KV pool holds 100000)")
    by_pool = model_len_limit(0, 262_144, 5_000)
    assert (by_pool.tokens, by_pool.source) == (5_000, "the KV pool (max_position_embeddings 262144)")
    unnamed = model_len_limit(0, 0, 5_000)
    assert unnamed.tokens == 5_000 and "names no max_position_embeddings" in unnamed.source


def test_max_model_len_flag_overrides_and_above_the_pool_is_refused():
    assert model_len_limit(4096, 8192, 100_000).tokens == 4096
    above = model_len_limit(16_384, 8192, 100_000)
    assert above.tokens == 16_384 and above.source == "--max-model-len (above max_position_embeddings 8192)"
    assert model_len_limit(100_000, 0, 100_000).source == "--max-model-len"
    with pytest.raises(InvalidArgumentError, match="--max-model-len 100001 exceeds the 100000 tokens the KV pool"):
        model_len_limit(100_001, 8192, 100_000)


@pytest.mark.parametrize("arch", ["bamba", "granitemoehybrid", "nemotron_h"])
def test_every_family_reads_max_position_embeddings(arch):
    raw = ModelSpec(arch=arch).to_hf_config()
    _, config = parse_config(raw)
    assert config.max_position_embeddings == raw["max_position_embeddings"] > 0
    del raw["max_position_embeddings"]
    _, without = parse_config(raw)
    assert without.max_position_embeddings == 0
    assert without.to_canonical_json() == config.to_canonical_json()  # not part of the fingerprint


def test_the_profiled_step_runs_a_whole_prompt_over_temporary_pools(tmp_path):
    """The dummy step the CUDA profile measures, run here on CPU: one prompt of max_num_batched_tokens."""
    spec = ModelSpec(hidden_size=64, num_hidden_layers=2, attn_layer_indices=(1,))
    loaded = load_model(write_random_checkpoint(tmp_path / "m", spec, seed=1))
    with dummy_step(loaded, 37, 4) as run:
        logits = run()
    assert logits.shape == (1, loaded.config.vocab_size) and torch.isfinite(logits).all()
    estimate = estimate_activation_bytes(loaded.config, 2048, 32, 4)
    assert estimate > 2 * estimate_activation_bytes(loaded.config, 512, 32, 4) > 0  # grows with the step
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]  # float32 weights, untied
    assert weights_bytes(loaded.model) == sum(t.numel() * t.element_size() for t in tensors) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_pools_take_the_utilised_device_memory(tmp_path):
    path = write_random_checkpoint(tmp_path / "m", ModelSpec(), seed=1)
    runner = ModelRunner.from_model_dir(path, RunnerConfig(gpu_memory_utilization=0.3, max_num_seqs=4,
                                                           num_checkpoint_slots=2, cuda_graph_max_batch=0))  # fmt: skip
    memory = runner.memory
    free, total = torch.cuda.mem_get_info()
    assert memory.source.startswith("gpu-memory-utilization 0.30 of") and memory.device_total_bytes == total
    assert memory.activation_source.startswith("profiled") and memory.activation_bytes > 0
    assert memory.budget_bytes <= 0.3 * total - memory.weights_bytes - memory.activation_bytes
    assert runner.kv_pool.num_pages == memory.num_kv_pages and free > 0.6 * total  # the rest left free


def test_a_host_that_cannot_hold_the_budgets_is_refused_with_the_figures(tmp_path):
    from gpu_worker.runner.memory import check_host_memory

    spec = ModelSpec(hidden_size=64, num_hidden_layers=2, attn_layer_indices=(1,))
    path = write_random_checkpoint(tmp_path / "m", spec, seed=1)
    memory = ModelRunner.from_model_dir(path, RunnerConfig(device="cpu", memory_budget_bytes=8 << 20,
                                                           max_model_len=60_000)).memory  # fmt: skip
    assert memory.activation_context_tokens == 60_000 and memory.attention_workspace_bytes > 0
    assert memory.activation_source.startswith("estimated from the shapes: a chunk of 2048 tokens at the end of 60000")
    need = memory.weights_bytes + memory.budget_bytes + 2 * memory.activation_bytes
    check_host_memory(memory, 2, need)  # exactly enough
    with pytest.raises(InvalidArgumentError, match=r"this worker needs .* activations .* \(2 x"):
        check_host_memory(memory, 2, need - 1)


TRIM_CHECK = """
from gpu_worker.runner.tuning import StepMemoryTrim, anonymous_resident_bytes, keep_freed_memory

assert keep_freed_memory()  # as a worker runs: freed blocks stay in the heap
trim = StepMemoryTrim(keep_bytes=8 << 20)
assert not trim.after_step()  # the first check sets the line
held = [bytearray(1 << 20) for _ in range(64)]  # 64 MiB touched, then freed: in the heap, resident
del held
grown = anonymous_resident_bytes()
assert grown - (trim.line or 0) > 32 << 20, (grown, trim.line)
assert trim.after_step() and trim.num_trims == 1
assert anonymous_resident_bytes() < grown - (32 << 20)
assert not trim.after_step()  # nothing more above the line
print("trimmed")
"""


def test_freed_memory_beyond_the_budget_goes_back_after_a_step():
    """In a fresh interpreter: the allocator settings are the process's, and a long-lived test process's
    heap may already hold free memory that the 64 MiB would reuse."""
    done = subprocess.run([sys.executable, "-c", TRIM_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "trimmed" in done.stdout, done.stderr
