"""Turns what a client asked for into an engine Request, rejecting what can never be served.

The wire message is converted first (gpu_worker/convert.py); nothing here knows protobuf.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from gpu_worker.engine.request import GenerationParams, Request
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.engine.stop_checker import StopChecker
from gpu_worker.model.loader import LoadedModel
from gpu_worker.runner import ModelRunner
from gpu_worker.sampling import SamplingParams, make_generator
from hybridserve.errors import InvalidArgumentError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """A generation request as the client sent it, before validation."""

    request_id: str  # "" = the worker picks one
    prompt: str | None  # text, or None when prompt_token_ids is given
    prompt_token_ids: tuple[int, ...] | None  # None when prompt is given; both None = neither was set
    max_tokens: int  # 0 = the worker's default
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0  # 0 = off (1.0)
    seed: int | None = None
    logprobs: int = 0  # top alternatives per token
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: int = 0


def max_model_len(runner: ModelRunner, settings: EngineSettings) -> int:
    """Prompt plus generated tokens one request may reach: the flag, capped by what the KV pool
    can ever hold."""
    capacity = runner.kv_pool.num_pages * runner.kv_page_size_tokens
    return min(settings.max_model_len, capacity) if settings.max_model_len > 0 else capacity


def build_request(
    asked: GenerationInput, runner: ModelRunner, settings: EngineSettings, time_remaining_s: float | None
) -> Request:
    loaded = runner.loaded
    prompt = _prompt_ids(asked, loaded)
    params = _params(asked, settings)
    limit = max_model_len(runner, settings)
    if len(prompt) + params.max_tokens > limit:
        raise InvalidArgumentError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds this worker's"
            f" limit of {limit} tokens; shorten the prompt or lower max_tokens"
        )
    now = time.monotonic()
    return Request(
        request_id=asked.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        params=params,
        arrival_time=now,
        deadline=None if time_remaining_s is None else now + time_remaining_s,
        stop_checker=StopChecker(loaded.tokenizer, params.stop),
        generator=make_generator(params.sampling, runner.device),
    )


def _prompt_ids(asked: GenerationInput, loaded: LoadedModel) -> list[int]:
    if asked.prompt is not None:
        if loaded.tokenizer is None:
            raise InvalidArgumentError(
                "this model has no tokenizer.json; send prompt_token_ids instead of a text prompt"
            )
        ids = loaded.tokenizer.encode(asked.prompt)
    elif asked.prompt_token_ids is not None:
        ids = list(asked.prompt_token_ids)
        vocab = loaded.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgumentError(f"prompt_token_ids holds {bad}, outside the vocabulary [0, {vocab})")
    else:
        raise InvalidArgumentError("set either prompt (text) or prompt_token_ids")
    if not ids:
        raise InvalidArgumentError("the prompt is empty")
    return ids


def _params(s: GenerationInput, settings: EngineSettings) -> GenerationParams:
    if s.max_tokens < 0:
        raise InvalidArgumentError(f"sampling.max_tokens must be >= 0 (0 = default), got {s.max_tokens}")
    if not 0 <= s.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(f"sampling.logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {s.logprobs}")
    if any(not stop for stop in s.stop):
        raise InvalidArgumentError("sampling.stop holds an empty string")
    if s.temperature != s.temperature or s.top_p != s.top_p:  # NaN
        raise InvalidArgumentError("sampling.temperature and top_p must be numbers")
    try:
        sampling = SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=1.0 if s.top_p == 0 else s.top_p,
            seed=s.seed,
            num_logprobs=s.logprobs,
        )
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"sampling.{exc}") from None
    return GenerationParams(
        sampling=sampling,
        max_tokens=s.max_tokens or settings.default_max_tokens,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        priority=s.priority,
    )
