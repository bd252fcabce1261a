"""bench/bench_roofline.py's floor arithmetic: bytes and FLOPs of a decode step from the model's own
modules, and the floor as the larger of the memory and compute times, with the bandwidth that fits."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from gpu_worker.model.loader import parse_config
from gpu_worker.model.model import HybridForCausalLM
from gpu_worker.runner.state_pool import MambaStatePool, state_shapes

_SPEC = importlib.util.spec_from_file_location(
    "bench_roofline", Path(__file__).resolve().parents[2] / "bench" / "bench_roofline.py"
)
assert _SPEC is not None and _SPEC.loader is not None
roofline = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = roofline  # its dataclasses look their module up
_SPEC.loader.exec_module(roofline)


def test_a_step_reads_the_weights_once_and_each_rows_state() -> None:
    _, config = parse_config(roofline.BENCH.to_hf_config())
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    one, flops_one = roofline.step_cost(roofline.BENCH, 1, context=0)
    eight, flops_eight = roofline.step_cost(roofline.BENCH, 8, context=0)
    gathered = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * 4  # not read whole
    state = MambaStatePool.bytes_per_slot(config.num_mamba_layers, *state_shapes(config), torch.float32)
    assert one == params * 4 - gathered + config.hidden_size * 4 + 2 * state  # one embedding row; state read, written
    assert eight > one and flops_eight == 8 * flops_one  # state per row; FLOPs in proportion to rows
    assert roofline.step_cost(roofline.BENCH, 1, context=100)[0] > one  # KV of the context


def test_the_floor_is_the_slower_of_memory_and_compute() -> None:
    read, flops = roofline.step_cost(roofline.BENCH, 1, context=16)
    fits = roofline.Machine(l3_bytes_per_s=4e10, dram_bytes_per_s=1e10, flops_per_s=1e12, cache_bytes=read)
    assert roofline.floors(roofline.BENCH, 1, fits, context=16) == roofline.Floor(read, flops, read / 4e10, "L3")
    beyond = roofline.Machine(4e10, 1e10, 1e12, cache_bytes=read - 1)
    assert roofline.floors(roofline.BENCH, 1, beyond, context=16).bound == "DRAM"
    slow = roofline.Machine(4e10, 1e10, flops_per_s=1e6, cache_bytes=0)
    assert roofline.floors(roofline.BENCH, 1, slow, context=16) == roofline.Floor(read, flops, flops / 1e6, "compute")
