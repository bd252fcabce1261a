"""What the step-memory tests and bench/bench_faults.py share: a lean checkpoint for long prompts, a worker
with its model processes found, their resident memory read from /proc."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from hybridserve.v1 import generation_pb2 as pb
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from tests.robustness.procs import WorkerClient

# One attention layer of two heads over one KV head, one Mamba layer: a 60,000-token prompt's attention
# (quadratic in the prompt) stays seconds on one core.
LONG_PROMPT_SPEC = ModelSpec(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, attn_layer_indices=(1,), num_attention_heads=2,
    num_key_value_heads=1, mamba_n_heads=2, mamba_d_state=16,
)  # fmt: skip
# Checkpoints every 256 tokens (not the tests' 16): a long prompt's boundary states stay few
LONG_PROMPT_FLAGS = ("--block-size", "256", "--mamba-block-size", "64", "--memory-budget-mb", "64")


def write_long_prompt_model(folder: Path) -> Path:
    return write_random_checkpoint(folder / "long-prompt", LONG_PROMPT_SPEC, seed=7)


def model_process_pids(client: WorkerClient) -> list[int]:
    """The pids the worker's log names in its "model process(es) ... ready" line."""
    for line in client.process.lines:
        found = re.search(r"model process(?:es)? ([\d, ]+) ready", line)
        if found:
            return [int(p) for p in found.group(1).replace(",", " ").split()]
    raise AssertionError(f"no model process line in the worker's log:\n{client.process.output}")


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of `pid`, and VmRSS's private (RssAnon) and shared-memory (RssShmem: the pools' pages
    it has touched) parts, MiB."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    return out


class PeakSampler:
    """The highest VmRSS of each pid, sampled every `period_s` on a thread, while the `with` block runs."""

    def __init__(self, pids: list[int], period_s: float = 0.05) -> None:
        self.pids, self.period_s = pids, period_s
        self.peak_mb = {pid: memory_mb(pid)["VmRSS"] for pid in pids}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            for pid in self.pids:
                self.peak_mb[pid] = max(self.peak_mb[pid], memory_mb(pid)["VmRSS"])

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)


def token_request(num_tokens: int, max_tokens: int, seed: int = 0) -> pb.GenerateRequest:
    """A prompt of `num_tokens` token ids (the byte tokenizer's printable range), greedy."""
    ids = [32 + (i * 7 + seed) % 90 for i in range(num_tokens)]
    return pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def slope_mb_per_1000(samples: list[tuple[int, float]]) -> float:
    """Least-squares slope of (requests done, MiB) samples, MiB per 1,000 requests (0 with fewer than two)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((x - mx) ** 2 for x, _ in samples)
    return 1000 * sum((x - mx) * (y - my) for x, y in samples) / var if var else 0.0


def mixed_request(i: int, rng_seed: int = 0) -> pb.GenerateRequest:
    """Request `i` of a soak: prompts of 8..400 tokens (some sharing a prefix, so the prefix cache hits),
    1..24 tokens, greedy or sampled with a seed, some with logprobs or a stop string."""
    import random

    rng = random.Random(rng_seed * 1_000_003 + i)
    shared = [40 + j % 50 for j in range(64)] if rng.random() < 0.3 else []
    ids = shared + [32 + rng.randrange(90) for _ in range(rng.randrange(8, 400 - len(shared)))]
    sampling = pb.SamplingParams(max_tokens=rng.randrange(1, 25), ignore_eos=True)
    if rng.random() < 0.5:
        sampling.temperature, sampling.seed = 0.8, i
    if rng.random() < 0.2:
        sampling.logprobs = 3
    if rng.random() < 0.1:
        sampling.stop.append("zz")
    request_id = f"soak-{rng_seed}-{i}"
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling)
