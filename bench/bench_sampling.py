"""Decode step time with the sampling controls, against the same step without them.

Model: the benchmark model's shape (bench/bench_decode.py: a tiny Granite-4.0-H, hidden 256, 8 layers) with
Granite-4.0-H's vocabulary of 100,352 tokens by default (the controls work on [rows, vocab] tensors, so the
vocabulary is what their cost grows with), in process on CPU. For each batch size the prompts (64 tokens)
are prefilled once per case, then decode steps (`ModelRunner.execute`: forward, the history tables' diffs,
sampling) are timed, the cases interleaved step group by step group so that a busy machine slows them alike:

    a  none     greedy, no controls (the plain path)
    b  controls greedy with presence, frequency and repetition penalties and a 16-token logit_bias on every row
    d  mixed    b on half the rows, a on the others

CASES maps a case's name to the sampling of each row (row index -> SamplingParams); a case added there
(a structured-output mask on every row, "c") is timed and compared with the rest. Prints the median step
time per case and size, and each case's ratio to "a none" at that size.

    .venv/bin/python bench/bench_sampling.py [--batches 1,32,128] [--steps 16] [--repeats 6] [--vocab 100352]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import SamplingParams, StepSampling
from gpu_worker.runner.settings import RunnerConfig
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

SPEC = ModelSpec(
    vocab_size=100_352, hidden_size=256, intermediate_size=512, num_hidden_layers=8, attn_layer_indices=(3, 7),
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=64, mamba_chunk_size=256,
    arch="granitemoehybrid", init_std=0.06,
)  # fmt: skip
PROMPT_TOKENS = 64
PAGE = 16


def _controls(row: int) -> SamplingParams:
    bias = tuple(((row * 131 + k * 977) % 50_000, 2.0 if k % 2 else -2.0) for k in range(16))
    return SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias=bias)


PLAIN = SamplingParams()
# case name -> the sampling of row i; add a case here to time it beside the others
CASES: dict[str, Callable[[int], SamplingParams]] = {
    "a none": lambda i: PLAIN,
    "b controls": _controls,
    "d mixed": lambda i: _controls(i) if i % 2 else PLAIN,
}


class Rows:
    """One case's requests: prompts prefilled, then one decode step at a time."""

    def __init__(self, runner: ModelRunner, n: int, params: Callable[[int], SamplingParams], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.runner = runner
        self.prompts = [torch.randint(3, 50_000, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(n)]
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.params = [params(i) for i in range(n)]
        self.slots = [runner.state_pool.allocate_slot() for _ in range(n)]
        self.pages: list[list[int]] = [[] for _ in range(n)]
        self.computed = [0] * n
        self.step(prefill=True)

    def _chunk(self, i: int, tokens: list[int]) -> SequenceChunk:
        end = self.computed[i] + len(tokens)
        need = self.runner.kv_pool.pages_for_tokens(end) - len(self.pages[i])
        if need > 0:
            self.pages[i] += self.runner.kv_pool.allocate(need)
        chunk = SequenceChunk(tuple(tokens), self.computed[i], tuple(self.pages[i]), self.slots[i])
        self.computed[i] = end
        return chunk

    def step(self, prefill: bool = False) -> float:
        n = len(self.prompts)
        chunks = tuple(
            self._chunk(i, self.prompts[i] if prefill else [self.outputs[i][-1]]) for i in range(n)
        )  # fmt: skip
        sampling = StepSampling.of(range(n), self.params, list(zip(self.prompts, self.outputs, strict=True)))
        started = time.perf_counter()
        out = self.runner.execute(Batch(chunks), sampling)
        seconds = time.perf_counter() - started
        for i, token in enumerate(out.token_ids):
            self.outputs[i].append(token)
        return seconds

    def release(self) -> None:
        for pages, slot in zip(self.pages, self.slots, strict=True):
            self.runner.kv_pool.free(pages)
            self.runner.state_pool.free_slot(slot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per case per repeat")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved rounds over the cases")
    parser.add_argument("--vocab", type=int, default=SPEC.vocab_size)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "m", replace(SPEC, vocab_size=args.vocab), seed=0)
        slots = len(CASES) * max(batches)
        config = RunnerConfig(
            memory_budget_bytes=1536 << 20, kv_page_size_tokens=PAGE, max_num_seqs=slots, num_checkpoint_slots=0,
            device="cpu", dtype="float32", cpu_threads=args.threads, decode_compile="off", cpu_warm_rows=0,
        )  # fmt: skip
        runner = ModelRunner.from_model_dir(path, config)
        print(f"vocab {args.vocab}, {args.threads} thread(s), prompts {PROMPT_TOKENS} tokens, "
              f"{args.steps} steps x {args.repeats} interleaved repeats per case")  # fmt: skip
        print(f"{'rows':>5} {'case':<12} {'median ms':>10} {'vs a none':>10}")
        for n in batches:
            rows = {name: Rows(runner, n, params, seed=k) for k, (name, params) in enumerate(CASES.items())}
            times: dict[str, list[float]] = {name: [] for name in CASES}
            for name in CASES:  # one untimed step each: the history tables' first writes
                rows[name].step()
            for _ in range(args.repeats):
                for name, case in rows.items():
                    times[name] += [case.step() for _ in range(args.steps)]
            base = statistics.median(times["a none"])
            for name in CASES:
                median = statistics.median(times[name])
                print(f"{n:>5} {name:<12} {median * 1e3:>10.3f} {median / base:>9.3f}x")
            for case in rows.values():
                case.release()
        runner.close()


if __name__ == "__main__":
    main()
