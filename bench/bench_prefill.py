"""Prefill profile of the model runner: milliseconds per prefill step, split by where they go.

Model: the benchmark model, a tiny hybrid (a random Granite-4.0-H as bench/bench_vs_vllm.py writes it: hidden 256,
8 layers, attention at layers 3 and 7, 8 Mamba heads of 64, d_state 64, dense MLP 512, vocab 512),
float32 on CPU, with the worker's default thread count (one thread on a 2-core machine). Cases:

    4x2000        four fresh 2,000-token prompts in one step
    1x3000        one fresh 3,000-token prompt in one step
    2048+952      the second chunk of a 3,000-token prompt served in 2,048-token steps (952 tokens
                  on top of 2,048 cached ones)
    8x256         eight fresh 256-token prompts in one step
    32x16..256    32 fresh prompts of 16..256 tokens (seeded uniform; the serving benchmark's short mix)
    512+32dec     a mixed step as serving runs it: one fresh 512-token prefill chunk beside 32 decoding
                  sequences (one token each on top of 160 cached ones)
    1x136         one fresh 136-token prompt (the short mix's middle: one client's time to first token)

For each case: the best CPU and wall time of a whole step (`ModelRunner.forward`, no instrumentation), then
the median split (CPU time) over the timed runs with every part wrapped in a timer (input building, embeddings, norms,
Mamba in_proj / causal conv / SSD scan / gated norm / out_proj, attention projections / KV write /
attention itself, MLPs, logits). Parts nest (a Mamba mixer's total holds its parts); "other" is what the
listed parts of a mixer leave. Only the split's proportions and before/after ratios in one run mean
anything.

    .venv/bin/python bench/bench_prefill.py [--repeats 5] [--cases 4x2000,1x3000] [--threads 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import gpu_worker.model.attention as attention_mod
import gpu_worker.model.mamba2 as mamba2_mod
import gpu_worker.runner.runner as runner_mod
from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.layers import MLP, RMSNorm
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import PREFILL_SCANS, RunnerConfig
from gpu_worker.runner.tuning import keep_freed_memory
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

SPEC = ModelSpec(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8, attn_layer_indices=(3, 7),
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=64, mamba_chunk_size=256,
    arch="granitemoehybrid", init_std=0.06,
)  # fmt: skip
# Parts are timed in this thread's CPU time: with one intra-op thread every op runs on the calling
# thread, and CPU time does not count the time other processes on shared cores take from it.
CLOCK = time.thread_time
CASES = {  # name -> ([(prompt tokens, cached tokens before the chunk)], ...)
    "4x2000": [(2000, 0)] * 4,
    "1x3000": [(3000, 0)],
    "2048+952": [(952, 2048)],
    "8x256": [(256, 0)] * 8,
    "32x16..256": [(n, 0) for n in random.Random(0).choices(range(16, 257), k=32)],
    "512+32dec": [(1, 160)] * 32 + [(512, 0)],
    "1x136": [(136, 0)],
}


class Split:
    """Accumulates wall seconds per label for one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def part(self, label: str) -> Iterator[None]:
        t0 = CLOCK()
        try:
            yield
        finally:
            self.seconds[label] += CLOCK() - t0


def instrument(runner: ModelRunner, split: Split) -> None:
    """Wraps the model's parts in `split` timers (module hooks and module-level functions)."""

    def hook(module: torch.nn.Module, label: str) -> None:
        starts: list[float] = []
        module.register_forward_pre_hook(lambda *_: starts.append(CLOCK()))

        def done(*_: Any) -> None:
            split.seconds[label] += CLOCK() - starts.pop()

        module.register_forward_hook(done)

    model = runner.model
    hook(model.embed, "embeddings")
    hook(model.final_norm, "norms (RMS)")
    hook(model.lm_head, "logits")
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            hook(module, "mamba: total")
            hook(module.in_proj, "mamba: in_proj")
            hook(module.out_proj, "mamba: out_proj")
            hook(module.norm, "mamba: gated norm")
        elif isinstance(module, PagedAttention):
            hook(module, "attention: total")
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                hook(getattr(module, name), "attention: q/k/v/o proj")
        elif isinstance(module, MLP):
            hook(module, "MLP")
        elif isinstance(module, RMSNorm):
            hook(module, "norms (RMS)")
    wrap(runner_mod, "build_inputs", split, "input building")
    for name in ("packed_causal_conv", "packed_index_for"):
        wrap(mamba2_mod, name, split, f"mamba: {name.removeprefix('packed_').replace('_', ' ')}")
    for name in ("packed_ssd_scan", "packed_scan", "ssd_scan"):
        wrap(mamba2_mod, name, split, "mamba: SSD scan")
    wrap(mamba2_mod.mamba_prefill, "sequential_scan", split, "mamba: SSD scan")
    wrap(mamba2_mod.mamba_prefill, "causal_conv", split, "mamba: causal conv")
    wrap(mamba2_mod, "save_boundary_states", split, "mamba: boundary states")
    wrap(PagedAttention, "_prefill", split, "attention: prefill (gather + attend)")
    wrap(attention_mod, "chunk_attention", split, "attention: flash kernels")
    wrap(attention_mod, "packed_prefill_attention", split, "attention: prefill (gather + attend)")


def wrap(owner: Any, name: str, split: Split, label: str) -> None:
    if not hasattr(owner, name):
        return
    inner: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with split.part(label):
            return inner(*args, **kwargs)

    setattr(owner, name, timed)


def make_batch(
    runner: ModelRunner, case: list[tuple[int, int]], g: torch.Generator
) -> tuple[Batch, Batch | None, Callable[[], None]]:
    """The timed batch, the batch that fills the cached context first (None when nothing is cached),
    and a function that frees their pages and slots."""
    kv, states = runner.kv_pool, runner.state_pool
    timed, warm, owned = [], [], []
    for n, cached in case:
        slot = states.allocate_slot()
        pages = kv.allocate(kv.pages_for_tokens(cached + n))
        owned.append((slot, pages))
        ids = torch.randint(3, SPEC.vocab_size, (cached + n,), generator=g).tolist()
        if cached:
            warm.append(SequenceChunk(tuple(ids[:cached]), 0, tuple(pages), slot))
        timed.append(SequenceChunk(tuple(ids[cached:]), cached, tuple(pages), slot))

    def free() -> None:
        for slot, pages in owned:
            kv.free(pages)
            states.free_slot(slot)

    return Batch(tuple(timed)), (Batch(tuple(warm)) if warm else None), free


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), CLOCK()
    fn()
    return time.perf_counter() - w0, CLOCK() - c0


def profile_case(
    runner: ModelRunner, name: str, repeats: int, split: Split | None
) -> tuple[int, list[tuple[float, float]], list[dict[str, float]]]:
    """(tokens of the step, (wall, CPU) seconds of each timed step, the split of each)."""
    batch, warm, free = make_batch(runner, CASES[name], torch.Generator().manual_seed(0))
    if warm is not None:
        runner.forward(warm)
    runner.forward(batch)  # warm-up
    totals: list[tuple[float, float]] = []
    runs: list[dict[str, float]] = []
    for _ in range(repeats):
        if split is not None:
            split.seconds.clear()
        totals.append(_timed(lambda: runner.forward(batch)))
        runs.append(dict(split.seconds) if split is not None else {})
    free()
    return batch.num_tokens, totals, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = the worker's default)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the weights' dtype")
    parser.add_argument("--prefill-scan", default="sequential", choices=PREFILL_SCANS,
                        help="the SSD scan's form (the worker's --cpu-prefill-scan)")  # fmt: skip
    args = parser.parse_args()
    keep_freed_memory()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "model", SPEC, seed=0, with_tokenizer=False)
        config = RunnerConfig(memory_budget_bytes=256 << 20, max_num_seqs=64, num_checkpoint_slots=0, dtype=args.dtype,
                              cpu_threads=args.threads, cpu_prefill_scan=args.prefill_scan)  # fmt: skip
        plain = ModelRunner.from_model_dir(path, config)
        profiled = ModelRunner.from_model_dir(path, config)
        split = Split()
        instrument(profiled, split)
        print(f"model: {SPEC.arch}, hidden 256, 8 layers, attention at (3, 7); {args.dtype} CPU, "
              f"{torch.get_num_threads()} thread(s), {args.prefill_scan} scan; "
              f"step: best of {args.repeats}; split: median")  # fmt: skip
        for name in args.cases.split(","):
            tokens, totals, _ = profile_case(plain, name, args.repeats, None)
            _, instrumented, runs = profile_case(profiled, name, args.repeats, split)
            wall, cpu = min(w for w, _ in totals), min(c for _, c in totals)
            profiled_cpu = statistics.median(c for _, c in instrumented)
            print(f"\n{name}: {tokens} tokens, step {cpu * 1e3:.1f} ms CPU ({tokens / cpu:.0f} tok/s), "
                  f"{wall * 1e3:.1f} ms wall; instrumented {profiled_cpu * 1e3:.1f} ms CPU")  # fmt: skip
            for label in sorted({k for r in runs for k in r}):
                ms = statistics.median(r.get(label, 0.0) for r in runs) * 1e3
                print(f"  {label:<34}{ms:>9.1f} ms")


if __name__ == "__main__":
    main()
