"""This machine's decode floor: what one core reads and computes per second, and from that the least time
a decode step of a model can take.

Measured on one core (one torch thread), float32, through the model's own projection modules
(gpu_worker.model.backends.cpu.linear.OneDnnLinear: oneDNN, weights prepacked as the CPU runner does):

    gemv L3     one row through a ring of 256 -> 1024 projections whose weights total --l3-mb (24 MB by
                default, the benchmark model's size: it stays in the last-level cache), weight bytes read
                per second
    gemv DRAM   the same over --dram-mb (512 MB: beyond any last-level cache)
    matmul      512 rows through a 1024 -> 1024 projection, its weight hot: FLOP/s

The floor of a decode step of R rows: max(bytes / bandwidth, flops / peak), where
    bytes = every parameter the step reads (all but the embedding, whose R rows are gathered; a tied LM
            head read once) + R x (the Mamba state, read and written) + R x CONTEXT x (KV bytes per token)
    flops = 2 x R x (the parameters the projections, convolutions and LM head multiply)
and the bandwidth is L3's when those bytes fit in the last-level cache (sysfs's size of the largest
cache), else DRAM's. Activations are left out (a few rows of hidden size). The models: the benchmark
model (bench/bench_decode.py), a 100k-vocabulary one (vocab 100,352, hidden 768, 8 layers) and a ~1 GB one,
built on the meta device (no weights are allocated).

    .venv/bin/python bench/bench_roofline.py [--rows 1,8,32] [--l3-mb 24] [--dram-mb 512] [--context 256]

`floors(spec, rows, machine)` gives the same figures to other benchmarks (decode step time as a
multiple of the floor). Absolute figures depend on the machine and its load; rerun on an idle machine.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from gpu_worker.model.backends.cpu.linear import OneDnnLinear, use_onednn_linears
from gpu_worker.model.loader import parse_config
from gpu_worker.model.model import HybridForCausalLM
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.state_pool import MambaStatePool, state_shapes
from hybridserve_cli.init_model import ModelSpec

BENCH = ModelSpec(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8, attn_layer_indices=(3, 7),
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=64, mamba_chunk_size=256,
    arch="granitemoehybrid", init_std=0.06,
)  # fmt: skip
MODELS = {
    "benchmark (hidden 256, vocab 512)": BENCH,
    "100k vocab (hidden 768, 8 layers)": replace(
        BENCH,
        vocab_size=100_352,
        hidden_size=768,
        intermediate_size=1536,
        num_attention_heads=12,
        num_key_value_heads=4,
        mamba_n_heads=24,
    ),  # fmt: skip
    "~1 GB (hidden 1024, 12 layers)": replace(
        BENCH,
        vocab_size=100_352,
        hidden_size=1024,
        intermediate_size=2560,
        num_hidden_layers=12,
        attn_layer_indices=(2, 5, 8, 11),
        num_attention_heads=16,
        num_key_value_heads=4,
        mamba_n_heads=32,
    ),  # fmt: skip
}
GEMV_SHAPE = (256, 1024)  # in -> out of the ring's projections


@dataclass(frozen=True, slots=True)
class Machine:
    l3_bytes_per_s: float
    dram_bytes_per_s: float
    flops_per_s: float
    cache_bytes: int  # the largest cache's size (sysfs), 0 when unknown


@dataclass(frozen=True, slots=True)
class Floor:
    bytes: int
    flops: int
    seconds: float
    bound: str  # "L3", "DRAM" or "compute"


def largest_cache_bytes() -> int:
    """The largest cache of CPU 0, as sysfs gives it (0 when it does not)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, value)
    return best


def _ring(total_bytes: int) -> list[nn.Module]:
    n_in, n_out = GEMV_SHAPE
    count = max(1, total_bytes // (n_in * n_out * 4))
    layers = nn.ModuleList(nn.Linear(n_in, n_out, bias=False) for _ in range(count))
    use_onednn_linears(layers)
    for layer in layers:  # packed whatever the ring's size (the runner packs a model of at most PACK_MAX_BYTES)
        assert isinstance(layer, OneDnnLinear)
        layer.set_packing(True)
    return list(layers)


@torch.inference_mode()
def gemv_bytes_per_s(total_bytes: int, seconds: float = 1.0) -> float:
    """Weight bytes read per second by one-row calls around a ring of projections of `total_bytes`."""
    ring = _ring(total_bytes)
    x = torch.randn(1, GEMV_SHAPE[0])
    for layer in ring:  # packs built, the ring touched once
        layer(x)
    weight_bytes = GEMV_SHAPE[0] * GEMV_SHAPE[1] * 4
    calls, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        for layer in ring:
            layer(x)
        calls += len(ring)
    return calls * weight_bytes / (time.perf_counter() - began)


@torch.inference_mode()
def matmul_flops_per_s(rows: int = 512, size: int = 1024, seconds: float = 1.0) -> float:
    layer = nn.Linear(size, size, bias=False)
    use_onednn_linears(layer)
    x = torch.randn(rows, size)
    layer(x)
    calls, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        layer(x)
        calls += 1
    return calls * 2 * rows * size * size / (time.perf_counter() - began)


def measure(l3_mb: int, dram_mb: int) -> Machine:
    return Machine(
        l3_bytes_per_s=gemv_bytes_per_s(l3_mb << 20),
        dram_bytes_per_s=gemv_bytes_per_s(dram_mb << 20, seconds=2.0),
        flops_per_s=matmul_flops_per_s(),
        cache_bytes=largest_cache_bytes(),
    )


def step_cost(spec: ModelSpec, rows: int, context: int) -> tuple[int, int]:
    """(bytes read, FLOPs) of one decode step of `rows` rows at `context` tokens of KV each."""
    _, config = parse_config(spec.to_hf_config())
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    embed = model.embed.weight
    weights: dict[int, torch.Tensor] = {id(p): p for p in model.parameters() if p is not embed}
    if config.tie_word_embeddings:
        weights[id(embed)] = embed  # read whole as the LM head
    param_bytes = sum(p.numel() * 4 for p in weights.values())
    state = MambaStatePool.bytes_per_slot(config.num_mamba_layers, *state_shapes(config), torch.float32)
    kv = KVPagePool.bytes_per_token(config.num_attention_layers, config.num_key_value_heads, config.head_dim,
                                    torch.float32)  # fmt: skip
    read = param_bytes + rows * (config.hidden_size * 4 + 2 * state + context * kv)
    multiplied = sum(p.numel() for p in weights.values() if p.dim() >= 2)
    return read, 2 * rows * multiplied


def floors(spec: ModelSpec, rows: int, machine: Machine, context: int = 256) -> Floor:
    read, flops = step_cost(spec, rows, context)
    in_cache = machine.cache_bytes > 0 and read <= machine.cache_bytes
    bandwidth = machine.l3_bytes_per_s if in_cache else machine.dram_bytes_per_s
    memory_s, compute_s = read / bandwidth, flops / machine.flops_per_s
    bound = ("L3" if in_cache else "DRAM") if memory_s >= compute_s else "compute"
    return Floor(read, flops, max(memory_s, compute_s), bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--l3-mb", type=int, default=24, help="the in-cache ring's weights, MB")
    parser.add_argument("--dram-mb", type=int, default=512, help="the beyond-cache ring's weights, MB")
    parser.add_argument("--context", type=int, default=256, help="KV tokens per row the floor reads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    machine = measure(args.l3_mb, args.dram_mb)
    cache = f"{machine.cache_bytes >> 20} MB" if machine.cache_bytes else "unknown"
    print(f"one core, float32, oneDNN: gemv from L3 ({args.l3_mb} MB ring) {machine.l3_bytes_per_s / 1e9:.1f} GB/s, "
          f"from DRAM ({args.dram_mb} MB ring) {machine.dram_bytes_per_s / 1e9:.1f} GB/s, "
          f"matmul {machine.flops_per_s / 1e9:.1f} GFLOP/s; largest cache {cache}")  # fmt: skip
    print(f"{'model':<36}{'rows':>5}{'MB read':>9}{'MFLOP':>9}{'floor ms':>10}  bound")
    for name, spec in MODELS.items():
        for rows in (int(r) for r in args.rows.split(",")):
            f = floors(spec, rows, machine, args.context)
            print(f"{name:<36}{rows:>5}{f.bytes / 1e6:>9.1f}{f.flops / 1e6:>9.1f}{f.seconds * 1e3:>10.3f}  {f.bound}")


if __name__ == "__main__":
    main()
