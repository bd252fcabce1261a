"""Model-runner benchmark, side by side with transformers `generate()` on the same model and prompts.

Model: a random Bamba (hidden 256, 8 layers, attention at layers 3 and 7, vocab 32000) written by
`hybridserve_cli.init_model`; both sides load the same folder in float32 on CPU (bf16 on CUDA for the runner).
Reported: prefill tokens/s for one 512-token prompt, decode tokens/s at batch 1, 8 and 32 with mixed
prompt lengths (greedy), and the runner's KV bytes per token and state bytes per request. Only ratios
measured in one run mean anything.

    /work/venv/bin/python bench/bench_model.py [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import BambaForCausalLM as HFBamba
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.utils import logging as hf_logging

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import SamplingParams, sample
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.tuning import keep_freed_memory
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

BENCH_SPEC = ModelSpec(
    vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=8, attn_layer_indices=(3, 7),
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=64,
    mamba_chunk_size=256,
)  # fmt: skip


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class StepClock(LogitsProcessor):
    """Timestamps each generate() step (called once per new token, right after that step's forward)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def hf_generate(
    model: HFBamba, prompts: list[list[int]], new_tokens: int, clock: StepClock | None = None
) -> torch.Tensor:
    """Left-padded greedy generate() of exactly `new_tokens` tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList([clock] if clock else []),
        )  # fmt: skip
    return out[:, width:]


class RunnerDriver:
    """The engine's per-step work, minimally: page tables, one packed prefill, then batched decode steps."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        """Greedy-generate; returns (outputs, prefill seconds, decode seconds)."""
        kv, states = self.runner.kv_pool, self.runner.state_pool
        slots = [states.allocate_slot() for _ in prompts]
        pages = [kv.allocate(kv.pages_for_tokens(len(p) + new_tokens)) for p in prompts]
        params = [SamplingParams()] * len(prompts)
        positions = [0] * len(prompts)
        t0 = time.perf_counter()
        batch = Batch(
            tuple(SequenceChunk(tuple(p), 0, tuple(pg), s) for p, pg, s in zip(prompts, pages, slots, strict=True))
        )
        last = sample(self.runner.forward(batch).logits, params, positions).token_ids
        outs = [[t] for t in last]
        t1 = time.perf_counter()
        for step in range(new_tokens - 1):
            batch = Batch(
                tuple(
                    SequenceChunk((o[-1],), len(p) + step, tuple(pg), s)
                    for p, o, pg, s in zip(prompts, outs, pages, slots, strict=True)
                )
            )
            for o, t in zip(outs, sample(self.runner.forward(batch).logits, params, positions).token_ids, strict=True):
                o.append(t)
        t2 = time.perf_counter()
        for pg, s in zip(pages, slots, strict=True):
            kv.free(pg)
            states.free_slot(s)
        return outs, t1 - t0, t2 - t1


def _hf_decode_seconds(hf: HFBamba, prompts: list[list[int]], n: int) -> float:
    """Seconds of the n decode steps after the prefill step (same span the runner is timed over)."""
    clock = StepClock()
    hf_generate(hf, prompts, n + 1, clock)
    return clock.times[-1] - clock.times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,8,32")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    # Same process, same allocator for both sides: keep freed activations in the heap (see gpu_worker.runner.tuning).
    tuned = keep_freed_memory()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_SPEC, seed=0, with_tokenizer=False)
        hf = HFBamba.from_pretrained(path, dtype=torch.float32).eval()
        runner = ModelRunner.from_model_dir(
            path,
            RunnerConfig(
                memory_budget_bytes=256 << 20, kv_page_size_tokens=16, max_num_seqs=40, num_checkpoint_slots=0
            ),
        )
        driver = RunnerDriver(runner)
        g = torch.Generator().manual_seed(1)
        info = runner.describe()
        print(
            f"model: hidden 256, 8 layers, attention at (3, 7), vocab 32000; threads {torch.get_num_threads()}, "
            f"allocator tuned: {tuned}"
        )
        print(f"runner: {info['device']} {info['dtype']}, kv_bytes_per_token={info['kv_bytes_per_token']}, "
              f"state_bytes_per_request={info['state_bytes_per_request']}, kv_pages={info['num_kv_pages']}x"
              f"{info['kv_page_size_tokens']}")  # fmt: skip

        prompt = torch.randint(3, 32000, (512,), generator=g).tolist()
        driver.generate([prompt], 1)  # warm-up
        hf_generate(hf, [prompt], 1)
        t_ours = t_hf = float("inf")
        for _ in range(args.repeats):  # interleaved
            t_ours = min(t_ours, _best_time(lambda: driver.generate([prompt], 1), 1))
            t_hf = min(t_hf, _best_time(lambda: hf_generate(hf, [prompt], 1), 1))
        print(f"{'case':<22}{'transformers tok/s':>20}{'hybridserve tok/s':>20}{'speedup':>10}")
        print(f"{'prefill 512':<22}{512 / t_hf:>20.1f}{512 / t_ours:>20.1f}{t_hf / t_ours:>9.2f}x")

        n = args.new_tokens
        for b in (int(x) for x in args.batches.split(",")):
            lens = torch.randint(16, 257, (b,), generator=g).tolist()
            prompts = [torch.randint(3, 32000, (k,), generator=g).tolist() for k in lens]
            runs, hf_runs = [], []
            for _ in range(args.repeats):  # interleaved, so a load spike hits both sides alike
                runs.append(driver.generate(prompts, n + 1))
                hf_runs.append(_hf_decode_seconds(hf, prompts, n))
            ours, hf_decode_s = min(runs, key=lambda r: r[2]), min(hf_runs)
            hf_tps, our_tps = b * n / hf_decode_s, b * n / ours[2]
            same = ""
            if b == 1:
                ref = hf_generate(hf, prompts, n + 1)[0].tolist()
                same = "  (greedy tokens identical)" if ref == ours[0][0] else "  (greedy tokens DIFFER)"
            label = f"decode batch {b}"
            print(f"{label:<22}{hf_tps:>20.1f}{our_tps:>20.1f}{our_tps / hf_tps:>9.2f}x{same}")
        print(f"prompt lengths for decode: uniform in [16, 256]; {n} new tokens per request; best of {args.repeats}")


if __name__ == "__main__":
    main()
