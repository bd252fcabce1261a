"""The seeded workloads `qualify` drives, on the bench driver (it records every streamed message's time).

    chat    `clients` closed-loop clients serve `requests` prompts of lengths uniform in
            [prompt_len_min, prompt_len_max], `max_tokens` new tokens each (EOS ignored, greedy), or
            with `max_tokens_min` > 0 each chat's own count uniform in [max_tokens_min, max_tokens]
            (chats of one length finish together, so a closed loop sends the next ones in waves)
    convoy  the chats, plus `long_prompts` prompts of `long_prompt_len` tokens that arrive one every
            `long_interval_s` from `long_after_s` on (each on its own client), `long_max_tokens` new tokens

The same seed gives the same prompts, so two profiles see the same work."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hybridserve_cli.bench import driver
from hybridserve_cli.bench.driver import BenchRequest, GrpcBackend, LoadSpec, RequestOutcome
from hybridserve_cli.qualify.gates import RequestTrace

FIRST_ORDINARY_TOKEN_ID = 3  # ids 0-2 are pad, bos, eos


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str = "chat"  # chat | convoy
    requests: int = 64  # chat requests in all
    prompt_len_min: int = 16
    prompt_len_max: int = 256
    max_tokens: int = 64
    max_tokens_min: int = 0  # > 0: each chat's new tokens uniform in [max_tokens_min, max_tokens]
    long_prompts: int = 0  # convoy: long prompts arriving mid-run
    long_prompt_len: int = 6000
    long_max_tokens: int = 16
    long_after_s: float = 1.0  # the first long prompt arrives this long after the start
    long_interval_s: float = 0.5  # then one every this many seconds
    seed: int = 0
    timeout_s: float = 600.0  # per request

    def prompts(self, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
        """(chat prompts, long prompts): seeded token ids that avoid the special ids."""
        rng = random.Random(self.seed)
        hi = vocab_size - 1

        def prompt(n: int) -> list[int]:
            return [rng.randint(FIRST_ORDINARY_TOKEN_ID, hi) for _ in range(n)]

        chats = [prompt(rng.randint(self.prompt_len_min, self.prompt_len_max)) for _ in range(self.requests)]
        longs = [prompt(self.long_prompt_len) for _ in range(self.long_prompts if self.kind == "convoy" else 0)]
        return chats, longs

    def chat_max_tokens(self) -> list[int]:
        """Each chat's new tokens: max_tokens, or seeded uniform from max_tokens_min (an RNG of its own,
        so the prompts are the same either way)."""
        if self.max_tokens_min <= 0:
            return [self.max_tokens] * self.requests
        rng = random.Random(f"{self.seed}-max-tokens")
        return [rng.randint(self.max_tokens_min, self.max_tokens) for _ in range(self.requests)]


def trace_of(outcome: RequestOutcome) -> RequestTrace:
    """A driver outcome as the gates read it."""
    return RequestTrace(outcome.kind, outcome.ok, outcome.prompt_len, outcome.output_len if outcome.ok else 0,
                        outcome.start_s, outcome.chunk_times_s, outcome.chunk_tokens, outcome.end_s,
                        outcome.error)  # fmt: skip


def run_workload(address: str, workload: Workload, clients: int, vocab_size: int) -> tuple[list[RequestTrace], float]:
    """Runs the workload against the worker at `address` on the bench driver (the chats closed-loop
    over `clients` clients, each long prompt at its own time); returns every request's trace and the
    wall time from the first call to the last stream's end (seconds)."""
    chats, longs = workload.prompts(vocab_size)
    requests = [BenchRequest(len(p), n, prompt_ids=tuple(p), kind="chat")
                for p, n in zip(chats, workload.chat_max_tokens(), strict=True)]  # fmt: skip
    requests += [
        BenchRequest(len(p), workload.long_max_tokens, prompt_ids=tuple(p), kind="long",
                     arrival_s=workload.long_after_s + i * workload.long_interval_s)
        for i, p in enumerate(longs)
    ]  # fmt: skip
    record = driver.run(
        requests,
        lambda: GrpcBackend(address, timeout_s=workload.timeout_s, max_in_flight=clients + len(longs)),
        LoadSpec(clients=clients),
    )
    traces = [trace_of(o) for o in record.outcomes]
    return traces, max((t.end_s for t in traces), default=0.0)
