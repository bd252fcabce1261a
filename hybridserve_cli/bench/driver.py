"""The load driver: sends BenchRequests on a schedule through a backend and records every streamed
chunk's arrival.

Schedules (LoadSpec):
    open loop    --request-rate R: arrivals of a Poisson process (gamma intervals with shape
                 `burstiness`, mean 1/R, as vLLM bench serve draws them), seeded; R = inf sends all at
                 once. --max-concurrency caps the requests in flight (an arrival waits for a free slot).
    closed loop  --clients N: N clients, each sends its next request as soon as its last one ended.
    own clock    a request with `arrival_s` set (a trace's timestamps, a convoy's long prompts) is
                 sent at that offset from the start whatever the schedule of the others.

Backends speak OpenAI's streamed /v1/completions or /v1/chat/completions (aiohttp) or the gRPC
Generation API (blocking calls on a thread pool). Times are seconds from the run's origin (the
moment the first request could be sent)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import grpc
from tqdm import tqdm

from gpu_worker.api.client import build_request, describe_rpc_error, generation_stub
from hybridserve.client_security import ClientSecurity, open_client_channel


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send. Exactly one of prompt_ids, prompt_text, messages is set."""

    prompt_len: int  # prompt tokens, counted by the model's tokenizer (chat: the rendered template)
    output_len: int  # tokens to generate (max_tokens; EOS ignored unless the run says otherwise)
    prompt_ids: tuple[int, ...] | None = None  # a token-id prompt (/v1/completions, gRPC)
    prompt_text: str | None = None  # a text prompt (/v1/completions, gRPC)
    messages: tuple[dict[str, str], ...] | None = None  # chat messages (/v1/chat/completions)
    arrival_s: float | None = None  # sent at this offset from the start (trace replay); None: the schedule's
    kind: str = ""  # the workload's label for the request (qualify: "chat", "long")


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request as the client saw it; times in seconds from the run's origin."""

    ok: bool
    prompt_len: int  # the server's count (usage) when it sent one, else the request's
    output_len: int  # generated tokens (usage, else the streamed ones)
    cached_tokens: int  # prompt tokens the server served from its prefix cache (usage)
    start_s: float  # the request was sent
    chunk_times_s: tuple[float, ...]  # arrival of each streamed chunk that carried tokens
    chunk_tokens: tuple[int, ...]  # tokens in each of those chunks (1 per chunk where the API does not say)
    end_s: float  # the stream ended
    error: str = ""
    kind: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT): (e2el - ttft) / (output_len - 1)."""
        ttft = self.ttft_s
        if ttft is None or self.output_len < 2:
            return None
        return (self.e2el_s - ttft) / (self.output_len - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive token-carrying chunks (vLLM's ITL samples)."""
        t = self.chunk_times_s
        return [t[i] - t[i - 1] for i in range(1, len(t))]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """When requests are sent (see the module docstring)."""

    clients: int = 0  # > 0: closed loop with this many clients; 0: open loop
    request_rate: float = math.inf  # open loop: mean arrivals per second (inf: all at once)
    burstiness: float = 1.0  # gamma shape of the inter-arrival times (1: Poisson)
    max_concurrency: int = 0  # open loop: most requests in flight (0: no cap)
    seed: int = 0  # of the arrival times

    def __post_init__(self) -> None:
        if self.clients < 0 or self.max_concurrency < 0:
            raise ValueError("--clients and --max-concurrency must be >= 0")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")


def arrival_offsets(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start of each arrival: cumulative gamma(shape=burstiness, scale=1/(rate *
    burstiness)) intervals, so the mean rate is `rate` at any burstiness; the first arrives at 0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    offsets, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.gammavariate(burstiness, theta)
        offsets.append(now)
    return offsets


class Backend(Protocol):
    async def send(self, request: BenchRequest, origin: float) -> RequestOutcome: ...
    async def close(self) -> None: ...


@dataclass
class _Stream:
    """What one streamed request collected."""

    origin: float
    start_s: float = 0.0
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def chunk(self, num_tokens: int) -> None:
        self.times.append(time.perf_counter() - self.origin)
        self.counts.append(num_tokens)

    def outcome(self, request: BenchRequest, error: str = "") -> RequestOutcome:
        return RequestOutcome(
            ok=not error, prompt_len=self.prompt_tokens or request.prompt_len,
            output_len=self.completion_tokens or sum(self.counts), cached_tokens=self.cached_tokens,
            start_s=self.start_s, chunk_times_s=tuple(self.times), chunk_tokens=tuple(self.counts),
            end_s=time.perf_counter() - self.origin, error=error, kind=request.kind,
        )  # fmt: skip


class HttpBackend:
    """OpenAI's streamed completions over HTTP: `endpoint` "completions" or "chat"."""

    def __init__(self, base_url: str, model: str, endpoint: str = "completions", api_key: str | None = None,
                 ignore_eos: bool = True, temperature: float = 0.0, timeout_s: float = 600.0) -> None:  # fmt: skip
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"--endpoint must be completions or chat, got {endpoint!r}")
        self.url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
        self.endpoint, self.model, self.ignore_eos, self.temperature = endpoint, model, ignore_eos, temperature
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": request.output_len, "temperature": self.temperature,
            "ignore_eos": self.ignore_eos, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        if self.endpoint == "chat":
            if request.messages is None:
                raise ValueError("--endpoint chat needs a chat dataset (multiturn, sharegpt); this one sends prompts")
            body["messages"] = list(request.messages)
        elif request.messages is not None:
            raise ValueError("this dataset sends chat messages: use --endpoint chat")
        else:
            body["prompt"] = list(request.prompt_ids) if request.prompt_ids is not None else request.prompt_text
        return body

    async def send(self, request: BenchRequest, origin: float) -> RequestOutcome:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector, headers=self.headers)
        stream = _Stream(origin)
        body = self.body(request)
        stream.start_s = time.perf_counter() - origin
        try:
            async with self._session.post(self.url, json=body) as response:
                if response.status != 200:
                    return stream.outcome(request, f"HTTP {response.status}: {(await response.text())[:300]}")
                async for raw in response.content:
                    error = self._absorb(stream, raw)
                    if error is not None:
                        return stream.outcome(request, error or "")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return stream.outcome(request, f"{type(exc).__name__}: {exc}")
        return stream.outcome(request)

    def _absorb(self, stream: _Stream, raw: bytes) -> str | None:
        """One SSE line; returns "" at [DONE], an error message on an error event, else None."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return None
        data = line[5:].strip()
        if data == b"[DONE]":
            return ""
        chunk = json.loads(data)
        if "error" in chunk:
            return str(chunk["error"].get("message", chunk["error"]))
        if chunk.get("choices"):  # as vLLM bench serve counts: every chunk with a choice (a token may be no text)
            stream.chunk(1)
        usage = chunk.get("usage")
        if usage:
            stream.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            stream.completion_tokens = int(usage.get("completion_tokens") or 0)
            stream.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class GrpcBackend:
    """The gRPC Generation API (a worker, or the gateway's proxy): blocking streams on a thread pool."""

    def __init__(self, address: str, security: ClientSecurity | None = None, ignore_eos: bool = True,
                 temperature: float = 0.0, timeout_s: float = 600.0, max_in_flight: int = 256) -> None:  # fmt: skip
        self.address, self.ignore_eos, self.temperature, self.timeout_s = address, ignore_eos, temperature, timeout_s
        self._channels = [open_client_channel(address, security) for _ in range(min(8, max(1, max_in_flight)))]
        self._next = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_in_flight), thread_name_prefix="bench-grpc")

    def _call(self, request: BenchRequest, origin: float, channel: grpc.Channel) -> RequestOutcome:
        if request.messages is not None:
            return _Stream(origin).outcome(request, "the gRPC API takes prompts, not chat messages")
        prompt = request.prompt_ids if request.prompt_ids is not None else (request.prompt_text or "")
        message = build_request(prompt, max_tokens=request.output_len, ignore_eos=self.ignore_eos,
                                temperature=self.temperature)  # fmt: skip
        stream = _Stream(origin, start_s=time.perf_counter() - origin)
        try:
            for reply in generation_stub(channel).Generate(message, timeout=self.timeout_s):
                if reply.token_ids:
                    stream.chunk(len(reply.token_ids))
                if reply.HasField("usage"):
                    stream.prompt_tokens = reply.usage.prompt_tokens
                    stream.cached_tokens = reply.usage.cached_tokens
                    stream.completion_tokens = reply.usage.completion_tokens
        except grpc.RpcError as exc:
            return stream.outcome(request, describe_rpc_error(exc, self.address))
        return stream.outcome(request)

    async def send(self, request: BenchRequest, origin: float) -> RequestOutcome:
        channel = self._channels[self._next % len(self._channels)]
        self._next += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, request, origin, channel)

    async def close(self) -> None:
        for channel in self._channels:
            channel.close()  # cancels calls in flight
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class RunRecord:
    """A finished run: every request's outcome (in request order) and the wall time."""

    outcomes: tuple[RequestOutcome, ...]
    duration_s: float  # origin to the last stream's end


async def drive(
    requests: Sequence[BenchRequest], backend: Backend, load: LoadSpec, progress: bool = False
) -> RunRecord:
    """Sends every request once on `load`'s schedule; returns when the last one ended."""
    outcomes: list[RequestOutcome | None] = [None] * len(requests)
    bar = tqdm(total=len(requests), unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    origin = time.perf_counter()
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency and not load.clients else None

    async def one(index: int) -> None:
        if gate is not None:
            async with gate:
                outcomes[index] = await backend.send(requests[index], origin)
        else:
            outcomes[index] = await backend.send(requests[index], origin)
        bar.update(1)

    async def at(offset_s: float, index: int) -> None:
        delay = offset_s - (time.perf_counter() - origin)
        if delay > 0:
            await asyncio.sleep(delay)
        await one(index)

    timed = [i for i, r in enumerate(requests) if r.arrival_s is not None]
    scheduled = [i for i, r in enumerate(requests) if r.arrival_s is None]
    tasks: list[Awaitable[None]] = [at(requests[i].arrival_s or 0.0, i) for i in timed]
    if load.clients:
        queue = iter(scheduled)

        async def client() -> None:
            for index in queue:  # one shared iterator: each index goes to exactly one client
                await one(index)

        tasks += [client() for _ in range(load.clients)]
    else:
        offsets = arrival_offsets(len(scheduled), load.request_rate, load.burstiness, load.seed)
        tasks += [at(offset, i) for offset, i in zip(offsets, scheduled, strict=True)]
    try:
        await asyncio.gather(*tasks)
    finally:
        bar.close()
        await backend.close()
    done = [o for o in outcomes if o is not None]
    return RunRecord(tuple(done), max((o.end_s for o in done), default=0.0))


def run(requests: Sequence[BenchRequest], backend_factory: Callable[[], Backend], load: LoadSpec,
        progress: bool = False) -> RunRecord:  # fmt: skip
    """`drive` on a fresh event loop; the backend is built inside it (aiohttp sessions belong to one)."""

    async def main() -> RunRecord:
        return await drive(requests, backend_factory(), load, progress)

    return asyncio.run(main())
