"""Client side of the Generation API, shared by `hybridserve generate`, `hybridserve bench` and the
serving benchmark: build a GenerateRequest, stream one completion while timing it, and turn a gRPC
error into a sentence a person can act on."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from hybridserve.v1 import generation_pb2, generation_pb2_grpc

DEFAULT_WORKER = "127.0.0.1:50052"


@dataclass(frozen=True, slots=True)
class WorkerTarget:
    """Which worker a client command talks to (`--worker`)."""

    worker: str = DEFAULT_WORKER  # host:port


@dataclass(slots=True)
class Completion:
    """One streamed completion and its timings (time.perf_counter seconds)."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the chosen token's, one per token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # token id -> logprob, one per token
    finish_reason: str = ""  # "length", "stop", "eos", "abort", "error" (finish_reason_name); "" = unfinished
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)  # when asked: each prompt token's after the first
    start_s: float = 0.0  # the call was made
    first_token_s: float | None = None  # the first message with tokens arrived
    last_token_s: float | None = None  # the last message with tokens arrived
    end_s: float = 0.0  # the stream ended
    first_message_tokens: int = 0  # tokens in the first message with tokens (a prefill may carry several)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency of the call, seconds."""
        return self.end_s - self.start_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, over the time from the first to the last token; None for one token."""
        if self.first_token_s is None or self.last_token_s is None:
            return None
        span_s = self.last_token_s - self.first_token_s
        decoded = len(self.token_ids) - self.first_message_tokens
        return decoded / span_s if decoded > 0 and span_s > 0 else None


def generation_stub(channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
    """The Generation stub on a channel (the generated constructor is untyped)."""
    return generation_pb2_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]


def build_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    logprobs: int = 0,
    request_id: str = "",
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    min_p: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
    prompt_logprobs: int | None = None,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt or a token-id prompt; sampling left None is left unset (the
    checkpoint's generation_config defaults, else greedy). `max_tokens` None: the worker's default; 0: no
    new tokens (with `prompt_logprobs=0`, a prompt's score)."""
    sampling = generation_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
        stop=list(stop), ignore_eos=ignore_eos, logprobs=logprobs, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, min_p=min_p,
        logit_bias=dict(logit_bias or {}), min_tokens=min_tokens, stop_token_ids=list(stop_token_ids),
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip
    if seed is not None:
        sampling.seed = seed
    request = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.ids.extend(prompt)
    return request


def stream_completion(
    stub: generation_pb2_grpc.GenerationStub,
    request: generation_pb2.GenerateRequest,
    timeout_s: float | None = None,
    on_message: Callable[[generation_pb2.GenerateResponse], None] | None = None,
) -> Completion:
    """Runs one Generate call to its end, calling on_message for each message; raises grpc.RpcError."""
    out = Completion(start_s=time.perf_counter())
    for message in stub.Generate(request, timeout=timeout_s):
        now = time.perf_counter()
        if message.token_ids:
            if out.first_token_s is None:
                out.first_token_s = now
                out.first_message_tokens = len(message.token_ids)
            out.last_token_s = now
        _absorb(out, message)
        if on_message is not None:
            on_message(message)
    out.end_s = time.perf_counter()
    if out.completion_tokens == 0:
        out.completion_tokens = len(out.token_ids)
    return out


def _absorb(out: Completion, message: generation_pb2.GenerateResponse) -> None:
    out.request_id = out.request_id or message.request_id
    out.text += message.text
    out.token_ids.extend(message.token_ids)
    out.logprobs.extend(message.logprobs)
    out.prompt_logprobs.extend(message.prompt_logprobs)
    for top in message.top_logprobs:
        out.top_logprobs.append(dict(zip(top.token_ids, top.logprobs, strict=False)))
    if message.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
        out.finish_reason = finish_reason_name(message.finish_reason)
    if message.HasField("usage"):
        out.prompt_tokens = message.usage.prompt_tokens
        out.cached_tokens = message.usage.cached_tokens
        out.completion_tokens = message.usage.completion_tokens


def finish_reason_name(reason: generation_pb2.FinishReason) -> str:
    """FINISH_REASON_LENGTH -> "length" (what the command line and JSON output show)."""
    return generation_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def describe_rpc_error(exc: grpc.RpcError, address: str) -> str:
    """One line saying what went wrong with a call to the worker at `address`, and what to do."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"no worker at {address}: is `hybridserve up` running? ({details})"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return f"the worker rejected the request: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the worker at {address} did not finish in time ({details})"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return f"the worker at {address} is out of capacity: {details}"
    if code == grpc.StatusCode.CANCELLED:
        return "the request was cancelled"
    name = code.name if code is not None else "error"
    return f"{name} from the worker at {address}: {details}"
