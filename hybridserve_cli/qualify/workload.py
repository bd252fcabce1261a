"""The seeded workloads `qualify` drives, and the driver that records every streamed message's time.

    chat    `clients` closed-loop clients serve `requests` prompts of lengths uniform in
            [prompt_len_min, prompt_len_max], `max_tokens` new tokens each (EOS ignored, greedy), or
            with `max_tokens_min` > 0 each chat's own count uniform in [max_tokens_min, max_tokens]
            (chats of one length finish together, so a closed loop sends the next ones in waves)
    convoy  the chats, plus `long_prompts` prompts of `long_prompt_len` tokens that arrive one every
            `long_interval_s` from `long_after_s` on (each on its own client), `long_max_tokens` new tokens

The same seed gives the same prompts, so two profiles see the same work."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from gpu_worker.api.client import build_request, describe_rpc_error, generation_stub
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


def one_request(stub: object, prompt: list[int], max_tokens: int, kind: str, origin: float, timeout_s: float,
                address: str) -> RequestTrace:  # fmt: skip
    """Streams one greedy completion (EOS ignored), recording when each token-carrying message came."""
    request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter() - origin
    times: list[float] = []
    counts: list[int] = []
    completion = 0
    try:
        for message in stub.Generate(request, timeout=timeout_s):  # type: ignore[attr-defined]
            if message.token_ids:
                times.append(time.perf_counter() - origin)
                counts.append(len(message.token_ids))
            if message.HasField("usage"):
                completion = message.usage.completion_tokens
    except grpc.RpcError as exc:
        return RequestTrace(kind, False, len(prompt), 0, start, tuple(times), tuple(counts),
                            time.perf_counter() - origin, describe_rpc_error(exc, address))  # fmt: skip
    return RequestTrace(kind, True, len(prompt), completion or sum(counts), start, tuple(times), tuple(counts),
                        time.perf_counter() - origin)  # fmt: skip


def run_workload(address: str, workload: Workload, clients: int, vocab_size: int) -> tuple[list[RequestTrace], float]:
    """Runs the workload against the worker at `address`; returns every request's trace and the wall
    time from the first call to the last stream's end (seconds)."""
    chats, longs = workload.prompts(vocab_size)
    chat_tokens = workload.chat_max_tokens()
    traces: list[RequestTrace] = []
    lock = threading.Lock()
    next_chat = iter(range(len(chats)))
    channels = [grpc.insecure_channel(address) for _ in range(clients + len(longs))]
    origin = time.perf_counter()

    def record(trace: RequestTrace) -> None:
        with lock:
            traces.append(trace)

    def chat_client(channel: grpc.Channel) -> None:
        stub = generation_stub(channel)
        while True:
            with lock:
                index = next(next_chat, None)
            if index is None:
                return
            record(one_request(stub, chats[index], chat_tokens[index], "chat", origin, workload.timeout_s, address))

    def long_client(channel: grpc.Channel, index: int) -> None:
        delay = workload.long_after_s + index * workload.long_interval_s - (time.perf_counter() - origin)
        if delay > 0:
            time.sleep(delay)
        stub = generation_stub(channel)
        record(one_request(stub, longs[index], workload.long_max_tokens, "long", origin, workload.timeout_s, address))

    targets: list[tuple[Callable[..., None], tuple[object, ...]]] = [(chat_client, (c,)) for c in channels[:clients]]
    targets += [(long_client, (channels[clients + i], i)) for i in range(len(longs))]
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in targets]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for channel in channels:
            channel.close()
    return traces, max((t.end_s for t in traces), default=0.0)
